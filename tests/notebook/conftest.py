import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # nb_fakes


@pytest.fixture(autouse=True)
def _private_runtime_dir(tmp_path_factory, monkeypatch):
    """Session beacons write their heartbeat files here, not in the user's Jupyter runtime dir."""
    monkeypatch.setenv("MEGATRAIN_NB_RUNTIME_DIR", str(tmp_path_factory.getbasetemp() / "runtime"))


@pytest.fixture
def fake_session(tmp_path):
    """Build Sessions around FakeTrainers; every one is closed at the end of the test."""
    from megatrain_nb.notebook import Session
    from nb_fakes import CharTokenizer, FakeTrainer, close_sessions

    made = []

    def make(name=None, resume_from_checkpoint=None, **kw):
        kw.setdefault("output_dir", str(tmp_path / "out"))
        trainer = FakeTrainer(**kw)
        s = Session.from_trainer(trainer, tokenizer=CharTokenizer(), name=name,
                                 resume_from_checkpoint=resume_from_checkpoint)
        made.append(s)
        return s

    yield make
    close_sessions(made, timeout=10)


@pytest.fixture
def ip():
    """An IPython shell with ``%load_ext megatrain_nb`` (the magics' tests)."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "megatrain_nb")
    yield shell
    shell.run_line_magic("unload_ext", "megatrain_nb")

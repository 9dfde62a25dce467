"""Every notebook in notebooks/ executes end to end (nbclient, a real kernel, small sizes)."""
import os
import shutil
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:3] == ["01-quickstart.ipynb", "02-your-own-model.ipynb",
                                               "03-bigger-than-memory.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    work = tmp_path / "run"
    work.mkdir()
    client = NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(work)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, "\n".join("\n".join(e["traceback"]) for e in errors)
    # a run that ended leaves a static snapshot in the notebook, for when it is saved
    text = nbformat.writes(nb)
    if "session.train()" in text:
        assert "Static snapshot" in text
    shutil.rmtree(work, ignore_errors=True)

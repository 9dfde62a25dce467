import os
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# runs announce themselves (heartbeat files, trainer/control.py): into a folder of the test
# session's own, never the user's Jupyter runtime folder
os.environ.setdefault("MEGATRAIN_NB_RUNTIME_DIR", tempfile.mkdtemp(prefix="mtnb-test-runtime-"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_addoption(parser):
    parser.addoption("--adversarial-transport", action="store_true",
                     help="run every engine on a CPU device through the adversarial transport (copies late at "
                          "random, buffers NaN-filled at their release, reuse before release raises)")


def pytest_configure(config):
    if config.getoption("--adversarial-transport", default=False):
        from megatrain_nb.engine.transport import ADVERSARIAL_ENV

        os.environ[ADVERSARIAL_ENV] = "1"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# The fast subset is `python -m pytest -m "not slow"` (README, "Development"). Besides the tests
# marked `slow` in their own files, whole kinds of test are slow by nature and marked here, in
# one place: everything that starts ranks under torchrun or gloo (tests/distributed/) and every
# browser test.
SLOW_FOLDERS = ("distributed",)


def _mark_slow_kinds(items):
    for item in items:
        folder = item.path.parent.name
        if folder in SLOW_FOLDERS or item.get_closest_marker("browser"):
            item.add_marker(pytest.mark.slow)


def pytest_collection_modifyitems(config, items):
    """Marks the slow kinds; without chromium (or playwright) the browser tests are left out,
    with one line saying why."""
    _mark_slow_kinds(items)
    from tests.browser import missing

    browser = [item for item in items if item.get_closest_marker("browser")]
    why = missing() if browser else None
    if why:
        items[:] = [item for item in items if not item.get_closest_marker("browser")]
        config.hook.pytest_deselected(items=browser)
        config._megatrain_browser_note = f"browser tests skipped ({len(browser)}): {why}"


def pytest_terminal_summary(terminalreporter, config):
    note = getattr(config, "_megatrain_browser_note", None)
    if note:
        terminalreporter.write_line(note, yellow=True)

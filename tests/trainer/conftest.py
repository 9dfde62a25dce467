import pytest


@pytest.fixture(autouse=True)
def _clean_defaults():
    """mt.init sets process-wide defaults: never let one test's leak into the next."""
    from megatrain_nb.trainer import defaults

    defaults._DEFAULTS.clear()
    yield
    defaults._DEFAULTS.clear()


@pytest.fixture
def small_cache(tmp_path, monkeypatch):
    """An empty built-in-default cache for this test."""
    root = tmp_path / "cache"
    monkeypatch.setenv("MEGATRAIN_NB_CACHE", str(root))
    return root

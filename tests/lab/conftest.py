import pytest


@pytest.fixture
def runtime_root(tmp_path, monkeypatch):
    """An isolated megatrain_nb runtime folder (what $MEGATRAIN_NB_RUNTIME_DIR points at)."""
    root = tmp_path / "runtime" / "megatrain_nb"
    monkeypatch.setenv("MEGATRAIN_NB_RUNTIME_DIR", str(root))
    return root


def wait_for(predicate, timeout=3.0, interval=0.01):
    """Poll ``predicate`` until truthy; returns (value, seconds waited) or fails the test."""
    import time

    t0 = time.monotonic()
    while True:
        v = predicate()
        if v:
            return v, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(interval)

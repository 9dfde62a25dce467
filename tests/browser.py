"""What the browser tests need, checked in one place. Without it the conftest leaves every
browser test out and says why in one line of the summary (not one SKIPPED line per test)."""
import importlib.util
import os
import shutil
from pathlib import Path
from typing import Optional

import pytest

CHROMIUM = os.environ.get("MEGATRAIN_NB_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def missing() -> Optional[str]:
    """Why the browser tests cannot run here (None when they can)."""
    if not Path(CHROMIUM).exists():
        return (f"chromium not found at {CHROMIUM} (as root: apt-get install -y chromium; or set "
                "MEGATRAIN_NB_CHROMIUM to a chromium binary)")
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (pip install -e '.[test]')"
    return None


def require_browser() -> None:
    why = missing()
    if why:
        pytest.skip(f"browser tests: {why}")

"""What the browser tests need, checked in one place. Without it the conftest leaves every
browser test out and says why in one line of the summary (not one SKIPPED line per test)."""
import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("MEGATRAIN_NB_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def launch_chromium(playwright):
    """Debian's headless chromium for a ``sync_playwright()`` session (never the test tool's own
    browser download)."""
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


def open_and_run_all(page, lab: dict, notebook: str) -> None:
    """Open ``notebook`` (a path under the lab's root) in JupyterLab, accept the "Select Kernel"
    dialog if it shows, and run all of its cells from the Run menu."""
    import re

    from playwright.sync_api import expect

    page.goto(f"{lab['url']}/lab/tree/{notebook}?token={lab['token']}&reset")
    expect(page.locator(".jp-Notebook").first).to_be_visible(timeout=60_000)
    try:
        page.locator(".jp-Dialog .jp-mod-accept").click(timeout=3_000)
    except Exception:  # noqa: BLE001 - no dialog: the kernel starts by itself
        pass
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_lab(base: Path, root: Path) -> Iterator[dict]:
    """A JupyterLab server on 127.0.0.1 serving ``root``, its config, runtime and settings under
    ``base`` (the announcements popup off); yields ``{"url", "token", "log"}``, and stops the
    server and its kernels afterwards."""
    config = base / "config" / "labconfig"
    config.mkdir(parents=True)
    (config / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(base / "config"), "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(base / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(base / "ws"),
           "IPYTHONDIR": str(base / "ipython"), "MEGATRAIN_NB_RUNTIME_DIR": str(base / "mtnb"),
           "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    # a sidebar build to test without installing it (a folder holding megatrain-nb-lab/): found
    # there first, it is the one JupyterLab loads
    if os.environ.get("MEGATRAIN_NB_LABEXTENSIONS"):
        cmd.append(f"--LabApp.extra_labextensions_path={os.environ['MEGATRAIN_NB_LABEXTENSIONS']}")
    log = base / "jupyterlab.log"
    proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"jupyter lab did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield {"url": url, "token": token, "log": log}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its kernels (its own session)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)

"""The dashboard in a real JupyterLab, driven in Debian's chromium by Playwright.

    pytest -m browser tests/notebook/test_dashboard_browser.py

It renders (both plotly FigureWidgets), the render probe retires the HTML fallback, the
dashboard's own buttons and learning-rate field steer the run through the kernel, and the
run's end leaves the static snapshot. Screenshots go to ``test-artifacts/``.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ARTIFACTS = REPO / "test-artifacts"
from tests.browser import CHROMIUM  # noqa: E402

CELLS = [
    f"""import sys
sys.path.insert(0, {str(HERE)!r})
from nb_fakes import CharTokenizer, FakeTrainer
from megatrain_nb.notebook import Session
session = Session.from_trainer(FakeTrainer(total_steps=100_000, step_time=0.02, lr=1e-3, eval_every=25,
                                           output_dir="out"), tokenizer=CharTokenizer(), name="browser-run")""",
    "session.train()",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    from tests.browser import require_browser

    require_browser()
    base = tmp_path_factory.mktemp("dashboard-e2e")
    root = base / "work"
    root.mkdir()
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": c, "outputs": [], "execution_count": None}
                    for c in CELLS],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    (root / "dashboard.ipynb").write_text(json.dumps(nb))
    config = base / "config" / "labconfig"
    config.mkdir(parents=True)
    (config / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(base / "config"), "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(base / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(base / "ws"),
           "IPYTHONDIR": str(base / "ipython"), "MEGATRAIN_NB_RUNTIME_DIR": str(base / "mtnb"),
           "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
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


def test_dashboard_renders_and_steers_the_run(lab):
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        page = browser.new_page(viewport={"width": 1500, "height": 1400})
        try:
            page.goto(f"{lab['url']}/lab/tree/dashboard.ipynb?token={lab['token']}&reset")
            expect(page.locator(".jp-Notebook").first).to_be_visible(timeout=60_000)
            try:
                page.locator(".jp-Dialog .jp-mod-accept").click(timeout=3_000)  # "Select Kernel", if asked
            except Exception:  # noqa: BLE001
                pass
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()

            out = page.locator(".jp-Notebook .jp-OutputArea-output")
            expect(out.locator(".js-plotly-plot")).to_have_count(2, timeout=120_000)
            state = out.locator(".mtnb-dashboard-state").first
            expect(state).to_have_text("running", timeout=60_000)
            # the frontend rendered widgets, so the live HTML fallback is retired
            expect(out.locator(".megatrain-summary")).to_have_count(0, timeout=30_000)

            # the dashboard's own controls, through the kernel
            out.locator(".widget-button", has_text="Pause").click()
            expect(state).to_have_text("paused", timeout=30_000)
            expect(out.locator(".widget-button", has_text="Resume")).to_be_visible(timeout=10_000)
            field = out.locator(".widget-text input").first
            field.fill("0.0005")
            field.press("Enter")
            expect(out.locator(".widget-html", has_text="Learning rate 0.0005")).to_be_visible(timeout=15_000)
            expect(out.locator(".js-plotly-plot text", has_text="lr 0.001→0.0005")).to_have_count(1, timeout=15_000)
            out.locator(".widget-button", has_text="Resume").click()
            expect(state).to_have_text("running", timeout=30_000)
            expect(out.locator(".widget-html", has_text=re.compile(r"lr 0\.0005"))).to_be_visible(timeout=15_000)
            page.screenshot(path=str(ARTIFACTS / "dashboard-e2e-running.png"), full_page=True)

            out.locator(".widget-button", has_text="Stop").click()
            expect(state).to_have_text("stopped", timeout=30_000)
            # the run's end leaves a static snapshot (what a saved notebook shows)
            expect(out.locator(".megatrain-summary", has_text="Static snapshot")).to_be_visible(timeout=30_000)
            page.screenshot(path=str(ARTIFACTS / "dashboard-e2e-stopped.png"), full_page=True)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "dashboard-e2e-failure.png"), full_page=True)
            shutil.copy(lab["log"], ARTIFACTS / "dashboard-e2e-jupyterlab.log")
            raise
        finally:
            browser.close()

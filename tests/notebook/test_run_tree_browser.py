"""The run tree in a browser (Debian's chromium, Playwright): the dashboard's branches panel in
a real JupyterLab (the dashboard's own chart, kind "panels": it must render there, with every
branch, its line saying what changed, and the fork point), and the exported HTML report's tree
(the same chart module, inlined), opened offline.

    pytest -m browser tests/notebook/test_run_tree_browser.py

A real Session (the micro model on CPU) trains 6 steps with a snapshot every 2, forks at step 2
with another learning rate and trains the fork. Screenshots go to ``test-artifacts/``.
"""
from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from test_dashboard_browser import ARTIFACTS
from tests.browser import launch_chromium, open_and_run_all, running_lab

pytestmark = pytest.mark.browser

HERE = Path(__file__).resolve().parent
BUILD = """import numpy as np, datasets, torch
from transformers import AutoModelForCausalLM, TrainingArguments
from megatrain_nb.notebook import Session
from megatrain_nb.model_configs import preset_config
torch.manual_seed(0)
ds = datasets.Dataset.from_dict({{"input_ids": np.random.default_rng(0).integers(0, 512, size=(48, 16)).tolist()}})
args = TrainingArguments(output_dir={out!r}, max_steps=6, per_device_train_batch_size=2, learning_rate=3e-3,
                         logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True)
s = Session(AutoModelForCausalLM.from_config(preset_config("micro")), train_dataset=ds, args=args, name="main",
            snapshot_steps=2)
s.train(block=True)
low = s.fork(step=2, name="low", learning_rate=1e-4)
low.train(block=True)"""
FORK_LABEL = "low (from step 2): learning_rate=0.0001"

# every run-tree chart on the page: its legend, fork diamonds (their x in the tooltip) and lines drawn
FIGURES = """() => Array.from(document.querySelectorAll('.mtnb-chart-root')).filter(r => r.querySelector('.mtnb-panels'))
  .map(r => ({legend: Array.from(r.querySelectorAll('.mtnb-chart-legend-item')).map(n => n.textContent),
              forks: Array.from(r.querySelectorAll('.mtnb-fork title')).map(n => n.textContent),
              drawn: r.querySelectorAll('.mtnb-series').length}))"""


def _check_tree(figures):
    assert figures, "no run-tree chart on the page"
    fig = figures[-1]
    assert "main" in fig["legend"] and FORK_LABEL in fig["legend"], fig["legend"]
    assert any("(step 2)" in t for t in fig["forks"]), fig["forks"]   # the fork point
    assert fig["drawn"] >= 4   # the branches' lines (loss and lr of both, at least)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    from tests.browser import require_browser

    require_browser()
    base = tmp_path_factory.mktemp("run-tree-e2e")
    root = base / "work"
    root.mkdir()
    cells = [BUILD.format(out=str(root / "out")), "s.dashboard()"]
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": c, "outputs": [], "execution_count": None}
                    for c in cells],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    (root / "tree.ipynb").write_text(json.dumps(nb))
    with running_lab(base, root) as lab_server:
        yield lab_server


def test_the_dashboards_branches_panel_draws_the_tree_in_jupyterlab(lab):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = launch_chromium(p)
        page = browser.new_page(viewport={"width": 1500, "height": 1600})
        try:
            open_and_run_all(page, lab, "tree.ipynb")
            out = page.locator(".jp-Notebook .jp-OutputArea-output")
            # the branches panel, below the dashboard's other figures (scrolled to: JupyterLab
            # may leave output it does not show undrawn)
            deadline, figures = time.monotonic() + 240, []
            while time.monotonic() < deadline:
                charts = out.locator(".mtnb-panels")
                if charts.count():
                    charts.last.scroll_into_view_if_needed(timeout=10_000)
                figures = page.evaluate(FIGURES)
                if any(f["drawn"] >= 4 and FORK_LABEL in f["legend"] for f in figures):
                    break
                page.wait_for_timeout(2_000)
            _check_tree(figures)
            page.screenshot(path=str(ARTIFACTS / "run-tree-dashboard.png"), full_page=True)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "run-tree-dashboard-failure.png"), full_page=True)
            shutil.copy(lab["log"], ARTIFACTS / "run-tree-jupyterlab.log")
            raise
        finally:
            browser.close()


def test_the_exported_reports_tree_renders_offline(tmp_path):
    from tests.browser import require_browser

    require_browser()
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    scope: dict = {}
    exec(BUILD.format(out=str(tmp_path / "out")), scope)   # the same run, in this process
    s, low = scope["s"], scope["low"]
    try:
        page_path = s.export_report(str(tmp_path / "report.html"))
    finally:
        low.close()
        s.close()
    with sync_playwright() as p:
        browser = launch_chromium(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1400})
        errors, requests = [], []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        try:
            page.goto(f"file://{page_path}", wait_until="load", timeout=60_000)
            page.wait_for_function("() => document.querySelectorAll('.mtnb-panels .mtnb-series').length >= 4",
                                   timeout=60_000)
            _check_tree(page.evaluate(FIGURES))
            page.screenshot(path=str(ARTIFACTS / "run-tree-report.png"), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert not [u for u in requests if not u.startswith(("file:", "data:", "blob:", "about:"))]   # offline

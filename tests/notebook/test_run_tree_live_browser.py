"""The dashboard's Branches chart in a real JupyterLab (Debian's chromium): rewound to 25,
trained to the end, then forked at 25, it draws every run (the abandoned steps, the
continuation, the fork) over the whole step range (issue 36: the plotly figure stayed at
x 0-71 and missed the fork).

    pytest -m browser tests/notebook/test_run_tree_live_browser.py
"""
import json
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"

CELLS = [
    """import numpy as np, datasets, torch
from transformers import AutoModelForCausalLM, TrainingArguments
from megatrain_nb.notebook import Session
from megatrain_nb.model_configs import preset_config
torch.manual_seed(0)
ds = datasets.Dataset.from_dict({"input_ids": np.random.default_rng(0).integers(0, 512, size=(64, 16)).tolist()})
args = TrainingArguments(output_dir="out", max_steps=60, per_device_train_batch_size=2, learning_rate=3e-3,
                         lr_scheduler_type="constant", logging_steps=1, report_to="none", save_strategy="no",
                         disable_tqdm=True, use_cpu=True)
s = Session(AutoModelForCausalLM.from_config(preset_config("micro")), train_dataset=ds, args=args, name="main",
            snapshot_steps=5)
s.train()""",
    "s.wait(); s.rewind(25); s.train(); s.wait()",
    "low = s.fork(step=25, name='low-lr', learning_rate=1e-4); low.train(); low.wait(); print('forked')",
]


def test_the_branches_chart_follows_rewinds_and_forks(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    from tests.browser import launch_chromium, open_and_run_all, require_browser, running_lab

    require_browser()
    root = tmp_path / "work"
    root.mkdir()
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": c, "outputs": [], "execution_count": None}
                    for c in CELLS],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    (root / "tree.ipynb").write_text(json.dumps(nb))
    ARTIFACTS.mkdir(exist_ok=True)
    with running_lab(tmp_path, root) as lab, sync_playwright() as p:
        browser = launch_chromium(p)
        page = browser.new_page(viewport={"width": 1600, "height": 1400})
        try:
            open_and_run_all(page, lab, "tree.ipynb")
            out = page.locator(".jp-Notebook .jp-OutputArea-output")
            expect(out.filter(has_text="forked")).to_have_count(1, timeout=240_000)
            # main's dashboard (the first output; every display of it shows one widget): the fork
            # trained after main had finished, and main's tree shows it
            legend = out.locator(".mtnb-panels").first.locator("xpath=..").locator(".mtnb-chart-legend-item")
            expect(legend.filter(has_text="low-lr (from step 25)")).to_have_count(1, timeout=20_000)
            names = legend.all_inner_texts()
            assert any("abandoned" in n for n in names) and any(n.startswith("main") for n in names), names
            loss = out.locator(".mtnb-panel").first
            expect(loss.locator(".mtnb-fork")).to_have_count(2, timeout=10_000)   # the rewind and the fork
            ticks = [int(t.replace("k", "000")) for t in loss.locator(".mtnb-chart-xtick").all_text_contents()]
            assert max(ticks) >= 55, ticks   # the whole range, not where the figure was first drawn
            # the dashboard does not scroll sideways at 1600 px
            wide = page.evaluate("""() => [...document.querySelectorAll('.mtnb-dashboard')].map(
                d => d.scrollWidth - d.clientWidth)""")
            over = page.evaluate("""() => { const d = document.querySelector('.mtnb-dashboard');
                const r = d.getBoundingClientRect().right; return [...d.querySelectorAll('*')]
                .filter(e => e.getBoundingClientRect().right > r + 1).slice(0, 5)
                .map(e => e.tagName + '.' + (e.getAttribute('class') || '') + ' ' + (e.getBoundingClientRect().right - r)); }""")
            assert all(w <= 1 for w in wide), (wide, over)
            page.screenshot(path=str(ARTIFACTS / "run-tree-live.png"), full_page=True)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "run-tree-live-failure.png"), full_page=True)
            shutil.copy(lab["log"], ARTIFACTS / "run-tree-live-jupyterlab.log")
            raise
        finally:
            browser.close()

"""What a dashboard weighs in a saved notebook.

plotly's FigureWidget put its ~5 MB JavaScript bundle into the widget state of each figure,
so a saved quickstart notebook weighed ~10 MB. The dashboard's charts are our own small
module now: a saved quickstart notebook (dashboard, widget state and all) stays under 1 MB
and still carries the run (the charts' data in the widget state, the static snapshot).
"""
import json
import os
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "notebooks" / "01-quickstart.ipynb"


def test_the_widget_state_of_a_dashboard_is_small(fake_session):
    from ipywidgets.embed import dependency_state

    s = fake_session(total_steps=600, eval_every=50)
    s.train(block=True)
    d = s.dashboard()  # ended run: filled once
    state = dependency_state([d])  # the dashboard and every widget it holds, as a notebook saves them
    size = len(json.dumps(state))
    charts = [w["state"] for w in state.values() if "spec" in w["state"]]
    assert len(charts) == 2 and any(len(c["spec"].get("loss", {}).get("x", [])) > 100 for c in charts)
    # everything of the dashboard: ~35 widgets, two chart modules, 400 loss points, the heatmap
    assert size < 200_000, size


@pytest.mark.slow
def test_a_saved_quickstart_notebook_weighs_under_a_megabyte_and_still_shows_the_run(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(QUICKSTART, as_version=4)
    work = tmp_path / "run"
    work.mkdir()
    # widget state saved with the notebook, as JupyterLab's "save widget state" does
    NotebookClient(nb, timeout=300, kernel_name="python3", store_widget_state=True,
                   resources={"metadata": {"path": str(work)}}).execute()
    out = tmp_path / "quickstart-saved.ipynb"
    nbformat.write(nb, out)
    size = out.stat().st_size
    text = out.read_text()
    print(f"saved quickstart notebook: {size / 1e6:.3f} MB")
    assert size <= 1_000_000, size
    # reopened without a kernel it still shows the run: the static snapshot (plain HTML) ...
    assert "Static snapshot" in text and "finished" in text
    # ... and the dashboard's charts with their data, from the saved widget state
    widgets = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    specs = [w["state"]["spec"] for w in widgets.values() if "spec" in w.get("state", {})]
    training = [sp for sp in specs if sp.get("kind") == "training"]
    assert training and training[-1]["step"] == 200 and len(training[-1]["loss"]["x"]) > 10
    assert "plotly.js" not in text and "widgetbundle" not in text

"""What a dashboard weighs in a saved notebook.

plotly's FigureWidget put its ~5 MB JavaScript bundle into the widget state of each figure,
so a saved quickstart notebook weighed ~10 MB. The dashboard's charts are our own small
module now: a saved quickstart notebook (dashboard, widget state and all) stays under 1 MB
and still carries the run (the charts' data in the widget state, the static snapshot): checked
on the executed quickstart in test_notebooks.py (``_check_saved_quickstart``).
"""
import json


def test_the_widget_state_of_a_dashboard_is_small(fake_session):
    from ipywidgets.embed import dependency_state

    s = fake_session(total_steps=600, eval_every=50)
    s.train(block=True)
    d = s.dashboard()  # ended run: filled once
    state = dependency_state([d])  # the dashboard and every widget it holds, as a notebook saves them
    size = len(json.dumps(state))
    charts = [w["state"] for w in state.values() if "spec" in w["state"]]
    # the training and layer charts; the Branches chart is there, empty, until the run has branches
    assert len(charts) == 3 and len([c for c in charts if c["spec"]]) == 2 and any(len(c["spec"].get("loss", {}).get("x", [])) > 100 for c in charts)
    # everything of the dashboard: ~35 widgets, two chart modules, 400 loss points, the heatmap
    assert size < 200_000, size

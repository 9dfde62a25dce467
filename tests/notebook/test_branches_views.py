"""The run tree where it is shown: mt.compare, the %megatrain magics, the dashboard panel and
the exported report."""
import json

import pytest

from test_branches import make  # noqa: F401 - the fixture


@pytest.fixture
def tree(make):  # noqa: F811
    s = make(snapshot_steps=2, name="main")
    s.train(block=True)
    b = s.fork(step=2, name="low", learning_rate=1e-4)
    b.train(block=True)
    return s, b


def test_compare_tables_what_differs_and_draws_both(tree):
    import megatrain_nb as mt

    s, b = tree
    cmp = mt.compare(s, b)
    rows = {r["branch"]: r for r in cmp.rows}
    assert rows["low"]["forked_from"] == "main" and rows["low"]["forked_at_step"] == 2
    assert rows["main"]["learning_rate"] == 3e-3 and rows["low"]["learning_rate"] == 1e-4
    assert "max_grad_norm" not in rows["main"]   # the same in both: not a column
    assert rows["main"]["steps"] == 6 and rows["main"]["best_loss"] <= rows["main"]["final_loss"]
    assert list(cmp.table.index) == ["main", "low"]
    names = {t.name for t in cmp.figure.data if t.name}
    assert "main" in names and "low (from step 2): learning_rate=0.0001" in names
    assert any(t.marker.symbol == "diamond" and list(t.x) == [2] for t in cmp.figure.data)
    assert "<table>" in cmp._repr_html_()
    with pytest.raises(TypeError, match="takes Sessions"):
        mt.compare(s, "low")


def test_magics_snapshot_rewind_fork_branches(tree, capsys):
    from megatrain_nb.notebook.magics import megatrain

    s, b = tree
    megatrain("snapshot -s main")
    assert "main: snapshot at step 6" in capsys.readouterr().out
    megatrain("rewind 3 -s main")
    assert "no snapshot at step 3" in capsys.readouterr().out and s.step == 6
    megatrain("rewind 4 -s main")
    assert "main: back at step 4 (idle)" in capsys.readouterr().out and s.step == 4
    got = megatrain("fork learning_rate=5e-4 name=mid step=2 -s main")
    assert got.name == "mid" and "branch 'mid' forked at step 2" in capsys.readouterr().out
    megatrain("fork precision=bf16 -s main")
    assert "cannot change precision" in capsys.readouterr().out
    megatrain("branches -s main")
    out = capsys.readouterr().out
    assert "low [" in out and "learning_rate=0.0001" in out and "main (abandoned after step 4)" in out
    assert "snapshots: 2 (" in out
    got.close()


def test_dashboard_shows_the_tree_once_there_are_branches(tree):
    from megatrain_nb.notebook.dashboard import Dashboard

    s, b = tree
    d = Dashboard(s)
    d.refresh(force=True)
    assert d.branches.box.layout.display == ""
    spec = d.branches.chart.spec
    names = {item["name"] for item in spec["legend"]}
    assert {"main", "low (from step 2): learning_rate=0.0001"} <= names
    assert spec["kind"] == "panels" and [q["x"] for q in spec["panels"][0]["points"]] == [2]


def test_the_dashboards_tree_follows_the_run_with_the_other_panels(tree):
    """Issue 36: rewound and trained on, then forked, the Branches figure kept its old x range
    and missed the fork. The chart's spec is rebuilt with the data panels' refresh."""
    from megatrain_nb.notebook.dashboard import Dashboard

    s, b = tree
    d = Dashboard(s)
    d.refresh(force=True)
    s.rewind(4)
    s.train(block=True)
    late = s.fork(step=4, name="late", learning_rate=5e-4)
    late.train(block=True)
    d.refresh(force=True)
    spec = d.branches.chart.spec
    loss = spec["panels"][0]
    assert max(x for series in loss["series"] for x in series["x"]) == 6
    assert any(item["name"].startswith("late (from step 4)") for item in spec["legend"]), spec["legend"]
    # the fork from the abandoned path is drawn on the abandoned curve, not on the continuation
    abandoned = next(r for r in s.explorer.tree() if "abandoned" in r["name"])
    at4 = next(r["loss"] for r in abandoned["records"] if r["step"] == 2)
    low = next(q for q in loss["points"] if q["x"] == 2)
    assert abs(low["y"] - at4) < 1e-6
    late.close()


def test_report_exports_the_tree(tree, tmp_path):
    s, b = tree
    path = s.export_report(str(tmp_path / "r.ipynb"))
    nb = json.loads(open(path).read())
    text = json.dumps(nb)
    assert "## Branches" in text and "low (from step 2)" in text and "forked at step" in text


def test_the_sidebar_rows_nest_forks_and_rewinds_under_their_run(tree, tmp_path, monkeypatch):
    from megatrain_nb.channel.beacon import SessionBeacon
    from megatrain_nb.channel.registry import list_sessions

    s, b = tree
    idle = s.fork(step=4, name="later", max_grad_norm=0.1)   # not started: no run id yet
    rows = {r["name"]: r for r in s.explorer.sidebar_rows()}
    assert set(rows) == {"main", "low", "later"}
    main = rows["main"]
    assert main["parent_run_id"] is None and main["state"] == "finished" and main["step"] == 6
    assert main["current"] and not rows["low"]["current"]
    assert (rows["low"]["parent_run_id"], rows["low"]["forked_at_step"], rows["low"]["state"]) == \
        (main["run_id"], 2, "finished")
    assert rows["low"]["changes"] == "learning_rate=0.0001" and rows["low"]["loss"] == b.history[-1]["loss"]
    assert (rows["later"]["run_id"], rows["later"]["parent_run_id"], rows["later"]["forked_at_step"]) == \
        (None, main["run_id"], 4)
    assert rows["later"]["state"] == "idle"
    s.rewind(4)   # the steps after 4 stay as a branch of their own, abandoned, once it trains again
    s.train(block=True)
    rows = s.explorer.sidebar_rows()
    gone = [r for r in rows if r["state"] == "abandoned"]
    assert len(gone) == 1 and gone[0]["run_id"] == main["run_id"] and gone[0]["step"] == 6
    now = next(r for r in rows if r["current"])
    assert now["parent_run_id"] == main["run_id"] and now["forked_at_step"] == 4
    # what the sidebar reads: the session's heartbeat
    monkeypatch.setenv("MEGATRAIN_NB_RUNTIME_DIR", str(tmp_path / "rt"))
    beacon = SessionBeacon(s, root=tmp_path / "rt").start()
    try:
        [hb] = list_sessions(tmp_path / "rt")
        assert {r["name"] for r in hb["branches"]} >= {"low", "later"} and len(hb["branches"]) == len(rows)
    finally:
        beacon.stop()
    idle.close()


def test_compare_names_every_parent_and_says_why_a_panel_is_empty(tree):
    """Issue 36: forked_from mixed raw run ids with branch names; the eval panel was blank."""
    import megatrain_nb as mt

    s, b = tree
    s.rewind(4)
    s.train(block=True)   # main goes on as a new run; the one "low" forked from is now abandoned
    rows = {r["branch"]: r for r in mt.compare(s, b).rows}
    assert rows["low"]["forked_from"] == "main (abandoned after step 4)"
    notes = [a.text for a in mt.compare(s, b).figure.layout.annotations]
    assert "no eval loss logged (no eval set)" in notes


def test_a_finished_runs_dashboard_shows_a_fork_trained_later(tree):
    """Issue 36: the Branches figure of a run that had finished never showed its later forks."""
    import ipywidgets  # noqa: F401

    s, b = tree
    d = s.dashboard()   # finished: refreshed once, nothing keeps it live
    later = s.fork(step=4, name="later", learning_rate=2e-4)
    later.dashboard()   # the fork's own dashboard, refreshed as it trains
    later.train(dashboard=False, block=True)
    later.dashboard()   # (refreshes it once more: the run ended)
    assert any(item["name"].startswith("later (from step 4)") for item in d.branches.chart.spec["legend"])
    later.close()

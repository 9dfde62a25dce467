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
    names = {t.name for t in d.branches.fig.data if t.name}
    assert {"main", "low (from step 2): learning_rate=0.0001"} <= names


def test_report_exports_the_tree(tree, tmp_path):
    s, b = tree
    path = s.export_report(str(tmp_path / "r.ipynb"))
    nb = json.loads(open(path).read())
    text = json.dumps(nb)
    assert "## Branches" in text and "low (from step 2)" in text and "forked at step" in text

"""The run tree lives in the runs' records, not in Session objects: dropping a fork's Session (a
notebook cell run again) keeps its runs in the tree; a finished parent's weights are its own."""
import gc

import torch

from test_branches import _weights, make  # noqa: F401 - the fixture


def test_dropping_a_forks_session_keeps_the_tree_whole(make, tmp_path):  # noqa: F811
    s = make(snapshot_steps=2, max_steps=4, name="main")
    s.train(block=True)
    b = s.fork(step=2, name="a", learning_rate=1e-4)
    b.train(block=True)
    a_run = b.trainer.run_id
    b = s.fork(step=2, name="b", learning_rate=2e-4)   # the cell run again: "a"'s Session is dropped
    gc.collect()
    c = s.fork(step=2, name="c", learning_rate=3e-4)
    assert {"main", "a", "b", "c"} <= s.explorer.taken_names()
    tree = {n["run_id"]: n for n in s.explorer.tree()}
    assert a_run in tree and [r["step"] for r in tree[a_run]["records"]] == [3, 4]
    assert s.explorer.sidebar_rows()
    assert c.explorer.all_snapshots()
    from megatrain_nb.notebook.report import export_report

    export_report(s, str(tmp_path / "r.html"))
    assert (tmp_path / "r.html").stat().st_size > 0
    del b

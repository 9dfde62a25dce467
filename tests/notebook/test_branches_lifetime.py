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


def test_a_finished_parent_reads_its_own_weights_after_its_fork_trained(make, tmp_path, capsys):  # noqa: F811
    from transformers import AutoModelForCausalLM

    s = make(snapshot_steps=2, max_steps=4, name="main")
    s.train(block=True)
    mine = _weights(s)
    b = s.fork(step=2, name="b", learning_rate=1e-4)
    b.train(block=True)
    said = capsys.readouterr().out
    assert "main.resume() switches back" not in said and "switches them back" in said
    theirs = {k: v.clone() for k, v in b.engine.state_dict().items()}
    assert any(not torch.equal(mine[k], theirs[k]) for k in mine)
    # every read of the parent's weights gets the parent's, not the fork's
    assert all(torch.equal(v, mine[k]) for k, v in s.engine.state_dict().items())
    s.trainer.save_model(str(tmp_path / "p"))
    saved = dict(AutoModelForCausalLM.from_pretrained(str(tmp_path / "p")).named_parameters())
    assert all(torch.equal(saved[k].detach(), mine[k]) for k in mine)
    # and the fork gets its own back
    assert all(torch.equal(v, theirs[k]) for k, v in b.engine.state_dict().items())
    assert any(e["kind"] == "switched_in" for e in s.events)


def test_resume_after_rewinding_a_finished_run_continues_it(make):  # noqa: F811
    s = make(snapshot_steps=2, max_steps=4, name="main")
    s.train(block=True)
    final = _weights(s)
    s.rewind(2)
    assert s.state == "idle"
    s.resume()
    assert s.wait(timeout=120) == "finished" and s.step == 4
    assert all(torch.equal(v, final[k]) for k, v in _weights(s).items())

"""What the user sees, round two (issue 36): labels that name the right steps, small texts
that read right, a preset run that repeats across kernels."""
import re

import numpy as np

from megatrain_nb.notebook.run_log import RunView
from megatrain_nb.notebook.summary_html import loss_svg


def _view(steps, events=()):
    x = np.asarray(steps, dtype=float)
    return RunView(version=1, step=int(x[-1]), records=len(x), curves={"loss": (x, 5.0 - 0.01 * x)},
                   events=list(events))


def test_the_loss_chart_label_names_the_first_and_last_step_even_with_markers():
    events = [{"step": 60, "kind": "pause"}, {"step": 60, "kind": "lr", "previous": 1e-3, "value": 5e-4},
              {"step": 120, "kind": "resume"}]
    svg = loss_svg(_view(range(5, 201), events))
    assert re.search(r"steps 5–200</text>", svg), svg[-200:]


PRESET_RUN = """
import os, sys, torch
torch.rand(int(sys.argv[2]))   # whatever the kernel drew before must not matter
from transformers import TrainingArguments
import megatrain_nb as mt
args = TrainingArguments(output_dir=sys.argv[1], seed=0, max_steps=1, per_device_train_batch_size=2,
                         logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no",
                         disable_tqdm=True, use_cpu=True)
s = mt.Session("micro", args=args, seq_len=16)
s.train(block=True)
print("LOSS", repr(s.run_log.last_record()["loss"]))
s.close()
"""


def test_a_preset_session_gives_the_same_first_loss_in_two_fresh_processes(tmp_path):
    import subprocess
    import sys

    losses = []
    for i, draws in enumerate((3, 11)):
        out = subprocess.run([sys.executable, "-c", PRESET_RUN, str(tmp_path / f"o{i}"), str(draws)],
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        losses.append(next(l for l in out.stdout.splitlines() if l.startswith("LOSS")))
    assert losses[0] == losses[1], losses


def test_status_counts_one_event_in_the_singular(fake_session):
    from megatrain_nb.notebook.magics import status_line

    s = fake_session(total_steps=4)
    s.train(block=True)
    s.run_log.add_event("pause", 4, source="test")
    assert "; 1 event (last: pause at step 4)" in status_line(s)


def test_snapshots_print_as_a_table_with_readable_times():
    import time

    from megatrain_nb.notebook import Session
    from megatrain_nb.notebook.snapshot_table import SnapshotTable
    from megatrain_nb.trainer.snapshot import SnapshotInfo

    import typing

    assert typing.get_type_hints(Session.snapshots.fget)["return"] is SnapshotTable
    assert "no snapshots yet" in repr(SnapshotTable())
    t = time.mktime((2026, 5, 4, 13, 7, 9, 0, 0, -1))
    table = SnapshotTable([SnapshotInfo(step=20, time=t, run_id="abcdef123456", path="/x/snap-20",
                                        bytes_unique=3 * 2**20, branch="main")])
    text = repr(table)
    assert text.splitlines()[0].split()[:4] == ["step", "branch", "kind", "taken"]
    assert "2026-05-04 13:07" in text and "3.0 MiB" in text and str(t) not in text
    assert table[0].step == 20 and "<td>main</td>" in table._repr_html_()


def test_the_lr_field_shows_the_scheduled_rate_the_header_shows(fake_session):
    s = fake_session(total_steps=3, lr=1e-3)
    s.trainer.args.learning_rate = 3e-3   # the base rate; the schedule gives 1e-3 at every step
    d = s.dashboard()
    assert d.lr_field.value == 3e-3
    s.train(block=True)
    d.refresh(force=True)
    assert "mtnb-dash-lr'>0.001<" in d.header.value and d.lr_field.value == 1e-3
    assert not any(e["kind"] == "lr" for e in s.events)   # showing a rate is not setting one


def test_the_step_axis_at_step_one_has_whole_distinct_ticks():
    from chart_node import draw, find, text

    spec = {"kind": "training", "step": 1, "loss": {"x": [1], "y": [8.3]}, "eval": {"x": [], "y": []},
            "lr": {"x": [1], "y": [1e-3]}, "events": []}
    labels = [text(t) for t in find(draw(spec), "mtnb-chart-xtick")]
    assert labels and len(labels) == len(set(labels)), labels
    assert all(float(v) == int(float(v)) for v in labels), labels
    spec["loss"] = {"x": list(range(1, 1001)), "y": [5.0] * 1000}
    spec["lr"] = {"x": list(range(1, 1001)), "y": [1e-3] * 1000}
    assert len(find(draw(spec), "mtnb-chart-xtick")) >= 4   # a long run still gets several


def test_the_run_tree_chart_draws_every_branch_and_says_why_a_panel_is_empty():
    from chart_node import draw, find, text

    from megatrain_nb.notebook.run_tree import runs_spec

    recs = [{"step": i, "loss": 5.0 - 0.01 * i, "lr": 1e-3, "grad_norm": 1.0} for i in range(1, 161)]
    fork = [{"step": i, "loss": 4.0, "lr": 1e-4, "grad_norm": 0.5} for i in range(26, 80)]
    runs = [{"run_id": "a", "name": "main", "parent_run_id": None, "forked_at_step": None, "changes": "",
             "records": recs},
            {"run_id": "b", "name": "low-lr", "parent_run_id": "a", "forked_at_step": 25,
             "changes": "learning_rate=0.0001", "records": fork}]
    tree = draw(runs_spec(runs), 1200)
    assert len(find(tree, "mtnb-panel")) == 4
    assert len(find(tree, "mtnb-series")) == 6   # loss, lr, grad norm of both; no eval
    assert [text(n) for n in find(tree, "mtnb-chart-note")] == ["no eval loss logged (no eval set)"]
    assert len(find(tree, "mtnb-fork")) == 1
    legend = [text(n) for n in find(tree, "mtnb-chart-legend-item")]
    assert legend == ["main", "low-lr (from step 25): learning_rate=0.0001"]
    ticks = [text(n) for n in find(find(tree, "mtnb-panel")[0], "mtnb-chart-xtick")]
    assert ticks[-1] == "160" or int(ticks[-1]) >= 150, ticks


def test_static_outputs_use_markup_a_notebook_sanitizer_keeps(fake_session):
    """Issue 36: untrusted, inline SVG was taken apart (labels run together) and the
    dashboard's "needs a widget frontend" line showed beside the snapshot."""
    import base64
    import re

    from megatrain_nb.notebook.summary_html import summary_html

    s = fake_session(total_steps=30, step_time=0.001)
    s.train(block=True)
    page = summary_html(s, s.run_log.view(), final=True)
    assert "<svg" not in page
    [data] = re.findall(r"src='data:image/svg\+xml;base64,([^']+)'", page)
    assert "steps 1–30" in base64.b64decode(data).decode()
    assert "<svg" not in s.inspect(0)._repr_html_()
    assert s.dashboard()._repr_mimebundle_()["text/plain"] == ""

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

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

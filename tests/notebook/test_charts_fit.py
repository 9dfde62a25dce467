"""Charts that fit (issue 46 item 3): the DPO panel's share axis runs 0 to 1 and its step labels
stay inside their boxes; mt.compare's figure has its axes in range as layout values, its "no eval
loss" note in the eval panel and each branch's line from its fork step."""
import pytest

from megatrain_nb.notebook.preference_view import reward_spec
from megatrain_nb.notebook.run_tree import run_tree_figure, runs_spec
from megatrain_nb.notebook.static_chart import panels_svg

CHAR = 6.5   # chart_node's text width per character


def _dpo_records(n=60, accuracy=1.0):
    return [{"step": i, "loss": 0.7 - 0.005 * i, "rewards/margins": 0.01 * i, "rewards/accuracies": accuracy}
            for i in range(1, n + 1)]


def _label_box(el: dict) -> tuple:
    """(left, right) of a drawn tick label, from its anchor (chart_node measures 6.5 px a char)."""
    from chart_node import text

    w, x = CHAR * len(text(el)), float(el["attrs"]["x"])
    anchor = el["attrs"].get("text-anchor", "start")
    return {"start": (x, x + w), "middle": (x - w / 2, x + w / 2), "end": (x - w, x)}[anchor]


@pytest.mark.parametrize("width", [560, 700, 1000])
def test_the_dpo_panels_accuracy_axis_is_a_share_and_step_labels_fit_their_boxes(width):
    from chart_node import draw, find, text

    tree = draw(reward_spec(_dpo_records()), width)
    margin, accuracy = find(tree, "mtnb-panel")
    yticks = [text(t) for t in find(accuracy, "mtnb-chart-ytick")]
    assert yticks == ["0", "0.25", "0.5", "0.75", "1"]   # all accuracies 1.0: not an axis to 1.5
    for panel in (margin, accuracy):
        svg = find(panel, "mtnb-chart-panel")[0]
        labels = find(svg, "mtnb-chart-xtick")
        assert labels and text(labels[-1]) == "60"   # the last step, whole ("6" was what showed)
        for el in labels:
            lo, hi = _label_box(el)
            assert 0 <= lo and hi <= float(svg["attrs"]["width"]), (text(el), lo, hi, svg["attrs"]["width"])


def test_the_static_picture_of_a_share_runs_to_one():
    svg = panels_svg(reward_spec(_dpo_records(accuracy=1.0)))
    assert ">1</text>" in svg and ">0</text>" in svg and "1.1</text>" not in svg


def _tree(parent_drawn=True):
    main = [{"step": s, "loss": 3 - 0.01 * s, "lr": 1e-3, "grad_norm": 1.0} for s in range(1, 61)]
    low = [{"step": s, "loss": 3 - 0.01 * s, "lr": 1e-3 if s <= 40 else 1e-4, "grad_norm": 0.5}
           for s in range(1, 61)]   # a fork's history holds its parent's steps before the fork
    runs = [{"name": "main", "run_id": "A", "parent_run_id": None, "forked_at_step": None, "changes": "",
             "records": main},
            {"name": "low", "run_id": "B", "parent_run_id": "A", "forked_at_step": 40,
             "changes": "learning_rate=0.0001", "records": low}]
    return runs if parent_drawn else runs[1:]


def test_the_compare_figure_has_its_axes_in_range_and_its_note_in_the_eval_panel():
    fig = run_tree_figure(_tree(), title="Compare")
    for k in ("xaxis", "xaxis2", "xaxis3", "xaxis4"):   # the steps drawn, 1 to 60: no axis from -20
        lo, hi = fig.layout[k].range
        assert 0 <= lo <= 1 and 60 <= hi <= 62, (k, lo, hi)
    assert fig.layout.yaxis3.range == (0, pytest.approx(1.1e-3))   # the learning rate from 0
    assert fig.layout.yaxis4.range == (0, pytest.approx(1.1))      # the grad norm from 0
    note = [a for a in fig.layout.annotations if a.text.startswith("no eval loss")]
    assert len(note) == 1 and note[0].xref == note[0].yref == "paper"
    xd, yd = fig.layout.xaxis2.domain, fig.layout.yaxis2.domain     # the eval panel (row 1, col 2)
    assert xd[0] < note[0].x < xd[1] and yd[0] < note[0].y < yd[1]
    ld = fig.layout.xaxis.domain                                     # not in the loss panel
    assert not ld[0] <= note[0].x <= ld[1]
    low = [t for t in fig.data if t.name and t.name.startswith("low")]
    assert {t.name for t in low} == {"low (from step 40): learning_rate=0.0001"}
    assert all(min(t.x) == 40 for t in low)   # drawn from its fork, as its legend says


def test_a_branch_without_its_parent_is_drawn_whole_and_says_where_it_forked():
    fig = run_tree_figure(_tree(parent_drawn=False))
    names = {t.name for t in fig.data if t.name}
    assert names == {"low (forked at step 40): learning_rate=0.0001"}
    assert min(min(t.x) for t in fig.data if t.name) == 1
    spec = runs_spec(_tree(parent_drawn=False))
    assert spec["legend"][0]["name"] == "low (forked at step 40): learning_rate=0.0001"
    assert runs_spec(_tree())["panels"][0]["series"][1]["x"][0] == 40


def test_the_weight_histogram_spreads_a_layers_matrices_not_its_norm_weights():
    """A layer's RMSNorm weights near 1 beside matrices near 0 (issue 46 item 3): the histogram is
    of the matrices, so their mass fills the range instead of its left 15%."""
    import torch

    from megatrain_nb.engine.updates.optimizer import unit_stats
    from megatrain_nb.engine.units import ParamEntry, Unit

    torch.manual_seed(0)
    w = torch.randn(64, 64) * 0.02
    norm = torch.ones(64)
    flat = torch.cat([w.reshape(-1), norm])
    unit = Unit("layers.0", "layer", 1, [ParamEntry("mlp.weight", 0, (64, 64), True),
                                         ParamEntry("norm.weight", 4096, (64,), False)], flat.numel(), 4096)
    st = unit_stats(unit, flat, torch.zeros_like(flat), flat[::1].clone())
    counts, edges = st["hist_counts"], st["hist_edges"]
    assert st["hist_of"] == "matrices" and sum(counts) == 4096 and edges[-1] < 0.2
    filled = [i for i, c in enumerate(counts) if c]
    assert filled[-1] - filled[0] >= len(counts) // 2   # the matrix's mass spread over the range

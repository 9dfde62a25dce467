"""trainer/kinds.py: the metrics a sequence objective returns per micro-batch (EngineOutput.
objective_metrics), kept by a kind until a log takes their means as TRL does."""
import math

from megatrain_nb.trainer.kinds import MetricLists, PlainKind


def test_metric_lists_give_the_steps_means_and_the_logs_means():
    m = MetricLists()
    assert m.add([{"a": 1.0, "b": 2}, {"a": 3.0}, {}]) == {"a": 2.0, "b": 2.0}   # {}: a filler micro-batch
    assert m.add([{"a": 5.0}]) == {"a": 5.0}
    assert m.add(None) == {}   # a token loss: no objective metrics
    assert m.take() == {"a": 3.0, "b": 2.0}   # per micro-batch since the last take: (1 + 3 + 5) / 3
    assert m.take() == {}


def test_metric_lists_leave_nan_out_as_grpo_logs_them():
    nan = float("nan")
    m = MetricLists(skip_nan=True)
    assert m.add([{"x": nan, "y": 1.0}, {"x": 2.0, "y": nan}, {"x": 4.0, "z": nan}]) == {"x": 3.0, "y": 1.0, "z": None}
    assert m.take() == {"x": 3.0, "y": 1.0, "z": None}
    plain = MetricLists()
    assert math.isnan(plain.add([{"x": nan}, {"x": 1.0}])["x"])   # DPO's: a plain mean


def test_the_plain_kind_logs_the_mean_token_loss():
    assert PlainKind().step_loss(None, None, 6.0, 4) == 1.5

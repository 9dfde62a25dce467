"""The run log's writers (notebook/run_log.py): a step's record and its layer statistics arrive
together, so no view (one dashboard refresh) shows a step's histogram beside the previous step's
header -- the race stop 55's suite once caught (header at step 1535, inspector at 1536)."""
import threading

from megatrain_nb.notebook.run_log import RunLog


def _stats(step):
    return [{"unit": "model.layers.0", "weight_norm": float(step)}, {"unit": "head", "weight_norm": 1.0}]


def test_a_view_taken_while_a_step_is_written_shows_one_step(monkeypatch):
    log = RunLog()
    log.add_record({"step": 1, "loss": 2.0}, layer_stats=_stats(1))
    seen = []
    put = RunLog._put_layer_stats

    def slow_put(self, step, stats):
        put(self, step, stats)
        # a reader arrives between the statistics and the record: it must wait for both
        reader = threading.Thread(target=lambda: seen.append(self.view(curves=())))
        reader.start()
        reader.join(timeout=0.3)
        seen.append(reader)
    monkeypatch.setattr(RunLog, "_put_layer_stats", slow_put)
    log.add_record({"step": 2, "loss": 1.9}, layer_stats=_stats(2))
    reader = next(s for s in seen if isinstance(s, threading.Thread))
    reader.join(timeout=10)
    views = [s for s in seen if not isinstance(s, threading.Thread)]
    assert len(views) == 1
    v = views[0]
    assert v.step == 2 and v.layers["model.layers.0"]["step"] == 2


def test_a_record_without_statistics_keeps_the_last_ones():
    log = RunLog()
    log.add_record({"step": 1, "loss": 2.0}, layer_stats=_stats(1))
    log.add_record({"step": 2, "loss": 1.9})
    v = log.view(curves=(), heat=("weight_norm",))
    assert v.step == 2 and v.layers["model.layers.0"]["step"] == 1
    assert v.units == ["model.layers.0", "head"]
    units, steps, z = v.heat["weight_norm"]
    assert list(steps) == [1]

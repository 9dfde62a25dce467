"""The engine's plan by predicted step time (engine/planning/plan_pick.py), on made-up rates: nothing is timed.

A tiny llama whose accumulation window of 8 micro-batches does not fit the device, under a host
budget whose RAM holds that window's boundary activations only at a checkpoint interval above 1:
at interval 1 they go to the disk tier. A very slow disk then makes the larger interval (more
recompute, no disk traffic) the fastest; very slow compute makes interval 1 (less recompute,
the disk's traffic free) the fastest. The test suite plans by the rules (tests/conftest.py sets
MEGATRAIN_NB_PLAN_BY=rules); these tests unset it.
"""
import io
import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.planning import plan_pick
from megatrain_nb.engine.planning.best_plans import best_plans, candidate_choices
from megatrain_nb.engine.planning.planner import ModelShape, UnitSpec, Workload, engine_plan, unit_specs_from_config

from .test_prediction import rates   # the same made-up rates

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
BUDGETS = dict(device="cpu", max_vram_gb=0.0016, max_host_gb=0.0042)
WORK = Workload(batch=1, seq=64, accumulation=8)




SLOW_DISK = rates(disk_read=1e5, disk_write=1e5)
SLOW_COMPUTE = rates(matmul_flops=1e7, attention_flops=1e7, disk_read=1e12, disk_write=1e12)


@pytest.fixture(autouse=True)
def _pick_by_prediction(monkeypatch):
    """Plan by prediction (the suite's conftest says rules), with no cached measurement."""
    monkeypatch.delenv(plan_pick.PLAN_BY_ENV, raising=False)
    monkeypatch.setattr(plan_pick, "cached_rates", lambda device, offload_dir: None)


def _engine(tmp_path, workload=WORK, **cfg):
    options = dict(BUDGETS, offload_dir=str(tmp_path / "disk"))
    options.update(cfg)
    return StreamingEngine(AutoModelForCausalLM.from_config(CONFIG), EngineConfig(**options), workload=workload)


def _plan_of(tmp_path, **cfg):
    e = _engine(tmp_path, **cfg)
    try:
        return e.plan
    finally:
        e.close()


def test_a_slow_disk_and_slow_compute_pick_different_checkpoint_intervals(tmp_path):
    disk_bound = _plan_of(tmp_path, rates=SLOW_DISK)
    compute_bound = _plan_of(tmp_path, rates=SLOW_COMPUTE)
    # a slow disk: more recompute, the window's boundary activations in RAM
    assert disk_bound.checkpoint_interval > 1 and disk_bound.choice["checkpoint_interval"] > 1
    # slow compute: no more recompute than interval 1, the boundaries' disk traffic is free
    assert compute_bound.checkpoint_interval == 1
    assert disk_bound.chosen_by.startswith("predicted step")
    assert compute_bound.chosen_by.startswith("rules' plan, the fastest predicted") and compute_bound.choice is None
    for plan in (disk_bound, compute_bound):
        assert "the run's workload, 1 x 64 tokens x 8" in plan.chosen_by
        assert "of 8 feasible" in plan.chosen_by and "rates: made-up" in plan.chosen_by


def test_the_pick_is_the_fastest_of_the_candidates_the_prediction_priced(tmp_path):
    units, shape = unit_specs_from_config(CONFIG), ModelShape.of(CONFIG)
    cfg = EngineConfig(offload_dir=str(tmp_path / "disk"), **BUDGETS)
    for r in (SLOW_DISK, SLOW_COMPUTE):
        found = best_plans(units, shape, cfg, WORK, r, cuda=False, k=None)
        times = [pc.prediction.step_seconds for pc in found]
        assert times == sorted(times) and len(found) == 10
        assert _plan_of(tmp_path, rates=r).checkpoint_interval == found[0].plan.checkpoint_interval
    # the two rates order the same candidates differently
    assert best_plans(units, shape, cfg, WORK, SLOW_DISK, cuda=False)[0].choice != \
        best_plans(units, shape, cfg, WORK, SLOW_COMPUTE, cuda=False)[0].choice


def test_a_field_the_user_set_is_never_varied(tmp_path):
    for r in (SLOW_DISK, SLOW_COMPUTE):
        plan = _plan_of(tmp_path, rates=r, checkpoint_interval=3, clip_hold="disk")
        assert plan.checkpoint_interval == 3 and plan.placement["gradients"] == "disk"
        assert set(plan.choice or {}) <= {"offload_params"}   # the only free one
    cfg = EngineConfig(offload_dir=str(tmp_path / "disk"), checkpoint_interval=3, clip_hold="disk", **BUDGETS)
    choices = candidate_choices(cfg, ModelShape.of(CONFIG), WORK, pinned={"checkpoint_interval": 3, "clip_hold": "disk"})
    assert {c["checkpoint_interval"] for c in choices} == {3} and {c["clip_hold"] for c in choices} == {"disk"}
    everything = _plan_of(tmp_path, rates=SLOW_DISK, checkpoint_interval=2, clip_hold="host", offload_params=False)
    assert everything.chosen_by.startswith("rules: every choice is pinned") and everything.choice is None


def test_without_rates_or_with_plan_by_rules_the_plan_is_the_rules(tmp_path, monkeypatch):
    units = [UnitSpec(u.name, u.numel, u.kind, u.tied_output) for u in unit_specs_from_config(CONFIG)]
    cfg = EngineConfig(offload_dir=str(tmp_path / "disk"), **BUDGETS)
    rules = engine_plan(units, CONFIG, cfg, cuda=False, accumulation=WORK.accumulation).to_dict()   # (the run's window)
    no_rates = _plan_of(tmp_path)
    assert no_rates.chosen_by.startswith("rules: no measured rates") and no_rates.choice is None
    pinned = _plan_of(tmp_path, rates=SLOW_DISK, overrides={"plan_by": "rules"})
    assert pinned.chosen_by == "rules: EngineOverrides(plan_by='rules')"
    monkeypatch.setenv(plan_pick.PLAN_BY_ENV, "rules")
    by_env = _plan_of(tmp_path, rates=SLOW_DISK)
    assert by_env.chosen_by == "rules: MEGATRAIN_NB_PLAN_BY=rules"
    for plan in (no_rates, pinned, by_env):
        assert {k: v for k, v in plan.to_dict().items() if k not in ("chosen_by", "choice")} == \
            {k: v for k, v in rules.items() if k not in ("chosen_by", "choice")}


def test_the_machines_cached_measurement_decides_when_no_rates_are_given(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(plan_pick, "cached_rates", lambda device, offload_dir: asked.append(device) or SLOW_DISK)
    e = _engine(tmp_path)
    try:
        assert e.plan.checkpoint_interval > 1 and asked == ["cpu"]
        assert e.rates is None   # (engine.prediction reads the cache itself, as before)
    finally:
        e.close()


def test_without_a_workload_the_planners_default_is_priced_and_said(tmp_path):
    plan = _plan_of(tmp_path, workload=None, rates=SLOW_COMPUTE)
    # Workload()'s 2048 tokens, cut to the model's 64 positions
    assert "the planner's default workload, 1 x 64 tokens x 1 micro-batch(es), clipped" in plan.chosen_by
    assert "not known when the engine is built" in plan.chosen_by


class _Ranks:
    """Two ranks' all_gather_json, called by rank 0 then rank 1: each sees rank 0's value first."""

    world = 2

    def __init__(self):
        self.sent = []

    def all_gather_json(self, obj):
        self.sent.append(obj)
        return [self.sent[0], obj]


def test_every_rank_takes_rank_zeros_choice():
    units = [UnitSpec(u.name, u.numel, u.kind, u.tied_output) for u in unit_specs_from_config(CONFIG)]
    ranks, dev = _Ranks(), torch.device("cpu")
    with tempfile.TemporaryDirectory() as d:
        zero = plan_pick.pick_plan(units, CONFIG, EngineConfig(offload_dir=d, rates=SLOW_DISK, **BUDGETS),
                                   device=dev, dist=ranks, workload=WORK)
        one = plan_pick.pick_plan(units, CONFIG, EngineConfig(offload_dir=d, rates=SLOW_COMPUTE, **BUDGETS),
                                  device=dev, dist=ranks, workload=WORK)
        alone = plan_pick.pick_plan(units, CONFIG, EngineConfig(offload_dir=d, rates=SLOW_COMPUTE, **BUDGETS),
                                    device=dev, workload=WORK)
    assert alone.checkpoint_interval == 1 != zero.checkpoint_interval   # rank 1's rates alone would differ
    assert one.checkpoint_interval == zero.checkpoint_interval and one.choice == zero.choice
    assert one.chosen_by == zero.chosen_by and len(ranks.sent) == 2


def test_a_trainer_prices_its_own_workload_and_the_header_says_how_the_plan_was_chosen(tmp_path):
    from transformers import TrainingArguments

    import megatrain_nb as mt
    from megatrain_nb.cli.report import print_header

    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=3, max_steps=1, report_to=[], save_strategy="no",
                             max_grad_norm=0.0)
    data = [{"input_ids": list(range(i, i + 32))} for i in range(12)]
    tr = mt.Trainer(model=AutoModelForCausalLM.from_config(CONFIG), train_dataset=data, args=args, seq_len=32,
                    device="cpu", rates=SLOW_COMPUTE)
    try:
        assert "the run's workload, 2 x 32 tokens x 3 micro-batch(es), unclipped" in tr.engine.plan.chosen_by
        assert tr.engine.workload == Workload(batch=2, seq=32, accumulation=3, gradients="none", clipped=False)
        assert tr.engine.rates is not None and tr.prediction is not None   # the given rates predict too
        out = io.StringIO()
        print_header(tr, model="tiny", data="12 rows", out=out)
        line = next(x for x in out.getvalue().splitlines() if x.startswith("plan:"))
        assert tr.engine.plan.chosen_by in line
    finally:
        tr.close()


def test_rates_are_checked_when_the_config_is_made():
    assert EngineConfig(rates=SLOW_DISK.to_dict()).rates == SLOW_DISK
    with pytest.raises(ValueError, match=r"disk_read=nan .*cores='abc'|cores='abc'.*disk_read=nan"):
        EngineConfig(rates=dict(SLOW_DISK.to_dict(), disk_read=float("nan"), cores="abc"))
    with pytest.raises(ValueError, match="unknown machine profile 'no-such-box'"):
        EngineConfig(rates="no-such-box")
    with pytest.raises(ValueError, match="plan_by"):
        EngineConfig(overrides={"plan_by": "fastest"})


def test_estimate_lists_the_fastest_plans_and_names_the_one_an_engine_builds(capsys):
    import megatrain_nb as mt

    kw = dict(vram_gb=0.0016, ram_gb=0.0042, disk_gb=1, seq=64, accumulation=8, compression="none", device="cpu")
    slow_disk = mt.estimate(CONFIG, rates=SLOW_DISK, **kw)
    assert slow_disk.pick is slow_disk.best[0] and slow_disk.pick.plan.checkpoint_interval > 1
    assert slow_disk.plan.checkpoint_interval == 1   # the table: the rules' plan (the default interval)
    text = str(slow_disk)
    assert "fastest plans within the budgets" in text and "builds plan 1; the table above is the rules' plan" in text
    d = slow_disk.to_dict()
    assert d["engine_pick"] == slow_disk.pick.choice and len(d["best_plans"]) == 3
    assert {"step_seconds", "host_bytes", "disk_bytes", "device_bytes", "bottleneck"} <= set(d["best_plans"][0])
    slow_compute = mt.estimate(CONFIG, rates=SLOW_COMPUTE, **kw)
    # (the rules' plan ties with the fastest: plans that differ only in where a few bytes wait)
    assert "builds the rules' plan above (plan " in str(slow_compute)
    assert slow_compute.pick.prediction.step_seconds <= slow_compute.best[0].prediction.step_seconds * (1 + 1e-6)
    pinned = mt.estimate(CONFIG, rates=SLOW_DISK, checkpoint_interval=2, **kw)
    assert {pc.plan.checkpoint_interval for pc in pinned.best} == {2}


# ---------------------------------------------------------------------------------------- the promises
def _llama(layers):
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """Rates cached for this machine's CPU in a temporary MEGATRAIN_NB_CACHE, read as a user's are
    (measure.cached_rates): compute so slow that no recompute (checkpoint_interval 0, every layer
    resident) is predicted fastest."""
    from megatrain_nb.engine import measure
    from megatrain_nb.engine.tiers.diskspace import filesystem_of

    monkeypatch.setenv("MEGATRAIN_NB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(plan_pick, "cached_rates", measure.cached_rates)
    path = tmp_path / "cache" / (measure.cache_key("cpu", filesystem_of(tempfile.gettempdir())) + ".json")
    measure.save_cached(str(path), SLOW_COMPUTE)
    assert measure.cached_rates("cpu") == SLOW_COMPUTE
    return SLOW_COMPUTE


def _built(model, cfg):
    e = StreamingEngine(model, cfg)
    try:
        return e.plan
    finally:
        e.close()


def test_a_value_the_user_passes_is_never_varied_whatever_it_equals(cached):
    given = _built(_llama(16), EngineConfig(device="cpu", checkpoint_interval=1))
    assert given.checkpoint_interval == 1 and given.layer_slots == 2 and given.choice is None
    assert "kept as given: checkpoint_interval=1" in given.chosen_by
    assert EngineConfig(device="cpu", checkpoint_interval=1).given == {"device", "checkpoint_interval"}
    assert EngineConfig(device="cpu").given == {"device"}
    assert EngineConfig(device="cpu").replace(clip_hold="host").given == {"device", "clip_hold"}
    # a device budget given: the pick may use it (no recompute, every layer resident)
    budget = _built(_llama(16), EngineConfig(device="cpu", max_vram_gb=4))
    assert budget.checkpoint_interval == 0 and budget.choice["checkpoint_interval"] == 0
    # the planner asked to decide (None) is free
    free = _built(_llama(16), EngineConfig(device="cpu", checkpoint_interval=None, max_vram_gb=4))
    assert free.checkpoint_interval == 0


@pytest.mark.slow   # (3.5 s: four engines step)
def test_without_a_device_budget_a_pick_never_grows_the_device_working_set(cached, monkeypatch):
    def peak(layers):
        e = StreamingEngine(_llama(layers), EngineConfig(device="cpu"))
        try:
            e.forward_backward(torch.randint(0, 256, (1, 32)))
            return e.memory_report()["device"]["peak_bytes"], e.plan
        finally:
            e.close()

    (p4, plan4), (p16, plan16) = peak(4), peak(16)
    for plan in (plan4, plan16):
        assert plan.checkpoint_interval == 1 and plan.layer_slots == 2
        assert "device held to the rules' device working set" in plan.chosen_by
    assert p16 <= 1.1 * p4, (p4, p16)
    monkeypatch.setenv(plan_pick.PLAN_BY_ENV, "rules")
    (r4, _), (r16, _) = peak(4), peak(16)
    assert p4 <= r4 * 1.01 and p16 <= r16 * 1.01, (p4, r4, p16, r16)


def test_a_trainer_on_tokenized_rows_plans_and_predicts_for_the_rows_the_data_has():
    """No seq_len, rows of 24 tokens: the plan's workload and the prediction are for 24-token rows
    (the issue's run planned and predicted 1024-token rows, 10x the step it measured)."""
    from transformers import TrainingArguments

    import megatrain_nb as mt
    from megatrain_nb.trainer.trainer import data_row_tokens

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, max_steps=1,
                             report_to=[], save_strategy="no")
    data = [{"input_ids": list(range(i, i + 20 + i % 5))} for i in range(12)]
    assert data_row_tokens(data) == 24 and data_row_tokens([{"text": "a b"}]) is None
    tr = mt.Trainer(model=AutoModelForCausalLM.from_config(CONFIG), train_dataset=data, args=args, device="cpu",
                    rates=SLOW_COMPUTE)
    try:
        assert tr.engine.workload.seq == 24 and "2 x 24 tokens" in tr.engine.plan.chosen_by
        assert tr.prediction.tokens_per_step == 2 * 24
    finally:
        tr.close()

"""Layer-major accumulation (forward_backward of a whole window): same weights as the
micro-batch-major path, each layer loaded twice per step, no host gradient accumulator."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.planning.planner import TOKENS_PER_PASS, GiB, loads_per_layer, window_plan

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


def _windows(steps, A, batch=2, seq=12, seed=3, pad=True):
    """``steps`` windows of ``A`` micro-batches; right and left padding, unequal target counts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        w = []
        for a in range(A):
            ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
            am = torch.ones_like(ids)
            if pad:
                if (s + a) % 2:
                    am[1, 7 + a % 3:] = 0
                else:
                    am[0, :2 + a % 3] = 0
            w.append({"input_ids": ids, "attention_mask": am})
        out.append(w)
    return out


def _targets(w):
    return sum(int((b["attention_mask"][:, 1:] == 1).sum()) for b in w)


def _micro_batch_major(engine, w, lr, clip=None):
    """Today's path: one forward_backward per micro-batch, the update on the last."""
    n = _targets(w)
    loss = 0.0
    for i, b in enumerate(w):
        last = i == len(w) - 1
        out = engine.forward_backward(b["input_ids"], attention_mask=b["attention_mask"], num_items_in_batch=n,
                                      step_lr=lr if last else None, max_grad_norm=clip if last else None)
        loss += out.loss * out.num_tokens
    return loss / n, out.grad_norm


def _rel(a: StreamingEngine, b: StreamingEngine) -> float:
    pa = dict(a.named_parameters())
    num = den = 0.0
    for name, p in b.named_parameters():
        num += float((pa[name] - p).double().norm() ** 2)
        den += float(p.double().norm() ** 2)
    return (num / den) ** 0.5


def _pair(model, **cfg):
    return (StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", **cfg)),
            StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", **cfg)))


@pytest.mark.parametrize("family,tie", [("llama", True), ("gpt2", True), ("gemma2", False), ("mistral", False)])
@pytest.mark.parametrize("k", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_20_steps_match_micro_batch_major(family, tie, k):
    """20 optimizer steps, accumulation 3, padding; clipping at k=2, int8 states at k=3.

    Untied, the sums are formed in the same order as the micro-batch-major path (bitwise the
    same weights). Tied, the embedding's two uses are summed in another order (all head uses,
    then all embedding uses); int8 states turn such last-bit differences into different codes,
    so int8 runs on the untied families here."""
    model = AutoModelForCausalLM.from_config(family_config(family, tie=tie)).eval()
    clip = 0.05 if k == 2 else None
    codec = "int8" if k == 3 and not tie else "none"
    ref, lm = _pair(model, checkpoint_interval=k, optimizer_compression=codec, weight_decay=0.1)
    start = copy.deepcopy(dict(ref.named_parameters()))
    for w in _windows(5, 3) * 4:
        ref_loss, ref_norm = _micro_batch_major(ref, w, 3e-3, clip)
        out = lm.forward_backward(w, step_lr=3e-3, max_grad_norm=clip)
        assert out.loss == pytest.approx(ref_loss, rel=1e-5)
        assert out.num_tokens == _targets(w)
        if clip:
            assert out.grad_norm == pytest.approx(ref_norm, rel=1e-5)
    assert _rel(lm, ref) <= 1e-5
    moved = sum(float((p - start[n]).norm() ** 2) for n, p in ref.named_parameters()) ** 0.5
    assert moved > 1e-2  # training really moved the weights
    for e in (ref, lm):
        e.close()


def test_keep_all_activations_interval_0():
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    ref, lm = _pair(model, checkpoint_interval=0)
    for w in _windows(3, 4):
        _micro_batch_major(ref, w, 3e-3)
        lm.forward_backward(w, step_lr=3e-3)
    assert _rel(lm, ref) <= 1e-5
    assert lm.telemetry()["last_step"]["loads_per_layer"] == 1


def test_counts_a4_each_layer_twice_and_no_host_gradients():
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=4))
    engine = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=1))
    windows = _windows(3, 4, pad=False)
    for w in windows:
        engine.forward_backward(w, step_lr=1e-3)
    tel = engine.telemetry()
    layer_loads = {k: v for k, v in tel["loads_per_unit"].items() if "layers" in k}
    assert len(layer_loads) == 4 and set(layer_loads.values()) == {2 * 3}   # twice per step, 3 steps
    assert tel["loads_per_unit"]["embed"] == 3 and tel["loads_per_unit"]["head"] == 3
    last = tel["last_step"]
    assert last["loads_per_layer"] == 2 and last["micro_batches"] == 4 and last["groups"] == 1
    tokens = sum(b["input_ids"].numel() for b in windows[-1])
    assert last["tokens"] == tokens and last["tokens_per_weight_fetch"] == tokens / 2
    assert last["host_to_device_bytes"] == 4 * (engine.num_parameters() + sum(u.numel for u in engine.layer_units))
    # the boundary activations: every layer's input of every micro-batch (2x12 tokens, hidden 32, fp32)
    assert last["boundary_tier"] == "device" and last["boundary_bytes"] == {"device": 4 * 4 * 2 * 12 * 32 * 4,
                                                                              "host": 0, "disk": 0}
    mem = engine.memory_report()
    assert mem["host"]["grads"] == 0                    # no host gradient accumulator
    assert mem["device"]["boundary_activations"] == last["boundary_bytes"]["device"]
    # the micro-batch-major path of the same window loads every layer 2 x 4 times
    ref = StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama", layers=4)),
                          EngineConfig(device="cpu"))
    _micro_batch_major(ref, windows[0], 1e-3)
    assert ref.telemetry()["last_step"]["loads_per_layer"] == 8
    assert ref.memory_report()["host"]["grads"] > 0
    for e in (engine, ref):
        e.close()


def test_host_tier_same_result_counted_on_host():
    model = AutoModelForCausalLM.from_config(family_config("qwen2")).eval()
    ref = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", checkpoint_interval=2))
    lm = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", checkpoint_interval=2, window_tier="host"))
    for w in _windows(4, 3):
        _micro_batch_major(ref, w, 3e-3)
        lm.forward_backward(w, step_lr=3e-3)
    assert _rel(lm, ref) <= 1e-5
    last = lm.telemetry()["last_step"]
    assert last["boundary_tier"] == "host"
    assert last["boundary_bytes"]["device"] == 0 and last["boundary_bytes"]["host"] > 0
    mem = lm.memory_report()
    assert mem["host"]["activations"] == last["boundary_bytes"]["host"] and mem["host"]["grads"] == 0


def test_split_into_groups_loads_twice_per_group():
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    ref = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu"))
    lm = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", max_window_micro_batches=2))
    for w in _windows(3, 5):
        _micro_batch_major(ref, w, 3e-3, clip=0.1)
        out = lm.forward_backward(w, step_lr=3e-3, max_grad_norm=0.1)
    assert _rel(lm, ref) <= 1e-5
    assert lm.last_window_plan.groups == 3 and lm.last_window_plan.group_size == 2
    assert "split into 3 groups" in lm.last_window_plan.reason
    assert lm.telemetry()["last_step"]["loads_per_layer"] == 6
    assert out.grad_norm is not None


def test_dropout_rng_restored_per_micro_batch_and_layer():
    cfg = family_config("gpt2", tie=True)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.2
    model = AutoModelForCausalLM.from_config(cfg).train()
    w = _windows(1, 3)[0]
    grads = {}
    for k in (0, 1, 2):  # 0: no recompute, the forward's own graphs: the reference for the recompute
        e = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", checkpoint_interval=k))
        torch.manual_seed(5)
        loss = e.forward_backward(w).loss
        grads[k] = (loss, {n: g.clone() for n, g in e.named_gradients()})
        e.close()
    for k in (1, 2):
        assert grads[k][0] == pytest.approx(grads[0][0], rel=1e-6)
        for n, g in grads[0][1].items():
            assert float((grads[k][1][n] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-9, (k, n)
    # a window of one micro-batch draws the same masks as the micro-batch-major path
    a, b = _pair(model, checkpoint_interval=2)
    torch.manual_seed(9)
    la = a.forward_backward([w[0]]).loss
    torch.manual_seed(9)
    lb = b.forward_backward(w[0]["input_ids"], attention_mask=w[0]["attention_mask"]).loss
    assert la == pytest.approx(lb, rel=1e-6)
    ga = dict(a.named_gradients())
    for n, g in b.named_gradients():
        assert float((ga[n] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-9, n
    # and the masks matter: another seed gives another loss
    torch.manual_seed(10)
    assert a.forward_backward([w[0]]).loss != pytest.approx(la, rel=1e-6)


def test_num_items_in_batch_and_loss_fn_and_tensor_micro_batches():
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    w = [torch.randint(1, VOCAB, (2, 10), generator=g) for _ in range(3)]

    def loss_fn(lg, lab):
        mask = lab != -100
        picked = lg.gather(-1, lab.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (((picked - 1.0) ** 2) * mask).sum()

    total = 0.0
    for ids in w:  # reference: HF autograd, the summed loss over the window / 40
        logits = ref(input_ids=ids).logits[:, :-1]
        part = ((logits.gather(-1, ids[:, 1:].unsqueeze(-1)) - 1.0) ** 2).sum()
        (part / 40).backward()
        total += float(part.detach())
    engine = StreamingEngine(model, EngineConfig(device="cpu", overrides={"loss_chunk_tokens": 8}))
    out = engine.forward_backward(w, loss_fn=loss_fn, num_items_in_batch=40)
    assert out.num_tokens == 3 * 2 * 9 and out.loss * out.num_tokens == pytest.approx(total, rel=1e-5)
    refg = {n: p.grad for n, p in ref.named_parameters()}
    for n, gr in engine.named_gradients():
        assert float((gr - refg[n]).norm()) <= 1e-4 * float(refg[n].norm()), n


def test_window_bad_input_is_named():
    engine = StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama")), EngineConfig(device="cpu"))
    ids = torch.randint(1, VOCAB, (1, 8))
    with pytest.raises(ValueError, match="micro-batch 1 of the window"):
        engine.forward_backward([ids, {"ids": ids}])
    with pytest.raises(ValueError, match="in its dict"):
        engine.forward_backward([ids, ids], attention_mask=torch.ones_like(ids))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.forward_backward([ids, ids + VOCAB])
    engine.close()


def test_window_plan_device_then_host_then_split():
    row = 4096 * 8192 * 2     # one micro-batch's hidden state: 4096 tokens, hidden 8192, bf16
    kw = dict(tokens=4096, hidden_size=8192, num_layers=80, checkpoint_interval=1, compute_bytes=2,
              raise_interval=False)   # (raising the interval: test_window_plan_disk_tier_and_interval)
    p = window_plan(16, device_free=None, host_free=None, **kw)
    assert (p.tier, p.groups, p.loads_per_layer) == ("device", 1, 2)
    p = window_plan(16, device_free=16 * 82 * row, host_free=None, **kw)
    assert (p.tier, p.groups, p.boundary_bytes) == ("device", 1, 16 * 80 * row)
    p = window_plan(16, device_free=40 * GiB, host_free=None, **kw)       # 16 x 80 x 64 MiB = 80 GiB: host
    assert (p.tier, p.groups, p.boundary_bytes) == ("host", 1, 16 * 80 * row)
    p = window_plan(16, device_free=40 * GiB, host_free=25 * GiB, **kw)   # 7 fit the device, 5 the host
    assert (p.tier, p.group_size, p.groups, p.loads_per_layer) == ("device", 7, 3, 6)
    p = window_plan(16, device_free=10 * GiB, host_free=25 * GiB, **kw)   # 1 fits the device, 5 the host
    assert (p.tier, p.group_size, p.groups, p.loads_per_layer) == ("host", 5, 4, 8)
    assert "split into 4 groups of up to 5" in p.reason
    p = window_plan(16, device_free=None, host_free=None, max_group=4, **kw)
    assert (p.groups, p.group_size) == (4, 4)
    assert loads_per_layer(80, 2) == pytest.approx(2.5)
    # a split window needs the host accumulator: its groups get the host RAM left after it
    p = window_plan(16, device_free=10 * GiB, host_free=25 * GiB, accumulator_bytes=10 * GiB, **kw)
    assert (p.tier, p.group_size, p.groups) == ("host", 3, 6)
    p = window_plan(4, device_free=10 * GiB, host_free=25 * GiB, accumulator_bytes=10 * GiB, **kw)
    assert p.groups == 1   # 4 x 5 GiB fit in one group, which needs no accumulator
    # optionally, groups stop growing at max_tokens_per_pass: 128 x 2048 tokens -> 4 groups of 32
    p = window_plan(128, device_free=None, host_free=None, max_tokens_per_pass=TOKENS_PER_PASS,
                    **{**kw, "tokens": 2048})
    assert (p.groups, p.group_size, p.loads_per_layer) == (4, 32, 8) and "hide the weight streaming" in p.reason
    assert window_plan(128, device_free=None, host_free=None, **{**kw, "tokens": 2048}).groups == 1


@pytest.mark.parametrize("clip,max_group", [(None, None), (0.5, None), (None, 2)])
def test_reduce_point_sees_each_final_gradient_once_per_window(clip, max_group):
    """The seam a distributed reduce plugs into: once per unit per step, the window's summed gradient."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2)).eval()
    ref = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", weight_decay=0.0))
    eng = StreamingEngine(model, EngineConfig(device="cpu", weight_decay=0.0, max_window_micro_batches=max_group))
    g = torch.Generator().manual_seed(5)
    window = [torch.randint(1, VOCAB, (2, 10), generator=g) for _ in range(3)]
    for ids in window:
        ref.forward_backward(ids, num_items_in_batch=3 * 2 * 9)
    want = {name: gr.clone() for name, gr in ref.named_gradients()}
    before = {name: p.clone() for name, p in eng.named_parameters()}
    seen = {}

    def reduce(unit, flat):
        assert unit.index not in seen, f"{unit.name} reduced twice"
        seen[unit.index] = (unit, flat.clone())
        flat.zero_()
    eng.updates.intake.reduce = reduce
    eng.forward_backward(window, step_lr=1e-2, max_grad_norm=clip)
    eng.zero_grad()
    assert {u.index for u in eng.units if u.numel} == set(seen)
    for unit, flat in seen.values():
        for p in unit.params:
            assert torch.allclose(flat[p.offset:p.offset + p.numel].view(p.shape), want[p.name], atol=1e-6), p.name
    for name, p in eng.named_parameters():
        assert torch.equal(p, before[name]), name
    eng.close()
    ref.close()


@pytest.mark.parametrize("window", [True, False])
def test_clipping_holds_final_gradients_on_the_disk_tier(tmp_path, window):
    """clip_hold='disk': the final gradients wait for the norm on the disk tier, not in RAM;
    same weights as holding them in RAM."""
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ram = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", offload_dir=str(tmp_path / "a"),
                                                             clip_hold="host"))
    disk = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", offload_dir=str(tmp_path / "b"),
                                                              clip_hold="disk"))
    for w in _windows(3, 3 if window else 1):
        outs = []
        for e in (ram, disk):
            if window:
                outs.append(e.forward_backward(w, step_lr=3e-3, max_grad_norm=0.05))
            else:
                b = w[0]
                outs.append(e.forward_backward(b["input_ids"], attention_mask=b["attention_mask"], step_lr=3e-3,
                                               max_grad_norm=0.05))
        assert outs[1].grad_norm == outs[0].grad_norm and outs[0].grad_norm > 0.05
    assert _rel(disk, ram) == 0.0
    mem = disk.memory_report()
    assert mem["host"]["grads"] == 0 and mem["disk"]["grads"] >= 4 * disk.num_parameters()
    assert ram.memory_report()["host"]["grads"] == 0   # held only until their updates (no accumulator kept)
    with pytest.raises(ValueError, match="clip_hold='disk' needs an offload_dir"):
        EngineConfig(clip_hold="disk")
    for e in (ram, disk):
        e.close()


def test_default_clip_hold_goes_to_disk_when_the_host_budget_is_short(tmp_path):
    """clip_hold="auto" (the default): with a max_host_gb that holds the master weights but not
    also a whole model's final gradients, the planner puts the held gradients on the disk tier
    (the master weights stay in RAM); the weights are bitwise those of holding them in RAM.
    Without a disk tier that budget is refused, naming the numbers."""
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    for d in "abc":
        (tmp_path / d).mkdir()
    ram = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", offload_dir=str(tmp_path / "a")))
    assert ram.config.clip_hold == "auto" and ram.plan.placement["gradients"] == "host"   # no budget: RAM
    grads = ram.plan.host["grads"]
    assert grads == 4 * ram.num_parameters()
    short = (ram.plan.host["total"] - grads // 2) / GiB   # room for everything but the gradients
    auto = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", offload_dir=str(tmp_path / "b"),
                                                              max_host_gb=short))
    assert auto.plan.placement == {"gradients": "disk", "master_weights": "host", "optimizer_states": "disk"}
    assert auto.plan.host["grads"] == 0 and auto.plan.disk["grads"] == grads
    assert auto.steps.hold() == "disk"
    roomy = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", offload_dir=str(tmp_path / "c"),
                                                               max_host_gb=short + grads / GiB))
    assert roomy.plan.placement["gradients"] == "host" and roomy.steps.hold() == "host"
    for w in _windows(3, 3):
        outs = [e.forward_backward(w, step_lr=3e-3, max_grad_norm=0.05) for e in (ram, auto, roomy)]
        assert outs[0].grad_norm == outs[1].grad_norm == outs[2].grad_norm and outs[0].grad_norm > 0.05
    single = _windows(1, 1, seed=5)[0][0]   # a single micro-batch's final gradient is held the same way
    outs = [e.forward_backward(single["input_ids"], attention_mask=single["attention_mask"], step_lr=3e-3,
                               max_grad_norm=0.05) for e in (ram, auto, roomy)]
    assert outs[0].grad_norm == outs[1].grad_norm == outs[2].grad_norm
    assert _rel(auto, ram) == 0.0 and _rel(roomy, ram) == 0.0
    mem = auto.memory_report()
    assert mem["host"]["grads"] == 0 and mem["disk"]["grads"] >= grads
    assert ram.memory_report()["disk"]["grads"] == 0
    for e in (ram, auto, roomy):
        e.close()
    # without a disk tier, a budget for the master weights and half the gradients is refused (the
    # disk tier's own buffers in flight -- fp32 states read into whole-unit buffers -- can exceed
    # what RAM-held states cost for a model this small, so ``short`` itself may fit in RAM)
    tight = (ram.plan.host["weights"] + grads // 2) / GiB
    with pytest.raises(ValueError, match=r"max_host_gb=.*host RAM needs .* GiB .*gradients .* give an offload_dir"):
        StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", max_host_gb=tight))


def test_estimate_counts_gradients_held_on_disk():
    """The estimator plans as the engine: with clipping, final gradients that the host budget
    cannot hold beside the master weights go to the disk tier (clip_hold "auto", the default);
    the table shows them there. An accumulator (micro-batch-major) stays in RAM."""
    from megatrain_nb import estimate

    kw = dict(vram_gb=80, ram_gb=640, disk_gb=4096)   # (the master weights hold 373 GiB, 516 at powers of two)
    host = estimate("llama-100b", clip_hold="host", **kw)
    auto = estimate("llama-100b", **kw)
    assert host.feasible and host.plan.placement["gradients"] == "host" and host.plan.host["grads"] > 0
    assert auto.feasible and auto.plan.host["grads"] == 0 and auto.plan.disk["grads"] == host.plan.host["grads"]
    assert auto.plan.placement == {"gradients": "disk", "master_weights": "host", "optimizer_states": "disk"}
    disk_row = next(r for r in auto._rows()[1] if r[0] == "disk")
    assert disk_row[4] != "-"   # the gradients column of the disk row
    assert "gradients -> disk" in str(auto) and "wait for the global norm on the disk tier" in str(auto)
    big = estimate("llama-100b", **dict(kw, ram_gb=1024))   # the budget holds them: RAM
    assert big.plan.placement["gradients"] == "host" and big.plan.host["grads"] == host.plan.host["grads"]
    mbm = estimate("llama-100b", accumulation=4, layer_major=False, **kw)   # an accumulator: never on disk
    # (an accumulator is pinned, per unit in whole pages -- llama-100b's units are -- held gradients are not)
    assert mbm.plan.placement["gradients"] == "host" and mbm.plan.host["grads"] == host.plan.host["grads"]
    # the least host RAM: weights, held gradients, boundaries all on the disk tier
    assert auto.host_min == estimate("llama-100b", **dict(kw, ram_gb=1)).plan.host["total"]
    assert auto.host_min < auto.plan.host["total"] and "at least" in str(auto)
    assert mbm.host_min >= host.plan.host["grads"]


# ---------------------------------------------------------------------- the disk tier, the window's interval
@pytest.mark.parametrize("k", [1, 2])
def test_disk_tier_bitwise_same_as_host_tier_counted_per_tier(tmp_path, k):
    """window_tier='disk': the boundary activations go through the disk tier (written behind,
    read back in the backward's order, files removed once read); the weights are bitwise those
    of the host tier; bytes per tier in telemetry and memory_report."""
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    (tmp_path / "h").mkdir()
    (tmp_path / "d").mkdir()
    cfg = dict(device="cpu", checkpoint_interval=k)
    host = StreamingEngine(copy.deepcopy(model), EngineConfig(offload_dir=str(tmp_path / "h"), window_tier="host",
                                                              **cfg))
    disk = StreamingEngine(copy.deepcopy(model), EngineConfig(offload_dir=str(tmp_path / "d"), window_tier="disk",
                                                              **cfg))
    A, clip = 3, 0.05
    for w in _windows(3, A):
        outs = [e.forward_backward(w, step_lr=3e-3, max_grad_norm=clip) for e in (host, disk)]
        assert outs[0].loss == outs[1].loss and outs[0].grad_norm == outs[1].grad_norm
    assert _rel(disk, host) == 0.0
    layers = len(disk.layer_units)
    row = 2 * 12 * 32 * 4                                  # one micro-batch's hidden state (fp32)
    saved = -(-layers // k) * A * row                      # every k-th layer's input, every micro-batch
    lh, ld = host.telemetry()["last_step"], disk.telemetry()["last_step"]
    assert lh["boundary_bytes"] == {"device": 0, "host": saved, "disk": 0}
    assert ld["boundary_tier"] == "disk" and ld["boundary_bytes"] == {"device": 0, "host": 0, "disk": saved}
    n_keys = -(-layers // k) * A
    assert ld["boundary_disk_ops"] == {"writes": n_keys, "reads": n_keys}
    assert lh["boundary_disk_ops"] == {"writes": 0, "reads": 0}
    assert ld["loads_per_layer"] == lh["loads_per_layer"] == loads_per_layer(layers, k)
    mem = disk.memory_report()
    assert mem["disk"]["activations"] == saved and mem["host"]["activations"] == 0
    assert host.memory_report()["host"]["activations"] == saved
    assert not [key for key in disk.disk.keys() if key.startswith("boundary-")]   # read once, then removed
    # RAM holds only the transfers in flight: a few recycled buffers, not the window's activations
    assert disk.boundary.free_bytes() <= (disk.boundary.READ_AHEAD + disk.boundary.WRITES_IN_FLIGHT + 1) * row
    with pytest.raises(ValueError, match="window_tier='disk' needs an offload_dir"):
        EngineConfig(window_tier="disk")
    for e in (host, disk):
        e.close()


def test_window_plan_disk_tier_and_interval():
    row = 4096 * 8192 * 2     # one micro-batch's hidden state: 4096 tokens, hidden 8192, bf16
    kw = dict(tokens=4096, hidden_size=8192, num_layers=80, checkpoint_interval=1, compute_bytes=2)
    # device (10 GiB) and host (25 GiB) short for 16 x 80 GiB/16: the disk tier, interval 1
    p = window_plan(16, device_free=10 * GiB, host_free=25 * GiB, disk_free=None, **kw)
    assert (p.tier, p.groups, p.checkpoint_interval, p.loads_per_layer) == ("disk", 1, 1, 2)
    assert p.boundary_bytes == 16 * 80 * row and "on the disk" in p.reason
    # no disk tier: interval 2 halves them (40 GiB, still too many); 4 -> 20 GiB fit the host
    p = window_plan(16, device_free=10 * GiB, host_free=25 * GiB, **kw)
    assert (p.tier, p.groups, p.checkpoint_interval) == ("host", 1, 4)
    assert p.boundary_bytes == 16 * 20 * row and p.loads_per_layer == loads_per_layer(80, 4) == 2.75
    assert "checkpoint interval 4 for this window" in p.reason and "exact" in p.reason
    p = window_plan(16, device_free=10 * GiB, host_free=45 * GiB, **kw)   # interval 2 is enough
    assert (p.tier, p.checkpoint_interval, p.loads_per_layer) == ("host", 2, 2.5)
    # a too small disk tier counts as short too; nothing fits at any interval: split at the given one
    p = window_plan(16, device_free=10 * GiB, host_free=5 * GiB, disk_free=11 * GiB, **kw)
    assert (p.checkpoint_interval, p.tier, p.group_size, p.groups) == (1, "disk", 2, 8)   # 2 x 5 GiB
    # a fixed interval (raise_interval=False) is kept
    p = window_plan(16, device_free=10 * GiB, host_free=25 * GiB, raise_interval=False, **kw)
    assert p.checkpoint_interval == 1 and p.groups > 1


def test_engine_runs_a_window_at_the_planned_interval():
    """A window the planner gives interval 2 (its boundary activations then fit) gives the
    same weights as the micro-batch-major path at interval 1; the recompute adds the loads."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=4)).eval()
    ref = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu"))
    lm = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu"))
    row = 2 * 12 * 32 * 4
    plan_window = lm.plan_window

    def tight(batches):   # room on the "device" for the boundary activations at interval 2 only
        p = window_plan(len(batches), tokens=24, hidden_size=32, num_layers=4, checkpoint_interval=1,
                        compute_bytes=4, device_free=3 * (2 + 3) * row, host_free=0)
        assert plan_window(batches).checkpoint_interval == 1    # the engine's own plan: no limit here
        return p
    lm.plan_window = tight
    for w in _windows(3, 3):
        _micro_batch_major(ref, w, 3e-3)
        lm.forward_backward(w, step_lr=3e-3)
    assert _rel(lm, ref) <= 1e-5
    last = lm.telemetry()["last_step"]
    assert last["checkpoint_interval"] == 2 and last["loads_per_layer"] == 2.5 and last["groups"] == 1
    assert last["boundary_bytes"]["device"] == 2 * 3 * row   # layers 0 and 2, three micro-batches
    for e in (ref, lm):
        e.close()


def test_clipped_window_keeps_no_host_accumulator_and_pool_is_bounded():
    """After a clipped layer-major step no host gradient accumulator exists (the final
    gradients wait for the norm in buffers their updates give back); the recycled final-gradient
    buffers are bounded by what the plan counts for them -- the update pipeline's buffers in
    flight and the gradients held for the norm (the host's ``grads``) -- and a steady clipped
    step makes none afresh (each would be a new mapping faulted in on the compute's threads)."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=4)).eval()
    eng = StreamingEngine(model, EngineConfig(device="cpu"))
    pool = eng.updates.intake.pool
    in_flight = pool.max_bytes
    assert in_flight < 4 * eng.num_parameters() and in_flight >= max(u.numel for u in eng.units) * 4
    assert eng.plan.host["grads"] == 4 * eng.num_parameters() and eng.plan.host["buffers"] >= in_flight
    bound = eng.plan.host["grads"] + in_flight
    made = []
    for w in _windows(3, 3):
        before = pool.allocations
        out = eng.forward_backward(w, step_lr=1e-3, max_grad_norm=0.01)
        assert out.grad_norm > 0.01
        eng.updates.wait_all()
        made.append(pool.allocations - before)
        assert not [g for g in eng.store.grads.values() if g is not None]   # never allocated
        mem = eng.memory_report()
        assert mem["host"]["grads"] == 0 and eng.updates.held_ram_bytes() == 0
        assert eng.updates.buffer_bytes() <= bound
        assert mem["host"]["buffers"] >= eng.updates.buffer_bytes()   # counted where RAM is reported
    assert made[0] == len(eng.units) and made[1:] == [0, 0]   # one per unit, once
    assert pool.dropped == 0
    eng.close()


def test_estimate_puts_llama100b_boundaries_on_disk_and_says_so():
    """The seed's configuration (batch 1 x 2048 x accumulation 128, fp32, no clipping): the
    window's boundary activations (768 GiB) do not fit the device nor the host budget's free
    part, so they go to the disk tier. The window's boundaries and per-micro-batch work take the
    place of one micro-batch's saved layer inputs (the engine's own room, engine_window_plan,
    counts them so): at 80 GB the device work of all 128 fits beside the slots, the gradient
    buffers (issue 37: a unit's autograd outputs) and the sums -- one group, 2 loads per layer,
    no host accumulator; at 72 GB two groups (4 loads) and the host keeps the accumulator a
    later group adds into."""
    from megatrain_nb import estimate

    kw = dict(vram_gb=80, ram_gb=1024, disk_gb=4096, batch=1, seq=2048, accumulation=128, clipping=False)
    before = estimate("llama-100b", layer_major=False, **kw)
    after = estimate("llama-100b", **kw)
    w = after.plan.window
    assert (w["tier"], w["groups"], w["checkpoint_interval"], w["loads_per_layer"]) == ("disk", 1, 1, 2)
    # (96 x 8192 = 64 x 12288: 64 layers of hidden 12288, fp32)
    assert after.plan.disk["activations"] == w["boundary_bytes"] == 128 * 96 * 2048 * 8192 * 4
    assert "activations" not in after.plan.host and after.plan.host["grads"] == 0
    assert after.host_min < before.host_min - before.plan.host["grads"] // 2   # no accumulator
    assert after.feasible and w["tokens_per_weight_fetch"] == 2048 * 128 / 2
    assert after.plan.device["total"] <= 80 * 2 ** 30   # (the sums included)
    assert "on the disk" in after.notes[0] and "131,072 tokens per weight fetch" in after.notes[0]
    small = estimate("llama-100b", **dict(kw, vram_gb=72)).plan   # the device work of 128 does not fit
    assert (small.window["tier"], small.window["groups"], small.window["loads_per_layer"]) == ("disk", 2, 4)
    assert small.host["grads"] == before.plan.host["grads"]


def test_cpu_window_sums_are_pool_buffers_adopted_whole(monkeypatch):
    """On a CPU "device" each unit's sum over the window is a buffer lent by the update pool
    and adopted as the final gradient: after a warm-up step a window takes its sums from the
    pool, and the device tier accounts them (one unit at a time when untied)."""
    from megatrain_nb.engine.tiers import disk_store

    model = AutoModelForCausalLM.from_config(family_config("llama", tie=False)).eval()
    eng = StreamingEngine(model, EngineConfig(device="cpu"))
    windows = _windows(3, 3)
    eng.forward_backward(windows[0], step_lr=1e-3)
    eng.updates.wait_all()
    made = []
    real = disk_store.aligned_empty
    monkeypatch.setattr(disk_store, "aligned_empty", lambda *a, **k: made.append(a) or real(*a, **k))
    pool = eng.updates.intake.pool
    takes = []
    real_take = pool.take
    monkeypatch.setattr(pool, "take", lambda n: takes.append(n) or real_take(n))
    for w in windows[1:]:
        eng.forward_backward(w, step_lr=1e-3)
        eng.updates.wait_all()
    # recycled, not allocated (without the pool: one per unit per step; a slow update thread
    # may keep one more buffer in flight than the pool retained, so not always zero)
    assert len(made) < len(eng.units)
    # one pool buffer per unit per step: the sum, adopted (a copy on arrival would take a second);
    # each a slot of the largest unit's size (BufferPool.take_slot: the same few serve every unit)
    assert takes == [max(u.numel for u in eng.units)] * (len(eng.units) * 2)
    assert eng.updates.intake.pool.lent_count() == 0   # every lent sum came back as a final gradient
    largest = max(u.numel for u in eng.units) * 4
    assert eng.memory_report()["device"]["grad_sums"] == largest
    eng.close()

"""The planner's activation bytes of a decoder layer (planning/planner.LayerDims) against what
autograd really holds, counted on the models' own layers: the saved tensors' unique storages
(``saved_tensors_hooks``, weights excluded) and the live bytes of every tensor the layer's
forward-with-grad and backward allocate (a dispatch mode that follows each storage until it is
freed). Deterministic counts, no timings. The engine's meter (recompute.ActivationMeter) counts
the same re-run as the saved bytes plus the two widest gradients in flight."""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM

from megatrain_nb.engine.planning.planner import LayerDims, activation_bytes
from megatrain_nb.engine.recompute import ActivationMeter
from megatrain_nb.model_configs import family_config


class _Live(TorchDispatchMode):
    """Bytes of the storages ops allocate while it is on, live now and at the peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.ptrs = set()

    def _free(self, ptr, n):
        self.live -= n
        self.ptrs.discard(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr and ptr not in self.ptrs:
                    self.ptrs.add(ptr)
                    self.live += st.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._free, ptr, st.nbytes())
        return out


# (family, hidden, intermediate, heads, kv heads, config fields): Llama's SwiGLU, Qwen2's biases,
# Qwen3's per-head q/k norms with a head wider than hidden/heads, Gemma's fp32 norm weight and GeGLU
CASES = [("llama", 64, 176, 4, 2, {}), ("qwen2", 48, 128, 4, 1, {}),
         ("qwen3", 32, 96, 4, 2, dict(head_dim=16)), ("gemma", 32, 96, 4, 1, dict(head_dim=8))]


def _layer(family, hidden, inter, heads, kv, extra, dtype):
    cfg = family_config(family, layers=1, hidden=hidden, intermediate_size=inter, num_attention_heads=heads,
                        num_key_value_heads=kv, max_position_embeddings=4096, **extra) \
        if family in ("llama", "qwen2") else _config(family, hidden, inter, heads, kv, extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype).train()
    return cfg, model.model


def _config(family, hidden, inter, heads, kv, extra):
    from transformers import AutoConfig
    return AutoConfig.for_model(family, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                                num_attention_heads=heads, num_key_value_heads=kv, vocab_size=128,
                                max_position_embeddings=4096, **extra)


def _meter(slots):
    """An ActivationMeter with no boundary activations, ``slots`` the weights' storages."""
    boundary = type("Boundary", (), {"bytes": {"device": 0}})()
    return ActivationMeter(boundary, type("Pager", (), {"slot_storages": lambda self: slots})())


def _counted(inner, batch, seq, dtype, meter=None):
    """(saved bytes, the re-run's live peak) of one layer over ``batch`` x ``seq`` tokens."""
    layer = inner.layers[0]
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    for p in layer.parameters():   # weight gradients are the gradient sums' (accounted apart)
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    x = torch.randn(batch, seq, inner.config.hidden_size, dtype=dtype, requires_grad=True)
    pos = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    pe = inner.rotary_emb(x, pos)
    g = torch.randn_like(x)
    seen, saved = set(), [0]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            saved[0] += t.untyped_storage().nbytes()
        return t
    with _Live() as live:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if meter is not None:
                with meter.count_saved():
                    y = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
            else:
                y = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(g)
        del y
    return saved[0], live.peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_planned_saved_bytes_are_the_counted_ones(case, dtype):
    """Exact to 0.1% (RoPE's cos/sin are planned per token, held per position and row), at two shapes."""
    cb = 2 if dtype == torch.bfloat16 else 4
    for batch, seq in ((1, 64), (2, 256)):
        cfg, inner = _layer(*case, dtype)
        saved, _ = _counted(inner, batch, seq, dtype)
        tok = batch * seq
        assert LayerDims.of(cfg).saved_bytes(tok, tok, cb) == pytest.approx(saved, rel=1e-3), (batch, seq)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_planned_layer_work_is_the_backward_peak_and_the_meter_counts_it(case):
    """The planned re-run work (saved + output + two gradients in flight) within 0.9-1.05 of the
    live peak of the layer's forward-with-grad and backward; the meter's count of the same re-run
    within 0.9-1.05 of the plan (it sees no output: the incoming gradient it counts is that size)."""
    cfg, inner = _layer(*case, torch.float32)
    batch, seq = 2, 512
    slots = {p.untyped_storage().data_ptr() for p in inner.layers[0].parameters()}
    meter = _meter(slots)
    _, peak = _counted(inner, batch, seq, torch.float32, meter)
    planned = LayerDims.of(cfg).work_bytes(batch * seq, batch * seq, 4)
    assert 0.9 <= planned / peak <= 1.05, planned / peak
    assert 0.9 <= meter.peak / planned <= 1.05, meter.peak / planned


def test_checkpoint_intervals_plan_the_layer_inputs_beside_one_re_run():
    """Interval 1: every layer's input kept, one re-run beside them; interval 2: half the inputs
    and the block's inner input; interval 0: every layer's saved tensors and output."""
    dims = LayerDims(64, 176, 4, 2)
    kw = dict(hidden_size=64, intermediate_size=176, num_layers=4, vocab_size=0, batch=2, seq=512,
              compute_bytes=4, dims=dims)
    tok, row = 1024, 1024 * 64 * 4
    work = dims.work_bytes(tok, tok, 4)
    assert activation_bytes(checkpoint_interval=1, **kw) == 4 * row + work
    assert activation_bytes(checkpoint_interval=2, **kw) == 2 * row + row + work
    assert activation_bytes(checkpoint_interval=0, **kw) == 4 * (dims.saved_bytes(tok, tok, 4) + row) + work


def test_a_held_graphs_backward_is_counted_as_its_saved_bytes_and_two_gradients():
    """A vision tower's graph held from the capture (Qwen2-VL's, counted with ``hold``), run
    backward: the meter's count (note_held_backward) within 0.95-1.1 of the live peak, where 2x
    its saved bytes was ~1.9x."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2]})
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model("qwen2_vl", text_config=text,
                                                                         vision_config=vision)).train()
    visual = model.model.visual
    slots = {p.untyped_storage().data_ptr() for p in visual.parameters()}
    for p in visual.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    meter = _meter(slots)
    side = 16   # patches per side: one 224-pixel image, 64 merged tokens
    grid = torch.tensor([[1, side, side]] * 2)
    with _Live() as live:
        pixels = torch.randn(2 * side * side, 3 * 2 * 14 * 14)   # on the device, held with the graph
        with meter.count_saved(hold=True):
            out = visual(pixels, grid_thw=grid)
        out = getattr(out, "pooler_output", out)
        held = meter.held
        meter.held -= held
        meter.note_held_backward(held)
        out.backward(torch.randn_like(out))
        del out
    assert 0.95 <= meter.peak / live.peak <= 1.1, meter.peak / live.peak
    assert 2 * held / live.peak > 1.5   # what the old count said


@pytest.mark.parametrize("family,k,vocab,batch", [("llama", 1, 64, 2), ("qwen2", 2, 64, 2), ("llama", 1, 4096, 8)])
def test_the_engines_accounted_peak_is_the_plans_device_bytes(family, k, vocab, batch):
    """A step's device peak as the engine accounts it (weight slots, gradient sums, the meter's
    activations) within 0.9-1.05 of make_plan's device bytes for the same workload, as mt.estimate
    plans it (benchmarks/bench_vlm.py's text_device_peak_vs_plan, at a shape it was not tuned on).
    The third case's peak is the head's chunk (a wide vocabulary, 8 rows): loss_chunk_tokens over
    the batch's rows, as the engine cuts it (the plan took that many tokens a row: 8x the bytes).
    After the step the device holds only the slots and buffers ``persistent_device_bytes`` counts."""
    from megatrain_nb.engine import EngineConfig, StreamingEngine
    from megatrain_nb.engine.planning.planner import ModelShape, UnitSpec, Workload, make_plan, persistent_device_bytes

    cfg = family_config(family, layers=4, hidden=64, intermediate_size=176, vocab=vocab, max_position_embeddings=512)
    torch.manual_seed(0)
    work = Workload(batch=batch, seq=256)
    engine = StreamingEngine(AutoModelForCausalLM.from_config(cfg), EngineConfig(device="cpu", checkpoint_interval=k),
                             workload=work)
    try:
        ids = torch.randint(1, 64, (batch, 256))
        engine.forward_backward(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, step_lr=1e-4)
        dev = engine.memory_report()["device"]
        peak = dev["peak_bytes"]
        # what the step leaves on the device: the slots and gradient buffers persistent_device_bytes counts (the
        # room of a phase between steps, GRPO's generation: decode.device_left), none of its activations
        assert dev["weights"] == engine.plan.device["weights"] and dev["used_bytes"] == dev["weights"] + dev["grads"]
        assert dev["used_bytes"] <= persistent_device_bytes(engine.plan) < peak
        ecfg = engine.parts.config.replace(checkpoint_interval=engine.runner.checkpoint_interval)
        specs = [UnitSpec(u.name, u.numel, u.kind, u.tied_output) for u in engine.parts.units]
        planned = make_plan(specs, ModelShape.of(engine.model_config), ecfg, cuda=False, workload=work).device["total"]
    finally:
        engine.close()
    assert engine.runner.checkpoint_interval == k
    assert 0.9 <= peak / planned <= 1.05, (peak, planned)

"""EngineConfig.optimizer_threads: each update on a team of threads (updates/fused_update.py
``UpdateTeam``). A fused int8/int4 chunk is cut in contiguous pieces on codec blocks that the
AdamW worker, its ``mtnb-update`` helpers and the codec threads take in turn; a plain AdamW call
(fp32 states) is torch's fused kernel on the team's count of torch threads. Both are elementwise
with absolute indices, so N threads give one thread's weights and stored states bit for bit --
weight decay and learning-rate groups (``lr_scale``) crossing the pieces included. Also: lr_scale
with compressed states (one pass of the kernel, each group's piece at its own rate) against
torch.optim.AdamW's parameter groups, within the codec's error; the prediction's per-thread pricing."""
import copy
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.planning.prediction import ENGINE_CORE_THREADS, update_threads
from megatrain_nb.engine.updates import fused_update
from megatrain_nb.engine.updates.fused_update import UpdateTeam
from megatrain_nb.engine.vision import lr_scale_names
from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config
from megatrain_nb.values import ValueRefused
from tests.engine.test_vision_lr import BETAS, LR, WD, _groups, _llm_batches

SCALES = {"model.embed_tokens": 0.1, "model.layers.1.self_attn.q_proj": 3.0, "model.layers.1.input_layernorm": 2.0}


def _ids(steps, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (2, 12), generator=g) for _ in range(steps)]


def _engine(model, codec, threads, **kw):
    e = StreamingEngine(model, EngineConfig(device="cpu", optimizer_compression=codec, weight_decay=0.1,
                                            optimizer_threads=threads, overrides={"update_chunk_numel": 4096},
                                            **kw))
    if threads == 1:
        e.states.fused_split = 1   # a fused chunk on this thread alone: no codec threads joining
    return e


def _assert_same_training(a, b) -> None:
    """Two engines' weights and stored optimizer states equal bit for bit."""
    theirs = dict(b.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in a.named_parameters())
    for u in b.units:
        got, want = a.states.stored(u), b.states.stored(u)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), u.name


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of a few hundred elements, so a tiny model's units are split many times (and across
    the decay boundary and the learning-rate groups); the threads that ran a piece, by name."""
    monkeypatch.setattr(UpdateTeam, "MIN_SPLIT", 0)
    monkeypatch.setattr(UpdateTeam, "PIECE", 300)
    names = []
    real_adamw = torch._fused_adamw_
    k = fused_update.kernels()   # (built and checked against torch first: not spied on)
    base = lambda: threading.current_thread().name.rsplit("_", 1)[0]   # noqa: E731 - a pool's thread: its name

    def torch_spy(*a, **kw):
        names.append(f"{base()} torch x{torch.get_num_threads()}")
        return real_adamw(*a, **kw)
    monkeypatch.setattr(torch, "_fused_adamw_", torch_spy)
    if k is not None:
        for fn in ("update", "adamw"):
            real = getattr(k, fn)

            def spy(*a, _real=real, _fn=fn, **kw):
                names.append(f"{base()} {_fn}")
                return _real(*a, **kw)
            monkeypatch.setattr(k, fn, spy)
    return names


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_n_threads_equal_one_thread_bitwise(small_pieces, codec, clip):
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2, hidden=64))
    one = _engine(copy.deepcopy(model), codec, 1, lr_scale=SCALES)
    many = _engine(model, codec, 4, lr_scale=SCALES)
    assert one.adam.team.threads == 1 and many.adam.team.threads == 4
    for ids in _ids(3):
        a = one.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip)
        b = many.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip)
        assert a.loss == b.loss
    _assert_same_training(many, one)
    ran = set(small_pieces)
    if codec == "none":   # the team of 4: torch's fused AdamW, one call on 4 torch threads
        assert "mtnb-adamw torch x4" in ran and not any(r.startswith("mtnb-update") for r in ran), ran
    elif fused_update.kernels() is not None:   # the fused chunks' pieces on the helpers and the codec threads
        assert {"mtnb-adamw update", "mtnb-update update", "mtnb-decode update", "mtnb-encode update"} <= ran, ran
    one.close()
    many.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("mtnb-update")]   # closed with the engine


def test_the_plain_update_on_n_threads_equals_one_thread():
    """fp32 states on a team of 3: torch's fused AdamW on 3 torch threads (its split at cache
    lines); on one thread the fused kernels' AdamW (torch's arithmetic): the same floats, a scalar
    tail included, weight decay on."""
    from megatrain_nb.engine.updates.optimizer import UnitAdamW

    g = torch.Generator().manual_seed(0)
    n = 300_000 + 13   # over torch's grain, a tail on the scalar path
    p, gr = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3
    m, v = torch.randn(n, generator=g) * 1e-4, torch.rand(n, generator=g) * 1e-6
    step = torch.tensor(5.0)
    got = {}
    for threads in (1, 3):
        adam = UnitAdamW(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, threads=threads)
        t = [x.clone() for x in (p, gr, m, v)]
        adam.fused(t[0], t[1], t[2], t[3], step, 1e-3, 0.1)
        adam.close()
        got[threads] = t
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = [x.clone() for x in (p, gr, m, v)]
        torch._fused_adamw_([want[0]], [want[1]], [want[2]], [want[3]], [], [step], lr=1e-3, beta1=0.9,
                            beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    finally:
        torch.set_num_threads(prev)
    for threads in (1, 3):
        assert all(torch.equal(got[threads][i], want[i]) for i in (0, 2, 3)), threads


def test_the_default_thread_count_and_its_refusals():
    assert update_threads(False, cores=64) == 1                          # a CPU device: the compute has the cores
    assert update_threads(True, cores=14) == 14 - ENGINE_CORE_THREADS    # an H100 host of 14 cores
    assert update_threads(True, cores=2) == 1
    assert update_threads(True, cores=14, given=5) == 5 and update_threads(False, given=3) == 3
    for bad in (0, -1, 2.5, "many", True):
        with pytest.raises(ValueRefused, match="EngineConfig.optimizer_threads"):
            EngineConfig(optimizer_threads=bad)
    assert EngineConfig(optimizer_threads="3").optimizer_threads == 3


# a parameter's distance from torch's groups over its movement: the codecs' round-trip error
# (tests/engine/test_codecs.py: int8 2%, int4 15% per moment) compounded over three steps
BOUND = {"int8": 0.06, "int4": 0.3}   # (measured 0.023 and 0.153; the unscaled engine ~9)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_lr_scale_with_compressed_states_matches_torch_param_groups(codec):
    """Llama, weight decay on, three steps: the token embedding at lr x 0.1, layer 1's query at
    lr x 3 and its first norm at lr x 2 (a group ending inside an int8 block), the states int8 /
    int4. The fused kernel (each group's piece at its own scalars, one pass) gives the ring's
    decode / fp32 AdamW per piece / encode bit for bit; each parameter's distance from
    torch.optim.AdamW with those groups, over its movement there, stays within the codec's error;
    the same engine without the scales is far off on the scaled parameters."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2))
    scales = lr_scale_names(model, SCALES)
    ref, plain, ring_model, start = (copy.deepcopy(model) for _ in range(4))
    opt = _groups(ref, scales)
    cfg = dict(device="cpu", adam_betas=BETAS, weight_decay=WD, optimizer_compression=codec)
    engine = StreamingEngine(model, EngineConfig(**cfg, lr_scale=SCALES))
    ring = StreamingEngine(ring_model, EngineConfig(**cfg, lr_scale=SCALES))
    ring.states.fused = False
    unscaled = StreamingEngine(plain, EngineConfig(**cfg))
    layer1 = engine.units[2]
    if codec == "int8":   # a group boundary inside a codec block (the layer's 32-wide norm)
        assert any(e % 256 for s, e, _ in layer1.lr_segments), layer1.lr_segments
    for batch in _llm_batches(3, seed=5):
        ref(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        for e in (engine, ring, unscaled):
            e.forward_backward(batch)
            e.optimizer_step(LR)
            e.zero_grad()
    _assert_same_training(engine, ring)
    mine = dict(engine.named_parameters())
    w0 = dict(start.named_parameters())

    def worst(e, names):
        got = dict(e.named_parameters())
        with torch.no_grad():
            return max(float((got[n] - p).norm() / (p - w0[n]).norm()) for n, p in ref.named_parameters()
                       if n in names and float((p - w0[n]).norm()) > 0)
    assert worst(engine, set(mine)) <= BOUND[codec]
    assert worst(unscaled, set(scales)) > 3 * BOUND[codec]
    for e in (engine, ring, unscaled):
        e.close()


def test_the_prediction_prices_the_optimizer_per_thread_times_the_update_threads():
    """Made-up rates (tests/engine/test_prediction.py): AdamW at 1e9 a thread. On CUDA with 14
    cores each update gets 11 threads; optimizer_threads pins it; a CPU device keeps one. A
    measured compressed chain (3 threads of a CUDA host's measurement) is priced per thread times
    the update's threads; the estimate's words say how many."""
    from tests.engine.test_prediction import N, predict, rates

    gpu, *_ = predict(rates(cores=14))
    assert gpu.phases["optimizer"] == pytest.approx(N / (1e9 * 11))
    assert any("each update on 11 thread(s)" in o for o in gpu.overlaps)
    four, *_ = predict(rates(cores=14), optimizer_threads=4)
    assert four.phases["optimizer"] == pytest.approx(N / 4e9)
    cpu, *_ = predict(rates(cores=14, compute_threads=1), cuda=False)
    assert cpu.phases["optimizer"] == pytest.approx(N / 1e9)
    chain = dict(cores=14, update_chain={"int8": 3e8}, update_chain_threads=3)
    slow, *_ = predict(rates(**chain), optimizer_threads=3, optimizer_compression="int8", clipped=True)
    fast, *_ = predict(rates(**chain), optimizer_compression="int8", clipped=True)   # 11 threads
    assert slow.streams["optimizer"] == pytest.approx(N / 3e8)
    assert fast.streams["optimizer"] == pytest.approx(N / (1e8 * 11))

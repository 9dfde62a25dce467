"""Optimizer-state codecs: exact code round trips, error bounds, the never-zero v guarantee."""

import pytest
import torch

from megatrain_nb.engine.updates.codecs import (
    CODEC_NAMES,
    RECOMMENDED_CODEC,
    ROLES,
    StateCodec,
    get_codec,
    normalize_compression,
)

QUANTISED = [(n, r) for n in ("int8", "int4") for r in ROLES]
ALL = [(n, r) for n in CODEC_NAMES for r in ROLES]


def adam_moments(numel: int, seed: int = 0, steps: int = 8):
    """m, v after a few Adam steps on gradients whose scale varies over ~4 decades by row."""
    g = torch.Generator().manual_seed(seed)
    rows = -(-numel // 64)
    scale = torch.pow(10.0, -6 + 4 * torch.rand(rows, 1, generator=g)).expand(rows, 64)
    scale = scale.reshape(-1)[:numel]
    m, v = torch.zeros(numel), torch.zeros(numel)
    for _ in range(steps):   # heavy-tailed gradients: gaussian times a log-normal factor
        grad = torch.randn(numel, generator=g) * torch.randn(numel, generator=g).mul_(0.7).exp_()
        grad.mul_(scale)
        m.mul_(0.9).add_(grad, alpha=0.1)
        v.mul_(0.999).addcmul_(grad, grad, value=0.001)
    return m, v


def roundtrip(codec, x):
    return codec.decode(codec.encode(x), torch.empty_like(x))


@pytest.mark.parametrize("name,role", ALL)
@pytest.mark.parametrize("numel", [1, 31, 255, 257, 70_001])
def test_codes_round_trip_exactly_and_decode_is_deterministic(name, role, numel):
    codec = get_codec(name, role)
    assert isinstance(codec, StateCodec)
    m, v = adam_moments(numel)
    x = m if role == "exp_avg" else v
    enc = codec.encode(x)
    assert set(enc) == ({"codes"} if name == "none" else {"codes", "scales"})
    assert all(t.device.type == "cpu" for t in enc.values())
    assert sum(t.numel() * t.element_size() for t in enc.values()) == codec.encoded_nbytes(numel)
    out = torch.full((numel,), float("nan"))
    assert codec.decode(enc, out) is out
    again = codec.encode(out)
    for k in enc:                           # stored codes and scales are a fixed point
        assert torch.equal(enc[k], again[k]), k
    stored = {k: t.clone() for k, t in enc.items()}      # as if saved and loaded
    assert torch.equal(codec.decode(stored, torch.empty(numel)), out)
    assert torch.equal(codec.encode(x)["codes"], enc["codes"])  # encoding is reproducible


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name,bound_m,bound_sqrt_v", [("none", 0.0, 0.0), ("int8", 0.02, 0.02),
                                                        ("int4", 0.15, 0.15)])
def test_relative_error_on_adam_moments(name, bound_m, bound_sqrt_v):
    m, v = adam_moments(65_536, seed=1)
    m_hat = roundtrip(get_codec(name, "exp_avg"), m)
    v_hat = roundtrip(get_codec(name, "exp_avg_sq"), v)
    assert _rel(m_hat, m) <= bound_m
    assert _rel(v_hat.sqrt(), v.sqrt()) <= bound_sqrt_v   # sqrt(v) is what scales the update
    # element-wise, for the entries that dominate their block
    if name == "int8":
        mb, mhb = m.view(-1, 256), m_hat.view(-1, 256)
        big = mb.abs() >= 0.1 * mb.abs().amax(1, keepdim=True)
        assert float(((mhb - mb).abs() / mb.abs())[big].max()) <= 0.03
        assert torch.equal(torch.sign(mhb)[big], torch.sign(mb)[big])
        vb, vhb = v.view(-1, 256), v_hat.view(-1, 256)
        big = vb >= 1e-4 * vb.amax(1, keepdim=True)
        assert float(((vhb.sqrt() - vb.sqrt()).abs() / vb.sqrt())[big].max()) <= 0.085


def test_int8_is_much_closer_than_a_linear_map():
    _, v = adam_moments(65_536, seed=2)
    vb = v.view(-1, 256)
    s = vb.amax(1, keepdim=True)
    linear = (torch.round(vb / s * 255) / 255 * s).view(-1)
    ours = roundtrip(get_codec("int8", "exp_avg_sq"), v)
    assert _rel(ours.sqrt(), v.sqrt()) * 5 < _rel(linear.sqrt(), v.sqrt())


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_second_moment_never_decodes_to_zero_for_positive_input(name):
    codec = get_codec(name, "exp_avg_sq")
    x = torch.rand(4096) * 1e-8
    x[::7] = 1e-30                                     # tiny values
    x[::13] = 0.0                                      # exact zeros are allowed anywhere
    x[5::64] = 1e3                                     # huge dynamic range inside blocks
    x[100:132] = 1e-30                                 # a whole int4 block of tiny values
    x[200:232] = torch.tensor([1e-38, 1e-40, 1e-45] * 10 + [0.0, 2e-45])  # subnormals
    x[300:332] = torch.tensor([3e-38] + [1e-45] * 31)  # decoded levels would underflow fp32
    x[-3:] = torch.tensor([1e-30, 7.0, 1e-30])         # ragged tail
    out = roundtrip(codec, x)
    assert bool((out[x > 0] > 0).all())
    assert bool(torch.isfinite(out).all()) and bool((out >= 0).all())


def test_all_zero_blocks_decode_to_zero():
    for name, role in QUANTISED:
        codec = get_codec(name, role)
        assert torch.equal(roundtrip(codec, torch.zeros(1000)), torch.zeros(1000))


def test_first_moment_is_sign_symmetric_at_int8_and_keeps_signs():
    codec = get_codec("int8", "exp_avg")
    m, _ = adam_moments(4096, seed=3)
    assert torch.equal(roundtrip(codec, -m), -roundtrip(codec, m))
    for name in ("int8", "int4"):
        out = roundtrip(get_codec(name, "exp_avg"), m)
        assert bool((out * m >= 0).all())             # never flips a sign


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_second_moment_follows_a_slow_moving_average(name):
    """beta2 = 0.999 moves v by 0.1 % per step, less than a code step: round-to-nearest would
    freeze it. The stochastic rounding must keep the stored average unbiased."""
    codec = get_codec(name, "exp_avg_sq")
    g = torch.Generator().manual_seed(4)
    target = torch.rand(1024, generator=g) + 0.5       # E[g^2] per entry
    v, v_q = torch.zeros(1024), torch.zeros(1024)
    noise = torch.randn(1500, 1024, generator=g).square_()      # chi-square(1) gradient noise
    for step in range(1500):
        g2 = target * noise[step]
        v.mul_(0.999).add_(g2, alpha=0.001)
        v_q.mul_(0.999).add_(g2, alpha=0.001)
        v_q = roundtrip(codec, v_q)
    ratio = float(v_q.mean() / v.mean())
    # int8 is unbiased; int4 rounds stochastically in v**(1/4), which biases v high (updates
    # slightly damped, never inflated). Frozen round-to-nearest would be far off either way.
    lo, hi = (0.98, 1.02) if name == "int8" else (1.0, 1.25)
    assert lo < ratio < hi, ratio


def test_bytes_per_param_order():
    for numel in (1000, 4097, 1 << 20):   # codes are padded to whole blocks: tiny tensors excepted
        for role in ROLES:
            none, i8, i4 = (get_codec(n, role).encoded_nbytes(numel) for n in CODEC_NAMES)
            assert none > i8 > i4
    n = 1 << 20
    assert get_codec("int8", "exp_avg").encoded_nbytes(n) / n == pytest.approx(1 + 4 / 256)
    assert get_codec("int4", "exp_avg_sq").encoded_nbytes(n) / n == pytest.approx(0.5 + 4 / 32)


def test_empty_input():
    for name, role in ALL:
        codec = get_codec(name, role)
        enc = codec.encode(torch.empty(0))
        assert codec.decode(enc, torch.empty(0)).numel() == 0
        assert codec.encoded_nbytes(0) == 0


def test_bad_inputs_are_rejected():
    codec = get_codec("int8", "exp_avg_sq")
    with pytest.raises(ValueError, match="non-negative"):
        codec.encode(torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="NaN or Inf"):
        get_codec("int8", "exp_avg").encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(TypeError, match="float32"):
        codec.encode(torch.ones(4, dtype=torch.float64))
    with pytest.raises(TypeError):
        codec.encode(torch.ones(2, 2))
    enc = codec.encode(torch.ones(300))
    with pytest.raises(ValueError, match="300|do not match"):
        codec.decode(enc, torch.empty(1000))
    with pytest.raises(ValueError, match="role"):
        get_codec("int8", "momentum")


def test_normalize_compression():
    assert normalize_compression(True) == RECOMMENDED_CODEC
    assert RECOMMENDED_CODEC in CODEC_NAMES and RECOMMENDED_CODEC != "none"
    assert normalize_compression(False) == "none"
    assert normalize_compression(None) == "none"
    assert normalize_compression(" INT4 ") == "int4"
    for bad in ("int2", "lossless", 8, 1.0):
        with pytest.raises(ValueError) as err:
            normalize_compression(bad)
        for allowed in CODEC_NAMES:
            assert allowed in str(err.value)
    with pytest.raises(ValueError, match="int8"):
        get_codec("fp8", "exp_avg")


def test_no_codec_calls_itself_lossless():
    from megatrain_nb.engine.updates import codecs

    for obj in [codecs] + [get_codec(n, r) for n, r in QUANTISED]:
        doc = (obj.__doc__ or "") + (type(obj).__doc__ or "")
        assert "lossless" not in doc.lower()


def _plain_int8_codes(role: str, x: torch.Tensor) -> torch.Tensor:
    """The int8 codes by the formula of the codec's docstring, with plain ``torch.sqrt`` on
    every element (MKL's slow path for zeros included): the reference for the fast path."""
    xb = x.view(-1, 256)
    if role == "exp_avg":
        mx = xb.abs().amax(dim=1, keepdim=True)
        k = torch.rsqrt(mx.clamp_min(2.0**-149)) * 127.0
        return torch.copysign(torch.round(xb.abs().sqrt() * k), xb).to(torch.int8).view(-1)
    mx = xb.amax(dim=1, keepdim=True)
    k = torch.rsqrt(mx.clamp_min(2.0**-149).sqrt()) * 255.0
    low = torch.bitwise_and(xb.view(torch.int32), 0xFFFF).add(65).float()
    r = (xb.sqrt().sqrt() * k).add_(low, alpha=(1.0 - 2.0 * 2.0**-10) / 65536.0)
    return r.clamp(1.0, 255.5).to(torch.int32).to(torch.uint8).view(-1)


@pytest.mark.parametrize("role", ["exp_avg", "exp_avg_sq"])
def test_moments_full_of_zeros_and_tiny_blocks_encode_as_the_plain_formula(role):
    """The encoder keeps zeros and subnormals away from sqrt (MKL's slow path, 3-35x slower),
    and its codes stay those of the plain formula: blocks with scattered zeros, all-zero blocks
    (an embedding's unused rows), blocks below 2**-60 (scaled into range), normal blocks."""
    g = torch.Generator().manual_seed(3)
    n = 256 * 64
    x = torch.rand(n, generator=g) * 1e-6
    if role == "exp_avg":
        x = x * torch.randn(n, generator=g).sign()
    x[::3] = 0.0                                   # scattered zeros
    x[256 * 4:256 * 12] = 0.0                      # all-zero blocks
    x[256 * 20:256 * 24] *= 1e-14                  # blocks below 2**-60, values still normal
    x[256 * 30:256 * 31] *= 1e-33                  # a block of subnormals
    codec = get_codec("int8", role)
    enc = codec.encode(x)
    assert torch.equal(enc["codes"], _plain_int8_codes(role, x))
    assert torch.equal(enc["scales"], x.view(-1, 256).abs().amax(dim=1))


# ------------------------------------------------------------------ the fused kernels
from megatrain_nb.engine.updates import fused_update  # noqa: E402

needs_kernels = pytest.mark.skipif(fused_update.kernels() is None,
                                   reason=f"no fused kernels: {fused_update.disabled_reason()}")


class _IeeeSqrt:
    """torch's Tensor.sqrt / sqrt_ with the IEEE square root (numpy's) in place of MKL's."""

    def __enter__(self):
        import numpy as np

        self.saved = torch.Tensor.sqrt, torch.Tensor.sqrt_
        torch.Tensor.sqrt = lambda t: torch.from_numpy(np.sqrt(t.contiguous().numpy()))
        torch.Tensor.sqrt_ = lambda t: t.copy_(torch.from_numpy(np.sqrt(t.contiguous().numpy())))

    def __exit__(self, *exc):
        torch.Tensor.sqrt, torch.Tensor.sqrt_ = self.saved


def _hard_moments(numel, seed):
    m, v = adam_moments(numel, seed=seed)
    m[::13], v[::17] = 0.0, 0.0                     # scattered zeros
    v[5::97] *= 1e-33                               # subnormals
    if numel > 4096:
        m[1024:2048], v[1024:2048] = 0.0, 0.0       # all-zero blocks
        v[2048:2304] *= 1e-20                       # a block below 2**-60
        m[2304:2560] *= 1e-25
    return m, v


@needs_kernels
@pytest.mark.parametrize("name,role", QUANTISED)
@pytest.mark.parametrize("numel", [1, 31, 257, 70_001, 1 << 20])
def test_kernel_codes_are_the_torch_formula_with_ieee_roots_bit_for_bit(name, role, numel):
    """The fused kernels compute the torch path's codes and scales op for op, with one
    difference: the square root is the IEEE one (MKL's rounds ~0.5% of inputs one ulp low).
    With that root in the torch path, codes and scales are equal bit for bit; decoding (no
    root) is equal bit for bit as it is."""
    codec = get_codec(name, role)
    m, v = _hard_moments(numel, seed=numel)
    x = m if role == "exp_avg" else v
    got = codec.encode(x)
    with _IeeeSqrt():
        want = codec.encode_torch(x)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    today = codec.encode_torch(x)                   # MKL's roots: one level apart at most, rarely
    d = (got["codes"].view(torch.uint8).to(torch.int32) - today["codes"].view(torch.uint8).to(torch.int32))
    if codec.codes_per_byte == 2:
        d = torch.stack([(got["codes"] & 15).int() - (today["codes"] & 15).int(),
                         (got["codes"] >> 4).int() - (today["codes"] >> 4).int()])
    assert int(d.abs().max()) <= 1 and int((d != 0).sum()) <= max(1, numel // 100_000)
    assert torch.equal(got["scales"], today["scales"])
    a, b = torch.empty(numel), torch.empty(numel)
    assert torch.equal(codec.decode(today, a), codec.decode_torch(today, b))


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("decay_end", [0, 1000, 4096 + 5, 10_000])
def test_fused_update_equals_decode_torch_adamw_encode(name, decay_end):
    """One pass (decode, AdamW, encode) against the codecs around torch._fused_adamw_, called
    as the engine calls it (split where weight decay stops): weights and codes bit for bit,
    torch's scalar tail (numel % its vector width) included."""
    n = 10_000 + 3
    m, v = _hard_moments(n, seed=5)
    g = torch.Generator().manual_seed(6)
    p, grads = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3
    codecs = {r: get_codec(name, r) for r in ROLES}
    stored = {f"{r}.{k}": t for r, x in zip(ROLES, (m, v)) for k, t in codecs[r].encode(x).items()}
    step, lr, wd = torch.tensor(7.0), 3e-3, 0.1
    want_p, mm, vv = p.clone(), torch.empty(n), torch.empty(n)
    for r, t in zip(ROLES, (mm, vv)):
        codecs[r].decode({k: stored[f"{r}.{k}"] for k in ("codes", "scales")}, t)
    for lo, hi, w in ((0, decay_end, wd), (decay_end, n, 0.0)):
        if hi > lo:
            torch._fused_adamw_([want_p[lo:hi]], [grads[lo:hi]], [mm[lo:hi]], [vv[lo:hi]], [], [step], lr=lr,
                                beta1=0.9, beta2=0.95, weight_decay=w, eps=1e-8, amsgrad=False, maximize=False)
    want = {f"{r}.{k}": t for r, x in zip(ROLES, (mm, vv)) for k, t in codecs[r].encode(x).items()}
    k = fused_update.kernels()
    got_p, out = p.clone(), {key: torch.empty_like(t) for key, t in stored.items()}
    args = fused_update.adam_args(lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd, step=7.0,
                                  decay_end=decay_end, regions=[(0, decay_end), (decay_end, n)], width=k.width)
    k.update(name, got_p, grads, stored, out, 0, args)
    assert torch.equal(got_p, want_p)
    for key in want:
        assert torch.equal(out[key], want[key]), key
    k.update(name, p.clone(), grads, stored, stored, 0, args)     # in place: the same codes
    assert all(torch.equal(stored[key], want[key]) for key in want)


@needs_kernels
def test_kernel_adamw_equals_torch_fused_adamw_and_optim_adamw():
    k = fused_update.kernels()
    for n in (1, 7, 1000, 4099):
        g = torch.Generator().manual_seed(n)
        p, grads = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
        m, v = torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-4
        ref = [t.clone() for t in (p, m, v)]
        torch._fused_adamw_([ref[0]], [grads], [ref[1]], [ref[2]], [], [torch.tensor(4.0)], lr=1e-3, beta1=0.9,
                            beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
        got = [t.clone() for t in (p, m, v)]
        k.adamw(got[0], grads, got[1], got[2], 0, fused_update.adam_args(
            lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=4.0, decay_end=n,
            regions=[(0, n)], width=k.width))
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), n
        param = torch.nn.Parameter(p.clone())        # torch.optim.AdamW: within fp32 rounding
        opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01)
        for _ in range(4):
            param.grad = grads.clone()
            opt.step()
        got = p.clone()
        mm, vv = torch.zeros(n), torch.zeros(n)
        for s in range(1, 5):
            k.adamw(got, grads, mm, vv, 0, fused_update.adam_args(
                lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=float(s), decay_end=n,
                regions=[(0, n)], width=k.width))
        assert torch.allclose(got, param.detach(), rtol=0, atol=1e-6)


def test_torch_path_is_the_fallback_and_says_why():
    with fused_update.torch_path():
        assert fused_update.kernels() is None and "torch_path" in fused_update.disabled_reason()
        codec = get_codec("int8", "exp_avg_sq")
        _, v = adam_moments(1000)
        assert torch.equal(codec.encode(v)["codes"], codec.encode_torch(v)["codes"])


@needs_kernels
def test_the_portable_build_computes_what_the_simd_build_does(tmp_path):
    """The kernels' AVX-512 paths (int4 levels by lane permute, nibble packing) against their
    plain C fallbacks (-DMT_NO_SIMD, what a CPU without AVX-512 runs)."""
    import ctypes
    import subprocess

    src = tmp_path / "k.c"
    src.write_text(fused_update.SOURCE)
    so = tmp_path / "k.so"
    cc = fused_update.kernels().compiler
    subprocess.run([cc, *fused_update.FLAGS, "-DMT_NO_SIMD", "-o", str(so), str(src), "-lm"], check=True)
    plain = fused_update.Kernels(ctypes.CDLL(str(so)), str(so))
    m, v = _hard_moments(70_001, seed=9)
    for name, role in QUANTISED:
        x = m if role == "exp_avg" else v
        codec = get_codec(name, role)
        want = codec.encode(x)
        got = {k: torch.empty_like(t) for k, t in want.items()}
        assert plain.encode(name, role, x, got["codes"], got["scales"]) == 0
        assert all(torch.equal(got[k], want[k]) for k in want), (name, role)
        a = torch.empty(x.numel())
        plain.decode(name, role, want["codes"], want["scales"], a)
        assert torch.equal(a, codec.decode(want, torch.empty(x.numel())))


@needs_kernels
def test_kernel_adamw_is_torch_fused_adamw_bit_for_bit_over_many_steps_and_betas():
    """One division fewer than torch (the constant one by a reciprocal and one exact residual
    step): the same floats, over wide moments, steps and betas."""
    k = fused_update.kernels()
    g = torch.Generator().manual_seed(11)
    n = 1 << 18
    for beta2, step, wd in ((0.999, 1.0, 0.01), (0.95, 37.0, 0.0), (0.9999, 5000.0, 0.1), (0.98, 123457.0, 0.01)):
        scale = torch.pow(10.0, -12 + 10 * torch.rand(n, generator=g))
        p, grads = torch.randn(n, generator=g), torch.randn(n, generator=g) * scale
        m, v = torch.randn(n, generator=g) * scale, torch.rand(n, generator=g) * scale.square()
        v[::7] = 0.0
        ref = [t.clone() for t in (p, m, v)]
        torch._fused_adamw_([ref[0]], [grads], [ref[1]], [ref[2]], [], [torch.tensor(step)], lr=2e-3, beta1=0.9,
                            beta2=beta2, weight_decay=wd, eps=1e-8, amsgrad=False, maximize=False)
        got = [t.clone() for t in (p, m, v)]
        k.adamw(got[0], grads, got[1], got[2], 0, fused_update.adam_args(
            lr=2e-3, beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=wd, step=step, decay_end=n, regions=[(0, n)],
            width=k.width), threads=2)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), (beta2, step)


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_kernel_results_do_not_depend_on_its_threads(name):
    k = fused_update.kernels()
    n = (1 << 19) + 4099                                   # above the kernels' split size
    m, v = _hard_moments(n, seed=12)
    g = torch.Generator().manual_seed(13)
    p, grads = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3
    stored = {f"{r}.{key}": t for r, x in zip(ROLES, (m, v)) for key, t in get_codec(name, r).encode(x).items()}
    args = fused_update.adam_args(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3.0,
                                  decay_end=n // 3, regions=[(0, n // 3), (n // 3, n)], width=k.width)
    outs = []
    for threads in (1, 3):
        w, out = p.clone(), {key: torch.empty_like(t) for key, t in stored.items()}
        k.update(name, w, grads, stored, out, 0, args, threads=threads)
        outs.append((w, out))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(outs[0][1][key], outs[1][1][key]) for key in stored)
    plain = [[t.clone() for t in (p, m, v)] for _ in range(2)]
    for threads, (w, mm, vv) in zip((1, 3), plain):
        k.adamw(w, grads, mm, vv, 0, args, threads=threads)
    assert all(torch.equal(a, b) for a, b in zip(*plain))


def test_without_a_compiler_the_torch_path_runs_and_says_why_once(monkeypatch, caplog):
    monkeypatch.setattr(fused_update, "_compiler", lambda: None)
    for key, value in (("tried", False), ("kernels", None), ("why", None)):
        monkeypatch.setitem(fused_update._STATE, key, value)
    with caplog.at_level("WARNING", logger="megatrain_nb.engine.updates.fused_update"):
        assert fused_update.kernels() is None and fused_update.kernels() is None
    assert "no C compiler" in fused_update.disabled_reason()
    assert caplog.text.count("fused update kernels unavailable (no C compiler") == 1
    codec = get_codec("int8", "exp_avg_sq")
    _, v = adam_moments(1000)
    assert torch.equal(codec.encode(v)["codes"], codec.encode_torch(v)["codes"])

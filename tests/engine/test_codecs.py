"""Optimizer-state codecs: exact code round trips, error bounds, the never-zero v guarantee."""

import pytest
import torch

from megatrain_nb.engine.codecs import (
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
    from megatrain_nb.engine import codecs

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

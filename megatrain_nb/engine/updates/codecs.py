"""Optimizer-state codecs: how the Adam moments are stored in the host and disk tiers.

Full precision in this project means fp32 master weights and fp32 gradients. Only the two Adam
moments (``exp_avg`` = m, ``exp_avg_sq`` = v) may be stored compressed. The optimizer always
runs in fp32: the engine decodes a unit's moments into fp32, runs PyTorch's fused AdamW's
arithmetic, and encodes them again -- where the fused kernels are built
(:mod:`.fused_update`), all three in one pass per block, and ``encode``/``decode`` here run
them too; else on the torch ops below (``encode_torch``/``decode_torch``). The two compute
the same codes except where MKL's ``sqrt`` (torch's) rounds a root one ulp below the IEEE one
the kernels use and that ulp crosses a code boundary: 2 in 1.3·10**8 codes measured, one
level apart.

Codecs (``get_codec(name, role)``)::

    name   role        stored form                                   bytes / param
    none   both        fp32 as is                                    4
    int8   exp_avg     block 256, fp32 absmax scale, int8 code c in [-127, 127],
                       value = sign(c) * (|c|/127)**2 * scale          1 + 4/256
    int8   exp_avg_sq  block 256, fp32 max scale, uint8 code c in [1, 255],
                       value = (c/255)**4 * scale                      1 + 4/256
    int4   exp_avg     block 32, fp32 absmax scale, 4-bit code c in [-8, 7],
                       value = -(|c|/8)**2 * scale (c < 0), (c/7)**2 * scale (c >= 0)
                                                                     0.5 + 4/32
    int4   exp_avg_sq  block 32, fp32 max scale, 4-bit code k in [0, 15],
                       value = ((k+1)/16)**4 * scale  (no zero level) 0.5 + 4/32

Why these maps (measured against fp32 AdamW with ``benchmarks/bench_codec_speed.py --tracking``,
a tiny Llama trained on CPU):

* Adam moments span several decades inside a block, so a linear map is poor. Quantising
  ``sqrt(|m|)`` and ``v ** (1/4)`` (i.e. ``sqrt`` of ``sqrt(v)``) linearly gives fine steps near
  the block maximum, where the entries that dominate the update live, and a wide range below
  it. For v this also makes the error in ``sqrt(v)`` -- what divides the update -- uniform.
* m changes by 10 % of the gradient per step (beta1 = 0.9), far more than a code step, so
  round-to-nearest is right for it. v changes by only 0.1 % per step (beta2 = 0.999), less than
  half a code step, so round-to-nearest freezes v and the update error keeps growing (about 21 %
  after 1500 steps at 8 bits, against 7 % with the rounding below). v is therefore
  *stochastically* rounded, which keeps the moving average unbiased at 8 bits (at 4 bits the
  rounding is unbiased in ``v ** (1/4)``, so v is biased high: updates are damped, not inflated).
  The dither is a deterministic function of the input value (its low 16 mantissa bits, close to
  uniformly distributed), so encoding is reproducible and needs no random state to save.
* The second moment never decodes to zero for a positive input: the int8 code is at least 1,
  the int4 map has no zero level (its lowest level is ``scale / 65536``), and a decoded value
  that would underflow fp32 is raised to the smallest positive float. A decoded v that is too
  small would blow the update ``m / (sqrt(v) + eps)`` up; one that is too large only damps it.
  An all-zero block (scale 0) decodes to zeros.
* Measured (tiny Llama, 1500 steps): int8 tracks the fp32 Adam update within ~7 % and the loss
  within run-to-run noise; int4's update error is ~30-40 %. Its loss also stayed within noise
  there, which a tiny model does not prove for a large one.

What is exact and what is not: the quantised codecs are lossy with respect to fp32 Adam. The
stored codes and scales round-trip bit-exactly (saving and loading them is exact, so resume is
exact), decoding is deterministic, and ``encode(decode(encode(x)))`` reproduces the codes and
scales of ``encode(x)``.

Example::

    >>> import torch
    >>> from megatrain_nb.engine.updates.codecs import get_codec
    >>> codec = get_codec("int8", "exp_avg_sq")
    >>> v = torch.rand(1000) * 1e-6
    >>> enc = codec.encode(v)                     # {"codes": uint8[1024], "scales": fp32[4]}
    >>> back = codec.decode(enc, torch.empty_like(v))
    >>> codec.encoded_nbytes(v.numel())
    1040
"""

from __future__ import annotations

import threading
from typing import Callable, Protocol, runtime_checkable

import torch

from .fused_update import encode_error, kernels

__all__ = [
    "CODECS",
    "CODEC_NAMES",
    "INT4_BLOCK",
    "INT8_BLOCK",
    "RECOMMENDED_CODEC",
    "ROLES",
    "StateCodec",
    "codec_names",
    "get_codec",
    "normalize_compression",
    "register_codec",
]

#: What ``optimizer_compression=True`` maps to: int8 tracks fp32 AdamW closely, int4 visibly
#: less (see the module docstring and ``benchmarks/bench_codec_speed.py --tracking``).
RECOMMENDED_CODEC: str = "int8"
ROLES = ("exp_avg", "exp_avg_sq")
INT8_BLOCK = 256
INT4_BLOCK = 32

# Elements per vectorised step: a multiple of both block sizes. Each step is some fifteen torch
# calls, and each call takes the GIL back when its kernel ends: in a training step the compute
# thread's Python holds the GIL often, and at 64K elements a step the encode thread ran at half
# its rate alone waiting for it (measured on the 2-core machine, beside a thread running small
# torch ops). 256K elements (1 MiB of fp32: the temporaries stay in a server core's L2 and L3)
# are 1.3-2x faster alone (benchmarks/bench_codec_speed.py) and about 2.5x faster beside such a
# thread; 512K and more lose the caches.
_CHUNK = 1 << 18
_F32_MIN_SUBNORMAL = 2.0**-149
_F32_MIN_NORMAL = 2.0**-126
# Dither u in [_DELTA, 1 - _DELTA]: a decoded value re-encodes to its own code even with a few
# ulps of rounding error, which makes encode(decode(encode(x))) reproduce the codes exactly.
_DELTA = 2.0**-10
_DITHER_ALPHA = (1.0 - 2.0 * _DELTA) / 65536.0


def dither_alpha() -> float:
    """The dither's step (``u = alpha * (low 16 bits + 65)``), for the fused kernels."""
    return _DITHER_ALPHA


@runtime_checkable
class StateCodec(Protocol):
    """Stores one 1-D fp32 optimizer-state tensor in a compact form.

    ``encode(x)`` takes a 1-D fp32 CPU tensor of any length and returns a dict of CPU tensors:
    ``"codes"`` (and ``"scales"`` for the quantised codecs), nothing else. ``decode(enc, out)``
    writes the fp32 values into ``out`` (1-D, same numel as the encoded tensor) and returns it.
    ``encoded_nbytes(numel)`` is the exact size of what ``encode`` returns.
    """

    name: str

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def decode(self, enc: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor: ...

    def encoded_nbytes(self, numel: int) -> int: ...


def normalize_compression(value) -> str:
    """Map a user's ``optimizer_compression`` setting to a codec name.

    ``True`` -> ``RECOMMENDED_CODEC``; ``False``/``None`` -> ``"none"``; a string must name a
    registered codec (:func:`codec_names`; case and surrounding spaces ignored).

    >>> normalize_compression(True)
    'int8'
    """
    if value is None or value is False:
        return "none"
    if value is True:
        return RECOMMENDED_CODEC
    if isinstance(value, str):
        name = value.strip().lower()
        if name in CODECS:
            return name
    raise ValueError(
        f"optimizer_compression={value!r} is not supported; use one of "
        f"{', '.join(repr(n) for n in CODECS)}, True (= {RECOMMENDED_CODEC!r}) or False "
        f"(= 'none')"
    )


def get_codec(name: str, role: str) -> StateCodec:
    """Return the codec ``name`` (one of :func:`codec_names`) for the moment ``role``
    ("exp_avg" | "exp_avg_sq"). Codecs are stateless and safe to share between threads."""
    if role not in ROLES:
        raise ValueError(f"unknown optimizer-state role {role!r}; expected one of {ROLES}")
    return CODECS[normalize_compression(name)](role)


def sliceable(codec) -> bool:
    """Whether a codec stores whole blocks independently (``block``, ``codes_per_byte``,
    ``code_dtype``, codes and scales): a slice of blocks then decodes and encodes alone."""
    return all(hasattr(codec, a) for a in ("block", "codes_per_byte", "code_dtype")) and codec.block > 0


def codec_names() -> tuple[str, ...]:
    """The registered codec names (what ``optimizer_compression`` accepts), "none" first."""
    return tuple(CODECS)


def register_codec(name: str, make: Callable[[str], StateCodec]) -> None:
    """Add a codec: ``make(role)`` returns its :class:`StateCodec` for "exp_avg" or
    "exp_avg_sq". The config, the planner, the estimator and the CLI read the registry, so a
    new codec is one module that defines its classes and calls this."""
    name = name.strip().lower()
    if not name or name in CODECS:
        raise ValueError(f"codec name {name!r} is empty or already registered ({', '.join(CODECS)})")
    CODECS[name] = make


_LOCAL = threading.local()


def _scratch(rows: int, block: int) -> list[torch.Tensor]:
    """Work buffers (two fp32, one int32) of ``rows x block``, kept per thread (codecs hold no
    state, so threads can share them; a fresh megabyte per call cost page faults): views of the
    thread's buffers, which grow to the largest call."""
    have = getattr(_LOCAL, "scratch", None)
    n = rows * block
    if have is None or have[0].numel() < n:
        have = _LOCAL.scratch = [torch.empty(n), torch.empty(n), torch.empty(n, dtype=torch.int32)]
    return [t[:n].view(rows, block) for t in have]


def _check_input(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 1:
        raise TypeError(f"codecs encode 1-D float32 tensors, got {getattr(x, 'dtype', type(x))} "
                        f"with shape {tuple(getattr(x, 'shape', ()))}")
    if x.device.type != "cpu":
        raise ValueError(f"codecs run on CPU tensors, got a tensor on {x.device}")
    return x.contiguous()


def _check_out(out: torch.Tensor, numel: int) -> None:
    if out.dtype != torch.float32 or out.dim() != 1 or out.numel() != numel:
        raise ValueError(f"decode needs a 1-D float32 `out` with {numel} elements, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if not out.is_contiguous():
        raise ValueError("decode needs a contiguous `out` tensor")


def _add_dither(r: torch.Tensor, xb: torch.Tensor, scratch: list[torch.Tensor]) -> None:
    """r += u, u = _DITHER_ALPHA * (low 16 bits of xb + 65), in [~_DELTA, ~1 - _DELTA].

    The low mantissa bits of an Adam moment are close to uniform and nearly independent of
    where the value falls between two code levels, so floor(r + u) is stochastic rounding that
    is a pure function of the input."""
    low = torch.bitwise_and(xb.view(torch.int32), 0xFFFF, out=scratch[2]).add_(65)
    r.add_(scratch[1].copy_(low), alpha=_DITHER_ALPHA)   # (an int32 operand: a temporary per call)


class NoneCodec:
    """fp32 stored as is (a copy). ``{"codes": fp32[numel]}``."""

    name = "none"
    block = 0

    def __init__(self, role: str = "exp_avg"):
        self.role = role

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"codes": _check_input(x).clone()}

    def decode(self, enc: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        codes = enc["codes"]
        _check_out(out, codes.numel())
        out.copy_(codes)
        return out

    def encoded_nbytes(self, numel: int) -> int:
        return 4 * int(numel)

    def __repr__(self) -> str:
        return f"NoneCodec(role={self.role!r})"


class _BlockCodec:
    """Block-wise codec skeleton: fp32 scale per block, codes padded to whole blocks.

    Subclasses implement ``_encode_blocks(xb, codes, scales, scratch)`` and
    ``_decode_blocks(codes, scales, outb, tmp)`` on a ``[nblocks, block]`` view of one chunk.
    """

    name = ""
    role = ""
    block = 0
    codes_per_byte = 1
    code_dtype = torch.uint8

    def encoded_nbytes(self, numel: int) -> int:
        nblocks = -(-int(numel) // self.block)
        return nblocks * self.block // self.codes_per_byte + 4 * nblocks

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The codes and scales of ``x``: by the fused kernels where they are built
        (``fused_update.kernels()``; IEEE square roots), else on torch ops (:meth:`encode_torch`)."""
        k = kernels()
        if k is None:
            return self.encode_torch(x)
        x = _check_input(x)
        codes, scales = self._empty_codes(x.numel())
        err = encode_error(k.encode(self.name, self.role, x, codes, scales), self.name, self.role)
        if err is not None:
            raise err
        return {"codes": codes, "scales": scales}

    def _empty_codes(self, n: int):
        nblocks = -(-n // self.block)
        return (torch.empty(nblocks * self.block // self.codes_per_byte, dtype=self.code_dtype),
                torch.empty(nblocks, dtype=torch.float32))

    def encode_torch(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """:meth:`encode` on torch ops (the path without the fused kernels; its ``sqrt`` is
        MKL's, which rounds ~0.5% of inputs one ulp low: a code can differ by one level)."""
        x = _check_input(x)
        n, b = x.numel(), self.block
        codes, scales = self._empty_codes(n)
        step = min(_CHUNK, max(b, n - n % b))
        scratch = _scratch(step // b, b)
        full = n - n % b
        for i in range(0, full, step):
            j = min(i + step, full)
            k = (j - i) // b
            self._encode_blocks(x[i:j].view(k, b), codes[i // self.codes_per_byte:
                                j // self.codes_per_byte], scales[i // b:j // b],
                                [s[:k] for s in scratch])
        if full < n:                                   # ragged tail: one zero-padded block
            tail = torch.zeros(1, b)
            tail[0, :n - full].copy_(x[full:])
            self._encode_blocks(tail, codes[full // self.codes_per_byte:],
                                scales[full // b:], _scratch(1, b))
        if n and not bool(torch.isfinite(scales).all()):
            raise ValueError(f"cannot encode {self.role} with the {self.name} codec: it contains "
                             f"NaN or Inf (the optimizer state has diverged)")
        return {"codes": codes, "scales": scales}

    def decode(self, enc: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """The values of ``enc`` into ``out``: the fused kernels' or torch's (equal bit for bit)."""
        k = kernels()
        if k is None:
            return self.decode_torch(enc, out)
        codes, scales = self._check_codes(enc, out)
        k.decode(self.name, self.role, codes.contiguous(), scales.contiguous(), out)
        return out

    def _check_codes(self, enc: dict[str, torch.Tensor], out: torch.Tensor):
        codes, scales = enc["codes"], enc["scales"]
        n, b = out.numel(), self.block
        nblocks = -(-n // b)
        if (codes.dtype != self.code_dtype or scales.dtype != torch.float32
                or scales.numel() != nblocks
                or codes.numel() != nblocks * b // self.codes_per_byte):
            raise ValueError(
                f"{self.name} {self.role} codes ({codes.dtype}, {codes.numel()}) and scales "
                f"({scales.dtype}, {scales.numel()}) do not match an output of {n} elements")
        _check_out(out, n)
        return codes, scales

    def decode_torch(self, enc: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` on torch ops."""
        codes, scales = self._check_codes(enc, out)
        n, b = out.numel(), self.block
        full = n - n % b
        step = min(_CHUNK, max(b, full))
        tmp = _scratch(step // b, b)[0]
        for i in range(0, full, step):
            j = min(i + step, full)
            outb = out[i:j].view(-1, b)
            self._decode_blocks(codes[i // self.codes_per_byte:j // self.codes_per_byte],
                                scales[i // b:j // b], outb, tmp[:outb.shape[0]])
        if full < n:
            tail = torch.empty(1, b)
            self._decode_blocks(codes[full // self.codes_per_byte:], scales[full // b:], tail,
                                torch.empty(1, b))
            out[full:].copy_(tail[0, :n - full])
        if self.role == "exp_avg_sq":
            _floor_positive_blocks(out, scales, b)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block={self.block})"


class Int8MomentCodec(_BlockCodec):
    """First moment, 8 bits: ``sign(x) * sqrt(|x| / absmax)`` quantised to 127 levels a side,
    round to nearest. Decoded value ``sign(c) * (|c|/127)**2 * absmax``."""

    name, role, block, code_dtype = "int8", "exp_avg", INT8_BLOCK, torch.int8

    def _encode_blocks(self, xb, codes, scales, scratch):
        a = _sqrt_of_abs_scaled(xb, scales, scratch, 127.0)
        torch.round(a, out=a)
        torch.copysign(a, xb, out=a)
        codes.view(a.shape).copy_(a)

    def _decode_blocks(self, codes, scales, outb, tmp):
        t = torch.mul(codes.view(outb.shape), 1.0 / 127.0, out=outb)
        t.mul_(torch.abs(t, out=tmp)).mul_(scales.unsqueeze(1))


class Int8VarianceCodec(_BlockCodec):
    """Second moment, 8 bits: ``255 * (v / max) ** (1/4)`` stochastically rounded (dither from
    the value's low mantissa bits), code >= 1 so positive v never decodes to 0. Decoded value
    ``(c/255)**4 * max``."""

    name, role, block, code_dtype = "int8", "exp_avg_sq", INT8_BLOCK, torch.uint8

    def _encode_blocks(self, xb, codes, scales, scratch):
        r = _fourth_root_levels(xb, scales, scratch, 255.0)
        # via int32 (truncation == floor for r >= 1): torch's float -> uint8 copy is ~3x slower
        codes.view(r.shape).copy_(scratch[2].copy_(r))

    def _decode_blocks(self, codes, scales, outb, tmp):
        t = torch.mul(codes.view(outb.shape), 1.0 / 255.0, out=outb)
        t.mul_(t).mul_(t).mul_(scales.unsqueeze(1))          # (c/255)**4 * max


class Int4MomentCodec(_BlockCodec):
    """First moment, 4 bits, two codes per byte (even index in the low nibble): the levels
    ``-(|c|/8)**2`` (c = -8..-1), 0 and ``(c/7)**2`` (c = 1..7) times the block absmax (all 16
    codes used), round to the nearest level. Decoded value = level * absmax."""

    name, role, block, codes_per_byte = "int4", "exp_avg", INT4_BLOCK, 2
    LEVELS = torch.tensor([-((8 - i) / 8.0) ** 2 for i in range(8)]
                           + [(i / 7.0) ** 2 for i in range(8)], dtype=torch.float64).float()

    def _encode_blocks(self, xb, codes, scales, scratch):
        # Nearest level in value (not in sqrt): with only 8 levels a side this lowers the update
        # error noticeably. Between levels k and k+1 the midpoint is ((k**2 + (k+1)**2) / 2) /
        # L**2, so c = round(sqrt(L**2 * y - 1/4)).
        a = torch.abs(xb, out=scratch[0])
        torch.amax(a, dim=1, out=scales)
        k = torch.rsqrt(scales.clamp_min(_F32_MIN_SUBNORMAL)).unsqueeze(1)
        y = a.mul_(k).mul_(k)                                # |x| / absmax, no overflow
        q = torch.copysign(y, xb, out=scratch[1])
        q.mul_(-7.5).add_(y, alpha=56.5)                     # L**2 * y: 64 y (x < 0), 49 y
        q.sub_(0.25).clamp_min_(0.01).sqrt_().round_()     # (below 0.25 rounds to 0 either way: no sqrt of 0)
        torch.copysign(q, xb, out=q).add_(8.0)               # nibble 0..15
        _pack_nibbles(scratch[2].copy_(q), codes)

    def _decode_blocks(self, codes, scales, outb, tmp):
        _unpack_lut(_PAIR_LUTS[type(self)], codes, outb)
        outb.mul_(scales.unsqueeze(1))


class Int4VarianceCodec(_BlockCodec):
    """Second moment, 4 bits: ``16 * (v / max) ** (1/4)`` stochastically rounded to the 16
    levels ``(k+1)/16``; there is no zero level, so positive v never decodes to 0 (lowest
    decoded value ``max / 65536``). Decoded value ``((k+1)/16)**4 * max``."""

    name, role, block, codes_per_byte = "int4", "exp_avg_sq", INT4_BLOCK, 2
    LEVELS = torch.tensor([((i + 1) / 16.0) ** 4 for i in range(16)], dtype=torch.float64).float()

    def _encode_blocks(self, xb, codes, scales, scratch):
        r = _fourth_root_levels(xb, scales, scratch, 16.0)
        c = scratch[2].copy_(r)                              # 1..16 (truncation == floor)
        _pack_nibbles(c.sub_(1), codes)

    def _decode_blocks(self, codes, scales, outb, tmp):
        _unpack_lut(_PAIR_LUTS[type(self)], codes, outb)
        outb.mul_(scales.unsqueeze(1))


def _normal_blocks(x, scales):
    """(x, scales) with every block whose max is below 2**-60 multiplied by 2**64 (exact: its
    subnormals become normal numbers; roots are 2**(64 / 2**n) times theirs), or as given."""
    tiny = (scales < 2.0**-60) & (scales > 0)   # (all-zero blocks: their factor is 0 anyway)
    if not bool(tiny.any()):
        return x, scales
    f = torch.where(tiny, 2.0**64, 1.0)
    return x.mul(f.unsqueeze(1)), scales * f


def _root_levels(x, mx, levels: float, under: float, out, roots: int) -> torch.Tensor:
    """``levels * (x / mx) ** (1 / 2**roots)`` per block (``mx``: the blocks' max, ``x >= 0``)
    into ``out``, computed as ``root(x) * (levels / root(mx))``; the inputs whose value comes out
    below ``under`` are taken as one at ``under`` (their code is the lowest either way).

    Why: MKL's sqrt takes a slow path for zero and subnormal inputs, and a chunk of Adam moments
    is full of them (an embedding's rows a batch did not use are zeros; moments decayed over
    hundreds of steps are subnormal): such a chunk encoded 3-7x (zeros) and 35x (subnormals)
    slower. Blocks below 2**-60 are scaled into the normal range first (exact), then every input
    is raised to at least its block's ``mx * (under / levels) ** 2**roots`` (a normal number),
    so the roots see no zero and no subnormal. All-zero blocks get the factor 0."""
    x, mx = _normal_blocks(x, mx)
    k = mx.clamp_min(_F32_MIN_SUBNORMAL)
    for _ in range(roots - 1):
        k = k.sqrt()
    k = torch.rsqrt(k).mul_(levels).masked_fill_(mx == 0, 0.0)
    floor = mx.mul((under / levels) ** (2**roots)).clamp_min_(_F32_MIN_NORMAL)
    r = torch.maximum(x, floor.unsqueeze(1), out=out)
    for _ in range(roots):
        r.sqrt_()
    return r.mul_(k.unsqueeze(1))


def _sqrt_of_abs_scaled(xb, scales, scratch, levels: float) -> torch.Tensor:
    """scales <- per-block absmax; returns ``levels * sqrt(|x| / absmax)`` in scratch[0] (the
    values below 0.25 as 0.25: they round to 0 either way)."""
    a = torch.abs(xb, out=scratch[0])
    torch.amax(a, dim=1, out=scales)
    return _root_levels(a, scales, levels, 0.25, a, 1)


def _fourth_root_levels(xb, scales, scratch, levels: float) -> torch.Tensor:
    """scales <- per-block max; returns ``levels * (v/max)**(1/4) + u`` clamped to
    [1, levels + 0.5] (u: the dither of ``_add_dither``) in scratch[0]: its floor is the code
    (the values below 0.5 before the dither as 0.5: their code is 1 either way)."""
    torch.amax(xb, dim=1, out=scales)                # (torch.aminmax is ~15x slower than both)
    if bool((torch.amin(xb, dim=1) < 0).any()):
        raise ValueError("exp_avg_sq must be non-negative")
    r = _root_levels(xb, scales, levels, 0.5, scratch[0], 2)
    _add_dither(r, xb, scratch)
    return torch.clamp(r, 1.0, levels + 0.5, out=r)


def _floor_positive_blocks(out: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """Raise decoded values that underflowed to 0 in a block with a positive scale to the
    smallest positive float. Only scales below ~1e-30 can underflow, so the common path is one
    cheap check over the scales."""
    tiny = (scales > 0) & (scales < 1e-30)
    if not bool(tiny.any()):
        return
    rows = tiny.nonzero().squeeze(1)
    full = out.numel() // block
    inner = rows[rows < full]                        # (only those blocks: not a copy of ``out``)
    if inner.numel():
        blocks = out[:full * block].view(-1, block)
        blocks[inner] = blocks[inner].clamp_min(_F32_MIN_SUBNORMAL)
    if rows.numel() > inner.numel():                 # the ragged last block
        out[full * block:].clamp_min_(_F32_MIN_SUBNORMAL)


def _pack_nibbles(nib: torch.Tensor, codes: torch.Tensor) -> None:
    """Pack int32 nibbles (0..15) pairwise into bytes: even index low, odd index high."""
    flat = nib.view(-1)
    codes.copy_(torch.add(flat[0::2], flat[1::2], alpha=16))


def _pair_lut(levels: torch.Tensor) -> torch.Tensor:
    """[256, 2] fp32 table: byte -> (level of the low nibble, level of the high nibble)."""
    byte = torch.arange(256)
    return torch.stack([levels[byte & 15], levels[byte >> 4]], dim=1).contiguous()


_PAIR_LUTS = {cls: _pair_lut(cls.LEVELS) for cls in (Int4MomentCodec, Int4VarianceCodec)}


def _unpack_lut(lut: torch.Tensor, codes: torch.Tensor, outb: torch.Tensor) -> None:
    torch.index_select(lut, 0, codes.long(), out=outb.view(-1, 2))


#: The codec registry: name -> ``make(role)``. Built-ins here; more via :func:`register_codec`.
CODECS: dict[str, Callable[[str], StateCodec]] = {
    "none": NoneCodec,
    "int8": lambda role: Int8MomentCodec() if role == "exp_avg" else Int8VarianceCodec(),
    "int4": lambda role: Int4MomentCodec() if role == "exp_avg" else Int4VarianceCodec(),
}
#: The built-in codec names (use :func:`codec_names` for every registered one).
CODEC_NAMES = tuple(CODECS)

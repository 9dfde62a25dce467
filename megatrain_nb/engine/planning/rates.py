"""A machine's rates: what the step-time prediction (``engine/planning/prediction.py``) is computed from.

``MachineRates`` holds one number per resource the engine's pipeline uses, in plain units
(bytes per second, FLOP per second, parameters per second), measured on this machine by
``mt.measure_machine`` (``engine/measure.py``) or taken from a named profile of a machine we
cannot measure (``PROFILES``), each number of a profile with its published source.

Every rate is a *sustained* rate at the engine's own sizes and access pattern, not a peak: the
prediction multiplies it by the bytes or FLOPs of a step and adds nothing else.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import List, Optional


@dataclass
class MachineRates:
    """Rates of one machine (device, host, disk), all per second.

    device: "cpu" or the accelerator's name ("cuda:0 NVIDIA H200").
    cores: CPU cores this process may use.
    h2d_pageable / h2d_pinned / d2h_pageable / d2h_pinned: host<->device copy, bytes/s, at the
        engine's transfer sizes (one layer's weights); on a CPU device, the memcpy rate.
    matmul_flops: device fp32 matmul FLOP/s at the model's shapes (``matmul_by_shape`` per
        "MxKxN" when measured for a model; ``matmul_flops`` is the one used when a shape is missing).
        M: tokens of a micro-batch, K: input features, N: output features (see :meth:`matmul_rate`).
    attention_flops: device FLOP/s of the attention kernel (SDPA, a causal forward counted as
        2·B·H·S²·D FLOPs: the half of the square it needs) at head size 64 (``attention_by_head``
        per head size, the model's too when measured for one; :meth:`attention_rate`).
    attention_by_seq / attention_backward_by_seq: a CPU device's causal SDPA forward and backward
        FLOP/s (the backward counted as twice the forward's FLOPs) at head size 64 on one thread, per
        row length "S" (128, 512, 2048 tokens): one thread ran the forward at 2048 tokens ~1.7x as
        fast as at 512 and its backward at 0.7-0.8x the forward's rate (where the prediction priced
        every row at ``attention_flops`` and the backward at the forward's rate);
        :meth:`attention_rates` interpolates them by a row's length; {} = not measured (a GPU, or an
        older cache): every row at :meth:`attention_rate`.
    bf16_matmul_flops / bf16_attention_flops: the same in bf16 (``EngineConfig(precision="bf16")``).
    compute_threads: how many threads the matmul and attention rates were measured on: 1 for a
        CPU device (one thread's rates: the prediction runs a CPU step's compute on
        :meth:`compute_team` threads), 0 for a GPU (the device's own rate).
    disk_read / disk_write: bytes/s through the engine's own I/O path (O_DIRECT where the
        filesystem has it, its block sizes and queue depth) on ``disk_path``'s filesystem, beyond
        the cost of each file below (an older measurement: layer-sized files' rates, it included).
    disk_read_file_s / disk_write_file_s: seconds each file read or written costs beyond its
        bytes (opening it, its header, a write's sync and rename), measured on files of two sizes;
        a step pays it once per unit file it moves; 0 = not measured (an older cache, a profile).
    adamw_per_thread: parameters/s of the fused CPU AdamW on one thread (fp32 states).
    codec_per_thread: bytes of fp32 states/s encoded+decoded on one thread, per codec ("int8", "int4").
    update_chain: parameters/s of one unit's whole update with compressed states, per codec, as
        the engine runs it (decode thread, AdamW, encode thread, the codes stored; beside a
        compute thread on a CPU device); the prediction prices a step's updates at it when measured.
    update_chain_threads: the threads the ``update_chain`` measurement's fused chunks ran on (the
        AdamW worker and the two codec threads, on the cores a CPU device's compute thread left:
        :meth:`chain_threads`); 0 = not recorded (an older measurement: the same, from ``cores``).
    team_matmul_flops: a CPU device's fp32 matmul FLOP/s at the default shape on torch's threads
        (the intra-op team a step computes on), alone: over the one thread's ``matmul_flops`` it is
        the speed-up the team gives the compute (:meth:`compute_team`); 0 = not measured (an older
        measurement, or a GPU).
    elementwise_rate: a CPU device's element accesses/s (each element read or written, fp32) of a
        decoder layer's non-matmul work -- its norms, rotary, activation and residual adds, forward
        and backward under autograd -- on one thread at a default shape (scaled by
        :meth:`compute_team` as the matmul's) (:func:`elementwise_accesses` counts them, for that shape as for a model's);
        the prediction prices the non-matmul work of a CPU step's layers at it; 0 = not measured.
    memory_speedup: a CPU device's memcpy rate (one layer-sized copy) on torch's threads over one
        thread's, measured back to back: what the team gives memory-bound work (the non-matmul
        work: ``elementwise_rate``, ``softmax_rate``); 0.9-1.0 on the 2-core VM, whose one thread
        already takes the memory's bandwidth, where its matmul's was 1.7-1.9; 0 = not measured.
    softmax_rate: a CPU device's logits/s through the loss head's log-softmax and loss, forward and
        backward, over one chunk of the engine's (1024 tokens by a vocabulary of 8192: 32 MiB of
        logits, beyond the caches, as a step allocates them), one thread; 0 = not measured.
    step_team: a CPU device's compute on torch's threads over what the prediction counts at the
        one-thread rates, per "TxH" (a micro-batch's tokens x hidden): a step-like chain of decoder
        layers (``measure.decoder_chain``), forward and backward, at a small and a large size (or on
        one thread where that was faster: a loaded machine's team); a step of many small operations
        gets less of the team than a large matmul in a hot loop.
        The prediction interpolates it by size (:meth:`step_speedup`); {} = not measured.
    compute_beside_disk: a CPU device's compute rate (on torch's threads, as a step computes)
        while the disk tier reads and writes beside it, over its rate alone (0: not measured, or
        a GPU, whose compute the host's I/O leaves alone); the prediction slows a CPU step's
        compute by it for the part of each window the disk is busy.
    source: "measured" or a profile's name; ``sources`` maps a field to its published source.
    """

    device: str = "cpu"
    cores: int = 1
    h2d_pageable: float = 0.0
    h2d_pinned: float = 0.0
    d2h_pageable: float = 0.0
    d2h_pinned: float = 0.0
    matmul_flops: float = 0.0
    matmul_by_shape: dict = field(default_factory=dict)
    attention_flops: float = 0.0
    attention_by_head: dict = field(default_factory=dict)
    attention_by_seq: dict = field(default_factory=dict)
    attention_backward_by_seq: dict = field(default_factory=dict)
    bf16_matmul_flops: float = 0.0
    bf16_attention_flops: float = 0.0
    compute_threads: int = 0
    disk_read: float = 0.0
    disk_write: float = 0.0
    disk_read_file_s: float = 0.0
    disk_write_file_s: float = 0.0
    disk_path: Optional[str] = None
    filesystem: Optional[str] = None
    adamw_per_thread: float = 0.0
    codec_per_thread: dict = field(default_factory=dict)
    update_chain: dict = field(default_factory=dict)
    update_chain_threads: int = 0
    compute_beside_disk: float = 0.0
    team_matmul_flops: float = 0.0
    elementwise_rate: float = 0.0
    softmax_rate: float = 0.0
    memory_speedup: float = 0.0
    step_team: dict = field(default_factory=dict)
    source: str = "measured"
    sources: dict = field(default_factory=dict)
    measured_at: Optional[float] = None
    seconds_taken: Optional[float] = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MachineRates":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"MachineRates: unknown fields {unknown}; known: {sorted(names)}")
        return cls(**d)

    # ------------------------------------------------------------------------------ look-ups
    def compute_team(self) -> float:
        """How many one-thread rates a CPU device's compute runs at: the measured speed-up of the
        matmul on torch's threads (the intra-op team) over one thread's, ``team_matmul_flops`` /
        ``matmul_flops``, from 1 to ``cores`` -- measured on this machine, quiet: 1.7-1.9 on 2 cores.
        Not measured (an older cache): every core but one, as before (the engine's own threads
        beside the compute)."""
        cores = max(int(self.cores or 1), 1)
        if self.team_matmul_flops > 0 and self.matmul_flops > 0:
            return min(max(self.team_matmul_flops / self.matmul_flops, 1.0), float(cores))
        return max(cores - 1, 1)

    def step_speedup(self, tokens: int, hidden: int) -> float:
        """What a CPU step's compute at ``tokens`` a micro-batch and ``hidden`` gets over the
        prediction's one-thread count: ``step_team`` interpolated in log(tokens x hidden) between
        the measured sizes (the nearest outside them); 0 = not measured."""
        points = [(int(k.split("x")[0]) * int(k.split("x")[1]), float(v)) for k, v in (self.step_team or {}).items()]
        return log_interp(points, float(tokens) * float(hidden))

    def attention_rates(self, head_dim: int, seq: int, *, bf16: bool = False) -> tuple:
        """(forward, backward) FLOP/s of the attention at ``head_dim`` on rows of ``seq`` tokens (the
        backward's FLOPs counted as twice the forward's): ``attention_by_seq`` and
        ``attention_backward_by_seq`` interpolated in log(seq) (the nearest outside the measured
        lengths), times the head size's rate over head 64's (:meth:`attention_rate`, both measured at
        the default row); not measured by row length (a GPU, bf16, an older cache): the head size's
        rate for both."""
        base = self.attention_rate(head_dim, bf16=bf16)
        if bf16 or not self.attention_by_seq or not self.attention_flops or not base:
            return base, base
        scale = base / self.attention_flops
        fwd = log_interp([(int(k), float(v)) for k, v in self.attention_by_seq.items()], seq)
        bwd = log_interp([(int(k), float(v)) for k, v in (self.attention_backward_by_seq or {}).items()], seq) or fwd
        return fwd * scale, bwd * scale

    def memory_team(self) -> float:
        """How many one-thread rates a CPU device's memory-bound work (its non-matmul work) runs at on
        torch's threads: ``memory_speedup`` (at most ``cores``); not measured: :meth:`compute_team`."""
        if self.memory_speedup > 0:
            return min(float(self.memory_speedup), float(max(int(self.cores or 1), 1)))
        return float(self.compute_team())

    def chain_threads(self) -> int:
        """Threads the ``update_chain`` rate was measured on (the prediction prices a compressed
        update at it over these, times the threads the update gets): the recorded count, else the
        engine's split of the measurement (its AdamW worker and two codec threads) on the cores a
        CPU device's measurement left beside its compute thread."""
        if self.update_chain_threads:
            return int(self.update_chain_threads)
        return max(min(3, int(self.cores or 1) - (1 if self.device == "cpu" else 0)), 1)

    def compute_scale(self, cuda: bool) -> float:
        """What the matmul/attention rates are multiplied by for a step's compute: the CPU
        team's speed-up when the rates are one thread's (``compute_threads`` 1), else 1."""
        return float(self.compute_team()) if not cuda and self.compute_threads == 1 else 1.0

    def matmul_rate(self, m: int, k: int, n: int, *, bf16: bool = False) -> float:
        """FLOP/s of an (m x k) @ (k x n) matmul: the measured shape "MxKxN" if there is one, else
        the measured shape with the same K and N (the rate hardly depends on the token count once
        it is in the hundreds), else :attr:`matmul_flops` (:attr:`bf16_matmul_flops` for bf16,
        which is measured at one shape only)."""
        if bf16:
            return self.bf16_matmul_flops
        exact = self.matmul_by_shape.get(shape_key(m, k, n))
        if exact:
            return exact
        same = [v for key, v in self.matmul_by_shape.items() if key.split("x")[1:] == [str(k), str(n)]]
        return max(same) if same else self.matmul_flops

    def attention_rate(self, head_dim: int, *, bf16: bool = False) -> float:
        """FLOP/s of the attention kernel at ``head_dim`` (measured per head size for a model),
        else :attr:`attention_flops` (:attr:`bf16_attention_flops` for bf16)."""
        if bf16:
            return self.bf16_attention_flops
        return self.attention_by_head.get(str(int(head_dim))) or self.attention_flops

    def with_cpu_from(self, other: "MachineRates") -> "MachineRates":
        """These rates with the CPU-side rates a profile leaves at 0 (not published: AdamW, the codec
        rates per thread and the compressed update chain) taken from ``other`` (this machine's
        measurement, say): a profile's update speed is always this machine's measured one."""
        d = self.to_dict()
        if not d["adamw_per_thread"]:
            d["adamw_per_thread"] = other.adamw_per_thread
            d["sources"] = {**d["sources"], "adamw_per_thread": f"measured on {other.device} ({other.source})"}
        if not d["codec_per_thread"]:
            d["codec_per_thread"] = dict(other.codec_per_thread)
            d["sources"] = {**d["sources"], "codec_per_thread": f"measured on {other.device} ({other.source})"}
        if not d["update_chain"] and other.update_chain:   # (a compressed update as the engine runs it)
            d["update_chain"] = dict(other.update_chain)
            d["update_chain_threads"] = other.chain_threads()   # (the measuring machine's, not this one's cores)
            d["sources"] = {**d["sources"], "update_chain": f"measured on {other.device} ({other.source}), "
                                                            f"{other.chain_threads()} thread(s)"}
        return MachineRates.from_dict(d)

    def table(self) -> str:
        """The rates as a readable table (``megatrain-nb machine``); :func:`format_rates`."""
        return format_rates(self)

    def __str__(self) -> str:
        return format_rates(self)


def log_interp(points, x: float) -> float:
    """The value at ``x`` of ``points`` ((x, value) pairs, values > 0 kept) interpolated linearly in
    log(x), the nearest value outside them; 0 = no points."""
    points = sorted((float(p), float(v)) for p, v in points if v and v > 0 and p > 0)
    if not points:
        return 0.0
    x = max(float(x), 1.0)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, v0), (x1, v1) in zip(points, points[1:]):
        if x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0) if x1 > x0 else 1.0
            return v0 + f * (v1 - v0)
    return points[-1][1]


def shape_key(m: int, k: int, n: int) -> str:
    """``matmul_by_shape``'s key: "MxKxN" (tokens x input features x output features)."""
    return f"{int(m)}x{int(k)}x{int(n)}"


#: Element accesses (an fp32 element read or written) of a decoder layer's non-matmul work per token,
#: one forward, counted op by op from Llama's layer: two RMSNorms (pow, mean, x * rsqrt, weight *: 7
#: a hidden element each), rotary on the queries and keys (x * cos, rotate_half's neg and cat,
#: * sin, the add: 10 each, per hidden element of q and of k), the attention's transposes to and
#: from its layout (4), two residual adds (3 each): 44 per hidden element; the gated MLP's
#: activation and product (silu: 2, the product: 3): 5 per intermediate element. The backward
#: does twice the forward's (each op's gradient reads its output's gradient and its inputs and
#: writes its inputs' gradients).
FORWARD_PER_HIDDEN, FORWARD_PER_INTERMEDIATE = 44, 5
def elementwise_accesses(tokens: float, hidden: int, intermediate: int, passes: float = 3.0) -> float:
    """Element accesses of ``tokens`` tokens through one decoder layer's non-matmul work, ``passes``
    forwards' worth (3: a forward and its backward): what ``MachineRates.elementwise_rate`` is
    measured in (``measure.measure_elementwise``) and what the prediction counts for a step."""
    return float(tokens) * passes * (FORWARD_PER_HIDDEN * hidden + FORWARD_PER_INTERMEDIATE * intermediate)


# ---------------------------------------------------------------------------------------- plausible values
#: (low, high) of each rate a measurement can give, per second: beyond them the number is a
#: measurement gone wrong or a file someone edited (a PCIe 7 link is 0.25 TB/s, an NVMe 30 GB/s,
#: a GPU 10 PFLOP/s dense; a CPU core's AdamW ~2 G params/s).
PLAUSIBLE = {"copy": (1e6, 1e13), "flops": (1e6, 1e17), "disk": (1e4, 1e12), "params": (1e3, 1e12),
             "bytes": (1e3, 1e13), "elements": (1e5, 1e14), "ratio": (1e-3, 65536.0)}
_KIND = {"h2d_pageable": "copy", "h2d_pinned": "copy", "d2h_pageable": "copy", "d2h_pinned": "copy",
         "matmul_flops": "flops", "attention_flops": "flops", "bf16_matmul_flops": "flops",
         "bf16_attention_flops": "flops", "disk_read": "disk", "disk_write": "disk", "adamw_per_thread": "params",
         "team_matmul_flops": "flops", "elementwise_rate": "elements", "softmax_rate": "elements"}
_TABLES = {"matmul_by_shape": "flops", "attention_by_head": "flops", "codec_per_thread": "bytes",
           "update_chain": "params", "step_team": "ratio", "attention_by_seq": "flops",
           "attention_backward_by_seq": "flops"}
_TEXT = ("device", "source")
_OPTIONAL_TEXT = ("disk_path", "filesystem")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: Rates a file may leave at 0, "not measured" (the prediction names them in its notes).
_MAY_BE_ZERO = ("bf16_matmul_flops", "bf16_attention_flops", "team_matmul_flops", "elementwise_rate",
                "softmax_rate")
#: Ratios (and the disk's seconds a file) a file may leave at 0 (not measured) and that are
#: otherwise positive and below a bound.
_RATIOS = {"compute_beside_disk": 1.0, "memory_speedup": 65536.0, "disk_read_file_s": 10.0,
           "disk_write_file_s": 10.0}


def _in_range(name: str, v, kind: str) -> Optional[str]:
    low, high = PLAUSIBLE[kind]
    if name in _MAY_BE_ZERO and _number(v) and v == 0:
        return None
    if not _number(v) or not math.isfinite(v) or not low <= v <= high:
        return f"{name}={v!r} (a number from {low:g} to {high:g} per second)"
    return None


def check_rates(d: dict) -> List[str]:
    """What is wrong with a MachineRates' fields ``d`` (a measurement's or a cached file's), each
    as "field=value (what it must be)": the types, every rate finite and within :data:`PLAUSIBLE`,
    ``cores`` a whole number from 1 to 65536, ``compute_beside_disk`` from 0 to 1 (the bf16 rates
    may be 0: not measured). [] when all is well."""
    if not isinstance(d, dict):
        return [f"rates={type(d).__name__} (a JSON object of MachineRates' fields)"]
    names = {f.name for f in fields(MachineRates)}
    bad = [f"{k}: not a MachineRates field" for k in sorted(set(d) - names, key=str)]
    cores = d.get("cores", 1)
    if not (_number(cores) and float(cores).is_integer() and 1 <= cores <= 65536):
        bad.append(f"cores={cores!r} (a whole number from 1 to 65536)")
    for name in ("compute_threads", "update_chain_threads"):
        threads = d.get(name, 0)
        if not (_number(threads) and float(threads).is_integer() and 0 <= threads <= 65536):
            bad.append(f"{name}={threads!r} (a whole number from 0 to 65536)")
    bad += [p for k, kind in _KIND.items() if (p := _in_range(k, d.get(k, 0.0), kind))]
    for table, kind in _TABLES.items():
        t = d.get(table, {})
        if not isinstance(t, dict):
            bad.append(f"{table}={t!r} (a table of rates)")
            continue
        bad += [p for k, v in t.items() if (p := _in_range(f"{table}[{k!r}]", v, kind))]
        if table == "step_team":   # (keys "TxH": a micro-batch's tokens x hidden, both positive)
            bad += [f"step_team[{k!r}] (a key \"TOKENSxHIDDEN\" of two whole numbers above 0)" for k in t
                    if not (isinstance(k, str) and len(k.split("x")) == 2
                            and all(p.isdigit() and int(p) > 0 for p in k.split("x")))]
        if table in ("attention_by_seq", "attention_backward_by_seq"):   # (keys: a row's tokens)
            bad += [f"{table}[{k!r}] (a key of a whole number of tokens above 0)" for k in t
                    if not (isinstance(k, str) and k.isdigit() and int(k) > 0)]
    for name, high in _RATIOS.items():
        v = d.get(name, 0.0)
        if not (_number(v) and math.isfinite(v) and 0 <= v <= high):
            bad.append(f"{name}={v!r} (a number from 0 to {high:g})")
    bad += [f"{k}={d[k]!r} (text)" for k in _TEXT if k in d and not isinstance(d[k], str)]
    bad += [f"{k}={d[k]!r} (text or null)" for k in _OPTIONAL_TEXT if d.get(k) is not None and not isinstance(d[k], str)]
    if not isinstance(d.get("sources", {}), dict):
        bad.append(f"sources={d['sources']!r} (a table)")
    for k in ("measured_at", "seconds_taken"):
        v = d.get(k)
        if v is not None and not (_number(v) and math.isfinite(v) and v >= 0):
            bad.append(f"{k}={v!r} (a number >= 0 or null)")
    return bad


# ---------------------------------------------------------------------------------------- the table
def _bps(v: float) -> str:
    return f"{v / 1e9:.2f} GB/s" if v else "-"


def _flops(v: float) -> str:
    if not v:
        return "-"
    return f"{v / 1e12:.1f} TFLOP/s" if v >= 1e12 else f"{v / 1e9:.1f} GFLOP/s"


def _rows(r: MachineRates) -> list:
    """(what, rate, the field whose source or detail goes beside it)."""
    one = " per thread" if r.compute_threads == 1 else ""
    rows = [("cores", str(r.cores), "cores"),
            ("h2d pageable", _bps(r.h2d_pageable), "h2d_pageable"),
            ("h2d pinned", _bps(r.h2d_pinned), "h2d_pinned"),
            ("d2h pageable", _bps(r.d2h_pageable), "d2h_pageable"),
            ("d2h pinned", _bps(r.d2h_pinned), "d2h_pinned"),
            (f"matmul fp32{one}", _flops(r.matmul_flops), "matmul_flops")]
    rows += [(f"  at {key}", _flops(v), None) for key, v in sorted(r.matmul_by_shape.items())]
    rows.append((f"attention fp32 (SDPA){one}", _flops(r.attention_flops), "attention_flops"))
    heads = sorted(r.attention_by_head.items(), key=lambda x: int(x[0]))
    rows += [(f"  head size {h}", _flops(v), None) for h, v in heads]
    back = r.attention_backward_by_seq or {}
    rows += [(f"  rows of {k} tokens: forward / backward", f"{_flops(v)} / {_flops(back.get(k, 0.0))}", None)
             for k, v in sorted((r.attention_by_seq or {}).items(), key=lambda kv: int(kv[0]))]
    rows += [(f"matmul bf16{one}", _flops(r.bf16_matmul_flops), "bf16_matmul_flops"),
             (f"attention bf16 (SDPA){one}", _flops(r.bf16_attention_flops), "bf16_attention_flops"),
             ("disk read", _bps(r.disk_read), "disk_read"),
             ("disk write", _bps(r.disk_write), "disk_write"),
             ("disk, each file beyond its bytes: read / write",
              f"{r.disk_read_file_s * 1e3:.2f} / {r.disk_write_file_s * 1e3:.2f} ms" if r.disk_read_file_s else "-",
              "disk_read_file_s"),
             ("AdamW per thread", f"{r.adamw_per_thread / 1e6:.0f} M params/s" if r.adamw_per_thread else
              "-", "adamw_per_thread")]
    codecs = r.codec_per_thread or {}
    rows += [(f"codec {name} per thread", _bps(v) + " of fp32", "codec_per_thread")
             for name, v in sorted(codecs.items())]
    if not codecs:
        rows.append(("codecs per thread", "-", "codec_per_thread"))
    rows += [(f"update chain {name} ({r.chain_threads()} threads)", f"{v / 1e6:.0f} M params/s", "update_chain")
             for name, v in sorted((r.update_chain or {}).items())]
    if r.team_matmul_flops:
        rows.append(("matmul fp32 on torch's threads", _flops(r.team_matmul_flops) + f" ({r.compute_team():.2f} x)",
                     "team_matmul_flops"))
    if r.elementwise_rate:
        rows.append(("non-matmul work per thread (element accesses)", f"{r.elementwise_rate / 1e9:.2f} G/s",
                     "elementwise_rate"))
    if r.memory_speedup:
        rows.append(("memcpy on torch's threads", f"{r.memory_speedup:.2f} x one thread's", "memory_speedup"))
    if r.softmax_rate:
        rows.append(("loss head's log-softmax per thread", f"{r.softmax_rate / 1e6:.0f} M logits/s", "softmax_rate"))
    for key, v in sorted((r.step_team or {}).items(), key=lambda kv: int(kv[0].split("x")[0]) * int(kv[0].split("x")[1])):
        rows.append((f"a step's compute at {key} (tokens x hidden)", f"{v:.2f} x the one-thread count", "step_team"))
    if r.compute_beside_disk:
        rows.append(("compute beside the disk", f"{r.compute_beside_disk:.2f} x alone", "compute_beside_disk"))
    return rows


def format_rates(r: MachineRates) -> str:
    """``MachineRates`` as a table: one rate a line, with its published source for a profile."""
    import time

    if r.source == "measured":
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.measured_at)) if r.measured_at else "?"
        took = f", took {r.seconds_taken:.1f} s" if r.seconds_taken is not None else ""
        head = f"Machine rates of {r.device}: measured {when}{took}"
    else:
        head = f"Machine rates of profile {r.source!r} ({r.device}): PUBLISHED FIGURES, not measured"
    lines = [head]
    if r.device == "cpu":
        lines.append("  h2d/d2h: a CPU device's copies are memcpy (of one layer-sized tensor)")
    if r.disk_path or r.filesystem:
        lines.append(f"  disk: {r.filesystem or '?'}" + (f" ({r.disk_path})" if r.disk_path else ""))
    width = max(len(w) for w, _, _ in _rows(r))
    for what, rate, key in _rows(r):
        note = (r.sources.get(key, "not published") if rate.startswith("-") else r.sources.get(key, "")) \
            if key and r.source != "measured" else ""
        lines.append(f"  {what:<{width}}  {rate:>18}" + (f"   {note}" if note else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- profiles
# Machines we cannot measure, for planning on paper. Every number is a PUBLISHED figure (a vendor
# datasheet or a standard; peaks, not sustained rates) or a stated assumption; ``sources`` names
# it. Rates nobody publishes (AdamW and codecs per CPU thread) stay 0: ``rates_for(name,
# cpu=measured)`` takes them from a measured machine.
_PCIE5 = "PCI-SIG PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b = 63 GB/s per direction (theoretical)"
_PINNED_PCIE5 = ("assumption: 52 GB/s = ~80% of the PCIe 5.0 x16 theoretical 63 GB/s per direction "
                 "(" + _PCIE5 + "; pinned cudaMemcpy typically reaches 50-55 GB/s)")
_PAGEABLE = "assumption: half the pinned rate (the driver stages a pageable copy through a pinned buffer)"
_DGX_CORES = "NVIDIA DGX {0} datasheet: 2x Intel Xeon Platinum 8480C, 112 cores for 8 GPUs = 14 cores per GPU"
_GEN4_READ = "Micron 7450 PRO (PCIe Gen4 NVMe, U.3 3.84 TB+) product brief: sequential read 6.8 GB/s"
_GEN4_WRITE = "Micron 7450 PRO (PCIe Gen4 NVMe, U.3 3.84 TB+) product brief: sequential write 5.3 GB/s"
_GEN5_READ = "Micron 9550 PRO (PCIe Gen5 NVMe) product brief: sequential read 14.0 GB/s"
_GEN5_WRITE = "Micron 9550 PRO (PCIe Gen5 NVMe) product brief: sequential write 10.0 GB/s"
_ATTN_FP32 = "assumption: the FP32 peak (no published attention figure)"
_ATTN_BF16 = ("assumption: half the dense BF16 peak (the FlashAttention-2 paper reports 50-73% of the "
              "theoretical peak on A100)")


def _profile(name: str, device: str, cores: int, pinned: float, fp32: float, bf16_dense: float,
             read: float, write: float, src: dict) -> MachineRates:
    r = MachineRates(device=device, cores=cores, h2d_pinned=pinned, d2h_pinned=pinned,
                     h2d_pageable=pinned / 2, d2h_pageable=pinned / 2, matmul_flops=fp32,
                     attention_flops=fp32, bf16_matmul_flops=bf16_dense, bf16_attention_flops=bf16_dense / 2,
                     disk_read=read, disk_write=write, filesystem=src["filesystem"], source=name)
    r.sources = {"h2d_pinned": src["pinned"], "d2h_pinned": src["pinned"], "h2d_pageable": _PAGEABLE,
                 "d2h_pageable": _PAGEABLE, "matmul_flops": src["fp32"], "attention_flops": _ATTN_FP32,
                 "bf16_matmul_flops": src["bf16"], "bf16_attention_flops": _ATTN_BF16,
                 "disk_read": src["read"], "disk_write": src["write"], "cores": src["cores"]}
    return r


def _datasheet(sheet: str, fp32: int, bf16_sparse: int) -> dict:
    return {"fp32": f"{sheet}: FP32 {fp32} TFLOPS",
            "bf16": f"{sheet}: BF16 Tensor Core {bf16_sparse:,} TFLOPS with sparsity = {bf16_sparse // 2} dense"}


_GEN4 = {"read": _GEN4_READ, "write": _GEN4_WRITE, "filesystem": "PCIe Gen4 NVMe (Micron 7450 PRO class)"}
_GEN5 = {"read": _GEN5_READ, "write": _GEN5_WRITE, "filesystem": "PCIe Gen5 NVMe (Micron 9550 PRO class)"}
_GH200 = "NVIDIA GH200 Grace Hopper Superchip datasheet"

PROFILES = {
    "h100-pcie5-gen4nvme": _profile(
        "h100-pcie5-gen4nvme", "NVIDIA H100 PCIe 80GB", 14, 52e9, 51e12, 756e12, 6.8e9, 5.3e9,
        {"pinned": _PINNED_PCIE5, "cores": _DGX_CORES.format("H100"), **_GEN4,
         **_datasheet("NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe", 51, 1513)}),
    "h200-pcie5-gen5nvme": _profile(
        "h200-pcie5-gen5nvme", "NVIDIA H200 SXM 141GB", 14, 52e9, 67e12, 989e12, 14.0e9, 10.0e9,
        {"pinned": _PINNED_PCIE5 + "; the H200's host link is PCIe Gen5 x16", "cores": _DGX_CORES.format("H200"),
         **_GEN5, **_datasheet("NVIDIA H200 Tensor Core GPU datasheet, H200 SXM", 67, 1979)}),
    "gh200": _profile(
        "gh200", "NVIDIA GH200 Grace Hopper (H100 96GB, NVLink-C2C)", 72, 360e9, 67e12, 989e12, 14.0e9, 10.0e9,
        {"pinned": f"assumption: 360 GB/s = 80% of NVLink-C2C's 450 GB/s per direction ({_GH200}: NVLink-C2C "
                   "900 GB/s bidirectional)",
         "cores": f"{_GH200}: 72 Arm Neoverse V2 cores", **_GEN5, **_datasheet(_GH200, 67, 1979)}),
}


#: Spec-sheet dense rates of an H100 SXM (FLOP/s), for the precision note when no GPU's rates are
#: known: fp32 without tensor cores, TF32 and bf16 tensor cores.
H100_FP32, H100_TF32, H100_BF16 = 67e12, 495e12, 990e12


def precision_words(precision: str, tf32: bool = False, rates=None) -> Optional[str]:
    """For fp32 compute on a GPU with TF32 off, one line saying that the matmuls run at the GPU's
    fp32 rate (most of it idle) and what bf16 or TF32 would give, from ``rates``' fp32 and bf16
    matmul rates (measured, or a profile's) where they are a GPU's, else an H100's published
    ones; the choice itself is left as the user made it. None for bf16 or TF32 on. The run
    header's line on CUDA (``engine.memory.precision_note``) and ``mt.estimate``'s."""
    if precision != "fp32" or tf32:
        return None
    fp32 = getattr(rates, "matmul_flops", 0.0) or 0.0
    bf16 = getattr(rates, "bf16_matmul_flops", 0.0) or 0.0
    source = getattr(rates, "source", "measured")
    src = "measured here" if source == "measured" else f"the {source} profile"
    if not (fp32 > 0 and bf16 > 0) or getattr(rates, "device", "cuda") == "cpu":
        fp32, bf16, src = H100_FP32, H100_BF16, "an H100's published dense rates"
    return (f"fp32 compute with TF32 off: the matmuls run at the GPU's fp32 rate, {fp32 / 1e12:,.0f} TFLOPS "
            f"against {bf16 / 1e12:,.0f} in bf16 ({src}): most of the GPU idles. precision='bf16' (fp32 master "
            f"weights and gradients still; TrainingArguments(bf16=True)) would run them up to {bf16 / fp32:,.0f}x "
            f"faster, TF32 (TrainingArguments(tf32=True)) up to about {H100_TF32 / H100_FP32:,.0f}x on an H100; "
            "kept as set")


def profile_names() -> list:
    return sorted(PROFILES)


def rates_for(profile=None, *, cpu: Optional[MachineRates] = None) -> Optional[MachineRates]:
    """The rates a prediction uses: ``profile`` a ``MachineRates`` (as is), a profile's name (a
    copy of :data:`PROFILES`' entry; with ``cpu``, the CPU rates a profile leaves at 0 taken from
    it) or None (None: the caller measures, ``mt.measure_machine()``). An unknown name raises
    ValueError listing the known ones."""
    if profile is None or isinstance(profile, MachineRates):
        return profile
    if not isinstance(profile, str):
        raise TypeError(f"rates: a MachineRates, a profile name ({', '.join(profile_names())}) or None, "
                        f"not {type(profile).__name__}")
    if profile not in PROFILES:
        raise ValueError(f"unknown machine profile {profile!r}; known profiles: {', '.join(profile_names())} "
                         "(or measure this machine: megatrain-nb machine)")
    r = MachineRates.from_dict(PROFILES[profile].to_dict())
    return r.with_cpu_from(cpu) if cpu is not None else r

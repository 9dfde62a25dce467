"""``mt.measure_machine``: this machine's rates (:class:`~.rates.MachineRates`), measured at the
engine's own sizes and through its own code paths, cached per machine, device and filesystem.

What is measured (each a median over repeated runs after a warm-up, within a time budget):

* host<->device copies of one layer-sized tensor (256 MiB on CUDA: a 1-2B model's layer; 64 MiB
  on a CPU device), pageable and pinned; on a CPU device the memcpy rate (all four copy fields);
* fp32 matmul FLOP/s at a default shape and, for a model, at its own shapes (hidden x hidden,
  hidden x intermediate, intermediate x hidden, hidden x vocab at ``tokens`` tokens); a dimension
  larger than the measurement's memory cap is measured on a slice of it (the rate of a large
  matmul is that of its slices); bf16 at the default shape;
* attention FLOP/s through ``scaled_dot_product_attention`` (causal forward, counted as
  2·B·H·S²·D FLOPs) at the model's head size (64 without a model), fp32 and bf16; on a CPU
  device also its forward and backward at rows of 128, 512 and 2048 tokens (head size 64, one
  thread: ``attention_by_seq``, ``attention_backward_by_seq``);
* disk read and write through :class:`~.disk_store.DiskStore` itself (O_DIRECT where the
  filesystem takes it, its 32 MiB syscalls, its worker threads, several layer-sized files in
  flight, checksums, fdatasync and rename) in a private folder under ``offload_dir``;
* the fused CPU AdamW (``UnitAdamW.fused``, what :mod:`.optimizer` calls) in parameters/s
  and each codec's encode+decode of both moments in fp32 bytes/s, on one thread;
* on a CPU device, its matmul rate on torch's threads (as a step computes) while the DiskStore
  writes and reads beside it, over its rate alone (``compute_beside_disk``: the disk tier's I/O
  slows a CPU step's compute);
* the CPU cores this process may use.

A reading its others contradict (a plain AdamW below 1/2.5 of a compressed update chain, which
runs the same AdamW on fewer bytes; a one-thread matmul below 1/1.25 of its team's over
``cores``) is taken again, the largest kept; still contradicted, the rates are used once with a
warning, not cached (:func:`retake_contradicted`).

The whole takes 10-20 s on a 2-core CPU machine (``seconds_taken``), less on a GPU machine's
CPU. The result is cached as JSON in the package's cache folder (:func:`cache_dir`:
``$MEGATRAIN_NB_CACHE``, else ``~/.cache/megatrain_nb``, as the built-in corpus) under a
name made of the host, the device and ``offload_dir``'s filesystem, written atomically; the next
call reads it (``refresh=True`` measures again; a damaged file, one that is not this user's
regular file writable by nobody else, or one whose values are not plausible rates is measured
again with a warning naming it and why: :func:`load_cached`).
A model's shapes missing from the cached file are measured and added to it.
"""
from __future__ import annotations

import contextlib

import os
import statistics
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatrain_nb.model_source import resolve
from megatrain_nb.threads import MEASURE, thread_name
from megatrain_nb.values import check

from . import family
from .config import EngineOverrides
from .updates.codecs import codec_names, get_codec
from .tiers.disk_format import aligned_empty
from .tiers.disk_store import DiskStore
from .tiers.diskspace import filesystem_of, filesystem_text
from .updates.optimizer import UnitAdamW
from .transport.pinned import release_cached_pinned
from .planning.prediction import GRAD_ACCESSES_PER_PARAM
from .planning.rates import MachineRates, check_rates, elementwise_accesses, shape_key
from .planning.rates_cache import (CACHE_VERSION, CacheRefused, cache_dir, cache_key, cached_rates,  # noqa: F401 - re-exported
                          device_name, load_cached, save_cached)
from .updates.states import OptimizerStates
from .telemetry import Telemetry

MIB = 1 << 20


@dataclass(frozen=True)
class Sizes:
    """How big each measurement is, and how long it repeats (``budget_s`` per rate)."""

    copy_bytes: int            # a layer-sized host<->device copy (a 1-2B model's layer)
    flop_cap: float            # FLOPs of one timed matmul at most (M shrinks to fit)
    dim_cap: int               # K and N measured at most this large (a slice of a larger one)
    default_shape: Tuple[int, int, int]
    attention: Tuple[int, int]  # heads, sequence length
    disk_file_bytes: int
    disk_files: int
    adamw_numel: int
    codec_numel: int
    budget_s: float
    min_runs: int
    codec_span: int = 16        # chunks the codec cycles over (a working set beyond the caches)
    chain_numel: int = 1 << 22  # one unit's update, measured whole (a layer of a ~1B model)


def sizes_for(cuda: bool, quick: bool) -> Sizes:
    """The sizes for a CUDA device or a CPU one; ``quick``: tiny ones (tests)."""
    if quick:
        return Sizes(256 * 1024, 2e6, 128, (32, 64, 64), (2, 32), 1 * MIB, 2, 4096, 4096, 0.0, 1, 1, 1 << 14)
    if cuda:
        return Sizes(256 * MIB, 2e12, 16384, (4096, 4096, 4096), (16, 2048), 64 * MIB, 4, 1 << 24, 1 << 20, 0.4, 3)
    return Sizes(64 * MIB, 1.5e9, 2048, (512, 1024, 1024), (8, 512), 32 * MIB, 4, 1 << 24, 1 << 20, 0.4, 3)


# ---------------------------------------------------------------------------------------- timing
def _rate(fn: Callable[[], None], work: float, sizes: Sizes, sync: Callable[[], None] = lambda: None) -> float:
    """``work`` per second of ``fn``: one warm-up call, then the median of at least
    ``min_runs`` timed calls, more while the budget lasts (at most 20)."""
    fn()
    sync()
    times: List[float] = []
    end = time.perf_counter() + sizes.budget_s
    while len(times) < sizes.min_runs or (time.perf_counter() < end and len(times) < 20):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return work / max(statistics.median(times), 1e-9)


def _mean_rate(fn: Callable[[], None], work: float, sizes: Sizes) -> float:
    """``work`` per second of ``fn`` over a stretch: one warm-up call, then calls for
    :data:`MEAN_STRETCH` budgets (at least ``min_runs``), all their work over all their time."""
    fn()
    n, t0 = 0, time.perf_counter()
    end = t0 + MEAN_STRETCH * sizes.budget_s
    while n < sizes.min_runs or time.perf_counter() < end:
        fn()
        n += 1
    return work * n / max(time.perf_counter() - t0, 1e-9)


#: A mean rate's stretch, in budgets of a rate (``Sizes.budget_s``).
MEAN_STRETCH = 2


def _sync_for(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


class _OneThread:
    """torch runs single-threaded inside (the per-thread rates), as before outside."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)


# ---------------------------------------------------------------------------------------- rates
def measure_copies(device: torch.device, nbytes: int, sizes: Sizes) -> dict:
    """h2d/d2h pageable and pinned bytes/s of an ``nbytes`` tensor (memcpy on a CPU device)."""
    n = max(1, nbytes // 4)
    host = torch.full((n,), 1.5)
    if device.type != "cuda":
        out = torch.empty_like(host)
        r = _rate(lambda: out.copy_(host), 4 * n, sizes)
        return dict(h2d_pageable=r, h2d_pinned=r, d2h_pageable=r, d2h_pinned=r)

    sync = _sync_for(device)
    dev = torch.empty(n, device=device)
    pinned = torch.empty(n, pin_memory=True).fill_(1.5)
    out = dict(h2d_pageable=_rate(lambda: dev.copy_(host), 4 * n, sizes, sync),
               h2d_pinned=_rate(lambda: dev.copy_(pinned, non_blocking=True), 4 * n, sizes, sync),
               d2h_pageable=_rate(lambda: host.copy_(dev), 4 * n, sizes, sync),
               d2h_pinned=_rate(lambda: pinned.copy_(dev, non_blocking=True), 4 * n, sizes, sync))
    del dev, pinned
    torch.cuda.empty_cache()          # (the measurement leaves no device or pinned memory behind)
    release_cached_pinned()
    return out


def measure_matmul(device: torch.device, m: int, k: int, n: int, sizes: Sizes, dtype=torch.float32) -> float:
    """FLOP/s of (m x k) @ (k x n); K and N above ``dim_cap`` measured on a slice, M shrunk so
    one product stays under ``flop_cap``."""
    k, n = min(k, sizes.dim_cap), min(n, sizes.dim_cap)
    m = max(1, min(m, int(sizes.flop_cap // (2 * k * n)) or 1))
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    return _rate(lambda: torch.mm(a, b, out=out), 2.0 * m * k * n, sizes, _sync_for(device))


def measure_attention(device: torch.device, head_dim: int, sizes: Sizes, dtype=torch.float32) -> float:
    """FLOP/s of a causal SDPA forward, counted as 2·B·H·S²·D (the half of the square it needs)."""
    import torch.nn.functional as F

    heads, seq = sizes.attention
    q, k, v = (torch.randn(1, heads, seq, head_dim, device=device).to(dtype) for _ in range(3))
    return _rate(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), 2.0 * heads * seq * seq * head_dim,
                 sizes, _sync_for(device))


#: Rows the attention is measured on by length (``MachineRates.attention_by_seq``): (tokens, heads),
#: the same FLOPs at each length; QUICK_ROWS: tests'.
ATTENTION_ROWS = ((128, 128), (512, 8), (2048, 2))
QUICK_ROWS = ((16, 2), (64, 1))


def measure_attention_rows(sizes: Sizes) -> Tuple[dict, dict]:
    """(forward, backward) FLOP/s of a causal SDPA at head size 64 on the caller's threads, per row
    length of :data:`ATTENTION_ROWS` (the backward's FLOPs counted as twice the forward's, as the
    prediction counts them; the backward timed alone, on a kept graph)."""
    import torch.nn.functional as F

    fwd, bwd = {}, {}
    for seq, heads in (ATTENTION_ROWS if sizes.budget_s else QUICK_ROWS):
        q, k, v = (torch.randn(1, heads, seq, 64).requires_grad_() for _ in range(3))
        flops = 2.0 * heads * seq * seq * 64
        with torch.no_grad():
            fwd[str(seq)] = _rate(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), flops, sizes)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grad = torch.randn_like(out)
        bwd[str(seq)] = _rate(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), 2 * flops, sizes)
    return fwd, bwd


def _write_files(store: DiskStore, prefix: str, data: List[torch.Tensor]) -> None:
    """``data`` written as files ``<prefix>.<i>``, behind, then flushed (synced and renamed)."""
    for i, t in enumerate(data):
        store.write(f"{prefix}.{i}", {"data": t})
    store.flush()


def _read_files(store: DiskStore, prefix: str, outs: List[torch.Tensor]) -> None:
    """Those files read back into ``outs``, all issued at once (read ahead)."""
    for f in [store.read(f"{prefix}.{i}", {"data": t}) for i, t in enumerate(outs)]:
        f.result()


#: The small files :func:`measure_disk` times beside the layer-sized ones: this many times as many,
#: each this many times smaller (a quarter of the bytes).
SMALL_FILES = 4
SMALL_FILE_SHARE = 16
#: Rounds of the four timings (large and small files, written and read), the first a warm-up: at
#: least this many, more while twice the budget of a rate lasts, at most the second.
DISK_ROUNDS, DISK_ROUNDS_MAX = 4, 12


def _file_cost(big: float, small: float, n_big: int, n_small: int, bytes_big: int, bytes_small: int) -> Tuple[float, float]:
    """(bytes/s, seconds a file) from the seconds ``big`` and ``small`` two sets of files took
    (``n_*`` files, ``bytes_*`` bytes in all): each file costs ``a`` beyond its bytes at ``R``,
    ``t = n·a + bytes / R``, solved from the two. A cost below a microsecond (noise) counts as
    one; the bandwidth is then the large files' as measured."""
    ratio = bytes_small / bytes_big
    a = max((small - big * ratio) / max(n_small - n_big * ratio, 1e-9), 1e-6)
    left = big - n_big * a
    if left < 0.1 * big:   # (the small files' cost would leave the large ones almost no bytes: noise)
        a, left = 1e-6, big
    return bytes_big / left, a


def measure_disk(root: str, sizes: Sizes) -> dict:
    """Read and write bytes/s through the engine's DiskStore under ``root``, and the seconds each
    file costs beyond its bytes (its open, header, sync and rename; ``disk_read_file_s``,
    ``disk_write_file_s``): ``disk_files`` layer-sized files written behind (timed to
    ``flush()``), then read ahead into aligned buffers, and the same for :data:`SMALL_FILES` times
    as many files :data:`SMALL_FILE_SHARE` times smaller, the four in turn (medians of the
    rounds). Measured on a 2-core VM's ext4: 0.74-1.08 ms a file written and 0.27-0.33 ms read
    when quiet, ~2.6 and ~1 ms beside a test suite (a 1 MiB file written at 130-250 MB/s where
    64 MiB ones went at 440-470): a step whose units are small pays it on every file."""
    numel = sizes.disk_file_bytes // 4
    small = max(numel // SMALL_FILE_SHARE, 1024)
    n_small = SMALL_FILES * sizes.disk_files
    data = [aligned_empty(numel).fill_(1.0 + i) for i in range(sizes.disk_files)]
    outs = [aligned_empty(numel) for _ in data]
    bits = [aligned_empty(small).fill_(2.0 + i) for i in range(n_small)]
    bit_outs = [aligned_empty(small) for _ in bits]
    total, total_small = 4 * numel * len(data), 4 * small * n_small
    calls = (lambda: _write_files(store, "rate", data), lambda: _write_files(store, "small", bits),
             lambda: _read_files(store, "rate", outs), lambda: _read_files(store, "small", bit_outs))
    times: List[List[float]] = [[] for _ in calls]
    with DiskStore(root) as store:
        # the four in turn, round after round (a VM's disk drifts: each pair is timed side by side)
        end = time.perf_counter() + 2 * sizes.budget_s
        for i in range(DISK_ROUNDS_MAX):
            for call, ts in zip(calls, times):
                t0 = time.perf_counter()
                call()
                ts.append(time.perf_counter() - t0)
            if i + 1 >= max(sizes.min_runs, DISK_ROUNDS) and time.perf_counter() > end:
                break
        direct = store.direct_io
    if not all(torch.equal(a, b) for a, b in zip(data + bits, outs + bit_outs)):
        raise RuntimeError(f"measure_machine: the disk under {root} read back different data")
    w, ws, r, rs = (statistics.median(ts[1:]) for ts in times)   # (the first round: a warm-up)
    write, write_file = _file_cost(w, ws, len(data), n_small, total, total_small)
    read, read_file = _file_cost(r, rs, len(data), n_small, total, total_small)
    return dict(disk_read=read, disk_write=write, disk_read_file_s=read_file, disk_write_file_s=write_file,
                direct_io=direct)


def measure_team_beside_disk(root: str, sizes: Sizes) -> Tuple[float, float]:
    """A CPU device's matmul rate while the DiskStore writes and reads under ``root``, over its
    rate alone (<= 1), on torch's threads as a step computes (its intra-op team): the disk tier's
    I/O threads (their syscalls, checksums, the transfers into memory) pre-empt the team's threads
    and it waits at its barriers. Measured on a 2-core VM: 0.64-0.79 with the team; one thread
    alone barely noticed (0.80-1.00, noise-sized: a reading of 1.00 made a clipped step's gradients
    held on the disk look free to the planner, and the step ran 1.13 s against 1.0). Both rates
    are means over a stretch (:func:`_mean_rate`): once the disk tier's I/O threads spent less CPU
    (the eighth session), their work came in bursts most single calls missed, and a median of
    calls read 0.97-1.00 where the stretch's mean was 0.65-0.75. Returns
    (the team's FLOP/s alone, the mean of two; that ratio): ``team_matmul_flops``, ``compute_beside_disk``."""
    m, k, n = sizes.default_shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    numel = sizes.disk_file_bytes // 4
    data = [aligned_empty(numel).fill_(1.0 + i) for i in range(sizes.disk_files)]
    stop, failed = threading.Event(), []

    def io() -> None:
        try:
            with DiskStore(root) as store:
                while not stop.is_set():
                    _write_files(store, "beside", data)
                    _read_files(store, "beside", data)
        except BaseException as e:   # (said after the measurement, not lost in a thread)
            failed.append(e)

    def matmul() -> float:
        # the mean rate over a stretch, not a median of calls: the I/O threads take a core in
        # bursts (a read's completion, a checksum), so most single calls run clean and their
        # median read 0.97-1.00 where the stretch's mean was 0.65-0.75
        return _mean_rate(lambda: torch.mm(a, b, out=out), 2.0 * m * k * n, sizes)

    alone, beside = [], []
    for _ in range(2):   # alone and beside in turn, twice (a shared machine's load moves)
        alone.append(matmul())
        stop.clear()
        thread = threading.Thread(target=io, name=thread_name(MEASURE), daemon=True)
        thread.start()
        try:
            beside.append(matmul())
        finally:
            stop.set()
            thread.join(timeout=30)
        if failed:
            raise RuntimeError(f"measure_machine: the disk under {root} failed beside the compute: {failed[0]}")
    return sum(alone) / len(alone), min(sum(beside) / sum(alone), 1.0)


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm, op for op (``LlamaRMSNorm.forward``)."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def elementwise_layer(tokens: int, hidden: int, inter: int, heads: int) -> Callable[[], None]:
    """One call: a decoder layer's non-matmul work, forward and backward under autograd, with the
    matmuls' outputs standing in as leaves (what ``rates.elementwise_accesses`` counts: two
    RMSNorms, rotary on the queries and keys, the attention's transposes, two residual adds, the
    gated MLP's silu and product)."""
    hd = hidden // heads
    leaf = lambda *shape: torch.randn(*shape).requires_grad_()  # noqa: E731
    x, q, k, o, gate, up = (leaf(tokens, hidden), leaf(tokens, hidden), leaf(tokens, hidden), leaf(tokens, hidden),
                            leaf(tokens, inter), leaf(tokens, inter))
    w1, w2 = leaf(hidden), leaf(hidden)
    ang = torch.arange(tokens)[:, None] * torch.rand(hd // 2)[None]
    cos, sin = (torch.cat((f(ang), f(ang)), -1)[None] for f in (torch.cos, torch.sin))   # (1, tokens, hd)

    def layer() -> None:
        _rms_norm(x, w1)
        qh, kh = (t.view(tokens, heads, hd).transpose(0, 1) for t in (q, k))
        qr = qh * cos + _rotate_half(qh) * sin
        kr = kh * cos + _rotate_half(kh) * sin
        a = x + (qr + kr).transpose(0, 1).contiguous().view(tokens, hidden)   # (the attention's output, laid back)
        n2 = _rms_norm(a, w2)
        h2 = a + o
        mlp = torch.nn.functional.silu(gate) * up
        torch.autograd.backward([n2, h2, mlp], [torch.ones_like(n2), torch.ones_like(h2), torch.ones_like(mlp)])
        for t in (x, q, k, o, gate, up, w1, w2):
            t.grad = None
    return layer


def measure_elementwise(sizes: Sizes) -> float:
    """Element accesses/s (``rates.elementwise_accesses``) of :func:`elementwise_layer` at the
    default shape's tokens x hidden (intermediate 8/3 of it, head size 64) on the caller's threads
    (``measure_machine``: one, as the matmul's rate; the prediction scales both by the team's
    measured speed-up. On the whole team such a chain ran 13x slower than on one thread while
    other processes held the cores, load 4 on 2 cores, where a step ran 2.4x slower: a team's rate
    is not what a step sees under load; one thread's is steady)."""
    tokens, hidden = sizes.default_shape[0], sizes.default_shape[1]
    inter = hidden * 8 // 3 // 32 * 32
    return _rate(elementwise_layer(tokens, hidden, inter, max(hidden // 64, 1)),
                 elementwise_accesses(tokens, hidden, inter), sizes)


#: The step-like chains the compute's team is measured on (``MachineRates.step_team``): (tokens,
#: hidden, intermediate, heads, layers) of a small step of many small operations and a large one.
STEP_CHAINS = ((64, 256, 672, 4, 4), (512, 1024, 1024, 16, 1))
QUICK_CHAINS = ((16, 64, 128, 2, 2), (64, 128, 256, 2, 1))


def decoder_chain(tokens: int, hidden: int, inter: int, heads: int, layers: int) -> Callable[[], None]:
    """One call: ``layers`` Llama-like decoder layers (each its own weights: RMSNorm, q/k/v/o, rotary,
    causal SDPA, the gated MLP, the residual adds) forward and backward under autograd on one row of
    ``tokens`` -- the sequence of operations a CPU step runs, op by op, at one size."""
    F = torch.nn.functional
    hd = hidden // heads
    leaf = lambda *shape: (torch.randn(*shape) * shape[-1] ** -0.5).requires_grad_()  # noqa: E731
    ws = [dict(n1=leaf(hidden), n2=leaf(hidden), q=leaf(hidden, hidden), k=leaf(hidden, hidden),
               v=leaf(hidden, hidden), o=leaf(hidden, hidden), g=leaf(inter, hidden), u=leaf(inter, hidden),
               d=leaf(hidden, inter)) for _ in range(layers)]
    x = torch.randn(tokens, hidden).requires_grad_()
    ang = torch.arange(tokens)[:, None] * torch.rand(hd // 2)[None]
    cos, sin = (torch.cat((f(ang), f(ang)), -1)[None] for f in (torch.cos, torch.sin))   # (1, tokens, hd)

    def heads_of(t: torch.Tensor) -> torch.Tensor:
        return t.view(tokens, heads, hd).transpose(0, 1)

    def step() -> None:
        h = x
        for w in ws:
            n = _rms_norm(h, w["n1"])
            q, k, v = (heads_of(F.linear(n, w[key])) for key in ("q", "k", "v"))
            q, k = (t * cos + _rotate_half(t) * sin for t in (q, k))
            a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
            h = h + F.linear(a.transpose(0, 1).reshape(tokens, hidden), w["o"])
            n2 = _rms_norm(h, w["n2"])
            h = h + F.linear(F.silu(F.linear(n2, w["g"])) * F.linear(n2, w["u"]), w["d"])
        h.sum().backward()
        x.grad = None
        for w in ws:
            for t in w.values():
                t.grad = None
    return step


def chain_count_seconds(r: MachineRates, tokens: int, hidden: int, inter: int, heads: int, layers: int) -> float:
    """Seconds :func:`decoder_chain` takes as the prediction counts it at ``r``'s one-thread rates:
    its matmuls (6 FLOPs a parameter a token) at ``matmul_flops``, its attention (2·s²·h forward,
    twice backward) at the head size's forward and backward rates for its row (``attention_rates``), its non-matmul work (``elementwise_accesses``, three
    passes, and the gradients' accesses a parameter, as the prediction counts them) at ``elementwise_rate``."""
    params = layers * (4 * hidden * hidden + 3 * hidden * inter)
    mm = 6.0 * params * tokens / r.matmul_flops
    fwd, bwd = r.attention_rates(hidden // heads, tokens)   # (a row of ``tokens``)
    at = 2.0 * tokens * tokens * hidden * layers * (1 / (fwd or r.matmul_flops) + 2 / (bwd or r.matmul_flops))
    ew = (layers * elementwise_accesses(tokens, hidden, inter, 3.0) + GRAD_ACCESSES_PER_PARAM * params) / r.elementwise_rate
    return mm + at + ew


def measure_step_team(r: MachineRates, sizes: Sizes) -> dict:
    """``MachineRates.step_team``: at each of :data:`STEP_CHAINS`' sizes, the seconds the prediction
    counts for :func:`decoder_chain` at ``r``'s one-thread rates over the seconds it takes on torch's
    threads (the compute's team, as a step runs it), or on one thread where that is faster. A step of many small operations wakes the team
    for each and gets less of it than a large matmul in a hot loop (``team_matmul_flops``);
    the prediction interpolates between the sizes by a micro-batch's tokens x hidden. Needs ``r``'s
    one-thread matmul, attention and element rates (measured before it)."""
    out = {}
    for tokens, hidden, inter, heads, layers in (STEP_CHAINS if sizes.budget_s else QUICK_CHAINS):
        chain = decoder_chain(tokens, hidden, inter, heads, layers)
        team = _rate(chain, 1.0, sizes)   # (calls a second, on torch's threads)
        with _OneThread():
            one = _rate(chain, 1.0, sizes)
        # never below one thread's: while other processes hold the cores a team's small operations
        # wait at every barrier (64 x 256 ran 20x the count on the team at load 9 on 2 cores, where
        # the steps ran 2-3x their quiet time); one thread stays steady
        out[f"{tokens}x{hidden}"] = chain_count_seconds(r, tokens, hidden, inter, heads, layers) * max(team, one)
    return out


def measure_softmax(sizes: Sizes) -> float:
    """Logits/s of the loss head's log-softmax and loss (``cross_entropy``), forward and backward,
    over one chunk of the engine's (``EngineOverrides.loss_chunk_tokens`` tokens by a vocabulary of
    8192: its logits allocated as a step allocates them, beyond the caches; measured: per logit
    4x slower than at a quarter of the chunk, 12x at twice it) on the caller's threads."""
    tokens, vocab = (EngineOverrides().loss_chunk_tokens, 8192) if sizes.budget_s else (sizes.default_shape[0], 256)
    logits, labels = torch.randn(tokens, vocab).requires_grad_(), torch.randint(0, vocab, (tokens,))

    def head() -> None:
        torch.nn.functional.cross_entropy(logits, labels).backward()
        logits.grad = None
    return _rate(head, float(tokens * vocab), sizes)


def adamw_step(numel: int, threads: int = 1) -> tuple:
    """``(step, params, grads)``: one call of ``step`` is one update of ``numel`` fp32 parameters
    by the engine's plain AdamW (``UnitAdamW.fused``: the fused kernels' where they are built,
    else torch's) on ``threads`` threads, as the engine runs it (what this module and
    bench_update_speed.py time)."""
    p, g = torch.randn(numel), torch.randn(numel) * 1e-3
    m, v, t = torch.zeros(numel), torch.zeros(numel), torch.zeros(())
    adam = UnitAdamW(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, threads=threads)

    def step():
        t.add_(1)
        adam.fused(p, g, m, v, t, 1e-4, 0.01)
    return step, p, g


def measure_adamw(numel: int, sizes: Sizes) -> float:
    """Parameters/s of the engine's fused CPU AdamW (:func:`adamw_step`) on one thread;
    torch.optim.AdamW(foreach=True) where the fused kernel is missing."""
    fused, p, g = adamw_step(numel)
    with _OneThread():
        try:
            return _rate(fused, numel, sizes)
        except (RuntimeError, AttributeError, NotImplementedError):
            param = torch.nn.Parameter(p)
            param.grad = g
            opt = torch.optim.AdamW([param], lr=1e-4, foreach=True)
            return _rate(opt.step, numel, sizes)


def measure_codecs(numel: int, sizes: Sizes, span: int = 1) -> dict:
    """Per codec (not "none"): fp32 bytes/s of encoding and decoding both moments, one thread,
    one ``numel`` chunk at a time over ``span`` chunks (a model's states are far larger than the
    caches: ``span`` 16 makes the working set so too)."""

    out = {}
    x = {"exp_avg": torch.randn(numel * span) * 1e-3, "exp_avg_sq": torch.rand(numel * span) * 1e-6}
    with _OneThread():
        for name in codec_names():
            if name == "none":
                continue
            seconds = 0.0
            for role, t in x.items():
                codec = get_codec(name, role)
                chunks = list(t.split(numel))
                encs = [codec.encode(c) for c in chunks]
                back = torch.empty(numel)
                turn = iter(range(1 << 30))
                seconds += 4 * numel / _rate(lambda: codec.encode(chunks[next(turn) % span]), 4 * numel, sizes)
                seconds += 4 * numel / _rate(lambda: codec.decode(encs[next(turn) % span], back), 4 * numel, sizes)
            out[name] = 2 * 4 * numel / seconds
    return out


class _BesideCompute:
    """On a CPU device, a thread running one-thread matmuls while the block measures: the engine
    runs AdamW and the codecs beside its compute (memory bandwidth and caches shared), and their
    rates measured alone were about twice what a training step saw (bench_prediction.py)."""

    def __init__(self, dev: torch.device):
        self.on = dev.type != "cuda"
        self.stop = threading.Event()

    def _spin(self) -> None:
        torch.set_num_threads(1)
        a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
        while not self.stop.is_set():
            a @ b

    def __enter__(self):
        if self.on:
            self.thread = threading.Thread(target=self._spin, name=thread_name(MEASURE), daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.on:
            self.stop.set()
            self.thread.join(timeout=10)


def measure_update_chain(codec: str, numel: int, sizes: Sizes) -> float:
    """Parameters/s of one unit's whole update with compressed states, as the engine runs it:
    ``OptimizerStates.update`` -- where the fused kernels are built (``fused_update.kernels()``),
    each chunk's codes decoded, stepped and encoded in one pass in this thread; else each chunk
    of the moments decoded in ``mtnb-decode`` a chunk ahead, AdamW on it in this thread, encoded
    in ``mtnb-encode`` a chunk behind -- the codes stored. (Its stages' rates alone missed the
    hand-offs and the sharing: the chain ran about twice as long in a training step as their sum
    said.)"""
    unit = SimpleNamespace(index=0, numel=numel, name="measure", decay_numel=numel)   # (all decayed)
    states = OptimizerStates([unit], SimpleNamespace(optimizer_compression=codec), Telemetry())
    adam = UnitAdamW(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    p, g = torch.randn(numel), torch.randn(numel) * 1e-3

    def one():
        run = adam.start_unit(unit, p, collect_stats=False)
        states.update(unit, lambda a, b, m, v, q=None: run.step(a, b, g, m, v, 1e-4, params=q))
        run.finish(g, grad_norm=None)
    try:
        with _OneThread():
            return _rate(one, numel, sizes)
    finally:
        states.close()


def update_rates(dev: torch.device, sizes: Sizes) -> tuple:
    """(AdamW parameters/s, codec bytes/s per codec, the update chain's parameters/s per codec),
    per thread, as the engine runs them: beside the compute on a CPU device, over a working set
    larger than the caches."""
    with _BesideCompute(dev):
        chain = {name: measure_update_chain(name, sizes.chain_numel, sizes) for name in codec_names() if name != "none"}
        return measure_adamw(sizes.adamw_numel, sizes), measure_codecs(sizes.codec_numel, sizes, sizes.codec_span), chain


#: A compressed update chain moves fewer bytes a parameter than a plain AdamW (int8: ~16 B against
#: 28 -- the weights, the gradient, the moments' codes in and out, against fp32 moments), so where
#: memory bounds them it may run faster (this VM: the int8 chain at up to 1.56x a plain AdamW
#: measured beside it), but not 2.5x: a plain AdamW below 1/2.5 of a chain is a disturbed reading.
#: (A busy spell over the ~0.4 s a rate is timed once measured AdamW at 144 M params/s beside
#: chains of 471, where every later call measured 539-956: cached, it prices and picks every
#: later run's plan.)
CHAIN_OVER_ADAMW = 2.5
#: torch's team of ``cores`` threads measured 1.75-2.24x one thread's matmul on this 2-core VM;
#: above 1.25x ``cores`` the one-thread reading was disturbed (a team of 107 GFLOP/s beside one
#: thread of 38, where the next measurement read 127 and 57).
TEAM_OVER_CORES = 1.25
#: Times a contradicted reading is taken again (the largest reading kept).
RETAKES = 2


def _contradicted(r: MachineRates) -> Dict[str, str]:
    """The readings of ``r`` its other readings contradict (:data:`CHAIN_OVER_ADAMW`,
    :data:`TEAM_OVER_CORES`): field -> "field=value (why)"."""
    out = {}
    chain = max((r.update_chain or {}).values(), default=0.0)
    if r.adamw_per_thread and r.adamw_per_thread * CHAIN_OVER_ADAMW < chain:
        out["adamw_per_thread"] = (f"adamw_per_thread={r.adamw_per_thread / 1e6:.0f} M params/s (a compressed update "
                                   f"chain, which runs the same AdamW on fewer bytes, measured {chain / 1e6:.0f})")
    team, cores_ = r.team_matmul_flops or 0.0, max(int(r.cores or 1), 1)
    if r.compute_threads == 1 and r.matmul_flops and team > r.matmul_flops * cores_ * TEAM_OVER_CORES:
        out["matmul_flops"] = (f"matmul_flops={r.matmul_flops / 1e9:.1f} GFLOP/s one thread (torch's {cores_} "
                               f"threads measured {team / 1e9:.1f})")
    return out


def retake_contradicted(r: MachineRates, dev: torch.device, sizes: Sizes) -> List[str]:
    """Take again, at most :data:`RETAKES` times each, the readings of ``r`` its other readings
    contradict (:func:`_contradicted`), keeping each one's largest (a one-thread matmul taken
    again: the step's team, counted at it, measured again too); returns what still contradicts
    (then the rates are used once and not cached: :func:`measure_machine`)."""
    matmul = r.matmul_flops
    for _ in range(RETAKES):
        bad = _contradicted(r)
        if "adamw_per_thread" in bad:
            with _BesideCompute(dev):
                r.adamw_per_thread = max(r.adamw_per_thread, measure_adamw(sizes.adamw_numel, sizes))
        if "matmul_flops" in bad:
            with _compute_threads(dev, r):
                r.matmul_flops = max(r.matmul_flops, measure_matmul(dev, *sizes.default_shape, sizes))
        if not bad:
            break
    if r.matmul_flops != matmul and r.step_team:
        r.step_team = measure_step_team(r, sizes)
    return list(_contradicted(r).values())


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------- a model's shapes
@dataclass(frozen=True)
class ModelShapes:
    matmuls: Tuple[Tuple[int, int, int], ...]   # (M, K, N)
    head_dim: int


def model_shapes(model, tokens: int) -> ModelShapes:
    """The matmul shapes (at ``tokens`` tokens) and head size of a model (a preset
    name, a model folder, a config.json, a config or a model: as ``mt.estimate`` takes)."""
    cfg = family.text_config(resolve(model, hub=False).config())
    h = family.hidden_size(cfg)
    if not h:
        raise ValueError(f"measure_machine: cannot read the hidden size of {model!r}'s config")
    inter = family.intermediate_size(cfg) or 4 * h
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None) or max(1, h // 64)
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    shapes = {(tokens, h, heads * head_dim), (tokens, h, inter), (tokens, inter, h),
              (tokens, h, family.vocab_size(cfg))}
    return ModelShapes(tuple(sorted(shapes)), int(head_dim))


# ---------------------------------------------------------------------------------------- measure_machine
def _device(device) -> Tuple[torch.device, str]:
    """The torch device to measure and its cache name (rates_cache.device_name, which checks it)."""
    name = device_name(device)
    return torch.device(name.split(" ")[0]), name


def _measure_all(dev: torch.device, name: str, root: str, fs_text: str, sizes: Sizes,
                 shapes: Optional[ModelShapes]) -> MachineRates:
    """Every rate, measured now (the cache's miss; tests count its calls)."""
    t0 = time.perf_counter()
    r = MachineRates(device=name, cores=cores(), **measure_copies(dev, sizes.copy_bytes, sizes))
    with _compute_threads(dev, r):
        r.matmul_flops = measure_matmul(dev, *sizes.default_shape, sizes)
        r.bf16_matmul_flops = measure_matmul(dev, *sizes.default_shape, sizes, torch.bfloat16)
        r.attention_flops = measure_attention(dev, 64, sizes)
        r.bf16_attention_flops = measure_attention(dev, 64, sizes, torch.bfloat16)
    r.attention_by_head = {"64": r.attention_flops}
    disk = measure_disk(root, sizes)
    _set_disk(r, disk)
    r.disk_path = root
    r.filesystem = fs_text + (", direct I/O" if disk["direct_io"] else ", buffered I/O (no O_DIRECT)")
    if dev.type != "cuda":
        _add_team(r, root, sizes)
    r.adamw_per_thread, r.codec_per_thread, r.update_chain = update_rates(dev, sizes)
    r.update_chain_threads = r.chain_threads()   # (the engine's split, as update_rates ran it)
    _add_model(r, dev, sizes, shapes)
    r.measured_at = time.time()
    r.seconds_taken = time.perf_counter() - t0
    return r


def _set_disk(r: MachineRates, disk: dict) -> None:
    r.disk_read, r.disk_write = disk["disk_read"], disk["disk_write"]
    r.disk_read_file_s, r.disk_write_file_s = disk["disk_read_file_s"], disk["disk_write_file_s"]


def _add_disk_files(r: MachineRates, root: str, sizes: Sizes) -> bool:
    """The disk's cost a file (``disk_read_file_s``, ``disk_write_file_s``), with its bandwidth
    beyond it, measured where a cache written before them lacks it (its ``disk_read`` and
    ``disk_write`` were the layer-sized files' rates, that cost included); True if it was."""
    if r.disk_read_file_s and r.disk_write_file_s:
        return False
    _set_disk(r, measure_disk(root, sizes))
    return True


def _add_team(r: MachineRates, root: str, sizes: Sizes) -> bool:
    """A CPU device's attention by row length on one thread (``attention_by_seq``, its backward's),
    its matmul on torch's threads (the compute's team) alone and beside the disk tier
    (``team_matmul_flops``, ``compute_beside_disk``) and its non-matmul work on one thread
    (``elementwise_rate``, ``softmax_rate``), a memcpy's team over one thread (``memory_speedup``),
    the team on a step-like chain of operations at a small and a large size (``step_team``) --
    measured where missing (a cache written before they were); True if any were."""
    added = False
    if not r.attention_by_seq and r.attention_flops:   # (the step chains' count prices it: measured first)
        with _OneThread():
            r.attention_by_seq, r.attention_backward_by_seq = measure_attention_rows(sizes)
        r.step_team = {}   # (a cache's, counted without it: measured again below)
        added = True
    if not (r.team_matmul_flops and r.elementwise_rate and r.softmax_rate and r.compute_beside_disk
            and r.memory_speedup):
        r.team_matmul_flops, r.compute_beside_disk = measure_team_beside_disk(root, sizes)
        team_copy = measure_copies(torch.device("cpu"), sizes.copy_bytes, sizes)["h2d_pageable"]
        with _OneThread():   # (one thread's, as the matmul's: the team's measured speed-ups scale them)
            r.elementwise_rate, r.softmax_rate = measure_elementwise(sizes), measure_softmax(sizes)
            r.memory_speedup = team_copy / measure_copies(torch.device("cpu"), sizes.copy_bytes, sizes)["h2d_pageable"]
        added = True
    if not r.step_team and r.matmul_flops and r.elementwise_rate:   # (a cache written before it: added)
        r.step_team = measure_step_team(r, sizes)
        added = True
    return added


def _add_model(r: MachineRates, dev: torch.device, sizes: Sizes, shapes: Optional[ModelShapes]) -> bool:
    """Measure a model's shapes and head size the rates lack; True if any were."""
    if shapes is None:
        return False
    missing = [s for s in shapes.matmuls if shape_key(*s) not in r.matmul_by_shape]
    head = str(shapes.head_dim)
    with _compute_threads(dev, r):
        for m, k, n in missing:
            r.matmul_by_shape[shape_key(m, k, n)] = measure_matmul(dev, m, k, n, sizes)
        if head not in r.attention_by_head:
            r.attention_by_head[head] = measure_attention(dev, shapes.head_dim, sizes)
            return True
    return bool(missing)


def _compute_threads(dev: torch.device, r: MachineRates):
    """A CPU device's compute rates are one thread's (``MachineRates.compute_threads`` = 1; the
    prediction scales them to the threads a step's compute gets, ``compute_team``): measured
    with one torch thread, they are steady where a whole team's collapse as soon as another
    thread takes a core. A GPU's: as they are."""
    if dev.type == "cuda":
        return contextlib.nullcontext()
    r.compute_threads = 1
    return _OneThread()


def measure_machine(device=None, offload_dir=None, refresh: bool = False, model=None, *, tokens: int = 2048,
                    quick: bool = False) -> MachineRates:
    """This machine's rates (:class:`~megatrain_nb.engine.planning.rates.MachineRates`), cached.

    device: "cpu", "cuda", "cuda:1" or None (CUDA if there is one). offload_dir: the folder whose
    filesystem the disk tier would use (default: the temporary folder). refresh: measure again
    even if cached. model: a preset name, model folder, config.json, config or model whose
    matmul shapes (at ``tokens`` tokens), head size and layer size are measured too. quick: tiny
    sizes, cached apart (tests). Takes 10-20 s the first time; ``print(rates)`` shows the table.
    """

    dev, name = _device(device)
    root = check("offload_dir", offload_dir, "measure_machine: offload_dir") or tempfile.gettempdir()
    try:   # made when missing, as the engine's disk tier makes it
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise ValueError(f"measure_machine: offload_dir {root!r} cannot be made ({e}); pass the folder the disk "
                         "tier will use") from None
    fs = filesystem_of(root)
    sizes = sizes_for(dev.type == "cuda", quick)
    shapes = model_shapes(model, tokens) if model is not None else None
    path = os.path.join(cache_dir(), cache_key(name, fs, quick) + ".json")
    rates = None if refresh else load_cached(path)
    if rates is None:
        rates = _measure_all(dev, name, root, filesystem_text(fs), sizes, shapes)
    elif not (_add_model(rates, dev, sizes, shapes) | (dev.type != "cuda" and _add_team(rates, root, sizes))
              | _add_disk_files(rates, root, sizes)):
        return rates
    contradicted = retake_contradicted(rates, dev, sizes) if sizes.budget_s else []   # (tiny sizes time overheads)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    bad = check_finite(rates)
    if bad:   # (a measurement gone wrong is used once, never cached for every later run)
        warnings.warn(f"measure_machine: rates measured out of range, not cached: {'; '.join(bad)}", stacklevel=2)
        return rates
    if contradicted:
        warnings.warn("measure_machine: a rate measured far below what another reading says it must reach, "
                      f"taken {RETAKES + 1} times (the machine was busy while it measured?), not cached: "
                      f"{'; '.join(contradicted)}; measure again when the machine is as quiet as the run "
                      "will be", stacklevel=2)
        return rates
    try:
        save_cached(path, rates)
    except OSError as e:
        warnings.warn(f"measure_machine: the rates could not be cached at {path} ({e}); they are used for this "
                      "call only", stacklevel=2)
    return rates


def check_finite(rates: MachineRates) -> List[str]:
    """What is wrong with measured ``rates`` (``rates.check_rates``: each "field=value (what it must
    be)"): a measurement gone wrong; [] when every rate is a positive, finite, plausible number."""
    return check_rates(rates.to_dict())

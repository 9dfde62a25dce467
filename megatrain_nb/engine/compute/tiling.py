"""Sequence tiling inside a layer: the per-token parts of a layer (its MLP, dense or
mixture-of-experts) run over the sequence a tile of tokens at a time.

Why: a layer's working set is otherwise sized by the whole sequence at the MLP's width (four or
more intermediate-sized tensors per token, and their gradients); tiled, the MLP's intermediates
exist for one tile at a time and the sequence only costs hidden-sized vectors per token.

How (in the spirit of ALST's TiledMLP, arXiv 2506.13996): without gradients the module simply
runs tile by tile. With gradients, :class:`_Tiled` (a custom autograd Function) keeps only the
module's input and its parameters; its backward recomputes each tile from its slice of the input
with gradients and sums the parameter gradients over the tiles. The layer's call is the model's
own (the engine runs the real layer); only the tileable module's ``forward`` is swapped, for the
duration of one layer call (:meth:`LayerTiling.active`).

When: only where a layer does not fit (issue 45). Tiles cost a recompute of the MLP per tile and
a full-size weight gradient per tile, so an automatic tile (no ``tile_tokens`` given) is used only
when the call's untiled MLP intermediates would take more than a quarter of the device budget
(``max_vram_gb``; on CUDA without one, the device's memory: :func:`needs_tiles`). On a CPU device
without a budget the device is the host's RAM, shared with everything else: there a call longer
than a tile is tiled as before. ``EngineOverrides.tile_tokens`` pins the tile (0: never).

Where the tiles' weight gradients go: straight into the unit's fp32 gradient sum where the bound
parameters' ``.grad`` already is that sum's view (fp32 compute: ``GradSums.grads_into``), a tile at a
time; otherwise (bf16 compute) summed in fp32 over the tiles and rounded to the compute dtype
once, as the untiled matmul's own gradient is.

Which modules: a layer's direct children that the model names as its feed-forward part
(``mlp``, ``feed_forward``, ``block_sparse_moe``, ...; :func:`candidates`). Each is then checked
before its first tiled call, with its real weights: called on a few tokens whole and in two
halves, the outputs must agree (a module whose output for a token depends on other tokens —
capacity-limited expert routing, a sequence-wide statistic — fails this and stays untiled, with
the reason kept in :meth:`LayerTiling.report`). Modules that draw random numbers while training
(dropout, router jitter), that carry forward hooks, or whose routers' logits the model collects for
a sequence-wide auxiliary loss (``output_router_logits``) are not tiled either: a tile's draws,
hook calls or logits would not be the whole sequence's.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["LayerTiling", "auto_tile_tokens", "candidates", "needs_tiles", "tile_tokens_for"]

#: Attribute names models give their per-token feed-forward part.
_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "moe", "ffn", "mlp_block", "ff", "feedforward")
#: How the class names of such parts end (lower case; a family prefix such as "Afmoe" is no hint).
_CLASS_ENDS = ("mlp", "moe", "moeblock", "sparsemoeblock", "moelayer", "feedforward", "ffn", "experts")
_TARGET_BYTES = 64 << 20   # a tile's MLP intermediates with no device budget given
#: An automatic tile is used when a call's untiled MLP intermediates exceed this share of the budget.
FIT_SHARE = 0.25
_MIN_TILE = 64
_MMAP_THRESHOLD = 1 << 20   # host allocations from 1 MiB up get their own mapping (returned when freed)
_allocator_note: Optional[str] = None


def steady_host_allocator() -> Optional[str]:
    """On glibc, pin malloc's mmap threshold at 1 MiB (once per process; not where the user set
    ``MALLOC_MMAP_THRESHOLD_``). Why: glibc raises the threshold to the size of each large block
    freed (up to 32 MiB), so after a tile's intermediates are freed the sequence-sized tensors
    of the next layers come from the heap, which fragments and does not shrink: measured, a
    step's peak RSS then grew by 16 KiB per token where the live tensors grew by 3.5. Applied
    when a CPU device first runs a sequence longer than a tile (the device is the host's RAM).

    Still needed (re-measured 2026-12-07, bench_long_context's child: Llama hidden 64, intermediate
    4096, 2 layers, one sequence on a CPU device, 3 steps, load ~10), pinned against not pinned:
    peak RSS 614 vs 857 MiB at 8,192 tokens and 647 vs 951 MiB at 16,384, i.e. 4.1 vs 11.8 KiB
    per token (bench_long_context's target is <= 6). Its price: the large temporaries are fresh
    mappings, zeroed page by page (minor faults 3.6 M vs 0.7 M at 8,192 tokens, 7.1 M vs 1.1 M at
    16,384; the step's CPU time 8.0 vs 5.4 s and 20.6 vs 14.3 s). Only a CPU device running
    sequences longer than a tile pays it; a CUDA device's host side never calls this."""
    global _allocator_note
    if _allocator_note is None:
        _allocator_note = ""
        if sys.platform.startswith("linux") and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            try:
                libc = ctypes.CDLL("libc.so.6")
                if libc.mallopt(-3, _MMAP_THRESHOLD) == 1:   # M_MMAP_THRESHOLD
                    _allocator_note = f"glibc mmap threshold pinned at {_MMAP_THRESHOLD >> 20} MiB"
            except (OSError, AttributeError):
                pass
    return _allocator_note or None


def candidates(layer: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The layer's direct children that the model names as its per-token feed-forward part."""
    out = []
    for name, mod in layer.named_children():
        cls = type(mod).__name__.lower()
        if name in _NAMES or cls.endswith(_CLASS_ENDS):
            if not isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and "attn" not in name and "norm" not in cls:
                out.append((name, mod))
    return out


def _width(config) -> int:
    """Per-token intermediate width of a layer's MLP, from the model's config (the widest layer's
    where it is a list per layer, as Gemma 3n's; 4 x hidden where the config does not say)."""
    cfg = getattr(config, "get_text_config", lambda: config)()
    hidden = _int(getattr(cfg, "hidden_size", 0)) or _int(getattr(cfg, "n_embd", 0)) or 1
    dense = _int(getattr(cfg, "intermediate_size", 0)) or _int(getattr(cfg, "n_inner", 0)) or 4 * hidden
    moe = _int(getattr(cfg, "moe_intermediate_size", 0)) * (_int(getattr(cfg, "num_experts_per_tok", 1)) or 1)
    return max(dense, moe + _int(getattr(cfg, "shared_expert_intermediate_size", 0)))


def _int(v) -> int:
    """A config number as an int: the largest of a per-layer list; 0 for anything else."""
    if isinstance(v, (list, tuple)):
        return max((_int(x) for x in v), default=0)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def auto_tile_tokens(config, elem_bytes: int, budget_bytes: Optional[int] = None) -> int:
    """Tokens per tile so that a tile's MLP intermediates (about four intermediate-sized vectors
    per token: gate, up, their product, its gradient) take a fixed share of the device: 64 MiB,
    or a 32nd of the device budget (between 8 and 256 MiB) when one is set. Whole multiples of 64."""
    return tile_for(_width(config), elem_bytes, budget_bytes)


def tile_for(width: int, elem_bytes: int, budget_bytes: Optional[int] = None, pinned: Optional[int] = None) -> int:
    """:func:`auto_tile_tokens` from the MLP's per-token ``width`` (the planner's view); ``pinned``
    (``EngineOverrides.tile_tokens``) when given, 0 meaning no tiling."""
    if pinned is not None:
        return pinned
    target = _TARGET_BYTES if budget_bytes is None else min(256 << 20, max(8 << 20, budget_bytes // 32))
    tokens = target // max(1, 4 * int(width) * elem_bytes)
    return max(_MIN_TILE, tokens // _MIN_TILE * _MIN_TILE)


def needs_tiles(width: int, tokens: int, elem_bytes: int, budget_bytes: Optional[int]) -> bool:
    """Whether a layer call over ``tokens`` must run its MLP in tiles: its untiled intermediates
    (about four ``width``-sized vectors per token) exceed :data:`FIT_SHARE` of ``budget_bytes``
    (None: no budget known, the CPU's rule -- tile past one tile's tokens)."""
    if budget_bytes is None:
        return True
    return 4 * int(width) * int(tokens) * int(elem_bytes) > FIT_SHARE * budget_bytes


def tile_tokens_for(width: int, tokens: int, elem_bytes: int, budget_bytes: Optional[int] = None,
                    pinned: Optional[int] = None) -> int:
    """Tokens per tile of a call over ``tokens`` (the planner's view of :class:`LayerTiling`):
    ``pinned`` when given; else 0 (untiled) where the layer fits (:func:`needs_tiles`), else
    :func:`tile_for`."""
    if pinned is not None:
        return pinned
    if not needs_tiles(width, tokens, elem_bytes, budget_bytes):
        return 0
    return tile_for(width, elem_bytes, budget_bytes)


def _cuda_memory() -> Optional[int]:
    """The current CUDA device's memory in bytes (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def _sink(orig: torch.Tensor) -> Optional[torch.Tensor]:
    """The fp32 gradient sum a bound parameter's ``.grad`` already is (``GradSums.grads_into``),
    where a tile's gradient may be added straight in; None otherwise (or with hooks to run)."""
    g = getattr(orig, "grad", None)
    if g is None or g.dtype != torch.float32 or g.shape != orig.shape or orig._backward_hooks:
        return None
    return g


class _Tiled(torch.autograd.Function):
    """``run`` (the module's own forward) over the tokens of ``x`` in tiles; keeps only ``x``
    and the parameters; the backward recomputes each tile with gradients."""

    @staticmethod
    def forward(ctx, run, rebind, tile, x, *params):
        ctx.run, ctx.rebind, ctx.tile = run, rebind, tile
        ctx.originals = params   # (their .grad, when it is the unit's fp32 sum: tiles added straight in)
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            return _loop(run, x, tile)

    @staticmethod
    def backward(ctx, g):
        x, *params = ctx.saved_tensors
        # fresh leaves (views): the tiles' gradients reach the real parameters through this
        # Function's outputs, where their own hooks (a frozen weight's zero gradient) apply
        params = [p.detach().requires_grad_(p.requires_grad) for p in params]
        want = [p for p in params if p.requires_grad]
        sinks = [_sink(o) for o, p in zip(ctx.originals, params) if p.requires_grad]
        gp = [None] * len(want)
        gx = x.new_empty(x.shape) if ctx.needs_input_grad[3] else None
        flat_x, flat_g = _tokens(x), _tokens(g)
        with ctx.rebind(params), torch.enable_grad():
            for s in range(0, flat_x.shape[0], ctx.tile):
                xt = flat_x[s:s + ctx.tile].detach().requires_grad_(gx is not None)
                yt = ctx.run(_shaped(xt, x))
                ins = ([xt] if gx is not None else []) + want
                got = torch.autograd.grad(yt, ins, _shaped(flat_g[s:s + ctx.tile], g), allow_unused=True)
                if gx is not None:
                    _tokens(gx)[s:s + ctx.tile] = got[0] if got[0] is not None else 0
                    got = got[1:]
                for i, t in enumerate(got):   # summed in fp32 (bf16 partial sums would lose bits)
                    if t is None:
                        continue
                    if sinks[i] is not None:   # straight into the unit's fp32 gradient sum
                        sinks[i].add_(t)
                    else:
                        gp[i] = t.float() if gp[i] is None else gp[i].add_(t)
                del xt, yt, got
        gp = [g if g is None else g.to(p.dtype) for g, p in zip(gp, want)]
        it = iter(zip(gp, sinks))   # (a parameter no tile used gets zeros: hooks on it do not take None)
        grads = [next(it) if p.requires_grad else (None, None) for p in params]
        grads = [None if sink is not None else torch.zeros_like(p) if g is None and p.requires_grad else g
                 for (g, sink), p in zip(grads, params)]
        return (None, None, None, gx, *grads)


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [tokens, features] (a view)."""
    return t.reshape(-1, t.shape[-1])


def _shaped(tile: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A [t, features] tile shaped as the module takes it: [1, t, features] for a batched input."""
    return tile.unsqueeze(0) if like.dim() == 3 else tile


def _loop(run, x: torch.Tensor, tile: int) -> torch.Tensor:
    """The output filled tile by tile (a tensor of its own, not a view: a model may add into
    it in place, as Falcon's layer does)."""
    flat, out = _tokens(x), None
    for s in range(0, flat.shape[0], tile):
        y = _tokens(run(_shaped(flat[s:s + tile], x)))
        if out is None:
            out = y.new_empty(*x.shape[:-1], y.shape[-1])
        _tokens(out)[s:s + tile] = y
        del y
    return out


def _random_reason(mod: nn.Module) -> Optional[str]:
    for m in mod.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return f"draws dropout masks while training (p={m.p}); a tile's draws would differ from the sequence's"
        rates = [(k, v) for k, v in vars(m).items() if "drop" in k and isinstance(v, float) and v > 0]
        if rates:   # a rate kept as a number, for F.dropout in the forward
            return f"draws dropout masks while training ({rates[0][0]}={rates[0][1]}); a tile's draws would differ"
        jitter = getattr(m, "jitter_noise", 0) or getattr(m, "router_jitter_noise", 0)
        if isinstance(jitter, (int, float)) and jitter > 0:
            return f"draws router jitter noise while training ({jitter}); a tile's draws would differ"
    return None


class LayerTiling:
    """The tileable modules of each decoder layer and the tile size. ``tile_tokens``: pinned
    tokens per tile (0: never tile; None: :func:`auto_tile_tokens`)."""

    def __init__(self, model: nn.Module, layers: List[nn.Module], *, tile_tokens: Optional[int],
                 elem_bytes: int = 4, budget_bytes: Optional[int] = None, host_device: bool = False):
        self.host_device = host_device   # the device is the CPU: its working set is the process's RSS
        self.config = getattr(model, "config", None)
        if budget_bytes is None and not host_device:
            budget_bytes = _cuda_memory()   # a GPU without a budget: its memory
        #: what an automatic tile must fit (None: a CPU device without a budget, see the module doc)
        self.budget = budget_bytes
        self.elem_bytes = elem_bytes
        self.tile = tile_tokens if tile_tokens is not None else auto_tile_tokens(self.config, elem_bytes, budget_bytes)
        self.pinned = tile_tokens is not None
        self._mods: Dict[int, List[Tuple[str, nn.Module]]] = {id(layer): candidates(layer) for layer in layers}
        self._verdict: Dict[int, Optional[str]] = {}   # id(module) -> None (tiles) or why not
        self._skipped: Dict[int, str] = {}   # id(module) -> why its last call was not tiled (training, hooks)
        self._names: Dict[int, str] = {}
        for layer in layers:
            for name, mod in self._mods[id(layer)]:
                self._names[id(mod)] = f"{type(layer).__name__}.{name} ({type(mod).__name__})"
        self.tiled_calls = 0

    def report(self) -> dict:
        """{"tile_tokens", "tiled": [module], "untiled": {module: reason}} over the modules seen."""
        tiled = sorted({self._names[i] for i, r in self._verdict.items() if r is None})
        untiled = {self._names[i]: r for i, r in {**self._skipped, **self._verdict}.items() if r is not None}
        if not any(self._mods.values()):
            untiled["(layers)"] = "no child module named as the layer's MLP (mlp, feed_forward, ...); nothing tiled"
        out = {"tile_tokens": self.tile, "tiled": tiled, "untiled": untiled}
        if self.host_device and _allocator_note:
            out["host_allocator"] = _allocator_note
        return out

    @contextlib.contextmanager
    def active(self, layer: nn.Module, hidden):
        """While one call of ``layer`` runs on ``hidden``: its tileable modules run in tiles when
        the call's tokens exceed a tile."""
        mods = self._mods.get(id(layer))
        if not mods or not self.tile or not torch.is_tensor(hidden) or hidden[..., 0].numel() <= self.tile \
                or not (self.pinned or self.fits_not(hidden[..., 0].numel())):
            yield
            return
        if self.host_device:
            steady_host_allocator()
        swapped = []
        try:
            for _, mod in mods:
                reason = self._static_reason(mod)
                if reason is None:
                    own = mod.__dict__.get("forward")
                    mod.forward = self._tiled_forward(mod, own or type(mod).forward.__get__(mod))
                    swapped.append((mod, own))
                else:
                    self._skipped[id(mod)] = reason
            yield
        finally:
            for mod, own in swapped:
                if own is None:
                    mod.__dict__.pop("forward", None)
                else:
                    mod.forward = own

    def fits_not(self, tokens: int) -> bool:
        """Whether a call over ``tokens`` does not fit untiled (:func:`needs_tiles`)."""
        return needs_tiles(_width(self.config), tokens, self.elem_bytes, self.budget)

    def _static_reason(self, mod: nn.Module) -> Optional[str]:
        if getattr(self.config, "output_router_logits", False):
            return "the model collects router logits for a sequence-wide auxiliary loss (output_router_logits)"
        if mod.training and _random_reason(mod):
            return _random_reason(mod)
        hooked = [n or "(itself)" for n, m in mod.named_modules() if m._forward_hooks or m._forward_pre_hooks]
        if hooked:
            return f"has forward hooks on {hooked[:3]}, which would see tiles instead of the sequence"
        return None

    def _tiled_forward(self, mod: nn.Module, run):
        def forward(*args, **kwargs):
            x = _only_tensor(args, kwargs)
            if x is None:
                self._verdict.setdefault(id(mod), "called with more than a hidden-state tensor")
                return run(*args, **kwargs)
            if id(mod) not in self._verdict:
                self._check(mod, run, x)
            if self._verdict[id(mod)] is not None:
                return run(x)
            self.tiled_calls += 1
            params = [p for m in mod.modules() for p in m._parameters.values() if p is not None]
            if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
                return _Tiled.apply(run, _rebinder(mod), self.tile, x, *params)
            return _loop(run, x, self.tile)
        return forward

    def _check(self, mod: nn.Module, run, x: torch.Tensor) -> None:
        """Whether ``mod`` acts on each token on its own, measured with its real weights: a few
        tokens run whole and in two halves give the same outputs."""
        flat = _tokens(x.detach())
        n = min(8, flat.shape[0]) // 2 * 2
        with torch.no_grad():
            try:
                probe = run(_shaped(flat[:n], x))
                if not torch.is_tensor(probe):
                    self._verdict[id(mod)] = f"returns a {type(probe).__name__} (not one tensor); runs untiled"
                    return
                whole = _tokens(probe)
                halves = torch.cat([_tokens(run(_shaped(flat[s:s + n // 2], x))) for s in (0, n // 2)])
            except Exception as e:   # noqa: BLE001 - a module that cannot take a tile is not tiled
                self._verdict[id(mod)] = f"cannot run on a tile of tokens ({type(e).__name__}: {e})"
                return
        if whole.shape != halves.shape:
            self._verdict[id(mod)] = f"its output's shape depends on the tokens it gets ({tuple(whole.shape)})"
            return
        tol = 2e-2 if x.dtype in (torch.bfloat16, torch.float16) else 1e-4
        scale = float(whole.abs().max()) + 1e-12
        if float((whole - halves).abs().max()) > tol * scale:
            self._verdict[id(mod)] = "the output for a token depends on other tokens (measured: whole vs halves differ)"
        else:
            self._verdict[id(mod)] = None


def _only_tensor(args, kwargs) -> Optional[torch.Tensor]:
    """The call's one argument when it is a float [tokens, features] or [batch, seq, features]
    tensor (positional or ``hidden_states=``); None for any other call."""
    if len(args) + len(kwargs) != 1:
        return None
    x = args[0] if args else kwargs.get("hidden_states")
    return x if torch.is_tensor(x) and x.dim() in (2, 3) and x.is_floating_point() else None


def _rebinder(mod: nn.Module):
    """A context manager factory: the module's parameters bound to ``params`` (the tensors the
    forward ran with) while a backward recomputes; the bindings of the time put back after
    (a layer whose graph is kept, checkpoint_interval=0, is unbound before its backward)."""
    slots = [(m, k) for m in mod.modules() for k, p in m._parameters.items() if p is not None]

    @contextlib.contextmanager
    def rebind(params):
        old = [m._parameters[k] for m, k in slots]
        for (m, k), p in zip(slots, params):
            m._parameters[k] = p
        try:
            yield
        finally:
            for (m, k), p in zip(slots, old):
                m._parameters[k] = p
    return rebind

"""A VLM's vision tower streamed by blocks (the ``streamed`` placement of
``planning/vision_plan.place_vision``): the tower's blocks' weights are not in the ``embed``
unit's device copy; each block's compute-dtype weights come to a device slot just before the block
runs -- in the capture, and again for its re-run in the embedding's backward (the tower runs by
blocks there: ``vision.ImageFeatures`` ``by_blocks``, each block under non-reentrant activation
checkpointing) -- through a pager of two block slots (the next block's copy in flight while one
computes), on the engine's transport, its loads counted as the decoder layers' are
(``Telemetry.loads_per_unit``, by the block's name).

The host side does not change: the tower's blocks stay parameters of the ``embed`` unit (its fp32
master weights, its AdamW states, its one gradient a window). The device side sees the embed unit
without the blocks (:attr:`TowerStream.trunk`, a unit of its own layout, bound and summed as the
embed unit is in the "blocks" placement) and one unit per block (:attr:`TowerStream.blocks`). A
block's weight gradients of a micro-batch, final once its backward is done (when the block below it
is re-run, or the micro-batch's backward returned), go to the host through the pager and are added
there into the embed unit's gradient of the window, in the same order of fp32 adds as the device's
sum of the "blocks" placement (so the result is bit-identical); the trunk's sum, arriving last,
completes it and the whole goes to the update as the embed unit's gradient.

Forcing a placement: ``MEGATRAIN_NB_VISION_PLACEMENT`` = resident | blocks | streamed (the
tests; otherwise the planner picks).
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..proxies import bind, unbind
from ..transport.pager import Pager
from ..units import Unit
from ..updates.grad_sums import GradSums

PLACEMENT_ENV = "MEGATRAIN_NB_VISION_PLACEMENT"
PLACEMENTS = ("resident", "blocks", "streamed")
_Span = Tuple[int, int, int]   # (offset in the embed unit, offset in the part, elements)


def forced_placement() -> Optional[str]:
    """The placement ``MEGATRAIN_NB_VISION_PLACEMENT`` forces (None: the planner's)."""
    got = os.environ.get(PLACEMENT_ENV, "").strip()
    if not got:
        return None
    if got not in PLACEMENTS:
        raise ValueError(f"{PLACEMENT_ENV}={got!r}: give one of {', '.join(PLACEMENTS)} (or unset it: the planner "
                         "picks).")
    return got


def _part(embed: Unit, entries, name: str, kind: str, index: int) -> Tuple[Unit, List[_Span], List[int]]:
    """A unit of some of ``embed``'s parameters (``entries``, in the embed unit's order: decayed,
    the others, the frozen last), laid out compactly; (the unit, the spans of its trainable
    elements in the embed unit's gradient, each entry's index among ``embed.params``)."""
    params, spans, where, off = [], [], [], 0
    position = {id(e): i for i, e in enumerate(embed.params)}
    for e in entries:
        params.append(replace(e, offset=off))
        where.append(position[id(e)])
        if not e.frozen and e.numel:
            spans.append((e.offset, off, e.numel))
        off += e.numel
    trainable = sum(e.numel for e in entries if not e.frozen)
    unit = Unit(name, kind, index, params, off, sum(e.numel for e in entries if e.decay),
                train=trainable if trainable != off else None)
    return unit, _merged(spans), where


def _merged(spans: List[_Span]) -> List[_Span]:
    out: List[_Span] = []
    for s in spans:
        if out and out[-1][0] + out[-1][2] == s[0] and out[-1][1] + out[-1][2] == s[1]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + s[2])
        else:
            out.append(s)
    return out


def split_embed(embed: Unit, blocks: Sequence[nn.Module], names: Sequence[str], first_index: int):
    """(the trunk: ``embed`` without the blocks' parameters, [(a block's unit, its spans, its
    entries' indices)]); a parameter bound outside its block (shared) stays in the trunk."""
    mods = [{id(m) for m in b.modules()} for b in blocks]
    owner: Dict[int, int] = {}
    for e in embed.params:
        homes = [next((i for i, ids in enumerate(mods) if id(m) in ids), None) for m, _ in e.bindings]
        if homes and homes[0] is not None and all(h == homes[0] for h in homes):
            owner[id(e)] = homes[0]
    trunk = _part(embed, [e for e in embed.params if id(e) not in owner], embed.name, embed.kind, embed.index)
    parts = [_part(embed, [e for e in embed.params if owner.get(id(e)) == i], names[i], "layer", first_index + i)
             for i in range(len(blocks))]
    return trunk, parts


class TowerStream:
    """The tower's blocks streamed through a pager of two slots (module docstring). Built by
    ``parts.build_parts`` before the step runner (its block wrappers go under
    ``ImageFeatures``' checkpointing); the engine's pager sees :attr:`trunk` for the embed unit,
    through :meth:`source`, :meth:`source_done`, :meth:`grad_sink`, :meth:`reached` and
    :meth:`plan_reads`, which hand the real embed unit to the host side."""

    def __init__(self, embed: Unit, blocks: Sequence[nn.Module], names: Sequence[str], *, placeholders,
                 transport, device: torch.device, dtype: torch.dtype, telemetry, source: Callable,
                 source_done: Callable, grad_sink: Callable, reached: Optional[Callable], depth: int = 1,
                 first_index: int = 1 << 20):
        self.embed, self.device = embed, device
        (self.trunk, self._trunk_spans, self._trunk_where), parts = split_embed(embed, blocks, names, first_index)
        self.blocks = [p[0] for p in parts]
        self._spans = [p[1] for p in parts]
        self._where = [p[2] for p in parts]
        self._placeholders = placeholders
        self._source, self._source_done, self._sink, self._reached = source, source_done, grad_sink, reached
        self.pager = Pager(self.blocks, device=device, dtype=dtype, layer_slots=2, source=self._gather,
                           source_done=lambda unit, t: None, telemetry=telemetry, grad_sink=self._block_arrived,
                           transport=transport, max_grads_in_flight=depth)
        self._slots = self.pager.pools.get("layer", [])
        #: device bytes of one block slot; the most slots held at once (loaded or in flight)
        self.slot_bytes = self._slots[0].buf.numel() * self._slots[0].buf.element_size() if self._slots else 0
        self.peak_slots = 0
        self.grads_returned = 0          # block gradients sent to the host
        self._lock = threading.Lock()
        self._full: Optional[torch.Tensor] = None   # the window's embed gradient on the host, tower part
        self._runs: deque = deque()      # per tower run with weights that train: {block: bound tensors}
        self._run: Optional[dict] = None
        self._last_back: Optional[int] = None   # the block last re-run in this backward, not yet sent
        self._touched = False            # this micro-batch's backward re-ran a block
        self._back = False               # in a micro-batch's embedding backward (:meth:`backward`)
        for i, block in enumerate(blocks):
            block.forward = self._wrap(i, block.forward)   # (the instance's; ImageFeatures wraps this)

    # ------------------------------------------------------------------ the engine's side
    def source(self, unit: Unit) -> torch.Tensor:
        return self._gather(unit) if unit is self.trunk else self._source(unit)

    def source_done(self, unit: Unit, t: torch.Tensor) -> None:
        if unit is not self.trunk:
            self._source_done(unit, t)

    def plan_reads(self, plan_reads: Callable) -> Callable:
        """``plan_reads`` seeing the embed unit where the compute order has the trunk."""
        return lambda order, step: plan_reads([self.embed if u is self.trunk else u for u in order], step)

    def reached(self, unit: Unit, indices) -> None:
        if self._reached is None:
            return
        if unit is self.trunk:
            self._reached(self.embed, [self._trunk_where[i] for i in indices])
        else:
            self._reached(unit, indices)

    def grad_sink(self, unit: Unit, grad: torch.Tensor):
        """The trunk's sum (the window's last of the embed unit) completes the embed gradient, which
        goes to the update whole; any other unit's goes on as it is."""
        if unit is not self.trunk:
            return self._sink(unit, grad)
        with self._lock:   # (the blocks' landed before it was sent: :meth:`backward`)
            full, self._full = self._full, None
        if full is None:
            full = torch.zeros(self.embed.train_numel, dtype=torch.float32)
        flat = grad if torch.is_tensor(grad) else torch.cat([g.reshape(-1).float() for g in grad])
        for dst, src, n in self._trunk_spans:
            full[dst:dst + n].copy_(flat[src:src + n])
        return self._sink(self.embed, full)

    def _block_arrived(self, unit: Unit, grad: torch.Tensor) -> None:
        """A block's gradient of one micro-batch on the host: added into the embed unit's."""
        spans = self._spans[unit.index - self.blocks[0].index]
        with self._lock:
            if self._full is None:
                self._full = torch.zeros(self.embed.train_numel, dtype=torch.float32)
            for dst, src, n in spans:
                self._full[dst:dst + n].add_(grad[src:src + n])

    def _gather(self, unit: Unit) -> torch.Tensor:
        """A part's weights out of the embed unit's host copy (in its dtype: fp32, or the shadow)."""
        whole = self._source(self.embed)
        try:
            out = torch.empty(unit.numel, dtype=whole.dtype)
            for e, own in zip((self.embed.params[i] for i in self._where_of(unit)), unit.params):
                out[own.offset:own.offset + own.numel].copy_(whole[e.offset:e.offset + e.numel])
        finally:
            self._source_done(self.embed, whole)
        return out

    def _where_of(self, unit: Unit) -> List[int]:
        return self._trunk_where if unit is self.trunk else self._where[unit.index - self.blocks[0].index]

    # ------------------------------------------------------------------ a block's run
    def _wrap(self, i: int, forward):
        def run(*args, **kwargs):
            back = self._back   # a re-run inside the embedding's backward (checkpointing)
            unit = self.blocks[i]
            w = self._acquire(i, back)
            grad = torch.is_grad_enabled()
            bound = bind(unit, w, requires_grad=grad)
            try:
                return forward(*args, **kwargs)
            finally:
                unbind(unit, self._placeholders)
                if grad and not back and any(t.requires_grad for t in bound):
                    if i == 0 or self._run is None:
                        self._run = {}
                        self._runs.append(self._run)
                    self._run[i] = bound
                if not back and i == len(self.blocks) - 1:   # the tower's forward is done
                    self._run = None
                    self.release_all()
        return run

    def _acquire(self, i: int, back: bool) -> torch.Tensor:
        """Block ``i``'s weights on the device; every other block's slot handed back (the block re-run
        before it in a backward: its backward is done, its gradient sent), the next block's load
        started (``back``: the block below, the backward's order)."""
        unit = self.blocks[i]
        if back:
            self._touched = True
            if self._last_back is not None and self._last_back != i:
                self._send(self._last_back)
            self._last_back = i
        for s in self._slots:
            if s.unit is not None and s.unit is not unit:
                self.pager.release(s.unit)
        w = self.pager.acquire(unit)
        nxt = i - 1 if back else i + 1
        if 0 <= nxt < len(self.blocks):
            self.pager.set_schedule([self.blocks[nxt]])
        self.peak_slots = max(self.peak_slots, sum(1 for s in self._slots if s.busy))
        return w

    def _send(self, i: int) -> None:
        """Block ``i``'s weight gradients of the micro-batch in its backward, to the host."""
        run = self._runs[0] if self._runs else None
        bound = run.pop(i, None) if run is not None else None
        if bound is None:
            return
        unit = self.blocks[i]
        grads = [t.grad for t in bound]
        for t in bound:
            t.grad = None
        if self._reached is not None:
            self._reached(self.embed, [self._where[i][k] for k, g in enumerate(grads) if g is not None])
        if not any(g is not None and not e.frozen for g, e in zip(grads, unit.params)):
            return
        acc = torch.zeros(unit.train_numel, dtype=torch.float32, device=self.device)
        GradSums.add(acc, unit, grads)
        del grads
        self.pager.return_grads(unit, [acc])
        self.grads_returned += 1

    @contextlib.contextmanager
    def backward(self):
        """Around a micro-batch's embedding backward (the blocks re-run in it go in the backward's
        order); once it returned, the last block re-run sends its gradient, the micro-batch's run is
        done and the slots go back."""
        self._back = True
        try:
            yield
        finally:
            self._back = False
        if self._last_back is not None:
            self._send(self._last_back)
        self.pager.wait_grads()   # (landed in the embed unit's before the trunk's sum, the window's last, is sent)
        if self._touched and self._runs:
            self._runs.popleft()   # (a block the loss does not reach has no gradient to send)
        self._last_back, self._touched = None, False
        self.release_all()

    def release_all(self) -> None:
        for s in self._slots:
            if s.unit is not None:
                self.pager.release(s.unit)

    def reset(self) -> None:
        """After an error mid-step: nothing held, nothing pending."""
        self._runs.clear()
        self._run, self._last_back, self._touched, self._back = None, None, False, False
        self.pager.reset()
        with self._lock:
            self._full = None

    def close(self) -> None:
        self.reset()
        self.pager.close(transport=False)

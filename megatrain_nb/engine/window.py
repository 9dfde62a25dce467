"""Layer-major accumulation: a whole accumulation window (A micro-batches) through the model
with every unit resident once per pass.

Forward: each unit, once on the device, runs all A micro-batches; the layer-boundary
activations (the input of every k-th layer, per micro-batch) stay in a :class:`BoundaryStore`
(device, host or disk tier). Backward: the units in reverse, each resident once, recompute and
back-propagate every micro-batch; the unit's gradient is summed on the device (fp32) and leaves
once, final, so its update can start at once (the update scheduler's path). With
checkpoint interval 1 every layer crosses to the device twice per step, whatever A.

The model's own code still runs for everything outside the layers. The base model's forward
is run per micro-batch with the layer proxies switched into one of two modes
(``StepRunner.intercept``):

* *capture*: each proxy records how the model called its layer (masks per layer type, rotary
  embeddings, positions: everything but the hidden state) and passes the hidden state through
  untouched; layer 0's input is the embedding's output. Nothing of the layers runs.
* *replay*: the last layer's proxy returns that micro-batch's real final hidden state (a leaf
  that collects its gradient), so the model's own post-layer code (final norm) runs on it.

The real layers are then called by this module, unit outer, micro-batch inner, with each
micro-batch's captured arguments. The embedding's part is captured again at the end of the
backward (same RNG state) to back-propagate into the embedding weights, so no autograd graph
is held across the step.

Dropout: the RNG state at each (micro-batch, layer) call is recorded in the forward and
restored for the recompute, so the backward sees the forward's masks. The draws happen in
layer-major order, so with dropout and A > 1 the masks differ from those of the micro-batch-
major path (same distribution; with A = 1 they are the same).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import finite
from .planner import WindowPlan, engine_window_plan
from .proxies import bind, output_template, template_of, unbind
from .step import StepRunner, _Call, _first, _StepContext
from .units import Unit
from .updates import StepContext


class BoundaryStore:
    """Layer-boundary activations of a window, keyed (layer index, micro-batch), on one tier:

    * "device": kept as they are;
    * "host": copied out (pinned on CUDA, copies on the compute stream so their order with the
      kernels that produced them is the stream's);
    * "disk": copied out to a recycled host buffer and written behind through the engine's
      :class:`DiskStore`; the backward pops them in its order (layers descending, micro-batches
      ascending), so each pop starts the reads of the next ``READ_AHEAD`` keys, and a read key's
      file is deleted (the disk holds only what the backward has still to read). RAM holds only
      the writes and reads in flight.
    """

    READ_AHEAD = 4       # disk reads started ahead of the backward
    WRITES_IN_FLIGHT = 4  # disk writes behind the forward before it waits

    def __init__(self, device: torch.device, disk=None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.disk = disk
        self.tier = "device"
        self._t: Dict[Tuple[int, int], object] = {}
        # Host buffers recycled across steps (pinning is slow): a buffer's next use is a copy
        # on the same stream as its last read, so the stream orders them.
        self._free: Dict[tuple, List[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.bytes = {"device": 0, "host": 0, "disk": 0}
        self.peak = {"device": 0, "host": 0, "disk": 0}
        self.disk_ops = {"writes": 0, "reads": 0}   # of the last window
        self._writes: List[Future] = []
        self._order: Optional[List[Tuple[int, int]]] = None   # the backward's pop order (disk)
        self._reads: Dict[Tuple[int, int], Tuple[Future, torch.Tensor]] = {}

    def start(self, tier: str) -> None:
        if tier == "disk" and self.disk is None:
            raise ValueError("boundary activations on the disk tier need an offload_dir (the engine's disk tier)")
        self.clear()
        self.tier = tier
        self.peak = {"device": 0, "host": 0, "disk": 0}
        self.disk_ops = {"writes": 0, "reads": 0}

    def _buffer(self, shape, dtype) -> torch.Tensor:
        with self._lock:
            free = self._free.get((tuple(shape), dtype))
            if free:
                return free.pop()
        if self.tier == "disk":
            from .disk_store import aligned_empty   # page-aligned: direct I/O

            return aligned_empty(tuple(shape), dtype)
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def _recycle(self, t: torch.Tensor) -> None:
        with self._lock:   # also from the disk workers (a write's buffer, once written)
            self._free.setdefault((tuple(t.shape), t.dtype), []).append(t)

    @staticmethod
    def _key(key) -> str:
        return f"boundary-{key[0]:05d}-{key[1]:05d}"

    def put(self, key, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.tier == "host":
            h = self._buffer(t.shape, t.dtype)
            h.copy_(t, non_blocking=self.cuda)
            t = h
        elif self.tier == "disk":
            h = self._buffer(t.shape, t.dtype)
            h.copy_(t)   # synchronous: the write runs in another thread
            fut = self.disk.write(self._key(key), {"h": h})
            fut.add_done_callback(lambda _f, h=h: self._recycle(h))
            self._writes = [f for f in self._writes if not f.done()] + [fut]
            if len(self._writes) > self.WRITES_IN_FLIGHT:   # back-pressure: RAM holds a few writes
                futures_wait(self._writes[:-self.WRITES_IN_FLIGHT])
            self.disk_ops["writes"] += 1
            t = (tuple(t.shape), t.dtype, fut)
        self._t[key] = t
        self.bytes[self.tier] += n
        self.peak[self.tier] = max(self.peak[self.tier], self.bytes[self.tier])

    def _read(self, k, urgent: bool = False) -> None:
        shape, dtype, _ = self._t[k]
        buf = self._buffer(shape, dtype)
        self._reads[k] = (self.disk.read(self._key(k), {"h": buf}, urgent=urgent), buf)
        self.disk_ops["reads"] += 1

    def _read_ahead(self) -> None:
        """Keep READ_AHEAD reads going, in the backward's order."""
        if self._order is None:
            self._order, self._pos = sorted(self._t, key=lambda k: (-k[0], k[1])), 0
        while self._pos < len(self._order) and len(self._reads) < self.READ_AHEAD:
            k = self._order[self._pos]
            self._pos += 1
            if k in self._t and k not in self._reads:
                self._read(k)

    def pop(self, key) -> torch.Tensor:
        if self.tier == "disk":
            self._read_ahead()
            if key not in self._reads:   # out of the backward's order: read it now
                self._read(key, urgent=True)
            fut, buf = self._reads.pop(key)
            shape, dtype, _ = self._t.pop(key)
            fut.result()
            self.disk.delete(self._key(key))
            self.bytes["disk"] -= buf.numel() * buf.element_size()
            out = buf.to(self.device)   # synchronous: the buffer is recycled for the next read
            if out is buf:
                out = buf.clone()
            self._recycle(buf)
            self._read_ahead()
            return out
        t = self._t.pop(key)
        self.bytes[self.tier] -= t.numel() * t.element_size()
        if self.tier == "host":
            out = t.to(self.device, non_blocking=self.cuda)
            if self.cuda or out is not t:
                self._recycle(t)
            return out
        return t

    def free_bytes(self) -> int:
        """Recycled host buffers kept for the next window."""
        with self._lock:
            return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)

    def clear(self) -> None:
        """Drop the window's activations (after a window, or a failed one): disk operations in
        flight finish and the tier's files are removed."""
        if self.tier == "disk" and self.disk is not None:
            futures_wait(self._writes + [f for f, _ in self._reads.values()])
            for f, buf in self._reads.values():
                self._recycle(buf)
            for k in list(self._t):
                try:
                    self.disk.delete(self._key(k))
                except Exception:  # noqa: BLE001 - a failed write left no file
                    pass
        self._writes, self._reads, self._order = [], {}, None
        self._t.clear()
        self.bytes = {"device": 0, "host": 0, "disk": 0}


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class _NotRun:
    """Stands for a layer's outputs besides the hidden state in the capture and replay passes
    (the layers do not run there); a layer receiving one is refused."""

    def __repr__(self):
        return "<output of a layer that did not run>"


NOT_RUN = _NotRun()


class WindowRunner:
    """Runs an accumulation window layer-major on a :class:`StepRunner`'s model, units, pager
    and helpers (head logits, chunked loss, RNG, activation accounting)."""

    def __init__(self, runner: StepRunner, boundary: BoundaryStore,
                 grad_buffer: Optional[Callable[[int], torch.Tensor]] = None):
        self.r = runner
        self.boundary = boundary
        self.tuple_out = False     # whether the layers return a tuple (learned from real calls)
        self.out_template: Dict[int, tuple] = {}   # per layer: proxies.template_of its output
        # CPU "device": the units' gradient sums are taken from the update scheduler's pool
        # (UpdateScheduler.lend_buffer) and handed over whole: no fresh pages to fault in per
        # unit per step, no copy on arrival. None: fresh device tensors.
        self.grad_buffer = grad_buffer
        self.sum_bytes = 0         # fp32 gradient sums alive on the device now
        self.sum_peak = 0          # ... and their peak over the windows run
        self._straight = False     # this window's sums go straight to their updates (unclipped)

    # ------------------------------------------------------------------ helpers
    def _out(self, h, unit: Optional[Unit] = None, args=(), kwargs=None):
        """``h`` shaped as the layer returns its output: a bare tensor, or a tuple whose first
        item is the hidden state and whose others are None where the layer returns None and
        NOT_RUN where it returns something (learned from a real call or a fake-tensor probe)."""
        t = self.out_template.get(unit.layer_index) if unit is not None else None
        if t is None and unit is not None:
            t = output_template(unit, args, kwargs or {}, self.r.placeholders)
            if t is not None:
                self.out_template[unit.layer_index] = t
        if t is None and self.out_template:   # the probe failed: as the other layers
            t = next(iter(self.out_template.values()))
        if t is None:
            return (h,) if self.tuple_out else h
        is_tuple, extras = t
        return (h,) + tuple(NOT_RUN if x else None for x in extras) if is_tuple else h

    def _call_layer(self, unit: Unit, call: _Call, hidden):
        a, kw = call.with_hidden(hidden)
        out = unit.module(*a, **kw)
        self.tuple_out = isinstance(out, (tuple, list))
        self.out_template[unit.layer_index] = template_of(out)
        return _first(out)

    def _capture(self, ids, am, calls: Dict[int, _Call]) -> torch.Tensor:
        """The model's own forward up to the layers: each layer's call arguments into ``calls``;
        returns layer 0's input (with its autograd graph when grad mode is on)."""
        h0 = []

        def intercept(unit, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            for v in list(kwargs.values()) + list(args[1:]):
                if torch.is_tensor(v) and v.requires_grad:
                    raise NotImplementedError(
                        f"{type(unit.module).__name__} receives a tensor argument that needs gradients besides "
                        "the hidden states; this family is not supported by the streaming engine yet.")
            if any(v is NOT_RUN for v in list(kwargs.values()) + list(args[1:])):
                raise NotImplementedError(
                    f"{type(unit.module).__name__} receives another output of the layer before it besides the "
                    "hidden states; a layer-major window does not run the layers in the model's forward, so this "
                    "family is not supported there (train it one micro-batch at a time).")
            if unit.layer_index in calls:
                raise NotImplementedError(
                    f"{type(self.r.model).__name__} calls its layer {unit.layer_index} more than once in one "
                    "forward (a looped or shared layer); this family is not supported by the streaming engine yet.")
            if unit.layer_index == 0:
                h0.append(hidden)
            if args:   # the hidden state itself is not kept (with_hidden puts each one in)
                calls[unit.layer_index] = _Call((None,) + tuple(args[1:]), kwargs, True)
            else:
                calls[unit.layer_index] = _Call(args, {k: v for k, v in kwargs.items() if k != "hidden_states"},
                                                False)
            return self._out(hidden, unit, args, kwargs)

        self.r.intercept = intercept
        try:
            self.r._base_forward(ids, am)
        finally:
            self.r.intercept = None
        return h0[0]

    def _replay(self, ids, am, h_last: torch.Tensor) -> torch.Tensor:
        """The model's own post-layer code (final norm, ...) on ``h_last``: the base forward
        with the last layer's proxy returning it. Under a forked RNG: the embedding's part,
        run again here, must not draw from the step's random stream."""
        last = len(self.r.layers) - 1

        def intercept(unit, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            return self._out(h_last if unit.layer_index == last else hidden, unit, args, kwargs)

        self.r.intercept = intercept
        devices = [self.r.device] if self.r.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                return self.r._base_forward(ids, am)
        finally:
            self.r.intercept = None

    @staticmethod
    def _add(acc: torch.Tensor, unit: Unit, grads: Sequence[Optional[torch.Tensor]]) -> None:
        for p, g in zip(unit.params, grads):
            if g is not None:
                acc[p.offset:p.offset + p.numel].add_(g.reshape(-1))

    @staticmethod
    def _grads_into(acc: torch.Tensor, unit: Unit, params: List[torch.Tensor]) -> bool:
        """Let autograd add each parameter's gradient straight into the unit's fp32 sum: every
        bound parameter's ``.grad`` becomes its view of ``acc``, and AccumulateGrad adds into an
        existing ``.grad`` in place (the backward runs with grad mode off). A micro-batch's
        backward then holds one parameter's fresh gradient at a time, not a whole unit's beside
        the sum (``autograd.grad`` returns them all at once). The same adds in the same order
        (the first into the zeroed sum is exact). Only where the bound tensors are fp32 on the
        sum's device (a bf16 parameter cannot have an fp32 ``.grad``): otherwise False, and
        :meth:`_layer_grads` adds ``autograd.grad``'s results itself."""
        if any(p.dtype != acc.dtype or p.device != acc.device for p in params):
            return False
        for spec, p in zip(unit.params, params):
            p.grad = acc[spec.offset:spec.offset + spec.numel].view(spec.shape)
        return True

    def _layer_grads(self, acc: torch.Tensor, unit: Unit, params: List[torch.Tensor], direct: bool,
                     x: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Back-propagate ``g`` through one layer call (input ``x``, output ``h``): the
        parameters' gradients are added into ``acc`` (``direct``: by autograd itself, see
        :meth:`_grads_into`); returns the input's gradient."""
        if direct:
            torch.autograd.backward(h, g, inputs=[x] + params)
            gx = x.grad
        else:
            grads = torch.autograd.grad(h, [x] + params, g, allow_unused=True)
            self._add(acc, unit, grads[1:])
            gx = grads[0]
            del grads
        return gx if gx is not None else torch.zeros_like(x)

    def _fold_outer(self, acc: Optional[torch.Tensor], unit: Unit, bound: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """Move the bound outer tensors' .grad (this micro-batch's share) into the fp32 sum,
        made on the first share (an untied embedding's sum exists only at the step's end)."""
        grads = [t.grad for t in bound]
        if acc is None and any(g is not None for g in grads):
            acc = self._sum(unit.numel)
        if acc is not None:
            self._add(acc, unit, grads)
        for t in bound:
            t.grad = None
        return acc

    def _sum(self, numel: int) -> torch.Tensor:
        """A zeroed fp32 buffer on the device for a unit's gradient summed over micro-batches."""
        if self.grad_buffer is not None:
            if self._straight:
                # The sums go straight to their updates: take the next one once every sum
                # returned so far is with its update (the one before it done). RAM then holds
                # the unit being updated and the sum being formed, never a third waiting in
                # line; the backward of a unit still overlaps the update of the one above it.
                self.r.pager.wait_grads()
            acc = self.grad_buffer(numel).zero_()
        else:
            acc = torch.zeros(numel, dtype=torch.float32, device=self.r.device)
        self.sum_bytes += numel * 4
        self.sum_peak = max(self.sum_peak, self.sum_bytes)
        return acc

    def _return(self, unit: Unit, acc: torch.Tensor) -> None:
        """Send a unit's final sum to the host (whole: a lent buffer is adopted, not copied)."""
        self.r.pager.return_grads(unit, [acc])
        self.sum_bytes -= acc.numel() * 4

    def _note(self, extra: int = 0) -> None:
        self.r.ctx.saved_bytes = self.boundary.bytes["device"] + self._front_bytes
        self.r._note_activation(self.r.ctx.saved_bytes + extra)

    # ------------------------------------------------------------------ one window
    def run(self, batches, *, loss_fn=None, step: StepContext, denom: float, tier: str,
            k: Optional[int] = None) -> Tuple[float, int, int]:
        """Forward and backward of ``batches`` (each ``(ids, am, labels)`` on the device),
        layer-major, with checkpoint interval ``k`` (default: the runner's; the planner may
        choose a larger one for a window, block recompute keeps the result the same).
        Returns (loss sum, target tokens, tokens)."""
        r = self.r
        k = r.checkpoint_interval if k is None else k
        A = len(batches)
        shifts = [F.pad(lab[:, 1:], (0, 1), value=-100) for _, _, lab in batches]
        n_tokens = sum(int((s != -100).sum()) for s in shifts)
        r.ctx = _StepContext(train=True, k=k)
        r.activation_now = 0
        self._front_bytes = 0
        # (one micro-batch: each unit's backward is too short to hide the update it would wait
        # for -- 10 % slower than the single-batch path in bench_accumulation -- and the window
        # holds no more than that path does)
        self._straight = step.updates and not step.clipped and len(batches) > 1
        self.boundary.start(tier)
        order = r.schedule(True, k)
        r.plan_reads(order, step)
        r.pager.set_schedule(order)
        training = r.model.training
        try:
            bound = r._bind_outer(requires_grad=True)
            calls: List[Dict[int, _Call]] = [{} for _ in range(A)]
            rng_embed = [None] * A
            rng: List[Dict[int, object]] = [{} for _ in range(A)]
            hs = []
            for a, (ids, am, _) in enumerate(batches):
                rng_embed[a] = r._rng_state() if training else None
                with torch.no_grad():
                    hs.append(self._capture(ids, am, calls[a]).detach())
            self._front_bytes = sum(_nbytes(h) for h in hs)
            self._note()

            kept = self._forward_layers(hs, calls, rng, k)

            # Head: per micro-batch, the model's own post-layer code and the chunked loss.
            head, embed = r.head, r.embed
            head_acc = embed_acc = None
            loss_sum, gs = 0.0, []
            for a, (ids, am, _) in enumerate(batches):
                h_last = hs[a].detach().requires_grad_(True)
                hs[a] = None
                hidden = self._replay(ids, am, h_last)
                leaf = hidden.detach()
                part, grad_hidden = r._loss_chunks(leaf, shifts[a], loss_fn, denom, backward=True)
                torch.autograd.backward(hidden, grad_hidden)
                loss_sum += part
                del hidden, leaf, grad_hidden
                gs.append(h_last.grad if h_last.grad is not None else torch.zeros_like(h_last))
                if head.numel:
                    head_acc = self._fold_outer(head_acc, head, bound[head.index])
                if embed.numel:   # tied output embeddings
                    embed_acc = self._fold_outer(embed_acc, embed, bound[embed.index])
            self._front_bytes = sum(_nbytes(g) for g in gs)
            if head.numel:
                self._return(head, head_acc if head_acc is not None else self._sum(head.numel))
                del head_acc
            # (the head stays bound until the embedding's capture below: the model's post-layer
            # code runs in every pass of its forward; its slot is its own, so this costs nothing)

            gs = self._backward_layers(gs, calls, rng, k, kept)

            # Embedding: its part of the forward again (same RNG state), back-propagated.
            if embed.numel:
                for a, (ids, am, _) in enumerate(batches):
                    with r._restored_rng(rng_embed[a]), torch.enable_grad():
                        h0 = self._capture(ids, am, {})
                    if h0.requires_grad:
                        torch.autograd.backward(h0, gs[a])
                    gs[a] = None
                    del h0
                    embed_acc = self._fold_outer(embed_acc, embed, bound[embed.index])
                self._return(embed, embed_acc if embed_acc is not None else self._sum(embed.numel))
            r._release_outer(head)
            r._release_outer(embed)
            tokens = sum(int(ids.numel()) for ids, _, _ in batches)
            return loss_sum, n_tokens, tokens
        except BaseException:
            for u in r.units:
                unbind(u, r.placeholders)
            r.pager.reset()
            raise
        finally:
            self.boundary.clear()
            self.sum_bytes = 0
            r.ctx = None
            r.activation_now = 0
            self._front_bytes = 0

    # ------------------------------------------------------------------ layers, forward
    def _forward_layers(self, hs: List[torch.Tensor], calls, rng, k: int):
        """Every layer once, all micro-batches; ``hs`` becomes the last layer's outputs.
        k == 0: the layers' autograd graphs are kept (returned) and their slots stay held."""
        r = self.r
        kept = {}
        for unit in r.layers:
            i = unit.layer_index
            w = r.pager.acquire(unit)
            if k == 0:
                params = bind(unit, w, requires_grad=True)
                try:
                    for a in range(len(hs)):
                        x = hs[a].detach().requires_grad_(True)
                        if r.model.training:
                            rng[a][i] = r._rng_state()
                        with torch.enable_grad(), r._count_saved(accumulate=True):
                            h = self._call_layer(unit, calls[a][i], x)
                        kept[(i, a)] = (x, h)
                        hs[a] = h.detach()
                finally:
                    unbind(unit, r.placeholders)
                kept[i] = params
                continue
            bind(unit, w, requires_grad=False)
            try:
                for a in range(len(hs)):
                    if i % k == 0:
                        self.boundary.put((i, a), hs[a])
                    if r.model.training:
                        rng[a][i] = r._rng_state()
                    with torch.no_grad():
                        hs[a] = self._call_layer(unit, calls[a][i], hs[a])
                self._note()
            finally:
                unbind(unit, r.placeholders)
                r.pager.release(unit)
        return kept

    # ------------------------------------------------------------------ layers, backward
    def _backward_layers(self, gs: List[torch.Tensor], calls, rng, k: int, kept):
        r = self.r
        layers, n, A = r.layers, len(r.layers), len(gs)
        if k == 0:
            for unit in reversed(layers):
                i = unit.layer_index
                params = kept.pop(i)
                acc = self._sum(unit.numel)
                direct = self._grads_into(acc, unit, params)
                for a in range(A):
                    x, h = kept.pop((i, a))
                    gs[a] = self._layer_grads(acc, unit, params, direct, x, h, gs[a])
                    del x, h
                for p in params:
                    p.grad = None
                self._return(unit, acc)
                r.pager.release(unit)
            return gs
        for b in reversed(range(0, n, k)):
            end = min(b + k, n)
            inputs = [{b: self.boundary.pop((b, a))} for a in range(A)]
            block = sum(_nbytes(d[b]) for d in inputs)
            for i in range(b, end - 1):   # recompute the block's inner inputs
                unit = layers[i]
                w = r.pager.acquire(unit)
                bind(unit, w, requires_grad=False)
                try:
                    for a in range(A):
                        with r._restored_rng(rng[a].get(i)), torch.no_grad():
                            inputs[a][i + 1] = self._call_layer(unit, calls[a][i], inputs[a][i])
                        block += _nbytes(inputs[a][i + 1])
                    self._note(block)
                finally:
                    unbind(unit, r.placeholders)
                    r.pager.release(unit)
            for i in reversed(range(b, end)):
                unit = layers[i]
                w = r.pager.acquire(unit)
                params = bind(unit, w, requires_grad=True)
                acc = self._sum(unit.numel)
                direct = self._grads_into(acc, unit, params)
                try:
                    for a in range(A):
                        x = inputs[a].pop(i).detach().requires_grad_(True)
                        with r._restored_rng(rng[a].get(i)), torch.enable_grad(), r._count_saved():
                            h = self._call_layer(unit, calls[a][i], x)
                        gs[a] = self._layer_grads(acc, unit, params, direct, x, h, gs[a])
                        del x, h
                finally:
                    unbind(unit, r.placeholders)
                    for p in params:
                        p.grad = None
                self._return(unit, acc)
                del acc
                r.pager.release(unit)
            self._front_bytes = sum(_nbytes(g) for g in gs)
            self._note()
        return gs


def plan_for(batches, *, plan, model_config, config, num_layers: int, device: torch.device) -> WindowPlan:
    """The layout a window of prepared ``(ids, am, labels)`` micro-batches gets: layer-major
    when their boundary activations fit the device budget, else host RAM, else split."""
    cap = None
    if device.type == "cuda" and not config.max_vram_gb:
        cap = torch.cuda.get_device_properties(device).total_memory
    return engine_window_plan(plan, model_config, config, num_layers,
                              tokens=max(int(b[0].numel()) for b in batches), micro_batches=len(batches),
                              device_capacity=cap)


class WindowStep:
    """One layer-major window through the engine's parts: plans its groups, runs each through
    the :class:`WindowRunner` with the step's updates, and records the telemetry.
    ``clip_hold_disk``: whether ``clip_hold="auto"`` means the disk tier (the planner's
    ``placement["gradients"]``: the host budget cannot hold them)."""

    def __init__(self, window_runner: WindowRunner, boundary: BoundaryStore, *, updates, pager, counters,
                 config, layer_names: List[str], clip_hold_disk: bool):
        self.window_runner, self.boundary = window_runner, boundary
        self.updates, self.pager, self.counters, self.config = updates, pager, counters, config
        self.layer_names, self.clip_hold_disk = layer_names, clip_hold_disk
        self.last_plan: Optional[WindowPlan] = None
        self.boundary_peak = {"device": 0, "host": 0, "disk": 0}   # over all windows, per tier

    def hold(self) -> str:
        """Where final gradients wait for the clipping norm ("host" | "disk")."""
        hold = self.config.clip_hold
        if hold == "auto":
            hold = "disk" if self.clip_hold_disk else "host"
        return hold

    def run(self, batches, plan_window: Callable, loss_fn, num_items_in_batch, step_lr, max_grad_norm):
        """``(loss, target tokens, grad norm, skipped)`` of the window ``batches``; ``plan_window(batches)``
        gives its :class:`WindowPlan`."""
        t0 = time.perf_counter()
        if num_items_in_batch is None:
            num_items_in_batch = sum(int((lab[:, 1:] != -100).sum()) for _, _, lab in batches)
        denom = max(num_items_in_batch, 1)
        wp = plan_window(batches)
        self.last_plan = wp
        loss_sum, n, norm, skipped = 0.0, 0, None, False
        boundary_peak = {"device": 0, "host": 0, "disk": 0}
        disk_ops: dict = {}
        for g0 in range(0, len(batches), wp.group_size):
            group = batches[g0:g0 + wp.group_size]
            last = g0 + wp.group_size >= len(batches)
            step = self.updates.context(step_lr if last else None, max_grad_norm if last else None, self.hold())
            self.updates.begin(step)
            try:
                part, cnt, tokens = self.window_runner.run(group, loss_fn=loss_fn, step=step, denom=denom,
                                                           tier=wp.tier, k=wp.checkpoint_interval)
                self.pager.wait_grads()
                # The finiteness check sees the whole window's loss (every group's so far).
                norm, skipped = self.updates.finish(step, (loss_sum + part) / max(n + cnt, 1))
            except finite.NonFiniteError:
                self.updates.nonfinite = None  # reported now, to this caller
                raise
            finally:
                self.updates.end()
            loss_sum, n = loss_sum + part, n + cnt
            for t in boundary_peak:
                boundary_peak[t] = max(boundary_peak[t], self.boundary.peak[t])
            for op, v in self.boundary.disk_ops.items():
                disk_ops[op] = disk_ops.get(op, 0) + v
            self.counters.add_tokens(tokens, len(group))
        self.boundary_peak = {t: max(v, self.boundary_peak[t]) for t, v in boundary_peak.items()}
        if step_lr is not None:
            self.counters.add("steps", 1)
            self.counters.close_step(list(self.layer_names), groups=wp.groups, group_size=wp.group_size,
                                     boundary_tier=wp.tier, boundary_bytes=boundary_peak,
                                     boundary_disk_ops=disk_ops, checkpoint_interval=wp.checkpoint_interval)
        self.counters.add("micro_batches", len(batches))
        self.counters.add("step_seconds", time.perf_counter() - t0)
        return loss_sum / max(n, 1), n, norm, skipped

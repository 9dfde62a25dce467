"""One training step, top to bottom: the layer-major loop is the only training loop.

A step is a window of A micro-batches (a single batch is a window of one). :class:`Steps` runs
it: the planner's layout (groups of micro-batches, where the boundary activations wait, the
checkpoint interval), then per group the update scheduler's begin, the :class:`StepRunner`'s
forward and backward, the gradients' return, the scheduler's finish (norm, clipping,
skipped) and end, then the telemetry.

:class:`StepRunner` runs one group, every unit resident once per pass:

1. *capture*: the model's own forward, per micro-batch, with the layer proxies recording how
   the model called each layer (masks per layer type, rotary embeddings, positions: all but
   the hidden state) and passing the hidden state through; layer 0's input is the embedding's
   output. Nothing of the layers runs.
2. *forward*: each layer, once on the device, runs every micro-batch (its captured call); the
   input of every k-th layer waits in the :class:`~.window.BoundaryStore` (device, host or
   disk tier). k == 0: every layer's autograd graph is kept instead (no recompute).
3. *head*: per micro-batch, the model's own post-layer code (final norm, ...) is *replayed*
   on the last layer's output (the last proxy returns it) and the loss is taken in chunks of
   the head; the head's gradient is summed.
4. *backward*: the layers' blocks of k in reverse; a block's inner inputs are recomputed from
   its boundary input, then each layer, resident once, back-propagates every micro-batch; its
   gradient is summed on the device (fp32) and leaves once, final, so its update can start.
5. *embedding*: its part of the forward again (same RNG state), back-propagated into its
   weights; no autograd graph is held across the step.

Dropout: the RNG state at each (micro-batch, layer) call is recorded in the forward and
restored for the recompute, so the backward sees the forward's masks. The draws happen in
layer-major order: with dropout and A > 1 the masks differ from those of one micro-batch at a
time (same distribution; with A = 1 they are the same).

Evaluation and logits take a small path of their own (:meth:`StepRunner.evaluate`,
:meth:`StepRunner.logits`): the model's own forward, each proxy running its layer without
gradients as it is called.

Beside the loop: the head and the chunked loss are :class:`.LossHead`'s (``loss_head.py``), the
units' fp32 gradient sums :class:`.GradSums`'s (``grad_sums.py``), the activation bytes and the
RNG state a recompute replays ``recompute.py``'s.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .updates import finite
from .discovery import locate
from .updates.grad_sums import GradSums
from .inputs import model_inputs
from .vision import ImageFeatures
from .layer_calls import GradKeys, GradRecord, LayerCall, NotRun, SideStreams, add_grads, graph_roots
from .layer_state import SharedState
from .compute.long_attention import long_attention
from .compute.packed_attention import packed_attention
from .compute.loss_head import HeadOut, LossHead
from .proxies import bind, output_template, template_of, unbind
from .recompute import ActivationMeter, restored_rng, rng_state
from .compute.tiling import LayerTiling
from .units import Unit, forward_order
from .planning.planner import WindowPlan
from .updates.updates import StepContext
from .window import BoundaryStore


class _AllCaptured(BaseException):
    """Raised by the capture once every layer's call is recorded: the rest of the model's forward
    (its post-layer code: the final norm) is not run there -- the head replays it. A
    BaseException, so a model's ``except Exception`` does not swallow it."""


def head_late_order(units: List[Unit]) -> List[Unit]:
    """The embedding, the layers, then the head: the order a training forward acquires units once
    the model is known not to use the head's modules before its layers (:attr:`StepRunner.head_late`),
    and the order a clipped step's updates then run in (the next forward's)."""
    return [units[0]] + list(units[1:-1]) + [units[-1]]


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _hidden_of(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _single_plan(checkpoint_interval: int) -> WindowPlan:
    """A single batch's layout: one micro-batch, its boundary activations on the device."""
    return WindowPlan(micro_batches=1, groups=1, group_size=1, tier="device", boundary_bytes=0,
                      device_work_bytes=0, loads_per_layer=0.0, reason="one micro-batch",
                      checkpoint_interval=checkpoint_interval)


class StepRunner:
    """Runs groups of micro-batches through ``model`` layer-major. Collaborators: ``units``
    (embedding first, head last), the ``pager`` (device slots, gradients back to the host), the
    meta ``placeholders`` parameters go back to after each use, the ``boundary`` store, and
    ``plan_reads(compute_order, step)`` (the update scheduler's disk read-ahead).
    ``grad_buffer(numel)``: where a unit's gradient sum is formed (a CPU "device": the update
    scheduler's pool, handed over whole, adopted without a copy); None: fresh device tensors.
    ``vision``: (how many micro-batches' vision graphs a group keeps, whether the tower runs by
    blocks[, the tower's blocks streamed: a ``compute/vision_stream.TowerStream`` or None]): the
    plan's placement of a VLM's vision tower (``vision.ImageFeatures``)."""

    def __init__(self, model, units: List[Unit], pager, placeholders, boundary: BoundaryStore, *,
                 device: torch.device, checkpoint_interval: int, loss_chunk_tokens: int,
                 plan_reads: Callable[[List[Unit], Optional[StepContext]], None],
                 grad_buffer: Optional[Callable[[int], torch.Tensor]] = None,
                 tile_tokens: Optional[int] = None, device_budget: Optional[int] = None,
                 reached: Optional[Callable] = None, vision: tuple = (None, False)):
        self.model = model
        self.units = units
        self.embed, self.head, self.layers = units[0], units[-1], units[1:-1]
        self.pager = pager
        self.placeholders = placeholders
        self.boundary = boundary
        self.device = device
        self.checkpoint_interval = checkpoint_interval
        self.loss_chunk_tokens = loss_chunk_tokens
        self.plan_reads = plan_reads
        base_name, self.base, path = locate(model)   # before the layer proxies go in
        self.meter = ActivationMeter(boundary, pager)   # device bytes of activations: now, peak
        # a VLM's image features: the vision tower once per micro-batch, its graph kept (vision.py)
        self.images = ImageFeatures(self.base, self.meter, keep=vision[0], by_blocks=vision[1])
        self.tower = vision[2] if len(vision) > 2 else None   # the streamed tower's blocks (or None)
        self.loss_head = LossHead(model, base_name, self.base, path, loss_chunk_tokens, self.meter)
        # the units' fp32 gradient sums on the device (``reached``: told what an outer unit's backward reached)
        self.sums = GradSums(pager, device, grad_buffer, reached)
        self._mode: Optional[Callable] = None   # the proxies' mode: capture or replay (None: run the layer)
        #: Whether a training forward binds the head after its last layer (not before the first):
        #: learned at the first training capture, which runs with the head bound and watches its
        #: modules -- True when none ran before every layer's call was recorded. A clipped step's
        #: updates then run embedding, layers, head, and the forward waits for the embedding's
        #: update only before its first layer (the head's runs behind the layers' compute).
        self.head_late: Optional[bool] = None
        self._tuple_out = False    # whether the layers return a tuple (learned from real calls)
        self._out_template: Dict[int, tuple] = {}   # per layer: proxies.template_of its output
        self._guessed: set = set()   # layers whose output shape _out guessed in this pass
        self._arg_grads: Optional[bool] = None   # whether layer arguments need gradients (None: not known yet)
        self._streams = SideStreams([])   # this group's layer outputs that later layers take
        self._state = SharedState()       # ... and state its layers store in shared arguments
        elem = torch.empty((), dtype=getattr(pager, "dtype", torch.float32)).element_size()
        # each layer's MLP over a long sequence in tiles (engine/compute/tiling.py)
        self.tiling = LayerTiling(model, [u.module for u in self.layers], tile_tokens=tile_tokens,
                                  elem_bytes=elem, budget_bytes=device_budget, host_device=device.type == "cpu")

    @property
    def activation_peak(self) -> int:
        """Peak device bytes of activations (saved inputs, work, logits)."""
        return self.meter.peak

    @property
    def activation_now(self) -> int:
        return self.meter.now

    @property
    def sum_peak(self) -> int:
        """Peak device bytes of fp32 gradient sums over the steps run."""
        return self.sums.peak

    # ------------------------------------------------------------------ schedule
    def schedule(self, train: bool, k: Optional[int] = None, head_late: bool = False) -> List[Unit]:
        """The units' compute order; ``k``: the checkpoint interval (default the runner's);
        ``head_late``: a training forward that binds the head after its last layer."""
        layers = self.layers
        order = head_late_order(self.units) if train and head_late else forward_order(self.units)
        k = self.checkpoint_interval if k is None else k
        if train and k > 0:
            n = len(layers)
            for b in reversed(range(0, n, k)):
                end = min(b + k, n)
                order += layers[b:end - 1]                 # recompute the block's forward
                order += list(reversed(layers[b:end]))     # then its backward
        return [u for u in order if u.numel > 0]

    def close(self) -> None:
        """The streamed vision tower's pager (slots, threads) dropped; the engine's pager is the engine's."""
        if self.tower is not None:
            self.tower.close()

    def _start(self, order: List[Unit], step: Optional[StepContext]) -> None:
        self.plan_reads(order, step)  # set first: the pager starts fetching at once
        self.pager.set_schedule(order)

    def _abort(self) -> None:
        """After an error mid-step: every unit back to its placeholders, every slot dropped."""
        for u in self.units:
            unbind(u, self.placeholders)
        self.pager.reset()
        self.images.clear()
        if self.tower is not None:
            self.tower.reset()

    # ------------------------------------------------------------------ the model's own code
    def layer_call(self, unit: Unit, args, kwargs):
        """A layer proxy's call: handed to the current mode (capture, replay), else the layer
        runs now without gradients (evaluation)."""
        if self._mode is not None:
            return self._mode(unit, args, kwargs)
        return self._run_layer_nograd(unit, LayerCall.captured(args, kwargs), _hidden_of(args, kwargs))

    def _base_forward(self, ids, am) -> torch.Tensor:
        """The base model's own forward (layers through the proxies): final hidden states."""
        out = self.base(input_ids=ids, use_cache=False, **model_inputs(am))
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def _out(self, h, unit: Unit, args=(), kwargs=None):
        """``h`` shaped as ``unit``'s layer returns its output (capture and replay, where the
        layers do not run): a bare tensor, or a tuple whose first item is the hidden state and
        whose others are None where the layer returns None and a :class:`.NotRun` where it returns
        something (learned from a real call or a fake-tensor probe)."""
        t = self._out_template.get(unit.layer_index)
        if t is None:
            t = output_template(unit, args, kwargs or {}, self.placeholders)
            if t is not None:
                self._out_template[unit.layer_index] = t
        if t is None:   # the probe failed: as the other layers (a guess)
            self._guessed.add(unit.layer_index)
            t = next(iter(self._out_template.values()), None)
        if t is None:
            return (h,) if self._tuple_out else h
        is_tuple, extras = t
        if not is_tuple:
            return h
        return (h,) + tuple(NotRun(unit.layer_index, j) if x else None for j, x in enumerate(extras))

    def _learn_output(self, unit: Unit, out) -> None:
        self._tuple_out = isinstance(out, (tuple, list))
        self._out_template[unit.layer_index] = template_of(out)

    def _capture(self, ids, am, calls: Dict[int, LayerCall], keep_graph: bool = False) -> torch.Tensor:
        """The model's own forward up to the layers: each layer's call into ``calls``; returns
        layer 0's input (with its autograd graph when grad mode is on). With grad mode on, the
        layer arguments that need gradients are marked in the calls (:mod:`.layer_calls`), and
        with ``keep_graph`` kept with their graph."""
        h0 = []
        keys = GradKeys()
        grad_on = torch.is_grad_enabled()

        def capture(unit, args, kwargs):
            if grad_on and not torch.is_grad_enabled():
                raise NotImplementedError(
                    f"{type(self.model).__name__} calls its layers with gradients off in a training forward "
                    "(under torch.no_grad, as iterations that take no gradient, or inside a custom autograd function, "
                    "as reversible layers whose backward inverts them); the streaming engine forms each layer's "
                    "gradient itself, so this family is not supported.")
            if unit.layer_index in calls:
                raise NotImplementedError(
                    f"{type(self.model).__name__} calls its layer {unit.layer_index} more than once in one "
                    "forward (a looped or shared layer); this family is not supported by the streaming engine yet.")
            hidden = _hidden_of(args, kwargs)
            if unit.layer_index == 0:
                h0.append(hidden)
            calls[unit.layer_index] = LayerCall.captured(args, kwargs, unit.layer_index, keys, keep_graph)
            if len(calls) == len(self.layers):
                raise _AllCaptured()
            return self._out(hidden, unit, args, kwargs)

        self._mode = capture
        self._guessed = set()
        watch = self._watch_head(calls) if self.head_late is None and grad_on else None
        try:
            with self.images.mode("backward" if keep_graph else "record"):   # (vision.ImageFeatures)
                try:
                    self._base_forward(ids, am)
                except _AllCaptured:
                    pass
            if watch is not None and len(calls) == len(self.layers):
                self.head_late = not watch["used"]
        except (TypeError, ValueError, IndexError) as e:
            if not self._guessed:
                raise
            # The model's code took apart an output shaped by a guess: what these layers return
            # could not be found without running them (the fake-tensor probe failed).
            raise NotImplementedError(
                f"{type(self.model).__name__}: what its layers {sorted(self._guessed)} return could not be found "
                f"without running them, and the model's forward failed on the guess ({type(e).__name__}: {e}); "
                "this family is not supported by the streaming engine yet.") from e
        finally:
            self._mode = None
            keys.close()
            if watch is not None:
                for h in watch["hooks"]:
                    h.remove()
        return h0[0]

    def _watch_head(self, calls: Dict[int, LayerCall]) -> dict:
        """Forward pre-hooks on the head's modules for one capture: ``used`` when one runs before
        every layer's call is recorded (a module registered after the layers, called before them)."""
        watch = {"used": False, "hooks": []}
        n = len(self.layers)

        def pre(_mod, _args):
            if len(calls) < n:
                watch["used"] = True
        mods = {id(m): m for e in self.head.params for m, _ in e.bindings}
        watch["hooks"] = [m.register_forward_pre_hook(pre) for m in mods.values()]
        return watch

    def _replay(self, ids, am, h_last: torch.Tensor) -> torch.Tensor:
        """The model's own post-layer code (final norm, ...) on ``h_last``: the base forward
        with the last layer's proxy returning it. Under a forked RNG: the embedding's part,
        run again here, must not draw from the step's random stream."""
        last = len(self.layers) - 1

        def replay(unit, args, kwargs):
            return self._out(h_last if unit.layer_index == last else _hidden_of(args, kwargs), unit, args, kwargs)

        self._mode = replay
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), self.images.mode("replay"):
                return self._base_forward(ids, am)
        finally:
            self._mode = None

    def _call_layer(self, unit: Unit, call: LayerCall, hidden, rec: Optional[GradRecord] = None,
                    side: Optional[dict] = None):
        """The layer's output hidden state; ``rec``: (a call with gradients) receives the leaves
        made of the call's arguments that need gradients (:meth:`.LayerCall.with_leaves`) and
        its side values; ``side``: the micro-batch's :class:`.SideStreams` values (taken from
        and added to)."""
        if rec is None:
            a, kw = call.with_hidden(hidden, side)
        else:
            taken = self._streams.leaves(call, side, rec) if side is not None else None
            a, kw, made = call.with_leaves(hidden, taken)
            rec.leaves.extend(made)
        state = self._state.before(call, rec) if side is not None else None
        with self.tiling.active(unit.module, hidden):
            out = unit.module(*a, **kw)
        if state is not None:
            self._state.after(call, rec, state)
        if side is not None:
            self._streams.learn(unit.layer_index, out, side, rec)
        self._learn_output(unit, out)
        return _first(out)

    def _run_layer_nograd(self, unit: Unit, call: LayerCall, hidden):
        w = self.pager.acquire(unit)
        bind(unit, w, requires_grad=False)
        try:
            a, kw = call.with_hidden(hidden)
            with torch.no_grad(), self.tiling.active(unit.module, hidden):
                out = unit.module(*a, **kw)
        finally:
            unbind(unit, self.placeholders)
            self.pager.release(unit)
        self._learn_output(unit, out)
        return out

    def _bind_outer(self, requires_grad: bool, units=None) -> Dict[int, List[torch.Tensor]]:
        bound = {}
        for u in units or (self.embed, self.head):
            bound[u.index] = bind(u, self.pager.acquire(u), requires_grad=requires_grad) \
                if u.numel else []
        return bound

    def _release_outer(self, u: Unit) -> None:
        if u.numel:
            unbind(u, self.placeholders)
            self.pager.release(u)

    # ------------------------------------------------------------------ one group of micro-batches
    def run(self, batches, *, loss_fn=None, step: StepContext, denom: float, tier: str = "device",
            k: Optional[int] = None, data: Optional[list] = None,
            head_late: bool = False) -> Tuple[float, int, int, List[HeadOut]]:
        """Forward and backward of ``batches`` (each ``(ids, am, labels)`` on the device),
        layer-major, with checkpoint interval ``k`` (default: the runner's; the planner may
        choose a larger one for a window, block recompute keeps the result the same), the
        boundary activations on ``tier``; the gradients go to the pager, that of ``sum of token
        losses / denom`` (a sequence objective's: of the sum of its micro-batch losses). ``data``:
        each micro-batch's ``objective_data`` (None: none), handed to the head with it.
        ``head_late``: the head is bound after the last layer (:attr:`head_late`; the pending
        updates run in that order). Returns (token loss sum, target tokens, tokens, each
        micro-batch's :class:`.HeadOut`)."""
        k = self.checkpoint_interval if k is None else k
        A = len(batches)
        long_attention(self.model, *batches[0][0].shape)   # eager attention at a long length: SDPA or a warning
        packed_attention(self.model, batches)              # long packed rows: attention per document
        shifts = [F.pad(lab[:, 1:], (0, 1), value=-100) for _, _, lab in batches]
        n_tokens = sum(int((s != -100).sum()) for s in shifts)
        self.meter.now = 0
        self.meter.saved = self.meter.front = 0
        # (one micro-batch: each unit's backward is too short to hide the update it would wait
        # for -- 10 % slower in bench_accumulation -- and it holds no more sums than that)
        self.sums.straight = step.straight and A > 1
        self.boundary.start(tier)
        head_late = head_late and bool(self.head_late)
        self._start(self.schedule(True, k, head_late), step)
        training = self.model.training
        try:
            # 1. capture: each micro-batch's layer calls and layer 0's input
            bound = self._bind_outer(requires_grad=True, units=(self.embed,) if head_late else None)
            calls: List[Dict[int, LayerCall]] = [{} for _ in range(A)]
            rng_embed = [None] * A
            rng: List[Dict[int, Any]] = [{} for _ in range(A)]
            hs = []
            for a, (ids, am, _) in enumerate(batches):
                if training:
                    rng_embed[a] = rng_state(self.device)
                # (grad mode on until the model is known to pass its layers nothing that needs
                # gradients besides the hidden state: the calls mark what does)
                with torch.set_grad_enabled(self._arg_grads is not False):
                    hs.append(self._capture(ids, am, calls[a]).detach())
            self._arg_grads = any(c.grad_paths for d in calls for c in d.values())
            self._streams, self._state = SideStreams(calls), SharedState()
            self.meter.front = sum(_nbytes(h) for h in hs)
            self.meter.note()
            if k:   # the forward's boundary puts: one per k-th layer and micro-batch
                self.boundary.expect(hs, sum(1 for u in self.layers if u.layer_index % k == 0))

            # 2. forward: every layer once, all micro-batches
            kept = self._forward_layers(hs, calls, rng, k)

            # 3. head: per micro-batch the model's own post-layer code and the chunked loss
            heads, gs, embed_acc, head_acc = self._head(batches, shifts, hs, bound, loss_fn, denom,
                                                        data or [None] * A)
            # (the head stays bound until the embedding's capture below: the model's post-layer
            # code runs in every pass of its forward; its slot is its own, so this costs nothing)

            # 4. backward: the layers' blocks in reverse
            arg_grads: List[dict] = [{} for _ in range(A)]   # per micro-batch: key -> gradient
            gs = self.backward_layers(gs, calls, rng, k, kept, arg_grads)

            # 5. embedding: its part of the forward again (same RNG state), back-propagated
            self._embedding_backward(batches, bound, gs, arg_grads, rng_embed, embed_acc, head_acc)
            self._release_outer(self.head)
            self._release_outer(self.embed)
            tokens = sum(int(ids.numel()) for ids, _, _ in batches)
            return sum(h.loss_sum for h in heads), n_tokens, tokens, heads
        except BaseException:
            self._abort()
            raise
        finally:
            self.boundary.clear()
            self.sums.bytes = 0
            self.meter.now = 0
            self.meter.saved = self.meter.front = 0

    def _head(self, batches, shifts, hs: List[torch.Tensor], bound, loss_fn, denom, data: list):
        """Per micro-batch: the model's post-layer code replayed on the last layer's output, the
        chunked loss (with the micro-batch's own ``data[a]``) and its backward. The head's
        gradient sum leaves; returns (each micro-batch's :class:`.HeadOut`, its gradient at the
        last layer's output, a tied embedding's sum so far, the head's sum when it waits for the
        embedding's backward, else None)."""
        head, embed = self.head, self.embed
        if head.index not in bound:   # (head_late: bound after the last layer)
            bound.update(self._bind_outer(requires_grad=True, units=(head,)))
        head_acc = embed_acc = None
        heads, gs = [], []
        for a, (ids, am, _) in enumerate(batches):
            h_last = hs[a].detach().requires_grad_(True)
            hs[a] = None
            hidden = self._replay(ids, am, h_last)
            leaf = hidden.detach()
            out = self.loss_head.loss(leaf, shifts[a], loss_fn, denom, backward=True, data=data[a])
            torch.autograd.backward(hidden, out.grad)
            out.grad = None
            heads.append(out)
            del hidden, leaf
            gs.append(h_last.grad if h_last.grad is not None else torch.zeros_like(h_last))
            if head.numel:
                head_acc = self.sums.fold_outer(head_acc, head, bound[head.index])
            if embed.numel:   # tied output embeddings
                embed_acc = self.sums.fold_outer(embed_acc, embed, bound[embed.index])
        self.meter.front = sum(_nbytes(g) for g in gs)
        if head.numel:
            if self._arg_grads:   # layer arguments may reach head weights (registered after the layers)
                return heads, gs, embed_acc, head_acc if head_acc is not None else self.sums.new(head.train_numel)
            self.sums.send(head, head_acc if head_acc is not None else self.sums.new(head.train_numel))
        return heads, gs, embed_acc, None

    def _embedding_backward(self, batches, bound, gs, arg_grads, rng_embed, embed_acc, head_acc) -> None:
        """Per micro-batch the model's forward up to the layers again (same RNG state, with its
        graph), back-propagated from layer 0's input (``gs``) and the layer arguments that need
        gradients (``arg_grads``); the embedding's sum (and a waiting head's) leaves."""
        embed, head = self.embed, self.head
        if not embed.numel and head_acc is None:
            return
        for a, (ids, am, _) in enumerate(batches):
            again: Dict[int, LayerCall] = {}
            with restored_rng(rng_embed[a], self.device), torch.enable_grad():
                h0 = self._capture(ids, am, again, keep_graph=True)
            roots, grads = graph_roots(again, arg_grads[a])
            roots, grads = [h0] + roots, [gs[a]] + grads
            keep = [i for i, t in enumerate(roots) if t.requires_grad]
            if keep:   # (a streamed vision tower's blocks re-run in it: their gradients leave as they are done)
                with self.tower.backward() if self.tower is not None else contextlib.nullcontext():
                    torch.autograd.backward([roots[i] for i in keep], [grads[i] for i in keep])
            gs[a] = arg_grads[a] = None
            del h0, roots, grads, again
            if embed.numel:
                embed_acc = self.sums.fold_outer(embed_acc, embed, bound[embed.index])
            if head_acc is not None:
                head_acc = self.sums.fold_outer(head_acc, head, bound[head.index])
        if head_acc is not None:
            self.sums.send(head, head_acc)
        if embed.numel:
            self.sums.send(embed, embed_acc if embed_acc is not None else self.sums.new(embed.train_numel))

    def _forward_layers(self, hs: List[torch.Tensor], calls, rng, k: int):
        """Every layer once, all micro-batches; ``hs`` becomes the last layer's outputs.
        k == 0: the layers' autograd graphs are kept (returned) and their slots stay held."""
        kept = {}
        for unit in self.layers:
            i = unit.layer_index
            w = self.pager.acquire(unit)
            if k == 0:
                params = bind(unit, w, requires_grad=True)
                try:
                    for a in range(len(hs)):
                        x = hs[a].detach().requires_grad_(True)
                        if self.model.training:
                            rng[a][i] = rng_state(self.device)
                        rec = GradRecord()
                        with torch.enable_grad(), self.meter.count_saved(accumulate=True):
                            h = self._call_layer(unit, calls[a][i], x, rec, self._streams.live[a])
                        kept[(i, a)] = (x, rec, h)
                        hs[a] = h.detach()
                finally:
                    unbind(unit, self.placeholders)
                kept[i] = params
                continue
            bind(unit, w, requires_grad=False)
            try:
                for a in range(len(hs)):
                    if i % k == 0:
                        self.boundary.put((i, a), hs[a])
                        self._streams.block_start(i, a)
                    if self.model.training:
                        rng[a][i] = rng_state(self.device)
                    with torch.no_grad():
                        hs[a] = self._call_layer(unit, calls[a][i], hs[a], side=self._streams.live[a])
                self.meter.note()
            finally:
                unbind(unit, self.placeholders)
                self.pager.release(unit)
        return kept

    def backward_layers(self, gs: List[torch.Tensor], calls, rng, k: int, kept, arg_grads: List[dict]):
        """The layers' backward, last block first; ``gs``: each micro-batch's gradient at the
        last layer's output, returned as that at layer 0's input; the gradients of the layer
        arguments that need them are summed into ``arg_grads`` (per micro-batch, by key)."""
        layers, n, A = self.layers, len(self.layers), len(gs)
        if k == 0:
            for unit in reversed(layers):
                i = unit.layer_index
                params = kept.pop(i)
                acc = self.sums.new(unit.train_numel)
                direct = self.sums.grads_into(acc, unit, params)
                for a in range(A):
                    x, rec, h = kept.pop((i, a))
                    gs[a] = self._layer_grads(acc, unit, params, direct, x, h, gs[a], rec, calls[a][i], a, arg_grads)
                    del x, rec, h
                for p in params:
                    p.grad = None
                self.sums.send(unit, acc)
                self.pager.release(unit)
            return gs
        for b in reversed(range(0, n, k)):
            end = min(b + k, n)
            inputs = [{b: self.boundary.pop((b, a))} for a in range(A)]
            side = [self._streams.block_backward(b, a) for a in range(A)]
            block = sum(_nbytes(d[b]) for d in inputs)
            for i in range(b, end - 1):   # recompute the block's inner inputs
                unit = layers[i]
                w = self.pager.acquire(unit)
                bind(unit, w, requires_grad=False)
                try:
                    for a in range(A):
                        with restored_rng(rng[a].get(i), self.device), torch.no_grad():
                            inputs[a][i + 1] = self._call_layer(unit, calls[a][i], inputs[a][i], side=side[a])
                        block += _nbytes(inputs[a][i + 1])
                    self.meter.note(block)
                finally:
                    unbind(unit, self.placeholders)
                    self.pager.release(unit)
            for i in reversed(range(b, end)):
                unit = layers[i]
                w = self.pager.acquire(unit)
                params = bind(unit, w, requires_grad=True)
                acc = self.sums.new(unit.train_numel)
                direct = self.sums.grads_into(acc, unit, params)
                try:
                    for a in range(A):
                        x = inputs[a].pop(i).detach().requires_grad_(True)
                        rec = GradRecord()
                        with restored_rng(rng[a].get(i), self.device), torch.enable_grad(), self.meter.count_saved():
                            h = self._call_layer(unit, calls[a][i], x, rec, side[a])
                        gs[a] = self._layer_grads(acc, unit, params, direct, x, h, gs[a], rec, calls[a][i], a,
                                                  arg_grads)
                        del x, h, rec
                finally:
                    unbind(unit, self.placeholders)
                    for p in params:
                        p.grad = None
                self.sums.send(unit, acc)
                del acc
                self.pager.release(unit)
            self.meter.front = sum(_nbytes(g) for g in gs)
            self.meter.note()
        return gs

    # ------------------------------------------------------------------ gradient sums
    def _layer_grads(self, acc: torch.Tensor, unit: Unit, params: List[torch.Tensor], direct: bool,
                     x: torch.Tensor, h: torch.Tensor, g: torch.Tensor, rec: GradRecord,
                     call: LayerCall, a: int, arg_grads: List[dict]) -> torch.Tensor:
        """Back-propagate ``g`` (and the gradients later layers sent to its side outputs)
        through one layer call of micro-batch ``a`` (input ``x``, output ``h``, ``rec``): the
        parameters' gradients are added into ``acc`` (``direct``: by autograd itself, see
        :meth:`.GradSums.grads_into`), its argument leaves' into ``arg_grads[a]`` by key, its side
        inputs' into the :class:`.SideStreams`; returns the input's gradient."""
        outs, gouts = [h], [g]
        for key, t in rec.side_out:
            gt = self._streams.grads[a].pop(key, None)
            if gt is not None:
                outs.append(t)
                gouts.append(gt)
        ins = [x] + rec.leaves + [t for _, t in rec.side_in]
        train = [p for p in params if p.requires_grad]   # a frozen weight is bound without: no weight gradient
        if direct:
            torch.autograd.backward(outs, gouts, inputs=ins + train)
            gin = [t.grad for t in ins]
        else:
            grads = torch.autograd.grad(outs, ins + train, gouts, allow_unused=True)
            it = iter(grads[len(ins):])
            self.sums.add(acc, unit, [next(it) if p.requires_grad else None for p in params])
            gin = list(grads[:len(ins)])
            del grads, it
        n = 1 + len(rec.leaves)
        add_grads(arg_grads[a], call, gin[1:n])
        for (key, _), gt in zip(rec.side_in, gin[n:]):
            self._streams.add_grad(a, key, gt)
        gx = gin[0]
        return gx if gx is not None else torch.zeros_like(x)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, ids, am, labels, loss_fn=None, data=None) -> Tuple[HeadOut, int]:
        """The head's :class:`.HeadOut` (the token loss sum; a sequence objective's loss and
        metrics, with ``data`` its ``objective_data``) and the target tokens of one batch,
        without gradients."""
        shift = F.pad(labels[:, 1:], (0, 1), value=-100)
        n_tokens = int((shift != -100).sum())
        self.meter.saved = 0
        packed_attention(self.model, [(ids, am, labels)])   # long packed rows: attention per document
        with self._outer_only():
            hidden = self._base_forward(ids, am)
            return self.loss_head.loss(hidden, shift, loss_fn, None, data=data), n_tokens

    def logits(self, ids, am) -> torch.Tensor:
        """Logits [batch, seq, vocab] (fp32, CPU) of one batch, without gradients."""
        with self._outer_only():
            return self.loss_head.all_logits(self._base_forward(ids, am))

    @contextlib.contextmanager
    def _outer_only(self):
        """No gradients; the embedding and the head bound through the block, the layers run by
        their proxies as the model calls them."""
        self._start(self.schedule(False), None)
        try:
            with torch.no_grad():
                self._bind_outer(requires_grad=False)
                yield
                self._release_outer(self.head)
                self._release_outer(self.embed)
        except BaseException:
            self._abort()
            raise
        finally:
            self.meter.now = 0


class Steps:
    """A training step through the engine's parts: the layout of its micro-batches, each group
    through the :class:`StepRunner` between the update scheduler's begin / finish / end, and
    the telemetry. ``clip_hold_disk``: whether ``clip_hold="auto"`` means the disk tier (the
    planner's ``placement["gradients"]``: the host budget cannot hold them)."""

    def __init__(self, runner: StepRunner, boundary: BoundaryStore, *, updates, pager, counters, config,
                 layer_names: List[str], clip_hold_disk: bool):
        self.runner, self.boundary = runner, boundary
        self.updates, self.pager, self.counters, self.config = updates, pager, counters, config
        self.layer_names, self.clip_hold_disk = layer_names, clip_hold_disk
        self.last_plan: Optional[WindowPlan] = None
        self.boundary_peak = {"device": 0, "host": 0, "disk": 0}   # over all windows, per tier
        #: The order the pending updates were queued in: head last (StepRunner.head_late), or
        #: first. The next forward acquires its units in that order (a mismatch is only slower).
        self._pending_late = False

    def hold(self) -> str:
        """Where final gradients wait for the clipping norm ("host" | "disk")."""
        hold = self.config.clip_hold
        if hold == "auto":
            hold = "disk" if self.clip_hold_disk else "host"
        return hold

    def run(self, batches, wp: Optional[WindowPlan], loss_fn, num_items_in_batch, step_lr, max_grad_norm,
            data: Optional[list] = None):
        """``(mean token loss, target tokens, grad norm, skipped, each micro-batch's HeadOut)`` of
        the prepared micro-batches ``batches`` laid out by ``wp`` (None: a single batch -- one
        micro-batch, as it always ran); ``data``: each micro-batch's ``objective_data``, in the
        same order (None: none), which goes through the step with its micro-batch."""
        t0 = time.perf_counter()
        if data is not None and len(data) != len(batches):
            raise ValueError(f"{len(data)} objective_data for {len(batches)} micro-batches: each micro-batch "
                             "carries its own (None where it has none).")
        window = wp is not None
        if not num_items_in_batch:
            num_items_in_batch = sum(int((lab[:, 1:] != -100).sum()) for _, _, lab in batches)
        denom = max(num_items_in_batch, 1)
        if window:
            self.last_plan = wp
        else:
            wp = _single_plan(self.runner.checkpoint_interval)
        loss_sum, n, norm, skipped, heads = 0.0, 0, None, False, []
        boundary_peak = {"device": 0, "host": 0, "disk": 0}
        disk_ops: dict = {}
        for g0 in range(0, len(batches), wp.group_size):
            group = batches[g0:g0 + wp.group_size]
            last = g0 + wp.group_size >= len(batches)
            step = self.updates.context(step_lr if last else None, max_grad_norm if last else None, self.hold())
            self.updates.begin(step)
            late_forward = self._order_updates(step)
            try:
                part, cnt, tokens, got = self.runner.run(
                    group, loss_fn=loss_fn, step=step, denom=denom, tier=wp.tier, k=wp.checkpoint_interval,
                    data=data[g0:g0 + wp.group_size] if data is not None else None, head_late=late_forward)
                heads += got
                self.pager.wait_grads()
                # The finiteness check sees the whole window's loss (every group's so far): the
                # mean token loss, or what a sequence objective back-propagates
                objective = [h.objective_loss for h in heads if h.objective_loss is not None]
                checked = sum(objective) if objective else (loss_sum + part) / max(n + cnt, 1)
                norm, skipped = self.updates.finish(step, checked)
            except finite.NonFiniteError:
                self.updates.reported()  # reported now, to this caller
                raise
            finally:
                self.updates.end()
            loss_sum, n = loss_sum + part, n + cnt
            for t in boundary_peak:
                boundary_peak[t] = max(boundary_peak[t], self.boundary.peak[t])
            for op, v in self.boundary.disk_ops.items():
                disk_ops[op] = disk_ops.get(op, 0) + v
            self.counters.add_tokens(tokens, len(group))
        if window:
            self.boundary_peak = {t: max(v, self.boundary_peak[t]) for t, v in boundary_peak.items()}
        if step_lr is not None:
            self.counters.add("steps", 1)
            extra = dict(groups=None)
            if window:
                extra = dict(groups=wp.groups, group_size=wp.group_size, boundary_tier=wp.tier,
                             boundary_bytes=boundary_peak, boundary_disk_ops=disk_ops,
                             checkpoint_interval=wp.checkpoint_interval)
            self.counters.close_step(list(self.layer_names), **extra)
        self.counters.add("micro_batches", len(batches))
        self.counters.add("step_seconds", time.perf_counter() - t0)
        return loss_sum / max(n, 1), n, norm, skipped, heads

    def _order_updates(self, step: StepContext) -> bool:
        """Whether this micro-batch's forward binds the head last: the order the pending updates
        were queued in (head last only once the runner learned the model allows it). A micro-batch
        that updates queues its own in the order the next forward will take (the updates' order
        when they wait for the norm: the next forward's)."""
        late = self._pending_late
        self._pending_late = bool(self.runner.head_late)
        if step.updates:
            units = self.updates.units
            self.updates.update_order = head_late_order(units) if self._pending_late else forward_order(units)
        return late

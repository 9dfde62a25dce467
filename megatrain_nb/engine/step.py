"""StepRunner: one micro-batch through the model — streamed forward, chunked head + loss,
per-layer backward from saved layer inputs (or block checkpoints), embedding backward.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .discovery import locate
from .proxies import HiddenStatesStub, bind, swapped_submodule, unbind
from .units import Unit, forward_order
from .updates import StepContext


@dataclass
class _Call:
    """How the model's forward called a layer, to re-run it with another hidden state."""
    args: tuple
    kwargs: dict
    positional: bool

    def with_hidden(self, h):
        if self.positional:
            return (h,) + self.args[1:], self.kwargs
        kw = dict(self.kwargs)
        kw["hidden_states"] = h
        return self.args, kw


@dataclass
class _StepContext:
    train: bool
    k: int
    calls: Dict[int, _Call] = field(default_factory=dict)
    saved: Dict[int, torch.Tensor] = field(default_factory=dict)
    rng: Dict[int, Any] = field(default_factory=dict)
    h0: Optional[torch.Tensor] = None
    h_last: Optional[torch.Tensor] = None
    saved_bytes: int = 0
    kept: Dict[int, tuple] = field(default_factory=dict)   # k == 0: (input, output, params) per layer
    extras: set = field(default_factory=set)   # ids of the last layer output's tensors besides the hidden state


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _replace_first(out, h):
    if isinstance(out, tuple):
        return (h,) + tuple(out[1:])
    if isinstance(out, list):
        return [h] + list(out[1:])
    return h


class StepRunner:
    """Runs micro-batches through ``model``. Collaborators: ``units`` (embedding first, head
    last), the ``pager`` (device slots), the meta ``placeholders`` parameters go back to after
    each use, and ``plan_reads(compute_order, step)`` (the update scheduler's disk read-ahead)."""

    def __init__(self, model, units: List[Unit], pager, placeholders, *, device: torch.device,
                 checkpoint_interval: int, loss_chunk_tokens: int,
                 plan_reads: Callable[[List[Unit], Optional[StepContext]], None]):
        self.model = model
        self.units = units
        self.embed, self.head, self.layers = units[0], units[-1], units[1:-1]
        self.pager = pager
        self.placeholders = placeholders
        self.device = device
        self.checkpoint_interval = checkpoint_interval
        self.loss_chunk_tokens = loss_chunk_tokens
        self.plan_reads = plan_reads
        self.base_name, self.base, path = locate(model)   # before the layer proxies go in
        self._head_stub = HiddenStatesStub(self.base, path)
        self.ctx: Optional[_StepContext] = None
        self.activation_peak = 0
        self.activation_now = 0
        self._slot_ptrs = None
        #: When set, the layer proxies hand their calls to it instead (window.WindowRunner's
        #: capture and replay passes of the model's own forward).
        self.intercept: Optional[Callable] = None

    # ------------------------------------------------------------------ schedule
    def schedule(self, train: bool, k: Optional[int] = None) -> List[Unit]:
        """The units' compute order; ``k``: the checkpoint interval (default the runner's)."""
        layers = self.layers
        order = forward_order(self.units)
        k = self.checkpoint_interval if k is None else k
        if train and k > 0:
            n = len(layers)
            for b in reversed(range(0, n, k)):
                end = min(b + k, n)
                order += layers[b:end - 1]                 # recompute the block's forward
                order += list(reversed(layers[b:end]))     # then its backward
        return [u for u in order if u.numel > 0]

    # ------------------------------------------------------------------ the model's own forward
    def _base_forward(self, ids, am) -> torch.Tensor:
        """The base model's own forward (layers streamed by the proxies): final hidden states."""
        out = self.base(input_ids=ids, attention_mask=am, use_cache=False)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def _head_logits(self, hidden_chunk: torch.Tensor) -> torch.Tensor:
        """The CausalLM's own head code (lm_head + the family's logit transform) on one chunk."""
        stub = self._head_stub
        stub.hidden = hidden_chunk
        dummy = torch.zeros(hidden_chunk.shape[:2], dtype=torch.long, device=hidden_chunk.device)
        try:
            with swapped_submodule(self.model, self.base_name, stub):
                out = self.model(input_ids=dummy, use_cache=False)
        except IndexError as e:   # the head indexes outputs of the base model the stub does not have
            raise NotImplementedError(
                f"{type(self.model).__name__}'s head reads more of its base model's output than the final hidden "
                f"states ({e}); this family is not supported by the streaming engine yet.") from e
        finally:
            stub.hidden = None
        return out.logits

    def _bind_outer(self, requires_grad: bool):
        bound = {}
        for u in (self.embed, self.head):
            if u.numel == 0:
                bound[u.index] = []
                continue
            w = self.pager.acquire(u)
            bound[u.index] = bind(u, w, requires_grad=requires_grad)
        return bound

    def _release_outer(self, u: Unit):
        if u.numel:
            unbind(u, self.placeholders)
            self.pager.release(u)

    # ------------------------------------------------------------------ layer calls from the proxies
    def layer_call(self, unit: Unit, args, kwargs):
        if self.intercept is not None:
            return self.intercept(unit, args, kwargs)
        ctx = self.ctx
        if args:
            hidden, call = args[0], _Call(args, kwargs, True)
        else:
            hidden, call = kwargs["hidden_states"], _Call(args, kwargs, False)
        li = unit.layer_index
        if ctx is not None and ctx.train:
            if li in ctx.calls or li in ctx.kept:
                raise NotImplementedError(
                    f"{type(self.model).__name__} calls its layer {li} more than once in one forward (a looped or "
                    "shared layer); this family is not supported by the streaming engine yet.")
            for v in list(kwargs.values()) + list(args[1:]):
                if torch.is_tensor(v) and v.requires_grad:
                    raise NotImplementedError(
                        f"{type(unit.module).__name__} receives a tensor argument that needs gradients besides "
                        "the hidden states; this family is not supported by the streaming engine yet.")
                if torch.is_tensor(v) and id(v) in ctx.extras:
                    raise NotImplementedError(
                        f"{type(unit.module).__name__} receives another output of the layer before it besides the "
                        "hidden states (a second stream between layers); this family is not supported by the "
                        "streaming engine yet.")
            if li == 0:
                ctx.h0 = hidden
            hidden = hidden.detach()
            if ctx.k == 0:
                return self._layer_forward_kept(unit, call, hidden)
            ctx.calls[li] = call
            if li % ctx.k == 0:
                ctx.saved[li] = hidden
                ctx.saved_bytes += hidden.numel() * hidden.element_size()
                self._note_activation(ctx.saved_bytes)
            if self.model.training:
                ctx.rng[li] = self._rng_state()
        out = self._run_layer_nograd(unit, call, hidden)
        if ctx is not None and ctx.train and isinstance(out, (tuple, list)):
            ctx.extras = {id(v) for v in out[1:] if torch.is_tensor(v) and v.is_floating_point()}
        if ctx is not None and ctx.train and li == len(self.layers) - 1:
            h = _first(out).detach().requires_grad_(True)
            ctx.h_last = h
            out = _replace_first(out, h)
        return out

    def _layer_forward_kept(self, unit: Unit, call: _Call, hidden):
        """checkpoint_interval=0: run the layer under autograd and keep its graph (and its
        weights in their slot) until the backward: no recompute, one load per step."""
        ctx = self.ctx
        w = self.pager.acquire(unit)
        params = bind(unit, w, requires_grad=True)
        try:
            x = hidden.requires_grad_(True)
            a, kw = call.with_hidden(x)
            with torch.enable_grad(), self._count_saved(accumulate=True):
                out = unit.module(*a, **kw)
        finally:
            unbind(unit, self.placeholders)
        h = _first(out)
        ctx.kept[unit.layer_index] = (x, h, params)
        h_out = h.detach()
        if unit.layer_index == len(self.layers) - 1:
            h_out.requires_grad_(True)
            ctx.h_last = h_out
        return _replace_first(out, h_out)

    def _run_layer_nograd(self, unit: Unit, call: _Call, hidden):
        w = self.pager.acquire(unit)
        bind(unit, w, requires_grad=False)
        try:
            a, kw = call.with_hidden(hidden)
            with torch.no_grad():
                out = unit.module(*a, **kw)
        finally:
            unbind(unit, self.placeholders)
            self.pager.release(unit)
        return out

    def _layer_backward(self, unit: Unit, inp: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        w = self.pager.acquire(unit)
        params = bind(unit, w, requires_grad=True)
        try:
            x = inp.detach().requires_grad_(True)
            a, kw = ctx.calls[unit.layer_index].with_hidden(x)
            rng = ctx.rng.get(unit.layer_index)
            with self._restored_rng(rng), torch.enable_grad(), self._count_saved():
                h = _first(unit.module(*a, **kw))
            grads = torch.autograd.grad(h, [x] + params, grad_out, allow_unused=True)
        finally:
            unbind(unit, self.placeholders)
        pgrads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads[1:], params)]
        self.pager.return_grads(unit, pgrads)
        self.pager.release(unit)
        return grads[0] if grads[0] is not None else torch.zeros_like(inp)

    # ------------------------------------------------------------------ one micro-batch
    def run(self, ids, am, labels, *, loss_fn=None, step: Optional[StepContext] = None,
            grad_scale_tokens=None) -> Tuple[float, int]:
        """One micro-batch: with ``step`` (training) forward and backward, gradients to the
        pager's gradient thread; without, the loss only."""
        train = step is not None
        shift = F.pad(labels[:, 1:], (0, 1), value=-100)
        n_tokens = int((shift != -100).sum())
        denom = grad_scale_tokens if grad_scale_tokens else max(n_tokens, 1)
        self.ctx = _StepContext(train=train, k=self.checkpoint_interval)
        self.activation_now = 0
        order = self.schedule(train)
        self.plan_reads(order, step)  # set first: the pager starts fetching at once
        self.pager.set_schedule(order)
        try:
            with contextlib.ExitStack() as stack:
                if not train:
                    stack.enter_context(torch.no_grad())
                bound = self._bind_outer(requires_grad=train)
                hidden = self._base_forward(ids, am)
                if not train:
                    loss_sum = self._loss_chunks(hidden, shift, loss_fn, None)
                    self._release_outer(self.head)
                    self._release_outer(self.embed)
                    return loss_sum, n_tokens
                hidden_leaf = hidden.detach()
                loss_sum, grad_hidden = self._loss_chunks(hidden_leaf, shift, loss_fn, denom, backward=True)
                torch.autograd.backward(hidden, grad_hidden)
                del hidden, grad_hidden, hidden_leaf
                self._return_outer_grads(self.head, bound)
                self._release_outer(self.head)
                g = self.ctx.h_last.grad
                self.ctx.h_last = None
                g = self._layers_backward(g)
                if self.ctx.h0 is not None and self.ctx.h0.requires_grad:
                    torch.autograd.backward(self.ctx.h0, g)
                self._return_outer_grads(self.embed, bound)
                self._release_outer(self.embed)
                return loss_sum, n_tokens
        except BaseException:
            for u in (self.embed, self.head):
                unbind(u, self.placeholders)
            for u in self.layers:
                unbind(u, self.placeholders)
            self.pager.reset()
            raise
        finally:
            self.ctx = None
            self.activation_now = 0

    def _return_outer_grads(self, unit: Unit, bound):
        if unit.numel == 0:
            return
        tensors = bound[unit.index]
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors]
        self.pager.return_grads(unit, grads)

    def _layers_backward(self, g: torch.Tensor) -> torch.Tensor:
        layers, ctx = self.layers, self.ctx
        n, k = len(layers), ctx.k
        if k == 0:
            for unit in reversed(layers):
                x, h, params = ctx.kept.pop(unit.layer_index)
                grads = torch.autograd.grad(h, [x] + params, g, allow_unused=True)
                pgrads = [gr if gr is not None else torch.zeros_like(p) for gr, p in zip(grads[1:], params)]
                self.pager.return_grads(unit, pgrads)
                self.pager.release(unit)
                g = grads[0] if grads[0] is not None else torch.zeros_like(x)
                del x, h, params, grads
            return g
        for b in reversed(range(0, n, k)):
            end = min(b + k, n)
            inputs = {b: ctx.saved.pop(b)}
            block_bytes = 0
            for i in range(b, end - 1):
                rng = ctx.rng.get(i)
                with self._restored_rng(rng):
                    inputs[i + 1] = _first(self._run_layer_nograd(layers[i], ctx.calls[i], inputs[i]))
                block_bytes += inputs[i + 1].numel() * inputs[i + 1].element_size()
                self._note_activation(ctx.saved_bytes + block_bytes)
            for i in reversed(range(b, end)):
                g = self._layer_backward(layers[i], inputs.pop(i), g)
            ctx.saved_bytes -= g.numel() * g.element_size()
        return g

    def _loss_chunks(self, hidden, shift, loss_fn, denom, backward: bool = False):
        B, S = shift.shape
        chunk = max(1, min(S, self.loss_chunk_tokens // max(B, 1) or 1))
        total = 0.0
        grads = []
        for s in range(0, S, chunk):
            lab = shift[:, s:s + chunk]
            hc = hidden[:, s:s + chunk]
            if backward:
                hc = hc.detach().requires_grad_(True)
            with torch.enable_grad() if backward else contextlib.nullcontext():
                logits = self._head_logits(hc).float()
                if loss_fn is not None:
                    part = loss_fn(logits, lab)
                else:
                    part = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1),
                                           ignore_index=-100, reduction="sum")
                self._note_activation(self.ctx.saved_bytes + 3 * logits.numel() * 4)
            total += float(part.detach())
            if backward:
                if part.requires_grad:
                    (part / denom).backward()
                grads.append(hc.grad if hc.grad is not None else torch.zeros_like(hc))
            del logits, part
        if backward:
            return total, torch.cat(grads, dim=1)
        return total

    def logits(self, ids, am) -> torch.Tensor:
        self.ctx = None
        order = self.schedule(False)
        self.plan_reads(order, None)
        self.pager.set_schedule(order)
        try:
            with torch.no_grad():
                self._bind_outer(requires_grad=False)
                hidden = self._base_forward(ids, am)
                chunk = max(1, self.loss_chunk_tokens // max(ids.shape[0], 1))
                out = [self._head_logits(hidden[:, s:s + chunk]).float().cpu()
                       for s in range(0, hidden.shape[1], chunk)]
                self._release_outer(self.head)
                self._release_outer(self.embed)
            return torch.cat(out, dim=1)
        except BaseException:
            for u in self.units:
                unbind(u, self.placeholders)
            self.pager.reset()
            raise

    # ------------------------------------------------------------------ accounting and RNG
    def _note_activation(self, nbytes: int) -> None:
        self.activation_now = nbytes
        self.activation_peak = max(self.activation_peak, nbytes)

    @contextlib.contextmanager
    def _count_saved(self, accumulate: bool = False):
        """Count the bytes autograd saves while one layer is re-run (weights in slots excluded)."""
        ctx = self.ctx
        if self._slot_ptrs is None:
            self._slot_ptrs = {s.buf.untyped_storage().data_ptr()
                               for pool in self.pager.pools.values() for s in pool}
        total = [0]
        seen = set()

        def pack(t):
            try:
                ptr = t.untyped_storage().data_ptr()
            except Exception:
                return t
            if ptr not in self._slot_ptrs and ptr not in seen:
                seen.add(ptr)
                total[0] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        if accumulate:  # graphs kept for the backward (checkpoint_interval=0)
            ctx.saved_bytes += total[0]
            self._note_activation(ctx.saved_bytes)
        else:  # saved tensors + their gradients flowing back, on top of the saved inputs
            self._note_activation(ctx.saved_bytes + 2 * total[0])

    def _rng_state(self):
        st = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            st["cuda"] = torch.cuda.get_rng_state(self.device)
        return st

    @contextlib.contextmanager
    def _restored_rng(self, st):
        if st is None:
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(st["cpu"])
            if "cuda" in st:
                torch.cuda.set_rng_state(st["cuda"], self.device)
            yield

"""How the model's forward called a layer, recorded to call it again (engine/step.py).

A :class:`LayerCall` keeps every argument of one layer call but the hidden state. Some models
pass a layer more than masks and rotary tables: tensors computed from trainable weights before
the layers (per-layer embeddings, the embedding output itself, a position bias). Hugging Face
autograd sends those tensors' gradients back through the arguments into the pre-layer graph;
so does the engine. The recorded call holds such a tensor detached (the step holds no graph),
and remembers where it sits (its *path* in the arguments) and which tensor of the forward it
was (its *key*: the layer and path where the model first passed that very tensor, so a tensor
the model hands to every layer is one key). A layer's backward makes each of them a leaf and
returns its gradient; the step sums the gradients per key and back-propagates them with the
embedding's (the model's own forward run again, its layer calls recorded with their graph).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

Path = Tuple[Any, ...]


class NotRun:
    """Stands for output ``item`` (after the hidden state) of layer ``layer`` in the capture and
    replay passes, where the layers do not run. A later layer receiving it gets the real output
    when it runs (a :class:`SideStreams` value)."""

    def __init__(self, layer: int, item: int):
        self.layer, self.item = layer, item

    def __repr__(self):
        return f"<output {self.item + 1} of layer {self.layer}, which did not run>"


def _tensors(obj, path: Path = (), kind=torch.Tensor):
    """(path, item) of every ``kind`` (tensors) in nested tuples, lists and mappings."""
    if isinstance(obj, kind):
        yield path, obj
    elif isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            yield from _tensors(x, path + (i,), kind)
    elif isinstance(obj, Mapping):
        for k, x in obj.items():
            yield from _tensors(x, path + (k,), kind)


def replaced(obj, path: Path, value):
    """``obj`` with the item at ``path`` replaced by ``value`` (containers copied on the way)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        out = dict(obj)
        out[head] = replaced(obj[head], rest, value)
        return out
    items = list(obj)
    items[head] = replaced(items[head], rest, value)
    if isinstance(obj, list):
        return items
    return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)   # a namedtuple, a tuple


def _at(obj, path: Path):
    for p in path:
        obj = obj[p]
    return obj


class GradKeys:
    """One forward's keys of the layer arguments that need gradients: a tensor gets the key of
    the first (layer, path) it was passed at. Holds the tensors until :meth:`close` (so their
    ids are not reused while the forward runs)."""

    def __init__(self):
        self._by_id: Dict[int, Tuple[int, Path]] = {}
        self._held: List[torch.Tensor] = []

    def key(self, layer: int, path: Path, t: torch.Tensor) -> Tuple[int, Path]:
        k = self._by_id.get(id(t))
        if k is None:
            k = self._by_id[id(t)] = (layer, path)
            self._held.append(t)
        return k

    def close(self) -> None:
        self._by_id.clear()
        self._held.clear()


@dataclass
class LayerCall:
    """How the model's forward called a layer (all but the hidden state), to call it again with
    another hidden state. ``grad_paths``/``grad_keys``: where the arguments that need gradients
    sit and their keys (:class:`GradKeys`); ``graph``: those tensors with their autograd graph
    (only when recorded with ``keep_graph``: the embedding's backward)."""
    args: tuple
    kwargs: dict
    positional: bool
    grad_paths: List[Path] = field(default_factory=list)
    grad_keys: List[Tuple[int, Path]] = field(default_factory=list)
    graph: List[torch.Tensor] = field(default_factory=list)
    links: List[Tuple[Path, int, int]] = field(default_factory=list)   # (path, layer, item) of NotRun args

    @classmethod
    def captured(cls, args, kwargs, layer: int = -1, keys: Optional[GradKeys] = None,
                 keep_graph: bool = False) -> "LayerCall":
        if args:   # the hidden state itself is not kept (with_hidden puts each one in)
            call = cls((None,) + tuple(args[1:]), kwargs, True)
        else:
            call = cls(args, {k: v for k, v in kwargs.items() if k != "hidden_states"}, False)
        rest = (call.args, call.kwargs)
        call.links = [(path, x.layer, x.item) for path, x in _tensors(rest, kind=NotRun)]
        if keys is None or not torch.is_grad_enabled():
            return call
        for path, t in list(_tensors(rest)):
            if t.requires_grad:
                call.grad_paths.append(path)
                call.grad_keys.append(keys.key(layer, path, t))
                if keep_graph:
                    call.graph.append(t)
                rest = replaced(rest, path, t.detach())
        call.args, call.kwargs = rest
        return call

    def with_hidden(self, h, side: Optional[dict] = None):
        """(args, kwargs) with hidden state ``h``; ``side``: the earlier layers' outputs (by
        (layer, item)) that the call's :class:`NotRun` arguments stand for."""
        args, kwargs = self.args, self.kwargs
        if self.links:
            rest = (args, kwargs)
            for path, j, item in self.links:
                rest = replaced(rest, path, side[(j, item)])
            args, kwargs = rest
        if self.positional:
            return (h,) + args[1:], kwargs
        kw = dict(kwargs)
        kw["hidden_states"] = h
        return args, kw

    def with_leaves(self, h, side: Optional[dict] = None) -> Tuple[tuple, dict, List[torch.Tensor]]:
        """:meth:`with_hidden`, and every argument that needs gradients a fresh leaf (returned
        third, in ``grad_paths`` order)."""
        rest = (self.args, self.kwargs)
        leaves = []
        for path in self.grad_paths:
            leaf = _at(rest, path).detach().requires_grad_(True)
            leaves.append(leaf)
            rest = replaced(rest, path, leaf)
        a, kw = LayerCall(rest[0], rest[1], self.positional, links=self.links).with_hidden(h, side)
        return a, kw, leaves


def add_grads(sums: Dict[Tuple[int, Path], torch.Tensor], call: LayerCall, grads) -> None:
    """Add a layer call's argument gradients (``grad_paths`` order) into ``sums`` by key."""
    for key, g in zip(call.grad_keys, grads):
        if g is not None:
            sums[key] = g if key not in sums else sums[key] + g


def graph_roots(calls: Dict[int, LayerCall], sums: Dict[Tuple[int, Path], torch.Tensor]):
    """(tensors, gradients) to back-propagate into the pre-layer graph: each key's tensor (from
    calls recorded with their graph) with its summed gradient."""
    roots, grads, seen = [], [], set()
    for call in calls.values():
        for key, t in zip(call.grad_keys, call.graph):
            if key in seen or key not in sums:
                continue
            seen.add(key)
            roots.append(t)
            grads.append(sums[key])
    if len(seen) != len(sums):
        raise RuntimeError("the model passed its layers different tensors needing gradients in two runs of its "
                           f"forward ({sorted(set(sums) - seen)[:3]}); the engine cannot back-propagate them")
    return roots, grads


@dataclass
class GradRecord:
    """What one layer call with gradients made besides its output hidden state: the leaves of
    its arguments that need gradients (``grad_paths`` order), the leaves of the float
    :class:`SideStreams` values it took and its own side outputs later layers take (each as
    ((layer, item), tensor))."""
    leaves: List[torch.Tensor] = field(default_factory=list)
    side_in: List[Tuple[Tuple[int, int], torch.Tensor]] = field(default_factory=list)
    side_out: List[Tuple[Tuple[int, int], torch.Tensor]] = field(default_factory=list)


class SideStreams:
    """The outputs of layers besides the hidden state that the model passes to later layers
    (``prev_topk_indices``: one layer's selected key indices reused by the next; a router's
    states carried to the next layer's router), in one layer-major group: per micro-batch the
    values alive now (``live``, detached), at each block start of the forward the values the
    block's layers take from before it, for its backward, and the gradients that later layers'
    backward sent to float values (``grads``), taken by the backward of the layer that made them."""

    def __init__(self, calls: List[Dict[int, "LayerCall"]]):
        self.last_use: Dict[Tuple[int, int], int] = {}
        for i, call in (calls[0].items() if calls else ()):
            for _, j, item in call.links:
                self.last_use[(j, item)] = max(i, self.last_use.get((j, item), -1))
        self.live: List[dict] = [{} for _ in calls]
        self.grads: List[dict] = [{} for _ in calls]
        self._saved: Dict[Tuple[int, int], dict] = {}

    def learn(self, layer: int, out, live: dict, rec: Optional[GradRecord]) -> None:
        """Keep the items of ``layer``'s output that later layers take (detached; with ``rec``
        also as they are, with their graph, for this layer's backward)."""
        if not self.last_use or not isinstance(out, (tuple, list)):
            return
        for item, v in enumerate(out[1:]):
            if (layer, item) not in self.last_use:
                continue
            live[(layer, item)] = v.detach() if torch.is_tensor(v) else v
            if rec is not None and torch.is_tensor(v) and v.requires_grad:
                rec.side_out.append(((layer, item), v))

    def leaves(self, call: "LayerCall", live: dict, rec: GradRecord) -> dict:
        """``live`` with the float values ``call`` takes made leaves (into ``rec.side_in``)."""
        out = dict(live)
        for _, j, item in call.links:
            v = live.get((j, item))
            if torch.is_tensor(v) and v.is_floating_point() and all(k != (j, item) for k, _ in rec.side_in):
                leaf = v.detach().requires_grad_(True)
                rec.side_in.append(((j, item), leaf))
                out[(j, item)] = leaf
        return out

    def add_grad(self, a: int, key: Tuple[int, int], g: Optional[torch.Tensor]) -> None:
        if g is not None:
            d = self.grads[a]
            d[key] = g if key not in d else d[key] + g

    def block_start(self, b: int, a: int) -> None:
        """The forward reaches the block starting at layer ``b``: keep what its layers take from before ``b``;
        drop what no layer from ``b`` on takes."""
        live = self.live[a]
        for key in [k for k, last in self.last_use.items() if last < b and k in live]:
            del live[key]
        if self.last_use:
            self._saved[(b, a)] = {k: v for k, v in live.items() if k[0] < b and self.last_use[k] >= b}

    def block_backward(self, b: int, a: int) -> dict:
        """The values block ``b``'s backward starts from (its recompute adds the rest)."""
        self.live[a] = self._saved.pop((b, a), {})
        return self.live[a]

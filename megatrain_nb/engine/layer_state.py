"""State a layer stores into an argument it shares with other layers (engine/step.py).

Some models hand every layer one mutable container (a dict of shared key/value states): a
layer stores tensors into it and a later layer reads them. Layer-major, the layers run one at a
time and again in the backward, so :class:`SharedState` makes every call of a layer after the
first see what the first (the forward) found there, and carries the gradients: a reading call
with gradients takes those tensors as leaves (their gradients go to the micro-batch's
:class:`~.layer_calls.SideStreams` by key), and the storing call's backward takes the tensors it
stored (with their graph) as outputs, with the gradients the readers sent. A key is (the
container's id, its key there, the path inside an immutable value such as a (key, value) tuple).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Dict, List, Optional

import torch

from .layer_calls import GradRecord, LayerCall, replaced


def _containers(obj, out: List, seen: set) -> List:
    """The mutable containers (mappings, lists) among nested arguments, each once."""
    if isinstance(obj, (Mapping, list)):
        if id(obj) in seen:
            return out
        seen.add(id(obj))
        out.append(obj)
        for v in (obj.values() if isinstance(obj, Mapping) else obj):
            _containers(v, out, seen)
    elif isinstance(obj, tuple):
        for v in obj:
            _containers(v, out, seen)
    return out


def _in_tuples(obj, path=()):
    if torch.is_tensor(obj):
        yield path, obj
    elif isinstance(obj, tuple):
        for i, x in enumerate(obj):
            yield from _in_tuples(x, path + (i,))


def _entries(container):
    """(key, tensor) of every tensor stored in ``container`` (through tuples in it)."""
    items = container.items() if isinstance(container, Mapping) else enumerate(container)
    for k, v in list(items):
        for path, t in _in_tuples(v):
            yield ("state", id(container), k, path), t


class SharedState:
    """One layer-major group's state stored in shared layer arguments (see the module)."""

    def __init__(self):
        self.written: set = set()             # keys some layer stored into
        self._reads: Dict[int, dict] = {}     # id(call) -> {key: tensor} its forward found
        self._by_id: Dict[int, object] = {}   # id(container) -> container

    def _put(self, key, value) -> None:
        _, cid, k, path = key
        c = self._by_id[cid]
        c[k] = replaced(c[k], path, value)

    def before(self, call: LayerCall, rec: Optional[GradRecord]) -> Optional[dict]:
        """Before a call: the state its forward found put back (as leaves into ``rec`` when it
        takes gradients); returns what the containers hold now ({key: id}), or None."""
        conts = _containers((call.args, call.kwargs), [], set())
        if not conts:
            return None
        for c in conts:
            self._by_id[id(c)] = c
        reads = self._reads.get(id(call))
        if reads is None:
            reads = self._reads[id(call)] = {key: t for c in conts for key, t in _entries(c) if key in self.written}
        for key, t in reads.items():
            if rec is not None and t.is_floating_point():
                t = t.detach().requires_grad_(True)
                rec.side_in.append((key, t))
            self._put(key, t)
        return {key: id(t) for c in conts for key, t in _entries(c)}

    def after(self, call: LayerCall, rec: Optional[GradRecord], before: dict) -> None:
        """After a call: what it stored is state (not what it reads); stored with a graph, an
        output of its backward (``rec``), left in the container detached."""
        reads = self._reads[id(call)]
        for c in _containers((call.args, call.kwargs), [], set()):
            for key, t in _entries(c):
                if before.get(key) == id(t):
                    continue
                self.written.add(key)
                reads.pop(key, None)
                if t.grad_fn is not None:
                    if rec is not None:
                        rec.side_out.append((key, t))
                    self._put(key, t.detach())

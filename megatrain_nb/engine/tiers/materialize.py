"""Fill the engine's store unit by unit: from a live model, by the model's own init for a
meta-device model, or from a safetensors folder — never the whole model in RAM at once.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from .disk_format import aligned_empty
from .io import shard_files
from ..units import Unit


def is_meta_model(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _unit_modules(model: nn.Module, unit: Unit, layer_modules) -> list:
    """Modules whose own parameters belong to this unit (for init)."""
    if unit.kind == "layer":
        return list(unit.module.modules())
    owners = []
    for p in unit.params:
        for mod, _ in p.bindings:
            if not any(mod is o for o in owners):
                owners.append(mod)
    return owners


def init_unit(model: nn.Module, unit: Unit, layer_modules) -> Dict[str, torch.Tensor]:
    """Materialise a unit's parameters on the CPU and run the model's own weight init on them."""
    values: Dict[str, torch.Tensor] = {}
    mods = _unit_modules(model, unit, layer_modules)
    saved = []
    for m in mods:
        for attr, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                saved.append((m, attr, p))
                m._parameters[attr] = nn.Parameter(aligned_empty(p.shape),   # (own mapping: no heap left behind)
                                                   requires_grad=p.requires_grad)
    # Tied weights: every binding of one entry must see the same tensor during init.
    for p in unit.params:
        first_mod, first_attr = p.bindings[0]
        t = first_mod._parameters[first_attr]
        for m, a in p.bindings[1:]:
            if m._parameters.get(a) is not None and m._parameters[a].is_meta:
                saved.append((m, a, m._parameters[a]))
            m._parameters[a] = t
    with torch.no_grad():
        for m in mods:
            model._init_weights(m)
    for p in unit.params:
        m, a = p.bindings[0]
        values[p.name] = m._parameters[a].detach()
    for m, a, orig in saved:
        m._parameters[a] = orig
    return values


def materialize_buffers(model: nn.Module, extra_modules) -> None:
    """Meta buffers (rotary inv_freq, ...) recomputed by the model's own init."""
    for m in list(model.modules()) + list(extra_modules):
        metas = [n for n, b in m._buffers.items() if b is not None and b.is_meta]
        if not metas:
            continue
        for n in metas:
            b = m._buffers[n]
            m._buffers[n] = torch.zeros(b.shape, dtype=b.dtype)
        with torch.no_grad():
            model._init_weights(m)
        orig = getattr(m, "original_inv_freq", None)
        if "inv_freq" in m._buffers and torch.is_tensor(orig) and orig.is_meta:
            m.original_inv_freq = m._buffers["inv_freq"].clone()


def take_parameters(model: nn.Module, units, alloc: Callable[[int], torch.Tensor],
                    put: Callable[[Unit, torch.Tensor], None], source=None) -> Dict[Tuple[int, str], nn.Parameter]:
    """Fill the store unit by unit (``alloc`` a flat buffer, ``put`` it); leave meta
    placeholders in the modules and return them by (id(module), attribute).

    Values come from the live model, from ``source`` (a safetensors folder), or — for a
    meta-device model — from the model's own weight init run on one unit at a time.
    """
    meta = is_meta_model(model)
    layer_modules = [u.module for u in units[1:-1]]
    placeholders: Dict[Tuple[int, str], nn.Parameter] = {}
    for u in units:
        if source is not None:
            values = source.unit_values(u)
        elif meta:
            values = init_unit(model, u, layer_modules)
        else:
            values = {p.name: p.bindings[0][0]._parameters[p.bindings[0][1]] for p in u.params}
        flat = alloc(u.numel)
        for p in u.params:
            flat[p.offset:p.offset + p.numel].copy_(values[p.name].detach().reshape(-1))
            ph = nn.Parameter(torch.empty(p.shape, device="meta", dtype=torch.float32))
            for m, a in p.bindings:
                m._parameters[a] = ph
                placeholders[(id(m), a)] = ph
        del values
        put(u, flat)
    if meta:
        materialize_buffers(model, layer_modules)
    return placeholders


class SafetensorsSource:
    """Reads one unit's tensors at a time from a (sharded) safetensors folder."""

    def __init__(self, folder, names: Optional[Callable[[list], Dict[str, str]]] = None):
        self.folder = folder
        self.files = shard_files(folder)
        #: a parameter's name -> its name in the folder, where they differ (transformers saves some
        #: families in an older layout: ``names(folder's keys)``, engine/vision.checkpoint_names)
        self.names: Dict[str, str] = names(list(self.files)) if names is not None else {}

    def unit_values(self, unit: Unit) -> Dict[str, torch.Tensor]:
        """One unit's tensors as fp32. Each shard is opened per unit and dropped right after,
        so its memory-mapped pages never accumulate in this process's RSS."""
        from safetensors import safe_open

        by_file: Dict[str, list] = {}
        for p in unit.params:
            f = self.files.get(self.names.get(p.name, p.name))
            if f is None:
                raise KeyError(f"{self.folder} has no tensor {p.name!r}: the folder does not match its config.")
            by_file.setdefault(f, []).append(p)
        out = {}
        for f, entries in by_file.items():
            with safe_open(f, "pt") as fh:
                for p in entries:
                    t = fh.get_tensor(self.names.get(p.name, p.name))
                    if tuple(t.shape) != tuple(p.shape):
                        raise ValueError(f"{p.name}: shape {tuple(t.shape)} in {self.folder}, {p.shape} in the config.")
                    out[p.name] = aligned_empty(t.shape).copy_(t)   # fp32, in a mapping of its own
        return out


def load_weights(engine, folder) -> None:
    """Read safetensors weights into the engine's master store, unit by unit (RAM or disk)."""
    source = SafetensorsSource(folder)
    for u in engine.units:
        values = source.unit_values(u)
        flat = aligned_empty(u.numel)
        for p in u.params:
            flat[p.offset:p.offset + p.numel].copy_(values[p.name].reshape(-1))
        engine.weights.overwrite(u, flat)

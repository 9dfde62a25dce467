"""Layer proxies and parameter binding.

A :class:`LayerProxy` takes a decoder layer's place in the model's layer list. The model's own
forward calls it exactly as it would call the layer (same arguments: masks chosen per layer
type, rotary embeddings, ...); the proxy hands the call to the engine, which runs the *real*
layer module with its streamed weights bound. Attribute reads the model's forward makes on a
layer (``attention_type``, ``layer_idx``, ...) fall through to the real layer, so per-layer
behaviour stays the model's own.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .units import Unit


class LayerProxy(nn.Module):
    def __init__(self, call, unit: Unit):
        super().__init__()
        # Plain attributes (not submodules) so model.named_parameters() keeps its names.
        # ``call(unit, args, kwargs)`` runs the real layer (the StepRunner's layer_call).
        object.__setattr__(self, "_mt_call", call)
        object.__setattr__(self, "_mt_unit", unit)

    def forward(self, *args, **kwargs):
        return self._mt_call(self._mt_unit, args, kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            unit = self.__dict__.get("_mt_unit")
            if unit is None:
                raise
            return getattr(unit.module, name)

    def extra_repr(self) -> str:
        return f"streams {type(self._mt_unit.module).__name__} {self._mt_unit.name}"


def bind(unit: Unit, flat: torch.Tensor, *, requires_grad: bool) -> List[torch.Tensor]:
    """Point every module attribute of the unit's parameters at views of ``flat``.

    Returns the bound tensors in ``unit.params`` order (leaves when ``requires_grad``). A frozen
    parameter's tensor (the model's requires_grad=False, ``EngineConfig.frozen``) never takes a
    gradient: a backward computes no weight gradient for it (a frozen vision tower's backward is
    not run; a decoder layer whose weights are all frozen computes only its input's gradient).
    """
    bound = []
    for p in unit.params:
        v = flat[p.offset:p.offset + p.numel].view(p.shape)
        if requires_grad and not p.frozen:
            v = v.detach().requires_grad_(True)
        for mod, attr in p.bindings:
            mod._parameters[attr] = v
        bound.append(v)
    return bound


def unbind(unit: Unit, placeholders: Dict[Tuple[int, str], nn.Parameter]) -> None:
    for p in unit.params:
        for mod, attr in p.bindings:
            mod._parameters[attr] = placeholders[(id(mod), attr)]


def output_template(unit: Unit, args, kwargs, placeholders) -> Optional[Tuple[bool, Tuple[bool, ...]]]:
    """:func:`template_of` the layer's output, found without its weights (the layer runs once
    on fake tensors: no memory, no compute); None if that cannot be found."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    hidden = args[0] if args else kwargs.get("hidden_states")
    if not torch.is_tensor(hidden):
        return None
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)   # an op without a fake kernel is an answer (None), not an error
    # (then in bfloat16: some fake kernels, grouped_mm's, take nothing else; the template is
    # the same in every dtype)
    try:
        for dtype in dict.fromkeys((hidden.dtype, torch.bfloat16)):
            try:
                with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
                    for p in unit.params:
                        t = torch.empty(p.shape, device=hidden.device, dtype=dtype)
                        for mod, attr in p.bindings:
                            mod._parameters[attr] = t
                    out = unit.module(*_cast(args, dtype), **_cast(kwargs, dtype))
                return template_of(out)
            except Exception:  # noqa: BLE001 - the caller keeps what it knew
                continue
            finally:
                unbind(unit, placeholders)
        return None
    finally:
        quiet.setLevel(level)


def _cast(obj, dtype):
    """``obj`` (nested tuples, lists, dicts) with its floating-point tensors in ``dtype``."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (tuple, list)) and not hasattr(obj, "_fields"):
        return type(obj)(_cast(x, dtype) for x in obj)
    if type(obj) is dict:
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj


def template_of(out) -> Tuple[bool, Tuple[bool, ...]]:
    """(whether the layer returns a tuple, for each item after the hidden state whether it is
    something rather than None)."""
    if isinstance(out, (tuple, list)):
        return True, tuple(x is not None for x in out[1:])
    return False, ()


@contextmanager
def swapped_submodule(parent: nn.Module, name: str, replacement: nn.Module):
    old = parent._modules[name]
    parent._modules[name] = replacement
    try:
        yield
    finally:
        parent._modules[name] = old


class HiddenStatesStub(nn.Module):
    """Stands in for the base model so the CausalLM's own head code runs on one chunk.

    Calling it (or any module of the stack path the head code reaches it through, such as
    ``self.model.decoder``) returns the chunk's hidden states; every other attribute the head
    code reads (``config``, ``embed_tokens``, multipliers, ...) is the real base model's.
    """

    def __init__(self, base: nn.Module = None, path=()):
        super().__init__()
        self.hidden = None
        # Plain attributes, not submodules: the stub owns no parameters.
        object.__setattr__(self, "_mt_base", base)
        object.__setattr__(self, "_mt_path", tuple(id(m) for m in path))

    def forward(self, *args, **kwargs):
        return _StubOutput(last_hidden_state=self.hidden)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self.__dict__.get("_mt_base")
            if base is None or name.startswith("__"):
                raise
            value = getattr(base, name)
            if isinstance(value, nn.Module) and id(value) in self.__dict__["_mt_path"]:
                return self
            return value


def _stub_output_class():
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class StubOutput(BaseModelOutputWithPast):
        # Head code of some families reads other fields (cross_attentions, ...): they are None.
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return StubOutput


_StubOutput = _stub_output_class()

"""Split a Hugging Face causal LM into streaming units with flat parameter layouts.

A unit is the granularity of streaming: every decoder layer is one unit, and the parameters
outside the layer list form two more: ``embed`` (everything the model uses before the first
layer, plus tied output weights) and ``head`` (final norm and untied ``lm_head``). Each unit's
parameters live in one flat buffer with a fixed layout: decayed parameters first, then the
ones without weight decay, so the optimizer runs as two fused calls per unit. Under
``EngineConfig.lr_scale`` each of the two is ordered further so that the parameters of one
learning-rate scale are one contiguous run (``Unit.lr_segments``): one fused call per run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .discovery import SUPPORTED_HINT, find_layer_list, modules_after_layers  # noqa: F401 - find_layer_list re-exported
from .vision import (auto_model_class, check_vision_model, guard_inputs,  # noqa: F401 - re-exported
                     is_image_text_model, lr_scale_names)





@dataclass
class ParamEntry:
    name: str                      # canonical name, as model.named_parameters() gives it
    offset: int                    # element offset in the unit's flat buffer
    shape: Tuple[int, ...]
    decay: bool
    bindings: List[Tuple[nn.Module, str]] = field(default_factory=list)  # every (module, attr) sharing it
    #: requires_grad=False in the model (a sinusoidal table, a router's correction bias): its
    #: gradient is zero and it gets no weight decay, so the optimizer leaves it as it is
    frozen: bool = False
    #: EngineConfig.lr_scale: AdamW steps it at the learning rate times this
    lr_scale: float = 1.0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Unit:
    name: str                      # "embed", "layers.<i>", "head"
    kind: str                      # "embed" | "layer" | "head"
    index: int                     # position in the unit list
    params: List[ParamEntry]
    numel: int
    decay_numel: int               # params[0:decay_numel] of the flat buffer get weight decay
    layer_index: Optional[int] = None
    module: Optional[nn.Module] = None   # the real decoder layer for layer units
    #: The embedding unit also holds the (tied) output embedding: its gradient gets a share from
    #: the head's loss too, so a layer-major window keeps its sum for the whole backward.
    tied_output: bool = False
    #: Elements that train (the frozen parameters at the buffer's end excluded: build_units'
    #: ``split_frozen``); None = all. Gradients, their transfer and the AdamW states cover
    #: ``flat[:train_numel]`` only.
    train: Optional[int] = None
    #: ``(start, end, scale)``: the element runs whose learning rate is scaled
    #: (EngineConfig.lr_scale; scale != 1); the optimizer splits them where weight decay stops.
    lr_segments: Tuple[Tuple[int, int, float], ...] = ()

    @property
    def train_numel(self) -> int:
        """The prefix of the flat buffer that trains (gradients, AdamW states)."""
        return self.numel if self.train is None else self.train

    def views(self, flat: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {p.name: flat[p.offset:p.offset + p.numel].view(p.shape) for p in self.params}


def train_numel(unit) -> int:
    """The elements of ``unit``'s flat buffer that train (:attr:`Unit.train_numel`; a unit-like
    object without one -- a shard, a measurement's stand-in -- trains whole)."""
    return getattr(unit, "train_numel", unit.numel)


def check_supported(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_output_embeddings"):
        raise TypeError(f"{type(model).__name__} is not a transformers model; the engine supports {SUPPORTED_HINT}.")
    if getattr(config, "is_encoder_decoder", False):
        raise TypeError(f"{type(model).__name__} is an encoder-decoder model; the engine supports {SUPPORTED_HINT}.")
    if is_image_text_model(model) and not _registered_causal_lm(model):   # a vision-language model (vision.py)
        check_vision_model(model)
    elif model.get_output_embeddings() is None or not (type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
                                                     or _registered_causal_lm(model)):
        raise TypeError(f"{type(model).__name__} is not a causal language model (encoder-only or a bare base "
                        f"model?); the engine supports {SUPPORTED_HINT}. Load it with "
                        "AutoModelForCausalLM.")
    guard_inputs(model)   # a processor's extra inputs reach only a forward that takes them


def _registered_causal_lm(model: nn.Module) -> bool:
    """Whether transformers registers the model's class as a causal LM (BertGenerationDecoder, ...)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def decay_parameter_names(model: nn.Module) -> set:
    """The same set transformers.Trainer decays (biases and normalisation weights excluded)."""
    from transformers import Trainer

    return set(Trainer.get_decay_parameter_names(None, model))


def _scale_runs(entries: List[ParamEntry]) -> Tuple[Tuple[int, int, float], ...]:
    """The ``(start, end, scale)`` runs of trainable ``entries`` (in buffer order) whose scale is not 1."""
    runs: List[Tuple[int, int, float]] = []
    for e in entries:
        if e.frozen or e.lr_scale == 1.0 or e.numel == 0:
            continue
        if runs and runs[-1][1] == e.offset and runs[-1][2] == e.lr_scale:
            runs[-1] = (runs[-1][0], e.offset + e.numel, e.lr_scale)
        else:
            runs.append((e.offset, e.offset + e.numel, e.lr_scale))
    return tuple(runs)


def build_units(model: nn.Module, layers: nn.ModuleList, split_frozen: bool = False,
                lr_scale: Optional[Dict[str, float]] = None) -> List[Unit]:
    """The units of ``model``; a unit's buffer holds its decayed parameters, then the other
    trainable ones, then the frozen ones (``requires_grad=False``). ``split_frozen``: a unit's
    gradient and AdamW states leave its frozen tail out (``Unit.train_numel``). ``lr_scale``:
    parameter name -> learning-rate scale (engine/vision.py ``lr_scale_names``); within the
    decayed and the undecayed segment the unscaled parameters come first (model order), then
    those of each scale, ascending (``Unit.lr_segments``); without it the layout is as before."""
    scales = dict(lr_scale or {})
    decay = decay_parameter_names(model)
    # Group every (module, attr) by the parameter object they hold: tied weights share one entry.
    canonical: Dict[int, str] = {}
    bindings: Dict[int, List[Tuple[nn.Module, str]]] = {}
    params: Dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters():
        canonical[id(p)] = name
        params[id(p)] = p
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is not None and id(p) in canonical:
                bindings.setdefault(id(p), [])
                if not any(m is mod and a == attr for m, a in bindings[id(p)]):
                    bindings[id(p)].append((mod, attr))

    layer_param_ids: List[set] = [set(id(p) for p in layer.parameters()) for layer in layers]
    in_layers = set().union(*layer_param_ids) if layer_param_ids else set()
    if sum(len(ids) for ids in layer_param_ids) != len(in_layers):
        raise TypeError(f"{type(model).__name__} shares parameters between its decoder layers (a block tied "
                        "across layers); this is not supported by the streaming engine, which streams each "
                        "layer's own weights.")

    # Outer parameters: the ones used after the layer list go to "head"; everything else to
    # "embed". "After" = the output embedding (unless tied to the input one) and base-model
    # modules registered after the layer list. A misplacement would fail loudly (a meta tensor
    # in the forward), never silently.
    out_emb = model.get_output_embeddings()
    in_emb = model.get_input_embeddings()
    tied_ids = set()
    if out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight:
        tied_ids.add(id(out_emb.weight))
    head_ids = set()
    if out_emb is not None:
        head_ids |= {id(p) for p in out_emb.parameters()} - tied_ids
    for child in modules_after_layers(model, layers):
        head_ids |= {id(p) for p in child.parameters()} - tied_ids - in_layers

    def make_unit(name, kind, index, ids, layer_index=None, module=None) -> Unit:
        ordered = [canonical[i] for i in canonical if i in ids]  # model order
        by_name = {canonical[i]: i for i in ids}
        frozen = [n for n in ordered if not params[by_name[n]].requires_grad]
        by_scale = lambda n: (scales.get(n, 1.0) != 1.0, scales.get(n, 1.0))  # noqa: E731 - (a stable sort)
        dec = sorted((n for n in ordered if n in decay and n not in frozen), key=by_scale)
        nodec = sorted((n for n in ordered if n not in decay and n not in frozen), key=by_scale)
        entries, off = [], 0
        for n in dec + nodec + frozen:
            p = params[by_name[n]]
            entries.append(ParamEntry(n, off, tuple(p.shape), n in dec, bindings[by_name[n]],
                                      frozen=not p.requires_grad, lr_scale=scales.get(n, 1.0)))
            off += p.numel()
        dn = sum(params[by_name[n]].numel() for n in dec)
        train = off - sum(params[by_name[n]].numel() for n in frozen) if split_frozen and frozen else None
        return Unit(name, kind, index, entries, off, dn, layer_index, module, train=train,
                    lr_segments=_scale_runs(entries))

    outer = [i for i in canonical if i not in in_layers]
    embed_ids = {i for i in outer if i not in head_ids}
    units = [make_unit("embed", "embed", 0, embed_ids)]
    units[0].tied_output = bool(tied_ids & embed_ids)
    prefix = _layer_prefix(model, layers)
    for li, layer in enumerate(layers):
        units.append(make_unit(f"{prefix}.{li}", "layer", li + 1, layer_param_ids[li] - set(), li, layer))
    units.append(make_unit("head", "head", len(layers) + 1, {i for i in outer if i in head_ids}))
    return units


def forward_order(units: List[Unit]) -> List[Unit]:
    """The embedding, the head, then the layers (``units`` as :func:`build_units` orders them:
    embedding first, head last): the order a forward acquires units (the head is bound before
    the layers run) and the order updates run in when they wait for the whole backward."""
    return [units[0], units[-1]] + list(units[1:-1])


def _layer_prefix(model: nn.Module, layers: nn.ModuleList) -> str:
    for name, mod in model.named_modules():
        if mod is layers:
            return name
    return "layers"


def lr_scales(model: nn.Module, config, world: int = 1) -> Dict[str, float]:
    """Parameter name -> learning-rate scale for ``config.lr_scale`` (engine/vision.py
    ``lr_scale_names``; empty without one). Refused, saying what to change, with several ranks
    (a shard's layout carries no scales). Any optimizer states: a compressed codec's fused kernel
    steps each group's piece of a chunk at its own rate (updates/optimizer.py)."""
    if not config.lr_scale:
        return {}
    if world > 1:
        raise ValueError(f"EngineConfig.lr_scale is not supported with {world} ranks yet (a shard's layout "
                         "carries no scales); train in one process or drop lr_scale.")
    return lr_scale_names(model, config.lr_scale)

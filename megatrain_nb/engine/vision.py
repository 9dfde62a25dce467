"""Vision-language models (``*ForConditionalGeneration`` of the image-text-to-text families) in the
streaming engine, by the model's own code.

The language model's decoder layers stream as units as for a causal LM; the vision tower and the
projector are parameters outside the layer list used before the first layer, so they live in the
``embed`` unit (with the token embedding) and are trained there: the model's own forward (its
image-feature function, its embedding merge, its position computation: M-RoPE for Qwen-VL) runs
in the embedding's pass, and the embedding's backward carries the gradient into the vision tower
and the projector. A parameter the user froze (``requires_grad=False``) gets a zero gradient and no
weight decay, so its weights stay as they are.

The processor's extra inputs (``pixel_values``, ``image_grid_thw``, ``image_sizes``,
``mm_token_type_ids``, ...) ride in a batch's attention-mask slot (:class:`.inputs.WithExtras`) and
reach the base model's forward as keywords. :func:`guard_inputs` refuses, when the forward runs,
an extra input the model's forward does not name and image tokens without their images (nothing
trains silently without its images).
"""
from __future__ import annotations

import contextlib
import inspect
import re
from collections import deque
from typing import Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import checkpoint

from .discovery import locate

#: The image-text-to-text families whose gradients are checked against the model's own (tests/engine/test_vlm.py).
VISION_FAMILIES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3", "idefics3", "smolvlm")
#: What the engine passes the base model's forward itself (everything else is a processor's extra input);
#: the KV cache: the streamed decoder's (engine/compute/decode.py; ``past_key_values`` before transformers 5)
_OWN = frozenset({"input_ids", "attention_mask", "position_ids", "use_cache", "cache", "past_key_values"})
_IMAGE_TOKEN = ("image_token_id", "image_token_index")


def _image_text_classes() -> set:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    except ImportError:   # an older transformers: no such families
        return set()
    return set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values())


def is_image_text_model(model: nn.Module) -> bool:
    """Whether transformers registers ``model``'s class as an image-text-to-text model."""
    return type(model).__name__ in _image_text_classes()


def auto_model_class(hf_config):
    """The transformers auto class that builds ``hf_config``'s model for the engine: a config
    transformers registers only as image-text-to-text (Qwen2-VL, LLaVA, Idefics3, ...) by
    ``AutoModelForImageTextToText``; every other (Gemma 3 is a causal LM too) by
    ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = getattr(hf_config, "model_type", "")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind in _image_text_types():
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def checkpoint_names(model: nn.Module, keys) -> dict:
    """``{parameter name: its name among keys}`` where they differ: a folder transformers wrote
    in a family's older layout (Qwen2-VL's ``model.layers...``, ``visual...`` for
    ``model.language_model.layers...``, ``model.visual...``), renamed as transformers' own
    loading renames it (the model's conversion mapping). A key that needs more than a renaming
    (a converter: tensors split or merged) is refused by name."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:   # an older transformers: the names are the model's
        return {}
    transforms = get_model_conversion_mapping(model)
    if not transforms:
        return {}
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    state = model.state_dict()
    out = {}
    for key in keys:
        name, converted = rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None),
                                            state)
        if converted is not None:
            raise ValueError(f"{key!r} in the folder becomes {name!r} by a conversion of its values "
                             f"({converted}), not a renaming; load the model with from_pretrained and hand it "
                             "to StreamingEngine(model) instead.")
        if name != key:
            out[name] = key
    return out


def _image_text_types() -> set:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    except ImportError:
        return set()
    return set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def family(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", "") or "")


def check_vision_model(model: nn.Module) -> None:
    """Refuse an image-text-to-text model of a family the engine is not checked on, by name."""
    name, fam = type(model).__name__, family(model)
    if fam not in VISION_FAMILIES:
        raise TypeError(f"{name} (model_type {fam!r}) is a vision-language family the streaming engine does not "
                        f"support yet: its gradients are not checked against the model's own. Supported "
                        f"vision-language families: {', '.join(VISION_FAMILIES)} (docs/VISION.md).")
    if model.get_output_embeddings() is None:
        raise TypeError(f"{name} has no language-model head (a bare base model?); load the family's "
                        "*ForConditionalGeneration class (AutoModelForImageTextToText).")


def guard_inputs(model: nn.Module) -> None:
    """A check on ``model``'s base model's forward: a processor's extra input is taken only by a
    supported vision-language family whose forward names it; image tokens need their images."""
    try:
        _, base, _ = locate(model)
    except TypeError:   # no base model with a layer list: the engine refuses the model later, in its own words
        return
    if getattr(base, "_mt_guarded", False):
        return
    named = {n for n, p in inspect.signature(base.forward).parameters.items() if p.kind != p.VAR_KEYWORD}
    cfg = model.config
    image_token = next((getattr(cfg, a) for a in _IMAGE_TOKEN if isinstance(getattr(cfg, a, None), int)), None)
    vision = is_image_text_model(model) and family(model) in VISION_FAMILIES
    label = f"{type(model).__name__} (model_type {family(model)!r})"

    def check(module, args, kwargs):
        extra = sorted(set(kwargs) - _OWN)
        if extra and not vision:
            raise ValueError(f"{label} takes no extra inputs {extra} in the streaming engine (only input_ids, "
                             f"attention_mask, labels, position_ids); vision-language families supported: "
                             f"{', '.join(VISION_FAMILIES)}.")
        unknown = [k for k in extra if k not in named]
        if unknown:
            raise ValueError(f"{label}'s forward takes no {unknown}; it takes {sorted(named - _OWN)}.")
        ids = kwargs.get("input_ids")
        if vision and image_token is not None and torch.is_tensor(ids) and kwargs.get("pixel_values") is None \
                and bool((ids == image_token).any()):
            raise ValueError(f"{label}: the batch has image tokens (id {image_token}) but no pixel_values; pass the "
                             "processor's pixel_values (and its other image inputs) with the batch.")
        return None

    base.register_forward_pre_hook(check, with_kwargs=True)
    object.__setattr__(base, "_mt_guarded", True)


#: The parts of a vision-language model ``EngineConfig.frozen`` names, as the base model's
#: attributes that hold them in the supported families (Qwen-VL's merger is the projector, not
#: part of its vision tower; LLaVA-NeXT's image_newline belongs to the projector).
PARTS = {"vision_tower": ("visual", "vision_tower", "vision_model"),
         "projector": ("multi_modal_projector", "connector", "visual.merger", "image_newline"),
         "language_model": ("language_model", "text_model")}


def _part_names(model: nn.Module, part: str) -> set:
    """The parameter names of ``part`` of ``model`` (empty when the family has no such part).
    The language model includes the output embedding (``lm_head``)."""
    try:
        base_name, _, _ = locate(model)
    except TypeError:
        return set()
    names = [n for n, _ in model.named_parameters()]

    def under(attrs):
        heads = tuple(f"{base_name}.{a}" for a in attrs)
        return {n for n in names if any(n == h or n.startswith(h + ".") for h in heads)}
    out = under(PARTS[part])
    if part == "vision_tower":
        out -= under(PARTS["projector"])
    if part == "language_model" and out:
        out |= {f"{name}.{pn}" for name, mod in model.named_children()   # (tied: already in, by its own name)
                if mod is model.get_output_embeddings() for pn, _ in mod.named_parameters()} & set(names)
    return out


def _prefix_match(entry: str) -> "re.Pattern":
    """A parameter-name prefix as a pattern: the whole name or a dotted head of names, a ``*``
    standing for one dotted segment (``model.layers.*.mlp``: every layer's MLP)."""
    head = entry[:-1] if entry.endswith(".") else entry
    body = r"[^.]+".join(re.escape(piece) for piece in head.split("*"))
    return re.compile(rf"{body}(\..*)?\Z")


def frozen_names(model: nn.Module, entries, field: str = "frozen") -> set:
    """The parameter names ``EngineConfig.frozen``'s ``entries`` name in ``model``: each a part
    (:data:`PARTS`) or a parameter-name prefix (a whole name, or a dotted head of names; ``*``
    stands for one dotted segment: ``model.layers.*.mlp``). An
    entry that names nothing is refused, with the parts and the top-level names there are
    (``field``: the EngineConfig field the refusal names)."""
    names = [n for n, _ in model.named_parameters()]
    out = set()
    for e in entries:
        hit = _part_names(model, e) if e in PARTS else {n for n in names if _prefix_match(e).match(n)}
        if not hit:
            heads = sorted({".".join(n.split(".")[:2]) for n in names})
            parts = [p for p in PARTS if _part_names(model, p)]
            raise ValueError(f"EngineConfig.{field} entry {e!r} names no parameter of {type(model).__name__}; "
                             f"give a part ({', '.join(parts) or 'none in this model'}) or a parameter-name "
                             f"prefix (such as {', '.join(heads[:8])}).")
        out |= hit
    return out


def lr_scale_names(model: nn.Module, scales) -> dict:
    """Parameter name -> learning-rate scale for ``EngineConfig.lr_scale`` (entry -> scale, each
    entry resolved as :func:`frozen_names` resolves one); where entries overlap, the longer
    (the more specific) entry's scale wins."""
    out: dict = {}
    for e in sorted(scales or {}, key=len):
        out.update(dict.fromkeys(frozen_names(model, [e], field="lr_scale"), float(scales[e])))
    return out


def freeze(model: nn.Module, entries) -> set:
    """``requires_grad_(False)`` on what ``entries`` name (:func:`frozen_names`); returns the names."""
    names = frozen_names(model, entries) if entries else set()
    for n, p in model.named_parameters():
        if n in names:
            p.requires_grad_(False)
    return names


def tower_blocks(base: nn.Module) -> list:
    """The vision tower's blocks (the longest ``nn.ModuleList`` under the base model's tower:
    Qwen-VL's ``visual.blocks``, CLIP's and SigLIP's ``encoder.layers``); empty without a tower."""
    for attr in PARTS["vision_tower"]:
        tower = getattr(base, attr, None)
        if isinstance(tower, nn.Module):
            lists = [m for m in tower.modules() if isinstance(m, nn.ModuleList) and len(m)]
            return list(max(lists, key=len)) if lists else []
    return []


class ImageFeatures:
    """A step's image features, computed once per micro-batch where the engine's passes of the
    model's forward would compute them three times. The capture (layer 0's input) runs the vision
    tower and the projector with their autograd graph (gradients on for that call alone) and
    keeps it; the head's replay -- which needs only the post-layer code, its embeddings are thrown
    away -- is served the features detached; the embedding's backward is served the kept graph
    and back-propagates through it, so the tower's forward runs once per micro-batch (counted in
    tests/engine/test_vision_passes.py). Where nothing of the tower and projector trains, the
    features carry no graph and are served as they are (a frozen tower: no graph at all).

    ``keep``: how many micro-batches of a group keep their graph (None: all; the plan's room for
    them: ``planning/vision_plan.graphs_kept``); a micro-batch past it is captured without a
    graph and its features are computed again, with their graph, in the embedding's backward.
    ``meter``: the step's :class:`.recompute.ActivationMeter`; a kept graph's saved bytes are
    counted as held (``meter.held``) until the embedding's backward takes it.

    ``by_blocks`` (the planner's placement where the tower's whole graph does not fit the device:
    ``planning/vision_plan.place_vision``): the tower's blocks run under non-reentrant activation
    checkpointing, so the kept graph holds each block's input only (the blocks' boundaries) and
    the embedding's backward runs each block again, one at a time, with its graph -- the schedule
    of a tower streamed by blocks; its weights stay in the ``embed`` unit (on the device for the
    step). The boundaries are the meter's held bytes.

    ``base``'s ``get_image_features`` (every supported family's forward calls it once) is
    wrapped on the instance; a model without one is left alone (every call a no-op)."""

    def __init__(self, base: nn.Module, meter=None, keep: Optional[int] = None, by_blocks: bool = False):
        self._fn = getattr(base, "get_image_features", None) if callable(getattr(base, "get_image_features", None)) \
            else None
        self._replay: deque = deque()   # per captured micro-batch: the features, detached (the head's replay)
        self._held: deque = deque()     # per captured micro-batch: (features for the backward or None, bytes)
        self._mode: Optional[str] = None
        self.meter, self.keep = meter, keep
        self.kept = 0                   # graphs held now
        self.runs = 0                   # the tower's runs (get_image_features calls that computed)
        self.by_blocks = by_blocks
        self._boundary = 0              # by blocks: the blocks' input bytes of the run in progress
        if self._fn is not None:
            base.get_image_features = self._call   # (the instance's attribute; the class is left as it is)
            for block in tower_blocks(base):
                block.forward = self._block_forward(block.forward)   # (the instance's; by_blocks decides)

    def _block_forward(self, forward):
        """``forward`` of one tower block, under activation checkpointing while :attr:`by_blocks`
        and gradients are on (the block's input kept, the block run again in the backward)."""
        def run(*args, **kwargs):
            if not (self.by_blocks and torch.is_grad_enabled()):
                return forward(*args, **kwargs)
            self._boundary += sum(t.untyped_storage().nbytes() for t in args[:1] if torch.is_tensor(t))
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return run

    def _call(self, *args, **kwargs):
        if self._mode == "replay" and self._replay:
            return self._replay.popleft()
        if self._mode == "backward" and self._held:
            out, nbytes = self._held.popleft()
            if out is not None:
                self._take(nbytes)
                return out
            with self._counted(hold=False):   # not kept: computed again with its graph
                return self._run(args, kwargs)
        if self._mode != "record":
            return self._run(args, kwargs)
        return self._record(args, kwargs)

    def _run(self, args, kwargs):
        self.runs += 1
        return self._fn(*args, **kwargs)

    def _record(self, args, kwargs):
        """The capture's run: with its graph where there is room for it (:attr:`keep`)."""
        room = self.keep is None or self.kept < self.keep
        counted = {"bytes": 0}
        self._boundary = 0
        with torch.enable_grad() if room else torch.no_grad(), self._counted(hold=True, into=counted) \
                if room else contextlib.nullcontext():
            out = self._run(args, kwargs)
        if room and self._boundary and self.meter is not None:   # by blocks: the checkpoints hold the blocks' inputs
            self.meter.held += self._boundary
            counted["bytes"] += self._boundary
            self.meter.note()
        detached = tree_map(lambda t: t.detach() if torch.is_tensor(t) else t, out)
        self._replay.append(detached)
        if not room:
            self._held.append((None, 0))
        elif not any(torch.is_tensor(t) and t.requires_grad for t in tree_leaves(out)):
            self._drop(counted["bytes"])       # nothing in it trains: no graph (a frozen tower and projector)
            self._held.append((detached, 0))
            return detached
        else:
            self.kept += 1
            self._held.append((out, counted["bytes"]))
        return out

    @contextlib.contextmanager
    def _counted(self, hold: bool, into: Optional[dict] = None):
        """The meter's count of the saved bytes of one run of the tower (none without a meter)."""
        if self.meter is None:
            yield
            return
        before = self.meter.held
        with self.meter.count_saved(hold=hold):
            yield
        if into is not None:
            into["bytes"] = self.meter.held - before

    def _take(self, nbytes: int) -> None:
        """A kept graph handed to the embedding's backward: held no more, its saved bytes and their
        gradients live while it runs backward."""
        self.kept -= 1
        if self.meter is not None:
            self.meter.held -= nbytes
            self.meter.note_held_backward(nbytes)   # (its saved bytes + two gradients in flight: recompute.py)

    def _drop(self, nbytes: int) -> None:
        if self.meter is not None:
            self.meter.held -= nbytes
            self.meter.note()

    @contextlib.contextmanager
    def mode(self, mode: Optional[str]):
        """``"record"`` (the capture), ``"replay"`` (the head's pass), ``"backward"`` (the
        embedding's backward), or None (a plain call: evaluation, decoding)."""
        before, self._mode = self._mode, mode
        try:
            yield
        finally:
            self._mode = before

    def clear(self) -> None:
        """Drop what a step left (an error mid-step)."""
        self._replay.clear()
        self._held.clear()
        self.kept = 0
        if self.meter is not None:
            self.meter.held = 0

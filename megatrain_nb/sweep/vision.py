"""Check one registered image-text-to-text family against Hugging Face autograd.

The registry is ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` of the installed transformers.
A family the engine takes (``engine/vision.py`` ``VISION_FAMILIES``) is built tiny here
(:func:`tiny_vlm`: its text and vision configs shrunk, its image tokens fitted) and checked as a
causal LM is (:mod:`.check`): the model's own forward and backward on two rows with their images
(:func:`vlm_batch`, shaped as the family's processor shapes them) against the streaming engine at
checkpoint intervals 1 and 2 and as a layer-major window of two micro-batches: the loss and every
parameter's gradient, vision tower and projector included. Any other family is built on the meta
device from its own default config (no memory) and handed to the engine's own check, which
refuses it by name with the reason (its gradients are not checked); a family transformers cannot
build is "not built", with transformers' words.

    check_vision("qwen2_vl")   # -> Result(status="supported", modes={"interval 1": "ok", ...})
"""
from __future__ import annotations

import copy
from typing import Dict, Optional

from .check import (FAILING, MODES, NOT_BUILT, NOT_DECODER, REFUSED, SUPPORTED, Result, check, engine_parts,
                    registry, run_modes, short_error)

#: The kind of an image-text-to-text result (its own table in docs/MODELS.md).
VISION_KIND = "image-text-to-text"
#: The tiny text and vision configs (the families' own model types added per family).
TINY_TEXT = dict(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                   patch_size=4)
IMAGE = 150   # the image token id of the tiny configs
#: Families whose top-level class is an encoder-decoder (or a vision encoder feeding a text decoder
#: through cross-attention): not a decoder stack with images merged into its embeddings.
ENCODER_DECODER = {"blip", "blip-2", "florence2", "instructblip", "instructblipvideo", "kosmos-2", "kosmos-2.5",
                   "mllama", "pix2struct", "t5gemma2", "udop", "vision-encoder-decoder", "idefics", "evolla"}


def vision_registry() -> Dict[str, str]:
    """model type -> image-text-to-text class name, for the installed transformers."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    except ImportError:   # an older transformers: no such registry
        return {}
    return dict(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _config(family: str, **overrides):
    """``family``'s tiny config; ``overrides``: top-level config fields (e.g. ``vision_feature_layer``)."""
    from transformers import AutoConfig

    if family in ("llava", "llava_next"):
        kw = dict(vision_config=dict(model_type="clip_vision_model", projection_dim=32, **TINY_VISION),
                  text_config=dict(model_type="llama", **TINY_TEXT), image_token_index=IMAGE)
        kw.update(dict(vision_feature_layer=-2, vision_feature_select_strategy="default") if family == "llava"
                  else dict(image_grid_pinpoints=[[16, 32], [32, 16]]))
    elif family in ("qwen2_vl", "qwen2_5_vl"):
        text = dict(TINY_TEXT, bos_token_id=1, eos_token_id=2,
                    rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0})
        vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=32,
                      intermediate_size=64)
        kw = dict(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=151,
                  vision_start_token_id=152, vision_end_token_id=153)
    elif family == "gemma3":
        kw = dict(text_config=dict(model_type="gemma3_text", head_dim=8, **TINY_TEXT),
                  vision_config=dict(model_type="siglip_vision_model", **TINY_VISION), mm_tokens_per_image=4,
                  image_token_id=IMAGE, boi_token_index=152, eoi_token_index=153)
    elif family in ("idefics3", "smolvlm"):
        kw = dict(text_config=dict(model_type="llama", **TINY_TEXT), vision_config=TINY_VISION, scale_factor=2,
                  image_token_id=IMAGE)
    else:
        raise KeyError(f"no tiny config for the image-text-to-text family {family!r}")
    return AutoConfig.for_model(family, **{**kw, **overrides})


def tiny_vlm(family: str, seed: int = 0, **overrides):
    """``family``'s tiny model (``AutoModelForImageTextToText`` from a shrunk config, ``overrides``
    on its top-level fields), in eval mode."""
    import torch
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(_config(family, **overrides)).eval()


def vlm_batch(family: str, seed: int = 1) -> dict:
    """Two rows (the second right-padded) with one image each, shaped as the family's processor
    gives them: ``input_ids`` with the image tokens, ``attention_mask``, ``labels`` and the image
    inputs (``pixel_values``, ``image_grid_thw``, ``image_sizes``, ``token_type_ids``, ...)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if family == "llava":   # 16x16 pixels, 4x4 patches: 16 image tokens (CLS dropped)
        ids = torch.randint(3, 140, (2, 24), generator=g)
        ids[:, 2:18] = IMAGE
        extras = {"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}
    elif family == "llava_next":   # a 16x32 image: the base view and two 16x16 crops, 52 image tokens
        ids = torch.randint(3, 140, (2, 60), generator=g)
        ids[:, 2:54] = IMAGE
        extras = {"pixel_values": torch.randn(2, 3, 3, 16, 16, generator=g),
                  "image_sizes": torch.tensor([[16, 32], [16, 32]])}
    elif family == "gemma3":   # 16 patches pooled to 4 soft tokens, attended both ways (token_type_ids)
        ids = torch.randint(3, 140, (2, 20), generator=g)
        ids[:, 3], ids[:, 4:8], ids[:, 8] = 152, IMAGE, 153
        extras = {"pixel_values": torch.randn(2, 3, 16, 16, generator=g), "token_type_ids": (ids == IMAGE).long()}
    elif family in ("idefics3", "smolvlm"):   # one image per row, 16 patches shuffled 2x2: 4 image tokens
        ids = torch.randint(3, 140, (2, 20), generator=g)
        ids[:, 4:8] = IMAGE
        extras = {"pixel_values": torch.randn(2, 1, 3, 16, 16, generator=g)}
    else:                   # Qwen-VL: a 4x4 patch grid merged 2x2, 4 image tokens between vision start and end
        ids = torch.randint(3, 140, (2, 20), generator=g)
        ids[:, 3], ids[:, 4:8], ids[:, 8] = 152, IMAGE, 153
        extras = {"pixel_values": torch.randn(32, 24, generator=g),
                  "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]]),
                  "mm_token_type_ids": (ids == IMAGE).int()}
    am = torch.ones_like(ids)
    am[1, -4:] = 0
    return {"input_ids": ids, "attention_mask": am, "labels": ids.masked_fill(am == 0, -100), **extras}


def vlm_reference(model, batches) -> tuple:
    """Hugging Face autograd over ``batches`` (each with its images): the window's summed token
    loss over its target tokens, as transformers.Trainer accumulates it; (loss, {name: grad})."""
    import torch

    ref = copy.deepcopy(model)
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    total = 0.0
    for b, n in zip(batches, counts):
        out = ref(**b)
        (out.loss * n / sum(counts)).backward()
        total += float(out.loss.detach()) * n
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)) for name, p in ref.named_parameters()}
    return total / sum(counts), grads


def _meta_model(model_type: str):
    """``model_type``'s model from its own default config on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type))


def _unchecked(res: Result) -> Result:
    """A family without a tiny check here: the engine's own first check of a model it is handed
    (``units.check_supported``, on the model built on the meta device), or why it is not built."""
    try:
        model = _meta_model(res.model_type)
    except Exception as e:  # noqa: BLE001 - the reason is the result
        res.status, res.reason = NOT_BUILT, f"transformers cannot build it from its own default config: {short_error(e)}"
        return res
    if res.model_type in ENCODER_DECODER:
        res.status = NOT_DECODER
        res.reason = (f"{res.architecture} is not a decoder stack with images merged into its token embeddings "
                      "(an encoder-decoder, or cross-attention to the image): the engine does not stream it")
        return res
    if res.architecture in set(registry().values()):
        res.status = REFUSED
        res.reason = (f"transformers registers {res.architecture} as a causal LM too: the engine trains it as one "
                      "(its row in the causal-LM table) and refuses image inputs for it by name; its images are "
                      "not supported")
        return res
    try:
        engine_parts()[2].check_supported(model)
    except TypeError as e:
        res.status, res.reason = REFUSED, str(e).strip().splitlines()[0]
        return res
    res.status, res.reason = FAILING, "the engine takes it, but the sweep has no tiny config for it (sweep/vision.py)"
    return res


def check_vision(model_type: str, modes=MODES) -> Result:
    """Check the image-text-to-text family ``model_type``: its tiny model against Hugging Face
    autograd in every mode, or the engine's refusal of it."""
    res = Result(model_type, vision_registry().get(model_type, "?"), VISION_KIND, SUPPORTED)
    if model_type not in engine_parts()[3].VISION_FAMILIES:
        return _unchecked(res)
    try:
        model = tiny_vlm(model_type)
        single, window = [vlm_batch(model_type, 1)], [vlm_batch(model_type, 2), vlm_batch(model_type, 3)]
        refs = {"single": vlm_reference(model, single), "window": vlm_reference(model, window)}
    except Exception as e:  # noqa: BLE001
        res.status, res.reason = FAILING, f"the tiny model does not run in transformers: {short_error(e)}"
        return res
    res = run_modes(res, model, modes, {"single": (single, refs["single"]), "window": (window, refs["window"])})
    res.layers = model.config.get_text_config().num_hidden_layers
    return res


def vision_sweep(model_types: Optional[list] = None, modes=MODES, progress=None) -> list:
    """The image-text-to-text registry (or ``model_types`` of it), checked."""
    out = []
    for mt in model_types if model_types is not None else list(vision_registry()):
        r = check_vision(mt, modes)
        out.append(r)
        if progress is not None:
            progress(r)
    return out


def sweep_all(model_types: Optional[list] = None, modes=MODES, progress=None) -> list:
    """Both registries (``megatrain-nb models --check``): every causal LM, then every
    image-text-to-text model; with ``model_types``, those, in each registry that has them."""
    causal, vision = registry(), vision_registry()
    unknown = [mt for mt in model_types or [] if mt not in causal and mt not in vision]
    if unknown:
        raise ValueError(f"model types {unknown} are in neither registry of the installed transformers (causal LM, "
                         "image-text-to-text)")
    out = []
    for mt in model_types or list(causal):
        if mt in causal:
            out.append(check(mt, modes))
            if progress is not None:
                progress(out[-1])
    return out + vision_sweep([mt for mt in model_types or list(vision) if mt in vision], modes, progress)

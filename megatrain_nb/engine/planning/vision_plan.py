"""A vision-language model's vision tower in the plan, without torch: its shape from the
config, image tokens from a pixel budget, and the device bytes its backward holds.

Where the engine runs the vision tower (engine/vision.py): inside the ``embed`` unit, whose
weights (token embedding, vision tower, projector) are on the device for the whole step; per
micro-batch it runs in the capture without a graph and again in the embedding's backward with
its autograd graph, which then holds every vision layer's saved activations for the row's
patches at once (no checkpointing inside the vision tower). That graph is counted here beside a
decoder layer's re-run and the head's chunk (the larger of them is the step's working peak).
Image tokens are tokens of the row: ``Workload.seq`` counts them, as TRL's ``max_length`` does,
so the long-sequence tiling and the boundary activations count them as sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

#: Elements one vision layer keeps per patch for its backward (norms, q/k/v and their rotary
#: copies, attention output, the residuals: ~14 x width) and its MLP (~3 x its width); the
#: projector keeps ~6 x width per patch. Measured with saved-tensor hooks on a Qwen2-VL vision
#: tower (SDPA attention: benchmarks/bench_vlm.py ``vlm_vision_graph_vs_plan``).
_PER_WIDTH, _PER_MLP, _PROJECTOR = 14, 3, 6


@dataclass(frozen=True)
class VisionShape:
    """What the planner needs of a vision tower."""
    width: int                 # the vision layers' hidden size
    intermediate: int          # their MLP's width
    depth: int                 # vision layers
    patch_size: int            # pixels per patch side
    patches_per_token: int     # patches merged into one image token (Qwen-VL 4, Gemma 3 16, LLaVA 1)
    patch_inputs: int = 0      # input values per patch (channels x frames x patch^2: the patch embedding keeps them)

    @classmethod
    def of(cls, config) -> Optional["VisionShape"]:
        """From a vision-language model's transformers config; None for a text-only one."""
        vc = getattr(config, "vision_config", None)
        if vc is None:
            return None
        width = int(getattr(vc, "embed_dim", None) or getattr(vc, "hidden_size", 0) or 0)
        inter = getattr(vc, "intermediate_size", None) or int(float(getattr(vc, "mlp_ratio", 4) or 4) * width)
        depth = int(getattr(vc, "depth", None) or getattr(vc, "num_hidden_layers", 0) or 0)
        patch = int(getattr(vc, "patch_size", 14) or 14)
        inputs = int(getattr(vc, "in_channels", None) or getattr(vc, "num_channels", 3) or 3) * patch * patch \
            * int(getattr(vc, "temporal_patch_size", 1) or 1)
        return cls(width, int(inter), depth, patch, patches_per_token(config), inputs)

    def tokens_of_pixels(self, max_pixels: int) -> int:
        """Image tokens of an image of at most ``max_pixels`` pixels (a processor's budget)."""
        return max(1, int(max_pixels) // (self.patch_size ** 2 * self.patches_per_token))

    def work_bytes(self, *, batch: int, image_tokens: int, compute_bytes: int) -> int:
        """Device bytes of one micro-batch's vision graph in the embedding's backward (its saved
        activations and their gradients)."""
        patches = batch * image_tokens * self.patches_per_token
        per_patch = self.depth * (_PER_WIDTH * self.width + _PER_MLP * self.intermediate) \
            + _PROJECTOR * self.width + self.patch_inputs
        return patches * per_patch * compute_bytes


def patches_per_token(config) -> int:
    """Patches per image token of the family: Qwen-VL merges spatial_merge_size^2, Idefics3 and
    SmolVLM shuffle scale_factor^2, Gemma 3 pools the image's patches to mm_tokens_per_image,
    LLaVA (and LLaVA-NeXT per view) takes one per patch."""
    vc = getattr(config, "vision_config", None)
    merge = getattr(vc, "spatial_merge_size", None)
    if merge:
        return int(merge) ** 2
    if getattr(config, "scale_factor", None):
        return int(config.scale_factor) ** 2
    per_image = getattr(config, "mm_tokens_per_image", None)
    if per_image and getattr(vc, "image_size", None) and getattr(vc, "patch_size", None):
        return max(1, (int(vc.image_size) // int(vc.patch_size)) ** 2 // int(per_image))
    return 1


def image_tokens_of(config, image_tokens: Optional[int], max_pixels: Optional[int], seq: int) -> int:
    """Image tokens per row from ``image_tokens`` or ``max_pixels`` (the family's patch size and
    merge), checked against the model and the row's ``seq`` (which counts them)."""
    if image_tokens is None and max_pixels is None:
        return 0
    shape = VisionShape.of(config)
    if shape is None:
        raise ValueError(f"image_tokens/max_pixels given for {type(config).__name__}, which has no vision tower; "
                         "leave them out for a text-only model.")
    if image_tokens is not None and max_pixels is not None:
        raise ValueError("give image_tokens or max_pixels, not both (max_pixels is turned into image tokens with "
                         f"the family's patch size {shape.patch_size} and {shape.patches_per_token} patches per token).")
    tokens = int(image_tokens) if image_tokens is not None else shape.tokens_of_pixels(max_pixels)
    if tokens < 0 or tokens > seq:
        raise ValueError(f"{tokens} image tokens per row do not fit seq={seq}: seq counts every token of a row, "
                         "image tokens included (as TRL's max_length does); raise seq.")
    return tokens

"""A vision-language model's vision tower in the plan, without torch: its shape from the
config, image tokens from a pixel budget, and the device bytes its backward holds.

Where the engine runs the vision tower (engine/vision.py): inside the ``embed`` unit, whose
weights (token embedding, vision tower, projector) are on the device for the whole step; per
micro-batch it runs once, in the capture, with its autograd graph, which is kept until the
embedding's backward takes it: every vision layer's saved activations for the row's patches at
once (no checkpointing inside the vision tower), held through the layers' forward and backward.
That graph is counted here on top of a decoder layer's re-run or the head's chunk (the larger of
them), for the micro-batches whose graphs the plan's room holds (:func:`graphs_kept`).
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

    def boundary_bytes(self, *, batch: int, image_tokens: int, compute_bytes: int) -> int:
        """Device bytes of one micro-batch's vision blocks' inputs (the tower run by blocks keeps
        them from the capture to the embedding's backward)."""
        return self.depth * batch * image_tokens * self.patches_per_token * self.width * compute_bytes

    def block_bytes(self, *, batch: int, image_tokens: int, compute_bytes: int) -> int:
        """Device bytes of one vision block's graph, run again in the embedding's backward when the
        tower runs by blocks (its share of :meth:`work_bytes`: depth blocks and the projector)."""
        return self.work_bytes(batch=batch, image_tokens=image_tokens,
                               compute_bytes=compute_bytes) // max(1, self.depth + 1)

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


def tower_params(config) -> int:
    """The vision tower's and projector's parameters, from the config (about: within a few percent;
    biases and norms counted per layer, a gated MLP where the family's vision MLP is gated)."""
    shape = VisionShape.of(config)
    if shape is None:
        return 0
    vc = config.vision_config
    w, inter = shape.width, shape.intermediate
    gated = str(getattr(config, "model_type", "")).startswith("qwen2_5_vl")   # (SwiGLU: gate, up, down)
    per_layer = 4 * w * w + (3 if gated else 2) * w * inter + 9 * w + inter
    out = int(getattr(vc, "out_hidden_size", None) or getattr(text_config_of(config), "hidden_size", w) or w)
    head = per_layer if getattr(vc, "vision_use_head", False) else 0   # (SigLIP's pooling head, where it is kept)
    return (shape.depth * per_layer + head + shape.patch_inputs * w + _projector_params(config, shape, out)
            + 2 * w)


def _projector_params(config, shape: VisionShape, out: int) -> int:
    """The projector's matrices and the tower's position table, by the family's merge."""
    w, vc = shape.width, config.vision_config
    merged = w * shape.patches_per_token
    if getattr(vc, "spatial_merge_size", None):        # Qwen-VL's merger: an MLP over 2x2 merged patches
        return merged * merged + merged * out
    side = int(getattr(vc, "image_size", 0) or 0) // max(1, shape.patch_size)
    table = side * side * w                            # a learned position per patch (CLIP, SigLIP)
    if getattr(config, "scale_factor", None):           # Idefics3 / SmolVLM: pixel shuffle, one matrix
        return table + merged * out
    if getattr(config, "mm_tokens_per_image", None):    # Gemma 3: pooled, one matrix
        return table + w * out
    return table + w * out + out * out                 # LLaVA: a two-layer MLP


def text_config_of(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else getattr(config, "text_config", config)


@dataclass(frozen=True)
class VisionPlacement:
    """Where the vision tower sits for a step, three options counted.

    ``resident``: inside the ``embed`` unit: its weights on the device for the whole step, in once
    and their gradient out once per step, its whole graph held from the capture to the
    embedding's backward, and the embed unit (the largest unit: the device's gradient staging is
    sized by it) that much larger. ``blocks``: the same weights, but the tower's blocks run under
    activation checkpointing (engine/vision.ImageFeatures ``by_blocks``): the blocks' boundary
    activations held and one block's graph at a time, at the price of one more forward of the
    tower a micro-batch. ``streamed``: by vision blocks as the decoder layers stream (two block
    slots, one block's gradient, the blocks' boundary activations and one block's re-run), each
    block loaded twice per window (the capture and the backward) and its forward run once more.
    ``extra_*``: what ``streamed`` costs beyond ``resident`` per step (bytes moved host->device,
    FLOPs recomputed -- ``blocks`` recomputes the same FLOPs --, seconds at the given rates)."""
    choice: str                 # "resident" | "blocks" | "streamed"
    built: bool                 # whether the engine runs the choice (all three are built: compute/vision_stream.py)
    params: int
    resident_bytes: int         # device bytes the tower adds kept resident
    streamed_bytes: int         # ... streamed by blocks
    extra_h2d_bytes: int        # streamed: one more load of the tower's weights per step
    extra_flops: float          # blocks, streamed: one more forward of the tower per micro-batch
    extra_seconds: Optional[float]
    reason: str
    blocks_bytes: int = 0       # ... its weights resident, its graph by blocks

    @property
    def runs(self) -> str:
        """What the engine runs: the choice, or by blocks where the choice is not built."""
        return self.choice if self.built else "blocks"

    def words(self, fmt=None) -> str:
        """The estimate's and the run header's line (``fmt``: how bytes are written)."""
        fmt = fmt or _size
        cost = f"{fmt(self.extra_h2d_bytes)} more host->device and {_flops(self.extra_flops)} recomputed a step"
        if self.extra_seconds is not None:
            cost += f" (~{self.extra_seconds:.2f} s)"
        size = f"{self.params / 1e9:.2f}B" if self.params >= 1e8 else f"{self.params / 1e6:.2f}M"
        line = (f"vision tower ({size} parameters with its projector): {self.choice} -- resident "
                f"{fmt(self.resident_bytes)} on the device, by blocks (weights resident, each block's graph "
                f"re-run in the backward) {fmt(self.blocks_bytes)} and {_flops(self.extra_flops)} recomputed a step, "
                f"streamed by blocks {fmt(self.streamed_bytes)} but {cost}; {self.reason}")
        if self.built and self.choice == "streamed":
            line += (" (the engine streams it: two block slots on the device, each block loaded for the capture and "
                     "again for its re-run in the backward, its gradient sent to the host as it is done)")
        if not self.built:
            line += (" (streaming the tower's weights by blocks is not built: the engine runs it by blocks with its "
                     "weights resident, over the budget)")
        return line


def _size(b: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= 0.1 * scale:
            return f"{b / scale:.1f} {unit}"
    return f"{int(b)} B"


def _flops(f: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if f >= 0.1 * scale:
            return f"{f / scale:.2f} {unit}"
    return f"{f:.0f} FLOP"


def place_vision(config, *, batch: int, image_tokens: int, accumulation: int = 1, compute_bytes: int,
                 embed_numel: int, largest_other: int, device_total: int, device_budget: Optional[int],
                 cuda: bool = True, h2d_bytes_per_s: Optional[float] = None,
                 flops_per_s: Optional[float] = None) -> Optional[VisionPlacement]:
    """The placements of the vision tower counted and one picked (None: no vision tower).

    ``embed_numel``: the embed unit with the tower inside; ``largest_other``: the largest other
    unit (a layer or the head); ``device_total``: the plan's device bytes with the tower resident
    (its graph kept). Resident costs no extra transfer or recompute, so it is picked wherever the
    plan fits the device budget (or no budget is given); by blocks where that fits (one more
    forward of the tower, no transfer); streamed where only it fits; where nothing
    fits, by blocks (the least of what the engine runs; the plan says what to change)."""
    shape = VisionShape.of(config)
    if shape is None:
        return None
    p = min(tower_params(config), embed_numel)
    per_grad = (2 * 4 + compute_bytes) if cuda else 4          # the device's gradient staging per element
    graph = shape.work_bytes(batch=batch, image_tokens=image_tokens, compute_bytes=compute_bytes)
    # (the gradient staging is sized by the largest unit: the embed unit with the tower inside)
    staging_gain = (max(embed_numel, largest_other) - max(embed_numel - p, largest_other)) * per_grad
    resident = p * compute_bytes + staging_gain + graph
    block = max(1, p // max(1, shape.depth))
    boundary = shape.boundary_bytes(batch=batch, image_tokens=image_tokens, compute_bytes=compute_bytes)
    one_block = shape.block_bytes(batch=batch, image_tokens=image_tokens, compute_bytes=compute_bytes)
    by_blocks = p * compute_bytes + staging_gain + boundary + one_block
    streamed = 2 * block * compute_bytes + block * per_grad + boundary + one_block
    extra_h2d = p * compute_bytes                           # each block in twice per window, not once
    patches = batch * image_tokens * shape.patches_per_token
    extra_flops = 2.0 * p * patches * max(1, accumulation)   # each micro-batch's tower forward once more
    secs = None
    if h2d_bytes_per_s and flops_per_s:
        secs = extra_h2d / h2d_bytes_per_s + extra_flops / flops_per_s
    other = device_total - resident
    over = (f"resident the plan needs {device_total / 2 ** 30:.1f} GiB, over the "
            f"{device_budget / 2 ** 30:.1f} GiB budget" if device_budget is not None else "")
    if device_budget is None or device_total <= device_budget:
        choice, why = "resident", ("it fits the device budget" if device_budget is not None else "no device budget")
        why += ", and it moves and recomputes least"
    elif other + by_blocks <= device_budget:
        choice, why = "blocks", f"{over}; by blocks it needs {(other + by_blocks) / 2 ** 30:.1f} GiB, and moves nothing more"
    elif other + streamed <= device_budget:
        choice, why = "streamed", f"{over}; streamed it needs {(other + streamed) / 2 ** 30:.1f} GiB"
    else:
        choice, why = "blocks", "nothing fits the device budget; by blocks needs the least the engine runs, the plan " \
                                "says what to change"
    return VisionPlacement(choice, True, p, resident, streamed, extra_h2d, extra_flops, secs, why,
                           by_blocks)


def vision_placement(config, units, workload, *, device_total: int, device_budget: Optional[int], precision: str,
                     cuda: bool, rates=None) -> Optional[VisionPlacement]:
    """:func:`place_vision` for a plan's unit specs ``units`` and ``workload`` (None for a
    text-only model or a workload without image tokens); ``device_total``: the plan's device bytes
    for that workload."""
    if VisionShape.of(config) is None or not workload.image_tokens:
        return None
    bf16 = precision == "bf16"
    flops = getattr(rates, "bf16_matmul_flops" if bf16 else "matmul_flops", 0.0) if rates is not None else 0.0
    return place_vision(config, batch=workload.batch, image_tokens=workload.image_tokens,
                        accumulation=workload.accumulation, compute_bytes=2 if bf16 else 4,
                        embed_numel=max([u.numel for u in units if u.kind == "embed"] or [0]),
                        largest_other=max([u.numel for u in units if u.kind != "embed"] or [0]),
                        device_total=device_total, device_budget=device_budget, cuda=cuda,
                        h2d_bytes_per_s=getattr(rates, "h2d_pinned", None) if rates is not None else None,
                        flops_per_s=flops or None)


def vision_lines(config, plan, units, workload, device_budget: Optional[int], precision: str, cuda: bool,
                 rates=None) -> list:
    """The estimate's line on the vision tower's placement (:func:`vision_placement` at the plan's
    device bytes; none for a text-only model or a workload without image tokens)."""
    got = vision_placement(config, units, workload, device_total=plan.device["total"], device_budget=device_budget,
                           precision=precision, cuda=cuda, rates=rates)
    return [got.words()] if got is not None else []


def graphs_kept(config, workload, *, device_total: int, device_budget: Optional[int], precision: str,
                by_blocks: bool = False) -> Optional[int]:
    """How many micro-batches of a group keep the vision tower's autograd graph from the capture
    to the embedding's backward (``engine/vision.ImageFeatures.keep``; the others run the tower
    again there). None (all) without a device budget or for a model without a vision tower; else
    the one micro-batch's graph the plan counts (:func:`.planner.activation_bytes`; ``device_total``
    is the plan's with the whole graph) and as many more as the budget's room holds; ``by_blocks``:
    a graph is the blocks' inputs (:meth:`VisionShape.boundary_bytes`), and the micro-batch whose
    backward runs holds one block's graph, run again, beside them (:meth:`VisionShape.block_bytes`)."""
    shape = VisionShape.of(config)
    if shape is None or device_budget is None:
        return None
    size = dict(batch=workload.batch, image_tokens=workload.image_tokens, compute_bytes=2 if precision == "bf16" else 4)
    graph = shape.work_bytes(**size)
    held = shape.boundary_bytes(**size) if by_blocks else graph
    rerun = shape.block_bytes(**size) if by_blocks else 0
    if held <= 0:
        return 1
    return 1 + max(0, int(device_budget) - (int(device_total) - graph + held + rerun)) // held

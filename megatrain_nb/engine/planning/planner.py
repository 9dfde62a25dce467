"""MemoryPlanner: budgets + model + batch shape -> placement and schedule, or a clear refusal.

One place knows the byte arithmetic of the tiers; the engine uses it to size device slots and
refuse impossible budgets, and the estimator (``mt.estimate``) prints the same numbers.

No torch at import (tests/test_planning_light.py: ``megatrain-nb --help`` reads the estimate's
arguments): the engine's modules whose rules it applies (the codecs, the staging and pinned
buffers, the update chunks, the MLP tiles) import torch, so it imports them where a plan is made.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from ..family import hidden_size, intermediate_size, text_config, vocab_size
from ..tiers.staging import disk_staging_buffers
from .vision_plan import VisionShape

GiB = 1024 ** 3
#: Share of the host budget that layer-boundary activations leave free (see make_plan).
HOST_HEADROOM = 0.1


@dataclass
class UnitSpec:
    name: str
    numel: int
    kind: str  # "embed" | "layer" | "head"
    tied_output: bool = False   # (embed) also the output embedding (units.Unit.tied_output)


def window_sum_bytes(units: List[UnitSpec]) -> int:
    """Peak device bytes of a layer-major window's fp32 gradient sums (step.StepRunner):
    one unit's at a time (the head's, each layer's, the embedding's at the end); a tied
    embedding's sum is formed from the head pass on, so it sits beside each of the others."""
    by_kind = {k: max([u.numel for u in units if u.kind == k] or [0]) for k in ("embed", "layer", "head")}
    if any(u.tied_output for u in units if u.kind == "embed"):
        return 4 * (by_kind["embed"] + max(by_kind["layer"], by_kind["head"]))
    return 4 * max(by_kind.values())


def unit_specs_from_config(config) -> List[UnitSpec]:
    """Unit sizes of a transformers config, built on the meta device (no memory, no download)."""
    import torch

    from ..units import auto_model_class, build_units, find_layer_list   # light: torch at plan time only

    with torch.device("meta"):   # (a vision-language model's own class: its vision tower in the embed unit)
        model = auto_model_class(config).from_config(config)
    _, _, layers = find_layer_list(model)
    return [UnitSpec(u.name, u.numel, u.kind, u.tied_output) for u in build_units(model, layers)]


def _smaller_codec_hint(compression: str) -> str:
    """Advice to compress further, only where a smaller codec exists (int8 is not compressed again)."""
    smaller = {"none": "'int8' (or 'int4')", "int8": "'int4'"}.get(compression)
    return f", or store the optimizer states smaller: optimizer_compression={smaller}" if smaller else ""


def codec_bytes_per_param(compression: str) -> float:
    """Stored bytes per parameter for both Adam moments together."""
    return _codec_facts(compression)[0]


def codec_in_blocks(compression: str) -> bool:
    """Whether ``compression`` stores whole blocks that decode alone (``codecs.sliceable``): its
    states are then updated in chunks (``states.update_chunk``), on the disk tier without a host
    cache read and written range by range inside each update."""
    return compression != "none" and _codec_facts(compression)[1]


def _codec_facts(compression: str):
    """(stored bytes per parameter of both moments, whether both roles' codecs store blocks)."""
    from ..updates.codecs import ROLES, get_codec, sliceable   # light: torch at plan time only

    n = 1 << 20
    codecs = [get_codec(compression, role) for role in ROLES]
    return sum(c.encoded_nbytes(n) for c in codecs) / n, all(sliceable(c) for c in codecs)


@dataclass
class Plan:
    device: Dict[str, int]
    host: Dict[str, int]
    disk: Dict[str, int]
    placement: Dict[str, str]
    layer_slots: int
    checkpoint_interval: int
    feasible: bool
    limiting_tier: Optional[str]
    reason: str
    capacity: Dict[str, Optional[int]] = field(default_factory=dict)
    #: With accumulation > 1: the window's layout (WindowPlan.to_dict()) and tokens per weight fetch.
    window: Optional[dict] = None
    #: Device bytes a layer-major window's gradient sums take (``window_sum_bytes``; in
    #: ``device["grad_sums"]`` when ``window`` is planned here, else taken by engine_window_plan).
    window_sum_bytes: int = 0
    #: Tokens per tile of a layer's MLP over a long row (engine/compute/tiling.py; 0: untiled).
    tile_tokens: int = 0
    #: Tokens per row of the workload planned, and the longest that fits the device budget.
    seq: int = 0
    longest_seq: Optional[int] = None
    #: How the planner's choices were made: "predicted step ..., fastest of N feasible ..." or
    #: "rules: ..." and why (``plan_pick.pick_plan``; "" for a plan made by make_plan alone).
    chosen_by: str = ""
    #: The EngineConfig fields the predicted pick set (``best_plans.CHOICES``); None: the rules'.
    choice: Optional[dict] = None

    def to_dict(self) -> dict:
        return asdict(self)


def persistent_device_bytes(plan: Plan) -> int:
    """Device bytes that stay allocated between the engine's steps: the weight slots and the
    gradient staging buffers (``plan.device["weights"]`` + ``["grads"]``, what the pager allocates
    once). Not the activations, a window's boundary activations nor its gradient sums: a step
    frees them at its end. What another phase between steps (a GRPO run's generation:
    ``estimator_grpo.plan_generation``, ``decode.device_left``) has beside it is the device
    budget less these; the step's transient bytes are the step's alone."""
    return int(plan.device["weights"]) + int(plan.device["grads"])


def persistent_host_bytes(plan: Plan) -> int:
    """Host bytes the plan keeps between steps: its host total less the boundary activations a
    step parks in host RAM (``host["activations"]``: a window's or a long row's, freed at the
    step's end). The master weights, gradients, optimizer states and buffers in flight stay."""
    return int(plan.host["total"]) - int(plan.host.get("activations", 0))


def _disk_weights_in_flight(u: int, depth: int, chunk: int, ring: int, held, pin: bool, compute_bytes: int) -> int:
    """Host bytes of the master weights on the disk tier in flight (``u``: the largest unit; large:
    over 256 MiB): the compute stream's staging buffers (``3 + depth``, large units 2: ``staging.disk_staging_buffers``), each a unit
    in the compute dtype where it is narrower (on CUDA, no host cache: the tier's compute-dtype
    copy, ``weight_store.DiskWeights``' ``shadow``, is what a load reads, so no cast buffer
    either), else fp32 -- pinned (``held``: ``pinned.held_bytes``) as the loads' source; and the
    optimizer's: ``ring`` chunks (chunked updates), else its buffers (2, large units 1: pinned in
    fp32 compute; with the copy pageable, and beside each the update's cast of it, being written)."""
    compute, optimizer = disk_staging_buffers(u, depth)
    out = compute * held(u * compute_bytes, pin)
    if chunk:
        return out + ring * chunk * 4
    return out + optimizer * (u * 4 + u * compute_bytes if compute_bytes < 4 else held(u * 4, pin))


def host_in_flight(units: List[UnitSpec], compression: str, *, weights_on_disk: bool, states_on_disk: bool,
                   cuda: bool, clipped: bool, depth: int = 1, chunk_numel: int = 1 << 20, compute_bytes: int = 4,
                   hold_disk: bool = False, pinned: Optional[bool] = None) -> int:
    """Host RAM the engine's code holds in flight besides the stored state, as it allocates
    it (``u``: the largest unit; "large": over 256 MiB, ``staging.SMALL_UNIT_BYTES``):

    * master weights on the disk tier: the compute stream's staging buffers (``3 + depth``,
      large units 2: ``staging.disk_staging_buffers``), each ``u``, and the optimizer stream's (2, large units 1), each ``u``,
      or with chunked updates ``RING`` chunks' buffers: an update not handed its backward's
      buffer reads and writes its weights range by range, a chunk ahead and a chunk behind
      (``weight_store.DiskWeights.ranged_update``, ``chunk_ring.ChunkRing.run``;
      layer statistics, once turned on, read such a unit whole into the optimizer stream's
      buffers, not counted here) (``parts.build_parts``);
    * final gradients: on CUDA the landing buffers (``landing.landing_host_bytes``: the
      ``depth`` units being updated in them and the one next in line,
      ``intake.GradientIntake.arrived``; pinned, or pageable behind a ring of pinned chunks); on
      a CPU "device" ``depth`` pool buffers and one more (the window's sum being formed, a lent
      pool buffer) and a tied embedding's sum; + 2 when
      a clipping norm is waited for (the hold's disk writes; on CUDA one more: a held gradient
      is copied out of its staging buffer into a pool buffer) -- except, on CUDA, where the
      held gradients wait on the disk tier (``hold_disk``): each is written straight from its
      staging buffer (``intake.GradientIntake._hold_staged``) and an update in chunks reads it
      back a chunk at a time into ``RING`` chunk buffers (``final_grads.HeldGradient``); states
      updated whole read it into one unit-sized buffer;
    * compressed optimizer states, updated in chunks (``states.OptimizerStates.update``): the
      fp32 moments of ``RING`` chunks (at most the largest unit's size, ``states.update_chunk``);
      on the disk tier the codes of those chunks only, read from the unit's file and written to
      its new version range by range (``states.OptimizerStates.ranged_io``,
      ``disk_store.DiskStore.ranged``: nothing read ahead nor written behind); in RAM a new
      set of the unit's codes;
      fp32 states on the disk tier are read into and written from whole-unit buffers (the unit
      being updated, reads ahead, writes behind); fp32 states in RAM are updated in place.
    * no cast buffer: with a compute dtype narrower than fp32 on CUDA a RAM-tier load copies the
      unit's compute-dtype shadow (``host_store.HostStore.source``, written by its update) and a
      disk-tier load without a host cache the tier's compute-dtype copy (``DiskWeights``'
      ``shadow``): nothing is cast at load time (only a disk tier behind a host cache casts, into
      ``transport.CudaTransport._cast_in``'s buffer; this count is the tier without a cache).
    Pinned buffers (``pinned``, default ``cuda``: the weight staging of the disk tier and the
    gradient staging) count as ``pinned.held_bytes`` says: registered at their
    exact size (whole pages) where CUDA allows, else at the caching host allocator's power of two
    (a 5.8 GiB unit would hold 8 GiB); the rest as allocated.
    (Without a host cache of the disk tier: the estimate's least host RAM.)
    """
    from ..updates.chunk_ring import RING   # light: torch at plan time only
    from ..updates.states import min_reads_ahead, update_chunk, writes_pending   # light: torch at plan time only
    from ..updates.final_grads import HOLD_WRITES   # light: torch at plan time only
    from ..transport.landing import landing_host_bytes   # light: torch at plan time only

    from ..transport.pinned import held_bytes   # light: torch at plan time only

    if not units:
        return 0
    u = max(x.numel for x in units)
    pin = cuda if pinned is None else pinned
    out = 0
    chunk = update_chunk(compression, chunk_numel, u)
    if weights_on_disk:   # compute staging; the optimizer's, or (chunked updates) one chunk's
        out += _disk_weights_in_flight(u, depth, chunk, RING, held_bytes, pin, compute_bytes if cuda else 4)
    tied = any(x.tied_output for x in units if x.kind == "embed")
    if cuda and clipped and hold_disk:   # written from the staging buffers, read back in chunks
        out += landing_host_bytes(u, depth, pin) + (0 if chunk else 1) * u * 4
    elif cuda:   # clipped: a held gradient is copied out of its staging buffer (+ the hold's writes)
        out += landing_host_bytes(u, depth, pin) + (HOLD_WRITES + 1 if clipped else 0) * u * 4
    else:
        out += (depth + 1 + int(tied) + (HOLD_WRITES if clipped else 0)) * u * 4
    if cuda and clipped and hold_disk and chunk:   # the ring's chunks of a held gradient read back (a CPU
        # "device" counts a whole unit for the read-back above, which covers them)
        out += RING * chunk * 4
    if compression == "none":
        if states_on_disk:
            out += (1 + min_reads_ahead(8 * u) + writes_pending(8 * u, False)) * 8 * u
    else:
        out += RING * 8 * chunk   # the fp32 moments of the ring's chunks
        if states_on_disk and chunk:   # codes read and written range by range (states.ranged_io)
            out += RING * int(chunk * codec_bytes_per_param(compression))
        else:   # a new set of codes in RAM
            out += int(u * codec_bytes_per_param(compression))
    return out


#: Families whose layers norm the hidden state four times (around attention and around the MLP).
SANDWICH_NORMS = ("gemma2", "gemma3", "gemma3_text")
#: Families with per-head RMSNorms on the queries and keys (``q_norm`` / ``k_norm``).
QK_NORMS = ("qwen3", "qwen3_moe", "qwen3_vl_text", "gemma3", "gemma3_text", "olmo2", "olmo3")


@dataclass(frozen=True)
class LayerDims:
    """A decoder layer's widths as its saved activations depend on them (0: derived from
    ``hidden``: as many heads of query as of key/value, one head the width of the model)."""
    hidden: int
    inter: int
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    norms: int = 2              # hidden-wide RMSNorms a layer applies
    qk_norm: bool = False       # per-head norms on q and k
    norm_fp32: bool = False     # the norm's weight applied in fp32 (Gemma's ``1 + weight``)

    def head_size(self) -> int:
        """An attention head's width (the config's, else the hidden size over the heads)."""
        return self.head_dim or self.hidden // (self.heads or 1)

    def query_width(self) -> int:
        """The query heads' width together (the attention's ``h`` in its FLOPs)."""
        return (self.heads or 1) * self.head_size()

    def saved_bytes(self, tokens: int, mlp_tokens: int, cb: int) -> int:
        """Bytes autograd saves running one layer over ``tokens`` (the MLP over ``mlp_tokens``: one
        tile), counted from the ops of a Llama-style layer (tests/engine/test_activation_plan.py
        checks it against the saved tensors' storages of llama, qwen2, qwen3, gemma layers):
        each RMSNorm its input in fp32, its fp32 rsqrt, the normed input and its output (where
        the weight is applied in fp32 the normed input is fp32, the output is not saved -- the
        projections save the compute-dtype copy -- and ``1 + weight`` is, once); attention its
        q, k, v after RoPE, its output and log-sum-exp, RoPE's cos and sin; a gated MLP gate, up,
        act(gate) and their product.
        The layer's input is the first norm's input."""
        heads, hd = self.heads or 1, self.head_size()
        q, kv = self.query_width(), (self.kv_heads or heads) * hd
        norm_w = (8 + cb) if self.norm_fp32 else (4 + 2 * cb)       # bytes per element of the norm's width
        norms = self.norms * (self.hidden * norm_w + 4)
        attn = (2 * q + 2 * kv + 2 * hd) * cb + heads * 4
        qk = ((q + kv) * (4 + cb) + (heads + (self.kv_heads or heads)) * 4) if self.qk_norm else 0
        weights = self.norms * self.hidden * 4 if self.norm_fp32 else 0    # Gemma's fp32 ``1 + weight``
        return tokens * (norms + attn + qk) + mlp_tokens * 4 * self.inter * cb + weights

    def work_bytes(self, tokens: int, mlp_tokens: int, cb: int) -> int:
        """A layer re-run's device peak in its backward: the saved tensors, its output, and the
        gradients of the two widest intermediates in flight at once (the MLP's: act(gate)'s and
        up's, computed from their product's while both are still saved)."""
        widest = max(mlp_tokens * self.inter * cb, tokens * self.hidden * 4)
        return self.saved_bytes(tokens, mlp_tokens, cb) + tokens * self.hidden * cb + 2 * widest

    @classmethod
    def of(cls, model_config) -> "LayerDims":
        t = text_config(model_config)
        kind = str(getattr(t, "model_type", ""))
        heads = int(getattr(t, "num_attention_heads", 0) or 0)
        return cls(hidden_size(model_config), intermediate_size(model_config) or 4 * hidden_size(model_config),
                   heads, int(getattr(t, "num_key_value_heads", 0) or heads), int(getattr(t, "head_dim", 0) or 0),
                   4 if kind in SANDWICH_NORMS else 2, kind in QK_NORMS, kind.startswith("gemma"))


def activation_bytes(*, hidden_size: int, intermediate_size: int, num_layers: int, vocab_size: int,
                     batch: int, seq: int, checkpoint_interval: int, compute_bytes: int,
                     loss_chunk_tokens: int = 1024, num_heads: int = 0, eager_attention: bool = False,
                     tile_tokens: Optional[int] = None, vision_bytes: int = 0,
                     dims: Optional[LayerDims] = None) -> int:
    """Device bytes for activations of one micro-batch (an estimate; the engine also measures).
    ``tile_tokens``: the MLP runs in tiles of that many tokens (engine/compute/tiling.py; None or 0: whole).
    ``vision_bytes``: a vision tower's graph, kept from the capture to the embedding's backward
    (``vision_plan``; engine/vision.ImageFeatures), so held beside a layer's re-run and the head's chunk.
    ``dims``: the layer's attention widths and norms (:class:`LayerDims`; None: from the widths)."""
    tok = batch * seq
    dims = dims or LayerDims(hidden_size, intermediate_size, num_heads)
    mlp_tok = min(tok, tile_tokens or tok)
    # One layer re-run under autograd: its saved activations and the gradients in flight (LayerDims).
    layer_work = dims.work_bytes(tok, mlp_tok, compute_bytes)
    if eager_attention and num_heads:
        layer_work += 2 * batch * num_heads * seq * seq * compute_bytes
    if checkpoint_interval == 0:  # every layer's autograd graph kept for the step
        saved_inputs = num_layers * (dims.saved_bytes(tok, mlp_tok, compute_bytes) + tok * hidden_size * compute_bytes)
        block_inputs = 0
    else:
        k = max(1, checkpoint_interval)
        saved_inputs = math.ceil(num_layers / k) * tok * hidden_size * compute_bytes
        block_inputs = (k - 1) * tok * hidden_size * compute_bytes
    # the head's chunk: loss_chunk_tokens over the batch's rows (engine/compute/loss_head._chunk)
    chunk = max(1, min(seq, loss_chunk_tokens // max(batch, 1)))
    head_work = 3 * batch * chunk * vocab_size * 4 + 2 * tok * hidden_size * 4
    return saved_inputs + block_inputs + vision_bytes + max(layer_work, head_work)


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model beyond its units' sizes."""
    hidden_size: int
    num_layers: int
    intermediate_size: Optional[int] = None
    vocab_size: int = 0
    vision: Optional[VisionShape] = None   # a vision-language model's vision tower (vision_plan.py)
    dims: Optional[LayerDims] = None       # a layer's attention widths and norms (None: from the widths)

    def layer(self) -> LayerDims:
        """The decoder layer's dimensions as its activations are planned."""
        return self.dims or LayerDims(self.hidden_size, self.intermediate_size or 4 * self.hidden_size)

    @classmethod
    def of(cls, model_config, *, logits: bool = True) -> "ModelShape":
        """From a transformers config (``logits`` False: the head's logits are not planned)."""
        layers = int(getattr(text_config(model_config), "num_hidden_layers", 0) or 0)
        return cls(hidden_size(model_config), layers, intermediate_size(model_config),
                   int(vocab_size(model_config) or 0) if logits else 0, VisionShape.of(model_config),
                   LayerDims.of(model_config))


@dataclass(frozen=True)
class Workload:
    """What a step trains on: ``batch`` x ``seq`` tokens per micro-batch, ``accumulation``
    micro-batches per optimizer step (> 1: planned as one layer-major window), and where a
    whole model's fp32 gradients are: ``gradients`` "none" (a layer-major step without
    clipping), "held" (final gradients waiting for a clipping norm: ``EngineConfig.clip_hold``
    decides RAM or disk) or "accumulator" (micro-batch-major accumulation: RAM)."""
    batch: int = 1
    seq: int = 2048
    accumulation: int = 1
    gradients: str = "held"
    clipped: bool = True
    image_tokens: int = 0   # per row, counted in seq (a vision-language model's images: vision_plan.py)


@dataclass
class _PlanInputs:
    """What make_plan's steps share: the budgets, the workload and the unit sizes."""
    units: List[UnitSpec]
    held: List[UnitSpec]                # whole units, or this rank's shards
    shape: ModelShape
    cfg: object
    cuda: bool
    workload: Workload
    disk_bytes: Optional[int]
    vram_bytes: Optional[int]
    host_bytes: Optional[int]
    cb: int                             # compute bytes per element
    inter: int                          # intermediate size
    by_kind: Dict[str, int]             # the largest unit of each kind (device working set)
    total: int                          # parameters whose state this process holds
    rows: int = 1                       # tokens a row the engine's slots must leave room for (engine_plan)

    @classmethod
    def of(cls, units, shape, cfg, cuda, workload, disk_bytes, state_units) -> "_PlanInputs":
        held = units if state_units is None else state_units
        return cls(units=units, held=held, shape=shape, cfg=cfg, cuda=cuda, workload=workload, disk_bytes=disk_bytes,
                   vram_bytes=int(cfg.max_vram_gb * GiB) if cfg.max_vram_gb else None,
                   host_bytes=int(cfg.max_host_gb * GiB) if cfg.max_host_gb else None,
                   cb=2 if cfg.precision == "bf16" else 4, inter=shape.intermediate_size or 4 * shape.hidden_size,
                   by_kind={k: max([u.numel for u in units if u.kind == k] or [0]) for k in ("embed", "layer", "head")},
                   total=sum(u.numel for u in held))

    @property
    def tile(self) -> int:
        """Tokens per tile of a layer's MLP as the engine tiles (``tiling.tile_tokens_for``: 0 where a
        micro-batch's MLP fits the device budget, else from the MLP width and the budget; or
        ``EngineOverrides.tile_tokens``; 0: untiled)."""
        from ..compute.tiling import tile_tokens_for   # light: torch at plan time only
        return tile_tokens_for(self.inter, self.workload.batch * self.workload.seq, self.cb, self.vram_bytes,
                               self.cfg.overrides.tile_tokens)

    def boundary(self, k: int) -> int:
        """Device bytes of one micro-batch's layer-boundary activations at interval ``k`` (the input
        of every k-th layer, kept from the forward for the backward; what may leave the device)."""
        if k == 0:
            return 0
        tok = self.workload.batch * self.workload.seq
        return math.ceil(self.shape.num_layers / k) * tok * self.shape.hidden_size * self.cb

    def fits(self, need: Dict[str, int], k: int) -> bool:
        """Whether ``need`` fits the device budget, with a single micro-batch's boundary
        activations moved to host RAM or the disk tier where they alone do not (long rows)."""
        if self.vram_bytes is None or need["total"] <= self.vram_bytes:
            return True
        return self.workload.accumulation == 1 and need["total"] - self.boundary(k) <= self.vram_bytes

    def device_need(self, slots: int, k: int) -> Dict[str, int]:
        """Device bytes of ``slots`` layer slots at checkpoint interval ``k``. A layer-major window
        (``accumulation`` > 1): the least it runs in (:meth:`window_least`), its gradient sums
        in ``grad_sums``: slots and intervals are chosen so that it fits."""
        by_kind, dev_max_unit = self.by_kind, max(u.numel for u in self.units)
        w = (by_kind["embed"] + by_kind["head"] + slots * by_kind["layer"]) * self.cb
        # CUDA: two fp32 staging buffers, and a unit's autograd.grad outputs in the compute
        # dtype until they are copied into one; a CPU "device" sums into a lent pool buffer
        grads = (2 * dev_max_unit * 4 + dev_max_unit * self.cb) if self.cuda else dev_max_unit * 4
        if self.workload.accumulation > 1:
            act, sums = self.window_least(k), window_sum_bytes(self.units)
            return {"weights": w, "grads": grads, "grad_sums": sums, "activations": act,
                    "total": w + grads + sums + act}
        act = self.activations(k)
        return {"weights": w, "grads": grads, "activations": act, "total": w + grads + act}

    def window_least(self, k: int) -> int:
        """Activation bytes on the device of the least layer-major window at interval ``k``: one
        layer's re-run or the head's chunk, and a group of one micro-batch (``window_sizes``: its
        fronts and block inputs; its boundary activations too at ``k`` 0, where they cannot leave
        the device). Where host RAM or the disk tier cannot hold the boundaries either, make_plan
        refuses the plan (``WindowPlan.fits``)."""
        saved, work = window_sizes(k, self.workload.batch * self.workload.seq, self.shape.hidden_size,
                                   self.shape.num_layers, self.cb, self.shape.layer().work_bytes(1, 1, self.cb))
        return self.activations(k, num_layers=0) + work + (saved if k == 0 else 0)

    def activations(self, k: int, num_layers: Optional[int] = None) -> int:
        """One micro-batch's activation bytes at checkpoint interval ``k`` (``num_layers`` 0:
        only the working set of one layer's re-run or the head's chunk, no saved inputs)."""
        return activation_bytes(hidden_size=self.shape.hidden_size, intermediate_size=self.inter,
                                num_layers=self.shape.num_layers if num_layers is None else num_layers,
                                vocab_size=self.shape.vocab_size, batch=self.workload.batch, seq=self.workload.seq,
                                checkpoint_interval=k, compute_bytes=self.cb,
                                loss_chunk_tokens=self.cfg.overrides.loss_chunk_tokens, tile_tokens=self.tile,
                                vision_bytes=self.vision_bytes(), dims=self.shape.layer())

    def vision_bytes(self) -> int:
        """One micro-batch's vision graph in the embedding's backward (0: no images planned)."""
        v, w = self.shape.vision, self.workload
        return v.work_bytes(batch=w.batch, image_tokens=w.image_tokens, compute_bytes=self.cb) if v else 0

    def pinned_units(self, per_param: int = 4, pinned: Optional[bool] = None) -> int:
        """Bytes of one host buffer of ``per_param`` B/param per held unit as the process holds
        them: pinned (default: on CUDA), each as ``pinned.held_bytes`` counts it (exact where
        registration works, else its power of two)."""
        from ..transport.pinned import held_bytes   # light: torch at plan time only
        pin = self.cuda if pinned is None else pinned
        return sum(held_bytes(u.numel * per_param, pin) for u in self.held)

    def host_weights(self) -> int:
        """The master weights in RAM (``HostStore``, one buffer per unit): pinned on CUDA as the
        loads' copy source; with a narrower compute dtype on CUDA each unit's compute-dtype shadow
        beside them instead (pinned, what a load copies, written by the unit's update) and the
        masters pageable (only the AdamW worker reads them): ``host_store.pinned_layout``."""
        if not (self.cuda and self.cb < 4):
            return self.pinned_units()
        return self.pinned_units(4, pinned=False) + self.pinned_units(self.cb)

    def in_flight(self, weights_on_disk: bool, hold_disk: bool = False) -> int:
        w = self.workload
        return host_in_flight(self.held, self.cfg.optimizer_compression, weights_on_disk=weights_on_disk,
                              states_on_disk=bool(self.cfg.offload_dir), cuda=self.cuda,
                              clipped=w.clipped and w.gradients != "accumulator",
                              depth=self.cfg.overrides.inflight_depth,
                              chunk_numel=self.cfg.overrides.update_chunk_numel, compute_bytes=self.cb,
                              hold_disk=hold_disk)


def _device_schedule(p: _PlanInputs):
    """The checkpoint interval and layer slots: (k, device figures, slots, feasible, limiting, reason)."""
    checkpoint_interval, layer_slots = p.cfg.checkpoint_interval, p.cfg.overrides.device_slots
    num_layers, vram_bytes = p.shape.num_layers, p.vram_bytes
    if checkpoint_interval == 0:  # no recompute: every layer resident for the step
        layer_slots = max(num_layers, 1)
    candidates = [checkpoint_interval] if checkpoint_interval is not None else sorted(
        {1, 2, 3, 4, max(1, int(math.sqrt(num_layers))), max(1, num_layers)})
    chosen_k, dev = None, None
    for k in candidates:
        need = p.device_need(layer_slots or 2, k)
        if p.fits(need, k):
            chosen_k, dev = k, need
            break
    feasible, limiting, reason = True, None, "fits"
    if chosen_k is None:
        chosen_k = candidates[0]
        dev = p.device_need(layer_slots or 2, chosen_k)
        feasible, limiting = False, "device"
        reason = _device_refusal(p, dev, chosen_k, p.device_need(2, max(candidates)), max(candidates))
    slots = layer_slots or 2
    if layer_slots is None and vram_bytes is not None and feasible:
        off = p.boundary(chosen_k) if dev["total"] > vram_bytes else 0   # boundaries already off the device
        while (slots < 4 and dev["total"] - off + p.by_kind["layer"] * p.cb <= vram_bytes
               and _keeps_rows(p, slots, chosen_k)):
            slots += 1
            dev = p.device_need(slots, chosen_k)
    return chosen_k, dev, slots, feasible, limiting, reason


def _keeps_rows(p: _PlanInputs, slots: int, k: int) -> bool:
    """Whether one more layer slot still leaves the device room for the rows the engine was told
    of (``p.rows`` tokens, or the longest that fits beside ``slots`` where that is shorter): an
    extra slot only prefetches, so it never shortens the rows the budget holds below them."""
    if p.rows <= 1:
        return True
    return longest_seq(p, upper=p.rows, slots=slots + 1, k=k) >= longest_seq(p, upper=p.rows, slots=slots, k=k)


def _device_refusal(p: _PlanInputs, dev: dict, k: int, minimal: dict, k_min: int) -> str:
    """Why the device cannot run the workload, with the numbers: the working set (without the
    boundary activations a single micro-batch may keep off the device), the MLP's tile, the
    budget, and the longest sequence that fits (:func:`longest_seq`, computed)."""
    w, vram = p.workload, p.vram_bytes
    single = w.accumulation == 1
    off = p.boundary(k) if single else 0
    need = dev["total"] - off
    rows = f"{w.batch} rows of " if w.batch > 1 else ""
    tile = f"its MLP in tiles of {p.tile:,} tokens" if p.tile and p.tile < w.batch * w.seq else "its MLP untiled"
    tokens = f"{w.seq:,} tokens need" if w.batch > 1 or w.seq != 1 else "one token needs"
    text = (f"{rows}{tokens} {need / GiB:.2f} GiB of device working set (weights slots "
            f"{dev['weights'] / GiB:.2f} GiB, gradient buffers {dev['grads'] / GiB:.2f} GiB, "
            + (f"the window's gradient sums {dev['grad_sums'] / GiB:.2f} GiB and one micro-batch's work, "
               if "grad_sums" in dev else "") + f"one layer's "
            f"activations with {tile} and the checkpoint inputs {(dev['activations'] - off) / GiB:.2f} GiB"
            + (f"; the boundary activations, {off / GiB:.2f} GiB, may wait in host RAM or on disk" if off else "")
            + f") but max_vram_gb allows {vram / GiB:.2f} GiB")
    if k_min != k:
        text += f"; the smallest plan (2 layer slots, checkpoint interval {k_min}) needs " \
                f"{(minimal['total'] - (p.boundary(k_min) if single else 0)) / GiB:.2f} GiB"
    most = longest_seq(p)
    if most:
        return text + f"; the longest sequence that fits is {most:,} tokens: raise max_vram_gb or shorten the " \
                      f"batch/sequence to {most:,} tokens"
    return text + "; no sequence fits (the weights slots and gradient buffers alone): raise max_vram_gb"


def longest_seq(p: _PlanInputs, upper: int = 1 << 24, slots: Optional[int] = None, k: Optional[int] = None) -> int:
    """The longest sequence (tokens per row, at ``p``'s batch) whose device working set fits the
    budget beside ``slots`` layer slots (None: the least plan's, ``device_slots`` or 2; a plan's
    own: ``plan.layer_slots``, the slots its engine holds) at checkpoint interval ``k`` (None:
    any the planner may choose; a plan's own: the interval its engine runs) under the same rules
    as ``p``'s workload (bisection over the planner's own arithmetic; 0: not even one token; ``upper``: no
    budget or every length up to it fits)."""
    import dataclasses

    if p.vram_bytes is None:
        return upper
    ks = [k] if k is not None else [p.cfg.checkpoint_interval] if p.cfg.checkpoint_interval is not None else sorted(
        {1, 2, 3, 4, max(1, int(math.sqrt(p.shape.num_layers))), max(1, p.shape.num_layers)})
    if slots is None:
        slots = max(p.shape.num_layers, 1) if p.cfg.checkpoint_interval == 0 else p.cfg.overrides.device_slots or 2

    def ok(seq: int) -> bool:
        q = dataclasses.replace(p, workload=dataclasses.replace(p.workload, seq=seq))
        return any(q.fits(q.device_need(slots, k), k) for k in ks)

    lo, hi = 0, upper
    if ok(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _host_placement(p: _PlanInputs):
    """Gradients always on the host (or held on the disk tier for a clipping norm); optimizer
    states to disk when a disk tier exists; master weights to disk when the host budget cannot
    hold them (or when forced). Returns (placement, host figures, grads on disk, weights, states)."""
    cfg, offload_dir, offload_params = p.cfg, bool(p.cfg.offload_dir), p.cfg.offload_params
    states = int(p.total * codec_bytes_per_param(cfg.optimizer_compression))
    weights, grads = p.total * 4, (p.total * 4 if p.workload.gradients != "none" else 0)
    if p.workload.gradients == "accumulator":   # HostStore's buffers (pinned on CUDA); a hold's are not
        grads = p.pinned_units()
    clip_hold = cfg.clip_hold if p.workload.gradients == "held" else None
    placement = {"gradients": "host", "master_weights": "host",
                 "optimizer_states": "disk" if offload_dir else "host"}
    host_states = 0 if offload_dir else states
    # Final gradients held for a clipping norm may wait on the disk tier (an accumulator may
    # not). "auto": there only when the host budget cannot hold them beside the master
    # weights; they move before the master weights do (one write and one read per step,
    # where weights on disk are also read by every forward).
    host_weights = p.host_weights()   # HostStore's buffers, one per unit (and the shadows)
    host_rest = ((0 if offload_params else host_weights) + (0 if offload_dir else states)
                 + p.in_flight(bool(offload_params)))   # the host's other needs, as counted below
    grads_on_disk = bool(offload_dir and grads) and (clip_hold == "disk" or (
        clip_hold == "auto" and p.host_bytes is not None and host_rest + grads > p.host_bytes))
    if grads_on_disk:
        placement["gradients"] = "disk"
        grads = 0
    if offload_params or (offload_params is None and offload_dir and p.host_bytes is not None
                          and host_weights + grads + host_states + p.in_flight(False) > p.host_bytes):
        placement["master_weights"] = "disk" if offload_dir else "host"
    host = {"weights": host_weights if placement["master_weights"] == "host" else 0,
            "grads": grads,
            "optimizer_states": states if placement["optimizer_states"] == "host" else 0,
            "buffers": p.in_flight(placement["master_weights"] == "disk", hold_disk=grads_on_disk)}
    return placement, host, grads_on_disk, weights, states


def _plan_window(p: _PlanInputs, chosen_k: int, dev: dict, host: dict, placement: dict, grads_on_disk: bool,
                 weights: int, states: int, sums: int):
    """``accumulation`` > 1: the window's layout; updates ``dev``, ``host``, ``placement`` in
    place. Returns (the window's dict, the device figures, grads on disk)."""
    w, cfg, total = p.workload, p.cfg, p.total
    # The window's boundary activations and per-micro-batch work (below) take the place of one
    # micro-batch's saved layer inputs and block inputs: beside them the device holds only one
    # layer's re-run or the head's chunk (as engine_window_plan counts the engine's room).
    dev = dict(dev, activations=p.activations(chosen_k, num_layers=0))
    dev["total"] = dev["weights"] + dev["grads"] + dev["activations"]
    free_dev = None if p.vram_bytes is None else max(p.vram_bytes - dev["total"] - sums, 0)
    # Boundary activations leave HOST_HEADROOM of the host budget free (the OS, page cache,
    # allocator slack: a pinned RAM tier filled to the last GiB is what gets a process killed).
    free_host = None if p.host_bytes is None else max(int((1 - HOST_HEADROOM) * p.host_bytes) - sum(host.values()), 0)
    disk_used = ((weights if placement["master_weights"] == "disk" else 0) + (total * 4 if grads_on_disk else 0)
                 + (states if placement["optimizer_states"] == "disk" else 0))
    free_disk = 0 if not cfg.offload_dir else None if p.disk_bytes is None else max(p.disk_bytes - disk_used, 0)
    hid = p.shape.hidden_size
    wp = window_plan(w.accumulation, tokens=w.batch * w.seq, hidden_size=hid, num_layers=p.shape.num_layers,
                     checkpoint_interval=chosen_k, compute_bytes=p.cb, device_free=free_dev, host_free=free_host,
                     layer_work_bytes_per_token=p.shape.layer().work_bytes(1, 1, p.cb),
                     accumulator_bytes=0 if host["grads"] else total * 4, disk_free=free_disk,
                     raise_interval=cfg.checkpoint_interval is not None and cfg.checkpoint_interval >= 1)
    if wp.groups > 1:   # a later group adds into the host accumulator
        host["grads"] = p.pinned_units()
        grads_on_disk = False
        placement["gradients"] = "host"
    window = wp.to_dict()
    window["tokens_per_weight_fetch"] = w.batch * w.seq * w.accumulation / wp.loads_per_layer
    dev = dict(dev, grad_sums=sums)
    if wp.tier in ("host", "disk"):
        if wp.tier == "host":
            host["activations"] = wp.boundary_bytes
        dev["activations"] += wp.device_work_bytes
    else:
        dev["activations"] += wp.boundary_bytes + wp.device_work_bytes
    dev["total"] = dev["weights"] + dev["grads"] + dev["grad_sums"] + dev["activations"]
    return window, dev, grads_on_disk


def _window_refusal(p: _PlanInputs, window: dict, dev: dict) -> str:
    """A window whose group of one micro-batch fits no tier: its boundary activations fit neither
    the device beside its working set nor host RAM (within ``1 - HOST_HEADROOM``) nor a disk tier."""
    w = p.workload
    return (f"a window of {w.accumulation} micro-batches of {w.batch * w.seq:,} tokens needs "
            f"{dev['total'] / GiB:.4f} GiB of device working set (weights slots {dev['weights'] / GiB:.4f} GiB, "
            f"gradient buffers {dev['grads'] / GiB:.4f} GiB, the window's gradient sums "
            f"{dev['grad_sums'] / GiB:.4f} GiB, activations {dev['activations'] / GiB:.4f} GiB with one "
            f"micro-batch's boundary activations, {window['boundary_bytes'] / GiB:.4f} GiB, on the device: "
            f"{window['reason']}) but max_vram_gb allows {p.vram_bytes / GiB:.4f} GiB: raise max_vram_gb, or let "
            "the boundary activations wait in host RAM (raise max_host_gb) or on disk (an offload_dir)")


def _host_refusal(p: _PlanInputs, host: dict, placement: dict) -> str:
    return (f"host RAM needs {host['total'] / GiB:.2f} GiB (master weights {host['weights'] / GiB:.2f}, "
            f"gradients {host['grads'] / GiB:.2f}, optimizer states {host['optimizer_states'] / GiB:.2f}, "
            f"buffers in flight {host['buffers'] / GiB:.2f}) "
            f"but {p.host_bytes / GiB:.2f} GiB are available: "
            + ("give an offload_dir for the disk tier" if not p.cfg.offload_dir
               else "more RAM, or offload_params=True to put the master weights on disk"
               if placement["master_weights"] == "host" else
               "more RAM (the gradient accumulator lives there)" if host["grads"] else
               "more RAM (units in flight are staged there)"))


def make_plan(units: List[UnitSpec], shape: ModelShape, cfg, *, cuda: bool = True, workload: Workload = Workload(),
              disk_bytes: Optional[int] = None, state_units: Optional[List[UnitSpec]] = None,
              rows: Optional[int] = None) -> Plan:
    """Place a model's training state on (device, host, disk) under ``cfg``'s budgets (an
    EngineConfig: ``max_vram_gb``, ``max_host_gb``, ``offload_dir``, ``offload_params``,
    ``optimizer_compression``, ``precision``, ``checkpoint_interval``, ``clip_hold``,
    ``overrides.device_slots`` / ``loss_chunk_tokens`` / ``update_chunk_numel`` /
    ``inflight_depth``); ``disk_bytes``: the disk tier's free bytes (None: no limit).

    ``workload.accumulation`` > 1: the window is planned too (``plan.window``: boundary
    activations on the device, else host RAM within ``1 - HOST_HEADROOM`` of the budget, else
    the disk tier (``disk["activations"]``), else a larger checkpoint interval for the window,
    else split). One micro-batch (a long row) whose boundary activations alone do not fit
    beside the device's working set: they go to host RAM, else the disk tier
    (``placement["activations"]``, :func:`boundary_tier`). ``plan.tile_tokens``: the MLP's tile;
    ``plan.longest_seq``: the longest row the device budget holds (:func:`longest_seq`); a
    device refusal names the tokens, the working set, the tile, the budget and that length. Final gradients held for a clipping norm live in host RAM when the host
    budget holds them beside the master weights, else on the disk tier ("auto";
    ``placement["gradients"]`` says which). ``host["buffers"]``: what the engine's code holds
    in flight (:func:`host_in_flight`).
    ``state_units``: the part of each unit whose training state this process holds (data
    parallel: this rank's shards, ``engine/ranks/sharded.py``); host and disk figures are theirs, the
    device working set stays that of the whole ``units``. Default: ``units``.
    ``rows`` (the engine's plan, ``engine_plan``: made at one token, its slots then held whatever
    the row): tokens a row the engine will be given; its layer slots grow past 2 only while rows
    that long still fit beside them (``_keeps_rows``), and ``plan.longest_seq`` is counted beside
    the slots and at the interval the plan holds. None (an estimate: a longer row gets a plan of
    its own): ``plan.longest_seq`` is the longest any plan of 2 slots (``device_slots``) fits."""
    p = _PlanInputs.of(units, shape, cfg, cuda, workload, disk_bytes, state_units)
    p.rows = max(int(rows or 1), 1)
    chosen_k, dev, slots, feasible, limiting, reason = _device_schedule(p)
    held = (slots, chosen_k) if rows is not None else (None, None)   # (the engine's: longest_seq beside them)
    placement, host, grads_on_disk, weights, states = _host_placement(p)
    window = None
    sums = window_sum_bytes(units)   # a window sums each unit's gradient on the device (fp32)
    if workload.accumulation > 1:
        window, dev, grads_on_disk = _plan_window(p, chosen_k, dev, host, placement, grads_on_disk, weights,
                                                  states, sums)
        if feasible and p.vram_bytes is not None and (not window["fits"] or dev["total"] > p.vram_bytes):
            feasible, limiting, reason = False, "device", _window_refusal(p, window, dev)
    elif feasible and p.vram_bytes is not None and dev["total"] > p.vram_bytes:   # a long row's boundaries
        dev = _place_boundaries(p, chosen_k, dev, host, placement, weights, states, grads_on_disk)
    host["total"] = sum(host.values())
    disk = {"weights": weights if placement["master_weights"] == "disk" else 0,
            "grads": p.total * 4 if grads_on_disk else 0,
            "optimizer_states": states if placement["optimizer_states"] == "disk" else 0}
    if window is not None and window["tier"] == "disk":
        disk["activations"] = window["boundary_bytes"]
    if placement.get("activations") == "disk":
        disk["activations"] = p.boundary(chosen_k)
    disk["total"] = sum(disk.values())
    if feasible and p.host_bytes is not None and host["total"] > p.host_bytes:
        feasible, limiting, reason = False, "host", _host_refusal(p, host, placement)
    if feasible and disk_bytes is not None and disk["total"] > disk_bytes:
        feasible, limiting = False, "disk"
        reason = (f"the disk tier needs {disk['total'] / GiB:.2f} GiB but {disk_bytes / GiB:.2f} GiB are free: "
                  "free space or use a larger disk" + _smaller_codec_hint(cfg.optimizer_compression))
    return Plan(device=dev, host=host, disk=disk, placement=placement, layer_slots=slots,
                checkpoint_interval=chosen_k, feasible=feasible, limiting_tier=limiting, reason=reason,
                capacity={"device": p.vram_bytes, "host": p.host_bytes, "disk": disk_bytes}, window=window,
                window_sum_bytes=sums, tile_tokens=p.tile, seq=workload.seq,
                longest_seq=longest_seq(p, slots=held[0], k=held[1]) if p.vram_bytes is not None else None)


def boundary_tier(nbytes: int, device_free: Optional[int], host_free: Optional[int],
                  disk_free: Optional[int]) -> Optional[str]:
    """Where one micro-batch's ``nbytes`` of layer-boundary activations wait between its forward
    and its backward: the device when they fit beside its working set, else host RAM, else the
    disk tier (free bytes per tier: None no limit; ``disk_free`` 0 no disk tier); None: nowhere."""
    for tier, free in (("device", device_free), ("host", host_free), ("disk", disk_free)):
        if free is None or nbytes <= free:
            if tier != "disk" or disk_free != 0:
                return tier
    return None


def _place_boundaries(p: _PlanInputs, k: int, dev: dict, host: dict, placement: dict, weights: int,
                      states: int, grads_on_disk: bool) -> dict:
    """A single micro-batch whose boundary activations do not fit beside the device's working
    set: they wait in host RAM (within ``1 - HOST_HEADROOM`` of its budget), else on the disk
    tier (``placement["activations"]``; the host check refuses where neither holds them).
    Returns the device figures without them."""
    nbytes = p.boundary(k)
    free_host = None if p.host_bytes is None else max(int((1 - HOST_HEADROOM) * p.host_bytes) - sum(host.values()), 0)
    used = ((weights if placement["master_weights"] == "disk" else 0) + (p.total * 4 if grads_on_disk else 0)
            + (states if placement["optimizer_states"] == "disk" else 0))
    free_disk = 0 if not p.cfg.offload_dir else None if p.disk_bytes is None else max(p.disk_bytes - used, 0)
    tier = boundary_tier(nbytes, 0, free_host, free_disk) or "host"
    placement["activations"] = tier
    if tier == "host":
        host["activations"] = nbytes
    dev = dict(dev, activations=dev["activations"] - nbytes)
    dev["total"] = dev["weights"] + dev["grads"] + dev["activations"]
    return dev


def engine_plan(units, model_config, cfg, *, cuda: bool, state_units=None, accumulation: int = 1,
                rows: int = 1) -> Plan:
    """The engine's plan for its units under an EngineConfig ``cfg``, or a ValueError naming
    the budget to change. ``state_units``: this rank's shards when the state is sharded.
    ``accumulation`` > 1 (the run's workload, where the engine is told it): its layer slots
    leave the device room for a layer-major window's gradient sums (``_PlanInputs.device_need``);
    ``rows``: tokens per micro-batch of that workload: a third or fourth slot is taken only where
    rows that long still fit beside it (``plan.longest_seq``: the longest row beside the slots held)."""
    specs = [UnitSpec(u.name, u.numel, u.kind, u.tied_output) for u in units]
    held = None if state_units is None else [UnitSpec(u.name, u.numel, u.kind) for u in state_units]
    shape = ModelShape.of(model_config, logits=False)
    shape = ModelShape(shape.hidden_size, len(units) - 2, shape.intermediate_size, 0, dims=shape.dims)
    plan = make_plan(specs, shape, cfg, cuda=cuda, workload=Workload(batch=1, seq=1, accumulation=max(accumulation, 1)),
                     state_units=held, rows=max(int(rows), 1))
    if not plan.feasible and plan.limiting_tier == "host":
        raise ValueError(f"max_host_gb={cfg.max_host_gb}: {plan.reason}.")
    if cfg.offload_params and not cfg.offload_dir:
        raise ValueError("offload_params=True needs an offload_dir for the disk tier.")
    if not plan.feasible:
        biggest = max(units, key=lambda u: u.numel)
        raise ValueError(
            f"max_vram_gb={cfg.max_vram_gb} is below what one training step needs: "
            f"{plan.reason}. The largest unit ({biggest.name}) alone holds "
            f"{biggest.numel * (2 if cfg.precision == 'bf16' else 4) / GiB:.3f} GiB; "
            f"set max_vram_gb to at least {plan.device['total'] / GiB:.3f}.")
    return plan


# ---------------------------------------------------------------------- accumulation windows
#: Tokens per layer-major pass beyond which a group stops growing (see window_plan).
TOKENS_PER_PASS = 65536

@dataclass
class WindowPlan:
    """How an accumulation window of ``micro_batches`` runs: layer-major in ``groups`` groups
    of at most ``group_size`` micro-batches (one group: each layer crosses to the device twice
    per step at checkpoint interval 1; G groups: 2·G), the boundary activations on ``tier``,
    at ``checkpoint_interval`` (the planner may raise it for the window so they fit)."""
    micro_batches: int
    groups: int
    group_size: int
    tier: str                          # "device" | "host" | "disk": where the boundary activations wait
    boundary_bytes: int                # boundary activations of the largest group, on ``tier``
    device_work_bytes: int             # fronts, gradients, block inputs of that group (device)
    loads_per_layer: float             # weight loads per layer per optimizer step
    reason: str
    checkpoint_interval: int = 1
    #: Whether the group fits its tier's room (False: not even one micro-batch fits anywhere; the
    #: group of one on ``tier`` would go over the device budget: make_plan and the engine refuse it)
    fits: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


def loads_per_layer(num_layers: int, checkpoint_interval: int, groups: int = 1) -> float:
    """Weight loads per layer per optimizer step (averaged over the layers): forward and
    backward once per group, plus the recompute of the layers inside a checkpoint block."""
    if checkpoint_interval == 0:
        return float(groups)
    n, k = max(num_layers, 1), max(checkpoint_interval, 1)
    recomputed = n - math.ceil(n / k)
    return groups * (2 + recomputed / n)


#: Checkpoint intervals a window may be raised to so its boundary activations fit (k = 2 halves
#: them, at half a load more per layer; splitting the window costs two loads per extra group).
WINDOW_INTERVALS = (2, 3, 4)


def window_sizes(k: int, tokens: int, hidden_size: int, num_layers: int, compute_bytes: int,
                 layer_work_bytes_per_token: int):
    """(boundary bytes, device work bytes) of one micro-batch of ``tokens`` in a layer-major window
    at checkpoint interval ``k``: the inputs of every k-th layer (k 0: every layer's autograd graph,
    device only), and its current hidden state or gradient and a block's recomputed inputs."""
    row = tokens * hidden_size * compute_bytes
    if k == 0:
        return num_layers * tokens * layer_work_bytes_per_token // 2 + row, row
    return math.ceil(num_layers / k) * row, (k + 1) * row


@dataclass
class _WindowRoom:
    """A window's bytes per micro-batch and the room each tier leaves for them."""
    A: int
    tokens: int
    hidden_size: int
    num_layers: int
    compute_bytes: int
    layer_work_bytes_per_token: int
    device_free: Optional[int]
    host_free: Optional[int]
    disk_free: Optional[int]
    accumulator_bytes: int

    def sizes(self, k: int):
        """(boundary bytes, device work bytes) of one micro-batch at checkpoint interval ``k``."""
        return window_sizes(k, self.tokens, self.hidden_size, self.num_layers, self.compute_bytes,
                            self.layer_work_bytes_per_token)

    def fits(self, g: int, where: str, k: int) -> bool:
        saved, work = self.sizes(k)
        if where == "device":
            return self.device_free is None or g * (saved + work) <= self.device_free
        if k == 0:
            return False
        room = {"host": self.host_free, "disk": self.disk_free}[where]
        if room is not None and g < self.A and where == "host":
            room -= self.accumulator_bytes
        return (self.device_free is None or g * work <= self.device_free) and (room is None or g * saved <= room)

    def largest(self, cap: int, where: str, k: int) -> int:
        """The largest group of at most ``cap`` that fits on ``where`` at ``k`` (1 when none does):
        ``cap`` itself, else a bisection below it, where fitting shrinks as the group grows (a group
        below the whole window also leaves room for the accumulator). O(log cap): an estimate of
        10**18 micro-batches returns at once."""
        if cap <= 1 or self.fits(cap, where, k):
            return max(cap, 1)
        lo, hi = 1, cap - 1   # fits(lo) assumed; the answer in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(mid, where, k):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def best(self, tiers, intervals, cap: int, k0: int):
        """The largest group (then the first tier, interval) that fits; a split keeps ``k0``."""
        best = None
        for k in intervals:
            for where in tiers:
                g = self.largest(cap, where, k)
                if best is None or g > best[0]:
                    best = (g, where, k)
                if g == cap:
                    break
            if best[0] == cap:
                break
        g, where, k = best
        if g < cap:   # split: keep the given interval (more groups cost more loads than a larger k saves)
            k = k0
            g = max(self.largest(cap, w, k) for w in tiers)
            where = next((w for w in tiers if self.fits(g, w, k)), tiers[0])
        return g, where, k


def _window_reason(A: int, g: int, groups: int, where: str, k: int, k0: int, loads: float, saved: int,
                   tokens: int, by_tokens: int, max_group: Optional[int]) -> str:
    raised = (f"; checkpoint interval {k} for this window (boundary activations {k0}/{k} of those at "
              f"interval {k0}; block recompute keeps the result exact, {loads:g} loads per layer)") if k != k0 else ""
    if groups == 1:
        return f"layer-major: all {A} micro-batches per pass, boundary activations on the {where}{raised}"
    if g == by_tokens and g < (min(A, max_group) if max_group else A):
        why = (f"{g * tokens} tokens per pass already hide the weight streaming; larger groups would only "
               f"hold more activations")
    elif max_group and g == max_group:
        why = f"max_window_micro_batches={max_group}"
    else:
        why = f"{A} micro-batches' boundary activations ({A * saved / GiB:.2f} GiB) do not fit"
    return (f"split into {groups} groups of up to {g} micro-batches (boundary activations on the "
            f"{where}): {why}{raised}")


def window_plan(micro_batches: int, *, tokens: int, hidden_size: int, num_layers: int, checkpoint_interval: int,
                compute_bytes: int, device_free: Optional[int], host_free: Optional[int],
                layer_work_bytes_per_token: int = 0, tier: str = "auto",
                max_group: Optional[int] = None, max_tokens_per_pass: Optional[int] = None,
                accumulator_bytes: int = 0, disk_free: Optional[int] = 0,
                raise_interval: bool = True) -> WindowPlan:
    """Decide a window's layout. ``tokens``: of the largest micro-batch. ``device_free`` /
    ``host_free`` / ``disk_free``: bytes left for the window's activations on each tier (None:
    no limit; ``disk_free`` 0: no disk tier). ``tier`` forces "device", "host" or "disk";
    ``max_group`` caps the group size (micro-batches per layer-major pass).
    ``max_tokens_per_pass`` (optional): a group stops growing at this many tokens (e.g.
    ``TOKENS_PER_PASS``: each weight fetch then carries several times the ~12-17k tokens that
    hide its transfer behind compute on H100/H200 over PCIe). ``accumulator_bytes``: host RAM a
    split window needs for the gradient accumulator (a later group adds into it); one group
    needs none, so a split must fit its boundary activations in ``host_free`` minus that.

    Order of preference: the whole window at the given checkpoint interval on the device, then
    host RAM, then the disk tier; then (``raise_interval``, k >= 1) at a larger interval
    (``WINDOW_INTERVALS``: exact, block recompute) on those tiers; only then the largest
    groups that fit. Per micro-batch the boundary activations are the inputs of every k-th
    layer (k = 0: every layer's autograd graph, device only); the device also holds each
    micro-batch's current hidden state or gradient and, in the backward, a block's recomputed
    inputs."""
    A, k0 = micro_batches, checkpoint_interval
    room = _WindowRoom(A, tokens, hidden_size, num_layers, compute_bytes, layer_work_bytes_per_token, device_free,
                       host_free, disk_free, accumulator_bytes)
    tiers = ["device", "host", "disk"] if tier == "auto" else [tier]
    intervals = [k0] + ([k for k in WINDOW_INTERVALS if k > k0 and k <= max(num_layers, 1)]
                        if raise_interval and k0 >= 1 else [])
    cap = min(A, max_group) if max_group else A
    by_tokens = max(1, max_tokens_per_pass // max(tokens, 1)) if max_tokens_per_pass else A
    cap = min(cap, by_tokens)
    g, where, k = room.best(tiers, intervals, cap, k0)
    saved, work = room.sizes(k)
    groups = math.ceil(A / g)
    loads = loads_per_layer(num_layers, k, groups)
    fits = room.fits(g, where, k)
    reason = _window_reason(A, g, groups, where, k, k0, loads, saved, tokens, by_tokens, max_group) if fits else (
        f"not even one micro-batch fits: its work on the device ({work / GiB:.4f} GiB) and its boundary "
        f"activations ({saved / GiB:.4f} GiB) on no tier beside the device's working set")
    return WindowPlan(micro_batches=A, groups=groups, group_size=g, tier=where, boundary_bytes=g * saved,
                      device_work_bytes=g * work, loads_per_layer=loads, reason=reason, checkpoint_interval=k,
                      fits=fits)


def engine_window_plan(plan: Plan, model_config, cfg, num_layers: int, *, tokens: int, micro_batches: int,
                       device_capacity: Optional[int] = None) -> WindowPlan:
    """The engine's window layout under an EngineConfig ``cfg`` and its ``plan``. ``tokens``: of
    the largest micro-batch; ``device_capacity``: the device's memory when ``max_vram_gb`` is
    unset (None on a CPU "device": no cap)."""

    esize = 2 if cfg.precision == "bf16" else 4
    cap = int(cfg.max_vram_gb * GiB) if cfg.max_vram_gb else device_capacity
    hid = hidden_size(model_config)
    dims = LayerDims.of(model_config)
    layer_work = dims.work_bytes(1, 1, esize)            # one layer re-run, per token (as activation_bytes)
    tile = plan.tile_tokens or tokens                    # the MLP's intermediates for one tile
    dev_free = None
    base = (plan.device["weights"] + plan.device["grads"] + plan.window_sum_bytes
            + dims.work_bytes(tokens, min(tokens, tile), esize))
    if cap is not None:   # (the engine's plan is made without a window: its sums are taken here)
        dev_free = max(cap - base, 0)
    # (a split window's accumulator is in RAM even where held final gradients go to disk)
    accumulator = plan.host["grads"] or plan.disk["grads"]
    if cfg.max_host_gb:  # a one-group layer-major step keeps no host gradient accumulator
        host_free = max(int(cfg.max_host_gb * GiB) - (plan.host["total"] - accumulator), 0)
    else:
        import psutil

        host_free = int(0.8 * psutil.virtual_memory().available)
    disk_free = 0   # no disk tier
    if cfg.offload_dir:
        import shutil

        disk_free = int(0.9 * shutil.disk_usage(cfg.offload_dir).free)
    if micro_batches == 1:   # one (long) row: its boundaries on the first tier that holds them
        k = plan.checkpoint_interval
        saved = math.ceil(num_layers / k) * tokens * hid * esize if k else 0
        tier = boundary_tier(saved, dev_free, host_free, disk_free) or "host"
        return WindowPlan(micro_batches=1, groups=1, group_size=1, tier=tier, boundary_bytes=saved,
                          device_work_bytes=0, loads_per_layer=loads_per_layer(num_layers, k),
                          reason=f"one micro-batch, boundary activations on the {tier}", checkpoint_interval=k)
    wp = window_plan(micro_batches, tokens=tokens, hidden_size=hid, num_layers=num_layers,
                     checkpoint_interval=plan.checkpoint_interval, compute_bytes=esize, device_free=dev_free,
                     host_free=host_free, layer_work_bytes_per_token=layer_work, tier=cfg.window_tier,
                     max_group=cfg.max_window_micro_batches, accumulator_bytes=accumulator, disk_free=disk_free)
    if not wp.fits:   # a group of one over the device's room: refused, never run past the budget
        least = base + wp.device_work_bytes + (wp.boundary_bytes if wp.tier == "device" else 0)
        said = f"max_vram_gb={cfg.max_vram_gb}" if cfg.max_vram_gb else "the device's free memory"
        raise ValueError(
            f"{said} ({cap / GiB:.4f} GiB) cannot hold a window of {micro_batches} micro-batches of {tokens:,} "
            f"tokens: {wp.reason} (weights slots {plan.device['weights'] / GiB:.4f} GiB, gradient buffers "
            f"{plan.device['grads'] / GiB:.4f} GiB, the window's gradient sums {plan.window_sum_bytes / GiB:.4f} "
            f"GiB; one micro-batch at a time needs about {least / GiB:.4f} GiB): raise max_vram_gb to at least "
            f"{least / GiB:.4f}, shorten the micro-batches, "
            + (f"keep 2 layer slots (it has {plan.layer_slots}: overrides={{'device_slots': 2}}), "
               if plan.layer_slots > 2 else "")
            + "or let the boundary activations wait in host RAM (max_host_gb) or on disk (offload_dir)")
    return wp

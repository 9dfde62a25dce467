"""What a GRPO run (``mt.GRPOTrainer``) adds to an estimate: generation before each step.

``mt.estimate(model, rollouts=R, completion_length=C, seq=S, ...)``: an optimizer step is one
generation batch of ``R`` rollouts (prompt + completion, ``S`` tokens at most: prompts of
``S - C`` tokens, completions of ``C``), trained in ``ceil(R / batch)`` micro-batches (TRL's
default ``steps_per_generation`` = the accumulation). Before it, all ``R`` rollouts are decoded
together, one token at a time, ``C`` times (the decode runs to the longest completion; every
completion is taken to reach ``C``: an upper bound of the time and of the tokens).

Where the generation runs (``GenerationPlan.mode``):

* ``"resident"``: a resident copy of the weights in the compute dtype (bf16 under
  ``precision="bf16"``, else fp32) and its KV cache in the same dtype fit in the device budget
  beside what stays on the device between training steps (the weight slots and the gradient
  staging buffers, ``planner.persistent_device_bytes``: generation and training are separate
  phases, the step's activations and boundaries are freed before generation runs, and the copy's
  device memory is released after it, ``grpo_rollout.ResidentPolicy.release``;
  ``trainer/grpo_rollout.resident_fits``, the engine's own rule): the copy (refreshed once per
  step: its bytes over the link once) decodes
  with transformers' ``generate``. A decoded token costs the compute of all rollouts, at least
  the copy's bytes and the cache read from device memory (``DEVICE_MEMORY``: the profiles'
  GPUs; a measured machine has no such rate, and the figure is then the compute alone, said).
* ``"streamed"`` (it does not fit): the layer-major decoder (``engine/compute/decode.py``)
  streams every unit's compute-dtype weights to the device once per decoded token for all
  rollouts at once: a token costs those bytes over the host link, overlapped with the compute of
  all rollouts (whichever is longer). Its KV cache (compute dtype) is placed by :func:`place_kv`,
  the decoder's own rule: on the device when it and the last logits fit the same room;
  else the full-attention layers' K/V in host RAM when they fit beside the host plan (the rest,
  and two layers' K/V in flight, on the device): each layer's K/V then crosses the link twice a
  decoded token, in at its current length as the layer runs and the new token's entries back,
  priced at the h2d and d2h rates beside the weights' bytes; else refused (the lines say so).

The prefill is priced as every rollout's prompt (an upper bound: a group's shared prompt is
prefilled once). No torch is imported here (``tests/test_planning_light.py``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from megatrain_nb.engine import family

from .estimator_dpo import format_bytes
from .planner import persistent_device_bytes, persistent_host_bytes
from .prediction import fmt_rate, fmt_seconds

#: Device memory bandwidth of the profiles' GPUs (a resident decode reads every weight once per token)
DEVICE_MEMORY = {
    "h100-pcie5-gen4nvme": (2.0e12, "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe: GPU memory bandwidth 2TB/s"),
    "h200-pcie5-gen5nvme": (4.8e12, "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: GPU memory bandwidth 4.8TB/s"),
    "gh200": (4.0e12, "NVIDIA GH200 Grace Hopper Superchip datasheet: HBM3 96GB, 4 TB/s"),
}
#: The estimate's words for each KV cache tier
KV_WHERE = {"device": "on the device", "host": "in host RAM, each layer's K/V streamed to the device as it runs",
            "none": "does NOT fit (the device, nor host RAM): refused"}
#: TRL's GRPOConfig.max_completion_length default (the estimate's when only ``rollouts`` is given)
DEFAULT_COMPLETION_LENGTH = 256


def attention_shape(config) -> tuple:
    """(layers, attention heads, key/value heads, head size) of a transformers config."""
    t = family.text_config(config)
    h = family.hidden_size(config)
    heads = int(getattr(t, "num_attention_heads", 0) or getattr(t, "n_head", 0) or 1)
    kv = int(getattr(t, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(t, "head_dim", 0) or h // heads)
    return int(getattr(t, "num_hidden_layers", 0) or 0), heads, kv, head_dim


def kv_cache_bytes(config, rows: int, tokens: int, bytes_per_value: int) -> int:
    """Bytes of the keys and values of ``rows`` sequences of ``tokens`` tokens (every layer; a
    sliding-window layer holds its window at most): the one count, the streamed decoder's and the
    estimate's. 0 for a model without attention (a state-space model's states do not grow)."""
    t = family.text_config(config)
    if not (getattr(t, "num_attention_heads", 0) or getattr(t, "n_head", 0)):
        return 0
    layers, _, kv, head_dim = attention_shape(config)
    window = getattr(t, "sliding_window", None)
    types = list(getattr(t, "layer_types", None) or ["full_attention"] * layers)[:layers]
    held = sum(min(tokens, window) if kind == "sliding_attention" and window else tokens for kind in types)
    return 2 * kv * head_dim * bytes_per_value * int(rows) * int(held)


def resident_need(config, numel: int, rows: int, tokens: int, bytes_per_value: int) -> int:
    """Device bytes of a resident copy of ``numel`` parameters and its KV cache, both in the compute
    dtype: the rule of ``generation="auto"`` (``grpo_rollout.resident_fits``) and of the estimate."""
    return numel * bytes_per_value + kv_cache_bytes(config, rows, tokens, bytes_per_value)


def streamed_need(config, rows: int, tokens: int, bytes_per_value: int) -> int:
    """Device bytes the streamed decoder holds beside the engine's slots and buffers: the KV cache in the
    compute dtype and the last logits (fp32 logits, scores and probabilities)."""
    return kv_cache_bytes(config, rows, tokens, bytes_per_value) + 3 * rows * family.vocab_size(config) * 4


def host_kv_bytes(config, rows: int, tokens: int, bytes_per_value: int) -> int:
    """Bytes of the keys and values the host tier holds: the full-attention layers' (a sliding
    window and a linear-attention layer's states stay on the device, as transformers' own
    offloading keeps them)."""
    t = family.text_config(config)
    if not (getattr(t, "num_attention_heads", 0) or getattr(t, "n_head", 0)):
        return 0
    layers, _, kv, head_dim = attention_shape(config)
    types = list(getattr(t, "layer_types", None) or ["full_attention"] * layers)[:layers]
    return 2 * kv * head_dim * bytes_per_value * int(rows) * int(tokens) * types.count("full_attention")


def full_layers(config) -> int:
    """Decoder layers whose K/V the host tier holds (full attention)."""
    t = family.text_config(config)
    layers = attention_shape(config)[0]
    return list(getattr(t, "layer_types", None) or ["full_attention"] * layers)[:layers].count("full_attention")


@dataclass
class KVPlace:
    """Where the streamed decoder's KV cache goes (:func:`place_kv`): ``tier`` "device" | "host" |
    "none" (refused), the bytes each tier holds, the device bytes the decoding needs, and why."""

    tier: str
    device_bytes: int
    host_bytes: int
    kv_bytes: int
    why: str
    batch_rows: int = 0   # tier "device" in sub-batches: the rows each decodes at most (0: one batch)
    rows: int = 0         # the rows placed

    @property
    def batches(self) -> int:
        """Sub-batches the rows decode in, one after another (1: all at once)."""
        return -(-self.rows // self.batch_rows) if self.batch_rows else 1


def place_kv(config, rows: int, tokens: int, bytes_per_value: int, device_room: Optional[int],
             host_room: Optional[int], *, weights_bytes: Optional[int] = None, group: int = 1,
             split: bool = True) -> KVPlace:
    """The streamed decoder's KV cache of ``rows`` x ``tokens``: on the device when it and the last
    logits fit ``device_room`` (the budget less what persists between the engine's steps,
    ``planner.persistent_device_bytes``; None: no budget); else the
    full-attention layers' K/V in host RAM when they fit ``host_room`` (beside the host plan) and
    the rest fits the device: the rest (logits, sliding windows, linear-attention states) and
    two full layers' K/V in flight (the layer brought in, and it with the new token appended);
    else (or where it moves fewer bytes) the rows decoded **in sub-batches** that each fit the
    device (``split``; ``batch_rows`` a multiple of ``group``, a group's shared prompt, where one
    fits): each sub-batch streams the weights once per token, so a token of all rows moves
    ``batches`` x ``weights_bytes`` over the link against the host tier's ``weights_bytes`` +
    its K/V in and out (at least half the host cache: the average length); without
    ``weights_bytes`` the host tier is taken where it fits; else refused ("none"), the numbers
    in ``why``."""
    kv = kv_cache_bytes(config, rows, tokens, bytes_per_value)
    need = streamed_need(config, rows, tokens, bytes_per_value)
    on = "" if device_room is None else f" the device room between the engine's steps ({format_bytes(device_room)})"
    if device_room is None or need <= device_room:
        return KVPlace("device", need, 0, kv, f"KV cache and logits ({format_bytes(need)}) fit{on or ' (no budget)'}",
                       rows=rows)
    host, n_full = host_kv_bytes(config, rows, tokens, bytes_per_value), full_layers(config)
    dev = need - host + (2 * host // n_full if n_full else 0)
    hr = "no host budget" if host_room is None else f"host room beside the host plan {format_bytes(host_room)}"
    why = (f"KV cache and logits ({format_bytes(need)}) exceed{on}; in host RAM: {format_bytes(host)} of "
           f"full-attention K/V ({hr}), {format_bytes(dev)} on the device (logits, other layers' states, two "
           "layers' K/V in flight)")
    on_host = bool(host) and dev <= device_room and (host_room is None or host <= host_room)
    fit = device_room // max(streamed_need(config, 1, tokens, bytes_per_value), 1) if split else 0
    fit = fit // group * group if fit >= group > 1 else fit
    if fit >= 1:
        sub = KVPlace("device", streamed_need(config, min(fit, rows), tokens, bytes_per_value), 0, kv,
                      "", batch_rows=fit, rows=rows)
        host_moves = None if weights_bytes is None else weights_bytes + host // 2
        if not on_host or (host_moves is not None and sub.batches * weights_bytes <= host_moves):
            sub.why = (f"{why}; decoded in {sub.batches} sub-batches of <= {fit} rows, each fitting the device "
                       f"({format_bytes(sub.device_bytes)})" + ("" if not on_host else
                                                                  ": fewer bytes over the link than the host tier"))
            return sub
    if on_host:
        return KVPlace("host", dev, host, kv, why, rows=rows)
    return KVPlace("none", dev, host, kv, why + ": neither fits", rows=rows)


def compute_bytes(precision: str) -> int:
    """Bytes of a value in the compute dtype (the resident copy's, its KV cache's, the streamed
    decoder's): 2 in bf16, 4 in fp32."""
    return 2 if precision == "bf16" else 4


def split_seq(seq: int, rollouts: Optional[int], completion_length: Optional[int], batch: int,
              accumulation: int) -> tuple:
    """((rollouts, prompt length, completion length) or None, accumulation) of a GRPO estimate;
    refused by name when they do not add up."""
    if rollouts is None:
        if completion_length is not None:
            raise ValueError("completion_length is a GRPO run's: give rollouts= too (completions per step)")
        return None, accumulation
    c = DEFAULT_COMPLETION_LENGTH if completion_length is None else completion_length
    if c >= seq:
        raise ValueError(f"completion_length={c} must be shorter than seq={seq} (seq is a rollout's whole row: "
                         f"prompt + completion); pass seq= the prompt's length + {c}")
    if accumulation == 1:
        accumulation = -(-rollouts // batch)
    elif batch * accumulation != rollouts:
        raise ValueError(f"rollouts={rollouts} is one optimizer step: batch x accumulation = {batch} x {accumulation} "
                         "must equal it (or leave accumulation out: rollouts / batch micro-batches)")
    return (rollouts, seq - c, c), accumulation


@dataclass
class GenerationPlan:
    """A GRPO step's generation as the estimate plans and prices it (see the module)."""

    rollouts: int
    prompt_length: int
    completion_length: int
    precision: str
    weights_bytes: int                    # the weights generation reads per token (the compute dtype's)
    kv_bytes: int                         # the KV cache of all rollouts at full length
    kv_tier: str                          # "device", "host" (streamed to the device per layer) or "none" (refused)
    mode: str                             # "resident" or "streamed"
    room_bytes: Optional[int]             # the device budget less what persists between training steps
    generation_s: Optional[float] = None  # prefill + decode (+ the resident copy's refresh)
    prefill_s: float = 0.0
    token_s: float = 0.0                  # one decoded token of all rollouts
    token_bound: str = ""                 # what bounds a decoded token: "link", "compute", "device memory"
    link_bytes_per_token: int = 0
    kv_host_bytes: int = 0                # the cache's bytes in host RAM (kv_tier "host")
    kv_in_bytes_per_token: int = 0        # host->device: each full layer's K/V at an average length
    kv_out_bytes_per_token: int = 0       # device->host: the new token's entries
    kv_why: str = ""                      # why the cache is where it is (place_kv)
    kv_batches: int = 1                   # sub-batches the rollouts decode in (the weights streamed once each a token)
    training_s: Optional[float] = None
    notes: list = field(default_factory=list)

    @property
    def trained_tokens(self) -> int:
        """Tokens through the training pass per step (prompt + completion of every rollout)."""
        return self.rollouts * (self.prompt_length + self.completion_length)

    @property
    def completion_tokens(self) -> int:
        return self.rollouts * self.completion_length

    @property
    def step_s(self) -> Optional[float]:
        if self.generation_s is None or self.training_s is None:
            return None
        return self.generation_s + self.training_s

    @property
    def tokens_per_second(self) -> float:
        """Trained tokens per second end to end (generation + training)."""
        return self.trained_tokens / self.step_s if self.step_s else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(trained_tokens=self.trained_tokens, completion_tokens=self.completion_tokens, step_s=self.step_s,
                 tokens_per_second=self.tokens_per_second)
        return d

    def lines(self) -> list:
        where = (f"a resident {self.precision} copy of the weights (transformers' generate)"
                 if self.mode == "resident" else
                 "layer-major streamed decoding: every unit's weights over the link once per decoded token, for "
                 "all rollouts at once")
        out = [f"GRPO: {self.rollouts:,} rollouts per step, prompts of {self.prompt_length:,} + completions of "
               f"<= {self.completion_length:,} tokens; generation on {where}",
               f"GRPO KV cache: {format_bytes(self.kv_bytes)} ("
               + (f"{self.precision}, the resident copy's) on the device" if self.mode == "resident" else
                  f"{self.precision}) " + KV_WHERE[self.kv_tier]
                  + (f", the rollouts decoded in {self.kv_batches} sub-batches" if self.kv_batches > 1 else ""))
               + ("" if self.room_bytes is None else
                  f" (device room between training steps: {format_bytes(self.room_bytes)})"),
               ]
        if self.kv_why and self.mode == "streamed":
            out.append(f"GRPO KV cache tier: {self.kv_tier}: {self.kv_why}")
        if self.kv_tier == "host":
            out.append(f"GRPO KV cache over the link per decoded token: {format_bytes(self.kv_in_bytes_per_token)} in "
                       f"(each full-attention layer's K/V as the layer runs, at the average length) + "
                       f"{format_bytes(self.kv_out_bytes_per_token)} back (the new token's entries), beside the "
                       f"weights' {format_bytes(self.weights_bytes)}")
        if self.step_s is not None and self.kv_tier != "none":
            s = self.step_s
            out.append(f"GRPO step: generation {fmt_seconds(self.generation_s)} ({self.generation_s / s:.0%}; prefill "
                       f"{fmt_seconds(self.prefill_s)}, {fmt_seconds(self.token_s)} per decoded token, bound by "
                       f"{self.token_bound}) + training {fmt_seconds(self.training_s)} = {fmt_seconds(s)}; "
                       f"{fmt_rate(self.tokens_per_second)} trained end to end ({self.trained_tokens:,} tokens a step; "
                       f"{fmt_rate(self.completion_tokens / s)} of completions)")
        return out + [f"GRPO note: {n}" for n in self.notes]


def plan_generation(config, units, plan, budgets: dict, rollouts: int, prompt_length: int,
                    completion_length: int, *, precision: str, reference: bool = False,
                    kept_beside: int = 0) -> GenerationPlan:
    """Where a step's generation runs and where its KV cache lives (no time: :func:`price`), by
    the engine's rule (``grpo_rollout.resident_fits``, ``decode.check_kv_budget``): generation
    runs between training steps, so its room is the device budget less what stays on the device
    between them (``planner.persistent_device_bytes``: the weight slots and the gradient staging
    buffers), not the training step's activations and boundaries, which the step frees (host RAM's
    room likewise: ``planner.persistent_host_bytes``). ``reference`` (``beta`` > 0): the reference
    model's engine, built with the policy's config, keeps the same slots and buffers beside them
    (``decode.share_device``); ``kept_beside``: other device bytes kept between steps (a streamed
    vision tower's block slots, ``decode.kept_on_device``)."""
    if not isinstance(kept_beside, int) or kept_beside < 0:
        raise ValueError(f"kept_beside={kept_beside!r}: the device bytes kept between steps beside the plan's, "
                         "a whole number >= 0")
    numel, tokens = sum(u.numel for u in units), prompt_length + completion_length
    kept = persistent_device_bytes(plan)
    beside = (kept if reference else 0) + kept_beside
    room = None if budgets.get("device") is None else max(budgets["device"] - kept - beside, 0)
    notes = ([f"the reference engine (beta > 0) keeps its weight slots and gradient buffers ({format_bytes(kept)}) "
              "on the device beside the policy's: counted out of generation's room"] if reference else [])
    cb = compute_bytes(precision)
    kv = kv_cache_bytes(config, rollouts, tokens, cb)
    if room is None or resident_need(config, numel, rollouts, tokens, cb) <= room:
        return GenerationPlan(rollouts, prompt_length, completion_length, precision, cb * numel, kv, "device",
                              "resident", room, notes=notes)
    host_room = None if budgets.get("host") is None else max(budgets["host"] - persistent_host_bytes(plan), 0)
    place = place_kv(config, rollouts, tokens, cb, room, host_room, weights_bytes=cb * numel)
    gp = GenerationPlan(rollouts, prompt_length, completion_length, precision, cb * numel, kv, place.tier, "streamed",
                        room, kv_host_bytes=place.host_bytes if place.tier == "host" else 0, kv_why=place.why,
                        kv_batches=place.batches, notes=notes)
    if gp.kv_tier == "none":
        gp.notes.append("the streamed decoder refuses this cache; generate fewer rollouts at once, shorten the "
                        "completions, or raise the device or host budget")
    return gp


def price(gp: GenerationPlan, config, units, shape, rates, *, training_s: float, cuda: bool) -> GenerationPlan:
    """``gp`` with its time at ``rates``: the prefill, each decoded token, the training step's."""
    R, P, C = gp.rollouts, gp.prompt_length, gp.completion_length
    layers, heads, _, head_dim = attention_shape(config)
    bf16, scale = gp.precision == "bf16", rates.compute_scale(cuda)   # (as the training step's prediction)
    mm = rates.matmul_rate(R, shape.hidden_size, shape.intermediate_size or 4 * shape.hidden_size, bf16=bf16) * scale
    at = (rates.attention_rate(head_dim, bf16=bf16) or mm) * scale
    head = [u for u in units if u.kind == "head"] or [u for u in units if u.kind == "embed" and u.tied_output]
    n_mm = sum(u.numel for u in units if u.kind == "layer") + sum(u.numel for u in head)
    attn_width = layers * heads * head_dim

    def compute(tokens: int, context: float) -> float:   # matmuls of ``tokens`` rows + their attention
        flops, attn = 2 * n_mm * tokens, 4 * tokens * context * attn_width
        return (flops / mm if mm else 0.0) + (attn / at if at else 0.0)

    link = (rates.h2d_pinned or rates.h2d_pageable) if cuda else rates.h2d_pageable   # a unit's load
    kv_avg = gp.kv_bytes * (P + C / 2) / (P + C)   # the cache read by an average decoded token
    compute_tok = compute(R, P + C / 2)
    if gp.mode == "streamed":
        if gp.kv_tier == "host":   # each full layer's K/V in at the average length, the new token's entries back
            gp.kv_in_bytes_per_token = int(gp.kv_host_bytes * (P + C / 2) / (P + C))
            gp.kv_out_bytes_per_token = gp.kv_host_bytes // (P + C)
        w = gp.weights_bytes * gp.kv_batches   # (sub-batches: the weights once per token of each)
        gp.link_bytes_per_token = w + gp.kv_in_bytes_per_token + gp.kv_out_bytes_per_token
        back = (rates.d2h_pinned or rates.d2h_pageable) if cuda else rates.d2h_pageable
        link_tok = ((w + gp.kv_in_bytes_per_token) / link if link else 0.0) + \
            (gp.kv_out_bytes_per_token / back if back else 0.0)   # (the two directions not assumed to overlap)
        gp.token_s, gp.token_bound = max((link_tok, "link"), (compute_tok, "compute"))
        gp.prefill_s = max(compute(R * P, P / 2), w / link if link else 0.0)
        if gp.kv_tier == "host" and back:   # the prompts' K/V to host RAM
            gp.prefill_s += gp.kv_host_bytes * P / (P + C) / back
    else:
        memory = DEVICE_MEMORY.get(rates.source)
        mem_tok = (gp.weights_bytes + kv_avg) / memory[0] if memory else 0.0
        gp.token_s, gp.token_bound = max((mem_tok, "device memory"), (compute_tok, "compute"))
        gp.prefill_s = compute(R * P, P / 2) + (gp.weights_bytes / link if link else 0.0)   # + the refresh
        gp.notes.append(f"device memory: {memory[1]}" if memory else
                        "a decoded token priced at its compute alone (no device-memory rate for these rates)")
    if not link:
        gp.notes.append("no host->device rate in these rates: the link counted as 0 s")
    gp.generation_s = gp.prefill_s + C * gp.token_s
    gp.training_s = float(training_s)
    gp.notes.append("every completion taken to reach completion_length (the decode runs to the longest one); "
                    "the prefill of every rollout's prompt (a group's shared prompt is prefilled once: less)")
    return gp


__all__ = ["DEVICE_MEMORY", "GenerationPlan", "KVPlace", "attention_shape", "compute_bytes", "full_layers",
           "host_kv_bytes", "kv_cache_bytes", "place_kv", "plan_generation", "price", "resident_need", "split_seq",
           "streamed_need"]

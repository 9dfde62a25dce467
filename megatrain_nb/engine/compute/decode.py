"""Layer-major streamed decoding: every rollout of a step advances one token together, so each
unit's weights cross to the device once per decoded token whatever the number of rollouts.

Example::

    from transformers import GenerationConfig
    dec = StreamedDecoder(engine)
    out = dec.generate([[5, 6, 7], [5, 6, 7], [9, 2]],
                       GenerationConfig(max_new_tokens=32, do_sample=True, temperature=0.8, eos_token_id=2))
    out.completions       # each row's new ids, cut after its first end-of-sequence id
    out.logps             # each row's per-token log-probs of its tokens (the raw logits / logprob_temperature)
    out.stats             # passes, rows computed, prefill rows, the KV cache's tier and bytes (moved)

**Design.** A decoding pass is the model's own forward on the engine, exactly as
``engine.forward_logits`` runs one: the embedding and the head bound from their slots for the
pass, each decoder layer run by its proxy as the model calls it, its weights taken from the pager
(the compute-dtype copy the transport loads; no extra cast) and handed back at once, the pager's
schedule prefetching the next layers meanwhile. The model's forward gets
``use_cache=True`` and a transformers ``DynamicCache`` (built from the model's config, so sliding
window layers keep only their window), so the model's own attention code fills and reads the KV
cache, which stays on the device (checked against ``generate`` on some thirty families: docs/GRPO.md).
Its full-attention layers are preallocated for the decoding's rows and tokens
(:class:`.kv_offload.DeviceKVCache`): each pass writes the new entries in place and the attention
reads a view, where ``DynamicLayer`` would copy the whole cache per layer per token.
One pass is one decoded token for every row: the prompt's pass (the prefill) gives each row's
first token, the next pass its second, and so on, so the transport loads each unit exactly once
per decoded token (``stats["passes"]``) whether 2 or 128 rows advance.

- **Shared prompts prefilled once**: rows with the same prompt (a GRPO group's ``num_generations``
  copies) are prefilled as one row, then the cache's rows are replicated
  (``Cache.reorder_cache``, which every cache layer has: attention, sliding window, and the
  linear-attention / state-space layers of hybrid families such as qwen3_next, zamba2,
  falcon_h1); ``stats["prefill_rows"]`` counts the rows prefilled.
- **Finished rows dropped**: a row that sampled an end-of-sequence id leaves the batch (its cache
  rows with it) before the next pass; ``stats["rows"]`` counts the rows the decoding passes ran.
- **Sampling** as ``generate`` samples: transformers' own logits processors in ``generate``'s
  order (repetition penalty on the prompt's real tokens and those generated, suppressed tokens,
  then temperature, top-k, top-p, min-p when ``do_sample``), ``torch.multinomial`` on the
  softmax (the global random stream, or a given generator), the arg max when ``do_sample=False``.
  Positions and masks as ``generate`` makes them (left-padded prompts, positions counted over the
  real tokens). Greedy decoding gives
  ``generate``'s tokens; sampled decoding draws from the same distributions, but once rows have
  left the batch the draws are not ``generate``'s (it keeps sampling for finished rows).
  GenerationConfig fields beyond these are refused by name (use ``generate`` on a resident model).
- **The KV cache's size** is checked before anything runs: rows x (prompt + new tokens) x, per
  layer, 2 x key/value heads x head dim x the compute dtype's bytes (a sliding layer: its window
  at most), plus the last logits, placed by the planner's rule (:func:`kv_place`,
  ``estimator_grpo.place_kv``): on the device when it fits the budget left between the engine's
  steps (``max_vram_gb`` minus the weight slots and gradient buffers that stay allocated,
  ``planner.persistent_device_bytes``: a step's activations are freed; no budget: it fits); else its
  full-attention layers' K/V in host RAM (:mod:`.kv_offload`: each layer's cache in to the device
  as the layer runs, the new token's entries back, twice across the link per decoded token,
  counted in ``stats``) when they fit beside the host plan and the rest fits the device; else the
  call is refused with both tiers' numbers and what to change (fewer rollouts at once, shorter
  completions, a larger budget).

The whole decoding runs under ``engine.lock`` (the weights do not change under it), without
gradients, in the model's own train/eval mode.
"""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, SuppressTokensLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from ... import threads
from ..planning.estimator_grpo import KVPlace, kv_cache_bytes, place_kv, streamed_need  # noqa: F401 - re-exported
from ..planning.planner import persistent_device_bytes, persistent_host_bytes
from ..proxies import bind, unbind
from .kv_offload import DeviceKVCache, HostKVCache

GIB = 1 << 30

#: GenerationConfig fields the decoder applies; any other one set away from its default is refused
APPLIED = frozenset({"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "min_p",
                     "repetition_penalty", "suppress_tokens", "eos_token_id", "pad_token_id", "bos_token_id",
                     "use_cache",
                     "disable_compile", "num_beams", "num_return_sequences",
                     "transformers_version", "return_dict_in_generate", "output_scores", "output_logits"})


@dataclass
class Decoded:
    """A decoding's result: each row's completion ids (cut after its first end-of-sequence id),
    the per-token log-probs of those ids, and the counts (:mod:`.decode`'s ``stats``)."""
    completions: List[List[int]]
    logps: List[torch.Tensor]
    stats: Dict[str, int] = field(default_factory=dict)


#: Engines whose device memory stays allocated beside an engine's between its steps (DPO's and
#: GRPO's reference engine where ``beta`` > 0): :func:`share_device`. Weak: a collected engine
#: leaves; a closed one counts nothing.
_BESIDE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def share_device(engine, other) -> None:
    """Count ``other``'s device memory between steps (:func:`kept_on_device`) in ``engine``'s room
    (:func:`device_left`): a second engine on the same device, the reference model's."""
    if other is not engine:
        _BESIDE.setdefault(engine, weakref.WeakSet()).add(other)


def kept_on_device(engine) -> int:
    """Device bytes an open engine keeps between its steps: its plan's weight slots and gradient
    staging buffers (``planner.persistent_device_bytes``) and a streamed vision tower's block
    slots and gradient buffers (``compute/vision_stream.py``: ``memory_report``'s
    ``vision_block_slots``, not in the engine's plan); 0 once closed."""
    if getattr(engine, "closed", False):
        return 0
    tower = getattr(getattr(getattr(engine, "runner", None), "tower", None), "pager", None)
    extra = int(tower.slot_bytes + tower.grad_buf_bytes) if tower is not None else 0
    return persistent_device_bytes(engine.plan) + extra


def device_left(engine) -> Optional[int]:
    """Device bytes the budget leaves between the engine's steps (None: no budget): the budget less
    what stays allocated between them (:func:`kept_on_device`: the weight slots, the gradient
    staging buffers, a streamed vision tower's block slots) and what engines sharing the device
    keep (:func:`share_device`: a DPO/GRPO reference engine); a step's activations are freed
    before generation runs."""
    cap = engine.plan.capacity.get("device")
    if cap is None:
        return None
    return cap - kept_on_device(engine) - sum(kept_on_device(o) for o in list(_BESIDE.get(engine, ())))


def decode_bytes(engine, rows: int, length: int) -> int:
    """Device bytes a decoding of ``rows`` x ``length`` tokens holds: the KV cache in the compute
    dtype and the last logits (fp32 logits, scores, probabilities)."""
    elem = torch.empty((), dtype=engine.dtype).element_size()
    return streamed_need(engine.model_config, rows, length, elem)


def host_left(engine) -> Optional[int]:
    """Host bytes the host budget leaves beside what the engine's plan keeps in host RAM between
    its steps (``planner.persistent_host_bytes``; None: no budget)."""
    cap = engine.plan.capacity.get("host")
    return None if cap is None else max(cap - persistent_host_bytes(engine.plan), 0)


def kv_place(engine, rows: int, length: int, *, group: int = 1, split: bool = True) -> KVPlace:
    """Where the KV cache of ``rows`` x ``length`` goes (the planner's rule, ``estimator_grpo.place_kv``,
    priced with the engine's weights in its compute dtype): "device" (in ``place.batches``
    sub-batches of ``group``-multiples where the whole does not fit and ``split``), "host" or "none"."""
    elem = torch.empty((), dtype=engine.dtype).element_size()
    left = device_left(engine)
    return place_kv(engine.model_config, rows, length, elem, None if left is None else max(left, 0),
                    host_left(engine), weights_bytes=elem * sum(u.numel for u in engine.units), group=group,
                    split=split)


def check_kv_budget(engine, rows: int, length: int, *, group: int = 1, split: bool = True) -> KVPlace:
    """:func:`kv_place` of ``rows`` x ``length``; refused, with the numbers, where neither the
    device budget between the engine's steps (whole or in sub-batches) nor host RAM beside
    its host plan holds it."""
    place = kv_place(engine, rows, length, group=group, split=split)
    if place.tier == "none":
        left, host = device_left(engine), host_left(engine)
        raise ValueError(
            f"streamed decoding of {rows} rollouts x {length} tokens (prompt + completion) needs "
            f"{decode_bytes(engine, rows, length) / GIB:.3f} GiB for its KV cache and logits; the device budget "
            f"(max_vram_gb={engine.config.max_vram_gb}) leaves {max(left or 0, 0) / GIB:.3f} GiB beside the engine's "
            f"weight slots and gradient buffers ({persistent_device_bytes(engine.plan) / GIB:.3f} GiB), and in host "
            f"RAM the cache would take "
            f"{place.host_bytes / GIB:.3f} GiB of the {(host or 0) / GIB:.3f} GiB left beside the host plan "
            f"({persistent_host_bytes(engine.plan) / GIB:.3f} GiB), with {place.device_bytes / GIB:.3f} GiB still on the "
            "device; generate fewer rollouts at once (a smaller generation_batch_size), shorten "
            "max_completion_length, or raise max_vram_gb / max_host_gb")
    return place


def check_generation_config(gc: GenerationConfig) -> None:
    """Refuse, by name, the GenerationConfig fields the decoder does not apply."""
    default = GenerationConfig().to_diff_dict()
    mine = gc.to_diff_dict()
    odd = sorted(k for k, v in mine.items() if k not in APPLIED and default.get(k) != v
                 and not (k == "cache_implementation" and v in (None, "dynamic")))   # (its cache is dynamic)
    if (gc.num_beams or 1) > 1 or (gc.num_return_sequences or 1) > 1:
        odd.append("num_beams/num_return_sequences (one sequence per row)")
    if odd:
        raise ValueError(f"streamed decoding does not apply the GenerationConfig field(s) {', '.join(odd)}: it "
                         "samples with temperature, top_k, top_p, min_p, repetition_penalty and suppress_tokens (or "
                         "greedily); "
                         "remove them, or generate on a resident model (generation='resident')")
    if gc.max_new_tokens is None or gc.max_new_tokens < 1:
        raise ValueError(f"streamed decoding needs GenerationConfig.max_new_tokens of at least 1 (the new tokens per "
                         f"row), got {gc.max_new_tokens}")


def processors(gc: GenerationConfig, pad_lengths: torch.Tensor) -> LogitsProcessorList:
    """transformers' logits processors in ``generate``'s order, for rows whose prompts have
    ``pad_lengths`` left pads (the repetition penalty skips them, as ``generate``)."""
    out = LogitsProcessorList()
    if gc.repetition_penalty is not None and gc.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(float(gc.repetition_penalty), prompt_ignore_length=pad_lengths))
    if gc.suppress_tokens is not None:
        out.append(SuppressTokensLogitsProcessor(gc.suppress_tokens, device=pad_lengths.device))
    if gc.do_sample:
        if gc.temperature is not None and gc.temperature != 1.0:
            out.append(TemperatureLogitsWarper(gc.temperature))
        if gc.top_k is not None and gc.top_k != 0:
            out.append(TopKLogitsWarper(top_k=gc.top_k, min_tokens_to_keep=1))
        if gc.top_p is not None and gc.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=gc.top_p, min_tokens_to_keep=1))
        if gc.min_p is not None:
            out.append(MinPLogitsWarper(min_p=gc.min_p, min_tokens_to_keep=1))
    return out


def eos_ids(gc: GenerationConfig) -> List[int]:
    e = gc.eos_token_id
    return [] if e is None else ([int(e)] if isinstance(e, int) else [int(x) for x in e])


def draw(probs: torch.Tensor, generator) -> torch.Tensor:
    """One token per row by ``torch.multinomial`` (on ``generator``'s device when one is given).
    A list: one generator per row; each row's token is the inverse of its cumulative
    distribution (fp64) at one uniform draw of its own generator, so a row's draws depend on no
    other row, and only those draws leave the device's logits where they are."""
    if generator is None:
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    if isinstance(generator, (list, tuple)):
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=g.device).cpu() for g in generator])
        cdf = probs.double().cumsum(-1)
        tok = torch.searchsorted(cdf, (u.to(probs.device) * cdf[:, -1])[:, None], right=True)[:, 0]
        return tok.clamp(max=probs.shape[-1] - 1)   # (the first token whose cumulative mass passes the draw)
    return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(1).to(probs.device)


def pick(logits, seqs, procs, gc: GenerationConfig, temperature: float, generator, alive):
    """(tokens, their log-probs) of one pass: ``procs`` on the rows' ``logits`` [rows, vocab], then
    a draw (``gc.do_sample``; ``generator`` a list: one per row of ``alive``) or the arg max; the
    log-probs are those of the raw ``logits / temperature``."""
    scores = procs(seqs, logits)
    if gc.do_sample:
        rows_gen = [generator[i] for i in alive.tolist()] if isinstance(generator, (list, tuple)) else generator
        tok = draw(torch.softmax(scores, dim=-1), rows_gen)
    else:
        tok = torch.argmax(scores, dim=-1)
    lp = torch.log_softmax(logits if temperature == 1 else logits / temperature, dim=-1).gather(1, tok[:, None])[:, 0]
    return tok, lp


def left_padded(rows: Sequence[Sequence[int]], pad: int):
    """(ids, mask, positions) [len(rows), longest], left-padded; positions as ``generate``'s."""
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, n - len(r):] = torch.tensor(list(r), dtype=torch.long)
        mask[i, n - len(r):] = 1
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return ids, mask, pos


def gathered(picked, rows: int, stats) -> Decoded:
    """Each row's tokens and log-probs from the passes' ``(rows, tokens, log-probs)``."""
    at = torch.cat([a for a, _, _ in picked]).cpu()
    tok = torch.cat([t for _, t, _ in picked]).cpu()
    lp = torch.cat([v for _, _, v in picked]).float().cpu()
    order = torch.sort(at, stable=True).indices   # by row, each row's passes in order
    counts = torch.bincount(at, minlength=rows).tolist()
    return Decoded([t.tolist() for t in tok[order].split(counts)], list(lp[order].split(counts)), stats)


class StreamedDecoder:
    """Decodes on ``engine``'s streamed weights, all rows one token per pass (see the module)."""

    def __init__(self, engine, *, kv_tier: str = "auto"):
        if kv_tier not in ("auto", "host"):
            raise ValueError(f"kv_tier={kv_tier!r}: 'auto' (the planner's place: device, else host RAM) or 'host' "
                             "(the KV cache in host RAM whatever fits)")
        self.engine, self.kv_tier = engine, kv_tier
        self.last_place: Optional[KVPlace] = None
        self.runner = engine.runner
        params = inspect.signature(self.runner.base.forward).parameters
        self.cache_key = "cache" if "cache" in params else "past_key_values"   # transformers 5.x / 4.x

    def generate(self, prompt_ids: Sequence[Sequence[int]], generation_config: GenerationConfig, *,
                 logprob_temperature: float = 1.0, generator=None, more=None) -> Decoded:
        """Each prompt's completion (see the module); ``logprob_temperature``: the log-probs are
        those of ``logits / logprob_temperature`` (GRPO's training temperature); ``generator``:
        the sampling's random stream (default: the global one, as ``generate``'s; a list: one per
        row, each row drawing from its own); ``more(going) -> bool``: for ranks decoding in
        lockstep (each pass gathers every unit), whether any rank still has rows decoding given
        whether this one has; a rank whose rows all ended runs filler passes (its first row, the
        results unused: ``stats["filler_passes"]``) until none has."""
        gc = generation_config
        check_generation_config(gc)
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("streamed decoding needs at least one prompt, each of at least one token")
        eng = self.engine
        if eng.closed:
            raise RuntimeError("this StreamingEngine is closed; create a new one.")
        steps = int(gc.max_new_tokens)
        length = max(len(p) for p in prompt_ids) + steps
        group = next((i for i, p in enumerate(prompt_ids) if p != prompt_ids[0]), len(prompt_ids))
        place = check_kv_budget(eng, len(prompt_ids), length, group=group, split=more is None)
        self.last_place = place
        size = place.batch_rows or len(prompt_ids)
        with eng.lock, torch.no_grad():
            threads.set_thread_device(eng.device)
            eng.updates.check()
            parts = [self._batch(prompt_ids[i:i + size], gc, place, length, logprob_temperature,
                                 generator[i:i + size] if isinstance(generator, (list, tuple)) else generator, more)
                     for i in range(0, len(prompt_ids), size)]
        if len(parts) == 1:
            return parts[0]
        stats = {k: (sum(p.stats[k] for p in parts) if k in ("passes", "rows", "prefill_rows", "rows_in") else v)
                 for k, v in parts[0].stats.items()}
        stats["kv_batches"] = len(parts)
        return Decoded([c for p in parts for c in p.completions], [lp for p in parts for lp in p.logps], stats)

    def _batch(self, prompt_ids, gc, place, length, temperature, generator, more) -> Decoded:
        """One (sub-)batch's decoding: its distinct prompts prefilled once, then a token a pass."""
        groups: Dict[tuple, int] = {}
        row_prompt = [groups.setdefault(tuple(p), len(groups)) for p in prompt_ids]
        stats = {"passes": 0, "rows": 0, "prefill_rows": len(groups), "rows_in": len(prompt_ids),
                 "kv_bytes_planned": place.device_bytes, "kv_host_bytes": place.host_bytes,
                 "kv_tier": place.tier, "kv_length": length, "kv_batches": place.batches}
        return self._decode(list(groups), row_prompt, gc, int(gc.max_new_tokens), temperature, stats, generator, more)

    def _decode(self, unique, row_prompt, gc, steps, temperature, stats, generator, more) -> Decoded:
        dev = self.engine.device
        pad = gc.pad_token_id if gc.pad_token_id is not None else (eos_ids(gc) or [0])[0]
        stops = torch.tensor(eos_ids(gc) or [-1], device=dev)
        ids_u, mask_u, pos_u = (t.to(dev) for t in left_padded(unique, pad))
        host = stats["kv_tier"] == "host" or self.kv_tier == "host"
        cache = (HostKVCache if host else DeviceKVCache)(self.engine.model_config, len(row_prompt),
                                                        stats["kv_length"])   # (per layer type: hybrid families too)
        logits = self._pass(ids_u, mask_u, pos_u, cache)          # the prefill: one row per distinct prompt
        stats["passes"] += 1
        rows = torch.tensor(row_prompt, device=dev)
        cache.reorder_cache(rows)                          # each group's cache replicated
        logits, mask, seqs = logits[rows], mask_u[rows], ids_u[rows]
        pos = pos_u[rows, -1:]
        alive = torch.arange(len(row_prompt), device=dev)        # the rows still decoding
        procs = processors(gc, (mask == 0).sum(1))
        picked = []   # per pass: (the rows decoding, their tokens, their log-probs)
        filler = False   # (lockstep ranks: this one's rows all ended, another's decode on)
        for t in range(steps):
            if not filler:
                tok, lp = pick(logits, seqs, procs, gc, temperature, generator, alive)
                picked.append((alive, tok, lp))
                keep = ~torch.isin(tok, stops)
            going = not filler and bool(keep.any())
            if t + 1 == steps or not (going if more is None else more(going)):
                break
            if not going and not filler:   # filler passes on the first row until no rank decodes
                filler, keep = True, torch.arange(len(keep), device=dev) == 0
                stats["filler_passes"] = 0
            seqs = torch.cat([seqs, tok[:, None]], dim=1)
            if not bool(keep.all()):                               # finished rows leave the batch
                idx = keep.nonzero()[:, 0]
                cache.reorder_cache(idx)
                alive, tok, mask, seqs, pos = alive[idx], tok[idx], mask[idx], seqs[idx], pos[idx]
                procs = processors(gc, (mask == 0).sum(1))
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos + 1
            logits = self._pass(tok[:, None], mask, pos, cache)
            stats["passes"] += 1
            if filler:
                stats["filler_passes"] += 1
            else:
                stats["rows"] += len(alive)
        if isinstance(cache, HostKVCache):
            stats["kv_tier"] = "host"
            stats.update(kv_h2d_bytes=cache.moved["h2d_bytes"], kv_d2h_bytes=cache.moved["d2h_bytes"],
                         kv_crossings=cache.moved["crossings"], kv_host_layers=cache.host_layers)
        return gathered(picked, len(row_prompt), stats)

    def _pass(self, ids, mask, pos, cache) -> torch.Tensor:
        """One forward of the model on the engine (every unit loaded once, in the pager's schedule)
        with ``cache`` filled by the model's own attention: fp32 logits [rows, vocab] of the last position."""
        r = self.runner
        order = r.schedule(False)
        r.plan_reads(order, None)   # (the disk tier's read-ahead, as a forward's)
        r.pager.set_schedule(order)
        outer = [u for u in (r.embed, r.head) if u.numel]
        try:
            for u in outer:
                bind(u, r.pager.acquire(u), requires_grad=False)
            out = r.base(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         **{self.cache_key: cache})
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            logits = r.loss_head.logits(hidden[:, -1:])[:, -1].float()
        except BaseException:
            for u in r.units:
                unbind(u, r.placeholders)
            r.pager.reset()
            raise
        for u in reversed(outer):
            unbind(u, r.placeholders)
            r.pager.release(u)
        return logits


__all__ = ["Decoded", "StreamedDecoder", "check_kv_budget", "decode_bytes", "device_left", "kept_on_device", "share_device",
           "host_left", "kv_cache_bytes", "kv_place"]

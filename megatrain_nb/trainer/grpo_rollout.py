"""Rollouts of a GRPO run: generation on a resident copy of the current weights or streamed on
the engine, per-token log-probs by a forward-only pass of an engine, rewards and advantages
(TRL's formulas).

- :class:`ResidentPolicy`: a plain Hugging Face module holding the engine's current weights in
  its compute dtype (bf16 under ``precision="bf16"``: the compute-dtype copies the update writes;
  copied after each optimizer step, only when they changed), on which transformers' ``generate``
  samples the completions exactly as ``trl.GRPOTrainer`` does (its GenerationConfig, its end of
  sequence ids, the completion cut after the first of them). Building it draws no random number.
- :class:`StreamedPolicy`: the engine's layer-major streamed decoder
  (:mod:`megatrain_nb.engine.compute.decode`) on the engine's own weights: every rollout advances
  a token together, each unit crosses to the device once per decoded token.
- :func:`make_policy`: which of the two (``generation="auto"``: the resident copy when it and its
  KV cache, both in the engine's compute dtype (:func:`resident_bytes`), fit the device budget
  between the engine's steps, else streamed; the copy's memory is released after each
  generation batch, :meth:`ResidentPolicy.release`, so training runs beside none of it).
- :func:`completion_logps`: the per-token log-probs of the completions (temperature applied, as
  TRL's fused head) through an engine's chunked head, forward only (:class:`TokenLogps`).
- :func:`score`: every reward function on every completion; a function that raises, returns a
  NaN / infinite value or the wrong number of rewards is an error naming it and the prompt.
- :func:`advantages`: group (or batch) normalised rewards, TRL's ``multi_objective_aggregation``.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from megatrain_nb.engine.compute.decode import StreamedDecoder, device_left, kv_place
from megatrain_nb.engine.compute.objective import TOKEN_NLL
from megatrain_nb.engine.planning.estimator_grpo import resident_need

from .data import DataError

#: ResidentPolicy.version while its parameters are released (any refresh copies the weights in again)
RELEASED = object()

#: GRPOTrainer's ``generation=`` (an engine option keyword): where the completions are sampled
GENERATION_MODES = ("auto", "resident", "streamed")


class RewardError(DataError):
    """A reward function failed on a batch of completions: nothing was trained on that batch."""


# ---------------------------------------------------------------------------------- generation
def eos_token_ids(model_config_eos, tokenizer) -> List[int]:
    """TRL's end-of-sequence ids: the model's generation config's, the tokenizer's first."""
    ids = model_config_eos
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if tokenizer.eos_token_id not in ids:
        ids = [tokenizer.eos_token_id, *ids]
    return ids


def generation_config(args, tokenizer, eos_ids):
    """``transformers.GenerationConfig`` as trl.GRPOTrainer builds it (``generation_kwargs`` last)."""
    from transformers import GenerationConfig

    kw = {"max_new_tokens": args.max_completion_length, "do_sample": True, "pad_token_id": tokenizer.pad_token_id,
          "bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos_ids, "temperature": args.temperature,
          "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
          "repetition_penalty": args.repetition_penalty, "cache_implementation": args.cache_implementation}
    if args.generation_kwargs is not None:
        kw.update(args.generation_kwargs)
    return GenerationConfig(**kw, disable_compile=True)


def left_pad(rows: List[List[int]], value: int) -> tuple:
    """(ids, mask) [B, max len], left-padded as TRL pads prompts."""
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), value, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, n - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, n - len(r):] = 1
    return ids, mask


def right_pad(rows: List[List[int]], value: int) -> tuple:
    n = max(max((len(r) for r in rows), default=0), 1)
    ids = torch.full((len(rows), n), value, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, :len(r)] = 1
    return ids, mask


def shadow_views(engine) -> Dict[str, torch.Tensor]:
    """name -> a view of the compute-dtype copy of that parameter the engine's update writes (the
    host store's shadows, ARCHITECTURE §15: kept for a compute dtype narrower than fp32 on CUDA,
    for the units whose masters are in host RAM, in one process); {} where it keeps none."""
    store = getattr(engine, "store", None)
    if store is None or getattr(engine, "sharded", None) is not None or engine.dtype == torch.float32:
        return {}
    out = {}
    for u in engine.units:
        sh = store.shadows.get(u.index)
        if sh is not None and sh.dtype == engine.dtype:
            out.update((p.name, sh[p.offset:p.offset + p.numel].view(p.shape)) for p in u.params)
    return out


class ResidentPolicy:
    """A plain HF module with the engine's current weights, for ``generate`` (the model fits).

    It is held in the engine's compute dtype (``dtype``: bf16 when ``precision="bf16"``, its KV
    cache with it; fp32 otherwise, as before). A bf16 copy is refreshed from the compute-dtype
    copies the engine's update writes (:func:`shadow_views`: no cast) where the engine keeps them
    (CUDA, weights in host RAM, one process); elsewhere (the CPU, the disk tier, several ranks)
    from the fp32 masters, cast once per refresh as they are copied in."""

    kind = "resident"

    def __init__(self, model_config, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng(devices=[]):   # no draw from the run's random stream
            # built in ``dtype`` as from_pretrained(dtype=) builds it (buffers such as rotary
            # frequencies stay fp32); fp32: exactly as before
            model = AutoModelForCausalLM.from_config(model_config) if dtype == torch.float32 else \
                AutoModelForCausalLM.from_config(model_config, dtype=dtype)
        self.model = model.eval()
        self.dtype = dtype
        self.version = None
        self._released: Dict[str, torch.Size] = {}   # name -> shape of each parameter whose memory is released
        self.cast_refreshes = 0   # refreshes that cast a parameter from the fp32 masters (compute dtype != fp32)

    def refresh(self, engine, version) -> None:
        """The engine's weights copied in (once per ``version``: the optimizer step they are from)."""
        if version == self.version:
            return
        if self.version is None:   # generation runs where the engine computes
            self.model.to(getattr(engine, "device", "cpu"))
        params = dict(self.model.named_parameters())
        for name, shape in self._released.items():   # (released after the last generation: allocated again)
            params[name].data = torch.empty(shape, dtype=params[name].dtype, device=params[name].device)
        unwritten, self._released = set(self._released), {}
        shadows, cast = None, False
        with torch.no_grad():
            for name, w in engine.named_parameters():   # (after every update: the shadows are current)
                if shadows is None:
                    shadows = shadow_views(engine)
                src = shadows.get(name, w)
                cast = cast or src.dtype != self.dtype
                params[name].copy_(src, non_blocking=False)
                unwritten.discard(name)
        if unwritten:   # (allocated again, uninitialised: never generate on them)
            raise RuntimeError(f"the resident copy's parameters {sorted(unwritten)[:3]} have no engine weight to copy "
                               "in after their release: generate with generation='streamed'")
        self.model.tie_weights()
        self.cast_refreshes += int(cast and self.dtype != torch.float32)
        self.version = version

    def release(self) -> None:
        """Free the device memory of the copy's parameters once a generation batch is made: the
        training steps that follow run beside the engine's own slots and buffers only, as
        :func:`resident_fits` (and the estimate) counts generation's room between the engine's
        steps, not beside a step's activations. The next :meth:`refresh` allocates them again and
        copies the weights in (which it does after every optimizer step anyway: only a second
        generation on the same weights, an evaluation's, copies once more). The buffers (rotary
        frequencies: small) stay."""
        if self._released or self.version is None:
            return
        for name, p in self.model.named_parameters():
            self._released[name] = p.shape
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.version = RELEASED

    @property
    def released(self) -> bool:
        """Whether the copy's parameters are released (:meth:`release`) until the next refresh."""
        return bool(self._released)

    def nbytes(self) -> int:
        """Bytes of the copy's parameters (a tied weight once), whether held now or released."""
        return sum(math.prod(self._released.get(n, p.shape)) * p.element_size()
                   for n, p in self.model.named_parameters())

    @torch.no_grad()
    def generate(self, prompt_ids: List[List[int]], config, pad_id: int, eos_ids: List[int]) -> List[List[int]]:
        """Each prompt's completion ids, cut after the first end-of-sequence id (TRL's rule)."""
        ids, mask = left_pad(prompt_ids, pad_id)
        dev = next(self.model.parameters()).device
        out = self.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), generation_config=config)
        comp = out[:, ids.shape[1]:].cpu()
        is_eos = torch.isin(comp, torch.tensor(eos_ids))
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
        any_eos = is_eos.any(dim=1)
        eos_idx[any_eos] = is_eos.int().argmax(dim=1)[any_eos]
        keep = torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1) <= eos_idx[:, None]
        return [c[m].tolist() for c, m in zip(comp, keep)]


class StreamedPolicy:
    """Generation streamed on the engine (the model need not fit the device): its weights are the
    engine's own, so there is nothing to refresh."""

    kind = "streamed"

    def __init__(self, engine):
        self.decoder = StreamedDecoder(engine)
        self.last_stats: dict = {}

    def refresh(self, engine, version) -> None:
        return None

    def release(self) -> None:
        return None   # (the KV cache is freed as the decoding ends; the weights are the engine's)

    def generate(self, prompt_ids: List[List[int]], config, pad_id: int, eos_ids: List[int], *, generator=None,
                 more=None) -> List[List[int]]:
        """Each prompt's completion ids, cut after the first end-of-sequence id (``config``'s);
        ``generator`` / ``more``: the decoder's (per-rollout streams, ranks decoding in lockstep)."""
        out = self.decoder.generate(prompt_ids, config, generator=generator, more=more)
        self.last_stats = out.stats
        return out.completions


def check_generation(mode) -> str:
    if mode not in GENERATION_MODES:
        raise ValueError(f"generation={mode!r}: one of {', '.join(map(repr, GENERATION_MODES))} (where completions are "
                         "sampled: 'resident' = transformers' generate on a resident copy of the weights, 'streamed' = "
                         "the engine's layer-major decoder, 'auto' = resident when the model fits the device budget)")
    return mode


def resident_bytes(engine, rows: int, length: int) -> int:
    """Device bytes of a resident copy in the engine's compute dtype and its KV cache (the same
    dtype) for ``rows`` x ``length`` tokens: 2 bytes a value in bf16, 4 in fp32."""
    elem = torch.empty((), dtype=engine.dtype).element_size()
    return resident_need(engine.model_config, engine.num_parameters(), rows, length, elem)


def resident_fits(engine, rows: int, length: int) -> bool:
    """Whether a resident copy of the model in the compute dtype and its KV cache for ``rows`` x
    ``length`` tokens (:func:`resident_bytes`) fit the device budget left between the engine's
    steps (``decode.device_left``: the budget less the weight slots and gradient buffers that stay
    allocated; a step's activations are freed, and the copy is released after generating,
    :meth:`ResidentPolicy.release`) (no budget: yes)."""
    left = device_left(engine)
    return left is None or resident_bytes(engine, rows, length) <= left


def make_policy(engine, mode: str, rows: int, length: int):
    """The policy that samples the completions (``mode``: :data:`GENERATION_MODES`)."""
    if mode == "streamed" or (mode == "auto" and not resident_fits(engine, rows, length)):
        return StreamedPolicy(engine)
    return ResidentPolicy(engine.model_config, engine.dtype)


def generation_words(engine, mode: str, rows: int, length: int) -> str:
    """Where ``make_policy`` samples ``rows`` x ``length`` tokens and why, and (streamed) where the
    decoder's KV cache goes and why (``decode.kv_place``, the estimate's rule): the run's line."""
    gib, left = 1 << 30, device_left(engine)
    room = ("no device budget" if left is None else
            f"{max(left, 0) / gib:.3f} GiB of device room between the engine's steps")
    need = resident_bytes(engine, rows, length) / gib
    if not (mode == "streamed" or (mode == "auto" and not resident_fits(engine, rows, length))):
        return (f"resident copy (transformers' generate) for {rows} rollouts x {length} tokens: the copy and its KV "
                f"cache ({need:.3f} GiB) fit {room}" + (" (generation='resident')" if mode == "resident" else ""))
    why = ("generation='streamed'" if mode == "streamed" else
           f"the resident copy and its KV cache ({need:.3f} GiB) exceed {room}")
    place = kv_place(engine, rows, length)
    return (f"layer-major streamed decoding for {rows} rollouts x {length} tokens ({why}); KV cache "
            f"{ {'device': 'on the device', 'host': 'in host RAM', 'none': 'refused'}[place.tier]}"
            + (f" in {place.batches} sub-batches" if place.batches > 1 else "") + f": {place.why}")


# ---------------------------------------------------------------------------------- log-probs
class TokenLogps:
    """A forward-only objective of the chunked head (stateless, no side data): each loss token's
    log-prob (temperature applied) in [batch, seq] (shifted-label coordinates), returned as the
    micro-batch's metric ``logps`` (on the CPU: ``EngineOutput.objective_metrics``)."""

    differentiable = ()

    def __init__(self, temperature: float = 1.0):
        self.temperature = temperature

    def context(self, labels, data):
        return labels.shape

    def token_stats(self, shape, logits, labels, start, grad):
        lp = torch.log_softmax(logits / self.temperature, dim=-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        full = torch.zeros(shape, dtype=lp.dtype, device=lp.device)
        full[:, start:start + labels.shape[1]] = lp * (labels != -100)
        if self.temperature != 1.0:
            return {"logps": full}
        return {"logps": full, TOKEN_NLL: -full.sum(1)}   # the head's cross-entropy, already here

    def loss(self, shape, stats):
        return stats["logps"].sum() * 0.0

    def metrics(self, shape, stats, loss):
        return {"logps": stats["logps"].detach().cpu()}


def completion_logps(engine, batch: dict, prompt_len: int, temperature: float, rows: int) -> torch.Tensor:
    """[B, C] per-token log-probs of the completions of ``batch`` (its input_ids, attention_mask,
    labels), forward only, ``rows`` sequences at a time (TRL's per-device batch)."""
    obj = TokenLogps(temperature)
    B = batch["input_ids"].shape[0]
    parts = [engine.evaluate(batch["input_ids"][s:s + rows], attention_mask=batch["attention_mask"][s:s + rows],
                             labels=batch["labels"][s:s + rows], loss_fn=obj).objective_metrics[0]["logps"]
             for s in range(0, B, rows)]
    full = torch.cat(parts, dim=0)
    C = batch["input_ids"].shape[1] - prompt_len
    return full[:, prompt_len - 1:prompt_len - 1 + C]


# ---------------------------------------------------------------------------------- rewards
def _call_reward(fn, name, prompts, completions, completion_ids, kwargs) -> List[float]:
    try:
        out = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    except Exception as e:
        raise RewardError(f"the reward function {name!r} raised {type(e).__name__}: {e} (on the batch whose first "
                          f"prompt is {prompts[0]!r}); nothing was trained on this batch") from e
    out = list(out) if out is not None else []
    if len(out) != len(prompts):
        raise RewardError(f"The reward function {name!r} returned {len(out)} rewards, but {len(prompts)} were expected "
                          f"(one per prompt-completion pair; first prompt {prompts[0]!r}). Make sure the reward "
                          "function returns exactly one reward per completion; nothing was trained on this batch.")
    vals = []
    for i, r in enumerate(out):
        if r is None:   # TRL's "this function does not score this row"
            vals.append(float("nan"))
            continue
        v = float(r)
        if not math.isfinite(v):
            raise RewardError(f"the reward function {name!r} returned {v} for the prompt {prompts[i]!r} and the "
                              f"completion {completions[i]!r}; return a finite number (or None: not scored); "
                              "nothing was trained on this batch")
        vals.append(v)
    return vals


def _model_reward(model, proc, prompts, completions, chat_kwargs) -> torch.Tensor:
    from trl.data_utils import apply_chat_template, is_conversational

    if is_conversational({"prompt": prompts[0]}):
        texts = [apply_chat_template({"messages": p + c}, proc, **chat_kwargs)["text"]
                 for p, c in zip(prompts, completions)]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    enc = proc(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.inference_mode():
        return model(**enc).logits[:, 0].float()


def score(funcs, names, procs, inputs: List[dict], prompts, completions, completion_ids, extra: dict,
          chat_kwargs: Optional[dict] = None) -> torch.Tensor:
    """[B, functions] rewards, as trl.GRPOTrainer._calculate_rewards (callables get the prompts,
    completions, completion ids, every other dataset column and ``extra``)."""
    out = torch.zeros(len(prompts), len(funcs))
    keys = [k for k in inputs[0] if k not in ("prompt", "completion", "completion_ids")]
    kwargs = {k: [x[k] for x in inputs] for k in keys}
    kwargs.update(extra)
    for i, (fn, name, proc) in enumerate(zip(funcs, names, procs)):
        if isinstance(fn, torch.nn.Module):
            out[:, i] = _model_reward(fn, proc, prompts, completions, chat_kwargs or {})
        else:
            out[:, i] = torch.tensor(_call_reward(fn, name, prompts, completions, completion_ids, kwargs),
                                     dtype=torch.float32)
    return out


def advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, G: int, scale_rewards: str,
               aggregation: str = "sum_then_normalize") -> tuple:
    """(advantages, is_std_zero) of TRL's formulas for groups of ``G`` completions."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights[None]).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
        if scale_rewards in ("group", "none"):
            std = (nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0) if G > 1
                   else torch.zeros_like(rewards))
        elif scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            raise ValueError(f"Invalid value for scale_rewards: {scale_rewards}. Must be one of 'batch', 'group', or "
                             "'none'.")
        adv = rewards - mean
        if scale_rewards != "none":
            adv = adv / (std + 1e-4)
    elif aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, G, rewards_per_func.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if G > 1 else torch.zeros_like(mean_k)
        rk = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
        rewards = (rk * weights[None]).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        adv = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    else:
        raise ValueError(f"Invalid multi_objective_aggregation: {aggregation}. Must be 'sum_then_normalize' or "
                         "'normalize_then_sum'.")
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def reward_metrics(rewards_per_func, weights, names, is_std_zero) -> Dict[str, float]:
    """TRL's reward metrics of one generation batch."""
    from trl.trainer.utils import nanstd

    m = {}
    for i, name in enumerate(names):
        m[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        m[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
    rewards = (rewards_per_func * weights[None]).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    m["reward"] = torch.nanmean(rewards).item()
    m["reward_std"] = nanstd(rewards).item()
    m["frac_reward_zero_std"] = is_std_zero.float().mean().item()
    return m


def length_metrics(completion_ids: List[List[int]], stops: List[int]) -> Dict[str, float]:
    """TRL's completions/* metrics (``stops``: the end-of-sequence ids and the pad id)."""
    lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.float32)
    truncated = torch.tensor([not c or c[-1] not in stops for c in completion_ids])
    term = lengths[~truncated]
    term = term if len(term) else torch.zeros(1)
    return {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.float().mean().item(),
            "completions/mean_terminated_length": term.mean().item(),
            "completions/min_terminated_length": term.min().item(),
            "completions/max_terminated_length": term.max().item()}


__all__ = ["GENERATION_MODES", "ResidentPolicy", "RewardError", "StreamedPolicy", "TokenLogps", "advantages",
           "check_generation", "completion_logps", "eos_token_ids", "generation_config", "length_metrics",
           "make_policy", "resident_bytes", "resident_fits", "reward_metrics", "score", "shadow_views"]

"""Sampling text from the engine's current weights: the engine's streamed decoder
(:mod:`.decode`: a KV cache on the device, or in host RAM where only host RAM holds it, each unit
loaded once per token) when the prompt and the new tokens fit the model's positions and the
planner places the cache (``decode.kv_place``); else (or an engine that only
gives ``forward_logits``) each new token re-runs the window, the last ``max_positions`` tokens.

Example::

    text = sample_text(engine, tokenizer, "def main(", max_new_tokens=40, temperature=0.8, top_k=50)
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from transformers import GenerationConfig

from megatrain_nb.values import check

from ..family import max_positions
from .decode import StreamedDecoder, kv_place


def sample_text(
    engine: Any,
    tokenizer: Any,
    prompt: str,
    *,
    max_new_tokens: int = 50,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    seed: Optional[int] = None,
    answer_only: bool = False,
) -> str:
    """``prompt`` followed by up to ``max_new_tokens`` sampled tokens, decoded (``answer_only``:
    the sampled tokens alone, e.g. the assistant's answer to a chat prompt).

    The whole sample is drawn under ``engine.lock`` so every token sees the same weights: a
    running trainer waits at most this long before its next micro-batch.
    """
    if tokenizer is None:
        raise ValueError("generate() needs a tokenizer: pass tokenizer= to the Session "
                         "(or use a model folder that contains one)")

    max_new_tokens, temperature = check("max_new_tokens", max_new_tokens), check("temperature", temperature)
    top_k, seed = check("top_k", top_k), check("sample_seed", seed, "seed")
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"]) if prompt else []
    if not ids:
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None:
            bos = getattr(tokenizer, "eos_token_id", None)
        if bos is None:
            raise ValueError("an empty prompt needs a tokenizer with a bos or eos token")
        ids = [int(bos)]
    window = max_positions(engine.model_config) or 2048  # tokens the model attends over
    eos = getattr(tokenizer, "eos_token_id", None)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    new: list[int] = []
    with engine.lock:
        if hasattr(engine, "runner") and len(ids) + max_new_tokens <= window \
                and kv_place(engine, 1, len(ids) + max_new_tokens).tier != "none":
            new = _decoded(engine, ids, max_new_tokens, temperature, top_k, eos, gen)
        else:
            for _ in range(max_new_tokens):
                ctx = (ids + new)[-window:]
                logits = engine.forward_logits(torch.tensor([ctx], dtype=torch.long))[0, -1].float()
                tok = _pick(logits, temperature, top_k, gen)
                new.append(tok)
                if eos is not None and tok == eos:
                    break
    return tokenizer.decode(ids + new if prompt and not answer_only else new, skip_special_tokens=True)


def _decoded(engine, ids, max_new_tokens, temperature, top_k, eos, gen) -> list:
    """The new tokens by the streamed decoder (greedy at temperature 0, else temperature and top-k)."""
    if temperature == 0:
        gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    else:
        gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                              top_k=top_k or 0, eos_token_id=eos, pad_token_id=0)
    return StreamedDecoder(engine).generate([ids], gc, generator=gen).completions[0]


def _pick(logits: torch.Tensor, temperature: float, top_k: Optional[int], gen) -> int:
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if top_k is not None and 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))

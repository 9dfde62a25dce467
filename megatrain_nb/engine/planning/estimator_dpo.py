"""What preference training (``mt.DPOTrainer``) adds to an estimate: the reference pass.

With no ``ref_model`` the reference is the policy as it starts, and its log-probs come from one
forward-only streamed pass over the pairs before the first step (``trainer/dpo_reference.py``):
no gradients, no optimizer states, the same layer streaming as training, so the tiers an
estimate plans are enough. What it adds is time (a forward pass of every pair, chosen and
rejected: about a third of an epoch's training compute, forward being about a third of
forward+backward) and a cache on disk: two float32 log-probs a pair plus a safetensors header,
in ``<output_dir>/reference_logps``, read back by a resume, a rewind, a fork and later runs.
``benchmarks/bench_dpo.py`` measures both.
"""
from __future__ import annotations

from typing import Optional

from megatrain_nb.formatting import fmt_bytes

#: the safetensors header naming the two tensors and the pass's seconds (measured: 208-232 bytes
#: from 1 to 100,000 pairs)
CACHE_HEADER_BYTES = 256
BYTES_PER_PAIR = 8   # the chosen and the rejected log-prob, float32


def format_bytes(n: Optional[float]) -> str:
    """Bytes as the estimate prints them: TiB to two decimals (a 100B model's tiers differ in the
    second digit), "unlimited" for no limit."""
    return fmt_bytes(n, none="unlimited", digits=2 if n is not None and n >= 1 << 40 else 1)


def reference_cache_bytes(pairs: int) -> int:
    """Bytes of one split's reference cache for ``pairs`` pairs (an upper bound within 64 bytes for up to 10**5 pairs)."""
    return CACHE_HEADER_BYTES + BYTES_PER_PAIR * int(pairs)


def reference_lines(pairs: int) -> list:
    """The lines an estimate prints for a DPO run over ``pairs`` pairs."""
    if not isinstance(pairs, int) or isinstance(pairs, bool) or pairs < 1:
        raise ValueError(f"pairs={pairs!r} must be a whole number >= 1 (the preference pairs of the training set)")
    return [f"DPO reference pass: one forward-only streamed pass over {pairs:,} pairs ({2 * pairs:,} sequences) "
            f"before the first step, no gradients nor optimizer states (the tiers above suffice): about "
            "a third of the time of one training epoch over them (forward only)",
            f"DPO reference cache: {format_bytes(reference_cache_bytes(pairs))} ({BYTES_PER_PAIR} bytes a pair) in "
            "<output_dir>/reference_logps, read back by resume, rewind, fork and later runs"]

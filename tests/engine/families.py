"""Test helpers over the tiny family configs (megatrain_nb/model_configs.py, the one registry):
a seeded two-layer model, packed rows with Hugging Face's loss and gradients on them, and the
largest relative gradient difference."""
from megatrain_nb.model_configs import FAMILIES, FAMILY_VOCAB as VOCAB, family_config  # noqa: F401


def packed_rows(model, rows, seq: int, seed: int = 3):
    """Packed rows for ``model``: documents of the given lengths per row (``rows``: one tuple of
    lengths per row, each summing to ``seq``), position ids restarting per document, labels with
    each document's first token ignored; and Hugging Face's loss and gradients on them.
    Returns (ids, position ids, labels, HF loss, {name: HF gradient})."""
    import copy

    import torch

    ids = torch.randint(1, VOCAB, (len(rows), seq), generator=torch.Generator().manual_seed(seed))
    pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    labels = ids.clone()
    labels[pos == 0] = -100
    ref = copy.deepcopy(model)
    out = ref(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
    out.loss.backward()
    return ids, pos, labels, float(out.loss.detach()), {n: p.grad for n, p in ref.named_parameters()}


def worst_rel(grads, ref) -> float:
    """The largest relative difference of a gradient in ``grads`` from ``ref``'s (same names)."""
    assert set(grads) == set(ref), set(grads) ^ set(ref)
    return max(float((grads[n] - ref[n]).norm() / (ref[n].norm() + 1e-12)) for n in ref)


def tiny_model(family: str, seq: int, **extra):
    """A two-layer model of ``family`` (one of FAMILIES, or qwen2_moe) for rows of up to ``seq``
    tokens, seeded, in eval mode; ``extra``: config fields to set."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = family_config(family, layers=2)
    cfg.max_position_embeddings = seq
    for k, v in extra.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()

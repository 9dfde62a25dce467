"""Tiny configs of the families the engine is tested against (no download)."""
from transformers import AutoConfig

VOCAB = 96


def family_config(family: str, *, layers: int = 3, tie: bool = False, hidden: int = 32):
    common = dict(vocab_size=VOCAB, num_hidden_layers=layers, tie_word_embeddings=tie, pad_token_id=0)
    llama_like = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    if family == "llama":
        return AutoConfig.for_model("llama", **common, **llama_like)
    if family == "qwen2":
        return AutoConfig.for_model("qwen2", **common, **llama_like)
    if family == "mistral":
        return AutoConfig.for_model("mistral", **common, **llama_like, sliding_window=5)
    if family == "phi3":
        return AutoConfig.for_model("phi3", **common, **llama_like, resid_pdrop=0.0, embd_pdrop=0.0,
                                    attention_dropout=0.0)
    if family == "mixtral":
        return AutoConfig.for_model("mixtral", **common, **llama_like, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=None)
    if family == "gemma2":
        return AutoConfig.for_model("gemma2", **common, **llama_like, head_dim=8, sliding_window=5,
                                    final_logit_softcapping=3.0, attn_logit_softcapping=5.0,
                                    query_pre_attn_scalar=8)
    if family == "gpt2":
        return AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=4,
                                    n_positions=64, tie_word_embeddings=tie, resid_pdrop=0.0, embd_pdrop=0.0,
                                    attn_pdrop=0.0)
    raise KeyError(family)


FAMILIES = ["llama", "qwen2", "mistral", "gpt2", "gemma2", "phi3", "mixtral"]


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
    """A two-layer model of ``family`` (or a small Qwen2-MoE with a shared expert) for rows of up to
    ``seq`` tokens, seeded, in eval mode; ``extra``: config fields to set."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if family == "qwen2_moe":
        cfg = AutoConfig.for_model("qwen2_moe", vocab_size=VOCAB, num_hidden_layers=2, hidden_size=32,
                                   intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                   num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                                   pad_token_id=0, tie_word_embeddings=False)
    else:
        cfg = family_config(family, layers=2)
    cfg.max_position_embeddings = seq
    for k, v in extra.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()

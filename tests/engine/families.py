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

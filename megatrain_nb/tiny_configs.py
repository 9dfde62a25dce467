"""Tiny configs for every causal-LM architecture transformers registers, from its own defaults.

One place for the shrinking rules: :func:`tiny_config` takes a model type's default config
and shrinks width, depth, heads, key/value heads, vocabulary, experts, intermediate sizes and
every per-layer list by the tables below; :data:`OVERRIDES` holds the few per-architecture
values no generic rule gets right (each with the constraint it satisfies).

Depth: a per-layer list (``layer_types``, ``layers_block_type``, ``mlp_layer_types``, ...) is cut
to one layer of each kind it names, in the order of their first occurrence (at least 2 layers,
at most 4), so a hybrid model keeps one layer of every kind.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

HIDDEN = 32
HEADS = 4
HEAD_DIM = HIDDEN // HEADS
KV_HEADS = 2
LAYERS = 2
MAX_LAYERS = 4
VOCAB = 128
INTERMEDIATE = 64
EXPERT_INTERMEDIATE = 32
EXPERTS = 4
TOP_K = 2
POSITIONS = 128
WINDOW = 4

WIDTH_KEYS = ("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "n_embed", "word_embed_proj_dim",
              "attention_hidden_size", "lru_width", "emb_dim", "embedding_dim", "embedding_size",
              "input_embedding_size", "output_embedding_size", "backbone_hidden_size", "hidden_dim",
              "hidden_size_global", "adapter_in_dim", "adapter_out_dim", "adapter_input_size")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
             "encoder_attention_heads", "attention_heads", "swa_num_attention_heads", "index_n_heads",
             "linear_num_value_heads", "linear_num_heads", "num_decoder_attention_heads",
             "num_encoder_attention_heads", "mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
KV_HEAD_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "swa_num_key_value_heads",
                "linear_num_key_heads", "multi_query_group_num", "num_query_groups")
HEAD_DIM_KEYS = ("head_dim", "swa_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim",
                 "kv_channels", "attention_head_dim", "d_head", "dim_head", "qk_rope_head_dim", "qk_nope_head_dim",
                 "v_head_dim", "index_head_dim", "attention_head_size", "d_rel")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
              "num_decoder_layers", "num_encoder_layers", "num_blocks")
INTERMEDIATE_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim",
                     "dense_intermediate_size", "intermediate_size_mlp", "feed_forward_size", "dim_ff", "d_inner",
                     "dff", "ffn_hidden_size", "shared_intermediate_size", "shared_expert_intermediate_size",
                     "moe_shared_expert_intermediate_size", "shared_experts_intermediate_size")
EXPERT_INTERMEDIATE_KEYS = ("moe_intermediate_size", "expert_ffn_hidden_size")
RANK_KEYS = {"kv_lora_rank": 16, "q_lora_rank": 16, "o_lora_rank": 16, "laurel_rank": 8, "adapter_rank": 8,
             "gated_norm_rank": 8, "loop_gate_rank": 8, "hc_lowrank": 4, "hidden_size_per_layer_input": 8,
             "ple_embed_dim": 8}
STATE_KEYS = ("state_size", "ssm_state_size", "mamba_d_state")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k")
ONE_KEYS = ("n_group", "num_expert_group", "topk_group", "mamba_n_groups", "n_groups", "mamba_ngroups",
            "first_k_dense_replace", "num_dense_layers", "num_nextn_predict_layers")
VOCAB_KEYS = ("vocab_size", "vocab_size_per_layer_input", "decoder_vocab_size", "encoder_hash_byte_group_vocab")
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions")
WINDOW_KEYS = ("sliding_window", "attention_window_size", "sliding_window_size", "local_attention_window_len",
               "window_size")
#: per-layer lists by name (any other list as long as the depth is cut the same way)
LAYER_LIST_KEYS = ("layer_types", "layers_block_type", "mlp_layer_types", "block_types", "attention_types",
                   "no_rope_layers", "intermediate_size", "activation_sparsity_pattern",
                   "num_attention_heads_per_layer", "indexer_types")

#: Per-architecture values the generic rules cannot guess (the constraint in the comment).
OVERRIDES: Dict[str, Dict[str, Any]] = {
    # mamba2: num_heads * head_dim == expand * hidden_size
    "mamba2": {"num_heads": 4, "head_dim": 16, "time_step_rank": 4},
    "mamba": {"time_step_rank": 4},
    # dots3_note: the sliding-window layers' head_dim == qk_nope_head_dim + qk_rope_head_dim
    "dots3_note_text": {"head_dim": 16},
    "dots3_note": {"head_dim": 16},
    # dory: n_input_layers + n_recurrent_layers + n_output_layers == num_hidden_layers
    # (its to_dict counts blocks: an attention and an mlp block per layer)
    "dory": {"num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 2,
             "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"]},
    # zamba: the shared transformer is tied across hybrid layers: two of them
    # (its attention runs on the hidden state beside the embeddings: twice the width)
    "zamba": {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_dt_rank": 4,
              "attention_hidden_size": 64, "attention_head_dim": 16,
              "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"]},
    # reformer: the axial position factors sum to the width, their shape multiplies to a sequence length
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [16, 16], "axial_pos_shape": [4, 2]},
    # deepseek_v2: the default leaves the router's top-k unset (None)
    "deepseek_v2": {"num_experts_per_tok": 2},
    "falcon_mamba": {"time_step_rank": 4},
    "jamba": {"mamba_dt_rank": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1, "use_mamba_kernels": False},
    # falcon_h1: mamba_n_heads * mamba_d_head == mamba_d_ssm
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_d_head": 16},
    "nemotron_h": {"mamba_head_dim": 16, "use_mamba_kernels": False},
    "bamba": {"mamba_d_head": 16},
    "granitemoehybrid": {"mamba_d_head": 16},
    # kolibri1_1 (transformers 5.25): the indexers are among the indexed-attention layers, each layer's
    # key/value source its own (sliding) or an earlier indexed one, head_dim a multiple of 16 (NVFP4
    # rounding of keys and values), index_num_heads at most the query heads per key head
    "kolibri1_1": {"num_hidden_layers": 4, "head_dim": 16, "index_num_heads": 1, "index_layers": [1],
                   "layer_types": ["sliding_attention", "indexed_attention", "sliding_attention", "indexed_attention"],
                   "kv_source_layers": [0, 1, 2, 1]},
    "zamba2": {"mamba_headdim": 16, "attention_hidden_size": 64, "attention_head_dim": 16,
               "hybrid_layer_ids": [1], "layers_block_type": ["mamba", "hybrid"], "num_hidden_layers": 2},
}


def _layer_count(d: Dict[str, Any]) -> Optional[int]:
    for k in LAYER_KEYS:
        v = d.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _pick_layers(d: Dict[str, Any], n: Optional[int]) -> List[int]:
    """The layer indices to keep: the first of each kind the per-layer lists name."""
    kinds: Dict[Any, int] = {}
    for k in LAYER_LIST_KEYS:
        v = d.get(k)
        if isinstance(v, list) and v and (n is None or len(v) == n):
            for i, x in enumerate(v):
                key = (k, repr(x))
                kinds.setdefault(key, i)
    picked = sorted(set(kinds.values()))[:MAX_LAYERS]
    i = 0
    while len(picked) < LAYERS:
        if i not in picked:
            picked.append(i)
        i += 1
    return sorted(picked)


def _is_index(x) -> bool:
    return (isinstance(x, int) and not isinstance(x, bool)) or (isinstance(x, str) and x.isdigit())


def _cut(v, keep: List[int]):
    return [v[i] for i in keep if i < len(v)]


def shrink(d: Dict[str, Any], model_type: str) -> Dict[str, Any]:
    """The tiny version of a config dict (``config.to_dict()``); returns a new dict."""
    d = dict(d)
    n = _layer_count(d)
    keep = _pick_layers(d, n)
    _cut_depth(d, n, keep)
    _shrink_sizes(d)
    if isinstance(d.get("num_kv_shared_layers"), int) and n is not None:   # all shared stays all shared
        d["num_kv_shared_layers"] = len(keep) if d["num_kv_shared_layers"] >= n else min(d["num_kv_shared_layers"], 1)
    _fit_token_ids(d)
    for k, v in list(d.items()):   # sub-configs (a text/vision/encoder config inside this one)
        if isinstance(v, dict) and any(x in v for x in LAYER_KEYS + WIDTH_KEYS):
            d[k] = shrink(v, model_type)
        elif isinstance(v, dict) and v and all(_is_index(x) for x in v):   # per-layer config keyed by index
            d[k] = {str(keep.index(int(x))) if isinstance(x, str) else keep.index(x):
                    shrink(y, model_type) if isinstance(y, dict) else y
                    for x, y in v.items() if int(x) in keep}
    d.update(OVERRIDES.get(model_type, {}))
    for k in ("use_cache",):
        if k in d:
            d[k] = False
    return d


def _cut_depth(d: Dict[str, Any], n: Optional[int], keep: List[int]) -> None:
    """Depth: every layer count and per-layer list cut to the layers ``keep`` (in place)."""
    for k in LAYER_KEYS:
        if isinstance(d.get(k), int) and not isinstance(d.get(k), bool) and d[k] > 0:
            d[k] = len(keep)
    for k, v in list(d.items()):
        if isinstance(v, list) and v and n is not None and len(v) == n and k not in ("time_step_limit",):
            d[k] = _cut(v, keep)
    if n is None:   # depth given only by a list (e.g. layers_block_type)
        for k in LAYER_LIST_KEYS:
            if isinstance(d.get(k), list) and len(d[k]) > 0:
                d[k] = _cut(d[k], keep)
    for k in ("mlp_only_layers", "moe_layers", "full_attn_idxs", "hybrid_layer_ids", "ple_layer_ids"):
        if isinstance(d.get(k), list):
            d[k] = [keep.index(i) for i in d[k] if i in keep]


def _shrink_sizes(d: Dict[str, Any]) -> None:
    """Width, heads, sizes, experts, vocabulary, positions and windows by the tables (in place)."""
    def setint(keys, value, only_if_larger=True):
        for k in keys:
            v = d.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and (not only_if_larger or v > value):
                d[k] = value

    setint(WIDTH_KEYS, HIDDEN)
    heads = next((d[k] for k in HEAD_KEYS if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)
    for k in KV_HEAD_KEYS:   # as many key/value heads as heads (MHA, MLA) stays so; one stays one
        v = d.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            d[k] = 1 if v == 1 else HEADS if v == heads else KV_HEADS
    setint(HEAD_KEYS, HEADS)
    setint(HEAD_DIM_KEYS, HEAD_DIM)
    if isinstance(d.get("qk_head_dim"), int):
        d["qk_head_dim"] = d.get("qk_rope_head_dim", HEAD_DIM) + d.get("qk_nope_head_dim", HEAD_DIM)
    if isinstance(d.get("swa_head_dim"), int) and isinstance(d.get("qk_nope_head_dim"), int):
        d["swa_head_dim"] = d["qk_nope_head_dim"] + d.get("qk_rope_head_dim", 0)
    setint(("rotary_dim",), HEAD_DIM)
    for k in INTERMEDIATE_KEYS:
        v = d.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > INTERMEDIATE:
            d[k] = INTERMEDIATE
        elif isinstance(v, list) and v and all(isinstance(x, int) for x in v):
            d[k] = [min(x, INTERMEDIATE) for x in v]
    setint(EXPERT_INTERMEDIATE_KEYS, EXPERT_INTERMEDIATE)
    for k, r in RANK_KEYS.items():
        setint((k,), r)
    setint(STATE_KEYS, 8)
    setint(EXPERT_KEYS, EXPERTS)
    setint(TOP_K_KEYS, TOP_K)
    setint(ONE_KEYS, 1)
    setint(VOCAB_KEYS, VOCAB)
    setint(POSITION_KEYS, POSITIONS)
    setint(("original_max_position_embeddings",), POSITIONS // 2)
    setint(WINDOW_KEYS, WINDOW)
    if isinstance(d.get("time_step_rank"), int):
        d["time_step_rank"] = 4
    if isinstance(d.get("mamba_dt_rank"), int):
        d["mamba_dt_rank"] = 4


def _fit_token_ids(d: Dict[str, Any]) -> None:
    """Special token ids inside the (tiny) vocabulary; the sweep's inputs avoid 0..3 and the top."""
    top = VOCAB - 1
    for k, v in sorted(d.items()):
        if (k.endswith("_token_id") or k.endswith("_token_index") or k in ("mask_index", "unk_index")) \
                and isinstance(v, int) and not isinstance(v, bool) and v >= VOCAB:
            d[k] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.get(k, top)
            if k not in ("pad_token_id", "bos_token_id", "eos_token_id"):
                top -= 1
        elif k.endswith("_token_id") and isinstance(v, list):
            d[k] = [x if x < VOCAB else 2 for x in v]


def tiny_config(model_type: str):
    """The tiny config of ``model_type`` (a key of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    d = shrink(default.to_dict(), model_type)
    for k in ("transformers_version", "architectures", "_name_or_path", "model_type"):
        d.pop(k, None)
    return type(default).from_dict(d)

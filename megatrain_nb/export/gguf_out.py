"""``format="gguf"``: one GGUF file with llama.cpp's tensor names and metadata, written with the
``gguf`` package's writer, ``dtype`` f32 | f16 | bf16 | q8_0.

What a file transformers' GGUF loader (and llama.cpp) reads back correctly needs, each done here:
llama.cpp's q/k row permutation for the ``llama`` architecture (``n_head`` for q, ``n_head_kv``
for k; transformers undoes it for ``llama`` only, when ``head_count_kv`` is written); tied
embeddings said by the absence of ``output.weight``; ``rope.dimension_count`` = the head
dimension; rope scaling refused (transformers does not read it back); 1-D tensors (norms,
biases) and MoE routers kept F32; q8_0 only for rows divisible by 32 (others F16, as llama.cpp
does); Gemma's norms stored as ``1 + w``; ``general.file_type`` set; the tokenizer's metadata
(:mod:`.gguf_vocab`).

The tensor infos are laid out from the source's entries first, then the data is written in that
order as the source yields it, unit by unit (``GGUFWriter.write_tensor_data``).
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from megatrain_nb.atomic import temp_name

from .gguf_vocab import VocabUnsupported, add_vocab, vocab_fields
from .source import WeightSource

DTYPES = ("f32", "f16", "bf16", "q8_0")


@dataclass(frozen=True)
class Arch:
    """How one transformers ``model_type`` is written: llama.cpp's architecture name, whether q/k
    are permuted, whether norms are stored as ``1 + w``, which config fields become which keys."""

    name: str
    permute_qk: bool = False
    norm_plus_one: bool = False
    key_length: bool = False     # attention.key_length / value_length = head_dim
    moe: bool = False


#: the architectures the writer knows (transformers' GGUF loader reads every one of them back)
ARCHS: Dict[str, Arch] = {
    "llama": Arch("llama", permute_qk=True),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3", key_length=True),
    "qwen2_moe": Arch("qwen2moe", moe=True),
    "qwen3_moe": Arch("qwen3moe", key_length=True, moe=True),
    "gemma2": Arch("gemma2", norm_plus_one=True, key_length=True),
}


def check_arch(config) -> Arch:
    """The :class:`Arch` of ``config``, or ValueError naming the model type and what works."""
    mt = getattr(config, "model_type", None)
    if mt not in ARCHS:
        raise ValueError(f"format='gguf' does not know the architecture {mt!r} (it writes "
                         f"{', '.join(sorted(ARCHS))}); export it with format='safetensors' and convert that "
                         "folder with llama.cpp's convert_hf_to_gguf.py")
    rope = _rope(config)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise ValueError(f"format='gguf': the model uses rope scaling {kind!r}, which transformers' GGUF loader does "
                         "not read back; export with format='safetensors'")
    return ARCHS[mt]


def _rope(config) -> dict:
    for key in ("rope_parameters", "rope_scaling"):
        value = getattr(config, key, None)
        if isinstance(value, dict):
            return value
    return {}


def _theta(config) -> float:
    return float(_rope(config).get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


def _head_dim(config) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _qtype(dtype: str, shape, name: str):
    from gguf import GGMLQuantizationType as Q

    if len(shape) < 2 or "ffn_gate_inp" in name:
        return Q.F32
    if dtype == "q8_0":
        return Q.Q8_0 if shape[-1] % 32 == 0 else Q.F16
    return {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16}[dtype]


def _file_type(dtype: str) -> int:
    from gguf import LlamaFileType as F

    return {"f32": F.ALL_F32, "f16": F.MOSTLY_F16, "bf16": F.MOSTLY_BF16, "q8_0": F.MOSTLY_Q8_0}[dtype]


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf ``permute`` (rows of each head: halves interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj$")


class TensorPlan:
    """HF entries -> GGUF tensors: ``infos`` [(gguf name, shape, qtype)] in write order, and
    ``convert(name, tensor)`` -> [(gguf name, fp32 array)] for one HF tensor."""

    def __init__(self, config, arch: Arch, dtype: str, entries, tied: bool):
        import gguf

        self.config, self.arch, self.dtype = config, arch, dtype
        self.names = gguf.get_tensor_name_map(self._model_arch(gguf), config.num_hidden_layers)
        self.infos: List[Tuple[str, tuple, object]] = []
        self.by_hf: Dict[str, List[Tuple[str, tuple]]] = {}
        for name, shape, _ in entries:
            if tied and name == "lm_head.weight":
                continue   # tying is said by the absence of output.weight
            outs = self._targets(name, tuple(shape))
            self.by_hf[name] = outs
            self.infos += [(g, s, _qtype(dtype, s, g)) for g, s in outs]

    def _model_arch(self, gguf):
        for key, value in gguf.MODEL_ARCH_NAMES.items():
            if value == self.arch.name:
                return key
        raise ValueError(f"the installed gguf package does not know {self.arch.name!r}; pip install -U gguf")

    def _targets(self, name: str, shape) -> List[Tuple[str, tuple]]:
        m = _EXPERTS.match(name)
        if m:
            e, two_i, h = shape
            return [(f"blk.{m.group(1)}.ffn_gate_exps.weight", (e, two_i // 2, h)),
                    (f"blk.{m.group(1)}.ffn_up_exps.weight", (e, two_i // 2, h))]
        base, suffix = (name.rsplit(".", 1) + [""])[:2] if name.endswith((".weight", ".bias")) else (name, "weight")
        g = self.names.get_name(base)
        if g is None:
            raise ValueError(f"format='gguf': no llama.cpp name for the {self.config.model_type} tensor {name!r}; "
                             "export with format='safetensors'")
        if g.endswith("ffn_gate_inp_shexp"):
            shape = (shape[-1],)   # llama.cpp stores the shared expert's gate as a vector
        return [(f"{g}.{suffix}", shape)]

    def convert(self, name: str, t: torch.Tensor) -> List[Tuple[str, np.ndarray]]:
        t = t.detach().to(torch.float32)
        outs = self.by_hf.get(name)
        if outs is None:
            return []
        if len(outs) == 2:   # fused experts: gate rows first, then up (transformers' order)
            half = t.shape[1] // 2
            return [(outs[0][0], t[:, :half].contiguous().numpy()), (outs[1][0], t[:, half:].contiguous().numpy())]
        g, shape = outs[0]
        cfg = self.config
        if self.arch.permute_qk and re.search(r"\.self_attn\.q_proj\.(weight|bias)$", name):
            t = _permute(t, cfg.num_attention_heads)
        elif self.arch.permute_qk and re.search(r"\.self_attn\.k_proj\.(weight|bias)$", name):
            t = _permute(t, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        if self.arch.norm_plus_one and name.endswith("norm.weight"):
            t = t + 1.0
        return [(g, t.reshape(shape).contiguous().numpy())]


def _encode(arr: np.ndarray, qtype) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    if qtype == Q.F32:
        return arr.astype(np.float32, copy=False)
    if qtype == Q.F16:
        return arr.astype(np.float16)
    return quants.quantize(arr, qtype)


def _nbytes(shape, qtype) -> int:
    from gguf import quants

    return int(np.prod(quants.quant_shape_to_byte_shape(shape, qtype)))


def add_metadata(writer, config, arch: Arch, dtype: str, name: str) -> None:
    """The architecture's keys, llama.cpp's spelling, from the transformers config."""
    from gguf import GGML_QUANT_VERSION

    cfg = config
    writer.add_name(name)
    writer.add_file_type(int(_file_type(dtype)))
    writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.add_context_length(int(cfg.max_position_embeddings))
    writer.add_embedding_length(int(cfg.hidden_size))
    writer.add_block_count(int(cfg.num_hidden_layers))
    writer.add_feed_forward_length(int(getattr(cfg, "intermediate_size", 0) or 0))
    writer.add_head_count(int(cfg.num_attention_heads))
    writer.add_head_count_kv(int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_rope_freq_base(_theta(cfg))
    writer.add_rope_dimension_count(_head_dim(cfg))
    writer.add_vocab_size(int(cfg.vocab_size))
    if arch.key_length:
        writer.add_key_length(_head_dim(cfg))
        writer.add_value_length(_head_dim(cfg))
    if arch.moe:
        writer.add_expert_count(int(cfg.num_experts))
        writer.add_expert_used_count(int(cfg.num_experts_per_tok))
        writer.add_expert_feed_forward_length(int(cfg.moe_intermediate_size))
        if getattr(cfg, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(int(cfg.shared_expert_intermediate_size))
    if arch.name == "gemma2":
        writer.add_attn_logit_softcapping(float(cfg.attn_logit_softcapping or 0.0))
        writer.add_final_logit_softcapping(float(cfg.final_logit_softcapping or 0.0))
        if cfg.sliding_window:
            writer.add_sliding_window(int(cfg.sliding_window))
    _warn_unread(cfg, arch)


def _warn_unread(cfg, arch: Arch) -> None:
    """Fields llama.cpp reads but transformers' GGUF loader does not: a value away from the
    config class's default comes back as the default there."""
    fields = {"qwen2moe": ("moe_intermediate_size", "shared_expert_intermediate_size"),
              "qwen3moe": ("moe_intermediate_size",),
              "gemma2": ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")}
    default = type(cfg)()
    odd = [f for f in fields.get(arch.name, ()) if getattr(cfg, f, None) != getattr(default, f, None)]
    if odd:
        warnings.warn(f"GGUF export: {', '.join(odd)} differ from {type(cfg).__name__}'s defaults; llama.cpp reads "
                      "them from the file, transformers' GGUF loader does not (load it there with config=...)",
                      stacklevel=3)


def write_gguf(src: WeightSource, path, *, dtype: str = "f16", tokenizer: bool = True,
               progress: Optional[Callable[[int], None]] = None) -> str:
    """Write ``src`` as one GGUF file at ``path`` (a temporary name renamed into place).
    ``tokenizer=False`` writes none (llama.cpp needs one to run the file)."""
    from gguf import GGUFWriter

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: a GGUF export is one of {', '.join(DTYPES)}")
    arch = check_arch(src.config)
    plan = TensorPlan(src.config, arch, dtype, src.entries, src.tied)
    fields = None
    if tokenizer and src.tokenizer is not None:
        try:
            fields = vocab_fields(src.tokenizer, int(src.config.vocab_size))
        except VocabUnsupported as e:
            warnings.warn(f"GGUF export without tokenizer metadata: {e}", stacklevel=2)
    elif tokenizer:
        warnings.warn("GGUF export without tokenizer metadata: no tokenizer is known (pass one to the "
                      "Trainer); llama.cpp needs one to run the file", stacklevel=2)
    path = os.fspath(path)
    tmp = temp_name(path)
    writer = GGUFWriter(tmp, arch.name)
    try:
        add_metadata(writer, src.config, arch, dtype, src.extra.get("name") or src.model_class)
        if fields:
            add_vocab(writer, fields)
        for g, shape, qtype in plan.infos:
            writer.add_tensor_info(g, _byte_shape(shape, qtype), np.dtype(np.uint8) if _raw(qtype) else
                                   (np.dtype(np.float16) if _is_f16(qtype) else np.dtype(np.float32)),
                                   _nbytes(shape, qtype), raw_dtype=qtype if _raw(qtype) else None)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        qtypes = {g: q for g, _, q in plan.infos}
        order = iter(plan.infos)
        for name, t in src.tensors():
            for g, arr in plan.convert(name, t):
                want = next(order)[0]
                if g != want:
                    raise RuntimeError(f"GGUF export: {g} came where {want} was laid out")
                writer.write_tensor_data(_encode(arr, qtypes[g]))
                if progress is not None:
                    progress(arr.nbytes)
            del t
        writer.flush()
        os.fsync(writer.fout[0].fileno())
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _raw(qtype) -> bool:
    from gguf import GGMLQuantizationType as Q

    return qtype not in (Q.F32, Q.F16)


def _is_f16(qtype) -> bool:
    from gguf import GGMLQuantizationType as Q

    return qtype == Q.F16


def _byte_shape(shape, qtype):
    from gguf import quants

    return quants.quant_shape_to_byte_shape(shape, qtype) if _raw(qtype) else shape

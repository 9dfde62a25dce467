"""Exports of trained tiny models of four architectures, read back by the references:
safetensors by ``from_pretrained`` (exact), GGUF by transformers' GGUF loader (f32 within 1e-4,
f16 within 2e-2 of the trained model's logits) and by the ``gguf`` package's reader (llama.cpp's
keys, the tokenizer's metadata), DCP by ``torch.distributed.checkpoint.load`` (equal weights)."""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("gguf")

from gguf import GGUFReader  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import megatrain_nb as mt  # noqa: E402
from megatrain_nb.export import read_dcp  # noqa: E402

from . import helpers as h  # noqa: E402

pytestmark = pytest.mark.slow   # a trained model per architecture: seconds each
KINDS = ["llama", "qwen2", "gemma2", "qwen3_moe"]


@pytest.fixture(scope="module", params=KINDS)
def run(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    trainer = h.trained(request.param, tmp)
    ids = h.batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = {"kind": request.param, "tmp": tmp, "trainer": trainer, "ids": ids,
               "logits": trainer.engine.forward_logits(ids), "state": dict(trainer.engine.state_dict())}
        out["st"] = mt.export(trainer, tmp / "st")
        out["f32"] = mt.export(trainer, tmp / "m-f32.gguf", format="gguf", dtype="f32")
        out["f16"] = mt.export(trainer, tmp / "m-f16.gguf", format="gguf", dtype="f16")
        out["dcp"] = mt.export(trainer, tmp / "dcp", format="dcp")
    yield out
    trainer.close()


def _field(reader, key):
    f = reader.fields[key]
    return f.contents()


def test_safetensors_is_exact(run):
    m = AutoModelForCausalLM.from_pretrained(run["st"], dtype=torch.float32)
    for name, t in run["state"].items():
        assert torch.equal(m.state_dict()[name], t), name
    with torch.no_grad():
        assert torch.equal(m(run["ids"]).logits, run["logits"])
    assert (m.config.tie_word_embeddings is True) == (run["kind"] == "gemma2")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run["st"])
    assert tok.chat_template == h.CHAT_TEMPLATE and tok.encode("the fox") == h.tokenizer().encode("the fox")


@pytest.mark.parametrize("dtype,tol", [("f32", 1e-4), ("f16", 2e-2)])
def test_gguf_read_back_by_transformers(run, dtype, tol):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = AutoModelForCausalLM.from_pretrained(str(run["tmp"]), gguf_file=f"m-{dtype}.gguf", dtype=torch.float32)
        with torch.no_grad():
            err = h.max_rel_err(m(run["ids"]).logits, run["logits"])
    assert err <= tol, err
    assert err > 0 or dtype == "f32"


def test_gguf_read_by_the_gguf_reader(run):
    r = GGUFReader(run["f16"])
    arch = {"llama": "llama", "qwen2": "qwen2", "gemma2": "gemma2", "qwen3_moe": "qwen3moe"}[run["kind"]]
    assert _field(r, "general.architecture") == arch
    assert _field(r, "general.file_type") == 1   # MOSTLY_F16
    cfg = run["trainer"].engine.model_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert _field(r, f"{arch}.rope.dimension_count") == head_dim
    assert _field(r, f"{arch}.attention.head_count_kv") == 2
    names = {t.name: t for t in r.tensors}
    assert ("output.weight" in names) == (run["kind"] != "gemma2")   # tying: said by its absence
    assert names["output_norm.weight"].tensor_type.name == "F32"   # 1-D kept F32
    assert names["blk.0.attn_q.weight"].tensor_type.name == "F16"
    tok = h.tokenizer()
    tokens = _field(r, "tokenizer.ggml.tokens")
    assert _field(r, "tokenizer.ggml.model") == "gpt2" and len(tokens) == h.VOCAB
    assert tokens[:len(tok)] == [tok.convert_ids_to_tokens(i) for i in range(len(tok))]
    types = _field(r, "tokenizer.ggml.token_type")
    assert types[tok.convert_tokens_to_ids("<|user|>")] == 3 and types[len(tok)] == 5
    assert _field(r, "tokenizer.ggml.eos_token_id") == tok.eos_token_id
    assert _field(r, "tokenizer.chat_template") == h.CHAT_TEMPLATE
    merges = _field(r, "tokenizer.ggml.merges")
    assert merges and all(len(m.split(" ")) == 2 for m in merges)


def test_gguf_tokenizer_read_back_by_transformers(run):
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = AutoTokenizer.from_pretrained(str(run["tmp"]), gguf_file="m-f16.gguf")
    ref = h.tokenizer()
    text = "the quick brown fox: what is the capital of france?"
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert tok.chat_template == h.CHAT_TEMPLATE


def test_dcp_holds_equal_weights(run):
    import torch.distributed.checkpoint as dcp

    m = AutoModelForCausalLM.from_config(h.config(run["kind"]), dtype=torch.float32)
    state = m.state_dict()
    assert "lm_head.weight" in state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=run["dcp"])   # a tied model's alias is in the checkpoint too
    for name, t in run["state"].items():
        assert torch.equal(state[name], t), name
    m2 = AutoModelForCausalLM.from_config(h.config(run["kind"]), dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        read_dcp(run["dcp"], m2)
    with torch.no_grad():
        assert torch.equal(m2(run["ids"]).logits, run["logits"])

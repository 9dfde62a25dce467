"""The built-in default: stdlib corpus, cached byte-level BPE, presets."""
import pytest
import torch

from megatrain_nb.trainer import default as builtin
from megatrain_nb.model_configs import PRESETS, preset_config


def test_corpus_is_deterministic_and_from_the_stdlib():
    a, b = builtin.stdlib_files(200_000), builtin.stdlib_files(200_000)
    assert a == b and a and all(p.suffix == ".py" for p in a)
    assert not any("site-packages" in p.parts or "test" in p.parts for p in a)


def test_load_default_trains_once_then_uses_the_cache(small_cache, monkeypatch):
    tok, train, evals = builtin.load_default(seq_len=32, vocab_size=512, max_bytes=150_000, eval_every=5)
    assert len(tok) == 512 and tok.eos_token == builtin.EOS and tok.pad_token == builtin.PAD
    assert len(train) > 10 and len(evals) >= 1
    assert {len(r) for r in train["input_ids"]} == {32}
    assert max(max(r) for r in train["input_ids"]) < 512
    assert tok.decode(tok("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"
    assert len(list(small_cache.iterdir())) == 1

    def no_training(*a, **k):
        raise AssertionError("the cached tokenizer should have been reused")
    monkeypatch.setattr(builtin, "train_tokenizer", no_training)
    tok2, train2, _ = builtin.load_default(seq_len=32, vocab_size=512, max_bytes=150_000, eval_every=5)
    assert train2["input_ids"] == train["input_ids"] and tok2.get_vocab() == tok.get_vocab()


def test_too_short_seq_len_is_refused(small_cache):
    with pytest.raises(ValueError, match="seq_len"):
        builtin.load_default(seq_len=1)


@pytest.mark.parametrize("name,low,high", [("tiny", 1e6, 5e6), ("llama-7b", 6.5e9, 7e9), ("llama-100b", 99e9, 101e9)])
def test_presets_have_the_advertised_size(name, low, high):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(name))
    assert low < sum(p.numel() for p in model.parameters()) < high


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match="llama-100b"):
        preset_config("huge")
    assert preset_config("tiny", vocab_size=300).vocab_size == 300
    assert "llama-100b" in PRESETS

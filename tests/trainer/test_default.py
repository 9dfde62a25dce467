"""The built-in default: stdlib corpus, cached byte-level BPE, presets."""
import pytest
import torch

from megatrain_nb.trainer import default as builtin
from megatrain_nb.model_configs import PRESETS, preset_config


def test_corpus_is_deterministic_and_from_the_stdlib():
    a, b = builtin.stdlib_files(200_000), builtin.stdlib_files(200_000)
    assert a == b and a and all(p.suffix == ".py" for p in a)
    assert not any("site-packages" in p.parts or "test" in p.parts for p in a)


def test_the_pruned_walk_finds_what_rglob_and_the_skip_rule_find(tmp_path):
    """stdlib_files prunes skipped folders as it walks; the files are the ones the rule names:
    every ``*.py`` file under the root, none with a skipped folder in its path, symlinked folders
    not followed, in sorted order (a global site-packages inside the stdlib's folder is not walked)."""
    import os

    root = tmp_path / "lib"
    for rel in ["a.py", "b.txt", "pkg/c.py", "pkg/tests/t.py", "site-packages/x/y.py", "pkg/sub/d.py",
                "encodings/e.py", "pkg/test_like.py", "z/__pycache__/q.py", "dir.py/inner.py"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    os.symlink(root / "pkg", root / "linked")          # a symlinked folder: not followed
    os.symlink(root / "a.py", root / "alias.py")       # a symlinked file: a file
    os.symlink(root / "gone.py", root / "broken.py")   # a broken link: not a file
    want = sorted(p for p in root.rglob("*.py")
                  if not builtin._SKIP_PARTS.intersection(p.relative_to(root).parts) and p.is_file())
    got = builtin.stdlib_files(10**9, root=root)
    assert got == want
    assert [p.relative_to(root).as_posix() for p in got] == [
        "a.py", "alias.py", "dir.py/inner.py", "pkg/c.py", "pkg/sub/d.py", "pkg/test_like.py"]
    assert builtin.stdlib_files(1, root=root) == got[:1]   # the byte cap: at least one file


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

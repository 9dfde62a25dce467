"""Hub ids ("org/name") resolved through huggingface_hub, offline, from a cache laid out as
huggingface_hub lays it out: models--org--name/{blobs/<sha256>, refs/<branch>, snapshots/<commit>/<file> -> blob}."""
import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.hub import ALLOW_PATTERNS, ModelNotFoundError, is_hub_id, resolve_model
from tests.trainer.helpers import args, micro_model, token_dataset

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def _add_snapshot(cache: Path, repo: str, commit: str, folder: Path, refs=("main",)) -> Path:
    """Put ``folder``'s files into the cache as snapshot ``commit`` of ``repo`` (blobs + symlinks)."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    for f in sorted(folder.rglob("*")):
        if not f.is_file():
            continue
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / f.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)  # huggingface_hub writes no newline
    return snap


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{chr(97 + i): i + 1 for i in range(26)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>", eos_token="<unk>")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """HF_HOME with org/micro (main = commit A, tag v2 = commit B, different weights) and a
    .bin-only org/old; HF_HUB_OFFLINE=1 so nothing can be downloaded."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = home / "hub"
    for commit, seed, refs in ((COMMIT_A, 0, ("main",)), (COMMIT_B, 1, ("v2",))):
        src = tmp_path / f"src-{seed}"
        micro_model(seed=seed).save_pretrained(src)
        _tokenizer().save_pretrained(src)
        _add_snapshot(cache, "org/micro", commit, src, refs)
    old = tmp_path / "old"
    m = micro_model()  # transformers 5 writes safetensors only: write the legacy .bin layout by hand
    m.config.save_pretrained(old)
    torch.save(m.state_dict(), old / "pytorch_model.bin")
    assert not list(old.glob("*.safetensors")) and list(old.glob("*.bin"))
    _add_snapshot(cache, "org/old", COMMIT_A, old)
    return cache


def test_allow_patterns_fetch_config_tokenizer_and_safetensors_only():
    from huggingface_hub.utils import filter_repo_objects

    repo = ["config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
            "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "pytorch_model.bin", "pytorch_model.bin.index.json", "onnx/model.onnx", "README.md", "tf_model.h5",
            "original/consolidated.00.pth", "flax_model.msgpack"]
    got = set(filter_repo_objects(repo, allow_patterns=ALLOW_PATTERNS))
    assert got == {"config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
                   "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json"}


def test_hub_id_spelling():
    assert is_hub_id("Qwen/Qwen2.5-0.5B") and is_hub_id("gpt2") and is_hub_id("org/my_model.v1")
    for bad in ("/abs/path", "./rel", "a/b/c", "../x", "org/..", "~/m", "org/name/", ""):
        assert not is_hub_id(bad), bad


def test_resolves_from_the_hf_home_cache_with_revision(hub):
    assert resolve_model("org/micro") == str(hub / "models--org--micro" / "snapshots" / COMMIT_A)
    assert resolve_model("org/micro", revision="v2").endswith(COMMIT_B)
    assert resolve_model("org/micro", revision=COMMIT_B).endswith(COMMIT_B)
    local = hub.parent.parent / "src-0"
    assert resolve_model(local) == str(local)  # a local folder is used as it is


def test_not_cached_offline_names_the_model_and_the_cache(hub):
    with pytest.raises(ModelNotFoundError, match=r"'org/absent'.*not in the Hugging Face cache.*HF_HUB_OFFLINE") as e:
        resolve_model("org/absent")
    assert str(hub) in str(e.value)
    with pytest.raises(ModelNotFoundError, match="nor a Hugging Face Hub id"):
        resolve_model("/no/such/folder")


def test_bin_only_weights_are_refused_clearly(hub):
    with pytest.raises(ValueError, match=r"'org/old'.*only in pytorch_model\.bin.*safetensors"):
        resolve_model("org/old")


def test_engine_from_pretrained_streams_a_hub_id_like_the_folder(hub):
    from megatrain_nb.engine import EngineConfig, StreamingEngine

    ref = AutoModelForCausalLM.from_pretrained(str(hub / "models--org--micro" / "snapshots" / COMMIT_B)).eval()
    engine = StreamingEngine.from_pretrained("org/micro", EngineConfig(device="cpu"), revision="v2")
    try:
        ids = torch.randint(1, 27, (2, 8), generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(engine.forward_logits(ids), ref(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    finally:
        engine.close()


def test_trainer_and_session_take_a_hub_id(hub, tmp_path):
    import megatrain_nb as mt

    tr = mt.Trainer(model="org/micro", train_dataset=token_dataset(8, seq=8), args=args(tmp_path / "o", max_steps=2),
                    device="cpu")
    try:
        assert tr.tokenizer is not None and tr.tokenizer("abc")["input_ids"] == [1, 2, 3]  # the repo's own
        assert tr.train().global_step == 2
    finally:
        tr.close()
    s = mt.Session("org/micro", train_dataset=token_dataset(8, seq=8), args=args(tmp_path / "s", max_steps=1),
                   device="cpu", revision="v2")
    try:
        ref = AutoModelForCausalLM.from_pretrained(str(hub / "models--org--micro" / "snapshots" / COMMIT_B))
        got = dict(s.trainer.engine.named_parameters())
        name = "model.layers.0.mlp.up_proj.weight"
        torch.testing.assert_close(got[name], dict(ref.named_parameters())[name])
    finally:
        s.close()
    with pytest.raises(ValueError, match="revision='v2' applies to a model given by name"):
        mt.Trainer(model=micro_model(), args=args(tmp_path / "r"), device="cpu", revision="v2")
    with pytest.raises(ModelNotFoundError, match="or a preset: .*tiny"):
        mt.Session("org/absent", train_dataset=token_dataset(4, seq=8), device="cpu")


def test_nothing_was_written_outside_the_cache(hub):
    before = sorted(p for p in hub.rglob("*"))
    resolve_model("org/micro")
    assert sorted(p for p in hub.rglob("*")) == before
    shutil.rmtree(hub / "models--org--micro" / "snapshots" / COMMIT_A)
    with pytest.raises(ModelNotFoundError):
        resolve_model("org/micro")

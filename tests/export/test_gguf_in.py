"""A GGUF as the model: resolved without loading weights (config, estimate), converted once
through transformers' GGUF loader into a plain fp32 model, trained one step with the loss
transformers gives on the same batch; the CLI's export of folders, runs and GGUF files; and the
writer's refusals (an architecture it does not know, by name)."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import megatrain_nb as mt  # noqa: E402
from megatrain_nb.cli import main as cli_main  # noqa: E402
from megatrain_nb.cli.config import model_source  # noqa: E402
from megatrain_nb.export.gguf_out import check_arch  # noqa: E402
from megatrain_nb.gguf_in import ORIGIN_FILE, load_plain  # noqa: E402
from megatrain_nb.model_source import resolve  # noqa: E402

from . import helpers as h  # noqa: E402


@pytest.fixture()
def gguf_file(tmp_path, monkeypatch):
    """(a q8_0 GGUF of a tiny llama with the tiny tokenizer, its folder) and a private cache."""
    monkeypatch.setenv("MEGATRAIN_NB_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "src"
    h.model("llama", seed=3).save_pretrained(folder)
    h.tokenizer().save_pretrained(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = mt.export(str(folder), tmp_path / "tiny-q8.gguf", format="gguf", dtype="q8_0")
    return path, folder


def test_an_unknown_architecture_is_refused_by_name():
    cfg = h.config("llama")
    cfg.model_type = "phi3"
    with pytest.raises(ValueError, match="architecture 'phi3'.*format='safetensors'"):
        check_arch(cfg)
    llama = h.config("llama")
    llama.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope scaling 'linear'"):
        check_arch(llama)


@pytest.mark.slow
def test_a_gguf_resolves_without_loading_and_says_its_quantization(gguf_file, tmp_path):
    path, _ = gguf_file
    src = resolve(path)
    assert src.kind == "gguf"
    assert "dequantized from Q8_0" in src.describe() and "F32" in src.describe()   # norms stay F32
    assert src.config().num_hidden_layers == 2 and src.config().model_type == "llama"
    est = mt.estimate(path, vram_gb=1, ram_gb=4, disk_gb=10, seq=64, device="cpu")
    assert est is not None
    assert not (tmp_path / "cache").exists()   # nothing converted for a config or an estimate
    folder = src.need_folder()
    assert os.path.isfile(os.path.join(folder, ORIGIN_FILE)) and src.need_folder() == folder   # once
    got, text = model_source({"model": os.path.basename(path)}, Path(path).parent)   # run.yaml's model:
    assert got == folder and "dequantized from Q8_0" in text


@pytest.mark.slow
def test_a_gguf_model_trained_one_step_matches_transformers(gguf_file, tmp_path):
    path, _ = gguf_file
    rows = h.rows(n=2, seq=20)
    ids = torch.tensor([r["input_ids"] for r in rows])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                   dtype=torch.float32)
        with torch.no_grad():
            want = float(ref(ids, labels=ids).loss)
        plain, tok = load_plain(path)   # the same weights as a plain, trainable model
    assert tok is not None and tok.chat_template == h.CHAT_TEMPLATE
    trainer = mt.Trainer(model=path, train_dataset=Dataset.from_list(rows),
                         args=h.args(tmp_path / "run", max_steps=1, learning_rate=1e-2))
    try:
        assert trainer.tokenizer is not None and trainer.tokenizer.chat_template == h.CHAT_TEMPLATE
        out = trainer.train()
        assert abs(out.training_loss - want) < 1e-5, (out.training_loss, want)
        # one AdamW step of transformers' model (clipped at 1.0 as TrainingArguments' default)
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
        plain(ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            after = float(plain(ids, labels=ids).loss)
        got = float(trainer.engine.evaluate(ids).loss)
        assert abs(got - after) < 1e-5, (got, after)
    finally:
        trainer.close()


@pytest.mark.slow
def test_the_cli_exports_a_folder_a_run_and_a_gguf(gguf_file, tmp_path, capsys):
    path, folder = gguf_file
    dest = tmp_path / "out.gguf"
    assert cli_main(["export", str(folder), str(dest), "--format", "gguf", "--dtype", "f16"]) == 0
    assert "exported" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="out.gguf", dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = h.batch()
    with torch.no_grad():
        assert h.max_rel_err(m(ids).logits, ref(ids).logits) <= 2e-2
    # a .gguf to a Hugging Face folder
    assert cli_main(["export", path, str(tmp_path / "from-gguf")]) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "from-gguf", dtype=torch.float32)
    assert back.config.model_type == "llama"
    # a run's output_dir: its newest checkpoint
    trainer = mt.Trainer(model=str(folder), train_dataset=Dataset.from_list(h.rows()),
                         args=h.args(tmp_path / "run", max_steps=2, save_strategy="steps", save_steps=1))
    trainer.train()
    state = {k: v.clone() for k, v in trainer.engine.state_dict().items()}
    trainer.close()
    assert cli_main(["export", str(tmp_path / "run"), str(tmp_path / "run-st")]) == 0
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "run-st", dtype=torch.float32).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in state.items())
    assert cli_main(["export", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2


@pytest.mark.slow
def test_safetensors_still_works_where_gguf_refuses(tmp_path):
    from megatrain_nb.model_configs import family_config

    torch.manual_seed(0)
    folder = tmp_path / "phi3"
    AutoModelForCausalLM.from_config(family_config("phi3")).save_pretrained(folder)
    with pytest.raises(ValueError, match="architecture 'phi3'"):
        mt.export(str(folder), tmp_path / "x.gguf", format="gguf")
    assert not (tmp_path / "x.gguf").exists()
    out = mt.export(str(folder), tmp_path / "st")
    back = AutoModelForCausalLM.from_pretrained(out)
    assert back.config.model_type == "phi3"
    with pytest.raises(ValueError, match="format="):
        mt.export(str(folder), tmp_path / "y", format="onnx")

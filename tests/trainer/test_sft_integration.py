"""SFT end to end: examples/sft.yaml as written (shortened), the Session hook, the sample prompt
and the "what the model is trained on" view."""
import time
from pathlib import Path

import pytest

pytest.importorskip("trl")

import megatrain_nb as mt  # noqa: E402
from megatrain_nb.assets import chat_dataset, chat_tokenizer  # noqa: E402
from megatrain_nb.cli import main  # noqa: E402
from megatrain_nb.trainer.sft_view import trained_on_view  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sft.yaml"


def test_example_sft_yaml_runs_as_written(tmp_path, capsys):
    assert main(["train", "--config", str(EXAMPLE), "--max-steps", "6", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "format messages" in out and "packed into 128-token rows" in out and "token accuracy" in out
    assert (tmp_path / "model.safetensors").is_file() or list(tmp_path.glob("*.safetensors"))


def test_cli_refuses_a_format_that_is_not_the_data(tmp_path, capsys):
    chat_dataset(n=8).to_json(str(tmp_path / "chat.jsonl"))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(EXAMPLE.read_text().replace("format: messages", "format: alpaca")
                   .replace("train: builtin", f"train: {tmp_path / 'chat.jsonl'}"))
    assert main(["train", "--config", str(cfg), "--max-steps", "1", "--output-dir", str(tmp_path / "o")]) == 2
    assert "data.format is 'alpaca' but data.train holds 'messages' rows" in capsys.readouterr().err


def test_session_builds_an_sft_trainer_and_samples_the_chat_prompt(tmp_path):
    from trl import SFTConfig

    tok = chat_tokenizer()
    args = SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, bf16=False,
                     assistant_only_loss=True, max_length=96, report_to="none", disable_tqdm=True, save_strategy="no")
    session = mt.Session("micro", train_dataset=chat_dataset(n=40), tokenizer=tok, args=args, device="cpu")
    assert isinstance(session.trainer, mt.SFTTrainer)
    session.set_sample_prompt([{"role": "user", "content": "What is two plus three ?"}])
    with pytest.raises(ValueError, match="messages must be a list"):
        session.set_sample_prompt("What is two plus three ?")
    view = session.trained_on(0)
    html = view._repr_html_()
    assert "count toward the loss" in html and view.counted_tokens > 0
    # the highlighted tokens are exactly the assistant's turns (labels != -100), never the user's
    row = session.trainer.train_dataset[0]
    assert view.counted == [False] + [lab != -100 for lab in row["labels"][1:]]
    assert "<|user|>" not in [t for t, c in zip(view.tokens, view.counted) if c]
    session.train(block=True)
    # the answers to the sample prompt: before training and from the final weights (greedy, the
    # answer alone); the same greedy answer from generate() now, the weights being the final ones
    end = time.monotonic() + 60   # bounded: the watch's thread draws the last answer after the run
    while [a["step"] for a in session.sample_watch.answers()][-1:] != [3] and time.monotonic() < end:
        time.sleep(0.05)
    answers = session.sample_watch.answers()
    assert answers[0]["step"] == 0 and answers[-1]["step"] == 3
    greedy = session.generate(max_new_tokens=48, temperature=0)
    assert greedy.endswith(answers[-1]["answer"]) and not answers[-1]["answer"].startswith("What is")
    text = session.generate(max_new_tokens=5, seed=0)
    assert text.startswith("What is two plus three")   # the rendered chat prompt, special tokens dropped
    assert session.samples[-1]["prompt"].startswith("<|user|>")
    from megatrain_nb.notebook.magics import _dispatch

    assert _dispatch(f"trained-on 1 -s {session.name}").counted_tokens > 0
    report = session.export_report(str(tmp_path / "run.html"))
    assert "What the model is trained on" in Path(report).read_text()
    assert "Answers to the sample prompt" in Path(report).read_text()
    session.close()


def test_session_with_chat_rows_and_training_arguments_builds_sft(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", disable_tqdm=True,
                             save_strategy="no")
    session = mt.Session("micro", train_dataset=chat_dataset("alpaca", n=8), tokenizer=chat_tokenizer(), args=args,
                         device="cpu")
    assert isinstance(session.trainer, mt.SFTTrainer) and session.trainer.completion_only_loss
    session.close()


def test_trained_on_view_marks_packed_documents(tmp_path):
    from trl import SFTConfig

    tok = chat_tokenizer()
    t = mt.SFTTrainer(model=_micro(len(tok)), processing_class=tok, train_dataset=chat_dataset(n=20),
                      args=SFTConfig(output_dir=str(tmp_path), packing=True, max_length=128, bf16=False,
                                     report_to="none"), device="cpu")
    view = trained_on_view(t, 0)
    row = t.train_dataset[0]
    assert len(view.starts) == len(row["seq_lengths"]) > 1
    assert not any(view.counted[s] for s in view.starts)
    assert "next packed document" in view._repr_html_()
    t.close()


def _micro(vocab):
    from transformers import AutoModelForCausalLM

    from megatrain_nb.model_configs import preset_config

    return AutoModelForCausalLM.from_config(preset_config("micro", vocab_size=vocab))

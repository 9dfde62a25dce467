"""mt.Trainer: parity with transformers.Trainer, the seed example, the Session seam, callbacks, saving."""
import copy
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments

import megatrain_nb as mt
from megatrain_nb.trainer import Trainer

from .helpers import args, micro_model, relative_difference, token_dataset


@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0])  # 0.5: updates after the backward; 0.0: during it
def test_same_weights_as_transformers_trainer(tmp_path, max_grad_norm):
    """Same model, data, order and arguments (accumulation, clipping, decay, warmup + cosine)."""
    from transformers import Trainer as HFTrainer

    model = micro_model()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    ds = token_dataset(22, masked=True)  # unequal target counts per micro-batch: tests the normalisation
    kw = dict(gradient_accumulation_steps=3, weight_decay=0.1, max_grad_norm=max_grad_norm, lr_scheduler_type="cosine",
              warmup_steps=2, num_train_epochs=2, seed=7)
    ref_model = copy.deepcopy(model)
    hf = HFTrainer(model=ref_model, args=args(tmp_path / "hf", **kw), train_dataset=ds)
    hf.train()
    ours = Trainer(model=copy.deepcopy(model), train_dataset=ds, args=args(tmp_path / "mt", **kw), device="cpu")
    records = list(ours.iter_steps())
    assert len(records) == hf.state.global_step == 8
    hf_logs = [h for h in hf.state.log_history if "loss" in h]
    assert [r["lr"] for r in records] == pytest.approx([h["learning_rate"] for h in hf_logs], rel=1e-12)
    assert [r["loss"] for r in records] == pytest.approx([h["loss"] for h in hf_logs], rel=1e-4)
    if max_grad_norm:
        assert [r["grad_norm"] for r in records] == pytest.approx([h["grad_norm"] for h in hf_logs], rel=1e-3)
    rel = relative_difference(dict(ours.engine.named_parameters()), dict(ref_model.named_parameters()), start)
    assert rel <= 1e-3


def test_seed_article_example_runs_as_written(tmp_path):
    folder, data = tmp_path / "local_model", tmp_path / "train.jsonl"
    micro_model().save_pretrained(folder)
    data.write_text("".join(json.dumps(r) + "\n" for r in token_dataset(8).to_list()))
    from datasets import load_dataset

    my_dataset = load_dataset("json", data_files=str(data), split="train")

    (tmp_path / "nvme_cache").mkdir()
    mt.init(offload_dir=str(tmp_path / "nvme_cache"), max_vram_gb=80, optimizer_compression=True)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    trainer = mt.Trainer(
        model=model,
        train_dataset=my_dataset,
        args=TrainingArguments(per_device_train_batch_size=1, gradient_accumulation_steps=4,
                               output_dir=str(tmp_path / "megatrain_outputs")),
    )
    trainer.train()
    assert trainer.state.global_step == 6  # 3 epochs x 2 steps (transformers' defaults)
    cfg = trainer.engine.config
    assert cfg.offload_dir == str(tmp_path / "nvme_cache") and cfg.max_vram_gb == 80
    assert cfg.optimizer_compression != "none"
    assert (tmp_path / "megatrain_outputs" / "checkpoint-6").is_dir()  # the final save, as transformers does
    trainer.close()


def test_save_model_loads_in_transformers_with_the_engines_logits(tmp_path):
    tr = Trainer(model=micro_model(), train_dataset=token_dataset(8), args=args(tmp_path, max_steps=2),
                 device="cpu")
    tr.train()
    out = tr.save_model()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([token_dataset(1, seed=9)[0]["input_ids"]])
    with torch.no_grad():
        expected = loaded(input_ids=ids).logits
    torch.testing.assert_close(tr.engine.forward_logits(ids), expected, rtol=1e-4, atol=1e-4)


def test_iter_steps_records_the_seam_fields(tmp_path):
    tr = Trainer(model=micro_model(), train_dataset=token_dataset(12), eval_dataset=token_dataset(4, seed=5),
                 args=args(tmp_path, max_steps=4, logging_steps=2, eval_strategy="steps", eval_steps=2),
                 device="cpu")
    assert tr.total_steps == 4
    records = list(tr.iter_steps())
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert {"step", "epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s",
                "time"} <= set(r)
        assert r["tokens"] == 2 * 32
    assert "memory" in records[1] and "memory" not in records[0]
    assert {"device", "host", "disk"} <= set(records[1]["memory"]) and "telemetry" in records[1]
    assert "eval_loss" in records[1] and records[1]["eval_ppl"] == pytest.approx(math.exp(records[1]["eval_loss"]))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x and "event" not in x] == [1, 2, 3, 4]


def test_evaluate_reports_loss_and_perplexity_of_the_model(tmp_path):
    model = micro_model()
    ref = copy.deepcopy(model).eval()
    ds = token_dataset(4, seed=5)
    tr = Trainer(model=model, eval_dataset=ds, args=args(tmp_path, per_device_eval_batch_size=4), device="cpu")
    metrics = tr.evaluate()
    with torch.no_grad():
        expected = float(ref(input_ids=torch.tensor(ds["input_ids"]), labels=torch.tensor(ds["input_ids"])).loss)
    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["eval_ppl"] == pytest.approx(math.exp(expected), rel=1e-5)


def test_set_lr_holds_a_constant_schedule_exactly_and_scales_a_decaying_one(tmp_path):
    tr = Trainer(model=micro_model(), train_dataset=token_dataset(20), args=args(tmp_path, max_steps=4,
                 lr_scheduler_type="constant"), device="cpu")
    lrs = []
    for r in tr.iter_steps():
        lrs.append(r["lr"])
        if r["step"] == 2:
            tr.set_lr(1.234e-4)
    assert lrs == [3e-3, 3e-3, 1.234e-4, 1.234e-4]

    tr = Trainer(model=micro_model(), train_dataset=token_dataset(20), args=args(tmp_path / "b", max_steps=6,
                 lr_scheduler_type="linear"), device="cpu")
    lrs = []
    for r in tr.iter_steps():
        lrs.append(r["lr"])
        if r["step"] == 2:
            tr.set_lr(lrs[-1] * 10)
    assert lrs[2] == 10 * lrs[1]  # the next step runs at exactly the new rate
    assert lrs[3] / lrs[2] == pytest.approx((3 / 6) / (4 / 6))  # and the schedule carries on relative to it


def test_request_stop_and_callback_stop(tmp_path):
    tr = Trainer(model=micro_model(), train_dataset=token_dataset(20), args=args(tmp_path, max_steps=8), device="cpu")
    steps = []
    for r in tr.iter_steps():
        steps.append(r["step"])
        if r["step"] == 2:
            tr.request_stop()
    assert steps == [1, 2]

    class StopAt3(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                control.should_training_stop = True

    seen = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            seen.append(dict(logs))

    tr = Trainer(model=micro_model(), train_dataset=token_dataset(20), args=args(tmp_path / "b", max_steps=8),
                 callbacks=[StopAt3(), Record()], device="cpu")
    out = tr.train()
    assert out.global_step == 3 and tr.state.global_step == 3
    assert [s["loss"] for s in seen if "loss" in s and "train_loss" not in s] and "learning_rate" in seen[0]


def test_report_to_uses_transformers_reporting_callbacks(tmp_path):
    pytest.importorskip("tensorboardX")
    tr = Trainer(model=micro_model(), train_dataset=token_dataset(8),
                 args=args(tmp_path, max_steps=2, report_to=["tensorboard"]), device="cpu")
    from transformers.integrations import TensorBoardCallback

    assert any(isinstance(c, TensorBoardCallback) for c in tr.callback_handler.callbacks)
    tr.train()
    assert list(tmp_path.rglob("events.out.tfevents*"))


def test_model_as_local_folder_and_text_dataset(tmp_path):
    from datasets import Dataset

    folder = tmp_path / "model"
    micro_model().save_pretrained(folder)

    class ByteTok:
        eos_token_id, pad_token_id = 0, 0

        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [list(t.encode()) for t in texts]}

    text = Dataset.from_dict({"text": ["def f(x):\n    return x * 2\n"] * 6})
    tr = Trainer(model=str(folder), train_dataset=text, tokenizer=ByteTok(), seq_len=16,
                 args=args(tmp_path / "out", max_steps=2), device="cpu")
    assert tr.train().global_step == 2
    with pytest.raises(ValueError, match="not a local model folder"):
        Trainer(model=str(tmp_path / "nowhere"), args=args(tmp_path / "o2"), device="cpu")


def test_a_transformers_data_collator_is_accepted(tmp_path):
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(500)} | {"[PAD]": 500, "[UNK]": 501}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    rows = [{"text": "x", "input_ids": list(range(i, i + 5 + i % 3))} for i in range(8)]  # ragged, extra column
    tr = Trainer(model=micro_model(), train_dataset=Dataset.from_list(rows), tokenizer=hf_tok,
                 data_collator=DataCollatorForLanguageModeling(hf_tok, mlm=False),
                 args=args(tmp_path, max_steps=2), device="cpu")
    records = list(tr.iter_steps())
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)


def test_callback_can_end_an_epoch_early(tmp_path):
    class SkipRest(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                control.should_epoch_stop = True

    tr = Trainer(model=micro_model(), train_dataset=token_dataset(8), callbacks=[SkipRest()],
                 args=args(tmp_path, num_train_epochs=2), device="cpu")
    epochs = [r["epoch"] for r in tr.iter_steps()]
    assert epochs[0] == 0.25 and epochs[1] == 1.25  # epoch 0 stopped after one of its four batches


def test_accumulation_runs_layer_major(tmp_path):
    """gradient_accumulation_steps=4: one layer-major window per step, each layer loaded twice
    per step, no host gradient accumulator (no clipping)."""
    ds = token_dataset(16)
    tr = Trainer(model=micro_model(), train_dataset=ds, device="cpu",
                 args=args(tmp_path, gradient_accumulation_steps=4, max_grad_norm=0.0, max_steps=2))
    records = list(tr.iter_steps())
    last = records[-1]["telemetry"]["last_step"]
    assert last["micro_batches"] == 4 and last["groups"] == 1 and last["loads_per_layer"] == 2
    assert last["tokens_per_weight_fetch"] == records[-1]["tokens"] / 2
    assert records[-1]["memory"]["host"]["grads"] == 0
    tr.close()

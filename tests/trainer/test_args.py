"""TrainingArguments: honoured, mapped onto the engine, or rejected with the field named."""
import pytest
from transformers import TrainingArguments

from megatrain_nb.trainer import Trainer, UnsupportedArgumentError, validate_training_args
from megatrain_nb.trainer.trainer import _derived_engine_options

from .helpers import micro_model, token_dataset


@pytest.mark.parametrize("field,value", [
    ("torch_compile", True),
    ("label_smoothing_factor", 0.1),
    ("optim", "adafactor"),
    ("push_to_hub", True),
    ("neftune_noise_alpha", 5.0),
    ("auto_find_batch_size", True),
    ("dataloader_num_workers", 2),
    ("fsdp", "full_shard"),
    ("load_best_model_at_end", True),
])
def test_unsupported_field_is_rejected_by_name(tmp_path, field, value):
    kw = {field: value}
    if field == "load_best_model_at_end":
        kw.update(eval_strategy="steps", save_strategy="steps")
    try:
        args = TrainingArguments(output_dir=str(tmp_path), **kw)
    except Exception as e:  # transformers itself refuses it on this machine: nothing for us to check
        pytest.skip(f"TrainingArguments({field}={value!r}) fails here: {e}")
    with pytest.raises(UnsupportedArgumentError, match=field):
        Trainer(model=micro_model(), train_dataset=token_dataset(), args=args, device="cpu")


def test_fp16_is_rejected_with_its_name(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path))
    args.fp16 = True  # on a CPU machine transformers refuses fp16 itself; a user's object may still carry it
    with pytest.raises(UnsupportedArgumentError, match="fp16"):
        validate_training_args(args)


def test_deepspeed_is_rejected(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path))
    args.deepspeed = "ds_config.json"
    with pytest.raises(UnsupportedArgumentError, match="deepspeed"):
        validate_training_args(args)


def test_defaults_and_honoured_fields_pass(tmp_path):
    validate_training_args(TrainingArguments(output_dir=str(tmp_path)))
    validate_training_args(TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=128,
        learning_rate=1e-4, weight_decay=0.1, adam_beta2=0.95, max_grad_norm=0.5, lr_scheduler_type="cosine",
        warmup_steps=0.1, max_steps=10, logging_steps=5, eval_strategy="steps", eval_steps=5, save_steps=5,
        save_total_limit=2, seed=3, gradient_checkpointing=True, run_name="x", report_to="none"))


def test_args_map_onto_engine_options(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), weight_decay=0.1, adam_beta2=0.95, adam_epsilon=1e-6,
                             use_cpu=True)
    assert _derived_engine_options(args) == {"weight_decay": 0.1, "adam_betas": (0.9, 0.95), "adam_eps": 1e-6,
                                             "device": "cpu"}
    assert _derived_engine_options(TrainingArguments(output_dir=str(tmp_path))) == {}
    tr = Trainer(model=micro_model(), train_dataset=token_dataset(), args=args)
    cfg = tr.engine.config
    assert (cfg.weight_decay, cfg.adam_betas, cfg.adam_eps, cfg.device) == (0.1, (0.9, 0.95), 1e-6, "cpu")


def test_conflicting_setting_in_args_and_engine_options(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), weight_decay=0.1)
    with pytest.raises(ValueError, match="weight_decay"):
        Trainer(model=micro_model(), train_dataset=token_dataset(), args=args, weight_decay=0.2, device="cpu")


def test_unknown_engine_option_is_named(tmp_path):
    with pytest.raises(TypeError, match="max_vram"):
        Trainer(model=micro_model(), train_dataset=token_dataset(), args={"output_dir": str(tmp_path)},
                max_vram=3)


def test_args_as_dict_and_none(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tr = Trainer(model=micro_model(), train_dataset=token_dataset(), args={"max_steps": 3}, device="cpu")
    assert tr.total_steps == 3 and tr.args.output_dir.endswith("megatrain_outputs")
    assert Trainer(model=micro_model(), device="cpu").args.per_device_train_batch_size == 8

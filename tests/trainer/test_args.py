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


@pytest.mark.parametrize("field,value,text", [
    ("per_device_train_batch_size", 0, "per_device_train_batch_size=0"),
    ("gradient_accumulation_steps", -2, "gradient_accumulation_steps=-2"),
    ("learning_rate", -1e-3, "learning_rate=-0.001: must be a finite number > 0"),
    ("learning_rate", 1e10, r"learning_rate=10000000000.0: .*implausibly large"),
])
def test_unusable_values_are_refused_when_the_trainer_or_session_is_built(tmp_path, field, value, text):
    from megatrain_nb.notebook import Session

    a = TrainingArguments(output_dir=str(tmp_path), report_to="none", **{field: value})
    with pytest.raises(UnsupportedArgumentError, match=text):
        Trainer(model=micro_model(), train_dataset=token_dataset(4), args=a, device="cpu")
    with pytest.raises(UnsupportedArgumentError, match=text):
        Session(micro_model(), train_dataset=token_dataset(4), args=a, device="cpu")
    with pytest.raises(UnsupportedArgumentError, match=text):   # a dict of fields too
        Trainer(model=micro_model(), train_dataset=token_dataset(4), device="cpu",
                args={"output_dir": str(tmp_path), field: value})


def test_a_misspelled_field_in_a_dict_suggests_the_closest_name(tmp_path):
    with pytest.raises(UnsupportedArgumentError, match=r"args.learning_rte \(did you mean 'learning_rate'\?\)"):
        Trainer(model=micro_model(), train_dataset=token_dataset(4), device="cpu",
                args={"output_dir": str(tmp_path), "learning_rte": 1e-4})


BAD_LRS = [0, -1e-4, float("nan"), float("inf"), 10.5, 1e10, True, None, "fast"]
GOOD_LRS = [1e-6, 3e-4, 10]


def test_one_learning_rate_rule_for_trainer_session_commands_and_the_sidebar(tmp_path):
    """Trainer.set_lr, Session.set_lr, the server's and the beacon's command check and the
    sidebar's own check accept and refuse the same values."""
    import re
    from pathlib import Path

    from megatrain_nb.commands import CommandError, check_command
    from megatrain_nb.learning_rate import MAX_LEARNING_RATE
    from megatrain_nb.notebook import Session

    tr = Trainer(model=micro_model(), train_dataset=token_dataset(4), device="cpu",
                 args=TrainingArguments(output_dir=str(tmp_path), report_to="none"))
    session = Session.from_trainer(tr)
    try:
        for lr in BAD_LRS:
            for set_lr in (tr.set_lr, session.set_lr):
                with pytest.raises(ValueError):
                    set_lr(lr)
            with pytest.raises(CommandError):
                check_command("lr", lr, sidebar=True)
        for lr in GOOD_LRS:
            tr.set_lr(lr)
            session.set_lr(lr)
            assert check_command("lr", lr, sidebar=True) == ("lr", float(lr))
    finally:
        session.close()
        tr.close()
    ts = (Path(__file__).resolve().parents[2] / "extension" / "src" / "commands.ts").read_text()
    assert re.search(r"export const MAX_LR = (\S+);", ts).group(1) == f"{MAX_LEARNING_RATE:g}"
    assert "value <= 0" in ts   # the sidebar's lower bound: > 0, as check_learning_rate

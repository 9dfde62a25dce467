"""The table of values (megatrain_nb/values.py) walked through every door that takes each value:
a wrong type, NaN/inf where numeric, a too-large integer and an out-of-range value are refused
when they enter, with the table's words, and nothing is applied. (The HTTP route's walk is in
tests/lab/test_handlers.py, which holds the Jupyter server fixtures.)"""
from __future__ import annotations

import dataclasses
import math

import pytest
import yaml

from megatrain_nb import values
from megatrain_nb.values import VALUES, ValueRefused, check, rule

HUGE = 10 ** 400


def bad_values(name: str) -> list:
    """(label, value) pairs no door may take for ``name``."""
    row = VALUES[name]
    if row.many:   # a list: empty, of a wrong type, or holding one bad value
        one = dataclasses.replace(row, many=False, none_ok=False)
        out = [("empty list", []), ("wrong type", {"a": 1})] + [(f"a list holding {label}", [value])
                                                                   for label, value in _bad_of(one)]
        return out + ([] if row.none_ok else [("None", None)])
    return _bad_of(row)


def _bad_of(row) -> list:
    if row.kind == "bool":
        out = [("wrong type", "no"), ("wrong type", "abc"), ("wrong type", 1), ("nan", math.nan), ("wrong type", [True])]
        return out + ([] if row.none_ok else [("None", None)])
    if row.kind == "path":
        return [("wrong type", 5), ("wrong type", True), ("wrong type", ["a"]), ("empty", "")]
    if row.kind == "choice":
        return [("wrong type", 5), ("wrong type", ["linear"] if not row.many else [5]), ("not a choice", "bogus")] + (
            [] if row.none_ok else [("None", None)])
    out = [("wrong type", [1]), ("wrong type", "x"), ("wrong type", True), ("nan", math.nan), ("inf", math.inf),
           ("-inf", -math.inf), ("huge", HUGE), ("huge", -HUGE)]
    if row.kind == "int":
        out.append(("fraction", 1.5))
    if row.low is not None:
        out.append(("below", row.low - 1 if row.kind == "int" and row.low - 1 not in row.also else row.low - 0.5))
        if row.low_open:
            out.append(("at the open bound", row.low))
    if row.high is not None:
        out.append(("above", row.high + 1 if row.high < values.MAX_INT else row.high + 1))
    if not row.none_ok:
        out.append(("None", None))
    return out


def cases(names):
    """One case per name; each test tries every bad value of it (a few hundred cases, not thousands)."""
    return [pytest.param(n, id=n) for n in names]


def refused_with_the_rule(name, message: str) -> None:
    assert rule(name) in message, (name, message)


# ---- the table itself -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", cases(VALUES))
def test_every_entry_refuses_its_bad_values_with_its_rule(name):
    for label, value in bad_values(name):
        with pytest.raises(ValueRefused) as e:
            check(name, value, f"here.{name}")
        assert str(e.value).startswith(f"here.{name}=")
        refused_with_the_rule(name, str(e.value))
        assert len(str(e.value)) < 400   # a 400-digit integer is named by its length, not printed


def test_good_values_pass_and_text_numbers_count():
    assert check("learning_rate", "3e-4") == 3e-4 and check("max_steps", -1) == -1
    assert check("max_steps", "10") == 10 and check("seq_len", None) is None
    assert check("adam_beta2", 0.999) == 0.999 and check("seed", 2 ** 32 - 1) == 2 ** 32 - 1
    assert check("lr_scheduler_type", "cosine") == "cosine"


def test_the_schedulers_are_transformers_own_less_the_metric_driven_ones():
    from transformers.trainer_utils import SchedulerType

    assert set(VALUES["lr_scheduler_type"].choices) == {s.value for s in SchedulerType} - {
        "reduce_lr_on_plateau", "greedy"}


# ---- EngineConfig (and mt.init) -------------------------------------------------------------------
def _engine_names():
    from megatrain_nb.engine.config import EngineConfig, EngineOverrides

    return ([f.name for f in dataclasses.fields(EngineConfig) if f.name in VALUES],
            [f.name for f in dataclasses.fields(EngineOverrides) if f.name in VALUES])


ENGINE, OVERRIDES = _engine_names()


@pytest.mark.parametrize("name", cases(ENGINE + OVERRIDES))
def test_engine_config_refuses(name):
    import megatrain_nb as mt
    from megatrain_nb.engine import EngineConfig

    for label, value in bad_values(name):
        with pytest.raises(ValueRefused) as e:
            EngineConfig.from_options(**{name: value})
        refused_with_the_rule(name, str(e.value))
        with pytest.raises(ValueRefused):
            mt.init(**{name: value})
        assert mt.get_defaults() == {}


def test_engine_adam_betas_use_the_beta_rules():
    from megatrain_nb.engine import EngineConfig

    for betas in [(math.nan, 0.9), (0.9, 1.0), (HUGE, 0.9)]:
        with pytest.raises(ValueRefused, match="adam_betas"):
            EngineConfig(adam_betas=betas)
    with pytest.raises(ValueRefused, match="must be a pair"):
        EngineConfig(adam_betas=0.9)


# ---- the Trainer, the SFTTrainer, the Session ---------------------------------------------------
TRAINING = [n for n in __import__("megatrain_nb.trainer.args", fromlist=["CHECKED"]).CHECKED if n != "max_length"]


@pytest.fixture(scope="module")
def model():
    from tests.trainer.helpers import micro_model

    return micro_model()


@pytest.mark.parametrize("name", cases(TRAINING))
def test_trainer_and_session_refuse(model, tmp_path, name):
    from megatrain_nb.notebook import Session
    from megatrain_nb.trainer import Trainer

    from tests.trainer.helpers import token_dataset

    for label, value in bad_values(name):
        fields = {"output_dir": str(tmp_path), name: value}
        with pytest.raises(ValueError) as e:
            Trainer(model=model, args=fields, device="cpu")
        refused_with_the_rule(name, str(e.value))
        with pytest.raises(ValueError) as e:
            Session(model, train_dataset=token_dataset(4), args=fields, device="cpu")
        refused_with_the_rule(name, str(e.value))


@pytest.mark.parametrize("name", cases(["snapshot_steps", "keep_snapshots", "seq_len"]))
def test_the_sessions_own_options_are_checked(model, name):
    from megatrain_nb.notebook import Session

    for label, value in bad_values(name):
        with pytest.raises(ValueRefused) as e:
            Session(model, **{name: value})
        refused_with_the_rule(name, str(e.value))


@pytest.mark.parametrize("name", cases(TRAINING + ["max_length"]))
def test_sft_trainer_refuses(model, tmp_path, name):
    pytest.importorskip("trl")
    from megatrain_nb.trainer.sft import SFTTrainer

    for label, value in bad_values(name):
        with pytest.raises(ValueError) as e:
            SFTTrainer(model=model, args={"output_dir": str(tmp_path), name: value}, train_dataset=[{"text": "a b"}],
                       device="cpu")
        refused_with_the_rule(name, str(e.value))


@pytest.mark.parametrize("name,value", [("weight_decay", math.nan), ("max_grad_norm", math.nan),
                                        ("learning_rate", HUGE), ("adam_epsilon", math.inf)])
def test_a_training_arguments_object_is_checked_too(model, tmp_path, name, value):
    from transformers import TrainingArguments

    from megatrain_nb.trainer import Trainer

    a = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    setattr(a, name, value)
    with pytest.raises(ValueError) as e:
        Trainer(model=model, args=a, device="cpu")
    refused_with_the_rule(name, str(e.value))


@pytest.mark.parametrize("name", cases(["seq_len"]))
def test_the_trainers_seq_len_is_checked(model, name):
    from megatrain_nb.trainer import Trainer

    for label, value in bad_values(name):
        with pytest.raises(ValueError) as e:
            Trainer(model=model, seq_len=value, device="cpu")
        refused_with_the_rule(name, str(e.value))


def test_seq_len_above_the_models_positions_and_eval_without_a_set_are_refused_at_once(tmp_path):
    from megatrain_nb.trainer import Trainer
    from tests.trainer.helpers import micro_model

    model = micro_model()
    n = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_position_embeddings \\({n}\\)"):
        Trainer(model=model, seq_len=n + 1, device="cpu")
    with pytest.raises(ValueError, match="eval_strategy='steps' evaluates during training, but no eval_dataset"):
        Trainer(model=micro_model(), args={"output_dir": str(tmp_path), "eval_strategy": "steps"}, device="cpu")


# ---- fork() ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", cases([n for n in __import__(
    "megatrain_nb.notebook.branches", fromlist=["ALLOWED"]).ALLOWED if n in VALUES]))
def test_fork_changes_are_checked_by_the_table(name):
    from megatrain_nb.notebook.branches import check_changes

    for label, value in bad_values(name):
        with pytest.raises(ValueRefused) as e:
            check_changes({name: value})
        assert f"fork({name})=" in str(e.value)
        refused_with_the_rule(name, str(e.value))


def test_fork_refuses_bad_changes_at_fork_and_applies_nothing(tmp_path):
    """Issue 32 defect 6: these trained silently or failed at train() with raw TypeErrors."""
    from megatrain_nb.notebook import Session
    from tests.trainer.helpers import token_dataset

    from tests.trainer.helpers import micro_model

    s = Session(micro_model(), train_dataset=token_dataset(8), args={"output_dir": str(tmp_path), "max_steps": 2,
                                                             "report_to": "none"}, device="cpu")
    try:
        for k, v in [("weight_decay", -1), ("warmup_steps", -3), ("lr_scheduler_type", "bogus"),
                     ("max_grad_norm", "x"), ("data_seed", "x"), ("max_steps", "x"), ("learning_rate", HUGE)]:
            with pytest.raises(ValueRefused) as e:
                s.fork(**{k: v})
            refused_with_the_rule(k, str(e.value))
        with pytest.raises(ValueError, match=r"fork\(loss_fn\)=5: must be a function"):
            s.fork(loss_fn=5)
        with pytest.raises(ValueRefused, match=r"fork\(step\)=-1"):
            s.fork(step=-1)
        assert s.explorer.all_snapshots() == [] and list(s.explorer.group.names()) == [s.name]
    finally:
        s.close()


# ---- the command table: the Python call, the inbox, the magics -------------------------------------
LR_TEXT = ["x", "nan", "inf", "-inf", "1" + "0" * 400, "-1", "0", "11", "[1]"]


@pytest.mark.parametrize("command,name", [("lr", "learning_rate"), ("rewind", "step")])
def test_commands_refuse_bad_values(command, name):
    """The Python call, the sidebar's check (server and beacon) and the ranks' inbox."""
    from megatrain_nb.commands import CommandError, check_command

    doors = [{}, {"ranks": True}] + ([{"sidebar": True}] if command == "lr" else [])
    for label, value in bad_values(name):
        for door in doors:
            with pytest.raises(CommandError) as e:
                check_command(command, value, **door)
            refused_with_the_rule(name, str(e.value))


class _Untouchable:
    """A session whose controls the magics must not reach: a refused value applies nothing
    (its one door, Session.command, checks the value by the table before anything else)."""
    name = "s"
    step = 0

    def command(self, *args, **kw):
        from megatrain_nb.notebook.session import Session

        return Session.command(self, *args, **kw)

    def __getattr__(self, item):
        raise AssertionError(f"the magic reached session.{item} with a refused value")


@pytest.mark.parametrize("text", LR_TEXT)
def test_the_lr_magic_refuses_with_the_table_words(text):
    from megatrain_nb.notebook.magics import MagicError, _lr

    with pytest.raises(MagicError) as e:
        _lr(_Untouchable(), [text])
    refused_with_the_rule("learning_rate", str(e.value))


@pytest.mark.parametrize("text", ["x", "-1", "1.5", "1" + "0" * 400, "nan"])
def test_the_rewind_magic_refuses_with_the_table_words(text):
    from megatrain_nb.notebook.magics import MagicError, _rewind

    with pytest.raises(MagicError) as e:
        _rewind(_Untouchable(), [text])
    refused_with_the_rule("step", str(e.value))


def test_session_and_trainer_set_lr_refuse(tmp_path):
    from megatrain_nb.notebook import Session
    from tests.trainer.helpers import micro_model

    from tests.trainer.helpers import token_dataset

    s = Session(micro_model(), train_dataset=token_dataset(4), args={"output_dir": str(tmp_path),
                                                                     "report_to": "none"}, device="cpu")
    try:
        before = s.trainer.schedule.current() if s.trainer.schedule is not None else None
        for label, value in bad_values("learning_rate"):
            for door in (s.set_lr, s.trainer.set_lr):
                with pytest.raises(ValueError) as e:
                    door(value)
                refused_with_the_rule("learning_rate", str(e.value))
        assert (s.trainer.schedule.current() if s.trainer.schedule is not None else None) == before
        assert s.trainer.pending_lr is None
    finally:
        s.close()


# ---- run.yaml through the CLI ---------------------------------------------------------------------
def _yaml_cases():
    return [pytest.param(section, n, id=f"{section}.{n}")
            for section, names in (("training", TRAINING), ("engine", ENGINE + OVERRIDES), ("sft", ["max_length"]),
                                   ("data", ["seq_len"])) for n in names]


@pytest.mark.parametrize("section,name", _yaml_cases())
def test_run_yaml_refuses_with_one_line_and_exit_2(tmp_path, capsys, section, name):
    for label, value in bad_values(name):
        one_yaml_refusal(tmp_path, capsys, section, name, value)


def one_yaml_refusal(tmp_path, capsys, section, name, value, row=None):
    from megatrain_nb.cli import main

    cfg = {"preset": "micro", "training": {"max_steps": 1}}
    cfg.setdefault(section, {})[name] = value
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert f"{section}.{name}=" in err
    refused_with_the_rule(row or name, err)
    assert not (tmp_path / "o").exists()   # refused before anything was made


# ---- sampling (Session.generate) ----------------------------------------------------------------------
@pytest.mark.parametrize("name,keyword", [("max_new_tokens", "max_new_tokens"), ("temperature", "temperature"),
                                          ("top_k", "top_k"), ("sample_seed", "seed")])
def test_sampling_values_are_checked_before_any_token(name, keyword):
    from megatrain_nb.engine.compute.sampling import sample_text

    for label, value in bad_values(name):
        with pytest.raises(ValueRefused) as e:
            sample_text(None, object(), "hi", **{keyword: value})   # the engine is never reached
        refused_with_the_rule(name, str(e.value))


# ---- preference and SFT fine-tuning (issue 44): DPOConfig's / SFTConfig's own values -----------------
DPO = list(values.DPO_FIELDS)
SFT = list(values.SFT_FIELDS)


def _fine_tuning_bad(family: str, field: str) -> list:
    return bad_values(values.row_name(field, family))


@pytest.fixture(scope="module")
def chat():
    pytest.importorskip("trl")
    from tests.trainer.dpo_helpers import pairs, tiny_llama, tokenizer

    tok = tokenizer()
    return tiny_llama(len(tok)), tok, pairs(4)


@pytest.mark.parametrize("name", cases(DPO))
def test_dpo_trainer_refuses_at_construction(chat, tmp_path, name):
    """The Python call (a dict and a DPOConfig): refused when the trainer is built, before any
    reference pass, with the table's words (beta=-0.5 and 0, label_smoothing NaN/-1/2/'abc', loss_type=[])."""
    from megatrain_nb.trainer.dpo import DPOTrainer
    from tests.trainer.dpo_helpers import dpo_config

    model, tok, rows = chat
    row = values.row_name(name, "dpo")
    for label, value in _fine_tuning_bad("dpo", name):
        fields = {"output_dir": str(tmp_path), "bf16": False, "report_to": "none", name: value}
        with pytest.raises(ValueError) as e:
            DPOTrainer(model=model, args=fields, train_dataset=rows, processing_class=tok, device="cpu")
        assert f"args.{name}=" in str(e.value)
        refused_with_the_rule(row, str(e.value))
        config = dpo_config(tmp_path)
        setattr(config, name, value)   # (a DPOConfig holds whatever it is given)
        with pytest.raises(ValueError) as e:
            DPOTrainer(model=model, args=config, train_dataset=rows, processing_class=tok, device="cpu")
        assert f"DPOConfig.{name}=" in str(e.value)
        refused_with_the_rule(row, str(e.value))
    assert not (tmp_path / "reference_logps").exists()


def test_dpo_numbers_as_text_count_as_the_table_counts_them(chat, tmp_path):
    from megatrain_nb.trainer.dpo import check_dpo_values
    from tests.trainer.dpo_helpers import dpo_config

    config = dpo_config(tmp_path, beta="1e-1", label_smoothing="0.25", loss_type="robust")
    check_dpo_values(config)
    assert (config.beta, config.label_smoothing, config.loss_type) == (0.1, 0.25, ["robust"])


@pytest.mark.parametrize("name", cases(SFT))
def test_sft_config_values_are_refused(model, tmp_path, name):
    pytest.importorskip("trl")
    from megatrain_nb.trainer.sft import SFTTrainer

    for label, value in _fine_tuning_bad("sft", name):
        with pytest.raises(ValueError) as e:
            SFTTrainer(model=model, args={"output_dir": str(tmp_path), "bf16": False, name: value},
                       train_dataset=[{"text": "a b"}], device="cpu")
        assert f"args.{name}=" in str(e.value)
        refused_with_the_rule(values.row_name(name, "sft"), str(e.value))


@pytest.mark.parametrize("name", cases(["beta", "loss_type"]))
def test_fork_dpo_changes_use_the_table(name):
    """fork(beta=...) and fork(loss_type=...) by the table's rules (they had their own: inf and 1e300 passed)."""
    from megatrain_nb.notebook.branches import check_changes

    row = values.row_name(name, "dpo")
    for label, value in bad_values(row) + [("too large", 1e300)] * (name == "beta"):
        with pytest.raises(ValueRefused) as e:
            check_changes({name: value})
        assert f"fork({name})=" in str(e.value)
        refused_with_the_rule(row, str(e.value))
    assert check_changes({"beta": "0.5", "loss_type": "ipo"}) == {"beta": 0.5, "loss_type": ["ipo"]}


@pytest.mark.parametrize("section,name", [pytest.param("dpo", n, id=f"dpo.{n}") for n in DPO]
                         + [pytest.param("sft", n, id=f"sft.{n}") for n in SFT])
def test_run_yaml_refuses_fine_tuning_values(tmp_path, capsys, section, name):
    row = values.row_name(name, section)
    for label, value in bad_values(row):
        one_yaml_refusal(tmp_path, capsys, section, name, value, row=row)


# ---- environment variables read as numbers (issue 44) ---------------------------------------------------
@pytest.mark.parametrize("text", ["abc", "nan", "-5", "1e999", "0", "inf", "1e9"])
def test_the_dist_timeout_variable_is_named_with_its_range(monkeypatch, text):
    """It was a raw ValueError (abc), and NaN, -5 and 1e999 were taken."""
    from megatrain_nb.engine.ranks.dist import Dist, default_timeout_s

    monkeypatch.setenv("MEGATRAIN_DIST_TIMEOUT_S", text)
    for read in (default_timeout_s, lambda: Dist(None, device="cpu", _single=True)):
        with pytest.raises(ValueError, match=r"MEGATRAIN_DIST_TIMEOUT_S='.*': must be a number of seconds > 0 and "
                                             r"<= 604800 \(seconds a collective waits"):
            read()
    monkeypatch.setenv("MEGATRAIN_DIST_TIMEOUT_S", "30")
    assert default_timeout_s() == 30.0 and Dist(None, device="cpu", _single=True).timeout_s == 30.0
    monkeypatch.delenv("MEGATRAIN_DIST_TIMEOUT_S")
    assert default_timeout_s() == 600.0


@pytest.mark.parametrize("field,value", [("beta", -0.5), ("beta", 0), ("beta", None), ("beta", "abc"), ("beta", HUGE),
                                         ("beta", math.inf), ("label_smoothing", math.nan), ("label_smoothing", -1),
                                         ("label_smoothing", 2), ("label_smoothing", "abc"), ("label_smoothing", 0.5),
                                         ("loss_type", [])])
def test_issue_44s_dpo_values_are_refused_when_the_trainer_is_built(chat, tmp_path, field, value):
    """beta=-0.5 trained toward the rejected answers, beta=0 trained nothing, label_smoothing=0.5 with
    'robust' gave NaN at step 1, loss_type=[] failed at step 1; the rest failed after the reference pass."""
    from megatrain_nb.trainer.dpo import DPOTrainer
    from tests.trainer.dpo_helpers import dpo_config

    model, tok, rows = chat
    config = dpo_config(tmp_path, loss_type=["robust"] if field == "label_smoothing" else ["sigmoid"])
    setattr(config, field, value)
    with pytest.raises(ValueRefused, match=rf"DPOConfig\.{field}=.*: {rule(values.row_name(field, 'dpo'))[:20]}"):
        DPOTrainer(model=model, args=config, train_dataset=rows, processing_class=tok, device="cpu")
    assert not (tmp_path / "reference_logps").exists()

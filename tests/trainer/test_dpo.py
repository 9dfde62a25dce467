"""mt.DPOTrainer beyond parity: bad preference rows named, DPOConfig fields that cannot apply
refused by name, the reference log-probs cached and reused, metrics in metrics.jsonl,
evaluation as TRL's."""
import copy
import json

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

import megatrain_nb as mt  # noqa: E402
from megatrain_nb.trainer.data import DataError  # noqa: E402

from .dpo_helpers import dpo_config, pairs, tiny_llama, tokenizer  # noqa: E402


def _trainer(tmp_path, rows, **kw):
    tok = tokenizer()
    model = tiny_llama(len(tok))
    return mt.DPOTrainer(model=model, args=dpo_config(tmp_path, **kw), train_dataset=rows,
                         processing_class=tok, device="cpu")


@pytest.mark.parametrize("bad,message", [
    (lambda r: r[3].pop("rejected"), "row 3: 'rejected' is missing"),
    (lambda r: r[2].update(rejected=r[2]["chosen"]), "row 2: chosen and rejected are the same"),
    (lambda r: r[1].update(chosen="plain words"), "row 1 mixes formats"),
    (lambda r: r[4].update(chosen=None), "row 4: 'chosen' is missing"),
])
def test_bad_rows_are_named(tmp_path, bad, message):
    rows = pairs(6)
    bad(rows)
    rows[3].setdefault("rejected", None)
    with pytest.raises(DataError, match=message):
        _trainer(tmp_path, rows)


def test_missing_column_and_all_truncated_are_refused(tmp_path):
    with pytest.raises(DataError, match=r"no \['rejected'\] column"):
        _trainer(tmp_path, [{"chosen": "a b"}, {"chosen": "c d"}])
    with pytest.raises(DataError, match="every pair's prompt fills max_length=2"):
        _trainer(tmp_path, pairs(4, "text"), max_length=2)


@pytest.mark.parametrize("field,value", [("sync_ref_model", True), ("router_aux_loss_coef", 0.1)])
def test_inapplicable_fields_are_refused_by_name(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        _trainer(tmp_path, pairs(4), **{field: value})


def test_peft_and_unknown_loss_type_are_refused(tmp_path):
    tok = tokenizer()
    with pytest.raises(ValueError, match="peft_config"):
        mt.DPOTrainer(model=tiny_llama(len(tok)), train_dataset=pairs(4), processing_class=tok,
                      args=dpo_config(tmp_path), peft_config=object(), device="cpu")
    with pytest.raises(ValueError, match=r"DPOConfig.loss_type=\['nope'\]: must be one or a non-empty list of"):
        _trainer(tmp_path, pairs(4), loss_type=["nope"])
    with pytest.raises(ValueError, match="Label smoothing must be greater than 0.0"):
        _trainer(tmp_path, pairs(4), loss_type=["exo_pair"])


def test_reference_is_cached_and_reused_and_metrics_logged(tmp_path):
    """The second trainer on the same data, tokenizer, weights and length reads the cache and
    never runs the reference pass; a changed max_length is another key."""
    tok = tokenizer()
    model = tiny_llama(len(tok))
    rows = pairs(8)
    first = mt.DPOTrainer(model=copy.deepcopy(model), args=dpo_config(tmp_path, max_steps=2), train_dataset=rows,
                          processing_class=copy.deepcopy(tok), device="cpu")
    first.train()
    assert first.reference_seconds["train"] > 0
    cached = list((tmp_path / "reference_logps").glob("train-*.safetensors"))
    assert len(cached) == 1
    from safetensors.torch import load_file

    ref = {k: v.clone() for k, v in load_file(str(cached[0])).items()}   # (safetensors: never a pickle)
    assert ref["chosen"].shape == (len(first.train_dataset),)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "rewards/margins" in x]
    assert len(steps) == 2 and all("logps/chosen" in x and "num_tokens" in x for x in steps)
    assert any(x.get("event") == "reference" and not x["cached"] for x in lines)
    assert "rewards/accuracies" in first.state.log_history[0]
    first.close()

    again = mt.DPOTrainer(model=copy.deepcopy(model), args=dpo_config(tmp_path, max_steps=1), train_dataset=rows,
                          processing_class=copy.deepcopy(tok), device="cpu")
    calls = []
    original = again.engine.evaluate
    again.engine.evaluate = lambda *a, **k: calls.append(1) or original(*a, **k)
    again.train()
    assert again.reference_seconds["train"] == 0.0 and not calls
    assert torch.equal(torch.tensor(again.train_dataset["ref_chosen_logps"]), ref["chosen"])
    again.close()

    other = mt.DPOTrainer(model=copy.deepcopy(model), args=dpo_config(tmp_path, max_steps=1, max_length=40),
                          train_dataset=rows, processing_class=copy.deepcopy(tok), device="cpu")
    other._ensure_reference()
    assert other.reference_seconds["train"] > 0
    assert len(list((tmp_path / "reference_logps").glob("train-*.safetensors"))) == 2
    other.close()

    cached[0].write_bytes(b"not a safetensors file")   # a damaged cache is named and computed again
    redo = mt.DPOTrainer(model=copy.deepcopy(model), args=dpo_config(tmp_path, max_steps=1), train_dataset=rows,
                         processing_class=copy.deepcopy(tok), device="cpu")
    with pytest.warns(UserWarning, match=f"reference cache {cached[0]}.*cannot be read"):
        redo._ensure_reference()
    assert redo.reference_seconds["train"] > 0
    assert torch.equal(torch.tensor(redo.train_dataset["ref_chosen_logps"]), ref["chosen"])
    redo.close()


def test_evaluate_matches_trl(tmp_path):
    import trl

    tok = tokenizer()
    model = tiny_llama(len(tok))
    rows = pairs(10)
    t = trl.DPOTrainer(model=copy.deepcopy(model), args=dpo_config(tmp_path / "t", precompute_ref_log_probs=True,
                                                                   per_device_eval_batch_size=3),
                       train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows[:7]),
                       processing_class=copy.deepcopy(tok))
    expected = t.evaluate()
    m = mt.DPOTrainer(model=copy.deepcopy(model), args=dpo_config(tmp_path / "m", per_device_eval_batch_size=3),
                      train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows[:7]),
                      processing_class=copy.deepcopy(tok), device="cpu")
    got = m.evaluate()
    for k in ("eval_loss", "eval_logps/chosen", "eval_logits/rejected", "eval_entropy", "eval_rewards/accuracies"):
        assert got[k] == pytest.approx(expected[k], rel=1e-5, abs=1e-6), k
    m.close()


def test_example_dpo_yaml_runs_as_written(tmp_path, capsys):
    from pathlib import Path

    from megatrain_nb.cli import main

    example = Path(__file__).resolve().parents[2] / "examples" / "dpo.yaml"
    assert main(["train", "--config", str(example), "--max-steps", "2", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "built-in preference set" in out and "reference log-probs" in out and "reward margin" in out
    cache = list((tmp_path / "reference_logps").glob("train-*.safetensors"))
    assert cache
    # megatrain-nb estimate --pairs N counts the reference pass and the bytes of that cache (200 pairs)
    assert main(["estimate", "micro", "--ram", "8", "--disk", "8", "--pairs", "200", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["reference_cache_bytes"] - 128 <= cache[0].stat().st_size <= est["reference_cache_bytes"]
    assert main(["estimate", "micro", "--ram", "8", "--disk", "8", "--pairs", "200"]) == 0
    out = capsys.readouterr().out
    assert "DPO reference pass: one forward-only streamed pass over 200 pairs" in out and "reference cache" in out


def test_a_bad_row_of_an_iterable_dataset_is_named_as_it_is_read(tmp_path):
    rows = pairs(8)
    rows[5]["rejected"] = rows[5]["chosen"]
    tok = tokenizer()
    trainer = mt.DPOTrainer(model=tiny_llama(len(tok)), args=dpo_config(tmp_path, max_steps=4),
                            train_dataset=Dataset.from_list(rows).to_iterable_dataset(), processing_class=tok,
                            device="cpu")
    with pytest.raises(DataError, match="row 5: chosen and rejected are the same"):
        trainer.train()
    trainer.close()


def test_resume_reads_the_cache_and_ends_where_an_uninterrupted_run_ends(tmp_path):
    tok = tokenizer()
    model = tiny_llama(len(tok))
    rows = pairs(12)

    def make(out, **kw):
        return mt.DPOTrainer(model=copy.deepcopy(model), args=dpo_config(out, **kw), train_dataset=rows,
                             processing_class=copy.deepcopy(tok), device="cpu")

    straight = make(tmp_path / "a", max_steps=4)
    straight.train()
    want = {n: w.clone() for n, w in straight.engine.named_parameters()}
    want_losses = [h["loss"] for h in straight.state.log_history if "rewards/margins" in h]
    straight.close()
    first = make(tmp_path / "b", max_steps=4, save_strategy="steps", save_steps=2)
    for record in first.iter_steps():
        if record["step"] == 2:
            break
    first.close()
    again = make(tmp_path / "b", max_steps=4, save_strategy="steps", save_steps=2)
    again.train(resume_from_checkpoint=True)
    assert again.reference_seconds["train"] == 0.0   # read from the cache, not the resumed weights
    got = dict(again.engine.named_parameters())
    assert max(float((got[n] - w).abs().max()) for n, w in want.items()) < 1e-6
    losses = [h["loss"] for h in again.state.log_history if "rewards/margins" in h]
    assert losses == pytest.approx(want_losses, rel=1e-6)   # steps 1-2 from the checkpoint's history
    again.close()


def test_evaluate_on_an_iterable_eval_set_matches_the_map_style_one(tmp_path):
    tok = tokenizer()
    rows = pairs(7)
    m = mt.DPOTrainer(model=tiny_llama(len(tok)), args=dpo_config(tmp_path, per_device_eval_batch_size=3),
                      train_dataset=pairs(6), processing_class=tok, device="cpu")
    mapped = m.evaluate(Dataset.from_list(rows))
    again = m.evaluate(Dataset.from_list(rows))   # the reference read from the cache
    streamed = m.evaluate(Dataset.from_list(rows).to_iterable_dataset())
    for k in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen"):
        assert again[k] == pytest.approx(mapped[k], rel=1e-6) and streamed[k] == pytest.approx(mapped[k], rel=1e-5)
    m.close()


def test_an_eval_strategy_without_an_eval_set_is_refused_before_anything_is_built(tmp_path):
    """As mt.Trainer and transformers refuse it; with an eval set it is fine (the pairs are
    prepared after Trainer.__init__, so the check is DPOTrainer's own)."""
    from megatrain_nb.trainer.args import UnsupportedArgumentError

    tok = tokenizer()
    with pytest.raises(UnsupportedArgumentError, match="no eval_dataset was given"):
        mt.DPOTrainer(model=tiny_llama(len(tok)), args=dpo_config(tmp_path, eval_strategy="steps", eval_steps=1),
                      train_dataset=pairs(4), processing_class=tok, device="cpu")
    t = mt.DPOTrainer(model=tiny_llama(len(tok)), args=dpo_config(tmp_path, eval_strategy="steps", eval_steps=1),
                      train_dataset=pairs(4), eval_dataset=pairs(2), processing_class=tok, device="cpu")
    assert len(t.eval_dataset) == 2
    t.close()

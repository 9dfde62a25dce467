"""mt.DPOTrainer on TRL's vision preference data (trainer/dpo_vision.py): a tiny Qwen2-VL built from a
config with Qwen2-VL's own processor built offline (megatrain_nb/assets/vision.py), pairs of
answers about drawn pictures. The same tokens and pixels reach the model as under trl.DPOTrainer
(its ``DataCollatorForVisionPreference``), the reference log-probs (computed ahead through the
engine's forward-only pass, with the pictures) are the model's own, the losses and metrics agree
to 1e-5 and the weights to round-off; rows that cannot train as given are refused by name."""
import copy
import random

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("PIL")

from datasets import Dataset  # noqa: E402

from megatrain_nb.assets.vision import COLOURS, QUESTIONS, SHAPES, draw, tiny_qwen2_vl, vision_processor  # noqa: E402
from megatrain_nb.trainer.data import DataError  # noqa: E402

from .dpo_helpers import dpo_config  # noqa: E402
from .vision_helpers import (apart_with_other_pictures, check_weights, flipped, tower_names,  # noqa: E402
                             train_mt, train_trl)

KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
           "logits/chosen", "entropy", "mean_token_accuracy", "num_tokens")


def vision_pairs(n: int = 8, seed: int = 0) -> Dataset:
    """``n`` pairs in TRL's vision preference format: a picture, a question, the right answer
    (chosen) and the same colour with another shape (rejected)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        shape, colour = rng.choice(SHAPES), rng.choice(COLOURS)
        other = rng.choice([s for s in SHAPES if s != shape])
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": rng.choice(QUESTIONS)}]}]
        rows.append({"images": [draw(shape, colour, rng=rng)], "prompt": prompt,
                     "chosen": [{"role": "assistant", "content": [{"type": "text", "text": f"a {colour} {shape} ."}]}],
                     "rejected": [{"role": "assistant",
                                   "content": [{"type": "text", "text": f"a {colour} {other} ."}]}]})
    return Dataset.from_list(rows)


@pytest.fixture(scope="module")
def setup():
    proc = vision_processor()
    return proc, tiny_qwen2_vl(proc), vision_pairs(8, seed=3)


def _run_trl(model, ds, args, proc):
    import trl

    return train_trl(trl.DPOTrainer(model=copy.deepcopy(model), ref_model=copy.deepcopy(model), args=args,
                                    train_dataset=ds, processing_class=copy.deepcopy(proc)), KEYS)


def _run_mt(model, ds, args, proc, **engine):
    import megatrain_nb as mt

    trainer = mt.DPOTrainer(model=copy.deepcopy(model), args=args, train_dataset=ds,
                            processing_class=copy.deepcopy(proc), device="cpu", **engine)
    return (*train_mt(trainer, KEYS), trainer)


@pytest.mark.slow
@pytest.mark.parametrize("accumulation,frozen", [(1, False), (2, False), (1, True)])
def test_losses_metrics_and_weights_match_trl(setup, tmp_path, accumulation, frozen):
    """Three steps (sigmoid DPO, weight decay): the batches (tokens, pixels, grids, M-RoPE's token
    types) are TRL's, every logged loss and metric within 1e-5, the weights to round-off; the vision
    tower trained (each of its weights moves) or frozen by name (bit-identical in both trainers)."""
    proc, model, ds = setup
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trl_model = copy.deepcopy(model)
    if frozen:
        for n, p in trl_model.named_parameters():
            p.requires_grad_(n not in tower_names(model))
    kw = dict(max_length=None, max_steps=3, gradient_accumulation_steps=accumulation, weight_decay=0.01)
    trl_seen, trl_logs, trl_w = _run_trl(trl_model, ds, dpo_config(tmp_path / "trl", **kw), proc)
    engine = dict(frozen=("vision_tower",)) if frozen else {}
    mt_seen, mt_logs, mt_w, trainer = _run_mt(model, ds, dpo_config(tmp_path / "mt", **kw), proc, **engine)
    assert len(mt_seen) == len(trl_seen) == 3 * accumulation
    for a, b in zip(trl_seen, mt_seen):
        assert set(a) == set(b) >= {"pixel_values", "image_grid_thw", "mm_token_type_ids"}
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert len(mt_logs) == len(trl_logs) == 3
    for t, m in zip(trl_logs, mt_logs):
        for k in METRICS:
            assert m[k] == pytest.approx(t[k], rel=1e-5, abs=1e-6), (k, m[k], t[k])
    check_weights(mt_w, trl_w, start, tower_names(model), frozen)
    trainer.close()


def _hf_logps(model, proc, ds):
    """Each pair's (chosen, rejected) completion log-prob sums by the HF model's own forward over
    TRL's collation of the pairs, with their pictures."""
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    batch = DataCollatorForVisionPreference(processor=proc)([dict(r) for r in ds])
    cm = batch.pop("completion_mask")
    with torch.no_grad():
        logits = model(**batch).logits[:, :-1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return (lp * cm[:, 1:]).sum(1).chunk(2)


def test_the_reference_log_probs_are_the_models_own_with_the_pictures(setup, tmp_path):
    """The pass ahead (two pairs a batch) gives the HF model's log-probs of the whole set collated
    at once, within 1e-5; other pictures give other values (they reached the model); a second
    trainer on the same pairs reads them from the cache, one with other pictures computes them."""
    import megatrain_nb as mt

    proc, model, ds = setup
    chosen, rejected = _hf_logps(model, copy.deepcopy(proc), ds)
    args = dpo_config(tmp_path, max_length=None, max_steps=1)
    trainer = mt.DPOTrainer(model=copy.deepcopy(model), args=args, train_dataset=ds,
                            processing_class=copy.deepcopy(proc), device="cpu")
    trainer._ensure_reference()
    got = trainer.train_dataset
    assert torch.allclose(torch.tensor(got["ref_chosen_logps"]), chosen, rtol=1e-5, atol=1e-5)
    assert torch.allclose(torch.tensor(got["ref_rejected_logps"]), rejected, rtol=1e-5, atol=1e-5)
    assert trainer.reference_seconds["train"] > 0
    trainer.close()
    again = mt.DPOTrainer(model=copy.deepcopy(model), args=args, train_dataset=ds,
                          processing_class=copy.deepcopy(proc), device="cpu")
    again._ensure_reference()
    assert again.reference_seconds["train"] == 0.0
    assert again.train_dataset["ref_chosen_logps"] == got["ref_chosen_logps"]
    again.close()
    other = mt.DPOTrainer(model=copy.deepcopy(model), args=args, train_dataset=flipped(ds),
                          processing_class=copy.deepcopy(proc), device="cpu")
    other._ensure_reference()
    assert other.reference_seconds["train"] > 0
    assert max(abs(a - b) for a, b in zip(other.train_dataset["ref_chosen_logps"], got["ref_chosen_logps"])) > 1e-4
    other.close()


@pytest.mark.slow
def test_the_comparison_can_fail(setup, tmp_path):
    """Other pictures (the same questions and answers) train to other weights."""
    proc, model, ds = setup
    assert apart_with_other_pictures(_run_trl, _run_mt, model, ds, proc, dpo_config, tmp_path) > 1e-3


def _refused(setup, tmp_path, ds=None, *, proc=None, model=None, match, error=(ValueError, DataError), **args):
    import megatrain_nb as mt

    p, m, d = setup
    with pytest.raises(error, match=match):
        trainer = mt.DPOTrainer(model=copy.deepcopy(model if model is not None else m),
                                args=dpo_config(tmp_path, **{"max_length": None, **args}),
                                train_dataset=d if ds is None else ds,
                                processing_class=copy.deepcopy(proc if proc is not None else p), device="cpu")
        trainer.train()


def test_bad_vision_pairs_are_refused_by_name(setup, tmp_path):
    proc, model, ds = setup
    rows = [dict(r) for r in ds]
    _refused(setup, tmp_path, proc=proc.tokenizer, match="processing_class is not a processor")
    _refused(setup, tmp_path, match="keep_end", max_length=64, truncation_mode="keep_end")
    no_prompt = [{k: v for k, v in r.items() if k != "prompt"} for r in rows]
    _refused(setup, tmp_path, Dataset.from_list(no_prompt), match=r"train_dataset\[0\].*explicit 'prompt'")
    two = [dict(r) for r in rows]
    two[3] = {**two[3], "images": two[3]["images"] * 2}
    _refused(setup, tmp_path, Dataset.from_list(two), match=r"train_dataset\[3\].*1 image placeholder.*2 image")
    _refused(setup, tmp_path, match=r"train_dataset\[\d\] \(chosen\) has \d+ tokens, 16 of them its images'.*"
             "never truncated", max_length=12)


def test_a_text_model_with_vision_pairs_is_refused(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatrain_nb.model_configs import family_config

    text = AutoModelForCausalLM.from_config(family_config("llama", layers=1, vocab=len(setup[0].tokenizer)))
    _refused(setup, tmp_path, model=text, match="not a vision-language model")


@pytest.mark.slow
def test_text_past_max_length_is_cut_as_trl_cuts_it(setup, tmp_path):
    """max_length inside the answers (after the images): the batches and the losses are TRL's."""
    proc, model, ds = setup
    kw = dict(max_length=28, max_steps=2)
    trl_seen, trl_logs, _ = _run_trl(model, ds, dpo_config(tmp_path / "trl", **kw), proc)
    mt_seen, mt_logs, _, trainer = _run_mt(model, ds, dpo_config(tmp_path / "mt", **kw), proc)
    assert trl_seen[0]["input_ids"].shape[1] == 28
    assert all(torch.equal(a[k], b[k]) for a, b in zip(trl_seen, mt_seen) for k in a)
    assert [m["loss"] for m in mt_logs] == pytest.approx([t["loss"] for t in trl_logs], rel=1e-5)
    trainer.close()


@pytest.mark.slow
def test_evaluation_with_images_matches_trl_and_save_model_writes_the_processor(setup, tmp_path):
    """evaluate() over vision pairs before training: eval_loss and the rewards/logps metrics are
    TRL's (its reference model beside each batch; ours computed ahead); save_model() writes a folder
    the processor and AutoModelForImageTextToText load, with the engine's weights."""
    import trl
    from transformers import AutoModelForImageTextToText

    import megatrain_nb as mt
    from megatrain_nb.assets.vision import ImageOnlyQwen2VLProcessor

    proc, model, ds = setup
    evalset = vision_pairs(6, seed=11)
    kw = dict(max_length=None, max_steps=1, per_device_eval_batch_size=3)
    theirs = trl.DPOTrainer(model=copy.deepcopy(model), ref_model=copy.deepcopy(model),
                            args=dpo_config(tmp_path / "trl", **kw), train_dataset=ds, eval_dataset=evalset,
                            processing_class=copy.deepcopy(proc)).evaluate()
    trainer = mt.DPOTrainer(model=copy.deepcopy(model), args=dpo_config(tmp_path / "mt", **kw), train_dataset=ds,
                            eval_dataset=evalset, processing_class=copy.deepcopy(proc), device="cpu")
    ours = trainer.evaluate()
    for k in ("eval_loss", "eval_logps/chosen", "eval_logps/rejected", "eval_rewards/margins"):
        assert ours[k] == pytest.approx(theirs[k], rel=1e-5, abs=1e-6), k
    folder = trainer.save_model(str(tmp_path / "saved"))
    again = ImageOnlyQwen2VLProcessor.from_pretrained(folder)
    assert again.tokenizer.get_vocab() == proc.tokenizer.get_vocab()
    assert again.image_processor.to_dict() == proc.image_processor.to_dict()
    loaded = dict(AutoModelForImageTextToText.from_pretrained(folder).named_parameters())
    assert all(torch.equal(loaded[n], w) for n, w in trainer.engine.named_parameters())
    trainer.close()


def test_the_engine_is_planned_at_the_pairs_image_tokens(setup, tmp_path):
    """The engine is built before the pairs are collated: its workload counts the rows' image tokens
    (the prompt's images, by the processor's own image processor: patches over the 2x2 merge) and
    their length (TRL's preference collator's chosen and rejected rows), not a text-only default."""
    import megatrain_nb as mt
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    from megatrain_nb.trainer.sft_vision import PLAN_ROWS

    proc, model, ds = setup
    rows = [dict(ds[i]) for i in range(min(PLAN_ROWS, len(ds)))]
    grids = [proc.image_processor(images=r["images"], return_tensors="pt")["image_grid_thw"] for r in rows]
    images = max(int(g.prod(-1).sum()) // 4 for g in grids)
    out = DataCollatorForVisionPreference(processor=proc, max_length=None)([dict(r) for r in rows])
    trainer = mt.DPOTrainer(model=copy.deepcopy(model), args=dpo_config(tmp_path, max_steps=1), train_dataset=ds,
                            processing_class=copy.deepcopy(proc), device="cpu")
    work = trainer.engine.workload
    assert images > 0
    assert (work.image_tokens, work.seq) == (images, int(out["attention_mask"].sum(dim=1).max()))
    trainer.close()

"""mt.SFTTrainer on TRL's vision data (trainer/sft_vision.py): a tiny Qwen2-VL built from a config
with Qwen2-VL's own processor built offline (megatrain_nb/assets/vision.py); the same batches
(tokens, labels, pixels, grids) reach the model as under trl.SFTTrainer, the losses agree to 1e-5
and the weights to round-off, with the vision tower trained and frozen; rows that cannot train
as given are refused by name."""
import copy

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("PIL")

from datasets import Dataset  # noqa: E402

from megatrain_nb.assets.vision import draw, shapes_dataset, tiny_qwen2_vl, vision_processor  # noqa: E402
from megatrain_nb.trainer.data import DataError  # noqa: E402

from .sft_helpers import sft_config  # noqa: E402
from .vision_helpers import (apart_with_other_pictures, check_weights, flipped, tower_names,  # noqa: E402
                             train_mt, train_trl)

KEYS = ("input_ids", "attention_mask", "labels", "pixel_values", "image_grid_thw", "mm_token_type_ids")


def _run_trl(model, ds, args, proc):
    import trl

    trainer = trl.SFTTrainer(model=copy.deepcopy(model), args=args, train_dataset=ds,
                             processing_class=copy.deepcopy(proc))
    seen, logs, weights = train_trl(trainer, KEYS)
    return seen, [r["loss"] for r in logs], weights


def _run_mt(model, ds, args, proc, **engine):
    import megatrain_nb as mt

    trainer = mt.SFTTrainer(model=copy.deepcopy(model), args=args, train_dataset=ds,
                            processing_class=copy.deepcopy(proc), device="cpu", **engine)
    seen, logs, weights = train_mt(trainer, KEYS)
    return seen, [r["loss"] for r in logs], weights, trainer


@pytest.fixture(scope="module")
def setup():
    proc = vision_processor()
    return proc, tiny_qwen2_vl(proc), shapes_dataset(12, seed=3)


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_losses_and_weights_match_trl(setup, tmp_path, frozen, accumulation):
    """The vision tower trained (every one of its weights moves) or frozen (bit-identical, in
    both trainers); the batches, the per-step losses (1e-5) and the weights (round-off) are TRL's."""
    proc, model, ds = setup
    if frozen:   # TRL trains what requires a gradient; mt freezes by the part's name
        model = copy.deepcopy(model)
        for n, p in model.named_parameters():
            p.requires_grad_(n not in tower_names(model))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    kw = dict(max_length=None, assistant_only_loss=True, max_steps=3, gradient_accumulation_steps=accumulation,
              weight_decay=0.01)
    trl_seen, trl_losses, trl_w = _run_trl(model, ds, sft_config(tmp_path / "trl", **kw), proc)
    mt_model = model
    if frozen:
        mt_model = copy.deepcopy(model)
        for p in mt_model.parameters():
            p.requires_grad_(True)
    engine = dict(frozen=("vision_tower",)) if frozen else {}
    mt_seen, mt_losses, mt_w, trainer = _run_mt(mt_model, ds, sft_config(tmp_path / "mt", **kw), proc, **engine)
    assert len(mt_seen) == len(trl_seen) == 3 * accumulation
    for a, b in zip(trl_seen, mt_seen):
        assert set(a) == set(b) >= {"pixel_values", "image_grid_thw"}
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert len(mt_losses) == len(trl_losses) == 3
    assert all(abs(m - t) <= 1e-5 * abs(t) for m, t in zip(mt_losses, trl_losses)), (mt_losses, trl_losses)
    check_weights(mt_w, trl_w, start, tower_names(model), frozen)
    merger = [n for n in mt_w if ".merger." in n]
    assert all(not torch.equal(mt_w[n], start[n]) for n in merger)
    trainer.close()


@pytest.mark.slow
def test_the_comparison_can_fail(setup, tmp_path):
    """Other pictures (the same questions and answers) train to other weights."""
    proc, model, ds = setup
    assert apart_with_other_pictures(_run_trl, _run_mt, model, ds, proc, sft_config, tmp_path) > 1e-3


def _trainer(setup, tmp_path, rows=None, frozen=(), **kw):
    import megatrain_nb as mt

    proc, model, ds = setup
    args = sft_config(tmp_path, **{"max_length": None, "max_steps": 1, **kw})
    return mt.SFTTrainer(model=copy.deepcopy(model), args=args, train_dataset=rows if rows is not None else ds,
                         processing_class=copy.deepcopy(proc), device="cpu", frozen=frozen)


def test_a_row_whose_images_pass_max_length_is_refused_by_name(setup, tmp_path):
    """A row's 16 image tokens sit at positions 2-17: max_length=12 would cut them; refused
    naming the row, before the model sees it (TRL's processor would raise naming no row)."""
    trainer = _trainer(setup, tmp_path, max_length=12)
    batch = [trainer.train_dataset[i] for i in (4, 5)]
    with pytest.raises(DataError, match=r"train_dataset\[4\] has \d+ tokens, 16 of them its images'.*"
                                        r"max_length=12.*never truncated.*max_length.*None"):
        trainer.data_collator(batch)
    trainer.close()


def test_a_row_long_by_its_text_only_is_cut_as_trl_cuts_it_and_counted(setup, tmp_path):
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    proc, _, ds = setup
    trainer = _trainer(setup, tmp_path, max_length=24)
    rows = [trainer.train_dataset[i] for i in range(4)]
    with pytest.warns(UserWarning, match=r"train_dataset\[0\] has \d+ tokens, more than max_length=24"):
        mine = trainer.data_collator(rows)
    theirs = DataCollatorForVisionLanguageModeling(processor=proc, max_length=24)([dict(ds[i]) for i in range(4)])
    assert mine["input_ids"].shape[1] == 24
    assert torch.equal(mine["input_ids"], theirs["input_ids"]) and torch.equal(mine["labels"], theirs["labels"])
    assert torch.equal(mine["extra_inputs"]["pixel_values"], theirs["pixel_values"])
    report = trainer.prep_reports[0]
    assert report.truncated == 4 and report.examples == 4 and report.tokens_dropped > 0
    trainer.close()


def _row(n_images=1, placeholders=1, part="image"):
    content = [{"type": part} for _ in range(placeholders)] + [{"type": "text", "text": "What do you see ?"}]
    return {"images": [draw("circle", "red") for _ in range(n_images)],
            "messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": [{"type": "text", "text": "a red circle ."}]}]}


@pytest.mark.parametrize("bad,match", [
    (dict(n_images=2), r"train_dataset\[1\]: its messages hold 1 image placeholder\(s\).*for 2 image\(s\)"),
    (dict(placeholders=0), r"train_dataset\[1\]: its messages hold 0 image placeholder"),
    (dict(part="video"), r"train_dataset\[1\]: message 0 has a content part.*'video'")])
def test_bad_rows_are_refused_by_name(setup, tmp_path, bad, match):
    with pytest.raises(DataError, match=match):
        _trainer(setup, tmp_path, rows=[_row(), _row(**bad)])


def test_a_tokenizer_or_a_text_model_with_images_is_refused(setup, tmp_path):
    import megatrain_nb as mt
    from transformers import AutoModelForCausalLM

    from megatrain_nb.model_configs import family_config

    proc, model, ds = setup
    with pytest.raises(ValueError, match="has images.*processing_class is a tokenizer.*AutoProcessor"):
        mt.SFTTrainer(model=copy.deepcopy(model), args=sft_config(tmp_path, max_length=None), train_dataset=ds,
                      processing_class=proc.tokenizer, device="cpu")
    text_model = AutoModelForCausalLM.from_config(family_config("llama", layers=1, vocab=len(proc.tokenizer)))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*not a vision-language model"):
        mt.SFTTrainer(model=text_model, args=sft_config(tmp_path, max_length=None), train_dataset=ds,
                      processing_class=proc, device="cpu")


@pytest.mark.parametrize("kw,match", [(dict(packing=True), "Packing is not supported for vision datasets"),
                                      (dict(padding_free=True), "Padding-free training is yet not supported"),
                                      (dict(max_length=64, truncation_mode="keep_end"), "keep_end.*not supported")])
def test_settings_trl_refuses_for_vision_are_refused(setup, tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _trainer(setup, tmp_path, **kw)


def test_rows_without_a_placeholder_get_their_images_before_the_first_user_turn(setup, tmp_path):
    """Plain-text messages with an images column: TRL puts the images before the first user
    turn; the batch holds the image tokens and the pixels."""
    rows = [{"images": [draw("square", "blue")], "messages": [{"role": "user", "content": "What do you see ?"},
                                                               {"role": "assistant", "content": "a blue square ."}]}]
    trainer = _trainer(setup, tmp_path, rows=Dataset.from_list(rows * 2))
    batch = trainer.data_collator([trainer.train_dataset[0]])
    image = trainer.processor.image_token_id
    assert int((batch["input_ids"] == image).sum()) == 16
    assert batch["extra_inputs"]["image_grid_thw"].tolist() == [[1, 8, 8]]
    trainer.close()


@pytest.mark.slow
def test_a_frozen_part_takes_no_adamw_state_and_no_gradient(setup, tmp_path):
    """frozen=("vision_tower",) (an EngineConfig field given to the trainer): the tower's elements
    leave the embed unit's gradient and its AdamW states (8 bytes each: m and v in fp32)."""
    proc, model, ds = setup
    tower = sum(p.numel() for n, p in model.named_parameters() if n in tower_names(model))
    whole = _trainer(setup, tmp_path / "whole")
    frozen = _trainer(setup, tmp_path / "frozen", frozen=("vision_tower",))
    for t in (whole, frozen):
        t.train()
        dict(t.engine.named_parameters())   # (the last step's updates done: every unit's states made)
    embed = frozen.engine.units[0]
    assert embed.numel - embed.train_numel == tower
    assert frozen.engine.store.grad(embed).numel() == embed.train_numel
    states = [t.engine.memory_report()["host"]["optimizer_states"] for t in (whole, frozen)]
    assert states[0] - states[1] == 8 * tower
    whole.close()
    frozen.close()


@pytest.mark.slow
def test_two_stage_recipe_projector_then_everything(setup, tmp_path):
    """Stage 1 trains the projector alone (the vision tower and the language model frozen by name);
    its saved folder (the model and the processor) starts stage 2, where everything trains."""
    from transformers import AutoModelForImageTextToText

    import megatrain_nb as mt
    from megatrain_nb.assets.vision import ImageOnlyQwen2VLProcessor

    proc, model, ds = setup
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    one = _trainer(setup, tmp_path / "one", max_steps=2, frozen=("vision_tower", "language_model"))
    one.train()
    moved = sorted(n for n, w in one.engine.named_parameters() if not torch.equal(w, start[n]))
    assert moved == sorted(n for n in start if ".merger." in n)
    folder = one.save_model(str(tmp_path / "stage1"))
    one.close()
    loaded = AutoModelForImageTextToText.from_pretrained(folder)
    processor = ImageOnlyQwen2VLProcessor.from_pretrained(folder)
    assert processor.tokenizer.get_vocab() == proc.tokenizer.get_vocab()
    two = mt.SFTTrainer(model=loaded, args=sft_config(tmp_path / "two", max_length=None, max_steps=1),
                        train_dataset=ds, processing_class=processor, device="cpu")
    two.train()
    after = dict(two.engine.named_parameters())
    assert all(not torch.equal(after[n], start[n]) for n in start if "embed_tokens" not in n and "lm_head" not in n)
    two.close()


def test_the_trained_on_view_of_a_vision_row(setup, tmp_path):
    """The masking check on a vision row: its image tokens and the question are not in the loss,
    the answer and its end are."""
    from megatrain_nb.trainer.sft_view import trained_on_view

    trainer = _trainer(setup, tmp_path, assistant_only_loss=True)
    view = trained_on_view(trainer, 0)
    assert view.tokens.count("<|image_pad|>") == 16
    answer = trainer.train_dataset[0]["messages"][1]["content"][0]["text"].split() + ["<|end|>"]
    assert [t for t, c in zip(view.tokens, view.counted) if c] == answer
    trainer.close()


def test_evaluation_takes_the_images(setup, tmp_path):
    """eval_loss over a vision eval set is the model's own token-weighted loss with the pictures;
    other pictures give another loss (the images reach the model)."""
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    proc, model, ds = setup
    evalset = shapes_dataset(6, seed=5)
    trainer = _trainer(setup, tmp_path, per_device_eval_batch_size=4)
    collate = DataCollatorForVisionLanguageModeling(processor=proc)
    total = tokens = 0.0
    for rows in ([evalset[i] for i in range(4)], [evalset[i] for i in range(4, 6)]):
        batch = collate(rows)
        n = int((batch["labels"][:, 1:] != -100).sum())
        with torch.no_grad():
            total += float(copy.deepcopy(model)(**batch).loss) * n
        tokens += n
    assert trainer.evaluate(evalset)["eval_loss"] == pytest.approx(total / tokens, rel=1e-5)
    assert abs(trainer.evaluate(flipped(evalset))["eval_loss"] - total / tokens) > 1e-4
    trainer.close()


@pytest.mark.slow
def test_resume_from_a_checkpoint_is_exact(setup, tmp_path):
    """4 steps straight = 2 steps, a checkpoint, and 2 more resumed from it (weights bit for bit);
    an iterable vision dataset trains too."""
    import os

    proc, model, ds = setup
    straight = _trainer(setup, tmp_path / "a", max_steps=4)
    straight.train()
    want = dict(straight.engine.named_parameters())
    straight.close()
    first = _trainer(setup, tmp_path / "b", max_steps=4, save_strategy="steps", save_steps=2)
    first.train()
    first.close()
    again = _trainer(setup, tmp_path / "b", max_steps=4)
    again.train(resume_from_checkpoint=os.path.join(tmp_path / "b", "checkpoint-2"))
    assert all(torch.equal(w, want[n]) for n, w in again.engine.named_parameters())
    again.close()
    streamed = _trainer(setup, tmp_path / "c", rows=ds.to_iterable_dataset(), max_steps=2)
    streamed.train()
    assert len([r for r in streamed.state.log_history if "loss" in r]) == 2
    streamed.close()


def test_the_engine_is_planned_at_the_rows_image_tokens(setup, tmp_path):
    """The engine is built (and planned) before the data is prepared: its workload counts the rows'
    image tokens (each row's images' patches over the 2x2 merge, by the processor's own image
    processor) and their length (TRL's collator's rows), not a text-only default."""
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from megatrain_nb.trainer.sft_vision import PLAN_ROWS

    proc, _, ds = setup
    rows = [ds[i] for i in range(PLAN_ROWS)]
    grids = [proc.image_processor(images=r["images"], return_tensors="pt")["image_grid_thw"] for r in rows]
    images = max(int(g.prod(-1).sum()) // 4 for g in grids)
    out = DataCollatorForVisionLanguageModeling(processor=proc, max_length=None)([dict(r) for r in rows])
    trainer = _trainer(setup, tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3)
    work = trainer.engine.workload
    assert images > 0
    assert (work.image_tokens, work.seq) == (images, int(out["attention_mask"].sum(dim=1).max()))
    assert (work.batch, work.accumulation) == (2, 3)
    trainer.close()

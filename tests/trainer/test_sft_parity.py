"""mt.SFTTrainer against trl.SFTTrainer: the same tokens, labels, masks and position ids reach
the model, and the weights after a few fp32 CPU steps agree to round-off."""
import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.slow   # ~20 s each: two trainers per case

from datasets import Dataset  # noqa: E402

from megatrain_nb.assets import as_format  # noqa: E402

from .sft_helpers import (CONVS, assert_same_batches, max_rel_diff, run_mt, run_trl, sft_config,  # noqa: E402
                          tiny_llama, tokenizer)

CASES = {
    "conversational_assistant_only": (dict(assistant_only_loss=True), "messages"),
    "prompt_completion": (dict(), "prompt_completion"),
    "packed_conversational": (dict(packing=True, max_length=96, assistant_only_loss=True), "messages"),
    "alpaca": (dict(), "alpaca"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("accumulation", [1, 3])
def test_batches_and_weights_match_trl(tmp_path, case, accumulation):
    kw, fmt = CASES[case]
    tok = tokenizer()
    rows = [as_format(c, fmt) for c in CONVS[:24]]
    if fmt == "alpaca":   # TRL reads alpaca only once converted; mt.SFTTrainer converts it itself
        from megatrain_nb.trainer.sft_data import to_trl_rows
        trl_rows = to_trl_rows(rows, "alpaca", "train_dataset")
    else:
        trl_rows = rows
    model = tiny_llama(len(tok))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = dict(kw, gradient_accumulation_steps=accumulation, max_steps=3)
    trl_seen, trl_w, _ = run_trl(model, Dataset.from_list(trl_rows), sft_config(tmp_path / "trl", **args), tok)
    mt_seen, mt_w, trainer = run_mt(model, Dataset.from_list(rows), sft_config(tmp_path / "mt", **args), tok)
    assert_same_batches(trl_seen, mt_seen)
    if kw.get("packing"):
        assert all(b["input_ids"].shape[0] == 1 and "position_ids" in b and "attention_mask" not in b for b in mt_seen)
        assert any(int((b["position_ids"] == 0).sum()) > 1 for b in mt_seen)   # rows hold several documents
    if kw.get("assistant_only_loss") or fmt in ("prompt_completion", "alpaca"):
        assert all(bool((b["labels"] == -100).any()) for b in mt_seen)   # the prompt is not trained on
    diff = max_rel_diff(mt_w, trl_w, start)
    assert diff < 1e-4, diff
    trainer.close()


def test_weight_comparison_can_fail(tmp_path):
    """The same run with the loss on every token differs from TRL's assistant-only run."""
    tok = tokenizer()
    rows = [as_format(c, "messages") for c in CONVS[:12]]
    model = tiny_llama(len(tok))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, trl_w, _ = run_trl(model, Dataset.from_list(rows), sft_config(tmp_path / "t", assistant_only_loss=True,
                                                                     max_steps=2), tok)
    seen, mt_w, trainer = run_mt(model, Dataset.from_list(rows), sft_config(tmp_path / "m", max_steps=2), tok)
    assert max_rel_diff(mt_w, trl_w, start) > 1e-2
    trainer.close()


def test_dft_loss_matches_trl(tmp_path):
    """loss_type='dft' (the engine's loss_fn hook) trains as TRL's DFT loss does."""
    tok = tokenizer()
    rows = [as_format(c, "prompt_completion") for c in CONVS[:16]]
    model = tiny_llama(len(tok))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = dict(loss_type="dft", gradient_accumulation_steps=2, max_steps=2)
    trl_seen, trl_w, _ = run_trl(model, Dataset.from_list(rows), sft_config(tmp_path / "trl", **args), tok)
    mt_seen, mt_w, trainer = run_mt(model, Dataset.from_list(rows), sft_config(tmp_path / "mt", **args), tok)
    assert_same_batches(trl_seen, mt_seen)
    assert max_rel_diff(mt_w, trl_w, start) < 1e-4
    trainer.close()

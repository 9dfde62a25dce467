"""A GRPO step whose completions are all truncated, with ``mask_truncated_completions=True``: no
completion token is trained on, and the step is TRL's zero-gradient step (not the loop's "no
target tokens" error): the same logs as trl.GRPOTrainer, the weights unchanged."""
import pytest

trl = pytest.importorskip("trl")

from .test_grpo_parity import NOT_COMPARED, reward_yes, run_mt, run_trl, tiny_model, tokenizer  # noqa: E402


@pytest.mark.slow
def test_all_truncated_completions_masked_take_trls_zero_gradient_step(tmp_path):
    tok = tokenizer()
    model = tiny_model(tok)
    # the end-of-sequence token suppressed: every completion runs to max_completion_length (truncated)
    kw = dict(mask_truncated_completions=True, generation_kwargs={"suppress_tokens": [tok.eos_token_id]},
              max_steps=2)
    ours = run_mt(tmp_path, model, tok, [reward_yes], **kw)
    assert [r["completions/clipped_ratio"] for r in ours[1]] == [1.0, 1.0]
    assert [r["loss"] for r in ours[1]] == [0.0, 0.0] and [r["grad_norm"] for r in ours[1]] == [0.0, 0.0]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(float((ours[2][n] - w).abs().max()) == 0.0 for n, w in start.items())
    theirs = run_trl(tmp_path, model, tok, [reward_yes], **kw)
    assert theirs[0] == ours[0]   # the same completions
    for a, b in zip(theirs[1], ours[1], strict=True):   # every logged value, None where TRL's is
        for k in (k for k in a if k not in NOT_COMPARED):
            assert (b[k] is None) if a[k] is None else b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (k, a[k], b[k])
    assert all(float((theirs[2][n].detach() - w).abs().max()) == 0.0 for n, w in start.items())

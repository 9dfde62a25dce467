"""GRPOObjective against trl.GRPOTrainer._compute_loss itself: every loss type, beta 0 and 0.04,
num_iterations 1 (old log-probs = the current ones) and 2 (other old log-probs: ratio != 1,
clipping active), on random logits (the head's two passes emulated chunk by chunk) and on a tiny
llama's real logits (the engine's gradients against TRL's loss on the plain HF model)."""
import copy
import types
from collections import defaultdict

import pytest
import torch

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.compute.loss_head import LossHead
from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config
from megatrain_nb.trainer.grpo_loss import LOSS_TYPES, GRPOObjective, GRPOSettings, RolloutBatch, to_shift

trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import entropy_from_logits, selective_log_softmax  # noqa: E402

MAX_COMPLETION = 12
CHUNK = 5


def _settings(loss_type, beta, **kw):
    return GRPOSettings(loss_type=loss_type, beta=beta, max_completion_length=MAX_COMPLETION, **kw)


def _fake_trl(s: GRPOSettings, logps_fn, accumulation=1):
    """A stand-in ``self`` for TRL's _compute_loss: its fields, one process, train mode."""
    args = types.SimpleNamespace(use_bias_correction_kl=s.use_bias_correction_kl, delta=s.delta,
                                 sapo_temperature_pos=s.sapo_temperature_pos,
                                 sapo_temperature_neg=s.sapo_temperature_neg, vespo_k_pos=s.vespo_k_pos,
                                 vespo_lambda_pos=s.vespo_lambda_pos, vespo_k_neg=s.vespo_k_neg,
                                 vespo_lambda_neg=s.vespo_lambda_neg, steps_per_generation=s.steps_per_generation)
    acc = types.SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                reduce=lambda x, reduction="sum": x)
    return types.SimpleNamespace(
        _get_per_token_logps_and_entropies=logps_fn, top_entropy_quantile=1.0,
        off_policy_mask_threshold=s.off_policy_mask_threshold, importance_sampling_level=s.importance_sampling_level,
        beta=s.beta, args=args, loss_type=s.loss_type, epsilon_low=s.eps_low, epsilon_high=s.eps_high,
        use_vllm=False, vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation, max_completion_length=s.max_completion_length,
        accelerator=acc, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)), get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=GRPOTrainer.get_gamma_weights)


def _rollouts(seed, B=4, P=5, C=MAX_COMPLETION, iterations=1, beta=0.0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB, (B, P), generator=g)
    pmask = torch.ones(B, P, dtype=torch.long)
    pmask[1, :2] = 0                                   # left-padded prompts, as TRL's
    comp = torch.randint(3, VOCAB, (B, C), generator=g)
    cmask = torch.ones(B, C, dtype=torch.long)
    for r, end in enumerate((C, C - 3, 4, C - 7)[:B]):
        cmask[r, end:] = 0
    adv = torch.randn(B, generator=g)
    adv[2] = -adv[2].abs()
    inputs = {"prompt_ids": prompt, "prompt_mask": pmask, "completion_ids": comp, "completion_mask": cmask,
              "advantages": adv, "num_items_in_batch": cmask.sum().float() * 3}   # the generation batch's
    return inputs, g


def _trl_loss(s, inputs, model=None, logits=None, accumulation=1):
    """TRL's loss and metrics; ``logits`` [B, C, V] (a leaf) or the model's own."""
    def logps_fn(m, input_ids, attention_mask, logits_to_keep, **kw):
        lg = logits if m is None else m(input_ids=input_ids, attention_mask=attention_mask).logits[:, -logits_to_keep - 1:-1]
        lg = lg.float() / s.temperature
        comp = input_ids[:, -logits_to_keep:]
        return selective_log_softmax(lg, comp), entropy_from_logits(lg), None

    fake = _fake_trl(s, logps_fn, accumulation)
    loss = GRPOTrainer._compute_loss(fake, model, inputs)
    return loss, {k: v[0] for k, v in fake._metrics["train"].items()}


def _side(inputs, s, shift=True, accumulation=1):
    P = inputs["prompt_ids"].shape[1] if shift else 1
    put = (lambda x: to_shift(x, P)) if shift else (lambda x: x)
    return RolloutBatch(advantages=inputs["advantages"], old_logps=put(inputs.get("old_per_token_logps")),
                        ref_logps=put(inputs.get("ref_per_token_logps")),
                        num_items=float(inputs["num_items_in_batch"]), accumulation=accumulation)


def _emulate_head(obj, logits, labels, chunk, data):
    """The chunked head's protocol (engine/compute/loss_head.py) over [B, C, V] logits with the
    micro-batch's side data: statistics without gradients, the loss's weights, then each chunk again
    with gradients. Returns the loss and the metrics."""
    ctx = obj.context(labels, data)
    sums = {}
    with torch.no_grad():
        for s in range(0, labels.shape[1], chunk):
            part = obj.token_stats(ctx, logits[:, s:s + chunk].float(), labels[:, s:s + chunk], s, grad=False)
            for k, v in part.items():
                sums[k] = sums[k] + v if k in sums else v
    weights, loss = LossHead._weights(obj, ctx, sums)
    metrics = obj.metrics(ctx, sums, loss)
    for s in range(0, labels.shape[1], chunk):
        part = obj.token_stats(ctx, logits[:, s:s + chunk].float(), labels[:, s:s + chunk], s, grad=True)
        sur = sum((w * part[k]).sum() for k, w in weights.items())
        if sur.requires_grad:
            sur.backward()
    return loss, metrics


def _with_old_and_ref(inputs, g, lp, iterations, beta):
    if iterations > 1:
        inputs["old_per_token_logps"] = lp + 0.3 * torch.randn(lp.shape, generator=g)
    if beta:
        inputs["ref_per_token_logps"] = lp + 0.2 * torch.randn(lp.shape, generator=g)


CASES = [(lt, beta, it) for lt in LOSS_TYPES for beta in (0.0, 0.04) for it in (1, 2)]


@pytest.mark.parametrize("loss_type,beta,iterations", CASES)
def test_loss_matches_trl_on_random_logits(loss_type, beta, iterations):
    s = _settings(loss_type, beta, temperature=0.7, epsilon_high=0.28 if loss_type != "cispo" else 4.0)
    inputs, g = _rollouts(7)
    B, C = inputs["completion_ids"].shape
    base = torch.randn(B, C, VOCAB, generator=g) * 2
    lp = selective_log_softmax(base / s.temperature, inputs["completion_ids"])
    _with_old_and_ref(inputs, g, lp, iterations, beta)
    ref_logits = base.clone().requires_grad_(True)
    ref_loss, ref_metrics = _trl_loss(s, inputs, logits=ref_logits, accumulation=2)
    ref_loss.backward()
    ours = base.clone().requires_grad_(True)
    labels = inputs["completion_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    obj = GRPOObjective(s)
    loss, metrics = _emulate_head(obj, ours, labels, chunk=CHUNK, data=_side(inputs, s, shift=False, accumulation=2))
    # vespo's weight exp(lambda + k log w - lambda w) of the sequence's summed log-ratio magnifies
    # the fp32 round-off of the log-softmax (TRL's selective_log_softmax vs log_softmax) ~10x;
    # cispo's loss sums -ratio * advantage * log-prob, terms ~10 that cancel to ~0.03: the fp32
    # round-off of summing them per sequence, then over sequences, is 1.3e-6 of the loss (measured
    # against TRL's in float64; in float64 the two losses agree to 5e-8)
    rel = 2e-5 if (loss_type == "vespo" and iterations == 2) else 5e-6 if loss_type == "cispo" else 1e-6
    assert loss == pytest.approx(float(ref_loss.detach()), rel=rel, abs=1e-9)
    assert torch.allclose(ours.grad, ref_logits.grad, rtol=10 * rel, atol=1e-8)
    assert set(metrics) == set(ref_metrics)
    for k, v in ref_metrics.items():
        assert metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7, nan_ok=True), k
    if iterations == 2 and loss_type in ("grpo", "dapo"):
        assert ref_metrics["clip_ratio/region_mean"] > 0   # the clipping is exercised


@pytest.mark.parametrize("level,extra", [("sequence", {}), ("token", {"delta": 1.1}),
                                         ("token", {"off_policy_mask_threshold": 0.05}),
                                         ("sequence", {"use_bias_correction_kl": False})])
def test_loss_variants_match_trl(level, extra):
    for loss_type in ("grpo", "dapo", "cispo", "sapo"):
        s = _settings(loss_type, 0.04, importance_sampling_level=level, **extra)
        inputs, g = _rollouts(11)
        B, C = inputs["completion_ids"].shape
        base = torch.randn(B, C, VOCAB, generator=g)
        lp = selective_log_softmax(base, inputs["completion_ids"])
        _with_old_and_ref(inputs, g, lp, 2, 0.04)
        ref_logits = base.clone().requires_grad_(True)
        ref_loss, _ = _trl_loss(s, inputs, logits=ref_logits)
        ref_loss.backward()
        ours = base.clone().requires_grad_(True)
        labels = inputs["completion_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        obj = GRPOObjective(s)
        loss, _ = _emulate_head(obj, ours, labels, chunk=4, data=_side(inputs, s, shift=False))
        assert loss == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-9), loss_type
        assert torch.allclose(ours.grad, ref_logits.grad, rtol=1e-5, atol=1e-8), loss_type


def _engine_grads(model, inputs, s, chunk, k=1):
    engine = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=k,
                                                  overrides={"loss_chunk_tokens": chunk}))
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    P = inputs["prompt_ids"].shape[1]
    labels = ids.masked_fill(am == 0, -100)
    labels[:, :P] = -100
    obj = GRPOObjective(s)
    before = copy.deepcopy(vars(obj))
    out = engine.forward_backward(ids, attention_mask=am, labels=labels, loss_fn=obj, objective_data=_side(inputs, s))
    assert vars(obj) == before   # the objective keeps nothing: its loss and metrics are in `out`
    grads = {n: g.clone() for n, g in engine.named_gradients()}
    engine.close()
    return out, grads


@pytest.mark.parametrize("loss_type,beta,iterations", [("dapo", 0.0, 1), ("grpo", 0.04, 1), ("grpo", 0.04, 2),
                                                       ("dr_grpo", 0.0, 2), ("bnpo", 0.04, 2), ("luspo", 0.0, 2),
                                                       ("cispo", 0.04, 2), ("sapo", 0.0, 2), ("vespo", 0.04, 2)])
def test_engine_gradients_match_trl_on_a_model(loss_type, beta, iterations):
    model = AutoModel(tie=False)
    s = _settings(loss_type, beta)
    inputs, g = _rollouts(5)
    with torch.no_grad():
        hf_lp, _, _ = _plain_logps(model, inputs)
    _with_old_and_ref(inputs, g, hf_lp, iterations, beta)
    hf = copy.deepcopy(model)
    ref_loss, ref_metrics = _trl_loss(s, inputs, model=hf)
    ref_loss.backward()
    out, grads = _engine_grads(model, inputs, s, chunk=7)
    assert out.objective_loss == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-8)
    worst = max(float((grads[n] - p.grad).norm() / (p.grad.norm() + 1e-12)) for n, p in hf.named_parameters())
    assert worst <= 1e-4
    assert out.objective_metrics[0]["entropy"] == pytest.approx(ref_metrics["entropy"], rel=1e-5)


def test_engine_gradients_catch_a_wrong_epsilon():
    """The comparison can fail: another epsilon clips other tokens, so other gradients."""
    model = AutoModel(tie=False)
    inputs, g = _rollouts(5)
    with torch.no_grad():
        hf_lp, _, _ = _plain_logps(model, inputs)
    _with_old_and_ref(inputs, g, hf_lp, 2, 0.0)
    hf = copy.deepcopy(model)
    _trl_loss(_settings("grpo", 0.0), inputs, model=hf)[0].backward()
    _, grads = _engine_grads(model, inputs, _settings("grpo", 0.0, epsilon=0.05), chunk=64)
    worst = max(float((grads[n] - p.grad).norm() / (p.grad.norm() + 1e-12)) for n, p in hf.named_parameters())
    assert worst > 1e-2


def AutoModel(tie=False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config("llama", tie=tie)).eval()


def _plain_logps(model, inputs):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    C = inputs["completion_ids"].shape[1]
    lg = model(input_ids=ids, attention_mask=am).logits[:, -C - 1:-1].float()
    return selective_log_softmax(lg, inputs["completion_ids"]), None, None


def test_unknown_loss_type_is_refused():
    with pytest.raises(ValueError, match="loss_type"):
        GRPOObjective(GRPOSettings(loss_type="ppo"))

"""The chunked head's sequence-level objective seam against plain Hugging Face autograd of the
same loss: DPO (a function of per-sequence log-prob sums) over pairs side by side in a batch."""
import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.compute.objective import TOKEN_NLL
from megatrain_nb.trainer.dpo_loss import DPOObjective, DPOSettings, PairBatch

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config

BETA = 0.1


def _pairs(seed: int = 3, pairs: int = 2, seq: int = 14):
    """Chosen rows then rejected rows; a prompt of 5 tokens, completions of varying length."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2 * pairs, seq), generator=g)
    am = torch.ones_like(ids)
    comp = torch.zeros_like(ids)
    for r in range(2 * pairs):
        end = seq - (r * 3) % 5
        am[r, end:] = 0
        comp[r, 5:end] = 1
    labels = ids.masked_fill(comp == 0, -100)
    ref = -torch.rand(2 * pairs, generator=g) * 40 - 20
    return ids, am, labels, comp, ref


def _hf_loss(model, ids, am, labels, ref, loss_type):
    logits = model(input_ids=ids, attention_mask=am).logits[:, :-1].float()
    lab = labels[:, 1:]
    lp = torch.log_softmax(logits, -1).gather(-1, lab.clamp(min=0)[..., None])[..., 0] * (lab != -100)
    logps = lp.sum(1)
    c, r = logps.chunk(2)
    rc, rr = ref.chunk(2)
    delta = (c - rc) - (r - rr)
    if loss_type == "sigmoid":
        return -F.logsigmoid(BETA * delta).mean()
    if loss_type == "hinge":
        return torch.relu(1 - BETA * delta).mean()
    return ((c - rc - 0.5 / BETA) ** 2 + (r - rr + 0.5 / BETA) ** 2).mean()   # sppo_hard


def _objective(loss_type, ref, comp, am):
    obj = DPOObjective(DPOSettings(beta=BETA, loss_type=[loss_type]))
    rc, rr = ref.chunk(2)
    return obj, PairBatch(rc, rr, comp.sum(1), int(am.sum()))


def _rel(engine, grads):
    worst = 0.0
    for name, g in engine.named_gradients():
        r = grads[name]
        worst = max(worst, float((g - r).norm() / (r.norm() + 1e-12)))
    return worst


@pytest.mark.parametrize("loss_type,k,chunk,tie", [("sigmoid", 1, 8, False), ("hinge", 0, 4096, True),
                                                  ("sppo_hard", 2, 5, False)])
def test_objective_gradients_match_hf_autograd(loss_type, k, chunk, tie):
    model = AutoModelForCausalLM.from_config(family_config("llama", tie=tie)).eval()
    ids, am, labels, comp, ref = _pairs()
    hf = copy.deepcopy(model)
    loss = _hf_loss(hf, ids, am, labels, ref, loss_type)
    loss.backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    engine = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=k,
                                                  overrides={"loss_chunk_tokens": chunk}))
    obj, side = _objective(loss_type, ref, comp, am)
    out = engine.forward_backward(ids, attention_mask=am, labels=labels, loss_fn=obj, objective_data=side)
    assert out.objective_loss == pytest.approx(float(loss.detach()), rel=1e-5)
    # EngineOutput.loss keeps its one meaning: the mean token loss, as the HF model computes it
    assert out.loss == pytest.approx(float(hf(input_ids=ids, attention_mask=am, labels=labels).loss.detach()), rel=1e-5)
    assert _rel(engine, grads) <= 1e-4
    engine.close()


def test_objective_window_sums_micro_batches():
    """Two micro-batches in one layer-major window: the gradient of the sum of their losses."""
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    batches = [_pairs(seed=s) for s in (3, 4)]
    hf = copy.deepcopy(model)
    total = sum(_hf_loss(hf, ids, am, lab, ref, "sigmoid") for ids, am, lab, _, ref in batches) / 2
    total.backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    engine = StreamingEngine(model, EngineConfig(device="cpu", overrides={"loss_chunk_tokens": 6}))
    obj = DPOObjective(DPOSettings(beta=BETA))
    out = engine.forward_backward(_window(batches, scale=0.5), loss_fn=obj)
    assert out.objective_loss == pytest.approx(float(total.detach()), rel=1e-5)
    assert len(out.objective_metrics) == 2
    assert _rel(engine, grads) <= 1e-4
    engine.close()


def _window(batches, scale=1.0):
    """The engine's window of ``_pairs`` micro-batches, each carrying its own PairBatch."""
    out = []
    for ids, am, lab, comp, ref in batches:
        side = _objective("sigmoid", ref, comp, am)[1]
        side.scale = scale
        out.append({"input_ids": ids, "attention_mask": am, "labels": lab, "objective_data": side})
    return out


def test_each_micro_batch_gets_its_own_side_data():
    """Three micro-batches whose reference log-probs differ, in two orders: each micro-batch's loss
    and metrics follow it (the permutation of one run's are the other's), the summed loss and the
    gradients are the same; and each equals that micro-batch run alone."""
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    batches = [_pairs(seed=s) for s in (3, 4, 5)]
    obj = DPOObjective(DPOSettings(beta=BETA))
    runs = {}
    for order in ((0, 1, 2), (2, 0, 1)):
        engine = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", overrides={"loss_chunk_tokens": 6}))
        out = engine.forward_backward(_window([batches[i] for i in order]), loss_fn=obj)
        runs[order] = (out, {n: g.clone() for n, g in engine.named_gradients()})
        if order[0] == 0:
            engine.close()
    (a, ga), (b, gb) = runs[(0, 1, 2)], runs[(2, 0, 1)]
    assert b.objective_metrics == [a.objective_metrics[i] for i in (2, 0, 1)]
    assert len({m["rewards/margins"] for m in a.objective_metrics}) == 3   # the side data differ
    assert b.objective_loss == pytest.approx(a.objective_loss, rel=1e-6)
    assert all(torch.allclose(ga[n], gb[n], rtol=1e-5, atol=1e-7) for n in ga)
    for i, (ids, am, lab, comp, ref) in enumerate(batches):   # (no step was taken: the same weights)
        alone = engine.evaluate(ids, attention_mask=am, labels=lab, loss_fn=obj,
                                objective_data=_objective("sigmoid", ref, comp, am)[1])
        assert alone.objective_metrics[0]["rewards/margins"] == pytest.approx(
            a.objective_metrics[i]["rewards/margins"], rel=1e-5)
    engine.close()


def test_an_objective_keeps_no_state_between_calls():
    """The objective's attributes are the same before and after training and evaluation calls, and
    the same micro-batch evaluated twice (with another one between) gives the same loss and metrics."""
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    batches = [_pairs(seed=s) for s in (3, 4)]
    obj = DPOObjective(DPOSettings(beta=BETA, loss_type=["sigmoid", "sft"], ld_alpha=0.5))
    before = copy.deepcopy(vars(obj))
    engine = StreamingEngine(model, EngineConfig(device="cpu", overrides={"loss_chunk_tokens": 6}))
    window = _window(batches)
    first = engine.evaluate(window[0], loss_fn=obj)
    engine.forward_backward(window, loss_fn=obj)
    engine.evaluate(window[1], loss_fn=obj)
    engine.zero_grad()
    again = engine.evaluate(window[0], loss_fn=obj)
    engine.close()
    assert vars(obj) == before
    assert again.objective_loss == first.objective_loss
    assert again.objective_metrics == first.objective_metrics


class _OwnNLL(DPOObjective):
    """DPO without the labels' NLL among its statistics: the head takes its own cross-entropy."""

    def token_stats(self, ctx, logits, labels, start, grad):
        out = super().token_stats(ctx, logits, labels, start, grad)
        out.pop(TOKEN_NLL, None)
        return out


@pytest.mark.parametrize("cls", [DPOObjective, _OwnNLL])
def test_loss_is_the_mean_token_loss_under_an_objective(cls):
    """EngineOutput.loss under a sequence objective is the HF model's mean token loss of the labels,
    whether the objective gives the NLL (TOKEN_NLL) or the head computes it; training and evaluation."""
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    ids, am, labels, comp, ref = _pairs()
    want = float(copy.deepcopy(model)(input_ids=ids, attention_mask=am, labels=labels).loss.detach())
    engine = StreamingEngine(model, EngineConfig(device="cpu", overrides={"loss_chunk_tokens": 12}))
    obj, side = cls(DPOSettings(beta=BETA)), _objective("sigmoid", ref, comp, am)[1]
    ev = engine.evaluate(ids, attention_mask=am, labels=labels, loss_fn=obj, objective_data=side)
    tr = engine.forward_backward(ids, attention_mask=am, labels=labels, loss_fn=obj, objective_data=side)
    engine.close()
    assert ev.loss == pytest.approx(want, rel=1e-5) and tr.loss == pytest.approx(want, rel=1e-5)
    assert tr.num_tokens == int((labels[:, 1:] != -100).sum())
    assert abs(tr.objective_loss - tr.loss) > 1e-3   # two different numbers


def test_side_data_is_required_and_only_with_an_objective():
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    ids, am, labels, comp, ref = _pairs()
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    obj, side = _objective("sigmoid", ref, comp, am)
    with pytest.raises(ValueError, match="objective_data"):
        engine.forward_backward(ids, attention_mask=am, labels=labels, loss_fn=obj)
    with pytest.raises(ValueError, match="objective_data"):
        engine.evaluate(ids, attention_mask=am, labels=labels, objective_data=side)
    with pytest.raises(ValueError, match="objective_data"):
        engine.forward_backward([{"input_ids": ids, "attention_mask": am, "labels": labels}], objective_data=side)
    engine.close()


def test_objective_comparison_can_fail():
    """The check catches a wrong weighting: another beta gives other gradients."""
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    ids, am, labels, comp, ref = _pairs()
    hf = copy.deepcopy(model)
    _hf_loss(hf, ids, am, labels, ref, "sigmoid").backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    obj = DPOObjective(DPOSettings(beta=1.0))
    engine.forward_backward(ids, attention_mask=am, labels=labels, loss_fn=obj,
                            objective_data=_objective("sigmoid", ref, comp, am)[1])
    assert _rel(engine, grads) > 1e-2
    engine.close()

"""mt.GRPOTrainer's refusals and its reward functions' failures: a function that raises, returns
NaN or the wrong number of rewards is an error naming it and the prompt, and nothing is trained;
PEFT, vLLM and vision are refused by name; a reward model scores as TRL's does."""
import copy
import math
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
from transformers import AutoModelForSequenceClassification  # noqa: E402

import megatrain_nb as mt  # noqa: E402
from megatrain_nb.model_configs import family_config  # noqa: E402
from megatrain_nb.trainer.grpo_rollout import RewardError, advantages, score  # noqa: E402

from .test_grpo_parity import config, prompts, reward_yes, tiny_model, tokenizer  # noqa: E402


def _trainer(tmp_path, funcs, **kw):
    tok = tokenizer()
    return mt.GRPOTrainer(model=tiny_model(tok), reward_funcs=funcs, args=config(tmp_path, **kw),
                          train_dataset=prompts(), processing_class=tok, device="cpu")


def _weights(t):
    return {n: w.clone() for n, w in t.engine.named_parameters()}


def raises(completions, **kw):
    raise KeyError("answer")


def gives_nan(completions, **kw):
    return [float("nan")] + [1.0] * (len(completions) - 1)


def too_few(completions, **kw):
    return [1.0]


@pytest.mark.parametrize("fn,words", [(raises, "raised KeyError"), (gives_nan, "returned nan"),
                                      (too_few, "returned 1 rewards, but 4")])
def test_a_bad_reward_function_is_named_with_its_prompt_and_nothing_is_trained(tmp_path, fn, words):
    t = _trainer(tmp_path, [reward_yes, fn], max_steps=2)
    before = _weights(t)
    with pytest.raises(RewardError) as e:
        t.train()
    msg = str(e.value)
    assert fn.__name__ in msg and words in msg and " plus " in msg and "nothing was trained" in msg
    assert t.state.global_step == 0
    assert all(torch.equal(before[n], w) for n, w in t.engine.named_parameters())
    t.close()


def test_none_means_not_scored_as_in_trl():
    """A None reward is TRL's "not scored" (NaN, left out of the means), not an error."""
    out = score([lambda completions, **k: [None, 1.0]], ["f"], [None], [{"prompt": "a"}, {"prompt": "b"}],
                ["a", "b"], ["x", "y"], [[1], [2]], {})
    assert math.isnan(float(out[0, 0])) and float(out[1, 0]) == 1.0
    adv, _ = advantages(out, torch.ones(1), 2, "group")
    assert torch.isfinite(adv).all()


@pytest.mark.parametrize("kw,words", [
    (dict(peft_config=object()), "peft_config"),
    (dict(tools=[len]), "tools"),
    (dict(optimizers=(object(), None)), "optimizers"),
])
def test_unsupported_arguments_are_refused_by_name(tmp_path, kw, words):
    tok = tokenizer()
    with pytest.raises(ValueError, match=words):
        mt.GRPOTrainer(model=tiny_model(tok), reward_funcs=reward_yes, args=config(tmp_path), train_dataset=prompts(),
                       processing_class=tok, device="cpu", **kw)


@pytest.mark.parametrize("field,value,words", [("use_vllm", True, "use_vllm=True.*transformers' generate"),
                                               ("entropy_coef", 0.1, "entropy_coef"),
                                               ("top_entropy_quantile", 0.5, "top_entropy_quantile")])
def test_unsupported_grpo_config_fields_are_refused_by_name(tmp_path, field, value, words):
    args = config(tmp_path)
    setattr(args, field, value)
    tok = tokenizer()
    with pytest.raises(ValueError, match=words):
        mt.GRPOTrainer(model=tiny_model(tok), reward_funcs=reward_yes, args=args, train_dataset=prompts(),
                       processing_class=tok, device="cpu")


def test_a_vision_processor_is_refused(tmp_path):
    from transformers import ProcessorMixin

    class Proc(ProcessorMixin):
        attributes = []

        def __init__(self):
            pass

    tok = tokenizer()
    with pytest.raises(ValueError, match="vision-language"):
        mt.GRPOTrainer(model=tiny_model(tok), reward_funcs=reward_yes, args=config(tmp_path), train_dataset=prompts(),
                       processing_class=Proc(), device="cpu")


def test_a_reward_model_scores_like_trl(tmp_path):
    tok = tokenizer()
    cfg = family_config("llama", layers=1, vocab=len(tok), max_position_embeddings=128, bos_token_id=None,
                        eos_token_id=tok.eos_token_id)
    cfg.num_labels = 1
    torch.manual_seed(1)
    rm = AutoModelForSequenceClassification.from_config(cfg).eval()
    rm.config.name_or_path = "tiny-rm"
    model = tiny_model(tok)
    trl_args = config(tmp_path / "trl", max_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = trl.GRPOTrainer(model=copy.deepcopy(model), reward_funcs=copy.deepcopy(rm), args=trl_args,
                            train_dataset=prompts(), processing_class=tok, reward_processing_classes=tok)
        t.train()
    m = mt.GRPOTrainer(model=copy.deepcopy(model), reward_funcs=copy.deepcopy(rm),
                       args=config(tmp_path / "mt", max_steps=2), train_dataset=prompts(), processing_class=tok,
                       reward_processing_classes=tok, device="cpu")
    m.train()
    a = [r for r in t.state.log_history if "loss" in r]
    b = [r for r in m.state.log_history if "loss" in r]
    for x, y in zip(a, b):
        for k in ("reward", "reward_std", "rewards/tiny-rm/mean", "loss"):
            assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-7), k
    m.close()


def test_a_model_folder_trains_as_the_module(tmp_path):
    """model= a local folder (the reference streamed from the same folder, beta > 0) ends where the
    module ends."""
    tok = tokenizer()
    model = tiny_model(tok)
    folder = tmp_path / "policy"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    ends = []
    for src in (copy.deepcopy(model), str(folder)):
        t = mt.GRPOTrainer(model=src, reward_funcs=reward_yes, args=config(tmp_path / "o", max_steps=2, beta=0.04),
                           train_dataset=prompts(), processing_class=tok, device="cpu")
        t.train()
        ends.append(({n: w.clone() for n, w in t.engine.named_parameters()},
                     [r["loss"] for r in t.state.log_history if "loss" in r], t.eos_token_ids))
        t.close()
    (w1, l1, e1), (w2, l2, e2) = ends
    assert e1 == e2 == [tok.eos_token_id]
    assert l1 == pytest.approx(l2, rel=1e-6, abs=1e-9)
    assert all(torch.allclose(w1[n], w2[n], atol=1e-6) for n in w1)


def test_each_step_record_splits_generation_from_training(tmp_path):
    """num_iterations=2: a step that generates records its seconds, the next (the stored rollouts)
    records 0.0; both carry the latest rollouts' reward and completion length; kind 'grpo'."""
    t = _trainer(tmp_path, reward_yes, max_steps=2, num_iterations=2)
    recs = list(t.iter_steps())
    assert t.kind.name == "grpo"
    assert recs[0]["generation_s"] > 0 and recs[1]["generation_s"] == 0.0
    assert recs[0]["reward"] == recs[1]["reward"] and recs[0]["completion_length"] > 0
    t.close()


def test_an_iterable_dataset_and_an_engine_with_beta_are_refused(tmp_path):
    tok = tokenizer()
    with pytest.raises(NotImplementedError, match="iterable train_dataset"):
        mt.GRPOTrainer(model=tiny_model(tok), reward_funcs=reward_yes, args=config(tmp_path),
                       train_dataset=prompts().to_iterable_dataset(), processing_class=tok, device="cpu")
    engine = mt.StreamingEngine(tiny_model(tok), mt.EngineConfig(device="cpu"))
    with pytest.raises(ValueError, match="beta > 0 needs the reference"):
        mt.GRPOTrainer(model=engine, reward_funcs=reward_yes, args=config(tmp_path, beta=0.04),
                       train_dataset=prompts(), processing_class=tok)
    engine.close()

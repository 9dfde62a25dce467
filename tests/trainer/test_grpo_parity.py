"""mt.GRPOTrainer against trl.GRPOTrainer on a tiny llama (built from a config) with a word-level
tokenizer built locally and a rule-based reward, same seed: the same sampled completions, every
logged value within 1e-5 relative (1e-7 absolute near zero), rewards equal, and the final weights
equal to round-off (the difference's L2 norm <= 1e-3 of the movement's)."""
import copy
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig  # noqa: E402

import megatrain_nb as mt  # noqa: E402
from megatrain_nb.assets import build_word_tokenizer  # noqa: E402
from megatrain_nb.model_configs import family_config  # noqa: E402

WORDS = "zero one two three four five six seven eight nine plus is yes no".split()
NOT_COMPARED = ("step_time", "epoch")   # TRL's wall-clock step time; the epoch fraction is counted otherwise


def tokenizer():
    return build_word_tokenizer(WORDS)


def tiny_model(tok):
    cfg = family_config("llama", layers=2, vocab=len(tok), max_position_embeddings=128, bos_token_id=None,
                        eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def prompts(conversational: bool = False):
    rows = [f"{a} plus {b} is" for a, b in zip(WORDS[:8], WORDS[2:10])]
    if conversational:   # the tokenizer's chat template, the completions as assistant messages
        return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r}]} for r in rows])
    return datasets.Dataset.from_list([{"prompt": r} for r in rows])


def _text(c):
    return c[0]["content"] if isinstance(c, list) else c


def reward_yes(completions, **kw):
    return [float(_text(c).split().count("yes")) for c in completions]


def reward_short(completion_ids, **kw):
    return [-0.1 * len(c) for c in completion_ids]


def config(out, **kw):
    base = dict(output_dir=str(out), bf16=False, use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                max_completion_length=6, learning_rate=1e-2, report_to="none", save_strategy="no", logging_steps=1,
                max_steps=4, seed=0, disable_tqdm=True)
    base.update(kw)
    return GRPOConfig(**base)


def _recording(model, sink: list):
    """``model.generate`` recording each call's completion tokens."""
    orig = model.generate

    def generate(*a, **k):
        out = orig(*a, **k)
        sink.append(out[:, k["input_ids"].shape[1]:].tolist())
        return out

    model.generate = generate


def run_trl(tmp_path, model, tok, funcs, conversational=False, **kw):
    args = config(tmp_path / "trl", **kw)
    if args.beta:   # TRL builds its reference from the policy's folder
        folder = tmp_path / "policy"
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        policy = AutoModelForCausalLM.from_pretrained(folder)
    else:
        policy = copy.deepcopy(model)
    gens: list = []
    _recording(policy, gens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = trl.GRPOTrainer(model=policy, reward_funcs=funcs, args=args, train_dataset=prompts(conversational),
                            processing_class=tok)
        t.train()
    return gens, [r for r in t.state.log_history if "loss" in r], dict(t.model.named_parameters())


def run_mt(tmp_path, model, tok, funcs, conversational=False, **kw):
    gens: list = []
    import megatrain_nb.trainer.grpo_rollout as rollout

    orig = rollout.ResidentPolicy.generate

    def generate(self, *a, **k):
        if not getattr(self, "_recorded", False):
            _recording(self.model, gens)
            self._recorded = True
        return orig(self, *a, **k)

    rollout.ResidentPolicy.generate = generate
    try:
        t = mt.GRPOTrainer(model=copy.deepcopy(model), reward_funcs=funcs, args=config(tmp_path / "mt", **kw),
                           train_dataset=prompts(conversational), processing_class=tok, device="cpu")
        t.train()
        weights = {n: w.clone() for n, w in t.engine.named_parameters()}
        t.close()
    finally:
        rollout.ResidentPolicy.generate = orig
    return gens, [r for r in t.state.log_history if "loss" in r], weights


def assert_parity(trl_run, mt_run, start):
    (g1, logs1, w1), (g2, logs2, w2) = trl_run, mt_run
    assert g1 == g2 and len(g1) >= 2                       # the same sampled completions
    assert len(logs1) == len(logs2)
    for a, b in zip(logs1, logs2):
        keys = [k for k in a if k not in NOT_COMPARED]
        assert set(keys) <= set(b), set(keys) - set(b)
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (a["step"], k)
    diff = sum(float((w2[n] - w1[n].detach()).norm() ** 2) for n in w1) ** 0.5
    moved = sum(float((w1[n].detach() - start[n]).norm() ** 2) for n in w1) ** 0.5
    assert moved > 0 and diff <= 1e-3 * moved


CASES = {"default_dapo_beta0": dict(),
         "grpo_beta004": dict(beta=0.04, loss_type="grpo"),
         "two_iterations": dict(num_iterations=2),
         "accumulation_2_steps_per_generation_2": dict(gradient_accumulation_steps=2, steps_per_generation=2,
                                                       per_device_train_batch_size=2, loss_type="bnpo"),
         "conversational": dict(conversational=True),
         "temperature_top_k_sapo_sequence_level": dict(temperature=0.7, top_k=8, beta=0.04, loss_type="sapo",
                                                       importance_sampling_level="sequence", num_iterations=2),
         # no max_steps: TRL's count of steps, and a second epoch's draw of the DataLoader's seed
         "two_epochs_logged_every_3": dict(max_steps=-1, num_train_epochs=2, per_device_train_batch_size=8,
                                           gradient_accumulation_steps=2, logging_steps=3)}


@pytest.mark.parametrize("case", list(CASES))
def test_same_completions_logs_and_weights_as_trl(tmp_path, case):
    tok = tokenizer()
    model = tiny_model(tok)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    kw = CASES[case]
    trl_run = run_trl(tmp_path, model, tok, [reward_yes, reward_short], **kw)
    mt_run = run_mt(tmp_path, model, tok, [reward_yes, reward_short], **kw)
    assert_parity(trl_run, mt_run, start)
    logs = mt_run[1]
    assert "rewards/reward_yes/mean" in logs[0] and "rewards/reward_short/std" in logs[0]
    assert ("kl" in logs[0]) == bool(kw.get("beta"))
    if case == "two_iterations":   # the second pass over a generation: the ratio moved off 1, clipped
        assert logs[1]["clip_ratio/region_mean"] > 0


def test_the_comparison_catches_another_seed(tmp_path):
    """Another seed samples other completions: the completion check can fail."""
    tok = tokenizer()
    model = tiny_model(tok)
    g1, _, _ = run_trl(tmp_path, model, tok, reward_yes, max_steps=1)
    g2, _, _ = run_mt(tmp_path, model, tok, reward_yes, max_steps=1, seed=1)
    assert g1 != g2


@pytest.mark.parametrize("during", [False, True])
def test_evaluate_matches_trl_before_and_after_training(tmp_path, during):
    """evaluate() before and after two steps (and, ``during``, after each step by eval_strategy):
    the same eval metrics as TRL's (eval_loss weighted as transformers and accelerate weigh the
    batches: 6 prompts in batches of 4, the last kept twice), and training goes on as TRL's."""
    tok = tokenizer()
    model = tiny_model(tok)
    ev = datasets.Dataset.from_list([{"prompt": f"{a} plus {b} is"} for a, b in zip(WORDS[3:9], WORDS[1:7])])
    kw = dict(per_device_eval_batch_size=4, num_generations_eval=2, max_steps=2)
    if during:
        kw.update(eval_strategy="steps", eval_steps=1, loss_type="grpo")
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = trl.GRPOTrainer(model=copy.deepcopy(model), reward_funcs=reward_yes, args=config(tmp_path / "trl", **kw),
                            train_dataset=prompts(), eval_dataset=ev, processing_class=tok)
        out.append((t.evaluate(), t.train() and t.evaluate(), t.state.log_history))
    m = mt.GRPOTrainer(model=copy.deepcopy(model), reward_funcs=reward_yes, args=config(tmp_path / "mt", **kw),
                       train_dataset=prompts(), eval_dataset=ev, processing_class=tok, device="cpu")
    out.append((m.evaluate(), m.train() and m.evaluate(), m.state.log_history))
    m.close()
    logged = [[r for r in o[2] if "eval_loss" in r or "loss" in r] for o in out]
    assert len(logged[0]) == len(logged[1]) == (5 if during else 3)   # (train() starts a new history)
    for a, b in list(zip(out[0][:2], out[1][:2])) + list(zip(*logged)):
        keys = [k for k in a if not k.endswith(("runtime", "per_second", "preparation_time", "step_time"))
                and k not in ("epoch", "step")]
        assert len(keys) > 15 and set(keys) <= set(b)
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
    if not during:   # (dapo weighs completions by their tokens: a loss off zero; grpo's is ~0 at ratio 1)
        assert out[1][1]["eval_loss"] != pytest.approx(0.0, abs=1e-6)

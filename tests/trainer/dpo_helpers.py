"""Shared pieces of the DPO tests: preference pairs made from the generated conversations (the
chosen reply is the conversation's own, the rejected one another conversation's), TRL and
megatrain runs of the same config on the same tiny llama."""
import copy

import torch

from .sft_helpers import CONVS, max_rel_diff, tiny_llama, tokenizer  # noqa: F401


def pairs(n: int = 16, fmt: str = "conversational", implicit: bool = False):
    rows = []
    for i in range(n):
        msgs = CONVS[i]["messages"]
        other = CONVS[(i + 5) % len(CONVS)]["messages"][-1]["content"]
        own = msgs[-1]["content"]
        if other == own:
            other = other + " no"
        if fmt == "conversational":
            prompt = msgs[:-1]
            row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": own}],
                   "rejected": [{"role": "assistant", "content": other}]}
            if implicit:
                row = {"chosen": prompt + row["chosen"], "rejected": prompt + row["rejected"]}
        else:
            prompt = " ".join(m["content"] for m in msgs[:-1])
            row = {"prompt": prompt, "chosen": " " + own, "rejected": " " + other}
        rows.append(row)
    return rows


def dpo_config(out, **kw):
    from trl import DPOConfig

    base = dict(output_dir=str(out), bf16=False, use_cpu=True, per_device_train_batch_size=2, learning_rate=1e-3,
                report_to="none", save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True, max_length=48,
                gradient_checkpointing=False)
    base.update(kw)
    return DPOConfig(**base)


def run_trl(model, ds, args, tok, live_ref: bool = False, ref_model=None):
    """Train with trl.DPOTrainer; returns (final weights, log_history)."""
    import trl

    ref = copy.deepcopy(ref_model if ref_model is not None else model) if live_ref or ref_model is not None else None
    trainer = trl.DPOTrainer(model=copy.deepcopy(model), ref_model=ref, args=args, train_dataset=ds,
                             processing_class=copy.deepcopy(tok))
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer.state.log_history


def run_mt(model, ds, args, tok, ref_model=None, **engine):
    """Train with mt.DPOTrainer; returns (final weights, log_history, trainer)."""
    import megatrain_nb as mt

    trainer = mt.DPOTrainer(model=copy.deepcopy(model), ref_model=ref_model, args=args, train_dataset=ds,
                            processing_class=copy.deepcopy(tok), device="cpu", **engine)
    trainer.train()
    weights = {n: w.clone() for n, w in trainer.engine.named_parameters()}
    return weights, trainer.state.log_history, trainer


def step_logs(history):
    return [h for h in history if "loss" in h and "train_runtime" not in h]


def assert_logs_match(mt_logs, trl_logs, keys, rel=1e-5, floor=1e-3):
    assert len(mt_logs) == len(trl_logs), (len(mt_logs), len(trl_logs))
    for i, (a, b) in enumerate(zip(mt_logs, trl_logs)):
        for k in keys:
            assert k in a, (i, k, sorted(a))
            x, y = float(a[k]), float(b[k])
            assert abs(x - y) <= rel * max(abs(y), floor), (i, k, x, y)


def start_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


__all__ = ["pairs", "dpo_config", "run_trl", "run_mt", "step_logs", "assert_logs_match", "max_rel_diff",
           "start_weights", "tiny_llama", "tokenizer", "torch"]

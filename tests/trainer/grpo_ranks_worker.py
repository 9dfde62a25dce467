"""Worker: mt.GRPOTrainer under torchrun (or alone),
``grpo_ranks_worker.py OUT GA SPG [beta loss_type [save_steps [resume_from]]] [-- OUT GA SPG ...]``
(several runs one after the other, in one process):
a tiny llama from a config, two rule-based rewards, per-rollout random streams, streamed generation;
4 steps, then an evaluation.
Rank 0 writes ``OUT/final`` (the weights), ``OUT/log_history.json`` and ``OUT/completions.json``
(each generation batch's completion ids, in TRL's order); every rank ``OUT/decode-RANK.json`` (its
decoder's counts per generation)."""
import json
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # tests/ (for the GRPO test helpers)

from trainer.test_grpo_parity import config, prompts, reward_short, reward_yes, tiny_model, tokenizer  # noqa: E402

import megatrain_nb as mt  # noqa: E402
from distributed.launch import argument_groups  # noqa: E402


def main(out_dir: str, ga: str, spg: str, beta: str = "0.0", loss_type: str = "dapo", save_steps: str = "0",
         resume: str = "") -> None:
    tok = tokenizer()
    args = config(out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=int(ga),
                  steps_per_generation=int(spg), max_steps=4, beta=float(beta), loss_type=loss_type,
                  max_completion_length=6, temperature=1.0, per_device_eval_batch_size=4,
                  **({"save_strategy": "steps", "save_steps": int(save_steps)} if int(save_steps) else {}))
    t = mt.GRPOTrainer(model=tiny_model(tok), reward_funcs=[reward_yes, reward_short], args=args,
                       train_dataset=prompts(), eval_dataset=prompts().select(range(2)), processing_class=tok,
                       device="cpu", rollout_seeds="per_rollout")
    gens, stats = [], []
    orig = t.make_rollouts

    def make_rollouts(examples, mode="train"):
        out = orig(examples, mode)
        gens.append([row[m.bool()].tolist() for row, m in zip(out["completion_ids"], out["completion_mask"])])
        stats.append(dict(t._policy.last_stats))
        return out

    t.make_rollouts = make_rollouts
    t.train(resume_from_checkpoint=resume or None)
    t.evaluate()   # 2 prompts x 4: each eval batch's generation split over the ranks
    t.save_model(out_dir + "/final")
    if t.dist.is_main:
        for name, value in (("log_history", t.state.log_history), ("completions", gens)):
            with open(f"{out_dir}/{name}.json", "w") as f:
                json.dump(value, f)
    with open(f"{out_dir}/decode-{t.dist.rank}.json", "w") as f:
        json.dump(stats, f)
    t.close()


if __name__ == "__main__":
    for argv in argument_groups(sys.argv[1:]):   # several runs, one after the other
        main(*argv)

"""Worker: mt.SFTTrainer under torchrun (or alone), issue 20:
``w_sft.py OUT GA CASE [save | resume:<ck> | nan] [-- OUT GA CASE ...]`` (several runs, one after the other).
CASE ``assistant`` (conversational, assistant_only_loss) or ``packed`` (the same, packed by TRL's
"bfd" strategy: padding-free rows with per-document position ids). ``nan``: on_nonfinite="skip"
and a NaN in rank 1's gradient shard during step 2. Rank 0 writes ``OUT/final`` and
``OUT/log_history.json`` (the logged metrics, mean_token_accuracy among them)."""
import json
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # tests/ (for the SFT test helpers)

from datasets import Dataset  # noqa: E402

from trainer.sft_helpers import CONVS, sft_config, tiny_llama, tokenizer  # noqa: E402

from distributed.launch import argument_groups  # noqa: E402
from megatrain_nb.trainer.sft import SFTTrainer  # noqa: E402

CASES = {"assistant": dict(assistant_only_loss=True),
         "packed": dict(assistant_only_loss=True, packing=True, max_length=96)}


def main(out_dir: str, ga: str, case: str, mode: str = "") -> None:
    kw = dict(CASES[case], gradient_accumulation_steps=int(ga), max_steps=3, weight_decay=0.1, max_grad_norm=0.5,
              per_device_eval_batch_size=2, eval_strategy="steps", eval_steps=3)
    if mode == "save":
        kw.update(save_strategy="steps", save_steps=2)
    tok = tokenizer()
    ds = Dataset.from_list(CONVS[:40])
    t = SFTTrainer(model=tiny_llama(len(tok)), args=sft_config(out_dir, **kw), train_dataset=ds,
                   eval_dataset=Dataset.from_list(CONVS[40:]), processing_class=tok, device="cpu",
                   on_nonfinite="skip" if mode == "nan" else "stop")
    if mode == "nan":
        poison_rank1_at_step2(t)
    t.train(resume_from_checkpoint=mode.split(":", 1)[1] if mode.startswith("resume:") else None)
    t.save_model(out_dir + "/final")
    if t.dist.is_main:
        with open(f"{out_dir}/log_history.json", "w") as f:
            json.dump(t.state.log_history, f)
    t.close()


def poison_rank1_at_step2(t) -> None:
    """A NaN in rank 1's gradient shard of one unit during step 2 (as it arrives, reduce-scattered:
    rank 0's own shards stay finite), as tests/distributed/w_nonfinite.py does to a bare engine."""
    intake = t.engine.updates.intake
    real = intake.arrived

    def poisoned(unit, grad):
        if t.dist.rank == 1 and t.state.global_step == 1 and unit.name == "model.layers.0" and grad.numel():
            grad.view(-1)[0] = float("nan")
        return real(unit, grad)

    intake.arrived = poisoned


if __name__ == "__main__":
    for argv in argument_groups(sys.argv[1:]):   # several runs, one after the other
        main(*argv)

"""Worker: mt.DPOTrainer under torchrun (or alone): ``w_dpo.py OUT GA``. Rank 0 writes
``OUT/final`` and ``OUT/log_history.json``."""
import json
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # tests/ (for the DPO test helpers)

from datasets import Dataset  # noqa: E402

from trainer.dpo_helpers import dpo_config, pairs, tiny_llama, tokenizer  # noqa: E402

from megatrain_nb.trainer.dpo import DPOTrainer  # noqa: E402


def main(out_dir: str, ga: str) -> None:
    kw = dict(gradient_accumulation_steps=int(ga), max_steps=3, per_device_train_batch_size=1, max_grad_norm=0.5,
              per_device_eval_batch_size=2, eval_strategy="steps", eval_steps=3)
    tok = tokenizer()
    rows = pairs(20)
    t = DPOTrainer(model=tiny_llama(len(tok)), args=dpo_config(out_dir, **kw), train_dataset=Dataset.from_list(rows),
                   eval_dataset=Dataset.from_list(pairs(5, "text")), processing_class=tok, device="cpu")
    t.train()
    t.save_model(out_dir + "/final")
    if t.dist.is_main:
        with open(f"{out_dir}/log_history.json", "w") as f:
            json.dump(t.state.log_history, f)
    t.close()


if __name__ == "__main__":
    main(*sys.argv[1:])

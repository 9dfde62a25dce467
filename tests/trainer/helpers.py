"""Tiny models and datasets shared by the trainer tests (2 layers, hidden 64, vocab 512, seq 32)."""
import torch
from transformers import AutoModelForCausalLM, TrainingArguments

from megatrain_nb.model_configs import preset_config

VOCAB = 512


def micro_model(seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(preset_config("micro", num_hidden_layers=layers))


def token_rows(n: int = 20, seq: int = 32, seed: int = 1, masked: bool = False):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (seq,), generator=g)
        row = {"input_ids": ids.tolist()}
        if masked:  # a varying number of ignored targets, so micro-batches weigh differently
            lab = ids.clone()
            lab[: i % 7] = -100
            row["labels"] = lab.tolist()
        rows.append(row)
    return rows


def token_dataset(n: int = 20, seq: int = 32, seed: int = 1, masked: bool = False):
    from datasets import Dataset

    return Dataset.from_list(token_rows(n, seq, seed, masked))


def args(output_dir, **kw):
    base = dict(per_device_train_batch_size=2, learning_rate=3e-3, report_to="none", disable_tqdm=True,
                logging_steps=1, save_strategy="no")
    base.update(kw)
    return TrainingArguments(output_dir=str(output_dir), **base)


def relative_difference(a: dict, b: dict, start: dict) -> float:
    """|a - b| / |b - start| over all tensors (how far apart, relative to how far training moved)."""
    num = sum(float((a[k].detach() - b[k].detach()).double().norm() ** 2) for k in b) ** 0.5
    den = sum(float((b[k].detach() - start[k].detach()).double().norm() ** 2) for k in b) ** 0.5
    return num / den

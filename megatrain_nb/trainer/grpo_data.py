"""The data stream of a GRPO run: prompts in trl.GRPOTrainer's order, rollouts generated and
scored once per ``steps_per_generation x num_iterations`` micro-batches, shuffled, split, and
handed to the loop as the engine's micro-batches, each carrying its own side data (advantages, old
and reference log-probs: a ``RolloutBatch``, its ``objective_data``) to the objective.

The order of random draws is TRL's (transformers' loop and DataLoader on one process): TRL's own
``RepeatSampler`` (its generator seeded with ``args.seed``) orders the prompts; the global stream
gives one int64 draw when each epoch's iteration starts (the DataLoader's base seed), then each generation's sampling, then ``shuffle_sequence_dict``'s
permutation. So the same seed samples TRL's completions.
"""
from __future__ import annotations

import base64
import copy
import dataclasses
import time
from functools import partial
from typing import List, Optional

import torch

from megatrain_nb.engine.inputs import OBJECTIVE_DATA

from .grpo_loss import RolloutBatch, to_shift
from .grpo_rollout import left_pad, right_pad
from .sharding import ZERO_WEIGHT, deal


def tokenize_prompts(tok, prompts: list, chat_template_kwargs: Optional[dict] = None) -> List[List[int]]:
    """The prompts' token ids as TRL takes them (a chat template with the generation prompt for
    conversations; plain text tokenised as is)."""
    from trl.data_utils import is_conversational

    if is_conversational({"prompt": prompts[0]}):
        out = tok.apply_chat_template(conversation=prompts, add_generation_prompt=True, tokenize=True,
                                      return_dict=True, **(chat_template_kwargs or {}))
        return [list(x) for x in out["input_ids"]]
    return [list(x) for x in tok(text=prompts)["input_ids"]]


def longest_prompt_tokens(tok, dataset, chat_template_kwargs: Optional[dict] = None,
                          sample: int = 256) -> Optional[int]:
    """The longest prompt, in tokens as :func:`tokenize_prompts` makes them, of ``dataset``'s first
    ``sample`` rows: the prompt part of the rows a run trains on (the engine's plan is made for
    them). None without a tokenizer or when the prompts cannot be read or tokenised here (a probe:
    generation says what is wrong with them)."""
    if tok is None:
        return None
    try:
        prompts = [dataset[i]["prompt"] for i in range(min(len(dataset), sample))]
        ids = tokenize_prompts(tok, copy.deepcopy(prompts), chat_template_kwargs) if prompts else []
    except Exception:   # noqa: BLE001 - a probe: the run's own tokenisation reports the cause
        return None
    return max(map(len, ids)) if ids else None


def _draw() -> None:
    torch.empty((), dtype=torch.int64).random_()


class RolloutStream:
    """``BatchStream``'s interface (``next_window``, ``epoch``, ``consumed``,
    ``batches_per_epoch``, ``start_next_epoch``, ``state_dict``) over rollouts: one micro-batch
    per ``per_device_train_batch_size`` completions; ``trainer.make_rollouts(examples)`` makes a
    generation batch's rollouts (a dict of TRL's keys).

    With several ranks it counts over all of them (one process with the accumulation and
    ``steps_per_generation`` times the ranks: :mod:`.grpo_ranks`): a generation batch is
    ``steps_per_generation x ranks`` micro-batches, a step takes ``accumulation x ranks`` of them
    and this rank its share (:func:`.sharding.deal`)."""

    def __init__(self, trainer, dataset):
        from trl.trainer.utils import RepeatSampler

        a = trainer.args
        self.trainer, self.dataset, self.args = trainer, dataset, a
        self.rank, self.world = trainer.dist.rank, trainer.dist.world
        # micro-batches of a generation batch over all ranks; TRL's dataloader batch of one process
        self.spg, self.iterations = a.steps_per_generation * self.world, trainer.num_iterations
        self.micro = a.per_device_train_batch_size * self.spg
        self.sampler = RepeatSampler(data_source=dataset, mini_repeat_count=a.num_generations,
                                     batch_size=a.generation_batch_size // a.num_generations,
                                     repeat_count=self.iterations * self.spg, shuffle=a.shuffle_dataset, seed=a.seed)
        self.batches_per_epoch = len(self.sampler) // self.micro if a.dataloader_drop_last else -(-len(self.sampler)
                                                                                                  // self.micro)
        if self.batches_per_epoch == 0:
            raise ValueError(f"train_dataset is too small for one generation batch ({a.generation_batch_size // a.num_generations} "
                             f"prompts x {a.num_generations} generations)")
        self.epoch, self.consumed = 0, 0
        self._order: Optional[list] = None
        self._step = 0          # micro-batches trained (TRL's self._step)
        self._buffer: Optional[list] = None
        self.generation_s = 0.0   # this window's seconds making rollouts (generation, log-probs, rewards)

    def state_dict(self) -> dict:
        """The data position (JSON): epoch, micro-batches consumed in it, micro-batches trained
        (``step``), the stored generation batch's rollouts when a step in its middle comes next
        (exact tensors: :func:`encode_tensors`) and the trainer's rollout metrics not yet logged."""
        mid = self._buffer is not None and self._step % (self.spg * self.iterations) != 0
        return {"epoch": self.epoch, "consumed": self.consumed, "step": self._step,
                "buffer": [encode_tensors(b) for b in self._buffer] if mid else None,
                "rollout_state": self.trainer.rollout_state()}

    def load_state_dict(self, state: dict) -> None:
        """A resume: the sampler's order replayed to the saved position, the stored generation
        batch and the trainer's rollout metrics back, so the run goes on as if never stopped."""
        if "step" not in state:
            raise ValueError("this checkpoint's data position has no GRPO rollout state (it was not written by "
                             "mt.GRPOTrainer, or by a version before GRPO resumes): start the run again")
        self.replay(state)
        self._step = int(state["step"])
        buffer = state.get("buffer")
        self._buffer = [decode_tensors(b) for b in buffer] if buffer else None
        self.trainer.load_rollout_state(state.get("rollout_state") or {})

    def replay(self, state: dict) -> None:
        """The sampler from its seed, advanced to ``state``'s epoch; mid-epoch, that epoch's order
        taken without the draw its start made (the random state restored is the one after it)."""
        RolloutStream.__init__(self, self.trainer, self.dataset)
        epoch = int(state.get("epoch", 0))
        for _ in range(epoch):   # each epoch's iteration advanced the sampler's own generator
            list(iter(self.sampler))
        self.epoch, self.consumed = epoch, int(state.get("consumed", 0))
        if self.consumed:
            idx = list(iter(self.sampler))
            self._order = [idx[i:i + self.micro] for i in range(0, len(idx), self.micro)]

    def start_next_epoch(self) -> None:
        self.epoch += 1
        self.consumed = 0
        self._order = None

    def _next_examples(self):
        if self._order is None:
            _draw()   # the DataLoader's base seed, once per epoch's iteration
            idx = list(iter(self.sampler))
            self._order = [idx[i:i + self.micro] for i in range(0, len(idx), self.micro)]
        if self.consumed >= len(self._order):
            return None
        chunk = self._order[self.consumed]
        self.consumed += 1
        return [self.dataset[i] for i in chunk]

    def next_window(self, accumulation: int):
        """This step's micro-batches (rollouts, generated when due) and whether the epoch ended."""
        from trl.trainer.utils import split_tensor_dict

        parts = []
        ended = False
        self.generation_s = 0.0
        while len(parts) < accumulation * self.world:
            ex = self._next_examples()
            if ex is None:
                ended = True
                break
            if self._step % (self.spg * self.iterations) == 0 or self._buffer is None:
                t0 = time.perf_counter()
                rollouts = self.trainer.make_rollouts(ex)
                self.generation_s += time.perf_counter() - t0
                self._buffer = split_tensor_dict(self.trainer.shuffle_rollouts(rollouts), self.spg)
            parts.append(self._buffer[self._step % self.spg])
            self._step += 1
        if not ended and self.consumed >= self.batches_per_epoch:
            ended = True
        # the loss constants are the step's and the generation's over all ranks (gradients are summed over them)
        raw = [partial(micro_batch, p, len(parts), self.spg) for p in parts]
        return [_filler(b) for b in deal(raw, self.rank, self.world, lambda b: b)], ended


def encode_tensors(d: dict) -> dict:
    """A dict of tensors (or None) as JSON: each tensor's dtype, shape and raw bytes (base64), so
    it reads back bitwise (:func:`decode_tensors`)."""
    out = {}
    for k, t in d.items():
        if t is None:
            out[k] = None
            continue
        t = t.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        out[k] = {"dtype": str(t.dtype).split(".")[-1], "shape": list(t.shape),
                  "data": base64.b64encode(raw).decode("ascii")}
    return out


def decode_tensors(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if v is None:
            out[k] = None
            continue
        dtype = getattr(torch, v["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"a stored rollout tensor {k!r} has an unknown dtype {v['dtype']!r}: the checkpoint's "
                             "data position is damaged")
        raw = bytearray(base64.b64decode(v["data"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out[k] = flat.view(dtype).reshape(v["shape"]).clone()
    return out


def _filler(b: dict) -> dict:
    """A rank's zero-weight micro-batch (:func:`.sharding.zero_weight`) weighs nothing in the loss
    and the metrics."""
    if b.get(ZERO_WEIGHT):
        b[OBJECTIVE_DATA] = dataclasses.replace(b[OBJECTIVE_DATA], weight=0.0)
    return b


def micro_batch(r: dict, accumulation: int, per_generation: int = 0) -> dict:
    """The engine's micro-batch of one slice of rollouts, its side data (a :class:`RolloutBatch`)
    its ``objective_data``: ``accumulation`` the step's micro-batches and ``per_generation`` the
    generation batch's (0: ``steps_per_generation``), both over all ranks."""
    P = r["prompt_ids"].shape[1]
    ids = torch.cat([r["prompt_ids"], r["completion_ids"]], 1)
    am = torch.cat([r["prompt_mask"], r["completion_mask"]], 1)
    labels = ids.masked_fill(am == 0, -100)
    labels[:, :P] = -100
    side = RolloutBatch(advantages=r["advantages"], old_logps=to_shift(r.get("old_per_token_logps"), P),
                        ref_logps=to_shift(r.get("ref_per_token_logps"), P),
                        num_items=float(r["num_items_in_batch"]), accumulation=accumulation,
                        per_generation=per_generation)
    return {"input_ids": ids, "attention_mask": am, "labels": labels, OBJECTIVE_DATA: side}


def pad_rollouts(prompt_ids, completion_ids, pad_id: int) -> dict:
    """TRL's tensors of a generation batch: prompts left-padded, completions right-padded."""
    p, pm = left_pad(prompt_ids, pad_id)
    c, cm = right_pad(completion_ids, pad_id)
    return {"prompt_ids": p, "prompt_mask": pm, "completion_ids": c, "completion_mask": cm}


__all__ = ["RolloutStream", "decode_tensors", "encode_tensors", "longest_prompt_tokens", "micro_batch", "pad_rollouts",
           "tokenize_prompts"]

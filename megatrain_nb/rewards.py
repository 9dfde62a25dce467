"""Reward functions shipped with megatrain_nb, for ``mt.GRPOTrainer`` (and ``trl.GRPOTrainer``: they
take TRL's keywords) on the shipped arithmetic task (``megatrain_nb.assets.arithmetic_dataset``).

    import megatrain_nb as mt
    from megatrain_nb.assets import arithmetic_dataset, chat_tokenizer
    from megatrain_nb.rewards import arithmetic_correct, answers_with_a_number

    trainer = mt.GRPOTrainer(model=..., reward_funcs=[arithmetic_correct, answers_with_a_number],
                             train_dataset=arithmetic_dataset(), processing_class=chat_tokenizer(), ...)

Both read a completion's first word (text, or the content of a conversational completion's
message): :func:`arithmetic_correct` is 1.0 when it is the row's ``answer`` (a number word or
its digits: "seven" or "7"), else 0.0 (the verifiable reward); :func:`answers_with_a_number` is
1.0 when it is any number (a format reward: what a freshly initialised model learns within a
minute, before it learns the sums). run.yaml names them ``megatrain_nb.rewards:arithmetic_correct``.
"""
from __future__ import annotations

from typing import List, Optional

from megatrain_nb.assets.words import NUMBERS

_VALUE = {w: i for i, w in enumerate(NUMBERS)}


def _text(completion) -> str:
    """A completion's text (a conversational completion: its messages' contents)."""
    if isinstance(completion, list):
        return " ".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def number_of(word: str) -> Optional[int]:
    """The number a word names ("seven", "Seven", "7"), or None."""
    w = word.strip().strip(".,!?").lower()
    if w.isdigit():
        return int(w)
    return _VALUE.get(w)


def first_word(completion) -> str:
    words = _text(completion).split()
    return words[0] if words else ""


def arithmetic_correct(completions, answer, **kwargs) -> List[float]:
    """1.0 for a completion whose first word is its row's ``answer`` (a number word or digits), else 0.0."""
    if len(answer) != len(completions):
        raise ValueError(f"arithmetic_correct: {len(completions)} completions but {len(answer)} answers; the "
                         "dataset needs an 'answer' column (megatrain_nb.assets.arithmetic_dataset has one)")
    out = []
    for c, a in zip(completions, answer):
        got, want = number_of(first_word(c)), number_of(str(a))
        out.append(1.0 if got is not None and got == want else 0.0)
    return out


def answers_with_a_number(completions, **kwargs) -> List[float]:
    """1.0 for a completion whose first word is a number (a word or digits), else 0.0 (the format)."""
    return [1.0 if number_of(first_word(c)) is not None else 0.0 for c in completions]


#: the shipped reward functions by name (run.yaml's ``grpo.reward_funcs`` may name them alone)
SHIPPED = {"arithmetic_correct": arithmetic_correct, "answers_with_a_number": answers_with_a_number}

__all__ = ["SHIPPED", "answers_with_a_number", "arithmetic_correct", "first_word", "number_of"]

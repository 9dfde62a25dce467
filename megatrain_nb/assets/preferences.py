"""The shipped preference set (``assets/chat/preferences.jsonl``), generated from the shipped
chat set by this project, so license-clean like it: one pair per conversation, in TRL's
conversational ``prompt``/``chosen``/``rejected`` format. The prompt is the conversation up to its
last reply, ``chosen`` that (correct) reply, ``rejected`` the same sentence with its answer word
swapped for another of its kind (a wrong sum, colour, opposite or count): a fluent near miss, so
the preference is about being right, not about form. ``python -m megatrain_nb.assets`` writes it
(deterministic); ``tests/test_assets_preferences.py`` checks the file is what the generator makes.

    from megatrain_nb.assets import preference_dataset
    pairs = preference_dataset()        # datasets.Dataset, 240 pairs
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from .words import COLOURS, NUMBERS, OPPOSITES
from megatrain_nb.atomic import atomic_file

PREFERENCES_FILE = Path(__file__).parent / "chat" / "preferences.jsonl"


def _pools() -> list:
    """The kinds of answer word, each a list of words that can stand in for one another (the
    numbers the chat set uses: up to nine plus eight, so every word is in the shipped tokenizer)."""
    return [NUMBERS[:18], sorted({c for _, c in COLOURS}), sorted({w for pair in OPPOSITES for w in pair})]


def near_miss(reply: str, rng: random.Random) -> str:
    """``reply`` with its answer word (the last before the full stop) replaced by another of its kind."""
    words = reply.split()
    k = len(words) - 2 if len(words) >= 2 and words[-1] == "." else len(words) - 1
    pool = next((p for p in _pools() if words[k] in p), None)
    if pool is None:
        raise ValueError(f"no answer word to swap in {reply!r}")
    words[k] = rng.choice([w for w in pool if w != words[k]])
    return " ".join(words)


def generate_preferences(conversations: list, seed: int = 0) -> list:
    """One pair per conversation (see the module docstring)."""
    rng = random.Random(seed)
    rows = []
    for c in conversations:
        msgs = c["messages"]
        rows.append({"prompt": msgs[:-1], "chosen": [msgs[-1]],
                     "rejected": [{"role": "assistant", "content": near_miss(msgs[-1]["content"], rng)}]})
    return rows


def preference_rows(n=None) -> list:
    """The shipped pairs as a list of dicts."""
    with open(PREFERENCES_FILE, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:n]


def preference_dataset(n=None):
    """The shipped pairs as a ``datasets.Dataset``."""
    from datasets import Dataset

    return Dataset.from_list(preference_rows(n))


def write_preferences(conversations: list) -> None:

    with atomic_file(PREFERENCES_FILE) as f:
        f.write("".join(json.dumps(r) + "\n" for r in generate_preferences(conversations)))

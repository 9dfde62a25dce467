"""What a Session's ``generate`` produced (``session.samples``). The conversation a prompt-less
``generate`` answers, and the answers drawn while training, live in ``sample_watch.py``."""
from __future__ import annotations

import time
from typing import Any


class Samples:
    """The samples of one run (see the module docstring)."""

    def __init__(self):
        self.drawn: list[dict] = []              # {"step", "prompt", "text", "time"}

    def draw(self, engine: Any, tokenizer: Any, prompt: str, step: int, **options: Any) -> str:
        """Sample from ``engine`` (see ``sampling.sample_text``) and keep the sample."""
        # light: the sampler's transformers away from a Session whose ranks train in other processes
        from megatrain_nb.engine.compute.sampling import sample_text

        text = sample_text(engine, tokenizer, prompt, **options)
        self.drawn.append({"step": step, "prompt": prompt, "text": text, "time": time.time()})
        return text

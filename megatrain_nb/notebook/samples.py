"""What a Session's ``generate`` produced, and the conversation it answers when given no prompt
(``Session.set_sample_prompt``). One per Session; the dashboard's samples panel reads
``session.samples``."""
from __future__ import annotations

import time
from typing import Any, Optional


class Samples:
    """The samples of one run (see the module docstring)."""

    def __init__(self):
        self.drawn: list[dict] = []              # {"step", "prompt", "text", "time"}
        self.messages: Optional[list] = None     # the conversation a prompt-less generate() answers

    def set_prompt(self, tokenizer: Any, messages: Any) -> None:
        from megatrain_nb.trainer.sft_view import chat_prompt

        chat_prompt(tokenizer, messages)   # refused now, not at the next sample, if it cannot render
        self.messages = list(messages)

    def draw(self, engine: Any, tokenizer: Any, prompt: str, step: int, **options: Any) -> str:
        """Sample from ``engine`` (see ``sampling.sample_text``) and keep the sample."""
        from .sampling import sample_text

        if not prompt and self.messages:
            from megatrain_nb.trainer.sft_view import chat_prompt

            prompt = chat_prompt(tokenizer, self.messages)
        text = sample_text(engine, tokenizer, prompt, **options)
        self.drawn.append({"step": step, "prompt": prompt, "text": text, "time": time.time()})
        return text

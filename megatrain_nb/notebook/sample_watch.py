"""Answers to the sample prompt while a run trains: the conversation set with
``session.set_sample_prompt(messages)`` is rendered with the chat template and answered from the
weights at a step interval, so the dashboard (and the report) show the answers change.

Threads: the training thread only notes that a step is due (:meth:`SampleWatch.on_step`, O(1));
the answer is drawn on the watch's own thread, under ``engine.lock`` like ``session.generate``, so
a running trainer waits at most one sample (``max_new_tokens`` forward passes) before its next
micro-batch. Steps that come due while an answer is drawn are merged into the latest one, and a
step is skipped until the last answer's time is under :data:`SHARE` of the time since: a slow
sample (a large model streams every layer per token) spaces the answers out rather than the
training. Nothing here touches a widget: the publisher reads :meth:`answers`
and :attr:`version` (see :func:`answers_html`).

Example::

    session.set_sample_prompt([{"role": "user", "content": "What is two plus three ?"}], every=20)
    session.sample_watch.answers()   # [{"step": 0, "answer": "...", "time": ...}, {"step": 20, ...}]
"""
from __future__ import annotations

import html
import threading
import time
from collections import deque
from typing import Any, Optional

from megatrain_nb.threads import SAMPLES, thread_name
from megatrain_nb.trainer.sft_view import chat_prompt
from megatrain_nb.values import check

DEFAULT_EVERY = 50        # steps between two answers when the run's length is unknown
DEFAULT_TOKENS = 48
SHARE = 0.1               # at most this share of the run's time goes to drawing answers (a slow sample: fewer)
HOLD_S = 1.0              # at most this long the training thread waits for the sampler to take the lock
FINAL_WAIT_S = 120.0      # at most this long the run's end waits for the answer from its final weights


class SampleWatch:
    """The sample prompt of one session and the last ``keep`` answers to it, newest last."""

    def __init__(self, session: Any, keep: int = 8):
        self.session = session
        self.keep = keep
        self.messages: Optional[list] = None
        self.prompt: Optional[str] = None     # the messages rendered with the chat template
        self.every: Optional[int] = None
        self.options: dict = {}
        self.version = 0                      # bumped at each change: what the dashboard keys on
        self.drawing: Optional[int] = None    # the step whose answer is being drawn
        self._answers: deque = deque(maxlen=keep)
        self._due: Optional[int] = None       # the step whose answer is wanted next
        self._cv = threading.Condition()
        self._grabbed = threading.Event()     # the sampler holds engine.lock: the weights are the due step's
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._next_ok = 0.0                   # monotonic time before which no interval step is due
        self.skipped = 0                      # interval steps left unanswered to keep under SHARE of the time
    # ---- the notebook's side ---------------------------------------------------------------------
    def set_prompt(self, messages: Any, *, every: Optional[int] = None, max_new_tokens: int = DEFAULT_TOKENS,
                   temperature: float = 0.0, seed: Optional[int] = 0) -> None:
        """Answer ``messages`` now (the weights as they are) and every ``every`` steps (default: a
        tenth of the run); ``temperature=0`` (greedy) so a change of answer is a change of weights."""
        prompt = chat_prompt(self.session.tokenizer, messages)   # refused now if it cannot render
        # the table's rules (megatrain_nb/values.py), as generate() applies them: refused here, not on the watch thread
        every = check("sample_every", every, "set_sample_prompt: every")
        max_new_tokens = check("max_new_tokens", max_new_tokens, "set_sample_prompt: max_new_tokens")
        temperature = check("temperature", temperature, "set_sample_prompt: temperature")
        seed = check("sample_seed", seed, "set_sample_prompt: seed")
        if self.session.engine is None or self.session.released:
            raise RuntimeError(f"session {self.session.name!r} has no model in this process to answer with (it was "
                               "released, or the run trains in worker processes); sample from its saved model")
        try:
            total = self.session.total_steps
        except Exception:  # noqa: BLE001 - an iterable dataset without max_steps: no length
            total = None
        with self._cv:
            self.messages, self.prompt = [dict(m) for m in messages], prompt
            self.every = every or (max(1, total // 10) if total else DEFAULT_EVERY)
            self.options = {"max_new_tokens": int(max_new_tokens), "temperature": float(temperature), "seed": seed}
            self._answers = deque(maxlen=self.keep)   # a new prompt, a new history
            self.skipped = 0
            self._due = self.session.step
            self._changed()
            self._cv.notify_all()
        self._start()

    def answers(self) -> list[dict]:
        """The last answers, oldest first: ``{"step", "answer", "time"}`` each."""
        with self._cv:
            return list(self._answers)

    def close(self, timeout: float = 30.0) -> None:
        """Stop drawing answers (waits for one being drawn, at most ``timeout`` seconds)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    # ---- the training thread's side: note and return ---------------------------------------------
    def on_step(self, step: int) -> None:
        """A step ended: its answer is due if it falls on the interval. When the sampler is idle,
        wait (at most :data:`HOLD_S`, a thread wake-up in practice) until it holds ``engine.lock``,
        so the answer is drawn from this step's weights, not the next one's."""
        if self.prompt is None or step % (self.every or DEFAULT_EVERY):
            return
        if time.monotonic() < self._next_ok:
            with self._cv:
                self.skipped += 1
                self._changed()
            return
        with self._cv:
            if self._due is not None:
                self.skipped += 1   # the step due before this one was not reached: merged into this one
            idle = self._due is None and self.drawing is None and self._thread is not None \
                and self._thread.is_alive()
            self._grabbed.clear()
            self._due = step
            self._cv.notify_all()
        if idle:
            self._grabbed.wait(HOLD_S)

    def run_ended(self, weights_kept: bool) -> None:
        """The run ended: one last answer from its final weights if they are kept, else stop."""
        if not weights_kept:
            self.close()
            return
        step = self.session.step
        with self._cv:
            if self.prompt is None or step in (self._due, self.drawing) or \
                    any(a["step"] == step for a in self._answers):
                return
        self._want(step)

    def finish(self, timeout: float = FINAL_WAIT_S) -> bool:
        """Wait (at most ``timeout`` s) until no answer is due or being drawn: the run's end waits
        for the answer from its final weights, so the final snapshot shows it, not "drawing…"."""
        t = self._thread
        if t is None or t is threading.current_thread():
            return True
        with self._cv:
            return self._cv.wait_for(lambda: self._closed or not t.is_alive()
                                     or (self._due is None and self.drawing is None), timeout)

    # ---- the watch's thread ----------------------------------------------------------------------
    def _want(self, step: int) -> None:
        with self._cv:
            self._due = step
            self._cv.notify_all()

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._closed = False
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=thread_name(SAMPLES, self.session.name))
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._due is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                self.drawing, self._due = self._due, None
                prompt, options = self.prompt, dict(self.options)
            t0 = time.monotonic()
            answer = self._draw(prompt, options)
            self._grabbed.set()
            end = time.monotonic()
            self._next_ok = end + (end - t0) * (1 - SHARE) / SHARE
            with self._cv:
                if answer is not None and prompt == self.prompt:   # not replaced meanwhile
                    self._answers.append(answer)
                self.drawing = None
                self._changed()
                self._cv.notify_all()   # (finish() waits on it)

    def _draw(self, prompt: str, options: dict) -> Optional[dict]:
        # light: torch away from %load_ext (the magics' summary reads answers_html from here)
        from megatrain_nb.engine.compute.sampling import sample_text

        s = self.session
        engine = s.engine
        if engine is None or s.released:
            return None
        try:
            with engine.lock:   # re-entrant: sample_text takes it again; the step read here is the weights'
                self._grabbed.set()
                step = s.step
                with self._cv:
                    self.drawing = step
                    self._changed()
                text = sample_text(engine, s.tokenizer, prompt, top_k=None, answer_only=True, **options)
        except Exception as e:  # noqa: BLE001 - shown in place of the answer, never raised into training
            text, step = f"(no answer: {type(e).__name__}: {e})", s.step
        return {"step": step, "answer": text, "time": time.time()}

    def _changed(self) -> None:   # with self._cv held
        self.version += 1
        log = getattr(self.session, "run_log", None)
        if log is not None:
            log.touch()


def answers_html(watch: Optional[SampleWatch], last: int = 5) -> str:
    """The prompt's last message and the last ``last`` answers, newest first, each with its step
    ("" while no sample prompt is set)."""
    if watch is None or watch.prompt is None:
        return ""
    answers = watch.answers()[-last:][::-1]
    asked = html.escape(str((watch.messages or [{}])[-1].get("content", "")))
    rows = "".join(
        f"<tr style='{'font-weight:600' if i == 0 else 'color:#666'}'><td style='padding-right:8px;"
        f"white-space:nowrap;vertical-align:top'>step {a['step']}</td><td style='white-space:pre-wrap'>"
        f"{html.escape(a['answer']) or '<i>(empty)</i>'}</td></tr>" for i, a in enumerate(answers))
    pending = (f"<div style='color:#888'>drawing the answer at step {watch.drawing}…</div>"
               if watch.drawing is not None else "")
    how = f"every {watch.every} steps, " + ("greedy: a new answer is a change of weights"
                                              if not watch.options.get("temperature") else
                                              f"temperature {watch.options['temperature']:g}")
    if watch.skipped:
        how += (f"; {watch.skipped} answer{'s' if watch.skipped != 1 else ''} skipped: drawing answers may take at "
                f"most {SHARE:.0%} of the run's time, so a slow sample spaces them out (the last one is drawn at "
                "the end)")
    return (f"<div class='mtnb-samples' style='font-size:12px;font-family:sans-serif'>"
            f"<b>Answers to the sample prompt</b> <span style='color:#888'>({how})</span>"
            f"<div>prompt: <code>{asked}</code></div>"
            f"<table>{rows}</table>{pending}</div>")

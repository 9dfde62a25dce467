"""Session: train in one background thread, steer the run from the notebook.

Example::

    import megatrain_nb as mt
    session = mt.Session("tiny")            # built-in default; or a model / local folder
    session.train()                         # returns at once; the dashboard shows the run
    session.pause(); session.set_lr(5e-4); session.resume()
    session.inspect(2)                      # layers.2: norms, update ratio, histogram
    session.wait()                          # re-raises a training error
    session.export_report("run.html")

Threads: the training thread drives ``trainer.iter_steps()`` and, between two steps, applies
the commands the controls enqueued (each recorded as an event at that step). It never touches
widgets; it appends to a :class:`RunLog` that a publisher (see ``publisher.py``) reads.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

from megatrain_nb.threads import SESSION, thread_name
from . import registry
from .display_mode import in_kernel, resolve_mode
from .lifecycle import ENDED, LIVE
from .branches import Explorer
from .run_log import RunLog


@runtime_checkable
class TrainerLike(Protocol):
    """All a Session needs from a trainer (``megatrain_nb.trainer.Trainer`` provides it)."""

    total_steps: Any
    engine: Any

    def iter_steps(self, resume_from_checkpoint: Any = None): ...
    def set_lr(self, lr: float) -> None: ...
    def save_checkpoint(self, path: Optional[str] = None) -> str: ...
    def request_stop(self) -> None: ...


#: Commands only the notebook's own Session applies at a step boundary (exploration: issue 21);
#: they never come through the inbox, the server or the ranks' run control.
SESSION_COMMANDS = ("snapshot", "rewind", "fork")


@dataclass
class QueuedCommand:
    kind: str  # a name in megatrain_nb.commands.COMMANDS (pause | resume | lr | checkpoint | stop)
    #            or in SESSION_COMMANDS
    value: Any = None
    source: str = "notebook"
    future: Optional[Future] = None

    def __post_init__(self):
        from megatrain_nb.commands import COMMANDS

        if self.kind not in COMMANDS and self.kind not in SESSION_COMMANDS:
            known = ", ".join(list(COMMANDS) + list(SESSION_COMMANDS))
            raise ValueError(f"unknown command {self.kind!r}: expected one of {known}")


class Session:
    """A training run driven from a notebook (see the module docstring).

    ``model``: a transformers ``*ForCausalLM`` (possibly on the meta device), a local model
    folder (``config.json`` + safetensors; its tokenizer is used when ``tokenizer`` is None),
    a Hugging Face Hub id (``"Qwen/Qwen2.5-0.5B"``: config, tokenizer and safetensors fetched
    into the HF cache; ``revision=``/``token=`` go with the options), or a preset name of the built-in default (``"micro"``, ``"tiny"``, ``"small"``...; with
    no ``train_dataset`` it trains on the built-in corpus and tokenizer, nothing downloaded).
    ``train_dataset``/``eval_dataset``/``args``/``tokenizer``: as for ``mt.Trainer``.
    ``name``: how ``%megatrain -s NAME`` and the JupyterLab sidebar call it (default
    "session-N"). ``seq_len``: block length for text datasets and the built-in corpus.
    ``loss_fn``: a custom loss, handed to the Trainer. ``**engine_options``: any
    ``EngineConfig`` field (``offload_dir=``, ``optimizer_compression=``, ``device=``...).
    ``nproc_per_node=N``: train on N local ranks in worker processes (``remote.py``); the
    object is then a :class:`~megatrain_nb.notebook.remote.RemoteSession` with this API.

    >>> session = Session("micro", seq_len=32)                  # doctest: +SKIP
    >>> session.train(); session.wait()                         # doctest: +SKIP
    'finished'
    """

    def __new__(cls, *args: Any, nproc_per_node: Optional[int] = None, **kwargs: Any):
        # nproc_per_node=N: the ranks train in N worker processes, this object steers them
        if cls is Session and nproc_per_node is not None:
            from .remote import RemoteSession

            return super().__new__(RemoteSession)
        return super().__new__(cls)

    @classmethod
    def attach(cls, name: str, **kw: Any) -> "Session":
        """Follow and steer a run started with torchrun on this machine (``mt.Trainer.train()``
        inside; rank 0 announces it under ``name``): history, events, dashboard, pause / resume
        / set_lr / save_checkpoint / stop. Raises LookupError listing the runs there are."""
        from .remote import RemoteSession

        return RemoteSession.attach(name, **kw)

    def __init__(self, model: Any, train_dataset: Any = None, args: Any = None, tokenizer: Any = None,
                 eval_dataset: Any = None, name: Optional[str] = None, *, seq_len: Optional[int] = None,
                 loss_fn: Any = None, snapshot_steps: Optional[int] = None, keep_snapshots: Optional[int] = None,
                 **engine_options: Any):
        from .model_source import build_trainer

        options = dict(engine_options)
        if loss_fn is not None:
            options["loss_fn"] = loss_fn
        trainer, tokenizer = build_trainer(
            model, train_dataset=train_dataset, args=args, tokenizer=tokenizer,
            eval_dataset=eval_dataset, seq_len=seq_len, trainer_options=options)
        self._setup(trainer, tokenizer, name, model_ref=model, engine_options=engine_options)
        self._explore = Explorer(self, snapshot_steps, keep_snapshots)

    @classmethod
    def from_trainer(cls, trainer: TrainerLike, *, tokenizer: Any = None, name: Optional[str] = None,
                     resume_from_checkpoint: Any = None) -> "Session":
        """A Session around a trainer you built (``mt.Trainer(...)`` or anything TrainerLike)."""
        missing = [m for m in ("iter_steps", "set_lr", "save_checkpoint", "request_stop")
                   if not callable(getattr(trainer, m, None))]
        if missing:
            raise TypeError(f"{type(trainer).__name__} is not a trainer a Session can drive: "
                            f"it lacks {', '.join(missing)}")
        self = cls.__new__(cls)
        self._setup(trainer, tokenizer if tokenizer is not None else getattr(trainer, "tokenizer", None),
                    name, model_ref=None, engine_options={})
        self._resume = resume_from_checkpoint
        return self

    @classmethod
    def from_checkpoint(cls, path: Any, train_dataset: Any = None, args: Any = None, tokenizer: Any = None,
                        eval_dataset: Any = None, name: Optional[str] = None, **engine_options: Any) -> "Session":
        """A Session that resumes exactly from a checkpoint folder written by ``save_checkpoint``."""
        self = cls(path, train_dataset=train_dataset, args=args, tokenizer=tokenizer,
                   eval_dataset=eval_dataset, name=name, **engine_options)
        self._resume = str(path)
        return self

    def _setup(self, trainer, tokenizer, name, *, model_ref, engine_options) -> None:
        self._trainer = trainer
        self._tokenizer = tokenizer
        self.id = uuid.uuid4().hex[:12]
        self.name = str(name) if name else registry.next_default_name()
        self._log = RunLog()
        self._commands: "queue.Queue[QueuedCommand]" = queue.Queue()
        self._cv = threading.Condition()
        self._state = "idle"
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._error_tb: Optional[str] = None
        self._error_tb_obj = None
        self._released = False
        self._resume: Any = None
        self._requested_lr: Optional[float] = None
        self._pending_lr: Optional[float] = None
        self._samples: list[dict] = []
        self._beacon = None
        self._live = None  # publisher.LiveView while displayed
        self._dashboard = None
        self._started_at: Optional[float] = None
        self._ended_at: Optional[float] = None
        self._model_ref = model_ref
        self._engine_options = dict(engine_options)
        self._explore = Explorer(self)   # snapshots, rewind, fork (branches.py)
        registry.register(self)
        if in_kernel():  # import the display stack now (plotly's FigureWidget: ~1.5 s), not in train()
            from .dashboard import warm_up

            warm_up()

    # ---- what the run looks like -------------------------------------------------------------
    @property
    def state(self) -> str:
        """"idle" | "running" | "paused" | "stopped" | "finished" | "failed"."""
        return self._state

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        last = self._log.last_record()
        return int(last.get("step", 0) or 0)

    @property
    def total_steps(self) -> Optional[int]:
        """Optimizer steps the run plans (None when the trainer cannot tell)."""
        total = getattr(self._trainer, "total_steps", None)
        return int(total) if isinstance(total, (int, float)) and total > 0 else None

    @property
    def history(self) -> list[dict]:
        """One record per optimizer step (step, loss, lr, tokens_per_s, memory, ...)."""
        return self._log.records()

    @property
    def events(self) -> list[dict]:
        """Interventions in order: pause, resume, lr, checkpoint, stop, error (each with its step)."""
        return self._log.events()

    @property
    def samples(self) -> list[dict]:
        """What ``generate`` produced: {"step", "prompt", "text"}."""
        return list(self._samples)

    @property
    def error(self) -> Optional[BaseException]:
        """The exception that ended a failed run (None otherwise); ``wait()`` re-raises it."""
        return self._error

    @property
    def error_traceback(self) -> Optional[str]:
        """The training thread's formatted traceback when the run failed, else None."""
        return self._error_tb

    @property
    def wall_time_s(self) -> Optional[float]:
        """Seconds from ``train()`` to the end of the run (to its latest step while it runs);
        None before ``train()``."""
        if self._started_at is None:
            return None
        end = self._ended_at or self._log.last_record().get("time", self._started_at)
        return end - self._started_at

    @property
    def trainer(self) -> Any:
        """The trainer the session drives (an ``mt.Trainer`` unless built ``from_trainer``)."""
        return self._trainer

    @property
    def engine(self) -> Any:
        """The trainer's StreamingEngine (None for a trainer without one)."""
        return getattr(self._trainer, "engine", None)

    @property
    def released(self) -> bool:
        """True once the engine is released (device memory, threads, disk files): nothing left
        to checkpoint, sample or inspect."""
        return self._released

    @property
    def tokenizer(self) -> Any:
        """The tokenizer ``generate`` and text datasets use (None if there is none)."""
        return self._tokenizer

    @property
    def run_log(self) -> RunLog:
        """The thread-safe log of records and events the dashboard and reports read."""
        return self._log

    @property
    def lr(self) -> Optional[float]:
        """The learning rate of the latest step (a set_lr not applied yet counts)."""
        if self._pending_lr is not None:
            return self._pending_lr
        v = self._log.last_record().get("lr")
        if v is None:
            v = self._configured_lr()
        return float(v) if v is not None else None

    def _configured_lr(self) -> Optional[float]:
        """The learning rate the run was set up with (before any step logged one)."""
        return getattr(getattr(self._trainer, "args", None), "learning_rate", None)

    @property
    def publisher(self) -> Any:
        """The publisher pushing this run to the notebook display, while one is shown (else None)."""
        return self._live

    @property
    def requested_lr(self) -> Optional[float]:
        """The last value given to ``set_lr`` (by code, magic, widget or sidebar), or None."""
        return self._requested_lr

    # ---- lifecycle ---------------------------------------------------------------------------
    def train(self, block: bool = False, dashboard: Any = None) -> None:
        """Start training in a background thread and return at once (``block=True`` waits).

        In a notebook the dashboard is displayed; ``dashboard`` picks how: None = auto (widgets
        when a widget frontend is connected, else a live HTML summary), "widgets", "html", or
        False for nothing.
        """
        mode = resolve_mode(dashboard)
        with self._cv:
            if self._state in LIVE:
                return
            if self._state in ENDED:
                raise RuntimeError(
                    f"session {self.name!r} has {self._state}; a run cannot be restarted. Start a "
                    "new Session, or mt.Session.from_checkpoint(path) from a saved checkpoint.")
            self._state = "running"
            self._started_at = time.time()
            self._thread = threading.Thread(target=self._run, name=thread_name(SESSION, self.name), daemon=True)
        registry.make_current(self)
        self._start_beacon()
        if mode is not None:  # display first: the training thread would slow the widget set-up down
            try:
                from .publisher import WIDGET_MODES, show_live

                self._live = show_live(self, mode, self._widget() if mode in WIDGET_MODES else None)
            except Exception as e:  # noqa: BLE001 - the run matters more than its display
                print(f"megatrain_nb: the dashboard could not be shown ({type(e).__name__}: {e}); "
                      "training goes on (session.dashboard() tries again)", file=sys.stderr)
        self._thread.start()
        if block:
            self.wait()

    def wait(self, timeout: Optional[float] = None, *, until_step: Optional[int] = None) -> str:
        """Block until the run is finished, stopped or failed (or, with ``until_step``, has done
        that many optimizer steps); returns the state ("running"/"paused" if ``timeout`` ran
        out first). A training error is re-raised here with the training thread's traceback."""
        t = self._thread
        if t is None:
            return self._state
        try:
            if until_step is not None:
                with self._cv:
                    self._cv.wait_for(lambda: self.step >= until_step or self._state in ENDED, timeout)
            else:
                t.join(timeout)
        except KeyboardInterrupt:
            print(f"megatrain_nb: stopped waiting; session {self.name!r} keeps training in the "
                  "background (session.stop() ends it).", file=sys.stderr)
            raise
        if self._state in ENDED and t is not threading.current_thread():
            t.join()  # quick once the state says so (the beacon and publisher are told last)
            if self._live is not None:
                self._live.final_from_caller()
        if self._state == "failed" and self._error is not None:
            raise self._error.with_traceback(self._error_tb_obj)
        return self._state

    def close(self) -> None:
        """Release the engine (device memory, worker threads, disk-tier files). A finished run
        keeps its weights for ``generate``/``inspect`` until this (or ``stop``) is called."""
        if self._state in LIVE:
            self.stop(wait=True)
            return
        self._release()
        registry.forget(self)

    # ---- controls: enqueue; the training thread applies them at a step boundary ----------------
    def pause(self, *, source: str = "notebook") -> None:
        """Pause after the current step (the step count then holds still)."""
        self._enqueue(QueuedCommand("pause", source=source))

    def resume(self, *, source: str = "notebook") -> None:
        """Continue a paused run from the step it paused at."""
        self._enqueue(QueuedCommand("resume", source=source))

    def set_lr(self, lr: float, *, source: str = "notebook") -> None:
        """From the next optimizer step the learning rate is ``lr``; a schedule carries on
        relative to it (a constant schedule stays at ``lr``). Recorded as an event."""
        from megatrain_nb.learning_rate import check_learning_rate

        value = check_learning_rate(lr)
        self._check_not_ended("change the learning rate of")
        self._requested_lr = self._pending_lr = value  # before the command: it may apply at once
        self._commands.put(QueuedCommand("lr", value, source=source))

    def save_checkpoint(self, path: Optional[str] = None, *, wait: bool = True,
                        source: str = "notebook") -> Optional[str]:
        """Write a checkpoint (weights + optimizer states + data position) at the next step
        boundary; with ``wait`` returns its path, else returns None (the event has the path)."""
        if self._released:
            raise RuntimeError(f"session {self.name!r} released its model when it {self._state}; "
                               "nothing left to checkpoint")
        t = self._thread
        if t is None or not t.is_alive() or t is threading.current_thread():
            return self._do_checkpoint(path, source)  # nothing else is training: write it here
        fut: Future = Future()
        self._commands.put(QueuedCommand("checkpoint", path, source, fut))
        if not wait:
            return None
        while True:
            try:
                return fut.result(timeout=0.25)
            except FuturesTimeout:
                if not t.is_alive() and not fut.done():  # the run ended before reaching it
                    if self._released:
                        raise RuntimeError(f"session {self.name!r} {self._state} before the checkpoint "
                                           "was written, and released its model") from None
                    return self._do_checkpoint(path, source)

    # ---- explore: snapshots, rewind, fork (the logic is in branches.py) ------------------------------
    @property
    def explorer(self) -> Explorer:
        """This run's snapshots and branches (``branches.Explorer``)."""
        return self._explore

    def snapshot(self):
        """Take a snapshot at the next step boundary (now, if nothing is training) and return its
        ``SnapshotInfo``. On the disk tier it hard-links the files and writes only RAM state."""
        return self._at_boundary("snapshot", None)

    @property
    def snapshots(self) -> list:
        """The snapshots this run can rewind to (checkpoints count): step, time, branch, path,
        bytes unique / shared."""
        return self._explore.snapshots()

    def rewind(self, step: int):
        """Go back to the snapshot at ``step``; ``train()``/``resume()`` continues from there. While
        running: at the next step boundary, then paused. The abandoned steps stay a branch."""
        if self._released:
            raise RuntimeError(f"session {self.name!r} {self._state} and released its model: nothing to rewind. "
                               "mt.Session.from_checkpoint(<a snapshot folder>) starts from one")
        self._explore.find(step)   # a step without a snapshot fails here, listing those that have one
        info = self._at_boundary("rewind", step)
        if self._state in ENDED + ("idle",):   # finished (it kept its model) or not started: train() goes on from it
            self._resume = self._explore.take_restart()
            self._ended_at = None
            self._set_state("idle")
        return info

    def fork(self, step: Optional[int] = None, name: Optional[str] = None, **changes: Any) -> "Session":
        """A new Session (a branch) from the snapshot at ``step`` (default: a snapshot now) with
        ``changes`` (learning_rate, lr_scheduler_type, warmup_steps, weight_decay, max_grad_norm,
        max_steps, gradient_accumulation_steps, data_seed, train_dataset, loss_fn). It shares this
        session's engine: starting it pauses this one (one branch trains at a time). ``device=``
        another device than this session's: an engine of its own there, trained side by side."""
        from .branches import check_changes

        check_changes(changes)
        if self._released:
            raise RuntimeError(f"session {self.name!r} released its model: nothing to fork")
        if step is not None:
            self._explore.find(step)   # no snapshot there: the error lists the steps that have one
        return self._at_boundary("fork", (step, name, changes))

    def _at_boundary(self, kind: str, value: Any):
        t = self._thread
        if t is None or not t.is_alive() or t is threading.current_thread():
            return self._explore.apply(kind, value)
        fut: Future = Future()
        self._commands.put(QueuedCommand(kind, value, "notebook", fut))
        while True:
            try:
                return fut.result(timeout=0.25)
            except FuturesTimeout:
                if not t.is_alive() and not fut.done():   # the run ended before reaching it
                    return self._at_boundary(kind, value)

    def stop(self, checkpoint: Any = False, *, wait: Optional[bool] = None, timeout: Optional[float] = None,
             source: str = "notebook") -> None:
        """End the run after the current step and release device memory, threads and disk
        files. ``checkpoint=True`` (or a path) writes a checkpoint first. ``wait`` defaults to
        True on the main thread (returns once released) and False elsewhere (e.g. the beacon)."""
        if wait is None:
            wait = threading.current_thread() is threading.main_thread()
        state = self._state
        if state == "idle":  # never started: nothing runs, end it here
            try:
                if checkpoint:
                    self._do_checkpoint(None if checkpoint is True else str(checkpoint), source)
                self._log.add_event("stop", self.step, source=source)
            finally:
                self._end("stopped")
            return
        if state in ENDED:
            self._release()
            return
        self._commands.put(QueuedCommand("stop", checkpoint, source))
        if wait and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._state == "finished":  # it finished before reaching the stop: release anyway
                self._release()

    def _enqueue(self, cmd: QueuedCommand) -> None:
        self._check_not_ended(cmd.kind)
        self._commands.put(cmd)

    def _check_not_ended(self, what: str) -> None:
        if self._state in ENDED:
            raise RuntimeError(f"session {self.name!r} has {self._state}: nothing to {what}")

    # ---- looking inside ------------------------------------------------------------------------
    def unit_names(self) -> list[str]:
        """The model's streaming units in order ("embed", "layers.0", ..., "head"): what
        ``inspect`` takes."""
        names = self._log.units()
        if not names and self.engine is not None:
            try:
                names = list(self.engine.unit_names())
            except Exception:  # noqa: BLE001 - a released engine
                names = []
        return names

    def inspect(self, layer: Any):
        """Statistics of one unit from the last optimizer step: weight and gradient norms,
        update norm, update-to-weight ratio, a weight histogram, and its history.

        ``layer``: a decoder layer index (negative counts from the end), or a unit name
        ("embed", "layers.3", "head")."""
        from .inspector import LayerReport, resolve_unit

        unit = resolve_unit(layer, self.unit_names())
        stats = self._log.layer(unit)
        if stats is None:
            raise LookupError(f"no statistics for {unit!r} yet: they are gathered at each optimizer "
                              "step; train at least one step first")
        hist = {m: self._log.unit_series(unit, m) for m in ("grad_norm", "update_ratio")}
        return LayerReport(stats, unit=unit, history=hist)

    def set_sample_prompt(self, messages: Any) -> None:
        """The conversation (a list of ``{"role", "content"}``) that ``generate()`` without a prompt
        answers, rendered with the tokenizer's chat template, so samples show the answers change."""
        from megatrain_nb.trainer.sft_view import chat_prompt

        chat_prompt(self._tokenizer, messages)   # refused now, not at the next sample, if it cannot render
        self._sample_messages = list(messages)

    def trained_on(self, index: int = 0):
        """One training example with the tokens that count toward the loss highlighted (HTML)."""
        from megatrain_nb.trainer.sft_view import trained_on_view

        return trained_on_view(self._trainer, index)

    def generate(self, prompt: str = "", max_new_tokens: int = 50, *, temperature: float = 0.8,
                 top_k: Optional[int] = 50, seed: Optional[int] = None) -> str:
        """Sample from the model as it is now (safe while training runs or is paused: the
        sample is drawn between two training micro-batches). No prompt: the conversation set
        with :meth:`set_sample_prompt`, if any."""
        from .sampling import sample_text

        if not prompt and getattr(self, "_sample_messages", None):
            from megatrain_nb.trainer.sft_view import chat_prompt

            prompt = chat_prompt(self._tokenizer, self._sample_messages)

        if self._released or self.engine is None:
            raise RuntimeError(f"session {self.name!r} released its model when it {self._state}; "
                               "load the last checkpoint (mt.Session.from_checkpoint) to sample")
        text = sample_text(self.engine, self._tokenizer, prompt, max_new_tokens=max_new_tokens,
                           temperature=temperature, top_k=top_k, seed=seed)
        self._samples.append({"step": self.step, "prompt": prompt, "text": text, "time": time.time()})
        self._log.touch()
        return text

    def dashboard(self):
        """The dashboard widget (display it again anywhere); it stays live while the run does."""
        from .publisher import make_live

        d = self._widget()
        self._live = make_live(self, d, self._live)
        return d

    def _widget(self):
        if self._dashboard is None:  # one per session: every display of it shows the same widgets
            from .dashboard import Dashboard

            self._dashboard = Dashboard(self)
        return self._dashboard

    def export_report(self, path: str) -> str:
        """Write a report of the run: ``.ipynb`` (nbformat) or ``.html`` (nbconvert), with
        static offline figures. Returns the path written."""
        from .report import export_report

        return export_report(self, path)

    def summary(self) -> dict:
        """A small JSON-able picture of the run (used by the magic and the HTML summary)."""
        last = self._log.last_record()
        return {"id": self.id, "name": self.name, "state": self._state, "step": self.step,
                "total_steps": self.total_steps, "loss": last.get("loss"), "lr": last.get("lr"),
                "tokens_per_s": last.get("tokens_per_s"), "events": len(self._log.events()),
                "error": None if self._error is None else f"{type(self._error).__name__}: {self._error}",
                "diverged_at": getattr(self._error, "step", None) if _is_divergence(self._error) else None,
                "skipped_steps": last.get("skipped_steps") or 0}

    @property
    def diverged(self) -> bool:
        """True when the run stopped on a NaN/inf loss or gradient (see ``on_nonfinite``)."""
        return _is_divergence(self._error)

    def __repr__(self) -> str:
        total = self.total_steps
        return (f"<megatrain_nb.Session {self.name!r} {self._state} step {self.step}"
                f"{'/' + str(total) if total else ''}>")

    def _repr_html_(self) -> str:
        from .summary_html import summary_html

        return summary_html(self, self._log.view())

    # ---- the training thread -----------------------------------------------------------------------
    def _run(self) -> None:
        it = None
        outcome = "finished"
        try:
            if self.engine is not None:   # the dashboard reads layer statistics after every step:
                self.engine.layer_stats()  # the engine gathers them once asked, so from step 1
            self._explore.activate()   # branches sharing the engine: this one's state in it
            it = iter(self._trainer.iter_steps(resume_from_checkpoint=self._resume))
            while True:
                if self._apply_commands():
                    outcome = "stopped"
                    break
                restart = self._explore.take_restart()   # rewound, or back from another branch
                if restart is not None:
                    it.close()
                    it = iter(self._trainer.iter_steps(resume_from_checkpoint=restart))
                try:
                    record = next(it)
                except StopIteration:
                    break
                self._on_record(record)
        except BaseException as e:  # noqa: BLE001 - surfaces in wait() and the dashboard
            outcome = "failed"
            self._fail(e)
        finally:
            if it is not None and hasattr(it, "close"):
                try:
                    it.close()
                except Exception:  # noqa: BLE001 - already ending
                    pass
            self._explore.settle()   # an automatic snapshot completing in the background: logged
            self._drain_commands(outcome)
            self._end(outcome)

    def _on_record(self, record: dict) -> None:
        engine = self.engine
        stats = engine.layer_stats() if engine is not None else None
        if stats:
            self._log.add_layer_stats(int(record.get("step", 0) or 0), list(stats))
        self._log.add_record(record)
        self._explore.on_record(record)
        with self._cv:
            self._cv.notify_all()

    def _apply_commands(self) -> bool:
        """Apply what is queued; while paused, wait here for more. True means stop."""
        while True:
            paused = self._state == "paused"
            t0 = time.monotonic()
            try:
                cmd = self._commands.get() if paused else self._commands.get_nowait()
            except queue.Empty:
                return False
            if paused:
                self._log.add_paused_time(time.monotonic() - t0)
            if self._apply(cmd):
                return True

    def _apply(self, cmd: QueuedCommand) -> bool:
        step = self.step
        try:
            if cmd.kind == "pause" and self._state == "running":
                self._set_state("paused")
                self._log.add_event("pause", step, source=cmd.source)
            elif cmd.kind == "resume" and self._state == "paused":
                self._explore.activate()   # another branch trained meanwhile: switch back
                self._set_state("running")
                self._log.add_event("resume", step, source=cmd.source)
            elif cmd.kind == "lr":
                previous = self._log.last_record().get("lr")
                self._trainer.set_lr(cmd.value)
                self._log.add_event("lr", step, value=cmd.value, previous=previous, source=cmd.source)
                if self._pending_lr == cmd.value:
                    self._pending_lr = None
            elif cmd.kind in ("snapshot", "rewind", "fork"):
                result = self._explore.apply(cmd.kind, cmd.value, cmd.source)
                if cmd.kind == "rewind" and self._state == "running":
                    self._set_state("paused")
                    self._log.add_event("pause", result.step, source="rewind")
                cmd.future.set_result(result)
            elif cmd.kind == "checkpoint":
                path = self._do_checkpoint(cmd.value, cmd.source)
                if cmd.future is not None:
                    cmd.future.set_result(path)
            elif cmd.kind == "stop":
                if cmd.value:
                    self._do_checkpoint(None if cmd.value is True else str(cmd.value), cmd.source)
                self._trainer.request_stop()
                self._log.add_event("stop", step, source=cmd.source)
                return True
        except Exception as e:  # noqa: BLE001 - a failed control must not kill the run
            if cmd.future is not None and not cmd.future.done():
                cmd.future.set_exception(e)
            self._log.add_event(f"{cmd.kind}_failed", step, error=f"{type(e).__name__}: {e}",
                                source=cmd.source)
            if cmd.kind == "stop":
                return True
        return False

    def _do_checkpoint(self, path: Optional[str], source: str) -> str:
        try:
            written = str(self._trainer.save_checkpoint(path))
        except Exception as e:
            if threading.current_thread() is not self._thread:
                self._log.add_event("checkpoint_failed", self.step, error=f"{type(e).__name__}: {e}",
                                    source=source)
            raise
        self._log.add_event("checkpoint", self.step, path=written, source=source)
        return written

    def _drain_commands(self, outcome: str) -> None:
        # Whoever waits on a checkpoint that will never be written must hear about it.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd.future is not None and not cmd.future.done():
                cmd.future.set_exception(RuntimeError(f"the run {outcome} before the {cmd.kind} was applied"))

    def _fail(self, e: BaseException) -> None:
        self._error = e
        self._error_tb_obj = e.__traceback__
        self._error_tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        self._log.add_event("error", self.step, error=f"{type(e).__name__}: {e}", traceback=self._error_tb)

    def _set_state(self, state: str) -> None:
        with self._cv:
            self._state = state
            self._cv.notify_all()
        self._log.touch()

    def _end(self, outcome: str) -> None:
        if outcome != "finished":
            self._release()  # a finished run keeps its weights for generate()/inspect()
        self._ended_at = time.time()
        self._set_state(outcome)
        self._stop_beacon()
        if self._live is not None:
            self._live.run_ended()

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._explore.engine_shared():   # branches still use the engine: the last one closes it
            return
        closer = getattr(self._trainer, "close", None)
        if not callable(closer):
            closer = getattr(self.engine, "close", None)
        if callable(closer):
            try:
                closer()
            except Exception as e:  # noqa: BLE001 - report, but finish ending the run
                print(f"megatrain_nb: releasing session {self.name!r} failed: {e}", file=sys.stderr)

    def _start_beacon(self) -> None:
        from megatrain_nb.lab.beacon import SessionBeacon

        try:
            self._beacon = SessionBeacon(self).start()
        except Exception as e:  # noqa: BLE001 - the sidebar is optional; training is not
            print(f"megatrain_nb: the JupyterLab beacon did not start ({e})", file=sys.stderr)
            self._beacon = None

    def _stop_beacon(self) -> None:
        if self._beacon is not None:
            try:
                self._beacon.stop()
            except Exception:  # noqa: BLE001
                pass
            self._beacon = None


def _is_divergence(error) -> bool:
    from ..engine.finite import NonFiniteError

    return isinstance(error, NonFiniteError)

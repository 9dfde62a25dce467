"""Session: train in the background, steer the run from the notebook.

Example::

    import megatrain_nb as mt
    session = mt.Session("tiny")            # built-in default; or a model / local folder
    session.train()                         # returns at once; the dashboard shows the run
    session.pause(); session.set_lr(5e-4); session.resume()
    session.inspect(2)                      # layers.2: norms, update ratio, histogram
    session.wait()                          # re-raises a training error
    session.export_report("run.html")

One Session class, composed of: a run controller chosen at construction (``run_state.RunController``:
``thread_run.ThreadRun`` trains in a background thread of this kernel, ``remote.ProcessRun`` in
worker processes, launched with ``nproc_per_node=N`` or followed with ``Session.attach``); the
state, log and command queue the two share (``run_state.RunState``); the display and the
JupyterLab beacon (``session_view.SessionView``); snapshots and branches (``branches.Explorer``).
Every control is a command of the one table (``megatrain_nb/commands.py``), applied by the run
controller at a step boundary.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

from megatrain_nb import export as export_model
from megatrain_nb.commands import check_command
from megatrain_nb.threads import SESSION, thread_name
from megatrain_nb.trainer.sft_view import trained_on_view
from megatrain_nb.values import check
from . import registry
from .branches import Explorer
from .controls import SessionControls
from .display_mode import in_kernel, resolve_mode
from .inspector import LayerReport, resolve_unit
from .lifecycle import ENDED, LIVE
from .model_source import build_trainer
from .remote import ProcessRun, find_run
from .run_state import Order, RunState, TrainerLike  # noqa: F401 - re-exported
from .samples import Samples
from .sample_watch import SampleWatch
from .session_readout import SessionReadout
from .session_view import SessionView
from .thread_run import ThreadRun


class Session(SessionReadout):
    """A training run driven from a notebook (see the module docstring).

    ``model``: a transformers ``*ForCausalLM`` (possibly on the meta device), a local model
    folder (``config.json`` + safetensors; its tokenizer is used when ``tokenizer`` is None),
    a Hugging Face Hub id (``"Qwen/Qwen2.5-0.5B"``: config, tokenizer and safetensors fetched
    into the HF cache; ``revision=``/``token=`` go with the options), or a preset name of the built-in default (``"micro"``, ``"tiny"``, ``"small"``...; with
    no ``train_dataset`` it trains on the built-in corpus and tokenizer, nothing downloaded).
    ``train_dataset``/``eval_dataset``/``args``/``tokenizer``: as for ``mt.Trainer`` (a
    ``trl.SFTConfig`` / ``DPOConfig`` builds an ``mt.SFTTrainer`` / ``DPOTrainer``; a ``GRPOConfig``
    with ``reward_funcs=`` an ``mt.GRPOTrainer``, the prompts as ``train_dataset``).
    ``name``: how ``%megatrain -s NAME`` and the JupyterLab sidebar call it (default
    "session-N"). ``seq_len``: block length for text datasets and the built-in corpus.
    ``loss_fn``: a custom loss, handed to the Trainer. ``snapshot_steps``/``keep_snapshots``:
    automatic snapshots (``branches.py``). ``**engine_options``: any ``EngineConfig`` field
    (``offload_dir=``, ``optimizer_compression=``, ``device=``...).
    ``nproc_per_node=N``: train on N local ranks in worker processes (``remote.py``; also
    ``callbacks=`` and ``save_model=``); the Session then also has ``nproc_per_node``,
    ``output_dir``, ``ranks``, ``worker_log``, ``launch_info()`` and ``run_dir`` (its run
    controller's), and refuses what needs the weights in this kernel (``inspect``, ``generate``);
    its ranks take the snapshots and rewinds, and ``fork`` launches new ranks (``rank_fork.py``).

    >>> session = Session("micro", seq_len=32)                  # doctest: +SKIP
    >>> session.train(); session.wait()                         # doctest: +SKIP
    'finished'
    """

    def __init__(self, model: Any, train_dataset: Any = None, args: Any = None, tokenizer: Any = None,
                 eval_dataset: Any = None, name: Optional[str] = None, *, seq_len: Optional[int] = None,
                 loss_fn: Any = None, snapshot_steps: Optional[int] = None, keep_snapshots: Optional[int] = None,
                 nproc_per_node: Optional[int] = None, **engine_options: Any):
        given = dict(train_dataset=train_dataset, args=args, tokenizer=tokenizer, eval_dataset=eval_dataset,
                     seq_len=check("seq_len", seq_len))
        snapshot_steps, keep_snapshots = check("snapshot_steps", snapshot_steps), check("keep_snapshots", keep_snapshots)
        if nproc_per_node is not None:   # the ranks train in worker processes; this object steers them
            make = ProcessRun.factory(nproc_per_node, model, loss_fn=loss_fn, engine_options=engine_options,
                                      snapshots=(snapshot_steps, keep_snapshots), **given)
            self._setup(make, None, tokenizer, name)
            return
        options = dict(engine_options)
        if loss_fn is not None:
            options["loss_fn"] = loss_fn
        trainer, tokenizer = build_trainer(model, trainer_options=options, **given)
        self._setup(lambda status, explorer, ident: ThreadRun(status, trainer, explorer), trainer, tokenizer, name,
                    snapshots=(snapshot_steps, keep_snapshots))

    @classmethod
    def attach(cls, name: str, *, root: Any = None, dashboard: Any = None) -> "Session":
        """Follow and steer a run started with torchrun on this machine (``mt.Trainer.train()``
        inside; rank 0 announces it under ``name``): history, events, dashboard, pause / resume
        / set_lr / save_checkpoint / stop. Raises LookupError listing the runs there are."""
        beat = find_run(name, root)
        self = cls.__new__(cls)
        self._setup(lambda status, explorer, ident: ProcessRun.attaching(status, beat, root, explorer), None, None,
                    beat.get("name"), ident=beat["id"])
        self.train(dashboard=dashboard)
        return self

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
        self._setup(lambda status, explorer, ident: ThreadRun(status, trainer, explorer, resume_from_checkpoint),
                    trainer, tokenizer if tokenizer is not None else getattr(trainer, "tokenizer", None), name)
        return self

    @classmethod
    def from_run_controller(cls, make_run: Any, *, tokenizer: Any = None, name: Optional[str] = None) -> "Session":
        """A Session around the run controller ``make_run(status, explorer, session_id)`` builds
        (``run_state.RunController``; e.g. the fork of a run in worker processes, ``rank_fork.py``)."""
        self = cls.__new__(cls)
        self._setup(make_run, None, tokenizer, name)
        return self

    @classmethod
    def from_checkpoint(cls, path: Any, train_dataset: Any = None, args: Any = None, tokenizer: Any = None,
                        eval_dataset: Any = None, name: Optional[str] = None, **engine_options: Any) -> "Session":
        """A Session that resumes exactly from a checkpoint folder written by ``save_checkpoint``."""
        self = cls(path, train_dataset=train_dataset, args=args, tokenizer=tokenizer,
                   eval_dataset=eval_dataset, name=name, **engine_options)
        self._run.resume_from = str(path)
        return self

    def _setup(self, make_run, trainer, tokenizer, name, *, ident: Optional[str] = None,
               snapshots: tuple = (None, None)) -> None:
        import uuid

        self.id = ident or uuid.uuid4().hex[:12]
        self.name = str(name) if name else registry.next_default_name()
        self._trainer = trainer
        self._tokenizer = tokenizer
        self._status = RunState(self.name)
        self._explore = Explorer(self, *snapshots, trainer=trainer)   # snapshots, rewind, fork (branches.py)
        self._run = make_run(self._status, self._explore, self.id)
        self._controls = SessionControls(self, self._status, self._run, self._explore, end=self._end,
                                         release=self._release)
        self._view = SessionView(self)
        self._samples = Samples()
        self._sample_watch = SampleWatch(self)   # answers to the sample prompt (sample_watch.py)
        if hasattr(self._run, "after_record"):   # an in-kernel run: the watch hears of each step
            self._run.after_record.append(lambda r: self._sample_watch.on_step(int(r.get("step", 0) or 0)))
        registry.register(self)
        if in_kernel():  # import the display stack now (plotly's FigureWidget: ~1.5 s), not in train()
            from .dashboard import warm_up   # light: ipywidgets and plotly only in a kernel that shows the run

            warm_up()

    def __getattr__(self, name: str) -> Any:
        # what only one kind of run has (in worker processes: nproc_per_node, output_dir, ranks...)
        run = self.__dict__.get("_run")
        if run is not None and name in run.public:
            return getattr(run, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- lifecycle ---------------------------------------------------------------------------
    def train(self, block: bool = False, dashboard: Any = None) -> None:
        """Start training in the background and return at once (``block=True`` waits).

        In a notebook the dashboard is displayed; ``dashboard`` picks how: None = auto (widgets
        when a widget frontend is connected, else a live HTML summary), "widgets", "html", or
        False for nothing.
        """
        mode = resolve_mode(dashboard)
        st = self._status
        with st.cv:
            if st.state in LIVE:
                return
            if st.state in ENDED:
                raise RuntimeError(
                    f"session {self.name!r} has {st.state}; a run cannot be restarted. Start a "
                    "new Session, or mt.Session.from_checkpoint(path) from a saved checkpoint.")
            st.state = "running"
            st.started_at = time.time()
            st.thread = threading.Thread(target=self._run.body, args=(self._end,),
                                         name=thread_name(SESSION, self.name), daemon=True)
        registry.make_current(self)
        if self._run.announces:
            self._view.announce()
        self._view.show(mode)   # display first: the training thread would slow the widget set-up down
        st.thread.start()
        if block:
            self.wait()

    def wait(self, timeout: Optional[float] = None, *, until_step: Optional[int] = None) -> str:
        """Block until the run is finished, stopped or failed (or, with ``until_step``, has done
        that many optimizer steps); returns the state ("running"/"paused" if ``timeout`` ran
        out first). A training error is re-raised here with the training thread's traceback."""
        st = self._status
        t = st.thread
        if t is None:
            return st.state
        try:
            if until_step is not None:
                with st.cv:
                    st.cv.wait_for(lambda: st.step >= until_step or st.state in ENDED, timeout)
            else:
                t.join(timeout)
        except KeyboardInterrupt:
            import sys

            print(f"megatrain_nb: stopped waiting; session {self.name!r} keeps training in the "
                  "background (session.stop() ends it).", file=sys.stderr)
            raise
        if st.state in ENDED and t is not threading.current_thread():
            t.join()  # quick once the state says so (the beacon and publisher are told last)
            self._view.final_from_caller()
        if st.state == "failed" and st.error is not None:
            raise st.error.with_traceback(st.error_tb)
        return st.state

    def close(self) -> None:
        """Release the engine (device memory, worker threads, disk-tier files). A finished run
        keeps its weights for ``generate``/``inspect`` until this (or ``stop``) is called."""
        if self._status.state in LIVE:
            self.stop(wait=True)
            return
        self._sample_watch.close()
        self._release()
        registry.forget(self)

    # ---- controls: every one through command(), the one check of its value ----------------------
    def command(self, name: Any, value: Any = None, *, source: str = "lab", command_id: Optional[str] = None,
                where: str = "", **options: Any) -> Any:
        """A command of the table (``megatrain_nb/commands.py``) by its name: the door of the
        inbox (the sidebar, a controller), ``%megatrain`` and the methods below. Its value is
        checked once, by the table (``where``: how a refusal names it), then the command is
        queued for the run's step-boundary controller (``trainer/boundary.py``), or applied now
        when nothing trains. ``options``: the method's own (``wait``, ``timeout``); from the
        inbox nothing waits. Returns what the command gives back (a checkpoint's path, a
        snapshot's ``SnapshotInfo``, a fork's Session)."""
        name, value = check_command(name, value, where=where)
        return self._controls.by_name[name](value, source, **options)

    def stop(self, checkpoint: Any = False, *, wait: Optional[bool] = None, timeout: Optional[float] = None,
             source: str = "notebook") -> None:
        """End the run after the current step and release device memory, threads and disk
        files. ``checkpoint=True`` (or a path) writes a checkpoint first. ``wait`` defaults to
        True on the main thread (returns once released) and False elsewhere (e.g. the beacon)."""
        self.command("stop", _path_text(checkpoint), source=source, where="stop(checkpoint)", wait=wait,
                     timeout=timeout)

    def pause(self, *, source: str = "notebook") -> None:
        """Pause after the current step (the step count then holds still)."""
        self.command("pause", source=source)

    def resume(self, *, source: str = "notebook") -> None:
        """Continue a paused run from the step it paused at; after ``rewind`` on a finished run
        (state "idle"), continue from the snapshot (as ``train()``)."""
        self.command("resume", source=source)

    def set_lr(self, lr: float, *, source: str = "notebook") -> None:
        """From the next optimizer step the learning rate is ``lr``; a schedule carries on
        relative to it (a constant schedule stays at ``lr``). Recorded as an event."""
        self.command("lr", lr, source=source, where="set_lr(lr)")

    def save_checkpoint(self, path: Optional[str] = None, *, wait: bool = True,
                        source: str = "notebook") -> Optional[str]:
        """Write a checkpoint (weights + optimizer states + data position) at the next step
        boundary; with ``wait`` returns its path, else returns None (the event has the path)."""
        return self.command("checkpoint", _path_text(path), source=source, where="save_checkpoint(path)",
                            wait=wait)

    # ---- explore: snapshots, rewind, fork (the logic is in branches.py) ------------------------------
    def snapshot(self, *, source: str = "notebook"):
        """Take a snapshot at the next step boundary (now, if nothing is training) and return its
        ``SnapshotInfo``. On the disk tier it hard-links the files and writes only RAM state."""
        return self.command("snapshot", source=source, wait=True)

    def rewind(self, step: int, *, source: str = "notebook"):
        """Go back to the snapshot at ``step``; ``train()``/``resume()`` continues from there. While
        running: at the next step boundary, then paused. The abandoned steps stay a branch."""
        return self.command("rewind", step, source=source, where="rewind(step)", wait=True)

    def fork(self, step: Optional[int] = None, name: Optional[str] = None, **changes: Any) -> "Session":
        """A new Session (a branch) from the snapshot at ``step`` (default: a snapshot now) with
        ``changes`` (learning_rate, lr_scheduler_type, warmup_steps, weight_decay, max_grad_norm,
        max_steps, gradient_accumulation_steps, data_seed, train_dataset, loss_fn; in a DPO run
        also beta, loss_type; in a GRPO run temperature and beta, its rollouts made anew from the
        fork's step with them). It shares this session's engine: starting it pauses this one (one
        branch trains at a time). ``device=`` another device than this session's: an engine of its
        own there, trained side by side. Ranks in worker processes (``nproc_per_node``): the fork
        launches ranks of its own from the snapshot."""
        return self.command("fork", (step, name, changes), source="notebook")

    # ---- looking inside ------------------------------------------------------------------------
    def unit_names(self) -> list[str]:
        """The model's streaming units in order ("embed", "layers.0", ..., "head"): what
        ``inspect`` takes."""
        names = self._status.log.units()
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
        self._run.check("inspect")
        unit = resolve_unit(layer, self.unit_names())
        stats = self._status.log.layer(unit)
        if stats is None:
            raise LookupError(f"no statistics for {unit!r} yet: they are gathered at each optimizer "
                              "step; train at least one step first")
        hist = {m: self._status.log.unit_series(unit, m) for m in ("grad_norm", "update_ratio")}
        return LayerReport(stats, unit=unit, history=hist)

    def set_sample_prompt(self, messages: Any, *, every: Optional[int] = None, max_new_tokens: int = 48,
                          temperature: float = 0.0) -> None:
        """The conversation (a list of ``{"role", "content"}``), rendered with the tokenizer's chat
        template, that is answered now and every ``every`` steps while the run trains (default: a
        tenth of the run), on a thread of its own; the dashboard shows the last answers with their
        steps (``session.sample_watch.answers()``). ``generate()`` without a prompt answers it too."""
        self._sample_watch.set_prompt(messages, every=every, max_new_tokens=max_new_tokens,
                                      temperature=temperature)

    @property
    def sample_watch(self) -> SampleWatch:
        """The sample prompt and the last answers to it (see :meth:`set_sample_prompt`)."""
        return self._sample_watch

    def trained_on(self, index: int = 0):
        """One training example with the tokens that count toward the loss highlighted (HTML)."""
        return trained_on_view(self._trainer, index)

    def generate(self, prompt: str = "", max_new_tokens: int = 50, *, temperature: float = 0.8,
                 top_k: Optional[int] = 50, seed: Optional[int] = None) -> str:
        """Sample from the model as it is now (safe while training runs or is paused: the
        sample is drawn between two training micro-batches). No prompt: the conversation set
        with :meth:`set_sample_prompt`, if any."""
        st = self._status
        self._run.check("generate")
        if not prompt and self._sample_watch.prompt:
            prompt = self._sample_watch.prompt
        if st.released or self._trainer is None or getattr(self._trainer, "engine", None) is None:
            raise RuntimeError(f"session {self.name!r} released its model when it {st.state}; "
                               "load the last checkpoint (mt.Session.from_checkpoint) to sample")
        self._own_weights("generate()", strict=True)
        text = self._samples.draw(self.engine, self._tokenizer, prompt, st.step, max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_k=top_k, seed=seed)
        st.log.touch()
        return text

    def dashboard(self):
        """The dashboard widget (display it again anywhere); it stays live while the run does."""
        return self._view.dashboard()

    def export(self, path, format: str = "safetensors", *, dtype: Optional[str] = None, tokenizer: bool = True) -> str:
        """Write the model to ``path`` as ``format`` "safetensors", "gguf" (``dtype`` f32 | f16 |
        bf16 | q8_0) or "dcp" (``mt.export``, docs/EXPORT.md). While the run trains or is paused
        it waits only for a snapshot at the next step boundary, then reads the snapshot's files
        while training goes on."""
        return export_model.export(self, path, format, dtype=dtype, tokenizer=tokenizer)

    def export_report(self, path: str) -> str:
        """Write a report of the run: ``.ipynb`` (nbformat) or ``.html`` (nbconvert), with
        static offline figures. Returns the path written."""
        from .report import export_report   # light: nbformat, plotly and ipywidgets only for a report

        return export_report(self, path)

    def summary(self) -> dict:
        """A small JSON-able picture of the run (used by the magic and the HTML summary)."""
        from .summary_html import session_summary   # light: ipywidgets (its GRPO panel's chart) only when asked

        return session_summary(self)

    def __repr__(self) -> str:
        total = self.total_steps
        return (f"<megatrain_nb.Session {self.name!r} {self._status.state} step {self.step}"
                f"{'/' + str(total) if total else ''}>")

    def _repr_html_(self) -> str:
        from .summary_html import summary_html   # light: as session_summary above

        return summary_html(self, self._status.log.view())

    # ---- the end of a run (the background thread, or stop() before it started) -------------------
    def _end(self, outcome: str) -> None:
        self._sample_watch.run_ended(weights_kept=outcome == "finished")
        self._sample_watch.finish()   # the final snapshot shows the answer from the final weights
        if outcome != "finished":
            self._release()  # a finished run keeps its weights for generate()/inspect()
        self._status.ended_at = time.time()
        self._status.set_state(outcome)
        self._view.run_ended()

    def _release(self) -> None:
        if self._status.released:
            return
        self._status.released = True
        self._run.release()


def _path_text(path: Any) -> Any:
    """A checkpoint folder given as a path object, as the text the command table takes."""
    return str(path) if hasattr(path, "__fspath__") else path

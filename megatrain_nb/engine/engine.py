"""StreamingEngine: train a causal LM whose training state lives in host RAM (and on disk),
streaming one layer at a time through a few device slots.

Example::

    from transformers import AutoConfig, AutoModelForCausalLM
    from megatrain_nb.engine import StreamingEngine, EngineConfig

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", ...))
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    out = engine.forward_backward(input_ids)      # out.loss, out.num_tokens
    engine.optimizer_step(lr=1e-3); engine.zero_grad()
"""
from __future__ import annotations

import os
import threading
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from megatrain_nb.model_source import resolve
from megatrain_nb.values import check

from .tiers import io as engine_io
from .updates import finite
from .config import EngineConfig
from .ranks.dist import resolve_dist
from .family import max_positions, vocab_size
from .inputs import prepare_batch, window_batches, window_data, with_extras
from .tiers.materialize import SafetensorsSource, load_weights
from .outcome import EngineOutput, objective_fields
from .memory import memory_report
from .parts import HoldsParts, build_parts
from .planning.codec_choice import checkpoint_codec
from .planning.planner import WindowPlan
from .planning.prediction_check import engine_prediction
from .ranks.reshard import load_engine_shards, refuse_sharded, save_engine_shards
from .telemetry import Telemetry
from .units import Unit, check_supported
from .vision import auto_model_class, checkpoint_names
from .window import plan_for
from .. import threads as thread_registry
from .tiers.linked_check import verify_folder
from .tiers.linked import is_linked, load_linked
from .ranks.linked_ranks import is_rank_linked, load_linked_rank
from .tiers.linked import begin_linked
from .tiers.linked import load_keeping
from .tiers.linked import save_linked
from .ranks.linked_ranks import save_linked_rank


class StreamingEngine(HoldsParts):
    """Streams a Hugging Face decoder-only model through the device, unit by unit.

    The engine takes ownership of ``model``: its parameters move into the engine's host store
    (the module keeps meta-device placeholders), and its decoder layers are replaced by proxies.
    Read weights back with :meth:`named_parameters` or :meth:`save_pretrained`. ``workload``
    (``planner.Workload``): what steps will train on, for the planner's predicted pick (plan_pick.py).
    ``codec_from``: a checkpoint whose codec ``optimizer_compression="auto"`` keeps (a resume never re-picks).
    """

    def __init__(self, model: nn.Module, config: Optional[EngineConfig] = None, *, _source=None, dist=None,
                 workload=None, codec_from=None, **options):
        if config is None:
            config = EngineConfig.from_options(**options)
        elif options:
            config = config.replace(**options)
        check_supported(model)
        self.config = config
        self.model = model
        self.model_config = model.config
        # Data parallel: ``dist`` (a Dist or a torch ProcessGroup), else the default group if
        # one is initialised (torchrun), else one process. With world > 1 every unit's training
        # state is sharded over the ranks (see engine/ranks/sharded.py).
        self.dist = resolve_dist(dist, config)
        self.device = self.dist.device if self.dist.world > 1 else config.torch_device
        self.dtype = config.compute_dtype
        self.lock = threading.RLock()
        self.counters = Telemetry()
        self._closed = False
        with thread_registry.thread_device(self.device):   # every engine pool's threads start on it (threads.py)
            parts = build_parts(model, config, dist=self.dist, device=self.device, counters=self.counters,
                                source=_source, workload=workload,
                                saved_codec=checkpoint_codec(codec_from) if codec_from is not None else None)
        self.hold(parts)   # engine.parts, and engine.pager, engine.updates...: each part (parts.HoldsParts)
        self.embed_unit, self.head_unit = self.units[0], self.units[-1]
        self.params_on_disk = self.plan.placement["master_weights"] == "disk"
        self.checkpoint_interval = self.plan.checkpoint_interval
        self.memory_peaks = {"host": 0, "disk": 0}   # memory_report's peaks across calls
        self.rates = config.rates   # MachineRates for .prediction (None: the machine's cached ones, if any)

    @classmethod
    def from_pretrained(cls, folder, config: Optional[EngineConfig] = None, **options) -> "StreamingEngine":
        """Load a local Hugging Face folder or Hub id (``revision=``, ``token=``), streaming
        safetensors shards unit by unit.

        The model is built on the meta device; at no time is the whole model in RAM beyond
        the engine's own store (which is on disk for weights when the planner pages them).
        """
        from transformers import AutoConfig

        source = resolve(folder, revision=options.pop("revision", None), token=options.pop("token", None))
        folder = source.need_folder("StreamingEngine.from_pretrained")   # a Hub id -> its cached snapshot folder
        hf_config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = auto_model_class(hf_config).from_config(hf_config, dtype=torch.float32)   # (a VLM's: vision.py)
        names = lambda keys: checkpoint_names(model, keys)   # noqa: E731 - (transformers' older layouts)
        return cls(model, config, _source=SafetensorsSource(folder, names), **options)

    # ------------------------------------------------------------------ helpers
    def _state_unit(self, unit: Unit) -> Unit:
        return self.sharded.shard(unit) if self.sharded is not None else unit

    def _whole(self, unit: Unit, flat: torch.Tensor) -> torch.Tensor:
        """A unit's whole flat buffer from this process's part (a collective when sharded: every
        rank must ask for the same units in the same order)."""
        return self.sharded.assemble(unit, flat) if self.sharded is not None else flat

    def _prepare(self, input_ids, attention_mask, labels, position_ids=None, extras=None):
        return prepare_batch(input_ids, with_extras(attention_mask, extras), labels,
                             vocab=vocab_size(self.model_config), max_pos=max_positions(self.model_config), device=self.device, position_ids=position_ids)

    # ------------------------------------------------------------------ public API
    def forward_backward(self, input_ids, attention_mask=None, labels=None, loss_fn=None,
                         num_items_in_batch: Optional[int] = None,
                         step_lr: Optional[float] = None,
                         max_grad_norm: Optional[float] = None, position_ids=None, objective_data=None,
                         **extras) -> EngineOutput:
        """Forward and backward of one micro-batch, or of a whole accumulation window.

        **One micro-batch** (``input_ids`` a tensor [batch, seq]): gradients accumulate on the host.
        ``loss`` is the mean token loss of this micro-batch (the Hugging Face definition:
        labels shifted by one, ``-100`` ignored). With ``num_items_in_batch`` the gradient is
        that of ``sum_loss / num_items_in_batch`` (gradient accumulation over a window).

        **A window** (``input_ids`` a list of micro-batches, each a tensor of input ids or a
        dict with ``input_ids`` and optionally ``attention_mask`` / ``labels``): layer-major —
        each unit, once on the device, runs every micro-batch; each unit's gradient is summed
        on the device and leaves it once per step (see ``window.py``). The gradient is that of
        ``sum of all token losses / num_items_in_batch`` (default: the window's target tokens,
        as transformers.Trainer normalises); ``loss`` is the window's mean token loss and
        ``num_tokens`` its target tokens. The planner may split a window whose boundary
        activations fit nowhere into groups (``last_window_plan``). ``attention_mask`` and
        ``labels`` go inside the micro-batches then.

        **A sequence-level objective** as ``loss_fn`` (DPO, GRPO: ``compute/objective.py``): each
        micro-batch's side data is its own ``objective_data`` (a window dict's key, or the keyword
        for one batch), handed to the objective with that micro-batch's statistics; ``loss`` stays
        the mean token loss and the objective's value is ``out.objective_loss`` (``outcome.py``).

        **Packed rows** (several documents per row, no padding): ``position_ids`` [batch, seq]
        restarting at 0 for each document and no ``attention_mask``; the model's own mask code
        keeps the documents apart (``inputs.PackedRows``).

        **A processor's extra inputs** by keyword (``pixel_values=``, ``image_grid_thw=``, ...: any
        input the model's forward takes; a window's go in its dicts): passed to it (vision.py).

        With ``step_lr`` this ends the optimizer step: each unit's AdamW update runs in a
        worker as soon as its gradient is final, overlapped with the backward of the units
        below it, and its gradient is zeroed after. Same result as ``forward_backward`` then
        ``optimizer_step(step_lr)`` then ``zero_grad()``; the next forward waits per unit.

        With ``step_lr`` and ``max_grad_norm`` (global-norm clipping): each unit's share of the
        norm is taken as its gradient becomes final and its optimizer states and weights are
        read ahead during the backward; once the norm is known every update runs in the worker,
        in the next forward's order, while this call returns. Same result as
        ``clip_grad_norm_(max_grad_norm)``, ``optimizer_step(step_lr)``, ``zero_grad()``;
        ``out.grad_norm`` is the norm before clipping. (The final gradients wait for the norm
        in host RAM, or on the disk tier when the host budget is short: ``EngineConfig.clip_hold``.)
        """
        if step_lr is not None:
            step_lr = finite.check_lr(step_lr)
        if max_grad_norm is not None and step_lr is None:
            raise ValueError("max_grad_norm is applied with the step's update: pass step_lr too (or call "
                             "clip_grad_norm_() before optimizer_step()).")
        max_grad_norm = check("max_grad_norm", max_grad_norm) or None   # the table's rule; 0 = no clipping
        window = window_batches(input_ids)
        if window is not None:
            if any(x is not None for x in (attention_mask, labels, position_ids, objective_data)) or extras:
                raise ValueError("forward_backward got a list of micro-batches and a separate attention_mask/labels/"
                                 f"position_ids/objective_data/{'/'.join(extras) or 'extra inputs'}; put each "
                                 "micro-batch's in its dict instead.")
            return self._forward_backward_window(window, loss_fn, num_items_in_batch, step_lr, max_grad_norm,
                                                 window_data(input_ids))
        with self.lock:
            self._check_open()
            batches = [self._prepare(input_ids, attention_mask, labels, position_ids, extras)]
            wp = self.plan_window(batches)   # a long row's boundary activations may leave the device
            return self._train(batches, wp if wp.tier != "device" else None, loss_fn, num_items_in_batch, step_lr,
                               max_grad_norm, [objective_data] if objective_data is not None else None)

    def plan_window(self, batches) -> WindowPlan:
        """The :class:`WindowPlan` of prepared ``(ids, am, labels)`` micro-batches (``window.plan_for``)."""
        return plan_for(batches, plan=self.plan, model_config=self.model_config, config=self.config,
                        num_layers=len(self.layer_units), device=self.device)

    #: The predicted step (engine/planning/prediction.py) of this plan at its last step's shape and ``self.rates``
    #: (else the machine's cached rates); None before a step or without rates.
    prediction = property(engine_prediction)

    @property
    def last_window_plan(self) -> Optional[WindowPlan]:
        """The plan of the last window :meth:`forward_backward` ran (None before the first)."""
        return self.steps.last_plan

    def _forward_backward_window(self, window, loss_fn, num_items_in_batch, step_lr, max_grad_norm,
                                 data=None) -> EngineOutput:
        with self.lock:
            self._check_open()
            batches = [self._prepare(*b) for b in window]
            return self._train(batches, self.plan_window(batches), loss_fn, num_items_in_batch, step_lr,
                               max_grad_norm, data)

    def _train(self, batches, wp, loss_fn, num_items_in_batch, step_lr, max_grad_norm, data=None) -> EngineOutput:
        loss, n, norm, skipped, heads = self.steps.run(batches, wp, loss_fn, num_items_in_batch, step_lr,
                                                       max_grad_norm, data)
        if step_lr is None:   # the step goes on (or is the caller's): nothing of a whole step to report yet
            return EngineOutput(loss=loss, num_tokens=n, grad_norm=norm, skipped=skipped, **objective_fields(heads))
        return EngineOutput(loss=loss, num_tokens=n, grad_norm=norm, skipped=skipped, memory=self.memory_report(),
                            telemetry=self.telemetry(),
                            layer_stats=self.layer_stats() if self.config.layer_stats else None,
                            **objective_fields(heads))

    def evaluate(self, input_ids, attention_mask=None, labels=None, loss_fn=None, position_ids=None,
                 objective_data=None, **extras) -> EngineOutput:
        """Loss of a batch without gradients (``objective_data``: a sequence objective's side data
        of this batch, also a key of a dict batch; see :class:`.EngineOutput`)."""
        with self.lock:
            self._check_open()
            if objective_data is None:   # a dict batch's own
                objective_data = (window_data(input_ids) or [None])[0]
            ids, am, labels = self._prepare(input_ids, attention_mask, labels, position_ids, extras)
            head, n = self.runner.evaluate(ids, am, labels, loss_fn=loss_fn, data=objective_data)
            return EngineOutput(loss=head.loss_sum / max(n, 1), num_tokens=n, **objective_fields([head]))

    def forward_logits(self, input_ids, attention_mask=None, position_ids=None, **extras) -> torch.Tensor:
        """Logits [batch, seq, vocab] (fp32, CPU) of the current weights, without gradients."""
        with self.lock:
            self._check_open()
            ids, am, _ = self._prepare(input_ids, attention_mask, None, position_ids, extras)
            return self.runner.logits(ids, am)

    def named_parameters(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(name, fp32 master tensor) with the names of ``model.named_parameters()``."""
        self.pager.wait_grads()
        self.updates.check_intact("named_parameters()")
        for u in self.units:
            flat = self._whole(u, self.weights.read_now(self._state_unit(u)))
            for p in u.params:
                yield p.name, flat[p.offset:p.offset + p.numel].view(p.shape)

    def named_gradients(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(name, fp32 accumulated gradient); tied weights once, holding the sum of both uses."""
        self.pager.wait_grads()
        for u in self.units:
            g = self._whole(u, self.store.grad(self._state_unit(u)))
            for p in u.params:   # (a frozen tail split off the gradient, Unit.train_numel: zero)
                yield p.name, g[p.offset:p.offset + p.numel].view(p.shape) if p.offset < g.numel() \
                    else torch.zeros(p.shape)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return dict(self.named_parameters())

    def grad_norm(self) -> float:
        with self.lock:
            self.pager.wait_grads()
            sq = sum(float(torch.linalg.vector_norm(self.store.grad(u)) ** 2) for u in self.state_units)
            if self.sharded is not None:
                sq = self.sharded.global_norm_sq(sq)
            return sq ** 0.5

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale all accumulated gradients so their global L2 norm is at most ``max_norm``."""
        with self.lock:
            total = self.grad_norm()
            coef = max_norm / (total + 1e-6)
            if coef < 1.0:
                for u in self.state_units:
                    self.store.grad(u).mul_(coef)
            return total

    def optimizer_step(self, lr: float) -> None:
        """One AdamW step on every unit (same result as torch.optim.AdamW with these settings).
        A NaN/inf gradient is refused before any unit moves (or the step skipped: on_nonfinite)."""
        lr = finite.check_lr(lr)
        with self.lock:
            self._check_open()
            self.pager.wait_grads()
            if self.updates.update_all(lr, grad_norm=self.grad_norm()):
                self.counters.add("steps", 1)
                self.counters.close_step([u.name for u in self.layer_units], groups=None)

    def zero_grad(self) -> None:
        with self.lock:
            self.pager.wait_grads()
            self.updates.wait_all()
            self.store.zero_grad()

    def layer_stats(self) -> List[dict]:
        """Per-unit statistics of each unit's latest update ([] unless ``EngineConfig.layer_stats``
        is on, or :meth:`configure` switched it on: they cost the optimizer two passes per unit).
        A step's come with its EngineOutput."""
        return [self.adam.stats[u.index] for u in self.units if u.index in self.adam.stats]

    def configure(self, **changes) -> None:
        """Change what may change between two optimizer steps, from the next one: ``layer_stats``
        (switch the statistics on or off) and ``weight_decay`` (a branch's own). Checked as
        :class:`EngineConfig` checks them; ``self.config`` says what holds."""
        if set(changes) - _LIVE:
            raise ValueError(f"configure() changes only {', '.join(sorted(_LIVE))} between steps, not "
                             f"{', '.join(sorted(set(changes) - _LIVE))}; build a new engine for the others")
        with self.lock:
            self.config = self.config.replace(**changes)
            self.adam.collect_stats, self.adam.weight_decay = self.config.layer_stats, self.config.weight_decay

    def unit_names(self) -> List[str]:
        return [u.name for u in self.units]

    def num_parameters(self) -> int:
        return sum(u.numel for u in self.units)

    def memory_report(self) -> dict:
        return memory_report(pager=self.pager, runner=self.runner, store=self.store, states=self.states,
                             weights=self.weights, updates=self.updates, boundary=self.boundary, config=self.config,
                             boundary_peak=self.steps.boundary_peak, peaks=self.memory_peaks, device=self.device,
                             grad_sums_peak=self.runner.sum_peak)

    def telemetry(self) -> dict:
        """Counters: bytes per link, prefetch hits/misses, stall seconds, loads per unit."""
        self.pager.count_idle()   # (CUDA: the compute stream's idle time read from finished events)
        out = self.counters.snapshot()
        if self.disk is not None:
            out["disk_cache"] = self.disk.report()
        return out

    def save_pretrained(self, path) -> None:
        """Write a folder that ``AutoModelForCausalLM.from_pretrained`` loads (safetensors)."""
        with self.lock:
            self.updates.check_intact("save_pretrained()")
            if self.dist.is_main:
                engine_io.save_pretrained(self, path)
            else:   # the other ranks take part in each unit's gather; rank 0 writes
                for _ in self.named_parameters():
                    pass
            self.dist.barrier()

    def save_checkpoint(self, path, *, link_disk: bool = False) -> Optional[dict]:
        """Weights (Hugging Face layout) plus optimizer states in their stored form.

        ``link_disk`` (a snapshot): hard-link the disk tier's files and write only what lives in
        RAM (see ``engine/tiers/linked.py``); returns the bytes linked, copied and written."""
        with self.lock:
            if link_disk:   # a snapshot; with several ranks each writes its own linked folder

                return save_linked(self, path) if self.sharded is None else save_linked_rank(self, path)
            if self.sharded is not None:
                return self.save_sharded_checkpoint(path)
            self.pager.wait_grads()
            self.updates.check_intact("save_checkpoint()")
            engine_io.save_pretrained(self, path, atomic=False)
            self.states.save(path, self.adam)

    def begin_linked_checkpoint(self, path):
        """A snapshot's engine part, begun at this step boundary without waiting for the step's
        updates where the disk tier holds the state (``engine/tiers/linked.py``); the returned
        ``LinkedWrite.result()`` completes it (any thread) and returns the bytes."""
        with self.lock:

            return begin_linked(self, path)

    def verify_checkpoint(self, path, *, manifest: bool = True) -> None:
        """Check a checkpoint or snapshot folder whole, by content, every time before any of it is
        loaded (``engine/linked_check.verify_folder``: its manifest and, for a snapshot, every part
        of the engine's). Raises ``IntegrityError`` (a ``ValueError``) naming the file."""

        verify_folder(self, path, manifest=manifest)

    def load_checkpoint(self, path, *, verify: bool = True) -> None:
        """Replace the weights, optimizer states and step counts by those saved in ``path``.
        The folder is checked whole first (:meth:`verify_checkpoint`; ``verify=False`` when the
        caller just did): a damaged one is refused by name and nothing changes. A load that
        still fails part way (an I/O error) puts the state from before back
        (``linked.load_keeping``) and raises ``LoadUndone``; where it cannot, the engine refuses
        to train, save or hand out weights until a load succeeds."""
        with self.lock:
            if verify:
                self.verify_checkpoint(path)

            load_keeping(self, path, self._load_checkpoint)

    def _load_checkpoint(self, path) -> None:

        if is_linked(path):
            if self.sharded is not None:
                raise ValueError(f"snapshot {os.fspath(path)!r} was written by one process and this run has "
                                 f"{self.dist.world} ranks: a snapshot loads back into the run that wrote it; "
                                 "to move between world sizes, resume from a checkpoint (checkpoint-<step>)")
            return load_linked(self, path)
        if is_rank_linked(path):
            return load_linked_rank(self, path)
        if any(f.startswith("shards-") for f in os.listdir(path)):
            return self.load_sharded_checkpoint(path)
        refuse_sharded("load_checkpoint", self.dist.world)
        self.pager.wait_grads()
        self.updates.settle()
        load_weights(self, path)
        self.states.load_saved(path, self.adam)
        self.updates.clear_failure()

    def close(self) -> None:
        """Release device memory, worker threads and the disk files the engine created."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.pager.wait_grads()
                self.updates.drain()
            finally:
                self.updates.close()
                self.states.close()
                self.boundary.close()
                self.runner.close()   # (a streamed vision tower's pager, on the transport closed below)
                self.pager.close()
                self.weights.reset()
                if self.disk is not None:
                    self.disk.close()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def save_sharded_checkpoint(self, path) -> None:
        """Every rank writes its shard of every unit to its own file in ``path`` (a folder all ranks
        see); any world size loads it back (:meth:`load_sharded_checkpoint`). Collective."""
        with self.lock:
            self.pager.wait_grads()
            self.updates.wait_all()
            save_engine_shards(path, units=self.units, state_unit=self._state_unit, weights=self.weights,
                               states=self.states, adam_steps=self.adam.steps, dist=self.dist,
                               codec=self.config.optimizer_compression)

    def load_sharded_checkpoint(self, path) -> None:
        """Load a :meth:`save_sharded_checkpoint` folder of any world size (reads this rank's ranges). Collective."""
        with self.lock:
            self.pager.wait_grads()
            self.updates.settle()
            load_engine_shards(path, units=self.units, state_unit=self._state_unit, weights=self.weights,
                               states=self.states, adam=self.adam, dist=self.dist,
                               codec=self.config.optimizer_compression)
            self.updates.clear_failure()
            self.dist.barrier()

    closed = property(lambda self: self._closed, doc="Whether close() has run (a closed engine refuses calls).")

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this StreamingEngine is closed; create a new one.")
        thread_registry.set_thread_device(self.device)   # the calling (compute) thread: a session's, a rank's (threads.py)
        self.updates.check()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # The garbage collector can run this anywhere, even inside an executor's submit() or
        # threading's own bookkeeping while a thread starts: taking a lock or joining a thread
        # here can deadlock. So only flags are set: idle workers exit on their own once their
        # executor is collected (or, for the disk store, when they see the flag), and the disk
        # folder goes with the store's finalizer. close() is the orderly way.
        if getattr(self, "_closed", True):
            return
        self._closed = True
        disk = getattr(self, "disk", None)
        if disk is not None:
            disk.abandon()


#: the settings configure() changes between steps
_LIVE = frozenset({"layer_stats", "weight_decay"})


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
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from . import io as engine_io
from . import finite
from .config import EngineConfig
from .host_store import BufferPool, HostStore
from .optimizer import UnitAdamW
from .pager import Pager
from .planner import GiB, make_plan, UnitSpec
from .proxies import HiddenStatesStub, LayerProxy
from .states import OptimizerStates
from .step import StepRunner
from .materialize import SafetensorsSource, init_unit, is_meta_model, materialize_buffers
from .telemetry import Telemetry
from .units import Unit, build_units, check_supported, find_layer_list
from .weight_store import WeightStore


@dataclass
class EngineOutput:
    loss: float
    num_tokens: int
    grad_norm: Optional[float] = None   # with step_lr: the global norm (before any clipping)
    skipped: bool = False               # the step was not applied (non-finite, on_nonfinite='skip')


class StreamingEngine:
    """Streams a Hugging Face decoder-only model through the device, unit by unit.

    The engine takes ownership of ``model``: its parameters move into the engine's host store
    (the module keeps meta-device placeholders), and its decoder layers are replaced by proxies.
    Read weights back with :meth:`named_parameters` or :meth:`save_pretrained`.
    """

    def __init__(self, model: nn.Module, config: Optional[EngineConfig] = None, *, _source=None, **options):
        if config is None:
            config = EngineConfig.from_options(**options)
        elif options:
            config = config.replace(**options)
        check_supported(model)
        self.config = config
        self.model = model
        self.model_config = model.config
        self.device = config.torch_device
        self.dtype = config.compute_dtype
        self.lock = threading.RLock()
        self.counters = Telemetry()
        self._closed = False
        self._failed: Optional[BaseException] = None   # an update that failed (see _check_open)
        self._guard: Optional[finite.StepGuard] = None  # the overlapped step's NaN/inf check
        self._nonfinite: Optional[BaseException] = None  # a stopped non-finite step not yet reported

        self._layer_parent, self._layer_attr, layers = find_layer_list(model)
        self.units: List[Unit] = build_units(model, layers)
        self.embed_unit, self.head_unit = self.units[0], self.units[-1]
        self.layer_units = self.units[1:-1]
        self._persistent_buffers = engine_io.persistent_buffers(model)

        self.plan = self._static_plan()
        pin = self.device.type == "cuda"
        self.store = HostStore(self.units, pin=pin)
        self.disk = self._open_disk_tier()
        # Pipeline depth: units in flight through host RAM per stage (RAM stays flat).
        # (depth 2 measured no faster on 2 cores and left more optimizer time exposed: keep 1)
        self.inflight_depth = 1
        self.weights = WeightStore(self.units, self.store, disk=self.disk if self.params_on_disk else None,
                                   pin=pin, counters=self.counters, compute_buffers=2 + self.inflight_depth,
                                   optimizer_buffers=2 if self._small_units() else 1)
        self.states = OptimizerStates(self.units, config, self.counters, disk=self.disk)
        self._placeholders = self._take_parameters(model, _source)
        self.weights.finish_initial()
        self._move_buffers(model)
        for u in self.layer_units:
            layers[u.layer_index] = LayerProxy(self, u)
        model.config.use_cache = False
        self.pager = Pager(self.units, device=self.device, dtype=self.dtype, layer_slots=self.plan.layer_slots,
                           source=self._host_params, source_done=self.weights.transfer_done,
                           telemetry=self.counters, grad_sink=self._grad_arrived)
        self.adam = UnitAdamW(betas=config.adam_betas, eps=config.adam_eps, weight_decay=config.weight_decay)
        self.runner = StepRunner(self)
        self._step_lr: Optional[float] = None
        self._clip: Optional[float] = None       # max_grad_norm of the step being run
        self._norm_sq = 0.0                      # sum of the final gradients' squared norms
        self._norm_lock = threading.Lock()
        self._updates: Dict[int, Future] = {}
        self._update_pool = ThreadPoolExecutor(1, thread_name_prefix="mtnb-adamw")
        self._update_slots = threading.BoundedSemaphore(self.inflight_depth)  # units queued for an update
        self._grad_pool = BufferPool(max_bytes=256 << 20)
        self.pager.max_grads_in_flight = self.inflight_depth
        self._head_stub = HiddenStatesStub()

    @classmethod
    def from_pretrained(cls, folder, config: Optional[EngineConfig] = None, **options) -> "StreamingEngine":
        """Load a local Hugging Face folder, streaming safetensors shards unit by unit.

        The model is built on the meta device; at no time is the whole model in RAM beyond
        the engine's own store (which is on disk for weights when the planner pages them).
        """
        import os

        from transformers import AutoConfig, AutoModelForCausalLM

        if not os.path.isdir(folder) or not os.path.exists(os.path.join(folder, "config.json")):
            raise FileNotFoundError(f"{folder!r} is not a local model folder (no config.json); save one with "
                                    "save_pretrained() or pass a model object.")
        hf_config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        source = SafetensorsSource(folder)
        try:
            return cls(model, config, _source=source, **options)
        finally:
            source.close()

    # ------------------------------------------------------------------ construction
    def _static_plan(self):
        cfg = self.config
        specs = [UnitSpec(u.name, u.numel, u.kind) for u in self.units]
        mc = self.model_config
        plan = make_plan(specs, hidden_size=_hidden(mc), num_layers=len(self.layer_units),
                         intermediate_size=getattr(mc, "intermediate_size", None), vocab_size=0,
                         vram_bytes=int(cfg.max_vram_gb * GiB) if cfg.max_vram_gb else None,
                         host_bytes=int(cfg.max_host_gb * GiB) if cfg.max_host_gb else None,
                         offload_params=cfg.offload_params, batch=1, seq=1, compression=cfg.optimizer_compression, precision=cfg.precision,
                         checkpoint_interval=cfg.checkpoint_interval, offload_dir=bool(cfg.offload_dir),
                         layer_slots=cfg.device_slots, cuda=self.device.type == "cuda",
                         loss_chunk_tokens=cfg.loss_chunk_tokens)
        if not plan.feasible and plan.limiting_tier == "host":
            raise ValueError(f"max_host_gb={cfg.max_host_gb}: {plan.reason}.")
        if cfg.offload_params and not cfg.offload_dir:
            raise ValueError("offload_params=True needs an offload_dir for the disk tier.")
        self.params_on_disk = plan.placement["master_weights"] == "disk"
        if not plan.feasible:
            biggest = max(self.units, key=lambda u: u.numel)
            raise ValueError(
                f"max_vram_gb={cfg.max_vram_gb} is below what one training step needs: "
                f"{plan.reason}. The largest unit ({biggest.name}) alone holds "
                f"{biggest.numel * (2 if cfg.precision == 'bf16' else 4) / GiB:.3f} GiB; "
                f"set max_vram_gb to at least {plan.device['total'] / GiB:.3f}.")
        self.checkpoint_interval = plan.checkpoint_interval
        return plan

    def _take_parameters(self, model: nn.Module, source=None) -> Dict[Tuple[int, str], nn.Parameter]:
        """Fill the store unit by unit; leave meta placeholders in the modules.

        Values come from the live model, from ``source`` (a safetensors folder), or — for a
        meta-device model — from the model's own weight init run on one unit at a time.
        """
        meta = is_meta_model(model)
        layer_modules = [u.module for u in self.layer_units]
        placeholders: Dict[Tuple[int, str], nn.Parameter] = {}
        for u in self.units:
            if source is not None:
                values = source.unit_values(u)
            elif meta:
                values = init_unit(model, u, layer_modules)
            else:
                values = {p.name: p.bindings[0][0]._parameters[p.bindings[0][1]] for p in u.params}
            flat = self.store.alloc(u.numel)
            for p in u.params:
                flat[p.offset:p.offset + p.numel].copy_(values[p.name].detach().reshape(-1))
                ph = nn.Parameter(torch.empty(p.shape, device="meta", dtype=torch.float32))
                for m, a in p.bindings:
                    m._parameters[a] = ph
                    placeholders[(id(m), a)] = ph
            del values
            self._store_unit_params(u, flat)
        if meta:
            materialize_buffers(model, layer_modules)
        return placeholders

    def _small_units(self) -> bool:
        """Units small enough that a spare buffer or two per stream costs little RAM (<= 256 MiB
        each). Large units get the minimum: one optimizer staging buffer (RAM stays flat for
        models far larger than RAM; their steps are long, so what it would overlap is small)."""
        return max(u.numel for u in self.units) * 4 <= (256 << 20)

    def _store_unit_params(self, unit: Unit, flat: torch.Tensor) -> None:
        self.weights.put_initial(unit, flat)

    def _open_disk_tier(self):
        """The disk tier under offload_dir (optimizer states; master weights when planned)."""
        cfg = self.config
        if not cfg.offload_dir:
            return None
        from .disk_store import DiskStore
        from .states import stored_state_bytes

        need = stored_state_bytes(self.units, cfg.optimizer_compression)
        if self.params_on_disk:
            need += self.num_parameters() * 4
        from .host_store import return_freed_memory_to_os

        return_freed_memory_to_os()  # RAM must stay flat while units stream through it
        if not os.path.isdir(cfg.offload_dir):
            from .disk_store import OffloadError

            raise OffloadError(f"offload_dir {cfg.offload_dir!r} does not exist; create it on a disk with at least "
                               f"{need} bytes ({need / GiB:.2f} GiB) free, or pass another folder.")
        # The engine bounds the memory its disk operations hold itself (staging pools, states
        # read ahead / written behind), so the store's own cap on queued operations only has to
        # stay out of the way.
        return DiskStore(cfg.offload_dir, reserve_bytes=need, keep=cfg.keep_offload_files)

    def _move_buffers(self, model: nn.Module) -> None:
        for mod in list(model.modules()) + [u.module for u in self.layer_units]:
            for name, b in list(mod._buffers.items()):
                if b is not None and b.device != self.device:
                    mod._buffers[name] = b.to(self.device)

    def _host_params(self, unit: Unit) -> torch.Tensor:
        """A unit's fp32 master weights for the device; waits for that unit's pending update only."""
        self._wait_update(unit)
        return self.weights.for_transfer(unit)

    # ------------------------------------------------------------------ optimizer overlap
    def _grad_arrived(self, unit: Unit, grad) -> None:
        """Runs in the gradient-return worker once a unit's gradient reached the host."""
        lr = self._step_lr
        if lr is not None and self._clip is not None:
            # Clipping: every update needs the global norm, so the gradient stays in its
            # accumulator; its share of the norm is taken now, while the backward goes on.
            self.store.accumulate(unit, grad)
            sq = float(torch.linalg.vector_norm(self.store.grad(unit))) ** 2
            with self._norm_lock:
                self._norm_sq += sq
            return
        if lr is not None and not self.store.has_grad(unit):
            # Single micro-batch: the incoming gradient is final as it is; no accumulator needed.
            # (a staging buffer is reused by the next transfer: copy it out)
            flat = self._grad_pool.take(unit.numel)
            if torch.is_tensor(grad):
                flat.copy_(grad)
            else:
                torch.cat([g.reshape(-1).float() for g in grad], out=flat)
            self._submit_update(unit, lr, flat, False, recycle=True)
            return
        self.store.accumulate(unit, grad)
        if lr is not None:  # last micro-batch: this unit's gradient is final, update it now
            self._submit_update(unit, lr, None, True)

    def _submit_update(self, unit: Unit, lr: float, grad, zero: bool, recycle: bool = False) -> None:
        self.weights.mark_updating(unit)
        self._update_slots.acquire()  # back-pressure: RAM holds only a few pending updates
        guard = self._guard

        def run():
            try:
                self._update_unit(unit, lr, grad, zero, guard=guard)
            except BaseException:
                self.weights.dirty.clean(unit)  # readers must not wait forever for a failed update
                raise
            finally:
                if recycle:
                    self._grad_pool.give(grad)
                self._update_slots.release()
        self._updates[unit.index] = self._update_pool.submit(run)

    def _submit_clipped_updates(self, lr: float, max_norm: float, loss: Optional[float] = None):
        """After the last backward with clipping: every unit's update, in the next forward's
        order, in the worker; the next forward waits per unit. Returns the norm before clipping
        and whether the step is skipped (non-finite; the updates then leave everything as is)."""
        with self._norm_lock:
            total, self._norm_sq = self._norm_sq ** 0.5, 0.0
        # A non-finite step still runs its updates, as no-ops: the reads scheduled for them are
        # consumed and the gradients zeroed, so the engine stays usable; 'stop' raises after.
        try:
            skip = not finite.apply_step(loss, total, self._next_step(), self.config.on_nonfinite)
            stop = None
        except finite.NonFiniteError as e:
            skip, stop = True, e
        if skip and stop is None:
            self.counters.add("skipped_steps", 1)
        coef = max_norm / (total + 1e-6)   # as torch.nn.utils.clip_grad_norm_
        coef = coef if coef < 1.0 else None
        order = [self.embed_unit, self.head_unit] + list(self.layer_units)
        order = [u for u in order if u.numel > 0]
        futures = {}
        for u in order:
            self.weights.mark_updating(u)
            futures[u.index] = self._updates[u.index] = Future()

        def run():
            for i, u in enumerate(order):
                try:
                    self._update_unit(u, lr, None, True, grad_coef=coef, skip=skip)
                except BaseException as e:  # noqa: BLE001 - delivered to whoever waits on the units
                    for v in order[i:]:
                        futures[v.index].set_exception(e)
                        self.weights.dirty.clean(v)
                    return
                futures[u.index].set_result(None)
        self._update_pool.submit(run)
        if stop is not None:
            raise stop
        return total, skip

    def _next_step(self) -> int:
        """The number of the optimizer step about to be applied (1-based, survives a resume)."""
        return 1 + max((int(s) for s in self.adam.steps.values()), default=0)

    def _update_unit(self, unit: Unit, lr: float, grad: Optional[torch.Tensor] = None, zero: bool = False,
                     grad_coef: Optional[float] = None, skip: bool = False,
                     guard: Optional["finite.StepGuard"] = None) -> None:
        t0 = time.perf_counter()
        self.weights.mark_updating(unit)
        m, v = self.states.load(unit)
        params = self.weights.for_update(unit)
        grad = grad if grad is not None else self.store.grad(unit)
        error = None
        if guard is not None:
            skip, error = guard.check(unit.name, grad)
            if error is not None and not error.partial and guard.policy == "skip":
                self.counters.add("skipped_steps", 1)
                error = None
        if not skip:  # a skipped (non-finite) step: states and weights go back as they came
            if grad_coef is not None:
                grad.mul_(grad_coef)
            self.adam.step_unit(unit, params, grad, m, v, lr)
        self.weights.update_done(unit, params)
        self.states.store(unit, m, v)
        if zero:
            self.store.zero_unit(unit)
        self.counters.add("optimizer_seconds", time.perf_counter() - t0)
        if error is not None:
            raise error

    def _wait_update(self, unit: Unit) -> None:
        fut = self._updates.get(unit.index)
        if fut is None:
            return
        t0 = time.perf_counter()
        try:
            fut.result()
        except BaseException as e:
            # Delivered once; the engine then refuses to train on (see _check_open) -- except
            # after a non-finite step none of whose updates was applied.
            self._updates.pop(unit.index, None)
            if isinstance(e, finite.NonFiniteError) and not e.partial:
                self._nonfinite = e  # raised (once) by whichever engine call comes next
            else:
                self._failed = e
            self._settle_disk()
            raise
        self._updates.pop(unit.index, None)
        self.counters.add("optimizer_exposed_seconds", time.perf_counter() - t0)

    def _settle_disk(self) -> None:
        """After a failed update: let the disk operations still in flight finish (a failed
        write removes its own temporary file), so the error leaves the offload folder settled."""
        if self.disk is not None:
            try:
                self.disk.flush()
            except BaseException:  # noqa: BLE001 - the first error is the one being raised
                pass

    def _wait_all_updates(self) -> None:
        try:
            for u in self.units:
                self._wait_update(u)
        except finite.NonFiniteError:
            self._nonfinite = None  # reported here, to this caller
            raise

    def _layer_call(self, unit: Unit, args, kwargs):
        return self.runner.layer_call(unit, args, kwargs)

    # ------------------------------------------------------------------ inputs
    def _prepare(self, input_ids, attention_mask, labels):
        if not torch.is_tensor(input_ids):
            input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an integer tensor [batch, seq]; got {tuple(input_ids.shape)} "
                             f"{input_ids.dtype}.")
        vocab = self.model_config.get_text_config().vocab_size
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the model's vocabulary (0..{vocab - 1}); the tokenizer "
                             "does not match the model, or resize the model's embeddings.")
        max_pos = _max_positions(self.model_config)
        if max_pos is not None and input_ids.shape[1] > max_pos:
            raise ValueError(f"input has {input_ids.shape[1]} tokens but the model supports at most {max_pos} "
                             "positions; truncate or pack sequences to that length.")
        input_ids = input_ids.long()
        if attention_mask is not None:
            attention_mask = torch.as_tensor(attention_mask)
            if attention_mask.dim() == 1:
                attention_mask = attention_mask.unsqueeze(0)
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids "
                                 f"{tuple(input_ids.shape)}.")
        if labels is None:
            labels = input_ids.clone()
            if attention_mask is not None:
                labels = labels.masked_fill(attention_mask == 0, -100)
        else:
            labels = torch.as_tensor(labels).long()
            if labels.dim() == 1:
                labels = labels.unsqueeze(0)
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} does not match input_ids "
                                 f"{tuple(input_ids.shape)}.")
        dev = self.device
        am = attention_mask.to(dev) if attention_mask is not None else None
        return input_ids.to(dev), am, labels.to(dev)

    # ------------------------------------------------------------------ public API
    def forward_backward(self, input_ids, attention_mask=None, labels=None, loss_fn=None,
                         num_items_in_batch: Optional[int] = None,
                         step_lr: Optional[float] = None,
                         max_grad_norm: Optional[float] = None) -> EngineOutput:
        """Forward and backward of one micro-batch; gradients accumulate on the host.

        ``loss`` is the mean token loss of this micro-batch (the Hugging Face definition:
        labels shifted by one, ``-100`` ignored). With ``num_items_in_batch`` the gradient is
        that of ``sum_loss / num_items_in_batch`` (gradient accumulation over a window).

        With ``step_lr`` this is the step's last micro-batch: each unit's AdamW update runs in a
        worker as soon as its gradient is final, overlapped with the backward of the units
        below it, and its gradient is zeroed after. Same result as ``forward_backward`` then
        ``optimizer_step(step_lr)`` then ``zero_grad()``; the next forward waits per unit.

        With ``step_lr`` and ``max_grad_norm`` (global-norm clipping): each unit's share of the
        norm is taken as its gradient becomes final and its optimizer states and weights are
        read ahead during the backward; once the norm is known every update runs in the worker,
        in the next forward's order, while this call returns. Same result as
        ``clip_grad_norm_(max_grad_norm)``, ``optimizer_step(step_lr)``, ``zero_grad()``;
        ``out.grad_norm`` is the norm before clipping.
        """
        if step_lr is not None:
            step_lr = finite.check_lr(step_lr)
        if max_grad_norm is not None and step_lr is None:
            raise ValueError("max_grad_norm is applied with the step's update: pass step_lr too (or call "
                             "clip_grad_norm_() before optimizer_step()).")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm!r}; pass None for no clipping.")
        with self.lock:
            self._check_open()
            ids, am, labels = self._prepare(input_ids, attention_mask, labels)
            t0 = time.perf_counter()
            # (a unit's pending update from the last step finishes before its forward reads it,
            # so before its new gradient reaches the accumulator)
            self._step_lr, self._clip, self._norm_sq = step_lr, max_grad_norm, 0.0
            # Without clipping the updates start during the backward, before the global norm is
            # known: each checks its own gradient instead (finite.StepGuard).
            self._guard = (finite.StepGuard(self._next_step(), self.config.on_nonfinite)
                           if step_lr is not None and max_grad_norm is None else None)
            norm, skipped = None, False
            try:
                self._raise_nonfinite()
                loss_sum, n = self.runner.run(ids, am, labels, loss_fn=loss_fn, train=True,
                                              grad_scale_tokens=num_items_in_batch)
                self.pager.wait_grads()
                if max_grad_norm is not None:
                    norm, skipped = self._submit_clipped_updates(step_lr, max_grad_norm, loss_sum / max(n, 1))
            except finite.NonFiniteError:
                self._nonfinite = None  # reported now (the forward met the stopped step's error)
                raise
            finally:
                self._step_lr, self._clip = None, None
            if step_lr is not None:
                self.counters.add("steps", 1)
            self.counters.add("micro_batches", 1)
            self.counters.add("step_seconds", time.perf_counter() - t0)
            return EngineOutput(loss=loss_sum / max(n, 1), num_tokens=n, grad_norm=norm, skipped=skipped)

    def evaluate(self, input_ids, attention_mask=None, labels=None, loss_fn=None) -> EngineOutput:
        """Loss of a batch without gradients."""
        with self.lock:
            self._check_open()
            ids, am, labels = self._prepare(input_ids, attention_mask, labels)
            loss_sum, n = self.runner.run(ids, am, labels, loss_fn=loss_fn, train=False)
            return EngineOutput(loss=loss_sum / max(n, 1), num_tokens=n)

    def forward_logits(self, input_ids, attention_mask=None) -> torch.Tensor:
        """Logits [batch, seq, vocab] (fp32, CPU) of the current weights, without gradients."""
        with self.lock:
            self._check_open()
            ids, am, _ = self._prepare(input_ids, attention_mask, None)
            return self.runner.logits(ids, am)

    def named_parameters(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(name, fp32 master tensor) with the names of ``model.named_parameters()``."""
        self.pager.wait_grads()
        self._check_intact("named_parameters()")
        for u in self.units:
            flat = self.weights.read_now(u)
            for p in u.params:
                yield p.name, flat[p.offset:p.offset + p.numel].view(p.shape)

    def named_gradients(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(name, fp32 accumulated gradient); tied weights once, holding the sum of both uses."""
        self.pager.wait_grads()
        for u in self.units:
            g = self.store.grad(u)
            for p in u.params:
                yield p.name, g[p.offset:p.offset + p.numel].view(p.shape)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return dict(self.named_parameters())

    def grad_norm(self) -> float:
        with self.lock:
            self.pager.wait_grads()
            sq = sum(float(torch.linalg.vector_norm(self.store.grad(u)) ** 2) for u in self.units)
            return sq ** 0.5

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale all accumulated gradients so their global L2 norm is at most ``max_norm``."""
        with self.lock:
            total = self.grad_norm()
            coef = max_norm / (total + 1e-6)
            if coef < 1.0:
                for u in self.units:
                    self.store.grad(u).mul_(coef)
            return total

    def optimizer_step(self, lr: float) -> None:
        """One AdamW step on every unit (same result as torch.optim.AdamW with these settings).
        A non-finite gradient is refused (or the step skipped) as ``on_nonfinite`` says."""
        lr = finite.check_lr(lr)
        with self.lock:
            self._check_open()
            self.pager.wait_grads()
            self._wait_all_updates()
            if not finite.apply_step(None, self.grad_norm(), self._next_step(), self.config.on_nonfinite):
                self.counters.add("skipped_steps", 1)
                return
            t0 = time.perf_counter()
            self.weights.schedule([], self.units)
            self.states.schedule(self.units)  # disk reads ahead of the updates
            try:
                for u in self.units:
                    self._update_unit(u, lr)
                self.states.flush()
            except BaseException as e:
                self._failed = e  # some units may be updated and others not
                self._settle_disk()
                raise
            self.counters.add("optimizer_exposed_seconds", time.perf_counter() - t0)
            self.counters.add("steps", 1)

    def zero_grad(self) -> None:
        with self.lock:
            self.pager.wait_grads()
            self._wait_all_updates()
            self.store.zero_grad()

    def layer_stats(self) -> List[dict]:
        """Per-unit statistics gathered during the last optimizer step."""
        return [self.adam.stats[u.index] for u in self.units if u.index in self.adam.stats]

    def unit_names(self) -> List[str]:
        return [u.name for u in self.units]

    def num_parameters(self) -> int:
        return sum(u.numel for u in self.units)

    def memory_report(self) -> dict:
        esize = 2 if self.dtype == torch.bfloat16 else 4
        dev_w = self.pager.slot_bytes
        dev_g = self.pager.grad_buf_bytes
        act = self.runner.activation_peak
        dev = {"weights": dev_w, "grads": dev_g, "activations": act,
               "used_bytes": dev_w + dev_g + self.runner.activation_now,
               "peak_bytes": dev_w + dev_g + act,
               "capacity_bytes": int(self.config.max_vram_gb * GiB) if self.config.max_vram_gb else None}
        if self.device.type == "cuda":
            dev["allocator_used_bytes"] = torch.cuda.memory_allocated(self.device)
            dev["allocator_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            if dev["capacity_bytes"] is None:
                dev["capacity_bytes"] = torch.cuda.get_device_properties(self.device).total_memory
        hb = self.store.nbytes()
        st = self.states.nbytes()
        wb = self.weights.nbytes()
        host = {"weights": wb["host"], "grads": hb["grads"], "optimizer_states": st["host"],
                # states read ahead of their updates + recycled scratch (moments, final gradients)
                "buffers": st["host_buffers"] + self._grad_pool.nbytes(),
                "capacity_bytes": int(self.config.max_host_gb * GiB) if self.config.max_host_gb else _ram_total()}
        host["used_bytes"] = host["weights"] + host["grads"] + host["optimizer_states"] + host["buffers"]
        self._host_peak = max(getattr(self, "_host_peak", 0), host["used_bytes"])
        host["peak_bytes"] = self._host_peak
        disk = {"weights": wb["disk"], "optimizer_states": st["disk"], "capacity_bytes": st.get("disk_capacity")}
        disk["used_bytes"] = disk["weights"] + disk["optimizer_states"]
        self._disk_peak = max(getattr(self, "_disk_peak", 0), disk["used_bytes"])
        disk["peak_bytes"] = self._disk_peak
        return {"device": dev, "host": host, "disk": disk}

    def telemetry(self) -> dict:
        """Counters: bytes per link, prefetch hits/misses, stall seconds, loads per unit."""
        return self.counters.snapshot()

    def save_pretrained(self, path) -> None:
        """Write a folder that ``AutoModelForCausalLM.from_pretrained`` loads (safetensors)."""
        with self.lock:
            self._check_intact("save_pretrained()")
            engine_io.save_pretrained(self, path)

    def save_checkpoint(self, path) -> None:
        """Weights (Hugging Face layout) plus optimizer states in their stored form."""
        with self.lock:
            self.pager.wait_grads()
            self._check_intact("save_checkpoint()")
            engine_io.save_pretrained(self, path, atomic=False)
            self.states.save(path, self.adam)

    def load_checkpoint(self, path) -> None:
        with self.lock:
            self.pager.wait_grads()
            try:
                self._wait_all_updates()
            except BaseException:  # noqa: BLE001 - a failed update is what loading repairs
                pass
            engine_io.load_weights(self, path)
            self.states.load_saved(path, self.adam)
            self._failed = None

    def close(self) -> None:
        """Release device memory, worker threads and the disk files the engine created."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.pager.wait_grads()
                delivered = self._failed is not None
                try:
                    self._wait_all_updates()
                except BaseException:  # noqa: BLE001 - an error already delivered is not raised again
                    if not delivered:
                        raise
            finally:
                self._update_pool.shutdown(wait=True)
                self.pager.close()
                self.weights.reset()
                if self.disk is not None:
                    self.disk.close()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _check_intact(self, what: str) -> None:
        """After a failed update some units hold the new step and others the old one: reading
        or saving the weights then would hand out a mixture, so it is refused until a load."""
        try:
            self._wait_all_updates()
        except finite.NonFiniteError:
            raise  # a stopped step: nothing was applied, but the caller must hear of it
        except BaseException:  # noqa: BLE001 - recorded in _failed and reported below
            pass
        self._raise_nonfinite()
        failed = self._failed
        if failed is not None:
            raise RuntimeError(f"{what} refused: an optimizer update failed ({type(failed).__name__}: {failed}), so "
                               "the weights hold a half-applied step. load_checkpoint() a saved checkpoint (or "
                               "build a new engine) first.") from failed

    def _raise_nonfinite(self) -> None:
        e, self._nonfinite = self._nonfinite, None
        if e is not None:
            raise e

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this StreamingEngine is closed; create a new one.")
        self._raise_nonfinite()
        failed = self._failed
        if failed is not None:
            raise RuntimeError(f"an optimizer update failed earlier ({type(failed).__name__}: {failed}); weights and "
                               "optimizer states may be out of step. Fix the cause, then load_checkpoint() a saved "
                               "checkpoint or build a new engine.") from failed

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


def _hidden(cfg) -> int:
    cfg = cfg.get_text_config()
    for name in ("hidden_size", "n_embd", "d_model"):
        if getattr(cfg, name, None):
            return int(getattr(cfg, name))
    return 0


def _max_positions(cfg) -> Optional[int]:
    cfg = cfg.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _ram_total() -> Optional[int]:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        return None

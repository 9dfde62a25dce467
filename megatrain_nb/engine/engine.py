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
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from . import io as engine_io
from . import finite
from .config import EngineConfig
from .family import max_positions, vocab_size
from .host_store import HostStore
from .inputs import prepare_batch
from .materialize import SafetensorsSource, take_parameters
from .optimizer import UnitAdamW
from .pager import Pager
from .planner import GiB, engine_plan
from .proxies import LayerProxy
from .states import OptimizerStates
from .step import StepRunner
from .telemetry import Telemetry
from .units import Unit, build_units, check_supported, find_layer_list
from .updates import StepContext, UpdateScheduler
from .weight_store import make_weight_store


@dataclass
class EngineOutput:
    loss: float
    num_tokens: int
    grad_norm: Optional[float] = None   # with step_lr and max_grad_norm: the norm before clipping
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

        _, _, layers = find_layer_list(model)
        self.units: List[Unit] = build_units(model, layers)
        self.embed_unit, self.head_unit = self.units[0], self.units[-1]
        self.layer_units = self.units[1:-1]
        self.persistent_buffers = engine_io.persistent_buffers(model)

        self.plan = engine_plan(self.units, self.model_config, config, cuda=self.device.type == "cuda")
        self.params_on_disk = self.plan.placement["master_weights"] == "disk"
        self.checkpoint_interval = self.plan.checkpoint_interval
        pin = self.device.type == "cuda"
        self.store = HostStore(self.units, pin=pin)
        self.disk = self._open_disk_tier()
        # Pipeline depth: units in flight through host RAM per stage (RAM stays flat).
        # (depth 2 measured no faster on 2 cores and left more optimizer time exposed: keep 1)
        self.inflight_depth = 1
        self.weights = make_weight_store(self.units, self.store, disk=self.disk if self.params_on_disk else None,
                                         pin=pin, counters=self.counters, compute_buffers=2 + self.inflight_depth,
                                         optimizer_buffers=2 if self._small_units() else 1)
        self.states = OptimizerStates(self.units, config, self.counters, disk=self.disk)
        placeholders = take_parameters(model, self.units, self.store.alloc, self.weights.put_initial, _source)
        self.weights.finish_initial()
        self._move_buffers(model)
        model.config.use_cache = False
        self.adam = UnitAdamW(betas=config.adam_betas, eps=config.adam_eps, weight_decay=config.weight_decay)
        self.updates = UpdateScheduler(self.units, grads=self.store, weights=self.weights, states=self.states,
                                       adam=self.adam, counters=self.counters, disk=self.disk,
                                       depth=self.inflight_depth)
        self.updates.policy = self.config.on_nonfinite
        self.pager = Pager(self.units, device=self.device, dtype=self.dtype, layer_slots=self.plan.layer_slots,
                           source=self.updates.ready_weights, source_done=self.weights.transfer_done,
                           telemetry=self.counters, grad_sink=self.updates.gradient_arrived)
        self.pager.max_grads_in_flight = self.inflight_depth
        self.runner = StepRunner(model, self.units, self.pager, placeholders, device=self.device,
                                 checkpoint_interval=self.checkpoint_interval,
                                 loss_chunk_tokens=config.loss_chunk_tokens, plan_reads=self.updates.plan_reads)
        for u in self.layer_units:
            layers[u.layer_index] = LayerProxy(self.runner.layer_call, u)

    @classmethod
    def from_pretrained(cls, folder, config: Optional[EngineConfig] = None, **options) -> "StreamingEngine":
        """Load a local Hugging Face folder, streaming safetensors shards unit by unit.

        The model is built on the meta device; at no time is the whole model in RAM beyond
        the engine's own store (which is on disk for weights when the planner pages them).
        """
        from transformers import AutoConfig, AutoModelForCausalLM

        if not os.path.isdir(folder) or not os.path.exists(os.path.join(folder, "config.json")):
            raise FileNotFoundError(f"{folder!r} is not a local model folder (no config.json); save one with "
                                    "save_pretrained() or pass a model object.")
        hf_config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        return cls(model, config, _source=SafetensorsSource(folder), **options)

    # ------------------------------------------------------------------ construction
    def _small_units(self) -> bool:
        """Units small enough that a spare buffer or two per stream costs little RAM (<= 256 MiB
        each). Large units get the minimum: one optimizer staging buffer (RAM stays flat for
        models far larger than RAM; their steps are long, so what it would overlap is small)."""
        return max(u.numel for u in self.units) * 4 <= (256 << 20)

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
        # read ahead / written behind); the store queues whatever it is given.
        return DiskStore(cfg.offload_dir, reserve_bytes=need, keep=cfg.keep_offload_files)

    def _move_buffers(self, model: nn.Module) -> None:
        for mod in list(model.modules()) + [u.module for u in self.layer_units]:
            for name, b in list(mod._buffers.items()):
                if b is not None and b.device != self.device:
                    mod._buffers[name] = b.to(self.device)

    def _prepare(self, input_ids, attention_mask, labels):
        return prepare_batch(input_ids, attention_mask, labels, vocab=vocab_size(self.model_config),
                             max_pos=max_positions(self.model_config), device=self.device)

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
            step = StepContext(lr=step_lr, clip=max_grad_norm)
            self.updates.begin(step)
            try:
                loss_sum, n = self.runner.run(ids, am, labels, loss_fn=loss_fn, step=step,
                                              grad_scale_tokens=num_items_in_batch)
                self.pager.wait_grads()
                norm, skipped = self.updates.finish(step, loss_sum / max(n, 1))
            except finite.NonFiniteError:
                self.updates.nonfinite = None  # reported now, to this caller
                raise
            finally:
                self.updates.end()
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
            loss_sum, n = self.runner.run(ids, am, labels, loss_fn=loss_fn)
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
        self.updates.check_intact("named_parameters()")
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
        A NaN/inf gradient is refused before any unit moves (or the step skipped: on_nonfinite)."""
        lr = finite.check_lr(lr)
        with self.lock:
            self._check_open()
            self.pager.wait_grads()
            if self.updates.update_all(lr, grad_norm=self.grad_norm()):
                self.counters.add("steps", 1)

    def zero_grad(self) -> None:
        with self.lock:
            self.pager.wait_grads()
            self.updates.wait_all()
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
                "buffers": st["host_buffers"] + self.updates.buffer_bytes(),
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
            self.updates.check_intact("save_pretrained()")
            engine_io.save_pretrained(self, path)

    def save_checkpoint(self, path) -> None:
        """Weights (Hugging Face layout) plus optimizer states in their stored form."""
        with self.lock:
            self.pager.wait_grads()
            self.updates.check_intact("save_checkpoint()")
            engine_io.save_pretrained(self, path, atomic=False)
            self.states.save(path, self.adam)

    def load_checkpoint(self, path) -> None:
        with self.lock:
            self.pager.wait_grads()
            self.updates.settle()
            engine_io.load_weights(self, path)
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
                self.pager.close()
                self.weights.reset()
                if self.disk is not None:
                    self.disk.close()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (a closed engine refuses every call)."""
        return self._closed

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this StreamingEngine is closed; create a new one.")
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


def _ram_total() -> int:
    import psutil

    return int(psutil.virtual_memory().total)

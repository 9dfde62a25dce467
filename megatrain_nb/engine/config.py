"""EngineConfig: the streaming engine's knobs, validated on construction.

The fields of :class:`EngineConfig` are what users set (budgets, tiers, precision, the
optimizer, the placement policies). Settings the planner decides and tests pin down live in
:class:`EngineOverrides` (``EngineConfig(overrides=...)``), so the user-facing list stays short.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch

from megatrain_nb.threads import with_index
from megatrain_nb.values import ValueRefused, check

from .updates.codecs import normalize_compression
from .updates.finite import check_policy, check_recovery
from .planning.prediction import resolve_rates  # (measure's cache behind a profile's name: only when given)

#: the fields the table of values (megatrain_nb/values.py) checks
_CHECKED = ("max_vram_gb", "max_host_gb", "host_cache_gb", "checkpoint_interval", "precision", "adam_eps",
            "weight_decay", "window_tier", "clip_hold", "max_window_micro_batches", "offload_dir", "offload_params",
            "keep_offload_files", "optimizer_threads")


def _betas(value) -> tuple:
    """adam_betas: a pair, each checked by the table's adam_beta1 / adam_beta2 rule."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise ValueRefused(f"EngineConfig.adam_betas={value!r}: must be a pair (beta1, beta2), each "
                           "a finite number >= 0 and < 1 (AdamW's moment decays)")
    return (check("adam_beta1", value[0], "EngineConfig.adam_betas[0]"),
            check("adam_beta2", value[1], "EngineConfig.adam_betas[1]"))


def _compression(value) -> str:
    """optimizer_compression: a codec's name (codecs.normalize_compression), or "auto"."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return normalize_compression(value)
    except ValueError as e:
        raise ValueError(f"EngineConfig.{e}, or 'auto' (the planner picks: docs/TIERS.md)") from None


def _frozen(value) -> tuple:
    """frozen: one name or a sequence of names (non-empty strings), as a tuple."""
    if isinstance(value, str):
        value = (value,)
    if value is None:
        return ()
    if not isinstance(value, (tuple, list, set, frozenset)) or not all(isinstance(v, str) and v for v in value):
        raise ValueRefused(f"EngineConfig.frozen={value!r}: must be a sequence of part names ('vision_tower', "
                           "'projector', 'language_model') or parameter-name prefixes, e.g. ('model.visual',)")
    return tuple(value)


def _lr_scale(value) -> dict:
    """lr_scale: a mapping of non-empty names to finite scales > 0 (None: empty)."""
    if value is None:
        return {}
    ok = isinstance(value, dict) and all(isinstance(k, str) and k for k in value) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in value.values())
    if not ok:
        raise ValueRefused(f"EngineConfig.lr_scale={value!r}: must be a dict of part names ('vision_tower', "
                           "'projector', 'language_model') or parameter-name prefixes to learning-rate scales, "
                           "each a finite number > 0, e.g. {'vision_tower': 0.1}")
    return {k: float(v) for k, v in value.items()}


@dataclass(frozen=True)
class EngineOverrides:
    """Settings the planner decides, pinned for tests and experiments (not for users):
    ``EngineConfig(overrides=EngineOverrides(device_slots=3))`` or ``overrides={"device_slots": 3}``."""

    device_slots: Optional[int] = None
    """Layer slots on the device (>= 2); None = planner picks (2 unless the budget allows more)."""
    loss_chunk_tokens: int = 1024
    """Tokens per chunk of the head + loss; full [batch, seq, vocab] logits never exist."""
    update_chunk_numel: int = 1 << 20
    """Elements of the Adam moments decoded at a time by an update (compressed states),
    rounded down to whole codec blocks; the result does not depend on it."""
    inflight_depth: int = 1
    """Units in flight through host RAM per pipeline stage (updates queued, gradients
    returning). (depth 2 measured no faster on 2 cores and left more optimizer time exposed.)"""
    held_weight_units: Optional[int] = None
    """Master weights on the disk tier, no host cache of it, a clipped step: units whose
    backward read is held for their update (which waits for the norm) beyond the compute
    stream's own buffers; None = as many as the host budget leaves room for."""

    plan_by: str = "auto"
    """How the planner's choices (checkpoint interval, clip hold, master weights on disk) are made:
    "auto" = the fastest predicted plan when the machine's rates are known (``EngineConfig.rates``
    or this machine's cached measurement; engine/planning/plan_pick.py), else the rules; "rules" = always
    the rules (a field at its default is then exactly what the rules make of it)."""

    tile_tokens: Optional[int] = None
    """Tokens per tile of a layer's per-token modules (its MLP) over a long sequence
    (engine/compute/tiling.py); None = from the device budget (64 MiB of MLP intermediates per tile
    without one); 0 = never tile. Sequences no longer than a tile run untiled."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, check(f.name, getattr(self, f.name), f"EngineOverrides.{f.name}"))

    @classmethod
    def of(cls, value) -> "EngineOverrides":
        """An EngineOverrides from itself, a dict of its fields, or None (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - names)
            if unknown:
                raise TypeError(f"unknown engine override(s) {unknown}; valid: {sorted(names)}")
            return cls(**value)
        raise TypeError(f"overrides={value!r}: pass an EngineOverrides, a dict of its fields, or None")


@dataclass
class EngineConfig:
    """Configuration of :class:`~megatrain_nb.engine.StreamingEngine`.

    Example::

        cfg = EngineConfig(device="cpu", max_vram_gb=2, checkpoint_interval=2)
    """

    device: Optional[str] = None
    """"cpu", "cuda", "cuda:1"; None picks cuda when available, else cpu."""
    max_vram_gb: Optional[float] = None
    """Budget for the device working set (slots + activations); None = no cap."""
    max_host_gb: Optional[float] = None
    """Budget for the host store; None = derived from free RAM."""
    offload_dir: Optional[Union[str, os.PathLike]] = None
    """Folder for the disk tier; None = no disk tier."""
    optimizer_compression: Union[str, bool, None] = "none"
    """A registered codec name (``codecs.codec_names()``: "none", "int8", "int4"); True = the
    recommended compact codec, False = "none"; "auto" = the planner picks (exact fp32 states when
    they fit host RAM, else int8; with rates, the fastest predicted: planning/codec_choice.py) --
    the engine's ``config`` then names the codec picked and ``engine.codec`` says why."""
    checkpoint_interval: Optional[int] = 1
    """Save the input of every k-th layer; 1 = weights cross twice per step. None = planner picks.
    0 = no recompute: every layer's activations and weights stay on the device for the step (one
    load per layer; only for models whose layers all fit the device budget)."""
    precision: str = "fp32"
    """"fp32" or "bf16" (bf16 compute; fp32 master weights and gradients)."""
    adam_betas: Tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    """Decoupled weight decay for every parameter except biases and normalisation weights."""
    offload_params: Optional[bool] = None
    """Master weights on disk too: None = the planner decides from max_host_gb; True forces it."""
    host_cache_gb: Optional[float] = None
    """Host RAM used as a cache of the disk tier (disk_cache.HostCache: the step's schedule
    decides what stays resident). None (default) = what max_host_gb leaves after the engine's
    own host needs, or without max_host_gb the free RAM less a safety margin (a quarter of RAM,
    at least 4 GiB, and the budgets of other open caches); never more than the disk tier
    holds. A number = that many GiB; 0 = no cache (every access goes to the disk)."""
    keep_offload_files: bool = False
    """Leave the disk-tier files in place on close() (they are removed by default)."""
    on_nonfinite: str = "stop"
    """A step with a NaN/inf loss or gradient norm: 'stop' raises before it is applied; 'skip'
    drops it (counted in ``telemetry()["skipped_steps"]``) and goes on; 'rewind' (a Trainer's
    run: ``trainer/recovery.py``) goes back to the newest snapshot that checks, lowers the
    learning rate, steps over the data window that diverged and goes on."""
    loss_spike: Optional[float] = None
    """With on_nonfinite='rewind': also recover from a loss more than this many robust standard
    deviations above the median of the last ``loss_spike_window`` steps (None: only NaN/inf)."""
    loss_spike_window: int = 50
    """The logged steps whose losses the loss_spike test compares against."""
    recover_lr_factor: float = 0.5
    """With on_nonfinite='rewind': the learning rate is multiplied by this at each recovery."""
    max_recoveries: int = 3
    """With on_nonfinite='rewind': recoveries before the run stops (listing every attempt)."""
    window_tier: str = "auto"
    """Where a layer-major window keeps its layer-boundary activations: "auto" (the device when
    they fit its budget, else host RAM, else the disk tier), "device", "host" or "disk" (needs
    an offload_dir)."""
    clip_hold: str = "auto"
    """With global-norm clipping, where gradients that arrive final in one piece (a layer-major
    window's, a single micro-batch's) wait for the norm: "host" RAM, "disk" (the disk tier:
    written at once, read back by the update), or "auto" (the default: host RAM when
    max_host_gb holds them beside the master weights, or when no max_host_gb is set; else the
    disk tier; without an offload_dir a budget too short for them is refused with the numbers).
    The planner decides (``engine.plan.placement["gradients"]``); the estimator shows the same."""
    max_window_micro_batches: Optional[int] = None
    """Cap on the micro-batches one layer-major pass runs (None: as many as fit); a larger window
    is split into groups, each layer then crossing to the device 2 x groups times per step."""
    layer_stats: bool = False
    """Gather per-unit statistics at every optimizer step (weight, gradient and update norms, a
    histogram: two more passes per unit in the optimizer), returned with the step's
    ``EngineOutput.layer_stats``; a Session switches them on for its dashboard."""
    frozen: Tuple[str, ...] = ()
    """Parameters that do not train (engine/vision.py ``frozen_names``): part names of a
    vision-language model ("vision_tower", "projector", "language_model") or parameter-name
    prefixes ("model.visual.blocks.0", "lm_head"). A frozen parameter keeps its weights bit for
    bit, takes no gradient back from the device and no AdamW state; an entry matching nothing
    is refused by name."""
    lr_scale: Dict[str, float] = dataclasses.field(default_factory=dict)
    """Learning rates per part: ``{entry: scale}``, entries as ``frozen`` takes them (part names
    "vision_tower", "projector", "language_model", or parameter-name prefixes); AdamW steps those
    parameters at the step's learning rate times the scale, as torch.optim.AdamW's parameter
    groups do (e.g. ``{"vision_tower": 0.1}``; the longer entry wins where two overlap). Scales
    are finite and > 0; an entry matching nothing is refused by name. Any optimizer states (a
    compressed codec's fused kernel steps each group's piece at its own rate); one process."""
    optimizer_threads: Optional[int] = None
    """Threads each AdamW update (plain or compressed) runs on, the results one thread's bit for
    bit; None = on CUDA the host's cores less the engine's own step and copy threads
    (``planning.prediction.update_threads``), on a CPU device 1 (the compute has the cores; a
    compressed update's fused chunks also take the two codec threads)."""
    overrides: Union[EngineOverrides, dict, None] = None
    """Planner and test settings (:class:`EngineOverrides`); None = the defaults."""
    rates: object = dataclasses.field(default=None, repr=False, compare=False)
    """The machine's rates the planner prices its free choices at (``mt.measure_machine()``, a
    profile's name, a dict of MachineRates fields): the engine then takes the fastest plan that
    fits (engine/planning/plan_pick.py) and ``engine.prediction`` uses them. None = this machine's cached
    measurement for the device, if ``megatrain-nb machine`` made one (nothing is measured), else
    the planner's rules."""

    def __post_init__(self):
        if self.device is not None:
            try:
                dev = torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"device={self.device!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'.") from e
            if dev.type not in ("cpu", "cuda"):
                raise ValueError(f"device={self.device!r}: only 'cpu' and 'cuda' devices are supported.")
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device={self.device!r} was asked for but CUDA is not available here; "
                                 "use device='cpu' or None.")
        for name in _CHECKED:
            setattr(self, name, check(name, getattr(self, name), f"EngineConfig.{name}"))
        self.adam_betas = _betas(self.adam_betas)
        self.optimizer_compression = _compression(self.optimizer_compression)
        check_policy(self.on_nonfinite)
        check_recovery(self)
        self.overrides = EngineOverrides.of(self.overrides)
        self.frozen = _frozen(self.frozen)
        self.lr_scale = _lr_scale(self.lr_scale)
        if self.rates is not None:
            self.rates = resolve_rates(self.rates)
        if not isinstance(self.layer_stats, bool):
            raise ValueError(f"EngineConfig.layer_stats={self.layer_stats!r}: must be True or False")
        if self.offload_dir is not None:
            self.offload_dir = os.fspath(self.offload_dir)
        if self.clip_hold == "disk" and not self.offload_dir:
            raise ValueError("clip_hold='disk' needs an offload_dir for the disk tier.")
        if self.window_tier == "disk" and not self.offload_dir:
            raise ValueError("window_tier='disk' needs an offload_dir for the disk tier.")

    @property
    def torch_device(self) -> torch.device:
        """The device, a GPU's with its index (``"cuda"`` is the current one: ``torch.cuda.set_device``
        and the engine's threads need the index)."""
        dev = torch.device(self.device if self.device is not None else
                           "cuda" if torch.cuda.is_available() else "cpu")
        return with_index(dev)

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    @property
    def given(self) -> frozenset:
        """The fields the caller passed (whatever their values): the planner never varies them
        (``best_plans.pinned_of``); a field left out keeps its default and may be chosen."""
        return getattr(self, "_given", frozenset(f.name for f in dataclasses.fields(self)))

    def replace(self, **changes) -> "EngineConfig":
        """A copy with ``changes`` (an :class:`EngineOverrides` field goes into ``overrides``);
        the copy's :attr:`given` is this one's and the fields changed."""
        names = {f.name for f in dataclasses.fields(EngineOverrides)}
        moved = {k: changes.pop(k) for k in list(changes) if k in names}
        if moved:
            changes["overrides"] = dataclasses.replace(EngineOverrides.of(changes.get("overrides", self.overrides)),
                                                       **moved)
        out = dataclasses.replace(self, **changes)
        out._given = self.given | frozenset(changes)
        return out

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        """Build from keyword options, naming any option that is not a field; an
        :class:`EngineOverrides` field (``device_slots=3``) goes into ``overrides``."""
        names = {f.name for f in dataclasses.fields(cls)}
        moved = {k: options.pop(k) for k in list(options) if k in {f.name for f in dataclasses.fields(EngineOverrides)}}
        if moved:
            options["overrides"] = dataclasses.replace(EngineOverrides.of(options.get("overrides")), **moved)
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid options: {sorted(names)}")
        return cls(**options)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(EngineConfig))
_dataclass_init = EngineConfig.__init__


def _init_recording_given(self, *args, **kwargs):
    _dataclass_init(self, *args, **kwargs)
    self._given = frozenset(_FIELD_NAMES[:len(args)]) | frozenset(kwargs)


_init_recording_given.__doc__ = _dataclass_init.__doc__
_init_recording_given.__signature__ = inspect.signature(_dataclass_init)
EngineConfig.__init__ = _init_recording_given   # (EngineConfig.given: which fields the caller passed)

"""Per-unit AdamW on the host: PyTorch's fused CPU kernel's arithmetic (``fused_update``'s C
kernel where it is built, bit for bit the same; else ``torch._fused_adamw_``).

Each unit's flat buffer keeps its decayed parameters first, so one unit is two fused calls
(weight decay on, off); under ``EngineConfig.lr_scale`` the parameters of one learning-rate
scale are one run of each (``Unit.lr_segments``), stepped by a fused call of its own at
``lr * scale`` -- torch.optim.AdamW's parameter groups, exactly (compressed states: each piece's
scalars in the fused kernel's one pass, within the codec's error). The Adam
moments come from an :class:`OptimizerStates` store, which keeps them as fp32 or in a
compressed codec, in RAM or on the disk tier; they are decoded only for the update and encoded
right after.
"""
from __future__ import annotations

import math
import zlib

from typing import Collection, Dict, List, Optional, Tuple

import torch

from .fused_update import CodedChunk, UpdateTeam, adam_args, kernels
from ..planning.prediction import update_threads
from ..units import Unit, train_numel
from ...threads import torch_threads_here



def lr_pieces(unit, a: int, b: int, weight_decay: float) -> List[Tuple[int, int, float, float]]:
    """``(lo, hi, weight_decay, lr scale)``: elements ``[a, b)`` of ``unit`` cut where weight
    decay stops (``decay_numel``) and where a learning-rate scale's run begins or ends
    (``lr_segments``, absent on a unit-like object: none); the empty pieces left out."""
    d, runs = unit.decay_numel, getattr(unit, "lr_segments", ())
    cuts = sorted({a, b, *(x for s, e, _ in runs for x in (s, e) if a < x < b), *((d,) if a < d < b else ())})
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        scale = next((c for s, e, c in runs if s <= lo and hi <= e), 1.0)
        out.append((lo, hi, weight_decay if lo < d else 0.0, scale))
    return out


def lr_layout(unit) -> int:
    """A fingerprint of ``unit``'s learning-rate runs (``Unit.lr_segments``; 0: none): what a
    checkpoint's moments must have been laid out by to load into it."""
    runs = getattr(unit, "lr_segments", ())
    return zlib.crc32(repr(tuple(runs)).encode()) or 1 if runs else 0


class UnitAdamW:
    def __init__(self, *, betas, eps: float, weight_decay: float, collect_stats: bool = False, threads: int = 1):
        self.beta1, self.beta2 = betas
        #: The threads each update runs on (EngineConfig.optimizer_threads): the caller and helpers.
        self.team = UpdateTeam(threads)
        self.eps = eps
        self.weight_decay = weight_decay
        self.steps: Dict[int, torch.Tensor] = {}
        #: Per unit, per parameter: the unit's updates that left the parameter alone (its gradient
        #: was None: :meth:`step_unit`'s ``reached``); its own step count is the unit's less this,
        #: as torch.optim.AdamW counts a parameter's steps. Made at a unit's first such update.
        self.lags: Dict[int, List[int]] = {}
        self.stats: Dict[int, dict] = {}
        #: Per unit: the learning-rate layout (:func:`lr_layout`) of a loaded checkpoint's units, checked
        #: against each unit's own at its first update after the load (None: nothing loaded).
        self.loaded_layouts: Optional[Dict[int, int]] = None
        self.layouts: Dict[int, int] = {}
        #: Per-unit statistics (unit_stats) cost two passes over a unit, as much as a third of
        #: the update itself, on the optimizer's critical path: gathered only once someone reads
        #: them (StreamingEngine.layer_stats turns this on).
        self.collect_stats = collect_stats
        kernels()   # the fused kernels built (or loaded from the cache) now, not in the first update

    @classmethod
    def for_config(cls, config, cuda: bool) -> "UnitAdamW":
        """The engine's: ``EngineConfig``'s betas, eps, weight decay, statistics and threads
        (``optimizer_threads``, its default by ``planning.prediction.update_threads``)."""
        return cls(betas=config.adam_betas, eps=config.adam_eps, weight_decay=config.weight_decay,
                   collect_stats=bool(config.layer_stats), threads=update_threads(cuda, given=config.optimizer_threads))

    def step_unit(self, unit: Unit, params: torch.Tensor, grads: torch.Tensor,
                  exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, lr: float,
                  collect_stats: Optional[bool] = None, grad_norm: Optional[float] = None,
                  reached: Optional[Collection[int]] = None) -> None:
        """One AdamW update of a unit's flat fp32 params in place (moments updated in place).
        ``collect_stats`` None: :attr:`collect_stats`. ``grad_norm``: the gradient's norm when
        the caller knows it (the clipped path took it during the backward), saving a pass.
        ``reached``: the indices (in ``unit.params``) of the parameters whose gradient exists
        (None: all); the others are left as torch.optim.AdamW leaves a parameter whose gradient
        is None -- weights, moments, weight decay and their own step count (:attr:`lags`)."""
        run = self.start_unit(unit, params, collect_stats)
        for a, b, lag in self.runs(unit, reached):
            run.step(a, b, grads, exp_avg[a:b], exp_avg_sq[a:b], lr, lag=lag)
        run.finish(grads, grad_norm=grad_norm)

    def runs(self, unit: Unit, reached: Optional[Collection[int]]) -> List[Tuple[int, int, int]]:
        """``(start, end, lag)``: the element ranges of ``unit`` an update steps, each of
        parameters with one step count (the unit's less ``lag``); the parameters not ``reached``
        fall behind by one (:attr:`lags`). All of it in one range while nothing was left out."""
        n, lags = train_numel(unit), self.lags.get(unit.index)
        if lags is None and (reached is None or len(reached) >= len(unit.params)):
            return [(0, n, 0)]
        if lags is None:
            lags = self.lags[unit.index] = []
        lags.extend([0] * (len(unit.params) - len(lags)))   # (a checkpoint keeps those not 0)
        out: List[Tuple[int, int, int]] = []
        for i, p in enumerate(unit.params):
            if p.offset >= n or p.numel == 0:
                continue
            if reached is not None and i not in reached:
                lags[i] += 1
            elif out and out[-1][1] == p.offset and out[-1][2] == lags[i]:
                out[-1] = (out[-1][0], p.offset + p.numel, lags[i])
            else:
                out.append((p.offset, p.offset + p.numel, lags[i]))
        return out

    def start_unit(self, unit: Unit, params: torch.Tensor,
                   collect_stats: Optional[bool] = None) -> "UnitRun":
        """One unit's update applied slice by slice (:meth:`UnitRun.step` on ``[a, b)``, then
        :meth:`UnitRun.finish`): the same arithmetic as :meth:`step_unit` (AdamW is elementwise;
        the step count advances once), so the moments need exist only a slice at a time."""
        if collect_stats is None:
            collect_stats = self.collect_stats
        self._check_layout(unit)
        step = self.steps.get(unit.index)
        if step is None:
            step = self.steps[unit.index] = torch.zeros((), dtype=torch.float32)
        old = None
        if collect_stats:   # the update norm is estimated from a strided sample
            old = params[::max(1, unit.numel // 65536)].clone()
        step.add_(1)
        return UnitRun(self, unit, params, step, old)

    def fused(self, params, grads, exp_avg, exp_avg_sq, step, lr: float, wd: float) -> None:
        """AdamW on flat fp32 buffers, ``torch._fused_adamw_``'s result bit for bit. On one thread
        the fused kernels' (``fused_update``: torch's arithmetic with one division fewer; faster
        than torch's per thread on an AVX2 host) where they are built; on the update's
        :attr:`team` of N threads torch's own kernel, one call on N torch threads: its split at
        cache lines gives one thread's floats, and against DeepSpeedCPUAdam it measured faster
        than the kernel cut in a piece per thread (benchmarks/bench_update_speed.py)."""
        k, threads = kernels(), self.team.threads
        if threads == 1 and k is not None and all(t.dtype == torch.float32 and t.device.type == "cpu"
                                                  and t.is_contiguous() for t in (params, grads, exp_avg, exp_avg_sq)):
            n = params.numel()
            k.adamw(params, grads, exp_avg, exp_avg_sq, 0, adam_args(
                lr=float(lr), beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=wd, step=float(step),
                decay_end=n, regions=[(0, n)], width=k.width))
            return
        prev = torch.get_num_threads()
        if prev != threads:   # (this thread's count only: threads started later keep the default)
            torch_threads_here(threads)
        try:
            torch._fused_adamw_([params], [grads], [exp_avg], [exp_avg_sq], [], [step], lr=float(lr),
                                beta1=self.beta1, beta2=self.beta2, weight_decay=wd, eps=self.eps, amsgrad=False,
                                maximize=False)
        finally:
            if prev != threads:
                torch_threads_here(prev)

    def close(self) -> None:
        """Stop the update's helper threads."""
        self.team.close()

    def _check_layout(self, unit) -> None:
        """Refuse moments laid out for other learning-rate scales (a checkpoint saved under another
        EngineConfig.lr_scale orders the unit's elements otherwise), else note the unit's layout."""
        mine = lr_layout(unit)
        if self.loaded_layouts is not None and unit.index in self.steps and unit.index not in self.layouts:
            if self.loaded_layouts.get(unit.index, 0) != mine:
                raise ValueError(f"the checkpoint's optimizer states of unit {unit.name!r} were saved under "
                                 "another EngineConfig.lr_scale (its elements are ordered by scale); resume with "
                                 "the lr_scale it was saved with")
        self.layouts[unit.index] = mine

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The units' step counts (``"<unit index>"``), the parameters' lags (``"<unit
        index>.lag.<parameter index>"``, those not 0) and the scaled units' learning-rate layouts
        (``"<unit index>.lr_layout"``: :func:`lr_layout`), each a scalar."""
        out = {str(i): s.clone() for i, s in self.steps.items()}
        out.update({f"{i}.lr_layout": torch.tensor(float(x), dtype=torch.float64)
                    for i, x in self.layouts.items() if x})
        out.update({f"{i}.lag.{j}": torch.tensor(float(x)) for i, lags in self.lags.items()
                    for j, x in enumerate(lags) if x})
        return out

    def load_state_dict(self, sd: Dict[str, torch.Tensor]) -> None:
        self.steps = {int(k): v.clone().float() for k, v in sd.items() if "." not in k}
        self.lags, self.layouts = {}, {}
        self.loaded_layouts = {int(k.split(".")[0]): int(v) for k, v in sd.items() if k.endswith(".lr_layout")}
        for k, v in sd.items():
            if ".lag." in k:
                i, j = (int(x) for x in k.split(".lag."))
                need = j + 1 - len(self.lags.setdefault(i, []))
                self.lags[i].extend([0] * max(need, 0))
                self.lags[i][j] = int(v)


class UnitRun:
    """A unit's AdamW update in slices (:meth:`UnitAdamW.start_unit`)."""

    def __init__(self, adam: UnitAdamW, unit: Unit, params: torch.Tensor, step: torch.Tensor, old):
        self.adam, self.unit, self.params, self.step_t, self.old = adam, unit, params, step, old

    def step(self, a: int, b: int, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
             lr: float, params: Optional[torch.Tensor] = None, grads_at: int = 0, lag: int = 0) -> None:
        """AdamW on elements ``[a, b)`` of the unit; ``exp_avg``/``exp_avg_sq`` hold just that
        slice (``b - a`` elements), and ``params`` too when given (else the unit's weights given
        to :meth:`UnitAdamW.start_unit`); ``grads`` starts at the unit's element ``grads_at``
        (0: the whole unit's; ``a``: the slice's own, read chunk by chunk). The slice is split
        where weight decay stops (the decayed parameters come first), as
        :meth:`UnitAdamW.step_unit` splits the whole unit. ``exp_avg`` a ``CodedChunk`` (a
        fused chunked update): the kernel decodes, steps and encodes the chunk in one pass, with
        the same arithmetic as those fused calls (:meth:`_step_coded`). ``lag``: the slice's
        parameters have taken that many fewer steps than the unit (:attr:`UnitAdamW.lags`)."""
        if isinstance(exp_avg, CodedChunk):
            self._step_coded(a, b, grads, exp_avg, lr, params, grads_at)
            return
        for lo, hi, wd, scale in lr_pieces(self.unit, a, b, self.adam.weight_decay):
            w = self.params[lo:hi] if params is None else params[lo - a:hi - a]
            g = grads[lo - grads_at:hi - grads_at]
            step = self.step_t if not lag else self.step_t - lag
            self.adam.fused(w, g, exp_avg[lo - a:hi - a], exp_avg_sq[lo - a:hi - a], step,
                            lr if scale == 1.0 else lr * scale, wd)

    def _step_coded(self, a: int, b: int, grads: torch.Tensor, chunk: CodedChunk, lr: float,
                    params: Optional[torch.Tensor], grads_at: int) -> None:
        """The chunk's pieces (:func:`lr_pieces`: cut where weight decay stops and where a
        learning-rate group begins or ends) each get their own scalars, stepped in one pass by the
        kernel (a group may end inside a codec block): the same arithmetic as one fused call per
        piece, the fp32 path's."""
        adam, lr, step, width = self.adam, float(lr), float(self.step_t), chunk.kernels.width
        args = [adam_args(lr=lr * scale, beta1=adam.beta1, beta2=adam.beta2, eps=adam.eps, weight_decay=wd,
                          step=step, decay_end=hi if wd else lo, regions=[(lo, hi)], width=width, lo=lo, hi=hi)
                for lo, hi, wd, scale in lr_pieces(self.unit, a, b, adam.weight_decay)]
        w = params if params is not None else self.params[a:b]
        g = grads[a - grads_at:b - grads_at]
        chunk.step(w, g, args, team=adam.team)

    def finish(self, grads: torch.Tensor, grad_norm: Optional[float] = None) -> None:
        if self.old is not None:
            st = unit_stats(self.unit, self.params, grads, self.old, grad_norm=grad_norm)
            st["optimizer_step"] = int(self.step_t)
            self.adam.stats[self.unit.index] = st


def _histogram_sample(unit: Unit, params: torch.Tensor, size: int = 65536) -> tuple:
    """``(sample, what)``: the histogram's strided sample of the unit's matrices (weights of two
    or more dimensions: "matrices"), so norm weights near 1 beside matrices near 0 do not squeeze
    the matrices' mass into a corner of the range; of all its weights ("all") where the unit has
    no matrix, only matrices, or ``params`` is a shard."""
    mats = [p for p in unit.params if len(p.shape) >= 2]
    if not mats or len(mats) == len(unit.params) or params.numel() != unit.numel:
        return params[::max(1, params.numel() // size)], "all"
    sizes = [math.prod(p.shape) for p in mats]
    stride = max(1, sum(sizes) // size)
    return torch.cat([params[p.offset:p.offset + n][::stride] for p, n in zip(mats, sizes)]), "matrices"


def unit_stats(unit: Unit, params: torch.Tensor, grads: torch.Tensor, old_sample: torch.Tensor,
               bins: int = 32, grad_norm: Optional[float] = None) -> dict:
    """Exact weight and gradient norms; update norm and histogram from a strided sample.

    Cheap enough to run every step (two passes over the unit besides the sample).
    """
    stride = max(1, unit.numel // 65536)
    sample = params[::stride]
    w_norm = float(torch.linalg.vector_norm(params))
    g_norm = float(torch.linalg.vector_norm(grads)) if grad_norm is None else float(grad_norm)
    scale = (params.numel() / max(1, sample.numel())) ** 0.5
    upd = float(torch.linalg.vector_norm(sample - old_sample)) * scale
    shown, hist_of = _histogram_sample(unit, params)
    lo, hi = float(shown.min()), float(shown.max())
    if lo == hi:
        lo, hi = lo - 1e-6, hi + 1e-6
    counts = torch.histc(shown, bins=bins, min=lo, max=hi)
    step = (hi - lo) / bins
    return {
        "unit": unit.name, "index": unit.index, "kind": unit.kind, "numel": unit.numel,
        "weight_norm": w_norm, "grad_norm": g_norm, "update_norm": upd,
        "update_ratio": upd / w_norm if w_norm > 0 else 0.0,
        "hist_counts": [int(c) for c in counts.tolist()], "hist_of": hist_of,
        "hist_edges": [lo + i * step for i in range(bins + 1)],
    }

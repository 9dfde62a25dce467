"""The fp32 gradient sums a step forms on the device, one per unit, over its micro-batches:
made (from the update side's lent buffers where there are some), added into, handed to the host
through the pager, and counted (``bytes`` alive now, their ``peak``). The layer-major loop
(:mod:`.step`) owns when; this module owns how."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from ..units import Unit, train_numel

__all__ = ["GradSums"]


class GradSums:
    """Gradient sums of units on ``device``; ``grad_buffer(numel)`` lends the buffer a sum is
    formed in (None: a fresh zeroed tensor). ``straight``: this group's sums go straight to
    their updates (unclipped), so a new one waits until every sum returned so far is taken."""

    def __init__(self, pager, device: torch.device,
                 grad_buffer: Optional[Callable[[int], torch.Tensor]] = None,
                 reached: Optional[Callable[[Unit, List[int]], None]] = None):
        self.pager = pager
        #: told which parameters of an outer unit a micro-batch's backward reached (the others'
        #: gradient is None: AdamW leaves them alone, ``optimizer.UnitAdamW.step_unit``)
        self.reached = reached
        self.device = device
        self.grad_buffer = grad_buffer
        self.bytes = 0          # fp32 gradient sums alive on the device now
        self.peak = 0           # ... and their peak over the steps run
        self.straight = False   # this group's sums go straight to their updates (unclipped)

    @staticmethod
    def add(acc: torch.Tensor, unit: Unit, grads: Sequence[Optional[torch.Tensor]]) -> None:
        for p, g in zip(unit.params, grads):
            if g is not None and not p.frozen:   # (a frozen parameter's gradient is zero; split off: no room)
                acc[p.offset:p.offset + p.numel].add_(g.reshape(-1))

    @staticmethod
    def grads_into(acc: torch.Tensor, unit: Unit, params: List[torch.Tensor]) -> bool:
        """Let autograd add each parameter's gradient straight into the unit's fp32 sum: every
        bound parameter's ``.grad`` becomes its view of ``acc``, and AccumulateGrad adds into an
        existing ``.grad`` in place (the backward runs with grad mode off). A micro-batch's
        backward then holds one parameter's fresh gradient at a time, not a whole unit's beside
        the sum (``autograd.grad`` returns them all at once). The same adds in the same order
        (the first into the zeroed sum is exact). Only where the bound tensors are fp32 on the
        sum's device (a bf16 parameter cannot have an fp32 ``.grad``): otherwise False, and the
        caller adds ``autograd.grad``'s results itself (:meth:`add`)."""
        if any(p.dtype != acc.dtype or p.device != acc.device for p in params):
            return False
        for spec, p in zip(unit.params, params):
            if not spec.frozen:   # (a frozen one's zero gradient goes nowhere)
                p.grad = acc[spec.offset:spec.offset + spec.numel].view(spec.shape)
        return True

    def fold_outer(self, acc: Optional[torch.Tensor], unit: Unit, bound: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """Move the bound outer tensors' .grad (this micro-batch's share) into the fp32 sum,
        made on the first share (an untied embedding's sum exists only at the step's end)."""
        grads = [t.grad for t in bound]
        if self.reached is not None and bound:
            self.reached(unit, [i for i, g in enumerate(grads) if g is not None])
        if acc is None and any(g is not None for g, p in zip(grads, unit.params) if not p.frozen):
            acc = self.new(train_numel(unit))
        if acc is not None:
            self.add(acc, unit, grads)
        for t in bound:
            t.grad = None
        return acc

    def new(self, numel: int) -> torch.Tensor:
        """A zeroed fp32 buffer on the device for a unit's gradient summed over micro-batches."""
        if self.grad_buffer is not None:
            if self.straight:
                # The sums go straight to their updates: take the next one once every sum
                # returned so far is with its update (the one before it done). RAM then holds
                # the unit being updated and the sum being formed, never a third waiting in
                # line; the backward of a unit still overlaps the update of the one above it.
                self.pager.wait_grads()
            acc = self.grad_buffer(numel).zero_()
        else:
            acc = torch.zeros(numel, dtype=torch.float32, device=self.device)
        self.bytes += numel * 4
        self.peak = max(self.peak, self.bytes)
        return acc

    def send(self, unit: Unit, acc: torch.Tensor) -> None:
        """Send a unit's final sum to the host (whole: a lent buffer is adopted, not copied)."""
        self.pager.return_grads(unit, [acc])
        self.bytes -= acc.numel() * 4

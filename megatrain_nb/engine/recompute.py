"""What a step needs to run a layer again: the device bytes of activations it holds counted
(:class:`ActivationMeter`, with the tensors autograd saves while a layer is (re-)run), and the
RNG state a recompute replays (:func:`rng_state`, :func:`restored_rng`), so dropout draws the
same masks the first pass drew."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["ActivationMeter", "restored_rng", "rng_state"]


class ActivationMeter:
    """Device bytes of activations (saved inputs, work, logits): ``now`` and ``peak``.
    ``saved``: activations held across the step (boundary, fronts, kept graphs); ``front``: the
    micro-batches' hidden states (or gradients) between the layers; ``held``: autograd graphs
    held from the capture to the embedding's backward (a VLM's image features: vision.py).
    ``boundary`` counts the
    boundary activations on the device; ``pager.slot_storages()`` names the weights' storages,
    which a layer's saved tensors do not count."""

    def __init__(self, boundary, pager):
        self.boundary = boundary
        self.pager = pager
        self.now = 0
        self.peak = 0
        self.saved = 0
        self.front = 0
        self.held = 0
        self.held_widest = 0   # the largest storage of a held graph (its backward's gradients in flight)
        self._slot_ptrs = None

    def note(self, extra: int = 0) -> None:
        self.saved = self.boundary.bytes["device"] + self.front + self.held
        self.at(self.saved + extra)

    def at(self, nbytes: int) -> None:
        self.now = nbytes
        self.peak = max(self.peak, nbytes)

    def note_held_backward(self, nbytes: int) -> None:
        """A held graph of ``nbytes`` saved bytes (no longer in :attr:`held`) running backward: its
        saved tensors and the gradients of its two widest in flight, as a layer's re-run. Measured
        on the Qwen2-VL tower of benchmarks/bench_vlm.py (CPU, fp32): the backward's live peak is
        1.11x its saved bytes (pixels included), this count 0.93x that peak -- the rest is the
        attention's per-image score matrices in the CPU kernel's backward --, 2x counted it 1.8x."""
        self.note(nbytes + 2 * self.held_widest)

    @contextlib.contextmanager
    def count_saved(self, accumulate: bool = False, hold: bool = False):
        """Count the bytes autograd saves while one layer is (re-)run (weights in slots excluded);
        ``hold``: a graph kept until a later pass takes it (added to :attr:`held`)."""
        if self._slot_ptrs is None:
            self._slot_ptrs = self.pager.slot_storages()
        total = [0, 0]   # all saved storages' bytes, the largest one's that takes a gradient
        seen = set()

        def pack(t):
            try:
                ptr = t.untyped_storage().data_ptr()
            except Exception:
                return t
            if ptr not in self._slot_ptrs and ptr not in seen:
                seen.add(ptr)
                n = t.untyped_storage().nbytes()
                total[0] += n
                if t.requires_grad:   # a gradient flows back to it (not to the pixels, masks, RoPE)
                    total[1] = max(total[1], n)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        if hold:
            self.held += total[0]
            self.held_widest = max(self.held_widest, total[1])
            self.note()
        elif accumulate:  # graphs kept for the backward (checkpoint_interval=0)
            self.saved += total[0]
            self.at(self.saved)
        else:  # the re-run's backward: its saved tensors, and the gradients of the two widest in
            # flight at once (the MLP's act(gate) and up, from their product's); a layer's backward
            # frees each node's saved tensors as it runs, so never all of them beside their gradients
            # (planning/planner.LayerDims.work_bytes; tests/engine/test_activation_plan.py)
            self.at(self.saved + total[0] + 2 * total[1])


def rng_state(device: torch.device) -> dict:
    """The CPU RNG state, and ``device``'s where it is a GPU."""
    st = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


@contextlib.contextmanager
def restored_rng(st, device: torch.device):
    """Run under the RNG state ``st`` (from :func:`rng_state`; None: as it is), the caller's
    state kept."""
    if st is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(st["cpu"])
        if "cuda" in st:
            torch.cuda.set_rng_state(st["cuda"], device)
        yield

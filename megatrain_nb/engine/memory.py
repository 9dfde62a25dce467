"""The engine's memory report: bytes per tier (device, host RAM, disk) and what holds them."""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .tiers.diskspace import filesystem_of
from .planning.planner import GiB
from .planning.rates import H100_BF16, H100_FP32, H100_TF32, precision_words  # noqa: F401 - (re-exported)


#: Device memory no plan may count on: the CUDA context, cuBLAS workspaces, the caching
#: allocator's per-stream pools and fragmentation (the larger of the two).
DEVICE_HEADROOM_BYTES = 1 << 30
DEVICE_HEADROOM_SHARE = 0.05


def device_capacity(device: torch.device) -> int:
    """Bytes this process may plan on for ``device``: what the driver says is free now
    (``mem_get_info``: other processes and contexts taken out) plus what this process's caching
    allocator already holds (the engine's own slots and buffers are in it), less a headroom."""
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    return max(0, free + held - max(DEVICE_HEADROOM_BYTES, int(DEVICE_HEADROOM_SHARE * total)))


def tf32_enabled() -> bool:
    """Whether fp32 matmuls may use TF32 tensor cores (either of PyTorch's two switches)."""
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def precision_note(device, precision: str, rates=None, tf32: Optional[bool] = None) -> Optional[str]:
    """On CUDA with fp32 compute and TF32 off, the line of :func:`.planning.rates.precision_words`
    (``mt.estimate`` prints the same); None otherwise."""
    if torch.device(device).type != "cuda":
        return None
    return precision_words(precision, tf32_enabled() if tf32 is None else tf32, rates)


def ram_total() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def memory_report(*, pager, runner, store, states, weights, updates, boundary, boundary_peak: Dict[str, int],
                  peaks: Dict[str, int], config, device, grad_sums_peak: int = 0) -> dict:
    """``{"device", "host", "disk"}`` with bytes per kind, used, peak and capacity. ``peaks``
    (``{"host", "disk"}``) carries the peaks seen across calls and is updated here.
    ``grad_sums_peak``: a layer-major window's fp32 gradient sums on the device (peak)."""
    tower = getattr(getattr(runner, "tower", None), "pager", None)   # a streamed vision tower's two block slots
    dev_w = pager.slot_bytes + (tower.slot_bytes if tower is not None else 0)
    dev_g = pager.grad_buf_bytes + (tower.grad_buf_bytes if tower is not None else 0)
    act = runner.activation_peak
    dev = {"weights": dev_w, "grads": dev_g, "activations": act,
           # (part of "weights") the streamed vision tower's block slots (compute/vision_stream.py)
           "vision_block_slots": tower.slot_bytes if tower is not None else 0,
           # layer-boundary activations of a layer-major window (part of "activations"); peak
           "boundary_activations": boundary_peak["device"],
           # a layer-major window's per-unit fp32 gradient sums (current unit, head, embedding);
           # peak. On a CPU "device" these are RAM lent by the update pool (host "buffers")
           "grad_sums": grad_sums_peak,
           "used_bytes": dev_w + dev_g + runner.activation_now,
           "peak_bytes": dev_w + dev_g + act + grad_sums_peak,
           "capacity_bytes": int(config.max_vram_gb * GiB) if config.max_vram_gb else None}
    if device.type == "cuda":
        dev["allocator_used_bytes"] = torch.cuda.memory_allocated(device)
        dev["allocator_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        # what the caching allocator holds (blocks cached, fragmentation): what the device runs out of
        dev["allocator_reserved_bytes"] = torch.cuda.memory_reserved(device)
        dev["allocator_reserved_peak_bytes"] = torch.cuda.max_memory_reserved(device)
        if dev["capacity_bytes"] is None:
            dev["capacity_bytes"] = torch.cuda.get_device_properties(device).total_memory
    hb = store.nbytes()
    st = states.nbytes()
    wb = weights.nbytes()
    # The disk tier's host cache (disk_cache.HostCache) holds some of that tier's data in RAM:
    # each kind counts as what it is (cached optimizer states are optimizer states); what no
    # owner claims (layer-boundary activations) stays "disk_cache".
    cached = {"optimizer_states": st.get("cached", 0), "weights": wb.get("cached", 0),
              "grads": updates.held_cached_bytes()}
    disk_tier = getattr(states, "disk", None)
    cache = disk_tier.report() if disk_tier is not None and hasattr(disk_tier, "report") else None
    host = {"weights": wb["host"] + cached["weights"],
            "grads": hb["grads"] + updates.held_ram_bytes() + cached["grads"],
            "optimizer_states": st["host"] + cached["optimizer_states"],
            # states read ahead of their updates + recycled scratch (moments, final gradients)
            # (and the pinned buffers gradients arrive in from the device, updated there)
            "buffers": st["host_buffers"] + updates.buffer_bytes() + boundary.free_bytes() + pager.grad_host_bytes
            + (tower.grad_host_bytes if tower is not None else 0),
            # layer-boundary activations a layer-major window kept in host RAM (peak)
            "activations": boundary_peak["host"],
            "capacity_bytes": int(config.max_host_gb * GiB) if config.max_host_gb else ram_total()}
    host["disk_cache"] = max(0, cache["ram_bytes"] - sum(cached.values())) if cache else 0
    if cache:   # a dict: not a kind of bytes in the tier (the dashboard shows it as text)
        host["disk_cache_stats"] = {k: cache[k] for k in ("capacity_bytes", "ram_bytes", "hits", "bytes_saved",
                                                          "disk_read_bytes", "disk_write_bytes")}
        host["disk_cache_stats"]["by_kind"] = {k: v for k, v in cached.items() if v}
    host["used_bytes"] = (host["weights"] + host["grads"] + host["optimizer_states"] + host["buffers"]
                          + host["disk_cache"] + boundary.bytes["host"])
    peaks["host"] = max(peaks["host"], host["used_bytes"],
                        host["used_bytes"] - boundary.bytes["host"] + boundary_peak["host"])
    host["peak_bytes"] = peaks["host"]
    disk = {"weights": wb["disk"], "optimizer_states": st["disk"], "grads": updates.held_disk_bytes(),
            # layer-boundary activations a layer-major window kept on the disk tier (peak)
            "activations": boundary_peak["disk"],
            "capacity_bytes": st.get("disk_capacity")}
    disk["used_bytes"] = (disk["weights"] + disk["optimizer_states"] + disk["grads"]
                          + boundary.bytes["disk"])
    peaks["disk"] = max(peaks["disk"], disk["used_bytes"])
    disk["peak_bytes"] = peaks["disk"]
    if disk_tier is not None and getattr(disk_tier, "root", None):
        disk["filesystem"] = filesystem_of(disk_tier.root)   # a dict: where the tier is, how much is free
    return {"device": dev, "host": host, "disk": disk}

"""A machine's rates: what the step-time prediction (``engine/prediction.py``) is computed from.

``MachineRates`` holds one number per resource the engine's pipeline uses, in plain units
(bytes per second, FLOP per second, parameters per second), measured on this machine by
``mt.measure_machine`` (``engine/measure.py``) or taken from a named profile of a machine we
cannot measure (``PROFILES``), each number of a profile with its published source.

Every rate is a *sustained* rate at the engine's own sizes and access pattern, not a peak: the
prediction multiplies it by the bytes or FLOPs of a step and adds nothing else.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Optional


@dataclass
class MachineRates:
    """Rates of one machine (device, host, disk), all per second.

    device: "cpu" or the accelerator's name ("cuda:0 NVIDIA H200").
    cores: CPU cores this process may use.
    h2d_pageable / h2d_pinned / d2h_pageable / d2h_pinned: host<->device copy, bytes/s, at the
        engine's transfer sizes (one layer's weights); on a CPU device, the memcpy rate.
    matmul_flops: device fp32 matmul FLOP/s at the model's shapes (``matmul_by_shape`` per
        "MxKxN" when measured for a model; ``matmul_flops`` is the one used when a shape is missing).
    attention_flops: device FLOP/s of the attention kernel (SDPA) at the model's head size.
    disk_read / disk_write: bytes/s through the engine's own I/O path (O_DIRECT where the
        filesystem has it, its block sizes and queue depth) on ``disk_path``'s filesystem.
    adamw_per_thread: parameters/s of the fused CPU AdamW on one thread (fp32 states).
    codec_per_thread: bytes of fp32 states/s encoded+decoded on one thread, per codec ("int8", "int4").
    source: "measured" or a profile's name; ``sources`` maps a field to its published source.
    """

    device: str = "cpu"
    cores: int = 1
    h2d_pageable: float = 0.0
    h2d_pinned: float = 0.0
    d2h_pageable: float = 0.0
    d2h_pinned: float = 0.0
    matmul_flops: float = 0.0
    matmul_by_shape: dict = field(default_factory=dict)
    attention_flops: float = 0.0
    disk_read: float = 0.0
    disk_write: float = 0.0
    disk_path: Optional[str] = None
    filesystem: Optional[str] = None
    adamw_per_thread: float = 0.0
    codec_per_thread: dict = field(default_factory=dict)
    source: str = "measured"
    sources: dict = field(default_factory=dict)
    measured_at: Optional[float] = None
    seconds_taken: Optional[float] = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MachineRates":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"MachineRates: unknown fields {unknown}; known: {sorted(names)}")
        return cls(**d)

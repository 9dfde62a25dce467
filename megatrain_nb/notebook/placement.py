"""Where a branch trains: on its parent's engine, taking turns, or side by side on another device.

``session.fork(..., device="cuda:1")`` asks for a branch on another device: it gets an engine
of its own there (:func:`sibling_engine`: same settings and model shape, its state loaded from
the fork's snapshot) and trains while its parent trains too. Without ``device=``, or with the
parent's device, the branch shares the parent's engine: one branch trains at a time, and
starting one pauses the one training (and says so; ``branches.Explorer.activate``).
"""
from __future__ import annotations

#: not a setting but where a fork trains (Session.fork's ``device=``)
PLACEMENT = "device"


def placement(current, wanted) -> str:
    """Where a fork asked for ``device=wanted`` trains, its parent's engine being on ``current``:
    ``"shared"`` (no device, or the same one: the branches take turns on one engine, starting
    one pauses the one training) or ``"side_by_side"`` (another device: an engine of its own
    there, both train at once). ``"cuda"`` is device 0 (as is ``"cpu"``)."""
    if wanted is None:
        return "shared"
    return "shared" if _device_key(current) == _device_key(wanted) else "side_by_side"


def _device_key(device) -> tuple:
    kind, _, index = str(device).strip().lower().partition(":")
    if not kind or (index and not index.isdigit()):
        raise ValueError(f"device={device!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'")
    return kind, int(index or 0)


def sibling_engine(engine, device: str):
    """An engine like ``engine`` (same settings and model shape) on ``device``, for a branch that
    trains side by side; its weights and states come from the fork's snapshot when it starts
    (the model is built on the meta device: nothing is held twice in RAM before that)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(engine.model_config)
    return type(engine)(model, engine.config.replace(device=device), workload=engine.workload)   # (the same pick)

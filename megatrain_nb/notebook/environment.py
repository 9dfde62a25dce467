"""What a report says about the run's configuration and the machine it ran on."""
from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import sys
from typing import Any

from megatrain_nb.formatting import fmt_bytes

_ARGS_SHOWN = ("output_dir", "max_steps", "num_train_epochs", "per_device_train_batch_size",
               "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_steps",
               "weight_decay", "max_grad_norm", "logging_steps", "eval_strategy", "eval_steps", "save_strategy",
               "seed", "bf16")


def configuration(session: Any) -> list[tuple[str, Any]]:
    """Model shape, the training arguments that matter, and the engine configuration."""
    rows: list[tuple[str, Any]] = [("session", session.name), ("session id", session.id)]
    engine = session.engine
    cfg = getattr(engine, "model_config", None)
    if cfg is not None:
        rows.append(("model type", getattr(cfg, "model_type", "?")))
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                    "max_position_embeddings", "tie_word_embeddings"):
            if hasattr(cfg, key):
                rows.append((f"model {key}", getattr(cfg, key)))
    n = _safe(lambda: engine.num_parameters())
    if n:
        rows.append(("parameters", f"{n:,}"))
    args = getattr(session.trainer, "args", None)
    if args is not None:
        for key in _ARGS_SHOWN:
            if hasattr(args, key):
                v = getattr(args, key)
                rows.append((f"args.{key}", getattr(v, "value", v)))
    launch = getattr(session, "launch_info", None)   # ranks in worker processes (notebook/remote.py)
    if callable(launch):
        rows.extend(launch())
    econf = getattr(engine, "config", None)
    if dataclasses.is_dataclass(econf):
        for f in dataclasses.fields(econf):
            rows.append((f"engine.{f.name}", getattr(econf, f.name)))
    return rows


def environment(session: Any) -> list[tuple[str, Any]]:
    """Versions, device, RAM and disk."""
    import torch

    rows: list[tuple[str, Any]] = [("python", sys.version.split()[0]), ("platform", platform.platform())]
    for mod in ("megatrain_nb", "torch", "transformers", "datasets", "ipywidgets", "plotly", "ipykernel"):
        rows.append((mod, _version(mod)))
    device = getattr(session.engine, "device", None)
    rows.append(("device", str(device) if device is not None else "?"))
    # a launched run's kernel never initialises CUDA (its ranks do), so it does not ask the GPU
    if session.engine is not None and torch.cuda.is_available():
        rows.append(("accelerator", torch.cuda.get_device_name(0)))
        rows.append(("accelerator memory", fmt_bytes(torch.cuda.get_device_properties(0).total_memory)))
    rows.append(("CPU cores", os.cpu_count()))
    try:
        import psutil

        vm = psutil.virtual_memory()
        rows.append(("RAM", f"{fmt_bytes(vm.total)} total, {fmt_bytes(vm.available)} available at report time"))
    except Exception:  # noqa: BLE001 - psutil is a dependency, but a report must not fail over it
        pass
    for label, path in (("output_dir", getattr(getattr(session.trainer, "args", None), "output_dir", None)),
                        ("offload_dir", getattr(getattr(session.engine, "config", None), "offload_dir", None))):
        if path:
            probe = str(path)
            while probe and not os.path.exists(probe):
                probe = os.path.dirname(probe)
            usage = _safe(lambda p=probe: shutil.disk_usage(p or "."))
            if usage:
                rows.append((f"disk at {label}", f"{fmt_bytes(usage.free)} free of {fmt_bytes(usage.total)} ({path})"))
    return rows


def _version(mod: str) -> str:
    try:
        from importlib.metadata import version

        return version(mod.replace("_", "-"))
    except Exception:  # noqa: BLE001
        m = sys.modules.get(mod)
        return str(getattr(m, "__version__", "not installed"))


def _safe(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None

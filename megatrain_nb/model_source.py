"""What a user names as "the model", resolved once: a preset name, a local folder (or a
config.json file), a Hugging Face Hub id, a model object, a transformers config or a built
engine. The Trainer, the engine's ``from_pretrained``, the Session, the multi-process launcher,
the CLI and the estimator all call :func:`resolve` and act on the :class:`ModelSource` it returns,
so the order of the checks (an existing path first, then a preset, then a Hub id) and the words
of every refusal are the same everywhere.

Example::

    >>> from megatrain_nb.model_source import resolve
    >>> resolve("tiny").kind
    'preset'
    >>> resolve("Qwen/Qwen2.5-0.5B").folder     # doctest: +SKIP  (fetched into the HF cache)
"""
from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatrain_nb.gguf_in import gguf_source, is_gguf
from megatrain_nb.hub import ModelNotFoundError, resolve_model
from megatrain_nb.model_configs import is_preset, preset_config, preset_names

#: the kinds of model source, in the order :func:`resolve` tells them apart
KINDS = ("folder", "file", "gguf", "preset", "hub", "config", "engine", "object")


@dataclass(frozen=True)
class ModelSource:
    """``kind`` (one of :data:`KINDS`); ``name`` (as the user wrote it, or the object's type);
    ``folder`` (a folder or file on this machine: a local one or the Hub snapshot); ``value`` (the
    object, engine or config handed in); ``revision`` (of a Hub id)."""

    kind: str
    name: str
    folder: Optional[str] = None
    value: Any = None
    revision: Optional[str] = None

    def need_folder(self, who: str = "this call") -> str:
        """The model folder (config.json + safetensors) to stream from; ValueError /
        FileNotFoundError naming the value and what to pass instead."""
        if self.kind == "preset":
            raise ValueError(f"model={self.name!r} is a preset: {who} takes a model folder, a Hub id or a model "
                             f"object; build the preset with AutoModelForCausalLM.from_config(mt.preset_config("
                             f"{self.name!r})), or use mt.Session({self.name!r})")
        if self.kind not in ("folder", "hub") or not os.path.isfile(os.path.join(self.folder, "config.json")):
            raise FileNotFoundError(
                f"{self.folder or self.name!r} is not a local model folder (no config.json): pass a Hugging Face "
                "model folder (config.json + *.safetensors; save one with save_pretrained()), a Hub id, a model "
                "object or a preset name")
        return self.folder

    def describe(self) -> str:
        """How a report names it: ``folder /x``, ``org/name (Hugging Face Hub; revision v2; /cache/...)``."""
        if self.kind == "hub":
            revision = f", revision {self.revision}" if self.revision else ""
            return f"{self.name} (Hugging Face Hub{revision}; {self.folder})"
        if self.kind in ("folder", "file"):
            return f"{self.kind} {self.folder}"
        return f"{self.kind} {self.name}"

    def config(self):
        """The transformers config (nothing is downloaded beyond what :func:`resolve` fetched)."""
        from transformers import AutoConfig   # transformers: imported only when a config is read

        if self.kind == "preset":
            return preset_config(self.name)
        if self.kind == "config":
            return self.value
        if self.kind == "file":
            return _config_file(self.folder)
        if self.kind in ("folder", "hub"):
            if not os.path.isfile(os.path.join(self.folder, "config.json")):
                raise ValueError(f"{self.folder!r} is a folder without config.json; give a model folder, a "
                                 f"config.json or a preset ({', '.join(preset_names())})")
            return AutoConfig.from_pretrained(self.folder)
        cfg = getattr(self.value, "model_config", None) or getattr(self.value, "config", None)
        if cfg is None:
            raise TypeError(f"{type(self.value).__name__} has no config: pass a preset name, a model folder, a "
                            "config.json, a transformers config, a model or a StreamingEngine")
        return cfg


def resolve(model: Any, *, revision: Optional[str] = None, token=None, base: Optional[os.PathLike] = None,
            hub: bool = True) -> ModelSource:
    """The :class:`ModelSource` of ``model``. A name is an existing path first (relative to
    ``base`` when given and found there), then a preset, then a Hub id (fetched: config,
    tokenizer and safetensors only; ``hub=False`` refuses Hub ids instead, for callers that must
    not download). ``revision`` applies to a Hub id only."""
    if isinstance(model, (str, os.PathLike)):
        return _by_name(os.fspath(model), revision, token, base, hub)
    if revision is not None:
        raise ValueError(f"revision={revision!r} applies to a model given by name (a Hub id); model is a "
                         f"{type(model).__name__}")
    from transformers import PretrainedConfig  # transformers is imported only when an object is handed in

    if isinstance(model, PretrainedConfig):
        return ModelSource("config", getattr(model, "name_or_path", "") or model.model_type, value=model)
    if is_engine(model):
        return ModelSource("engine", type(model).__name__, value=model)
    return ModelSource("object", type(model).__name__, value=model)


def is_engine(obj) -> bool:
    """A built engine (a StreamingEngine, or anything with its step methods)."""
    return hasattr(obj, "forward_backward") and hasattr(obj, "optimizer_step")


def _by_name(name: str, revision, token, base, hub: bool) -> ModelSource:
    path = Path(name).expanduser()
    if base is not None and not path.is_absolute() and (Path(base) / path).exists():
        path = (Path(base) / path).resolve()
    if path.exists():
        if is_gguf(path) and revision is None:   # a GGUF: converted to a folder on need (gguf_in.py)
            return gguf_source(name, str(path))
        if revision is not None:
            raise ValueError(f"revision={revision!r} was given with the local folder {str(path)!r}; a revision "
                             "only applies to a Hub id")
        return ModelSource("folder" if path.is_dir() else "file", name, folder=str(path))
    if is_preset(name):
        return ModelSource("preset", name)
    _refuse_near_preset(name)
    if not hub:
        raise ValueError(f"{name!r} is neither a preset ({', '.join(preset_names())}) nor an existing model folder "
                         "or config file")
    try:
        folder = resolve_model(name, revision=revision, token=token)
    except ModelNotFoundError as e:
        raise ModelNotFoundError(f"{e}; or a preset: {', '.join(preset_names())}") from e
    return ModelSource("hub", name, folder=folder, revision=revision)


def _refuse_near_preset(name: str) -> None:
    """A name one slip away from a preset ("tinyy", "Tiny", "llama7b") is refused here, before
    any Hub request: a typo gets "did you mean" and the presets, not a network error. Names with
    an organisation ("org/name") are Hub ids and go on."""
    if "/" in name or os.sep in name:
        return
    presets = preset_names()
    near = [p for p in presets if p.lower() == name.lower() or p.replace("-", "") == name.lower().replace("-", "")]
    near = near or difflib.get_close_matches(name.lower(), presets, n=1, cutoff=0.75)
    if near:
        raise ModelNotFoundError(f"model={name!r} is not a preset: did you mean {near[0]!r}? The presets: "
                                 f"{', '.join(presets)}; or pass a local model folder or a Hub id ('org/name')")


def _config_file(path: str):
    from transformers import AutoConfig   # transformers: imported only when a config is read

    with open(path) as f:
        d = json.load(f)
    model_type = d.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{path!r} has no model_type; is it a transformers config.json?")
    return AutoConfig.for_model(model_type, **d)

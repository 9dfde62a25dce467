"""What the worker processes of ``mt.Session(..., nproc_per_node=N)`` need, written once into a
private folder as plain files, so that nothing crosses the process boundary as a pickle:

- the model: a local folder or a Hub id (resolved here, once, into the HF cache) is passed as
  its path; a preset name as its name; a model object is written once with
  ``save_pretrained`` (safetensors) into ``<run>/model``;
- datasets: ``datasets.Dataset.save_to_disk`` (Arrow) into ``<run>/train`` / ``<run>/eval``; a
  list or a torch map-style dataset is first turned into a ``datasets.Dataset``;
- the tokenizer: ``save_pretrained`` into ``<run>/tokenizer``;
- ``TrainingArguments`` (or a ``trl.SFTConfig`` / ``trl.DPOConfig`` / ``trl.GRPOConfig``, then the
  workers build an ``mt.SFTTrainer`` / ``mt.DPOTrainer`` / ``mt.GRPOTrainer``):
  the fields that differ from their defaults, as JSON, and which class they are (a GRPOConfig's
  ``generation_batch_size`` is derived again in the workers, from the ranks: set
  ``steps_per_generation`` for another one); a GRPO run's ``reward_funcs``: import paths, or a
  reward model's local folder;
- engine options, ``seq_len``: JSON; ``loss_fn`` and callbacks: import paths
  (``"package.module:name"``), since a function defined in a notebook cell cannot be imported
  by another process.

``spec.json`` lists it all; :func:`build_from_spec` (in each worker) turns it back into an
``mt.Trainer``.

The folder (:func:`make_run_dir`): ``megatrain-launch-<pid>-<host>-<start>-<random>`` in the
temporary folder, mode 0700. ``close()`` removes it; so does the kernel's exit without
``close()`` (atexit) once no worker process names it; one left behind (a killed kernel, workers
still finishing) is reclaimed when the next multi-process Session starts, as offload folders
are (``engine/tiers/reclaim.py``).
"""
from __future__ import annotations

import atexit
import dataclasses
import enum
import importlib
import inspect
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional

from megatrain_nb.engine.tiers.reclaim import folder_prefix, reclaim
from megatrain_nb.model_configs import is_preset
from megatrain_nb.model_source import resolve
from megatrain_nb.torchrun import LAUNCH_LABEL
from megatrain_nb.trainer.args import default_values, training_arguments, validate_training_args
from megatrain_nb.trainer.data import as_example
from megatrain_nb.trainer.grpo_fields import validate_grpo_args
from megatrain_nb.trainer.snapshot import BranchStart

from .model_source import build_trainer, default_args

SPEC_FILE = "spec.json"
RUN_DIR_LABEL = LAUNCH_LABEL   # the wrapper's torchelastic log folders share it (reclaimed alike)
_made: set = set()          # this process's launch folders (removed at exit if still there)
_made_lock = threading.Lock()


def folder_in_use(path) -> bool:
    """Whether a running process names ``path`` on its command line (torchrun's agent and the
    workers get the launch folder as their argument)."""
    import psutil

    path = str(path)
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if path in (proc.info.get("cmdline") or []):
                return True
        except (psutil.Error, OSError):
            continue
    return False


def make_run_dir(root=None) -> Path:
    """A private launch folder under ``root`` (default: the temporary folder), after reclaiming
    the ones processes that no longer run left there."""
    root = str(root or tempfile.gettempdir())
    reclaim(root, label=RUN_DIR_LABEL, in_use=folder_in_use, what="launch folder")
    path = Path(tempfile.mkdtemp(prefix=folder_prefix(RUN_DIR_LABEL), dir=root))   # 0700
    with _made_lock:
        _made.add(str(path))
    return path


@atexit.register
def _remove_run_dirs() -> None:
    """The kernel exits without ``close()``: its launch folders go, unless a worker still uses
    one (then the next start reclaims it)."""
    with _made_lock:
        paths = [p for p in _made if os.path.isdir(p)]
        _made.clear()
    for p in paths:
        try:
            if not folder_in_use(p):
                shutil.rmtree(p, ignore_errors=True)
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


class LaunchError(ValueError):
    """Something given to a multi-process Session cannot reach its worker processes."""


def write_spec(run_dir: Path, *, model: Any, train_dataset: Any, args: Any, tokenizer: Any, eval_dataset: Any,
               seq_len: Optional[int], loss_fn: Any, callbacks: Any, engine_options: dict,
               resume: Any = None, branch: Optional[dict] = None) -> dict:
    """Write everything into ``run_dir`` (which exists, private); returns the spec.
    ``branch`` (with ``resume``: a snapshot or checkpoint): the fields of a
    ``trainer.snapshot.BranchStart``; every rank then starts from the snapshot as that branch (a
    fork of a multi-process run: the same step on every rank)."""
    if args is None:   # spell out the defaults, so that the controller knows the output folder too
        if isinstance(model, str) and is_preset(model) and not Path(model).exists():
            on_corpus = train_dataset is None or eval_dataset is not None   # as model_source._builtin
            args = default_args(os.path.join("megatrain_outputs", model), eval_strategy="steps" if on_corpus else "no")
        else:
            args = {"output_dir": "megatrain_outputs"}
    rewards = None
    if _trl_config(args) == "GRPOConfig" or "reward_funcs" in engine_options:   # (GRPO: rollouts split over ranks)
        engine_options = dict(engine_options)
        rewards = _reward_refs(args, engine_options.pop("reward_funcs", None))
    fields = _args_fields(args)
    if rewards is not None:
        fields = _grpo_fields(fields, args)
    args_class = _check_args(fields, trl_class=_trl_config(args))   # refused here, before any worker starts
    spec: dict = {"format": 1, "model": _model_ref(run_dir, model, engine_options), "seq_len": seq_len,
                  "args": fields, "args_class": args_class, "engine_options": _json_only(engine_options, "engine option"),
                  "loss_fn": import_ref(loss_fn, "loss_fn") if loss_fn is not None else None,
                  "callbacks": [import_ref(c, "callback") for c in (callbacks or [])],
                  "resume": str(resume) if resume not in (None, False) else None,
                  "branch": _branch(branch, resume),
                  "train": _dataset(run_dir / "train", train_dataset, "train_dataset"),
                  "eval": _dataset(run_dir / "eval", eval_dataset, "eval_dataset"),
                  "tokenizer": None, "reward_funcs": rewards}
    if tokenizer is not None:
        if not hasattr(tokenizer, "save_pretrained"):
            raise LaunchError(f"tokenizer of type {type(tokenizer).__name__} has no save_pretrained(); the worker "
                              "processes load it from a folder: pass a transformers tokenizer")
        tokenizer.save_pretrained(str(run_dir / "tokenizer"))
        spec["tokenizer"] = str(run_dir / "tokenizer")
    with open(run_dir / SPEC_FILE, "w", encoding="utf-8") as f:
        json.dump(spec, f, indent=1)
    return spec


def _branch(branch: Optional[dict], resume: Any) -> Optional[dict]:
    if branch is None:
        return None
    if resume in (None, False, True):
        raise LaunchError("a branch starts from a snapshot: give resume=<the snapshot's or checkpoint's folder>")
    fields = {f.name for f in dataclasses.fields(BranchStart)} - {"extra"}
    unknown = sorted(set(branch) - fields)
    if unknown:
        raise LaunchError(f"branch fields {unknown} are not BranchStart fields ({', '.join(sorted(fields))})")
    return _json_only(dict(branch), "branch field")


def branch_start(spec: dict):
    """The ``BranchStart`` a worker gives its trainer before ``train()`` (None: not a branch)."""
    if not spec.get("branch"):
        return None
    return BranchStart(**spec["branch"])


def _model_ref(run_dir: Path, model: Any, options: dict) -> dict:
    if isinstance(model, (str, os.PathLike)):
        # resolved once here, so that N workers do not each go to the Hub
        source = resolve(model, revision=options.pop("revision", None), token=options.pop("token", None))
        if source.kind == "preset":
            return {"preset": source.name}
        try:
            return {"folder": str(Path(source.need_folder("a launched run")).resolve())}
        except FileNotFoundError as e:   # a path without config.json
            raise LaunchError(str(e)) from None
    import torch

    if not isinstance(model, torch.nn.Module) or not hasattr(model, "save_pretrained"):
        raise LaunchError(f"model of type {type(model).__name__} cannot reach the worker processes: pass a "
                          "transformers *ForCausalLM, a local model folder, a Hub id or a preset name")
    if any(p.is_meta for p in model.parameters()):
        raise LaunchError("the model is on the meta device (its weights exist nowhere yet), so the worker "
                          "processes cannot load it: save a real model with save_pretrained and pass the folder")
    model.save_pretrained(str(run_dir / "model"), safe_serialization=True)
    return {"folder": str(run_dir / "model"), "written": True}


def _dataset(path: Path, ds: Any, what: str) -> Optional[str]:
    if ds is None:
        return None
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        raise LaunchError(f"{what} is a DatasetDict with splits {list(ds)}; pass one split, e.g. ds['train']")
    if isinstance(ds, datasets.IterableDataset) or not hasattr(ds, "__len__") or not hasattr(ds, "__getitem__"):
        raise LaunchError(f"{what} of type {type(ds).__name__} is iterable-only: the worker processes need it "
                          "written to disk first; pass a datasets.Dataset (e.g. Dataset.from_generator(...))")
    if not isinstance(ds, datasets.Dataset):
        rows = [{k: v.tolist() if hasattr(v, "tolist") else v for k, v in as_example(ds[i]).items()}
                for i in range(len(ds))]
        ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(path))
    return str(path)


TRL_CONFIGS = ("SFTConfig", "DPOConfig", "GRPOConfig")


def _reward_refs(args: Any, funcs: Any) -> list:
    """A GRPO run's reward functions as the workers load them: ``{"ref": "module:name"}`` or a
    reward model's ``{"folder": path}``."""
    if _trl_config(args) != "GRPOConfig":
        raise LaunchError("reward_funcs= trains with mt.GRPOTrainer: give the Session args=trl.GRPOConfig(...)")
    if funcs is None:
        raise LaunchError("a GRPOConfig trains from rewards: pass reward_funcs= (importable functions, or reward "
                          "models' local folders; megatrain_nb.rewards has some)")
    out = []
    for f in funcs if isinstance(funcs, (list, tuple)) else [funcs]:
        if isinstance(f, (str, os.PathLike)) and os.path.isdir(f):
            out.append({"folder": str(Path(f).resolve())})
        elif hasattr(f, "save_pretrained"):
            raise LaunchError(f"the reward model {type(f).__name__} reaches the worker processes as a local folder: "
                              "save_pretrained it (with its tokenizer) and pass the folder in reward_funcs")
        else:
            out.append({"ref": import_ref(f, "reward function")})
    return out


def _grpo_fields(fields: dict, args: Any) -> dict:
    """A GRPOConfig's fields for the workers: ``generation_batch_size`` left out (GRPOConfig derives
    it from the ranks it sees: per device x ``steps_per_generation`` x ranks), and
    ``steps_per_generation`` when it is the accumulation (its default, derived the same way)."""
    out = {k: v for k, v in fields.items() if k != "generation_batch_size"}
    if args.steps_per_generation == args.gradient_accumulation_steps:
        out.pop("steps_per_generation", None)
    return out


def _trl_config(args: Any) -> Optional[str]:
    """``"SFTConfig"`` / ``"DPOConfig"`` for TRL's configs (told by type, without importing trl), else None."""
    return next((c.__name__ for c in type(args).__mro__
                 if c.__name__ in TRL_CONFIGS and c.__module__.startswith("trl")), None)


def _check_args(fields: dict, *, trl_class: Optional[str] = None) -> str:
    """Check the arguments the workers will build (so that they are refused before any starts);
    returns the class they build: ``"TrainingArguments"``, ``"SFTConfig"`` (an SFTTrainer) or
    ``"DPOConfig"`` (a DPOTrainer)."""
    if trl_class == "GRPOConfig":
        config = _trl_args(fields, trl_class)
        validate_training_args(config, where="args")
        validate_grpo_args(config)
        return trl_class
    if trl_class == "DPOConfig":
        # light: the DPO and SFT trainers' modules (transformers) away from a kernel that launches plain ranks
        from megatrain_nb.trainer.dpo import validate_dpo_args

        config = _trl_args(fields, trl_class)
        validate_training_args(config, where="args")
        validate_dpo_args(config)
        return trl_class
    if trl_class is None:
        training_arguments(fields, where="args")
        return "TrainingArguments"
    from megatrain_nb.trainer.sft import validate_sft_args   # light: as validate_dpo_args above

    config = _trl_args(fields, "SFTConfig")
    validate_training_args(config, where="args")
    validate_sft_args(config)
    return "SFTConfig"


def _trl_args(fields: dict, trl_class: str):
    import trl

    return getattr(trl, trl_class)(**fields)


def _sft_defaults(args) -> dict:
    """An SFTConfig's (or DPOConfig's) default values (their own differ from TrainingArguments':
    learning_rate, bf16...). Built with ``args``' precision and device fields, since a default one
    (bf16) cannot be built on a machine without bf16; those fields are then never "defaults"."""
    own = {k: getattr(args, k) for k in _SFT_ALWAYS}
    ref = _trl_args({"output_dir": os.path.join(os.getcwd(), "megatrain_outputs"), **own}, _trl_config(args))
    return {f.name: (object() if f.name in _SFT_ALWAYS else getattr(ref, f.name)) for f in dataclasses.fields(ref)}


_SFT_ALWAYS = ("bf16", "fp16", "use_cpu")


def _args_fields(args: Any) -> dict:
    """The TrainingArguments (or SFTConfig) fields that differ from their defaults (JSON values)."""
    if args is None:
        return {}
    if isinstance(args, dict):
        fields = dict(args)
    else:
        defaults = _sft_defaults(args) if _trl_config(args) else default_values()
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
                  if f.init and not f.name.startswith("_") and getattr(args, f.name) != defaults.get(f.name)}
        fields["output_dir"] = args.output_dir
    fields = {k: v.value if isinstance(v, enum.Enum) else v for k, v in fields.items()}
    if fields.get("output_dir"):
        fields["output_dir"] = str(Path(fields["output_dir"]).expanduser().resolve())
    return _json_only(fields, "TrainingArguments field")


def _json_only(values: dict, what: str) -> dict:
    out = {}
    for k, v in values.items():
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError):
            raise LaunchError(f"{what} {k}={v!r} cannot be written as JSON for the worker processes; pass plain "
                              "values (strings, numbers, lists)") from None
        out[k] = v
    return out


def import_ref(obj: Any, what: str) -> str:
    """``"module:qualname"`` of an importable function or class (or such a string, checked)."""
    if isinstance(obj, str):
        load_ref(obj, what)   # fail here, not in N workers
        return obj
    # a function or class by its name; an instance by its class (each worker makes its own)
    target = obj if isinstance(obj, type) or inspect.isfunction(obj) or inspect.isbuiltin(obj) else type(obj)
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if module and module != "__main__" and "<" not in name:
        ref = f"{module}:{name}"
        try:
            if load_ref(ref, what) is target:
                return ref
        except LaunchError:
            pass
    raise LaunchError(f"{what} {obj!r} must reach the worker processes by import: define it in a module "
                      "(not a notebook cell) and pass it, or its path as 'package.module:name'")


def load_ref(ref: str, what: str) -> Any:
    module, _, name = ref.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise LaunchError(f"{what} {ref!r} cannot be imported ({type(e).__name__}: {e}); give "
                          "'package.module:name' of something on the worker processes' path") from None
    return obj


def build_from_spec(run_dir: Path):
    """(trainer, tokenizer) in a worker process, from ``run_dir/spec.json``."""
    import datasets

    spec = json.loads((run_dir / SPEC_FILE).read_text(encoding="utf-8"))
    model = spec["model"].get("folder") or spec["model"]["preset"]
    tokenizer = None
    if spec["tokenizer"]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    options = dict(spec["engine_options"])
    if spec["loss_fn"]:
        options["loss_fn"] = load_ref(spec["loss_fn"], "loss_fn")
    if spec["callbacks"]:
        options["callbacks"] = [load_ref(c, "callback") for c in spec["callbacks"]]
    if spec.get("reward_funcs"):   # a GRPO run's (write_spec's _reward_refs)
        options["reward_funcs"] = [r["folder"] if "folder" in r else load_ref(r["ref"], "reward function")
                                   for r in spec["reward_funcs"]]
    args = None
    if spec.get("args_class") in TRL_CONFIGS:   # the workers build an SFT/DPOTrainer (model_source.build_trainer)
        args = _trl_args(spec["args"], spec["args_class"])
    elif spec["args"]:
        from transformers import TrainingArguments

        args = TrainingArguments(**spec["args"])
    load = datasets.load_from_disk
    return build_trainer(model, train_dataset=load(spec["train"]) if spec["train"] else None, args=args,
                         tokenizer=tokenizer, eval_dataset=load(spec["eval"]) if spec["eval"] else None,
                         seq_len=spec["seq_len"], trainer_options=options), spec

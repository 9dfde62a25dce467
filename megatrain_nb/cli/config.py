"""``megatrain-nb train``'s input: run.yaml read and checked, its files and model located.
Bad input raises :class:`UsageError` (one line, exit status 2; see megatrain_nb/cli/__init__.py)."""
from __future__ import annotations

import os
from pathlib import Path

from megatrain_nb import assets
from megatrain_nb.model_configs import check_preset, preset_config
from megatrain_nb.model_source import resolve
from megatrain_nb.values import ValueRefused, check, check_fields

EXAMPLE_CONFIG = "examples/run.yaml"


class UsageError(ValueError):
    """Bad input on the command line or in run.yaml: one line, exit status 2."""


_SECTIONS = {"model", "revision", "preset", "tokenizer", "data", "training", "engine", "seed", "sft", "dpo", "grpo"}
_DATA_KEYS = {"train", "eval", "seq_len", "text_column", "format"}
_DATA_KINDS = {".jsonl": "json", ".json": "json", ".txt": "text", ".csv": "csv", ".parquet": "parquet"}


def load_files(spec, *, base: Path, what: str):
    """A datasets.Dataset from local files, a saved dataset folder, or 'builtin' (None)."""
    import datasets

    if spec is None or spec == "builtin":
        return None
    if not isinstance(spec, (str, list)) or not all(isinstance(f, str) for f in ([spec] if isinstance(spec, str) else spec)):
        raise UsageError(f"data.{what}: expected a file name, a list of them or 'builtin', got {spec!r}")
    files = [spec] if isinstance(spec, str) else list(spec)
    files = [str((base / f).resolve()) if not os.path.isabs(f) else f for f in files]
    if len(files) == 1 and os.path.isdir(files[0]):
        return datasets.load_from_disk(files[0])
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise UsageError(f"data.{what}: file(s) not found: {', '.join(missing)}")
    kinds = {_DATA_KINDS.get(Path(f).suffix.lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise UsageError(f"data.{what}: {files}: use files of one kind, .jsonl/.json/.txt/.csv/.parquet")
    kind = kinds.pop()
    from datasets.utils import logging as ds_logging

    level, bars = ds_logging.get_verbosity(), datasets.is_progress_bar_enabled()
    ds_logging.set_verbosity(ds_logging.CRITICAL)   # a file that cannot be read is said once, in our line
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(kind, data_files=files, split="train")
    except Exception as e:  # noqa: BLE001 - datasets wraps the parser's error (DatasetGenerationError)
        raise UsageError(f"data.{what}: {_unreadable(files, kind, e)}") from None
    finally:
        ds_logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def _unreadable(files: list, kind: str, error: Exception) -> str:
    """Which file (and, for JSON lines, which line) could not be read, in one line."""
    import json

    if kind == "json":
        for f in files:
            if not f.lower().endswith(".jsonl"):
                continue
            with open(f, encoding="utf-8", errors="replace") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except ValueError as e:
                        return f"{f} line {n} is not JSON ({e}); each line must be one JSON object"
                    if not isinstance(row, dict):
                        return f"{f} line {n} is a {type(row).__name__}, not a JSON object like {{\"text\": ...}}"
    cause = error.__cause__ or error.__context__ or error
    text = " ".join(str(cause).split())[:300]
    return f"{', '.join(files)} cannot be read as {kind} ({type(cause).__name__}: {text})"


def load_run_config(path) -> dict:
    """run.yaml as a dict, its shape checked (see examples/run.yaml); bad input -> UsageError."""
    import yaml

    p = Path(path)
    if p.is_dir():
        inside = sorted(q.name for q in p.glob("*.y*ml") if q.is_file())
        hint = f" (it holds {', '.join(inside)})" if inside else ""
        raise UsageError(f"--config {path}: is a directory, not a config file; give the run.yaml itself{hint} "
                         f"(see {EXAMPLE_CONFIG} for an example)")
    if not p.is_file():
        raise UsageError(f"--config {path}: no such file (see {EXAMPLE_CONFIG} for an example)")
    try:
        cfg = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise UsageError(f"--config {path}: not valid YAML: {' '.join(str(e).split())}") from e
    if not isinstance(cfg, dict):
        raise UsageError(f"--config {path}: expected a mapping at the top level (see {EXAMPLE_CONFIG})")
    unknown = set(cfg) - _SECTIONS
    if unknown:
        raise UsageError(f"--config {path}: unknown section(s) {sorted(unknown)}; use model (+ revision) or "
                         "preset, tokenizer, data, training, engine, seed, sft, dpo, grpo")
    if ("model" in cfg) == ("preset" in cfg):
        raise UsageError(f"--config {path}: give exactly one of 'model' (a local folder or a Hugging Face Hub "
                         "id) or 'preset'")
    for key in ("data", "training", "engine", "sft", "dpo", "grpo"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise UsageError(f"--config {path}: '{key}' must be a mapping, got {cfg[key]!r}")
    bad = set(cfg.get("data") or {}) - _DATA_KEYS
    if bad:
        raise UsageError(f"--config {path}: unknown data field(s) {sorted(bad)}; use {', '.join(sorted(_DATA_KEYS))}")
    for key in ("model", "preset", "tokenizer", "revision"):
        if key in cfg and not isinstance(cfg[key], str):
            raise UsageError(f"--config {path}: '{key}' must be a string, got {cfg[key]!r}")
    check_values(cfg, path)
    return cfg


def check_values(cfg: dict, path) -> None:
    """Every value of run.yaml the table of values holds (:mod:`megatrain_nb.values`), checked as
    it enters, before any model or data is read; the checked numbers replace the text."""
    try:
        for key in ("training", "sft", "dpo", "grpo", "engine"):
            if cfg.get(key):
                cfg[key].update(check_fields(cfg[key], key, family=key))
        data = cfg.get("data") or {}
        if "seq_len" in data:
            data["seq_len"] = check("seq_len", data["seq_len"], "data.seq_len")
        if "seed" in cfg:
            cfg["seed"] = check("seed", cfg["seed"], "seed")
    except ValueRefused as e:
        raise UsageError(f"--config {path}: {e}") from None


def model_source(cfg: dict, base: Path) -> tuple[str, str]:
    """(folder, how to name it) for run.yaml's ``model``: a folder relative to the config file,
    else a Hub id fetched through huggingface_hub (config, tokenizer and safetensors only)."""
    source = resolve(os.path.expanduser(cfg["model"]), revision=cfg.get("revision"), base=base)
    if source.kind == "preset":
        raise UsageError(f"model: {cfg['model']!r} is a preset; write preset: {cfg['model']} instead")
    return source.need_folder("model:"), source.describe()


def check_preset_field(cfg: dict) -> None:
    """run.yaml's ``preset:``, if any, names a preset (UsageError listing them otherwise)."""
    if "preset" in cfg:
        try:
            check_preset(cfg["preset"])
        except ValueError as e:
            raise UsageError(str(e)) from None


def trl_config(cls, fields: dict, cfg: dict, section: str):
    """A fine-tuning run.yaml's TRL config (``cls``: SFTConfig, DPOConfig) from ``fields``, its
    ``preset:`` checked first; an unknown field is one line naming the section."""
    check_preset_field(cfg)
    try:
        return cls(**fields)
    except TypeError as e:
        raise UsageError(f"training/{section}: {e} (fields of trl.{cls.__name__})") from None


def fine_tuner(cls, cfg: dict, base: Path, fields: dict, args, train_ds, eval_ds) -> tuple:
    """``(trainer, model_text)``: the fine-tuner ``cls`` (mt.SFTTrainer, mt.DPOTrainer) of a run.yaml,
    built from :func:`fine_tune_parts`, its output folder made."""
    model, model_text, tokenizer, engine_options = fine_tune_parts(cfg, base, fields, args.max_length)
    os.makedirs(args.output_dir, exist_ok=True)
    return cls(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tokenizer,
               **engine_options), model_text


def fine_tune_parts(cfg: dict, base: Path, fields: dict, max_length) -> tuple:
    """``(model, model_text, tokenizer, engine options)`` of a fine-tuning run.yaml (SFT or DPO):
    ``model:`` a folder or Hub id (its own tokenizer unless ``tokenizer:`` names one), else the
    preset built from its config with the shipped chat tokenizer, seeded first (as the Session
    does); the engine's ``offload_dir`` relative to the file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, model_text = (None, f"preset {cfg.get('preset')}")
    if "model" in cfg:
        model, model_text = model_source(cfg, base)
    tokenizer = None
    if cfg.get("tokenizer"):
        local = (base / cfg["tokenizer"]).resolve()
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else cfg["tokenizer"])
    elif model is None:
        tokenizer = assets.chat_tokenizer()
    if model is None:
        torch.manual_seed(int(cfg.get("seed", fields.get("seed", 42))))
        model = AutoModelForCausalLM.from_config(preset_config(
            cfg["preset"], vocab_size=len(tokenizer), max_position_embeddings=max(max_length or 0, 128)))
    engine_options = dict(cfg.get("engine") or {})
    if engine_options.get("offload_dir") and not os.path.isabs(os.path.expanduser(str(engine_options["offload_dir"]))):
        engine_options["offload_dir"] = str((base / engine_options["offload_dir"]).resolve())
    return model, model_text, tokenizer, engine_options


def training_fields(ns, cfg: dict, base: Path) -> dict:
    training = dict(cfg.get("training") or {})
    if ns.output_dir:
        training["output_dir"] = ns.output_dir
    if ns.max_steps:
        training["max_steps"] = ns.max_steps
    training.setdefault("output_dir", "megatrain_outputs")
    training.setdefault("disable_tqdm", True)
    training.setdefault("report_to", "none")
    if not os.path.isabs(training["output_dir"]):
        training["output_dir"] = str((base / training["output_dir"]).resolve())
    return training


def check_max_steps(v, where: str, error=None) -> int:
    """max_steps by the table's rule (>= 1, or -1: transformers' "no step limit"; 0 and other
    negatives would silently fall back to epochs in transformers): refused with ``error``."""
    try:
        return check("max_steps", v, where or "max_steps")
    except ValueRefused as e:
        raise (error or UsageError)(str(e)) from None

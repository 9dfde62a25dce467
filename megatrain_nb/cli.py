"""``megatrain-nb``: the command line.

    megatrain-nb demo                      # the main job on the built-in default, no network needed
    megatrain-nb train --config run.yaml   # a training run from a config file
    megatrain-nb estimate llama-100b --vram 80 --ram 1024 --disk 4096

``run.yaml``: see ``examples/run.yaml`` (every field, commented) and the README's "run.yaml"
section. Sections: ``model`` (a local folder or a Hugging Face Hub id; ``revision`` optional) or
``preset``; ``tokenizer``; ``data`` (``train``, ``eval``, ``seq_len``, ``text_column``);
``training`` (``transformers.TrainingArguments`` fields); ``engine`` (``EngineConfig`` fields);
``seed``.

Metrics go to ``<output_dir>/metrics.jsonl``. Errors in the input print one line
``megatrain-nb <command>: error: ...`` and exit with status 2 (set ``MEGATRAIN_NB_DEBUG=1`` for
the traceback).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

from megatrain_nb.formatting import fmt_bytes


# ---------------------------------------------------------------------------------------- running
EXAMPLE_CONFIG = "examples/run.yaml"


class UsageError(ValueError):
    """Bad input on the command line or in run.yaml: one line, exit status 2."""


def _tier_text(memory: Optional[dict]) -> str:
    if not memory:
        return ""
    return " ".join(f"{t} {fmt_bytes(memory.get(t, {}).get('used_bytes'), none='-', compact=True)}"
                    for t in ("device", "host", "disk"))


def run_with_progress(trainer, *, resume=None, out=None) -> dict:
    """Drive ``trainer.iter_steps`` with a progress bar (loss, tokens/s, tier usage); returns a summary."""
    from tqdm.auto import tqdm

    out = out or sys.stdout
    total = trainer.total_steps
    bar = tqdm(total=total, file=out, dynamic_ncols=True, desc="train", mininterval=0.5)
    t0, first, last, memory, tokens, evals = time.time(), None, None, None, 0, []
    try:
        for rec in trainer.iter_steps(resume_from_checkpoint=resume):
            first = rec["loss"] if first is None else first
            last = rec
            tokens += rec["tokens"]
            memory = rec.get("memory", memory)
            if "eval_loss" in rec:
                evals.append((rec["step"], rec["eval_loss"], rec["eval_ppl"]))
            bar.n = rec["step"]
            tiers = _tier_text(memory)  # empty until the first memory record
            bar.set_postfix_str(f"loss {rec['loss']:.3f} | {rec['tokens_per_s']:.0f} tok/s" + (f" | {tiers}" if tiers else ""),
                                refresh=False)
            bar.refresh()
    finally:
        bar.close()
    elapsed = time.time() - t0
    return {"steps": trainer.state.global_step, "seconds": elapsed, "tokens": tokens, "first_loss": first,
            "last_loss": last["loss"] if last else None, "evals": evals,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0}


def print_summary(trainer, summary: dict, *, model_dir: Optional[str], eval_metrics: Optional[dict], out=None):
    from megatrain_nb.trainer.checkpoint import list_checkpoints

    p = lambda *a: print(*a, file=out or sys.stdout)  # noqa: E731
    p("")
    p("== summary ==")
    p(f"steps {summary['steps']} in {summary['seconds']:.1f} s, {summary['tokens']:,} tokens "
      f"({summary['tokens_per_s']:.0f} tokens/s)")
    if summary["first_loss"] is not None:
        p(f"train loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}")
    if eval_metrics:
        p(f"eval loss {eval_metrics['eval_loss']:.3f}, perplexity {eval_metrics['eval_ppl']:.1f}"
          + (f", token accuracy {eval_metrics['eval_mean_token_accuracy']:.3f}"
             if "eval_mean_token_accuracy" in eval_metrics else ""))
    mem = trainer.engine.memory_report()
    for tier in ("device", "host", "disk"):
        d = mem.get(tier, {})
        kinds = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in d.items()
                          if isinstance(v, int) and not k.endswith("_bytes") and v)
        p(f"{tier:<6} peak {fmt_bytes(d.get('peak_bytes'))}" + (f" ({kinds})" if kinds else ""))
    tel = trainer.engine.telemetry() or {}
    cache = cache_text(mem.get("host", {}))
    if cache:
        p(cache)
    moved = {k: v for k, v in (tel.get("bytes") or {}).items() if v}
    if moved:
        p("bytes moved: " + ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(v)}" for k, v in moved.items()))
    line = streaming_text(tel)
    if line:
        p("streaming: " + line)
    p("outputs:")
    if model_dir:
        p(f"  model (transformers.AutoModelForCausalLM.from_pretrained): {model_dir}")
    ckpts = list_checkpoints(trainer.args.output_dir, run_id=getattr(trainer, "run_id", None))
    if ckpts:  # this run's only: an earlier run in the same folder is not this run's resume point
        p(f"  checkpoints (resume with resume_from_checkpoint=...): {', '.join(str(c) for c in ckpts)}")
    p(f"  metrics log (JSONL): {trainer.metrics_log.path}")


def cache_text(host: dict) -> str:
    """What the disk tier's host cache holds and how much of the tier reached the disk, said
    plainly (a cache large enough keeps the whole tier in RAM: the disk then holds nothing)."""
    st = host.get("disk_cache_stats") or {}
    if not st:
        return ""
    if not st.get("capacity_bytes"):
        return "no host cache of the disk tier: every access went to the disk"
    kinds = ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(v)}" for k, v in (st.get("by_kind") or {}).items() if v)
    held = (f"host cache of the disk tier: {fmt_bytes(st.get('ram_bytes', 0))} in RAM"
            + (f" ({kinds})" if kinds else "") + f" of its {fmt_bytes(st['capacity_bytes'])}")
    wrote, read = st.get("disk_write_bytes", 0), st.get("disk_read_bytes", 0)
    if not wrote and not read:
        return held + "; nothing reached the disk: the cache held the whole tier"
    return held + f"; reached the disk: {fmt_bytes(wrote)} written, {fmt_bytes(read)} read back"


def disk_text(engine) -> str:
    """Where the disk tier is (filesystem, free space) and how much RAM caches it; "" without one."""
    from megatrain_nb.engine.diskspace import filesystem_text

    fs = (engine.memory_report().get("disk") or {}).get("filesystem")
    if not fs:
        return ""
    cache = (engine.telemetry() or {}).get("disk_cache") or {}
    text = f"{fs['path']} {filesystem_text(fs)}"
    if cache.get("capacity_bytes"):
        text += f"; host cache of the disk tier up to {fmt_bytes(cache['capacity_bytes'])} of RAM"
        units = engine.state_units
        tier = sum(engine.states.stored_nbytes(u) for u in units) + (
            4 * sum(u.numel for u in units) if engine.params_on_disk else 0)
        if cache["capacity_bytes"] >= tier:
            text += f", room for the whole tier ({fmt_bytes(tier)}): the disk may hold nothing"
    elif cache:
        text += "; no host cache (every access goes to the disk)"
    return text


# What each stall counter measures: time the training thread waited, whether or not the
# transfer had been started ahead ("issued ahead" is about scheduling, not about arriving in time).
_WAITS = {"device": "for weights to reach the device", "disk": "for disk reads",
          "host_cache": "for copies out of the disk tier's host cache", "decode": "for optimizer states to decode",
          "optimizer": "for optimizer updates", "grad_return": "for gradients to return to the host"}


def streaming_text(tel: dict) -> str:
    """One line on how well streaming hid transfers: how many unit loads were issued ahead of
    need, then how long the step still waited, per cause."""
    pf = (tel.get("prefetch") or {}).get("device") or {}
    parts = []
    loads = (pf.get("ahead") or 0) + (pf.get("late") or 0)
    if loads:
        parts.append(f"{pf.get('ahead', 0) / loads:.0%} of {loads:,} weight loads issued ahead of need")
    waits = [f"{_WAITS.get(k, k)} {v:.2f} s" for k, v in (tel.get("stall_seconds") or {}).items() if v >= 0.005]
    if tel.get("stall_seconds") is not None:
        parts.append("time spent waiting: " + ", ".join(waits) if waits else "no time spent waiting")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------- demo
#: The demo's host cache holds this share of its disk tier (the rest is read and written each step).
DEMO_CACHE_SHARE = 0.5


def demo_cache_gb(model, compression: str) -> float:
    """GiB of host cache for the demo: DEMO_CACHE_SHARE of its disk tier (the optimizer states
    in their stored form), so that both RAM and the disk carry the states. By default the cache
    takes what RAM allows, which at the demo's size is the whole tier: the disk would stay empty."""
    from megatrain_nb.engine.planner import codec_bytes_per_param

    states = sum(p.numel() for p in model.parameters()) * codec_bytes_per_param(compression)
    return DEMO_CACHE_SHARE * states / (1 << 30)


def cmd_demo(ns) -> int:
    import torch
    from transformers import AutoModelForCausalLM, TrainingArguments

    from megatrain_nb.trainer import Trainer
    from megatrain_nb.trainer.default import cache_dir, load_default
    from megatrain_nb.trainer.presets import preset_config

    if ns.quick:
        ns.steps = ns.steps or 20
        ns.seq_len = ns.seq_len or 64
    steps, seq_len = ns.steps or 250, ns.seq_len or 128
    out_dir = Path(ns.output_dir).resolve()
    offload = None if ns.no_disk else str(out_dir / "offload")
    if offload:
        os.makedirs(offload, exist_ok=True)
    print(f"megatrain-nb demo: preset {ns.preset!r}, {steps} steps of {ns.batch_size} x {seq_len} tokens; "
          f"disk tier {'off' if offload is None else 'at ' + offload}; optimizer states {ns.compression}")
    t0 = time.time()
    tokenizer, train_ds, eval_ds = load_default(seq_len=seq_len, vocab_size=ns.vocab_size,
                                                max_eval_blocks=16 if ns.quick else 64)
    print(f"data: the Python standard library's own source as a corpus, {len(train_ds):,} training blocks, "
          f"{len(eval_ds)} eval blocks; byte-level BPE tokenizer ({len(tokenizer)} tokens) cached in {cache_dir()} "
          f"[{time.time() - t0:.1f} s]")
    torch.manual_seed(ns.seed)
    model = AutoModelForCausalLM.from_config(preset_config(ns.preset, vocab_size=len(tokenizer),
                                                           max_position_embeddings=max(seq_len, 128)))
    print(f"model: Llama-style {ns.preset}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          "fp32 master weights")
    save_every = max(steps // 2, 1)
    args = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=ns.batch_size,
                             per_device_eval_batch_size=ns.batch_size, learning_rate=ns.lr, max_steps=steps,
                             lr_scheduler_type="cosine", warmup_steps=max(steps // 10, 1), weight_decay=0.1,
                             logging_steps=max(min(10, steps // 5), 1), eval_strategy="steps", eval_steps=save_every,
                             save_steps=save_every, save_total_limit=2, report_to="none", disable_tqdm=True,
                             seed=ns.seed)
    engine_opts = {"optimizer_compression": ns.compression, "offload_dir": offload}
    if offload:   # the main job shows both tiers at work: RAM caches part of the disk tier, not all of it
        engine_opts["host_cache_gb"] = (ns.host_cache if ns.host_cache is not None
                                        else demo_cache_gb(model, ns.compression))
    if ns.device:
        engine_opts["device"] = ns.device
    trainer = Trainer(model=model, train_dataset=train_ds, eval_dataset=eval_ds, args=args, tokenizer=tokenizer,
                      **engine_opts)
    try:
        disk = disk_text(trainer.engine)
        if disk:
            print(f"disk tier: {disk}")
        summary = run_with_progress(trainer)
        metrics = trainer.evaluate()
        model_dir = trainer.save_model(str(out_dir / "model"))
        if not ns.quick:
            from megatrain_nb.notebook.sampling import sample_text

            n_params = sum(p.numel() for _, p in trainer.engine.named_parameters())
            print(f"sample from this {n_params / 1e6:.1f}M-parameter model after {summary['steps']} steps "
                  f"({summary['seconds'] / 60:.1f} min of training); a model this small and this briefly trained "
                  "writes Python-flavoured noise, as expected: "
                  + repr(sample_text(trainer.engine, tokenizer, "def ", max_new_tokens=32, temperature=0.8,
                                     top_k=20, seed=ns.seed)))
        print_summary(trainer, summary, model_dir=model_dir, eval_metrics=metrics)
        print(f"total time {time.time() - t0:.1f} s")
    finally:
        trainer.close()
    return 0


# ---------------------------------------------------------------------------------------- train
_SECTIONS = {"model", "revision", "preset", "tokenizer", "data", "training", "engine", "seed", "sft"}
_DATA_KEYS = {"train", "eval", "seq_len", "text_column", "format"}
_DATA_KINDS = {".jsonl": "json", ".json": "json", ".txt": "text", ".csv": "csv", ".parquet": "parquet"}


def _load_files(spec, *, base: Path, what: str):
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
    return datasets.load_dataset(kinds.pop(), data_files=files, split="train")


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
                         "preset, tokenizer, data, training, engine, seed")
    if ("model" in cfg) == ("preset" in cfg):
        raise UsageError(f"--config {path}: give exactly one of 'model' (a local folder or a Hugging Face Hub "
                         "id) or 'preset'")
    for key in ("data", "training", "engine", "sft"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise UsageError(f"--config {path}: '{key}' must be a mapping, got {cfg[key]!r}")
    bad = set(cfg.get("data") or {}) - _DATA_KEYS
    if bad:
        raise UsageError(f"--config {path}: unknown data field(s) {sorted(bad)}; use {', '.join(sorted(_DATA_KEYS))}")
    for key in ("model", "preset", "tokenizer", "revision"):
        if key in cfg and not isinstance(cfg[key], str):
            raise UsageError(f"--config {path}: '{key}' must be a string, got {cfg[key]!r}")
    return cfg


def _model_source(cfg: dict, base: Path) -> tuple[str, str]:
    """(folder, how to name it) for run.yaml's ``model``: a folder relative to the config file,
    else a Hub id fetched through huggingface_hub (config, tokenizer and safetensors only)."""
    from megatrain_nb.hub import resolve_model

    local = (base / os.path.expanduser(cfg["model"])).resolve()
    name = str(local) if local.exists() else cfg["model"]
    folder = resolve_model(name, revision=cfg.get("revision"))
    if folder == name:
        return folder, f"folder {folder}"
    return folder, f"{cfg['model']} (Hugging Face Hub{', revision ' + cfg['revision'] if cfg.get('revision') else ''}; {folder})"


def _device_text(engine) -> str:
    import torch

    dev = engine.device
    if dev.type == "cuda":
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return f"{dev} ({torch.get_num_threads()} threads)" if dev.type == "cpu" else str(dev)


def print_header(trainer, *, model: str, data: str, out=None) -> None:
    """What a run is about to do, before its first step: model, data, device, tiers, codec."""
    from megatrain_nb.engine.planner import codec_bytes_per_param

    p = lambda *a: print(*a, file=out or sys.stdout)  # noqa: E731
    engine, cfg = trainer.engine, trainer.engine.config
    placement = dict(getattr(getattr(engine, "plan", None), "placement", {}) or {})
    where = {"disk": f"disk ({cfg.offload_dir})", "host": "host RAM"}.get  # noqa: E731
    codec = cfg.optimizer_compression
    p(f"model:  {model}, {engine.num_parameters() / 1e6:,.2f}M parameters, fp32 master weights")
    p(f"data:   {data}")
    p(f"device: {_device_text(engine)}")
    if placement:
        p("tiers:  " + ", ".join(f"{k.replace('_', ' ')} in {where(v, v)}" for k, v in placement.items()))
    disk = disk_text(engine)
    if disk:
        p(f"disk:   {disk}")
    p(f"codec:  optimizer states {codec} ({codec_bytes_per_param(codec):.2f} bytes/parameter for both Adam "
      "moments" + (", lossy vs fp32 AdamW)" if codec != "none" else ", exact)"))
    p(f"output: {trainer.args.output_dir} ({trainer.total_steps} steps; metrics in {trainer.metrics_log.path})")
    if trainer.args.max_steps < 1:   # transformers: no step limit, the epochs decide
        p(f"steps:  max_steps {trainer.args.max_steps} means no step limit: num_train_epochs "
          f"{trainer.args.num_train_epochs:g} epochs give {trainer.total_steps:,} optimizer steps (set "
          "training.max_steps or --max-steps for fewer)")


def _data_text(data: dict, train_ds, eval_ds, seq_len: int) -> str:
    def one(spec, ds):
        what = "built-in corpus" if spec in (None, "builtin") else ", ".join([spec] if isinstance(spec, str) else spec)
        n = f"{len(ds):,} examples" if hasattr(ds, "__len__") else "streamed"
        return f"{what} ({n})"

    text = f"train {one(data.get('train', 'builtin'), train_ds)}"
    if eval_ds is not None:
        text += f", eval {one(data.get('eval', 'builtin'), eval_ds)}"
    return text + f"; blocks of {seq_len} tokens"


def cmd_train(ns) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatrain_nb.trainer import Trainer
    from megatrain_nb.trainer.args import training_arguments
    from megatrain_nb.trainer.default import load_default
    from megatrain_nb.trainer.presets import preset_config, preset_names

    cfg = load_run_config(ns.config)
    base = Path(ns.config).resolve().parent
    data = cfg.get("data") or {}
    if "sft" in cfg or "format" in data:   # fine-tuning on instructions / conversations
        return cmd_train_sft(ns, cfg, base)
    training = dict(cfg.get("training") or {})
    if ns.output_dir:
        training["output_dir"] = ns.output_dir
    if ns.max_steps is not None:
        training["max_steps"] = ns.max_steps
    _check_max_steps(training.get("max_steps", -1), "--max-steps" if ns.max_steps is not None else
                     "training.max_steps")
    training.setdefault("output_dir", "megatrain_outputs")
    training.setdefault("disable_tqdm", True)
    training.setdefault("report_to", "none")
    if not os.path.isabs(training["output_dir"]):
        training["output_dir"] = str((base / training["output_dir"]).resolve())
    try:
        seq_len = int(data.get("seq_len", 256))
    except (TypeError, ValueError):
        raise UsageError(f"data.seq_len: expected a whole number, got {data.get('seq_len')!r}") from None
    if "preset" in cfg and cfg["preset"] not in preset_names():
        raise UsageError(f"preset: {cfg['preset']!r} is not a preset; use one of {', '.join(preset_names())}")
    try:   # checked before any data is prepared; a misspelled field gets the closest name
        args = training_arguments(training, where="training")
    except ValueError as e:
        raise UsageError(str(e)) from None
    model_text = f"preset {cfg.get('preset')}"
    model = None
    if "model" in cfg:
        model, model_text = _model_source(cfg, base)  # its own tokenizer, if it has one, is used
    tokenizer = None
    if cfg.get("tokenizer"):
        local = (base / cfg["tokenizer"]).resolve()
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else cfg["tokenizer"])
    train_ds = _load_files(data.get("train", "builtin"), base=base, what="train")
    from megatrain_nb.trainer.sft_data import is_conversational_dataset

    if train_ds is not None and is_conversational_dataset(train_ds, data.get("text_column", "text")):
        return cmd_train_sft(ns, cfg, base)   # instruction / chat rows: the format is detected
    eval_ds = _load_files(data.get("eval"), base=base, what="eval") if data.get("eval") else None
    if train_ds is None:  # built-in corpus
        tok, train_ds, builtin_eval = load_default(seq_len=seq_len)
        tokenizer = tokenizer or tok
        eval_ds = eval_ds if eval_ds is not None else builtin_eval
    if model is None:
        torch.manual_seed(int(cfg.get("seed", training.get("seed", 42))))
        vocab = {"vocab_size": len(tokenizer)} if tokenizer is not None else {}
        model = AutoModelForCausalLM.from_config(preset_config(cfg["preset"], max_position_embeddings=max(seq_len, 128),
                                                               **vocab))
    engine_options = dict(cfg.get("engine") or {})
    if engine_options.get("offload_dir") and not os.path.isabs(os.path.expanduser(str(engine_options["offload_dir"]))):
        engine_options["offload_dir"] = str((base / engine_options["offload_dir"]).resolve())
    os.makedirs(args.output_dir, exist_ok=True)  # so an offload_dir inside it can be created
    trainer = Trainer(model=model, train_dataset=train_ds, eval_dataset=eval_ds, args=args, tokenizer=tokenizer,
                      seq_len=seq_len, text_column=data.get("text_column", "text"), **engine_options)
    try:
        print_header(trainer, model=model_text, data=_data_text(data, train_ds, eval_ds, seq_len))
        summary = run_with_progress(trainer, resume=ns.resume if ns.resume is not None else None)
        metrics = trainer.evaluate() if eval_ds is not None else None
        model_dir = trainer.save_model()
        print_summary(trainer, summary, model_dir=model_dir, eval_metrics=metrics)
    finally:
        trainer.close()
    return 0


def _training_fields(ns, cfg: dict, base: Path) -> dict:
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


def cmd_train_sft(ns, cfg: dict, base: Path) -> int:
    """run.yaml with an ``sft:`` section or an instruction/chat ``data.format``: mt.SFTTrainer.
    ``data.train: builtin`` is the shipped chat set (in ``data.format``); the tokenizer defaults to
    the model's own, else the shipped chat tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatrain_nb.trainer.presets import preset_config, preset_names
    from megatrain_nb.trainer.sft_data import FORMATS, detect_format, require_trl

    require_trl()
    from trl import SFTConfig

    from megatrain_nb import assets
    from megatrain_nb.trainer.sft import SFTTrainer

    data = cfg.get("data") or {}
    fmt = data.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise UsageError(f"data.format: {fmt!r}; use one of {', '.join(FORMATS)} (or leave it out to detect it)")
    bad = {"seq_len", "text_column"} & set(data)
    if bad:
        raise UsageError(f"data: {sorted(bad)} do not apply to fine-tuning; use sft.max_length and "
                         "sft.dataset_text_field")
    fields = {**_training_fields(ns, cfg, base), **(cfg.get("sft") or {})}
    if fields.get("chat_template_path") and not os.path.isabs(fields["chat_template_path"]):
        fields["chat_template_path"] = str((base / fields["chat_template_path"]).resolve())
    if "preset" in cfg and cfg["preset"] not in preset_names():
        raise UsageError(f"preset: {cfg['preset']!r} is not a preset; use one of {', '.join(preset_names())}")
    try:
        args = SFTConfig(**fields)
    except TypeError as e:
        raise UsageError(f"training/sft: {e} (fields of trl.SFTConfig)") from None
    builtin = data.get("train", "builtin") in (None, "builtin")
    train_ds = (assets.chat_dataset(fmt or "messages") if builtin
                else _load_files(data["train"], base=base, what="train"))
    eval_ds = _load_files(data.get("eval"), base=base, what="eval") if data.get("eval") not in (None, "builtin") else (
        assets.chat_dataset(fmt or "messages").select(range(200, 240)) if builtin else None)
    if builtin:
        train_ds = train_ds.select(range(200))
    found = detect_format([train_ds[i] for i in range(min(len(train_ds), 1000))], args.dataset_text_field)
    if fmt is not None and found != fmt:
        raise UsageError(f"data.format is {fmt!r} but data.train holds {found!r} rows; fix data.format or the data")
    model, model_text = (None, f"preset {cfg.get('preset')}")
    if "model" in cfg:
        model, model_text = _model_source(cfg, base)
    tokenizer = None
    if cfg.get("tokenizer"):
        local = (base / cfg["tokenizer"]).resolve()
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else cfg["tokenizer"])
    elif model is None:
        tokenizer = assets.chat_tokenizer()
    if model is None:
        torch.manual_seed(int(cfg.get("seed", fields.get("seed", 42))))
        model = AutoModelForCausalLM.from_config(preset_config(
            cfg["preset"], vocab_size=len(tokenizer), max_position_embeddings=max(args.max_length or 0, 128)))
    engine_options = dict(cfg.get("engine") or {})
    if engine_options.get("offload_dir") and not os.path.isabs(os.path.expanduser(str(engine_options["offload_dir"]))):
        engine_options["offload_dir"] = str((base / engine_options["offload_dir"]).resolve())
    os.makedirs(args.output_dir, exist_ok=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                         processing_class=tokenizer, **engine_options)
    try:
        where = "built-in chat set" if builtin else data["train"]
        text = (f"{where}, format {found}, {len(trainer.train_dataset):,} rows"
                + (f" packed into {args.max_length}-token rows" if args.packing else ""))
        print_header(trainer, model=model_text, data=text)
        for report in trainer.prep_reports:
            if report.message():
                print(f"note:   {report.message()}")
        summary = run_with_progress(trainer, resume=ns.resume if ns.resume is not None else None)
        metrics = trainer.evaluate() if trainer.eval_dataset is not None else None
        model_dir = trainer.save_model()
        print_summary(trainer, summary, model_dir=model_dir, eval_metrics=metrics)
    finally:
        trainer.close()
    return 0


# ---------------------------------------------------------------------------------------- estimate
def _budget_arg(s: str):
    if s.lower() in ("auto",):
        return "auto"
    if s.lower() in ("none", "unlimited", "inf"):
        return None
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of GiB, 'auto' or 'none', not {s!r}")
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{s!r}: must be > 0")
    return v


def run_estimate(ns):
    """The estimate an ``estimate`` command line asks for (the CLI and ``%megatrain estimate``)."""
    from megatrain_nb.estimator import CLI_NAMES, estimate

    kw = dict(vram_gb=ns.vram, ram_gb=ns.ram, disk_gb=ns.disk, batch=ns.batch, seq=ns.seq,
              compression=ns.compression, precision=ns.precision,
              offload_dir=False if ns.no_disk else (ns.offload_dir or True), names=CLI_NAMES)
    if ns.accumulation != 1:
        kw["accumulation"] = ns.accumulation
    if ns.nodes == 1 and ns.gpus_per_node == 1:
        return estimate(ns.model, **kw)
    from megatrain_nb.estimator_dist import estimate_scale_out  # the state sharded over every GPU

    return estimate_scale_out(ns.model, nodes=ns.nodes, gpus_per_node=ns.gpus_per_node, **kw)


def estimate_from_words(words):
    """``%megatrain estimate <words>``: the CLI's own parser; a usage error raises ValueError
    with argparse's message instead of exiting."""
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = build_parser().parse_args(["estimate", *words])
    except SystemExit:
        lines = [x for x in err.getvalue().strip().splitlines() if x]
        raise ValueError(lines[-1].replace("megatrain-nb estimate: error: ", "") if lines else
                         "usage: estimate <model> [--vram GB] [--ram GB] [--disk GB] [--nodes M] "
                         "[--gpus-per-node N]") from None
    return run_estimate(ns)


def cmd_estimate(ns) -> int:
    est = run_estimate(ns)
    print(json.dumps(est.to_dict(), indent=2, default=str) if ns.json else est)
    return 0


def _max_steps_arg(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number >= 1 (or -1 for epochs), not {s!r}") from None
    _check_max_steps(v, "", error=argparse.ArgumentTypeError)
    return v


def _check_max_steps(v, where: str, error=None) -> None:
    """max_steps: >= 1, or -1 (transformers' "no step limit": num_train_epochs decides). 0 and
    other negatives would silently fall back to epochs in transformers: refused."""
    error = error or UsageError
    if isinstance(v, bool) or not isinstance(v, int) or (v < 1 and v != -1):
        raise error(f"{where + ' ' if where else ''}{v!r}: give a whole number of optimizer steps >= 1, or -1 "
                    "for no step limit (the run then lasts training.num_train_epochs epochs)")


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number >= 1, not {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number >= 1, not {s!r}")
    return v


# ---------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    from megatrain_nb import __version__
    from megatrain_nb.engine.codecs import codec_names  # the codec registry: a new codec is one file
    from megatrain_nb.trainer.presets import preset_names  # the preset registry

    ap = argparse.ArgumentParser(prog="megatrain-nb", description="Full-precision training of models larger "
                                 "than accelerator memory.")
    ap.add_argument("--version", action="version", version=f"megatrain-nb {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train the built-in default (no download) with the disk tier and "
                                    "compressed optimizer states")
    d.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps (default 250; 20 with --quick)")
    d.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    d.add_argument("--output-dir", default="megatrain_demo", help="where checkpoints, the model and metrics go")
    d.add_argument("--quick", action="store_true", help="a very short run (smoke test)")
    d.add_argument("--seq-len", type=_positive_int, default=None,
                   help="tokens per sequence (default 128; 64 with --quick)")
    d.add_argument("--batch-size", type=_positive_int, default=8)
    d.add_argument("--lr", type=float, default=3e-3)
    d.add_argument("--vocab-size", type=_positive_int, default=4096)
    d.add_argument("--compression", default="int8", choices=codec_names(),
                   help="optimizer-state codec (default int8)")
    d.add_argument("--no-disk", action="store_true", help="keep everything in RAM (no disk tier)")
    d.add_argument("--host-cache", type=float, default=None, metavar="GB",
                   help="GiB of RAM caching the disk tier (default: half the tier, so that both carry the "
                        "optimizer states; 0 = every access goes to the disk)")
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("train", help="train from a run.yaml config")
    t.add_argument("--config", required=True, metavar="RUN_YAML",
                   help=f"the run config: model or preset, data, training (TrainingArguments fields), engine "
                        f"(EngineConfig fields); every field is shown in {EXAMPLE_CONFIG} in the repository and "
                        "the README's 'run.yaml' section")
    t.add_argument("--output-dir", default=None, help="override training.output_dir")
    t.add_argument("--max-steps", type=_max_steps_arg, default=None,
                   help="override training.max_steps: a whole number >= 1, or -1 for no step limit (the run "
                        "then lasts training.num_train_epochs epochs, as in transformers)")
    t.add_argument("--resume", default=None, nargs="?", const=True,
                   help="resume: a checkpoint folder, or no value for the newest checkpoint of the run that "
                        "wrote last into output_dir; 'auto': that checkpoint if there is one, else a fresh start "
                        "(for torchrun --max-restarts: the restarted workers continue by themselves)")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("estimate", help="the memory table for a model on given hardware")
    e.add_argument("model", help=f"a preset ({', '.join(preset_names())}), a local model folder or a config.json")
    e.add_argument("--vram", type=_budget_arg, default=80.0, help="device budget in GiB (default 80)")
    e.add_argument("--ram", type=_budget_arg, default="auto", help="host RAM in GiB, 'auto' (this machine) or 'none'")
    e.add_argument("--disk", type=_budget_arg, default="auto", help="disk tier in GiB, 'auto' (free space) or 'none'")
    e.add_argument("--batch", type=int, default=1)
    e.add_argument("--seq", type=int, default=2048)
    e.add_argument("--compression", default="int8", choices=codec_names())
    e.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    e.add_argument("--offload-dir", default=None, help="where the disk tier would live (for 'auto' free space)")
    e.add_argument("--no-disk", action="store_true", help="no disk tier")
    e.add_argument("--accumulation", type=_positive_int, default=1,
                   help="micro-batches per optimizer step on each GPU (default 1)")
    e.add_argument("--nodes", type=_positive_int, default=1,
                   help="machines in the run (default 1); --ram and --disk are per node")
    e.add_argument("--gpus-per-node", type=_positive_int, default=1,
                   help="GPUs (ranks) per node (default 1); the training state is sharded over all of them")
    e.add_argument("--json", action="store_true", help="print JSON instead of the table")
    e.set_defaults(func=cmd_estimate)

    m = sub.add_parser("models", help="which causal LMs of the installed transformers the engine supports "
                                      "(docs/MODELS.md)")
    m.add_argument("--check", nargs="*", metavar="MODEL_TYPE", default=None,
                   help="run the check here (tiny models, CPU; the whole registry takes minutes) instead of "
                        "showing the shipped results; with model types, only those")
    m.set_defaults(func=cmd_models)
    return ap


def cmd_models(ns) -> int:
    """The models table for the installed transformers (shipped results, or checked here)."""
    import transformers

    from megatrain_nb.sweep import table

    if ns.check is not None:
        from megatrain_nb.sweep.check import sweep

        results = [r.to_dict() for r in sweep(ns.check or None)]
    else:
        stored = table.load()
        results = table.for_installed(stored)
        if stored.get("transformers") and stored["transformers"] != transformers.__version__:
            print(f"(results checked with transformers {stored['transformers']}; installed: "
                  f"{transformers.__version__}; `megatrain-nb models --check` checks this one)")
    print(table.text(results, transformers.__version__))
    return 0


def main(argv=None) -> int:
    ns = build_parser().parse_args(argv)  # usage errors: argparse prints them and exits 2
    try:
        return ns.func(ns)
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        # UsageError, CheckpointError, DataError, OffloadError, a missing model or file...
        if os.environ.get("MEGATRAIN_NB_DEBUG"):
            raise
        text = " ".join(str(e).split())
        print(f"megatrain-nb {ns.command}: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

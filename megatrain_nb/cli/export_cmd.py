"""``megatrain-nb export SRC DEST --format gguf --dtype f16``: a saved model folder, a checkpoint,
a run's ``output_dir`` (its newest checkpoint) or a ``.gguf`` file, written as a Hugging Face
safetensors folder, a GGUF file or a torch.distributed.checkpoint (docs/EXPORT.md)."""
from __future__ import annotations

import os
import time

FORMATS = ("safetensors", "gguf", "dcp")
GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")


def cmd_export(ns) -> int:
    from megatrain_nb.export import export   # light: the exporters (torch, transformers) away from --help

    if not os.path.exists(ns.src):
        raise FileNotFoundError(f"{ns.src!r}: no such model folder, checkpoint, run folder or .gguf file")
    start = time.time()
    out = export(ns.src, ns.dest, format=ns.format, dtype=ns.dtype if ns.format == "gguf" else None,
                 tokenizer=not ns.no_tokenizer)
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(out) for f in fs) \
        if os.path.isdir(out) else os.path.getsize(out)
    what = f"{ns.format}" + (f" {ns.dtype}" if ns.format == "gguf" else "")
    print(f"exported {ns.src} -> {out} ({what}, {size / 1e6:.1f} MB in {time.time() - start:.1f} s)")
    return 0


def add_parser(sub) -> None:
    """The ``export`` subcommand's arguments."""
    e = sub.add_parser("export", help="write a saved model, checkpoint, run or .gguf as safetensors, GGUF or a "
                                      "torch.distributed.checkpoint")
    e.add_argument("src", help="a model folder, a checkpoint, a run's output_dir or a .gguf file")
    e.add_argument("dest", help="the folder (safetensors, dcp) or file (gguf) to write")
    e.add_argument("--format", default="safetensors", choices=FORMATS)
    e.add_argument("--dtype", default="f16", choices=GGUF_DTYPES, help="the GGUF's weight type (default f16)")
    e.add_argument("--no-tokenizer", action="store_true", help="a GGUF without tokenizer metadata")
    e.set_defaults(func=cmd_export)

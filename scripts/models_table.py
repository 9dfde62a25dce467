"""Run the registry sweep and write docs/MODELS.md and megatrain_nb/data/models.json.

    python scripts/models_table.py                 # the whole registry, in chunks of 20
    python scripts/models_table.py --jobs 2        # two chunks at a time
    python scripts/models_table.py --only llama gpt2   # re-check some, keep the others' results
    python scripts/models_table.py --vision            # the image-text-to-text registry only (or --vision qwen2_vl ...)

Each chunk runs in its own process with a time limit per architecture (a hang or a crash of
one architecture is its result, not the end of the sweep).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHUNK_CODE = r"""
import json, signal, sys, warnings
warnings.filterwarnings("ignore")
from transformers.utils import logging
logging.set_verbosity_error()
import torch
torch.set_num_threads(1)
from megatrain_nb.sweep.check import FAILING, check, registry

class Timeout(Exception):
    pass

def on_alarm(*_):
    raise Timeout(f"no result within {LIMIT} s")

LIMIT = int(sys.argv[1])
signal.signal(signal.SIGALRM, on_alarm)
arch = registry()
for mt in sys.argv[2:]:
    signal.alarm(LIMIT)
    try:
        r = check(mt).to_dict()
    except BaseException as e:
        r = {"model_type": mt, "architecture": arch.get(mt, "?"), "kind": "", "status": FAILING,
             "reason": f"the check crashed: {type(e).__name__}: {e}"[:300], "modes": {}, "layers": None}
    signal.alarm(0)
    print(json.dumps(r), flush=True)
"""


def run_chunk(types, limit):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", CHUNK_CODE, str(limit), *types], capture_output=True, text=True,
                       env=env, cwd=ROOT)
    out = {}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[r["model_type"]] = r
    for mt in types:   # the process died under it: that is its result
        if mt not in out:
            out[mt] = {"model_type": mt, "architecture": "?", "kind": "", "status": "failing",
                       "reason": f"the check process died (exit {p.returncode})", "modes": {}, "layers": None}
            break
    return out, [mt for mt in types if mt not in out]


def main(argv=None):
    import transformers

    from megatrain_nb.sweep import table
    from megatrain_nb.sweep.check import registry
    from megatrain_nb.sweep.vision import vision_registry, vision_sweep

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=20)
    ap.add_argument("--limit", type=int, default=300, help="seconds per architecture")
    ap.add_argument("--from-jsonl", nargs="*", default=None, help="results already run (JSON lines) to use")
    ap.add_argument("--vision", nargs="*", default=None,
                    help="check only the image-text-to-text registry (these model types; all when none given)")
    ns = ap.parse_args(argv)

    loaded = table.load().get("results", [])
    stored = {r["model_type"]: r for r in loaded if not table.is_vision(r)}
    vision = {r["model_type"]: r for r in loaded if table.is_vision(r)}
    if ns.vision is not None or (ns.only is None and ns.from_jsonl is None):   # in this process: a few minutes
        for r in vision_sweep(ns.vision or None):
            vision[r.model_type] = r.to_dict()
            print(f"{r.model_type:<28} {r.status:<20} {r.reason[:100]}", flush=True)
    if ns.vision is not None:
        todo = []
    elif ns.from_jsonl is not None:
        for path in ns.from_jsonl:
            for line in open(path):
                if line.startswith("{"):
                    r = json.loads(line)
                    stored[r["model_type"]] = r
        todo = []
    else:
        todo = ns.only if ns.only else list(registry())
    chunks = [todo[i:i + ns.chunk] for i in range(0, len(todo), ns.chunk)]
    with ThreadPoolExecutor(ns.jobs) as pool:
        pending = list(chunks)
        while pending:
            done = list(pool.map(lambda c: run_chunk(c, ns.limit), pending))
            pending = [rest for _, rest in done if rest]
            for out, _ in done:
                stored.update(out)
                for r in out.values():
                    print(f"{r['model_type']:<28} {r['status']:<20} {r.get('reason', '')[:100]}", flush=True)
    results = ([stored[mt] for mt in registry() if mt in stored]
               + [vision[mt] for mt in vision_registry() if mt in vision])
    table.save(results, transformers.__version__)
    with open(os.path.join(ROOT, "docs", "MODELS.md"), "w") as f:
        f.write(table.markdown(results, transformers.__version__))
    print(table.summary(results))


if __name__ == "__main__":
    main()

"""docs/INTERNALS.md's thread table against the thread registry (megatrain_nb/threads.py) and
against the threads a training step really starts."""
import gc
import re
import threading
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.threads import THREADS

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "INTERNALS.md"


def _doc_threads() -> dict:
    """{thread name: its row} of the table under '## Threads and locks'."""
    text = DOC.read_text()
    section = text.split("## Threads and locks", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `mtnb-"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            for name in re.findall(r"`(mtnb-[a-z0-9_-]+)`", cells[0]):
                rows[name] = cells
    return rows


def _base(name: str) -> str:
    """A running thread's registry name: pools add ``_<n>``, per-instance threads ``-<suffix>``."""
    for spec in sorted(THREADS, key=len, reverse=True):
        if name == spec or name.startswith(spec + "_") or name.startswith(spec + "-"):
            return spec
    return name


def test_the_table_lists_every_registered_thread_with_its_owner_and_settings():
    rows = _doc_threads()
    assert set(THREADS) <= set(rows), sorted(set(THREADS) - set(rows))
    for name, spec in THREADS.items():
        cells = rows[name]
        assert cells[1] == spec.owner, (name, cells[1], spec.owner)
        assert cells[2] == spec.settings, (name, cells[2], spec.settings)
    assert set(rows) <= set(THREADS), sorted(set(rows) - set(THREADS))   # nothing listed that nobody starts


def test_a_training_step_starts_exactly_the_registered_engine_threads(tmp_path):
    # (thread objects, not idents: a thread of an engine an earlier test left behind may end
    # during this step, and a new thread can then be given its ident)
    gc.collect()
    before = set(threading.enumerate())
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2, hidden=64))
    e = StreamingEngine(model, EngineConfig(device="cpu", optimizer_compression="int8", offload_dir=str(tmp_path),
                                            offload_params=True, host_cache_gb=0.01))
    ids = torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        e.forward_backward(ids, step_lr=1e-3)
    e.zero_grad()
    started = {_base(t.name) for t in threading.enumerate() if t not in before}
    want = {n for n, s in THREADS.items() if s.per_step}
    assert started == want, (sorted(started), sorted(want))
    e.close()

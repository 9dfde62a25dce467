"""mt.Trainer runs unchanged under torchrun: 2 ranks x accumulation 2 end where 1 process x
accumulation 4 does; one metrics log and one saved model, written by rank 0."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .launch import REPO, check, torchrun

HERE = Path(__file__).parent


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def _alone(*argv):
    p = subprocess.run([sys.executable, str(HERE / "w_trainer.py"), *argv], cwd=str(REPO),
                       env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                            "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """The one-process run (accumulation 4) the two-rank runs end on: trained once per module."""
    out = tmp_path_factory.mktemp("alone") / "one"
    _alone(str(out), "4")
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The two-rank run (accumulation 2) with a checkpoint at step 2: the run that ends where the
    one-process run ends, and the checkpoint that one process resumes (saving it changes nothing
    the run trains, logs or evaluates)."""
    out = tmp_path_factory.mktemp("two-ranks") / "two"
    check(torchrun(HERE / "w_trainer.py", str(out), "2", "save", nproc=2, timeout=300))
    return out


def _agree(a, b):
    assert a.keys() == b.keys()
    diff = sum(float((a[k] - b[k]).norm()) ** 2 for k in a) ** 0.5
    norm = sum(float(b[k].norm()) ** 2 for k in a) ** 0.5
    assert diff / norm <= 1e-5 and max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-4


def test_checkpoint_of_two_ranks_resumes_in_one_process(tmp_path, two_ranks):
    """Trainer checkpoint written by 2 ranks (each its shards, rank 0 the shared files), resumed
    by one process with accumulation 4: it ends where the 2-rank run ended."""
    ck = two_ranks / "checkpoint-2"
    assert sorted(f.name for f in ck.glob("shards-*")) == ["shards-00000-of-00002.safetensors",
                                                           "shards-00001-of-00002.safetensors"]
    assert (ck / "trainer_state.json").is_file() and not list(two_ranks.glob("*.tmp-*"))
    # rank 0's manifest covers every rank's shards; scheduler and RNG state are JSON, no pickles
    from megatrain_nb.manifest import verify_manifest

    assert verify_manifest(ck)
    listed = set(json.loads((ck / "manifest.json").read_text())["files"])
    assert {"shards-00000-of-00002.safetensors", "shards-00001-of-00002.safetensors",
            "scheduler.json", "rng_state.json"} <= listed
    assert not list(ck.glob("*.pt")) and not list(ck.glob("*.pth"))
    _alone(str(tmp_path / "one"), "4", f"resume:{ck}")
    _agree(_weights(two_ranks / "final"), _weights(tmp_path / "one" / "final"))


def test_trainer_two_ranks_equal_one_process(two_ranks, alone):
    two = two_ranks
    a, b = _weights(two / "final"), _weights(alone / "final")
    assert a.keys() == b.keys()
    diff = sum(float((a[k] - b[k]).norm()) ** 2 for k in a) ** 0.5
    norm = sum(float(b[k].norm()) ** 2 for k in a) ** 0.5
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"relative difference {diff / norm:.3g}, largest element difference {worst:.3g}")
    assert diff / norm <= 1e-5
    # single elements: Adam turns a summation-order rounding in a near-cancelling gradient
    # (an embedding row seen by both ranks) into a larger step; see test_zero3_flow._max_rel
    assert worst <= 1e-4
    two_log = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    one_log = [json.loads(x) for x in (alone / "metrics.jsonl").read_text().splitlines()]
    steps2 = [r for r in two_log if "loss" in r and "event" not in r]
    steps1 = [r for r in one_log if "loss" in r and "event" not in r]
    assert len(steps2) == len(steps1) == 3                     # one log: rank 1 wrote nothing
    for r2, r1 in zip(steps2, steps1):                          # global loss, tokens and norm
        assert r2["tokens"] == r1["tokens"]
        assert abs(r2["loss"] - r1["loss"]) <= 1e-5 * abs(r1["loss"])
        assert abs(r2["grad_norm"] - r1["grad_norm"]) <= 1e-5 * r1["grad_norm"]
    assert not list((two / "final").glob(".save-tmp-*"))
    # evaluation is sharded: 5 eval batches, 3 on rank 0 and 2 + a zero-weight pad on rank 1;
    # the summed loss is the one-process eval loss
    ev2 = [json.loads((two / f"eval-rank{r}.json").read_text()) for r in range(2)]
    ev1 = json.loads((alone / "eval-rank0.json").read_text())
    assert [e["batches"] for e in ev2] == [3, 3] and ev1["batches"] == 5
    assert ev2[0]["tokens"] == ev2[1]["tokens"] == ev1["tokens"]
    assert ev2[0]["loss"] == ev2[1]["loss"] == pytest.approx(ev1["loss"], rel=1e-6)


def test_rank_death_restarts_and_resumes_exactly(tmp_path, alone):
    """torchrun --max-restarts 1: rank 1 dies after checkpoint-2; the agent stops rank 0 and starts
    both again; with resume_from_checkpoint="auto" they resume from checkpoint-2 by themselves and
    end where an uninterrupted run ends (item 3's rule)."""
    out = tmp_path / "two"
    out.mkdir()
    proc = torchrun(HERE / "w_trainer.py", str(out), "2", "crash", nproc=2, timeout=300, max_restarts=1,
                    dist_timeout_s=30)
    check(proc)
    assert sorted(p.name for p in out.glob("attempt-*")) == ["attempt-0-rank0", "attempt-0-rank1",
                                                             "attempt-1-rank0", "attempt-1-rank1"]
    log = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    starts = [r for r in log if r.get("event") == "run_start"]
    assert [s["step"] for s in starts] == [0, 2] and starts[1]["resumed_from"].endswith("checkpoint-2")
    assert starts[0]["run_id"] == starts[1]["run_id"]          # the same run, continued
    assert [r["step"] for r in log if "loss" in r and "event" not in r] == [1, 2, 3]
    _agree(_weights(out / "final"), _weights(alone / "final"))


def test_rank_death_then_rerun_with_resume_true(tmp_path, alone):
    """Without restarts the run fails (rank 1 named); re-running the job with
    resume_from_checkpoint=True continues from the last complete checkpoint, exactly."""
    out = tmp_path / "two"
    out.mkdir()
    failed = torchrun(HERE / "w_trainer.py", str(out), "2", "crash", nproc=2, timeout=300, dist_timeout_s=30)
    assert failed.returncode != 0 and "exitcode  : 9" in failed.stderr
    assert (out / "checkpoint-2").is_dir() and not (out / "final").exists()
    check(torchrun(HERE / "w_trainer.py", str(out), "2", "resume:latest", nproc=2, timeout=300))
    _agree(_weights(out / "final"), _weights(alone / "final"))

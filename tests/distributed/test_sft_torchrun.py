"""mt.SFTTrainer under torchrun (issue 20: "layer-major accumulation, sharding, checkpoints,
resume ... work as for mt.Trainer"): 2 gloo ranks x accumulation 2 end where 1 process x
accumulation 4 ends, on conversational data with assistant_only_loss, plain and packed; the
token metrics (mean_token_accuracy, entropy) are counted over every rank; a checkpoint of the
2 ranks resumes in one process and ends there too; on_nonfinite="skip" skips a step on every
rank when one rank's gradient shard holds a NaN."""
import json
from pathlib import Path

import pytest

from .launch import alone, alone_once, check, torchrun
from .test_trainer_torchrun import _agree, _weights

pytest.importorskip("trl")

HERE = Path(__file__).parent
#: the xdist group of the tests that compare with the one-process run of the "assistant" case
SFT_ONE_PROCESS = "sft-one-process"


def _alone(*argv):
    alone(HERE / "w_sft.py", *argv)


def _logs(folder, key):
    return [r for r in json.loads((Path(folder) / "log_history.json").read_text()) if key in r]


def _same_logs(two, one):
    for key in ("loss", "eval_loss"):
        a, b = _logs(two, key), _logs(one, key)
        assert len(a) == len(b) >= 1, key
        for x, y in zip(a, b):
            assert x[key] == pytest.approx(y[key], rel=1e-5), key
    acc = _logs(two, "mean_token_accuracy")
    assert [r["mean_token_accuracy"] for r in acc] == pytest.approx(
        [r["mean_token_accuracy"] for r in _logs(one, "mean_token_accuracy")], rel=1e-9)
    assert len(acc) == 3 and all("entropy" in r for r in acc)
    ev = _logs(two, "eval_mean_token_accuracy")
    assert [r["eval_mean_token_accuracy"] for r in ev] == pytest.approx(
        [r["eval_mean_token_accuracy"] for r in _logs(one, "eval_mean_token_accuracy")], rel=1e-9) and ev


CASES = ["assistant", "packed"]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Both cases' two-rank runs (accumulation 2, a checkpoint at step 2), one after the other in
    one launch: ``<case>/``."""
    base = tmp_path_factory.mktemp("sft-two-ranks")
    # (no leading "--": torchrun's own parser would take it)
    argv = [a for case in CASES for a in ("--", str(base / case), "2", case, "save")][1:]
    check(torchrun(HERE / "w_sft.py", *argv, nproc=2, timeout=450))
    return base


@pytest.mark.slow
@pytest.mark.xdist_group(SFT_ONE_PROCESS)
@pytest.mark.parametrize("case", CASES)
def test_sft_two_ranks_equal_one_process(two_rank_runs, tmp_path, case):
    two = two_rank_runs / case
    one = alone_once(HERE / "w_sft.py", "4", case)   # (test_sft_session.py's too)
    _agree(_weights(two / "final"), _weights(one / "final"))
    _same_logs(two, one)
    ck = two / "checkpoint-2"
    assert sorted(f.name for f in ck.glob("shards-*")) == ["shards-00000-of-00002.safetensors",
                                                           "shards-00001-of-00002.safetensors"]
    if case == "packed":   # the 2 ranks' checkpoint, resumed by one process with accumulation 4
        _alone(str(tmp_path / "resumed"), "4", case, f"resume:{ck}")
        _agree(_weights(tmp_path / "resumed" / "final"), _weights(one / "final"))


@pytest.mark.slow
def test_sft_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """on_nonfinite="skip" as for mt.Trainer: a NaN in rank 1's gradient shard at step 2 makes
    both ranks skip that step (no collective timeout), and steps 1 and 3 train."""
    check(torchrun(HERE / "w_sft.py", str(tmp_path / "two"), "2", "assistant", "nan", nproc=2, timeout=300,
                   dist_timeout_s=30))
    log = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r and "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and [r["skipped_steps"] for r in steps] == [0, 1, 1]
    assert (tmp_path / "two" / "final" / "model.safetensors").is_file()

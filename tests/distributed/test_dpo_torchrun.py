"""mt.DPOTrainer under torchrun: 2 gloo ranks x accumulation 2 end where 1 process x
accumulation 4 ends (weights, logged losses, eval loss, the reward metrics as the mean over ranks)."""
import json
from pathlib import Path

import pytest

from .launch import alone_once, check, torchrun
from .test_trainer_torchrun import _agree, _weights

pytest.importorskip("trl")

HERE = Path(__file__).parent
#: the xdist group of the tests that compare with the one-process run (accumulation 4)
DPO_ONE_PROCESS = "dpo-one-process"


def _logs(folder, key):
    return [r[key] for r in json.loads((Path(folder) / "log_history.json").read_text()) if key in r]


@pytest.mark.slow
@pytest.mark.xdist_group(DPO_ONE_PROCESS)
def test_dpo_two_ranks_equal_one_process(tmp_path):
    check(torchrun(HERE / "w_dpo.py", str(tmp_path / "two"), "2", nproc=2, timeout=300))
    one = alone_once(HERE / "w_dpo.py", "4")   # (test_dpo_session.py's too)
    _agree(_weights(tmp_path / "two" / "final"), _weights(one / "final"))
    for key in ("loss", "eval_loss", "rewards/margins", "logps/chosen"):
        a, b = _logs(tmp_path / "two", key), _logs(one, key)
        assert len(a) == len(b) >= 1 and a == pytest.approx(b, rel=1e-5, abs=1e-6), key

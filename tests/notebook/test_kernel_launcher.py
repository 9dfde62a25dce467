"""mt.Session(..., nproc_per_node=2) in a real Jupyter kernel: train() returns at once, the kernel
answers while two worker processes train, the controls reach both ranks, the sidebar's stop too."""
import json
import time

import pytest
from test_kernel import Kernel

pytestmark = pytest.mark.slow

SETUP = """
import json, time, torch
import numpy as np, datasets
from transformers import AutoModelForCausalLM, TrainingArguments
import megatrain_nb as mt
from megatrain_nb.model_configs import preset_config
%load_ext megatrain_nb
rng = np.random.default_rng(0)
ds = datasets.Dataset.from_dict({"input_ids": rng.integers(0, 512, size=(256, 32)).tolist()})
model = AutoModelForCausalLM.from_config(preset_config("micro"))
args = TrainingArguments(output_dir=OUT, max_steps=100000, per_device_train_batch_size=2, learning_rate=1e-3,
                         lr_scheduler_type="constant", logging_steps=5, report_to="none", save_strategy="no",
                         disable_tqdm=True)
session = mt.Session(model, train_dataset=ds, args=args, name="kernel-launch", nproc_per_node=2, device="cpu")
"""


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_DIST_TIMEOUT_S", "30")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    k = Kernel(tmp_path)
    yield k
    try:
        k.run("session.stop(timeout=30) if session.state in ('running', 'paused') else None", timeout=40)
    finally:
        k.close()


def test_launcher_in_a_real_kernel(kernel, tmp_path, timed_part_done):
    from megatrain_nb.channel.registry import enqueue_command, list_sessions

    k = kernel
    k.ok(f"OUT = {str(tmp_path / 'out')!r}\n" + SETUP)
    out = k.run("t0 = time.perf_counter(); session.train(); print(round(time.perf_counter() - t0, 3), session.state)")
    assert out["error"] is None, out["error"]
    took, state = out["text"].split()
    assert float(took) < 3.0 and state == "running", took
    assert any("application/vnd.jupyter.widget-view+json" in d for d in out["displays"])   # the dashboard

    # the kernel answers while the workers start, and while they train
    t0 = time.monotonic()
    assert k.ok("print(1 + 1)", timeout=10).strip() == "2" and time.monotonic() - t0 < 2.0
    k.ok("session.wait(timeout=60, until_step=2)", timeout=70)
    steps = []
    for _ in range(3):
        t0 = time.monotonic()
        steps.append(int(k.ok("time.sleep(0.3); print(session.step)", timeout=10)))
        assert time.monotonic() - t0 < 2.0
    assert steps[-1] > steps[0] >= 2 and k.ok("print(session.state)").strip() == "running"
    assert k.ok("print(torch.cuda.is_initialized())").strip() == "False"
    timed_part_done()   # (ALONE_TESTS) what follows waits on bounds of a minute: other tests may run beside it

    k.ok("%megatrain pause")
    k.ok("while session.state != 'paused': time.sleep(0.02)", timeout=30)
    held = int(k.ok("print(session.step)"))
    assert "learning rate 0.0005" in k.ok("%megatrain lr 5e-4")
    k.ok("%megatrain resume")
    k.ok(f"session.wait(timeout=60, until_step={held + 2})", timeout=70)

    # the JupyterLab sidebar lists the run once, and its stop reaches both ranks
    runs = [s for s in list_sessions(tmp_path / "runtime") if s["name"] == "kernel-launch"]
    assert len(runs) == 1, runs
    enqueue_command(runs[0]["id"], "stop", root=tmp_path / "runtime")
    assert "'stopped'" in k.ok("session.wait(timeout=60)", timeout=70)
    got = json.loads(k.ok("""print(json.dumps({
        "events": [[e["kind"], e["step"], e.get("source")] for e in session.events],
        "ranks": [[r["outcome"], r["step"], [[e["kind"], e["step"]] for e in r["events"]]] for r in session.ranks],
        "step": session.step}))"""))
    final = got["step"]
    assert got["events"] == [["pause", held, "magic"], ["lr", held, "magic"], ["resume", held, "magic"],
                             ["stop", final, "lab"]]
    per_rank = [["pause", held], ["lr", held], ["resume", held], ["stop", final]]
    assert got["ranks"] == [["stopped", final, per_rank], ["stopped", final, per_rank]]
    # the ranks have exited and their heartbeat with them (issue 44: ended runs' files do not pile
    # up); the notebook's own Session still shows the run
    assert [(s["name"], s["state"]) for s in list_sessions(tmp_path / "runtime")] == []

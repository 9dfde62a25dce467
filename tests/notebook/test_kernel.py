"""A real Jupyter kernel (jupyter_client) driving a real Trainer through a Session and %megatrain."""
import json
import os
import time

import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETUP = """
import json, time
import numpy as np, datasets
from transformers import AutoModelForCausalLM, TrainingArguments
import megatrain_nb as mt
from megatrain_nb.model_configs import preset_config
%load_ext megatrain_nb
rng = np.random.default_rng(0)
ds = datasets.Dataset.from_dict({"input_ids": rng.integers(0, 512, size=(512, 32)).tolist()})
model = AutoModelForCausalLM.from_config(preset_config("micro"))
args = TrainingArguments(output_dir=OUT, max_steps=300, per_device_train_batch_size=4, learning_rate=1e-3,
                         lr_scheduler_type="constant", logging_steps=10, report_to="none", save_strategy="no",
                         disable_tqdm=True, use_cpu=True)
session = mt.Session(model, train_dataset=ds, args=args, name="kernel-test")
"""


class Kernel:
    def __init__(self, tmp_path):
        from jupyter_client.manager import start_new_kernel

        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
                   MEGATRAIN_NB_RUNTIME_DIR=str(tmp_path / "runtime"), MEGATRAIN_NB_DASHBOARD="auto")
        self.km, self.kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path))
        self.iopub: list[dict] = []  # every iopub message, with its arrival time

    def run(self, code: str, timeout: float = 120) -> dict:
        msg_id = self.kc.execute(code)
        out = {"text": "", "error": None, "displays": []}
        end = time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(0.1, end - time.monotonic()))
            msg["_t"] = time.monotonic()
            self.iopub.append(msg)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out["text"] += content["text"]
            elif kind == "error":
                out["error"] = "\n".join(content["traceback"])
            elif kind in ("display_data", "execute_result"):
                out["displays"].append(content["data"])
                if kind == "execute_result":
                    out["text"] += content["data"].get("text/plain", "")
            elif kind == "status" and content["execution_state"] == "idle":
                return out

    def ok(self, code: str, timeout: float = 120) -> str:
        out = self.run(code, timeout)
        assert out["error"] is None, out["error"]
        return out["text"]

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture
def kernel(tmp_path):
    k = Kernel(tmp_path)
    yield k
    k.close()


def test_session_in_a_real_kernel_with_magics(kernel, tmp_path, timed_part_done):
    k = kernel
    k.ok(f"OUT = {str(tmp_path / 'out')!r}\n" + SETUP)

    # train() returns at once while training continues
    out = k.run("t0 = time.perf_counter(); session.train(); print(round(time.perf_counter() - t0, 3), session.state)")
    assert out["error"] is None, out["error"]
    took, state = out["text"].split()
    assert float(took) < 3.0 and state == "running", took  # builds and shows the dashboard, then returns
    timed_part_done()   # (tests/conftest.py ALONE_TESTS) nothing below is timed: other tests may run beside it
    assert any("application/vnd.jupyter.widget-view+json" in d for d in out["displays"])  # the dashboard
    # ...while training goes on: the step count moves (waited for, not slept on: how many steps a
    # fixed 0.3 s holds depends on the machine's load)
    first = int(k.ok("print(session.step)"))
    later = int(k.ok(f"while session.step == {first} and session.state == 'running': time.sleep(0.02)\n"
                     "print(session.step)", timeout=60))
    assert later > first >= 0

    # %megatrain pause holds the step count still
    text = k.ok("%megatrain pause")
    assert "paused at step" in text or "pause requested" in text
    k.ok("while session.state != 'paused': time.sleep(0.01)", timeout=30)
    a, b, state = k.ok("a = session.step; time.sleep(0.6); print(a, session.step, session.state)").split()
    assert a == b and state == "paused" and int(a) < 300

    # %megatrain lr 5e-4 under a constant schedule, then resume and wait
    assert "learning rate 0.0005" in k.ok("%megatrain lr 5e-4")
    assert "resumed" in k.ok("%megatrain resume")
    assert "'finished'" in k.ok("session.wait()", timeout=180)

    result = json.loads(k.ok("""print(json.dumps({
        "events": [[e["kind"], e["step"], e.get("value"), e.get("source")] for e in session.events],
        "lrs": [[r["step"], r["lr"]] for r in session.history], "step": session.step}))"""))
    held = int(a)
    assert result["events"] == [["pause", held, None, "magic"], ["lr", held, 5e-4, "magic"],
                                ["resume", held, None, "magic"]]
    assert result["step"] == 300
    for step, lr in result["lrs"]:
        assert lr == (1e-3 if step <= held else 5e-4), (step, lr)

    # the dashboard was published from the kernel at a bounded rate while the cells above ran
    comm_msgs = [m for m in k.iopub if m["msg_type"] == "comm_msg"]
    assert comm_msgs, "the dashboard sent nothing"
    span = max(m["_t"] for m in comm_msgs) - min(m["_t"] for m in comm_msgs)
    assert len(comm_msgs) / max(span, 1.0) < 60
    # ...and the static snapshot replaced the live summary when the run ended
    finals = [m for m in k.iopub if m["msg_type"] == "update_display_data"
              and "Static snapshot" in m["content"]["data"].get("text/html", "")]
    assert finals

    # status and report through the magic
    assert "finished" in k.ok("%megatrain status")
    report = tmp_path / "report.html"
    assert "report written" in k.ok(f"%megatrain report {report}")
    assert report.stat().st_size > 100_000

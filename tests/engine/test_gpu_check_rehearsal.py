"""benchmarks/gpu_check.py's CPU rehearsal (issue 37) keeps working: the sections that need no
CUDA (delayed-stream parity on the device, host and disk tiers; host-buffer poisoning) run on
the adversarial CPU transport, in a subprocess as CI would, and print passing RESULT lines."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), *args], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cpu_rehearsal_passes_and_prints_result_lines():
    p = _run("--cpu-rehearsal")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    names = {ln.split()[1] for ln in lines}
    assert {"rehearsal_grad_rel_err_device", "rehearsal_grad_rel_err_host", "rehearsal_grad_rel_err_disk",
            "rehearsal_poisoning_caught", "rehearsal_adversary_late_writes"} <= names
    assert "cpu rehearsal: ok" in p.stdout


def test_list_names_every_section_and_which_need_cuda(capsys):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert gpu_check.main(["--list"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    kinds = {r[0]: r[1] for r in rows}
    assert kinds["delayed-streams"] == kinds["host-poisoning"] == "cpu-rehearsal"
    assert kinds["memory"] == kinds["sanitizer"] == kinds["two-gpus"] == "cuda"

"""benchmarks/gpu_check.py survives first contact (issues 37, 45): it runs from a bare copy of the
checkout with nothing installed but torch's site-packages (``python -S``); every section also runs
on the CPU device (``--cpu-rehearsal``, in a subprocess as CI would) and prints its RESULT lines
as it ends; a section that raises prints its traceback and the others still print theirs."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _run(*args, timeout=300, env_extra=None):
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1",
               **(env_extra or {}))
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=timeout)


def _results(out: str) -> dict:
    return {ln.split()[1]: ln for ln in out.splitlines() if ln.startswith("RESULT ")}


def _sections():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return gpu_check


def test_cpu_rehearsal_runs_every_section_and_prints_result_lines():
    p = _run("--cpu-rehearsal")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    names = set(_results(p.stdout))
    assert {"rehearsal_delayed_streams_rel_err_device", "rehearsal_delayed_streams_rel_err_host",
            "rehearsal_delayed_streams_rel_err_disk", "rehearsal_poisoning_caught", "rehearsal_adversary_late_writes",
            "rehearsal_grad_rel_err_fp32", "rehearsal_grad_rel_err_bf16", "rehearsal_pinned_bytes_per_param_7b_bf16",
            "rehearsal_optimizer_adamw_params_per_s", "rehearsal_link_h2d_memcpy_gbps",
            "rehearsal_link_d2h_memcpy_gbps", "rehearsal_tflops", "rehearsal_accum_loads_per_layer",
            "rehearsal_dropout_rng_rel_err", "rehearsal_sanitizer_steps", "rehearsal_registered_exact"} <= names
    # each section's lines come right after its own header (printed as it ends, not at the end)
    blocks = p.stdout.split("\n== ")
    for name, _, _ in _sections().SECTIONS:
        block = next(b for b in blocks if b.startswith(name + ":"))
        assert name == "two-gpus" or "RESULT rehearsal_" in block, block[-2000:]
    assert "cpu rehearsal: ok" in p.stdout


def test_list_names_every_section(capsys):
    gpu_check = _sections()
    assert gpu_check.main(["--list"]) == 0
    rows = [ln.split()[0] for ln in capsys.readouterr().out.splitlines() if ln.strip() and not ln.startswith("#")]
    assert rows == [name for name, _, _ in gpu_check.SECTIONS]
    assert {"parity", "delayed-streams", "host-poisoning", "cpu-side", "memory", "sanitizer", "two-gpus"} <= set(rows)


def test_list_runs_from_a_bare_copy_of_the_checkout(tmp_path):
    """``python -S`` (no site, so no installed megatrain_nb), only torch's site-packages on the
    path, from another folder: exits 0, and the package is the copy's own."""
    copy = tmp_path / "checkout"
    files = subprocess.run(["git", "ls-files", "megatrain_nb", "benchmarks"], cwd=str(REPO), capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (copy / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, copy / f)
    site = str(Path(torch.__file__).resolve().parents[1])
    p = subprocess.run([sys.executable, "-S", str(copy / "benchmarks" / "gpu_check.py"), "--list"], cwd=str(tmp_path),
                       env={"PYTHONPATH": site, "PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "delayed-streams" in p.stdout and f"# megatrain_nb from {copy / 'megatrain_nb'}" in p.stdout


def test_an_injected_section_failure_leaves_the_other_sections_lines():
    """GPU_CHECK_FAIL=cpu-side: that section's traceback and a failure line; the sections before
    and after it print their RESULT lines; the exit status says it failed."""
    p = _run("--cpu-rehearsal", "--sections", "host-poisoning,cpu-side,registered-pinned",
             env_extra={"GPU_CHECK_FAIL": "cpu-side"})
    res = _results(p.stdout)
    assert p.returncode == 1, p.stdout[-3000:]
    assert "Traceback" in p.stdout and "injected failure of section 'cpu-side'" in p.stdout
    assert "rehearsal_section_failed_cpu_side" in res and "rehearsal_pinned_bytes_per_param_7b_bf16" not in res
    assert {"rehearsal_poisoning_caught", "rehearsal_registered_exact", "rehearsal_registered_left_after_free"} <= set(res)
    assert "sections failed ['cpu-side']" in p.stdout


def test_a_python_without_the_engines_packages_is_told_which_in_one_line(tmp_path):
    """The GPU machine may have torch and transformers only: the missing ones (xxhash here, hidden
    by a meta path finder) are named with the pip command, before any import fails deep inside."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'xxhash':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n")
    env = dict(os.environ, PYTHONPATH=str(hide))
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--list"], cwd=str(tmp_path),
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "gpu_check: this Python lacks xxhash, which the engine imports: pip install xxhash" in p.stderr

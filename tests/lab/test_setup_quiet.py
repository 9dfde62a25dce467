"""`scripts/setup.sh lab` prints only real warnings (issue 46 item 7): yarn's informational lines
(~150 "YN0013 ... error-ex / es-errors ... can't be found in the cache", matched by the old filter
for "rror") are left out; a peer-dependency warning and a failure's output are printed."""
import os
import re
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_JLPM = """#!/usr/bin/env bash
echo "➤ YN0000: ┌ Resolution step"
echo "➤ YN0000: └ Completed in 1s"
echo "➤ YN0013: │ error-ex@npm:1.3.2 can't be found in the cache and will be fetched from the remote registry"
echo "➤ YN0013: │ es-errors@npm:1.3.0 can't be found in the cache and will be fetched from the remote registry"
echo "➤ YN0007: │ core-js@npm:3.1 must be built because it never has been before or the last one failed"
echo "➤ YN0060: │ react is listed by your project with version 18, which doesn't satisfy what x requests (^17)."
echo "➤ YN0000: · Done with warnings in 7s"
exit ${FAKE_RC:-0}
"""


def _run_jlpm_install(tmp_path, rc: int) -> subprocess.CompletedProcess:
    text = (ROOT / "scripts" / "setup.sh").read_text()
    fn = re.search(r"^jlpm_install\(\) \{\n.*?^\}\n", text, re.S | re.M).group(0)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    jlpm = bin_dir / "jlpm"
    jlpm.write_text(FAKE_JLPM)
    jlpm.chmod(jlpm.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "extension").mkdir(exist_ok=True)
    script = f"set -euo pipefail\n{fn}\njlpm_install\n"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_RC=str(rc))
    return subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def test_jlpm_install_prints_the_warnings_and_nothing_informational(tmp_path):
    out = _run_jlpm_install(tmp_path, 0)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == ["    ➤ YN0060: │ react is listed by your project with version 18, which doesn't satisfy "
                     "what x requests (^17)."], lines
    assert out.stderr == ""


def test_a_failed_jlpm_install_says_so_with_its_output(tmp_path):
    out = _run_jlpm_install(tmp_path, 3)
    assert out.returncode == 3
    assert "jlpm install failed (exit 3); its output:" in out.stderr
    assert "es-errors@npm:1.3.0" in out.stderr   # the whole output, where it is needed

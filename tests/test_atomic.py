"""megatrain_nb.atomic, megatrain_nb.processes and megatrain_nb.formatting: the small shared helpers."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain_nb.atomic import atomic_dir, atomic_file, staging_dir, temp_name
from megatrain_nb.formatting import byte_scale, fmt_bytes, fmt_num, fmt_seconds
from megatrain_nb.processes import pid_alive


def test_atomic_file_modes_and_no_leftovers(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_file(tmp_path / "a.html") as f:
            f.write("<p>ü</p>")
        with atomic_file(tmp_path / "b.json", "wb", private=True, fsync=False) as f:
            f.write(b"{}")
    finally:
        os.umask(old)
    assert (tmp_path / "a.html").read_text(encoding="utf-8") == "<p>ü</p>"
    assert (tmp_path / "a.html").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.html", "b.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "r.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as f:
            f.write("half")
            raise RuntimeError("crash mid-write")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.txt"]


def test_atomic_dir_swaps_whole_folders_and_cleans_up(tmp_path):
    dst = tmp_path / "model"
    dst.mkdir()
    (dst / "old.bin").write_text("old")
    seen = []

    def write(tmp):
        seen.append(os.path.basename(tmp))
        (Path(tmp) / "new.bin").write_text("new")

    assert atomic_dir(dst, write) == str(dst)
    assert [p.name for p in dst.iterdir()] == ["new.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # neither the old copy nor the temporary
    assert seen[0].startswith(f"model.tmp-{os.getpid()}-") and temp_name(dst) != temp_name(dst)

    def fail(tmp):
        (Path(tmp) / "partial.bin").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError):
        atomic_dir(dst, fail)
    assert [p.name for p in dst.iterdir()] == ["new.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_staging_dir_is_removed_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with staging_dir(tmp_path, prefix=".x-") as tmp:
            (tmp / "f").write_text("x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_pid_alive():
    assert pid_alive(os.getpid()) is True
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert pid_alive(done.pid) is False  # reaped: gone
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped yet
        assert pid_alive(zombie.pid) is False
    finally:
        zombie.wait()
    assert pid_alive(os.getpid(), host="another-host.invalid") is None
    assert pid_alive("12") is False and pid_alive(True) is False and pid_alive(0) is False


def test_formatters():
    assert fmt_bytes(None) == "–" and fmt_bytes(float("nan")) == "–" and fmt_bytes(None, none="unlimited") == "unlimited"
    assert [fmt_bytes(n) for n in (0, 1023, 1024, 1536, 3 * 2**30, 2**41)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "3.0 GiB", "2.0 TiB"]
    assert byte_scale(5 * 2**20) == (2.0**20, "MiB") and byte_scale(10) == (1.0, "B")
    assert [fmt_seconds(s) for s in (None, 42, 187, 3725)] == ["–", "42s", "3m07s", "1h02m"]
    assert fmt_num(0.000123, ".3g") == "0.000123" and fmt_num(float("inf")) == "–" and fmt_num("x") == "–"

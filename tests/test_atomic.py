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
    assert [fmt_bytes(n, compact=True) for n in (512, 3 << 20, 1.5 * 2**30)] == ["512B", "3.0M", "1.5G"]
    assert byte_scale(5 * 2**20) == (2.0**20, "MiB") and byte_scale(10) == (1.0, "B")
    assert [fmt_seconds(s) for s in (None, 42, 187, 3725)] == ["–", "42s", "3m07s", "1h02m"]
    assert fmt_num(0.000123, ".3g") == "0.000123" and fmt_num(float("inf")) == "–" and fmt_num("x") == "–"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_save_cut_between_its_two_renames_keeps_the_old_folder(tmp_path, monkeypatch):
    from megatrain_nb import atomic

    dst = tmp_path / "ckpt"
    dst.mkdir()
    (dst / "w").write_text("old")
    real, calls = os.replace, []

    def replace(a, b):
        calls.append(b)
        if len(calls) == 2:  # the old one is aside, the new one not yet in place
            raise OSError("killed here")
        real(a, b)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(OSError):
        atomic_dir(dst, lambda tmp: (Path(tmp) / "w").write_text("new"))
    monkeypatch.setattr(atomic.os, "replace", real)
    assert (dst / "w").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_recover_interrupted_finishes_dead_writers_saves_only(tmp_path):
    from megatrain_nb.atomic import recover_interrupted

    dead, live = _dead_pid(), os.getppid()
    for name in (f"a.tmp-{dead}-0123abcd", f"b.old-{dead}-0123abcd", f"c.old-{dead}-0123abcd", "c",
                 f"d.tmp-{live}-0123abcd", "e.tmp-notapid"):
        (tmp_path / name).mkdir()
    (tmp_path / f"b.old-{dead}-0123abcd" / "w").write_text("previous")
    done = recover_interrupted(tmp_path)
    assert len(done) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "c", f"d.tmp-{live}-0123abcd", "e.tmp-notapid"]
    assert (tmp_path / "b" / "w").read_text() == "previous"  # a save that died with the old one aside

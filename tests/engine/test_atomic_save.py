"""The atomic-save helpers (megatrain_nb.atomic, used by engine.io): the old version or the new one, never half, no leftovers."""
import os

import pytest

from megatrain_nb.atomic import atomic_dir, atomic_file


def _write(name, text):
    def write(tmp):
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    return write


def test_atomic_dir_creates_and_replaces(tmp_path):
    final = tmp_path / "sub" / "ckpt"
    assert atomic_dir(final, _write("a.txt", "one")) == str(final)
    assert (final / "a.txt").read_text() == "one"
    atomic_dir(final, _write("b.txt", "two"))
    assert sorted(os.listdir(final)) == ["b.txt"]            # replaced, not merged
    assert os.listdir(final.parent) == ["ckpt"]              # no temporary or old copy left


def test_atomic_dir_failure_keeps_the_old_version(tmp_path):
    final = tmp_path / "ckpt"
    atomic_dir(final, _write("a.txt", "one"))

    def broken(tmp):
        _write("a.txt", "half")(tmp)
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        atomic_dir(final, broken)
    assert (final / "a.txt").read_text() == "one"
    assert os.listdir(tmp_path) == ["ckpt"]


def test_atomic_file_text_bytes_and_failure(tmp_path):
    path = tmp_path / "report.html"
    with atomic_file(path) as f:
        f.write("<p>one</p>")
    assert path.read_text() == "<p>one</p>"
    with atomic_file(path, "wb") as f:
        f.write(b"two")
    assert path.read_bytes() == b"two"
    with pytest.raises(RuntimeError):
        with atomic_file(path) as f:
            f.write("half")
            raise RuntimeError("stop")
    assert path.read_bytes() == b"two" and os.listdir(tmp_path) == ["report.html"]
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m

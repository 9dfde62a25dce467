"""DiskStore.link: an ordered hard link of a key's file (snapshots queue it behind the step's
writes): it sees the version written before it was issued, never one written after."""
import errno
import os

import pytest
import torch

from megatrain_nb.engine.tiers.disk_store import DiskStore, OffloadError


def test_a_link_holds_the_version_issued_before_it_whatever_is_written_after(tmp_path):
    dest = tmp_path / "snap"
    dest.mkdir()
    later = tmp_path / "later"
    later.mkdir()
    with DiskStore(tmp_path / "off") as store:
        store.write("k", {"x": torch.full((1000,), 1.0)})
        first = store.link("k", dest)            # queued behind version 1's write
        store.write("k", {"x": torch.full((1000,), 2.0)})
        second = store.link("k", later)          # behind version 2's
        store.write("k", {"x": torch.full((1000,), 3.0)})
        name, linked, copied = first.result()
        assert copied == 0 and linked == store.nbytes_of("k") and linked % 4096 == 0
        assert float(store.read_file(dest / name, "k")["x"][0]) == 1.0
        assert float(store.read_file(later / second.result()[0], "k")["x"][0]) == 2.0
        assert float(store.read("k").result()["x"][0]) == 3.0
        assert os.stat(dest / name).st_nlink == 1   # the store's file moved on: the link alone keeps v1


def test_a_link_copies_across_filesystems_and_refuses_a_key_without_a_file(tmp_path, monkeypatch):
    dest = tmp_path / "snap"
    dest.mkdir()
    with DiskStore(tmp_path / "off") as store:
        with pytest.raises(OffloadError, match="no file for 'missing'"):
            store.link("missing", dest).result()
        store.write("k", {"x": torch.arange(10.0)})

        def cross(src, dst):
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "link", cross)
        name, linked, copied = store.link("k", dest).result()
        assert linked == 0 and copied == store.nbytes_of("k")
        assert torch.equal(store.read_file(dest / name, "k")["x"], torch.arange(10.0))

"""The export's bounded overlaps: a file written through two staging buffers (direct I/O where the
filesystem takes it) holds exactly the bytes handed in; the read-ahead never holds more than its
byte budget beyond the tensor being written, and passes a failure of the source on."""
from __future__ import annotations

import pytest
import torch

from megatrain_nb.export import stream


@pytest.mark.parametrize("direct", [False, None])
def test_a_direct_file_holds_exactly_the_bytes_written(tmp_path, monkeypatch, direct):
    monkeypatch.setattr(stream, "CHUNK", 1 << 16)
    g = torch.Generator().manual_seed(0)
    pieces = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (13, 70000, 4096, 1, 200001, 7)]
    f = stream.DirectFile(str(tmp_path / "x.bin"), direct=direct)
    for p in pieces:
        f.write(p.numpy())
    f.close()
    assert (tmp_path / "x.bin").read_bytes() == b"".join(p.numpy().tobytes() for p in pieces)


def test_read_ahead_passes_errors_on():
    def failing():
        yield "a", torch.zeros(4)
        raise OSError("disk tier read failed")

    with pytest.raises(OSError, match="disk tier read failed"):
        list(stream.read_ahead(failing()))


def test_read_ahead_is_bounded_by_its_bytes():
    produced, consumed = [], []

    def source():
        for i in range(10):
            produced.append(i)
            yield str(i), torch.zeros(1000, dtype=torch.uint8)

    it = stream.read_ahead(source(), max_bytes=2000)
    name, _ = next(it)
    import time

    time.sleep(0.3)   # the producer stops at the budget: the tensor handed out and two more at most
    assert len(produced) <= 4
    consumed = [name] + [n for n, _ in it]
    assert consumed == [str(i) for i in range(10)]

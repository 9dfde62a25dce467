"""The export's bounded overlaps: a file written through its staging buffers (direct I/O where the
filesystem takes it) holds exactly the bytes handed in; the read-ahead never holds more than its
byte budget beyond the tensor being written, and passes a failure of the source on; the pieces
(units) read by several threads at once are written in order, chunk by chunk, and a failed read
stops the stream with its error."""
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


class _Ranged:
    """A ranged reader over a tensor (the disk tier's RangedRead's calls), counting its reads."""

    def __init__(self, flat, log):
        self.flat, self.log, self.next = flat, log, 0

    def read(self, name, start, out):
        assert name == "w" and start == self.next   # in order from the start
        out.copy_(self.flat[start:start + out.numel()])
        self.next += out.numel()
        self.log.append(out.numel())
        return out

    def close(self):
        self.log.append("closed")


def _flats(n_units=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(int(torch.randint(1, 3000, (1,), generator=g)), generator=g) for _ in range(n_units)]


@pytest.mark.parametrize("readers", [1, 2, 3])
def test_pieces_are_written_in_order_whatever_reads_first(monkeypatch, readers):
    monkeypatch.setattr(stream, "CHUNK", 4096)   # units of up to 12 KB: several chunks each
    flats, log = _flats(), []
    pieces = []
    for i, f in enumerate(flats):
        n = f.numel() * 4
        spans = [(0, n)] if i % 3 else [(0, n // 8 * 4), (n // 8 * 4 + 4, n)]   # a gap: 4 bytes left out
        if i % 2:
            pieces.append(stream.Piece(spans, load=lambda f=f: f))
        else:
            pieces.append(stream.Piece(spans, open=lambda f=f: _Ranged(f, log)))
    out = []
    total = stream.stream_pieces(iter(pieces), lambda b: out.append(bytes(b)), readers=readers)
    want = b"".join(f.numpy().tobytes()[a:b] for f, p in zip(flats, pieces) for a, b in p.spans)
    assert b"".join(out) == want and total == len(want)
    assert log.count("closed") == 4   # every ranged reader closed
    assert max(x for x in log if x != "closed") <= 1024   # chunk by chunk, never a unit at once


def test_a_failing_piece_stops_the_stream_with_its_error(monkeypatch):
    monkeypatch.setattr(stream, "CHUNK", 4096)

    class Broken(_Ranged):
        def read(self, name, start, out):
            raise OSError("disk tier read failed")

    flats = _flats()
    pieces = [stream.Piece([(0, f.numel() * 4)], load=lambda f=f: f) for f in flats]
    pieces[3] = stream.Piece(pieces[3].spans, open=lambda: Broken(flats[3], []))
    written = []
    with pytest.raises(OSError, match="disk tier read failed"):
        stream.stream_pieces(iter(pieces), written.append, readers=2)
    assert len(written) <= 3   # the pieces before it at most

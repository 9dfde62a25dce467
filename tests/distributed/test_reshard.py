"""Sharded checkpoints written by N ranks, read back by M (one process plays every rank; the
files and ranges are what each rank of a real run writes and reads)."""
import pytest
import torch

from megatrain_nb.engine.updates.codecs import get_codec
from megatrain_nb.engine.ranks.dist import ShardLayout
from megatrain_nb.engine.ranks.reshard import read_meta, read_rank_shards, write_rank_shards

UNITS = {"embed": 3000, "layers.0": 257, "layers.1": 4096 + 77, "head": 5}


def _full_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: {"master": torch.randn(k, generator=g), "exp_avg": torch.randn(k, generator=g) * 1e-3,
                "exp_avg_sq": torch.rand(k, generator=g) * 1e-6} for n, k in UNITS.items()}


def _stored(state: dict, codec: str) -> dict:
    """A range's tensors in stored form: fp32 master, moments fp32 or encoded."""
    out = {"master": state["master"]}
    for role in ("exp_avg", "exp_avg_sq"):
        if codec == "none":
            out[role] = state[role]
        else:
            for k, v in get_codec(codec, role).encode(state[role]).items():
                out[f"{role}.{k}"] = v
    return out


def _write(folder, world, codec, full):
    for r in range(world):
        ranges, tensors = {}, {}
        for n, k in UNITS.items():
            s, e = ShardLayout.make(k, world).bounds(r)
            ranges[n] = (k, s, e)
            tensors[n] = _stored({key: t[s:e].clone() for key, t in full[n].items()}, codec)
        write_rank_shards(folder, rank=r, world=world, codec=codec, units=ranges, tensors=tensors)


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
@pytest.mark.parametrize("old,new", [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_reshard_is_exact_in_stored_form(tmp_path, codec, old, new):
    full = _full_state()
    _write(tmp_path, old, codec, full)
    assert [m["rank"] for m in read_meta(tmp_path)] == list(range(old))
    for r in range(new):
        got = read_rank_shards(tmp_path, r, new, UNITS)
        for n, k in UNITS.items():
            s, e = ShardLayout.make(k, new).bounds(r)
            want = _stored({key: t[s:e].clone() for key, t in full[n].items()}, codec) if e > s else {}
            assert got[n].keys() == want.keys()
            for key in want:   # codes and scales equal bit for bit what encoding the new range gives
                assert torch.equal(got[n][key], want[key]), (n, key, r)


def test_incomplete_checkpoint_is_refused(tmp_path):
    _write(tmp_path, 2, "none", _full_state())
    (tmp_path / "shards-00001-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="incomplete"):
        read_meta(tmp_path)


def test_other_model_is_refused(tmp_path):
    _write(tmp_path, 2, "none", _full_state())
    with pytest.raises(ValueError, match="another model"):
        read_rank_shards(tmp_path, 0, 1, {**UNITS, "layers.0": 300})


def test_reader_slices_not_whole_files(tmp_path, monkeypatch):
    """A rank reads only its range: get_slice, never get_tensor."""
    from safetensors import safe_open

    _write(tmp_path, 1, "int8", _full_state())
    sliced = []
    orig = safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.fh = orig(*a, **k)

        def __enter__(self):
            self.inner = self.fh.__enter__()
            return self

        def __exit__(self, *exc):
            return self.fh.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def metadata(self):
            return self.inner.metadata()

        def get_slice(self, k):
            sliced.append(k)
            return self.inner.get_slice(k)

        def get_tensor(self, k):
            raise AssertionError("whole tensor read")

    monkeypatch.setattr("safetensors.safe_open", Spy)
    got = read_rank_shards(tmp_path, 1, 2, {"embed": 3000})
    assert got["embed"]["master"].numel() == 3000 - 1536 and sliced

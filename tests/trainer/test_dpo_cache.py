"""The DPO reference cache checked on read (issue 44 item 2): a payload byte flipped, a NaN, the
chosen and rejected columns swapped, another dataset's cache of the same size under this key and a
file without a checksum are each computed again with a line that says why (the log-probs equal the
first pass's); non-finite reference log-probs given in the data are refused naming the row; the
key covers the reference's weights whole (one changed element anywhere is another key)."""
import copy
import shutil
import warnings

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import megatrain_nb as mt  # noqa: E402
from megatrain_nb.trainer.data import DataError  # noqa: E402
from megatrain_nb.trainer.dpo_reference import payload_digest, weights_fingerprint  # noqa: E402

from .dpo_helpers import dpo_config, pairs, tiny_llama, tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def parts():
    tok = tokenizer()
    torch.manual_seed(0)
    return tiny_llama(len(tok)), tok


def _trainer(parts, out, rows):
    model, tok = parts
    return mt.DPOTrainer(model=copy.deepcopy(model), args=dpo_config(out, max_steps=1), train_dataset=rows,
                         processing_class=copy.deepcopy(tok), device="cpu")


def _reference(parts, out, rows):
    """(chosen, rejected, the warnings' texts, the cache file) of one trainer's reference."""
    t = _trainer(parts, out, rows)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t._ensure_reference()
        ds = t.train_dataset
        files = sorted((out / "reference_logps").glob("train-*.safetensors"))
        return (torch.tensor(ds["ref_chosen_logps"]), torch.tensor(ds["ref_rejected_logps"]),
                [str(w.message) for w in caught if "reference cache" in str(w.message)], files,
                t.reference_seconds["train"])
    finally:
        t.close()


def _read(path):
    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), f.get_tensor("chosen").clone(), f.get_tensor("rejected").clone()


@pytest.fixture(scope="module")
def first(parts, tmp_path_factory):
    out = tmp_path_factory.mktemp("first")
    c, r, said, files, seconds = _reference(parts, out, pairs(6))
    assert not said and len(files) == 1 and seconds > 0
    return out, c, r, files[0]


def _again(parts, first, tmp_path, damage):
    """A copy of the first run's output folder, its cache damaged by ``damage(path)``; the second
    reference: recomputed, equal to the first, with a line saying why."""
    src, c0, r0, f0 = first
    out = tmp_path / "o"
    shutil.copytree(src, out)
    path = out / "reference_logps" / f0.name
    damage(path)
    c, r, said, files, seconds = _reference(parts, out, pairs(6))
    assert seconds > 0, "the damaged cache was used"
    assert torch.equal(c, c0) and torch.equal(r, r0)
    assert len(said) == 1 and str(path) in said[0] and "computing the reference log-probs again" in said[0]
    meta, c1, r1 = _read(path)   # rewritten whole
    assert meta["xxh3"] == payload_digest(c1, r1) and torch.equal(c1, c0.float())
    return said[0]


def test_a_healthy_cache_is_read(parts, first, tmp_path):
    src, c0, r0, f0 = first
    shutil.copytree(src, tmp_path / "o")
    c, r, said, files, seconds = _reference(parts, tmp_path / "o", pairs(6))
    assert seconds == 0.0 and not said and torch.equal(c, c0) and torch.equal(r, r0)


@pytest.mark.parametrize("where", [0, 9, 23, 40, -1])
def test_a_flipped_payload_byte_is_recomputed(parts, first, tmp_path, where):
    def flip(path):
        data = bytearray(path.read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")   # the payload follows the header
        i = start + where if where >= 0 else len(data) - 1
        data[i] ^= 0x40
        path.write_bytes(bytes(data))

    said = _again(parts, first, tmp_path, flip)
    assert "does not match its checksum" in said


def test_a_nan_is_recomputed_and_with_a_forged_checksum_too(parts, first, tmp_path):
    def nan_kept_checksum(path):
        meta, c, r = _read(path)
        c[0] = float("nan")
        save_file({"chosen": c, "rejected": r}, str(path), metadata=meta)

    assert "does not match its checksum" in _again(parts, first, tmp_path / "a", nan_kept_checksum)

    def nan_new_checksum(path):
        meta, c, r = _read(path)
        c[2] = float("nan")
        save_file({"chosen": c, "rejected": r}, str(path), metadata={**meta, "xxh3": payload_digest(c, r)})

    assert "non-finite chosen log-prob (pair 2)" in _again(parts, first, tmp_path / "b", nan_new_checksum)


def test_swapped_columns_are_recomputed(parts, first, tmp_path):
    def swap(path):
        meta, c, r = _read(path)
        save_file({"chosen": r, "rejected": c}, str(path), metadata=meta)

    assert "does not match its checksum" in _again(parts, first, tmp_path, swap)


def test_another_datasets_cache_under_this_key_is_recomputed(parts, first, tmp_path):
    other = tmp_path / "other"
    rows = pairs(6)
    for row in rows:   # six other pairs: a cache of the same size
        row["chosen"][0]["content"] += " indeed"
    _c, _r, _said, files, _s = _reference(parts, other, rows)

    def foreign(path):
        assert files[0].stat().st_size == path.stat().st_size and files[0].name != path.name
        shutil.copyfile(files[0], path)

    said = _again(parts, first, tmp_path, foreign)
    assert "was written for other data" in said


def test_a_cache_without_a_checksum_is_recomputed(parts, first, tmp_path):
    def old(path):
        _meta, c, r = _read(path)
        save_file({"chosen": c, "rejected": r}, str(path))

    assert "has no checksum" in _again(parts, first, tmp_path, old)


def test_the_key_covers_every_reference_weight(parts):
    model, _tok = parts
    m = copy.deepcopy(model)
    before = weights_fingerprint(m)
    with torch.no_grad():
        w = m.model.layers[0].mlp.up_proj.weight
        w.view(-1)[w.numel() // 2 + 7] += 1e-3   # not one of 64 evenly spaced samples
    assert weights_fingerprint(m) != before and weights_fingerprint(copy.deepcopy(model)) == before


def test_a_nan_reference_column_in_the_data_is_refused_naming_the_row(parts, tmp_path):
    """It stopped the run at step 1 advising a lower learning rate."""
    rows = pairs(6)
    for i, row in enumerate(rows):
        row["ref_chosen_logps"], row["ref_rejected_logps"] = -10.0 - i, -12.0 - i
    rows[4]["ref_chosen_logps"] = float("nan")
    t = _trainer(parts, tmp_path, rows)
    try:
        with pytest.raises(DataError, match=r"train_dataset row 4: its ref_chosen_logps is not finite"):
            t.train()
        assert t.state.global_step == 0
    finally:
        t.close()

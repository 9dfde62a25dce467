"""Checkpoint integrity: a flipped byte, a truncation or a garbled header is refused before
anything is loaded, naming the file and the checkpoint to fall back to; nothing in a checkpoint
is unpickled."""
import json
import os
import pickle

import pytest
import torch

from megatrain_nb.trainer import Trainer, checkpoint as ckpt
from megatrain_nb.manifest import IntegrityError

from .helpers import args, micro_model, token_dataset


def _trainer(out, **kw):
    torch.set_num_threads(1)
    a = args(out, max_steps=4, save_strategy="steps", save_steps=2, **kw)
    return Trainer(model=micro_model(), train_dataset=token_dataset(12), args=a, device="cpu",
                   optimizer_compression="int8")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity") / "run"
    tr = _trainer(out)
    tr.train()
    tr.close()
    return out


def _copy(saved, tmp_path):
    import shutil
    dst = tmp_path / "run"
    shutil.copytree(saved, dst)
    return dst


def _big_files(folder):
    return sorted((p for p in folder.iterdir() if p.suffix == ".safetensors"), key=lambda p: p.stat().st_size)


def test_a_checkpoint_carries_a_manifest_that_verifies(saved):
    c4 = saved / "checkpoint-4"
    m = json.loads((c4 / "manifest.json").read_text())
    assert set(m["files"]) == {p.name for p in c4.iterdir() if p.name != "manifest.json"}
    assert ckpt.verify(c4) is True


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_damaged_weights_or_states_are_refused_naming_the_file_and_the_previous_checkpoint(saved, tmp_path, damage):
    out = _copy(saved, tmp_path)
    files = _big_files(out / "checkpoint-4")
    assert any("optimizer" in p.name for p in files) and any("model" in p.name for p in files)
    for victim in files:
        data = bytearray(victim.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0x01
        elif damage == "truncate":
            data = data[:-100]
        else:
            data[0:8] = b"\xff" * 8  # the safetensors header length
        victim.write_bytes(bytes(data))
        tr = _trainer(out)
        with pytest.raises(IntegrityError) as e:
            tr.train(resume_from_checkpoint=True)
        tr.close()
        msg = str(e.value)
        assert victim.name in msg and str(out / "checkpoint-2") in msg, msg
        (out / "checkpoint-4" / victim.name).write_bytes((saved / "checkpoint-4" / victim.name).read_bytes())


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/megatrain_nb_pwned_$PPID",))


@pytest.mark.parametrize("name", ["scheduler.pt", "rng_state.pth"])
def test_a_crafted_pickle_in_an_old_style_checkpoint_is_never_run(saved, tmp_path, name):
    out = _copy(saved, tmp_path)
    c4 = out / "checkpoint-4"
    stem = name.split(".")[0]
    (c4 / f"{stem}.json").unlink()
    (c4 / name).write_bytes(pickle.dumps({"scheduler": _Boom()}))
    ckpt.write_manifest(c4)  # a crafted checkpoint comes with a matching manifest
    marker = f"/tmp/megatrain_nb_pwned_{os.getpid()}"
    tr = _trainer(out)
    with pytest.raises(ckpt.CheckpointError, match="cannot be loaded safely"):
        tr.train(resume_from_checkpoint=str(c4))
    tr.close()
    assert not os.path.exists(marker)


def test_old_style_plain_pickles_still_load_with_weights_only(saved, tmp_path):
    out = _copy(saved, tmp_path)
    c4 = out / "checkpoint-4"
    sched = ckpt.read_json(c4 / "scheduler.json")
    (c4 / "scheduler.json").unlink()
    torch.save(sched, c4 / "scheduler.pt")
    assert ckpt.read_scheduler_state(c4) == sched


def test_rng_state_round_trips_through_json():
    import random

    import numpy as np
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    state = json.loads(json.dumps(ckpt.rng_state()))
    a = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    ckpt.set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == a


def _folder(tmp_path, sizes=(300_000, 70_000, 0)):
    d = tmp_path / "ck"
    d.mkdir()
    for i, n in enumerate(sizes):
        (d / f"f{i}.bin").write_bytes(os.urandom(n))
    return d


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256", "blake2b"])
def test_every_piece_of_a_chunked_manifest_is_checked(tmp_path, algorithm):
    from megatrain_nb import manifest as mf

    d = _folder(tmp_path)
    m = mf.write_manifest(d, algorithm=algorithm, chunk=64 << 10)  # f0 in 5 pieces
    assert m["algorithm"] == algorithm and len(m["files"]["f0.bin"]["chunks"]) == 5
    assert mf.verify_manifest(d)
    good = (d / "f0.bin").read_bytes()
    for at in (0, (64 << 10) - 1, 64 << 10, 200_000, len(good) - 1):  # each piece, its edges
        bad = bytearray(good)
        bad[at] ^= 0x40
        (d / "f0.bin").write_bytes(bytes(bad))
        with pytest.raises(IntegrityError, match="f0.bin.*does not match its checksum"):
            mf.verify_manifest(d)
    (d / "f0.bin").write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # same size, last byte changed
    with pytest.raises(IntegrityError, match="f0.bin"):
        mf.verify_manifest(d)
    (d / "f0.bin").write_bytes(good[: 64 << 10])  # truncated on a piece boundary
    with pytest.raises(IntegrityError, match="f0.bin.*truncated"):
        mf.verify_manifest(d)
    (d / "f0.bin").write_bytes(good)
    assert mf.verify_manifest(d)


def test_format_1_manifests_written_before_stay_verifiable(tmp_path):
    import hashlib

    from megatrain_nb import manifest as mf

    d = _folder(tmp_path)
    files = {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(d.iterdir())}
    (d / "manifest.json").write_text(json.dumps({"format": 1, "algorithm": "sha256", "files": files}))
    assert mf.verify_manifest(d)
    data = bytearray((d / "f1.bin").read_bytes())
    data[5] ^= 1
    (d / "f1.bin").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="f1.bin.*does not match"):
        mf.verify_manifest(d)


@pytest.mark.parametrize("edit", [{"algorithm": "md5"}, {"format": 9}, {"chunk_bytes": 0}])
def test_a_manifest_naming_an_unknown_algorithm_or_format_is_refused(tmp_path, edit):
    from megatrain_nb import manifest as mf

    d = _folder(tmp_path)
    m = mf.write_manifest(d)
    (d / "manifest.json").write_text(json.dumps({**m, **edit}))
    with pytest.raises(IntegrityError, match="manifest.json is damaged"):
        mf.verify_manifest(d)


def test_a_folder_excluded_from_the_manifest_is_recorded_and_only_it_is_let_through(tmp_path):
    """A snapshot leaves its hard links to the disk tier's files (which carry their own
    checksums) out of its manifest: those pass verification, an unlisted file elsewhere does not."""
    from megatrain_nb import manifest as mf

    d = _folder(tmp_path)
    (d / "disk").mkdir()
    (d / "disk" / "u0.mtd").write_bytes(b"linked")
    m = mf.write_manifest(d, exclude=("disk",))
    assert m["excluded"] == ["disk"] and "disk/u0.mtd" not in m["files"]
    assert mf.verify_manifest(d)
    (d / "diskette.bin").write_bytes(b"x")   # a name that only starts like the folder
    with pytest.raises(IntegrityError, match="diskette.bin.*not listed"):
        mf.verify_manifest(d)
    (d / "diskette.bin").unlink()
    mf.write_manifest(d)   # nothing excluded: the linked file must be listed
    (d / "disk" / "u1.mtd").write_bytes(b"added")
    with pytest.raises(IntegrityError, match="u1.mtd.*not listed"):
        mf.verify_manifest(d)


def _flip_weights(c):
    w = next(p for p in c.iterdir() if p.name.startswith("model") and p.suffix == ".safetensors")
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 0x01
    w.write_bytes(bytes(data))
    return w


def test_a_checkpoint_stripped_of_its_manifest_is_refused_naming_it_and_the_previous_one(saved, tmp_path):
    out = _copy(saved, tmp_path)
    c4 = out / "checkpoint-4"
    (c4 / "manifest.json").unlink()
    _flip_weights(c4)
    tr = _trainer(out)
    with pytest.raises(IntegrityError) as e:
        tr.train(resume_from_checkpoint=True)
    tr.close()
    msg = str(e.value)
    assert "no manifest.json" in msg and str(c4) in msg and str(out / "checkpoint-2") in msg, msg
    assert "seal(" in msg, msg   # the documented opt-out for a checkpoint made by hand


def test_a_file_whose_manifest_entry_was_removed_is_refused(saved, tmp_path):
    out = _copy(saved, tmp_path)
    c4 = out / "checkpoint-4"
    w = _flip_weights(c4)
    m = json.loads((c4 / "manifest.json").read_text())
    del m["files"][w.name]
    m.pop("self_xxh3_128")   # (as a manifest written before manifests checked themselves)
    (c4 / "manifest.json").write_text(json.dumps(m))
    tr = _trainer(out)
    with pytest.raises(IntegrityError, match=rf"{w.name}.*not listed in its manifest.json"):
        tr.train(resume_from_checkpoint=True)
    tr.close()
    (c4 / "extra.bin").write_bytes(b"x")   # a file added later is refused the same way
    ckpt.seal(c4, reseal=True)   # (its manifest does not verify: only an explicit reseal overwrites it)
    (c4 / "added.txt").write_text("later")
    with pytest.raises(IntegrityError, match="added.txt.*not listed"):
        ckpt.verify(c4)


def test_sealing_a_hand_made_checkpoint_is_the_explicit_way_to_resume_it(saved, tmp_path):
    out = _copy(saved, tmp_path)
    c4 = out / "checkpoint-4"
    (c4 / "manifest.json").unlink()
    with pytest.raises(IntegrityError):
        ckpt.verify(c4)
    ckpt.seal(c4)
    tr = _trainer(out)
    tr.train(resume_from_checkpoint=str(c4))   # max_steps=4: resumes at 4 and ends
    assert tr.state.global_step == 4
    tr.close()


@pytest.mark.parametrize("record", [True, False])
def test_a_checkpoint_of_another_model_is_refused_naming_the_model_that_wrote_it(tmp_path, record):
    torch.set_num_threads(1)
    out = tmp_path / "run"
    a = args(out, max_steps=2, save_strategy="steps", save_steps=2)
    tr = Trainer(model=micro_model(layers=3), train_dataset=token_dataset(12), args=a, device="cpu")
    tr.train()
    tr.close()
    c2 = out / "checkpoint-2"
    meta = json.loads((c2 / "megatrain_state.json").read_text())
    assert meta["model"]["describe"]["num_hidden_layers"] == 3
    if not record:   # a checkpoint without the record (made by hand): its weights file is checked
        del meta["model"]
        (c2 / "megatrain_state.json").write_text(json.dumps(meta))
        ckpt.seal(c2, reseal=True)
    a = args(out, max_steps=4, save_strategy="no")
    tr = Trainer(model=micro_model(layers=2), train_dataset=token_dataset(12), args=a, device="cpu")
    with pytest.raises(ckpt.CheckpointError) as e:
        tr.train(resume_from_checkpoint=str(c2))
    tr.close()
    msg = str(e.value)
    assert str(c2) in msg and "layers.2." in msg and "this model does not have" in msg, msg
    if record:
        assert "num_hidden_layers=3" in msg and "num_hidden_layers=2" in msg, msg


def test_a_checkpoint_with_a_parameter_of_another_shape_is_refused(tmp_path):
    from megatrain_nb.model_configs import preset_config
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    out = tmp_path / "run"
    tr = Trainer(model=micro_model(), train_dataset=token_dataset(12), device="cpu",
                 args=args(out, max_steps=2, save_strategy="steps", save_steps=2))
    tr.train()
    tr.close()
    torch.manual_seed(0)
    wider = AutoModelForCausalLM.from_config(preset_config("micro", num_hidden_layers=2, intermediate_size=96))
    tr = Trainer(model=wider, train_dataset=token_dataset(12), device="cpu", args=args(out, max_steps=4))
    with pytest.raises(ckpt.CheckpointError, match=r"differ in shape.*mlp"):
        tr.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    tr.close()


def test_the_engine_checks_a_trainer_checkpoint_before_loading_it(saved, tmp_path):
    """StreamingEngine.load_checkpoint on a Trainer checkpoint reads its manifest first."""
    out = _copy(saved, tmp_path)
    victim = [p for p in _big_files(out / "checkpoint-4") if "model" in p.name][0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    tr = _trainer(tmp_path / "other")
    before = {k: v.clone() for k, v in tr.engine.state_dict().items()}
    with pytest.raises(IntegrityError, match=victim.name):
        tr.engine.load_checkpoint(str(out / "checkpoint-4"))
    after = tr.engine.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    tr.close()


def test_a_load_that_fails_part_way_leaves_nothing_to_train_or_save_on(saved, tmp_path, monkeypatch):
    tr = _trainer(tmp_path / "other")
    e = tr.engine
    real, calls = e.weights.overwrite, []

    def overwrite(unit, flat):
        calls.append(unit.name)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real(unit, flat)
    monkeypatch.setattr(e.weights, "overwrite", overwrite)
    with pytest.raises(OSError):
        e.load_checkpoint(str(saved / "checkpoint-4"))
    for use in (lambda: e.save_pretrained(str(tmp_path / "m")), lambda: e.state_dict(), lambda: tr.train()):
        with pytest.raises(RuntimeError, match="failed part way"):
            use()
    monkeypatch.setattr(e.weights, "overwrite", real)
    e.load_checkpoint(str(saved / "checkpoint-4"))   # a load that succeeds repairs it
    assert e.state_dict()
    tr.close()


def test_seal_refuses_a_folder_whose_manifest_does_not_verify(saved, tmp_path):
    """Issue 33 item 7: seal() overwrote the manifest of a damaged checkpoint megatrain wrote."""
    out = _copy(saved, tmp_path)
    c4 = out / "checkpoint-4"
    before = (c4 / "manifest.json").read_text()
    assert ckpt.seal(c4) == json.loads(before)   # a manifest that verifies: left as it is
    w = _flip_weights(c4)
    with pytest.raises(ckpt.CheckpointError, match=rf"seal\(.*\) refused: it has a manifest.json and it does not "
                                                   rf"verify.*{w.name}.*reseal=True"):
        ckpt.seal(c4)
    assert (c4 / "manifest.json").read_text() == before
    with pytest.raises(IntegrityError):
        ckpt.verify(c4)
    ckpt.seal(c4, reseal=True)   # said explicitly: the files as they are now
    assert ckpt.verify(c4)


@pytest.mark.parametrize("text", ["{}", "[1, 2]", "not json", '{"scheduler": 3}', '{"scheduler": {}, "override": 5}'])
def test_a_garbage_scheduler_file_is_named_by_seal_and_by_the_resume(saved, tmp_path, text):
    out = _copy(saved, tmp_path)
    c4 = out / "checkpoint-4"
    (c4 / "scheduler.json").write_text(text)
    with pytest.raises(ckpt.CheckpointError, match="scheduler.json"):
        ckpt.seal(c4, reseal=True)
    with pytest.raises(ckpt.CheckpointError, match="scheduler.json"):
        ckpt.read_scheduler_state(c4)

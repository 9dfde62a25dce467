"""Issue 44: a snapshot is checked by content at every load, and a load never tears the live state
(item 1); each disk-tier file is bound to its snapshot, so another step's file of the same unit
put in its place is refused at rewind, fork and a fresh Session's resume (item 3)."""
import glob
import os
import shutil
import time

import pytest
import torch
from transformers import TrainerCallback

from nb_fakes import close_sessions
from test_branches import _args, _dataset
from test_snapshot_damage import _everything, _same

DISK = {"offload_params": True, "optimizer_compression": "int8", "host_cache_gb": 0}
BOUND = 120


def _session(tmp_path, out, **kw):
    from transformers import AutoModelForCausalLM

    from megatrain_nb.model_configs import preset_config
    from megatrain_nb.notebook import Session

    torch.manual_seed(0)
    return Session(AutoModelForCausalLM.from_config(preset_config("micro")), train_dataset=_dataset(),
                   args=_args(tmp_path / out, **kw), snapshot_steps=2, offload_dir=str(tmp_path / f"{out}-off"),
                   name=out, **DISK)


class _PauseAt(TrainerCallback):
    """Pauses the session at the end of ``step`` (the pause applies at that step's boundary)."""

    def __init__(self, session, step):
        self.session, self.step, self.armed = session, step, False

    def on_step_end(self, args, state, control, **kw):
        if self.armed and state.global_step == self.step:
            self.armed = False
            self.session.pause()


def _flip_inside_payload(path):
    """Flip one byte in the middle of the file's first tensor, its mtime restored (as bit rot)."""
    from megatrain_nb.engine.tiers.disk_format import IO_CHUNK, read_header

    st = os.stat(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        header = read_header(fd, _key_in(path), path, memoryview(bytearray(IO_CHUNK)))
    finally:
        os.close(fd)
    entry = max(header["tensors"], key=lambda e: e["nbytes"])
    at = entry["offset"] + entry["nbytes"] // 2
    original = open(path, "rb").read()
    damaged = bytearray(original)
    damaged[at] ^= 0x5A
    with open(path, "r+b") as f:   # in place: the same inode, size and (restored) times
        f.write(bytes(damaged))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return original, st


def _restore(path, original, st):
    with open(path, "r+b") as f:
        f.write(original)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _key_in(path):
    import json
    import struct

    with open(path, "rb") as f:
        head = f.read(4096)
    _, length, _ = struct.unpack_from("<8sQI", head, 0)
    with open(path, "rb") as f:
        f.seek(struct.calcsize("<8sQI"))
        return json.loads(f.read(length))["key"]


def test_a_rewind_to_a_rotted_snapshot_keeps_the_live_state_and_trains_on(tmp_path):
    """Item 1: rewind(2), train to step 6, one byte flipped inside step 2's Adam file (then a
    weights file), mtime restored: the next rewind(2) is refused naming the file, before anything
    is touched. A load that fails part way anyway (an I/O error after the check) puts the live
    state back. Either way the session trains on from step 6 and ends where an undamaged run does."""
    s = _session(tmp_path, "rot", max_steps=8)
    try:
        s.train(block=True)
        want_loss = {r["step"]: r["loss"] for r in s.history}
        want = {k: v.clone() for k, v in s.engine.state_dict().items()}
        pause = _PauseAt(s, 6)
        s.trainer.add_callback(pause)
        s.rewind(2)                                   # (the old check cached this folder's stamp here)
        pause.armed = True
        s.train()
        end = time.monotonic() + BOUND
        while not (s.state == "paused" and s.step == 6 and s.history and s.history[-1]["step"] == 6):
            assert time.monotonic() < end and s.state in ("running", "paused"), (s.state, s.step)
            time.sleep(0.05)
        s.trainer.wait_snapshot()                     # (step 6's, completing in the background)
        before = _everything(s)
        snap = [i for i in s.snapshots if i.step == 2 and not i.damaged][0]
        for pattern in ("disk/adam-00001*", "disk/weights-00002*"):
            [victim] = glob.glob(os.path.join(snap.path, pattern))
            original, st = _flip_inside_payload(victim)
            try:
                with pytest.raises(ValueError) as err:
                    s.rewind(2)
                assert os.path.basename(victim) in str(err.value), str(err.value)
                _same(_everything(s), before)
                assert s.state == "paused" and s.step == 6
            finally:
                _restore(victim, original, st)
                from megatrain_nb.trainer import snapshot

                snapshot._DAMAGED.clear()
        _a_load_failing_part_way_puts_the_state_back(s, before)
        s.resume()
        assert s.wait(timeout=BOUND) == "finished" and s.step == 8
        assert {r["step"]: r["loss"] for r in s.history if r["step"] > 6} == {7: want_loss[7], 8: want_loss[8]}
        got = s.engine.state_dict()
        for k in want:
            assert torch.equal(got[k], want[k]), k
    finally:
        close_sessions([s], timeout=30)


def _a_load_failing_part_way_puts_the_state_back(s, before):
    from megatrain_nb.engine.tiers.linked import LoadUndone

    disk = s.engine.disk
    real, calls = disk.read_file, []

    def flaky(path, key):
        calls.append(key)
        if len(calls) == 3:   # the third file read of the load: two units are loaded already
            raise OSError(5, "Input/output error (injected)")
        return real(path, key)

    disk.read_file = flaky
    try:
        with pytest.raises(LoadUndone, match="put back") as err:
            s.rewind(2)
        assert "Input/output error" in str(err.value)
    finally:
        del disk.read_file
    assert len(calls) > 3   # the load went part way, then the kept state was read back
    _same(_everything(s), before)
    assert s.state == "paused" and s.step == 6
    s.engine.named_parameters()   # not torn: weights are handed out


def test_a_disk_tier_file_of_another_step_is_refused_at_rewind_fork_and_resume(tmp_path):
    """Item 3: step 4's Adam file of a unit copied over step 2's (same name, a valid file of its
    own) mixed step-2 weights with step-4 moments at rewind, fork and a fresh Session's resume."""
    s = _session(tmp_path, "mix", max_steps=4)
    fresh = None
    try:
        s.train(block=True)
        infos = {i.step: i for i in s.snapshots}
        [mine] = glob.glob(os.path.join(infos[2].path, "disk", "adam-00001*"))
        [other] = glob.glob(os.path.join(infos[4].path, "disk", os.path.basename(mine)))
        os.unlink(mine)                   # (a hard link: replace the name, not the shared bytes)
        shutil.copyfile(other, mine)
        name = os.path.basename(mine)
        before = _everything(s)
        with pytest.raises(ValueError, match=name) as err:
            s.rewind(2)
        assert "linked.json" in str(err.value) and "another step" in str(err.value)
        _same(_everything(s), before)
        with pytest.raises(ValueError, match=name):
            s.fork(step=2, name="mixed")
        fresh = _session(tmp_path, "mix", max_steps=6, resume_from_checkpoint=infos[2].path)
        with pytest.raises(ValueError, match=name):
            fresh.train(block=True)
        os.unlink(os.path.join(infos[4].path, "megatrain_state.json"))   # item 9: listed damaged, not gone
        [listed] = [i for i in s.snapshots if i.path == infos[4].path]
        assert listed.step == 4 and "megatrain_state.json" in listed.damaged and "missing" in listed.damaged
    finally:
        close_sessions([x for x in (s, fresh) if x is not None], timeout=30)

"""``trainer.export(path, format=..., dtype=...)`` and ``session.export(...)`` (API.md): the same
files as ``mt.export``; a Session's export holds its run for a snapshot only -- the run trains (or,
paused, resumes and trains) while the export writes."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import megatrain_nb as mt
from megatrain_nb.export import safetensors_out

from . import helpers as h

pytestmark = pytest.mark.slow


def test_trainer_export_writes_what_mt_export_writes(tmp_path):
    t = h.trained("llama", tmp_path)
    try:
        a, b = t.export(tmp_path / "a"), mt.export(t, tmp_path / "b")
        sa, sb = load_file(f"{a}/model.safetensors"), load_file(f"{b}/model.safetensors")
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        assert all(torch.equal(sa[k], v) for k, v in t.engine.state_dict().items())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t.export(tmp_path / "m.gguf", format="gguf", dtype="f32")
            m = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
        ids = h.batch()
        with torch.no_grad():
            assert h.max_rel_err(m(ids).logits, t.engine.forward_logits(ids)) <= 1e-4
        with pytest.raises(ValueError, match="format='onnx'"):
            t.export(tmp_path / "x", format="onnx")
        with pytest.raises(ValueError, match="applies to format='gguf'"):
            t.export(tmp_path / "x", dtype="f16")
    finally:
        t.close()


def _writes_only_after(monkeypatch, proceed):
    """The export's weights are written only once ``proceed()`` (run in the export's thread) returns."""
    original = safetensors_out.write_config_files
    seen = {}

    def gated(src, target, dtype="float32"):
        seen["value"] = proceed()
        return original(src, target, dtype)

    monkeypatch.setattr(safetensors_out, "write_config_files", gated)
    return seen


@pytest.mark.parametrize("state", ["running", "paused"])
def test_a_session_export_holds_the_run_for_a_snapshot_only(tmp_path, monkeypatch, state):
    from megatrain_nb.notebook import Session

    s = Session(h.model("llama"), train_dataset=Dataset.from_list(h.rows(n=64)), tokenizer=h.tokenizer(),
                args=h.args(tmp_path / "out", max_steps=400))
    try:
        s.train()
        assert s.wait(until_step=2, timeout=120) == "running"
        if state == "paused":
            s.pause()
            deadline = threading.Event()
            while s.state != "paused" and not deadline.wait(0.05):
                pass
            assert s.state == "paused"

        def trained_on():   # inside the export, after its snapshot: the run goes on
            (snap,) = s.snapshots
            if state == "paused":
                s.resume()
            return snap.step, s.wait(until_step=snap.step + 2, timeout=120), s.step

        seen = _writes_only_after(monkeypatch, trained_on)
        out = s.export(tmp_path / "live")
        snap_step, waited, step_then = seen["value"]
        assert waited == "running" and step_then >= snap_step + 2   # trained two steps during the export
        s.pause()
        s.rewind(snap_step)   # the project's own loader puts the snapshot's weights back
        want = {k: v.clone() for k, v in s.engine.state_dict().items()}
        got = load_file(f"{out}/model.safetensors")
        assert want.keys() <= got.keys() and all(torch.equal(got[k], v) for k, v in want.items())
        s.stop()
    finally:
        s.close()

"""EngineConfig(optimizer_compression="auto"): the engine builds with the codec the planner picks
(planning/codec_choice.py), says which and why (``engine.codec``, the config, the plan's
``chosen_by``), and a resume keeps the checkpoint's codec (docs/TIERS.md)."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.planning.codec_choice import checkpoint_codec
from megatrain_nb.engine.planning.plan_pick import PLAN_BY_ENV

from .test_prediction import rates

#: 2.1M parameters; the host budgets (GB) under which the rules pick int8 / fp32 states in RAM
#: (probed with codec_choice.engine_codec: fp32 needs ~0.035, int8 ~0.025 with small update chunks)
TIGHT, ROOMY = 0.029, 0.2
CHUNK = {"update_chunk_numel": 1 << 14}


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512)
    return AutoModelForCausalLM.from_config(cfg)


def _engine(compression, host_gb, seed=0, **kw):
    return StreamingEngine(_model(seed), EngineConfig(device="cpu", optimizer_compression=compression,
                                                      max_host_gb=host_gb, overrides=CHUNK), **kw)


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, 512, (2, 16), generator=g)


def _train(engine, steps, start=0):
    for i in range(start, start + steps):
        engine.forward_backward(_batch(i))
        engine.optimizer_step(lr=1e-3)
        engine.zero_grad()


def _state_bytes(engine):
    """(bytes of the stored states, their dtypes) as the states hold them in RAM."""
    tensors = [t for s in engine.states.ram.values() for t in s.values()]
    return sum(t.numel() * t.element_size() for t in tensors), {t.dtype for t in tensors}


def _trained_numel(engine):
    return sum(u.train_numel for u in engine.state_units)


@pytest.mark.slow   # (builds engines and trains: seconds)
def test_tight_host_budget_picks_int8_and_stores_int8():
    with _engine("auto", TIGHT) as e:
        assert e.config.optimizer_compression == "int8"   # what the parts, the states and checkpoints use
        assert (e.codec.asked, e.codec.codec, e.codec.by, e.codec.states_on_disk) == ("auto", "int8", "rules", False)
        assert "fp32 (exact) optimizer states in host RAM" in e.codec.reason   # the one it passed over
        assert "optimizer_compression='auto'" in e.plan.chosen_by and "codec int8" in e.plan.chosen_by
        _train(e, 1)
        nbytes, dtypes = _state_bytes(e)
        n = _trained_numel(e)
        assert torch.int8 in dtypes or torch.uint8 in dtypes
        assert torch.float32 not in dtypes or nbytes < 3 * n   # codes + per-block scales, not 8 B/param
        assert 2 * n <= nbytes < 3 * n
        assert e.memory_report()["host"]["optimizer_states"] >= nbytes


@pytest.mark.slow   # (builds engines and trains: seconds)
def test_roomy_host_budget_picks_fp32_bit_identical_to_none():
    with _engine("auto", ROOMY) as auto, _engine("none", ROOMY) as plain:
        assert auto.config.optimizer_compression == "none"
        assert (auto.codec.codec, auto.codec.by) == ("none", "rules")
        assert "the rules' first choice, it fits" in auto.codec.reason
        assert plain.codec.asked == "none" and plain.codec.by == "given"
        _train(auto, 3)
        _train(plain, 3)
        nbytes, dtypes = _state_bytes(auto)
        assert dtypes == {torch.float32} and nbytes == 8 * _trained_numel(auto)
        a, b = dict(auto.named_parameters()), dict(plain.named_parameters())
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("bad", ["int7", "Automatic", 3, "fp16"])
def test_bad_values_refused_with_the_allowed_ones(bad):
    with pytest.raises(ValueError) as info:
        EngineConfig(optimizer_compression=bad)
    msg = str(info.value)
    for allowed in ("'none'", "'int8'", "'int4'", "'auto'", "True", "False"):
        assert allowed in msg, (allowed, msg)


def test_auto_spelled_loosely_and_a_codec_named_stays():
    assert EngineConfig(optimizer_compression=" AUTO ").optimizer_compression == "auto"
    assert EngineConfig(optimizer_compression=True).optimizer_compression == "int8"


@pytest.mark.slow   # (builds engines and trains: seconds)
def test_resume_with_auto_keeps_the_checkpoints_codec(tmp_path):
    ckpt = tmp_path / "ckpt"
    with _engine("auto", TIGHT) as first:
        _train(first, 2)
        first.save_checkpoint(str(ckpt))
        _train(first, 2, start=2)
        want = dict(first.named_parameters())
    assert checkpoint_codec(ckpt) == "int8"   # the checkpoint records the codec picked, not "auto"
    # the roomy budget alone would pick fp32 states, whose load refuses the int8 checkpoint by name
    with _engine("auto", ROOMY, seed=1) as repick:
        assert repick.config.optimizer_compression == "none"
        with pytest.raises(ValueError, match="optimizer_compression='int8'"):
            repick.load_checkpoint(str(ckpt))
    # given the checkpoint, "auto" keeps its codec: the resumed run continues bit for bit
    with _engine("auto", ROOMY, seed=1, codec_from=ckpt) as resumed:
        assert resumed.config.optimizer_compression == "int8"
        assert (resumed.codec.asked, resumed.codec.by) == ("auto", "checkpoint")
        resumed.load_checkpoint(str(ckpt))
        _train(resumed, 2, start=2)
        got = dict(resumed.named_parameters())
    for k in want:
        assert torch.equal(want[k], got[k]), k


@pytest.mark.slow   # (builds engines and trains: seconds)
def test_codec_from_leaves_a_named_codec_alone(tmp_path):
    ckpt = tmp_path / "ckpt"
    with _engine("int8", ROOMY) as e:
        _train(e, 1)
        e.save_checkpoint(str(ckpt))
    with _engine("none", ROOMY, codec_from=ckpt) as e:
        assert e.config.optimizer_compression == "none" and e.codec.by == "given"


@pytest.mark.slow   # (builds engines and trains: seconds)
def test_a_linked_checkpoint_records_the_codec_picked_too(tmp_path):
    ckpt = tmp_path / "linked"
    with StreamingEngine(_model(), EngineConfig(device="cpu", optimizer_compression="int8", offload_dir=tmp_path / "d",
                                                keep_offload_files=True)) as e:
        _train(e, 1)
        e.save_checkpoint(str(ckpt), link_disk=True)
    assert (ckpt / "linked.json").is_file() and checkpoint_codec(ckpt) == "int8"
    assert checkpoint_codec(tmp_path) is None   # no checkpoint here: "auto" picks afresh


@pytest.mark.slow   # (builds engines: seconds)
def test_with_rates_the_fastest_predicted_codec_unless_the_rules_are_within_the_margin(monkeypatch, tmp_path):
    monkeypatch.delenv(PLAN_BY_ENV, raising=False)   # (the suite plans by the rules)
    # a disk tier (the states go there): the rules take int8 on it; a codec far slower than a fast
    # disk makes fp32 states there predicted faster (in RAM fp32 is never slower: no codec work)
    slow_codec = rates(device="cpu", codec_per_thread={"int8": 1e5, "int4": 1e5}, disk_read=100e9, disk_write=100e9)
    cfg = dict(device="cpu", optimizer_compression="auto", max_host_gb=ROOMY, offload_dir=tmp_path, overrides=CHUNK)
    with StreamingEngine(_model(), EngineConfig(rates=slow_codec, **cfg)) as e:
        assert (e.config.optimizer_compression, e.codec.by, e.codec.states_on_disk) == ("none", "prediction", True)
        assert "the fastest predicted" in e.codec.reason and "codec none" in e.plan.chosen_by
        assert e.plan.placement["optimizer_states"] == "disk"
    # the same rates under plan_by="rules": the rules' int8 on the disk tier
    rules = {**cfg, "overrides": {**CHUNK, "plan_by": "rules"}}
    with StreamingEngine(_model(), EngineConfig(rates=slow_codec, **rules)) as e:
        assert (e.config.optimizer_compression, e.codec.by) == ("int8", "rules")
    # nothing much faster: the rules' pick stays
    with StreamingEngine(_model(), EngineConfig(rates=rates(device="cpu"), **cfg)) as e:
        assert (e.config.optimizer_compression, e.codec.by) == ("int8", "rules")

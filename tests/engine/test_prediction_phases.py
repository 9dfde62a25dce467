"""The phases issue 45 added to the engine, counted by the plan and the prediction (arithmetic on
made-up rates, nothing timed): the compute-dtype shadow each update writes (its cast in the update
chain, its pinned bytes in the host plan, as ``host_store.pinned_layout`` counts them), the disk
tier's bf16 copy written by the updates (the transport's cast of each load behind a host cache),
and the tiled MLP's second forward only where the
plan tiles (``tiling.tile_tokens_for``: where a micro-batch's MLP does not fit)."""
import pytest

from megatrain_nb.engine.planning.prediction import CAST_VS_ADAMW
from megatrain_nb.engine.tiers.host_store import pinned_layout
from megatrain_nb.engine.transport.pinned import held_bytes

from .test_prediction import SHAPE, UNITS, N, predict, rates

CAST_RATE = 1e9 * CAST_VS_ADAMW   # rates()' adamw_per_thread is 1e9


def test_a_bf16_update_casts_its_shadow_once_and_the_host_plan_holds_it_pinned():
    bf16, c, plan, w = predict(rates(), precision="bf16", optimizer_threads=1)   # (the cast on the update's thread)
    fp32, *_ = predict(rates(), optimizer_threads=1)
    assert bf16.phases["cast"] == pytest.approx(N / CAST_RATE) and fp32.phases["cast"] == 0
    # on the update's thread: the update chain grows by the cast (unclipped: in the backward's window)
    assert bf16.streams["optimizer"] == pytest.approx(fp32.streams["optimizer"] + N / CAST_RATE)
    # the host plan: the masters pageable, the shadows pinned (the engine's own count of what it pins)
    want = sum(held_bytes(u.numel * 4, False) for u in UNITS) + \
        pinned_layout([u.numel for u in UNITS], compute_bytes=2)["weights"]
    assert plan.host["weights"] == want
    cpu, *_ = predict(rates(), precision="bf16", cuda=False)   # a CPU device: the memcpy casts, no shadows
    assert cpu.phases["cast"] == 0


def test_a_bf16_load_from_the_disk_tier_reads_the_copy_its_update_wrote():
    """No host cache: each update writes its unit's bf16 copy on the disk tier (the cast in the
    update chain, once) and a load reads that copy, 2 bytes a parameter, with no cast before its
    copy (``weight_store.DiskWeights``' shadow); behind a host cache the transport casts each load."""
    disk = dict(offload_dir="/nowhere", offload_params=True, optimizer_threads=1)
    p, c, plan, w = predict(rates(), precision="bf16", **disk)
    fp32, *_ = predict(rates(), **disk)
    assert plan.placement["master_weights"] == "disk"
    assert p.phases["cast"] == pytest.approx(N / CAST_RATE)   # once per update, not per load
    assert p.streams["h2d"] == pytest.approx(p.phases["h2d"])
    assert p.bytes["disk_write"] == fp32.bytes["disk_write"] + 2 * N   # the copy, written beside the masters
    cached, *_ = predict(rates(), precision="bf16", cache=1 << 40, **disk)
    loaded = cached.bytes["h2d"] / 2   # every load's parameters (bf16: 2 bytes each)
    assert cached.phases["cast"] == pytest.approx(loaded / CAST_RATE)
    assert cached.streams["h2d"] == pytest.approx(cached.phases["h2d"] + cached.phases["cast"])


def test_the_tiled_backward_forwards_the_mlp_again_only_where_the_plan_tiles():
    seq = 4096   # the MLP's untiled intermediates: 4 x 1024 x 4096 x 4 B = 64 MiB, over a quarter of 0.2 GiB
    roomy, _, plan_roomy, _ = predict(rates(), batch=1, seq=seq, max_vram_gb=64.0, checkpoint_interval=1)
    tight, _, plan_tight, _ = predict(rates(), batch=1, seq=seq, max_vram_gb=0.2, checkpoint_interval=1)
    assert plan_roomy.tile_tokens == 0 and 0 < plan_tight.tile_tokens < seq
    extra = 2.0 * 3 * SHAPE.hidden_size * SHAPE.intermediate_size * seq * SHAPE.num_layers
    assert tight.phases["recompute"] - roomy.phases["recompute"] == pytest.approx(extra / 1e12)
    assert tight.flops - roomy.flops == pytest.approx(extra)

"""The disk links' speed is reported once bytes moved on them (issue 36: ``bytes_per_second``
of ``disk_to_host`` was null while hundreds of MiB went through)."""
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.telemetry import Telemetry

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


def test_disk_links_report_a_rate_when_bytes_moved(tmp_path):
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2))
    e = StreamingEngine(model, EngineConfig(device="cpu", offload_dir=str(tmp_path), offload_params=True,
                                            host_cache_gb=0))
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        e.forward_backward(torch.randint(1, VOCAB, (2, 12), generator=g), step_lr=1e-3)
    e.zero_grad()
    e.disk.flush()
    t = e.telemetry()
    for link in ("disk_to_host", "host_to_disk"):
        assert t["bytes"][link] > 0, link
        rate = t["bytes_per_second"][link]
        assert rate is not None and rate > 0, (link, rate)
    e.close()


def test_overlapping_transfers_count_the_busy_time_once():
    from concurrent.futures import Future

    t = Telemetry()
    a, b = Future(), Future()
    t.busy_while("disk_to_host", a)
    t.busy_while("disk_to_host", b)
    a.set_result(None)
    assert t.link_seconds["disk_to_host"] == 0.0   # b still under way: the link is still busy
    b.set_result(None)
    busy = t.link_seconds["disk_to_host"]
    assert busy > 0
    t.add_bytes("disk_to_host", 1000)
    assert t.snapshot()["bytes_per_second"]["disk_to_host"] == 1000 / busy

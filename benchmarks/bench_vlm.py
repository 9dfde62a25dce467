"""Vision-language training through the streaming engine (issue 49): the step's time per token
with images against the same language model on text only, the vision graph's device bytes
against the plan, and full SFT of Qwen2.5-VL-7B and Gemma-3-27B on paper (one H100 profile).

    python benchmarks/bench_vlm.py                 # a few minutes on 2 loaded cores; nothing downloaded
    python benchmarks/bench_vlm.py --paper-only    # the estimates only (seconds)

The model: a Qwen2-VL shaped like Qwen2-VL-7B, its widths scaled down 14x so that it steps on a
CPU (language model: 8 layers, hidden 256, MLP 1352, vocabulary 2048; vision tower: 9 blocks of
width 96, MLP x4, 14-pixel patches merged 2x2, so the vision tower's work per image token
against the language model's per token is Qwen2-VL-7B's, ~0.36). Rows of ``--seq`` tokens,
``--image-tokens`` of them an image's (one image per row, the processor's layout: vision
start, image pads, vision end). The text step: the same rows with the image tokens replaced by
text tokens -- the same language model, the same tokens. Contenders side by side: the engine's
ratio, and the model's own forward+backward's (Hugging Face, plain autograd): what the vision
tower itself costs, which no placement removes.

``vlm_device_peak_vs_plan``: on CUDA the allocator's peak over the planner's device bytes for
the step's workload (image tokens included; ``make_plan`` on the engine's units and config, as
``mt.estimate`` plans). On a CPU there is no device allocator to read: the figure is the engine's
own accounted peak (``memory_report()["device"]["peak_bytes"]``: weight slots, gradient staging and
sums, the activation meter's peak with the vision graph held from the capture) over the same
plan, and ``text_device_peak_vs_plan`` the same for the text step on a text-only engine (the part
of the gap that is not the vision tower's). ``vlm_vision_graph_vs_plan``: the vision graph the
engine holds from the capture (its meter's count of the saved tensors) over what
``planning/vision_plan.VisionShape.work_bytes`` plans for it. Timings: image and text steps in
turns, the median of each (the machine is shared).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import result  # noqa: E402

PROFILE = "h100-pcie5-gen4nvme"
IMAGE, VSTART, VEND = 2000, 2001, 2002


def _qwen25_vl_7b():
    """Qwen2.5-VL-7B-Instruct's published config.json (huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct)."""
    from megatrain_nb.model_configs import published_config

    return published_config("qwen2.5-vl-7b")


def _gemma3_27b():
    """Gemma-3-27B-it's published config.json (huggingface.co/google/gemma-3-27b-it)."""
    from megatrain_nb.model_configs import published_config

    return published_config("gemma-3-27b")


def paper() -> None:
    """Full SFT (vision tower, projector and language model trained) on one H100 profile: bf16
    compute over fp32 master weights, int8 AdamW states, 512 GiB of host RAM, a disk tier;
    one 4,096-token row per micro-batch, 8 a step, an image's tokens in each."""
    import megatrain_nb as mt

    for name, cfg, image_tokens in (("qwen25_vl_7b", _qwen25_vl_7b(), 1280), ("gemma3_27b", _gemma3_27b(), 256)):
        est = mt.estimate(cfg, vram_gb=80, ram_gb=512, disk_gb=4000, seq=4096, accumulation=8, precision="bf16",
                          compression="int8", image_tokens=image_tokens, rates=PROFILE)
        plan = est.plan
        print(f"{name}: {est.num_parameters / 1e9:.2f}B parameters, {image_tokens} image tokens per 4096-token row, "
              f"feasible={est.feasible}, weights on {plan.placement['master_weights']}, "
              f"step {est.prediction.step_seconds:.1f} s ({est.prediction.bottleneck})")
        print("  " + "\n  ".join(n for n in est.notes if n.startswith("vision tower")))   # resident vs streamed
        result(f"{name}_full_sft_device_gib", plan.device["total"] / 2**30, "GiB", "<=", 80)
        result(f"{name}_full_sft_host_gib", plan.host["total"] / 2**30, "GiB", "<=", 512)
        result(f"{name}_full_sft_disk_gib", plan.disk["total"] / 2**30, "GiB", "<=", 4000)
        result(f"{name}_full_sft_host_min_gib", est.host_min / 2**30, "GiB", "<=", 512)


def _model():
    """A Qwen2-VL of Qwen2-VL-7B's proportions, scaled down (see the module's docstring)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = dict(vocab_size=2048, hidden_size=256, intermediate_size=1352, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "mrope_section": [16, 8, 8], "rope_theta": 1e6})
    vision = dict(depth=9, embed_dim=96, hidden_size=256, num_heads=4, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    cfg = AutoConfig.for_model("qwen2_vl", text_config=text, vision_config=vision, image_token_id=IMAGE,
                               video_token_id=2003, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    return AutoModelForImageTextToText.from_config(cfg).train()


def _batches(batch: int, seq: int, image_tokens: int):
    """(the image batch, the text batch of the same tokens): one square image per row."""
    import torch

    side = int(round((image_tokens * 4) ** 0.5))   # patches per side (2x2 patches a token)
    assert side * side == 4 * image_tokens, "--image-tokens must be a square number of 2x2 tokens (256, 576, 1024)"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1990, (batch, seq), generator=g)
    text = {"input_ids": ids.clone(), "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    ids[:, 8], ids[:, 9:9 + image_tokens], ids[:, 9 + image_tokens] = VSTART, IMAGE, VEND
    labels = ids.masked_fill(ids == IMAGE, -100)
    image = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
             "pixel_values": torch.randn(batch * side * side, 3 * 2 * 14 * 14, generator=g),
             "image_grid_thw": torch.tensor([[1, side, side]] * batch),
             "mm_token_type_ids": (ids == IMAGE).int()}
    return image, text


def _timed(fa, fb, steps: int):
    """((wall seconds of ``fa``, of ``fb``), (the process's CPU seconds of each, all threads)):
    each warmed up, then run in turns ``steps`` times, the median of each (on a loaded machine
    turns see the same load, the median drops a slow outlier, and CPU time counts the work done
    rather than the waits for a core)."""
    fa(), fb()   # warm-up
    wall, cpu = ([], []), ([], [])
    for _ in range(steps):
        for i, fn in enumerate((fa, fb)):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[i].append(time.perf_counter() - t0)
            cpu[i].append(time.process_time() - c0)
    return tuple(statistics.median(x) for x in wall), tuple(statistics.median(x) for x in cpu)


def _hf_step(model, batch):
    def step():
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def _held_graph_bytes(engine, batch) -> int:
    """The vision graph's bytes the engine holds from the capture (its meter's ``held``, read when
    the language model's first layer is called in the capture: the saved tensors' storages)."""
    seen = []
    hook = engine.model.model.language_model.layers[0].register_forward_hook(
        lambda *_: seen.append(engine.runner.meter.held))
    engine.forward_backward(**batch)
    hook.remove()
    engine.zero_grad()
    return seen[0]


def _planned_device(engine, work) -> int:
    """The planner's device bytes for ``work`` on this engine's units and config (its checkpoint
    interval): what ``mt.estimate`` plans for the step (the engine's own plan is made before any
    workload is known when none is given, and counts no activations of one)."""
    from megatrain_nb.engine.planning.planner import ModelShape, UnitSpec, make_plan

    cfg = engine.parts.config.replace(checkpoint_interval=engine.runner.checkpoint_interval)
    specs = [UnitSpec(u.name, u.numel, u.kind, u.tied_output) for u in engine.parts.units]
    return make_plan(specs, ModelShape.of(engine.model_config), cfg, cuda=engine.parts.pager.device.type == "cuda",
                     workload=work).device["total"]


def _accounted_peak(engine, batch, work) -> tuple:
    """(the engine's accounted device peak after a step of ``batch``, the plan's device bytes)."""
    engine.forward_backward(**batch, step_lr=1e-4)
    return engine.memory_report()["device"]["peak_bytes"], _planned_device(engine, work)


def measured(batch: int, seq: int, image_tokens: int, steps: int) -> None:
    import torch

    from megatrain_nb.engine import EngineConfig, StreamingEngine
    from megatrain_nb.engine.planning.planner import Workload
    from megatrain_nb.engine.planning.vision_plan import VisionShape

    torch.manual_seed(0)
    image, text = _batches(batch, seq, image_tokens)
    model = _model()
    hf = copy.deepcopy(model)
    (hf_image, hf_text), (hf_image_cpu, hf_text_cpu) = _timed(_hf_step(hf, image), _hf_step(hf, text), steps)
    work = Workload(batch=batch, seq=seq, accumulation=1, image_tokens=image_tokens)
    cuda = torch.cuda.is_available()
    engine = StreamingEngine(model, EngineConfig(device="cuda" if cuda else "cpu"), workload=work)
    (vlm_s, text_s), (vlm_cpu, text_cpu) = _timed(lambda: engine.forward_backward(**image, step_lr=1e-4),
                                                  lambda: engine.forward_backward(**text, step_lr=1e-4), steps)
    print(f"per step (median of {steps}, in turns): engine {vlm_s:.3f} s with images, {text_s:.3f} s text only "
          f"({batch}x{seq} tokens, {image_tokens} image tokens a row); Hugging Face forward+backward "
          f"{hf_image:.3f} s / {hf_text:.3f} s")
    result("vlm_step_vs_text_step", vlm_s / text_s, "x", "<=", 1.15)
    result("hf_vlm_step_vs_text_step", hf_image / hf_text, "x", "<=", 1.15)
    print(f"CPU seconds (the process, all threads): engine {vlm_cpu:.3f} / {text_cpu:.3f}, Hugging Face "
          f"{hf_image_cpu:.3f} / {hf_text_cpu:.3f}")
    result("vlm_step_vs_text_step_cpu_time", vlm_cpu / text_cpu, "x", "<=", 1.15)
    result("hf_vlm_step_vs_text_step_cpu_time", hf_image_cpu / hf_text_cpu, "x", "<=", 1.15)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        engine.forward_backward(**image, step_lr=1e-4)
        result("vlm_device_peak_vs_plan", torch.cuda.max_memory_allocated() / _planned_device(engine, work),
               "x", "<=", 1.05)
    else:
        # No allocator on a CPU device: the engine's own accounting of its device bytes (weight
        # slots, gradient staging and sums, the activation meter's peak -- the vision graph held
        # from the capture included) over the plan for the step's workload; beside it the same
        # figure for the text step on a text-only engine (what is not the vision tower's).
        peak, planned = _accounted_peak(engine, image, work)
        text_engine = StreamingEngine(_model(), EngineConfig(device="cpu"), workload=Workload(batch=batch, seq=seq))
        t_peak, t_planned = _accounted_peak(text_engine, text, Workload(batch=batch, seq=seq))
        text_engine.close()
        print(f"device bytes as the engine accounts them (CPU device, no allocator): peak {peak / 2**20:.1f} MiB of "
              f"{planned / 2**20:.1f} MiB planned; text only {t_peak / 2**20:.1f} of {t_planned / 2**20:.1f} MiB")
        result("vlm_device_peak_vs_plan", peak / planned, "x", "<=", 1.05)
        result("text_device_peak_vs_plan", t_peak / t_planned, "x", "<=", 1.05)
    got = _held_graph_bytes(engine, image)
    planned = VisionShape.of(model.config).work_bytes(batch=batch, image_tokens=image_tokens,
                                                      compute_bytes=2 if engine.parts.config.precision == "bf16" else 4)
    print(f"vision graph held from the capture: {got / 2**20:.1f} MiB (the engine's count), {planned / 2**20:.1f} MiB "
          "planned")
    result("vlm_vision_graph_vs_plan", got / planned, "x", "<=", 1.05)
    engine.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--image-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--paper-only", action="store_true")
    a = p.parse_args(argv)
    paper()
    if not a.paper_only:
        measured(a.batch, a.seq, a.image_tokens, a.steps)


if __name__ == "__main__":
    main()

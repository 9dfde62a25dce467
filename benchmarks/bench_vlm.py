"""Vision-language training through the streaming engine (issue 49): the step's time per token
with images against the same language model on text only, the vision graph's device bytes
against the plan, and full SFT of Qwen2.5-VL-7B and Gemma-3-27B on paper (one H100 profile).

    python benchmarks/bench_vlm.py                 # a few minutes on 2 loaded cores; nothing downloaded
    python benchmarks/bench_vlm.py --paper-only    # the estimates only (seconds)

The model: a Qwen2-VL shaped like Qwen2-VL-7B, its widths scaled down so that it steps on a CPU
(language model: 8 layers, hidden 256 = 3584/14, MLP 1352 (Qwen2-VL-7B's ratio); vision tower: 9
blocks of width 96 = 1280/13.3, MLP x4, 14-pixel patches merged 2x2). Widths alone do not keep
the workload's proportions: attention costs patches^2 x width in the tower and seq^2 x hidden in
the language model, and the head vocabulary x hidden, so the workload is scaled with the widths
too, by one rule (``scaled_layout``, from the real row layout ``REAL_SEQ``/``REAL_GRID``:
Qwen2-VL-7B's rows of 4,096 tokens with one 896x896 image, 64x64 patches = 1,024 image tokens,
a quarter of the row): patches per image x the towers' width ratio (307 -> an image of 16x20
patches, 80 image tokens; the nearest grid of even sides), the row's share of image tokens
kept (rows of 320 tokens; the language model's seq/hidden 1.25 against the real 1.14), the
vocabulary x the language models' width ratio (152,064 -> 10,862). Counted, not estimated
(``flop_counts``: ``torch.utils.flop_counter.FlopCounterMode`` over the model built on the
meta device, attention included): Qwen2-VL-7B's vision tower+merger does 7,819 MFLOP per image
token against its language model's 15,785 per token (0.4953: the linear layers alone give
~0.36), an image row 1.1238x a text row's FLOPs; the tiny model at this layout 13.78 against
27.94 MFLOP (0.4932), 1.1233x (0.9995 of the real ratio). At the layout this bench ran before
(rows of 1,024 tokens, one 32x32-patch image, vocabulary 2,048) the tiny model's vision work
per image token was 0.805 of its LM's (1.201x a text row): the 1.15 target was under its own
FLOP floor there. Qwen2.5-VL-7B (windowed attention in 28 of 32 tower blocks) at the same row:
0.349, 1.087x (printed for information). The LM's attention is counted over the full square; a
causal kernel does about half (both ratios printed).

Rows of 320 tokens, 8 a step, one image each (the processor's layout: vision start, image pads,
vision end). The text step: the same rows with the image tokens replaced by text tokens -- the
same language model, the same tokens. Contenders side by side: the engine's ratio, and the
model's own forward+backward's (Hugging Face, plain autograd): what the vision tower itself
costs, which no placement removes. Beside the seconds, the steps' FLOPs counted (load-free):
``vlm_step_vs_text_step_flops`` (the engine's, whose text step also re-runs the layers under
checkpointing), ``hf_vlm_step_vs_text_step_flops``, and ``vlm_image_flops_vs_hf``: what images
add to the engine's step over what they add to Hugging Face's (1.000 measured: the tower runs
once forward, once backward). ``--flops-only``: the FLOP counts alone (seconds).

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
#: the real model's row layout the tiny one is scaled from: rows of 4,096 tokens (the on-paper
#: profile's), one 896x896-pixel image each (64x64 patches of 14 px, 1,024 image tokens: a quarter
#: of the row, the share the bench ran at before)
REAL_SEQ, REAL_GRID = 4096, (1, 64, 64)


def _qwen2_vl_7b():
    """Qwen2-VL-7B-Instruct's published config.json (huggingface.co/Qwen/Qwen2-VL-7B-Instruct)."""
    from megatrain_nb.model_configs import published_config

    return published_config("qwen2-vl-7b")


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


def _model(vocab: int = 2048):
    """A Qwen2-VL of Qwen2-VL-7B's proportions, scaled down (see the module's docstring)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = dict(vocab_size=vocab, hidden_size=256, intermediate_size=1352, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "mrope_section": [16, 8, 8], "rope_theta": 1e6})
    vision = dict(depth=9, embed_dim=96, hidden_size=256, num_heads=4, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    cfg = AutoConfig.for_model("qwen2_vl", text_config=text, vision_config=vision, image_token_id=IMAGE,
                               video_token_id=2003, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    return AutoModelForImageTextToText.from_config(cfg).train()


def scaled_layout(real_cfg, tiny_cfg, real_seq: int = REAL_SEQ, real_grid=REAL_GRID) -> tuple:
    """(the rows' length, the image's (t, h, w) patch grid, the vocabulary) of the tiny model's
    workload, scaled from the real one's by the rule in the module's docstring: patches per image
    times the towers' width ratio (the nearest grid of even sides h <= w <= h + 4: Qwen-VL merges
    2x2), the real row's share of image tokens kept (the row's length follows from the image's
    tokens), the vocabulary times the language models' width ratio."""
    rv, tv = real_cfg.vision_config, tiny_cfg.vision_config
    target = real_grid[1] * real_grid[2] * tv.embed_dim / rv.embed_dim
    h, w = min(((h, w) for h in range(2, 200, 2) for w in range(h, h + 5, 2)),
               key=lambda hw: (abs(hw[0] * hw[1] - target), hw[1] - hw[0]))
    share = real_grid[1] * real_grid[2] / rv.spatial_merge_size ** 2 / real_seq
    seq = round(h * w / tv.spatial_merge_size ** 2 / share)
    vocab = round(real_cfg.text_config.vocab_size * tiny_cfg.text_config.hidden_size
                  / real_cfg.text_config.hidden_size)
    return seq, (1, h, w), vocab


def _tower_kwargs(tower, grid):
    """The tower's index tensors for ``grid`` (a CPU tensor), computed as the tower computes them
    (transformers.vision_utils) and handed to it precomputed so that a meta-device tower runs:
    what the hidden states are indexed by on the meta device, the attention's segment bounds on
    the CPU (they are read as Python numbers)."""
    from transformers import vision_utils as vu

    kw = {"position_ids": vu.get_vision_position_ids(grid, tower.spatial_merge_size).to("meta")}
    kw["cu_seqlens"], _ = vu.get_vision_attention_seqlens(grid, tower.config)
    if getattr(tower, "window_size", None):   # Qwen2.5-VL: windowed attention in most blocks
        index, bounds = vu.get_vision_window_index(grid, spatial_merge_size=tower.spatial_merge_size,
                                                   window_size=tower.window_size, patch_size=tower.patch_size)
        kw["window_index"], kw["cu_window_seqlens"] = index.to("meta"), bounds
    return kw


def flop_counts(config, seq: int, grids) -> dict:
    """Forward FLOPs of one row, counted by ``torch.utils.flop_counter.FlopCounterMode`` on the
    meta device (the model built there from ``config``: nothing allocated): ``vision`` (the
    tower and its merger on the row's images, ``grids`` their (t, h, w) patch grids), ``lm``
    (the language model and its head on ``seq`` tokens, attention over the full square, as the
    counter counts it), ``lm_attention`` (the language model's attention matmuls in it: a causal
    kernel skips about half)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    base, vc = model.model, config.vision_config
    grid = torch.tensor([list(g) for g in grids])
    pixels = torch.empty(int(grid.prod(-1).sum()), vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2,
                         device="meta")
    with FlopCounterMode(display=False) as fc:
        base.visual(pixels, grid_thw=grid, **_tower_kwargs(base.visual, grid))
    vision = fc.get_total_flops()
    embeds = torch.empty(1, seq, config.text_config.hidden_size, device="meta")
    positions = torch.arange(seq, device="meta").view(1, 1, -1).expand(3, 1, -1)
    with FlopCounterMode(display=False) as fc:
        model.lm_head(base.language_model(inputs_embeds=embeds, position_ids=positions).last_hidden_state)
    # (on the meta device attention runs as the math kernel: its two batched matmuls are the
    # language model's bmm, besides the rotary table's, seq x head_dim / 2 multiply-adds)
    attention = sum(n for op, n in fc.get_flop_counts()["Global"].items() if "bmm" in str(op))
    return {"vision": vision, "lm": fc.get_total_flops(), "lm_attention": attention,
            "image_tokens": int(grid.prod(-1).sum()) // vc.spatial_merge_size ** 2}


def info(name: str, value: float, unit: str) -> None:
    print(f"RESULT {name} {value:.4g} {unit} (informational)", flush=True)


def flop_ratios(layouts) -> dict:
    """Print, per (name, config, seq, grids), the forward FLOPs of the vision tower + merger per
    image token and of the language model per token, and the image row's FLOPs over the text
    row's (the same tokens, the image tokens text); returns name -> that ratio."""
    out = {}
    for name, config, seq, grids in layouts:
        c = flop_counts(config, seq, grids)
        per_image, per_token = c["vision"] / c["image_tokens"], c["lm"] / seq
        causal = c["lm"] - c["lm_attention"] / 2
        out[name] = 1 + c["vision"] / c["lm"]
        print(f"FLOPs counted, {name}: rows of {seq} tokens, {c['image_tokens']} of them image tokens (images of "
              f"{' + '.join('x'.join(map(str, g)) for g in grids)} patches); vision tower+merger "
              f"{per_image / 1e6:.5g} MFLOP per image token, language model+head {per_token / 1e6:.5g} MFLOP per "
              f"token (its attention {c['lm_attention'] / c['lm']:.1%}, the full square); vision per image token "
              f"/ LM per token {per_image / per_token:.4f}; image row / text row {out[name]:.4f} "
              f"({1 + c['vision'] / causal:.4f} with the LM's attention causal, half the square)")
        info(f"vlm_flop_ratio_{name}", out[name], "x")
    return out


def _batches(batch: int, seq: int, grid, vocab: int):
    """(the image batch, the text batch of the same tokens): one image of ``grid`` ((t, h, w)
    patches) per row, the processor's layout (vision start, image pads, vision end)."""
    import torch

    image_tokens = grid[0] * grid[1] * grid[2] // 4   # (2x2 patches a token)
    assert 10 + image_tokens <= seq, f"{image_tokens} image tokens do not fit rows of {seq}"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    ids[(ids >= IMAGE) & (ids <= IMAGE + 3)] = 3             # (the special ids only where the layout puts them)
    text = {"input_ids": ids.clone(), "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    ids[:, 8], ids[:, 9:9 + image_tokens], ids[:, 9 + image_tokens] = VSTART, IMAGE, VEND
    labels = ids.masked_fill(ids == IMAGE, -100)
    image = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
             "pixel_values": torch.randn(batch * grid[0] * grid[1] * grid[2], 3 * 2 * 14 * 14, generator=g),
             "image_grid_thw": torch.tensor([list(grid)] * batch),
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


def _step_times(model, engine, image, text, steps: int, label: str) -> None:
    """The engine's and Hugging Face's image step over their text step, side by side."""
    hf = copy.deepcopy(model)
    (hf_image, hf_text), (hf_image_cpu, hf_text_cpu) = _timed(_hf_step(hf, image), _hf_step(hf, text), steps)
    del hf
    (vlm_s, text_s), (vlm_cpu, text_cpu) = _timed(lambda: engine.forward_backward(**image, step_lr=1e-4),
                                                  lambda: engine.forward_backward(**text, step_lr=1e-4), steps)
    print(f"per step (median of {steps}, in turns): engine {vlm_s:.3f} s with images, {text_s:.3f} s text only "
          f"({label}); Hugging Face forward+backward {hf_image:.3f} s / {hf_text:.3f} s")
    result("vlm_step_vs_text_step", vlm_s / text_s, "x", "<=", 1.15)
    result("hf_vlm_step_vs_text_step", hf_image / hf_text, "x", "<=", 1.15)
    print(f"CPU seconds (the process, all threads): engine {vlm_cpu:.3f} / {text_cpu:.3f}, Hugging Face "
          f"{hf_image_cpu:.3f} / {hf_text_cpu:.3f}")
    result("vlm_step_vs_text_step_cpu_time", vlm_cpu / text_cpu, "x", "<=", 1.15)
    result("hf_vlm_step_vs_text_step_cpu_time", hf_image_cpu / hf_text_cpu, "x", "<=", 1.15)


def _step_flops(model, engine, image, text) -> None:
    """The steps' FLOPs, counted (``FlopCounterMode`` over one step each, after the timed ones:
    the engine's first step runs its layers' forward once more, a warm-up): the engine's image step
    over its text step, Hugging Face's, and what images add to the engine's step over what they add
    to Hugging Face's (1: the tower runs once forward and once backward, nothing more). The engine's
    text step re-runs the layers (checkpointing), so its ratio is the lower of the two."""
    from torch.utils.flop_counter import FlopCounterMode

    def flops(fn) -> int:
        with FlopCounterMode(display=False) as fc:
            fn()
        return fc.get_total_flops()
    hf = copy.deepcopy(model)
    e_image, e_text = (flops(lambda b=b: engine.forward_backward(**b, step_lr=1e-4)) for b in (image, text))
    h_image, h_text = (flops(lambda b=b: hf(**b).loss.backward()) for b in (image, text))
    print(f"FLOPs of a step, counted: engine {e_image / 1e9:.2f} / {e_text / 1e9:.2f} GFLOP with images / text only, "
          f"Hugging Face forward+backward {h_image / 1e9:.2f} / {h_text / 1e9:.2f} GFLOP")
    info("vlm_step_vs_text_step_flops", e_image / e_text, "x")
    info("hf_vlm_step_vs_text_step_flops", h_image / h_text, "x")
    info("vlm_image_flops_vs_hf", (e_image - e_text) / (h_image - h_text), "x")


def measured(batch: int, seq: int, grid, vocab: int, steps: int) -> None:
    import torch

    from megatrain_nb.engine import EngineConfig, StreamingEngine
    from megatrain_nb.engine.planning.planner import Workload
    from megatrain_nb.engine.planning.vision_plan import VisionShape

    torch.manual_seed(0)
    image_tokens = grid[0] * grid[1] * grid[2] // 4
    image, text = _batches(batch, seq, grid, vocab)
    model = _model(vocab)
    work = Workload(batch=batch, seq=seq, accumulation=1, image_tokens=image_tokens)
    cuda = torch.cuda.is_available()
    engine = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cuda" if cuda else "cpu"), workload=work)
    _step_times(model, engine, image, text, steps,
                f"{batch}x{seq} tokens, an image of {'x'.join(map(str, grid))} patches = {image_tokens} tokens a row")
    _step_flops(model, engine, image, text)
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
        text_engine = StreamingEngine(_model(vocab), EngineConfig(device="cpu"),
                                      workload=Workload(batch=batch, seq=seq))
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


def counted(seq: int, grid, vocab: int) -> None:
    """The FLOP counts: the real model at its row layout, the tiny model at the bench's (and at
    the layout the bench ran before, for the record), Qwen2.5-VL-7B for information."""
    real, tiny = _qwen2_vl_7b(), _model(vocab).config
    got = flop_ratios([("qwen2_vl_7b", real, REAL_SEQ, [REAL_GRID]), ("tiny", tiny, seq, [grid]),
                       ("tiny_old_layout", _model(2048).config, 1024, [(1, 32, 32)]),
                       ("qwen25_vl_7b", _qwen25_vl_7b(), REAL_SEQ, [REAL_GRID])])
    info("vlm_flop_ratio_tiny_over_real", got["tiny"] / got["qwen2_vl_7b"], "x")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--paper-only", action="store_true")
    p.add_argument("--flops-only", action="store_true", help="the FLOP counts only (seconds)")
    a = p.parse_args(argv)
    seq, grid, vocab = scaled_layout(_qwen2_vl_7b(), _model().config)
    print(f"the tiny model's workload, scaled from Qwen2-VL-7B's rows of {REAL_SEQ} tokens with one image of "
          f"{'x'.join(map(str, REAL_GRID))} patches: rows of {seq} tokens, one image of {'x'.join(map(str, grid))} "
          f"patches each, vocabulary {vocab}")
    counted(seq, grid, vocab)
    if a.flops_only:
        return
    paper()
    if not a.paper_only:
        measured(a.batch, seq, grid, vocab, a.steps)


if __name__ == "__main__":
    main()

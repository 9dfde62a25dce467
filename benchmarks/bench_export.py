"""Exports streamed from the tiers (issue 47): the safetensors export of a model whose weights are
on the disk tier against ``dd`` with direct I/O on the same disk, the export's extra resident
memory, and the GGUF files' logits against the trained model's.

    python benchmarks/bench_export.py [--hidden 2048 --layers 22 --dir /tmp] [--reps 2]

1. A llama of ``--layers`` x ``--hidden`` (vocab 32000; the default is 1.1B parameters, 4.3 GiB of
   fp32) is built on the meta device and initialised unit by unit onto the disk tier
   (``offload_params=True``, no host cache): its weights exist only in the offload folder.
2. ``dd if=/dev/zero of=F bs=64M oflag=direct`` measures the disk's write rate, before and after
   the exports (the median); each export (``mt.export(engine, folder)``: every unit read from the
   disk tier and its tensors written into the shards, fsynced) is timed ``--reps`` times; the
   rate is the weights' bytes over the export's seconds. Beside it, the disk's *copy* rate: the
   tier's own files copied with direct I/O both ways, four 32 MiB chunks in flight (reads and
   writes overlapped), nothing checked or converted -- what any export that reads the bytes it
   writes from the same disk can reach there; and ``dd``'s direct read rate.
3. The export's extra RSS: the process's peak (VmHWM, reset through /proc/self/clear_refs before
   each export) less its RSS before it, as the OS saw them.
4. A small llama trained 3 steps (mt.Trainer) is exported as GGUF f32 and f16 and reloaded by
   transformers' GGUF loader; max |logits - trained| / max |trained| on a batch.

    RESULT export_safetensors_vs_disk_write <ratio> x (target >= 0.8)
    RESULT export_safetensors_vs_disk_copy <ratio> x (target >= 0.8)
    RESULT export_extra_rss_gib <GiB> GiB (target <= 1)
    RESULT export_gguf_f32_logits_max_rel_err <err> (target <= 0.0001)
    RESULT export_gguf_f16_logits_max_rel_err <err> (target <= 0.02)
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common import current_rss_bytes, hwm_bytes, machine, median, reset_peak_rss, result  # noqa: E402

import megatrain_nb as mt  # noqa: E402
from megatrain_nb.engine import EngineConfig, StreamingEngine  # noqa: E402

GiB = 1024 ** 3


def dd_write_rate(folder: str, count: int = 32) -> float:
    """Bytes per second dd writes with direct I/O into ``folder`` (``count`` x 64 MiB)."""
    path = os.path.join(folder, "dd.bin")
    try:
        proc = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}", "oflag=direct"],
                              capture_output=True, text=True, check=True)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    m = re.search(r"copied, ([0-9.]+) s", proc.stderr)
    return count * 64 * 1024 ** 2 / float(m.group(1))


def raw_copy_rate(files, folder: str, chunk: int = 32 << 20, in_flight: int = 4) -> float:
    """Bytes per second of ``files`` copied into one file of ``folder`` with direct I/O both ways,
    ``in_flight`` chunks at once (each read, then written: reads and writes overlap), no checks,
    no conversion: the disk's own rate for a copy, the bound of an export that reads from the
    same disk every byte it writes (the files' sizes are whole blocks)."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    path = os.path.join(folder, "raw-copy.bin")
    jobs, at = [], 0
    for f in files:
        size = os.path.getsize(f)
        jobs += [(f, o, min(chunk, size - o), at + o) for o in range(0, size, chunk)]
        at += size
    bufs = [mmap.mmap(-1, chunk) for _ in range(in_flight)]
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    fds = {f: os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files}

    def copy(i):
        f, off, n, dest = jobs[i]
        mv = memoryview(bufs[i % in_flight])[:n]
        got = 0
        while got < n:
            got += os.preadv(fds[f], [mv[got:]], off + got)
        done = 0
        while done < n:
            done += os.pwritev(out, [mv[done:]], dest + done)

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(in_flight) as ex:   # job i and i + in_flight share a buffer: waves
            for w in range(0, len(jobs), in_flight):
                list(ex.map(copy, range(w, min(w + in_flight, len(jobs)))))
        os.fsync(out)
        return at / (time.perf_counter() - t0)
    finally:
        os.close(out)
        for fd in fds.values():
            os.close(fd)
        os.unlink(path)


def dd_read_rate(files) -> float:
    """Bytes per second ``dd`` reads ``files`` with direct I/O."""
    t0 = time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=64M", "iflag=direct", "status=none"], check=True)
    return sum(os.path.getsize(f) for f in files) / (time.perf_counter() - t0)


def tier_files(folder: str) -> list:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.endswith(".mtd"))


def disk_engine(a, folder: str, host_cache_gb=0) -> StreamingEngine:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.75),
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                      num_key_value_heads=max(1, a.hidden // 256), max_position_embeddings=2048,
                      tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    extra = {} if host_cache_gb is None else {"host_cache_gb": host_cache_gb}   # None: the default cache
    return StreamingEngine(model, EngineConfig(device="cpu", offload_dir=folder, offload_params=True, **extra))


def bench_disk_export(a) -> None:
    """The default configuration (the host cache of the disk tier as a user gets it) and, beside it,
    no host cache (every weight read from the disk during the export)."""
    figures = {label: disk_export(a, cache) for label, cache in (("default host cache", None), ("no host cache", 0))}
    for label, f in figures.items():
        print(f"{label}: export / dd write {f['vs_write']:.2f} x, export / raw copy {f['vs_copy']:.2f} x, "
              f"extra peak RSS {f['extra']:.2f} GiB")
    f = figures["default host cache"]
    result("export_safetensors_vs_disk_write", f["vs_write"], "x", ">=", 0.8)
    result("export_safetensors_vs_disk_copy", f["vs_copy"], "x", ">=", 0.8)
    print(f"(the model is {f['weights'] / GiB:.1f} GiB: {f['weights'] / GiB:.1f}x the 1 GiB budget)")
    result("export_extra_rss_gib", max(f["extra"], figures["no host cache"]["extra"]), "GiB", "<=", 1.0)


def disk_export(a, host_cache_gb) -> dict:
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        t0 = time.perf_counter()
        engine = disk_engine(a, os.path.join(d, "offload"), host_cache_gb)
        n = engine.num_parameters()
        weights = n * 4
        cache = getattr(engine.disk, "capacity", 0) / GiB
        print(f"model: llama {a.layers} x {a.hidden}, {n / 1e9:.2f}B params, {weights / GiB:.2f} GiB fp32 on the "
              f"disk tier (params_on_disk={engine.params_on_disk}, host cache {cache:.1f} GiB); initialised in "
              f"{time.perf_counter() - t0:.0f}s", flush=True)
        engine.disk.flush()
        files = tier_files(os.path.join(d, "offload"))
        rates, copies, times, extra = [dd_write_rate(d)], [], [], []
        for rep in range(a.reps):
            copies.append(raw_copy_rate(files, d))
            out = os.path.join(d, f"export-{rep}")
            engine.disk.flush()
            before = current_rss_bytes()
            can_reset = reset_peak_rss()
            read0 = engine.disk.stats()["bytes_read"]
            t0 = time.perf_counter()
            mt.export(engine, out)
            times.append(time.perf_counter() - t0)
            read = engine.disk.stats()["bytes_read"] - read0
            extra.append((hwm_bytes() - before) / GiB if can_reset else float("nan"))
            size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
            print(f"export {rep + 1}: {times[-1]:.1f}s ({weights / times[-1] / 1e9:.2f} GB/s), {size / GiB:.2f} GiB "
                  f"written, {read / GiB:.2f} GiB read from the disk tier, extra peak RSS {extra[-1]:.2f} GiB; "
                  f"raw copy of the tier's files {copies[-1] / 1e9:.2f} GB/s", flush=True)
            shutil.rmtree(out)
        rates.append(dd_write_rate(d))
        read_alone = dd_read_rate(files)
        engine.close()
    rate, dd, copy = weights / median(times), median(rates), median(copies)
    print(f"export {rate / 1e9:.2f} GB/s (median of {a.reps}); dd direct write {dd / 1e9:.2f} GB/s "
          f"(before {rates[0] / 1e9:.2f}, after {rates[-1] / 1e9:.2f}); dd direct read {read_alone / 1e9:.2f} GB/s; "
          f"raw direct-I/O copy (read and write at once) {copy / 1e9:.2f} GB/s each way", flush=True)
    return {"vs_write": rate / dd, "vs_copy": rate / copy, "extra": max(extra), "weights": weights}


def bench_gguf(a) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(0, 2048, (64,), generator=g).tolist()} for _ in range(16)]
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        args = TrainingArguments(output_dir=os.path.join(d, "run"), per_device_train_batch_size=4, max_steps=3,
                                 learning_rate=1e-3, report_to="none", disable_tqdm=True, save_strategy="no")
        trainer = mt.Trainer(model=AutoModelForCausalLM.from_config(cfg), train_dataset=Dataset.from_list(rows),
                             args=args)
        trainer.train()
        ids = torch.randint(0, 2048, (2, 64), generator=g)
        ref = trainer.engine.forward_logits(ids)
        errs = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for dtype in ("f32", "f16"):
                mt.export(trainer, os.path.join(d, f"m-{dtype}.gguf"), format="gguf", dtype=dtype, tokenizer=False)
                m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f"m-{dtype}.gguf", dtype=torch.float32)
                with torch.no_grad():
                    errs[dtype] = float((m(ids).logits - ref).abs().max() / ref.abs().max())
        trainer.close()
    print(f"GGUF: llama 4 x 256 trained 3 steps, logits of 2 x 64 tokens reloaded by transformers' GGUF loader")
    result("export_gguf_f32_logits_max_rel_err", errs["f32"], "", "<=", 1e-4)
    result("export_gguf_f16_logits_max_rel_err", errs["f16"], "", "<=", 2e-2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22, help="22 x 2048: 1.1B parameters, 4.3 GiB of fp32")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="the disk to measure (offload folder, exports)")
    ap.add_argument("--skip-disk", action="store_true", help="only the GGUF figures")
    a = ap.parse_args()
    with open("/proc/loadavg") as f:
        print(f"machine: {machine()}; load {f.read().split()[:3]}")
    if not a.skip_disk:
        bench_disk_export(a)
    bench_gguf(a)
    with open("/proc/loadavg") as f:
        print(f"load at the end: {f.read().split()[:3]}")


if __name__ == "__main__":
    main()

"""A small fake trainer that honours the Trainer -> Session seam (docs/INTERNALS.md):
``iter_steps`` yields records; ``set_lr``, ``save_checkpoint``, ``request_stop``,
``total_steps``, ``engine`` and ``close``. The fake engine offers what the Session reads:
``lock``, ``layer_stats``, ``unit_names``, ``forward_logits``, ``close``.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

VOCAB = 128


class FakeEngine:
    def __init__(self, n_layers: int = 3):
        self.lock = threading.RLock()
        self.closed = False
        self.n_layers = n_layers
        self.model_config = SimpleNamespace(model_type="fake", hidden_size=8, num_hidden_layers=n_layers,
                                            vocab_size=VOCAB, max_position_embeddings=32)
        self.step = 0
        self.in_step = threading.Event()  # set while a "step" holds the lock

    def unit_names(self):
        return ["embed"] + [f"model.layers.{i}" for i in range(self.n_layers)] + ["head"]

    def layer_stats(self):
        out = []
        for i, name in enumerate(self.unit_names()):
            g = 1.0 / (1 + self.step) * (i + 1)
            out.append({"unit": name, "index": i, "weight_norm": 10.0 + i, "grad_norm": g,
                        "update_norm": g * 1e-3, "update_ratio": g * 1e-4,
                        "hist_counts": [1, 3, 7, 3, 1], "hist_edges": [-1.0, -0.6, -0.2, 0.2, 0.6, 1.0]})
        return out

    def forward_logits(self, input_ids, attention_mask=None):
        self._check()
        b, s = input_ids.shape
        logits = torch.zeros(b, s, VOCAB)
        nxt = (input_ids + 1) % VOCAB  # the "model" predicts the next character code
        logits.scatter_(2, nxt.unsqueeze(-1), 10.0)
        return logits

    def memory_report(self):
        return {"device": {"weights": 1000, "grads": 500, "activations": 2000, "used_bytes": 3500,
                           "peak_bytes": 4000, "capacity_bytes": 8000},
                "host": {"weights": 4000, "grads": 4000, "optimizer_states": 8000, "used_bytes": 16000,
                         "peak_bytes": 16000, "capacity_bytes": 64000},
                "disk": {"weights": 0, "optimizer_states": 0, "used_bytes": 0, "peak_bytes": 0, "capacity_bytes": None}}

    def telemetry(self):
        n = self.step
        return {"bytes": {"host_to_device": 1000 * n, "device_to_host": 500 * n, "disk_to_host": 0, "host_to_disk": 0},
                "bytes_per_second": {}, "prefetch": {"device": {"ahead": 9 * n, "late": n, "hit_rate": 0.9 if n else None}},
                "stall_seconds": {"device": 0.001 * n}, "step_seconds": 0.01 * n}

    def num_parameters(self):
        return 1234

    def close(self):
        self.closed = True

    def _check(self):
        if self.closed:
            raise RuntimeError("engine closed")


class FakeTrainer:
    """``total_steps`` steps of ``step_time`` seconds each; a constant LR schedule."""

    def __init__(self, total_steps: int = 50, step_time: float = 0.0, lr: float = 1e-3, loss_fn=None,
                 output_dir: str | None = None, log_every: int = 5, eval_every: int = 0):
        self.total_steps = total_steps
        self.step_time = step_time
        self.loss_fn = loss_fn
        self._lr = lr
        self._stop = False
        self.engine = FakeEngine()
        self.args = SimpleNamespace(learning_rate=lr, output_dir=output_dir or "fake_out", lr_scheduler_type="constant")
        self.log_every = log_every
        self.eval_every = eval_every
        self.lrs_used: list[tuple[int, float]] = []
        self.step = 0
        self.closed_generator = False
        self.threads_seen: set[str] = set()
        self.layer_stats = False

    def gather_layer_stats(self, on: bool = True):
        self.layer_stats = on

    def iter_steps(self, resume_from_checkpoint=None):
        start = 0
        if resume_from_checkpoint:
            start = json.loads((Path(resume_from_checkpoint) / "state.json").read_text())["step"]
        self.step = start
        try:
            while self.step < self.total_steps and not self._stop:
                self.threads_seen.add(threading.current_thread().name)
                with self.engine.lock:
                    if self.step_time:
                        time.sleep(self.step_time)
                    step = self.step + 1
                    loss = 4.0 / (1 + 0.1 * step)
                    if self.loss_fn is not None:
                        loss = float(self.loss_fn(step))
                    self.lrs_used.append((step, self._lr))
                    self.step = self.engine.step = step
                rec = {"step": step, "epoch": step / self.total_steps, "loss": loss, "lr": self._lr, "grad_norm": 1.0,
                       "tokens": 256, "tokens_per_s": 256 / max(self.step_time, 1e-3),
                       "step_time_s": self.step_time, "time": time.time(), "total_steps": self.total_steps}
                if self.log_every and step % self.log_every == 0:
                    rec["memory"] = self.engine.memory_report()
                    rec["telemetry"] = self.engine.telemetry()
                if self.eval_every and step % self.eval_every == 0:
                    rec["eval_loss"] = loss + 0.1
                if self.layer_stats:
                    rec["layer_stats"] = self.engine.layer_stats()
                yield rec
        finally:
            self.closed_generator = True

    def set_lr(self, lr):
        self._lr = float(lr)

    def save_checkpoint(self, path=None):
        path = Path(path or os.path.join(self.args.output_dir, f"checkpoint-{self.step}"))
        path.mkdir(parents=True, exist_ok=True)
        (path / "state.json").write_text(json.dumps({"step": self.step}))
        return str(path)

    def request_stop(self):
        self._stop = True

    def close(self):
        self.engine.close()


class CharTokenizer:
    """ASCII characters <-> ids (enough for generate())."""

    eos_token_id = None
    bos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % VOCAB for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def wait_until(pred, timeout: float = 10.0, interval: float = 0.005) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def close_sessions(sessions, timeout: float) -> None:
    """Test teardown: stop and close every Session a fixture made (errors already reported)."""
    for s in sessions:
        try:
            s.stop(wait=True, timeout=timeout)
            s.close()
        except Exception:
            pass

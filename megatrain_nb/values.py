"""The one table of user-settable values: each one's type, range and meaning, and the one check
every door applies when the value enters.

The doors: :class:`~megatrain_nb.engine.EngineConfig` (and ``mt.init``), the Trainer's and
SFTTrainer's arguments (``trainer/args.py``), ``Session.fork`` changes (``notebook/branches.py``),
the command table (``commands.py``: the sidebar, the Jupyter server, the inbox, ``%megatrain``,
``set_lr``) and run.yaml (``cli/config.py``). Each calls :func:`check` with the value's name and
where it came from, so a value is refused with the same words wherever it enters, when it enters:

    >>> check("learning_rate", "3e-4")
    0.0003
    >>> try:
    ...     check("weight_decay", float("nan"), "run.yaml engine.weight_decay")
    ... except ValueRefused as e:
    ...     print(e)
    run.yaml engine.weight_decay=nan: must be a finite number >= 0 (decoupled weight decay of every weight matrix)

Numbers written as text ("3e-4", "10") count, as typed in a magic or a YAML file; a bool is never
a number; NaN, inf and integers too large for the run (10**400) are refused. A switch ("bool") is
True or False, or the text 'true'/'false' (never "no", "abc", 1 or NaN read as truthy); a folder
("path") is text or os.PathLike; a list row (``many``: DPO's loss_type, loss_weights) takes one value
or a non-empty list. A config field whose meaning depends on the config (``loss_type`` in DPOConfig
and SFTConfig) has one row per family (``ALIASES``, :func:`row_name`). Standard library only: the
Jupyter server side imports it cheaply.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

#: The largest whole number a count may be (a C int64: torch and numpy hold it).
MAX_INT = 2 ** 63 - 1
#: Random seeds: numpy's generators take 0 .. 2**32 - 1.
MAX_SEED = 2 ** 32 - 1


class ValueRefused(ValueError):
    """A user-set value outside its rule in :data:`VALUES` (the message names where it came from)."""


@dataclass(frozen=True)
class Value:
    """One row of the table: ``kind`` "int", "float" or "choice"; ``low``/``high`` the bounds
    (None: none), ``low_open``/``high_open`` whether the bound itself is excluded; ``none_ok``:
    None is allowed (and means what ``meaning`` says); ``also``: other whole numbers allowed
    outside the range (max_steps' -1)."""

    name: str
    kind: str
    meaning: str
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    none_ok: bool = False
    choices: tuple = ()
    also: tuple = ()
    many: bool = False   # a non-empty list of such values (one value alone counts as a list of one)

    def rule(self) -> str:
        """What is allowed, in words: the same wherever the value enters."""
        if self.kind == "bool":
            text = "True or False (as text: 'true' or 'false')"
        elif self.kind == "path":
            text = "a folder's path (text or os.PathLike, not empty)"
        elif self.many and self.kind == "choice":
            text = "one or a non-empty list of " + ", ".join(repr(c) for c in self.choices)
        elif self.kind == "choice":
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            text = "a whole number" if self.kind == "int" else "a finite number"
            parts = []
            if self.low is not None:
                parts.append(f"{'>' if self.low_open else '>='} {_num(self.low)}")
            if self.high is not None:
                parts.append(f"{'<' if self.high_open else '<='} {_num(self.high)}")
            text += " " + " and ".join(parts) if parts else ""
            if self.also:
                text += ", or " + ", ".join(str(a) for a in self.also)
            if self.many:
                text = "a non-empty list, each " + text
        if self.none_ok:
            text += ", or None"
        return f"must be {text} ({self.meaning})"


def _num(x: float) -> str:
    if x == MAX_INT:
        return "2**63-1"
    if x == MAX_SEED:
        return "2**32-1"
    return f"{x:g}" if isinstance(x, float) else str(x)


def _row(name, kind, meaning, **kw) -> Value:
    return Value(name, kind, meaning, **kw)


_BATCH = dict(low=1, high=MAX_INT)
_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
               "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")

# ---- fine-tuning (trl.DPOConfig / trl.SFTConfig fields the DPOTrainer and SFTTrainer honour), the
# engine's switches and its disk folder, the sample prompt: issue 44's block ----
#: trl.DPOTrainer's loss types (trainer/dpo_loss.py computes each; a test checks TRL's list)
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
_FINE_TUNING_ROWS = (
    _row("beta", "float", "DPO's temperature: how strongly the policy is held to the reference; above 1000 "
         "every pair's loss saturates: a typo?", low=0, low_open=True, high=1000.0),
    _row("label_smoothing", "float", "the assumed share of wrong preference labels (cDPO, robust, EXO, AOT)",
         low=0, high=0.5, high_open=True),
    _row("dpo_loss_type", "choice", "the DPO losses, summed", choices=DPO_LOSS_TYPES, many=True),
    _row("loss_weights", "float", "each DPO loss type's weight; None = 1 each", low=0, many=True, none_ok=True),
    _row("ld_alpha", "float", "LD-DPO's weight of the tokens beyond the shorter answer; None = no length "
         "desensitisation", low=0, high=1, none_ok=True),
    _row("f_divergence_type", "choice", "the divergence DPO's log-ratios go through", choices=F_DIVERGENCES),
    _row("f_alpha_divergence_coef", "float", "the alpha of f_divergence_type='alpha_divergence'", low=0,
         low_open=True),
    _row("discopop_tau", "float", "DiscoPOP's temperature", low=0, low_open=True),
    _row("use_weighting", "bool", "WPO's weighting of each pair by its likelihood"),
    _row("truncation_mode", "choice", "which end of a too-long row is kept", choices=("keep_start", "keep_end")),
    _row("precompute_ref_batch_size", "int", "pairs per batch of the reference pass; None = the train / eval "
         "batch size", low=1, high=MAX_INT, none_ok=True),
    _row("disable_dropout", "bool", "dropout off in the policy and the reference"),
    _row("sft_loss_type", "choice", "SFT's token loss", choices=("nll", "dft")),
    _row("packing", "bool", "several rows packed into each sequence"),
    _row("eval_packing", "bool", "the eval rows packed too; None = as packing", none_ok=True),
    _row("packing_strategy", "choice", "how rows are packed", choices=("bfd", "bfd_split", "wrapped")),
    _row("completion_only_loss", "bool", "only the completion's tokens count in the loss; None = when the rows "
         "have a completion", none_ok=True),
    _row("assistant_only_loss", "bool", "only the assistant's tokens count in the loss"),
    _row("shuffle_dataset", "bool", "the training rows shuffled before preparation"),
    _row("padding_free", "bool", "rows concatenated without padding"),
    _row("offload_params", "bool", "master weights on the disk tier too; None = the planner decides from the "
         "host budget", none_ok=True),
    _row("keep_offload_files", "bool", "the disk tier's files left in place when the engine closes"),
    _row("offload_dir", "path", "the folder of the disk tier, made when missing; None = no disk tier",
         none_ok=True),
    _row("sample_every", "int", "optimizer steps between two answers to the sample prompt; None = a tenth of the "
         "run", low=1, high=MAX_INT, none_ok=True),
)

# ---- the estimator's command line (megatrain-nb estimate, %megatrain estimate; issue 44 item 7): each
# number a flag takes, within what a plan can be made for (a larger one is a typo, and overflowed) ----
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
# ---- GRPOConfig's fields a run.yaml grpo: section and a fork change (issue 48 item 5) ----
_GRPO_ROWS = (
    _row("grpo_beta", "float", "GRPO's KL coefficient to the reference (0: no reference, TRL's default); above "
         "1000 the KL term swamps the advantages: a typo?", low=0, high=1000.0),
    _row("grpo_temperature", "float", "GRPO's sampling temperature (also in the loss's log-probs); > 0",
         low=0, low_open=True, high=100.0),
    _row("grpo_loss_type", "choice", "the GRPO loss", choices=GRPO_LOSS_TYPES),
)

_ESTIMATE_ROWS = (
    _row("estimate_batch", "int", "sequences per micro-batch the estimate plans for (--batch)", low=1, high=2 ** 24),
    _row("estimate_seq", "int", "tokens per row the estimate plans for (--seq)", low=1, high=2 ** 28),
    _row("estimate_accumulation", "int", "micro-batches per optimizer step on each GPU (--accumulation)", low=1,
         high=2 ** 40),
    _row("estimate_nodes", "int", "machines in the run (--nodes)", low=1, high=2 ** 20),
    _row("estimate_gpus_per_node", "int", "GPUs (ranks) per node (--gpus-per-node)", low=1, high=2 ** 16),
    _row("estimate_pairs", "int", "DPO preference pairs of the reference pass (--pairs)", low=1, high=2 ** 48),
    _row("estimate_rollouts", "int", "GRPO completions per optimizer step (--rollouts)", low=1, high=2 ** 32),
    _row("estimate_completion_length", "int", "GRPO: the most tokens of a completion (--completion-length)", low=1,
         high=2 ** 28),
)

#: A field whose name means another row in one config family: (family, field) -> row name
#: (DPOConfig's and SFTConfig's ``loss_type`` differ).
ALIASES = {("dpo", "loss_type"): "dpo_loss_type", ("sft", "loss_type"): "sft_loss_type",
           ("grpo", "loss_type"): "grpo_loss_type", ("grpo", "beta"): "grpo_beta",
           ("grpo", "temperature"): "grpo_temperature"}
#: The rows of each TRL config's own fields (beyond TrainingArguments'), by field name.
DPO_FIELDS = ("beta", "label_smoothing", "loss_type", "loss_weights", "ld_alpha", "f_divergence_type",
              "f_alpha_divergence_coef", "discopop_tau", "use_weighting", "truncation_mode",
              "precompute_ref_batch_size", "disable_dropout", "max_length", "padding_free")
SFT_FIELDS = ("loss_type", "packing", "eval_packing", "packing_strategy", "completion_only_loss",
              "assistant_only_loss", "shuffle_dataset", "padding_free", "max_length", "truncation_mode")


def row_name(field: str, family: Optional[str] = None) -> Optional[str]:
    """The table's row of ``field`` in ``family`` ("dpo", "sft" or None), None when it has none."""
    name = ALIASES.get((family, field), field)
    return name if name in VALUES else None


#: Every value a user sets, by name (TrainingArguments / SFTConfig fields, EngineConfig fields,
#: the Trainer's and Session's own options, command values).
VALUES: dict[str, Value] = {v.name: v for v in (
    # ---- the optimizer and its schedule (TrainingArguments; the engine's AdamW) ----
    _row("learning_rate", "float", "the optimizer's step size; above 10 is implausibly large: a typo for a "
         "negative exponent?", low=0, low_open=True, high=10.0),
    _row("weight_decay", "float", "decoupled weight decay of every weight matrix", low=0),
    _row("step_lr", "float", "the learning rate of one optimizer step, a schedule's value; 0 = no update",
         low=0),
    _row("adam_beta1", "float", "AdamW's first-moment decay", low=0, high=1, high_open=True),
    _row("adam_beta2", "float", "AdamW's second-moment decay", low=0, high=1, high_open=True),
    _row("adam_epsilon", "float", "AdamW's denominator term", low=0, low_open=True),
    _row("adam_eps", "float", "AdamW's denominator term", low=0, low_open=True),
    _row("max_grad_norm", "float", "clip the gradients' global norm to it; 0 or None = no clipping", low=0,
         none_ok=True),
    _row("lr_scheduler_type", "choice", "the learning-rate schedule; the metric-driven reduce_lr_on_plateau and "
         "greedy are not supported", choices=_SCHEDULERS),
    _row("warmup_steps", "float", "optimizer steps of linear warm-up (below 1: a fraction of the run)", low=0),
    # ---- how long, how much per step ----
    _row("max_steps", "int", "optimizer steps to train; -1 = num_train_epochs decides", low=1, high=MAX_INT,
         also=(-1,)),
    _row("num_train_epochs", "float", "passes over the training data when max_steps is -1", low=0,
         low_open=True),
    _row("per_device_train_batch_size", "int", "sequences per micro-batch", **_BATCH),
    _row("per_device_eval_batch_size", "int", "sequences per evaluation batch", **_BATCH),
    _row("gradient_accumulation_steps", "int", "micro-batches per optimizer step", **_BATCH),
    _row("seq_len", "int", "tokens per training block; None = the model's context up to 1024", low=2, high=MAX_INT,
         none_ok=True),
    _row("max_length", "int", "tokens per fine-tuning row; None = no limit", low=1, high=MAX_INT, none_ok=True),
    # ---- logging, evaluation, saving ----
    _row("logging_steps", "float", "optimizer steps between logged records (below 1: a fraction of the run)",
         low=0, low_open=True),
    _row("eval_steps", "float", "optimizer steps between evaluations (below 1: a fraction of the run); "
         "None = logging_steps", low=0, low_open=True, none_ok=True),
    _row("save_steps", "float", "optimizer steps between checkpoints (below 1: a fraction of the run)", low=0,
         low_open=True),
    _row("save_total_limit", "int", "checkpoints kept; None = all", low=1, high=MAX_INT, none_ok=True),
    _row("eval_strategy", "choice", "when to evaluate", choices=("no", "steps", "epoch")),
    _row("seed", "int", "the random seed of the model's initialisation and the data order", low=0, high=MAX_SEED),
    _row("data_seed", "int", "the random seed of the data order; None = seed", low=0, high=MAX_SEED, none_ok=True),
    # ---- the engine (EngineConfig and its overrides) ----
    _row("budget_gb", "float", "GiB of a budget the estimator plans with (--vram, --ram, --disk); above a billion "
         "GiB is a typo", low=0, low_open=True, high=1e9),
    _row("max_vram_gb", "float", "GiB of device memory the engine may use; None = no cap", low=0, low_open=True,
         none_ok=True),
    _row("max_host_gb", "float", "GiB of host RAM the engine may use; None = derived from free RAM", low=0,
         low_open=True, none_ok=True),
    _row("host_cache_gb", "float", "GiB of host RAM caching the disk tier, 0 = no cache; None = derived from "
         "max_host_gb / free RAM", low=0, none_ok=True),
    _row("checkpoint_interval", "int", "save every k-th layer's input; 0 = no recompute; None = the planner picks",
         low=0, high=MAX_INT, none_ok=True),
    _row("precision", "choice", "the compute precision (master weights stay fp32)", choices=("fp32", "bf16")),
    _row("optimizer_threads", "int", "threads each AdamW update runs on; None = on CUDA the host's cores less the "
         "engine's step and copy threads, on a CPU device 1 (the compute has the cores)", low=1, high=4096,
         none_ok=True),
    _row("window_tier", "choice", "where a layer-major window keeps its activations",
         choices=("auto", "device", "host", "disk")),
    _row("clip_hold", "choice", "where gradients wait for the clipping norm", choices=("auto", "host", "disk")),
    _row("max_window_micro_batches", "int", "micro-batches one layer-major pass runs; None = as many as fit",
         low=1, high=MAX_INT, none_ok=True),
    _row("device_slots", "int", "layer slots on the device (double buffering); None = the planner picks",
         low=2, high=MAX_INT, none_ok=True),
    _row("loss_chunk_tokens", "int", "tokens per chunk of the head and loss", low=1, high=MAX_INT),
    _row("update_chunk_numel", "int", "optimizer-state elements decoded at a time", low=1, high=MAX_INT),
    _row("inflight_depth", "int", "units in flight per pipeline stage", low=1, high=MAX_INT),
    _row("held_weight_units", "int", "units whose backward read waits for a clipped update; None = what the "
         "host budget allows", low=0, high=MAX_INT, none_ok=True),
    _row("plan_by", "choice", "how the planner's choices are made: 'auto' = the fastest predicted plan when the "
         "machine's rates are known, else the rules; 'rules' = always the rules", choices=("auto", "rules")),
    _row("tile_tokens", "int", "tokens per tile of a layer's MLP over a long row (engine/compute/tiling.py); 0 = no "
         "tiling; None = from the device budget", low=0, high=MAX_INT, none_ok=True),
    # ---- divergence: what a non-finite or spiking step does (engine/updates/finite.py, trainer/recovery.py) ----
    _row("on_nonfinite", "choice", "a non-finite loss or gradient: 'stop' raises before the step is applied, "
         "'skip' drops the step and goes on, 'rewind' goes back to the newest snapshot, lowers the learning "
         "rate, steps over the data that diverged and goes on", choices=("stop", "skip", "rewind")),
    _row("loss_spike", "float", "with on_nonfinite='rewind': also recover from a loss this many robust standard "
         "deviations above its recent median; None = no spike test", low=0, low_open=True, none_ok=True),
    _row("loss_spike_window", "int", "logged steps the spike test's median looks back over", low=5,
         high=MAX_INT),
    _row("recover_lr_factor", "float", "the learning rate is multiplied by it at each recovery", low=0,
         low_open=True, high=1),
    _row("max_recoveries", "int", "recoveries before the run stops, listing every attempt", low=0, high=MAX_INT),
    # ---- a Session's exploration ----
    _row("snapshot_steps", "int", "optimizer steps between snapshots; None = none", low=1, high=MAX_INT,
         none_ok=True),
    _row("keep_snapshots", "int", "snapshots kept; None = all", low=1, high=MAX_INT, none_ok=True),
    _row("step", "int", "an optimizer step", low=0, high=MAX_INT),
    # ---- sampling (Session.generate, the dashboard's samples) ----
    _row("max_new_tokens", "int", "tokens to sample", low=0, high=MAX_INT),
    _row("temperature", "float", "the sampling temperature; 0 = greedy", low=0),
    _row("top_k", "int", "sample among the k likeliest tokens; None or 0 = all", low=0, high=MAX_INT,
         none_ok=True),
    _row("sample_seed", "int", "the sampling generator's seed; None = unseeded", low=0, high=MAX_INT,
         none_ok=True),
    *_FINE_TUNING_ROWS,
    *_ESTIMATE_ROWS,
    *_GRPO_ROWS,
)}


def _short(value: Any) -> str:
    """``repr(value)`` cut short (a 400-digit integer is named by its length)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10 ** 30:
        return f"<an integer of {len(str(abs(value)))} digits>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def rule(name: str) -> str:
    """The words of ``name``'s rule ("must be ..."), as every refusal of it says them."""
    return VALUES[name].rule()


def check(name: str, value: Any, where: Optional[str] = None) -> Any:
    """``value`` as the table's type (a number given as text as that number) when it keeps
    ``name``'s rule; else :class:`ValueRefused` saying ``where`` (default: the name), the value
    and the rule."""
    row = VALUES[name]
    out = _convert(row, value)
    if out is _BAD:
        raise ValueRefused(f"{where or name}={_short(value)}: {row.rule()}")
    return out


_BAD = object()


def _convert(row: Value, value: Any) -> Any:
    if value is None:
        return None if row.none_ok else _BAD
    if row.many:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        out = [_convert_one(row, v) for v in items]
        return out if out and all(v is not _BAD and v is not None for v in out) else _BAD
    return _convert_one(row, value)


_TRUTH = {"true": True, "false": False}


def _convert_one(row: Value, value: Any) -> Any:
    if value is None:
        return _BAD
    if row.kind == "bool":
        if isinstance(value, bool) or type(value).__name__ == "bool_":   # (numpy's bool)
            return bool(value)
        return _TRUTH.get(value.strip().lower(), _BAD) if isinstance(value, str) else _BAD
    if row.kind == "path":
        if isinstance(value, str) or hasattr(value, "__fspath__"):
            text = os.fspath(value)
            return text if isinstance(text, str) and text.strip() and "\0" not in text else _BAD
        return _BAD
    if row.kind == "choice":
        v = getattr(value, "value", value)   # an enum (transformers' SchedulerType) -> its text
        return v if isinstance(v, str) and v in row.choices else _BAD
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) and not hasattr(value, "__float__"):
        return _BAD
    if row.kind == "int":
        n = _as_int(value)
        if n is _BAD or not (n in row.also or _inside(row, n)):
            return _BAD
        return n
    try:
        x = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError, OverflowError):
        return _BAD
    return x if math.isfinite(x) and _inside(row, x) else _BAD


def _as_int(value: Any) -> Any:
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        if len(text) > 40:
            return _BAD
        try:
            return int(text)
        except ValueError:
            return _BAD
    if hasattr(value, "__index__"):   # numpy / torch integers
        return int(value.__index__())
    return _BAD


def _inside(row: Value, x) -> bool:
    if row.low is not None and (x < row.low or (row.low_open and x == row.low)):
        return False
    if row.high is not None and (x > row.high or (row.high_open and x == row.high)):
        return False
    return True


def check_fields(fields: dict, where: str, names=None, family: Optional[str] = None) -> dict:
    """The table's check of every ``fields`` entry it holds (``names``: only those), each named
    ``where.name``; the checked values by name. ``family`` ("dpo", "sft"): the config the fields
    belong to, for the names whose row depends on it (``ALIASES``: ``loss_type``)."""
    return {k: check(row_name(k, family), v, f"{where}.{k}") for k, v in fields.items()
            if row_name(k, family) is not None and (names is None or k in names)}

"""The ``estimate`` command line, below both of its users: ``megatrain-nb estimate`` (the CLI
adds these arguments to its sub-command) and ``%megatrain estimate`` in a notebook (which parses
its words with :func:`estimate_from_words`), so the notebook does not import the CLI above it.
"""
from __future__ import annotations

import argparse
import contextlib
import io

from megatrain_nb.engine.planning.prediction import resolve_rates
from megatrain_nb.engine.planning.estimator import CLI_NAMES, estimate
from megatrain_nb.engine.planning.estimator_dist import estimate_scale_out
from megatrain_nb.model_configs import preset_names
from megatrain_nb.values import MAX_INT, ValueRefused, check


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number >= 1, not {s[:40]!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number >= 1, not {s[:40]!r}")
    if v > MAX_INT:
        raise argparse.ArgumentTypeError(f"takes a whole number <= 2**63-1, not one of {len(s)} digits")
    return v


def table_number(row: str, flag: str):
    """An argparse ``type``: the words of the values table's ``row`` (megatrain_nb/values.py) for a
    number that breaks its rule, as a usage error (exit status 2), never a traceback."""
    def convert(s: str):
        try:
            return check(row, s, flag)
        except ValueRefused as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = row
    return convert


class Lazy:
    """Names read from a registry only when argparse needs them (a choice checked, a help
    printed): the registries live in packages that import torch and transformers, which
    `megatrain-nb --help` has no use for (seconds, cold)."""

    def __init__(self, names) -> None:
        self.names = names

    def __iter__(self):
        return iter(self.names())

    def __contains__(self, x) -> bool:
        return x in self.names()

    def __str__(self) -> str:
        return ", ".join(self.names())


def codec_names_lazy() -> tuple:
    from megatrain_nb.engine.updates.codecs import codec_names  # the codec registry: a new codec is one file

    return codec_names()


def preset_names_lazy() -> list:
    return preset_names()


def add_estimate_arguments(e: argparse.ArgumentParser) -> None:
    """The arguments of ``estimate``: the model, the hardware budgets and the run's shape."""
    codec_names = Lazy(lambda: (*codec_names_lazy(), "auto"))   # auto: the planner picks (planning/codec_choice)
    e.add_argument("model", help="a preset (%(presets)s), a local model folder or a config.json").presets = \
        Lazy(preset_names_lazy)
    e.add_argument("--vram", type=budget_arg, default=80.0, help="device budget in GiB (default 80)")
    e.add_argument("--ram", type=budget_arg, default="auto", help="host RAM in GiB, 'auto' (this machine) or 'none'")
    e.add_argument("--disk", type=budget_arg, default="auto", help="disk tier in GiB, 'auto' (free space) or 'none'")
    e.add_argument("--batch", type=table_number("estimate_batch", "--batch"), default=1)
    e.add_argument("--seq", type=table_number("estimate_seq", "--seq"), default=2048)
    e.add_argument("--compression", default="int8", choices=codec_names, metavar="CODEC",
                   help="optimizer-state codec: %(choices)s (default int8; auto: the planner picks, exact "
                        "states in RAM when they fit)")
    e.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    e.add_argument("--offload-dir", default=None, help="where the disk tier would live (for 'auto' free space)")
    e.add_argument("--no-disk", action="store_true", help="no disk tier")
    e.add_argument("--accumulation", type=table_number("estimate_accumulation", "--accumulation"), default=1,
                   help="micro-batches per optimizer step on each GPU (default 1)")
    e.add_argument("--nodes", type=table_number("estimate_nodes", "--nodes"), default=1,
                   help="machines in the run (default 1); --ram and --disk are per node")
    e.add_argument("--gpus-per-node", type=table_number("estimate_gpus_per_node", "--gpus-per-node"), default=1,
                   help="GPUs (ranks) per node (default 1); the training state is sharded over all of them")
    e.add_argument("--profile", default=None, metavar="NAME",
                   help="also predict the time per step and per 1B tokens on this machine profile "
                        "(megatrain_nb.engine.planning.rates.PROFILES), or 'here' for this machine's measured rates")
    e.add_argument("--json", action="store_true", help="print JSON instead of the table")
    e.add_argument("--pairs", type=table_number("estimate_pairs", "--pairs"), default=None, help="DPO: preference pairs (the reference pass)")
    e.add_argument("--rollouts", type=table_number("estimate_rollouts", "--rollouts"), default=None,
                   help="GRPO: completions per optimizer step (prompts x num_generations); --seq is then prompt + "
                        "completion")
    e.add_argument("--completion-length", type=table_number("estimate_completion_length", "--completion-length"),
                   default=None, help="GRPO: the most tokens of a completion (default 256, TRL's)")
    e.add_argument("--beta", type=float, default=0.0,
                   help="GRPO/DPO: the KL weight (default 0.0, TRL's GRPO); above 0 a reference engine keeps its "
                        "slots on the device, out of generation's room")


def estimate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatrain-nb estimate")
    add_estimate_arguments(parser)
    return parser


def budget_arg(s: str):
    """``--vram/--ram/--disk``: 'auto', 'none' or GiB within the values table's ``budget_gb`` rule."""
    if s.lower() in ("auto",):
        return "auto"
    if s.lower() in ("none", "unlimited", "inf"):
        return None
    try:
        return check("budget_gb", s, "the budget")
    except ValueRefused as e:
        raise argparse.ArgumentTypeError(f"takes a number of GiB, 'auto' or 'none': {e}") from None


def run_estimate(ns):
    """The estimate an ``estimate`` command line asks for (the CLI and ``%megatrain estimate``)."""
    kw = dict(vram_gb=ns.vram, ram_gb=ns.ram, disk_gb=ns.disk, batch=ns.batch, seq=ns.seq,
              compression=ns.compression, precision=ns.precision,
              offload_dir=False if ns.no_disk else (ns.offload_dir or True), names=CLI_NAMES)
    if ns.accumulation != 1:
        kw["accumulation"] = ns.accumulation
    if getattr(ns, "pairs", None):   # DPO: the reference pass and its cache
        kw["pairs"] = ns.pairs
    if getattr(ns, "rollouts", None):   # GRPO: generation before each step
        kw.update(rollouts=ns.rollouts, completion_length=ns.completion_length)
    elif getattr(ns, "completion_length", None):
        kw["completion_length"] = ns.completion_length   # (refused by name: it needs --rollouts)
    if getattr(ns, "beta", 0.0):   # GRPO/DPO: a reference engine beside the policy
        kw["beta"] = ns.beta
    if getattr(ns, "profile", None):
        kw["rates"] = profile_rates(ns.profile)
    if ns.nodes == 1 and ns.gpus_per_node == 1:
        return estimate(ns.model, **kw)

    return estimate_scale_out(ns.model, nodes=ns.nodes, gpus_per_node=ns.gpus_per_node, **kw)


def profile_rates(name: str):
    """``--profile``: a named profile's MachineRates (``engine.rates.PROFILES``), or ``here``: this
    machine's rates (``mt.measure_machine``: cached, else measured, up to a minute)."""
    from megatrain_nb.engine.measure import measure_machine   # (torch's kernels: only when asked)

    return measure_machine() if name == "here" else resolve_rates(name)


def estimate_from_words(words):
    """``%megatrain estimate <words>``: the CLI's own parser; a usage error raises ValueError
    with argparse's message instead of exiting."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = estimate_parser().parse_args(list(words))
    except SystemExit:
        lines = [x for x in err.getvalue().strip().splitlines() if x]
        raise ValueError(lines[-1].replace("megatrain-nb estimate: error: ", "") if lines else
                         "usage: estimate <model> [--vram GB] [--ram GB] [--disk GB] [--nodes M] "
                         "[--gpus-per-node N]") from None
    return run_estimate(ns)

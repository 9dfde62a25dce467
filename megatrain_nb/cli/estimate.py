"""``megatrain-nb estimate``: the memory table for a model on given hardware (also
``%megatrain estimate``)."""
from __future__ import annotations

import argparse
import json


def budget_arg(s: str):
    if s.lower() in ("auto",):
        return "auto"
    if s.lower() in ("none", "unlimited", "inf"):
        return None
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of GiB, 'auto' or 'none', not {s!r}")
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{s!r}: must be > 0")
    return v


def run_estimate(ns):
    """The estimate an ``estimate`` command line asks for (the CLI and ``%megatrain estimate``)."""
    from megatrain_nb.estimator import CLI_NAMES, estimate

    kw = dict(vram_gb=ns.vram, ram_gb=ns.ram, disk_gb=ns.disk, batch=ns.batch, seq=ns.seq,
              compression=ns.compression, precision=ns.precision,
              offload_dir=False if ns.no_disk else (ns.offload_dir or True), names=CLI_NAMES)
    if ns.accumulation != 1:
        kw["accumulation"] = ns.accumulation
    if getattr(ns, "pairs", None):   # DPO: the reference pass and its cache
        kw["pairs"] = ns.pairs
    if getattr(ns, "profile", None):
        kw["rates"] = profile_rates(ns.profile)
    if ns.nodes == 1 and ns.gpus_per_node == 1:
        return estimate(ns.model, **kw)
    from megatrain_nb.estimator_dist import estimate_scale_out  # the state sharded over every GPU

    return estimate_scale_out(ns.model, nodes=ns.nodes, gpus_per_node=ns.gpus_per_node, **kw)


def profile_rates(name: str):
    """``--profile``: a named profile's MachineRates (``engine.rates.PROFILES``, looked up now), or
    ``here``: this machine's rates (``mt.measure_machine``: cached, else measured, up to a minute)."""
    from megatrain_nb.engine.prediction import resolve_rates

    if name != "here":
        return resolve_rates(name)
    try:
        from megatrain_nb.engine.measure import measure_machine
    except ImportError:
        raise ValueError("--profile here: this build cannot measure the machine (no megatrain_nb.engine.measure); "
                         "give a profile name") from None
    return measure_machine()


def estimate_from_words(words):
    """``%megatrain estimate <words>``: the CLI's own parser; a usage error raises ValueError
    with argparse's message instead of exiting."""
    import contextlib
    import io

    from megatrain_nb.cli import build_parser   # (the parser holds every command)

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = build_parser().parse_args(["estimate", *words])
    except SystemExit:
        lines = [x for x in err.getvalue().strip().splitlines() if x]
        raise ValueError(lines[-1].replace("megatrain-nb estimate: error: ", "") if lines else
                         "usage: estimate <model> [--vram GB] [--ram GB] [--disk GB] [--nodes M] "
                         "[--gpus-per-node N]") from None
    return run_estimate(ns)


def cmd_estimate(ns) -> int:
    est = run_estimate(ns)
    print(json.dumps(est.to_dict(), indent=2, default=str) if ns.json else est)
    return 0

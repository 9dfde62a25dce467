"""``megatrain-nb machine``: this machine's measured rates (``mt.measure_machine``, cached), or a
named profile's published figures, as a table."""
from __future__ import annotations

import time

from megatrain_nb.engine.planning.rates import PROFILES, profile_names, rates_for


def cmd_machine(ns) -> int:
    if ns.profiles:
        for name in profile_names():
            print(f"{name:22s} {PROFILES[name].device} + {PROFILES[name].filesystem}")
        print("(published figures, not measured: megatrain-nb machine --profile NAME shows one with its sources)")
        return 0
    if ns.profile is not None:
        print(rates_for(ns.profile))   # an unknown name: ValueError listing the known ones (exit 2)
        return 0
    from megatrain_nb.engine.measure import measure_machine   # light: torch's kernels away from --help

    start = time.time()
    rates = measure_machine(device=ns.device, offload_dir=ns.offload_dir, refresh=ns.refresh)
    print(rates)
    fresh = rates.measured_at is not None and rates.measured_at >= start
    print(f"(measured now, {time.time() - start:.1f} s in all)" if fresh else
          "(cached: megatrain-nb machine --refresh measures again)")
    return 0


def add_parser(sub) -> None:
    """The ``machine`` subcommand's arguments."""
    m = sub.add_parser("machine", help="this machine's rates (copies, matmul, disk, AdamW, codecs), measured "
                                       "and cached; or a named profile's published figures")
    m.add_argument("--refresh", action="store_true", help="measure again (else the cached rates, if any)")
    m.add_argument("--offload-dir", default=None, metavar="DIR",
                   help="measure the disk on this folder's filesystem (default: the temporary folder)")
    m.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    which = m.add_mutually_exclusive_group()
    which.add_argument("--profile", default=None, metavar="NAME",
                       help="show a named profile (published figures, not measured) instead of measuring")
    which.add_argument("--profiles", action="store_true", help="list the named profiles")
    m.set_defaults(func=cmd_machine)

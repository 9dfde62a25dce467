"""engine/transport/issuer.py: collectives announced in the program's order are issued in that order,
whatever the order the worker threads reach them; a cancelled ticket lets the next ones go;
an unannounced worker collective and a ticket that never comes are errors, not hangs."""
import random
import threading
import time

import pytest

from megatrain_nb.engine.ranks.dist import DistError
from megatrain_nb.engine.transport.issuer import Issuer


def _worker(issuer, jobs, seed, order):
    rng = random.Random(seed)
    for kind, key in jobs:
        time.sleep(rng.uniform(0, 0.004))
        issuer.issue(kind, key, lambda k=kind, u=key: order.append((k, u)))


def test_workers_issue_in_the_announced_order_whatever_their_timing():
    for seed in range(4):
        issuer = Issuer(10, DistError)
        issuer.log = []
        program = []   # the program thread: a gather per unit, a reduce-scatter and vote per gradient
        for u in range(12):
            program.append(("gather", u))
            if u >= 3:
                program += [("reduce_scatter", u - 3), ("vote", u - 3)]
        tickets = [issuer.announce(k, u) for k, u in program]
        order = []
        threads = [threading.Thread(target=_worker, args=(issuer, [j for j in program if (j[0] == "gather") == g],
                                                          seed * 2 + g, order)) for g in (True, False)]
        for t in threads:
            t.start()
        issuer.issue("norm", None, lambda: order.append(("norm", None)))   # the program's own, after its announcements
        for t in threads:
            t.join(10)
        assert order == program + [("norm", None)] == issuer.log
        assert issuer.pending() == 0 and all(t.claimed for t in tickets)


def test_a_cancelled_ticket_lets_the_next_go_and_a_claimed_one_stays():
    issuer = Issuer(5, DistError)
    first, second = issuer.announce("gather", 0), issuer.announce("gather", 1)
    done = []
    t = threading.Thread(target=lambda: issuer.issue("gather", 1, lambda: done.append(1)))
    t.start()
    time.sleep(0.05)
    assert done == []            # waits behind ticket 0
    first.cancel()               # its fetch failed before its gather
    t.join(5)
    assert done == [1]
    second.cancel()              # claimed and issued: nothing
    assert issuer.pending() == 0


def test_an_unannounced_worker_collective_and_a_lost_ticket_are_errors():
    issuer = Issuer(0.2, DistError)
    with pytest.raises(DistError, match="did not announce"):
        issuer.issue("reduce_scatter", 3, lambda: None)
    issuer.announce("gather", 0)   # never issued, never cancelled
    with pytest.raises(DistError, match=r"waited 0s for ticket 0"):
        issuer.issue("norm", None, lambda: None)


def test_a_failed_collective_still_passes_the_turn_on():
    issuer = Issuer(2, DistError)
    issuer.announce("gather", 0)
    with pytest.raises(ValueError):
        issuer.issue("gather", 0, lambda: (_ for _ in ()).throw(ValueError("peer gone")))
    assert issuer.issue("norm", None, lambda: 7) == 7


def test_a_collective_made_of_several_runs_in_one_turn():
    issuer = Issuer(2, DistError)
    issuer.log = []
    inner = lambda: issuer.issue("json", None, lambda: 1)   # noqa: E731 - the sizes, then the bytes
    assert issuer.issue("json", None, lambda: inner() + inner()) == 2
    assert issuer.log == [("json", None)] and issuer.pending() == 0

"""The sidebar at scale in a real JupyterLab (Debian's chromium): with sixteen runs that ended,
a paused one and a running one, the running card is first and the ended ones are one folded
group; a fork's card sits in its parent's, which lists it; no branch row is cut without an
ellipsis at the sidebar's default width (issue 36). Runs from two other processes (a script, a
pytest run) are listed after this server's, folded in their own group that says where each comes
from; one from elsewhere that ended long ago is not listed; the status bar counts this server's
runs only (issue 46 item 1).

    pytest -m browser tests/lab/test_sidebar_scale_browser.py
"""
import os
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]


def _row(run_id, name, parent=None, at=None, state="finished", current=False, changes=""):
    return {"run_id": run_id, "name": name, "parent_run_id": parent, "forked_at_step": at, "state": state,
            "step": 160, "loss": 3.1234, "changes": changes, "current": current}


def _origin(pid, command):
    return {"kind": "process", "pid": pid, "parent_pid": 1, "connection_file": None, "command": command}


def _heartbeats(now, kernel_id):
    long = "learning_rate=0.0001, weight_decay=0.05, max_grad_norm=0.5, warmup_steps=20"
    main_rows = [_row("r0", "main (abandoned after step 25)", state="abandoned"),
                 _row("r1", "main", "r0", 25, current=True, changes="rewound to step 25")]
    fork_rows = main_rows[:1] + [dict(main_rows[1], current=False),
                                 _row("f1", "low-lr-with-a-rather-long-branch-name", "r1", 60, "running", True, long)]
    beats = [dict(id=f"old{i:02d}", name=f"old-run-{i}", state="finished", started=now - 9000 + i, ended=now - 5000 + i)
             for i in range(16)]
    beats += [dict(id="paused0001", name="paused-run", state="paused", started=now - 3000),
              dict(id="main000001", name="main", state="finished", started=now - 2000, ended=now - 100,
                   branches=main_rows),
              dict(id="fork000001", name="low-lr-with-a-rather-long-branch-name", state="running", started=now - 50,
                   branches=fork_rows)]
    for b in beats:   # this server's: in the kernel the test started there
        b["kernel_id"] = kernel_id
    beats += [dict(id="script0001", name="session-1-fork-2", state="running", started=now - 500, kernel_id=None,
                   origin=_origin(4242, "python train.py --steps 200")),
              dict(id="pytest0001", name="session-1", state="finished", started=now - 400, ended=now - 30,
                   kernel_id=None, origin=_origin(4343, "pytest tests/test_x.py")),
              dict(id="pytest0002", name="session-2", state="finished", started=now - 9000, ended=now - 4000,
                   kernel_id=None, origin=_origin(4444, "pytest tests/test_y.py"))]
    for b in beats:
        b.update(pid=os.getpid(), notebook=None, step=160, total_steps=200, loss=3.1, lr=1e-3,
                 loss_tail=[4, 3.5, 3.1], memory=None, updated=b.get("ended") or now)
    return beats


def _start_kernel(lab) -> str:
    """A kernel of this server (its runs are "here"): its id."""
    import json
    import urllib.request

    req = urllib.request.Request(f"{lab['url']}/api/kernels", data=b"{}", method="POST",
                                 headers={"Authorization": f"token {lab['token']}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["id"]


def test_the_sidebar_orders_groups_and_nests_at_scale(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    from megatrain_nb.channel.protocol import atomic_write_json, make_private_dir
    from tests.browser import launch_chromium, require_browser, running_lab

    require_browser()
    root = tmp_path / "work"
    root.mkdir()
    sessions = make_private_dir(make_private_dir(tmp_path / "mtnb") / "sessions")
    stop = threading.Event()

    written = set()
    kernel = []   # the id of the kernel started on the server, once it runs

    def beat():   # the live ones' heartbeats, fresh as a beacon keeps them; an ended one's last, once
        while not stop.is_set():
            now = time.time()
            for b in _heartbeats(now, kernel[0]) if kernel else []:
                if b.get("ended") is None or b["id"] not in written:   # (a dismissed run stays dismissed)
                    atomic_write_json(sessions / f"{b['id']}.json", b)
                    written.add(b["id"])
            stop.wait(1.0)

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        with running_lab(tmp_path, root) as lab, sync_playwright() as p:
            kernel.append(_start_kernel(lab))
            browser = launch_chromium(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            try:
                page.goto(f"{lab['url']}/lab?token={lab['token']}&reset")
                status = page.locator(".mtnb-status")
                expect(status).to_contain_text("MegaTrain", timeout=60_000)
                status.click()
                panel = page.locator("#megatrain-nb-sessions")
                expect(panel).to_be_visible()
                top = panel.locator(".mtnb-sessions:not(.mtnb-sessions-finished):not(.mtnb-sessions-elsewhere)"
                                    " > .mtnb-session")
                expect(top).to_have_count(2, timeout=20_000)   # main (with its running fork) and the paused run
                assert top.nth(0).get_attribute("data-session-id") == "main000001"
                assert top.nth(1).get_attribute("data-session-id") == "paused0001"
                # runs from elsewhere: after this server's, folded, each saying where it comes from
                away = panel.locator(".mtnb-elsewhere")
                expect(away.locator(".mtnb-elsewhere-count")).to_have_text("2 from elsewhere")
                expect(away.locator(".mtnb-session").first).to_be_hidden()   # folded
                order = page.evaluate("""() => [...document.querySelectorAll('#megatrain-nb-sessions .mtnb-session')]
                    .map(n => n.dataset.sessionId)""")
                assert order.index("script0001") > max(order.index(i) for i in ("main000001", "paused0001", "old15"))
                assert "pytest0002" not in order   # ended an hour ago elsewhere: aged out
                away.locator(".mtnb-elsewhere-count").click()
                origins = away.locator(".mtnb-session .mtnb-notebook")
                expect(origins).to_have_text(["from python train.py --steps 200 (pid 4242)",
                                              "from pytest tests/test_x.py (pid 4343)"])
                expect(status).to_contain_text("MegaTrain: 1 running / 2")   # the script's run is not counted
                group = panel.locator(".mtnb-finished")
                expect(group.locator(".mtnb-finished-count")).to_have_text("16 finished")
                expect(group.locator(".mtnb-session").first).to_be_hidden()   # folded
                fork = top.nth(0).locator(".mtnb-forks > .mtnb-session")
                expect(fork).to_have_attribute("data-session-id", "fork000001")
                rows = top.nth(0).locator(":scope > .mtnb-branches > .mtnb-branch")
                expect(rows).to_have_count(3)
                # every part of every row is whole, or ends in an ellipsis with the row's full text on hover
                cut = page.evaluate("""() => [...document.querySelectorAll('.mtnb-branch > span')]
                    .filter(s => s.scrollWidth > s.clientWidth + 1 && getComputedStyle(s).textOverflow !== 'ellipsis')
                    .map(s => s.textContent)""")
                assert cut == [], cut
                inside = page.evaluate("""() => [...document.querySelectorAll('.mtnb-branch')].every(
                    r => r.getBoundingClientRect().right <= r.closest('.mtnb-session').getBoundingClientRect().right + 1)""")
                assert inside
                assert "low-lr-with-a-rather-long-branch-name" in rows.nth(2).get_attribute("title")
                # the summary's words fold and unfold it (a click in its middle could land on "Dismiss all")
                group.locator(".mtnb-finished-count").click()
                expect(group.locator(".mtnb-session").first).to_be_visible()
                group.locator(".mtnb-dismiss-all").click()
                expect(group).to_be_hidden(timeout=20_000)
                expect(panel.locator(".mtnb-session[data-state=paused]")).to_have_count(1)
            finally:
                browser.close()
    finally:
        stop.set()
        t.join(5)

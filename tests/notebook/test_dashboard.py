"""The dashboard without a browser: a recording comm stands in for the frontend."""
import threading
import time
from collections import defaultdict

import pytest

from nb_fakes import wait_until


class Recorder:
    def __init__(self):
        self.messages = []  # (time, comm_id, msg_type, data, thread name)
        self.lock = threading.Lock()

    def by_comm(self, since=0.0):
        out = defaultdict(list)
        with self.lock:
            for t, cid, kind, data, _sender in self.messages:
                if t >= since and kind == "comm_msg":
                    out[cid].append((t, data))
        return out


@pytest.fixture
def recording(monkeypatch):
    import comm
    from comm.base_comm import BaseComm

    rec = Recorder()

    class RecordingComm(BaseComm):
        kernel = True  # ipywidgets only sends when the comm has a kernel

        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
            with rec.lock:
                rec.messages.append((time.monotonic(), self.comm_id, msg_type, data,
                                     threading.current_thread().name))

    monkeypatch.setattr(comm, "create_comm", lambda *a, **k: RecordingComm(*a, **k))
    return rec


def _state_keys(data):
    return set((data or {}).get("state", {}))


def test_message_rate_is_bounded_during_hundreds_of_fast_steps(fake_session, recording):
    s = fake_session(total_steps=600, step_time=0.004, eval_every=50)
    d = s.dashboard()  # before training: one synchronous refresh
    s.train()
    t0 = time.monotonic()
    d2 = s.dashboard()  # attaches the live publisher (no kernel here, so train() displayed nothing)
    assert d2 is d and s.publisher is not None
    s.wait(timeout=60)
    s.publisher.join(5)
    t1 = time.monotonic()
    duration = t1 - t0
    assert duration > 2.0, "the run should last a few seconds for the rate to mean something"

    per_comm = recording.by_comm(since=t0)
    total = sum(len(v) for v in per_comm.values())
    # no panel sends more than a few messages per second...
    for cid, msgs in per_comm.items():
        assert len(msgs) <= 4 * 5 * duration + 8, (cid, len(msgs))
    # ...figures are redrawn about once per second at most (one spec per redraw)
    for name, fig in {"training": d.training_fig, "layers": d.layers_fig}.items():
        msgs = [m for _, m in per_comm.get(fig.comm.comm_id, []) if "spec" in (m.get("state") or {})]
        # session.wait() resends each panel's whole state once, from the caller, after the publisher is done
        resent = [m for m in msgs if "_model_name" in m["state"]]
        assert len(resent) == 1 and msgs[-1] is resent[0], (name, len(resent))
        updates = [m for m in msgs if m not in resent]
        assert 2 <= len(updates) <= duration / 1.0 + 2, (name, len(updates), duration)
    assert total / duration < 60, total / duration
    # the header went out at a bounded rate and ended on the final state
    header = per_comm[d.header.comm.comm_id]
    assert len(header) <= duration / 1.0 + 3
    assert "finished" in d.header.value and "600" in d.header.value
    # curves are downsampled, the last step is shown, and eval loss is drawn
    spec = d.training_fig.spec
    loss, evals = spec["loss"], spec["eval"]
    assert 2 < len(loss["x"]) <= 400 and loss["x"][-1] == 600 and spec["step"] == 600
    assert len(evals["x"]) == 12
    # the memory tiers show used against capacity by kind
    assert "device" in d.memory.value and "25.0%" in d.memory.value
    # the training thread never touched a widget; the publisher is gone with the run
    senders = {m[4] for m in recording.messages}
    assert f"mtnb-session-{s.name}" not in senders
    assert f"mtnb-publisher-{s.name}" in senders and not s.publisher.running


def test_buttons_and_the_lr_field_change_the_run(fake_session, recording):
    s = fake_session(total_steps=5000, step_time=0.003, lr=1e-3)
    s.train()
    d = s.dashboard()
    assert wait_until(lambda: s.step >= 3)
    d.pause_button.click()
    assert wait_until(lambda: s.state == "paused")
    held = s.step
    time.sleep(0.2)
    assert s.step == held
    assert wait_until(lambda: d.pause_button.description == "Resume", timeout=3)
    d.lr_field.value = 5e-4  # what typing a value + Enter does
    assert wait_until(lambda: any(e["kind"] == "lr" for e in s.events))
    d.lr_apply.click()  # the same value again: nothing new to apply
    assert "already" in d._notice_text
    d.pause_button.click()
    assert wait_until(lambda: s.state == "running")
    assert wait_until(lambda: s.step >= held + 5)
    d.checkpoint_button.click()
    assert wait_until(lambda: any(e["kind"] == "checkpoint" for e in s.events))
    d.stop_button.click()
    assert wait_until(lambda: s.state == "stopped")
    assert [e["kind"] for e in s.events] == ["pause", "lr", "resume", "checkpoint", "stop"]
    assert {e["source"] for e in s.events} == {"widget"}
    lr_event = s.events[1]
    assert lr_event["step"] == held and lr_event["value"] == 5e-4
    assert all(lr == (1e-3 if step <= held else 5e-4) for step, lr in s.trainer.lrs_used)
    assert wait_until(lambda: d.stop_button.disabled and d.pause_button.disabled, timeout=3)


def test_bad_lr_in_the_field_is_reported_not_raised(fake_session, recording):
    s = fake_session(total_steps=10)
    d = s.dashboard()
    d._apply_lr(-1)
    assert "must be" in d._notice_text
    assert s.events == []


def test_layer_inspector_follows_the_selection(fake_session, recording):
    s = fake_session(total_steps=20)
    s.train(block=True)
    d = s.dashboard()  # ended run: one synchronous refresh
    assert d.layer_select.options == tuple(s.unit_names())
    assert d.layer_select.value == "model.layers.0"
    assert "grad norm" in d.layer_stats.value
    spec = d.layers_fig.spec
    assert spec["hist"]["counts"] == [1, 3, 7, 3, 1]
    heat = spec["heat"]
    assert (len(heat["z"]), len(heat["z"][0])) == (5, 20) and heat["units"] == s.unit_names()
    d.layer_select.value = "head"
    d.metric.value = "update_ratio"
    assert d.refresh(force=True) >= 1
    spec = d.layers_fig.spec
    assert "head" in spec["hist_title"] and "head" in d.layer_stats.value
    assert "update" in spec["heat"]["label"]


class FakeHandle:
    def __init__(self):
        self.updates = []

    def update(self, obj, raw=False):
        self.updates.append((time.monotonic(), dict(obj), threading.current_thread().name))


def test_html_fallback_is_rate_limited_and_ends_with_a_static_snapshot(fake_session):
    from megatrain_nb.notebook.publisher import Publisher

    s = fake_session(total_steps=300, step_time=0.008)
    pub = Publisher(s, html_live=True)
    pub.html_handle = FakeHandle()
    s.publisher = pub
    pub.start()
    t0 = time.monotonic()
    s.train()
    s.wait(timeout=30)
    pub.join(5)
    duration = time.monotonic() - t0
    ups = pub.html_handle.updates
    assert 2 <= len(ups) <= duration / 1.0 + 3
    assert "Static snapshot" in ups[-1][1]["text/html"] and "finished" in ups[-1][1]["text/html"]
    assert "<script" not in ups[-1][1]["text/html"]
    s.wait()  # from the caller's thread again (what nbclient needs)
    assert ups[-1][2] == threading.current_thread().name and "Static snapshot" in ups[-1][1]["text/html"]


def test_a_rendering_widget_frontend_retires_the_html_fallback(fake_session, recording):
    from megatrain_nb.notebook.publisher import Publisher

    s = fake_session(total_steps=2000, step_time=0.005)
    d = s.dashboard()
    pub = Publisher(s, dashboard=d, html_live=True)
    pub.html_handle = FakeHandle()
    s.publisher = pub
    pub.start()
    s.train()
    assert wait_until(lambda: len(pub.html_handle.updates) >= 1)
    d.probe._got(d.probe, {"event": "rendered"}, [])  # what the frontend view sends on render
    assert wait_until(lambda: pub.html_handle.updates[-1][1].get("text/html") == "")
    n = len(pub.html_handle.updates)
    s.wait(timeout=30)
    pub.join(5)
    later = [u[1].get("text/html", "") for u in pub.html_handle.updates[n:]]
    # no live summary any more: only the final snapshot (from the publisher, then from wait())
    assert later and all("Static snapshot" in h for h in later)


def test_failed_run_shows_the_error_in_the_header(fake_session, recording):
    def boom(step):
        if step == 5:
            raise RuntimeError("bad batch")
        return 1.0

    s = fake_session(total_steps=50, loss_fn=boom, step_time=0.05)
    d = s.dashboard()
    s.train()
    s.dashboard()
    assert s.publisher is not None
    with pytest.raises(RuntimeError):
        s.wait(timeout=10)
    s.publisher.join(5)
    assert "failed" in d.header.value and "bad batch" in d.header.value and "Traceback" in d.header.value


def test_refresh_serves_each_registered_panel_and_resends_only_what_changed(fake_session):
    from megatrain_nb.notebook.dashboard import PANELS

    names = [p.name for p in PANELS]
    assert len(set(names)) == len(names) and {"header", "controls", "training", "layers"} <= set(names)
    s = fake_session(total_steps=3)
    d = s.dashboard()  # idle: refreshed once, every panel
    assert d.refresh(force=True) == 0  # nothing changed since
    d.layer_select.value = d.layer_select.options[-1]  # a user's choice shows at once, only that panel
    assert d.refresh() == 1 and "no statistics yet" in d.layer_stats.value
    s.train(block=True)
    assert d.refresh(force=True) >= 3  # header, controls (state), training, layers... changed


def _header_step(d):
    import re

    return int(re.search(r"data-step='(\d+)'", d.header.value).group(1))


def test_every_panel_shows_one_snapshot_after_each_refresh(fake_session):
    """Header, curves, inspector and extra figures are filled from one view: never two steps."""
    s = fake_session(total_steps=2000, step_time=0.005)
    d = s.dashboard()
    seen = []
    d.add_figure(__import__("ipywidgets").HTML(), fill=lambda view: seen.append(view.step))
    s.train()
    checked = 0
    while s.state == "running" and checked < 12:
        # every 0.3 s: past the quick panels' interval each time, the data panels' now and then
        if d.refresh() and _header_step(d) > 0:
            step = _header_step(d)
            assert d.training_fig.spec["step"] == step
            assert f"(step {step})" in d.layers_fig.spec["hist_title"] and f"step {step}<" in d.layer_stats.value
            assert seen[-1] == step
            checked += 1
        time.sleep(0.3)
    s.stop()
    s.wait(timeout=30)
    assert checked >= 5


def test_no_eta_while_paused(fake_session):
    from megatrain_nb.notebook.magics import status_line

    s = fake_session(total_steps=5000, step_time=0.003)
    s.train()
    d = s.dashboard()
    assert wait_until(lambda: s.step >= 5)
    assert wait_until(lambda: "ETA" in status_line(s))
    s.pause()
    assert wait_until(lambda: s.state == "paused")
    assert "ETA" not in status_line(s) and "paused" in status_line(s)
    d.refresh(force=True)
    assert "ETA" not in d.header.value and "paused" in d.header.value
    s.stop()
    s.wait(timeout=10)


def test_memory_tiers_say_when_a_tier_has_no_cap(fake_session):
    s = fake_session(total_steps=20)
    s.train(block=True)
    d = s.dashboard()
    disk = d.memory.value.split("data-tier='disk'")[1]
    assert "no limit set" in disk.split("</span>")[0] and "%" not in disk.split("</span>")[0]
    host = d.memory.value.split("data-tier='host'")[1]
    assert "15.6 KiB used of 62.5 KiB (25.0%) · 46.9 KiB free" in host
    # the room left is its own segment, in its own colour (not the grey "other") -- issue 46 item 4
    assert "data-kind='free'" in host.split("data-tier=")[0] and "title='free: 46.9 KiB'" in host
    assert "share of its peak" not in d.memory.value

"""A run shown once (issue 46 item 2): the static snapshot a run leaves carries its run's class,
and its dashboard's render probe hides exactly that class on a page where the dashboard renders;
memory bars in words a person would say (item 4)."""
from megatrain_nb.notebook.probe import RenderProbe
from megatrain_nb.notebook.summary_html import final_key, memory_tiers_html, summary_html


def test_the_final_snapshot_is_the_one_the_dashboards_probe_hides(fake_session):
    s = fake_session(total_steps=5)
    s.train(block=True)
    d = s.dashboard()
    key = final_key(s)
    assert key and key == "".join(c for c in str(s.id) if c.isalnum() or c in "_-")
    assert d.probe.key == key
    final = summary_html(s, s.run_log.view(), final=True)
    assert final.startswith(f"<div class='megatrain-summary mtnb-final-snapshot mtnb-final-{key}'")
    live = summary_html(s, s.run_log.view())   # the live fallback (no widget frontend) is not hidden
    assert live.startswith("<div class='megatrain-summary' ") and "mtnb-final" not in live
    # the probe's view writes the rule for its own run only
    assert ".mtnb-final-${key} { display: none !important; }" in RenderProbe._esm
    assert RenderProbe(key="abc").key == "abc"


def test_tier_words_without_a_limit(fake_session):
    s = fake_session(total_steps=3)
    s.train(block=True)
    view = s.run_log.view()
    view.memory = {"device": {"weights": 2048, "used_bytes": 2048, "peak_bytes": 8192, "capacity_bytes": None},
                   "disk": {"weights": 0, "used_bytes": 0, "peak_bytes": 0, "capacity_bytes": None},
                   "host": {"weights": 1024, "used_bytes": 4096, "peak_bytes": 4096, "capacity_bytes": 16384}}
    out = memory_tiers_html(view)
    device, disk, host = (out.split(f"data-tier='{t}'")[1].split("</span>")[0] for t in ("device", "disk", "host"))
    assert device.endswith("2.0 KiB in use, at most 8.0 KiB so far (no limit set)")
    assert disk.endswith("nothing stored here (no limit set)")
    assert host.endswith("4.0 KiB used of 16.0 KiB (25.0%) · 12.0 KiB free")
    host_bar = out.split("data-tier='host'")[1].split("data-tier=")[0]
    assert "data-kind='other'" in host_bar and "title='other: 3.0 KiB'" in host_bar   # what is not itemised
    assert "title='free: 12.0 KiB'" in host_bar   # the room left, in its own colour

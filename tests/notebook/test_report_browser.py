"""The exported HTML report in Debian's chromium, offline (a file URL; no server): every chart is
drawn by the dashboard's own chart module, a pointer over a curve reads its values, and the
page stays under 1 MB (issue 36: 5.2 MB of inlined plotly.js).

    pytest -m browser tests/notebook/test_report_browser.py
"""
import pytest

from nb_fakes import wait_until

pytestmark = pytest.mark.browser


def test_the_html_report_draws_its_charts_and_reads_values_on_hover(fake_session, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    from tests.browser import launch_chromium, require_browser

    require_browser()
    s = fake_session(total_steps=400, step_time=0.002, eval_every=50)
    s.train()
    assert wait_until(lambda: s.step >= 60)
    s.pause()
    assert wait_until(lambda: s.state == "paused")
    s.set_lr(5e-4)
    s.resume()
    s.wait(timeout=60)
    path = s.export_report(tmp_path / "run.html")
    assert (tmp_path / "run.html").stat().st_size < 1_000_000
    with sync_playwright() as p:
        browser = launch_chromium(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.route("**/*", lambda route: route.abort() if not route.request.url.startswith("file:")
                       else route.continue_())   # offline: nothing but the file itself
            page.goto(f"file://{path}")
            charts = page.locator(".mtnb-static-chart")
            expect(charts.first.locator("svg.mtnb-chart-loss")).to_have_count(1, timeout=20_000)
            assert charts.count() >= 4 and not errors, errors
            expect(page.locator(".mtnb-static-chart img")).to_have_count(0)   # every fallback replaced
            expect(page.locator(".mtnb-chart-marker", has_text="lr 0.001→0.0005")).to_have_count(1)
            loss = page.locator("svg.mtnb-chart-loss").first
            loss.scroll_into_view_if_needed()
            box = loss.bounding_box()
            page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] * 0.6)
            tip = page.locator(".mtnb-hover").first
            expect(tip).to_be_visible(timeout=5_000)
            expect(tip).to_contain_text("step")
            expect(tip).to_contain_text("train loss:")
        finally:
            browser.close()

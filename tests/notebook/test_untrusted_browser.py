"""A notebook opened untrusted (anything nbconvert executed, any notebook from someone else) in
JupyterLab in Debian's chromium: its static snapshot and inspect() table read as they should
(issue 36: the sanitizer took the inline SVG apart: "resumepause · lr … resumeloss 5.51–8.32",
a histogram as "-0.096291.037", and "needs a widget frontend" beside it).

    pytest -m browser tests/notebook/test_untrusted_browser.py
"""
import json
import re

import pytest

pytestmark = pytest.mark.browser


def _outputs(s):
    from megatrain_nb.notebook.summary_html import summary_html

    dash = s.dashboard()._repr_mimebundle_()
    return [
        [{"output_type": "display_data", "metadata": {}, "data": dash},
         {"output_type": "display_data", "metadata": {},
          "data": {"text/html": summary_html(s, s.run_log.view(), final=True), "text/plain": repr(s)}}],
        [{"output_type": "execute_result", "metadata": {}, "execution_count": 2,
          "data": {"text/html": s.inspect(0)._repr_html_(), "text/plain": repr(s.inspect(0))}}],
    ]


def test_an_untrusted_notebook_shows_the_snapshot_and_the_histogram_whole(fake_session, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    from tests.browser import launch_chromium, require_browser, running_lab

    require_browser()
    s = fake_session(total_steps=120, step_time=0.001)
    s.train()
    s.wait(timeout=30)
    s.run_log.add_event("pause", 60, source="test")
    s.run_log.add_event("resume", 60, source="test")
    root = tmp_path / "work"
    root.mkdir()
    outs = _outputs(s)
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": src, "outputs": o, "execution_count": i + 1}
                    for i, (src, o) in enumerate(zip(["session.train()", "session.inspect(0)"], outs))],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    (root / "untrusted.ipynb").write_text(json.dumps(nb))   # no signature: JupyterLab opens it untrusted
    with running_lab(tmp_path, root) as lab, sync_playwright() as p:
        browser = launch_chromium(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{lab['url']}/lab/tree/untrusted.ipynb?token={lab['token']}&reset")
            out = page.locator(".jp-Notebook .jp-OutputArea-output")
            summary = out.locator(".megatrain-summary")
            expect(summary).to_be_visible(timeout=60_000)
            for alt in ("loss curve", "weight histogram"):
                image = out.locator(f"img[alt='{alt}']")
                expect(image).to_be_visible(timeout=10_000)
                assert image.evaluate("i => i.naturalWidth > 100 && i.getBoundingClientRect().height > 40"), alt
            text = " ".join(out.all_inner_texts())
            assert "needs a widget frontend" not in text
            assert not re.search(r"resumepause|pause · resumeloss|\d\.\d+-?\d\.\d+</", text), text[:500]
            assert "step" in text and "Static snapshot" in text
        finally:
            browser.close()

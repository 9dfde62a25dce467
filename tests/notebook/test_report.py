"""Reports: the notebook validates, the HTML opens offline and shows the run."""
import re
from html.parser import HTMLParser

import nbformat
import pytest

from nb_fakes import wait_until


class _Resources(HTMLParser):
    """Every URL the page would fetch when opened: script/img/iframe src, stylesheet links,
    CSS url(...) and @import."""

    def __init__(self):
        super().__init__()
        self.urls = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in ("script", "img", "iframe", "embed", "source", "audio", "video") and a.get("src"):
            self.urls.append(a["src"])
        if tag == "link" and a.get("href") and "stylesheet" in (a.get("rel") or "") + (a.get("as") or ""):
            self.urls.append(a["href"])
        if tag == "link" and a.get("rel") in ("preload", "modulepreload", "import") and a.get("href"):
            self.urls.append(a["href"])


def _network_urls(page: str) -> list[str]:
    p = _Resources()
    p.feed(page)
    css = re.findall(r"@import\s+(?:url\()?['\"]?(https?:[^'\")\s]+)", page)
    css += re.findall(r"url\(\s*['\"]?(https?://[^'\")]+)", _styles(page))
    return [u for u in p.urls + css if not u.startswith("data:")]


def _styles(page: str) -> str:
    return "".join(re.findall(r"<style[^>]*>(.*?)</style>", page, flags=re.S))


@pytest.fixture
def finished_session(fake_session):
    s = fake_session(total_steps=120, step_time=0.002, eval_every=30)
    s.train()
    assert wait_until(lambda: s.step >= 40)
    s.pause()
    assert wait_until(lambda: s.state == "paused")
    s.set_lr(5e-4)
    s.resume()
    s.wait(timeout=30)
    s.generate("hi", max_new_tokens=4, temperature=0)
    return s


def _chart_specs(page: str) -> list[dict]:
    """The spec of every chart on the page (what chart.js draws there)."""
    import json

    class Charts(HTMLParser):
        specs = []

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if "mtnb-static-chart" in (a.get("class") or ""):
                self.specs.append(json.loads(a["data-spec"]))

    p = Charts()
    p.specs = []
    p.feed(page)
    return p.specs


def test_html_report_opens_offline_and_shows_loss_and_lr_marker(finished_session, tmp_path):
    s = finished_session
    path = s.export_report(tmp_path / "run.html")
    page = open(path, encoding="utf-8").read()
    assert _network_urls(page) == []
    assert "require.min.js" not in page and "mathjax/2.7.7" not in page and "mermaid.esm" not in page
    # the dashboard's own chart module draws every chart (inlined: no plotly.js, ~5 MB a report)
    assert "window.mtnbChart" in page and "Plotly" not in page and len(page) < 1_000_000
    specs = _chart_specs(page)
    assert [sp["kind"] for sp in specs][:2] == ["training", "panels"] and len(specs) >= 4
    assert "Loss and learning rate" in page
    lr = [e for e in s.events if e["kind"] == "lr"][0]
    markers = {e["step"]: e["label"] for e in specs[0]["events"]}
    assert "lr 0.001→0.0005" in markers[lr["step"]]   # the marker's label, at the step it happened
    assert "Interventions" in page and "Per-layer statistics" in page and "Environment" in page
    assert "model.layers.2" in page and "hi" in page  # layer table and the sample
    assert not list(tmp_path.glob(".run.html.*"))  # no temporary left behind


def test_ipynb_report_validates_and_carries_figures(finished_session, tmp_path):
    path = finished_session.export_report(str(tmp_path / "run.ipynb"))
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    charts = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "mtnb-static-chart" in o.get("data", {}).get("text/html", "")]
    assert len(charts) >= 4
    # where scripts do not run (an untrusted notebook), an image of each curve chart stays
    assert sum("<img alt=" in o["data"]["text/html"] for o in charts) >= 3
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "| 40 | lr |" in text.replace(f"| {finished_session.events[1]['step']} | lr |", "| 40 | lr |")
    assert "Training report" in text


def test_report_of_a_failed_run_says_so(fake_session, tmp_path):
    def boom(step):
        if step == 5:
            raise ValueError("loss exploded")
        return 1.0

    s = fake_session(total_steps=20, loss_fn=boom)
    s.train()
    with pytest.raises(ValueError):
        s.wait(timeout=10)
    page = open(s.export_report(tmp_path / "failed.html"), encoding="utf-8").read()
    assert "The run failed" in page and "loss exploded" in page


def test_report_path_must_be_ipynb_or_html(fake_session, tmp_path):
    with pytest.raises(ValueError, match=".ipynb or .html"):
        fake_session().export_report(tmp_path / "x.pdf")


# -- escaping: a hostile session name, path, exception and traceback run no script ------------

HOSTILE_NAME = "run<img src=x onerror=alert(1)>[a](javascript:alert(2))"
HOSTILE_ERROR = "</code><script>alert(3)</script>``` <img src=y onerror=alert(4)>"


class _Active(HTMLParser):
    """Tags and attributes that would run script: script bodies calling alert, on* handlers,
    javascript: URLs."""

    def __init__(self):
        super().__init__()
        self.found, self._in_script = [], False

    def handle_starttag(self, tag, attrs):
        self._in_script = tag == "script"
        for k, v in attrs:
            if k.startswith("on") or (k in ("href", "src", "action", "formaction")
                                       and (v or "").strip().lower().startswith("javascript:")):
                self.found.append((tag, k, v))

    def handle_data(self, data):
        if self._in_script and "alert(" in data:
            self.found.append(("script", data[:80]))


@pytest.fixture
def hostile_session(fake_session, tmp_path):
    def boom(step):
        if step == 4:
            raise ValueError(HOSTILE_ERROR)
        return 1.0

    out = tmp_path / "o<img src=z onerror=alert(5)>"
    s = fake_session(name=HOSTILE_NAME, total_steps=20, loss_fn=boom, output_dir=str(out))
    s.generate("<script>alert(6)</script>", max_new_tokens=2, temperature=0)
    s.train()
    with pytest.raises(ValueError):
        s.wait(timeout=10)
    return s


def test_report_escapes_user_and_error_strings(hostile_session, tmp_path):
    page = open(hostile_session.export_report(tmp_path / "r.html"), encoding="utf-8").read()
    p = _Active()
    p.feed(page)
    assert p.found == []
    # ...while the strings are still shown, as text
    text = re.sub(r"<[^>]+>", "", page)
    assert "alert(3)" in text and "onerror=alert(1)" in text.replace("&gt;", ">").replace("&lt;", "<")
    nb = nbformat.read(hostile_session.export_report(tmp_path / "r.ipynb"), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            assert "<img" not in cell.source and "<script" not in cell.source
            assert not re.search(r"(?<!\\)\]\(javascript", cell.source)  # an unescaped markdown link


def test_report_in_a_browser_fires_no_dialog(hostile_session, tmp_path):
    from test_dashboard_browser import CHROMIUM
    import os
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"chromium not found at {CHROMIUM} (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    page_path = hostile_session.export_report(tmp_path / "r.html")
    control = tmp_path / "control.html"  # proves the harness sees a dialog when one fires
    control.write_text("<html><body><img src=x onerror=alert(1)></body></html>")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            seen = {}
            for path in (control, page_path):
                page = browser.new_page()
                dialogs = []
                page.on("dialog", lambda d, dialogs=dialogs: (dialogs.append(d.message), d.dismiss()))
                page.goto(f"file://{path}", wait_until="load", timeout=30_000)
                page.wait_for_timeout(1000)  # onerror handlers of broken images fire after load
                seen[str(path)] = dialogs
                page.close()
        finally:
            browser.close()
    assert seen[str(control)] == ["1"]
    assert seen[str(page_path)] == []

"""The status page as a browser shows it: headless Chromium (Debian's ``chromium``).

Pages are rendered in process from synthetic /status documents and histories, then
loaded by a real browser: from a file, with a script appended that measures the layout
(the boxes of the charts' labels, the points of their lines, the font sizes) and writes
what it found into the document, which ``--dump-dom`` prints; or from a one-shot HTTP
server on 127.0.0.1 that serves the page once and then is gone, as an activator that
stopped. ``--virtual-time-budget`` runs the page's timers (its refreshes, the stale
banner's count) without waiting for them. The same page, served by a running activator,
is checked in ``e2e/test_operator_view.py``.
"""

from __future__ import annotations

import http.server
import json
import re
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from test_page import synthetic_history, synthetic_status

from activator.ops.page import render_page

pytestmark = pytest.mark.skipif(
    shutil.which("chromium") is None, reason="chromium is not installed (apt-get install chromium)"
)


def chromium(url: str, *args: str) -> str:
    """The DOM of ``url`` once loaded (and the virtual time of ``args`` spent)."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        done = subprocess.run(
            [
                "chromium",
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                f"--user-data-dir={profile}",
                *args,
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class Texts(HTMLParser):
    """Text of the elements with an ``id`` or a ``data-legend``, by that name."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: dict[str, str] = {}
        self._open: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        name = a.get("data-legend") or a.get("id") or (f"class:{a['class']}" if a.get("class") else None)
        self._open.append(name)
        if name is not None:
            self.texts.setdefault(name, "")

    def handle_endtag(self, tag: str) -> None:
        if self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for name in self._open:
            if name is not None:
                self.texts[name] += data


def texts(dom: str) -> dict[str, str]:
    parser = Texts()
    parser.feed(dom)
    return {name: " ".join(text.split()) for name, text in parser.texts.items()}


def load_file(tmp_path: Path, page: str, script: str = "") -> str:
    """Load ``page`` from a file (``script`` appended at the end of its body)."""
    path = tmp_path / "page.html"
    path.write_text(page.replace("</body>", f"<script>{script}</script></body>") if script else page)
    return chromium(path.as_uri())


# --------------------------------------------------------------------------------------


def busy_status(queued: int, in_flight: int, capacity: int) -> dict[str, Any]:
    status = synthetic_status(3)
    service = status["services"]["api"]
    service.update(queued=queued, queue_depth=30, in_flight=in_flight, capacity=capacity)
    service["requests_per_second"] = 4.5
    service["per_second"] = {"requests": 4.5, "responses": {"5xx": 0.5}, "rejected": 1.2}
    return status


def test_the_legends_say_what_the_summary_beside_them_says(tmp_path: Path) -> None:
    history = synthetic_history(seconds=60)
    api = history["services"]["api"]
    api["queued"][-1], api["in_flight"][-1], api["capacity"][-1] = 7, 1, 1  # a second ago
    api["requests"][-1] = 9
    status = busy_status(queued=5, in_flight=3, capacity=3)
    dom = load_file(tmp_path, render_page(status, history))
    summary = texts(dom)["class:summary"]
    load, rates = (
        " ".join(re.sub("<[^>]+>", " ", c).split()) for c in re.findall(r"<figcaption>(.*?)</figcaption>", dom)[:2]
    )
    assert "queued 5/30" in summary and "in flight 3" in summary and "capacity 3" in summary
    assert re.search(r"queued (\d+) in flight (\d+) capacity (\d+)", load).groups() == ("5", "3", "3"), load
    assert "4.5 req/s" in summary and "5xx 0.5/s" in summary and "rejected 1.2/s" in summary
    assert re.match(r"req/s 4\.5 5xx 0\.5/s rejected 1\.2/s", rates), rates


# For each chart: the boxes of its texts, and whether a vertex of a line lies in one;
# the smallest label font.
LAYOUT_SCRIPT = """
var out = {charts: [], smallest: 1e9};
document.querySelectorAll('svg.spark').forEach(function (svg) {
  var boxes = Array.prototype.map.call(svg.querySelectorAll('text'), function (t) {
    out.smallest = Math.min(out.smallest, parseFloat(getComputedStyle(t).fontSize));
    var b = t.getBBox();
    return {text: t.textContent, x: b.x, y: b.y, w: b.width, h: b.height};
  });
  var crossed = [];
  svg.querySelectorAll('polyline').forEach(function (line) {
    var width = parseFloat(line.getAttribute('stroke-width') || '1') / 2;
    line.getAttribute('points').trim().split(/\\s+/).forEach(function (p) {
      var xy = p.split(',').map(parseFloat);
      boxes.forEach(function (b) {
        if (xy[0] >= b.x - width && xy[0] <= b.x + b.w + width && xy[1] >= b.y - width && xy[1] <= b.y + b.h + width) {
          crossed.push(b.text + ' at ' + p);
        }
      });
    });
  });
  out.charts.push({label: svg.getAttribute('aria-label'), texts: boxes.map(function (b) { return b.text; }),
                   crossed: crossed});
});
var pre = document.createElement('pre');
pre.id = 'layout';
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
"""


def layout(tmp_path: Path, history: dict[str, Any]) -> dict[str, Any]:
    dom = load_file(tmp_path, render_page(busy_status(2, 1, 1), history), LAYOUT_SCRIPT)
    found = re.search(r"<pre id=\"layout\">(.*?)</pre>", dom, re.S)
    assert found is not None, dom[-2000:]
    result: dict[str, Any] = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    return result


def test_no_line_is_drawn_over_a_label_and_the_labels_are_readable(tmp_path: Path) -> None:
    history = synthetic_history(seconds=120)
    api = history["services"]["api"]
    # The worst case for labels: the largest value in the first and last seconds (under
    # the scale at the top left), zeros along the bottom (over the time axis).
    api["requests"] = [9] + [0] * 118 + [9]
    api["queued"] = [5] + [0] * 118 + [5]
    api["queue_wait_p99"] = [0.5] + [0.0] * 118 + [0.5]
    found = layout(tmp_path, history)
    assert len(found["charts"]) == 3
    for chart in found["charts"]:
        assert chart["crossed"] == [], f"{chart['label']}: lines drawn over its labels"
        assert len(chart["texts"]) == 3, chart
    assert found["smallest"] >= 11, "labels of at least 11 px"


def test_a_sub_millisecond_chart_is_labelled_in_milliseconds(tmp_path: Path) -> None:
    history = synthetic_history(seconds=60)
    api = history["services"]["api"]
    api["queue_wait_p99"] = [0.0004] * len(api["t"])
    (p99,) = [c for c in layout(tmp_path, history)["charts"] if c["label"].startswith("queue wait")]
    scale = p99["texts"][0]
    assert scale.endswith(" ms") and scale != "0 s", p99["texts"]


def test_a_configuration_without_services_says_so(tmp_path: Path) -> None:
    status = synthetic_status(1)
    status["services"] = {}
    shown = texts(load_file(tmp_path, render_page(status, {"services": {}, "last": 0})))
    message = shown["class:no-services"]
    assert message.startswith("no services: /etc/activator/activator.yaml configures none"), message


# --------------------------------------------------------------------------------------
# refreshes that fail


class OneShotServer:
    """Answers the page's address on 127.0.0.1 with ``answers`` in turn ("page": the
    page, "503": an activator in trouble), then closes (an activator that stopped), or,
    given ``later``, serves that page from then on. Other paths (the favicon) get 404
    and use no answer."""

    def __init__(self, page: str, answers: list[str], later: str | None = None) -> None:
        self.page = page.encode()
        self.later = later.encode() if later is not None else b""
        self.answers = list(answers)
        self.then = "gone" if later is None else "later"
        self.served: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/":
                    self.send_error(404)
                    return
                answer = outer.answers.pop(0) if outer.answers else outer.then
                outer.served.append(answer)
                body = {"page": outer.page, "later": outer.later}.get(answer, b"busy\n")
                self.send_response(503 if answer == "503" else 200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                if not outer.answers and outer.then == "gone":
                    threading.Thread(target=outer.server.shutdown, daemon=True).start()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.server.serve_forever(poll_interval=0.05)
        self.server.server_close()  # refused from now on

    def __enter__(self) -> OneShotServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.thread.join(5)


@pytest.fixture
def page() -> Iterator[str]:
    yield render_page(busy_status(1, 1, 1), synthetic_history(seconds=30))


def refused(url: str) -> bool:
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return True
    return False


def test_a_page_whose_refreshes_fail_says_it_is_stale(page: str) -> None:
    with OneShotServer(page, ["page"]) as server:
        dom = chromium(server.url, "--virtual-time-budget=9000")
        assert refused(server.url), "the server is gone after its one page"
    banner = texts(dom).get("stale", "")
    seconds = re.fullmatch(r"stale: last refresh failed (\d+) s ago \((.+)\)", banner)
    assert seconds is not None, banner or dom[-3000:]
    assert 1 <= int(seconds.group(1)) <= 9, "counted from the first refresh that failed, every second"
    assert 'class="stale"' in dom, "the page is dimmed"
    assert server.served == ["page"]


def test_an_error_answer_is_a_failed_refresh_and_the_next_good_one_clears_it(page: str) -> None:
    with OneShotServer(page, ["page", "503"], later=page) as server:
        dom = chromium(server.url, "--virtual-time-budget=2500")  # one failed refresh
    shown = texts(dom)
    assert shown.get("stale", "").startswith("stale: last refresh failed "), "an answer that is not 200"
    assert "HTTP 503" in shown["stale"]
    fresh = page.replace("<h1>activator", "<h1 id='fresh'>activator", 1)
    with OneShotServer(page, ["page", "503"], later=fresh) as server:
        dom = chromium(server.url, "--virtual-time-budget=5000")  # then a good one
    assert server.served[:3] == ["page", "503", "later"], server.served
    shown = texts(dom)
    assert "stale" not in shown and "fresh" in shown, "the good refresh replaced the page and took the banner away"

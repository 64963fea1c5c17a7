"""The operator's views rendered from a /status document, in process: the status page,
``/status.csv``, ``/metrics``, and the log format (journald priorities).

The documents are synthetic (a service of 200 pods, hostile names); the same
renderings are checked against a running activator in ``e2e/test_operator_view.py``.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import random
import re
import tempfile
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any

import pytest
from builders import svc
from prometheus_client.parser import text_string_to_metric_families

from activator.ops.history import REFUSED_BEFORE_ROUTING, SERVICE_REASONS, History
from activator.ops.logs import (
    NOTICE,
    JournalFormatter,
    LineFormatter,
    log_level,
    priority,
    setup_logging,
    stream_is_journal,
)
from activator.ops.observe import RequestRecord
from activator.ops.page import CSV_COLUMNS, POD_TABLE, VISIBLE_PODS, render_page, status_csv, trouble_key
from activator.ops.prometheus import CONTENT_TYPE, render

STATES = ("healthy", "pending", "draining", "removed")


def synthetic_status(pods: int = 200, name: str = "api") -> dict[str, Any]:
    rng = random.Random(7)
    entries = []
    for i in range(pods):
        state = "healthy" if i % 10 else rng.choice(STATES[1:])
        entries.append(
            {
                "address": f"10.0.{i // 250}.{i % 250}:8000",
                "state": state,
                "in_flight": rng.randint(0, 1),
                "slots": 1,
                "failures": rng.choice([0, 0, 0, 1, 4]),
                "failures_total": rng.randint(0, 9),
                "requests": rng.randint(0, 1000),
                "requests_per_second": 0.5,
                "seconds_in_state": 12.0,
                "last_probe": {"result": "pass", "duration_seconds": 0.002, "seconds_ago": 0.4} if i % 3 else None,
                "transport_failures": {"connect_errors.healthy": i % 4},
            }
        )
    service = {
        "hosts": ["api.example.com"],
        "container_concurrency": 1,
        "lb_policy": "first-available",
        "capacity": 180,
        "in_flight": sum(p["in_flight"] for p in entries),
        "tunnels": 0,
        "queued": 3,
        "queue_depth": 100,
        "oldest_wait_seconds": 1.25,
        "pods": entries,
        "forward_to": None,
    }
    status = {
        "version": "0.1.0",
        "ready": True,
        "uptime_seconds": 60.0,
        "activator": {"self": None, "peers": {}},
        "config": {"path": "/etc/activator/activator.yaml", "loaded_at": "2026-01-01T00:00:00Z", "last_error": None},
        "reloads": {"ok": 2, "failed": 1},
        "services": {name: service},
    }
    History().annotate(status["services"])
    return status


def synthetic_history(name: str = "api", seconds: int = 120) -> dict[str, Any]:
    """A history export with some load, from real throttlers and records."""
    from activator.core.throttler import ServiceThrottler

    h = History()
    t = ServiceThrottler(svc("10.0.0.1:8000", name=name), 0.0, rng=random.Random(0))
    for second in range(1000, 1000 + seconds):
        for i in range(second % 5):
            r = RequestRecord(0.0, "127.0.0.1", "GET", b"/")
            r.service, r.status, r.queue_wait = name, 503 if i == 3 else 200, 0.01 * i
            r.reason = "queue-full" if i == 3 else "-"
            h.request_done(r)
        h.sample({name: t}, second)
    return h.export(pods=False)


class Rows(HTMLParser):
    """The pod rows of a page: (in a <details>?, data-pod, the row's cell texts by data-col)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[bool, str, dict[str, str]]] = []
        self.details = 0
        self.cells: dict[str, str] | None = None
        self.col = ""
        self.pod = ""
        self.text = ""
        self.svgs = 0
        self.polylines: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "details":
            self.details += 1
        elif tag == "tr" and attributes.get("data-pod"):
            self.cells, self.pod = {}, str(attributes["data-pod"])
        elif tag == "td":
            self.text, self.col = "", str(attributes.get("data-col"))
        elif tag == "svg":
            self.svgs += 1
        elif tag == "polyline":
            self.polylines.append(attributes)

    def handle_endtag(self, tag: str) -> None:
        if tag == "details":
            self.details -= 1
        elif tag == "td" and self.cells is not None:
            self.cells[self.col] = self.text.strip()
        elif tag == "tr" and self.cells is not None:
            self.rows.append((self.details > 0, self.pod, self.cells))
            self.cells = None

    def handle_data(self, data: str) -> None:
        self.text += data


def parse(page: str) -> Rows:
    rows = Rows()
    rows.feed(page)
    return rows


def test_a_200_pod_service_is_sorted_by_trouble_and_folded() -> None:
    status = synthetic_status(200)
    page = render_page(status, synthetic_history())
    rows = parse(page)
    assert len(rows.rows) == 200
    shown = [pod for folded, pod, _ in rows.rows if not folded]
    assert len(shown) == VISIBLE_PODS
    assert page.count("<details class='more-pods'") == 1 and "180 more pods" in page
    by_address = {p["address"]: p for p in status["services"]["api"]["pods"]}
    order = [by_address[pod] for _, pod, _ in rows.rows]
    assert order == sorted(status["services"]["api"]["pods"], key=trouble_key)
    # The troubled ones come first: every pod that is not healthy is in the visible rows.
    unhealthy = {p["address"] for p in by_address.values() if p["state"] != "healthy"}
    assert unhealthy <= set(shown)
    streaks = [p["failures"] for p in order if p["state"] == "healthy"]
    assert streaks == sorted(streaks, reverse=True)


def test_a_pod_row_has_its_figures() -> None:
    status = synthetic_status(3)
    pod = status["services"]["api"]["pods"][1]
    rows = {address: cells for _, address, cells in parse(render_page(status)).rows}
    cells = rows[pod["address"]]
    assert list(cells) == [col for _, _, col, _ in POD_TABLE], "every column, in order"
    assert cells["pod"] == pod["address"] and cells["state"] == pod["state"]
    assert cells["in_flight"] == str(pod["in_flight"]) and cells["slots"] == str(pod["slots"])
    assert cells["requests"] == str(pod["requests"])
    assert cells["failures_total"] == str(pod["failures_total"]) and cells["streak"] == str(pod["failures"])
    assert cells["probe"] == "pass" and cells["probe_took"] == "2 ms" and cells["probe_when"] == "400 ms ago"


def test_a_pod_row_shows_its_peaks_beside_in_flight_and_slots_and_how_it_answered() -> None:
    status = synthetic_status(1)
    (pod,) = status["services"]["api"]["pods"]
    pod.update(
        in_flight=1,
        slots=2,
        peak_in_flight=2,
        peak_in_flight_window=1,
        retries=3,
        responses={"1xx": 0, "2xx": 40, "3xx": 1, "4xx": 2, "5xx": 5},
        recent_pod_time_seconds={"count": 4, "sum": 1.0},
        seconds_by_state={"pending": 95.0, "healthy": 10.0, "draining": 0.0, "removed": 0.0},
    )
    (cells,) = [cells for _, _, cells in parse(render_page(status)).rows]
    assert (cells["in_flight"], cells["peak_window"], cells["peak"], cells["slots"]) == ("1", "1", "2", "2")
    assert (cells["2xx"], cells["3xx"], cells["4xx"], cells["5xx"]) == ("40", "1", "2", "5")
    assert cells["retries"] == "3" and cells["pod_time"] == "250 ms" and cells["pending_total"] == "95.0 s"
    page = render_page(status)
    assert "<th colspan='4'>in flight</th>" in page and "<th>max 15 min</th>" in page


def test_the_page_draws_sparklines_with_points_and_marks_state_changes() -> None:
    history = synthetic_history(seconds=120)
    history["services"]["api"]["transitions"] = [
        {"t": 1050.5, "pod": "10.0.0.1:8000", "old": "healthy", "new": "pending", "reason": "probe failed"}
    ]
    page = render_page(synthetic_status(2), history)
    rows = parse(page)
    assert rows.svgs == 3
    series = {p["data-series"] for p in rows.polylines}
    assert {"queued", "in_flight", "capacity", "requests", "5xx", "rejected", "queue_wait_p99"} <= series
    requests = next(p for p in rows.polylines if p["data-series"] == "requests")
    assert int(requests["data-points"] or 0) == 120 and len((requests["points"] or "").split()) == 120
    assert page.count("class='change'") == 3  # one mark on each chart
    assert "oldest wait <b class='oldest-wait'>1.2 s</b>" in page
    assert "<a href='/status.csv'>" in page and "<a href='/status'>" in page
    assert "http-equiv='refresh'" in page and "<script>" in page and "src=" not in page


def test_the_page_without_history_still_renders() -> None:
    page = render_page(synthetic_status(1))
    assert "no history yet" in page and page.endswith("</html>")


def test_everything_from_outside_is_escaped() -> None:
    status = synthetic_status(1, name="<b>svc</b>")
    service = status["services"]["<b>svc</b>"]
    service["hosts"] = ["<script>alert(1)</script>"]
    service["pods"][0]["address"] = "x'><img src=x onerror=alert(1)>"
    service["pods"][0]["last_probe"] = {"result": "fail: <i>503</i>", "duration_seconds": None, "seconds_ago": 1.0}
    status["config"]["last_error"] = "a.yaml:1: <key>: bad & worse"
    status["config"]["path"] = "/tmp/<p>.yaml"
    page = render_page(status)
    assert "<script>alert" not in page and "<img" not in page and "<b>svc" not in page and "<i>503" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "bad &amp; worse" in page
    assert "&lt;b&gt;svc&lt;/b&gt;" in page


def test_the_csv_has_one_row_per_pod_with_its_services_columns() -> None:
    status = synthetic_status(5)
    status["services"]["empty"] = dict(status["services"]["api"], pods=[], capacity=None)
    rows = list(csv.reader(io.StringIO(status_csv(status))))
    assert tuple(rows[0]) == CSV_COLUMNS
    body = [dict(zip(CSV_COLUMNS, row, strict=True)) for row in rows[1:]]
    assert len(body) == 6
    api = [row for row in body if row["service"] == "api"]
    for row, pod in zip(api, status["services"]["api"]["pods"], strict=True):
        assert row["pod"] == pod["address"] and row["state"] == pod["state"]
        assert int(row["requests"]) == pod["requests"] and int(row["failures_total"]) == pod["failures_total"]
        assert row["capacity"] == "180" and row["queued"] == "3" and row["oldest_wait_seconds"] == "1.25"
    (empty,) = [row for row in body if row["service"] == "empty"]
    assert empty["pod"] == "" and empty["capacity"] == ""


def test_the_csv_quotes_what_needs_quoting() -> None:
    status = synthetic_status(1)
    status["services"]["api"]["pods"][0]["last_probe"] = {
        "result": 'fail: status 503, "busy"',
        "duration_seconds": 0.1,
        "seconds_ago": 2.0,
    }
    text = status_csv(status)
    assert '"fail: status 503, ""busy"""' in text and text.endswith("\r\n")
    (row,) = list(csv.DictReader(io.StringIO(text)))
    assert row["last_probe_result"] == 'fail: status 503, "busy"'


def test_metrics_render_the_status_with_service_and_pod_labels() -> None:
    status = synthetic_status(4)
    api = status["services"]["api"]
    api["totals"]["requests"] = 42
    api["totals"]["rejected"] = {"queue-full": 5}
    api["queue_wait_seconds"]["counts"][3] = 7
    families = {f.name: f for f in text_string_to_metric_families(render(status).decode())}
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert value[("activator_requests_total", (("service", "api"),))] == 42
    assert value[("activator_rejected_total", (("reason", "queue-full"), ("service", "api")))] == 5
    assert value[("activator_queued", (("service", "api"),))] == 3
    assert value[("activator_capacity", (("service", "api"),))] == 180
    assert value[("activator_config_reloads_total", (("result", "failed"),))] == 1
    assert value[("activator_queue_wait_seconds_count", (("service", "api"),))] == 7
    assert value[("activator_queue_wait_seconds_bucket", (("le", "+Inf"), ("service", "api")))] == 7
    for pod in api["pods"]:
        labels = (("pod", pod["address"]), ("service", "api"))
        assert value[("activator_pod_in_flight", labels)] == pod["in_flight"]
        assert value[("activator_pod_requests_total", labels)] == pod["requests"]
        connect_errors = pod["transport_failures"]["connect_errors.healthy"]
        assert value[("activator_pod_connect_errors_total", labels)] == connect_errors
        assert value[("activator_pod_state", (*labels, ("state", pod["state"])))] == 1
    per_state = {state: sum(1 for p in api["pods"] if p["state"] == state) for state in STATES}
    for state, count in per_state.items():
        assert value[("activator_pods", (("service", "api"), ("state", state)))] == count
    assert families["activator_requests"].type == "counter"
    assert families["activator_queue_wait_seconds"].type == "histogram"
    assert all(name.startswith(("activator_", "process_", "python_")) for name in families)


def test_an_unlimited_service_has_no_capacity_metric() -> None:
    status = synthetic_status(1)
    status["services"]["api"]["capacity"] = None
    assert "activator_capacity{" not in render(status).decode()


def test_metrics_have_every_label_value_from_the_start_and_the_process_own_series() -> None:
    status = synthetic_status(2)
    status["refused"] = dict.fromkeys(sorted(REFUSED_BEFORE_ROUTING), 0) | {"bad-host": 4}
    status["h2_goaway"] = {"resets": 3, "pings": 0}
    pod = status["services"]["api"]["pods"][0]
    pod.update(
        state="healthy",
        peak_in_flight=1,
        peak_in_flight_window=1,
        retries=2,
        responses={"1xx": 0, "2xx": 7, "3xx": 0, "4xx": 0, "5xx": 1},
        pod_time_seconds={"count": 8, "sum": 2.0},
        seconds_by_state={"pending": 3.0, "healthy": 9.0, "draining": 0.0, "removed": 0.0},
    )
    text = render(status).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    for reason in SERVICE_REASONS:  # a rate over a reason that never happened has a series
        assert value[("activator_rejected_total", (("reason", reason), ("service", "api")))] == 0
    for reason in REFUSED_BEFORE_ROUTING:
        assert ("activator_refused_total", (("reason", reason),)) in value
    assert value[("activator_refused_total", (("reason", "bad-host"),))] == 4
    assert value[("activator_h2_goaway_total", (("budget", "resets"),))] == 3
    assert value[("activator_h2_goaway_total", (("budget", "pings"),))] == 0
    for state in STATES:
        assert ("activator_pod_transitions_total", (("service", "api"), ("state", state))) in value
    labels = (("pod", pod["address"]), ("service", "api"))
    assert [value[("activator_pod_state", (*labels, ("state", state)))] for state in STATES] == [
        1.0 if state == "healthy" else 0.0 for state in STATES
    ]
    assert value[("activator_pod_peak_in_flight", labels)] == 1
    assert value[("activator_pod_peak_in_flight_window", labels)] == 1
    assert value[("activator_pod_retries_total", labels)] == 2
    assert value[("activator_pod_responses_total", (("class", "2xx"), *labels))] == 7
    assert value[("activator_pod_responses_total", (("class", "3xx"), *labels))] == 0
    assert value[("activator_pod_response_duration_seconds_count", labels)] == 8
    assert value[("activator_pod_response_duration_seconds_sum", labels)] == 2.0
    assert value[("activator_pod_state_seconds_total", (*labels, ("state", "pending")))] == 3.0
    assert families["activator_pod_response_duration_seconds"].type == "summary"
    for name in ("process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds", "python_info"):
        assert name in families, f"{name}: prometheus_client's own collectors"
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


def test_the_csv_has_the_pods_peaks_answers_and_time_in_each_state() -> None:
    status = synthetic_status(1)
    (pod,) = status["services"]["api"]["pods"]
    pod.update(
        peak_in_flight=1,
        peak_in_flight_window=0,
        retries=5,
        responses={"1xx": 0, "2xx": 3, "3xx": 0, "4xx": 0, "5xx": 2},
        pod_time_seconds={"count": 5, "sum": 1.5},
        seconds_by_state={"pending": 4.0, "healthy": 8.0, "draining": 0.0, "removed": 0.0},
    )
    (row,) = csv.DictReader(io.StringIO(status_csv(status)))
    assert (row["peak_in_flight"], row["peak_in_flight_window"], row["retries"]) == ("1", "0", "5")
    assert (row["responses_2xx"], row["responses_5xx"]) == ("3", "2")
    assert (row["pod_time_seconds_count"], row["pod_time_seconds_sum"]) == ("5", "1.5")
    assert (row["seconds_pending"], row["seconds_healthy"]) == ("4.0", "8.0")


# -- logs ------------------------------------------------------------------------------


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Put back the root logger and gevent's hub error stream that ``setup_logging`` replaces."""
    import gevent

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    hub = gevent.get_hub()
    stream = hub.exception_stream
    try:
        yield
    finally:
        hub.exception_stream = stream
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


def test_syslog_priorities_of_the_levels() -> None:
    assert [priority(level) for level in (50, 40, 30, 25, 20, 10, 5)] == [3, 3, 4, 5, 6, 7, 7]
    assert NOTICE == 25 and logging.getLevelName(NOTICE) == "NOTICE"


def test_every_line_of_a_record_gets_its_priority_and_level() -> None:
    formatter = JournalFormatter("%(message)s")
    record = logging.LogRecord("activator", logging.ERROR, __file__, 1, "first\nsecond", (), None)
    assert formatter.format(record) == "<3>ERROR first\n<3>ERROR second"


def test_every_line_of_a_record_gets_its_time_and_level() -> None:
    record = logging.LogRecord("activator", logging.INFO, __file__, 1, "config reload applied:\nadd pod x", (), None)
    lines = LineFormatter("%(message)s").format(record).split("\n")
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO "
    assert len(lines) == 2 and all(re.match(stamp, line) for line in lines), lines
    assert lines[1].endswith(" INFO add pod x")


@pytest.mark.parametrize(("value", "level"), [(None, "INFO"), ("debug", "DEBUG"), (" Notice ", "NOTICE")])
def test_the_log_level_comes_from_the_environment(value: str | None, level: str) -> None:
    assert log_level(value) == (level, None)


def test_a_bad_log_level_is_a_warning_not_a_crash(restore_logging: None) -> None:
    assert log_level("verbose")[0] == "INFO" and "verbose" in str(log_level("verbose")[1])
    with tempfile.NamedTemporaryFile("w+") as f:
        handler = setup_logging(f, {"ACTIVATOR_LOG_LEVEL": "verbose"})
        logging.getLogger("activator.test").info("still logging")
        handler.flush()
        f.seek(0)
        text = f.read()
    assert logging.getLogger().level == logging.INFO
    assert " WARNING ACTIVATOR_LOG_LEVEL='verbose' is not a level (DEBUG, INFO, NOTICE, WARNING, ERROR)" in text
    assert " INFO still logging" in text and "Traceback" not in text


def test_the_journal_is_recognised_by_the_device_and_inode_of_stderr(restore_logging: None) -> None:
    with tempfile.NamedTemporaryFile("w+") as f, tempfile.NamedTemporaryFile("w+") as other:
        stat = os.fstat(f.fileno())
        assert stream_is_journal(f, f"{stat.st_dev}:{stat.st_ino}")
        assert not stream_is_journal(other, f"{stat.st_dev}:{stat.st_ino}")
        assert not stream_is_journal(f, None) and not stream_is_journal(f, "garbage")
        handler = setup_logging(f, {"JOURNAL_STREAM": f"{stat.st_dev}:{stat.st_ino}", "ACTIVATOR_LOG_LEVEL": "debug"})
        log = logging.getLogger("activator.test")
        log.debug("d")
        log.info("i")
        log.warning("w")
        log.error("e")
        handler.flush()
        f.seek(0)
        assert f.read().splitlines() == ["<7>DEBUG d", "<6>INFO i", "<4>WARNING w", "<3>ERROR e"]
        plain = setup_logging(other, {})
        log.info("plain")
        plain.flush()
        other.seek(0)
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO plain\n", other.read())


def test_an_unexpected_error_in_a_greenlet_is_logged_once_with_its_traceback(restore_logging: None) -> None:
    import gevent

    with tempfile.NamedTemporaryFile("w+") as f:
        handler = setup_logging(f, {})

        def broken() -> None:
            raise RuntimeError("a bug")

        gevent.spawn(broken).join()
        gevent.sleep(0)
        gevent.sleep(0)
        handler.flush()
        f.seek(0)
        text = f.read()
    lines = text.splitlines()
    assert all(" ERROR " in line for line in lines), "every line of the one record says its level"
    assert text.count(" ERROR unexpected error in a greenlet:") == 1, text
    assert re.search(r"greenlet:\n\S+ \S+ ERROR Traceback \(most recent call last\):", text), text
    assert "RuntimeError: a bug" in text and "failed with RuntimeError" in text


def test_a_fatal_line_gets_its_priority_under_the_journal(monkeypatch: Any) -> None:
    from activator.ops.logs import fatal

    with tempfile.NamedTemporaryFile("w+") as f:
        stat = os.fstat(f.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{stat.st_dev}:{stat.st_ino}")
        fatal("activator: a.yaml:1: listen: bad", f)
        monkeypatch.delenv("JOURNAL_STREAM")
        fatal("activator: plain", f)
        f.seek(0)
        assert f.read() == "<3>activator: a.yaml:1: listen: bad\nactivator: plain\n"


def test_classes_and_tenants_show_on_the_page_in_status_and_in_metrics() -> None:
    from activator.ops.statustext import format_status

    status = synthetic_status(1)
    service = status["services"]["api"]
    service["classes"] = {
        "critical": {"queued": 1, "oldest_wait_seconds": 0.5, "shed": 0},
        "sheddable": {"queued": 7, "oldest_wait_seconds": 12.0, "shed": 3},
    }
    service["tenants"] = 2
    service["top_tenants"] = [{"tenant": "<key-a>", "queued": 6}, {"tenant": "", "queued": 2}]
    page = render_page(status)
    assert "sheddable: queued 7, oldest 12" in page and "shed 3" in page
    assert "most queued: &lt;key-a&gt; 6, (none) 2" in page  # a tenant key is client input: escaped
    text = format_status(status)
    assert "sheddable queued=7" in text and "shed=3" in text and "most queued: <key-a>=6, (none)=2" in text
    scraped = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(render(status).decode())
        for sample in family.samples
    }
    assert scraped[("activator_class_queued", (("class", "sheddable"), ("service", "api")))] == 7
    assert scraped[("activator_class_shed_total", (("class", "sheddable"), ("service", "api")))] == 3
    assert scraped[("activator_tenants", (("service", "api"),))] == 2

"""End to end: what an operator sees (issue 15): the history, the status page in a real
browser, ``/status.csv``, ``/metrics``, ``activator status [--watch]``, and clean logs.

The real ``activator run`` (or ``$ACTIVATOR_BIN``) in front of ``tests/backend.py``
pods. The load is real: a slow pod with ``container_concurrency: 1`` and several clients
at once, so that requests queue. Values that move under load are compared only at
quiet moments (the load over and every count back to zero, checked before and after
the comparison); nothing is timed. The page is loaded by headless Chromium (Debian's
``chromium``); its screenshot is kept as ``test-output/status-page.png``.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from harness import (
    REPO_ROOT,
    Activator,
    Pod,
    Process,
    activator_command,
    concurrent_requests,
    find_pod,
    make_config,
    probe_config,
    request,
    run_cli,
    send_raw,
    start_request,
    stream,
    wait_until,
)
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.binary

SLOW = "/delay?ms=250"
CLIENTS = 5
OUTPUT = REPO_ROOT / "test-output"
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|NOTICE|WARNING|ERROR|CRITICAL) ")


class Load:
    """``CLIENTS`` clients sending ``SLOW`` requests one after the other until ``stop``."""

    def __init__(self, act: Activator, clients: int = CLIENTS, path: str = SLOW) -> None:
        self.act = act
        self.done = threading.Event()
        self.sent = 0
        self.statuses: list[int] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(path,), daemon=True) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _client(self, path: str) -> None:
        while not self.done.is_set():
            status = request(self.act.url(path), timeout=60).status
            with self._lock:
                self.sent += 1
                self.statuses.append(status)

    def stop(self) -> int:
        """Stop, wait for every client's last answer; how many requests were sent."""
        self.done.set()
        for thread in self._threads:
            thread.join(90)
        return self.sent


class Setup:
    def __init__(self, act: Activator, pod: Pod) -> None:
        self.act = act
        self.pod = pod


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """One slow pod (cc 1, probed) and an activator in front of it, for the whole module."""
    with Pod() as pod:
        config = make_config([pod], queue_depth=50, probe=probe_config("300ms"))
        with Activator(config, workdir=tmp_path_factory.mktemp("operator")) as act:
            act.wait_pod_state("api", pod.address, "healthy")
            yield Setup(act, pod)


@pytest.fixture
def loaded(setup: Setup) -> Iterator[Load]:
    """Load running, with requests queued, for the length of a test."""
    load = Load(setup.act)
    try:
        setup.act.wait_for(lambda st: st["services"]["api"]["queued"] >= 1, message="requests queued")
        yield load
    finally:
        load.stop()
        setup.act.wait_idle()


def quiet_status(act: Activator) -> dict[str, Any]:
    """/status once nothing is queued or in flight (the load is over)."""
    return act.wait_idle()


# --------------------------------------------------------------------------------------
# the history


def test_status_history_has_points_while_requests_queue(setup: Setup, loaded: Load) -> None:
    act = setup.act

    def history() -> dict[str, Any] | None:
        h = act.admin_get("/status/history").json()["services"]["api"]
        enough = len(h["t"]) >= 3 and sum(h["requests"]) > 0 and max(h["queued"]) >= 1
        return h if enough else None

    h = wait_until(history, message="history points with requests and a queue")
    n = len(h["t"])
    assert h["t"] == sorted(h["t"]) and all(isinstance(t, int) for t in h["t"])
    for series in ("requests", "bytes_out", "queued", "in_flight", "capacity", "queue_wait_p50", "queue_wait_p99"):
        assert len(h[series]) == n, series
    assert set(h["responses"]) == {"1xx", "2xx", "3xx", "4xx", "5xx"}
    assert max(h["in_flight"]) == 1 and h["capacity"][-1] == 1, "cc 1, one pod"
    assert set(h["capacity"]) <= {0, 1}, "0 before its first probe passed"
    assert any(p99 is not None and p99 > 0 for p99 in h["queue_wait_p99"]), "queued requests waited"
    assert h["pods_in_state"]["healthy"][-1] == 1
    pod = h["pods"][setup.pod.address]
    assert len(pod["requests"]) == n and sum(v or 0 for v in pod["requests"]) > 0
    assert any(change["pod"] == setup.pod.address and change["new"] == "healthy" for change in h["transitions"])
    short = act.admin_get("/status/history?seconds=2&pods=0").json()["services"]["api"]
    assert len(short["t"]) <= 2 and "pods" not in short
    assert act.admin_get("/status/history?seconds=0").status == 400


# --------------------------------------------------------------------------------------
# the page, in a real browser


class PageDom(HTMLParser):
    """What the test reads of the page: sparklines, their polylines, the pod rows."""

    def __init__(self) -> None:
        super().__init__()
        self.svgs = 0
        self.polylines: list[dict[str, str | None]] = []
        self.rows: dict[str, dict[str, str]] = {}  # pod -> its cells by data-col
        self.summary = ""
        self._row: str | None = None
        self._col = ""
        self._cell: str | None = None
        self._in_summary = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "svg":
            self.svgs += 1
        elif tag == "polyline":
            self.polylines.append(a)
        elif tag == "tr" and a.get("data-pod"):
            self._row = str(a["data-pod"])
            self.rows[self._row] = {}
        elif tag == "td" and self._row is not None:
            self._cell, self._col = "", str(a.get("data-col"))
        elif tag == "p" and a.get("class") == "summary":
            self._in_summary = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._row is not None and self._cell is not None:
            self.rows[self._row][self._col] = self._cell.strip()
            self._cell = None
        elif tag == "tr":
            self._row = None
        elif tag == "p":
            self._in_summary = False

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell += data
        if self._in_summary:
            self.summary += data


def chromium(*args: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        return subprocess.run(
            [
                "chromium",
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                f"--user-data-dir={profile}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (apt-get install chromium)")
def test_the_page_in_a_real_browser_draws_the_history_and_the_pods(setup: Setup, loaded: Load) -> None:
    act = setup.act
    wait_until(
        lambda: len(act.admin_get("/status/history?pods=0").json()["services"]["api"]["t"]) >= 3,
        message="a few seconds of history",
    )
    dumped = chromium("--dump-dom", act.admin_url("/"))
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = PageDom()
    dom.feed(dumped.stdout)
    status = act.status()
    service = status["services"]["api"]
    assert dom.svgs == 3, "three sparklines for the one service"
    by_series = {p.get("data-series"): p for p in dom.polylines}
    for name in ("queued", "in_flight", "capacity", "requests", "queue_wait_p99"):
        assert name in by_series, f"no {name} line"
    drawn = [p for p in dom.polylines if p.get("data-series") == "requests"]
    assert sum(int(p.get("data-points") or 0) for p in drawn) >= 3
    assert all(len((p.get("points") or "").split()) == int(p.get("data-points") or 0) for p in drawn)
    # What cannot move during the test: the pod, its state, its slots, its peaks (cc 1,
    # busy all along); the service's limits.
    (pod,) = service["pods"]
    cells = dom.rows[pod["address"]]
    assert cells["pod"] == pod["address"] and cells["state"] == "healthy" and cells["slots"] == str(pod["slots"]) == "1"
    assert cells["peak"] == cells["peak_window"] == "1", "HAProxy's Cur / Max / Limit: the limit held"
    assert cells["probe"] == "pass", "the last probe passed"
    assert int(cells["2xx"]) > 0 and cells["5xx"] == "0"
    assert f"cc {service['container_concurrency']}" in dom.summary
    assert f"/{service['queue_depth']}" in dom.summary and "capacity 1" in dom.summary
    assert "oldest wait" in dom.summary and "req/s" in dom.summary
    OUTPUT.mkdir(exist_ok=True)
    shot = OUTPUT / "status-page.png"
    shot.unlink(missing_ok=True)
    taken = chromium(f"--screenshot={shot}", "--window-size=1280,2000", act.admin_url("/"))
    assert taken.returncode == 0 and shot.exists() and shot.stat().st_size > 10_000, taken.stderr[-2000:]


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (apt-get install chromium)")
def test_the_page_of_an_empty_configuration_says_so(activator_factory: Callable[..., Activator]) -> None:
    act = activator_factory({"services": {}})
    dumped = chromium("--dump-dom", act.admin_url("/"))
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    text = " ".join(re.sub(r"<[^>]+>", " ", dumped.stdout).split())
    assert f"no services: {act.config_path} configures none ( services: {{}} )" in text, text[-1500:]


# --------------------------------------------------------------------------------------
# /status.csv and /metrics, compared with /status at a quiet moment


def test_status_csv_parses_and_matches_status(setup: Setup) -> None:
    act = setup.act
    # One request of its own: the pod's peak is 1 whichever of the module's tests ran
    # before this one on this worker (with xdist, maybe none).
    assert request(act.listen, path="/delay?ms=1").status == 200
    before = quiet_status(act)
    response = act.admin_get("/status.csv")
    after = quiet_status(act)
    assert response.status == 200 and response.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.text, newline="")))
    assert response.text.endswith("\r\n")
    (row,) = rows
    service = after["services"]["api"]
    (pod,) = service["pods"]
    assert before["services"]["api"]["pods"][0]["requests"] == pod["requests"], "quiet while read"
    assert row["service"] == "api" and row["pod"] == pod["address"] and row["state"] == pod["state"]
    for column, value in (
        ("container_concurrency", service["container_concurrency"]),
        ("capacity", service["capacity"]),
        ("queue_depth", service["queue_depth"]),
        ("queued", 0),
        ("service_in_flight", 0),
        ("in_flight", 0),
        ("slots", pod["slots"]),
        ("requests", pod["requests"]),
        ("failures", pod["failures"]),
        ("failures_total", pod["failures_total"]),
        ("peak_in_flight", 1),
        ("peak_in_flight_window", pod["peak_in_flight_window"]),
        ("retries", 0),
        ("responses_2xx", pod["responses"]["2xx"]),
        ("responses_5xx", 0),
        ("pod_time_seconds_count", pod["pod_time_seconds"]["count"]),
    ):
        assert row[column] == str(value), column
    assert float(row["seconds_healthy"]) > 0 and row["seconds_draining"] == "0.0"
    assert row["lb_policy"] == service["lb_policy"] and row["hosts"] == "*"
    assert row["last_probe_result"] == "pass"


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_parse_and_match_status(setup: Setup) -> None:
    act = setup.act
    load = Load(act, clients=3)
    act.wait_for(lambda st: st["services"]["api"]["queued"] >= 1, message="requests queued")
    load.stop()
    before = quiet_status(act)
    response = act.admin_get("/metrics")
    after = quiet_status(act)
    assert before["services"]["api"]["totals"] == after["services"]["api"]["totals"], "quiet while scraped"
    assert response.status == 200 and response.headers["content-type"].startswith("text/plain")
    values = metric_values(response.text)
    service = after["services"]["api"]
    (pod,) = service["pods"]
    s = (("service", "api"),)
    on_pod = (("pod", pod["address"]), ("service", "api"))
    totals = service["totals"]
    assert values[("activator_requests_total", s)] == totals["requests"] >= load.sent
    for cls, count in totals["responses"].items():
        assert values[("activator_responses_total", (("class", cls), ("service", "api")))] == count
    assert totals["responses"]["2xx"] >= load.sent
    assert values[("activator_response_body_bytes_total", s)] == totals["bytes_out"] > 0
    assert values[("activator_queued", s)] == 0 and values[("activator_in_flight", s)] == 0
    assert values[("activator_capacity", s)] == service["capacity"] == 1
    assert values[("activator_pods", (("service", "api"), ("state", "healthy")))] == 1
    assert values[("activator_pod_in_flight", on_pod)] == 0
    assert values[("activator_pod_slots", on_pod)] == 1
    assert values[("activator_pod_requests_total", on_pod)] == pod["requests"]
    assert values[("activator_pod_state", (*on_pod, ("state", "healthy")))] == 1
    waits = service["queue_wait_seconds"]
    assert values[("activator_queue_wait_seconds_count", s)] == sum(waits["counts"])
    assert values[("activator_queue_wait_seconds_sum", s)] == pytest.approx(waits["sum"])
    assert values[("activator_queue_wait_seconds_bucket", (("le", "+Inf"), ("service", "api")))] == sum(waits["counts"])
    assert values[("activator_request_duration_seconds_count", s)] == totals["requests"]
    assert values[("activator_config_reloads_total", (("result", "ok"),))] == after["reloads"]["ok"]
    assert values[("activator_ready", ())] == 1
    # The proof that the limit held, and how the pod did.
    assert values[("activator_pod_peak_in_flight", on_pod)] == pod["peak_in_flight"] == 1
    assert values[("activator_pod_peak_in_flight_window", on_pod)] == pod["peak_in_flight_window"]
    assert values[("activator_pod_responses_total", (("class", "2xx"), *on_pod))] == pod["responses"]["2xx"] > 0
    assert values[("activator_pod_responses_total", (("class", "5xx"), *on_pod))] == 0
    assert values[("activator_pod_retries_total", on_pod)] == 0
    assert values[("activator_pod_response_duration_seconds_count", on_pod)] == pod["pod_time_seconds"]["count"]
    assert values[("activator_pod_response_duration_seconds_sum", on_pod)] == pytest.approx(
        pod["pod_time_seconds"]["sum"]
    )
    assert values[("activator_pod_state_seconds_total", (*on_pod, ("state", "healthy")))] > 0
    for state in ("pending", "draining", "removed"):
        assert values[("activator_pod_state", (*on_pod, ("state", state)))] == 0, "every state has a series"
    for reason in ("queue-full", "queue-timeout", "upstream-connect", "upstream-timeout"):
        assert ("activator_rejected_total", (("reason", reason), ("service", "api"))) in values, reason
    assert values[("process_cpu_seconds_total", ())] > 0 and values[("process_start_time_seconds", ())] > 0
    assert all(name.startswith(("activator_", "process_", "python_")) for name, _ in values)


# --------------------------------------------------------------------------------------
# activator status


def test_status_command_prints_rates_and_the_oldest_wait(setup: Setup, loaded: Load) -> None:
    act = setup.act
    assert act.admin is not None
    act.wait_for(lambda st: st["services"]["api"]["requests_per_second"] > 0, message="a rate over 0")
    act.wait_for(lambda st: st["services"]["api"]["oldest_wait_seconds"] > 0, message="someone waiting")
    result = run_cli(["status", "--admin", act.admin])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    rates = re.search(r"rates \(last 10s\): ([\d.]+) req/s  5xx ([\d.]+)/s  rejected ([\d.]+)/s", out)
    assert rates, out
    oldest = re.search(r"oldest_wait=(\d+ms|[\d.]+s)", out)
    assert oldest, out
    assert setup.pod.address in out and "REQ/S" in out and "FAIL_TOTAL" in out
    header = next(line for line in out.splitlines() if "IN_FLIGHT" in line).split()
    row = next(line for line in out.splitlines() if line.strip().startswith(setup.pod.address)).split()
    assert row[header.index("MAX")] == row[header.index("SLOTS")] == "1", "the limit held, and shows it"


def test_status_watch_refreshes_until_interrupted(setup: Setup, tmp_path: Path) -> None:
    act = setup.act
    assert act.admin is not None
    watch = Process(
        [*activator_command(), "status", "--watch", "--interval", "0.2", "--admin", act.admin],
        stdout_path=tmp_path / "watch.out",
        stderr_path=tmp_path / "watch.err",
        name="status --watch",
    )
    try:
        wait_until(
            lambda: watch.stdout_text().count(f"from {act.admin}") >= 2 or watch.check_running("refreshing"),
            message="two refreshes",
        )
        watch.signal(signal.SIGINT)
        code = watch.wait()
    finally:
        watch.kill()
    out = watch.stdout_text()
    assert code == 0, watch.output_tail()
    blocks = [block for block in out.split(f"every 0.2s from {act.admin}") if block.strip()]
    assert len(blocks) >= 2 and all("api  cc=1" in block for block in blocks), out
    assert "\x1b[2J" not in out, "not a terminal: plain blocks, no screen clearing"
    assert "Traceback" not in watch.stderr_text() and not watch.stderr_text().strip()


# --------------------------------------------------------------------------------------
# logs


BROKEN = """\
services:
  api:
    hosts: ["*"]
    bogus_key: 1
    pods: [127.0.0.1:9]
"""


def error_lines(act: Activator) -> list[str]:
    return [line for line in act.stderr_text().splitlines() if " ERROR " in line or line.startswith("<3>")]


def test_an_invalid_reload_logs_one_line_and_no_traceback(
    pod_factory: Callable[..., list[Pod]], activator_factory: Callable[..., Activator]
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod]))
    good = act.read_config()
    act.rewrite_config(BROKEN)  # the watcher reloads it
    first = act.wait_for(lambda st: st["reloads"]["failed"] >= 1, message="a failed reload")
    act.reload()  # and SIGHUP once more
    status = act.wait_for(lambda st: st["reloads"]["failed"] == first["reloads"]["failed"] + 1, message="SIGHUP")
    assert status["config"]["last_error"]
    wait_until(lambda: len(error_lines(act)) == status["reloads"]["failed"], message="one error line per reload")
    stderr = act.stderr_text()
    assert "Traceback" not in stderr and "failed with" not in stderr, stderr
    for line in error_lines(act):
        assert re.search(
            r"config reload \((file changed|SIGHUP)\) failed, keeping the running config: "
            r"\S*activator\.yaml:4: services\.api\.bogus_key: unknown key",
            line,
        ), line
    assert all(LOG_LINE.match(line) for line in stderr.splitlines()), stderr
    act.write_config_in_place(good)
    act.wait_for(lambda st: st["config"]["last_error"] is None, message="the good file back")
    assert request(act.url("/")).status == 200


def test_bad_requests_clients_that_leave_and_a_pod_that_dies_leave_no_traceback(
    pod_factory: Callable[..., list[Pod]], activator_factory: Callable[..., Activator]
) -> None:
    slow, doomed = pod_factory(2)
    config = make_config([slow], top={"limits": {"client_timeout": "2s"}}, queue_depth=5)
    config["services"]["doomed"] = {
        "hosts": ["doomed.test"],
        "container_concurrency": 1,
        "probe": None,
        "pods": [doomed.address],
    }
    config["services"]["api"]["hosts"] = ["api.test"]
    act = activator_factory(config)

    def raw(data: bytes, *, close_at_once: bool = False) -> None:
        sock = send_raw(act.listen, data, timeout=10)
        try:
            if not close_at_once:
                while sock.recv(65536):
                    pass
        except OSError:
            pass
        finally:
            sock.close()

    # Malformed heads and framing.
    for data in (
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/9.9\r\nHost: api.test\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),  # TLS on the plain port
        b"GET / HTTP/1.1\r\nHost: api.test\r\nContent-Length: x\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: api.test\r\nX: " + b"y" * 70000 + b"\r\n\r\n",
    ):
        raw(data)
    # Clients that leave: mid-head, mid-body, while queued, mid-response.
    raw(b"GET / HTTP/1.1\r\nHost: api", close_at_once=True)
    raw(b"POST /upload HTTP/1.1\r\nHost: api.test\r\nContent-Length: 100000\r\n\r\n" + b"x" * 1000, close_at_once=True)
    held = start_request(act.url("/delay?ms=1500"), host="api.test")
    act.wait_for(lambda st: st["services"]["api"]["in_flight"] == 1, message="the slot held")
    queued = start_request(act.url("/delay?ms=10"), host="api.test")
    act.wait_for(lambda st: st["services"]["api"]["queued"] == 1, message="one queued")
    queued.close()
    held.close()
    with stream(act.url("/download?bytes=50000000"), host="api.test") as response:
        response.read1(1000)
    with stream(act.url("/sse?n=1000&gap_ms=10"), host="api.test") as response:
        response.readline()
    act.wait_idle("api")
    # A pod that dies under a request, then refuses connections.
    in_flight = start_request(act.url("/delay?ms=5000"), host="doomed.test")
    act.wait_for(lambda st: st["services"]["doomed"]["in_flight"] == 1, message="a request on the pod")
    doomed.kill()
    assert in_flight.getresponse().status == 502
    in_flight.close()
    assert request(act.url("/"), host="doomed.test").status == 502
    # Broken answers from a pod: not HTTP at all; a body cut off.
    for path in (b"/garbage", b"/reset-mid-body"):
        raw(b"GET " + path + b" HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n")
    # Many clients at once, some leaving early.
    concurrent_requests(8, lambda i: _leave_or_wait(act, i), return_exceptions=True)
    act.wait_idle()
    assert request(act.url("/delay?ms=1"), host="api.test").status == 200
    assert find_pod(act.status(), "doomed", doomed.address) is not None
    stderr = act.stderr_text()
    assert "Traceback" not in stderr and "failed with" not in stderr, stderr
    assert all(LOG_LINE.match(line) for line in stderr.splitlines()), stderr


def _leave_or_wait(act: Activator, i: int) -> int:
    if i % 2:
        sock = send_raw(act.listen, b"GET /delay?ms=300 HTTP/1.1\r\nHost: api.test\r\n\r\n")
        time.sleep(0.05)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()  # a reset, not a clean close
        return 0
    return request(act.url("/delay?ms=100"), host="api.test").status


def test_under_systemd_every_log_line_has_its_syslog_priority(
    pod_factory: Callable[..., list[Pod]], activator_factory: Callable[..., Activator]
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod]), start=False)
    act.stderr_path.touch()
    stat = os.stat(act.stderr_path)
    act.env["JOURNAL_STREAM"] = f"{stat.st_dev}:{stat.st_ino}"  # stderr is "the journal"
    act.start()
    act.rewrite_config(BROKEN)
    act.wait_for(lambda st: st["reloads"]["failed"] >= 1, message="a failed reload")
    wait_until(lambda: error_lines(act), message="the error logged")
    lines = act.stderr_text().splitlines()
    assert lines and all(re.match(r"<[34567]>(DEBUG|INFO|NOTICE|WARNING|ERROR) ", line) for line in lines), lines
    assert any(line.startswith("<5>NOTICE service api: pod ") and "-> healthy" in line for line in lines), lines
    assert any(line.startswith("<6>INFO activator ") and "listening on" in line for line in lines), lines
    (error,) = [line for line in lines if line.startswith("<3>")]
    assert "<3>ERROR config reload (file changed) failed" in error and "bogus_key" in error
    assert not any(re.match(r"<\d>\d{4}-", line) for line in lines), "no time stamp: the journal has its own"


# --------------------------------------------------------------------------------------
# workers: the supervisor merges


def test_with_two_workers_history_and_metrics_merge_both(
    pod_factory: Callable[..., list[Pod]], activator_factory: Callable[..., Activator]
) -> None:
    pods = pod_factory(2)
    config = make_config(pods, top={"workers": 2}, container_concurrency=2, queue_depth=200)
    act = activator_factory(config)
    results = concurrent_requests(16, lambda i: [request(act.url("/delay?ms=20")).status for _ in range(5)])
    sent = sum(len(r) for r in results)
    assert all(status == 200 for r in results for status in r)
    status = act.wait_for(
        lambda st: st["services"]["api"]["totals"]["requests"] == sent and st["worker"]["count"] == 2,
        message="every request counted once, by one worker",
    )
    assert [w["index"] for w in status["workers"]] == [0, 1]

    def merged() -> dict[str, Any] | None:
        h = act.admin_get("/status/history").json()
        api = h["services"].get("api")
        return h if api and sum(api["requests"]) == sent else None

    history = wait_until(merged, message="the merged history holds every request")
    assert history["workers"] == 2
    api = history["services"]["api"]
    assert sum(api["responses"]["2xx"]) == sent
    assert max(api["capacity"]) == 4, "both workers' slots: 2 pods x cc 2"
    assert set(api["pods"]) == {p.address for p in pods}
    assert sum(v or 0 for p in api["pods"].values() for v in p["requests"]) == sent
    assert {change.get("worker") for change in api["transitions"]} == {0, 1}, "each worker's pod changes"
    values = metric_values(act.admin_get("/metrics").text)
    assert values[("activator_requests_total", (("service", "api"),))] == sent
    assert values[("activator_capacity", (("service", "api"),))] == 4
    per_pod = [values[("activator_pod_requests_total", (("pod", p.address), ("service", "api")))] for p in pods]
    assert sum(per_pod) == sent
    rows = list(csv.DictReader(io.StringIO(act.admin_get("/status.csv").text, newline="")))
    assert sorted(row["pod"] for row in rows) == sorted(p.address for p in pods)
    assert sum(int(row["slots"]) for row in rows) == 4

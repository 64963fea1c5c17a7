"""Self-tests of the e2e test pod (``tests/backend.py``) and of the harness (its processes,
waits, config builders and receivers).

The e2e tests trust the pod's own record of its concurrency, so this module proves that
record right (concurrent requests raise the peak, sequential ones do not) and proves the
pod can fail the ways the e2e tests need (unhealthy, hanging, garbage, reset mid-body).
No activator is involved; waits poll a condition, and no assertion is about elapsed time.
The process tests run small Python children that print what the test then checks.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import harness
import pytest
from harness import (
    SERVICE,
    Client,
    HarnessError,
    NotifySocket,
    Pod,
    Process,
    ProcessExited,
    StatsdReceiver,
    activator_command,
    concurrent_requests,
    download_pattern,
    free_ports,
    is_idle,
    json_request,
    make_config,
    pod_entry,
    probe_config,
    request,
    start_request,
    stream,
    wait_http,
    wait_listening,
    wait_until,
)


@pytest.fixture(scope="module")
def shared_pod() -> Iterator[Pod]:
    with Pod() as pod:
        yield pod


@pytest.fixture
def pod(shared_pod: Pod) -> Pod:
    wait_until(lambda: shared_pod.stats()["in_flight"] == 0, timeout=10)
    shared_pod.reset()
    shared_pod.set_health(True)
    shared_pod.set_health_hang(False)
    return shared_pod


def test_concurrent_requests_raise_the_peak(pod: Pod) -> None:
    # Three requests written back to back on three connections, then read: all three
    # are inside the pod's 300 ms sleep together.
    conns = [start_request(pod.address, "GET", "/delay?ms=300") for _ in range(3)]
    try:
        bodies = [c.getresponse().read() for c in conns]
    finally:
        for c in conns:
            c.close()
    assert all(pod.address.encode() in b for b in bodies)
    stats = pod.stats()
    assert stats["peak"] == 3
    assert stats["count"] == 3
    assert stats["in_flight"] == 0
    assert stats["paths"] == {"/delay": 3}


def test_sequential_requests_keep_peak_one(pod: Pod) -> None:
    for _ in range(3):
        assert request(pod.address, "GET", "/delay?ms=20").status == 200
    with Client(pod.address) as client:  # keep-alive: same connection, still one at a time
        for _ in range(3):
            assert client.request("GET", "/other-path?ms=5").status == 200
    stats = pod.stats()
    assert stats["peak"] == 1
    assert stats["count"] == 6
    assert stats["paths"] == {"/delay": 3, "/other-path": 3}


def test_concurrent_requests_helper_returns_results_in_order(pod: Pod) -> None:
    results = concurrent_requests(4, lambda i: request(pod.address, "GET", f"/echo?i={i}").json()["query"])
    assert results == ["i=0", "i=1", "i=2", "i=3"]
    assert 1 <= pod.stats()["peak"] <= 4


def test_reset_zeroes_peak_and_count(pod: Pod) -> None:
    request(pod.address, "GET", "/delay", headers={"X-Request-Id": "before-reset"})
    assert pod.stats()["count"] == 1
    pod.reset()
    stats = pod.stats()
    assert (stats["peak"], stats["count"], stats["paths"], stats["request_ids"]) == (0, 0, {}, [])


def test_request_ids_recorded_and_control_endpoints_not_counted(pod: Pod) -> None:
    request(pod.address, "GET", "/delay", headers={"X-Request-Id": "r-1"})
    request(pod.address, "POST", "/echo", headers={"X-Request-Id": "r-2"}, body=b"x")
    request(pod.address, "GET", "/healthz", headers={"X-Request-Id": "probe"})
    pod.stats()
    stats = pod.stats()
    assert stats["request_ids"] == ["r-1", "r-2"]
    assert stats["count"] == 2


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_upload_hash_matches(pod: Pod, chunked: bool) -> None:
    data = os.urandom(300_000)
    body = (data[i : i + 50_000] for i in range(0, len(data), 50_000)) if chunked else data
    resp = request(pod.address, "POST", "/upload", body=body)
    assert resp.status == 200
    got = resp.json()
    assert got["length"] == len(data)
    assert got["sha256"] == hashlib.sha256(data).hexdigest()
    if chunked:
        assert got["transfer_encoding"] == "chunked"
        assert got["content_length"] is None
    else:
        assert got["transfer_encoding"] is None
        assert got["content_length"] == len(data)


def test_download_streams_the_pattern(pod: Pod) -> None:
    size = 1_000_003
    resp = request(pod.address, "GET", f"/download?bytes={size}")
    assert resp.status == 200
    assert resp.headers["content-length"] == str(size)
    assert resp.body == download_pattern(size)
    assert resp.body[251] == 0 and resp.body[250] == 250


def test_sse_is_chunked_one_event_per_chunk(pod: Pod) -> None:
    with stream(pod.address, "GET", "/sse?n=3&gap_ms=50") as resp:
        assert resp.getheader("Transfer-Encoding") == "chunked"
        assert resp.getheader("Content-Length") is None
        events = resp.read().decode().strip().split("\n\n")
    assert [e.splitlines()[0] for e in events] == ["id: 0", "id: 1", "id: 2"]


def test_echo_and_status(pod: Pod) -> None:
    got = request(
        pod.address, "PUT", "/echo/a%20b?x=1&y", headers={"X-Custom": "v", "Host": "api.test"}, body=b"hi"
    ).json()
    assert got["method"] == "PUT"
    assert (got["path"], got["query"]) == ("/echo/a%20b", "x=1&y")
    assert got["headers"]["x-custom"] == "v"
    assert got["headers"]["host"] == "api.test"
    assert got["body_length"] == 2
    resp = request(pod.address, "GET", "/status?code=418")
    assert resp.status == 418
    assert resp.headers["X-Pod"] == pod.address


def test_health_toggle(pod: Pod) -> None:
    assert request(pod.address, "GET", "/healthz").status == 200
    pod.set_health(False)
    assert request(pod.address, "GET", "/healthz").status == 503
    assert pod.stats()["healthy"] is False
    pod.set_health(True)
    assert request(pod.address, "GET", "/healthz").status == 200


def test_health_hang_never_answers(pod: Pod) -> None:
    pod.set_health_hang(True)
    with pytest.raises(TimeoutError):
        request(pod.address, "GET", "/healthz", timeout=0.5)
    pod.set_health_hang(False)
    assert request(pod.address, "GET", "/healthz").status == 200
    assert pod.stats()["count"] == 0


def test_hang_does_not_answer_and_ends_when_client_leaves(pod: Pod) -> None:
    with pytest.raises(socket.timeout):
        request(pod.address, "GET", "/hang", timeout=0.5)
    # The client closed its connection: the pod notices and the request leaves.
    wait_until(lambda: pod.stats()["in_flight"] == 0, timeout=10)
    stats = pod.stats()
    assert stats["count"] == 1 and stats["peak"] == 1


def test_hang_counts_as_in_flight(pod: Pod) -> None:
    conn = start_request(pod.address, "GET", "/hang", headers={"X-Request-Id": "h"})
    try:
        wait_until(lambda: pod.stats()["in_flight"] == 1, timeout=10)
        assert pod.stats()["request_ids"] == ["h"]
    finally:
        conn.close()
    wait_until(lambda: pod.stats()["in_flight"] == 0, timeout=10)


def test_garbage_is_not_http(pod: Pod) -> None:
    with pytest.raises(http.client.HTTPException):
        request(pod.address, "GET", "/garbage", timeout=5)
    wait_until(lambda: pod.stats()["in_flight"] == 0, timeout=10)


def test_reset_mid_body(pod: Pod) -> None:
    with stream(pod.address, "GET", "/reset-mid-body?bytes=1000", timeout=5) as resp:
        assert resp.status == 200
        assert resp.getheader("Content-Length") == "1000000"
        with pytest.raises((http.client.IncompleteRead, ConnectionResetError)):
            resp.read()
    wait_until(lambda: pod.stats()["in_flight"] == 0, timeout=10)


def test_stop_refuses_and_restart_same_port() -> None:
    with Pod(fail_health=True) as pod:
        port = pod.port
        assert request(pod.address, "GET", "/healthz").status == 503
        pod.stop()
        with pytest.raises(ConnectionRefusedError):
            request(pod.address, "GET", "/delay", timeout=5)
        pod.restart()
        assert pod.port == port
        assert request(pod.address, "GET", "/delay").status == 200
        assert pod.stats()["count"] == 1
        pod.kill()
        assert not pod.is_running()


def test_free_ports_distinct() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5


def test_free_ports_consecutive_are_a_run_of_free_neighbours() -> None:
    first, *rest = free_ports(4, consecutive=True)
    assert rest == [first + 1, first + 2, first + 3]
    for port in (first, *rest):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_xdist_workers_pick_ports_from_slices_of_their_own_below_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    slices = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(set(harness._port_slice()))
    assert all(len(s) > 1000 for s in slices)
    assert not (slices[0] & slices[1]) and not (slices[1] & slices[2]) and not (slices[0] & slices[2])
    assert max(max(s) for s in slices) < ephemeral
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    assert slices[0] | slices[1] | slices[2] <= set(harness._port_slice())  # a run without workers: the block


def test_wait_until_fails_with_message() -> None:
    with pytest.raises(HarnessError, match="never"):
        wait_until(lambda: False, timeout=0.1, message="never")


def test_statsd_receiver_collects_and_parses() -> None:
    with StatsdReceiver() as rx:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
            tx.sendto(b"a.requests:1|c\na.in_flight:3|g", ("127.0.0.1", rx.port))
            tx.sendto(b"a.requests:2|c|@0.5|#service:api\na.latency:12.5|ms", ("127.0.0.1", rx.port))
        rx.wait_for(lambda lines: len(lines) == 4, timeout=10)
        assert rx.metrics()[:2] == [("a.requests", 1.0, "c"), ("a.in_flight", 3.0, "g")]
        assert rx.counter("a.requests") == 3
        assert rx.gauge("a.in_flight") == 3
        assert rx.wait_for_metric("a.latency", "ms").value == 12.5
        assert rx.tagged_metrics()[2].tags == ("service:api",)


def test_notify_socket_collects_datagrams() -> None:
    with NotifySocket() as ns:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as tx:
            tx.sendto(b"READY=1\nSTATUS=serving", ns.path)
            tx.sendto(b"WATCHDOG=1", ns.path)
        assert "STATUS=serving" in ns.wait_for("READY=1", timeout=10)
        ns.wait_for("WATCHDOG=1", timeout=10)
        assert ns.assignments() == ["READY=1", "STATUS=serving", "WATCHDOG=1"]
        assert ns.env()["NOTIFY_SOCKET"] == ns.path
    assert json.dumps(ns.messages())  # still readable after close


# --------------------------------------------------------------------------------------
# the harness: processes, waits, configs


def _python(tmp_path: Path, code: str, name: str = "child") -> Process:
    return Process(
        [sys.executable, "-c", code],
        stdout_path=tmp_path / f"{name}.out",
        stderr_path=tmp_path / f"{name}.err",
        name=name,
    )


def _gone(pid: int) -> bool:
    """No such process any more (or only its zombie, waiting for its new parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


# A parent that starts a child in its own process group, prints the child's pid, and
# waits; the child would outlive it by a minute.
_PARENT_AND_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("CHILD", child.pid, flush=True)
time.sleep(60)
"""


def test_process_stop_ends_the_process_and_its_group(tmp_path: Path) -> None:
    proc = _python(tmp_path, _PARENT_AND_CHILD)
    child = int(proc.wait_output(r"^CHILD (\d+)$").group(1))
    assert os.getpgid(child) == proc.pid  # the process leads its own group
    assert proc.stop(grace=10) == -signal.SIGTERM  # it exited on SIGTERM, in time
    assert not proc.is_running()
    wait_until(lambda: _gone(child), timeout=10, message="the child killed with the group")


def test_process_stop_kills_what_ignores_the_signal(tmp_path: Path) -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('READY', flush=True); time.sleep(60)"
    )
    proc = _python(tmp_path, code)
    proc.wait_output("^READY$")
    assert proc.stop(grace=0.5) is None  # not exited within the grace period: killed
    assert proc.returncode == -signal.SIGKILL


def test_waits_on_a_process_fail_at_once_when_it_exits(tmp_path: Path) -> None:
    proc = _python(tmp_path, "import sys; print('bye'); sys.exit(3)")
    with pytest.raises(ProcessExited, match="exited with 3") as exc:
        proc.wait_output("never printed", timeout=60)
    assert exc.value.code == 3
    assert "bye" in str(exc.value)  # the output tail comes with the failure
    (port,) = free_ports(1)
    with pytest.raises(ProcessExited):
        wait_http(f"127.0.0.1:{port}", "/", process=proc, timeout=60)
    with pytest.raises(ProcessExited):
        wait_listening(f"127.0.0.1:{port}", process=proc, timeout=60)
    assert proc.wait(timeout=10) == 3


def test_wait_http_and_wait_listening_on_a_pod(pod: Pod) -> None:
    wait_listening(pod.address, process=pod.process)
    assert wait_http(pod.address, "/_stats", process=pod.process).json()["in_flight"] == 0
    assert json_request(pod.address, "GET", "/_stats")["healthy"] is True
    with pytest.raises(HarnessError, match="404"):
        json_request(pod.address, "GET", "/status?code=404")


def test_process_output_goes_to_its_files(tmp_path: Path) -> None:
    proc = _python(tmp_path, "import sys; print('to stdout'); print('to stderr', file=sys.stderr)")
    assert proc.wait(timeout=30) == 0
    assert proc.stdout_text() == "to stdout\n"
    assert proc.stderr_text() == "to stderr\n"
    assert "--- child stderr (tail)\nto stderr" in proc.output_tail()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [sys.executable, "-m", "activator"]),
        (sys.executable, [sys.executable]),  # a path to an executable: as is
        ("python3 -m activator", ["python3", "-m", "activator"]),  # a command line: split
    ],
)
def test_activator_command_honours_activator_bin(
    monkeypatch: pytest.MonkeyPatch, value: str | None, expected: list[str]
) -> None:
    if value is None:
        monkeypatch.delenv("ACTIVATOR_BIN", raising=False)
    else:
        monkeypatch.setenv("ACTIVATOR_BIN", value)
    assert activator_command() == expected


def test_make_config_and_its_options() -> None:
    class Other:  # any pod-like object with an address
        address = "127.0.0.1:2"

    config = make_config(
        ["127.0.0.1:1", Other(), pod_entry("127.0.0.1:3", drain=True)],
        top={"limits": {"client_timeout": "1s"}},
        lb_policy="first-available",
        container_concurrency=2,
    )
    assert config == {
        "access_log": False,
        "limits": {"client_timeout": "1s"},
        "services": {
            SERVICE: {
                "hosts": ["*"],
                "container_concurrency": 2,
                "probe": None,
                "lb_policy": "first-available",
                "pods": ["127.0.0.1:1", "127.0.0.1:2", {"address": "127.0.0.1:3", "drain": True}],
            }
        },
    }
    named = make_config([], service="other", top={"access_log": True}, probe=probe_config(interval="1s"))
    assert named["access_log"] is True
    assert named["services"]["other"]["probe"] == {
        "path": "/healthz",
        "interval": "1s",
        "timeout": "1s",
        "healthy_after": 1,
        "unhealthy_after": 2,
    }


def _status(**counts: int) -> dict[str, Any]:
    """A /status with services ``a`` and ``b``; ``counts`` like ``a_queued=1``, ``b_pod=1``."""
    return {
        "services": {
            name: {
                "in_flight": counts.get(f"{name}_in_flight", 0),
                "queued": counts.get(f"{name}_queued", 0),
                "pods": [{"address": "127.0.0.1:1", "in_flight": counts.get(f"{name}_pod", 0)}],
            }
            for name in ("a", "b")
        }
    }


@pytest.mark.parametrize("busy", ["a_in_flight", "a_queued", "a_pod", "b_in_flight", "b_queued", "b_pod"])
def test_is_idle_sees_every_count(busy: str) -> None:
    assert is_idle(_status()) and is_idle(_status(), "a") and is_idle(_status(), "b")
    status = _status(**{busy: 1})
    assert not is_idle(status)
    service = busy[0]
    other = "b" if service == "a" else "a"
    assert not is_idle(status, service)
    assert is_idle(status, other)

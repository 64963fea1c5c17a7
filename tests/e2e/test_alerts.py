"""End to end: what an operator alerts on and reads, from a running activator (issue 26).

The real ``activator run`` (or ``$ACTIVATOR_BIN``) in front of ``tests/backend.py`` pods:

- pod state changes at priorities ``journalctl -p warning`` can filter (a pod leaving
  ``healthy`` is WARNING, one back is NOTICE), and a dead pod of a service without a
  probe logged all the same;
- every request refused before routing (bad framing, a bad Host, a header section over
  the limit, an unknown host, too many connections, an HTTP/2 stream with a bad
  authority) as one access-log line and one count, in ``/status``, ``/metrics`` and
  StatsD, each reason present at 0 from the start; activator's own answers logged with
  the bytes of their body;
- ``STATUS=`` kept current on a real notification socket;
- the process log: a bad ``ACTIVATOR_LOG_LEVEL``, a port taken, a reload's changes, a
  certificate replaced under the same paths;
- ``/metrics``' content type and ``HEAD``.

Nothing is timed: every wait polls the condition with a generous timeout.
"""

from __future__ import annotations

import hashlib
import re
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest
from harness import (
    ActivatorFactory,
    H2Client,
    PodFactory,
    StatsdReceiver,
    free_port,
    make_config,
    probe_config,
    request,
    run_cli,
    send_raw,
    start_request,
    wait_until,
)
from prometheus_client.parser import text_string_to_metric_families
from test_tls import Authority

pytestmark = pytest.mark.binary

#: A process-log line of the plain format (time, level, message).
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|NOTICE|WARNING|ERROR|CRITICAL) ")


def log_lines(act: Any, level: str, text: str) -> list[str]:
    return [line for line in act.stderr_text().splitlines() if f" {level} " in line and text in line]


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# --------------------------------------------------------------------------------------
# pod state changes at priorities an operator can alert on


def test_a_pod_leaving_healthy_is_a_warning_and_one_back_is_a_notice(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], probe=probe_config("100ms")))
    act.wait_pod_state("api", pod.address, "healthy")
    pod.set_health(False)
    act.wait_pod_state("api", pod.address, "pending")
    wait_until(lambda: log_lines(act, "WARNING", "healthy -> pending"), message="the warning")
    pod.set_health(True)
    act.wait_pod_state("api", pod.address, "healthy")
    wait_until(lambda: len(log_lines(act, "NOTICE", "pending -> healthy")) == 2, message="both returns as notices")
    (warning,) = log_lines(act, "WARNING", "healthy -> pending")
    assert f"service api: pod {pod.address} healthy -> pending (probe failed 2 times: " in warning
    assert not log_lines(act, "INFO", "-> pending"), "never at INFO: journalctl -p warning would miss it"


def test_a_dead_pod_without_a_probe_is_logged_and_so_is_its_return(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], top={"access_log": True}))  # probe: null
    assert request(act.url("/delay?ms=1")).status == 200
    pod.stop()

    def failing_logged() -> list[str]:
        assert request(act.url("/delay?ms=1")).status == 502
        return log_lines(act, "WARNING", "in a row")

    wait_until(failing_logged, message="a warning after connections failed in a row")
    (warning,) = log_lines(act, "WARNING", "in a row")
    assert f"service api: pod {pod.address} failed 3 times in a row (connect_errors);" in warning
    assert "no probe is configured, so it stays in rotation" in warning
    pod.start()  # the same port
    wait_until(lambda: request(act.url("/delay?ms=1")).status == 200, message="served again")
    wait_until(lambda: log_lines(act, "NOTICE", f"pod {pod.address} answers again"), message="the notice")
    assert len(log_lines(act, "WARNING", "in a row")) == 1, "one warning per streak"


# --------------------------------------------------------------------------------------
# refusals before routing: one line and one count each


def refuse(act: Any, data: bytes) -> bytes:
    sock = send_raw(act.listen, data, timeout=10)
    try:
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer
    except OSError:
        return b""
    finally:
        sock.close()


def test_every_refusal_is_an_access_line_and_a_count_in_status_metrics_and_statsd(
    pod_factory: PodFactory, activator_factory: ActivatorFactory, statsd_receiver: StatsdReceiver
) -> None:
    (pod,) = pod_factory(1)
    config = make_config(
        [pod],
        hosts=["api.test"],
        top={
            "access_log": True,
            "limits": {"max_header_bytes": 2048},
            "statsd": {"address": statsd_receiver.address, "prefix": "t"},
        },
    )
    act = activator_factory(config)
    before = metric_values(act.admin_get("/metrics").text)
    for reason in ("bad-request", "headers-too-large", "bad-host", "unknown-host", "too-many-connections"):
        assert before[("activator_refused_total", (("reason", reason),))] == 0, f"{reason}: a series from the start"
    assert act.status()["refused"]["bad-host"] == 0

    assert refuse(act, b"GET / HTTP/1.1\nHost: api.test\n\n").startswith(b"HTTP/1.1 400 ")  # bare LF
    assert refuse(act, b"GET /big HTTP/1.1\r\nHost: api.test\r\nX: " + b"y" * 4000 + b"\r\n\r\n").startswith(
        b"HTTP/1.1 431 "
    )
    assert refuse(act, b"GET /no-host HTTP/1.1\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert request(act.url("/elsewhere"), host="nowhere.test").status == 404
    h2 = H2Client(act.listen, host="a,b")
    try:
        stream = h2.send("GET", "/h2")
        assert h2.response(stream).status == 400
    finally:
        h2.close()
    expected = {"bad-request": 1, "headers-too-large": 1, "bad-host": 2, "unknown-host": 1}

    lines = wait_until(
        lambda: (found := [r for r in act.access_log() if r.service == "-"]) and len(found) == 5 and found,
        message="five access-log lines of no service",
    )
    by_reason: dict[str, int] = {}
    for line in lines:
        by_reason[line.reason] = by_reason.get(line.reason, 0) + 1
        assert line.pod == "-" and line.bytes == len(f"{line.status} {line.reason}\n"), line.line
    assert by_reason == expected
    assert {(r.reason, r.method, r.target) for r in lines} >= {
        ("bad-request", "-", ""),
        ("headers-too-large", "-", ""),
        ("bad-host", "GET", "/no-host"),
        ("unknown-host", "GET", "/elsewhere"),
        ("bad-host", "GET", "/h2"),
    }
    status = act.wait_for(lambda st: sum(st["refused"].values()) == 5, message="five refusals counted")
    assert {k: v for k, v in status["refused"].items() if v} == expected
    after = metric_values(act.admin_get("/metrics").text)
    for reason, count in expected.items():
        assert after[("activator_refused_total", (("reason", reason),))] == count, reason
    for name, count in (("bad_request", 1), ("header_too_large", 1), ("bad_host", 2), ("unknown_host", 1)):
        statsd_receiver.wait_for(
            lambda _, name=name, count=count: statsd_receiver.counter(f"t.rejected.{name}") == count
        )
    assert not any(".api.requests" in line for line in statsd_receiver.lines()), "no service counted them"


def test_too_many_connections_is_a_line_and_a_count(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], top={"access_log": True, "limits": {"max_connections": 1}}))
    held = socket.create_connection(("127.0.0.1", act.port), timeout=10)
    try:
        held.sendall(b"GET /delay?ms=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert held.recv(65536).startswith(b"HTTP/1.1 200 ")  # it is open, and kept alive
        assert refuse(act, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 503 ")
    finally:
        held.close()
    line = act.wait_access(lambda r: r.reason == "too-many-connections", message="the refusal's line")
    assert (line.service, line.status, line.bytes) == ("-", 503, len(b"503 too-many-connections\n"))
    act.wait_for(lambda st: st["refused"]["too-many-connections"] == 1, message="counted")


def test_activators_own_answers_log_the_bytes_of_their_body(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], queue_depth=0, top={"access_log": True}))
    assert request(act.url("/delay?ms=1")).status == 200
    busy = start_request(act.url("/delay?ms=3000"))
    try:
        act.wait_for(lambda st: st["services"]["api"]["in_flight"] == 1, message="the one slot taken")
        full = request(act.url("/refused"))
        assert full.status == 503 and full.body == b"503 queue-full\n"
    finally:
        busy.close()
    line = act.wait_access(lambda r: r.reason == "queue-full", message="the queue-full line")
    assert line.bytes == len(b"503 queue-full\n") == 15 and line.service == "api"


# --------------------------------------------------------------------------------------
# systemd's STATUS= line


def test_the_status_line_follows_the_pods_without_a_reload(
    pod_factory: PodFactory, activator_factory: ActivatorFactory, notify_socket: Any
) -> None:
    (pod,) = pod_factory(1, fail_health=True)
    config = make_config([pod], probe=probe_config("100ms"))
    act = activator_factory(config, env=notify_socket.env())
    ready = notify_socket.wait_for("READY=1")
    assert "STATUS=1 services, 0/1 pods healthy" in ready
    pod.set_health(True)
    act.wait_pod_state("api", pod.address, "healthy")
    notify_socket.wait_for("STATUS=1 services, 1/1 pods healthy")
    assert notify_socket.assignments().count("READY=1") == 1, "no reload was needed"
    pod.set_health(False)
    act.wait_pod_state("api", pod.address, "pending")
    wait_until(
        lambda: notify_socket.assignments()[-1].startswith("STATUS=1 services, 0/1 pods healthy"),
        message="the line follows the pod back down",
    )


# --------------------------------------------------------------------------------------
# the process log


def test_a_bad_log_level_is_one_warning_not_a_crash(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod]), env={"ACTIVATOR_LOG_LEVEL": "verbose"})
    assert request(act.url("/delay?ms=1")).status == 200
    stderr = act.stderr_text()
    assert "Traceback" not in stderr
    (warning,) = [line for line in stderr.splitlines() if " WARNING " in line]
    assert (
        "ACTIVATOR_LOG_LEVEL='verbose' is not a level (DEBUG, INFO, NOTICE, WARNING, ERROR); logging at INFO" in warning
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_a_port_taken_is_named_in_the_error(
    pod_factory: PodFactory, activator_factory: ActivatorFactory, workers: int
) -> None:
    (pod,) = pod_factory(1)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        config = make_config([pod], top={"listen": f"127.0.0.1:{port}", "workers": workers})
        act = activator_factory(config, start=False)
        act.start(wait_ready=False)
        assert act.wait(60) == 1
    finally:
        taken.close()
    stderr = act.stderr_text()
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in stderr, stderr
    assert "Traceback" not in stderr and "[Errno" not in stderr


def test_a_reload_logs_each_change_on_a_line_of_its_own(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    a, b = pod_factory(2)
    act = activator_factory(make_config([a]))
    act.rewrite_config(make_config([a, b], container_concurrency=2))
    act.wait_for(lambda st: st["reloads"]["ok"] >= 1 and len(st["services"]["api"]["pods"]) == 2, message="applied")
    wait_until(lambda: "config reload" in act.stderr_text(), message="the reload logged")
    lines = act.stderr_text().splitlines()
    assert all(LOG_LINE.match(line) for line in lines), lines
    reload = [line for line in lines if "config reload (file changed)" in line or "service api:" in line]
    assert any(line.endswith(f"service api: add pod {b.address}") for line in lines), reload
    assert any(line.endswith("service api: container_concurrency 1 -> 2") for line in lines), reload


def test_a_certificate_replaced_under_the_same_paths_is_a_change(
    pod_factory: PodFactory, activator_factory: ActivatorFactory, tmp_path: Path
) -> None:
    (pod,) = pod_factory(1)
    pki = tmp_path / "pki"
    pki.mkdir()
    authority = Authority(pki)
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    authority.issue(cert, key)
    act = activator_factory(make_config([pod], top={"tls": {"cert": str(cert), "key": str(key)}}))
    authority.issue(cert, key, common_name="renewed")
    act.reload()
    found = wait_until(
        lambda: [line for line in act.stderr_text().splitlines() if "tls: certificate" in line],
        message="the new certificate logged",
    )
    fingerprint = re.search(r"reloaded \(sha256 ((?:[0-9A-F]{2}:){31}[0-9A-F]{2})\)$", found[-1])
    assert fingerprint is not None and f"tls: certificate {cert} reloaded" in found[-1], found
    der = ssl.PEM_cert_to_DER_cert(cert.read_text())
    assert fingerprint.group(1) == ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())
    assert not [line for line in act.stderr_text().splitlines() if line.endswith("(SIGHUP): no change")]


def test_check_shows_a_removed_secret_as_gone_without_showing_it(tmp_path: Path) -> None:
    peers = {"vm-a": f"127.0.0.1:{free_port()}", "vm-b": f"127.0.0.1:{free_port()}"}
    old = tmp_path / "old.yaml"
    new = tmp_path / "new.yaml"
    old.write_text(
        "activators:\n  self: vm-a\n  secret: a-secret-of-32-characters-long!!\n"
        f"  peers: {{vm-a: {peers['vm-a']}, vm-b: {peers['vm-b']}}}\nservices: {{}}\n"
    )
    new.write_text(f"activators:\n  self: vm-a\n  peers: {{vm-a: {peers['vm-a']}}}\nservices: {{}}\n")
    done = run_cli(["check", "-c", str(new), "--against", str(old)])
    assert done.returncode == 0, done.stderr
    assert "activators.secret (hidden) -> null" in done.stdout, done.stdout
    assert "a-secret-of" not in done.stdout


# --------------------------------------------------------------------------------------
# /metrics as Prometheus expects it


def test_metrics_are_text_format_0_0_4_and_answer_head(
    pod_factory: PodFactory, activator_factory: ActivatorFactory
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod]))
    got = act.admin_get("/metrics")
    assert got.status == 200 and got.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    values = metric_values(got.text)
    assert values[("process_open_fds", ())] > 0 and values[("process_resident_memory_bytes", ())] > 0
    head = request(act.admin_url("/metrics"), "HEAD")
    assert head.status == 200 and head.body == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    assert request(act.admin_url("/status"), "HEAD").status == 200
    assert request(act.admin_url("/healthz"), "HEAD").status == 200

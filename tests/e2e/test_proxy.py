"""End to end: the throttling proxy in front of real pods (issue 2, point 6).

The real ``activator run`` (or ``$ACTIVATOR_BIN``) runs as a subprocess in front of
``tests/backend.py`` pods on 127.0.0.1 that record their own peak concurrency. Every
test waits by polling (``/status``, the pods' ``/_stats``) with generous timeouts and
never asserts on elapsed time. Most tests end with :meth:`Activator.wait_idle`: every count
in ``/status`` back to zero, which is how a leaked slot (a path that forgot to release)
shows up. The tests that leave the activator and its pod as they found them share one
pair for the module (the ``proxied`` fixture).
"""

from __future__ import annotations

import hashlib
import http.server
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from harness import (
    SERVICE,
    Activator,
    Client,
    concurrent_requests,
    download_pattern,
    find_pod,
    free_port,
    make_config,
    read_all,
    request,
    send_raw,
    start_request,
    stream,
    wait_until,
)

pytestmark = pytest.mark.binary

MiB = 1024 * 1024


def service_status(act: Activator) -> dict[str, Any]:
    result: dict[str, Any] = act.status()["services"][SERVICE]
    return result


def reason(resp: Any) -> str | None:
    return resp.headers.get("X-Activator-Reason")


# --------------------------------------------------------------------------------------
# throttling


def test_thirty_concurrent_requests_over_three_cc1_pods(pod_factory, activator_factory):
    pods = pod_factory(3)
    act = activator_factory(make_config(pods))

    results = concurrent_requests(30, lambda i: request(act.listen, path="/delay?ms=100"))

    assert [r.status for r in results] == [200] * 30
    served = {r.headers["X-Pod"] for r in results}
    assert served == {p.address for p in pods}
    for pod in pods:
        stats = pod.stats()
        assert stats["peak"] == 1, f"{pod.address} saw {stats['peak']} requests at once"
        assert stats["count"] > 0
    assert sum(p.stats()["count"] for p in pods) == 30

    st = act.wait_idle()
    svc = st["services"][SERVICE]
    assert svc["in_flight"] == 0 and svc["queued"] == 0
    assert [p["in_flight"] for p in svc["pods"]] == [0, 0, 0]
    assert all(p["state"] == "healthy" for p in svc["pods"])


def test_queue_overflow_answers_503_queue_full_at_once(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], queue_depth=1, queue_timeout="30s"))

    running = start_request(act.listen, path="/delay?ms=2500")
    act.wait_for(
        lambda st: st["services"][SERVICE]["in_flight"] == 1,
        message="first request running",
    )
    queued = start_request(act.listen, path="/delay?ms=10")
    act.wait_for(
        lambda st: st["services"][SERVICE]["queued"] == 1,
        message="second request queued",
    )
    try:
        refused = request(act.listen, path="/delay?ms=10")
        # Answered while the queue is still full: it did not wait for a slot.
        svc = service_status(act)
        assert svc["queued"] == 1 and svc["in_flight"] == 1
        assert pod.stats()["in_flight"] == 1

        assert refused.status == 503
        assert reason(refused) == "queue-full"
        assert "Retry-After" in refused.headers
        assert int(refused.headers["Retry-After"]) >= 0

        first = running.getresponse()
        assert first.status == 200
        first.read()
        second = queued.getresponse()
        assert second.status == 200
        second.read()
    finally:
        running.close()
        queued.close()
    assert pod.stats()["count"] == 2  # the refused one never reached the pod
    assert pod.stats()["peak"] == 1
    act.wait_idle()


def test_queue_timeout_answers_503_queue_timeout(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], queue_timeout="1s"))

    running = start_request(act.listen, path="/delay?ms=3000")
    try:
        act.wait_for(
            lambda st: st["services"][SERVICE]["in_flight"] == 1,
            message="first request running",
        )
        late = request(act.listen, path="/delay?ms=10")
        assert late.status == 503
        assert reason(late) == "queue-timeout"
        first = running.getresponse()
        assert first.status == 200
        first.read()
    finally:
        running.close()
    assert pod.stats()["count"] == 1  # the timed-out request never reached the pod
    act.wait_idle()


# --------------------------------------------------------------------------------------
# routing


def test_routing_by_host(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], hosts=["api.example.com"]))

    unknown = request(act.listen, path="/delay", host="other.example.com")
    assert unknown.status == 404
    assert reason(unknown) == "unknown-host"
    assert pod.stats()["count"] == 0

    for host in (
        "api.example.com",
        "api.example.com:8080",
        "API.Example.COM",
        "Api.Example.Com:1",
    ):
        resp = request(act.listen, path="/echo", host=host)
        assert resp.status == 200, host
        assert resp.headers["X-Pod"] == pod.address
        assert resp.json()["headers"]["host"] == host  # the original Host is kept
    assert pod.stats()["count"] == 4
    act.wait_idle()


def test_absolute_form_target_is_refused_and_reaches_no_pod(proxied):
    pod, act = proxied.pod, proxied.act

    sock = send_raw(
        act.listen,
        b"GET http://elsewhere/ HTTP/1.1\r\nHost: elsewhere\r\nConnection: close\r\n\r\n",
    )
    try:
        answer = read_all(sock)
    finally:
        sock.close()
    assert re.match(rb"HTTP/1\.[01] 400 ", answer), answer[:200]
    assert pod.stats()["count"] == 0
    # The proxy still serves ordinary requests.
    assert request(act.listen, path="/delay").status == 200
    act.wait_idle()


# --------------------------------------------------------------------------------------
# upstream failures


def test_refused_connection_answers_502(activator_factory):
    closed = f"127.0.0.1:{free_port()}"
    act = activator_factory(make_config([closed], connect_timeout="2s"))

    resp = request(act.listen, path="/delay")
    assert resp.status == 502
    assert reason(resp) == "upstream-connect"
    act.wait_idle()


def test_connect_failure_is_retried_once_on_another_pod(pod_factory, activator_factory):
    (live,) = pod_factory(1)
    closed = f"127.0.0.1:{free_port()}"
    # first-available with the closed pod listed first: it is always tried first.
    act = activator_factory(make_config([closed, live], lb_policy="first-available"))

    for _ in range(4):
        resp = request(act.listen, path="/delay")
        assert resp.status == 200, (resp.status, resp.headers)
        assert resp.headers["X-Pod"] == live.address
    assert live.stats()["count"] == 4

    st = act.wait_idle()
    dead = find_pod(st, SERVICE, closed)
    assert dead is not None
    connect_errors = sum(n for k, n in dead["transport_failures"].items() if k.startswith("connect"))
    assert connect_errors >= 1, dead  # the closed pod was tried, and the request retried


def test_pod_slower_than_request_timeout_answers_504(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], request_timeout="500ms"))

    resp = request(act.listen, path="/delay?ms=2500")
    assert resp.status == 504
    assert reason(resp) == "upstream-timeout"
    act.wait_idle()  # the slot came back
    wait_until(lambda: pod.stats()["in_flight"] == 0)
    assert request(act.listen, path="/delay?ms=10").status == 200


# --------------------------------------------------------------------------------------
# bodies streaming both ways


def test_large_upload_with_content_length_arrives_intact(proxied):
    act = proxied.act
    body = os.urandom(4 * MiB)

    resp = request(
        act.listen,
        "POST",
        "/upload",
        body=body,
        headers={
            "Content-Length": str(len(body)),
            "Content-Type": "application/octet-stream",
        },
    )
    assert resp.status == 200
    got = resp.json()
    assert got["length"] == len(body)
    assert got["sha256"] == hashlib.sha256(body).hexdigest()
    act.wait_idle()


def test_large_chunked_upload_arrives_intact(proxied):
    act = proxied.act
    body = os.urandom(4 * MiB)

    def pieces() -> Iterator[bytes]:
        for i in range(0, len(body), 100_000):  # odd-sized chunks
            yield body[i : i + 100_000]

    resp = request(act.listen, "PUT", "/upload", body=pieces())
    assert resp.status == 200
    got = resp.json()
    assert got["length"] == len(body)
    assert got["sha256"] == hashlib.sha256(body).hexdigest()
    act.wait_idle()


def test_large_download_arrives_intact(proxied):
    act = proxied.act
    size = 4 * MiB

    resp = request(act.listen, path=f"/download?bytes={size}")
    assert resp.status == 200
    assert len(resp.body) == size
    assert resp.body == download_pattern(size)
    act.wait_idle()


def test_server_sent_events_arrive_chunk_by_chunk(proxied):
    pod, act = proxied.pod, proxied.act

    with stream(act.listen, path="/sse?n=5&gap_ms=300") as resp:
        assert resp.status == 200
        assert resp.getheader("Content-Type", "").startswith("text/event-stream")
        first_event = []
        while True:
            line = resp.readline()
            assert line, "stream ended before the first event"
            if line == b"\n":
                break
            first_event.append(line)
        assert first_event[0] == b"id: 0\n"
        # The first event is here while the pod is still producing the others.
        assert pod.stats()["in_flight"] == 1
        assert service_status(act)["in_flight"] == 1
        rest = resp.read()
    events = re.findall(rb"^id: (\d+)$", rest, re.M)
    assert events == [b"1", b"2", b"3", b"4"]
    act.wait_idle()


# --------------------------------------------------------------------------------------
# what is forwarded


def test_forwarded_headers_and_hop_by_hop_headers(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], hosts=["api.example.com"]))

    resp = request(
        act.listen,
        path="/echo",
        headers={
            "Host": "API.example.com:8443",
            "Connection": "x-custom",
            "X-Custom": "hop by hop, named in Connection",
            "Keep-Alive": "timeout=5",
            "TE": "trailers",
            "Upgrade": "h2c",
            "Proxy-Authorization": "Basic c2VjcmV0",
            "X-End-To-End": "kept",
            "X-Forwarded-For": "203.0.113.7",
        },
    )
    assert resp.status == 200
    seen = resp.json()["headers"]
    assert seen["host"] == "API.example.com:8443"
    assert seen["x-end-to-end"] == "kept"
    assert seen["x-forwarded-host"] == "API.example.com:8443"
    assert seen["x-forwarded-proto"] == "http"
    assert [h.strip() for h in seen["x-forwarded-for"].split(",")] == [
        "203.0.113.7",
        "127.0.0.1",
    ]
    for name in ("x-custom", "keep-alive", "te", "upgrade", "proxy-authorization"):
        assert name not in seen, f"hop-by-hop header {name} was forwarded: {seen}"
    assert seen.get("connection", "").lower() in ("", "keep-alive")
    act.wait_idle()


def test_x_forwarded_for_is_set_without_a_client_value(proxied):
    act = proxied.act
    seen = request(act.listen, path="/echo", host="x.example.com").json()["headers"]
    assert seen["x-forwarded-for"] == "127.0.0.1"
    assert seen["x-forwarded-host"] == "x.example.com"
    assert seen["x-forwarded-proto"] == "http"


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH", "OPTIONS", "POST"])
def test_methods_pass_through_with_target_untouched(proxied, method):
    act = proxied.act
    target = "/echo/a%20b%2Fc/%7Euser?q=%41%2B%2b&x=1&empty=&sp=a+b&pct=%25"
    body = b"payload for " + method.encode() if method in ("PUT", "PATCH", "POST") else None

    resp = request(act.listen, method, target, body=body)
    assert resp.status == 200
    got = resp.json()
    assert got["method"] == method
    assert got["target"] == target
    assert got["query"] == "q=%41%2B%2b&x=1&empty=&sp=a+b&pct=%25"
    if body is not None:
        assert got["body_length"] == len(body)
        assert got["body_sha256"] == hashlib.sha256(body).hexdigest()
    act.wait_idle()


def test_204_and_304_pass_and_release_their_slots(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], queue_timeout="5s"))

    with Client(act.listen) as client:
        no_content = client.request("GET", "/status?code=204")
        assert no_content.status == 204
        assert no_content.body == b""
        not_modified = client.request("GET", "/status?code=304")
        assert not_modified.status == 304
        assert not_modified.body == b""
        ok = client.request("GET", "/status?code=200")
        assert ok.status == 200
        assert ok.body.startswith(b"status 200")
    assert pod.stats()["count"] == 3
    act.wait_idle()


class _MiniPod(http.server.BaseHTTPRequestHandler):
    """A small keep-alive HTTP/1.1 pod for what ``tests/backend.py`` cannot do: send
    two Set-Cookie headers, and answer HEAD without a body (pywsgi, under the test
    backend, writes the body after a HEAD response's head, which desynchronises a
    kept-alive connection)."""

    protocol_version = "HTTP/1.1"

    def _answer(self, with_body: bool) -> None:
        self.server.seen.append(f"{self.command} {self.path}")  # type: ignore[attr-defined]
        body = f"{self.path} from mini pod\n".encode()
        self.send_response(200)
        if self.path.startswith("/cookies"):
            self.send_header("Set-Cookie", "a=1; Path=/")
            self.send_header("Set-Cookie", "b=2; Path=/; HttpOnly")
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def do_GET(self) -> None:  # http.server's naming
        self._answer(True)

    def do_HEAD(self) -> None:  # http.server's naming
        self._answer(False)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def mini_pod() -> Iterator[Any]:
    """(address, list of "METHOD path" it served)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _MiniPod)
    server.daemon_threads = True
    server.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", server.seen  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()


def test_head_passes_and_releases_its_slot(mini_pod, activator_factory):
    address, seen = mini_pod
    act = activator_factory(make_config([address], queue_timeout="5s"))

    with Client(act.listen) as client:
        for _ in range(3):
            head = client.request("HEAD", "/thing")
            assert head.status == 200
            assert head.body == b""
            assert head.headers.get("Content-Length") in (
                None,
                str(len(b"/thing from mini pod\n")),
            )
            # cc=1: a HEAD that kept its slot would make this GET wait, then 503.
            after = client.request("GET", "/thing")
            assert after.status == 200, (after.status, after.headers)
            assert after.body == b"/thing from mini pod\n"
    assert seen == ["HEAD /thing", "GET /thing"] * 3
    act.wait_idle()


def test_head_to_the_test_backend_releases_its_slot(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(make_config([pod], queue_timeout="5s"))
    resp = request(act.listen, "HEAD", "/delay?ms=10")
    assert resp.status == 200
    assert resp.body == b""
    assert resp.headers["X-Pod"] == pod.address
    act.wait_idle()  # before the fix, the slot was never released


def test_multiple_set_cookie_headers_all_reach_the_client(mini_pod, activator_factory):
    address, _ = mini_pod
    act = activator_factory(make_config([address]))
    resp = request(act.listen, path="/cookies")
    assert resp.status == 200
    assert resp.headers.get_all("Set-Cookie") == [
        "a=1; Path=/",
        "b=2; Path=/; HttpOnly",
    ]
    act.wait_idle()


# --------------------------------------------------------------------------------------
# the admin view after load


def test_status_counts_return_to_zero_after_mixed_load(pod_factory, activator_factory):
    pods = pod_factory(2)
    act = activator_factory(make_config(pods, queue_depth=100))

    paths = [
        "/delay?ms=50",
        "/download?bytes=200000",
        "/status?code=204",
        "/echo",
        "/status?code=304",
        "/sse?n=3&gap_ms=20",
        "/status?code=500",
    ]

    def one(i: int) -> int:
        # No HEAD here: the test backend (pywsgi) writes a body after a HEAD
        # response, which breaks the kept-alive pod connection (see _MiniPod).
        return request(act.listen, "GET", paths[i % len(paths)]).status

    statuses = concurrent_requests(28, one)
    assert set(statuses) == {200, 204, 304, 500}, statuses
    st = act.wait_idle()
    svc = st["services"][SERVICE]
    assert svc["in_flight"] == 0 and svc["queued"] == 0
    for pod in svc["pods"]:
        assert pod["in_flight"] == 0
        assert pod["state"] == "healthy"
    for pod in pods:
        assert pod.stats()["peak"] == 1
    assert sum(p.stats()["count"] for p in pods) == 28

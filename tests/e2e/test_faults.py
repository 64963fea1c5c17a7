"""End to end: faults cost only what they must (issue 7, points 1, 2, 4 and 5).

Clients that leave, pods that fail, resource limits, no open proxy. The real
``activator run`` (or ``$ACTIVATOR_BIN``) runs in front of ``tests/backend.py`` pods,
and, where a test must see which pod *connection* carried a request, in front of
:class:`ConnPod`, a small keep-alive pod in this file that numbers its connections.
Every wait polls (``/status``, the pods' ``/_stats``) with a generous timeout; no test
asserts on elapsed time. Short configured timeouts (``client_timeout: 2s``,
``request_timeout: 1s``) only make the waits short.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from harness import (
    SERVICE,
    Activator,
    Client,
    Pod,
    activator_reason,
    find_pod,
    free_ports,
    make_config,
    parse_head,
    probe_config,
    read_all,
    request,
    rss_kib,
    send_raw,
    start_request,
    stream,
    wait_until,
)

pytestmark = pytest.mark.binary

#: One catch-all service ``api``: cc 1, no probe, first-available (the first listed free
#: pod gets a request, so a test knows where it lands).
faults_config = partial(make_config, lb_policy="first-available", queue_timeout="30s")


def svc(status: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = status["services"][SERVICE]
    return result


def failures(status: dict[str, Any], address: str, kind: str) -> int:
    """Transport failures of ``kind`` (connect_errors, timeouts, resets) counted for a pod."""
    pod = find_pod(status, SERVICE, address)
    assert pod is not None, f"{address} not in /status"
    return sum(n for k, n in pod["transport_failures"].items() if k.split(".")[0] == kind)


def raw_exchange(act: Activator, data: bytes, timeout: float = 30.0) -> bytes:
    sock = send_raw(act.listen, data, timeout=timeout)
    try:
        return read_all(sock)
    finally:
        sock.close()


def read_event(resp: http.client.HTTPResponse) -> bytes:
    """One server-sent event (up to its blank line)."""
    lines = []
    while True:
        line = resp.readline()
        assert line, "stream ended before an event"
        if line == b"\n":
            return b"".join(lines)
        lines.append(line)


# --------------------------------------------------------------------------------------
# a pod that numbers its connections


class ConnPod:
    """A keep-alive HTTP/1.1 pod on 127.0.0.1 (threads, in this process) that records,
    for every request, the number of the connection that carried it.

    ``GET /x?ms=N`` answers after N ms (Content-Length, keep-alive; ``X-Conn`` header);
    ``GET /stream`` sends an endless Content-Length body until its connection breaks.
    ``in_flight`` counts requests being answered; ``closed`` the connections that ended.
    """

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self.requests: list[tuple[int, str, str | None]] = []  # (connection, path, X-Request-Id)
        self.closed: set[int] = set()
        self.in_flight = 0
        self._ids = itertools.count(1)
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn, next(self._ids)), daemon=True).start()

    def _serve(self, conn: socket.socket, cid: int) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                target = urlsplit(lines[0].split(" ")[1])
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
                ms = int(parse_qs(target.query).get("ms", ["0"])[-1])
                with self._lock:
                    self.requests.append((cid, target.path, headers.get("x-request-id")))
                    self.in_flight += 1
                try:
                    if target.path == "/stream":
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n")
                        while True:
                            conn.sendall(b"x" * 100)
                            time.sleep(0.05)
                    time.sleep(ms / 1000)
                    body = b"connection %d\n" % cid
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Conn: %d\r\n\r\n%s" % (len(body), cid, body)
                    )
                finally:
                    with self._lock:
                        self.in_flight -= 1
        except OSError:
            pass
        finally:
            with self._lock:
                self.closed.add(cid)
            conn.close()

    def connection_of(self, request_id: str) -> int:
        with self._lock:
            hits = [c for c, _, rid in self.requests if rid == request_id]
        assert len(hits) == 1, f"{request_id} seen {len(hits)} times: {self.requests}"
        return hits[0]

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def conn_pod() -> Iterator[ConnPod]:
    pod = ConnPod()
    yield pod
    pod.close()


# --------------------------------------------------------------------------------------
# 1. clients that leave


def test_client_leaving_while_queued_is_dropped_and_never_reaches_the_pod(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(faults_config([pod]))

    first = start_request(act.listen, path="/delay?ms=4000", headers={"X-Request-Id": "first"})
    try:
        act.wait_for(lambda st: svc(st)["in_flight"] == 1, message="first request on the pod")
        # Two clients queue behind it: a plain GET, and a POST whose body sits unread
        # in the activator's socket buffer (the EOF hides behind it).
        leaver = start_request(act.listen, path="/delay?ms=0", headers={"X-Request-Id": "leaver"})
        body = b"x" * 5000
        poster = start_request(
            act.listen,
            "POST",
            "/echo",
            body=body,
            headers={"X-Request-Id": "poster", "Content-Length": str(len(body))},
        )
        act.wait_for(lambda st: svc(st)["queued"] == 2, message="two requests queued")
        leaver.close()
        poster.close()
        # Out of the queue while the first request still holds the only slot.
        act.wait_for(
            lambda st: svc(st)["queued"] == 0 and svc(st)["in_flight"] == 1,
            message="the queue empties before the first request ends",
        )
        resp = first.getresponse()
        assert resp.status == 200
        resp.read()
    finally:
        first.close()

    third = request(act.listen, path="/delay?ms=0", headers={"X-Request-Id": "third"})
    assert third.status == 200
    ids = pod.stats()["request_ids"]
    assert ids == ["first", "third"], ids  # the leavers never reached the pod
    assert pod.stats()["peak"] == 1
    act.wait_idle()


def test_client_leaving_mid_response_releases_the_slot_and_closes_the_pod_connection(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(faults_config([pod]))

    # An endless event stream: it can only end because the activator closed the pod
    # connection when the client went away.
    with stream(act.listen, path="/sse?n=1000000&gap_ms=50") as resp:
        assert resp.status == 200
        read_event(resp)
        assert pod.stats()["in_flight"] == 1
    act.wait_for(
        lambda st: svc(st)["in_flight"] == 0,
        message="slot released after the client left",
    )
    wait_until(
        lambda: pod.stats()["in_flight"] == 0,
        message="the pod saw its connection closed",
    )
    assert request(act.listen, path="/delay?ms=0").status == 200
    assert pod.stats()["peak"] == 1
    act.wait_idle()


def test_client_leaving_mid_response_the_pod_connection_is_not_reused(conn_pod, activator_factory):
    act = activator_factory(faults_config([conn_pod]))

    # Control: the activator does keep pod connections alive and reuse them.
    one = request(act.listen, path="/x", headers={"X-Request-Id": "one"})
    two = request(act.listen, path="/x", headers={"X-Request-Id": "two"})
    assert one.status == two.status == 200
    assert conn_pod.connection_of("one") == conn_pod.connection_of("two")

    with stream(act.listen, path="/stream", headers={"X-Request-Id": "streamed"}) as resp:
        assert resp.status == 200
        assert resp.read1(50)
    streamed = conn_pod.connection_of("streamed")
    act.wait_for(
        lambda st: svc(st)["in_flight"] == 0,
        message="slot released after the client left",
    )
    wait_until(lambda: streamed in conn_pod.closed, message="the pod connection was closed")

    nxt = request(act.listen, path="/x", headers={"X-Request-Id": "next"})
    assert nxt.status == 200
    assert conn_pod.connection_of("next") != streamed
    act.wait_idle()


def test_client_leaving_while_the_pod_works_releases_at_the_end_and_drops_the_connection(conn_pod, activator_factory):
    act = activator_factory(faults_config([conn_pod]))
    assert request(act.listen, path="/x", headers={"X-Request-Id": "warm"}).status == 200

    conn = start_request(act.listen, path="/x?ms=1500", headers={"X-Request-Id": "left"})
    wait_until(lambda: conn_pod.in_flight == 1, message="the pod is working on it")
    conn.close()
    # The slot comes back no later than the pod's response ends.
    wait_until(lambda: conn_pod.in_flight == 0, message="the pod finished")
    act.wait_for(
        lambda st: svc(st)["in_flight"] == 0,
        message="slot released once the pod answered",
    )
    left = conn_pod.connection_of("left")

    nxt = request(act.listen, path="/x", headers={"X-Request-Id": "next"})
    assert nxt.status == 200
    act.wait_idle()
    assert conn_pod.connection_of("next") != left, "the abandoned request's pod connection was reused"


# --------------------------------------------------------------------------------------
# 2. pods that fail


@pytest.mark.parametrize("hard", [1, 0], ids=["reset", "close"])
def test_pod_breaking_off_mid_response_cuts_the_client_and_counts_against_the_pod(pod_factory, activator_factory, hard):
    bad, good = pod_factory(2)
    act = activator_factory(faults_config([bad, good]))

    # The pod sends a head promising 1 MB, 1000 bytes, then a reset (or a plain close).
    cut = start_request(act.listen, path=f"/reset-mid-body?bytes=1000&after_ms=500&hard={hard}")
    try:
        wait_until(
            lambda: bad.stats()["in_flight"] == 1,
            message="the reset request is on the first pod",
        )
        # Requests on the other pod, during the reset and after it.
        others = [start_request(act.listen, path="/delay?ms=300") for _ in range(4)]
        resp = cut.getresponse()
        assert resp.status == 200  # the head was already passed on ...
        with pytest.raises((http.client.IncompleteRead, ConnectionError)):
            resp.read()  # ... so the only signal left is the cut connection
        for conn in others:
            try:
                r = conn.getresponse()
                assert r.status == 200, (r.status, activator_reason(r))
                r.read()
            finally:
                conn.close()
    finally:
        cut.close()

    st = act.wait_idle()
    assert failures(st, bad.address, "resets") >= 1, find_pod(st, SERVICE, bad.address)
    assert failures(st, good.address, "resets") == 0
    assert good.stats()["count"] >= 1
    # A reset does not eject the pod: it keeps serving.
    assert find_pod(st, SERVICE, bad.address)["state"] == "healthy"
    resp2 = request(act.listen, path="/delay?ms=0")
    assert resp2.status == 200 and resp2.headers["X-Pod"] == bad.address


def test_pod_that_never_answers_gets_504_at_request_timeout(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(faults_config([pod], request_timeout="1s"))

    resp = request(act.listen, path="/hang")
    assert resp.status == 504
    assert activator_reason(resp) == "upstream-timeout"
    # The activator closed the pod connection (the pod's /hang waits for exactly that).
    wait_until(
        lambda: pod.stats()["in_flight"] == 0,
        message="the hung pod connection was closed",
    )
    st = act.wait_idle()
    assert failures(st, pod.address, "timeouts") == 1
    assert request(act.listen, path="/delay?ms=0").status == 200


def test_pod_answering_garbage_gets_502(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(faults_config([pod]))

    resp = request(act.listen, path="/garbage")
    assert resp.status == 502
    assert activator_reason(resp) == "upstream-bad-response"
    assert pod.stats()["count"] == 1  # sent once, not retried
    act.wait_idle()
    ok = request(act.listen, path="/delay?ms=0")
    assert ok.status == 200
    assert pod.stats()["count"] == 2


def test_pod_killed_under_load_fails_only_its_own_requests_and_comes_back(pod_factory, activator_factory):
    doomed, steady = pod_factory(2)
    act = activator_factory(faults_config([doomed, steady], container_concurrency=2, probe=probe_config()))
    act.wait_for(
        lambda st: all(p["state"] == "healthy" for p in svc(st)["pods"]),
        message="both healthy",
    )

    # Two requests on the doomed pod (first-available, cc 2): one mid-response, one
    # whose response has not started; one long stream on the steady pod.
    streaming = start_request(act.listen, path="/sse?n=100000&gap_ms=50")
    waiting = None
    other = None
    try:
        resp_streaming = streaming.getresponse()
        assert resp_streaming.getheader("X-Pod") == doomed.address
        read_event(resp_streaming)
        waiting = start_request(act.listen, path="/delay?ms=60000")
        wait_until(
            lambda: doomed.stats()["in_flight"] == 2,
            message="two requests on the doomed pod",
        )
        other = start_request(act.listen, path="/sse?n=30&gap_ms=50")
        resp_other = other.getresponse()
        assert resp_other.getheader("X-Pod") == steady.address
        read_event(resp_other)

        doomed.kill()

        with pytest.raises((http.client.IncompleteRead, ConnectionError, ValueError)):
            # the chunked stream is cut: http.client reports a short or broken chunk
            while resp_streaming.read(4096):
                pass
        resp_waiting = waiting.getresponse()
        assert resp_waiting.status == 502, resp_waiting.status
        assert activator_reason(resp_waiting) == "upstream-connect"
        resp_waiting.read()
        rest = resp_other.read()  # the steady pod's stream is untouched
        assert rest.count(b"\n\n") == 29
    finally:
        streaming.close()
        for conn in (waiting, other):
            if conn is not None:
                conn.close()

    # The dead pod is ejected (passive or by its probe); the steady one serves everyone.
    act.wait_pod_state(SERVICE, doomed.address, "pending")
    st = act.status()
    assert failures(st, doomed.address, "resets") >= 1
    assert failures(st, doomed.address, "connect_errors") >= 1
    for _ in range(4):
        r = request(act.listen, path="/delay?ms=0")
        assert r.status == 200 and r.headers["X-Pod"] == steady.address

    doomed.start()  # same port, fresh process
    act.wait_pod_state(SERVICE, doomed.address, "healthy")
    back = request(act.listen, path="/delay?ms=0")
    assert back.status == 200 and back.headers["X-Pod"] == doomed.address
    assert steady.stats()["peak"] <= 2 and doomed.stats()["peak"] <= 2
    act.wait_idle()


# --------------------------------------------------------------------------------------
# 4. resource limits


@pytest.fixture
def three_held(pod_factory, activator_factory) -> Iterator[tuple[Activator, Pod, list[Client]]]:
    """An activator with ``max_connections: 3`` and three kept-alive connections held."""
    (pod,) = pod_factory(1)
    act = activator_factory(faults_config([pod], top={"limits": {"max_connections": 3}}))
    held = [Client(act.listen) for _ in range(3)]
    try:
        for c in held:  # each connection has been accepted and counted
            assert c.request("GET", "/delay?ms=0").status == 200
        yield act, pod, held
    finally:
        for c in held:
            c.close()


def test_connections_over_max_connections_get_503_and_then_are_served_again(three_held):
    act, pod, held = three_held
    count = pod.stats()["count"]
    for _ in range(3):
        sock = send_raw(act.listen, b"")  # the answer comes before any request is read
        try:
            answer = read_all(sock)
        finally:
            sock.close()
        status, headers = parse_head(answer)
        assert status == 503, answer
        assert headers.get("x-activator-reason") == "too-many-connections"
    assert pod.stats()["count"] == count
    # The held connections are still served.
    assert held[0].request("GET", "/delay?ms=0").status == 200
    for c in held:
        c.close()

    def served() -> bool:
        return request(act.listen, path="/delay?ms=0").status == 200

    wait_until(served, message="new connections are served once the held ones closed")
    act.wait_idle()


def test_a_client_sending_at_once_over_max_connections_sees_the_503(three_held):
    act, pod, _ = three_held
    count = pod.stats()["count"]
    for _ in range(20):  # a client's usual way: connect, send, read
        answer = raw_exchange(act, b"GET /delay?ms=0 HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers = parse_head(answer)
        assert status == 503, answer
        assert headers.get("x-activator-reason") == "too-many-connections"
    assert pod.stats()["count"] == count


def test_idle_keep_alive_connection_is_closed_after_client_timeout(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(faults_config([pod], top={"limits": {"client_timeout": "1s"}}))

    sock = send_raw(act.listen, b"GET /delay?ms=0 HTTP/1.1\r\nHost: x\r\n\r\n", timeout=30)
    try:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, "closed before the response"
            data += chunk
        status, headers = parse_head(data)
        assert status == 200
        body_len = int(headers["content-length"])
        body = data.split(b"\r\n\r\n", 1)[1]
        while len(body) < body_len:
            body += sock.recv(65536)
        # Now idle on a kept-alive connection: the activator closes it (no wait here
        # beyond the socket's generous timeout; a timeout raises and fails the test).
        assert read_all(sock) == b""
    finally:
        sock.close()


def test_slowloris_gets_408_or_is_closed(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(faults_config([pod], top={"limits": {"client_timeout": "2s"}}))

    sock = send_raw(act.listen, b"GET /delay?ms=0 HTTP/1.1\r\nHost: x\r\n", timeout=30)
    sent_lines = 0
    answered = b""
    try:
        # One header line every 200 ms, for at most 30 s: each byte arrives well within
        # client_timeout, but the head as a whole never does.
        for sent_lines in range(150):
            readable = selectors.DefaultSelector()
            readable.register(sock, selectors.EVENT_READ)
            if readable.select(0.2):
                break
            try:
                sock.sendall(b"X-Slow-%d: v\r\n" % sent_lines)
            except OSError:
                break
        else:
            pytest.fail("the activator kept reading a slowloris head for 30 s")
        with contextlib.suppress(ConnectionResetError):
            answered = read_all(sock)
    finally:
        sock.close()
    if answered:
        status, headers = parse_head(answered)
        assert status == 408, answered
        assert headers.get("x-activator-reason") == "client-timeout"
    assert pod.stats()["count"] == 0
    assert request(act.listen, path="/delay?ms=0").status == 200


def test_hundreds_of_idle_and_slow_connections_do_not_starve_real_requests(pod_factory, activator_factory):
    pods = pod_factory(2)
    act = activator_factory(faults_config(pods, top={"limits": {"client_timeout": "2s"}}))
    host, port = act.listen.split(":")

    idle: list[socket.socket] = []
    try:
        for i in range(220):
            s = socket.create_connection((host, int(port)), timeout=30)
            if i % 10 == 0:  # every tenth one a slowloris with half a head
                s.sendall(b"GET /delay HTTP/1.1\r\nHost: x\r\nX-Partial: ")
            idle.append(s)
        results: list[Any] = []

        def one(i: int) -> None:
            results.append(request(act.listen, path="/delay?ms=20").status)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [200] * 10
        # And the idle ones are let go after client_timeout, without help from us.
        sel = selectors.DefaultSelector()
        for s in idle:
            sel.register(s, selectors.EVENT_READ)
        open_ = set(idle)
        deadline = time.monotonic() + 60
        while open_ and time.monotonic() < deadline:
            for key, _ in sel.select(1.0):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    data = s.recv(65536)
                except ConnectionResetError:
                    data = b""
                if data:
                    status, _ = parse_head(data)
                    assert status == 408, data
                    continue  # EOF follows
                sel.unregister(s)
                open_.discard(s)
        assert not open_, f"{len(open_)} idle connections still open after client_timeout"
    finally:
        for s in idle:
            s.close()
    assert sum(p.stats()["count"] for p in pods) == 10
    act.wait_idle()


def test_memory_stays_bounded_under_a_full_queue(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(faults_config([pod], queue_depth=50, queue_timeout="120s"))
    n_clients = 300

    statuses: list[tuple[int, str | None]] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        try:
            r = request(act.listen, path="/delay?ms=0", timeout=120)
            item = (r.status, activator_reason(r))
        except Exception as exc:
            item = (-1, repr(exc))
        with lock:
            statuses.append(item)

    rss_before = rss_kib(act.pid)
    # The hold: an endless stream holding the only slot until this test lets go.
    with stream(act.listen, path="/sse?n=1000000&gap_ms=100") as hold:
        read_event(hold)
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n_clients)]
        for t in threads:
            t.start()
        # The excess is answered while the slot is still held: at once, not after a wait.
        wait_until(
            lambda: len(statuses) >= n_clients - 50,
            timeout=60,
            message=lambda: f"{len(statuses)} answers so far",
        )
        st = act.wait_for(lambda st: svc(st)["queued"] == 50, message="the queue is full")
        rss_full = rss_kib(act.pid)
        with lock:
            early = list(statuses)
        assert len(early) == n_clients - 50, early[:5]
        assert all(s == (503, "queue-full") for s in early), sorted(set(early))
        assert svc(st)["in_flight"] == 1
        assert pod.stats()["count"] == 1  # only the hold reached the pod
    # (No peak check after this point: the slot is free as soon as the hold's client
    # is gone, possibly a moment before the pod notices its stream was closed.)
    for t in threads:
        t.join(120)
    late = statuses[len(early) :]
    assert late == [(200, None)] * 50, sorted(set(late))
    rss_after = rss_kib(act.pid)
    print(f"\nRSS KiB: before {rss_before}, queue full {rss_full}, after {rss_after}; {n_clients} clients, 50 queued")
    assert rss_full < 200 * 1024 and rss_after < 200 * 1024
    assert pod.stats()["count"] == 51
    act.wait_idle()


# --------------------------------------------------------------------------------------
# 5. no open proxy


def test_only_configured_hosts_are_reachable(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(faults_config([pod], hosts=["api.example.com"]))

    unknown = request(act.listen, path="/delay?ms=0", host="elsewhere.example.com")
    assert unknown.status == 404 and activator_reason(unknown) == "unknown-host"
    status, headers = parse_head(raw_exchange(act, b"GET /delay?ms=0 HTTP/1.0\r\n\r\n"))  # no Host
    assert status == 404 and headers.get("x-activator-reason") == "unknown-host"
    # The pod's own address as the Host is not a way in either.
    as_pod = request(act.listen, path="/delay?ms=0", host=pod.address)
    assert as_pod.status == 404 and activator_reason(as_pod) == "unknown-host"
    assert pod.stats()["count"] == 0


@pytest.mark.parametrize(
    "request_line",
    [
        b"GET http://{pod}/delay?ms=0 HTTP/1.1",
        b"GET http://api.example.com/delay?ms=0 HTTP/1.1",
        b"CONNECT {pod} HTTP/1.1",
        b"CONNECT api.example.com:80 HTTP/1.1",
        b"GET {pod} HTTP/1.1",
        b"GET * HTTP/1.1",
    ],
    ids=[
        "absolute-pod",
        "absolute-own-host",
        "connect-pod",
        "connect-own-host",
        "authority-form",
        "asterisk",
    ],
)
def test_absolute_form_and_connect_are_refused(pod_factory, activator_factory, request_line):
    (pod,) = pod_factory(1)
    act = activator_factory(faults_config([pod], hosts=["api.example.com"]))

    line = request_line.replace(b"{pod}", pod.address.encode())
    for host in (b"api.example.com", pod.address.encode()):
        answer = raw_exchange(act, line + b"\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n")
        status, headers = parse_head(answer)
        assert status == 400, answer
        assert headers.get("x-activator-reason") == "bad-request-target", answer
    assert pod.stats()["count"] == 0
    assert request(act.listen, path="/delay?ms=0", host="api.example.com").status == 200


def test_admin_api_is_not_served_on_the_proxy_port(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(faults_config([pod], hosts=["api.example.com"]))

    for path in ("/status", "/healthz", "/readyz", "/"):
        resp = request(act.listen, path=path, host="admin.example.com")
        assert resp.status == 404 and activator_reason(resp) == "unknown-host", path
        with pytest.raises(ValueError):
            json.loads(resp.body)
    # With the service's Host, /status is a path like any other: it goes to the pod.
    resp = request(act.listen, path="/status", host="api.example.com")
    assert resp.status == 200 and resp.headers["X-Pod"] == pod.address
    assert "services" not in resp.text
    assert "not on loopback" not in act.stderr_text()


def test_admin_api_off_loopback_is_warned_about(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    listen_port, admin_port = free_ports(2)
    config = faults_config([pod])
    config["listen"] = f"127.0.0.1:{listen_port}"
    config["admin"] = f"0.0.0.0:{admin_port}"
    # Not waited for through the admin API: this test connects to loopback only.
    act = activator_factory(config, wait_ready=False)

    def started() -> str | None:
        if not act.is_running():
            raise AssertionError(f"activator exited\n{act.output_tail()}")
        text = act.stderr_text()
        return text if "listening on" in text else None

    text = wait_until(started, message="activator listening")
    warning = [line for line in text.splitlines() if "not on loopback" in line]
    assert warning, text
    assert "WARNING" in warning[0] and f"0.0.0.0:{admin_port}" in warning[0]
    assert request(f"127.0.0.1:{listen_port}", path="/delay?ms=0").status == 200

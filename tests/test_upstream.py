"""The pod-side HTTP/1.1 client (``activator.pods.http1``) against real sockets on 127.0.0.1.

What is tested: pooling (LIFO, ``max_idle``, close), the reuse rules, the retry rule for
stale kept-alive connections, streaming both ways without buffering, uploads with
Content-Length and chunked (the same bytes and trailers arriving), early answers, 1xx,
trailers, repeated header lines, HEAD, the response framings (length, chunked, until
close, other codings refused), every way a pod can fail, the deadlines (``Timeouts``),
pods that keep Nagle's algorithm, and client bodies that fail or stall.

How: the pods are in-process gevent servers (``upstream_backend``): a pywsgi app for
well-behaved traffic and hand-written raw handlers for everything else; the requests a
raw pod gets are decoded by llhttp, so a test checks what really arrived. Request bodies
come from two test body sources: ``BufferedBody`` (all bytes in hand) and ``SocketBody``
(a socketpair the test writes: a real slow client). The session is not monkey-patched:
everything uses gevent sockets and primitives directly. No assertion is about time: a
timeout here only bounds a wait, so that a bug shows as a failure instead of a hang.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import gevent
import gevent.event
import gevent.select
import pytest
from gevent import socket as gsocket
from hypothesis import given, settings
from hypothesis import strategies as st
from upstream_backend import (
    Handler,
    RawBackend,
    RequestReader,
    WsgiBackend,
    answer_every_request,
    drain,
    listener,
    pattern,
    read_head,
    reset,
)

from activator.base.exchange import InterimCallback, PodRequest
from activator.core.errors import (
    ClientBodyError,
    ClientGone,
    ClientTimeout,
    UpstreamBadResponse,
    UpstreamBodyError,
    UpstreamBodyTimeout,
    UpstreamConnectError,
    UpstreamIdle,
    UpstreamTimeout,
)
from activator.core.failures import CONNECT_RETRIES, FailureKind, may_retry_elsewhere
from activator.core.heads import BodyFraming, Header
from activator.core.timeouts import Timeouts
from activator.pods.http1 import BLOCK_SIZE, MAX_POD_FIELD_BYTES, PodConnection, UpstreamPool

MiB = 1024 * 1024
#: Generous: no test here expects a connect or a response head to take long.
TIMEOUTS = Timeouts(connect=2.0, response_start=5.0)
#: Seconds a test waits for something that should happen at once (only to turn a hang into a failure).
BOUND = 5.0
#: Seconds after which a whole test counts as hung (each takes well under one).
TEST_BOUND = 20.0
#: An upload far larger than what loopback socket buffers hold, so a pod that stops
#: reading (or answers early) is seen while most of it is still unsent.
LARGE = bytes(32 * MiB)

OK_EMPTY = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


# -- request bodies ----------------------------------------------------------------------------


class BufferedBody:
    """A request body wholly in hand, as one that came in with its head.

    ``buffered()`` is always True, so the client never waits for it (``wait_for_body``
    fails loudly). Hands out at most ``step`` bytes a read and counts reads.
    After ``fail_after`` reads it raises ``ClientGone`` (the client left mid-body);
    ``known_error`` is what ``raise_known_error`` raises (broken framing already parsed).
    """

    def __init__(
        self,
        data: bytes,
        *,
        step: int = BLOCK_SIZE,
        fail_after: int | None = None,
        known_error: Exception | None = None,
        trailers: list[Header] | None = None,
    ) -> None:
        self._data = memoryview(data)
        self._offset = 0
        self.step = step
        self.reads = 0
        self.fail_after = fail_after
        self.known_error = known_error
        self.trailers: list[Header] = trailers or []

    def read(self, size: int = BLOCK_SIZE) -> bytes:
        self.reads += 1
        if self.fail_after is not None and self.reads > self.fail_after:
            raise ClientGone("the client went away mid-body")
        start = self._offset
        self._offset = min(len(self._data), start + min(size, self.step))
        return bytes(self._data[start : self._offset])

    def raise_known_error(self) -> None:
        if self.known_error is not None:
            raise self.known_error

    def buffered(self) -> bool:
        return True

    def wait_for_body(self, pod_fd: int, timeout: float) -> bool:
        raise AssertionError("a buffered body is never waited for")


class SocketBody:
    """A request body that a test sends as it goes, like a slow client.

    The client under test reads one end of a socketpair; the test writes ``client``, the
    other end, and closes it to end a chunked body. ``buffered()`` is False: every wait
    for the body is a wait on its socket (or the pod's), as with a real client.
    """

    def __init__(self) -> None:
        self.sock, self.client = gsocket.socketpair()
        self.sock.settimeout(BOUND * 2)  # only so that a broken test fails instead of hanging
        self.trailers: list[Header] = []

    def read(self, size: int = BLOCK_SIZE) -> bytes:
        piece: bytes = self.sock.recv(size)
        return piece

    def raise_known_error(self) -> None:
        pass

    def buffered(self) -> bool:
        return False

    def wait_for_body(self, pod_fd: int, timeout: float) -> bool:
        readable, _, _ = gevent.select.select([self.sock.fileno(), pod_fd], [], [], timeout)
        if not readable:
            raise ClientTimeout("the request body stalled")
        return pod_fd in readable

    def send_all_then_end(self, data: bytes) -> gevent.Greenlet:
        """Write ``data`` from a greenlet, then close the client end (EOF)."""

        def write() -> None:
            self.client.sendall(data)
            self.client.close()

        return gevent.spawn(write)

    def close(self) -> None:
        self.sock.close()
        self.client.close()


RequestBody = BufferedBody | SocketBody
#: The ``raw`` fixture: ``raw(handler, **RawBackend options) -> (pod, pool to it)``.
RawFactory = Callable[..., tuple[RawBackend, UpstreamPool]]
Interim = tuple[int, bytes, list[Header]]


# -- fixtures and helpers --------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def hang_is_failure() -> Iterator[None]:
    """A client that waits forever (no deadline of its own fires) fails the test instead of hanging it."""
    with gevent.Timeout(TEST_BOUND, AssertionError(f"the test was still waiting after {TEST_BOUND}s")):
        yield


@pytest.fixture
def backend() -> Iterator[WsgiBackend]:
    server = WsgiBackend()
    yield server
    server.close()


@pytest.fixture
def pool(backend: WsgiBackend) -> Iterator[UpstreamPool]:
    upstream = UpstreamPool("127.0.0.1", backend.port)
    yield upstream
    upstream.close()


@pytest.fixture
def raw() -> Iterator[RawFactory]:
    """Raw pods, each with a pool to it; all closed at teardown."""
    started: list[tuple[RawBackend, UpstreamPool]] = []

    def start(handler: Handler | None, **options: bool) -> tuple[RawBackend, UpstreamPool]:
        pod = RawBackend(handler, **options)
        started.append((pod, UpstreamPool("127.0.0.1", pod.port)))
        return started[-1]

    yield start
    for pod, upstream in started:
        upstream.close()
        pod.close()


@pytest.fixture
def socket_body() -> Iterator[SocketBody]:
    body = SocketBody()
    yield body
    body.close()


def host_line(port: int) -> list[Header]:
    return [(b"Host", b"127.0.0.1:%d" % port)]


def send(
    pool: UpstreamPool,
    method: str = "GET",
    target: bytes = b"/",
    body: RequestBody | None = None,
    *,
    length: int | None = None,
    timeouts: Timeouts = TIMEOUTS,
    interim: InterimCallback | None = None,
    headers: list[Header] | None = None,
) -> PodConnection:
    """One request: no body, a body with Content-Length (``length`` given) or chunked."""
    framing = BodyFraming.NONE if body is None else BodyFraming.CHUNKED if length is None else BodyFraming.LENGTH
    if headers is None:
        headers = host_line(pool.port)
    return pool.request(PodRequest(method, target, headers, body, framing, length, interim), timeouts)


def read_to_end(response: PodConnection) -> bytes:
    """The whole response body; the connection is closed (or pooled) after it."""
    try:
        return b"".join(response.body())
    finally:
        response.close()


def fetch(*args: Any, **kwargs: Any) -> tuple[PodConnection, bytes]:
    """``send(*args, **kwargs)``, and the whole answer read."""
    response = send(*args, **kwargs)
    return response, read_to_end(response)


def recorded() -> tuple[list[Interim], InterimCallback]:
    """An interim callback and the list of the 1xx answers it gets."""
    calls: list[Interim] = []
    return calls, lambda status, reason, headers: calls.append((status, reason, headers))


def send_in_pieces(conn: gsocket.socket, data: bytes, cuts: Iterable[int]) -> None:
    """Send ``data`` cut at ``cuts``, each piece in its own write, pausing between them so
    that the client gets them in separate reads (pacing only: nothing depends on it)."""
    start = 0
    for end in [*sorted(set(cuts)), len(data)]:
        conn.sendall(data[start:end])
        start = end
        gevent.sleep(0.001)


def counting_pod(
    after_head: Callable[[gsocket.socket], None] | None = None,
) -> tuple[Handler, gevent.event.AsyncResult]:
    """A handler that reads whatever comes (after ``after_head(conn)`` once a request head
    arrived, if given) until the client closes, and reports how many bytes it got."""
    received = gevent.event.AsyncResult()

    def handler(conn: gsocket.socket, index: int) -> None:
        reader = RequestReader(conn)
        if after_head is not None and reader.read_until(lambda request: request.head_done):
            after_head(conn)
        received.set(reader.received + drain(conn))

    return handler, received


def bytes_until_closed(received: gevent.event.AsyncResult) -> int:
    """What a ``counting_pod`` got, once the client closed the connection (a failure if it does not)."""
    try:
        count: int = received.get(timeout=BOUND)
    except gevent.Timeout:
        pytest.fail("the pod connection was left open")
    return count


def may_go_elsewhere(error: UpstreamConnectError) -> bool:
    """Whether the proxy's retry rule sends this failed request to another pod."""
    return may_retry_elsewhere(error.kind, error.connected, error.body_read, CONNECT_RETRIES, stopping=False)


# -- keep-alive and pooling ----------------------------------------------------------------------


def test_keep_alive_reuses_one_connection(backend: WsgiBackend, pool: UpstreamPool) -> None:
    for _ in range(5):
        response, data = fetch(pool, target=b"/bytes/100")
        assert (response.head.status, response.head.reason) == (200, b"OK")
        assert (response.framing, response.head.content_length) == (BodyFraming.LENGTH, 100)
        assert data == pattern(100)
        assert (b"X-Kind", b"bytes") in response.head.headers
    assert backend.connections == 1
    assert pool.idle_count == 1


def test_idle_connections_are_reused_last_in_first_out(backend: WsgiBackend, pool: UpstreamPool) -> None:
    first = send(pool, target=b"/bytes/10")
    second = send(pool, target=b"/bytes/10")  # the first is busy: a second connection
    assert backend.connections == 2
    read_to_end(second)
    read_to_end(first)  # given back last
    assert pool.idle_count == 2
    fetch(pool, target=b"/bytes/10")
    assert backend.ports[2] == backend.ports[0], "the most recently given back connection is reused first"


def test_max_idle_and_close(backend: WsgiBackend) -> None:
    pool = UpstreamPool("127.0.0.1", backend.port, max_idle=2)
    for ack in backend.acks:
        ack.set()
    # Three concurrent exchanges need three connections; only two stay idle afterwards.
    exchanges = [gevent.spawn(fetch, pool, target=b"/slow") for _ in range(3)]
    gevent.joinall(exchanges, raise_error=True)
    assert [exchange.value[1] for exchange in exchanges] == [b"".join(backend.slow_chunks)] * 3
    assert backend.connections == 3
    assert pool.idle_count == 2
    pool.close()
    assert pool.idle_count == 0
    _, data = fetch(pool, target=b"/bytes/3")  # still works after close, just not pooled
    assert data == pattern(3)
    assert pool.idle_count == 0


# -- reuse rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, reusable",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", True),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", True),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok", True),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 404 NF\r\nContent-Length: 1\r\n\r\nx", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok and then some garbage", False),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\ngarbage", False),
    ],
    ids=[
        "length",
        "chunked",
        "1.0-keep-alive",
        "1.0",
        "close",
        "extra-response",
        "trailing-garbage",
        "chunked-trailing-garbage",
    ],
)
@pytest.mark.parametrize("writes", ["one-write", "head-then-body"])
def test_reuse_rules(raw: RawFactory, response: bytes, reusable: bool, writes: str) -> None:
    """A complete answer is the answer whatever follows it; what follows decides only the reuse.
    ``head-then-body``: the body and what follows come after the head, in the body's reads."""
    cuts = [] if writes == "one-write" else [response.index(b"\r\n\r\n") + 4]

    def handler(conn: gsocket.socket, index: int) -> None:
        for _ in RequestReader(conn).requests():
            send_in_pieces(conn, response, cuts)

    pod, pool = raw(handler)
    try:
        answer, data = fetch(pool)
    except UpstreamBadResponse as error:
        pytest.fail(f"a complete answer was refused for the bytes after it: {error}")
    assert (answer.head.status, answer.head.reason) == (200, b"OK")
    assert (data, list(answer.trailers)) == (b"ok", []), "what follows this response is no part of it"
    assert pool.idle_count == (1 if reusable else 0)
    fetch(pool)
    assert pod.accepted == (1 if reusable else 2)


def test_unread_body_then_close_is_not_reused(backend: WsgiBackend, pool: UpstreamPool) -> None:
    response = send(pool, target=b"/bytes/%d" % (4 * MiB))
    next(response.body())
    response.close()
    assert pool.idle_count == 0
    _, data = fetch(pool, target=b"/bytes/10")
    assert data == pattern(10)
    assert backend.connections == 2


def test_close_without_reading_a_bodyless_response_keeps_the_connection(
    backend: WsgiBackend, pool: UpstreamPool
) -> None:
    send(pool, target=b"/status/204").close()
    fetch(pool, target=b"/status/204")
    assert backend.connections == 1


def test_head_204_304_have_no_body_and_reuse(backend: WsgiBackend, pool: UpstreamPool) -> None:
    response, data = fetch(pool, "HEAD", b"/bytes/5000")
    assert (response.head.status, data, response.head.content_length) == (200, b"", 5000)
    for status in (204, 304):
        response, data = fetch(pool, target=b"/status/%d" % status)
        assert (response.head.status, data) == (status, b"")
    _, data = fetch(pool, target=b"/bytes/10")
    assert data == pattern(10)
    assert backend.connections == 1


def test_abort_closes_the_pod_connection_whatever_was_read(raw: RawFactory) -> None:
    handler, received = counting_pod(lambda conn: conn.sendall(OK_EMPTY))
    _, pool = raw(handler)
    response = send(pool)
    assert response.complete
    response.abort()
    response.close()  # a no-op now
    bytes_until_closed(received)
    assert pool.idle_count == 0


# -- HEAD ----------------------------------------------------------------------------------------------


HEAD_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"
GET_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc"


def test_head_answer_completes_at_once_and_the_connection_serves_the_next_request(raw: RawFactory) -> None:
    pod, pool = raw(answer_every_request(HEAD_ANSWER, GET_ANSWER))
    response = send(pool, "HEAD")
    assert response.complete, "a HEAD answer has no body to wait for"
    assert (response.head.status, response.head.content_length, response.framing) == (200, 100, BodyFraming.NONE)
    assert read_to_end(response) == b""
    assert pool.idle_count == 1
    answer, data = fetch(pool)
    assert (answer.head.status, answer.head.content_length, data) == (200, 3, b"abc")
    assert pod.accepted == 1


@pytest.mark.parametrize("when", ["same-write", "later-write"])
@pytest.mark.parametrize("method", ["HEAD", "GET"])
def test_bytes_after_the_answer_make_the_connection_not_reusable(raw: RawFactory, method: str, when: str) -> None:
    """A pod that sends more than its answer (a body after a HEAD head, bytes after a
    complete body): the connection is not reused, and the next request gets its own answer."""
    answer = HEAD_ANSWER if method == "HEAD" else b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    stray = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray"  # bytes that even look like an answer
    answer_read = gevent.event.Event()
    stray_sent = gevent.event.Event()

    def handler(conn: gsocket.socket, index: int) -> None:
        requests = RequestReader(conn).requests()
        if next(requests, None) is None:
            return
        if index == 0 and when == "same-write":
            conn.sendall(answer + stray)
        elif index == 0:
            conn.sendall(answer)
            answer_read.wait(BOUND)
            conn.sendall(stray)
            stray_sent.set()
        else:
            conn.sendall(GET_ANSWER)
        for _ in requests:
            conn.sendall(GET_ANSWER)

    pod, pool = raw(handler)
    read_to_end(send(pool, method))
    answer_read.set()
    if when == "later-write":
        assert stray_sent.wait(BOUND)
    try:
        _, data = fetch(pool)
    except UpstreamBadResponse as error:
        pytest.fail(f"the stray bytes of the last answer were read as the next one: {error}")
    assert data == b"abc", "the next request gets its own answer, not the stray bytes"
    assert pod.accepted == 2


# -- the response head: fidelity, 1xx, trailers, framing -----------------------------------------------------


def test_repeated_header_lines_stay_separate_and_in_order(raw: RawFactory) -> None:
    lines = [
        (b"Set-Cookie", b"a=1"),
        (b"Link", b"</a.css>; rel=preload"),
        (b"X-Empty", b""),
        (b"Set-Cookie", b"b=2"),
        (b"Connection", b"keep-alive"),
        (b"link", b"</b.js>; rel=preload"),
        (b"Content-Length", b"2"),
    ]
    head = b"HTTP/1.1 200 All Good\r\n" + b"".join(b"%s: %s\r\n" % line for line in lines) + b"\r\n"
    _, pool = raw(answer_every_request(head + b"ok"))
    response, data = fetch(pool)
    assert (response.head.status, response.head.reason, data) == (200, b"All Good", b"ok")
    assert response.head.headers == lines
    assert response.head.lower_names == [name.lower() for name, _ in lines]
    assert response.head.connection_values == [b"keep-alive"]
    assert response.head.content_length == 2


def test_head_trickled_in_small_pieces(raw: RawFactory) -> None:
    answer = (
        b"HTTP/1.1 200 Fine Thanks\r\nX-Long-Header-Name: a fairly long value, with commas\r\n"
        b"Content-Length: 5\r\n\r\nhello"
    )

    def handler(conn: gsocket.socket, index: int) -> None:
        for _ in RequestReader(conn).requests():
            send_in_pieces(conn, answer, range(3, len(answer), 3))

    pod, pool = raw(handler)
    for _ in range(2):
        response, data = fetch(pool)
        assert response.head.reason == b"Fine Thanks"
        assert response.head.headers[0] == (b"X-Long-Header-Name", b"a fairly long value, with commas")
        assert (response.head.content_length, data) == (5, b"hello")
    assert pod.accepted == 1


EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\nLink: </b.js>; rel=preload\r\n\r\n"
EARLY_HINTS_SEEN = (103, b"Early Hints", [(b"Link", b"</a.css>; rel=preload"), (b"Link", b"</b.js>; rel=preload")])
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@pytest.mark.parametrize("method", ["POST", "HEAD"])
@pytest.mark.parametrize(
    "interims, seen",
    [
        ([EARLY_HINTS], [EARLY_HINTS_SEEN]),
        ([CONTINUE, EARLY_HINTS, b"HTTP/1.1 102 Processing\r\n\r\n"], [EARLY_HINTS_SEEN, (102, b"Processing", [])]),
        ([CONTINUE], []),
    ],
    ids=["103", "100-103-102", "100-only"],
)
@pytest.mark.parametrize("writes", ["one-write", "one-write-each"])
def test_interim_answers_reach_the_callback_in_order_and_100_is_dropped(
    raw: RawFactory,
    method: str,
    interims: list[bytes],
    seen: list[Interim],
    writes: str,
) -> None:
    final = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Final: yes\r\n\r\n" + (b"" if method == "HEAD" else b"ok")
    answer = b"".join(interims) + final
    cuts = [] if writes == "one-write" else [sum(map(len, interims[: i + 1])) for i in range(len(interims))]

    def handler(conn: gsocket.socket, index: int) -> None:
        for _ in RequestReader(conn).requests():
            send_in_pieces(conn, answer, cuts)

    pod, pool = raw(handler)
    calls, interim = recorded()
    body = BufferedBody(b"abc") if method == "POST" else None
    response, data = fetch(pool, method, b"/", body, length=None if body is None else 3, interim=interim)
    assert calls == seen
    assert (response.head.status, response.head.reason) == (200, b"OK")
    assert response.head.headers == [(b"Content-Length", b"2"), (b"X-Final", b"yes")], (
        "no interim line in the final head"
    )
    assert data == (b"" if method == "HEAD" else b"ok")
    assert pool.idle_count == 1
    fetch(pool, method)
    assert pod.accepted == 1


def test_an_interim_answer_during_the_upload_loses_no_body_bytes(raw: RawFactory) -> None:
    """A pod that says 102 Processing as soon as it has the head, then reads the body."""
    upload = pattern(8 * MiB + 5)
    got = gevent.event.AsyncResult()

    def handler(conn: gsocket.socket, index: int) -> None:
        reader = RequestReader(conn)
        reader.read_until(lambda request: request.head_done)
        conn.sendall(b"HTTP/1.1 102 Processing\r\n\r\n")
        whole = reader.read_until(lambda request: request.complete)
        got.set(bytes(reader.current.body))
        if whole:
            conn.sendall(OK_EMPTY)

    _, pool = raw(handler)
    calls, interim = recorded()
    quick = Timeouts(connect=2.0, response_start=2.0)
    try:
        response, _ = fetch(
            pool, "PUT", b"/", BufferedBody(upload), length=len(upload), timeouts=quick, interim=interim
        )
    except UpstreamTimeout:  # the pod still waits for the rest of its body
        arrived = got.get(timeout=BOUND)
        pytest.fail(f"the pod got {len(arrived)} of the {len(upload)} body bytes: bytes were lost after its 102")
    assert got.get(timeout=BOUND) == upload
    assert response.head.status == 200
    assert calls == [(102, b"Processing", [])]


@pytest.mark.parametrize("writes", ["one-write", "trailers-later"])
def test_trailers_of_a_chunked_response_are_kept_after_the_body(raw: RawFactory, writes: str) -> None:
    head_and_body = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n4\r\nwiki\r\n5\r\npedia\r\n"
    )
    end = b"0\r\nX-Checksum: abc\r\nX-Second: 2\r\n\r\n"
    cuts = [] if writes == "one-write" else [len(head_and_body)]

    def handler(conn: gsocket.socket, index: int) -> None:
        for _ in RequestReader(conn).requests():
            send_in_pieces(conn, head_and_body + end, cuts)

    _, pool = raw(handler)
    response, data = fetch(pool)
    assert (response.framing, data) == (BodyFraming.CHUNKED, b"wikipedia")
    assert response.trailers == [(b"X-Checksum", b"abc"), (b"X-Second", b"2")]
    assert response.head.headers == [(b"Transfer-Encoding", b"chunked"), (b"Trailer", b"X-Checksum")]
    assert pool.idle_count == 1


@pytest.mark.parametrize("coding", [b"gzip", b"chunked, gzip"])
def test_transfer_coding_other_than_chunked_is_a_bad_response(raw: RawFactory, coding: bytes) -> None:
    _, pool = raw(answer_every_request(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: %s\r\n\r\nabc" % coding))
    with pytest.raises(UpstreamBadResponse):
        send(pool)
    assert pool.idle_count == 0


def test_gzip_then_chunked_is_chunked(raw: RawFactory) -> None:
    _, pool = raw(
        answer_every_request(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
    )
    response, data = fetch(pool)
    assert (response.framing, data) == (BodyFraming.CHUNKED, b"abc")


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])
def test_response_delimited_by_close_streams_until_eof_and_is_not_pooled(raw: RawFactory, version: bytes) -> None:
    first_piece_read = gevent.event.Event()

    def handler(conn: gsocket.socket, index: int) -> None:
        read_head(conn)
        conn.sendall(b"HTTP/%s 200 OK\r\nX-A: 1\r\n\r\nfirst piece" % version)
        first_piece_read.wait(BOUND)
        conn.sendall(b"second piece")

    pod, pool = raw(handler)
    for _ in range(2):
        first_piece_read.clear()
        response = send(pool)
        assert (response.head.status, response.framing, response.head.content_length) == (200, BodyFraming.CLOSE, None)
        pieces = []
        for piece in response.body():
            pieces.append(piece)
            first_piece_read.set()
        response.close()
        assert pieces == [b"first piece", b"second piece"], "each piece as the pod sent it, none held back"
        assert pool.idle_count == 0
    assert pod.accepted == 2


def test_a_101_hands_over_the_socket_with_the_bytes_after_its_head(raw: RawFactory) -> None:
    def handler(conn: gsocket.socket, index: int) -> None:
        read_head(conn)
        conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\nhello")
        while data := conn.recv(65536):
            conn.sendall(data.upper())

    _, pool = raw(handler)
    response = send(pool, headers=[*host_line(pool.port), (b"Upgrade", b"echo"), (b"Connection", b"Upgrade")])
    assert (response.head.status, response.upgraded, response.tunnel_data) == (101, True, b"hello")
    tunnel = response.detach()
    try:
        tunnel.sendall(b"spliced")
        assert tunnel.recv(100) == b"SPLICED"
    finally:
        tunnel.close()
    assert pool.idle_count == 0


SPLIT_HEAD_START = EARLY_HINTS + b"HTTP/1.1 200 All Good\r\nServer: x\r\nX-Empty:\r\nSet-Cookie: a=1\r\n"
RESPONSE_TO_SPLIT = {
    "GET": SPLIT_HEAD_START + b"Transfer-Encoding: chunked\r\nSet-Cookie: b=2\r\n\r\n"
    b"4\r\nwiki\r\n5\r\npedia\r\n0\r\nX-Trailer: t\r\n\r\n",
    "HEAD": SPLIT_HEAD_START + b"Content-Length: 100\r\n\r\n",
}


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_a_response_cut_anywhere_reads_the_same(raw: RawFactory, method: str) -> None:
    """The response (a 103, then the final head, body and trailers) cut at random points,
    each piece in its own write, on one kept-alive connection."""
    whole = RESPONSE_TO_SPLIT[method]
    cuts_now: list[int] = []

    def handler(conn: gsocket.socket, index: int) -> None:
        for _ in RequestReader(conn).requests():
            send_in_pieces(conn, whole, cuts_now)

    pod, pool = raw(handler)

    @settings(max_examples=25, deadline=None)
    @given(st.lists(st.integers(min_value=1, max_value=len(whole) - 1), max_size=12))
    def check(cuts: list[int]) -> None:
        cuts_now[:] = cuts
        calls, interim = recorded()
        response, data = fetch(pool, method, interim=interim)
        assert calls == [EARLY_HINTS_SEEN]
        assert (response.head.status, response.head.reason) == (200, b"All Good")
        assert response.head.headers[:3] == [(b"Server", b"x"), (b"X-Empty", b""), (b"Set-Cookie", b"a=1")]
        if method == "GET":
            assert response.head.headers[3:] == [(b"Transfer-Encoding", b"chunked"), (b"Set-Cookie", b"b=2")]
            assert (data, response.trailers) == (b"wikipedia", [(b"X-Trailer", b"t")])
        else:
            assert (data, response.head.content_length) == (b"", 100)
        assert pool.idle_count == 1

    check()
    assert pod.accepted == 1


# -- streaming -------------------------------------------------------------------------------------


def test_download_4mib_is_streamed_in_pieces(backend: WsgiBackend, pool: UpstreamPool) -> None:
    size = 4 * MiB + 3
    response = send(pool, target=b"/bytes/%d" % size)
    assert response.head.content_length == size
    digest = hashlib.sha256()
    pieces = 0
    for piece in response.body():
        assert len(piece) <= BLOCK_SIZE
        digest.update(piece)
        pieces += 1
    response.close()
    assert digest.hexdigest() == hashlib.sha256(pattern(size)).hexdigest()
    assert pieces > 1
    assert pool.idle_count == 1  # fully read: back in the pool


def test_slow_chunked_response_is_streamed_chunk_by_chunk(backend: WsgiBackend, pool: UpstreamPool) -> None:
    response = send(pool, target=b"/slow")
    assert (response.framing, response.head.content_length) == (BodyFraming.CHUNKED, None)
    got = []
    for piece in response.body():
        got.append(piece)
        backend.log.append(("got", len(got) - 1))
        backend.acks[len(got) - 1].set()
    response.close()
    assert got == backend.slow_chunks  # one piece per chunk, nothing merged or held back
    # The first chunk reached us before the backend sent the last one.
    assert backend.log.index(("got", 0)) < backend.log.index(("sent", 4))
    assert pool.idle_count == 1


@pytest.mark.parametrize("source", ["buffered", "socket"])
@pytest.mark.parametrize("framing", [BodyFraming.LENGTH, BodyFraming.CHUNKED])
def test_upload_arrives_whole(
    backend: WsgiBackend, pool: UpstreamPool, socket_body: SocketBody, framing: BodyFraming, source: str
) -> None:
    upload = pattern(3 * MiB + 12345)
    body: RequestBody
    if source == "buffered":
        body = BufferedBody(upload, step=70_000)
    else:
        body = socket_body
        socket_body.send_all_then_end(upload)
    length = len(upload) if framing is BodyFraming.LENGTH else None
    _, answer = fetch(pool, "PUT", b"/echo", body, length=length)
    info = json.loads(answer)
    assert info["sha256"] == hashlib.sha256(upload).hexdigest()
    assert info["length"] == len(upload)
    assert info["method"] == "PUT"
    assert info["host"] == f"127.0.0.1:{backend.port}"
    if framing is BodyFraming.LENGTH:
        assert (info["content_length"], info["transfer_encoding"]) == (str(len(upload)), None)
    else:
        assert info["transfer_encoding"] == "chunked"


@pytest.mark.parametrize("framing", [BodyFraming.LENGTH, BodyFraming.CHUNKED])
def test_upload_is_streamed_as_the_client_sends_it(
    raw: RawFactory, socket_body: SocketBody, framing: BodyFraming
) -> None:
    first, second = b"a" * 1000, b"b" * 2000
    first_arrived = gevent.event.Event()
    got = gevent.event.AsyncResult()

    def handler(conn: gsocket.socket, index: int) -> None:
        reader = RequestReader(conn)
        reader.read_until(lambda request: len(request.body) >= len(first))
        first_arrived.set()
        reader.read_until(lambda request: request.complete)
        got.set(bytes(reader.current.body))
        conn.sendall(OK_EMPTY)

    _, pool = raw(handler)
    length = len(first) + len(second) if framing is BodyFraming.LENGTH else None
    exchange = gevent.spawn(fetch, pool, "POST", b"/", socket_body, length=length)
    socket_body.client.sendall(first)
    assert first_arrived.wait(BOUND), "the pod got the first piece while the client still held the rest"
    socket_body.send_all_then_end(second).join(BOUND)
    response, _ = exchange.get(timeout=BOUND)
    assert got.get(timeout=BOUND) == first + second
    assert response.head.status == 200


def test_empty_bodies(backend: WsgiBackend, pool: UpstreamPool) -> None:
    _, answer = fetch(pool, "POST", b"/echo", BufferedBody(b""), length=0)
    assert json.loads(answer)["content_length"] == "0"
    _, answer = fetch(pool, "POST", b"/echo", BufferedBody(b""))  # chunked, no chunk but the last
    info = json.loads(answer)
    assert (info["length"], info["transfer_encoding"]) == (0, "chunked")
    assert backend.connections == 1


@pytest.mark.parametrize(
    "framing, framing_line, trailers",
    [
        (BodyFraming.LENGTH, (b"Content-Length", b"7"), []),
        (BodyFraming.CHUNKED, (b"Transfer-Encoding", b"chunked"), []),
        (BodyFraming.CHUNKED, (b"Transfer-Encoding", b"chunked"), [(b"X-Sum", b"1"), (b"X-Sum", b"2")]),
    ],
    ids=["length", "chunked", "chunked-trailers"],
)
def test_request_goes_out_as_given_plus_its_framing_line(
    raw: RawFactory,
    framing: BodyFraming,
    framing_line: Header,
    trailers: list[Header],
) -> None:
    requests = []

    def handler(conn: gsocket.socket, index: int) -> None:
        for request in RequestReader(conn).requests():
            requests.append(request)
            conn.sendall(OK_EMPTY)

    _, pool = raw(handler)
    block = [(b"Host", b"pod.example"), (b"X-A", b"1"), (b"x-a", b"2")]
    length = 7 if framing is BodyFraming.LENGTH else None
    body = BufferedBody(b"payload", step=3, trailers=trailers)
    fetch(pool, "PATCH", b"/a/b?c=d", body, length=length, headers=block)
    [request] = requests
    assert (request.method, request.target) == (b"PATCH", b"/a/b?c=d")
    assert request.headers == [(b"Host", b"pod.example"), (b"X-A", b"1"), (b"x-a", b"2"), framing_line]
    assert (bytes(request.body), request.trailers) == (b"payload", trailers)


# -- early answers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("framing", [BodyFraming.LENGTH, BodyFraming.CHUNKED])
@pytest.mark.parametrize("then", ["closes", "discards"])
def test_an_early_answer_stops_the_upload(raw: RawFactory, then: str, framing: BodyFraming) -> None:
    """The pod answers 413 right after the head of a large upload, then closes (or keeps
    reading and discarding, the connection kept alive): the 413 is the answer."""
    close_line = b"Connection: close\r\n" if then == "closes" else b""
    answer = b"HTTP/1.1 413 Payload Too Large\r\n%sContent-Length: 9\r\n\r\ntoo large" % close_line
    received = gevent.event.AsyncResult()

    def handler(conn: gsocket.socket, index: int) -> None:
        reader = RequestReader(conn)
        reader.read_until(lambda request: request.head_done)
        conn.sendall(answer)
        received.set(reader.received + (drain(conn) if then == "discards" else 0))

    pod, pool = raw(handler)
    length = len(LARGE) if framing is BodyFraming.LENGTH else None
    response = send(pool, "POST", b"/", BufferedBody(LARGE), length=length)
    assert (response.head.status, response.early) == (413, True)
    assert read_to_end(response) == b"too large"
    assert pool.idle_count == 0, "a request not sent whole leaves its connection out of the pool"
    assert bytes_until_closed(received) < len(LARGE), "the rest of the body was not sent"
    fetch(pool)
    assert pod.accepted == 2


# -- a pod that fails ---------------------------------------------------------------------------------


def test_connection_refused_may_go_to_another_pod() -> None:
    sock = listener()
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    body = BufferedBody(b"abc")
    with pytest.raises(UpstreamConnectError) as caught:
        send(UpstreamPool("127.0.0.1", port), "POST", b"/", body, length=3)
    assert (caught.value.kind, caught.value.status) == (FailureKind.CONNECT, 502)
    assert (caught.value.connected, caught.value.body_read) == (False, False)
    assert body.reads == 0
    assert may_go_elsewhere(caught.value)


def test_no_response_head_within_response_start_is_a_timeout(raw: RawFactory) -> None:
    handler, _ = counting_pod()  # reads, never answers
    _, pool = raw(handler)
    with pytest.raises(UpstreamTimeout) as caught:
        send(pool, timeouts=Timeouts(connect=2.0, response_start=0.3))
    assert caught.value.status == 504
    assert pool.idle_count == 0


def test_connect_timeout_is_a_connect_error_that_may_go_elsewhere() -> None:
    sock = listener(backlog=0)  # never accepts
    port = sock.getsockname()[1]
    queued = gsocket.create_connection(("127.0.0.1", port), timeout=BOUND)  # the queue is full now
    try:
        with pytest.raises(UpstreamConnectError) as caught:
            send(UpstreamPool("127.0.0.1", port), timeouts=Timeouts(connect=0.3, response_start=5.0))
        assert (caught.value.connected, caught.value.body_read) == (False, False)
        assert may_go_elsewhere(caught.value)
    finally:
        queued.close()
        sock.close()


def test_never_accepted_is_a_timeout_too(raw: RawFactory) -> None:
    _, pool = raw(None, accept=False)  # the kernel completes the handshake from the backlog
    with pytest.raises(UpstreamTimeout):
        send(pool, timeouts=Timeouts(connect=2.0, response_start=0.3))


def test_pod_that_does_not_read_the_upload_times_out(raw: RawFactory) -> None:
    stop = gevent.event.Event()
    _, pool = raw(lambda conn, index: stop.wait(BOUND * 2))  # accepts, never reads
    try:
        with pytest.raises(UpstreamTimeout):
            send(pool, "PUT", b"/", BufferedBody(LARGE), length=len(LARGE), timeouts=Timeouts(2.0, 0.3))
    finally:
        stop.set()


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_a_response_head_that_never_ends_is_a_bad_response_at_once(raw: RawFactory, method: str) -> None:
    """Past MAX_POD_FIELD_BYTES of head (llhttp holds an unfinished line; a HEAD answer's
    head is buffered whole) the answer is refused, not read on until the head deadline."""
    endless = b"HTTP/1.1 200 OK\r\nX-Endless: " + b"v" * (MAX_POD_FIELD_BYTES + BLOCK_SIZE)
    _, pool = raw(answer_every_request(endless))
    with pytest.raises(UpstreamBadResponse, match="response head over"):
        send(pool, method)


def test_garbage_response_is_a_bad_response(raw: RawFactory) -> None:
    _, pool = raw(answer_every_request(b"SSH-2.0-OpenSSH_9.2\r\n\r\n"))
    with pytest.raises(UpstreamBadResponse) as caught:
        send(pool)
    assert isinstance(caught.value, UpstreamConnectError)
    assert (caught.value.status, caught.value.reason) == (502, "upstream-bad-response")
    assert not may_go_elsewhere(caught.value)


@pytest.mark.parametrize("sent", [b"", b"HTTP/1.1 200 OK\r\nContent-Le"], ids=["nothing", "half-a-head"])
@pytest.mark.parametrize("how", ["fin", "reset"])
def test_a_pod_gone_before_a_whole_head_is_a_connect_error_not_sent_elsewhere(
    raw: RawFactory, sent: bytes, how: str
) -> None:
    def handler(conn: gsocket.socket, index: int) -> None:
        read_head(conn)
        conn.sendall(sent)
        if how == "reset":
            reset(conn)

    _, pool = raw(handler)
    with pytest.raises(UpstreamConnectError) as caught:
        send(pool)
    assert type(caught.value) is UpstreamConnectError
    assert caught.value.connected
    assert not may_go_elsewhere(caught.value)  # the request had been sent


@pytest.mark.parametrize("how", ["reset", "fin"])
@pytest.mark.parametrize(
    "head, rest",
    [
        (b"Content-Length: 1000000\r\n\r\n" + b"x" * 1000, b""),
        (b"Transfer-Encoding: chunked\r\n\r\n3e8\r\n" + b"x" * 1000 + b"\r\n", b""),
        (b"Transfer-Encoding: chunked\r\n\r\n3e8\r\n" + b"x" * 1000 + b"\r\n", b"zz\r\nnot hex\r\n"),
    ],
    ids=["length", "chunked", "bad-chunk"],
)
def test_a_broken_body_is_a_body_error(raw: RawFactory, head: bytes, rest: bytes, how: str) -> None:
    first_piece_read = gevent.event.Event()

    def handler(conn: gsocket.socket, index: int) -> None:
        read_head(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\n" + head)
        first_piece_read.wait(BOUND)
        conn.sendall(rest)
        if how == "reset":
            reset(conn)

    _, pool = raw(handler)
    response = send(pool)
    pieces = response.body()
    assert next(pieces) == b"x" * 1000
    first_piece_read.set()
    with pytest.raises(UpstreamBodyError) as caught:
        next(pieces)
    assert (type(caught.value), caught.value.kind) == (UpstreamBodyError, FailureKind.RESET)
    response.close()
    assert pool.idle_count == 0


# -- the deadlines of a response body ---------------------------------------------------------------


@pytest.mark.parametrize(
    "head",
    [b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", b"Content-Length: 100\r\n\r\nhello"],
    ids=["chunked", "length"],
)
def test_a_pod_silent_mid_body_is_idle(raw: RawFactory, head: bytes) -> None:
    handler, _ = counting_pod(lambda conn: conn.sendall(b"HTTP/1.1 200 OK\r\n" + head))
    _, pool = raw(handler)
    response = send(pool, timeouts=Timeouts(connect=2.0, response_start=5.0, idle=0.3))
    pieces = response.body()
    assert next(pieces) == b"hello"
    with pytest.raises(UpstreamIdle) as caught:
        next(pieces)
    assert caught.value.kind is FailureKind.TIMEOUT
    assert pool.idle_count == 0


@pytest.mark.parametrize("idle", [None, 5.0])
def test_a_pod_trickling_past_the_total_time_is_a_body_timeout(raw: RawFactory, idle: float | None) -> None:
    def handler(conn: gsocket.socket, index: int) -> None:
        read_head(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
        while True:  # until the client goes (the send fails)
            conn.sendall(b"x")
            gevent.sleep(0.02)

    _, pool = raw(handler)
    response = send(pool, timeouts=Timeouts(connect=2.0, response_start=5.0, idle=idle, total=0.5))
    with pytest.raises(UpstreamBodyTimeout):
        for _ in response.body():
            pass
    assert pool.idle_count == 0


# -- stale kept-alive connections and the retry rule ------------------------------------------------


def answered_then(after_answer: Callable[[gsocket.socket, int], None]) -> Handler:
    """Connection 0 answers its first request, then, once it has its second one, does
    ``after_answer(conn, index)``. Every request is answered with its connection's index."""

    def handler(conn: gsocket.socket, index: int) -> None:
        requests = RequestReader(conn).requests()
        for number, _ in enumerate(requests):
            if index == 0 and number == 1:
                after_answer(conn, index)
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n%d" % index)

    return handler


@pytest.mark.parametrize("body", [None, b"x" * 100_000], ids=["replayable", "streamed"])
def test_an_idle_connection_the_pod_closed_is_replaced(raw: RawFactory, body: bytes | None) -> None:
    """The pod closes every connection after one answer (an idle timeout of ~0)."""
    closed = gevent.event.Event()

    def handler(conn: gsocket.socket, index: int) -> None:
        if RequestReader(conn).next_request() is not None:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n%d" % index)
        conn.close()
        closed.set()

    pod, pool = raw(handler)
    _, data = fetch(pool)
    assert (data, pool.idle_count) == (b"0", 1)
    assert closed.wait(BOUND)  # the FIN is on its way while the connection is idle
    gevent.sleep(0)
    length = None if body is None else len(body)
    _, data = fetch(pool, "POST", b"/", None if body is None else BufferedBody(body), length=length)
    assert data == b"1"
    assert pod.accepted == 2


@pytest.mark.parametrize("how", ["fin", "reset"])
@pytest.mark.parametrize("body", [None, b"small body"], ids=["no-body", "small-body"])
def test_a_kept_alive_connection_dying_before_the_answer_is_retried_once(
    raw: RawFactory, body: bytes | None, how: str
) -> None:
    """The reused connection passes for alive but dies once it has the request."""
    pod, pool = raw(answered_then(lambda conn, index: reset(conn) if how == "reset" else None))
    assert fetch(pool)[1] == b"0"
    length = None if body is None else len(body)
    _, data = fetch(pool, "POST", b"/", None if body is None else BufferedBody(body), length=length)
    assert data == b"1"
    assert pod.accepted == 2


def test_the_retry_is_not_retried(raw: RawFactory) -> None:
    """Every connection after the first takes its request and closes unanswered."""

    def handler(conn: gsocket.socket, index: int) -> None:
        for number, _ in enumerate(RequestReader(conn).requests()):
            if index > 0 or number > 0:
                return
            conn.sendall(OK_EMPTY)

    pod, pool = raw(handler)
    fetch(pool)
    with pytest.raises(UpstreamConnectError) as caught:
        send(pool)
    assert not may_go_elsewhere(caught.value)
    assert pod.accepted == 2, "one fresh connection for the retry, no more"


@pytest.mark.parametrize("body", [None, b"small body"], ids=["no-body", "small-body"])
def test_a_refused_retry_may_go_elsewhere_only_if_no_body_was_consumed(raw: RawFactory, body: bytes | None) -> None:
    """The reused connection dies with the request, and the pod stopped listening: the
    retry's connect is refused. The proxy may try another pod only if it still has the
    whole body to send there, i.e. if none was read from the client."""
    servers: list[RawBackend] = []

    def stop_listening_and_close(conn: gsocket.socket, index: int) -> None:
        servers[0].stop_listening()

    pod, pool = raw(answered_then(stop_listening_and_close))
    servers.append(pod)
    fetch(pool)
    source = None if body is None else BufferedBody(body)
    with pytest.raises(UpstreamConnectError) as caught:
        send(pool, "POST", b"/", source, length=None if body is None else len(body))
    consumed = source is not None and source.reads > 0
    assert caught.value.body_read is consumed
    assert may_go_elsewhere(caught.value) is not consumed


def test_a_streamed_body_is_never_replayed(raw: RawFactory) -> None:
    def handler(conn: gsocket.socket, index: int) -> None:
        reader = RequestReader(conn)
        if reader.next_request() is not None:
            conn.sendall(OK_EMPTY)
            # More than the first write (head + 64 KiB): the body is streaming when the pod goes.
            reader.read_until(lambda request: len(request.body) > 100_000)
            reset(conn)

    pod, pool = raw(handler)
    fetch(pool)
    with pytest.raises(UpstreamConnectError) as caught:
        fetch(pool, "POST", b"/", BufferedBody(pattern(300_000)), length=300_000)
    assert not may_go_elsewhere(caught.value)
    assert pod.accepted == 1, "no second attempt"


# -- pods with Nagle's algorithm ------------------------------------------------------------------


def test_a_pod_writing_head_and_body_apart_without_nodelay_serves_a_pooled_connection(raw: RawFactory) -> None:
    def handler(conn: gsocket.socket, index: int) -> None:
        for number, _ in enumerate(RequestReader(conn).requests()):
            body = b"answer %d" % number
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
            conn.sendall(body)

    pod, pool = raw(handler, nodelay=False)
    for number in range(5):
        _, data = fetch(pool)
        assert data == b"answer %d" % number
    assert pod.accepted == 1
    assert pool.idle_count == 1


# -- the client's body fails or stalls --------------------------------------------------------------


@pytest.mark.parametrize("length", [10 * MiB, None], ids=["length", "chunked"])
def test_a_client_body_error_propagates_and_closes_the_pod_connection(raw: RawFactory, length: int | None) -> None:
    handler, received = counting_pod()
    _, pool = raw(handler)
    with pytest.raises(ClientGone):
        send(pool, "POST", b"/", BufferedBody(bytes(10 * MiB), fail_after=3), length=length)
    assert bytes_until_closed(received) < 10 * MiB
    assert pool.idle_count == 0


def test_a_body_known_broken_reaches_no_pod(raw: RawFactory) -> None:
    handler, received = counting_pod()
    _, pool = raw(handler)
    with pytest.raises(ClientBodyError):
        send(pool, "POST", b"/", BufferedBody(b"abc", known_error=ClientBodyError("bad chunk")))
    assert bytes_until_closed(received) == 0
    assert pool.idle_count == 0


def test_a_body_ending_before_its_content_length_closes_the_pod_connection(raw: RawFactory) -> None:
    handler, received = counting_pod()
    _, pool = raw(handler)
    with pytest.raises(ClientBodyError):
        send(pool, "POST", b"/", BufferedBody(b"x" * 100_000), length=200_000)
    assert bytes_until_closed(received) < 200_000
    assert pool.idle_count == 0


def test_a_client_body_that_stalls_is_a_client_timeout(raw: RawFactory, socket_body: SocketBody) -> None:
    handler, received = counting_pod()
    _, pool = raw(handler)
    socket_body.client.sendall(b"x" * 1000)  # then nothing
    with pytest.raises(ClientTimeout):
        send(pool, "POST", b"/", socket_body, length=100_000, timeouts=Timeouts(2.0, 5.0, client=0.3))
    assert bytes_until_closed(received) > 1000
    assert pool.idle_count == 0

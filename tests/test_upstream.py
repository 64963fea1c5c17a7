"""The upstream client against real sockets on 127.0.0.1: pooling, reuse rules, streaming
both ways, timeouts, and every way a pod can fail (tests/upstream_backend.py).
"""

import hashlib
import io
import json

import gevent
import gevent.event
import pytest

from activator.core.errors import UpstreamConnectError, UpstreamTimeout
from activator.upstream import (
    RequestBodyError,
    UpstreamBadResponse,
    UpstreamBodyError,
    UpstreamBodyTimeout,
    UpstreamPool,
)
from upstream_backend import RawBackend, WsgiBackend, listener, pattern, read_head, reset

MiB = 1024 * 1024
TIMEOUTS = {"connect_timeout": 2.0, "request_timeout": 5.0}


@pytest.fixture
def backend():
    b = WsgiBackend()
    yield b
    b.close()


@pytest.fixture
def pool(backend):
    p = UpstreamPool("127.0.0.1", backend.port)
    yield p
    p.close()


@pytest.fixture
def raw():
    servers = []

    def start(handler, **kw):
        s = RawBackend(handler, **kw)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


def host(port):
    return [("Host", f"127.0.0.1:{port}")]


def call(pool, method, path, body=None, body_length=None, headers=None, **timeouts):
    resp = pool.request(
        method, path, headers if headers is not None else host(pool.port), body, body_length, **(timeouts or TIMEOUTS)
    )
    try:
        data = b"".join(resp.chunks())
    finally:
        resp.close()
    return resp, data


class ChunkyReader:
    """A file-like body that hands out at most ``step`` bytes per read and counts reads."""

    def __init__(self, data: bytes, step: int = 10_000) -> None:
        self._f = io.BytesIO(data)
        self.step = step
        self.reads = 0

    def read(self, n: int) -> bytes:
        self.reads += 1
        return self._f.read(min(n, self.step))


# -- keep-alive and streaming ----------------------------------------------------------


def test_keep_alive_reuses_one_connection(backend, pool):
    for _ in range(5):
        resp, data = call(pool, "GET", "/bytes/100")
        assert resp.status == 200
        assert resp.reason == "OK"
        assert resp.content_length == 100
        assert data == pattern(100)
        assert ("X-Kind", "bytes") in resp.headers
    assert backend.connections == 1
    assert pool.idle_count == 1


def test_response_headers_have_no_hop_by_hop_or_length(raw):
    def handler(conn, index):
        read_head(conn)
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nConnection: X-Private, keep-alive\r\nKeep-Alive: timeout=5\r\n"
            b"X-Private: secret\r\nX-Public: yes\r\nTransfer-Encoding: chunked\r\nSet-Cookie: a=1\r\n"
            b"Set-Cookie: b=2\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
        )
        read_head(conn)

    srv = raw(handler)
    pool = UpstreamPool("127.0.0.1", srv.port)
    resp, data = call(pool, "GET", "/")
    assert data == b"abc"
    assert resp.content_length is None
    assert resp.headers == [("X-Public", "yes"), ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2")]
    assert pool.idle_count == 1  # chunked and keep-alive: reusable
    pool.close()


def test_upload_4mib_with_content_length(backend, pool):
    data = pattern(4 * MiB + 7)
    body = ChunkyReader(data, step=100_000)
    resp, out = call(pool, "POST", "/echo", body, len(data))
    info = json.loads(out)
    assert info["sha256"] == hashlib.sha256(data).hexdigest()
    assert info["length"] == len(data)
    assert info["content_length"] == str(len(data))
    assert info["transfer_encoding"] is None
    assert info["host"] == f"127.0.0.1:{backend.port}"
    assert body.reads > 10  # streamed in pieces, not read whole


def test_upload_chunked_unknown_length(backend, pool):
    data = pattern(3 * MiB + 12345)
    resp, out = call(pool, "PUT", "/echo", ChunkyReader(data, step=70_000), None)
    info = json.loads(out)
    assert info["sha256"] == hashlib.sha256(data).hexdigest()
    assert info["length"] == len(data)
    assert info["transfer_encoding"] == "chunked"
    assert info["method"] == "PUT"


def test_empty_bodies(backend, pool):
    _, out = call(pool, "POST", "/echo", None, 0)
    assert json.loads(out)["content_length"] == "0"
    _, out = call(pool, "POST", "/echo", io.BytesIO(b""), None)  # chunked, zero chunks
    info = json.loads(out)
    assert info["length"] == 0 and info["transfer_encoding"] == "chunked"
    assert backend.connections == 1


def test_short_request_body_is_a_request_body_error(backend, pool):
    with pytest.raises(RequestBodyError):
        pool.request("POST", "/echo", host(backend.port), io.BytesIO(b"x" * 100_000), 200_000, **TIMEOUTS)
    assert pool.idle_count == 0  # that connection was closed, not pooled
    resp, _ = call(pool, "GET", "/bytes/1")
    assert resp.status == 200


def test_download_4mib(backend, pool):
    n = 4 * MiB + 3
    resp = pool.request("GET", f"/bytes/{n}", host(backend.port), None, None, **TIMEOUTS)
    assert resp.content_length == n
    h = hashlib.sha256()
    pieces = 0
    for piece in resp.chunks():
        assert isinstance(piece, bytes)
        assert len(piece) <= 65536
        h.update(piece)
        pieces += 1
    resp.close()
    assert h.hexdigest() == hashlib.sha256(pattern(n)).hexdigest()
    assert pieces > 1
    assert pool.idle_count == 1  # fully read: back in the pool


def test_slow_chunked_response_is_streamed_chunk_by_chunk(backend, pool):
    resp = pool.request("GET", "/slow", host(backend.port), None, None, **TIMEOUTS)
    assert resp.content_length is None
    got = []
    for piece in resp.chunks():
        i = len(got)
        got.append(piece)
        backend.log.append(("got", i))
        backend.acks[i].set()
    resp.close()
    assert got == backend.slow_chunks  # one piece per chunk, nothing merged or held back
    # The first chunk reached us before the backend sent the last one.
    assert backend.log.index(("got", 0)) < backend.log.index(("sent", 4))
    assert pool.idle_count == 1


def test_head_204_304_have_no_body_and_reuse(backend, pool):
    resp, data = call(pool, "HEAD", "/bytes/5000")
    assert (resp.status, data, resp.content_length) == (200, b"", 5000)
    resp, data = call(pool, "GET", "/status/204")
    assert (resp.status, data) == (204, b"")
    resp, data = call(pool, "GET", "/status/304")
    assert (resp.status, data) == (304, b"")
    resp, data = call(pool, "GET", "/bytes/10")
    assert data == pattern(10)
    assert backend.connections == 1


def test_interim_1xx_response_is_skipped(raw):
    def handler(conn, index):
        read_head(conn)
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n")
        conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
        read_head(conn)

    srv = raw(handler)
    pool = UpstreamPool("127.0.0.1", srv.port)
    resp, data = call(pool, "POST", "/", io.BytesIO(b"abc"), 3)
    assert (resp.status, resp.reason, resp.headers, data) == (201, "Created", [], b"ok")
    assert pool.idle_count == 1
    pool.close()


def test_read_until_close_response_is_not_reused(raw):
    def handler(conn, index):
        read_head(conn)
        conn.sendall(b"HTTP/1.0 200 OK\r\nX-A: 1\r\n\r\n")
        conn.sendall(b"until close")

    srv = raw(handler)
    pool = UpstreamPool("127.0.0.1", srv.port)
    for _ in range(2):
        resp, data = call(pool, "GET", "/")
        assert (resp.status, resp.content_length, data) == (200, None, b"until close")
        assert pool.idle_count == 0
    assert srv.accepted == 2
    pool.close()


# -- failures ----------------------------------------------------------------------------


def test_connection_refused_is_retriable_connect_error():
    sock = listener()
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    pool = UpstreamPool("127.0.0.1", port)
    body = ChunkyReader(b"abc")
    with pytest.raises(UpstreamConnectError) as ei:
        pool.request("POST", "/", host(port), body, 3, **TIMEOUTS)
    assert ei.value.retriable is True
    assert ei.value.status == 502
    assert body.reads == 0  # the body is untouched, so the proxy may retry elsewhere


def test_accept_and_never_answer_is_timeout(raw):
    srv = raw(lambda conn, index: gevent.sleep(10))
    pool = UpstreamPool("127.0.0.1", srv.port)
    with pytest.raises(UpstreamTimeout) as ei:
        pool.request("GET", "/", host(srv.port), None, None, connect_timeout=1.0, request_timeout=0.2)
    assert ei.value.status == 504
    assert pool.idle_count == 0


def test_never_accepted_is_timeout_too(raw):
    srv = raw(None, accept=False)  # the kernel completes the handshake from the backlog
    pool = UpstreamPool("127.0.0.1", srv.port)
    with pytest.raises(UpstreamTimeout):
        pool.request("GET", "/", host(srv.port), None, None, connect_timeout=1.0, request_timeout=0.1)


def test_garbage_response_is_bad_response(raw):
    def handler(conn, index):
        read_head(conn)
        conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")

    srv = raw(handler)
    pool = UpstreamPool("127.0.0.1", srv.port)
    with pytest.raises(UpstreamBadResponse) as ei:
        pool.request("GET", "/", host(srv.port), None, None, **TIMEOUTS)
    assert isinstance(ei.value, UpstreamConnectError)
    assert (ei.value.status, ei.value.reason, ei.value.retriable) == (502, "upstream-bad-response", False)


def test_reset_before_head_is_non_retriable_connect_error(raw):
    def handler(conn, index):
        read_head(conn)
        reset(conn)

    srv = raw(handler)
    pool = UpstreamPool("127.0.0.1", srv.port)
    with pytest.raises(UpstreamConnectError) as ei:
        pool.request("GET", "/", host(srv.port), None, None, **TIMEOUTS)
    assert type(ei.value) is UpstreamConnectError
    assert ei.value.retriable is False  # the request had been sent


def test_close_after_partial_head_is_connect_error(raw):
    def handler(conn, index):
        read_head(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Le")

    srv = raw(handler)
    pool = UpstreamPool("127.0.0.1", srv.port)
    with pytest.raises(UpstreamConnectError) as ei:
        pool.request("GET", "/", host(srv.port), None, None, **TIMEOUTS)
    assert ei.value.retriable is False


@pytest.mark.parametrize("how", ["reset", "fin"])
def test_broken_body_raises_body_error(raw, how):
    def handler(conn, index):
        read_head(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 1000)
        gevent.sleep(0.05)
        if how == "reset":
            reset(conn)

    srv = raw(handler)
    pool = UpstreamPool("127.0.0.1", srv.port)
    resp = pool.request("GET", "/", host(srv.port), None, None, **TIMEOUTS)
    assert resp.status == 200
    got = b""
    with pytest.raises(UpstreamBodyError) as ei:
        for piece in resp.chunks():
            got += piece
    assert not ei.value.timed_out
    assert got == b"x" * 1000
    resp.close()
    resp.close()  # idempotent
    assert pool.idle_count == 0


def test_broken_chunked_body_raises_body_error(raw):
    def handler(conn, index):
        read_head(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        gevent.sleep(0.05)
        conn.sendall(b"zz\r\nnot hex\r\n")

    srv = raw(handler)
    pool = UpstreamPool("127.0.0.1", srv.port)
    resp = pool.request("GET", "/", host(srv.port), None, None, **TIMEOUTS)
    it = resp.chunks()
    assert next(it) == b"hello"
    with pytest.raises(UpstreamBodyError):
        next(it)
    resp.close()


@pytest.mark.parametrize(
    "head",
    [b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", b"Content-Length: 100\r\n\r\nhello"],
    ids=["chunked", "length"],
)
def test_stalled_body_hits_request_timeout(raw, head):
    def handler(conn, index):
        read_head(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\n" + head)
        gevent.sleep(10)

    srv = raw(handler)
    pool = UpstreamPool("127.0.0.1", srv.port)
    resp = pool.request("GET", "/", host(srv.port), None, None, connect_timeout=1.0, request_timeout=0.2)
    it = resp.chunks()
    assert next(it) == b"hello"
    with pytest.raises(UpstreamBodyTimeout) as ei:
        next(it)
    assert ei.value.timed_out
    resp.close()


# -- reuse rules ---------------------------------------------------------------------------


def test_unread_body_then_close_is_not_reused(backend, pool):
    resp = pool.request("GET", f"/bytes/{4 * MiB}", host(backend.port), None, None, **TIMEOUTS)
    next(iter(resp.chunks()))
    resp.close()
    assert pool.idle_count == 0
    resp, data = call(pool, "GET", "/bytes/10")
    assert data == pattern(10)
    assert backend.connections == 2
    assert backend.ports[0] != backend.ports[1]


def test_close_without_reading_bodyless_response_keeps_connection(backend, pool):
    resp = pool.request("GET", "/status/204", host(backend.port), None, None, **TIMEOUTS)
    resp.close()
    call(pool, "GET", "/status/204")
    assert backend.connections == 1


def test_stale_idle_connection_is_replaced(raw):
    """The pod closes every connection after one response (an idle timeout of ~0)."""

    closed = gevent.event.Event()

    def handler(conn, index):
        read_head(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n%d" % index)
        conn.close()
        closed.set()

    srv = raw(handler)
    pool = UpstreamPool("127.0.0.1", srv.port)
    _, data = call(pool, "GET", "/")
    assert data == b"0"
    assert pool.idle_count == 1
    closed.wait(5)  # the FIN is on its way while the connection is idle
    gevent.sleep(0)
    _, data = call(pool, "GET", "/")
    assert data == b"1"
    pool.close()


@pytest.mark.parametrize("how", ["fin", "reset"])
@pytest.mark.parametrize("body", [None, b"small body"])
def test_connection_dying_after_request_is_retried_once(raw, body, how):
    """Reused connection passes the idle check but dies before any response byte."""

    def handler(conn, index):
        read_head(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n%d" % index)
        if index == 0:
            read_head(conn)  # takes the second request, then goes away without answering
            if how == "reset":
                reset(conn)
            return
        read_head(conn)

    srv = raw(handler)
    pool = UpstreamPool("127.0.0.1", srv.port)
    _, data = call(pool, "GET", "/")
    assert data == b"0"
    length = None if body is None else len(body)
    _, data = call(pool, "POST", "/", None if body is None else io.BytesIO(body), length)
    assert data == b"1"
    assert srv.accepted == 2
    pool.close()


def test_streamed_body_is_never_replayed(raw):

    def handler(conn, index):
        read_head(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n%d" % index)
        if index == 0:
            # Take more than the first write (head + 64 KiB), so the body is being
            # streamed from the client when the pod goes away.
            got = b""
            while len(got) < 100_000:
                got += conn.recv(65536)
            reset(conn)

    srv = raw(handler)
    pool = UpstreamPool("127.0.0.1", srv.port)
    call(pool, "GET", "/")
    body = ChunkyReader(pattern(300_000), step=65536)
    with pytest.raises((UpstreamConnectError, UpstreamTimeout)) as ei:
        call(pool, "POST", "/", body, 300_000)
    assert getattr(ei.value, "retriable", False) is False
    assert srv.accepted == 1  # no second attempt
    pool.close()


def test_max_idle_and_close(backend):
    pool = UpstreamPool("127.0.0.1", backend.port, max_idle=2)
    for ev in backend.acks:
        ev.set()
    # Three concurrent exchanges need three connections; only two stay idle afterwards.
    gs = [gevent.spawn(call, pool, "GET", "/slow") for _ in range(3)]
    gevent.joinall(gs, raise_error=True)
    assert [g.value[1] for g in gs] == [b"".join(backend.slow_chunks)] * 3
    assert backend.connections == 3
    assert pool.idle_count == 2
    pool.close()
    assert pool.idle_count == 0
    resp, data = call(pool, "GET", "/bytes/3")  # still works after close, just not pooled
    assert data == pattern(3)
    assert pool.idle_count == 0


class Zeros:
    """A file-like body of n zero bytes made on the fly; optionally fails after some reads."""

    def __init__(self, n: int, fail_after: int | None = None) -> None:
        self.left = n
        self.reads = 0
        self.fail_after = fail_after

    def read(self, n: int) -> bytes:
        self.reads += 1
        if self.fail_after is not None and self.reads > self.fail_after:
            raise OSError("client went away")
        n = min(n, self.left)
        self.left -= n
        return bytes(n)


def test_pod_that_does_not_read_the_upload_times_out(raw):
    srv = raw(lambda conn, index: gevent.sleep(10))  # accepts, never reads
    pool = UpstreamPool("127.0.0.1", srv.port)
    with pytest.raises(UpstreamTimeout):
        pool.request("PUT", "/", host(srv.port), Zeros(256 * MiB), 256 * MiB, connect_timeout=1.0, request_timeout=0.2)


def test_failing_client_body_is_request_body_error(backend, pool):
    with pytest.raises(RequestBodyError) as ei:
        pool.request("POST", "/echo", host(backend.port), Zeros(10 * MiB, fail_after=3), 10 * MiB, **TIMEOUTS)
    assert isinstance(ei.value.__cause__, OSError)
    assert pool.idle_count == 0
    with pytest.raises(RequestBodyError):  # same for a chunked upload
        pool.request("POST", "/echo", host(backend.port), Zeros(10 * MiB, fail_after=3), None, **TIMEOUTS)
    assert pool.idle_count == 0


def test_head_trickled_in_small_pieces(raw):
    head = (
        b"HTTP/1.1 200 Fine Thanks\r\nX-Long-Header-Name: a fairly long value, with commas\r\n"
        b"Content-Length: 5\r\n\r\nhello"
    )

    def handler(conn, index):
        read_head(conn)
        for i in range(0, len(head), 3):
            conn.sendall(head[i : i + 3])
            gevent.sleep(0.001)
        read_head(conn)

    srv = raw(handler)
    pool = UpstreamPool("127.0.0.1", srv.port)
    resp, data = call(pool, "GET", "/")
    assert resp.reason == "Fine Thanks"
    assert resp.headers == [("X-Long-Header-Name", "a fairly long value, with commas")]
    assert (resp.content_length, data) == (5, b"hello")
    assert pool.idle_count == 1
    pool.close()


@pytest.mark.parametrize(
    "response, reusable",
    [
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok", True),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 404 NF\r\nContent-Length: 1\r\n\r\nx", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok and then some garbage", False),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\ngarbage", False),
    ],
    ids=["1.0-keep-alive", "1.0", "close", "extra-response", "trailing-garbage", "chunked-trailing-garbage"],
)
def test_reuse_rules(raw, response, reusable):
    def handler(conn, index):
        read_head(conn)
        conn.sendall(response)
        read_head(conn)

    srv = raw(handler)
    pool = UpstreamPool("127.0.0.1", srv.port)
    resp, data = call(pool, "GET", "/")
    assert (resp.status, resp.reason, data) == (200, "OK", b"ok")
    assert pool.idle_count == (1 if reusable else 0)
    pool.close()


def test_host_name_and_bare_requests(backend):
    pool = UpstreamPool("localhost", backend.port)  # resolved on connect
    resp, data = call(pool, "GET", "/bytes/4", headers=[])  # no headers at all is still a valid request
    assert (resp.status, data) == (200, pattern(4))
    with pytest.raises(ValueError):
        pool.request("POST", "/echo", [], None, 10, **TIMEOUTS)
    pool.close()


# -- the head parser, fed in arbitrary pieces (no sockets) ---------------------------------

from hypothesis import given, settings
from hypothesis import strategies as st

from activator.upstream import UpstreamResponse

SAMPLE_HEAD = (
    b"HTTP/1.1 200 All Good\r\nServer: x\r\nX-Empty:\r\nConnection: keep-alive, X-Hop\r\n"
    b"X-Hop: 1\r\nSet-Cookie: a=1\r\nTransfer-Encoding: chunked\r\nSet-Cookie: b=2\r\n\r\n"
    b"4\r\nwiki\r\n5\r\npedia\r\n0\r\nX-Trailer: t\r\n\r\n"
)


def parse(pieces, whole_head):
    resp = UpstreamResponse(whole_head)
    resp._method_head = False
    body = b""
    for piece in pieces:
        resp.feed(piece)
        if resp._pending:
            body += resp._take_pending()
    return resp, body


def test_head_in_one_piece():
    resp, body = parse([SAMPLE_HEAD], True)
    assert (resp.status, resp.reason) == (200, "All Good")
    assert resp.headers == [("Server", "x"), ("X-Empty", ""), ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2")]
    assert (body, resp._complete, resp._keep_alive) == (b"wikipedia", True, True)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(SAMPLE_HEAD) - 1), max_size=30))
def test_head_split_anywhere_parses_the_same(cuts):
    cuts = sorted(set(cuts))
    pieces = [SAMPLE_HEAD[a:b] for a, b in zip([0, *cuts], [*cuts, len(SAMPLE_HEAD)])]
    one, one_body = parse([SAMPLE_HEAD], True)
    resp, body = parse(pieces, False)
    assert (resp.status, resp.reason, resp.headers, resp.content_length) == (
        one.status,
        one.reason,
        one.headers,
        one.content_length,
    )
    assert (body, resp._complete, resp._keep_alive) == (one_body, True, True)

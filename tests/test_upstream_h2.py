"""The h2c pod client (``activator.pods.h2c``) against real HTTP/2 peers on 127.0.0.1.

What is tested: the request as the pod receives it (pseudo-headers, lower-cased names,
no connection-specific fields, ``te: trailers``, the body with its length or trailers),
the response framings and 1xx heads; gRPC end to end against a real grpcio server
(unary with its ``grpc-status`` trailer, a trailers-only error, server-, client- and
bidirectional streaming); many streams on one connection, a second connection only at
the pod's ``SETTINGS_MAX_CONCURRENT_STREAMS``; flow control both ways (a slow reader
holds at most its stream window, one slow stream never stalls another, uploads keep to
the pod's window); every way a pod can fail (refused connection, no SETTINGS, not
HTTP/2, streams reset or refused, the connection closed mid-stream, GOAWAY, a response
h2 refuses, a malformed ``:status``) with the error kinds the proxy's retry rule needs;
the deadlines (``connect``, ``response_start`` from the end of the upload, ``idle``,
``total``); the client's body failing; and the pump stopped when the response ends (the
driver's frame scanner, which takes the GOAWAY frames out, is ``test_h2wire.py``'s).

How: ``h2_pod.H2Pod`` is an HTTP/2 server written with h2 (server side) on gevent
sockets, in this process, recording what it received; the grpcio server
(``grpc_pod.py``) runs as a process of its own (why: see there), and the tests
coordinate with it through gRPC calls made with the client under test. The session is
not monkey-patched: everything uses gevent sockets and primitives directly. No assertion
is about time: a timeout here only bounds a wait, so that a bug shows as a failure
instead of a hang.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gevent
import gevent.event
import gevent.queue
import pytest
from gevent import socket as gsocket
from h2.errors import ErrorCodes
from h2_helpers import eventually
from h2_pod import H2Pod, PodRequest
from upstream_backend import RawBackend, pattern

from activator.base import exchange
from activator.base.exchange import InterimCallback
from activator.core.errors import (
    ClientGone,
    UpstreamBadResponse,
    UpstreamBodyError,
    UpstreamBodyTimeout,
    UpstreamConnectError,
    UpstreamIdle,
    UpstreamTimeout,
)
from activator.core.failures import CONNECT_RETRIES, may_retry_elsewhere
from activator.core.heads import BodyFraming, Header
from activator.core.load import LoadReading, reading_in_head
from activator.core.timeouts import Timeouts
from activator.pods.h2c import CONNECTION_ATTEMPTS, H2PodPool, H2PodStream

MiB = 1024 * 1024
#: Generous: no test here expects a connect or a response head to take long.
TIMEOUTS = Timeouts(connect=2.0, response_start=5.0)
#: Seconds a test waits for something that should happen at once (only to turn a hang into a failure).
BOUND = 5.0
#: Seconds after which a whole test counts as hung.
TEST_BOUND = 30.0
#: The small stream window of the flow-control tests: a 1 MiB answer is 16 windows.
SMALL_WINDOW = 65536
TESTS_DIR = Path(__file__).resolve().parent


# -- request bodies ----------------------------------------------------------------------------


class QueueBody:
    """A request body the test feeds as it goes, like a client streaming its upload.

    ``put`` a piece, ``end`` it (with trailers), or ``fail`` it with the error the client's
    side would raise. ``waiting`` counts reads blocked on it now (a pump still running).
    """

    def __init__(self, *pieces: bytes, end: bool = False, trailers: list[Header] | None = None) -> None:
        self._queue: gevent.queue.Queue[bytes | BaseException] = gevent.queue.Queue()
        self._rest = b""
        self._ended = False
        self.trailers: list[Header] = []
        self.waiting = 0
        for piece in pieces:
            self.put(piece)
        if end:
            self.end(trailers)

    def put(self, data: bytes) -> None:
        assert data, "an empty piece would end the body"
        self._queue.put(data)

    def end(self, trailers: list[Header] | None = None) -> None:
        self.trailers = trailers or []
        self._queue.put(b"")

    def fail(self, error: BaseException) -> None:
        self._queue.put(error)

    def read(self, size: int = 65536) -> bytes:
        if not self._rest and not self._ended:
            self.waiting += 1
            try:
                item = self._queue.get(timeout=TEST_BOUND)
            finally:
                self.waiting -= 1
            if isinstance(item, BaseException):
                raise item
            self._rest = item
            self._ended = not item
        piece, self._rest = self._rest[:size], self._rest[size:]
        return piece

    def raise_known_error(self) -> None:
        pass

    def buffered(self) -> bool:
        return bool(self._rest) or self._ended or not self._queue.empty()

    def exhausted(self) -> bool:
        return self._ended and not self._rest

    def wait_for_body(self, pod_fd: int, timeout: float) -> bool:
        raise AssertionError("the h2c client never waits on a pod socket")


# -- fixtures and helpers --------------------------------------------------------------------------

PodFactory = Callable[..., tuple[H2Pod, H2PodPool]]


@pytest.fixture(autouse=True)
def hang_is_failure() -> Iterator[None]:
    """A client that waits forever (no deadline of its own fires) fails the test instead of hanging it."""
    with gevent.Timeout(TEST_BOUND, AssertionError(f"the test was still waiting after {TEST_BOUND}s")):
        yield


@pytest.fixture
def h2pod() -> Iterator[PodFactory]:
    """``h2pod(handler, stream_window=..., **H2Pod options) -> (pod, pool to it)``; all closed at teardown."""
    started: list[tuple[H2Pod, H2PodPool]] = []

    def start(
        handler: Callable[[PodRequest], None], *, stream_window: int | None = None, **options: Any
    ) -> tuple[H2Pod, H2PodPool]:
        pod = H2Pod(handler, **options)
        window = {} if stream_window is None else {"stream_window": stream_window}
        started.append((pod, H2PodPool("127.0.0.1", pod.port, **window)))
        return started[-1]

    yield start
    for pod, pool in started:
        pool.close()
        pod.close()


@pytest.fixture(scope="module")
def grpc_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The port of a real grpcio server (``grpc_pod.py``, its own process)."""
    import harness

    workdir = tmp_path_factory.mktemp("grpc-pod")
    process = harness.Process(
        [sys.executable, str(TESTS_DIR / "grpc_pod.py")],
        stdout_path=workdir / "stdout",
        stderr_path=workdir / "stderr",
        name="grpc-pod",
    )
    try:
        yield int(process.wait_output(r"^PORT (\d+)$").group(1))
    finally:
        process.kill()


@pytest.fixture
def grpc_pool(grpc_port: int) -> Iterator[H2PodPool]:
    pool = H2PodPool("127.0.0.1", grpc_port)
    yield pool
    pool.close()


def host_line(port: int) -> list[Header]:
    return [(b"Host", b"127.0.0.1:%d" % port)]


def send(
    pool: H2PodPool,
    method: str = "GET",
    target: bytes = b"/",
    body: QueueBody | None = None,
    *,
    length: int | None = None,
    headers: list[Header] | None = None,
    timeouts: Timeouts = TIMEOUTS,
    interim: InterimCallback | None = None,
) -> H2PodStream:
    """One request: no body, a body with Content-Length (``length`` given), or a stream."""
    framing = BodyFraming.NONE if body is None else BodyFraming.CHUNKED if length is None else BodyFraming.LENGTH
    if headers is None:
        headers = host_line(pool.port)
    return pool.request(exchange.PodRequest(method, target, headers, body, framing, length, interim), timeouts)


def read_to_end(response: H2PodStream) -> bytes:
    """The whole response body (whichever way the proxy would take it); the stream is closed after."""
    try:
        return response.take_body() if response.complete else b"".join(response.body())
    finally:
        response.close()


def fetch(*args: Any, **kwargs: Any) -> tuple[H2PodStream, bytes]:
    """``send(*args, **kwargs)``, and the whole answer read."""
    response = send(*args, **kwargs)
    return response, read_to_end(response)


def attempt(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, or the exception it raised (for a greenlet expected to fail)."""
    try:
        return function(*args, **kwargs)
    except Exception as error:
        return error


def connect_error(greenlet: gevent.Greenlet) -> UpstreamConnectError:
    """The ``UpstreamConnectError`` a greenlet running ``attempt(send, ...)`` ended with."""
    error = greenlet.get(timeout=BOUND)
    assert isinstance(error, UpstreamConnectError), f"{error!r} instead of a connect error"
    return error


def may_go_elsewhere(error: UpstreamConnectError) -> bool:
    """Whether the proxy's retry rule sends this failed request to another pod."""
    return may_retry_elsewhere(error.kind, error.connected, error.body_read, CONNECT_RETRIES, stopping=False)


def answer(
    status: int = 200, headers: list[Header] | None = None, body: bytes = b"", trailers: list[Header] | None = None
) -> Callable[[PodRequest], None]:
    """A handler that reads the whole request, then answers with these."""

    def handler(request: PodRequest) -> None:
        request.read_all()
        request.respond(status, headers or [], end=not body and not trailers)
        if body or trailers:
            request.send(body, end=not trailers)
        if trailers:
            request.send_trailers(trailers)

    return handler


def hold_until_reset(request: PodRequest) -> None:
    """A handler that answers nothing and waits for the client to give up."""
    request.wait_until(lambda: request.reset_code is not None, timeout=TEST_BOUND)


def resets_of(pod: H2Pod) -> list[tuple[int, int]]:
    return [reset for connection in pod.connections for reset in connection.resets]


# -- what the pod receives -------------------------------------------------------------------------


def test_request_head_is_sent_as_http2_wants_it(h2pod: PodFactory) -> None:
    pod, pool = h2pod(answer())
    headers = [
        (b"Host", b"api.example:8080"),
        (b"Content-Type", b"text/plain"),
        (b"Connection", b"keep-alive"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Proxy-Connection", b"keep-alive"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Upgrade", b"websocket"),
        (b"TE", b"gzip"),
        (b"X-Repeated", b"one"),
        (b"X-Repeated", b"two"),
    ]
    fetch(pool, "PUT", b"/models/m?x=1", QueueBody(b"hello", end=True), length=5, headers=headers)
    (request,) = pod.requests
    assert request.headers == [
        (b":method", b"PUT"),
        (b":scheme", b"http"),
        (b":authority", b"api.example:8080"),
        (b":path", b"/models/m?x=1"),
        (b"content-type", b"text/plain"),
        (b"x-repeated", b"one"),
        (b"x-repeated", b"two"),
        (b"te", b"trailers"),
        (b"content-length", b"5"),
    ]
    assert bytes(request.read_all()) == b"" and request.ended.is_set()


@pytest.mark.parametrize("length", [5, None], ids=["content-length", "unknown length"])
def test_a_body_here_whole_goes_at_once_without_a_pump(h2pod: PodFactory, length: int | None) -> None:
    pod, pool = h2pod(answer())
    body = QueueBody(b"hello", end=True)
    body.read(0)  # what the client sent came whole (as a small gRPC call's does): nothing to wait for
    response = send(pool, "POST", b"/whole", body, length=length)
    assert response._upload is not None and response._upload.greenlet is None  # no greenlet, no wait
    read_to_end(response)
    (request,) = pod.requests
    assert request.ended.is_set()
    response.close()


def test_a_body_larger_than_the_pods_window_goes_on_in_the_pump(h2pod: PodFactory) -> None:
    def digest(request: PodRequest) -> None:
        received = bytes(request.read_all())
        request.respond(200, [], end=False)
        request.send(hashlib.sha256(received).hexdigest().encode(), end=True)

    _, pool = h2pod(digest, initial_window_size=1000)
    data = pattern(5000)
    body = QueueBody(data, end=True)
    body.read(0)
    response, answer_data = fetch(pool, "POST", b"/large", body, length=len(data))
    assert response._upload is not None and response._upload.greenlet is not None
    assert answer_data == hashlib.sha256(data).hexdigest().encode()


def test_a_streamed_body_arrives_whole_with_its_trailers(h2pod: PodFactory) -> None:
    received: list[bytes] = []

    def handler(request: PodRequest) -> None:
        received.append(request.read_all())
        request.respond(200, end=True)

    pod, pool = h2pod(handler)
    data = pattern(3 * MiB + 17)  # many windows of the pod's default 64 KiB
    body = QueueBody(*[data[i : i + 100_000] for i in range(0, len(data), 100_000)])
    body.end(trailers=[(b"X-Checksum", b"abc"), (b"Connection", b"close"), (b"TE", b"gzip")])
    response, _ = fetch(pool, "POST", b"/upload", body)
    assert response.head.status == 200
    assert hashlib.sha256(received[0]).digest() == hashlib.sha256(data).digest()
    (request,) = pod.requests
    assert request.header(b"content-length") is None
    assert request.trailers == [(b"x-checksum", b"abc")]


def test_authority_is_the_pod_address_without_a_host(h2pod: PodFactory) -> None:
    pod, pool = h2pod(answer())
    fetch(pool, headers=[(b"Accept", b"*/*")])
    assert pod.requests[0].header(b":authority") == b"127.0.0.1:%d" % pod.port


def test_one_connection_carries_every_request_in_turn(h2pod: PodFactory) -> None:
    pod, pool = h2pod(answer(body=b"ok"))
    for _ in range(5):
        response, data = fetch(pool)
        assert (response.head.status, data) == (200, b"ok")
    assert len(pod.connections) == 1
    assert [request.stream_id for request in pod.requests] == [1, 3, 5, 7, 9]
    assert (pool.connection_count, pool.idle_count, pool.stream_count) == (1, 1, 0)


# -- the response ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "status", "headers", "body", "trailers", "framing", "length"),
    [
        ("GET", 200, [(b"content-length", b"5")], b"hello", None, BodyFraming.LENGTH, 5),
        ("GET", 200, [], b"hello", None, BodyFraming.CHUNKED, None),
        ("GET", 200, [], b"hello", [(b"grpc-status", b"0")], BodyFraming.CHUNKED, None),
        ("GET", 200, [(b"content-length", b"0")], b"", None, BodyFraming.NONE, 0),
        ("GET", 200, [], b"", None, BodyFraming.NONE, None),  # the headers ended the stream
        ("GET", 204, [], b"", None, BodyFraming.NONE, None),
        ("HEAD", 200, [(b"content-length", b"5")], b"", None, BodyFraming.NONE, 5),
        ("GET", 304, [(b"content-length", b"5")], b"", None, BodyFraming.NONE, 5),
    ],
)
def test_response_framing(
    h2pod: PodFactory,
    method: str,
    status: int,
    headers: list[Header],
    body: bytes,
    trailers: list[Header] | None,
    framing: BodyFraming,
    length: int | None,
) -> None:
    _, pool = h2pod(answer(status, [*headers, (b"x-kind", b"test")], body, trailers))
    response, data = fetch(pool, method)
    assert (response.head.status, response.head.reason) == (status, b"")
    assert (response.framing, response.head.content_length) == (framing, length)
    assert response.head.headers == [*headers, (b"x-kind", b"test")]
    assert response.head.lower_names == [name for name, _ in response.head.headers]
    assert (tuple(response.head.connection_values), response.early, response.upgraded) == ((), False, False)
    assert data == body
    assert list(response.trailers) == (trailers or [])


def test_interim_heads_go_to_the_callback_and_100_is_dropped(h2pod: PodFactory) -> None:
    def handler(request: PodRequest) -> None:
        request.respond(100)
        request.respond(103, [(b"link", b"</style.css>; rel=preload")])
        request.respond(200, [(b"content-length", b"2")])
        request.send(b"ok", end=True)

    _, pool = h2pod(handler)
    interims: list[tuple[int, bytes, list[Header]]] = []
    response, data = fetch(pool, interim=lambda *args: interims.append(args))
    assert interims == [(103, b"", [(b"link", b"</style.css>; rel=preload")])]
    assert (response.head.status, data) == (200, b"ok")


def test_a_stream_never_tunnels(h2pod: PodFactory) -> None:
    _, pool = h2pod(answer())
    response, _ = fetch(pool)
    with pytest.raises(NotImplementedError):
        response.detach()


# -- gRPC, against grpcio ---------------------------------------------------------------------------


def grpc_frame(message: bytes) -> bytes:
    """One gRPC message as it travels: uncompressed flag, 4-byte length, the bytes."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


class GrpcReader:
    """Splits a response body into gRPC messages as its pieces arrive."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, piece: bytes) -> list[bytes]:
        self._buffer += piece
        messages = []
        while len(self._buffer) >= 5:
            size = int.from_bytes(self._buffer[1:5], "big")
            if len(self._buffer) < 5 + size:
                break
            messages.append(self._buffer[5 : 5 + size])
            self._buffer = self._buffer[5 + size :]
        return messages


def grpc_send(pool: H2PodPool, method: str, body: QueueBody) -> H2PodStream:
    headers = [*host_line(pool.port), (b"Content-Type", b"application/grpc"), (b"User-Agent", b"test")]
    return send(pool, "POST", b"/test.Pod/" + method.encode(), body, headers=headers)


def grpc_unary(pool: H2PodPool, method: str, message: bytes) -> tuple[H2PodStream, list[bytes]]:
    """One unary call (its messages, its stream closed)."""
    response = grpc_send(pool, method, QueueBody(grpc_frame(message), end=True))
    return response, GrpcReader().feed(read_to_end(response))


def test_grpc_unary_call_with_its_status_trailer(grpc_pool: H2PodPool) -> None:
    response, messages = grpc_unary(grpc_pool, "Unary", b"hello")
    assert response.head.status == 200
    assert (b"content-type", b"application/grpc") in response.head.headers
    assert response.framing is BodyFraming.CHUNKED
    assert messages == [b"hello"]
    assert (b"grpc-status", b"0") in response.trailers


def test_grpc_error_is_a_trailers_only_answer(grpc_pool: H2PodPool) -> None:
    response, messages = grpc_unary(grpc_pool, "Fail", b"x")
    assert (response.head.status, response.framing, response.complete) == (200, BodyFraming.NONE, True)
    assert (b"grpc-status", b"3") in response.head.headers
    assert (b"grpc-message", b"refused on purpose") in response.head.headers
    assert messages == []


def test_concurrent_grpc_calls_share_one_connection(grpc_pool: H2PodPool) -> None:
    calls = [gevent.spawn(grpc_unary, grpc_pool, "Unary", b"call %d" % i) for i in range(20)]
    gevent.joinall(calls, timeout=BOUND, raise_error=True)
    assert [call.value[1] for call in calls] == [[b"call %d" % i] for i in range(20)]
    assert grpc_pool.connection_count == 1


def test_grpc_server_streaming_delivers_each_message_as_it_is_sent(grpc_pool: H2PodPool) -> None:
    # The server sends message i+1 only once Ack(i) said message i arrived here: a client
    # that held the answer back would end with DEADLINE_EXCEEDED instead.
    count = 5
    response = grpc_send(grpc_pool, "ServerStream", QueueBody(grpc_frame(b"%d" % count), end=True))
    reader = GrpcReader()
    received: list[bytes] = []
    try:
        for piece in response.body():
            for message in reader.feed(piece):
                grpc_unary(grpc_pool, "Ack", b"%d" % len(received))
                received.append(message)
    finally:
        response.close()
    assert received == [b"message %d" % i for i in range(count)]
    assert (b"grpc-status", b"0") in response.trailers
    assert grpc_pool.connection_count == 1, "the acks went on streams of the same connection"


def test_grpc_client_streaming_sends_while_nothing_comes_back(grpc_pool: H2PodPool) -> None:
    body = QueueBody()
    call = gevent.spawn(grpc_send, grpc_pool, "ClientStream", body)
    for index in range(3):
        body.put(grpc_frame(b"m%d" % index))

        def server_has_it(index: int = index) -> bool:
            return grpc_unary(grpc_pool, "Received", b"")[1] == [b"%d" % (index + 1)]

        eventually(server_has_it, f"the server receiving message {index}")
        assert not call.ready(), "no answer before the upload ended"
    body.end()
    response = call.get(timeout=BOUND)
    assert GrpcReader().feed(read_to_end(response)) == [b"m0,m1,m2"]
    assert (b"grpc-status", b"0") in response.trailers


def test_grpc_bidirectional_answers_each_message_while_the_upload_goes_on(grpc_pool: H2PodPool) -> None:
    body = QueueBody(grpc_frame(b"m0"))
    response = grpc_send(grpc_pool, "Bidi", body)  # the head comes with the first answer
    reader = GrpcReader()
    pieces = response.body()
    try:
        for index in range(4):
            messages: list[bytes] = []
            while not messages:
                messages = reader.feed(next(pieces))
            assert messages == [b"echo m%d" % index]
            if index < 3:
                body.put(grpc_frame(b"m%d" % (index + 1)))
        body.end()
        assert list(pieces) == []
    finally:
        response.close()
    assert (b"grpc-status", b"0") in response.trailers


# -- many streams -----------------------------------------------------------------------------------


def barrier(count: int) -> Callable[[PodRequest], None]:
    """A handler that answers (its path) only once ``count`` requests are in at once."""
    arrived = gevent.event.Event()
    seen: list[PodRequest] = []

    def handler(request: PodRequest) -> None:
        seen.append(request)
        if len(seen) == count:
            arrived.set()
        assert arrived.wait(BOUND), f"only {len(seen)} of {count} requests came at once"
        request.respond(200)
        request.send(request.path or b"", end=True)

    return handler


def test_many_concurrent_streams_share_one_connection(h2pod: PodFactory) -> None:
    count = 50
    pod, pool = h2pod(barrier(count))
    calls = [gevent.spawn(fetch, pool, target=b"/%d" % i) for i in range(count)]
    gevent.joinall(calls, timeout=BOUND, raise_error=True)
    assert [call.value[1] for call in calls] == [b"/%d" % i for i in range(count)]
    assert len(pod.connections) == 1
    assert (pool.connection_count, pool.stream_count) == (1, 0)


def test_a_second_connection_only_past_the_pods_stream_limit(h2pod: PodFactory) -> None:
    together = barrier(3)
    pod, pool = h2pod(by_path(first=answer(), **{str(i): together for i in range(3)}), max_concurrent_streams=2)
    fetch(pool, target=b"/first")  # the pod's SETTINGS are known from now on
    calls = [gevent.spawn(fetch, pool, target=b"/%d" % i) for i in range(3)]
    gevent.joinall(calls, timeout=BOUND, raise_error=True)
    assert len(pod.connections) == 2
    assert sorted(len(c.requests) for c in pod.connections) == [1, 3]
    eventually(lambda: pool.connection_count == 1, "one connection closing after the burst")
    eventually(lambda: [c.closed.is_set() for c in pod.connections].count(True) == 1, "the pod seeing it close")
    assert [c.goaway_received for c in pod.connections].count(True) == 1
    assert fetch(pool, target=b"/first")[0].head.status == 200 and len(pod.connections) == 2


# -- flow control ----------------------------------------------------------------------------------


def big_answer(size: int) -> Callable[[PodRequest], None]:
    def handler(request: PodRequest) -> None:
        request.respond(200)
        request.send(pattern(size), end=True)

    return handler


def test_a_slow_reader_holds_at_most_its_stream_window(h2pod: PodFactory) -> None:
    pod, pool = h2pod(big_answer(MiB), stream_window=SMALL_WINDOW)
    response = send(pool)
    (request,) = pod.requests
    eventually(lambda: response.buffered >= SMALL_WINDOW, "a whole window arriving")
    gevent.sleep(0.1)  # room for a client that handed the window back unread to get more (it must not)
    assert response.buffered == SMALL_WINDOW
    assert request.blocked.is_set() and not request.sent_all.is_set()
    data = b""
    for piece in response.body():
        data += piece
        gevent.sleep(0)  # a slow client of the proxy
    response.close()
    assert data == pattern(MiB)
    assert response.peak_buffered <= SMALL_WINDOW


def test_one_unread_stream_never_stalls_another(h2pod: PodFactory) -> None:
    pod, pool = h2pod(big_answer(MiB), stream_window=SMALL_WINDOW)
    unread = send(pool)
    eventually(lambda: pod.requests[0].blocked.is_set(), "the first stream filling its window")
    _, data = fetch(pool)  # the connection window does not hold it up
    assert data == pattern(MiB)
    assert read_to_end(unread) == pattern(MiB)
    assert len(pod.connections) == 1


def test_an_upload_keeps_to_the_pods_window(h2pod: PodFactory) -> None:
    released = gevent.event.Event()
    received: list[bytes] = []

    def handler(request: PodRequest) -> None:
        assert released.wait(BOUND)
        received.append(request.read_all())
        request.respond(200, end=True)

    pod, pool = h2pod(handler, hold_window=True, initial_window_size=16384)
    data = pattern(MiB)
    body = QueueBody(data, end=True)
    call = gevent.spawn(send, pool, "POST", b"/upload", body, length=len(data))
    eventually(lambda: pod.requests and len(pod.requests[0].body) == 16384, "the pod receiving one window")
    gevent.sleep(0.05)  # room for a client that broke the window to send more (it must not)
    assert len(pod.requests[0].body) == 16384
    assert not call.ready()
    released.set()
    assert read_to_end(call.get(timeout=BOUND)) == b""
    assert received == [data]


def test_a_pod_that_takes_no_upload_and_gives_no_answer_times_out(h2pod: PodFactory) -> None:
    pod, pool = h2pod(hold_until_reset, hold_window=True, initial_window_size=16384)
    body = QueueBody(pattern(MiB), end=True)
    with pytest.raises(UpstreamTimeout, match="took no request body"):
        send(pool, "POST", body=body, timeouts=Timeouts(connect=2.0, response_start=0.3))
    eventually(lambda: resets_of(pod) == [(1, ErrorCodes.CANCEL)], "the pod seeing the stream cancelled")


# -- a pod's failures ---------------------------------------------------------------------------------


def by_path(**handlers: Callable[[PodRequest], None]) -> Callable[[PodRequest], None]:
    """A handler choosing by path: ``/name`` runs ``handlers[name]``."""

    def handler(request: PodRequest) -> None:
        handlers[(request.path or b"/").decode()[1:]](request)

    return handler


def test_a_refused_connection_may_go_to_another_pod() -> None:
    sock = gsocket.socket(gsocket.AF_INET, gsocket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    pool = H2PodPool("127.0.0.1", port)
    with pytest.raises(UpstreamConnectError) as caught:
        send(pool)
    assert (caught.value.connected, caught.value.body_read) == (False, False)
    assert type(caught.value) is UpstreamConnectError and may_go_elsewhere(caught.value)
    assert pool.connection_count == 0


def test_a_pod_that_never_sends_its_settings_is_a_connect_error(h2pod: PodFactory) -> None:
    _, pool = h2pod(answer(), send_settings=False)
    with pytest.raises(UpstreamConnectError, match="SETTINGS") as caught:
        send(pool, timeouts=Timeouts(connect=0.3, response_start=5.0))
    assert type(caught.value) is UpstreamConnectError and may_go_elsewhere(caught.value)


def test_a_pod_that_takes_no_stream_on_any_connection_gets_no_storm_of_them(h2pod: PodFactory) -> None:
    pod, pool = h2pod(answer(), goaway_at_once=True)
    with pytest.raises(UpstreamConnectError, match="took no new stream") as caught:
        send(pool)
    assert may_go_elsewhere(caught.value)
    assert len(pod.connections) == CONNECTION_ATTEMPTS


def test_a_pod_that_does_not_speak_http2_is_a_bad_response() -> None:
    def http1_pod(conn: gsocket.socket, index: int) -> None:
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    pod = RawBackend(http1_pod)
    pool = H2PodPool("127.0.0.1", pod.port)
    try:
        with pytest.raises(UpstreamBadResponse) as caught:
            send(pool)
        assert may_go_elsewhere(caught.value), "nothing was sent: another pod may take it"
    finally:
        pool.close()
        pod.close()


def test_a_stream_reset_before_its_head_is_a_connect_error_and_others_go_on(h2pod: PodFactory) -> None:
    held = gevent.event.Event()

    def slow(request: PodRequest) -> None:
        assert held.wait(BOUND)
        request.respond(200)
        request.send(b"still here", end=True)

    pod, pool = h2pod(by_path(reset=lambda request: request.reset(ErrorCodes.INTERNAL_ERROR), slow=slow))
    other = gevent.spawn(fetch, pool, target=b"/slow")
    with pytest.raises(UpstreamConnectError, match="INTERNAL_ERROR") as caught:
        send(pool, target=b"/reset")
    assert caught.value.connected and not may_go_elsewhere(caught.value)
    held.set()
    assert other.get(timeout=BOUND)[1] == b"still here"
    assert len(pod.connections) == 1


def test_a_refused_stream_may_go_to_another_pod_unless_its_body_was_read(h2pod: PodFactory) -> None:
    def refuse(request: PodRequest) -> None:
        if request.header(b":method") == b"POST":
            request.wait_until(lambda: len(request.body) > 0)
        request.reset(ErrorCodes.REFUSED_STREAM)

    _, pool = h2pod(refuse)
    with pytest.raises(UpstreamConnectError, match="refused") as caught:
        send(pool)
    assert (caught.value.connected, caught.value.body_read) == (False, False)
    assert may_go_elsewhere(caught.value)
    with pytest.raises(UpstreamConnectError, match="refused") as caught:
        send(pool, "POST", body=QueueBody(b"data", end=True))
    assert (caught.value.connected, caught.value.body_read) == (False, True)
    assert not may_go_elsewhere(caught.value)


def test_a_stream_reset_mid_body_is_a_body_error(h2pod: PodFactory) -> None:
    def reset(request: PodRequest) -> None:
        request.respond(200)
        request.send(b"first")
        request.reset(ErrorCodes.INTERNAL_ERROR)

    pod, pool = h2pod(by_path(reset=reset, ok=answer(body=b"ok")))
    response = send(pool, target=b"/reset")
    data = b""
    with pytest.raises(UpstreamBodyError, match="INTERNAL_ERROR"):
        for piece in response.body():
            data += piece
    response.close()
    assert data == b"first"
    assert fetch(pool, target=b"/ok")[1] == b"ok"
    assert len(pod.connections) == 1, "the connection goes on"


def test_a_connection_closed_mid_stream_fails_each_stream_its_way(h2pod: PodFactory) -> None:
    def partial(request: PodRequest) -> None:
        request.respond(200)
        request.send(b"first")
        hold_until_reset(request)

    pod, pool = h2pod(by_path(partial=partial, silent=hold_until_reset, upload=hold_until_reset, ok=answer()))
    mid_body = send(pool, target=b"/partial")
    pieces = mid_body.body()
    assert next(pieces) == b"first"
    waiting = gevent.spawn(attempt, send, pool, target=b"/silent")
    uploading = gevent.spawn(attempt, send, pool, "POST", b"/upload", QueueBody(b"part"))
    eventually(lambda: len(pod.requests) == 3 and pod.requests[2].body, "the pod receiving all three")
    pod.connections[0].close()
    with pytest.raises(UpstreamBodyError):
        next(pieces)
    mid_body.close()
    error = connect_error(waiting)
    assert type(error) is UpstreamConnectError and (error.connected, error.body_read) == (True, False)
    error = connect_error(uploading)
    assert (error.connected, error.body_read) == (True, True)
    response, _ = fetch(pool, target=b"/ok")
    assert response.head.status == 200 and len(pod.connections) == 2


def test_goaway_sends_new_streams_elsewhere_and_lets_earlier_ones_finish(h2pod: PodFactory) -> None:
    release = gevent.event.Event()

    def handler(request: PodRequest) -> None:
        if request.path == b"/finishes":
            assert release.wait(BOUND)
            request.respond(200)
            request.send(b"finished", end=True)
        elif request.path == b"/new":
            request.respond(200)
            request.send(b"new connection", end=True)
        else:
            hold_until_reset(request)

    pod, pool = h2pod(handler)
    finishing = gevent.spawn(fetch, pool, target=b"/finishes")
    refused = gevent.spawn(attempt, send, pool, target=b"/never-seen")
    eventually(lambda: len(pod.requests) == 2, "the pod receiving both streams")
    first = pod.connections[0]
    first.goaway(last_stream_id=1)
    error = connect_error(refused)
    assert "GOAWAY" in str(error) and may_go_elsewhere(error)
    _, data = fetch(pool, target=b"/new")
    assert data == b"new connection"
    assert len(pod.connections) == 2 and pod.requests[-1].connection is pod.connections[1]
    release.set()
    assert finishing.get(timeout=BOUND)[1] == b"finished"
    eventually(first.closed.is_set, "the old connection closing after its last stream")
    assert first.goaway_received
    assert pool.connection_count == 1


def test_a_response_h2_refuses_is_a_bad_response(h2pod: PodFactory) -> None:
    def handler(request: PodRequest) -> None:
        request.respond(200, [(b"X-Upper", b"not allowed in HTTP/2")], end=True)

    _, pool = h2pod(handler)
    with pytest.raises(UpstreamBadResponse) as caught:
        send(pool)
    assert caught.value.connected and not may_go_elsewhere(caught.value)
    assert pool.connection_count == 0


def test_a_malformed_status_is_a_bad_response(h2pod: PodFactory) -> None:
    def handler(request: PodRequest) -> None:
        if request.path == b"/bad":
            request.connection.send_headers(request.stream_id, [(b":status", b"2x0")], False)
        else:
            answer()(request)

    pod, pool = h2pod(handler)
    with pytest.raises(UpstreamBadResponse, match=":status"):
        send(pool, target=b"/bad")
    eventually(lambda: resets_of(pod) == [(1, ErrorCodes.PROTOCOL_ERROR)], "the pod seeing the stream reset")
    assert fetch(pool)[0].head.status == 200
    assert len(pod.connections) == 1, "the connection goes on"


# -- deadlines -----------------------------------------------------------------------------------------


def test_no_head_within_response_start_is_a_timeout_and_the_connection_stays(h2pod: PodFactory) -> None:
    pod, pool = h2pod(by_path(silent=hold_until_reset, ok=answer()))
    with pytest.raises(UpstreamTimeout, match="no response head"):
        send(pool, target=b"/silent", timeouts=Timeouts(connect=2.0, response_start=0.3))
    eventually(lambda: resets_of(pod) == [(1, ErrorCodes.CANCEL)], "the pod seeing the stream cancelled")
    assert fetch(pool, target=b"/ok")[0].head.status == 200
    assert len(pod.connections) == 1


def test_response_start_runs_from_the_end_of_the_upload(h2pod: PodFactory) -> None:
    _, pool = h2pod(answer(body=b"done"))
    body = QueueBody(b"one")

    def slow_client() -> None:
        for piece in (b"two", b"three"):
            gevent.sleep(0.4)  # the whole upload takes longer than response_start
            body.put(piece)
        body.end()

    client = gevent.spawn(slow_client)
    response, data = fetch(pool, "POST", b"/", body, timeouts=Timeouts(connect=2.0, response_start=0.5))
    client.get()
    assert (response.head.status, data) == (200, b"done")


def test_total_bounds_the_wait_for_the_head_while_the_body_streams(h2pod: PodFactory) -> None:
    pod, pool = h2pod(hold_until_reset)
    with pytest.raises(UpstreamTimeout, match="did not answer within"):
        send(pool, "POST", body=QueueBody(b"never ends"), timeouts=Timeouts(2.0, 5.0, total=0.3))
    eventually(lambda: resets_of(pod) == [(1, ErrorCodes.CANCEL)], "the pod seeing the stream cancelled")


def silent_after_first_piece(request: PodRequest) -> None:
    request.respond(200)
    request.send(b"first")
    hold_until_reset(request)


@pytest.mark.parametrize(
    ("timeouts", "error"),
    [
        (Timeouts(2.0, 5.0, idle=0.3), UpstreamIdle),
        (Timeouts(2.0, 5.0, total=0.5), UpstreamBodyTimeout),
    ],
)
def test_silence_mid_body(h2pod: PodFactory, timeouts: Timeouts, error: type[UpstreamBodyError]) -> None:
    pod, pool = h2pod(silent_after_first_piece)
    response = send(pool, timeouts=timeouts)
    pieces = response.body()
    assert next(pieces) == b"first"
    with pytest.raises(error):
        next(pieces)
    response.close()
    eventually(lambda: resets_of(pod) == [(1, ErrorCodes.CANCEL)], "the pod seeing the stream cancelled")


# -- the request body -------------------------------------------------------------------------------


def test_a_client_body_that_fails_is_raised_and_the_stream_cancelled(h2pod: PodFactory) -> None:
    pod, pool = h2pod(hold_until_reset)
    body = QueueBody(b"part")
    call = gevent.spawn(attempt, send, pool, "POST", b"/", body)
    eventually(lambda: pod.requests and pod.requests[0].body == b"part", "the pod receiving the first piece")
    body.fail(ClientGone("the client left mid-body"))
    assert isinstance(call.get(timeout=BOUND), ClientGone)
    eventually(lambda: resets_of(pod) == [(1, ErrorCodes.CANCEL)], "the pod seeing the stream cancelled")


def test_the_pump_stops_when_the_response_ends_first(h2pod: PodFactory) -> None:
    def early(request: PodRequest) -> None:
        request.respond(200)
        request.send(b"not waiting for it", end=True)

    pod, pool = h2pod(early)
    body = QueueBody(b"part")
    response, data = fetch(pool, "POST", b"/", body)
    assert (data, response.early) == (b"not waiting for it", False)
    assert body.waiting == 0, "the pump still reads the client's body"
    eventually(lambda: resets_of(pod) == [(1, ErrorCodes.CANCEL)], "the pod seeing the stream cancelled")


def test_an_empty_length_body_ends_with_the_headers(h2pod: PodFactory) -> None:
    pod, pool = h2pod(answer())
    fetch(pool, "POST", b"/", QueueBody(end=True), length=0)
    (request,) = pod.requests
    assert request.header(b"content-length") == b"0" and request.ended.is_set()


# -- the pool -----------------------------------------------------------------------------------------


def test_close_ends_the_idle_connection_and_later_requests_still_work(h2pod: PodFactory) -> None:
    pod, pool = h2pod(answer(body=b"ok"))
    fetch(pool)
    pool.close()
    eventually(pod.connections[0].closed.is_set, "the idle connection closing")
    assert pod.connections[0].goaway_received
    assert fetch(pool)[1] == b"ok"
    eventually(lambda: len(pod.connections) == 2 and pod.connections[1].closed.is_set(), "the later one closing")
    assert pool.connection_count == 0


def test_close_lets_a_running_stream_finish_then_ends_its_connection(h2pod: PodFactory) -> None:
    release = gevent.event.Event()

    def handler(request: PodRequest) -> None:
        assert release.wait(BOUND)
        answer(body=b"finished")(request)

    pod, pool = h2pod(handler)
    call = gevent.spawn(fetch, pool)
    eventually(lambda: pod.requests, "the pod receiving the request")
    pool.close()
    assert not pod.connections[0].closed.is_set()
    release.set()
    assert call.get(timeout=BOUND)[1] == b"finished"
    eventually(pod.connections[0].closed.is_set, "the connection closing after its stream")
    assert pool.connection_count == 0


def test_abort_cancels_the_stream_and_the_connection_stays(h2pod: PodFactory) -> None:
    pod, pool = h2pod(big_answer(MiB), stream_window=SMALL_WINDOW)
    response = send(pool)
    response.abort()
    eventually(lambda: resets_of(pod) == [(1, ErrorCodes.CANCEL)], "the pod seeing the stream cancelled")
    assert fetch(pool)[1] == pattern(MiB)
    assert len(pod.connections) == 1


def test_the_load_an_h2c_pod_announces_is_read_from_its_head(h2pod: PodFactory) -> None:
    """The proxy reads ORCA's header from ``response.head`` whichever client made it."""
    _, pool = h2pod(
        answer(headers=[(b"endpoint-load-metrics", b"TEXT cpu_utilization=0.4, named_metrics.max_concurrency=2")])
    )
    response, _ = fetch(pool)
    head = response.head
    assert reading_in_head(head.headers, head.lower_names, "cpu_utilization") == LoadReading(0.4, 2)

"""The HTTP/2 server side (``activator.front.http2``) against real clients on 127.0.0.1.

What is tested: the request head as the proxy sees it (``ClientExchange``), bodies of
known and unknown length, concurrent streams each in its own greenlet (a blocked one
holds up no other), flow control both ways (a client that does not read one stream, a
body larger than the window that nobody reads yet), trailers both ways, 1xx, a stream
reset or a connection lost while the application waits, ``wait_for_body``, activator's
own answers (plain and gRPC-shaped), refusals that keep the connection, the limits
(header list, body, idle connection, body stall, a client that gives no window), the
bound on stream greenlets, protocol errors (GOAWAY with h2's code), the graceful stop,
TLS (the GOAWAYs stay inside TLS), real clients (curl, nghttp, grpcio), and the engine's
wiring (preface detection, WSGI environ).

How: a real ``H2ServerConnection`` per accepted connection (``h2_helpers.H2Server``) runs
a ``call_app`` written here, which drives the exchange directly as the proxy does; the
client is the ``h2`` library over a real socket (``h2_helpers.H2Client``), or a real
client program or library. The
session is not monkey-patched: gevent sockets and primitives only. Orderings are proved
by events (a stream finishes while another is blocked on a test event), never by time;
a timeout here only bounds a wait so that a bug shows as a failure instead of a hang.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gevent
import gevent.event
import gevent.subprocess
import pytest
from gevent import socket as gsocket
from h2.config import H2Configuration
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from h2_helpers import BOUND, H2Client, H2Server, Stream, eventually, listener, make_limits, tls_contexts

from activator.core import http
from activator.core.config import LimitsConfig
from activator.core.errors import (
    ActivatorError,
    BodyTooLarge,
    ClientGone,
    ClientTimeout,
    QueueFull,
    ShuttingDown,
    UnknownHost,
    UpstreamTimeout,
)
from activator.core.heads import BodyFraming, Header, RequestHead
from activator.front.engine import HttpServer
from activator.front.http2 import STREAM_WINDOW, H2Exchange, H2ServerConnection

#: Seconds after which a whole test counts as hung (each takes well under one, or two with a linger).
TEST_BOUND = 20.0
#: A client_timeout for the tests that wait for one to pass.
SHORT = 0.3
MiB = 1024 * 1024

Handler = Callable[[H2Exchange], None]


def pattern(n: int) -> bytes:
    """n deterministic bytes (not all alike, so misplaced bytes show in a hash)."""
    block = bytes(range(256)) * 256
    return (block * (n // len(block) + 1))[:n]


def sha(data: bytes | bytearray) -> bytes:
    return hashlib.sha256(data).hexdigest().encode()


def read_all(exchange: H2Exchange) -> bytes:
    return b"".join(iter(exchange.read, b""))


def respond(
    exchange: H2Exchange,
    body: bytes = b"",
    status: int = 200,
    headers: tuple[Header, ...] = (),
    trailers: tuple[Header, ...] = (),
    framing: BodyFraming | None = None,
) -> None:
    """Answer as the proxy relays a pod's answer: start, write, finish."""
    if framing is None:
        framing = BodyFraming.CHUNKED if trailers else BodyFraming.LENGTH
    lines = list(headers)
    if framing is BodyFraming.LENGTH:
        lines.append((b"Content-Length", b"%d" % len(body)))
    exchange.start(status, b"OK", lines, framing)
    if body:
        exchange.write(body)
    exchange.finish(trailers)


class App:
    """The ``call_app`` of the tests: the handler for the request's path drives the exchange.

    Like the engine and the proxy: an ``ActivatorError`` from a handler becomes
    activator's own answer, ``ClientGone`` goes on up (the connection's stream runner
    takes it), and a response the handler left open is finished. Every exchange the
    application saw is kept, and what each handler raised.
    """

    def __init__(self, routes: dict[bytes, Handler]) -> None:
        self.routes = routes
        self.seen: list[H2Exchange] = []
        self.raised: dict[int, BaseException] = {}

    def __call__(self, exchange: H2Exchange) -> None:
        self.seen.append(exchange)
        handler = self.routes[exchange.head.target.partition(b"?")[0]]
        try:
            handler(exchange)
        except ClientGone as error:
            self.raised[exchange.stream_id] = error
            raise
        except ActivatorError as error:
            self.raised[exchange.stream_id] = error
            exchange.answer(error)
        if not exchange.finished:
            exchange.finish()

    def exchange(self, stream_id: int) -> H2Exchange:
        return next(exchange for exchange in self.seen if exchange.stream_id == stream_id)


def wait_for(event: gevent.event.Event) -> None:
    assert event.wait(BOUND), "the application never got there"


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def hang_is_failure() -> Iterator[None]:
    with gevent.Timeout(TEST_BOUND, AssertionError(f"the test was still waiting after {TEST_BOUND}s")):
        yield


@pytest.fixture(autouse=True)
def no_greenlet_died(capsys: pytest.CaptureFixture[str]) -> Iterator[None]:
    """A greenlet that dies of an exception is printed by gevent's hub: a test fails on it."""
    yield
    gevent.sleep(0)
    assert "Traceback" not in capsys.readouterr().err


@pytest.fixture
def start() -> Iterator[Callable[..., tuple[H2Server, App]]]:
    """``start(routes, max_streams=..., **limits) -> (server, app)``; everything closed at teardown."""
    servers: list[H2Server] = []

    def make(
        routes: dict[bytes, Handler], max_streams: int | None = None, tls: Any = None, **limits: Any
    ) -> tuple[H2Server, App]:
        app = App(routes)
        server = H2Server(app, make_limits(max_streams, **limits), tls)
        servers.append(server)
        return server, app

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def clients() -> Iterator[Callable[..., H2Client]]:
    made: list[H2Client] = []

    def make(server: H2Server, **options: Any) -> H2Client:
        client = H2Client(server.address, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def ok(exchange: H2Exchange) -> None:
    respond(exchange, b"ok")


# -- pure pieces -----------------------------------------------------------------------------


def test_header_list_size_counts_as_rfc_9113() -> None:
    assert RequestHead.from_h2([], True).list_size == 0
    assert RequestHead.from_h2([(b":path", b"/"), (b"a", b"bc")], True).list_size == (5 + 1 + 32) + (1 + 2 + 32)


@pytest.mark.parametrize(
    ("given", "sent"),
    [
        ([(b"Content-Type", b"text/plain")], [(b"content-type", b"text/plain")]),
        ([(b"Connection", b"close"), (b"X-A", b"1")], [(b"x-a", b"1")]),
        ([(b"transfer-encoding", b"chunked"), (b"keep-alive", b"5"), (b"upgrade", b"h2c")], []),
        ([(b"Proxy-Connection", b"x"), (b"TE", b"trailers"), (b"set-cookie", b"a"), (b"Set-Cookie", b"b")],
         [(b"set-cookie", b"a"), (b"set-cookie", b"b")]),
        ([(b":status", b"200"), (b"content-length", b"3")], [(b"content-length", b"3")]),
    ],
)  # fmt: skip
def test_response_fields_are_lower_case_without_connection_specific_lines(
    given: list[Header], sent: list[Header]
) -> None:
    assert http.h2_response_fields(given) == sent


# -- requests and answers --------------------------------------------------------------------


def test_get_the_head_as_the_proxy_sees_it(start: Any, clients: Any) -> None:
    def handler(exchange: H2Exchange) -> None:
        respond(
            exchange,
            b"hello",
            headers=((b"X-Pod", b"one"), (b"Connection", b"close"), (b"Keep-Alive", b"5"), (b"x-pod", b"two")),
        )

    server, app = start({b"/path": handler})
    client = clients(server)
    stream_id = client.request(
        b"/path?q=1",
        headers=[(b"x-one", b"1"), (b"x-activator-forwarded", b"peer a"), (b"x-one", b"2"), (b"cookie", b"c=1")],
    )
    answer = client.response(stream_id)

    exchange = app.exchange(stream_id)
    assert (exchange.head.method, exchange.head.target, exchange.head.version) == ("GET", b"/path?q=1", "2")
    assert exchange.head.headers == [
        (b"host", exchange.head.hosts[0]),  # :authority, for a pod spoken to in HTTP/1.1
        (b"x-one", b"1"),
        (b"x-activator-forwarded", b"peer a"),
        (b"x-one", b"2"),
        (b"cookie", b"c=1"),
    ]
    assert exchange.head.lower_names == [b"host", b"x-one", b"x-activator-forwarded", b"x-one", b"cookie"]
    assert exchange.head.hosts == [b"test.example"]
    assert exchange.head.host == "test.example"
    assert exchange.head.framing is BodyFraming.NONE
    assert exchange.head.content_length is None
    assert exchange.head.forwarded == [b"peer a"]
    assert not exchange.head.connection_values
    assert not exchange.head.upgrade
    assert exchange.client_ip == "127.0.0.1"
    assert exchange.client_ip_bytes == b"127.0.0.1"
    assert exchange.scheme_bytes == b"http"

    assert answer.status == 200
    assert answer.headers == [
        (b":status", b"200"),
        (b"x-pod", b"one"),
        (b"x-pod", b"two"),
        (b"content-length", b"5"),
    ]
    assert bytes(answer.data) == b"hello"
    assert answer.ended and answer.reset is None
    assert exchange.finished and exchange.status == 200 and exchange.bytes_sent == 5
    assert not exchange.was_cut


def test_host_header_when_there_is_no_authority(start: Any, clients: Any) -> None:
    server, app = start({b"/": ok})
    client = clients(server)
    stream_id = client.request(b"/", headers=[(b"host", b"other.example:8080")], authority=None)
    assert client.response(stream_id).status == 200
    assert app.exchange(stream_id).head.host == "other.example:8080"


def test_bodiless_answer_is_one_headers_frame(start: Any, clients: Any) -> None:
    def no_content(exchange: H2Exchange) -> None:
        exchange.start(204, b"No Content", [(b"x-a", b"1")], BodyFraming.NONE)
        exchange.finish()

    server, _ = start({b"/": no_content})
    client = clients(server)
    answer = client.response(client.request(b"/"))
    assert answer.status == 204
    assert answer.head_ended_stream
    assert not answer.data and answer.trailers is None


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "unknown-length"])
def test_post_body_arrives_whole(start: Any, clients: Any, declared: bool) -> None:
    body = pattern(3 * STREAM_WINDOW + 12345)  # beyond the window: it reopens as it is read

    def echo_digest(exchange: H2Exchange) -> None:
        data = read_all(exchange)
        respond(exchange, sha(data) + b" %d" % exchange.body_bytes)

    server, app = start({b"/upload": echo_digest})
    client = clients(server)
    headers = [(b"content-length", b"%d" % len(body))] if declared else []
    stream_id = client.request(b"/upload", b"POST", headers, body=body)
    answer = client.response(stream_id)

    assert bytes(answer.data) == sha(body) + b" %d" % len(body)
    exchange = app.exchange(stream_id)
    assert exchange.head.framing is (BodyFraming.LENGTH if declared else BodyFraming.CHUNKED)
    assert exchange.head.content_length == (len(body) if declared else None)
    assert exchange.buffered_bytes == 0


def test_request_trailers_reach_the_exchange_and_response_trailers_the_client(start: Any, clients: Any) -> None:
    def grpc_like(exchange: H2Exchange) -> None:
        data = read_all(exchange)
        respond(
            exchange,
            data[::-1],
            headers=((b"content-type", b"application/grpc"), (b"Trailer", b"grpc-status")),
            trailers=((b"grpc-status", b"0"), (b"Grpc-Message", b"fine"), (b"Connection", b"x")),
        )

    server, app = start({b"/rpc": grpc_like})
    client = clients(server)
    stream_id = client.request(
        b"/rpc", b"POST", [(b"content-type", b"application/grpc"), (b"te", b"trailers")], end_stream=False
    )
    client.send_body(stream_id, b"abc", end=False)
    client.send_trailers(stream_id, [(b"x-checksum", b"42"), (b"x-more", b"yes")])
    answer = client.response(stream_id)

    assert app.exchange(stream_id).trailers == [(b"x-checksum", b"42"), (b"x-more", b"yes")]
    assert bytes(answer.data) == b"cba"
    assert answer.trailers == [(b"grpc-status", b"0"), (b"grpc-message", b"fine")]
    assert answer.ended


def test_interim_answers_come_first_and_100_is_never_relayed(start: Any, clients: Any) -> None:
    def early_hints(exchange: H2Exchange) -> None:
        exchange.interim(100, b"Continue", [])
        exchange.interim(103, b"Early Hints", [(b"Link", b"</style.css>; rel=preload"), (b"Connection", b"x")])
        respond(exchange, b"page")
        exchange.interim(103, b"Early Hints", [(b"link", b"</late>")])  # after the final one: nothing

    server, _ = start({b"/": early_hints})
    client = clients(server)
    answer = client.response(client.request(b"/"))
    assert answer.informational == [[(b":status", b"103"), (b"link", b"</style.css>; rel=preload")]]
    assert answer.status == 200
    assert bytes(answer.data) == b"page"


def test_expect_100_continue_is_answered_when_the_body_is_first_read(start: Any, clients: Any) -> None:
    reading = gevent.event.Event()

    def upload(exchange: H2Exchange) -> None:
        reading.set()
        respond(exchange, read_all(exchange))

    server, _ = start({b"/": upload})
    client = clients(server)
    stream_id = client.request(b"/", b"POST", [(b"expect", b"100-continue")], end_stream=False)
    client.until(lambda: bool(client.streams[stream_id].informational))
    assert reading.is_set()
    assert client.streams[stream_id].informational == [[(b":status", b"100")]]
    client.send_body(stream_id, b"body")
    assert bytes(client.response(stream_id).data) == b"body"


# -- concurrency and flow control ----------------------------------------------------------------


def test_every_stream_runs_in_its_own_greenlet_and_a_blocked_one_delays_no_other(start: Any, clients: Any) -> None:
    release = gevent.event.Event()
    blocked = gevent.event.Event()
    greenlets: dict[int, object] = {}

    def slow(exchange: H2Exchange) -> None:
        greenlets[exchange.stream_id] = gevent.getcurrent()
        blocked.set()
        release.wait()
        respond(exchange, b"slow")

    def fast(exchange: H2Exchange) -> None:
        greenlets[exchange.stream_id] = gevent.getcurrent()
        respond(exchange, b"fast %d" % exchange.stream_id)

    server, _ = start({b"/slow": slow, b"/fast": fast})
    client = clients(server)
    slow_id = client.request(b"/slow")
    wait_for(blocked)
    fast_ids = [client.request(b"/fast") for _ in range(20)]
    for stream_id in fast_ids:
        assert bytes(client.response(stream_id).data) == b"fast %d" % stream_id
    assert not client.streams[slow_id].done  # the slow one is still blocked on the test's event
    release.set()
    assert bytes(client.response(slow_id).data) == b"slow"
    assert len(set(map(id, greenlets.values()))) == 21


def test_a_client_that_does_not_read_one_stream_holds_up_no_other(start: Any, clients: Any) -> None:
    big = pattern(MiB)
    writing = gevent.event.Event()

    def download(exchange: H2Exchange) -> None:
        writing.set()
        respond(exchange, big, framing=BodyFraming.CHUNKED)

    server, app = start({b"/big": download, b"/small": ok})
    client = clients(server)  # its stream windows: the default 65535 bytes
    held = client.request(b"/big")
    client.hold(held)
    client.until(lambda: len(client.streams[held].data) == 65535)  # the whole window, and no more
    exchange = app.exchange(held)
    assert not exchange.finished and exchange.bytes_sent < len(big)

    other = client.request(b"/small")
    assert bytes(client.response(other).data) == b"ok"
    assert len(client.streams[held].data) == 65535 and not client.streams[held].done

    client.release(held)
    answer = client.response(held)
    assert sha(answer.data) == sha(big)
    assert exchange.bytes_sent == len(big)


def test_a_body_nobody_reads_yet_stays_within_the_stream_window(start: Any, clients: Any) -> None:
    body = pattern(4 * STREAM_WINDOW)
    other_body = pattern(300 * 1024)
    go = gevent.event.Event()

    def queued(exchange: H2Exchange) -> None:
        go.wait()  # like a request waiting for its slot
        respond(exchange, sha(read_all(exchange)))

    def reader(exchange: H2Exchange) -> None:
        respond(exchange, sha(read_all(exchange)))

    server, app = start({b"/queued": queued, b"/read": reader})
    client = clients(server)
    waiting = client.request(b"/queued", b"POST", end_stream=False)
    sent = client.send_what_fits(waiting, body)
    assert sent == STREAM_WINDOW  # what the server's window allows, and the client cannot send more
    client.sync()  # the server has processed all of it
    exchange = app.exchange(waiting)
    assert exchange.buffered_bytes == sent
    assert exchange.body_bytes == sent

    # Another stream's body, larger than the connection's default window, goes through meanwhile.
    other = client.request(b"/read", b"POST", body=other_body)
    assert bytes(client.response(other).data) == sha(other_body)
    client.sync()
    assert exchange.buffered_bytes == STREAM_WINDOW
    assert client.streams[waiting].window_updates == 0  # nothing was given back before the application read

    go.set()
    client.send_body(waiting, body[sent:])
    assert bytes(client.response(waiting).data) == sha(body)
    assert client.streams[waiting].window_updates > 0
    assert exchange.buffered_bytes == 0


def test_a_client_that_gives_no_window_for_client_timeout_gets_its_stream_cancelled(start: Any, clients: Any) -> None:
    server, app = start({b"/big": lambda exchange: respond(exchange, pattern(MiB))}, client_timeout=SHORT)
    client = clients(server)
    stream_id = client.request(b"/big")
    client.hold(stream_id)
    answer = client.response(stream_id)
    assert answer.reset == ErrorCodes.CANCEL
    assert isinstance(app.raised[stream_id], ClientGone)
    assert app.exchange(stream_id).was_cut
    assert bytes(answer.data) == pattern(65535)


# -- clients that leave -------------------------------------------------------------------------


def test_a_reset_stream_tells_its_watchers_and_fails_its_reads_others_go_on(start: Any, clients: Any) -> None:
    waiting = gevent.event.Event()
    failed = gevent.event.Event()
    release = gevent.event.Event()
    calls: list[int] = []

    def wait_for_body(exchange: H2Exchange) -> None:
        assert exchange.watch_gone(lambda: calls.append(exchange.stream_id))
        assert not exchange.client_gone()
        waiting.set()
        try:
            exchange.read()
        finally:
            failed.set()

    def later(exchange: H2Exchange) -> None:
        release.wait()
        respond(exchange, b"still here")

    server, app = start({b"/wait": wait_for_body, b"/later": later})
    client = clients(server)
    other = client.request(b"/later")
    stream_id = client.request(b"/wait", b"POST", end_stream=False)
    wait_for(waiting)
    client.reset(stream_id)
    wait_for(failed)

    assert calls == [stream_id]
    assert isinstance(app.raised[stream_id], ClientGone)
    exchange = app.exchange(stream_id)
    assert exchange.client_gone() and exchange.was_cut
    assert not exchange.watch_gone(lambda: None)  # gone already
    release.set()
    assert bytes(client.response(other).data) == b"still here"


def test_a_lost_connection_is_every_stream_gone(start: Any, clients: Any) -> None:
    waiting = gevent.event.Event()
    failed = gevent.event.Event()
    calls: list[int] = []

    def wait_for_body(exchange: H2Exchange) -> None:
        exchange.watch_gone(lambda: calls.append(exchange.stream_id))
        waiting.set()
        try:
            exchange.read()
        finally:
            failed.set()

    server, app = start({b"/wait": wait_for_body})
    client = clients(server)
    stream_id = client.request(b"/wait", b"POST", end_stream=False)
    wait_for(waiting)
    client.close()
    wait_for(failed)
    assert calls == [stream_id]
    assert isinstance(app.raised[stream_id], ClientGone)
    gevent.joinall(server.serving, timeout=BOUND)
    assert all(greenlet.dead for greenlet in server.serving)


def test_wait_for_body_wakes_for_body_data_for_the_pod_and_times_out(start: Any, clients: Any) -> None:
    first_wait = gevent.event.Event()
    second_wait = gevent.event.Event()
    pod, pod_peer = gsocket.socketpair()
    outcomes: list[object] = []

    def relay(exchange: H2Exchange) -> None:
        first_wait.set()
        outcomes.append(exchange.wait_for_body(pod.fileno(), BOUND))  # the client sends first
        outcomes.append(exchange.read())
        second_wait.set()
        outcomes.append(exchange.wait_for_body(pod.fileno(), BOUND))  # the pod speaks first
        outcomes.append(pod.recv(10))
        try:
            exchange.wait_for_body(pod.fileno(), SHORT)  # nobody speaks
        except ClientTimeout as error:
            outcomes.append(error)
        respond(exchange, b"done")

    server, _ = start({b"/relay": relay})
    client = clients(server)
    stream_id = client.request(b"/relay", b"POST", end_stream=False)
    wait_for(first_wait)
    client.send_body(stream_id, b"piece", end=False)
    wait_for(second_wait)
    pod_peer.sendall(b"pod")
    assert bytes(client.response(stream_id).data) == b"done"
    assert outcomes[:4] == [False, b"piece", True, b"pod"]
    assert isinstance(outcomes[4], ClientTimeout)
    pod.close()
    pod_peer.close()


# -- activator's own answers and refusals ---------------------------------------------------------


def refuse(error: ActivatorError) -> Handler:
    def handler(exchange: H2Exchange) -> None:
        raise error

    return handler


def test_own_answer_is_plain_text_with_its_reason(start: Any, clients: Any) -> None:
    server, _ = start({b"/full": refuse(QueueFull())})
    client = clients(server)
    answer = client.response(client.request(b"/full"))
    assert answer.status == 503
    assert answer.header(b"x-activator-reason") == b"queue-full"
    assert answer.header(b"retry-after") == b"1"
    assert answer.header(b"content-type") == b"text/plain; charset=utf-8"
    assert bytes(answer.data) == b"503 queue-full\n"
    assert int(answer.header(b"content-length") or b"-1") == len(answer.data)


@pytest.mark.parametrize(
    "error",
    [QueueFull(), ShuttingDown(), UnknownHost(), UpstreamTimeout(), BodyTooLarge()],
    ids=lambda error: error.reason,
)
def test_own_answer_to_a_grpc_request_is_trailers_only(start: Any, clients: Any, error: ActivatorError) -> None:
    server, app = start({b"/svc/Method": refuse(error)})
    client = clients(server)
    stream_id = client.request(
        b"/svc/Method", b"POST", [(b"content-type", b"application/grpc+proto"), (b"te", b"trailers")], body=b"\0"
    )
    answer = client.response(stream_id)
    assert answer.head_ended_stream  # one HEADERS frame with END_STREAM: no DATA, no second HEADERS
    assert not answer.data and answer.trailers is None
    assert answer.status == 200
    assert answer.header(b"content-type") == b"application/grpc"
    assert answer.header(b"grpc-status") == b"%d" % http.grpc_status(error)
    assert answer.header(b"grpc-message")
    assert answer.header(b"x-activator-reason") == error.reason.encode()
    assert app.exchange(stream_id).status == 200


@pytest.mark.parametrize(
    ("fields", "status", "reason"),
    [
        ([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b":authority", b"bad host")],
         400, b"bad-host"),
        ([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b":authority", b"user@host")],
         400, b"bad-host"),
        ([(b":method", b"CONNECT"), (b":authority", b"elsewhere:443")], 400, b"bad-request-target"),
        ([(b":method", b"CONNECT"), (b":protocol", b"websocket"), (b":scheme", b"http"), (b":path", b"/chat"),
          (b":authority", b"test.example")], 400, b"bad-request-target"),
        ([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"http://elsewhere/"),
          (b":authority", b"test.example")], 400, b"bad-request-target"),
        ([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"*"), (b":authority", b"test.example")],
         400, b"bad-request-target"),
        ([(b":method", b"GE T"), (b":scheme", b"http"), (b":path", b"/"), (b":authority", b"test.example")],
         400, b"bad-request"),
        ([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/a b"), (b":authority", b"test.example")],
         400, b"bad-request"),
    ],
    ids=["space-in-host", "userinfo", "connect", "extended-connect", "absolute-form", "asterisk-not-options",
         "method-not-a-token", "space-in-path"],
)  # fmt: skip
def test_refused_heads_are_answered_on_their_stream_and_the_connection_goes_on(
    start: Any, clients: Any, fields: list[Header], status: int, reason: bytes
) -> None:
    server, app = start({b"/": ok})
    client = clients(server)
    refused = client.response(client.raw_request(fields, end_stream=fields[0][1] != b"CONNECT"))
    assert refused.status == status
    assert refused.header(b"x-activator-reason") == reason
    assert app.seen == []  # the application never ran
    assert bytes(client.response(client.request(b"/")).data) == b"ok"


def test_options_asterisk_is_a_target(start: Any, clients: Any) -> None:
    server, app = start({b"*": ok})
    client = clients(server)
    assert client.response(client.request(b"*", b"OPTIONS")).status == 200
    assert app.seen[0].head.target == b"*"


# -- limits -----------------------------------------------------------------------------------


def test_the_header_list_limit_is_advertised_and_a_larger_block_gets_431_on_its_stream(
    start: Any, clients: Any
) -> None:
    server, app = start({b"/": ok}, max_header_bytes=4096)
    client = clients(server)
    assert client.h2.remote_settings.max_header_list_size == 4096
    assert client.h2.remote_settings.max_concurrent_streams == 256
    assert client.h2.remote_settings.initial_window_size == STREAM_WINDOW
    fits = client.request(b"/", headers=[(b"x-big", b"a" * 3000)])
    assert client.response(fits).status == 200
    too_large = client.response(client.request(b"/", headers=[(b"x-big", b"a" * 5000)]))
    assert (too_large.status, too_large.header(b"x-activator-reason")) == (431, b"headers-too-large")
    assert client.response(client.request(b"/")).status == 200  # the connection goes on
    assert len(app.seen) == 2


def test_a_header_block_over_four_times_the_limit_ends_the_connection(start: Any, clients: Any) -> None:
    server, app = start({b"/": ok}, max_header_bytes=4096)
    client = clients(server)
    client.request(b"/", headers=[(b"x-big", b"a" * 17000)])
    client.until_closed()
    assert [goaway.error_code for goaway in client.goaways] == [ErrorCodes.ENHANCE_YOUR_CALM]
    assert app.seen == []


def test_a_large_header_block_before_the_settings_are_acknowledged_gets_431(start: Any, clients: Any) -> None:
    server, app = start({b"/": ok}, max_header_bytes=4096)
    client = clients(server, handshake=False)  # the request goes out before the server's SETTINGS are read
    too_large = client.request(b"/", headers=[(b"x-big", b"a" * 5000)])
    answer = client.response(too_large)
    assert answer.status == 431
    assert answer.header(b"x-activator-reason") == b"headers-too-large"
    assert app.seen == []
    assert client.response(client.request(b"/")).status == 200


def test_a_declared_body_over_the_limit_is_refused_before_the_application_runs(start: Any, clients: Any) -> None:
    server, app = start({b"/": ok}, max_body_bytes=1000)
    client = clients(server)
    stream_id = client.request(b"/", b"POST", [(b"content-length", b"5000")], end_stream=False)
    answer = client.response(stream_id)
    assert answer.status == 413
    assert answer.header(b"x-activator-reason") == b"body-too-large"
    client.until(lambda: client.streams[stream_id].reset is not None)
    assert client.streams[stream_id].reset == ErrorCodes.NO_ERROR  # "stop sending": the answer is complete
    assert app.seen == []
    assert client.response(client.request(b"/")).status == 200


def test_a_body_of_unknown_length_that_grows_over_the_limit_fails_its_read(start: Any, clients: Any) -> None:
    def upload(exchange: H2Exchange) -> None:
        respond(exchange, read_all(exchange))

    server, app = start({b"/": upload}, max_body_bytes=1000)
    client = clients(server)
    stream_id = client.request(b"/", b"POST", body=pattern(3000))
    answer = client.response(stream_id)
    assert answer.status == 413
    assert isinstance(app.raised[stream_id], BodyTooLarge)
    assert client.response(client.request(b"/", b"POST", body=pattern(1000))).data == pattern(1000)


def test_a_body_that_stalls_for_client_timeout_fails_its_read(start: Any, clients: Any) -> None:
    def upload(exchange: H2Exchange) -> None:
        respond(exchange, read_all(exchange))

    server, app = start({b"/": upload}, client_timeout=SHORT)
    client = clients(server)
    stream_id = client.request(b"/", b"POST", end_stream=False)
    client.send_body(stream_id, b"some", end=False)
    answer = client.response(stream_id)
    assert answer.status == 408
    assert isinstance(app.raised[stream_id], ClientTimeout)


def test_a_connection_without_streams_for_client_timeout_is_closed_with_goaway(start: Any, clients: Any) -> None:
    server, _ = start({b"/": ok}, client_timeout=SHORT)
    client = clients(server)
    assert client.response(client.request(b"/")).status == 200
    client.until_closed()
    assert [(goaway.error_code, goaway.last_stream_id) for goaway in client.goaways] == [(ErrorCodes.NO_ERROR, 1)]


def test_stream_greenlets_are_bounded_even_after_their_streams_were_reset(start: Any, clients: Any) -> None:
    release = gevent.event.Event()
    running: list[int] = []
    ended: list[int] = []
    all_ended = gevent.event.Event()

    def stubborn(exchange: H2Exchange) -> None:  # it does not watch its client: it finds out late
        running.append(exchange.stream_id)
        release.wait()
        ended.append(exchange.stream_id)
        if len(ended) == 4:
            all_ended.set()

    server, _ = start({b"/stubborn": stubborn, b"/": ok}, max_streams=2)
    client = clients(server)
    assert client.h2.remote_settings.max_concurrent_streams == 2
    for _ in range(2):
        pair = client.request(b"/stubborn"), client.request(b"/stubborn")
        eventually(lambda pair=pair: set(pair) <= set(running), "both streams running")
        for stream_id in pair:
            client.reset(stream_id)
    # Reset streams are closed (RFC 9113 5.1.2 counts none open), but four greenlets
    # still run: twice the stream limit, the most a connection may keep.
    refused = client.request(b"/")
    assert client.response(refused).reset == ErrorCodes.REFUSED_STREAM
    release.set()
    wait_for(all_ended)
    assert client.response(client.request(b"/")).status == 200


def test_streams_over_the_limit_are_refused_one_by_one_and_the_connection_goes_on(start: Any, clients: Any) -> None:
    release = gevent.event.Event()

    def held(exchange: H2Exchange) -> None:
        release.wait()
        respond(exchange, b"held")

    server, app = start({b"/held": held, b"/": ok}, max_streams=2)
    client = clients(server)
    # This client ignores the limit it was told.
    client.h2.remote_settings[SettingCodes.MAX_CONCURRENT_STREAMS] = 100
    client.h2.remote_settings.acknowledge()
    streams = [client.request(b"/held"), client.request(b"/held")]
    eventually(lambda: len(app.seen) == 2, "both streams running")
    assert [client.response(client.request(b"/")).reset for _ in range(3)] == [ErrorCodes.REFUSED_STREAM] * 3
    release.set()
    assert [bytes(client.response(stream_id).data) for stream_id in streams] == [b"held", b"held"]
    assert client.response(client.request(b"/")).status == 200
    assert not client.goaways


def test_a_first_flight_over_the_limit_is_taken_up_to_twice_the_limit(start: Any, clients: Any) -> None:
    release = gevent.event.Event()

    def held(exchange: H2Exchange) -> None:
        release.wait()
        respond(exchange, b"held")

    server, _ = start({b"/held": held}, max_streams=2)
    client = clients(server, handshake=False)  # its streams go out before it knows the limit
    streams = [client.request(b"/held") for _ in range(5)]
    assert client.response(streams[4]).reset == ErrorCodes.REFUSED_STREAM
    release.set()
    assert [bytes(client.response(stream_id).data) for stream_id in streams[:4]] == [b"held"] * 4


# -- the end of a connection ----------------------------------------------------------------------


def test_protocol_error_gets_goaway_with_h2s_code_and_the_connection_closes(
    start: Any, clients: Any, caplog: pytest.LogCaptureFixture
) -> None:
    waiting = gevent.event.Event()

    def wait_for_body(exchange: H2Exchange) -> None:
        waiting.set()
        exchange.read()

    server, app = start({b"/wait": wait_for_body})
    client = clients(server)
    stream_id = client.request(b"/wait", b"POST", end_stream=False)
    wait_for(waiting)
    with caplog.at_level(logging.DEBUG, logger="activator"):
        client.sock.sendall(b"\x00\x00\x01\x00\x00\x00\x00\x00\x00x")  # DATA on stream 0
        client.until_closed()
    assert [(goaway.error_code, goaway.last_stream_id) for goaway in client.goaways] == [
        (ErrorCodes.PROTOCOL_ERROR, stream_id)
    ]
    assert isinstance(app.raised[stream_id], ClientGone)
    assert [record.levelno for record in caplog.records] == [logging.DEBUG]
    gevent.joinall(server.serving, timeout=BOUND)
    assert all(greenlet.successful() for greenlet in server.serving)


@pytest.mark.parametrize(
    "fields",
    [
        [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b"X-Upper", b"1")],
        [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b"x(y", b"1")],
        [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b"x-space", b"1 ")],
        [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b"connection", b"close")],
        [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b"te", b"gzip")],
        [(b":method", b"GET"), (b":scheme", b"http"), (b"x-a", b"1"), (b":path", b"/")],
        [(b":method", b"GET"), (b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/")],
        [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b":status", b"200")],
        [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"")],
        [(b":method", b"GET"), (b":path", b"/")],
    ],
    ids=["upper-case-name", "name-not-a-token", "value-with-trailing-space", "connection-specific", "te-not-trailers",
         "pseudo-after-regular", "repeated-pseudo", "response-pseudo", "empty-path", "no-scheme"],
)  # fmt: skip
def test_a_malformed_request_resets_its_stream_and_the_connection_goes_on(
    start: Any, clients: Any, fields: list[Header]
) -> None:
    server, app = start({b"/": ok})
    sloppy = H2Configuration(
        client_side=True, header_encoding=None, validate_outbound_headers=False, normalize_outbound_headers=False
    )
    client = clients(server, config=sloppy)
    malformed = client.response(client.raw_request(fields))
    assert malformed.reset == ErrorCodes.PROTOCOL_ERROR and malformed.headers is None
    assert app.seen == []
    assert client.response(client.request(b"/")).status == 200
    assert not client.goaways


def test_stop_sends_goaway_refuses_new_streams_and_finishes_the_others(start: Any, clients: Any) -> None:
    release = gevent.event.Event()
    blocked = gevent.event.Event()

    def slow(exchange: H2Exchange) -> None:
        blocked.set()
        release.wait()
        respond(exchange, b"finished")

    server, _ = start({b"/slow": slow, b"/": ok})
    client = clients(server)
    in_progress = client.request(b"/slow")
    wait_for(blocked)
    server.connections[0].stop()
    client.until(lambda: bool(client.goaways))
    assert [(goaway.error_code, goaway.last_stream_id) for goaway in client.goaways] == [
        (ErrorCodes.NO_ERROR, in_progress)
    ]
    late = client.request(b"/")
    assert client.response(late).reset == ErrorCodes.REFUSED_STREAM
    release.set()
    assert bytes(client.response(in_progress).data) == b"finished"
    client.until_closed()  # the server closes once its last stream is done (after a short linger)
    gevent.joinall(server.serving, timeout=BOUND)
    assert all(greenlet.successful() for greenlet in server.serving)


def test_an_idle_connection_stops_at_once(start: Any, clients: Any) -> None:
    server, _ = start({b"/": ok})
    client = clients(server)
    assert client.response(client.request(b"/")).status == 200
    server.connections[0].stop()
    client.until(lambda: bool(client.goaways))
    assert client.goaways[0].error_code == ErrorCodes.NO_ERROR
    client.close()  # a client that saw the GOAWAY and closes
    gevent.joinall(server.serving, timeout=BOUND)
    assert all(greenlet.successful() for greenlet in server.serving)


def test_over_tls_the_goaways_are_sent_inside_tls(start: Any, clients: Any, tmp_path: Path) -> None:
    """The idle and the lingering ends stop the reader without dropping the TLS layer."""
    server_context, client_context = tls_contexts(tmp_path)
    server, app = start({b"/": ok}, tls=server_context, client_timeout=SHORT)
    client = clients(server, tls=client_context)
    assert client.response(client.request(b"/")).status == 200
    assert app.seen[0].scheme_bytes == b"https"
    client.until_closed()  # no stream for client_timeout
    assert [(goaway.error_code, goaway.last_stream_id) for goaway in client.goaways] == [(ErrorCodes.NO_ERROR, 1)]

    stopping = clients(server, tls=client_context)
    assert stopping.response(stopping.request(b"/")).status == 200
    server.connections[1].stop()
    stopping.until_closed()  # the GOAWAY, then the lingering close, and a ping answered in between
    assert [goaway.error_code for goaway in stopping.goaways] == [ErrorCodes.NO_ERROR]


def test_a_bug_that_escapes_the_application_is_logged_once_and_resets_only_its_stream(
    start: Any, clients: Any, caplog: pytest.LogCaptureFixture
) -> None:
    def bug(exchange: H2Exchange) -> None:
        raise RuntimeError("a bug")

    server, _ = start({b"/bug": bug, b"/": ok})
    client = clients(server)
    assert client.response(client.request(b"/bug")).reset == ErrorCodes.INTERNAL_ERROR
    assert [record.exc_info[0] for record in caplog.records if record.exc_info] == [RuntimeError]
    assert client.response(client.request(b"/")).status == 200


# -- real clients and the engine --------------------------------------------------------------------


def echo_request(exchange: H2Exchange) -> None:
    body = read_all(exchange)
    respond(exchange, b"%s %s %s" % (exchange.head.method.encode(), exchange.head.target, body))


def test_curl_with_prior_knowledge(start: Any) -> None:
    version = gevent.subprocess.run(["curl", "--version"], capture_output=True, check=True).stdout
    assert b"HTTP2" in version, "this machine's curl has no HTTP/2"
    server, app = start({b"/one": echo_request, b"/two": echo_request})
    base = f"http://127.0.0.1:{server.address[1]}"
    # One request per curl: curl 7.88 fails its second request on a reused prior-knowledge
    # connection ("Error in the HTTP2 framing layer"), whatever the server (nghttp below
    # covers streams on one connection).
    outputs = []
    for extra in ([f"{base}/one?a=1"], ["--data-binary", "posted", f"{base}/two"]):
        result = gevent.subprocess.run(
            ["curl", "--http2-prior-knowledge", "-sS", "--max-time", "10", "-w", " [%{http_version} %{http_code}]",
             *extra],
            capture_output=True,
            timeout=15,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    assert outputs == [b"GET /one?a=1  [2 200]", b"POST /two posted [2 200]"]
    assert [(exchange.head.version, exchange.head.framing) for exchange in app.seen] == [
        ("2", BodyFraming.NONE),
        ("2", BodyFraming.LENGTH),
    ]


@pytest.mark.skipif(shutil.which("nghttp") is None, reason="nghttp (nghttp2's client) is not installed")
def test_nghttp_multiplexes_streams_on_one_connection(start: Any) -> None:
    server, app = start({b"/one": echo_request, b"/two": echo_request, b"/three": echo_request})
    base = f"http://127.0.0.1:{server.address[1]}"
    result = gevent.subprocess.run(
        ["nghttp", "--stat", "--null-out", f"{base}/one", f"{base}/two", f"{base}/three"],
        capture_output=True,
        timeout=15,
    )
    assert result.returncode == 0, result.stderr
    statistics = [
        line.split() for line in result.stdout.splitlines() if line.strip().endswith((b"/one", b"/two", b"/three"))
    ]
    assert sorted((row[-1], row[-3]) for row in statistics) == [
        (b"/one", b"200"),
        (b"/three", b"200"),
        (b"/two", b"200"),
    ]
    assert len(server.connections) == 1
    assert sorted(exchange.head.target for exchange in app.seen) == [b"/one", b"/three", b"/two"]


def test_a_grpc_client_gets_trailers_and_own_answers_as_statuses(start: Any) -> None:
    grpc = pytest.importorskip("grpc")

    def upper(exchange: H2Exchange) -> None:
        message = read_all(exchange)
        reply = message[5:].upper()  # after the gRPC message prefix (flag, length)
        respond(
            exchange,
            b"\0" + len(reply).to_bytes(4, "big") + reply,
            headers=((b"content-type", b"application/grpc"),),
            trailers=((b"grpc-status", b"0"),),
        )

    server, app = start({b"/test.Echo/Upper": upper, b"/test.Echo/Full": refuse(QueueFull())})

    def calls() -> tuple[Any, ...]:  # in a thread of its own: grpc's calls block their thread
        with grpc.insecure_channel(f"127.0.0.1:{server.address[1]}") as channel:
            answer = channel.unary_unary("/test.Echo/Upper")(b"hello", timeout=10)
            try:
                channel.unary_unary("/test.Echo/Full")(b"x", timeout=10)
            except grpc.RpcError as error:
                metadata = dict(error.trailing_metadata() or ())
                return answer, error.code(), error.details(), metadata.get("x-activator-reason")
        raise AssertionError("the refused call succeeded")

    answer, code, details, reason = gevent.get_hub().threadpool.apply(calls)
    assert answer == b"HELLO"
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details == "503 queue-full"
    assert reason == "queue-full"
    assert http.is_grpc(app.seen[0].head.content_type)
    assert app.seen[0].head.grpc_timeout is not None


def test_the_engine_hands_h2c_connections_to_http2(clients: Any) -> None:
    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        body = b"%s %s %s" % (
            environ["REQUEST_METHOD"].encode(),
            environ["PATH_INFO"].encode(),
            environ["wsgi.input"].read(),
        )
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]

    sock = listener()
    sock.setblocking(False)
    engine = HttpServer(sock, wsgi, LimitsConfig())
    engine.start()
    try:
        client = H2Client(engine.address)
        stream_id = client.request(b"/via/engine", b"POST", body=b"data")
        answer: Stream = client.response(stream_id)
        assert answer.status == 200
        assert bytes(answer.data) == b"POST /via/engine data"
        client.close()
    finally:
        engine.stop(BOUND)


def test_a_connection_is_served_the_same_when_given_directly(clients: Any) -> None:
    """Constructed as the engine does (the client's address as a plain string)."""
    sock = listener()
    app = App({b"/": ok})
    served: list[gevent.Greenlet] = []

    def accept() -> None:
        conn, _ = sock.accept()
        served.append(gevent.spawn(H2ServerConnection(conn, "127.0.0.1", LimitsConfig(), "https", app).serve))

    acceptor = gevent.spawn(accept)
    client = H2Client(sock.getsockname())
    assert client.response(client.request(b"/")).status == 200
    assert app.seen[0].scheme_bytes == b"https" and app.seen[0].client_ip == "127.0.0.1"
    client.close()
    gevent.joinall([acceptor, *served], timeout=BOUND)
    sock.close()

"""The ``exchange.ClientExchange`` contract, one suite run over both client exchanges.

Every test runs once over ``http1.H1Exchange`` (an HTTP/1.1 client: h11 over a socket)
and once over ``http2.H2Exchange`` (an HTTP/2 client: the h2 library), both served by the
real ``engine.HttpServer`` with a WSGI application that drives the exchange as the proxy
does (``client_sides``). What is covered: the head as the proxy sees it (method, target,
version, host, the header lines in order with ``lower_names``, ``forwarded``,
``content_type``, ``grpc_timeout``, ``upgrade``, the framing); the body read in pieces as
it comes, of known and of unknown length (with trailers), ``read(size)``,
``Expect: 100-continue`` answered at the first read and not before, ``buffered``,
``raise_known_error`` and ``wait_for_body`` (the body, the pod, or neither first); the
response: ``start``/``write``/``finish`` with a length, a stream of unknown length with
trailers, a bodiless 204, an answer to HEAD, ``flush``, a 103 before it (and none after
the final head began, and never a 100); ``answer(error)`` for an ``ActivatorError``
(plain and gRPC-shaped, with ``x-activator-reason`` and ``retry-after``; to HEAD;
replacing a head not sent yet; a cut once the head is out), ``cut()`` (seen by the client
at once); ``watch_gone``/``unwatch_gone``/``client_gone`` when the client goes away (an
HTTP/1.1 hang-up, an HTTP/2 stream reset) and a write after it; and the record of what
was sent (``bytes_sent``, ``status``, ``started``, ``finished``, ``was_cut``).

A test body never asks which transport it runs on: what differs is a property of the
adapter. Handlers note what they saw (``notes``) and the test body asserts on it once they
returned. Timeouts here only bound waits; nothing asserts a duration.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import gevent.event
import pytest
from client_sides import BOUND, SIDES, ClientSide, wait_for
from gevent import socket as gsocket

from activator.base.exchange import ClientExchange
from activator.core.errors import BodyTooLarge, ClientGone, ClientTimeout, QueueFull, QueueTimeout
from activator.core.heads import BodyFraming, Header

#: How long a handler waits, after ``cut()``, for its client to see the cut.
CUT_SEEN_BOUND = 2.0


@pytest.fixture
def client_side(transport: str) -> Iterator[ClientSide]:
    side = SIDES[transport]()
    yield side
    side.close()


# -- helpers ------------------------------------------------------------------------------------------


def respond(
    exchange: ClientExchange,
    body: bytes = b"ok",
    *,
    status: int = 200,
    headers: Sequence[Header] = (),
    trailers: Sequence[Header] = (),
) -> None:
    """Answer as the proxy relays a pod's answer: a length, or a stream when there are trailers."""
    framing = BodyFraming.CHUNKED if trailers else BodyFraming.LENGTH
    lines = list(headers)
    if framing is BodyFraming.LENGTH:
        lines.append((b"Content-Length", b"%d" % len(body)))
    exchange.start(status, b"OK", lines, framing)
    exchange.write(body)
    exchange.finish(trailers)


def read_all(exchange: ClientExchange) -> bytes:
    return b"".join(iter(exchange.read, b""))


def read_exactly(exchange: ClientExchange, size: int) -> bytes:
    """Read until ``size`` bytes came (more, if a piece brought more)."""
    data = b""
    while len(data) < size:
        piece = exchange.read()
        assert piece, "the body ended early"
        data += piece
    return data


def record(exchange: ClientExchange) -> tuple[int, int, bool, bool, bool]:
    """What the exchange says was sent: (status, bytes_sent, started, finished, was_cut)."""
    return exchange.status, exchange.bytes_sent, exchange.started, exchange.finished, exchange.was_cut


def wait(event: gevent.event.Event) -> None:
    assert event.wait(BOUND), "the test never got there"


# -- the request head -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "PURGE"])
def test_the_head_as_the_proxy_sees_it(client_side: ClientSide, method: str) -> None:
    notes: dict[str, Any] = {}

    def handler(exchange: ClientExchange) -> None:
        notes["before"] = record(exchange)
        respond(exchange)

    app, client = client_side.serve(handler)
    sent = [
        (b"X-One", b"1"),
        (b"X-Activator-Forwarded", b"a1"),
        (b"Content-Type", b"application/json"),
        (b"grpc-timeout", b"5S"),
        (b"X-Activator-Forwarded", b"a2"),
        (b"X-One", b"2"),
    ]
    answer = client.answer(client.request(method.encode(), b"/path/to?q=1&r", sent))
    assert (answer.status, answer.body) == (200, b"ok")
    exchange = app.wait_returned()
    head = exchange.head
    name = client_side.wire_name
    assert head.method == method
    assert head.target == b"/path/to?q=1&r"
    assert head.version == client_side.version
    assert head.host == "a.example"
    assert head.hosts == [b"a.example"]
    assert head.headers == [(name(key), value) for key, value in [(b"Host", b"a.example"), *sent]]
    assert head.lower_names == [key.lower() for key, _ in head.headers]
    assert head.forwarded == [b"a1", b"a2"]
    assert head.content_type == b"application/json"
    assert head.grpc_timeout == b"5S"
    assert head.upgrade is False
    assert head.framing is BodyFraming.NONE
    assert head.content_length is None
    assert (exchange.client_ip, exchange.scheme_bytes) == ("127.0.0.1", b"http")
    assert exchange.refusal is None
    assert notes["before"] == (0, 0, False, False, False)
    assert exchange.body_done and exchange.body_bytes == 0
    assert exchange.read() == b""


# -- the request body -----------------------------------------------------------------------------------


def echo_in_two_steps(notes: dict[str, Any], first_read: gevent.event.Event) -> Any:
    """A handler that reads the body's first 3 bytes, tells the test, reads the rest, echoes it."""

    def handler(exchange: ClientExchange) -> None:
        notes["first"] = read_exactly(exchange, 3)
        first_read.set()
        body = notes["first"] + read_all(exchange)
        notes["trailers"] = list(exchange.trailers)
        respond(exchange, body)

    return handler


def test_a_body_of_known_length_is_read_in_pieces_as_it_comes(client_side: ClientSide) -> None:
    notes: dict[str, Any] = {}
    first_read = gevent.event.Event()
    app, client = client_side.serve(echo_in_two_steps(notes, first_read))
    rid = client.request(b"POST", b"/upload", body=b"one", length=6, more=True)
    wait(first_read)  # read while the rest is not even sent
    assert notes["first"] == b"one"
    client.send(rid, b"two", end=True)
    answer = client.answer(rid)
    assert (answer.status, answer.body, answer.interims) == (200, b"onetwo", [])
    exchange = app.wait_returned()
    assert exchange.head.framing is BodyFraming.LENGTH
    assert exchange.head.content_length == 6
    assert (exchange.body_bytes, exchange.body_done) == (6, True)
    assert notes["trailers"] == []


def test_a_body_of_unknown_length_is_read_in_pieces_with_its_trailers(client_side: ClientSide) -> None:
    notes: dict[str, Any] = {}
    first_read = gevent.event.Event()
    app, client = client_side.serve(echo_in_two_steps(notes, first_read))
    rid = client.request(b"POST", b"/upload", body=b"one", more=True)
    wait(first_read)
    assert notes["first"] == b"one"
    client.send(rid, b"two", end=True, trailers=[(b"x-checksum", b"abc")])
    answer = client.answer(rid)
    assert (answer.status, answer.body) == (200, b"onetwo")
    exchange = app.wait_returned()
    assert exchange.head.framing is BodyFraming.CHUNKED
    assert exchange.head.content_length is None
    assert (exchange.body_bytes, exchange.body_done) == (6, True)
    assert notes["trailers"] == [(b"x-checksum", b"abc")]


def test_read_returns_at_most_the_size_asked(client_side: ClientSide) -> None:
    notes: dict[str, Any] = {}

    def handler(exchange: ClientExchange) -> None:
        notes["pieces"] = [exchange.read(4) for _ in range(4)]
        respond(exchange)

    app, client = client_side.serve(handler)
    client.answer(client.request(b"POST", b"/", body=b"0123456789", length=10))
    app.wait_returned()
    assert notes["pieces"] == [b"0123", b"4567", b"89", b""]


def test_expect_100_continue_is_answered_at_the_first_read(client_side: ClientSide) -> None:
    reached = gevent.event.Event()
    go = gevent.event.Event()
    notes: dict[str, Any] = {}

    def handler(exchange: ClientExchange) -> None:
        reached.set()
        wait(go)
        respond(exchange, read_all(exchange))

    app, client = client_side.serve(handler)
    rid = client.request(b"POST", b"/upload", [(b"Expect", b"100-continue")], length=4, more=True)
    wait(reached)
    notes["before the first read"] = client.nothing_yet(rid)
    go.set()
    interim = client.wait_interim(rid)
    assert [status for status, _ in interim.interims] == [100]
    client.send(rid, b"data", end=True)
    answer = client.answer(rid)
    assert (answer.status, answer.body) == (200, b"data")
    assert notes["before the first read"], "100 Continue went out before the application read the body"
    assert app.wait_returned().head.expect_continue


def test_buffered_says_whether_the_body_is_here_without_waiting(client_side: ClientSide) -> None:
    notes: dict[str, Any] = {}
    looked = gevent.event.Event()

    def handler(exchange: ClientExchange) -> None:
        if exchange.head.target == b"/later":
            notes["nothing yet"] = exchange.buffered()
            exchange.raise_known_error()  # nothing known broken: it returns
            looked.set()
        else:
            notes["with the head"] = exchange.buffered()
        body = read_all(exchange)
        notes[f"after the end of {exchange.head.target.decode()}"] = exchange.buffered()
        respond(exchange, body)

    app, client = client_side.serve(handler)
    answer = client.answer(client.request(b"POST", b"/with-head", body=b"data"))
    assert (answer.status, answer.body) == (200, b"data")
    rid = client.request(b"POST", b"/later", body=b"", more=True)
    wait(looked)
    client.send(rid, b"data", end=True)
    answer = client.answer(rid)
    assert (answer.status, answer.body) == (200, b"data")
    app.wait_returned(2)
    assert notes == {
        "with the head": True,
        "after the end of /with-head": True,
        "nothing yet": False,
        "after the end of /later": True,
    }


def test_raise_known_error_raises_a_body_error_that_came_with_the_head(client_side: ClientSide) -> None:
    notes: dict[str, Any] = {}

    def handler(exchange: ClientExchange) -> None:
        notes["buffered"] = exchange.buffered()
        try:
            exchange.raise_known_error()
        except BodyTooLarge as error:
            notes["raised"] = error
            raise
        notes["read"] = exchange.read()  # what a pod would have been sent
        respond(exchange, b"not raised")

    app, client = client_side.serve(handler, max_body_bytes=8)
    answer = client.answer(client.request(b"POST", b"/upload", body=b"x" * 20))  # unknown length, past the limit
    app.wait_returned()
    assert notes["buffered"] is True
    assert isinstance(notes.get("raised"), BodyTooLarge), f"not raised; the first read gave {notes.get('read')!r}"
    assert answer.status == 413
    assert answer.header(b"x-activator-reason") == b"body-too-large"


def test_wait_for_body_says_whether_the_body_or_the_pod_came_first(client_side: ClientSide) -> None:
    targets = (b"/body-first", b"/pod-first", b"/neither")
    notes: dict[bytes, Any] = {}
    waiting = {target: gevent.event.Event() for target in targets}
    decided = {target: gevent.event.Event() for target in targets}
    # What the exchange watches beside its client: a pod's socket, one per request.
    pods = {target: gsocket.socketpair() for target in targets}

    def handler(exchange: ClientExchange) -> None:
        target = exchange.head.target
        pod, peer = pods[target]
        if target == b"/pod-first":
            peer.sendall(b"an early answer")
        waiting[target].set()
        try:
            notes[target] = exchange.wait_for_body(pod.fileno(), BOUND if target != b"/neither" else 0.1)
        except ClientTimeout as error:
            notes[target] = error
            raise
        decided[target].set()
        respond(exchange, read_all(exchange))

    app, client = client_side.serve(handler)
    try:
        # The body comes while the exchange waits.
        rid = client.request(b"POST", b"/body-first", length=4, more=True)
        wait(waiting[b"/body-first"])
        client.send(rid, b"data", end=True)
        assert client.answer(rid).body == b"data"
        # The pod spoke first: the body is sent only once the wait returned.
        rid = client.request(b"POST", b"/pod-first", length=4, more=True)
        wait(decided[b"/pod-first"])
        client.send(rid, b"data", end=True)
        assert client.answer(rid).body == b"data"
        # Neither.
        answer = client.answer(client.request(b"POST", b"/neither", length=4, more=True))
        app.wait_returned(3)
    finally:
        for pair in pods.values():
            for sock in pair:
                sock.close()
    assert notes[b"/body-first"] is False
    assert notes[b"/pod-first"] is True
    assert isinstance(notes[b"/neither"], ClientTimeout)
    assert (answer.status, answer.header(b"x-activator-reason")) == (408, b"client-timeout")


# -- the response ---------------------------------------------------------------------------------------


def test_a_response_of_known_length(client_side: ClientSide) -> None:
    def handler(exchange: ClientExchange) -> None:
        exchange.start(200, b"OK", [(b"Content-Length", b"5"), (b"X-Kind", b"length")], BodyFraming.LENGTH)
        exchange.write(b"hel")
        exchange.write(b"lo")
        exchange.finish()

    app, client = client_side.serve(handler)
    answer = client.answer(client.request(b"GET", b"/"))
    assert (answer.status, answer.body, answer.ended) == (200, b"hello", True)
    assert answer.header(b"content-length") == b"5"
    assert answer.header(b"x-kind") == b"length"
    assert answer.trailers == []
    assert record(app.wait_returned()) == (200, 5, True, True, False)


def test_a_stream_of_unknown_length_with_trailers(client_side: ClientSide) -> None:
    def handler(exchange: ClientExchange) -> None:
        exchange.start(200, b"OK", [(b"X-Kind", b"stream")], BodyFraming.CHUNKED)
        exchange.write(b"one")
        exchange.write(b"two")
        exchange.finish([(b"x-checksum", b"abc"), (b"x-count", b"2")])

    app, client = client_side.serve(handler)
    answer = client.answer(client.request(b"GET", b"/"))
    assert (answer.status, answer.body, answer.ended) == (200, b"onetwo", True)
    assert answer.header(b"content-length") is None
    assert answer.header(b"x-kind") == b"stream"
    assert answer.trailers == [(b"x-checksum", b"abc"), (b"x-count", b"2")]
    assert record(app.wait_returned()) == (200, 6, True, True, False)


def test_a_bodiless_204(client_side: ClientSide) -> None:
    def handler(exchange: ClientExchange) -> None:
        exchange.start(204, b"No Content", [(b"X-Kind", b"none")], BodyFraming.NONE)
        exchange.finish()

    app, client = client_side.serve(handler)
    answer = client.answer(client.request(b"DELETE", b"/thing"))
    assert (answer.status, answer.body, answer.ended) == (204, b"", True)
    assert answer.header(b"x-kind") == b"none"
    assert answer.header(b"content-length") is None
    assert record(app.wait_returned()) == (204, 0, True, True, False)


def test_an_answer_to_head_has_its_length_and_no_body(client_side: ClientSide) -> None:
    def handler(exchange: ClientExchange) -> None:
        if exchange.head.method == "HEAD":
            exchange.start(200, b"OK", [(b"Content-Length", b"5")], BodyFraming.NONE)
            exchange.finish()
        else:
            respond(exchange, b"after")

    app, client = client_side.serve(handler)
    answer = client.answer(client.request(b"HEAD", b"/"))
    assert (answer.status, answer.body, answer.ended) == (200, b"", True)
    assert answer.header(b"content-length") == b"5"
    assert record(app.wait_returned()) == (200, 0, True, True, False)
    # The answer's end is where the client saw it: the connection goes on.
    assert client.answer(client.request(b"GET", b"/")).body == b"after"


def test_a_103_goes_before_the_answer(client_side: ClientSide) -> None:
    def handler(exchange: ClientExchange) -> None:
        exchange.interim(103, b"Early Hints", [(b"Link", b"</style.css>; rel=preload")])
        respond(exchange)

    app, client = client_side.serve(handler)
    answer = client.answer(client.request(b"GET", b"/"))
    assert answer.interims == [(103, [(b"link", b"</style.css>; rel=preload")])]
    assert (answer.status, answer.body) == (200, b"ok")
    assert record(app.wait_returned()) == (200, 2, True, True, False)


def test_an_interim_after_the_final_head_began_is_not_sent(client_side: ClientSide) -> None:
    def handler(exchange: ClientExchange) -> None:
        exchange.start(200, b"OK", [(b"Content-Length", b"2")], BodyFraming.LENGTH)
        exchange.interim(103, b"Early Hints", [(b"Link", b"</late.css>; rel=preload")])
        exchange.write(b"ok")
        exchange.finish()

    app, client = client_side.serve(handler)
    answer = client.answer(client.request(b"GET", b"/"))
    assert (answer.interims, answer.status, answer.body) == ([], 200, b"ok")
    assert record(app.wait_returned()) == (200, 2, True, True, False)


def test_a_100_is_never_relayed(client_side: ClientSide) -> None:
    def handler(exchange: ClientExchange) -> None:
        exchange.interim(100, b"Continue", [])
        exchange.interim(103, b"Early Hints", [])
        respond(exchange)

    app, client = client_side.serve(handler)
    answer = client.answer(client.request(b"GET", b"/"))
    assert [status for status, _ in answer.interims] == [103]
    assert (answer.status, answer.body) == (200, b"ok")
    app.wait_returned()


def test_the_head_goes_out_with_the_first_write_or_at_flush(client_side: ClientSide) -> None:
    started = gevent.event.Event()
    flush = gevent.event.Event()
    write = gevent.event.Event()

    def handler(exchange: ClientExchange) -> None:
        exchange.start(200, b"OK", [], BodyFraming.CHUNKED)
        started.set()
        wait(flush)
        exchange.flush()
        wait(write)
        exchange.write(b"late")
        exchange.finish()

    app, client = client_side.serve(handler)
    rid = client.request(b"GET", b"/events")
    wait(started)
    assert client.nothing_yet(rid), "start() sent the head before any write or flush"
    flush.set()
    head = client.head(rid)
    assert (head.status, head.body, head.done) == (200, b"", False)
    write.set()
    answer = client.answer(rid)
    assert (answer.body, answer.ended) == (b"late", True)
    assert record(app.wait_returned()) == (200, 4, True, True, False)


# -- activator's own answers, and cuts --------------------------------------------------------------------


def test_an_error_is_answered_with_its_reason_and_retry_after(client_side: ClientSide) -> None:
    def handler(exchange: ClientExchange) -> None:
        raise QueueFull()

    app, client = client_side.serve(handler)
    answer = client.answer(client.request(b"GET", b"/"))
    assert (answer.status, answer.body, answer.ended) == (503, b"503 queue-full\n", True)
    assert answer.header(b"x-activator-reason") == b"queue-full"
    assert answer.header(b"retry-after") == b"1"
    assert answer.header(b"content-type") == b"text/plain; charset=utf-8"
    assert record(app.wait_returned()) == (503, len(answer.body), True, True, False)


def test_an_error_answered_to_head_has_no_body(client_side: ClientSide) -> None:
    def handler(exchange: ClientExchange) -> None:
        if exchange.head.method == "HEAD":
            raise QueueFull()
        respond(exchange, b"after")

    app, client = client_side.serve(handler)
    answer = client.answer(client.request(b"HEAD", b"/"))
    assert (answer.status, answer.body, answer.ended) == (503, b"", True)
    assert answer.header(b"x-activator-reason") == b"queue-full"
    # Where the answer ended is where the client saw it end: the connection goes on.
    after = client.answer(client.request(b"GET", b"/"))
    assert (after.status, after.body) == (200, b"after")
    app.wait_returned(2)


def test_a_grpc_request_gets_its_error_as_a_grpc_status(client_side: ClientSide) -> None:
    def handler(exchange: ClientExchange) -> None:
        raise QueueFull()

    app, client = client_side.serve(handler)
    rid = client.request(b"POST", b"/pkg.Service/Call", [(b"Content-Type", b"application/grpc")], body=b"", length=0)
    answer = client.answer(rid)
    assert (answer.status, answer.body, answer.ended) == (200, b"", True)
    assert answer.header(b"content-type") == b"application/grpc"
    assert answer.header(b"grpc-status") == b"8"  # RESOURCE_EXHAUSTED
    assert answer.header(b"grpc-message") == b"503 queue-full"
    assert answer.header(b"x-activator-reason") == b"queue-full"
    assert answer.header(b"retry-after") == b"1"
    assert record(app.wait_returned()) == (200, 0, True, True, False)


def test_an_error_replaces_a_head_not_sent_yet(client_side: ClientSide) -> None:
    def handler(exchange: ClientExchange) -> None:
        exchange.start(200, b"OK", [(b"Content-Length", b"2")], BodyFraming.LENGTH)
        raise QueueTimeout()

    app, client = client_side.serve(handler)
    answer = client.answer(client.request(b"GET", b"/"))
    assert (answer.status, answer.ended) == (503, True)
    assert answer.header(b"x-activator-reason") == b"queue-timeout"
    exchange = app.wait_returned()
    assert (exchange.status, exchange.started, exchange.finished, exchange.was_cut) == (503, True, True, False)


def test_an_error_once_the_head_is_out_cuts_the_response(client_side: ClientSide) -> None:
    def handler(exchange: ClientExchange) -> None:
        exchange.start(200, b"OK", [], BodyFraming.CHUNKED)
        exchange.write(b"part")
        raise QueueTimeout()

    app, client = client_side.serve(handler)
    answer = client.answer(client.request(b"GET", b"/"))
    assert (answer.status, answer.body, answer.cut) == (200, b"part", True)
    assert record(app.wait_returned()) == (200, 4, True, True, True)


def test_cut_abandons_the_response(client_side: ClientSide) -> None:
    def handler(exchange: ClientExchange) -> None:
        exchange.start(200, b"OK", [(b"Content-Length", b"10")], BodyFraming.LENGTH)
        exchange.write(b"part")
        exchange.cut()

    app, client = client_side.serve(handler)
    answer = client.answer(client.request(b"GET", b"/"))
    assert (answer.status, answer.body, answer.cut) == (200, b"part", True)
    assert record(app.wait_returned()) == (200, 4, True, True, True)


def test_the_client_sees_a_cut_at_once(client_side: ClientSide) -> None:
    seen = gevent.event.Event()
    notes: dict[str, bool] = {}

    def handler(exchange: ClientExchange) -> None:
        exchange.start(200, b"OK", [(b"Content-Length", b"10")], BodyFraming.LENGTH)
        exchange.write(b"part")
        exchange.cut()
        # Bounded below BOUND: where the cut waits for the application, this test waits that long.
        notes["seen before the application returned"] = seen.wait(CUT_SEEN_BOUND)

    app, client = client_side.serve(handler)
    answer = client.answer(client.request(b"GET", b"/"))
    seen.set()
    assert (answer.status, answer.body, answer.cut) == (200, b"part", True)
    app.wait_returned()
    assert notes == {"seen before the application returned": True}


# -- the client going away --------------------------------------------------------------------------------


def test_watch_gone_calls_back_when_the_client_goes_away(client_side: ClientSide) -> None:
    notes: dict[str, Any] = {}
    watching = gevent.event.Event()
    told = gevent.event.Event()

    def handler(exchange: ClientExchange) -> None:
        notes["watch"] = exchange.watch_gone(told.set)
        notes["gone before"] = exchange.client_gone()
        watching.set()
        notes["told"] = told.wait(BOUND)
        notes["gone after"] = exchange.client_gone()
        notes["watch after"] = exchange.watch_gone(lambda: None)
        exchange.cut()  # as the proxy does when its client left
        raise ClientGone("the client left")

    app, client = client_side.serve(handler)
    rid = client.request(b"GET", b"/slow")
    wait(watching)
    client.go_away(rid)
    app.wait_returned()
    assert notes == {"watch": True, "gone before": False, "told": True, "gone after": True, "watch after": False}


def test_unwatch_gone_ends_a_watch(client_side: ClientSide) -> None:
    notes: dict[str, Any] = {}
    watching = gevent.event.Event()
    ended_watch = gevent.event.Event()

    def handler(exchange: ClientExchange) -> None:
        exchange.watch_gone(ended_watch.set)
        exchange.unwatch_gone(ended_watch.set)
        exchange.unwatch_gone(ended_watch.set)  # idempotent
        watching.set()
        notes["gone"] = wait_for(exchange.client_gone)
        notes["ended watch told"] = ended_watch.is_set()
        exchange.cut()
        raise ClientGone("the client left")

    app, client = client_side.serve(handler)
    rid = client.request(b"GET", b"/slow")
    wait(watching)
    client.go_away(rid)
    app.wait_returned()
    assert notes == {"gone": True, "ended watch told": False}


def _write_until_gone(exchange: ClientExchange) -> bool:
    """Write until a write raises ``ClientGone`` (a hung-up socket fails on the write after
    its reset came back); whether one did within the bound."""
    with gevent.Timeout(BOUND, False):
        while True:
            try:
                exchange.write(b"more")
            except ClientGone:
                return True
            gevent.sleep(0.01)
    return False


def test_a_write_after_the_client_left_raises_client_gone(client_side: ClientSide) -> None:
    notes: dict[str, Any] = {}
    writing = gevent.event.Event()
    told = gevent.event.Event()

    def handler(exchange: ClientExchange) -> None:
        exchange.start(200, b"OK", [], BodyFraming.CHUNKED)
        exchange.write(b"first")
        exchange.watch_gone(told.set)
        writing.set()
        notes["told"] = told.wait(BOUND)
        notes["raised"] = _write_until_gone(exchange)
        notes["after"] = (exchange.started, exchange.finished, exchange.was_cut)
        exchange.cut()
        raise ClientGone("the client left")

    app, client = client_side.serve(handler)
    rid = client.request(b"GET", b"/stream")
    assert client.head(rid).status == 200
    wait(writing)
    client.go_away(rid)
    app.wait_returned()
    assert notes == {"told": True, "raised": True, "after": (True, False, True)}


def test_a_response_under_way_when_its_client_left_was_cut(client_side: ClientSide) -> None:
    notes: dict[str, Any] = {}
    writing = gevent.event.Event()
    told = gevent.event.Event()

    def handler(exchange: ClientExchange) -> None:
        exchange.start(200, b"OK", [], BodyFraming.CHUNKED)
        exchange.write(b"first")
        exchange.watch_gone(told.set)
        writing.set()
        notes["told"] = told.wait(BOUND)
        notes["was_cut"] = exchange.was_cut
        exchange.cut()
        raise ClientGone("the client left")

    app, client = client_side.serve(handler)
    rid = client.request(b"GET", b"/stream")
    assert client.head(rid).status == 200
    wait(writing)
    client.go_away(rid)
    app.wait_returned()
    assert notes == {"told": True, "was_cut": True}

"""The ``exchange.PodResponse`` contract, one suite run over both pod clients.

Every test runs once over ``upstream.UpstreamPool`` (an HTTP/1.1 pod) and once over
``upstream_h2.H2PodPool`` (an h2c pod), each against a scripted pod of its protocol on
127.0.0.1 (``pod_sides``). What is covered: what the pod receives (method, target,
end-to-end fields in order, a body of known and of unknown length, trailers); the
response head (status, reason where the protocol has one, header lines in order with
``lower_names``, ``content_length``), its framing as ``core.heads.response_framing``
decides it for the same answers; the body in pieces as it comes and whole with its head
(``take_body`` / ``body()``), trailers; 1xx heads to the interim callback (100 dropped);
``close()`` reusing the connection, ``close()`` or ``abort()`` mid-body giving the
exchange up at the pod, ``abort()`` never reusing; the deadlines (``response_start`` and
``total`` before the head -> ``UpstreamTimeout``, ``idle`` -> ``UpstreamIdle``,
``total`` mid-body -> ``UpstreamBodyTimeout``); every way a pod fails (refused, a
connect that times out, closed before the head, a head that is not of the protocol, a
reset or a close mid-body) with the fields the proxy's retry rule reads and the ``kind``
each error carries (``core.failures``); a client body that fails, raised to the caller,
and one known broken (at once, or after a first piece) that reaches no pod.

A test body never asks which transport it runs on: what differs is a property of the
adapter. Timeouts here only bound waits; nothing asserts a duration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import gevent.event
import pytest
from gevent import socket as gsocket
from pod_sides import (
    BOUND,
    SIDES,
    ClientBody,
    PodExchange,
    PodSide,
    Script,
    ScriptedPod,
    read_to_end,
    request,
    wait_for,
)
from upstream_backend import listener

from activator.core.errors import (
    BodyTooLarge,
    ClientBodyError,
    UpstreamBadResponse,
    UpstreamBodyError,
    UpstreamBodyTimeout,
    UpstreamConnectError,
    UpstreamIdle,
    UpstreamTimeout,
)
from activator.core.failures import CONNECT_RETRIES, FailureKind, may_retry_elsewhere
from activator.core.heads import BodyFraming, Header, response_framing
from activator.core.timeouts import Timeouts


@pytest.fixture
def pod_side(transport: str) -> Iterator[PodSide]:
    side = SIDES[transport]()
    yield side
    errors = side.close()
    assert not errors, f"the pod's script failed: {errors!r}"


# -- scripts ------------------------------------------------------------------------------------


def answer_ok(exchange: PodExchange) -> None:
    """Read the whole request, answer ``ok`` in one write."""
    exchange.read_body()
    exchange.whole(200, b"OK", [], b"ok")


def by_target(scripts: dict[bytes, Script]) -> Script:
    """A script per request target."""

    def script(exchange: PodExchange) -> None:
        scripts[exchange.received.target](exchange)

    return script


def stream_then_wait(exchange: PodExchange) -> None:
    """A stream's head and a first piece, then nothing until the client gives up."""
    exchange.read_body()
    exchange.respond(200, b"OK")
    exchange.send(b"part")
    exchange.await_abandoned()


def read_exactly(pieces: Iterator[bytes], size: int) -> bytes:
    """Take pieces until ``size`` bytes came (more, if a piece brought more)."""
    data = b""
    while len(data) < size:
        data += next(pieces)
    return data


def may_go_elsewhere(error: UpstreamConnectError) -> bool:
    return may_retry_elsewhere(error.kind, error.connected, error.body_read, CONNECT_RETRIES, stopping=False)


# -- what the pod receives ------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "DELETE", "PURGE"])
def test_the_pod_receives_the_method_target_and_end_to_end_fields_in_order(pod_side: PodSide, method: str) -> None:
    pod, pool = pod_side.start(answer_ok)
    headers = [(b"Host", b"pod.example"), (b"X-One", b"1"), (b"Accept", b"*/*"), (b"X-One", b"2")]
    assert read_to_end(request(pool, method, b"/a/b?c=d&e", headers)) == b"ok"
    (received,) = pod.received
    assert received.method == method.encode()
    assert received.target == b"/a/b?c=d&e"
    assert received.authority == b"pod.example"
    assert received.fields == [(b"x-one", b"1"), (b"accept", b"*/*"), (b"x-one", b"2")]
    assert received.declared_length is None
    assert received.body == b""


def test_a_body_of_known_length_arrives_whole_with_its_length(pod_side: PodSide) -> None:
    pod, pool = pod_side.start(answer_ok)
    body = ClientBody(b"first-", b"second-", b"third")
    assert read_to_end(request(pool, "POST", b"/upload", body=body, length=18)) == b"ok"
    (received,) = pod.received
    assert received.declared_length == 18
    assert received.body == b"first-second-third"
    assert received.trailers == []


@pytest.mark.parametrize("pieces", [(b"first-", b"second"), ()], ids=["two-pieces", "empty"])
def test_a_body_of_unknown_length_arrives_whole_with_its_trailers(pod_side: PodSide, pieces: tuple[bytes, ...]) -> None:
    pod, pool = pod_side.start(answer_ok)
    body = ClientBody(*pieces, trailers=[(b"X-Checksum", b"abc"), (b"x-count", b"2")])
    assert read_to_end(request(pool, "POST", b"/upload", body=body)) == b"ok"
    (received,) = pod.received
    assert received.declared_length is None
    assert received.body == b"".join(pieces)
    assert received.trailers == [(b"x-checksum", b"abc"), (b"x-count", b"2")]


# -- the response head and its framing ---------------------------------------------------------------


def test_the_response_head_keeps_every_line_in_order(pod_side: PodSide) -> None:
    headers = [(b"X-Mixed-Case", b"a"), (b"Set-Cookie", b"1"), (b"Set-Cookie", b"2")]

    def script(exchange: PodExchange) -> None:
        exchange.read_body()
        exchange.whole(200, b"Fine Thanks", headers, b"hello")

    _, pool = pod_side.start(script)
    response = request(pool)
    head = response.head
    name = pod_side.wire_name
    assert head.status == 200
    assert head.reason == pod_side.reason(b"Fine Thanks")
    assert head.headers == [(name(key), value) for key, value in [*headers, (b"Content-Length", b"5")]]
    assert head.lower_names == [b"x-mixed-case", b"set-cookie", b"set-cookie", b"content-length"]
    assert head.content_length == 5
    assert response.head_done and not response.early and not response.upgraded
    assert response.framing is BodyFraming.LENGTH
    assert read_to_end(response) == b"hello"


def _with_length(exchange: PodExchange, status: int) -> None:
    exchange.respond(status, b"Whatever", length=5)
    exchange.send(b"hel")
    exchange.send(b"lo")
    exchange.end()


def _as_a_stream(exchange: PodExchange, status: int) -> None:
    exchange.respond(status, b"Whatever")
    exchange.send(b"hel")
    exchange.send(b"lo")
    exchange.end()


def _empty_length(exchange: PodExchange, status: int) -> None:
    exchange.respond(status, b"Whatever", length=0, end=True)


def _head_of_length(exchange: PodExchange, status: int) -> None:
    exchange.respond(status, b"Whatever", length=5, end=True)


def _bodiless(exchange: PodExchange, status: int) -> None:
    exchange.respond(status, b"Whatever", end=True)


@pytest.mark.parametrize(
    ("method", "status", "answer", "framing", "length", "body"),
    [
        ("GET", 200, _with_length, BodyFraming.LENGTH, 5, b"hello"),
        ("GET", 200, _as_a_stream, BodyFraming.CHUNKED, None, b"hello"),
        ("GET", 200, _empty_length, BodyFraming.NONE, 0, b""),
        ("HEAD", 200, _head_of_length, BodyFraming.NONE, 5, b""),
        ("GET", 204, _bodiless, BodyFraming.NONE, None, b""),
        ("GET", 304, _bodiless, BodyFraming.NONE, None, b""),
    ],
    ids=["length", "stream", "empty-length", "head", "204", "304"],
)
def test_the_framing_is_what_response_framing_decides(
    pod_side: PodSide,
    method: str,
    status: int,
    answer: Callable[[PodExchange, int], None],
    framing: BodyFraming,
    length: int | None,
    body: bytes,
) -> None:
    def script(exchange: PodExchange) -> None:
        exchange.read_body()
        answer(exchange, status)

    pod, pool = pod_side.start(script)
    response = request(pool, method)
    assert response.head.status == status
    assert response.head.content_length == length
    assert response.framing is framing
    assert response.framing is response_framing(method, response.head, http2=pod_side.http2)
    assert read_to_end(response) == body
    assert response.complete
    # The connection is sound after it: the next answer comes on it.
    assert read_to_end(request(pool, method)) == body
    assert pod.connections == 1


# -- the body -------------------------------------------------------------------------------------------


def test_the_body_comes_piece_by_piece_as_the_pod_sends_it(pod_side: PodSide) -> None:
    head_taken = gevent.event.Event()
    first_taken = gevent.event.Event()
    waited: list[bool] = []

    def script(exchange: PodExchange) -> None:
        exchange.read_body()
        exchange.respond(200, b"OK")
        # Each piece only once the one before was taken: a client that waits for more
        # before it hands a piece on gets the two together.
        waited.append(head_taken.wait(BOUND))
        exchange.send(b"first")
        waited.append(first_taken.wait(BOUND))
        exchange.send(b"second")
        exchange.end()

    _, pool = pod_side.start(script)
    response = request(pool)
    head_taken.set()
    pieces = response.body()
    assert read_exactly(pieces, 5) == b"first"
    assert not response.complete
    first_taken.set()
    assert b"".join(pieces) == b"second"
    assert response.complete
    assert waited == [True, True]
    response.close()


def test_a_body_that_came_with_its_head_is_there_whole(pod_side: PodSide) -> None:
    def script(exchange: PodExchange) -> None:
        exchange.read_body()
        exchange.whole(200, b"OK", [], b"all of it")

    _, pool = pod_side.start(script)
    response = request(pool)
    assert response.complete
    assert response.take_body() == b"all of it"
    assert response.take_body() == b""
    assert list(response.body()) == []
    response.close()


def test_the_trailers_of_a_stream_come_after_its_body(pod_side: PodSide) -> None:
    trailers = [(b"x-checksum", b"abc"), (b"x-count", b"1")]
    body_sent = gevent.event.Event()

    def script(exchange: PodExchange) -> None:
        exchange.read_body()
        exchange.respond(200, b"OK", [(b"Trailer", b"x-checksum, x-count")])
        exchange.send(b"data")
        body_sent.wait(BOUND)
        exchange.end(trailers)

    _, pool = pod_side.start(script)
    response = request(pool)
    assert response.framing is BodyFraming.CHUNKED
    pieces = response.body()
    assert read_exactly(pieces, 4) == b"data"
    assert response.trailers == ()
    body_sent.set()
    assert b"".join(pieces) == b""
    assert response.trailers == trailers
    response.close()


def test_interim_heads_go_to_the_callback_and_100_is_dropped(pod_side: PodSide) -> None:
    link = (b"link", b"</style.css>; rel=preload")

    def script(exchange: PodExchange) -> None:
        exchange.read_body()
        exchange.interim(100, b"Continue")
        exchange.interim(103, b"Early Hints", [link])
        exchange.interim(102, b"Processing")
        exchange.whole(200, b"OK", [], b"ok")

    _, pool = pod_side.start(script)
    seen: list[tuple[int, bytes, list[Header]]] = []
    response = request(pool, interim=lambda status, reason, headers: seen.append((status, reason, list(headers))))
    assert seen == [(103, pod_side.reason(b"Early Hints"), [link]), (102, pod_side.reason(b"Processing"), [])]
    assert response.head.status == 200
    assert read_to_end(response) == b"ok"


# -- ending an exchange ------------------------------------------------------------------------------------


def test_close_after_the_whole_answer_reuses_the_connection(pod_side: PodSide) -> None:
    pod, pool = pod_side.start(answer_ok)
    for _ in range(3):
        assert read_to_end(request(pool)) == b"ok"
    assert len(pod.received) == 3
    assert pod.connections == 1


@pytest.mark.parametrize("ending", ["close", "abort"])
def test_an_answer_given_up_mid_body_is_given_up_at_the_pod(pod_side: PodSide, ending: str) -> None:
    pod, pool = pod_side.start(by_target({b"/stream": stream_then_wait, b"/ok": answer_ok}))
    response = request(pool, target=b"/stream")
    assert read_exactly(response.body(), 4) == b"part"
    getattr(response, ending)()
    assert wait_for(lambda: pod.exchanges[0].abandoned), "the pod never saw the exchange given up"
    assert read_to_end(request(pool, target=b"/ok")) == b"ok"
    assert pod.connections == (1 if pod_side.abort_keeps_connection else 2)


def test_abort_after_the_whole_answer_never_reuses_the_exchange(pod_side: PodSide) -> None:
    pod, pool = pod_side.start(answer_ok)
    response = request(pool)
    assert response.take_body() + b"".join(response.body()) == b"ok"
    response.abort()
    assert read_to_end(request(pool)) == b"ok"
    assert pod.connections == (1 if pod_side.abort_keeps_connection else 2)


# -- deadlines -----------------------------------------------------------------------------------------------


def wait_for_nothing(exchange: PodExchange) -> None:
    """Read the request, answer nothing until the client gives up."""
    exchange.read_body()
    exchange.await_abandoned()


@pytest.mark.parametrize(
    "timeouts",
    [Timeouts(connect=2.0, response_start=0.2), Timeouts(connect=2.0, response_start=5.0, total=0.2)],
    ids=["response_start", "total"],
)
def test_no_head_in_time_is_a_timeout(pod_side: PodSide, timeouts: Timeouts) -> None:
    pod, pool = pod_side.start(wait_for_nothing)
    with pytest.raises(UpstreamTimeout) as caught:
        request(pool, timeouts=timeouts)
    assert caught.value.kind is FailureKind.TIMEOUT
    assert wait_for(lambda: pod.exchanges[0].abandoned), "the pod never saw the exchange given up"


@pytest.mark.parametrize(
    ("timeouts", "error"),
    [
        (Timeouts(connect=2.0, response_start=5.0, idle=0.2), UpstreamIdle),
        (Timeouts(connect=2.0, response_start=5.0, total=1.0), UpstreamBodyTimeout),
    ],
    ids=["idle", "total"],
)
def test_silence_mid_body_is_a_body_timeout(
    pod_side: PodSide, timeouts: Timeouts, error: type[UpstreamBodyError]
) -> None:
    pod, pool = pod_side.start(stream_then_wait)
    response = request(pool, timeouts=timeouts)
    pieces = response.body()
    assert read_exactly(pieces, 4) == b"part"
    with pytest.raises(UpstreamBodyError) as caught:
        next(pieces)
    assert type(caught.value) is error
    assert caught.value.kind is FailureKind.TIMEOUT
    response.close()
    assert wait_for(lambda: pod.exchanges[0].abandoned), "the pod never saw the exchange given up"


# -- pods that fail ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_body", [False, True], ids=["bodiless", "with-body"])
def test_a_refused_connection_may_go_to_another_pod(pod_side: PodSide, with_body: bool) -> None:
    pool = pod_side.pool_to_nothing()
    body = ClientBody(b"data") if with_body else None
    with pytest.raises(UpstreamConnectError) as caught:
        request(pool, "POST", body=body, length=4 if with_body else None)
    error = caught.value
    assert type(error) is UpstreamConnectError
    assert (error.connected, error.body_read) == (False, False)
    assert error.kind is FailureKind.CONNECT
    assert may_go_elsewhere(error)


def test_a_connect_that_times_out_may_go_to_another_pod(pod_side: PodSide) -> None:
    sock = listener(backlog=0)  # never accepts
    port = sock.getsockname()[1]
    queued = gsocket.create_connection(("127.0.0.1", port), timeout=BOUND)  # the backlog is full now
    try:
        with pytest.raises(UpstreamConnectError) as caught:
            request(pod_side.pool_to(port), timeouts=Timeouts(connect=0.2, response_start=5.0))
    finally:
        queued.close()
        sock.close()
    error = caught.value
    assert type(error) is UpstreamConnectError
    assert (error.connected, error.body_read) == (False, False)
    assert error.kind is FailureKind.CONNECT
    assert may_go_elsewhere(error)


def hang_up_before_the_head(exchange: PodExchange) -> None:
    exchange.read_body()
    exchange.hang_up()


def test_a_pod_that_closes_with_the_body_read_before_its_head_is_a_connect_error(pod_side: PodSide) -> None:
    _, pool = pod_side.start(hang_up_before_the_head)
    with pytest.raises(UpstreamConnectError) as caught:
        request(pool, "POST", body=ClientBody(b"data"), length=4)
    error = caught.value
    assert type(error) is UpstreamConnectError
    assert (error.connected, error.body_read) == (True, True)
    assert error.kind is FailureKind.CONNECT
    assert not may_go_elsewhere(error)


def test_a_pod_that_closes_before_the_head_of_a_bodiless_request_read_nothing_of_its_body(pod_side: PodSide) -> None:
    _, pool = pod_side.start(hang_up_before_the_head)
    with pytest.raises(UpstreamConnectError) as caught:
        request(pool)
    error = caught.value
    assert type(error) is UpstreamConnectError
    assert error.kind is FailureKind.CONNECT
    assert (error.connected, error.body_read) == (True, False)


def test_a_head_that_is_not_the_protocols_is_a_bad_response(pod_side: PodSide) -> None:
    def script(exchange: PodExchange) -> None:
        exchange.read_body()
        exchange.malformed_head()

    _, pool = pod_side.start(script)
    with pytest.raises(UpstreamBadResponse) as caught:
        request(pool)
    error = caught.value
    assert error.connected
    assert error.kind is FailureKind.CONNECT
    assert not may_go_elsewhere(error)


@pytest.mark.parametrize("how", ["cut", "hang_up"])
def test_a_pod_that_breaks_off_mid_body_is_a_body_error(pod_side: PodSide, how: str) -> None:
    def broken(exchange: PodExchange) -> None:
        exchange.read_body()
        exchange.respond(200, b"OK", length=10)
        exchange.send(b"part")
        getattr(exchange, how)()

    _, pool = pod_side.start(by_target({b"/broken": broken, b"/ok": answer_ok}))
    response = request(pool, target=b"/broken")
    with pytest.raises(UpstreamBodyError) as caught:
        b"".join(response.body())
    assert type(caught.value) is UpstreamBodyError
    assert caught.value.kind is FailureKind.RESET
    assert not response.complete
    response.close()
    assert read_to_end(request(pool, target=b"/ok")) == b"ok"  # the pool goes on


# -- the client's body ------------------------------------------------------------------------------------------


def wait_for_the_client_to_give_up(exchange: PodExchange) -> None:
    """Read nothing of the body (it never ends), answer nothing."""
    exchange.await_abandoned()


@pytest.mark.parametrize("length", [None, 20], ids=["unknown-length", "length"])
def test_a_client_body_that_fails_is_raised_to_the_caller(pod_side: PodSide, length: int | None) -> None:
    pod, pool = pod_side.start(wait_for_the_client_to_give_up)
    failure = ClientBodyError("a broken chunk")
    with pytest.raises(ClientBodyError) as caught:
        request(pool, "POST", body=ClientBody(b"first", error=failure), length=length)
    assert caught.value is failure
    assert wait_for(lambda: pod.exchanges and pod.exchanges[0].abandoned), "the pod never saw the exchange given up"


def assert_reached_no_pod(pod: ScriptedPod, pool: Any) -> None:
    """Once a request after it was answered and every connection ended: only that one came."""
    assert read_to_end(request(pool, target=b"/after")) == b"ok"
    pool.close()
    assert wait_for(pod.all_closed), "the pod's connections never ended"
    assert [received.target for received in pod.received] == [b"/after"]


@pytest.mark.parametrize("length", [None, 20], ids=["unknown-length", "length"])
def test_a_client_body_known_broken_reaches_no_pod(pod_side: PodSide, length: int | None) -> None:
    pod, pool = pod_side.start(answer_ok)
    failure = BodyTooLarge("over max_body_bytes")
    with pytest.raises(BodyTooLarge) as caught:
        request(pool, "POST", b"/broken", body=ClientBody(error=failure, known=True), length=length)
    assert caught.value is failure
    assert_reached_no_pod(pod, pool)


def test_a_body_known_broken_after_its_first_piece_reaches_no_pod(pod_side: PodSide) -> None:
    pod, pool = pod_side.start(answer_ok)
    failure = ClientBodyError("a broken chunk after a good one, in the packet of the head")
    with pytest.raises(ClientBodyError) as caught:
        request(pool, "POST", b"/broken", body=ClientBody(b"good chunk", error=failure, known=True))
    assert caught.value is failure
    assert_reached_no_pod(pod, pool)

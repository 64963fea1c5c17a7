"""The two pod clients behind one adapter, each with a scripted pod of its protocol.

``PodSide`` is what a test of ``test_pod_clients.py`` holds: a pod client
(``upstream.UpstreamPool`` for HTTP/1.1, ``upstream_h2.H2PodPool`` for h2c), the scripted
pod it talks to on 127.0.0.1, and the few properties in which the two protocols really
differ (``carries_reason``, ``wire_name``, ``http2``, ``abort_keeps_connection``).

The pod runs ``script(exchange)`` for every request, in a greenlet of its own, as soon as
the request's head came; ``exchange`` is a ``PodExchange``, the same for both protocols:

- what the pod received (``received``: method, target, authority, the end-to-end fields
  with lower-cased names in their order, the declared length; the body and the trailers
  once ``read_body`` returned);
- how it answers: ``interim``, ``respond`` (a length, a stream, or no body at all),
  ``send``, ``end`` (with trailers), ``whole`` (head and body in one write), ``cut`` (a
  reset: RST for HTTP/1.1, RST_STREAM for h2c), ``hang_up`` (the connection closed);
- ``await_abandoned``: wait until the client gave the exchange up (HTTP/1.1: it closed
  the connection; h2c: it reset the stream, or the connection ended).

HTTP/1.1 pods: ``upstream_backend.RawBackend``, requests decoded by llhttp
(``RequestReader``). h2c pods: ``h2_pod.H2Pod``. What a script raises is recorded
(``errors``) and fails the test at teardown. No monkey-patching; every wait is bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gevent
from gevent import socket as gsocket
from h2.errors import ErrorCodes
from h2_pod import H2Pod, PodRequest
from upstream_backend import RawBackend, ReceivedRequest, RequestReader, listener, reset

from activator.base import exchange
from activator.base.exchange import InterimCallback, PodResponse
from activator.core.errors import ActivatorError
from activator.core.heads import BodyFraming, Header
from activator.core.timeouts import Timeouts
from activator.pods.h2c import H2PodPool
from activator.pods.http1 import UpstreamPool

#: Seconds a pod or a test waits for something that should happen at once (only to turn
#: a hang into a failure).
BOUND = 5.0
#: Generous: no test expects a connect or a response head to take long.
TIMEOUTS = Timeouts(connect=2.0, response_start=5.0)
#: Request fields a pod sees that are not end-to-end: framing, the authority, ``te``.
_NOT_END_TO_END = frozenset((b"host", b"content-length", b"transfer-encoding", b"te", b"connection"))


def wait_for(condition: Callable[[], object], bound: float = BOUND) -> bool:
    """Poll ``condition()`` until it is true or ``bound`` passed; its last value."""
    with gevent.Timeout(bound, False):
        while not condition():
            gevent.sleep(0.005)
    return bool(condition())


@dataclass
class Received:
    """One request as the pod got it, whatever the protocol."""

    method: bytes
    target: bytes
    authority: bytes | None
    #: End-to-end fields in their order, names lower-cased (no framing, authority or ``te``).
    fields: list[Header]
    #: The Content-Length it came with, None for a body of unknown length (or none).
    declared_length: int | None
    body: bytes = b""
    trailers: list[Header] = field(default_factory=list)


def _received(method: bytes, target: bytes, pairs: Sequence[Header]) -> Received:
    lowered = [(name.lower(), value) for name, value in pairs]
    authority = next((value for name, value in lowered if name in (b"host", b":authority")), None)
    length = next((int(value) for name, value in lowered if name == b"content-length"), None)
    fields = [(name, value) for name, value in lowered if name[:1] != b":" and name not in _NOT_END_TO_END]
    return Received(method, target, authority, fields, length)


def _lowered(headers: Sequence[Header]) -> list[Header]:
    return [(name.lower(), value) for name, value in headers]


class PodExchange:
    """One request at the scripted pod, and the pod's answer (see the module docstring)."""

    received: Received
    #: ``await_abandoned`` saw the client give the exchange up.
    abandoned = False

    @property
    def client_left(self) -> bool:
        """Whether the client left the exchange (h2c: reset its stream) as far as the pod knows."""
        return False

    def read_body(self) -> bytes:
        """Wait for the whole request body (and its trailers); fills ``received``."""
        raise NotImplementedError

    def interim(self, status: int, reason: bytes, headers: Sequence[Header] = ()) -> None:
        raise NotImplementedError

    def respond(
        self,
        status: int,
        reason: bytes,
        headers: Sequence[Header] = (),
        *,
        length: int | None = None,
        end: bool = False,
    ) -> None:
        """The final head: with ``length``, a body of that length follows (or none, with
        ``end``: a HEAD answer); without, a stream (or no body at all, with ``end``)."""
        raise NotImplementedError

    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def end(self, trailers: Sequence[Header] = ()) -> None:
        raise NotImplementedError

    def whole(self, status: int, reason: bytes, headers: Sequence[Header], body: bytes) -> None:
        """Head and body (of its length) in one write."""
        raise NotImplementedError

    def malformed_head(self) -> None:
        """Answer with a head that is not one of the protocol's."""
        raise NotImplementedError

    def cut(self) -> None:
        """Reset the exchange (HTTP/1.1: the connection with RST; h2c: RST_STREAM)."""
        raise NotImplementedError

    def hang_up(self) -> None:
        """Close the connection the exchange runs on."""
        raise NotImplementedError

    def await_abandoned(self) -> bool:
        """Wait until the client gave the exchange up; sets and returns ``abandoned``."""
        raise NotImplementedError


Script = Callable[[PodExchange], None]


class ScriptedPod:
    """A pod that runs a script per request and records what it got."""

    port: int
    #: Every request's exchange, in the order their heads came.
    exchanges: list[PodExchange]
    #: What the scripts raised (the fixture fails the test on any).
    errors: list[BaseException]

    @property
    def received(self) -> list[Received]:
        return [exchange.received for exchange in self.exchanges]

    @property
    def connections(self) -> int:
        """Connections the pod accepted so far."""
        raise NotImplementedError

    def all_closed(self) -> bool:
        """Whether every connection the pod accepted has ended."""
        raise NotImplementedError

    def run(self, script: Script, exchange: PodExchange) -> None:
        self.exchanges.append(exchange)
        try:
            script(exchange)
        except Exception as error:
            # A write the client's leaving made fail (a closed connection, a reset
            # stream) is not the script's failure.
            if not (isinstance(error, OSError) or exchange.client_left):
                self.errors.append(error)

    def close(self) -> None:
        raise NotImplementedError


# -- HTTP/1.1 ----------------------------------------------------------------------------------


class H1PodExchange(PodExchange):
    def __init__(self, conn: gsocket.socket, reader: RequestReader, request: ReceivedRequest) -> None:
        self.conn = conn
        self.reader = reader
        self.request = request
        self.received = _received(request.method, request.target, request.headers)
        self.chunked = False
        self.done_with_connection = False  # cut, hung up, or given up by the client

    def read_body(self) -> bytes:
        assert self.reader.read_until(lambda request: request.complete), "the request never ended"
        self.received.body = bytes(self.request.body)
        self.received.trailers = _lowered(self.request.trailers)
        return self.received.body

    def interim(self, status: int, reason: bytes, headers: Sequence[Header] = ()) -> None:
        self.conn.sendall(b"HTTP/1.1 %d %s\r\n%s\r\n" % (status, reason, _lines(headers)))

    def _head(self, status: int, reason: bytes, headers: Sequence[Header], length: int | None, end: bool) -> bytes:
        lines = list(headers)
        if length is not None:
            lines.append((b"Content-Length", b"%d" % length))
        elif not end:
            lines.append((b"Transfer-Encoding", b"chunked"))
            self.chunked = True
        return b"HTTP/1.1 %d %s\r\n%s\r\n" % (status, reason, _lines(lines))

    def respond(
        self,
        status: int,
        reason: bytes,
        headers: Sequence[Header] = (),
        *,
        length: int | None = None,
        end: bool = False,
    ) -> None:
        self.conn.sendall(self._head(status, reason, headers, length, end))

    def send(self, data: bytes) -> None:
        self.conn.sendall(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)

    def end(self, trailers: Sequence[Header] = ()) -> None:
        if self.chunked:
            self.conn.sendall(b"0\r\n%s\r\n" % _lines(trailers))

    def whole(self, status: int, reason: bytes, headers: Sequence[Header], body: bytes) -> None:
        self.conn.sendall(self._head(status, reason, headers, len(body), False) + body)

    def malformed_head(self) -> None:
        self.conn.sendall(b"NOT AN HTTP ANSWER\r\n\r\n")

    def cut(self) -> None:
        self.done_with_connection = True
        reset(self.conn)

    def hang_up(self) -> None:
        self.done_with_connection = True
        self.conn.close()

    def await_abandoned(self) -> bool:
        """The client closed the connection (what it still sent is read and dropped)."""
        with gevent.Timeout(BOUND, False):
            try:
                while self.conn.recv(65536):
                    pass
            except OSError:
                pass
            self.abandoned = True
            self.done_with_connection = True
        return self.abandoned


def _lines(headers: Sequence[Header]) -> bytes:
    return b"".join(b"%s: %s\r\n" % header for header in headers)


class H1Pod(ScriptedPod):
    """An HTTP/1.1 pod: each accepted connection serves its requests one after the other."""

    def __init__(self, script: Script) -> None:
        self.exchanges = []
        self.errors = []
        self.ended = 0  # connections whose loop ended
        self._script = script
        self._backend = RawBackend(self._serve)
        self.port = self._backend.port

    @property
    def connections(self) -> int:
        return self._backend.accepted

    def all_closed(self) -> bool:
        return self.ended == self._backend.accepted

    def _serve(self, conn: gsocket.socket, index: int) -> None:
        reader = RequestReader(conn)
        try:
            while True:
                if reader.current.complete or reader.current.head_done:
                    reader.current = ReceivedRequest()
                if not reader.read_until(lambda request: request.head_done):
                    return
                exchange = H1PodExchange(conn, reader, reader.current)
                self.run(self._script, exchange)
                if exchange.done_with_connection or not reader.read_until(lambda request: request.complete):
                    return
        finally:
            self.ended += 1

    def close(self) -> None:
        self._backend.close()


# -- h2c -----------------------------------------------------------------------------------------


class H2PodExchange(PodExchange):
    def __init__(self, request: PodRequest) -> None:
        self.request = request
        self.received = _received(request.method or b"", request.path or b"", request.headers)

    @property
    def client_left(self) -> bool:
        return self.request.reset_code is not None or self.request.connection.closed.is_set()

    def read_body(self) -> bytes:
        self.received.body = self.request.read_all()
        self.received.trailers = list(self.request.trailers)
        return self.received.body

    def interim(self, status: int, reason: bytes, headers: Sequence[Header] = ()) -> None:
        self.request.respond(status, _lowered(headers))

    def _fields(self, status: int, headers: Sequence[Header], length: int | None) -> list[Header]:
        fields = [(b":status", b"%d" % status), *_lowered(headers)]
        if length is not None:
            fields.append((b"content-length", b"%d" % length))
        return fields

    def respond(
        self,
        status: int,
        reason: bytes,
        headers: Sequence[Header] = (),
        *,
        length: int | None = None,
        end: bool = False,
    ) -> None:
        connection = self.request.connection
        connection.send_headers(self.request.stream_id, self._fields(status, headers, length), end)

    def send(self, data: bytes) -> None:
        self.request.send(data)

    def end(self, trailers: Sequence[Header] = ()) -> None:
        if trailers:
            self.request.send_trailers(_lowered(trailers))
        else:
            self.request.send(b"", end=True)

    def whole(self, status: int, reason: bytes, headers: Sequence[Header], body: bytes) -> None:
        connection = self.request.connection
        stream_id = self.request.stream_id
        connection.h2.send_headers(stream_id, self._fields(status, headers, len(body)))  # sent with the DATA
        connection.send_data(stream_id, body, True)

    def malformed_head(self) -> None:
        self.request.connection.send_headers(self.request.stream_id, [(b":status", b"2x0")], True)

    def cut(self) -> None:
        self.request.reset(ErrorCodes.INTERNAL_ERROR)

    def hang_up(self) -> None:
        self.request.connection.close()

    def await_abandoned(self) -> bool:
        """The client reset the stream (or its connection ended)."""
        request = self.request
        self.abandoned = wait_for(lambda: request.reset_code is not None or request.connection.closed.is_set())
        return self.abandoned


class H2CPod(ScriptedPod):
    def __init__(self, script: Script) -> None:
        self.exchanges = []
        self.errors = []
        self._pod = H2Pod(lambda request: self.run(script, H2PodExchange(request)))
        self.port = self._pod.port

    @property
    def connections(self) -> int:
        return len(self._pod.connections)

    def all_closed(self) -> bool:
        return all(connection.closed.is_set() for connection in self._pod.connections)

    def close(self) -> None:
        self._pod.close()


# -- the client's body ------------------------------------------------------------------------------


class ClientBody:
    """A client's request body as a pod client reads it (``upstream.BodySource``).

    Its pieces are all in hand (``buffered()``); after the last, a read raises ``error``
    if one is given. ``known``: the error came with what arrived (a broken chunk in the
    packet of the head): as ``exchange.ClientExchange`` does, ``raise_known_error``
    raises it once no piece is left to read.
    """

    def __init__(
        self,
        *pieces: bytes,
        trailers: Sequence[Header] = (),
        error: ActivatorError | None = None,
        known: bool = False,
    ) -> None:
        self._pieces = [piece for piece in pieces if piece]
        self.trailers = list(trailers)
        self.error = error
        self.known = known

    def read(self, size: int = 65536) -> bytes:
        if not self._pieces:
            if self.error is not None:
                raise self.error
            return b""
        piece = self._pieces.pop(0)
        if len(piece) > size:
            self._pieces.insert(0, piece[size:])
            piece = piece[:size]
        return piece

    def raise_known_error(self) -> None:
        if self.known and self.error is not None and not self._pieces:
            raise self.error

    def buffered(self) -> bool:
        return True

    def exhausted(self) -> bool:
        return not self._pieces and self.error is None

    def wait_for_body(self, pod_fd: int, timeout: float) -> bool:
        raise AssertionError("a body wholly in hand is never waited for")


# -- the adapters ------------------------------------------------------------------------------------


class PodSide:
    """A pod client of one protocol and its scripted pods (see the module docstring)."""

    #: The protocol's name, for messages only.
    name: str
    #: Response heads carry a reason phrase (HTTP/2 has none).
    carries_reason: bool
    #: ``core.heads.response_framing``'s ``http2`` argument for this protocol.
    http2: bool
    #: ``abort()`` leaves the connection to other requests (an h2c stream is the unit
    #: given up, not the connection); HTTP/1.1: the connection is closed.
    abort_keeps_connection: bool

    def __init__(self) -> None:
        self._pods: list[ScriptedPod] = []
        self._pools: list[Any] = []

    def wire_name(self, name: bytes) -> bytes:
        """A header name as this protocol carries it (HTTP/2 names are lower-case)."""
        raise NotImplementedError

    def reason(self, phrase: bytes) -> bytes:
        """The reason a head read by this client carries, for a pod that sent ``phrase``."""
        return phrase if self.carries_reason else b""

    def _pod(self, script: Script) -> ScriptedPod:
        raise NotImplementedError

    def _pool(self, port: int) -> Any:
        raise NotImplementedError

    def start(self, script: Script) -> tuple[ScriptedPod, Any]:
        """A scripted pod and a pool (pod client) to it."""
        pod = self._pod(script)
        self._pods.append(pod)
        return pod, self.pool_to(pod.port)

    def pool_to(self, port: int) -> Any:
        pool = self._pool(port)
        self._pools.append(pool)
        return pool

    def pool_to_nothing(self) -> Any:
        """A pool to a port on 127.0.0.1 nothing listens on (connections are refused)."""
        sock = listener()
        port = sock.getsockname()[1]
        sock.close()
        return self.pool_to(port)

    def close(self) -> list[BaseException]:
        """Close everything; what the pods' scripts raised."""
        for pool in self._pools:
            pool.close()
        errors = []
        for pod in self._pods:
            pod.close()
            errors += pod.errors
        return errors


class H1Side(PodSide):
    name = "HTTP/1.1"
    carries_reason = True
    http2 = False
    abort_keeps_connection = False

    def wire_name(self, name: bytes) -> bytes:
        return name

    def _pod(self, script: Script) -> ScriptedPod:
        return H1Pod(script)

    def _pool(self, port: int) -> UpstreamPool:
        return UpstreamPool("127.0.0.1", port)


class H2Side(PodSide):
    name = "h2c"
    carries_reason = False
    http2 = True
    abort_keeps_connection = True

    def wire_name(self, name: bytes) -> bytes:
        return name.lower()

    def _pod(self, script: Script) -> ScriptedPod:
        return H2CPod(script)

    def _pool(self, port: int) -> H2PodPool:
        return H2PodPool("127.0.0.1", port)


SIDES: dict[str, type[PodSide]] = {"http1": H1Side, "http2": H2Side}


def request(
    pool: Any,
    method: str = "GET",
    target: bytes = b"/",
    headers: Sequence[Header] = ((b"Host", b"pod.example"),),
    body: ClientBody | None = None,
    *,
    length: int | None = None,
    timeouts: Timeouts = TIMEOUTS,
    interim: InterimCallback | None = None,
) -> PodResponse:
    """One request through ``pool``: no body, a body of ``length`` bytes, or (``length``
    None) a body of unknown length."""
    framing = BodyFraming.NONE if body is None else BodyFraming.CHUNKED if length is None else BodyFraming.LENGTH
    request = exchange.PodRequest(method, target, list(headers), body, framing, length, interim)
    response: PodResponse = pool.request(request, timeouts)
    return response


def read_to_end(response: PodResponse) -> bytes:
    """The whole body, as the proxy takes it (what is here, then the rest as it comes);
    the response is closed after."""
    try:
        return response.take_body() + b"".join(response.body())
    finally:
        response.close()

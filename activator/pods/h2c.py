"""The pod side for ``protocol: h2c`` services: HTTP/2 with prior knowledge, one stream per request.

What this module decides:

Connections
    One ``H2PodPool`` per pod address keeps one HTTP/2 connection (plain TCP, prior
    knowledge: our preface and SETTINGS go out at once), opened on first use, and carries
    every request on it as one stream. h2 (``H2Connection``, sans-IO) keeps the protocol
    state; this module drives it from gevent sockets. A second connection is opened only
    when every open one carries as many streams as the pod's
    ``SETTINGS_MAX_CONCURRENT_STREAMS`` (the slots normally keep far below it). A
    connection left without streams is closed (with a GOAWAY of ours) unless it is the
    pod's only one that takes new streams, so the extra connections of a burst go away
    after it and one stays open. Requests that come while a connection opens wait for it
    (up to ``ASSUMED_MAX_STREAMS`` of them, until the pod's SETTINGS say how many it
    takes); one that finds it gone, or full, when it opened tries another, at most
    ``CONNECTION_ATTEMPTS`` connections in all. A connection that is gone (EOF, reset, an
    h2 protocol error, a write the pod did not take in time) fails the streams it carried;
    the next request opens a new one.

GOAWAY
    New streams go to another connection at once; the streams up to the GOAWAY's
    last-stream-id finish on the old one, which is closed once they did; the streams above
    it were never processed by the pod and fail as refused (so the proxy may send them to
    another pod). h2 ends its connection state on any GOAWAY it receives (it then refuses
    every frame of the streams still running), so we own that piece: GOAWAY frames are
    taken out of the pod's bytes before h2 sees them (the driver's frame scanner).

Greenlets, and the order of frames
    Each connection is an ``h2wire.H2Wire`` (the one HTTP/2 driver, shared with the client
    side): one reader greenlet (which also connects and waits for the pod's first
    SETTINGS) feeds h2 and dispatches its events to the streams, and one writer greenlet
    sends what h2 produced, in h2's order, whichever greenlet made it. A request body
    already here whole (a small gRPC call's) goes at once, its last DATA frame ending the
    stream, with no greenlet; otherwise, per stream, a
    pump greenlet reads it from the client and sends it as DATA within the pod's
    flow-control windows while the response comes (full duplex: gRPC client-, server- and
    bidirectional streaming); the request's trailers go as a trailing HEADERS frame. The
    pump stops when the client's body fails (the stream is reset with CANCEL and the error
    reaches the caller), when the pod resets the stream or the connection dies, and when
    the caller ends the response (``close``, ``abort``: the stream is reset with CANCEL
    unless both sides had ended it).

Request headers
    ``:method``, ``:scheme`` (``http``), ``:authority`` (the request's Host, else the pod's
    address), ``:path``, then every other header line (``core.http.h2_request_fields``).
    Our SETTINGS (one frame at the preface) disable server push and set the stream
    window.

The response (``H2PodStream``, an ``exchange.PodResponse``)
    ``reason`` is empty (HTTP/2 has none); ``framing`` is ``core.heads.response_framing``'s
    (NONE for headers that ended the stream: a gRPC trailers-only answer). Never
    ``early``: an HTTP/2 answer before the upload ended is normal, the pump goes on. 1xx
    heads go to the ``interim`` callback (``100`` dropped: activator answers ``Expect``).
    A ``:status`` that is not three digits, or 101 (no protocol switch in HTTP/2), is a bad
    response (the stream is reset with PROTOCOL_ERROR).

Windows
    Each stream's receive window is ``stream_window`` (SETTINGS_INITIAL_WINDOW_SIZE), and
    received DATA is acknowledged only as the caller takes it (``take_body``, ``body``):
    a slow client of the proxy makes the pod wait, and a stream never holds more than its
    window (``buffered``, ``peak_buffered``). The connection window is opened to the most
    HTTP/2 allows, so that one slow stream never stalls the others: the stream windows
    are what bound memory. Our uploads respect the pod's windows and frame size. Server
    push is disabled.

Timeouts (``upstream.Timeouts``), as deadlines (``deadlines``), not socket timeouts
    ``connect`` bounds the TCP connect (the one socket timeout: a shutdown does not
    interrupt a connect) and the wait for the pod's first SETTINGS (requests
    waiting for a connection that opens wait within the connect time of the request that
    opened it). ``response_start`` runs from the moment the request was sent whole (its
    END_STREAM) to the response head, as with HTTP/1.1 pods: a gRPC client-streaming
    call is answered only after its upload, however long the client takes to send it.
    While the body still streams, the wait for the head is bounded by the pod's flow
    control instead: each wait for window before the head is bounded by
    ``response_start`` (a pod that stops taking the body), and by ``total``. ``idle``
    bounds each wait for the pod mid-body; ``total`` bounds the whole exchange from the
    request's headers. A write of the connection the pod does not take within the longest
    ``response_start`` seen ends the connection.

Errors (as the HTTP/1.1 client raises them)
    No connection (refused, unreachable, no SETTINGS within ``connect``) ->
    ``UpstreamConnectError(connected=False, body_read=False)``; a pod that does not speak
    HTTP/2 -> the same as ``UpstreamBadResponse``; a stream refused before any response
    (RST_STREAM REFUSED_STREAM, or above a GOAWAY's last-stream-id) ->
    ``UpstreamConnectError(connected=False, body_read=<the pump read from the client>)``;
    a reset or a dead connection before the response head ->
    ``UpstreamConnectError(connected=True)`` (``UpstreamBadResponse`` when h2 refused what
    the pod sent); no head in time -> ``UpstreamTimeout``. Mid-body: ``UpstreamBodyError``
    (reset, connection gone), ``UpstreamIdle``, ``UpstreamBodyTimeout``. The client's body
    error (``ClientGone``, ``ClientTimeout``, ``ClientBodyError``...) is raised as it is,
    by ``request`` or, once the response began, by ``body``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import gevent
import gevent.event
import h2.config
import h2.connection
import h2.events
import h2.exceptions
from gevent import socket as gsocket
from h2.errors import ErrorCodes
from h2.settings import SettingCodes, Settings
from hyperframe.exceptions import HyperframeError
from hyperframe.frame import GoAwayFrame

from ..base import deadlines
from ..base.exchange import BodySource, InterimCallback, PodRequest, PodResponse
from ..base.h2wire import RECV_SIZE, FrameScanner, H2Wire
from ..core.errors import ClientBodyError, UpstreamBadResponse, UpstreamBodyError, UpstreamConnectError, UpstreamTimeout
from ..core.heads import BodyFraming, Header, response_framing
from ..core.http import h2_request_fields, h2_trailer_fields
from ..core.timeouts import Timeouts
from .http1 import BLOCK_SIZE

__all__ = ["H2PodPool", "H2PodStream"]

log = logging.getLogger("activator")

#: Each stream's receive window: the most a stream buffers when its reader is slow.
STREAM_WINDOW = 1024 * 1024
#: The connection's receive window: the largest HTTP/2 allows (see "Windows").
CONNECTION_WINDOW = 2**31 - 1
#: Streams a connection is assumed to take until the pod's SETTINGS say (RFC 9113
#: recommends that a server take no fewer than 100).
ASSUMED_MAX_STREAMS = 100
#: Connections a request tries for its stream (one may go away or fill up while it waits
#: for it to open): a pod that refuses every stream gets no storm of connections.
CONNECTION_ATTEMPTS = 3

#: The pod is trusted, but what it sends may reach an HTTP/1.1 client: h2 checks its
#: fields; ours are spelled right already.
_H2_CONFIG = h2.config.H2Configuration(
    client_side=True,
    header_encoding=None,
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
    split_outbound_cookies=False,
)
#: What ends a connection: the socket, the pod's EOF, HTTP/2 that h2 (or our scanner) refuses.
_CONNECTION_ERRORS = (OSError, EOFError, h2.exceptions.ProtocolError, HyperframeError)
_NO_HEADERS: list[Header] = []


def parse_status(value: bytes) -> int | None:
    """A ``:status`` value as a number, None unless it is three digits. Pure."""
    if len(value) != 3 or not value.isdigit():
        return None
    return int(value)


@dataclass(frozen=True, slots=True)
class _Cause:
    """Why a stream (or its whole connection) ended before its response did."""

    message: str
    #: False: the pod never took the request (no connection, a refused stream).
    connected: bool = True
    #: The pod broke HTTP/2 (h2 refused what it sent) or sent a malformed head.
    bad_response: bool = False

    def before_head(self, body_read: bool) -> UpstreamConnectError:
        cls = UpstreamBadResponse if self.bad_response else UpstreamConnectError
        return cls(self.message, connected=self.connected, body_read=body_read)


def _wait(watched: Any, wake: gevent.event.Event, deadline: float) -> bool:
    """Wait until ``wake`` is set, or until ``deadline`` (0: none); True if the deadline
    passed. The pattern of every wait: ``wake.clear()``, look at the state, then wait;
    nothing that the reader changes between the clear and the wait can be missed."""
    watched.timed_out = False
    watched.deadline = deadline
    try:
        wake.wait()
    finally:
        watched.deadline = 0.0
    return bool(watched.timed_out)


class H2PodPool:
    """HTTP/2 connections to one pod (``host:port``); see the module docstring."""

    __slots__ = ("host", "port", "where", "stream_window", "_connections", "_closed")

    def __init__(self, host: str, port: int, *, stream_window: int = STREAM_WINDOW) -> None:
        self.host = host
        self.port = port
        self.where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.stream_window = stream_window
        # Invariant: every connection here is alive (not dead) and not closing, in the
        # order they were opened; a new stream goes to the first that takes one.
        self._connections: list[H2PodConnection] = []
        self._closed = False

    def __repr__(self) -> str:
        return f"<H2PodPool {self.where} connections={len(self._connections)} streams={self.stream_count}>"

    @property
    def idle_count(self) -> int:
        """Open connections that carry no stream now."""
        return sum(1 for connection in self._connections if not connection.streams)

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    @property
    def stream_count(self) -> int:
        return sum(len(connection.streams) for connection in self._connections)

    def close(self) -> None:
        """Close the connections once their streams ended (idle ones now); later requests
        still work, on connections closed after them. Does not yield."""
        self._closed = True
        for connection in list(self._connections):
            connection.retire()

    def request(self, request: PodRequest, timeouts: Timeouts) -> H2PodStream:
        """Send one request on a stream; return once the final response head came (the
        body streams on after this returns). Read the response, then ``close()`` it.
        """
        started = time.monotonic()
        if request.body is not None and request.framing is not BodyFraming.NONE:
            request.body.raise_known_error()  # a request whose framing is already known broken reaches no pod
        for _ in range(CONNECTION_ATTEMPTS):
            connection = self._connection_for_a_stream(timeouts)
            connection.wait_ready()
            stream = connection.open_stream(request, timeouts)
            if stream is not None:
                break
            # It went away, or the pod's SETTINGS allow fewer streams than waited for it.
        else:
            raise UpstreamConnectError(
                f"{CONNECTION_ATTEMPTS} connections to {self.where} took no new stream",
                connected=False,
                body_read=False,
            )
        try:
            stream.wait_head(started)
        except BaseException:
            stream.abort()
            raise
        return stream

    def _connection_for_a_stream(self, timeouts: Timeouts) -> H2PodConnection:
        """The first connection that takes a new stream, else a new one. Does not yield."""
        for connection in self._connections:
            if connection.takes_new_streams():
                connection.note_timeouts(timeouts)
                return connection
        connection = H2PodConnection(self, timeouts)
        self._connections.append(connection)
        return connection

    def stream_ended(self, connection: H2PodConnection) -> None:
        """One of ``connection``'s streams ended: retire it if it is empty and not the one
        kept open (see "Connections"). Does not yield."""
        if connection.streams:
            return
        if self._closed or any(c is not connection and c.takes_new_streams() for c in self._connections):
            connection.retire()

    def forget(self, connection: H2PodConnection) -> None:
        """``connection`` is dead. Does not yield."""
        if connection in self._connections:
            self._connections.remove(connection)


class H2PodConnection(H2Wire):
    """One HTTP/2 connection to a pod, its reader and writer greenlets, and its streams.

    Its own deadline bounds the handshake (``connect``); the driver's writer deadline
    bounds each write (the longest ``response_start`` of its requests). Either, when it
    expires, shuts the socket down, which ends the connection.
    """

    __slots__ = (
        "deadline",
        "timed_out",
        "pool",
        "streams",
        "ready",
        "dead",
        "going_away",
        "waiting",
        "_cause",
        "_ready_event",
        "_closing",
    )

    def __init__(self, pool: H2PodPool, timeouts: Timeouts) -> None:
        h2conn = h2.connection.H2Connection(config=_H2_CONFIG)
        h2conn.local_settings = Settings(
            client=True,
            initial_values={SettingCodes.ENABLE_PUSH: 0, SettingCodes.INITIAL_WINDOW_SIZE: pool.stream_window},
        )
        handlers: dict[type[h2.events.Event], Callable[[Any], None]] = {
            h2.events.DataReceived: self._on_data,
            h2.events.WindowUpdated: self._on_window_update,
            h2.events.ResponseReceived: self._on_response,
            h2.events.InformationalResponseReceived: self._on_informational,
            h2.events.TrailersReceived: self._on_trailers,
            h2.events.StreamEnded: self._on_stream_ended,
            h2.events.StreamReset: self._on_stream_reset,
            h2.events.RemoteSettingsChanged: self._on_settings,
        }
        # The socket comes with the connect, in the reader greenlet.
        super().__init__(None, h2conn, FrameScanner(cut_goaway=True), handlers, timeouts.response_start)
        self.deadline = 0.0
        self.timed_out = False
        self.pool = pool
        # Invariant: a stream is here from its HEADERS until its caller ended it.
        self.streams: dict[int, H2PodStream] = {}
        self.ready = False  # the pod's first SETTINGS came: streams may open
        self.dead = False
        self.going_away = False  # no new streams (a GOAWAY, ours or the pod's)
        self.waiting = 0  # requests waiting for this connection to be ready
        self._cause: _Cause | None = None
        self._ready_event = gevent.event.Event()  # set when ready, or dead
        self._closing = False  # close the socket once the outbox is sent
        gevent.spawn(self._run, timeouts.connect)

    def __repr__(self) -> str:
        state = "dead" if self.dead else "going away" if self.going_away else "ready" if self.ready else "opening"
        return f"<H2PodConnection {self.pool.where} {state} streams={len(self.streams)}>"

    def expire(self) -> None:
        """The handshake's deadline passed: shut the socket down (the reader sees it)."""
        self.timed_out = True
        if self.sock is not None:
            try:
                self.sock.shutdown(gsocket.SHUT_RDWR)
            except OSError:
                pass

    # -- taking streams (the request's greenlet) --------------------------------------------

    def _max_streams(self) -> int:
        return self.h2.remote_settings.max_concurrent_streams if self.ready else ASSUMED_MAX_STREAMS

    def takes_new_streams(self) -> bool:
        """Whether a new request may wait for (or open) a stream here. Does not yield."""
        if self.dead or self.going_away:
            return False
        return len(self.streams) + self.waiting < self._max_streams()

    def note_timeouts(self, timeouts: Timeouts) -> None:
        """A request with ``timeouts`` uses this connection: writes may take that long."""
        if timeouts.response_start > self.write_timeout:
            self.write_timeout = timeouts.response_start

    def wait_ready(self) -> None:
        """Wait until the connection is ready (or dead: raise its connect error)."""
        self.waiting += 1
        try:
            self._ready_event.wait()  # the handshake's deadline bounds it
        finally:
            self.waiting -= 1
        cause = self._cause
        if not self.ready and cause is not None:
            raise cause.before_head(body_read=False)

    def open_stream(self, request: PodRequest, timeouts: Timeouts) -> H2PodStream | None:
        """Send the request's HEADERS on a new stream (its pump starts if it has a body);
        None if this connection takes no new stream now. Does not yield."""
        if self.dead or self.going_away:
            return None
        limit = self._max_streams()
        if len(self.streams) >= limit:
            if limit == 0:  # a pod that takes no stream at all: waiting for room would not help
                raise UpstreamConnectError(
                    f"{self.pool.where} allows no HTTP/2 streams", connected=False, body_read=False
                )
            return None
        try:
            stream_id = self.h2.get_next_available_stream_id()
        except h2.exceptions.NoAvailableStreamIDError:
            self.retire()  # its stream ids are used up: new streams go to a new connection
            return None
        has_body = request.has_body
        first = b""
        if has_body:
            body = request.body
            assert body is not None
            if body.buffered():  # what came with the head: a body already known broken goes nowhere
                length = request.content_length
                first = body.read(BLOCK_SIZE if length is None else min(BLOCK_SIZE, length))
                body.raise_known_error()
        fields = h2_request_fields(
            request.method,
            request.target,
            request.headers,
            self.pool.where.encode(),
            request.framing,
            request.content_length,
        )
        self.send_headers(stream_id, fields, end_stream=not has_body)
        stream = H2PodStream(self, stream_id, request.method, timeouts, request.interim)
        self.streams[stream_id] = stream
        if has_body:
            assert request.body is not None
            stream.start_upload(request.body, request.framing, request.content_length, first)
        else:
            stream.upload_ended()
        return stream

    def end_upload(self, stream_id: int, trailers: list[Header]) -> None:
        """END_STREAM, with the trailers as a trailing HEADERS frame if there are any."""
        if trailers:
            self.send_headers(stream_id, trailers, end_stream=True)
        else:
            self.end_stream(stream_id)

    def forget_stream(self, stream: H2PodStream) -> None:
        """The caller ended ``stream``."""
        if self.streams.pop(stream.stream_id, None) is stream:
            if self.going_away and not self.streams:
                self._close_gracefully()
            else:
                self.pool.stream_ended(self)

    def retire(self) -> None:
        """Take no new stream; close once the streams it carries ended."""
        self.going_away = True
        if not self.streams:
            self._close_gracefully()

    def _close_gracefully(self) -> None:
        if self.dead or self._closing:
            return
        self._closing = True
        self.pool.forget(self)
        if self.ready:
            self.h2.close_connection()
        self.stop_writing()

    def _outbox_drained(self) -> bool:
        if self._closing:
            self.lose(f"we closed the connection to {self.pool.where}")
            return True
        return False

    # -- the reader greenlet -----------------------------------------------------------------

    def _run(self, connect_timeout: float) -> None:
        """The reader greenlet: open the connection, then read until it ends."""
        try:
            self._open(connect_timeout)
            while not self.dead:
                self._receive()
        except _CONNECTION_ERRORS as error:
            self._fail(self._cause_of(error) if self.ready else self._handshake_cause(error, connect_timeout))
        except Exception as error:  # a bug: nobody may wait for a reader that is gone
            log.exception("internal error on the h2c connection to %s", self.pool.where)
            self._fail(_Cause(f"internal error on the connection to {self.pool.where}: {error!r}", self.ready))

    def _open(self, connect_timeout: float) -> None:
        """Connect, send our preface and SETTINGS, read until the pod's first SETTINGS."""
        started = time.monotonic()
        # A socket timeout for the connect alone (a shutdown does not interrupt a connect);
        # then the connect time left is the handshake's deadline.
        sock = gsocket.create_connection((self.pool.host, self.pool.port), timeout=connect_timeout)
        sock.setsockopt(gsocket.IPPROTO_TCP, gsocket.TCP_NODELAY, 1)
        sock.settimeout(None)
        self.sock = sock
        self.deadline = started + connect_timeout
        sweeper = deadlines.sweeper()
        sweeper.add(self)
        sweeper.add(self.writer_deadline)
        h2c = self.h2
        h2c.initiate_connection()
        h2c.increment_flow_control_window(CONNECTION_WINDOW - h2c.inbound_flow_control_window)
        sock.sendall(h2c.data_to_send())
        while not self.ready:
            self._receive()
        self.deadline = 0.0
        gevent.spawn(self.write_loop)
        self._ready_event.set()

    def _handshake_cause(self, error: BaseException, connect_timeout: float) -> _Cause:
        where = self.pool.where
        if self.timed_out:
            return _Cause(f"{where} sent no HTTP/2 SETTINGS within {connect_timeout}s", connected=False)
        if isinstance(error, (h2.exceptions.ProtocolError, HyperframeError)):
            return _Cause(f"{where} does not speak HTTP/2: {error}", connected=False, bad_response=True)
        return _Cause(f"connect to {where} failed: {error!r}", connected=False)

    def _cause_of(self, error: BaseException) -> _Cause:
        where = self.pool.where
        if self.writer_deadline.timed_out:
            return _Cause(f"{where} did not take our frames within {self.write_timeout}s")
        if isinstance(error, (h2.exceptions.ProtocolError, HyperframeError)):
            return _Cause(f"{where} broke HTTP/2: {error}", bad_response=True)
        return _Cause(f"the connection to {where} ended: {error!r}")

    def _receive(self) -> None:
        """One recv from the pod, through h2, dispatched. Raises what ends the connection."""
        data = self.sock.recv(RECV_SIZE)
        if not data:
            if self.timed_out or self.writer_deadline.timed_out:
                raise TimeoutError("deadline")
            raise EOFError("the pod closed the connection")
        if not self.receive(data) and not self.dead:
            raise EOFError("the connection was lost")

    def _on_data(self, event: h2.events.DataReceived) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is None:  # its caller ended it while the DATA was on the way
            self.acknowledge(event.stream_id, event.flow_controlled_length)
        else:
            stream.on_data(event.data, event.flow_controlled_length)

    def _on_window_update(self, event: h2.events.WindowUpdated) -> None:
        if event.stream_id:
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.window_opened()
        else:
            for stream in self.streams.values():
                stream.window_opened()

    def _on_response(self, event: h2.events.ResponseReceived) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is not None:
            stream.on_head(event.headers, ended=event.stream_ended is not None)

    def _on_informational(self, event: h2.events.InformationalResponseReceived) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is not None:
            stream.on_head(event.headers, ended=False)

    def _on_trailers(self, event: h2.events.TrailersReceived) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is not None:
            stream.trailers = list(event.headers)

    def _on_stream_ended(self, event: h2.events.StreamEnded) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is not None:
            stream.on_end()

    def _on_stream_reset(self, event: h2.events.StreamReset) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is not None:
            stream.on_reset(event.error_code)

    def _on_settings(self, event: h2.events.RemoteSettingsChanged) -> None:
        if not self.ready:
            self.ready = True
        elif SettingCodes.INITIAL_WINDOW_SIZE in event.changed_settings:
            for stream in self.streams.values():
                stream.window_opened()

    def _goaway_received(self, goaway: GoAwayFrame) -> None:
        """After the frames around it in the same batch: a GOAWAY only says which streams
        (above its last-stream-id) the pod never saw, and those frames are of others."""
        self.going_away = True
        last = goaway.last_stream_id
        message = f"{self.pool.where} sent GOAWAY (error {goaway.error_code}, last stream {last})"
        for stream_id, stream in self.streams.items():
            if stream_id > last:
                stream.on_refused(message)
        if not self.streams:
            self._close_gracefully()

    def _fail(self, cause: _Cause) -> None:
        """The connection is gone: every stream it carried fails with ``cause``. Idempotent;
        does not yield."""
        if self.dead:
            return
        self.dead = True
        self._cause = cause
        self.lose(cause.message)

    def _lost(self, why: str) -> None:
        if not self.dead:
            self.dead = True
            self._cause = _Cause(why)
        cause = self._cause
        assert cause is not None
        self.pool.forget(self)
        sweeper = deadlines.sweeper()
        sweeper.discard(self)
        sweeper.discard(self.writer_deadline)
        if self.sock is not None:
            self.sock.close()
        self._ready_event.set()
        for stream in self.streams.values():
            stream.on_connection_lost(cause)


class _Upload:
    """The request body of one stream, sent by its pump greenlet (see "Greenlets").

    Its ``deadline`` bounds the pump's waits for the pod's window; ``expire`` wakes it."""

    __slots__ = (
        "deadline",
        "timed_out",
        "stream",
        "body",
        "framing",
        "remaining",
        "stopped",
        "greenlet",
        "_wake",
        "_leftover",
    )

    def __init__(self, stream: H2PodStream, body: BodySource, framing: BodyFraming, content_length: int | None) -> None:
        self.deadline = 0.0
        self.timed_out = False
        self._wake = gevent.event.Event()
        self.stream = stream
        self.body = body
        self.framing = framing
        #: Body bytes still to send of a body of known length (None: unknown length).
        self.remaining = content_length if framing is BodyFraming.LENGTH else None
        #: Set by the stream when the body is not wanted any more; the pump checks it
        #: after every wait, before any h2 call.
        self.stopped = False
        #: What the first pass read and could not send yet (the pod's window was short).
        self._leftover = memoryview(b"")
        self.greenlet: gevent.Greenlet | None = None

    def start(self, first: bytes) -> None:
        """Send ``first`` (read already) and what the client's body has here (a small
        upload: all of it, the last DATA frame ending the stream, with no greenlet); the
        rest, if any, by the pump. Does not yield."""
        if first:
            self.stream.body_read = True
            if self.remaining is not None:
                self.remaining -= len(first)
        try:
            if self._send_at_once(first):
                return
        except Exception as error:  # the client's body failed: the caller raises it
            self.stream.upload_failed(error)
            return
        deadlines.sweeper().add(self)
        self.greenlet = gevent.spawn(self._pump)

    def _send_at_once(self, first: bytes) -> bool:
        """Read and send what needs no waiting; True when the body went whole."""
        stream = self.stream
        body = self.body
        connection = stream.connection
        while first or body.buffered():
            piece, first = (first, b"") if first else (self._read(), b"")
            if not piece:
                stream.upload_ended(h2_trailer_fields(body.trailers))
                return True
            view = memoryview(piece)
            last = body.exhausted() and not body.trailers
            while view:
                window = connection.window(stream.stream_id)
                if not window:
                    self._leftover = view
                    return False
                if last and len(view) <= window:
                    connection.send_data(stream.stream_id, view, end_stream=True)
                    stream.upload_ended(sent_end=True)
                    return True
                connection.send_data(stream.stream_id, view[:window])
                view = view[window:]
        return False

    def _read(self) -> bytes:
        """The next piece of the client's body (it may wait). Raises the client's errors."""
        remaining = self.remaining
        piece = self.body.read(BLOCK_SIZE if remaining is None else min(BLOCK_SIZE, remaining))
        if piece:
            self.stream.body_read = True
            if remaining is not None:
                self.remaining = remaining - len(piece)
        elif remaining:
            raise ClientBodyError("the request body ended before its Content-Length")
        return piece

    def stop(self) -> None:
        """Stop at the next chance (the pump's waits are woken). Does not yield."""
        self.stopped = True
        self._wake.set()

    def window_opened(self) -> None:
        self._wake.set()

    def expire(self) -> None:
        self.timed_out = True
        self._wake.set()

    def _pump(self) -> None:
        stream = self.stream
        try:
            if self._send_body():
                stream.upload_ended(h2_trailer_fields(self.body.trailers))
        except Exception as error:  # the client's body failed (or a bug): the caller raises it
            if not self.stopped:
                stream.upload_failed(error)
        finally:
            deadlines.sweeper().discard(self)

    def _send_body(self) -> bool:
        """Read the body and send it; False if stopped first. Raises the client's errors."""
        if self._leftover and not self._send_piece(self._leftover):
            return False
        while self.remaining is None or self.remaining > 0:
            piece = self._read()
            if self.stopped:
                return False
            if not piece:
                return True
            if not self._send_piece(memoryview(piece)):
                return False
        return True

    def _send_piece(self, view: memoryview) -> bool:
        connection = self.stream.connection
        stream_id = self.stream.stream_id
        while view:
            window = self._wait_for_window()
            if not window:
                return False
            connection.send_data(stream_id, view[:window])
            view = view[window:]
        return True

    def _wait_for_window(self) -> int:
        """The bytes the next DATA frame may carry (0: stopped). Before the response head, a
        pod that opens no window within ``response_start`` is a timeout."""
        stream = self.stream
        timeout = stream.timeouts.response_start
        expired = False
        while True:
            self._wake.clear()
            if self.stopped:
                return 0
            window = stream.connection.window(stream.stream_id)
            if window > 0:
                return window
            if expired and not stream.head_done:
                raise UpstreamTimeout(f"{stream.connection.pool.where} took no request body for {timeout}s")
            expired = _wait(self, self._wake, 0.0 if stream.head_done else time.monotonic() + timeout)


class H2PodStream(PodResponse):
    """One request's stream and, from its head on, the pod's answer (``exchange.PodResponse``).

    The reader greenlet fills it (``on_*``: none yields); the caller's greenlet waits on
    it (``wait_head``, ``body``); the pump, if any, sends the request body. Its deadline
    bounds the caller's waits; ``expire`` only wakes it (the socket is shared).
    """

    __slots__ = (
        "connection",
        "stream_id",
        "timeouts",
        "body_read",
        "buffered",
        "peak_buffered",
        "_method",
        "_wake",
        "_interim",
        "_interims",
        "_pieces",
        "_unacknowledged",
        "_total_deadline",
        "_sent_whole_at",
        "_cause",
        "_upload",
        "_upload_error",
        "_sent_end",
        "_reset",
        "_open",
    )

    def __init__(
        self,
        connection: H2PodConnection,
        stream_id: int,
        method: str,
        timeouts: Timeouts,
        interim: InterimCallback | None,
    ) -> None:
        super().__init__(connection.sock)
        self.connection = connection
        self.stream_id = stream_id
        self.timeouts = timeouts
        #: Some of the client's body was read (a refused stream may not be replayed then).
        self.body_read = False
        #: Body bytes received and not taken by the caller yet, and the most there ever were.
        self.buffered = 0
        self.peak_buffered = 0
        self._method = method
        self._wake = gevent.event.Event()
        self._interim = interim
        self._interims: list[tuple[int, list[Header]]] = []
        self._pieces: list[bytes] = []
        self._unacknowledged = 0  # flow-controlled bytes of _pieces (padding included)
        self._total_deadline: float | None = None
        self._sent_whole_at: float | None = None  # END_STREAM queued (None while the body streams)
        self._cause: _Cause | None = None
        self._upload: _Upload | None = None
        self._upload_error: Exception | None = None
        self._sent_end = False
        self._reset = False  # a RST_STREAM went either way
        self._open = True
        deadlines.sweeper().add(self)

    def expire(self) -> None:
        """The deadline passed: wake the waiting greenlet. Does not yield."""
        self.timed_out = True
        self._wake.set()

    def __repr__(self) -> str:
        return f"<H2PodStream {self.connection.pool.where} #{self.stream_id} {self.head.status} {self.framing.value}>"

    # -- the request body (the pump's greenlet, or open_stream) ------------------------------

    def start_upload(
        self, body: BodySource, framing: BodyFraming, content_length: int | None, first: bytes = b""
    ) -> None:
        """Send the request body (``first``: what of it was read already)."""
        self._upload = upload = _Upload(self, body, framing, content_length)
        upload.start(first)

    def upload_ended(self, trailers: list[Header] = _NO_HEADERS, *, sent_end: bool = False) -> None:
        """The request was sent whole (HEADERS or the last DATA with END_STREAM, or the
        body's end: ``sent_end`` says whether END_STREAM went already). Does not yield."""
        if self._upload is not None and not sent_end:
            self.connection.end_upload(self.stream_id, trailers)
        self._sent_end = True
        self._sent_whole_at = time.monotonic()
        self._wake.set()  # response_start runs from now

    def upload_failed(self, error: Exception) -> None:
        """The client's body failed: reset the stream; the caller raises ``error``. Does not yield."""
        self._upload_error = error
        self._reset_on_wire()
        self._wake.set()

    def window_opened(self) -> None:
        if self._upload is not None:
            self._upload.window_opened()

    # -- what the reader dispatches (none yields) --------------------------------------------

    def on_head(self, fields: list[Header], ended: bool) -> None:
        """A head (1xx or final); ``ended``: it also ended the stream."""
        status = parse_status(fields[0][1]) if fields and fields[0][0] == b":status" else None
        if status is None or status == 101:  # no protocol switch in HTTP/2 (RFC 9113 8.6)
            self._fail(_Cause(f"{self.connection.pool.where} sent a malformed :status", bad_response=True))
            self._reset_on_wire(ErrorCodes.PROTOCOL_ERROR)
            return
        regular = [field for field in fields if field[0][:1] != b":"]
        if status < 200:
            if status != 100:  # ours to give (activator answers Expect itself)
                self._interims.append((status, regular))
                self._wake.set()
            return
        self.head.fill_from_h2(status, regular)
        self.framing = response_framing(self._method, self.head, http2=True, ended=ended)
        self.head_done = True
        self._wake.set()

    def on_data(self, data: bytes, flow_controlled: int) -> None:
        if data:
            self._pieces.append(data)
            self.buffered += len(data)
            if self.buffered > self.peak_buffered:
                self.peak_buffered = self.buffered
        self._unacknowledged += flow_controlled
        self._wake.set()

    def on_trailers(self, fields: list[Header]) -> None:
        self.trailers = list(fields)

    def on_end(self) -> None:
        if self.head_done:
            self.complete = True
        self._wake.set()

    def on_reset(self, code: int) -> None:
        self._reset = True
        self._stop_upload()
        if self.complete:
            return  # "stop sending" after a complete answer (RFC 9113 8.1): nothing is lost
        where = self.connection.pool.where
        if code == ErrorCodes.REFUSED_STREAM and not self.head_done:
            self._fail(_Cause(f"{where} refused the stream", connected=False))
        else:
            self._fail(_Cause(f"{where} reset the stream ({_code_name(code)})"))

    def on_refused(self, message: str) -> None:
        """Above a GOAWAY's last-stream-id: the pod never processed it."""
        if not self.head_done:
            self._stop_upload()
            self._fail(_Cause(message, connected=False))

    def on_connection_lost(self, cause: _Cause) -> None:
        self._stop_upload()
        if not self.complete:
            self._fail(cause)

    def _fail(self, cause: _Cause) -> None:
        if self._cause is None:
            self._cause = cause
        self._stop_upload()
        self._wake.set()

    def _stop_upload(self) -> None:
        if self._upload is not None:
            self._upload.stop()

    # -- the caller's greenlet ---------------------------------------------------------------

    def wait_head(self, started: float) -> None:
        """Wait for the final response head (relaying 1xx heads to ``interim``); raises the
        errors of the module docstring. ``started``: when the exchange began."""
        self._total_deadline = self.timeouts.total_deadline(started)
        expired = False
        while True:
            self._wake.clear()
            if self._interims:
                self._relay_interims()  # may yield: what the reader sets meanwhile is seen below
            if self.head_done:
                return
            self._raise_failure()
            if expired:
                raise self._head_timeout()
            expired = _wait(self, self._wake, self.timeouts.head_deadline(self._sent_whole_at, self._total_deadline))

    def _head_timeout(self) -> UpstreamTimeout:
        where = self.connection.pool.where
        if self.timeouts.ran_out(time.monotonic(), self._total_deadline, deadlines.TICK):
            return UpstreamTimeout(f"{where} did not answer within {self.timeouts.total}s")
        return UpstreamTimeout(f"{where} sent no response head within {self.timeouts.response_start}s")

    def _relay_interims(self) -> None:
        interims, self._interims = self._interims, []
        interim = self._interim
        if interim is not None:
            for status, fields in interims:
                interim(status, b"", fields)

    def _raise_failure(self) -> None:
        """Raise what ended the exchange (the client's body error first: it is the cause)."""
        if self._upload_error is not None:
            raise self._upload_error
        cause = self._cause
        if cause is not None:
            if self.head_done:
                raise UpstreamBodyError(f"the response body broke off: {cause.message}")
            raise cause.before_head(self.body_read)

    def take_body(self) -> bytes:
        """The body bytes here now (all of it when ``complete``), without waiting; the pod
        may send as much more."""
        pieces = self._pieces
        if not pieces:
            return b""
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self.buffered = 0
        acknowledged, self._unacknowledged = self._unacknowledged, 0
        self.connection.acknowledge(self.stream_id, acknowledged)
        return data

    def body(self) -> Iterator[bytes]:
        """Yield the body as it arrives (what came since the last piece, joined).

        Raises ``UpstreamBodyError`` (reset, connection gone), ``UpstreamIdle``,
        ``UpstreamBodyTimeout``, or the client's body error. Iterate it at most once.
        """
        expired = False
        while True:
            self._wake.clear()
            if self._pieces:
                expired = False
                yield self.take_body()
                continue
            if self.complete:
                return
            self._raise_failure()
            if expired:
                raise self._cut_by_time()
            deadline = self.timeouts.body_deadline(time.monotonic(), self._total_deadline)
            if deadline is None:
                raise self._cut_by_time()
            expired = _wait(self, self._wake, deadline)

    def _cut_by_time(self) -> UpstreamBodyError:
        self.abort()
        return self.timeouts.body_timeout(time.monotonic(), self._total_deadline, deadlines.TICK)

    def close(self) -> None:
        """End the stream: reset (CANCEL) unless both sides ended it; the connection stays
        for the other streams. Stops the pump (it may be waiting for the client). Idempotent."""
        if not self._open:
            return
        self._open = False
        upload = self._upload
        if upload is not None:
            upload.stop()
        if not (self._sent_end and self.complete):
            self._reset_on_wire()
        self.buffered = 0
        self._pieces.clear()
        unacknowledged, self._unacknowledged = self._unacknowledged, 0
        self.connection.acknowledge(self.stream_id, unacknowledged)  # the connection's window
        self.connection.forget_stream(self)
        deadlines.sweeper().discard(self)
        if upload is not None and upload.greenlet is not None:
            # It may be blocked reading the client: stopped before the client's
            # connection moves on (another read there would collide with it).
            upload.greenlet.kill(block=True)

    def abort(self) -> None:
        """Drop the stream now: for a stream, the same as ``close`` (the connection stays)."""
        self.close()

    def detach(self) -> Any:
        raise NotImplementedError("no tunnels over h2c: an HTTP/2 pod never answers 101")

    def _reset_on_wire(self, code: ErrorCodes = ErrorCodes.CANCEL) -> None:
        if not self._reset:
            self._reset = True
            self.connection.reset(self.stream_id, code)


def _code_name(code: int) -> str:
    try:
        return ErrorCodes(code).name
    except ValueError:
        return f"error {code}"

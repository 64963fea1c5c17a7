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
    taken out of the pod's bytes before h2 sees them (``GoawayCutter``: frames are
    delimited by their 9-byte header, and only a GOAWAY is parsed, by hyperframe).

Greenlets, and the order of frames
    Per connection, one reader greenlet (which also connects and waits for the pod's first
    SETTINGS) feeds h2 and dispatches its events to the streams, and one writer greenlet
    sends what h2 produced. Every h2 call is made without yielding and what it produced is
    moved at once to the connection's outbox, which only the writer drains: frames go out
    in the order h2 made them, whichever greenlet made them. Per stream with a body, a
    pump greenlet reads it from the client and sends it as DATA within the pod's
    flow-control windows while the response comes (full duplex: gRPC client-, server- and
    bidirectional streaming); the request's trailers go as a trailing HEADERS frame. The
    pump stops when the client's body fails (the stream is reset with CANCEL and the error
    reaches the caller), when the pod resets the stream or the connection dies, and when
    the caller ends the response (``close``, ``abort``: the stream is reset with CANCEL
    unless both sides had ended it).

Request headers
    ``:method``, ``:scheme`` (``http``), ``:authority`` (the request's Host, else the pod's
    address), ``:path``, then every other header line in its order, its name lower-cased,
    except those HTTP/2 forbids (``connection``, ``keep-alive``, ``proxy-connection``,
    ``transfer-encoding``, ``upgrade``, ``host``, carried by ``:authority``, and any
    ``te``); then ``te: trailers`` always (gRPC servers require it: it says we accept trailers), and
    ``content-length`` for a body of known length. Trailers follow the same rules.

The response (``H2PodStream``, an ``exchange.PodResponse``)
    ``reason`` is empty (HTTP/2 has none); ``framing`` is NONE for HEAD, 204, 304, a
    ``content-length: 0`` or headers that ended the stream (a gRPC trailers-only answer),
    LENGTH with a content-length, else CHUNKED (DATA frames, trailers possible). Never
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
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gevent
import gevent.event
import h2.config
import h2.connection
import h2.events
import h2.exceptions
from gevent import socket as gsocket
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hyperframe.exceptions import HyperframeError
from hyperframe.frame import Frame, GoAwayFrame

from . import deadlines
from .core.errors import (
    ClientBodyError,
    UpstreamBadResponse,
    UpstreamConnectError,
    UpstreamTimeout,
)
from .core.http import BodyFraming, Header
from .exchange import InterimCallback
from .upstream import BLOCK_SIZE, BodySource, Timeouts, UpstreamBodyError, UpstreamBodyTimeout, UpstreamIdle

if TYPE_CHECKING:
    from .exchange import PodResponse

__all__ = ["GoawayCutter", "H2PodPool", "H2PodStream", "request_fields", "trailer_fields"]

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

#: Header names HTTP/2 forbids (RFC 9113 8.2.2), ``host`` (``:authority`` carries it) and
#: ``te`` (we always send ``te: trailers``, the only value HTTP/2 allows).
NOT_IN_HTTP2 = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade", b"host", b"te")
)

_FRAME_HEADER_SIZE = 9
_GOAWAY_TYPE = GoAwayFrame.type
#: The largest frame we accept (our SETTINGS_MAX_FRAME_SIZE is h2's default).
_MAX_FRAME_SIZE = 16384
_H2_CONFIG = h2.config.H2Configuration(client_side=True, header_encoding=None)
#: What ends a connection: the socket, the pod's EOF, HTTP/2 that h2 (or our cutter) refuses.
_CONNECTION_ERRORS = (OSError, EOFError, h2.exceptions.ProtocolError, HyperframeError)
_BODILESS_STATUSES = frozenset((204, 304))
_NO_HEADERS: list[Header] = []


def request_fields(
    method: str,
    target: bytes,
    headers: Iterable[Header],
    default_authority: bytes,
    framing: BodyFraming,
    content_length: int | None,
) -> list[Header]:
    """The HTTP/2 header block of a request (see "Request headers"). Pure."""
    authority = None
    regular: list[Header] = []
    for name, value in headers:
        lower = name.lower()
        if lower == b"host":
            if authority is None:
                authority = value
        elif _travels(lower):
            regular.append((lower, value))
    fields = [
        (b":method", method.encode("ascii")),
        (b":scheme", b"http"),
        (b":authority", default_authority if authority is None else authority),
        (b":path", target),
        *regular,
        (b"te", b"trailers"),
    ]
    if framing is BodyFraming.LENGTH:
        fields.append((b"content-length", b"%d" % (content_length or 0)))
    return fields


def trailer_fields(trailers: Iterable[Header]) -> list[Header]:
    """Request trailers as HTTP/2 sends them: names lower-cased, forbidden ones dropped. Pure."""
    return [(lower, value) for lower, value in ((n.lower(), v) for n, v in trailers) if _travels(lower)]


def _travels(lower: bytes) -> bool:
    return lower not in NOT_IN_HTTP2 and lower[:1] != b":"


def parse_status(value: bytes) -> int | None:
    """A ``:status`` value as a number, None unless it is three digits. Pure."""
    if len(value) != 3 or not value.isdigit():
        return None
    return int(value)


class GoawayCutter:
    """Takes the GOAWAY frames out of the bytes a pod sends (see "GOAWAY").

    Frames are delimited by their 9-byte header (RFC 9113 4.1: a 24-bit payload length,
    then the type); every frame but a GOAWAY passes on untouched and in order, only a
    GOAWAY is parsed (by hyperframe, which also checks it). A frame header split across
    reads is held back until it is whole, so that a GOAWAY is never half passed on. A
    frame longer than we accept is refused at its header (h2 would wait for all of it
    first: an HTTP/1.x answer, read as a frame header, announces megabytes).
    """

    __slots__ = ("_held", "_payload_left", "_goaway")

    def __init__(self) -> None:
        self._held = b""  # the start of a frame header that is not whole yet
        self._payload_left = 0  # payload bytes of the current frame still to come
        self._goaway: bytearray | None = None  # the GOAWAY being collected, its header included

    def feed(self, data: bytes) -> tuple[bytes, list[GoAwayFrame]]:
        """The bytes for h2, and the GOAWAY frames that ended in ``data``, in order.

        Raises ``HyperframeError`` for a malformed GOAWAY. Does not yield.
        """
        if self._held:
            data = self._held + data
            self._held = b""
        passed: list[bytes] = []
        goaways: list[GoAwayFrame] = []
        end = len(data)
        position = 0
        run_start = 0  # where the bytes to pass on (since the last GOAWAY) begin
        while position < end:
            if self._payload_left:
                step = min(self._payload_left, end - position)
                if self._goaway is not None:
                    self._goaway += data[position : position + step]
                position += step
                self._payload_left -= step
            elif end - position < _FRAME_HEADER_SIZE:
                self._held = data[position:]
                break
            else:
                self._payload_left = int.from_bytes(data[position : position + 3], "big")
                if self._payload_left > _MAX_FRAME_SIZE:
                    raise HyperframeError(f"a frame of {self._payload_left} bytes (at most {_MAX_FRAME_SIZE})")
                if data[position + 3] == _GOAWAY_TYPE:
                    passed.append(data[run_start:position])
                    self._goaway = bytearray(data[position : position + _FRAME_HEADER_SIZE])
                position += _FRAME_HEADER_SIZE
            if self._goaway is not None and not self._payload_left:
                goaways.append(_parse_goaway(self._goaway))
                self._goaway = None
                run_start = position
        if self._goaway is None:
            passed.append(data[run_start:position])
        return b"".join(passed), goaways


def _parse_goaway(frame_bytes: bytearray) -> GoAwayFrame:
    view = memoryview(frame_bytes)
    frame, _ = Frame.parse_frame_header(view[:_FRAME_HEADER_SIZE])
    frame.parse_body(view[_FRAME_HEADER_SIZE:])
    assert isinstance(frame, GoAwayFrame)
    return frame


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


class _Waiter(deadlines.Watched):
    """A greenlet's waits on one stream, woken by the reader or by its deadline.

    The pattern of every wait: ``_wake.clear()``, look at the state, then ``_wait``;
    nothing that the reader changes between the clear and the wait can be missed.
    """

    __slots__ = ("_wake",)

    def __init__(self, sock: Any) -> None:
        super().__init__(sock)
        self._wake = gevent.event.Event()

    def expire(self) -> None:
        """The deadline passed: wake the waiting greenlet (the socket is shared: it stays
        open). Does not yield."""
        self.timed_out = True
        self._wake.set()

    def _wait(self, deadline: float) -> bool:
        """Wait until woken, or until ``deadline`` (0: none); True if the deadline passed."""
        self.timed_out = False
        self.deadline = deadline
        try:
            self._wake.wait()
        finally:
            self.deadline = 0.0
        return self.timed_out


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

    def request(
        self,
        method: str,
        target: bytes,
        headers: list[Header],
        body: BodySource | None,
        framing: BodyFraming,
        content_length: int | None,
        timeouts: Timeouts,
        interim: InterimCallback | None = None,
    ) -> H2PodStream:
        """Send one request on a stream; return once the final response head came.

        ``headers``: the end-to-end header lines (``core.http.pod_request_headers``);
        ``framing``/``content_length``: how ``body`` is sent (it streams on after this
        returns). Read the response, then ``close()`` it.
        """
        started = time.monotonic()
        if body is not None and framing is not BodyFraming.NONE:
            body.raise_known_error()  # a request whose framing is already known broken reaches no pod
        for _ in range(CONNECTION_ATTEMPTS):
            connection = self._connection_for_a_stream(timeouts)
            connection.wait_ready()
            stream = connection.open_stream(method, target, headers, body, framing, content_length, timeouts, interim)
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


class H2PodConnection(deadlines.Watched):
    """One HTTP/2 connection to a pod, its reader and writer greenlets, and its streams.

    Its own deadline bounds the handshake (``connect``), then each write; ``expire``
    shuts the socket down, which ends the connection.
    """

    __slots__ = (
        "pool",
        "h2",
        "streams",
        "ready",
        "dead",
        "going_away",
        "waiting",
        "write_timeout",
        "_cause",
        "_ready_event",
        "_outbox",
        "_writable",
        "_closing",
        "_cutter",
        "_handlers",
    )

    def __init__(self, pool: H2PodPool, timeouts: Timeouts) -> None:
        super().__init__(None)  # the socket comes with the connect, in the reader greenlet
        self.pool = pool
        self.h2 = h2.connection.H2Connection(config=_H2_CONFIG)
        # Invariant: a stream is here from its HEADERS until its caller ended it.
        self.streams: dict[int, H2PodStream] = {}
        self.ready = False  # the pod's first SETTINGS came: streams may open
        self.dead = False
        self.going_away = False  # no new streams (a GOAWAY, ours or the pod's)
        self.waiting = 0  # requests waiting for this connection to be ready
        self.write_timeout = timeouts.response_start
        self._cause: _Cause | None = None
        self._ready_event = gevent.event.Event()  # set when ready, or dead
        self._outbox: deque[bytes] = deque()
        self._writable = gevent.event.Event()
        self._closing = False  # close the socket once the outbox is sent
        self._cutter = GoawayCutter()
        self._handlers: dict[type[h2.events.Event], Callable[[Any], None]] = {
            h2.events.DataReceived: self._on_data,
            h2.events.WindowUpdated: self._on_window_update,
            h2.events.ResponseReceived: self._on_response,
            h2.events.InformationalResponseReceived: self._on_informational,
            h2.events.TrailersReceived: self._on_trailers,
            h2.events.StreamEnded: self._on_stream_ended,
            h2.events.StreamReset: self._on_stream_reset,
            h2.events.RemoteSettingsChanged: self._on_settings,
        }
        gevent.spawn(self._run, timeouts.connect)

    def __repr__(self) -> str:
        state = "dead" if self.dead else "going away" if self.going_away else "ready" if self.ready else "opening"
        return f"<H2PodConnection {self.pool.where} {state} streams={len(self.streams)}>"

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

    def open_stream(
        self,
        method: str,
        target: bytes,
        headers: list[Header],
        body: BodySource | None,
        framing: BodyFraming,
        content_length: int | None,
        timeouts: Timeouts,
        interim: InterimCallback | None,
    ) -> H2PodStream | None:
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
        has_body = (
            body is not None
            and framing is not BodyFraming.NONE
            and not (framing is BodyFraming.LENGTH and not content_length)
        )
        fields = request_fields(method, target, headers, self.pool.where.encode(), framing, content_length)
        self.h2.send_headers(stream_id, fields, end_stream=not has_body)
        stream = H2PodStream(self, stream_id, method, timeouts, interim)
        self.streams[stream_id] = stream
        if has_body:
            assert body is not None
            stream.start_upload(body, framing, content_length)
        else:
            stream.upload_ended()
        self._flush()
        return stream

    # -- h2 calls for the streams (each does not yield) ---------------------------------------

    def send_window(self, stream_id: int) -> int:
        """How many body bytes one DATA frame may carry on ``stream_id`` now."""
        if self.dead:
            return 0
        return min(self.h2.local_flow_control_window(stream_id), self.h2.max_outbound_frame_size)

    def send_data(self, stream_id: int, data: memoryview) -> None:
        if not self.dead:
            self.h2.send_data(stream_id, data)
            self._flush()

    def end_upload(self, stream_id: int, trailers: list[Header]) -> None:
        """END_STREAM, with the trailers as a trailing HEADERS frame if there are any."""
        if self.dead:
            return
        if trailers:
            self.h2.send_headers(stream_id, trailers, end_stream=True)
        else:
            self.h2.end_stream(stream_id)
        self._flush()

    def reset(self, stream_id: int, code: ErrorCodes) -> None:
        if self.dead:
            return
        try:
            self.h2.reset_stream(stream_id, code)
        except h2.exceptions.StreamClosedError:
            pass  # h2 closed it on its own (it resets a stream that broke its rules)
        self._flush()

    def acknowledge(self, stream_id: int, flow_controlled: int) -> None:
        """The caller took ``flow_controlled`` bytes of ``stream_id``: the pod may send more."""
        if not self.dead and flow_controlled:
            self.h2.acknowledge_received_data(flow_controlled, stream_id)
            self._flush()

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
            self._flush()
        self._writable.set()

    def _flush(self) -> None:
        """Move what h2 produced to the outbox (the writer sends it, in this order)."""
        data = self.h2.data_to_send()
        if data:
            self._outbox.append(data)
            self._writable.set()

    # -- the reader greenlet -----------------------------------------------------------------

    def _run(self, connect_timeout: float) -> None:
        """The reader greenlet: open the connection, then read until it ends."""
        try:
            self._open(connect_timeout)
            self._read_frames()
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
        deadlines.sweeper().add(self)
        h2c = self.h2
        h2c.initiate_connection()
        h2c.update_settings({SettingCodes.ENABLE_PUSH: 0, SettingCodes.INITIAL_WINDOW_SIZE: self.pool.stream_window})
        h2c.increment_flow_control_window(CONNECTION_WINDOW - h2c.inbound_flow_control_window)
        sock.sendall(h2c.data_to_send())
        while not self.ready:
            self._receive()
        self.deadline = 0.0
        gevent.spawn(self._write_frames)
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
        if self.timed_out:
            return _Cause(f"{where} did not take our frames within {self.write_timeout}s")
        if isinstance(error, (h2.exceptions.ProtocolError, HyperframeError)):
            return _Cause(f"{where} broke HTTP/2: {error}", bad_response=True)
        return _Cause(f"the connection to {where} ended: {error!r}")

    def _read_frames(self) -> None:
        while not self.dead:
            self._receive()

    def _receive(self) -> None:
        """One recv from the pod, through h2, dispatched. Raises what ends the connection."""
        data = self.sock.recv(BLOCK_SIZE)
        if not data:
            if self.timed_out:
                raise TimeoutError("deadline")
            raise EOFError("the pod closed the connection")
        data, goaways = self._cutter.feed(data)
        if data:
            handlers = self._handlers
            for event in self.h2.receive_data(data):
                handler = handlers.get(type(event))
                if handler is not None:
                    handler(event)
        # After the frames around them in the same read: a GOAWAY only says which streams
        # (above its last-stream-id) the pod never saw, and those frames are of others.
        for goaway in goaways:
            self._on_goaway(goaway)
        self._flush()  # what h2 answered (SETTINGS and PING acknowledgements, resets)

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
            stream.on_trailers(event.headers)

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

    def _on_goaway(self, goaway: GoAwayFrame) -> None:
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
        self.pool.forget(self)
        deadlines.sweeper().discard(self)
        if self.sock is not None:
            self.sock.close()  # the writer, if it waits on the socket, gets an error
        self._outbox.clear()
        self._writable.set()
        self._ready_event.set()
        for stream in self.streams.values():
            stream.on_connection_lost(cause)

    # -- the writer greenlet -----------------------------------------------------------------

    def _write_frames(self) -> None:
        outbox = self._outbox
        sock = self.sock
        while not self.dead:
            if not outbox:
                if self._closing:
                    self._fail(_Cause(f"we closed the connection to {self.pool.where}"))
                    return
                self._writable.clear()
                self._writable.wait()
                continue
            data = outbox.popleft() if len(outbox) == 1 else b"".join(outbox)
            outbox.clear()
            self.deadline = time.monotonic() + self.write_timeout
            try:
                sock.sendall(data)
            except OSError as error:
                self._fail(self._cause_of(error))
                return
            finally:
                self.deadline = 0.0


class _Upload(_Waiter):
    """The request body of one stream, sent by its pump greenlet (see "Greenlets")."""

    __slots__ = ("stream", "body", "framing", "content_length", "stopped", "greenlet")

    def __init__(self, stream: H2PodStream, body: BodySource, framing: BodyFraming, content_length: int | None) -> None:
        super().__init__(stream.connection.sock)
        self.stream = stream
        self.body = body
        self.framing = framing
        self.content_length = content_length
        #: Set by the stream when the body is not wanted any more; the pump checks it
        #: after every wait, before any h2 call.
        self.stopped = False
        deadlines.sweeper().add(self)
        self.greenlet = gevent.spawn(self._pump)

    def stop(self) -> None:
        """Stop at the next chance (the pump's waits are woken). Does not yield."""
        self.stopped = True
        self._wake.set()

    def window_opened(self) -> None:
        self._wake.set()

    def _pump(self) -> None:
        stream = self.stream
        try:
            if self._send_body():
                stream.upload_ended(trailer_fields(self.body.trailers))
        except Exception as error:  # the client's body failed (or a bug): the caller raises it
            if not self.stopped:
                stream.upload_failed(error)
        finally:
            deadlines.sweeper().discard(self)

    def _send_body(self) -> bool:
        """Read the body and send it; False if stopped first. Raises the client's errors."""
        stream = self.stream
        body = self.body
        remaining = self.content_length if self.framing is BodyFraming.LENGTH else None
        while remaining is None or remaining > 0:
            piece = body.read(BLOCK_SIZE if remaining is None else min(BLOCK_SIZE, remaining))
            if piece:
                stream.body_read = True
            if self.stopped:
                return False
            if not piece:
                if remaining:
                    raise ClientBodyError("the request body ended before its Content-Length")
                return True
            if remaining is not None:
                remaining -= len(piece)
            if not self._send_piece(piece):
                return False
        return True

    def _send_piece(self, piece: bytes) -> bool:
        view = memoryview(piece)
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
            window = stream.connection.send_window(stream.stream_id)
            if window > 0:
                return window
            if expired and not stream.head_done:
                raise UpstreamTimeout(f"{stream.connection.pool.where} took no request body for {timeout}s")
            expired = self._wait(0.0 if stream.head_done else time.monotonic() + timeout)


class H2PodStream(_Waiter):
    """One request's stream and, from its head on, the pod's answer (``exchange.PodResponse``).

    The reader greenlet fills it (``on_*``: none yields); the caller's greenlet waits on
    it (``wait_head``, ``body``); the pump, if any, sends the request body.
    """

    __slots__ = (
        "connection",
        "stream_id",
        "timeouts",
        "status",
        "reason",
        "headers",
        "lower_names",
        "connection_values",
        "framing",
        "content_length",
        "early",
        "upgraded",
        "tunnel_data",
        "complete",
        "trailers",
        "head_done",
        "body_read",
        "buffered",
        "peak_buffered",
        "_head_only",
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
        self.status = 0
        self.reason = b""
        self.headers: list[Header] = []
        self.lower_names: list[bytes] = []
        self.connection_values: list[bytes] = []
        self.framing = BodyFraming.NONE
        self.content_length: int | None = None
        self.early = False
        self.upgraded = False
        self.tunnel_data = b""
        self.complete = False  # the pod ended the stream: the whole body is here
        self.trailers: list[Header] = []
        self.head_done = False
        #: Some of the client's body was read (a refused stream may not be replayed then).
        self.body_read = False
        #: Body bytes received and not taken by the caller yet, and the most there ever were.
        self.buffered = 0
        self.peak_buffered = 0
        self._head_only = method == "HEAD"
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

    def __repr__(self) -> str:
        return f"<H2PodStream {self.connection.pool.where} #{self.stream_id} {self.status} {self.framing.value}>"

    # -- the request body (the pump's greenlet, or open_stream) ------------------------------

    def start_upload(self, body: BodySource, framing: BodyFraming, content_length: int | None) -> None:
        self._upload = _Upload(self, body, framing, content_length)

    def upload_ended(self, trailers: list[Header] = _NO_HEADERS) -> None:
        """The request was sent whole (HEADERS with END_STREAM, or the pump's end). Does not yield."""
        if self._upload is not None:
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
        self.status = status
        self.headers = regular
        self.lower_names = [name for name, _ in regular]
        for name, value in regular:
            if name == b"content-length":
                self.content_length = int(value)  # h2 has checked it
        if ended or self._head_only or status in _BODILESS_STATUSES or self.content_length == 0:
            self.framing = BodyFraming.NONE
        elif self.content_length is not None:
            self.framing = BodyFraming.LENGTH
        else:
            self.framing = BodyFraming.CHUNKED
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
        total = self.timeouts.total
        self._total_deadline = None if total is None else started + total
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
            expired = self._wait(self._head_deadline())

    def _head_deadline(self) -> float:
        deadline = self._total_deadline
        if self._sent_whole_at is not None:
            whole = self._sent_whole_at + self.timeouts.response_start
            deadline = whole if deadline is None else min(deadline, whole)
        return 0.0 if deadline is None else deadline

    def _head_timeout(self) -> UpstreamTimeout:
        where = self.connection.pool.where
        if self._total_deadline is not None and time.monotonic() >= self._total_deadline - deadlines.TICK:
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
            deadline = self._body_deadline()
            if deadline is None:
                raise self._cut_by_time()
            expired = self._wait(deadline)

    def _body_deadline(self) -> float | None:
        """The deadline of the next wait mid-body (0: none), None if ``total`` is over."""
        now = time.monotonic()
        total = self._total_deadline
        if total is not None and total <= now:
            return None
        idle = self.timeouts.idle
        if idle is None:
            return 0.0 if total is None else total
        return now + idle if total is None else min(now + idle, total)

    def _cut_by_time(self) -> UpstreamBodyError:
        self.abort()
        total = self._total_deadline
        if total is not None and time.monotonic() >= total - deadlines.TICK:
            return UpstreamBodyTimeout(f"the response did not finish within {self.timeouts.total}s")
        return UpstreamIdle(f"the pod sent nothing for {self.timeouts.idle}s mid-body")

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
        if upload is not None:
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


if TYPE_CHECKING:  # mypy checks that a stream is a PodResponse

    def _is_a_pod_response(stream: H2PodStream) -> PodResponse:
        return stream

"""The client side of HTTP/2: one connection's streams, each served like an HTTP/1.x request.

``H2ServerConnection`` drives the ``h2`` library (sans-IO) over one client socket (h2c
with prior knowledge, or TLS with ALPN ``h2``) and hands out one ``H2Exchange`` per
stream: an ``exchange.ClientExchange``, so that every stream goes through the same
routing, FIFO queue and slots as an HTTP/1.x request (one slot per stream). Its rules:

- **One reader, one writer, one greenlet per stream.** The connection's greenlet reads
  (64 KiB at a time), feeds ``h2`` and dispatches its events; each request runs the
  application in a greenlet of its own, so a stream that waits (for a slot, for its pod,
  for its client's window) never holds up another. Every frame ``h2`` produces goes into
  one outbound queue, in the order ``h2`` made it (no yield between an ``h2`` call and
  taking its bytes), drained by one writer greenlet: the order on the wire is the order
  of the calls. ``h2`` is only ever called without yielding, from any of these greenlets.
- **Streams are bounded**: ``max_streams`` (256) is advertised as
  ``SETTINGS_MAX_CONCURRENT_STREAMS`` (``h2`` refuses more open streams as a connection
  error) and also bounds the stream greenlets still running: a stream the client reset
  keeps its greenlet until the application notices, and a new stream over the bound is
  refused with ``REFUSED_STREAM`` (the client may retry it: nothing was done).
- **Request flow control**: a stream's DATA is acknowledged to the client only as the
  application reads it, so a stream that is not read (queued for a slot) holds at most
  its window, ``STREAM_WINDOW`` = 256 KiB (``h2`` treats a client that sends more as a
  ``FLOW_CONTROL_ERROR``). 256 KiB keeps a stream's upload at full speed over any link
  whose bandwidth-delay product is below it (1 Gbit/s at 2 ms). The connection window
  (``connection_window``: 2 x 256 x 256 KiB = 128 MiB) never binds before the stream
  windows do: ``h2`` hands consumed bytes back on the connection once half its window
  was consumed, so the client may always send more than 64 MiB less what is buffered,
  while all the streams' windows together allow at most 256 x 256 KiB = 64 MiB less what
  is buffered. So a queued stream's unread body never takes the window of the stream
  that holds a slot.
- **Response flow control**: DATA goes out within the client's windows
  (``local_flow_control_window``, in frames of ``max_outbound_frame_size``); a stream
  whose window is closed waits for the client's WINDOW_UPDATE (its greenlet blocks, the
  others go on) for at most ``client_timeout``, then it is reset (``CANCEL``). A
  ``write`` returns at once while the outbound queue holds less than
  ``OUTBOUND_HIGH_WATER`` (64 KiB: a head, its body and its END_STREAM then go out in one
  send), else once its bytes were handed to the kernel; ``finish`` always waits for that.
- **Memory**, per stream: at most 256 KiB of request body (its window) and the one
  response piece being written (the proxy writes at most 64 KiB); per connection: at most
  256 x 256 KiB = 64 MiB of request bodies, when every stream is full and unread, and an
  outbound queue of at most 64 KiB plus one piece per writing stream.
- **Limits** (``limits``, as for HTTP/1.x): ``max_header_bytes`` is advertised as
  ``SETTINGS_MAX_HEADER_LIST_SIZE`` (RFC 9113 sizes: name + value + 32 per field); once
  the client acknowledged it, ``h2`` refuses a larger block as a connection error
  (``ENHANCE_YOUR_CALM``: the HPACK state cannot survive it), and before that a larger
  block is answered 431 on its stream. A declared body over ``max_body_bytes`` is
  answered 413 before the application runs; a body of unknown length that grows past it
  fails its read with ``BodyTooLarge`` (further DATA is dropped, handed back on the
  connection window only, so the client's stream stalls). ``client_timeout`` bounds a
  connection without streams (then GOAWAY ``NO_ERROR`` and close), each wait for body
  data, each wait for a client window, and each write to the socket.
- **Refusals stay on their stream** (the connection goes on): a bad ``:authority`` ->
  400 ``bad-host``, CONNECT (plain or extended) and targets that are not origin-form ->
  400 ``bad-request-target``, a method that is not a token, or a target or header name
  that could not travel in an HTTP/1.1 request -> 400 ``bad-request``.
- **What ``h2`` refuses ends the connection**: a protocol error from the client gets the
  GOAWAY with the error code ``h2`` chose, then the connection is closed (logged at DEBUG:
  an expected condition). A GOAWAY from the client ends the connection too (``h2``
  sends nothing after it), and its streams in progress see their client gone.
- **Stopping** (``stop()``): a GOAWAY ``NO_ERROR`` naming the last stream taken
  (``h2``'s own ``close_connection`` would forbid finishing the streams in progress, so
  this one frame is ours, serialized by ``hyperframe``); later streams are refused, the
  streams in progress finish, then the connection waits briefly for the client to close
  (a lingering close, so that the last answers are not lost to a reset). The reader's
  wait is only ended (its read side shut) once everything queued went out: over TLS,
  OpenSSL fails every write after the EOF its read then sees.
- **Answers**: response header names are lower-cased and connection-specific lines never
  sent; ``start`` sends nothing until the first ``write`` or ``finish`` (a bodiless
  answer is one HEADERS frame with END_STREAM); trailers go in a last HEADERS frame.
  When a response ends before the request body did, the stream is reset with
  ``NO_ERROR`` (RFC 9113 8.1: the client stops sending). Activator's own answers for a
  gRPC request (``content-type: application/grpc...``) are "trailers-only": one HEADERS
  frame with ``:status 200``, ``grpc-status``, ``grpc-message`` and
  ``x-activator-reason``.
"""

from __future__ import annotations

import logging
import re
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import gevent
import h2.events
import h2.exceptions
from gevent.event import Event
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hyperframe.frame import GoAwayFrame

from . import deadlines
from .core import http
from .core.errors import (
    ActivatorError,
    BadRequest,
    BodyTooLarge,
    ClientGone,
    ClientTimeout,
    ConnectRefused,
    HeadersTooLarge,
)
from .core.http import BodyFraming, Header
from .http1 import linger
from .sockets import shutdown_keeping_tls

if TYPE_CHECKING:
    from .exchange import ClientExchange

log = logging.getLogger("activator")

#: One recv from the client.
RECV_SIZE = 65536
#: Streams open at once (SETTINGS_MAX_CONCURRENT_STREAMS), and stream greenlets alive at once.
MAX_STREAMS = 256
#: The request-body window of each stream (SETTINGS_INITIAL_WINDOW_SIZE): see the module docstring.
STREAM_WINDOW = 256 * 1024
#: The window both sides start with (RFC 9113 6.9.2), and the largest one.
_DEFAULT_WINDOW = 65535
_LARGEST_WINDOW = 2**31 - 1
#: After a graceful GOAWAY and the last stream: how long we wait for the client to close.
LINGER_SECONDS = 1.0
#: A ``write`` waits for the kernel to take its bytes once this much is queued.
OUTBOUND_HIGH_WATER = 65536
#: RFC 9113 6.5.2: what a field costs in a header list, beyond its name and value.
FIELD_OVERHEAD = 32

_NO_BYTES = b""
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
# A request target that can travel in an HTTP/1.1 request line: visible ASCII only.
_TARGET_BYTES = re.compile(rb"[\x21-\x7e]+\Z")

# Names the exchange looks at, lower-cased (HTTP/2 names are).
_METHOD = b":method"
_PATH = b":path"
_AUTHORITY = b":authority"
_HOST = b"host"
_CONTENT_LENGTH = b"content-length"
_CONTENT_TYPE = b"content-type"
_GRPC_TIMEOUT = b"grpc-timeout"
_EXPECT = b"expect"
_FORWARDED = b"x-activator-forwarded"
_SPECIAL = frozenset((_HOST, _CONTENT_LENGTH, _CONTENT_TYPE, _GRPC_TIMEOUT, _EXPECT, _FORWARDED))
_CONTINUE_HEAD = [(b":status", b"100")]


class Limits(Protocol):
    """What a connection enforces (``engine.Limits`` is one)."""

    client_timeout: float
    max_header_bytes: int
    max_body_bytes: int | None


def connection_window(max_streams: int) -> int:
    """The connection's request-body window: twice what all the stream windows hold
    together, so that it never binds before they do (see the module docstring)."""
    return min(2 * max_streams * STREAM_WINDOW, _LARGEST_WINDOW)


def header_list_size(pairs: Sequence[Header]) -> int:
    """A header block's size as SETTINGS_MAX_HEADER_LIST_SIZE counts it (RFC 9113 6.5.2)."""
    return sum(len(name) + len(value) + FIELD_OVERHEAD for name, value in pairs)


def response_fields(headers: Sequence[Header]) -> list[Header]:
    """Header lines as HTTP/2 sends them: names lower-cased, connection-specific lines
    (and anything that looks like a pseudo-header) left out, the rest in order."""
    fields = []
    for name, value in headers:
        lower = name.lower()
        if lower in http.RESPONSE_HOP_BY_HOP or lower[:1] == b":":
            continue
        fields.append((lower, value))
    return fields


class H2Exchange(deadlines.Watched):
    """One stream of an ``H2ServerConnection``: its request head, its body, its response.

    Built by the connection's reader from the request's header block; read and answered
    by the stream's greenlet (see ``exchange.ClientExchange`` for the contract). Its
    ``deadline`` bounds the stream's own waits; ``expire`` only wakes the waiter.
    """

    __slots__ = (
        "conn",
        "stream_id",
        "client_ip",
        "client_ip_bytes",
        "scheme_bytes",
        "method",
        "target",
        "version",
        "headers",
        "lower_names",
        "hosts",
        "host",
        "content_length",
        "framing",
        "connection_values",
        "forwarded",
        "content_type",
        "grpc_timeout",
        "upgrade",
        "upgrade_value",
        "trailers",
        "expect_continue",
        "refusal",
        "body_done",
        "body_error",
        "body_bytes",
        "buffered_bytes",
        "gone",
        "started",
        "finished",
        "status",
        "bytes_sent",
        "_body",
        "_continue_sent",
        "_wake",
        "_watchers",
        "_head",
        "_head_sent",
        "_cut",
        "_ended_by_us",
        "_reset_sent",
        "_pod_spoke",
    )

    def __init__(self, conn: H2ServerConnection, stream_id: int, pairs: Sequence[Header], ended: bool) -> None:
        super().__init__(conn.sock)
        self.conn = conn
        self.stream_id = stream_id
        self.client_ip = conn.client_ip
        self.client_ip_bytes = conn.client_ip_bytes
        self.scheme_bytes = conn.scheme_bytes
        self.method = ""
        self.target = _NO_BYTES
        self.version = "2"
        self.headers: list[Header] = []
        self.lower_names: list[bytes] = []
        self.hosts: list[bytes] = []
        self.host = ""
        self.content_length: int | None = None
        self.framing = BodyFraming.NONE
        self.connection_values: list[bytes] = []  # HTTP/2 has no Connection lines
        #: ``x-activator-forwarded`` values (the hops between activators), in order.
        self.forwarded: list[bytes] = []
        self.content_type: bytes | None = None
        self.grpc_timeout: bytes | None = None
        self.upgrade = False  # HTTP/2 has no Upgrade
        self.upgrade_value: bytes | None = None
        self.trailers: list[Header] = []
        self.expect_continue = False
        #: Set when the head is refused: the stream is answered that, the application never runs.
        self.refusal: ActivatorError | None = None
        self.body_done = ended
        self.body_error: ActivatorError | None = None
        #: Request body bytes received so far (what ``max_body_bytes`` limits).
        self.body_bytes = 0
        #: Request body bytes received and not yet read by the application.
        #: Invariant: at most the stream's window (``STREAM_WINDOW``), which is all the
        #: client may send before the application reads.
        self.buffered_bytes = 0
        #: The client reset the stream, or the connection is lost.
        self.gone = False
        self.started = False
        self.finished = False
        self.status = 0
        #: Response body bytes given to the connection (all handed to the kernel once ``finish`` returned).
        self.bytes_sent = 0
        self._body: deque[bytes] = deque()
        self._continue_sent = False
        self._wake = Event()
        self._watchers: list[Callable[[], None]] = []
        self._head: list[Header] | None = None  # the final head, until it is sent
        self._head_sent = False
        self._cut = False
        self._ended_by_us = False  # our side of the stream is closed (END_STREAM or RST_STREAM)
        self._reset_sent = False
        self._pod_spoke = False
        self._read_head(pairs, ended)

    def __repr__(self) -> str:
        return f"<H2Exchange {self.stream_id} {self.method} {self.target[:60]!r}>"

    def _read_head(self, pairs: Sequence[Header], ended: bool) -> None:
        """Fill the head from the header block ``h2`` validated, and decide its refusal."""
        limits = self.conn.limits
        authority = None
        regular_names_ok = True
        for name, value in pairs:
            if name[:1] == b":":
                if name == _METHOD:
                    self.method = value.decode("latin-1")
                elif name == _PATH:
                    self.target = value
                elif name == _AUTHORITY:
                    authority = value
                continue  # :scheme is what the client says; we know what it spoke
            self.headers.append((name, value))
            self.lower_names.append(name)
            if regular_names_ok and _TOKEN.match(name) is None:
                regular_names_ok = False
            if name in _SPECIAL:
                self._note_field(name, value)
        if authority is not None:
            self.hosts = [authority]
            if _HOST not in self.lower_names:
                # RFC 9113 8.3.1: a request going on in HTTP/1.1 carries its authority as Host.
                self.headers.insert(0, (b"host", authority))
                self.lower_names.insert(0, _HOST)
        if not ended:
            self.framing = BodyFraming.CHUNKED if self.content_length is None else BodyFraming.LENGTH
        try:
            self.host = _check_head(
                self.method,
                self.target,
                self.hosts,
                self.content_length,
                header_list_size(pairs),
                regular_names_ok,
                limits.max_header_bytes,
                limits.max_body_bytes,
            )
        except ActivatorError as error:
            self.refusal = error

    def _note_field(self, name: bytes, value: bytes) -> None:
        """A header line the exchange looks at (one of ``_SPECIAL``)."""
        if name == _HOST:
            self.hosts.append(value)
        elif name == _CONTENT_LENGTH:
            if self.content_length is None:
                self.content_length = int(value)  # h2 has checked its digits and that repeats agree
        elif name == _CONTENT_TYPE:
            self.content_type = value
        elif name == _GRPC_TIMEOUT:
            self.grpc_timeout = value
        elif name == _EXPECT:
            self.expect_continue = value.lower() == b"100-continue"
        else:
            self.forwarded.append(value)

    # -- the request body ------------------------------------------------------------------

    def read(self, size: int = RECV_SIZE) -> bytes:
        """The next piece of the request body (at most ``size`` bytes); b"" at its end.

        What is read is acknowledged to the client (its window reopens). Raises
        ``ClientGone`` (the stream was reset, the connection lost), ``BodyTooLarge``, or
        ``ClientTimeout`` when nothing came for ``client_timeout``. The first read answers
        ``expect: 100-continue``.
        """
        body = self._body
        while not body:
            if self.body_error is not None:
                raise self.body_error
            if self.body_done:
                return _NO_BYTES
            if self.expect_continue and not self._continue_sent:
                self._continue_sent = True
                if not self.started:
                    self._send_headers(_CONTINUE_HEAD, end_stream=False)
            if not self._wait_until(self.buffered, self.conn.client_timeout):
                raise ClientTimeout("the request body stalled for client_timeout")
        piece = body.popleft()
        if len(piece) > size:
            body.appendleft(piece[size:])
            piece = piece[:size]
        elif body and len(piece) + len(body[0]) <= size:  # several pieces here already: one read
            pieces = [piece]
            taken = len(piece)
            while body and taken + len(body[0]) <= size:
                more = body.popleft()
                pieces.append(more)
                taken += len(more)
            piece = b"".join(pieces)
        self.buffered_bytes -= len(piece)
        self.conn.acknowledge(self.stream_id, len(piece))
        return piece

    def raise_known_error(self) -> None:
        """Raise the body's error if what already arrived shows it (no waiting)."""
        if self.body_error is not None and not self._body:
            raise self.body_error

    def buffered(self) -> bool:
        """Whether a piece (or the end, or an error) is here without waiting."""
        return bool(self._body) or self.body_done or self.body_error is not None

    def wait_for_body(self, pod_fd: int, timeout: float) -> bool:
        """Wait until more body is here or ``pod_fd`` is readable; True if ``pod_fd`` is.

        Raises ``ClientTimeout`` when neither happens within ``timeout``.
        """
        self._pod_spoke = False
        watcher = gevent.get_hub().loop.io(pod_fd, 1)  # 1: libev's EV_READ
        watcher.start(self._pod_readable)
        try:
            if not self._wait_until(self._body_or_pod, timeout):
                raise ClientTimeout("the request body stalled for client_timeout")
        finally:
            watcher.close()
        return self._pod_spoke

    def _pod_readable(self) -> None:
        # In the hub: only flags and a wake-up.
        self._pod_spoke = True
        self._wake.set()

    def _body_or_pod(self) -> bool:
        return self._pod_spoke or self.buffered()

    # -- the client ---------------------------------------------------------------------

    def watch_gone(self, on_gone: Callable[[], None]) -> bool:
        """Call ``on_gone()`` when the client resets the stream or the connection is lost.
        False if that happened already. Does not yield."""
        if self.gone:
            return False
        self._watchers.append(on_gone)
        return True

    def unwatch_gone(self, on_gone: Callable[[], None]) -> None:
        """End that watch (idempotent). Does not yield."""
        if on_gone in self._watchers:
            self._watchers.remove(on_gone)

    def client_gone(self) -> bool:
        return self.gone

    @property
    def was_cut(self) -> bool:
        """The response was abandoned mid-way: cut by us, or its client left before its end."""
        return self._cut

    # -- the response -------------------------------------------------------------------

    def interim(self, status: int, reason: bytes, headers: list[Header]) -> None:
        """Relay a 1xx answer before the final one (never 100: ours to give, nor 101)."""
        if self.started or self.gone or status in (100, 101):
            return
        self._send_headers([(b":status", b"%d" % status), *response_fields(headers)], end_stream=False)

    def start(
        self,
        status: int,
        reason: bytes | None,
        headers: Sequence[Header],
        framing: BodyFraming,
        close: bool = False,
    ) -> None:
        """Begin the final response: its HEADERS frame goes with the first ``write`` or
        ``finish``. HTTP/2 needs none of the rest: no reason phrase; DATA frames carry any
        body whatever its ``framing`` (a ``content-length`` line among ``headers`` goes as it
        is); for ``close``, a request body still coming when the response ends is stopped
        with a reset (``NO_ERROR``) in any case."""
        self.started = True
        self.status = status
        self._head = [(b":status", b"%d" % status), *response_fields(headers)]

    def flush(self) -> None:
        """Send the HEADERS frame now, if it still waits for the first ``write``."""
        self._check_open()
        self._send_pending_head(end_stream=False)

    def write(self, data: bytes) -> None:
        """Send a piece of the body within the client's windows (waiting for the kernel to
        take it when much is queued: see the module docstring). Raises ``ClientGone`` (the
        stream reset, the connection lost, or no window for ``client_timeout``: then we
        reset the stream with ``CANCEL``)."""
        if not data:
            return
        self._check_open()
        self._send_pending_head(end_stream=False)
        conn = self.conn
        stream_id = self.stream_id
        offset = 0
        while offset < len(data):
            window = conn.send_window(stream_id)
            if window <= 0:
                if not self._wait_until(self._window_open, conn.client_timeout):
                    self._reset(ErrorCodes.CANCEL)
                    self._cut = True
                    raise ClientGone("the client gave no window for client_timeout")
                self._check_open()
                continue
            size = min(window, conn.frame_size(), len(data) - offset)
            conn.send_data(stream_id, data[offset : offset + size])
            offset += size
        self.bytes_sent += len(data)
        if conn.queued - conn.sent > OUTBOUND_HIGH_WATER:
            self._flushed(conn.queued)

    def finish(self, trailers: Sequence[Header] = ()) -> None:
        """End the response: END_STREAM on its last frame, after a HEADERS frame of
        trailers when there are some. Raises ``ClientGone``."""
        if self.finished:
            return
        if self._head is None and not self._head_sent:
            self.finished = True
            return  # nothing was started: the stream is reset when it ends
        self._check_open()
        fields = response_fields(trailers)
        if self._head is not None:
            self._send_pending_head(end_stream=not fields)
        if fields:
            self._send_headers(fields, end_stream=True)
        elif not self._ended_by_us:
            self.conn.end_stream(self.stream_id)
            self._ended_by_us = True
        self._flushed(self.conn.queued)
        self.finished = True

    def answer(self, error: ActivatorError) -> None:
        """Activator's own answer for ``error`` (gRPC-shaped for a gRPC request); if part
        of a response is out already, the only honest signal left: ``cut``."""
        if self._head_sent:
            self.cut()
            return
        self._check_open()
        status, headers, body = http.own_answer_headers(error, http.is_grpc(self.content_type))
        self.started = True
        self.status = status
        self._head = [(b":status", b"%d" % status), *response_fields(headers)]
        if body and self.method != "HEAD":
            self.write(body)
        self.finish()  # a gRPC answer has no body: one HEADERS frame that ends the stream

    def cut(self) -> None:
        """Abandon the response: the stream is reset (``INTERNAL_ERROR``: our side failed;
        a client that left needs nothing more)."""
        self.started = self.finished = True
        self._cut = True
        self._head = None
        if not self._ended_by_us:
            self._reset(ErrorCodes.INTERNAL_ERROR)

    # -- for the connection (none of these yields) -----------------------------------------

    def expire(self) -> None:
        """A wait of this stream passed its deadline: wake it (the socket is not touched)."""
        self.timed_out = True
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def received(self, data: bytes, flow_controlled: int) -> None:
        """DATA for this stream (``flow_controlled``: its length with padding)."""
        conn = self.conn
        padding = flow_controlled - len(data)
        if self.body_error is not None:
            # Over max_body_bytes, or the stream is going: drop it, and give the credit back
            # on the connection only (this stream's window stays closed: its client stops).
            conn.refund_connection(flow_controlled)
            return
        if padding:
            conn.acknowledge(self.stream_id, padding)  # nothing of it is kept
        if not data:
            return
        self.body_bytes += len(data)
        maximum = conn.limits.max_body_bytes
        if maximum is not None and self.body_bytes > maximum:
            self.body_error = BodyTooLarge(f"request body over max_body_bytes {maximum}")
            conn.refund_connection(len(data))
        else:
            self._body.append(data)
            self.buffered_bytes += len(data)
        self._wake.set()

    def body_ended(self) -> None:
        self.body_done = True
        self._wake.set()

    def client_left(self, why: str, lost: bool) -> None:
        """The client reset the stream (``lost``: the whole connection is gone). Its
        unread body is dropped (and handed back to the connection window, if the
        connection is still there); the watchers are told."""
        if self.gone:
            return
        self.gone = True
        if not self.finished:
            self._cut = True
        self.body_error = ClientGone(why)
        self._ended_by_us = True  # nothing more may be sent on a reset stream
        unread = self.buffered_bytes
        self._body.clear()
        self.buffered_bytes = 0
        if unread and not lost:
            self.conn.acknowledge(self.stream_id, unread)
        watchers, self._watchers = self._watchers, []
        self._wake.set()
        for on_gone in watchers:
            on_gone()

    def end(self) -> None:
        """The stream's greenlet is done: close our side of the stream if it is open, and
        hand back the credit of a body nobody will read."""
        if not self._ended_by_us:
            self._reset(ErrorCodes.INTERNAL_ERROR)  # the application left it unfinished
        elif not self.body_done:
            self._reset(ErrorCodes.NO_ERROR)  # answered before the body ended: stop it
        if self.buffered_bytes:
            self.conn.acknowledge(self.stream_id, self.buffered_bytes)
        self._body.clear()
        self.buffered_bytes = 0
        self._watchers = []
        deadlines.sweeper().discard(self)

    # -- inside -------------------------------------------------------------------------

    def _wait_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Block until ``ready()`` (checked at every wake-up); False after ``timeout``.

        Whatever makes ``ready`` true sets ``_wake``, and it is only set while we wait:
        nothing yields between looking at ``ready`` and clearing the event.
        """
        if ready():
            return True
        self.timed_out = False
        self.deadline = 0.0 if timeout is None else time.monotonic() + timeout
        try:
            while not ready():
                if self.timed_out:
                    return False
                self._wake.clear()
                self._wake.wait()
        finally:
            self.deadline = 0.0
        return True

    def _window_open(self) -> bool:
        return self.gone or self.conn.send_window(self.stream_id) > 0

    def _flushed(self, mark: int) -> None:
        """Wait until the outbound queue went out up to ``mark`` (the writer's own deadline
        bounds this). Raises ``ClientGone`` if the connection was lost first."""
        conn = self.conn
        if conn.sent < mark:
            conn.wait_flush(self, mark)
            self._wait_until(lambda: conn.sent >= mark or conn.lost, None)
        if conn.sent < mark:
            raise ClientGone("the connection was lost before the response went out")

    def _check_open(self) -> None:
        if self.gone or self._ended_by_us:
            raise ClientGone("the client reset the stream" if self.gone else "the stream is closed")

    def _send_pending_head(self, end_stream: bool) -> None:
        head, self._head = self._head, None
        if head is not None:
            self._send_headers(head, end_stream)
            self._head_sent = True

    def _send_headers(self, fields: list[Header], end_stream: bool) -> None:
        self._check_open()
        self.conn.send_headers(self.stream_id, fields, end_stream)
        if end_stream:
            self._ended_by_us = True

    def _reset(self, code: ErrorCodes) -> None:
        """RST_STREAM, once, unless the client reset the stream first."""
        if not (self.gone or self._reset_sent):
            self.conn.reset(self.stream_id, code)
        self._reset_sent = self._ended_by_us = True


def _check_head(
    method: str,
    target: bytes,
    hosts: Sequence[bytes],
    content_length: int | None,
    list_size: int,
    names_ok: bool,
    max_header_bytes: int,
    max_body_bytes: int | None,
) -> str:
    """What ``h2`` leaves to us about a request head; the Host, or raises the refusal:
    size, method, target, Host, declared length, header names, in that order. Pure."""
    if list_size > max_header_bytes:
        raise HeadersTooLarge(f"header list of {list_size} bytes over {max_header_bytes}")
    if _TOKEN.match(method.encode("latin-1")) is None:
        raise BadRequest(f"method {method[:40]!r} is not a token")
    if method == "CONNECT":
        raise ConnectRefused("CONNECT is not proxied")
    http.check_target(method, target)
    if _TARGET_BYTES.match(target) is None:
        raise BadRequest(f"request target {target[:100]!r} has bytes an HTTP/1.1 request line cannot carry")
    host = http.request_host("2", hosts)
    if max_body_bytes is not None and content_length is not None and content_length > max_body_bytes:
        raise BodyTooLarge(f"content-length {content_length} over max_body_bytes {max_body_bytes}")
    if not names_ok:
        raise BadRequest("a header name that is not a token")
    return host


class H2ServerConnection(deadlines.Watched):
    """One HTTP/2 client connection (see the module docstring).

    ``serve()`` runs in the connection's greenlet until the connection ends and its
    streams are done; it closes the socket. ``call_app(exchange)`` runs the application
    for one stream, in that stream's greenlet, and returns once its response is finished
    (``engine.HttpServer._call_app``). The engine has told HTTP/2 from HTTP/1.x by
    looking at the preface without consuming it: ``h2`` reads it. The connection's
    ``deadline`` is the idle (or lingering) deadline, set only while no stream runs.
    """

    def __init__(
        self,
        sock: Any,
        address: Any,
        limits: Limits,
        scheme: str,
        call_app: Callable[[H2Exchange], None],
        *,
        max_streams: int = MAX_STREAMS,
        on_refusal: Callable[[str, str, bytes, ActivatorError], None] | None = None,
    ) -> None:
        super().__init__(sock)
        #: Told of each stream refused before the application ran (``engine.RefusalHook``).
        self.on_refusal = on_refusal
        self.client_ip = address[0] if isinstance(address, tuple) else str(address)
        self.client_ip_bytes = self.client_ip.encode()
        self.limits = limits
        self.client_timeout = limits.client_timeout
        self.scheme = scheme
        self.scheme_bytes = scheme.encode()
        self.max_streams = max_streams
        #: A graceful stop is under way (``stop``): no new stream, the others finish.
        self.closing = False
        #: The socket failed (or the client went away): nothing more goes out.
        self.lost = False
        #: Bytes given to the outbound queue, and of those, handed to the kernel.
        #: Invariant: ``sent <= queued``, and both only grow.
        self.queued = 0
        self.sent = 0
        self.h2 = H2Connection(H2Configuration(client_side=False, header_encoding=None, validate_inbound_headers=True))
        self._call_app = call_app
        #: The streams whose greenlet runs, by stream id (the only ones events go to).
        self._streams: dict[int, H2Exchange] = {}
        self._greenlets: set[gevent.Greenlet] = set()
        self._outbound: list[bytes] = []
        self._outbound_ready = Event()
        self._flush_waiters: deque[tuple[int, H2Exchange]] = deque()  # in mark order
        self._writer_deadline = deadlines.Watched(sock)  # expiring shuts the socket down
        self._writing = True
        #: The writer shuts the read side once the queue is empty (``expire``).
        self._end_reading = False
        self._terminated = False  # h2 sends nothing more (a GOAWAY was sent or received)
        sock.settimeout(None)  # timeouts are deadlines (see ``deadlines``)
        sweeper = deadlines.sweeper()
        sweeper.add(self)
        sweeper.add(self._writer_deadline)
        self._start_h2()

    def __repr__(self) -> str:
        return f"<H2ServerConnection {self.client_ip} streams={len(self._streams)}>"

    def _start_h2(self) -> None:
        h2conn = self.h2
        h2conn.initiate_connection()
        h2conn.update_settings(
            {
                SettingCodes.MAX_CONCURRENT_STREAMS: self.max_streams,
                SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                SettingCodes.MAX_HEADER_LIST_SIZE: self.limits.max_header_bytes,
            }
        )
        h2conn.increment_flow_control_window(connection_window(self.max_streams) - _DEFAULT_WINDOW)
        self._take_output()
        self.deadline = time.monotonic() + self.client_timeout

    # -- the connection's life ------------------------------------------------------------

    def serve(self) -> None:
        """Serve the connection until it ends (see the class docstring)."""
        writer = gevent.spawn(self._write_loop)
        try:
            self._read_loop()
            if self.lost:
                self._lose("the client closed the connection")
            elif self._streams:  # h2 sends nothing more: a GOAWAY went one way or the other
                self._streams_gone("the connection was terminated")
            gevent.joinall(list(self._greenlets))
            self._writing = False
            self._outbound_ready.set()
            writer.join()
            if not self.lost:
                linger(self.sock)
        except BaseException:  # killed (the engine's stop), or a bug: end everything now
            self._lose("the connection was stopped")
            gevent.killall([*self._greenlets, writer])
            raise
        finally:
            sweeper = deadlines.sweeper()
            sweeper.discard(self)
            sweeper.discard(self._writer_deadline)
            self.sock.close()

    def stop(self) -> None:
        """Graceful stop: GOAWAY ``NO_ERROR`` naming the last stream taken; later streams
        are refused, those in progress finish, then the connection closes. Does not yield."""
        if self.closing:
            return
        self.closing = True
        if self._terminated:
            return
        frame = GoAwayFrame(stream_id=0, last_stream_id=self.h2.highest_inbound_stream_id, error_code=0)
        self._queue(frame.serialize())
        if not self._greenlets:
            self.deadline = time.monotonic() + LINGER_SECONDS

    def expire(self) -> None:
        """The idle (or lingering) deadline passed. Idle: GOAWAY ``NO_ERROR``. Either way the
        reader's wait ends once what is queued went out (``_end_reading``): over TLS the read
        side cannot be shut before, OpenSSL fails every write after the EOF its read then
        sees. Does not yield."""
        self.timed_out = True
        if not (self._terminated or self.closing):
            self.h2.close_connection(ErrorCodes.NO_ERROR)
            self._terminated = True
            self._take_output()
        self._end_reading = True
        self._outbound_ready.set()

    def _read_loop(self) -> None:
        while True:
            try:
                data = self.sock.recv(RECV_SIZE)
            except (OSError, ValueError):  # ValueError: a TLS socket whose TLS layer was dropped (``_lose``)
                data = _NO_BYTES
            if self.timed_out:  # idle, or done lingering: what came now is not read
                return
            if not data:
                if not (self.closing and not self._greenlets):
                    self.lost = True
                return
            if not self._feed(data):
                return

    def _feed(self, data: bytes) -> bool:
        """Hand ``data`` to ``h2`` and act on its events; False when the connection ends."""
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as error:
            # h2 has queued the GOAWAY with its error code; it sends nothing more.
            log.debug("HTTP/2 protocol error from %s: %s", self.client_ip, error)
            self._terminated = True
            self._take_output()
            return False
        for event in events:
            self._dispatch(event)
        self._take_output()
        return not self._terminated

    def _dispatch(self, event: h2.events.Event) -> None:  # noqa: C901 (one branch per event)
        if isinstance(event, h2.events.DataReceived):
            exchange = self._streams.get(event.stream_id)
            if exchange is not None:
                exchange.received(event.data, event.flow_controlled_length)
            else:  # a stream we refused or finished: nobody reads it
                self.acknowledge(event.stream_id, event.flow_controlled_length)
        elif isinstance(event, h2.events.RequestReceived):
            self._request(event)
        elif isinstance(event, h2.events.StreamEnded):
            exchange = self._streams.get(event.stream_id)
            if exchange is not None:
                exchange.body_ended()
        elif isinstance(event, h2.events.TrailersReceived):
            exchange = self._streams.get(event.stream_id)
            if exchange is not None:
                exchange.trailers = list(event.headers)
        elif isinstance(event, h2.events.WindowUpdated):
            if event.stream_id:
                exchange = self._streams.get(event.stream_id)
                if exchange is not None:
                    exchange.wake()
            else:
                self._wake_window_waiters()
        elif isinstance(event, h2.events.StreamReset):
            exchange = self._streams.get(event.stream_id)
            if exchange is not None:
                exchange.client_left(f"the client reset the stream ({event.error_code!r})", lost=False)
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            if SettingCodes.INITIAL_WINDOW_SIZE in event.changed_settings:
                self._wake_window_waiters()
        elif isinstance(event, h2.events.ConnectionTerminated):
            log.debug("HTTP/2 GOAWAY from %s: %r", self.client_ip, event.error_code)
            self._terminated = True
        # Settings acknowledgements, pings (h2 answers them), priorities: nothing to do.

    def _request(self, event: h2.events.RequestReceived) -> None:
        stream_id = event.stream_id
        if self.closing or len(self._greenlets) >= self.max_streams:
            self.reset(stream_id, ErrorCodes.REFUSED_STREAM)
            return
        exchange = H2Exchange(self, stream_id, event.headers, ended=event.stream_ended is not None)
        self._streams[stream_id] = exchange
        deadlines.sweeper().add(exchange)
        self._greenlets.add(gevent.spawn(self._run_stream, exchange))
        self.deadline = 0.0  # not idle

    def _run_stream(self, exchange: H2Exchange) -> None:
        try:
            if exchange.refusal is not None:
                refusal = exchange.refusal
                log.debug("refused a request from %s: %s (%s)", self.client_ip, refusal.reason, refusal)
                if self.on_refusal is not None:
                    self.on_refusal(self.client_ip, exchange.method, exchange.target, refusal)
                exchange.answer(refusal)
            else:
                self._call_app(exchange)
        except ClientGone:
            pass
        except Exception:  # a bug (the application's own are answered by call_app): logged once
            log.exception("internal error serving HTTP/2 stream %d of %s", exchange.stream_id, self.client_ip)
            exchange.cut()
        finally:
            self._stream_done(exchange, gevent.getcurrent())

    def _stream_done(self, exchange: H2Exchange, greenlet: Any) -> None:
        exchange.end()
        self._streams.pop(exchange.stream_id, None)
        self._greenlets.discard(greenlet)
        if not self._greenlets:
            self.deadline = time.monotonic() + (LINGER_SECONDS if self.closing else self.client_timeout)

    def _lose(self, why: str) -> None:
        """The socket is done for: nothing more goes out, the reader stops too."""
        self.lost = True
        self._streams_gone(why)
        for _, exchange in self._flush_waiters:
            exchange.wake()
        self._flush_waiters.clear()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _streams_gone(self, why: str) -> None:
        """Nothing more can be sent on any stream: each one in progress sees its client gone
        (what is queued still goes out, if the socket lets it)."""
        for exchange in list(self._streams.values()):
            exchange.client_left(why, lost=True)

    # -- for the streams (none of these yields, but ``wait_flush``'s caller waits) ----------

    def send_window(self, stream_id: int) -> int:
        """What may be sent on the stream now (0 if it is gone)."""
        if self.lost or self._terminated:
            return 0
        try:
            return self.h2.local_flow_control_window(stream_id)
        except h2.exceptions.ProtocolError:
            return 0

    def frame_size(self) -> int:
        return self.h2.max_outbound_frame_size

    def send_data(self, stream_id: int, data: bytes) -> None:
        self._h2_send(lambda: self.h2.send_data(stream_id, data))

    def send_headers(self, stream_id: int, fields: list[Header], end_stream: bool) -> None:
        self._h2_send(lambda: self.h2.send_headers(stream_id, fields, end_stream=end_stream))

    def end_stream(self, stream_id: int) -> None:
        self._h2_send(lambda: self.h2.end_stream(stream_id))

    def _h2_send(self, send: Callable[[], None]) -> None:
        """One ``h2`` call that sends on a stream; ``ClientGone`` when it cannot be done."""
        if self.lost or self._terminated:
            raise ClientGone("the connection is gone")
        try:
            send()
        except h2.exceptions.ProtocolError as error:  # the stream closed under us (a reset)
            raise ClientGone(f"the stream cannot be sent on: {error}") from None
        self._take_output()

    def reset(self, stream_id: int, code: ErrorCodes) -> None:
        if self.lost or self._terminated:
            return
        try:
            self.h2.reset_stream(stream_id, code)
        except h2.exceptions.ProtocolError:
            return  # closed already: nothing to say
        self._take_output()

    def acknowledge(self, stream_id: int, size: int) -> None:
        """``size`` bytes of the stream were consumed: the client may send that much more."""
        if size and not self.lost and not self._terminated:
            self.h2.acknowledge_received_data(size, stream_id)
            self._take_output()

    def refund_connection(self, size: int) -> None:
        """Give ``size`` bytes of credit back on the connection window only."""
        if size and not self.lost and not self._terminated:
            self.h2.increment_flow_control_window(size)
            self._take_output()

    def wait_flush(self, exchange: H2Exchange, mark: int) -> None:
        """Wake ``exchange`` once ``sent`` reaches ``mark``."""
        self._flush_waiters.append((mark, exchange))

    def _wake_window_waiters(self) -> None:
        for exchange in self._streams.values():
            exchange.wake()

    # -- the one outbound path --------------------------------------------------------------

    def _take_output(self) -> None:
        """Move what ``h2`` has to send into the outbound queue (right after the ``h2``
        call that made it: this is what keeps frames in order)."""
        data = self.h2.data_to_send()
        if data:
            self._queue(data)

    def _queue(self, data: bytes) -> None:
        if self.lost:
            return
        self._outbound.append(data)
        self.queued += len(data)
        self._outbound_ready.set()

    def _write_loop(self) -> None:
        """The writer greenlet: the outbound queue, in order, each send under a deadline."""
        outbound = self._outbound
        waiters = self._flush_waiters
        writer = self._writer_deadline
        while True:
            if not outbound:
                if self._end_reading:
                    self._end_reading = False
                    shutdown_keeping_tls(self.sock, socket.SHUT_RD)
                if not self._writing or self.lost:
                    return
                self._outbound_ready.clear()
                self._outbound_ready.wait()
                continue
            data = outbound[0] if len(outbound) == 1 else b"".join(outbound)
            outbound.clear()
            writer.deadline = time.monotonic() + self.client_timeout
            try:
                self.sock.sendall(data)
            except (OSError, ValueError):
                self._lose("writing to the client failed")
                return
            finally:
                writer.deadline = 0.0
            self.sent += len(data)
            while waiters and waiters[0][0] <= self.sent:
                waiters.popleft()[1].wake()


if TYPE_CHECKING:  # mypy checks that an HTTP/2 stream is a ClientExchange

    def _is_a_client_exchange(exchange: H2Exchange) -> ClientExchange:
        return exchange

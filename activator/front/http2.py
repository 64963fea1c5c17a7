"""The client side of HTTP/2: one connection's streams, each served like an HTTP/1.x request.

``H2ServerConnection`` is an ``h2wire.H2Wire`` (the one HTTP/2 driver: frames in bounded
batches, one writer) over one client socket (h2c with prior knowledge, or TLS with ALPN
``h2``), and hands out one ``H2Exchange`` per stream: an ``exchange.ClientExchange``, so
that every stream goes through the same routing, FIFO queue and slots as an HTTP/1.x
request (one slot per stream). Its rules:

- **One reader, one writer, one greenlet per stream.** The connection's greenlet reads
  and feeds ``h2`` (``H2Wire.receive``); each request runs the application in a greenlet
  of its own, so a stream that waits (for a slot, for its pod, for its client's window)
  never holds up another. A stream's greenlet is started once the batch that opened it
  was dispatched, and not at all when the same batch reset it (a rapid reset costs no
  greenlet, no routing, no queue entry).
- **One SETTINGS frame at the preface**, ours (serialized by ``hyperframe``): the limits
  we advertise. ``h2`` itself runs with a larger stream limit and header-list limit than
  those (``local_settings``) and with its header validation off: the limits are ours to
  enforce stream by stream, and the fields are checked by ``core.heads`` (one check for
  both transports), so that what RFC 9113 calls a stream error stays on its stream.
- **Streams are bounded**: ``max_concurrent_streams`` (256) is advertised as
  SETTINGS_MAX_CONCURRENT_STREAMS. A stream counts as open, as RFC 9113 5.1.2 counts it,
  until both sides ended it; once the client acknowledged our SETTINGS, a stream over
  the limit is refused with REFUSED_STREAM (the client may retry it: nothing was done),
  one by one, and the connection goes on. Before that (the client's first flight, sent
  before it knew the limit) up to twice the limit are taken.
- **Request heads** (``core.heads.RequestHead.from_h2`` and ``check_request_head``): a
  malformed one (RFC 9113 8.1.1) gets RST_STREAM PROTOCOL_ERROR and no answer; a header
  list over ``max_header_bytes`` (RFC 9113 sizes: name + value + 32 per field) is
  answered 431 on its stream; ``h2`` ends the connection (ENHANCE_YOUR_CALM) only for a
  block over four times that (``INTERNAL_HEADER_LIST_FACTOR``). Other refusals are
  answered on their stream: a bad ``:authority`` -> 400 ``bad-host``, CONNECT and
  targets that are not origin-form -> 400 ``bad-request-target``, a method that is not a
  token or a target that could not travel in an HTTP/1.1 request line -> 400
  ``bad-request``, a declared body over ``max_body_bytes`` -> 413.
- **Budgets** (``core.h2budgets``, ``limits.http2``): resets of streams not answered yet,
  PING and SETTINGS frames, acks the client leaves unread, empty frames, WINDOW_UPDATE and
  PRIORITY frames, CONTINUATION frames per header block, each counted over a sliding
  window. Past one: GOAWAY ``ENHANCE_YOUR_CALM``, the connection closed, one log line
  naming the client and the budget, and ``on_budget(budget)`` (the count in StatsD and
  ``/metrics``).
- **A share of the queues**: the streams of one connection may hold at most
  ``max_queue_share`` of a service's ``queue_depth`` (``queue_share``); one more gets
  503 ``queue-full`` while other clients still queue.
- **Request flow control**: a stream's DATA is acknowledged to the client only as the
  application reads it, so a stream that is not read (queued for a slot) holds at most
  its window, ``STREAM_WINDOW`` = 256 KiB. The connection window (twice what all the
  streams' windows hold together) never binds before the stream windows do, so a
  queued stream's unread body never takes the window of the stream that holds a slot.
- **Response flow control**: DATA goes out within the client's windows, in frames of
  ``max_outbound_frame_size``; a stream whose window is closed waits for the client's
  WINDOW_UPDATE (its greenlet blocks, the others go on) for at most ``client_timeout``,
  then it is reset (``CANCEL``). A ``write`` returns at once while less than
  ``OUTBOUND_HIGH_WATER`` (64 KiB) of it is unsent, else once its bytes were handed to
  the kernel; ``finish`` returns once its frames are queued for the writer (which sends
  them before anything the next greenlet makes), and waits for the kernel too when more
  than that is unsent on the connection (a client slow to read).
- **Memory**, per stream: at most 256 KiB of request body (its window) and the one
  response piece being written; per connection: the streams' windows together, and an
  outbound queue of about 64 KiB plus one piece per writing stream.
- **Time**: ``client_timeout`` bounds a connection without streams (then GOAWAY
  ``NO_ERROR`` and close), each wait for body data, each wait for a client window, and
  each write to the socket.
- **What ``h2`` refuses ends the connection**: a protocol error from the client gets the
  GOAWAY with the error code ``h2`` chose (a content-length ``h2`` refuses among them),
  then the connection is closed (logged at DEBUG: an expected condition). A GOAWAY from
  the client ends the connection too, and its streams in progress see their client gone.
- **Stopping** (``stop()``, at the start of a graceful stop): a GOAWAY ``NO_ERROR``
  naming the last stream taken (``h2``'s own ``close_connection`` would forbid finishing
  the streams in progress, so this frame is ours); later streams are refused, the
  streams in progress finish, then the connection waits briefly for the client to close
  (a lingering close, so that the last answers are not lost to a reset). The reader's
  wait is only ended (its read side shut) once everything queued went out: over TLS,
  OpenSSL fails every write after the EOF its read then sees.
- **Answers**: response header names are lower-cased and connection-specific lines never
  sent (``core.http.h2_response_fields``); ``start`` sends nothing until the first
  ``write`` or ``finish`` (a bodiless answer is one HEADERS frame with END_STREAM);
  trailers go in a last HEADERS frame. When a response ends before the request body
  did, the stream is reset with ``NO_ERROR`` (RFC 9113 8.1: the client stops sending).
  Activator's own answers for a gRPC request are "trailers-only": one HEADERS frame with
  ``:status 200``, ``grpc-status``, ``grpc-message`` and ``x-activator-reason``.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import gevent
import h2.events
import h2.exceptions
from gevent.event import Event
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.settings import SettingCodes, Settings
from hyperframe.exceptions import HyperframeError
from hyperframe.frame import GoAwayFrame, SettingsFrame

from ..base import deadlines
from ..base.exchange import ClientExchange, QueueShare
from ..base.h2wire import (
    CLIENT_PREFACE,
    COUNT_CONTINUATIONS,
    COUNT_EMPTY,
    COUNT_PINGS,
    COUNT_PRIORITIES,
    COUNT_SETTINGS,
    COUNT_WINDOW_UPDATES,
    RECV_SIZE,
    Batch,
    FrameScanner,
    H2Wire,
)
from ..core import heads, http
from ..core.config import LimitsConfig
from ..core.errors import ActivatorError, BodyTooLarge, ClientGone, ClientTimeout, MalformedMessage
from ..core.h2budgets import EMPTY_FRAMES, PINGS, PRIORITY, RESETS, SETTINGS, WINDOW_UPDATES, Budget, BudgetMeter
from ..core.heads import BodyFraming, Header, RequestHead
from .http1 import linger
from .sockets import shutdown_keeping_tls

log = logging.getLogger("activator")

#: The request-body window of each stream (SETTINGS_INITIAL_WINDOW_SIZE): see the module docstring.
STREAM_WINDOW = 256 * 1024
#: The window both sides start with (RFC 9113 6.9.2), and the largest one.
_DEFAULT_WINDOW = 65535
_LARGEST_WINDOW = 2**31 - 1
#: ``h2``'s own stream limit: ours are enforced stream by stream (see the module docstring).
_H2_STREAM_LIMIT = 2**31 - 1
#: ``h2`` ends the connection for a header list over this many times ``max_header_bytes``.
INTERNAL_HEADER_LIST_FACTOR = 4
#: After a graceful GOAWAY and the last stream: how long we wait for the client to close.
LINGER_SECONDS = 1.0
#: After a GOAWAY ENHANCE_YOUR_CALM: how long it may take to go out (a client that reads
#: nothing never takes it) before the connection is closed.
CALM_DOWN_SECONDS = 1.0
#: A ``write`` waits for the kernel to take its bytes once this much is unsent.
OUTBOUND_HIGH_WATER = 65536
_NO_BYTES = b""
_CONTINUE_HEAD = [(b":status", b"100")]
#: ``h2`` decodes, we check (``core.heads``), and our answers are spelled right already.
_H2_CONFIG = H2Configuration(
    client_side=False,
    header_encoding=None,
    validate_inbound_headers=False,
    normalize_inbound_headers=False,
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
    split_outbound_cookies=False,
)


def connection_window(max_streams: int) -> int:
    """The connection's request-body window: twice what all the stream windows hold
    together, so that it never binds before they do (see the module docstring)."""
    return min(2 * max_streams * STREAM_WINDOW, _LARGEST_WINDOW)


class H2Exchange(ClientExchange):
    """One stream of an ``H2ServerConnection``: its request head, its body, its response.

    Built by the connection's reader from the request's header block; read and answered
    by the stream's greenlet (see ``exchange.ClientExchange`` for the contract). Its
    ``deadline`` bounds the stream's own waits; ``expire`` only wakes the waiter.
    """

    __slots__ = (
        "conn",
        "stream_id",
        "deadline",
        "timed_out",
        "buffered_bytes",
        "gone",
        "_wake",
        "_watchers",
        "_pending_head",
        "_head_sent",
        "_cut",
        "_ended_by_us",
        "_reset_sent",
        "_pod_spoke",
        "_open",
        "_unflushed",
    )

    def __init__(self, conn: H2ServerConnection, stream_id: int, head: RequestHead) -> None:
        super().__init__(head, conn.client_ip, conn.client_ip_bytes, conn.scheme_bytes)
        self.conn = conn
        self.stream_id = stream_id
        self.deadline = 0.0
        self.timed_out = False
        self.body_done = head.ended
        #: Request body bytes received and not yet read by the application.
        #: Invariant: at most the stream's window (``STREAM_WINDOW``), which is all the
        #: client may send before the application reads.
        self.buffered_bytes = 0
        #: The client reset the stream, or the connection is lost.
        self.gone = False
        self._wake = Event()
        self._watchers: list[Callable[[], None]] = []
        self._pending_head: list[Header] | None = None  # the final head, until it is sent
        self._head_sent = False
        self._cut = False
        self._ended_by_us = False  # our side of the stream is closed (END_STREAM or RST_STREAM)
        self._reset_sent = False
        self._pod_spoke = False
        self._open = True  # counted in the connection's open streams
        self._unflushed = 0  # bytes written since the last wait for the kernel
        limits = conn.limits
        try:
            heads.check_request_head(head, limits.max_body_bytes, head.list_size, limits.max_header_bytes)
        except ActivatorError as error:
            self.refusal = error

    # -- the request body ------------------------------------------------------------------

    def _await_body(self) -> None:
        if not self._wait_until(self.buffered, self.conn.client_timeout):
            raise ClientTimeout("the request body stalled for client_timeout")

    def _send_continue(self) -> None:
        self._send_headers(_CONTINUE_HEAD, end_stream=False)

    def _consumed(self, size: int) -> None:
        self.buffered_bytes -= size
        self.conn.acknowledge(self.stream_id, size)

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
    def queue_share(self) -> QueueShare:
        return self.conn.queue_share

    @property
    def was_cut(self) -> bool:
        """The response was abandoned mid-way: cut by us, or its client left before its end."""
        return self._cut

    # -- the response -------------------------------------------------------------------

    def interim(self, status: int, reason: bytes, headers: list[Header]) -> None:
        """Relay a 1xx answer before the final one (never 100: ours to give, nor 101)."""
        if self.started or self.gone or status in (100, 101):
            return
        self._send_headers([(b":status", b"%d" % status), *http.h2_response_fields(headers)], end_stream=False)

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
        self._pending_head = [(b":status", b"%d" % status), *http.h2_response_fields(headers)]

    def flush(self) -> None:
        """Send the HEADERS frame now, if it still waits for the first ``write``."""
        self._check_open()
        self._send_pending_head(end_stream=False)

    def write(self, data: bytes) -> None:
        """Send a piece of the body within the client's windows (waiting for the kernel to
        take it when much is unsent: see the module docstring). Raises ``ClientGone`` (the
        stream reset, the connection lost, or no window for ``client_timeout``: then we
        reset the stream with ``CANCEL``)."""
        if not data:
            return
        self._check_open()
        self._send_pending_head(end_stream=False)
        conn = self.conn
        stream_id = self.stream_id
        view = memoryview(data) if len(data) > conn.h2.max_outbound_frame_size else data
        offset = 0
        while offset < len(data):
            window = conn.window(stream_id)
            if window <= 0:
                if not self._wait_until(self._window_open, conn.client_timeout):
                    self._reset(ErrorCodes.CANCEL)
                    self._cut = True
                    raise ClientGone("the client gave no window for client_timeout")
                self._check_open()
                continue
            size = min(window, len(data) - offset)
            if not conn.send_data(stream_id, view[offset : offset + size] if size < len(data) else data):
                raise ClientGone("the stream cannot be sent on")
            offset += size
        self.bytes_sent += len(data)
        conn.meter.sent_data(len(data), time.monotonic())
        self._unflushed += len(data)
        if self._unflushed > OUTBOUND_HIGH_WATER:
            self._unflushed = 0
            self._flushed(conn.mark())

    def finish(self, trailers: Sequence[Header] = (), last: bytes = _NO_BYTES) -> None:
        """End the response: END_STREAM on its last frame (``last``'s DATA when it fits
        the client's windows), after a HEADERS frame of trailers when there are some.
        Raises ``ClientGone``."""
        if self.finished:
            return
        if self._pending_head is None and not self._head_sent:
            self.finished = True
            return  # nothing was started: the stream is reset when it ends
        self._check_open()
        fields = http.h2_response_fields(trailers)
        if last:
            if fields or len(last) > self.conn.window(self.stream_id):
                self.write(last)
            else:  # one DATA frame with END_STREAM
                self._send_pending_head(end_stream=False)
                if not self.conn.send_data(self.stream_id, last, end_stream=True):
                    raise ClientGone("the stream cannot be sent on")
                self.bytes_sent += len(last)
                self.conn.meter.sent_data(len(last), time.monotonic())
                self._ended_by_us = True
                self._maybe_closed()
        if self._pending_head is not None:
            self._send_pending_head(end_stream=not fields)
        if fields:
            self._send_headers(fields, end_stream=True)
        elif not self._ended_by_us:
            if not self.conn.end_stream(self.stream_id):
                raise ClientGone("the stream cannot be sent on")
            self._ended_by_us = True
            self._maybe_closed()
        mark = self.conn.mark()
        if mark - self.conn.sent > OUTBOUND_HIGH_WATER:  # a client slow to read: hold on until it took it
            self._flushed(mark)
        self.finished = True

    def answer(self, error: ActivatorError) -> None:
        """Activator's own answer for ``error`` (gRPC-shaped for a gRPC request); if part
        of a response is out already, the only honest signal left: ``cut``. A malformed
        request gets no answer: its stream is reset (PROTOCOL_ERROR)."""
        if self._head_sent:
            self.cut()
            return
        self._check_open()
        if isinstance(error, MalformedMessage):
            self.started = self.finished = True
            self._reset(ErrorCodes.PROTOCOL_ERROR)
            return
        status, headers, body = http.own_answer_headers(error, http.is_grpc(self.head.content_type))
        self.started = True
        self.status = status
        self._pending_head = [(b":status", b"%d" % status), *http.h2_response_fields(headers)]
        if body and self.head.method != "HEAD":
            self.write(body)
        self.finish()  # a gRPC answer has no body: one HEADERS frame that ends the stream

    def cut(self) -> None:
        """Abandon the response: the stream is reset (``INTERNAL_ERROR``: our side failed;
        a client that left needs nothing more)."""
        self.started = self.finished = True
        self._cut = True
        self._pending_head = None
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
        self._maybe_closed()

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
        self._maybe_closed()
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
        self._close_count()
        deadlines.sweeper().discard(self)

    # -- inside -------------------------------------------------------------------------

    def _maybe_closed(self) -> None:
        """Both sides ended the stream: it no longer counts against the stream limit."""
        if self._ended_by_us and (self.body_done or self.gone):
            self._close_count()

    def _close_count(self) -> None:
        if self._open:
            self._open = False
            self.conn.open_streams -= 1

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
        if self.gone or self.conn.window(self.stream_id) > 0:
            self.conn.window_waiters.discard(self)
            return True
        self.conn.window_waiters.add(self)
        return False

    def _flushed(self, mark: int) -> None:
        """Wait until the outbound queue went out up to ``mark`` (the writer's own deadline
        bounds this). Raises ``ClientGone`` if the connection was lost first."""
        conn = self.conn
        if conn.sent < mark:
            conn.when_sent(mark, self._wake.set)
            self._wait_until(lambda: conn.sent >= mark or conn.lost, None)
        if conn.sent < mark:
            raise ClientGone("the connection was lost before the response went out")

    def _check_open(self) -> None:
        if self.gone or self._ended_by_us:
            raise ClientGone("the client reset the stream" if self.gone else "the stream is closed")

    def _send_pending_head(self, end_stream: bool) -> None:
        head, self._pending_head = self._pending_head, None
        if head is not None:
            self._send_headers(head, end_stream)
            self._head_sent = True

    def _send_headers(self, fields: list[Header], end_stream: bool) -> None:
        self._check_open()
        if not self.conn.send_headers(self.stream_id, fields, end_stream):
            raise ClientGone("the stream cannot be sent on")
        if end_stream:
            self._ended_by_us = True
            self._maybe_closed()

    def _reset(self, code: ErrorCodes) -> None:
        """RST_STREAM, once, unless the client reset the stream first."""
        if not (self.gone or self._reset_sent):
            self.conn.reset(self.stream_id, code)
        self._reset_sent = self._ended_by_us = True
        self._maybe_closed()


RefusalHook = Callable[[str, str, bytes, ActivatorError], None]
BudgetHook = Callable[[Budget], None]


class H2ServerConnection(H2Wire):
    """One HTTP/2 client connection (see the module docstring).

    ``serve()`` runs in the connection's greenlet until the connection ends and its
    streams are done; it closes the socket. ``call_app(exchange)`` runs the application
    for one stream, in that stream's greenlet, and returns once its response is finished
    (``engine.HttpServer._call_app``). The engine has told HTTP/2 from HTTP/1.x by
    looking at the preface without consuming it: ``h2`` reads it. The connection's
    ``deadline`` is the idle (or lingering) deadline, set only while no stream runs.
    """

    __slots__ = (
        "deadline",
        "timed_out",
        "client_ip",
        "client_ip_bytes",
        "limits",
        "client_timeout",
        "scheme",
        "scheme_bytes",
        "max_streams",
        "closing",
        "open_streams",
        "settings_acked",
        "meter",
        "queue_share",
        "window_waiters",
        "_call_app",
        "_on_refusal",
        "_on_budget",
        "_streams",
        "_greenlets",
        "_opened",
        "_pending_acks",
        "_exceeded",
        "_terminated",
        "_end_reading",
    )

    def __init__(
        self,
        sock: Any,
        address: Any,
        limits: LimitsConfig,
        scheme: str,
        call_app: Callable[[H2Exchange], None],
        *,
        on_refusal: RefusalHook | None = None,
        on_budget: BudgetHook | None = None,
    ) -> None:
        h2limits = limits.http2
        h2conn = H2Connection(_H2_CONFIG)
        internal_list_size = INTERNAL_HEADER_LIST_FACTOR * limits.max_header_bytes
        h2conn.local_settings = Settings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: _H2_STREAM_LIMIT,
                SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                SettingCodes.MAX_HEADER_LIST_SIZE: internal_list_size,
            },
        )
        h2conn.decoder.max_header_list_size = internal_list_size  # h2 sets it only when a setting changes
        handlers: dict[type[h2.events.Event], Callable[[Any], None]] = {
            h2.events.RequestReceived: self._on_request,
            h2.events.DataReceived: self._on_data,
            h2.events.StreamEnded: self._on_stream_ended,
            h2.events.TrailersReceived: self._on_trailers,
            h2.events.WindowUpdated: self._on_window_update,
            h2.events.StreamReset: self._on_stream_reset,
            h2.events.RemoteSettingsChanged: self._on_settings,
            h2.events.SettingsAcknowledged: self._on_settings_acknowledged,
            h2.events.ConnectionTerminated: self._on_terminated,
        }
        super().__init__(sock, h2conn, FrameScanner(preface=len(CLIENT_PREFACE)), handlers, limits.client_timeout)
        self.deadline = 0.0
        self.timed_out = False
        self.client_ip = address[0] if isinstance(address, tuple) else str(address)
        self.client_ip_bytes = self.client_ip.encode()
        self.limits = limits
        self.client_timeout = limits.client_timeout
        self.scheme = scheme
        self.scheme_bytes = scheme.encode()
        self.max_streams = h2limits.max_concurrent_streams
        #: A graceful stop is under way (``stop``): no new stream, the others finish.
        self.closing = False
        #: Streams open as RFC 9113 counts them (until both sides ended them).
        self.open_streams = 0
        self.settings_acked = False
        now = time.monotonic()
        self.meter = BudgetMeter(h2limits.budgets, now)
        self.queue_share = QueueShare(h2limits.max_queue_share)
        #: Streams waiting for the client to open a window.
        self.window_waiters: set[H2Exchange] = set()
        self._call_app = call_app
        self._on_refusal = on_refusal
        self._on_budget = on_budget
        #: The streams whose greenlet runs (or is about to), by stream id.
        self._streams: dict[int, H2Exchange] = {}
        self._greenlets: set[gevent.Greenlet] = set()
        self._opened: list[H2Exchange] = []  # streams opened by the batch being dispatched
        self._pending_acks = 0  # PING and SETTINGS acks owed since the writer last caught up
        self._exceeded: Budget | None = None
        self._terminated = False  # h2 sends nothing more (a GOAWAY was sent or received)
        #: The writer shuts the read side once the queue is empty (``expire``).
        self._end_reading = False
        sock.settimeout(None)  # timeouts are deadlines (see ``deadlines``)
        sweeper = deadlines.sweeper()
        sweeper.add(self)
        sweeper.add(self.writer_deadline)
        self._start_h2(now)

    def __repr__(self) -> str:
        return f"<H2ServerConnection {self.client_ip} streams={len(self._streams)}>"

    def _start_h2(self, now: float) -> None:
        """Our preface: one SETTINGS frame with the limits we advertise (``h2``'s own,
        with its internal limits, is not sent), and the connection window opened."""
        h2conn = self.h2
        h2conn.initiate_connection()
        h2conn.data_to_send()  # h2's SETTINGS: ours replaces it
        frame = SettingsFrame(0)
        frame.settings = {
            SettingCodes.MAX_CONCURRENT_STREAMS: self.max_streams,
            SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            SettingCodes.MAX_HEADER_LIST_SIZE: self.limits.max_header_bytes,
        }
        self.queue_frames(frame.serialize())
        h2conn.increment_flow_control_window(connection_window(self.max_streams) - _DEFAULT_WINDOW)
        self.deadline = now + self.client_timeout

    # -- the connection's life ------------------------------------------------------------

    def serve(self) -> None:
        """Serve the connection until it ends (see the class docstring)."""
        writer = gevent.spawn(self.write_loop)
        try:
            self._read_loop()
            if not self.lost and self._streams:  # h2 sends nothing more: a GOAWAY went one way or the other
                self._streams_gone("the connection was terminated")
            gevent.joinall(list(self._greenlets))
            self.stop_writing()
            if self._exceeded is None:
                writer.join()
                if not self.lost:
                    linger(self.sock)
            else:  # past a budget: its GOAWAY gets a moment to go out, then the connection closes
                writer.join(CALM_DOWN_SECONDS)
                self.lose(f"past its {self._exceeded.value} budget")
                writer.kill()
        except BaseException:  # killed (the engine's stop), or a bug: end everything now
            self.lose("the connection was stopped")
            gevent.killall([*self._greenlets, writer])
            raise
        finally:
            sweeper = deadlines.sweeper()
            sweeper.discard(self)
            sweeper.discard(self.writer_deadline)
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
        self.queue_frames(frame.serialize())
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
        self._end_reading = True
        self.kick()

    def _read_loop(self) -> None:
        while True:
            try:
                data = self.sock.recv(RECV_SIZE)
            except (OSError, ValueError):  # ValueError: a TLS socket whose TLS layer was dropped (``lose``)
                data = _NO_BYTES
            if self.timed_out:  # idle, or done lingering: what came now is not read
                return
            if not data:
                if not (self.closing and not self._greenlets):
                    self.lose("the client closed the connection")
                return
            try:
                if not self.receive(data):
                    return
            except (h2.exceptions.ProtocolError, HyperframeError) as error:
                self._protocol_error(error)
                return
            if self._terminated:
                return

    def _protocol_error(self, error: Exception) -> None:
        """What h2 (or the frame scanner) refused: GOAWAY with its code; nothing more is read."""
        log.debug("HTTP/2 protocol error from %s: %s", self.client_ip, error)
        if not self._terminated:
            code = getattr(error, "error_code", ErrorCodes.PROTOCOL_ERROR)
            if not isinstance(error, h2.exceptions.ProtocolError):  # h2 has not queued its GOAWAY
                code = ErrorCodes.FRAME_SIZE_ERROR
                self.h2.close_connection(code)
            self._terminated = True
            self.kick()

    # -- frames in: budgets, events -----------------------------------------------------------

    def _admit_batch(self, batch: Batch) -> bool:
        """Count the batch against the budgets; past one, GOAWAY ENHANCE_YOUR_CALM. Nothing
        more is read once a GOAWAY went either way."""
        if self._terminated:
            return False
        counts = batch.counts
        meter = self.meter
        now = time.monotonic()
        exceeded = None
        if counts[COUNT_EMPTY]:
            exceeded = meter.count(EMPTY_FRAMES, counts[COUNT_EMPTY], now)
        acks = counts[COUNT_PINGS] + counts[COUNT_SETTINGS]
        if acks:
            self._pending_acks += acks
            if counts[COUNT_PINGS]:
                exceeded = meter.count(PINGS, counts[COUNT_PINGS], now) or exceeded
            if counts[COUNT_SETTINGS]:
                exceeded = meter.count(SETTINGS, counts[COUNT_SETTINGS], now) or exceeded
            if self._pending_acks > meter.budgets.pending_acks:
                exceeded = Budget.PENDING_ACKS
        if counts[COUNT_WINDOW_UPDATES]:
            exceeded = meter.count(WINDOW_UPDATES, counts[COUNT_WINDOW_UPDATES], now) or exceeded
        if counts[COUNT_PRIORITIES]:
            exceeded = meter.count(PRIORITY, counts[COUNT_PRIORITIES], now) or exceeded
        if counts[COUNT_CONTINUATIONS] > meter.budgets.continuations:
            exceeded = Budget.CONTINUATIONS
        if exceeded is not None:
            self._calm_down(exceeded)
            return False
        return True

    def _batch_done(self) -> None:
        """Start the greenlets of the streams the batch opened (those it also reset never
        run), then wake the writer."""
        opened, self._opened = self._opened, []
        for exchange in opened:
            if exchange.gone:
                self._stream_done(exchange, None)
            else:
                self._greenlets.add(gevent.spawn(self._run_stream, exchange))
        if self._exceeded is not None and not self._terminated:
            self._calm_down(self._exceeded)
        self.kick()

    def _calm_down(self, budget: Budget) -> None:
        """GOAWAY ENHANCE_YOUR_CALM: the client went past ``budget``."""
        self._exceeded = budget
        if self._terminated:
            return
        log.warning(
            "HTTP/2 client %s went past its %s budget (limits.http2.budgets): GOAWAY ENHANCE_YOUR_CALM",
            self.client_ip,
            budget.value,
        )
        if self._on_budget is not None:
            self._on_budget(budget)
        self.h2.close_connection(ErrorCodes.ENHANCE_YOUR_CALM)
        self._terminated = True
        self._streams_gone(f"the connection went past its {budget.value} budget")
        self.kick()

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        stream_id = event.stream_id
        head = RequestHead.from_h2(event.headers, ended=event.stream_ended is not None)
        if head.malformed is not None:
            self.reset(stream_id, ErrorCodes.PROTOCOL_ERROR)
            self._refused(head, MalformedMessage(head.malformed))
            return
        limit = self.max_streams if self.settings_acked else 2 * self.max_streams
        if self.closing or self.open_streams >= limit or len(self._streams) >= 2 * self.max_streams:
            self.reset(stream_id, ErrorCodes.REFUSED_STREAM)
            return
        self.meter.opened_stream(time.monotonic())
        exchange = H2Exchange(self, stream_id, head)
        self.open_streams += 1
        self._streams[stream_id] = exchange
        self._opened.append(exchange)
        deadlines.sweeper().add(exchange)
        self.deadline = 0.0  # not idle

    def _on_data(self, event: h2.events.DataReceived) -> None:
        exchange = self._streams.get(event.stream_id)
        if exchange is not None:
            exchange.received(event.data, event.flow_controlled_length)
        else:  # a stream we refused or finished: nobody reads it
            self.acknowledge(event.stream_id, event.flow_controlled_length)

    def _on_stream_ended(self, event: h2.events.StreamEnded) -> None:
        exchange = self._streams.get(event.stream_id)
        if exchange is not None:
            exchange.body_ended()

    def _on_trailers(self, event: h2.events.TrailersReceived) -> None:
        exchange = self._streams.get(event.stream_id)
        if exchange is None:
            return
        malformed = heads.trailer_fields_malformed(event.headers)
        if malformed is not None:
            self.reset(event.stream_id, ErrorCodes.PROTOCOL_ERROR)
            exchange.client_left(f"malformed trailers: {malformed}", lost=False)
            return
        exchange.trailers = list(event.headers)

    def _on_window_update(self, event: h2.events.WindowUpdated) -> None:
        if event.stream_id:
            exchange = self._streams.get(event.stream_id)
            if exchange is not None and exchange in self.window_waiters:
                exchange.wake()
        else:
            self._wake_window_waiters()

    def _on_stream_reset(self, event: h2.events.StreamReset) -> None:
        exchange = self._streams.get(event.stream_id)
        if exchange is None:
            return
        if not exchange.started and self._exceeded is None:
            exceeded = self.meter.count(RESETS, 1, time.monotonic())
            if exceeded is not None:
                self._exceeded = exceeded
        exchange.client_left(f"the client reset the stream ({event.error_code!r})", lost=False)

    def _on_settings(self, event: h2.events.RemoteSettingsChanged) -> None:
        if SettingCodes.INITIAL_WINDOW_SIZE in event.changed_settings:
            self._wake_window_waiters()

    def _on_settings_acknowledged(self, event: h2.events.SettingsAcknowledged) -> None:
        self.settings_acked = True

    def _on_terminated(self, event: h2.events.ConnectionTerminated) -> None:
        log.debug("HTTP/2 GOAWAY from %s: %r", self.client_ip, event.error_code)
        self._terminated = True

    def _wake_window_waiters(self) -> None:
        for exchange in self.window_waiters:
            exchange.wake()

    # -- the streams ---------------------------------------------------------------------------

    def _run_stream(self, exchange: H2Exchange) -> None:
        try:
            if exchange.refusal is not None:
                self._refused(exchange.head, exchange.refusal)
                exchange.answer(exchange.refusal)
            else:
                self._call_app(exchange)
        except ClientGone:
            pass
        except Exception:  # a bug (the application's own are answered by call_app): logged once
            log.exception("internal error serving HTTP/2 stream %d of %s", exchange.stream_id, self.client_ip)
            exchange.cut()
        finally:
            self._stream_done(exchange, gevent.getcurrent())

    def _refused(self, head: RequestHead | None, refusal: ActivatorError) -> None:
        log.debug("refused a request from %s: %s (%s)", self.client_ip, refusal.reason, refusal)
        if self._on_refusal is not None:
            self._on_refusal(self.client_ip, head.method if head else "", head.target if head else b"", refusal)

    def _stream_done(self, exchange: H2Exchange, greenlet: Any) -> None:
        exchange.end()
        self.window_waiters.discard(exchange)
        self._streams.pop(exchange.stream_id, None)
        self._greenlets.discard(greenlet)
        if not self._streams:
            self.deadline = time.monotonic() + (LINGER_SECONDS if self.closing else self.client_timeout)

    def _lost(self, why: str) -> None:
        self._streams_gone(why)

    def _streams_gone(self, why: str) -> None:
        """Nothing more can be sent on any stream: each one in progress sees its client gone
        (what is queued still goes out, if the socket lets it)."""
        for exchange in list(self._streams.values()):
            exchange.client_left(why, lost=True)

    # -- frames out ----------------------------------------------------------------------------

    def _outbox_drained(self) -> bool:
        self._pending_acks = 0
        if self._end_reading:
            self._end_reading = False
            shutdown_keeping_tls(self.sock, socket.SHUT_RD)
        return False

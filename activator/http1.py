"""The client side of HTTP/1.x: requests parsed by llhttp, answered in order on one socket.

``H1Connection`` drives httptools' ``HttpRequestParser`` (llhttp, strict: no lenient flag
is ever set) over one client socket and hands out one ``H1Exchange`` per request, which
carries the parsed head, reads the body, and writes the response. Its rules:

- **Pull, not push.** Nothing is read from the socket until the request being served
  needs it (its head, its body) or the connection moves on to the next request; one
  recv is at most 64 KiB, so pipelined requests parsed ahead are bounded by that.
  Requests are answered strictly in order.
- **What llhttp refuses, we refuse**, classified by ``core.http``: a malformed head ->
  400 ``bad-request`` (501 for an unknown method or transfer coding), the connection
  closed after the answer. Our own limits are checked as the parser delivers the head:
  a request line over 8 KiB -> 414, a header section over ``max_header_bytes`` -> 431,
  and so is a chunked body's trailer section (a field section of its own, same limit).
  Then ``core.http`` checks what llhttp leaves to us (version, target form, Host, body
  framing); a refusal that leaves the framing intact (bad Host, absolute-form) keeps the
  connection.
- **Body framing errors close the connection** (a bad chunk, a chunked body over
  ``max_body_bytes``, a client that stops sending): the answer says
  ``Connection: close``, nothing after the error is parsed, and the socket is closed
  after a lingering drain (so that the answer is not lost to a reset). This is what
  keeps a front proxy and activator from disagreeing about where a request ends.
- **Keep-alive** when the client wants it (llhttp's reading of the version and
  ``Connection``) and the request body was read to its end; a body the application did
  not read is discarded up to ``DRAIN_LIMIT`` bytes, else the connection closes.
  ``Expect: 100-continue`` is answered when the application first reads the body (the
  proxy does that once it holds a slot); a request whose body was never asked for
  closes the connection after its answer.
- **Time**: ``client_timeout`` bounds an idle keep-alive connection waiting for its next
  request and the whole head of a request once it started (408 when part of a head
  came, silence when nothing did), and each read of the body and each write after that.
- **Responses** are written with the status line, headers and first body piece in one
  ``send``. 1xx answers go to HTTP/1.1 clients only. Chunked responses carry their
  trailers. A write that fails marks the client gone (``ClientGone``).
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import gevent
import httptools
from gevent.select import select as gselect
from gevent.socket import wait_read

from . import deadlines, hangup
from .core import http
from .core.errors import (
    ActivatorError,
    BadRequest,
    BodyTooLarge,
    ClientBodyError,
    ClientGone,
    ClientTimeout,
    HeadersTooLarge,
    MalformedTarget,
    RequestLineTooLong,
    UnsupportedMethod,
)
from .core.http import BodyFraming
from .sockets import shutdown_keeping_tls

if TYPE_CHECKING:
    from .exchange import ClientExchange

#: One recv from the client.
RECV_SIZE = 65536
#: Longest request target (the old pywsgi limit, kept).
MAX_TARGET = 8192
#: Unread request body the connection discards to stay alive after an answer.
DRAIN_LIMIT = 65536
#: Lingering close: how long and how much we read (and drop) after shutting our side.
LINGER_SECONDS = 1.0
LINGER_BYTES = 65536

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: What an HTTP/2 client sends first (RFC 9113 3.4); an HTTP/1.x request never starts so.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
#: While only a prefix of the preface has come (a rare, slow client), look again this often.
PREFACE_POLL_SECONDS = 0.01
_NO_BYTES = b""
# Names of request headers the connection itself looks at, lower-cased.
_HOST = b"host"
_CONTENT_LENGTH = b"content-length"
_TRANSFER_ENCODING = b"transfer-encoding"
_CONNECTION = b"connection"
_EXPECT = b"expect"
_UPGRADE = b"upgrade"
_FORWARDED = b"x-activator-forwarded"
_CONTENT_TYPE = b"content-type"
_GRPC_TIMEOUT = b"grpc-timeout"
_METHOD_THEN_SPACE = re.compile(rb"(?:\r\n)*[!#$%&'*+\-.^_`|~0-9A-Za-z]+ ")
#: Method names llhttp returned, as str (llhttp knows a fixed set).
_METHODS: dict[bytes, str] = {}
_SPECIAL = frozenset(
    (
        _HOST,
        _CONTENT_LENGTH,
        _TRANSFER_ENCODING,
        _CONNECTION,
        _EXPECT,
        _UPGRADE,
        _FORWARDED,
        _CONTENT_TYPE,
        _GRPC_TIMEOUT,
    )
)


class H1Exchange:
    """One request on an ``H1Connection``: its head, its body, and its response.

    The parser fills the head and the body pieces; the application reads the body with
    ``read`` and answers with ``start``/``write``/``finish`` (or ``answer`` for one of
    activator's own answers, or ``interim`` for a 1xx first).
    """

    __slots__ = (
        "conn",
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
        "transfer_encodings",
        "connection_values",
        "expect_continue",
        "upgrade",
        "upgrade_value",
        "forwarded",
        "content_type",
        "grpc_timeout",
        "tunnel_data",
        "keep_alive",
        "framing",
        "refusal",
        "head_done",
        "body",
        "body_bytes",
        "body_done",
        "body_error",
        "trailers",
        "continue_sent",
        "started",
        "finished",
        "response_framing",
        "close_after",
        "status",
        "bytes_sent",
        "_head",
    )

    def __init__(self, conn: H1Connection) -> None:
        self.conn = conn
        self.client_ip = conn.client_ip
        self.client_ip_bytes = conn.client_ip_bytes
        self.scheme_bytes = conn.scheme_bytes
        self.method = ""
        self.target = _NO_BYTES
        self.version = "1.1"
        self.headers: list[http.Header] = []
        self.lower_names: list[bytes] = []
        # Lines few requests carry: no list until one comes (``core.http.add_line``).
        self.hosts: list[bytes] | tuple[()] = ()
        self.host = ""
        self.content_length: int | None = None
        self.transfer_encodings: list[bytes] | tuple[()] = ()
        self.connection_values: list[bytes] | tuple[()] = ()
        self.expect_continue = False
        self.upgrade = False
        self.upgrade_value: bytes | None = None
        #: ``X-Activator-Forwarded`` lines (the hops between activators), in order.
        self.forwarded: list[bytes] | tuple[()] = ()
        self.content_type: bytes | None = None
        self.grpc_timeout: bytes | None = None
        #: Bytes the client sent after the head of an upgrade request (tunnel data).
        self.tunnel_data = _NO_BYTES
        self.keep_alive = True
        self.framing = BodyFraming.NONE
        #: Set when the head is fine for llhttp but refused by our rules.
        self.refusal: ActivatorError | None = None
        self.head_done = False
        #: Body pieces parsed and not read yet (a list: an empty deque costs 600 bytes,
        #: and this one holds a piece or two).
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.body_done = False
        self.body_error: ActivatorError | None = None
        self.trailers: list[http.Header] | tuple[()] = ()
        self.continue_sent = False
        self.started = False
        self.finished = False
        self.response_framing = BodyFraming.NONE
        self.close_after = False
        self.status = 0
        #: Body bytes actually handed to the kernel for the client.
        self.bytes_sent = 0
        self._head = _NO_BYTES

    def __repr__(self) -> str:
        return f"<H1Exchange {self.method} {self.target[:60]!r} HTTP/{self.version}>"

    # -- the request -------------------------------------------------------------------

    def read(self, size: int = RECV_SIZE) -> bytes:
        """The next piece of the request body (at most ``size`` bytes); b"" at its end.

        Raises the body's framing error (``ClientBodyError``, ``BodyTooLarge``),
        ``ClientTimeout``, or ``ClientGone`` if the client closed mid-body. The first
        read answers ``Expect: 100-continue``.
        """
        body = self.body
        while not body:
            if self.body_error is not None:
                raise self.body_error
            if self.body_done:
                return _NO_BYTES
            if self.expect_continue and not self.continue_sent:
                self.continue_sent = True
                if not self.started:
                    self.conn.send(_CONTINUE)
            self.conn.pump_body(self)
        piece = body.pop(0)
        if len(piece) > size:
            body.insert(0, piece[size:])
            return piece[:size]
        if body and len(piece) + len(body[0]) <= size:  # several pieces already here: one read
            pieces = [piece]
            taken = len(piece)
            while body and taken + len(body[0]) <= size:
                more = body.pop(0)
                pieces.append(more)
                taken += len(more)
            piece = b"".join(pieces)
        return piece

    def raise_known_error(self) -> None:
        """Raise the body's error if the bytes already parsed show it (no socket read).

        Called before the first byte goes to the pod: a request whose framing is broken
        within what already arrived (the usual smuggling attempt, in one packet) reaches
        no pod at all.
        """
        if self.body_error is not None and not self.body:
            raise self.body_error

    def buffered(self) -> bool:
        """Whether body bytes (or its end, or an error) are here without reading the socket."""
        return bool(self.body) or self.body_done or self.body_error is not None

    def fileno(self) -> int:
        return int(self.conn.sock.fileno())

    def wait_for_body(self, pod_fd: int, timeout: float) -> bool:
        """Wait for more body or for the pod to speak; True if the pod did."""
        readable, _, _ = gselect([self.fileno(), pod_fd], [], [], timeout)
        if not readable:
            raise ClientTimeout("the request body stalled for client_timeout")
        return pod_fd in readable

    # -- the client ---------------------------------------------------------------------

    def watch_gone(self, on_gone: Callable[[], None]) -> bool:
        return self.conn.watch_gone(on_gone)

    def unwatch_gone(self, on_gone: Callable[[], None]) -> None:
        self.conn.unwatch_gone(on_gone)

    def client_gone(self) -> bool:
        return self.conn.client_gone()

    @property
    def was_cut(self) -> bool:
        return self.conn.cut

    # -- the response ------------------------------------------------------------------

    def interim(self, status: int, reason: bytes, headers: list[http.Header]) -> None:
        """Relay a pod's 1xx answer (before the final one); HTTP/1.0 clients never get one."""
        if self.version == "1.1" and not self.started:
            lower_names = [name.lower() for name, _ in headers]
            kept = http.response_headers(headers, lower_names, BodyFraming.NONE)
            self.conn.send(b"%s%s\r\n" % (http.status_line(status, reason), http.header_block(kept)))

    def start(
        self,
        status: int,
        reason: bytes | None,
        headers: Sequence[http.Header],
        framing: BodyFraming,
        close: bool = False,
    ) -> None:
        """Begin the final response: the head is sent with the first ``write`` (or ``finish``).

        ``headers``: end-to-end header lines, without framing or Connection lines
        (``core.http.response_headers``); ``framing`` says how the body goes out
        (``core.http.client_framing``).
        """
        self.started = True
        self.status = status
        self.response_framing = framing
        close = close or self._must_close() or framing is BodyFraming.CLOSE
        self.close_after = close
        parts = [http.status_line(status, reason)]
        parts += [b"%s: %s\r\n" % header for header in headers]
        if framing is BodyFraming.CHUNKED:
            parts.append(b"Transfer-Encoding: chunked\r\n")
        if close:
            parts.append(b"Connection: close\r\n")
        elif self.version == "1.0":
            parts.append(b"Connection: keep-alive\r\n")
        parts.append(b"\r\n")
        self._head = b"".join(parts)

    def write(self, data: bytes) -> None:
        """Send a piece of the body (with the head, the first time). Raises ClientGone."""
        if not data:
            return
        framed = b"%x\r\n%s\r\n" % (len(data), data) if self.response_framing is BodyFraming.CHUNKED else data
        head = self._head
        if head:
            self._head = _NO_BYTES
            framed = head + framed
        self.conn.send(framed)
        self.bytes_sent += len(data)

    def flush(self) -> None:
        """Send the head now, if it still waits for the first ``write``. Raises ClientGone."""
        head = self._head
        if head:
            self._head = _NO_BYTES
            self.conn.send(head)

    def finish(self, trailers: Sequence[http.Header] = ()) -> None:
        """End the response (the last chunk and the trailers, for chunked; an HTTP/1.x
        response that is not chunked has nowhere to put trailers: they are dropped)."""
        if self.finished:
            return
        self.finished = True
        tail = self._head
        self._head = _NO_BYTES
        if self.response_framing is BodyFraming.CHUNKED:
            tail += b"0\r\n%s\r\n" % http.header_block(trailers)
        if tail:
            self.conn.send(tail)

    def switch_protocols(self, reason: bytes, headers: Sequence[http.Header]) -> tuple[Any, bytes]:
        """Send the pod's 101 (with ``Connection: upgrade``) and hand over the socket.

        Returns the client socket and the bytes it sent after its request head; the
        connection carries no more HTTP/1.x after this (it ends when the tunnel does).
        """
        self.started = self.finished = True
        self.status = 101
        self.close_after = True
        lines = b"".join([b"%s: %s\r\n" % header for header in headers])
        self.conn.send(b"%s%sConnection: upgrade\r\n\r\n" % (http.status_line(101, reason), lines))
        self.conn.cut = True  # after the tunnel: no lingering, no next request
        return self.conn.sock, self.tunnel_data

    def answer(self, error: ActivatorError) -> None:
        """Activator's own answer for ``error``; if the response already started, the
        only honest signal left is cutting the connection."""
        if self.started and not self._head:  # part of the pod's answer is out already
            self.cut()
            return
        self._head = _NO_BYTES
        close = error.closes_connection or self._must_close()
        grpc = http.is_grpc(self.content_type)
        self.started = self.finished = True
        self.status = 200 if grpc else error.status
        self.close_after = close
        self.conn.send(http.own_answer(error, close, grpc))
        self.bytes_sent += len(http.own_answer_headers(error, grpc)[2])  # its body, for the access log

    def cut(self) -> None:
        """Abandon the response mid-way: the connection is closed without finishing it."""
        self.started = self.finished = True
        self.close_after = True
        self.conn.cut = True

    def _must_close(self) -> bool:
        """Whether the connection cannot carry another request after this answer."""
        if not self.keep_alive or self.conn.closing:
            return True
        if self.body_done:
            return False
        if self.body_error is not None or (self.expect_continue and not self.continue_sent):
            return True
        if self.framing is BodyFraming.LENGTH:  # the rest can be discarded if it is small
            assert self.content_length is not None
            return self.content_length - self.body_bytes > DRAIN_LIMIT
        return True  # an unfinished chunked body: its length is unknown


class H1Connection(deadlines.Watched):
    """One client connection (see the module docstring). Used by one greenlet."""

    __slots__ = (
        "client_ip",
        "client_ip_bytes",
        "client_timeout",
        "max_header_bytes",
        "max_body_bytes",
        "scheme",
        "scheme_bytes",
        "closing",
        "cut",
        "_parser",
        "_ready",
        "_current",
        "_url_parts",
        "_field_bytes",
        "_fed_without_data",
        "_data_in_feed",
        "_error",
        "_eof",
        "_stopped",
        "_upgraded",
        "_in_head_wait",
        "_feeding",
        "_head_raw",
        "_head_raw_from_start",
        "_at_boundary",
        "_completed_in_feed",
        "_served_one",
        "_hangup_fd",
        "_hung_up",
        "_on_gone",
    )

    def __init__(
        self,
        sock: Any,
        address: Any,
        client_timeout: float,
        max_header_bytes: int,
        max_body_bytes: int | None,
        scheme: str = "http",
    ) -> None:
        super().__init__(sock)
        self.client_ip = address[0] if isinstance(address, tuple) else str(address)
        self.client_ip_bytes = self.client_ip.encode()
        self.client_timeout = client_timeout
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.scheme = scheme
        self.scheme_bytes = scheme.encode()
        #: The connection ends after the current answer (set by the server when stopping).
        self.closing = False
        #: A response was abandoned mid-way: close without lingering.
        self.cut = False
        self._parser = httptools.HttpRequestParser(self)
        self._ready: list[H1Exchange] = []  # heads parsed ahead (pipelining), in order
        self._current: H1Exchange | None = None  # the message being parsed
        self._url_parts: list[bytes] = []
        #: Size so far of the field section being parsed, the head's and then a chunked
        #: body's trailers' (what max_header_bytes limits).
        self._field_bytes = 0
        #: Bytes fed since the message began or its body last brought data: a memory
        #: backstop for a field line llhttp (httptools) buffers until it ends.
        self._fed_without_data = 0
        self._data_in_feed = False  # on_body ran during the current feed
        self._error: ActivatorError | None = None  # a refused head, after the ready ones
        self._eof = False  # the client closed (or reset) its side
        self._stopped = False  # nothing more is parsed (an error, or the limit backstop)
        self._upgraded = False
        self._in_head_wait = False  # a timeout now still lets us answer 408
        # Raw bytes, for the checks llhttp leaves to us (the request line, the method).
        self._feeding = _NO_BYTES  # the data being fed now
        self._head_raw = _NO_BYTES  # the feeds since the current head began
        #: Whether ``_head_raw`` begins where the message does (nothing of another before it).
        self._head_raw_from_start = True
        self._at_boundary = True  # the feed began between two messages
        self._completed_in_feed = 0
        #: A request of this plain-TCP connection was handed out already (see ``next_exchange``).
        self._served_one = False
        #: The socket as the hang-up monitor watches it (-1: not watched); see ``watch_gone``.
        self._hangup_fd = -1
        self._hung_up = False  # the monitor saw the client hang up
        self._on_gone: Callable[[], None] | None = None  # the current watch's callback
        sock.settimeout(None)  # timeouts are deadlines (see ``deadlines``)
        deadlines.sweeper().add(self)

    def expire(self) -> None:
        """A deadline passed: interrupt the wait (keeping the write side for a 408)."""
        self.timed_out = True
        shutdown_keeping_tls(self.sock, socket.SHUT_RD if self._in_head_wait else socket.SHUT_RDWR)

    # -- llhttp callbacks (called from feed_data; they never yield) ------------------------

    def on_message_begin(self) -> None:
        self._head_raw = self._feeding  # where this head's request line is (see _check_request_line)
        self._head_raw_from_start = self._at_boundary and not self._completed_in_feed
        self._current = H1Exchange(self)
        self._url_parts = []
        self._field_bytes = 0
        self._fed_without_data = 0

    def on_url(self, url: bytes) -> None:
        parts = self._url_parts
        parts.append(url)
        if (len(parts) > 1 and sum(map(len, parts)) > MAX_TARGET) or len(url) > MAX_TARGET:
            raise RequestLineTooLong(f"request target over {MAX_TARGET} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        exchange = self._current
        assert exchange is not None
        self._field_bytes += len(name) + len(value) + 4
        if exchange.head_done:  # a trailer of a chunked body
            if self._field_bytes > self.max_header_bytes:
                raise HeadersTooLarge(f"trailer section over {self.max_header_bytes} bytes")
            exchange.trailers = http.add_line(exchange.trailers, (name, value))
            return
        if self._field_bytes > self.max_header_bytes:
            raise HeadersTooLarge(f"header section over {self.max_header_bytes} bytes")
        exchange.headers.append((name, value))
        lower = name.lower()
        exchange.lower_names.append(lower)
        if lower in _SPECIAL:
            if lower == _HOST:
                exchange.hosts = http.add_line(exchange.hosts, value)
            elif lower == _CONTENT_LENGTH:
                exchange.content_length = int(value)  # llhttp has validated it
            elif lower == _TRANSFER_ENCODING:
                exchange.transfer_encodings = http.add_line(exchange.transfer_encodings, value)
            elif lower == _CONNECTION:
                exchange.connection_values = http.add_line(exchange.connection_values, value)
            elif lower == _EXPECT:
                exchange.expect_continue = value.lower() == b"100-continue"
            elif lower == _UPGRADE:
                exchange.upgrade_value = value
            elif lower == _FORWARDED:
                exchange.forwarded = http.add_line(exchange.forwarded, value)
            elif lower == _CONTENT_TYPE:
                exchange.content_type = value
            else:
                exchange.grpc_timeout = value

    def on_headers_complete(self) -> None:
        exchange = self._current
        assert exchange is not None
        parser = self._parser
        parts = self._url_parts
        exchange.target = target = parts[0] if len(parts) == 1 else b"".join(parts)
        raw_method = parser.get_method()
        method = _METHODS.get(raw_method)
        if method is None:
            method = _METHODS.setdefault(raw_method, raw_method.decode("ascii"))
        exchange.method = method
        exchange.version = version = parser.get_http_version()
        exchange.keep_alive = parser.should_keep_alive()
        # llhttp flags Upgrade requests (and CONNECT, refused below) as upgrades.
        upgrade = exchange.upgrade_value is not None and method != "CONNECT" and parser.should_upgrade()
        exchange.upgrade = upgrade
        try:
            self._check_request_line(raw_method, target, version)
            exchange.framing, exchange.host = http.check_request_head(
                version,
                method,
                target,
                exchange.hosts,
                exchange.content_length,
                exchange.transfer_encodings,
                upgrade,
                self.max_body_bytes,
            )
        except ActivatorError as error:
            if error.closes_connection:
                raise  # stops the parser: nothing after this head is read as HTTP
            exchange.refusal = error
        self._head_raw = _NO_BYTES  # checked: not kept while the request waits
        self._field_bytes = self._fed_without_data = 0  # trailers, if any, are a section of their own
        exchange.head_done = True
        if exchange.framing is BodyFraming.NONE:
            exchange.body_done = True
        self._ready.append(exchange)

    def on_body(self, data: bytes) -> None:
        exchange = self._current
        assert exchange is not None
        exchange.body.append(data)
        exchange.body_bytes += len(data)
        self._data_in_feed = True
        maximum = self.max_body_bytes
        if maximum is not None and exchange.body_bytes > maximum:
            raise BodyTooLarge(f"request body over max_body_bytes {maximum}")

    def on_message_complete(self) -> None:
        exchange = self._current
        assert exchange is not None
        exchange.body_done = True
        self._current = None
        self._completed_in_feed += 1

    def _check_request_line(self, method: bytes, target: bytes, version: str) -> None:
        """The request line as llhttp read it must be in the bytes as they came, exactly.

        llhttp tolerates several spaces between the parts of a request line and a version
        without digits it reads as 0.9; RFC 9112 asks for one SP. A head is in the bytes
        of the feeds since its message began (``_head_raw``, which may begin with the end
        of the message before it).
        """
        line = b"%s %s HTTP/%s\r\n" % (method, target, version.encode("ascii"))
        raw = self._head_raw
        if raw.startswith(line):  # the usual case: nothing before it
            return
        at = raw.find(line)
        if at < 0:
            raise BadRequest("malformed request line")
        # Before it, only empty lines (RFC 9112 2.2); llhttp also skips a bare CR there.
        if self._head_raw_from_start and raw[:at].replace(b"\r\n", b"").strip(b"\n"):
            raise BadRequest("bytes before the request line")

    # -- reading ----------------------------------------------------------------------------

    def starts_with_h2_preface(self) -> bool:
        """Whether the client opened with the HTTP/2 connection preface (h2c with prior
        knowledge). Looks without consuming (``MSG_PEEK``), within ``client_timeout``."""
        self.deadline = time.monotonic() + self.client_timeout
        self._in_head_wait = True
        try:
            while True:
                try:
                    seen = self.sock.recv(len(H2_PREFACE), socket.MSG_PEEK)
                except OSError:
                    return False
                if not seen or not H2_PREFACE.startswith(seen):
                    return False
                if len(seen) == len(H2_PREFACE):
                    return True
                if hangup.hung_up(self.sock):
                    return False  # a prefix and then the end (a peek cannot tell): HTTP/1.x's to refuse
                gevent.sleep(PREFACE_POLL_SECONDS)  # a prefix of it: the rest is on its way
        finally:
            self.deadline = 0.0
            self._in_head_wait = False

    def next_exchange(self) -> H1Exchange | None:
        """The next request, or None when the connection is done (EOF, idle timeout).

        Raises the refusal of a head llhttp or our limits refused (the connection then
        closes after the answer).
        """
        ready = self._ready
        if not ready and self._error is None and not self._stopped and not self._upgraded:
            self.deadline = time.monotonic() + self.client_timeout
            self._in_head_wait = True
            try:
                if self._served_one and self._current is None:
                    # A keep-alive client sends its next request once it has read our
                    # answer: wait for it rather than try a recv bound to fail (a syscall
                    # and an exception per request). Not under TLS, whose layer may hold
                    # decrypted bytes the socket no longer shows. A deadline ends the wait
                    # too (the socket is shut: EOF).
                    wait_read(self.sock.fileno())
                while not ready and self._error is None and not self._stopped:
                    if not self._pump():
                        if self._current is not None:  # part of a head came, not all of it
                            if self.timed_out:
                                raise ClientTimeout("request head not received within client_timeout")
                            raise BadRequest("the request head was cut short")
                        return None  # the client left, or an idle keep-alive connection timed out
            finally:
                self.deadline = 0.0
                self._in_head_wait = False
        if ready:
            self._served_one = self.scheme == "http"
            return ready.pop(0)
        if self._error is not None:
            error, self._error = self._error, None
            self._stopped = True
            raise error
        return None

    def pump_body(self, exchange: H1Exchange) -> None:
        """Read more of ``exchange``'s body (it is the message being parsed)."""
        if self._stopped:
            exchange.body_error = ClientGone("client closed the connection before the body ended")
            return
        self.deadline = time.monotonic() + self.client_timeout
        try:
            more = self._pump()
        finally:
            self.deadline = 0.0
        if not more and exchange.body_error is None:
            if self.timed_out:
                exchange.body_error = ClientTimeout("request body stalled for client_timeout")
            else:
                exchange.body_error = ClientGone("client closed the connection before the body ended")

    def _pump(self) -> bool:
        """One recv, fed to the parser. False at EOF (or a timeout: see ``timed_out``)."""
        try:
            data = self.sock.recv(RECV_SIZE)
        except OSError:
            self._eof = self._stopped = True
            return False
        if not data:
            self._eof = self._stopped = True
            return False
        self._feed(data)
        return True

    def _feed(self, data: bytes) -> None:
        current = self._current
        if current is not None and not current.head_done:
            self._head_raw += data  # a head that goes on from the previous feed
        self._feeding = data
        self._at_boundary = current is None
        self._completed_in_feed = 0
        try:
            self._parser.feed_data(data)
            self._feeding = _NO_BYTES
        except httptools.HttpParserUpgrade as upgrade:
            self._upgraded = True
            offset = upgrade.args[0]
            exchange = self._ready[-1] if self._ready else None
            if exchange is not None:
                exchange.tunnel_data = data[offset:]
            return
        except httptools.HttpParserError as error:
            self._stopped = True  # llhttp is in an error state: nothing more is parsed
            self._parse_failed(error)
            return
        data_came, self._data_in_feed = self._data_in_feed, False
        current = self._current
        if current is None:
            return
        if data_came:
            self._fed_without_data = 0
            return
        self._fed_without_data += len(data)
        if self._fed_without_data > self.max_header_bytes + RECV_SIZE:
            self._stopped = True
            if current.head_done:  # an endless trailer line, or chunk framing with no data
                current.body_error = ClientBodyError(
                    f"chunked body: over {self.max_header_bytes + RECV_SIZE} bytes without data"
                )
            else:
                self._error = HeadersTooLarge(f"header section over {self.max_header_bytes} bytes")

    def _parse_failed(self, error: httptools.HttpParserError) -> None:
        cause = error.__context__
        ours = cause if isinstance(cause, ActivatorError) else None
        current = self._current
        if current is not None and current.head_done:
            # In the body: its framing is broken (or it grew past the limit).
            current.body_error = ours or ClientBodyError(f"request body: {error}")
            return
        if ours is not None:
            self._error = ours
        elif isinstance(error, httptools.HttpParserInvalidMethodError):
            self._error = self._method_refusal()
        elif isinstance(error, httptools.HttpParserInvalidURLError):
            self._error = MalformedTarget(str(error))
        else:
            self._error = http.refusal_of_head(str(error))

    def _method_refusal(self) -> ActivatorError:
        """501 for a well-formed method llhttp does not know, 400 for a malformed line.

        Only told apart when the failing request line starts this feed (the usual case: it
        is the first thing the client sent, or it came on its own): then its first word is
        in plain view.
        """
        if self._at_boundary and not self._completed_in_feed and _METHOD_THEN_SPACE.match(self._feeding):
            return UnsupportedMethod("a method llhttp does not know")
        return BadRequest("malformed request line")

    # -- after an answer ------------------------------------------------------------------

    def settle(self, exchange: H1Exchange) -> bool:
        """After ``exchange``'s answer: whether the connection carries another request.

        Discards what is left of its body when that is small enough and intact.
        """
        if exchange.close_after or self.cut or self.closing or not exchange.keep_alive:
            return False
        drained = 0
        while not exchange.body_done:
            if exchange.body_error is not None or drained > DRAIN_LIMIT:
                return False
            drained += sum(map(len, exchange.body))
            exchange.body.clear()
            if not exchange.body_done:
                self.pump_body(exchange)
        return exchange.body_error is None and not self._upgraded

    # -- writing ----------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Hand ``data`` to the kernel (one send when it fits). Raises ClientGone."""
        sock = self.sock
        try:
            sent = sock.send(data)
            if sent < len(data):
                self.deadline = time.monotonic() + self.client_timeout
                try:
                    sock.sendall(memoryview(data)[sent:])
                finally:
                    self.deadline = 0.0
        except (OSError, ValueError) as error:
            self.cut = True
            raise ClientGone(f"writing to the client failed: {error!r}") from None

    # -- the client hanging up ---------------------------------------------------------------

    def watch_gone(self, on_gone: Callable[[], None]) -> bool:
        """Call ``on_gone()`` (in the hub) when the client hangs up; False if it has already.

        The first watch puts the socket in the hang-up monitor and it stays there until
        the connection closes: a watch that ends (``unwatch_gone``) costs no syscall, and
        neither does ``client_gone`` while the socket is watched (the monitor would have
        called). Does not yield.
        """
        if self._hung_up:
            return False
        if self._hangup_fd < 0:
            try:
                fd = self.sock.fileno()
            except OSError:
                return False
            if fd < 0 or not hangup.monitor().watch(fd, self._client_hung_up):
                return False
            self._hangup_fd = fd
        self._on_gone = on_gone
        return True

    def unwatch_gone(self, on_gone: Callable[[], None]) -> None:
        if self._on_gone == on_gone:
            self._on_gone = None

    def client_gone(self) -> bool:
        """Whether the client hung up: the monitor's word while it watches the socket,
        else one ``poll``. Does not yield."""
        if self._hung_up:
            return True
        if self._hangup_fd >= 0:
            return False
        return hangup.hung_up(self.sock)

    def _client_hung_up(self) -> None:
        """The monitor's callback (it ended its watch as it fired)."""
        self._hung_up = True
        self._hangup_fd = -1
        on_gone, self._on_gone = self._on_gone, None
        if on_gone is not None:
            on_gone()

    def close(self) -> None:
        """Close the socket. When we end a connection the client has not closed (and whose
        answer was complete), linger first, so that the answer is not lost to a reset."""
        sock = self.sock
        deadlines.sweeper().discard(self)
        if self._hangup_fd >= 0:
            hangup.monitor().unwatch(self._hangup_fd, self._client_hung_up)
            self._hangup_fd = -1
        try:
            if not self._eof and not self.cut and not self.timed_out:
                linger(sock)
        finally:
            sock.close()


def linger(sock: Any, seconds: float = LINGER_SECONDS, limit: int = LINGER_BYTES) -> None:
    """Shut our side and read (and drop) what the client still sends, briefly.

    Closing with unread data makes the kernel send a reset, which can overtake the
    answer just written; this lets the client read it first. (A socket timeout here: the
    connection is ending, a timer for one last wait is fine.)
    """
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(seconds)
        deadline = time.monotonic() + seconds
        drained = 0
        while drained < limit and time.monotonic() < deadline:
            data = sock.recv(16384)
            if not data:
                break
            drained += len(data)
    except OSError:
        pass


if TYPE_CHECKING:  # mypy checks that an HTTP/1.x exchange is a ClientExchange

    def _is_a_client_exchange(exchange: H1Exchange) -> ClientExchange:
        return exchange

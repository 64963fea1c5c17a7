"""The client side of HTTP/1.x: requests parsed by llhttp, answered in order on one socket.

``H1Connection`` drives httptools' ``HttpRequestParser`` (llhttp, strict: no lenient flag
is ever set) over one client socket and hands out one ``H1Exchange`` per request, which
carries the parsed head, reads the body, and writes the response. Its rules:

- **Pull, not push.** Nothing is read from the socket until the request being served
  needs it (its head, its body) or the connection moves on to the next request; one
  recv is at most 64 KiB, so pipelined requests parsed ahead are bounded by that.
  Requests are answered strictly in order.
- **What llhttp refuses, we refuse**, classified by ``core.heads``: a malformed head ->
  400 ``bad-request`` (501 for a transfer coding), the connection closed after the
  answer. Our own limits are checked as the parser delivers the head: a request line
  over 8 KiB -> 414, a header section over ``max_header_bytes`` -> 431, and so is a
  chunked body's trailer section (a field section of its own, same limit). The head is
  a ``core.heads.RequestHead``, checked by ``core.heads.check_request_head`` as an
  HTTP/2 one is (version, method, target form, body framing, Host, Upgrade); a refusal
  that leaves the framing intact (bad Host, absolute-form) keeps the connection.
- **Any token is a method** (RFC 9110 9.1). llhttp knows a fixed list of them, so every
  message is fed to it from its first byte on (the feeds are cut where a message may
  end: after each CRLF CRLF, and at the end of a body of known length; a chunked body
  ends with CRLF CRLF too), and a method outside ``FED_AS_IS`` is given to llhttp as
  ``GET``, a method of no consequence for a request's framing; the exchange keeps the
  method the client sent, and the request line is checked against the bytes as they
  came.
- **Upgrade**: llhttp stops at the end of an Upgrade request's head (it skips any body).
  A request that becomes a tunnel if its pod answers 101 (``core.heads.wants_tunnel``)
  keeps what followed its head for the tunnel; when the pod answers anything else, the
  connection goes on with those bytes as the next requests. A declined Upgrade (it has a
  body, or asks for ``h2c``) is served as a plain request: its body is read by a parser
  primed with a head of the same framing, which goes on with the requests after it.
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
from typing import Any

import gevent
import httptools
from gevent.select import select as gselect
from gevent.socket import wait_read

from ..base import deadlines
from ..base.exchange import ClientExchange
from ..core import heads, http
from ..core.errors import (
    ActivatorError,
    BadRequest,
    BodyTooLarge,
    ClientBodyError,
    ClientGone,
    ClientTimeout,
    HeadersTooLarge,
    MalformedTarget,
    RequestLineTooLong,
)
from ..core.heads import BodyFraming, RequestHead
from . import hangup
from .sockets import shutdown_keeping_tls

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
_HEAD_END = b"\r\n\r\n"
#: Methods fed to llhttp as they came; any other token is fed as ``GET`` (see the
#: module docstring). CONNECT is llhttp's to read as the tunnel request it is.
FED_AS_IS = frozenset((b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"CONNECT"))
_STAND_IN = b"GET"
#: A message's start: empty lines, then a method token and its space.
_REQUEST_START = re.compile(rb"(?:\r\n)*([!#$%&'*+\-.^_`|~0-9A-Za-z]+) ")
#: What may still become one: empty lines, then part of a token (or a lone CR).
_PARTIAL_START = re.compile(rb"(?:\r\n)*(?:\r|[!#$%&'*+\-.^_`|~0-9A-Za-z]*)\Z")
#: Heads that put a fresh parser in the body of a declined Upgrade request.
_PRIMED_LENGTH = b"PUT / HTTP/1.1\r\nContent-Length: %d\r\n\r\n"
_PRIMED_CHUNKED = b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"


class H1Exchange(ClientExchange):
    """One request on an ``H1Connection``: its head, its body, and its response
    (``exchange.ClientExchange``)."""

    __slots__ = ("conn", "head_done", "tunnel_data", "response_framing", "close_after", "_pending_head")

    def __init__(self, conn: H1Connection) -> None:
        super().__init__(RequestHead(), conn.client_ip, conn.client_ip_bytes, conn.scheme_bytes)
        self.conn = conn
        self.head_done = False
        #: Bytes the client sent after the head of an upgrade request (tunnel data).
        self.tunnel_data = _NO_BYTES
        self.response_framing = BodyFraming.NONE
        self.close_after = False
        #: The final response's head, until it goes out with the first piece of its body.
        self._pending_head = _NO_BYTES

    # -- the request -------------------------------------------------------------------

    def _await_body(self) -> None:
        self.conn.pump_body(self)

    def _send_continue(self) -> None:
        self.conn.send(_CONTINUE)

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
        """The response was abandoned mid-way: cut, or its client left before its end."""
        conn = self.conn
        return conn.cut or (conn.hung_up and not self.finished)

    # -- the response ------------------------------------------------------------------

    def interim(self, status: int, reason: bytes, headers: list[heads.Header]) -> None:
        """Relay a pod's 1xx answer (before the final one; never 100, activator's to give,
        nor 101); HTTP/1.0 clients never get one."""
        if self.head.version == "1.1" and not self.started and status not in (100, 101):
            lower_names = [name.lower() for name, _ in headers]
            kept = http.response_headers(headers, lower_names, BodyFraming.NONE)
            self.conn.send(b"%s%s\r\n" % (http.status_line(status, reason), http.header_block(kept)))

    def start(
        self,
        status: int,
        reason: bytes | None,
        headers: Sequence[heads.Header],
        framing: BodyFraming,
        close: bool = False,
    ) -> None:
        """Begin the final response: the head is sent with the first ``write`` (or ``finish``).

        ``headers``: end-to-end header lines, without framing or Connection lines
        (``core.http.response_headers``); ``framing`` says how the body goes out
        (``core.heads.client_framing``).
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
        elif self.head.version == "1.0":
            parts.append(b"Connection: keep-alive\r\n")
        parts.append(b"\r\n")
        self._pending_head = b"".join(parts)

    def write(self, data: bytes) -> None:
        """Send a piece of the body (with the head, the first time). Raises ClientGone."""
        if not data:
            return
        framed = b"%x\r\n%s\r\n" % (len(data), data) if self.response_framing is BodyFraming.CHUNKED else data
        head = self._pending_head
        if head:
            self._pending_head = _NO_BYTES
            framed = head + framed
        self.conn.send(framed)
        self.bytes_sent += len(data)

    def flush(self) -> None:
        """Send the head now, if it still waits for the first ``write``. Raises ClientGone."""
        head = self._pending_head
        if head:
            self._pending_head = _NO_BYTES
            self.conn.send(head)

    def finish(self, trailers: Sequence[heads.Header] = (), last: bytes = _NO_BYTES) -> None:
        """End the response (the last chunk and the trailers, for chunked; an HTTP/1.x
        response that is not chunked has nowhere to put trailers: they are dropped), in
        one send with the head and ``last`` when they are still here."""
        if self.finished:
            return
        self.finished = True
        tail = self._pending_head
        self._pending_head = _NO_BYTES
        chunked = self.response_framing is BodyFraming.CHUNKED
        if last:
            tail += b"%x\r\n%s\r\n" % (len(last), last) if chunked else last
        if chunked:
            tail += b"0\r\n%s\r\n" % http.header_block(trailers)
        if tail:
            self.conn.send(tail)
        self.bytes_sent += len(last)

    def switch_protocols(self, reason: bytes, headers: Sequence[heads.Header]) -> tuple[Any, bytes]:
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
        if self.started and not self._pending_head:  # part of the pod's answer is out already
            self.cut()
            return
        self._pending_head = _NO_BYTES
        close = error.closes_connection or self._must_close()
        grpc = http.is_grpc(self.head.content_type)
        self.started = self.finished = True
        self.status = 200 if grpc else error.status
        self.close_after = close
        answer, body_bytes = http.own_answer(error, close, grpc, head_only=self.head.method == "HEAD")
        self.conn.send(answer)
        self.bytes_sent += body_bytes

    def cut(self) -> None:
        """Abandon the response mid-way: the connection is shut at once (the client sees
        it now, not once the application returns), without finishing it."""
        self.started = self.finished = True
        self.close_after = True
        self.conn.cut_now()

    def _must_close(self) -> bool:
        """Whether the connection cannot carry another request after this answer."""
        if not self.head.keep_alive or self.conn.closing:
            return True
        if self.body_done:
            return False
        if self.body_error is not None or (self.head.expect_continue and not self._continue_sent):
            return True
        if self.head.framing is BodyFraming.LENGTH:  # the rest can be discarded if it is small
            assert self.head.content_length is not None
            return self.head.content_length - self.body_bytes > DRAIN_LIMIT
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
        "_held",
        "_tail",
        "_method",
        "_shift",
        "_head_raw",
        "_priming",
        "_upgrade_ended",
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
        #: Parsing paused after the head of a request that may become a tunnel.
        self._upgraded = False
        self._in_head_wait = False  # a timeout now still lets us answer 408
        #: The start of a message whose method token is not whole yet.
        self._held = _NO_BYTES
        #: The last bytes fed (a CRLF CRLF may straddle two feeds).
        self._tail = _NO_BYTES
        #: The method token of the message being parsed, as the client sent it, and how
        #: much longer the bytes fed to llhttp are than those (its stand-in's length).
        self._method = _NO_BYTES
        self._shift = 0
        #: The bytes since the current head began, as they came (``_check_request_line``).
        self._head_raw = _NO_BYTES
        #: A fresh parser is being put into a declined Upgrade request's body.
        self._priming = False
        #: llhttp stopped at the end of the head just parsed (an Upgrade request).
        self._upgrade_ended = False
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
        if self._priming:
            return
        self._current = H1Exchange(self)
        self._url_parts = []
        self._field_bytes = 0
        self._fed_without_data = 0

    def on_url(self, url: bytes) -> None:
        if self._priming:
            return
        parts = self._url_parts
        parts.append(url)
        if (len(parts) > 1 and sum(map(len, parts)) > MAX_TARGET) or len(url) > MAX_TARGET:
            raise RequestLineTooLong(f"request target over {MAX_TARGET} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._priming:
            return
        exchange = self._current
        assert exchange is not None
        self._field_bytes += len(name) + len(value) + 4
        if self._field_bytes > self.max_header_bytes:
            section = "trailer" if exchange.head_done else "header"
            raise HeadersTooLarge(f"{section} section over {self.max_header_bytes} bytes")
        if value[-1:] in heads.TRAILING_WHITESPACE:  # not part of the value (RFC 9110 5.5)
            value = value.rstrip(b" \t")
        if exchange.head_done:  # a trailer of a chunked body
            exchange.trailers = heads.add_line(exchange.trailers, (name, value))
            return
        head = exchange.head
        lower = name.lower()
        head.headers.append((name, value))
        head.lower_names.append(lower)
        if lower in heads.NOTED:
            head.note(lower, value)

    def on_headers_complete(self) -> None:
        if self._priming:
            return
        exchange = self._current
        assert exchange is not None
        parser = self._parser
        parts = self._url_parts
        head = exchange.head
        head.target = target = parts[0] if len(parts) == 1 else b"".join(parts)
        token, self._method = self._method, _NO_BYTES  # a message begun mid-piece has none: refused
        head.method = heads.method_name(token)
        head.version = version = parser.get_http_version()
        head.keep_alive = parser.should_keep_alive()
        try:
            self._check_request_line(token, target, version)
            heads.check_request_head(head, self.max_body_bytes)
        except ActivatorError as error:
            if error.closes_connection:
                raise  # stops the parser: nothing after this head is read as HTTP
            exchange.refusal = error
        self._head_raw = _NO_BYTES  # checked: not kept while the request waits
        self._field_bytes = self._fed_without_data = 0  # trailers, if any, are a section of their own
        exchange.head_done = True
        if head.framing is BodyFraming.NONE:
            exchange.body_done = True
        self._ready.append(exchange)

    def on_body(self, data: bytes) -> None:
        exchange = self._current
        assert exchange is not None
        exchange.body_bytes += len(data)
        self._data_in_feed = True
        maximum = self.max_body_bytes
        if maximum is not None and exchange.body_bytes > maximum:
            raise BodyTooLarge(f"request body over max_body_bytes {maximum}")  # what took it over is dropped
        exchange._body.append(data)

    def on_message_complete(self) -> None:
        if self._priming:
            return
        exchange = self._current
        assert exchange is not None
        exchange.body_done = True
        self._current = None

    def _check_request_line(self, method: bytes, target: bytes, version: str) -> None:
        """The request line as llhttp read it must be in the bytes as they came, exactly.

        llhttp tolerates several spaces between the parts of a request line and a version
        without digits it reads as 0.9; RFC 9112 asks for one SP. A head is in the bytes
        fed since its message began (``_head_raw``), after empty lines at most (RFC 9112
        2.2; llhttp also skips a bare CR there, which is refused here).
        """
        line = b"%s %s HTTP/%s\r\n" % (method, target, version.encode("ascii"))
        raw = self._head_raw
        if raw.startswith(line):  # the usual case: nothing before it
            return
        at = raw.find(line)
        if at < 0 or raw[:at].replace(b"\r\n", b""):
            raise BadRequest("malformed request line")

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
                if self._served_one and self._current is None and not self._held:
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
        """Feed ``data`` to llhttp, cut where a message may end (see the module docstring)."""
        if self._held:
            data = self._held + data
            self._held = _NO_BYTES
        self._data_in_feed = False
        if self._current is None:  # the usual feed: one whole head, a method fed as it came
            method = data[: data.find(b" ")]
            if method in FED_AS_IS and data.find(_HEAD_END) == len(data) - 4:
                self._method = method
                self._shift = 0
                rest = self._feed_piece(data, data)
                if rest is not None:
                    self._after_upgrade_head(rest)  # nothing followed the head: nothing to parse
                self._limit_fields(len(data))  # a body still to come
                return
        fed = 0
        while data and not self._stopped and not self._upgraded:
            current = self._current
            if current is None:  # a message (or empty lines before one) starts here
                parsed = self._start_message(data)
                if parsed is None:
                    self._held = data  # the method token is not whole yet
                    break
                to_llhttp, self._shift = parsed
            else:
                to_llhttp, self._shift = data, 0
            end = self._piece_end(data, current)
            if end < len(data):
                piece, data = data[:end], data[end:]
                to_llhttp = to_llhttp[: end + self._shift]
            else:
                piece, data = data, _NO_BYTES
            fed += len(piece)
            rest = self._feed_piece(piece, to_llhttp)
            if rest is not None:  # llhttp stopped after an Upgrade request's head
                data = rest + data
                data = self._after_upgrade_head(data)
        self._limit_fields(fed)

    def _start_message(self, data: bytes) -> tuple[bytes, int] | None:
        """What llhttp is fed for a message that starts in ``data``, and the shift of its
        stand-in method; None while the method token may still grow."""
        match = _REQUEST_START.match(data)
        if match is None:
            if len(data) <= MAX_TARGET and _PARTIAL_START.match(data) is not None:
                return None
            self._method = _NO_BYTES
            return data, 0  # not a request line llhttp can take: it refuses it
        token = match.group(1)
        self._method = token
        if token in FED_AS_IS:
            return data, 0
        return data[: match.start(1)] + _STAND_IN + data[match.end(1) :], len(_STAND_IN) - len(token)

    def _piece_end(self, data: bytes, current: H1Exchange | None) -> int:
        """Where the piece of ``data`` that may end a message ends: after the first
        CRLF CRLF (a head's end, or a chunked body's), or at the end of a body of known
        length."""
        if current is None:  # a message starts: it cannot end before it began
            at = data.find(_HEAD_END)
            return len(data) if at < 0 else at + 4
        head = current.head
        if current.head_done and head.content_length is not None and not head.transfer_encodings:
            # llhttp reads this body by its length (also that of a refused head)
            return max(1, head.content_length - current.body_bytes)
        tail = self._tail
        at = (tail + data).find(_HEAD_END)
        return len(data) if at < 0 else at + 4 - len(tail)

    def _feed_piece(self, piece: bytes, to_llhttp: bytes) -> bytes | None:
        """Feed one piece; what followed the head of an Upgrade request in it (llhttp
        stopped there), else None."""
        self._tail = piece[-3:]
        if self._current is None or not self._current.head_done:
            self._head_raw += piece
        try:
            self._parser.feed_data(to_llhttp)
        except httptools.HttpParserUpgrade as upgrade:
            self._upgrade_ended = True
            return piece[upgrade.args[0] - self._shift :]
        except httptools.HttpParserError as error:
            self._stopped = True  # llhttp is in an error state: nothing more is parsed
            self._parse_failed(error)
        return None

    def _after_upgrade_head(self, data: bytes) -> bytes:
        """llhttp stopped after an Upgrade request's head; ``data``: what followed it.
        Returns what is still to parse now (see "Upgrade" in the module docstring)."""
        self._upgrade_ended = False
        exchange = self._ready[-1] if self._ready else None
        if exchange is None:  # refused (CONNECT): nothing more is parsed
            self._stopped = True
            return _NO_BYTES
        if exchange.head.upgrade:
            exchange.tunnel_data = data
            self._upgraded = True
            return _NO_BYTES
        if exchange.refusal is not None:
            self._stopped = True  # where its body (if any) ends is not known: close after the answer
            return _NO_BYTES
        if exchange.head.framing is not BodyFraming.NONE:
            self._prime(exchange)
        return data

    def _prime(self, exchange: H1Exchange) -> None:
        """A fresh parser, in the body of ``exchange`` (a declined Upgrade: llhttp skipped it)."""
        head = exchange.head
        chunked = head.framing is BodyFraming.CHUNKED
        primer = _PRIMED_CHUNKED if chunked else _PRIMED_LENGTH % (head.content_length or 0)
        exchange.body_done = False
        self._current = exchange
        self._parser = httptools.HttpRequestParser(self)
        self._priming = True
        try:
            self._parser.feed_data(primer)
        finally:
            self._priming = False

    def _limit_fields(self, fed: int) -> None:
        """The memory backstop: a field line llhttp holds until it ends, or chunk framing
        without data, may not grow past the header limit and one recv more."""
        data_came, self._data_in_feed = self._data_in_feed, False
        current = self._current
        if current is None or self._stopped:
            return
        if data_came:
            self._fed_without_data = 0
            return
        self._fed_without_data += fed
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
            refused_coding = "Transfer-Encoding" in str(error)
            if ours is None and refused_coding and not current.body_bytes and current in self._ready:
                # llhttp refused the head's framing once the head was complete (a
                # Transfer-Encoding it cannot read): a refusal of the head, not of a body.
                self._ready.remove(current)
                self._error = heads.refusal_of_head(str(error))
                return
            # In the body: its framing is broken (or it grew past the limit).
            current.body_error = ours or ClientBodyError(f"request body: {error}")
            return
        if ours is not None:
            self._error = ours
        elif isinstance(error, httptools.HttpParserInvalidURLError):
            self._error = MalformedTarget(str(error))
        else:
            self._error = heads.refusal_of_head(str(error))

    # -- after an answer ------------------------------------------------------------------

    def settle(self, exchange: H1Exchange) -> bool:
        """After ``exchange``'s answer: whether the connection carries another request.

        Discards what is left of its body when that is small enough and intact. An
        Upgrade request its pod declined goes on with what the client sent after it.
        """
        if exchange.close_after or self.cut or self.closing or not exchange.head.keep_alive:
            return False
        if self._upgraded:
            self._upgraded = False
            following, exchange.tunnel_data = exchange.tunnel_data, _NO_BYTES
            if following:
                self._feed(following)
            return True
        drained = 0
        while not exchange.body_done:
            if exchange.body_error is not None or drained > DRAIN_LIMIT:
                return False
            drained += sum(map(len, exchange._body))
            exchange._body.clear()
            if not exchange.body_done:
                self.pump_body(exchange)
        return exchange.body_error is None

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

    @property
    def hung_up(self) -> bool:
        """The hang-up monitor saw the client leave (no syscall)."""
        return self._hung_up

    def cut_now(self) -> None:
        """Abandon the connection now: shut both ways (no lingering close after it)."""
        self.cut = True
        shutdown_keeping_tls(self.sock, socket.SHUT_RDWR)

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

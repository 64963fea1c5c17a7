"""The pod side of the proxy: per-pod keep-alive pools and one streamed HTTP/1.1 exchange.

What this module decides:

Parsing
    Responses are parsed by llhttp through httptools' ``HttpResponseParser``, strict but
    for one leniency: a line may end in a bare LF (the pod is trusted, and HAProxy and
    nginx relay such answers too; a client's request never gets it). A response to HEAD
    is fed to it one head at a time (llhttp would otherwise read the next response's
    bytes as the body its Content-Length announces).
    1xx answers (103 Early Hints, 102 Processing) are collected and handed to the caller's
    ``interim`` callback before the final answer; ``100 Continue`` is ours to give
    (activator answers the client's ``Expect`` itself) and is dropped. Header lines keep
    their order and stay separate. Trailers of a chunked response are kept for the caller.
    A head (or chunk framing and trailers without data) over ``MAX_POD_FIELD_BYTES`` is
    refused.

Sending
    The head and the first piece of the body go out in one write. The rest of the body
    is streamed piece by piece, and before each piece the socket is checked: a pod that
    answers before it has read the whole upload (413, 401, ...) gets nothing more; its
    answer is read and returned with ``early`` set (the connection is never reused then:
    the request was not sent whole). While the client is slow to send, we wait for the
    client or the pod, whichever speaks first.

Pooling
    One ``UpstreamPool`` per pod address. Idle connections are kept in a LIFO stack (the
    most recently used is reused first, so a burst's extra connections age out on the pod
    side), at most ``max_idle`` of them. The pool never limits concurrency: the slots do.

Reuse rules
    A connection goes back to the pool only when the request was sent whole, the response
    was read to its end, llhttp says the connection persists (HTTP/1.1 without
    ``Connection: close``, or 1.0 with keep-alive), the body was framed (not delimited by
    close), and the pod sent nothing after it. Before an idle connection is reused it is
    polled once (no wait): readable (EOF, reset or stray bytes) means the pod closed it.

Delayed ACKs
    Every pod socket has TCP_NODELAY, and ``TCP_QUICKACK`` is re-armed before each read
    that waits for the rest of a response already begun: a pod that writes its head and
    its body in two small writes without TCP_NODELAY (Python's http.server, and others)
    would otherwise wait for our delayed ACK of the head (~40 ms on a kept-alive
    connection) before it sends the body; re-arming it sends that ACK at once. A response
    that arrives whole in one read (the usual small one) needs no such call.

Timeouts (``Timeouts``)
    ``connect`` bounds the TCP connect. ``response_start`` runs from the moment the
    request was sent whole to the response head. ``idle`` bounds every wait for the pod
    mid-body (None: no limit of its own). ``total`` bounds the whole exchange from the
    moment the request head was sent (None: no limit). While the body is being sent, each
    write must be taken by the pod within ``response_start`` (a pod that stops reading).
    Pod sockets have no socket timeout: waits are bounded by deadlines (``deadlines``), so
    that no timer is started per wait. The arithmetic is ``core.timeouts.Timeouts``'.

Retry rule
    A reused idle connection that fails before any response byte (send error, EOF or reset
    while waiting for the head) is retried exactly once on a fresh connection, if the whole
    request is still in hand (no body, or a body that fit in the first write). Failures on
    fresh connections are not retried here; the error carries what the proxy's retry rule
    needs (``UpstreamConnectError.connected`` / ``body_read``, ``core.failures``).
"""

from __future__ import annotations

import ipaddress
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import httptools
from gevent import socket as gsocket
from gevent.monkey import get_original

from ..base import deadlines
from ..base.exchange import BodySource, PodRequest, PodResponse
from ..core.errors import ClientBodyError, UpstreamBadResponse, UpstreamBodyError, UpstreamConnectError, UpstreamTimeout
from ..core.heads import (
    RESPONSE_NOTED,
    TRAILING_WHITESPACE,
    BodyFraming,
    Header,
    ResponseHead,
    add_line,
    response_framing,
)
from ..core.http import header_block
from ..core.timeouts import Timeouts

__all__ = ["FixedBody", "PodConnection", "UpstreamPool"]

#: Size of one recv from the pod and of one read from the request body.
BLOCK_SIZE = 65536
#: The most a pod may send of its response head (1xx heads included), or of chunk
#: framing and trailers without body data, before its answer is refused: 502
#: ``upstream-bad-response`` before the head, a cut stream after it. llhttp (httptools)
#: holds an unfinished header line until it ends; this bounds what one pod costs.
MAX_POD_FIELD_BYTES = 4 * BLOCK_SIZE

_poll = get_original("select", "poll")  # the real poll, only ever with a zero timeout
_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT
_POLL_GONE = select.POLLIN | select.POLLHUP | select.POLLERR
_IPPROTO_TCP = socket.IPPROTO_TCP
_TCP_NODELAY = socket.TCP_NODELAY
_TCP_QUICKACK = getattr(socket, "TCP_QUICKACK", None)
_HEAD_END = b"\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


class FixedBody:
    """A ``BodySource`` of bytes known up front (a probe's request message)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.trailers: list[Header] = []
        self._sent = False

    def read(self, size: int = -1) -> bytes:
        if self._sent:
            return b""
        self._sent = True
        return self.data

    def raise_known_error(self) -> None:
        return None

    def buffered(self) -> bool:
        return True

    def exhausted(self) -> bool:
        return self._sent

    def wait_for_body(self, pod_fd: int, timeout: float) -> bool:
        return True


class _Stale(Exception):
    """A reused connection died before any response byte: retry on a fresh one."""


def _connect_error(
    message: str,
    *,
    connected: bool = True,
    body_read: bool = True,
    cls: type[UpstreamConnectError] = UpstreamConnectError,
) -> UpstreamConnectError:
    return cls(message, connected=connected, body_read=body_read)


def _address_family(host: str) -> int | None:
    """AF_INET / AF_INET6 for an IP address, None for a name."""
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return None


def _timeout_error(message: str) -> UpstreamTimeout:
    return UpstreamTimeout(message)


class UpstreamPool:
    """Keep-alive connections to one pod (``host:port``); see the module docstring."""

    __slots__ = ("_address", "_closed", "_family", "_idle", "host", "max_idle", "port", "where")

    def __init__(self, host: str, port: int, *, max_idle: int = 64) -> None:
        self.host = host
        self.port = port
        self.max_idle = max_idle
        self.where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        # Invariant: every connection in _idle finished its last exchange completely and
        # is reusable; len(_idle) <= max_idle; _idle is empty once _closed.
        self._idle: list[PodConnection] = []
        self._closed = False
        self._address = (host, port)
        self._family = _address_family(host)

    def __repr__(self) -> str:
        return f"<UpstreamPool {self.where} idle={len(self._idle)}{' closed' if self._closed else ''}>"

    @property
    def idle_count(self) -> int:
        return len(self._idle)

    def close(self) -> None:
        """Close the idle connections; later requests still work but are not pooled."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.abort()

    def _connect(self, timeout: float) -> PodConnection:
        try:
            if self._family is None:  # a name: resolved at each connect (in gevent's resolver)
                sock = gsocket.create_connection(self._address, timeout=timeout)
            else:  # an address: no resolver round trip (a thread hop in gevent)
                sock = gsocket.socket(self._family, socket.SOCK_STREAM)
                try:
                    sock.settimeout(timeout)
                    sock.connect(self._address)
                except BaseException:
                    sock.close()
                    raise
            sock.setsockopt(_IPPROTO_TCP, _TCP_NODELAY, 1)
            sock.settimeout(None)  # from now on, deadlines (see ``deadlines``)
        except OSError as error:  # refused, unreachable, timeout, name resolution
            raise _connect_error(
                f"connect to {self.where} failed: {error!r}", connected=False, body_read=False
            ) from error
        return PodConnection(self, sock)

    def give_back(self, conn: PodConnection) -> None:
        """Take back a connection whose exchange ended cleanly and that may be reused."""
        if self._closed or len(self._idle) >= self.max_idle:
            conn.abort()
        else:
            self._idle.append(conn)

    def _take(self) -> PodConnection | None:
        """The most recently used idle connection that still looks alive, or None.

        Each is polled first (no wait): EOF, a reset or stray bytes mean the pod closed it
        or broke its framing; it is closed and the next one tried.
        """
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.readable_or_closed():
                return conn
            conn.abort()
        return None

    def request(self, request: PodRequest, timeouts: Timeouts) -> PodConnection:
        """Send one request; return once the final response head (or an early answer) came.

        This adds the framing line to ``request.headers``. The connection returned carries
        the response: read it, then ``close()`` it.
        """
        conn = self._take()
        reused = conn is not None
        if conn is None:
            conn = self._connect(timeouts.connect)
        conn.begin(request, timeouts)
        try:
            payload = conn.first_write(request.target, header_block(request.headers))
        except BaseException:
            conn.abort()
            raise
        if reused:
            try:
                conn.run(payload, reused=True)
                return conn
            except _Stale:
                if not conn.replayable:
                    raise _connect_error(f"{self.where} closed a kept-alive connection mid-request") from None
                try:
                    fresh = self._connect(timeouts.connect)
                except UpstreamConnectError as error:
                    error.body_read = request.framing is not BodyFraming.NONE  # the first write took it
                    raise
                fresh.begin(request, timeouts)
                fresh.replayable = conn.replayable
                conn = fresh
        conn.run(payload, reused=False)
        return conn


class PodConnection(PodResponse):
    """One keep-alive connection to a pod, and the exchange it carries now.

    Between ``UpstreamPool.request`` and ``close()`` it is the response (an
    ``exchange.PodResponse``: its ``head`` holds every line as the pod sent it; the
    caller filters hop-by-hop ones with ``core.http``). The llhttp parser lives as long
    as the connection (llhttp starts over after each message).
    """

    __slots__ = (
        "pool",
        "fd",
        "received",
        "replayable",
        "_parser",
        "_method",
        "_head_only",
        "_body",
        "_framing_out",
        "_length_out",
        "_timeouts",
        "_interim",
        "_remaining",
        "_sent_at",
        "_reason_parts",
        "_interims",
        "_pending",
        "_keep_alive",
        "_extra",
        "_head_buffer",
        "_fed_without_data",
        "_other_coding",
        "_total_deadline",
        "_open",
        "_gone_poll",
    )

    def __init__(self, pool: UpstreamPool, sock: Any) -> None:
        super().__init__(sock)
        self.pool = pool
        self.fd = sock.fileno()
        # Asked before each reuse: made once, for the connection's life.
        self._gone_poll = _poll()
        self._gone_poll.register(self.fd, _POLL_GONE)
        self._parser: httptools.HttpResponseParser | None = None
        self._open = True
        deadlines.sweeper().add(self)

    def __repr__(self) -> str:
        return f"<PodConnection {self.pool.where} {self.head.status} {self.framing.value}>"

    def begin(self, request: PodRequest, timeouts: Timeouts) -> None:
        """Start a new exchange on this connection."""
        if self._parser is None:
            self._parser = httptools.HttpResponseParser(self)
            self._parser.set_dangerous_leniencies(lenient_optional_cr_before_lf=True)
        method = self._method = request.method
        self._head_only = method == "HEAD"
        self._body = request.body
        self._framing_out = request.framing
        self._length_out = request.content_length
        self._timeouts = timeouts
        self._interim = request.interim
        self._remaining = 0
        self._sent_at = 0.0
        self.replayable = True
        self.head = ResponseHead()
        self.trailers = ()
        self.framing = BodyFraming.NONE
        self.early = False
        self.upgraded = False
        self.tunnel_data = b""
        self.head_done = False
        self.complete = False
        self.received = False
        self._reason_parts: list[bytes] | tuple[()] = ()  # llhttp may cut the phrase at each recv
        self._interims: list[tuple[int, bytes, list[Header]]] | tuple[()] = ()
        self._pending: list[bytes] = []
        self._keep_alive = False
        self._extra = False
        self._head_buffer = b""
        self._fed_without_data = 0  # bytes fed before the head was done, or since body data came
        self._total_deadline: float | None = None
        self._other_coding = False

    def readable_or_closed(self) -> bool:
        """Whether the pod sent something (or closed) on this connection. Does not wait."""
        return bool(self._gone_poll.poll(0))

    # -- sending ------------------------------------------------------------------------------

    def first_write(self, target: bytes, lines: bytes) -> bytes:
        """The head (``lines``: its header lines) and the first piece of the body, as one payload."""
        framing = self._framing_out
        head = b"%s %s HTTP/1.1\r\n%s" % (self._method.encode("ascii"), target, lines)
        body = self._body
        if framing is BodyFraming.NONE or body is None:
            return head + b"\r\n"
        if framing is BodyFraming.LENGTH:
            length = self._length_out
            assert length is not None
            first = body.read(min(BLOCK_SIZE, length)) if length else b""
            self._remaining = length - len(first)
            self.replayable = self._remaining == 0
            return b"%sContent-Length: %d\r\n\r\n%s" % (head, length, first)
        first = body.read(BLOCK_SIZE)
        body.raise_known_error()
        head += b"Transfer-Encoding: chunked\r\n\r\n"
        if not first:
            return head + _last_chunk(body)
        self._remaining = -1  # chunked: more to come
        self.replayable = False
        return b"%s%x\r\n%s\r\n" % (head, len(first), first)

    def run(self, payload: bytes, reused: bool) -> None:
        """Send the request, read until the final head. Closes the connection on failure."""
        sock = self.sock
        try:
            self._sent_at = now = time.monotonic()
            try:
                sent = sock.send(payload)
                if sent < len(payload):
                    self.deadline = now + self._timeouts.response_start
                    sock.sendall(memoryview(payload)[sent:])
            except OSError as error:
                if self.timed_out:
                    raise _timeout_error(
                        f"{self.pool.where} did not take the request within {self._timeouts.response_start}s"
                    ) from error
                if reused:
                    raise _Stale() from error
                raise self._failed(f"{self.pool.where} failed while the request was sent: {error!r}") from error
            finally:
                self.deadline = 0.0
            if self._remaining and self._send_rest():  # the pod answered first
                self.early = True
            if not self.head_done:
                self.deadline = self._head_deadline()
                try:
                    if not self.received:
                        # A pod has not answered a request sent this instant: wait until it
                        # does, rather than try a recv bound to fail (a syscall and an
                        # exception per request). A deadline ends the wait too (EOF).
                        gsocket.wait_read(self.fd)
                    while not self.head_done:
                        self._receive_head(reused)
                finally:
                    self.deadline = 0.0
        except BaseException:
            self.abort()
            raise
        self._total_deadline = self._timeouts.total_deadline(self._sent_at)

    def _head_deadline(self) -> float:
        """When the response head is due: ``response_start`` from now, within ``total``."""
        timeouts = self._timeouts
        return timeouts.head_deadline(time.monotonic(), timeouts.total_deadline(self._sent_at))

    def _send_rest(self) -> bool:
        """Stream the rest of the body. True if the pod sent a final answer before the end."""
        body = self._body
        assert body is not None
        chunked = self._remaining < 0
        while self._remaining:
            if self._pod_spoke():
                return True
            if not body.buffered() and body.wait_for_body(self.fd, self._timeouts.client):
                continue  # the pod spoke (a final answer, or a 1xx): look at it first
            piece = body.read(BLOCK_SIZE if chunked else min(BLOCK_SIZE, self._remaining))
            if chunked:
                if piece:
                    self._send_piece(b"%x\r\n%s\r\n" % (len(piece), piece))
                else:
                    self._send_piece(_last_chunk(body))
                    self._remaining = 0
            else:
                if not piece:
                    raise ClientBodyError("the request body ended before its Content-Length")
                self._remaining -= len(piece)
                self._send_piece(piece)
            if self.head_done:
                return True
        return False

    def _pod_spoke(self) -> bool:
        """Read what the pod sent while the body streams; True once a final head is in."""
        if not self.readable_or_closed():
            return False
        self.deadline = self._head_deadline()
        try:
            self._receive_head(reused=False)
        finally:
            self.deadline = 0.0
        return self.head_done

    def _send_piece(self, data: bytes) -> None:
        """Send all of ``data``, reading what the pod says meanwhile; stops early only when
        the pod gave its final answer (``head_done``) or closed."""
        sock = self.sock
        fd = self.fd
        view = memoryview(data)
        timeout = self._timeouts.response_start
        while view:
            poller = _poll()
            poller.register(fd, _POLLOUT | _POLL_GONE)
            events = dict(poller.poll(0)).get(fd, 0)
            if events & _POLL_GONE:
                if self._pod_spoke():
                    return  # the final answer: the rest of the body is not wanted
                continue  # a 1xx: go on sending
            if not events & _POLLOUT:
                try:
                    gsocket.wait_readwrite(fd, timeout=timeout, timeout_exc=TimeoutError())
                except TimeoutError:
                    raise _timeout_error(f"{self.pool.where} did not take the request body within {timeout}s") from None
                continue
            try:
                view = view[sock.send(view) :]
            except OSError as error:
                if self._pod_spoke():
                    return
                raise _connect_error(
                    f"{self.pool.where} failed while the request body was sent: {error!r}", body_read=True
                ) from error

    def _failed(self, message: str, cls: type[UpstreamConnectError] = UpstreamConnectError) -> UpstreamConnectError:
        """What ends an exchange before its response head; ``body_read``: whether some of the
        client's body went into the request (a bodiless one read none)."""
        body_read = self._body is not None and self._framing_out is not BodyFraming.NONE
        return cls(message, connected=True, body_read=body_read)

    # -- reading the head ----------------------------------------------------------------------

    def _receive_head(self, reused: bool) -> None:
        """One recv toward the head (under the deadline set by the caller), fed to the parser."""
        sock = self.sock
        where = self.pool.where
        if self.received:  # the rest of a head that came in pieces (see "Delayed ACKs")
            _quickack(sock)
        try:
            data = sock.recv(BLOCK_SIZE)
        except OSError as error:
            if self.timed_out:
                raise _timeout_error(
                    f"{where} sent no response head within {self._timeouts.response_start}s"
                ) from error
            if reused and not self.received:
                raise _Stale() from error
            raise self._failed(f"{where} failed before a response head: {error!r}") from error
        if not data:
            if self.timed_out:
                raise _timeout_error(f"{where} sent no response head within {self._timeouts.response_start}s")
            if reused and not self.received:
                raise _Stale()
            raise self._failed(f"{where} closed the connection before a complete response head")
        try:
            self._feed_head(data)
        except httptools.HttpParserError as error:
            if not self.complete:
                raise self._failed(f"{where} sent a malformed response head: {error}", UpstreamBadResponse) from error
            self._extra = True  # garbage after a complete answer: answer it, never reuse
        interims = self._interims
        if interims:
            self._interims = ()
            interim = self._interim
            for status, reason, headers in interims:
                if interim is not None and status != 100:
                    interim(status, reason, headers)

    def _feed_head(self, data: bytes) -> None:
        """Feed bytes that came before (or with) the final head."""
        self.received = True
        if self._head_only:
            # One head at a time: what follows the final head of a HEAD answer is not its body.
            buffer = self._head_buffer + data
            while not self.head_done:
                end = buffer.find(_HEAD_END)
                if end < 0:
                    break
                self._feed(buffer[: end + 4])
                buffer = buffer[end + 4 :]
            self._head_buffer = buffer
            if self.head_done:
                self._parser = None  # it expects the body the head announced: start over next time
                if buffer:
                    self._extra = True
                return
            waiting = len(buffer)
        else:
            self._feed(data)
            if self.head_done:
                return
            self._fed_without_data += len(data)
            waiting = self._fed_without_data
        if waiting > MAX_POD_FIELD_BYTES:
            raise httptools.HttpParserError(f"response head over {MAX_POD_FIELD_BYTES} bytes")

    def _feed(self, data: bytes) -> None:
        parser = self._parser
        assert parser is not None
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self.upgraded = True
            self.tunnel_data = data[upgrade.args[0] :]

    # -- llhttp callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            self._extra = True

    def on_status(self, reason: bytes) -> None:
        self._reason_parts = add_line(self._reason_parts, reason)

    def on_header(self, name: bytes, value: bytes) -> None:
        if value[-1:] in TRAILING_WHITESPACE:  # not part of the value (RFC 9110 5.5)
            value = value.rstrip(b" \t")
        if self.head_done:
            if self.complete:  # a message after this response: not ours
                self._extra = True
            else:
                self.trailers = add_line(self.trailers, (name, value))
            return
        lower = name.lower()
        head = self.head
        head.headers.append((name, value))
        head.lower_names.append(lower)
        if lower in RESPONSE_NOTED:
            head.note(lower, value)
            if lower == b"transfer-encoding":
                self._other_coding = not head.chunked  # refused in on_headers_complete

    def on_headers_complete(self) -> None:
        if self.head_done:
            self._extra = True
            return
        parser = self._parser
        assert parser is not None
        status = parser.get_status_code()
        parts = self._reason_parts
        reason = parts[0] if len(parts) == 1 else b"".join(parts)
        self._reason_parts = ()
        head = self.head
        if status < 200 and status != 101:
            self._interims = add_line(self._interims, (status, reason, head.headers))
            self.head = ResponseHead()
            return
        if self._other_coding:
            raise httptools.HttpParserError("a Transfer-Encoding other than chunked")
        head.status = status
        head.reason = reason
        self.head_done = True
        self._fed_without_data = 0
        self._keep_alive = parser.should_keep_alive()
        self.framing = framing = response_framing(self._method, head, http2=False)
        if framing is BodyFraming.NONE:
            self.complete = True

    def on_body(self, data: bytes) -> None:
        if self.complete:  # the body of a message after this response: not ours
            self._extra = True
        else:
            self._pending.append(data)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = True

    # -- the body -----------------------------------------------------------------------------

    def take_body(self) -> bytes:
        """The body bytes already here (all of it when ``complete``), without waiting."""
        pending = self._pending
        if not pending:
            return b""
        data = b"".join(pending) if len(pending) > 1 else pending[0]
        pending.clear()
        return data

    def body(self) -> Iterator[bytes]:
        """Yield the body as it arrives (each piece is what one recv brought).

        Raises ``UpstreamBodyError`` (reset, early EOF, bad chunking), ``UpstreamIdle`` or
        ``UpstreamBodyTimeout``. Iterate it at most once.
        """
        pending = self._pending
        if pending:
            data = b"".join(pending) if len(pending) > 1 else pending[0]
            pending.clear()
            yield data
        sock = self.sock
        while not self.complete:
            self._arm_body_deadline()
            _quickack(sock)
            try:
                data = sock.recv(BLOCK_SIZE)
            except OSError as error:
                raise self._cut(error) from error
            finally:
                self.deadline = 0.0
            if not data:
                if self.timed_out:
                    raise self._cut(TimeoutError("deadline"))
                if self.framing is BodyFraming.CLOSE:
                    self.complete = True
                    return
                raise self._cut(EOFError("the pod closed the connection before the body ended"))
            self._feed_body(data)
            if pending:
                self._fed_without_data = 0
                data = b"".join(pending) if len(pending) > 1 else pending[0]
                pending.clear()
                yield data
            elif not self.complete:
                self._fed_without_data += len(data)
                if self._fed_without_data > MAX_POD_FIELD_BYTES:
                    raise self._cut(ValueError(f"over {MAX_POD_FIELD_BYTES} bytes of chunk framing or trailers"))

    def _feed_body(self, data: bytes) -> None:
        """Feed body bytes to the parser (its callbacks fill ``_pending``, set ``complete``)."""
        try:
            self._feed(data)
        except httptools.HttpParserError as error:
            if not self.complete:
                raise self._cut(error) from error
            self._extra = True  # garbage after a complete body: not reusable

    def _arm_body_deadline(self) -> None:
        deadline = self._timeouts.body_deadline(time.monotonic(), self._total_deadline)
        if deadline is None:
            self.timed_out = True
            raise self._cut(TimeoutError("the exchange's total time is over"))
        self.deadline = deadline

    def _cut(self, cause: BaseException) -> UpstreamBodyError:
        timed_out = self.timed_out
        self.abort()
        if timed_out:
            return self._timeouts.body_timeout(time.monotonic(), self._total_deadline, deadlines.TICK)
        return UpstreamBodyError(f"the response body broke off: {cause!r}")

    def reusable(self) -> bool:
        return (
            self.complete
            and self._keep_alive
            and not self._extra
            and not self.early
            and not self.upgraded
            and self.framing is not BodyFraming.CLOSE
            and not self.timed_out
            and self._open
        )

    def close(self) -> None:
        """End the exchange: pooled if the response was read to its end and the connection
        may be reused, else closed. Idempotent."""
        if not self._open:
            return
        if self.reusable():
            self._body = None
            self._interim = None
            self.pool.give_back(self)
        else:
            self.abort()

    def abort(self) -> None:
        """Close the pod connection now, whatever was read. Idempotent."""
        if self._open:
            self._open = False
            deadlines.sweeper().discard(self)
            self.sock.close()

    def detach(self) -> Any:
        """Take the socket (a 101 answer: it becomes a tunnel); this connection is done."""
        self._open = False
        deadlines.sweeper().discard(self)
        return self.sock


def _quickack(sock: Any) -> None:
    if _TCP_QUICKACK is not None:
        try:
            sock.setsockopt(_IPPROTO_TCP, _TCP_QUICKACK, 1)
        except OSError:
            pass


def _last_chunk(body: BodySource) -> bytes:
    trailers = body.trailers
    if not trailers:
        return _LAST_CHUNK
    return b"0\r\n%s\r\n" % b"".join(b"%s: %s\r\n" % (name, value) for name, value in trailers)

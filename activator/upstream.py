"""Upstream side of the proxy: per-pod keep-alive pools and one streamed HTTP/1.1 exchange.

What this module decides:

Implementation
    Our own small HTTP/1.1 client on gevent sockets. Response heads (and chunked or
    read-until-close bodies) are parsed by geventhttpclient's C ``HTTPResponseParser``
    (llhttp); Content-Length bodies bypass the parser and are ``recv``'d straight to the
    caller. It was chosen over ``geventhttpclient.HTTPClient`` by measurement
    (``bench/upstream_micro.py``): it streams without buffering (ghc's ``read(n)`` waits
    for n bytes), never retries a streamed body behind our back, sets TCP_NODELAY and
    sends Content-Length for file-like bodies, and does less work per request.

Pooling
    One ``UpstreamPool`` per pod address. Idle connections are kept in a LIFO stack (the
    most recently used connection is reused first, so a burst's extra connections age
    out on the pod side), at most ``max_idle`` of them; extra ones are closed. The pool
    never limits concurrency: the activator's slots do. ``close()`` closes the idle
    connections; requests after it still work, but their connections are closed instead
    of being pooled.

Reuse rules
    A connection goes back to the pool only when the response was read to its end, the
    response was HTTP/1.1 without ``Connection: close`` (or HTTP/1.0 with keep-alive),
    its length was framed (Content-Length, chunked, or no body: HEAD, 1xx, 204, 304),
    and the pod sent nothing after it. Everything else (a body not fully read, an error,
    a read-until-close body, trailing bytes) closes the socket. Before an idle
    connection is reused it is polled once (no wait): readable (EOF, reset or stray
    bytes) means the pod has closed it, so it is dropped and the next one is tried.

Timeouts
    ``connect_timeout`` bounds the TCP connect. ``request_timeout`` is one deadline for
    the whole response: it starts when the last request byte was handed to the pod, and
    both the response head and the complete body must arrive before it. A head that
    misses it raises ``UpstreamTimeout`` (504); a body that misses it makes ``chunks()``
    raise ``UpstreamBodyTimeout`` (the head is already out, the proxy can only cut the
    client connection). While the request body is being sent, each write must be taken
    by the pod within ``request_timeout`` (a pod that stops reading -> ``UpstreamTimeout``);
    time spent waiting for a slow *client* to upload is not charged to the pod.

Retry rule
    A reused idle connection that fails before any response byte (send error, EOF or
    reset while waiting for the head) is retried exactly once on a fresh connection, if
    everything taken from the request body so far is still in hand. The head and the
    first body piece (<= 64 KiB) go out in one write and are kept until it is done, so
    this covers: no body, a body that fit in that first piece, or a failure during the
    first write (the rest of the body is then still unread). Once a second piece has
    been read, the body is being streamed and is never replayed: a failure then is an
    error. Failures on fresh connections are not retried here; instead
    ``UpstreamConnectError.retriable`` tells the proxy whether it may retry on another
    pod: True only when the connection could not be established (refused, unreachable,
    connect timeout) and nothing was read from the request body yet.

Errors
    ``UpstreamConnectError`` (502; ``retriable`` is always set on the instance),
    ``UpstreamBadResponse`` (502, a malformed response head), ``UpstreamTimeout`` (504),
    ``RequestBodyError`` (the client's body failed or was short; the pod connection is
    closed), and from ``chunks()``: ``UpstreamBodyError`` / ``UpstreamBodyTimeout``.

Caller contract
    ``headers`` are end-to-end headers only (no hop-by-hop, no Content-Length or
    Transfer-Encoding) and include the Host header to send; names and values come from a
    parsed request, so they hold no CR/LF. This module adds the framing header. A
    response's ``headers`` have hop-by-hop headers, the headers named in ``Connection``,
    and Content-Length removed; the length is in ``content_length`` (for HEAD, 204 and
    304 it is the declared length, while the body itself is empty). Always call
    ``UpstreamResponse.close()`` (e.g. from the WSGI iterable's ``close``).
"""

from __future__ import annotations

import ipaddress
import select as _select_mod
from collections.abc import Iterator
from time import monotonic

from gevent import socket as _gsocket
from gevent.monkey import get_original
from geventhttpclient._parser import HTTPParseError, HTTPResponseParser

from activator.core.errors import ActivatorError, UpstreamConnectError, UpstreamTimeout
from activator.sockets import send_all

__all__ = [
    "RequestBodyError",
    "UpstreamBadResponse",
    "UpstreamBodyError",
    "UpstreamBodyTimeout",
    "UpstreamPool",
    "UpstreamResponse",
]

#: Size of one recv from the pod and of one read from the request body.
BLOCK_SIZE = 65536

_IPPROTO_TCP = _gsocket.IPPROTO_TCP
_TCP_NODELAY = _gsocket.TCP_NODELAY
_SOCK_STREAM = _gsocket.SOCK_STREAM
_GSocket = _gsocket.socket
# The real poll (gevent's monkey-patching removes select.poll); used only with a zero
# timeout, so it never blocks the hub.
_poll = get_original("select", "poll")
_POLLIN = _select_mod.POLLIN

# Response headers that are never passed on (RFC 9110 7.6.1), plus the framing ones,
# which the proxy re-derives from ``content_length``.
_HOP_BY_HOP = frozenset(
    (
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
    )
)

# Body framing of a response.
_F_NONE = 0  # no body (HEAD, 1xx, 204, 304, or a zero Content-Length)
_F_LENGTH = 1  # Content-Length: bypasses the parser
_F_PARSER = 2  # chunked or read-until-close: fed through the parser


class UpstreamBadResponse(UpstreamConnectError):
    """The pod answered with something that is not an HTTP/1.x response head."""

    status = 502
    reason = "upstream-bad-response"


class UpstreamBodyError(Exception):
    """The response body broke off (reset, EOF, bad chunking) after its head was read.

    Not an ``ActivatorError``: the head has been passed on already, so the only answer
    left is to cut the client's connection.
    """

    timed_out = False


class UpstreamBodyTimeout(UpstreamBodyError):
    """The response body did not finish within ``request_timeout``."""

    timed_out = True


class RequestBodyError(ActivatorError):
    """Reading the client's request body failed, or it ended before its Content-Length."""

    status = 400
    reason = "client-body"


def _connect_error(msg: str, retriable: bool, cls: type = UpstreamConnectError) -> UpstreamConnectError:
    err = cls(msg)
    err.retriable = retriable
    return err


class _Stale(Exception):
    """Internal: a reused connection died before the response; retry on a fresh one."""


def _is_idle_alive(sock) -> bool:
    """True if an idle pooled connection shows no sign of being closed (no wait)."""
    p = _poll()
    try:
        p.register(sock, _POLLIN)
    except (OSError, ValueError):
        return False
    # Any event on an idle keep-alive connection (EOF, reset, stray bytes) means unusable.
    return not p.poll(0)


class UpstreamPool:
    """Keep-alive connections to one pod (``host:port``); see the module docstring."""

    __slots__ = ("host", "port", "max_idle", "_idle", "_closed", "_family", "_addr", "_where")

    def __init__(self, host: str, port: int, *, max_idle: int = 64) -> None:
        self.host = host
        self.port = port
        self.max_idle = max_idle
        # Invariant: every socket in _idle finished its last response completely and is
        # reusable; len(_idle) <= max_idle; _idle is empty once _closed.
        self._idle: list = []
        self._closed = False
        self._where = f"{host}:{port}"
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            self._family = None  # a name: resolve on every connect
            self._addr = (host, port)
        else:
            self._family = _gsocket.AF_INET6 if ip.version == 6 else _gsocket.AF_INET
            self._addr = (str(ip), port)

    def __repr__(self) -> str:
        return f"<UpstreamPool {self.host}:{self.port} idle={len(self._idle)}{' closed' if self._closed else ''}>"

    @property
    def idle_count(self) -> int:
        return len(self._idle)

    def close(self) -> None:
        """Close the idle connections; later requests still work but are not pooled."""
        self._closed = True
        idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    # -- connections -------------------------------------------------------------------

    def _connect(self, connect_timeout: float):
        try:
            if self._family is None:
                sock = _gsocket.create_connection(self._addr, timeout=connect_timeout)
            else:
                sock = _GSocket(self._family, _SOCK_STREAM)
                try:
                    sock.settimeout(connect_timeout)
                    sock.connect(self._addr)
                except BaseException:
                    sock.close()
                    raise
            sock.setsockopt(_IPPROTO_TCP, _TCP_NODELAY, 1)
        except OSError as e:  # refused, unreachable, timeout (TimeoutError), DNS
            raise _connect_error(f"connect to {self.host}:{self.port} failed: {e!r}", True) from e
        return sock

    def _release(self, sock) -> None:
        """Take back a connection whose response ended cleanly and is reusable."""
        idle = self._idle
        if self._closed or len(idle) >= self.max_idle:
            sock.close()
        else:
            idle.append(sock)

    # -- one exchange --------------------------------------------------------------------

    def request(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body,
        body_length: int | None,
        *,
        connect_timeout: float,
        request_timeout: float,
    ) -> UpstreamResponse:
        """Send one request and return once the response head has arrived.

        ``body`` is None or has ``read(n)``; with ``body_length`` it is sent with
        Content-Length, without it chunked. The body is streamed in 64 KiB pieces.
        """
        # Pick a connection first, so a failed connect has consumed nothing of the body.
        sock = None
        reused = False
        idle = self._idle
        while idle:
            sock = idle.pop()
            if _is_idle_alive(sock):
                reused = True
                break
            sock.close()
            sock = None
        if sock is None:
            sock = self._connect(connect_timeout)

        # Head and first piece of the body, sent in one write.
        hdrs = "\r\n".join(map(": ".join, headers))
        if hdrs:
            hdrs += "\r\n"
        more = False  # body bytes remain to be streamed after the first write
        chunked = False
        remaining = 0
        try:
            if body is None or body_length == 0:
                if body_length is None:
                    framing = ""
                elif body_length == 0:
                    framing = "Content-Length: 0\r\n"
                else:
                    raise ValueError("body_length > 0 without a body")
                payload = f"{method} {target} HTTP/1.1\r\n{hdrs}{framing}\r\n".encode("latin-1")
            elif body_length is not None:
                first = _read_body(body, BLOCK_SIZE if body_length > BLOCK_SIZE else body_length)
                if not first:
                    raise RequestBodyError("request body ended before Content-Length")
                remaining = body_length - len(first)
                more = remaining > 0
                payload = (
                    f"{method} {target} HTTP/1.1\r\n{hdrs}Content-Length: {body_length}\r\n\r\n".encode("latin-1")
                    + first
                )
            else:
                chunked = True
                first = _read_body(body, BLOCK_SIZE)
                payload = f"{method} {target} HTTP/1.1\r\n{hdrs}Transfer-Encoding: chunked\r\n\r\n".encode("latin-1")
                if first:
                    payload = b"%s%x\r\n%s\r\n" % (payload, len(first), first)
                    more = True
                else:
                    payload += b"0\r\n\r\n"
        except BaseException:
            sock.close()
            raise

        if reused:
            try:
                return self._exchange(sock, method, payload, body, more, chunked, remaining, request_timeout, True)
            except _Stale:
                # The whole request is in ``payload``; replay it once on a fresh connection.
                try:
                    sock = self._connect(connect_timeout)
                except UpstreamConnectError as e:
                    e.retriable = body is None or body_length == 0
                    raise
        return self._exchange(sock, method, payload, body, more, chunked, remaining, request_timeout, False)

    def _exchange(self, sock, method, payload, body, more, chunked, remaining, request_timeout, reused):
        """Write the request, read the head. Closes ``sock`` on any failure."""
        where = self._where
        try:
            sock.settimeout(request_timeout)
            try:
                send_all(sock, payload)
            except TimeoutError as e:
                raise UpstreamTimeout(f"{where} did not take the request within {request_timeout}s") from e
            except OSError as e:
                if reused:
                    raise _Stale() from e
                raise _connect_error(f"{where} failed while sending: {e!r}", False) from e

            if more:
                reused = False  # a streamed body cannot be replayed
                _send_rest(sock, body, chunked, remaining, where, request_timeout)

            deadline = monotonic() + request_timeout
            resp = None
            while True:
                try:
                    data = sock.recv(BLOCK_SIZE)
                except TimeoutError as e:
                    raise UpstreamTimeout(f"{where} sent no response head within {request_timeout}s") from e
                except OSError as e:
                    if reused and resp is None:
                        raise _Stale() from e
                    raise _connect_error(f"{where} failed before a response head: {e!r}", False) from e
                if not data:
                    if reused and resp is None:
                        raise _Stale()
                    raise _connect_error(f"{where} closed the connection before a complete response head", False)
                if resp is None:
                    # The usual case: the whole head of a final (non-1xx) response in one recv.
                    resp = UpstreamResponse(b"\r\n\r\n" in data and data[9:10] != b"1")
                    resp._method_head = method == "HEAD"
                try:
                    resp.feed(data)
                except (HTTPParseError, ValueError) as e:
                    if not resp._head_done:
                        raise _connect_error(
                            f"{where} sent a malformed response head: {e!r}", False, UpstreamBadResponse
                        ) from e
                    # A complete head followed by garbage: fail when the body is read.
                    resp._failed = e
                if resp._head_done:
                    break
                left = deadline - monotonic()
                if left <= 0:
                    raise UpstreamTimeout(f"{where} sent no response head within {request_timeout}s")
                sock.settimeout(left)
        except BaseException:
            sock.close()
            raise

        resp._deadline = deadline
        # Held even when the response is already complete: the caller decides, with
        # close() (pool it) or abort() (the client left: drop it).
        resp._sock = sock
        resp._pool = self
        return resp


def _read_body(body, n: int) -> bytes:
    try:
        return body.read(n)
    except ActivatorError:
        raise  # the handler's own verdict on the body (e.g. 413 body-too-large)
    except Exception as e:
        raise RequestBodyError(f"reading the request body failed: {e!r}") from e


def _send_rest(sock, body, chunked: bool, remaining: int, where: str, request_timeout: float) -> None:
    """Stream the rest of the request body. ``sock`` has timeout ``request_timeout``."""
    try:
        if chunked:
            while True:
                piece = _read_body(body, BLOCK_SIZE)
                if not piece:
                    send_all(sock, b"0\r\n\r\n")
                    return
                send_all(sock, b"%x\r\n%s\r\n" % (len(piece), piece))
        while remaining > 0:
            piece = _read_body(body, BLOCK_SIZE if remaining > BLOCK_SIZE else remaining)
            if not piece:
                raise RequestBodyError("request body ended before Content-Length")
            remaining -= len(piece)
            send_all(sock, piece)
    except TimeoutError as e:
        raise UpstreamTimeout(f"{where} did not take the request body within {request_timeout}s") from e
    except OSError as e:
        raise _connect_error(f"{where} failed while the request body was sent: {e!r}", False) from e


class UpstreamResponse(HTTPResponseParser):
    """One pod response: the head is parsed, the body is read by ``chunks()``.

    Public: ``status``, ``reason``, ``headers`` (hop-by-hop and Content-Length removed),
    ``content_length`` (None when chunked or read-until-close).
    """

    __slots__ = (
        "status",
        "reason",
        "headers",
        "content_length",
        # llhttp looks the callbacks up on the instance: the data callbacks are bound
        # list.append methods (no Python frame per header), see __init__.
        "_on_status",
        "_on_header_field",
        "_on_header_value",
        "_on_body",
        "_raw",
        "_last",
        "_pending",
        "_method_head",
        "_head_done",
        "_complete",
        "_interim",
        "_framing",
        "_keep_alive",
        "_extra",
        "_failed",
        "_sock",
        "_pool",
        "_deadline",
    )

    def __init__(self, whole_head: bool) -> None:
        """``whole_head``: the first feed holds the complete head of a final response.

        Then every span (status, each name, each value) arrives in exactly one callback,
        in order, so a bare ``list.append`` collects them. Otherwise spans can be split
        at feed boundaries and the slow callbacks glue the pieces back together.
        """
        super().__init__()
        self._raw = raw = []  # [reason?, name, value, name, value, ...]
        self._pending = pending = []  # body pieces from the last feed
        self._on_body = pending.append
        if whole_head:
            self._on_status = self._on_header_field = self._on_header_value = raw.append
        else:
            self._last = 0
            self._on_status = self._span_status
            self._on_header_field = self._span_field
            self._on_header_value = self._span_value
        self.status = 0
        self.reason = ""
        self.content_length = None
        self._head_done = False
        self._complete = False
        self._interim = False
        self._extra = False
        self._failed = None
        self._sock = None

    def __repr__(self) -> str:
        return f"<UpstreamResponse {self.status} {self.reason!r} length={self.content_length}>"

    # -- parser callbacks (called from feed()) ---------------------------------------------

    def _span(self, kind: int, s: str) -> None:
        if self._last == kind:
            self._raw[-1] += s  # the rest of a span split by a feed boundary
        else:
            self._raw.append(s)
            self._last = kind

    def _span_status(self, s: str) -> None:
        self._span(1, s)

    def _span_field(self, s: str) -> None:
        self._span(2, s)

    def _span_value(self, s: str) -> None:
        self._span(3, s)

    def _on_message_begin(self) -> None:
        if self._complete:
            self._extra = True  # the pod sent more than one response

    def _on_headers_complete(self):
        if self._head_done:
            self._extra = True
            return True  # a second response after ours: ignore it, and its body
        code = self.get_code()
        raw = self._raw
        if code < 200:
            # An interim response (100 Continue, 103 Early Hints): drop it, the final
            # response follows on the same connection.
            self._interim = True
            raw.clear()
            self._last = 0
            return False
        n = len(raw)
        i = n & 1  # a reason phrase comes first, then name/value pairs
        if i:
            self.reason = raw[0]
        headers = []
        length = None
        chunked = False
        tokens = None
        while i < n:
            name = raw[i]
            lname = name.lower()
            if lname in _HOP_BY_HOP:
                value = raw[i + 1]
                if lname == "content-length":
                    length = int(value)  # llhttp has validated it
                elif lname == "transfer-encoding":
                    chunked = value.rstrip().lower().endswith("chunked")
                elif lname == "connection":
                    t = {t.strip().lower() for t in value.split(",")}
                    tokens = t if tokens is None else tokens | t
            else:
                headers.append((name, raw[i + 1]))
            i += 2
        self.status = code
        self.content_length = length
        self._head_done = True
        # Later spans (chunked trailers) are dropped; this also breaks the
        # self -> bound method -> self cycle of the slow callbacks.
        raw.clear()
        self._on_status = self._on_header_field = self._on_header_value = raw.append
        if tokens is None:
            keep_alive = self.get_http_version() == "HTTP/1.1"
        else:
            if self.get_http_version() == "HTTP/1.1":
                keep_alive = "close" not in tokens
            else:
                keep_alive = "keep-alive" in tokens
            tokens.discard("close")
            tokens.discard("keep-alive")
            if tokens:  # headers named in Connection are hop-by-hop too
                headers = [h for h in headers if h[0].lower() not in tokens]
        self.headers = headers
        if self._method_head or code == 204 or code == 304:
            self._framing = _F_NONE
            self._keep_alive = keep_alive
            return True  # no body, whatever the headers say
        if length is not None:
            # llhttp rejects Content-Length together with Transfer-Encoding.
            self._framing = _F_LENGTH if length else _F_NONE
        else:
            # chunked, or read until the pod closes (then never reusable)
            self._framing = _F_PARSER
            if not chunked:
                keep_alive = False
        self._keep_alive = keep_alive
        return False

    def _on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._complete = True

    # -- reading the body ------------------------------------------------------------------

    def _reusable(self) -> bool:
        return self._keep_alive and self._complete and not self._extra and self._failed is None

    def _take_pending(self) -> bytes:
        pending = self._pending
        data = bytes(pending[0]) if len(pending) == 1 else b"".join(pending)
        pending.clear()
        return data

    def abort(self) -> None:
        """Close the pod connection now, whatever was read: it is never reused.

        For a response nobody will read (the client went away). Idempotent; ``close()``
        afterwards does nothing.
        """
        sock = self._sock
        if sock is not None:
            self._sock = None
            self._pool = None
            sock.close()

    def _finish(self) -> None:
        """The body ended: hand the connection back (or close it)."""
        sock = self._sock
        if sock is not None:
            self._sock = None
            if self._reusable():
                self._pool._release(sock)
            else:
                sock.close()
            self._pool = None

    def _cut(self, exc: BaseException, timed_out: bool = False):
        sock = self._sock
        self._sock = None
        self._pool = None
        if sock is not None:
            sock.close()
        cls = UpstreamBodyTimeout if timed_out else UpstreamBodyError
        return cls(f"response body from the pod broke off: {exc!r}")

    def chunks(self) -> Iterator[bytes]:
        """Yield the body as it arrives (each piece is what one recv brought).

        Raises ``UpstreamBodyError`` (reset, early EOF, bad chunking) or
        ``UpstreamBodyTimeout``. Iterate it at most once.
        """
        if self._failed is not None and not self._complete:
            raise self._cut(self._failed) from self._failed
        if self._pending:
            if self._complete:
                self._finish()
            yield self._take_pending()
        sock = self._sock
        if sock is None:
            return
        deadline = self._deadline
        if self._framing == _F_LENGTH:
            remaining = self.get_remaining_content_length()
            while remaining > 0:
                left = deadline - monotonic()
                if left <= 0:
                    raise self._cut(TimeoutError("request_timeout"), True)
                sock.settimeout(left)
                try:
                    data = sock.recv(BLOCK_SIZE if remaining > BLOCK_SIZE else remaining)
                except TimeoutError as e:
                    raise self._cut(e, True) from e
                except OSError as e:
                    raise self._cut(e) from e
                if not data:
                    raise self._cut(EOFError(f"pod closed with {remaining} body bytes missing"))
                remaining -= len(data)
                if remaining == 0:
                    self._complete = True
                    self._finish()
                yield data
            return
        while not self._complete:
            left = deadline - monotonic()
            if left <= 0:
                raise self._cut(TimeoutError("request_timeout"), True)
            sock.settimeout(left)
            try:
                data = sock.recv(BLOCK_SIZE)
            except TimeoutError as e:
                raise self._cut(e, True) from e
            except OSError as e:
                raise self._cut(e) from e
            try:
                self.feed(data)  # b"" tells the parser the pod closed
            except HTTPParseError as e:
                if not self._complete:
                    raise self._cut(e) from e
                self._failed = e  # trailing garbage after a complete body: do not reuse
            if not data and not self._complete:
                raise self._cut(EOFError("connection closed before the body ended"))
            if self._complete:
                self._finish()
            if self._pending:
                yield self._take_pending()

    def close(self) -> None:
        """Return the connection to the pool if the body was read to its end and the
        connection is reusable; otherwise close it. Idempotent."""
        sock = self._sock
        if sock is not None:
            self._sock = None
            if self._complete and self._reusable():
                self._pool._release(sock)
            else:
                sock.close()
            self._pool = None

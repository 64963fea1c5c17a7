"""The client side of HTTP/1.1: what a request must look like to reach a pod.

pywsgi parses leniently (it folds continuation lines, lets Transfer-Encoding beat a
conflicting Content-Length, reads ``+5`` as a length). A proxy must not: two
parsers that disagree about where a request ends are how requests get smuggled.
This handler replaces pywsgi's header parsing with a strict one and refuses, before
anything reaches a pod:

- a request line that is not ``METHOD SP target SP HTTP/1.0|1.1`` -> 400;
- header names that are not tokens, whitespace before the colon, control
  characters in values, obsolete line folding -> 400;
- a header section over ``limits.max_header_bytes`` -> 431;
- Content-Length that is not digits, or several that disagree -> 400; both
  Content-Length and Transfer-Encoding -> 400; a Transfer-Encoding other than
  exactly ``chunked`` -> 501 (HTTP/1.0 with any -> 400);
- a declared body over ``limits.max_body_bytes`` -> 413 (a chunked body that grows
  past it is cut by ``LimitedInput``);
- a request line over pywsgi's 8 KiB limit -> 414 (pywsgi's own answer, given our
  ``X-Activator-Reason``).

After a response whose request body was not read to its end (the app failed on a
malformed chunk, a body over the limit, a client too slow to send it), the
connection is closed: where the next request starts is unknown, and parsing the
rest of that body as a new request is exactly how a request is smuggled.

Responses go out with status line, headers and the first piece of body in one write.

It also bounds how long a client may take: ``limits.client_timeout`` for an idle
keep-alive connection to send its next request and for the whole request head to
arrive (a slowloris cannot hold a connection), and per socket operation after
that. Refusals carry ``X-Activator-Reason`` like every answer of activator's own.
"""

from __future__ import annotations

import re
from typing import Any

import gevent
from gevent.pywsgi import MAX_REQUEST_LINE, WSGIHandler

from .core.config import LimitsConfig
from .core.errors import ActivatorError
from .sockets import send_all

CLIENT_SOCKET = "activator.client_socket"

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_TARGET = re.compile(rb"[\x21-\x7e]+\Z")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_DIGITS = re.compile(r"[0-9]+\Z")


class RequestRefused(ValueError):
    """A request refused before it reached the app: status, reason, message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


_STATUS_TEXT = {400: "Bad Request", 408: "Request Timeout", 413: "Content Too Large", 414: "URI Too Long",
                431: "Request Header Fields Too Large", 501: "Not Implemented", 503: "Service Unavailable"}


def refusal_bytes(status: int, reason: str) -> bytes:
    body = f"{status} {reason}\n".encode()
    return (f"HTTP/1.1 {status} {_STATUS_TEXT[status]}\r\nConnection: close\r\n"
            f"X-Activator-Reason: {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class _HeadTimeout(Exception):
    """The request head did not arrive within client_timeout."""


class StrictHandler(WSGIHandler):
    """pywsgi's handler with strict request parsing and client time limits.

    ``limits`` is set on the subclass the server makes (``handler_for``).
    """

    limits: LimitsConfig = LimitsConfig()
    _head_timer: gevent.Timeout | None = None

    def handle(self) -> None:
        self.socket.settimeout(self.limits.client_timeout)
        try:
            super().handle()
        finally:
            if self._head_timer is not None:
                self._head_timer.close()

    def handle_one_request(self) -> Any:
        try:
            result = super().handle_one_request()
        finally:
            self._stop_head_timer()  # e.g. a request line too long never reaches read_request
        if isinstance(result, tuple) and result[0] == "414":
            self.log_error("refused request from %s: request line over %d bytes", self.client_address,
                           MAX_REQUEST_LINE)
            return "414", refusal_bytes(414, "request-line-too-long")
        return result

    def handle_one_response(self) -> None:
        try:
            super().handle_one_response()
        finally:
            if not _body_consumed(self.wsgi_input):
                self.close_connection = True

    def read_requestline(self) -> str:
        # The clock for the whole head starts when we wait for its first byte:
        # idle keep-alive and slow senders get the same budget.
        if self._head_timer is None:  # one per connection, restarted for each request
            self._head_timer = gevent.Timeout(self.limits.client_timeout, _HeadTimeout)
        self._head_timer.start()
        try:
            line: bytes = self.rfile.readline(MAX_REQUEST_LINE)
        except _HeadTimeout:
            line = b""
        if not line:
            self._stop_head_timer()
        return line.decode("latin-1")

    def read_request(self, raw_requestline: str) -> bool:
        try:
            return self._read_request(raw_requestline)
        except _HeadTimeout:
            raise RequestRefused(408, "client-timeout", "request head not received within client_timeout") from None
        finally:
            self._stop_head_timer()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()

    def _read_request(self, raw_requestline: str) -> bool:
        line = raw_requestline.rstrip("\r\n")
        self.requestline = line
        words = line.split(" ")
        if len(words) != 3 or not _TOKEN.match(words[0].encode("latin-1")) \
                or not _TARGET.match(words[1].encode("latin-1")) or words[2] not in ("HTTP/1.1", "HTTP/1.0"):
            raise RequestRefused(400, "bad-request", f"malformed request line {line[:100]!r}")
        self.command, self.path, self.request_version = words
        self.headers = self._read_headers()
        self.content_length = self._framing()
        if self.request_version == "HTTP/1.1":
            self.close_connection = "close" in self.headers.get("connection", "").lower()
        else:
            self.close_connection = "keep-alive" not in self.headers.get("connection", "close").lower()
        return True

    def _read_headers(self) -> Any:
        limit = self.limits.max_header_bytes
        total = 0
        message = RequestHeaders()
        while True:
            raw: bytes = self.rfile.readline(limit + 2)
            total += len(raw)
            if total > limit:
                raise RequestRefused(431, "headers-too-large", f"header section over {limit} bytes")
            if not raw.endswith(b"\n"):
                raise RequestRefused(400, "bad-request", "header section ended early")
            if raw in (b"\r\n", b"\n"):
                return message
            if raw[:1] in (b" ", b"\t"):
                raise RequestRefused(400, "bad-request", "obsolete line folding")
            name, colon, value = raw.rstrip(b"\r\n").partition(b":")
            if not colon or not _TOKEN.match(name):
                raise RequestRefused(400, "bad-request", f"malformed header line {raw[:60]!r}")
            value = value.strip(b" \t")
            if _BAD_VALUE.search(value):
                raise RequestRefused(400, "bad-request", f"control character in header {name.decode()!r}")
            message.add(name.decode("latin-1"), value.decode("latin-1"))

    def _framing(self) -> int | None:
        headers = self.headers
        lengths = {part.strip() for value in headers.get_all("content-length") for part in value.split(",")}
        encodings = headers.get_all("transfer-encoding")
        if encodings:
            if self.request_version != "HTTP/1.1":
                raise RequestRefused(400, "bad-request", "Transfer-Encoding in an HTTP/1.0 request")
            if lengths:
                raise RequestRefused(400, "bad-request", "both Content-Length and Transfer-Encoding")
            if len(encodings) != 1 or encodings[0].strip().lower() != "chunked":
                raise RequestRefused(501, "unsupported-transfer-encoding",
                                     f"Transfer-Encoding {', '.join(encodings)!r} (only chunked)")
            return None
        if not lengths:
            return None
        if len(lengths) != 1 or not _DIGITS.match(next(iter(lengths))):
            raise RequestRefused(400, "bad-request", f"invalid Content-Length {sorted(lengths)!r}")
        length = int(next(iter(lengths)))
        if length and self.command == "HEAD":
            raise RequestRefused(400, "bad-request", "a HEAD request with a body")
        headers.remove("content-length")
        headers.add("Content-Length", str(length))
        maximum = self.limits.max_body_bytes
        if maximum is not None and length > maximum:
            raise RequestRefused(413, "body-too-large", f"Content-Length {length} over max_body_bytes {maximum}")
        return length

    def _handle_client_error(self, ex: BaseException) -> tuple[str, bytes]:
        if isinstance(ex, RequestRefused):
            self.log_error("refused request from %s: %s", self.client_address, ex)
            return str(ex.status), refusal_bytes(ex.status, ex.reason)
        result: tuple[str, bytes] = super()._handle_client_error(ex)
        return result

    def _write_with_headers(self, data: bytes) -> None:
        """Status line, headers and the first piece of body in one send (pywsgi sends two).

        One segment instead of two per small response: fewer syscalls, and no Nagle
        interplay with delayed ACKs. Chunked framing is added as pywsgi's ``_write`` does.
        """
        self.headers_sent = True
        self.finalize_headers()
        towrite = bytearray(b"HTTP/1.1 ")
        towrite += self.status
        towrite += b"\r\n"
        for header, value in self.response_headers:
            towrite += header
            towrite += b": "
            towrite += value
            towrite += b"\r\n"
        towrite += b"\r\n"
        if data:
            if self.response_use_chunked:
                towrite += b"%x\r\n" % len(data)
                towrite += data
                towrite += b"\r\n"
            else:
                towrite += data
        self._sendall(towrite)

    def _sendall(self, data: bytes | bytearray) -> None:
        """pywsgi's, with ``send_all`` (one send syscall for a small response)."""
        try:
            send_all(self.socket, data)
        except OSError as ex:
            self.status = f"socket error: {ex}"
            if self.code > 0:
                self.code = -self.code
            raise
        self.response_length += len(data)

    def log_request(self) -> None:
        """Nothing: the proxy writes its own access log (pywsgi would format a line per
        request even with logging off)."""

    def get_environ(self) -> dict[str, Any]:
        env: dict[str, Any] = super().get_environ()
        env["RAW_URI"] = self.path
        env[CLIENT_SOCKET] = self.socket
        maximum = self.limits.max_body_bytes
        if maximum is not None and self.content_length is None and "HTTP_TRANSFER_ENCODING" in env:
            env["wsgi.input"] = LimitedInput(env["wsgi.input"], maximum)
        return env


def _body_consumed(stream: Any) -> bool:
    """Whether pywsgi's ``Input`` was read (or discarded) to the end of the request body.

    False after a malformed chunk, an over-limit body (``LimitedInput``) or a read
    that failed: the connection's framing is then unknown and it must be closed.
    """
    if stream is None:
        return True
    if getattr(stream, "chunked_input", False):
        return stream.chunk_length == 0 and not stream._chunked_input_error
    return bool(stream.position >= (stream.content_length or 0))


class BodyTooLarge(ActivatorError):
    """A chunked request body grew past max_body_bytes."""

    status = 413
    reason = "body-too-large"


class LimitedInput:
    """wsgi.input for a chunked body: raises BodyTooLarge once it passes ``maximum`` bytes.

    Once tripped, the rest of the body is neither read nor discarded (a client may
    stream for ever): the connection is closed after the response.
    """

    def __init__(self, stream: Any, maximum: int) -> None:
        self._stream = stream
        self._left = maximum

    def read(self, size: int = -1) -> bytes:
        if self._left < 0:
            raise BodyTooLarge("request body over max_body_bytes")
        data: bytes = self._stream.read(size) if size is not None and size >= 0 else self._stream.read()
        self._left -= len(data)
        if self._left < 0:
            # pywsgi's own flag for "stream in an unknown state": skips the discard.
            self._stream._chunked_input_error = True
            raise BodyTooLarge("request body over max_body_bytes")
        return data


class RequestHeaders:
    """The parsed request headers, with the small interface pywsgi uses.

    Replaces pywsgi's ``http.client``/``email`` message (a feed parser per request, the
    largest single cost of parsing a request). Names keep their case; lookups ignore it.
    """

    __slots__ = ("_items",)
    status = ""  # pywsgi's parse-error slot: we raise instead

    def __init__(self) -> None:
        self._items: list[tuple[str, str, str]] = []  # (lower-case name, name, value)

    def add(self, name: str, value: str) -> None:
        self._items.append((name.lower(), name, value))

    def get(self, name: str, default: str | None = None) -> str | None:
        key = name.lower()
        for lower, _, value in self._items:
            if lower == key:
                return value
        return default

    getheader = get

    def get_all(self, name: str) -> list[str]:
        key = name.lower()
        return [value for lower, _, value in self._items if lower == key]

    def remove(self, name: str) -> None:
        key = name.lower()
        self._items = [item for item in self._items if item[0] != key]

    @property
    def headers(self) -> list[str]:
        """As pywsgi's ``_headers`` reads them: ``"Name: value\\r\\n"`` lines."""
        return [f"{name}: {value}\r\n" for _, name, value in self._items]

    @property
    def typeheader(self) -> str | None:
        return self.get("content-type")


def handler_for(limits: LimitsConfig) -> type[StrictHandler]:
    """A handler class bound to these limits (pywsgi instantiates it per connection)."""
    return type("ProxyHandler", (StrictHandler,), {"limits": limits})

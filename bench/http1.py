"""HTTP/1.1 messages read off a socket with llhttp (httptools' public API), for the bench's own servers.

The minimal forwarder reads its clients' requests and its pod's responses with it, the
two-write pod its requests. What it decides, and its rules:

- a message is whole when llhttp says so (``on_message_complete``); its body is buffered
  (the bench only sends small bodies) and arrives de-chunked when it was sent chunked;
- several messages in one read (pipelining) are handed out one by one, in arrival order;
- keep-alive is llhttp's verdict for that message (its HTTP version and ``Connection``);
- the peer closing (or resetting) the connection before the next whole message ends the
  stream: ``next()`` returns None; bytes that are not HTTP raise ``httptools.HttpParserError``.

No limits and no timeouts: these servers only ever talk to the bench's own processes.
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import httptools

#: Bytes asked of one recv: a whole small message, or a good share of a large one.
RECV_SIZE = 65536

Headers = list[tuple[bytes, bytes]]


@dataclass(slots=True)
class Request:
    method: bytes
    target: bytes
    headers: Headers
    body: bytes
    keep_alive: bool


@dataclass(slots=True)
class Response:
    status: int
    headers: Headers
    body: bytes
    keep_alive: bool


Message = TypeVar("Message", Request, Response)


class _Reader(Generic[Message]):
    """The parts of one message as llhttp hands them over, and the whole messages read so far."""

    _feed: Callable[[bytes], None]  # the subclass's parser's feed_data

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._whole: deque[Message] = deque()
        self._headers: Headers = []
        self._body: list[bytes] = []

    def next(self) -> Message | None:
        """The next whole message; None once the peer closed the connection. Blocks (yields under gevent)."""
        while not self._whole:
            try:
                data = self.sock.recv(RECV_SIZE)
            except ConnectionError:
                return None
            if not data:
                return None
            self._feed(data)
        return self._whole.popleft()

    # llhttp callbacks (httptools looks them up by name)

    def on_message_begin(self) -> None:
        self._headers = []
        self._body = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)


class RequestReader(_Reader[Request]):
    """The requests a client sends on one connection."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self._parser = httptools.HttpRequestParser(self)
        self._feed = self._parser.feed_data
        self._target = b""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._target = b""

    def on_url(self, url: bytes) -> None:  # llhttp may hand the target over in pieces
        self._target += url

    def on_message_complete(self) -> None:
        parser = self._parser
        self._whole.append(
            Request(parser.get_method(), self._target, self._headers, b"".join(self._body), parser.should_keep_alive())
        )


class ResponseReader(_Reader[Response]):
    """The responses a server sends on one connection (never to HEAD: the bench does not send it)."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self._parser = httptools.HttpResponseParser(self)
        self._feed = self._parser.feed_data

    def on_message_complete(self) -> None:
        parser = self._parser
        self._whole.append(
            Response(parser.get_status_code(), self._headers, b"".join(self._body), parser.should_keep_alive())
        )

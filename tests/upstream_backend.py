"""In-process test pods for tests/test_upstream.py (loopback only, gevent sockets, no patching).

``WsgiBackend`` is a gevent pywsgi server with a few routes; every request records the
client port of its connection, so tests can tell whether a connection was reused.
``RawBackend`` runs a hand-written handler per accepted connection, for pods that
misbehave (garbage, resets, silence, early answers, closing idle connections).
``RequestReader`` is what a raw handler reads requests with: llhttp (httptools' request
parser) decodes them, so a test sees the body and the trailers that really arrived,
chunked or not, and can stop reading part-way to see how much arrived.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import gevent
import gevent.event
import gevent.pywsgi
import httptools
from gevent import socket as gsocket

#: ``handler(conn, index)``: serves one accepted connection; ``index`` counts them from 0.
Handler = Callable[[gsocket.socket, int], None]


def listener(*, nodelay: bool = True, backlog: int = 128) -> gsocket.socket:
    """A listening socket on 127.0.0.1 (an ephemeral port); accepted sockets inherit TCP_NODELAY.

    With ``backlog=0`` one connection nobody accepts fills the queue, and the kernel drops
    the handshakes of later ones: their connect times out.
    """
    sock = gsocket.socket(gsocket.AF_INET, gsocket.SOCK_STREAM)
    sock.setsockopt(gsocket.SOL_SOCKET, gsocket.SO_REUSEADDR, 1)
    if nodelay:
        sock.setsockopt(gsocket.IPPROTO_TCP, gsocket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    return sock


def pattern(n: int) -> bytes:
    """n deterministic bytes (not all alike, so misplaced bytes show in a hash)."""
    block = bytes(range(256)) * 256
    return (block * (n // len(block) + 1))[:n]


def read_head(conn: gsocket.socket) -> bytes:
    """Read up to the end of a request head on a raw connection (b"" on EOF)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return b""
        buf += data
    return buf


def drain(conn: gsocket.socket) -> int:
    """Read and discard until EOF (or a reset); the number of bytes read."""
    total = 0
    try:
        while data := conn.recv(65536):
            total += len(data)
    except OSError:
        pass
    return total


def reset(conn: gsocket.socket) -> None:
    """Close with RST instead of FIN."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


@dataclass
class ReceivedRequest:
    """One request as the pod got it (``body`` grows while it arrives)."""

    method: bytes = b""
    target: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    trailers: list[tuple[bytes, bytes]] = field(default_factory=list)
    head_done: bool = False
    complete: bool = False

    def header(self, name: bytes) -> bytes | None:
        """The value of the one ``name`` line (case-insensitive), None if absent."""
        values = [value for key, value in self.headers if key.lower() == name.lower()]
        assert len(values) <= 1, f"{name!r} sent {len(values)} times"
        return values[0] if values else None


class RequestReader:
    """Reads the requests of one raw pod connection through llhttp.

    The client under test never pipelines, so one request is in progress at a time:
    ``current``. ``received`` counts every byte read off the socket.
    """

    def __init__(self, conn: gsocket.socket) -> None:
        self.conn = conn
        self.received = 0
        self.current = ReceivedRequest()
        self._parser = httptools.HttpRequestParser(self)

    def read_until(self, done: Callable[[ReceivedRequest], bool]) -> bool:
        """Read until ``done(current)``; False if the connection ended first."""
        while not done(self.current):
            try:
                data = self.conn.recv(65536)
            except OSError:
                return False
            if not data:
                return False
            self.received += len(data)
            self._parser.feed_data(data)
        return True

    def next_request(self) -> ReceivedRequest | None:
        """The next whole request (None at EOF), its body and trailers read."""
        if self.current.complete:
            self.current = ReceivedRequest()
        return self.current if self.read_until(lambda request: request.complete) else None

    def requests(self) -> Iterator[ReceivedRequest]:
        """Every request of the connection, each once it is whole, until EOF."""
        while (request := self.next_request()) is not None:
            yield request

    # -- llhttp callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.current = ReceivedRequest()

    def on_url(self, url: bytes) -> None:
        self.current.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self.current
        (request.trailers if request.head_done else request.headers).append((name, value))

    def on_headers_complete(self) -> None:
        self.current.head_done = True
        self.current.method = self._parser.get_method()

    def on_body(self, body: bytes) -> None:
        self.current.body += body

    def on_message_complete(self) -> None:
        self.current.complete = True


def answer_every_request(*responses: bytes) -> Handler:
    """A handler that answers the n-th request of a connection with ``responses[n]``
    (the last one again once they run out), until the client closes."""

    def handler(conn: gsocket.socket, index: int) -> None:
        for number, _ in enumerate(RequestReader(conn).requests()):
            conn.sendall(responses[min(number, len(responses) - 1)])

    return handler


class WsgiBackend:
    """Routes:

    - ``/echo``: reads the whole body in pieces, answers JSON with its sha256, length,
      the request's Content-Length / Transfer-Encoding, Host and method.
    - ``/bytes/<n>``: ``pattern(n)`` with Content-Length (empty body for HEAD).
    - ``/status/<code>``: an empty response with that status.
    - ``/slow``: 5 chunks, chunked, 0.3 s apart; the wait before chunk i+1 ends early
      when the test sets ``acks[i]`` (it got chunk i), so a streaming client runs fast
      and a buffering one is slow and fails the ordering check. Steps go to ``log``.
    """

    def __init__(self) -> None:
        self.ports: list[int] = []  # client port of the connection, per request
        self.log: list[tuple[str, int]] = []
        self.acks = [gevent.event.Event() for _ in range(5)]
        self.slow_chunks = [b"data: %d\n\n" % i for i in range(5)]
        sock = listener()
        self.port = sock.getsockname()[1]
        self.server = gevent.pywsgi.WSGIServer(sock, self.app, log=None, error_log=None)
        self.server.start()

    def close(self) -> None:
        self.server.stop(timeout=1)

    @property
    def connections(self) -> int:
        return len(set(self.ports))

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        self.ports.append(int(environ["REMOTE_PORT"]))
        path = environ["PATH_INFO"]
        if path == "/echo":
            digest = hashlib.sha256()
            length = 0
            stream = environ["wsgi.input"]
            while piece := stream.read(65536):
                digest.update(piece)
                length += len(piece)
            body = json.dumps(
                {
                    "sha256": digest.hexdigest(),
                    "length": length,
                    "content_length": environ.get("CONTENT_LENGTH"),
                    "transfer_encoding": environ.get("HTTP_TRANSFER_ENCODING"),
                    "host": environ.get("HTTP_HOST"),
                    "method": environ["REQUEST_METHOD"],
                }
            ).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if path.startswith("/bytes/"):
            n = int(path.rsplit("/", 1)[1])
            start_response("200 OK", [("Content-Length", str(n)), ("X-Kind", "bytes")])
            if environ["REQUEST_METHOD"] == "HEAD":
                return []
            return [pattern(n)]
        if path.startswith("/status/"):
            code = int(path.rsplit("/", 1)[1])
            start_response(f"{code} Whatever", [("X-Status", str(code))])
            return []
        if path == "/slow":
            start_response("200 OK", [("Content-Type", "text/event-stream")])
            return self._slow()
        start_response("404 Not Found", [("Content-Length", "0")])
        return []

    def _slow(self) -> Iterator[bytes]:
        for i, chunk in enumerate(self.slow_chunks):
            if i:
                self.acks[i - 1].wait(0.3)
            self.log.append(("sent", i))
            yield chunk


class RawBackend:
    """Calls ``handler(conn, index)`` in a greenlet for each accepted connection.

    ``accept=False``: connections complete in the kernel's backlog and are never taken.
    ``nodelay=False``: the pod's sockets keep Nagle's algorithm (as many real servers do).
    """

    def __init__(self, handler: Handler | None, *, accept: bool = True, nodelay: bool = True) -> None:
        self.handler = handler
        self.accepted = 0
        self.sock = listener(nodelay=nodelay)
        self.port = self.sock.getsockname()[1]
        self._greenlets: list[gevent.Greenlet] = []
        if accept:
            self._greenlets.append(gevent.spawn(self._accept_loop))

    def _accept_loop(self) -> None:
        assert self.handler is not None
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # stop_listening()
                return
            index = self.accepted
            self.accepted += 1
            self._greenlets.append(gevent.spawn(self._run, self.handler, conn, index))

    @staticmethod
    def _run(handler: Handler, conn: gsocket.socket, index: int) -> None:
        try:
            handler(conn, index)
        except OSError:
            pass
        finally:
            conn.close()

    def stop_listening(self) -> None:
        """Close the listening socket: new connections are refused, accepted ones go on."""
        self.sock.close()

    def close(self) -> None:
        gevent.killall(self._greenlets, timeout=1)
        self.sock.close()

"""A tiny in-process test backend for tests/test_upstream.py (loopback only).

``WsgiBackend`` is a gevent pywsgi server with a few routes; every request records the
client port of its connection, so tests can tell whether a connection was reused.
``RawBackend`` runs a hand-written handler per accepted connection, for pods that
misbehave (garbage, resets, silence, closing idle connections).
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct

import gevent
import gevent.event
import gevent.pywsgi
from gevent import socket as gsocket


def listener() -> gsocket.socket:
    sock = gsocket.socket(gsocket.AF_INET, gsocket.SOCK_STREAM)
    sock.setsockopt(gsocket.SOL_SOCKET, gsocket.SO_REUSEADDR, 1)
    sock.setsockopt(gsocket.IPPROTO_TCP, gsocket.TCP_NODELAY, 1)  # inherited by accepted sockets
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def pattern(n: int) -> bytes:
    """n deterministic bytes (not all alike, so misplaced bytes show in a hash)."""
    block = bytes(range(256)) * 256
    return (block * (n // len(block) + 1))[:n]


def read_head(conn) -> bytes:
    """Read up to the end of a request head on a raw connection (b"" on EOF)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return b""
        buf += data
    return buf


def reset(conn) -> None:
    """Close with RST instead of FIN."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


class WsgiBackend:
    """Routes:

    - ``/echo``: reads the whole body in pieces, answers JSON with its sha256, length,
      the request's Content-Length / Transfer-Encoding and the connection's client port.
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

    def app(self, environ, start_response):
        self.ports.append(int(environ["REMOTE_PORT"]))
        path = environ["PATH_INFO"]
        if path == "/echo":
            h = hashlib.sha256()
            n = 0
            inp = environ["wsgi.input"]
            while True:
                piece = inp.read(65536)
                if not piece:
                    break
                h.update(piece)
                n += len(piece)
            body = json.dumps(
                {
                    "sha256": h.hexdigest(),
                    "length": n,
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

    def _slow(self):
        for i, chunk in enumerate(self.slow_chunks):
            if i:
                self.acks[i - 1].wait(0.3)
            self.log.append(("sent", i))
            yield chunk


class RawBackend:
    """Calls ``handler(conn, index)`` in a greenlet for each accepted connection."""

    def __init__(self, handler, *, accept: bool = True) -> None:
        self.handler = handler
        self.accepted = 0
        self.sock = listener()
        self.port = self.sock.getsockname()[1]
        self._greenlets: list[gevent.Greenlet] = []
        if accept:
            self._greenlets.append(gevent.spawn(self._accept_loop))

    def _accept_loop(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            index = self.accepted
            self.accepted += 1
            self._greenlets.append(gevent.spawn(self._run, conn, index))

    def _run(self, conn, index) -> None:
        try:
            self.handler(conn, index)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        gevent.killall(self._greenlets, timeout=1)
        self.sock.close()

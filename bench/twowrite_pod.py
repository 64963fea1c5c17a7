"""A pod that writes each response in two sends, on sockets without TCP_NODELAY: the bench's slow-ACK case.

    python -m bench.twowrite_pod --port N [--one-write] [--nodelay]

Python's ``http.server`` (and many small servers) write the response head, then the body,
in two ``send`` calls, on a socket with Nagle's algorithm on. The second, small send then
waits in the kernel until the first is acknowledged; a peer in delayed-ACK mode (a
kept-alive connection that has seen a few exchanges) acknowledges only after its
delayed-ACK timer (about 40 ms on Linux), or when it has data to send itself. A fresh
connection starts in quick-ACK mode and does not stall. This pod reproduces that, with
keep-alive; ``--one-write`` (head and body in one send) and ``--nodelay`` (TCP_NODELAY on
the listener, inherited by accepted sockets) turn the two halves of the problem off.

Endpoints, shaped like ``tests/backend.py`` where ``bench/scheduling.py`` reads them:

- ``/delay?ms=N`` (any path that is not a control one: ``ms`` from the query, else 0):
  waits N ms, answers 200 with a short text body; counted;
- ``GET /_stats``: JSON ``in_flight``, ``peak``, ``count``, and per work request since
  the last reset ``busy_us`` (head parsed to the last send returned) and ``gaps_us``
  (for a request that found the pod idle: the time since the pod's previous response
  was sent; with one request at a time, that is what whoever sends the requests adds
  between two of them); ``POST /_reset`` clears them. Control requests are not counted.

Single-threaded (gevent): the counters change without yielding, so no locks.
"""

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402 (gevent patches the stdlib first, above)
import json  # noqa: E402 (gevent patches the stdlib first, above)
import socket  # noqa: E402 (gevent patches the stdlib first, above)
import time  # noqa: E402 (gevent patches the stdlib first, above)
from typing import Any  # noqa: E402 (gevent patches the stdlib first, above)
from urllib.parse import parse_qs  # noqa: E402 (gevent patches the stdlib first, above)

import gevent  # noqa: E402 (gevent patches the stdlib first, above)
import gevent.pool  # noqa: E402 (gevent patches the stdlib first, above)
import httptools  # noqa: E402 (gevent patches the stdlib first, above)
from gevent.server import StreamServer  # noqa: E402 (gevent patches the stdlib first, above)

from bench.http1 import RequestReader  # noqa: E402 (gevent patches the stdlib first, above)


class Stats:
    """The pod's own view of its work. Invariant: in_flight >= 0; idle_since is set only while in_flight == 0."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.reset()

    def reset(self) -> None:
        self.peak = self.in_flight  # restarts from what is in flight now (0 when idle)
        self.count = 0
        self.busy_us: list[int] = []
        self.gaps_us: list[int] = []
        self.idle_since: float | None = None  # no gap for the first request after a reset

    def enter(self, now: float) -> None:
        if self.in_flight == 0 and self.idle_since is not None:
            self.gaps_us.append(round((now - self.idle_since) * 1e6))
        self.idle_since = None
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        self.count += 1

    def exit(self, started: float, now: float) -> None:
        self.in_flight -= 1
        self.busy_us.append(round((now - started) * 1e6))
        if self.in_flight == 0:
            self.idle_since = now

    def as_dict(self) -> dict[str, Any]:
        return {
            "in_flight": self.in_flight,
            "peak": self.peak,
            "count": self.count,
            "busy_us": self.busy_us,
            "gaps_us": self.gaps_us,
        }


def response(status: str, body: bytes, content_type: str, keep_alive: bool) -> tuple[bytes, bytes]:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
    return (head + ("\r\n" if keep_alive else "Connection: close\r\n\r\n")).encode("latin-1"), body


class Pod:
    def __init__(self, port: int, one_write: bool) -> None:
        self.name = f"127.0.0.1:{port}"
        self.one_write = one_write
        self.stats = Stats()

    def handle(self, sock: socket.socket, _client: tuple[str, int]) -> None:
        requests = RequestReader(sock)
        try:
            while True:
                request = requests.next()
                if request is None:
                    return
                path, _, query = request.target.partition(b"?")
                if path == b"/_stats":
                    body = json.dumps(self.stats.as_dict()).encode()
                    sock.sendall(b"".join(response("200 OK", body, "application/json", request.keep_alive)))
                elif path == b"/_reset":
                    self.stats.reset()
                    sock.sendall(b"".join(response("200 OK", b"{}", "application/json", request.keep_alive)))
                else:
                    self.work(sock, path, query, request.keep_alive)
                if not request.keep_alive:
                    return
        except httptools.HttpParserError:
            return
        finally:
            sock.close()

    def work(self, sock: socket.socket, path: bytes, query: bytes, keep_alive: bool) -> None:
        started = time.monotonic()
        self.stats.enter(started)
        try:
            try:
                ms = int(parse_qs(query.decode("latin-1")).get("ms", ["0"])[-1])
            except ValueError:
                ms = 0
            if ms > 0:
                gevent.sleep(ms / 1000)
            body = f"pod {self.name} path {path.decode('latin-1')} ms {ms}\n".encode()
            head, body = response("200 OK", body, "text/plain", keep_alive)
            if self.one_write:
                sock.sendall(head + body)
            else:
                sock.sendall(head)
                sock.sendall(body)
        finally:
            self.stats.exit(started, time.monotonic())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--one-write", action="store_true", help="head and body in one send")
    ap.add_argument("--nodelay", action="store_true", help="TCP_NODELAY on every connection")
    args = ap.parse_args()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if args.nodelay:
        listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    listener.bind(("127.0.0.1", args.port))
    listener.listen(1024)
    pod = Pod(args.port, args.one_write)
    print(f"READY {args.port}", flush=True)
    StreamServer(listener, pod.handle, spawn=gevent.pool.Pool()).serve_forever()


if __name__ == "__main__":
    main()

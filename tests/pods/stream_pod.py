"""A raw HTTP/1.1 pod whose event stream moves only when the test says so.

    python -m pods.stream_pod --port 0 --control-port 0

``GET /events`` (any query) is answered at once with a chunked ``text/event-stream``
head; then the pod sends one event (one chunk: ``id: I``, ``data: event I``) each time
the control port gets ``POST /send?n=K`` (K events), and the last chunk after
``POST /end``. Told nothing, it sends nothing: a pod that stops mid-body. A stream is
one unit of work (``podstats.Stats``, named ``/events``) until it ended or the peer
closed the connection; ``notes`` count the events written (``sent``, counted just before
each one goes out: counted after, a client could read an event before the pod's count
of it moved). Any other path:
404. Written on sockets, not on a framework, so that nothing but the test decides when
a byte goes out; each connection serves one request and is closed.
"""

from __future__ import annotations

import select
import socket
import socketserver
import threading
from urllib.parse import urlsplit

from pods.podstats import HOST, Stats, announce, arguments, serve_control

HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
)
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def event(i: int) -> bytes:
    """Event ``i`` as the client reads it (the payload of one chunk)."""
    return b"id: %d\ndata: event %d\n\n" % (i, i)


class Commands:
    """What the test told the streams: events to send, and whether to end."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.to_send = 0
        self.ended = False

    def send(self, query: dict[str, str]) -> dict[str, int]:
        with self.cond:
            self.to_send += int(query.get("n", "1"))
            self.cond.notify_all()
            return {"to_send": self.to_send}

    def end(self, query: dict[str, str]) -> dict[str, bool]:
        with self.cond:
            self.ended = True
            self.cond.notify_all()
            return {"ended": True}

    def next(self) -> bool | None:
        """True: send an event; False: end the stream; None: nothing yet (after a short wait)."""
        with self.cond:
            if not self.to_send and not self.ended:
                self.cond.wait(0.05)
            if self.to_send:
                self.to_send -= 1
                return True
            return False if self.ended else None


def peer_closed(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    stats = Stats()
    commands = Commands()

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            sock: socket.socket = self.request
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            head = b""
            while b"\r\n\r\n" not in head:
                piece = sock.recv(65536)
                if not piece:
                    return
                head += piece
            target = head.split(b"\r\n", 1)[0].split(b" ")[1].decode("latin-1")
            if urlsplit(target).path != "/events":
                sock.sendall(NOT_FOUND)
                return
            with stats.track("/events"):
                self.stream(sock)

        def stream(self, sock: socket.socket) -> None:
            sock.sendall(HEAD)
            sent = 0
            while not peer_closed(sock):
                step = commands.next()
                if step is None:
                    continue
                try:
                    if not step:
                        sock.sendall(b"0\r\n\r\n")
                        return
                    data = event(sent)
                    sent += 1
                    stats.note("sent")
                    sock.sendall(b"%x\r\n%s\r\n" % (len(data), data))
                except OSError:
                    return

    socketserver.ThreadingTCPServer.allow_reuse_address = True
    server = socketserver.ThreadingTCPServer((HOST, args.port), Handler)
    server.daemon_threads = True
    announce(
        server.server_address[1], serve_control(args.control_port, stats, {"send": commands.send, "end": commands.end})
    )
    server.serve_forever()


if __name__ == "__main__":
    main()

"""The minimal HTTP/2 forwarder: the floor of an h2 proxy on activator's stack, for the bench.

    python -m bench.h2forwarder --port N --upstream HOST:PORT [--pod-h2c]

``bench/forwarder.py`` with an HTTP/2 client side, and nothing else: ``monkey.patch_all()``,
a gevent ``StreamServer`` on a TCP_NODELAY listener, ``h2`` for the clients (h2c with prior
knowledge), each request stream's WSGI environ handed to the same ``falcon.App`` with one
sink (``forwarder.make_app``), and behind it either the HTTP/1.1 forwarder's keep-alive
pool (``forwarder.PodPool``) or, with ``--pod-h2c``, one h2c connection to the pod
(prior knowledge), every request one stream on it.

How it uses ``h2``: plainly, as its documentation shows. The default configuration
(``h2`` validates and normalizes the fields both ways), a greenlet per request stream
once its END_STREAM came, every stream's answer sent as ``send_headers`` /
``send_data`` / trailers then one ``data_to_send`` and one ``sendall`` under the
connection's write lock; the readers send what ``h2`` made after each read (WINDOW_UPDATEs
for the DATA they acknowledge at once, SETTINGS and PING acks). A stream the client
resets has its pod stream reset (CANCEL) when it is on the h2c pod; an HTTP/1.1 pod
finishes it.

What it leaves out, on purpose (a yardstick, not a product): throttling, limits, timeouts,
streaming (bodies are buffered both ways and an answer must fit in the client's window: the
bench sends small ones), a second pod connection (the pod's stream limit must cover the
load), GOAWAY handling, TLS, HTTP/1.1 clients.
"""

from gevent import monkey

monkey.patch_all()

import argparse
import socket
from collections.abc import Callable
from typing import Any

import falcon
import gevent
import gevent.event
import gevent.lock
import gevent.pool
import h2.config
import h2.connection
import h2.events
import h2.exceptions
from gevent.server import StreamServer
from h2.errors import ErrorCodes

from bench.forwarder import Fields, PodPool, call_app, environ, make_app
from bench.http1 import Headers, Request, Response

RECV_SIZE = 65536
#: The environ keys by which the client side and the h2c upstream talk: the pod's trailers
#: (sent after the body), and where the upstream leaves how to cancel the pod's stream.
TRAILERS = "h2forwarder.trailers"
CANCEL = "h2forwarder.cancel"
#: Why a pod stream ended when its client reset its own.
CANCELED = "canceled by the client"


class Wire:
    """One ``h2`` connection over one socket; ``flush`` sends what ``h2`` made, one writer at a time."""

    def __init__(self, sock: socket.socket, client_side: bool) -> None:
        self.sock = sock
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=client_side, header_encoding=None))
        self._lock = gevent.lock.Semaphore()

    def flush(self) -> None:
        with self._lock:
            data = self.h2.data_to_send()
            if data:
                self.sock.sendall(data)


class PodStream:
    """One request's stream on the h2c pod connection: what came back, and when it is whole."""

    __slots__ = ("status", "headers", "body", "trailers", "error", "done")

    def __init__(self) -> None:
        self.status = 0
        self.headers: Headers = []
        self.body: list[bytes] = []
        self.trailers: Headers = []
        self.error = ""
        self.done = gevent.event.Event()


class H2Pod:
    """The one h2c connection to the pod (opened at start), every request one stream on it."""

    def __init__(self, address: tuple[str, int]) -> None:
        sock = socket.create_connection(address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.authority = f"{address[0]}:{address[1]}"
        self.wire = Wire(sock, client_side=True)
        self.streams: dict[int, PodStream] = {}
        self.wire.h2.initiate_connection()
        self.wire.flush()
        gevent.spawn(self._read)

    def forward(self, env: dict[str, Any], method: str, target: str, headers: Fields, body: bytes) -> Response:
        h2conn = self.wire.h2
        authority = self.authority
        fields = []
        for name, value in headers:
            if name == "host":
                authority = value
            else:
                fields.append((name.encode("latin-1"), value.encode("latin-1")))
        if env.get("HTTP_TE") == "trailers":  # gRPC needs it; the sink leaves te to us
            fields.append((b"te", b"trailers"))
        pseudo = [(b":method", method.encode()), (b":scheme", b"http"), (b":authority", authority.encode())]
        stream_id = h2conn.get_next_available_stream_id()
        stream = self.streams[stream_id] = PodStream()
        h2conn.send_headers(stream_id, [*pseudo, (b":path", target.encode("latin-1")), *fields], end_stream=not body)
        if body:
            h2conn.send_data(stream_id, body, end_stream=True)
        env[CANCEL] = lambda: self._cancel(stream_id)
        self.wire.flush()
        stream.done.wait()
        if stream.error == CANCELED:  # an answer nobody reads: the client's stream is gone
            return Response(499, [], b"", True)
        if stream.error:
            raise ConnectionError(stream.error)
        env[TRAILERS] = stream.trailers
        return Response(stream.status, stream.headers, b"".join(stream.body), True)

    def _cancel(self, stream_id: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            return
        try:
            self.wire.h2.reset_stream(stream_id, ErrorCodes.CANCEL)
        except h2.exceptions.ProtocolError:
            pass  # it ended meanwhile
        stream.error = CANCELED
        stream.done.set()
        self.wire.flush()

    def _read(self) -> None:
        h2conn = self.wire.h2
        while True:
            data = self.wire.sock.recv(RECV_SIZE)
            if not data:
                break
            for event in h2conn.receive_data(data):
                stream = self.streams.get(getattr(event, "stream_id", 0) or 0)
                if stream is None:
                    continue
                if isinstance(event, h2.events.ResponseReceived):
                    stream.status = int(dict(event.headers)[b":status"])
                    stream.headers = [(n, v) for n, v in event.headers if not n.startswith(b":")]
                elif isinstance(event, h2.events.DataReceived):
                    stream.body.append(event.data)
                    h2conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.TrailersReceived):
                    stream.trailers = list(event.headers)
                elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    if isinstance(event, h2.events.StreamReset):
                        stream.error = f"the pod reset the stream ({event.error_code!r})"
                    del self.streams[event.stream_id]
                    stream.done.set()
            self.wire.flush()
        for stream in self.streams.values():
            stream.error = "the pod closed the connection"
            stream.done.set()
        self.streams.clear()


class ClientStream:
    """A client's request stream while it comes, then while it is served."""

    __slots__ = ("headers", "body", "env")

    def __init__(self, headers: Headers) -> None:
        self.headers = headers
        self.body: list[bytes] = []
        self.env: dict[str, Any] = {}


class ClientConnection:
    """One h2c client connection: its reader, and a greenlet per request stream once it is whole."""

    def __init__(self, app: falcon.App, sock: socket.socket, client: tuple[str, int], port: int) -> None:
        self.app = app
        self.client = client
        self.port = port
        self.wire = Wire(sock, client_side=False)
        self.streams: dict[int, ClientStream] = {}

    def run(self) -> None:
        h2conn = self.wire.h2
        streams = self.streams
        h2conn.initiate_connection()
        self.wire.flush()
        while True:
            data = self.wire.sock.recv(RECV_SIZE)
            if not data:
                return
            for event in h2conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    streams[event.stream_id] = ClientStream(list(event.headers))
                elif isinstance(event, h2.events.DataReceived):
                    streams[event.stream_id].body.append(event.data)
                    h2conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    gevent.spawn(self.answer, event.stream_id, streams[event.stream_id])
                elif isinstance(event, h2.events.StreamReset):
                    gone = streams.pop(event.stream_id, None)
                    if gone is not None and CANCEL in gone.env:
                        gone.env[CANCEL]()
                elif isinstance(event, h2.events.ConnectionTerminated):
                    return
            self.wire.flush()

    def answer(self, stream_id: int, stream: ClientStream) -> None:
        """Call the application for one request stream; send its answer."""
        pseudo = dict(h for h in stream.headers if h[0].startswith(b":"))
        lines = [(b"host", pseudo.get(b":authority", b"")), *(h for h in stream.headers if h[0][:1] != b":")]
        request = Request(pseudo[b":method"], pseudo[b":path"], lines, b"".join(stream.body), True)
        env = stream.env = environ(request, self.client, self.port)
        try:
            status, headers, body = call_app(self.app, env)
        finally:
            self.streams.pop(stream_id, None)
        trailers = env.get(TRAILERS)
        fields = [(b":status", status[:3].encode())]
        fields += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]
        h2conn = self.wire.h2
        try:
            h2conn.send_headers(stream_id, fields, end_stream=not body and not trailers)
            if body:
                h2conn.send_data(stream_id, body, end_stream=not trailers)
            if trailers:
                h2conn.send_headers(stream_id, trailers, end_stream=True)
        except h2.exceptions.ProtocolError:  # the client reset the stream meanwhile
            return
        try:
            self.wire.flush()
        except OSError:
            pass  # the client went away; its reader ends the connection


def serve(app: falcon.App, port: int) -> Callable[[socket.socket, tuple[str, int]], None]:
    """The StreamServer's handler: one h2c client connection."""

    def handle(sock: socket.socket, client: tuple[str, int]) -> None:
        try:
            ClientConnection(app, sock, client, port).run()
        except (OSError, h2.exceptions.ProtocolError):
            pass  # the client went away, or broke HTTP/2
        finally:
            sock.close()

    return handle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="HOST:PORT of the pod")
    ap.add_argument("--pod-h2c", action="store_true", help="the pod speaks h2c (prior knowledge), else HTTP/1.1")
    args = ap.parse_args()
    host, _, upstream_port = args.upstream.rpartition(":")
    address = (host, int(upstream_port))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    listener.bind(("127.0.0.1", args.port))  # before the pod connection can take the port as its own
    listener.listen(1024)
    app = make_app(H2Pod(address) if args.pod_h2c else PodPool(address))
    server = StreamServer(listener, serve(app, args.port), spawn=gevent.pool.Pool())
    print(f"READY {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

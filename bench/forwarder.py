"""The minimal forwarder: the ceiling of any proxy on activator's HTTP stack, for the bench.

    python -m bench.forwarder --port N --upstream HOST:PORT

The same stack as activator's engine, with nothing else: ``monkey.patch_all()``, a
gevent ``StreamServer`` on a listener made with TCP_NODELAY (accepted sockets inherit
it), llhttp through httptools on both sides (``bench/http1.py``), a small WSGI environ
handed to a ``falcon.App`` whose one sink forwards, and a LIFO pool of keep-alive
connections to the one upstream. What it forwards: the method, the target as received,
the end-to-end request headers and the body; back: the pod's status, its end-to-end
headers and its body, head and body in one write.

What it leaves out, on purpose (it is a yardstick, not a product): throttling, limits,
timeouts, header fidelity beyond that (repeated response headers collapse into one),
streaming (bodies are buffered; Content-Length or chunked, both ways), retries, error
pages other than Falcon's 500 when the pod hangs up, HEAD and upgrades.
"""

from gevent import monkey

monkey.patch_all()

import argparse
import io
import socket
import sys
from collections.abc import Callable, Iterable
from typing import Any, Protocol
from urllib.parse import unquote_to_bytes

import falcon
import gevent.pool
import httptools
from gevent.server import StreamServer

from bench.http1 import Request, RequestReader, Response, ResponseReader

#: Request headers that describe the client's connection, not the message (RFC 9110
#: 7.6.1), in environ spelling; the body goes on with a length of its own.
HOP_BY_HOP_ENV = frozenset({"CONNECTION", "KEEP_ALIVE", "PROXY_CONNECTION", "TE", "TRAILER", "TRANSFER_ENCODING"})
#: The same for the pod's response headers; Falcon states the length of the body it sends.
HOP_BY_HOP_RESPONSE = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"content-length"}
)

#: Header lines as the sink hands them to the upstream (names lower-case).
Fields = list[tuple[str, str]]

BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class PodConnection:
    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.responses = ResponseReader(self.sock)


class PodPool:
    """Keep-alive connections to the upstream, most recently used first (the likeliest to be open)."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.idle: list[PodConnection] = []

    def forward(self, env: dict[str, Any], method: str, target: str, headers: Fields, body: bytes) -> Response:
        """One request as HTTP/1.1 on a pooled connection; the pod's whole response."""
        lines = [f"{method} {target} HTTP/1.1\r\n", *(f"{name}: {value}\r\n" for name, value in headers)]
        if body:
            lines.append(f"Content-Length: {len(body)}\r\n")
        lines.append("\r\n")
        return self.exchange("".join(lines).encode("latin-1") + body)

    def exchange(self, request: bytes) -> Response:
        conn = self.idle.pop() if self.idle else PodConnection(self.address)
        conn.sock.sendall(request)
        response = conn.responses.next()
        if response is None:
            conn.sock.close()
            raise ConnectionError("the pod closed the connection before a whole response")
        if response.keep_alive:
            self.idle.append(conn)
        else:
            conn.sock.close()
        return response


class Upstream(Protocol):
    """Where the sink sends a request: ``PodPool`` (HTTP/1.1), or ``bench.h2forwarder``'s h2c pod."""

    def forward(self, env: dict[str, Any], method: str, target: str, headers: Fields, body: bytes) -> Response: ...


def make_app(upstream: Upstream) -> falcon.App:
    """The application: every request goes to one sink, which forwards it to the pod.

    ``headers``: the request's end-to-end header lines (lower-case names; ``te`` left out,
    the upstream decides about it from the environ), with the request's body."""

    def forward(req: falcon.Request, resp: falcon.Response, **_: str) -> None:
        env = req.env
        headers = [
            (key[5:].replace("_", "-").lower(), value)
            for key, value in env.items()
            if key.startswith("HTTP_") and key[5:] not in HOP_BY_HOP_ENV
        ]
        if "CONTENT_TYPE" in env:
            headers.append(("content-type", env["CONTENT_TYPE"]))
        body = env["wsgi.input"].read()
        response = upstream.forward(env, env["REQUEST_METHOD"], env["RAW_URI"], headers, body)
        resp.status = response.status
        resp.set_headers(
            [
                (name.decode("latin-1"), value.decode("latin-1"))
                for name, value in response.headers
                if name.lower() not in HOP_BY_HOP_RESPONSE
            ]
        )
        resp.data = response.body

    app = falcon.App(media_type=None)  # type: ignore[call-overload]  # None: no default Content-Type
    app.add_sink(forward, prefix="")  # "" matches every path, "/" would not match "*" or absolute forms
    return app


def environ(request: Request, client: tuple[str, int], port: int) -> dict[str, Any]:
    """The WSGI environ (PEP 3333) of one request; its raw target as ``RAW_URI``, as gunicorn names it."""
    path, _, query = request.target.partition(b"?")
    env: dict[str, Any] = {
        "REQUEST_METHOD": request.method.decode("ascii"),
        "SCRIPT_NAME": "",
        "PATH_INFO": unquote_to_bytes(path).decode("latin-1"),
        "QUERY_STRING": query.decode("latin-1"),
        "RAW_URI": request.target.decode("latin-1"),
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": str(port),
        "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": client[0],
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(request.body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": False,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    if request.body:  # buffered and de-chunked: its length is known now
        env["CONTENT_LENGTH"] = str(len(request.body))
    for name, value in request.headers:
        key = name.decode("latin-1").upper().replace("-", "_")
        if key == "CONTENT_TYPE":
            env[key] = value.decode("latin-1")
        elif key not in ("CONTENT_LENGTH", "TRANSFER_ENCODING"):
            key = "HTTP_" + key
            text = value.decode("latin-1")
            env[key] = f"{env[key]},{text}" if key in env else text
    return env


def call_app(app: falcon.App, env: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
    """Call the application: its status line's text, its header lines and its whole body."""
    answer: list[Any] = []
    body: list[bytes] = []  # what the application writes through start_response's write(), then its iterable

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
        answer[:] = [status, headers]
        return body.append

    chunks: Iterable[bytes] = app(env, start_response)
    try:
        body.extend(chunks)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    return answer[0], answer[1], b"".join(body)


def respond(app: falcon.App, env: dict[str, Any], keep_alive: bool) -> bytes:
    """Call the application; its response as the bytes to send (head and body together)."""
    status, headers, body = call_app(app, env)
    lines = [f"HTTP/1.1 {status}\r\n"]
    lines += [f"{name}: {value}\r\n" for name, value in headers]
    if not keep_alive:
        lines.append("Connection: close\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1") + body


def serve(app: falcon.App, port: int) -> Callable[[socket.socket, tuple[str, int]], None]:
    """The StreamServer's handler: one client connection, its requests one after another."""

    def handle(sock: socket.socket, client: tuple[str, int]) -> None:
        requests = RequestReader(sock)
        try:
            while True:
                request = requests.next()
                if request is None:
                    return
                sock.sendall(respond(app, environ(request, client, port), request.keep_alive))
                if not request.keep_alive:
                    return
        except httptools.HttpParserError:
            sock.sendall(BAD_REQUEST)
        except ConnectionError:
            pass  # the client went away mid-response
        finally:
            sock.close()

    return handle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="HOST:PORT of the pod")
    args = ap.parse_args()
    host, _, upstream_port = args.upstream.rpartition(":")
    app = make_app(PodPool((host, int(upstream_port))))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    listener.bind(("127.0.0.1", args.port))
    listener.listen(1024)
    server = StreamServer(listener, serve(app, args.port), spawn=gevent.pool.Pool())
    print(f"READY {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

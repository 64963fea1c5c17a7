"""A real HTTP "pod" for end-to-end tests, run as a subprocess.

    python tests/backend.py --port N [--host 127.0.0.1] [--fail-health]

It prints ``READY <port>`` on stdout once it listens (``--port 0`` picks a free port and
prints it). What it decides, and its rules:

- It records its OWN concurrency, so a test can prove what the proxy in front of it did:
  ``in_flight`` and ``peak`` of *work* requests, a total ``count``, per-path counts and
  every ``X-Request-Id`` seen. A work request is in flight from the moment its head is
  parsed until its response iterable is closed (the last byte was handed to the kernel,
  or the client went away). Between the last byte written and the decrement there is no
  cooperative yield, so another request can never be counted as overlapping a response
  that was already complete.
- Control endpoints are never counted: ``GET /_stats``, ``POST /_reset``, ``/healthz``,
  ``POST /_health?ok=0|1&hang=0|1``, ``POST /_release?key=K`` (``key=*``: every one).
- The load it announces: ``POST /_load?orca=VALUE`` puts ``endpoint-load-metrics: VALUE``
  (ORCA's header, e.g. ``TEXT cpu_utilization=0.3``) on every work response (empty:
  none); ``POST /_load?gauge=N`` sets the gauge ``pod_queue_length`` that ``GET /metrics``
  (Prometheus text, never counted) shows.
- ``/hold?key=K`` is held until the test releases ``K``: tests that must know exactly
  what runs where (a pod busy until told) need no timing. ``/_stats`` lists the keys held.
- Work endpoints: ``/delay?ms=``, ``/upload``, ``/download?bytes=``, ``/sse?n=&gap_ms=``,
  ``/echo`` (and ``/echo/anything``), ``/status?code=``, ``/hang``, ``/garbage``, ``/reset-mid-body``; any other
  path behaves like ``/delay`` (``ms`` from the query, else 0).
- ``/hang``, ``/garbage`` and ``/reset-mid-body`` (and ``/healthz`` in hang mode) bypass
  WSGI: the handler talks to the raw socket, because their whole point is to break the
  HTTP contract.

Every response made through WSGI carries ``X-Pod: 127.0.0.1:PORT`` so a test can tell
which pod served a request.
"""

from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import argparse
import errno
import hashlib
import http
import json
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import parse_qs

import gevent
import gevent.event
from gevent import pywsgi

StartResponse = Callable[..., Any]
Environ = dict[str, Any]

#: Piece size for streamed bodies, and the deterministic download pattern.
PIECE = 64 * 1024
_PATTERN = bytes(range(251)) * (PIECE // 251 + 2)

CONTROL_PATHS = frozenset({"/_stats", "/_reset", "/healthz", "/_health", "/_release", "/_load", "/metrics"})
RAW_PATHS = frozenset({"/hang", "/garbage", "/reset-mid-body"})


def pattern_bytes(offset: int, size: int) -> bytes:
    """Bytes ``offset .. offset+size`` of the download stream, where byte i is i % 251."""
    start = offset % 251
    return _PATTERN[start : start + size]


def _query(environ: Environ) -> dict[str, str]:
    parsed = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    return {k: v[-1] for k, v in parsed.items()}


def _int(q: dict[str, str], name: str, default: int) -> int:
    try:
        return int(q.get(name, default))
    except ValueError:
        return default


class Stats:
    """The pod's own view of its load. Single-threaded (gevent): no locks, never yields."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.peak = 0
        self.count = 0
        self.paths: dict[str, int] = {}
        self.request_ids: list[str] = []

    def enter(self, path: str, request_id: str | None) -> None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        self.count += 1
        self.paths[path] = self.paths.get(path, 0) + 1
        if request_id is not None:
            self.request_ids.append(request_id)

    def exit(self) -> None:
        self.in_flight -= 1

    def reset(self) -> None:
        # The peak restarts from what is in flight right now, which is 0 when idle.
        self.peak = self.in_flight
        self.count = 0
        self.paths = {}
        self.request_ids = []

    def as_dict(self) -> dict[str, Any]:
        return {
            "in_flight": self.in_flight,
            "peak": self.peak,
            "count": self.count,
            "paths": dict(self.paths),
            "request_ids": list(self.request_ids),
        }


class _Tracked:
    """Wraps a response iterable; leaves the in-flight count once, when closed."""

    def __init__(self, inner: Iterable[bytes], on_close: Callable[[], None]) -> None:
        self._inner = inner
        self._on_close: Callable[[], None] | None = on_close

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._inner)

    def close(self) -> None:
        try:
            close = getattr(self._inner, "close", None)
            if close is not None:
                close()
        finally:
            on_close, self._on_close = self._on_close, None
            if on_close is not None:
                on_close()


class Backend:
    """The WSGI application, plus the raw-socket endpoints the handler calls."""

    def __init__(self, port: int, healthy: bool = True) -> None:
        self.port = port
        self.pod = f"127.0.0.1:{port}"
        self.stats = Stats()
        self.healthy = healthy
        self.health_hang = False
        #: What it announces (``/_load``): the ORCA header's value, and its gauge.
        self.orca = ""
        self.gauge = 0.0
        #: /hold requests waiting for their release, by key (several may share one).
        self.held: dict[str, list[gevent.event.Event]] = {}

    # --- WSGI -------------------------------------------------------------------------

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path in CONTROL_PATHS:
            return self._control(path, environ, start_response)
        self.stats.enter(path, environ.get("HTTP_X_REQUEST_ID"))
        try:
            body = self._work(path, environ, start_response)
        except BaseException:
            self.stats.exit()
            raise
        if environ["REQUEST_METHOD"] == "HEAD":
            # pywsgi would write the body even for HEAD, breaking the connection's framing.
            close = getattr(body, "close", None)
            if close is not None:
                close()
            body = []
        return _Tracked(body, self.stats.exit)

    def _respond(
        self,
        start_response: StartResponse,
        code: int,
        body: bytes,
        content_type: str = "text/plain",
        extra: list[tuple[str, str]] | None = None,
    ) -> list[bytes]:
        headers = [("Content-Type", content_type), ("X-Pod", self.pod)]
        if code not in (204, 304):
            headers.append(("Content-Length", str(len(body))))
        else:
            body = b""
        headers.extend(extra or [])
        if self.orca:
            headers.append(("endpoint-load-metrics", self.orca))
        start_response(_status_line(code), headers)
        return [body]

    def _json(self, start_response: StartResponse, obj: Any, code: int = 200) -> list[bytes]:
        data = json.dumps(obj, sort_keys=True).encode()
        return self._respond(start_response, code, data, "application/json")

    def _control(self, path: str, environ: Environ, start_response: StartResponse) -> list[bytes]:
        q = _query(environ)
        if path == "/_stats":
            held = sorted(key for key, events in self.held.items() for _ in events)
            return self._json(start_response, self.stats.as_dict() | {"healthy": self.healthy, "held": held})
        if path == "/_release":
            key = q.get("key", "*")
            keys = list(self.held) if key == "*" else [key]
            released = 0
            for name in keys:
                for event in self.held.pop(name, []):
                    event.set()
                    released += 1
            return self._json(start_response, {"released": released})
        if path == "/_load":
            if "orca" in q:
                self.orca = q["orca"]
            if "gauge" in q:
                self.gauge = float(q["gauge"])
            return self._json(start_response, {"orca": self.orca, "gauge": self.gauge})
        if path == "/metrics":
            text = f"# HELP pod_queue_length Waiting.\n# TYPE pod_queue_length gauge\npod_queue_length {self.gauge}\n"
            return self._respond(start_response, 200, text.encode(), "text/plain; version=0.0.4")
        if path == "/_reset":
            self.stats.reset()
            return self._json(start_response, self.stats.as_dict())
        if path == "/_health":
            if "ok" in q:
                self.healthy = q["ok"] not in ("0", "false", "")
            if "hang" in q:
                self.health_hang = q["hang"] not in ("0", "false", "")
            return self._json(start_response, {"healthy": self.healthy, "hang": self.health_hang})
        # /healthz (hang mode never reaches WSGI: the handler takes it raw)
        if self.healthy:
            return self._respond(start_response, 200, b"ok\n")
        return self._respond(start_response, 503, b"unhealthy\n")

    def _work(self, path: str, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        q = _query(environ)
        if path == "/upload":
            return self._upload(environ, start_response)
        if path == "/download":
            return self._download(_int(q, "bytes", 0), start_response)
        if path == "/sse":
            return self._sse(_int(q, "n", 5), _int(q, "gap_ms", 100), start_response)
        if path == "/echo" or path.startswith("/echo/"):
            return self._echo(environ, start_response)
        if path == "/hold":
            key = q.get("key", "")
            event = gevent.event.Event()
            self.held.setdefault(key, []).append(event)
            event.wait()
            return self._respond(start_response, 200, f"released {key} on {self.pod}\n".encode())
        if path == "/status":
            code = _int(q, "code", 200)
            return self._respond(start_response, code, f"status {code} from {self.pod}\n".encode())
        ms = _int(q, "ms", 0)
        if ms > 0:
            gevent.sleep(ms / 1000.0)
        body = f"pod {self.pod} path {path} ms {ms}\n".encode()
        return self._respond(start_response, 200, body)

    def _upload(self, environ: Environ, start_response: StartResponse) -> list[bytes]:
        stream = environ["wsgi.input"]
        digest = hashlib.sha256()
        length = 0
        while True:
            piece = stream.read(PIECE)
            if not piece:
                break
            digest.update(piece)
            length += len(piece)
        cl = environ.get("CONTENT_LENGTH")
        return self._json(
            start_response,
            {
                "length": length,
                "sha256": digest.hexdigest(),
                "transfer_encoding": environ.get("HTTP_TRANSFER_ENCODING"),
                "content_length": int(cl) if cl else None,
            },
        )

    def _download(self, size: int, start_response: StartResponse) -> Iterator[bytes]:
        start_response(
            "200 OK",
            [
                ("Content-Type", "application/octet-stream"),
                ("Content-Length", str(size)),
                ("X-Pod", self.pod),
            ],
        )

        def pieces() -> Iterator[bytes]:
            offset = 0
            while offset < size:
                n = min(PIECE, size - offset)
                yield pattern_bytes(offset, n)
                offset += n

        return pieces()

    def _sse(self, n: int, gap_ms: int, start_response: StartResponse) -> Iterator[bytes]:
        # No Content-Length on HTTP/1.1: pywsgi sends it chunked, one chunk per yield.
        start_response(
            "200 OK",
            [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"), ("X-Pod", self.pod)],
        )

        def events() -> Iterator[bytes]:
            for i in range(n):
                if i:
                    gevent.sleep(gap_ms / 1000.0)
                yield f"id: {i}\ndata: event {i} from {self.pod}\n\n".encode()

        return events()

    def _echo(self, environ: Environ, start_response: StartResponse) -> list[bytes]:
        body = environ["wsgi.input"].read()
        raw_headers: list[tuple[str, str]] = environ.get("backend.headers", [])
        headers: dict[str, str] = {}
        for name, value in raw_headers:
            key = name.lower()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        target: str = environ.get("backend.target", environ.get("PATH_INFO", "/"))
        raw_path, _, raw_query = target.partition("?")
        return self._json(
            start_response,
            {
                "method": environ["REQUEST_METHOD"],
                "path": raw_path,
                "query": raw_query,
                "target": target,
                "http_version": environ.get("SERVER_PROTOCOL"),
                "headers": headers,
                "header_list": [[n, v] for n, v in raw_headers],
                "body_length": len(body),
                "body_sha256": hashlib.sha256(body).hexdigest(),
            },
        )

    # --- raw socket endpoints (called by the handler, outside WSGI) --------------------

    def raw(self, path: str, handler: Handler) -> None:
        """Serve a contract-breaking endpoint on the handler's socket. Closes it."""
        if path == "/healthz":  # hang mode: not counted
            _wait_for_peer_close(handler.socket)
            return
        self.stats.enter(path, handler.headers.get("X-Request-Id"))
        try:
            q = _query(handler.environ)
            if path == "/hang":
                _drain_body(handler)
                _wait_for_peer_close(handler.socket)
            elif path == "/garbage":
                _drain_body(handler)
                handler.socket.sendall(b"this is not HTTP at all \x00\xff\r\n\r\n")
                handler.socket.shutdown(socket.SHUT_RDWR)
            elif path == "/reset-mid-body":
                _drain_body(handler)
                sent = _int(q, "bytes", 1000)
                head = b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                head += b"Content-Length: 1000000\r\nX-Pod: " + self.pod.encode() + b"\r\n\r\n"
                handler.socket.sendall(head + pattern_bytes(0, sent))
                # Let the peer read what was sent before the reset discards it.
                gevent.sleep(_int(q, "after_ms", 100) / 1000.0)
                if q.get("hard", "1") != "0":
                    handler.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        finally:
            self.stats.exit()


def _status_line(code: int) -> str:
    try:
        phrase = http.HTTPStatus(code).phrase
    except ValueError:
        phrase = "Unknown"
    return f"{code} {phrase}"


def _drain_body(handler: Handler) -> None:
    try:
        while handler.wsgi_input.read(PIECE):
            pass
    except (OSError, ValueError):
        pass


def _wait_for_peer_close(sock: socket.socket) -> None:
    """Block (cooperatively) until the peer closes or resets the connection."""
    while True:
        try:
            data = sock.recv(1, socket.MSG_PEEK)
        except OSError:
            return
        if not data:
            return
        # The peer sent more (pipelining): we will never answer it, keep waiting.
        gevent.sleep(0.05)


class Handler(pywsgi.WSGIHandler):
    """pywsgi handler that exposes raw headers, and serves the raw endpoints itself."""

    def __init__(self, sock: socket.socket, address: Any, server: Any, rfile: Any = None) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        super().__init__(sock, address, server, rfile)

    def get_environ(self) -> Environ:
        env: Environ = super().get_environ()
        env["backend.headers"] = list(self.headers.items())
        env["backend.target"] = self.path
        return env

    def handle_one_response(self) -> None:
        app: Backend = self.server.application
        path = self.environ.get("PATH_INFO", "/")
        if path == "/healthz" and app.health_hang:
            pass
        elif path not in RAW_PATHS:
            super().handle_one_response()
            return
        self.close_connection = True
        self.status = "000 raw"
        self.response_length = 0
        try:
            app.raw(path, self)
        finally:
            self._close_hard()
            self.time_finish = time.time()

    def _close_hard(self) -> None:
        # The buffered reader holds a reference; the fd (and so the FIN/RST) only goes
        # out when both are closed.
        for closable in (self.rfile, self.socket):
            try:
                closable.close()
            except OSError:
                pass

    def log_request(self) -> None:  # no access log: tests read /_stats instead
        pass


def make_listener(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--fail-health", action="store_true", help="start with /healthz 503")
    args = parser.parse_args(argv)
    try:
        listener = make_listener(args.host, args.port)
    except OSError as exc:
        print(f"backend: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 98 if exc.errno == errno.EADDRINUSE else 1
    port = listener.getsockname()[1]
    app = Backend(port, healthy=not args.fail_health)
    server = pywsgi.WSGIServer(listener, app, handler_class=Handler, log=None)
    server.start()
    print(f"READY {port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

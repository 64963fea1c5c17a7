"""What every pod of ``tests/pods`` shares: its own count of work in progress, and the control port.

Rules:

- :class:`Stats` counts the pod's *work* (a WebSocket connection, a gRPC call, a stream)
  from the moment the pod starts on it until it is over: ``in_flight``, its ``peak``, a
  total ``count`` and the count ``per`` name (a path, a method), in arrival ``order``.
  ``notes`` counts other things the pod saw (an upgrade it refused). Thread-safe: these
  pods serve from threads.
- :func:`serve_control` answers on a second port, never counted: ``GET /_stats`` (the
  stats as JSON), ``POST /_reset``, and ``POST /<action>?key=value`` for the pod's own
  actions (a callable of the query, whose result is answered as JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

HOST = "127.0.0.1"

Action = Callable[[dict[str, str]], Any]


class Stats:
    """The pod's own view of its load (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0
        self.count = 0
        self.per: dict[str, int] = {}
        self.order: list[str] = []
        self.notes: dict[str, int] = {}

    def enter(self, name: str) -> None:
        with self._lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            self.count += 1
            self.per[name] = self.per.get(name, 0) + 1
            self.order.append(name)

    def exit(self) -> None:
        with self._lock:
            self.in_flight -= 1

    @contextlib.contextmanager
    def track(self, name: str) -> Iterator[None]:
        """In flight for the body of the ``with`` block."""
        self.enter(name)
        try:
            yield
        finally:
            self.exit()

    def note(self, name: str) -> None:
        with self._lock:
            self.notes[name] = self.notes.get(name, 0) + 1

    def reset(self) -> None:
        with self._lock:
            self.peak = self.in_flight  # the peak restarts from what is in flight now
            self.count = 0
            self.per = {}
            self.order = []
            self.notes = {}

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "in_flight": self.in_flight,
                "peak": self.peak,
                "count": self.count,
                "per": dict(self.per),
                "order": list(self.order),
                "notes": dict(self.notes),
            }


def serve_control(port: int, stats: Stats, actions: Mapping[str, Action] | None = None) -> int:
    """Serve the control port from a daemon thread; the port it listens on."""
    known = dict(actions or {})

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if urlsplit(self.path).path == "/_stats":
                self._answer(200, stats.as_dict())
            else:
                self._answer(404, {"error": "unknown path"})

        def do_POST(self) -> None:
            parts = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            name = parts.path.lstrip("/")
            if name == "_reset":
                stats.reset()
                self._answer(200, stats.as_dict())
            elif name in known:
                self._answer(200, known[name](query))
            else:
                self._answer(404, {"error": f"unknown action {name}"})

        def _answer(self, code: int, obj: Any) -> None:
            data = json.dumps(obj, sort_keys=True).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read /_stats
            pass

    server = ThreadingHTTPServer((HOST, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="control", daemon=True).start()
    return int(server.server_address[1])


def arguments(description: str) -> argparse.Namespace:
    """The command line every pod takes: ``--port`` and ``--control-port`` (0 picks one)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--control-port", type=int, default=0)
    return parser.parse_args()


def announce(port: int, control_port: int) -> None:
    """The line ``harness.ModulePod`` waits for."""
    print(f"READY {port} {control_port}", flush=True)

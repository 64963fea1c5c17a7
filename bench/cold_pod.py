"""A pod for the cold-start bench: says when it began and when it listens, then answers.

    python bench/cold_pod.py PORT TIMES_FILE

Appends ``exec <wall time>`` as its first act and ``listen <wall time>`` once its socket
listens to TIMES_FILE, then answers every request (``/healthz`` included) 200, a thread
per connection (the prober keeps its connection open), with the standard library only:
its own boot is as short as a Python process can make it, and the bench subtracts it
from what the client saw.
"""

from __future__ import annotations

import time

EXEC = time.time()

import http.server  # noqa: E402  (the clock first: the imports are the pod's own boot)
import sys  # noqa: E402


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    port, times = int(sys.argv[1]), sys.argv[2]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    with open(times, "a") as out:
        out.write(f"exec {EXEC!r}\nlisten {time.time()!r}\n")
    server.serve_forever()


if __name__ == "__main__":
    main()

"""A small HTTP/1.1 load generator: open loop, closed loop, and "hold N connections".

    python -m bench.loadgen open   --port P --rate 1000 --duration 10 [--poisson --seed 1]
                                   [--count N] [--conns 32] [--burst B] --out result.json
    python -m bench.loadgen closed --port P --clients 16 --duration 20 --out result.json
    python -m bench.loadgen hold   --port P --n 10000 --out result.json

Open loop (coordinated-omission safe): request i has a scheduled send time fixed in
advance (every 1/rate s, or Poisson gaps with a seed); it is sent at that time on an
idle keep-alive connection (a new one is opened when none is idle, up to --max-conns),
and its latency is measured from the *scheduled* time, so a slow server makes the
latency grow instead of the rate drop. The send times are kept too ("sent"), so
service latency (from the actual send) is available as well. Two shapes of it:

- one steady connection: ``--conns 1 --max-conns 1``: one request at a time; a request
  whose time has come while the one before is still out is sent when it is answered,
  and its latency still runs from its own scheduled time;
- bursts: ``--burst B`` schedules the requests B at a time, on the same ticks (a tick
  every B/rate s, or Poisson ticks at rate/B); with ``--conns B --max-conns B`` that is
  ``hey -c B -q rate/B``: every tick, each of the B connections sends one request at once.

``--connection-close`` asks for a new connection per request (``Connection: close``),
in either mode.

Closed loop: --clients connections, each sends its next request when the previous
response has arrived, for --duration seconds.

Hold: opens --n connections, sends one request on each and keeps them open (queued
requests), prints ``HELD n`` and waits for SIGTERM (at most 15 minutes).

Keep-alive: a connection the server closes after "Connection: close" is reopened for the
next request. A request that fails on a *reused* connection before a single response
byte arrived (the server closed an idle keep-alive connection as the request went out)
is retried once on a fresh connection, as HTTP clients do for idempotent requests; it
is counted in "retried". Anything else is a failure (status 0).

Timing uses time.monotonic() (system-wide on Linux, so other processes can relate it to
their own events). Waits go through select() on an epoll fd: select() takes a
microsecond timeout where epoll_wait rounds up to milliseconds.

Output (JSON): sched, sent, done (absolute monotonic seconds) and status per request
(0 = failed), retried, errors by kind, connections opened.
"""

from __future__ import annotations

import argparse
import errno
import json
import random
import resource
import select
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

mono = time.monotonic


def raise_nofile() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass


class Conn:
    __slots__ = (
        "buf",
        "chunked",
        "clen",
        "close_after",
        "fd",
        "got_bytes",
        "head_end",
        "req",
        "sock",
        "status",
        "used",
    )

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.buf = bytearray()
        self.req = -1
        self.used = 0
        self.reset()

    def reset(self) -> None:
        self.buf.clear()
        self.head_end = -1
        self.clen = -1
        self.chunked = False
        self.close_after = False
        self.status = 0
        self.got_bytes = False

    def complete(self) -> bool:
        """True once the buffered bytes hold one whole response."""
        buf = self.buf
        if self.head_end < 0:
            i = buf.find(b"\r\n\r\n")
            if i < 0:
                return False
            self.head_end = i + 4
            head = bytes(buf[:i]).decode("latin-1").split("\r\n")
            try:
                self.status = int(head[0].split(" ", 2)[1])
            except (IndexError, ValueError):
                self.status = 0
            http10 = head[0].startswith("HTTP/1.0")
            self.close_after = http10
            for line in head[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    self.clen = int(value.strip())
                elif name == "transfer-encoding":
                    self.chunked = "chunked" in value.lower()
                elif name == "connection":
                    v = value.lower()
                    if "close" in v:
                        self.close_after = True
                    elif "keep-alive" in v:
                        self.close_after = False
            if self.status in (204, 304) or 100 <= self.status < 200:
                self.clen = 0
        if self.clen >= 0:
            return len(buf) >= self.head_end + self.clen
        if self.chunked:
            return buf.endswith(b"0\r\n\r\n") and len(buf) > self.head_end
        return False  # read until close: completed by EOF


class Generator:
    def __init__(self, args: argparse.Namespace) -> None:
        self.addr = (args.host, args.port)
        close = "Connection: close\r\n" if args.connection_close else ""
        self.request = (
            f"{args.method} {args.path} HTTP/1.1\r\nHost: {args.host_header}\r\n"
            f"User-Agent: bench-loadgen\r\n{close}\r\n"
        ).encode()
        self.ep = select.epoll()
        self.conns: dict[int, Conn] = {}
        self.idle: list[Conn] = []
        self.opened = 0
        self.retried = 0
        self.errors: dict[str, int] = {}

    # -- connections ------------------------------------------------------------------

    def connect(self) -> Conn:
        sock = socket.create_connection(self.addr, timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        conn = Conn(sock)
        self.conns[conn.fd] = conn
        self.ep.register(conn.fd, select.EPOLLIN | select.EPOLLRDHUP)
        self.opened += 1
        return conn

    def drop(self, conn: Conn) -> None:
        if self.conns.pop(conn.fd, None) is not None:
            try:
                self.ep.unregister(conn.fd)
            except OSError:
                pass
            conn.sock.close()
        if conn in self.idle:
            self.idle.remove(conn)

    def wait(self, timeout: float) -> list[tuple[int, int]]:
        if timeout > 0:
            select.select([self.ep.fileno()], [], [], timeout)
        return self.ep.poll(0)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def send(self, conn: Conn, req: int) -> bool:
        """Send the request; False when the connection turned out to be dead."""
        conn.reset()
        conn.req = req
        try:
            n = conn.sock.send(self.request)
            if n < len(self.request):
                conn.sock.setblocking(True)
                conn.sock.sendall(self.request[n:])
                conn.sock.setblocking(False)
        except OSError:
            return False
        return True

    def on_readable(self, conn: Conn) -> tuple[str, int]:
        """('done', status) | ('more', 0) | ('retry', 0) | ('fail', 0) | ('idle-closed', 0)."""
        try:
            data = conn.sock.recv(262144)
        except BlockingIOError:
            return "more", 0
        except OSError:
            data = None
        if conn.req < 0:  # an idle connection became readable: the server closed it
            return "idle-closed", 0
        if data:
            conn.got_bytes = True
            conn.buf += data
            if conn.complete():
                return "done", conn.status
            return "more", 0
        # EOF or error
        if conn.head_end >= 0 and conn.clen < 0 and not conn.chunked and data == b"":
            conn.close_after = True
            return "done", conn.status  # read-until-close body
        if not conn.got_bytes and conn.used > 0:
            return "retry", 0
        return "fail", 0

    def endings(self, timeout: float) -> Iterator[tuple[Conn, int, str, int]]:
        """Wait up to ``timeout`` for readable connections; each request that came to an end
        there, as (connection, request, 'done' | 'retry' | 'fail', status), handed over as
        soon as it is read. An idle connection the server closed is dropped."""
        for fd, _ev in self.wait(timeout):
            conn = self.conns.get(fd)
            if conn is None:
                continue
            what, st = self.on_readable(conn)
            if what == "more":
                continue
            if what == "idle-closed":
                self.drop(conn)
                continue
            i = conn.req
            conn.req = -1
            yield conn, i, what, st

    def unfinished(self, done: list[float]) -> None:
        """Requests still without an answer at the end: failed, now."""
        for i in range(len(done)):
            if done[i] == 0.0:
                self.error("unfinished")
                done[i] = mono()


def _schedule(args: argparse.Namespace, n: int, start: float) -> list[float]:
    """The send time of each of the ``n`` requests: every 1/rate s or Poisson gaps, ``--burst`` at a time."""
    rng = random.Random(args.seed)
    sched = []
    t = start
    for i in range(n):
        if i % args.burst:  # the rest of a burst: the same tick
            sched.append(t)
        elif args.poisson:
            t += rng.expovariate(args.rate / args.burst)
            sched.append(t)
        else:
            t = start + i / args.rate
            sched.append(t)
    return sched


class _OpenLoop:
    """The open loop's requests: each sent at its time on an idle connection (a new one up
    to ``max_conns``), a retried one first in line."""

    def __init__(self, g: Generator, n: int, max_conns: int) -> None:
        self.g = g
        self.max_conns = max_conns
        self.sent = [0.0] * n
        self.done = [0.0] * n
        self.status = [0] * n
        self.pending: deque[int] = deque()
        self.finished = 0

    def fail(self, i: int, kind: str) -> None:
        self.g.error(kind)
        self.done[i] = mono()
        self.finished += 1

    def send_pending(self) -> None:
        g, pending = self.g, self.pending
        while pending and (g.idle or len(g.conns) < self.max_conns):
            if g.idle:
                conn = g.idle.pop()
            else:
                try:
                    conn = g.connect()
                except OSError:
                    self.fail(pending.popleft(), "connect")
                    continue
            i = pending.popleft()
            self.sent[i] = mono()
            if not g.send(conn, i):
                g.drop(conn)
                if conn.used > 0:
                    g.retried += 1
                    pending.appendleft(i)
                else:
                    self.fail(i, "send")

    def ended(self, conn: Conn, i: int, what: str, st: int) -> None:
        g = self.g
        if what == "done":
            self.done[i] = mono()
            self.status[i] = st
            self.finished += 1
            conn.used += 1
            if conn.close_after:
                g.drop(conn)
            else:
                g.idle.append(conn)
        elif what == "retry":
            g.drop(conn)
            g.retried += 1
            self.pending.appendleft(i)
        else:
            g.drop(conn)
            self.fail(i, "response")


def run_open(g: Generator, args: argparse.Namespace) -> dict[str, Any]:
    n = args.count if args.count else int(args.rate * args.duration)
    start = mono() + 0.2
    sched = _schedule(args, n, start)
    for _ in range(min(args.conns, args.max_conns)):
        g.idle.append(g.connect())
    loop = _OpenLoop(g, n, args.max_conns)
    nxt = 0
    hard_deadline = (sched[-1] if sched else start) + args.drain
    while loop.finished < n:
        now = mono()
        if now > hard_deadline:
            break
        while nxt < n and sched[nxt] <= now:
            loop.pending.append(nxt)
            nxt += 1
        loop.send_pending()
        timeout = (sched[nxt] - mono()) if nxt < n else 0.05
        if loop.pending and not g.idle and len(g.conns) >= args.max_conns:
            timeout = min(timeout, 0.05)
        for conn, i, what, st in g.endings(min(max(timeout, 0.0), 0.05)):
            loop.ended(conn, i, what, st)
    g.unfinished(loop.done)
    return {"mode": "open", "start": start, "sched": sched, "sent": loop.sent, "done": loop.done, "status": loop.status}


class _ClosedLoop:
    """The closed loop's clients: each sends its next request when the previous response
    has arrived, until ``end``."""

    def __init__(self, g: Generator, end: float) -> None:
        self.g = g
        self.end = end
        self.sent: list[float] = []
        self.done: list[float] = []
        self.status: list[int] = []

    def issue(self, conn: Conn | None, i: int | None = None) -> None:
        """Send request i (a new one when None) on conn (a new connection when None)."""
        g = self.g
        while True:
            if i is None:
                if mono() >= self.end:
                    if conn is not None:
                        g.drop(conn)
                    return
                i = len(self.sent)
                self.sent.append(mono())
                self.done.append(0.0)
                self.status.append(0)
            retried = False
            while True:
                if conn is None:
                    try:
                        conn = g.connect()
                    except OSError:
                        g.error("connect")
                        break
                if g.send(conn, i):
                    return
                reused = conn.used > 0
                g.drop(conn)
                conn = None
                if reused and not retried:
                    g.retried += 1
                    retried = True
                    continue
                g.error("send")
                break
            self.done[i] = mono()  # request i failed; this client goes on with a new one
            i = None
            time.sleep(0.01)

    def ended(self, conn: Conn, i: int, what: str, st: int) -> None:
        g = self.g
        if what == "done":
            self.done[i] = mono()
            self.status[i] = st
            conn.used += 1
            if conn.close_after:
                g.drop(conn)
                self.issue(None)
            else:
                self.issue(conn)
        elif what == "retry":
            g.drop(conn)
            g.retried += 1
            self.issue(None, i)
        else:
            g.drop(conn)
            g.error("response")
            self.done[i] = mono()
            self.issue(None)


def run_closed(g: Generator, args: argparse.Namespace) -> dict[str, Any]:
    start = mono()
    loop = _ClosedLoop(g, start + args.duration)
    for _ in range(args.clients):
        loop.issue(None)
    while g.conns:
        for conn, i, what, st in g.endings(0.05):
            loop.ended(conn, i, what, st)
        if mono() > loop.end + args.drain:
            break
    g.unfinished(loop.done)
    return {
        "mode": "closed",
        "start": start,
        "sched": loop.sent,
        "sent": loop.sent,
        "done": loop.done,
        "status": loop.status,
    }


def run_hold(g: Generator, args: argparse.Namespace) -> dict[str, Any]:
    """Open n connections (at most 256 connecting at once), one request on each."""
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))
    socks: list[socket.socket] = []
    connecting: dict[int, socket.socket] = {}
    ep = select.epoll()
    made = 0
    failed = 0
    t0 = mono()
    while (made < args.n or connecting) and mono() - t0 < args.duration:
        while made < args.n and len(connecting) < 256:
            s = socket.socket()
            s.setblocking(False)
            err = s.connect_ex(g.addr)
            if err not in (0, errno.EINPROGRESS):
                failed += 1
                s.close()
            else:
                connecting[s.fileno()] = s
                ep.register(s.fileno(), select.EPOLLOUT)
            made += 1
        for fd, _ev in ep.poll(0.05):
            s = connecting.pop(fd)
            ep.unregister(fd)
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                failed += 1
                s.close()
                continue
            try:
                s.send(g.request)
            except OSError:
                failed += 1
                s.close()
                continue
            socks.append(s)
    print(f"HELD {len(socks)} failed {failed} in {mono() - t0:.2f}s", flush=True)
    deadline = mono() + 900  # never outlive a crashed bench for long
    while not stop["now"] and mono() < deadline:
        time.sleep(0.1)
    for s in socks:
        s.close()
    return {"mode": "hold", "held": len(socks), "failed": failed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="HTTP/1.1 load generator")
    ap.add_argument("mode", choices=("open", "closed", "hold"))
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--path", default="/")
    ap.add_argument("--method", default="GET")
    ap.add_argument("--host-header", default="bench")
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--count", type=int, default=0)
    ap.add_argument("--poisson", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--burst", type=int, default=1, help="open loop: requests sent together on each tick")
    ap.add_argument("--connection-close", action="store_true", help="a new connection per request")
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--max-conns", type=int, default=900)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--drain", type=float, default=30.0, help="seconds to wait for late responses")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    raise_nofile()
    g = Generator(args)
    if args.mode == "open":
        result = run_open(g, args)
    elif args.mode == "closed":
        result = run_closed(g, args)
    else:
        args.duration = max(args.duration, 120.0)
        result = run_hold(g, args)
    result["retried"] = g.retried
    result["errors"] = g.errors
    result["opened"] = g.opened
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

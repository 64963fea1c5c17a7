"""Micro benchmark: activator.upstream vs plain geventhttpclient HTTPClient.

20k keep-alive GETs against a fast local server (a raw gevent socket server in a
subprocess that answers every request head with a fixed 12-byte response). Two shapes:
one connection with sequential requests (latency: client overhead + round trip), and
50 greenlets sharing one pool. For each client it prints requests/s and the client
process's CPU time per request (the better number on a noisy box: the server's own cost
is not in it). The two processes are pinned to different CPUs when there are two.

    .venv/bin/python bench/upstream_micro.py [--n 20000] [--concurrency 50] [--rounds 3]
"""

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import gevent  # noqa: E402
import gevent.pool  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from geventhttpclient import HTTPClient  # noqa: E402

from activator.upstream import UpstreamPool  # noqa: E402

SERVER = r"""
import os, sys
from gevent import monkey; monkey.patch_all()
import socket, gevent
from gevent.server import StreamServer
if len(os.sched_getaffinity(0)) > 1 and os.cpu_count() >= 2:
    os.sched_setaffinity(0, {1})
RESP = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 12\r\n\r\nhello world\n"
def handle(conn, addr):
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = b""
    while True:
        data = conn.recv(65536)
        if not data:
            return
        buf += data
        n = buf.count(b"\r\n\r\n")
        if n:
            buf = buf[buf.rindex(b"\r\n\r\n") + 4:]
            conn.sendall(RESP * n)
srv = StreamServer(("127.0.0.1", 0), handle, backlog=1024)
srv.start()
print(srv.server_port, flush=True)
gevent.wait()
"""


def run(label, one_request, n, concurrency):
    done = 0

    def worker(count):
        nonlocal done
        for _ in range(count):
            one_request()
            done += 1

    # warm up (connections opened, code paths hot)
    for _ in range(200):
        one_request()
    cpu0, t0 = time.process_time(), time.perf_counter()
    if concurrency == 1:
        worker(n)
    else:
        per = n // concurrency
        gevent.joinall([gevent.spawn(worker, per) for _ in range(concurrency)], raise_error=True)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return done / wall, cpu / done * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        if (os.cpu_count() or 1) >= 2:
            os.sched_setaffinity(0, {0})
        headers = [("Host", f"127.0.0.1:{port}"), ("User-Agent", "bench"), ("Accept", "*/*")]

        def ours_factory():
            pool = UpstreamPool("127.0.0.1", port)

            def one():
                resp = pool.request("GET", "/hello", headers, None, None, connect_timeout=2.0, request_timeout=10.0)
                for _ in resp.chunks():
                    pass
                resp.close()

            return one

        def ghc_factory():
            client = HTTPClient("127.0.0.1", port, concurrency=args.concurrency, block_size=65536)
            hdrs = dict(headers)

            def one():
                resp = client.get("/hello", headers=hdrs)
                resp.read()
                resp.release()

            return one

        results: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for _ in range(args.rounds):
            for conc in (1, args.concurrency):
                for label, factory in (("activator.upstream", ours_factory), ("geventhttpclient", ghc_factory)):
                    results.setdefault((label, conc), []).append(run(label, factory(), args.n, conc))
        print(f"{args.n} keep-alive GETs, 12-byte body, best of {args.rounds} rounds (max rps, min CPU)")
        print(f"{'client':<20} {'conc':>5} {'req/s':>10} {'client CPU us/req':>18}")
        for (label, conc), rs in results.items():
            rps = max(r[0] for r in rs)
            cpu = min(r[1] for r in rs)
            print(f"{label:<20} {conc:>5} {rps:>10,.0f} {cpu:>18.1f}")
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()

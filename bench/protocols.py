"""Protocols: gRPC, WebSocket and HTTP/2 through activator, against direct and HAProxy.

Everything in one run; each comparison runs its targets in interleaved rounds and reports
medians over rounds (full mode), and every ratio is against what the same run measured.
The proxies (activator, HAProxy) on cpu1; the pods and the load generators on cpu0.

(a) gRPC unary saturation: ``h2load`` (nghttp2, C: it needs little of cpu0) sends valid
    gRPC requests (``POST /activator.test.Pod/Unary``, ``content-type: application/grpc``,
    ``te: trailers``, a body of one length-prefixed message from a ``-d`` file), 10
    connections x 10 streams, to the grpcio pod (``tests/pods/grpc_pod.py``, its ``Unary``
    answers the request) directly, through activator (``protocol: h2c``, a high
    ``container_concurrency``, so nothing queues) and through HAProxy (``bind ... proto h2``,
    ``server ... proto h2``). The pod counts the calls its handler ran: a request that was
    not valid gRPC would not reach it, so the count checks the requests. Calls/s and the
    CPU time (user + system, from /proc) of the proxy and of the pod per call.
(b) gRPC added latency at a fixed low rate: an open-loop grpcio client (this module, run
    as ``python -m bench.protocols grpc-open``, one channel) issues a ``Unary`` call every
    1/rate s whether or not the earlier ones were answered; a call's latency runs from its
    scheduled time to its completion callback, and a call that did not end ``OK`` is a
    failure. Added = target - direct, per round, then the median over rounds.
(c) WebSocket echo round trip: one ``websockets`` (asyncio) connection to the echo pod
    (``tests/pods/ws_echo.py``), small binary messages paced one every few ms, each sent
    after the previous echo came back; the time from ``send`` to the echo's ``recv``.
    Direct, through activator (an Upgrade tunnel) and through HAProxy (HTTP mode, which
    tunnels WebSocket).
(d) h2c vs HTTP/1.1 through activator to the same nginx pod (HTTP/1.1 to the pod in
    both): ``h2load -c 50 -m 10`` (h2c, prior knowledge: 500 requests in flight) and
    ``h2load -c 50 -m 1`` (50 in flight, as wrk) against ``wrk -t1 -c50``, req/s and
    activator's CPU per request, and the connections the proxy opened to the pod (nginx's
    ``stub_status`` accepts, before and after each run); HAProxy (an h2 and an HTTP/1.1
    frontend to the same backend) for reference.
(e) Memory: a fresh activator's RSS (``/proc``, the process and its children) before and
    while 500 WebSocket tunnels are open to the echo pod (every one has echoed a message,
    and ``/status`` counts them), delta / tunnels; another fresh activator's RSS before and
    while h2load holds 50 connections x 100 streams (h2c from the client, ``protocol: h2c``
    to the pod) that the pod holds until told to answer (``python -m bench.protocols
    h2-hold-pod``, ``tests/h2_pod.py``'s H2Pod in a process of its own), delta / streams,
    once the pod holds them all and ``/status`` counts them in flight. Each activator first
    opens and closes a few of them, so one-time costs (lazy imports, first allocations) are
    not counted; the RSS once they all closed is shown too.

The clients and the hold pod are this module's own ``main`` (``python -m bench.protocols
grpc-open | ws-echo | ws-hold | h2-hold-pod``): subprocesses on cpu0, so grpcio's threads
and fork handlers never enter the bench process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness

from . import common as c
from .report import Section, Table

GRPC_METHOD = "/activator.test.Pod/Unary"
GRPC_MESSAGE = b"hello"  # the pod's methods take raw bytes (no protobuf)
GRPC_HEADERS = ("content-type: application/grpc", "te: trailers")
#: (a): h2load connections x streams per connection.
GRPC_CONNS, GRPC_STREAMS = 10, 10
#: (b): calls per second of the open-loop client; the calls it makes first, one at a time.
GRPC_RATE = 200
WARM_CALLS = 20
#: (c): message size and the pause between one echo and the next message.
WS_BYTES, WS_INTERVAL = 16, 0.002
#: (e): tunnels held; h2 connections x streams per connection held.
TUNNELS = 500
HOLD_CONNS, HOLD_STREAMS = 50, 100
#: (e): the hold pod's SETTINGS_MAX_CONCURRENT_STREAMS (activator opens a pod connection per that many).
HOLD_POD_STREAMS = 1000

DIRECT = "direct"
ACTIVATOR = "activator"
HAPROXY = "HAProxy"

Endpoint = tuple[str, int, harness.Process]  # (name in the tables, port, the process whose CPU is counted)


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else float("nan")


def _ms3(x: float) -> str:
    """A latency in ms with three decimals (the tables' default of two hides tens of us)."""
    return "n/a" if math.isnan(x) else f"{x:.3f}"


def _signed(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:+.3f}"


# ---------------------------------------------------------------------------------------
# processes


def module_pod(procs: c.Procs, name: str, module: str, *args: str) -> tuple[harness.Process, int, int]:
    """A pod of ``tests/pods`` (``python -m pods.MODULE``) on cpu0; (process, port, control port)."""
    tests = c.ROOT / "tests"
    proc = procs.start(
        name,
        [c.PYTHON, "-m", f"pods.{module}", "--port", "0", "--control-port", "0", *args],
        role="load",
        env={"PYTHONPATH": f"{tests}{os.pathsep}{c.ROOT}"},
    )
    ready = proc.wait_output(r"^READY (\d+) (\d+)$", timeout=30)
    return proc, int(ready.group(1)), int(ready.group(2))


def pod_control(control: int, method: str, path: str) -> Any:
    return harness.json_request(f"{c.LOCALHOST}:{control}", method, path)


def start_activator_over(
    procs: c.Procs, name: str, pod: str, *, cc: int, h2c: bool = False, **service_keys: Any
) -> c.Activator:
    """activator (this tree) with one service over one pod, every host; ``protocol: h2c`` to the
    pod when ``h2c``, and any other keys of the service as given (``common.start_activator``
    without the keys its config builder does not know: ``protocol``, ``client_gone``)."""
    config = c.activator_config({"svc": {"hosts": ["*"], "cc": cc, "queue_depth": 10000, "pods": [pod]}})
    if h2c:
        config["services"]["svc"]["protocol"] = "h2c"
    config["services"]["svc"].update(service_keys)
    build = c.this_tree()
    act = c.Activator(
        config,
        label=build.label,
        workdir=procs.dir / name,
        command=build.cmd,
        env=build.env,
        cwd=build.cwd,
        wrapper=c.pin(procs.ctx, "proxy"),
        ready_timeout=30,
        start=False,
    )
    procs.add(act.start(wait_ready=False).process)
    act.wait_ready()
    return act


def start_haproxy_h2(
    procs: c.Procs, name: str, pod: str, *, frontends: dict[str, bool], pod_h2: bool, maxconn: int = 5000
) -> tuple[harness.Process, dict[str, int]]:
    """HAProxy (``nbthread 1``) with one backend, one server (``proto h2`` when ``pod_h2``,
    ``maxconn`` requests or streams at once), a frontend per name (``proto h2`` when its value
    is true); (process, port per frontend)."""
    haproxy = procs.ctx.tools.get("haproxy")
    if haproxy is None:
        raise RuntimeError("haproxy not available")
    ports = {fe: harness.free_port() for fe in frontends}
    fes = "".join(
        f"frontend {fe}\n  bind 127.0.0.1:{ports[fe]}{' proto h2' if h2 else ''}\n  default_backend be\n"
        for fe, h2 in frontends.items()
    )
    cfg_text = f"""global
  maxconn 9000
  nbthread 1
defaults
  mode http
  timeout connect 2s
  timeout client 120s
  timeout server 300s
  timeout tunnel 300s
  timeout queue 30s
  timeout http-keep-alive 120s
  option http-keep-alive
  http-reuse always
{fes}backend be
  server pod {pod}{" proto h2" if pod_h2 else ""} maxconn {maxconn}
"""
    cfg = procs.dir / f"{name}.cfg"
    harness.write_atomic(cfg, cfg_text)
    check = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True, check=False)
    if check.returncode != 0:
        raise RuntimeError(f"haproxy config invalid: {check.stdout}{check.stderr}")
    proc = procs.start(name, [haproxy, "-db", "-f", str(cfg)], role="proxy")
    for port in ports.values():
        harness.wait_listening(f"{c.LOCALHOST}:{port}", process=proc, timeout=10)
    return proc, ports


def _rss_kib(pid: int) -> int:
    """RSS of a process and its children (workers), KiB."""
    total = 0
    for p in [pid, *c.children_of(pid)]:
        try:
            total += harness.rss_kib(p)
        except harness.HarnessError:
            pass
    return total


def client_cmd(ctx: c.Ctx, args: list[str], rt: bool = False, module: str = "bench.protocols") -> list[str]:
    """A bench module's own clients (this one's: see :func:`main`), on cpu0."""
    return [*c.rt_prefix(ctx, rt), *c.pin(ctx, "load"), c.PYTHON, "-m", module, *args]


def run_client(
    ctx: c.Ctx, args: list[str], timeout: float, rt: bool = False, module: str = "bench.protocols"
) -> dict[str, Any]:
    """Run one client to its end; what it wrote to its ``--out`` file (JSON)."""
    out = ctx.work / f"protocols-{time.monotonic_ns()}.json"
    r = subprocess.run(
        client_cmd(ctx, [*args, "--out", str(out)], rt, module),
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        cwd=str(c.ROOT),
        env=harness.child_env(),
    )
    if r.returncode != 0:
        raise RuntimeError(f"client {args[0]} failed ({r.returncode}): {r.stderr[-2000:]}")
    data: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return data


# ---------------------------------------------------------------------------------------
# h2load


def h2load_path() -> str | None:
    """nghttp2's load generator (Debian: nghttp2-client), if installed."""
    return shutil.which("h2load")


_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def _seconds(text: str) -> float:
    m = re.match(r"([0-9.]+)(us|ms|s|m)$", text)
    return float(m.group(1)) * _UNITS[m.group(2)] if m else float("nan")


def parse_h2load(out: str) -> dict[str, Any]:
    """What an h2load run printed: its duration, the requests done / succeeded / failed, the 2xx,
    the mean time per request (ms), and req/s (succeeded / duration)."""
    res: dict[str, Any] = {"seconds": float("nan"), "done": 0, "ok": 0, "failed": 0, "timeout": 0, "s2xx": 0}
    m = re.search(r"^finished in ([0-9.]+(?:us|ms|s|m)),", out, re.MULTILINE)
    if m:
        res["seconds"] = _seconds(m.group(1))
    m = re.search(
        r"^requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored, "
        r"(\d+) timeout",
        out,
        re.MULTILINE,
    )
    if m:
        res.update(done=int(m.group(3)), ok=int(m.group(4)), failed=int(m.group(5)), timeout=int(m.group(7)))
    m = re.search(r"^status codes: (\d+) 2xx", out, re.MULTILINE)
    if m:
        res["s2xx"] = int(m.group(1))
    m = re.search(r"^time for request:\s+(\S+)\s+(\S+)\s+(\S+)", out, re.MULTILINE)
    res["mean_ms"] = _seconds(m.group(3)) * 1000 if m else float("nan")
    secs = res["seconds"]
    res["rps"] = res["ok"] / secs if secs and not math.isnan(secs) else 0.0
    res["raw"] = out
    return res


def run_h2load(
    ctx: c.Ctx, args: list[str], url: str, seconds: float, cpu_pids: dict[str, int] | None = None
) -> dict[str, Any]:
    """h2load on cpu0; with ``cpu_pids`` (label -> pid), each one's CPU us per succeeded request
    in ``cpu_us[label]``."""
    h2load = h2load_path()
    assert h2load is not None
    pids = cpu_pids or {}
    before = {k: c.cpu_seconds([p]) for k, p in pids.items()}
    r = subprocess.run(
        [*c.pin(ctx, "load"), h2load, *args, url], capture_output=True, text=True, check=False, timeout=seconds + 60
    )
    res = parse_h2load(r.stdout + r.stderr)
    res["cpu_us"] = {
        k: (c.cpu_seconds([p]) - before[k]) / res["ok"] * 1e6 if res["ok"] else float("nan") for k, p in pids.items()
    }
    return res


def grpc_body(path: Path) -> Path:
    """The request body h2load sends: one gRPC message (flag 0, 4-byte big-endian length, bytes)."""
    path.write_bytes(b"\x00" + struct.pack(">I", len(GRPC_MESSAGE)) + GRPC_MESSAGE)
    return path


def grpc_h2load_args(body: Path) -> list[str]:
    return ["-d", str(body), *(x for h in GRPC_HEADERS for x in ("-H", h))]


# ---------------------------------------------------------------------------------------
# the scenario


def run(ctx: c.Ctx) -> Section:
    sec = Section("protocols", "Protocols: gRPC, WebSocket and HTTP/2 through activator")
    missing = [
        what
        for what, ok in (
            ("h2load (nghttp2-client)", h2load_path() is not None),
            ("grpcio", _importable("grpc")),
            ("websockets", _importable("websockets")),
            ("haproxy", ctx.tools.get("haproxy") is not None),
        )
        if not ok
    ]
    for what in missing:
        ctx.note(f"protocols: {what} not available: the parts or rows that need it are left out")
    have_h2load = h2load_path() is not None
    have_grpc = _importable("grpc")
    have_ws = _importable("websockets")
    have_haproxy = ctx.tools.get("haproxy") is not None
    sec.intro = _intro(ctx)
    mem_rows: list[list[Any]] = []
    with c.Procs(ctx, "protocols") as procs:
        if have_grpc:
            body = grpc_body(procs.dir / "unary.grpc")
            grpc_pod, grpc_port, grpc_control = module_pod(procs, "grpc-pod", "grpc_pod")
            act = start_activator_over(procs, "activator-grpc", f"127.0.0.1:{grpc_port}", cc=1000, h2c=True)
            targets: list[Endpoint] = [(DIRECT, grpc_port, grpc_pod), (ACTIVATOR, act.port, act.process)]
            if have_haproxy:
                hap, ports = start_haproxy_h2(
                    procs, "haproxy-grpc", f"127.0.0.1:{grpc_port}", frontends={"fe": True}, pod_h2=True
                )
                targets.append((HAPROXY, ports["fe"], hap))
            if have_h2load:
                _grpc_saturation(ctx, sec, targets, grpc_pod, grpc_control, body)
            grpc_latency(ctx, sec, targets)
            for _, _, proc in reversed(targets):
                procs.stop(proc)
        if have_ws:
            ws_pod, ws_port, _ = module_pod(procs, "ws-pod", "ws_echo")
            act = start_activator_over(procs, "activator-ws", f"127.0.0.1:{ws_port}", cc=1000)
            ws_targets: list[Endpoint] = [(DIRECT, ws_port, ws_pod), (ACTIVATOR, act.port, act.process)]
            if have_haproxy:
                hap, ports = start_haproxy_h2(
                    procs, "haproxy-ws", f"127.0.0.1:{ws_port}", frontends={"fe": False}, pod_h2=False
                )
                ws_targets.append((HAPROXY, ports["fe"], hap))
            _websocket(ctx, sec, ws_targets)
            for _, _, proc in ws_targets[1:]:
                procs.stop(proc)
            mem_rows.append(_tunnel_memory(ctx, procs, sec, ws_port))
            procs.stop(ws_pod)
        if have_h2load:
            _h2c_vs_h1(ctx, procs, sec, have_haproxy)
            mem_rows.append(_stream_memory(ctx, procs, sec))
        if mem_rows:
            sec.tables.append(
                Table(
                    "(e) memory held per open tunnel and per open h2 stream (a fresh activator each; RSS of the "
                    "process, KiB)",
                    [
                        "held",
                        "count (per /status)",
                        "RSS before",
                        "RSS while held",
                        "delta",
                        "KiB per item",
                        "RSS after they closed",
                        "held for",
                    ],
                    mem_rows,
                )
            )
    return sec


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _intro(ctx: c.Ctx) -> str:
    return (
        "Pods: `tests/pods/grpc_pod.py` (grpcio, a 64-thread pool, raw-bytes methods; its `Unary` answers the "
        "request), `tests/pods/ws_echo.py` (python `websockets`, threaded, echoes every message), nginx-light "
        '(`return 200 "hello"`, as in the overhead section, plus `stub_status`), the hold pod of (e). activator: '
        "one service over one pod, `container_concurrency: 1000` (10,000 for the held streams) so nothing "
        "queues, `protocol: h2c` for the gRPC pod and the hold pod, `access_log: false`. HAProxy 2.6: "
        "`nbthread 1`, `http-reuse always`, "
        "`server ... maxconn 5000`, `proto h2` on the frontend's `bind` and on the `server` line for gRPC, HTTP "
        "mode (which tunnels the WebSocket upgrade) for WebSocket. h2load (nghttp2) and the clients of this "
        "module (`python -m bench.protocols grpc-open | ws-echo | ws-hold`) run on cpu0 with the pods, the "
        "proxies on cpu1. "
        f"gRPC request: `POST {GRPC_METHOD}`, `content-type: application/grpc`, `te: trailers`, one "
        f"{len(GRPC_MESSAGE)}-byte message. "
        + (
            "The latency runs ((b), (c)) are made at real-time priority (`chrt -r 1`: pods, proxies and client) "
            "as in the overhead section; they are light."
            if ctx.rt
            else "The latency runs share the CPUs with whatever else runs (no real-time priority)."
        )
    )


# -- (a) gRPC saturation -------------------------------------------------------------------


def _grpc_saturation(
    ctx: c.Ctx,
    sec: Section,
    targets: list[Endpoint],
    pod: harness.Process,
    control: int,
    body: Path,
) -> None:
    seconds, rounds = ctx.dur(5, 1), ctx.n(3, 1)
    args = grpc_h2load_args(body)
    load = ["-c", str(GRPC_CONNS), "-m", str(GRPC_STREAMS)]
    if not ctx.quick:  # warm-up: connections open, code paths hot
        for _name, port, _proc in targets:
            run_h2load(ctx, [*load, "-D", "1", *args], f"http://127.0.0.1:{port}{GRPC_METHOD}", 1)
    results: dict[str, list[dict[str, Any]]] = {}
    for r in range(rounds):
        for name, port, proc in targets:
            if not proc.is_running():
                continue
            c.log(
                f"protocols (a) gRPC unary, h2load -c{GRPC_CONNS} -m{GRPC_STREAMS} {seconds:g}s, {name}, "
                f"round {r + 1}/{rounds}"
            )
            pod_control(control, "POST", "/_reset")
            pids = {"pod": pod.pid} | ({"proxy": proc.pid} if proc is not pod else {})
            res = run_h2load(
                ctx,
                [*load, "-D", str(max(1, round(seconds))), *args],
                f"http://127.0.0.1:{port}{GRPC_METHOD}",
                seconds,
                pids,
            )
            res["pod_calls"] = pod_control(control, "GET", "/_stats")["per"].get("Unary", 0)
            if proc.is_running():
                results.setdefault(name, []).append(res)

    def med(name: str, key: str, sub: str | None = None) -> float:
        return c.median([(x[key][sub] if sub else x[key]) for x in results.get(name, []) if not sub or sub in x[key]])

    direct, hap = med(DIRECT, "rps"), med(HAPROXY, "rps")
    rows = []
    for name, _, _ in targets:
        rs = results.get(name, [])
        rows.append(
            [
                name,
                med(name, "rps"),
                " / ".join(f"{x['rps']:,.0f}" for x in rs),
                med(name, "cpu_us", "proxy") if name != DIRECT else "-",
                med(name, "cpu_us", "pod"),
                _ratio(med(name, "rps"), direct),
                _ratio(med(name, "rps"), hap),
                med(name, "mean_ms"),
                sum(x["ok"] for x in rs),
                sum(x["pod_calls"] for x in rs),
                sum(x["failed"] + x["timeout"] + (x["ok"] - x["s2xx"]) for x in rs),
            ]
        )
    sec.tables.append(
        Table(
            f"(a) gRPC unary calls on one core: h2load -c{GRPC_CONNS} -m{GRPC_STREAMS} (h2c), {seconds:g} s, median "
            f"of {rounds} interleaved round(s); CPU = user + system of that process during the run / calls answered",
            [
                "target",
                "calls/s (median)",
                "rounds",
                "proxy CPU us/call",
                "pod CPU us/call",
                "/ direct",
                "/ HAProxy",
                "h2load mean ms",
                "calls answered",
                "calls the pod ran",
                "errors",
            ],
            rows,
        )
    )
    act, cpu_act, cpu_hap = med(ACTIVATOR, "rps"), med(ACTIVATOR, "cpu_us", "proxy"), med(HAPROXY, "cpu_us", "proxy")
    sec.headline.append(
        f"gRPC unary on one core: activator {act:,.0f} calls/s ({cpu_act:.0f} us CPU per call), "
        f"{_ratio(act, direct):.2f}x direct, {_ratio(act, hap):.2f}x HAProxy h2 ({hap:,.0f} calls/s, "
        f"{cpu_hap:.0f} us per call)"
    )
    sec.notes.append(
        "(a) 'calls the pod ran' is the pod's own count of `Unary` handlers run (at least the calls answered: h2load "
        "stops with some calls in flight): every request h2load sent was a valid gRPC call. h2load does not read "
        "`grpc-status`; (b) makes real grpcio calls through the same proxies and counts any status but OK as a "
        "failure. Direct is bounded by cpu0, where the grpcio pod and h2load share one core."
    )


# -- (b) gRPC latency ----------------------------------------------------------------------


def grpc_latency(ctx: c.Ctx, sec: Section, targets: list[Endpoint]) -> dict[str, dict[str, float]]:
    """(b) for these targets (the first one named ``DIRECT``): its table and headline in ``sec``;
    per target, the added p50 and p99 (ms, nan for direct) and the CPU of its process per
    call answered OK at this rate (``cpu_us``)."""
    seconds, warmup, rounds = ctx.dur(5, 1), ctx.dur(1, 0.5), ctx.n(3, 1)
    runs: dict[str, list[dict[str, Any]]] = {}
    with c.realtime(ctx, [proc.pid for _, _, proc in targets]):
        for r in range(rounds):
            for name, port, proc in targets:
                if not proc.is_running():
                    continue
                c.log(f"protocols (b) gRPC open loop {GRPC_RATE} calls/s, {name}, round {r + 1}/{rounds}")
                cpu0 = c.cpu_seconds([proc.pid])
                res = run_client(
                    ctx,
                    ["grpc-open", "--port", str(port), "--rate", str(GRPC_RATE), "--duration", str(seconds + warmup)],
                    timeout=seconds + warmup + 60,
                    rt=True,
                )
                t0 = res["start"] + warmup
                lat = [
                    (d - s) * 1000
                    for s, d, ok in zip(res["sched"], res["done"], res["ok"], strict=True)
                    if s >= t0 and ok
                ]
                failed = sum(1 for s, ok in zip(res["sched"], res["ok"], strict=True) if s >= t0 and not ok)
                # the client's whole run (its warm-up calls and channel set-up included) / its OK calls
                cpu_us = (c.cpu_seconds([proc.pid]) - cpu0) / max(1, sum(res["ok"]) + WARM_CALLS) * 1e6
                runs.setdefault(name, []).append({"lat": lat, "failed": failed, "late": res["late"], "cpu_us": cpu_us})
                for why, count in res["failures"].items():
                    sec.notes.append(f"(b) {name}, round {r + 1}: {count} call(s) ended {why}")
    direct = runs.get(DIRECT, [])
    added = {
        name: (c.added_ms(rs, direct, 50), c.added_ms(rs, direct, 99))
        for name, rs in runs.items()
        if name != DIRECT and direct and len(rs) == len(direct)
    }
    rows = []
    for name, rs in runs.items():
        a50, a99 = added.get(name, (float("nan"), float("nan")))
        rows.append(
            [
                name,
                sum(len(x["lat"]) for x in rs),
                _ms3(c.median([c.pct(x["lat"], 50) for x in rs])),
                _ms3(c.median([c.pct(x["lat"], 99) for x in rs])),
                _ms3(c.median([c.pct(x["lat"], 99.9) for x in rs])),
                _ms3(max((max(x["lat"], default=float("nan")) for x in rs), default=float("nan"))),
                "-" if name == DIRECT else _signed(a50),
                "-" if name == DIRECT else _signed(a99),
                c.median([x["cpu_us"] for x in rs]),
                sum(x["failed"] for x in rs),
                sum(x["late"] for x in rs),
            ]
        )
    sec.tables.append(
        Table(
            f"(b) gRPC unary latency at {GRPC_RATE} calls/s, open loop (one grpcio channel, latency from the scheduled "
            f"call time to its completion; {rounds} interleaved round(s) of {seconds:g} s after {warmup:g} s warm-up; "
            "ms; percentiles per round, median over rounds; added = target - direct per round)",
            [
                "target",
                "calls",
                "p50",
                "p99",
                "p99.9",
                "max",
                "added p50",
                "added p99",
                "CPU us/call (its process)",
                "failed (not OK)",
                "sent > 1 ms late",
            ],
            rows,
        )
    )
    a50, a99 = added.get(ACTIVATOR, (float("nan"), float("nan")))
    h50, h99 = added.get(HAPROXY, (float("nan"), float("nan")))
    sec.headline.append(
        f"gRPC added latency at {GRPC_RATE} calls/s: activator p50 {_signed(a50)} ms, p99 {_signed(a99)} ms "
        f"(HAProxy p50 {_signed(h50)} ms, p99 {_signed(h99)} ms)"
    )
    nan = float("nan")
    return {
        name: {
            "a50": added.get(name, (nan, nan))[0],
            "a99": added.get(name, (nan, nan))[1],
            "cpu_us": c.median([x["cpu_us"] for x in rs]),
        }
        for name, rs in runs.items()
    }


# -- (c) WebSocket -------------------------------------------------------------------------


def _websocket(ctx: c.Ctx, sec: Section, targets: list[Endpoint]) -> None:
    messages, rounds = ctx.n(1500, 300), ctx.n(3, 1)
    runs: dict[str, list[list[float]]] = {}
    with c.realtime(ctx, [proc.pid for _, _, proc in targets]):
        for r in range(rounds):
            for name, port, proc in targets:
                if not proc.is_running():
                    continue
                c.log(f"protocols (c) WebSocket echo, {messages} messages, {name}, round {r + 1}/{rounds}")
                res = run_client(
                    ctx,
                    ["ws-echo", "--port", str(port), "--messages", str(messages)],
                    timeout=messages * 0.1 + 60,
                    rt=True,
                )
                runs.setdefault(name, []).append([x * 1000 for x in res["rtt"]])
    direct = runs.get(DIRECT, [])

    def added(rs: list[list[float]], p: float) -> float:
        if len(rs) != len(direct):
            return float("nan")
        return c.median([c.pct(x, p) - c.pct(d, p) for x, d in zip(rs, direct, strict=True)])

    rows = []
    result: dict[str, tuple[float, float]] = {}
    for name, rs in runs.items():
        result[name] = (added(rs, 50), added(rs, 99))
        rows.append(
            [
                name,
                sum(len(x) for x in rs),
                _ms3(c.median([c.pct(x, 50) for x in rs])),
                _ms3(c.median([c.pct(x, 99) for x in rs])),
                _ms3(c.median([c.pct(x, 99.9) for x in rs])),
                _ms3(max((max(x, default=float("nan")) for x in rs), default=float("nan"))),
                "-" if name == DIRECT else _signed(result[name][0]),
                "-" if name == DIRECT else _signed(result[name][1]),
            ]
        )
    sec.tables.append(
        Table(
            f"(c) WebSocket echo round trip, one connection, {WS_BYTES}-byte binary messages, the next sent "
            f"{WS_INTERVAL * 1000:g} ms after an echo ({messages} per round, {rounds} interleaved round(s); ms from "
            "send to the echo's receipt; percentiles per round, median over rounds; added = target - direct per "
            "round)",
            ["target", "messages", "p50", "p99", "p99.9", "max", "added p50", "added p99"],
            rows,
        )
    )
    a50, a99 = result.get(ACTIVATOR, (float("nan"), float("nan")))
    h50, h99 = result.get(HAPROXY, (float("nan"), float("nan")))
    sec.headline.append(
        f"WebSocket echo round trip added: activator p50 {_signed(a50)} ms, p99 {_signed(a99)} ms "
        f"(HAProxy p50 {_signed(h50)} ms, p99 {_signed(h99)} ms)"
    )


# -- (d) h2c vs HTTP/1.1 -------------------------------------------------------------------


def _nginx_counted(procs: c.Procs, name: str) -> tuple[harness.Process, int]:
    """nginx-light as ``common.start_nginx`` starts it (``return 200 "hello"``, one worker,
    keep-alive forever), plus ``stub_status`` on ``/_nginx_status``: its ``accepts`` count
    is the connections the proxies opened to the pod."""
    nginx = procs.ctx.tools.get("nginx")
    if nginx is None:
        raise RuntimeError("nginx not available")
    port = harness.free_port()
    prefix = procs.dir / name
    for sub in ("logs", "tmp"):
        (prefix / sub).mkdir(parents=True, exist_ok=True)
    user = "user root;\n" if os.geteuid() == 0 else ""
    temps = "".join(
        f"  {kind}_temp_path {prefix}/tmp/{kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    (prefix / "nginx.conf").write_text(
        f"""{user}worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
worker_rlimit_nofile 65536;
events {{ worker_connections 40000; multi_accept on; }}
http {{
  access_log off;
{temps}  keepalive_requests 100000000;
  keepalive_timeout 600s;
  default_type text/plain;
  server {{
    listen {c.LOCALHOST}:{port} backlog=4096;
    location / {{ return 200 "hello"; }}
    location = /_nginx_status {{ stub_status; }}
  }}
}}
"""
    )
    proc = procs.start(
        name,
        [nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "logs" / "error.log")],
        role="load",
    )
    harness.wait_http(f"{c.LOCALHOST}:{port}", "/", process=proc, timeout=10)
    return proc, port


def _nginx_accepts(port: int) -> int:
    """Connections nginx accepted so far (``stub_status``; the status request's own included)."""
    text = harness.request(f"{c.LOCALHOST}:{port}", "GET", "/_nginx_status").text
    m = re.search(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s*$", text, re.MULTILINE)
    return int(m.group(1)) if m else 0


#: (d): the loads, by name: (client protocol, tool, arguments).
H1_LOAD = "wrk -t1 -c50"
H2_LOADS = {"h2load -c50 -m1": ["-c", "50", "-m", "1"], "h2load -c50 -m10": ["-c", "50", "-m", "10"]}


def _h2c_vs_h1(ctx: c.Ctx, procs: c.Procs, sec: Section, have_haproxy: bool) -> None:
    seconds, rounds = ctx.dur(5, 1), ctx.n(3, 1)
    if ctx.tools.get("nginx") is None:
        sec.notes.append("(d) left out: nginx not available")
        return
    nginx_proc, nginx = _nginx_counted(procs, "nginx")
    act = start_activator_over(procs, "activator-web", f"127.0.0.1:{nginx}", cc=1000)
    # (proxy, load, port, process): activator takes both protocols on one port
    runs: list[tuple[str, str, int, harness.Process]] = [
        (ACTIVATOR, H1_LOAD, act.port, act.process),
        *((ACTIVATOR, load, act.port, act.process) for load in H2_LOADS),
    ]
    hap: harness.Process | None = None
    if have_haproxy:
        hap, ports = start_haproxy_h2(
            procs, "haproxy-web", f"127.0.0.1:{nginx}", frontends={"fe_h2": True, "fe_h1": False}, pod_h2=False
        )
        runs += [(HAPROXY, H1_LOAD, ports["fe_h1"], hap), (HAPROXY, "h2load -c50 -m10", ports["fe_h2"], hap)]

    def once(load: str, port: int, proc: harness.Process, secs: float) -> dict[str, Any]:
        accepts = _nginx_accepts(nginx)
        if load == H1_LOAD:
            w = c.run_wrk(ctx, port, secs, cpu_pids=[proc.pid])
            res = {"rps": w.rps, "cpu_us": w.cpu_us, "errors": w.errors + w.non2xx, "n": w.requests}
        else:
            h = run_h2load(
                ctx,
                [*H2_LOADS[load], "-D", str(max(1, round(secs)))],
                f"http://127.0.0.1:{port}/",
                secs,
                {"p": proc.pid},
            )
            res = {"rps": h["rps"], "cpu_us": h["cpu_us"]["p"], "errors": h["failed"] + h["timeout"], "n": h["ok"]}
        res["pod_conns"] = _nginx_accepts(nginx) - accepts - 1  # less the status request's own
        return res

    if not ctx.quick:  # warm-up
        for _name, load, port, proc in runs:
            once(load, port, proc, 1)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(rounds):
        for name, load, port, proc in runs:
            if not proc.is_running():
                continue
            c.log(f"protocols (d) saturation, {load} {seconds:g}s, {name}, round {r + 1}/{rounds}")
            res = once(load, port, proc, seconds)
            if proc.is_running():
                results.setdefault((name, load), []).append(res)

    def med(key: tuple[str, str], attr: str) -> float:
        return c.median([x[attr] for x in results.get(key, [])])

    rows = []
    for name, load, _, _ in runs:
        key, base = (name, load), (name, H1_LOAD)
        rs = results.get(key, [])
        served = sum(x["n"] for x in rs)
        rows.append(
            [
                name,
                "HTTP/1.1" if load == H1_LOAD else "h2c",
                load,
                med(key, "rps"),
                " / ".join(f"{x['rps']:,.0f}" for x in rs),
                med(key, "cpu_us"),
                _ratio(med(key, "rps"), med(base, "rps")),
                _ratio(med(key, "cpu_us"), med(base, "cpu_us")),
                sum(x["pod_conns"] for x in rs),
                _ratio(sum(x["pod_conns"] for x in rs) * 1000, served),
                sum(x["errors"] for x in rs),
            ]
        )
    sec.tables.append(
        Table(
            f"(d) h2c vs HTTP/1.1 from the client, HTTP/1.1 to the same nginx pod, the proxy on one core ({seconds:g} "
            f"s, median of {rounds} interleaved round(s)); pod connections = what nginx accepted during the runs",
            [
                "proxy",
                "client protocol",
                "load",
                "req/s (median)",
                "rounds",
                "CPU us/req",
                "/ its HTTP/1.1 req/s",
                "/ its HTTP/1.1 CPU",
                "pod connections opened",
                "per 1,000 requests",
                "errors",
            ],
            rows,
        )
    )
    h1k, h2k = (ACTIVATOR, H1_LOAD), (ACTIVATOR, "h2load -c50 -m10")
    h2, h1 = med(h2k, "rps"), med(h1k, "rps")
    sec.headline.append(
        f"activator h2c (h2load -c50 -m10) / HTTP/1.1 (wrk -c50) saturation, nginx pod: {_ratio(h2, h1):.2f}x "
        f"({h2:,.0f} vs {h1:,.0f} req/s; CPU {med(h2k, 'cpu_us'):.0f} vs {med(h1k, 'cpu_us'):.0f} us/req; "
        f"h2c -m1, the same 50 in flight as wrk: {med((ACTIVATOR, 'h2load -c50 -m1'), 'cpu_us'):.0f} us/req)"
        + (
            f"; HAProxy {_ratio(med((HAPROXY, 'h2load -c50 -m10'), 'rps'), med((HAPROXY, H1_LOAD), 'rps')):.2f}x"
            if have_haproxy
            else ""
        )
    )
    sec.notes.append(
        "(d) `h2load -c50 -m10` keeps 500 requests in flight (`wrk -c50` and `h2load -c50 -m1`: 50). activator "
        "speaks HTTP/1.1 to the pod, one connection per request in flight, and keeps at most 64 idle connections "
        "per pod (`UpstreamPool(max_idle=64)`, `activator/pods/clients.py`): with more requests than that in flight to "
        "one pod, the connections above 64 are closed after their response and new ones opened, which the 'pod "
        "connections opened' column counts. The -m1 row is the protocol's own cost at the same concurrency."
    )
    procs.stop(act.process)
    if hap is not None:
        procs.stop(hap)
    procs.stop(nginx_proc)


# -- (e) memory ----------------------------------------------------------------------------


def _service_status(act: c.Activator) -> dict[str, Any]:
    svc: dict[str, Any] = act.status()["services"]["svc"]
    return svc


def _tunnel_memory(ctx: c.Ctx, procs: c.Procs, sec: Section, ws_port: int) -> list[Any]:
    act = start_activator_over(procs, "activator-tunnels", f"127.0.0.1:{ws_port}", cc=TUNNELS * 2)
    # warm-up: a few tunnels opened, used and closed
    warm = procs.start("ws-warm", client_cmd(ctx, ["ws-hold", "--port", str(act.port), "--connections", "20"]))
    warm.wait_output(r"^HELD", timeout=60)
    procs.stop(warm)
    act.wait_idle()
    time.sleep(0.3)
    before = _rss_kib(act.pid)
    c.log(f"protocols (e) opening {TUNNELS} WebSocket tunnels through activator")
    t0 = time.monotonic()
    holder = procs.start(
        "ws-hold", client_cmd(ctx, ["ws-hold", "--port", str(act.port), "--connections", str(TUNNELS)])
    )
    m = holder.wait_output(r"^HELD (\d+) (\d+)$", timeout=120)
    opened, failed = int(m.group(1)), int(m.group(2))
    time.sleep(0.5)
    svc = _service_status(act)
    held = _rss_kib(act.pid)
    held_for = time.monotonic() - t0
    procs.stop(holder)
    act.wait_idle(timeout=60)
    time.sleep(0.3)
    after = _rss_kib(act.pid)
    procs.stop(act.process)
    counted = svc.get("tunnels", svc.get("in_flight"))
    per = (held - before) / opened if opened else float("nan")
    sec.headline.append(f"memory per open WebSocket tunnel (activator RSS): {per:.1f} KiB ({opened} tunnels)")
    if failed:
        sec.notes.append(f"(e) {failed} of {TUNNELS} WebSocket connections failed to open or echo")
    return [
        f"WebSocket tunnels ({opened} opened, {failed} failed)",
        counted,
        before,
        held,
        held - before,
        per,
        after,
        f"{held_for:.1f} s",
    ]


def _stream_memory(ctx: c.Ctx, procs: c.Procs, sec: Section) -> list[Any]:
    h2load = h2load_path()
    assert h2load is not None
    total = HOLD_CONNS * HOLD_STREAMS
    pod = procs.start("h2-hold-pod", client_cmd(ctx, ["h2-hold-pod", "--max-streams", str(HOLD_POD_STREAMS)]))
    pod_port = int(pod.wait_output(r"^READY (\d+)$", timeout=30).group(1))
    act = start_activator_over(procs, "activator-streams", f"127.0.0.1:{pod_port}", cc=total * 2, h2c=True)

    def hold(name: str, conns: int, streams: int) -> harness.Process:
        return procs.start(
            name,
            [h2load, "-n", str(conns * streams), "-c", str(conns), "-m", str(streams), f"http://127.0.0.1:{act.port}/"],
            role="load",
        )

    def in_flight(n: int) -> None:
        pod.wait_output(rf"^HELD {n}$", timeout=120)  # the pod holds them all
        act.wait_for(lambda st: st["services"]["svc"]["in_flight"] >= n, timeout=30, message=f"{n} streams in flight")

    def release(proc: harness.Process) -> dict[str, Any]:
        pod.signal(signal.SIGUSR1)  # the pod answers every stream it holds, and any that comes
        procs.finish(proc, timeout=120)
        pod.signal(signal.SIGUSR2)  # and holds them again
        return parse_h2load(proc.stdout_text())

    # warm-up: a few connections and streams held and released
    warm = hold("h2load-warm", 5, 20)
    in_flight(100)
    release(warm)
    act.wait_idle(timeout=60)
    time.sleep(0.3)
    before = _rss_kib(act.pid)
    c.log(f"protocols (e) holding {HOLD_CONNS} h2 connections x {HOLD_STREAMS} streams through activator")
    t0 = time.monotonic()
    holder = hold("h2load-hold", HOLD_CONNS, HOLD_STREAMS)
    in_flight(total)
    time.sleep(0.3)
    svc = _service_status(act)
    held = _rss_kib(act.pid)
    held_for = time.monotonic() - t0
    res = release(holder)
    act.wait_idle(timeout=60)
    time.sleep(0.3)
    after = _rss_kib(act.pid)
    procs.stop(act.process)
    procs.stop(pod)
    per = (held - before) / total
    sec.headline.append(
        f"memory per open h2 stream (h2c both sides, held by the pod; activator RSS): {per:.1f} KiB "
        f"({HOLD_CONNS} connections x {HOLD_STREAMS} streams)"
    )
    if res["ok"] != total:
        sec.notes.append(f"(e) of the {total} held streams, {res['ok']} were answered 2xx once released")
    sec.notes.append(
        "(e) per item = (RSS while held - RSS before) / items: what each open tunnel or stream costs activator "
        "(both sockets of a tunnel; the client stream, the pod stream and their greenlets for an h2 stream). "
        "'After' shows how much the process keeps once they closed (CPython and the C allocator keep freed "
        f"memory for reuse). The h2 streams are held by a pod of this module (`python -m bench.protocols "
        f"h2-hold-pod`: `tests/h2_pod.py`'s H2Pod, h2c, `SETTINGS_MAX_CONCURRENT_STREAMS` {HOLD_POD_STREAMS}, "
        "so activator opens a pod connection per that many streams), which answers all of them when signalled; "
        "the grpcio pod is not used for this, its 64 threads run 64 calls at a time and it cancels some of the "
        "queued ones after about a second."
    )
    return [
        f"h2 streams ({HOLD_CONNS} client connections x {HOLD_STREAMS}; {res['ok']} answered 2xx once released)",
        svc.get("in_flight"),
        before,
        held,
        held - before,
        per,
        after,
        f"{held_for:.1f} s",
    ]


def _h2_hold_pod(args: argparse.Namespace) -> None:
    """An h2c pod that holds every request stream while closed (its start, and after SIGUSR2)
    and answers them all (``200``, 4 bytes) once opened (SIGUSR1), and every stream that comes
    while open at once. Prints ``READY <port>``, then ``HELD <n>`` each time the streams it
    holds reach a multiple of 100."""
    import gevent
    import gevent.event
    from h2_pod import H2Pod, PodRequest

    gate = [gevent.event.Event()]
    held = [0]

    def handler(request: PodRequest) -> None:
        if not gate[0].is_set():
            held[0] += 1
            if held[0] % 100 == 0:
                print(f"HELD {held[0]}", flush=True)
            gate[0].wait()
            held[0] -= 1
        request.respond(200, [(b"content-type", b"text/plain"), (b"content-length", b"4")])
        request.send(b"held", end=True)

    def close_gate() -> None:
        if gate[0].is_set():
            gate[0] = gevent.event.Event()

    pod = H2Pod(handler, max_concurrent_streams=args.max_streams)
    gevent.signal_handler(signal.SIGUSR1, lambda: gate[0].set())
    gevent.signal_handler(signal.SIGUSR2, close_gate)
    print(f"READY {pod.port}", flush=True)
    gevent.wait()


# ---------------------------------------------------------------------------------------
# the clients: ``python -m bench.protocols grpc-open | ws-echo | ws-hold`` (subprocesses on
# cpu0: grpcio's threads and fork handlers stay out of the bench process)


def _grpc_open(args: argparse.Namespace) -> dict[str, Any]:
    """Open loop: a ``Unary`` call every 1/rate s on one channel, each from its scheduled time
    (perf_counter seconds) to its completion callback."""
    import threading

    import grpc  # type: ignore[import-untyped]

    channel = grpc.insecure_channel(
        f"127.0.0.1:{args.port}",
        options=[("grpc.enable_http_proxy", 0), ("grpc.enable_retries", 0), ("grpc.default_authority", "bench")],
    )
    unary = channel.unary_unary(GRPC_METHOD)
    grpc.channel_ready_future(channel).result(timeout=10)
    for _ in range(WARM_CALLS):
        unary(GRPC_MESSAGE, timeout=10)
    n = max(1, int(args.rate * args.duration))
    interval = 1.0 / args.rate
    done = [float("nan")] * n
    ok = [False] * n
    left = [n]
    lock = threading.Lock()
    finished = threading.Event()

    failures: dict[str, int] = {}  # "CODE: details" of the calls that did not end OK

    def callback(i: int, fut: Any) -> None:
        done[i] = time.perf_counter()
        code = fut.code()
        ok[i] = code == grpc.StatusCode.OK
        with lock:
            if not ok[i]:
                failures[f"{code.name}: {fut.details()}"] = failures.get(f"{code.name}: {fut.details()}", 0) + 1
            left[0] -= 1
            if not left[0]:
                finished.set()

    start = time.perf_counter() + 0.05
    sched = [start + i * interval for i in range(n)]
    late = 0
    futures = []
    for i, t in enumerate(sched):
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        elif delay < -0.001:
            late += 1
        fut = unary.future(GRPC_MESSAGE, timeout=30)
        fut.add_done_callback(lambda f, i=i: callback(i, f))
        futures.append(fut)
    finished.wait(60)
    channel.close()
    return {"start": start, "sched": sched, "done": done, "ok": ok, "late": late, "failures": failures}


async def _ws_echo(args: argparse.Namespace) -> dict[str, Any]:
    import asyncio

    from websockets.asyncio.client import connect

    message = b"x" * WS_BYTES
    rtt: list[float] = []
    async with connect(f"ws://127.0.0.1:{args.port}/echo", compression=None, ping_interval=None, max_size=None) as ws:
        for _ in range(50):
            await ws.send(message)
            await ws.recv()
        for _ in range(args.messages):
            await asyncio.sleep(WS_INTERVAL)
            t = time.perf_counter()
            await ws.send(message)
            got = await ws.recv()
            rtt.append(time.perf_counter() - t)
            if got != message:
                raise RuntimeError(f"echo mismatch: {got!r}")
    return {"rtt": rtt}


async def _ws_hold(args: argparse.Namespace) -> None:
    """Open ``--connections`` WebSockets (50 handshakes at a time), each echoes one message;
    print ``HELD <open> <failed>``, hold them until SIGTERM, then close them."""
    import asyncio
    import signal

    from websockets.asyncio.client import connect

    gate = asyncio.Semaphore(50)
    conns: list[Any] = []
    failed = 0

    async def one(i: int) -> None:
        nonlocal failed
        async with gate:
            try:
                ws = await connect(
                    f"ws://127.0.0.1:{args.port}/hold", compression=None, ping_interval=None, open_timeout=30
                )
                await ws.send(b"%d" % i)
                await asyncio.wait_for(ws.recv(), 30)
                conns.append(ws)
            except Exception as exc:  # counted and shown: the bench reports it
                failed += 1
                print(f"connection {i}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    await asyncio.gather(*(one(i) for i in range(args.connections)))
    print(f"HELD {len(conns)} {failed}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await asyncio.gather(*(ws.close() for ws in conns), return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    import asyncio

    ap = argparse.ArgumentParser(prog="python -m bench.protocols", description="the protocols scenario's clients")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grpc-open")
    g.add_argument("--port", type=int, required=True)
    g.add_argument("--rate", type=float, default=GRPC_RATE)
    g.add_argument("--duration", type=float, default=2.0)
    g.add_argument("--out", required=True)
    e = sub.add_parser("ws-echo")
    e.add_argument("--port", type=int, required=True)
    e.add_argument("--messages", type=int, default=1000)
    e.add_argument("--out", required=True)
    h = sub.add_parser("ws-hold")
    h.add_argument("--port", type=int, required=True)
    h.add_argument("--connections", type=int, default=TUNNELS)
    pod = sub.add_parser("h2-hold-pod")
    pod.add_argument("--max-streams", type=int, default=HOLD_POD_STREAMS)
    args = ap.parse_args(argv)
    if args.cmd == "h2-hold-pod":
        _h2_hold_pod(args)
        return 0
    if args.cmd == "ws-hold":
        asyncio.run(_ws_hold(args))
        return 0
    result = _grpc_open(args) if args.cmd == "grpc-open" else asyncio.run(_ws_echo(args))
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

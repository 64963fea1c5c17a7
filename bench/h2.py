"""HTTP/2 and gRPC against their floor (issue 24): activator beside a minimal h2 forwarder.

Everything in one run (the machine's speed varies between sessions; only the ratios of one
run count); each comparison runs its targets in interleaved rounds and reports medians over
rounds. The proxies on cpu1; the pods, h2load, wrk and the Python clients on cpu0.

(a) CPU per request on one core, closed loop: the proxy's user + system CPU over the run
    (``/proc/PID/stat``) / requests answered. HTTP/1.1 through activator (``wrk -t1 -c50``,
    nginx pod), the HTTP/1.1 forwarder beside it; h2c from the client (``h2load -c50 -m10``
    and ``-m1``) to an HTTP/1.1 pod (the same nginx) and to an h2c pod (nginx, ``listen ...
    http2``, prior knowledge); a gRPC unary call (``h2load`` sending valid gRPC requests as
    in the protocols scenario, ``tests/pods/grpc_pod.py`` behind, ``protocol: h2c``).
    Each through activator, through the minimal h2 forwarder (``bench/h2forwarder.py``: the
    same stack, ``h2`` used plainly, no throttling) and through HAProxy for reference.
(b) gRPC added latency at 200 calls/s (a grpcio client, open loop, one channel:
    ``protocols.grpc_latency``): direct, activator, the forwarder, HAProxy; with the CPU
    of each per call at that rate.
(c) Where the time goes: ``py-spy record`` of activator and of the forwarder under
    ``h2load -c50 -m10`` to the h2c pod, the busy samples by package of the running frame
    (``h2``, ``hpack``, ``hyperframe``, activator's modules, gevent, falcon, the rest).
(d) What ``h2`` itself costs per exchange: an in-memory pair of ``H2Connection`` (no
    sockets; ``python -m bench.h2 h2-exchange``, on cpu0), the server role (what
    activator's client side does for a stream: take the request, send the answer) and the
    client role (its pod side: send the request, take the answer), with ``h2``'s default
    configuration and with activator's, for a GET answered with 5 bytes and for a gRPC
    unary call (headers, message, trailers).
(e) Cancels: a call that runs on a ``container_concurrency: 1`` pod with the next call
    queued behind it; the client cancels the running one (gRPC: the future's ``cancel``,
    an RST_STREAM; HTTP/1.1: the client closes its connection). The pod (this module's,
    ``python -m bench.h2 cancel-pod-grpc | cancel-pod-h1``) stamps, on the machine's
    monotonic clock, when the call arrived, when it saw the cancel (gRPC: the call's
    termination callback; HTTP/1.1: its connection read EOF) and when the next call
    arrived; the client stamps its cancel. Per trial: cancel -> pod saw it, cancel -> next
    call at the pod. gRPC through activator (h2c pod), the h2 forwarder (no slots: only the
    first figure), HAProxy (``maxconn 1``) and direct; HTTP/1.1 through activator with
    ``client_gone: cancel`` and with ``finish`` (the pod then answers after its hold time,
    ``H1_HOLD``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness

from . import common as c
from . import profile
from . import protocols as pr
from .report import Section, Table, Target

GROUP = "issue 24"
ACTIVATOR, FORWARDER, HAPROXY, DIRECT = pr.ACTIVATOR, "h2 forwarder", pr.HAPROXY, pr.DIRECT
H1_FORWARDER = "HTTP/1.1 forwarder"
#: The loads of (a), by name: the tool and its arguments (h2load's URL and -D added per run).
WRK = "wrk -t1 -c50"
H2_M10, H2_M1 = "h2load -c50 -m10", "h2load -c50 -m1"
GRPC_LOAD = f"h2load -c{pr.GRPC_CONNS} -m{pr.GRPC_STREAMS} (gRPC)"
H2_ARGS = {H2_M10: ["-c", "50", "-m", "10"], H2_M1: ["-c", "50", "-m", "1"]}
#: The pods of (a).
POD_H1, POD_H2C, POD_GRPC = "nginx, HTTP/1.1", "nginx, h2c", "grpcio"
#: (e): how long a held call lasts when nothing cancels it (gRPC; HTTP/1.1), and how long
#: the next call is left to queue before the cancel.
GRPC_HOLD, H1_HOLD, QUEUED_WAIT = 2.0, 0.3, 0.02
CANCEL_SERVICE = "bench.Cancel"

Run = tuple[str, str, str, int, Any]  # (proxy, pod, load, port, process)


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else float("nan")


def _x(a: float, b: float) -> str:
    return f"{_ratio(a, b):.2f}x"


def run(ctx: c.Ctx) -> Section:
    sec = Section("h2", "HTTP/2 and gRPC against their floor (issue 24): activator, a minimal h2 forwarder, HAProxy")
    if pr.h2load_path() is None or importlib.util.find_spec("grpc") is None or ctx.tools.get("nginx") is None:
        sec.notes.append("left out: it needs h2load (nghttp2-client), grpcio and nginx")
        return sec
    have_haproxy = ctx.tools.get("haproxy") is not None and not ctx.quick
    sec.intro = _intro(ctx, have_haproxy)
    with c.Procs(ctx, "h2") as procs:
        cpu = _cpu_per_request(ctx, procs, sec, have_haproxy)
        _where_the_time_goes(ctx, procs, sec)
    _h2_costs(ctx, sec, cpu)
    with c.Procs(ctx, "h2-cancel") as procs:
        _cancels(ctx, procs, sec, have_haproxy)
    return sec


def _intro(ctx: c.Ctx, have_haproxy: bool) -> str:
    return (
        "activator: one service over one pod, `container_concurrency: 1000` (nothing queues), `protocol: h2c` for "
        "the h2c and gRPC pods, `access_log: false`. The h2 forwarder: `bench/h2forwarder.py`, h2c clients, "
        "`h2` with its default configuration, a greenlet per request stream, the HTTP/1.1 forwarder's Falcon sink "
        "and environ, and behind it that forwarder's keep-alive pool or one h2c connection to the pod; no "
        "throttling, no limits, buffered bodies. "
        + (
            "HAProxy 2.6 (`nbthread 1`, `proto h2` on the frontend, and on the server line for the h2c pods) for "
            "reference. "
            if have_haproxy
            else "HAProxy left out (quick run, or not installed). "
        )
        + 'nginx-light: `return 200 "hello"` (5 bytes), one worker; the h2c one with `http2_max_concurrent_streams '
        "1000`. The ratios are of this run only: this machine's speed varied 2-5x between sessions."
    )


# -- (a) CPU per request ---------------------------------------------------------------------


def _cpu_per_request(ctx: c.Ctx, procs: c.Procs, sec: Section, have_haproxy: bool) -> dict[str, float]:
    seconds, rounds = ctx.dur(5, 1), ctx.n(3, 1)
    nginx_proc, nginx = c.start_nginx(procs, "nginx")
    _, nginx_h2c = c.start_nginx(procs, "nginx-h2c", h2c=True)
    grpc_pod, grpc_port, grpc_control = pr.module_pod(procs, "grpc-pod", "grpc_pod")
    pods = {POD_H1: (nginx, False), POD_H2C: (nginx_h2c, True), POD_GRPC: (grpc_port, True)}
    acts = {
        pod: pr.start_activator_over(procs, f"activator-{i}", f"127.0.0.1:{port}", cc=1000, h2c=h2c)
        for i, (pod, (port, h2c)) in enumerate(pods.items())
    }
    fwds = {
        pod: c.start_h2_forwarder(procs, port, f"h2-forwarder-{i}", pod_h2c=h2c)
        for i, (pod, (port, h2c)) in enumerate(pods.items())
    }
    h1_fwd, h1_fwd_port = c.start_forwarder(procs, nginx)
    body = pr.grpc_body(procs.dir / "unary.grpc")
    runs: list[Run] = [
        (ACTIVATOR, POD_H1, WRK, acts[POD_H1].port, acts[POD_H1].process),
        (H1_FORWARDER, POD_H1, WRK, h1_fwd_port, h1_fwd),
    ]
    h2_loads = [H2_M10, H2_M1] if not ctx.quick else [H2_M10]
    for pod in (POD_H1, POD_H2C):
        for load in h2_loads:
            runs.append((ACTIVATOR, pod, load, acts[pod].port, acts[pod].process))
            runs.append((FORWARDER, pod, load, fwds[pod][1], fwds[pod][0]))
    runs += [
        (ACTIVATOR, POD_GRPC, GRPC_LOAD, acts[POD_GRPC].port, acts[POD_GRPC].process),
        (FORWARDER, POD_GRPC, GRPC_LOAD, fwds[POD_GRPC][1], fwds[POD_GRPC][0]),
        (DIRECT, POD_GRPC, GRPC_LOAD, grpc_port, grpc_pod),
    ]
    latency_targets: list[pr.Endpoint] = [
        (DIRECT, grpc_port, grpc_pod),
        (ACTIVATOR, acts[POD_GRPC].port, acts[POD_GRPC].process),
        (FORWARDER, fwds[POD_GRPC][1], fwds[POD_GRPC][0]),
    ]
    if have_haproxy:
        hap_h1, ports_h1 = pr.start_haproxy_h2(
            procs, "haproxy-nginx", f"127.0.0.1:{nginx}", frontends={"fe_h2": True, "fe_h1": False}, pod_h2=False
        )
        hap_h2c, ports_h2c = pr.start_haproxy_h2(
            procs, "haproxy-h2c", f"127.0.0.1:{nginx_h2c}", frontends={"fe": True}, pod_h2=True
        )
        hap_grpc, ports_grpc = pr.start_haproxy_h2(
            procs, "haproxy-grpc", f"127.0.0.1:{grpc_port}", frontends={"fe": True}, pod_h2=True
        )
        runs += [
            (HAPROXY, POD_H1, WRK, ports_h1["fe_h1"], hap_h1),
            (HAPROXY, POD_H1, H2_M10, ports_h1["fe_h2"], hap_h1),
            (HAPROXY, POD_H2C, H2_M10, ports_h2c["fe"], hap_h2c),
            (HAPROXY, POD_GRPC, GRPC_LOAD, ports_grpc["fe"], hap_grpc),
        ]
        latency_targets.append((HAPROXY, ports_grpc["fe"], hap_grpc))

    def once(load: str, port: int, proc: harness.Process, secs: float) -> dict[str, Any]:
        if load == WRK:
            w = c.run_wrk(ctx, port, secs, cpu_pids=[proc.pid])
            return {"rps": w.rps, "cpu_us": w.cpu_us, "errors": w.errors + w.non2xx, "n": w.requests}
        if load == GRPC_LOAD:
            args, url = (
                ["-c", str(pr.GRPC_CONNS), "-m", str(pr.GRPC_STREAMS), *pr.grpc_h2load_args(body)],
                pr.GRPC_METHOD,
            )
        else:
            args, url = H2_ARGS[load], "/"
        h = pr.run_h2load(
            ctx, [*args, "-D", str(max(1, round(secs)))], f"http://127.0.0.1:{port}{url}", secs, {"p": proc.pid}
        )
        errors = h["failed"] + h["timeout"] + (h["ok"] - h["s2xx"])
        return {"rps": h["rps"], "cpu_us": h["cpu_us"]["p"], "errors": errors, "n": h["ok"]}

    for _proxy, _pod, load, port, proc in runs:  # warm-up: connections open, lazy imports done, code hot
        once(load, port, proc, ctx.dur(1, 0.5) if load != WRK else 1)
    results: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in range(rounds):
        for proxy, pod, load, port, proc in runs:
            if not proc.is_running():
                continue
            c.log(f"h2 (a) {load} {seconds:g}s, {proxy} -> {pod}, round {r + 1}/{rounds}")
            if pod == POD_GRPC:
                pr.pod_control(grpc_control, "POST", "/_reset")
            res = once(load, port, proc, seconds)
            if pod == POD_GRPC:
                res["pod_calls"] = pr.pod_control(grpc_control, "GET", "/_stats")["per"].get("Unary", 0)
            if proc.is_running():
                results.setdefault((proxy, pod, load), []).append(res)

    med = _cpu_table(sec, runs, results, seconds, rounds)
    figures = {
        "h1": med((ACTIVATOR, POD_H1, WRK), "cpu_us"),
        "h2c_h1pod": med((ACTIVATOR, POD_H1, H2_M10), "cpu_us"),
        "h2c_h2pod": med((ACTIVATOR, POD_H2C, H2_M10), "cpu_us"),
        "fwd_h2c_h1pod": med((FORWARDER, POD_H1, H2_M10), "cpu_us"),
        "fwd_h2c_h2pod": med((FORWARDER, POD_H2C, H2_M10), "cpu_us"),
        "grpc": med((ACTIVATOR, POD_GRPC, GRPC_LOAD), "cpu_us"),
        "fwd_grpc": med((FORWARDER, POD_GRPC, GRPC_LOAD), "cpu_us"),
    }
    _cpu_targets(sec, figures)
    c.log("h2 (b) gRPC latency at 200 calls/s")
    latency = pr.grpc_latency(ctx, sec, latency_targets)
    _latency_target(sec, latency)
    figures["grpc_200"] = latency.get(ACTIVATOR, {}).get("cpu_us", float("nan"))
    figures["fwd_grpc_200"] = latency.get(FORWARDER, {}).get("cpu_us", float("nan"))
    sec.notes.append(
        "(b) CPU us/call at 200 calls/s: the process's CPU over the client's whole run (its channel set-up and "
        f"{pr.WARM_CALLS} warm-up calls, one at a time, included) / the calls answered OK: a call's cost when calls "
        "do not share reads and writes. For direct, the pod's."
    )
    for proc, _ in fwds.values():  # the next parts use their own processes
        procs.stop(proc)
    procs.stop(h1_fwd)
    procs.stop(acts[POD_GRPC].process)
    procs.stop(nginx_proc)
    return figures


def _cpu_table(
    sec: Section,
    runs: list[Run],
    results: dict[tuple[str, str, str], list[dict[str, Any]]],
    seconds: float,
    rounds: int,
) -> Callable[[tuple[str, str, str], str], float]:
    """(a)'s table; the median over rounds of a run's figure."""

    def med(key: tuple[str, str, str], attr: str) -> float:
        return c.median([x[attr] for x in results.get(key, [])])

    h1_act = med((ACTIVATOR, POD_H1, WRK), "cpu_us")
    rows = []
    for proxy, pod, load, _, _ in runs:
        key = (proxy, pod, load)
        rs = results.get(key, [])
        rows.append(
            [
                proxy,
                pod,
                load,
                med(key, "rps"),
                " / ".join(f"{x['rps']:,.0f}" for x in rs),
                med(key, "cpu_us"),
                _ratio(med(key, "cpu_us"), med((FORWARDER, pod, load), "cpu_us")) if proxy != H1_FORWARDER else "-",
                _ratio(med(key, "cpu_us"), h1_act),
                sum(x["errors"] for x in rs),
            ]
        )
    sec.tables.append(
        Table(
            f"(a) CPU per request, the proxy on one core, closed loop ({seconds:g} s, median of {rounds} interleaved "
            "round(s)); CPU = user + system of the proxy process during the run / requests answered",
            [
                "proxy",
                "pod",
                "load",
                "req/s (median)",
                "rounds",
                "CPU us/req",
                "CPU / h2 forwarder's (same pod, load)",
                "CPU / HTTP/1.1 via activator",
                "errors",
            ],
            rows,
        )
    )
    grpc_calls = sum(x.get("pod_calls", 0) for k, v in results.items() if k[1] == POD_GRPC for x in v)
    sec.notes.append(
        f"(a) the grpcio pod ran {grpc_calls:,} `Unary` handlers over the gRPC rows' rounds: h2load's requests "
        "are real gRPC calls (h2load does not read `grpc-status`; (b) makes grpcio calls and checks them)."
    )
    return med


def _cpu_targets(sec: Section, f: dict[str, float]) -> None:
    def target(name: str, goal: str, ratio: float, limit: float, measured: str) -> None:
        met = None if math.isnan(ratio) else ratio <= limit
        sec.add_target(
            Target(
                name,
                goal,
                measured,
                met,
                "" if met or met is None else f"{ratio / limit:.2f}x over the goal",
                group=GROUP,
            )
        )

    target(
        "gRPC unary call, CPU: activator / h2 forwarder",
        "<= 1.1x",
        _ratio(f["grpc"], f["fwd_grpc"]),
        1.1,
        f"{_x(f['grpc'], f['fwd_grpc'])} ({f['grpc']:.0f} vs {f['fwd_grpc']:.0f} us per call, {GRPC_LOAD})",
    )
    for pod, act, fwd in ((POD_H2C, "h2c_h2pod", "fwd_h2c_h2pod"), (POD_H1, "h2c_h1pod", "fwd_h2c_h1pod")):
        target(
            f"h2c request ({pod} pod), CPU: activator / h2 forwarder",
            "<= 1.1x",
            _ratio(f[act], f[fwd]),
            1.1,
            f"{_x(f[act], f[fwd])} ({f[act]:.0f} vs {f[fwd]:.0f} us per request, {H2_M10})",
        )
        target(
            f"h2c request ({pod} pod) / HTTP/1.1 request, CPU, both through activator",
            "<= 2.0x",
            _ratio(f[act], f["h1"]),
            2.0,
            f"{_x(f[act], f['h1'])} ({f[act]:.0f} vs {f['h1']:.0f} us per request; {H2_M10} vs {WRK})",
        )


def _latency_target(sec: Section, latency: dict[str, dict[str, float]]) -> None:
    act, fwd = latency.get(ACTIVATOR), latency.get(FORWARDER)
    if act is None or fwd is None:
        return
    r50, r99 = _ratio(act["a50"], fwd["a50"]), _ratio(act["a99"], fwd["a99"])
    measurable = fwd["a50"] > 0 and fwd["a99"] > 0
    met = (r50 <= 1.5 and r99 <= 1.5) if measurable else None
    sec.add_target(
        Target(
            f"gRPC added latency at {pr.GRPC_RATE} calls/s: activator / h2 forwarder",
            "<= 1.5x at p50 and p99",
            f"p50 {r50:.2f}x ({act['a50']:+.3f} vs {fwd['a50']:+.3f} ms), p99 {r99:.2f}x ({act['a99']:+.3f} vs "
            f"{fwd['a99']:+.3f} ms)",
            met,
            "" if met or met is None else f"p50 needs {1.5 * fwd['a50']:+.3f} ms, p99 {1.5 * fwd['a99']:+.3f} ms",
            group=GROUP,
        )
    )


# -- (c) where the time goes -----------------------------------------------------------------


#: activator's HTTP/2 modules, shown apart in (c): the driver, the client side, the pod side.
H2_MODULES = ("base/h2wire.py", "front/http2.py", "pods/h2c.py")


def package_of(path: str) -> str:
    """The package a frame's file belongs to, as (c) groups them."""
    for prefix, name in (
        ("h2/", "h2"),
        ("hpack/", "hpack"),
        ("hyperframe/", "hyperframe"),
        ("gevent/", "gevent"),
        ("falcon/", "falcon"),
        ("bench/", "the forwarder's own code (bench/)"),
    ):
        if path.startswith(prefix):
            return name
    if path.startswith("activator/"):
        module = path.removeprefix("activator/")
        return f"activator: {module}" if module in H2_MODULES else "activator: the rest"
    return "the rest (stdlib, other packages)"


def _where_the_time_goes(ctx: c.Ctx, procs: c.Procs, sec: Section) -> None:
    if ctx.quick:
        sec.notes.append("(c) py-spy left out of quick runs")
        return
    spy = profile.ensure_pyspy(ctx)
    if spy is None:
        sec.notes.append("(c) left out: py-spy not available")
        return
    seconds = 10
    _, nginx_h2c = c.start_nginx(procs, "nginx-h2c-profile", h2c=True)
    act = pr.start_activator_over(procs, "activator-profile", f"127.0.0.1:{nginx_h2c}", cc=1000, h2c=True)
    fwd, fwd_port = c.start_h2_forwarder(procs, nginx_h2c, "h2-forwarder-profile", pod_h2c=True)
    shares: dict[str, dict[str, float]] = {}
    rates: dict[str, str] = {}
    for name, port, pid in ((ACTIVATOR, act.port, act.pid), (FORWARDER, fwd_port, fwd.pid)):
        url = f"http://127.0.0.1:{port}/"
        pr.run_h2load(ctx, [*H2_ARGS[H2_M10], "-D", "1"], url, 1)

        def load(secs: float, url: str = url, pid: int = pid) -> dict[str, Any]:
            return pr.run_h2load(ctx, [*H2_ARGS[H2_M10], "-D", str(round(secs))], url, secs, {"p": pid})

        c.log(f"h2 (c) py-spy of {name} under {H2_M10}, h2c pod")
        sampled = profile.record(ctx, procs, spy, pid, seconds, load, name=f"py-spy-{name.replace(' ', '-')}")
        if sampled is None:
            continue
        raw, res = sampled
        shares[name] = dict(profile.shares_by(raw, package_of))
        rates[name] = f"{res['rps']:,.0f} req/s, {res['cpu_us']['p']:.0f} us CPU/req"
    if not shares:
        return
    groups = sorted({g for s in shares.values() for g in s}, key=lambda g: -max(s.get(g, 0) for s in shares.values()))
    names = list(shares)
    rows = [[g, *(shares[n].get(g, 0.0) for n in names)] for g in groups]
    in_h2 = {n: sum(shares[n].get(g, 0.0) for g in ("h2", "hpack", "hyperframe")) for n in names}
    rows.append(["h2 + hpack + hyperframe", *(in_h2[n] for n in names)])
    sec.tables.append(
        Table(
            f"(c) where the time goes: `py-spy record -r 250 --nonblocking`, {seconds} s, under {H2_M10} to the h2c "
            "pod; % of the busy samples by the package of the running frame (self time) ("
            + "; ".join(f"{n}: {rates[n]}" for n in names)
            + ")",
            ["package", *(f"{n} %" for n in names)],
            rows,
        )
    )
    sec.headline.append(
        "share of the busy time inside h2/hpack/hyperframe under h2c load: "
        + ", ".join(f"{n} {in_h2[n]:.0f}%" for n in names)
    )
    sec.notes.append(
        "(c) the raw collapsed stacks are in the run's work directory (`h2/py-spy-*.txt`); py-spy leaves out the "
        "samples in which the process was idle (the hub waiting in epoll)."
    )


# -- (d) what h2 costs per exchange ----------------------------------------------------------


def _h2_costs(ctx: c.Ctx, sec: Section, cpu: dict[str, float]) -> None:
    seconds = ctx.dur(2, 0.2)
    res = pr.run_client(ctx, ["h2-exchange", "--seconds", str(seconds)], timeout=120, module="bench.h2")
    rows = []
    for r in res["rows"]:
        rows.append(
            [r["shape"], r["config"], r["exchanges"], r["server_us"], r["client_us"], r["server_us"] + r["client_us"]]
        )
    sec.tables.append(
        Table(
            f"(d) what `h2` itself costs per exchange: an in-memory pair of `H2Connection`s, no sockets, one "
            f"connection, {seconds:g} s per row on cpu0; us of CPU per exchange (the thread's CPU time around the "
            "calls of each role)",
            [
                "exchange",
                "h2 configuration",
                "exchanges",
                "server role us (activator's client side)",
                "client role us (activator's pod side)",
                "both (one h2c-to-h2c proxied request)",
            ],
            rows,
        )
    )
    lean = {r["shape"]: r["server_us"] + r["client_us"] for r in res["rows"] if r["config"] == "activator's"}
    crowded = lean.get(f"GET, 5-byte answer, {OPEN_ALONGSIDE} other streams open", float("nan"))
    get, grpc = lean.get("GET, 5-byte answer", float("nan")), lean.get("gRPC unary", float("nan"))
    sec.headline.append(
        f"h2 itself (activator's configuration, both roles) per proxied request: {get:.0f} us for a GET, {grpc:.0f} "
        f"us for a gRPC unary call; activator's whole CPU per request in (a): {cpu['h2c_h2pod']:.0f} us (h2c pod, "
        f"{H2_M10}), {cpu['grpc']:.0f} us (gRPC) — the h2 lower bound is {_ratio(get, cpu['h2c_h2pod']) * 100:.0f}% "
        f"and {_ratio(grpc, cpu['grpc']) * 100:.0f}% of them; a GET with {OPEN_ALONGSIDE} other streams open on the "
        f"connection: {crowded:.0f} us"
    )
    sec.notes.append(
        "(d) one exchange: the client role sends HEADERS (and the request's DATA), `data_to_send`; the server role "
        "takes them (`receive_data`, acknowledging DATA), sends HEADERS, DATA (and trailers), `data_to_send`; the "
        "client role takes the answer and acknowledges its DATA, and the server role takes that WINDOW_UPDATE. "
        "Every exchange on one connection (HPACK's dynamic table hot, as on a long-lived connection); in the last "
        f"shape {OPEN_ALONGSIDE} requests were opened first and never ended, so every new stream is counted among "
        "them (`h2` counts the open streams by walking all of them at each new stream, `_open_streams`). activator's "
        "configurations are `activator/front/http2.py`'s and `activator/pods/h2c.py`'s (`_H2_CONFIG`: no header "
        "validation or normalization where `core.heads` checks the fields)."
    )


_GET = (
    [
        (b":method", b"GET"),
        (b":scheme", b"http"),
        (b":authority", b"127.0.0.1:8080"),
        (b":path", b"/"),
        (b"user-agent", b"h2load nghttp2/1.52.0"),
    ],
    b"",
    [
        (b":status", b"200"),
        (b"server", b"nginx/1.22.1"),
        (b"date", b"Thu, 03 Dec 2026 10:00:00 GMT"),
        (b"content-type", b"text/plain"),
        (b"content-length", b"5"),
    ],
    b"hello",
    [],
)
_GRPC = (
    [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":authority", b"127.0.0.1:8080"),
        (b":path", pr.GRPC_METHOD.encode()),
        (b"te", b"trailers"),
        (b"content-type", b"application/grpc"),
        (b"user-agent", b"grpc-python/1.85.3 grpc-c/52.0.0 (linux; chttp2)"),
        (b"grpc-accept-encoding", b"identity"),
    ],
    b"\x00\x00\x00\x00\x05hello",
    [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-accept-encoding", b"identity")],
    b"\x00\x00\x00\x00\x05hello",
    [(b"grpc-status", b"0"), (b"grpc-message", b"")],
)


def _h2_exchange(args: argparse.Namespace) -> dict[str, Any]:
    """(d), in this process: us of CPU per exchange for each shape and configuration."""
    import h2.config

    from activator.front import http2
    from activator.pods import h2c

    configs = {
        "h2's defaults": (
            h2.config.H2Configuration(client_side=False, header_encoding=None),
            h2.config.H2Configuration(client_side=True, header_encoding=None),
        ),
        "activator's": (http2._H2_CONFIG, h2c._H2_CONFIG),
    }
    rows = []
    for shape, exchange, others in (
        ("GET, 5-byte answer", _GET, 0),
        ("gRPC unary", _GRPC, 0),
        (f"GET, 5-byte answer, {OPEN_ALONGSIDE} other streams open", _GET, OPEN_ALONGSIDE),
    ):
        for config_name, (server_config, client_config) in configs.items():
            done, in_server, in_client = _exchanges(server_config, client_config, exchange, others, args.seconds)
            rows.append(
                {
                    "shape": shape,
                    "config": config_name,
                    "exchanges": done,
                    "server_us": in_server / done * 1e6,
                    "client_us": in_client / done * 1e6,
                }
            )
    return {"rows": rows}


#: (d): the streams left open beside the exchanges in the last shape (as under h2load -c50 -m10
#: on activator's one pod connection).
OPEN_ALONGSIDE = 500


def _exchanges(
    server_config: Any, client_config: Any, exchange: tuple[Any, ...], others: int, seconds: float
) -> tuple[int, float, float]:
    """Exchanges on one in-memory connection pair for ``seconds``: how many, and the CPU
    seconds (this thread's) spent in the server role's and in the client role's calls."""
    import h2.connection
    import h2.events
    from h2.settings import SettingCodes

    req_fields, req_body, resp_fields, resp_body, trailers = exchange
    server = h2.connection.H2Connection(server_config)
    client = h2.connection.H2Connection(client_config)
    client.initiate_connection()
    server.initiate_connection()
    server.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: 2**31 - 1})
    for _ in range(3):  # prefaces, SETTINGS and their acks
        server.receive_data(client.data_to_send())
        client.receive_data(server.data_to_send())
    for _ in range(others):  # requests whose body never ends: open on both sides
        client.send_headers(client.get_next_available_stream_id(), req_fields)
    server.receive_data(client.data_to_send())
    clock = time.thread_time
    in_server = in_client = 0.0
    done = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(50):
            t0 = clock()
            sid = client.get_next_available_stream_id()
            client.send_headers(sid, req_fields, end_stream=not req_body)
            if req_body:
                client.send_data(sid, req_body, end_stream=True)
            out = client.data_to_send()
            t1 = clock()
            for event in server.receive_data(out):
                if isinstance(event, h2.events.DataReceived):
                    server.acknowledge_received_data(event.flow_controlled_length, sid)
            server.send_headers(sid, resp_fields)
            server.send_data(sid, resp_body, end_stream=not trailers)
            if trailers:
                server.send_headers(sid, trailers, end_stream=True)
            back = server.data_to_send()
            t2 = clock()
            for event in client.receive_data(back):
                if isinstance(event, h2.events.DataReceived):
                    client.acknowledge_received_data(event.flow_controlled_length, sid)
            ack = client.data_to_send()
            t3 = clock()
            server.receive_data(ack)
            server.data_to_send()
            t4 = clock()
            in_client += (t1 - t0) + (t3 - t2)
            in_server += (t2 - t1) + (t4 - t3)
        done += 50
    return done, in_server, in_client


# -- (e) cancels -----------------------------------------------------------------------------


def _cancels(ctx: c.Ctx, procs: c.Procs, sec: Section, have_haproxy: bool) -> None:
    trials = ctx.n(50, 5)
    rows = []
    # gRPC
    pod = procs.start("cancel-pod-grpc", pr.client_cmd(ctx, ["cancel-pod-grpc"], module="bench.h2"))
    pod_port = int(pod.wait_output(r"^READY (\d+)$", timeout=30).group(1))
    address = f"127.0.0.1:{pod_port}"
    act = pr.start_activator_over(procs, "activator-cancel-grpc", address, cc=1, h2c=True)
    _, fwd_port = c.start_h2_forwarder(procs, pod_port, "h2-forwarder-cancel", pod_h2c=True)
    grpc_targets: list[tuple[str, int, bool]] = [(DIRECT, pod_port, False), (ACTIVATOR, act.port, True)]
    grpc_targets.append((FORWARDER, fwd_port, False))
    if have_haproxy:
        _, ports = pr.start_haproxy_h2(procs, "haproxy-cancel", address, frontends={"fe": True}, pod_h2=True, maxconn=1)
        grpc_targets.append((HAPROXY, ports["fe"], True))
    slot_freed: dict[str, list[float]] = {}
    for name, port, slots in grpc_targets:
        c.log(f"h2 (e) gRPC cancel, {trials} trials, {name}")
        res = pr.run_client(
            ctx,
            [
                "cancel-client",
                "--kind",
                "grpc",
                "--port",
                str(port),
                "--pod-port",
                str(pod_port),
                "--trials",
                str(trials),
            ],
            timeout=trials * (GRPC_HOLD + 2) + 60,
            module="bench.h2",
        )
        rows.append(_cancel_row(f"gRPC, {name}", "RST_STREAM on its stream", res, slots))
        if slots:
            slot_freed[name] = [t["next"] - t["cancel"] for t in res["trials"] if t.get("next") is not None]
    # HTTP/1.1
    h1_pod = procs.start("cancel-pod-h1", pr.client_cmd(ctx, ["cancel-pod-h1"], module="bench.h2"))
    h1_port = int(h1_pod.wait_output(r"^READY (\d+)$", timeout=30).group(1))
    for mode in ("cancel", "finish"):
        act1 = pr.start_activator_over(
            procs, f"activator-cancel-h1-{mode}", f"127.0.0.1:{h1_port}", cc=1, client_gone=mode
        )
        c.log(f"h2 (e) HTTP/1.1 client gone, client_gone: {mode}, {trials} trials")
        res = pr.run_client(
            ctx,
            [
                "cancel-client",
                "--kind",
                "h1",
                "--port",
                str(act1.port),
                "--pod-port",
                str(h1_port),
                "--trials",
                str(trials),
            ],
            timeout=trials * (H1_HOLD + 2) + 60,
            module="bench.h2",
        )
        rows.append(_cancel_row(f"HTTP/1.1, {ACTIVATOR}", f"client_gone: {mode}", res, True))
        procs.stop(act1.process)
    sec.tables.append(
        Table(
            f"(e) a call canceled while it runs on a cc=1 pod, the next call queued behind it ({trials} trials each; "
            "ms from the client's cancel, on the machine's monotonic clock)",
            [
                "call, through",
                "what the pod gets",
                "trials",
                "pod saw the cancel: p50",
                "p99",
                "max",
                "not seen",
                "next call at the pod: p50",
                "p99",
                "max",
            ],
            rows,
        )
    )
    freed = slot_freed.get(ACTIVATOR, [])
    if freed:
        p99 = c.pct(freed, 99) * 1000
        sec.add_target(
            Target(
                "a canceled gRPC call frees its slot (cancel -> the next queued call at the pod, p99)",
                "<= 10 ms",
                f"{p99:.1f} ms (p50 {c.pct(freed, 50) * 1000:.1f}, max {max(freed) * 1000:.1f} ms, "
                f"{len(freed)} trials)",
                p99 <= 10,
                "" if p99 <= 10 else f"{p99 - 10:.1f} ms over",
                group=GROUP,
            )
        )
    sec.notes.append(
        f"(e) the held gRPC call ends by itself after {GRPC_HOLD:g} s and the HTTP/1.1 one after {H1_HOLD:g} s when "
        f"no cancel reaches the pod; the next call is sent {QUEUED_WAIT * 1000:g} ms before the cancel. Through the "
        "h2 forwarder and directly there is no slot: the next call runs at once, so only the first figure means "
        "anything there. gRPC's pod sees the cancel in its call's termination callback (`context.add_callback`, "
        "grpcio's own thread); the HTTP/1.1 pod when its connection reads EOF."
    )


def _cancel_row(what: str, pod_gets: str, res: dict[str, Any], slots: bool) -> list[Any]:
    trials = res["trials"]
    seen = [(t["seen"] - t["cancel"]) * 1000 for t in trials if t.get("seen") is not None]
    nxt = [(t["next"] - t["cancel"]) * 1000 for t in trials if t.get("next") is not None] if slots else []

    def three(xs: list[float]) -> list[Any]:
        return [c.pct(xs, 50), c.pct(xs, 99), max(xs)] if xs else ["-", "-", "-"]

    return [what, pod_gets, len(trials), *three(seen), len(trials) - len(seen), *three(nxt)]


def _cancel_pod_grpc(args: argparse.Namespace) -> None:
    """gRPC pod of (e), service ``bench.Cancel``: ``Hold`` (runs until canceled, at most
    ``GRPC_HOLD``), ``Next`` (answers at once), ``Stamps`` (the stamps of trial ``i``, JSON;
    asked directly, not through the proxy). Prints ``READY <port>``."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import grpc  # type: ignore[import-untyped]

    stamps: dict[str, dict[str, float]] = {}

    def hold(request: bytes, context: Any) -> bytes:
        trial = stamps.setdefault(request.decode(), {})
        trial["hold"] = time.monotonic()
        returned = threading.Event()
        ended = threading.Event()

        def terminated() -> None:
            if not returned.is_set():
                trial["seen"] = time.monotonic()
            ended.set()

        context.add_callback(terminated)
        if not ended.wait(GRPC_HOLD):
            trial["end"] = time.monotonic()  # no cancel came: the call is answered
        returned.set()
        return request

    def next_call(request: bytes, context: Any) -> bytes:
        stamps.setdefault(request.decode(), {})["next"] = time.monotonic()
        return request

    def stamps_of(request: bytes, context: Any) -> bytes:
        return json.dumps(stamps.get(request.decode(), {})).encode()

    handlers = {
        "Hold": grpc.unary_unary_rpc_method_handler(hold),
        "Next": grpc.unary_unary_rpc_method_handler(next_call),
        "Stamps": grpc.unary_unary_rpc_method_handler(stamps_of),
    }
    server = grpc.server(ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(CANCEL_SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"READY {port}", flush=True)
    server.wait_for_termination()


def _cancel_pod_h1(args: argparse.Namespace) -> None:
    """HTTP/1.1 pod of (e): ``GET /hold?<i>`` holds until its connection reads EOF (then it
    stamps and closes) or ``H1_HOLD`` passed (then it answers), ``GET /next?<i>`` answers at
    once, ``GET /stamps?<i>`` answers the stamps of trial i (JSON). Prints ``READY <port>``."""
    import gevent
    import gevent.socket
    from gevent.server import StreamServer

    from .http1 import RequestReader

    stamps: dict[str, dict[str, float]] = {}

    def answer(sock: Any, body: bytes) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    def handle(sock: Any, _client: Any) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = RequestReader(sock)
        try:
            while (request := reader.next()) is not None:
                path, _, trial_id = request.target.decode().partition("?")
                trial = stamps.setdefault(trial_id, {})
                if path == "/hold":
                    trial["hold"] = time.monotonic()
                    try:
                        gevent.socket.wait_read(sock.fileno(), timeout=H1_HOLD)
                    except TimeoutError:
                        answer(sock, b"held")
                        continue
                    trial["seen"] = time.monotonic()  # readable while holding: the proxy closed
                    return
                if path == "/next":
                    trial["next"] = time.monotonic()
                answer(sock, json.dumps(trial).encode() if path == "/stamps" else b"ok")
        except OSError:
            pass
        finally:
            sock.close()

    server = StreamServer(("127.0.0.1", 0), handle)
    server.start()
    print(f"READY {server.server_port}", flush=True)
    gevent.wait()


def _cancel_client(args: argparse.Namespace) -> dict[str, Any]:
    """(e)'s client: ``--trials`` cancels through ``--port``, the stamps asked of the pod directly."""
    return {"trials": _cancel_grpc_trials(args) if args.kind == "grpc" else _cancel_h1_trials(args)}


def _wait_for(stamps: Callable[[], dict[str, float]], *keys: str, timeout: float = 10.0) -> dict[str, float]:
    """The trial's stamps once one of ``keys`` is among them (or ``timeout`` passed)."""
    end = time.monotonic() + timeout
    while True:
        got = stamps()
        if any(key in got for key in keys) or time.monotonic() > end:
            return got
        time.sleep(0.002)


def _cancel_grpc_trials(args: argparse.Namespace) -> list[dict[str, Any]]:
    import grpc

    options = [("grpc.enable_http_proxy", 0), ("grpc.enable_retries", 0), ("grpc.default_authority", "bench")]
    channel = grpc.insecure_channel(f"127.0.0.1:{args.port}", options=options)
    direct = grpc.insecure_channel(f"127.0.0.1:{args.pod_port}", options=options)
    hold = channel.unary_unary(f"/{CANCEL_SERVICE}/Hold")
    next_call = channel.unary_unary(f"/{CANCEL_SERVICE}/Next")
    stamps_call = direct.unary_unary(f"/{CANCEL_SERVICE}/Stamps")
    for i in range(5):  # warm-up: channels up, code hot
        next_call(b"warm-%d" % i, timeout=10)
    trials = []
    for i in range(args.trials):
        key = f"{os.getpid()}-{i}".encode()  # the pod serves several runs: a trial of this one
        running = hold.future(key, timeout=30)
        _wait_for(lambda key=key: json.loads(stamps_call(key, timeout=10)), "hold")
        queued = next_call.future(key, timeout=30)
        time.sleep(QUEUED_WAIT)
        cancel = time.monotonic()
        running.cancel()
        queued.result()
        got = _wait_for(lambda key=key: json.loads(stamps_call(key, timeout=10)), "seen", "end", timeout=GRPC_HOLD + 1)
        trials.append({"cancel": cancel, **got})
    channel.close()
    direct.close()
    return trials


def _cancel_h1_trials(args: argparse.Namespace) -> list[dict[str, Any]]:
    import http.client

    pod = http.client.HTTPConnection("127.0.0.1", args.pod_port, timeout=10)

    def stamps(key: str) -> dict[str, float]:
        pod.request("GET", f"/stamps?{key}")
        got: dict[str, float] = json.loads(pod.getresponse().read())
        return got

    trials = []
    for i in range(args.trials):
        key = f"{os.getpid()}-{i}"  # the pod serves several runs: a trial of this one
        running = socket.create_connection(("127.0.0.1", args.port))
        running.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        running.sendall(f"GET /hold?{key} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
        _wait_for(lambda key=key: stamps(key), "hold")
        queued = http.client.HTTPConnection("127.0.0.1", args.port, timeout=30)
        queued.request("GET", f"/next?{key}", headers={"Host": "bench"})
        time.sleep(QUEUED_WAIT)
        cancel = time.monotonic()
        running.close()
        queued.getresponse().read()
        queued.close()
        time.sleep(0.01)  # the pod's EOF, if it comes
        trials.append({"cancel": cancel, **stamps(key)})
    return trials


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.h2", description="the h2 scenario's own processes")
    sub = ap.add_subparsers(dest="cmd", required=True)
    x = sub.add_parser("h2-exchange")
    x.add_argument("--seconds", type=float, default=2.0)
    x.add_argument("--out", required=True)
    sub.add_parser("cancel-pod-grpc")
    sub.add_parser("cancel-pod-h1")
    k = sub.add_parser("cancel-client")
    k.add_argument("--kind", choices=("grpc", "h1"), required=True)
    k.add_argument("--port", type=int, required=True)
    k.add_argument("--pod-port", type=int, required=True)
    k.add_argument("--trials", type=int, default=50)
    k.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "cancel-pod-grpc":
        _cancel_pod_grpc(args)
        return 0
    if args.cmd == "cancel-pod-h1":
        _cancel_pod_h1(args)
        return 0
    result = _h2_exchange(args) if args.cmd == "h2-exchange" else _cancel_client(args)
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

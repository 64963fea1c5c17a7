"""HTTP engine: activator against its previous engine and against a minimal forwarder on the new stack.

Everything in one run; each comparison runs its targets in interleaved rounds and
reports medians over rounds; the targets are ratios against what the same run measured.

(a) Saturation on one core: ``wrk -t1 -c50``, the proxy pinned to cpu1, nginx behind it:
    direct nginx, HAProxy, the minimal forwarder (``bench/forwarder.py``, the new ceiling),
    activator (this tree) and the previous engine (activator at ``--baseline``, from a git
    worktree); with ``--compiled`` also this tree with its request path compiled by mypyc.
(b) CPU per proxied request, from the same runs: user + system CPU time of the proxy
    process over the wrk run, divided by the requests served.
(c) Added latency at 1,000 req/s, open loop, latency from the scheduled send time;
    added = target - direct nginx, per round, then the median over rounds. Two shapes:
    one steady keep-alive connection (one request at a time), and bursts of 10
    simultaneous requests (10 keep-alive connections sending together every 10 ms).
(d) Slot held beyond the pod's own time: one cc=1 pod (``bench/twowrite_pod.py
    --one-write --nodelay``, a fixed service time) saturated by a closed loop of several
    clients through the proxy, so a request always waits for the slot. The pod records
    how long it sat idle before each request, since its previous response was sent:
    what the proxy takes to deliver a response, hand the slot over and send the next
    request. The same figure from the throughput, (run time - requests x the pod's busy
    time) / requests, is shown next to it.

Equivalent configurations as in ``bench/overhead.py``: activator ``container_concurrency:
100`` with one pod (no queueing at 50 connections), HAProxy ``server ... maxconn 100``;
for (d) ``container_concurrency: 1`` and ``maxconn 1``, ``balance first``.
"""

from __future__ import annotations

from typing import Any

import harness

from . import common as c
from .report import Section, Table, Target

DIRECT = "direct nginx"
FORWARDER = "minimal forwarder"
HAPROXY = "HAProxy"
GROUP = "HTTP engine"

#: The two shapes of the 1,000 req/s load (bench.loadgen open arguments).
SHAPES = (
    ("one steady connection", ["--conns", "1", "--max-conns", "1"]),
    ("bursts of 10 simultaneous requests", ["--conns", "10", "--max-conns", "10", "--burst", "10"]),
)

SLOT_SERVICE_MS = 5
SLOT_CLIENTS = 8

Endpoint = tuple[str, int, harness.Process]  # (name in the tables, port, the process whose CPU is counted)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def run(ctx: c.Ctx) -> Section:
    sec = Section("engine", "HTTP engine: activator vs its previous engine and a minimal forwarder")
    with c.Procs(ctx, "engine") as procs:
        nginx_proc, nginx = c.start_nginx(procs)
        service = {"web": {"hosts": ["*"], "cc": 100, "queue_depth": 1000, "pods": [f"127.0.0.1:{nginx}"]}}
        fwd_proc, fwd = c.start_forwarder(procs, nginx)
        act = c.start_activator(procs, "activator", service)
        proxies: list[Endpoint] = [(FORWARDER, fwd, fwd_proc), (act.label, act.port, act.process)]
        prev = ctx.baseline.start(procs, "activator-previous", service) if ctx.baseline else None
        if prev:
            proxies.append((prev.label, prev.port, prev.process))
        compiled = ctx.compiled.start(procs, "activator-compiled", service) if ctx.compiled else None
        if compiled:
            proxies.append((compiled.label, compiled.port, compiled.process))
        refs: list[Endpoint] = [(DIRECT, nginx, nginx_proc)]
        if ctx.tools.get("haproxy"):
            hap = c.start_haproxy(
                procs, "haproxy", [("nginx", f"127.0.0.1:{nginx}")], maxconn=100, balance="roundrobin"
            )
            refs.append((HAPROXY, hap.port, hap.proc))
        sec.intro = _intro(act.label, prev.label if prev else None, compiled.label if compiled else None)
        _saturation(ctx, procs, sec, refs + proxies, act.label, prev.label if prev else None)
        _latency(ctx, sec, refs[0], proxies, act.label)
        _slot_held(ctx, procs, sec, act.label)
    return sec


def _intro(this: str, previous: str | None, compiled: str | None) -> str:
    return (
        "Backend: nginx-light as in the overhead section. The minimal forwarder: `bench/forwarder.py`, the same "
        "stack as the new engine with nothing else (gevent `StreamServer` on a TCP_NODELAY listener, httptools' "
        "`HttpRequestParser` / `HttpResponseParser`, a WSGI environ handed to a `falcon.App` with one sink, a "
        "keep-alive pool of pod connections; no throttling, no limits, buffered bodies). "
        f"{this}: `python -m activator` from this working tree (or `$ACTIVATOR_BIN`, see Machine)"
        + (f"; {previous}: the same from a git worktree of that commit" if previous else "")
        + (
            f"; {compiled} (`--compiled`, an experiment that does not ship: it fails refused requests, see "
            "`bench/common.py` `Compiled`): a copy of this tree with the modules of the request path compiled by mypyc"
            if compiled
            else ""
        )
        + "."
        + " activator: `container_concurrency: 100`, one pod, `access_log: false`, no StatsD; HAProxy: `nbthread 1`, "
        "`server ... maxconn 100`, `http-reuse always`. "
        "(c) shapes: one steady connection = one keep-alive connection, one request at a time, the next one "
        "scheduled 1 ms after the last (sent when the one before is answered, its latency still counted from its "
        "scheduled time); bursts = every 10 ms, 10 keep-alive connections send one request each at once (the shape "
        "of `hey -c 10 -q 100`, but open loop). "
        f"(d) method: one pod (`bench/twowrite_pod.py --one-write --nodelay`, {SLOT_SERVICE_MS} ms per request) behind "
        f"each proxy with one slot (`container_concurrency: 1` / `maxconn 1`), {SLOT_CLIENTS} clients in a closed "
        "loop, so a request always waits for the slot. The pod measures, for each request that found it idle, the "
        "time from the return of its previous response's last send to the arrival of this request's head: what the "
        "path in front of it adds per hand-off (the proxy reading the response, writing it to the client, releasing "
        'the slot, waking the next waiter and sending its request), plus the pod\'s own wake-up. "From throughput" '
        "is the same from the clients' side: (run time - requests x the pod's busy time per request) / requests. "
        "Direct with one client is the floor: the load generator's own turnaround between a response and its next "
        "request."
    )


def _saturation(
    ctx: c.Ctx, procs: c.Procs, sec: Section, targets: list[Endpoint], this: str, previous: str | None
) -> None:
    seconds, rounds = ctx.dur(10, 1), ctx.n(3, 1)
    results = c.saturate(ctx, procs, targets, seconds, rounds, "engine (a)")

    def med(name: str | None, attr: str) -> float:
        return c.median_of(results, name, attr) if name else float("nan")

    direct, fwd, prev, act = (med(n, "rps") for n in (DIRECT, FORWARDER, previous, this))
    rows = [
        [
            name,
            med(name, "rps"),
            " / ".join(f"{w.rps:,.0f}" for w in results.get(name, [])),
            med(name, "p50_ms"),
            med(name, "p99_ms"),
            _ratio(med(name, "rps"), direct),
            _ratio(med(name, "rps"), fwd),
            _ratio(med(name, "rps"), prev),
            med(name, "cpu_us"),
            sum(w.errors + w.non2xx for w in results.get(name, [])),
        ]
        for name, _, _ in targets
    ]
    sec.tables.append(
        Table(
            f"(a) saturation, wrk -t1 -c50, {seconds:g} s, median of {rounds} interleaved rounds (proxy on one core); "
            "(b) CPU per request: user + system CPU of that process during the run / requests served",
            [
                "target",
                "req/s (median)",
                "rounds",
                "p50 ms",
                "p99 ms",
                "/ direct",
                "/ forwarder",
                "/ previous engine",
                "CPU us/req",
                "errors",
            ],
            rows,
        )
    )

    vs_prev, vs_fwd = _ratio(act, prev), _ratio(act, fwd)
    sec.add_target(
        Target(
            "saturation on one core: activator / previous engine",
            ">= 1.6x",
            f"{vs_prev:.2f}x ({act:,.0f} vs {prev:,.0f} req/s)" if previous else "no previous engine in this run",
            None if previous is None else vs_prev >= 1.6,
            "" if vs_prev >= 1.6 or previous is None else f"needs {1.6 * prev:,.0f} req/s",
            group=GROUP,
        )
    )
    sec.add_target(
        Target(
            "saturation on one core: activator / minimal forwarder",
            ">= 0.7x",
            f"{vs_fwd:.2f}x ({act:,.0f} vs {fwd:,.0f} req/s)",
            vs_fwd >= 0.7,
            "" if vs_fwd >= 0.7 else f"needs {0.7 * fwd:,.0f} req/s",
            group=GROUP,
        )
    )
    cpu = med(this, "cpu_us")
    others = ", ".join(f"{name} {med(name, 'cpu_us'):.0f} us" for name in (previous, FORWARDER, HAPROXY) if name)
    sec.add_target(
        Target(
            "CPU per proxied request (activator)",
            "<= 80 us",
            f"{cpu:.0f} us ({others})",
            cpu <= 80,
            "" if cpu <= 80 else f"{cpu - 80:.0f} us over",
            group=GROUP,
        )
    )


def _latency(ctx: c.Ctx, sec: Section, direct: Endpoint, proxies: list[Endpoint], this: str) -> None:
    seconds, warmup, rounds = ctx.dur(10, 1), ctx.dur(2, 0.5), ctx.n(3, 1)
    label = "isolated (SCHED_RR)" if ctx.rt else "normal priority"
    targets = [direct, *proxies]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with c.realtime(ctx, [proc.pid for _, _, proc in targets]):
        for shape, args in SHAPES:
            for r in range(rounds):
                for name, port, _ in targets:
                    c.log(f"engine (c) 1000 req/s, {shape}, {name}, round {r + 1}/{rounds}")
                    runs.setdefault((shape, name), []).append(c.open_loop(ctx, port, seconds, warmup, ctx.rt, args))
    if ctx.rt:
        sec.notes.append(
            "(c) ran with nginx, the proxies and the load generator at real-time priority (`chrt -r 1`) "
            "for the light-load runs only, as in the overhead section."
        )
    for shape, _ in SHAPES:
        base = runs[(shape, direct[0])]

        def added(name: str, p: float, shape: str = shape, base: list[dict[str, Any]] = base) -> float:
            return c.added_ms(runs[(shape, name)], base, p) if name != direct[0] else float("nan")

        rows = []
        for name, _, _ in targets:
            rs = runs[(shape, name)]
            rows.append(
                [
                    name,
                    sum(x["n"] for x in rs),
                    c.median([c.pct(x["lat"], 50) for x in rs]),
                    c.median([c.pct(x["lat"], 99) for x in rs]),
                    c.median([c.pct(x["lat"], 99.9) for x in rs]),
                    max(max(x["lat"], default=0) for x in rs),
                    added(name, 50),
                    added(name, 99),
                    _ratio(added(name, 50), added(FORWARDER, 50)),
                    _ratio(added(name, 99), added(FORWARDER, 99)),
                    sum(x["failed"] for x in rs),
                ]
            )
        sec.tables.append(
            Table(
                f"(c) latency at 1,000 req/s, {shape}, {label} ({rounds} interleaved rounds of {seconds:g} s after "
                f"{warmup:g} s warm-up, open loop, latency from the scheduled send time; ms; added = target - direct, "
                "per round, median over rounds)",
                [
                    "target",
                    "requests",
                    "p50",
                    "p99",
                    "p99.9",
                    "max",
                    "added p50",
                    "added p99",
                    "added p50 / forwarder's",
                    "added p99 / forwarder's",
                    "failed",
                ],
                rows,
            )
        )
        r50, r99 = _ratio(added(this, 50), added(FORWARDER, 50)), _ratio(added(this, 99), added(FORWARDER, 99))
        # A forwarder no slower than direct in a run (noise) leaves no ratio to judge.
        measurable = added(FORWARDER, 50) > 0 and added(FORWARDER, 99) > 0
        met = measurable and r50 <= 1.3 and r99 <= 1.3
        sec.add_target(
            Target(
                f"added latency at 1,000 req/s, {shape}: activator / minimal forwarder",
                "<= 1.3x at p50 and p99",
                f"p50 {r50:.2f}x (+{added(this, 50):.3f} vs +{added(FORWARDER, 50):.3f} ms), p99 {r99:.2f}x "
                f"(+{added(this, 99):.3f} vs +{added(FORWARDER, 99):.3f} ms)",
                met,
                ""
                if met
                else f"p50 needs +{1.3 * added(FORWARDER, 50):.3f} ms, p99 +{1.3 * added(FORWARDER, 99):.3f} ms"
                if measurable
                else "not judged: the forwarder added no latency over direct in this run (noise)",
                group=GROUP,
            )
        )


def _slot_held(ctx: c.Ctx, procs: c.Procs, sec: Section, this: str) -> None:
    seconds, rounds = ctx.dur(5, 1), ctx.n(3, 1)
    pod_proc, pod = c.start_twowrite_pod(procs, "slot-pod", one_write=True, nodelay=True)
    addr = f"127.0.0.1:{pod}"
    service = {"slot": {"hosts": ["*"], "cc": 1, "queue_depth": 1000, "pods": [addr]}}
    # (name, port, clients, process): direct with one client is the floor, the client's own turnaround
    targets: list[tuple[str, int, int, harness.Process]] = [("direct, one client", pod, 1, pod_proc)]
    act = c.start_activator(procs, "activator-cc1", service)
    targets.append((this, act.port, SLOT_CLIENTS, act.process))
    prev = ctx.baseline.start(procs, "activator-previous-cc1", service) if ctx.baseline else None
    if prev:
        targets.append((prev.label, prev.port, SLOT_CLIENTS, prev.process))
    compiled = ctx.compiled.start(procs, "activator-compiled-cc1", service) if ctx.compiled else None
    if compiled:
        targets.append((compiled.label, compiled.port, SLOT_CLIENTS, compiled.process))
    if ctx.tools.get("haproxy"):
        hap = c.start_haproxy(procs, "haproxy-cc1", [("pod", addr)], maxconn=1, balance="first")
        targets.append((HAPROXY, hap.port, SLOT_CLIENTS, hap.proc))
    path = f"/delay?ms={SLOT_SERVICE_MS}"
    measured: dict[str, list[dict[str, float]]] = {}
    with c.realtime(ctx, [proc.pid for *_, proc in targets]):
        for r in range(rounds):
            for name, port, clients, _ in targets:
                c.log(f"engine (d) slot hand-off, {name}, {clients} clients, round {r + 1}/{rounds}")
                closed = ["closed", "--port", str(port), "--path", path, "--clients", str(clients), "--duration"]
                if r == 0 and not ctx.quick:  # warm-up: the proxy's pod connection open, code paths hot
                    c.run_loadgen(ctx, [*closed, "1"], rt=True)
                c.reset_pods([pod])
                res = c.run_loadgen(ctx, [*closed, str(seconds)], rt=True)
                measured.setdefault(name, []).append(_hand_off(res, c.pod_stats([pod])[0]))
    rows = []
    for name, _, clients, _ in targets:
        ms = measured[name]

        def med(key: str, ms: list[dict[str, float]] = ms) -> float:
            return c.median([m[key] for m in ms])

        rows.append(
            [
                name,
                clients,
                int(sum(m["requests"] for m in ms)),
                med("busy"),
                med("gap_mean"),
                med("gap_p50"),
                med("gap_p99"),
                med("by_throughput"),
                int(max(m["peak"] for m in ms)),
                int(sum(m["failed"] for m in ms)),
            ]
        )
    sec.tables.append(
        Table(
            f"(d) slot held beyond the pod's own time: one pod, `container_concurrency: 1` / `maxconn 1`, "
            f"{SLOT_SERVICE_MS} ms per request, closed loop of {SLOT_CLIENTS} clients through each proxy, "
            f"{seconds:g} s, median of {rounds} interleaved rounds; ms",
            [
                "path",
                "clients",
                "requests",
                "pod busy per request",
                "pod idle before a request: mean",
                "p50",
                "p99",
                "from throughput",
                "pod peak",
                "failed",
            ],
            rows,
        )
    )
    held = [m["gap_mean"] for m in measured.get(this, [])]
    gap = c.median(held)
    others = ", ".join(f"{name} {c.median([m['gap_mean'] for m in measured[name]]):.3f} ms" for name, *_ in targets[2:])
    sec.add_target(
        Target(
            "slot held beyond the pod's own time (cc=1, every request waiting)",
            "<= 0.2 ms",
            f"{gap:.3f} ms mean per hand-off ({others})",
            gap <= 0.2,
            "" if gap <= 0.2 else f"{gap - 0.2:.3f} ms over",
            group=GROUP,
        )
    )


def _hand_off(res: dict[str, Any], stats: dict[str, Any]) -> dict[str, float]:
    """One run's hand-off figures (ms) from the load generator's result and the pod's own stats."""
    ok = [(s, d) for s, d, st in zip(res["sent"], res["done"], res["status"], strict=True) if st == 200]
    busy = c.mean(stats["busy_us"]) / 1000
    gaps = [g / 1000 for g in stats["gaps_us"]]
    span = (max(d for _, d in ok) - min(s for s, _ in ok)) * 1000 if ok else float("nan")
    return {
        "requests": len(ok),
        "failed": len(res["status"]) - len(ok),
        "busy": busy,
        "gap_mean": c.mean(gaps),
        "gap_p50": c.pct(gaps, 50),
        "gap_p99": c.pct(gaps, 99),
        "by_throughput": (span - len(ok) * busy) / len(ok) if ok else float("nan"),
        "peak": stats["peak"],
    }

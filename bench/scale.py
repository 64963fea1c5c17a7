"""Scale: 10,000 pods in the file, and 10,000 queued requests.

Pods are distinct loopback addresses ``127.x.y.z:PORT`` served by ONE nginx listening on
``0.0.0.0:PORT``: every pod is real (a request to any of them is answered), and only the
pods a test routes to are ever connected.

1. Reload: a file with a 1-pod service ``small`` (the one requests go to) and a service
   ``big`` with N pods (``probe: null``). The file is changed (100 of the big service's
   pods drained, or undrained) and SIGHUP sent; also SIGHUPs with no change. First with
   no traffic: reload time = SIGHUP to the "config reload ... applied" / "no change" log
   line (log timestamps, ms), and the CPU time the process spent on it (/proc). Then
   under a steady open-loop stream of 500 req/s to ``small``: stall = the longest
   latency (from the scheduled send time) of the requests scheduled while the reload
   ran, against the same stream before any reload. The file watcher is set to a long
   interval here so that only the SIGHUP triggers a reload.
2. Per-request cost with 10 vs N pods in the routed service (a separate activator for
   each N, so nothing else differs): first-available (cc 1, wrk -c8: no queueing, 8
   pods busy) and round-robin (cc 100, wrk -c50: every pod used in turn, so N distinct
   upstream pools and connections; a warm-up opens them first).
3. Memory: one pod (``/delay?ms=300000``), cc 1, ``queue_depth: 20000``; M client
   connections each send one request (1 runs, M-1 queue). RSS before and after, per
   queued request; the same for HAProxy (``maxconn 1`` server, as many connections as
   its fd limit allows).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import harness

from . import common as c
from .report import Section, Table, Target

_RELOAD = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \w+ config reload \((\w[^)]*)\)(:? applied|: no change)"
)


def pod_address(i: int, port: int) -> str:
    return f"127.{10 + i // 62500}.{(i // 250) % 250 + 1}.{i % 250 + 1}:{port}"


def _log_reloads(path: Path) -> list[tuple[float, str]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = _RELOAD.match(line)
        if m:
            wall = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
            out.append((wall, m.group(4).strip(": ")))
    return out


def _wait_reload_line(path: Path, count: int, timeout: float = 30.0) -> list[tuple[float, str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = _log_reloads(path)
        if len(logs) >= count:
            return logs
        time.sleep(0.01)
    return _log_reloads(path)


def _reload_test(ctx: c.Ctx, procs: c.Procs, nginx: int, npods: int, sec: Section) -> None:
    pods = [pod_address(i, nginx) for i in range(npods)]

    def services(drained: int) -> dict[str, Any]:
        big = [{"address": a, "drain": True} if i < drained else a for i, a in enumerate(pods)]
        return {
            "small": {"hosts": ["small"], "cc": 100, "pods": [f"127.0.0.1:{nginx}"]},
            "big": {"hosts": ["big"], "cc": 1, "pods": big},
        }

    t_start = time.monotonic()
    act = c.start_activator(
        procs, "activator-reload", services(0), env={"ACTIVATOR_WATCH_INTERVAL": "3600"}, ready_timeout=120
    )
    startup = time.monotonic() - t_start
    rss = harness.rss_kib(act.pid)
    drained = 0

    def trigger(kind: str) -> tuple[float, float]:
        nonlocal drained
        if kind == "change":
            drained = 100 if drained == 0 else 0
            act.rewrite_config(c.activator_config(services(drained)))
        mono, wall = time.monotonic(), time.time()
        act.reload()
        return mono, wall

    # Phase 1, no traffic: wall time (log) and CPU time (/proc) of each reload.
    quiet = ["change", "change", "no change"] * ctx.n(3, 1)
    seen = len(_log_reloads(act.stderr_path))
    quiet_rows = []
    walls: list[float] = []
    cpus: list[float] = []
    for kind in quiet:
        time.sleep(0.3)
        cpu0 = c.cpu_seconds([act.pid])
        _, wall = trigger(kind)
        logs = _wait_reload_line(act.stderr_path, seen + 1)
        cpu = (c.cpu_seconds([act.pid]) - cpu0) * 1000
        seen = len(logs)
        took = (logs[-1][0] - wall) * 1000 if logs else float("nan")
        quiet_rows.append((kind, took, cpu))
        if kind == "change":
            walls.append(took)
            cpus.append(cpu)
    sec.tables.append(
        Table(
            f'reload of a file with {npods:,} pods (+1), no traffic: SIGHUP -> "applied" log line (wall) and the '
            "process's CPU time for it (/proc, 10 ms ticks)",
            ["reload", "runs", "wall ms, median", "wall ms, each", "CPU ms, median", "CPU ms, each"],
            [
                [
                    kind,
                    len(rs),
                    c.median([r[1] for r in rs]),
                    " / ".join(f"{r[1]:.0f}" for r in rs),
                    c.median([r[2] for r in rs]),
                    " / ".join(f"{r[2]:.0f}" for r in rs),
                ]
                for kind in ("change", "no change")
                for rs in [[r for r in quiet_rows if r[0] == kind]]
                if rs
            ],
        )
    )

    # Phase 2: the same reloads under a steady stream of requests to the small service.
    events = ["change", "change", "change", "no change"] if not ctx.quick else ["change", "no change"]
    gap = ctx.dur(2.5, 1.5)
    lead = ctx.dur(2.0, 1.0)
    duration = lead + gap * len(events) + 0.5
    out = ctx.work / "scale-stream.json"
    lg = c.start_loadgen(
        procs,
        "loadgen-stream",
        [
            "open",
            "--port",
            str(act.port),
            "--host-header",
            "small",
            "--rate",
            "500",
            "--duration",
            str(duration),
            "--conns",
            "16",
        ],
        out,
    )
    time.sleep(0.3)  # the generator starts its schedule 0.2 s after it starts
    t0 = time.monotonic()
    sent: list[tuple[float, float, str]] = []  # (monotonic, wall, kind)
    for k, kind in enumerate(events):
        time.sleep(max(0.0, t0 + lead + gap * k - time.monotonic()))
        mono, wall = trigger(kind)
        sent.append((mono, wall, kind))
    res = c.finish_loadgen(procs, lg, out, timeout=duration + 60)
    offset = time.time() - time.monotonic()
    logs = _log_reloads(act.stderr_path)[seen:]
    reqs = [(s, (d - s) * 1000, st) for s, d, st in zip(res["sched"], res["done"], res["status"], strict=True)]
    first = sent[0][0] if sent else float("inf")
    base = [lat for s, lat, st in reqs if res["start"] + 0.5 <= s < first - 0.1]
    failed = sum(1 for _, _, st in reqs if st != 200)
    rows = []
    stall_ms: list[float] = []
    for (mono, wall, kind), logged in zip(sent, logs, strict=False):  # a missing log line is noted below
        done_wall = logged[0]
        took = (done_wall - wall) * 1000
        done_mono = done_wall - offset
        window = [lat for s, lat, st in reqs if mono - 0.002 <= s <= done_mono + 0.002]
        worst = max(window, default=float("nan"))
        rows.append([kind, logged[1], took, len(window), worst, c.pct(window, 50)])
        if kind == "change":
            stall_ms.append(worst)
    sec.tables.append(
        Table(
            "the same reloads under 500 req/s (open loop) to the 1-pod service: the requests scheduled while the "
            "reload ran",
            [
                "reload",
                "logged",
                "SIGHUP -> applied ms",
                "requests during it",
                "max latency during it ms",
                "p50 latency during it ms",
            ],
            rows,
        )
    )
    sec.notes.append(
        f"The stream before any reload: p50 {c.pct(base, 50):.2f} ms, p99 {c.pct(base, 99):.2f} ms, max "
        f"{max(base, default=float('nan')):.2f} ms ({len(base)} requests); {failed} failed in the whole stream. "
        f"Startup with {npods:,} pods: {startup:.2f} s to /readyz; RSS {rss / 1024:.0f} MiB."
    )
    sec.notes.append(
        "Why requests stall during a reload although the file is parsed in the hub's threadpool: the parse is "
        "Python code holding the GIL, and the hub gets the GIL back only every `sys.getswitchinterval()` (5 ms) "
        "and gives it up again at each wait in epoll, so every loop iteration of a request costs up to 5 ms "
        "(the convoy effect); libyaml's compose (Cython) never releases it. Then `diff_configs`, "
        "`Topology.apply` (every tracker of the service) and `Runtime.summary()` run on the hub itself."
    )
    if len(logs) != len(sent):
        sec.notes.append(f"expected {len(sent)} reload log lines, found {len(logs)}")
    full = npods >= 10000
    if walls:
        wall_med = c.median(walls)
        sec.targets.append(
            Target(
                f"reload of {npods:,} pods",
                "<= 200 ms",
                f"{wall_med:.0f} ms median wall ({max(walls):.0f} worst of {len(walls)}), {c.median(cpus):.0f} ms CPU",
                wall_med <= 200 if full else None,
                "" if wall_med <= 200 else f"{wall_med - 200:.0f} ms over",
                why=f"{c.median(cpus):.0f} ms of CPU per reload: the YAML compose (libyaml) and "
                "the config validation in Python (per pod: ipaddress parsing and formatting), "
                "then diff and apply over every pod on the hub.",
            )
        )
        sec.headline.append(f"reload of {npods:,} pods: {wall_med:.0f} ms median wall, {c.median(cpus):.0f} ms CPU")
    if stall_ms:
        worst_stall = max(stall_ms)
        sec.targets.append(
            Target(
                "request stall during that reload",
                "<= 10 ms",
                f"{worst_stall:.1f} ms max latency during a reload (stream before: p99 "
                f"{c.pct(base, 99):.1f}, max {max(base, default=float('nan')):.1f} ms)",
                worst_stall <= 10 if full else None,
                "" if worst_stall <= 10 else f"{worst_stall - 10:.1f} ms over",
                why="the GIL: the threadpool's parse is Python code, so the hub waits up to "
                "`sys.getswitchinterval()` (5 ms) for the GIL at every loop iteration a request "
                "needs; then the diff, the apply over every pod and `Runtime.summary()` run on "
                "the hub without yielding (see the notes of the scale section).",
            )
        )
        sec.headline.append(
            f"longest request during a {npods:,}-pod reload: {worst_stall:.1f} ms "
            f"(stream p99 before: {c.pct(base, 99):.1f} ms)"
        )
    procs.stop(act.process)


def _cost_test(ctx: c.Ctx, procs: c.Procs, nginx: int, npods: int, sec: Section) -> None:
    secs = ctx.dur(10, 1)
    rounds = ctx.n(2, 1)
    results: dict[tuple[str, int], list[c.WrkResult]] = {}
    for n in (10, npods):
        # a pod belongs to one service: the two services use different addresses
        act = c.start_activator(
            procs,
            f"activator-{n}",
            {
                "fa": {"hosts": ["fa"], "cc": 1, "pods": [pod_address(i, nginx) for i in range(n)]},
                "rr": {"hosts": ["rr"], "cc": 100, "pods": [pod_address(100000 + i, nginx) for i in range(n)]},
            },
            ready_timeout=120,
        )
        # warm-up: round-robin touches every pod once per n requests; open their pools
        c.run_wrk(ctx, act.port, 1, connections=8, host="fa")
        c.run_wrk(ctx, act.port, max(1.0, min(8.0, n / 1500 + 1)), connections=50, host="rr")
        for r in range(rounds):
            for policy, conns in (("fa", 8), ("rr", 50)):
                c.log(f"scale: per-request cost, {n} pods, {policy}, round {r + 1}")
                results.setdefault((policy, n), []).append(
                    c.run_wrk(ctx, act.port, secs, connections=conns, host=policy, cpu_pids=[act.pid])
                )
        st = act.status()
        results[("rr-pools", n)] = [len([p for p in st["services"]["rr"]["pods"] if p.get("requests")])]  # type: ignore[list-item]
        procs.stop(act.process)
    rows = []
    ratios = []
    for policy, label, conns in (("fa", "first-available, cc 1", 8), ("rr", "round-robin, cc 100", 50)):
        small = c.median([w.rps for w in results[(policy, 10)]])
        big = c.median([w.rps for w in results[(policy, npods)]])
        cpu_small = c.median([w.cpu_us for w in results[(policy, 10)]])
        cpu_big = c.median([w.cpu_us for w in results[(policy, npods)]])
        ratios.append(cpu_big / cpu_small)
        used = results.get(("rr-pools", npods), [0])[0] if policy == "rr" else 8
        rows.append(
            [
                label,
                conns,
                small,
                big,
                big / small,
                cpu_small,
                cpu_big,
                cpu_big / cpu_small,
                c.median([w.p99_ms for w in results[(policy, 10)]]),
                c.median([w.p99_ms for w in results[(policy, npods)]]),
                used,
            ]
        )
    sec.tables.append(
        Table(
            f"per-request cost, 10 vs {npods:,} pods in the routed service (wrk -t1, {secs:g} s, median of {rounds}; "
            "CPU us/req = activator's CPU time / requests)",
            [
                "policy",
                "wrk -c",
                "req/s, 10 pods",
                f"req/s, {npods:,} pods",
                "req/s ratio",
                "CPU us/req, 10 pods",
                f"CPU us/req, {npods:,} pods",
                "CPU ratio",
                "p99 ms, 10",
                f"p99 ms, {npods:,}",
                "pods that served",
            ],
            rows,
        )
    )
    worst = max(ratios)
    sec.targets.append(
        Target(
            "per-request cost flat in the number of pods",
            f"CPU per request with {npods:,} pods <= 1.1x of 10 pods",
            " / ".join(f"{r:.2f}x" for r in ratios) + " (first-available / round-robin)",
            worst <= 1.1 if npods >= 10000 else None,
            "" if worst <= 1.1 else f"{(worst - 1) * 100:.0f}% more CPU per request",
        )
    )
    sec.headline.append(
        f"per-request CPU cost with {npods:,} vs 10 pods: "
        + " / ".join(f"{r:.2f}x" for r in ratios)
        + " (first-available / round-robin)"
    )


def _memory_test(ctx: c.Ctx, procs: c.Procs, nqueued: int, sec: Section) -> None:
    rows = []
    _, pod = c.start_backend(procs, "slow-pod")
    act = c.start_activator(
        procs,
        "activator-queue",
        {
            "slow": {
                "hosts": ["*"],
                "cc": 1,
                "queue_depth": 20000,
                "queue_timeout": "600s",
                "pods": [f"127.0.0.1:{pod}"],
            }
        },
        max_connections=20000,
    )
    time.sleep(0.5)
    before = harness.rss_kib(act.pid)
    out = ctx.work / "hold.json"
    t0 = time.monotonic()
    holder = c.start_loadgen(
        procs, "loadgen-hold", ["hold", "--port", str(act.port), "--path", "/delay?ms=300000", "--n", str(nqueued)], out
    )
    queued = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            queued = act.status()["services"]["slow"]["queued"]
        except Exception:
            pass
        if queued >= nqueued - 1:
            break
        time.sleep(0.25)
    fill = time.monotonic() - t0
    time.sleep(0.5)
    after = harness.rss_kib(act.pid)
    t1 = time.monotonic()
    readyz = act.admin_get("/readyz").status
    admin_ms = (time.monotonic() - t1) * 1000
    procs.stop(holder, grace=30)
    t2 = time.monotonic()
    left = queued
    while time.monotonic() - t2 < 60:
        try:
            left = act.status()["services"]["slow"]["queued"]
        except Exception:
            pass
        if left == 0:
            break
        time.sleep(0.1)
    cleanup = time.monotonic() - t2
    rows.append(
        [
            "activator",
            queued,
            before / 1024,
            after / 1024,
            (after - before) / max(queued, 1),
            f"{fill:.1f} s to queue them; /readyz answered {readyz} in {admin_ms:.0f} ms with all queued; "
            f"{cleanup:.1f} s for the queue to empty after the clients hung up (left: {left})",
        ]
    )
    procs.stop(act.process)
    sec.headline.append(
        f"{queued:,} queued requests: activator RSS {before / 1024:.0f} -> {after / 1024:.0f} MiB "
        f"({(after - before) / max(queued, 1):.1f} KiB per queued request)"
    )
    if ctx.tools.get("haproxy"):
        _, pod2 = c.start_backend(procs, "slow-pod-2")
        n_h = min(nqueued, 8500)
        hap = c.start_haproxy(
            procs, "haproxy-queue", [("slow", f"127.0.0.1:{pod2}")], maxconn=1, balance="first", global_maxconn=9000
        )
        time.sleep(0.5)
        before = harness.rss_kib(hap.proc.pid)
        holder = c.start_loadgen(
            procs,
            "loadgen-hold-haproxy",
            ["hold", "--port", str(hap.port), "--path", "/delay?ms=300000", "--n", str(n_h)],
            ctx.work / "hold-h.json",
        )
        held = int(holder.wait_output(r"^HELD (\d+)", timeout=300).group(1))
        time.sleep(1.0)
        after = harness.rss_kib(hap.proc.pid)
        procs.stop(holder, grace=30)
        rows.append(
            [
                "HAProxy",
                held,
                before / 1024,
                after / 1024,
                (after - before) / max(held, 1),
                "global maxconn 9000 (fd limit): fewer connections",
            ]
        )
        procs.stop(hap.proc)
    sec.tables.append(
        Table(
            "memory with queued requests (1 pod, cc 1, every other request queued)",
            ["proxy", "queued", "RSS before MiB", "RSS after MiB", "KiB per queued", "notes"],
            rows,
        )
    )


def run(ctx: c.Ctx) -> Section:
    npods = ctx.n(10000, 2000)
    nqueued = ctx.n(10000, 1000)
    sec = Section("scale", f"Scale: {npods:,} pods in the file, {nqueued:,} queued requests")
    sec.intro = (
        "Pods are distinct loopback addresses `127.x.y.z:PORT`, all served by one nginx listening on "
        "`0.0.0.0:PORT`, `probe: null`. activator on cpu1, nginx and the load on cpu0, normal priority "
        "(not real-time: with SCHED_RR on one core the hub thread does not get the GIL back from the "
        "threadpool's parse at all, which is not what production sees)."
    )
    with c.Procs(ctx, "scale") as procs:
        _, nginx = c.start_nginx(procs, any_address=True)
        c.log(f"scale: reload with {npods} pods")
        _reload_test(ctx, procs, nginx, npods, sec)
        c.log(f"scale: per-request cost 10 vs {npods} pods")
        _cost_test(ctx, procs, nginx, npods, sec)
        c.log(f"scale: memory with {nqueued} queued")
        _memory_test(ctx, procs, nqueued, sec)
    return sec

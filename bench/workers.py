"""Workers: throughput of ``workers: 1`` vs ``workers: 2`` in front of nginx.

Unpinned (the kernel spreads the processes over both cores; wrk and nginx share them
too), wrk -t2 -c100. ``container_concurrency: 200`` with one pod, so with two workers
each owns 100 slots and nothing queues. The same for HAProxy ``nbthread 1`` vs 2 would
be a different comparison (threads, not processes), so HAProxy is not run here.
"""

from __future__ import annotations

from . import common as c
from .report import Section, Table


def run(ctx: c.Ctx) -> Section:
    sec = Section("workers", "Workers: one process vs two (SO_REUSEPORT), unpinned")
    secs = ctx.dur(10, 1)
    rounds = ctx.n(3, 1)
    sec.intro = (
        f"activator `workers: 1` vs `workers: 2`, `container_concurrency: 200`, one nginx pod; wrk -t2 -c100, "
        f"{secs:g} s, median of {rounds} interleaved rounds; nothing pinned (2 CPUs shared by wrk, nginx "
        "and the activator processes)."
    )
    results: dict[int, list[c.WrkResult]] = {}
    with c.Procs(ctx, "workers") as procs:
        _, nginx = c.start_nginx(procs, role=None)
        service = {"web": {"hosts": ["*"], "cc": 200, "queue_depth": 1000, "pods": [f"127.0.0.1:{nginx}"]}}
        acts = {
            n: c.start_activator(procs, f"activator-w{n}", service, role=None, workers=n, ready_timeout=60)
            for n in (1, 2)
        }
        for act in acts.values():  # warm-up
            c.run_wrk(ctx, act.port, 1, connections=100, threads=2, role=None)
        for r in range(rounds):
            for n, act in acts.items():
                c.log(f"workers: {n} worker(s), round {r + 1}/{rounds}")
                results.setdefault(n, []).append(
                    c.run_wrk(ctx, act.port, secs, connections=100, threads=2, role=None, cpu_pids=[act.pid])
                )
    one = c.median([w.rps for w in results[1]])
    rows = []
    for n, ws in results.items():
        rps = c.median([w.rps for w in ws])
        rows.append(
            [
                n,
                rps,
                " / ".join(f"{w.rps:,.0f}" for w in ws),
                c.median([w.p50_ms for w in ws]),
                c.median([w.p99_ms for w in ws]),
                c.median([w.cpu_us for w in ws]),
                rps / one,
                sum(w.errors + w.non2xx for w in ws),
            ]
        )
    sec.tables.append(
        Table(
            "throughput by number of worker processes",
            [
                "workers",
                "req/s (median)",
                "rounds",
                "p50 ms",
                "p99 ms",
                "CPU us/req (all workers)",
                "scaling vs 1",
                "errors",
            ],
            rows,
        )
    )
    two = c.median([w.rps for w in results[2]])
    sec.headline.append(
        f"workers: 2 / workers: 1 throughput: **{two / one:.2f}x** ({two:,.0f} vs {one:,.0f} req/s, "
        "2 cores shared with wrk and nginx)"
    )
    sec.notes.append(
        "With 2 cores and the load generator and nginx on the same cores, 2x is out of reach: "
        "the ratio shows how much of the second core the second worker turns into throughput."
    )
    return sec

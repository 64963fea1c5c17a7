"""Churn: drain one pod and add another every second, under steady load.

Six pods (``tests/backend.py``, ``/delay?ms=50``), ``container_concurrency: 1``, four
listed at a time: every second the oldest listed pod is removed and the next one of
the ring is added (so a pod comes back 2 s after it was removed). Load: closed loop,
16 clients (more clients than slots: there is always a queue).

- activator: the YAML is rewritten (write + atomic rename) and picked up by its file
  watcher (``ACTIVATOR_WATCH_INTERVAL=0.2`` so that each edit is applied before the
  next one; the default is 1 s). A removed pod drains.
- HAProxy: master-worker (``-W``), the config file is rewritten the same way and the
  master gets SIGUSR2 (what ``systemctl reload haproxy`` does): a new worker starts
  with every server's count at zero while the old one finishes its requests.

Failed = non-2xx or transport errors seen by the clients. A request that found its
kept-alive connection closed before any byte of a response (HAProxy's old worker
closing idle connections on reload) is retried once on a fresh connection, as HTTP
clients do, and is counted in "retried", not in "failed". Peak per pod is what the
pod itself saw.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import harness

from . import common as c
from .report import Section, Table, Target

RING = 6
LISTED = 4
SERVICE_MS = 50
CLIENTS = 16


def _window(k: int) -> list[int]:
    return [(k + i) % RING for i in range(LISTED)]


def _drive(
    procs: c.Procs, port: int, pods: list[int], seconds: float, edit: Callable[[list[int]], None]
) -> dict[str, Any]:
    c.reset_pods(pods)
    out = procs.ctx.work / f"churn-{port}.json"
    lg = c.start_loadgen(
        procs,
        f"loadgen-{port}",
        [
            "closed",
            "--port",
            str(port),
            "--path",
            f"/delay?ms={SERVICE_MS}",
            "--clients",
            str(CLIENTS),
            "--duration",
            str(seconds),
            "--drain",
            "30",
        ],
        out,
    )
    t0 = time.monotonic()
    k = 0
    edits = 0
    while True:
        k += 1
        at = t0 + k
        if at > t0 + seconds - 0.5:
            break
        time.sleep(max(0.0, at - time.monotonic()))
        edit(_window(k))
        edits += 1
    res = c.finish_loadgen(procs, lg, out, timeout=seconds + 60)
    stats = c.pod_stats(pods)
    ok = [(s, d) for s, d, st in zip(res["sent"], res["done"], res["status"], strict=True) if 200 <= st < 300]
    lat = [(d - s) * 1000 for s, d in ok]
    non2xx = sum(1 for st in res["status"] if st and not 200 <= st < 300)
    transport = sum(1 for st in res["status"] if st == 0)
    return {
        "requests": len(res["status"]),
        "ok": len(ok),
        "non2xx": non2xx,
        "transport": transport,
        "retried": res["retried"],
        "errors": res["errors"],
        "lat": lat,
        "edits": edits,
        "peaks": [s["peak"] for s in stats],
        "counts": [s["count"] for s in stats],
        "seconds": seconds,
    }


def run(ctx: c.Ctx) -> Section:
    sec = Section("churn", "Churn: one pod drained and one added every second, under load")
    seconds = ctx.dur(20, 3)
    sec.intro = (
        f"{RING} pods (`/delay?ms={SERVICE_MS}`), `container_concurrency: 1` / `maxconn 1`, {LISTED} listed "
        f"at a time; every second the oldest listed pod is removed and the next one of the ring added "
        f"(a pod comes back 2 s after its removal). {CLIENTS} closed-loop clients, {seconds:g} s. "
        "activator: YAML rewritten with an atomic rename, applied by its file watcher "
        "(`ACTIVATOR_WATCH_INTERVAL=0.2`). HAProxy 2.6: master-worker `-W`, config file rewritten the "
        "same way, SIGUSR2 to the master (= `systemctl reload haproxy`). `balance first` for HAProxy, "
        "first-available for activator."
    )
    have_haproxy = ctx.tools.get("haproxy") is not None
    results: dict[str, dict[str, Any]] = {}
    with c.Procs(ctx, "churn") as procs:
        pods = [c.start_backend(procs, f"pod{i}")[1] for i in range(RING)]
        addrs = [f"127.0.0.1:{p}" for p in pods]

        def service(window: list[int]) -> dict[str, Any]:
            return {
                "pods": {
                    "hosts": ["*"],
                    "cc": 1,
                    "queue_depth": 1000,
                    "queue_timeout": "30s",
                    "pods": [addrs[i] for i in window],
                }
            }

        act = c.start_activator(procs, "activator", service(_window(0)), env={"ACTIVATOR_WATCH_INTERVAL": "0.2"})

        def edit_activator(window: list[int]) -> None:
            act.rewrite_config(c.activator_config(service(window)))

        c.run_loadgen(
            ctx, ["closed", "--port", str(act.port), "--path", "/delay?ms=1", "--clients", "4", "--duration", "0.5"]
        )
        c.log(f"churn: activator, {seconds:g} s")
        results["activator"] = _drive(procs, act.port, pods, seconds, edit_activator)
        st = act.status()
        results["activator"]["reload_error"] = st["config"]["last_error"]
        results["activator"]["left_in_flight"] = sum(s["in_flight"] for s in st["services"].values())
        procs.stop(act.process)

        if have_haproxy:
            hap = c.start_haproxy(
                procs,
                "haproxy",
                [(f"pod{i}", addrs[i]) for i in _window(0)],
                maxconn=1,
                balance="first",
                master_worker=True,
            )

            def edit_haproxy(window: list[int]) -> None:
                harness.write_atomic(
                    hap.config,
                    c.haproxy_cfg(hap.port, [(f"pod{i}", addrs[i]) for i in window], maxconn=1, balance="first"),
                )
                hap.proc.signal(signal.SIGUSR2)

            c.run_loadgen(
                ctx, ["closed", "--port", str(hap.port), "--path", "/delay?ms=1", "--clients", "4", "--duration", "0.5"]
            )
            c.log(f"churn: HAProxy, {seconds:g} s")
            results["HAProxy"] = _drive(procs, hap.port, pods, seconds, edit_haproxy)
            results["HAProxy"]["workers_left"] = len(c.children_of(hap.proc.pid))
            alerts = [line for line in hap.proc.stderr_text().splitlines() if "ALERT" in line]
            if alerts:
                sec.notes.append(f"HAProxy alerts during the reloads: {alerts[:3]}")

    rows = []
    for name, r in results.items():
        over = sum(1 for p in r["peaks"] if p > 1)
        rows.append(
            [
                name,
                r["edits"],
                r["requests"],
                r["ok"] / r["seconds"],
                r["non2xx"] + r["transport"],
                r["non2xx"],
                r["transport"],
                r["retried"],
                c.pct(r["lat"], 50),
                c.pct(r["lat"], 99),
                max(r["lat"], default=0),
                " / ".join(str(p) for p in r["peaks"]),
                over,
                " / ".join(str(n) for n in r["counts"]),
            ]
        )
    sec.tables.append(
        Table(
            "failures and peak concurrency per pod (pods 1..6; cc = 1, so any peak above 1 is an overcommit)",
            [
                "proxy",
                "edits",
                "requests",
                "ok req/s",
                "failed",
                "non-2xx",
                "transport errors",
                "retried (stale keep-alive)",
                "latency p50 ms",
                "p99 ms",
                "max ms",
                "peak per pod",
                "pods above cc",
                "requests per pod",
            ],
            rows,
        )
    )
    a = results.get("activator")
    if a:
        failed = a["non2xx"] + a["transport"]
        peak = max(a["peaks"])
        sec.targets.append(
            Target(
                "churn: failed requests",
                "0",
                f"{failed} of {a['requests']}",
                failed == 0,
                "" if failed == 0 else f"{failed} failed",
            )
        )
        sec.targets.append(
            Target(
                "churn: no pod above cc",
                "peak <= 1 on every pod",
                f"max peak {peak}",
                peak <= 1,
                "" if peak <= 1 else f"peak {peak}",
            )
        )
        if a.get("reload_error"):
            sec.notes.append(f"activator reported a reload error: {a['reload_error']}")
        if a.get("left_in_flight"):
            sec.notes.append(f"activator still had {a['left_in_flight']} in flight after the run")
        h = results.get("HAProxy")
        line = f"churn ({a['edits']} edits): activator {failed} failed, max pod peak {peak}"
        if h:
            line += (
                f"; HAProxy {h['non2xx'] + h['transport']} failed (+{h['retried']} stale keep-alive retries), "
                f"max pod peak {max(h['peaks'])} ({sum(1 for p in h['peaks'] if p > 1)} of {RING} pods above cc)"
            )
        sec.headline.append(line)
    if "HAProxy" in results:
        sec.notes.append(
            "HAProxy's new worker starts every server's connection count at zero while the old worker "
            "still runs (and still drains its own queue onto) the same pods: a cc=1 pod can get one "
            "request from each, which is the overcommit in 'peak per pod'. activator applies the new "
            "file inside the running process; the pods' in-flight counts survive the edit."
        )
        sec.notes.append(f"HAProxy worker processes still alive at the end: {results['HAProxy'].get('workers_left')}")
    return sec

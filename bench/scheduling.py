"""Scheduling: four one-request-at-a-time pods, Poisson arrivals, who waits how long.

4 pods (``tests/backend.py``, ``/delay?ms=20``: a 20 ms service time) with
``container_concurrency: 1``; Poisson arrivals, open loop, at 70% and 90% utilisation
(rate = util x pods / service time), the same seeded arrival sequence for both proxies.
activator: ``lb_policy: auto`` (first-available for cc 1), FIFO queue. HAProxy:
``balance first``, ``server ... maxconn 1``, the backend queue, ``timeout queue``.

Queue wait is what each proxy logs itself: activator's access log ``Tw=`` (arrival to
slot) and HAProxy's ``%Tw`` (time in its queues), both in whole ms, HAProxy's sent to a
UDP syslog socket the bench opens. Client-side latency (from the scheduled send time)
is reported too. Pod utilisation = requests served x 20 ms / run time; peak concurrency
per pod is what the pod itself saw (``/_stats``).
"""

from __future__ import annotations

import re
import socket
import threading
import time
from typing import Any

from . import common as c
from .report import Section, Table, Target

SERVICE_MS = 20
PODS = 4


class Syslog:
    """A UDP syslog sink for HAProxy's log lines (a thread; lines kept in memory)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.lines: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            self.lines.append(data.decode("latin-1", "replace"))

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines

    def close(self) -> None:
        self._stop = True
        self._thread.join(1)
        self.sock.close()


_TW = re.compile(r"\bTw=(-?\d+)")


def _reset(ports: list[int]) -> None:
    for p in ports:
        c.http_get(f"http://127.0.0.1:{p}/_reset", method="POST")


def _pod_stats(ports: list[int]) -> list[dict[str, Any]]:
    return [c.http_json(f"http://127.0.0.1:{p}/_stats") for p in ports]


def _one(ctx: c.Ctx, port: int, rate: float, count: int, pods: list[int]) -> dict[str, Any]:
    _reset(pods)
    res = c.run_loadgen(ctx, ["open", "--port", str(port), "--path", f"/delay?ms={SERVICE_MS}", "--poisson",
                              "--seed", "8", "--rate", f"{rate:.3f}", "--count", str(count), "--conns", "64",
                              "--drain", "60"], rt=True)
    stats = _pod_stats(pods)
    ok = [(s, d) for s, d, st in zip(res["sched"], res["done"], res["status"]) if st == 200]
    lat = [(d - s) * 1000 for s, d in ok]
    span = max(res["done"]) - min(res["sched"])
    return {
        "lat": lat,
        "failed": len(res["status"]) - len(ok),
        "span": span,
        "counts": [s["count"] for s in stats],
        "peaks": [s["peak"] for s in stats],
        "retried": res["retried"],
    }


def _closed(ctx: c.Ctx, port: int, clients: int, seconds: float) -> float:
    """Seconds per completed request over a closed-loop run."""
    res = c.run_loadgen(ctx, ["closed", "--port", str(port), "--path", f"/delay?ms={SERVICE_MS}", "--clients",
                              str(clients), "--duration", str(seconds)], rt=True)
    ok = [(s, d) for s, d, st in zip(res["sent"], res["done"], res["status"]) if st == 200]
    span = max(d for _, d in ok) - min(s for s, _ in ok)
    return span / len(ok) if ok else float("nan")


def run(ctx: c.Ctx) -> Section:
    sec = Section("scheduling", "Scheduling: cc=1 pods, Poisson arrivals, queue wait (activator vs HAProxy)")
    sec.intro = (f"{PODS} pods (`tests/backend.py`, `/delay?ms={SERVICE_MS}`), `container_concurrency: 1`; "
                 "Poisson arrivals (open loop, seeded: the same arrival times for both proxies) at a rate of "
                 "util x pods / S, where S is the pod's real service time measured first (one client, direct: "
                 "the 20 ms sleep plus the pod's own overhead). activator: "
                 "`lb_policy: auto` = first-available, FIFO queue, `access_log: true` (for `Tw=`). HAProxy: "
                 "`balance first`, `server ... maxconn 1`, backend queue, `timeout queue 30s`, `log-format` with "
                 "`%Tw` to a UDP socket of the bench. Queue wait = each proxy's own `Tw` (whole ms). "
                 "Utilisation per pod = served x S / run time. Pods, proxies and the load generator run at "
                 "real-time priority (`chrt -r 1`) when available: a light load, measured without the other "
                 "sessions' noise.")
    count = ctx.n(3000, 300)
    utils = (0.7, 0.9)
    have_haproxy = ctx.tools.get("haproxy") is not None
    results: dict[tuple[str, float], dict[str, Any]] = {}
    syslog = Syslog()
    try:
        with c.Procs(ctx, "scheduling") as procs:
            pods = [c.start_backend(procs, f"pod{i}")[1] for i in range(PODS)]
            addrs = [f"127.0.0.1:{p}" for p in pods]
            service = {"pods": {"hosts": ["*"], "cc": 1, "queue_depth": 10000, "queue_timeout": "60s",
                                "pods": addrs}}
            act = c.start_activator(procs, "activator", service, access_log=True)
            hap = c.start_haproxy(procs, "haproxy", [(f"pod{i}", a) for i, a in enumerate(addrs)], maxconn=1,
                                  balance="first", log_port=syslog.port) if have_haproxy else None
            if ctx.rt:
                c.set_rt([p.pid for p in procs.procs], True)
            # warm-up: connections to the pods, code paths
            for port in [act.port] + ([hap.port] if hap else []):
                c.run_loadgen(ctx, ["open", "--port", str(port), "--path", f"/delay?ms={SERVICE_MS}", "--rate", "50",
                                    "--count", "50", "--conns", "8"], rt=True)
            # The pod's real service time, and each proxy's time per request per slot when
            # every slot is busy and requests wait (16 clients, 4 pods): the difference is
            # how long a proxy keeps a slot beyond the pod's own work (hand-off included).
            service = _closed(ctx, pods[0], 1, ctx.dur(3, 1))
            slot_time = {"direct (1 client, 1 pod)": service}
            for name, target in (("activator", act), ("HAProxy", hap)):
                if target is not None:
                    slot_time[name] = _closed(ctx, target.port, 16, ctx.dur(4, 1.5)) * PODS
            for util in utils:
                rate = util * PODS / service
                for name, target in (("activator", act), ("HAProxy", hap)):
                    if target is None:
                        continue
                    c.log(f"scheduling: {name} at {util:.0%} ({rate:.0f} req/s, {count} requests)")
                    if name == "activator":
                        offset = act.proc.stdout.stat().st_size
                    else:
                        syslog.take()
                    r = _one(ctx, target.port, rate, count, pods)
                    if name == "activator":
                        with open(act.proc.stdout, "rb") as f:
                            f.seek(offset)
                            text = f.read().decode("latin-1")
                        tw = [int(m.group(1)) for m in _TW.finditer(text)]
                    else:
                        time.sleep(0.3)
                        tw = [int(m.group(1)) for line in syslog.take() for m in _TW.finditer(line)]
                    r["tw"] = [x for x in tw if x >= 0]
                    r["rate"] = rate
                    r["service"] = service
                    results[(name, util)] = r
            if ctx.rt:
                c.set_rt([p.pid for p in procs.procs], False)
    finally:
        syslog.close()

    sec.tables.append(Table(
        "time per request per slot, every slot busy (closed loop: 1 client direct; 16 clients through each proxy "
        "onto the 4 pods; ms)",
        ["path", "ms per request", "beyond the pod's own"],
        [[name, t * 1000, (t - service) * 1000] for name, t in slot_time.items()]))
    rows = []
    for (name, util), r in results.items():
        util_pods = [n * r["service"] / r["span"] for n in r["counts"]]
        eff = r["rate"] * slot_time.get(name, float("nan")) / PODS
        rows.append([f"{util:.0%}", name, r["rate"], eff, len(r["lat"]), len(r["tw"]), c.mean(r["tw"]), c.pct(r["tw"], 50),
                     c.pct(r["tw"], 99), max(r["tw"], default=0), c.mean(r["lat"]), c.pct(r["lat"], 99),
                     " / ".join(f"{u:.0%}" for u in util_pods), sum(util_pods) / len(util_pods),
                     " / ".join(str(p) for p in r["peaks"]), r["failed"]])
    sec.tables.append(Table(
        f"{count} requests per run; times in ms; per-pod columns are pod1 / pod2 / pod3 / pod4 (file order)",
        ["util", "proxy", "req/s", "util incl. the proxy's slot time", "ok", "Tw samples", "Tw mean", "Tw p50", "Tw p99", "Tw max", "latency mean",
         "latency p99", "utilisation per pod", "mean util", "peak per pod", "failed"], rows))

    ratio_rows = []
    for util in utils:
        a, h = results.get(("activator", util)), results.get(("HAProxy", util))
        if not a or not h:
            continue
        am, hm = c.mean(a["tw"]), c.mean(h["tw"])
        a99, h99 = c.pct(a["tw"], 99), c.pct(h["tw"], 99)
        ratio_rows.append([f"{util:.0%}", am - hm, am / hm if hm else float("nan"), a99 - h99,
                           c.mean(a["lat"]) - c.mean(h["lat"]), max(a["peaks"]), max(h["peaks"])])
        # 5% of HAProxy's mean wait, but never tighter than the logs' 1 ms resolution
        tol = max(0.05 * hm, 1.0)
        ok = abs(am - hm) <= tol
        sec.targets.append(Target(
            f"queue wait vs HAProxy at {util:.0%}", "mean within 5% (or 1 ms, the log resolution)",
            f"{am:.2f} vs {hm:.2f} ms mean ({am / hm if hm else float('nan'):.2f}x); p99 {a99:.0f} vs {h99:.0f} ms",
            ok, "" if ok else f"{am - hm:+.2f} ms ({(am / hm - 1) * 100 if hm else float('nan'):+.0f}%)",
            why=f"activator keeps each slot {(slot_time.get('activator', 0) - service) * 1000:.2f} ms beyond the "
                f"pod's own time per request, HAProxy {(slot_time.get('HAProxy', 0) - service) * 1000:.2f} ms "
                "(hand-off to the next waiter: the response is written to the client, the slot released, the "
                "waiter's greenlet woken and its request built and sent). The same arrivals then load the pods "
                f"at {a['rate'] * slot_time.get('activator', 0) / PODS:.3f} instead of "
                f"{h['rate'] * slot_time.get('HAProxy', 0) / PODS:.3f}, and near saturation the wait grows like "
                "1/(1-load). Less CPU per request shortens the hand-off."))
        sec.headline.append(f"queue wait at {util:.0%}: activator mean {am:.2f} ms / p99 {a99:.0f} ms vs HAProxy "
                            f"{hm:.2f} ms / {h99:.0f} ms")
    if ratio_rows:
        sec.tables.append(Table("activator minus HAProxy (same arrivals)",
                                ["util", "Tw mean diff ms", "Tw mean ratio", "Tw p99 diff ms",
                                 "latency mean diff ms", "activator peak", "HAProxy peak"], ratio_rows))
    sec.notes.append("Tw is whole milliseconds in both logs, so differences under ~1 ms are within resolution. "
                     "A proxy that takes longer per request also holds each pod's slot longer (the slot is held "
                     "until the response is delivered to the client, then handed to the next waiter), so the same "
                     "arrival rate loads the pods more: 'util incl. the proxy's slot time'. Near saturation queue "
                     "wait grows like 1/(1-util), so a fraction of a millisecond per request shows up as a large "
                     "difference at 90%.")
    return sec

"""Fleet: one queue across ``workers: 2``, and slot hand-overs between two activators.

Part 1, one queue across workers. The pods and arrivals of ``bench/scheduling.py``: 4
one-write pods (``tests/backend.py``, ``/delay?ms=20``), ``container_concurrency: 1``;
Poisson arrivals (open loop, the same seeded sequence for every target) at 70% and 90%
utilisation (rate = util x pods / S, S the pod's own time measured first). The same
arrivals go through activator ``workers: 1``, activator ``workers: 2`` (the two workers
share one FIFO queue per service through the supervisor's slot exchange) and HAProxy
(``balance first``, ``maxconn 1`` per server, backend queue), in interleaved rounds.
Queue wait is each proxy's own ``Tw`` (access log, HAProxy's ``%Tw`` over UDP syslog),
latency is the client's (from the scheduled send time). Everything as in scheduling.py:
proxies on cpu1 (both workers and the supervisor too), pods and the load generator on
cpu0, real-time priority when available.

Part 2, hand-over. Two activators (``activators:`` with ``self``, the same ``peers`` and
``secret``) in front of cc=1 pods (``tests/backend.py``, which records its own peak
concurrency), under a steady closed-loop load (more client threads than slots, spread
over both activators, so every slot is contended when a change lands). A change is
rolled like an operator does: every running activator's file rewritten, then SIGHUP to
each; the bench then polls every activator's ``/status`` (every few ms) and records,
from the SIGHUP: when each applied the file (peers and listed pods as in the
file), when the old owner of a moved slot last ran a request on it, when the new owner
may use it (``handover_slots`` 0, nothing ``capped_by``, each pod's ``slots`` what the
division of the file gives: ``activator.core.slots.divide_slots``), and when the new
owner ran its first request on it (the pod's ``requests`` there went up). First a pod
change that moves a slot, applied and reverted a few times; then successive peer and
pod changes (a pod added, drained, removed, replaced; vm-b leaving the fleet as the
README says: out of the load, file without it, stopped once handed over; and joining
again: started with the new file and, harder than the README's order, put into the load
at once, before vm-a is rolled, so it queues or passes requests on while its slots are
on their way). The pod each change adds or takes is the one that moves the most slots
(by the division), so most changes hand slots over. Requests sent, failed (non-200
or transport error; a kept-alive connection found closed before any byte is retried
once, as HTTP clients do, and counted apart) and every pod's own peak.
"""

from __future__ import annotations

import http.client
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import harness

from activator.core.slots import divide_slots, moved_slots

from . import common as c
from .report import Section, Table, Target
from .scheduling import _TW, PODS, SERVICE_MS, UTILS, Syslog, _closed, _one

W1, W2, HAPROXY = "activator workers: 1", "activator workers: 2", "HAProxy"
GROUP = "fleet"
SECRET = "bench-fleet-secret-0123456789abcdef"
SERVICE = "fleet"
NAMES = ("vm-a", "vm-b")
#: Part 2: pods in the pool, listed at the start, client threads, the pods' time.
POOL = 7
LISTED = 4
CLIENTS = 12
HANDOVER_MS = 20


# =======================================================================================
# part 1: one queue across workers


def _queue(ctx: c.Ctx, sec: Section) -> None:
    count = ctx.n(2000, 150)
    rounds = ctx.n(2, 1)
    results: dict[tuple[str, float], list[dict[str, Any]]] = {}
    syslog = Syslog()
    try:
        with c.Procs(ctx, "fleet-queue") as procs:
            pods = [c.start_backend(procs, f"pod{i}")[1] for i in range(PODS)]
            addrs = [f"127.0.0.1:{p}" for p in pods]
            service = {"pods": {"hosts": ["*"], "cc": 1, "queue_depth": 10000, "queue_timeout": "60s", "pods": addrs}}
            acts = {
                W1: c.start_activator(procs, "activator-w1", service, access_log=True),
                W2: c.start_activator(procs, "activator-w2", service, access_log=True, workers=2, ready_timeout=60),
            }
            targets: dict[str, int] = {name: act.port for name, act in acts.items()}
            if ctx.tools.get("haproxy"):
                hap = c.start_haproxy(
                    procs,
                    "haproxy",
                    [(f"pod{i}", a) for i, a in enumerate(addrs)],
                    maxconn=1,
                    balance="first",
                    log_port=syslog.port,
                )
                targets[HAPROXY] = hap.port
            with c.realtime(ctx, [p.pid for p in procs.procs]):
                for port in targets.values():  # warm-up: connections to the pods (each worker's), code paths
                    c.run_loadgen(
                        ctx,
                        [
                            "open",
                            "--port",
                            str(port),
                            "--path",
                            f"/delay?ms={SERVICE_MS}",
                            "--rate",
                            "50",
                            "--count",
                            str(ctx.n(60, 30)),
                            "--conns",
                            "16",
                        ],
                        rt=True,
                    )
                one = ctx.dur(3, 0.8)
                service_s = min(_closed(ctx, pods[0], 1, one), _closed(ctx, pods[0], 1, one, new_connections=True))
                # each target's time per request per slot with every slot busy (16 clients, 4 pods)
                slot_time = {name: _closed(ctx, port, 16, ctx.dur(4, 1.5)) * PODS for name, port in targets.items()}
                for r in range(rounds):
                    for util in UTILS:
                        rate = util * PODS / service_s
                        for name, port in targets.items():
                            c.log(
                                f"fleet: {name} at {util:.0%} ({rate:.0f} req/s, {count} requests), "
                                f"round {r + 1}/{rounds}"
                            )
                            res = _tw_run(ctx, acts.get(name), syslog, port, rate, count, pods)
                            results.setdefault((name, util), []).append(res)
            for name, act in acts.items():
                if not act.is_running():
                    sec.notes.append(f"{name} had exited before the end of part 1")
    finally:
        syslog.close()
    _report_queue(sec, count, rounds, service_s, slot_time, results)


def _tw_run(
    ctx: c.Ctx, act: c.Activator | None, syslog: Syslog, port: int, rate: float, count: int, pods: list[int]
) -> dict[str, Any]:
    """One Poisson run (scheduling.py's), with the proxy's own queue waits: activator's access
    log ``Tw=`` (the supervisor's stdout holds its workers' lines too), else HAProxy's ``%Tw``."""
    offset = act.stdout_path.stat().st_size if act is not None else 0
    if act is None:
        syslog.take()
    res = _one(ctx, port, rate, count, pods)
    lines: list[str] = []
    deadline = time.monotonic() + 2
    while True:  # every answered request's line (they are written as the responses end)
        if act is not None:
            with open(act.stdout_path, "rb") as f:
                f.seek(offset)
                lines = [f.read().decode("latin-1")]
        else:
            lines += syslog.take()
        tw = [int(m.group(1)) for line in lines for m in _TW.finditer(line)]
        if len(tw) >= len(res["lat"]) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    res["tw"] = [x for x in tw if x >= 0]
    res["rate"] = rate
    return res


def _why(service_s: float, slot_time: dict[str, float], rate: float) -> str:
    s1, s2 = slot_time.get(W1, math.nan), slot_time.get(W2, math.nan)
    return (
        f"with every slot busy, workers: 2 keeps each slot {(s2 - service_s) * 1000:.2f} ms beyond the pod's own "
        f"time per request, workers: 1 {(s1 - service_s) * 1000:.2f} ms (a request queued with workers: 2 "
        "crosses the supervisor: its enqueue, the slot's offer, the lend to its worker and the slot's return are "
        "datagrams on a local socket pair, handled by the supervisor on the same core as both workers here); the "
        f"same arrivals then load the pods at {rate * s2 / PODS:.3f} instead of {rate * s1 / PODS:.3f}, and the "
        "wait grows like 1/(1-load). On a shared machine a difference of this size can also be run-to-run noise: "
        "compare the per-round means (and HAProxy's)"
    )


def _pooled(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [x for r in runs for x in r[key]]


def _report_queue(
    sec: Section,
    count: int,
    rounds: int,
    service_s: float,
    slot_time: dict[str, float],
    results: dict[tuple[str, float], list[dict[str, Any]]],
) -> None:
    sec.tables.append(
        Table(
            f"one queue across workers: time per request per slot with every slot busy (16 closed-loop clients "
            f"onto the {PODS} pods, x {PODS} for one slot); S = {service_s * 1000:.2f} ms (the pod alone, one client)",
            ["target", "ms per request per slot", "beyond S"],
            [[name, t * 1000, (t - service_s) * 1000] for name, t in slot_time.items()],
        )
    )
    rows = []
    for (name, util), runs in results.items():
        tw, lat = _pooled(runs, "tw"), _pooled(runs, "lat")
        rows.append(
            [
                f"{util:.0%}",
                name,
                runs[0]["rate"],
                len(lat),
                len(tw),
                c.mean(tw),
                " / ".join(f"{c.mean(r['tw']):.2f}" for r in runs),
                c.pct(tw, 50),
                c.pct(tw, 99),
                max(tw, default=0),
                c.pct(lat, 50),
                c.pct(lat, 99),
                " / ".join(str(max(r["peaks"][i] for r in runs)) for i in range(PODS)),
                sum(r["failed"] for r in runs),
            ]
        )
    sec.tables.append(
        Table(
            f"one queue across workers: {PODS} cc=1 pods, S = {service_s * 1000:.2f} ms, {count} Poisson arrivals "
            f"per run (the same seeded sequence for every target), {rounds} round(s), samples pooled over the "
            "rounds; times in ms",
            [
                "util",
                "target",
                "req/s",
                "ok",
                "Tw samples",
                "Tw mean",
                "Tw mean per round",
                "Tw p50",
                "Tw p99",
                "Tw max",
                "latency p50",
                "latency p99",
                "peak per pod",
                "failed",
            ],
            rows,
        )
    )
    ratio_rows = []
    for util in UTILS:
        one, two, hap = (results.get((name, util)) for name in (W1, W2, HAPROXY))
        if not one or not two:
            continue
        m1, m2 = c.mean(_pooled(one, "tw")), c.mean(_pooled(two, "tw"))
        p1, p2 = c.pct(_pooled(one, "tw"), 99), c.pct(_pooled(two, "tw"), 99)
        mh = c.mean(_pooled(hap, "tw")) if hap else float("nan")
        ratio = m2 / m1 if m1 else float("nan")
        ratio_rows.append(
            [
                f"{util:.0%}",
                ratio,
                m2 - m1,
                p2 / p1 if p1 else float("nan"),
                c.pct(_pooled(two, "lat"), 99) - c.pct(_pooled(one, "lat"), 99),
                m1 / mh if mh else float("nan"),
                m2 / mh if mh else float("nan"),
            ]
        )
        ok = ratio <= 1.10
        sec.add_target(
            Target(
                f"one queue across workers, queue wait at {util:.0%}",
                "workers: 2 mean Tw at most 1.10x workers: 1's",
                f"{ratio:.2f}x ({m2:.2f} vs {m1:.2f} ms mean; p99 {p2:.0f} vs {p1:.0f} ms)",
                ok,
                "" if ok else f"{m2 - m1:+.2f} ms ({(ratio - 1) * 100:+.0f}%)",
                why=_why(service_s, slot_time, one[0]["rate"]),
                group=GROUP,
            )
        )
        if hap:
            sec.headline.append(
                f"queue wait at {util:.0%} (cc=1, same arrivals): workers 1 {m1:.2f} ms, workers 2 {m2:.2f} ms, "
                f"HAProxy {mh:.2f} ms mean"
            )
    if ratio_rows:
        sec.tables.append(
            Table(
                "one queue across workers: workers 2 against workers 1 (and both against HAProxy), same arrivals",
                [
                    "util",
                    "Tw mean ratio w2/w1",
                    "Tw mean diff ms (w2 - w1)",
                    "Tw p99 ratio w2/w1",
                    "latency p99 diff ms (w2 - w1)",
                    "Tw mean w1/HAProxy",
                    "Tw mean w2/HAProxy",
                ],
                ratio_rows,
            )
        )


# =======================================================================================
# part 2: hand-over between two activators


class Load:
    """Client threads in a closed loop, each over kept-alive connections, sending to the
    activators of ``targets`` in turn (the list can be swapped while it runs); every
    outcome counted, the failures kept."""

    def __init__(self, targets: list[str], threads: int, path: str) -> None:
        self.targets = list(targets)
        self.path = path
        self.phase = "start"
        self.sent = 0
        self.ok = 0
        self.retried = 0
        self.failures: list[tuple[str, str, str]] = []  # (activator, phase, what)
        self.busy: list[str | None] = [None] * threads
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, i: int) -> None:
        clients: dict[str, tuple[harness.Client, list[int]]] = {}  # listen -> (client, [requests on it])
        k = i
        while not self._stop.is_set():
            targets = self.targets
            for gone in [t for t in clients if t not in targets]:  # out of the balancer: its connections closed
                clients.pop(gone)[0].close()
            if not targets:
                time.sleep(0.01)
                continue
            target = targets[k % len(targets)]
            k += 1
            self.busy[i] = target
            if target not in self.targets:  # taken out meanwhile (wait_not_busy reads busy after the swap)
                self.busy[i] = None
                continue
            what = self._one(clients, target)
            self.busy[i] = None
            with self._lock:
                self.sent += 1
                if what is None:
                    self.ok += 1
                else:
                    self.failures.append((target, self.phase, what))
        for client, _ in clients.values():
            client.close()

    def _one(self, clients: dict[str, tuple[harness.Client, list[int]]], target: str) -> str | None:
        """One request; None when it was answered 200, else what went wrong."""
        for attempt in range(2):
            if target not in clients:
                clients[target] = (harness.Client(target, timeout=60, host="fleet"), [0])
            client, used = clients[target]
            try:
                resp = client.request("GET", self.path)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                clients.pop(target)[0].close()
                if used[0] and attempt == 0:  # a kept-alive connection closed under us: retried once
                    with self._lock:
                        self.retried += 1
                    continue
                return repr(exc)
            except Exception as exc:  # counted as a failure
                clients.pop(target)[0].close()
                return repr(exc)
            used[0] += 1
            if resp.status != 200:
                return f"{resp.status} {resp.headers.get('X-Activator-Reason') or '-'}"
            if resp.headers.get("Connection", "").lower() == "close":
                clients.pop(target)[0].close()
            return None
        return "retried twice"

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)

    def set_targets(self, targets: list[str]) -> None:
        self.targets = list(targets)

    def wait_not_busy(self, target: str, timeout: float = 30) -> None:
        """Until no thread has a request to ``target`` under way."""
        harness.wait_until(lambda: target not in self.busy, timeout=timeout, interval=0.005)

    def wait_more(self, n: int, timeout: float = 30) -> None:
        goal = self.sent + n
        harness.wait_until(lambda: self.sent >= goal, timeout=timeout, interval=0.01)


@dataclass
class Change:
    """One change as measured: what, the slots it moved, and its times from the SIGHUP (s)."""

    text: str
    peers: list[str]
    listed: int
    moved: int
    applied: dict[str, float] = field(default_factory=dict)  # activator -> applied
    old_idle: float = float("nan")  # the old owners ran nothing more on the moved slots
    usable: float = float("nan")  # every activator's slots as the file divides them, no hand-over pending
    first_use: float = float("nan")  # the new owners ran a request on every moved slot
    new_owner_applied: float = float("nan")
    poll: float = float("nan")  # the mean time between two polls of every activator's /status

    @property
    def last_applied(self) -> float:
        return max(self.applied.values(), default=float("nan"))


class Fleet:
    """Two activators over a pool of cc=1 pods; the files, the rolls and the measurements."""

    def __init__(self, ctx: c.Ctx, procs: c.Procs) -> None:
        self.ctx = ctx
        self.procs = procs
        self.pods = [c.start_backend(procs, f"pod{i}")[1] for i in range(POOL)]
        self.addrs = [f"127.0.0.1:{p}" for p in self.pods]
        self.listed: dict[str, bool] = {a: False for a in self.addrs[:LISTED]}  # address -> drain, in file order
        ports = harness.free_ports(len(NAMES))
        self.address = {name: f"127.0.0.1:{port}" for name, port in zip(NAMES, ports, strict=True)}
        self.peers = list(NAMES)
        self.acts: dict[str, c.Activator] = {}
        self.last_out: dict[str, float] = {a: 0.0 for a in self.addrs}  # when each pod last left the file
        #: the longest wait for a change to be applied and handed over (then it is reported as not)
        self.settle = ctx.dur(20.0, 10.0)

    # -- files ---------------------------------------------------------------------------

    def config(self, name: str) -> dict[str, Any]:
        pods = [{"address": a, "drain": True} if drain else a for a, drain in self.listed.items()]
        service = {SERVICE: {"hosts": ["*"], "cc": 1, "queue_depth": 1000, "queue_timeout": "30s", "pods": pods}}
        config = c.activator_config(service)
        config["listen"] = self.address[name]
        config["activators"] = {"self": name, "peers": {p: self.address[p] for p in self.peers}, "secret": SECRET}
        return config

    def active(self, listed: dict[str, bool] | None = None) -> dict[str, int]:
        return {a: 1 for a, drain in (self.listed if listed is None else listed).items() if not drain}

    def division(self, listed: dict[str, bool] | None = None, peers: list[str] | None = None) -> dict[str, dict]:
        return divide_slots(self.active(listed), self.peers if peers is None else peers)

    def start(self, name: str) -> c.Activator:
        act = self.acts.get(name)
        if act is None:
            build = c.this_tree()  # as start_activator runs it
            act = self.acts[name] = c.Activator(
                self.config(name),
                label=name,
                workdir=self.procs.dir / name,
                command=build.cmd,
                env=build.env,
                cwd=build.cwd,
                wrapper=c.pin(self.ctx, "proxy"),
                start=False,
            )
        else:
            act.rewrite_config(self.config(name))
        self.procs.add(act.start(wait_ready=False).process)
        return act

    def running(self) -> list[str]:
        return [n for n, act in self.acts.items() if act.is_running()]

    def statuses(self, names: list[str]) -> dict[str, dict[str, Any]]:
        out = {}
        for name in names:
            try:
                out[name] = harness.json_request(self.acts[name].admin or "", "GET", "/status", timeout=5)
            except (OSError, harness.HarnessError):
                continue
        return out

    # -- what a /status shows ----------------------------------------------------------

    def pods_of(self, st: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {p["address"]: p for p in st["services"][SERVICE]["pods"]}

    def applied(self, st: dict[str, Any]) -> bool:
        if set(st["activator"]["peers"]) != set(self.peers):
            return False
        shown = {a: p for a, p in self.pods_of(st).items() if p["listed"]}
        return set(shown) == set(self.listed) and all(shown[a]["drain"] == d for a, d in self.listed.items())

    def handed(self, name: str, st: dict[str, Any], division: dict[str, dict]) -> bool:
        svc = st["services"][SERVICE]
        if not self.applied(st) or svc["handover_slots"] or svc["capped_by"]:
            return False
        mine = division.get(name, {})
        pods = self.pods_of(st)
        return all(pods[a]["slots"] == mine.get(a, 0) for a in self.listed)

    # -- a change ------------------------------------------------------------------------

    def roll(self, text: str, names: list[str], old: dict[str, dict]) -> Change:
        """Rewrite the files of ``names``, SIGHUP each, and follow every running activator's
        /status until the new division is in use and each moved slot was used by its new
        owner (or ``settle`` seconds)."""
        new = self.division()
        follow = _Follow(self, names, new, [(a, o, n) for a, o, n in _moves(old, new, self.active())])
        for name in names:
            self.acts[name].rewrite_config(self.config(name))
        t0 = time.monotonic()
        for name in names:
            self.acts[name].reload()
        ch = Change(text, list(self.peers), len(self.active()), moved_slots(old, new))
        follow.run(ch, t0)
        return ch


def _moves(old: dict[str, dict], new: dict[str, dict], active: dict[str, int]) -> list[tuple[str, str, str]]:
    """The slots that move: (pod, old owner, new owner), for the cc=1 pods in both divisions."""
    moves = []
    for a in active:
        was = next((p for p, share in old.items() if share.get(a)), None)
        now = next((p for p, share in new.items() if share.get(a)), None)
        if was is not None and now is not None and was != now:
            moves.append((a, was, now))
    return moves


class _Follow:
    """Polls every running activator's /status after a roll; the times go into a Change."""

    def __init__(self, fl: Fleet, names: list[str], new: dict[str, dict], moves: list[tuple[str, str, str]]) -> None:
        self.fl = fl
        self.names = names
        self.new = new
        self.moves = moves
        self.watch = fl.running()
        before = fl.statuses(self.watch)
        #: each new owner's requests on each moved pod before the change
        self.base = {(a, n): self.requests(before, n, a) for a, _o, n in moves}
        self.idle: dict[str, float] = {}
        self.used: dict[str, float] = {}

    def requests(self, sts: dict[str, dict[str, Any]], name: str, address: str) -> int:
        if name not in sts:
            return 0
        return int(self.fl.pods_of(sts[name]).get(address, {}).get("requests", 0))

    def observe(self, ch: Change, sts: dict[str, dict[str, Any]], now: float) -> None:
        fl = self.fl
        for name in self.names:
            if name not in ch.applied and name in sts and fl.applied(sts[name]):
                ch.applied[name] = now
        for a, was, n in self.moves:
            # the old owner runs nothing more on the pod (once it has the file, if it gets it)
            knows = was not in self.names or was in ch.applied
            if a not in self.idle and was in sts and knows and fl.pods_of(sts[was]).get(a, {}).get("in_flight") == 0:
                self.idle[a] = now
            if a not in self.used and self.requests(sts, n, a) > self.base[(a, n)]:
                self.used[a] = now
        if math.isnan(ch.usable) and len(ch.applied) == len(self.names):
            live = [n for n in self.watch if n in fl.peers]
            if all(n in sts and fl.handed(n, sts[n], self.new) for n in live):
                ch.usable = now

    def run(self, ch: Change, t0: float) -> None:
        deadline = t0 + self.fl.settle
        polls = 0
        while time.monotonic() < deadline:
            sts = self.fl.statuses(self.watch)
            polls += 1
            self.observe(ch, sts, time.monotonic() - t0)
            if not math.isnan(ch.usable) and len(self.used) == len(self.moves):
                break
            time.sleep(0.005)
        ch.poll = (time.monotonic() - t0) / max(polls, 1)
        if not self.moves:
            return
        if len(self.idle) == len(self.moves):
            ch.old_idle = max(self.idle.values())
        if len(self.used) == len(self.moves):
            ch.first_use = max(self.used.values())
        # a peer that was not rolled (one that joins) had the file before: from the roll's last apply
        ch.new_owner_applied = max(ch.applied.get(n, ch.last_applied) for _a, _o, n in self.moves)


def _pick(fl: Fleet, candidates: list[dict[str, bool]]) -> dict[str, bool]:
    """The candidate file that moves the most slots (the first such: the candidates are in ring order)."""
    old = fl.division()
    return max(candidates, key=lambda cand: moved_slots(old, fl.division(cand)))


def _spares(fl: Fleet) -> list[str]:
    """The pods not in the file, the one out longest first."""
    return sorted((a for a in fl.addrs if a not in fl.listed), key=lambda a: fl.last_out[a])


def _candidates(fl: Fleet, key: str) -> list[dict[str, bool]]:
    """The files one change of this kind away from the current one (address -> drain)."""
    now = fl.listed
    active = [a for a, drain in now.items() if not drain]
    spares = _spares(fl)
    if key == "add":
        return [{**now, s: False} for s in spares[:3]]
    if key == "remove":
        return [{k: v for k, v in now.items() if k != a} for a in active]
    if key == "drain":
        return [{**now, a: True} for a in active]
    if key == "drop":
        return [{k: v for k, v in now.items() if not v}]
    if key == "swap":
        return [{(s if k == a else k): v for k, v in now.items()} for a in active for s in spares[:2]]
    if key == "near":  # one or two pods away, simplest first (every pod active)
        out = _candidates(fl, "add") + _candidates(fl, "remove") + _candidates(fl, "swap")
        out += [{**now, s: False, t: False} for s, t in itertools.combinations(spares, 2)]
        out += [{k: v for k, v in now.items() if k not in pair} for pair in itertools.combinations(active, 2)]
        return [cand for cand in out if sum(not d for d in cand.values()) >= 2]
    raise ValueError(key)


def _describe(fl: Fleet, old: dict[str, bool], new: dict[str, bool]) -> str:
    """What a change of the pod list does, in words (pods by their index in the pool)."""

    def pods(addrs: list[str], what: str) -> str:
        return f"{what} pod{'s' * (len(addrs) > 1)} {', '.join(str(fl.addrs.index(a)) for a in addrs)}"

    added = [a for a in new if a not in old]
    removed = [a for a in old if a not in new and not old[a]]
    dropped = [a for a in old if a not in new and old[a]]
    drained = [a for a in new if a in old and new[a] and not old[a]]
    if len(added) == len(removed) == 1 and not dropped and not drained:
        return f"replace pod {fl.addrs.index(removed[0])} by pod {fl.addrs.index(added[0])}"
    parts = [pods(added, "add")] if added else []
    parts += [pods(removed, "remove")] if removed else []
    parts += [pods(dropped, "remove drained")] if dropped else []
    parts += [pods(drained, "drain")] if drained else []
    return "; ".join(parts) or "no change"


#: One cycle of the successive changes (listed pods: 4 5 5 4 . 3 . 4 3 4 4).
CYCLE = ("add", "drain", "drop", "leave", "remove", "join", "add", "remove", "add", "swap")


def _pod_change(fl: Fleet, key: str) -> Change:
    listed = _pick(fl, _candidates(fl, key))
    text = _describe(fl, fl.listed, listed)
    old = fl.division()
    for a in fl.listed:
        if a not in listed:
            fl.last_out[a] = time.monotonic()
    fl.listed = listed
    return fl.roll(text, [n for n in fl.peers if n in fl.running()], old)


def _leave(fl: Fleet, load: Load) -> Change:
    """vm-b leaves (README: out of the balancer, the file without it, stopped once handed over)."""
    b = NAMES[1]
    load.set_targets([fl.address[NAMES[0]]])
    load.wait_not_busy(fl.address[b])
    fl.acts[b].wait_idle(SERVICE, timeout=30)  # what it had queued or forwarded is done
    old = fl.division()
    fl.peers = [NAMES[0]]
    ch = fl.roll("vm-b leaves the fleet", [NAMES[0]], old)
    fl.procs.stop(fl.acts[b].process)
    return ch


def _join(fl: Fleet, load: Load) -> Change:
    """vm-b joins (README: started with the new file first, then the other one rolled). It is
    put into the load as soon as it is ready, before the roll: it must queue for its
    slots or pass the requests on meanwhile."""
    b = NAMES[1]
    old = fl.division()
    fl.peers = list(NAMES)
    act = fl.start(b)
    act.wait_ready()
    load.set_targets([fl.address[n] for n in NAMES])
    load.wait_more(10)
    return fl.roll("vm-b joins the fleet", [NAMES[0]], old)


def _changes(ctx: c.Ctx, sec: Section, fl: Fleet, load: Load, single: list[Change], changes: list[Change]) -> None:
    """The measured changes: first one pod change that moves a slot, applied and reverted
    (into ``single``); then the successive peer and pod changes (into ``changes``)."""
    load.wait_more(ctx.n(200, 60))
    original = dict(fl.listed)
    moving = [cand for cand in _candidates(fl, "near") if moved_slots(fl.division(), fl.division(cand))]
    if moving:
        for _ in range(ctx.n(3, 1)):
            for files in (moving[0], original):
                text = _describe(fl, fl.listed, files)
                load.phase = text
                prev = fl.division()
                fl.listed = dict(files)
                c.log(f"fleet: hand-over, {text}")
                single.append(fl.roll(text, list(NAMES), prev))
                load.wait_more(ctx.n(100, 40))
    else:
        sec.notes.append(
            "no change of one or two pods of this pool moves a slot between the two activators (the "
            "division depends on the pods' ports): the hand-overs are those of the successive changes only"
        )
    n_changes = ctx.n(20, 10)
    for i in range(n_changes):
        key = CYCLE[i % len(CYCLE)]
        load.phase = f"change {i + 1} ({key})"
        c.log(f"fleet: change {i + 1}/{n_changes}: {key}")
        if key == "leave":
            changes.append(_leave(fl, load))
        elif key == "join":
            changes.append(_join(fl, load))
        else:
            changes.append(_pod_change(fl, key))
        load.wait_more(ctx.n(60, 30))
    load.phase = "after the changes"
    load.wait_more(ctx.n(100, 30))


def _handover(ctx: c.Ctx, sec: Section) -> None:
    path = f"/delay?ms={HANDOVER_MS}"
    with c.Procs(ctx, "fleet-handover") as procs:
        fl = Fleet(ctx, procs)
        for name in NAMES:
            fl.start(name)
        for name in NAMES:
            fl.acts[name].wait_ready()
        for name in NAMES:  # a starting activator uses its share once its peers answered
            fl.acts[name].wait_for(lambda st, n=name: fl.handed(n, st, fl.division()), timeout=30)
        c.reset_pods(fl.pods)
        load = Load([fl.address[n] for n in NAMES], CLIENTS, path)
        single: list[Change] = []
        changes: list[Change] = []
        load.start()
        try:
            _changes(ctx, sec, fl, load, single, changes)
        except harness.HarnessError as exc:  # a wait that never ended: reported, with what was measured
            first = str(exc).splitlines()[0]
            sec.notes.append(f"**the hand-over part stopped early** ({load.phase}): {first}")
            c.log(f"fleet: stopped early: {first}")
        finally:
            load.stop()
        idle = {}
        for name in fl.running():
            try:
                fl.acts[name].wait_idle(SERVICE, timeout=15)
                idle[name] = True
            except harness.HarnessError:
                idle[name] = False
        stats = c.pod_stats(fl.pods)
    _report_handover(sec, fl, single, changes, load, stats, idle)


def _ms(x: float) -> float:
    return x * 1000


def _report_handover(
    sec: Section,
    fl: Fleet,
    single: list[Change],
    changes: list[Change],
    load: Load,
    stats: list[dict[str, Any]],
    idle: dict[str, bool],
) -> None:
    def row(ch: Change) -> list[Any]:
        return [
            ch.text,
            ch.moved,
            " / ".join(f"{n} {_ms(t):.0f}" for n, t in sorted(ch.applied.items())) or "not applied",
            _ms(ch.old_idle) if ch.moved else "-",
            _ms(ch.usable),
            _ms(ch.first_use) if ch.moved else "-",
            _ms(ch.usable - ch.new_owner_applied) if ch.moved else "-",
            _ms(ch.first_use - ch.new_owner_applied) if ch.moved else "-",
        ]

    heads = [
        "change",
        "slots moved",
        "applied (ms after SIGHUP)",
        "old owner idle on the moved slots",
        "division in use everywhere",
        "new owner's first request on them",
        "hand-over: usable after the new owner applied",
        "first use after the new owner applied",
    ]
    if single:
        sec.tables.append(
            Table(
                f"hand-over of a moved slot: two activators, {LISTED} cc=1 pods listed, {CLIENTS} closed-loop "
                "clients over both; one pod change applied and reverted (each moves a slot); times in ms from "
                "the SIGHUP unless said otherwise",
                heads,
                [row(ch) for ch in single],
            )
        )
        firsts = [ch.first_use - ch.new_owner_applied for ch in single if not math.isnan(ch.first_use)]
        usables = [ch.usable - ch.new_owner_applied for ch in single if not math.isnan(ch.usable)]
        missing = len(single) - len(firsts)
        sec.headline.append(
            f"hand-over of a moved slot (two activators, under load, {len(single)} changes): used by its new owner "
            f"{c.fmt(_ms(c.median(firsts)), 0)} ms (median; max {c.fmt(_ms(max(firsts, default=math.nan)), 0)} ms) "
            f"after the new owner applied the file; usable after {c.fmt(_ms(c.median(usables)), 0)} ms (median)"
            + (f"; {missing} not used within {fl.settle:.0f} s" if missing else "")
        )
    sec.tables.append(
        Table(
            f"{len(changes)} successive changes under load (two activators, vm-b leaving and joining; "
            f"pool of {POOL} cc=1 pods); times in ms from the SIGHUP",
            ["#", "peers", "pods (active)", *heads],
            [[i + 1, ",".join(ch.peers), ch.listed, *row(ch)] for i, ch in enumerate(changes)],
        )
    )
    peaks = [s["peak"] for s in stats]
    failed = len(load.failures)
    unsettled = [i + 1 for i, ch in enumerate(changes) if math.isnan(ch.usable)]
    sec.tables.append(
        Table(
            "requests and pod peaks through the hand-overs and the successive changes",
            [
                "requests",
                "ok",
                "failed",
                "retried (kept-alive connection closed)",
                f"peak per pod (pods 0..{POOL - 1})",
                "requests per pod",
                "changes not settled",
                "counts back to zero",
            ],
            [
                [
                    load.sent,
                    load.ok,
                    failed,
                    load.retried,
                    " / ".join(str(p) for p in peaks),
                    " / ".join(str(s["count"]) for s in stats),
                    ", ".join(map(str, unsettled)) or "none",
                    " / ".join(f"{n} {'yes' if v else 'NO'}" for n, v in idle.items()),
                ]
            ],
        )
    )
    if load.failures:
        kinds: dict[str, int] = {}
        for target, phase, what in load.failures:
            key = f"{what} (to {target}, {phase})"
            kinds[key] = kinds.get(key, 0) + 1
        sec.notes.append(
            "failed requests: " + "; ".join(f"{n} x {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:8])
        )
    if unsettled:
        sec.notes.append(
            f"changes {', '.join(map(str, unsettled))}: the division of the file was not in use everywhere "
            f"within {fl.settle:.0f} s (handover_slots, capped_by or a pod's slots)"
        )
    moving = [ch for ch in [*single, *changes] if ch.moved and not math.isnan(ch.usable)]
    waits = [ch.usable - ch.new_owner_applied for ch in moving]
    quick = [w for w in waits if w < 0.1]
    later = [w for w in waits if w >= 0.1]
    if moving:
        sec.headline.append(
            f"hand-overs through the changes: {len(moving)} changes moved slots; {len(quick)} usable by the new "
            f"owner within 100 ms of its reload, {len(later)} after {c.fmt(_ms(c.median(later)), 0)} ms (median; "
            f"max {c.fmt(_ms(max(later, default=math.nan)), 0)} ms)"
        )
    sec.add_target(
        Target(
            f"hand-over: failed requests through {len(changes)} changes",
            "0",
            f"{failed} of {load.sent:,}",
            failed == 0,
            "" if failed == 0 else f"{failed} failed",
            group=GROUP,
        )
    )
    peak = max(peaks, default=0)
    sec.add_target(
        Target(
            "hand-over: no pod above cc",
            "peak <= 1 on every pod",
            f"max peak {peak} ({sum(1 for p in peaks if p > 1)} of {len(peaks)} pods above cc)",
            peak <= 1,
            "" if peak <= 1 else f"peak {peak}",
            group=GROUP,
        )
    )
    sec.notes.append(
        "A moved slot becomes usable by its new owner when the old owner answers a peer check asked after the "
        "change with at most its new share of the pod in use. The check made at once after the reload finds the "
        "old owner still running its last request there when the slot was busy (under this load it usually "
        "is); the next check is made at the next `activators.interval` (1 s), or sooner when another reload "
        "kicks one (the file watcher, polling every second, re-reads the file that SIGHUP already applied and "
        "logs `config reload (file changed): no change`). Through the changes: "
        f"{len(quick)} of {len(moving)} hand-overs took under 100 ms (nothing in use at the first check), the "
        f"others {c.fmt(_ms(min(later, default=math.nan)), 0)} to {c.fmt(_ms(max(later, default=math.nan)), 0)} ms. "
        f"Times are from polling every activator's `/status` (one poll of all of them every "
        f"{c.fmt(_ms(c.median([ch.poll for ch in [*single, *changes]])), 1)} ms, median)."
    )


# =======================================================================================


def run(ctx: c.Ctx) -> Section:
    sec = Section("fleet", "Fleet: one queue across workers, slot hand-over between activators")
    sec.intro = (
        f"**One queue across workers**: {PODS} cc=1 pods (`tests/backend.py`, `/delay?ms={SERVICE_MS}`), Poisson "
        "arrivals at 70% and 90% utilisation, the same seeded arrival sequence through activator `workers: 1`, "
        "activator `workers: 2` (one FIFO queue per service through the supervisor's slot exchange) and HAProxy "
        "(`balance first`, `maxconn 1` per server), in interleaved rounds; queue wait is each proxy's own `Tw` "
        "(access log / `%Tw`), latency the client's from the scheduled send time; proxies (supervisor and both "
        "workers included) on cpu1, pods and load generator on cpu0, real-time priority when available. "
        "**Hand-over**: two activators (`activators:` with `self`, the same `peers` and `secret`) in front of "
        f"cc=1 pods (`/delay?ms={HANDOVER_MS}`), {CLIENTS} closed-loop client threads over both (every slot "
        "contended); each change written to every running activator's file and rolled with SIGHUP, then every "
        "`/status` followed until the file's slot division (`activator.core.slots.divide_slots`) is in use "
        "with no hand-over pending (`handover_slots` 0, `capped_by` empty) and the new owner of each moved "
        "slot has run a request on it (its `requests` on that pod went up). vm-b leaves (taken out of the "
        "load first, file without it, stopped once handed over) and joins (started with the new file and put "
        "into the load, then vm-a rolled). Peak per pod is what each pod saw itself."
    )
    _queue(ctx, sec)
    _handover(ctx, sec)
    return sec

"""Soak: steady load through pods that are drained, re-added, unlisted, crashed and
restarted while the file is reloaded (issue 7, point 6).

Eight client threads send ``ACTIVATOR_SOAK_REQUESTS`` requests (2000 by default; e.g.
100000 on the benchmark machine), each on a fresh connection, each tried exactly once
(no client retries), through one activator in front of four cc=1 pods with a 200 ms
probe. Meanwhile the main thread edits the file (drain, undrain, unlist, re-list,
shuffle), sends SIGHUP, and SIGKILLs one pod at a time, restarting it on its port a
moment later.

A failed request is blamed on a pod only when it failed the way a dying pod makes a
request fail (502/504 or a cut connection) *and* a pod was killed during that request's
lifetime. Every other failure is a bug. Also checked: every pod's peak concurrency
stays <= 1 (read from each pod right before it is killed, and at the end), /status
counts return to zero, and the activator's RSS at the end is within 30 MB of its RSS
after warm-up.
"""

from __future__ import annotations

import http.client
import os
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from harness import SERVICE, Activator, Pod, make_config, probe_config, request, rss_kib, start_pods, wait_until

pytestmark = [pytest.mark.binary, pytest.mark.slow]

N_PODS = 4
THREADS = 8
REQUESTS = int(os.environ.get("ACTIVATOR_SOAK_REQUESTS", "2000"))
RSS_MARGIN_KIB = 30 * 1024


@dataclass
class Outcome:
    rid: str
    start: float
    end: float
    kind: str  # "ok", "http-<status>-<reason>", "cut:<exception>"
    pod: str | None = None


class Load:
    """``THREADS`` clients sending ``total`` requests between them, once each."""

    def __init__(self, act: Activator, total: int) -> None:
        self.act = act
        self.total = total
        self.outcomes: list[Outcome] = []
        self._issued = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(THREADS)]
        self._rng = random.Random(7)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), f"load still running: {self.done}/{self.total}"

    @property
    def done(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def _next(self) -> int | None:
        with self._lock:
            if self._issued >= self.total:
                return None
            self._issued += 1
            return self._issued

    def _run(self, thread: int) -> None:
        while (n := self._next()) is not None:
            rid = f"soak-{n}"
            ms = 5 + n % 20  # 5..24 ms of pod work
            start = time.monotonic()
            try:
                resp = request(
                    self.act.listen,
                    path=f"/delay?ms={ms}",
                    headers={"X-Request-Id": rid},
                    timeout=120,
                )
            except (http.client.HTTPException, OSError) as exc:
                outcome = Outcome(rid, start, time.monotonic(), f"cut:{type(exc).__name__}")
            else:
                if resp.status == 200:
                    outcome = Outcome(rid, start, time.monotonic(), "ok", resp.headers.get("X-Pod"))
                else:
                    why = resp.headers.get("X-Activator-Reason")
                    outcome = Outcome(rid, start, time.monotonic(), f"http-{resp.status}-{why}")
            with self._lock:
                self.outcomes.append(outcome)


def pod_failure_shaped(kind: str) -> bool:
    return kind.startswith("cut:") or kind.startswith("http-502-") or kind.startswith("http-504-")


def nearest_kill(o: Outcome, kills: list[tuple[str, float, float]]) -> str:
    if not kills:
        return "no kill"
    pod, before, after = min(kills, key=lambda k: min(abs(k[1] - o.end), abs(k[2] - o.start)))
    return f"kill of {pod} {before - o.start:+.3f}s..{after - o.start:+.3f}s from its start"


class Chaos:
    """What the main thread does to the pods while the load runs (drain, undrain, unlist,
    re-list, shuffle, SIGHUP, crash and restart), and what it did."""

    def __init__(self, pods: list[Pod], rng: random.Random) -> None:
        self.pods = pods
        self.rng = rng
        # listing: pod -> "serve" | "drain"; unlisted pods are absent
        self.listing: dict[Pod, str] = {p: "serve" for p in pods}
        self.peaks: dict[str, int] = {p.address: 0 for p in pods}
        # (pod, signal about to be sent, process reaped): a request is blamed on a kill
        # when its lifetime overlaps that interval
        self.kills: list[tuple[str, float, float]] = []
        self.actions: Counter[str] = Counter()
        self.restarting: list[threading.Thread] = []
        self.dead: set[Pod] = set()

    def config(self) -> dict[str, Any]:
        entries: list[Any] = [
            p.address if how == "serve" else {"address": p.address, "drain": True} for p, how in self.listing.items()
        ]
        self.rng.shuffle(entries)
        return make_config(
            entries,
            lb_policy="auto",
            probe=probe_config(),
            queue_depth=10000,
            queue_timeout="120s",
            connect_timeout="1s",
            request_timeout="30s",
        )

    def note_peak(self, pod: Pod) -> None:
        self.peaks[pod.address] = max(self.peaks[pod.address], pod.stats()["peak"])

    def serving(self) -> list[Pod]:
        return [p for p, how in self.listing.items() if how == "serve" and p not in self.dead]

    def _restart_later(self, pod: Pod, after: float) -> None:
        time.sleep(after)  # how long the pod stays dead: pacing, not a wait for an effect
        pod.start()
        self.dead.discard(pod)

    def crash(self) -> None:
        victim = self.rng.choice(self.serving())
        self.note_peak(victim)
        self.dead.add(victim)
        before = time.monotonic()
        victim.kill()
        self.kills.append((victim.address, before, time.monotonic()))
        self.actions["crash"] += 1
        t = threading.Thread(target=self._restart_later, args=(victim, self.rng.uniform(0.3, 0.8)), daemon=True)
        t.start()
        self.restarting.append(t)

    def step(self, act: Activator, roll: float) -> None:
        """One action, chosen by ``roll`` (0 <= roll < 1; 0: a crash)."""
        if roll < 0.2 and not self.dead and len(self.serving()) >= 3:
            self.crash()
        elif roll < 0.4 and len(self.serving()) >= 3:
            self.listing[self.rng.choice(self.serving())] = "drain"
            self.actions["drain"] += 1
            act.rewrite_config(self.config())
        elif roll < 0.55 and len(self.serving()) >= 3:
            del self.listing[self.rng.choice(self.serving())]
            self.actions["unlist"] += 1
            act.rewrite_config(self.config())
        elif roll < 0.85:
            back = [p for p in self.pods if self.listing.get(p) != "serve"]
            if back:
                self.listing[self.rng.choice(back)] = "serve"
                self.actions["re-add"] += 1
            act.rewrite_config(self.config())
        else:
            act.rewrite_config(self.config())  # same pods, another order
            act.reload()
            self.actions["reload+sighup"] += 1

    def settle(self, act: Activator) -> None:
        """Every crashed pod back, every pod listed and serving."""
        for t in self.restarting:
            t.join(60)
        for p in self.pods:
            self.listing[p] = "serve"
        act.rewrite_config(self.config())
        self.actions["re-add"] += 1


def test_soak_with_churn_and_crashes(activator_factory):
    pods = start_pods(N_PODS)
    chaos = Chaos(pods, random.Random(20261129))
    try:
        act = activator_factory(chaos.config(), env={"ACTIVATOR_WATCH_INTERVAL": "0.2"})
        act.wait_for(
            lambda st: [p["state"] for p in st["services"][SERVICE]["pods"]] == ["healthy"] * N_PODS,
            message="all pods healthy",
        )
        load = Load(act, REQUESTS)
        load.start()
        warm = max(200, REQUESTS // 10)
        wait_until(lambda: load.done >= warm, timeout=120, message="warm-up")
        rss_warm = rss_kib(act.pid)

        first = True
        while load.done < REQUESTS - THREADS * 4:
            chaos.step(act, 0.0 if first else chaos.rng.random())  # the first action is always a crash
            first = False
            time.sleep(chaos.rng.uniform(0.05, 0.2))  # pacing the chaos, not a wait for an effect

        chaos.settle(act)
        load.join(timeout=300)
        st = act.wait_idle(SERVICE)
        rss_end = rss_kib(act.pid)
        for p in pods:
            chaos.note_peak(p)
    finally:
        for p in pods:
            p.close()

    outcomes = load.outcomes
    kills, peaks, actions = chaos.kills, chaos.peaks, chaos.actions
    by_kind = Counter(o.kind for o in outcomes)
    blamed, bugs = [], []
    for o in outcomes:
        if o.kind == "ok":
            continue
        during = [pod for pod, before, after in kills if o.start <= after and before <= o.end]
        (blamed if during and pod_failure_shaped(o.kind) else bugs).append(o)

    served = Counter(o.pod for o in outcomes if o.kind == "ok")
    svc = st["services"][SERVICE]
    print(
        f"\nsoak: requests={len(outcomes)} ok={by_kind['ok']} pod-failed={len(blamed)} other-failures={len(bugs)}"
        f"\n  edits/actions={dict(actions)} crashes={len(kills)}"
        f"\n  failures by kind={ {k: n for k, n in by_kind.items() if k != 'ok'} }"
        f"\n  peaks={sorted(peaks.values())} served per pod={sorted(served.values())}"
        f"\n  RSS KiB after warm-up={rss_warm} end={rss_end} (+{rss_end - rss_warm})"
        f"\n  final status: in_flight={svc['in_flight']} queued={svc['queued']}"
        f" states={[p['state'] for p in svc['pods']]}"
    )
    assert len(outcomes) == REQUESTS
    assert not bugs, [(o.rid, o.kind, f"lasted {o.end - o.start:.3f}s", nearest_kill(o, kills)) for o in bugs[:20]]
    assert all(peak <= 1 for peak in peaks.values()), peaks
    assert svc["in_flight"] == 0 and svc["queued"] == 0
    assert rss_end < rss_warm + RSS_MARGIN_KIB, (rss_warm, rss_end)
    # The churn did happen.
    assert len(kills) >= 1 and sum(actions.values()) >= 5, (kills, actions)
    assert re.search(r"config reload \([^)]*\) applied", act.stderr_text())

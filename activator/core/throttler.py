"""The per-service throttler: admit, queue in arrival order, hand freed slots over.

This module decides, for one service, which request runs on which pod and when.
Rules, each checked by ``check_invariants``:

- A request gets a slot only on a *healthy* pod with a free slot owned by this
  activator (``in_flight < slots``; cc 0 pods have no limit). Capacity is the sum of
  the slots of healthy pods: pending and draining pods never count, so nobody waits
  for a slot that cannot be used.
- Waiters are served strictly in arrival order. A newcomer may take a slot directly
  only when nobody waits; when a slot frees (release, a pod turning healthy, a limit
  raised) it is handed to the oldest waiter at once. So: *while anyone waits, no pod
  has a free slot*. There is no retry loop anywhere.
- Pod trackers are keyed by address and outlive config reloads: a pod unlisted and
  listed again, or drained and undrained, keeps its in-flight count and is never
  sent more than its limit. A tracker is deleted only once it is removed, unlisted
  and idle.
- Every grant is released exactly once (a second release raises).

Nothing here yields or does I/O; the shell calls in and wakes waiters through the
``notify`` callable each waiter carries (which must not yield either).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .errors import QueueFull
from .config import ServiceConfig, resolve_lb_policy
from .lb import Policy, make_policy
from .states import PodEvent, PodState, next_state

HEALTHY = PodState.HEALTHY
PENDING = PodState.PENDING
DRAINING = PodState.DRAINING
REMOVED = PodState.REMOVED

#: Kinds of transport failure counted per pod (the seed's "per-pod transport failures").
FAILURE_KINDS = ("connect_errors", "timeouts", "resets")


class InvariantViolation(AssertionError):
    """The core's own promise broken: always a bug."""


@dataclass(frozen=True)
class Transition:
    """A pod changed state; the shell logs each one once, with its reason."""

    service: str
    address: str
    old: PodState
    new: PodState
    event: PodEvent
    reason: str


class PodTracker:
    """One pod as this activator sees it. Outlives config reloads (keyed by address)."""

    __slots__ = (
        "address", "rank", "state", "since", "in_flight", "slots", "listed", "drain",
        "probe_passes", "probe_failures", "failures", "requests", "failure_counts",
    )

    def __init__(self, address: str, rank: int, now: float) -> None:
        self.address = address
        self.rank = rank  # position in the file (first-available order)
        self.state = PENDING
        self.since = now  # when it entered its state
        # Invariant: equals the number of unreleased grants on this pod.
        self.in_flight = 0
        # Slots owned by this activator; None = unlimited (container_concurrency 0).
        self.slots: int | None = None
        self.listed = True
        self.drain = False
        self.probe_passes = 0  # consecutive
        self.probe_failures = 0  # consecutive
        self.failures = 0  # consecutive transport failures on real traffic
        self.requests = 0  # grants ever made
        # (kind, state when it failed) -> count; kind in FAILURE_KINDS
        self.failure_counts: dict[tuple[str, str], int] = {}

    @property
    def wanted(self) -> bool:
        """Listed without drain: the operator wants it serving."""
        return self.listed and not self.drain

    def can_take(self) -> bool:
        """Healthy with a free slot owned here."""
        if self.state is not HEALTHY:
            return False
        return self.slots is None or self.in_flight < self.slots


class Grant:
    """A slot held on one pod; give it back with ``ServiceThrottler.release`` exactly once."""

    __slots__ = ("pod", "granted_at", "released", "queued")

    def __init__(self, pod: PodTracker, now: float) -> None:
        self.pod = pod
        self.granted_at = now
        self.released = False
        self.queued = False  # handed over to a waiter (rather than granted on arrival)


class Waiter:
    """A queued request. ``notify()`` is called (without yielding) once ``grant`` is set."""

    __slots__ = ("notify", "enqueued_at", "grant", "redirected", "__weakref__")

    def __init__(self, notify: Callable[[], None], now: float) -> None:
        self.notify = notify
        self.enqueued_at = now
        self.grant: Grant | None = None
        # Taken out of the queue because this process no longer owns any slot of the
        # service: the shell forwards the request to an owner instead.
        self.redirected = False


class ServiceThrottler:
    """Admission, FIFO queue and pod trackers of one service. Does not yield."""

    def __init__(
        self,
        config: ServiceConfig,
        now: float,
        *,
        owned: Mapping[str, int] | None = None,
        rng: random.Random | None = None,
        on_transition: Callable[[Transition], None] | None = None,
    ) -> None:
        self.name = config.name
        self.config = config
        self._rng = rng
        self._on_transition = on_transition or _ignore
        self.trackers: dict[str, PodTracker] = {}
        # Invariant: non-empty only while no pod can take a request.
        self._queue: OrderedDict[Waiter, None] = OrderedDict()
        # Invariant: equals the sum of the trackers' in_flight.
        self.in_flight = 0
        self.policy: Policy = make_policy(config.lb_policy, config.container_concurrency, rng)
        self._draining: set[str] = set()
        self._capacity: int | None = 0
        self._capacity_stale = True  # set on every state or slot change
        self.apply(config, now, owned)

    # -- the request path -------------------------------------------------------

    def acquire(self, now: float, notify: Callable[[], None]) -> Grant | Waiter:
        """A slot now, or a place in the queue. Raises ``QueueFull``."""
        if not self._queue:
            pod = self.policy.pick()
            if pod is not None:
                return self._grant(pod, now)  # type: ignore[arg-type]
        if len(self._queue) >= self.config.queue_depth:
            raise QueueFull()
        waiter = Waiter(notify, now)
        self._queue[waiter] = None
        return waiter

    def acquire_retry(self, failed: Grant, now: float, notify: Callable[[], None]) -> Grant | Waiter:
        """A second slot for a request whose connection to ``failed.pod`` failed.

        Prefers another available pod; if none is free, the request waits at the
        head of the queue (it already waited its turn). Call before releasing
        ``failed``, so that its freed slot is not the first one offered.
        """
        excluded = failed.pod
        was_available = excluded in self.policy
        if was_available:
            self.policy.discard(excluded)
        pod = self.policy.pick() if not self._queue else None
        if was_available:
            self._refresh(excluded)
        if pod is not None:
            return self._grant(pod, now)  # type: ignore[arg-type]
        waiter = Waiter(notify, now)
        self._queue[waiter] = None
        self._queue.move_to_end(waiter, last=False)
        self._dispatch(now)  # the failed pod may be the only one with a free slot
        return waiter

    def abandon(self, waiter: Waiter) -> Grant | None:
        """The waiter gives up (timeout, client gone). Returns its grant if it got one meanwhile."""
        if waiter.grant is not None:
            return waiter.grant
        self._queue.pop(waiter, None)
        return None

    def release(self, grant: Grant, now: float) -> None:
        """Give a slot back; it goes to the oldest waiter if anyone waits."""
        if grant.released:
            raise InvariantViolation(f"grant on {grant.pod.address} released twice")
        grant.released = True
        pod = grant.pod
        pod.in_flight -= 1
        self.in_flight -= 1
        if pod.in_flight == 0 and pod.state is not HEALTHY:
            self._fire(pod, PodEvent.LAST_RELEASED, now, "last request released")
        else:
            self._refresh(pod)
        self._dispatch(now)

    def record_success(self, grant: Grant) -> None:
        """The pod answered: its consecutive transport failures start over."""
        grant.pod.failures = 0

    def record_failure(self, grant: Grant, kind: str, now: float) -> None:
        """A transport failure on real traffic (``kind`` in FAILURE_KINDS).

        Connect errors and timeouts count toward passive ejection: ``unhealthy_after``
        in a row send a healthy pod back to pending (only with a probe configured:
        probes are what bring it back).
        """
        pod = grant.pod
        key = (kind, "healthy" if pod.state is HEALTHY else "unhealthy")
        pod.failure_counts[key] = pod.failure_counts.get(key, 0) + 1
        if kind == "resets":
            return
        pod.failures += 1
        probe = self.config.probe
        if probe is not None and pod.state is HEALTHY and pod.failures >= probe.unhealthy_after:
            self._fire(pod, PodEvent.CONNECT_FAILED, now, f"{pod.failures} transport failures in a row ({kind})")

    # -- topology: one writer (config applier, prober, ticker) ------------------

    def apply(self, config: ServiceConfig, now: float, owned: Mapping[str, int] | None = None) -> None:
        """Apply a (new) service configuration as a diff against the trackers.

        ``owned`` maps pod address -> slots owned by this activator (several
        activators); None means this activator owns every slot.
        """
        old_probe = self.config.probe if self.trackers else config.probe
        self.config = config
        self._capacity_stale = True
        cc = config.container_concurrency
        if resolve_lb_policy(config.lb_policy, cc) != self.policy.name:
            self.policy = make_policy(config.lb_policy, cc, self._rng)
        listed = {pod.address: pod for pod in config.pods}
        for address, tracker in list(self.trackers.items()):
            if address not in listed and tracker.listed:
                tracker.listed = False
                self._fire(tracker, PodEvent.UNLISTED, now, "no longer in the file")
        for rank, pod in enumerate(config.pods):
            existing = self.trackers.get(pod.address)
            if existing is None:
                new = self.trackers[pod.address] = PodTracker(pod.address, rank, now)
                new.drain = pod.drain
                if pod.drain:
                    self._fire(new, PodEvent.DRAIN_SET, now, "listed with drain: true")
                else:
                    self._admit_unprobed(new, now, "listed")
                continue
            tracker = existing
            tracker.rank = rank
            was_listed, was_drain = tracker.listed, tracker.drain
            tracker.listed, tracker.drain = True, pod.drain
            if not was_listed:
                if not pod.drain:
                    self._fire(tracker, PodEvent.LISTED, now, "listed again")
                    self._admit_unprobed(tracker, now, "listed again")
            elif was_drain and not pod.drain:
                self._fire(tracker, PodEvent.DRAIN_CLEARED, now, "drain cleared")
                self._admit_unprobed(tracker, now, "drain cleared")
            elif pod.drain and not was_drain:
                self._fire(tracker, PodEvent.DRAIN_SET, now, "drain: true")
        if old_probe is not None and config.probe is None:
            for tracker in list(self.trackers.values()):
                self._admit_unprobed(tracker, now, "probe removed")
        for tracker in list(self.trackers.values()):
            if cc == 0:
                tracker.slots = None
            elif owned is None:
                tracker.slots = cc
            else:
                tracker.slots = owned.get(tracker.address, 0)
            self._refresh(tracker)
        self._dispatch(now)

    def redirect_waiters(self) -> None:
        """Send every waiter back to the shell (notify, no grant, ``redirected``).

        Called when this process stops owning any slot of the service (a peer or a
        worker took them over): its waiters could only time out here.
        """
        queue = self._queue
        while queue:
            waiter, _ = queue.popitem(last=False)
            waiter.redirected = True
            waiter.notify()

    def probe_result(self, address: str, ok: bool, now: float, detail: str = "") -> None:
        """One active probe's verdict. Probes only judge pending and healthy pods."""
        tracker = self.trackers.get(address)
        probe = self.config.probe
        if tracker is None or probe is None or tracker.state not in (PENDING, HEALTHY):
            return
        if ok:
            tracker.probe_passes += 1
            tracker.probe_failures = 0
            if tracker.state is PENDING and tracker.probe_passes >= probe.healthy_after:
                self._fire(tracker, PodEvent.PROBE_PASSED, now, f"probe passed {tracker.probe_passes} times")
                self._dispatch(now)  # its slots go to the waiters at once
        else:
            tracker.probe_failures += 1
            tracker.probe_passes = 0
            if tracker.state is HEALTHY and tracker.probe_failures >= probe.unhealthy_after:
                why = f"probe failed {tracker.probe_failures} times" + (f": {detail}" if detail else "")
                self._fire(tracker, PodEvent.PROBE_FAILED, now, why)

    def tick(self, now: float) -> None:
        """Periodic housekeeping: force out pods draining longer than drain_timeout."""
        limit = self.config.drain_timeout
        for address in list(self._draining):
            tracker = self.trackers[address]
            if now - tracker.since >= limit:
                self._fire(tracker, PodEvent.DRAIN_TIMEOUT, now, f"still {tracker.in_flight} in flight after drain_timeout")

    # -- views ------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def capacity(self) -> int | None:
        """Slots usable now: healthy pods' slots owned here. None = unlimited (cc 0 with a healthy pod).

        O(1) on the request path: recomputed only after a state or slot change.
        """
        if self._capacity_stale:
            self._capacity = self._count_capacity()
            self._capacity_stale = False
        return self._capacity

    def _count_capacity(self) -> int | None:
        healthy = [t for t in self.trackers.values() if t.state is HEALTHY]
        if self.config.container_concurrency == 0:
            return None if healthy else 0
        return sum(t.slots or 0 for t in healthy)

    @property
    def idle(self) -> bool:
        """Nothing queued, nothing in flight, no tracker left."""
        return not self._queue and not self.trackers and self.in_flight == 0

    def snapshot(self, now: float) -> dict[str, Any]:
        """The service as /status shows it."""
        pods = []
        for tracker in sorted(self.trackers.values(), key=lambda t: (not t.listed, t.rank, t.address)):
            pods.append({
                "address": tracker.address,
                "state": tracker.state.value,
                "in_flight": tracker.in_flight,
                "slots": tracker.slots,
                "failures": tracker.failures,
                "listed": tracker.listed,
                "drain": tracker.drain,
                "requests": tracker.requests,
                "seconds_in_state": round(now - tracker.since, 3),
                "transport_failures": {f"{kind}.{state}": n for (kind, state), n in sorted(tracker.failure_counts.items())},
            })
        oldest = next(iter(self._queue), None)
        return {
            "hosts": list(self.config.hosts),
            "container_concurrency": self.config.container_concurrency,
            "lb_policy": self.policy.name,
            "capacity": self.capacity,
            "in_flight": self.in_flight,
            "queued": len(self._queue),
            "queue_depth": self.config.queue_depth,
            "oldest_wait_seconds": round(now - oldest.enqueued_at, 3) if oldest else 0.0,
            "pods": pods,
        }

    def check_invariants(self) -> None:
        """Raise InvariantViolation if any promise of this module is broken."""
        def fail(message: str) -> None:
            raise InvariantViolation(f"service {self.name}: {message}")

        total = 0
        for address, t in self.trackers.items():
            if address != t.address:
                fail(f"tracker keyed {address} is {t.address}")
            if t.in_flight < 0:
                fail(f"{address} in_flight {t.in_flight} < 0")
            total += t.in_flight
            if (t in self.policy) != t.can_take():
                fail(f"{address} availability {t in self.policy} but can_take {t.can_take()}")
            if t.state in (PENDING, HEALTHY) and not t.wanted:
                fail(f"{address} is {t.state.value} but not wanted")
            if t.state in (DRAINING, REMOVED) and t.wanted:
                fail(f"{address} is {t.state.value} but wanted")
            if t.state is DRAINING and t.in_flight == 0:
                fail(f"{address} draining with nothing in flight")
            if (t.state is DRAINING) != (address in self._draining):
                fail(f"{address} draining set out of date")
            if t.state is REMOVED and not t.listed and t.in_flight == 0:
                fail(f"{address} removed, unlisted and idle but still tracked")
        if not self._capacity_stale and self._capacity != self._count_capacity():
            fail(f"cached capacity {self._capacity} but {self._count_capacity()}")
        if total != self.in_flight:
            fail(f"in_flight {self.in_flight} != sum over pods {total}")
        if len(self.policy) != sum(1 for t in self.trackers.values() if t.can_take()):
            fail("policy holds pods that are not tracked")
        if self._queue and len(self.policy):
            fail(f"{len(self._queue)} waiting while a pod has a free slot")
        if any(waiter.grant is not None for waiter in self._queue):
            fail("a queued waiter already holds a grant")

    # -- internals --------------------------------------------------------------

    def _grant(self, pod: PodTracker, now: float) -> Grant:
        if not pod.can_take():
            raise InvariantViolation(f"grant on {pod.address} ({pod.state.value}, {pod.in_flight}/{pod.slots})")
        pod.in_flight += 1
        pod.requests += 1
        self.in_flight += 1
        if pod.slots is not None and pod.in_flight >= pod.slots:
            self.policy.discard(pod)
        return Grant(pod, now)

    def _dispatch(self, now: float) -> None:
        """Hand free slots to the oldest waiters, as many as there are free slots."""
        queue = self._queue
        while queue:
            pod = self.policy.pick()
            if pod is None:
                return
            waiter, _ = queue.popitem(last=False)
            grant = waiter.grant = self._grant(pod, now)  # type: ignore[arg-type]
            grant.queued = True
            waiter.notify()

    def _refresh(self, tracker: PodTracker) -> None:
        if tracker.can_take():
            self.policy.add(tracker)
        else:
            self.policy.discard(tracker)

    def _admit_unprobed(self, tracker: PodTracker, now: float, why: str) -> None:
        """With ``probe: null`` a wanted pending pod is routable at once."""
        if self.config.probe is None and tracker.state is PENDING:
            self._fire(tracker, PodEvent.PROBE_PASSED, now, f"{why} (no probe configured)")

    def _fire(self, tracker: PodTracker, event: PodEvent, now: float, reason: str) -> None:
        old = tracker.state
        new = next_state(old, event)
        if new is not old:
            tracker.state = new
            tracker.since = now
            self._capacity_stale = True
            tracker.probe_passes = tracker.probe_failures = 0
            if new is HEALTHY:
                tracker.failures = 0
            if new is DRAINING:
                self._draining.add(tracker.address)
            elif old is DRAINING:
                self._draining.discard(tracker.address)
            self._on_transition(Transition(self.name, tracker.address, old, new, event, reason))
        if new is DRAINING and tracker.in_flight == 0:
            self._fire(tracker, PodEvent.LAST_RELEASED, now, "nothing in flight")
            return
        if new is REMOVED and not tracker.listed and tracker.in_flight == 0:
            self.policy.discard(tracker)
            del self.trackers[tracker.address]
            return
        self._refresh(tracker)


def _ignore(transition: Transition) -> None:
    pass

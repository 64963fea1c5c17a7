"""The per-service throttler: admit, queue in arrival order, hand freed slots over.

This module decides, for one service, which request runs on which pod and when.
Rules, each checked by ``check_invariants``:

- A request gets a slot only on a *healthy* pod with a free slot owned by this
  activator (``in_flight < slots``; cc 0 pods have no limit). Capacity is the sum of
  the slots of healthy pods: pending and draining pods never count, so nobody waits
  for a slot that cannot be used.
- Waiters are served in the order of the service's ``WaitQueue`` (``core.waitqueue``):
  arrival order, unless the service has priority classes or ``fair_by``. A newcomer may
  take a slot directly only when nobody waits; when a slot frees (release, a pod turning
  healthy, a limit raised) it is handed to the next waiter at once. So: *while anyone
  waits, no pod has a free slot*. There is no retry loop anywhere. A waiter shed from a
  full queue (a higher class took its place) is woken without a grant, ``shed``.
- Pod trackers are keyed by address and outlive config reloads: a pod unlisted and
  listed again, or drained and undrained, keeps its in-flight count and is never
  sent more than its limit. A tracker is deleted only once it is removed, unlisted
  and idle.
- Every grant is released exactly once (a second release raises).

**Effects out.** Nothing here yields, does I/O or calls the shell. A call that changes
more than its own request returns ``Effects``: the waiters it handed a slot to (or
redirected), which the shell wakes, and the pod state changes, which the shell logs and
counts. ``NO_EFFECTS`` when nothing happened. The shell acts after the call returned.

**Shared mode** (``workers: N > 1``, see ``core.slotexchange``): the activator's one
queue is the supervisor's, not this throttler's. A request is served here only when the
service is not *contended* (nobody of it waits anywhere) and a slot is free
(``acquire_here``); otherwise the shell queues it at the exchange. While contended, every
slot that is free or frees is *lent* (held, in ``Effects.lent``) for the shell to offer
the exchange, which gives it back (``release``) when nobody wants it. So, here as
above: while anyone of the service waits, no pod has a free slot.

Who calls what: request greenlets (and, in shared mode, the exchange's reader)
``acquire``, ``acquire_here``, ``acquire_retry``, ``retry_here``, ``abandon``,
``release``, ``set_contended``, ``reserve``, ``reclaim``, ``borrow`` and ``give_back``;
everything else (``apply``, ``probe_result``, ``record_failure``, ``tick``,
``redirect_waiters``) is topology, applied by the one topology writer.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from .config import Listing, ServiceConfig, pod_changes
from .failures import FailureKind
from .lb import Pickable, Policy, make_policy, policy_matches
from .load import announced_limit
from .priority import Classifier, queue_policy
from .probes import Verdict
from .states import PodEvent, PodState, next_state
from .status import queue_view
from .waitqueue import Queued, WaitQueue

HEALTHY = PodState.HEALTHY
PENDING = PodState.PENDING
DRAINING = PodState.DRAINING
REMOVED = PodState.REMOVED


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


def _last_probe(last: tuple[str, float | None, float] | None, now: float) -> dict[str, Any] | None:
    """A tracker's last probe as /status shows it (None: never probed)."""
    if last is None:
        return None
    result, duration, at = last
    return {
        "result": result,
        "duration_seconds": None if duration is None else round(duration, 6),
        "seconds_ago": round(now - at, 3),
    }


class PodTracker:
    """One pod as this activator sees it. Outlives config reloads (keyed by address)."""

    __slots__ = (
        "address",
        "rank",
        "state",
        "since",
        "in_flight",
        "slots",
        "listed",
        "drain",
        "parked",
        "probe_passes",
        "probe_failures",
        "failures",
        "requests",
        "failure_counts",
        "failures_total",
        "last_probe",
        "peak_in_flight",
        "recent_peak",
        "retries",
        "state_seconds",
        "load",
        "announced",
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
        # Drained by its launcher (scaled down, to be stopped), whatever the file says.
        self.parked = False
        self.probe_passes = 0  # consecutive
        self.probe_failures = 0  # consecutive
        self.failures = 0  # consecutive transport failures on real traffic
        self.requests = 0  # grants ever made
        # (kind, whether the pod was healthy when it failed) -> count
        self.failure_counts: dict[tuple[FailureKind, bool], int] = {}
        self.failures_total = 0  # transport failures on real traffic, ever (every kind)
        # The last probe reported: (result text, its duration in seconds or None, when).
        self.last_probe: tuple[str, float | None, float] | None = None
        # Invariant: in_flight <= recent_peak <= peak_in_flight. The highest in_flight
        # ever (the proof that the limit held), and since the last ``take_recent_peak``.
        self.peak_in_flight = 0
        self.recent_peak = 0
        self.retries = 0  # requests whose connection to this pod failed, retried elsewhere
        self.state_seconds: dict[PodState, float] = {}  # time spent in each state left so far
        # What the pod announces (``core.load``): its figure, and the limit its announced
        # concurrency sets (already bounded: 1 <= announced <= container_concurrency).
        self.load: float | None = None
        self.announced: int | None = None

    def take_recent_peak(self) -> int:
        """The highest in_flight since the last call (the history's per-second peak),
        which starts over from the current count. Does not yield."""
        peak, self.recent_peak = self.recent_peak, self.in_flight
        return peak

    def seconds_by_state(self, now: float) -> dict[str, float]:
        """Time spent in each state since the tracker exists, the current one included."""
        spent = {state.value: round(self.state_seconds.get(state, 0.0), 3) for state in PodState}
        spent[self.state.value] = round(self.state_seconds.get(self.state, 0.0) + now - self.since, 3)
        return spent

    @property
    def wanted(self) -> bool:
        """Listed without drain, and not drained by its launcher: wanted serving."""
        return self.listed and not self.drain and not self.parked

    @property
    def limit(self) -> int | None:
        """The most requests this activator sends it at once: its slots, lowered by the
        concurrency it announced (never raised). None = unlimited."""
        if self.slots is None or self.announced is None:
            return self.slots
        return min(self.slots, self.announced)

    def can_take(self) -> bool:
        """Healthy with a free slot owned here (within the limit it announced)."""
        if self.state is not HEALTHY:
            return False
        limit = self.limit
        return limit is None or self.in_flight < limit


def _note_peak(pod: PodTracker) -> None:
    """After ``pod.in_flight`` grew: keep its peaks (see ``PodTracker``). Does not yield."""
    if pod.in_flight > pod.recent_peak:
        pod.recent_peak = pod.in_flight
        if pod.in_flight > pod.peak_in_flight:
            pod.peak_in_flight = pod.in_flight


class Grant:
    """A slot held on one pod; give it back with ``ServiceThrottler.release`` exactly once."""

    __slots__ = ("lent", "pod", "queued", "released", "tunnel")

    def __init__(self, pod: PodTracker) -> None:
        self.pod = pod
        self.released = False
        self.queued = False  # handed over to a waiter (rather than granted on arrival)
        self.tunnel = False  # it became a tunnel (an upgrade the pod accepted)
        # Held for the activator's slot exchange (shared mode): lent to whichever worker's
        # waiter it goes to, and released when the exchange gives it back.
        self.lent = False


class Waiter(Queued):
    """A queued request (of priority class ``klass``, of ``tenant``). Woken (through
    ``Effects.woken``) once it has a ``grant``, or when ``redirected`` or ``shed``."""

    __slots__ = ("__weakref__", "grant", "redirected", "refusal", "shed", "token")

    def __init__(self, now: float, klass: int = 0, tenant: Hashable | None = None) -> None:
        super().__init__(now, klass, tenant)
        self.grant: Grant | None = None
        # A higher-class arrival took its place in the full queue: answered 503 shed.
        self.shed = False
        #: Taken out of the queue with this answer instead of a slot (an ``ActivatorError``,
        #: such as ``ColdStartFailed``): the shell raises it.
        self.refusal: Exception | None = None
        # Taken out of the queue because this process no longer owns any slot of the
        # service: the shell forwards the request to an owner instead.
        self.redirected = False
        #: The shell's handle to wake this waiter with (the core never touches it).
        self.token: Any = None


class Effects:
    """What a core call changed beyond its own request: for the shell to act on.

    ``lent``: slots held for the activator's slot exchange (shared mode), each with its
    service's throttler, to offer the exchange.
    """

    __slots__ = ("lent", "transitions", "woken")

    def __init__(
        self,
        woken: list[Waiter] | tuple[()] = (),
        transitions: list[Transition] | tuple[()] = (),
        lent: list[tuple[ServiceThrottler, Grant]] | tuple[()] = (),
    ) -> None:
        self.woken = woken
        self.transitions = transitions
        self.lent = lent

    def __bool__(self) -> bool:
        return bool(self.woken or self.transitions or self.lent)

    def __repr__(self) -> str:
        return f"<Effects woken={len(self.woken)} lent={len(self.lent)} transitions={list(self.transitions)}>"


NO_EFFECTS = Effects()


class EffectsCollector:
    """Effects of many core calls, gathered into one (without copying at each step)."""

    __slots__ = ("_lent", "_transitions", "_woken")

    def __init__(self) -> None:
        self._woken: list[Waiter] = []
        self._transitions: list[Transition] = []
        self._lent: list[tuple[ServiceThrottler, Grant]] = []

    def add(self, effects: Effects) -> None:
        if effects:
            self._woken.extend(effects.woken)
            self._transitions.extend(effects.transitions)
            self._lent.extend(effects.lent)

    def result(self) -> Effects:
        if not self._woken and not self._transitions and not self._lent:
            return NO_EFFECTS
        return Effects(self._woken, self._transitions, self._lent)


def then(first: Effects, second: Effects) -> Effects:
    """The effects of two calls, in order (either may be empty)."""
    if not second:
        return first
    if not first:
        return second
    collected = EffectsCollector()
    collected.add(first)
    collected.add(second)
    return collected.result()


class ServiceThrottler:
    """Admission, FIFO queue and pod trackers of one service. Does not yield."""

    def __init__(
        self,
        config: ServiceConfig,
        now: float,
        *,
        owned: Mapping[str, int] | None = None,
        rng: random.Random | None = None,
        sharing: bool = False,
    ) -> None:
        self.name = config.name
        #: One of several workers: limited services are in shared mode (unlimited ones,
        #: container_concurrency 0, have no slot to lend and queue per worker).
        self.sharing = sharing
        #: In shared mode (see the module docstring).
        self.shared = False
        #: Shared mode: someone of this service waits at the exchange.
        self.contended = False
        self.config = config
        self._rng = rng
        self.trackers: dict[str, PodTracker] = {}
        # Invariant: non-empty only while no pod can take a request.
        self._queue = WaitQueue(queue_policy(config), config.queue_depth)
        #: Waiters shed from the full queue, per class, ever.
        self.sheds = [0] * self._queue.policy.classes
        # Invariant: equals the sum of the trackers' in_flight.
        self.in_flight = 0
        # Invariant: the unreleased grants that became tunnels (each is also in in_flight),
        # and the borrowed slots' requests that did.
        self.tunnels = 0
        # Shared mode: requests running here on slots lent by siblings.
        self.borrowed = 0
        self.policy: Policy = make_policy(config.lb_policy, config.container_concurrency, rng)
        self._draining: set[str] = set()
        self._capacity: int | None = 0
        self._capacity_stale = True  # set on every state or slot change
        # The outbox of the call under way (see "Effects out").
        self._woken: list[Waiter] = []
        self._transitions: list[Transition] = []
        self._lent: list[tuple[ServiceThrottler, Grant]] = []
        self.initial_effects = self._apply(None, config, now, owned)

    # -- the request path -------------------------------------------------------

    def acquire(self, now: float) -> Grant | Waiter:
        """``admit`` in the lowest class, with no tenant: it sheds nobody, so it never has
        effects. Raises ``QueueFull`` (``TenantQueueFull`` with a tenant cap)."""
        first, _ = self.admit(now, self._queue.policy.classes - 1)
        return first

    def admit(self, now: float, klass: int = 0, tenant: Hashable | None = None) -> tuple[Grant | Waiter, Effects]:
        """A slot now, or a place in the queue (in ``klass``, of ``tenant``). Raises
        ``QueueFull`` or ``TenantQueueFull``. Its effects: the waiter it shed, if any."""
        queue = self._queue
        if not queue:
            pod = self.policy.pick()
            if pod is not None:
                return self._grant(pod), NO_EFFECTS
        waiter = Waiter(now, klass, tenant)
        shed = queue.push(waiter)
        if shed is None:
            return waiter, NO_EFFECTS
        assert isinstance(shed, Waiter)
        shed.shed = True
        self.sheds[shed.klass] += 1
        return waiter, Effects([shed])

    def acquire_here(self) -> Grant | None:
        """Shared mode: a slot now, unless the service is contended or none is free (the
        shell then queues the request at the exchange). Never has effects."""
        if self.contended:
            return None
        pod = self.policy.pick()
        return self._grant(pod) if pod is not None else None

    def retry_here(self, failed: Grant, now: float) -> tuple[Grant | None, Effects]:
        """Shared mode ``acquire_retry``: another free pod's slot, or None (queue at the
        exchange); ``failed`` is given back after the choice."""
        pod = self._other_pod(failed, may_pick=not self.contended)
        grant = self._grant(pod) if pod is not None else None
        self._release(failed, now, answered=False)
        return grant, self._effects()

    def set_contended(self, contended: bool) -> Effects:
        """Shared mode: the exchange has waiters of this service (lend every free slot) or none."""
        self.contended = contended and self.shared
        self._dispatch()  # (lends; the local queue of a shared service is empty)
        return self._effects()

    def reserve(self, address: str) -> Grant:
        """Shared mode, at start: a slot of this worker's previous incarnation still lent out.

        Held (and counted in flight) until the exchange gives it back, even beyond the
        pod's limit here: the request on it runs.
        """
        tracker = self.trackers.get(address)
        if tracker is None:
            tracker = self.trackers[address] = PodTracker(address, 0, 0.0)
            tracker.listed = False
            tracker.state = REMOVED
        tracker.in_flight += 1
        _note_peak(tracker)
        self.in_flight += 1
        self._refresh(tracker)
        grant = Grant(tracker)
        grant.lent = True
        return grant

    def reclaim(self, grant: Grant) -> None:
        """Shared mode: a slot of ours, lent to the exchange, came back to a request of ours."""
        if not grant.lent or grant.released:
            raise InvariantViolation(f"reclaim of a grant on {grant.pod.address} that was not lent")
        grant.lent = False
        grant.queued = True
        grant.pod.requests += 1

    def borrow(self, address: str) -> None:
        """Shared mode: a request runs here on a slot lent by a sibling (counted per pod;
        its slot is counted in flight by its owner)."""
        self.borrowed += 1
        tracker = self.trackers.get(address)
        if tracker is not None:
            tracker.requests += 1

    def count_shed(self, klass: int) -> None:
        """Shared mode: a request of this worker was shed from the supervisor's queue."""
        if 0 <= klass < len(self.sheds):
            self.sheds[klass] += 1

    def borrowed_tunnel(self) -> None:
        """The borrowed slot's request became a tunnel."""
        self.tunnels += 1

    def give_back(self, tunnel: bool) -> None:
        """The request on a borrowed slot ended (``tunnel``: it had become one)."""
        if self.borrowed <= 0 or (tunnel and self.tunnels <= 0):
            raise InvariantViolation("a borrowed slot given back that was not borrowed")
        self.borrowed -= 1
        if tunnel:
            self.tunnels -= 1

    def acquire_retry(self, failed: Grant, now: float) -> tuple[Grant | Waiter, Effects]:
        """A second slot for a request whose connection to ``failed.pod`` failed.

        Prefers another available pod; if none is free, the request waits at the head
        of the queue (it already waited its turn). ``failed`` is released here, after
        the choice, so that its freed slot is not the first one offered.
        """
        pod = self._other_pod(failed, may_pick=not self._queue)
        first: Grant | Waiter
        if pod is not None:
            first = self._grant(pod)
        else:
            first = Waiter(now)  # first of the highest class: it already waited its turn
            self._queue.push_front(first)
        self._release(failed, now, answered=False)
        return first, self._effects()

    def _other_pod(self, failed: Grant, may_pick: bool) -> Pickable | None:
        """For a retry: a free pod other than ``failed``'s, if ``may_pick`` (nobody is in
        line before the request), or None. ``failed`` is not given back here."""
        if failed.released:
            raise InvariantViolation(f"retry of a grant on {failed.pod.address} given back already")
        excluded = failed.pod
        excluded.retries += 1
        was_available = excluded in self.policy
        if was_available:
            self.policy.discard(excluded)
        pod = self.policy.pick() if may_pick else None
        if was_available:
            self._refresh(excluded)
        return pod

    def abandon(self, waiter: Waiter) -> Grant | None:
        """The waiter gives up (timeout, client gone). Returns its grant if it got one
        meanwhile (the caller releases it)."""
        if waiter.grant is not None:
            return waiter.grant
        self._queue.remove(waiter)
        return None

    def open_tunnel(self, grant: Grant) -> None:
        """The request of ``grant`` became a tunnel: it holds its slot until released."""
        if grant.released or grant.tunnel:
            raise InvariantViolation(f"tunnel opened on a grant on {grant.pod.address} that cannot have one")
        grant.tunnel = True
        self.tunnels += 1

    def release(self, grant: Grant, now: float, answered: bool = False) -> Effects:
        """Give a slot back; it goes to the oldest waiter if anyone waits.

        ``answered``: the pod answered this request, so its consecutive transport
        failures start over.
        """
        self._release(grant, now, answered)
        return self._effects()

    # -- topology: applied by the one writer ------------------------------------

    def record_failure(self, address: str, kind: FailureKind, now: float) -> Effects:
        """A transport failure on real traffic (see ``core.failures``).

        Failures that count toward ejection do so in a row: ``unhealthy_after`` of them
        send a healthy pod back to pending (only with a probe configured: probes are
        what bring it back).
        """
        pod = self.trackers.get(address)
        if pod is None:
            return NO_EFFECTS
        key = (kind, pod.state is HEALTHY)
        pod.failure_counts[key] = pod.failure_counts.get(key, 0) + 1
        pod.failures_total += 1
        if kind.counts_toward_ejection:
            pod.failures += 1
            probe = self.config.probe
            if probe is not None and pod.state is HEALTHY and pod.failures >= probe.unhealthy_after:
                why = f"{pod.failures} transport failures in a row ({kind.value})"
                self._fire(pod, PodEvent.CONNECT_FAILED, now, why)
        return self._effects()

    def apply(self, config: ServiceConfig, now: float, owned: Mapping[str, int] | None = None) -> Effects:
        """Apply a (new) service configuration; trackers and waiters are kept.

        ``owned`` maps pod address -> slots owned by this activator (several activators
        or workers); None means this activator owns every slot.
        """
        return self._apply(self.config, config, now, owned)

    def park(self, address: str, parked: bool, now: float, reason: str) -> Effects:
        """The pod's launcher drains it (``parked``: scaled down, to be stopped) or wants it
        again (stopped, or not to be stopped after all). Today's draining: no new request,
        its in-flight ones finish. The file's own listing and drain still apply."""
        tracker = self.trackers.get(address)
        if tracker is None or tracker.parked is parked:
            return NO_EFFECTS
        was_wanted = tracker.wanted
        tracker.parked = parked
        if was_wanted and not tracker.wanted:
            self._fire(tracker, PodEvent.DRAIN_SET, now, reason)
        elif tracker.wanted and not was_wanted:
            self._fire(tracker, PodEvent.DRAIN_CLEARED, now, reason)
            self._admit_unprobed(tracker, now, reason)
        return self._effects()

    def refuse_waiters(self, refusal: Exception) -> Effects:
        """Every waiter leaves the queue with ``refusal`` as its answer (the shell raises it)."""
        for waiter in self._queue.drain():
            assert isinstance(waiter, Waiter)
            waiter.refusal = refusal
            self._woken.append(waiter)
        return self._effects()

    def redirect_waiters(self) -> Effects:
        """Send every waiter back to the shell (woken, no grant, ``redirected``).

        Called when this process stops owning any slot of the service (a peer or a
        worker took them over): its waiters could only time out here.
        """
        self._redirect_all()
        return self._effects()

    def probe_result(
        self, address: str, verdict: Verdict, now: float, detail: str = "", duration: float | None = None
    ) -> Effects:
        """One active probe's verdict (and how long it took). Probes only judge pending
        and healthy pods; the last one is kept for /status whatever the pod's state."""
        tracker = self.trackers.get(address)
        probe = self.config.probe
        if tracker is not None:
            result = verdict.value + (f": {detail}" if detail and verdict is not Verdict.PASS else "")
            tracker.last_probe = (result, duration, now)
        if tracker is None or probe is None or tracker.state not in (PENDING, HEALTHY):
            return NO_EFFECTS
        if verdict is Verdict.PASS:
            tracker.probe_passes += 1
            tracker.probe_failures = 0
            if tracker.state is PENDING and tracker.probe_passes >= probe.healthy_after:
                self._fire(tracker, PodEvent.PROBE_PASSED, now, f"probe passed {tracker.probe_passes} times")
                self._dispatch(now)  # its slots go to the waiters at once
        elif verdict is Verdict.FAIL:
            tracker.probe_failures += 1
            tracker.probe_passes = 0
            if tracker.state is HEALTHY and tracker.probe_failures >= probe.unhealthy_after:
                why = f"probe failed {tracker.probe_failures} times" + (f": {detail}" if detail else "")
                self._fire(tracker, PodEvent.PROBE_FAILED, now, why)
        return self._effects()

    def load_report(self, address: str, figure: float | None, concurrency: int | None, now: float) -> Effects:
        """What a pod announced (``core.load``): its figure for ``least-loaded`` and the
        concurrency it asks for, bounded by container_concurrency (never above it). A
        lowered limit takes effect for the next grants (nothing running is cut); a raised
        one hands the freed slots to the waiters at once."""
        tracker = self.trackers.get(address)
        if tracker is None:
            return NO_EFFECTS
        announced = announced_limit(concurrency, self.config.container_concurrency)
        if tracker.load == figure and tracker.announced == announced:
            return NO_EFFECTS
        tracker.load, tracker.announced = figure, announced
        self._capacity_stale = True
        self._refresh(tracker)  # re-indexed by its new figure, or no longer free
        self._dispatch(now)
        return self._effects()

    def tick(self, now: float) -> Effects:
        """Periodic housekeeping: force out pods draining longer than drain_timeout."""
        limit = self.config.drain_timeout
        for address in list(self._draining):
            tracker = self.trackers[address]
            if now - tracker.since >= limit:
                why = f"still {tracker.in_flight} in flight after drain_timeout"
                self._fire(tracker, PodEvent.DRAIN_TIMEOUT, now, why)
        return self._effects()

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
        return sum(t.limit or 0 for t in healthy)

    @property
    def idle(self) -> bool:
        """Nothing queued, nothing in flight, no tracker left."""
        return not self._queue and not self.trackers and self.in_flight == 0

    def oldest_wait(self, now: float) -> float:
        """How long the oldest waiter has waited (0 when nobody waits)."""
        oldest = self._queue.oldest_arrival()
        return now - oldest if oldest is not None else 0.0

    @property
    def queue(self) -> WaitQueue:
        """The waiters (read-only views for /status and the metrics)."""
        return self._queue

    def snapshot(self, now: float) -> dict[str, Any]:
        """The service as /status shows it."""
        pods = []
        for tracker in sorted(self.trackers.values(), key=lambda t: (not t.listed, t.rank, t.address)):
            pods.append(
                {
                    "address": tracker.address,
                    "state": tracker.state.value,
                    "in_flight": tracker.in_flight,
                    "slots": tracker.slots,
                    "failures": tracker.failures,
                    "peak_in_flight": tracker.peak_in_flight,
                    "retries": tracker.retries,
                    "listed": tracker.listed,
                    "drain": tracker.drain,
                    "parked": tracker.parked,
                    "requests": tracker.requests,
                    "seconds_in_state": round(now - tracker.since, 3),
                    "seconds_by_state": tracker.seconds_by_state(now),
                    "failures_total": tracker.failures_total,
                    "last_probe": _last_probe(tracker.last_probe, now),
                    "load": tracker.load,
                    "announced_concurrency": tracker.announced,
                    "transport_failures": {
                        f"{kind.value}.{'healthy' if healthy else 'unhealthy'}": n
                        for (kind, healthy), n in sorted(
                            tracker.failure_counts.items(), key=lambda item: (item[0][0].value, not item[0][1])
                        )
                    },
                }
            )
        return {
            "hosts": list(self.config.hosts),
            "container_concurrency": self.config.container_concurrency,
            "lb_policy": self.policy.name,
            "capacity": self.capacity,
            "in_flight": self.in_flight,
            "tunnels": self.tunnels,
            "borrowed": self.borrowed,
            "queued": len(self._queue),
            "queue_depth": self.config.queue_depth,
            "oldest_wait_seconds": round(self.oldest_wait(now), 3),
            **queue_view(
                self._queue,
                list(self.config.priority.classes) if self.config.priority is not None else None,
                self.config.fair_by is not None,
                self.sheds,
                now,
            ),
            "pods": pods,
        }

    def check_invariants(self) -> None:
        """Raise InvariantViolation if any promise of this module is broken."""
        for address, tracker in self.trackers.items():
            self._check_tracker(address, tracker)
        if not self._capacity_stale and self._capacity != self._count_capacity():
            self._fail(f"cached capacity {self._capacity} but {self._count_capacity()}")
        total = sum(tracker.in_flight for tracker in self.trackers.values())
        if total != self.in_flight:
            self._fail(f"in_flight {self.in_flight} != sum over pods {total}")
        if len(self.policy) != sum(1 for t in self.trackers.values() if t.can_take()):
            self._fail("policy holds pods that are not tracked")
        if not 0 <= self.tunnels <= self.in_flight + self.borrowed:
            self._fail(f"{self.tunnels} tunnels with {self.in_flight} in flight")
        if self._queue and len(self.policy):
            self._fail(f"{len(self._queue)} waiting while a pod has a free slot")
        if self.contended and len(self.policy):
            self._fail("contended while a pod has a free slot (it should be lent)")
        if self._queue and self.shared:
            self._fail("a local queue in shared mode")
        if any(not isinstance(w, Waiter) or w.grant is not None for w in self._queue):
            self._fail("a queued waiter already holds a grant")
        self._queue.check_invariants()
        if self._woken or self._transitions or self._lent:
            self._fail("effects left in the outbox after a call")

    def _check_tracker(self, address: str, t: PodTracker) -> None:
        if address != t.address:
            self._fail(f"tracker keyed {address} is {t.address}")
        if t.in_flight < 0:
            self._fail(f"{address} in_flight {t.in_flight} < 0")
        if not t.in_flight <= t.recent_peak <= t.peak_in_flight:
            self._fail(f"{address} in_flight {t.in_flight}, recent peak {t.recent_peak}, peak {t.peak_in_flight}")
        if (t in self.policy) != t.can_take():
            self._fail(f"{address} availability {t in self.policy} but can_take {t.can_take()}")
        if t.state in (PENDING, HEALTHY) and not t.wanted:
            self._fail(f"{address} is {t.state.value} but not wanted")
        if t.state in (DRAINING, REMOVED) and t.wanted:
            self._fail(f"{address} is {t.state.value} but wanted")
        if t.state is DRAINING and t.in_flight == 0:
            self._fail(f"{address} draining with nothing in flight")
        if (t.state is DRAINING) != (address in self._draining):
            self._fail(f"{address} draining set out of date")
        if t.state is REMOVED and not t.listed and t.in_flight == 0:
            self._fail(f"{address} removed, unlisted and idle but still tracked")

    def _fail(self, message: str) -> None:
        raise InvariantViolation(f"service {self.name}: {message}")

    # -- internals --------------------------------------------------------------

    def _effects(self) -> Effects:
        """Empty the outbox into the call's result."""
        woken, transitions, lent = self._woken, self._transitions, self._lent
        if not woken and not transitions and not lent:
            return NO_EFFECTS
        if lent:
            self._lent = []
        self._woken, self._transitions = [], []
        return Effects(woken, transitions, lent)

    def _grant(self, pickable: Pickable, request: bool = True) -> Grant:
        pod = self.trackers[pickable.address]
        if not pod.can_take():
            raise InvariantViolation(f"grant on {pod.address} ({pod.state.value}, {pod.in_flight}/{pod.slots})")
        pod.in_flight += 1
        _note_peak(pod)
        if request:
            pod.requests += 1
        self.in_flight += 1
        if not pod.can_take():
            self.policy.discard(pod)
        return Grant(pod)

    def _release(self, grant: Grant, now: float, answered: bool) -> None:
        if grant.released:
            raise InvariantViolation(f"grant on {grant.pod.address} released twice")
        grant.released = True
        if grant.tunnel:
            self.tunnels -= 1
        pod = grant.pod
        if answered:
            pod.failures = 0
        pod.in_flight -= 1
        self.in_flight -= 1
        if pod.in_flight == 0 and pod.state is not HEALTHY:
            self._fire(pod, PodEvent.LAST_RELEASED, now, "last request released")
        else:
            self._refresh(pod)
        self._dispatch(now)

    def _dispatch(self, now: float = -math.inf) -> None:
        """Hand free slots to the next waiters, as many as there are free slots (shared
        mode: to the exchange, while contended). ``now`` is for the queue's starvation
        bound (without it, nobody counts as starving)."""
        if self.contended:
            while (pod := self.policy.pick()) is not None:
                grant = self._grant(pod, request=False)
                grant.lent = True
                self._lent.append((self, grant))
            return
        queue = self._queue
        while queue:
            pod = self.policy.pick()
            if pod is None:
                return
            waiter = queue.pop(now)
            assert isinstance(waiter, Waiter)
            grant = waiter.grant = self._grant(pod)
            grant.queued = True
            self._woken.append(waiter)

    def _redirect_all(self) -> None:
        for waiter in self._queue.drain():
            assert isinstance(waiter, Waiter)
            waiter.redirected = True
            self._woken.append(waiter)

    def _refresh(self, tracker: PodTracker) -> None:
        if tracker.can_take():
            self.policy.add(tracker)
        else:
            self.policy.discard(tracker)

    def _apply(
        self, old: ServiceConfig | None, config: ServiceConfig, now: float, owned: Mapping[str, int] | None
    ) -> Effects:
        """Follow the pods' listing changes (``core.config.pod_changes``), then the settings."""
        old_probe = old.probe if old is not None else config.probe
        self.config = config
        #: How a request of this service gets its class and tenant (``core.priority``).
        self.classifier = Classifier(config)
        policy = queue_policy(config)
        if policy.classes != len(self.sheds):
            self.sheds = [0] * policy.classes
        self._queue.reshape(policy, config.queue_depth)
        self._capacity_stale = True
        cc = config.container_concurrency
        shared = self.sharing and cc > 0
        if shared != self.shared:
            # Into shared mode, local waiters go to the exchange (the shell re-queues
            # redirected waiters there); out of it, nothing is lent any more.
            self.shared = shared
            self.contended = False
            if shared:
                self._redirect_all()
        if not policy_matches(self.policy, config.lb_policy, cc):
            self.policy = make_policy(config.lb_policy, cc, self._rng)
        for change in pod_changes(old, config):
            self._apply_listing(change.address, change.after, now)
        for rank, pod in enumerate(config.pods):
            self.trackers[pod.address].rank = rank
        if old_probe is not None and config.probe is None:
            for tracker in list(self.trackers.values()):
                self._admit_unprobed(tracker, now, "probe removed")
        forget_load = old is not None and old.load != config.load
        for tracker in list(self.trackers.values()):
            if forget_load:  # announced under other rules (or none now): heard again
                tracker.load = tracker.announced = None
            if cc == 0:
                tracker.slots = None
            elif owned is None:
                tracker.slots = cc
            else:
                tracker.slots = owned.get(tracker.address, 0)
            self._refresh(tracker)
        self._dispatch(now)
        return self._effects()

    def _apply_listing(self, address: str, after: Listing, now: float) -> None:
        """One pod's new listing, as pod state machine events (its tracker may linger
        from an earlier listing: unlisted but still running requests)."""
        tracker = self.trackers.get(address)
        if after is Listing.ABSENT:
            if tracker is not None and tracker.listed:
                tracker.listed = False
                self._fire(tracker, PodEvent.UNLISTED, now, "no longer in the file")
            return
        drained = after is Listing.DRAINED
        if tracker is None:
            tracker = self.trackers[address] = PodTracker(address, 0, now)
            tracker.drain = drained
            if drained:
                self._fire(tracker, PodEvent.DRAIN_SET, now, "listed with drain: true")
            else:
                self._admit_unprobed(tracker, now, "listed")
            return
        was_listed, was_drained = tracker.listed, tracker.drain
        tracker.listed, tracker.drain = True, drained
        if tracker.parked:
            if drained and not was_drained:
                self._fire(tracker, PodEvent.DRAIN_SET, now, "drain: true")
            return  # its launcher keeps it drained until it wants it again
        if not was_listed:
            if not drained:
                self._fire(tracker, PodEvent.LISTED, now, "listed again")
                self._admit_unprobed(tracker, now, "listed again")
        elif was_drained and not drained:
            self._fire(tracker, PodEvent.DRAIN_CLEARED, now, "drain cleared")
            self._admit_unprobed(tracker, now, "drain cleared")
        elif drained and not was_drained:
            self._fire(tracker, PodEvent.DRAIN_SET, now, "drain: true")

    def _admit_unprobed(self, tracker: PodTracker, now: float, why: str) -> None:
        """With ``probe: null`` a wanted pending pod is routable at once."""
        if self.config.probe is None and tracker.state is PENDING:
            self._fire(tracker, PodEvent.PROBE_PASSED, now, f"{why} (no probe configured)")

    def _fire(self, tracker: PodTracker, event: PodEvent, now: float, reason: str) -> None:
        old = tracker.state
        new = next_state(old, event)
        if new is not old:
            tracker.state_seconds[old] = tracker.state_seconds.get(old, 0.0) + now - tracker.since
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
            self._transitions.append(Transition(self.name, tracker.address, old, new, event, reason))
        if new is DRAINING and tracker.in_flight == 0:
            self._fire(tracker, PodEvent.LAST_RELEASED, now, "nothing in flight")
            return
        if new is REMOVED and not tracker.listed and tracker.in_flight == 0:
            self.policy.discard(tracker)
            del self.trackers[tracker.address]
            return
        self._refresh(tracker)

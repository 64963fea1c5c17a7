"""The last fifteen minutes, one point a second, per service and per pod.

What this module decides, and its rules:

- **Per request, a few increments** (``History.request_done``, from the observer when a
  request is over): into its service's ``Counters``: requests, the answer's status class,
  the reason when the activator answered itself (``X-Activator-Reason``: a *rejection*),
  request and response body bytes, the latency's histogram bucket and sum, and, when it
  got a slot, its queue wait's bucket of the current second, the wait's sum and the
  second's longest wait; into its pod's ``PodCounters`` (when it reached one): the
  status class, and the pod's time (request sent to last byte). Nothing is allocated,
  nothing is kept per request. A request of no service (refused before routing: a head
  the engine refused, an unknown host) counts only as a *refusal*, by reason
  (``History.refused``).
- **Label values exist before their first event**: ``totals.rejected`` of every service
  holds every reason of ``SERVICE_REASONS``, ``refused`` every reason of
  ``REFUSED_BEFORE_ROUTING``, a pod's ``responses`` every class, at 0 until it happens
  (a rate over a reason that never happened is 0, not "no data").
- **Once a second** (``History.sample``, from one greenlet of the shell): each service's
  ring gets one point: the increase of its counters since the last point (requests,
  answers by class, rejections by reason, bytes in and out), what the topology says now
  (queued, in flight, capacity, pods per state), and queue wait p50/p99 of the requests
  that got their slot in that second, read off that second's histogram (the upper bound
  of the bucket holding the rank, never above the second's longest wait; None when no
  request got a slot). Each pod's ring gets its in-flight count, its highest in flight
  since the last point (``PodTracker.take_recent_peak``: a peak between two samples is
  not lost), the increase of its tracker's requests (grants) and transport failures, and
  of its answers and their pod time. A point is keyed by its wall-clock second (so that workers' points line up); a
  second that was not sampled (the process busy) is simply absent from the time axis.
- **Bounded memory.** A ring is a set of preallocated arrays of ``POINTS`` (900) values,
  indexed by second modulo 900; see ``service_ring_bytes`` and ``pod_ring_bytes`` for
  the exact bound. A service keeps its last ``TRANSITIONS_KEPT`` pod state changes. A
  service's rings, counters and changes go when the service leaves the topology, a
  pod's ring when its tracker does. Rejection series are allocated on a reason's first
  occurrence; reasons are the finite set of the activator's own answers (``REASONS``).
- **Export and merge** are pure: ``History.export`` is the JSON of ``/status/history``;
  ``merge_histories`` merges several workers' exports point-wise (see there);
  ``History.annotate`` adds the counters' totals, the last ten seconds' rates and the
  histograms to the services of ``/status``.

Nothing here yields or does I/O; the caller passes the time.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from ..core.errors import (
    ActivatorError,
    BadHost,
    BadRequest,
    BodyTooLarge,
    ClientGone,
    ClientTimeout,
    HeadersTooLarge,
    NotOriginForm,
    RequestLineTooLong,
    TooManyConnections,
    UnknownHost,
    UnsupportedMethod,
    UnsupportedTransferEncoding,
)
from ..core.states import PodState
from ..core.throttler import PodTracker, ServiceThrottler, Transition

#: Points kept per series: fifteen minutes at one a second.
POINTS = 900
#: Pod state changes kept per service.
TRANSITIONS_KEPT = 200
#: Seconds the rates of /status average over.
RATE_WINDOW = 10
#: Upper bounds (seconds, inclusive) of the histogram buckets of queue waits and
#: latencies; one more bucket holds everything above the last.
BOUNDS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
BUCKETS = len(BOUNDS) + 1
CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
STATES = tuple(state.value for state in PodState)
#: Longest reason text kept with a state change.
REASON_CHARS = 160


def _own_reasons() -> frozenset[str]:
    """Every ``X-Activator-Reason`` of an answer the activator makes itself (not
    ``client-gone``: nothing is answered then)."""
    found: set[str] = set()
    todo: list[type[ActivatorError]] = [ActivatorError]
    while todo:
        cls = todo.pop()
        found.add(cls.reason)
        todo.extend(cls.__subclasses__())
    found.discard(ClientGone.reason)
    return frozenset(found)


#: The reasons counted as rejections.
REASONS = _own_reasons()
#: What only the engine (a head llhttp, ``core.http`` or a limit refused) or the router
#: (no service for the Host) answers: never under a service.
_ONLY_BEFORE_ROUTING = frozenset(
    cls.reason
    for cls in (
        BadRequest,
        BadHost,
        NotOriginForm,
        UnsupportedMethod,
        UnsupportedTransferEncoding,
        RequestLineTooLong,
        HeadersTooLarge,
        TooManyConnections,
        UnknownHost,
    )
)
#: Refusals of requests no service was found for (counted in ``History.refusals``):
#: those, and the two that come before routing or after it (a declared body too large,
#: a head too slow; a body too large or too slow once routed).
REFUSED_BEFORE_ROUTING = _ONLY_BEFORE_ROUTING | {BodyTooLarge.reason, ClientTimeout.reason}
#: The rejections a service's requests can get.
SERVICE_REASONS = REASONS - _ONLY_BEFORE_ROUTING

# Typecodes: counts of one second fit in 32 bits; bytes do not; gauges may be -1 (none).
_COUNT, _GAUGE, _BYTES, _SECONDS, _TIME = "I", "i", "d", "f", "q"


def _zeros(typecode: str, n: int = POINTS) -> array[Any]:
    return array(typecode, bytes(array(typecode).itemsize * n))


def _itemsize(typecode: str) -> int:
    return array(typecode).itemsize


def service_ring_bytes(reasons: int = len(REASONS)) -> int:
    """The array payload of one service's history, with ``reasons`` rejection series.

    Per point: the time (8 bytes), requests and 5 status classes (6 x 4), bytes in and
    out (2 x 8), queued, in flight, capacity (3 x 4), wait p50 and p99 (2 x 4), pods in
    each of the 4 states (4 x 4): 84 bytes, plus 4 per rejection reason seen.
    """
    per_point = (
        _itemsize(_TIME)
        + (1 + len(CLASSES)) * _itemsize(_COUNT)
        + 2 * _itemsize(_BYTES)
        + 3 * _itemsize(_GAUGE)
        + 2 * _itemsize(_SECONDS)
        + len(STATES) * _itemsize(_COUNT)
        + reasons * _itemsize(_COUNT)
    )
    return POINTS * per_point


def pod_ring_bytes() -> int:
    """The array payload of one pod's history: in flight and its peak, requests,
    failures, answers (6 x 4 bytes a point), and the answers' pod time."""
    return POINTS * (2 * _itemsize(_GAUGE) + 3 * _itemsize(_COUNT) + _itemsize(_SECONDS))


class RequestFacts(Protocol):
    """What a finished request tells the history (``observe.RequestRecord``)."""

    start: float
    end: float
    service: str
    pod: str
    status: int
    reason: str
    queue_wait: float | None
    upstream_start: float | None
    bytes_in: int
    bytes_out: int


class PodCounters:
    """One pod's answers (cumulative since it was first answered here): by status class,
    and the pod time of those that reached it (request sent to last byte)."""

    __slots__ = ("classes", "answered", "pod_seconds")

    def __init__(self) -> None:
        self.classes = [0] * 10  # by status // 100
        self.answered = 0  # requests sent to the pod (a pod time was measured)
        self.pod_seconds = 0.0


class Counters:
    """One service's request counters (cumulative since it appeared here), and its queue
    waits of the current second. Updated per request: does not yield."""

    __slots__ = (
        "requests",
        "classes",
        "rejected",
        "bytes_in",
        "bytes_out",
        "latency",
        "latency_sum",
        "waits",
        "wait_sum",
        "second_waits",
        "second_wait_max",
        "transitions",
        "pods",
    )

    def __init__(self) -> None:
        self.requests = 0
        self.classes = [0] * 10  # by status // 100; 0: no status
        self.rejected: dict[str, int] = {}  # reason -> count
        self.bytes_in = 0
        self.bytes_out = 0
        self.latency = [0] * BUCKETS  # arrival to last byte, by bucket
        self.latency_sum = 0.0
        self.waits = [0] * BUCKETS  # queue waits up to the last sample, by bucket
        self.wait_sum = 0.0
        self.second_waits = [0] * BUCKETS  # queue waits since the last sample
        self.second_wait_max = 0.0
        self.transitions: dict[str, int] = {}  # new state -> pod state changes into it
        self.pods: dict[str, PodCounters] = {}  # by address; a pod no longer tracked goes at the next sample


class _PodRing:
    __slots__ = (
        "first",
        "in_flight",
        "peak",
        "requests",
        "failures",
        "answered",
        "pod_seconds",
        "tracker",
        "answers",
        "seen_requests",
        "seen_failures",
        "seen_answered",
        "seen_pod_seconds",
    )

    def __init__(self, first: int) -> None:
        self.first = first  # the first second it was sampled
        self.in_flight = _zeros(_GAUGE)
        self.peak = _zeros(_GAUGE)  # the highest in flight during the second
        self.requests = _zeros(_COUNT)
        self.failures = _zeros(_COUNT)
        self.answered = _zeros(_COUNT)
        self.pod_seconds = _zeros(_SECONDS)
        self.tracker: PodTracker | None = None
        self.answers: PodCounters | None = None
        self.seen_requests = 0
        self.seen_failures = 0
        self.seen_answered = 0
        self.seen_pod_seconds = 0.0

    def sample(self, tracker: PodTracker, answers: PodCounters | None, slot: int) -> None:
        """The pod's point at ``slot``: what its tracker and its answers' counters say."""
        if self.tracker is not tracker:  # a new tracker counts from zero
            self.tracker, self.seen_requests, self.seen_failures = tracker, 0, 0
        self.in_flight[slot] = tracker.in_flight
        self.peak[slot] = tracker.take_recent_peak()
        self.requests[slot] = tracker.requests - self.seen_requests
        self.failures[slot] = tracker.failures_total - self.seen_failures
        self.seen_requests, self.seen_failures = tracker.requests, tracker.failures_total
        if answers is not self.answers:  # new counters count from zero
            self.answers, self.seen_answered, self.seen_pod_seconds = answers, 0, 0.0
        if answers is None:
            self.answered[slot], self.pod_seconds[slot] = 0, 0.0
            return
        self.answered[slot] = answers.answered - self.seen_answered
        self.pod_seconds[slot] = answers.pod_seconds - self.seen_pod_seconds
        self.seen_answered, self.seen_pod_seconds = answers.answered, answers.pod_seconds


class _ServiceRing:
    __slots__ = (
        "times",
        "requests",
        "classes",
        "rejected",
        "bytes_in",
        "bytes_out",
        "queued",
        "in_flight",
        "capacity",
        "wait_p50",
        "wait_p99",
        "pods_in_state",
        "pods",
        "last",
        "seen_requests",
        "seen_classes",
        "seen_rejected",
        "seen_bytes_in",
        "seen_bytes_out",
    )

    def __init__(self) -> None:
        # Invariant: times[k % POINTS] == k exactly when second k was sampled and is
        # one of the last POINTS seconds up to ``last``.
        self.times = _zeros(_TIME)
        self.requests = _zeros(_COUNT)
        self.classes = [_zeros(_COUNT) for _ in CLASSES]
        self.rejected: dict[str, array[Any]] = {}
        self.bytes_in = _zeros(_BYTES)
        self.bytes_out = _zeros(_BYTES)
        self.queued = _zeros(_GAUGE)
        self.in_flight = _zeros(_GAUGE)
        self.capacity = _zeros(_GAUGE)  # -1: unlimited
        self.wait_p50 = _zeros(_SECONDS)  # NaN: no request got a slot that second
        self.wait_p99 = _zeros(_SECONDS)
        self.pods_in_state = {state: _zeros(_COUNT) for state in STATES}
        self.pods: dict[str, _PodRing] = {}
        self.last = -1  # the last second sampled
        self.seen_requests = 0
        self.seen_classes = [0] * 10
        self.seen_rejected: dict[str, int] = {}
        self.seen_bytes_in = 0
        self.seen_bytes_out = 0

    def keys(self, seconds: int) -> list[int]:
        """The sampled seconds among the last ``seconds`` (at most POINTS), oldest first."""
        seconds = max(0, min(seconds, POINTS))
        times = self.times
        return [k for k in range(self.last - seconds + 1, self.last + 1) if k > 0 and times[k % POINTS] == k]


def percentile(buckets: list[int], q: float, most: float) -> float | None:
    """The ``q`` quantile of a histogram over ``BOUNDS``: the upper bound of the bucket
    holding that rank, never above ``most`` (the largest value seen); None when empty."""
    total = sum(buckets)
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for index, count in enumerate(buckets):
        seen += count
        if seen >= rank:
            return min(BOUNDS[index], most) if index < len(BOUNDS) else most
    return most  # not reached: the ranks add up to total


class History:
    """Counters per request, rings per second, state changes (see the module docstring).

    No method yields; ``request_done``, ``transition`` and ``reload`` never raise on
    what a request or the topology hands them.
    """

    def __init__(self) -> None:
        self.counters: dict[str, Counters] = {}
        self.rings: dict[str, _ServiceRing] = {}
        self.transitions: dict[str, deque[tuple[float, str, str, str, str]]] = {}
        self.reloads = {"ok": 0, "failed": 0}
        #: Requests refused before a service was found for them, by reason.
        self.refusals: dict[str, int] = dict.fromkeys(sorted(REFUSED_BEFORE_ROUTING), 0)
        self.last = -1  # the last second sampled

    # -- events (per request, per pod change, per reload) --------------------------

    def request_done(self, record: RequestFacts) -> None:
        """Count one finished request. A few increments; does not yield."""
        service = record.service
        if service == "-":
            if record.reason in REASONS:
                self.refused(record.reason)
            return
        counters = self.counters.get(service)
        if counters is None:
            counters = self.counters[service] = Counters()
        counters.requests += 1
        status_class = record.status // 100
        if status_class < 10:
            counters.classes[status_class] += 1
        if record.pod != "-":
            pod = counters.pods.get(record.pod)
            if pod is None:
                pod = counters.pods[record.pod] = PodCounters()
            if status_class < 10:
                pod.classes[status_class] += 1
            if record.upstream_start is not None:
                pod.answered += 1
                pod.pod_seconds += record.end - record.upstream_start
        reason = record.reason
        if reason in REASONS:
            counters.rejected[reason] = counters.rejected.get(reason, 0) + 1
        counters.bytes_in += record.bytes_in
        counters.bytes_out += record.bytes_out
        latency = record.end - record.start
        counters.latency[bisect_left(BOUNDS, latency)] += 1
        counters.latency_sum += latency
        wait = record.queue_wait
        if wait is not None:
            counters.second_waits[bisect_left(BOUNDS, wait)] += 1
            counters.wait_sum += wait
            if wait > counters.second_wait_max:
                counters.second_wait_max = wait

    def transition(self, transition: Transition, wall: float) -> None:
        """Keep a pod state change (at wall-clock time ``wall``) and count it. Does not yield."""
        kept = self.transitions.get(transition.service)
        if kept is None:
            kept = self.transitions[transition.service] = deque(maxlen=TRANSITIONS_KEPT)
        new = transition.new.value
        kept.append((wall, transition.address, transition.old.value, new, transition.reason[:REASON_CHARS]))
        counters = self.counters.get(transition.service)
        if counters is None:
            counters = self.counters[transition.service] = Counters()
        counters.transitions[new] = counters.transitions.get(new, 0) + 1

    def reload(self, ok: bool) -> None:
        self.reloads["ok" if ok else "failed"] += 1

    def refused(self, reason: str) -> None:
        """Count a request refused before it was routed. Does not yield."""
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    # -- the sampler's step --------------------------------------------------------

    def sample(self, services: Mapping[str, ServiceThrottler], second: int) -> None:
        """One point for every service and pod, keyed ``second`` (whole wall-clock
        seconds). A second not after the last one sampled (the clock went back) adds
        nothing: the counts wait for the next point. Does not yield."""
        if second <= self.last:
            return
        self.last = second
        slot = second % POINTS
        for name, throttler in services.items():
            ring = self.rings.get(name)
            if ring is None:
                ring = self.rings[name] = _ServiceRing()
            counters = self.counters.get(name)
            if counters is None:
                counters = self.counters[name] = Counters()
            ring.last = second
            ring.times[slot] = second
            self._sample_counters(ring, counters, slot)
            ring.queued[slot] = throttler.queued
            ring.in_flight[slot] = throttler.in_flight
            capacity = throttler.capacity
            ring.capacity[slot] = -1 if capacity is None else capacity
            per_state = dict.fromkeys(STATES, 0)
            pods = ring.pods
            answers = counters.pods
            for address, tracker in throttler.trackers.items():
                per_state[tracker.state.value] += 1
                pod = pods.get(address)
                if pod is None:
                    pod = pods[address] = _PodRing(second)
                pod.sample(tracker, answers.get(address), slot)
            for state, count in per_state.items():
                ring.pods_in_state[state][slot] = count
            if len(pods) != len(throttler.trackers):
                for address in [a for a in pods if a not in throttler.trackers]:
                    del pods[address]
            for address in [a for a in answers if a not in throttler.trackers]:
                del answers[address]  # a pod no longer tracked (or a peer forwarded to)
        for table in (self.rings, self.counters, self.transitions):
            for name in [n for n in table if n not in services]:
                del table[name]

    @staticmethod
    def _sample_counters(ring: _ServiceRing, counters: Counters, slot: int) -> None:
        ring.requests[slot] = counters.requests - ring.seen_requests
        ring.seen_requests = counters.requests
        for index, series in enumerate(ring.classes, start=1):
            series[slot] = counters.classes[index] - ring.seen_classes[index]
        ring.seen_classes = list(counters.classes)
        for series in ring.rejected.values():
            series[slot] = 0
        for reason, count in counters.rejected.items():
            increase = count - ring.seen_rejected.get(reason, 0)
            if increase:
                rejected = ring.rejected.get(reason)
                if rejected is None:
                    rejected = ring.rejected[reason] = _zeros(_COUNT)
                rejected[slot] = increase
        ring.seen_rejected = dict(counters.rejected)
        ring.bytes_in[slot] = counters.bytes_in - ring.seen_bytes_in
        ring.bytes_out[slot] = counters.bytes_out - ring.seen_bytes_out
        ring.seen_bytes_in, ring.seen_bytes_out = counters.bytes_in, counters.bytes_out
        waits, most = counters.second_waits, counters.second_wait_max
        p50, p99 = percentile(waits, 0.5, most), percentile(waits, 0.99, most)
        ring.wait_p50[slot] = math.nan if p50 is None else p50
        ring.wait_p99[slot] = math.nan if p99 is None else p99
        for index, count in enumerate(waits):
            counters.waits[index] += count
        counters.second_waits = [0] * BUCKETS
        counters.second_wait_max = 0.0

    # -- views ---------------------------------------------------------------------

    def export(self, seconds: int = POINTS, pods: bool = True) -> dict[str, Any]:
        """``/status/history``: per service its time axis (``t``, wall-clock seconds,
        oldest first) and a series per measure aligned to it, its pod state changes and
        (``pods``) a series per pod and measure. Counts are per point (the second that
        ends at ``t``); ``capacity`` None is unlimited; wait percentiles None when no
        request got a slot that second; a pod's values None before it was tracked."""
        services: dict[str, Any] = {}
        for name, ring in sorted(self.rings.items()):
            keys = ring.keys(seconds)
            slots = [k % POINTS for k in keys]

            def counts(series: array[Any], slots: list[int] = slots) -> list[int]:
                return [series[s] for s in slots]

            def amounts(series: array[Any], slots: list[int] = slots) -> list[int]:
                return [int(series[s]) for s in slots]

            def waits(series: array[Any], slots: list[int] = slots) -> list[float | None]:
                return [None if math.isnan(series[s]) else round(series[s], 6) for s in slots]

            entry: dict[str, Any] = {
                "t": keys,
                "requests": counts(ring.requests),
                "responses": {cls: counts(series) for cls, series in zip(CLASSES, ring.classes, strict=True)},
                "rejected": {reason: counts(series) for reason, series in sorted(ring.rejected.items())},
                "bytes_in": amounts(ring.bytes_in),
                "bytes_out": amounts(ring.bytes_out),
                "queued": counts(ring.queued),
                "in_flight": counts(ring.in_flight),
                "capacity": [None if ring.capacity[s] < 0 else ring.capacity[s] for s in slots],
                "queue_wait_p50": waits(ring.wait_p50),
                "queue_wait_p99": waits(ring.wait_p99),
                "pods_in_state": {state: counts(series) for state, series in ring.pods_in_state.items()},
                "transitions": self._transitions(name, keys[0] if keys else None),
            }
            if pods:
                entry["pods"] = {
                    address: {
                        measure: [None if k < pod.first else series[k % POINTS] for k in keys]
                        for measure, series in (
                            ("in_flight", pod.in_flight),
                            ("peak_in_flight", pod.peak),
                            ("requests", pod.requests),
                            ("failures", pod.failures),
                        )
                    }
                    for address, pod in sorted(ring.pods.items())
                }
            services[name] = entry
        return {"interval_seconds": 1, "points": POINTS, "last": self.last, "services": services}

    def _transitions(self, service: str, since: int | None) -> list[dict[str, Any]]:
        kept = self.transitions.get(service, ())
        return [
            {"t": round(wall, 3), "pod": pod, "old": old, "new": new, "reason": reason}
            for wall, pod, old, new, reason in kept
            if since is None or wall >= since - 1
        ]

    def annotate(self, services: dict[str, Any]) -> dict[str, Any]:
        """Add to each service of a /status snapshot (in place; returned): ``totals``
        (since the service appeared in this process), ``per_second`` and
        ``requests_per_second`` (the average of the last RATE_WINDOW points),
        ``latency_seconds`` and ``queue_wait_seconds`` (histograms over ``BOUNDS``:
        per-bucket counts, sum); and to each pod its ``requests_per_second``,
        ``responses`` (by class, since it was first answered here),
        ``pod_time_seconds`` (count and sum of its answers' pod time),
        ``recent_pod_time_seconds`` (the same over the last RATE_WINDOW seconds), and
        ``peak_in_flight_window``: its highest in flight over the history kept (the
        last POINTS seconds, or as many as there are)."""
        for name, service in services.items():
            counters = self.counters.get(name) or Counters()
            ring = self.rings.get(name)
            slots = [k % POINTS for k in ring.keys(RATE_WINDOW)] if ring is not None else []
            per_second = _rates(ring, slots)
            service["requests_per_second"] = per_second["requests"]
            service["per_second"] = per_second
            rejected = dict.fromkeys(SERVICE_REASONS, 0) | counters.rejected
            service["totals"] = {
                "requests": counters.requests,
                "responses": {cls: counters.classes[i] for i, cls in enumerate(CLASSES, start=1)},
                "rejected": dict(sorted(rejected.items())),
                "bytes_in": counters.bytes_in,
                "bytes_out": counters.bytes_out,
                "pod_transitions": dict(sorted(counters.transitions.items())),
            }
            service["latency_seconds"] = _histogram(counters.latency, counters.latency_sum)
            # The waits since the last sample count too: the sum already holds them.
            waits = [kept + recent for kept, recent in zip(counters.waits, counters.second_waits, strict=True)]
            service["queue_wait_seconds"] = _histogram(waits, counters.wait_sum)
            pod_rings = ring.pods if ring is not None else {}
            window = ring.keys(POINTS) if ring is not None else []
            for pod in service.get("pods", ()):
                address = pod["address"]
                pod_ring = pod_rings.get(address)
                answers = counters.pods.get(address) or PodCounters()
                pod["responses"] = {cls: answers.classes[i] for i, cls in enumerate(CLASSES, start=1)}
                pod["pod_time_seconds"] = {"count": answers.answered, "sum": round(answers.pod_seconds, 6)}
                if pod_ring is None:
                    pod["requests_per_second"] = 0.0
                    pod["recent_pod_time_seconds"] = {"count": 0, "sum": 0.0}
                    pod["peak_in_flight_window"] = pod.get("peak_in_flight", pod["in_flight"])
                    continue
                pod["requests_per_second"] = _rate(pod_ring.requests, slots)
                pod["recent_pod_time_seconds"] = {
                    "count": sum(pod_ring.answered[s] for s in slots),
                    "sum": round(sum(pod_ring.pod_seconds[s] for s in slots), 6),
                }
                since_sampled = pod_ring.tracker.recent_peak if pod_ring.tracker is not None else 0
                pod["peak_in_flight_window"] = max(_window_peak(pod_ring, window), since_sampled, pod["in_flight"])
        return services


def _window_peak(pod: _PodRing, keys: list[int]) -> int:
    """The highest of a pod's per-second peaks at ``keys`` (its sampled seconds)."""
    if len(keys) == POINTS and pod.first <= keys[0]:  # every slot is in the window
        return int(max(pod.peak))
    peaks = pod.peak
    return int(max((peaks[k % POINTS] for k in keys if k >= pod.first), default=0))


def _rate(series: array[Any], slots: list[int]) -> float:
    """The average of ``series`` over ``slots`` (0 when there is none)."""
    return round(sum(series[s] for s in slots) / len(slots), 3) if slots else 0.0


def _rates(ring: _ServiceRing | None, slots: list[int]) -> dict[str, Any]:
    """A service's ``per_second`` of /status: its counts averaged over ``slots``."""
    if ring is None or not slots:
        return {
            "requests": 0.0,
            "responses": dict.fromkeys(CLASSES, 0.0),
            "rejected": 0.0,
            "bytes_in": 0.0,
            "bytes_out": 0.0,
        }
    return {
        "requests": _rate(ring.requests, slots),
        "responses": {cls: _rate(series, slots) for cls, series in zip(CLASSES, ring.classes, strict=True)},
        "rejected": round(sum((_rate(series, slots) for series in ring.rejected.values()), 0.0), 3),
        "bytes_in": _rate(ring.bytes_in, slots),
        "bytes_out": _rate(ring.bytes_out, slots),
    }


def _histogram(buckets: list[int], total: float) -> dict[str, Any]:
    return {"bounds": list(BOUNDS), "counts": list(buckets), "sum": round(total, 6)}


# -- several workers -----------------------------------------------------------------


def merge_histories(histories: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One activator's history from its workers' (``History.export`` each), point-wise.

    Points are matched by their second (``t``): the merged axis is every second any
    worker sampled. At each second, counts and gauges are summed over the workers that
    have that point (capacity is None, unlimited, if any of them says so); queue wait
    p50 and p99 are the *largest* of the workers' values: the true percentile of all
    the workers' waits together is never above it (at least that share of every
    worker's waits is at or below it), so it is an upper bound, exact with one worker.
    State changes are joined, each marked with its ``worker`` (every worker tracks every
    pod itself), in time order. Pure.
    """
    histories = list(histories)
    names = sorted({name for h in histories for name in h.get("services", {})})
    services = {}
    for name in names:
        parts = [(i, h["services"][name]) for i, h in enumerate(histories) if name in h.get("services", {})]
        services[name] = _ServiceMerge(parts).merged()
    return {
        "interval_seconds": 1,
        "points": POINTS,
        "last": max((h.get("last", -1) for h in histories), default=-1),
        "workers": len(histories),
        "services": services,
    }


class _ServiceMerge:
    """One service's history merged from its workers' (see ``merge_histories``)."""

    def __init__(self, parts: list[tuple[int, Mapping[str, Any]]]) -> None:
        self.parts = parts
        self.axis = sorted({t for _, part in parts for t in part["t"]})
        self.where = {t: i for i, t in enumerate(self.axis)}

    def keys(self, field: str) -> list[str]:
        return sorted({key for _, part in self.parts for key in part.get(field, {})})

    def fold(self, into: list[Any], times: list[int], values: list[Any] | None, how: str) -> None:
        """Fold one worker's ``values`` (at ``times``) into ``into``."""
        if values is None:
            return
        where = self.where
        for t, value in zip(times, values, strict=True):
            i = where[t]
            have = into[i]
            if how == "max":
                if value is not None and (have is None or value > have):
                    into[i] = value
            elif how == "capacity":
                into[i] = None if value is None or have is None else have + value
            elif value is not None:
                into[i] = value if have is None else have + value

    def series(self, get: Any, how: str = "sum") -> list[Any]:
        """``get(part)`` of every worker merged ``how``: "sum" (a missing point is 0),
        "max" (None when no worker has a value) or "capacity" (None wins)."""
        # Every second of the axis is some worker's point: capacity starts at 0 there.
        into: list[Any] = [0] * len(self.axis) if how == "capacity" else [None] * len(self.axis)
        for _, part in self.parts:
            self.fold(into, part["t"], get(part), how)
        return [0 if v is None else v for v in into] if how == "sum" else into

    def merged(self) -> dict[str, Any]:
        series = self.series
        entry: dict[str, Any] = {
            "t": self.axis,
            "requests": series(lambda p: p["requests"]),
            "responses": {cls: series(lambda p, c=cls: p["responses"].get(c)) for cls in CLASSES},
            "rejected": {r: series(lambda p, r=r: p["rejected"].get(r)) for r in self.keys("rejected")},
            "bytes_in": series(lambda p: p["bytes_in"]),
            "bytes_out": series(lambda p: p["bytes_out"]),
            "queued": series(lambda p: p["queued"]),
            "in_flight": series(lambda p: p["in_flight"]),
            "capacity": series(lambda p: p["capacity"], "capacity"),
            "queue_wait_p50": series(lambda p: p["queue_wait_p50"], "max"),
            "queue_wait_p99": series(lambda p: p["queue_wait_p99"], "max"),
            "pods_in_state": {s: series(lambda p, s=s: p["pods_in_state"].get(s)) for s in self.keys("pods_in_state")},
            "transitions": sorted(
                (dict(change, worker=i) for i, part in self.parts for change in part.get("transitions", ())),
                key=lambda change: change["t"],
            ),
        }
        if any("pods" in part for _, part in self.parts):
            pods: dict[str, Any] = {}
            for address in self.keys("pods"):
                pods[address] = {}
                for measure in ("in_flight", "peak_in_flight", "requests", "failures"):
                    into: list[Any] = [None] * len(self.axis)  # None: no worker tracked it then
                    for _, part in self.parts:
                        pod = part.get("pods", {}).get(address)
                        if pod is not None:
                            self.fold(into, part["t"], pod[measure], "sum")
                    pods[address][measure] = into
            entry["pods"] = pods
        return entry

"""The history (``activator.ops.history``): counters per request, one point a second, merges.

In-process and deterministic: real core throttlers (``probe: null`` pods are healthy at
once), real ``RequestRecord`` values, and the second of each point given explicitly.
"""

from __future__ import annotations

import math
import random
from array import array
from typing import Any

import pytest
from builders import svc
from hypothesis import given, settings
from hypothesis import strategies as st

from activator.core.failures import FailureKind
from activator.core.status import merge_worker_statuses
from activator.core.throttler import Grant, ServiceThrottler
from activator.ops.history import (
    BOUNDS,
    BUCKETS,
    CLASSES,
    POINTS,
    REASONS,
    REFUSED_BEFORE_ROUTING,
    SERVICE_REASONS,
    STATES,
    TRANSITIONS_KEPT,
    History,
    merge_histories,
    percentile,
    pod_ring_bytes,
    service_ring_bytes,
)
from activator.ops.observe import RequestRecord

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def throttler(*pods: str, cc: int = 1, name: str = "api") -> ServiceThrottler:
    return ServiceThrottler(svc(*pods, cc=cc, name=name), 0.0, rng=random.Random(0))


def record(
    service: str = "api",
    status: int = 200,
    reason: str = "-",
    wait: float | None = 0.0,
    latency: float = 0.01,
    bytes_in: int = 0,
    bytes_out: int = 0,
) -> RequestRecord:
    r = RequestRecord(100.0, "127.0.0.1", "GET", b"/")
    r.end = 100.0 + latency
    r.service, r.status, r.reason, r.queue_wait = service, status, reason, wait
    r.bytes_in, r.bytes_out = bytes_in, bytes_out
    return r


def point(history: History, field: str, service: str = "api") -> list[Any]:
    value: list[Any] = history.export()["services"][service][field]
    return value


# -- per request, per second ----------------------------------------------------------


def test_requests_become_one_point_per_second_by_class_reason_and_bytes() -> None:
    h = History()
    t = throttler(A)
    h.request_done(record(status=200, bytes_in=10, bytes_out=100))
    h.request_done(record(status=503, reason="queue-full", wait=None))
    h.request_done(record(status=499, reason="client-gone"))  # a 4xx, not a rejection
    h.request_done(record(status=502, reason="upstream-connect"))
    h.request_done(record(service="-", status=404, reason="unknown-host"))  # no service: a refusal only
    h.sample({"api": t}, 1000)
    h.request_done(record(status=204))
    h.sample({"api": t}, 1001)
    out = h.export()["services"]["api"]
    assert out["t"] == [1000, 1001]
    assert out["requests"] == [4, 1]
    assert out["responses"] == {"1xx": [0, 0], "2xx": [1, 1], "3xx": [0, 0], "4xx": [1, 0], "5xx": [2, 0]}
    assert out["rejected"] == {"queue-full": [1, 0], "upstream-connect": [1, 0]}
    assert out["bytes_in"] == [10, 0] and out["bytes_out"] == [100, 0]
    assert out["capacity"] == [1, 1] and out["in_flight"] == [0, 0] and out["queued"] == [0, 0]
    assert out["pods_in_state"]["healthy"] == [1, 1]
    status = h.annotate({"api": {"pods": []}})["api"]
    assert status["totals"]["requests"] == 5
    assert status["totals"]["responses"] == {"1xx": 0, "2xx": 2, "3xx": 0, "4xx": 1, "5xx": 2}
    rejected = status["totals"]["rejected"]
    assert {reason: n for reason, n in rejected.items() if n} == {"queue-full": 1, "upstream-connect": 1}
    assert set(rejected) == SERVICE_REASONS, "every reason a service's request can get, from the start"
    assert h.refusals["unknown-host"] == 1
    assert (status["totals"]["bytes_in"], status["totals"]["bytes_out"]) == (10, 100)
    assert status["requests_per_second"] == 2.5  # 5 requests over the 2 points there are
    assert status["per_second"]["rejected"] == 1.0


def pod_record(pod: str, status: int, pod_time: float | None) -> RequestRecord:
    r = record(status=status)
    r.pod = pod
    r.upstream_start = None if pod_time is None else r.end - pod_time
    return r


def test_each_pod_counts_its_answers_by_class_and_its_pod_time() -> None:
    h = History()
    t = throttler(A, B)
    h.sample({"api": t}, 1)
    h.request_done(pod_record(A, 200, 0.25))
    h.request_done(pod_record(A, 503, 0.5))
    h.request_done(pod_record(A, 499, None))  # the client left before it was sent: no pod time
    h.request_done(pod_record(B, 204, 0.125))
    h.sample({"api": t}, 2)
    h.request_done(pod_record(A, 200, 1.0))  # after the last point: in the totals, not the recent ones
    pods = {pod["address"]: pod for pod in h.annotate({"api": t.snapshot(2.0)})["api"]["pods"]}
    assert pods[A]["responses"] == {"1xx": 0, "2xx": 2, "3xx": 0, "4xx": 1, "5xx": 1}
    assert pods[A]["pod_time_seconds"] == {"count": 3, "sum": 1.75}
    assert pods[A]["recent_pod_time_seconds"] == {"count": 2, "sum": 0.75}
    assert pods[B]["responses"]["2xx"] == 1 and pods[B]["pod_time_seconds"] == {"count": 1, "sum": 0.125}


def test_a_peak_between_two_samples_is_kept_for_the_window_and_since_start() -> None:
    h = History()
    t = throttler(A, cc=2)
    h.sample({"api": t}, 1)
    grants = [t.acquire(1.0), t.acquire(1.0)]
    for g in grants:
        assert isinstance(g, Grant)
        t.release(g, 1.5)
    h.sample({"api": t}, 2)  # nothing in flight now, two at once during the second
    assert h.export()["services"]["api"]["pods"][A]["peak_in_flight"] == [0, 2]
    (pod,) = h.annotate({"api": t.snapshot(2.0)})["api"]["pods"]
    assert (pod["in_flight"], pod["peak_in_flight"], pod["peak_in_flight_window"]) == (0, 2, 2)
    one = t.acquire(3.0)  # not sampled yet: the window's peak includes the current second
    (pod,) = h.annotate({"api": t.snapshot(3.0)})["api"]["pods"]
    assert pod["peak_in_flight_window"] == 2 and pod["in_flight"] == 1
    assert isinstance(one, Grant)
    t.release(one, 3.0)
    for second in range(3, 4 + POINTS):  # the second with one in flight, then fifteen quiet minutes
        h.sample({"api": t}, second)
    (pod,) = h.annotate({"api": t.snapshot(9999.0)})["api"]["pods"]
    assert pod["peak_in_flight_window"] == 0 and pod["peak_in_flight"] == 2


def test_refusals_before_routing_are_counted_by_reason_from_zero() -> None:
    h = History()
    assert set(h.refusals) == REFUSED_BEFORE_ROUTING and not any(h.refusals.values())
    assert {"bad-request", "headers-too-large", "bad-host", "unknown-host"} <= REFUSED_BEFORE_ROUTING
    h.request_done(record(service="-", status=400, reason="bad-host"))
    h.request_done(record(service="-", status=400, reason="bad-host"))
    h.request_done(record(service="-", status=499, reason="client-gone"))  # nothing was refused
    assert h.refusals["bad-host"] == 2 and sum(h.refusals.values()) == 2
    assert not h.counters, "no service counts them"
    assert not REFUSED_BEFORE_ROUTING - REASONS and "unknown-host" not in SERVICE_REASONS


def test_the_rejection_reasons_are_the_activators_own_answers() -> None:
    assert {"queue-full", "queue-timeout", "shutting-down", "peer-unavailable", "upstream-connect"} <= REASONS
    assert "client-gone" not in REASONS and "upstream-body-cut" not in REASONS and "-" not in REASONS


def test_gauges_follow_the_topology() -> None:
    h = History()
    t = throttler(A, B)
    grants = [t.acquire(0.0) for _ in range(2)]
    waiter = t.acquire(0.0)
    h.sample({"api": t}, 10)
    assert all(isinstance(g, Grant) for g in grants)
    t.abandon(waiter)  # type: ignore[arg-type]
    for g in grants:
        t.release(g, 1.0)  # type: ignore[arg-type]
    h.sample({"api": t}, 11)
    assert point(h, "queued") == [1, 0]
    assert point(h, "in_flight") == [2, 0]
    assert point(h, "capacity") == [2, 2]
    pods = h.export()["services"]["api"]["pods"]
    # The peak of second 11 is 1: the grants were released during it.
    assert pods[A] == {"in_flight": [1, 0], "peak_in_flight": [1, 1], "requests": [1, 0], "failures": [0, 0]}
    assert pods[B] == {"in_flight": [1, 0], "peak_in_flight": [1, 1], "requests": [1, 0], "failures": [0, 0]}


def test_an_unlimited_service_has_no_capacity_number() -> None:
    h = History()
    h.sample({"api": throttler(A, cc=0)}, 5)
    assert point(h, "capacity") == [None]


def test_pod_series_count_grants_and_failures_and_start_when_the_pod_does() -> None:
    h = History()
    t = throttler(A)
    h.sample({"api": t}, 1)
    t.apply(svc(A, B), 1.0)
    g = t.acquire(1.0)
    assert isinstance(g, Grant)
    t.record_failure(g.pod.address, FailureKind.CONNECT, 1.0)
    t.record_failure(g.pod.address, FailureKind.RESET, 1.0)
    t.release(g, 1.0)
    h.sample({"api": t}, 2)
    pods = h.export()["services"]["api"]["pods"]
    assert pods[A] == {"in_flight": [0, 0], "peak_in_flight": [0, 1], "requests": [0, 1], "failures": [0, 2]}
    assert pods[B] == {
        "in_flight": [None, 0],
        "peak_in_flight": [None, 0],
        "requests": [None, 0],
        "failures": [None, 0],
    }
    assert t.trackers[A].failures_total == 2


def test_a_pod_or_a_service_that_leaves_takes_its_history_along() -> None:
    h = History()
    t = throttler(A, B)
    other = throttler(A, name="other")
    h.request_done(record(service="other"))
    h.sample({"api": t, "other": other}, 1)
    t.apply(svc(A), 1.0)  # B unlisted and idle: forgotten
    h.sample({"api": t}, 2)
    out = h.export()["services"]
    assert list(out) == ["api"] and list(out["api"]["pods"]) == [A]
    assert "other" not in h.counters and "other" not in h.rings


def test_the_ring_wraps_around_after_900_points() -> None:
    h = History()
    t = throttler(A)
    for second in range(1, 1001):
        for _ in range(second % 7):
            h.request_done(record())
        h.sample({"api": t}, second)
    out = h.export()["services"]["api"]
    assert out["t"] == list(range(101, 1001))
    assert out["requests"] == [s % 7 for s in range(101, 1001)]
    assert len(out["pods"][A]["requests"]) == POINTS
    last = h.export(seconds=3)["services"]["api"]
    assert last["t"] == [998, 999, 1000] and last["requests"] == [998 % 7, 999 % 7, 1000 % 7]


def test_unsampled_seconds_are_absent_and_a_clock_going_back_adds_nothing() -> None:
    h = History()
    t = throttler(A)
    h.request_done(record())
    h.sample({"api": t}, 10)
    h.request_done(record())
    h.sample({"api": t}, 9)  # the clock went back: nothing, the count waits
    h.sample({"api": t}, 10)  # the same second again: nothing
    h.request_done(record())
    h.sample({"api": t}, 14)  # 11..13 were not sampled (a busy process)
    out = h.export()["services"]["api"]
    assert out["t"] == [10, 14] and out["requests"] == [1, 2]
    # Seconds that fell out of the window, or were never written, are not shown again.
    h.sample({"api": t}, 14 + POINTS)
    assert h.export()["services"]["api"]["t"] == [14 + POINTS]


# -- queue wait percentiles -------------------------------------------------------------


def test_queue_wait_percentiles_come_from_each_seconds_buckets() -> None:
    h = History()
    t = throttler(A)
    for _ in range(98):
        h.request_done(record(wait=0.004))
    for _ in range(2):
        h.request_done(record(wait=7.0))
    h.sample({"api": t}, 1)
    h.sample({"api": t}, 2)  # nobody got a slot in that second
    for _ in range(100):
        h.request_done(record(wait=0.0002))
    h.request_done(record(wait=None, status=503, reason="queue-timeout"))  # no slot: no wait
    h.sample({"api": t}, 3)
    assert point(h, "queue_wait_p50") == [0.005, None, 0.0002]  # the bucket's bound, or the slowest
    assert point(h, "queue_wait_p99") == [7.0, None, 0.0002]
    wait = h.annotate({"api": {"pods": []}})["api"]["queue_wait_seconds"]
    assert wait["bounds"] == list(BOUNDS) and sum(wait["counts"]) == 200
    assert wait["sum"] == pytest.approx(98 * 0.004 + 14.0 + 100 * 0.0002)


def test_the_wait_histogram_counts_the_waits_since_the_last_sample_as_the_totals_do() -> None:
    h = History()
    h.sample({"api": throttler(A)}, 1)
    for _ in range(3):
        h.request_done(record(wait=0.02))
    service = h.annotate({"api": {"pods": []}})["api"]
    assert service["totals"]["requests"] == 3 == sum(service["queue_wait_seconds"]["counts"])
    assert service["queue_wait_seconds"]["sum"] == pytest.approx(0.06)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1000.0), min_size=1, max_size=300), st.sampled_from([0.5, 0.99]))
def test_a_percentile_is_an_upper_bound_in_the_true_values_bucket(values: list[float], q: float) -> None:
    buckets = [0] * BUCKETS
    for v in values:
        buckets[sum(1 for bound in BOUNDS if v > bound)] += 1
    got = percentile(buckets, q, max(values))
    true = sorted(values)[max(1, math.ceil(q * len(values))) - 1]
    assert got is not None
    assert true <= got <= max(values)
    lower = max([0.0, *(bound for bound in BOUNDS if bound < true)])
    assert got == max(values) or lower < got or got == true == 0.0


def test_an_empty_histogram_has_no_percentile() -> None:
    assert percentile([0] * BUCKETS, 0.99, 0.0) is None


# -- state changes ------------------------------------------------------------------------


def test_state_changes_are_kept_bounded_and_counted() -> None:
    h = History()
    t = throttler(A)
    h.sample({"api": t}, 1)
    for i in range(TRANSITIONS_KEPT + 50):
        effects = t.apply(svc() if i % 2 == 0 else svc(A), float(i))  # unlisted (gone), listed again
        for change in effects.transitions:
            h.transition(change, 1.5 + i * 0.001)
    kept = h.export()["services"]["api"]["transitions"]
    assert len(kept) == TRANSITIONS_KEPT
    assert set(kept[0]) == {"t", "pod", "old", "new", "reason"} and kept[0]["pod"] == A
    counted = h.annotate({"api": {"pods": []}})["api"]["totals"]["pod_transitions"]
    assert sum(counted.values()) > TRANSITIONS_KEPT


def test_reloads_are_counted() -> None:
    h = History()
    h.reload(True)
    h.reload(False)
    h.reload(False)
    assert h.reloads == {"ok": 1, "failed": 2}


# -- memory ---------------------------------------------------------------------------


def _payload(ring: Any) -> int:
    arrays: list[array[Any]] = []
    for name in type(ring).__slots__:
        value = getattr(ring, name)
        values = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        arrays.extend(v for v in values if isinstance(v, array))
    return sum(a.itemsize * len(a) for a in arrays)


def test_the_memory_bound_is_what_the_rings_hold() -> None:
    h = History()
    t = throttler(A)
    for reason in sorted(REASONS):
        h.request_done(record(status=503, reason=reason))
    h.sample({"api": t}, 1)
    ring = h.rings["api"]
    assert len(ring.rejected) == len(REASONS)
    assert _payload(ring) == service_ring_bytes(len(REASONS))
    assert _payload(ring.pods[A]) == pod_ring_bytes()
    # The numbers the README states: 84 bytes a point, 4 more per reason seen; 24 a pod.
    assert service_ring_bytes(0) == POINTS * 84 == 75_600
    assert pod_ring_bytes() == POINTS * 24 == 21_600
    assert service_ring_bytes(len(REASONS)) == POINTS * (84 + 4 * len(REASONS))
    # Many seconds later nothing grew.
    for second in range(2, 3 * POINTS):
        h.request_done(record(status=503, reason="queue-full", wait=0.5))
        h.sample({"api": t}, second)
    assert _payload(h.rings["api"]) == service_ring_bytes(len(REASONS))
    assert len(h.transitions.get("api", ())) <= TRANSITIONS_KEPT


# -- several workers ------------------------------------------------------------------


def _worker(seconds: list[int], per_second: int, wait: float, *, capacity_cc: int = 1) -> dict[str, Any]:
    h = History()
    t = throttler(A, cc=capacity_cc)
    for second in seconds:
        for _ in range(per_second):
            grant = t.acquire(float(second))
            assert isinstance(grant, Grant)
            t.release(grant, float(second))
            h.request_done(record(wait=wait, status=503 if per_second > 2 else 200, reason="-"))
        h.sample({"api": t}, second)
    return h.export()


def test_workers_histories_merge_point_wise() -> None:
    one = _worker([10, 11, 12], 1, 0.002)
    two = _worker([11, 12, 13], 3, 0.2, capacity_cc=0)
    merged = merge_histories([one, two])
    assert merged["workers"] == 2 and merged["last"] == 13
    out = merged["services"]["api"]
    assert out["t"] == [10, 11, 12, 13]
    assert out["requests"] == [1, 4, 4, 3]
    assert out["responses"]["2xx"] == [1, 1, 1, 0] and out["responses"]["5xx"] == [0, 3, 3, 3]
    assert out["capacity"] == [1, None, None, None]  # one worker unlimited: unlimited
    assert out["queue_wait_p99"] == [0.002, 0.2, 0.2, 0.2]  # the larger worker's value
    assert out["pods"][A]["requests"] == [1, 4, 4, 3]
    assert out["pods_in_state"]["healthy"] == [1, 2, 2, 1]


def test_merging_one_history_changes_nothing_but_the_workers_mark() -> None:
    h = History()
    t = throttler(A)
    h.sample({"api": t}, 1)
    effects = t.apply(svc(), 1.0)
    for change in effects.transitions:
        h.transition(change, 1.2)
    h.request_done(record(wait=0.3))
    h.sample({"api": t}, 2)
    exported = h.export()
    merged = merge_histories([exported])["services"]["api"]
    original = exported["services"]["api"]
    assert [dict(c, worker=0) for c in original["transitions"]] == merged["transitions"]
    for key in set(original) - {"transitions"}:
        assert merged[key] == original[key], key


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 5), st.floats(0.0, 20.0)), min_size=1, max_size=6),
        min_size=1,
        max_size=4,
    )
)
def test_merged_counts_are_the_sums_and_p99_the_largest(workers: list[list[tuple[int, float]]]) -> None:
    exports = []
    for plan in workers:
        h = History()
        t = throttler(A)
        for second, (count, wait) in enumerate(plan, start=1):
            for _ in range(count):
                h.request_done(record(wait=wait))
            h.sample({"api": t}, second)
        exports.append(h.export())
    merged = merge_histories(exports)["services"]["api"]
    for i, second in enumerate(merged["t"]):
        present = [e["services"]["api"] for e in exports if second in e["services"]["api"]["t"]]
        at = [p["t"].index(second) for p in present]
        assert merged["requests"][i] == sum(p["requests"][j] for p, j in zip(present, at, strict=True))
        p99s = [p["queue_wait_p99"][j] for p, j in zip(present, at, strict=True) if p["queue_wait_p99"][j] is not None]
        assert merged["queue_wait_p99"][i] == (max(p99s) if p99s else None)


def test_workers_statuses_merge_the_new_totals() -> None:
    def status(index: int, requests: int, probe_ago: float, oldest: float) -> dict[str, Any]:
        h = History()
        t = throttler(A)
        for _ in range(requests):
            h.request_done(record(status=503, reason="queue-full", wait=0.01))
        h.sample({"api": t}, 1)
        h.reload(index == 0)
        services = h.annotate({"api": t.snapshot(1.0) | {"forward_to": None}})
        services["api"]["oldest_wait_seconds"] = oldest
        probe = {"result": f"pass {index}", "duration_seconds": 0.1, "seconds_ago": probe_ago}
        services["api"]["pods"][0]["last_probe"] = probe
        services["api"]["pods"][0]["transport_failures"] = {"connect_errors.healthy": index + 1}
        services["api"]["pods"][0]["failures_total"] = index + 1
        return {"ready": True, "worker": {"index": index}, "reloads": dict(h.reloads), "services": services}

    merged = merge_worker_statuses([status(0, 2, 5.0, 0.5), status(1, 3, 1.0, 2.0)])
    api = merged["services"]["api"]
    assert merged["reloads"] == {"ok": 1, "failed": 1}
    assert api["totals"]["requests"] == 5 and api["totals"]["rejected"]["queue-full"] == 5
    assert api["totals"]["responses"]["5xx"] == 5
    assert api["requests_per_second"] == 5.0 and api["per_second"]["rejected"] == 5.0
    assert sum(api["queue_wait_seconds"]["counts"]) == 5
    assert api["queue_wait_seconds"]["bounds"] == list(BOUNDS)
    assert api["oldest_wait_seconds"] == 2.0
    (pod,) = api["pods"]
    assert pod["last_probe"]["result"] == "pass 1"  # the most recent
    assert pod["peak_in_flight"] == 0 and pod["responses"] == dict.fromkeys(CLASSES, 0)
    assert set(pod["seconds_by_state"]) == set(STATES)
    assert pod["failures_total"] == 3 and pod["transport_failures"] == {"connect_errors.healthy": 3}
    assert pod["requests_per_second"] == 0.0 and pod["slots"] == 2


def test_constants_describe_the_series() -> None:
    assert CLASSES == ("1xx", "2xx", "3xx", "4xx", "5xx")
    assert set(STATES) == {"pending", "healthy", "draining", "removed"}
    assert len(BOUNDS) + 1 == BUCKETS and list(BOUNDS) == sorted(BOUNDS)

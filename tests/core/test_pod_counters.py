"""What a pod tracker counts for the operator: peaks in flight, retries, time per state.

The proof that a limit held is the pod's highest in-flight count (HAProxy's "Sessions
Max"): kept since the tracker exists and since the history last took it, updated where
in-flight grows (every grant, and a slot reserved for an earlier incarnation's lend).
Deterministic, no sockets; ``check_invariants`` after every step.
"""

from __future__ import annotations

import random

import pytest
from builders import svc
from hypothesis import given, settings
from hypothesis import strategies as st

from activator.core.config import ProbeConfig
from activator.core.failures import FailureKind
from activator.core.probes import Verdict
from activator.core.throttler import Grant, ServiceThrottler, Waiter

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def throttler(*pods: str, cc: int = 1, **kw: object) -> ServiceThrottler:
    return ServiceThrottler(svc(*pods, cc=cc, **kw), 0.0, rng=random.Random(0))  # type: ignore[arg-type]


def grant(t: ServiceThrottler, now: float = 0.0) -> Grant:
    g = t.acquire(now)
    assert isinstance(g, Grant)
    t.check_invariants()
    return g


def test_the_peak_is_the_most_in_flight_at_once_and_survives_the_releases() -> None:
    t = throttler(A, cc=3)
    tracker = t.trackers[A]
    grants = [grant(t) for _ in range(3)]
    assert (tracker.in_flight, tracker.peak_in_flight, tracker.recent_peak) == (3, 3, 3)
    for g in grants:
        t.release(g, 1.0)
        t.check_invariants()
    assert (tracker.in_flight, tracker.peak_in_flight) == (0, 3)
    assert tracker.take_recent_peak() == 3
    assert tracker.take_recent_peak() == 0, "the recent peak starts over from what is in flight"
    kept = grant(t)
    assert tracker.take_recent_peak() == 1 and tracker.recent_peak == 1, "one still in flight"
    t.release(kept, 2.0)
    assert t.snapshot(2.0)["pods"][0]["peak_in_flight"] == 3


def test_a_pod_unlisted_and_listed_again_keeps_its_peak() -> None:
    t = throttler(A, cc=2)
    g1, g2 = grant(t), grant(t)
    t.apply(svc(cc=2), 1.0)  # unlisted while busy: draining, tracker kept
    t.apply(svc(A, cc=2), 2.0)
    t.check_invariants()
    assert t.trackers[A].peak_in_flight == 2
    for g in (g1, g2):
        t.release(g, 3.0)
    t.check_invariants()


def test_a_reserved_slot_counts_in_the_peak() -> None:
    t = ServiceThrottler(svc(A, cc=1), 0.0, rng=random.Random(0), sharing=True)
    g = t.reserve(A)
    assert t.trackers[A].peak_in_flight == 1
    t.check_invariants()
    t.release(g, 1.0)


def test_a_failed_connect_retried_elsewhere_counts_on_the_pod_that_failed() -> None:
    t = throttler(A, B)
    first = grant(t)
    failed_on = first.pod.address
    retried, _ = t.acquire_retry(first, 1.0)
    t.check_invariants()
    assert isinstance(retried, Grant) and retried.pod.address != failed_on
    assert t.trackers[failed_on].retries == 1 and t.trackers[retried.pod.address].retries == 0
    assert {p["address"]: p["retries"] for p in t.snapshot(1.0)["pods"]} == {failed_on: 1, retried.pod.address: 0}
    t.release(retried, 1.0)
    # With no other pod free, the retry waits at the head of the queue: still a retry.
    lone = throttler(A)
    only = grant(lone)
    waiter, effects = lone.acquire_retry(only, 2.0)
    assert isinstance(waiter, Waiter) and lone.trackers[A].retries == 1
    assert effects.woken == [waiter]
    assert waiter.grant is not None
    lone.release(waiter.grant, 2.0)
    lone.check_invariants()


def test_time_in_each_state_adds_up_to_the_trackers_life() -> None:
    probe = ProbeConfig(unhealthy_after=1)
    t = throttler(A, probe=probe)  # pending until a probe passes
    t.probe_result(A, Verdict.PASS, 2.0)  # pending 0..2
    t.probe_result(A, Verdict.FAIL, 5.0)  # healthy 2..5
    t.probe_result(A, Verdict.PASS, 5.5)  # pending 5..5.5
    t.check_invariants()
    (pod,) = t.snapshot(10.0)["pods"]  # healthy 5.5..10
    assert pod["seconds_by_state"] == {"pending": 2.5, "healthy": 7.5, "draining": 0.0, "removed": 0.0}
    assert pod["seconds_in_state"] == 4.5
    t.record_failure(A, FailureKind.CONNECT, 11.0)
    t.check_invariants()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["grant", "release", "take"]), max_size=60))
def test_peaks_bound_what_was_in_flight_whatever_the_order(steps: list[str]) -> None:
    t = throttler(A, cc=3, queue_depth=100)
    tracker = t.trackers[A]
    held: list[Grant] = []
    most = 0
    most_since_take = 0
    for step in steps:
        if step == "grant" and len(held) < 3:
            held.append(grant(t))
        elif step == "release" and held:
            t.release(held.pop(0), 1.0)
        elif step == "take":
            assert tracker.take_recent_peak() == most_since_take
            most_since_take = len(held)
        most = max(most, len(held))
        most_since_take = max(most_since_take, len(held))
        t.check_invariants()
        assert tracker.peak_in_flight == most and tracker.recent_peak == most_since_take


def test_the_invariant_catches_a_peak_below_what_is_in_flight() -> None:
    t = throttler(A, cc=2)
    grant(t)
    t.trackers[A].peak_in_flight = 0  # what a grant that forgot the peak would leave
    with pytest.raises(AssertionError, match="peak"):
        t.check_invariants()

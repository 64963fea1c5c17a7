"""The per-service throttler: deterministic tables, then random operation sequences.

No sockets, no sleeps: configs are built directly and time is an explicit float.
``check_invariants()`` is called after every step that changes something.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from builders import pod, svc

from activator.core.config import ProbeConfig, ServiceConfig
from activator.core.errors import QueueFull
from activator.core.states import PodEvent, PodState
from activator.core.throttler import Grant, InvariantViolation, ServiceThrottler, Transition, Waiter

HEALTHY, PENDING, DRAINING, REMOVED = PodState.HEALTHY, PodState.PENDING, PodState.DRAINING, PodState.REMOVED

A, B, C, D, E = (f"10.0.0.{i}:8000" for i in range(1, 6))


PROBE = ProbeConfig(healthy_after=1, unhealthy_after=3)


class Notes:
    """Records notify() calls: which waiter was woken, in which order, how often."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, name: str) -> Callable[[], None]:
        return lambda: self.calls.append(name)


def make(config: ServiceConfig, now: float = 0.0, **kw: Any) -> ServiceThrottler:
    t = ServiceThrottler(config, now, rng=random.Random(0), **kw)
    t.check_invariants()
    return t


def grant_of(result: Grant | Waiter) -> Grant:
    assert isinstance(result, Grant), f"expected a grant, got {result!r}"
    return result


def waiter_of(result: Grant | Waiter) -> Waiter:
    assert isinstance(result, Waiter), f"expected to wait, got a grant on {getattr(result, 'pod', None)}"
    return result


def nothing() -> None:
    pass


def state(t: ServiceThrottler, address: str) -> PodState | None:
    tracker = t.trackers.get(address)
    return tracker.state if tracker else None


# =============================================================================
# capacity
# =============================================================================


@pytest.mark.parametrize(
    ("cc", "healthy", "pending", "drained", "expected"),
    [
        (1, 3, 0, 0, 3),
        (2, 2, 1, 0, 4),
        (3, 0, 2, 0, 0),
        (5, 2, 0, 1, 10),
        (4, 0, 0, 0, 0),
        (0, 1, 0, 0, None),  # unlimited
        (0, 2, 1, 1, None),
        (0, 0, 2, 0, 0),  # cc 0 but nothing healthy: nothing to send to
        (0, 0, 0, 0, 0),
    ],
)
def test_capacity_is_cc_times_healthy_pods(cc: int, healthy: int, pending: int, drained: int, expected: int | None) -> None:
    addresses = [A, B, C, D, E][: healthy + pending + drained]
    pods = [pod(a) for a in addresses[: healthy + pending]] + [pod(a, drain=True) for a in addresses[healthy + pending :]]
    t = make(svc(*pods, cc=cc, probe=PROBE))
    for address in addresses[:healthy]:
        t.probe_result(address, True, 1.0)
    assert t.capacity == expected
    t.check_invariants()


def test_capacity_counts_only_owned_slots() -> None:
    t = make(svc(A, B, C, cc=3), owned={A: 1, B: 2})  # C owned by another activator
    assert t.capacity == 3
    assert t.trackers[C].slots == 0


def test_draining_pod_with_requests_in_flight_does_not_count() -> None:
    t = make(svc(A, B, cc=2))
    grant_of(t.acquire(0.0, nothing))
    assert t.capacity == 4
    t.apply(svc(B, cc=2), 1.0)
    assert state(t, A) is DRAINING
    assert t.capacity == 2


# =============================================================================
# queueing and FIFO hand-off
# =============================================================================


def test_queue_depth_overflow_raises_queue_full() -> None:
    t = make(svc(A, cc=1, queue_depth=2))
    grant_of(t.acquire(0.0, nothing))
    waiter_of(t.acquire(0.0, nothing))
    waiter_of(t.acquire(0.0, nothing))
    with pytest.raises(QueueFull):
        t.acquire(0.0, nothing)
    assert t.queued == 2
    t.check_invariants()


def test_queue_depth_zero_means_no_queueing() -> None:
    t = make(svc(A, cc=1, queue_depth=0))
    g = grant_of(t.acquire(0.0, nothing))
    with pytest.raises(QueueFull):
        t.acquire(0.0, nothing)
    assert t.queued == 0
    t.release(g, 1.0)
    grant_of(t.acquire(2.0, nothing))


def test_queue_full_with_no_pods_at_all() -> None:
    t = make(svc(cc=1, queue_depth=1))
    waiter_of(t.acquire(0.0, nothing))
    with pytest.raises(QueueFull):
        t.acquire(0.0, nothing)


def test_fifo_hand_off_in_arrival_order_and_no_barging() -> None:
    notes = Notes()
    t = make(svc(A, cc=1))
    first = grant_of(t.acquire(0.0, notes("first")))
    w1 = waiter_of(t.acquire(1.0, notes("w1")))
    w2 = waiter_of(t.acquire(2.0, notes("w2")))
    w3 = waiter_of(t.acquire(3.0, notes("w3")))
    assert t.queued == 3

    t.release(first, 4.0)  # the slot goes straight to w1
    assert notes.calls == ["w1"]
    assert w1.grant is not None and w1.grant.pod.address == A
    assert w2.grant is None and w3.grant is None
    t.check_invariants()

    # A newcomer while w2 and w3 wait is queued behind them: it never barges.
    newcomer = waiter_of(t.acquire(5.0, notes("newcomer")))
    t.check_invariants()

    # Each holder in turn wakes (abandon hands it its grant) and finishes; its slot
    # goes to the next in line.
    holder = w1
    for i, (nxt, name) in enumerate([(w2, "w2"), (w3, "w3"), (newcomer, "newcomer")]):
        held = t.abandon(holder)
        assert held is not None and held is holder.grant
        assert nxt.grant is None
        t.release(held, 6.0 + i)
        assert notes.calls[-1] == name and nxt.grant is not None
        t.check_invariants()
        holder = nxt

    assert notes.calls == ["w1", "w2", "w3", "newcomer"]
    t.release(newcomer.grant, 20.0)  # type: ignore[arg-type]
    assert t.in_flight == 0 and t.queued == 0
    t.check_invariants()


def test_notify_is_called_exactly_once_when_granted() -> None:
    notes = Notes()
    t = make(svc(A, cc=1))
    g = grant_of(t.acquire(0.0, notes("direct")))
    w = waiter_of(t.acquire(0.0, notes("w")))
    assert notes.calls == []  # not for a direct grant, not while waiting
    t.release(g, 1.0)
    assert notes.calls == ["w"]
    # Nothing that happens afterwards notifies it again.
    t.apply(svc(A, cc=3), 2.0)
    got = t.abandon(w)
    assert got is w.grant
    t.release(got, 3.0)  # type: ignore[arg-type]
    assert notes.calls == ["w"]


def test_abandon_removes_a_queued_waiter() -> None:
    notes = Notes()
    t = make(svc(A, cc=1))
    g = grant_of(t.acquire(0.0, nothing))
    w1 = waiter_of(t.acquire(0.0, notes("w1")))
    w2 = waiter_of(t.acquire(0.0, notes("w2")))
    assert t.abandon(w1) is None
    assert t.queued == 1
    assert t.abandon(w1) is None  # twice is harmless
    t.check_invariants()
    t.release(g, 1.0)
    assert notes.calls == ["w2"]  # w1 is gone, never woken
    assert w1.grant is None and w2.grant is not None


def test_abandon_returns_the_grant_if_it_was_already_granted() -> None:
    t = make(svc(A, cc=1))
    g = grant_of(t.acquire(0.0, nothing))
    w = waiter_of(t.acquire(0.0, nothing))
    t.release(g, 1.0)  # granted to w, before w woke up and gave up
    got = t.abandon(w)
    assert got is not None and got is w.grant and got.pod.address == A
    assert t.in_flight == 1
    t.release(got, 2.0)  # the caller gives it back
    assert t.in_flight == 0
    t.check_invariants()


def test_double_release_raises() -> None:
    t = make(svc(A, cc=1))
    g = grant_of(t.acquire(0.0, nothing))
    t.release(g, 1.0)
    with pytest.raises(InvariantViolation):
        t.release(g, 2.0)
    assert t.in_flight == 0 and t.trackers[A].in_flight == 0
    t.check_invariants()


# =============================================================================
# ported from Knative (breaker_test.go, throttler_test.go)
# =============================================================================


def test_knative_breaker_reserve_overload() -> None:
    # {QueueDepth 1, MaxConcurrency 1}: Reserve#1 ok, #2 fails; after release ok again.
    t = make(svc(A, cc=1, queue_depth=0))
    g = grant_of(t.acquire(0.0, nothing))
    with pytest.raises(QueueFull):
        t.acquire(0.0, nothing)
    t.release(g, 1.0)
    grant_of(t.acquire(1.0, nothing))


def test_knative_breaker_overload() -> None:
    # {1,1,1}: 1 running, 1 queued, the 3rd fails at once with queue full.
    t = make(svc(A, cc=1, queue_depth=1))
    grant_of(t.acquire(0.0, nothing))
    waiter_of(t.acquire(0.0, nothing))
    with pytest.raises(QueueFull):
        t.acquire(0.0, nothing)


def test_knative_breaker_queueing_capacity_zero_then_a_pod_turns_healthy() -> None:
    # Capacity 0 with 2 queued; the pod becomes healthy: both are served, in order.
    notes = Notes()
    t = make(svc(A, cc=1, probe=PROBE))
    assert t.capacity == 0 and state(t, A) is PENDING
    w1 = waiter_of(t.acquire(0.0, notes("w1")))
    w2 = waiter_of(t.acquire(0.0, notes("w2")))
    t.probe_result(A, True, 1.0)
    assert state(t, A) is HEALTHY
    assert notes.calls == ["w1"]  # its slot handed over at once
    t.check_invariants()
    t.release(t.abandon(w1), 2.0)  # type: ignore[arg-type]
    assert notes.calls == ["w1", "w2"]
    t.release(t.abandon(w2), 3.0)  # type: ignore[arg-type]
    assert t.in_flight == 0 and t.queued == 0
    t.check_invariants()


def test_knative_breaker_queueing_owned_slots_zero_then_one() -> None:
    # The same through the slot division: this activator owned nothing, now one slot.
    notes = Notes()
    t = make(svc(A, cc=1), owned={A: 0})
    assert t.capacity == 0
    waiter_of(t.acquire(0.0, notes("w1")))
    waiter_of(t.acquire(0.0, notes("w2")))
    t.apply(svc(A, cc=1), 1.0, owned={A: 1})
    assert notes.calls == ["w1"]
    t.check_invariants()


def test_knative_breaker_no_overload() -> None:
    # At capacity: process one, add one, repeatedly. Never a failure, never above capacity.
    t = make(svc(A, B, cc=2, queue_depth=1))
    grants = [grant_of(t.acquire(0.0, nothing)) for _ in range(4)]
    for i in range(100):
        t.release(grants.pop(0), float(i))
        grants.append(grant_of(t.acquire(float(i), nothing)))
        assert t.in_flight == 4
        assert all(tr.in_flight <= 2 for tr in t.trackers.values())
        t.check_invariants()


def test_knative_breaker_cancel() -> None:
    # A cancelled waiter frees its queue place; capacity stays consistently full.
    notes = Notes()
    t = make(svc(A, cc=1, queue_depth=1))
    g = grant_of(t.acquire(0.0, nothing))
    w = waiter_of(t.acquire(0.0, notes("cancelled")))
    assert t.abandon(w) is None
    assert t.queued == 0
    t.check_invariants()
    # Still full: a new request waits (and fits in the freed queue place).
    w2 = waiter_of(t.acquire(1.0, notes("w2")))
    t.release(g, 2.0)
    assert notes.calls == ["w2"]
    assert t.in_flight == 1
    t.release(t.abandon(w2), 3.0)  # type: ignore[arg-type]
    assert t.in_flight == 0


def test_knative_clumping_first_available_cc3() -> None:
    # "clumping test": cc=3, 5 pods, 3 requests -> all on the first pod.
    t = make(svc(A, B, C, D, E, cc=3))
    assert t.policy.name == "first-available"
    grants = [grant_of(t.acquire(0.0, nothing)) for _ in range(3)]
    assert {g.pod.address for g in grants} == {A}
    assert t.capacity == 15
    assert grant_of(t.acquire(0.0, nothing)).pod.address == B  # the 4th spills over


def test_knative_spread_cc1_two_pods() -> None:
    # "spread podIP load": cc=1, 2 pods, 2 requests -> both pods.
    t = make(svc(A, B, cc=1))
    grants = [grant_of(t.acquire(0.0, nothing)) for _ in range(2)]
    assert {g.pod.address for g in grants} == {A, B}
    waiter_of(t.acquire(0.0, nothing))


def test_knative_round_robin_cc5_three_pods() -> None:
    t = make(svc(A, B, C, cc=5))
    assert t.policy.name == "round-robin"
    grants = [grant_of(t.acquire(0.0, nothing)) for _ in range(3)]
    assert {g.pod.address for g in grants} == {A, B, C}


def test_knative_infinite_capacity_cc0() -> None:
    # cc=0: every pod used, no limit, least-in-flight spreads the load.
    t = make(svc(A, B, C, cc=0))
    assert t.policy.name == "least-in-flight"
    assert t.capacity is None
    grants = [grant_of(t.acquire(0.0, nothing)) for _ in range(30)]
    per_pod = Counter(g.pod.address for g in grants)
    assert set(per_pod) == {A, B, C}
    assert max(per_pod.values()) - min(per_pod.values()) <= 10
    t.check_invariants()


def test_knative_multiple_activators_own_one_slot() -> None:
    # 2 activators, 3 pods, cc=1: this one owns one slot; a second request waits.
    t = make(svc(A, B, C, cc=1), owned={A: 1, B: 0, C: 0})
    assert t.capacity == 1
    g = grant_of(t.acquire(0.0, nothing))
    assert g.pod.address == A
    waiter_of(t.acquire(0.0, nothing))


# =============================================================================
# pod lifecycle
# =============================================================================


def test_new_pods_start_pending_when_a_probe_is_configured() -> None:
    t = make(svc(A, B, probe=PROBE))
    assert state(t, A) is PENDING and state(t, B) is PENDING
    waiter_of(t.acquire(0.0, nothing))


def test_new_pods_are_healthy_at_once_without_probe() -> None:
    transitions: list[Transition] = []
    t = make(svc(A, B), on_transition=transitions.append)
    assert state(t, A) is HEALTHY and state(t, B) is HEALTHY
    assert [(tr.address, tr.old, tr.new, tr.event) for tr in transitions] == [
        (A, PENDING, HEALTHY, PodEvent.PROBE_PASSED),
        (B, PENDING, HEALTHY, PodEvent.PROBE_PASSED),
    ]


def test_new_pod_listed_with_drain_true_is_kept_as_removed() -> None:
    t = make(svc(pod(A, drain=True), B))
    assert state(t, A) is REMOVED
    assert grant_of(t.acquire(0.0, nothing)).pod.address == B


def test_drain_with_requests_in_flight() -> None:
    notes = Notes()
    t = make(svc(A, B, cc=2))
    g = grant_of(t.acquire(0.0, nothing))
    assert g.pod.address == A
    t.apply(svc(pod(A, drain=True), B, cc=2), 1.0)
    assert state(t, A) is DRAINING
    t.check_invariants()
    # No new grant to it, although it has a free slot.
    for _ in range(2):
        assert grant_of(t.acquire(2.0, nothing)).pod.address == B
    waiter_of(t.acquire(2.0, notes("w")))
    t.release(g, 3.0)
    assert state(t, A) is REMOVED  # still listed with drain: true: kept as removed
    assert notes.calls == []  # A's freed slot is not routable
    t.check_invariants()


def test_unlisted_pod_drains_then_its_tracker_disappears() -> None:
    t = make(svc(A, B, cc=1))
    ga = grant_of(t.acquire(0.0, nothing))
    gb = grant_of(t.acquire(0.0, nothing))
    t.apply(svc(B, cc=1), 1.0)
    assert state(t, A) is DRAINING and t.trackers[A].in_flight == 1
    t.check_invariants()
    t.release(ga, 2.0)
    assert A not in t.trackers
    t.check_invariants()
    t.release(gb, 3.0)
    assert set(t.trackers) == {B}


def test_unlisted_idle_pod_disappears_at_once() -> None:
    t = make(svc(A, B))
    t.apply(svc(B), 1.0)
    assert set(t.trackers) == {B}
    t.check_invariants()


def test_SEED_BUG_unlist_and_relist_busy_cc1_pod_keeps_its_count() -> None:
    """THE seed bug (Knative #15811): a busy pod unlisted and listed again must keep
    its in-flight count, and get no second request until the first is released."""
    notes = Notes()
    t = make(svc(A, cc=1))
    g = grant_of(t.acquire(0.0, nothing))

    t.apply(svc(cc=1), 1.0)  # unlisted: draining, one in flight
    assert state(t, A) is DRAINING and t.trackers[A].in_flight == 1
    tracker = t.trackers[A]

    t.apply(svc(A, cc=1), 2.0)  # listed again: same tracker, same count
    assert t.trackers[A] is tracker
    assert state(t, A) is HEALTHY and tracker.in_flight == 1
    t.check_invariants()

    w = waiter_of(t.acquire(3.0, notes("second")))  # NOT a second grant on A
    assert tracker.in_flight == 1
    t.release(g, 4.0)
    assert notes.calls == ["second"] and w.grant is not None and w.grant.pod is tracker
    assert tracker.in_flight == 1
    t.release(t.abandon(w), 5.0)  # type: ignore[arg-type]
    assert tracker.in_flight == 0 and t.in_flight == 0
    t.check_invariants()


def test_SEED_BUG_with_probe_relisted_busy_pod_proven_again_keeps_its_count() -> None:
    t = make(svc(A, cc=1, probe=PROBE))
    t.probe_result(A, True, 0.0)
    g = grant_of(t.acquire(0.0, nothing))
    t.apply(svc(cc=1, probe=PROBE), 1.0)
    t.apply(svc(A, cc=1, probe=PROBE), 2.0)
    assert state(t, A) is PENDING and t.trackers[A].in_flight == 1
    t.probe_result(A, True, 3.0)
    assert state(t, A) is HEALTHY
    waiter_of(t.acquire(4.0, nothing))
    assert t.trackers[A].in_flight == 1
    t.release(g, 5.0)
    assert t.trackers[A].in_flight == 1 and t.queued == 0
    t.check_invariants()


def test_SEED_BUG_drain_true_then_false_keeps_the_count() -> None:
    t = make(svc(A, cc=1))
    g = grant_of(t.acquire(0.0, nothing))
    t.apply(svc(pod(A, drain=True), cc=1), 1.0)
    assert state(t, A) is DRAINING
    t.apply(svc(pod(A, drain=False), cc=1), 2.0)
    assert state(t, A) is HEALTHY and t.trackers[A].in_flight == 1
    w = waiter_of(t.acquire(3.0, nothing))
    t.release(g, 4.0)
    assert w.grant is not None and t.trackers[A].in_flight == 1
    t.check_invariants()


def test_SEED_BUG_relisted_after_removed_by_drain_timeout() -> None:
    t = make(svc(A, cc=1, drain_timeout=10.0))
    g = grant_of(t.acquire(0.0, nothing))
    t.apply(svc(cc=1, drain_timeout=10.0), 1.0)
    t.tick(20.0)
    assert state(t, A) is REMOVED and t.trackers[A].in_flight == 1
    t.apply(svc(A, cc=1, drain_timeout=10.0), 21.0)
    assert state(t, A) is HEALTHY and t.trackers[A].in_flight == 1
    waiter_of(t.acquire(22.0, nothing))
    t.release(g, 23.0)
    assert t.trackers[A].in_flight == 1
    t.check_invariants()


def test_cc0_pods_drain_with_reference_counting_too() -> None:
    # Knative's PR leaked here: cc=0 pods were removed at once with requests running.
    t = make(svc(A, cc=0))
    grants = [grant_of(t.acquire(0.0, nothing)) for _ in range(3)]
    assert t.trackers[A].in_flight == 3
    t.apply(svc(cc=0), 1.0)
    assert state(t, A) is DRAINING
    waiter_of(t.acquire(1.0, nothing))  # nothing routable
    for i, g in enumerate(grants[:2]):
        t.release(g, 2.0 + i)
        assert state(t, A) is DRAINING
        t.check_invariants()
    t.release(grants[2], 5.0)
    assert A not in t.trackers
    t.check_invariants()


def test_cc0_relisted_busy_pod_keeps_its_count() -> None:
    t = make(svc(A, cc=0))
    g = grant_of(t.acquire(0.0, nothing))
    t.apply(svc(cc=0), 1.0)
    t.apply(svc(A, cc=0), 2.0)
    assert t.trackers[A].in_flight == 1
    g2 = grant_of(t.acquire(3.0, nothing))
    assert t.trackers[A].in_flight == 2
    t.release(g, 4.0)
    t.release(g2, 5.0)
    assert t.trackers[A].in_flight == 0
    t.check_invariants()


def test_drain_timeout_forces_removed_while_in_flight() -> None:
    transitions: list[Transition] = []
    t = make(svc(A, B, cc=1, drain_timeout=10.0), on_transition=transitions.append)
    g = grant_of(t.acquire(0.0, nothing))
    t.apply(svc(B, cc=1, drain_timeout=10.0), 5.0)
    assert state(t, A) is DRAINING
    t.tick(14.9)
    assert state(t, A) is DRAINING
    t.tick(15.0)
    assert state(t, A) is REMOVED and t.trackers[A].in_flight == 1
    assert transitions[-1].event is PodEvent.DRAIN_TIMEOUT
    t.check_invariants()
    t.release(g, 16.0)
    assert A not in t.trackers  # unlisted: gone once released
    t.check_invariants()


def test_drain_timeout_on_a_listed_drain_true_pod_keeps_it_as_removed() -> None:
    t = make(svc(A, B, cc=1, drain_timeout=10.0))
    g = grant_of(t.acquire(0.0, nothing))
    t.apply(svc(pod(A, drain=True), B, cc=1, drain_timeout=10.0), 0.0)
    t.tick(10.0)
    assert state(t, A) is REMOVED
    t.release(g, 11.0)
    assert state(t, A) is REMOVED and t.trackers[A].in_flight == 0
    t.check_invariants()


def test_probe_result_counts_consecutive_passes_and_failures() -> None:
    probe = ProbeConfig(healthy_after=2, unhealthy_after=3)
    t = make(svc(A, probe=probe))
    seq: list[tuple[bool, PodState]] = [
        (True, PENDING),
        (False, PENDING),  # breaks the run of passes
        (True, PENDING),
        (True, HEALTHY),  # 2 in a row
        (False, HEALTHY),
        (False, HEALTHY),
        (True, HEALTHY),  # breaks the run of failures
        (False, HEALTHY),
        (False, HEALTHY),
        (False, PENDING),  # 3 in a row
        (True, PENDING),
        (True, HEALTHY),
    ]
    for i, (ok, expected) in enumerate(seq):
        t.probe_result(A, ok, float(i))
        assert state(t, A) is expected, f"step {i}"
        t.check_invariants()


def test_probe_failure_leaves_in_flight_requests_to_finish() -> None:
    t = make(svc(A, B, cc=1, probe=ProbeConfig(healthy_after=1, unhealthy_after=1)))
    t.probe_result(A, True, 0.0)
    t.probe_result(B, True, 0.0)
    g = grant_of(t.acquire(0.0, nothing))
    t.probe_result(g.pod.address, False, 1.0)
    assert g.pod.state is PENDING and g.pod.in_flight == 1
    other = grant_of(t.acquire(2.0, nothing))
    assert other.pod is not g.pod
    t.release(g, 3.0)
    assert g.pod.state is PENDING and g.pod.in_flight == 0
    t.check_invariants()


def test_probe_results_are_ignored_for_unknown_and_unwanted_pods() -> None:
    t = make(svc(A, pod(B, drain=True), probe=PROBE))
    t.probe_result(C, True, 0.0)
    t.probe_result(B, True, 0.0)
    assert C not in t.trackers and state(t, B) is REMOVED
    t2 = make(svc(A))  # no probe configured: results ignored
    t2.probe_result(A, False, 0.0)
    t2.probe_result(A, False, 0.0)
    t2.probe_result(A, False, 0.0)
    assert state(t2, A) is HEALTHY


def test_passive_ejection_after_unhealthy_after_connect_errors() -> None:
    t = make(svc(A, B, cc=2, probe=ProbeConfig(healthy_after=1, unhealthy_after=2)))
    t.probe_result(A, True, 0.0)
    t.probe_result(B, True, 0.0)
    g1 = grant_of(t.acquire(0.0, nothing))
    g2 = grant_of(t.acquire(0.0, nothing))
    assert g1.pod is g2.pod and g1.pod.address == A
    t.record_failure(g1, "connect_errors", 1.0)
    assert state(t, A) is HEALTHY and t.trackers[A].failures == 1
    t.record_failure(g2, "timeouts", 2.0)
    assert state(t, A) is PENDING
    assert t.trackers[A].failure_counts == {("connect_errors", "healthy"): 1, ("timeouts", "healthy"): 1}
    t.check_invariants()
    assert grant_of(t.acquire(3.0, nothing)).pod.address == B
    t.release(g1, 4.0)
    t.release(g2, 4.0)
    t.probe_result(A, True, 5.0)  # probes bring it back
    assert state(t, A) is HEALTHY and t.trackers[A].failures == 0


def test_resets_do_not_count_toward_ejection() -> None:
    t = make(svc(A, cc=1, probe=ProbeConfig(healthy_after=1, unhealthy_after=1)))
    t.probe_result(A, True, 0.0)
    g = grant_of(t.acquire(0.0, nothing))
    for i in range(5):
        t.record_failure(g, "resets", float(i))
    assert state(t, A) is HEALTHY and t.trackers[A].failures == 0
    assert t.trackers[A].failure_counts == {("resets", "healthy"): 5}


def test_no_passive_ejection_without_probe() -> None:
    # Nothing would bring it back: the pod stays healthy however many failures.
    t = make(svc(A, cc=1))
    g = grant_of(t.acquire(0.0, nothing))
    for i in range(10):
        t.record_failure(g, "connect_errors", float(i))
    assert state(t, A) is HEALTHY and t.trackers[A].failures == 10
    t.check_invariants()


def test_record_success_resets_the_failure_run() -> None:
    t = make(svc(A, cc=1, probe=ProbeConfig(healthy_after=1, unhealthy_after=2)))
    t.probe_result(A, True, 0.0)
    g = grant_of(t.acquire(0.0, nothing))
    t.record_failure(g, "connect_errors", 1.0)
    t.record_success(g)
    assert t.trackers[A].failures == 0
    t.record_failure(g, "connect_errors", 2.0)
    assert state(t, A) is HEALTHY
    t.record_failure(g, "connect_errors", 3.0)
    assert state(t, A) is PENDING


def test_failure_on_a_draining_pod_is_counted_but_changes_nothing() -> None:
    t = make(svc(A, cc=1, probe=ProbeConfig(healthy_after=1, unhealthy_after=1)))
    t.probe_result(A, True, 0.0)
    g = grant_of(t.acquire(0.0, nothing))
    t.apply(svc(cc=1, probe=ProbeConfig(healthy_after=1, unhealthy_after=1)), 1.0)
    t.record_failure(g, "connect_errors", 2.0)
    assert state(t, A) is DRAINING
    assert t.trackers[A].failure_counts == {("connect_errors", "unhealthy"): 1}
    t.release(g, 3.0)
    assert A not in t.trackers


def test_removing_the_probe_admits_pending_pods() -> None:
    notes = Notes()
    t = make(svc(A, probe=PROBE))
    waiter_of(t.acquire(0.0, notes("w")))
    t.apply(svc(A), 1.0)
    assert state(t, A) is HEALTHY
    assert notes.calls == ["w"]
    t.check_invariants()


# =============================================================================
# limits changed on the fly
# =============================================================================


def test_lowering_cc_below_in_flight_stops_grants_until_below_the_new_limit() -> None:
    notes = Notes()
    t = make(svc(A, cc=3))
    grants = [grant_of(t.acquire(0.0, nothing)) for _ in range(3)]
    t.apply(svc(A, cc=1), 1.0)
    assert t.capacity == 1 and t.trackers[A].in_flight == 3
    t.check_invariants()
    w = waiter_of(t.acquire(1.0, notes("w")))
    t.release(grants[0], 2.0)
    assert notes.calls == []  # 2 in flight, limit 1
    t.release(grants[1], 3.0)
    assert notes.calls == []  # 1 in flight, limit 1
    t.release(grants[2], 4.0)
    assert notes.calls == ["w"] and t.trackers[A].in_flight == 1
    t.check_invariants()
    t.release(t.abandon(w), 5.0)  # type: ignore[arg-type]


def test_raising_cc_hands_slots_to_waiters_at_once_in_order() -> None:
    notes = Notes()
    t = make(svc(A, cc=1))
    grant_of(t.acquire(0.0, nothing))
    waiters = [waiter_of(t.acquire(float(i), notes(f"w{i}"))) for i in range(4)]
    t.apply(svc(A, cc=3), 5.0)
    assert notes.calls == ["w0", "w1"]
    assert [w.grant is not None for w in waiters] == [True, True, False, False]
    assert t.trackers[A].in_flight == 3 and t.queued == 2
    t.check_invariants()


def test_cc_change_switches_the_auto_policy() -> None:
    t = make(svc(A, B, cc=1))
    assert t.policy.name == "first-available"
    g = grant_of(t.acquire(0.0, nothing))
    t.apply(svc(A, B, cc=5), 1.0)
    assert t.policy.name == "round-robin"
    t.check_invariants()
    t.apply(svc(A, B, cc=0), 2.0)
    assert t.policy.name == "least-in-flight"
    t.check_invariants()
    t.release(g, 3.0)
    t.check_invariants()


def test_queue_depth_lowered_keeps_the_waiters_but_admits_no_more() -> None:
    t = make(svc(A, cc=1, queue_depth=5))
    grant_of(t.acquire(0.0, nothing))
    for _ in range(3):
        waiter_of(t.acquire(0.0, nothing))
    t.apply(svc(A, cc=1, queue_depth=1), 1.0)
    assert t.queued == 3
    with pytest.raises(QueueFull):
        t.acquire(2.0, nothing)


def test_reordered_pods_stay_routable_first_available() -> None:
    # The pod above it was removed from the file: its rank changed from 1 to 0.
    # (A stale heap entry once hid it: requests queued with a free pod.)
    t = make(svc(B, A, cc=2))
    t.apply(svc(A, cc=2), 1.0)
    g = grant_of(t.acquire(2.0, nothing))
    assert g.pod.address == A
    t.apply(svc(C, A, cc=2), 3.0)
    assert grant_of(t.acquire(4.0, nothing)).pod.address == C
    t.apply(svc(A, C, cc=2), 5.0)  # swapped
    assert grant_of(t.acquire(6.0, nothing)).pod.address == A
    t.check_invariants()


# =============================================================================
# retry after a connect failure
# =============================================================================


def test_acquire_retry_prefers_another_pod() -> None:
    t = make(svc(A, B, cc=2))
    failed = grant_of(t.acquire(0.0, nothing))
    assert failed.pod.address == A  # A still has a free slot
    retry = grant_of(t.acquire_retry(failed, 1.0, nothing))
    assert retry.pod.address == B
    t.release(failed, 1.0)
    t.check_invariants()
    assert t.trackers[A].in_flight == 0 and t.trackers[B].in_flight == 1


def test_acquire_retry_waits_at_the_head_of_the_queue() -> None:
    notes = Notes()
    t = make(svc(A, B, cc=1))
    failed = grant_of(t.acquire(0.0, nothing))
    other = grant_of(t.acquire(0.0, nothing))
    waiter_of(t.acquire(1.0, notes("older")))
    retry = waiter_of(t.acquire_retry(failed, 2.0, notes("retry")))
    assert notes.calls == []
    t.release(failed, 2.0)  # the gate releases the failed grant right after
    assert notes.calls == ["retry"]  # ahead of the older waiter: it already waited its turn
    assert retry.grant is not None
    t.release(other, 3.0)
    assert notes.calls == ["retry", "older"]
    t.check_invariants()


def test_acquire_retry_on_the_only_pod_with_a_free_slot() -> None:
    notes = Notes()
    t = make(svc(A, cc=2))
    failed = grant_of(t.acquire(0.0, nothing))
    retry = waiter_of(t.acquire_retry(failed, 1.0, notes("retry")))
    assert notes.calls == ["retry"]  # no other pod: the same pod's free slot, at once
    assert retry.grant is not None and retry.grant.pod.address == A
    assert t.trackers[A].in_flight == 2
    t.release(failed, 1.0)
    t.release(t.abandon(retry), 2.0)  # type: ignore[arg-type]
    assert t.in_flight == 0
    t.check_invariants()


def test_acquire_retry_ignores_queue_depth() -> None:
    t = make(svc(A, cc=1, queue_depth=0))
    failed = grant_of(t.acquire(0.0, nothing))
    retry = waiter_of(t.acquire_retry(failed, 1.0, nothing))
    t.release(failed, 1.0)
    assert retry.grant is not None


# =============================================================================
# slots owned by this activator
# =============================================================================


def test_owned_slots_limit_grants_per_pod() -> None:
    t = make(svc(A, B, C, cc=3), owned={A: 1, B: 2, C: 0})
    grants = [grant_of(t.acquire(0.0, nothing)) for _ in range(3)]
    assert Counter(g.pod.address for g in grants) == {A: 1, B: 2}
    waiter_of(t.acquire(0.0, nothing))
    t.check_invariants()
    # The division changes (a peer left): C's slots are ours now, the waiter gets one.
    t.apply(svc(A, B, C, cc=3), 1.0, owned={A: 1, B: 2, C: 3})
    assert t.queued == 0 and t.trackers[C].in_flight == 1
    t.check_invariants()


def test_owned_mapping_missing_a_pod_means_zero_slots() -> None:
    t = make(svc(A, B, cc=2), owned={A: 2})
    assert t.trackers[B].slots == 0 and t.capacity == 2


def test_cc0_ignores_owned() -> None:
    t = make(svc(A, B, cc=0), owned={A: 0, B: 0})
    assert t.capacity is None
    grant_of(t.acquire(0.0, nothing))


# =============================================================================
# snapshot
# =============================================================================


def test_snapshot_shape() -> None:
    t = make(svc(A, B, cc=1))
    grant_of(t.acquire(0.0, nothing))
    snap = t.snapshot(1.0)
    assert snap["container_concurrency"] == 1 and snap["capacity"] == 2
    assert snap["in_flight"] == 1 and snap["queued"] == 0
    assert [p["address"] for p in snap["pods"]] == [A, B]
    first = snap["pods"][0]
    assert {k: first[k] for k in ("state", "in_flight", "slots", "failures")} == {
        "state": "healthy", "in_flight": 1, "slots": 1, "failures": 0,
    }


# =============================================================================
# random operation sequences
# =============================================================================

UNIVERSE = [f"10.9.0.{i}:80" for i in range(1, 5)]
PROBES = [None, ProbeConfig(healthy_after=1, unhealthy_after=1), ProbeConfig(healthy_after=2, unhealthy_after=2)]
POLICIES = ["auto", "first-available", "round-robin", "least-in-flight"]
DRAIN_TIMEOUT = 10.0


class Token:
    """One request, as the model sees it."""

    def __init__(self, machine: "ThrottlerMachine") -> None:
        self.machine = machine
        self.notified = 0
        self.waiter: Waiter | None = None
        self.granted_on: str | None = None  # the pod the model saw it granted on

    def notify(self) -> None:
        self.notified += 1
        assert self.notified == 1, "notify called twice"
        self.machine.on_notify(self)


@st.composite
def service_configs(draw: st.DrawFn) -> tuple[ServiceConfig, dict[str, int] | None]:
    addresses = draw(st.lists(st.sampled_from(UNIVERSE), unique=True, max_size=4))
    pods = tuple(pod(a, drain=draw(st.sampled_from([False, False, True]))) for a in addresses)
    cc = draw(st.integers(0, 3))
    config = ServiceConfig(
        name="api",
        hosts=("api",),
        container_concurrency=cc,
        queue_depth=draw(st.integers(0, 3)),
        lb_policy=draw(st.sampled_from(POLICIES)),
        drain_timeout=DRAIN_TIMEOUT,
        probe=draw(st.sampled_from(PROBES)),
        pods=pods,
    )
    owned = None
    if draw(st.booleans()):
        owned = {a: draw(st.integers(0, cc)) for a in draw(st.lists(st.sampled_from(UNIVERSE), unique=True))}
    return config, owned


class ThrottlerMachine(RuleBasedStateMachine):
    """Random operations on one throttler, checked against a small model after each.

    The model keeps its own per-pod count of outstanding grants, the expected queue
    order (arrivals at the back, retries at the front) and, at each grant, checks the
    pod was healthy, wanted and had a free slot of ours *at that moment*.
    """

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.t: ServiceThrottler | None = None
        self.config: ServiceConfig | None = None
        self.owned: dict[str, int] | None = None
        self.outstanding: list[Grant] = []  # grants the "requests" hold
        self.model_queue: list[Token] = []  # expected queue order
        self.granted: list[Token] = []  # woken, not yet collected
        self.all_tokens: list[Token] = []
        self.count: Counter[str] = Counter()  # model in-flight per pod
        self.woken: list[Token] = []  # notified during the current core call
        self.seen: dict[str, int] = {}  # trackers' in_flight as last seen

    # -- model hooks ---------------------------------------------------------------

    def look(self) -> dict[str, int]:
        assert self.t is not None
        return {a: tr.in_flight for a, tr in self.t.trackers.items()}

    def before_call(self, releasing: Grant | None = None) -> None:
        self.seen = self.look()
        if releasing is not None:
            self.seen[releasing.pod.address] -= 1

    def on_notify(self, token: Token) -> None:
        """Inside the core, right after one grant: find it, judge it then and there."""
        assert self.t is not None
        now_seen = self.look()
        grew = {a: n - self.seen.get(a, 0) for a, n in now_seen.items() if n != self.seen.get(a, 0)}
        assert len(grew) == 1 and list(grew.values()) == [1], f"one grant expected, saw {grew}"
        (address,) = grew
        tracker = self.t.trackers[address]
        assert tracker.state is HEALTHY, f"granted on a {tracker.state.value} pod"
        assert tracker.wanted, "granted on an unwanted pod"
        if tracker.slots is not None:
            assert now_seen[address] - 1 < tracker.slots, (
                f"{address}: granted with {now_seen[address] - 1} in flight and {tracker.slots} slots"
            )
        token.granted_on = address
        self.seen = now_seen
        self.woken.append(token)

    def check_direct_grant(self, grant: Grant) -> None:
        """A grant returned by acquire/acquire_retry (the only grant of that call)."""
        assert self.t is not None
        tracker = grant.pod
        assert self.t.trackers.get(tracker.address) is tracker
        assert tracker.state is HEALTHY and tracker.wanted
        before = self.count[tracker.address]
        if tracker.slots is not None:
            assert before < tracker.slots, f"{tracker.address}: granted with {before} in flight, {tracker.slots} slots"
        self.count[tracker.address] += 1
        assert tracker.in_flight == self.count[tracker.address]

    def settle(self) -> None:
        """After a core call: the woken waiters were the oldest, in order."""
        woken, self.woken = self.woken, []
        if not woken:
            return
        assert woken == self.model_queue[: len(woken)], "hand-off out of FIFO order"
        del self.model_queue[: len(woken)]
        for token in woken:
            assert token.waiter is not None and token.waiter.grant is not None
            assert token.waiter.grant.pod.address == token.granted_on
            self.count[token.granted_on] += 1
            self.granted.append(token)

    def advance(self, dt: float) -> float:
        self.now += dt
        return self.now

    def pop_outstanding(self, data: st.DataObject) -> Grant:
        return self.outstanding.pop(data.draw(st.integers(0, len(self.outstanding) - 1)))

    def do_release(self, grant: Grant) -> None:
        assert self.t is not None
        self.before_call(releasing=grant)
        self.count[grant.pod.address] -= 1
        self.t.release(grant, self.now)
        self.settle()

    def do_abandon(self, token: Token) -> None:
        assert self.t is not None and token.waiter is not None
        self.before_call()
        got = self.t.abandon(token.waiter)
        if token in self.granted:
            assert got is not None and got is token.waiter.grant
            self.granted.remove(token)
            self.outstanding.append(got)  # the request goes on with it (released later)
        else:
            assert got is None
            self.model_queue.remove(token)
        self.settle()

    # -- rules ---------------------------------------------------------------------

    @initialize(conf=service_configs())
    def start(self, conf: tuple[ServiceConfig, dict[str, int] | None]) -> None:
        self.config, self.owned = conf
        self.t = ServiceThrottler(self.config, self.now, owned=self.owned, rng=random.Random(0))

    @rule(dt=st.sampled_from([0.0, 0.5, 3.0]))
    def acquire(self, dt: float) -> None:
        assert self.t is not None and self.config is not None
        token = Token(self)
        self.all_tokens.append(token)
        queued_before = self.t.queued
        self.before_call()
        try:
            result = self.t.acquire(self.advance(dt), token.notify)
        except QueueFull:
            assert queued_before >= self.config.queue_depth
            assert self.t.queued == queued_before
            return
        if isinstance(result, Grant):
            assert queued_before == 0, "a newcomer barged past waiters"
            self.check_direct_grant(result)
            self.outstanding.append(result)
        else:
            token.waiter = result
            self.model_queue.append(token)
        self.settle()

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self.do_release(self.pop_outstanding(data))

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def release_twice_raises(self, data: st.DataObject) -> None:
        assert self.t is not None
        grant = self.pop_outstanding(data)
        self.do_release(grant)
        with pytest.raises(InvariantViolation):
            self.t.release(grant, self.now)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        """A connect failure: acquire_retry, then release the failed grant (as the gate does)."""
        assert self.t is not None
        failed = self.pop_outstanding(data)
        token = Token(self)
        self.all_tokens.append(token)
        others_free = [tr for tr in self.t.trackers.values() if tr is not failed.pod and tr.can_take()]
        self.model_queue.insert(0, token)  # if it waits, it is at the head: it waited its turn already
        self.before_call()
        result = self.t.acquire_retry(failed, self.now, token.notify)
        if isinstance(result, Grant):
            self.model_queue.remove(token)
            assert others_free, "a grant although no other pod was free"
            assert result.pod is not failed.pod, "retried on the failed pod while another was free"
            self.check_direct_grant(result)
            self.outstanding.append(result)
        else:
            assert not others_free
            token.waiter = result
        self.settle()
        self.do_release(failed)

    @precondition(lambda self: self.model_queue or self.granted)
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        """A waiter gives up or wakes up: abandon() returns its grant if it has one."""
        pool = self.model_queue + self.granted
        self.do_abandon(pool[data.draw(st.integers(0, len(pool) - 1))])

    @rule(conf=service_configs(), dt=st.sampled_from([0.0, 1.0, 5.0]))
    def apply(self, conf: tuple[ServiceConfig, dict[str, int] | None], dt: float) -> None:
        assert self.t is not None
        self.config, self.owned = conf
        self.before_call()
        self.t.apply(self.config, self.advance(dt), self.owned)
        self.settle()
        cc = self.config.container_concurrency
        for address, tracker in self.t.trackers.items():
            expected = None if cc == 0 else cc if self.owned is None else self.owned.get(address, 0)
            assert tracker.slots == expected
        for p in self.config.pods:
            tracker = self.t.trackers[p.address]
            if p.drain:
                assert tracker.state in (DRAINING, REMOVED)
            elif self.config.probe is None:
                assert tracker.state is HEALTHY

    @precondition(lambda self: self.config is not None)
    @rule(
        kind=st.sampled_from(["remove", "add-front", "toggle-drain", "swap", "cc-up", "cc-down"]),
        data=st.data(),
    )
    def edit(self, kind: str, data: st.DataObject) -> None:
        """One small edit of the file, as an operator makes them (keeps the owned map)."""
        assert self.t is not None and self.config is not None
        pods = list(self.config.pods)
        cc = self.config.container_concurrency
        absent = [a for a in UNIVERSE if a not in {p.address for p in pods}]
        if kind == "remove" and pods:
            del pods[data.draw(st.integers(0, len(pods) - 1))]
        elif kind == "add-front" and absent:
            pods.insert(0, pod(data.draw(st.sampled_from(absent))))
        elif kind == "toggle-drain" and pods:
            i = data.draw(st.integers(0, len(pods) - 1))
            pods[i] = pod(pods[i].address, drain=not pods[i].drain)
        elif kind == "swap" and len(pods) >= 2:
            i, j = data.draw(st.lists(st.integers(0, len(pods) - 1), min_size=2, max_size=2, unique=True))
            pods[i], pods[j] = pods[j], pods[i]
        elif kind == "cc-up":
            cc = min(cc + 1, 3)
        elif kind == "cc-down":
            cc = max(cc - 1, 0)
        owned = self.owned
        if owned is not None:
            owned = {a: min(n, cc) for a, n in owned.items()}
        self.apply((replace(self.config, pods=tuple(pods), container_concurrency=cc), owned), 0.0)

    @rule(address=st.sampled_from(UNIVERSE), ok=st.booleans())
    def probe(self, address: str, ok: bool) -> None:
        assert self.t is not None
        self.before_call()
        self.t.probe_result(address, ok, self.now)
        self.settle()

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data(), kind=st.sampled_from(["connect_errors", "timeouts", "resets"]))
    def record_failure(self, data: st.DataObject, kind: str) -> None:
        assert self.t is not None
        grant = self.outstanding[data.draw(st.integers(0, len(self.outstanding) - 1))]
        self.before_call()
        self.t.record_failure(grant, kind, self.now)
        self.settle()

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def record_success(self, data: st.DataObject) -> None:
        assert self.t is not None
        grant = self.outstanding[data.draw(st.integers(0, len(self.outstanding) - 1))]
        self.t.record_success(grant)
        assert grant.pod.failures == 0

    @rule(dt=st.sampled_from([1.0, 4.0, 11.0]))
    def tick(self, dt: float) -> None:
        assert self.t is not None
        self.before_call()
        self.t.tick(self.advance(dt))
        self.settle()
        for tracker in self.t.trackers.values():
            assert tracker.state is not DRAINING or self.now - tracker.since < DRAIN_TIMEOUT

    # -- after every step ----------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if self.t is None or self.config is None:
            return
        t = self.t
        t.check_invariants()
        assert not self.woken
        assert t.queued == len(self.model_queue)
        assert t.in_flight == sum(self.count.values())
        listed = {p.address for p in self.config.pods}
        for address in UNIVERSE:
            tracker = t.trackers.get(address)
            if tracker is None:
                # A tracker is only forgotten when nothing runs on it (the seed bug).
                assert self.count[address] == 0, f"{address} forgotten with {self.count[address]} in flight"
                assert address not in listed
            else:
                assert tracker.in_flight == self.count[address]
                assert tracker.listed == (address in listed)
        assert all(token.notified == 0 for token in self.model_queue)
        assert all(token.notified == 1 for token in self.granted)
        healthy = [tr for tr in t.trackers.values() if tr.state is HEALTHY]
        if self.config.container_concurrency == 0:
            assert t.capacity == (None if healthy else 0)
        else:
            assert t.capacity == sum(tr.slots or 0 for tr in healthy)

    def teardown(self) -> None:
        t = self.t
        if t is None:
            return
        # Release everything, abandon every waiter: every count back to zero.
        while self.outstanding or self.model_queue or self.granted:
            if self.outstanding:
                self.do_release(self.outstanding.pop())
            else:
                self.do_abandon((self.model_queue + self.granted)[0])
            t.check_invariants()
        assert t.in_flight == 0
        assert t.queued == 0
        assert all(tracker.in_flight == 0 for tracker in t.trackers.values())
        assert all(tracker.state is not DRAINING for tracker in t.trackers.values())
        assert all(tracker.listed for tracker in t.trackers.values())  # unlisted idle ones are gone
        for token in self.all_tokens:
            if token.waiter is not None:
                assert token.notified == (1 if token.waiter.grant is not None else 0)
            else:
                assert token.notified == 0  # granted directly, never woken


ThrottlerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_random_operation_sequences = ThrottlerMachine.TestCase

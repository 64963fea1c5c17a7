"""The per-service throttler: deterministic tables, then random operation sequences.

No sockets, no sleeps: configs are built directly and time is an explicit float.
Every call that can change more than its own request returns ``Effects`` (the waiters
it handed a slot to, or redirected, and the pod state changes): the shell acts on those
and on nothing else, so the tests assert them exactly (``builders.expect``).
``check_invariants()`` is called after every step that changes something; it also fails
when a call left effects behind in the throttler's outbox.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import pytest
from builders import Move, expect, pod, svc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from activator.core.config import ProbeConfig, ServiceConfig
from activator.core.errors import QueueFull
from activator.core.failures import FailureKind
from activator.core.probes import Verdict
from activator.core.states import PodEvent, PodState, next_state
from activator.core.throttler import (
    NO_EFFECTS,
    Effects,
    EffectsCollector,
    Grant,
    InvariantViolation,
    ServiceThrottler,
    Waiter,
)

HEALTHY, PENDING, DRAINING, REMOVED = PodState.HEALTHY, PodState.PENDING, PodState.DRAINING, PodState.REMOVED
E = PodEvent
PASS, FAIL, INCONCLUSIVE = Verdict.PASS, Verdict.FAIL, Verdict.INCONCLUSIVE
CONNECT, TIMEOUT, RESET = FailureKind.CONNECT, FailureKind.TIMEOUT, FailureKind.RESET

A, B, C, D, F = (f"10.0.0.{i}:8000" for i in range(1, 6))


PROBE = ProbeConfig(healthy_after=1, unhealthy_after=3)


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


def collect(t: ServiceThrottler, waiter: Waiter) -> Grant:
    """A woken waiter takes its grant (``abandon`` hands it over, as the gate does)."""
    grant = t.abandon(waiter)
    assert grant is not None and grant is waiter.grant, "the waiter was not handed a slot"
    return grant


def state(t: ServiceThrottler, address: str) -> PodState | None:
    tracker = t.trackers.get(address)
    return tracker.state if tracker else None


def admitted(address: str) -> Move:
    """A pending pod made healthy: its probe passed (at once with ``probe: null``)."""
    return (address, PENDING, HEALTHY, E.PROBE_PASSED)


def healthy_with_probe(config: ServiceConfig) -> ServiceThrottler:
    """A throttler whose pods all passed their first probe (``healthy_after`` 1)."""
    t = make(config)
    for p in config.pods:
        expect(t.probe_result(p.address, PASS, 0.0), changes=[admitted(p.address)])
    return t


# =============================================================================
# effects
# =============================================================================


def test_effects_are_falsy_when_empty_and_gather_in_order() -> None:
    t = make(svc(A, B, cc=1))
    assert not NO_EFFECTS and not Effects()
    first, second = list(t.initial_effects.transitions)
    one, two = Effects(transitions=[first]), Effects(transitions=[second])
    assert one and two
    gathered = EffectsCollector()
    assert gathered.result() is NO_EFFECTS
    for effects in (one, NO_EFFECTS, two):
        gathered.add(effects)
    assert gathered.result().transitions == [first, second]


def test_a_call_that_changes_nothing_returns_no_effects() -> None:
    t = make(svc(A, cc=2))
    g = grant_of(t.acquire(0.0))
    assert t.release(g, 1.0) is NO_EFFECTS
    assert t.apply(svc(A, cc=2), 2.0) is NO_EFFECTS
    assert t.tick(3.0) is NO_EFFECTS
    assert t.redirect_waiters() is NO_EFFECTS
    assert t.probe_result(A, PASS, 4.0) is NO_EFFECTS  # no probe configured
    assert t.record_failure(A, CONNECT, 5.0) is NO_EFFECTS  # counted, but no ejection without a probe
    t.check_invariants()


def test_construction_effects_are_the_pods_turning_healthy() -> None:
    t = make(svc(A, B))
    assert state(t, A) is HEALTHY and state(t, B) is HEALTHY
    expect(t.initial_effects, changes=[admitted(A), admitted(B)])
    assert [tr.reason for tr in t.initial_effects.transitions] == ["listed (no probe configured)"] * 2


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
def test_capacity_is_cc_times_healthy_pods(
    cc: int, healthy: int, pending: int, drained: int, expected: int | None
) -> None:
    addresses = [A, B, C, D, F][: healthy + pending + drained]
    pods = [pod(a) for a in addresses[: healthy + pending]] + [
        pod(a, drain=True) for a in addresses[healthy + pending :]
    ]
    t = make(svc(*pods, cc=cc, probe=PROBE))
    # A pod listed with drain: true is drained at once; nothing runs on it: removed.
    drained_at_once = [
        change
        for a in addresses[healthy + pending :]
        for change in ((a, PENDING, DRAINING, E.DRAIN_SET), (a, DRAINING, REMOVED, E.LAST_RELEASED))
    ]
    expect(t.initial_effects, changes=drained_at_once)
    for address in addresses[:healthy]:
        expect(t.probe_result(address, PASS, 1.0), changes=[admitted(address)])
    assert t.capacity == expected
    t.check_invariants()


def test_capacity_counts_only_owned_slots() -> None:
    t = make(svc(A, B, C, cc=3), owned={A: 1, B: 2})  # C owned by another activator
    assert t.capacity == 3
    assert t.trackers[C].slots == 0


def test_draining_pod_with_requests_in_flight_does_not_count() -> None:
    t = make(svc(A, B, cc=2))
    grant_of(t.acquire(0.0))
    assert t.capacity == 4
    expect(t.apply(svc(B, cc=2), 1.0), changes=[(A, HEALTHY, DRAINING, E.UNLISTED)])
    assert state(t, A) is DRAINING
    assert t.capacity == 2


# =============================================================================
# queueing and FIFO hand-off
# =============================================================================


def test_queue_depth_overflow_raises_queue_full() -> None:
    t = make(svc(A, cc=1, queue_depth=2))
    grant_of(t.acquire(0.0))
    waiter_of(t.acquire(0.0))
    waiter_of(t.acquire(0.0))
    with pytest.raises(QueueFull):
        t.acquire(0.0)
    assert t.queued == 2
    t.check_invariants()


def test_queue_depth_zero_means_no_queueing() -> None:
    t = make(svc(A, cc=1, queue_depth=0))
    g = grant_of(t.acquire(0.0))
    with pytest.raises(QueueFull):
        t.acquire(0.0)
    assert t.queued == 0
    expect(t.release(g, 1.0))
    grant_of(t.acquire(2.0))


def test_queue_full_with_no_pods_at_all() -> None:
    t = make(svc(cc=1, queue_depth=1))
    waiter_of(t.acquire(0.0))
    with pytest.raises(QueueFull):
        t.acquire(0.0)


def test_fifo_hand_off_in_arrival_order_and_no_barging() -> None:
    t = make(svc(A, cc=1))
    first = grant_of(t.acquire(0.0))
    w1 = waiter_of(t.acquire(1.0))
    w2 = waiter_of(t.acquire(2.0))
    w3 = waiter_of(t.acquire(3.0))
    assert t.queued == 3

    expect(t.release(first, 4.0), woken=[w1])  # the slot goes straight to w1
    assert w1.grant is not None and w1.grant.pod.address == A and w1.grant.queued
    assert w2.grant is None and w3.grant is None
    t.check_invariants()

    # A newcomer while w2 and w3 wait is queued behind them: it never barges.
    newcomer = waiter_of(t.acquire(5.0))
    t.check_invariants()

    # Each holder in turn wakes (abandon hands it its grant) and finishes; its slot
    # goes to the next in line, and to nobody else.
    holder = w1
    for i, nxt in enumerate([w2, w3, newcomer]):
        held = collect(t, holder)
        assert nxt.grant is None
        expect(t.release(held, 6.0 + i), woken=[nxt])
        assert nxt.grant is not None
        t.check_invariants()
        holder = nxt

    expect(t.release(collect(t, newcomer), 20.0))
    assert t.in_flight == 0 and t.queued == 0
    t.check_invariants()


def test_a_waiter_is_woken_exactly_once_and_a_direct_grant_never() -> None:
    t = make(svc(A, cc=1))
    g = grant_of(t.acquire(0.0))  # direct: acquire returns no effects at all
    assert not g.queued
    w = waiter_of(t.acquire(0.0))
    woken: list[Waiter] = []
    for effects in (t.release(g, 1.0), t.apply(svc(A, cc=3), 2.0)):
        woken += effects.woken
    got = collect(t, w)
    woken += t.release(got, 3.0).woken
    assert woken == [w]  # by the release; nothing afterwards wakes it again


def test_abandon_removes_a_queued_waiter() -> None:
    t = make(svc(A, cc=1))
    g = grant_of(t.acquire(0.0))
    w1 = waiter_of(t.acquire(0.0))
    w2 = waiter_of(t.acquire(0.0))
    assert t.abandon(w1) is None
    assert t.queued == 1
    assert t.abandon(w1) is None  # twice is harmless
    t.check_invariants()
    expect(t.release(g, 1.0), woken=[w2])  # w1 is gone, never woken
    assert w1.grant is None and w2.grant is not None


def test_abandon_returns_the_grant_if_it_was_already_granted() -> None:
    t = make(svc(A, cc=1))
    g = grant_of(t.acquire(0.0))
    w = waiter_of(t.acquire(0.0))
    expect(t.release(g, 1.0), woken=[w])  # granted to w, before w woke up and gave up
    got = collect(t, w)
    assert got.pod.address == A
    assert t.in_flight == 1
    expect(t.release(got, 2.0))  # the caller gives it back
    assert t.in_flight == 0
    t.check_invariants()


def test_double_release_raises() -> None:
    t = make(svc(A, cc=1))
    g = grant_of(t.acquire(0.0))
    t.release(g, 1.0)
    with pytest.raises(InvariantViolation):
        t.release(g, 2.0)
    assert t.in_flight == 0 and t.trackers[A].in_flight == 0
    t.check_invariants()


def test_redirect_waiters_wakes_every_waiter_in_order_without_a_grant() -> None:
    t = make(svc(A, cc=1))
    g = grant_of(t.acquire(0.0))
    waiters = [waiter_of(t.acquire(float(i))) for i in range(3)]
    expect(t.redirect_waiters(), woken=waiters)
    assert all(w.redirected and w.grant is None for w in waiters)
    assert t.queued == 0
    assert all(t.abandon(w) is None for w in waiters)  # the gate then forwards them
    expect(t.release(g, 5.0))  # nobody left to hand the slot to
    t.check_invariants()


# =============================================================================
# ported from Knative (breaker_test.go, throttler_test.go)
# =============================================================================


def test_knative_breaker_reserve_overload() -> None:
    # {QueueDepth 1, MaxConcurrency 1}: Reserve#1 ok, #2 fails; after release ok again.
    t = make(svc(A, cc=1, queue_depth=0))
    g = grant_of(t.acquire(0.0))
    with pytest.raises(QueueFull):
        t.acquire(0.0)
    expect(t.release(g, 1.0))
    grant_of(t.acquire(1.0))


def test_knative_breaker_overload() -> None:
    # {1,1,1}: 1 running, 1 queued, the 3rd fails at once with queue full.
    t = make(svc(A, cc=1, queue_depth=1))
    grant_of(t.acquire(0.0))
    waiter_of(t.acquire(0.0))
    with pytest.raises(QueueFull):
        t.acquire(0.0)


def test_knative_breaker_queueing_capacity_zero_then_a_pod_turns_healthy() -> None:
    # Capacity 0 with 2 queued; the pod becomes healthy: both are served, in order.
    t = make(svc(A, cc=1, probe=PROBE))
    assert t.capacity == 0 and state(t, A) is PENDING
    w1 = waiter_of(t.acquire(0.0))
    w2 = waiter_of(t.acquire(0.0))
    expect(t.probe_result(A, PASS, 1.0), woken=[w1], changes=[admitted(A)])  # its slot handed over at once
    assert state(t, A) is HEALTHY
    t.check_invariants()
    expect(t.release(collect(t, w1), 2.0), woken=[w2])
    expect(t.release(collect(t, w2), 3.0))
    assert t.in_flight == 0 and t.queued == 0
    t.check_invariants()


def test_knative_breaker_queueing_owned_slots_zero_then_one() -> None:
    # The same through the slot division: this activator owned nothing, now one slot.
    t = make(svc(A, cc=1), owned={A: 0})
    assert t.capacity == 0
    w1 = waiter_of(t.acquire(0.0))
    waiter_of(t.acquire(0.0))
    expect(t.apply(svc(A, cc=1), 1.0, owned={A: 1}), woken=[w1])
    t.check_invariants()


def test_knative_breaker_no_overload() -> None:
    # At capacity: process one, add one, repeatedly. Never a failure, never above capacity.
    t = make(svc(A, B, cc=2, queue_depth=1))
    grants = [grant_of(t.acquire(0.0)) for _ in range(4)]
    for i in range(100):
        expect(t.release(grants.pop(0), float(i)))
        grants.append(grant_of(t.acquire(float(i))))
        assert t.in_flight == 4
        assert all(tr.in_flight <= 2 for tr in t.trackers.values())
        t.check_invariants()


def test_knative_breaker_cancel() -> None:
    # A cancelled waiter frees its queue place; capacity stays consistently full.
    t = make(svc(A, cc=1, queue_depth=1))
    g = grant_of(t.acquire(0.0))
    w = waiter_of(t.acquire(0.0))
    assert t.abandon(w) is None
    assert t.queued == 0
    t.check_invariants()
    # Still full: a new request waits (and fits in the freed queue place).
    w2 = waiter_of(t.acquire(1.0))
    expect(t.release(g, 2.0), woken=[w2])
    assert t.in_flight == 1
    expect(t.release(collect(t, w2), 3.0))
    assert t.in_flight == 0


def test_knative_clumping_first_available_cc3() -> None:
    # "clumping test": cc=3, 5 pods, 3 requests -> all on the first pod.
    t = make(svc(A, B, C, D, F, cc=3))
    assert t.policy.name == "first-available"
    grants = [grant_of(t.acquire(0.0)) for _ in range(3)]
    assert {g.pod.address for g in grants} == {A}
    assert t.capacity == 15
    assert grant_of(t.acquire(0.0)).pod.address == B  # the 4th spills over


def test_knative_spread_cc1_two_pods() -> None:
    # "spread podIP load": cc=1, 2 pods, 2 requests -> both pods.
    t = make(svc(A, B, cc=1))
    grants = [grant_of(t.acquire(0.0)) for _ in range(2)]
    assert {g.pod.address for g in grants} == {A, B}
    waiter_of(t.acquire(0.0))


def test_knative_round_robin_cc5_three_pods() -> None:
    t = make(svc(A, B, C, cc=5))
    assert t.policy.name == "round-robin"
    grants = [grant_of(t.acquire(0.0)) for _ in range(3)]
    assert {g.pod.address for g in grants} == {A, B, C}


def test_knative_infinite_capacity_cc0() -> None:
    # cc=0: every pod used, no limit, least-in-flight spreads the load.
    t = make(svc(A, B, C, cc=0))
    assert t.policy.name == "least-in-flight"
    assert t.capacity is None
    grants = [grant_of(t.acquire(0.0)) for _ in range(30)]
    per_pod = Counter(g.pod.address for g in grants)
    assert set(per_pod) == {A, B, C}
    assert max(per_pod.values()) - min(per_pod.values()) <= 10
    t.check_invariants()


def test_knative_multiple_activators_own_one_slot() -> None:
    # 2 activators, 3 pods, cc=1: this one owns one slot; a second request waits.
    t = make(svc(A, B, C, cc=1), owned={A: 1, B: 0, C: 0})
    assert t.capacity == 1
    g = grant_of(t.acquire(0.0))
    assert g.pod.address == A
    waiter_of(t.acquire(0.0))


# =============================================================================
# pod lifecycle
# =============================================================================


def test_new_pods_start_pending_when_a_probe_is_configured() -> None:
    t = make(svc(A, B, probe=PROBE))
    assert state(t, A) is PENDING and state(t, B) is PENDING
    expect(t.initial_effects)  # pending is where a tracker starts: no change
    waiter_of(t.acquire(0.0))


def test_new_pods_are_healthy_at_once_without_probe() -> None:
    t = make(svc(A, B))
    assert state(t, A) is HEALTHY and state(t, B) is HEALTHY
    expect(t.initial_effects, changes=[admitted(A), admitted(B)])


def test_new_pod_listed_with_drain_true_is_kept_as_removed() -> None:
    t = make(svc(pod(A, drain=True), B))
    assert state(t, A) is REMOVED
    expect(
        t.initial_effects,
        changes=[(A, PENDING, DRAINING, E.DRAIN_SET), (A, DRAINING, REMOVED, E.LAST_RELEASED), admitted(B)],
    )
    assert grant_of(t.acquire(0.0)).pod.address == B


def test_drain_with_requests_in_flight() -> None:
    t = make(svc(A, B, cc=2))
    g = grant_of(t.acquire(0.0))
    assert g.pod.address == A
    expect(t.apply(svc(pod(A, drain=True), B, cc=2), 1.0), changes=[(A, HEALTHY, DRAINING, E.DRAIN_SET)])
    t.check_invariants()
    # No new grant to it, although it has a free slot.
    for _ in range(2):
        assert grant_of(t.acquire(2.0)).pod.address == B
    waiter_of(t.acquire(2.0))
    # Still listed with drain: true: kept as removed. A's freed slot is not routable:
    # the waiter is not woken.
    expect(t.release(g, 3.0), changes=[(A, DRAINING, REMOVED, E.LAST_RELEASED)])
    assert state(t, A) is REMOVED
    t.check_invariants()


def test_unlisted_pod_drains_then_its_tracker_disappears() -> None:
    t = make(svc(A, B, cc=1))
    ga = grant_of(t.acquire(0.0))
    gb = grant_of(t.acquire(0.0))
    expect(t.apply(svc(B, cc=1), 1.0), changes=[(A, HEALTHY, DRAINING, E.UNLISTED)])
    assert t.trackers[A].in_flight == 1
    t.check_invariants()
    expect(t.release(ga, 2.0), changes=[(A, DRAINING, REMOVED, E.LAST_RELEASED)])
    assert A not in t.trackers
    t.check_invariants()
    expect(t.release(gb, 3.0))
    assert set(t.trackers) == {B}


def test_unlisted_idle_pod_disappears_at_once() -> None:
    t = make(svc(A, B))
    expect(
        t.apply(svc(B), 1.0),
        changes=[(A, HEALTHY, DRAINING, E.UNLISTED), (A, DRAINING, REMOVED, E.LAST_RELEASED)],
    )
    assert set(t.trackers) == {B}
    t.check_invariants()


def test_SEED_BUG_unlist_and_relist_busy_cc1_pod_keeps_its_count() -> None:
    """THE seed bug (Knative #15811): a busy pod unlisted and listed again must keep
    its in-flight count, and get no second request until the first is released."""
    t = make(svc(A, cc=1))
    g = grant_of(t.acquire(0.0))

    # unlisted: draining, one in flight
    expect(t.apply(svc(cc=1), 1.0), changes=[(A, HEALTHY, DRAINING, E.UNLISTED)])
    assert t.trackers[A].in_flight == 1
    tracker = t.trackers[A]

    # listed again: same tracker, same count
    expect(t.apply(svc(A, cc=1), 2.0), changes=[(A, DRAINING, PENDING, E.LISTED), admitted(A)])
    assert t.trackers[A] is tracker
    assert state(t, A) is HEALTHY and tracker.in_flight == 1
    t.check_invariants()

    w = waiter_of(t.acquire(3.0))  # NOT a second grant on A
    assert tracker.in_flight == 1
    expect(t.release(g, 4.0), woken=[w])
    assert w.grant is not None and w.grant.pod is tracker
    assert tracker.in_flight == 1
    expect(t.release(collect(t, w), 5.0))
    assert tracker.in_flight == 0 and t.in_flight == 0
    t.check_invariants()


def test_SEED_BUG_with_probe_relisted_busy_pod_proven_again_keeps_its_count() -> None:
    t = healthy_with_probe(svc(A, cc=1, probe=PROBE))
    g = grant_of(t.acquire(0.0))
    expect(t.apply(svc(cc=1, probe=PROBE), 1.0), changes=[(A, HEALTHY, DRAINING, E.UNLISTED)])
    expect(t.apply(svc(A, cc=1, probe=PROBE), 2.0), changes=[(A, DRAINING, PENDING, E.LISTED)])
    assert t.trackers[A].in_flight == 1
    expect(t.probe_result(A, PASS, 3.0), changes=[admitted(A)])
    w = waiter_of(t.acquire(4.0))
    assert t.trackers[A].in_flight == 1
    expect(t.release(g, 5.0), woken=[w])
    assert t.trackers[A].in_flight == 1 and t.queued == 0
    t.check_invariants()


def test_SEED_BUG_drain_true_then_false_keeps_the_count() -> None:
    t = make(svc(A, cc=1))
    g = grant_of(t.acquire(0.0))
    expect(t.apply(svc(pod(A, drain=True), cc=1), 1.0), changes=[(A, HEALTHY, DRAINING, E.DRAIN_SET)])
    expect(
        t.apply(svc(pod(A, drain=False), cc=1), 2.0),
        changes=[(A, DRAINING, PENDING, E.DRAIN_CLEARED), admitted(A)],
    )
    assert t.trackers[A].in_flight == 1
    w = waiter_of(t.acquire(3.0))
    expect(t.release(g, 4.0), woken=[w])
    assert t.trackers[A].in_flight == 1
    t.check_invariants()


def test_SEED_BUG_relisted_after_removed_by_drain_timeout() -> None:
    t = make(svc(A, cc=1, drain_timeout=10.0))
    g = grant_of(t.acquire(0.0))
    expect(t.apply(svc(cc=1, drain_timeout=10.0), 1.0), changes=[(A, HEALTHY, DRAINING, E.UNLISTED)])
    expect(t.tick(20.0), changes=[(A, DRAINING, REMOVED, E.DRAIN_TIMEOUT)])
    assert t.trackers[A].in_flight == 1
    expect(
        t.apply(svc(A, cc=1, drain_timeout=10.0), 21.0),
        changes=[(A, REMOVED, PENDING, E.LISTED), admitted(A)],
    )
    assert t.trackers[A].in_flight == 1
    w = waiter_of(t.acquire(22.0))
    expect(t.release(g, 23.0), woken=[w])
    assert t.trackers[A].in_flight == 1
    t.check_invariants()


def test_cc0_pods_drain_with_reference_counting_too() -> None:
    # Knative's PR leaked here: cc=0 pods were removed at once with requests running.
    t = make(svc(A, cc=0))
    grants = [grant_of(t.acquire(0.0)) for _ in range(3)]
    assert t.trackers[A].in_flight == 3
    expect(t.apply(svc(cc=0), 1.0), changes=[(A, HEALTHY, DRAINING, E.UNLISTED)])
    waiter_of(t.acquire(1.0))  # nothing routable
    for i, g in enumerate(grants[:2]):
        expect(t.release(g, 2.0 + i))
        assert state(t, A) is DRAINING
        t.check_invariants()
    expect(t.release(grants[2], 5.0), changes=[(A, DRAINING, REMOVED, E.LAST_RELEASED)])
    assert A not in t.trackers
    t.check_invariants()


def test_cc0_relisted_busy_pod_keeps_its_count() -> None:
    t = make(svc(A, cc=0))
    g = grant_of(t.acquire(0.0))
    expect(t.apply(svc(cc=0), 1.0), changes=[(A, HEALTHY, DRAINING, E.UNLISTED)])
    expect(t.apply(svc(A, cc=0), 2.0), changes=[(A, DRAINING, PENDING, E.LISTED), admitted(A)])
    assert t.trackers[A].in_flight == 1
    g2 = grant_of(t.acquire(3.0))
    assert t.trackers[A].in_flight == 2
    expect(t.release(g, 4.0))
    expect(t.release(g2, 5.0))
    assert t.trackers[A].in_flight == 0
    t.check_invariants()


def test_drain_timeout_forces_removed_while_in_flight() -> None:
    t = make(svc(A, B, cc=1, drain_timeout=10.0))
    g = grant_of(t.acquire(0.0))
    expect(t.apply(svc(B, cc=1, drain_timeout=10.0), 5.0), changes=[(A, HEALTHY, DRAINING, E.UNLISTED)])
    expect(t.tick(14.9))
    assert state(t, A) is DRAINING
    expect(t.tick(15.0), changes=[(A, DRAINING, REMOVED, E.DRAIN_TIMEOUT)])
    assert t.trackers[A].in_flight == 1
    t.check_invariants()
    expect(t.release(g, 16.0))  # removed already: no change, and the tracker goes
    assert A not in t.trackers  # unlisted: gone once released
    t.check_invariants()


def test_drain_timeout_on_a_listed_drain_true_pod_keeps_it_as_removed() -> None:
    t = make(svc(A, B, cc=1, drain_timeout=10.0))
    g = grant_of(t.acquire(0.0))
    expect(
        t.apply(svc(pod(A, drain=True), B, cc=1, drain_timeout=10.0), 0.0),
        changes=[(A, HEALTHY, DRAINING, E.DRAIN_SET)],
    )
    expect(t.tick(10.0), changes=[(A, DRAINING, REMOVED, E.DRAIN_TIMEOUT)])
    expect(t.release(g, 11.0))
    assert state(t, A) is REMOVED and t.trackers[A].in_flight == 0
    t.check_invariants()


def test_probe_result_counts_consecutive_passes_and_failures() -> None:
    probe = ProbeConfig(healthy_after=2, unhealthy_after=3)
    t = make(svc(A, probe=probe))
    seq: list[tuple[Verdict, PodState]] = [
        (PASS, PENDING),
        (FAIL, PENDING),  # breaks the run of passes
        (PASS, PENDING),
        (INCONCLUSIVE, PENDING),  # neither breaks the run nor adds to it
        (PASS, HEALTHY),  # 2 in a row
        (FAIL, HEALTHY),
        (FAIL, HEALTHY),
        (PASS, HEALTHY),  # breaks the run of failures
        (FAIL, HEALTHY),
        (INCONCLUSIVE, HEALTHY),
        (FAIL, HEALTHY),
        (FAIL, PENDING),  # 3 in a row
        (PASS, PENDING),
        (PASS, HEALTHY),
    ]
    before = PENDING
    for i, (verdict, expected) in enumerate(seq):
        effects = t.probe_result(A, verdict, float(i))
        if expected is before:
            expect(effects)
        else:
            event = E.PROBE_PASSED if verdict is PASS else E.PROBE_FAILED
            expect(effects, changes=[(A, before, expected, event)])
        assert state(t, A) is expected, f"step {i}"
        t.check_invariants()
        before = expected


def test_probe_failure_leaves_in_flight_requests_to_finish() -> None:
    t = healthy_with_probe(svc(A, B, cc=1, probe=ProbeConfig(healthy_after=1, unhealthy_after=1)))
    g = grant_of(t.acquire(0.0))
    expect(t.probe_result(g.pod.address, FAIL, 1.0), changes=[(g.pod.address, HEALTHY, PENDING, E.PROBE_FAILED)])
    assert g.pod.in_flight == 1
    other = grant_of(t.acquire(2.0))
    assert other.pod is not g.pod
    expect(t.release(g, 3.0))
    assert g.pod.state is PENDING and g.pod.in_flight == 0
    t.check_invariants()


def test_probe_results_are_ignored_for_unknown_and_unwanted_pods() -> None:
    t = make(svc(A, pod(B, drain=True), probe=PROBE))
    expect(t.probe_result(C, PASS, 0.0))
    expect(t.probe_result(B, PASS, 0.0))
    assert C not in t.trackers and state(t, B) is REMOVED
    t2 = make(svc(A))  # no probe configured: results ignored
    for _ in range(3):
        expect(t2.probe_result(A, FAIL, 0.0))
    assert state(t2, A) is HEALTHY


def test_passive_ejection_after_unhealthy_after_connect_errors() -> None:
    t = healthy_with_probe(svc(A, B, cc=2, probe=ProbeConfig(healthy_after=1, unhealthy_after=2)))
    g1 = grant_of(t.acquire(0.0))
    g2 = grant_of(t.acquire(0.0))
    assert g1.pod is g2.pod and g1.pod.address == A
    expect(t.record_failure(A, CONNECT, 1.0))
    assert state(t, A) is HEALTHY and t.trackers[A].failures == 1
    expect(t.record_failure(A, TIMEOUT, 2.0), changes=[(A, HEALTHY, PENDING, E.CONNECT_FAILED)])
    assert t.trackers[A].failure_counts == {(CONNECT, True): 1, (TIMEOUT, True): 1}
    t.check_invariants()
    assert grant_of(t.acquire(3.0)).pod.address == B
    expect(t.release(g1, 4.0))
    expect(t.release(g2, 4.0))
    expect(t.probe_result(A, PASS, 5.0), changes=[admitted(A)])  # probes bring it back
    assert t.trackers[A].failures == 0


def test_resets_do_not_count_toward_ejection() -> None:
    t = healthy_with_probe(svc(A, cc=1, probe=ProbeConfig(healthy_after=1, unhealthy_after=1)))
    grant_of(t.acquire(0.0))
    for i in range(5):
        expect(t.record_failure(A, RESET, float(i)))
    assert state(t, A) is HEALTHY and t.trackers[A].failures == 0
    assert t.trackers[A].failure_counts == {(RESET, True): 5}


def test_no_passive_ejection_without_probe() -> None:
    # Nothing would bring it back: the pod stays healthy however many failures.
    t = make(svc(A, cc=1))
    grant_of(t.acquire(0.0))
    for i in range(10):
        expect(t.record_failure(A, CONNECT, float(i)))
    assert state(t, A) is HEALTHY and t.trackers[A].failures == 10
    t.check_invariants()


def test_a_failure_of_an_unknown_pod_is_ignored() -> None:
    t = make(svc(A, cc=1, probe=ProbeConfig(healthy_after=1, unhealthy_after=1)))
    expect(t.record_failure(B, CONNECT, 0.0))  # unlisted and forgotten meanwhile
    assert set(t.trackers) == {A}
    t.check_invariants()


def test_an_answered_release_resets_the_failure_run() -> None:
    t = healthy_with_probe(svc(A, cc=2, probe=ProbeConfig(healthy_after=1, unhealthy_after=2)))
    g = grant_of(t.acquire(0.0))
    unanswered = grant_of(t.acquire(0.0))
    expect(t.record_failure(A, CONNECT, 1.0))
    expect(t.release(unanswered, 1.5))  # not answered: the run goes on
    assert t.trackers[A].failures == 1
    expect(t.release(g, 2.0, answered=True))
    assert t.trackers[A].failures == 0
    expect(t.record_failure(A, CONNECT, 2.0))
    assert state(t, A) is HEALTHY
    expect(t.record_failure(A, CONNECT, 3.0), changes=[(A, HEALTHY, PENDING, E.CONNECT_FAILED)])


def test_failure_on_a_draining_pod_is_counted_but_changes_nothing() -> None:
    probe = ProbeConfig(healthy_after=1, unhealthy_after=1)
    t = healthy_with_probe(svc(A, cc=1, probe=probe))
    g = grant_of(t.acquire(0.0))
    expect(t.apply(svc(cc=1, probe=probe), 1.0), changes=[(A, HEALTHY, DRAINING, E.UNLISTED)])
    expect(t.record_failure(A, CONNECT, 2.0))
    assert state(t, A) is DRAINING
    assert t.trackers[A].failure_counts == {(CONNECT, False): 1}
    expect(t.release(g, 3.0), changes=[(A, DRAINING, REMOVED, E.LAST_RELEASED)])
    assert A not in t.trackers


def test_removing_the_probe_admits_pending_pods() -> None:
    t = make(svc(A, probe=PROBE))
    w = waiter_of(t.acquire(0.0))
    effects = t.apply(svc(A), 1.0)
    expect(effects, woken=[w], changes=[admitted(A)])
    assert [tr.reason for tr in effects.transitions] == ["probe removed (no probe configured)"]
    t.check_invariants()


# =============================================================================
# limits changed on the fly
# =============================================================================


def test_lowering_cc_below_in_flight_stops_grants_until_below_the_new_limit() -> None:
    t = make(svc(A, cc=3))
    grants = [grant_of(t.acquire(0.0)) for _ in range(3)]
    expect(t.apply(svc(A, cc=1), 1.0))
    assert t.capacity == 1 and t.trackers[A].in_flight == 3
    t.check_invariants()
    w = waiter_of(t.acquire(1.0))
    expect(t.release(grants[0], 2.0))  # 2 in flight, limit 1
    expect(t.release(grants[1], 3.0))  # 1 in flight, limit 1
    expect(t.release(grants[2], 4.0), woken=[w])
    assert t.trackers[A].in_flight == 1
    t.check_invariants()
    expect(t.release(collect(t, w), 5.0))


def test_raising_cc_hands_slots_to_waiters_at_once_in_order() -> None:
    t = make(svc(A, cc=1))
    grant_of(t.acquire(0.0))
    waiters = [waiter_of(t.acquire(float(i))) for i in range(4)]
    expect(t.apply(svc(A, cc=3), 5.0), woken=waiters[:2])
    assert [w.grant is not None for w in waiters] == [True, True, False, False]
    assert t.trackers[A].in_flight == 3 and t.queued == 2
    t.check_invariants()


def test_cc_change_switches_the_auto_policy() -> None:
    t = make(svc(A, B, cc=1))
    assert t.policy.name == "first-available"
    g = grant_of(t.acquire(0.0))
    expect(t.apply(svc(A, B, cc=5), 1.0))
    assert t.policy.name == "round-robin"
    t.check_invariants()
    expect(t.apply(svc(A, B, cc=0), 2.0))
    assert t.policy.name == "least-in-flight"
    t.check_invariants()
    expect(t.release(g, 3.0))
    t.check_invariants()


def test_queue_depth_lowered_keeps_the_waiters_but_admits_no_more() -> None:
    t = make(svc(A, cc=1, queue_depth=5))
    grant_of(t.acquire(0.0))
    for _ in range(3):
        waiter_of(t.acquire(0.0))
    expect(t.apply(svc(A, cc=1, queue_depth=1), 1.0))
    assert t.queued == 3
    with pytest.raises(QueueFull):
        t.acquire(2.0)


def test_reordered_pods_stay_routable_first_available() -> None:
    # The pod above it was removed from the file: its rank changed from 1 to 0.
    # (A stale heap entry once hid it: requests queued with a free pod.)
    t = make(svc(B, A, cc=2))
    expect(
        t.apply(svc(A, cc=2), 1.0),
        changes=[(B, HEALTHY, DRAINING, E.UNLISTED), (B, DRAINING, REMOVED, E.LAST_RELEASED)],
    )
    g = grant_of(t.acquire(2.0))
    assert g.pod.address == A
    expect(t.apply(svc(C, A, cc=2), 3.0), changes=[admitted(C)])
    assert grant_of(t.acquire(4.0)).pod.address == C
    expect(t.apply(svc(A, C, cc=2), 5.0))  # swapped
    assert grant_of(t.acquire(6.0)).pod.address == A
    t.check_invariants()


# =============================================================================
# retry after a connect failure
# =============================================================================


def test_acquire_retry_prefers_another_pod_and_releases_the_failed_grant() -> None:
    t = make(svc(A, B, cc=2))
    failed = grant_of(t.acquire(0.0))
    assert failed.pod.address == A  # A still has a free slot
    retry, effects = t.acquire_retry(failed, 1.0)
    expect(effects)
    assert grant_of(retry).pod.address == B
    assert failed.released
    t.check_invariants()
    assert t.trackers[A].in_flight == 0 and t.trackers[B].in_flight == 1
    with pytest.raises(InvariantViolation):
        t.release(failed, 2.0)  # given back already, by acquire_retry


def test_acquire_retry_waits_at_the_head_of_the_queue() -> None:
    t = make(svc(A, B, cc=1))
    failed = grant_of(t.acquire(0.0))
    other = grant_of(t.acquire(0.0))
    older = waiter_of(t.acquire(1.0))
    result, effects = t.acquire_retry(failed, 2.0)
    retry = waiter_of(result)
    # The failed grant, released after the choice, goes to the retry: ahead of the
    # older waiter, since it already waited its turn.
    expect(effects, woken=[retry])
    assert retry.grant is not None and retry.grant.pod.address == A
    expect(t.release(other, 3.0), woken=[older])
    t.check_invariants()


def test_acquire_retry_on_the_only_pod_with_a_free_slot() -> None:
    t = make(svc(A, cc=2))
    failed = grant_of(t.acquire(0.0))
    result, effects = t.acquire_retry(failed, 1.0)
    retry = waiter_of(result)
    expect(effects, woken=[retry])  # no other pod: the same pod's free slot, at once
    assert retry.grant is not None and retry.grant.pod.address == A
    assert t.trackers[A].in_flight == 1 and failed.released
    expect(t.release(collect(t, retry), 2.0))
    assert t.in_flight == 0
    t.check_invariants()


def test_acquire_retry_ignores_queue_depth() -> None:
    t = make(svc(A, cc=1, queue_depth=0))
    failed = grant_of(t.acquire(0.0))
    result, effects = t.acquire_retry(failed, 1.0)
    retry = waiter_of(result)
    expect(effects, woken=[retry])
    assert retry.grant is not None


def test_acquire_retry_of_a_grant_given_back_already_raises_before_taking_a_slot() -> None:
    """A second release through ``acquire_retry`` is a caller's bug and raises, as
    ``release`` does, and like ``release`` it must raise before changing anything.

    KNOWN BUG (core): ``acquire_retry`` grants (or queues) first and releases ``failed``
    last, so the double release is only noticed after a new grant was made: the
    exception leaves that slot taken by nobody, for good.
    """
    t = make(svc(A, B, cc=1))
    failed = grant_of(t.acquire(0.0))
    expect(t.release(failed, 1.0))
    with pytest.raises(InvariantViolation):
        t.acquire_retry(failed, 2.0)
    leaked = {a: tr.in_flight for a, tr in t.trackers.items() if tr.in_flight}
    assert t.in_flight == 0 and t.queued == 0, (
        f"acquire_retry raised for a double release but kept the slot it took meanwhile ({leaked}): "
        "it should check failed.released before granting or queueing"
    )
    t.check_invariants()


def test_acquire_retry_reports_the_failed_pod_leaving() -> None:
    # The failed pod was unlisted meanwhile: giving its grant back removes it, and that
    # change is the retry's effect for the shell to log.
    t = make(svc(A, B, cc=1))
    failed = grant_of(t.acquire(0.0))
    expect(t.apply(svc(B, cc=1), 0.5), changes=[(A, HEALTHY, DRAINING, E.UNLISTED)])
    retry, effects = t.acquire_retry(failed, 1.0)
    assert grant_of(retry).pod.address == B
    expect(effects, changes=[(A, DRAINING, REMOVED, E.LAST_RELEASED)])
    assert A not in t.trackers
    t.check_invariants()


# =============================================================================
# slots owned by this activator
# =============================================================================


def test_owned_slots_limit_grants_per_pod() -> None:
    t = make(svc(A, B, C, cc=3), owned={A: 1, B: 2, C: 0})
    grants = [grant_of(t.acquire(0.0)) for _ in range(3)]
    assert Counter(g.pod.address for g in grants) == {A: 1, B: 2}
    w = waiter_of(t.acquire(0.0))
    t.check_invariants()
    # The division changes (a peer left): C's slots are ours now, the waiter gets one.
    expect(t.apply(svc(A, B, C, cc=3), 1.0, owned={A: 1, B: 2, C: 3}), woken=[w])
    assert t.queued == 0 and t.trackers[C].in_flight == 1
    t.check_invariants()


def test_owned_mapping_missing_a_pod_means_zero_slots() -> None:
    t = make(svc(A, B, cc=2), owned={A: 2})
    assert t.trackers[B].slots == 0 and t.capacity == 2


def test_cc0_ignores_owned() -> None:
    t = make(svc(A, B, cc=0), owned={A: 0, B: 0})
    assert t.capacity is None
    grant_of(t.acquire(0.0))


# =============================================================================
# snapshot
# =============================================================================


def test_snapshot_shape() -> None:
    t = make(svc(A, B, cc=1))
    grant_of(t.acquire(0.0))
    t.record_failure(A, CONNECT, 0.5)
    t.record_failure(A, RESET, 0.5)
    snap = t.snapshot(1.0)
    assert snap["container_concurrency"] == 1 and snap["capacity"] == 2
    assert snap["in_flight"] == 1 and snap["queued"] == 0
    assert [p["address"] for p in snap["pods"]] == [A, B]
    first = snap["pods"][0]
    assert {k: first[k] for k in ("state", "in_flight", "slots", "failures")} == {
        "state": "healthy",
        "in_flight": 1,
        "slots": 1,
        "failures": 1,
    }
    assert first["transport_failures"] == {"connect_errors.healthy": 1, "resets.healthy": 1}


# =============================================================================
# random operation sequences
# =============================================================================

UNIVERSE = [f"10.9.0.{i}:80" for i in range(1, 5)]
PROBES = [None, ProbeConfig(healthy_after=1, unhealthy_after=1), ProbeConfig(healthy_after=2, unhealthy_after=2)]
POLICIES = ["auto", "first-available", "round-robin", "least-in-flight"]
DRAIN_TIMEOUT = 10.0


@st.composite
def service_configs(draw: st.DrawFn) -> tuple[ServiceConfig, dict[str, int] | None]:
    no_pods_allowed = draw(st.integers(0, 3)) == 0  # a service with no pods, now and then
    addresses = draw(st.lists(st.sampled_from(UNIVERSE), unique=True, min_size=0 if no_pods_allowed else 1, max_size=4))
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
    owned = None  # this activator owns every slot, or (a third of the time) its share:
    if draw(st.integers(0, 2)) == 0:  # most addresses in the map, some with 0 slots here
        owned = {a: draw(st.integers(0, cc)) for a in UNIVERSE if draw(st.integers(0, 3))}
    return config, owned


@dataclass(frozen=True)
class Seen:
    """The pods as they were just before a core call."""

    in_flight: dict[str, int]
    states: dict[str, PodState]


class ThrottlerMachine(RuleBasedStateMachine):
    """Random operations on one throttler, checked against a small model after each.

    The model keeps its own per-pod count of outstanding grants and the expected queue
    order (arrivals at the back, retries at the front). After every call it reads the
    call's ``Effects`` as the shell would and checks they are exactly what happened:
    the woken waiters are the oldest, in order, each woken once, each with a grant or
    redirected; every pod that gained a grant in the call was healthy, wanted and
    within this activator's slots; and the transitions, replayed from the states seen
    before the call, follow the table and end in the states the pods are in now (a
    pod whose state changed without a transition, or a transition that changed
    nothing, fails).
    """

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.t: ServiceThrottler | None = None
        self.config: ServiceConfig | None = None
        self.owned: dict[str, int] | None = None
        self.outstanding: list[Grant] = []  # grants the "requests" hold
        self.model_queue: list[Waiter] = []  # expected queue order
        self.granted: list[Waiter] = []  # woken with a grant, not yet collected
        self.redirected: list[Waiter] = []  # woken without one, not yet collected
        self.times_woken: dict[int, int] = {}  # id(waiter) -> how often an Effects named it
        self.waiters: list[Waiter] = []  # every waiter made (keeps the ids above alive)
        self.count: Counter[str] = Counter()  # model in-flight per pod

    # -- the model's view of one call -----------------------------------------------

    @property
    def throttler(self) -> ServiceThrottler:
        assert self.t is not None
        return self.t

    def seen(self) -> Seen:
        trackers = self.throttler.trackers
        return Seen({a: tr.in_flight for a, tr in trackers.items()}, {a: tr.state for a, tr in trackers.items()})

    def observe(
        self, effects: Effects, before: Seen, *, direct: Grant | None = None, released: Grant | None = None
    ) -> None:
        """After one call: ``direct`` is the grant it returned, ``released`` the one it took back."""
        self.check_transitions(effects, before)
        grants = self.take_woken(effects)
        if direct is not None:
            grants.append(direct)
        if released is not None:
            self.count[released.pod.address] -= 1
        trackers = self.throttler.trackers
        for grant in grants:
            tracker = grant.pod
            assert trackers.get(tracker.address) is tracker, "granted on a forgotten tracker"
            assert tracker.state is HEALTHY, f"granted on a {tracker.state.value} pod"
            assert tracker.wanted, "granted on an unwanted pod"
            self.count[tracker.address] += 1
        for address in {grant.pod.address for grant in grants}:
            # In flight only grows by the call's grants: within the slots at the end
            # means within them at every grant.
            tracker = trackers[address]
            if tracker.slots is not None:
                assert tracker.in_flight <= tracker.slots, (
                    f"{address}: granted up to {tracker.in_flight} in flight with {tracker.slots} slots"
                )

    def check_transitions(self, effects: Effects, before: Seen) -> None:
        replay = dict(before.states)
        for tr in effects.transitions:
            assert tr.service == "api"
            assert tr.new is not tr.old, f"a transition that changes nothing: {tr}"
            assert next_state(tr.old, tr.event) is tr.new, tr
            assert replay.get(tr.address, PENDING) is tr.old, f"{tr} from a pod that was {replay.get(tr.address)}"
            replay[tr.address] = tr.new  # a new tracker starts pending
        for address in UNIVERSE:
            tracker = self.throttler.trackers.get(address)
            if tracker is not None:
                assert tracker.state is replay.get(address, PENDING), f"{address} changed state unreported"
            elif address in replay:
                assert replay[address] is REMOVED, f"{address} forgotten while {replay[address].value}"

    def take_woken(self, effects: Effects) -> list[Grant]:
        """The woken waiters: the head of the queue, in order, each woken once."""
        woken = list(effects.woken)
        assert [id(w) for w in woken] == [id(w) for w in self.model_queue[: len(woken)]], (
            "woken out of FIFO order, or a waiter that was not queued"
        )
        del self.model_queue[: len(woken)]
        grants = []
        for waiter in woken:
            self.times_woken[id(waiter)] += 1
            assert self.times_woken[id(waiter)] == 1, "a waiter woken twice"
            if waiter.grant is not None:
                assert not waiter.redirected and waiter.grant.queued
                grants.append(waiter.grant)
                self.granted.append(waiter)
            else:
                assert waiter.redirected, "woken with neither a grant nor a redirect"
                self.redirected.append(waiter)
        return grants

    def queued(self, waiter: Waiter, *, at_head: bool = False) -> None:
        """A waiter the call returned (a retry's may have been handed a slot by the same call)."""
        self.waiters.append(waiter)
        self.times_woken[id(waiter)] = 0
        self.model_queue.insert(0 if at_head else len(self.model_queue), waiter)

    def draw_address(self, data: st.DataObject, likely: list[str]) -> str:
        """Half the time one of ``likely`` (when there are any), else any address."""
        pick_likely: bool = data.draw(st.booleans())
        if likely and pick_likely:
            return data.draw(st.sampled_from(likely))
        return data.draw(st.sampled_from(UNIVERSE))

    def advance(self, dt: float) -> float:
        self.now += dt
        return self.now

    def pop_outstanding(self, data: st.DataObject) -> Grant:
        return self.outstanding.pop(data.draw(st.integers(0, len(self.outstanding) - 1)))

    def do_release(self, grant: Grant, answered: bool = False) -> None:
        before = self.seen()
        effects = self.throttler.release(grant, self.now, answered)
        self.observe(effects, before, released=grant)
        if answered:
            assert grant.pod.failures == 0

    def do_abandon(self, waiter: Waiter) -> None:
        got = self.throttler.abandon(waiter)  # never has effects: it returns a grant at most
        if waiter in self.granted:
            assert got is not None and got is waiter.grant
            self.granted.remove(waiter)
            self.outstanding.append(got)  # the request goes on with it (released later)
        else:
            assert got is None
            (self.redirected if waiter in self.redirected else self.model_queue).remove(waiter)

    # -- rules ---------------------------------------------------------------------

    @initialize(conf=service_configs())
    def start(self, conf: tuple[ServiceConfig, dict[str, int] | None]) -> None:
        self.config, self.owned = conf
        self.t = ServiceThrottler(self.config, self.now, owned=self.owned, rng=random.Random(0))
        self.observe(self.t.initial_effects, Seen({}, {}))

    @rule(dt=st.sampled_from([0.0, 0.5, 3.0]))
    def acquire(self, dt: float) -> None:
        assert self.config is not None
        t = self.throttler
        queued_before = t.queued
        before = self.seen()
        try:
            result = t.acquire(self.advance(dt))
        except QueueFull:
            assert queued_before >= self.config.queue_depth
            assert t.queued == queued_before
            return
        if isinstance(result, Grant):
            assert queued_before == 0, "a newcomer barged past waiters"
            self.observe(NO_EFFECTS, before, direct=result)
            self.outstanding.append(result)
        else:
            assert queued_before < self.config.queue_depth
            assert result.grant is None and not result.redirected
            self.queued(result)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data(), answered=st.booleans())
    def release(self, data: st.DataObject, answered: bool) -> None:
        self.do_release(self.pop_outstanding(data), answered)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def release_twice_raises(self, data: st.DataObject) -> None:
        grant = self.pop_outstanding(data)
        self.do_release(grant)
        with pytest.raises(InvariantViolation):
            self.throttler.release(grant, self.now)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        """A connect failure: acquire_retry, which gives the failed grant back itself."""
        t = self.throttler
        failed = self.pop_outstanding(data)
        others_free = [tr for tr in t.trackers.values() if tr is not failed.pod and tr.can_take()]
        before = self.seen()
        result, effects = t.acquire_retry(failed, self.now)
        assert failed.released
        if isinstance(result, Grant):
            assert others_free, "a grant although no other pod was free"
            assert result.pod is not failed.pod, "retried on the failed pod while another was free"
            self.observe(effects, before, direct=result, released=failed)
            self.outstanding.append(result)
        else:
            assert not others_free
            self.queued(result, at_head=True)  # it waited its turn already
            self.observe(effects, before, released=failed)

    @precondition(lambda self: self.model_queue or self.granted or self.redirected)
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        """A waiter gives up or wakes up: abandon() returns its grant if it has one."""
        pool = self.model_queue + self.granted + self.redirected
        self.do_abandon(pool[data.draw(st.integers(0, len(pool) - 1))])

    @rule(conf=service_configs(), dt=st.sampled_from([0.0, 1.0, 5.0]))
    def apply(self, conf: tuple[ServiceConfig, dict[str, int] | None], dt: float) -> None:
        t = self.throttler
        self.config, self.owned = conf
        before = self.seen()
        self.observe(t.apply(self.config, self.advance(dt), self.owned), before)
        cc = self.config.container_concurrency
        for address, tracker in t.trackers.items():
            expected = None if cc == 0 else cc if self.owned is None else self.owned.get(address, 0)
            assert tracker.slots == expected
        for p in self.config.pods:
            tracker = t.trackers[p.address]
            assert tracker.rank == self.config.pods.index(p)
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
        assert self.config is not None
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

    @rule(data=st.data(), verdict=st.sampled_from(Verdict))
    def probe(self, data: st.DataObject, verdict: Verdict) -> None:
        """A probe's verdict: often on a listed pod, else on any address."""
        assert self.config is not None
        listed = [p.address for p in self.config.pods]
        address = self.draw_address(data, likely=listed)
        tracker = self.throttler.trackers.get(address)
        probe = self.config.probe
        if tracker is None or probe is None or tracker.state not in (PENDING, HEALTHY):
            expect(self.throttler.probe_result(address, verdict, self.now))  # not judged: nothing at all
            return
        was, passes, failures = tracker.state, tracker.probe_passes, tracker.probe_failures
        before = self.seen()
        effects = self.throttler.probe_result(address, verdict, self.now)
        self.observe(effects, before)
        if verdict is PASS:
            expected = HEALTHY if was is HEALTHY or passes + 1 >= probe.healthy_after else PENDING
        elif verdict is FAIL:
            expected = PENDING if was is PENDING or failures + 1 >= probe.unhealthy_after else HEALTHY
        else:  # neither a pass nor a failure: the runs are left as they were
            expected = was
            assert not effects and (tracker.probe_passes, tracker.probe_failures) == (passes, failures)
        assert tracker.state is expected, f"{verdict.value} after {passes} passes, {failures} failures"

    @rule(data=st.data(), kind=st.sampled_from(FailureKind))
    def record_failure(self, data: st.DataObject, kind: FailureKind) -> None:
        """A transport failure: often on a pod that runs a request, else on any address."""
        assert self.config is not None
        busy = sorted({grant.pod.address for grant in self.outstanding})
        address = self.draw_address(data, likely=busy)
        tracker = self.throttler.trackers.get(address)
        if tracker is None:
            expect(self.throttler.record_failure(address, kind, self.now))
            assert address not in self.throttler.trackers, "a failure made a tracker"
            return
        was, streak = tracker.state, tracker.failures
        key = (kind, was is HEALTHY)
        counted = tracker.failure_counts.get(key, 0)
        before = self.seen()
        self.observe(self.throttler.record_failure(address, kind, self.now), before)
        assert tracker.failure_counts[key] == counted + 1
        in_a_row = kind is not RESET  # the pod answered a reset request: not toward ejection
        assert tracker.failures == streak + in_a_row
        probe = self.config.probe
        ejected = in_a_row and probe is not None and was is HEALTHY and tracker.failures >= probe.unhealthy_after
        assert tracker.state is (PENDING if ejected else was)

    @precondition(lambda self: self.model_queue)
    @rule()
    def redirect_waiters(self) -> None:
        """This process stopped owning the service's slots: every waiter is sent away."""
        queued = list(self.model_queue)
        before = self.seen()
        effects = self.throttler.redirect_waiters()
        self.observe(effects, before)
        assert [id(w) for w in effects.woken] == [id(w) for w in queued] and not effects.transitions
        assert self.throttler.queued == 0

    @rule(dt=st.sampled_from([1.0, 4.0, 11.0]))
    def tick(self, dt: float) -> None:
        before = self.seen()
        self.observe(self.throttler.tick(self.advance(dt)), before)
        for tracker in self.throttler.trackers.values():
            assert tracker.state is not DRAINING or self.now - tracker.since < DRAIN_TIMEOUT

    # -- after every step ----------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if self.t is None or self.config is None:
            return
        t = self.t
        t.check_invariants()  # the outbox included: every effect was handed out
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
        assert all(self.times_woken[id(w)] == 0 for w in self.model_queue)
        assert all(self.times_woken[id(w)] == 1 for w in self.granted + self.redirected)
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
        while self.outstanding or self.model_queue or self.granted or self.redirected:
            if self.outstanding:
                self.do_release(self.outstanding.pop())
            else:
                self.do_abandon((self.model_queue + self.granted + self.redirected)[0])
            t.check_invariants()
        assert t.in_flight == 0
        assert t.queued == 0
        assert all(tracker.in_flight == 0 for tracker in t.trackers.values())
        assert all(tracker.state is not DRAINING for tracker in t.trackers.values())
        assert all(tracker.listed for tracker in t.trackers.values())  # unlisted idle ones are gone
        for waiter in self.waiters:
            handed = waiter.grant is not None or waiter.redirected
            assert self.times_woken[id(waiter)] == (1 if handed else 0)


ThrottlerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_random_operation_sequences = ThrottlerMachine.TestCase

"""The throttler with priority classes and tenants: the queue's order reaches the hand-off,
a shed waiter is an effect, and a reload keeps every waiter whatever the new policy."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from builders import svc

from activator.core.config import FairBy, PriorityConfig
from activator.core.errors import QueueFull, TenantQueueFull
from activator.core.throttler import Grant, ServiceThrottler, Waiter

A = "10.0.0.1:8000"
CLASSES = PriorityConfig(("critical", "standard", "sheddable"), "standard")


def make(**options: object) -> tuple[ServiceThrottler, Grant]:
    """A cc=1 service over one pod, its only slot taken."""
    throttler = ServiceThrottler(svc(A, cc=1, probe=None, **options), 0.0, rng=random.Random(0))  # type: ignore[arg-type]
    busy, effects = throttler.admit(0.0)
    assert isinstance(busy, Grant) and not effects
    return throttler, busy


def queued(throttler: ServiceThrottler, klass: int, tenant: str | None = None, now: float = 1.0) -> Waiter:
    waiter, effects = throttler.admit(now, klass, tenant)
    assert isinstance(waiter, Waiter) and not effects
    throttler.check_invariants()
    return waiter


def serve_next(throttler: ServiceThrottler, grant: Grant, now: float = 5.0) -> Waiter:
    effects = throttler.release(grant, now)
    (woken,) = effects.woken
    assert isinstance(woken, Waiter) and woken.grant is not None
    throttler.check_invariants()
    return woken


def test_a_freed_slot_goes_to_the_highest_class() -> None:
    throttler, busy = make(priority=CLASSES)
    low, mid, high = queued(throttler, 2), queued(throttler, 1), queued(throttler, 0)
    first = serve_next(throttler, busy)
    assert first is high
    assert serve_next(throttler, first.grant) is mid  # type: ignore[arg-type]
    assert serve_next(throttler, mid.grant) is low  # type: ignore[arg-type]


def test_a_full_queue_sheds_as_an_effect_and_counts_it() -> None:
    throttler, _ = make(priority=CLASSES, queue_depth=2)
    low1, low2 = queued(throttler, 2), queued(throttler, 2)
    high, effects = throttler.admit(2.0, 0)
    assert list(effects.woken) == [low2] and low2.shed and low2.grant is None
    assert isinstance(high, Waiter) and throttler.queued == 2
    assert throttler.sheds == [0, 0, 1]
    assert throttler.abandon(low2) is None  # the shell's gate: no grant, shed
    throttler.check_invariants()
    with pytest.raises(QueueFull):  # nobody below the lowest class
        throttler.admit(3.0, 2)
    assert low1 in throttler.queue


def test_acquire_without_a_class_is_the_lowest_and_sheds_nobody() -> None:
    throttler, _ = make(priority=CLASSES, queue_depth=1)
    assert isinstance(throttler.acquire(1.0), Waiter)
    with pytest.raises(QueueFull):
        throttler.acquire(1.0)


def test_a_tenant_over_its_share_is_refused_while_others_queue() -> None:
    throttler, _ = make(fair_by=FairBy("x-key"), queue_depth=4, tenant_queue_share=0.5)
    queued(throttler, 0, "a"), queued(throttler, 0, "a")
    with pytest.raises(TenantQueueFull):
        throttler.admit(1.0, 0, "a")
    queued(throttler, 0, "b")
    assert throttler.queued == 3


def test_a_reload_keeps_every_waiter_whatever_the_new_policy() -> None:
    throttler, busy = make(priority=CLASSES, fair_by=FairBy("x-key"))
    waiters = [
        queued(throttler, 2, "a", now=1.0),
        queued(throttler, 0, "b", now=2.0),
        queued(throttler, 1, "a", now=3.0),
    ]
    plain = replace(throttler.config, priority=None, fair_by=None)
    throttler.apply(plain, 4.0)
    throttler.check_invariants()
    assert throttler.queued == 3 and throttler.sheds == [0]
    served = [serve_next(throttler, busy)]
    for _ in range(2):
        served.append(serve_next(throttler, served[-1].grant))  # type: ignore[arg-type]
    assert served == waiters  # one FIFO again: by arrival
    assert throttler.snapshot(6.0).get("classes") is None


def test_a_retry_waits_first() -> None:
    throttler, busy = make(priority=CLASSES)
    queued(throttler, 0)
    retry, effects = throttler.acquire_retry(busy, 2.0)
    assert isinstance(retry, Waiter)
    assert list(effects.woken) == [retry]  # the failed slot, given back, goes to the retry first

"""The throttler with priority classes and tenants: the queue's order reaches the hand-off,
a shed waiter is an effect, and a reload keeps every waiter whatever the new policy."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from builders import svc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule
from test_throttler import NO_EFFECTS, ThrottlerMachine, service_configs

from activator.core.config import FairBy, PriorityConfig, ServiceConfig, tenant_cap
from activator.core.errors import QueueFull, TenantQueueFull
from activator.core.throttler import Effects, Grant, ServiceThrottler, Waiter

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


# -- random operation sequences with classes and tenants --------------------------------------
# The throttler's own machine (``test_throttler.ThrottlerMachine``: pods, probes, reloads,
# retries, releases, a model of every count), its services given three classes and
# tenants: arrivals draw a class and a tenant, and the woken waiters are checked against
# the queue's rules instead of FIFO (the highest class first, each tenant's oldest first;
# a shed waiter is the youngest of the lowest class below the arrival).

TENANTS = ("a", "b", "c")


def classed(conf: tuple[ServiceConfig, dict[str, int] | None]) -> tuple[ServiceConfig, dict[str, int] | None]:
    config, owned = conf
    return replace(config, priority=CLASSES, fair_by=FairBy("x-key"), tenant_queue_share=0.5), owned


class ClassedThrottlerMachine(ThrottlerMachine):
    def __init__(self) -> None:
        super().__init__()
        self.shed: list[Waiter] = []  # woken without a grant, shed

    @initialize(conf=service_configs().map(classed))
    def start(self, conf: tuple[ServiceConfig, dict[str, int] | None]) -> None:
        ThrottlerMachine.start(self, conf)

    @rule(conf=service_configs().map(classed), dt=st.sampled_from([0.0, 1.0, 5.0]))
    def apply(self, conf: tuple[ServiceConfig, dict[str, int] | None], dt: float) -> None:
        ThrottlerMachine.apply(self, conf, dt)

    @rule(dt=st.sampled_from([0.0, 0.5, 3.0]), klass=st.integers(0, 2), tenant=st.sampled_from(TENANTS))
    def acquire(self, dt: float, klass: int, tenant: str) -> None:  # type: ignore[override]
        assert self.config is not None
        t = self.throttler
        queued_before = list(self.model_queue)
        before = self.seen()
        try:
            result, effects = t.admit(self.advance(dt), klass, tenant)
        except TenantQueueFull:
            assert sum(w.tenant == tenant for w in queued_before) >= tenant_cap(self.config)
            return
        except QueueFull:
            assert len(queued_before) >= self.config.queue_depth
            assert all(w.klass <= klass for w in queued_before), "refused while a lower class could be shed"
            return
        if isinstance(result, Grant):
            assert not queued_before, "a newcomer barged past waiters"
            self.observe(NO_EFFECTS, before, direct=result)
            self.outstanding.append(result)
            return
        self.queued(result)
        if effects.woken:
            (victim,) = effects.woken
            assert len(queued_before) >= self.config.queue_depth
            lowest = max(w.klass for w in queued_before)
            assert victim.klass == lowest > klass
            assert victim is [w for w in queued_before if w.klass == lowest][-1], "not the youngest of its class"
        self.observe(effects, before)

    @precondition(lambda self: self.model_queue)
    @rule()
    def redirect_waiters(self) -> None:
        """Every waiter sent away, in the order of the queue (``take_woken`` checks it)."""
        queued = list(self.model_queue)
        before = self.seen()
        effects = self.throttler.redirect_waiters()
        self.observe(effects, before)
        assert sorted(map(id, effects.woken)) == sorted(map(id, queued)) and not effects.transitions
        assert self.throttler.queued == 0

    def take_woken(self, effects: Effects) -> list[Grant]:
        grants = []
        for waiter in effects.woken:
            assert any(w is waiter for w in self.model_queue), "woken but not queued"
            self.times_woken[id(waiter)] += 1
            assert self.times_woken[id(waiter)] == 1, "a waiter woken twice"
            if waiter.shed:
                assert waiter.grant is None and not waiter.redirected
                self.model_queue.remove(waiter)
                self.waiters.remove(waiter)
                self.shed.append(waiter)
                continue
            top = min(w.klass for w in self.model_queue)
            assert waiter.klass == top, f"class {waiter.klass} served while class {top} waits"
            first = next(w for w in self.model_queue if w.klass == waiter.klass and w.tenant == waiter.tenant)
            assert first is waiter, "a tenant's waiters served out of order"
            self.model_queue.remove(waiter)
            if waiter.grant is not None:
                assert not waiter.redirected and waiter.grant.queued
                grants.append(waiter.grant)
                self.granted.append(waiter)
            else:
                assert waiter.redirected, "woken with neither a grant nor a redirect"
                self.redirected.append(waiter)
        return grants


ClassedThrottlerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_random_operation_sequences_with_classes_and_tenants = ClassedThrottlerMachine.TestCase

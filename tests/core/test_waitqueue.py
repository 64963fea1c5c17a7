"""The wait queue's rules: tables for each rule, hypothesis for the promises over any sequence."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from activator.core.errors import QueueFull, TenantQueueFull
from activator.core.waitqueue import Queued, QueuePolicy, WaitQueue


class Named(Queued):
    __slots__ = ("name",)

    def __init__(self, name: str, klass: int = 0, tenant: str | None = None, at: float = 0.0) -> None:
        super().__init__(at, klass, tenant)
        self.name = name

    def __repr__(self) -> str:
        return self.name


def names(queue: WaitQueue, now: float = 0.0) -> list[str]:
    served = []
    while (next_one := queue.pop(now)) is not None:
        assert isinstance(next_one, Named)
        served.append(next_one.name)
        queue.check_invariants()
    return served


def fill(queue: WaitQueue, *spec: tuple[str, int, str | None, float]) -> dict[str, Named]:
    made = {}
    for name, klass, tenant, at in spec:
        made[name] = Named(name, klass, tenant, at)
        assert queue.push(made[name]) is None
        queue.check_invariants()
    return made


def test_plain_queue_is_one_fifo() -> None:
    queue = WaitQueue(QueuePolicy(), depth=3)
    fill(queue, ("a", 0, None, 0), ("b", 0, None, 1), ("c", 0, None, 2))
    with pytest.raises(QueueFull):
        queue.push(Named("d"))
    assert names(queue) == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("arrivals", "served"),
    [
        ([("low1", 2), ("low2", 2), ("high", 0)], ["high", "low1", "low2"]),
        ([("mid", 1), ("low", 2), ("high", 0), ("mid2", 1)], ["high", "mid", "mid2", "low"]),
        ([("low", 2), ("low2", 2)], ["low", "low2"]),
    ],
)
def test_highest_class_first_fifo_within(arrivals: list[tuple[str, int]], served: list[str]) -> None:
    queue = WaitQueue(QueuePolicy(classes=3), depth=10)
    fill(queue, *[(name, klass, None, at) for at, (name, klass) in enumerate(arrivals)])
    assert names(queue) == served


def test_fair_round_robin_between_tenants_each_fifo() -> None:
    queue = WaitQueue(QueuePolicy(fair=True), depth=10)
    fill(
        queue,
        ("a1", 0, "a", 0),
        ("a2", 0, "a", 1),
        ("a3", 0, "a", 2),
        ("b1", 0, "b", 3),
        ("c1", 0, "c", 4),
        ("b2", 0, "b", 5),
    )
    assert names(queue) == ["a1", "b1", "c1", "a2", "b2", "a3"]


def test_tenant_cap_refuses_that_tenant_only() -> None:
    queue = WaitQueue(QueuePolicy(fair=True, tenant_cap=2), depth=10)
    fill(queue, ("a1", 0, "a", 0), ("a2", 0, "a", 1))
    with pytest.raises(TenantQueueFull):
        queue.push(Named("a3", 0, "a"))
    fill(queue, ("b1", 0, "b", 2))
    assert len(queue) == 3
    assert queue.top_tenants(1) == [("a", 2)]


@pytest.mark.parametrize(
    ("queued", "arrival", "shed", "refused"),
    [
        # the youngest of the lowest class below the arrival goes
        ([("s1", 2), ("s2", 2), ("m1", 1)], ("c", 0), "s2", False),
        ([("m1", 1), ("m2", 1), ("s1", 2)], ("c", 0), "s1", False),
        ([("m1", 1), ("m2", 1), ("m3", 1)], ("c", 0), "m3", False),
        ([("s1", 2), ("m1", 1), ("m2", 1)], ("m", 1), "s1", False),
        # nobody below: refused
        ([("m1", 1), ("m2", 1), ("m3", 1)], ("m", 1), None, True),
        ([("c1", 0), ("m1", 1), ("s1", 2)], ("s", 2), None, True),
    ],
)
def test_full_queue_sheds_the_youngest_of_the_lowest_class_below(
    queued: list[tuple[str, int]], arrival: tuple[str, int], shed: str | None, refused: bool
) -> None:
    queue = WaitQueue(QueuePolicy(classes=3), depth=3)
    made = fill(queue, *[(name, klass, None, at) for at, (name, klass) in enumerate(queued)])
    newcomer = Named(arrival[0], arrival[1], None, 10)
    if refused:
        with pytest.raises(QueueFull):
            queue.push(newcomer)
        assert len(queue) == 3
        return
    out = queue.push(newcomer)
    assert out is made[shed]  # type: ignore[index]
    assert out not in queue and newcomer in queue and len(queue) == 3
    queue.check_invariants()


def test_max_starvation_lets_a_lower_class_go_next() -> None:
    queue = WaitQueue(QueuePolicy(classes=2, max_starvation=30.0), depth=10)
    fill(queue, ("batch", 1, None, 0), ("chat1", 0, None, 5), ("chat2", 0, None, 6))
    assert queue.pop(now=20.0).name == "chat1"  # type: ignore[union-attr]
    assert queue.pop(now=30.0).name == "batch"  # type: ignore[union-attr]
    assert queue.pop(now=30.0).name == "chat2"  # type: ignore[union-attr]


def test_strict_without_max_starvation() -> None:
    queue = WaitQueue(QueuePolicy(classes=2), depth=10)
    fill(queue, ("batch", 1, None, 0), ("chat", 0, None, 5))
    assert names(queue, now=1e9) == ["chat", "batch"]


def test_push_front_is_first_in_class_and_tenant_past_limits() -> None:
    queue = WaitQueue(QueuePolicy(classes=2, fair=True, tenant_cap=1), depth=2)
    fill(queue, ("a1", 1, "a", 0), ("b1", 1, "b", 1))
    retry = Named("a0", 1, "a", 2)
    queue.push_front(retry)
    queue.check_invariants()
    assert names(queue) == ["a0", "b1", "a1"]


def test_remove_and_reshape_keep_order() -> None:
    queue = WaitQueue(QueuePolicy(classes=3, fair=True), depth=10)
    made = fill(queue, ("x", 2, "a", 0), ("y", 0, "b", 1), ("z", 1, "a", 2))
    assert queue.remove(made["z"]) and not queue.remove(made["z"])
    queue.reshape(QueuePolicy(), depth=5)
    queue.check_invariants()
    assert names(queue) == ["x", "y"]  # one FIFO again: by arrival


def test_plain_queue_tracks_no_tenants() -> None:
    queue = WaitQueue(QueuePolicy(), depth=10)
    fill(queue, ("a", 0, None, 0))
    assert queue.tenants == 0 and queue.top_tenants(3) == []


# -- properties over any sequence -------------------------------------------------------------

operations = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 2), st.sampled_from("abcd")),
        st.tuples(st.just("pop"), st.integers(0, 0), st.just("")),
        st.tuples(st.just("remove"), st.integers(0, 50), st.just("")),
        st.tuples(st.just("wait"), st.integers(1, 20), st.just("")),
    ),
    max_size=80,
)
policies = st.builds(
    QueuePolicy,
    classes=st.integers(1, 3),
    fair=st.booleans(),
    tenant_cap=st.one_of(st.none(), st.integers(1, 4)),
    max_starvation=st.one_of(st.none(), st.sampled_from([5.0, 15.0])),
)


class Model:
    """What the queue must do, kept the slow and obvious way: who is queued in arrival
    order, and (fair) per class the tenants in the order of their turns."""

    def __init__(self, policy: QueuePolicy, depth: int) -> None:
        self.policy = policy
        self.depth = depth
        self.queue = WaitQueue(policy, depth)
        self.inside: list[Named] = []
        self.turns: dict[int, list[str | None]] = {}

    def gone(self, waiter: Named) -> None:
        self.inside.remove(waiter)
        if not any(w.klass == waiter.klass and w.tenant == waiter.tenant for w in self.inside):
            self.turns[waiter.klass].remove(waiter.tenant)

    def push(self, newcomer: Named) -> None:
        policy, inside = self.policy, self.inside
        before = list(inside)
        try:
            shed = self.queue.push(newcomer)
        except TenantQueueFull:
            assert policy.tenant_cap is not None
            assert sum(1 for w in inside if w.tenant == newcomer.tenant) >= policy.tenant_cap
            return
        except QueueFull:
            assert len(inside) >= self.depth
            assert all(w.klass <= newcomer.klass for w in inside)  # nobody below to shed
            return
        if shed is not None:
            assert len(before) >= self.depth and shed in before
            lowest = max(w.klass for w in before)
            assert shed.klass == lowest > newcomer.klass
            assert shed is [w for w in before if w.klass == lowest][-1]  # the youngest
            self.gone(shed)  # type: ignore[arg-type]
        inside.append(newcomer)
        line = self.turns.setdefault(newcomer.klass, [])
        if newcomer.tenant not in line:
            line.append(newcomer.tenant)

    def pop(self, now: float) -> None:
        policy, inside = self.policy, self.inside
        out = self.queue.pop(now)
        if not inside:
            assert out is None
            return
        assert isinstance(out, Named) and out in inside
        top = min(w.klass for w in inside)
        if out.klass != top:  # only a starving waiter may pass the highest class
            assert policy.max_starvation is not None
            assert now - out.enqueued_at >= policy.max_starvation
        same = [w for w in inside if w.klass == out.klass and w.tenant == out.tenant]
        assert same[0] is out  # FIFO within a class and tenant
        if out.klass == top and not policy.fair:
            assert out is next(w for w in inside if w.klass == top)
        if out.klass == top and policy.fair:  # round-robin: the tenant whose turn it is
            assert out.tenant == self.turns[top][0]
            self.turns[top].append(self.turns[top].pop(0))
        self.gone(out)

    def check(self) -> None:
        """No waiter lost or duplicated; the caps hold."""
        queue, inside = self.queue, self.inside
        queue.check_invariants()
        assert sorted(map(id, queue)) == sorted(map(id, inside))
        assert len(queue) <= self.depth
        if self.policy.tenant_cap is not None:
            for t in "abcd":
                assert sum(1 for w in inside if w.tenant == t) <= self.policy.tenant_cap
        assert queue.tenants <= len(queue)


@settings(max_examples=300, deadline=None)
@given(policy=policies, depth=st.integers(0, 6), ops=operations)
@example(
    QueuePolicy(fair=True), 6, [("push", 0, "a"), ("push", 0, "a"), ("push", 0, "b"), ("pop", 0, ""), ("pop", 0, "")]
)
def test_promises_hold_over_any_sequence(policy: QueuePolicy, depth: int, ops: list[tuple[str, int, str]]) -> None:
    model = Model(policy, depth)
    now = 0.0
    for made, (op, number, tenant_name) in enumerate(ops):
        tenant = tenant_name if policy.fair or policy.tenant_cap is not None else None
        if op == "push":
            model.push(Named(f"w{made}", min(number, policy.classes - 1), tenant, now))
        elif op == "pop":
            model.pop(now)
        elif op == "remove" and model.inside:
            victim = model.inside[number % len(model.inside)]
            assert model.queue.remove(victim)
            model.gone(victim)
        elif op == "wait":
            now += number
        model.check()


def test_the_views_of_several_processes_merge() -> None:
    from activator.core.status import merge_queue_view, queue_view

    queue = WaitQueue(QueuePolicy(classes=2, fair=True), depth=10)
    fill(queue, ("a1", 0, "a", 0), ("a2", 1, "a", 1), ("b1", 1, "b", 4))
    view = queue_view(queue, ["high", "low"], True, [0, 2], now=10.0)
    assert view == {
        "classes": {
            "high": {"queued": 1, "oldest_wait_seconds": 10.0, "shed": 0},
            "low": {"queued": 2, "oldest_wait_seconds": 9.0, "shed": 2},
        },
        "tenants": 2,
        "top_tenants": [{"tenant": "a", "queued": 2}, {"tenant": "b", "queued": 1}],
    }
    into: dict[str, object] = {}
    merge_queue_view(into, view)
    merge_queue_view(
        into, queue_view(WaitQueue(QueuePolicy(classes=2, fair=True)), ["high", "low"], True, [1, 0], 10.0)
    )
    merge_queue_view(into, view)
    assert into["classes"] == {
        "high": {"queued": 2, "oldest_wait_seconds": 10.0, "shed": 1},
        "low": {"queued": 4, "oldest_wait_seconds": 9.0, "shed": 4},
    }
    assert into["top_tenants"] == [{"tenant": "a", "queued": 4}, {"tenant": "b", "queued": 2}]
    assert into["tenants"] == 4

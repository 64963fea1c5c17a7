"""The activator's one queue across workers (``core.slotexchange``), simulated: no sockets.

A fleet of N workers of one activator, each with its shared-mode throttler and its
``WorkerLedger``, and the supervisor's ``SlotExchange``, wired by FIFO channels as the
shell wires them (one socket pair per worker, datagrams in order). Hypothesis drives
arrivals, finishes, give-ups and message deliveries in any interleaving. After every
step:

- no pod runs more requests than its limit (own slots and borrowed ones counted on the
  pod), every throttler's and the exchange's invariants hold;
- whenever no message is in flight: no worker has a free slot while a request of the
  service waits at the exchange (no pod idle while anything waits), and nothing waits
  at the exchange that no worker waits for;

and at the end, once every request finished and every message was delivered, every slot
is free again, nothing is lent, nothing queued, nobody contended. The deterministic
cases pin the rules: FIFO across workers, a grant crossing a cancel, queue_depth for the
activator, a worker's crash.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from builders import svc
from hypothesis import given, settings
from hypothesis import strategies as st

from activator.core import slotexchange as wire
from activator.core import slots as slot_division
from activator.core.config import FairBy, PriorityConfig
from activator.core.slotexchange import (
    Borrowed,
    LedgerEffects,
    QueueIsFull,
    SlotExchange,
    Waiting,
    WasShed,
    WorkerLedger,
)
from activator.core.throttler import Effects, Grant, ServiceThrottler


@dataclass
class Request:
    worker: int
    arrival: float
    slot: Grant | Borrowed | None = None
    waiting: Waiting | None = None
    outcome: str = "new"  # new, running, waiting, done, full, tenant-full, shed, gave-up
    klass: int = 0
    tenant: str | None = None


@dataclass
class Fleet:
    """N workers and the supervisor, connected by FIFO channels."""

    workers: int
    pods: list[str]
    cc: int
    queue_depth: int = 100
    #: With classes (``critical``, ``standard``, ``sheddable``) and tenants (a header).
    classed: bool = False
    exchange: SlotExchange = field(default_factory=SlotExchange)
    clock: float = 0.0

    def __post_init__(self) -> None:
        policy: dict[str, object] = {}
        if self.classed:
            priority = PriorityConfig(("critical", "standard", "sheddable"), "standard", max_starvation=20.0)
            policy = {"priority": priority, "fair_by": FairBy("x-tenant"), "tenant_queue_share": 0.5}
        config = svc(*self.pods, cc=self.cc, probe=None, queue_depth=self.queue_depth, **policy)
        division = slot_division.divide_slots({p: self.cc for p in self.pods}, [str(w) for w in range(self.workers)])
        self.throttlers = [
            ServiceThrottler(config, 0.0, owned=division[str(w)], sharing=True) for w in range(self.workers)
        ]
        self.ledgers = [WorkerLedger(w, first_slot=1000 * (w + 1)) for w in range(self.workers)]
        self.to_hub: list[deque[wire.Request]] = [deque() for _ in range(self.workers)]
        self.to_worker: list[deque[wire.Message]] = [deque() for _ in range(self.workers)]
        self.requests: list[Request] = []
        for w in range(self.workers):
            self.to_hub[w].extend(self.ledgers[w].hello())
        self.served_order: list[float] = []
        self.served: list[Request] = []  # the requests that waited, in the order they got a slot

    # -- the shell's part, as sharing.py does it --------------------------------------

    def services(self, w: int) -> dict[str, ServiceThrottler]:
        return {"api": self.throttlers[w]}

    def act(self, w: int, effects: Effects) -> None:
        assert not effects.woken, "shared mode never queues in a worker"
        for throttler, grant in effects.lent:
            self.take(w, self.ledgers[w].offer(throttler, grant))

    def take(self, w: int, out: LedgerEffects) -> None:
        """What a ledger call asks of the shell: messages out, effects, requests woken
        (each keeps its outcome: a slot, or a full queue)."""
        ledger = self.ledgers[w]
        self.to_hub[w].extend(out.send)
        assert not out.failures
        self.act(w, out.effects)
        for waiting in out.woken:
            request: Request = waiting.token
            keep = ledger.leave(waiting, self.services(w), True, self.clock)
            self.to_hub[w].extend(keep.send)
            self.act(w, keep.effects)
            request.waiting = None
            if isinstance(waiting.outcome, QueueIsFull):
                request.outcome = "full" if waiting.outcome.reason == "queue-full" else "tenant-full"
            elif isinstance(waiting.outcome, WasShed):
                request.outcome = "shed"
            else:
                assert isinstance(waiting.outcome, Grant | Borrowed), waiting.outcome
                request.slot, request.outcome = waiting.outcome, "running"
                self.served_order.append(request.arrival)
                self.served.append(request)

    def arrive(self, w: int, klass: int = 0, tenant: str | None = None) -> Request:
        self.clock += 1
        request = Request(w, self.clock, klass=klass, tenant=tenant)
        self.requests.append(request)
        grant = self.throttlers[w].acquire_here()
        if grant is not None:
            request.slot, request.outcome = grant, "running"
        else:
            waiting, messages = self.ledgers[w].enqueue(self.throttlers[w], request.arrival, klass, tenant)
            waiting.token = request
            request.waiting, request.outcome = waiting, "waiting"
            self.to_hub[w].extend(messages)
        return request

    def finish(self, request: Request) -> None:
        w, slot = request.worker, request.slot
        assert request.outcome == "running" and slot is not None
        request.slot, request.outcome = None, "done"
        if isinstance(slot, Grant):
            self.act(w, self.throttlers[w].release(slot, self.clock))
        else:
            self.take(w, self.ledgers[w].borrowed_done(self.throttlers[w], slot, False, None))

    def give_up(self, request: Request) -> None:
        w = request.worker
        assert request.waiting is not None
        out = self.ledgers[w].leave(request.waiting, self.services(w), False, self.clock)
        self.to_hub[w].extend(out.send)
        self.act(w, out.effects)
        request.waiting, request.outcome = None, "gave-up"

    def deliver_to_hub(self, w: int) -> None:
        message = self.to_hub[w].popleft()
        for recipient, answer in self.exchange.receive(message, self.clock):
            targets = range(self.workers) if recipient is None else [recipient]
            for target in targets:
                self.to_worker[target].append(answer)

    def deliver_to_worker(self, w: int) -> None:
        message = self.to_worker[w].popleft()
        self.take(w, self.ledgers[w].receive(message, self.services(w), self.clock))

    # -- what must hold ------------------------------------------------------------

    def in_transit(self) -> bool:
        return any(self.to_hub) or any(self.to_worker)

    def running_on(self, pod: str) -> int:
        n = 0
        for request in self.requests:
            slot = request.slot
            if request.outcome == "running" and slot is not None:
                n += (slot.pod.address if isinstance(slot, Grant) else slot.pod) == pod
        return n

    def check(self) -> None:
        for pod in self.pods:
            assert self.running_on(pod) <= self.cc, (pod, self.running_on(pod))
        for throttler in self.throttlers:
            throttler.check_invariants()
        self.exchange.check_invariants()
        if not self.in_transit():
            waiting = sum(r.outcome == "waiting" for r in self.requests)
            assert self.exchange.queued("api") == waiting
            if waiting:
                for throttler in self.throttlers:
                    assert len(throttler.policy) == 0, "a free slot while a request waits"
                    assert throttler.contended

    def drain(self) -> None:
        """Deliver everything, finish everything, until nothing is left to do."""
        for _ in range(10_000):
            if self.in_transit():
                for w in range(self.workers):
                    while self.to_hub[w]:
                        self.deliver_to_hub(w)
                        self.check()
                    while self.to_worker[w]:
                        self.deliver_to_worker(w)
                        self.check()
                continue
            running = [r for r in self.requests if r.outcome == "running"]
            if not running:
                return
            self.finish(running[0])
            self.check()
        raise AssertionError("the fleet never settled")

    def check_settled(self) -> None:
        assert not any(r.outcome in ("running", "waiting") for r in self.requests)
        for throttler in self.throttlers:
            assert throttler.in_flight == 0 and not throttler.contended and throttler.borrowed == 0
        for ledger in self.ledgers:
            assert not ledger.lent and not ledger.waiting and not ledger.contended
        assert self.exchange.queued("api") == 0 and self.exchange.lent() == 0


PODS = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]

steps = st.lists(
    st.tuples(st.sampled_from(["arrive", "finish", "give-up", "to-hub", "to-worker"]), st.integers(0, 50)),
    max_size=150,
)


def play(fleet: Fleet, workers: int, script: Any) -> None:
    """Run ``script``'s steps on ``fleet``, checking it after each, then drain it: each step
    is (action, pick, *what an arrival carries)."""
    fleet.check()
    for action, pick, *arrival in script:
        if action == "arrive":
            fleet.arrive(pick % workers, *arrival)
        elif action == "finish":
            running = [r for r in fleet.requests if r.outcome == "running"]
            if running:
                fleet.finish(running[pick % len(running)])
        elif action == "give-up":
            waiting = [r for r in fleet.requests if r.outcome == "waiting"]
            if waiting:
                fleet.give_up(waiting[pick % len(waiting)])
        else:
            queues = fleet.to_hub if action == "to-hub" else fleet.to_worker
            busy = [w for w in range(workers) if queues[w]]
            if busy:
                w = busy[pick % len(busy)]
                (fleet.deliver_to_hub if action == "to-hub" else fleet.deliver_to_worker)(w)
        fleet.check()
    fleet.drain()
    fleet.check_settled()


@settings(max_examples=300, deadline=None)
@given(
    workers=st.integers(2, 3),
    n_pods=st.integers(1, 3),
    cc=st.integers(1, 2),
    queue_depth=st.integers(1, 6),
    script=steps,
)
def test_any_interleaving_keeps_limits_and_serves_everyone(
    workers: int, n_pods: int, cc: int, queue_depth: int, script: list[tuple[str, int]]
) -> None:
    play(Fleet(workers, PODS[:n_pods], cc, queue_depth), workers, script)


def settle(fleet: Fleet) -> None:
    """Deliver every message in flight (finishing nothing)."""
    while fleet.in_transit():
        for w in range(fleet.workers):
            while fleet.to_hub[w]:
                fleet.deliver_to_hub(w)
            while fleet.to_worker[w]:
                fleet.deliver_to_worker(w)
        fleet.check()


def test_requests_are_served_in_arrival_order_whichever_worker_they_came_to() -> None:
    fleet = Fleet(2, PODS[:2], 1)  # one cc=1 pod per worker
    settle(fleet)
    first = [fleet.arrive(0), fleet.arrive(1)]
    assert [r.outcome for r in first] == ["running", "running"]
    queued = [fleet.arrive(w) for w in (0, 0, 1, 0, 1, 1)]
    settle(fleet)
    assert fleet.exchange.queued("api") == 6
    # Slots free in both workers, in any order: the queue is served oldest first.
    for running in (first[1], first[0]):
        fleet.finish(running)
        settle(fleet)
    while any(r.outcome == "waiting" for r in queued):
        fleet.finish(next(r for r in fleet.requests if r.outcome == "running"))
        settle(fleet)
    assert fleet.served_order == sorted(fleet.served_order)
    assert fleet.served_order == [r.arrival for r in queued]
    fleet.drain()
    fleet.check_settled()


def test_a_slot_goes_straight_to_its_workers_first_in_line_when_nobody_older_waits_elsewhere() -> None:
    fleet = Fleet(2, PODS[:2], 1)  # one cc=1 pod per worker
    settle(fleet)
    busy = [fleet.arrive(0), fleet.arrive(1)]
    assert [r.outcome for r in busy] == ["running", "running"]
    mine, theirs, mine_later = fleet.arrive(0), fleet.arrive(1), fleet.arrive(0)
    settle(fleet)
    assert fleet.ledgers[0].others_oldest == {"api": theirs.arrival}
    assert fleet.ledgers[1].others_oldest == {"api": mine.arrival}

    # Worker 0's slot frees: its own waiter arrived first, so it runs on it at once, with
    # nothing sent but the cancel that takes it out of the one queue.
    assert mine.waiting is not None
    request_id = mine.waiting.request
    fleet.finish(busy[0])
    assert mine.outcome == "running" and isinstance(mine.slot, Grant)
    assert list(fleet.to_hub[0]) == [wire.Cancel(0, "api", request_id)]
    settle(fleet)
    assert fleet.exchange.queued("api") == 2
    assert fleet.ledgers[0].others_oldest == {"api": theirs.arrival}

    # Worker 0's slot frees again: worker 1's waiter is older than worker 0's next one,
    # so the slot is offered, and lent across.
    fleet.finish(mine)
    assert mine_later.outcome == "waiting"
    assert [type(m) for m in fleet.to_hub[0]] == [wire.Offer]
    settle(fleet)
    assert theirs.outcome == "running" and isinstance(theirs.slot, Borrowed)
    fleet.drain()
    assert fleet.served_order == sorted(fleet.served_order)
    fleet.check_settled()


def test_each_worker_with_waiters_hears_the_oldest_arrival_of_the_others() -> None:
    exchange = SlotExchange()

    def told(out: list[tuple[int | None, wire.Message]]) -> dict[int, float | None]:
        return {m.worker: m.arrival for _, m in out if isinstance(m, wire.Oldest)}

    assert told(exchange.receive(wire.Enqueue(0, "api", 1, 1.0, 10))) == {0: None}
    assert told(exchange.receive(wire.Enqueue(1, "api", 1, 2.0, 10))) == {0: 2.0, 1: 1.0}
    assert told(exchange.receive(wire.Enqueue(2, "api", 1, 3.0, 10))) == {2: 1.0}  # (0 and 1: unchanged)
    assert told(exchange.receive(wire.Enqueue(0, "api", 2, 4.0, 10))) == {}  # not a worker's oldest
    # Worker 0's oldest is served (its next arrived at 4.0): worker 1 now hears worker 2's,
    # worker 2 worker 1's; worker 0's others are unchanged.
    lend = exchange.receive(wire.Offer("api", 1, 7, "10.0.0.1:80"))
    assert lend[0] == (0, wire.Lend(0, 1, "api", 1, 7, "10.0.0.1:80"))
    assert told(lend) == {1: 3.0, 2: 2.0}
    # Worker 1's only waiter leaves: worker 1 is told nothing more, the others hear anew.
    assert told(exchange.receive(wire.Cancel(1, "api", 1))) == {0: 3.0, 2: 4.0}


def test_a_worker_owning_no_slot_is_served_on_a_siblings() -> None:
    fleet = Fleet(2, PODS[:1], 1)  # the one slot belongs to one worker
    settle(fleet)
    owner = next(w for w in range(2) if fleet.throttlers[w].capacity)
    other = 1 - owner
    request = fleet.arrive(other)
    assert request.outcome == "waiting"
    settle(fleet)
    assert request.outcome == "running" and isinstance(request.slot, Borrowed)
    assert request.slot.owner == owner and fleet.throttlers[owner].in_flight == 1
    assert fleet.throttlers[other].borrowed == 1
    fleet.drain()
    fleet.check_settled()


def test_a_grant_that_crosses_a_cancel_goes_to_the_next_waiter() -> None:
    fleet = Fleet(2, PODS[:1], 1)
    settle(fleet)
    owner = next(w for w in range(2) if fleet.throttlers[w].capacity)
    busy = fleet.arrive(owner)
    assert busy.outcome == "running"
    leaving, staying = fleet.arrive(1 - owner), fleet.arrive(1 - owner)
    settle(fleet)
    fleet.finish(busy)
    for _ in range(3):  # the owner's offer reaches the exchange, which lends it to `leaving`
        for w in range(2):
            while fleet.to_hub[w]:
                fleet.deliver_to_hub(w)
    fleet.give_up(leaving)  # ... while `leaving` gives up: the Lend is on its way
    settle(fleet)
    assert leaving.outcome == "gave-up" and staying.outcome == "running"
    fleet.drain()
    fleet.check_settled()


def test_queue_depth_bounds_the_activators_queue_not_a_workers() -> None:
    fleet = Fleet(2, PODS[:2], 1, queue_depth=3)
    settle(fleet)
    running = [fleet.arrive(0), fleet.arrive(1)]
    assert all(r.outcome == "running" for r in running)
    queued = [fleet.arrive(w) for w in (0, 1, 0, 1, 0)]
    settle(fleet)
    # (whichever reached the exchange first got in: here worker 0's messages go first)
    assert sorted(r.outcome for r in queued) == ["full"] * 2 + ["waiting"] * 3
    fleet.drain()
    fleet.check_settled()


def test_a_crashed_worker_takes_its_waiters_and_its_borrowed_slots_go_home() -> None:
    exchange = SlotExchange()
    assert exchange.receive(wire.Enqueue(1, "api", 1, 1.0, 10)) == [
        (None, wire.Contended("api", True)),
        (1, wire.Oldest(1, "api", None)),  # nobody else waits
    ]
    exchange.receive(wire.Enqueue(1, "api", 2, 2.0, 10))
    lend = exchange.receive(wire.Offer("api", 0, 7, "10.0.0.1:80"))
    assert lend[0] == (1, wire.Lend(1, 1, "api", 0, 7, "10.0.0.1:80"))
    # worker 1 dies: its second waiter leaves the queue, the slot it borrowed goes home
    out = exchange.forget_worker(1)
    assert wire.Contended("api", False) in out and wire.Decline(0, "api", 7) in out
    assert exchange.queued("api") == 0 and exchange.lent() == 0


def test_a_restarted_owner_is_told_which_of_its_slots_are_still_lent() -> None:
    exchange = SlotExchange()
    exchange.receive(wire.Enqueue(1, "api", 1, 1.0, 10))
    exchange.receive(wire.Offer("api", 0, 7, "10.0.0.1:80"))  # lent to worker 1
    # worker 0 restarts: it must not use slot 7 until worker 1 is done with it
    hello = exchange.receive(wire.Hello(0))
    assert (0, wire.Reserved("api", 7, "10.0.0.1:80")) in hello
    throttler = ServiceThrottler(svc("10.0.0.1:80", cc=1, probe=None), 0.0, owned={"10.0.0.1:80": 1}, sharing=True)
    ledger = WorkerLedger(0)
    ledger.receive(wire.Reserved("api", 7, "10.0.0.1:80"), {"api": throttler}, 1.0)
    assert throttler.capacity == 1 and throttler.acquire_here() is None  # held for its borrower
    back = exchange.receive(wire.Offer("api", 0, 7, "10.0.0.1:80"))  # the borrower is done
    assert back == [(0, wire.Decline(0, "api", 7))]
    ledger.receive(back[0][1], {"api": throttler}, 2.0)
    assert throttler.acquire_here() is not None


def test_messages_survive_the_wire() -> None:
    messages = [
        wire.Lend(1, 2, "api", 0, 7, "10.0.0.1:80"),
        wire.Decline(0, "api", 7, "connect"),
        wire.Full(1, 3),
        wire.Full(1, 3, "tenant-queue-full"),
        wire.Shed(1, 4),
        wire.Enqueue(1, "api", 4, 12.5, 100, 2, "key", [3, True, 50, None]),
        wire.Contended("api", True),
        wire.Reserved("api", 7, "10.0.0.1:80"),
        wire.Oldest(1, "api", 12.5),
        wire.Oldest(0, "api", None),
        wire.Hello(2),
        wire.Enqueue(1, "api", 3, 12.5, 100),
        wire.Cancel(1, "api", 3),
        wire.Offer("api", 0, 7, "10.0.0.1:80", None),
    ]
    for message in messages:
        assert wire.decode(wire.encode(message)) == message


# -- classes and tenants across workers -------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    workers=st.integers(2, 3),
    n_pods=st.integers(1, 2),
    queue_depth=st.integers(1, 6),
    script=st.lists(
        st.tuples(
            st.sampled_from(["arrive", "finish", "give-up", "to-hub", "to-worker"]),
            st.integers(0, 50),
            st.integers(0, 2),
            st.sampled_from("ab"),
        ),
        max_size=150,
    ),
)
def test_a_classed_queue_across_workers_keeps_limits_and_serves_everyone(
    workers: int, n_pods: int, queue_depth: int, script: list[tuple[str, int, int, str]]
) -> None:
    play(Fleet(workers, PODS[:n_pods], 1, queue_depth, classed=True), workers, script)


def test_across_workers_the_highest_class_goes_first_and_tenants_take_turns() -> None:
    fleet = Fleet(2, PODS[:1], 1, queue_depth=10, classed=True)  # one slot, owned by one worker
    settle(fleet)
    busy = fleet.arrive(next(w for w in range(2) if fleet.throttlers[w].capacity))
    assert busy.outcome == "running"
    settle(fleet)
    waiting = [
        fleet.arrive(0, 2, "a"),
        fleet.arrive(1, 2, "a"),
        fleet.arrive(0, 2, "b"),
        fleet.arrive(1, 0, "a"),
    ]
    settle(fleet)
    fleet.finish(busy)
    settle(fleet)
    while any(r.outcome == "waiting" for r in fleet.requests):
        fleet.finish(next(r for r in fleet.requests if r.outcome == "running"))
        settle(fleet)
    assert fleet.served == [waiting[3], waiting[0], waiting[2], waiting[1]]
    order = [(r.klass, r.tenant) for r in fleet.served]
    assert order == [(0, "a"), (2, "a"), (2, "b"), (2, "a")]
    fleet.drain()
    fleet.check_settled()


def test_across_workers_a_full_queue_sheds_another_workers_waiter_and_a_tenant_is_capped() -> None:
    fleet = Fleet(2, PODS[:1], 1, queue_depth=2, classed=True)  # tenant cap: 1
    settle(fleet)
    busy = fleet.arrive(next(w for w in range(2) if fleet.throttlers[w].capacity))
    assert busy.outcome == "running"
    low = fleet.arrive(0, 2, "a")
    settle(fleet)
    capped = fleet.arrive(1, 1, "a")
    settle(fleet)
    assert capped.outcome == "tenant-full"
    other = fleet.arrive(1, 2, "b")
    settle(fleet)
    urgent = fleet.arrive(1, 0, "c")
    settle(fleet)
    assert (other.outcome, low.outcome, urgent.outcome) == ("shed", "waiting", "waiting")
    full = fleet.arrive(0, 2, "d")
    settle(fleet)
    assert full.outcome == "full"
    fleet.finish(busy)
    settle(fleet)
    assert urgent.outcome == "running"
    fleet.drain()
    fleet.check_settled()

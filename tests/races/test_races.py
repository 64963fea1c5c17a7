"""Races (DESIGN.md tier 2): greenlets through ``activator.gate``, interleaved with
topology changes by ``gevent.sleep(0)`` / ``gevent.idle()`` steps only.

Ordering never depends on the wall clock; a wall-clock timeout only bounds a test so
that a bug shows as a failure, not a hang. The fake work records how many requests
each pod runs at once, as a real backend would, and every test ends with every count
back to zero and ``check_invariants()`` holding.
"""

import random
import time
from collections import Counter
from dataclasses import replace
from typing import Any, Callable

import gevent
import pytest
from gevent.event import Event

import socket

from activator import gate, hangup
from builders import pod, svc

from activator.core.config import Config, ProbeConfig
from activator.core.errors import ClientGone, QueueFull, QueueTimeout
from activator.core.states import PodState
from activator.core.throttler import Grant, ServiceThrottler
from activator.core.topology import Topology

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
BOUND = 10.0  # seconds: only to turn a hang into a failure


def now() -> float:
    return time.monotonic()


LIVE: list["Request"] = []  # this test's requests, to surface their errors early


@pytest.fixture(autouse=True)
def _fresh_requests() -> Any:
    LIVE.clear()
    yield
    for r in LIVE:
        r.greenlet.kill()
    LIVE.clear()


def settle(rounds: int = 3) -> None:
    """Let every runnable greenlet run until it blocks (no wall-clock sleeping)."""
    for _ in range(rounds):
        gevent.idle()
        gevent.sleep(0)
    for r in LIVE:
        if r.greenlet.dead and r.greenlet.exception is not None:
            raise r.greenlet.exception


class Pods:
    """The fake backends: per-pod concurrency as the pods themselves would see it."""

    def __init__(self) -> None:
        self.running: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self.served: list[tuple[str, int]] = []  # (pod, request id) in start order

    def start(self, address: str, rid: int) -> None:
        self.running[address] += 1
        self.peak[address] = max(self.peak[address], self.running[address])
        self.served.append((address, rid))

    def stop(self, address: str) -> None:
        self.running[address] -= 1
        assert self.running[address] >= 0


class Request:
    """One client request: acquire through the gate, run on the pod, release exactly once."""

    def __init__(
        self,
        throttler: ServiceThrottler,
        pods: Pods,
        rid: int,
        *,
        hold: Event | None = None,
        steps: int = 0,
        timeout: float = BOUND,
        on_start: Callable[[Grant], None] | None = None,
        client_socket: Any = None,
    ) -> None:
        self.client_socket = client_socket
        self.throttler = throttler
        self.pods = pods
        self.rid = rid
        self.hold = hold
        self.steps = steps
        self.timeout = timeout
        self.on_start = on_start
        self.grant: Grant | None = None
        self.outcome: str = "new"
        self.greenlet = gevent.spawn(self.run)
        LIVE.append(self)

    def run(self) -> None:
        self.outcome = "waiting"
        try:
            grant = gate.acquire(self.throttler, self.timeout, self.client_socket)
        except (QueueFull, QueueTimeout, ClientGone) as e:
            self.outcome = type(e).__name__
            return
        if grant.queued and self.client_socket is not None and hangup.hung_up(self.client_socket):
            # As the proxy does before sending a request that waited.
            self.throttler.release(grant, now())
            self.outcome = "ClientGone"
            return
        self.grant = grant
        address = grant.pod.address
        self.pods.start(address, self.rid)
        if self.on_start is not None:
            self.on_start(grant)
        self.outcome = "running"
        try:
            if self.hold is not None:
                self.hold.wait()
            for _ in range(self.steps):
                gevent.sleep(0)
        finally:
            self.pods.stop(address)
            self.throttler.release(grant, now())
            self.outcome = "done"


def finish(requests: list[Request]) -> None:
    gevent.joinall([r.greenlet for r in requests], timeout=BOUND)
    stuck = [r.rid for r in requests if not r.greenlet.dead]
    assert not stuck, f"requests {stuck} never finished"
    for r in requests:
        if r.greenlet.exception is not None:
            raise r.greenlet.exception


def assert_all_zero(throttler: ServiceThrottler) -> None:
    throttler.check_invariants()
    assert throttler.in_flight == 0
    assert throttler.queued == 0
    assert all(t.in_flight == 0 for t in throttler.trackers.values())


# -- drain while requests are in flight -----------------------------------------


def test_drain_while_requests_in_flight() -> None:
    t = ServiceThrottler(svc(A, B, cc=1), now())
    pods = Pods()
    holds = [Event() for _ in range(4)]
    drained = False
    after_drain_on_a: list[int] = []

    def watch(grant: Grant) -> None:
        if drained and grant.pod.address == A:
            after_drain_on_a.append(1)

    reqs = [Request(t, pods, i, hold=holds[i], on_start=watch) for i in range(4)]
    settle()
    assert sorted(r.grant.pod.address for r in reqs[:2] if r.grant) == [A, B]
    assert t.queued == 2

    t.apply(svc(pod(A, drain=True), B, cc=1), now())
    drained = True
    assert t.trackers[A].state is PodState.DRAINING
    holds[0].set()  # A's request finishes: A is removed, its slot goes to nobody
    settle()
    assert t.trackers[A].state is PodState.REMOVED
    assert t.queued == 2
    holds[1].set()  # B frees: the oldest waiter gets B
    settle()
    assert reqs[2].grant is not None and reqs[2].grant.pod.address == B
    holds[2].set()
    holds[3].set()
    finish(reqs)
    assert after_drain_on_a == []
    assert pods.peak[A] == 1 and pods.peak[B] == 1
    assert [rid for _, rid in pods.served] == [0, 1, 2, 3]  # FIFO
    assert_all_zero(t)


# -- unlist and re-list a busy pod (the seed bug) -----------------------------------


def test_SEED_BUG_unlist_and_relist_busy_pod_never_exceeds_cc() -> None:
    t = ServiceThrottler(svc(A, cc=1), now())
    pods = Pods()
    hold = Event()
    first = Request(t, pods, 0, hold=hold)
    settle()
    assert first.outcome == "running"

    t.apply(svc(cc=1), now())  # unlisted while busy
    settle()
    t.apply(svc(A, cc=1), now())  # listed again
    second = Request(t, pods, 1, steps=3)
    settle()
    assert second.outcome == "waiting", "the re-listed busy pod was sent a second request"
    assert t.trackers[A].in_flight == 1

    hold.set()
    finish([first, second])
    assert pods.peak[A] == 1
    assert_all_zero(t)


@pytest.mark.parametrize("seed", range(5))
def test_listing_flaps_under_load_never_exceed_cc(seed: int) -> None:
    """Many requests doing sleep(0) steps while one writer flaps listing, drain and probes."""
    rng = random.Random(seed)
    cc = 2
    probe = ProbeConfig(healthy_after=1, unhealthy_after=1)
    base = Config(path="races.yaml", services={"api": svc(A, B, C, cc=cc, probe=probe, queue_depth=1000)})
    topo = Topology(base, now(), rng=random.Random(seed))
    t = topo.route("api.example.com")
    for address in (A, B, C):
        t.probe_result(address, True, now())
    pods = Pods()
    over: list[str] = []

    def check(grant: Grant) -> None:
        for tracker in t.trackers.values():
            if tracker.in_flight > cc:
                over.append(f"{tracker.address}: {tracker.in_flight}")
        if pods.running[grant.pod.address] > cc:
            over.append(f"{grant.pod.address} runs {pods.running[grant.pod.address]}")

    reqs: list[Request] = []

    def clients() -> None:
        for i in range(120):
            reqs.append(Request(t, pods, i, steps=rng.randint(0, 6), on_start=check))
            for _ in range(rng.randint(0, 2)):
                gevent.sleep(0)

    def writer() -> None:
        for _ in range(60):
            listed = [a for a in (A, B, C) if rng.random() < 0.7]
            pods_cfg = [pod(a, drain=rng.random() < 0.2) for a in listed]
            topo.apply(replace(base, services={"api": svc(*pods_cfg, cc=cc, probe=probe, queue_depth=1000)}), now())
            for address in listed:
                t.probe_result(address, rng.random() < 0.8, now())
            topo.check_invariants()
            for _ in range(rng.randint(0, 3)):
                gevent.sleep(0)
        # Back to everything listed and healthy, so that every request can finish.
        topo.apply(base, now())
        for address in (A, B, C):
            t.probe_result(address, True, now())

    producers = [gevent.spawn(clients), gevent.spawn(writer)]
    gevent.joinall(producers, timeout=BOUND, raise_error=True)
    finish(reqs)
    assert over == []
    assert max(pods.peak.values()) <= cc
    assert all(r.outcome == "done" for r in reqs)
    assert_all_zero(t)
    assert topo.route("api.example.com") is t


# -- shrink capacity below in-flight ------------------------------------------------


def test_shrink_capacity_below_in_flight() -> None:
    t = ServiceThrottler(svc(A, cc=3), now())
    pods = Pods()
    holds = [Event() for _ in range(5)]
    reqs = [Request(t, pods, i, hold=holds[i]) for i in range(3)]
    settle()
    assert pods.running[A] == 3

    t.apply(svc(A, cc=1), now())
    reqs += [Request(t, pods, i, hold=holds[i]) for i in (3, 4)]
    settle()
    assert t.queued == 2
    for i in (0, 1, 2):  # 3 -> 2 -> 1 -> 0 in flight: only at 0 does one more start
        assert [r.outcome for r in reqs[3:]] == ["waiting", "waiting"]
        holds[i].set()
        settle()
    assert [r.outcome for r in reqs[3:]] == ["running", "waiting"]
    assert pods.running[A] == 1
    holds[3].set()
    settle()
    assert reqs[4].outcome == "running" and pods.running[A] == 1
    holds[4].set()
    finish(reqs)
    assert_all_zero(t)


# -- a queued waiter's greenlet killed (the client went away) ---------------------


def test_killed_waiter_leaves_the_queue() -> None:
    t = ServiceThrottler(svc(A, cc=1), now())
    pods = Pods()
    hold = Event()
    holder = Request(t, pods, 0, hold=hold)
    waiter = Request(t, pods, 1)
    settle()
    assert t.queued == 1
    gevent.kill(waiter.greenlet)  # asynchronous, as when the client goes away
    waiter.greenlet.join(timeout=BOUND)
    assert waiter.greenlet.dead and t.queued == 0
    t.check_invariants()
    hold.set()
    finish([holder])
    assert pods.served == [(A, 0)]
    assert_all_zero(t)


def test_killed_waiter_releases_a_grant_that_arrived_in_the_same_tick() -> None:
    """The kill is already on its way when the slot is handed over: the greenlet wakes
    with GreenletExit inside the wait while holding a grant, and must give it back."""
    t = ServiceThrottler(svc(A, cc=1), now())
    pods = Pods()
    held = t.acquire(now(), lambda: None)
    assert isinstance(held, Grant)
    waiter = Request(t, pods, 1)
    settle()
    assert waiter.outcome == "waiting" and t.queued == 1

    gevent.kill(waiter.greenlet)  # asynchronous: the GreenletExit is scheduled first...
    t.release(held, now())  # ...then, in the same tick, the slot is handed to it
    assert t.queued == 0 and t.in_flight == 1 and t.trackers[A].in_flight == 1

    waiter.greenlet.join(timeout=BOUND)
    assert waiter.greenlet.dead
    # It died in the wait (never ran on the pod), holding a grant it gave back.
    assert isinstance(waiter.greenlet.value, gevent.GreenletExit)
    assert waiter.grant is None and pods.served == []  # never ran
    assert_all_zero(t)
    # The slot really is free again.
    again = t.acquire(now(), lambda: None)
    assert isinstance(again, Grant)
    t.release(again, now())


def test_killed_running_request_releases_exactly_once() -> None:
    t = ServiceThrottler(svc(A, cc=1), now())
    pods = Pods()
    running = Request(t, pods, 0, hold=Event())
    queued = Request(t, pods, 1, steps=2)
    settle()
    gevent.kill(running.greenlet)  # client gone mid-response
    finish([queued])
    assert pods.served == [(A, 0), (A, 1)]
    assert_all_zero(t)


# -- the client hangs up while queued ---------------------------------------------


def until(condition: Callable[[], bool]) -> None:
    """Let the hub turn (poll sockets included) until ``condition`` holds, within a bound."""
    for _ in range(1000):
        if condition():
            return
        gevent.idle()
    raise AssertionError("condition never held")


def test_client_gone_while_queued_leaves_the_queue() -> None:
    ours, theirs = socket.socketpair()
    try:
        t = ServiceThrottler(svc(A, cc=1), now())
        pods = Pods()
        hold = Event()
        holder = Request(t, pods, 0, hold=hold)
        waiter = Request(t, pods, 1, client_socket=ours)
        settle()
        assert t.queued == 1 and hangup.monitor().watching == 1
        theirs.shutdown(socket.SHUT_WR)  # the client's FIN, nothing else
        until(lambda: waiter.outcome == "ClientGone")
        assert t.queued == 0 and hangup.monitor().watching == 0
        hold.set()
        finish([holder, waiter])
        assert pods.served == [(A, 0)]
        assert_all_zero(t)
    finally:
        ours.close()
        theirs.close()


def test_client_gone_in_the_same_tick_as_its_grant_releases_it() -> None:
    ours, theirs = socket.socketpair()
    try:
        t = ServiceThrottler(svc(A, cc=1), now())
        pods = Pods()
        held = t.acquire(now(), lambda: None)
        assert isinstance(held, Grant)
        waiter = Request(t, pods, 1, client_socket=ours)
        settle()
        theirs.close()  # the client hangs up...
        t.release(held, now())  # ...and its slot arrives, before the hub noticed the hang-up
        assert t.in_flight == 1 and t.queued == 0
        finish([waiter])
        assert waiter.outcome == "ClientGone" and pods.served == []  # never sent to the pod
        assert_all_zero(t)
    finally:
        ours.close()


def test_client_gone_with_unread_bytes_is_seen() -> None:
    """A pipelined request (or a body) waiting unread does not hide the hang-up."""
    ours, theirs = socket.socketpair()
    try:
        t = ServiceThrottler(svc(A, cc=1), now())
        pods = Pods()
        held = t.acquire(now(), lambda: None)
        assert isinstance(held, Grant)
        waiter = Request(t, pods, 1, client_socket=ours)
        settle()
        theirs.sendall(b"GET /next HTTP/1.1\r\n\r\n")
        theirs.shutdown(socket.SHUT_WR)
        until(lambda: waiter.outcome == "ClientGone")
        t.release(held, now())
        assert_all_zero(t)
    finally:
        ours.close()
        theirs.close()


def test_client_hangs_up_on_a_real_socket() -> None:
    ours, theirs = socket.socketpair()
    try:
        t = ServiceThrottler(svc(A, cc=1), now())
        pods = Pods()
        held = t.acquire(now(), lambda: None)
        assert isinstance(held, Grant)
        waiter = Request(t, pods, 1, client_socket=ours)
        settle()
        assert t.queued == 1
        theirs.close()
        waiter.greenlet.join(timeout=BOUND)
        assert waiter.outcome == "ClientGone" and t.queued == 0
        t.release(held, now())
        assert_all_zero(t)
    finally:
        ours.close()
        theirs.close()


# -- timeouts ------------------------------------------------------------------------


def test_queue_timeout_raises_and_leaves_the_queue() -> None:
    t = ServiceThrottler(svc(A, cc=1), now())
    held = t.acquire(now(), lambda: None)
    assert isinstance(held, Grant)
    with pytest.raises(QueueTimeout):
        gate.acquire(t, 0.05)
    assert t.queued == 0
    t.release(held, now())
    assert_all_zero(t)


def test_queue_full_through_the_gate() -> None:
    t = ServiceThrottler(svc(A, cc=1, queue_depth=0), now())
    held = gate.acquire(t, BOUND)
    with pytest.raises(QueueFull):
        gate.acquire(t, BOUND)
    t.release(held, now())
    assert_all_zero(t)


def test_one_of_two_times_out_the_other_is_served() -> None:
    # Knative TestThrottlerErrorOneTimesOut: cc=1, one pod, two requests.
    t = ServiceThrottler(svc(A, cc=1), now())
    pods = Pods()
    hold = Event()
    first = Request(t, pods, 0, hold=hold)
    second = Request(t, pods, 1, timeout=0.05)
    second.greenlet.join(timeout=BOUND)
    assert second.outcome == "QueueTimeout"
    hold.set()
    finish([first, second])
    assert_all_zero(t)


# -- retry after a connect failure ---------------------------------------------------


def test_acquire_retry_releases_the_failed_grant() -> None:
    t = ServiceThrottler(svc(A, B, cc=1), now())
    failed = gate.acquire(t, BOUND)
    assert failed.pod.address == A
    retry = gate.acquire_retry(t, failed, BOUND)
    assert retry.pod.address == B
    assert failed.released and t.trackers[A].in_flight == 0
    t.release(retry, now())
    assert_all_zero(t)


def test_acquire_retry_waits_at_the_head_and_releases_the_failed_grant() -> None:
    t = ServiceThrottler(svc(A, cc=1), now())
    pods = Pods()
    failed = gate.acquire(t, BOUND)
    older = Request(t, pods, 1)  # already waiting
    settle()
    retry = gate.acquire_retry(t, failed, BOUND)  # no other pod: waits at the head
    assert failed.released and retry.pod.address == A
    assert older.outcome == "waiting"
    t.release(retry, now())
    finish([older])
    assert_all_zero(t)


def test_acquire_retry_timeout_still_releases_the_failed_grant() -> None:
    # The failed pod was unlisted meanwhile and the other is busy: the retry waits,
    # times out, and the failed grant is released all the same.
    t = ServiceThrottler(svc(A, B, cc=1), now())
    failed = gate.acquire(t, BOUND)
    other = gate.acquire(t, BOUND)
    assert failed.pod.address == A
    t.apply(svc(B, cc=1), now())
    with pytest.raises(QueueTimeout):
        gate.acquire_retry(t, failed, 0.05)
    assert failed.released and A not in t.trackers
    assert t.queued == 0
    t.release(other, now())
    assert_all_zero(t)


def test_killed_retry_hands_its_slot_to_the_next_waiter() -> None:
    t = ServiceThrottler(svc(A, B, cc=1), now())
    failed = gate.acquire(t, BOUND)
    other = gate.acquire(t, BOUND)
    third = t.acquire(now(), lambda: None)  # both pods busy: it waits
    assert not isinstance(third, Grant)

    result: list[Any] = []

    def retrying() -> None:
        # A's freed slot goes to the retry at the head, so it is granted at once:
        # hold it until killed.
        grant = gate.acquire_retry(t, failed, BOUND)
        result.append(grant)
        try:
            gevent.sleep(BOUND)
        finally:
            t.release(grant, now())

    g = gevent.spawn(retrying)
    settle()
    assert failed.released and len(result) == 1
    gevent.kill(g)
    settle()
    # The retry's slot went on to the older waiter.
    grant = t.abandon(third)
    assert grant is not None
    t.release(grant, now())
    t.release(other, now())
    assert_all_zero(t)

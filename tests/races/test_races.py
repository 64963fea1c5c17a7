"""Races (DESIGN.md tier 2): greenlets through ``activator.base.gate`` and the proxy's own
``Lease`` (``activator.proxy.responder``: the request's one owner of its slot, whose
release lets a woken waiter run first), interleaved with topology changes by
``gevent.sleep(0)`` / ``gevent.idle()`` steps only.

Ordering never depends on the wall clock; a wall-clock timeout only bounds a test so
that a bug shows as a failure, not a hang (and a queue timeout, where timing out is the
behaviour under test). The fake work records how many requests each pod runs at once,
as a real backend would, and every test ends with every count back to zero and
``check_invariants()`` holding.

The core hands its effects out; as in the proxy and the writer, every core call here
passes them to the shell's ``Actor``, which wakes the waiters (each one's ``token``) and
reports the transitions to its observer. A waiter is woken by nothing else.
"""

from __future__ import annotations

import random
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import gevent
import pytest
from builders import Move, moves, pod, svc
from gevent.event import Event

from activator.base import gate
from activator.base.writer import Actor, TopologyWriter
from activator.core.config import Config, ProbeConfig, diff_configs
from activator.core.errors import ClientGone, QueueFull, QueueTimeout
from activator.core.events import ConfigChanged, ProbeReport
from activator.core.probes import Verdict
from activator.core.states import PodEvent, PodState
from activator.core.throttler import Effects, Grant, ServiceThrottler, Transition, Waiter
from activator.core.topology import Topology
from activator.front import hangup
from activator.proxy.responder import Lease

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
P, H, D, R = PodState.PENDING, PodState.HEALTHY, PodState.DRAINING, PodState.REMOVED
BOUND = 10.0  # seconds: only to turn a hang into a failure
EXPIRING = 0.05  # seconds: a queue timeout that is meant to expire (nothing else waits on it)


def now() -> float:
    return time.monotonic()


LIVE: list[Request] = []  # this test's requests, to surface their errors early


@pytest.fixture(autouse=True)
def _fresh_requests() -> Iterator[None]:
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


class Recorder:
    """The actor's observer: every transition the shell was told of, in order."""

    def __init__(self) -> None:
        self.transitions: list[Transition] = []

    def transition(self, transition: Transition) -> None:
        self.transitions.append(transition)

    @property
    def moves(self) -> list[Move]:
        return moves(Effects(transitions=self.transitions))


class Shell:
    """One service's throttler with the shell's actor and the one writer, used as the proxy
    uses them: every call's effects go to ``act`` (and the construction's too)."""

    def __init__(self, topology: Topology, host: str, actor: Actor | None = None) -> None:
        self.throttler = topology.route(host)
        self.recorder = Recorder()
        self.actor = actor or Actor(self.recorder)
        #: The writer a ``Lease`` posts its transport failures to (its steps are applied
        #: by the test itself, not by its greenlet).
        self.writer = TopologyWriter(topology, self.actor)
        if actor is None:
            self.act(topology.initial_effects)

    def act(self, effects: Effects) -> Effects:
        self.actor.act(effects)
        return effects

    def release(self, grant: Grant) -> Effects:
        return self.act(self.throttler.release(grant, now()))

    def apply(self, config: Any) -> Effects:
        return self.act(self.throttler.apply(config, now()))

    def held(self) -> Grant:
        """A slot taken at once, outside any request greenlet."""
        grant = self.throttler.acquire(now())
        assert isinstance(grant, Grant)
        return grant

    def queued(self) -> Waiter:
        """A place in the queue taken outside the gate, with the token the gate gives it."""
        waiter = self.throttler.acquire(now())
        assert isinstance(waiter, Waiter)
        waiter.token = Event()
        return waiter


def service(config: Any) -> Shell:
    topology = Topology(Config(path="races.yaml", services={config.name: config}), now())
    return Shell(topology, config.hosts[0])


def admitted(address: str) -> Move:
    return (address, P, H, PodEvent.PROBE_PASSED)


class SocketClient:
    """A client as the gate sees it (``gate.Client``), on one socket: its hang-up heard
    through the process's ``HangupMonitor``, as ``http1.H1Exchange`` does it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def watch_gone(self, on_gone: Callable[[], None]) -> bool:
        fd = self.sock.fileno()
        return fd >= 0 and hangup.monitor().watch(fd, on_gone)

    def unwatch_gone(self, on_gone: Callable[[], None]) -> None:
        fd = self.sock.fileno()
        if fd >= 0:
            hangup.monitor().unwatch(fd, on_gone)

    def client_gone(self) -> bool:
        return hangup.hung_up(self.sock)


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
        shell: Shell,
        pods: Pods,
        rid: int,
        *,
        hold: Event | None = None,
        steps: int = 0,
        timeout: float = BOUND,
        on_start: Callable[[Grant], None] | None = None,
        client_socket: socket.socket | None = None,
    ) -> None:
        self.client = SocketClient(client_socket) if client_socket is not None else None
        self.shell = shell
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
        shell = self.shell
        try:
            grant = gate.acquire(shell.throttler, self.timeout, self.client, shell.actor.act)
        except (QueueFull, QueueTimeout, ClientGone) as e:
            self.outcome = type(e).__name__
            return
        lease = Lease(shell.throttler, grant, shell.actor, shell.writer)
        if lease.waited and self.client is not None and self.client.client_gone():
            # As the proxy does before sending a request that waited.
            lease.release()
            self.outcome = "ClientGone"
            return
        self.grant = grant
        address = lease.pod
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
            lease.release()
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


# -- waking goes through the actor only --------------------------------------------


def test_a_waiter_handed_a_slot_sleeps_until_the_effects_are_acted_on() -> None:
    s = service(svc(A, cc=1))
    pods = Pods()
    held = s.held()
    waiter = Request(s, pods, 1)
    settle()
    effects = s.throttler.release(held, now())  # not acted on (yet)
    assert len(effects.woken) == 1 and effects.woken[0].grant is not None
    settle()
    assert waiter.outcome == "waiting", "a waiter woke without the shell acting on the effects"
    s.act(effects)
    finish([waiter])
    assert waiter.outcome == "done" and pods.served == [(A, 1)]
    assert_all_zero(s.throttler)


# -- drain while requests are in flight -----------------------------------------


def test_drain_while_requests_in_flight() -> None:
    s = service(svc(A, B, cc=1))
    t = s.throttler
    pods = Pods()
    holds = [Event() for _ in range(4)]
    drained = False
    after_drain_on_a: list[int] = []

    def watch(grant: Grant) -> None:
        if drained and grant.pod.address == A:
            after_drain_on_a.append(1)

    reqs = [Request(s, pods, i, hold=holds[i], on_start=watch) for i in range(4)]
    settle()
    assert sorted(r.grant.pod.address for r in reqs[:2] if r.grant) == [A, B]
    assert t.queued == 2

    assert not s.apply(svc(pod(A, drain=True), B, cc=1)).woken
    drained = True
    assert t.trackers[A].state is D
    holds[0].set()  # A's request finishes: A is removed, its slot goes to nobody
    settle()
    assert t.trackers[A].state is R
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
    # Each change reached the shell once: from the writer's apply and from the release.
    assert s.recorder.moves == [
        admitted(A),
        admitted(B),
        (A, H, D, PodEvent.DRAIN_SET),
        (A, D, R, PodEvent.LAST_RELEASED),
    ]
    assert_all_zero(t)


# -- unlist and re-list a busy pod (the seed bug) -----------------------------------


def test_SEED_BUG_unlist_and_relist_busy_pod_never_exceeds_cc() -> None:
    s = service(svc(A, cc=1))
    t = s.throttler
    pods = Pods()
    hold = Event()
    first = Request(s, pods, 0, hold=hold)
    settle()
    assert first.outcome == "running"

    s.apply(svc(cc=1))  # unlisted while busy
    settle()
    s.apply(svc(A, cc=1))  # listed again
    second = Request(s, pods, 1, steps=3)
    settle()
    assert second.outcome == "waiting", "the re-listed busy pod was sent a second request"
    assert t.trackers[A].in_flight == 1

    hold.set()
    finish([first, second])
    assert pods.peak[A] == 1
    assert s.recorder.moves == [
        admitted(A),
        (A, H, D, PodEvent.UNLISTED),
        (A, D, P, PodEvent.LISTED),
        admitted(A),
    ]
    assert_all_zero(t)


@pytest.mark.parametrize("seed", range(5))
def test_listing_flaps_under_load_never_exceed_cc(seed: int) -> None:
    """Many requests doing sleep(0) steps while the one writer flaps listing, drain and
    probes, each change posted as the topology event the shell makes of it."""
    rng = random.Random(seed)
    cc = 2
    probe = ProbeConfig(healthy_after=1, unhealthy_after=1)
    base = Config(path="races.yaml", services={"api": svc(A, B, C, cc=cc, probe=probe, queue_depth=1000)})
    topo = Topology(base, now(), rng=random.Random(seed))
    recorder = Recorder()
    actor = Actor(recorder)
    actor.act(topo.initial_effects)
    s = Shell(topo, "api.example.com", actor)
    writer, t = s.writer, s.throttler

    def reconfigure(config: Config) -> None:
        writer.apply(ConfigChanged(config, diff_configs(topo.config, config)))

    def probe_all(addresses: list[str], verdict: Callable[[], Verdict]) -> None:
        for address in addresses:
            writer.apply(ProbeReport("api", address, verdict()))

    probe_all([A, B, C], lambda: Verdict.PASS)
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
            reqs.append(Request(s, pods, i, steps=rng.randint(0, 6), on_start=check))
            for _ in range(rng.randint(0, 2)):
                gevent.sleep(0)

    def flapping() -> None:
        for _ in range(60):
            listed = [a for a in (A, B, C) if rng.random() < 0.7]
            pods_cfg = [pod(a, drain=rng.random() < 0.2) for a in listed]
            reconfigure(replace(base, services={"api": svc(*pods_cfg, cc=cc, probe=probe, queue_depth=1000)}))
            probe_all(listed, lambda: Verdict.PASS if rng.random() < 0.8 else Verdict.FAIL)
            topo.check_invariants()
            for _ in range(rng.randint(0, 3)):
                gevent.sleep(0)
        # Back to everything listed and healthy, so that every request can finish.
        reconfigure(base)
        probe_all([A, B, C], lambda: Verdict.PASS)

    producers = [gevent.spawn(clients), gevent.spawn(flapping)]
    gevent.joinall(producers, timeout=BOUND, raise_error=True)
    finish(reqs)
    assert over == []
    assert max(pods.peak.values()) <= cc
    assert all(r.outcome == "done" for r in reqs)
    assert_all_zero(t)
    assert topo.route("api.example.com") is t
    # The shell heard of every change, in order: replaying them gives each pod's state now.
    last: dict[str, PodState] = {}
    for address, old, new, _ in recorder.moves:
        was = last.get(address, P)
        # A removed pod unlisted while idle is forgotten; listed again, it starts pending.
        assert old is was or (was is R and old is P), f"{address}: a change from {old} reported while it was {was}"
        last[address] = new
    assert {a: tr.state for a, tr in t.trackers.items()} == {a: last.get(a, P) for a in t.trackers}


# -- shrink capacity below in-flight ------------------------------------------------


def test_shrink_capacity_below_in_flight() -> None:
    s = service(svc(A, cc=3))
    pods = Pods()
    holds = [Event() for _ in range(5)]
    reqs = [Request(s, pods, i, hold=holds[i]) for i in range(3)]
    settle()
    assert pods.running[A] == 3

    assert not s.apply(svc(A, cc=1))
    reqs += [Request(s, pods, i, hold=holds[i]) for i in (3, 4)]
    settle()
    assert s.throttler.queued == 2
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
    assert_all_zero(s.throttler)


# -- a queued waiter's greenlet killed (the client went away) ---------------------


def test_killed_waiter_leaves_the_queue() -> None:
    s = service(svc(A, cc=1))
    pods = Pods()
    hold = Event()
    holder = Request(s, pods, 0, hold=hold)
    waiter = Request(s, pods, 1)
    settle()
    assert s.throttler.queued == 1
    gevent.kill(waiter.greenlet)  # asynchronous, as when the client goes away
    waiter.greenlet.join(timeout=BOUND)
    assert waiter.greenlet.dead and s.throttler.queued == 0
    s.throttler.check_invariants()
    hold.set()
    finish([holder])
    assert pods.served == [(A, 0)]
    assert_all_zero(s.throttler)


def test_killed_waiter_releases_a_grant_that_arrived_in_the_same_tick() -> None:
    """The kill is already on its way when the slot is handed over: the greenlet wakes
    with GreenletExit inside the wait while holding a grant, and must give it back."""
    s = service(svc(A, cc=1))
    t = s.throttler
    pods = Pods()
    held = s.held()
    waiter = Request(s, pods, 1)
    settle()
    assert waiter.outcome == "waiting" and t.queued == 1

    gevent.kill(waiter.greenlet)  # asynchronous: the GreenletExit is scheduled first...
    effects = s.release(held)  # ...then, in the same tick, the slot is handed to it
    assert len(effects.woken) == 1 and effects.woken[0].grant is not None
    assert t.queued == 0 and t.in_flight == 1 and t.trackers[A].in_flight == 1

    waiter.greenlet.join(timeout=BOUND)
    assert waiter.greenlet.dead
    # It died in the wait (never ran on the pod), holding a grant it gave back.
    assert isinstance(waiter.greenlet.value, gevent.GreenletExit)
    assert waiter.grant is None and pods.served == []  # never ran
    assert_all_zero(t)
    # The slot really is free again.
    s.release(s.held())


def test_killed_running_request_releases_exactly_once() -> None:
    s = service(svc(A, cc=1))
    pods = Pods()
    running = Request(s, pods, 0, hold=Event())
    queued = Request(s, pods, 1, steps=2)
    settle()
    gevent.kill(running.greenlet)  # client gone mid-response
    finish([queued])
    assert pods.served == [(A, 0), (A, 1)]
    assert_all_zero(s.throttler)


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
        s = service(svc(A, cc=1))
        pods = Pods()
        hold = Event()
        holder = Request(s, pods, 0, hold=hold)
        waiter = Request(s, pods, 1, client_socket=ours)
        settle()
        assert s.throttler.queued == 1 and hangup.monitor().watching == 1
        theirs.shutdown(socket.SHUT_WR)  # the client's FIN, nothing else
        until(lambda: waiter.outcome == "ClientGone")
        assert s.throttler.queued == 0 and hangup.monitor().watching == 0
        hold.set()
        finish([holder, waiter])
        assert pods.served == [(A, 0)]
        assert_all_zero(s.throttler)
    finally:
        ours.close()
        theirs.close()


def test_client_gone_in_the_same_tick_as_its_grant_releases_it() -> None:
    ours, theirs = socket.socketpair()
    try:
        s = service(svc(A, cc=1))
        pods = Pods()
        held = s.held()
        waiter = Request(s, pods, 1, client_socket=ours)
        settle()
        theirs.close()  # the client hangs up...
        s.release(held)  # ...and its slot arrives, before the hub noticed the hang-up
        assert s.throttler.in_flight == 1 and s.throttler.queued == 0
        finish([waiter])
        assert waiter.outcome == "ClientGone" and pods.served == []  # never sent to the pod
        assert_all_zero(s.throttler)
    finally:
        ours.close()


def test_client_gone_with_unread_bytes_is_seen() -> None:
    """A pipelined request (or a body) waiting unread does not hide the hang-up."""
    ours, theirs = socket.socketpair()
    try:
        s = service(svc(A, cc=1))
        pods = Pods()
        held = s.held()
        waiter = Request(s, pods, 1, client_socket=ours)
        settle()
        theirs.sendall(b"GET /next HTTP/1.1\r\n\r\n")
        theirs.shutdown(socket.SHUT_WR)
        until(lambda: waiter.outcome == "ClientGone")
        assert not s.release(held)  # nobody is left waiting for it
        assert_all_zero(s.throttler)
    finally:
        ours.close()
        theirs.close()


def test_client_hangs_up_on_a_real_socket() -> None:
    ours, theirs = socket.socketpair()
    try:
        s = service(svc(A, cc=1))
        pods = Pods()
        held = s.held()
        waiter = Request(s, pods, 1, client_socket=ours)
        settle()
        assert s.throttler.queued == 1
        theirs.close()
        waiter.greenlet.join(timeout=BOUND)
        assert waiter.outcome == "ClientGone" and s.throttler.queued == 0
        s.release(held)
        assert_all_zero(s.throttler)
    finally:
        ours.close()
        theirs.close()


# -- timeouts ------------------------------------------------------------------------


def test_queue_timeout_raises_and_leaves_the_queue() -> None:
    s = service(svc(A, cc=1))
    held = s.held()
    with pytest.raises(QueueTimeout):
        gate.acquire(s.throttler, EXPIRING, None, s.actor.act)
    assert s.throttler.queued == 0
    assert not s.release(held)
    assert_all_zero(s.throttler)


def test_queue_full_through_the_gate() -> None:
    s = service(svc(A, cc=1, queue_depth=0))
    held = gate.acquire(s.throttler, BOUND, None, s.actor.act)
    with pytest.raises(QueueFull):
        gate.acquire(s.throttler, BOUND, None, s.actor.act)
    s.release(held)
    assert_all_zero(s.throttler)


def test_one_of_two_times_out_the_other_is_served() -> None:
    # Knative TestThrottlerErrorOneTimesOut: cc=1, one pod, two requests.
    s = service(svc(A, cc=1))
    pods = Pods()
    hold = Event()
    first = Request(s, pods, 0, hold=hold)
    second = Request(s, pods, 1, timeout=EXPIRING)
    second.greenlet.join(timeout=BOUND)
    assert second.outcome == "QueueTimeout"
    hold.set()
    finish([first, second])
    assert_all_zero(s.throttler)


# -- retry after a connect failure ---------------------------------------------------


def test_acquire_retry_releases_the_failed_grant() -> None:
    s = service(svc(A, B, cc=1))
    failed = gate.acquire(s.throttler, BOUND, None, s.actor.act)
    assert failed.pod.address == A
    retry = gate.acquire_retry(s.throttler, failed, BOUND, None, s.actor.act)
    assert retry.pod.address == B
    assert failed.released and s.throttler.trackers[A].in_flight == 0
    s.release(retry)
    assert_all_zero(s.throttler)


def test_acquire_retry_waits_at_the_head_and_releases_the_failed_grant() -> None:
    s = service(svc(A, cc=1))
    pods = Pods()
    failed = gate.acquire(s.throttler, BOUND, None, s.actor.act)
    older = Request(s, pods, 1)  # already waiting
    settle()
    # No other pod: it waits at the head, and the failed grant's slot comes back to it.
    retry = gate.acquire_retry(s.throttler, failed, BOUND, None, s.actor.act)
    assert failed.released and retry.pod.address == A and retry.queued
    assert older.outcome == "waiting"
    s.release(retry)
    finish([older])
    assert_all_zero(s.throttler)


def test_acquire_retry_timeout_still_releases_the_failed_grant() -> None:
    # The failed pod was unlisted meanwhile and the other is busy: the retry waits,
    # times out, and the failed grant is released all the same.
    s = service(svc(A, B, cc=1))
    failed = gate.acquire(s.throttler, BOUND, None, s.actor.act)
    other = gate.acquire(s.throttler, BOUND, None, s.actor.act)
    assert failed.pod.address == A
    s.apply(svc(B, cc=1))
    with pytest.raises(QueueTimeout):
        gate.acquire_retry(s.throttler, failed, EXPIRING, None, s.actor.act)
    assert failed.released and A not in s.throttler.trackers
    assert s.throttler.queued == 0
    # The failed pod's leaving reached the shell through the retry's effects.
    assert s.recorder.moves[-2:] == [(A, H, D, PodEvent.UNLISTED), (A, D, R, PodEvent.LAST_RELEASED)]
    s.release(other)
    assert_all_zero(s.throttler)


def test_killed_retry_hands_its_slot_to_the_next_waiter() -> None:
    s = service(svc(A, B, cc=1))
    failed = gate.acquire(s.throttler, BOUND, None, s.actor.act)
    other = gate.acquire(s.throttler, BOUND, None, s.actor.act)
    third = s.queued()  # both pods busy: it waits

    result: list[Grant] = []

    def retrying() -> None:
        # A's freed slot goes to the retry at the head, so it is granted at once:
        # hold it until killed.
        grant = gate.acquire_retry(s.throttler, failed, BOUND, None, s.actor.act)
        result.append(grant)
        try:
            Event().wait()
        finally:
            s.release(grant)

    g = gevent.spawn(retrying)
    settle()
    assert failed.released and len(result) == 1
    assert not third.token.is_set()
    gevent.kill(g)
    settle()
    # The retry's slot went on to the older waiter, and the actor woke it.
    assert third.token.is_set()
    grant = s.throttler.abandon(third)
    assert grant is not None
    s.release(grant)
    s.release(other)
    assert_all_zero(s.throttler)

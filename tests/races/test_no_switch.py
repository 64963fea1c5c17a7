"""The core never yields, and neither does the writer's step: checked with ``no_switch()``.

First the helper itself is proven (a block that switches fails it, one that only
schedules does not, the previous trace function survives). Then every core call of the
request path (``acquire``, ``release``, ``abandon``, ``acquire_retry``) and of the
writer (``apply``, ``probe_result``, ``record_failure``, ``tick``, ``redirect_waiters``,
``Topology.handle`` for each event type), and the writer's whole step
(``TopologyWriter.apply`` with a real ``Topology`` and an ``Actor``), run inside
``no_switch()``, each in a case where it does real work: hands a slot over, changes a
pod's state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import gevent
import greenlet  # type: ignore[import-untyped]
import pytest
from builders import svc
from gevent.event import Event
from noswitch import Switched, no_switch

from activator.base import gate
from activator.base.writer import Actor, TopologyWriter
from activator.core.config import Config, ProbeConfig, ServiceConfig, diff_configs
from activator.core.errors import QueueFull
from activator.core.events import ConfigChanged, ProbeReport, Tick, TransportFailure
from activator.core.events import Event as TopologyEvent
from activator.core.failures import FailureKind
from activator.core.probes import Verdict
from activator.core.states import PodState
from activator.core.throttler import Effects, Grant, ServiceThrottler, Transition, Waiter
from activator.core.topology import Topology

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
EJECT_AT_ONCE = ProbeConfig(healthy_after=1, unhealthy_after=1)
BOUND = 10.0  # seconds: only to turn a hang into a failure
T = TypeVar("T")


def quiet(what: str, call: Callable[[], T]) -> T:
    """``call()`` inside ``no_switch()``."""
    with no_switch(what):
        return call()


# -- the helper itself ---------------------------------------------------------------


def switch_to_another_greenlet() -> None:
    greenlet.greenlet(lambda: None).switch()


def throw_into_another_greenlet() -> None:
    with pytest.raises(KeyError):
        greenlet.greenlet(lambda: None).throw(KeyError)


SWITCHING: dict[str, Callable[[], Any]] = {
    "sleep(0)": lambda: gevent.sleep(0),
    "idle()": gevent.idle,
    "join a greenlet": lambda: gevent.spawn(lambda: None).join(),
    "greenlet.switch": switch_to_another_greenlet,
    "greenlet.throw": throw_into_another_greenlet,
}


@pytest.mark.parametrize("action", list(SWITCHING), ids=list(SWITCHING))
def test_a_block_that_switches_away_fails(action: str) -> None:
    with pytest.raises(Switched) as info, no_switch(action):
        SWITCHING[action]()
    assert action in str(info.value)


def test_sleep_0_is_one_switch_however_many_greenlets_the_hub_runs_meanwhile() -> None:
    ran: list[str] = []

    def other(name: str) -> None:
        ran.append(name)
        gevent.sleep(0)

    others = [gevent.spawn(other, name) for name in ("g1", "g2")]
    with pytest.raises(Switched) as info, no_switch("sleep"):
        gevent.sleep(0)
    assert ran == ["g1", "g2"]  # they ran and switched, inside the block: not counted
    assert "1 time(s)" in str(info.value)
    gevent.joinall(others)


def test_scheduling_without_switching_passes() -> None:
    flag = Event()
    with no_switch("scheduling"):
        flag.set()  # the waiters are notified later, from the hub
        spawned = gevent.spawn(lambda: None)  # starts at the next switch
        later = gevent.spawn(Event().wait)
        later.kill(block=False)
        sum(range(1000))
    assert not spawned.dead  # proof it did not run inside the block
    gevent.joinall([spawned, later])


def test_the_previous_trace_function_is_kept_informed_and_restored() -> None:
    seen: list[str] = []

    def outer(event: str, args: tuple[Any, Any]) -> None:
        seen.append(event)

    before = greenlet.settrace(outer)
    try:
        with pytest.raises(Switched), no_switch():
            gevent.sleep(0)
        assert greenlet.gettrace() is outer
        assert "switch" in seen
        with pytest.raises(ZeroDivisionError), no_switch():
            1 / 0  # noqa: B018 - an error inside the block restores the tracer too
        assert greenlet.gettrace() is outer
    finally:
        greenlet.settrace(before)
    assert greenlet.gettrace() is before


# -- the request path --------------------------------------------------------------


def with_token(result: Grant | Waiter) -> Waiter:
    """A waiter with the token the gate gives it (the actor sets it)."""
    assert isinstance(result, Waiter)
    result.token = Event()
    return result


def test_the_request_path_core_calls_never_switch() -> None:
    t = ServiceThrottler(svc(A, B, cc=1, queue_depth=2), 0.0)
    first = quiet("acquire (granted)", lambda: t.acquire(0.0))
    second = quiet("acquire (granted)", lambda: t.acquire(0.0))
    assert isinstance(first, Grant) and isinstance(second, Grant)
    waiter = with_token(quiet("acquire (queued)", lambda: t.acquire(1.0)))
    leaving = with_token(quiet("acquire (queued)", lambda: t.acquire(1.0)))
    with pytest.raises(QueueFull), no_switch("acquire (queue full)"):
        t.acquire(1.0)
    assert quiet("abandon (still queued)", lambda: t.abandon(leaving)) is None

    handed = quiet("release (handed over)", lambda: t.release(first, 2.0))
    assert list(handed.woken) == [waiter]
    got = quiet("abandon (granted meanwhile)", lambda: t.abandon(waiter))
    assert got is waiter.grant and got is not None

    # A failed connect with the other pod busy: the retry waits at the head and is
    # handed the failed grant's slot in the same call.
    retry, effects = quiet("acquire_retry (queued)", lambda: t.acquire_retry(got, 3.0))
    assert isinstance(retry, Waiter) and list(effects.woken) == [retry]
    assert retry.grant is not None
    assert not quiet("release", lambda: t.release(retry.grant, 4.0))  # type: ignore[arg-type]
    # And with a free pod: a grant there at once.
    third, effects = quiet("acquire_retry (granted)", lambda: t.acquire_retry(second, 5.0))
    assert isinstance(third, Grant) and not effects
    quiet("release", lambda: t.release(third, 6.0, answered=True))
    t.check_invariants()
    assert t.in_flight == 0


def test_the_gate_s_immediate_grant_and_the_actor_never_switch() -> None:
    t = ServiceThrottler(svc(A, cc=1), 0.0)
    recorder = Recorder()
    actor = Actor(recorder)
    grant = quiet("gate.acquire (a free slot)", lambda: gate.acquire(t, 1.0, None, actor.act))
    waiter = with_token(t.acquire(time.monotonic()))
    effects = t.release(grant, time.monotonic())
    quiet("Actor.act", lambda: actor.act(effects))
    assert waiter.token.is_set()
    t.release(t.abandon(waiter), time.monotonic())  # type: ignore[arg-type]


# -- the writer's core calls ---------------------------------------------------------


def test_the_throttler_s_topology_calls_never_switch() -> None:
    t = ServiceThrottler(svc(A, cc=1, probe=EJECT_AT_ONCE, drain_timeout=10.0), 0.0)
    waiter = with_token(t.acquire(0.0))
    effects = quiet("probe_result", lambda: t.probe_result(A, Verdict.PASS, 1.0))
    assert list(effects.woken) == [waiter] and effects.transitions
    assert quiet("record_failure", lambda: t.record_failure(A, FailureKind.CONNECT, 2.0)).transitions
    quiet("probe_result", lambda: t.probe_result(A, Verdict.PASS, 3.0))
    second = with_token(t.acquire(3.0))
    assert quiet("redirect_waiters", lambda: t.redirect_waiters()).woken == [second]
    assert t.abandon(second) is None
    assert quiet("apply", lambda: t.apply(svc(B, cc=1, probe=EJECT_AT_ONCE, drain_timeout=10.0), 4.0)).transitions
    assert quiet("tick", lambda: t.tick(20.0)).transitions  # A forced out: drain_timeout passed
    t.release(t.abandon(waiter), 21.0)  # type: ignore[arg-type]
    t.check_invariants()


class Recorder:
    """The actor's observer: the transitions it was told of."""

    def __init__(self) -> None:
        self.transitions: list[Transition] = []

    def transition(self, transition: Transition) -> None:
        self.transitions.append(transition)


@dataclass
class Scene:
    """A topology where one event does real work: ``waiters`` are queued for a slot."""

    topology: Topology
    event: TopologyEvent
    waiters: list[Waiter]
    #: (address, state) the event leaves the pod in
    after: tuple[str, PodState]


def topology_of(*services: ServiceConfig, at: float) -> Topology:
    return Topology(Config(path="noswitch.yaml", services={s.name: s for s in services}), at)


def config_changed(at: float) -> Scene:
    topo = topology_of(svc(A, cc=1), at=at)
    api = topo.services["api"]
    api.acquire(at)
    waiters = [with_token(api.acquire(at))]
    new = Config(path="noswitch.yaml", services={"api": svc(A, B, cc=1)})
    return Scene(topo, ConfigChanged(new, diff_configs(topo.config, new)), waiters, (B, PodState.HEALTHY))


def probe_report(at: float) -> Scene:
    topo = topology_of(svc(A, cc=1, probe=EJECT_AT_ONCE), at=at)
    waiters = [with_token(topo.services["api"].acquire(at))]
    return Scene(topo, ProbeReport("api", A, Verdict.PASS), waiters, (A, PodState.HEALTHY))


def transport_failure(at: float) -> Scene:
    topo = topology_of(svc(A, cc=1, probe=EJECT_AT_ONCE), at=at)
    topo.handle(ProbeReport("api", A, Verdict.PASS), at)
    return Scene(topo, TransportFailure("api", A, FailureKind.TIMEOUT), [], (A, PodState.PENDING))


def tick(at: float) -> Scene:
    # drain_timeout 0: the unlisted busy pod is past it at the next tick, whatever the clock.
    api = svc(A, cc=1, drain_timeout=0.0)
    topo = topology_of(api, at=at)
    topo.services["api"].acquire(at)
    topo.apply(Config(path="noswitch.yaml", services={"api": svc(cc=1, drain_timeout=0.0)}), at)
    return Scene(topo, Tick(), [], (A, PodState.REMOVED))


SCENES: dict[str, Callable[[float], Scene]] = {
    "ConfigChanged": config_changed,
    "ProbeReport": probe_report,
    "TransportFailure": transport_failure,
    "Tick": tick,
}


def assert_done(scene: Scene, transitions: list[Transition]) -> None:
    address, state = scene.after
    assert scene.topology.services["api"].trackers[address].state is state
    assert (address, state) in [(tr.address, tr.new) for tr in transitions], "the event changed no pod"
    scene.topology.check_invariants()


@pytest.mark.parametrize("name", list(SCENES), ids=list(SCENES))
def test_topology_handle_never_switches(name: str) -> None:
    at = time.monotonic()
    scene = SCENES[name](at)
    effects: Effects = quiet(f"Topology.handle({name})", lambda: scene.topology.handle(scene.event, at))
    assert [id(w) for w in effects.woken] == [id(w) for w in scene.waiters]
    assert_done(scene, list(effects.transitions))


@pytest.mark.parametrize("name", list(SCENES), ids=list(SCENES))
def test_the_writer_s_step_never_switches_and_acts_on_the_effects(name: str) -> None:
    scene = SCENES[name](time.monotonic())
    recorder = Recorder()
    changed: list[int] = []
    applied: list[TopologyEvent] = []
    actor = Actor(recorder, on_states_changed=lambda: changed.append(1))
    writer = TopologyWriter(scene.topology, actor, on_applied=applied.append)
    quiet(f"TopologyWriter.apply({name})", lambda: writer.apply(scene.event))
    assert all(w.token.is_set() for w in scene.waiters), "a waiter handed a slot was not woken"
    assert changed == [1]  # the states changed: the probes are synced, once
    assert applied == [scene.event]
    assert_done(scene, recorder.transitions)


@pytest.fixture
def parked() -> Iterator[list[gevent.Greenlet]]:
    spawned: list[gevent.Greenlet] = []
    yield spawned
    gevent.killall(spawned)


def test_a_request_parked_in_the_gate_runs_after_the_writer_s_step(parked: list[gevent.Greenlet]) -> None:
    """End to end through the gate: the writer's step hands the slot over and wakes the
    request without switching; the request runs once the writer's greenlet yields."""
    topo = topology_of(svc(A, cc=1, probe=EJECT_AT_ONCE, queue_timeout=30.0), at=time.monotonic())
    throttler = topo.services["api"]
    actor = Actor(Recorder())
    writer = TopologyWriter(topo, actor)
    request = gevent.spawn(gate.acquire, throttler, 30.0, None, actor.act)
    parked.append(request)
    gevent.sleep(0)
    assert throttler.queued == 1
    quiet("TopologyWriter.apply(ProbeReport)", lambda: writer.apply(ProbeReport("api", A, Verdict.PASS)))
    assert not request.ready()  # woken, not yet run
    grant = request.get(timeout=BOUND)
    assert isinstance(grant, Grant) and grant.queued and grant.pod.address == A
    actor.act(throttler.release(grant, time.monotonic()))
    topo.check_invariants()
    assert throttler.in_flight == 0 and throttler.queued == 0

"""The writer's step stays switch-free with launched pods (``process.launcher.Launching``).

Each case runs ``TopologyWriter.apply`` inside ``no_switch()`` where the launcher does
real work in the step: a queued request starts a pod (its process greenlet is only
scheduled), a pod no longer wanted is drained (the throttler's ``park``, a pod state
change), a failed cold start gives the waiters up (woken with ``cold-start-failed``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import gevent
import pytest
from builders import svc
from gevent.event import Event
from noswitch import no_switch

from activator.base.writer import Actor, TopologyWriter
from activator.core.autoscale import Action, LaunchCheck, LaunchEffect, PodEnded
from activator.core.config import Config, LaunchConfig, ProbeConfig
from activator.core.errors import ColdStartFailed
from activator.core.events import ProbeReport, Tick
from activator.core.probes import Verdict
from activator.core.states import PodState
from activator.core.throttler import Transition, Waiter
from activator.core.topology import Topology
from activator.process.launcher import Launching

A = "127.0.0.1:1"  # never listens: nothing here connects to it


class Sink:
    def __init__(self) -> None:
        self.transitions: list[Transition] = []
        self.launched: list[LaunchEffect] = []

    def transition(self, transition: Transition) -> None:
        self.transitions.append(transition)

    def launched_effect(self, effect: LaunchEffect) -> None:
        self.launched.append(effect)


class Scene:
    def __init__(self, **launch: Any) -> None:
        config = LaunchConfig(command=("/bin/true",), cold_start_timeout=60.0, **launch)
        service = svc(A, cc=1, probe=ProbeConfig(), launch=config)
        self.config = Config(path="noswitch.yaml", services={"api": service})
        self.topology = Topology(self.config, time.monotonic())
        self.sink = Sink()
        self.posted: list[Any] = []
        self.launching = Launching(self.topology, self.posted.append, _Counted(self.sink))
        self.writer = TopologyWriter(self.topology, Actor(self.sink))
        self.writer.launching = self.launching
        self.launching.configure(self.config, time.monotonic())
        # Its first probe: nothing answers there (a pod not probed yet is never started).
        self.writer.apply(ProbeReport("api", A, Verdict.FAIL, "connect: refused"))

    def queue(self) -> Waiter:
        waiter = self.topology.services["api"].acquire(time.monotonic())
        assert isinstance(waiter, Waiter)
        waiter.token = Event()
        return waiter

    def actions(self) -> list[tuple[Action, str]]:
        return [(effect.action, effect.pod) for effect in self.sink.launched]


class _Counted:
    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    def launched(self, effect: LaunchEffect) -> None:
        self.sink.launched_effect(effect)


@pytest.fixture
def scene() -> Iterator[Scene]:
    made = Scene(stable_window=0.01, scale_to_zero_after=0.0)
    yield made
    for process in list(made.launching.processes.values()):
        process.wait(timeout=10)  # /bin/true: its end is posted to a list


def test_a_queued_request_starts_a_pod_in_the_writer_s_step_without_switching(scene: Scene) -> None:
    scene.queue()
    with no_switch("TopologyWriter.apply(LaunchCheck)"):
        scene.writer.apply(LaunchCheck("api"))
    assert scene.actions() == [(Action.START, A)]
    assert ("api", A) in scene.launching.processes  # its greenlet is scheduled, not run


def test_a_pod_no_longer_wanted_is_drained_in_the_writer_s_step_without_switching(scene: Scene) -> None:
    grant_waiter = scene.queue()
    scene.writer.apply(LaunchCheck("api"))
    scene.writer.apply(ProbeReport("api", A, Verdict.PASS))  # ready: the waiter gets its slot
    assert grant_waiter.token.is_set() and grant_waiter.grant is not None
    assert (Action.READY, A) in scene.actions()
    scene.topology.services["api"].release(grant_waiter.grant, time.monotonic())
    gevent.sleep(0.05)  # past the 10 ms stable window and scale_to_zero_after 0
    with no_switch("TopologyWriter.apply(Tick) draining a launched pod"):
        scene.writer.apply(Tick())
    assert (Action.DRAIN, A) in scene.actions()
    tracker = scene.topology.services["api"].trackers[A]
    assert tracker.parked and tracker.state is PodState.REMOVED
    assert [(tr.old, tr.new) for tr in scene.sink.transitions][-2:] == [
        (PodState.HEALTHY, PodState.DRAINING),
        (PodState.DRAINING, PodState.REMOVED),
    ]


def test_a_failed_cold_start_gives_the_waiters_up_in_the_writer_s_step_without_switching(scene: Scene) -> None:
    waiter = scene.queue()
    scene.writer.apply(LaunchCheck("api"))
    process = scene.launching.processes[("api", A)]
    assert process.wait(timeout=10)  # /bin/true ended before it was ready
    ended = scene.posted[-1]
    assert isinstance(ended, PodEnded)
    with no_switch("TopologyWriter.apply(PodEnded) refusing the waiters"):
        scene.writer.apply(ended)
    assert scene.actions()[-2:] == [(Action.FAILED, A), (Action.REFUSE_WAITERS, "")]
    assert waiter.token.is_set() and isinstance(waiter.refusal, ColdStartFailed)
    assert scene.topology.services["api"].queued == 0

"""The one writer of topology, and the one place where the shell acts on the core's effects.

What this module decides:

- **One writer.** Everything that changes pods and services apart from requests (a new
  file, a probe verdict, a transport failure, the passing of time) is a topology event
  (``core.events``). Any greenlet may ``post`` one (it never yields); the writer's
  greenlet applies them one at a time, in the order they were posted, with
  ``Topology.handle``, a core call that never yields. So the topology has one writer,
  and request greenlets only acquire and release slots. The writer also ticks itself
  every ``TICK_SECONDS``.
- **Acting on effects** (``Actor``): after a core call returns, the waiters it handed a
  slot to are woken (each waiter's ``token`` is its ``gevent.event.Event``), the slots it
  lent are offered to the activator's slot exchange (``workers: N``), each pod state
  change is logged and counted once, and when pod states changed, the probes are synced
  (started for newly probed pods, stopped for the others). Request greenlets use
  the same actor for what their ``release`` hands over.
- **Launched pods** (``process.launcher.Launching``): the launcher's decisions are made in the
  writer's steps too, after each new config, at each tick, and on its own events
  (``LaunchCheck``, ``PodEnded``); what they change in the topology (a pod drained
  before its stop, waiters given up) is acted on like any other effects.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import gevent
from gevent.event import Event as Flag
from gevent.queue import Empty, Queue

from ..core.autoscale import LaunchCheck, LaunchEvent, PodEnded
from ..core.config import Config
from ..core.events import ConfigChanged, Event, ProbeReport, Tick
from ..core.probes import Verdict
from ..core.throttler import Effects, Grant, ServiceThrottler, Transition
from ..core.topology import Topology

log = logging.getLogger("activator")

#: How often the writer ticks (drain timeouts, retired services).
TICK_SECONDS = 0.5


class LaunchHandler(Protocol):
    """Launched pods' decisions (``process.launcher.Launching``), made in the writer's steps."""

    def configure(self, config: Config, now: float) -> Effects: ...
    def step(self, now: float, sample: bool | None = None) -> Effects: ...
    def handle(self, event: LaunchEvent, now: float) -> Effects: ...
    def probed(self, service: str, address: str, now: float) -> Effects: ...


class TransitionSink(Protocol):
    def transition(self, transition: Transition) -> None: ...


class Actor:
    """Acts on ``Effects`` (see the module docstring). ``act`` does not yield."""

    def __init__(
        self,
        observer: TransitionSink,
        on_states_changed: Callable[[], None] = lambda: None,
        lend: Callable[[ServiceThrottler, Grant], None] | None = None,
    ) -> None:
        self.observer = observer
        self.on_states_changed = on_states_changed
        #: Where lent slots go (``sharing.SlotSharing.offer``); None: a single process.
        self.lend = lend

    def act(self, effects: Effects) -> None:
        if not effects:
            return
        for waiter in effects.woken:
            waiter.token.set()
        if effects.lent:
            assert self.lend is not None, "a slot lent without a slot exchange"
            for throttler, grant in effects.lent:
                self.lend(throttler, grant)
        if effects.transitions:
            for transition in effects.transitions:
                self.observer.transition(transition)
            self.on_states_changed()


class TopologyWriter:
    """The greenlet that applies topology events (see the module docstring)."""

    def __init__(
        self,
        topology: Topology,
        actor: Actor,
        on_applied: Callable[[Event], None] = lambda event: None,
        tick: float = TICK_SECONDS,
    ) -> None:
        self.topology = topology
        self.actor = actor
        #: Called right after each event was applied, in the same step (after a new
        #: configuration the runtime swaps the settings that live outside the topology).
        self.on_applied = on_applied
        self.tick = tick
        #: Launched pods (``process.launcher.Launching``): decided in the writer's steps too.
        self.launching: LaunchHandler | None = None
        self._events: Queue[tuple[Event | LaunchEvent, Flag | None]] = Queue()
        self._greenlet: gevent.Greenlet | None = None

    def start(self) -> None:
        self._greenlet = gevent.spawn(self._run)

    def stop(self) -> None:
        if self._greenlet is not None:
            self._greenlet.kill(block=False)

    def post(self, event: Event | LaunchEvent, done: Flag | None = None) -> None:
        """Queue ``event`` for the writer; ``done`` is set once it was applied. Does not yield."""
        self._events.put_nowait((event, done))

    def apply(self, event: Event | LaunchEvent) -> None:
        """Apply one event and act on its effects. The writer's step: does not yield."""
        now = time.monotonic()
        launching = self.launching
        if isinstance(event, (LaunchCheck, PodEnded)):
            if launching is not None:
                self.actor.act(launching.handle(event, now))
            return
        effects = self.topology.handle(event, now)
        self.on_applied(event)
        self.actor.act(effects)
        if launching is not None:
            if isinstance(event, ConfigChanged):
                self.actor.act(launching.configure(event.config, now))
            elif isinstance(event, Tick):
                self.actor.act(launching.step(now))
            elif isinstance(event, ProbeReport) and event.verdict is Verdict.PASS:  # a booting pod may be ready
                self.actor.act(launching.probed(event.service, event.address, now))

    def _run(self) -> None:
        next_tick = time.monotonic() + self.tick
        while True:
            try:
                event, done = self._events.get(timeout=max(0.0, next_tick - time.monotonic()))
            except Empty:
                pass
            else:
                self._apply_logged(event)
                if done is not None:
                    done.set()
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self.tick
                self._apply_logged(Tick())

    def _apply_logged(self, event: Event) -> None:
        try:
            self.apply(event)
        except Exception:  # a bug: the writer must live on; the event is lost, said once
            log.exception("topology writer failed to apply %r", event)

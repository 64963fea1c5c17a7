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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import gevent
from gevent.event import Event as Flag
from gevent.queue import Empty, Queue

from ..core.events import Event, Tick
from ..core.throttler import Effects, Grant, ServiceThrottler, Transition
from ..core.topology import Topology

log = logging.getLogger("activator")

#: How often the writer ticks (drain timeouts, retired services).
TICK_SECONDS = 0.5


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
        self._events: Queue[tuple[Event, Flag | None]] = Queue()
        self._greenlet: gevent.Greenlet | None = None

    def start(self) -> None:
        self._greenlet = gevent.spawn(self._run)

    def stop(self) -> None:
        if self._greenlet is not None:
            self._greenlet.kill(block=False)

    def post(self, event: Event, done: Flag | None = None) -> None:
        """Queue ``event`` for the writer; ``done`` is set once it was applied. Does not yield."""
        self._events.put_nowait((event, done))

    def apply(self, event: Event) -> None:
        """Apply one event and act on its effects. The writer's step: does not yield."""
        effects = self.topology.handle(event, time.monotonic())
        self.on_applied(event)
        self.actor.act(effects)

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

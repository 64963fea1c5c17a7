"""The pod state machine: one transition table, and nothing else decides a pod's state.

States (SPEC.md "Pod states"):

- ``pending``: listed, not (yet, or no longer) taking traffic: new, or failing probes
  or connections. Probes bring it to ``healthy``.
- ``healthy``: takes new requests; its slots count toward capacity.
- ``draining``: unlisted or ``drain: true``; takes nothing new, its in-flight
  requests finish. Becomes ``removed`` when its last request is released, or when
  ``drain_timeout`` passes.
- ``removed``: takes nothing and (normally) runs nothing. Kept while still listed
  with ``drain: true``, or while requests forced past ``drain_timeout`` still run.

Events are what happened, not what to do. The applier of a config diff sends
``LISTED`` / ``UNLISTED`` / ``DRAIN_SET`` / ``DRAIN_CLEARED`` only when the pod's
listing actually changed; probes and passive failures send their events only for
pods they watch (``pending`` and ``healthy``). A pair missing from the table is
impossible by construction and raises ``IllegalTransition``.

A pod's in-flight count is not part of its state: the tracker keeps it through every
transition (the bug this project exists to fix is a count lost on a state change).
"""

from __future__ import annotations

import enum


class PodState(enum.Enum):
    PENDING = "pending"
    HEALTHY = "healthy"
    DRAINING = "draining"
    REMOVED = "removed"


class PodEvent(enum.Enum):
    LISTED = "listed"  # appears in the file again (new pods are created pending instead)
    UNLISTED = "unlisted"  # disappears from the file
    DRAIN_SET = "drain-set"  # still listed, now with drain: true
    DRAIN_CLEARED = "drain-cleared"  # still listed, drain: true removed
    PROBE_PASSED = "probe-passed"  # healthy_after consecutive passes (at once when probe: null)
    PROBE_FAILED = "probe-failed"  # unhealthy_after consecutive failures
    CONNECT_FAILED = "connect-failed"  # unhealthy_after consecutive failures on real traffic
    LAST_RELEASED = "last-released"  # its in-flight count reached zero
    DRAIN_TIMEOUT = "drain-timeout"  # drain_timeout passed while draining


class IllegalTransition(Exception):
    """An event that cannot happen in this state: a bug in the caller."""


P, H, D, R = PodState.PENDING, PodState.HEALTHY, PodState.DRAINING, PodState.REMOVED
E = PodEvent

# (state, event) -> next state. Every pair not listed raises.
TRANSITIONS: dict[tuple[PodState, PodEvent], PodState] = {
    # pending: listed and wanted, not yet proven
    (P, E.UNLISTED): D,
    (P, E.DRAIN_SET): D,
    (P, E.PROBE_PASSED): H,
    (P, E.PROBE_FAILED): P,
    (P, E.CONNECT_FAILED): P,
    (P, E.LAST_RELEASED): P,
    # healthy: takes traffic
    (H, E.UNLISTED): D,
    (H, E.DRAIN_SET): D,
    (H, E.PROBE_PASSED): H,
    (H, E.PROBE_FAILED): P,
    (H, E.CONNECT_FAILED): P,
    (H, E.LAST_RELEASED): H,
    # draining: unwanted, requests finishing. Wanted again -> proven again.
    (D, E.LISTED): P,
    (D, E.DRAIN_CLEARED): P,
    (D, E.UNLISTED): D,
    (D, E.DRAIN_SET): D,
    (D, E.CONNECT_FAILED): D,
    (D, E.LAST_RELEASED): R,
    (D, E.DRAIN_TIMEOUT): R,
    # removed: unwanted, (normally) idle
    (R, E.LISTED): P,
    (R, E.DRAIN_CLEARED): P,
    (R, E.UNLISTED): R,
    (R, E.DRAIN_SET): R,
    (R, E.CONNECT_FAILED): R,
    (R, E.LAST_RELEASED): R,
}

del P, H, D, R, E


def next_state(state: PodState, event: PodEvent) -> PodState:
    """The state after ``event``; raises ``IllegalTransition`` for an impossible pair."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"event {event.value} cannot happen to a {state.value} pod") from None

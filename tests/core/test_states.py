"""The pod state machine: every (state, event) pair, h11 ``_state.py`` style.

Each pair either appears in ``TRANSITIONS`` and leads to its next state, or is
impossible and raises ``IllegalTransition``. The named cases below spell out the
ones the SPEC relies on.
"""

from __future__ import annotations

import itertools

import pytest

from activator.core.states import TRANSITIONS, IllegalTransition, PodEvent, PodState, next_state

P, H, D, R = PodState.PENDING, PodState.HEALTHY, PodState.DRAINING, PodState.REMOVED
E = PodEvent

# The table as the SPEC reads it, written out independently of the module: a change
# to the module's table must be a deliberate change here too.
EXPECTED: dict[tuple[PodState, PodEvent], PodState] = {
    (P, E.UNLISTED): D,
    (P, E.DRAIN_SET): D,
    (P, E.PROBE_PASSED): H,
    (P, E.PROBE_FAILED): P,
    (P, E.CONNECT_FAILED): P,
    (P, E.LAST_RELEASED): P,
    (H, E.UNLISTED): D,
    (H, E.DRAIN_SET): D,
    (H, E.PROBE_PASSED): H,
    (H, E.PROBE_FAILED): P,
    (H, E.CONNECT_FAILED): P,
    (H, E.LAST_RELEASED): H,
    (D, E.LISTED): P,
    (D, E.DRAIN_CLEARED): P,
    (D, E.UNLISTED): D,
    (D, E.DRAIN_SET): D,
    (D, E.CONNECT_FAILED): D,
    (D, E.LAST_RELEASED): R,
    (D, E.DRAIN_TIMEOUT): R,
    (R, E.LISTED): P,
    (R, E.DRAIN_CLEARED): P,
    (R, E.UNLISTED): R,
    (R, E.DRAIN_SET): R,
    (R, E.CONNECT_FAILED): R,
    (R, E.LAST_RELEASED): R,
}

ALL_PAIRS = list(itertools.product(PodState, PodEvent))


def _id(pair: tuple[PodState, PodEvent]) -> str:
    return f"{pair[0].value}+{pair[1].value}"


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=[_id(p) for p in ALL_PAIRS])
def test_every_state_event_pair(pair: tuple[PodState, PodEvent]) -> None:
    state, event = pair
    if pair in EXPECTED:
        assert next_state(state, event) is EXPECTED[pair]
    else:
        with pytest.raises(IllegalTransition) as info:
            next_state(state, event)
        # The message names both, for the log line of a bug report.
        assert state.value in str(info.value) and event.value in str(info.value)


def test_module_table_matches_the_expected_table() -> None:
    assert TRANSITIONS == EXPECTED


def test_table_only_mentions_known_states_and_events() -> None:
    for (state, event), new in TRANSITIONS.items():
        assert isinstance(state, PodState) and isinstance(event, PodEvent) and isinstance(new, PodState)


def test_every_state_is_reachable_and_every_event_used() -> None:
    assert {new for new in TRANSITIONS.values()} == set(PodState)
    assert {event for _, event in TRANSITIONS} == set(PodEvent)


def test_illegal_transition_is_not_an_activator_error() -> None:
    # An impossible pair is a bug in the caller, not an answer to a client.
    from activator.core.errors import ActivatorError

    assert not issubclass(IllegalTransition, ActivatorError)


# -- named cases ---------------------------------------------------------------


def test_new_pod_becomes_healthy_when_its_probe_passes() -> None:
    assert next_state(P, E.PROBE_PASSED) is H


def test_healthy_pod_failing_probes_goes_back_to_pending() -> None:
    assert next_state(H, E.PROBE_FAILED) is P


def test_healthy_pod_failing_connections_goes_back_to_pending() -> None:
    assert next_state(H, E.CONNECT_FAILED) is P


@pytest.mark.parametrize("state", [P, H])
@pytest.mark.parametrize("event", [E.UNLISTED, E.DRAIN_SET])
def test_unwanted_pod_drains(state: PodState, event: PodEvent) -> None:
    assert next_state(state, event) is D


def test_draining_pod_is_removed_when_its_last_request_is_released() -> None:
    assert next_state(D, E.LAST_RELEASED) is R


def test_draining_pod_is_forced_out_after_drain_timeout() -> None:
    assert next_state(D, E.DRAIN_TIMEOUT) is R


@pytest.mark.parametrize("state", [D, R])
@pytest.mark.parametrize("event", [E.LISTED, E.DRAIN_CLEARED])
def test_pod_wanted_again_must_be_proven_again(state: PodState, event: PodEvent) -> None:
    # Re-listed or undrained: pending, never straight to healthy (probes decide, or
    # the throttler at once with probe: null). Its in-flight count is the tracker's,
    # not the state's, so it survives this transition.
    assert next_state(state, event) is P


@pytest.mark.parametrize("state", [P, H])
@pytest.mark.parametrize("event", [E.LISTED, E.DRAIN_CLEARED])
def test_a_wanted_pod_cannot_be_listed_again(state: PodState, event: PodEvent) -> None:
    with pytest.raises(IllegalTransition):
        next_state(state, event)


@pytest.mark.parametrize("state", [P, H, R])
def test_drain_timeout_only_happens_while_draining(state: PodState) -> None:
    with pytest.raises(IllegalTransition):
        next_state(state, E.DRAIN_TIMEOUT)


@pytest.mark.parametrize("state", [D, R])
@pytest.mark.parametrize("event", [E.PROBE_PASSED, E.PROBE_FAILED])
def test_probes_do_not_judge_unwanted_pods(state: PodState, event: PodEvent) -> None:
    with pytest.raises(IllegalTransition):
        next_state(state, event)


def test_connect_failure_on_a_draining_pod_keeps_it_draining() -> None:
    assert next_state(D, E.CONNECT_FAILED) is D

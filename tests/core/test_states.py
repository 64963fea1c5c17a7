"""The pod state machine: every (state, event) pair, h11 ``_state.py`` style.

The expected table is not a copy of ``TRANSITIONS``: it is derived below from what the
states are (SPEC.md "Pod states", in its words) and what each event means. Each pair
either can happen and leads to the state the rules give, or cannot happen and raises
``IllegalTransition``. The named cases at the end spell out the ones the SPEC relies on.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from activator.core.states import TRANSITIONS, IllegalTransition, PodEvent, PodState, next_state

P, H, D, R = PodState.PENDING, PodState.HEALTHY, PodState.DRAINING, PodState.REMOVED
E = PodEvent


@dataclass(frozen=True)
class Meaning:
    """What a state means, in the words of SPEC.md's table of pod states."""

    #: "takes new requests" (and so "counts toward capacity": the same column).
    takes_new_requests: bool
    #: Listed without ``drain: true``: the operator wants it serving (pending or healthy).
    wanted: bool
    #: "its in-flight requests finish": it is on its way out, requests still running.
    finishing: bool


SPEC_STATES: dict[PodState, Meaning] = {
    P: Meaning(takes_new_requests=False, wanted=True, finishing=False),  # "new, or failing probes"
    H: Meaning(takes_new_requests=True, wanted=True, finishing=False),
    D: Meaning(takes_new_requests=False, wanted=False, finishing=True),  # "its in-flight requests finish"
    R: Meaning(takes_new_requests=False, wanted=False, finishing=False),  # "nothing in flight"
}


def the_state(**meaning: bool) -> PodState:
    """The one state with this meaning (so that the rules below name no state by hand)."""
    (state,) = [s for s, m in SPEC_STATES.items() if all(getattr(m, k) == v for k, v in meaning.items())]
    return state


#: Wanted, not taking requests: where a pod is until it is proven (SPEC: "a new pod starts pending").
UNPROVEN = the_state(wanted=True, takes_new_requests=False)
SERVING = the_state(takes_new_requests=True)
FINISHING = the_state(finishing=True)
GONE = the_state(wanted=False, finishing=False)


def expected_next(state: PodState, event: PodEvent) -> PodState | None:
    """The rules, per event: what it means, to which states it can happen, where it
    leads. ``None``: it cannot happen to a pod in ``state``."""
    meaning = SPEC_STATES[state]
    if event in (E.LISTED, E.DRAIN_CLEARED):
        # Wanted again (listed again, or drain: true removed). A wanted pod is listed
        # without drain already, so only an unwanted one can be; it must be proven again.
        return UNPROVEN if not meaning.wanted else None
    if event in (E.UNLISTED, E.DRAIN_SET):
        # No longer wanted: it takes nothing new and its requests finish. An unwanted pod
        # (drained, then unlisted) stays as it is.
        return FINISHING if meaning.wanted else state
    if event in (E.PROBE_PASSED, E.PROBE_FAILED):
        # Probes only judge wanted pods (pending and healthy). A pass proves it; a
        # failure ("failing probes") makes it stop taking new requests.
        if not meaning.wanted:
            return None
        return SERVING if event is E.PROBE_PASSED else UNPROVEN
    if event is E.CONNECT_FAILED:
        # Requests run in every state, so their connections can fail in every state;
        # "whose connections fail that many times in a row, goes back to pending", and
        # only a pod that takes requests has anywhere to go back from.
        return UNPROVEN if meaning.takes_new_requests else state
    if event is E.LAST_RELEASED:
        # Its in-flight count reached zero, in any state; a finishing pod is then done.
        return GONE if meaning.finishing else state
    if event is E.DRAIN_TIMEOUT:
        # Only a finishing pod has a drain timeout; when it passes, the pod is forced out.
        return GONE if meaning.finishing else None
    raise AssertionError(f"no rule for {event}")


ALL_PAIRS = list(itertools.product(PodState, PodEvent))


def _id(pair: tuple[PodState, PodEvent]) -> str:
    return f"{pair[0].value}+{pair[1].value}"


def test_every_event_and_state_has_a_rule() -> None:
    assert set(SPEC_STATES) == set(PodState)
    for state, event in ALL_PAIRS:
        expected_next(state, event)  # raises for an event without a rule


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=[_id(p) for p in ALL_PAIRS])
def test_every_state_event_pair(pair: tuple[PodState, PodEvent]) -> None:
    state, event = pair
    expected = expected_next(state, event)
    if expected is not None:
        assert next_state(state, event) is expected
    else:
        with pytest.raises(IllegalTransition) as info:
            next_state(state, event)
        # The message names both, for the log line of a bug report.
        assert state.value in str(info.value) and event.value in str(info.value)


def test_the_table_holds_exactly_the_pairs_that_can_happen() -> None:
    possible = {pair for pair in ALL_PAIRS if expected_next(*pair) is not None}
    assert set(TRANSITIONS) == possible


def test_table_only_mentions_known_states_and_events() -> None:
    for (state, event), new in TRANSITIONS.items():
        assert isinstance(state, PodState) and isinstance(event, PodEvent) and isinstance(new, PodState)


def test_every_state_is_reachable_and_every_event_used() -> None:
    assert set(TRANSITIONS.values()) == set(PodState)
    assert {event for _, event in TRANSITIONS} == set(PodEvent)


def test_only_a_passed_probe_makes_a_pod_take_requests() -> None:
    # SPEC: a new pod "becomes healthy once its probe passes" (at once with probe: null,
    # which the throttler sends as a pass); no listing change proves a pod.
    for (state, event), new in TRANSITIONS.items():
        if SPEC_STATES[new].takes_new_requests and not SPEC_STATES[state].takes_new_requests:
            assert event is E.PROBE_PASSED, (state, event)


def test_an_unwanted_pod_never_takes_requests_before_it_is_wanted_again() -> None:
    for (state, event), new in TRANSITIONS.items():
        if not SPEC_STATES[state].wanted and event not in (E.LISTED, E.DRAIN_CLEARED):
            assert not SPEC_STATES[new].wanted, (state, event)


def test_illegal_transition_is_not_an_activator_error() -> None:
    # An impossible pair is a bug in the caller, not an answer to a client.
    from activator.core.errors import ActivatorError

    assert not issubclass(IllegalTransition, ActivatorError)


# -- named cases ---------------------------------------------------------------


def test_the_rules_name_the_states_the_spec_names() -> None:
    assert (UNPROVEN, SERVING, FINISHING, GONE) == (P, H, D, R)


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

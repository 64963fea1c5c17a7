"""Tests for activator.core.peering: the rules peers check each other by.

What they prove:

- **Proof.** ``prove`` then ``verify`` gives back the sender's name (any peer name, and a
  sibling worker's ``worker N`` with its space); a changed body, name or stamp, another
  secret, a stamp more than ``MAX_CLOCK_SKEW`` seconds off either way, and a missing or
  malformed header each raise PeerAuthError saying which.
- **Wire format.** Check and Answer survive encode -> decode; anything else decodes to a
  ValueError (not JSON, not an object, a bad scope, a negative / bool / float count, a
  capacity that is not a count or null). A deeply nested body is a known exception (xfail).
- **merge_answers** sums in-use counts and capacities, an unlimited (None) capacity
  absorbing any count; **capped** takes each own pod down to the smallest cap given it.
- **Health.** ``PeerHealth`` goes down after ``unhealthy_after`` unanswered checks in a
  row (reporting the change once), comes back up on one answer, and reports capacity.
- **Hand-over.** A planned gain is held until every holder has answered a check asked
  at or after the plan with ``in use <= its share``, or until its deadline (``expire``);
  ``deadline=None`` waits for an answer forever.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from activator.core.peering import (
    ACTIVATOR_SCOPE,
    MAX_CLOCK_SKEW,
    WORKER_SCOPE,
    Answer,
    Check,
    HandOvers,
    Holder,
    PeerAuthError,
    PeerHealth,
    PeerState,
    capped,
    decode_answer,
    decode_check,
    encode_answer,
    encode_check,
    merge_answers,
    prove,
    verify,
)

SECRET = "s3cret"
NOW = 1_700_000_000.0
BODY = b'{"sender": "vm-a", "scope": "activator", "view": {}}'

#: Peer names as the config allows them (A-Z a-z 0-9 _ . -), and sibling workers' names.
PEER_NAMES = st.text(alphabet="ABCXYZabcxyz0189_.-", min_size=1, max_size=20)
NAMES = st.one_of(PEER_NAMES, st.integers(0, 63).map(lambda i: f"worker {i}"))
COUNTS = st.dictionaries(
    st.text(max_size=8),
    st.dictionaries(st.text(max_size=12), st.integers(0, 10_000), max_size=4),
    max_size=4,
)
CAPACITIES = st.dictionaries(st.text(max_size=8), st.none() | st.integers(0, 10_000), max_size=4)


# -- proof --------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    secret=st.text(min_size=1, max_size=30),
    name=NAMES,
    body=st.binary(max_size=200),
    now=st.floats(0, 4e9),
    drift=st.floats(-MAX_CLOCK_SKEW + 1, MAX_CLOCK_SKEW - 1),
)
def test_prove_then_verify_gives_the_senders_name(
    secret: str, name: str, body: bytes, now: float, drift: float
) -> None:
    proof = prove(secret, name, now, body)
    assert verify(secret, proof, body, now + drift) == name


def test_a_workers_name_with_a_space_verifies() -> None:
    proof = prove(SECRET, "worker 1", NOW, BODY)
    assert proof.startswith(b"worker 1 1700000000 ")
    assert verify(SECRET, proof, BODY, NOW) == "worker 1"


def test_a_changed_body_is_refused() -> None:
    proof = prove(SECRET, "vm-a", NOW, BODY)
    with pytest.raises(PeerAuthError, match="does not match"):
        verify(SECRET, proof, BODY.replace(b"vm-a", b"vm-b"), NOW)
    with pytest.raises(PeerAuthError, match="does not match"):
        verify(SECRET, proof, BODY + b" ", NOW)


def test_another_secret_is_refused() -> None:
    proof = prove(SECRET, "vm-a", NOW, BODY)
    with pytest.raises(PeerAuthError, match="another secret"):
        verify("other", proof, BODY, NOW)


@pytest.mark.parametrize("name", ["vm-b", "vm-a ", "worker 1"])
def test_a_proof_relabelled_with_another_name_is_refused(name: str) -> None:
    mac = prove(SECRET, "vm-a", NOW, BODY).rsplit(b" ", 1)[1]
    with pytest.raises(PeerAuthError, match="does not match"):
        verify(SECRET, b"%s %d %s" % (name.encode(), int(NOW), mac), BODY, NOW)


def test_a_proof_with_a_changed_stamp_is_refused() -> None:
    name, stamp, mac = prove(SECRET, "vm-a", NOW, BODY).split(b" ")
    with pytest.raises(PeerAuthError, match="does not match"):
        verify(SECRET, b"%s %d %s" % (name, int(stamp) + 1, mac), BODY, NOW)


@pytest.mark.parametrize("drift", [MAX_CLOCK_SKEW, -MAX_CLOCK_SKEW])
def test_a_stamp_at_the_allowed_skew_is_accepted(drift: float) -> None:
    assert verify(SECRET, prove(SECRET, "vm-a", NOW, BODY), BODY, NOW + drift) == "vm-a"


@pytest.mark.parametrize(("drift", "shown"), [(MAX_CLOCK_SKEW + 1, "+301 s off"), (-MAX_CLOCK_SKEW - 1, "-301 s off")])
def test_a_stamp_beyond_the_allowed_skew_is_refused(drift: float, shown: str) -> None:
    proof = prove(SECRET, "vm-a", NOW, BODY)  # a valid MAC: only the time is wrong
    with pytest.raises(PeerAuthError, match=re.escape(shown)):
        verify(SECRET, proof, BODY, NOW + drift)


def test_a_missing_header_is_refused() -> None:
    with pytest.raises(PeerAuthError, match="no Activator-Peer header"):
        verify(SECRET, None, BODY, NOW)


@pytest.mark.parametrize(
    "proof",
    [
        b"",
        b"vm-a",
        b"vm-a 1700000000",  # no MAC
        b"vm-a soon 0123abcd",  # a stamp that is not a number
        b"vm-a 1700000000.5 0123abcd",  # nor an integer
        "vm-\u00e4 1700000000 0123abcd".encode(),  # not ASCII
        b"\xff\xfe 1700000000 0123abcd",
    ],
)
def test_a_malformed_header_is_refused(proof: bytes) -> None:
    with pytest.raises(PeerAuthError, match="malformed"):
        verify(SECRET, proof, BODY, NOW)


# -- checks and answers --------------------------------------------------------------------


@given(sender=NAMES, scope=st.sampled_from([ACTIVATOR_SCOPE, WORKER_SCOPE]), view=COUNTS)
def test_a_check_survives_encode_and_decode(sender: str, scope: str, view: dict[str, dict[str, int]]) -> None:
    check = Check(sender, scope, view)
    assert decode_check(encode_check(check)) == check


@given(name=NAMES, in_use=COUNTS, capacity=CAPACITIES, listed=st.booleans())
def test_an_answer_survives_encode_and_decode(
    name: str, in_use: dict[str, dict[str, int]], capacity: dict[str, int | None], listed: bool
) -> None:
    answer = Answer(name, in_use, capacity, listed)
    assert decode_answer(encode_answer(answer)) == answer


def test_merged_answers_are_listed_only_if_every_worker_lists_the_checker() -> None:
    both = merge_answers("vm-a", [Answer("w0", {}, {}), Answer("w1", {}, {}, listed=False)])
    assert not both.listed
    assert merge_answers("vm-a", [Answer("w0", {}, {}), Answer("w1", {}, {})]).listed


def _json(value: object) -> bytes:
    return json.dumps(value).encode()


GOOD_CHECK = {"sender": "vm-a", "scope": "activator", "view": {"api": {"10.0.0.1:80": 1}}}
GOOD_ANSWER = {"name": "vm-a", "in_use": {"api": {"10.0.0.1:80": 1}}, "capacity": {"api": 2, "web": None}}


def test_the_good_bodies_decode() -> None:
    # (so that each malformed body below is refused for its one defect)
    assert decode_check(_json(GOOD_CHECK)) == Check("vm-a", "activator", {"api": {"10.0.0.1:80": 1}})
    assert decode_answer(_json(GOOD_ANSWER)).capacity == {"api": 2, "web": None}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "not JSON"),
        (b"{", "not JSON"),
        (b"\xff\xfe\x00", "not JSON"),
        (b"[]", "not a JSON object"),
        (b'"check"', "not a JSON object"),
        (_json({**GOOD_CHECK, "scope": "everyone"}), "sender and a scope"),
        (_json({k: v for k, v in GOOD_CHECK.items() if k != "sender"}), "sender and a scope"),
        (_json({**GOOD_CHECK, "sender": 7}), "sender and a scope"),
        (_json({k: v for k, v in GOOD_CHECK.items() if k != "view"}), "mapping of service"),
        (_json({**GOOD_CHECK, "view": []}), "mapping of service"),
        (_json({**GOOD_CHECK, "view": {"api": [1]}}), "mapping of service"),
        (_json({**GOOD_CHECK, "view": {"api": {"p": -1}}}), "non-negative integer"),
        (_json({**GOOD_CHECK, "view": {"api": {"p": True}}}), "non-negative integer"),
        (_json({**GOOD_CHECK, "view": {"api": {"p": 1.0}}}), "non-negative integer"),
        (_json({**GOOD_CHECK, "view": {"api": {"p": "1"}}}), "non-negative integer"),
    ],
)
def test_a_malformed_check_is_a_value_error(body: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_check(body)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"nope", "not JSON"),
        (b"null", "not a JSON object"),
        (_json({k: v for k, v in GOOD_ANSWER.items() if k != "name"}), "a name and capacities"),
        (_json({**GOOD_ANSWER, "capacity": [2]}), "a name and capacities"),
        (_json({**GOOD_ANSWER, "capacity": {"api": "2"}}), "a count or null"),
        (_json({**GOOD_ANSWER, "capacity": {"api": True}}), "a count or null"),
        (_json({**GOOD_ANSWER, "capacity": {"api": 1.5}}), "a count or null"),
        (_json({k: v for k, v in GOOD_ANSWER.items() if k != "in_use"}), "mapping of service"),
        (_json({**GOOD_ANSWER, "in_use": {"api": {"p": -3}}}), "non-negative integer"),
    ],
)
def test_a_malformed_answer_is_a_value_error(body: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_answer(body)


@pytest.mark.parametrize(
    "body",
    [b"[" * 5000, b'{"sender": "x", "scope": "activator", "view": ' + b'{"a": ' * 5000],
)
def test_a_deeply_nested_body_is_a_value_error(body: bytes) -> None:
    with pytest.raises(ValueError):
        decode_check(body)
    with pytest.raises(ValueError):
        decode_answer(body)


# -- merged answers ---------------------------------------------------------------------------


def test_merged_answers_sum_counts_and_capacities() -> None:
    one = Answer("worker 0", {"api": {"p1": 1, "p2": 2}}, {"api": 3, "web": 1})
    two = Answer("worker 1", {"api": {"p2": 5, "p3": 1}, "web": {"w": 4}}, {"api": 2, "db": 0})
    merged = merge_answers("vm-a", [one, two])
    assert merged == Answer(
        "vm-a",
        {"api": {"p1": 1, "p2": 7, "p3": 1}, "web": {"w": 4}},
        {"api": 5, "web": 1, "db": 0},
    )
    assert one.in_use == {"api": {"p1": 1, "p2": 2}}  # the inputs are left alone


@pytest.mark.parametrize(
    ("capacities", "total"),
    [
        ([None, 3], None),
        ([3, None], None),
        ([2, None, 5], None),
        ([None, None], None),
        ([0, 0], 0),
        ([4], 4),
    ],
)
def test_an_unlimited_capacity_absorbs_the_counts(capacities: list[int | None], total: int | None) -> None:
    answers = [Answer(f"worker {i}", {}, {"api": c}) for i, c in enumerate(capacities)]
    assert merge_answers("vm-a", answers).capacity == {"api": total}


def test_merging_no_answers_is_an_empty_answer() -> None:
    assert merge_answers("vm-a", []) == Answer("vm-a", {}, {})


@given(st.lists(st.tuples(COUNTS, CAPACITIES), max_size=5))
def test_merged_counts_are_the_sums(parts: list[tuple[dict[str, dict[str, int]], dict[str, int | None]]]) -> None:
    merged = merge_answers("vm-a", [Answer(f"worker {i}", u, c) for i, (u, c) in enumerate(parts)])
    for service in {s for u, _ in parts for s in u}:
        for pod in {p for u, _ in parts for p in u.get(service, {})}:
            assert merged.in_use[service][pod] == sum(u.get(service, {}).get(pod, 0) for u, _ in parts)
    for service in {s for _, c in parts for s in c}:
        given_ = [c[service] for _, c in parts if service in c]
        assert merged.capacity[service] == (None if None in given_ else sum(n for n in given_ if n is not None))


# -- caps --------------------------------------------------------------------------------------


def test_capped_takes_each_pod_to_its_smallest_cap() -> None:
    own = {"p1": 3, "p2": 2, "p3": 1}
    caps = [{"p1": 2, "p2": 5, "other": 0}, {"p1": 1}, {}]
    assert capped(own, caps) == {"p1": 1, "p2": 2, "p3": 1}  # p2's larger cap raises nothing
    assert own == {"p1": 3, "p2": 2, "p3": 1}


def test_capped_without_caps_is_a_copy() -> None:
    own = {"p1": 3}
    result = capped(own, [])
    assert result == own and result is not own


@given(
    own=st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 5)),
    caps=st.lists(st.dictionaries(st.sampled_from("abcdefgh"), st.integers(0, 5)), max_size=4),
)
def test_capped_is_the_minimum_over_the_caps_that_name_the_pod(own: dict[str, int], caps: list[dict[str, int]]) -> None:
    result = capped(own, caps)
    assert set(result) == set(own)
    for pod, n in own.items():
        assert result[pod] == min([n, *(cap[pod] for cap in caps if pod in cap)])


# -- health ------------------------------------------------------------------------------------


def answer(capacity: dict[str, int | None] | None = None) -> Answer:
    return Answer("vm-b", {}, capacity or {})


def test_a_peer_goes_down_after_unhealthy_after_unanswered_checks_in_a_row() -> None:
    peer = PeerHealth("vm-b", "10.0.0.2:8080", since=0.0)
    assert peer.state is PeerState.UNKNOWN and peer.usable  # not checked yet: trusted
    assert peer.unanswered("timed out", 1.0, unhealthy_after=3) is False
    assert peer.unanswered("timed out", 2.0, unhealthy_after=3) is False
    assert peer.state is PeerState.UNKNOWN and peer.usable and peer.failures == 2
    assert peer.unanswered("refused", 3.0, unhealthy_after=3) is True  # the change, reported once
    assert peer.state is PeerState.DOWN and not peer.usable
    assert (peer.since, peer.last_error, peer.failures) == (3.0, "refused", 3)
    assert peer.unanswered("refused", 4.0, unhealthy_after=3) is False
    assert peer.since == 3.0


def test_one_answer_brings_a_down_peer_back_up() -> None:
    peer = PeerHealth("vm-b", "10.0.0.2:8080")
    peer.unanswered("timed out", 1.0, unhealthy_after=1)
    assert peer.state is PeerState.DOWN
    assert peer.answered(answer({"api": 2}), 5.0) is True
    assert peer.state is PeerState.UP and peer.usable
    assert (peer.failures, peer.last_error, peer.last_answer, peer.since) == (0, "", 5.0, 5.0)
    assert peer.answered(answer({"api": 2}), 6.0) is False  # no change: not reported
    assert peer.since == 5.0 and peer.last_answer == 6.0


def test_the_first_answer_is_a_change_to_up() -> None:
    peer = PeerHealth("vm-b", "10.0.0.2:8080")
    assert peer.answered(answer(), 1.0) is True
    assert peer.state is PeerState.UP


def test_an_answer_resets_the_unanswered_count() -> None:
    peer = PeerHealth("vm-b", "10.0.0.2:8080")
    peer.answered(answer(), 0.0)
    for t in (1.0, 2.0):
        peer.unanswered("timed out", t, unhealthy_after=3)
    peer.answered(answer(), 3.0)
    for t in (4.0, 5.0):
        assert peer.unanswered("timed out", t, unhealthy_after=3) is False
    assert peer.state is PeerState.UP  # 2 + 2 failures, never 3 in a row


def test_capacity_is_the_last_answers() -> None:
    peer = PeerHealth("vm-b", "10.0.0.2:8080")
    assert not peer.has_capacity("api")  # nothing reported yet
    peer.answered(answer({"api": 2, "web": 0, "unlimited": None}), 1.0)
    assert peer.has_capacity("api") and peer.has_capacity("unlimited")
    assert not peer.has_capacity("web") and not peer.has_capacity("db")
    peer.answered(answer({"api": 0}), 2.0)
    assert not peer.has_capacity("api") and not peer.has_capacity("unlimited")


def test_health_snapshot() -> None:
    peer = PeerHealth("vm-b", "10.0.0.2:8080", since=1.0)
    assert peer.snapshot(3.0) == {
        "address": "10.0.0.2:8080",
        "state": "unknown",
        "failures": 0,
        "seconds_in_state": 2.0,
        "last_answer_seconds_ago": None,
        "last_error": None,
    }
    peer.answered(answer(), 4.0)
    peer.unanswered("refused", 5.0, unhealthy_after=2)
    snap = peer.snapshot(6.5)
    assert (snap["state"], snap["failures"], snap["seconds_in_state"]) == ("up", 1, 2.5)
    assert (snap["last_answer_seconds_ago"], snap["last_error"]) == (2.5, "refused")


# -- hand-over ---------------------------------------------------------------------------------


def in_use(n: int, pod: str = "p1", service: str = "api") -> dict[str, dict[str, int]]:
    return {service: {pod: n}}


def test_a_gain_is_held_until_its_holder_reports_its_share() -> None:
    h = HandOvers()
    h.plan("api", "p1", 3, {"vm-b": Holder(1, 2)}, now=10.0, deadline=None, cap=2)
    assert h.held("api", "p1") == 2 and h.held("api", "p2") == 0 and h.held("web", "p1") == 0
    assert h.waiting_on() == {"vm-b"}
    assert h.answered("vm-b", in_use(3), asked_at=11.0) == set()  # still two over its share
    assert h.held("api", "p1") == 2
    assert h.answered("vm-b", in_use(2), asked_at=11.5) == {"api"}  # one over: one released
    assert h.held("api", "p1") == 1
    assert h.answered("vm-b", in_use(3), asked_at=11.7) == set()  # (it cannot start more: a stale count)
    assert h.held("api", "p1") == 1
    assert h.answered("vm-b", in_use(1), asked_at=12.0) == {"api"}  # at its share: released
    assert h.held("api", "p1") == 0 and h.waiting_on() == set()


def test_only_a_check_asked_after_the_plan_counts() -> None:
    h = HandOvers()
    h.plan("api", "p1", 1, {"vm-b": Holder(0, 1)}, now=10.0, deadline=None)
    assert h.answered("vm-b", in_use(0), asked_at=9.5) == set()  # asked before the change
    assert h.held("api", "p1") == 1
    assert h.answered("vm-b", in_use(0), asked_at=10.5) == {"api"}


def test_a_pod_left_out_of_the_answer_counts_as_nothing_in_use() -> None:
    h = HandOvers()
    h.plan("api", "p1", 1, {"vm-b": Holder(0, 1)}, now=10.0, deadline=None)
    assert h.answered("vm-b", {"api": {"p2": 3}}, asked_at=11.0) == {"api"}


def test_every_holder_with_an_excess_must_answer() -> None:
    h = HandOvers()
    h.plan("api", "p1", 2, {"vm-b": Holder(0, 1), "vm-c": Holder(1, 1)}, now=10.0, deadline=None)
    assert h.answered("vm-d", in_use(0), asked_at=11.0) == set()  # not a holder
    assert h.answered("vm-b", in_use(0), asked_at=11.0) == {"api"}  # one of the two released
    assert h.held("api", "p1") == 1 and h.waiting_on() == {"vm-c"}
    assert h.answered("vm-b", in_use(0), asked_at=12.0) == set()  # already counted
    assert h.answered("vm-c", in_use(1), asked_at=12.0) == {"api"}
    assert h.held("api", "p1") == 0


def test_the_held_slots_are_at_most_the_cap_and_the_share() -> None:
    h = HandOvers()
    h.plan("api", "p1", 2, {"vm-b": Holder(0, 3)}, now=10.0, deadline=None, cap=1)
    assert h.held("api", "p1") == 1
    h.plan("api", "p1", 3, {}, now=11.0, deadline=None)  # our share grew with nothing to wait for
    assert h.held("api", "p1") == 1
    h.plan("api", "p2", 1, {"vm-b": Holder(0, 3)}, now=10.0, deadline=None)
    assert h.held("api", "p2") == 1


def test_one_answer_releases_every_pod_it_clears() -> None:
    h = HandOvers()
    h.plan("api", "p1", 1, {"vm-b": Holder(0, 1)}, now=10.0, deadline=None)
    h.plan("api", "p2", 1, {"vm-b": Holder(0, 1)}, now=10.0, deadline=None)
    h.plan("web", "w1", 1, {"vm-b": Holder(0, 1)}, now=10.0, deadline=None)
    released = h.answered("vm-b", {"api": {"p1": 0, "p2": 1}, "web": {"w1": 0}}, asked_at=11.0)
    assert released == {"api", "web"}
    assert (h.held("api", "p1"), h.held("api", "p2"), h.held("web", "w1")) == (0, 1, 0)


def test_a_gain_is_waited_out_at_its_deadline() -> None:
    h = HandOvers()
    h.plan("api", "p1", 1, {"vm-b": Holder(0, 1)}, now=10.0, deadline=40.0)
    assert h.expire(39.9) == set() and h.held("api", "p1") == 1
    assert h.expire(40.0) == {"api"}
    assert h.held("api", "p1") == 0 and h.waiting_on() == set()
    assert h.expire(41.0) == set()


def test_without_a_deadline_only_an_answer_releases() -> None:
    h = HandOvers()
    h.plan("api", "p1", 1, {"vm-b": Holder(0, 1)}, now=10.0, deadline=None)
    assert h.expire(1e12) == set()
    assert h.held("api", "p1") == 1
    assert h.answered("vm-b", in_use(0), asked_at=1e12) == {"api"}


@pytest.mark.parametrize(
    ("share", "holders", "cap"),
    [
        (0, {"vm-b": Holder(0, 1)}, None),
        (2, {"vm-b": Holder(0, 0)}, None),
        (2, {}, None),
        (2, {"vm-b": Holder(0, 1)}, 0),
    ],
)
def test_nothing_to_hold(share: int, holders: dict[str, Holder], cap: int | None) -> None:
    h = HandOvers()
    h.plan("api", "p1", share, holders, now=10.0, deadline=None, cap=cap)
    assert h.pending == {} and h.held("api", "p1") == 0


def test_a_gain_on_a_pending_one_waits_for_both_until_the_later_deadline() -> None:
    h = HandOvers()
    h.plan("api", "p1", 1, {"vm-b": Holder(0, 1)}, now=10.0, deadline=50.0)
    h.plan("api", "p1", 3, {"vm-c": Holder(1, 2)}, now=20.0, deadline=60.0, cap=2)
    assert h.held("api", "p1") == 3 and h.waiting_on() == {"vm-b", "vm-c"}
    # vm-b keeps its place: its answer to a check asked after its own plan counts
    assert h.answered("vm-c", in_use(0), asked_at=15.0) == set()  # (vm-c's: before its plan)
    assert h.answered("vm-b", in_use(0), asked_at=15.0) == {"api"}
    assert h.waiting_on() == {"vm-c"} and h.held("api", "p1") == 2
    assert h.expire(50.0) == set() and h.held("api", "p1") == 2
    assert h.expire(60.0) == {"api"}


@pytest.mark.parametrize(("first", "second"), [(None, 60.0), (50.0, None)])
def test_a_gain_without_a_deadline_on_a_pending_one_has_none(first: float | None, second: float | None) -> None:
    h = HandOvers()
    h.plan("api", "p1", 1, {"vm-b": Holder(0, 1)}, now=10.0, deadline=first)
    h.plan("api", "p1", 2, {"vm-c": Holder(0, 1)}, now=20.0, deadline=second, cap=1)
    assert h.expire(1e12) == set() and h.held("api", "p1") == 2


def test_a_share_that_falls_holds_no_more_than_itself() -> None:
    h = HandOvers()
    h.plan("api", "p1", 3, {"vm-b": Holder(0, 3)}, now=10.0, deadline=None)
    h.plan("api", "p1", 5, {}, now=11.0, deadline=None)
    assert h.held("api", "p1") == 3
    h.plan("api", "p1", 1, {}, now=11.0, deadline=None)
    assert h.held("api", "p1") == 1
    h.plan("api", "p1", 0, {}, now=11.0, deadline=None)
    assert h.held("api", "p1") == 0 and h.waiting_on() == {"vm-b"}  # (it may come back)
    h.plan("api", "p1", 2, {}, now=12.0, deadline=None)
    assert h.held("api", "p1") == 2  # back: vm-b still has not answered
    h.plan("api", "p9", 0, {}, now=11.0, deadline=None)  # nothing pending: nothing to do
    assert ("api", "p9") not in h.pending


def test_hand_over_snapshot() -> None:
    h = HandOvers()
    h.plan("api", "p2", 1, {"vm-c": Holder(0, 1), "vm-b": Holder(0, 1)}, now=10.0, deadline=40.0)
    h.plan("api", "p1", 2, {"vm-b": Holder(1, 2)}, now=12.0, deadline=None)
    h.plan("web", "w1", 1, {"vm-b": Holder(0, 1)}, now=12.0, deadline=None)
    assert h.snapshot("api", 20.0) == [
        {"pod": "p1", "slots": 2, "waiting_on": ["vm-b"], "seconds_waiting": 8.0, "seconds_left": None},
        {"pod": "p2", "slots": 1, "waiting_on": ["vm-b", "vm-c"], "seconds_waiting": 10.0, "seconds_left": 20.0},
    ]
    assert h.snapshot("api", 50.0)[1]["seconds_left"] == 0.0
    assert h.snapshot("db", 20.0) == []

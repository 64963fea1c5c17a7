"""Tests for activator.core.slots: the division of pod slots among peers.

Tables for the small cases, a brute-force oracle for the optimum, and hypothesis
properties for exact cover, balance, spread, order independence and the movement
bounds stated in the module docstring.
"""

from __future__ import annotations

import ast
import doctest
import hashlib
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from activator.core import slots
from activator.core.slots import Division, check_division, divide_slots, moved_slots, owned_slots, score

# --------------------------------------------------------------------------- helpers


def divide_checked(pods: Mapping[str, int], peers: Sequence[str]) -> Division:
    division = divide_slots(pods, peers)
    check_division(pods, peers, division)
    return division


def total(division: Division, peer: str) -> int:
    return sum(division[peer].values())


def brute_force(pods: Mapping[str, int], peers: Sequence[str]) -> Division:
    """The specified optimum, by enumeration: among balanced and spread divisions, the
    one with the greatest sum of score(peer, address) over the peers holding an extra."""
    names = sorted(peers)
    n = len(names)
    items = sorted((a, cc) for a, cc in pods.items() if cc > 0)
    options = []
    for address, cc in items:
        q, rem = divmod(cc, n)
        options.append(
            [
                (address, q, frozenset(c), sum(score(names[p], address) for p in c))
                for c in itertools.combinations(range(n), rem)
            ]
        )
    best: tuple[int, tuple[tuple[str, int, frozenset[int], int], ...]] | None = None
    for combo in itertools.product(*options):
        load = [0] * n
        for _, _, chosen, _ in combo:
            for p in chosen:
                load[p] += 1
        if n and max(load) - min(load) > 1:
            continue
        value = sum(c[3] for c in combo)
        if best is None or value > best[0]:
            best = (value, combo)
    assert best is not None
    out: Division = {name: {} for name in names}
    for address, q, chosen, _ in best[1]:
        for p, name in enumerate(names):
            count = q + (p in chosen)
            if count:
                out[name][address] = count
    return out


# ------------------------------------------------------------------------ strategies

peer_names = st.lists(
    st.one_of(st.from_regex(r"act-[0-9]{1,3}", fullmatch=True), st.text(min_size=1, max_size=6)),
    min_size=1,
    max_size=6,
    unique=True,
)
addresses = st.one_of(
    st.builds(
        lambda a, b, port: f"10.0.{a}.{b}:{port}",
        st.integers(0, 255),
        st.integers(0, 255),
        st.integers(1, 65535),
    ),
    st.text(min_size=1, max_size=10),
)
pod_sets = st.dictionaries(addresses, st.integers(0, 6), max_size=12)
limited_pod_sets = st.dictionaries(addresses, st.integers(1, 6), min_size=1, max_size=12)


# ----------------------------------------------------------------------------- tables


@pytest.mark.parametrize(
    ("pods", "peers", "expected"),
    [
        # One pod of cc 1 and three peers: one owns it, the others own nothing.
        ({"10.0.0.1:80": 1}, ["a", "b", "c"], {"a": {"10.0.0.1:80": 1}, "b": {}, "c": {}}),
        # No pods: every peer is a key and owns nothing.
        ({}, ["a", "b"], {"a": {}, "b": {}}),
        # A single peer owns every slot.
        (
            {"10.0.0.1:80": 3, "10.0.0.2:80": 1},
            ["solo"],
            {"solo": {"10.0.0.1:80": 3, "10.0.0.2:80": 1}},
        ),
        # cc=0 pods are unlimited: never divided, never listed.
        ({"10.0.0.1:80": 0, "10.0.0.2:80": 0}, ["a", "b"], {"a": {}, "b": {}}),
        ({"10.0.0.1:80": 0, "10.0.0.2:80": 1}, ["solo"], {"solo": {"10.0.0.2:80": 1}}),
        # No peers: nobody to divide among.
        ({"10.0.0.1:80": 2}, [], {}),
        # cc a multiple of the peer count: every peer gets cc // n of each pod.
        (
            {"10.0.0.1:80": 3, "10.0.0.2:80": 3},
            ["a", "b", "c"],
            {p: {"10.0.0.1:80": 1, "10.0.0.2:80": 1} for p in "abc"},
        ),
        ({"p": 4}, ["x", "y"], {"x": {"p": 2}, "y": {"p": 2}}),
        # Spread: cc=2, 2 peers, each peer gets one slot of every pod, never a whole pod.
        ({"p1": 2, "p2": 2, "p3": 2}, ["a", "b"], {p: {"p1": 1, "p2": 1, "p3": 1} for p in "ab"}),
        # The docstring's worked examples (pinned: the hash is fixed).
        (
            {"10.0.0.1:80": 1, "10.0.0.2:80": 1, "10.0.0.3:80": 1},
            ["a", "b"],
            {"a": {"10.0.0.1:80": 1, "10.0.0.2:80": 1}, "b": {"10.0.0.3:80": 1}},
        ),
        (
            {"10.0.0.1:80": 2, "10.0.0.2:80": 2, "10.0.0.9:80": 0},
            ["a", "b", "c"],
            {
                "a": {"10.0.0.1:80": 1, "10.0.0.2:80": 1},
                "b": {"10.0.0.2:80": 1},
                "c": {"10.0.0.1:80": 1},
            },
        ),
    ],
)
def test_table(pods: dict[str, int], peers: list[str], expected: Division) -> None:
    assert divide_checked(pods, peers) == expected


@pytest.mark.parametrize(
    ("pods", "peers", "totals"),
    [
        # Knative's PR gave activators with index >= pod count nothing; here anyone
        # with a slot to spare gets one: 5 slots, 4 peers.
        ({"a": 1, "b": 1, "c": 1, "d": 2}, ["w", "x", "y", "z"], [1, 1, 1, 2]),
        # Knative's "5 pods cc=1, 2 activators": 3 and 2.
        ({f"10.0.0.{i}:80": 1 for i in range(5)}, ["a", "b"], [2, 3]),
        # 20 pods over 3 peers: 7, 7, 6.
        ({f"10.0.0.{i}:80": 1 for i in range(20)}, ["a", "b", "c"], [6, 7, 7]),
        # 1 pod of cc 4, 4 peers: each peer one slot (the Knative fallback would give
        # every activator the whole pod, overcommitting it 4 times).
        ({"10.0.0.1:80": 4}, ["a", "b", "c", "d"], [1, 1, 1, 1]),
        # 1 pod of cc 5, 3 peers: 2, 2, 1.
        ({"10.0.0.1:80": 5}, ["a", "b", "c"], [1, 2, 2]),
    ],
)
def test_totals(pods: dict[str, int], peers: list[str], totals: list[int]) -> None:
    division = divide_checked(pods, peers)
    assert sorted(total(division, p) for p in peers) == totals


def test_docstring_examples() -> None:
    failures, tried = doctest.testmod(slots, raise_on_error=False, report=True)
    assert tried >= 6
    assert failures == 0


def test_owned_slots() -> None:
    pods = {"10.0.0.1:80": 2, "10.0.0.2:80": 2, "10.0.0.9:80": 0}
    peers = ["c", "a", "b"]
    division = divide_slots(pods, peers)
    for me in peers:
        assert owned_slots(pods, peers, me) == division[me]
    with pytest.raises(ValueError, match="not one of the peers"):
        owned_slots(pods, peers, "d")


@pytest.mark.parametrize(
    ("pods", "peers", "message"),
    [
        ({"p": 1}, ["a", "b", "a"], "duplicate peer"),
        ({"p": -1}, ["a"], "int >= 0"),
        ({"p": True}, ["a"], "int >= 0"),
        ({"p": 1.5}, ["a"], "int >= 0"),
    ],
)
def test_invalid_input(pods: dict[str, int], peers: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        divide_slots(pods, peers)


def test_check_division_rejects_bad_divisions() -> None:
    pods = {"p": 2, "q": 1}
    good = divide_slots(pods, ["a", "b"])
    check_division(pods, ["a", "b"], good)
    bad: list[Division] = [
        {"a": {"p": 2, "q": 1}, "b": {}},  # unbalanced and not spread
        {"a": {"p": 1}, "b": {"p": 1}},  # q not covered
        {"a": {"p": 1, "q": 1}, "b": {"p": 2}},  # p over-covered
        {"a": {"p": 1, "q": 1}},  # b missing
        {"a": {"p": 1, "q": 1}, "b": {"p": 1, "r": 0}},  # zero count, unknown pod
    ]
    for division in bad:
        with pytest.raises(AssertionError):
            check_division(pods, ["a", "b"], division)


def test_moved_slots() -> None:
    old: Division = {"a": {"p": 1, "q": 2}, "b": {"p": 1}}
    assert moved_slots(old, old) == 0
    # b's slot of p went to c; q shrank by one (not a move); r is new.
    new: Division = {"a": {"p": 1, "q": 1}, "c": {"p": 1, "r": 3}}
    assert moved_slots(old, new) == 1
    # q grew and changed hands entirely: its 2 surviving slots moved.
    assert moved_slots({"a": {"q": 2}}, {"b": {"q": 3}}) == 2
    # q shrank to 1 slot, now at b: the 1 surviving slot moved.
    assert moved_slots({"a": {"q": 2}}, {"b": {"q": 1}}) == 1
    assert moved_slots({"a": {"q": 2}}, {"b": {}}) == 0


def test_module_is_pure() -> None:
    tree = ast.parse(Path(slots.__file__).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.module is not None
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "hashlib", "heapq", "itertools", "collections"}, imported


_CHILD = """
import json, sys
from activator.core.slots import divide_slots
pods = {f"10.1.{i % 7}.{i}:{8000 + i}": i % 5 for i in range(60)}
peers = ["activator-b", "activator-a", "activator-c", "\\u00e9t\\u00e9"]
print(json.dumps(divide_slots(pods, peers), sort_keys=True))
"""


def test_same_result_in_every_process() -> None:
    """blake2b, never the salted hash(): two interpreters with different hash seeds agree."""
    outputs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        root = str(Path(slots.__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
        outputs.append(json.loads(proc.stdout))
    assert outputs[0] == outputs[1]
    pods = {f"10.1.{i % 7}.{i}:{8000 + i}": i % 5 for i in range(60)}
    assert outputs[0] == divide_slots(pods, ["activator-b", "activator-a", "activator-c", "\u00e9t\u00e9"])


def test_score_is_pinned() -> None:
    """The hash is part of the contract: peers on different versions must agree."""
    assert score("a", "10.0.0.1:80") == int.from_bytes(
        hashlib.blake2b(b"\x00\x00\x00\x01a10.0.0.1:80", digest_size=8).digest(),
        "big",
    )


_PINNED_PEER_NAMES = [
    *(f"act-{i}" for i in range(12)),
    *(f"activator-{i}.example" for i in range(4)),
    "\u00e9t\u00e9",
    "\u00e9t\u00e9-2",
    "w0",
    "w1",
    "10.0.0.7:8080",
    "a",
    "b",
    "c",
]

#: sha256 of the canonical JSON of every division of ``_pinned_services()``, recorded
#: before the rebalancing was split into named steps. Never update it to make a change
#: pass: a different division on two activators running different versions overcommits pods.
_PINNED_DIVISIONS_SHA256 = "e6d2ec29b9930cffa563c7cacda6a6f6f60233136dcbc1b321861ef44dd47fe2"


def _pinned_services() -> list[tuple[dict[str, int], list[str]]]:
    """3,000 services from a fixed seed: 1-40 pods of cc 0-5, 1-9 peers in no order.

    When the digest was recorded, 2,304 of them needed the balancing pass of the rebalancing
    and 71 the improving pass (chains of up to 7 moves), so the pin covers both.
    """
    rng = random.Random(20240917)
    services = []
    for _ in range(3000):
        peers = rng.sample(_PINNED_PEER_NAMES, rng.randint(1, 9))
        pods = {}
        for _ in range(rng.randint(1, 40)):
            address = f"10.{rng.randrange(4)}.{rng.randrange(256)}.{rng.randrange(256)}:{rng.choice((80, 8000, 8080))}"
            pods[address] = rng.randint(0, 5)
        services.append((pods, peers))
    return services


def test_divisions_are_pinned() -> None:
    """The division is part of the contract, like the hash: every activator computes it
    on its own, so a refactor or an optimisation must give the same answer for every input."""
    divisions = [divide_slots(pods, peers) for pods, peers in _pinned_services()]
    canonical = json.dumps(divisions, sort_keys=True, separators=(",", ":")).encode()
    assert hashlib.sha256(canonical).hexdigest() == _PINNED_DIVISIONS_SHA256


def test_a_large_service_is_valid() -> None:
    rng = random.Random(5)
    pods = {f"10.{i // 256}.{i % 256}.1:8080": rng.randint(0, 5) for i in range(2000)}
    peers = [f"activator-{i}" for i in range(7)]
    divide_checked(pods, peers)


# ------------------------------------------------------------------------- properties


@settings(max_examples=200, deadline=None)
@given(pods=pod_sets, peers=peer_names)
def test_exact_cover_balance_spread(pods: dict[str, int], peers: list[str]) -> None:
    division = divide_checked(pods, peers)
    # Restated without check_division, for the two properties the SPEC promises.
    for address, cc in pods.items():
        assert sum(division[p].get(address, 0) for p in peers) == cc
    totals = [total(division, p) for p in peers]
    assert max(totals) - min(totals) <= 1


@settings(max_examples=100, deadline=None)
@given(data=st.data(), pods=pod_sets, peers=peer_names)
def test_order_independence(data: st.DataObject, pods: dict[str, int], peers: list[str]) -> None:
    expected = divide_slots(pods, peers)
    shuffled_peers = data.draw(st.permutations(peers))
    shuffled_pods = dict(data.draw(st.permutations(list(pods.items()))))
    assert divide_slots(shuffled_pods, shuffled_peers) == expected
    assert divide_slots(shuffled_pods, tuple(shuffled_peers)) == expected


@settings(max_examples=150, deadline=None)
@given(
    pods=st.dictionaries(addresses, st.integers(0, 5), max_size=4),
    peers=st.lists(st.from_regex(r"[a-z]{1,3}", fullmatch=True), min_size=1, max_size=4, unique=True),
)
def test_is_the_optimum(pods: dict[str, int], peers: list[str]) -> None:
    """The rebalancing finds exactly the specified optimum (the bounds rest on it)."""
    assert divide_slots(pods, peers) == brute_force(pods, peers)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), peer_count=st.integers(2, 6), top_score=st.sampled_from([1, 3, 2**64 - 1]))
def test_rebalancing_keeps_its_invariants(data: st.DataObject, peer_count: int, top_score: int) -> None:
    """Every step of the rebalancing keeps the invariants its docstrings state, with ties
    in the scores too: the hash makes ties all but impossible, the invariants do not rely on it."""
    pod_scores = st.lists(st.integers(0, top_score), min_size=peer_count, max_size=peer_count)
    scores = data.draw(st.lists(pod_scores, min_size=1, max_size=12))
    extras = st.integers(1, peer_count - 1)
    extras_per_pod = data.draw(st.lists(extras, min_size=len(scores), max_size=len(scores)))
    flow = slots._ExtraSlotFlow(scores, extras_per_pod, peer_count)
    flow.check_invariants()
    while flow.step():
        flow.check_invariants()
    assert max(flow.extras_held) - min(flow.extras_held) <= 1


@settings(max_examples=150, deadline=None)
@given(pods=limited_pod_sets, peers=peer_names, new=st.text(min_size=1, max_size=6))
def test_adding_a_peer(pods: dict[str, int], peers: list[str], new: str) -> None:
    if new in peers:
        return
    before = divide_checked(pods, peers)
    after = divide_checked(pods, [*peers, new])
    n = len(peers) + 1
    k = total(after, new)
    assert k >= sum(pods.values()) // n
    moved = moved_slots(before, after)
    assert k <= moved <= k + k * (n - 2)
    # The new peer's slots are the only ones any old peer gives up net.
    assert all(total(after, p) <= total(before, p) for p in peers)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), pods=limited_pod_sets, peers=peer_names.filter(lambda p: len(p) >= 2))
def test_removing_a_peer(data: st.DataObject, pods: dict[str, int], peers: list[str]) -> None:
    gone = data.draw(st.sampled_from(peers))
    rest = [p for p in peers if p != gone]
    before = divide_checked(pods, peers)
    after = divide_checked(pods, rest)
    n = len(peers)
    k = total(before, gone)
    moved = moved_slots(before, after)
    assert k <= moved <= k + k * (n - 2)
    assert all(total(after, p) >= total(before, p) for p in rest)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), pods=pod_sets, peers=peer_names, cc=st.integers(1, 6))
def test_adding_or_removing_a_pod(data: st.DataObject, pods: dict[str, int], peers: list[str], cc: int) -> None:
    address = data.draw(addresses.filter(lambda a: a not in pods))
    without = divide_checked(pods, peers)
    with_pod = divide_checked({**pods, address: cc}, peers)
    bound = cc * (len(peers) - 1)
    # Same two divisions, either way round: adding, then removing.
    assert moved_slots(without, with_pod) <= bound
    assert moved_slots(with_pod, without) <= bound
    # A cc=0 pod changes nothing at all.
    assert divide_slots({**pods, address: 0}, peers) == without


@settings(max_examples=150, deadline=None)
@given(data=st.data(), pods=limited_pod_sets, peers=peer_names, new_cc=st.integers(0, 8))
def test_changing_a_cc(data: st.DataObject, pods: dict[str, int], peers: list[str], new_cc: int) -> None:
    address = data.draw(st.sampled_from(sorted(pods)))
    before = divide_checked(pods, peers)
    after = divide_checked({**pods, address: new_cc}, peers)
    assert moved_slots(before, after) <= abs(new_cc - pods[address]) * (len(peers) - 1)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), pods=limited_pod_sets, peers=peer_names)
def test_one_slot_more_moves_at_most_n_minus_1(data: st.DataObject, pods: dict[str, int], peers: list[str]) -> None:
    address = data.draw(st.sampled_from(sorted(pods)))
    before = divide_checked(pods, peers)
    after = divide_checked({**pods, address: pods[address] + 1}, peers)
    assert moved_slots(before, after) <= len(peers) - 1
    assert moved_slots(after, before) <= len(peers) - 1


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("cc"), st.integers(0, 9), st.integers(0, 5)),
            st.tuples(st.just("peer+"), st.integers(0, 9), st.just(0)),
            st.tuples(st.just("peer-"), st.integers(0, 9), st.just(0)),
        ),
        max_size=25,
    )
)
def test_random_operation_sequences(steps: list[tuple[str, int, int]]) -> None:
    """A topology evolving one event at a time stays valid, and each step keeps its bound."""
    pods: dict[str, int] = {f"10.0.0.{i}:80": 1 + i % 3 for i in range(4)}
    peers = ["act-0", "act-1"]
    division = divide_checked(pods, peers)
    for kind, i, value in steps:
        if kind == "cc":
            address = f"10.0.0.{i}:80"
            d = abs(pods.get(address, 0) - value)
            pods = {**pods, address: value}
            new_division = divide_checked(pods, peers)
            assert moved_slots(division, new_division) <= d * (len(peers) - 1)
        elif kind == "peer+" and f"act-{i}" not in peers:
            peers = [*peers, f"act-{i}"]
            new_division = divide_checked(pods, peers)
            k = total(new_division, f"act-{i}")
            assert k <= moved_slots(division, new_division) <= k * (len(peers) - 1)
        elif kind == "peer-" and f"act-{i}" in peers and len(peers) > 1:
            k = total(division, f"act-{i}")
            n = len(peers)
            peers = [p for p in peers if p != f"act-{i}"]
            new_division = divide_checked(pods, peers)
            assert k <= moved_slots(division, new_division) <= k * (n - 1)
        else:
            continue
        division = new_division


def test_typical_movement_is_close_to_the_minimum() -> None:
    """The module docstring's figures, on a fixed sample (deterministic, not timed).

    Adding a 4th peer to 3 over 200 random services of 1..40 pods with cc 1..4 moves
    about 0.7 slots beyond the new peer's share on average (measured: see docstring);
    the assertion leaves room, the point is to catch a scheme that reshuffles.
    """
    rng = random.Random(2024)
    add_extra, remove_extra, pod_moves = [], [], []
    for _ in range(200):
        pods = {
            f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(256)}:8080": rng.randint(1, 4)
            for _ in range(rng.randint(1, 40))
        }
        peers = [f"act-{i}" for i in rng.sample(range(1000), 3)]
        before = divide_slots(pods, peers)
        after = divide_slots(pods, [*peers, "act-new"])
        add_extra.append(moved_slots(before, after) - total(after, "act-new"))
        gone = peers[0]
        after = divide_slots(pods, peers[1:])
        remove_extra.append(moved_slots(before, after) - total(before, gone))
        after = divide_slots({**pods, "192.168.0.1:80": rng.randint(1, 4)}, peers)
        pod_moves.append(moved_slots(before, after))
    assert statistics.mean(add_extra) < 1.5
    assert statistics.mean(remove_extra) < 1.0
    assert statistics.mean(pod_moves) < 1.0
    assert max(add_extra + remove_extra + pod_moves) <= 8

"""Load-balancing policies, on fake pods (Knative's lb_policy_test.go, ported)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from activator.core.config import resolve_lb_policy as resolve
from activator.core.lb import FirstAvailable, LeastInFlight, RoundRobin, make_policy


@dataclass(eq=False)
class Pod:
    address: str
    rank: int
    in_flight: int = 0
    load: float | None = None


def pods(n: int) -> list[Pod]:
    return [Pod(f"10.0.0.{i}:8000", i) for i in range(n)]


# -- resolve / make_policy -------------------------------------------------------


@pytest.mark.parametrize(
    ("cc", "expected"),
    [
        (0, "least-in-flight"),
        (1, "first-available"),
        (2, "first-available"),
        (3, "first-available"),
        (4, "round-robin"),
        (5, "round-robin"),
        (100, "round-robin"),
    ],
)
def test_resolve_auto_follows_knative(cc: int, expected: str) -> None:
    assert resolve("auto", cc) == expected
    assert make_policy("auto", cc).name == expected


@pytest.mark.parametrize("name", ["first-available", "round-robin", "least-in-flight"])
@pytest.mark.parametrize("cc", [0, 1, 10])
def test_explicit_policy_is_kept_whatever_the_cc(name: str, cc: int) -> None:
    assert resolve(name, cc) == name
    assert make_policy(name, cc).name == name


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError):
        make_policy("random", 1)


@pytest.mark.parametrize("policy", [FirstAvailable, RoundRobin, LeastInFlight])
def test_empty_policy_picks_nothing(policy: type) -> None:
    p = policy()
    assert p.pick() is None
    assert len(p) == 0


@pytest.mark.parametrize("policy", [FirstAvailable, RoundRobin, LeastInFlight])
def test_add_is_idempotent_and_discard_of_unknown_is_harmless(policy: type) -> None:
    p = policy()
    a, b = pods(2)
    p.add(a)
    p.add(a)
    assert len(p) == 1 and a in p and b not in p
    p.discard(b)
    assert len(p) == 1
    p.discard(a)
    p.discard(a)
    assert len(p) == 0 and a not in p
    assert p.pick() is None


@pytest.mark.parametrize("policy", [FirstAvailable, RoundRobin, LeastInFlight])
def test_pick_changes_nothing_but_the_rotation(policy: type) -> None:
    p = policy()
    group = pods(3)
    for pod in group:
        p.add(pod)
    for _ in range(10):
        assert p.pick() in group
    assert len(p) == 3
    assert all(pod.in_flight == 0 for pod in group)


# -- first-available -----------------------------------------------------------


def test_first_available_picks_lowest_rank() -> None:
    p = FirstAvailable()
    a, b, c = pods(3)
    for pod in (c, a, b):  # insertion order does not matter, rank does
        p.add(pod)
    assert p.pick() is a
    assert p.pick() is a  # pick does not rotate


def test_first_available_follows_add_and_discard() -> None:
    # Knative TestFirstAvailable "2 trackers, 1 slot": pod order.
    p = FirstAvailable()
    a, b, c = pods(3)
    p.add(a)
    p.add(b)
    p.add(c)
    p.discard(a)
    assert p.pick() is b
    p.discard(b)
    assert p.pick() is c
    p.add(a)
    assert p.pick() is a
    p.discard(c)
    p.discard(a)
    assert p.pick() is None
    p.add(b)
    assert p.pick() is b


def test_first_available_follows_a_rank_change() -> None:
    # The file was edited: the pod above was removed, so this one moved up. It must
    # stay pickable (a stale heap entry must not hide it) and use its new rank.
    p = FirstAvailable()
    a, b = pods(2)
    p.add(a)
    p.add(b)
    a.rank, b.rank = 5, 0
    p.add(a)
    p.add(b)
    assert p.pick() is b
    p.discard(b)
    assert p.pick() is a
    p.discard(a)
    assert p.pick() is None


def test_first_available_single_member_rank_change_stays_pickable() -> None:
    p = FirstAvailable()
    (a,) = pods(1)
    a.rank = 1
    p.add(a)
    a.rank = 0
    p.add(a)  # the throttler refreshes every tracker after an apply
    assert p.pick() is a


# -- round-robin ---------------------------------------------------------------


def test_round_robin_rotates_fairly() -> None:
    p = RoundRobin()
    group = pods(4)
    for pod in group:
        p.add(pod)
    picks = [p.pick() for _ in range(40)]
    assert all(pod is not None for pod in picks)
    assert picks[:4] == group  # in the order they became available
    assert Counter(pod.address for pod in picks if pod) == {pod.address: 10 for pod in group}
    # Each window of 4 consecutive picks uses every pod once.
    for i in range(0, 40, 4):
        assert set(map(id, picks[i : i + 4])) == set(map(id, group))


def test_round_robin_follows_discard_and_readd() -> None:
    # Knative TestRoundRobin, cc=1: busy pods leave the rotation, freed ones rejoin at the back.
    p = RoundRobin()
    a, b, c = pods(3)
    for pod in (a, b, c):
        p.add(pod)
    assert p.pick() is a
    p.discard(a)  # a is busy
    assert p.pick() is b
    p.discard(b)
    p.add(a)  # a freed: joins behind c
    assert p.pick() is c
    assert p.pick() is a
    p.discard(c)
    p.discard(a)
    assert p.pick() is None
    p.add(b)
    assert p.pick() is b


# -- least-in-flight (power of two choices) ------------------------------------


def test_least_in_flight_picks_the_less_loaded_of_two() -> None:
    p = LeastInFlight(random.Random(42))
    a, b = pods(2)
    a.in_flight, b.in_flight = 3, 1
    p.add(a)
    p.add(b)
    for _ in range(20):
        assert p.pick() is b
    b.in_flight = 7
    for _ in range(20):
        assert p.pick() is a


def test_least_in_flight_uses_both_pods_over_100_picks() -> None:
    # Knative TestRandomChoice_TwoTrackersDistribution, with a seeded Random, and the
    # load moving with the picks as the throttler would move it.
    p = LeastInFlight(random.Random(1))
    a, b = pods(2)
    p.add(a)
    p.add(b)
    counts: Counter[str] = Counter()
    for _ in range(100):
        pod = p.pick()
        assert pod is not None
        counts[pod.address] += 1
        pod.in_flight += 1
    assert set(counts) == {a.address, b.address}
    assert abs(counts[a.address] - counts[b.address]) <= 1  # two pods: always the idler one


def test_least_in_flight_ties_are_broken_randomly() -> None:
    p = LeastInFlight(random.Random(7))
    a, b = pods(2)
    p.add(a)
    p.add(b)
    counts = Counter(p.pick().address for _ in range(100))  # type: ignore[union-attr]
    assert set(counts) == {a.address, b.address}


def test_least_in_flight_single_pod_and_swap_remove() -> None:
    p = LeastInFlight(random.Random(3))
    group = pods(5)
    for pod in group:
        p.add(pod)
    for pod in group[:4]:
        p.discard(pod)
    assert len(p) == 1
    assert p.pick() is group[4]
    p.discard(group[4])
    assert p.pick() is None


def test_least_in_flight_never_picks_a_discarded_pod() -> None:
    rng = random.Random(5)
    p = LeastInFlight(random.Random(9))
    group = pods(8)
    members: set[str] = set()
    for _ in range(2000):
        pod = rng.choice(group)
        if rng.random() < 0.5:
            p.add(pod)
            members.add(pod.address)
        else:
            p.discard(pod)
            members.discard(pod.address)
        assert len(p) == len(members)
        picked = p.pick()
        assert (picked is None) == (not members)
        if picked is not None:
            assert picked.address in members


# -- compaction ----------------------------------------------------------------


def test_first_available_heap_stays_bounded() -> None:
    p = FirstAvailable()
    group = pods(4)
    for pod in group:
        p.add(pod)
    for i in range(10_000):
        pod = group[i % 4]
        p.discard(pod)
        p.add(pod)
        if i % 7 == 0:
            pod.rank += 4  # rank changes leave stale entries too
            p.add(pod)
    assert len(p._heap) <= 2 * len(p) + 17
    assert p.pick() is min(group, key=lambda pod: pod.rank)


def test_round_robin_ring_stays_bounded_and_fair() -> None:
    p = RoundRobin()
    group = pods(4)
    for pod in group:
        p.add(pod)
    for i in range(10_000):
        pod = group[i % 4]
        p.discard(pod)
        p.add(pod)
    assert len(p._ring) <= 2 * len(p) + 17
    picks = [p.pick() for _ in range(8)]
    assert Counter(pod.address for pod in picks) == {pod.address: 2 for pod in group}  # type: ignore[union-attr]


def test_first_available_pick_drops_stale_entries() -> None:
    p = FirstAvailable()
    group = pods(10)
    for pod in group:
        p.add(pod)
    for pod in group[:9]:
        p.discard(pod)
    assert p.pick() is group[9]
    assert len(p._heap) == 1  # the stale ones in front were popped

"""The division of slots as the running topology applies it (issue 4 points 2-4, issue 8
point 5): no sockets, no sleeps.

``core/slots.py`` has its own property tests of ``divide_slots``. These check what the
rest of the program sees through :class:`Topology`: the slots each activator (and each
of its workers) owns of every pod, and where a process that owns nothing forwards.
Every activator is built with the same file, differing only in ``activators.self``
(and, for workers, the worker index), exactly as a fleet runs it.

Properties, for every service:

- exact cover: the activators' owned slots of a pod add up to its cc, and so do the
  workers' of one activator to that activator's;
- balance: totals differ by at most one between activators, and between the workers of
  one activator;
- cc = 0 pods are unlimited everywhere (tracker slots None), and nobody forwards;
- no black hole: an activator owning nothing of a service that has slots forwards it
  to a peer that owns some (kind "peer"); workers never forward to each other (a worker
  owning nothing of a service its activator owns borrows a sibling's slots through the
  slot exchange, ``core.slotexchange``); following the forwards with the real hop rule
  (``core.topology.may_forward``, on the ``X-Activator-Forwarded`` marker the proxy
  builds, one hop appended per forward) always ends at an activator with slots, in one
  peer hop: the rule's second peer hop is for activators whose files disagree for a
  moment, which a fleet with one file never needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from builders import pod
from hypothesis import given, settings
from hypothesis import strategies as st

from activator.core.config import ActivatorsConfig, Address, Config, ServiceConfig
from activator.core.events import PeerChecked
from activator.core.fleet import Forward
from activator.core.peering import Answer
from activator.core.throttler import Grant, Waiter
from activator.core.topology import Topology, may_forward

# --------------------------------------------------------------------------- helpers

#: service name -> (container_concurrency, pod addresses, addresses listed with drain)
Services = Mapping[str, tuple[int, Sequence[str], frozenset[str]]]


def peer_address(index: int) -> Address:
    return Address("127.0.0.1", 20000 + index)


def worker_addresses(peer_index: int, workers: int) -> list[str]:
    return [f"127.0.0.1:{30000 + 100 * peer_index + w}" for w in range(workers)] if workers > 1 else []


def make_config(me: str | None, peers: Sequence[str], services: Services, workers: int = 1) -> Config:
    activators = None
    if me is not None:
        activators = ActivatorsConfig(self_name=me, peers={p: peer_address(i) for i, p in enumerate(peers)})
    return Config(
        path="test.yaml",
        workers=workers,
        activators=activators,
        services={
            name: ServiceConfig(
                name=name,
                hosts=(f"{name}.example.com",),
                container_concurrency=cc,
                pods=tuple(pod(a, a in drained) for a in addresses),
            )
            for name, (cc, addresses, drained) in services.items()
        },
    )


def topology(me: str, peers: Sequence[str], services: Services, worker: int = 0, workers: int = 1) -> Topology:
    config = make_config(me, peers, services, workers)
    return Topology(config, 0.0, worker_index=worker, workers=worker_addresses(list(peers).index(me), workers))


def owned(t: Topology, service: str) -> dict[str, int]:
    """Slots of each pod this process owns (0s left out). The topology answers None
    for "every slot" (one activator, one worker): spelled out here as cc per pod."""
    config = t.config.services[service]
    result = t.owned_slots(config)
    if result is None:
        divided = (t.config.activators is not None and len(t.config.activators.peers) > 1) or len(t.workers) > 1
        assert not divided, "a divided topology answered None (owns everything)"
        cc = config.container_concurrency
        return {p.address: cc for p in config.pods if not p.drain and cc}
    return {a: n for a, n in result.items() if n}


def tracker_slots(t: Topology, service: str) -> dict[str, int | None]:
    """What the throttler (and so /status, and admission) uses: slots per tracker."""
    return {a: tr.slots for a, tr in t.services[service].trackers.items()}


def snapshot(t: Topology, service: str) -> dict[str, Any]:
    result: dict[str, Any] = t.snapshot(0.0)[service]
    return result


def peer_names(n: int) -> list[str]:
    return [f"vm-{chr(ord('a') + i)}" for i in range(n)]


def pods_of(n: int, first: int = 1) -> list[str]:
    return [f"10.0.1.{i}:8000" for i in range(first, first + n)]


def hop_marker(marker: str | None, kind: str, sender: str) -> str:
    """The ``X-Activator-Forwarded`` value after one more hop, as the proxy writes it: the
    hops so far, then this one (``peer <sender's name>``)."""
    hop = f"{kind} {sender}"
    return f"{marker}, {hop}" if marker else hop


# --------------------------------------------------------------------------- worked examples


def test_three_cc1_pods_two_peers_split_two_and_one() -> None:
    pods = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]
    services: Services = {"api": (1, pods, frozenset())}
    a = topology("a", ["a", "b"], services)
    b = topology("b", ["a", "b"], services)
    # The docstring's example of core/slots.py, as the topology applies it.
    assert owned(a, "api") == {"10.0.0.1:80": 1, "10.0.0.2:80": 1}
    assert owned(b, "api") == {"10.0.0.3:80": 1}
    assert tracker_slots(a, "api") == {"10.0.0.1:80": 1, "10.0.0.2:80": 1, "10.0.0.3:80": 0}
    assert tracker_slots(b, "api") == {"10.0.0.1:80": 0, "10.0.0.2:80": 0, "10.0.0.3:80": 1}
    assert a.services["api"].capacity == 2 and b.services["api"].capacity == 1
    assert a.forward_target("api") is None and b.forward_target("api") is None
    assert snapshot(a, "api")["forward_to"] is None


def test_two_cc3_pods_three_peers_one_slot_of_each_pod_each() -> None:
    services: Services = {"api": (3, ["10.0.0.1:80", "10.0.0.2:80"], frozenset())}
    for me in ("a", "b", "c"):
        assert owned(topology(me, ["a", "b", "c"], services), "api") == {"10.0.0.1:80": 1, "10.0.0.2:80": 1}


def test_one_cc1_pod_three_peers_non_owners_forward_to_the_owner() -> None:
    services: Services = {"api": (1, ["10.0.0.1:80"], frozenset())}
    peers = ["a", "b", "c"]
    a, b, c = (topology(me, peers, services) for me in peers)
    assert owned(a, "api") == {"10.0.0.1:80": 1}
    assert a.forward_target("api") is None
    for t in (b, c):
        assert owned(t, "api") == {}
        assert t.services["api"].capacity == 0
        assert t.forward_target("api") == Forward(str(peer_address(0)), "a")
        assert snapshot(t, "api")["forward_to"] == f"peer {peer_address(0)}"


def test_unlimited_pods_are_used_by_every_activator_and_every_worker() -> None:
    services: Services = {"free": (0, pods_of(2), frozenset()), "api": (1, pods_of(1, 50), frozenset())}
    peers = peer_names(3)
    for me in peers:
        for worker in range(2):
            t = topology(me, peers, services, worker=worker, workers=2)
            assert tracker_slots(t, "free") == {a: None for a in pods_of(2)}
            assert t.services["free"].capacity is None  # unlimited: healthy pods with no limit
            assert t.forward_target("free") is None
            assert all(p["slots"] is None for p in snapshot(t, "free")["pods"])


def test_single_activator_single_worker_owns_every_slot() -> None:
    config = make_config(None, [], {"api": (2, pods_of(3), frozenset())})
    t = Topology(config, 0.0)
    assert t.owned_slots(config.services["api"]) is None
    assert tracker_slots(t, "api") == {a: 2 for a in pods_of(3)}
    # A peers list naming only this activator divides nothing either.
    t = topology("a", ["a"], {"api": (2, pods_of(3), frozenset())})
    assert tracker_slots(t, "api") == {a: 2 for a in pods_of(3)}
    assert t.forward_target("api") is None


def test_drained_pods_are_not_divided() -> None:
    """A pod listed with drain: true takes no new request anywhere; its slots are not
    handed out, and the division of the others is the one without it."""
    peers = ["a", "b"]
    with_drain: Services = {"api": (1, pods_of(3), frozenset(pods_of(3)[2:]))}
    without: Services = {"api": (1, pods_of(2), frozenset())}
    for me in peers:
        assert owned(topology(me, peers, with_drain), "api") == owned(topology(me, peers, without), "api")
        assert tracker_slots(topology(me, peers, with_drain), "api")[pods_of(3)[2]] == 0


# --------------------------------------------------------------------------- properties


def check_fleet(peers: Sequence[str], services: Services, workers: int) -> None:
    """Every property of the module docstring for one fleet (same file everywhere)."""
    procs = {(me, w): topology(me, peers, services, worker=w, workers=workers) for me in peers for w in range(workers)}
    tops = {me: topology(me, peers, services) for me in peers}  # the activator's share, one process
    for name, (cc, addresses, drained) in services.items():
        routable = [a for a in dict.fromkeys(addresses) if a not in drained]
        if cc == 0:
            for t in procs.values():
                assert set(tracker_slots(t, name).values()) <= {None}
                assert t.forward_target(name) is None
            continue
        shares = {me: owned(t, name) for me, t in tops.items()}
        # exact cover among activators
        for address in routable:
            assert sum(s.get(address, 0) for s in shares.values()) == cc, (name, address, shares)
        for address in drained:
            assert all(address not in s for s in shares.values())
        # balance among activators
        totals = [sum(s.values()) for s in shares.values()]
        assert max(totals) - min(totals) <= 1, (name, shares)
        has_slots = bool(routable)
        for me in peers:
            worker_shares = {w: owned(procs[(me, w)], name) for w in range(workers)}
            if workers > 1:
                # exact cover of this activator's share among its workers, and balance
                for address in routable:
                    assert sum(s.get(address, 0) for s in worker_shares.values()) == shares[me].get(address, 0)
                wt = [sum(s.values()) for s in worker_shares.values()]
                assert max(wt) - min(wt) <= 1, (me, worker_shares)
            else:
                assert worker_shares[0] == shares[me]
            for w in range(workers):
                t = procs[(me, w)]
                # admission uses exactly these counts
                slots = tracker_slots(t, name)
                # (a drained pod takes nothing whatever its slots; compare the others)
                assert {a: n for a, n in slots.items() if n and a not in drained} == worker_shares[w]
                assert t.services[name].capacity == sum(worker_shares[w].values())
                forward = t.forward_target(name)
                if shares[me] or not has_slots:
                    # The activator owns slots: each worker serves on its own or borrows.
                    assert forward is None, (me, w, forward)
                    continue
                # no black hole: follow the forwards as the proxy would
                assert forward is not None, f"{me}/{w} owns nothing of {name} and forwards nowhere"
                assert_reaches_owner(procs, peers, workers, name, me, w)


def assert_reaches_owner(
    procs: Mapping[tuple[str, int], Topology], peers: Sequence[str], workers: int, service: str, me: str, w: int
) -> None:
    by_address = {str(peer_address(i)): p for i, p in enumerate(peers)}
    forward = procs[(me, w)].forward_target(service)
    assert forward is not None and forward.name in peers and may_forward(None), (me, w, forward)
    assert forward.address in by_address, forward
    target = by_address[forward.address]
    assert target != me, "forwards to itself"
    marker = hop_marker(None, "peer", me)
    # The kernel gives the connection to any worker of the target: every one serves it,
    # on its own slots or borrowed ones, and none sends it on.
    assert any(owned(procs[(target, i)], service) for i in range(workers)), (target, service)
    for i in range(workers):
        onward = procs[(target, i)].forward_target(service)
        assert onward is None, f"{target}/{i} sends a forwarded request on ({onward}, marker {marker})"


def test_the_hop_rule_allows_a_second_peer_hop_never_a_third() -> None:
    """A second hop is for activators whose files disagree for a moment; a third never."""
    assert may_forward(None)
    assert may_forward(hop_marker(None, "peer", "a"))
    assert not may_forward(hop_marker(hop_marker(None, "peer", "a"), "peer", "b"))


@pytest.mark.parametrize("n_peers", [2, 3, 4])
@pytest.mark.parametrize("cc", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("n_pods", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_fleet_table(n_peers: int, cc: int, n_pods: int, workers: int) -> None:
    check_fleet(peer_names(n_peers), {"api": (cc, pods_of(n_pods), frozenset())}, workers)


services_strategy = st.dictionaries(
    st.sampled_from(["api", "web", "gpu"]),
    st.tuples(
        st.integers(0, 4),
        st.lists(st.integers(1, 30).map(lambda i: f"10.0.2.{i}:8000"), max_size=8, unique=True),
        st.integers(0, 255),  # drain mask
    ).map(lambda t: (t[0], t[1], frozenset(a for i, a in enumerate(t[1]) if t[2] >> i & 1 and i % 3 == 0))),
    min_size=1,
    max_size=3,
)


@settings(max_examples=120, deadline=None)
@given(
    peers=st.lists(st.text("abcdefgh-.", min_size=1, max_size=6), min_size=1, max_size=5, unique=True),
    services=services_strategy,
    workers=st.integers(1, 4),
)
def test_fleet_properties(peers: list[str], services: Services, workers: int) -> None:
    check_fleet(peers, services, workers)


# --------------------------------------------------------------------------- changes


def shares(peers: Sequence[str], services: Services, service: str) -> dict[str, dict[str, int]]:
    return {me: owned(topology(me, peers, services), service) for me in peers}


def test_removed_peer_slots_move_to_the_others_and_nothing_else_moves_with_two_left() -> None:
    services: Services = {"api": (2, pods_of(5), frozenset())}
    before = shares(["a", "b", "c"], services, "api")
    after = shares(["a", "b"], services, "api")
    for address in pods_of(5):
        assert after["a"].get(address, 0) + after["b"].get(address, 0) == 2
        # a and b only gain: c's slots went to them, none of theirs moved.
        assert after["a"].get(address, 0) >= before["a"].get(address, 0)
        assert after["b"].get(address, 0) >= before["b"].get(address, 0)


def test_applying_a_new_peer_list_keeps_trackers_and_in_flight_requests() -> None:
    """A slot moving away while a request uses it: the request keeps its grant, the pod
    takes no new one here, and the count returns to zero on release (issue 4 point 3)."""
    services: Services = {"api": (1, pods_of(1), frozenset())}
    three = peer_names(3)
    owner = next(me for me in three if owned(topology(me, three, services), "api"))
    t = topology(owner, three, services)
    throttler = t.services["api"]
    grant = throttler.acquire(0.0)
    assert isinstance(grant, Grant)
    # The operator hands the pod to another activator: an edit where the owner's slot
    # moves (the owner stays a peer, a new peer list changes who owns the pod).
    others = [p for p in three if p != owner]
    for extra in ("vm-x", "vm-y", "vm-z", "vm-w", "vm-v"):
        new_peers = sorted([owner, *others, extra])
        if not owned(topology(owner, new_peers, services), "api"):
            break
    else:  # pragma: no cover - the hash would have to favour the owner five times over
        pytest.skip("no peer list found that moves the slot")
    # No pod changes state and nobody waits: a slot moving away is no effect.
    assert not t.apply(make_config(owner, new_peers, services), 1.0)
    assert t.services["api"] is throttler
    tracker = throttler.trackers[pods_of(1)[0]]
    assert tracker.slots == 0 and tracker.in_flight == 1
    assert throttler.capacity == 0
    forward = t.forward_target("api")
    assert forward is not None and forward.name != owner
    waiter = throttler.acquire(1.0)
    assert isinstance(waiter, Waiter), "a moved-away slot was granted again"
    assert throttler.abandon(waiter) is None
    assert not throttler.release(grant, 2.0), "the freed slot was handed to someone here"
    assert tracker.in_flight == 0 and throttler.in_flight == 0
    t.check_invariants()


def test_forward_targets_follow_a_reload() -> None:
    services: Services = {"api": (1, pods_of(1), frozenset())}
    three = peer_names(3)
    division = shares(three, services, "api")
    owner = next(me for me, s in division.items() if s)
    other = next(me for me in three if me != owner)
    t = topology(other, three, services)
    assert t.forward_target("api") == Forward(str(peer_address(three.index(owner))), owner)
    # The owner leaves the file: someone among the two left owns the pod now.
    two = [p for p in three if p != owner]
    remaining_peers = {p: peer_address(three.index(p)) for p in two}
    config = Config(
        path="test.yaml",
        activators=ActivatorsConfig(other, remaining_peers),
        services=make_config(other, two, services).services,
    )
    t.apply(config, 1.0)
    after = {
        me: owned(
            Topology(
                Config(path="t", activators=ActivatorsConfig(me, remaining_peers), services=config.services),
                0.0,
            ),
            "api",
        )
        for me in two
    }
    assert sum(sum(s.values()) for s in after.values()) == 1
    if after[other]:
        assert t.forward_target("api") is None
        # The slot moved here from the owner that left: held until it says it runs
        # nothing on it any more (core.peering's hand-over rule), then used.
        assert tracker_slots(t, "api") == {pods_of(1)[0]: 0}
        assert [target.name for target in t.fleet.check_targets(())] == sorted([owner, *[p for p in two if p != other]])
        t.handle(PeerChecked(owner, 1.5, Answer(owner, {"api": {pods_of(1)[0]: 1}}, {"api": 1})), 2.0)
        assert tracker_slots(t, "api") == {pods_of(1)[0]: 0}, "still running a request on it"
        t.handle(PeerChecked(owner, 2.5, Answer(owner, {"api": {pods_of(1)[0]: 0}}, {"api": 0})), 3.0)
        assert tracker_slots(t, "api") == {pods_of(1)[0]: 1}
        assert owner not in [target.name for target in t.fleet.check_targets(())], "done with the leaver"
    else:
        remaining = next(me for me in two if me != other)
        assert t.forward_target("api") == Forward(str(peer_address(three.index(remaining))), remaining)


def test_a_worker_owning_nothing_forwards_nowhere_its_siblings_lend_it_slots() -> None:
    services: Services = {"api": (1, pods_of(1), frozenset())}
    addresses = worker_addresses(0, 3)
    procs = [Topology(make_config("a", ["a"], services, 3), 0.0, worker_index=w, workers=addresses) for w in range(3)]
    assert sum(bool(owned(t, "api")) for t in procs) == 1
    for t in procs:
        assert t.forward_target("api") is None
        assert snapshot(t, "api")["forward_to"] is None
        # shared mode: it serves only on its own slots at once, else queues at the exchange
        assert t.services["api"].shared
    # Without an activators: section at all, workers still divide.
    procs = [Topology(make_config(None, [], services, 3), 0.0, worker_index=w, workers=addresses) for w in range(3)]
    assert sum(bool(owned(t, "api")) for t in procs) == 1
    assert all(t.forward_target("api") is None for t in procs)


def test_workers_of_a_peer_split_its_share_cc2_two_workers() -> None:
    """cc=2 pods, 2 activators, 2 workers each: every worker of the fleet owns exactly
    one slot of one pod... or of two; in all, each pod's 2 slots go to 2 processes."""
    services: Services = {"api": (2, pods_of(2), frozenset())}
    peers = ["a", "b"]
    totals: dict[str, int] = {}
    for me in peers:
        share = owned(topology(me, peers, services), "api")
        assert share == {a: 1 for a in pods_of(2)}  # spread: one slot of each pod each
        per_worker = [owned(topology(me, peers, services, w, 2), "api") for w in range(2)]
        assert sorted(sum(s.values()) for s in per_worker) == [1, 1]
        for s in per_worker:
            for address, n in s.items():
                totals[address] = totals.get(address, 0) + n
    assert totals == {a: 2 for a in pods_of(2)}

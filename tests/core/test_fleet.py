"""Tests for activator.core.fleet: this process among the other holders of the pods' slots.

Every fleet here is built as the topology builds it: ``configure`` with the file, then
``follow`` each service; time is passed in. What they prove:

- **Shares.** With several activators each one may use exactly its share of
  ``core.slots.divide_slots`` (and, with workers, its worker's share of that); with one
  activator and one worker nothing is divided (None: every slot).
- **Hand-over.** The first file moves nothing. A peer removed from the file: the slots of
  its that come to us are held (usable lower) until that peer answers a check asked after
  the change with nothing of them in use, then usable rises and the peer is forgotten; or
  until the longest request life (``request_timeout`` + grace) has passed (``expire``);
  without a ``request_timeout`` only the answer releases them. A peer added takes its
  share at once. Going back to one activator waits for the leaver the same way, and so
  does a cap lifted by removing the peer that set it.
- **Views.** A peer's view below our share caps it (``capped_by``); the cap lifting is a
  hand-over that waits for that peer; views from unknown, removed or own names are ignored.
  Two peers capping the same pod: both are shown in ``capped_by``, and when the second
  lifts its cap, the first (lifted earlier, under the second's) is waited on too.
- **Forwards.** A service this activator owns nothing of goes to an owner that is not down,
  the same one while it stays so, and raises PeerUnavailable when every owner is down; an
  activator with slots but its capacity spent goes to an UP peer that reported capacity.
- **Checks.** ``check_targets`` gives every peer (and a removed one, until forgotten) and
  every sibling worker our view of its shares, for the divided services only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from builders import pod, svc
from hypothesis import given, settings
from hypothesis import strategies as st

from activator.core.config import ActivatorsConfig, Address, Config, ServiceConfig
from activator.core.errors import PeerUnavailable
from activator.core.fleet import CheckTarget, Fleet, Forward, PeerChange
from activator.core.peering import ACTIVATOR_SCOPE, WORKER_SCOPE, Answer, PeerState
from activator.core.slots import divide_slots, score

ABC = ("vm-a", "vm-b", "vm-c")
SIX = tuple(f"10.0.1.{i}:8000" for i in range(1, 7))
GRACE = 30.0


def address(peer: str) -> Address:
    return Address("127.0.0.1", 20000 + ord(peer[-1]))


def config(
    me: str | None, peers: Sequence[str], *services: ServiceConfig, unhealthy_after: int = 3, workers: int = 1
) -> Config:
    activators = None
    if me is not None:
        activators = ActivatorsConfig(
            self_name=me, peers={p: address(p) for p in peers}, secret="s", unhealthy_after=unhealthy_after
        )
    return Config(
        path="test.yaml",
        workers=workers,
        grace_period=GRACE,
        activators=activators,
        services={s.name: s for s in services},
    )


def apply(fleet: Fleet, cfg: Config, now: float) -> dict[str, dict[str, int] | None]:
    """A new file, as the topology applies it: the peers, then every service."""
    fleet.configure(cfg, now)
    return {name: fleet.follow(service, now, grace=cfg.grace_period) for name, service in cfg.services.items()}


def fleet_of(me: str, peers: Sequence[str], *services: ServiceConfig, now: float = 0.0, **kw: Any) -> Fleet:
    fleet = Fleet()
    apply(fleet, config(me, peers, *services, **kw), now)
    return fleet


def limits(service: ServiceConfig) -> dict[str, int]:
    return {p.address: service.container_concurrency for p in service.pods if not p.drain}


def division(service: ServiceConfig, peers: Sequence[str]) -> dict[str, dict[str, int]]:
    return divide_slots(limits(service), peers)


def answer(peer: str, in_use: dict[str, dict[str, int]] | None = None, **capacity: int | None) -> Answer:
    return Answer(peer, in_use or {}, capacity)


def idle(peer: str, service: ServiceConfig) -> Answer:
    """``peer``'s answer with nothing in use on any of ``service``'s pods."""
    return answer(peer, {service.name: dict.fromkeys(limits(service), 0)})


def down(fleet: Fleet, peer: str, now: float, times: int = 3) -> None:
    for i in range(times):
        fleet.checked(peer, now + i, None, "timed out", now + i)


def target(fleet: Fleet, name: str) -> CheckTarget:
    [found] = [t for t in fleet.check_targets(()) if t.name == name]
    return found


def gained_from(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], me: str) -> dict[str, int]:
    return {p: n - before[me].get(p, 0) for p, n in after[me].items() if n > before[me].get(p, 0)}


# -- shares --------------------------------------------------------------------------------


@pytest.mark.parametrize("me", ABC)
@pytest.mark.parametrize("cc", [1, 2, 3, 5])
def test_each_of_three_activators_uses_its_division_share(me: str, cc: int) -> None:
    api = svc(*SIX, pod("10.0.1.9:8000", drain=True), cc=cc)
    fleet = Fleet()
    usable = apply(fleet, config(me, ABC, api), 0.0)
    assert usable == {"api": division(api, ABC)[me]}
    assert "10.0.1.9:8000" not in (usable["api"] or {})  # a draining pod is not divided
    assert fleet.handovers.pending == {}


def test_the_three_shares_cover_every_slot_once() -> None:
    api = svc(*SIX, cc=2)
    total: dict[str, int] = {}
    for me in ABC:
        usable = fleet_of(me, ABC, api).usable("api")
        assert usable is not None
        for p, n in usable.items():
            total[p] = total.get(p, 0) + n
    assert total == dict.fromkeys(SIX, 2)


@pytest.mark.parametrize(("me", "peers"), [(None, ()), ("vm-a", ("vm-a",))])
def test_one_activator_divides_nothing(me: str | None, peers: Sequence[str]) -> None:
    fleet = Fleet()
    assert apply(fleet, config(me, peers, svc(*SIX)), 0.0) == {"api": None}
    assert fleet.forward_target("api", capacity_spent=True) is None
    assert fleet.check_targets(()) == [] and fleet.snapshot_peers(0.0) == {}


def test_unlimited_pods_are_not_divided() -> None:
    fleet = fleet_of("vm-a", ABC, svc(*SIX, cc=0))
    assert fleet.usable("api") is None
    assert fleet.forward_target("api", capacity_spent=True) is None


def test_workers_divide_the_activators_share() -> None:
    api = svc(*SIX, cc=3)
    mine = division(api, ABC)["vm-b"]
    workers = divide_slots(mine, ["0", "1", "2"])
    for index in range(3):
        fleet = Fleet(worker_index=index, workers=3)
        assert apply(fleet, config("vm-b", ABC, api, workers=3), 0.0) == {"api": workers[str(index)]}


# -- hand-over on a new file ---------------------------------------------------------------------


def test_the_first_file_plans_no_hand_over_when_read_from_the_file_alone() -> None:
    api = svc(*SIX, cc=2)
    fleet = fleet_of("vm-a", ABC, api, now=5.0)
    assert fleet.handovers.pending == {} and fleet.departed == {}
    assert fleet.usable("api") == division(api, ABC)["vm-a"]
    assert fleet.snapshot_service("api", 6.0)["handover"] == []


def test_a_starting_process_waits_for_each_peer_before_using_its_share() -> None:
    # A process that starts (the server's topology) cannot know what its peers run on the
    # slots its file gives it (an older file may give them to the peers): each peer
    # answers first, at or under its own share by our file.
    api = svc(*SIX, cc=2)
    ours, theirs = division(api, ABC)["vm-a"], division(api, ABC)["vm-b"]
    fleet = Fleet(hand_over_at_start=True)
    usable = apply(fleet, config("vm-a", ABC, api), 5.0)["api"]
    assert usable == dict.fromkeys(ours, 0)
    assert fleet.snapshot_service("api", 5.0)["handover_slots"] == sum(ours.values())
    # vm-b still runs more than its share of a pod by our file (an older file of its):
    busy_pod = next(p for p in ours if ours[p])
    busy = answer("vm-b", {"api": {**dict.fromkeys(SIX, 0), busy_pod: theirs.get(busy_pod, 0) + 1}})
    assert fleet.checked("vm-b", 6.0, busy, "", 6.5) == set()  # vm-c not heard yet
    assert fleet.checked("vm-c", 6.0, idle("vm-c", api), "", 6.5) == {"api"}
    assert fleet.usable("api") == {**ours, busy_pod: 0}  # that pod still waits for vm-b
    assert fleet.checked("vm-b", 7.0, idle("vm-b", api), "", 7.5) == {"api"}
    assert fleet.usable("api") == ours


def test_an_answer_from_a_peer_that_does_not_list_us_releases_nothing() -> None:
    # A newcomer's peers with an older file (not naming it) answer its checks, but they
    # may start another request on its slots right after: only their new file ends that.
    api = svc(*SIX, cc=1)
    fleet = Fleet(hand_over_at_start=True)
    apply(fleet, config("vm-a", ABC, api), 5.0)
    unlisted = Answer("vm-b", idle("vm-b", api).in_use, {"api": 2}, listed=False)
    assert fleet.checked("vm-b", 6.0, unlisted, "", 6.5) == set()
    assert fleet.health["vm-b"].state is PeerState.UP  # it answered all the same
    fleet.checked("vm-c", 6.0, idle("vm-c", api), "", 6.5)
    assert any(fleet.handovers.pending)
    fleet.checked("vm-b", 7.0, idle("vm-b", api), "", 7.5)
    assert fleet.usable("api") == division(api, ABC)["vm-a"]


def test_a_peer_whose_port_refuses_runs_nothing() -> None:
    api = svc(*SIX, cc=1)
    fleet = Fleet(hand_over_at_start=True)
    apply(fleet, config("vm-a", ABC, api), 5.0)
    assert fleet.checked("vm-b", 6.0, None, "connection refused", 6.1, refused=True) == set()
    assert fleet.checked("vm-c", 6.0, None, "timed out", 6.1) == set()  # not known to run nothing
    assert fleet.usable("api") == dict.fromkeys(division(api, ABC)["vm-a"], 0)
    assert fleet.checked("vm-c", 7.0, None, "connection refused", 7.1, refused=True) == {"api"}
    assert fleet.usable("api") == division(api, ABC)["vm-a"]


def test_a_departed_peer_whose_port_refuses_is_forgotten() -> None:
    fleet, _ = removed_c()
    assert fleet.checked("vm-c", 11.0, None, "connection refused", 11.5, refused=True) == {"api"}
    assert fleet.usable("api") == AFTER["vm-a"]
    assert "vm-c" not in fleet.departed and "vm-c" not in fleet.health


def test_a_peer_added_takes_its_share_at_once() -> None:
    api = svc(*SIX, cc=2)
    fleet = fleet_of("vm-a", ABC[:2], api)
    after = apply(fleet, config("vm-a", ABC, api), 1.0)
    assert after == {"api": division(api, ABC)["vm-a"]}  # ours shrank: nothing to wait for
    assert fleet.handovers.pending == {} and fleet.departed == {}
    assert {t.name for t in fleet.check_targets(())} == {"vm-b", "vm-c"}


API6 = svc(*SIX, cc=1)
BEFORE, AFTER = division(API6, ABC), division(API6, ("vm-a", "vm-b"))
GAINED = gained_from(BEFORE, AFTER, "vm-a")


def test_the_removal_example_moves_only_vm_c_s_slots_and_some_to_us() -> None:
    # The scenario of the next tests (a fact of the division, checked here so that they
    # test what they say): vm-c leaves, some of its pods come to vm-a, vm-b loses nothing.
    assert GAINED and all(BEFORE["vm-c"].get(p) for p in GAINED)
    assert any(p not in GAINED for p in BEFORE["vm-c"])  # and some go to vm-b
    assert all(AFTER["vm-b"].get(p, 0) >= n for p, n in BEFORE["vm-b"].items())


def removed_c(request_timeout: float | None = 300.0) -> tuple[Fleet, ServiceConfig]:
    api = svc(*SIX, cc=1, request_timeout=request_timeout)
    fleet = fleet_of("vm-a", ABC, api)
    usable = apply(fleet, config("vm-a", ("vm-a", "vm-b"), api), 10.0)["api"]
    assert usable == {p: n - GAINED.get(p, 0) for p, n in AFTER["vm-a"].items()}  # the new slots held
    return fleet, api


def test_a_removed_peers_slots_are_held_until_it_answers_with_none_in_use() -> None:
    fleet, api = removed_c()
    assert list(fleet.departed) == ["vm-c"]
    assert fleet.departed["vm-c"].address == str(address("vm-c")) and fleet.departed["vm-c"].secret == "s"
    assert fleet.snapshot_peers(10.0)["vm-c"]["departed"] is True
    snap = fleet.snapshot_service("api", 12.0)
    assert snap["handover_slots"] == sum(GAINED.values())
    assert [(h["pod"], h["waiting_on"]) for h in snap["handover"]] == [(p, ["vm-c"]) for p in sorted(GAINED)]
    # It is still checked, with a view that gives it nothing.
    assert target(fleet, "vm-c").view == {"api": dict.fromkeys(SIX, 0)}

    # An answer to a check asked before the change proves nothing.
    assert fleet.checked("vm-c", 9.0, idle("vm-c", api), "", 11.0) == set()
    # A request still running on one of the slots: still held, still checked.
    busy = answer("vm-c", {"api": {**dict.fromkeys(SIX, 0), min(GAINED): 1}})
    assert fleet.checked("vm-c", 11.0, busy, "", 12.0) == set()
    assert fleet.usable("api") != AFTER["vm-a"] and "vm-c" in fleet.departed

    assert fleet.checked("vm-c", 13.0, idle("vm-c", api), "", 14.0) == {"api"}
    assert fleet.usable("api") == AFTER["vm-a"]
    assert fleet.departed == {} and "vm-c" not in fleet.snapshot_peers(14.0)
    assert [t.name for t in fleet.check_targets(())] == ["vm-b"]
    assert fleet.snapshot_service("api", 14.0)["handover"] == []


def test_a_removed_peer_still_running_requests_is_still_checked() -> None:
    fleet, api = removed_c()
    elsewhere = next(p for p in BEFORE["vm-c"] if p not in GAINED)  # one of its pods that went to vm-b
    busy = answer("vm-c", {"api": {**dict.fromkeys(SIX, 0), elsewhere: 1}})
    assert fleet.checked("vm-c", 11.0, busy, "", 12.0) == {"api"}  # ours are free
    assert fleet.usable("api") == AFTER["vm-a"]
    assert "vm-c" in fleet.departed and "vm-c" in [t.name for t in fleet.check_targets(())]
    assert fleet.checked("vm-c", 13.0, idle("vm-c", api), "", 14.0) == set()
    assert fleet.departed == {}


def test_a_removed_peers_slots_are_released_when_waited_out() -> None:
    fleet, _ = removed_c(request_timeout=10.0)
    deadline = 10.0 + 10.0 + GRACE
    assert fleet.snapshot_service("api", 10.0)["handover"][0]["seconds_left"] == deadline - 10.0
    down(fleet, "vm-c", 11.0)  # it does not answer
    assert fleet.expire(deadline - 0.1) == set()
    assert fleet.usable("api") != AFTER["vm-a"] and "vm-c" in fleet.departed
    assert fleet.expire(deadline) == {"api"}
    assert fleet.usable("api") == AFTER["vm-a"]
    assert fleet.departed == {} and "vm-c" not in fleet.health


def test_without_a_request_timeout_only_the_answer_releases() -> None:
    fleet, api = removed_c(request_timeout=None)
    assert fleet.expire(1e9) == set()
    assert fleet.usable("api") != AFTER["vm-a"] and "vm-c" in fleet.departed
    assert fleet.checked("vm-c", 1e9, idle("vm-c", api), "", 1e9) == {"api"}
    assert fleet.usable("api") == AFTER["vm-a"] and fleet.departed == {}


def test_a_removed_peer_that_comes_back_is_a_peer_again() -> None:
    fleet, api = removed_c()
    usable = apply(fleet, config("vm-a", ABC, api), 20.0)
    assert usable == {"api": BEFORE["vm-a"]}
    assert fleet.departed == {} and fleet.snapshot_service("api", 20.0)["handover_slots"] == 0
    assert fleet.snapshot_peers(20.0)["vm-c"]["departed"] is False
    # (the waits on it stay, holding nothing, until it answers: the slots may come back)
    fleet.checked("vm-c", 21.0, idle("vm-c", api), "", 21.0)
    assert fleet.handovers.pending == {} and fleet.usable("api") == BEFORE["vm-a"]


@settings(max_examples=60, deadline=None)
@given(
    pods=st.integers(1, 8),
    cc=st.integers(1, 5),
    leaving=st.sampled_from(("vm-b", "vm-c", "vm-d")),
)
def test_after_a_removal_nothing_moved_is_used_before_its_old_holders_answer(pods: int, cc: int, leaving: str) -> None:
    peers = ("vm-a", "vm-b", "vm-c", "vm-d")
    remaining = tuple(p for p in peers if p != leaving)
    api = svc(*(f"10.0.2.{i}:8000" for i in range(pods)), cc=cc)
    before, after = division(api, peers), division(api, remaining)
    fleet = fleet_of("vm-a", peers, api)
    usable = apply(fleet, config("vm-a", remaining, api), 10.0)["api"]
    assert usable is not None
    for p in limits(api):
        assert usable.get(p, 0) == min(before["vm-a"].get(p, 0), after["vm-a"].get(p, 0))
    for peer in peers[1:]:
        fleet.checked(peer, 11.0, idle(peer, api), "", 12.0)
    assert fleet.usable("api") == after["vm-a"]
    assert fleet.handovers.pending == {} and fleet.departed == {}


def test_back_to_one_activator_waits_for_the_removed_peer() -> None:
    api = svc(*SIX, cc=1)
    fleet = fleet_of("vm-a", ("vm-a", "vm-b"), api)
    ours = division(api, ("vm-a", "vm-b"))["vm-a"]
    usable = apply(fleet, config("vm-a", ("vm-a",), api), 10.0)["api"]
    assert usable is not None, "took every slot at once"
    assert {p: n for p, n in usable.items() if n} == ours
    assert fleet.checked("vm-b", 11.0, idle("vm-b", api), "", 12.0) == {"api"}


# -- views -----------------------------------------------------------------------------------


API3 = svc(*SIX, cc=1)
OURS = division(API3, ABC)["vm-a"]
CAPPED_POD = min(OURS)


def capped_fleet() -> Fleet:
    fleet = fleet_of("vm-a", ABC, API3)
    view = {"api": {**OURS, CAPPED_POD: 0}}
    assert fleet.view_received("vm-b", view, [API3], 1.0) == {"api"}
    return fleet


def test_a_peers_view_caps_our_share() -> None:
    fleet = capped_fleet()
    assert fleet.usable("api") == {**OURS, CAPPED_POD: 0}
    assert fleet.snapshot_service("api", 1.0)["capped_by"] == ["vm-b"]
    assert fleet.handovers.pending == {}  # a share that falls needs no hand-over
    # The same view again changes nothing.
    assert fleet.view_received("vm-b", {"api": {**OURS, CAPPED_POD: 0}}, [API3], 2.0) == set()


def test_a_cap_that_lifts_waits_for_its_issuer() -> None:
    fleet = capped_fleet()
    assert fleet.view_received("vm-b", {"api": dict(OURS)}, [API3], 5.0) == {"api"}
    snap = fleet.snapshot_service("api", 5.0)
    assert snap["capped_by"] == []
    assert [(h["pod"], h["slots"], h["waiting_on"]) for h in snap["handover"]] == [(CAPPED_POD, 1, ["vm-b"])]
    assert fleet.usable("api") == {**OURS, CAPPED_POD: 0}
    assert fleet.checked("vm-c", 6.0, idle("vm-c", API3), "", 6.0) == set()  # not the issuer
    assert fleet.checked("vm-b", 4.0, idle("vm-b", API3), "", 6.0) == set()  # asked before
    busy = answer("vm-b", {"api": {CAPPED_POD: 1}})
    assert fleet.checked("vm-b", 6.0, busy, "", 6.5) == set()
    assert fleet.checked("vm-b", 7.0, idle("vm-b", API3), "", 7.5) == {"api"}
    assert fleet.usable("api") == OURS


def test_a_cap_set_again_holds_nothing_but_keeps_waiting() -> None:
    fleet = capped_fleet()
    fleet.view_received("vm-b", {"api": dict(OURS)}, [API3], 5.0)  # lifted: pending on vm-b
    assert fleet.snapshot_service("api", 5.0)["handover_slots"] == 1
    assert fleet.view_received("vm-b", {"api": {CAPPED_POD: 0}}, [API3], 6.0) == {"api"}
    assert fleet.snapshot_service("api", 6.0)["handover_slots"] == 0
    assert fleet.usable("api") == {**OURS, CAPPED_POD: 0}
    # Lifted once more: a new hand-over, from this change on.
    fleet.view_received("vm-b", {"api": dict(OURS)}, [API3], 7.0)
    assert fleet.checked("vm-b", 6.5, idle("vm-b", API3), "", 7.5) == set()
    assert fleet.checked("vm-b", 7.0, idle("vm-b", API3), "", 7.5) == {"api"}
    assert fleet.usable("api") == OURS


def test_a_view_that_leaves_our_share_as_it_is_changes_nothing() -> None:
    fleet = fleet_of("vm-a", ABC, API3)
    assert fleet.view_received("vm-c", {"api": dict(OURS)}, [API3], 1.0) == set()
    assert fleet.view_received("vm-c", {"web": {"10.0.9.9:80": 0}}, [API3], 2.0) == set()
    assert fleet.usable("api") == OURS and fleet.snapshot_service("api", 2.0)["capped_by"] == []


def capped_by_two() -> Fleet:
    fleet = fleet_of("vm-a", ABC, API3)
    view = {"api": {**OURS, CAPPED_POD: 0}}
    assert fleet.view_received("vm-b", view, [API3], 1.0) == {"api"}
    fleet.view_received("vm-c", view, [API3], 1.5)
    fleet.view_received("vm-b", {"api": dict(OURS)}, [API3], 2.0)  # vm-b lifts: vm-c still caps
    assert fleet.usable("api") == {**OURS, CAPPED_POD: 0}
    return fleet


def test_capped_by_names_the_peer_whose_view_caps_us() -> None:
    assert capped_by_two().snapshot_service("api", 2.0)["capped_by"] == ["vm-c"]


def test_a_cap_lifted_under_another_cap_is_waited_on_too() -> None:
    fleet = capped_by_two()
    assert fleet.view_received("vm-c", {"api": dict(OURS)}, [API3], 3.0) == {"api"}
    [pending] = fleet.snapshot_service("api", 3.0)["handover"]
    assert pending["waiting_on"] == ["vm-b", "vm-c"]


@pytest.mark.parametrize("issuer", ["vm-z", "vm-a", "worker 0", "worker 1", "worker x"])
def test_views_from_others_than_peers_are_ignored(issuer: str) -> None:
    fleet = fleet_of("vm-a", ABC, API3)
    assert fleet.view_received(issuer, {"api": dict.fromkeys(OURS, 0)}, [API3], 1.0) == set()
    assert fleet.usable("api") == OURS and fleet.views == {}


def test_a_sibling_workers_view_caps_this_worker() -> None:
    api = svc(*SIX, cc=2)
    fleet = Fleet(worker_index=0, workers=2)
    mine = apply(fleet, config("vm-a", ABC, api, workers=2), 0.0)["api"]
    assert mine
    pod_ = min(mine)
    assert fleet.view_received("worker 1", {"api": {pod_: 0}}, [api], 1.0) == {"api"}
    assert fleet.usable("api") == {**mine, pod_: 0}
    assert fleet.snapshot_service("api", 1.0)["capped_by"] == ["worker 1"]


def test_a_removed_peers_view_is_dropped() -> None:
    # (the scenario of the test below: the capped pod stays ours when vm-b leaves)
    assert division(API3, ("vm-a", "vm-c"))["vm-a"].get(CAPPED_POD) == 1
    fleet = capped_fleet()
    apply(fleet, config("vm-a", ("vm-a", "vm-c"), API3), 10.0)
    assert "vm-b" not in fleet.views
    assert fleet.snapshot_service("api", 10.0)["capped_by"] == []
    assert fleet.view_received("vm-b", {"api": {CAPPED_POD: 0}}, [API3], 11.0) == set()  # it left


def test_a_cap_lifted_by_removing_its_issuer_waits_for_it() -> None:
    fleet = capped_fleet()
    usable = apply(fleet, config("vm-a", ("vm-a", "vm-c"), API3), 10.0)["api"]
    assert usable is not None and usable[CAPPED_POD] == 0, "the lifted cap's pod was used at once"


# -- forwards --------------------------------------------------------------------------------


ONE = svc("10.0.1.1:8000", cc=1)
[OWNER] = [p for p, owned in division(ONE, ABC).items() if owned]
NON_OWNERS = [p for p in ABC if p != OWNER]


def test_the_owner_of_a_one_slot_service_keeps_it() -> None:
    fleet = fleet_of(OWNER, ABC, ONE)
    assert fleet.forward_target("api", capacity_spent=False) is None
    assert fleet.snapshot_service("api", 0.0)["forward_to"] is None


def test_a_non_owner_forwards_to_the_owner_while_it_is_up() -> None:
    fleet = fleet_of(NON_OWNERS[0], ABC, ONE, unhealthy_after=2)
    expected = Forward(str(address(OWNER)), OWNER)
    assert fleet.usable("api") == {}
    assert fleet.forward_target("api", capacity_spent=True) == expected  # not checked yet: trusted
    fleet.checked(OWNER, 1.0, answer(OWNER, api=1), "", 1.0)
    assert fleet.forward_target("api", capacity_spent=True) == expected
    assert fleet.snapshot_service("api", 1.0)["forward_to"] == f"peer {address(OWNER)}"
    fleet.checked(OWNER, 2.0, None, "timed out", 2.0)
    assert fleet.forward_target("api", capacity_spent=True) == expected  # one miss is not down


def test_a_non_owner_raises_peer_unavailable_when_every_owner_is_down() -> None:
    fleet = fleet_of(NON_OWNERS[0], ABC, ONE, unhealthy_after=2)
    down(fleet, OWNER, 1.0, times=2)
    with pytest.raises(PeerUnavailable) as info:
        fleet.forward_target("api", capacity_spent=True)
    assert (info.value.status, info.value.reason) == (503, "peer-unavailable")
    assert fleet.snapshot_service("api", 3.0)["forward_to"] is None
    # The other non-owner is up, but owns nothing: not an answer.
    fleet.checked(NON_OWNERS[1], 3.0, answer(NON_OWNERS[1], api=0), "", 3.0)
    with pytest.raises(PeerUnavailable):
        fleet.forward_target("api", capacity_spent=False)
    fleet.checked(OWNER, 4.0, answer(OWNER, api=1), "", 4.0)
    assert fleet.forward_target("api", capacity_spent=True) == Forward(str(address(OWNER)), OWNER)


def test_a_non_owners_preferred_owner_is_the_rendezvous_first() -> None:
    not_by_name = 0
    for i in range(8):
        two = svc(f"10.0.{i}.1:8000", f"10.0.{i}.2:8000", cc=1)
        [idle_peer] = [p for p, owned in division(two, ABC).items() if not owned]
        owners = [p for p in ABC if p != idle_peer]
        fleet = fleet_of(idle_peer, ABC, two)
        best = max(owners, key=lambda p: score(p, idle_peer))
        assert fleet.forward_target("api", capacity_spent=True) == Forward(str(address(best)), best)
        not_by_name += best != min(owners)
    assert not_by_name  # (some case tells the rendezvous order from the names' order)


def test_a_non_owner_sticks_to_one_owner_while_it_is_up() -> None:
    two = svc("10.0.1.1:8000", "10.0.1.2:8000", cc=1)
    [idle_peer] = [p for p, owned in division(two, ABC).items() if not owned]
    fleet = fleet_of(idle_peer, ABC, two, unhealthy_after=1)
    first = fleet.forward_target("api", capacity_spent=True)
    assert first is not None and first.name != idle_peer
    [other] = [p for p in ABC if p not in (idle_peer, first.name)]
    for t in (1.0, 2.0, 3.0):
        fleet.checked(other, t, answer(other, api=1), "", t)
        assert fleet.forward_target("api", capacity_spent=True) == first
    fleet.checked(first.name, 4.0, None, "refused", 4.0)
    assert fleet.forward_target("api", capacity_spent=True) == Forward(str(address(other)), other)
    fleet.checked(first.name, 5.0, answer(first.name, api=1), "", 5.0)
    assert fleet.forward_target("api", capacity_spent=True) == first


def test_an_owner_with_its_capacity_spent_forwards_to_an_up_peer_with_capacity() -> None:
    fleet = fleet_of("vm-a", ABC, API3, unhealthy_after=1)
    assert fleet.usable("api") and fleet.forward_target("api", capacity_spent=False) is None
    assert fleet.snapshot_service("api", 0.0)["forward_to"] is None  # it owns slots: nothing to show
    assert fleet.forward_target("api", capacity_spent=True) is None  # nobody reported capacity
    fleet.checked("vm-b", 1.0, answer("vm-b", api=0, web=5), "", 1.0)
    assert fleet.forward_target("api", capacity_spent=True) is None  # vm-b has none of api
    fleet.checked("vm-c", 1.0, answer("vm-c", api=1), "", 1.0)
    assert fleet.forward_target("api", capacity_spent=True) == Forward(str(address("vm-c")), "vm-c")
    assert fleet.forward_target("api", capacity_spent=False) is None
    fleet.checked("vm-c", 2.0, None, "refused", 2.0)  # down (its last capacity is stale)
    assert fleet.forward_target("api", capacity_spent=True) is None
    fleet.checked("vm-b", 3.0, answer("vm-b", api=None), "", 3.0)  # unlimited counts
    assert fleet.forward_target("api", capacity_spent=True) == Forward(str(address("vm-b")), "vm-b")


def test_an_owner_with_capacity_spent_prefers_an_owner_to_a_peer_that_owns_nothing() -> None:
    two = svc("10.0.1.1:8000", "10.0.1.2:8000", cc=1)
    owners = [p for p, owned in division(two, ABC).items() if owned]
    [idle_peer] = [p for p in ABC if p not in owners]
    me, other = owners
    fleet = fleet_of(me, ABC, two)
    for peer in (idle_peer, other):
        fleet.checked(peer, 1.0, answer(peer, api=1), "", 1.0)
    assert fleet.forward_target("api", capacity_spent=True) == Forward(str(address(other)), other)
    down(fleet, other, 2.0)
    assert fleet.forward_target("api", capacity_spent=True) == Forward(str(address(idle_peer)), idle_peer)


def test_an_owner_with_capacity_spent_prefers_owners_in_its_order() -> None:
    fleet = fleet_of("vm-a", ABC, API3)
    for peer in ("vm-b", "vm-c"):
        fleet.checked(peer, 1.0, answer(peer, api=2), "", 1.0)
    first = fleet.forward_target("api", capacity_spent=True)
    assert first is not None and first.name == fleet.shares["api"].owners[0]
    assert all(fleet.forward_target("api", capacity_spent=True) == first for _ in range(5))


def test_a_removed_peer_is_not_forwarded_to() -> None:
    fleet, _ = removed_c()
    fleet.checked("vm-c", 11.0, answer("vm-c", {"api": {min(GAINED): 1}}, api=3), "", 11.0)
    assert fleet.health["vm-c"].state is PeerState.UP and "vm-c" in fleet.departed
    assert fleet.forward_target("api", capacity_spent=True) is None


# -- checks and health -------------------------------------------------------------------------


def test_check_targets_carry_our_view_of_each_peers_shares() -> None:
    api = svc(*SIX, pod("10.0.1.9:8000", drain=True), cc=2)
    web = svc("10.0.3.1:8000", "10.0.3.2:8000", cc=3, name="web")
    free = svc("10.0.4.1:8000", cc=0, name="free")  # unlimited: in no view
    fleet = fleet_of("vm-a", ABC, api, web, free)
    targets = fleet.check_targets(())
    assert [(t.name, t.address, t.scope) for t in targets] == [
        ("vm-b", str(address("vm-b")), ACTIVATOR_SCOPE),
        ("vm-c", str(address("vm-c")), ACTIVATOR_SCOPE),
    ]
    for t in targets:
        assert t.view == {
            "api": {p: division(api, ABC)[t.name].get(p, 0) for p in SIX},
            "web": {p: division(web, ABC)[t.name].get(p, 0) for p in limits(web)},
        }


def test_check_targets_include_the_sibling_workers() -> None:
    api = svc(*SIX, cc=3)
    mine = division(api, ABC)["vm-a"]
    workers = divide_slots(mine, ["0", "1", "2"])
    fleet = Fleet(worker_index=1, workers=3)
    apply(fleet, config("vm-a", ABC, api, workers=3), 0.0)
    targets = fleet.check_targets(("127.0.0.1:31000", "127.0.0.1:31001", "127.0.0.1:31002"))
    assert [t.name for t in targets if t.scope == ACTIVATOR_SCOPE] == ["vm-b", "vm-c"]
    siblings = [t for t in targets if t.scope == WORKER_SCOPE]
    assert [(t.name, t.address) for t in siblings] == [("worker 0", "127.0.0.1:31000"), ("worker 2", "127.0.0.1:31002")]
    for t in siblings:
        index = t.name.removeprefix("worker ")
        assert t.view == {"api": {p: workers[index].get(p, 0) for p in mine}}


def test_check_answers_change_peer_health_and_are_reported_once() -> None:
    fleet = fleet_of("vm-a", ABC, API3, unhealthy_after=2)
    assert fleet.snapshot_peers(0.0)["vm-b"]["state"] == "unknown"
    fleet.checked("vm-b", 1.0, None, "timed out", 1.0)
    assert fleet.take_changes() == []
    fleet.checked("vm-b", 2.0, None, "refused", 2.0)
    fleet.checked("vm-b", 3.0, None, "refused", 3.0)
    assert fleet.take_changes() == [PeerChange("vm-b", PeerState.UNKNOWN, PeerState.DOWN, "refused")]
    assert fleet.take_changes() == []
    fleet.checked("vm-b", 4.0, answer("vm-b", api=1), "", 4.0)
    fleet.checked("vm-c", 4.0, answer("vm-c", api=1), "", 4.0)
    assert fleet.take_changes() == [
        PeerChange("vm-b", PeerState.DOWN, PeerState.UP, "answered"),
        PeerChange("vm-c", PeerState.UNKNOWN, PeerState.UP, "answered"),
    ]
    peers = fleet.snapshot_peers(5.0)
    assert sorted(peers) == ["vm-b", "vm-c"]
    assert peers["vm-b"] == {
        "address": str(address("vm-b")),
        "state": "up",
        "failures": 0,
        "seconds_in_state": 1.0,
        "last_answer_seconds_ago": 1.0,
        "last_error": None,
        "departed": False,
    }


def test_a_new_address_for_a_peer_is_followed() -> None:
    fleet = fleet_of("vm-a", ABC, API3)
    fleet.checked("vm-b", 1.0, answer("vm-b", api=1), "", 1.0)
    moved = config("vm-a", ABC, API3)
    assert moved.activators is not None
    moved = Config(
        path=moved.path,
        activators=ActivatorsConfig("vm-a", {**moved.activators.peers, "vm-b": Address("10.9.9.9", 8080)}),
        services=moved.services,
    )
    apply(fleet, moved, 2.0)
    assert target(fleet, "vm-b").address == "10.9.9.9:8080"
    assert fleet.health["vm-b"].state is PeerState.UP  # the same peer: its health is kept


# -- found by the model of the fleet (tests/core/test_fleet_model.py) --------------------------


def test_a_cc_that_falls_waits_for_the_holder_of_the_slot_that_vanished() -> None:
    # cc 2 -> 1 on a pod of two activators: one keeps its slot, the other's vanishes, and
    # its request may still run there: the slot that remains waits for its answer.
    two = ("vm-a", "vm-b")
    before, after = svc("10.0.1.1:8000", cc=2), svc("10.0.1.1:8000", cc=1)
    [keeper] = [p for p, owned in division(after, two).items() if owned]
    [loser] = [p for p in two if p != keeper]
    fleet = fleet_of(keeper, two, before)
    assert fleet.usable("api") == {"10.0.1.1:8000": 1}
    assert apply(fleet, config(keeper, two, after), 10.0) == {"api": {"10.0.1.1:8000": 0}}
    [held] = fleet.snapshot_service("api", 10.0)["handover"]
    assert held["waiting_on"] == [loser]
    busy = answer(loser, {"api": {"10.0.1.1:8000": 1}})
    assert fleet.checked(loser, 11.0, busy, "", 11.5) == set()
    assert fleet.checked(loser, 12.0, answer(loser, {"api": {"10.0.1.1:8000": 0}}), "", 12.5) == {"api"}
    assert fleet.usable("api") == {"10.0.1.1:8000": 1}


def test_a_cc_that_falls_among_workers_waits_for_the_sibling() -> None:
    before, after = svc("10.0.1.1:8000", cc=2), svc("10.0.1.1:8000", cc=1)
    keeper = next(i for i in range(2) if divide_slots(limits(after), ["0", "1"])[str(i)].get("10.0.1.1:8000"))
    fleet = Fleet(worker_index=keeper, workers=2)
    apply(fleet, config(None, (), before, workers=2), 0.0)
    assert fleet.usable("api") == {"10.0.1.1:8000": 1}
    assert apply(fleet, config(None, (), after, workers=2), 1.0) == {"api": {"10.0.1.1:8000": 0}}
    sibling = f"worker {1 - keeper}"
    assert fleet.checked(sibling, 2.0, None, "connection refused", 2.0, refused=True) == {"api"}  # it crashed
    assert fleet.usable("api") == {"10.0.1.1:8000": 1}


def test_back_to_one_activator_without_peers_still_asks_the_leaver() -> None:
    # Knative's TestActivatorsIndexUpdate: the file drops the peers section altogether;
    # the leaver is still asked (as this activator's name in the file it left, with that
    # file's secret), and a leaver whose port refuses runs nothing: every slot at once.
    api = svc(*SIX, cc=1)
    fleet = fleet_of("vm-a", ("vm-a", "vm-b"), api)
    usable = apply(fleet, config(None, (), api), 10.0)["api"]
    assert usable is not None and sum(usable.values()) < len(SIX)
    [leaver] = fleet.check_targets(())
    assert (leaver.name, leaver.sender, leaver.secret) == ("vm-b", "vm-a", "s")
    assert fleet.checked("vm-b", 11.0, None, "connection refused", 11.0, refused=True) == {"api"}
    assert fleet.usable("api") is None or fleet.usable("api") == dict.fromkeys(SIX, 1)
    assert fleet.departed == {} and fleet.check_targets(()) == []


def test_the_leaver_of_a_file_without_peers_answering_releases_its_slots() -> None:
    api = svc(*SIX, cc=1)
    fleet = fleet_of("vm-a", ("vm-a", "vm-b"), api)
    apply(fleet, config(None, (), api), 10.0)
    assert fleet.me == "vm-a"  # (not "": an answer of the leaver lists the asker by that name)
    assert fleet.checked("vm-b", 11.0, idle("vm-b", api), "", 11.5) == {"api"}
    assert fleet.handovers.pending == {}


def test_a_worker_that_restarts_waits_for_its_siblings() -> None:
    # cc 2 -> 1 while a sibling still runs a request on the pod; this worker restarts
    # with the new file and its share of the one slot: the sibling answers first.
    api = svc("10.0.1.1:8000", cc=1)
    [keeper] = [i for i in range(3) if divide_slots(limits(api), ["0", "1", "2"])[str(i)]]
    fleet = Fleet(worker_index=keeper, workers=3, hand_over_at_start=True)
    assert apply(fleet, config(None, (), api, workers=3), 5.0) == {"api": {"10.0.1.1:8000": 0}}
    siblings = [f"worker {i}" for i in range(3) if i != keeper]
    assert fleet.snapshot_service("api", 5.0)["handover"][0]["waiting_on"] == siblings
    busy, other = siblings
    fleet.checked(other, 6.0, answer(other, {"api": {"10.0.1.1:8000": 0}}), "", 6.0)
    assert fleet.checked(busy, 6.0, answer(busy, {"api": {"10.0.1.1:8000": 1}}), "", 6.0) == set()
    assert fleet.checked(busy, 7.0, None, "connection refused", 7.0, refused=True) == {"api"}  # (it crashed)
    assert fleet.usable("api") == {"10.0.1.1:8000": 1}


def test_a_leaver_is_asked_until_it_answers_even_before_a_gain_waits_on_it() -> None:
    # One worker of two: its share of the pod is capped by its sibling when the peer
    # leaves, so nothing waits on the leaver yet; the cap lifts later: the leaver (still
    # running its older file) is waited on all the same.
    api = svc("10.0.1.1:8000", cc=1)
    two = ("vm-a", "vm-b")
    [keeper] = [i for i in range(2) if divide_slots(limits(api), ["0", "1"])[str(i)]]
    fleet = Fleet(worker_index=keeper, workers=2)
    apply(fleet, config("vm-b", two, api, workers=2), 0.0)
    sibling = f"worker {1 - keeper}"
    fleet.view_received(sibling, {"api": {"10.0.1.1:8000": 0}}, [api], 1.0)  # capped
    apply(fleet, config("vm-b", ("vm-b",), api, workers=2), 2.0)  # vm-a leaves
    assert fleet.expire(3.0) == set() and "vm-a" in fleet.departed  # not forgotten
    assert fleet.view_received(sibling, {"api": {"10.0.1.1:8000": 1}}, [api], 4.0) == {"api"}  # lifted
    assert fleet.usable("api") == {"10.0.1.1:8000": 0}
    assert fleet.snapshot_service("api", 4.0)["handover"][0]["waiting_on"] == sorted([sibling, "vm-a"])


def test_a_share_capped_to_nothing_and_back_still_waits_for_the_first_holders() -> None:
    # A starting worker waits on its peer and its sibling; a stale view of the sibling
    # caps it to nothing, a fresh one lifts the cap: the peer is still waited on.
    api = svc("10.0.1.1:8000", cc=1)
    [keeper] = [i for i in range(2) if divide_slots(limits(api), ["0", "1"])[str(i)]]
    fleet = Fleet(worker_index=keeper, workers=2, hand_over_at_start=True)
    apply(fleet, config("vm-a", ("vm-a", "vm-b"), api, workers=2), 0.0)
    sibling = f"worker {1 - keeper}"
    assert division(api, ("vm-a", "vm-b"))["vm-a"] == {"10.0.1.1:8000": 1}  # (vm-a's pod, as the test needs)
    fleet.view_received(sibling, {"api": {"10.0.1.1:8000": 0}}, [api], 1.0)
    fleet.view_received(sibling, {"api": {"10.0.1.1:8000": 1}}, [api], 2.0)
    fleet.checked(sibling, 3.0, answer(sibling, {"api": {"10.0.1.1:8000": 0}}), "", 3.0)
    assert fleet.usable("api") == {"10.0.1.1:8000": 0}
    assert fleet.snapshot_service("api", 3.0)["handover"][0]["waiting_on"] == ["vm-b"]

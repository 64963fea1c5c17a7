"""Routing by Host, and config reloads applied to the running throttlers as a diff."""

from __future__ import annotations

import random
from typing import Any

import pytest

from activator.core.config import ActivatorsConfig, Address, Config, PodConfig, ServiceConfig
from activator.core.errors import UnknownHost
from activator.core.states import PodState
from activator.core.throttler import Grant, Waiter
from activator.core.topology import Topology

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def pod(address: str, drain: bool = False) -> PodConfig:
    host, port = address.rsplit(":", 1)
    return PodConfig(address=address, host=host.strip("[]"), port=int(port), drain=drain)


def service(name: str, hosts: tuple[str, ...], *pods: str | PodConfig, cc: int = 1, **kw: Any) -> ServiceConfig:
    return ServiceConfig(
        name=name,
        hosts=hosts,
        container_concurrency=cc,
        pods=tuple(p if isinstance(p, PodConfig) else pod(p) for p in pods),
        **kw,
    )


def config(*services: ServiceConfig, activators: ActivatorsConfig | None = None) -> Config:
    return Config(path="test.yaml", services={s.name: s for s in services}, activators=activators)


def topo(cfg: Config, **kw: Any) -> Topology:
    t = Topology(cfg, 0.0, rng=random.Random(0), **kw)
    t.check_invariants()
    return t


def grant_of(result: Grant | Waiter) -> Grant:
    assert isinstance(result, Grant)
    return result


def nothing() -> None:
    pass


API = service("api", ("api.example.com",), A)
WEB = service("web", ("web.example.com", "www.example.com"), B)
LOCAL6 = service("v6", ("::1",), C)
CATCH_ALL = service("default", ("*",), C)


# -- routing -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("api.example.com", "api"),
        ("Api.Example.Com", "api"),
        ("api.example.com:8080", "api"),
        ("www.example.com", "web"),
        ("WEB.example.com:443", "web"),
        ("  api.example.com  ", "api"),
        ("[::1]:8080", "v6"),
        ("[::1]", "v6"),
        ("::1", "v6"),
        ("[0:0::1]:80", "v6"),  # the compressed form the config stores
    ],
)
def test_route_by_host(header: str, name: str) -> None:
    t = topo(config(API, WEB, LOCAL6))
    assert t.route(header).name == name


@pytest.mark.parametrize("header", ["unknown.example.com", "", "api.example.com.evil", "127.0.0.1:8080"])
def test_unknown_host(header: str) -> None:
    t = topo(config(API, WEB))
    with pytest.raises(UnknownHost) as info:
        t.route(header)
    assert info.value.status == 404 and info.value.reason == "unknown-host"


@pytest.mark.parametrize("header", ["unknown.example.com", "", "127.0.0.1:8080"])
def test_catch_all_takes_unknown_hosts(header: str) -> None:
    t = topo(config(API, CATCH_ALL))
    assert t.route(header).name == "default"
    assert t.route("api.example.com").name == "api"  # a named host still wins


def test_no_services_routes_nothing() -> None:
    t = topo(config())
    with pytest.raises(UnknownHost):
        t.route("api.example.com")


def test_host_moved_to_another_service_on_reload() -> None:
    t = topo(config(API, WEB))
    t.apply(config(service("api", (), A), service("web", ("web.example.com", "api.example.com"), B)), 1.0)
    assert t.route("api.example.com").name == "web"
    t.apply(config(API), 2.0)
    with pytest.raises(UnknownHost):
        t.route("web.example.com")


def test_catch_all_removed_on_reload() -> None:
    t = topo(config(API, CATCH_ALL))
    t.apply(config(API), 1.0)
    with pytest.raises(UnknownHost):
        t.route("other.example.com")


# -- reloads -------------------------------------------------------------------


def test_apply_keeps_throttlers_and_trackers() -> None:
    t = topo(config(API, WEB))
    api = t.route("api.example.com")
    tracker = api.trackers[A]
    g = grant_of(api.acquire(0.0, nothing))
    t.apply(config(service("api", ("api.example.com",), A, B, cc=2), WEB), 1.0)
    assert t.route("api.example.com") is api
    assert api.trackers[A] is tracker and tracker.in_flight == 1
    assert api.config.container_concurrency == 2
    assert set(api.trackers) == {A, B}
    t.check_invariants()
    api.release(g, 2.0)
    assert tracker.in_flight == 0


def test_reload_keeps_waiters() -> None:
    notes: list[str] = []
    t = topo(config(API))
    api = t.route("api.example.com")
    grant_of(api.acquire(0.0, nothing))
    w = api.acquire(0.0, lambda: notes.append("w"))
    assert isinstance(w, Waiter)
    t.apply(config(service("api", ("api.example.com",), A, B)), 1.0)  # a pod added
    assert notes == ["w"] and w.grant is not None and w.grant.pod.address == B
    t.check_invariants()


def test_removed_service_keeps_its_busy_trackers_until_released() -> None:
    t = topo(config(API, WEB))
    api = t.route("api.example.com")
    g = grant_of(api.acquire(0.0, nothing))
    t.apply(config(WEB), 1.0)
    with pytest.raises(UnknownHost):
        t.route("api.example.com")
    assert t.services["api"] is api  # still tracked: a request runs on it
    assert api.trackers[A].state is PodState.DRAINING and api.trackers[A].in_flight == 1
    t.check_invariants()
    api.release(g, 2.0)
    assert A not in api.trackers and api.idle
    t.tick(3.0)
    assert "api" not in t.services
    t.check_invariants()


def test_removed_idle_service_disappears_at_once() -> None:
    t = topo(config(API, WEB))
    t.apply(config(WEB), 1.0)
    assert set(t.services) == {"web"}


def test_removed_service_with_a_waiter_disappears_once_it_gave_up() -> None:
    t = topo(config(API))
    api = t.route("api.example.com")
    g = grant_of(api.acquire(0.0, nothing))
    w = api.acquire(0.0, nothing)
    assert isinstance(w, Waiter)
    t.apply(config(), 1.0)
    api.release(g, 2.0)
    assert w.grant is None  # nothing routable left for it
    assert "api" in t.services
    assert api.abandon(w) is None  # its queue_timeout
    t.tick(3.0)
    assert "api" not in t.services


def test_re_added_service_reuses_its_throttler_and_keeps_the_count() -> None:
    # The seed bug one level up: a service removed and re-added while busy.
    t = topo(config(API))
    api = t.route("api.example.com")
    g = grant_of(api.acquire(0.0, nothing))
    t.apply(config(), 1.0)
    t.apply(config(API), 2.0)
    assert t.route("api.example.com") is api
    assert api.trackers[A].in_flight == 1 and api.trackers[A].state is PodState.HEALTHY
    assert isinstance(api.acquire(3.0, nothing), Waiter)  # cc=1: not a second request
    t.check_invariants()
    api.release(g, 4.0)
    assert api.queued == 0 and api.trackers[A].in_flight == 1
    t.check_invariants()


def test_re_added_service_after_it_was_dropped_starts_fresh() -> None:
    t = topo(config(API))
    old = t.route("api.example.com")
    t.apply(config(), 1.0)
    t.apply(config(API), 2.0)
    assert t.route("api.example.com") is not old


def test_transitions_are_reported() -> None:
    seen: list[tuple[str, str, str]] = []
    t = topo(config(API), on_transition=lambda tr: seen.append((tr.service, tr.address, tr.new.value)))
    t.apply(config(service("api", ("api.example.com",), pod(A, drain=True))), 1.0)
    assert ("api", A, "healthy") in seen and ("api", A, "removed") in seen


def test_snapshot_lists_services_by_name() -> None:
    t = topo(config(WEB, API))
    snap = t.snapshot(1.0)
    assert list(snap) == ["api", "web"]
    assert snap["api"]["pods"][0]["address"] == A


# -- several activators and workers --------------------------------------------


def peers(*names: str, me: str) -> ActivatorsConfig:
    return ActivatorsConfig(self_name=me, peers={n: Address(f"10.1.0.{i}", 8080) for i, n in enumerate(names, 1)})


def test_single_peer_owns_every_slot() -> None:
    cfg = config(service("api", ("api",), A, B, cc=3), activators=peers("vm-a", me="vm-a"))
    t = topo(cfg)
    assert t.route("api").capacity == 6


@pytest.mark.parametrize("cc", [1, 2, 3, 5])
def test_two_activators_divide_every_pod_exactly(cc: int) -> None:
    svc = service("api", ("api",), A, B, C, cc=cc)
    views = [topo(config(svc, activators=peers("vm-a", "vm-b", me=me))) for me in ("vm-a", "vm-b")]
    for address in (A, B, C):
        assert sum(v.route("api").trackers[address].slots or 0 for v in views) == cc
    totals = [v.route("api").capacity or 0 for v in views]
    assert sum(totals) == 3 * cc
    assert max(totals) - min(totals) <= 1


def test_workers_divide_this_activators_slots() -> None:
    svc = service("api", ("api",), A, B, cc=3)
    workers = ("127.0.0.1:9001", "127.0.0.1:9002")
    views = [topo(config(svc), worker_index=i, workers=workers) for i in range(2)]
    for address in (A, B):
        assert sum(v.route("api").trackers[address].slots or 0 for v in views) == 3


def test_peer_removed_gives_this_activator_every_slot() -> None:
    # Knative TestActivatorsIndexUpdate: 2 activators, then the peer leaves.
    svc = service("api", ("api",), A, cc=1)
    views = [topo(config(svc, activators=peers("vm-a", "vm-b", me=me))) for me in ("vm-a", "vm-b")]
    assert sorted(v.route("api").capacity for v in views) == [0, 1]  # type: ignore[type-var]
    loser = next(v for v in views if v.route("api").capacity == 0)
    me = loser.config.activators.self_name  # type: ignore[union-attr]
    loser.apply(config(svc, activators=peers(me, me=me)), 1.0)
    assert loser.route("api").capacity == 1


def test_cc0_pods_are_used_by_every_activator() -> None:
    svc = service("api", ("api",), A, B, cc=0)
    for me in ("vm-a", "vm-b"):
        t = topo(config(svc, activators=peers("vm-a", "vm-b", me=me)))
        assert t.route("api").capacity is None
        grant_of(t.route("api").acquire(0.0, nothing))


def test_drained_pod_is_left_out_of_the_division() -> None:
    svc = service("api", ("api",), A, pod(B, drain=True), cc=1)
    views = [topo(config(svc, activators=peers("vm-a", "vm-b", me=me))) for me in ("vm-a", "vm-b")]
    assert sum(v.route("api").trackers[A].slots or 0 for v in views) == 1
    assert all(v.route("api").trackers[B].slots == 0 for v in views)


def test_activator_owning_no_slot_forwards_to_one_that_does() -> None:
    svc = service("api", ("api",), A, cc=1)
    views = {me: topo(config(svc, activators=peers("vm-a", "vm-b", me=me))) for me in ("vm-a", "vm-b")}
    owner = next(me for me, v in views.items() if v.route("api").capacity == 1)
    other = next(me for me in views if me != owner)
    assert views[owner].forward_target("api") is None
    forward = views[other].forward_target("api")
    assert forward is not None and forward.kind == "peer"
    assert forward.address == str(views[other].config.activators.peers[owner])  # type: ignore[union-attr]


def test_route_cache_follows_reloads() -> None:
    t = topo(config(API))
    assert t.route("API.example.com:80").name == "api"
    t.apply(config(WEB), 1.0)
    with pytest.raises(UnknownHost):
        t.route("API.example.com:80")


def test_apply_only_the_changed_services_leaves_the_others_alone() -> None:
    old = config(service("a", ("a.x",), "10.0.0.1:80"), service("b", ("b.x",), "10.0.0.2:80"))
    t = topo(old)
    untouched = t.services["b"].config
    new = config(service("a", ("a.x",), "10.0.0.3:80", "10.0.0.1:80"),
                 service("b", ("b.x",), "10.0.0.2:80", "10.0.0.9:80"))
    t.apply(new, 1.0, only={"a"})
    assert set(t.services["a"].trackers) == {"10.0.0.1:80", "10.0.0.3:80"}
    assert t.services["a"].trackers["10.0.0.3:80"].rank == 0  # a reorder is a change too
    assert t.services["b"].config is untouched and set(t.services["b"].trackers) == {"10.0.0.2:80"}
    t.apply(new, 2.0)  # None: every service
    assert set(t.services["b"].trackers) == {"10.0.0.2:80", "10.0.0.9:80"}
    t.check_invariants()

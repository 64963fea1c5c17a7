"""End to end: several activators in front of the same pods (issue 4, point 6).

Two or three real ``activator run`` processes (or ``$ACTIVATOR_BIN``) on 127.0.0.1,
with the same ``activators.peers`` list (each peer's address is its proxy listener, so
the ports are picked before any of them starts), in front of ``tests/backend.py`` pods
that record their own peak concurrency. Load goes to every activator at once. What is
proven:

- together they never push a cc=1 pod past 1 (nor a cc=2 pod past 2), and every request
  succeeds;
- a service with fewer slots than activators is served through every activator: the
  ones owning nothing forward to the owner (``forward_to`` in /status, and the owner's
  count of requests on the pod is everyone's);
- the slots a peer owned move to the others when it leaves the file, with zero failed
  requests while load runs, and it gets its share back when it returns;
- ``activator check`` prints this activator's share.

Waits poll ``/status`` with generous timeouts; no assertion is on elapsed time.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from harness import (
    LOCALHOST,
    Activator,
    Pod,
    concurrent_requests,
    find_pod,
    free_ports,
    request,
    run_cli,
    service_config,
    wait_until,
)

pytestmark = pytest.mark.binary

#: A service of the fleet's files: ``service(pods, hosts=[...], container_concurrency=N)``.
service = partial(service_config, queue_depth=500, queue_timeout="30s")


# --------------------------------------------------------------------------------------
# helpers


#: The peers' shared secret in these tests.
FLEET_SECRET = "the-fleets-shared-secret"


def fleet_config(name: str, peers: Mapping[str, str], services: Mapping[str, Any], **top: Any) -> dict[str, Any]:
    """One activator's file: the same everywhere except ``self`` (and so ``listen``)."""
    return {
        "listen": peers[name],
        "access_log": os.environ.get("PEERS_ACCESS_LOG") == "1",
        **top,
        "activators": {"self": name, "peers": dict(peers), "secret": FLEET_SECRET},
        "services": dict(services),
    }


def start_fleet(
    activator_factory: Callable[..., Activator], names: Sequence[str], services: Mapping[str, Any], **top: Any
) -> tuple[dict[str, Activator], dict[str, str]]:
    """Start one activator per name (all launched, then each waited for, until it sees
    every peer up (one checked before it listened was down) and its peers answered: a
    starting activator uses its share once they have)."""
    peers = {name: f"{LOCALHOST}:{port}" for name, port in zip(names, free_ports(len(names)), strict=True)}
    acts = {name: activator_factory(fleet_config(name, peers, services, **top), start=False) for name in names}
    for act in acts.values():
        act.start(wait_ready=False)
    for act in acts.values():
        act.wait_ready()
    for act in acts.values():
        act.wait_for(
            lambda st: all(h["state"] == "up" for h in st["activator"]["health"].values()), message="every peer up"
        )
        wait_handed_over(act)
    return acts, peers


def slots_of(act: Activator, service_name: str, address: str, status: dict[str, Any] | None = None) -> int:
    pod = find_pod(status if status is not None else act.status(), service_name, address)
    assert pod is not None, f"{address} not in {service_name} of {act.listen}"
    assert pod["slots"] is not None, f"{address} of {service_name} is unlimited in {act.listen}"
    return int(pod["slots"])


def wait_handed_over(act: Activator) -> None:
    """Until no slot that moved to ``act`` waits for its old holder any more, and no
    peer's view (from a file older than ``act``'s) caps it."""
    act.wait_for(
        lambda st: all(not s["handover_slots"] and not s["capped_by"] for s in st["services"].values()),
        message="moved slots handed over",
    )


def slot_table(acts: Mapping[str, Activator], service_name: str, pods: Sequence[Pod]) -> dict[str, dict[str, int]]:
    """activator name -> {pod address: slots owned there}, from each one's /status."""
    table = {}
    for name, act in acts.items():
        st = act.status()
        table[name] = {p.address: slots_of(act, service_name, p.address, st) for p in pods}
    return table


def assert_exact_cover(table: Mapping[str, Mapping[str, int]], pods: Sequence[Pod], cc: int) -> None:
    for pod in pods:
        got = {name: row[pod.address] for name, row in table.items()}
        assert sum(got.values()) == cc, f"{pod.address}: slots {got} do not add up to cc {cc}"
    totals = [sum(row.values()) for row in table.values()]
    assert max(totals) - min(totals) <= 1, f"unbalanced: {table}"


def owner_of(acts: Mapping[str, Activator], service_name: str, pod: Pod) -> str:
    owners = [name for name, act in acts.items() if slots_of(act, service_name, pod.address)]
    assert len(owners) == 1, f"{pod.address} of {service_name} owned by {owners}"
    return owners[0]


class Load:
    """Client threads sending requests in a loop until stopped; every outcome kept (a
    failure with the phase it was sent in and the one it ended in).

    ``targets`` (a list of (activator, Host header)) can be swapped while it runs.
    """

    def __init__(self, targets: Sequence[tuple[Activator, str]], threads: int, path: str) -> None:
        self.targets = list(targets)
        self.path = path
        self.phase = "start"  # a label the test moves along, shown with failures
        self.outcomes: list[tuple[str, str, Any]] = []  # (listen, host, status or error)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, i: int) -> None:
        k = i
        while not self._stop.is_set():
            targets = self.targets
            act, host = targets[k % len(targets)]
            k += 1
            phase = self.phase
            try:
                resp = request(act.listen, path=self.path, host=host, timeout=60)
                outcome: Any = resp.status
                if resp.status != 200:
                    outcome = (resp.status, resp.headers.get("X-Activator-Reason"), phase, self.phase)
            except Exception as exc:  # recorded as a failure
                outcome = (repr(exc), phase, self.phase)
            if outcome != 200:
                self.failed(act, host, outcome)
            with self._lock:
                self.outcomes.append((act.listen, host, outcome))

    def failed(self, act: Activator, host: str, outcome: Any) -> None:
        """A request failed (its outcome: status, reason, phase sent, phase done)."""

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def count(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def wait_more(self, n: int) -> None:
        """Wait until ``n`` more requests finished (so the load really overlaps a step)."""
        goal = self.count() + n
        wait_until(lambda: self.count() >= goal, timeout=60, message=f"{n} more requests done")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)

    def failures(self) -> list[tuple[str, str, Any]]:
        with self._lock:
            return [o for o in self.outcomes if o[2] != 200]


# --------------------------------------------------------------------------------------
# hammering every activator at once


@pytest.mark.parametrize("n", [2, 3])
def test_hammer_every_activator_no_cc1_pod_above_one(n, pod_factory, activator_factory):
    pods = pod_factory(4)
    (solo,) = pod_factory(1)
    names = ["vm-a", "vm-b", "vm-c"][:n]
    acts, _ = start_fleet(
        activator_factory,
        names,
        {
            "api": service(pods, hosts=["api.test"], container_concurrency=1),
            "solo": service([solo], hosts=["solo.test"], container_concurrency=1),
        },
    )
    order = [acts[name] for name in names]
    table = slot_table(acts, "api", pods)
    assert_exact_cover(table, pods, 1)
    assert_exact_cover(slot_table(acts, "solo", [solo]), [solo], 1)

    # 40 requests to api and 12 to the one-pod service, spread over every activator,
    # all released together.
    def one(i: int) -> Any:
        if i < 40:
            return request(order[i % n].listen, path="/delay?ms=100", host="api.test")
        return request(order[i % n].listen, path="/delay?ms=100", host="solo.test")

    results = concurrent_requests(52, one)

    assert [r.status for r in results] == [200] * 52
    for pod in pods:
        stats = pod.stats()
        assert stats["peak"] == 1, f"{pod.address} saw {stats['peak']} requests at once"
        assert stats["count"] > 0, f"{pod.address} was never used: a black hole"
    assert sum(p.stats()["count"] for p in pods) == 40
    assert {r.headers["X-Pod"] for r in results[:40]} == {p.address for p in pods}
    assert solo.stats()["peak"] == 1
    assert solo.stats()["count"] == 12
    for act in order:
        act.wait_idle()


@pytest.mark.parametrize("n", [2, 3])
def test_one_pod_service_is_served_through_every_activator(n, pod_factory, activator_factory):
    (solo,) = pod_factory(1)
    names = ["vm-a", "vm-b", "vm-c"][:n]
    acts, peers = start_fleet(
        activator_factory, names, {"solo": service([solo], hosts=["solo.test"], container_concurrency=1)}
    )
    owner = owner_of(acts, "solo", solo)
    for name, act in acts.items():
        svc = act.status()["services"]["solo"]
        if name == owner:
            assert svc["forward_to"] is None
            assert svc["capacity"] == 1
        else:
            assert svc["forward_to"] == f"peer {peers[owner]}", svc
            assert svc["capacity"] == 0
        shown = act.status()["activator"]
        assert (shown["self"], shown["peers"]) == (name, peers)
        assert set(shown["health"]) == set(peers) - {name}  # every other peer, checked

    # One at a time through each activator, then a burst through all of them at once.
    for act in acts.values():
        for _ in range(2):
            resp = request(act.listen, path="/delay?ms=10", host="solo.test")
            assert resp.status == 200, (act.listen, resp.status, resp.text)
            assert resp.headers["X-Pod"] == solo.address
    order = list(acts.values())
    burst = concurrent_requests(4 * n, lambda i: request(order[i % n].listen, path="/delay?ms=50", host="solo.test"))
    assert [r.status for r in burst] == [200] * (4 * n)
    total = 2 * n + 4 * n
    assert solo.stats()["count"] == total
    assert solo.stats()["peak"] == 1

    # Every request reached the pod through the owner's slot.
    for name, act in acts.items():
        act.wait_idle()
        pod = find_pod(act.status(), "solo", solo.address)
        assert pod is not None
        assert pod["requests"] == (total if name == owner else 0), (name, pod)


def test_cc2_pods_two_activators_own_one_slot_of_each(pod_factory, activator_factory):
    pods = pod_factory(2)
    acts, _ = start_fleet(
        activator_factory, ["vm-a", "vm-b"], {"api": service(pods, hosts=["api.test"], container_concurrency=2)}
    )
    table = slot_table(acts, "api", pods)
    assert table == {name: {p.address: 1 for p in pods} for name in acts}, table
    for act in acts.values():
        assert act.status()["services"]["api"]["capacity"] == 2

    order = list(acts.values())
    results = concurrent_requests(30, lambda i: request(order[i % 2].listen, path="/delay?ms=100", host="api.test"))
    assert [r.status for r in results] == [200] * 30
    for pod in pods:
        stats = pod.stats()
        assert 1 <= stats["peak"] <= 2, f"{pod.address} saw {stats['peak']} requests at once"
    assert sum(p.stats()["count"] for p in pods) == 30
    for act in order:
        act.wait_idle()


def worker_private_addresses(act: Activator) -> list[str]:
    """Each worker's private proxy port, from the ``ACTIVATOR_WORKER`` spec in the
    environment of a process under the activator (a descendant: a one-file
    ``$ACTIVATOR_BIN`` runs the supervisor under its bootloader); see workersockets.py."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
            except OSError:
                pass
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor and ancestor != act.pid:
            ancestor = parents.get(ancestor)
        if ancestor != act.pid:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"ACTIVATOR_WORKER="):
                addresses: list[str] = json.loads(item.partition(b"=")[2])["addresses"]
                return addresses
    raise AssertionError(f"no worker found under {act.pid}")


def test_activators_with_two_workers_each(pod_factory, activator_factory):
    """Both levels at once: slots divided among 2 activators, then among each one's 2
    workers. A request forwarded by a peer may still go to a sibling worker (the
    second level of the one-hop rule); a cc=1 pod is never pushed past 1."""
    pods = pod_factory(3)
    (solo,) = pod_factory(1)
    acts, peers = start_fleet(
        activator_factory,
        ["vm-a", "vm-b"],
        {
            "api": service(pods, hosts=["api.test"], container_concurrency=1),
            "solo": service([solo], hosts=["solo.test"], container_concurrency=1),
        },
        workers=2,
    )
    for act in acts.values():
        act.wait_for(lambda st: st["ready"] and st["worker"]["count"] == 2, message="both workers ready")
    assert_exact_cover(slot_table(acts, "api", pods), pods, 1)
    owner = owner_of(acts, "solo", solo)
    for name, act in acts.items():
        forward = act.status()["services"]["solo"]["forward_to"]
        assert forward == (None if name == owner else f"peer {peers[owner]}"), (name, forward)

    # A request marked as coming from the peer, straight to each worker of the owner:
    # the worker without the slot passes it to its sibling instead of queueing it.
    for address in worker_private_addresses(acts[owner]):
        resp = request(address, path="/delay?ms=10", host="solo.test", headers={"X-Activator-Forwarded": "peer vm-x"})
        assert resp.status == 200, (address, resp.status, resp.text)

    order = list(acts.values())
    plan = ["api.test"] * 30 + ["solo.test"] * 12
    results = concurrent_requests(len(plan), lambda i: request(order[i % 2].listen, path="/delay?ms=100", host=plan[i]))
    assert [r.status for r in results] == [200] * len(plan)
    # (Which worker gets a connection is the kernel's choice, so a pod owned by one
    # worker may see no request at all: the limit is what is checked here.)
    for pod in [*pods, solo]:
        stats = pod.stats()
        assert stats["peak"] <= 1, f"{pod.address} saw {stats['peak']} requests at once"
    assert sum(p.stats()["count"] for p in pods) == 30
    assert solo.stats()["count"] == 12 + 2
    assert solo.stats()["peak"] == 1
    for act in order:
        act.wait_idle()


# --------------------------------------------------------------------------------------
# a peer leaves the file, and comes back


def removal_fleet(pod_factory: Callable[..., list[Pod]]) -> tuple[list[Pod], Pod, dict[str, Any]]:
    """3 pods of cc 2 (6 slots: 2 per activator of 3) and a one-pod cc=1 service."""
    pods = pod_factory(3)
    (solo,) = pod_factory(1)
    # queue_timeout: a request stranded in a queue shows up as a 503 well within the test.
    services = {
        "api": service(pods, hosts=["api.test"], container_concurrency=2),
        "solo": service([solo], hosts=["solo.test"], container_concurrency=1, queue_timeout="10s"),
    }
    return pods, solo, services


def test_peer_removed_under_load_gives_its_slots_away_with_zero_failures(pod_factory, activator_factory):
    pods, solo, services = removal_fleet(pod_factory)
    acts, peers = start_fleet(activator_factory, ["vm-a", "vm-b", "vm-c"], services)
    before = slot_table(acts, "api", pods)
    assert_exact_cover(before, pods, 2)
    assert all(sum(row.values()) == 2 for row in before.values()), before  # 6 slots, 2 each

    # The peer that leaves is the one owning the one-pod service: the others forward
    # that service to it, so they must take it over.
    victim_name = owner_of(acts, "solo", solo)
    victim = acts[victim_name]
    remaining = {name: act for name, act in acts.items() if name != victim_name}
    without = {name: addr for name, addr in peers.items() if name != victim_name}

    targets = [(act, host) for act in remaining.values() for host in ("api.test", "solo.test")]
    with Load(targets, threads=6, path="/delay?ms=40") as load:
        load.wait_more(30)

        # 1. Every remaining activator gets the file without the victim.
        load.phase = "victim leaves the file"
        for name, act in remaining.items():
            act.rewrite_config(fleet_config(name, without, services))
        for act in remaining.values():
            act.wait_for(lambda st: set(st["activator"]["peers"]) == set(without), message="peer list applied")
        for act in remaining.values():
            wait_handed_over(act)

        after = slot_table(remaining, "api", pods)
        assert_exact_cover(after, pods, 2)
        for name in remaining:
            for pod in pods:
                # the victim's slots went to the others; nobody else lost one
                assert after[name][pod.address] >= before[name][pod.address], (before, after)
        assert sum(slots_of(act, "solo", solo.address) for act in remaining.values()) == 1
        for act in remaining.values():
            assert act.status()["services"]["solo"]["forward_to"] in (None, *(f"peer {a}" for a in without.values()))
        load.wait_more(20)

        # 2. Only then is the victim stopped: its in-flight (forwarded) requests finish.
        load.phase = "victim stopping"
        assert victim.stop() == 0
        load.phase = "victim stopped"
        load.wait_more(30)

    assert load.failures() == [], f"{len(load.failures())} of {load.count()} failed: {load.failures()[:10]}"
    assert load.count() >= 80
    # Slots only moved away from the victim, which never served the api pods (only
    # forwarded solo requests reached it): they were never overcommitted.
    for pod in pods:
        assert pod.stats()["peak"] <= 2, f"{pod.address} saw {pod.stats()['peak']} at once"
    for act in remaining.values():
        act.wait_idle()


def test_peer_added_back_under_load_gets_its_share_with_zero_failures(pod_factory, activator_factory):
    """The reverse step: two activators run with a file naming only them; the third
    starts first (its file names all three), then the other two get the file naming
    all three. Meanwhile load runs through the two; nothing may fail.

    The slot of the one-pod service may move away from an activator that has requests
    queued for it: those must still be served (forwarded to the new owner), not left
    to time out in a queue that no slot will ever reach."""
    pods, solo, services = removal_fleet(pod_factory)
    # First the three together, to learn the division the fleet comes back to.
    acts, peers = start_fleet(activator_factory, ["vm-a", "vm-b", "vm-c"], services)
    expected = slot_table(acts, "api", pods)
    newcomer = owner_of(acts, "solo", solo)  # it comes back owning the one-pod service
    for act in acts.values():
        assert act.stop() == 0

    others = {name: act for name, act in acts.items() if name != newcomer}
    two = {name: addr for name, addr in peers.items() if name != newcomer}
    for name, act in others.items():
        act.rewrite_config(fleet_config(name, two, services))
        act.start(wait_ready=False)
    for act in others.values():
        act.wait_ready()
    assert sum(slots_of(act, "solo", solo.address) for act in others.values()) == 1

    targets = [(act, host) for act in others.values() for host in ("api.test", "solo.test")]
    with Load(targets, threads=6, path="/delay?ms=40") as load:
        load.wait_more(30)
        load.phase = "newcomer starting"
        acts[newcomer].start()  # its file (unchanged) names all three
        load.phase = "others learn of it"
        for name, act in others.items():
            act.rewrite_config(fleet_config(name, peers, services))
        for act in acts.values():
            act.wait_for(lambda st: set(st["activator"]["peers"]) == set(peers), message="peer list applied")
        for act in acts.values():
            wait_handed_over(act)
        load.phase = "all three"
        load.targets = [(act, host) for act in acts.values() for host in ("api.test", "solo.test")]
        load.wait_more(40)

    assert load.failures() == [], f"{len(load.failures())} of {load.count()} failed: {load.failures()[:10]}"
    back = slot_table(acts, "api", pods)
    assert back == expected, "the division is a pure function of the file: the same file, the same division"
    assert sum(back[newcomer].values()) == 2
    assert owner_of(acts, "solo", solo) == newcomer
    # The newcomer took no api request before every activator had the new file, and
    # the others only lost slots: the api pods were never overcommitted.
    for pod in pods:
        assert pod.stats()["peak"] <= 2, f"{pod.address} saw {pod.stats()['peak']} at once"
    for act in acts.values():
        act.wait_idle()


# --------------------------------------------------------------------------------------
# activator check


def write_fleet_file(tmp_path: Path, me: str, peers: Sequence[str], pods: Mapping[str, int]) -> Path:
    import yaml

    ccs = set(pods.values())
    assert len(ccs) == 1
    config = {
        "activators": {
            "self": me,
            "peers": {p: f"10.0.0.{100 + i}:8080" for i, p in enumerate(peers)},
            "secret": FLEET_SECRET,
        },
        "services": {"api": {"hosts": ["api.example.com"], "container_concurrency": ccs.pop(), "pods": list(pods)}},
    }
    path = tmp_path / f"{me}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_check_prints_this_activators_share(tmp_path):
    pods = {"10.0.0.1:80": 1, "10.0.0.2:80": 1, "10.0.0.3:80": 1}
    # The worked example of core/slots.py: a owns the first two pods, b the third.
    out_a = run_cli(["check", "-c", str(write_fleet_file(tmp_path, "a", ["a", "b"], pods))])
    out_b = run_cli(["check", "-c", str(write_fleet_file(tmp_path, "b", ["a", "b"], pods))])
    assert out_a.returncode == 0, out_a.stderr
    assert out_b.returncode == 0, out_b.stderr
    assert "this activator (a) owns:" in out_a.stdout
    assert "api: 2 of 3 slots" in out_a.stdout
    assert "10.0.0.1:80: 1" in out_a.stdout and "10.0.0.2:80: 1" in out_a.stdout
    assert "10.0.0.3:80" not in out_a.stdout.split("owns:")[1]
    assert "this activator (b) owns:" in out_b.stdout
    assert "api: 1 of 3 slots" in out_b.stdout
    assert "10.0.0.3:80: 1" in out_b.stdout.split("owns:")[1]

    # One cc=1 pod and three peers: two of them own nothing.
    shares = []
    for me in ("a", "b", "c"):
        out = run_cli(["check", "-c", str(write_fleet_file(tmp_path, me, ["a", "b", "c"], {"10.0.0.1:80": 1}))])
        assert out.returncode == 0, out.stderr
        assert f"this activator ({me}) owns:" in out.stdout
        shares.append("api: 1 of 1 slots" in out.stdout)
        assert shares[-1] or "api: 0 of 1 slots" in out.stdout, out.stdout
    assert shares == [True, False, False]


def test_an_activator_whose_own_pods_are_all_pending_forwards_instead_of_queueing(pod_factory, activator_factory):
    """No black hole: two activators each own one of two cc=1 pods; the pod one of them
    owns fails its probe. That activator's capacity is 0, so its requests go to the
    peer, whose pod is healthy, instead of waiting out queue_timeout in its own queue."""
    pods = pod_factory(2)
    services = {
        "api": service(
            pods,
            hosts=["api.test"],
            container_concurrency=1,
            probe={"path": "/healthz", "interval": "200ms"},
            queue_timeout="2s",
        )
    }
    acts, _ = start_fleet(activator_factory, ["vm-a", "vm-b"], services)
    for act in acts.values():
        act.wait_for(
            lambda st: all(p["state"] == "healthy" for p in st["services"]["api"]["pods"]), message="both pods healthy"
        )
    owner = {owner_of(acts, "api", pod): pod for pod in pods}
    assert set(owner) == {"vm-a", "vm-b"}, "each activator owns one pod"
    sick = owner["vm-a"]
    sick.set_health(False)
    acts["vm-a"].wait_for(
        lambda st: find_pod(st, "api", sick.address)["state"] == "pending", message="vm-a's pod pending"
    )
    sick.reset()
    healthy = owner["vm-b"]
    healthy.reset()
    results = [request(acts["vm-a"].url("/delay?ms=50"), host="api.test") for _ in range(4)]
    assert [r.status for r in results] == [200] * 4, [(r.status, r.headers.get("x-activator-reason")) for r in results]
    assert sick.stats()["count"] == 0
    assert healthy.stats()["count"] == 4 and healthy.stats()["peak"] == 1

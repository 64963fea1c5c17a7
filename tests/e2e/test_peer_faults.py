"""End to end: a fleet of activators when something goes wrong between them.

Real ``activator run`` processes (or ``$ACTIVATOR_BIN``) on 127.0.0.1 that check each
other over ``POST /.activator/peer`` every 200 ms (``unhealthy_after: 2``), in front of
``tests/backend.py`` pods. What is proven, one test (or two) each:

1. **Cancellation across a peer hop**: a client of the activator that owns no slot of a
   one-pod service hangs up while its request, forwarded to the owner, waits in the
   owner's queue (HTTP/1.1: it closes the connection; HTTP/2: it resets the stream, and
   only that stream may end): the owner's queue empties without the pod being released,
   and the abandoned request never reaches the pod (and, over HTTP/2, the other stream
   on the connection is served).
2. **A peer SIGKILLed under load** (not the owner of the one-pod service, then the
   owner): the survivors mark it ``down`` (``/status`` ``activator.health``, and
   ``activator status``); requests through them for a service another live owner can
   serve keep succeeding. Exactly what may fail: the requests a survivor had forwarded
   to the dead one and that were in flight at the kill; nothing else fails at any time
   (a forward that finds the dead one's port closed marks it down at once and goes to
   another owner). Once ``down``: a service whose only owner is the dead one gets 503
   ``peer-unavailable`` with ``Retry-After``; a service with a live owner left is
   forwarded there. The killed one, restarted with the same file,
   comes back ``up`` and the 503s stop.
3. **A wrong secret**: an activator whose file has another secret is refused by the
   others (and refuses them): each side shows the other ``down``, the two good ones stay
   ``up`` with each other; a raw check without a valid proof gets 403 ``peer-auth`` and
   changes nothing, while the same check properly signed is applied (so the 403s are
   about the proof). A client's ``X-Activator-Forwarded`` header only uses up the hops
   a request may take: at an activator owning no slot, a request claiming both hops is
   queued there (it may not go on) and answered 503 ``queue-timeout``: it never reaches
   the pod, even a free one; at the owner the slot's limit holds; with every owner down
   it is still 503 ``peer-unavailable``; the header never reaches a pod.
4. **StatsD**: ``peer.<name>.up`` gauges are 1 for a live peer and 0 once it is killed
   (and 1 again once it is back).

Which activator owns what depends on the pods' addresses: where a test needs a given
shape (the victim owning a service a survivor forwards to it first), the pod's port is
picked with the division's own pure function (``activator.core.slots``), and the
activators' ``/status`` is checked to agree before anything else. Waits poll; no
assertion is on elapsed time (the figures printed are for the report only).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from harness import (
    LOCALHOST,
    Activator,
    H2Client,
    Pod,
    activator_reason,
    find_pod,
    free_port,
    free_ports,
    request,
    run_cli,
    service_config,
    start_request,
    wait_until,
)

from activator.core.slots import divide_slots, score

pytestmark = pytest.mark.binary

SECRET = "the-fleets-shared-secret"
WRONG_SECRET = "not-the-fleets-secret-at-all"
NAMES = ("vm-a", "vm-b", "vm-c")
API, DUO, SOLO = "api.test", "duo.test", "solo.test"
#: Quick checks: a dead peer is down after two refused checks, 200 ms apart.
CHECKS = {"interval": "200ms", "timeout": "500ms", "unhealthy_after": 2}


# --------------------------------------------------------------------------------------
# the fleet


def peer_config(
    name: str, peers: Mapping[str, str], services: Mapping[str, Any], *, secret: str = SECRET, **top: Any
) -> dict[str, Any]:
    """One activator's file: the same everywhere but ``self`` (and ``listen``)."""
    return {
        "listen": peers[name],
        "access_log": False,
        **top,
        "activators": {"self": name, "peers": dict(peers), "secret": secret, **CHECKS},
        "services": dict(services),
    }


def start_fleet(
    activator_factory: Callable[..., Activator],
    names: Sequence[str],
    services: Mapping[str, Any],
    *,
    secrets: Mapping[str, str] | None = None,
    extra: Mapping[str, Mapping[str, Any]] | None = None,
    later: Sequence[str] = (),
) -> tuple[dict[str, Activator], dict[str, str]]:
    """One activator per name, all launched, then each waited for; ``secrets`` and
    ``extra`` (top-level keys) per name. The ``later`` ones start once the others are
    ready (so that those found nothing listening there at their start)."""
    peers = {name: f"{LOCALHOST}:{port}" for name, port in zip(names, free_ports(len(names)), strict=True)}
    acts = {
        name: activator_factory(
            peer_config(name, peers, services, secret=(secrets or {}).get(name, SECRET), **(extra or {}).get(name, {})),
            start=False,
        )
        for name in names
    }
    for group in ([n for n in names if n not in later], list(later)):
        for name in group:
            acts[name].start(wait_ready=False)
        for name in group:
            acts[name].wait_ready()
    # A peer checked before it listened is down (its port refused) until its next answer.
    secret_of = {name: (secrets or {}).get(name, SECRET) for name in names}
    for name, act in acts.items():
        for peer in names:
            if peer != name and secret_of[peer] == secret_of[name]:
                wait_peer(act, peer, "up", f"{name} to see {peer} up")
    return acts, peers


def service(pods: Sequence[Pod], host: str, cc: int, **options: Any) -> dict[str, Any]:
    return service_config(
        pods, hosts=[host], container_concurrency=cc, **{"queue_depth": 500, "queue_timeout": "30s", **options}
    )


def slots_of(act: Activator, service_name: str, address: str) -> int:
    pod = find_pod(act.status(), service_name, address)
    assert pod is not None and pod["slots"] is not None, (service_name, address, pod)
    return int(pod["slots"])


def owner_of(acts: Mapping[str, Activator], service_name: str, pod: Pod) -> str:
    owners = [name for name, act in acts.items() if slots_of(act, service_name, pod.address)]
    assert len(owners) == 1, f"{pod.address} of {service_name} owned by {owners}"
    return owners[0]


def peer_health(status: Mapping[str, Any], peer: str) -> dict[str, Any]:
    result: dict[str, Any] = status["activator"]["health"][peer]
    return result


def wait_peer(act: Activator, peer: str, state: str, message: str = "") -> dict[str, Any]:
    """Wait until ``act``'s ``/status`` shows ``peer`` in ``state``; that status."""
    return act.wait_for(
        lambda st: peer_health(st, peer)["state"] == state,
        message=message or f"{act.listen} to see {peer} {state}",
    )


def peers_line(act: Activator) -> str:
    """The ``peers: ...`` line of ``activator status``."""
    result = run_cli(["status", "--admin", str(act.admin)])
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("peers: ")]
    assert len(lines) == 1, result.stdout
    return lines[0]


def shown_as(act: Activator, peer: str, address: str) -> str | None:
    """How ``activator status`` of ``act`` shows ``peer``: up, down, unknown (None: not listed)."""
    match = re.search(rf"\b{re.escape(peer)}={re.escape(address)} (\w+)", peers_line(act))
    return match.group(1) if match else None


# --------------------------------------------------------------------------------------
# choosing pods by what the fleet will make of them


def prefers(me: str, first: str, second: str) -> bool:
    """Whether ``me`` forwards to ``first`` before ``second`` when both own slots and are
    up (``core.fleet``: the owners in order of ``score(owner, me)``, highest first)."""
    return score(first, me) > score(second, me)


def owners_of_port(port: int, cc: int) -> set[str]:
    """The activators of ``NAMES`` owning slots of a pod of ``cc`` at ``127.0.0.1:port``."""
    address = f"{LOCALHOST}:{port}"
    return {name for name, owned in divide_slots({address: cc}, sorted(NAMES)).items() if owned.get(address)}


def pick_port(cc: int, want: Callable[[set[str]], bool]) -> int:
    """A free port where a pod of ``cc`` would be owned by a set of activators ``want`` accepts."""
    for _ in range(2000):
        port = free_port()
        if want(owners_of_port(port, cc)):
            return port
    raise AssertionError("no port gives the wanted owners")


@pytest.fixture
def fixed_pods() -> Iterator[Callable[[int], Pod]]:
    """``fixed_pods(port) -> Pod`` on that port, killed at teardown."""
    made: list[Pod] = []

    def make(port: int) -> Pod:
        pod = Pod(port=port)
        made.append(pod)
        return pod

    yield make
    for pod in made:
        pod.close()


# --------------------------------------------------------------------------------------
# held requests (the pod holds ``/hold?key=K`` until ``pod.release(K)``)


def send_hold(
    act: Activator, key: str, host: str, headers: Mapping[str, str] | None = None
) -> http.client.HTTPConnection:
    """``GET /hold?key=K`` with ``X-Request-Id: K`` on its own connection; read it with :func:`answer`."""
    return start_request(
        act.listen, path=f"/hold?key={key}", host=host, headers={"X-Request-Id": key, **(headers or {})}, timeout=60
    )


def answer(conn: http.client.HTTPConnection) -> tuple[int, str | None, str]:
    """(status, X-Activator-Reason, body); closes the connection."""
    try:
        resp = conn.getresponse()
        body = resp.read().decode("utf-8", "replace")
        return resp.status, activator_reason(resp), body
    finally:
        conn.close()


def wait_held(pod: Pod, keys: list[str], message: str) -> None:
    last: list[list[str]] = [[]]

    def check() -> bool:
        last[0] = pod.held()
        return last[0] == sorted(keys)

    wait_until(check, message=lambda: f"{message}: want {sorted(keys)}, pod holds {last[0]}")


def queued(act: Activator, service_name: str, n: int, message: str, timeout: float = 30.0) -> None:
    act.wait_for(lambda st: st["services"][service_name]["queued"] == n, timeout=timeout, message=message)


# --------------------------------------------------------------------------------------
# 1. cancellation across a peer hop


#: The bug both tests below show (see the report): the forwarder's hang-up callback raises.
def hop_fleet(pod_factory, activator_factory) -> tuple[Pod, Activator, Activator]:
    """Two activators, one cc=1 pod: (the pod, its owner, the other, which forwards to it)."""
    (pod,) = pod_factory(1)
    # queue_timeout 60 s: within the waits below only a hang-up can empty a queue.
    services = {"solo": service([pod], SOLO, 1, queue_timeout="60s")}
    acts, peers = start_fleet(activator_factory, NAMES[:2], services)
    owner_name = owner_of(acts, "solo", pod)
    (forwarder,) = [act for name, act in acts.items() if name != owner_name]
    assert forwarder.status()["services"]["solo"]["forward_to"] == f"peer {peers[owner_name]}"
    return pod, acts[owner_name], forwarder


def test_a_client_gone_while_forwarded_and_queued_at_the_owner_leaves_the_owners_queue(pod_factory, activator_factory):
    pod, owner, forwarder = hop_fleet(pod_factory, activator_factory)
    busy = send_hold(owner, "busy", SOLO)
    wait_held(pod, ["busy"], "the pod busy with the owner's own request")
    gone = send_hold(forwarder, "gone", SOLO)
    queued(owner, "solo", 1, "the forwarded request queued at the owner")
    assert forwarder.status()["services"]["solo"]["queued"] == 0, "the forwarder does not queue it itself"

    gone.close()  # the client of the forwarder hangs up while its request waits at the owner
    queued(owner, "solo", 0, "the abandoned request out of the owner's queue", timeout=15)
    assert pod.held() == ["busy"], "the queue emptied by the hang-up, not by the pod"

    pod.release("busy")
    assert answer(busy)[0] == 200
    owner.wait_for(lambda st: st["services"]["solo"]["in_flight"] == 0, message="the slot free again")
    # Had the abandoned request stayed in the queue, it would have had the slot first.
    later = send_hold(forwarder, "later", SOLO)
    wait_held(pod, ["later"], "a later request through the forwarder gets the slot")
    pod.release("later")
    assert answer(later)[:2] == (200, None)
    stats = pod.stats()
    assert stats["request_ids"] == ["busy", "later"], "the abandoned request reached the pod"
    assert stats["peak"] == 1
    assert "Traceback" not in forwarder.stderr_text(), forwarder.stderr_text()[-3000:]
    for act in (owner, forwarder):
        act.wait_idle()


def test_an_http2_stream_reset_while_forwarded_cancels_that_stream_only(pod_factory, activator_factory):
    pod, owner, forwarder = hop_fleet(pod_factory, activator_factory)
    busy = send_hold(owner, "busy", SOLO)
    wait_held(pod, ["busy"], "the pod busy with the owner's own request")
    with H2Client(forwarder.listen, timeout=60, host=SOLO) as client:
        gone = client.send("GET", "/hold?key=gone", [("x-request-id", "gone")])
        queued(owner, "solo", 1, "the first forwarded stream queued at the owner")
        stays = client.send("GET", "/hold?key=stays", [("x-request-id", "stays")])
        queued(owner, "solo", 2, "the second forwarded stream queued behind it")

        client.reset(gone)  # the client gives up on one stream of the connection
        queued(owner, "solo", 1, "the reset stream out of the owner's queue", timeout=15)
        assert pod.held() == ["busy"]
        client.ping()  # the connection is still there

        pod.release("busy")
        assert answer(busy)[0] == 200
        wait_held(pod, ["stays"], "the other stream, still queued, gets the slot")
        pod.release("stays")
        resp = client.response(stays)
        assert (resp.status, resp.reset, client.terminated) == (200, None, None), resp
    stats = pod.stats()
    assert stats["request_ids"] == ["busy", "stays"], "the reset stream reached the pod"
    assert stats["peak"] == 1
    assert "Traceback" not in forwarder.stderr_text(), forwarder.stderr_text()[-3000:]
    for act in (owner, forwarder):
        act.wait_idle()


# --------------------------------------------------------------------------------------
# 2. a peer SIGKILLed under load


@dataclass(frozen=True)
class Outcome:
    via: str  # the activator's name
    host: str
    phase: str  # the test's phase when the request was sent
    ended: str  # ... and when its answer was read
    status: int | None  # None: no HTTP answer (error)
    reason: str | None
    retry_after: str | None
    error: str | None = None


class Load:
    """Client threads sending requests in a loop until stopped, each outcome kept with
    the phase in which it was *sent* (``phase``, moved along by the test)."""

    def __init__(self, targets: Sequence[tuple[str, Activator, str]], threads: int, path: str) -> None:
        self.targets = list(targets)
        self.path = path
        self.phase = "before"
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, i: int) -> None:
        k = i
        while not self._stop.is_set():
            name, act, host = self.targets[k % len(self.targets)]
            k += 1
            phase = self.phase
            try:
                resp = request(act.listen, path=self.path, host=host, timeout=60)
                outcome = Outcome(
                    name, host, phase, self.phase, resp.status, activator_reason(resp), resp.headers.get("Retry-After")
                )
            except Exception as exc:  # kept as a failure
                outcome = Outcome(name, host, phase, self.phase, None, None, None, repr(exc))
            with self._lock:
                self.outcomes.append(outcome)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)

    def count(self, phase: str | None = None) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if phase is None or o.phase == phase)

    def wait_more(self, n: int, phase: str | None = None) -> None:
        """Wait until ``n`` more requests (sent in ``phase``, default: the current one) finished."""
        phase = phase or self.phase
        goal = self.count(phase) + n
        wait_until(lambda: self.count(phase) >= goal, timeout=60, message=f"{n} more requests sent in {phase} done")

    def of(self, phase: str) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.phase == phase]


def fault_fleet_pods(role: str, pod_factory, fixed_pods) -> tuple[list[Pod], Pod, Pod, str, str, str]:
    """The pods and the roles of a kill: (api pods, duo pod, solo pod, victim, t, x).

    ``api``: 3 pods of cc 2, 2 slots each activator's. ``solo``: one pod of cc 1, owned
    by the victim (``role == "owner"``) or not. ``duo``: one pod of cc 2, owned by the
    victim and ``x``; ``t`` owns none of it and forwards it to the victim first: the kill
    takes away its forward target while another live owner, ``x``, is left.
    """
    # The victims some activator forwards to first, of the two others.
    first_choice = {
        v for t in NAMES for v in NAMES if v != t and all(prefers(t, v, x) for x in NAMES if x not in (t, v))
    }
    if role == "owner":
        solo_port = pick_port(1, lambda owners: bool(owners & first_choice))
    else:
        solo_port = pick_port(1, lambda owners: bool(first_choice - owners))
    solo = fixed_pods(solo_port)  # (each pod bound before the next port is picked)
    (solo_owner,) = owners_of_port(solo_port, 1)
    victim = solo_owner if role == "owner" else min(first_choice - {solo_owner})
    t = next(n for n in NAMES if n != victim and all(prefers(n, victim, x) for x in NAMES if x not in (n, victim)))
    (x,) = [n for n in NAMES if n not in (victim, t)]
    duo = fixed_pods(pick_port(2, lambda owners: owners == {victim, x}))
    return pod_factory(3), duo, solo, victim, t, x


HOST_SERVICE = {API: "api", DUO: "duo", SOLO: "solo"}


def check_outcomes(load: Load, to_victim: set[tuple[str, str]]) -> list[Outcome]:
    """Every outcome against the rules of the kill test; the ones that failed in the window.

    A request is *failable* when its survivor forwarded its service to the victim before
    the kill (``to_victim``). Not failable: 200, always. Failable: 200 if answered before
    the kill; anything while in flight at the kill, or sent while the kill was under way
    (the kernel completes a connect until the process is gone; these are returned); sent
    after the victim is gone (before or after the survivors saw it down: a forward that
    finds its port closed marks it down at once and goes elsewhere), 200 if another owner
    is left (duo), else 503 peer-unavailable with Retry-After (solo); sent while it
    restarts, the same but solo may be 200 too; once it is back up, 200.
    """
    window: list[Outcome] = []
    wrong: list[tuple[str, Outcome]] = []
    for o in load.outcomes:
        service_name = HOST_SERVICE[o.host]
        if (o.via, service_name) not in to_victim or o.ended == "before" or o.phase == "back":
            if o.status != 200:
                wrong.append(("must be served", o))
        elif o.phase in ("before", "killing"):  # in flight at the kill: lost with the victim
            if o.status != 200:
                window.append(o)
        elif o.phase == "window" and service_name == "solo":
            # Sent after the kill: the forward finds the port closed, so the victim is
            # down at once and the only owner is gone (or it was answered before the kill).
            if o.status != 200 and (o.status, o.reason) != (503, "peer-unavailable"):
                wrong.append(("sent after the kill: served or peer-unavailable", o))
        elif service_name == "duo":
            if o.status != 200:
                wrong.append(("another owner is live", o))
        else:
            refused = (o.status, o.reason) == (503, "peer-unavailable") and (o.retry_after or "").isdigit()
            if not (refused or (o.phase == "restarting" and o.status == 200)):
                wrong.append(("the only owner is down", o))
    assert wrong == [], f"{len(wrong)} of {len(load.outcomes)} wrong: {wrong[:10]}"
    return window


def failable_sent(load: Load, to_victim: set[tuple[str, str]], phase: str, service_name: str) -> int:
    return sum(
        1 for o in load.of(phase) if (o.via, HOST_SERVICE[o.host]) in to_victim and HOST_SERVICE[o.host] == service_name
    )


def check_down(acts: Mapping[str, Activator], peers: Mapping[str, str], victim: str, t: str, x: str, role: str) -> None:
    """What the survivors show and do once both marked the victim down."""
    survivors = {name: act for name, act in acts.items() if name != victim}
    for name, act in survivors.items():
        assert shown_as(act, victim, peers[victim]) == "down", peers_line(act)
        (live,) = set(survivors) - {name}
        assert peer_health(act.status(), live)["state"] == "up", "the live peers stay up"
    assert acts[t].status()["services"]["duo"]["forward_to"] == f"peer {peers[x]}", "t forwards duo to x now"
    if role == "owner":
        for name, act in survivors.items():
            resp = request(act.listen, path="/delay?ms=1", host=SOLO)
            assert (resp.status, activator_reason(resp)) == (503, "peer-unavailable"), (name, resp.status)
            assert resp.headers.get("Retry-After", "").isdigit(), resp.headers
            assert act.status()["services"]["solo"]["forward_to"] is None


@pytest.mark.parametrize("role", ["not-solo-owner", "owner"])
def test_a_peer_killed_under_load(role, pod_factory, fixed_pods, activator_factory, capsys):
    api, duo, solo, victim_name, t, x = fault_fleet_pods(role, pod_factory, fixed_pods)
    services = {"api": service(api, API, 2), "duo": service([duo], DUO, 2), "solo": service([solo], SOLO, 1)}
    acts, peers = start_fleet(activator_factory, NAMES, services)
    victim, victim_address = acts[victim_name], peers[victim_name]
    survivors = {name: act for name, act in acts.items() if name != victim_name}
    for name, act in acts.items():
        for peer in NAMES:
            if peer != name:
                wait_peer(act, peer, "up")

    # The fleet divided as computed: 2 api slots each, duo owned by the victim and x
    # (t forwards it to the victim), solo by the victim or not.
    for name, act in acts.items():
        assert sum(slots_of(act, "api", p.address) for p in api) == 2, name
    assert {n for n, a in acts.items() if slots_of(a, "duo", duo.address)} == {victim_name, x}
    assert (owner_of(acts, "solo", solo) == victim_name) == (role == "owner")
    # Who forwards what to the victim: only those requests may fail before it is down.
    to_victim = {
        (name, svc)
        for name, act in survivors.items()
        for svc, entry in act.status()["services"].items()
        if entry["forward_to"] == f"peer {victim_address}"
    }
    expected = {(t, "duo")} | ({(n, "solo") for n in survivors} if role == "owner" else set())
    assert to_victim == expected, (to_victim, expected)
    for act in survivors.values():
        assert shown_as(act, victim_name, victim_address) == "up"

    targets = [(name, act, host) for name, act in survivors.items() for host in (API, DUO, SOLO)]
    with Load(targets, threads=6, path="/delay?ms=30") as load:
        load.wait_more(60)

        load.phase = "killing"  # until the victim is reaped: its port may still take a connect
        killed_at = time.monotonic()
        victim.kill()
        load.phase = "window"  # from its exit until both survivors see it down
        to_down = {}
        for name, act in survivors.items():
            health = peer_health(wait_peer(act, victim_name, "down", f"{name} to mark {victim_name} down"), victim_name)
            to_down[name] = time.monotonic() - killed_at - health["seconds_in_state"]
            assert health["failures"] >= 1 and health["last_error"], health
        load.phase = "down"
        check_down(acts, peers, victim_name, t, x, role)
        load.wait_more(60)

        load.phase = "restarting"  # the same file again, until both survivors see it up
        restarted_at = time.monotonic()
        victim.start()
        to_up = {}
        for name, act in survivors.items():
            wait_peer(act, victim_name, "up", f"{name} to see the restarted {victim_name} up")
            to_up[name] = time.monotonic() - restarted_at
        load.phase = "back"
        for act in survivors.values():
            assert shown_as(act, victim_name, victim_address) == "up", peers_line(act)
        assert acts[t].status()["services"]["duo"]["forward_to"] == f"peer {victim_address}"
        for peer in survivors:
            wait_peer(victim, peer, "up", f"the restarted {victim_name} to see {peer} up")
        load.wait_more(60)

    window = check_outcomes(load, to_victim)
    assert failable_sent(load, to_victim, "down", "duo") > 0, "duo through t was not tried while the victim was down"
    if role == "owner":
        assert failable_sent(load, to_victim, "down", "solo") > 0
        assert failable_sent(load, to_victim, "back", "solo") > 0
    for pod, cc in [*((p, 2) for p in api), (duo, 2), (solo, 1)]:
        assert pod.stats()["peak"] <= cc, f"{pod.address} saw {pod.stats()['peak']} at once"
    for act in acts.values():
        act.wait_idle()

    kinds: dict[str, int] = {}
    for o in window:
        key = f"{o.via}/{HOST_SERVICE[o.host]} {o.phase}: {o.status} {o.reason or o.error}"
        kinds[key] = kinds.get(key, 0) + 1
    with capsys.disabled():
        print(
            f"\n[figures {role}] victim {victim_name}, t {t}, x {x}: kill->down "
            + ", ".join(f"{n} {s:.3f}s" for n, s in to_down.items())
            + "; restart->up seen "
            + ", ".join(f"{n} {s:.3f}s" for n, s in to_up.items())
            + f"; in flight at the kill and failed: {len(window)} {kinds}"
            + f"; sent in window {len(load.of('window'))}, down {len(load.of('down'))}, total {len(load.outcomes)}"
        )


# --------------------------------------------------------------------------------------
# 3. a wrong secret; forged checks and forged hop markers


def sign(secret: str, sender: str, body: bytes, stamp: int | None = None) -> str:
    """An ``Activator-Peer`` value, as ``core.peering`` makes it (HMAC-SHA256 of name,
    time and body)."""
    stamp = int(time.time()) if stamp is None else stamp
    mac = hmac.new(secret.encode(), b"%s\n%d\n" % (sender.encode(), stamp) + body, hashlib.sha256).hexdigest()
    return f"{sender} {stamp} {mac}"


def check_body(sender: str, view: Mapping[str, Mapping[str, int]]) -> bytes:
    return json.dumps({"sender": sender, "scope": "activator", "view": view}).encode()


def post_check(act: Activator, body: bytes, proof: str | None, method: str = "POST") -> Any:
    headers = {"Content-Type": "application/json"}
    if proof is not None:
        headers["Activator-Peer"] = proof
    return request(act.listen, method, "/.activator/peer", headers=headers, body=body, host=act.listen)


def test_an_activator_with_another_secret_is_refused_and_forged_checks_change_nothing(pod_factory, activator_factory):
    pods = pod_factory(3)
    services = {"api": service(pods, API, 1)}
    # vm-c starts last: the others found nothing listening there when they started, so
    # they use their shares at once (a peer that answers, even with a 403, is waited for).
    acts, peers = start_fleet(activator_factory, NAMES, services, secrets={"vm-c": WRONG_SECRET}, later=["vm-c"])
    a, b, c = (acts[n] for n in NAMES)

    # The two with the fleet's secret are up with each other, the odd one down, both ways.
    wait_peer(a, "vm-b", "up")
    wait_peer(b, "vm-a", "up")
    for act, peer in [(a, "vm-c"), (b, "vm-c"), (c, "vm-a"), (c, "vm-b")]:
        act.wait_for(
            lambda st, peer=peer: (
                peer_health(st, peer)["state"] == "down" and peer_health(st, peer)["last_error"] == "status 403"
            ),
            message=f"{act.listen} to see {peer} down, its checks refused with a 403",
        )
    for act in (a, b, c):
        wait_until(
            lambda act=act: "refused a peer check" in act.stderr_text(), message=f"{act.listen} to log a refused check"
        )
    assert "another secret" in a.stderr_text()
    assert shown_as(a, "vm-c", peers["vm-c"]) == "down"
    assert shown_as(a, "vm-b", peers["vm-b"]) == "up"

    # Forged checks in the name of vm-c, whose real checks are always refused (so a view
    # from vm-c, had one been applied, would stay): a view capping every pod of a's at 0.
    capping = check_body("vm-c", {"api": {p.address: 0 for p in pods}})
    before = a.status()["services"]["api"]
    assert before["capacity"] >= 1 and before["capped_by"] == []
    stale = int(time.time()) - 3600
    forged = {
        "no proof": None,
        "garbage": "vm-c hello",
        "another secret": sign(WRONG_SECRET, "vm-c", capping),
        "a proof of another body": sign(SECRET, "vm-c", b"{}"),
        "a proof by another sender": sign(SECRET, "vm-b", capping),
        "an hour old": sign(SECRET, "vm-c", capping, stamp=stale),
    }
    for what, proof in forged.items():
        resp = post_check(a, capping, proof)
        assert (resp.status, activator_reason(resp)) == (403, "peer-auth"), (what, resp.status, resp.text)
        assert "Activator-Peer" not in resp.headers, what
    resp = post_check(a, b"", None, method="GET")
    assert (resp.status, activator_reason(resp)) == (403, "peer-auth")
    after = a.status()["services"]["api"]
    assert (after["capacity"], after["capped_by"]) == (before["capacity"], []), after
    assert request(a.listen, path="/delay?ms=1", host=API).status == 200
    assert sum(p.stats()["count"] for p in pods) == 1, "no check went to a pod"

    # The same capping check, properly signed, is applied at once: the 403s above were
    # about the proof alone.
    resp = post_check(a, capping, sign(SECRET, "vm-c", capping))
    assert resp.status == 200, resp.text
    assert resp.headers["Activator-Peer"].startswith("vm-a ")
    assert resp.json()["name"] == "vm-a"
    capped = a.status()["services"]["api"]
    assert capped["capped_by"] == ["vm-c"] and capped["capacity"] == 0, capped


def test_a_clients_forwarded_marker_only_uses_up_its_hops(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    # queue_timeout 5 s: a request stranded where no slot comes would be answered 503.
    services = {"solo": service([pod], SOLO, 1, queue_timeout="5s")}
    acts, _ = start_fleet(activator_factory, NAMES[:2], services)
    owner_name = owner_of(acts, "solo", pod)
    owner = acts[owner_name]
    (other,) = [act for name, act in acts.items() if name != owner_name]
    assert other.status()["services"]["solo"]["capacity"] == 0
    both_hops = {"X-Activator-Forwarded": f"peer {owner_name}, peer vm-x"}

    # The worst case: at the activator owning no slot, a request claiming its hops are
    # used up is not forwarded at once; it waits there until the redirect that says the
    # slots are elsewhere (the writer's tick), then takes one hop more, to the owner, and
    # runs on the owner's slot: neither stranded nor past the limit.
    marked = send_hold(other, "marked", SOLO, both_hops)
    wait_held(pod, ["marked"], "the marked request on the owner's slot")
    pod.release("marked")
    assert answer(marked)[0] == 200
    shown = find_pod(owner.status(), "solo", pod.address)
    assert shown is not None and shown["requests"] == 1, shown
    other.wait_idle()

    # At the owner the marker changes nothing: the slot's limit holds.
    busy = send_hold(owner, "busy", SOLO)
    wait_held(pod, ["busy"], "the owner's slot in use")
    second = send_hold(owner, "second", SOLO, both_hops)
    queued(owner, "solo", 1, "the marked request queued behind the busy one")
    assert pod.held() == ["busy"]
    pod.release("busy")
    assert answer(busy)[0] == 200
    wait_held(pod, ["second"], "the marked request served after the busy one")
    pod.release("second")
    assert answer(second)[0] == 200

    # One hop claimed: one is left, the slotless activator forwards it to the owner. The
    # marker is the activators' own: no pod sees it, the client's nor the one added.
    for act in (other, owner):
        resp = request(act.listen, path="/echo", host=SOLO, headers={"X-Activator-Forwarded": "peer vm-x"})
        assert resp.status == 200, (act.listen, resp.status, activator_reason(resp))
        assert "x-activator-forwarded" not in resp.json()["headers"], resp.json()["headers"]
    stats = pod.stats()
    assert stats["request_ids"] == ["marked", "busy", "second"] and stats["peak"] == 1, stats
    for act in acts.values():
        act.wait_idle()

    # Nor does a marker skip the answer for a service whose only owner is down.
    owner.kill()
    wait_peer(other, owner_name, "down")
    resp = request(other.listen, path="/delay?ms=1", host=SOLO, headers=both_hops)
    assert (resp.status, activator_reason(resp)) == (503, "peer-unavailable"), (resp.status, resp.text)
    assert resp.headers.get("Retry-After", "").isdigit()
    assert other.status()["services"]["solo"]["queued"] == 0
    assert pod.stats()["count"] == 5


# --------------------------------------------------------------------------------------
# 4. StatsD


def test_statsd_peer_up_gauges(pod_factory, activator_factory, statsd_receiver):
    (pod,) = pod_factory(1)
    rx = statsd_receiver
    statsd = {"address": rx.address, "prefix": "t", "tags": False}
    acts, _ = start_fleet(
        activator_factory, NAMES, {"solo": service([pod], SOLO, 1)}, extra={"vm-a": {"statsd": statsd}}
    )
    up_b, up_c = "t.peer.vm-b.up", "t.peer.vm-c.up"
    rx.wait_for(lambda _: rx.gauge(up_b) == 1 and rx.gauge(up_c) == 1)
    assert "t.peer.vm-a.up" not in rx.names(), "no gauge of itself"

    acts["vm-c"].kill()
    wait_peer(acts["vm-a"], "vm-c", "down")
    rx.wait_for(lambda _: rx.gauge(up_c) == 0)
    # From then on (datagrams of one socket arrive in order): 0 for vm-c, 1 for vm-b.
    rx.clear()
    rx.wait_for(lambda _: len(rx.values(up_c, "g")) >= 2 and len(rx.values(up_b, "g")) >= 2)
    assert set(rx.values(up_c, "g")) == {0}, rx.values(up_c)
    assert set(rx.values(up_b, "g")) == {1}, rx.values(up_b)

    acts["vm-c"].start()
    wait_peer(acts["vm-a"], "vm-c", "up")
    rx.wait_for(lambda _: rx.gauge(up_c) == 1)
    rx.clear()
    rx.wait_for(lambda _: len(rx.values(up_c, "g")) >= 2)
    assert set(rx.values(up_c, "g")) == {1}, rx.values(up_c)

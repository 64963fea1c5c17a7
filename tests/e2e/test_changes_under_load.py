"""End to end: peer, pod and cc changes while load runs through every activator.

The claim: **no pod ever runs more requests at once than its cc, and no request fails**,
through every kind of change an operator makes to the file while requests run:

- a fleet of 2 and of 3 activators (one worker each): a peer added, a peer removed (in
  the README's order), a pod added, a pod drained then taken out of the file, a pod
  taken out of the file outright, cc raised, cc lowered; each its own test case;
- one activator with ``workers: 2``: the same pod and cc changes;
- a soak: 20 successive changes of every kind on a fleet of 2 (3 at times).

Two services: ``one`` (cc 1, 3 pods) and ``two`` (cc 2, 2 pods), pods taking 40 ms per
request (``/delay?ms=40``), load from more client threads than there are slots, spread
over every activator the L4 balancer would send to and over both services, so that
queues form everywhere and every slot is contended when a change lands.

A change is rolled like an operator does: every activator's file is rewritten, then each
is sent SIGHUP (``systemctl reload`` everywhere); then the test waits until each one's
``/status`` (with workers, each worker's own) shows the new file applied (peers, each of
them seen up, cc, pods listed and drained), then until no slot is held for a hand-over
(``handover_slots`` 0) and no peer's view caps anyone (``capped_by`` empty), then checks
that every pod's slots add up to its cc over the activators. Peers are added and removed
in the README's order ("Adding a VM", "Removing a VM"). Nothing is asserted on elapsed
time.

A hand-over that does not complete although every holder it waits on runs no more on
the pod than its new share (so a check would release it) is recorded as stalled
(:class:`HandOverStalled`) once that has lasted ``STALLED_AFTER`` seconds, several check
intervals; the case goes on under load (the soak still waits for every other hand-over,
a one-change case for none), its peaks and failures are checked as usual, and only then
does it fail with the stall's evidence.

Peaks: each pod records the most requests it ran at once (``/_stats`` ``peak``). The
limit a pod is held to is the smallest cc it had while requests ran, per phase: before a
change of cc, the peak so far is checked against the old cc; a raised cc holds from then
on. A lowered cc lets the requests already running finish (README, "Live reload": a
lowered limit admits nothing until enough requests end), so the transition may still
show the old cc; once the file is applied everywhere and the pod runs no more than the
new cc, its stats are reset (the peak restarts from what is in flight) and from then on
the new cc holds.

The number of requests of each case is printed (``-s``) and listed in the terminal
summary. A failed request is shown with the phase it was sent in and the one it ended
in, and the first few failures with every activator's /status at that moment.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
from harness import (
    LOCALHOST,
    Activator,
    HarnessError,
    Pod,
    find_pod,
    free_port,
    free_ports,
    json_request,
    service_config,
    start_pods,
    wait_until,
)
from test_peers import Load, fleet_config

from activator.core.slots import divide_slots

pytestmark = [pytest.mark.binary, pytest.mark.slow]

#: The services of every file: name -> (Host header, cc at start, pods at start).
SERVICES = {"one": ("one.test", 1, 3), "two": ("two.test", 2, 2)}
PATH = "/delay?ms=40"
NAMES = ("vm-a", "vm-b", "vm-c", "vm-d")
#: ``queue_timeout``: a request stranded in a queue shows up as a 503 within the test.
service = partial(service_config, queue_depth=500, queue_timeout="20s")
#: A hand-over still held this long after every holder it waits on ran no more on the pod
#: than its new share is stalled (checks go every ``activators.interval``, 1 s).
STALLED_AFTER = 3.0


class ChangeLoad(Load):
    """test_peers' load (client threads through every target, each outcome kept), with
    the activators' /status snapshot at the first few failures (``snapshot``, set by the
    rig)."""

    def __init__(self, targets: Sequence[tuple[Activator, str]], threads: int, path: str) -> None:
        super().__init__(targets, threads, path)
        self.snapshot: Callable[[], str] = lambda: ""
        self.snapshots: list[str] = []

    def failed(self, act: Activator, host: str, outcome: Any) -> None:
        if len(self.snapshots) < 3:
            with contextlib.suppress(Exception):
                self.snapshots.append(f"at {act.listen} {host} {outcome}:\n{self.snapshot()}")


#: case id -> requests sent during it (printed at the end of the module's run).
REQUESTS: dict[str, int] = {}


class HandOverStalled(AssertionError):
    """A moved slot stayed held although its old holders no longer ran a request on it."""


class PodPool:
    """Pods shared by the module's cases (started as needed, killed at its end): each case
    takes them in order, each idle and reset when taken."""

    def __init__(self) -> None:
        self.pods: list[Pod] = []

    def take(self, i: int) -> Pod:
        while len(self.pods) <= i:
            self.pods.extend(start_pods(6 if not self.pods else 2))
        pod = self.pods[i]
        wait_until(lambda: pod.stats()["in_flight"] == 0, message=f"{pod.address} idle")
        pod.reset()
        return pod

    def close(self) -> None:
        for pod in self.pods:
            pod.close()


@pytest.fixture(scope="module")
def pod_pool() -> Iterator[PodPool]:
    pool = PodPool()
    yield pool
    pool.close()


class _RequestCounts:
    """A plugin printing :data:`REQUESTS` in the terminal summary (after the captures)."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not REQUESTS:
            return
        terminalreporter.write_sep("-", f"requests per case ({__name__})")
        for case, n in REQUESTS.items():
            terminalreporter.write_line(f"  {case:<40} {n:>6}")
        terminalreporter.write_line(f"  {'total':<40} {sum(REQUESTS.values()):>6}")


@pytest.fixture(scope="module", autouse=True)
def _print_request_counts(request: pytest.FixtureRequest) -> None:
    name = f"{__name__}-requests"
    if not request.config.pluginmanager.has_plugin(name):
        request.config.pluginmanager.register(_RequestCounts(), name)


# --------------------------------------------------------------------------------------
# workers' own admin APIs (``workers: 2``: the supervisor's /status merges them)


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    below: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - below
        below |= frontier
    return sorted(below)


def _worker_admin_fd(pid: int) -> int | None:
    """The admin socket's descriptor in a worker's ``ACTIVATOR_WORKER`` spec."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"ACTIVATOR_WORKER="):
            return int(json.loads(item.partition(b"=")[2])["admin"])
    return None


def _listening_ports() -> dict[str, int]:
    """Socket inode -> local port, for every listening TCP socket."""
    ports = {}
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                ports[fields[9]] = int(fields[1].rpartition(":")[2], 16)
    return ports


def worker_admins(act: Activator, n: int) -> list[str]:
    """The admin address of each of the ``n`` workers under ``act`` (from /proc: the admin
    descriptor of its spec, that socket's inode, the port listening on it)."""

    def find() -> list[str] | None:
        ports = _listening_ports()
        found = set()
        for pid in _descendants(act.pid):
            fd = _worker_admin_fd(pid)
            if fd is None:
                continue
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            m = re.fullmatch(r"socket:\[(\d+)\]", link)
            if m and m[1] in ports:
                found.add(f"{LOCALHOST}:{ports[m[1]]}")
        return sorted(found) if len(found) == n else None

    return wait_until(find, message=f"the admin ports of {n} workers")


# --------------------------------------------------------------------------------------
# the activators under test and what their files say


@dataclass
class Entry:
    pod: Pod
    drain: bool = False


@dataclass
class Svc:
    host: str
    cc: int
    entries: list[Entry]

    def listed(self) -> dict[str, Entry]:
        return {e.pod.address: e for e in self.entries}


@dataclass
class Rig:
    """Activators (a fleet, or one with workers), the pods, what the files say, the load,
    the peak each pod is held to, and the hand-overs found stalled."""

    factory: Callable[..., Activator]
    pool: PodPool
    addresses: dict[str, str] = field(default_factory=dict)  # each peer's proxy address
    workers: int = 1
    peers: list[str] = field(default_factory=list)  # in the file, in order
    services: dict[str, Svc] = field(default_factory=dict)
    acts: dict[str, Activator] = field(default_factory=dict)  # every one ever started
    pods: list[Pod] = field(default_factory=list)  # every pod ever listed
    allowed: dict[str, int] = field(default_factory=dict)  # pod address -> its peak limit
    admins: list[str] = field(default_factory=list)  # the workers' admin addresses
    #: In a fleet, the activators that run several workers (name -> workers) and, once
    #: started, their workers' admin addresses.
    fleet_workers: dict[str, int] = field(default_factory=dict)
    fleet_admins: dict[str, list[str]] = field(default_factory=dict)
    spares: list[Pod] = field(default_factory=list)  # pods started, not listed yet
    taken: int = 0  # pods taken from the pool
    soak: bool = False  # after a stall, wait for the other hand-overs still
    load: ChangeLoad | None = None
    changes: int = 0
    stalls: list[str] = field(default_factory=list)  # evidence of hand-overs that stalled
    stuck: set[tuple[str, str, str]] = field(default_factory=set)  # (process, service, pod) stalled

    # -- files ------------------------------------------------------------------------

    @property
    def fleet(self) -> bool:
        return self.workers == 1

    def config(self, name: str) -> dict[str, Any]:
        services = {
            svc_name: service(
                [{"address": e.pod.address, "drain": True} if e.drain else e.pod.address for e in svc.entries],
                hosts=[svc.host],
                container_concurrency=svc.cc,
            )
            for svc_name, svc in self.services.items()
        }
        if not self.fleet:
            return {"workers": self.workers, "access_log": False, "services": services}
        top = {"workers": self.fleet_workers[name]} if name in self.fleet_workers else {}
        return fleet_config(name, {p: self.addresses[p] for p in self.peers}, services, **top)

    def start(self, name: str) -> Activator:
        """Start the activator ``name`` (a new one, also for a name that was used before)
        with the current file."""
        act = self.acts[name] = self.factory(self.config(name), start=False)
        act.start(wait_ready=False)
        if name in self.fleet_workers:
            self.fleet_admins[name] = worker_admins(act, self.fleet_workers[name])
        return act

    def next_pod(self) -> Pod:
        """A spare pod, else the pool's next one."""
        if self.spares:
            return self.spares.pop(0)
        self.taken += 1
        return self.pool.take(self.taken - 1)

    def running(self) -> dict[str, Activator]:
        """The activators in the file (with workers: the one)."""
        return {n: self.acts[n] for n in self.peers} if self.fleet else dict(self.acts)

    def roll(self, names: Sequence[str] | None = None) -> None:
        """Give every activator in the file (or just ``names``) the new file at once:
        rewrite every file, SIGHUP each; then wait until all in the file applied it."""
        self.changes += 1
        assert self.load is not None
        self.load.phase = f"change {self.changes} rolling"
        names = list(self.running()) if names is None else list(names)
        for name in names:
            self.acts[name].rewrite_config(self.config(name))
        for name in names:
            self.acts[name].reload()
        self.wait_applied()

    # -- waits ------------------------------------------------------------------------

    def applied(self, st: dict[str, Any]) -> bool:
        """``st`` (an activator's or a worker's /status) shows the current file applied."""
        if st["config"].get("last_error"):
            raise HarnessError(f"the file was refused: {st['config']['last_error']}")
        if self.fleet:
            me, health = st["activator"]["self"], st["activator"]["health"]
            if set(st["activator"]["peers"]) != set(self.peers):
                return False
            if any(health.get(p, {}).get("state") != "up" for p in self.peers if p != me):
                return False  # (a peer refused while it was starting is down until checked again)
        for name, svc in self.services.items():
            s = st["services"][name]
            if s["container_concurrency"] != svc.cc:
                return False
            shown = {p["address"]: p for p in s["pods"] if p["listed"]}
            listed = svc.listed()
            if set(shown) != set(listed) or any(shown[a]["drain"] != e.drain for a, e in listed.items()):
                return False
        return True

    def processes(self) -> dict[str, Callable[[], dict[str, Any]]]:
        """Every process holding slots, by the name its peers give it, with its /status:
        each running activator of a fleet (one that left the file included, while it
        runs; one with workers: each of them, as ``NAME/worker I``), or each worker."""
        if not self.fleet:
            return self._workers("", self.admins)
        procs: dict[str, Callable[[], dict[str, Any]]] = {}
        for name, act in self.acts.items():
            if not act.is_running():
                continue
            if name in self.fleet_admins:
                procs.update(self._workers(f"{name}/", self.fleet_admins[name]))
            else:
                procs[name] = act.status
        return procs

    @staticmethod
    def _workers(prefix: str, admins: list[str]) -> dict[str, Callable[[], dict[str, Any]]]:
        procs = {}
        for admin in admins:
            st = json_request(admin, "GET", "/status")
            procs[f"{prefix}worker {st['worker']['index']}"] = partial(json_request, admin, "GET", "/status")
        return procs

    def wait_applied(self) -> None:
        describe = self.describe()
        for name, act in self.running().items():
            act.wait_for(self.applied, message=f"{name} applied change {self.changes}: {describe}")
        procs = self.processes()
        for proc, status in procs.items():
            if "worker" in proc:
                wait_until(lambda status=status: self.applied(status()), message=f"{proc} applied: {describe}")
        if self.stalls and not self.soak:
            return  # one stall fails the case: its evidence is in, the rest is its load
        stalled = self.wait_handed_over(procs)
        if stalled:
            self.stalls.append(f"change {self.changes} ({describe}):\n{stalled}\n{self.logs()}")
        if not self.stuck:  # (slots held for good do not add up)
            self.check_cover()

    def wait_handed_over(self, procs: dict[str, Callable[[], dict[str, Any]]]) -> str | None:
        """Until no process in the file holds a moved slot or is capped by a view; None.
        A hand-over still held ``STALLED_AFTER`` seconds after every holder it waits on
        ran no more than its new share of the pod (a stopped one: nothing) is stalled:
        the wait returns that evidence, and from then on ignores that hand-over."""
        members = {p for p in procs if p.partition("/")[0] in self.peers} if self.fleet else set(procs)
        settled_since: dict[tuple[str, str, str], float] = {}
        evidence: list[str] = []
        last: list[str] = []

        def holder_counts(
            statuses: dict[str, Any], checker: str, holder: str, service: str, pod: str
        ) -> tuple[int, int] | None:
            """(in flight, slots) of the holder on the pod; None: unknown."""
            if holder.startswith("worker ") and "/" in checker:  # a sibling of the checker
                holder = f"{checker.partition('/')[0]}/{holder}"
            if holder in statuses:
                shown = find_pod(statuses[holder], service, pod)
                return None if shown is None else (shown["in_flight"], shown["slots"] or 0)
            workers = [st for proc, st in statuses.items() if proc.startswith(f"{holder}/")]
            if workers:  # a peer with workers: what they run and hold, summed
                shown_all = [find_pod(st, service, pod) for st in workers]
                if any(shown is None for shown in shown_all):
                    return None
                return sum(p["in_flight"] for p in shown_all), sum(p["slots"] or 0 for p in shown_all)
            act = self.acts.get(holder)
            return (0, 0) if act is not None and not act.is_running() else None

        def done() -> bool:
            statuses = {name: status() for name, status in procs.items()}
            last[:] = [
                f"{name}: {svc_name} handover {s['handover']} capped_by {s['capped_by']} pods "
                + str([(p["address"], p["state"], p["in_flight"], p["slots"]) for p in s["pods"]])
                for name, st in statuses.items()
                for svc_name, s in st["services"].items()
            ]
            now = time.monotonic()
            busy = False
            for name in members:
                for svc_name, s in statuses[name]["services"].items():
                    busy = busy or bool(s["capped_by"])
                    for held in s["handover"]:
                        key = (name, svc_name, held["pod"])
                        if key in self.stuck:
                            continue
                        busy = True
                        holders = {
                            h: holder_counts(statuses, name, h, svc_name, held["pod"]) for h in held["waiting_on"]
                        }
                        if not all(h is not None and h[0] <= h[1] for h in holders.values()):
                            settled_since.pop(key, None)
                            continue
                        since = settled_since.setdefault(key, now)
                        if now - since >= STALLED_AFTER:
                            self.stuck.add(key)
                            evidence.append(
                                f"{name}: {svc_name} {held} still held {now - since:.1f} s after each holder "
                                f"(in_flight, slots) {holders} ran no more than its share of the pod (a stopped "
                                "one: nothing)"
                            )
            return not busy

        wait_until(
            done,
            message=lambda: (
                f"hand-overs of change {self.changes} done: {self.describe()}\n" + "\n".join(last) + f"\n{self.logs()}"
            ),
        )
        return "\n".join(evidence) or None

    def check_cover(self) -> None:
        """Every pod's slots, summed over the activators, are its cc (0 for a drained one)."""
        statuses = [act.status() for act in self.running().values()]
        for name, svc in self.services.items():
            for e in svc.entries:
                owned = [find_pod(st, name, e.pod.address) for st in statuses]
                slots = [p["slots"] if p is not None else None for p in owned]
                expected = 0 if e.drain else svc.cc
                assert sum(s or 0 for s in slots) == expected, f"{name} {e.pod.address}: slots {slots}, cc {svc.cc}"

    def describe(self) -> str:
        files = {n: [(e.pod.address, e.drain) for e in s.entries] for n, s in self.services.items()}
        return f"peers {self.peers}, cc {[(n, s.cc) for n, s in self.services.items()]}, pods {files}"

    # -- load and peaks ---------------------------------------------------------------

    def targets(self) -> list[tuple[Activator, str]]:
        return [(act, svc.host) for act in self.running().values() for svc in self.services.values()]

    def more(self, n: int, phase: str) -> None:
        assert self.load is not None
        self.load.phase = phase
        self.load.wait_more(n)

    def check_peaks(self, when: str) -> None:
        """Every pod ever listed ran at most the cc it is held to (so far)."""
        over = {}
        for pod in self.pods:
            peak = pod.stats()["peak"]
            if peak > self.allowed[pod.address]:
                over[pod.address] = (peak, self.allowed[pod.address])
        assert not over, f"{when}: pod -> (peak, cc): {over}; {self.describe()}\n{self.logs()}"

    def snapshot(self) -> str:
        """Each running activator's services and peers, in short."""
        lines = []
        for name, act in self.acts.items():
            if not act.is_running():
                continue
            st = act.status()
            health = {p: h["state"] for p, h in (st["activator"].get("health") or {}).items()}
            lines.append(f"{name}: peers {sorted(st['activator'].get('peers') or {})} health {health}")
            for svc_name, s in st["services"].items():
                pods = [(p["address"], p["state"], p["in_flight"], p["slots"]) for p in s["pods"]]
                lines.append(
                    f"  {svc_name}: capacity {s['capacity']} in_flight {s['in_flight']} queued {s['queued']} "
                    f"forward_to {s['forward_to']} handover {s['handover']} capped_by {s['capped_by']} pods {pods}"
                )
        return "\n".join(lines)

    def logs(self, lines: int = 30) -> str:
        parts = []
        for name, act in self.acts.items():
            tail = act.stderr_text().splitlines()[-lines:]
            parts.append(f"--- {name} stderr (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- changes ----------------------------------------------------------------------

    def add_peer(self, name: str) -> None:
        """README "Adding a VM": it starts first, with the new file (no traffic yet); then
        every other activator gets the file; then the balancer sends to it too."""
        assert self.load is not None
        others = list(self.peers)
        self.peers.append(name)
        self.addresses[name] = f"{LOCALHOST}:{free_port()}"  # (a peer added again: a new VM)
        self.start(name).wait_ready()
        self.roll(others)
        self.load.targets = self.targets()

    def remove_peer(self, name: str) -> None:
        """README "Removing a VM": out of the balancer; the remaining ones get the file
        without it and apply it; then it is stopped (it finishes what it still runs)."""
        assert self.load is not None
        victim = self.acts[name]
        self.peers.remove(name)
        self.load.targets = self.targets()
        self.roll()
        assert victim.stop() == 0, victim.output_tail()

    def add_pod(self, svc_name: str, pod: Pod | None = None) -> Pod:
        """A pod (a new one, or one listed before) added to the service."""
        svc = self.services[svc_name]
        if pod is None:
            pod = self.next_pod()
        if pod not in self.pods:
            self.pods.append(pod)
        svc.entries.append(Entry(pod))
        self.allowed[pod.address] = svc.cc
        self.roll()
        return pod

    def drain_pod(self, svc_name: str, pod: Pod, drain: bool = True) -> None:
        """``drain: true`` (or back to false); once drained, nothing runs on it any more."""
        self.services[svc_name].listed()[pod.address].drain = drain
        self.roll()
        if drain:
            for act in self.running().values():
                act.wait_for(
                    lambda st: find_pod(st, svc_name, pod.address)["in_flight"] == 0, message=f"{pod.address} drained"
                )

    def remove_pod(self, svc_name: str, pod: Pod) -> None:
        """Out of the file (drained first or not)."""
        svc = self.services[svc_name]
        svc.entries = [e for e in svc.entries if e.pod is not pod]
        self.roll()

    def set_cc(self, svc_name: str, cc: int) -> None:
        """A new cc for the service. Raised: it holds at once. Lowered: the requests
        already running finish first (at most the old cc meanwhile); once the file is
        applied everywhere and each pod runs at most the new cc, the pods' peaks are reset
        and the new cc holds."""
        svc = self.services[svc_name]
        old, svc.cc = svc.cc, cc
        self.check_peaks(f"before {svc_name} cc {old} -> {cc}")
        pods = [e.pod for e in svc.entries]
        for pod in pods:
            self.allowed[pod.address] = max(old, cc)
        self.roll()
        if cc < old:
            for pod in pods:
                wait_until(lambda pod=pod: pod.stats()["in_flight"] <= cc, message=f"{pod.address} down to cc {cc}")
            self.check_peaks(f"{svc_name} cc {old} -> {cc}, while the requests above it finished")
            for pod in pods:
                pod.reset()
        for pod in pods:
            self.allowed[pod.address] = cc


def pods_on_ports(n: int, wanted: Callable[[list[str]], bool]) -> list[Pod]:
    """``n`` pods on ports picked so that ``wanted(their addresses)`` holds."""
    for _ in range(1000):
        ports = free_ports(n)
        if wanted([f"{LOCALHOST}:{p}" for p in ports]):
            break
    else:
        raise HarnessError("no ports found for the pods")
    pods = [Pod(port, start=False) for port in ports]
    try:
        for pod in pods:
            pod.launch()
        for pod in pods:
            pod.wait_ready()
    except BaseException:
        for pod in pods:
            pod.close()
        raise
    return pods


@contextlib.contextmanager
def rig(
    activator_factory: Callable[..., Activator],
    pool: PodPool,
    case: str,
    *,
    peers: int = 0,
    workers: int = 1,
    fleet_workers: Mapping[str, int] | None = None,
    threads: int = 16,
    ports: Callable[[list[str]], bool] | None = None,
    spares: int = 0,
    soak: bool = False,
) -> Iterator[Rig]:
    """The services' pods and ``spares`` more (their addresses chosen by ``ports``, when
    given), ``peers`` activators (those named in ``fleet_workers`` with that many workers),
    or one with ``workers``, and load through every one of them. On the way out: the load
    stopped, no request failed, every peak within its limit, every activator idle, the
    number of requests recorded; then a stalled hand-over fails the case."""
    r = Rig(activator_factory, pool, workers=workers, soak=soak, fleet_workers=dict(fleet_workers or {}))
    listed = sum(n for _, _, n in SERVICES.values())
    with contextlib.ExitStack() as stack:
        if ports is not None:  # started here, on chosen ports: not the pool's
            r.spares = pods_on_ports(listed + spares, ports)
            for pod in r.spares:
                stack.callback(pod.close)
        for name, (host, cc, n) in SERVICES.items():
            entries = [Entry(r.next_pod()) for _ in range(n)]
            r.services[name] = Svc(host, cc, entries)
            for e in entries:
                r.pods.append(e.pod)
                r.allowed[e.pod.address] = cc
        if workers > 1:
            r.start("solo").wait_ready()
            r.admins = worker_admins(r.acts["solo"], workers)
        else:
            r.peers = list(NAMES[:peers])
            r.addresses = {n: f"{LOCALHOST}:{p}" for n, p in zip(r.peers, free_ports(peers), strict=True)}
            for name in r.peers:
                r.start(name)
            for act in r.acts.values():
                act.wait_ready()
        r.wait_applied()
        with ChangeLoad(r.targets(), threads=threads, path=PATH) as load:
            r.load = load
            load.snapshot = r.snapshot
            r.more(30, "before")
            yield r
            r.more(30, "after the last change")
        count = load.count()
        REQUESTS[case] = count
        print(f"{case}: {count} requests, {r.changes} file changes")
        failures = load.failures()
        assert not failures, (
            f"{len(failures)} of {count} failed (status, reason, phase sent, phase done): {failures[:10]}\n"
            + "\n".join(load.snapshots)
            + f"\n{r.logs()}"
        )
        r.check_peaks("at the end")
        for act in r.running().values():
            act.wait_idle()
        if r.stalls:
            raise HandOverStalled("\n".join(r.stalls))


# --------------------------------------------------------------------------------------
# one change per case


def apply_change(r: Rig, change: str) -> None:
    if change == "add-peer":
        r.add_peer(NAMES[len(r.peers)])
    elif change == "remove-peer":
        r.remove_peer(r.peers[-1])
    elif change == "add-pod":
        r.add_pod("one")
        r.add_pod("two")
    elif change == "drain-pod":
        for name in ("one", "two"):
            pod = r.services[name].entries[0].pod
            r.drain_pod(name, pod)
            r.more(15, f"{pod.address} drained")
            r.remove_pod(name, pod)
    elif change == "remove-pod":
        for name in ("one", "two"):
            r.remove_pod(name, r.services[name].entries[0].pod)
    elif change == "raise-cc":
        r.set_cc("one", 2)
        r.set_cc("two", 3)
    elif change == "lower-cc":
        r.set_cc("two", 1)
    else:
        raise AssertionError(change)


FLEET_CHANGES = ["add-peer", "remove-peer", "add-pod", "drain-pod", "remove-pod", "raise-cc", "lower-cc"]


@pytest.mark.parametrize("change", FLEET_CHANGES)
@pytest.mark.parametrize("n", [2, 3])
def test_fleet_change_under_load(n, change, pod_pool, activator_factory):
    with rig(activator_factory, pod_pool, f"{n} activators, {change}", peers=n) as r:
        apply_change(r, change)


def _moves_between_workers(before: list[str], after: list[str]) -> bool:
    """Whether the division of cc=1 pods among 2 workers takes a slot from one of them
    that the other gets (so that the other waits for a hand-over)."""
    old = divide_slots(dict.fromkeys(before, 1), ["0", "1"])
    new = divide_slots(dict.fromkeys(after, 1), ["0", "1"])
    return any(new[w].get(p, 0) < old[w].get(p, 0) for w in old for p in after)


#: The pods' addresses (``one``'s 3 pods, ``two``'s 2, then a spare for ``one``) for each
#: worker case: chosen so that the change moves a slot of ``one`` from a worker to the
#: other (a hand-over between the workers, every time).
WORKER_PORTS: dict[str, Callable[[list[str]], bool]] = {
    "add-pod": lambda a: _moves_between_workers(a[:3], [*a[:3], a[5]]),
    "drain-pod": lambda a: _moves_between_workers(a[:3], a[1:3]),
    "remove-pod": lambda a: _moves_between_workers(a[:3], a[1:3]),
}


# In add-pod, drain-pod and remove-pod a slot moves between the workers (the choice of
# ports above); in raise-cc the first worker to apply the file is capped by its
# sibling's older view, and that cap lifting is a hand-over; lowering moves nothing.
@pytest.mark.parametrize("change", ["add-pod", "drain-pod", "remove-pod", "raise-cc", "lower-cc"])
def test_workers_change_under_load(change, pod_pool, activator_factory):
    case = f"1 activator, 2 workers, {change}"
    ports = WORKER_PORTS.get(change)
    spares = 1 if change == "add-pod" else 0
    with rig(activator_factory, pod_pool, case, workers=2, threads=12, ports=ports, spares=spares) as r:
        apply_change(r, change)


# --------------------------------------------------------------------------------------
# the soak


def test_twenty_changes_in_a_row_under_load(pod_pool, activator_factory):
    """20 changes of every kind, one after the other, on a fleet of 2 (3 at times), with
    load all along; the peaks checked after each."""
    with rig(activator_factory, pod_pool, "soak: 20 changes, 2-3 activators", peers=2, soak=True) as r:
        one = [e.pod for e in r.services["one"].entries]
        two = [e.pod for e in r.services["two"].entries]
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("add a pod to one", lambda: r.add_pod("one")),
            ("one cc 1 -> 2", lambda: r.set_cc("one", 2)),
            ("add vm-c", lambda: r.add_peer("vm-c")),
            ("drain a pod of two", lambda: r.drain_pod("two", two[0])),
            ("one cc 2 -> 1", lambda: r.set_cc("one", 1)),
            ("remove vm-c", lambda: r.remove_peer("vm-c")),
            ("take the drained pod out of two", lambda: r.remove_pod("two", two[0])),
            ("two cc 2 -> 3", lambda: r.set_cc("two", 3)),
            ("list it in two again", lambda: r.add_pod("two", two[0])),
            ("take a pod out of one outright", lambda: r.remove_pod("one", one[0])),
            ("add vm-c again", lambda: r.add_peer("vm-c")),
            ("two cc 3 -> 1", lambda: r.set_cc("two", 1)),
            ("list the pod in one again", lambda: r.add_pod("one", one[0])),
            ("remove vm-b", lambda: r.remove_peer("vm-b")),
            ("one cc 1 -> 2", lambda: r.set_cc("one", 2)),
            ("drain another pod of one", lambda: r.drain_pod("one", one[1])),
            ("add vm-b again", lambda: r.add_peer("vm-b")),
            ("undrain it", lambda: r.drain_pod("one", one[1], drain=False)),
            ("two cc 1 -> 2", lambda: r.set_cc("two", 2)),
            ("remove vm-c", lambda: r.remove_peer("vm-c")),
        ]
        assert len(steps) == 20
        for i, (what, step) in enumerate(steps, 1):
            step()
            r.more(15, f"{i}: {what}")
            r.check_peaks(f"after change {i} ({what})")


def test_three_activators_twelve_changes_under_load(pod_pool, activator_factory):
    """Issue 25's scenario on three activators, one of them with two workers: twelve
    changes rolled in the README's order under load, among them cc lowered (2 -> 1: the
    slot that remains waits for the holder of the one that vanished) and a peer removed;
    every pod's own peak checked after each change."""
    with rig(
        activator_factory, pod_pool, "3 activators, 12 changes", peers=3, fleet_workers={"vm-a": 2}, soak=True
    ) as r:
        one = [e.pod for e in r.services["one"].entries]
        two = [e.pod for e in r.services["two"].entries]
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("two cc 2 -> 1", lambda: r.set_cc("two", 1)),
            ("one cc 1 -> 2", lambda: r.set_cc("one", 2)),
            ("remove vm-c", lambda: r.remove_peer("vm-c")),
            ("two cc 1 -> 2", lambda: r.set_cc("two", 2)),
            ("add vm-c again", lambda: r.add_peer("vm-c")),
            ("one cc 2 -> 1", lambda: r.set_cc("one", 1)),
            ("add a pod to two", lambda: r.add_pod("two")),
            ("drain a pod of one", lambda: r.drain_pod("one", one[0])),
            ("two cc 2 -> 1", lambda: r.set_cc("two", 1)),
            ("remove vm-b", lambda: r.remove_peer("vm-b")),
            ("undrain it", lambda: r.drain_pod("one", one[0], drain=False)),
            ("take a pod out of two", lambda: r.remove_pod("two", two[0])),
        ]
        assert len(steps) == 12
        for i, (what, step) in enumerate(steps, 1):
            step()
            r.more(15, f"{i}: {what}")
            r.check_peaks(f"after change {i} ({what})")

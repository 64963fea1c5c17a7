"""A simulated fleet of activators (and their workers) around the real core.

Each process (an activator's worker) is a real ``core.topology.Topology``: its
``Fleet``, its hand-overs, its throttlers. Everything else is simulated here, in the
fewest lines that keep the shell's contract (``activator.peers``):

- **Checks.** ``Sim.send_checks`` makes one check per ``Fleet.check_targets`` entry,
  as ``PeerChecker`` does (no secret in force for a target: no check). A check reaching
  a live process is applied there (``ViewReceived``), and, for the activator scope with
  several workers, at every sibling (the relay); the answer is ``Topology.answer``,
  merged over the workers (``peering.merge_answers``), or none when a sibling is not
  running (the endpoint's 503). A check reaching an activator that is not running is
  refused (``PeerChecked(refused=True)``); one lost (or cut by a partition) becomes a
  timeout.
- **The network** holds every message in flight (checks and answers) in one list;
  the test chooses which one is delivered, lost or duplicated next, so every order is
  possible.
- **Requests** arrive at a process, are granted (or queued, for a single worker) by its
  throttler, and end when the test completes them; a request lives at most
  ``REQUEST_TIMEOUT`` and waits at most ``QUEUE_TIMEOUT`` (the shell enforces both), so
  advancing the clock past them ends it.
- **Crashes**: a process that crashes loses its requests (its connections to the pods
  close with it) and refuses checks until it is started again, with the file in force.

``in_use`` is the ground truth the model's properties are about: the requests running
on each pod, summed over every live process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from builders import pod as pod_config
from builders import svc

from activator.core.config import ActivatorsConfig, Address, Config
from activator.core.errors import QueueFull
from activator.core.events import PeerChecked, Tick, ViewReceived
from activator.core.fleet import CheckTarget
from activator.core.peering import ACTIVATOR_SCOPE, WORKER_SCOPE, Answer, Check, merge_answers
from activator.core.throttler import Effects, Grant, Waiter
from activator.core.topology import Topology

NAMES = ("a", "b", "c", "d")
PODS = ("10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80")
SERVICE = "api"
REQUEST_TIMEOUT = 20.0
QUEUE_TIMEOUT = 5.0
GRACE = 5.0
SECRET = "model-secret"


def peer_address(name: str) -> Address:
    return Address("127.0.0.1", 20000 + NAMES.index(name))


@dataclass(frozen=True)
class File:
    """The fleet's file, as the model edits it: the listed peers, the pods (with their
    drain flags) and the cc of the one service."""

    peers: tuple[str, ...]
    pods: tuple[tuple[str, bool], ...]
    cc: int

    def config(self, me: str) -> Config:
        activators = None
        if len(self.peers) > 1:
            activators = ActivatorsConfig(
                self_name=me, peers={p: peer_address(p) for p in self.peers}, secret=SECRET, unhealthy_after=2
            )
        service = svc(
            *(pod_config(address, drain=drain) for address, drain in self.pods),
            cc=self.cc,
            request_timeout=REQUEST_TIMEOUT,
            queue_timeout=QUEUE_TIMEOUT,
        )
        return Config(path="model.yaml", grace_period=GRACE, activators=activators, services={SERVICE: service})

    def cc_of(self, pod: str) -> int:
        """The pod's cc by this file (0: not listed, or draining: no new request)."""
        return self.cc if (pod, False) in self.pods else 0


@dataclass
class Request:
    process: Process
    grant: Grant | None
    waiter: Waiter | None
    started: float


@dataclass
class Process:
    """One worker of an activator (the whole activator when it has one)."""

    activator: str
    index: int
    topology: Topology | None = None  # None: not running
    file: File | None = None  # the file it applied last
    requests: list[Request] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.activator}/{self.index}"

    @property
    def running(self) -> bool:
        return self.topology is not None


@dataclass
class Message:
    """A check on its way to ``target`` (``answer`` None), or its answer on its way back."""

    checker: Process
    target: CheckTarget
    check: Check
    asked_at: float
    answer: Answer | None = None
    reply: bool = False  # an answer (or a no-answer) on its way back
    error: str = ""
    refused: bool = False


class Sim:
    """The fleet: ``activators`` names, each with ``workers[name]`` processes."""

    def __init__(self, workers: dict[str, int], file: File) -> None:
        self.now = 0.0
        self.file = file
        self.workers = workers
        self.processes = {name: [Process(name, i) for i in range(count)] for name, count in workers.items()}
        self.network: list[Message] = []
        #: Pairs of activators that cannot reach each other.
        self.cut: set[frozenset[str]] = set()
        #: Per pod, the grants made in the step under way.
        self.granted: dict[str, int] = {}
        for name in file.peers:
            self.start(name)

    # -- processes -------------------------------------------------------------------

    def addresses(self, activator: str) -> tuple[str, ...]:
        count = self.workers[activator]
        return tuple(f"127.0.0.{10 + NAMES.index(activator)}:{30000 + i}" for i in range(count)) if count > 1 else ()

    def live(self) -> Iterable[Process]:
        return (p for group in self.processes.values() for p in group if p.running)

    def running(self, activator: str) -> bool:
        return any(p.running for p in self.processes[activator])

    def start(self, activator: str, index: int | None = None) -> None:
        """Start an activator (every worker) with the file in force, or restart one worker
        of a running activator (with its siblings' file, which it reads from the disk)."""
        siblings = [p.file for p in self.processes[activator] if p.file is not None]
        file = siblings[0] if siblings else self.file
        for process in self.processes[activator]:
            if process.running or (index is not None and process.index != index):
                continue
            config = file.config(activator)
            process.topology = Topology(
                config,
                self.now,
                worker_index=process.index,
                workers=self.addresses(activator),
                hand_over_at_start=True,
            )
            process.file = file
            self.act(process, process.topology.initial_effects)

    def crash(self, activator: str, index: int | None = None) -> None:
        """An activator (or one worker) ends: its requests end with it."""
        for process in self.processes[activator]:
            if index is None or process.index == index:
                process.topology = None
                process.file = None
                process.requests = []

    def apply_file(self, process: Process) -> None:
        """``process`` applies the file in force (its activator must be listed in it)."""
        assert process.topology is not None
        process.file = self.file
        self.act(process, process.topology.apply(self.file.config(process.activator), self.now))

    # -- requests ----------------------------------------------------------------------

    def arrive(self, process: Process) -> None:
        topology = process.topology
        assert topology is not None
        throttler = topology.services[SERVICE]
        if throttler.shared:
            grant = throttler.acquire_here()  # (no free slot here: it would queue at the exchange)
            if grant is not None:
                self._granted(grant)
                process.requests.append(Request(process, grant, None, self.now))
            return
        try:
            taken = throttler.acquire(self.now)
        except QueueFull:
            return  # answered 503 queue-full
        if isinstance(taken, Grant):
            self._granted(taken)
            process.requests.append(Request(process, taken, None, self.now))
        else:
            process.requests.append(Request(process, None, taken, self.now))

    def complete(self, request: Request) -> None:
        """The request ends: its slot is given back, or it leaves the queue."""
        process = request.process
        assert process.topology is not None
        throttler = process.topology.services.get(SERVICE)
        process.requests.remove(request)
        if throttler is None:
            return
        if request.grant is not None:
            self.act(process, throttler.release(request.grant, self.now))
        elif request.waiter is not None:
            grant = throttler.abandon(request.waiter)
            if grant is not None:
                self.act(process, throttler.release(grant, self.now))

    def act(self, process: Process, effects: Effects) -> None:
        for waiter in effects.woken:
            request = next((r for r in process.requests if r.waiter is waiter), None)
            if request is None:
                continue
            if waiter.grant is not None:
                self._granted(waiter.grant)
                request.grant, request.waiter = waiter.grant, None
            else:  # redirected: forwarded to a peer (not modelled: it leaves here)
                process.requests.remove(request)

    def _granted(self, grant: Grant) -> None:
        self.granted[grant.pod.address] = self.granted.get(grant.pod.address, 0) + 1

    # -- time ------------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Time passes: requests older than their timeout end; every process ticks."""
        self.now += seconds
        for process in list(self.live()):
            for request in list(process.requests):
                timeout = REQUEST_TIMEOUT if request.grant is not None else QUEUE_TIMEOUT
                if self.now - request.started >= timeout:
                    self.complete(request)
            assert process.topology is not None
            self.act(process, process.topology.handle(Tick(), self.now))

    # -- checks ------------------------------------------------------------------------

    def send_checks(self, process: Process) -> None:
        """``process`` checks every target of its fleet, as ``PeerChecker`` does (a peer
        with no secret in force is not checked)."""
        topology = process.topology
        assert topology is not None
        for target in topology.fleet.check_targets(self.addresses(process.activator)):
            if target.scope == ACTIVATOR_SCOPE and target.secret is None:
                continue
            check = Check(target.sender, target.scope, target.view)
            self.network.append(Message(process, target, check, self.now))

    def deliver(self, message: Message) -> None:
        """One message reaches its end (it stays in the network if duplicated first)."""
        if message in self.network:
            self.network.remove(message)
        if message.reply:
            checker = message.checker
            if checker.topology is None:
                return  # its checker is gone
            event = PeerChecked(message.target.name, message.asked_at, message.answer, message.error, message.refused)
            self.act(checker, checker.topology.handle(event, self.now))
            return
        answer, refused = self._answer(message)
        reply = dataclasses.replace(message, reply=True, answer=answer, refused=refused)
        reply.error = "" if answer is not None else ("connection refused" if refused else "status 503")
        self.network.append(reply)

    def lose(self, message: Message) -> None:
        """The message is lost (or cut): the checker's check times out."""
        if message in self.network:
            self.network.remove(message)
        self.network.append(dataclasses.replace(message, reply=True, answer=None, error="timed out"))

    def _answer(self, message: Message) -> tuple[Answer | None, bool]:
        """The checked one's answer to a check (None, refused: nothing listens)."""
        target, check = message.target, message.check
        if target.scope == WORKER_SCOPE:
            index = int(target.name.removeprefix("worker "))
            group = [self.processes[message.checker.activator][index]]
        else:
            group = self.processes[target.name]
        if target.scope == ACTIVATOR_SCOPE and frozenset((message.checker.activator, target.name)) in self.cut:
            return None, False
        if not any(p.running for p in group):
            return None, True
        if any(not p.running for p in group):
            return None, False  # a sibling cannot be relayed to: 503
        answers = []
        for process in group:
            assert process.topology is not None
            self.act(process, process.topology.handle(ViewReceived(check.sender, check.view), self.now))
            answers.append(process.topology.answer(check, process.activator))
        return merge_answers(target.name if target.scope == ACTIVATOR_SCOPE else "", answers), False

    # -- what the properties are about ------------------------------------------------

    def in_use(self, pod: str) -> int:
        """Requests running on ``pod``, over the whole fleet (the pods' own count)."""
        return sum(1 for p in self.live() for r in p.requests if r.grant is not None and r.grant.pod.address == pod)

    def cc_in_force(self, pod: str) -> int:
        """The largest cc of ``pod`` in the files the live processes hold."""
        return max((p.file.cc_of(pod) for p in self.live() if p.file is not None), default=0)

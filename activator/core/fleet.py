"""This process among the other holders of the same pods' slots: shares, forwards, checks.

The holders are the activators of ``activators.peers`` and, with ``workers: N``, this
activator's workers. What this module decides (the rules of proof, views, hand-over and
health are ``core.peering``'s):

- **Shares.** A pod's slots are divided among the activators, then this activator's
  share among its workers, with ``core.slots.divide_slots`` (the same file gives every
  process the same division). This process's share is then capped by the peers' views
  (activator level) and the siblings' views (worker level), and what moved to it and
  is still held for its old holder (``core.peering.HandOvers``) is taken off: the rest
  is what the throttler may use (``usable``).
- **Hand-over planning.** On a new file (or a view that changes our share), every pod
  is planned against the holders that may run more of it than they may now (each with
  the share it must come down to and how far above it it may be: ``peering.Holder``):
  a holder (peer, sibling) whose share shrank, a peer that left the file, an issuer
  whose cap lifted; what came here, plus the slots that vanished (a cc that fell), waits
  for their answers or is waited out. A peer that left is asked (with the secret and
  our name of the file it left) until it answers with nothing in use, refuses, or is
  waited out. A process that starts waits for its peers and siblings
  (``hand_over_at_start``); the first file of ``check`` moves nothing.
- **Forwards.** A service whose slots this activator owns none of is forwarded to an
  owner that is not down, the same one for as long as it stays up (rendezvous order);
  when every owner is down, the request is answered 503 ``peer-unavailable``. An
  activator that owns slots but cannot use any now (its pods pending, or its share
  capped to nothing by a peer's newer file) forwards to an owner that reported usable
  slots, else to any peer that did, else queues here.
- **Checks.** ``check_targets`` lists whom to check and with which view: every other
  peer (scope activator), every peer that left the file until it answered with nothing
  in use (or was waited out), every sibling worker (scope worker).

Pure: no I/O, time passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import slots as slot_division
from .config import Config, ServiceConfig
from .errors import PeerUnavailable
from .peering import (
    ACTIVATOR_SCOPE,
    WORKER_SCOPE,
    Answer,
    HandOvers,
    Holder,
    PeerHealth,
    PeerState,
    PodCounts,
    capped,
)


@dataclass(frozen=True)
class Forward:
    """Send the service's requests to the peer ``name`` at ``address`` (its proxy port)."""

    address: str
    name: str


@dataclass(frozen=True)
class CheckTarget:
    """Check ``name`` at ``address`` with ``view`` (what we believe its shares are), as
    ``sender``, proved with ``secret`` (None: the siblings' secret, which the shell keeps;
    for a peer, None only when no secret is in force: no check then)."""

    name: str
    address: str
    scope: str
    view: PodCounts
    sender: str = ""
    secret: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Departed:
    """A peer that left the file, still asked (at ``address``, with the ``secret`` and our
    ``name`` of the file it left) until it runs nothing of the slots that moved."""

    address: str
    secret: str | None = field(repr=False)
    name: str
    #: When it is waited out (the longest life of a request it may run; None: never).
    until: float | None = None


@dataclass(frozen=True)
class PeerChange:
    """A peer's health changed (for the shell to log and count)."""

    name: str
    old: PeerState
    new: PeerState
    detail: str


@dataclass
class Shares:
    """One service's division as this process applies it."""

    pods: tuple[str, ...] = ()  # the pods with slots (listed, not draining)
    activators: dict[str, dict[str, int]] = field(default_factory=dict)  # peer -> pod -> slots
    workers: dict[str, dict[str, int]] = field(default_factory=dict)  # "worker i" -> pod -> slots
    #: This process's share after the caps (hand-over holds not taken off); None: all.
    mine: dict[str, int] | None = None
    #: The other activators owning slots, in this one's order of preference.
    owners: tuple[str, ...] = ()
    #: Whether this activator (all its workers) owns any slot.
    activator_owns: bool = True
    #: The peers (or siblings) whose views give this process less than its file does.
    capped_by: tuple[str, ...] = ()


def worker_name(index: int) -> str:
    return f"worker {index}"


class Fleet:
    """This process's view of the fleet (see the module docstring). Does not yield."""

    def __init__(self, worker_index: int = 0, workers: int = 1, *, hand_over_at_start: bool = False) -> None:
        #: Whether a service's first shares wait for the peers (see ``follow``).
        self.hand_over_at_start = hand_over_at_start
        self.worker_index = worker_index
        self.workers = workers
        self.me_worker = worker_name(worker_index)
        self.config: Config | None = None
        self.shares: dict[str, Shares] = {}
        #: issuer (peer name or "worker i") -> its view of our shares
        self.views: dict[str, PodCounts] = {}
        self.health: dict[str, PeerHealth] = {}
        #: Peers that left the file, still checked until nothing of theirs is in use.
        self.departed: dict[str, Departed] = {}
        #: This activator's name, kept from the last file that named it (a file back to
        #: one activator may have no ``activators`` section: the leavers are asked as it).
        self.name = ""
        self.handovers = HandOvers()
        #: (service, pod) -> the issuers whose views capped it here and lifted since: they
        #: answer before a gain of it is used.
        self.lifted: dict[tuple[str, str], set[str]] = {}
        #: Peer health changes since the shell last took them.
        self.changes: list[PeerChange] = []

    # -- configuration ---------------------------------------------------------------

    @property
    def me(self) -> str:
        return self.name

    def configure(self, config: Config, now: float) -> None:
        """A new file: peers come, stay or leave (a leaving peer is still asked)."""
        old = self.config.activators if self.config is not None else None
        new = config.activators
        self.config = config
        peers = dict(new.peers) if new is not None and len(new.peers) > 1 else {}
        if new is not None:
            self.name = new.self_name
        me = self.name
        if old is not None:
            until = _longest_life(config, now)
            for name, address in old.peers.items():
                if name != me and name not in peers and self.shares:
                    self.departed[name] = Departed(str(address), old.secret, old.self_name, until)
        for name in list(self.health):
            if name not in peers and name not in self.departed:
                del self.health[name]
        for name, address in peers.items():
            if name == me:
                continue
            self.departed.pop(name, None)
            health = self.health.get(name)
            if health is None:
                self.health[name] = PeerHealth(name, str(address), since=now)
            else:
                health.address = str(address)
        for issuer in list(self.views):
            if not self._valid_issuer(issuer):
                # Its caps lift: a slot one of them held from us waits for it (a leaver
                # is still asked; one forgotten runs nothing).
                for service_name, caps in self.views.pop(issuer).items():
                    for pod in caps:
                        self.lifted.setdefault((service_name, pod), set()).add(issuer)

    def _valid_issuer(self, issuer: str) -> bool:
        if issuer.startswith("worker "):
            index = issuer.removeprefix("worker ")
            return index.isdigit() and int(index) < self.workers and issuer != self.me_worker
        return issuer in self.health and issuer not in self.departed

    # -- shares ------------------------------------------------------------------------

    def follow(self, service: ServiceConfig, now: float, *, grace: float) -> dict[str, int] | None:
        """The service's shares now (planning hand-overs against the previous ones); what
        this process may use (None: every slot)."""
        new = self._divide(service)
        old = self.shares.get(service.name)
        self.shares[service.name] = new
        deadline = None if service.request_timeout is None else now + service.request_timeout + grace
        if old is not None and old.mine is not None and new.mine is not None:
            self._plan(service.name, old, new, now, deadline)
        elif old is None and self.hand_over_at_start and new.mine is not None and (new.activators or new.workers):
            # New here (a start, a worker restarted, or a service added): the peers and the
            # siblings may run requests on what is ours by this file (theirs by an older
            # one, or above a share that fell while this worker was away): each answers
            # first, with what it runs at or under its share by ours (a peer whose port
            # refuses runs nothing).
            for pod, share in new.mine.items():
                holders = {name: Holder(new.activators.get(name, {}).get(pod, 0), share) for name in self.health}
                for sibling, shares in new.workers.items():
                    if sibling != self.me_worker:
                        holders[sibling] = Holder(shares.get(pod, 0), share)
                self.handovers.plan(service.name, pod, share, holders, now, deadline)
        return self.usable(service.name)

    def usable(self, service: str) -> dict[str, int] | None:
        shares = self.shares.get(service)
        if shares is None or shares.mine is None:
            return None
        held = self.handovers.held
        return {pod: n - min(n, held(service, pod)) for pod, n in shares.mine.items()}

    def divided(self, service: str) -> bool:
        """Whether the service's slots are shared out (among activators or workers)."""
        shares = self.shares.get(service)
        return shares is not None and shares.mine is not None

    def capped(self, service: str) -> bool:
        shares = self.shares.get(service)
        return shares is not None and bool(shares.capped_by)

    def held_slots(self, service: str) -> int:
        """Slots of the service that came to this process and wait for a hand-over."""
        return sum(gain.slots for (name, _), gain in self.handovers.pending.items() if name == service)

    def forget(self, service: str) -> None:
        self.shares.pop(service, None)

    def _divide(self, service: ServiceConfig) -> Shares:
        config = self.config
        assert config is not None
        peers = config.activators
        several = peers is not None and len(peers.peers) > 1
        # Back to one activator: still divided (all of it ours) while a peer that left may
        # run requests on what comes to us, so that the gain waits for it.
        if service.container_concurrency == 0 or (not several and self.workers <= 1 and not self.departed):
            return Shares()
        limits = {pod.address: service.container_concurrency for pod in service.pods if not pod.drain}
        shares = Shares(pods=tuple(limits), mine=dict(limits))
        if not limits:
            return shares
        if several:
            assert peers is not None
            me = peers.self_name
            shares.activators = slot_division.divide_slots(limits, sorted(peers.peers))
            caps = {p: self.views[p].get(service.name, {}) for p in peers.peers if p != me and p in self.views}
            shares.mine = capped(shares.activators[me], caps.values())
            shares.capped_by += _below(shares.activators[me], caps)
            others = [p for p, owned in shares.activators.items() if p != me and any(owned.values())]
            shares.owners = tuple(sorted(others, key=lambda p: -slot_division.score(p, me)))
            shares.activator_owns = any(shares.activators[me].values())
        if self.workers > 1:
            assert shares.mine is not None
            division = slot_division.divide_slots(shares.mine, [str(i) for i in range(self.workers)])
            shares.workers = {worker_name(i): division[str(i)] for i in range(self.workers)}
            caps = {i: view.get(service.name, {}) for i, view in self.views.items() if i.startswith("worker ")}
            shares.mine = capped(division[str(self.worker_index)], caps.values())
            shares.capped_by += _below(division[str(self.worker_index)], caps)
        return shares

    def _holders(self, service: str, old: Shares, new: Shares, pod: str, gained: int) -> dict[str, Holder]:
        """The holders of ``pod`` that may run more of it than they may now, each with the
        share it must come down to and how far above it it may be: every holder (peer,
        leaver, sibling) whose share of it shrank in our file (by what it lost: a cc that
        falls takes slots that may still be in use), and, when ours grew (``gained``),
        every peer whose view capped it here and lifted since (it may still run requests
        on the slot)."""
        holders: dict[str, Holder] = {}
        for before_all, after_all, me in (
            (old.activators, new.activators, self.me),
            (old.workers, new.workers, self.me_worker),
        ):
            for holder in set(before_all) | set(after_all):
                if holder == me:
                    continue
                before = before_all.get(holder, {}).get(pod, 0)
                after = after_all.get(holder, {}).get(pod, 0)
                if before > after:
                    holders[holder] = Holder(after, before - after)
        if gained > 0:
            # A peer that left may run requests on what comes to us now (it is asked until
            # it runs nothing, or is waited out).
            for name in self.departed:
                holders.setdefault(name, Holder(0, gained))
            for name in self.lifted.pop((service, pod), set()):
                if self._valid_issuer(name) or name in self.departed:  # (one forgotten since: gone)
                    level = new.workers if name.startswith("worker ") else new.activators
                    holders.setdefault(name, Holder(level.get(name, {}).get(pod, 0), gained))
        return holders

    def _plan(
        self,
        service: str,
        old: Shares,
        new: Shares,
        now: float,
        deadline: float | None,
    ) -> None:
        assert old.mine is not None and new.mine is not None
        for pod, share in new.mine.items():
            gained = share - old.mine.get(pod, 0)
            holders = self._holders(service, old, new, pod, gained)
            cap = (
                max(0, gained)
                + _vanished(old.activators, new.activators, pod)
                + _vanished(old.workers, new.workers, pod)
            )
            self.handovers.plan(service, pod, share, holders, now, deadline, cap)
        for pod in set(old.mine) - set(new.mine):
            self.handovers.plan(service, pod, 0, {}, now, deadline)

    # -- events ------------------------------------------------------------------------

    def view_received(self, issuer: str, view: PodCounts, services: Iterable[ServiceConfig], now: float) -> set[str]:
        """A check came in with ``issuer``'s view of our shares: the services to re-apply."""
        if not self._valid_issuer(issuer) or self.views.get(issuer) == view:
            return set()
        before = self.views.get(issuer, {})
        self.views[issuer] = view
        for service_name, caps in before.items():
            now_caps = view.get(service_name, {})
            for pod, cap in caps.items():
                if pod in now_caps and now_caps[pod] > cap:  # (a pod left out is not lifted: gone)
                    self.lifted.setdefault((service_name, pod), set()).add(issuer)
        changed: set[str] = set()
        grace = self.config.grace_period if self.config is not None else 0.0
        for service in services:
            old = self.shares.get(service.name)
            if old is None:
                continue
            new = self._divide(service)
            self.shares[service.name] = new  # (capped_by may change with the same share)
            if old.mine == new.mine:
                continue
            if old.mine is not None and new.mine is not None:
                deadline = None if service.request_timeout is None else now + service.request_timeout + grace
                self._plan(service.name, old, new, now, deadline)
            changed.add(service.name)
        return changed

    def checked(
        self,
        peer: str,
        asked_at: float,
        answer: Answer | None,
        error: str,
        now: float,
        refused: bool = False,
        forwarding: bool = False,
    ) -> set[str]:
        """Our check of ``peer`` (or a request ``forwarding`` there) was answered, or not
        (``refused``: nothing listens there, so nothing of its runs): the services to
        re-apply."""
        health = self.health.get(peer)
        if answer is None:
            if health is not None:
                config = self.config
                unhealthy_after = config.activators.unhealthy_after if config and config.activators else 3
                old = health.state
                # A refused port: no activator listens there, down at once, once it had
                # been up or a request found it so (a check at our start may come before
                # the peer listens: that one counts as any unanswered check).
                at_once = refused and (forwarding or health.state is PeerState.UP)
                if health.unanswered(error, now, 1 if at_once else unhealthy_after):
                    self.changes.append(PeerChange(peer, old, health.state, error))
            if not refused:
                return set()
            released = self.handovers.answered(peer, {}, asked_at)
            if peer in self.departed and peer not in self.handovers.waiting_on():
                del self.departed[peer]  # it left and is not running
                self.health.pop(peer, None)
            return released
        if health is not None:
            old = health.state
            if health.answered(answer, now):
                self.changes.append(PeerChange(peer, old, health.state, "answered"))
        if not answer.listed:
            return set()  # its counts follow an older file: they release nothing
        released = self.handovers.answered(peer, answer.in_use, asked_at)
        idle = not any(n for pods in answer.in_use.values() for n in pods.values())
        if peer in self.departed and peer not in self.handovers.waiting_on() and idle:
            del self.departed[peer]  # it left and runs nothing of ours: done with it
            self.health.pop(peer, None)
        return released

    def expire(self, now: float) -> set[str]:
        """Hand-overs waited out: the services to re-apply. Leavers waited out go (nobody
        waits on them any more)."""
        released = self.handovers.expire(now)
        waited_on = self.handovers.waiting_on()
        for peer, departed in list(self.departed.items()):
            if peer not in waited_on and departed.until is not None and now >= departed.until:
                del self.departed[peer]
                self.health.pop(peer, None)
        return released

    def take_changes(self) -> list[PeerChange]:
        changes, self.changes = self.changes, []
        return changes

    # -- forwards ----------------------------------------------------------------------

    def forward_target(self, service: str, capacity_spent: bool) -> Forward | None:
        """Where a request of ``service`` goes instead of queueing here (None: here).
        Raises PeerUnavailable when only down peers own its slots."""
        shares = self.shares.get(service)
        if shares is None or shares.mine is None:
            return None
        if not shares.activator_owns and shares.owners:
            for name in shares.owners:
                health = self.health.get(name)
                if health is not None and health.usable:
                    return Forward(health.address, name)
            raise PeerUnavailable(f"every owner of {service}'s slots is down")
        if capacity_spent:
            if self.held_slots(service) and not shares.capped_by:
                return None  # our slots are on their way (a hand-over): they are waited for
            # The owners first, then any peer that reported usable slots of it (one whose
            # view took ours, while our file says they are ours).
            others = [name for name in sorted(self.health) if name not in shares.owners]
            for name in (*shares.owners, *others):
                health = self.health.get(name)
                usable = health is not None and health.state is PeerState.UP and name not in self.departed
                if usable and health is not None and health.has_capacity(service):
                    return Forward(health.address, name)
        return None

    # -- checks ------------------------------------------------------------------------

    def check_targets(self, worker_addresses: tuple[str, ...]) -> list[CheckTarget]:
        """Whom to check, each with our view of its shares."""
        targets: list[CheckTarget] = []
        peers = self.config.activators if self.config is not None else None
        for name, health in sorted(self.health.items()):
            view = {s: self._view_of(shares.pods, shares.activators.get(name, {})) for s, shares in self.shares.items()}
            departed = self.departed.get(name)
            if departed is not None:
                sender, secret = departed.name, departed.secret
            else:
                sender, secret = self.me, peers.secret if peers is not None else None
            limited = _limited(view, self.shares)
            targets.append(CheckTarget(name, health.address, ACTIVATOR_SCOPE, limited, sender, secret))
        for index, address in enumerate(worker_addresses):
            name = worker_name(index)
            if index == self.worker_index:
                continue
            view = {s: self._view_of(shares.pods, shares.workers.get(name, {})) for s, shares in self.shares.items()}
            targets.append(CheckTarget(name, address, WORKER_SCOPE, _limited(view, self.shares), self.me_worker))
        return targets

    @staticmethod
    def _view_of(pods: tuple[str, ...], share: Mapping[str, int]) -> dict[str, int]:
        return {pod: share.get(pod, 0) for pod in pods}

    # -- views -------------------------------------------------------------------------

    def snapshot_peers(self, now: float) -> dict[str, Any]:
        return {name: dict(h.snapshot(now), departed=name in self.departed) for name, h in sorted(self.health.items())}

    def snapshot_service(self, service: str, now: float) -> dict[str, Any]:
        pending = self.handovers.snapshot(service, now)
        shares = self.shares.get(service)
        forward = None
        if shares is not None and shares.owners and not shares.activator_owns:
            for name in shares.owners:
                health = self.health.get(name)
                if health is not None and health.usable:
                    forward = f"peer {health.address}"
                    break
        return {
            "forward_to": forward,
            "handover": pending,
            "handover_slots": sum(p["slots"] for p in pending),
            "capped_by": list(shares.capped_by) if shares is not None else [],
        }


def _longest_life(config: Config, now: float) -> float | None:
    """Until when a request started now may run, in any service (None: no limit)."""
    lives = [service.request_timeout for service in config.services.values()]
    if any(life is None for life in lives):
        return None
    return now + max((life for life in lives if life is not None), default=0.0) + config.grace_period


def _vanished(before: Mapping[str, Mapping[str, int]], after: Mapping[str, Mapping[str, int]], pod: str) -> int:
    """How many fewer slots of ``pod`` the holders have in all (a cc that fell, a share of
    ours that fell among our workers; 0 when the pod is gone: nobody uses it)."""
    total_before = sum(shares.get(pod, 0) for shares in before.values())
    total_after = sum(shares.get(pod, 0) for shares in after.values())
    return max(0, total_before - total_after) if total_after else 0


def _below(own: Mapping[str, int], caps: Mapping[str, Mapping[str, int]]) -> tuple[str, ...]:
    """The issuers whose views give some pod less than ``own``."""
    return tuple(issuer for issuer, cap in caps.items() if any(cap.get(pod, n) < n for pod, n in own.items()))


def _limited(view: dict[str, dict[str, int]], shares: Mapping[str, Shares]) -> dict[str, dict[str, int]]:
    """Only the services with divided slots."""
    return {service: pods for service, pods in view.items() if shares[service].mine is not None}

"""Activators (and workers) that check each other: proof, health, and slots handed over.

Each process checks every other holder of slots of the same pods, its *peers*: the other
activators of ``activators.peers`` (and, with ``workers: N``, its sibling workers), every
``activators.interval``, over the peer endpoint (``POST /.activator/peer`` on the proxy
port; a worker's private port for siblings). One check carries the checker's *view*:
what it believes the checked one's share of every limited pod is; the answer carries the
checked one's *in use* count of each of those pods (its requests running on them, slots
it lent included) and its usable capacity per service. This module decides:

- **Proof.** A check and its answer carry ``Activator-Peer: NAME TIME MAC``, the MAC an
  HMAC-SHA256 with the shared secret over the name, the time and the body; one more than
  ``MAX_CLOCK_SKEW`` seconds off, or with another MAC, is refused (``verify``). Clients
  cannot use the endpoint.
- **Views cap.** A process never uses more of a pod than the smallest share any current
  peer's view gives it (``capped``): a peer that has a newer file (a peer added: its
  share comes out of ours) is obeyed before our own file catches up, and one being
  removed, which never gets the new file, obeys the others. A peer's latest view
  replaces its previous one; the views of processes no longer listed are dropped.
- **Hand-over.** Before a slot of a pod is used, what every holder may run on it adds
  up to less than its cc (``HandOvers``): a holder whose share of the pod shrank (a slot
  moved away, or vanished with a lower cc), that left the file, or whose cap lifted may
  still run requests above its new share until it answers a check made after the
  change; the slots that came here (and those that vanished) are held until its answer
  shows ``in use <= its share now`` (fewer in use releases as many). A peer whose port
  refuses runs nothing: that is an answer. A peer that cannot be asked is waited out:
  the longest life a request on the slot can have (``request_timeout`` plus the grace
  period); without a ``request_timeout`` only an answer releases it. A new pod and a
  higher cc need no hand-over; a process that starts waits for its peers and siblings.
- **Health.** A peer that does not answer ``unhealthy_after`` checks in a row is
  ``down``; one answer brings it back ``up`` (``PeerHealth``). Its slots are not taken
  over while it is down (a network split would overload the pods): removing it from the
  file does that, under the hand-over rule.

Pure: no I/O; time is passed in.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: The endpoint's path on the proxy port (a worker's private port for its siblings).
PEER_PATH = b"/.activator/peer"
#: The header that proves a check (and its answer) came from a peer.
PROOF_HEADER = b"activator-peer"
#: How far a peer's clock may be from ours (seconds) before its proof is refused.
MAX_CLOCK_SKEW = 300

#: {service: {pod address: slots}}
PodCounts = Mapping[str, Mapping[str, int]]


class PeerAuthError(Exception):
    """A check or an answer whose proof does not hold."""


def _mac(secret: str, name: str, stamp: int, body: bytes) -> str:
    message = b"%s\n%d\n" % (name.encode(), stamp) + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def prove(secret: str, name: str, now: float, body: bytes) -> bytes:
    """The ``Activator-Peer`` value for ``body`` sent by ``name`` at ``now`` (wall clock)."""
    stamp = int(now)
    return f"{name} {stamp} {_mac(secret, name, stamp, body)}".encode()


def verify(secret: str, proof: bytes | None, body: bytes, now: float) -> str:
    """The sender's name, if ``proof`` holds for ``body``; raises PeerAuthError."""
    if proof is None:
        raise PeerAuthError("no Activator-Peer header")
    try:
        # (a sibling worker's name has a space: "worker 1")
        name, stamp_text, mac = proof.decode("ascii").rsplit(" ", 2)
        stamp = int(stamp_text)
    except (UnicodeDecodeError, ValueError):
        raise PeerAuthError("a malformed Activator-Peer header") from None
    if abs(now - stamp) > MAX_CLOCK_SKEW:
        raise PeerAuthError(f"a proof {now - stamp:+.0f} s off this clock")
    if not hmac.compare_digest(mac, _mac(secret, name, stamp, body)):
        raise PeerAuthError("a proof that does not match (another secret?)")
    return name


# -- checks ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One check: from ``sender`` (a peer's name, or ``worker N``), ``scope`` ``activator``
    (the whole activator answers) or ``worker`` (just the one process), with the
    sender's ``view`` of the checked one's shares."""

    sender: str
    scope: str
    view: PodCounts


@dataclass(frozen=True)
class Answer:
    """A check's answer: the checked one's in-use count of each pod in the view, and its
    usable capacity per service (None: unlimited). ``listed``: the checker is in the
    answerer's file (so the answerer applied its view, and its counts follow the same
    division); a count from one that does not list the checker releases no hand-over:
    it may start another request on the slot by its older file right after answering."""

    name: str
    in_use: PodCounts
    capacity: Mapping[str, int | None]
    listed: bool = True


ACTIVATOR_SCOPE = "activator"
WORKER_SCOPE = "worker"


def encode_check(check: Check) -> bytes:
    return json.dumps({"sender": check.sender, "scope": check.scope, "view": check.view}).encode()


def decode_check(body: bytes) -> Check:
    """Raises ValueError for anything but a check."""
    data = _json_object(body)
    view = _pod_counts(data.get("view"))
    sender, scope = data.get("sender"), data.get("scope")
    if not isinstance(sender, str) or scope not in (ACTIVATOR_SCOPE, WORKER_SCOPE):
        raise ValueError("a check needs a sender and a scope")
    return Check(sender, scope, view)


def encode_answer(answer: Answer) -> bytes:
    return json.dumps(
        {"name": answer.name, "in_use": answer.in_use, "capacity": answer.capacity, "listed": answer.listed}
    ).encode()


def decode_answer(body: bytes) -> Answer:
    """Raises ValueError for anything but an answer."""
    data = _json_object(body)
    capacity = data.get("capacity")
    name = data.get("name")
    if not isinstance(name, str) or not isinstance(capacity, dict):
        raise ValueError("an answer needs a name and capacities")
    for value in capacity.values():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError("a capacity is a count or null")
    listed = data.get("listed", True)
    if not isinstance(listed, bool):
        raise ValueError("listed is true or false")
    return Answer(name, _pod_counts(data.get("in_use")), capacity, listed)


def merge_answers(name: str, answers: Iterable[Answer]) -> Answer:
    """One activator's answer from its workers' (counts and capacities summed)."""
    in_use: dict[str, dict[str, int]] = {}
    capacity: dict[str, int | None] = {}
    listed = True
    for answer in answers:
        listed = listed and answer.listed
        for service, pods in answer.in_use.items():
            into = in_use.setdefault(service, {})
            for pod, n in pods.items():
                into[pod] = into.get(pod, 0) + n
        for service, slots in answer.capacity.items():
            total = capacity.get(service, 0)
            capacity[service] = None if slots is None or total is None else total + slots
    return Answer(name, in_use, capacity, listed)


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        raise ValueError("not JSON") from None
    except RecursionError:  # a body nested too deeply for the parser
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def _pod_counts(value: object) -> dict[str, dict[str, int]]:
    if not isinstance(value, dict):
        raise ValueError("counts must be a mapping of service to pod counts")
    counts: dict[str, dict[str, int]] = {}
    for service, pods in value.items():
        if not isinstance(service, str) or not isinstance(pods, dict):
            raise ValueError("counts must be a mapping of service to pod counts")
        for pod, n in pods.items():
            if not isinstance(pod, str) or not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError("a pod count is a non-negative integer")
        counts[service] = dict(pods)
    return counts


# -- views -----------------------------------------------------------------------------


def capped(own: Mapping[str, int], caps: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """``own`` shares, each pod at most what any of ``caps`` gives it."""
    result = dict(own)
    for cap in caps:
        for pod, limit in cap.items():
            if pod in result and limit < result[pod]:
                result[pod] = limit
    return result


# -- health ----------------------------------------------------------------------------


class PeerState(enum.Enum):
    UNKNOWN = "unknown"  # not checked yet
    UP = "up"
    DOWN = "down"


@dataclass
class PeerHealth:
    """One peer as the checks see it."""

    name: str
    address: str
    state: PeerState = PeerState.UNKNOWN
    failures: int = 0  # checks in a row that got no answer
    since: float = 0.0  # when it entered its state
    last_answer: float | None = None
    last_error: str = ""
    capacity: Mapping[str, int | None] = field(default_factory=dict)

    def answered(self, answer: Answer, now: float) -> bool:
        """A check got ``answer``; True when the state changed."""
        self.failures = 0
        self.last_answer = now
        self.last_error = ""
        self.capacity = answer.capacity
        return self._enter(PeerState.UP, now)

    def unanswered(self, error: str, now: float, unhealthy_after: int) -> bool:
        """A check got no (valid) answer; True when the state changed."""
        self.failures += 1
        self.last_error = error
        if self.failures >= unhealthy_after:
            return self._enter(PeerState.DOWN, now)
        return False

    @property
    def usable(self) -> bool:
        """Forwarded to: not down (a peer not checked yet is trusted, as before checks)."""
        return self.state is not PeerState.DOWN

    def has_capacity(self, service: str) -> bool:
        slots = self.capacity.get(service, 0)
        return slots is None or slots > 0

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "address": self.address,
            "state": self.state.value,
            "failures": self.failures,
            "seconds_in_state": round(now - self.since, 3),
            "last_answer_seconds_ago": None if self.last_answer is None else round(now - self.last_answer, 3),
            "last_error": self.last_error or None,
        }

    def _enter(self, state: PeerState, now: float) -> bool:
        if state is self.state:
            return False
        self.state = state
        self.since = now
        return True


# -- hand-over -------------------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    """A holder a hand-over waits on: the ``share`` of the pod it must be at or under,
    and how many requests above that share it may still run (``excess``) until it
    answers (or is waited out)."""

    share: int
    excess: int


@dataclass
class Wait:
    """One holder of a pending gain: its share and excess (``Holder``), and since when
    (an answer counts only to a check asked after that)."""

    share: int
    excess: int
    since: float


@dataclass
class PendingGain:
    """This process's usable share of ``pod`` (``share``) and the holders that may still
    run requests on it beyond their own shares: ``slots`` of the share are held, the
    sum of their excesses, at most ``cap`` (what came to us, plus the slots that
    vanished: see ``HandOvers``) and at most the share."""

    service: str
    pod: str
    share: int
    cap: int
    since: float
    deadline: float | None
    waiting_on: dict[str, Wait]

    @property
    def slots(self) -> int:
        return min(self.share, self.cap, sum(wait.excess for wait in self.waiting_on.values()))

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "pod": self.pod,
            "slots": self.slots,
            "waiting_on": sorted(self.waiting_on),
            "seconds_waiting": round(now - self.since, 3),
            "seconds_left": None if self.deadline is None else round(max(0.0, self.deadline - now), 3),
        }


class HandOvers:
    """The slots of this process's shares that wait for other holders (see the module
    docstring). Keyed by (service, pod).

    The rule: before a slot of a pod is used, what every holder may run on it adds up
    to less than its cc. This process's share and the others' shares add up to the cc
    (exact cover); each holder whose share is smaller than it was, that left, or whose
    view capped ours and lifted, may still run up to ``excess`` requests above its share
    until it answers. What they may run beyond their shares is held by the processes
    that gained those slots (each holds at most its gain), and, when the pod's slots
    are fewer than before (a cc that falls), the slots that vanished are held by every
    remaining holder (none of them knows which of the others' requests end first).
    ``slots`` of ours are held until the holders' answers bring their excesses to zero,
    or the deadline (the longest life of a request) passes.
    """

    def __init__(self) -> None:
        self.pending: dict[tuple[str, str], PendingGain] = {}

    def plan(
        self,
        service: str,
        pod: str,
        share: int,
        holders: Mapping[str, Holder],
        now: float,
        deadline: float | None,
        cap: int | None = None,
    ) -> None:
        """Our usable share of ``pod`` is now ``share``; ``holders`` (new ones, or ones
        whose share fell again) may run requests above theirs until they answer a check
        asked after ``now``, and ``cap`` more of our share waits for them (None: all of
        it). Holders already waited on keep their place, whatever our share meanwhile; the
        deadline is the later one."""
        key = (service, pod)
        holders = {name: holder for name, holder in holders.items() if holder.excess > 0}
        more = share if cap is None else cap
        gain = self.pending.get(key)
        if gain is None:
            if more <= 0 or not holders:
                return
            gain = self.pending[key] = PendingGain(service, pod, share, 0, now, deadline, {})
        elif holders:
            gain.deadline = None if gain.deadline is None or deadline is None else max(gain.deadline, deadline)
        if holders:
            gain.cap += max(0, more)
        gain.share = share
        for name, holder in holders.items():
            wait = gain.waiting_on.get(name)
            excess = holder.excess if wait is None else max(wait.excess, holder.excess)
            gain.waiting_on[name] = Wait(holder.share, excess, now)
        # (a share that fell to nothing keeps its waits: the holders may still run requests
        # on the pod when it comes back, by a cap that lifts or a file)

    def answered(self, peer: str, in_use: PodCounts, asked_at: float) -> set[str]:
        """``peer`` answered a check made at ``asked_at`` (it applied that check's view
        first, so it starts nothing beyond its share from then on): the services with
        slots released."""
        released: set[str] = set()
        for key, gain in list(self.pending.items()):
            wait = gain.waiting_on.get(peer)
            if wait is None or asked_at < wait.since:
                continue
            held = gain.slots
            running = in_use.get(gain.service, {}).get(gain.pod, 0)
            wait.excess = min(wait.excess, max(0, running - wait.share))
            if wait.excess == 0:
                del gain.waiting_on[peer]
            if not gain.waiting_on:
                del self.pending[key]
            if gain.slots < held or key not in self.pending:
                released.add(gain.service)
        return released

    def expire(self, now: float) -> set[str]:
        """Waited out: the services with slots released."""
        released: set[str] = set()
        for key, gain in list(self.pending.items()):
            if gain.deadline is not None and now >= gain.deadline:
                del self.pending[key]
                released.add(gain.service)
        return released

    def held(self, service: str, pod: str) -> int:
        gain = self.pending.get((service, pod))
        return gain.slots if gain is not None else 0

    def waiting_on(self) -> set[str]:
        return {peer for gain in self.pending.values() for peer in gain.waiting_on}

    def snapshot(self, service: str, now: float) -> list[dict[str, Any]]:
        return [gain.snapshot(now) for (name, _), gain in sorted(self.pending.items()) if name == service]

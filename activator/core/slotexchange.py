"""One queue per activator across its worker processes: slots offered, waiters served in order.

With ``workers: N > 1`` each worker owns its share of every pod's slots and serves a
request on one of them at once when it has a free one and nobody of the service waits
anywhere. Otherwise the request waits here, in the supervisor, in the service's one
queue, and slots come to it. This module decides who gets which slot:

- **One queue per service**, ordered by arrival time (the workers' monotonic clocks are
  the machine's one clock), whichever worker the request came to. ``queue_depth`` bounds
  the activator's queue, not a worker's (``Full``).
- **Contended.** While a service has anyone waiting here it is *contended*: every worker
  is told (``Contended``) and then serves nothing of it locally; it lends this exchange
  every slot of the service that is free or frees (``offer``). ``Contended(False)`` when
  the queue empties. So no pod has a free slot in one worker while a request of its
  service waits in another, within the time one message takes.
- **Offers.** ``offer`` matches a slot with the oldest waiter (``Lend`` to the waiter's
  worker: the slot stays its owner's, lent for one request) or, when nobody waits,
  gives it back (``Decline`` to the owner, which frees it). A borrower that is done
  offers the slot again (it may go straight to the next waiter, owner unchanged).
- **First in line stays home.** Each worker with waiters of a contended service is told
  when the oldest waiter of the *other* workers changes (``Oldest``). A slot that frees
  in a worker (its own, or one it borrowed) goes straight to that worker's oldest
  waiter when that one arrived first (no older one waits elsewhere, as far as the last
  ``Oldest`` says), and the exchange hears ``Cancel`` for it: the hand-off crosses no
  process. Otherwise the slot is offered. The order is the one queue's within one
  message's delay; a ``Lend`` that crosses such a ``Cancel`` is offered again.
- A waiter that gives up (timeout, client gone) is ``cancel``\\ led; a grant that crossed
  its cancel is offered again by the waiter's worker.
- **Classes and tenants.** A service with ``priority`` or ``fair_by`` has its one queue
  here ordered by the same ``core.waitqueue.WaitQueue`` as a worker's: ``Enqueue``
  carries the request's class, tenant and the service's ``QueuePolicy``; a full queue
  sheds (``Shed`` to the victim's worker) or refuses (``Full``, with its reason).
  Such a queue is not ordered by arrival alone, so no ``Oldest`` is sent for it: every
  slot that frees is offered here, and the exchange picks the waiter.
- **Loans outlive their worker's crash.** A worker that ends takes its waiters with it
  and its borrowed slots go back to their owners (``forget_worker``); the slots it had
  lent stay out until their borrowers are done, and its next incarnation is told which
  (``reserved``), so that it does not use them meanwhile.

Each worker's side is a ``WorkerLedger``: its requests waiting here, the slots it lent,
the services it was told are contended, and what it does with each message (a grant to
a request that gave up is offered again; a declined slot is freed; a request whose
service left shared mode is redirected, and cancelled here).

Nothing here yields or does I/O; every call returns the messages to send (effects out).
``encode`` and ``decode`` spell messages (both ways) as datagrams.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import QueueFull, TenantQueueFull
from .events import TransportFailure
from .failures import FailureKind
from .throttler import NO_EFFECTS, Effects, EffectsCollector, Grant, ServiceThrottler
from .waitqueue import Queued, QueuePolicy, WaitQueue


@dataclass(frozen=True)
class Lend:
    """To ``worker``: its request ``request`` may use ``slot`` of ``owner`` on ``pod``."""

    worker: int
    request: int
    service: str
    owner: int
    slot: int
    pod: str


@dataclass(frozen=True)
class Decline:
    """To ``owner``: nobody waits for ``slot``; free it (``failed``: its borrower's request
    met a transport failure on the pod, which the owner records)."""

    owner: int
    service: str
    slot: int
    failed: str | None = None


@dataclass(frozen=True)
class Full:
    """To ``worker``: the service's queue is full (or the tenant's share of it); answer
    ``request`` 503 with ``reason`` (queue-full, tenant-queue-full)."""

    worker: int
    request: int
    reason: str = "queue-full"


@dataclass(frozen=True)
class Shed:
    """To ``worker``: a higher class took the place of ``request`` in the full queue."""

    worker: int
    request: int


@dataclass(frozen=True)
class Contended:
    """To every worker: ``service`` has waiters here (``True``) or none any more."""

    service: str
    contended: bool


@dataclass(frozen=True)
class Reserved:
    """To a worker that (re)started: ``slot`` of its previous incarnation on ``pod`` is still
    lent out; hold it until it comes back (``Decline``)."""

    service: str
    slot: int
    pod: str


@dataclass(frozen=True)
class Oldest:
    """To ``worker``: the oldest request of ``service`` waiting here from the other
    workers arrived at ``arrival`` (None: none waits)."""

    worker: int
    service: str
    arrival: float | None


Message = Lend | Decline | Full | Shed | Contended | Reserved | Oldest


# -- what workers send --------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """From a worker that (re)started."""

    worker: int


@dataclass(frozen=True)
class Enqueue:
    """From ``worker``: its request waits (``arrival``: monotonic seconds); of class
    ``klass`` and ``tenant`` under ``policy`` (``QueuePolicy``'s fields in order; None:
    one FIFO)."""

    worker: int
    service: str
    request: int
    arrival: float
    queue_depth: int
    klass: int = 0
    tenant: str | None = None
    policy: list[Any] | None = None


@dataclass(frozen=True)
class Cancel:
    """From ``worker``: its request gave up."""

    worker: int
    service: str
    request: int


@dataclass(frozen=True)
class Offer:
    """From any worker: ``slot`` of ``owner`` on ``pod`` is free (``failed``: the borrower's
    request met this transport failure kind on the pod)."""

    service: str
    owner: int
    slot: int
    pod: str
    failed: str | None = None


Request = Hello | Enqueue | Cancel | Offer

_KINDS: dict[str, type] = {
    kind.__name__: kind
    for kind in (Lend, Decline, Full, Shed, Contended, Reserved, Oldest, Hello, Enqueue, Cancel, Offer)
}


def encode(message: Message | Request) -> bytes:
    """One message as one datagram: a JSON list, its kind first, then its fields in order."""
    return json.dumps([type(message).__name__, *(getattr(message, f.name) for f in fields(message))]).encode()


def decode(data: bytes) -> Message | Request:
    """The message of one datagram; raises ValueError for anything else."""
    try:
        kind, *values = json.loads(data)
        message: Message | Request = _KINDS[kind](*values)
    except (TypeError, KeyError, ValueError) as error:
        raise ValueError(f"not a slot exchange message: {data[:100]!r}") from error
    return message


@dataclass(frozen=True)
class Loan:
    """A slot lent out: who owns it and on which pod."""

    owner: int
    service: str
    slot: int
    pod: str


Entry = tuple[float, int, int, int]  # (arrival, sequence, worker, request)


class _Classed(Queued):
    """A waiter of a service with classes or tenants, in its ``WaitQueue``."""

    __slots__ = ("key",)

    def __init__(self, key: tuple[int, int], arrival: float, klass: int, tenant: str | None) -> None:
        super().__init__(arrival, klass, tenant)
        self.key = key  # (worker, request)


def policy_fields(policy: QueuePolicy) -> list[Any] | None:
    """A ``QueuePolicy`` as ``Enqueue`` carries it (None: one FIFO)."""
    if policy.plain:
        return None
    return [getattr(policy, f.name) for f in fields(policy)]


@dataclass
class _Queue:
    # With classes or tenants: the live waiters in their order (``heap`` and
    # ``by_worker`` stay empty, ``live`` maps to each waiter's entry there).
    ordered: WaitQueue | None = None
    # Heaps of entries; entries of waiters gone stay until they surface.
    heap: list[Entry] = field(default_factory=list)
    by_worker: dict[int, list[Entry]] = field(default_factory=dict)
    # (worker, request) -> its entry, for the live waiters only.
    live: dict[tuple[int, int], Entry | _Classed] = field(default_factory=dict)
    # worker -> the last ``Oldest`` arrival it was told (workers with waiters only).
    told: dict[int, float | None] = field(default_factory=dict)

    def push(self, entry: Entry) -> None:
        heapq.heappush(self.heap, entry)
        heapq.heappush(self.by_worker.setdefault(entry[2], []), entry)
        self.live[(entry[2], entry[3])] = entry

    def oldest(self) -> Entry | None:
        return self._top(self.heap)

    def oldest_of(self, worker: int) -> Entry | None:
        heap = self.by_worker.get(worker)
        entry = self._top(heap) if heap is not None else None
        if entry is None:
            self.by_worker.pop(worker, None)
        return entry

    def _top(self, heap: list[Entry]) -> Entry | None:
        live = self.live
        while heap:
            entry = heap[0]
            if live.get((entry[2], entry[3])) is entry:
                return entry
            heapq.heappop(heap)
        return None


class SlotExchange:
    """The supervisor's queues and loans (see the module docstring). Does not yield."""

    def __init__(self) -> None:
        self._queues: dict[str, _Queue] = {}
        self._sequence = 0
        # (owner, slot) -> (loan, borrowing worker or None while offered but not taken)
        self._loans: dict[tuple[int, int], tuple[Loan, int | None]] = {}

    def receive(self, message: Request, now: float = -math.inf) -> list[tuple[int | None, Message]]:
        """Apply one worker's message; what to send to whom (None: every worker). ``now``
        is for a queue's starvation bound (without it, nobody counts as starving)."""
        if isinstance(message, Enqueue):
            if message.policy is not None:
                out = self.enqueue_classed(message, QueuePolicy(*message.policy))
            else:
                out = self.enqueue(
                    message.service, message.worker, message.request, message.arrival, message.queue_depth
                )
        elif isinstance(message, Cancel):
            out = self.cancel(message.service, message.worker, message.request)
        elif isinstance(message, Offer):
            out = self.offer(message.service, message.owner, message.slot, message.pod, message.failed, now)
        else:
            greeting: list[Message] = [Contended(service, True) for service in self.contended_services()]
            greeting += [Reserved(loan.service, loan.slot, loan.pod) for loan in self.reserved(message.worker)]
            return [(message.worker, m) for m in greeting]
        return [(recipient(m), m) for m in out]

    # -- a worker's requests ------------------------------------------------------

    def enqueue(self, service: str, worker: int, request: int, arrival: float, queue_depth: int) -> list[Message]:
        """A request that ``worker`` could not serve at once waits here (in arrival order)."""
        queue = self._queues.get(service)
        if queue is None:
            queue = self._queues[service] = _Queue()
        if (worker, request) in queue.live:
            return []
        if len(queue.live) >= queue_depth:
            return [Full(worker, request)]
        self._sequence += 1
        queue.push((arrival, self._sequence, worker, request))
        contended: list[Message] = [Contended(service, True)] if len(queue.live) == 1 else []
        return contended + self._tell_oldest(service, queue)

    def enqueue_classed(self, message: Enqueue, policy: QueuePolicy) -> list[Message]:
        """``enqueue`` for a service with classes or tenants: the service's ``WaitQueue``
        decides (it may shed a waiter, of any worker, or refuse)."""
        service, key = message.service, (message.worker, message.request)
        queue = self._queues.get(service)
        if queue is None:
            queue = self._queues[service] = _Queue(ordered=WaitQueue(policy, message.queue_depth))
        if key in queue.live:
            return []
        ordered = queue.ordered
        if ordered is None:  # a FIFO queue that got a policy (a reload): it keeps its order until empty
            return self.enqueue(service, message.worker, message.request, message.arrival, message.queue_depth)
        ordered.reshape(policy, message.queue_depth)
        waiter = _Classed(key, message.arrival, min(message.klass, policy.classes - 1), message.tenant)
        try:
            shed = ordered.push(waiter)
        except TenantQueueFull as refused:
            return [Full(message.worker, message.request, refused.reason)]
        except QueueFull:
            return [Full(message.worker, message.request)]
        queue.live[key] = waiter
        out: list[Message] = [Contended(service, True)] if len(queue.live) == 1 else []
        if shed is not None:
            assert isinstance(shed, _Classed)
            del queue.live[shed.key]
            out.append(Shed(*shed.key))
        return out

    def cancel(self, service: str, worker: int, request: int) -> list[Message]:
        """The request gave up, or took a slot in its worker (first in line there). If it
        was granted here meanwhile, its worker offers the slot again."""
        queue = self._queues.get(service)
        if queue is None:
            return []
        entry = queue.live.pop((worker, request), None)
        if entry is None:
            return []
        if isinstance(entry, _Classed) and queue.ordered is not None:
            queue.ordered.remove(entry)
        return self._tell_oldest(service, queue) + self._maybe_uncontended(service, queue)

    # -- slots ------------------------------------------------------------------

    def offer(
        self, service: str, owner: int, slot: int, pod: str, failed: str | None = None, now: float = -math.inf
    ) -> list[Message]:
        """A slot of ``owner`` on ``pod``, free now: to the next waiter (the oldest, or the
        one a classed queue picks at ``now``), else back to its owner."""
        key = (owner, slot)
        queue = self._queues.get(service)
        if failed is not None or queue is None or not queue.live:
            self._loans.pop(key, None)
            return [Decline(owner, service, slot, failed)]
        if queue.ordered is not None:
            picked = queue.ordered.pop(now)
            assert isinstance(picked, _Classed)
            worker, request = picked.key
        else:
            entry = queue.oldest()
            assert entry is not None
            _, _, worker, request = entry
            heapq.heappop(queue.heap)
        del queue.live[(worker, request)]
        if worker == owner:
            self._loans.pop(key, None)  # back home: the owner runs it as its own
        else:
            self._loans[key] = (Loan(owner, service, slot, pod), worker)
        lend = Lend(worker, request, service, owner, slot, pod)
        return [lend, *self._tell_oldest(service, queue), *self._maybe_uncontended(service, queue)]

    # -- workers ----------------------------------------------------------------

    def forget_worker(self, worker: int) -> list[Message]:
        """``worker`` ended: its waiters are gone, its borrowed slots go back to their owners."""
        messages: list[Message] = []
        for service, queue in list(self._queues.items()):
            for key in [key for key in queue.live if key[0] == worker]:
                entry = queue.live.pop(key)
                if isinstance(entry, _Classed) and queue.ordered is not None:
                    queue.ordered.remove(entry)
            messages += self._tell_oldest(service, queue)
            messages += self._maybe_uncontended(service, queue)
        for key, (loan, borrower) in list(self._loans.items()):
            if borrower == worker:
                del self._loans[key]
                if loan.owner != worker:
                    messages.append(Decline(loan.owner, loan.service, loan.slot))
        return messages

    def reserved(self, owner: int) -> list[Loan]:
        """The slots of ``owner`` still lent out (its new incarnation must not use them)."""
        return [loan for loan, _ in self._loans.values() if loan.owner == owner]

    def contended_services(self) -> list[str]:
        """The services with waiters (a worker that (re)starts is told)."""
        return [service for service, queue in self._queues.items() if queue.live]

    # -- views ------------------------------------------------------------------

    def queued(self, service: str) -> int:
        queue = self._queues.get(service)
        return len(queue.live) if queue is not None else 0

    def oldest_arrival(self, service: str) -> float | None:
        queue = self._queues.get(service)
        if queue is not None and queue.ordered is not None:
            return queue.ordered.oldest_arrival()
        entry = queue.oldest() if queue is not None else None
        return entry[0] if entry is not None else None

    def waiting(self, service: str) -> WaitQueue | None:
        """The classed queue of ``service`` (its views, for /status), if it has one."""
        queue = self._queues.get(service)
        return queue.ordered if queue is not None else None

    def lent(self) -> int:
        return len(self._loans)

    def check_invariants(self) -> None:
        for service, queue in self._queues.items():
            if not queue.live:
                raise AssertionError(f"{service}: an empty queue kept")
            if queue.ordered is not None:
                queue.ordered.check_invariants()
                if sorted(queue.live) != sorted(w.key for w in queue.ordered if isinstance(w, _Classed)):
                    raise AssertionError(f"{service}: the live waiters are not the queue's")
                continue
            for key, entry in queue.live.items():
                if isinstance(entry, _Classed) or (entry[2], entry[3]) != key:
                    raise AssertionError(f"{service}: waiter {key} filed as {entry}")
            if len(queue.heap) < len(queue.live):
                raise AssertionError(f"{service}: a live waiter missing from the heap")
            if sum(len(heap) for heap in queue.by_worker.values()) < len(queue.live):
                raise AssertionError(f"{service}: a live waiter missing from its worker's heap")

    def _tell_oldest(self, service: str, queue: _Queue) -> list[Message]:
        """``Oldest`` for each worker with waiters whose others' oldest changed."""
        heads: dict[int, float] = {}
        for worker in list(queue.by_worker):
            entry = queue.oldest_of(worker)
            if entry is not None:
                heads[worker] = entry[0]
        told = queue.told
        for worker in [w for w in told if w not in heads]:
            del told[worker]  # (told again once it has waiters again)
        # The others' oldest is the oldest head, except for its own worker: the next one.
        ranked = heapq.nsmallest(2, heads.items(), key=lambda item: item[1])
        out: list[Message] = []
        for worker in heads:
            others = next((arrival for w, arrival in ranked if w != worker), None)
            if worker not in told or told[worker] != others:
                told[worker] = others
                out.append(Oldest(worker, service, others))
        return out

    def _maybe_uncontended(self, service: str, queue: _Queue) -> list[Message]:
        if queue.live:
            return []
        del self._queues[service]
        return [Contended(service, False)]


def recipient(message: Message) -> int | None:
    """The worker a message is for (None: every worker)."""
    if isinstance(message, Lend | Full | Shed | Oldest):
        return message.worker
    if isinstance(message, Decline):
        return message.owner
    return None


# -- a worker's side -----------------------------------------------------------------------


@dataclass(frozen=True)
class Borrowed:
    """A sibling's slot on ``pod``, lent to one request of this worker."""

    service: str
    owner: int
    slot: int
    pod: str


class Redirect:
    """The outcome of a wait whose service left shared mode: queue in the worker again."""


class QueueIsFull:
    """The outcome of a wait the exchange refused (``Full``), with its reason."""

    def __init__(self, reason: str = "queue-full") -> None:
        self.reason = reason


class WasShed:
    """The outcome of a wait whose place a higher class took (``Shed``)."""


Outcome = Borrowed | Grant | Redirect | QueueIsFull | WasShed


class Waiting:
    """A request of this worker queued at the exchange; ``outcome`` set once decided."""

    __slots__ = ("arrival", "outcome", "request", "service", "token")

    def __init__(self, request: int, service: str, arrival: float) -> None:
        self.request = request
        self.service = service
        self.arrival = arrival
        self.outcome: Outcome | None = None
        #: The shell's handle to wake the request with (the core never touches it).
        self.token: Any = None


@dataclass
class LedgerEffects:
    """What one ledger call asks of the shell: requests to wake (their ``outcome`` is set),
    messages to send, the throttlers' effects, failures to post to the topology writer."""

    woken: list[Waiting] = field(default_factory=list)
    send: list[Request] = field(default_factory=list)
    effects: Effects = NO_EFFECTS
    failures: list[TransportFailure] = field(default_factory=list)


class WorkerLedger:
    """One worker's side of the exchange (see the module docstring). Does not yield."""

    def __init__(self, worker: int, first_slot: int = 1) -> None:
        self.worker = worker
        self._requests = itertools.count(1)
        # Slot ids of this incarnation: a restarted worker starts above its predecessor's.
        self._slots = itertools.count(first_slot)
        self.waiting: dict[int, Waiting] = {}
        #: Slots of ours lent out (or offered): slot id -> (throttler, grant).
        self.lent: dict[int, tuple[ServiceThrottler, Grant]] = {}
        self.contended: set[str] = set()
        #: service -> when the oldest waiter of the other workers arrived (None: none
        #: waits), as the exchange last said (``Oldest``); unknown: not said since this
        #: worker's waiters of it began.
        self.others_oldest: dict[str, float | None] = {}
        # service -> heap of (arrival, request) of this worker's waiters; entries of
        # requests decided or gone stay until they surface.
        self._lines: dict[str, list[tuple[float, int]]] = {}

    def hello(self) -> list[Request]:
        return [Hello(self.worker)]

    # -- requests ---------------------------------------------------------------

    def enqueue(
        self, throttler: ServiceThrottler, arrival: float, klass: int = 0, tenant: str | None = None
    ) -> tuple[Waiting, list[Request]]:
        """A request this worker cannot serve at once waits at the exchange (in ``klass``,
        as ``tenant``, when the service has classes or tenants)."""
        if self._oldest_waiting(throttler.name) is None:
            self.others_oldest.pop(throttler.name, None)  # the exchange tells it anew
        waiting = Waiting(next(self._requests), throttler.name, arrival)
        self.waiting[waiting.request] = waiting
        heapq.heappush(self._lines.setdefault(throttler.name, []), (arrival, waiting.request))
        depth = throttler.config.queue_depth
        policy = policy_fields(throttler.queue.policy)
        if policy is None:
            return waiting, [Enqueue(self.worker, throttler.name, waiting.request, arrival, depth)]
        return waiting, [Enqueue(self.worker, throttler.name, waiting.request, arrival, depth, klass, tenant, policy)]

    def leave(
        self, waiting: Waiting, services: Mapping[str, ServiceThrottler], keep: bool, now: float
    ) -> LedgerEffects:
        """The request stops waiting: with its outcome (``keep``, it goes on with the slot) or
        without (timeout, client gone: a slot that came meanwhile is given back)."""
        out = LedgerEffects()
        if self.waiting.pop(waiting.request, None) is None:
            return out
        outcome = waiting.outcome
        if outcome is None or isinstance(outcome, Redirect):
            out.send.append(Cancel(self.worker, waiting.service, waiting.request))
        elif not keep:
            throttler = services.get(waiting.service)
            if isinstance(outcome, Borrowed):
                out.send.append(Offer(outcome.service, outcome.owner, outcome.slot, outcome.pod))
            elif isinstance(outcome, Grant) and throttler is not None:
                out.effects = throttler.release(outcome, now)
        elif isinstance(outcome, Borrowed):
            throttler = services.get(waiting.service)
            if throttler is not None:
                throttler.borrow(outcome.pod)
        return out

    def borrowed_done(
        self, throttler: ServiceThrottler, slot: Borrowed, tunnel: bool, failed: str | None
    ) -> LedgerEffects:
        """The request on a borrowed slot ended: the slot goes to this worker's first in
        line, else back to the exchange (``failed``: the transport failure its request
        met, for the owner to record: always back)."""
        throttler.give_back(tunnel)
        first = self._first_in_line(slot.service) if failed is None else None
        if first is not None:
            return self._hand(first, slot)
        return LedgerEffects(send=[Offer(slot.service, slot.owner, slot.slot, slot.pod, failed)])

    def _first_in_line(self, service: str) -> Waiting | None:
        """This worker's oldest waiter of ``service``, if no older one waits elsewhere."""
        if service not in self.others_oldest:
            return None  # not told yet: the exchange decides
        first = self._oldest_waiting(service)
        others = self.others_oldest[service]
        return first if first is not None and (others is None or first.arrival <= others) else None

    def _oldest_waiting(self, service: str) -> Waiting | None:
        """This worker's oldest request of ``service`` still waiting for an outcome."""
        line = self._lines.get(service)
        while line:
            waiting = self.waiting.get(line[0][1])
            if waiting is not None and waiting.outcome is None:
                return waiting
            heapq.heappop(line)
        self._lines.pop(service, None)
        return None

    def _hand(self, first: Waiting, outcome: Grant | Borrowed) -> LedgerEffects:
        """``first`` takes the slot here; the exchange hears it left the queue."""
        first.outcome = outcome
        return LedgerEffects(woken=[first], send=[Cancel(self.worker, first.service, first.request)])

    # -- slots of ours ------------------------------------------------------------

    def offer(self, throttler: ServiceThrottler, grant: Grant) -> LedgerEffects:
        """A free slot of ours (``Effects.lent``): to this worker's first in line, else
        lent to the exchange."""
        first = self._first_in_line(throttler.name)
        if first is not None:
            throttler.reclaim(grant)
            return self._hand(first, grant)
        slot = next(self._slots)
        self.lent[slot] = (throttler, grant)
        return LedgerEffects(send=[Offer(throttler.name, self.worker, slot, grant.pod.address)])

    def resync(self, services: Mapping[str, ServiceThrottler]) -> LedgerEffects:
        """After a new configuration: new throttlers learn the flags; requests waiting for a
        service no longer shared are redirected (they queue in the worker again)."""
        out = LedgerEffects()
        collected = EffectsCollector()
        for name in self.contended:
            throttler = services.get(name)
            if throttler is not None and throttler.shared and not throttler.contended:
                collected.add(throttler.set_contended(True))
        for waiting in self.waiting.values():
            throttler = services.get(waiting.service)
            if waiting.outcome is None and (throttler is None or not throttler.shared):
                waiting.outcome = Redirect()
                out.woken.append(waiting)
        out.effects = collected.result()
        return out

    # -- the exchange's messages --------------------------------------------------

    def receive(self, message: Message, services: Mapping[str, ServiceThrottler], now: float) -> LedgerEffects:
        """Apply one message of the exchange."""
        out = LedgerEffects()
        if isinstance(message, Lend):
            waiting = self.waiting.get(message.request)
            if waiting is None or waiting.outcome is not None:  # it crossed a cancel
                out.send.append(Offer(message.service, message.owner, message.slot, message.pod))
            elif message.owner == self.worker and message.slot in self.lent:
                throttler, grant = self.lent.pop(message.slot)  # ours, back to a request of ours
                throttler.reclaim(grant)
                waiting.outcome = grant
                out.woken.append(waiting)
            else:
                waiting.outcome = Borrowed(message.service, message.owner, message.slot, message.pod)
                out.woken.append(waiting)
        elif isinstance(message, Decline):
            entry = self.lent.pop(message.slot, None)
            if entry is not None:
                throttler, grant = entry
                if message.failed is not None:
                    failure = TransportFailure(throttler.name, grant.pod.address, FailureKind(message.failed))
                    out.failures.append(failure)
                out.effects = throttler.release(grant, now)
        elif isinstance(message, Full | Shed):
            waiting = self.waiting.get(message.request)
            if waiting is not None and waiting.outcome is None:
                waiting.outcome = QueueIsFull(message.reason) if isinstance(message, Full) else WasShed()
                out.woken.append(waiting)
        elif isinstance(message, Oldest):
            self.others_oldest[message.service] = message.arrival
        elif isinstance(message, Contended):
            if message.contended:
                self.contended.add(message.service)
            else:
                self.contended.discard(message.service)
                self.others_oldest.pop(message.service, None)
            service = services.get(message.service)
            if service is not None:
                out.effects = service.set_contended(message.contended)
        else:  # Reserved
            service = services.get(message.service)
            if service is not None:
                self.lent[message.slot] = (service, service.reserve(message.pod))
        return out

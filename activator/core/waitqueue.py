"""The wait queue of one service: who is served next, who is refused, who is shed.

A queued request carries its priority class (``klass``: 0 is the highest) and, with
``fair_by``, its tenant. This module decides the order and the limits; it does no I/O
and takes the time as an argument. Rules, each checked by ``check_invariants``:

- **Classes in order.** A freed slot goes to the highest class that has a waiter.
  Within a class, waiters are served in arrival order; with tenants (``fair``), the
  class serves its tenants round-robin, each tenant's own waiters in arrival order.
- **Starvation bound.** With ``max_starvation``, a waiter of a lower class that has
  waited that long goes next (the longest-waiting such waiter first), so that batch
  work still moves under a steady stream of higher-class work. None: strictly by class.
- **Depth.** At most ``depth`` waiters. A full queue admits an arrival of a higher class
  by shedding the youngest waiter of the lowest class below it (``Shed``: the caller
  answers it 503 ``shed``); an arrival with nobody below it is refused (``QueueFull``).
- **Tenant cap.** One tenant holds at most ``tenant_cap`` waiters (``TenantQueueFull``
  past it, while other tenants still queue). Tenants are tracked only while they have
  waiters: at most ``depth`` of them.
- A retried request (its pod connection failed after it waited its turn) goes back to
  the head of its class and tenant (``push_front``), past the limits: it already held
  its place.

Without classes and tenants (``QueuePolicy()``) this is one FIFO: one ordered dict,
today's cost. Every operation is O(1) apart from a scan over the classes (at most 8).
The memory per waiter is its entry in its class's ordered dict (and, with tenants, one
more in its tenant's).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

from .errors import QueueFull, TenantQueueFull


@dataclass(frozen=True)
class QueuePolicy:
    """How a service's queue orders and limits its waiters (from ``priority``/``fair_by``)."""

    #: How many priority classes (1: no classes).
    classes: int = 1
    #: Round-robin between tenants within a class.
    fair: bool = False
    #: Waiters one tenant may hold (None: no cap).
    tenant_cap: int | None = None
    #: A lower-class waiter that waited this long (seconds) goes next; None: strict.
    max_starvation: float | None = None

    @property
    def plain(self) -> bool:
        """One FIFO: no classes, no tenants."""
        return self.classes == 1 and not self.fair


PLAIN = QueuePolicy()


class Queued:
    """What the queue needs of a waiter: its class, its tenant, when it arrived. A
    waiter type subclasses it (``__slots__`` keep the memory per waiter small)."""

    __slots__ = ("enqueued_at", "klass", "tenant")

    def __init__(self, now: float, klass: int = 0, tenant: Hashable | None = None) -> None:
        self.enqueued_at = now
        self.klass = klass
        self.tenant = tenant


class _ClassLine:
    """The waiters of one class: in arrival order, and (fair) per tenant in rotation."""

    __slots__ = ("order", "tenants")

    def __init__(self) -> None:
        # Invariant: every waiter of this class, oldest first.
        self.order: OrderedDict[Queued, None] = OrderedDict()
        # Invariant (fair): the tenants with waiters of this class, next to serve first,
        # each with its waiters oldest first; together exactly the waiters in ``order``.
        self.tenants: OrderedDict[Hashable, OrderedDict[Queued, None]] = OrderedDict()


class WaitQueue:
    """One service's waiters under a ``QueuePolicy`` (see the module docstring). Does not yield."""

    __slots__ = ("_fair", "_lines", "_size", "_tenant_counts", "_tracks_tenants", "depth", "policy")

    def __init__(self, policy: QueuePolicy = PLAIN, depth: int = 100) -> None:
        self._reset(policy, depth)

    def _reset(self, policy: QueuePolicy, depth: int) -> None:
        self.policy = policy
        self.depth = depth
        self._fair = policy.fair
        self._tracks_tenants = policy.fair or policy.tenant_cap is not None
        self._lines = [_ClassLine() for _ in range(policy.classes)]
        # Invariant: the number of waiters.
        self._size = 0
        # Invariant (with tenants): tenant -> its waiters (>= 1), over every class.
        self._tenant_counts: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __contains__(self, item: Queued) -> bool:
        return 0 <= item.klass < len(self._lines) and item in self._lines[item.klass].order

    def __iter__(self) -> Iterator[Queued]:
        """Every waiter, class by class, each class oldest first."""
        for line in self._lines:
            yield from line.order

    # -- changes -------------------------------------------------------------------

    def push(self, item: Queued) -> Queued | None:
        """Queue ``item`` at the end of its class (and tenant). Returns the waiter shed to
        make room (already out of the queue), or None. Raises ``TenantQueueFull`` or
        ``QueueFull``, queueing nothing."""
        policy = self.policy
        if policy.tenant_cap is not None and self._tenant_counts.get(item.tenant, 0) >= policy.tenant_cap:
            raise TenantQueueFull()
        shed = None
        if self._size >= self.depth:
            shed = self._youngest_below(item.klass)
            if shed is None:
                raise QueueFull()
            self.remove(shed)
        self._add(item, front=False)
        return shed

    def push_front(self, item: Queued) -> None:
        """Queue ``item`` first in its class and tenant, past the limits (a retry)."""
        self._add(item, front=True)

    def pop(self, now: float) -> Queued | None:
        """The waiter to serve next, out of the queue (None: nobody waits)."""
        if not self._size:
            return None
        lines = self._lines
        if len(lines) == 1:
            return self._pop_from(lines[0])
        for top in lines:
            if top.order:
                break
        limit = self.policy.max_starvation
        if limit is not None:
            starving = self._longest_starving(top, now - limit)
            if starving is not None:
                self.remove(starving)
                return starving
        return self._pop_from(top)

    def remove(self, item: Queued) -> bool:
        """Take ``item`` out (it gave up); False if it was not queued."""
        if not 0 <= item.klass < len(self._lines):
            return False
        line = self._lines[item.klass]
        if line.order.pop(item, _ABSENT) is _ABSENT:
            return False
        if self._fair:
            mine = line.tenants[item.tenant]
            del mine[item]
            if not mine:
                del line.tenants[item.tenant]
        self._forget(item)
        return True

    def drain(self) -> Iterator[Queued]:
        """Every waiter taken out, in serving order of classes, oldest first."""
        for line in self._lines:
            while line.order:
                item = next(iter(line.order))
                self.remove(item)
                yield item

    def reshape(self, policy: QueuePolicy, depth: int) -> None:
        """A new policy and depth (a reload): the waiters stay, in their order; a class
        that no longer exists sends its waiters to the lowest class. Does not shed."""
        if policy == self.policy:
            self.depth = depth
            return
        items = list(self)
        items.sort(key=lambda item: item.enqueued_at)  # stable: ties keep class order
        self._reset(policy, depth)
        for item in items:
            item.klass = min(item.klass, policy.classes - 1)
            if not policy.fair:
                item.tenant = None
            self._add(item, front=False)

    # -- views -------------------------------------------------------------------

    def oldest_arrival(self) -> float | None:
        """When the longest-waiting waiter arrived (None: nobody waits)."""
        heads = [next(iter(line.order)).enqueued_at for line in self._lines if line.order]
        return min(heads) if heads else None

    def queued_by_class(self) -> list[int]:
        return [len(line.order) for line in self._lines]

    def oldest_by_class(self) -> list[float | None]:
        """Per class, when its longest-waiting waiter arrived (None: none waits)."""
        return [next(iter(line.order)).enqueued_at if line.order else None for line in self._lines]

    def top_tenants(self, n: int) -> list[tuple[Hashable, int]]:
        """The ``n`` tenants with the most waiters, most first."""
        return heapq.nlargest(n, self._tenant_counts.items(), key=lambda item: item[1])

    @property
    def tenants(self) -> int:
        """Tenants with waiters (the tracked ones)."""
        return len(self._tenant_counts)

    def check_invariants(self) -> None:
        """Raise AssertionError if a promise of this module is broken."""
        counts: dict[Hashable, int] = {}
        total = 0
        for klass, line in enumerate(self._lines):
            for item in line.order:
                if item.klass != klass:
                    raise AssertionError(f"a waiter of class {item.klass} in line {klass}")
                if self._tracks_tenants:
                    counts[item.tenant] = counts.get(item.tenant, 0) + 1
            total += len(line.order)
            if self.policy.fair:
                by_tenant = [item for mine in line.tenants.values() for item in mine]
                if sorted(map(id, by_tenant)) != sorted(map(id, line.order)):
                    raise AssertionError(f"class {klass}: tenant lines differ from the class's waiters")
                if any(not mine for mine in line.tenants.values()):
                    raise AssertionError(f"class {klass}: an empty tenant line kept")
                if any(item.tenant != tenant for tenant, mine in line.tenants.items() for item in mine):
                    raise AssertionError(f"class {klass}: a waiter in another tenant's line")
            elif line.tenants:
                raise AssertionError("tenant lines without fair_by")
        if total != self._size:
            raise AssertionError(f"size {self._size} but {total} waiters")
        if counts != self._tenant_counts:
            raise AssertionError(f"tenant counts {self._tenant_counts} but {counts}")

    # -- internals ---------------------------------------------------------------

    def _add(self, item: Queued, front: bool) -> None:
        line = self._lines[item.klass]
        line.order[item] = None
        if front:
            line.order.move_to_end(item, last=False)
        if self._fair:
            mine = line.tenants.get(item.tenant)
            if mine is None:
                mine = line.tenants[item.tenant] = OrderedDict()
            mine[item] = None
            if front:
                mine.move_to_end(item, last=False)
                line.tenants.move_to_end(item.tenant, last=False)
        if self._tracks_tenants:
            self._tenant_counts[item.tenant] = self._tenant_counts.get(item.tenant, 0) + 1
        self._size += 1

    def _forget(self, item: Queued) -> None:
        self._size -= 1
        if self._tracks_tenants:
            left = self._tenant_counts[item.tenant] - 1
            if left:
                self._tenant_counts[item.tenant] = left
            else:
                del self._tenant_counts[item.tenant]

    def _pop_from(self, line: _ClassLine) -> Queued:
        if not self._fair:
            item, _ = line.order.popitem(last=False)
            self._forget(item)
            return item
        tenant, mine = next(iter(line.tenants.items()))
        item, _ = mine.popitem(last=False)
        if mine:
            line.tenants.move_to_end(tenant)  # the next tenant's turn
        else:
            del line.tenants[tenant]
        del line.order[item]
        self._forget(item)
        return item

    def _longest_starving(self, top: _ClassLine, arrived_by: float) -> Queued | None:
        """The longest-waiting waiter below ``top`` that arrived by ``arrived_by``."""
        best: Queued | None = None
        below = False
        for line in self._lines:
            if line is top:
                below = True
            elif below and line.order:
                oldest = next(iter(line.order))
                if oldest.enqueued_at <= arrived_by and (best is None or oldest.enqueued_at < best.enqueued_at):
                    best = oldest
        return best

    def _youngest_below(self, klass: int) -> Queued | None:
        """The youngest waiter of the lowest class below ``klass`` that has one."""
        for line in reversed(self._lines[klass + 1 :]):
            if line.order:
                return next(reversed(line.order))
        return None


_ABSENT = object()

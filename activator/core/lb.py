"""Load-balancing policies: which available pod gets the next request.

A policy only ever sees *available* pods: healthy, with a free slot owned by this
activator. The throttler tells it when a pod becomes available or stops being so
(``add`` / ``discard``); ``pick`` returns one of them without changing any count.
Each policy keeps its own index so that a pick costs O(1) or O(log n), never a scan
of every pod: per-request cost must not grow with the number of pods.

- ``first-available``: the available pod listed first in the file. Packs work onto
  the first pods (Knative's choice for cc 1..3: warm pods stay warm).
- ``round-robin``: the available pod that was picked least recently.
- ``least-in-flight``: power of two choices: two random available pods, the one
  with fewer requests in flight (Knative's choice for cc 0).
- ``auto``: by container_concurrency, as Knative: 0 -> least-in-flight,
  1..3 -> first-available, more -> round-robin.
- ``least-loaded``: the available pod with the lowest announced load (``core.load``),
  ties by rank (the file's order). A pod that announced nothing is picked first, by
  ``auto``'s choice among such pods: an unknown pod is tried (its first answer tells its
  load), and with nothing announced anywhere the policy is ``auto``. A pod's figure
  changes only with its reports: a burst fills the least loaded pod up to its limit.

None of these yield or do I/O.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from typing import Protocol

from .config import resolve_lb_policy


class Pickable(Protocol):
    address: str
    rank: int  # position in the file; lower is "first"
    in_flight: int
    load: float | None  # the figure the pod announced; None: nothing


class Policy(Protocol):
    name: str

    def add(self, pod: Pickable) -> None: ...
    def discard(self, pod: Pickable) -> None: ...
    def pick(self) -> Pickable | None: ...
    def __len__(self) -> int: ...
    def __contains__(self, pod: object) -> bool: ...


class FirstAvailable:
    """Min-heap of available pods by rank, with lazy deletion."""

    name = "first-available"

    def __init__(self) -> None:
        # Invariant: every available pod has at least one heap entry with its current
        # rank; other entries (unavailable pods, old ranks) are stale and skipped (and
        # compacted away).
        self._members: dict[str, Pickable] = {}
        self._ranks: dict[str, int] = {}  # rank of each member's newest heap entry
        self._heap: list[tuple[int, str]] = []

    def add(self, pod: Pickable) -> None:
        # A member whose rank changed (the file was reordered) needs a fresh entry:
        # its old one is now stale and pick() would drop it.
        if pod.address in self._members and self._ranks[pod.address] == pod.rank:
            return
        self._members[pod.address] = pod
        self._ranks[pod.address] = pod.rank
        heapq.heappush(self._heap, (pod.rank, pod.address))
        if len(self._heap) > 2 * len(self._members) + 16:
            self._heap = [(p.rank, a) for a, p in self._members.items()]
            self._ranks = {a: p.rank for a, p in self._members.items()}
            heapq.heapify(self._heap)

    def discard(self, pod: Pickable) -> None:
        self._members.pop(pod.address, None)
        self._ranks.pop(pod.address, None)

    def pick(self) -> Pickable | None:
        heap, members = self._heap, self._members
        while heap:
            rank, address = heap[0]
            pod = members.get(address)
            if pod is not None and pod.rank == rank:
                return pod
            heapq.heappop(heap)
        return None

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, pod: object) -> bool:
        return getattr(pod, "address", None) in self._members


class RoundRobin:
    """A rotation of available pods: pick the one waiting longest, send it to the back."""

    name = "round-robin"

    def __init__(self) -> None:
        # Invariant: each available pod has exactly one entry in the ring with its
        # current generation; other entries are stale and skipped.
        self._members: dict[str, tuple[Pickable, int]] = {}
        self._ring: deque[tuple[str, int]] = deque()
        self._generation = 0

    def add(self, pod: Pickable) -> None:
        if pod.address in self._members:
            return
        self._generation += 1
        self._members[pod.address] = (pod, self._generation)
        self._ring.append((pod.address, self._generation))
        if len(self._ring) > 2 * len(self._members) + 16:
            self._ring = deque((a, g) for a, (_, g) in self._members.items())

    def discard(self, pod: Pickable) -> None:
        self._members.pop(pod.address, None)

    def pick(self) -> Pickable | None:
        ring, members = self._ring, self._members
        while ring:
            address, generation = ring[0]
            member = members.get(address)
            if member is not None and member[1] == generation:
                ring.rotate(-1)  # picked: to the back of the rotation
                return member[0]
            ring.popleft()
        return None

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, pod: object) -> bool:
        return getattr(pod, "address", None) in self._members


class LeastInFlight:
    """Power of two choices over an array of available pods (swap-remove keeps it dense)."""

    name = "least-in-flight"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        # Invariant: _index[pod.address] == i  <=>  _pods[i] is pod.
        self._pods: list[Pickable] = []
        self._index: dict[str, int] = {}

    def add(self, pod: Pickable) -> None:
        if pod.address in self._index:
            return
        self._index[pod.address] = len(self._pods)
        self._pods.append(pod)

    def discard(self, pod: Pickable) -> None:
        i = self._index.pop(pod.address, None)
        if i is None:
            return
        last = self._pods.pop()
        if last is not pod:
            self._pods[i] = last
            self._index[last.address] = i

    def pick(self) -> Pickable | None:
        pods = self._pods
        n = len(pods)
        if n == 0:
            return None
        if n == 1:
            return pods[0]
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        if j >= i:
            j += 1
        a, b = pods[i], pods[j]
        if a.in_flight == b.in_flight:
            return a if self._rng.random() < 0.5 else b
        return a if a.in_flight < b.in_flight else b

    def __len__(self) -> int:
        return len(self._pods)

    def __contains__(self, pod: object) -> bool:
        return getattr(pod, "address", None) in self._index


class LeastLoaded:
    """Min-heap of announcing pods by (figure, rank), with lazy deletion; pods that
    announced nothing are in ``auto``'s policy and picked first (see the module docstring).

    ``add`` again after a pod's figure changed moves it: O(log n) per change and pick.
    """

    name = "least-loaded"

    def __init__(self, unannounced: Policy) -> None:
        # Invariant: each available pod is in exactly one of _unannounced (load None) and
        # _members (load not None); each member has a heap entry with its key in _keys;
        # other heap entries are stale and skipped (and compacted away).
        self._unannounced = unannounced
        self._members: dict[str, Pickable] = {}
        self._keys: dict[str, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, str]] = []

    def add(self, pod: Pickable) -> None:
        if pod.load is None:
            self._discard_announced(pod)
            self._unannounced.add(pod)
            return
        self._unannounced.discard(pod)
        key = (pod.load, pod.rank)
        if self._keys.get(pod.address) == key:
            return
        self._members[pod.address] = pod
        self._keys[pod.address] = key
        heapq.heappush(self._heap, (*key, pod.address))
        if len(self._heap) > 2 * len(self._members) + 16:
            self._heap = [(*k, a) for a, k in self._keys.items()]
            heapq.heapify(self._heap)

    def _discard_announced(self, pod: Pickable) -> None:
        self._members.pop(pod.address, None)
        self._keys.pop(pod.address, None)

    def discard(self, pod: Pickable) -> None:
        self._discard_announced(pod)
        self._unannounced.discard(pod)

    def pick(self) -> Pickable | None:
        first = self._unannounced.pick()
        if first is not None:
            return first
        heap, keys = self._heap, self._keys
        while heap:
            load, rank, address = heap[0]
            if keys.get(address) == (load, rank):
                return self._members[address]
            heapq.heappop(heap)
        return None

    @property
    def unannounced_policy(self) -> str:
        """The name of the policy among pods that announced nothing."""
        return self._unannounced.name

    def __len__(self) -> int:
        return len(self._members) + len(self._unannounced)

    def __contains__(self, pod: object) -> bool:
        return getattr(pod, "address", None) in self._members or pod in self._unannounced


def make_policy(name: str, container_concurrency: int, rng: random.Random | None = None) -> Policy:
    """A fresh, empty policy for ``name`` (``auto`` resolved by ``container_concurrency``)."""
    concrete = resolve_lb_policy(name, container_concurrency)
    if concrete == "least-loaded":
        return LeastLoaded(make_policy("auto", container_concurrency, rng))
    if concrete == "first-available":
        return FirstAvailable()
    if concrete == "round-robin":
        return RoundRobin()
    if concrete == "least-in-flight":
        return LeastInFlight(rng)
    raise ValueError(f"unknown lb_policy {name!r}")


def policy_matches(policy: Policy, name: str, container_concurrency: int) -> bool:
    """Whether ``policy`` is what ``make_policy(name, container_concurrency)`` would make
    (else a reload replaces it): ``least-loaded`` also by its ``auto`` part."""
    if policy.name != resolve_lb_policy(name, container_concurrency):
        return False
    if isinstance(policy, LeastLoaded):
        return policy.unannounced_policy == resolve_lb_policy("auto", container_concurrency)
    return True

"""How the slots of a service's pods are divided among activator peers.

Decides, for one service, which peer owns how many of each pod's slots. The same
function divides one activator's own slots among its worker processes (the "pods" are
then the slots this activator owns, the "peers" its workers). Pure: no I/O, no
randomness but a fixed hash, never yields.

Rules
=====

A pod with ``container_concurrency`` (cc) ``c > 0`` has ``c`` slots. A pod with cc 0 is
unlimited and is not divided: it is left out of the result, and callers let every peer
use it. With ``n`` peers and ``T`` slots in all, the division is:

* **exact cover**: every slot belongs to exactly one peer, so a pod's counts add up to
  its cc and all the peers together never exceed it;
* **balanced**: every peer owns ``T // n`` or ``T // n + 1`` slots of the service;
* **spread**: every peer owns ``c // n`` or ``c // n + 1`` slots of each pod, so a pod's
  slots go to distinct peers whenever ``c <= n``. (A cc=1 pod is of course owned whole.)
  Spread and balance can always hold together, so spread costs no balance; see
  "Why spread" below;
* a pure function of the *sets* of (address, cc) pairs and peer names: the order of the
  inputs does not matter, and the result is the same in every process (it hashes with
  ``hashlib.blake2b``, never with the per-process salted ``hash()``);
* **minimal movement**, within the bounds below.

The scheme
==========

Every (peer, pod) pair has a score, rendezvous (HRW) style::

    score(peer, address) = int.from_bytes(blake2b(len(peer) as 4 bytes big-endian
                                                  + peer + address, digest_size=8), "big")

(names are UTF-8). Among all divisions that are balanced and spread, the division
returned is the one that maximises the sum of the scores of its (peer, pod, extra slot)
triples. Spread fixes every peer's count on a pod to ``c // n`` plus 0 or 1 "extra"
slot, and a pod hands out exactly ``c % n`` extras, to distinct peers; so the choice is
which peers get each pod's extras, under the constraint that every peer's total differs
from the others' by at most one. That is a small min-cost flow problem, solved exactly:

1. every pod gives its ``c % n`` extras to its best-scoring peers (plain HRW top-k);
2. while the peers' totals differ by 2 or more, one extra slot is moved from a fullest
   peer to an emptiest one along the cheapest chain of moves (a shortest path in the
   graph of peers, where the edge p -> q costs the cheapest score loss of giving one of
   p's extras to q, one pod at a time; Dijkstra with potentials);
3. once balanced, while some chain from a peer with ``T // n + 1`` slots to one with
   ``T // n`` gains score (a negative path), it is applied.

Steps 2 and 3 only ever move extras along shortest paths, so every state stays optimal
for its own totals (the successive-shortest-path invariant), and the end state is the
optimum. Scores are 64-bit hashes, so two different divisions of equal total score
happen with negligible probability (never seen); the optimum is then unique, which is
what the movement bounds rest on. (If there ever is a tie, the result is still
deterministic: ties are broken by sorted peer name and pod address.)

In the code, step 1 is ``_top_scoring_holders``; steps 2 and 3 are
``_ExtraSlotFlow.step``, which ``_assign_extras`` repeats until it has nothing to apply.

Movement bounds
===============

Slots "move" when a peer's count on a pod falls while another's rises; slots removed
with a pod (or a smaller cc) and new slots do not count. ``moved_slots(old, new)``
measures it. Let ``n`` be the number of peers (the larger of the two counts when a peer
is added or removed). These bounds hold exactly, given that the optimum is unique: two
optima whose inputs differ by one slot differ by one augmenting path (successive
shortest paths), and a path visits each peer at most once, so it moves at most ``n - 1``
slots; when a peer goes, its ``k`` slots are re-placed one path each from the old
optimum without it (still optimal for what remains), and a peer coming is the same seen
backwards.

==========================================  ==========  ===============================
change                                      must move   bound (tested with hypothesis)
==========================================  ==========  ===============================
one slot more or less (cc +- 1, or a pod    0 [1]       ``n - 1``
of cc 1 added or removed)
``d`` slots more or less (a pod of cc       0 [1]       ``d * (n - 1)``
``d`` added or removed, a cc changed by d)
remove a peer that owned ``k`` slots        ``k``       ``k + k * (n - 2)``
add a peer that ends up owning ``k`` slots  ``k`` [2]   ``k + k * (n - 2)``
==========================================  ==========  ===============================

[1] When slots are removed, restoring the balance may force a move or two. [2] The
least an added peer can get is ``T // n``; ``k`` is that or one more.

The worst cases are far from what happens. Measured over 500 random services each
(1..40 pods, cc 1..4, random peer names), "extra" being the slots moved beyond the
"must move" column:

==========================  ===============================  ===========================
change                      3 peers: extra avg / max         9 peers: extra avg / max
==========================  ===============================  ===========================
add a peer (3->4, 9->10)    0.69 / 5 (share moved: 12.45)    2.35 / 7 (share: 5.01)
remove a peer               0.26 / 3 (its slots: 16.59)      2.19 / 7 (its slots: 5.58)
add a pod                   0.50 / 2                         2.48 / 7
remove a pod                0.55 / 2                         2.30 / 10
cc + 1 / cc - 1             0.62 / 2, 0.64 / 2               1.40 / 7, 1.41 / 7
==========================  ===============================  ===========================

With 2 peers and cc 1..2, removing a peer never moves more than its own slots, and
adding a third moves 0.46 extra on average. The extra grows with ``n`` because exact
(+-1) balance, kept by a function of the current inputs alone (no memory of the previous
division), has to pass a surplus along a chain of peers. Timing: 10,000 pods of cc 4 and
10 peers take about 0.14 s in CPython 3.11 (hashing 0.04 s, the division 0.08 s); 1,000
pods of cc 4 among 64 workers, about 0.4 s; 10,000 pods of cc 4 and 32 peers, 0.8 s.

Why spread
==========

With cc=2 and 2 peers, each peer owns one slot of every pod rather than half the pods
whole. It keeps the property that every peer can reach every pod (a pod going unhealthy
takes a little capacity from everyone rather than all of one peer's, and a peer's load
balancer has more pods to pick from). It costs nothing in the bounds above: spread never
conflicts with balance, and a peer removed or added needs its own share of each pod
moved anyway. With cc=1 pods, or cc < n, whole pods (or single slots) per peer are
unavoidable, and spread degenerates to "distinct peers".

Worked examples
===============

Three pods with cc=1 and two peers: the 3 slots go 2 to one peer and 1 to the other.

>>> divide_slots({"10.0.0.1:80": 1, "10.0.0.2:80": 1, "10.0.0.3:80": 1}, ["a", "b"])
{'a': {'10.0.0.1:80': 1, '10.0.0.2:80': 1}, 'b': {'10.0.0.3:80': 1}}

Two pods with cc=3 and three peers: spread gives every peer one slot of each pod.

>>> divide_slots({"10.0.0.1:80": 3, "10.0.0.2:80": 3}, ["a", "b", "c"])
{'a': {'10.0.0.1:80': 1, '10.0.0.2:80': 1}, 'b': {'10.0.0.1:80': 1, '10.0.0.2:80': 1}, \
'c': {'10.0.0.1:80': 1, '10.0.0.2:80': 1}}

Two pods with cc=2 and three peers: 4 slots, so totals 2, 1, 1; each pod's two slots go
to two distinct peers. A cc=0 pod is left out, and one pod with cc=1 and three peers
leaves two peers with nothing (they forward to the owner).

>>> divide_slots({"10.0.0.1:80": 2, "10.0.0.2:80": 2, "10.0.0.9:80": 0}, ["a", "b", "c"])
{'a': {'10.0.0.1:80': 1, '10.0.0.2:80': 1}, 'b': {'10.0.0.2:80': 1}, 'c': {'10.0.0.1:80': 1}}
>>> divide_slots({"10.0.0.1:80": 1}, ["a", "b", "c"])
{'a': {'10.0.0.1:80': 1}, 'b': {}, 'c': {}}

Removing peer "a" from the previous-but-one example moves only a's two slots:

>>> before = divide_slots({"10.0.0.1:80": 2, "10.0.0.2:80": 2}, ["a", "b", "c"])
>>> after = divide_slots({"10.0.0.1:80": 2, "10.0.0.2:80": 2}, ["b", "c"])
>>> after
{'b': {'10.0.0.1:80': 1, '10.0.0.2:80': 1}, 'c': {'10.0.0.1:80': 1, '10.0.0.2:80': 1}}
>>> moved_slots(before, after)
2

Cost: n blake2b calls for each pod whose cc is not a multiple of n, a heap entry per
(pod, peer with its extra, peer without), then one shortest-path search (O(n^2)) per
rebalancing move; those are about as many as HRW's imbalance (791 moves for 10,000
pods of cc 4 and 10 peers). Roughly linear in pods * (cc % n) * n.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Mapping, Sequence

#: peer -> {pod address: slots of that pod the peer owns}. Pods with 0 slots for a peer
#: are absent from its dict; every peer is a key.
Division = dict[str, dict[str, int]]


def _check_inputs(pods: Mapping[str, int], peers: Sequence[str]) -> list[str]:
    """Validates the inputs; returns the peer names, sorted."""
    names = sorted(peers)
    for previous, name in itertools.pairwise(names):
        if name == previous:
            raise ValueError(f"duplicate peer {name!r}")
    for address, cc in pods.items():
        if isinstance(cc, bool) or not isinstance(cc, int) or cc < 0:
            raise ValueError(f"pod {address!r}: container_concurrency must be an int >= 0, not {cc!r}")
    return names


def _peer_hashers(names: Sequence[str]) -> list[hashlib.blake2b]:
    """One blake2b per peer, already fed the peer's length-prefixed name.

    The length prefix keeps (peer, address) pairs apart ("ab" + "c" vs "a" + "bc"); hashing
    the name once and copying the state saves rehashing it for every pod.
    """
    hashers = []
    for name in names:
        key = name.encode()
        hashers.append(hashlib.blake2b(len(key).to_bytes(4, "big") + key, digest_size=8))
    return hashers


def _scores(hashers: Sequence[hashlib.blake2b], address: str) -> list[int]:
    """score(peer, address) for every peer, in the order of ``hashers``."""
    data = address.encode()
    scores = []
    for hasher in hashers:
        keyed = hasher.copy()
        keyed.update(data)
        scores.append(int.from_bytes(keyed.digest(), "big"))
    return scores


def score(peer: str, address: str) -> int:
    """The rendezvous score of ``peer`` for the pod at ``address`` (a 64-bit int)."""
    return _scores(_peer_hashers([peer]), address)[0]


def _top_scoring_holders(
    scores: Sequence[Sequence[int]], extras_per_pod: Sequence[int], peer_count: int
) -> tuple[list[bytearray], list[int]]:
    """Step 1: every pod gives its extras to its best-scoring peers (plain HRW top-k).

    Returns (holds_extra, extras_held): ``holds_extra[pod][peer]`` is 1 if peer gets one of
    pod's extras, ``extras_held[peer]`` how many peer got. This is the best total score with
    no balance constraint, so it is optimal for its own totals: the rebalancing starts from
    a state that keeps its invariant (all potentials 0). Among equal scores the lower peer
    number wins (the sort is stable).
    """
    holds_extra = []
    extras_held = [0] * peer_count
    for pod_scores, extras in zip(scores, extras_per_pod, strict=True):
        best_first = sorted(range(peer_count), key=pod_scores.__getitem__, reverse=True)
        holders = bytearray(peer_count)
        for peer in best_first[:extras]:
            holders[peer] = 1
            extras_held[peer] += 1
        holds_extra.append(holders)
    return holds_extra, extras_held


class _ExtraSlotFlow:
    """Steps 2 and 3 of the scheme: the extras moved between peers until they are optimal.

    Pods are numbered in address order, peers in name order. Moving pod ``pod``'s extra
    from ``giver`` (who holds one) to ``taker`` (who does not) loses ``scores[pod][giver]
    - scores[pod][taker]`` of the total score. The peers form a graph whose edge giver ->
    taker is the cheapest such move; a chain of moves along a path shifts one extra from
    its first peer to its last and leaves the peers in between with their totals.

    A move is one int, its key: ``score_lost * pod_count + pod``. Keys order moves by score
    lost, then by pod, and ``key // pod_count`` and ``key % pod_count`` give both back
    (ints are much cheaper in a heap than tuples). Does not yield.
    """

    __slots__ = (
        "scores",
        "extras_per_pod",
        "pod_count",
        "peer_count",
        "holds_extra",
        "extras_held",
        "move_heaps",
        "cheapest_move",
        "potential",
    )

    def __init__(self, scores: Sequence[Sequence[int]], extras_per_pod: Sequence[int], peer_count: int) -> None:
        self.scores = scores
        self.extras_per_pod = extras_per_pod
        self.pod_count = len(extras_per_pod)
        self.peer_count = peer_count
        # Invariant: holds_extra[pod][peer] is 1 if peer holds one of pod's extras, else 0;
        # pod's row has extras_per_pod[pod] ones.
        # Invariant: extras_held[peer] == sum(holders[peer] for holders in holds_extra).
        self.holds_extra, self.extras_held = _top_scoring_holders(scores, extras_per_pod, peer_count)
        # Invariant: move_heaps[giver * peer_count + taker] is a heap holding the key of
        # every possible move from giver to taker, and stale keys of moves no longer
        # possible, which _cheapest_possible_move drops when they surface.
        self.move_heaps = self._every_possible_move()
        # Invariant: cheapest_move[giver][taker] is the least key of a possible move from
        # giver to taker, None if there is none (and on the diagonal).
        self.cheapest_move: list[list[int | None]] = [
            [self._cheapest_possible_move(giver, taker) if giver != taker else None for taker in range(peer_count)]
            for giver in range(peer_count)
        ]
        # Invariant: score lost + potential[giver] - potential[taker] >= 0 for every
        # possible move. So no cycle of moves gains score: the extras are the optimum for
        # the peers' current totals (the successive-shortest-path invariant).
        self.potential = [0] * peer_count

    def _every_possible_move(self) -> list[list[int]]:
        """The heaps of moves, one per (giver, taker), for the holders of step 1."""
        peer_count, pod_count = self.peer_count, self.pod_count
        move_heaps: list[list[int]] = [[] for _ in range(peer_count * peer_count)]
        appenders = [heap.append for heap in move_heaps]
        for pod, (pod_scores, holders) in enumerate(zip(self.scores, self.holds_extra, strict=True)):
            scaled = [pod_score * pod_count for pod_score in pod_scores]
            takers = [peer for peer in range(peer_count) if not holders[peer]]
            for giver in range(peer_count):
                if holders[giver]:
                    giver_key = scaled[giver] + pod
                    row = giver * peer_count
                    for taker in takers:
                        appenders[row + taker](giver_key - scaled[taker])
        for heap in move_heaps:
            heapq.heapify(heap)
        return move_heaps

    def _cheapest_possible_move(self, giver: int, taker: int) -> int | None:
        """The least key of a move from giver to taker that is still possible, or None.

        Drops the stale keys it finds on top: a pod's extras changed since they were pushed.
        """
        heap = self.move_heaps[giver * self.peer_count + taker]
        while heap:
            holders = self.holds_extra[heap[0] % self.pod_count]
            if holders[giver] and not holders[taker]:
                return heap[0]
            heapq.heappop(heap)
        return None

    def step(self) -> bool:
        """Applies one chain of moves toward the optimum; False when there is none left.

        While the totals differ by 2 or more (step 2), the cheapest chain from a fullest
        peer to an emptiest one (there always is one: every peer is reachable). Once they
        are balanced (step 3), the cheapest chain from a peer with one extra more to one with
        one less, if it gains score. Both keep the balance they reached and, moving along
        shortest paths, the potentials' invariant; so the state the last step leaves is the
        optimum. Among equally cheap chains, the one ending at the lower peer number.
        """
        most, least = max(self.extras_held), min(self.extras_held)
        if most == least:
            return False
        distance, predecessor = self._shortest_chains_from_fullest(most)
        ends = [
            (distance[peer], peer)
            for peer, held in enumerate(self.extras_held)
            if held == least and (most - least > 1 or distance[peer] < 0)
        ]
        if not ends:  # balanced, and no chain gains score
            return False
        self._apply_chain(predecessor, min(ends)[1])
        return True

    def _shortest_chains_from_fullest(self, most: int) -> tuple[list[int], list[int]]:
        """The cheapest chain of moves from any fullest peer (``most`` extras) to every peer.

        Dijkstra on reduced costs, which the invariant keeps non-negative. Returns
        (distance, predecessor): ``distance[peer]`` is the score the cheapest chain to peer
        loses, ``predecessor`` the shortest-path tree (-1 at its roots); among equally near
        peers, the lower number is settled first. Every peer is reached: one that no chain
        reaches would hold every extra a fullest peer holds, and so be fullest itself.

        The distances then become the potentials (Johnson's reweighting): no edge's reduced
        cost goes below 0 and the tree's edges cost 0, so moving along a tree path keeps the
        invariant.
        """
        peer_count, pod_count, potential = self.peer_count, self.pod_count, self.potential
        # reduced[peer]: the cheapest chain found so far less potential[peer]; None until reached.
        reduced: list[int | None] = [None] * peer_count
        settled = [False] * peer_count
        distance = [0] * peer_count
        predecessor = [-1] * peer_count
        for peer, held in enumerate(self.extras_held):
            if held == most:
                reduced[peer] = -potential[peer]
        for _ in range(peer_count):
            nearest, nearest_reduced = -1, 0
            for peer, known in enumerate(reduced):
                if known is not None and not settled[peer] and (nearest < 0 or known < nearest_reduced):
                    nearest, nearest_reduced = peer, known
            settled[nearest] = True
            distance[nearest] = nearest_reduced + potential[nearest]
            for taker, key in enumerate(self.cheapest_move[nearest]):
                if key is None or settled[taker]:
                    continue
                candidate = distance[nearest] + key // pod_count - potential[taker]
                known = reduced[taker]
                if known is None or candidate < known:
                    reduced[taker] = candidate
                    predecessor[taker] = nearest
        self.potential = distance
        return distance, predecessor

    def _apply_chain(self, predecessor: Sequence[int], end: int) -> None:
        """Makes the moves along the tree path that ends at ``end``."""
        path = [end]
        while predecessor[path[-1]] >= 0:
            path.append(predecessor[path[-1]])
        path.reverse()
        # Read every edge's pod before moving any: the path is shortest as a whole, and each
        # move changes the edges at its two peers.
        moves = []
        for giver, taker in itertools.pairwise(path):
            key = self.cheapest_move[giver][taker]
            assert key is not None, "a shortest-path tree edge with no move"
            moves.append((key % self.pod_count, giver, taker))
        for pod, giver, taker in moves:
            self._move_extra(pod, giver, taker)

    def _move_extra(self, pod: int, giver: int, taker: int) -> None:
        """Moves one of pod's extras from giver to taker, and updates the moves it changes."""
        peer_count, pod_count = self.peer_count, self.pod_count
        holders = self.holds_extra[pod]
        holders[giver] = 0
        holders[taker] = 1
        self.extras_held[giver] -= 1
        self.extras_held[taker] += 1
        # The moves of this pod that become possible: the taker can give it to any peer
        # without it, any peer with it can give it to the giver. The moves that became
        # impossible stay in their heaps, stale, until they surface.
        scaled = [pod_score * pod_count for pod_score in self.scores[pod]]
        for peer in range(peer_count):
            if peer == taker:
                continue
            if holders[peer]:
                heapq.heappush(self.move_heaps[peer * peer_count + giver], scaled[peer] - scaled[giver] + pod)
            else:
                heapq.heappush(self.move_heaps[taker * peer_count + peer], scaled[taker] - scaled[peer] + pod)
        # Only the edges at the giver and the taker can have changed.
        cheapest_move, cheapest_possible_move = self.cheapest_move, self._cheapest_possible_move
        for peer in range(peer_count):
            if peer != giver:
                cheapest_move[giver][peer] = cheapest_possible_move(giver, peer)
                cheapest_move[peer][giver] = cheapest_possible_move(peer, giver)
            if peer != taker:
                cheapest_move[taker][peer] = cheapest_possible_move(taker, peer)
                cheapest_move[peer][taker] = cheapest_possible_move(peer, taker)

    def check_invariants(self) -> None:
        """Raises AssertionError unless every invariant above holds.

        For tests: it recomputes everything from ``holds_extra``, in O(pods * peers^2).
        """
        peer_count, pod_count = self.peer_count, self.pod_count
        for pod, holders in enumerate(self.holds_extra):
            assert set(holders) <= {0, 1} and sum(holders) == self.extras_per_pod[pod], (pod, holders)
        assert self.extras_held == [sum(holders[peer] for holders in self.holds_extra) for peer in range(peer_count)]
        possible: dict[tuple[int, int], list[int]] = {}
        for pod, (pod_scores, holders) in enumerate(zip(self.scores, self.holds_extra, strict=True)):
            for giver, taker in itertools.permutations(range(peer_count), 2):
                if holders[giver] and not holders[taker]:
                    key = (pod_scores[giver] - pod_scores[taker]) * pod_count + pod
                    possible.setdefault((giver, taker), []).append(key)
        for giver, taker in itertools.product(range(peer_count), repeat=2):
            keys = possible.get((giver, taker), [])
            assert set(keys) <= set(self.move_heaps[giver * peer_count + taker]), (giver, taker)
            cheapest = min(keys, default=None)
            assert self.cheapest_move[giver][taker] == cheapest, (giver, taker)
            if cheapest is not None:
                reduced_cost = cheapest // pod_count + self.potential[giver] - self.potential[taker]
                assert reduced_cost >= 0, (giver, taker, reduced_cost)


def _assign_extras(scores: Sequence[Sequence[int]], extras_per_pod: Sequence[int], peer_count: int) -> list[bytearray]:
    """Which peers get each pod's extra slots: the optimum described in the module docstring.

    ``scores[pod][peer]`` is the pod's score for the peer, ``extras_per_pod[pod]``
    (0 < extras < peer_count) how many extras the pod hands out. Returns
    ``holds_extra[pod][peer]``: 1 if the peer gets one of the pod's extras, else 0.
    Does not yield.
    """
    flow = _ExtraSlotFlow(scores, extras_per_pod, peer_count)
    while flow.step():
        pass
    return flow.holds_extra


def divide_slots(pods: Mapping[str, int], peers: Sequence[str]) -> Division:
    """Divides the slots of ``pods`` (address -> cc) among ``peers``.

    Returns peer -> {address: slots owned}, every peer a key, pods with 0 slots for a
    peer omitted, cc=0 pods omitted everywhere. No peers: ``{}``. Raises ValueError on a
    duplicate peer or a cc that is not an int >= 0. Pure, does not yield.
    """
    names = _check_inputs(pods, peers)
    peer_count = len(names)
    division: Division = {name: {} for name in names}
    if peer_count == 0:
        return division
    limited = sorted((address, cc) for address, cc in pods.items() if cc > 0)
    if peer_count == 1:
        division[names[0]] = dict(limited)
        return division
    hashers = _peer_hashers(names)
    uneven: list[tuple[str, int]] = []  # pods with extras: (address, every peer's share cc // n)
    scores: list[list[int]] = []
    extras_per_pod: list[int] = []
    owned_by_peer = [division[name] for name in names]
    for address, cc in limited:
        share, extras = divmod(cc, peer_count)
        if extras:
            uneven.append((address, share))
            scores.append(_scores(hashers, address))
            extras_per_pod.append(extras)
        else:
            for owned in owned_by_peer:
                owned[address] = share
    holds_extra = _assign_extras(scores, extras_per_pod, peer_count)
    for (address, share), holders in zip(uneven, holds_extra, strict=True):
        for owned, extra in zip(owned_by_peer, holders, strict=True):
            if share + extra:
                owned[address] = share + extra
    # Present every peer's pods in address order, whatever the path above.
    return {name: dict(sorted(division[name].items())) for name in names}


def owned_slots(pods: Mapping[str, int], peers: Sequence[str], me: str) -> dict[str, int]:
    """The slots ``me`` owns: ``divide_slots(pods, peers)[me]``.

    Raises ValueError if ``me`` is not among ``peers`` (an activator that is not in
    its own peer list would otherwise silently own nothing). Does not yield.
    """
    if me not in peers:
        raise ValueError(f"{me!r} is not one of the peers {sorted(peers)!r}")
    return divide_slots(pods, peers)[me]


def _by_pod(division: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    pods: dict[str, dict[str, int]] = {}
    for peer, owned in division.items():
        for address, count in owned.items():
            pods.setdefault(address, {})[peer] = count
    return pods


def moved_slots(old: Mapping[str, Mapping[str, int]], new: Mapping[str, Mapping[str, int]]) -> int:
    """How many slots changed owner between two divisions.

    For a pod in both: ``min(old cc, new cc) - sum over peers of min(old count, new
    count)``: the slots that survive the change, less those that can keep their owner.
    Pods in only one of the two move nothing. Peers may differ between the two.
    """
    before = _by_pod(old)
    after = _by_pod(new)
    moved = 0
    for address, o in before.items():
        a = after.get(address)
        if a is None:
            continue
        kept = sum(min(c, a.get(peer, 0)) for peer, c in o.items())
        moved += min(sum(o.values()), sum(a.values())) - kept
    return moved


def check_division(pods: Mapping[str, int], peers: Sequence[str], division: Division) -> None:
    """Raises AssertionError unless ``division`` is a valid division of ``pods``.

    Checks exact cover, balance (totals within 1) and spread (each pod's counts within
    1), that every peer is a key and that no zero counts or cc=0 pods appear.
    """
    names = sorted(peers)
    if sorted(division) != names:
        raise AssertionError(f"peers {sorted(division)} != {names}")
    if not names:
        return
    n = len(names)
    limited = {a: cc for a, cc in pods.items() if cc > 0}
    counts = _by_pod(division)
    if set(counts) != set(limited):
        raise AssertionError(f"pods divided {sorted(counts)} != pods with cc > 0 {sorted(limited)}")
    for address, cc in limited.items():
        got = counts[address]
        if any(c <= 0 for c in got.values()):
            raise AssertionError(f"{address}: non-positive count in {got}")
        if sum(got.values()) != cc:
            raise AssertionError(f"{address}: counts {got} do not add up to cc {cc}")
        q = cc // n
        for name in names:
            if not q <= got.get(name, 0) <= q + 1:
                raise AssertionError(f"{address}: not spread, {got} with {n} peers")
    totals = [sum(division[name].values()) for name in names]
    if max(totals) - min(totals) > 1:
        raise AssertionError(f"unbalanced totals {dict(zip(names, totals, strict=True))}")

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
   ``T // n`` loses no score (a negative path), it is applied.

Steps 2 and 3 only ever move extras along shortest paths, so every state stays optimal
for its own totals (the successive-shortest-path invariant), and the end state is the
optimum. Scores are 64-bit hashes, so two different divisions of equal total score
happen with negligible probability (never seen); the optimum is then unique, which is
what the movement bounds rest on. (If there ever is a tie, the result is still
deterministic: ties are broken by sorted peer name and pod address.)

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
    """Validates the inputs; returns the peers, sorted."""
    names = sorted(peers)
    for i in range(1, len(names)):
        if names[i] == names[i - 1]:
            raise ValueError(f"duplicate peer {names[i]!r}")
    for address, cc in pods.items():
        if isinstance(cc, bool) or not isinstance(cc, int) or cc < 0:
            raise ValueError(
                f"pod {address!r}: container_concurrency must be an int >= 0, not {cc!r}"
            )
    return names


def _peer_hashers(names: Sequence[str]) -> list[hashlib.blake2b]:
    out = []
    for name in names:
        key = name.encode()
        out.append(hashlib.blake2b(len(key).to_bytes(4, "big") + key, digest_size=8))
    return out


def _scores(hashers: Sequence[hashlib.blake2b], address: str) -> list[int]:
    """score(peer, address) for every peer, in the order of ``hashers``."""
    data = address.encode()
    out = []
    for h in hashers:
        c = h.copy()
        c.update(data)
        out.append(int.from_bytes(c.digest(), "big"))
    return out


def score(peer: str, address: str) -> int:
    """The rendezvous score of ``peer`` for the pod at ``address`` (a 64-bit int)."""
    return _scores(_peer_hashers([peer]), address)[0]


def _extras(scores: list[list[int]], rems: list[int], n: int) -> list[bytearray]:
    """Which peers get each pod's extra slot: the optimum described in the docstring.

    ``scores[y][p]`` is pod y's score for peer p, ``rems[y]`` (0 < rems[y] < n) how many
    extras pod y hands out. Returns ``member[y][p]`` = 1 if peer p gets an extra of pod y.
    Does not yield.
    """
    m = len(rems)
    member: list[bytearray] = []
    load = [0] * n
    if m == 0:
        return member
    # heaps[p * n + q] holds the ways of moving one extra from peer p to peer q: for a
    # pod y with an extra at p and none at q, the key (s[p] - s[q]) * m + y, which
    # orders by score lost, then by pod (ints: cheaper than tuples). Entries go stale
    # when the pod's extras change; top() drops them when they surface.
    heaps: list[list[int]] = [[] for _ in range(n * n)]
    appenders = [h.append for h in heaps]
    peers = range(n)
    for y in range(m):
        s = scores[y]
        order = sorted(peers, key=s.__getitem__, reverse=True)
        r = rems[y]
        row = bytearray(n)
        outs = order[r:]
        scaled = [x * m for x in s]
        for p in order[:r]:
            row[p] = 1
            load[p] += 1
            sp = scaled[p] + y
            base = p * n
            for q in outs:
                appenders[base + q](sp - scaled[q])
        member.append(row)
    for h in heaps:
        heapq.heapify(h)

    def top(p: int, q: int) -> int | None:
        h = heaps[p * n + q]
        while h:
            row = member[h[0] % m]
            if row[p] and not row[q]:
                return h[0]
            heapq.heappop(h)
        return None

    # weight[p][q]: the key of the cheapest way to move one extra from p to q, or None.
    weight: list[list[int | None]] = [[top(p, q) if p != q else None for q in peers] for p in peers]
    # Invariant: weight[p][q] // m + pot[p] - pot[q] >= 0 for every edge, i.e. there is
    # no negative cycle: the current extras are optimal for their own totals.
    pot = [0] * n

    def shortest(sources: list[int]) -> tuple[list[int | None], list[int]]:
        """Dijkstra from the set ``sources`` on reduced costs.

        Returns (dist, pred): dist[v] is the true cost of the cheapest path from any
        source to v (None if unreachable), pred the shortest-path tree. Updates ``pot``
        so that the invariant holds again after augmenting along a path of the tree.
        """
        label: list[int | None] = [None] * n
        pred = [-1] * n
        done = [False] * n
        for a in sources:
            label[a] = -pot[a]
        for _ in peers:
            u = -1
            best = 0
            for v in peers:
                lv = label[v]
                if lv is not None and not done[v] and (u < 0 or lv < best):
                    u, best = v, lv
            if u < 0:
                break
            done[u] = True
            wu = weight[u]
            base = best + pot[u]
            for v in peers:
                e = wu[v]
                if e is None or done[v]:
                    continue
                cand = base + e // m - pot[v]
                lv = label[v]
                if lv is None or cand < lv:
                    label[v] = cand
                    pred[v] = u
        top_label = max(x for x in label if x is not None)
        dist: list[int | None] = [None] * n
        for v in peers:
            lv = label[v]
            if lv is None:
                pot[v] += top_label
            else:
                dist[v] = lv + pot[v]
                pot[v] += lv
        return dist, pred

    def move(y: int, p: int, q: int) -> None:
        row = member[y]
        row[p] = 0
        row[q] = 1
        load[p] -= 1
        load[q] += 1
        scaled = [x * m for x in scores[y]]
        for r in peers:
            if r == q:
                continue
            if not row[r]:
                heapq.heappush(heaps[q * n + r], scaled[q] - scaled[r] + y)
            else:
                heapq.heappush(heaps[r * n + p], scaled[r] - scaled[p] + y)
        for r in peers:
            if r != p:
                weight[p][r] = top(p, r)
                weight[r][p] = top(r, p)
            if r != q:
                weight[q][r] = top(q, r)
                weight[r][q] = top(r, q)

    def augment(pred: list[int], b: int) -> None:
        path = [b]
        while pred[path[-1]] >= 0:
            path.append(pred[path[-1]])
        path.reverse()
        # Read every edge's pod before moving any: the path is shortest as a whole.
        steps = []
        for u, v in itertools.pairwise(path):
            e = weight[u][v]
            assert e is not None
            steps.append((e % m, u, v))
        for y, u, v in steps:
            move(y, u, v)

    # Most negative cycle first: from a fullest peer to an emptiest one.
    while True:
        hi = max(load)
        lo = min(load)
        if hi - lo <= 1:
            break
        dist, pred = shortest([p for p in peers if load[p] == hi])
        # Reachable: a fullest peer has an extra of some pod that an emptiest lacks.
        b = min(
            (p for p in peers if load[p] == lo and dist[p] is not None),
            key=lambda p: (dist[p], p),
        )
        augment(pred, b)
    # Balanced; hand the "+1" from a peer to another while that gains score.
    while True:
        hi = max(load)
        lo = min(load)
        if hi == lo:
            break
        dist, pred = shortest([p for p in peers if load[p] == hi])
        cands = [(d, p) for p in peers if load[p] == lo and (d := dist[p]) is not None and d < 0]
        if not cands:
            break
        augment(pred, min(cands)[1])
    return member


def divide_slots(pods: Mapping[str, int], peers: Sequence[str]) -> Division:
    """Divides the slots of ``pods`` (address -> cc) among ``peers``.

    Returns peer -> {address: slots owned}, every peer a key, pods with 0 slots for a
    peer omitted, cc=0 pods omitted everywhere. No peers: ``{}``. Raises ValueError on a
    duplicate peer or a cc that is not an int >= 0. Pure, does not yield.
    """
    names = _check_inputs(pods, peers)
    n = len(names)
    out: Division = {name: {} for name in names}
    if n == 0:
        return out
    items = sorted((a, cc) for a, cc in pods.items() if cc > 0)
    if n == 1:
        out[names[0]] = dict(items)
        return out
    hashers = _peer_hashers(names)
    split: list[tuple[str, int]] = []  # pods with extras: (address, cc // n)
    scores: list[list[int]] = []
    rems: list[int] = []
    rows = [out[name] for name in names]
    for address, cc in items:
        q, rem = divmod(cc, n)
        if rem:
            split.append((address, q))
            scores.append(_scores(hashers, address))
            rems.append(rem)
        else:
            for row in rows:
                row[address] = q
    member = _extras(scores, rems, n)
    for (address, q), extra in zip(split, member, strict=True):
        for p in range(n):
            c = q + extra[p]
            if c:
                rows[p][address] = c
    # Present every peer's pods in address order, whatever the path above.
    return {name: dict(sorted(out[name].items())) for name in names}


def owned_slots(pods: Mapping[str, int], peers: Sequence[str], me: str) -> dict[str, int]:
    """The slots ``me`` owns: ``divide_slots(pods, peers)[me]``.

    Raises ValueError if ``me`` is not among ``peers`` (an activator that is not in
    its own peer list would otherwise silently own nothing). Does not yield.
    """
    if me not in peers:
        raise ValueError(f"{me!r} is not one of the peers {sorted(peers)!r}")
    return divide_slots(pods, peers)[me]


def slot_owners(pods: Mapping[str, int], peers: Sequence[str]) -> dict[tuple[str, int], str]:
    """The slot-level view: (address, slot index) -> owning peer.

    Slot numbers are labels derived from the counts of ``divide_slots``: a pod's peers
    take consecutive slot numbers in the order of their score for that pod, best first.
    Movement is defined and bounded on counts (which is what capacity uses); a label
    can change owner where the counts did not. Does not yield.
    """
    division = divide_slots(pods, peers)
    names = sorted(division)
    hashers = _peer_hashers(names)
    counts = _by_pod(division)
    out: dict[tuple[str, int], str] = {}
    for address in sorted(counts):
        s = _scores(hashers, address)
        order = sorted(range(len(names)), key=s.__getitem__, reverse=True)
        i = 0
        for p in order:
            for _ in range(counts[address].get(names[p], 0)):
                out[(address, i)] = names[p]
                i += 1
    return out


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

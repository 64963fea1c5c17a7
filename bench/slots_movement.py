"""Movement and balance of the slot division (activator/core/slots.py), measured.

Run: .venv/bin/python bench/slots_movement.py
For random services (1-40 pods, random cc), how many slots move when a peer or a pod
is added or removed, or a cc changes, against the minimum that must move.
"""

import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from activator.core.slots import check_division, divide_slots, moved_slots


def rnd_pods(rng, cchi):
    return {
        f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(256)}:8080": rng.randint(1, cchi)
        for _ in range(rng.randint(1, 40))
    }


def report(label, rows):
    moved = [m for m, _ in rows]
    mins = [k for _, k in rows]
    extra = [m - k for m, k in rows]
    print(
        f"  {label:34s} moved avg {statistics.mean(moved):6.2f} max {max(moved):3d} | "
        f"minimum avg {statistics.mean(mins):6.2f} | extra avg {statistics.mean(extra):4.2f} "
        f"max {max(extra):2d} | extra=0 in {100 * extra.count(0) / len(extra):.0f}%"
    )


N = 500
for n, cchi in [(3, 4), (3, 1), (2, 2), (9, 4)]:
    rng = random.Random(1000 * n + cchi)
    add, rem, addpod, rmpod, ccp, ccm = [], [], [], [], [], []
    for _ in range(N):
        pods = rnd_pods(rng, cchi)
        peers = [f"act-{i}" for i in rng.sample(range(1000), n)]
        d = divide_slots(pods, peers)
        check_division(pods, peers, d)
        new = f"act-x{rng.randrange(1000)}"
        d4 = divide_slots(pods, [*peers, new])
        add.append((moved_slots(d, d4), sum(d4[new].values())))
        gone = rng.choice(peers)
        dm = divide_slots(pods, [p for p in peers if p != gone])
        rem.append((moved_slots(d, dm), sum(d[gone].values())))
        p2 = dict(pods)
        p2["192.168.0.1:1"] = rng.randint(1, cchi)
        addpod.append((moved_slots(d, divide_slots(p2, peers)), 0))
        p3 = dict(pods)
        p3.pop(rng.choice(sorted(pods)))
        rmpod.append((moved_slots(d, divide_slots(p3, peers)), 0))
        p4 = dict(pods)
        a = rng.choice(sorted(pods))
        p4[a] += 1
        ccp.append((moved_slots(d, divide_slots(p4, peers)), 0))
        p5 = dict(pods)
        a = rng.choice(sorted(pods))
        p5[a] -= 1
        ccm.append((moved_slots(d, divide_slots(p5, peers)), 0))
    print(f"{N} random services, 1..40 pods, cc 1..{cchi}, {n} peers:")
    report(f"add a peer ({n}->{n + 1})", add)
    report(f"remove a peer ({n}->{n - 1})", rem)
    report(f"add a pod (cc 1..{cchi})", addpod)
    report("remove a pod", rmpod)
    report("cc + 1 on one pod", ccp)
    report("cc - 1 on one pod", ccm)

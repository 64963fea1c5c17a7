"""``python -m bench.handover_ab BEFORE_DIR AFTER_DIR [--rounds N] [--quick]``: the
hand-over part of ``bench/fleet.py`` for two source trees, in one run.

Each tree is run as ``python -m activator`` with that tree first on ``PYTHONPATH`` (two
git worktrees: the commit before a change and the one after), in alternating rounds
(before, after, before, after, ...) so that a burst of outside load does not land on one
of them only. Prints, per tree, the hand-over latencies of every round pooled: from the
new owner's reload to the moved slot usable there, and to its first request on it
(median, p90, max), the failed requests and the highest peak of any pod.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import common as c
from . import fleet
from .report import Section


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(values: list[float]) -> str:
    if not values:
        return "n/a"
    ms = [v * 1000 for v in values]
    return f"median {statistics.median(ms):.0f} ms, p90 {_quantile(ms, 0.9):.0f} ms, max {max(ms):.0f} ms (n={len(ms)})"


def _one(tree: Path, work: Path, quick: bool) -> dict[str, Any]:
    """One hand-over run of ``tree`` (in this process: the next one starts afresh)."""
    os.environ["ACTIVATOR_BIN"] = f"env PYTHONPATH={tree} {sys.executable} -m activator"
    tools, _ = c.find_tools(install=False)
    ctx = c.Ctx(quick=quick, work=work, tools=tools)
    captured: dict[str, Any] = {}
    original = fleet._report_handover

    def capture(sec, fl, single, changes, load, stats, idle):  # type: ignore[no-untyped-def]
        captured.update(changes=[*single, *changes], load=load, stats=stats)
        original(sec, fl, single, changes, load, stats, idle)

    fleet._report_handover = capture  # type: ignore[assignment]
    fleet._handover(ctx, Section("fleet", tree.name))
    changes, load, stats = captured["changes"], captured["load"], captured["stats"]
    return {
        "usable": [ch.usable - ch.new_owner_applied for ch in changes if ch.moved and not math.isnan(ch.usable)],
        "first": [ch.first_use - ch.new_owner_applied for ch in changes if ch.moved and not math.isnan(ch.first_use)],
        "sent": load.sent,
        "failed": load.sent - load.ok,
        "peak": max((s.get("peak", 0) for s in stats), default=0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.handover_ab", description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # (a round of one tree, in a child process)
    args = ap.parse_args(argv)
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    if args.one:
        work = c.OUT / f"work-handover-ab-{os.getpid()}"
        work.mkdir(parents=True, exist_ok=True)
        print("RESULT " + json.dumps(_one(trees[args.one], work, args.quick)), flush=True)
        return 0
    pooled: dict[str, dict[str, Any]] = {
        name: {"usable": [], "first": [], "sent": 0, "failed": 0, "peak": 0} for name in trees
    }
    for round_ in range(args.rounds):
        for name in trees:
            c.log(f"handover A/B: round {round_ + 1}, {name} ({trees[name]})")
            command = [sys.executable, "-m", "bench.handover_ab", args.before, args.after, "--one", name]
            done = subprocess.run([*command, *(["--quick"] if args.quick else [])], capture_output=True, text=True)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"{name}: round {round_ + 1} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
                continue
            result = json.loads(line.removeprefix("RESULT "))
            into = pooled[name]
            into["usable"] += result["usable"]
            into["first"] += result["first"]
            into["sent"] += result["sent"]
            into["failed"] += result["failed"]
            into["peak"] = max(into["peak"], result["peak"])
    for name, tree in trees.items():
        r = pooled[name]
        print(f"{name} ({tree.name}): moved slot usable after the new owner applied the file: {_summary(r['usable'])}")
        print(f"{name} ({tree.name}): first request there: {_summary(r['first'])}")
        print(f"{name} ({tree.name}): failed {r['failed']} of {r['sent']}; highest pod peak {r['peak']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

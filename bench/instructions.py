"""CPU per proxied request as instruction counts: activator under valgrind's callgrind.

``python -m bench.instructions [--tree PATH ...] [-n N] [--rounds R] [--protocol h1|h2c ...] [--calls]``

Wall-clock and CPU-time figures move with the machine's load; the instructions a request
costs do not. Each activator (this tree, and every ``--tree``: another checkout, e.g. a
``git worktree`` of an older commit, run with it first on ``PYTHONPATH`` and the venv's
dependencies) runs under ``valgrind --tool=callgrind`` in front of one nginx pod on
loopback; the client (``h2load -c1 -m1``: one keep-alive connection, one request at a
time; ``--h1`` for HTTP/1.1, prior-knowledge h2c otherwise) runs outside valgrind.

After a warm-up run the counters are zeroed and the idle process is counted for a few
seconds: its timers (the deadline sweeper, the history's sampler, the status line) cost
some 800,000 instructions a second, and under valgrind a request lasts milliseconds, so
that work is subtracted from each run (its rate times the run's length). Then one client
run of N requests and one of 2N, each followed by a dump (``callgrind_control``): Ir per
request = (Ir(2N) - Ir(N)) / N, so what a client run costs once (its connection, the dump
itself) cancels out. ``--rounds`` repeats it, the builds interleaved; the median is
reported with the range. What is left of the noise (a few thousand per request) is work
that depends on time, e.g. the proxy's hang-up check of a request older than 5 ms, which
under valgrind some requests are.

``--calls`` also runs each activator under cProfile (N and 2N requests, one process each)
and prints the Python functions whose calls per request differ between the first tree and
the others: call counts are exact and load-independent, the diff shows where work was
added. Output (markdown) on stdout; the processes' files under ``bench/out/instructions/``.
"""

from __future__ import annotations

import argparse
import os
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from . import common as c

PROTOCOLS = ("h1", "h2c")
#: How long the idle process is measured, for the work its timers do per second.
IDLE_SECONDS = 5.0
_SERVICE = {"web": {"hosts": ["*"], "cc": 10, "queue_depth": 100, "pods": []}}


def _build(tree: Path | None) -> c.Build:
    if tree is None:
        return c.this_tree()
    sha = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return c.Build(
        f"{tree.name} ({sha.stdout.strip()})", [c.PYTHON, "-m", "activator"], {"PYTHONPATH": str(tree)}, tree
    )


def _client(port: int, protocol: str, n: int) -> None:
    """n requests on one keep-alive connection, one at a time; fails unless all are 2xx."""
    cmd = ["h2load", "-n", str(n), "-c1", "-m1", *(["--h1"] if protocol == "h1" else []), f"http://127.0.0.1:{port}/"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800).stdout
    m = re.search(r"status codes: (\d+) 2xx", out)
    if not m or int(m.group(1)) != n:
        raise RuntimeError(f"h2load did not get {n} answers 2xx:\n{out[-800:]}")


def _start(procs: c.Procs, name: str, build: c.Build, pod: int, wrapper: list[str]) -> c.Activator:
    config = c.activator_config({"web": {**_SERVICE["web"], "pods": [f"127.0.0.1:{pod}"]}})
    act = c.Activator(
        config,
        label=build.label,
        workdir=procs.dir / name,
        command=build.cmd,
        env=build.env,
        cwd=build.cwd,
        wrapper=wrapper,
        ready_timeout=600,
        start=False,
    )
    procs.add(act.start(wait_ready=False).process)
    act.wait_ready()
    return act


def _ir(dump: Path) -> int:
    m = re.search(r"^(?:summary|totals): (\d+)", dump.read_text(errors="replace"), re.M)
    if not m:
        raise RuntimeError(f"no totals in {dump}")
    return int(m.group(1))


def instructions(procs: c.Procs, name: str, build: c.Build, pod: int, protocol: str, n: int) -> tuple[float, float]:
    """Ir per request of ``build`` for ``protocol``: (Ir of 2N requests - Ir of N) / N, each
    less what the process's timers did meanwhile (their Ir per second, measured idle first,
    times the run's length: under valgrind a run lasts seconds, and the machine's load
    stretches it); and that idle rate."""
    out = procs.dir / name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("callgrind.out*"):
        old.unlink()
    # whole names in every dump: each one can be read alone (callgrind_annotate)
    valgrind = ["valgrind", "--tool=callgrind", "--compress-strings=no", f"--callgrind-out-file={out}/callgrind.out.%p"]
    act = _start(procs, name, build, pod, valgrind)
    _client(act.port, protocol, max(50, n // 5))  # warm-up: first-use costs, caches
    subprocess.run(["callgrind_control", "-z", str(act.pid)], capture_output=True, check=True, timeout=300)
    since = time.monotonic()

    def dump() -> tuple[int, float]:
        """Ir since the last dump (or zeroing), and the seconds that took."""
        nonlocal since
        before = set(out.glob("callgrind.out.*.*"))
        subprocess.run(["callgrind_control", "-d", str(act.pid)], capture_output=True, check=True, timeout=300)
        (new,) = set(out.glob("callgrind.out.*.*")) - before
        now, start = time.monotonic(), since
        since = now
        return _ir(new), now - start

    time.sleep(IDLE_SECONDS)
    idle_ir, idle_seconds = dump()
    rate = idle_ir / idle_seconds  # the timers' work (sweeper, history, status), per second
    work = []
    for count in (n, 2 * n):
        _client(act.port, protocol, count)
        ir, seconds = dump()
        work.append(ir - rate * seconds)
    procs.stop(act.process, grace=60)
    return (work[1] - work[0]) / n, rate


def _calls(procs: c.Procs, name: str, build: c.Build, pod: int, protocol: str, n: int) -> dict[str, int]:
    """Python calls of ``build`` during n requests (cProfile's primitive+recursive counts)."""
    profile = procs.dir / f"{name}.prof"
    act = _start(procs, name, dataclass_replace(build, ["-m", "cProfile", "-o", str(profile)]), pod, [])
    _client(act.port, protocol, n)
    procs.stop(act.process, grace=60)
    stats = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    calls: dict[str, int] = {}
    for func, entry in stats.items():
        calls[_where(func)] = calls.get(_where(func), 0) + int(entry[1])
    return calls


def dataclass_replace(build: c.Build, python_args: list[str]) -> c.Build:
    """``build`` with ``python_args`` after the interpreter (``python -m cProfile -o F -m activator``)."""
    return c.Build(build.label, [build.cmd[0], *python_args, *build.cmd[1:]], build.env, build.cwd)


def _where(func: tuple[str, int, str]) -> str:
    path, _, fn = func
    for marker in ("site-packages/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    if "/activator/" in path:
        path = "activator/" + path.rsplit("/activator/", 1)[1]
    fn = re.sub(r" at 0x[0-9a-f]+", "", fn)  # a builtin's address differs between processes
    return f"{path}:{fn}"  # no line: the same function in two trees compares


def per_request_calls(procs: c.Procs, name: str, build: c.Build, pod: int, protocol: str, n: int) -> dict[str, float]:
    small = _calls(procs, f"{name}-n", build, pod, protocol, n)
    large = _calls(procs, f"{name}-2n", build, pod, protocol, 2 * n)
    calls = {k: (large.get(k, 0) - small.get(k, 0)) / n for k in set(small) | set(large)}
    listing = sorted(((v, k) for k, v in calls.items() if v), reverse=True)
    (procs.dir / f"{name}-calls.txt").write_text("".join(f"{v:9.2f} {k}\n" for v, k in listing))
    return calls


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", type=Path, default=[], help="another checkout to measure (repeatable)")
    ap.add_argument("-n", type=int, default=500, help="requests in the first counted run (the second has 2N)")
    ap.add_argument("--protocol", action="append", choices=PROTOCOLS, help="h1 or h2c (default both)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the builds interleaved in each; medians reported")
    ap.add_argument("--calls", action="store_true", help="also diff Python calls per request (cProfile)")
    ap.add_argument("--no-this", action="store_true", help="measure only the --tree checkouts")
    args = ap.parse_args(argv)
    for tool in ("valgrind", "callgrind_control", "h2load", "nginx"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            print(f"{tool} is missing (apt install valgrind nghttp2-client nginx)", file=sys.stderr)
            return 2
    builds = [] if args.no_this else [_build(None)]
    builds += [_build(t.resolve()) for t in args.tree]
    protocols = args.protocol or list(PROTOCOLS)
    tools, _ = c.find_tools(install=False)
    work = c.OUT / "instructions"
    shutil.rmtree(work, ignore_errors=True)
    ctx = c.Ctx(quick=False, work=work, tools=tools, pinning=False)
    measured: dict[tuple[str, str], list[float]] = {(b.label, p): [] for p in protocols for b in builds}
    calls: dict[tuple[str, str], dict[str, float]] = {}
    with c.Procs(ctx, "run") as procs:
        _, pod = c.start_nginx(procs, role=None)
        for protocol in protocols:
            for r in range(args.rounds):
                for i, build in enumerate(builds):
                    t0 = time.monotonic()
                    ir, rate = instructions(procs, f"b{i}-{protocol}", build, pod, protocol, args.n)
                    took = time.monotonic() - t0
                    c.log(
                        f"{build.label} {protocol} #{r + 1}: {ir:,.0f} Ir/request, idle {rate:,.0f} Ir/s ({took:.0f}s)"
                    )
                    measured[(build.label, protocol)].append(ir)
            for i, build in enumerate(builds if args.calls else ()):
                calls[(build.label, protocol)] = per_request_calls(
                    procs, f"p{i}-{protocol}", build, pod, protocol, args.n
                )
    print(
        f"`python -m bench.instructions -n {args.n} --rounds {args.rounds}`: Ir per request = (Ir(2N) - Ir(N)) / N,"
        " less the timers' work; the median of the rounds, and their range\n"
    )
    print("| activator | protocol | Ir per request | range | vs first |")
    print("|---|---|---:|---:|---:|")
    for protocol in protocols:
        first = statistics.median(measured[(builds[0].label, protocol)])
        for build in builds:
            runs = measured[(build.label, protocol)]
            ir = statistics.median(runs)
            print(f"| {build.label} | {protocol} | {ir:,.0f} | {min(runs):,.0f}-{max(runs):,.0f} | {ir / first:.3f}x |")
    for protocol in protocols if args.calls else ():
        base = calls[(builds[0].label, protocol)]
        for build in builds[1:]:
            other = calls[(build.label, protocol)]
            diff = sorted(
                ((k, base.get(k, 0.0), other.get(k, 0.0)) for k in set(base) | set(other)),
                key=lambda r: -abs(r[2] - r[1]),
            )
            print(f"\n{protocol}: Python calls per request, {builds[0].label} -> {build.label} (largest changes)\n")
            print("| function | first | other | change |")
            print("|---|---:|---:|---:|")
            for k, a, b in diff[:60]:
                if abs(b - a) >= 0.5:
                    print(f"| `{k}` | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the time goes: py-spy on the running activator under wrk load.

activator (cpu1) in front of nginx (cpu0), wrk -t1 -c50 (cpu0); ``py-spy record
--nonblocking`` samples the process for 10 s (Python frames: ``--native`` needs the
blocking mode, which pauses the process for every sample and distorts it). The
collapsed stacks are reduced to: time by function (self), time by function (inclusive:
on the stack), and time by module file, as shares of the samples in which the process
was busy (py-spy leaves out idle samples, e.g. the hub waiting in epoll).

Returns markdown (not a Section): it goes at the end of RESULTS.md.
"""

from __future__ import annotations

import collections
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from . import common as c

T = TypeVar("T")


def ensure_pyspy(ctx: c.Ctx) -> str | None:
    if ctx.tools.get("py-spy"):
        return ctx.tools["py-spy"]
    if ctx.quick:
        return None
    c.log("installing py-spy into the venv (pip)")
    r = subprocess.run([c.PYTHON, "-m", "pip", "install", "-q", "py-spy"], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        ctx.note(f"pip install py-spy failed: {r.stderr.strip()[-200:]}")
        return None
    path = Path(c.PYTHON).parent / "py-spy"
    ctx.tools["py-spy"] = str(path) if path.exists() else None
    return ctx.tools["py-spy"]


_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]*)(?::(?P<line>\d+))?\)$")


def _short(frame: str, with_line: bool) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    path = m.group("file")
    for marker in ("site-packages/", "lib/python3", f"{c.ROOT}/"):  # paths shown relative to the repo
        if marker in path:
            path = path.split(marker, 1)[1]
    if path.startswith((".", "/")):
        path = path.rsplit("/", 2)[-1]
    line = f":{m.group('line')}" if with_line and m.group("line") else ""
    return f"{m.group('func')} ({path}{line})"


def analyse(
    raw: Path, top: int = 25
) -> tuple[int, list[tuple[str, float]], list[tuple[str, float]], list[tuple[str, float]]]:
    self_t: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    files: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        total += count
        frames = [_short(f, False) for f in stack.split(";")]
        self_t[frames[-1]] += count
        for f in set(frames):
            incl[f] += count
        leaf = _FRAME.match(stack.split(";")[-1])
        if leaf:
            path = _short(stack.split(";")[-1], False).rsplit("(", 1)[-1].rstrip(")")
            files[path] += count

    def share(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(k, 100 * v / total) for k, v in counter.most_common(top)] if total else []

    return total, share(self_t), share(incl), share(files)


#: (label, how, pattern): "self" = samples whose running frame matches, "incl" = samples
#: with a matching frame anywhere on the stack. Patterns match "function (file)".
GROUPS = (
    ("socket I/O: gevent send/recv/sendall (the syscalls included)", "self", "(gevent/_socketcommon.py)"),
    ("the upstream exchange, all of it (UpstreamPool.request)", "incl", "UpstreamPool.request ("),
    ("request headers built through email.feedparser (pywsgi headers_factory)", "incl", "headers_factory ("),
    ("pywsgi formatting a request-log line for the null log (format_request)", "incl", "format_request ("),
    ("gevent.Timeout objects (head timer, socket timeouts)", "self", "(gevent/timeout.py)"),
    ("falcon", "self", "(falcon/"),
    ("activator's own code (self time)", "self", "(activator/"),
    ("the event loop (Hub.run)", "self", "Hub.run ("),
)


def groups(raw: Path) -> list[tuple[str, float]]:
    counts = dict.fromkeys(range(len(GROUPS)), 0)
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = [_short(f, False) for f in stack.split(";")]
        total += int(n)
        for i, (_, how, pattern) in enumerate(GROUPS):
            hit = pattern in frames[-1] if how == "self" else any(pattern in f for f in frames)
            if hit:
                counts[i] += int(n)
    return (
        [
            (GROUPS[i][0] + (" [self]" if GROUPS[i][1] == "self" else " [on stack]"), 100 * counts[i] / total)
            for i in range(len(GROUPS))
        ]
        if total
        else []
    )


def record(
    ctx: c.Ctx, procs: c.Procs, spy: str, pid: int, seconds: float, load: Callable[[float], T], name: str = "py-spy"
) -> tuple[Path, T] | None:
    """``py-spy record -r 250 --nonblocking`` of process ``pid`` for ``seconds`` while
    ``load(seconds + 1)`` runs; the raw collapsed stacks (``<scenario>/<name>.txt``) and
    what ``load`` returned, or None (and a run note) when py-spy could not sample it.

    Python frames only, --nonblocking: --native needs the blocking mode, which pauses the
    process for every sample; tried here it cut throughput ~8x and counted the hub's
    epoll_wait as busy, so the shares meant little."""
    out = procs.dir / f"{name}.txt"
    cmd = [spy, "record", "-r", "250", "-f", "raw", "-o", str(out), "-d", str(int(seconds)), "-p", str(pid)]
    sampler = procs.start(name, [*cmd, "--nonblocking"])
    time.sleep(0.5)
    result = load(seconds + 1)
    code = procs.finish(sampler, timeout=60)
    if code == 0 and out.exists() and out.stat().st_size > 0:
        return out, result
    ctx.note(f"py-spy failed: {(sampler.stdout_text() + sampler.stderr_text()).strip()[-300:]}")
    return None


def shares_by(raw: Path, classify: Callable[[str], str]) -> list[tuple[str, float]]:
    """Busy samples by what ``classify`` says of the running frame's file (shown relative
    to the repository or site-packages), largest first, as % of the busy samples."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        path = _short(stack.split(";")[-1], False).rsplit("(", 1)[-1].rstrip(")")
        counts[classify(path)] += int(n)
    total = sum(counts.values())
    return [(k, 100 * v / total) for k, v in counts.most_common()] if total else []


def run(ctx: c.Ctx) -> str:
    spy = ensure_pyspy(ctx)
    if spy is None:
        return "## Where the time goes\n\npy-spy not available: profile skipped.\n"
    seconds = ctx.dur(10, 2)
    mode = "--nonblocking"
    with c.Procs(ctx, "profile") as procs:
        _, nginx = c.start_nginx(procs)
        act = c.start_activator(
            procs,
            "activator",
            {"web": {"hosts": ["*"], "cc": 100, "queue_depth": 1000, "pods": [f"127.0.0.1:{nginx}"]}},
        )
        c.run_wrk(ctx, act.port, 1)
        sampled = record(ctx, procs, spy, act.pid, seconds, lambda s: c.run_wrk(ctx, act.port, s, cpu_pids=[act.pid]))
        if sampled is None:
            return "## Where the time goes\n\npy-spy could not sample the process: profile skipped.\n"
        out, result = sampled
    total, self_t, incl, files = analyse(out)
    lines = [
        "## Where the time goes (py-spy)",
        "",
        (
            f"activator pinned to one core, wrk -t1 -c50 against nginx through it, {result.rps:,.0f} req/s "
            f"({result.cpu_us:.0f} us CPU per request) while `py-spy record -r 250 {mode}` sampled it "
            f"for {seconds:g} s: {total:,} busy samples. Shares are of the busy samples. The raw collapsed stacks "
            f"are in `{out.relative_to(c.ROOT)}` (git-ignored; render with any flamegraph tool)."
        ),
        "",
        "**Named costs** (overlapping groups, shares of busy samples)",
        "",
        "| what | % |",
        "|---|---|",
    ]
    lines += [f"| {label} | {p:.1f} |" for label, p in groups(out)]
    lines += ["", "**By file (self time)**", "", "| file | self % |", "|---|---|"]
    lines += [f"| `{f}` | {p:.1f} |" for f, p in files[:15]]
    lines += [
        "",
        "**Top functions, self time** (the function itself was running)",
        "",
        "| function | self % |",
        "|---|---|",
    ]
    lines += [f"| `{f}` | {p:.1f} |" for f, p in self_t[:25]]
    lines += ["", "**Top functions, inclusive** (on the stack)", "", "| function | inclusive % |", "|---|---|"]
    lines += [f"| `{f}` | {p:.1f} |" for f, p in incl[:40]]
    return "\n".join(lines) + "\n"

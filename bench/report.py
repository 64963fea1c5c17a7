"""What a scenario hands back, and how RESULTS.md is written from it."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .common import COMPILED_MODULES, ROOT, Ctx, fmt, ncpu, pin_text, tool_versions


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[Any]]

    def render(self) -> str:
        out = [
            f"**{self.title}**",
            "",
            "| " + " | ".join(self.headers) + " |",
            "|" + "|".join("---" for _ in self.headers) + "|",
        ]
        for row in self.rows:
            out.append("| " + " | ".join(fmt(c) for c in row) + " |")
        return "\n".join(out)


@dataclass
class Target:
    name: str
    goal: str
    measured: str
    met: bool | None  # None: could not be measured in this run
    gap: str = ""
    why: str = ""  # what limits it (shown when not met)
    group: str = "issue 8"  # the issue that set it: one table of targets per group

    def verdict(self) -> str:
        return "n/a" if self.met is None else ("**met**" if self.met else "**not met**")


@dataclass
class Section:
    name: str
    title: str
    intro: str = ""
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    headline: list[str] = field(default_factory=list)
    seconds: float = 0.0
    load: str = ""
    error: str | None = None

    def add_target(self, target: Target) -> None:
        """A target, and its line in the headline: what was measured against the goal, met or not."""
        self.targets.append(target)
        self.headline.append(f"{target.name}: {target.measured} (goal {target.goal}): {target.verdict()}")

    def render(self) -> str:
        out = [f"## {self.title}", ""]
        if self.error:
            out += [f"**Scenario failed:** `{self.error}`", ""]
        if self.intro:
            out += [self.intro, ""]
        for t in self.tables:
            out += [t.render(), ""]
        for n in self.notes:
            out.append(f"- {n}")
        if self.notes:
            out.append("")
        out.append(f"_(scenario took {self.seconds:.0f} s; load average {self.load})_")
        out.append("")
        return "\n".join(out)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def git_rev() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "activator"], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()
        return rev + (" (activator/ has uncommitted changes)" if dirty else "")
    except OSError:
        return "?"


def previous_engine(ctx: Ctx) -> str:
    baseline = ctx.baseline
    if baseline is None:
        return "not measured in this run"
    if baseline.build is not None:
        return (
            f"{baseline.build.label}: `python -m activator` from a git worktree of `{baseline.commit}` (`--baseline`)"
        )
    return f"`{baseline.commit}` not available ({baseline.failure or 'not used by the scenarios run'})"


def compiled_build(ctx: Ctx) -> str:
    compiled = ctx.compiled
    if compiled is None:
        return "not measured in this run (`--compiled`)"
    if compiled.build is not None:
        modules = ", ".join(f"`{m.removeprefix('activator/')}`" for m in COMPILED_MODULES)
        return f"{compiled.build.label}: a copy of `activator/` with {modules} compiled by mypyc (`--compiled`)"
    return f"not available ({compiled.failure or 'not used by the scenarios run'})"


def machine_lines(ctx: Ctx) -> list[str]:
    import falcon
    import gevent

    versions = tool_versions(ctx.tools)
    mem = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) // 1024} MiB"
    except OSError:
        pass
    return [
        f"- CPUs: {ncpu()} (nproc), `{cpu_model()}`, memory {mem}",
        f"- kernel: `{platform.release()}`; {platform.platform()}",
        f"- python: {platform.python_version()}; gevent {gevent.__version__}, falcon {falcon.__version__}",
        f"- haproxy: `{versions.get('haproxy', 'not available')}`",
        f"- nginx: `{versions.get('nginx', 'not available')}`",
        f"- wrk: `{versions.get('wrk', 'not available (Python closed-loop generator used instead)')}`",
        f"- activator: `{os.environ.get('ACTIVATOR_BIN') or 'python -m activator'}` at commit {git_rev()}",
        f"- previous engine: {previous_engine(ctx)}",
        f"- compiled build: {compiled_build(ctx)}",
        f"- pinning: {pin_text(ctx)}",
    ]


def render(ctx: Ctx, sections: list[Section], command: str, started: float, profile_md: str | None) -> str:
    out = ["# activator benchmarks", ""]
    out += [
        (
            f"Recorded by `{command}` on {time.strftime('%Y-%m-%d %H:%M %Z', time.localtime(started))}, "
            f"{time.time() - started:.0f} s in all"
            f"{' (QUICK mode: short runs, numbers are rough)' if ctx.quick else ''}."
        ),
        (
            "Everything ran on this one machine, servers on 127.0.0.1, in one run: compare the ratios "
            "(against the baseline measured in the same run) rather than absolute numbers."
        ),
        "",
    ]
    out += ["## Machine", "", *machine_lines(ctx), ""]
    out += [
        "## Method",
        "",
        (
            "- Every server is started by the bench on 127.0.0.1 (free ports), its output in `bench/out/work/` "
            "(git-ignored). Configurations are written by the scenario modules (`bench/*.py`); activator runs as "
            "`python -m activator run -c CONFIG` (or `$ACTIVATOR_BIN run -c CONFIG`), `access_log: false` unless a "
            "row says otherwise. The previous engine (activator at the commit before the HTTP engine work, "
            "`--baseline`) runs the same way from a git worktree the bench makes under `bench/out/` and removes at "
            "the end of the run."
        ),
        (
            "- Closed-loop saturation: `wrk -t1 -c50` (Debian's wrk 4.1). Open loop (fixed rate, Poisson arrivals, "
            "bursts), the churn clients and the 10,000 held connections: `bench/loadgen.py`, raw sockets and epoll, "
            "waits through select() for microsecond timers; an open-loop request's latency runs from its *scheduled* "
            "send time, so a stalled proxy cannot hide behind a slowed-down generator (coordinated omission). wrk2 "
            "and vegeta are not packaged in Debian 12; hey's `-q` is a per-worker closed-loop rate."
        ),
        (
            "- CPU us/req: user + system CPU time of the server process (and its children) from /proc over a wrk "
            "run, divided by the requests served. On a shared machine it is much steadier than req/s."
        ),
        (
            "- Each comparison runs its targets in interleaved rounds and reports medians, so a burst of outside "
            "load does not land on one target only."
        ),
        "",
    ]
    heads = [h for s in sections for h in s.headline]
    if heads:
        out += ["## Headline", ""] + [f"- {h}" for h in heads] + [""]
    targets = [t for s in sections for t in s.targets]
    for group in dict.fromkeys(t.group for t in targets):  # in order of first appearance
        out += [f"## Targets ({group})", "", "| target | goal | measured | met | gap |", "|---|---|---|---|---|"]
        out += [
            f"| {t.name} | {t.goal} | {t.measured} | {t.verdict()} | {t.gap or '-'} |"
            for t in targets
            if t.group == group
        ]
        out.append("")
        unmet = [t for t in targets if t.group == group and t.met is False and t.why]
        if unmet:
            out += ["What limits the targets not met:", ""] + [f"- **{t.name}**: {t.why}" for t in unmet] + [""]
    for s in sections:
        out.append(s.render())
    if profile_md:
        out += [profile_md, ""]
    if ctx.notes:
        out += ["## Run notes", ""] + [f"- {n}" for n in ctx.notes] + [""]
    return "\n".join(out)

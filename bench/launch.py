"""Launched pods: activator's own share of a cold start, and the cost of the decisions.

- **Cold start.** One activator with ``COLD_SERVICES`` launched services of one pod each
  (``bench/cold_pod.py``, which writes when it listens, behind ``bash`` noting the time
  of the fork). Each service gets one request, one after the other, each a cold start.
  The pod's own boot is from the fork to its socket listening (the interpreter's
  start-up included); activator's own share is the rest of what the client waited: from
  the request to the fork (deciding, spawning) plus from the pod listening to the answer
  (probing it ready, handing the waiter its slot, proxying), less the same request sent
  to the pod directly afterwards. A fork to bash alone, from Python, is measured in the
  same run as the baseline of what spawning costs here. Goal (issue 28): under 50 ms.
- **Decisions.** In one process, without sockets: ``Launches.step`` over
  ``DECISION_SERVICES`` launched services (two pods each, demand changing every sampled
  second), against the writer's own periodic work on the same services
  (``Topology.tick``) as the baseline measured in the same run: the cost of one second
  of scaling decisions, and its ratio."""

from __future__ import annotations

import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import harness

from . import common as c
from .report import Section, Table, Target

COLD_SERVICES = 10
DECISION_SERVICES = 1000
POD = Path(__file__).resolve().parent / "cold_pod.py"
#: The pod's command: note the time of the fork (bash starts in about a millisecond and
#: ``$EPOCHREALTIME`` forks nothing), then become the pod: the interpreter's start-up is
#: the pod's own boot.
SPAWN = f'echo "spawn $EPOCHREALTIME" >> "$1"; exec {sys.executable} {POD} "$0" "$1"'


def _cold_starts(ctx: c.Ctx, sec: Section) -> None:
    count = ctx.n(COLD_SERVICES, 3)
    ports = harness.free_ports(count)
    with c.Procs(ctx, "launch") as procs:
        times = procs.dir / "times"
        procs.dir.mkdir(parents=True, exist_ok=True)
        services = {}
        for i, port in enumerate(ports):
            services[f"s{i}"] = harness.service_config(
                [f"127.0.0.1:{port}"],
                hosts=[f"s{i}.bench"],
                probe=harness.probe_config("1s"),
                launch={"command": ["/bin/bash", "-c", SPAWN, "{port}", f"{times}-{port}"], "max": 1},
            )
        config = {"access_log": False, "grace_period": "1s", "services": services}
        act = c.Activator(config, label="activator", workdir=procs.dir / "activator", start=False)
        procs.add(act.start(wait_ready=True).process)
        rows = []
        own_ms: list[float] = []
        try:
            for i, port in enumerate(ports):
                sent = time.time()
                response = harness.request(act.listen, path="/", host=f"s{i}.bench", timeout=60)
                answered = time.time()
                assert response.status == 200, response
                marks = dict(line.split() for line in Path(f"{times}-{port}").read_text().splitlines())
                started, listening = float(marks["spawn"]), float(marks["listen"])
                direct_started = time.time()
                harness.request(f"127.0.0.1:{port}", path="/", timeout=10)
                direct = time.time() - direct_started
                boot = listening - started
                before, after = started - sent, answered - listening - direct
                own = (before + after) * 1000
                own_ms.append(own)
                rows.append([f"s{i}", (answered - sent) * 1000, boot * 1000, before * 1000, after * 1000, own])
        finally:
            for port in ports:  # stop_pods_on_exit is false: the pods outlive activator
                try:
                    pid = int(next(p for p in Path("/proc").iterdir() if _listens(p, port)).name)
                except StopIteration:
                    continue
                os.kill(pid, signal.SIGKILL)
    sec.tables.append(
        Table(
            "Cold starts (ms): client's wait, the pod's own boot, and activator's own share",
            ["service", "client waited", "pod boot (fork to listen)", "request to fork", "listen to answer", "own"],
            rows,
        )
    )
    median = statistics.median(own_ms)
    spawn = _spawn_alone(len(own_ms))
    sec.tables.append(
        Table(
            "Baseline in the same run: a fork to bash's first instruction, alone (gevent Popen from Python)",
            ["spawns", "median ms", "max ms", "activator's own median minus this"],
            [[len(spawn), statistics.median(spawn), max(spawn), median - statistics.median(spawn)]],
        )
    )
    sec.add_target(
        Target(
            "activator's own share of a cold start (median)",
            "< 50 ms",
            f"{median:.1f} ms (max {max(own_ms):.1f} ms, {len(own_ms)} cold starts)",
            median < 50,
            group="issue 28",
        )
    )


def _spawn_alone(count: int) -> list[float]:
    """Milliseconds from a gevent ``Popen`` to bash's first instruction, ``count`` times:
    what any launcher pays to fork on this machine now."""
    import gevent.subprocess

    spawned = []
    for _ in range(count):
        before = time.time()
        out = gevent.subprocess.run(["/bin/bash", "-c", "echo $EPOCHREALTIME"], stdout=gevent.subprocess.PIPE).stdout
        spawned.append((float(out) - before) * 1000)
    return spawned


def _listens(proc: Path, port: int) -> bool:
    """Whether the process ``/proc/PID`` has a socket listening on ``port`` (for cleanup)."""
    if not proc.name.isdigit():
        return False
    try:
        cmdline = (proc / "cmdline").read_bytes()
    except OSError:
        return False
    return b"cold_pod.py" in cmdline and str(port).encode() in cmdline


def _decisions(ctx: c.Ctx, sec: Section) -> None:
    from activator.core.autoscale import Launches, PodView, ServiceView
    from activator.core.config import Config, LaunchConfig, PodConfig, ProbeConfig, ServiceConfig
    from activator.core.topology import Topology

    count = ctx.n(DECISION_SERVICES, 100)
    seconds = ctx.n(120, 20)
    services = {}
    for i in range(count):
        pods = tuple(
            PodConfig(f"10.{i // 250}.{i % 250}.{n}:8000", f"10.{i // 250}.{i % 250}.{n}", 8000) for n in (1, 2)
        )
        services[f"s{i}"] = ServiceConfig(
            f"s{i}",
            (f"s{i}.bench",),
            probe=ProbeConfig(),
            pods=pods,
            launch=LaunchConfig(command=("model", "{port}"), stable_window=60.0, scale_to_zero_after=30.0),
        )
    config = Config(path="bench", services=services)
    topology = Topology(config, 0.0)
    launches = Launches()
    launches.configure(config, 0.0)
    rng = random.Random(1)
    healthy: set[str] = set()
    spent = baseline = 0.0
    for second in range(seconds):
        now = float(second + 1)
        views: dict[str, Any] = {}
        for name, service in services.items():
            demand = rng.choice((0, 0, 1, 1, 2, 3))
            pods = {p.address: PodView(p.address in healthy, 0) for p in service.pods}
            views[name] = ServiceView(demand, 0, second * demand, pods)
        started = time.perf_counter()
        effects = launches.step(now, views, sample=True)
        spent += time.perf_counter() - started
        for effect in effects:  # pods come up by the next second, go when stopped
            if effect.action.value == "start":
                healthy.add(effect.pod)
            elif effect.action.value == "stop":
                healthy.discard(effect.pod)
                launches.ended(effect.service, effect.pod, now, "stopped")
        started = time.perf_counter()
        topology.tick(now)
        topology.tick(now + 0.5)  # the writer ticks twice a second
        baseline += time.perf_counter() - started
    per_second = spent / seconds * 1000
    sec.tables.append(
        Table(
            f"Scaling decisions for {count} launched services (one sampled step per second, {seconds} s)",
            ["work", "ms per second", "share of one core"],
            [
                ["Launches.step (every launched service)", per_second, f"{per_second / 10:.2f}%"],
                ["baseline: the writer's two ticks (Topology.tick)", baseline / seconds * 1000, ""],
                ["ratio decisions / ticks", spent / baseline if baseline else None, ""],
            ],
        )
    )
    sec.headline.append(
        f"scaling decisions, {count} launched services: {per_second:.2f} ms per second of one core "
        f"({spent / baseline:.2f}x the writer's own ticks over them)"
    )


def run(ctx: c.Ctx) -> Section:
    sec = Section("launch", "Launched pods: activator's own share of a cold start, decisions' cost")
    sec.intro = (__doc__ or "").split("\n\n", 1)[1].strip()
    _cold_starts(ctx, sec)
    _decisions(ctx, sec)
    return sec

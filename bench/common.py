"""What the benchmarks add to the test harness: tools, pinning, configs, load, numbers.

The processes, ports and waits are ``tests/harness.py``'s, the same as the end-to-end
tests use (``bench/__init__.py`` puts ``tests/`` on ``sys.path``): every server is a
:class:`harness.Process` started by the bench on 127.0.0.1 (free ports picked by binding
port 0), in its own process group (killed if the bench dies), with its output in
``bench/out/work*/<scenario>/``; ``Procs.stop_all`` ends exactly the processes the bench
started (SIGTERM, then SIGKILL to the whole group after a grace period).

Pinning (``taskset``, only with >= 2 CPUs): the process under test (activator,
HAProxy, the Falcon hello app, the minimal forwarder) on cpu1; nginx, the backend pods,
wrk and the Python load generator on cpu0. The "workers" scenario runs unpinned.

Two activators can be measured in one run: this tree (``python -m activator``, or
``$ACTIVATOR_BIN``) and the previous engine, activator at an earlier commit (``--baseline``)
checked out by the bench in a git worktree under the run's work directory, made on first
use and removed at the end of the run.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import harness

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
OUT = BENCH / "out"
PYTHON = sys.executable
LOCALHOST = harness.LOCALHOST
#: The previous engine's commit: the last one before the HTTP engine work (``--baseline``).
BASELINE_COMMIT = "26dbad7"


# ---------------------------------------------------------------------------------------
# context of one run


@dataclass
class Ctx:
    quick: bool
    work: Path
    tools: dict[str, str | None]
    notes: list[str] = field(default_factory=list)
    pinning: bool = True
    rt: bool = False  # real-time priority available for the latency measurements
    baseline: Baseline | None = None  # the previous engine, when the run has one
    compiled: Compiled | None = None  # this tree compiled with mypyc (``--compiled``)

    def dur(self, full: float, quick: float) -> float:
        return quick if self.quick else full

    def n(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    def dir(self, name: str) -> Path:
        d = self.work / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def note(self, text: str) -> None:
        print(f"[bench] note: {text}", flush=True)
        self.notes.append(text)


def log(text: str) -> None:
    print(f"[bench] {time.strftime('%H:%M:%S')} {text}", flush=True)


# ---------------------------------------------------------------------------------------
# tools


def find_tools(install: bool = True) -> tuple[dict[str, str | None], list[str]]:
    """Locate haproxy, nginx, wrk, taskset; apt-get install the missing ones when root."""
    notes: list[str] = []
    wanted = {"haproxy": "haproxy", "nginx": "nginx-light", "wrk": "wrk"}

    def where(name: str) -> str | None:
        return shutil.which(name) or next(
            (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None
        )

    missing = [pkg for name, pkg in wanted.items() if where(name) is None]
    if missing and install:
        if os.geteuid() != 0:
            notes.append(f"not root: did not try to install {' '.join(missing)}")
        elif shutil.which("apt-get") is None:
            notes.append(f"no apt-get: could not install {' '.join(missing)}")
        else:
            log(f"installing {' '.join(missing)} with apt-get")
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")

            def apt_get(*args: str) -> subprocess.CompletedProcess[str]:
                return subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True, check=False)

            r = apt_get("install", "-y", "--no-install-recommends", *missing)
            if r.returncode != 0:  # stale package lists: refresh them once, then try again
                apt_get("update", "-qq")
                r = apt_get("install", "-y", "--no-install-recommends", *missing)
            if r.returncode != 0:
                notes.append(f"apt-get install {' '.join(missing)} failed: {r.stderr.strip()[-300:]}")
    tools: dict[str, str | None] = {name: where(name) for name in wanted}
    tools["taskset"] = shutil.which("taskset")
    pyspy = Path(PYTHON).parent / "py-spy"
    tools["py-spy"] = str(pyspy) if pyspy.exists() else shutil.which("py-spy")
    for name in wanted:
        if tools[name] is None:
            notes.append(f"{name} not available: the scenarios that need it are skipped or use a fallback")
    return tools, notes


def tool_versions(tools: dict[str, str | None]) -> dict[str, str]:
    def first_line(cmd: list[str]) -> str:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return "?"
        text = (r.stdout + r.stderr).strip().splitlines()
        return text[0].strip() if text else "?"

    out = {}
    if tools.get("haproxy"):
        out["haproxy"] = first_line([tools["haproxy"], "-v"])  # type: ignore[list-item]
    if tools.get("nginx"):
        out["nginx"] = first_line([tools["nginx"], "-v"])  # type: ignore[list-item]
    if tools.get("wrk"):
        out["wrk"] = first_line([tools["wrk"], "-v"])  # type: ignore[list-item]
    return out


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def ncpu() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def rt_available() -> bool:
    """Can we give processes SCHED_RR priority (chrt, root or CAP_SYS_NICE)?"""
    if shutil.which("chrt") is None:
        return False
    try:
        return subprocess.run(["chrt", "-r", "1", "true"], capture_output=True, check=False).returncode == 0
    except OSError:
        return False


def set_rt(pids: Iterable[int], on: bool) -> None:
    """SCHED_RR priority 1 (on) or back to SCHED_OTHER, for these processes, their threads
    and their descendants. Used only while the load is light (open-loop latency runs):
    the processes then never wait behind other work on the machine, and use a small
    share of a core, so nothing else is starved (the kernel caps real-time at 95% anyway)."""
    for pid in pids:
        for p in [pid, *children_of(pid)]:
            cmd = ["chrt", "-a", "-r", "-p", "1", str(p)] if on else ["chrt", "-a", "-o", "-p", "0", str(p)]
            subprocess.run(cmd, capture_output=True, check=False)


@contextmanager
def realtime(ctx: Ctx, pids: Iterable[int]) -> Iterator[None]:
    """SCHED_RR for these processes while the block runs (when available), normal priority after."""
    pids = list(pids)
    if ctx.rt:
        set_rt(pids, True)
    try:
        yield
    finally:
        if ctx.rt:
            set_rt(pids, False)


def rt_prefix(ctx: Ctx, rt: bool) -> list[str]:
    return ["chrt", "-r", "1"] if rt and ctx.rt else []


def pin(ctx: Ctx, role: str) -> list[str]:
    """taskset prefix: role 'proxy' -> cpu1, 'load' -> cpu0, anything else unpinned."""
    if not ctx.pinning or ctx.tools.get("taskset") is None or ncpu() < 2:
        return []
    cpus = sorted(os.sched_getaffinity(0))
    cpu = {"proxy": cpus[1], "load": cpus[0]}.get(role)
    return [] if cpu is None else ["taskset", "-c", str(cpu)]


def pin_text(ctx: Ctx) -> str:
    if not pin(ctx, "proxy"):
        return "no pinning (fewer than 2 CPUs or no taskset)"
    return (
        f"proxy under test (activator / HAProxy / Falcon hello / forwarder) on cpu{pin(ctx, 'proxy')[-1]}; "
        f"nginx, backend pods, wrk and the Python load generator on cpu{pin(ctx, 'load')[-1]}; "
        "the workers scenario unpinned"
    )


# ---------------------------------------------------------------------------------------
# processes: the harness's, per scenario; their CPU time


_CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time of these processes and all their descendants, in seconds."""
    total = 0.0
    seen: set[int] = set()
    for pid in pids:
        for p in [pid, *children_of(pid)]:
            if p in seen:
                continue
            seen.add(p)
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / _CLK
    return total


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def children_of(pid: int) -> list[int]:
    out: list[int] = []
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for k in kids:
        out.append(int(k))
        out.extend(children_of(int(k)))
    return out


class Procs:
    """The processes one scenario started (:class:`harness.Process`), their output in
    ``bench/out/work*/<scenario>/``; ``stop_all`` ends them (and only them)."""

    def __init__(self, ctx: Ctx, scenario: str) -> None:
        self.ctx = ctx
        self.dir = ctx.dir(scenario)
        self.procs: list[harness.Process] = []

    def start(
        self,
        name: str,
        cmd: Sequence[str],
        role: str | None = None,
        env: dict[str, str] | None = None,
        cwd: Path = ROOT,
    ) -> harness.Process:
        """``cmd`` pinned for ``role`` (:func:`pin`), its output in ``<name>.out`` and ``<name>.err``."""
        proc = harness.Process(
            [*(pin(self.ctx, role) if role else []), *cmd],
            stdout_path=self.dir / f"{name}.out",
            stderr_path=self.dir / f"{name}.err",
            env=env,
            cwd=cwd,
            name=name,
        )
        return self.add(proc)

    def add(self, proc: harness.Process) -> harness.Process:
        """Track a process started by the harness (an activator, a pod) for ``stop_all``."""
        self.procs.append(proc)
        return proc

    def finish(self, proc: harness.Process, timeout: float) -> int:
        """Wait for a process that ends by itself (a load generator, py-spy); its exit code."""
        code = proc.wait(timeout)
        self.procs.remove(proc)
        return code

    def stop(self, proc: harness.Process, grace: float = 5.0) -> None:
        rc = proc.returncode
        if rc is not None:  # it should still be running: say so in the results
            self.ctx.note(
                f"{self.dir.name}: {proc.name} (pid {proc.pid}) had exited on its own before the end of "
                f"its scenario, exit status {rc}; see {proc.stderr_path.relative_to(ROOT)}"
            )
        proc.stop(grace)  # the group may hold children (nginx/haproxy workers, activator workers)
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in list(reversed(self.procs)):
            self.stop(proc)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


# ---------------------------------------------------------------------------------------
# which activator


@dataclass
class Build:
    """An activator to run: the command before ``run -c CONFIG``, with its environment and directory."""

    label: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = ROOT


def this_tree() -> Build:
    """This working tree, or ``$ACTIVATOR_BIN`` (what the e2e tests run: :func:`harness.activator_command`)."""
    return Build("activator (this tree)", harness.activator_command())


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False, timeout=120)


class ExtraBuild:
    """An activator other than this tree's, made in ``path`` on first use (``_make``) and
    run as ``python -m activator`` with ``path`` as its working directory (``-m`` puts the
    working directory first on sys.path) and on ``PYTHONPATH`` (ahead of the venv's
    editable install of this tree); its dependencies are the venv's. When it cannot be
    made or does not start, its rows are left out (with a run note) and it is not tried again."""

    what = "an extra build"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.build: Build | None = None
        self.failure: str | None = None  # why it could not be had; then it is not tried again

    def get(self, ctx: Ctx) -> Build | None:
        """The build, made on the first call; None (and a run note) when it cannot be had."""
        if self.build is None and self.failure is None:
            try:
                self.build = self._make()
            except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
                self.failure = str(exc)
                ctx.note(f"{self.what} not available, its rows are left out: {exc}")
        return self.build

    def _make(self) -> Build:
        raise NotImplementedError

    def _imported_from_path(self, build: Build, module: str) -> Path:
        """Where ``module`` is imported from under ``build``; raises unless it is inside ``path``."""
        probe = subprocess.run(
            [PYTHON, "-c", f"import {module} as m; print(m.__file__)"],
            cwd=str(self.path),
            env=dict(os.environ, **build.env),
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        imported = Path(probe.stdout.strip() or "?").resolve()
        if self.path.resolve() not in imported.parents:
            raise RuntimeError(f"{module} is not imported from {self.path} ({imported}): {probe.stderr[-300:]}")
        return imported

    def start(self, procs: Procs, name: str, services: dict[str, dict[str, Any]], **options: Any) -> Activator | None:
        """This build with this config, once ready (``start_activator``'s options); None and a run
        note when it cannot be had or does not start (e.g. a dependency of an old engine missing
        from the venv): its rows are then left out and the scenario goes on."""
        build = self.get(procs.ctx)
        if build is None:
            return None
        try:
            return start_activator(procs, name, services, build=build, **options)
        except harness.HarnessError as exc:  # it exited, or was not ready in time (and was killed)
            stderr = procs.dir / name / "stderr.log"
            lines = stderr.read_text(errors="replace").strip().splitlines() if stderr.exists() else []
            self.build, self.failure = None, f"{str(exc).splitlines()[0]}: {lines[-1] if lines else 'no output'}"
            procs.ctx.note(f"{build.label} did not start, its rows are left out: {self.failure}")
            return None

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class Baseline(ExtraBuild):
    """activator at an earlier commit (the previous engine), from a git worktree of this repository
    (the old engine's geventhttpclient comes from the venv)."""

    def __init__(self, commit: str, path: Path) -> None:
        super().__init__(path)
        self.commit = commit
        self.what = f"previous engine ({commit})"

    def _make(self) -> Build:
        sha = _git("rev-parse", "--verify", "--short", f"{self.commit}^{{commit}}")
        if sha.returncode != 0:
            raise RuntimeError(f"git rev-parse {self.commit}: {sha.stderr.strip()}")
        short = sha.stdout.strip()
        # --force: a worktree left registered by a run that died (its directory went with
        # the work directory) is taken over instead of refused
        added = _git("worktree", "add", "--force", "--detach", str(self.path), short)
        if added.returncode != 0:
            raise RuntimeError(f"git worktree add: {added.stderr.strip()}")
        build = Build(
            f"activator (previous engine, {short})",
            [PYTHON, "-m", "activator"],
            {"PYTHONPATH": str(self.path)},
            self.path,
        )
        self._imported_from_path(build, "activator")
        log(f"previous engine: {build.label} from {self.path.relative_to(ROOT)}")
        return build

    def remove(self) -> None:
        if self.path.exists():
            _git("worktree", "remove", "--force", str(self.path))
        super().remove()


#: What ``--compiled`` compiles: the modules every proxied HTTP/1.1 request runs through.
#: Not the core's throttler (mypyc cannot compile its exception subclassing AssertionError).
COMPILED_MODULES = (
    "activator/base/deadlines.py",
    "activator/front/hangup.py",
    "activator/front/http1.py",
    "activator/pods/http1.py",
    "activator/front/engine.py",
    "activator/proxy/responder.py",
    "activator/base/gate.py",
    "activator/core/http.py",
    "activator/core/lb.py",
)


class Compiled(ExtraBuild):
    """This tree's activator with ``COMPILED_MODULES`` compiled ahead of time by mypyc (the
    venv's, from the lint tools): a copy of ``activator/`` made under ``path``, so the tree
    itself never holds compiled modules that would shadow its sources.

    An experiment, not what ships: mypyc trusts mypy's narrowing of an attribute even where
    llhttp's callbacks change the attribute inside ``feed_data``, so this build fails every
    refused request (a TypeError in ``H1Connection.next_exchange``); the benchmarks send
    only valid ones. One line is changed in the copy: mypyc evaluates the ``= ...`` default
    of ``BodySource.read`` (a Protocol) as a real default."""

    what = "the mypyc-compiled build (--compiled)"

    def _make(self) -> Build:
        super().remove()
        shutil.copytree(ROOT / "activator", self.path / "activator", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(ROOT / "pyproject.toml", self.path / "pyproject.toml")  # mypy's settings
        upstream = self.path / "activator" / "pods" / "http1.py"
        protocol_default = "def read(self, size: int = ...) -> bytes: ..."
        text = upstream.read_text()
        if protocol_default not in text:
            raise RuntimeError(f"{protocol_default!r} not found in activator/pods/http1.py")
        upstream.write_text(text.replace(protocol_default, protocol_default.replace("= ...", "= -1")))
        t0 = time.monotonic()
        compiled = subprocess.run(
            [PYTHON, "-m", "mypyc", *COMPILED_MODULES],
            cwd=str(self.path),
            capture_output=True,
            text=True,
            check=False,
            timeout=900,
        )
        if compiled.returncode != 0:
            raise RuntimeError(f"mypyc failed: {(compiled.stdout + compiled.stderr)[-500:]}")
        env = {"PYTHONPATH": str(self.path)}
        build = Build("activator (this tree, mypyc-compiled)", [PYTHON, "-m", "activator"], env, self.path)
        imported = self._imported_from_path(build, "activator.front.http1")
        if not imported.name.endswith(".so"):
            raise RuntimeError(f"activator.front.http1 is not the compiled module ({imported})")
        log(f"compiled {len(COMPILED_MODULES)} modules with mypyc in {time.monotonic() - t0:.0f}s")
        return build


# ---------------------------------------------------------------------------------------
# servers


def activator_config(
    services: dict[str, dict[str, Any]],
    *,
    access_log: bool = False,
    workers: int = 1,
    statsd: str | None = None,
    max_connections: int = 10000,
) -> dict[str, Any]:
    """An activator config (the harness picks ``listen`` and ``admin``). services: name ->
    {hosts, cc, queue_depth, queue_timeout, lb_policy, pods (addresses or {address, drain})}."""
    config: dict[str, Any] = {
        "workers": workers,
        "grace_period": "1s",
        "access_log": access_log,
        "limits": {"max_connections": max_connections, "client_timeout": "120s"},
    }
    if statsd:
        config["statsd"] = {"address": statsd, "prefix": "bench"}
    config["services"] = {
        name: harness.service_config(
            s["pods"],
            hosts=s.get("hosts", ["*"]),
            container_concurrency=s.get("cc", 1),
            queue_depth=s.get("queue_depth", 1000),
            queue_timeout=s.get("queue_timeout", "30s"),
            connect_timeout="2s",
            request_timeout="300s",
            lb_policy=s.get("lb_policy", "auto"),
        )
        for name, s in services.items()
    }
    return config


class Activator(harness.Activator):
    """The harness's activator, with the label of the build it runs (for the tables)."""

    def __init__(self, config: dict[str, Any], *, label: str, **options: Any) -> None:
        super().__init__(config, **options)
        self.label = label


def start_activator(
    procs: Procs,
    name: str,
    services: dict[str, dict[str, Any]],
    *,
    role: str | None = "proxy",
    access_log: bool = False,
    workers: int = 1,
    statsd: str | None = None,
    max_connections: int = 10000,
    env: dict[str, str] | None = None,
    ready_timeout: float = 30.0,
    build: Build | None = None,
) -> Activator:
    """An activator (this tree unless ``build`` says otherwise) with this config, once
    ready; its config and output in ``<scenario>/<name>/``."""
    build = build or this_tree()
    config = activator_config(
        services, access_log=access_log, workers=workers, statsd=statsd, max_connections=max_connections
    )
    act = Activator(
        config,
        label=build.label,
        workdir=procs.dir / name,
        command=build.cmd,
        env={**build.env, **(env or {})},
        cwd=build.cwd,
        wrapper=pin(procs.ctx, role) if role else [],
        ready_timeout=ready_timeout,
        start=False,
    )
    procs.add(act.start(wait_ready=False).process)
    act.wait_ready()
    return act


def start_backend(
    procs: Procs, name: str, role: str | None = "load", *, any_address: bool = False
) -> tuple[harness.Process, int]:
    """tests/backend.py (:class:`harness.Pod`): a gevent pod that records its own peak
    concurrency (/_stats); on ``0.0.0.0`` with ``any_address`` (every loopback address)."""
    pod = harness.Pod(
        workdir=procs.dir / name,
        host="0.0.0.0" if any_address else LOCALHOST,
        wrapper=pin(procs.ctx, role) if role else [],
    )
    assert pod.port is not None  # set once it is ready
    return procs.add(pod.process), pod.port


def start_nginx(
    procs: Procs, name: str = "nginx", *, any_address: bool = False, role: str | None = "load", h2c: bool = False
) -> tuple[harness.Process, int]:
    """nginx answering every request with 200 "hello" (5 bytes), one worker, keep-alive forever;
    with ``h2c``, HTTP/2 with prior knowledge instead of HTTP/1.1 (1,000 streams per connection)."""
    nginx = procs.ctx.tools.get("nginx")
    if nginx is None and h2c:
        raise RuntimeError("nginx not available (the h2c pod)")
    if nginx is None:  # fallback: the gevent test pod (much slower than nginx; noted in the results)
        if "nginx missing: tests/backend.py stands in for it" not in procs.ctx.notes:
            procs.ctx.note("nginx missing: tests/backend.py stands in for it")
        return start_backend(procs, name, role, any_address=any_address)
    port = harness.free_port()
    prefix = procs.dir / name
    prefix.mkdir(exist_ok=True)
    for sub in ("logs", "tmp"):
        (prefix / sub).mkdir(exist_ok=True)
    user = "user root;\n" if os.geteuid() == 0 else ""
    listen = (f"{port}" if any_address else f"{LOCALHOST}:{port}") + (" http2" if h2c else "")
    streams = "  http2_max_concurrent_streams 1000;\n" if h2c else ""
    conf = f"""{user}worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
worker_rlimit_nofile 65536;
events {{ worker_connections 40000; multi_accept on; }}
http {{
  access_log off;
  client_body_temp_path {prefix}/tmp/body;
  proxy_temp_path {prefix}/tmp/proxy;
  fastcgi_temp_path {prefix}/tmp/fastcgi;
  uwsgi_temp_path {prefix}/tmp/uwsgi;
  scgi_temp_path {prefix}/tmp/scgi;
  keepalive_requests 100000000;
  keepalive_timeout 600s;
{streams}  default_type text/plain;
  server {{
    listen {listen} backlog=4096;
    location / {{ return 200 "hello"; }}
  }}
}}
"""
    (prefix / "nginx.conf").write_text(conf)
    proc = procs.start(
        name,
        [nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "logs" / "error.log")],
        role=role,
    )
    if h2c:
        harness.wait_listening(f"{LOCALHOST}:{port}", process=proc, timeout=10)
    else:
        harness.wait_http(f"{LOCALHOST}:{port}", "/", process=proc, timeout=10)
    return proc, port


def _start_server(
    procs: Procs, name: str, module: str, args: Sequence[str], path: str, role: str | None
) -> tuple[harness.Process, int]:
    """``python -m module --port P *args`` on a free port, once ``GET path`` answers 200."""
    port = harness.free_port()
    proc = procs.start(name, [PYTHON, "-m", module, "--port", str(port), *args], role=role)
    harness.wait_http(f"{LOCALHOST}:{port}", path, process=proc, timeout=15)
    return proc, port


def start_hello(procs: Procs, name: str = "hello") -> tuple[harness.Process, int]:
    return _start_server(procs, name, "bench.hello_app", [], "/", "proxy")


def start_forwarder(procs: Procs, upstream: int, name: str = "forwarder") -> tuple[harness.Process, int]:
    """bench/forwarder.py in front of 127.0.0.1:upstream, once a request went through it."""
    return _start_server(procs, name, "bench.forwarder", ["--upstream", f"{LOCALHOST}:{upstream}"], "/", "proxy")


def start_h2_forwarder(
    procs: Procs, upstream: int, name: str = "h2-forwarder", *, pod_h2c: bool = False
) -> tuple[harness.Process, int]:
    """bench/h2forwarder.py (h2c clients) in front of 127.0.0.1:upstream (an h2c pod with
    ``pod_h2c``, else HTTP/1.1), once it listens (it speaks no HTTP/1.1 to wait with)."""
    port = harness.free_port()
    cmd = [PYTHON, "-m", "bench.h2forwarder", "--port", str(port), "--upstream", f"{LOCALHOST}:{upstream}"]
    proc = procs.start(name, [*cmd, *(["--pod-h2c"] if pod_h2c else [])], role="proxy")
    proc.wait_output(rf"^READY {port}$", timeout=15)
    return proc, port


def start_twowrite_pod(
    procs: Procs, name: str, *, one_write: bool = False, nodelay: bool = False, role: str | None = "load"
) -> tuple[harness.Process, int]:
    """bench/twowrite_pod.py: two sends per response without TCP_NODELAY, unless told otherwise."""
    args = ["--one-write"] * one_write + ["--nodelay"] * nodelay
    return _start_server(procs, name, "bench.twowrite_pod", args, "/_stats", role)


def reset_pods(ports: Iterable[int]) -> None:
    """``POST /_reset`` on each of these pods (``tests/backend.py``, ``bench/twowrite_pod.py``)."""
    for port in ports:
        harness.json_request(f"{LOCALHOST}:{port}", "POST", "/_reset")


def pod_stats(ports: Iterable[int]) -> list[dict[str, Any]]:
    """``GET /_stats`` of each of these pods: their own count and peak concurrency."""
    return [harness.json_request(f"{LOCALHOST}:{port}", "GET", "/_stats") for port in ports]


def haproxy_cfg(
    port: int,
    servers: Sequence[tuple[str, str]],
    *,
    maxconn: int,
    balance: str,
    log_port: int | None = None,
    queue_timeout: str = "30s",
    global_maxconn: int = 9000,
) -> str:
    """HAProxy equivalent of an activator service: per-server maxconn, backend queue,
    keep-alive and connection reuse towards the servers, the same X-Forwarded-* headers."""
    log_global = f"  log 127.0.0.1:{log_port} len 4096 local0\n" if log_port else ""
    log_defaults = '  log global\n  log-format "BENCH Tw=%Tw Tc=%Tc Tr=%Tr Ta=%Ta st=%ST srv=%s"\n' if log_port else ""
    server_lines = "".join(f"  server {name} {addr} maxconn {maxconn}\n" for name, addr in servers)
    return f"""global
  maxconn {global_maxconn}
  nbthread 1
{log_global}defaults
  mode http
{log_defaults}  timeout connect 2s
  timeout client 120s
  timeout server 300s
  timeout queue {queue_timeout}
  timeout http-keep-alive 120s
  option http-keep-alive
  option forwardfor
  http-reuse always
frontend fe
  bind 127.0.0.1:{port}
  maxconn {global_maxconn}
  default_backend be
backend be
  balance {balance}
  http-request set-header X-Forwarded-Proto http
  http-request set-header X-Forwarded-Host %[req.hdr(host)]
{server_lines}"""


@dataclass
class HAProxy:
    proc: harness.Process
    port: int
    config: Path


def start_haproxy(
    procs: Procs,
    name: str,
    servers: Sequence[tuple[str, str]],
    *,
    maxconn: int,
    balance: str,
    log_port: int | None = None,
    master_worker: bool = False,
    role: str | None = "proxy",
    global_maxconn: int = 9000,
) -> HAProxy:
    haproxy = procs.ctx.tools.get("haproxy")
    if haproxy is None:
        raise RuntimeError("haproxy not available")
    port = harness.free_port()
    cfg = procs.dir / f"{name}.cfg"
    harness.write_atomic(
        cfg,
        haproxy_cfg(port, servers, maxconn=maxconn, balance=balance, log_port=log_port, global_maxconn=global_maxconn),
    )
    check = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True, check=False)
    if check.returncode != 0:
        raise RuntimeError(f"haproxy config invalid: {check.stdout}{check.stderr}")
    cmd = [haproxy, "-W", "-db", "-f", str(cfg)] if master_worker else [haproxy, "-db", "-f", str(cfg)]
    proc = procs.start(name, cmd, role=role)
    harness.wait_listening(f"{LOCALHOST}:{port}", process=proc, timeout=10)
    return HAProxy(proc, port, cfg)


# ---------------------------------------------------------------------------------------
# load: wrk and the Python load generator


@dataclass
class WrkResult:
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    non2xx: int
    raw: str
    cpu_us: float = float("nan")  # CPU time of the measured processes per request

    def row(self) -> dict[str, Any]:
        return {"rps": self.rps, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms, "errors": self.errors + self.non2xx}


_UNIT = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def _ms(text: str) -> float:
    m = re.match(r"([0-9.]+)(us|ms|s|m)$", text.strip())
    if not m:
        return float("nan")
    return float(m.group(1)) * _UNIT[m.group(2)]


def run_wrk(
    ctx: Ctx,
    port: int,
    seconds: float,
    *,
    connections: int = 50,
    threads: int = 1,
    host: str = "bench",
    path: str = "/",
    role: str | None = "load",
    cpu_pids: Sequence[int] = (),
) -> WrkResult:
    """wrk against 127.0.0.1:port; with cpu_pids, also their CPU time per request."""
    cpu0 = cpu_seconds(cpu_pids) if cpu_pids else 0.0
    result = _run_wrk(ctx, port, seconds, connections=connections, threads=threads, host=host, path=path, role=role)
    if cpu_pids and result.requests:
        result.cpu_us = (cpu_seconds(cpu_pids) - cpu0) / result.requests * 1e6
    return result


def _run_wrk(
    ctx: Ctx, port: int, seconds: float, *, connections: int, threads: int, host: str, path: str, role: str | None
) -> WrkResult:
    wrk = ctx.tools.get("wrk")
    url = f"http://127.0.0.1:{port}{path}"
    if wrk is None:  # fallback: the Python closed-loop generator
        res = run_loadgen(
            ctx,
            [
                "closed",
                "--port",
                str(port),
                "--path",
                path,
                "--host-header",
                host,
                "--clients",
                str(connections),
                "--duration",
                str(seconds),
            ],
            role=role,
        )
        lat = [d - s for s, d, st in zip(res["sent"], res["done"], res["status"], strict=True) if st]
        ok = sum(1 for st in res["status"] if 200 <= st < 300)
        return WrkResult(
            len(lat) / seconds,
            pct(lat, 50) * 1000,
            pct(lat, 99) * 1000,
            len(lat),
            sum(1 for st in res["status"] if st == 0),
            len(lat) - ok,
            "python loadgen",
        )
    cmd = [
        *(pin(ctx, role) if role else []),
        wrk,
        f"-t{threads}",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        "--latency",
        "-H",
        f"Host: {host}",
        url,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=seconds + 60)
    out = r.stdout
    rate = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    rps = float(rate.group(1)) if rate else 0.0
    percentiles = dict(re.findall(r"^\s+(50|75|90|99)%\s+(\S+)", out, re.MULTILINE))
    reqs = re.search(r"(\d+) requests in", out)
    errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return WrkResult(
        rps=rps,
        p50_ms=_ms(percentiles.get("50", "nan")),
        p99_ms=_ms(percentiles.get("99", "nan")),
        requests=int(reqs.group(1)) if reqs else 0,
        errors=sum(int(x) for x in errs.groups()) if errs else 0,
        non2xx=int(non2xx.group(1)) if non2xx else 0,
        raw=out + r.stderr,
    )


def loadgen_cmd(args: Sequence[str]) -> list[str]:
    return [PYTHON, "-m", "bench.loadgen", *args]


def run_loadgen(
    ctx: Ctx, args: Sequence[str], role: str | None = "load", timeout: float = 600, rt: bool = False
) -> dict[str, Any]:
    out = ctx.work / f"loadgen-{time.monotonic_ns()}.json"
    cmd = [*rt_prefix(ctx, rt), *(pin(ctx, role) if role else []), *loadgen_cmd([*args, "--out", str(out)])]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout, cwd=str(ROOT))
    if r.returncode != 0:
        raise RuntimeError(f"loadgen failed ({r.returncode}): {r.stderr[-2000:]}")
    data: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return data


def start_loadgen(
    procs: Procs, name: str, args: Sequence[str], out: Path, role: str | None = "load"
) -> harness.Process:
    """The load generator in the background (see :func:`finish_loadgen`), its result to ``out``."""
    return procs.start(name, loadgen_cmd([*args, "--out", str(out)]), role=role)


def finish_loadgen(procs: Procs, proc: harness.Process, out: Path, timeout: float) -> dict[str, Any]:
    """Wait for a load generator of :func:`start_loadgen` to end; its result."""
    code = procs.finish(proc, timeout)
    if code != 0:
        raise RuntimeError(f"loadgen failed ({code}): {proc.stderr_text()[-2000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def saturate(
    ctx: Ctx, procs: Procs, targets: Sequence[tuple[str, int, harness.Process]], seconds: float, rounds: int, what: str
) -> dict[str, list[WrkResult]]:
    """wrk -t1 -c50 on every (name, port, process) in interleaved rounds, with that process's
    CPU time per request; in full mode a one-second warm-up of each first (connections
    open, code paths hot). A target whose process died is left out from then on (its
    stop notes it), never counted as 0 req/s."""
    if not ctx.quick:
        for _name, port, _proc in targets:
            run_wrk(ctx, port, 1)
    results: dict[str, list[WrkResult]] = {}
    for r in range(rounds):
        for name, port, proc in targets:
            if not proc.is_running():
                continue
            log(f"{what}: wrk -t1 -c50 {seconds:g}s, {name}, round {r + 1}/{rounds}")
            w = run_wrk(ctx, port, seconds, cpu_pids=[proc.pid])
            if proc.is_running():
                results.setdefault(name, []).append(w)
    return results


def median_of(results: dict[str, list[WrkResult]], name: str, attr: str) -> float:
    """The median over rounds of one WrkResult attribute; nan when the target has no rounds."""
    return median([getattr(w, attr) for w in results.get(name, [])])


def open_loop(ctx: Ctx, port: int, seconds: float, warmup: float, rt: bool, shape: Sequence[str]) -> dict[str, Any]:
    """1,000 req/s open loop (bench.loadgen open with the ``shape`` arguments) for warmup +
    seconds; what was scheduled after the warm-up: latency from the scheduled send time
    ("lat") and from the actual send ("svc"), in ms, failures and the achieved rate."""
    res = run_loadgen(
        ctx, ["open", "--port", str(port), "--rate", "1000", "--duration", str(seconds + warmup), *shape], rt=rt
    )
    t0 = res["start"] + warmup
    lat = [(d - s) * 1000 for s, d, st in zip(res["sched"], res["done"], res["status"], strict=True) if s >= t0 and st]
    svc = [
        (d - s) * 1000
        for s, d, st, sch in zip(res["sent"], res["done"], res["status"], res["sched"], strict=True)
        if sch >= t0 and st
    ]
    failed = sum(1 for s, st in zip(res["sched"], res["status"], strict=True) if s >= t0 and not (200 <= st < 300))
    span = (max(res["done"]) - t0) if res["done"] else 0
    return {
        "lat": lat,
        "svc": svc,
        "failed": failed,
        "n": len(lat),
        "rate": len(lat) / span if span else 0,
        "retried": res["retried"],
        "opened": res["opened"],
    }


def added_ms(runs: Sequence[dict[str, Any]], direct: Sequence[dict[str, Any]], p: float) -> float:
    """Latency added over direct at percentile p: per round (this target's minus direct's in
    the same round), then the median over rounds, so one disturbed round does not decide."""
    return median([pct(r["lat"], p) - pct(d["lat"], p) for r, d in zip(runs, direct, strict=True)])


# ---------------------------------------------------------------------------------------
# numbers


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile; nan when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(p / 100 * len(s) + 0.5) - 1))
    return s[k]


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if math.isnan(x):
            return "n/a"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.{digits}f}"
    return str(x)

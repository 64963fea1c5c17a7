"""``workers: N``: one activator as N processes on one listener, and their supervisor.

What this module decides:

- The supervisor binds every socket (the shared proxy listener, and for each
  worker a private loopback proxy port and a loopback admin port) and starts N
  copies of ``activator run`` that inherit them (``workersockets.py``). The kernel
  hands each accepted connection to one worker; a worker is a full activator.
- Slots: each worker owns its share of this activator's slots of every pod (the
  same consistent-hash division as among activators, one level down), so the
  workers together never exceed a pod's limit. A worker that owns no slot of a
  service forwards its requests to a sibling that does (one hop, on the sibling's
  private port): no worker is a black hole.
- The supervisor serves the admin API: /healthz; /readyz (200 when every worker is
  ready); /status and the page merge the workers' views (sums of counts, a pod's
  state as every worker sees it).
- Signals: SIGHUP is passed to every worker (each re-reads the file); SIGTERM or
  SIGINT stops them gracefully (a second one kills them); a worker that dies
  unexpectedly is restarted on the same sockets. systemd hears READY=1 once every
  worker is ready, STOPPING=1 on stop, and watchdog pings from the supervisor.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import Any

import gevent
import gevent.subprocess
import falcon
from gevent.event import Event

from . import admin as admin_api
from .core.config import Address, Config
from .engine import HttpServer, Limits
from .server import DUPLICATE_SIGNAL_SECONDS, listen_on
from .systemd import Notifier, run_watchdog
from .workersockets import ENV, WorkerSockets

log = logging.getLogger("activator")

RESTART_DELAY = 1.0


def worker_command(config_path: str) -> list[str]:
    """The command that runs one worker: this same program (venv or one-file)."""
    if getattr(sys, "frozen", False):
        return [sys.executable, "run", "-c", config_path]
    return [sys.executable, "-m", "activator", "run", "-c", config_path]


def merge_statuses(statuses: list[dict[str, Any]]) -> dict[str, Any]:
    """One activator's status from its workers' (same shape as a single process's)."""
    merged = json.loads(json.dumps(statuses[0]))
    merged["ready"] = all(s["ready"] for s in statuses)
    merged["worker"] = {"count": len(statuses)}
    merged["workers"] = [{"index": s["worker"]["index"], "ready": s["ready"]} for s in statuses]
    services: dict[str, Any] = {}
    for status in statuses:
        for name, service in status["services"].items():
            into = services.get(name)
            if into is None:
                into = services[name] = json.loads(json.dumps(service))
                into["pods"] = {}
                for key in ("capacity", "in_flight", "queued"):
                    into[key] = 0
                into["forward_to"] = None
            for key in ("in_flight", "queued"):
                into[key] += service[key]
            if into["capacity"] is None or service["capacity"] is None:
                into["capacity"] = None
            else:
                into["capacity"] += service["capacity"]
            for pod in service["pods"]:
                seen = into["pods"].get(pod["address"])
                if seen is None:
                    seen = into["pods"][pod["address"]] = dict(pod, states=[], in_flight=0, slots=0, requests=0)
                seen["states"].append(pod["state"])
                seen["in_flight"] += pod["in_flight"]
                seen["requests"] += pod["requests"]
                seen["failures"] = max(seen["failures"], pod["failures"])
                seen["slots"] = None if seen["slots"] is None or pod["slots"] is None else seen["slots"] + pod["slots"]
    for name, service in services.items():
        # The activator forwards a service when none of its workers owns a slot of it:
        # every worker then names the same peer (a worker forwarding to a sibling is
        # internal, the activator still serves the service itself).
        forwards = {s["services"][name].get("forward_to") for s in statuses if name in s["services"]}
        if len(forwards) == 1:
            (only,) = forwards
            if isinstance(only, str) and only.startswith("peer "):
                service["forward_to"] = only
        pods = list(service["pods"].values())
        for pod in pods:
            states = sorted(set(pod["states"]))
            pod["state"] = states[0] if len(states) == 1 else "/".join(states)
        service["pods"] = pods
    merged["services"] = services
    return merged


class Worker:
    def __init__(self, index: int, addresses: list[str], public: Any, private: Any, admin: Any) -> None:
        self.index = index
        self.sockets = (public, private, admin)
        self.admin_address = "127.0.0.1:%d" % admin.getsockname()[1]
        self.spec = WorkerSockets.encode(index, addresses, public.fileno(), private.fileno(), admin.fileno())
        self.process: gevent.subprocess.Popen | None = None


class Supervisor:
    """Starts, watches and stops the workers; serves the merged admin API."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.notifier = Notifier.from_env()
        self.stopping = False
        self._stop_signalled_at = 0.0
        self._done = Event()
        public = listen_on(config.listen)
        privates = [listen_on(Address("127.0.0.1", 0)) for _ in range(config.workers)]
        admins = [listen_on(Address("127.0.0.1", 0)) for _ in range(config.workers)]
        addresses = ["127.0.0.1:%d" % s.getsockname()[1] for s in privates]
        self.workers = [Worker(i, addresses, public, privates[i], admins[i]) for i in range(config.workers)]
        self.admin_server: HttpServer | None = None
        if config.admin is not None:
            self.admin_server = HttpServer(listen_on(config.admin), self._admin_app(), Limits())

    # -- workers ----------------------------------------------------------------

    def _start(self, worker: Worker) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        env[ENV] = worker.spec
        fds = [s.fileno() for s in worker.sockets]
        worker.process = gevent.subprocess.Popen(worker_command(self.config.path), env=env, pass_fds=fds)
        log.info("worker %d started (pid %d)", worker.index, worker.process.pid)

    def _watch(self, worker: Worker) -> None:
        while True:
            assert worker.process is not None
            code = worker.process.wait()
            if self.stopping:
                return
            log.error("worker %d exited with %s; restarting it", worker.index, code)
            gevent.sleep(RESTART_DELAY)
            if self.stopping:
                return
            self._start(worker)

    def _signal_all(self, sig: int) -> None:
        for worker in self.workers:
            if worker.process is not None and worker.process.poll() is None:
                try:
                    worker.process.send_signal(sig)
                except OSError:
                    pass

    # -- status -----------------------------------------------------------------

    def _fetch(self, worker: Worker, path: str) -> tuple[int, bytes]:
        from .core.http import BodyFraming
        from .upstream import Timeouts, UpstreamPool

        host, _, port = worker.admin_address.rpartition(":")
        pool = UpstreamPool(host, int(port), max_idle=0)
        response = pool.request("GET", path.encode(), b"Host: %s\r\n" % worker.admin_address.encode(), None,
                                BodyFraming.NONE, None, Timeouts(2.0, 5.0, total=5.0))
        try:
            return response.status, b"".join(response.body())
        finally:
            response.close()
            pool.close()

    def status(self) -> dict[str, Any]:
        jobs = [gevent.spawn(self._fetch, w, "/status") for w in self.workers]
        gevent.joinall(jobs, timeout=6)
        statuses = []
        for worker, job in zip(self.workers, jobs):
            if job.successful() and job.value[0] == 200:
                statuses.append(json.loads(job.value[1]))
            else:
                statuses.append({"ready": False, "worker": {"index": worker.index}, "services": {},
                                 "version": "", "config": {}, "activator": {}})
        merged = merge_statuses(statuses)
        merged["stopping"] = self.stopping
        merged["ready"] = merged["ready"] and not self.stopping
        return merged

    def _admin_app(self) -> falcon.App:
        supervisor = self

        class Ready:
            def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
                ready = not supervisor.stopping and all(
                    _ok(lambda w=w: supervisor._fetch(w, "/readyz")) for w in supervisor.workers)
                resp.status = 200 if ready else 503
                resp.content_type = "text/plain"
                resp.text = "ready\n" if ready else "not ready\n"

        class Status:
            def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
                resp.content_type = "application/json"
                resp.text = json.dumps(supervisor.status(), indent=2)

        class Page:
            def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
                resp.content_type = "text/html; charset=utf-8"
                resp.text = admin_api.render_page(supervisor.status())

        app = falcon.App()
        app.add_route("/healthz", admin_api.Health())
        app.add_route("/readyz", Ready())
        app.add_route("/status", Status())
        app.add_route("/", Page())
        return app

    # -- lifecycle --------------------------------------------------------------

    def run(self) -> int:
        for worker in self.workers:
            self._start(worker)
        watchers = [gevent.spawn(self._watch, w) for w in self.workers]
        if self.admin_server is not None:
            self.admin_server.start()
        gevent.signal_handler(signal.SIGHUP, lambda: self._signal_all(signal.SIGHUP))
        gevent.signal_handler(signal.SIGTERM, self._on_stop_signal)
        gevent.signal_handler(signal.SIGINT, self._on_stop_signal)
        if self.notifier.watchdog_interval():
            gevent.spawn(run_watchdog, self.notifier, lambda: True)
        gevent.spawn(self._announce_ready)
        self._done.wait()
        gevent.killall(watchers)
        return 0

    def _announce_ready(self) -> None:
        while not self.stopping:
            if all(_ok(lambda w=w: self._fetch(w, "/readyz")) for w in self.workers):
                log.info("%d workers ready on %s", len(self.workers), self.config.listen)
                self.notifier.ready(f"{len(self.workers)} workers")
                return
            gevent.sleep(0.1)

    def _on_stop_signal(self) -> None:
        now = time.monotonic()
        if self.stopping:
            if now - self._stop_signalled_at < DUPLICATE_SIGNAL_SECONDS:
                return  # one Ctrl-C seen twice (see server.DUPLICATE_SIGNAL_SECONDS)
            self._signal_all(signal.SIGKILL)
            os._exit(0)
        self._stop_signalled_at = now
        gevent.spawn(self._stop)

    def _stop(self) -> None:
        self.stopping = True
        self.notifier.stopping()
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.config.grace_period + 5
        for worker in self.workers:
            if worker.process is not None:
                try:
                    worker.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except gevent.subprocess.TimeoutExpired:
                    worker.process.kill()
        if self.admin_server is not None:
            self.admin_server.stop(timeout=1)
        self._done.set()


def _ok(fetch: Any) -> bool:
    try:
        return bool(fetch()[0] == 200)
    except Exception:
        return False

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
- The supervisor serves the admin API with the same resources as a single process
  (``admin.make_admin_app``): /readyz is 200 when every worker is ready; /status and the
  page merge the workers' views (``core.status.merge_worker_statuses``).
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
from gevent.event import Event

from .admin import make_admin_app
from .core.config import Config
from .core.status import merge_worker_statuses
from .engine import HttpServer, Limits
from .signals import Signals
from .sockets import listen_socket
from .systemd import Notifier, run_watchdog
from .workersockets import ENV, WorkerSockets

log = logging.getLogger("activator")

RESTART_DELAY = 1.0


def worker_command(config_path: str) -> list[str]:
    """The command that runs one worker: this same program (venv or one-file)."""
    if getattr(sys, "frozen", False):
        return [sys.executable, "run", "-c", config_path]
    return [sys.executable, "-m", "activator", "run", "-c", config_path]


class Worker:
    def __init__(self, index: int, addresses: list[str], public: Any, private: Any, admin: Any) -> None:
        self.index = index
        self.sockets = (public, private, admin)
        self.admin_address = f"127.0.0.1:{admin.getsockname()[1]}"
        self.spec = WorkerSockets.encode(index, addresses, public.fileno(), private.fileno(), admin.fileno())
        self.process: gevent.subprocess.Popen | None = None


class Supervisor:
    """Starts, watches and stops the workers; serves the merged admin API."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.notifier = Notifier.from_env()
        self.stopping = False
        self.signals = Signals(lambda: self._signal_all(signal.SIGHUP), self._stop, self._kill_all)
        self._done = Event()
        public = listen_socket(config.listen.host, config.listen.port)
        privates = [listen_socket("127.0.0.1", 0) for _ in range(config.workers)]
        admins = [listen_socket("127.0.0.1", 0) for _ in range(config.workers)]
        addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in privates]
        self.workers = [Worker(i, addresses, public, privates[i], admins[i]) for i in range(config.workers)]
        self.admin_server: HttpServer | None = None
        if config.admin is not None:
            self.admin_server = HttpServer(
                listen_socket(config.admin.host, config.admin.port), make_admin_app(self), Limits()
            )

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
        response = pool.request(
            "GET",
            path.encode(),
            [(b"Host", worker.admin_address.encode())],
            None,
            BodyFraming.NONE,
            None,
            Timeouts(2.0, 5.0, total=5.0),
        )
        try:
            return response.status, b"".join(response.body())
        finally:
            response.close()
            pool.close()

    def status(self) -> dict[str, Any]:
        jobs = [gevent.spawn(self._fetch, w, "/status") for w in self.workers]
        gevent.joinall(jobs, timeout=6)
        statuses = []
        for worker, job in zip(self.workers, jobs, strict=False):
            if job.successful() and job.value[0] == 200:
                statuses.append(json.loads(job.value[1]))
            else:
                statuses.append(
                    {
                        "ready": False,
                        "worker": {"index": worker.index},
                        "services": {},
                        "version": "",
                        "config": {},
                        "activator": {},
                    }
                )
        merged = merge_worker_statuses(statuses)
        merged["stopping"] = self.stopping
        merged["ready"] = merged["ready"] and not self.stopping
        return merged

    def is_serving(self) -> bool:
        """Every worker serving, and the supervisor not stopping (asks each worker)."""
        return not self.stopping and all(_ok(lambda w=w: self._fetch(w, "/readyz")) for w in self.workers)

    # -- lifecycle --------------------------------------------------------------

    def run(self) -> int:
        for worker in self.workers:
            self._start(worker)
        watchers = [gevent.spawn(self._watch, w) for w in self.workers]
        if self.admin_server is not None:
            self.admin_server.start()
        self.signals.install()
        if self.notifier.watchdog_interval():
            gevent.spawn(run_watchdog, self.notifier)
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

    def _kill_all(self) -> None:
        self._signal_all(signal.SIGKILL)
        os._exit(0)

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

"""``workers: N``: one activator as N processes on one listener, and their supervisor.

What this module decides:

- The supervisor binds every socket (the shared proxy listener, and for each
  worker a private loopback proxy port and a loopback admin port) and starts N
  copies of ``activator run`` that inherit them (``workersockets.py``). The kernel
  hands each accepted connection to one worker; a worker is a full activator.
- Slots: each worker owns its share of this activator's slots of every pod (the
  same consistent-hash division as among activators, one level down), so the
  workers together never exceed a pod's limit. The activator has one queue, here:
  a request a worker cannot serve at once waits in the supervisor's slot exchange
  (``sharing.ExchangeHub``, rules in ``core.slotexchange``) and the workers lend it
  their slots, so no pod has a free slot in one worker while a request of its
  service waits in another, and requests are served in arrival order whichever
  worker they came to.
- The supervisor serves the admin API with the same resources as a single process
  (``admin.make_admin_app``): /readyz is 200 when every worker is ready; /status, the
  page, /status.csv and /metrics merge the workers' views
  (``core.status.merge_worker_statuses``), /status/history their histories point-wise
  (``history.merge_histories``).
- Signals: SIGHUP is passed to every worker (each re-reads the file); SIGTERM or
  SIGINT stops them gracefully (a second one kills them); a worker that dies
  unexpectedly is restarted on the same sockets. systemd hears READY=1 once every
  worker is ready, STOPPING=1 on stop, and watchdog pings from the supervisor.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import time
from typing import Any

import gevent
import gevent.subprocess
from gevent.event import Event

from ..core.config import Config, LimitsConfig
from ..core.status import merge_queue_view, merge_worker_statuses, queue_view
from ..fleet.sharing import ExchangeHub, socket_pair
from ..front.engine import HttpServer
from ..front.sockets import listen_socket
from ..ops.admin import make_admin_app
from ..ops.history import merge_histories
from .signals import Signals
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
    def __init__(self, index: int, addresses: list[str], public: Any, private: Any, admin: Any, secret: str) -> None:
        self.index = index
        self.addresses = addresses
        self.secret = secret
        self.sockets = (public, private, admin)
        self.admin_address = f"127.0.0.1:{admin.getsockname()[1]}"
        self.process: gevent.subprocess.Popen | None = None

    def spec(self, exchange: int) -> str:
        public, private, admin = self.sockets
        return WorkerSockets.encode(
            self.index, self.addresses, public.fileno(), private.fileno(), admin.fileno(), exchange, self.secret
        )


class Supervisor:
    """Starts, watches and stops the workers; serves the merged admin API."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.notifier = Notifier.from_env()
        self.stopping = False
        self.signals = Signals(lambda: self._signal_all(signal.SIGHUP), self._stop, self._kill_all)
        self._done = Event()
        #: The activator's one queue (``sharing.py``).
        self.hub = ExchangeHub()
        public = listen_socket(config.listen.host, config.listen.port)
        privates = [listen_socket("127.0.0.1", 0) for _ in range(config.workers)]
        admins = [listen_socket("127.0.0.1", 0) for _ in range(config.workers)]
        addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in privates]
        secret = secrets.token_hex(32)  # the workers' checks of each other
        self.workers = [Worker(i, addresses, public, privates[i], admins[i], secret) for i in range(config.workers)]
        self.admin_server: HttpServer | None = None
        if config.admin is not None:
            self.admin_server = HttpServer(
                listen_socket(config.admin.host, config.admin.port), make_admin_app(self), LimitsConfig()
            )

    # -- workers ----------------------------------------------------------------

    def _start(self, worker: Worker) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        hub_end, worker_end = socket_pair()
        env[ENV] = worker.spec(worker_end.fileno())
        fds = [s.fileno() for s in worker.sockets] + [worker_end.fileno()]
        try:
            worker.process = gevent.subprocess.Popen(worker_command(self.config.path), env=env, pass_fds=fds)
        finally:
            worker_end.close()  # the worker's now
        self.hub.attach(worker.index, hub_end)
        log.info("worker %d started (pid %d)", worker.index, worker.process.pid)

    def _watch(self, worker: Worker) -> None:
        while True:
            assert worker.process is not None
            code = worker.process.wait()
            if not self.stopping:
                log.error("worker %d exited with %s; restarting it", worker.index, code)
                gevent.sleep(RESTART_DELAY)
            if self.stopping:  # before the exit, or during the delay
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
        from ..base.exchange import PodRequest
        from ..core.timeouts import Timeouts
        from ..pods.http1 import UpstreamPool

        host, _, port = worker.admin_address.rpartition(":")
        pool = UpstreamPool(host, int(port), max_idle=0)
        request = PodRequest("GET", path.encode(), [(b"Host", worker.admin_address.encode())])
        response = pool.request(request, Timeouts(2.0, 5.0, total=5.0))
        try:
            return response.head.status, b"".join(response.body())
        finally:
            response.close()
            pool.close()

    def _fetch_all(self, path: str) -> list[Any]:
        """``path`` of every worker's admin API, as JSON (None for a worker that did not answer 200)."""
        jobs = [gevent.spawn(self._fetch, w, path) for w in self.workers]
        gevent.joinall(jobs, timeout=6)
        return [json.loads(job.value[1]) if job.successful() and job.value[0] == 200 else None for job in jobs]

    def history(self, seconds: int, pods: bool) -> dict[str, Any]:
        """The workers' histories merged point-wise (a worker that does not answer is left out)."""
        histories = self._fetch_all(f"/status/history?seconds={seconds}&pods={int(pods)}")
        return merge_histories(h for h in histories if h is not None)

    def status(self) -> dict[str, Any]:
        statuses = []
        for worker, fetched in zip(self.workers, self._fetch_all("/status"), strict=True):
            if fetched is not None:
                statuses.append(fetched)
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
        now = time.monotonic()
        for name, service in merged["services"].items():
            # Requests waiting in the activator's one queue are the supervisor's.
            service["queued"] += self.hub.queued(name)
            exchange_wait = round(self.hub.oldest_wait(name, now), 3)
            service["oldest_wait_seconds"] = max(service["oldest_wait_seconds"], exchange_wait)
            waiting = self.hub.exchange.waiting(name)
            if waiting is not None:  # classes or tenants: the one queue's view of them
                classes = list(service["classes"]) if "classes" in service else None
                fair = "top_tenants" in service
                no_sheds = [0] * waiting.policy.classes  # (each worker counts its own)
                merge_queue_view(service, queue_view(waiting, classes, fair, no_sheds, now))
        merged["stopping"] = self.stopping
        merged["ready"] = merged["ready"] and not self.stopping
        return merged

    def is_serving(self) -> bool:
        """Every worker serving, and the supervisor not stopping (asks each worker)."""
        return not self.stopping and all(_ok(lambda w=w: self._fetch(w, "/readyz")) for w in self.workers)

    # -- lifecycle --------------------------------------------------------------

    def run(self) -> int:
        self.hub.start()
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

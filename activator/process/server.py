"""The running process: listeners, the topology writer, reloads, signals, shutdown.

What this module decides:

- Listeners: made by ``sockets.listen_socket`` (TCP_NODELAY, SO_REUSEADDR) and served
  by the HTTP engine (``engine.HttpServer``): the proxy port, a worker's private port,
  and the admin port.
- One writer of topology (``writer.TopologyWriter``): config reloads, the periodic tick
  (drain timeouts, then idle pools closed here), probe verdicts and transport failures
  are events applied one at a time by one greenlet; requests only acquire and release.
  After a new configuration is applied, in the same step, the settings that live outside
  the topology (limits, access log, StatsD, this activator's name) follow it.
- Reload: the file is parsed, validated and diffed in the hub's threadpool (a big file
  must not stall requests), then posted to the writer. A bad file changes nothing; the
  error is logged (one line: file, line, key, message), counted and shown in /status.
  (The thread function returns a bad file's ``ConfigError`` as a value instead of
  raising it: the threadpool prints the traceback of anything raised in it.) ``listen``,
  ``admin`` and ``workers`` changes are reported as needing a restart. One reload at a
  time, in the order asked.
- History (``history.History``, kept by the observer): one greenlet samples the
  topology into it once a second, just after each whole wall-clock second; the same
  step checks the failure streaks of unprobed pods (``observe.FailureStreaks``) and
  keeps systemd's ``STATUS=`` line current (``systemd.StatusLine``: sent when it
  changed, at most once a second; also right after pod states changed).
- Refusals: the engine tells the observer of every request it refuses before any
  application runs (``HttpServer(on_refusal=...)``): one access-log line and one count.
- A reload logs one record, one line per change (``logs`` prefixes each line); a
  certificate or key that changed under the same paths is a change too (the
  certificate's SHA-256 fingerprint is logged), never "no change".
- Signals (``signals.Signals``): SIGHUP re-reads the file; SIGTERM or SIGINT starts a
  graceful stop: /readyz turns 503, the listener closes, new requests on kept-alive
  connections get 503 ``shutting-down``, queued and in-flight requests finish within
  ``grace_period``, then exit 0. A second SIGTERM or SIGINT exits at once.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import math
import os
import socket
import ssl
import sys
import time
from typing import Any

import gevent
import gevent.lock
from gevent.event import Event

from .. import __version__
from ..base.writer import Actor, TopologyWriter
from ..core.config import Address, Config, ConfigDiff, LimitsConfig, TlsConfig, diff_configs
from ..core.errors import ConfigError
from ..core.events import ConfigChanged, Tick, TransportFailure, ViewReceived
from ..core.events import Event as TopologyEvent
from ..core.throttler import Grant, ServiceThrottler
from ..core.topology import Topology
from ..fleet.peers import PeerChecker, PeerEndpoint
from ..fleet.sharing import SlotSharing
from ..front.engine import HttpServer
from ..front.sockets import CannotListen, listen_socket
from ..front.tls import load_context
from ..ops.admin import make_admin_app
from ..ops.logs import fatal, setup_logging
from ..ops.metrics import make_metrics
from ..ops.observe import Observer
from ..pods.clients import PodClients
from ..pods.prober import Prober
from ..proxy.responder import Proxy, make_app
from .configfile import load_config
from .signals import Signals
from .systemd import Notifier, StatusLine, run_watchdog
from .watcher import FileWatcher
from .workersockets import WorkerSockets

log = logging.getLogger("activator")

#: The GIL switch interval while the threadpool parses a new file (Python's default: 5 ms).
RELOAD_SWITCH_INTERVAL = 0.0005
#: The history is sampled this long after each whole second.
HISTORY_OFFSET = 0.01

__all__ = ["Runtime", "listen_on", "run", "setup_logging"]


def listen_on(address: Address) -> socket.socket:
    """A listener for a configured address (``sockets.listen_socket``)."""
    return listen_socket(address.host, address.port)


class Runtime:
    """Everything one activator process runs; built from a valid config."""

    def __init__(self, config: Config, *, worker: WorkerSockets | None = None) -> None:
        self.worker = worker
        self.config = config
        self.path = config.path
        self.loaded_at = time.time()
        self.last_error: str | None = None
        self.started = time.monotonic()
        self.ready = False
        self.stopping = False
        self.notifier = Notifier.from_env()
        self.status_line = StatusLine(self.notifier)
        self.observer = Observer(access_log=config.access_log)
        self.topology = Topology(
            config,
            time.monotonic(),
            worker_index=worker.index if worker else 0,
            workers=worker.addresses if worker else (),
            hand_over_at_start=True,
        )
        self.observer.metrics = make_metrics(config.statsd, self.topology)
        self.actor = Actor(self.observer, self._states_changed, self._lend if worker else None)
        self.writer = TopologyWriter(self.topology, self.actor, self._applied)
        #: ``workers: N``: this worker's side of the activator's one queue.
        self.sharing: SlotSharing | None = None
        if worker is not None:
            self.sharing = SlotSharing(worker.exchange, worker.index, self.topology, self.actor.act, self.writer.post)
        self.prober = Prober(self.topology, self.writer)
        self.pods = PodClients()
        self.proxy = Proxy(
            self.topology,
            self.observer,
            self.pods.get,
            self.writer,
            self.actor,
            config.activators.self_name if config.activators else "",
            config.limits.client_timeout,
            self.sharing,
        )
        me = self._my_name
        self.proxy.peers = PeerEndpoint(self.topology, self.writer.post, me, worker.secret if worker else None)
        self.checker = PeerChecker(self.topology, self.writer.post, me, worker.secret if worker else None)
        self.watcher = FileWatcher(self.path, self.reload)
        #: The proxy listener's TLS context (``tls:``), made at start and on each reload,
        #: and what its files held then (``tls_identity``).
        self._tls_context = load_context(config.tls, config.path) if config.tls is not None else None
        self._tls_identity = tls_identity(config.tls)
        self._tls_watchers: list[gevent.Greenlet] = []
        self.signals = Signals(self._reload_on_signal, self.stop, self._exit_now)
        self._stopped = Event()
        self._reload_lock = gevent.lock.Semaphore()
        self._greenlets: list[gevent.Greenlet] = []
        self.server: HttpServer | None = None
        self.private_server: HttpServer | None = None  # a worker's port for its siblings
        self.admin_server: HttpServer | None = None

    # -- upstream pools ---------------------------------------------------------

    def _close_unused_pools(self) -> None:
        """Close the clients of pods no longer tracked (peers and sibling workers keep theirs)."""
        keep = {a for s in self.topology.services.values() for a in s.trackers}
        keep.update(self.topology.workers)
        if self.config.activators is not None:
            keep.update(str(address) for address in self.config.activators.peers.values())
        self.pods.close_unused(keep)

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        """Bind the listeners and start serving; raises OSError if a port is taken."""
        config = self.config
        worker = self.worker
        app = make_app(self.proxy)
        refused = self.observer.refused
        self.server = HttpServer(
            worker.public if worker else listen_on(config.listen),
            app,
            config.limits,
            tls=self._tls_context,
            on_refusal=refused,
            on_budget=self.observer.h2_goaway,
        )
        self.server.start()
        if worker is not None:
            self.private_server = HttpServer(
                worker.private, app, config.limits, on_refusal=refused, on_budget=self.observer.h2_goaway
            )
            self.private_server.start()
            self.admin_server = HttpServer(worker.admin, make_admin_app(self), LimitsConfig())
            self.admin_server.start()
        elif config.admin is not None:
            if config.admin.host not in ("127.0.0.1", "::1", "localhost"):
                log.warning(
                    "admin API listens on %s, not on loopback: anyone who can reach it sees /status", config.admin
                )
            self.admin_server = HttpServer(listen_on(config.admin), make_admin_app(self), LimitsConfig())
            self.admin_server.start()
        if self.sharing is not None:
            self.sharing.start()
        self.actor.act(self.topology.initial_effects)
        self.prober.sync()
        self.observer.metrics.start()
        self.writer.start()
        self.checker.start()
        self._greenlets = [gevent.spawn(self.watcher.run), gevent.spawn(self._sample_history)]
        self._watch_tls_files()
        if self.notifier.watchdog_interval():
            self._greenlets.append(gevent.spawn(run_watchdog, self.notifier))  # a stuck loop stops it
        self.signals.install()
        self.ready = True
        role = f"worker {worker.index} of {len(worker.addresses)}" if worker else f"admin {config.admin or 'off'}"
        log.info(
            "activator %s listening on %s (%s), %d services, config %s",
            __version__,
            config.listen,
            role,
            len(config.services),
            self.path,
        )
        self.notifier.ready(self.status_line.sent(self.summary(), time.monotonic()))

    def is_serving(self) -> bool:
        return self.ready and not self.stopping

    def serve_forever(self) -> int:
        self._stopped.wait()
        return 0

    def summary(self) -> str:
        services = self.topology.services.values()
        healthy = sum(1 for s in services for t in s.trackers.values() if t.state.value == "healthy")
        pods = sum(len(s.trackers) for s in services)
        return (
            f"{len(self.topology.services)} services, {healthy}/{pods} pods healthy, "
            f"{sum(s.in_flight for s in services)} in flight, {sum(s.queued for s in services)} queued"
        )

    def _watch_tls_files(self) -> None:
        """Watch the certificate and key files: a change is a reload (a renewed certificate)."""
        gevent.killall(self._tls_watchers, block=False)
        tls = self.config.tls
        paths = (tls.cert, tls.key) if tls is not None else ()
        self._tls_watchers = [gevent.spawn(FileWatcher(path, self.reload).run) for path in paths]

    def _sample_history(self) -> None:
        """Sample the topology into the history once a second, just after each whole
        wall-clock second (so that the workers' points line up); check the unprobed
        pods' failure streaks and the STATUS= line in the same step."""
        history = self.observer.history
        failed = False
        while True:
            now = time.time()
            gevent.sleep(math.floor(now) + 1 - now + HISTORY_OFFSET)
            try:
                history.sample(self.topology.services, int(time.time()))
                self.observer.streaks.check(self.topology.services)
                if not self.stopping:
                    self.status_line.update(self.summary(), time.monotonic())
            except Exception:  # a bug: the history stops, the proxy goes on; said once
                if not failed:
                    failed = True
                    log.exception("history: sampling failed (logged once)")

    def _states_changed(self) -> None:
        self.prober.sync()
        if self.ready and not self.stopping:
            self.status_line.update(self.summary(), time.monotonic())

    def _my_name(self) -> str:
        peers = self.config.activators
        return peers.self_name if peers is not None else ""

    def _lend(self, throttler: ServiceThrottler, grant: Grant) -> None:
        assert self.sharing is not None
        self.sharing.offer(throttler, grant)

    def _applied(self, event: TopologyEvent) -> None:
        """Right after the writer applied ``event``, in the same step (does not yield)."""
        if isinstance(event, ConfigChanged):
            self._follow_config(event.config)
            if self.sharing is not None:
                self.sharing.resync()
            self.checker.kick()  # hand-overs wait for answers made after the change
        elif isinstance(event, Tick):
            self._close_unused_pools()
        elif isinstance(event, ViewReceived) and self.topology.fleet.handovers.pending:
            self.checker.kick()  # a lifted cap is a hand-over too: ask its holders now
        elif isinstance(event, TransportFailure):
            throttler = self.topology.services.get(event.service)
            if throttler is not None:
                self.observer.streaks.failed(throttler, event.address, event.kind.value)
        for change in self.topology.fleet.take_changes():
            level = logging.WARNING if change.new.value == "down" else logging.INFO
            log.log(level, "peer %s: %s -> %s (%s)", change.name, change.old.value, change.new.value, change.detail)

    # -- reload -----------------------------------------------------------------

    def _reload_on_signal(self) -> None:
        self.watcher.mark_seen()  # else the watcher applies the same edit a second time
        self.reload("SIGHUP")

    def reload(self, reason: str) -> None:
        """Re-read the file; apply it if valid, else keep serving the old one.

        One reload at a time (the watcher and SIGHUP may ask together), so files are
        applied in the order they were read.
        """
        with self._reload_lock:
            self._reload(reason)

    def _reload(self, reason: str) -> None:
        self.notifier.reloading()
        # Parse, validate and diff off the event loop: a big file must not stall requests.
        # That work is Python holding the GIL; a short switch interval lets the hub get
        # it back every 0.5 ms instead of every 5 ms while it runs.
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(RELOAD_SWITCH_INTERVAL)
        try:
            loaded = gevent.get_hub().threadpool.apply(_load_and_diff, (self.path, self.config))
        finally:
            sys.setswitchinterval(switch_interval)
        if isinstance(loaded, ConfigError):
            error = loaded
            self.last_error = str(error)
            if self.topology.worker_index == 0:  # one count per activator, not per worker
                self.observer.reload(False)
            log.error("config reload (%s) failed, keeping the running config: %s", reason, error)
            self.notifier.ready(self.status_line.sent(f"reload failed: {error}", time.monotonic()))
            return
        new, diff, context, identity = loaded
        self._tls_context = context
        applied = Event()
        self.writer.post(ConfigChanged(new, diff), applied)
        applied.wait()
        changes = [] if diff.is_empty() else diff.describe().splitlines()
        renew = identity != self._tls_identity  # a new certificate, or TLS turned on or off
        if new.tls is not None and identity is not None and renew:
            changes.append(f"tls: certificate {new.tls.cert} reloaded (sha256 {identity[0]})")
        self._tls_identity = identity
        if renew and self.server is not None:
            # The connections made before end gracefully (HTTP/2: GOAWAY; HTTP/1.x: after
            # the answer in progress), so that their clients come back to the new listener.
            self.server.renew_connections()
        if not changes:
            log.info("config reload (%s): no change", reason)
        else:
            log.info("config reload (%s) applied:\n%s", reason, "\n".join(changes))
        self.notifier.ready(self.status_line.sent(self.summary(), time.monotonic()))

    def _follow_config(self, new: Config) -> None:
        """The settings outside the topology follow a new configuration. Does not yield."""
        old = self.config
        self.config = new
        self.observer.access_log = new.access_log
        for server in (self.server, self.private_server):
            if server is not None:
                server.limits = new.limits
        self.proxy.client_timeout = new.limits.client_timeout
        self.proxy.self_name = new.activators.self_name if new.activators else ""
        if self.server is not None:
            self.server.tls = self._tls_context
        if new.tls != old.tls:
            self._watch_tls_files()
        if new.statsd != old.statsd:
            self.observer.metrics.stop()
            self.observer.metrics = make_metrics(new.statsd, self.topology)
            self.observer.metrics.start()
        self.loaded_at = time.time()
        self.last_error = None
        if self.topology.worker_index == 0:  # one count per activator, not per worker
            self.observer.reload(True)
        self.prober.sync()

    # -- stop -------------------------------------------------------------------

    def _exit_now(self) -> None:
        log.warning("second stop signal: exiting now")
        os._exit(0)

    def stop(self) -> None:
        """Graceful stop: refuse new work, let queued and in-flight requests finish."""
        self.stopping = True
        self.ready = False
        self.proxy.stopping = True
        grace = self.config.grace_period
        log.info("stopping: %d requests in the proxy, grace period %ss", self.proxy.active, grace)
        self.notifier.stopping(f"draining {self.proxy.active} requests")
        for server in (self.server, self.private_server):
            if server is not None:
                server.begin_stop()  # HTTP/2 clients get their GOAWAY now, not at the end
        if self.server is not None:
            self.server.close()
        deadline = time.monotonic() + grace
        while self.proxy.active > 0 and time.monotonic() < deadline:
            gevent.sleep(0.05)
        if self.proxy.active:
            log.warning("grace period over with %d requests unfinished", self.proxy.active)
        for server in (self.server, self.private_server, self.admin_server):
            if server is not None:
                server.stop(timeout=1)
        gevent.killall([*self._greenlets, *self._tls_watchers], block=False)
        self.writer.stop()
        self.checker.stop()
        self.prober.stop()
        self.observer.metrics.stop()
        log.info("stopped")
        self._stopped.set()

    # -- status -----------------------------------------------------------------

    def history(self, seconds: int, pods: bool) -> dict[str, Any]:
        """``/status/history``: the last ``seconds`` of the history (pods' series too)."""
        return self.observer.history.export(seconds, pods)

    def status(self) -> dict[str, Any]:
        config = self.config
        peers = config.activators
        now = time.monotonic()
        return {
            "version": __version__,
            "ready": self.ready and not self.stopping,
            "stopping": self.stopping,
            "uptime_seconds": round(now - self.started, 3),
            "worker": {"index": self.topology.worker_index, "count": len(self.topology.workers) or 1},
            "activator": {
                "self": peers.self_name if peers else None,
                "peers": {name: str(addr) for name, addr in sorted(peers.peers.items())} if peers else {},
                "health": self.topology.fleet.snapshot_peers(now),
            },
            "config": {
                "path": self.path,
                "loaded_at": _iso(self.loaded_at),
                "last_error": self.last_error,
            },
            "reloads": dict(self.observer.history.reloads),
            "refused": dict(sorted(self.observer.history.refusals.items())),
            "h2_goaway": dict(self.observer.h2_goaways),
            "services": self.observer.history.annotate(self.topology.snapshot(now)),
        }


def tls_identity(tls: TlsConfig | None) -> tuple[str, str] | None:
    """What the TLS files hold, to tell a new certificate from the running one: the
    leaf certificate's SHA-256 fingerprint (as ``openssl x509 -fingerprint -sha256``
    writes it) and a digest of both files; None without TLS or when they cannot be read
    (``tls.load_context`` says why)."""
    if tls is None:
        return None
    try:
        with open(tls.cert, "rb") as cert, open(tls.key, "rb") as key:
            cert_bytes, key_bytes = cert.read(), key.read()
        pem = cert_bytes.decode("ascii", "replace")
        begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
        start = pem.index(begin)
        der = ssl.PEM_cert_to_DER_cert(pem[start : pem.index(end, start) + len(end)])
    except (OSError, ValueError):
        return None
    fingerprint = ":".join(f"{byte:02X}" for byte in hashlib.sha256(der).digest())
    return fingerprint, hashlib.sha256(cert_bytes + b"\0" + key_bytes).hexdigest()


def _load_and_diff(
    path: str, old: Config
) -> tuple[Config, ConfigDiff, ssl.SSLContext | None, tuple[str, str] | None] | ConfigError:
    """Read ``path``: the new config, what applying it changes, its TLS context (the
    certificate and key read again) and what those files hold (``tls_identity``); or the
    ``ConfigError`` that makes it unusable.

    Runs in the threadpool, which prints the traceback of anything raised there: an
    expected error is returned, never raised (anything else is a bug, and printed)."""
    try:
        new = load_config(path)
        context = load_context(new.tls, path) if new.tls is not None else None
    except ConfigError as error:
        return error
    return new, diff_configs(old, new), context, tls_identity(new.tls)


def _iso(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def run(config: Config, worker: WorkerSockets | None) -> int:
    """Serve ``config`` as one activator process until stopped. Returns the exit code."""
    try:
        runtime = Runtime(config, worker=worker)
    except ConfigError as error:  # a TLS pair that cannot serve
        fatal(f"activator: {error}")
        return 2
    try:
        runtime.start()
    except CannotListen as error:  # names the address: "cannot listen on 127.0.0.1:8080: ..."
        log.error("%s", error)
        return 1
    except OSError as error:
        log.error("cannot start: %s", error)
        return 1
    return runtime.serve_forever()

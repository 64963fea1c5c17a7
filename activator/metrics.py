"""StatsD metrics: what is sent, when, and how it can never hurt a request.

What this module decides (SPEC.md "StatsD metrics"; ``{p}`` prefix, ``{s}`` service,
``{pod}`` the pod address with ``.``, ``:``, ``[`` and ``]`` replaced by ``_``):

- Per request, when it is over, ONE pipeline (one datagram), built from lines
  precomputed per service (the hot path only formats two numbers):
  ``{p}.{s}.requests`` (c), ``{p}.{s}.responses.{2xx,3xx,4xx,5xx}`` (c, activator's
  own answers included), ``{p}.{s}.rejected.{queue_full,queue_timeout,shutting_down}``
  (c, from the ``X-Activator-Reason``), ``{p}.{s}.latency`` (ms, arrival to last
  byte) and ``{p}.{s}.queue_wait`` (ms, arrival to slot; only when a slot was
  obtained). Requests that matched no service (``404 unknown-host``) are not counted
  anywhere. A request whose client went away before any answer counts in
  ``requests`` and ``latency`` but in no ``responses`` class.
- Every second, from one greenlet (never per request): gauges ``{p}.{s}.queued``,
  ``.in_flight``, ``.capacity``, ``{p}.{s}.pods.{healthy,pending,draining}`` and
  ``{p}.{s}.pod.{pod}.in_flight``; and the per-pod transport-failure counters
  ``{p}.{s}.pod.{pod}.{connect_errors,timeouts,resets}`` as the increase of the
  trackers' ``failure_counts`` (healthy and unhealthy summed) since the last flush,
  so the request path does nothing for them. A counter whose increase is 0 is not
  sent. Failures recorded before this sink was created are not re-sent.
- ``capacity`` is omitted for ``container_concurrency: 0`` services (unlimited: no
  number is honest; ``pods.healthy`` says whether they can serve at all).
- A gauge that stops being reported (a pod removed, a service retired, a service
  turned unlimited) is sent once as 0, so a StatsD server that keeps the last value
  of a gauge does not show a stale one forever.
- On every pod state change: ``{p}.{s}.pod_transitions.{new_state}`` (c), sent with
  that pod's pending failure increase (a pod removed and forgotten keeps none).
- ``{p}.config.reload.{ok,failed}`` (c) on each reload.
- Tags mode (``statsd.tags: true``): the same names without the service and pod
  segments, which become DogStatsD tags: ``{p}.requests:1|c|#service:api``,
  ``{p}.pod.in_flight:1|g|#service:api,pod:10_0_1_5_8000``.
- With ``workers: N > 1`` every worker reports its own view, so its gauges carry the
  worker (``{p}.{s}.worker{i}.queued``, tag ``worker:{i}``); counters and timers are
  unchanged, since StatsD adds them up across processes.

Rules: sending never blocks and never raises into a request. The socket is a
non-blocking UDP socket (a full buffer drops the datagram; a dead address costs a
``sendto``); every send is guarded and the first failure is logged once. Building
and starting the sink does not yield (the server swaps it in during a reload without
yielding): a numeric address is used at once; a host name is resolved on the gauge
greenlet, retried every flush until it resolves (warned once); until then nothing is
sent. The UDP client is the ``statsd`` package's (4.0.1), its pipeline splitting at
512 bytes; the lines themselves are formatted here, which is all tags need.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import gevent
import gevent.socket
from gevent.monkey import get_original
from statsd.client.udp import Pipeline, StatsClient

from .core.config import StatsdConfig
from .core.states import PodState
from .core.throttler import FAILURE_KINDS, PodTracker, ServiceThrottler, Transition
from .core.topology import Topology
from .observe import MetricsSink, NoMetrics, RequestRecord

log = logging.getLogger("activator")

#: Seconds between gauge flushes (SPEC: at least every second).
FLUSH_SECONDS = 1.0

_numeric_getaddrinfo = get_original("socket", "getaddrinfo")

_REJECTED = {"queue-full": "queue_full", "queue-timeout": "queue_timeout", "shutting-down": "shutting_down"}
_POD_STATES = (PodState.HEALTHY, PodState.PENDING, PodState.DRAINING)
_POD_ID = str.maketrans({".": "_", ":": "_", "[": "_", "]": "_"})


def pod_id(address: str) -> str:
    """The ``{pod}`` segment: ``10.0.1.5:8000`` -> ``10_0_1_5_8000``."""
    return address.translate(_POD_ID)


class _Client(StatsClient):  # type: ignore[misc]
    """statsd's UDP client on an already resolved address and a non-blocking socket.

    ``StatsClient.__init__`` resolves the host itself (it may yield, and raises
    ``gaierror``), so it is not called; the attributes it would set are set here.
    """

    def __init__(self, family: int, sockaddr: Any) -> None:
        self._addr = sockaddr
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._prefix = None
        self._maxudpsize = 512

    def pipeline(self) -> _Pipeline:
        return _Pipeline(self)


class _Pipeline(Pipeline):  # type: ignore[misc]
    """A pipeline of lines formatted by this module (``name:value|type[|#tags]``)."""

    def line(self, text: str) -> None:
        self._stats.append(text)


class _Namer:
    """Spells metric names, plain or tagged, as ``(head, tail)``: a line is head + value + tail."""

    def __init__(self, config: StatsdConfig, worker: tuple[int, int]) -> None:
        self.prefix = config.prefix
        self.tags = config.tags
        self.worker = worker[0] if worker[1] > 1 else None

    def __call__(self, metric: str, kind: str, service: str | None = None, pod: str | None = None,
                 *, gauge: bool = False) -> tuple[str, str]:
        worker = self.worker if gauge else None
        if self.tags:
            tags = ",".join(f"{key}:{value}" for key, value in
                            (("service", service), ("pod", pod), ("worker", worker)) if value is not None)
            name = [self.prefix, "pod", metric] if pod is not None else [self.prefix, metric]
            return ".".join(name) + ":", (f"|{kind}|#{tags}" if tags else f"|{kind}")
        parts = [self.prefix]
        if service is not None:
            parts.append(service)
        if worker is not None:
            parts.append(f"worker{worker}")
        if pod is not None:
            parts += ["pod", pod]
        parts.append(metric)
        return ".".join(parts) + ":", f"|{kind}"


class _PodNames:
    """One pod's lines, and how much of its tracker's failures was already sent."""

    __slots__ = ("tracker", "in_flight", "failures", "sent")

    def __init__(self, namer: _Namer, service: str, tracker: PodTracker, sent: dict[str, int]) -> None:
        pod = pod_id(tracker.address)
        #: The tracker counted so far: a re-created tracker (same address) starts from zero.
        self.tracker = tracker
        self.in_flight = namer("in_flight", "g", service, pod, gauge=True)
        self.failures = {kind: namer(kind, "c", service, pod) for kind in FAILURE_KINDS}
        self.sent = sent

    def failure_lines(self, tracker: PodTracker) -> list[str]:
        """Counter lines for the failures since the last call (none when nothing new). Does not yield."""
        if tracker is not self.tracker:
            self.tracker = tracker
            self.sent = {}
        totals = failure_totals(tracker)
        lines = []
        for kind, (head, tail) in self.failures.items():
            increase = totals[kind] - self.sent.get(kind, 0)
            if increase > 0:
                lines.append(f"{head}{increase}{tail}")
        self.sent = totals
        return lines


def failure_totals(tracker: PodTracker) -> dict[str, int]:
    """Transport failures of a pod by kind, healthy and unhealthy summed."""
    totals = dict.fromkeys(FAILURE_KINDS, 0)
    for (kind, _), count in tracker.failure_counts.items():
        totals[kind] = totals.get(kind, 0) + count
    return totals


class _ServiceNames:
    """Everything a service's metrics are called, computed once."""

    __slots__ = ("namer", "name", "requests", "responses", "rejected", "latency", "queue_wait",
                 "queued", "in_flight", "capacity", "pods_in_state", "transitions", "pods")

    def __init__(self, namer: _Namer, service: str) -> None:
        self.namer = namer
        self.name = service

        def counter(metric: str) -> str:
            head, tail = namer(metric, "c", service)
            return f"{head}1{tail}"

        self.requests = counter("requests")
        self.responses = {cls: counter(f"responses.{cls}xx") for cls in (2, 3, 4, 5)}
        self.rejected = {reason: counter(f"rejected.{name}") for reason, name in _REJECTED.items()}
        self.latency = namer("latency", "ms", service)
        self.queue_wait = namer("queue_wait", "ms", service)
        self.queued = namer("queued", "g", service, gauge=True)
        self.in_flight = namer("in_flight", "g", service, gauge=True)
        self.capacity = namer("capacity", "g", service, gauge=True)
        self.pods_in_state = {state: namer(f"pods.{state.value}", "g", service, gauge=True) for state in _POD_STATES}
        self.transitions = {state: counter(f"pod_transitions.{state.value}") for state in PodState}
        self.pods: dict[str, _PodNames] = {}

    def pod(self, tracker: PodTracker, sent: dict[str, int] | None = None) -> _PodNames:
        names = self.pods.get(tracker.address)
        if names is None:
            names = self.pods[tracker.address] = _PodNames(self.namer, self.name, tracker, sent or {})
        return names


class StatsdMetrics:
    """The StatsD sink (see the module docstring). Its methods never raise and never yield."""

    def __init__(self, config: StatsdConfig, topology: Topology, *, interval: float = FLUSH_SECONDS) -> None:
        self.config = config
        self.topology = topology
        self.interval = interval
        self._namer = _Namer(config, topology.worker)
        self._services: dict[str, _ServiceNames] = {}
        # Failures already counted before this sink existed are not sent again.
        for throttler in topology.services.values():
            names = self._service(throttler.name)
            for tracker in throttler.trackers.values():
                names.pod(tracker, failure_totals(tracker))
        self._reload = {ok: f"{head}1{tail}" for ok, (head, tail) in
                        ((True, self._namer("config.reload.ok", "c")), (False, self._namer("config.reload.failed", "c")))}
        self._gauges: set[tuple[str, str]] = set()  # (head, tail) of every gauge sent at the last flush
        self._client: _Client | None = None
        self._greenlet: gevent.Greenlet | None = None
        self._stopped = False
        self._warned_resolve = False
        self._warned_send = False
        try:
            self._client = _connect(config, _numeric_getaddrinfo, socket.AI_NUMERICHOST)
        except OSError:
            pass  # a host name: resolved on the gauge greenlet

    # -- MetricsSink --------------------------------------------------------------

    def start(self) -> None:
        """Start the gauge greenlet. Call once; does not yield."""
        self._greenlet = gevent.spawn(self._run)

    def stop(self) -> None:
        """Stop sending: kill the gauge greenlet, close the socket. Does not yield."""
        self._stopped = True
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def request_started(self, service: str) -> None:
        """Nothing: a request is counted when it is over, so that it costs one datagram."""

    def request_done(self, record: RequestRecord) -> None:
        """One datagram for one request. Does not yield, never raises."""
        client = self._client
        if client is None or record.service == "-" or record.relayed:
            return
        try:
            names = self._services.get(record.service) or self._service(record.service)
            pipe = client.pipeline()
            pipe.line(names.requests)
            response = names.responses.get(record.status // 100)
            if response is not None:
                pipe.line(response)
            rejected = names.rejected.get(record.reason)
            if rejected is not None:
                pipe.line(rejected)
            head, tail = names.latency
            pipe.line(f"{head}{(record.end - record.start) * 1000:.3f}{tail}")
            if record.queue_wait is not None:
                head, tail = names.queue_wait
                pipe.line(f"{head}{record.queue_wait * 1000:.3f}{tail}")
            pipe.send()
        except Exception:
            self._send_failed()

    def transition(self, transition: Transition) -> None:
        """Count the pod's new state, with its failures so far (it may be forgotten next). Does not yield."""
        client = self._client
        if client is None:
            return
        try:
            names = self._services.get(transition.service) or self._service(transition.service)
            pipe = client.pipeline()
            pipe.line(names.transitions[transition.new])
            throttler = self.topology.services.get(transition.service)
            tracker = throttler.trackers.get(transition.address) if throttler is not None else None
            if tracker is not None:
                for line in names.pod(tracker).failure_lines(tracker):
                    pipe.line(line)
            pipe.send()
        except Exception:
            self._send_failed()

    def reload(self, ok: bool) -> None:
        """Count a reload. Does not yield."""
        client = self._client
        if client is None:
            return
        try:
            pipe = client.pipeline()
            pipe.line(self._reload[ok])
            pipe.send()
        except Exception:
            self._send_failed()

    # -- the gauge greenlet -------------------------------------------------------

    def flush(self) -> None:
        """Send every gauge and the failure counters' increase, as one pipeline. Does not yield."""
        client = self._client
        if client is None:
            return
        pipe = client.pipeline()
        sent: set[tuple[str, str]] = set()

        def gauge(name: tuple[str, str], value: int) -> None:
            pipe.line(f"{name[0]}{value}{name[1]}")
            sent.add(name)

        live: dict[str, ServiceThrottler] = self.topology.services
        for throttler in live.values():
            names = self._services.get(throttler.name) or self._service(throttler.name)
            gauge(names.queued, throttler.queued)
            gauge(names.in_flight, throttler.in_flight)
            if throttler.config.container_concurrency != 0:
                gauge(names.capacity, throttler.capacity or 0)
            per_state = dict.fromkeys(_POD_STATES, 0)
            for tracker in throttler.trackers.values():
                if tracker.state in per_state:
                    per_state[tracker.state] += 1
                pod = names.pod(tracker)
                gauge(pod.in_flight, tracker.in_flight)
                for line in pod.failure_lines(tracker):
                    pipe.line(line)
            for state, count in per_state.items():
                gauge(names.pods_in_state[state], count)
            for address in [a for a in names.pods if a not in throttler.trackers]:
                del names.pods[address]
        for name in [n for n in self._services if n not in live]:
            del self._services[name]
        for head, tail in self._gauges - sent:
            pipe.line(f"{head}0{tail}")
        self._gauges = sent
        pipe.send()

    def _run(self) -> None:
        while not self._stopped:
            if self._client is None:
                self._resolve()
            try:
                self.flush()
            except Exception:
                self._send_failed()
            gevent.sleep(self.interval)

    def _resolve(self) -> None:
        """Resolve the StatsD host name (yields: only on the gauge greenlet)."""
        try:
            client = _connect(self.config, gevent.socket.getaddrinfo, 0)
        except OSError as error:
            if not self._warned_resolve:
                self._warned_resolve = True
                log.warning("statsd: cannot resolve %s (%s); metrics are not sent, retrying every %ss",
                            self.config.address, error, self.interval)
            return
        if self._stopped:
            client.close()
            return
        self._client = client
        if self._warned_resolve:
            log.info("statsd: %s resolved, sending metrics", self.config.address)

    def _service(self, service: str) -> _ServiceNames:
        names = self._services[service] = _ServiceNames(self._namer, service)
        return names

    def _send_failed(self) -> None:
        if not self._warned_send:
            self._warned_send = True
            log.warning("statsd: sending failed (logged once)", exc_info=True)


def _connect(config: StatsdConfig, getaddrinfo: Any, flags: int) -> _Client:
    """A client for the configured address, IPv4 preferred (as the statsd package does)."""
    address = config.address
    infos = getaddrinfo(address.host, address.port, 0, socket.SOCK_DGRAM, 0, flags)
    family, _, _, _, sockaddr = min(infos, key=lambda info: info[0] != socket.AF_INET)
    return _Client(family, sockaddr)


def make_metrics(config: StatsdConfig | None, topology: Topology) -> MetricsSink:
    """The sink for this configuration: StatsD, or nothing. Does not yield, never raises on a bad address."""
    if config is None:
        return NoMetrics()
    return StatsdMetrics(config, topology)

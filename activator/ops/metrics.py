"""StatsD metrics: what is sent, when, and how it can never hurt a request.

What this module decides (SPEC.md "StatsD metrics"; ``{p}`` prefix, ``{s}`` service,
``{pod}`` the pod address with ``.``, ``:``, ``[`` and ``]`` replaced by ``_``):

- Per request, when it is over, ONE batch (one datagram), from names computed once per
  service: ``{p}.{s}.requests`` (c), ``{p}.{s}.responses.{2xx,3xx,4xx,5xx}`` (c, by the
  status the client got, activator's own answers included),
  ``{p}.{s}.rejected.{queue_full,queue_timeout,shutting_down,shed,tenant_queue_full}`` (c, from the
  ``X-Activator-Reason``), ``{p}.{s}.latency`` (ms, arrival to last byte) and
  ``{p}.{s}.queue_wait`` (ms, arrival to slot; only when a slot was obtained), and for a
  service with priority classes ``{p}.{s}.class.{c}.queue_wait`` too; timings
  are written as statsd writes them, with six decimals. A client that left before the last byte is
  recorded as 499 ``client-gone`` (``proxy.py``), so it counts as a 4xx response; a
  record with no status (0) counts in no class.
- A request refused before it was routed (no service: a head the engine refused, an
  unknown host; ``observe.refusal_record``) is one ``{p}.rejected.{reason}`` (c), the
  reason's ``-`` spelled ``_`` (``bad_request``, ``bad_host``, ``unknown_host``, and
  ``header_too_large`` for ``headers-too-large``, as SPEC.md names it), nothing else.
- Every second, from one greenlet (never per request): gauges ``{p}.{s}.queued``,
  ``.in_flight``, ``.tunnels`` (open WebSockets and other upgrades), ``.capacity``,
  ``{p}.{s}.class.{c}.queued`` per priority class (when the service has classes),
  ``{p}.{s}.pods.{healthy,pending,draining}``,
  ``{p}.{s}.pod.{pod}.in_flight`` and ``{p}.{s}.pod.{pod}.peak_in_flight`` (the highest
  since the pod's tracker exists: the proof that its limit held), ``.pod.{pod}.load`` and
  ``.pod.{pod}.announced_concurrency`` (what the pod announced, ``core.load``; not sent
  while it announced nothing); and the per-pod transport-failure counters
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
  that pod's pending failure increase. The sink remembers each pod's tracker, so a pod
  that the core forgot in the very call that reported its removal still sends its last
  failures (a pod the sink never saw keeps none).
- ``{p}.config.reload.{ok,failed}`` (c) on each reload.
- Tags mode (``statsd.tags: true``): the same names without the service and pod
  segments, which become DogStatsD tags: ``{p}.requests:1|c|#service:api``,
  ``{p}.pod.in_flight:1|g|#service:api,pod:10_0_1_5_8000``.
- With ``workers: N > 1`` every worker reports its own view, so its gauges carry the
  worker (``{p}.{s}.worker{i}.queued``, tag ``worker:{i}``); counters and timers are
  unchanged, since StatsD adds them up across processes.

How it is sent. One naming function (``Namer``) spells every metric in both modes: a
``Metric`` is a name and its tag suffix (empty in plain mode). The sink fills a
``Batch`` (``count``, ``timing``, ``gauge``, then ``send``), of one of two kinds:

- plain mode: ``PlainBatch``, the ``statsd`` package's own pipeline through its public
  API only (``statsd.StatsClient``, ``pipeline()``, ``incr`` / ``timing`` / ``gauge``,
  ``send()``, ``close()``); the pipeline joins the lines into datagrams below 512 bytes;
- tags mode: ``TaggedBatch``, because statsd's API cannot write a DogStatsD line (it
  appends the type after the value itself, and knows no tags). It writes the lines
  with the value texts statsd would use, and ``TaggedSender`` sends them on a
  non-blocking UDP socket of its own, joined into datagrams exactly as statsd's
  pipeline splits them (``split_into_datagrams``).

Rules: sending never blocks and never raises into a request; the first send failure is
logged once.

- Building, starting and stopping the sink, and every send, do not yield (the server
  swaps sinks during a reload without yielding; pod changes are counted within the
  topology writer's step, which must not yield). The address is resolved, and the sender built, on the
  sink's own gauge greenlet (``connect``), which may yield; a host that does not
  resolve is retried every flush and warned about once. Until the sender exists
  nothing is sent: a request's metrics are dropped, and the event counters (reloads,
  pod changes) are added up and go with the first flush.
- Both senders use a non-blocking UDP socket: a full buffer drops the datagram, a dead
  address costs a ``sendto``. Socket errors are dropped silently (statsd's own rule,
  kept by ours); anything else is caught and logged once.
- statsd's client resolves its host itself (``socket.getaddrinfo``, which yields under
  gevent's monkey-patching) and takes the process's default timeout for its socket
  (blocking). So it is given the address already resolved and built in one step that
  cannot yield (``_statsd_client``): gevent's non-cooperative resolver, instant on a
  numeric address, and a zero default timeout, which makes its socket non-blocking.
  Both are put back before anything else can run, so no other code sees either.
"""

from __future__ import annotations

import logging
import socket
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, Protocol

import gevent
import gevent.socket
import statsd
from gevent.resolver.blocking import Resolver as BlockingResolver

from ..core.autoscale import Action, LaunchEffect, Launches
from ..core.config import Address, StatsdConfig
from ..core.failures import FailureKind
from ..core.h2budgets import Budget
from ..core.peering import PeerState
from ..core.states import PodState
from ..core.throttler import PodTracker, ServiceThrottler, Transition
from ..core.topology import Topology
from .history import REASONS
from .observe import MetricsSink, NoMetrics, RequestRecord

log = logging.getLogger("activator")

#: Seconds between gauge flushes (SPEC: at least every second).
FLUSH_SECONDS = 1.0

#: Datagrams stay below this many bytes (statsd's ``maxudpsize``; a lone longer line
#: goes alone).
MAX_DATAGRAM = 512

#: ``{p}.{s}.launch.{name}`` counts these launcher actions.
_LAUNCH_COUNTS = {Action.START: "started", Action.STOP: "stopped", Action.FAILED: "failed"}
_REJECTED = {
    "queue-full": "queue_full",
    "queue-timeout": "queue_timeout",
    "shutting-down": "shutting_down",
    "shed": "shed",
    "tenant-queue-full": "tenant_queue_full",
}
#: ``{p}.rejected.{name}`` of each refusal before routing (SPEC.md spells one in the singular).
_REFUSED = {reason: reason.replace("-", "_") for reason in REASONS} | {"headers-too-large": "header_too_large"}
_POD_STATES = (PodState.HEALTHY, PodState.PENDING, PodState.DRAINING)
_POD_ID = str.maketrans({".": "_", ":": "_", "[": "_", "]": "_"})


def pod_id(address: str) -> str:
    """The ``{pod}`` segment: ``10.0.1.5:8000`` -> ``10_0_1_5_8000``."""
    return address.translate(_POD_ID)


# -- names ------------------------------------------------------------------------


class Metric(NamedTuple):
    """A metric as it is sent: its name, and its DogStatsD tags (``|#service:api``, or "")."""

    name: str
    tags: str = ""


class Namer:
    """Spells every metric, plain or tagged: the one naming function of both modes."""

    def __init__(self, config: StatsdConfig, worker: tuple[int, int]) -> None:
        self.prefix = config.prefix
        self.tags = config.tags
        self.worker = worker[0] if worker[1] > 1 else None

    def __call__(
        self, metric: str, service: str | None = None, pod: str | None = None, *, gauge: bool = False
    ) -> Metric:
        worker = self.worker if gauge else None
        if self.tags:
            tags = ",".join(
                f"{key}:{value}"
                for key, value in (("service", service), ("pod", pod), ("worker", worker))
                if value is not None
            )
            name = f"{self.prefix}.pod.{metric}" if pod is not None else f"{self.prefix}.{metric}"
            return Metric(name, f"|#{tags}" if tags else "")
        parts = [self.prefix]
        if service is not None:
            parts.append(service)
        if worker is not None:
            parts.append(f"worker{worker}")
        if pod is not None:
            parts += ["pod", pod]
        parts.append(metric)
        return Metric(".".join(parts))


# -- senders ----------------------------------------------------------------------


class Batch(Protocol):
    """Lines to send together (as few datagrams as fit). No call yields."""

    def count(self, metric: Metric, value: int = 1) -> None: ...
    def timing(self, metric: Metric, ms: float) -> None: ...
    def gauge(self, metric: Metric, value: float) -> None: ...
    def send(self) -> None: ...


class Sender(Protocol):
    def batch(self) -> Batch: ...
    def close(self) -> None: ...


class PlainBatch:
    """Plain lines through statsd's own pipeline (its public calls only)."""

    __slots__ = ("pipe",)

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    def count(self, metric: Metric, value: int = 1) -> None:
        self.pipe.incr(metric.name, value)

    def timing(self, metric: Metric, ms: float) -> None:
        self.pipe.timing(metric.name, ms)

    def gauge(self, metric: Metric, value: float) -> None:
        self.pipe.gauge(metric.name, value)

    def send(self) -> None:
        self.pipe.send()


class PlainSender:
    """statsd's UDP client on a resolved address (see ``_statsd_client``). Does not yield."""

    def __init__(self, family: int, sockaddr: tuple[Any, ...]) -> None:
        self.client = _statsd_client(family, sockaddr)

    def batch(self) -> PlainBatch:
        return PlainBatch(self.client.pipeline())

    def close(self) -> None:
        self.client.close()


class TaggedBatch:
    """DogStatsD lines (``name:value|type|#tags``), with the value texts statsd writes."""

    __slots__ = ("sender", "lines")

    def __init__(self, sender: TaggedSender) -> None:
        self.sender = sender
        self.lines: list[str] = []

    def count(self, metric: Metric, value: int = 1) -> None:
        self.lines.append(f"{metric.name}:{value}|c{metric.tags}")

    def timing(self, metric: Metric, ms: float) -> None:
        self.lines.append(f"{metric.name}:{ms:0.6f}|ms{metric.tags}")

    def gauge(self, metric: Metric, value: float) -> None:
        self.lines.append(f"{metric.name}:{value}|g{metric.tags}")

    def send(self) -> None:
        self.sender.send(self.lines)


class TaggedSender:
    """Our own sender for tags mode: a non-blocking UDP socket. Does not yield."""

    def __init__(self, family: int, sockaddr: tuple[Any, ...]) -> None:
        self.sockaddr = sockaddr
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.setblocking(False)

    def batch(self) -> TaggedBatch:
        return TaggedBatch(self)

    def send(self, lines: Iterable[str]) -> None:
        for datagram in split_into_datagrams(lines):
            try:
                self.sock.sendto(datagram.encode("ascii"), self.sockaddr)
            except OSError:
                pass  # a full buffer, an unreachable address: the datagram is dropped, as statsd does

    def close(self) -> None:
        self.sock.close()


def split_into_datagrams(lines: Iterable[str], limit: int = MAX_DATAGRAM) -> Iterator[str]:
    """Lines joined by newlines as statsd's pipeline joins them: a line goes into the
    current datagram when the result stays below ``limit``, else it starts the next."""
    data: str | None = None
    for line in lines:
        if data is None:
            data = line
        elif len(data) + 1 + len(line) >= limit:
            yield data
            data = line
        else:
            data += "\n" + line
    if data is not None:
        yield data


def _resolve(address: Address) -> tuple[int, tuple[Any, ...]]:
    """``(family, sockaddr)`` of the StatsD address, IPv4 preferred. Yields (gevent's resolver)."""
    infos = gevent.socket.getaddrinfo(address.host, address.port, 0, socket.SOCK_DGRAM)
    family, _, _, _, sockaddr = min(infos, key=lambda info: info[0] != socket.AF_INET)
    return family, sockaddr


def _statsd_client(family: int, sockaddr: tuple[Any, ...]) -> Any:
    """statsd's client on this numeric address, its socket non-blocking. Does not yield.

    Its constructor calls ``socket.getaddrinfo`` (gevent's cooperative resolver under
    monkey-patching: a yield, even for a numeric address) and opens its socket with the
    default timeout. For this one step, the hub resolves without yielding (instant on a
    numeric address) and new sockets are non-blocking: since nothing yields in between,
    no other greenlet sees either setting.
    """
    hub = gevent.get_hub()
    resolver, default_timeout = hub.resolver, socket.getdefaulttimeout()
    hub.resolver = BlockingResolver()
    socket.setdefaulttimeout(0.0)
    try:
        return statsd.StatsClient(
            sockaddr[0], sockaddr[1], prefix=None, maxudpsize=MAX_DATAGRAM, ipv6=family == socket.AF_INET6
        )
    finally:
        socket.setdefaulttimeout(default_timeout)
        hub.resolver = resolver


# -- what each service and pod is called -------------------------------------------


def failure_totals(tracker: PodTracker) -> dict[FailureKind, int]:
    """Transport failures of a pod by kind, healthy and unhealthy summed."""
    totals = dict.fromkeys(FailureKind, 0)
    for (kind, _healthy), count in tracker.failure_counts.items():
        totals[kind] += count
    return totals


class _PodNames:
    """One pod's metrics, the tracker last seen for it, and how much of its failures was sent."""

    __slots__ = ("tracker", "in_flight", "peak_in_flight", "load", "announced", "failures", "sent")

    def __init__(self, namer: Namer, service: str, tracker: PodTracker, sent: dict[FailureKind, int]) -> None:
        pod = pod_id(tracker.address)
        #: The tracker counted so far: a re-created tracker (same address) starts from zero.
        self.tracker = tracker
        self.in_flight = namer("in_flight", service, pod, gauge=True)
        self.peak_in_flight = namer("peak_in_flight", service, pod, gauge=True)
        self.load = namer("load", service, pod, gauge=True)
        self.announced = namer("announced_concurrency", service, pod, gauge=True)
        self.failures = {kind: namer(kind.value, service, pod) for kind in FailureKind}
        self.sent = sent

    def gauges(self, tracker: PodTracker) -> list[tuple[Metric, float]]:
        """The pod's gauges now (what it announced only when it did). Does not yield."""
        shown: list[tuple[Metric, float]] = [
            (self.in_flight, tracker.in_flight),
            (self.peak_in_flight, tracker.peak_in_flight),
        ]
        if tracker.load is not None:
            shown.append((self.load, tracker.load))
        if tracker.announced is not None:
            shown.append((self.announced, tracker.announced))
        return shown

    def failure_increase(self, tracker: PodTracker) -> list[tuple[Metric, int]]:
        """Counters for the failures since the last call (none when nothing new). Does not yield."""
        if tracker is not self.tracker:
            self.tracker = tracker
            self.sent = {}
        totals = failure_totals(tracker)
        increase = [(self.failures[kind], totals[kind] - self.sent.get(kind, 0)) for kind in FailureKind]
        self.sent = totals
        return [(metric, count) for metric, count in increase if count > 0]


class _ServiceNames:
    """Everything a service's metrics are called, computed once."""

    __slots__ = (
        "namer",
        "name",
        "requests",
        "responses",
        "rejected",
        "latency",
        "queue_wait",
        "queued",
        "in_flight",
        "tunnels",
        "capacity",
        "handover_slots",
        "pods_in_state",
        "transitions",
        "pods",
        "launch",
        "cold_start",
        "desired",
        "classes",
    )

    def __init__(self, namer: Namer, service: str) -> None:
        self.namer = namer
        self.name = service
        self.requests = namer("requests", service)
        self.responses = {cls: namer(f"responses.{cls}xx", service) for cls in (2, 3, 4, 5)}
        self.rejected = {reason: namer(f"rejected.{name}", service) for reason, name in _REJECTED.items()}
        self.latency = namer("latency", service)
        self.queue_wait = namer("queue_wait", service)
        self.queued = namer("queued", service, gauge=True)
        self.in_flight = namer("in_flight", service, gauge=True)
        self.tunnels = namer("tunnels", service, gauge=True)
        self.capacity = namer("capacity", service, gauge=True)
        self.handover_slots = namer("handover_slots", service, gauge=True)
        self.pods_in_state = {state: namer(f"pods.{state.value}", service, gauge=True) for state in _POD_STATES}
        self.transitions = {state: namer(f"pod_transitions.{state.value}", service) for state in PodState}
        self.pods: dict[str, _PodNames] = {}
        self.launch = {action: namer(f"launch.{name}", service) for action, name in _LAUNCH_COUNTS.items()}
        self.cold_start = namer("launch.cold_start", service)
        self.desired = namer("launch.desired", service, gauge=True)
        #: Priority class -> its (queued, queue_wait), named when first needed.
        self.classes: dict[str, tuple[Metric, Metric]] = {}

    def klass(self, name: str) -> tuple[Metric, Metric]:
        names = self.classes.get(name)
        if names is None:
            names = self.classes[name] = (
                self.namer(f"class.{name}.queued", self.name, gauge=True),
                self.namer(f"class.{name}.queue_wait", self.name),
            )
        return names

    def pod(self, tracker: PodTracker, sent: dict[FailureKind, int] | None = None) -> _PodNames:
        names = self.pods.get(tracker.address)
        if names is None:
            names = self.pods[tracker.address] = _PodNames(self.namer, self.name, tracker, sent or {})
        return names


# -- the sink ----------------------------------------------------------------------


class StatsdMetrics:
    """The StatsD sink (see the module docstring). Its methods never raise, and only
    ``connect`` yields."""

    def __init__(self, config: StatsdConfig, topology: Topology, *, interval: float = FLUSH_SECONDS) -> None:
        self.config = config
        self.topology = topology
        self.interval = interval
        self._namer = Namer(config, topology.worker)
        self._services: dict[str, _ServiceNames] = {}
        # Failures already counted before this sink existed are not sent again.
        for throttler in topology.services.values():
            names = self._names(throttler.name)
            for tracker in throttler.trackers.values():
                names.pod(tracker, failure_totals(tracker))
        self._reload = {True: self._namer("config.reload.ok"), False: self._namer("config.reload.failed")}
        self._refused = {reason: self._namer(f"rejected.{name}") for reason, name in _REFUSED.items()}
        self._goaway = {budget.value: self._namer(f"h2.goaway.{budget.value}") for budget in Budget}
        #: The launcher's scalers (``launch:``; the server sets it): their desired pods are gauges.
        self.launches: Launches | None = None
        self._gauges: set[Metric] = set()  # every gauge sent at the last flush
        #: Event counters counted while there was no sender yet: they go with the first flush.
        self._pending: dict[Metric, int] = {}
        self._sender: Sender | None = None
        self._greenlet: gevent.Greenlet | None = None
        self._stopped = False
        self._warned_resolve = False
        self._warned_send = False

    # -- MetricsSink --------------------------------------------------------------

    def start(self) -> None:
        """Start the gauge greenlet. Call once; does not yield."""
        self._greenlet = gevent.spawn(self._run)

    def stop(self) -> None:
        """Stop sending: kill the gauge greenlet, close the socket. Does not yield."""
        self._stopped = True
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
        sender, self._sender = self._sender, None
        if sender is not None:
            try:
                sender.close()
            except Exception:
                self._send_failed()

    def request_started(self, service: str) -> None:
        """Nothing: a request is counted when it is over, so that it costs one datagram."""

    def request_done(self, record: RequestRecord) -> None:
        """One datagram for one request (none before the sender exists). Does not yield, never raises."""
        sender = self._sender
        if sender is None:
            return
        if record.service == "-":
            refused = self._refused.get(record.reason)
            if refused is not None:
                try:
                    self._count([(refused, 1)])
                except Exception:
                    self._send_failed()
            return
        try:
            names = self._services.get(record.service) or self._names(record.service)
            batch = sender.batch()
            batch.count(names.requests)
            response = names.responses.get(record.status // 100)
            if response is not None:
                batch.count(response)
            rejected = names.rejected.get(record.reason)
            if rejected is not None:
                batch.count(rejected)
            batch.timing(names.latency, (record.end - record.start) * 1000)
            if record.queue_wait is not None:
                batch.timing(names.queue_wait, record.queue_wait * 1000)
                if record.klass is not None:
                    batch.timing(names.klass(record.klass)[1], record.queue_wait * 1000)
            batch.send()
        except Exception:
            self._send_failed()

    def transition(self, transition: Transition) -> None:
        """Count the pod's new state, with its failures so far (it may be forgotten already). Does not yield."""
        try:
            names = self._services.get(transition.service) or self._names(transition.service)
            counts = [(names.transitions[transition.new], 1)]
            tracker = self._tracker(names, transition.address)
            if tracker is not None:
                counts += names.pod(tracker).failure_increase(tracker)
            self._count(counts)
        except Exception:
            self._send_failed()

    def reload(self, ok: bool) -> None:
        """Count a reload. Does not yield."""
        try:
            self._count([(self._reload[ok], 1)])
        except Exception:
            self._send_failed()

    def launched(self, effect: LaunchEffect) -> None:
        """Count a launch (``{p}.{s}.launch.{started,stopped,failed}``) or time a cold
        start (``{p}.{s}.launch.cold_start``). Does not yield."""
        try:
            names = self._services.get(effect.service) or self._names(effect.service)
            counter = names.launch.get(effect.action)
            if counter is not None:
                self._count([(counter, 1)])
            elif effect.action is Action.READY and effect.seconds is not None and self._sender is not None:
                batch = self._sender.batch()
                batch.timing(names.cold_start, effect.seconds * 1000)
                batch.send()
        except Exception:
            self._send_failed()

    def h2_goaway(self, budget: str) -> None:
        """Count an HTTP/2 connection closed past ``budget`` (``{p}.h2.goaway.{budget}``). Does not yield."""
        try:
            self._count([(self._goaway[budget], 1)])
        except Exception:
            self._send_failed()

    # -- the gauge greenlet -------------------------------------------------------

    def connect(self) -> bool:
        """Resolve the address and build the sender, unless built: whether it is built now.

        Yields (name resolution): the gauge greenlet calls it before each flush; tests
        call it to make a sink live without that greenlet.
        """
        if self._sender is not None:
            return True
        if self._stopped:
            return False
        resolved = self._resolved_address()
        if resolved is None or self._stopped:  # (or it was stopped while resolving)
            return False
        family, sockaddr = resolved
        try:
            self._sender = (TaggedSender if self.config.tags else PlainSender)(family, sockaddr)
        except Exception:
            self._send_failed()
            return False
        if self._warned_resolve:
            log.info("statsd: %s resolved, sending metrics", self.config.address)
        return True

    def _resolved_address(self) -> tuple[int, tuple[Any, ...]] | None:
        """The address resolved (yields), or None, with one warning until it resolves again."""
        try:
            return _resolve(self.config.address)
        except OSError as error:
            if not self._warned_resolve:
                self._warned_resolve = True
                log.warning(
                    "statsd: cannot resolve %s (%s); metrics are not sent, retrying every %ss",
                    self.config.address,
                    error,
                    self.interval,
                )
            return None

    def flush(self) -> None:
        """Send every gauge, the failure counters' increase and the pending event
        counters, as one batch. Does not yield, never raises."""
        sender = self._sender
        if sender is None:
            return
        try:
            batch = sender.batch()
            self._fill(batch)
            batch.send()
        except Exception:
            self._send_failed()

    def _fill(self, batch: Batch) -> None:
        sent: set[Metric] = set()

        def gauge(metric: Metric, value: float) -> None:
            batch.gauge(metric, value)
            sent.add(metric)

        def count(counts: Iterable[tuple[Metric, int]]) -> None:
            for metric, value in counts:
                batch.count(metric, value)

        live: dict[str, ServiceThrottler] = self.topology.services
        fleet = self.topology.fleet
        for peer, health in fleet.health.items():
            gauge(self._namer(f"peer.{peer}.up", gauge=True), 1 if health.state is PeerState.UP else 0)
        for throttler in live.values():
            names = self._services.get(throttler.name) or self._names(throttler.name)
            gauge(names.queued, throttler.queued)
            for metric, value in [*_class_gauges(names, throttler), *self._launch_gauges(names, throttler.name)]:
                gauge(metric, value)
            gauge(names.in_flight, throttler.in_flight)
            gauge(names.tunnels, throttler.tunnels)
            if throttler.config.container_concurrency != 0:
                gauge(names.capacity, throttler.capacity or 0)
            if fleet.divided(throttler.name):
                gauge(names.handover_slots, fleet.held_slots(throttler.name))
            per_state = Counter(tracker.state for tracker in throttler.trackers.values())
            for tracker in throttler.trackers.values():
                pod = names.pod(tracker)
                for metric, reading in pod.gauges(tracker):
                    gauge(metric, reading)
                count(pod.failure_increase(tracker))
            for state in _POD_STATES:
                gauge(names.pods_in_state[state], per_state[state])
            for address in [a for a in names.pods if a not in throttler.trackers]:
                del names.pods[address]
        for name in [n for n in self._services if n not in live]:
            del self._services[name]
        for metric in self._gauges - sent:
            batch.gauge(metric, 0)
        self._gauges = sent
        pending, self._pending = self._pending, {}
        count(pending.items())

    def _launch_gauges(self, names: _ServiceNames, service: str) -> list[tuple[Metric, int]]:
        """``launch.desired`` of a launched service (none otherwise)."""
        scaler = self.launches.services.get(service) if self.launches is not None else None
        return [(names.desired, scaler.desired)] if scaler is not None else []

    def _run(self) -> None:
        while not self._stopped:
            if self.connect():
                self.flush()
            gevent.sleep(self.interval)

    # -- helpers ------------------------------------------------------------------

    def _count(self, counts: list[tuple[Metric, int]]) -> None:
        """Send these event counters now as one batch, or keep them for the first flush."""
        sender = self._sender
        if sender is None:
            pending = self._pending
            for metric, value in counts:
                pending[metric] = pending.get(metric, 0) + value
            return
        batch = sender.batch()
        for metric, value in counts:
            batch.count(metric, value)
        batch.send()

    def _tracker(self, names: _ServiceNames, address: str) -> PodTracker | None:
        """The pod's tracker: the topology's, else the one this sink last saw (forgotten since)."""
        throttler = self.topology.services.get(names.name)
        tracker = throttler.trackers.get(address) if throttler is not None else None
        if tracker is None:
            remembered = names.pods.get(address)
            tracker = remembered.tracker if remembered is not None else None
        return tracker

    def _names(self, service: str) -> _ServiceNames:
        names = self._services[service] = _ServiceNames(self._namer, service)
        return names

    def _send_failed(self) -> None:
        if not self._warned_send:
            self._warned_send = True
            log.warning("statsd: sending failed (logged once)", exc_info=True)


def _class_gauges(names: _ServiceNames, throttler: ServiceThrottler) -> list[tuple[Metric, int]]:
    """``class.{c}.queued`` of a service with priority classes (none without)."""
    priority = throttler.config.priority
    if priority is None:
        return []
    return [
        (names.klass(name)[0], queued)
        for name, queued in zip(priority.classes, throttler.queue.queued_by_class(), strict=False)
    ]


def make_metrics(config: StatsdConfig | None, topology: Topology, launches: Launches | None = None) -> MetricsSink:
    """The sink for this configuration: StatsD, or nothing. Does not yield, never raises on a bad address."""
    if config is None:
        return NoMetrics()
    metrics = StatsdMetrics(config, topology)
    metrics.launches = launches
    return metrics

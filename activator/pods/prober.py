"""Active health probes: one greenlet per probed pod, staggered, reporting to the writer.

What is probed, when a probe is due and what an outcome counts as are decided in
``core.probes``; this module does the I/O:

- ``sync`` keeps one greenlet per (service, pod) that ``core.probes.probed`` says is
  probed, and stops the others; the shell calls it whenever pod states changed.
- Each greenlet waits a random offset within the first ``interval`` (so that probes of
  many pods do not fire together), then every ``interval`` (a pod booting after its
  launcher started it: every ``BOOT_PROBE_INTERVAL``, from its start): if the probe is due (not
  while every slot of the pod here is in use), it sends ``GET probe.path`` with its own
  connection (never a proxied request's) and reports the ``ProbeOutcome``, judged by
  ``core.probes.judge``, to the topology writer as a ``ProbeReport`` with how long the
  probe took (shown as the pod's last probe in /status). Inconclusive verdicts are not
  reported.
- The outcome comes from what happened, by type: a 2xx/3xx answer passes; another
  status is ``BAD_STATUS``; a connection that could not be made is ``REFUSED``; no
  complete answer in time is ``TIMED_OUT``; anything else broken is ``BROKEN``.
- **A pass is an answer within ``timeout``, as measured here** (``within_timeout``): the
  pool's deadlines are swept every 0.1 s and a busy loop reads late, so an answer can
  complete after the timeout; it is then ``TIMED_OUT`` (saying how long it took), never
  a pass that took longer than the probe allows.
- **The load gauge** (``load: {from: {path, metric}}``): at each interval, due probe or
  not (a busy pod is the one whose load matters), ``GET load.path`` with the probe's
  connection and timeout; the Prometheus text (at most ``MAX_METRICS_BYTES``) is parsed
  with prometheus-client's own parser, and the sum of the samples named ``metric`` (one
  per label set, e.g. per model) is the pod's figure, posted as ``LoadReported`` when it
  changed. No such sample, an error status, a body too long or unparsable: no figure
  (the pod counts as silent: ``auto``'s choice), never a stale one.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import gevent
from prometheus_client.parser import text_string_to_metric_families

from ..base.exchange import PodRequest
from ..base.writer import TopologyWriter
from ..core.config import LoadConfig, ProbeConfig
from ..core.errors import UpstreamBodyError, UpstreamConnectError, UpstreamTimeout
from ..core.events import LoadReported, ProbeReport
from ..core.failures import FailureKind
from ..core.heads import BodyFraming
from ..core.probes import (
    GRPC_HEALTH_PATH,
    GRPC_HEALTH_REQUEST,
    ProbeOutcome,
    Verdict,
    grpc_health_outcome,
    judge,
    probe_due,
    probed,
)
from ..core.timeouts import Timeouts
from ..core.topology import Topology
from .clients import H2C, HTTP1, PodClient, make_client
from .http1 import FixedBody

PROBE_HEADERS = [(b"User-Agent", b"activator-probe"), (b"Accept", b"*/*")]
#: How often a booting pod (started by the launcher, not ready yet) is probed, whatever its
#: ``probe.interval``: the wait between its readiness and its first request is activator's
#: own share of a cold start.
BOOT_PROBE_INTERVAL = 0.01
#: A longer Prometheus text is not read (a model server's is some hundred KB).
MAX_METRICS_BYTES = 1 << 20


class Prober:
    """Keeps one probe greenlet per (service, pod) that needs probing."""

    def __init__(self, topology: Topology, writer: TopologyWriter) -> None:
        self.topology = topology
        self.writer = writer
        self._greenlets: dict[tuple[str, str], gevent.Greenlet] = {}
        #: Whether (service, pod) is booting (``process.launcher.Launching.booting``): probed
        #: every ``BOOT_PROBE_INTERVAL`` then.
        self.booting: Callable[[str, str], bool] = lambda service, address: False

    def sync(self) -> None:
        """Start probes for pods that need them, stop the others. Does not yield."""
        wanted = set()
        for name, service in self.topology.services.items():
            if service.config.probe is None:
                continue
            for address, tracker in service.trackers.items():
                if probed(tracker.state):
                    wanted.add((name, address))
        for key in list(self._greenlets):
            if key not in wanted or self._greenlets[key].dead:
                self._greenlets.pop(key).kill(block=False)
        for key in wanted - self._greenlets.keys():
            self._greenlets[key] = gevent.spawn(self._probe_forever, *key)

    def hurry(self, service: str, address: str) -> None:
        """The pod started booting: its probes begin now, at the boot interval. Does not yield."""
        key = (service, address)
        greenlet = self._greenlets.pop(key, None)
        if greenlet is not None:
            greenlet.kill(block=False)
        self.sync()

    def stop(self) -> None:
        for greenlet in self._greenlets.values():
            greenlet.kill(block=False)
        self._greenlets.clear()

    def _probe_forever(self, service_name: str, address: str) -> None:
        protocol = HTTP1
        pool = make_client(address, protocol, max_idle=1)
        first = True
        try:
            while True:
                service = self.topology.services.get(service_name)
                probe = service.config.probe if service else None
                if service is None or probe is None:
                    return
                if service.config.protocol != protocol:  # spoken to as the service says
                    pool.close()
                    protocol = service.config.protocol
                    pool = make_client(address, protocol, max_idle=1)
                if self.booting(service_name, address):
                    gevent.sleep(min(probe.interval, BOOT_PROBE_INTERVAL))
                else:
                    # A launched service's pods are probed at once at first: until then, the
                    # launcher cannot tell whether one runs already.
                    offset = 0.0 if service.config.launch is not None else random.uniform(0, probe.interval)
                    gevent.sleep(offset if first else probe.interval)
                first = False
                service = self.topology.services.get(service_name)
                tracker = service.trackers.get(address) if service else None
                probe = service.config.probe if service else None
                if service is None or tracker is None or probe is None or not probed(tracker.state):
                    return
                load = service.config.load
                if load is not None and load.path is not None:
                    figure = read_gauge(pool, address, load, probe.timeout)
                    if figure != tracker.load:
                        self.writer.post(LoadReported(service_name, address, figure, None))
                if not probe_due(tracker.in_flight, tracker.limit):
                    continue  # busy with our own requests: alive, and a probe would queue behind them
                started = time.monotonic()
                outcome, detail = probe_once(pool, address, probe, protocol)
                duration = time.monotonic() - started
                outcome, detail = within_timeout(outcome, detail, duration, probe.timeout)
                verdict = judge(outcome, tracker.in_flight)
                if verdict is not Verdict.INCONCLUSIVE:
                    self.writer.post(ProbeReport(service_name, address, verdict, detail, duration))
        finally:
            pool.close()


def within_timeout(outcome: ProbeOutcome, detail: str, duration: float, timeout: float) -> tuple[ProbeOutcome, str]:
    """A probe's outcome, given how long it took: a pass after ``timeout`` is a timeout."""
    if outcome is ProbeOutcome.PASSED and duration > timeout:
        return ProbeOutcome.TIMED_OUT, f"answered after {duration:.2f}s, over the {timeout:g}s timeout"
    return outcome, detail


def probe_once(pool: PodClient, address: str, probe: ProbeConfig, protocol: str = HTTP1) -> tuple[ProbeOutcome, str]:
    """One probe: what happened, and in words.

    ``GET probe.path``; on an ``h2c`` service whose probe path is
    ``core.probes.GRPC_HEALTH_PATH``, a gRPC health check instead.
    """
    grpc_check = protocol == H2C and probe.path == GRPC_HEALTH_PATH
    headers = [(b"Host", address.encode()), *PROBE_HEADERS]
    body: FixedBody | None = None
    if grpc_check:
        headers += [(b"Content-Type", b"application/grpc")]
        body = FixedBody(GRPC_HEALTH_REQUEST)
    timeouts = Timeouts(probe.timeout, probe.timeout, total=probe.timeout)
    data = bytearray()
    try:
        with gevent.Timeout(probe.timeout * 2 + 1):  # backstop; the pool enforces the real timeouts
            if body is not None:
                request = PodRequest("POST", probe.path.encode(), headers, body, BodyFraming.LENGTH, len(body.data))
            else:
                request = PodRequest("GET", probe.path.encode(), headers)
            response = pool.request(request, timeouts)
            try:
                for piece in response.body():
                    if grpc_check and len(data) < 4096:
                        data += piece
            finally:
                response.close()
    except UpstreamConnectError as error:
        if not error.connected:
            return ProbeOutcome.REFUSED, f"connect: {error}"
        return ProbeOutcome.BROKEN, str(error)
    except (UpstreamTimeout, gevent.Timeout) as error:
        return ProbeOutcome.TIMED_OUT, f"timeout: {error}"
    except UpstreamBodyError as error:
        return (ProbeOutcome.TIMED_OUT if error.kind is FailureKind.TIMEOUT else ProbeOutcome.BROKEN), str(error)
    status_code = response.head.status
    if grpc_check and status_code == 200:
        fields = [*response.head.headers, *response.trailers]
        status = next((value for name, value in fields if name.lower() == b"grpc-status"), None)
        return grpc_health_outcome(status, bytes(data))
    if 200 <= status_code < 400 and not grpc_check:
        return ProbeOutcome.PASSED, ""
    return ProbeOutcome.BAD_STATUS, f"status {status_code}"


def gauge_in(text: str, metric: str) -> float | None:
    """The sum of the samples named ``metric`` in Prometheus ``text``; None: none, or
    the text does not parse (or the sum is not a finite number >= 0)."""
    total: float | None = None
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == metric:
                    total = (total or 0.0) + float(sample.value)
    except (ValueError, TypeError, IndexError, KeyError):
        return None
    if total is None or not 0 <= total < float("inf"):
        return None
    return total


def read_gauge(pool: PodClient, address: str, load: LoadConfig, timeout: float) -> float | None:
    """``GET load.path`` and the gauge in it (``gauge_in``); None on any failure."""
    assert load.path is not None
    headers = [(b"Host", address.encode()), *PROBE_HEADERS]
    data = bytearray()
    try:
        with gevent.Timeout(timeout * 2 + 1):  # backstop; the pool enforces the real timeouts
            response = pool.request(
                PodRequest("GET", load.path.encode(), headers), Timeouts(timeout, timeout, total=timeout)
            )
            try:
                for piece in response.body():
                    data += piece
                    if len(data) > MAX_METRICS_BYTES:
                        response.abort()
                        return None
            finally:
                response.close()
    except (UpstreamConnectError, UpstreamTimeout, UpstreamBodyError, gevent.Timeout):
        return None
    if response.head.status != 200:
        return None
    return gauge_in(data.decode("utf-8", "replace"), load.metric)

"""What the proxy reports about each request and each pod change, and to whom.

The proxy fills one ``RequestRecord`` per request and hands it to the ``Observer``
when the request is over; pod state changes and reloads come here too. The
observer fans out to the access log (one line per request on stdout, HAProxy-like
fields), to the metrics sink (StatsD, see ``metrics.py``) and to the in-process
history (``history.py``: a few counter increments per request, the pod changes and
reloads, for the status page, ``/status/history`` and ``/metrics``). Nothing here may
block or raise into a request.

Rules:

- **Every refusal is one access-log line and one count.** A request the engine refuses
  before any application sees it (a head llhttp or ``core.http`` refused, too many
  connections) reaches ``Observer.refused`` through the engine's ``on_refusal`` hook;
  it becomes a record of no service (``-``) with the answer's status, reason and body
  size, which goes the way of every record: the access log, the history (a refusal,
  ``History.refused``) and the metrics sink (``{p}.rejected.{reason}``). A 404
  ``unknown-host`` from the proxy is such a record already.
- **Log priorities an operator can alert on** (``transition_level``): a pod leaving
  ``healthy`` because it failed (probes, connections) and a pod forced out of a drain
  are WARNING; a pod that becomes ``healthy`` is NOTICE; the operator's own changes
  (drain, unlist, list) are INFO.
- **A failing pod with no probe still says so** (``FailureStreaks``): without a probe
  nothing takes a pod out of rotation (nothing would bring it back), so when its
  connections fail ``UNPROBED_FAILURES`` times in a row one WARNING says it, and one
  NOTICE when it answers again.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import IO, Protocol

from ..core.config import ProbeConfig
from ..core.errors import ActivatorError
from ..core.h2budgets import Budget
from ..core.http import own_answer_headers
from ..core.states import PodEvent, PodState
from ..core.throttler import ServiceThrottler, Transition
from .history import History
from .logs import NOTICE

log = logging.getLogger("activator")

#: Connections failing this many times in a row on a pod of a service without a probe
#: are logged (a probe's default ``unhealthy_after``).
UNPROBED_FAILURES = ProbeConfig().unhealthy_after
#: Pod events that mean it failed, or was forced out: a pod going out because of them is a warning.
_FAILING_EVENTS = frozenset({PodEvent.PROBE_FAILED, PodEvent.CONNECT_FAILED, PodEvent.DRAIN_TIMEOUT})


def transition_level(transition: Transition) -> int:
    """The log level of a pod state change (see the module docstring)."""
    if transition.event in _FAILING_EVENTS:
        return logging.WARNING
    if transition.new is PodState.HEALTHY:
        return NOTICE
    return logging.INFO


class RequestRecord:
    """One request's facts, filled in as it goes (times are monotonic seconds)."""

    __slots__ = (
        "start",
        "end",
        "client",
        "method",
        "target",
        "service",
        "pod",
        "status",
        "reason",
        "queue_wait",
        "klass",
        "upstream_start",
        "bytes_in",
        "bytes_out",
    )

    def __init__(self, start: float, client: str, method: str, target: bytes) -> None:
        self.start = start
        self.end = start
        self.client = client
        self.method = method
        self.target = target
        self.service = "-"
        self.pod = "-"
        self.status = 0
        self.reason = "-"  # X-Activator-Reason, or what cut the response short
        self.queue_wait: float | None = None
        self.klass: str | None = None  # its priority class, when the service has classes
        self.upstream_start: float | None = None
        self.bytes_in = 0  # request body bytes (a tunnel: client to pod)
        self.bytes_out = 0  # response body bytes sent (a tunnel: pod to client)

    def access_line(self, wall_clock: float) -> str:
        """HAProxy-like: time client service pod status reason Tw Tr Tt bytes in "request"
        (``"-"`` for a request line that could not be read)."""

        def ms(seconds: float | None) -> str:
            return "-1" if seconds is None else str(round(seconds * 1000))

        upstream = None if self.upstream_start is None else self.end - self.upstream_start
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall_clock))
        request = f"{self.method} {self.target.decode('latin-1')}" if self.method else "-"
        return (
            f"{stamp}Z {self.client} {self.service} {self.pod} {self.status} {self.reason} "
            f"Tw={ms(self.queue_wait)} Tr={ms(upstream)} Tt={ms(self.end - self.start)} "
            f'bytes={self.bytes_out} in={self.bytes_in} "{request}"'
        )


def refusal_record(now: float, client: str, method: str, target: bytes, refusal: ActivatorError) -> RequestRecord:
    """The record of a request refused before it was routed (``method`` "" when its
    request line could not be read): the answer's status, reason and body size."""
    record = RequestRecord(now, client, method, target)
    record.status, record.reason = refusal.status, refusal.reason
    record.bytes_out = len(own_answer_headers(refusal, grpc=False)[2])
    return record


class MetricsSink(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def request_started(self, service: str) -> None: ...
    def request_done(self, record: RequestRecord) -> None: ...
    def transition(self, transition: Transition) -> None: ...
    def reload(self, ok: bool) -> None: ...
    def h2_goaway(self, budget: str) -> None: ...


class NoMetrics:
    """The sink when StatsD is not configured."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def request_started(self, service: str) -> None:
        pass

    def request_done(self, record: RequestRecord) -> None:
        pass

    def transition(self, transition: Transition) -> None:
        pass

    def reload(self, ok: bool) -> None:
        pass

    def h2_goaway(self, budget: str) -> None:
        pass


class FailureStreaks:
    """Pods of services without a probe whose connections fail in a row (see the module
    docstring): logged once when a streak reaches ``UNPROBED_FAILURES``, once when it
    ends. Does not yield."""

    def __init__(self) -> None:
        self.failing: set[tuple[str, str]] = set()  # (service, pod) logged as failing

    def failed(self, throttler: ServiceThrottler, address: str, kind: str) -> None:
        """A transport failure on ``address`` was applied to its tracker."""
        key = (throttler.name, address)
        if throttler.config.probe is not None or key in self.failing:
            return
        tracker = throttler.trackers.get(address)
        if tracker is not None and tracker.failures >= UNPROBED_FAILURES:
            self.failing.add(key)
            log.warning(
                "service %s: pod %s failed %d times in a row (%s); no probe is configured, so it stays in rotation",
                throttler.name,
                address,
                tracker.failures,
                kind,
            )

    def check(self, services: Mapping[str, ServiceThrottler]) -> None:
        """Once in a while (every second): the streaks that ended since."""
        for key in list(self.failing):
            service, address = key
            throttler = services.get(service)
            tracker = throttler.trackers.get(address) if throttler is not None else None
            if tracker is None or throttler is None or throttler.config.probe is not None:
                self.failing.discard(key)  # gone, or probed now: the probes' own changes say the rest
            elif tracker.failures == 0:
                self.failing.discard(key)
                log.log(NOTICE, "service %s: pod %s answers again", service, address)


class Observer:
    """Access log + metrics + history + pod-change log. Swappable parts, set by the server."""

    def __init__(
        self, access_log: bool = True, metrics: MetricsSink | None = None, stream: IO[str] | None = None
    ) -> None:
        self.access_log = access_log
        self.metrics: MetricsSink = metrics or NoMetrics()
        self._stream = stream or sys.stdout
        self._offset = time.time() - time.monotonic()
        self.history = History()
        self.streaks = FailureStreaks()
        #: HTTP/2 client connections closed for going past a budget, by budget (every
        #: budget present from the start, so that a rate over one that never fired exists).
        self.h2_goaways = dict.fromkeys((budget.value for budget in Budget), 0)
        self._history_failed = False

    def h2_goaway(self, budget: Budget) -> None:
        """The engine's ``on_budget`` hook: an HTTP/2 client went past ``budget`` (its
        connection got GOAWAY ENHANCE_YOUR_CALM; the engine logged it). Does not yield."""
        self.h2_goaways[budget.value] += 1
        self.metrics.h2_goaway(budget.value)

    def refused(self, client: str, method: str, target: bytes, refusal: ActivatorError) -> None:
        """The engine's ``on_refusal`` hook: a request refused before routing. Does not yield."""
        self.request_done(refusal_record(time.monotonic(), client, method, target, refusal))

    def request_started(self, service: str) -> None:
        self.metrics.request_started(service)

    def request_done(self, record: RequestRecord) -> None:
        try:
            self.history.request_done(record)
        except Exception:  # a bug: never into a request; said once
            self._history_bug()
        self.metrics.request_done(record)
        if self.access_log:
            try:
                self._stream.write(record.access_line(record.end + self._offset) + "\n")
                self._stream.flush()
            except (OSError, ValueError):
                pass

    def transition(self, transition: Transition) -> None:
        log.log(
            transition_level(transition),
            "service %s: pod %s %s -> %s (%s)",
            transition.service,
            transition.address,
            transition.old.value,
            transition.new.value,
            transition.reason,
        )
        self.metrics.transition(transition)
        try:
            self.history.transition(transition, time.time())
        except Exception:
            self._history_bug()

    def reload(self, ok: bool) -> None:
        self.metrics.reload(ok)
        self.history.reload(ok)

    def _history_bug(self) -> None:
        if not self._history_failed:
            self._history_failed = True
            log.exception("history: counting failed (logged once)")

"""What the proxy reports about each request and each pod change, and to whom.

The proxy fills one ``RequestRecord`` per request and hands it to the ``Observer``
when the request is over; pod state changes and reloads come here too. The
observer fans out to the access log (one line per request on stdout, HAProxy-like
fields), to the metrics sink (StatsD, see ``metrics.py``) and to the in-process
history (``history.py``: a few counter increments per request, the pod changes and
reloads, for the status page, ``/status/history`` and ``/metrics``). Nothing here may
block or raise into a request.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import IO, Protocol

from .core.throttler import Transition
from .history import History

log = logging.getLogger("activator")


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
        self.upstream_start: float | None = None
        self.bytes_in = 0  # request body bytes (a tunnel: client to pod)
        self.bytes_out = 0  # response body bytes sent (a tunnel: pod to client)

    def access_line(self, wall_clock: float) -> str:
        """HAProxy-like: time client service pod status reason Tw Tr Tt bytes in "request"."""

        def ms(seconds: float | None) -> str:
            return "-1" if seconds is None else str(round(seconds * 1000))

        upstream = None if self.upstream_start is None else self.end - self.upstream_start
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall_clock))
        return (
            f"{stamp}Z {self.client} {self.service} {self.pod} {self.status} {self.reason} "
            f"Tw={ms(self.queue_wait)} Tr={ms(upstream)} Tt={ms(self.end - self.start)} "
            f'bytes={self.bytes_out} in={self.bytes_in} "{self.method} {self.target.decode("latin-1")}"'
        )


class MetricsSink(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def request_started(self, service: str) -> None: ...
    def request_done(self, record: RequestRecord) -> None: ...
    def transition(self, transition: Transition) -> None: ...
    def reload(self, ok: bool) -> None: ...


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
        self._history_failed = False

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
        log.info(
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

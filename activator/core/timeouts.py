"""The deadlines of one exchange with a pod, whatever protocol carries it.

``Timeouts`` holds a service's pod timeouts (``connect_timeout``,
``response_start_timeout``, ``idle_timeout``, ``request_timeout``) and the client's
``client_timeout``; its methods are the one place where they become deadlines
(``time.monotonic()`` instants; 0.0 means "no deadline", as the shell's sweeper reads it):

- ``connect`` bounds the TCP connect (and, for HTTP/2, the wait for the pod's SETTINGS);
- ``total`` (``request_timeout``) runs from the moment the request head went out to the
  response's last byte (``total_deadline``), None: no limit;
- ``response_start`` runs from the moment the request was sent whole to the response
  head (``head_deadline``), within ``total``; while the body still streams, each write
  must be taken by the pod within it instead;
- ``idle`` bounds each wait for the pod mid-body (``body_deadline``), within ``total``;
- when a body wait ran out, ``body_timeout`` tells which of the two it was.

Pure: the time is an argument.
"""

from __future__ import annotations

from .errors import UpstreamBodyError, UpstreamBodyTimeout, UpstreamIdle


class Timeouts:
    """The timeouts of one exchange with a pod (see the module docstring)."""

    __slots__ = ("connect", "response_start", "idle", "total", "client")

    def __init__(
        self,
        connect: float,
        response_start: float,
        idle: float | None = None,
        total: float | None = None,
        client: float = 60.0,
    ) -> None:
        self.connect = connect
        self.response_start = response_start
        self.idle = idle
        self.total = total
        #: Longest wait for the client while its body streams through (client_timeout).
        self.client = client

    def total_deadline(self, sent_at: float) -> float | None:
        """When the whole exchange must be over, for a request head sent at ``sent_at``."""
        return None if self.total is None else sent_at + self.total

    def head_deadline(self, sent_whole_at: float | None, total_deadline: float | None) -> float:
        """When the response head is due: ``response_start`` after the request was sent
        whole (None: its body still streams), within the total; 0.0: no deadline."""
        if sent_whole_at is None:
            return 0.0 if total_deadline is None else total_deadline
        due = sent_whole_at + self.response_start
        return due if total_deadline is None else min(due, total_deadline)

    def body_deadline(self, now: float, total_deadline: float | None) -> float | None:
        """The deadline of the next wait mid-body (0.0: none); None when the total is over."""
        if total_deadline is not None and total_deadline <= now:
            return None
        idle = self.idle
        if idle is None:
            return 0.0 if total_deadline is None else total_deadline
        return now + idle if total_deadline is None else min(now + idle, total_deadline)

    def ran_out(self, now: float, total_deadline: float | None, resolution: float) -> bool:
        """Whether the total time is over at ``now`` (deadlines fire up to ``resolution`` late)."""
        return total_deadline is not None and now >= total_deadline - resolution

    def body_timeout(self, now: float, total_deadline: float | None, resolution: float) -> UpstreamBodyError:
        """The error of a body wait that ran out: the total time, or the idle one."""
        if self.ran_out(now, total_deadline, resolution):
            return UpstreamBodyTimeout(f"the response did not finish within {self.total}s")
        return UpstreamIdle(f"the pod sent nothing for {self.idle}s mid-body")

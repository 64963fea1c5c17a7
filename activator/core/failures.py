"""Transport failures on real traffic: their kinds, and what each one allows.

A request to a pod can fail three ways before the pod's answer is complete; each kind is
counted per pod (``/status``, the StatsD ``{pod}.{kind}`` counters) and two of them count
toward passive ejection (``ServiceThrottler.record_failure``):

- ``CONNECT``: no answer head came: the connection could not be made (refused,
  unreachable, connect timeout), or it broke, or the pod sent something that is not an
  HTTP answer, before a response head. Counts toward ejection.
- ``TIMEOUT``: the pod did not answer within its time (response head, whole exchange, or
  silence mid-body). Counts toward ejection.
- ``RESET``: the body broke off after the head was relayed. Not counted toward ejection:
  the pod did answer; a pod that keeps failing this way fails its probes too.

The retry rule (``may_retry_elsewhere``): a request whose connection could not even be
made, and of which nothing was read from the client's body, is retried once on another
pod (if one has a free slot, else at the head of the queue). Anything else has reached
the pod in some form and is never replayed here.
"""

from __future__ import annotations

import enum


class FailureKind(enum.Enum):
    """A transport failure on real traffic; the value is its name in metrics and /status."""

    CONNECT = "connect_errors"
    TIMEOUT = "timeouts"
    RESET = "resets"

    @property
    def counts_toward_ejection(self) -> bool:
        return self is not FailureKind.RESET


#: A connect that failed may be retried this many times, on another pod.
CONNECT_RETRIES = 1


def may_retry_elsewhere(kind: FailureKind, connected: bool, body_read: bool, retries_left: int, stopping: bool) -> bool:
    """Whether a failed request goes to another pod (see the module docstring)."""
    return kind is FailureKind.CONNECT and not connected and not body_read and retries_left > 0 and not stopping

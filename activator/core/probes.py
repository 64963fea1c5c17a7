"""Active health probes: when a pod is probed, and what a probe's outcome means.

The shell does the I/O (``GET probe.path`` within ``probe.timeout``) and reports a
``ProbeOutcome``; these rules decide the rest:

- **What is probed**: pods that are ``pending`` or ``healthy``, of a service with a probe
  (``probed``). Draining and removed pods are left alone.
- **Busy pods are not misjudged.** A pod whose slots here are all in use is not probed at
  all (``probe_due``): it is visibly alive, it is serving our requests, and a probe would
  only queue behind the work, as with a one-request-at-a-time model server. A probe that
  fails while requests are in flight on the pod is ``INCONCLUSIVE`` (``judge``), except a
  refused connection: a pod that refuses connections is down, busy or not.
- **What passes**: a 2xx or 3xx answer within the timeout. ``healthy_after`` passes in a
  row make a pending pod healthy, ``unhealthy_after`` failures in a row a healthy pod
  pending (``ServiceThrottler.probe_result``).
"""

from __future__ import annotations

import enum

from .states import PodState


class ProbeOutcome(enum.Enum):
    """What one probe saw."""

    PASSED = "passed"  # 2xx or 3xx in time
    BAD_STATUS = "bad-status"  # any other status
    TIMED_OUT = "timed-out"  # no complete answer within probe.timeout
    REFUSED = "refused"  # no connection could be made
    BROKEN = "broken"  # the connection broke, or the answer was not HTTP


class Verdict(enum.Enum):
    """What the outcome counts as."""

    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"  # ignored: neither a pass nor a failure


PROBED_STATES = frozenset((PodState.PENDING, PodState.HEALTHY))


def probed(state: PodState) -> bool:
    """Whether a pod in this state is probed (its service having a probe)."""
    return state in PROBED_STATES


def probe_due(in_flight: int, slots: int | None) -> bool:
    """Whether to probe now: not while every slot of the pod owned here is in use."""
    return slots is None or in_flight < max(slots, 1)


def judge(outcome: ProbeOutcome, in_flight: int) -> Verdict:
    """What a probe outcome counts as, for a pod with ``in_flight`` requests here."""
    if outcome is ProbeOutcome.PASSED:
        return Verdict.PASS
    if outcome is ProbeOutcome.REFUSED or in_flight == 0:
        return Verdict.FAIL
    return Verdict.INCONCLUSIVE


#: A probe of this path on an ``h2c`` service is a gRPC health check
#: (``grpc.health.v1.Health/Check`` for the whole server, the empty service name).
GRPC_HEALTH_PATH = "/grpc.health.v1.Health/Check"
#: The request message: a gRPC length-prefixed frame holding an empty HealthCheckRequest.
GRPC_HEALTH_REQUEST = b"\x00\x00\x00\x00\x00"
_SERVING = 1


def grpc_health_outcome(grpc_status: bytes | None, body: bytes) -> tuple[ProbeOutcome, str]:
    """What a gRPC health check's answer means: passed only for status 0 and SERVING.

    ``body``: the response's DATA (one length-prefixed HealthCheckResponse, whose field 1,
    a varint, is the serving status). Read without a protobuf library: one field.
    """
    if grpc_status != b"0":
        status = grpc_status.decode("latin-1") if grpc_status is not None else "missing"
        return ProbeOutcome.BAD_STATUS, f"grpc-status {status}"
    if len(body) < 5 or body[0] != 0:
        return ProbeOutcome.BROKEN, "not an uncompressed gRPC message"
    message = body[5 : 5 + int.from_bytes(body[1:5], "big")]
    serving = None
    index = 0
    while index + 1 < len(message):
        key, value = message[index], message[index + 1]
        if key == 0x08 and value < 0x80:  # field 1, varint, one byte
            serving = value
        index += 2
    if serving == _SERVING:
        return ProbeOutcome.PASSED, ""
    return ProbeOutcome.BAD_STATUS, f"health status {serving if serving is not None else 'unknown'}"

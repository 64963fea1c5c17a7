"""What an operator alerts on, decided in the shell without sockets: the log level of each
pod state change, the alarm for a failing pod that no probe watches, a probe that passed
too late, and the access-log line of a request refused before routing.

Real core throttlers and records; the process log is captured with ``caplog``. The same
rules are checked against a running activator in ``e2e/test_alerts.py``.
"""

from __future__ import annotations

import logging
import random

import pytest
from builders import svc

from activator.core.config import ProbeConfig
from activator.core.errors import ActivatorError, BadHost, BadRequest, HeadersTooLarge, UnknownHost
from activator.core.failures import FailureKind
from activator.core.probes import ProbeOutcome, Verdict
from activator.core.states import PodEvent, PodState
from activator.core.throttler import Grant, ServiceThrottler, Transition
from activator.ops.logs import NOTICE
from activator.ops.observe import UNPROBED_FAILURES, FailureStreaks, Observer, refusal_record, transition_level
from activator.pods.prober import within_timeout

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
P, H, D, R = PodState.PENDING, PodState.HEALTHY, PodState.DRAINING, PodState.REMOVED


def change(old: PodState, new: PodState, event: PodEvent) -> Transition:
    return Transition("api", A, old, new, event, "why")


@pytest.mark.parametrize(
    ("old", "new", "event", "level"),
    [
        (H, P, PodEvent.PROBE_FAILED, logging.WARNING),  # out of rotation: journalctl -p warning shows it
        (H, P, PodEvent.CONNECT_FAILED, logging.WARNING),
        (D, R, PodEvent.DRAIN_TIMEOUT, logging.WARNING),  # forced out with requests in flight
        (P, H, PodEvent.PROBE_PASSED, NOTICE),  # back (or new): worth seeing, not a problem
        (H, D, PodEvent.DRAIN_SET, logging.INFO),  # the operator's own doing
        (H, D, PodEvent.UNLISTED, logging.INFO),
        (D, R, PodEvent.LAST_RELEASED, logging.INFO),
        (D, P, PodEvent.LISTED, logging.INFO),
    ],
)
def test_the_log_level_of_a_pod_state_change(old: PodState, new: PodState, event: PodEvent, level: int) -> None:
    assert transition_level(change(old, new, event)) == level


def test_the_observer_logs_a_pod_leaving_healthy_as_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    observer = Observer(access_log=False)
    with caplog.at_level(logging.DEBUG, logger="activator"):
        observer.transition(change(H, P, PodEvent.PROBE_FAILED))
        observer.transition(change(P, H, PodEvent.PROBE_PASSED))
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"service api: pod {A} healthy -> pending (why)"),
        ("NOTICE", f"service api: pod {A} pending -> healthy (why)"),
    ]


def unprobed(*pods: str, probe: ProbeConfig | None = None) -> ServiceThrottler:
    return ServiceThrottler(svc(*pods, probe=probe), 0.0, rng=random.Random(0))


def fail(t: ServiceThrottler, streaks: FailureStreaks, address: str, times: int) -> None:
    for _ in range(times):
        t.record_failure(address, FailureKind.CONNECT, 1.0)
        streaks.failed(t, address, FailureKind.CONNECT.value)


def test_a_failing_pod_without_a_probe_is_logged_once_then_once_when_it_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    t = unprobed(A, B)
    streaks = FailureStreaks()
    with caplog.at_level(logging.DEBUG, logger="activator"):
        fail(t, streaks, A, UNPROBED_FAILURES - 1)
        assert not caplog.records, "not yet a streak"
        fail(t, streaks, A, 5)
        streaks.check({"api": t})
        assert t.trackers[A].state is H, "no probe: it stays in rotation (nothing would bring it back)"
        (warning,) = caplog.records
        assert warning.levelno == logging.WARNING
        assert warning.getMessage() == (
            f"service api: pod {A} failed {UNPROBED_FAILURES} times in a row (connect_errors);"
            " no probe is configured, so it stays in rotation"
        )
        grant = t.acquire(2.0)
        while isinstance(grant, Grant) and grant.pod.address != A:  # first-available: A first
            grant = t.acquire(2.0)
        assert isinstance(grant, Grant) and grant.pod.address == A
        t.release(grant, 2.0, answered=True)  # it answered: the streak is over
        streaks.check({"api": t})
        streaks.check({"api": t})
    assert [(r.levelno, r.getMessage()) for r in caplog.records[1:]] == [
        (NOTICE, f"service api: pod {A} answers again")
    ]
    assert UNPROBED_FAILURES == ProbeConfig().unhealthy_after == 3


def test_a_probed_pod_has_its_state_changes_instead(caplog: pytest.LogCaptureFixture) -> None:
    t = unprobed(A, probe=ProbeConfig())
    t.probe_result(A, Verdict.PASS, 0.5)
    streaks = FailureStreaks()
    with caplog.at_level(logging.DEBUG, logger="activator"):
        fail(t, streaks, A, 5)
    assert not caplog.records and t.trackers[A].state is P


def test_a_pass_that_came_after_the_timeout_is_a_timeout() -> None:
    assert within_timeout(ProbeOutcome.PASSED, "", 0.9, 1.0) == (ProbeOutcome.PASSED, "")
    outcome, detail = within_timeout(ProbeOutcome.PASSED, "", 1.4, 1.0)
    assert outcome is ProbeOutcome.TIMED_OUT and detail == "answered after 1.40s, over the 1s timeout"
    assert within_timeout(ProbeOutcome.BAD_STATUS, "status 503", 3.0, 1.0) == (ProbeOutcome.BAD_STATUS, "status 503")


@pytest.mark.parametrize(
    ("refusal", "method", "target", "shown", "size"),
    [
        (BadRequest("bare LF"), "", b"", '"-"', len(b"400 bad-request\n")),
        (BadHost("two Host headers"), "GET", b"/x?y=1", '"GET /x?y=1"', len(b"400 bad-host\n")),
        (HeadersTooLarge(), "POST", b"/", '"POST /"', len(b"431 headers-too-large\n")),
        (UnknownHost(), "GET", b"/", '"GET /"', len(b"404 unknown-host\n")),
    ],
)
def test_a_refusal_is_an_access_line_of_no_service(
    refusal: ActivatorError, method: str, target: bytes, shown: str, size: int
) -> None:
    record = refusal_record(5.0, "127.0.0.9", method, target, refusal)
    line = record.access_line(0.0)
    assert line == (
        f"1970-01-01T00:00:00Z 127.0.0.9 - - {refusal.status} {refusal.reason} Tw=-1 Tr=-1 Tt=0 "
        f"bytes={size} in=0 {shown}"
    )

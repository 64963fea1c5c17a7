"""The throttler's side of launched pods: a pod drained by its launcher (``park``) and
waiters given up with an answer (``refuse_waiters``). Tables, no sockets."""

from __future__ import annotations

from builders import pod, svc
from hypothesis import given, settings
from hypothesis import strategies as st

from activator.core.config import ProbeConfig
from activator.core.errors import ColdStartFailed
from activator.core.probes import Verdict
from activator.core.states import PodState
from activator.core.throttler import Grant, ServiceThrottler, Waiter

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def healthy_throttler(*pods: str) -> ServiceThrottler:
    throttler = ServiceThrottler(svc(*pods, cc=1, probe=ProbeConfig()), 0.0)
    for address in pods:
        throttler.probe_result(address, Verdict.PASS, 0.0)
    return throttler


def test_a_parked_pod_drains_its_requests_then_is_removed_and_unparked_is_probed_again() -> None:
    throttler = healthy_throttler(A)
    grant = throttler.acquire(0.0)
    assert isinstance(grant, Grant)
    effects = throttler.park(A, True, 1.0, "scaled down")
    assert [(t.old, t.new) for t in effects.transitions] == [(PodState.HEALTHY, PodState.DRAINING)]
    waiter = throttler.acquire(1.0)
    assert isinstance(waiter, Waiter)  # no new request on a draining pod
    effects = throttler.release(grant, 2.0)
    assert throttler.trackers[A].state is PodState.REMOVED and not effects.woken
    effects = throttler.park(A, False, 3.0, "stopped")
    assert throttler.trackers[A].state is PodState.PENDING
    throttler.check_invariants()
    effects = throttler.probe_result(A, Verdict.PASS, 4.0)
    assert effects.woken == [waiter]
    throttler.check_invariants()


def test_the_file_cannot_undrain_a_parked_pod_but_can_drain_it() -> None:
    throttler = healthy_throttler(A, B)
    throttler.park(A, True, 1.0, "scaled down")
    config = svc(pod(A, drain=True), B, cc=1, probe=ProbeConfig())
    throttler.apply(config, 2.0)
    throttler.apply(svc(A, B, cc=1, probe=ProbeConfig()), 3.0)  # drain cleared in the file
    assert throttler.trackers[A].state is PodState.REMOVED  # still parked
    throttler.park(A, False, 4.0, "stopped")
    assert throttler.trackers[A].state is PodState.PENDING
    throttler.check_invariants()


def test_parking_twice_or_an_unknown_pod_changes_nothing() -> None:
    throttler = healthy_throttler(A)
    throttler.park(A, True, 1.0, "scaled down")
    assert not throttler.park(A, True, 1.0, "scaled down")
    assert not throttler.park("10.9.9.9:1", True, 1.0, "scaled down")
    throttler.check_invariants()


def test_refused_waiters_leave_the_queue_in_order_with_their_answer() -> None:
    throttler = ServiceThrottler(svc(A, cc=1, probe=ProbeConfig()), 0.0)
    first, second = throttler.acquire(0.0), throttler.acquire(0.0)
    refusal = ColdStartFailed("no launched pod became ready")
    effects = throttler.refuse_waiters(refusal)
    assert effects.woken == [first, second]
    assert all(isinstance(w, Waiter) and w.refusal is refusal and w.grant is None for w in effects.woken)
    assert throttler.queued == 0
    throttler.check_invariants()


# -- random sequences: parking among everything else the throttler sees ---------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["park", "unpark", "list", "drain", "unlist", "acquire", "release", "pass", "fail", "tick"]),
        st.sampled_from([A, B]),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS)
def test_parking_among_file_changes_probes_and_requests_keeps_every_invariant(ops: list[tuple[str, str]]) -> None:
    """After any sequence, the throttler's invariants hold, a parked pod never takes a new
    request, and a pod the file wants that is not parked is wanted (pending or healthy)."""
    listing = {A: "active", B: "active"}
    throttler = ServiceThrottler(svc(A, B, cc=1, probe=ProbeConfig(), drain_timeout=5.0), 0.0)
    grants: list[Grant] = []
    now = 0.0
    for op, address in ops:
        now += 1.0
        tracker = throttler.trackers.get(address)
        if op in ("park", "unpark"):
            throttler.park(address, op == "park", now, op)
        elif op in ("list", "drain", "unlist"):
            listing[address] = {"list": "active", "drain": "drained", "unlist": "absent"}[op]
            pods = [pod(a, drain=state == "drained") for a, state in listing.items() if state != "absent"]
            throttler.apply(svc(*pods, cc=1, probe=ProbeConfig(), drain_timeout=5.0), now)
        elif op == "acquire":
            got = throttler.acquire(now)
            if isinstance(got, Grant):
                assert not got.pod.parked, "a parked pod took a new request"
                grants.append(got)
            else:
                throttler.abandon(got)
        elif op == "release" and grants:
            throttler.release(grants.pop(0), now)
        elif op in ("pass", "fail") and tracker is not None:
            throttler.probe_result(address, Verdict.PASS if op == "pass" else Verdict.FAIL, now)
        elif op == "tick":
            throttler.tick(now)
        throttler.check_invariants()
        for t in throttler.trackers.values():
            if t.listed and not t.drain and not t.parked:
                assert t.state in (PodState.PENDING, PodState.HEALTHY), (t.address, t.state)
    for grant in grants:
        throttler.release(grant, now)
    throttler.check_invariants()
    assert throttler.in_flight == 0

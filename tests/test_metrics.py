"""The StatsD sink against a real UDP socket on 127.0.0.1: names, types, values, datagrams.

A Topology is built from config dataclasses (no file, no proxy); requests are fed as
RequestRecords, pod changes as the Effects the core returns. A sink sends nothing until
its sender is built: ``live()`` builds it with ``connect()`` (what the gauge greenlet
does first), so that most tests run without that greenlet. Loopback UDP is delivered
inside ``sendto``, so after a call returns its datagrams are already queued on the
receiver: no waiting, except for the gauge greenlet itself (polled with a generous
timeout, never timed). Every test that expects nothing also checks that the sink does
send, so that silence proves something.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gevent
import pytest
from builders import pod
from gevent import socket  # recv yields to the hub, so the sink's greenlets run
from hypothesis import example, given
from hypothesis import strategies as st
from statsd import StatsClient

from activator.core.config import Address, Config, ProbeConfig, ServiceConfig, StatsdConfig
from activator.core.failures import FailureKind
from activator.core.states import PodEvent, PodState
from activator.core.throttler import Effects, Grant, Transition
from activator.core.topology import Topology
from activator.ops.metrics import MAX_DATAGRAM, StatsdMetrics, make_metrics, pod_id, split_into_datagrams
from activator.ops.observe import MetricsSink, NoMetrics, RequestRecord

POD_A = "127.0.0.1:8001"
POD_B = "127.0.0.1:8002"
REPO_ROOT = Path(__file__).resolve().parent.parent


class Receiver:
    """A bound UDP socket; ``datagrams()`` drains what has arrived, without waiting."""

    def __init__(self, port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", port))
        self.port: int = self.sock.getsockname()[1]

    def datagrams(self) -> list[str]:
        self.sock.setblocking(False)
        out = []
        while True:
            try:
                out.append(self.sock.recv(65536).decode())
            except BlockingIOError:
                return out

    def lines(self) -> list[str]:
        return [line for d in self.datagrams() for line in d.split("\n")]

    def wait_datagram(self, timeout: float = 10.0) -> str:
        """The next datagram (yields to the hub while waiting, so greenlets run)."""
        self.sock.settimeout(timeout)
        data: bytes = self.sock.recv(65536)
        return data.decode()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.sock.close()


def service(name: str = "api", cc: int = 1, pods: tuple[str, ...] = (POD_A,), queue_depth: int = 10) -> ServiceConfig:
    return ServiceConfig(
        name=name,
        hosts=(f"{name}.test",),
        container_concurrency=cc,
        queue_depth=queue_depth,
        pods=tuple(pod(p) for p in pods),
    )


def topology(*services: ServiceConfig, **worker: Any) -> Topology:
    config = Config(path="test.yaml", services={s.name: s for s in services})
    return Topology(config, time.monotonic(), **worker)


def statsd(receiver: Receiver, tags: bool = False, host: str = "127.0.0.1") -> StatsdConfig:
    return StatsdConfig(address=Address(host, receiver.port), prefix="t", tags=tags)


def live(config: StatsdConfig, topo: Topology) -> StatsdMetrics:
    """The sink the server would make, with its sender built (as its gauge greenlet does first)."""
    sink = make_metrics(config, topo)
    assert isinstance(sink, StatsdMetrics)
    assert sink.connect()
    return sink


def record(
    service: str = "api", status: int = 200, reason: str = "-", queue_wait: float | None = 0.25, total: float = 1.5
) -> RequestRecord:
    r = RequestRecord(start=100.0, client="127.0.0.1", method="GET", target=b"/")
    r.service = service
    r.status = status
    r.reason = reason
    r.queue_wait = queue_wait
    r.end = r.start + total
    return r


def grant(topo: Topology, name: str = "api") -> Grant:
    got = topo.services[name].acquire(time.monotonic())
    assert isinstance(got, Grant)
    return got


def deliver(effects: Effects, sink: MetricsSink) -> None:
    """What the shell does with a core call's effects: each pod change goes to the sink."""
    for transition in effects.transitions:
        sink.transition(transition)


def counters(lines: list[str]) -> list[str]:
    """The counter lines (type ``c``, tagged or not), sorted."""
    return sorted(line for line in lines if line.split("|")[1:2] == ["c"])


SENT_A_REQUEST = "t.api.requests:1|c"


# ---------------------------------------------------------------------------------
# per request


def test_no_config_means_no_metrics() -> None:
    assert isinstance(make_metrics(None, topology(service())), NoMetrics)


def test_a_served_request_is_one_datagram(receiver: Receiver) -> None:
    sink = live(statsd(receiver), topology(service()))
    sink.request_started("api")
    sink.request_done(record())
    assert receiver.datagrams() == [
        "t.api.requests:1|c\nt.api.responses.2xx:1|c\nt.api.latency:1500.000000|ms\nt.api.queue_wait:250.000000|ms"
    ]
    sink.stop()


@pytest.mark.parametrize(
    ("reason", "rejected"),
    [
        ("queue-full", "t.api.rejected.queue_full:1|c"),
        ("queue-timeout", "t.api.rejected.queue_timeout:1|c"),
        ("shutting-down", "t.api.rejected.shutting_down:1|c"),
    ],
)
def test_refused_requests_count_by_reason_without_queue_wait(receiver: Receiver, reason: str, rejected: str) -> None:
    sink = live(statsd(receiver), topology(service()))
    sink.request_done(record(status=503, reason=reason, queue_wait=None, total=0.002))
    assert receiver.datagrams() == [
        f"t.api.requests:1|c\nt.api.responses.5xx:1|c\n{rejected}\nt.api.latency:2.000000|ms"
    ]


@pytest.mark.parametrize(("status", "cls"), [(204, "2xx"), (304, "3xx"), (404, "4xx"), (502, "5xx"), (504, "5xx")])
def test_responses_by_class(receiver: Receiver, status: int, cls: str) -> None:
    sink = live(statsd(receiver), topology(service()))
    sink.request_done(record(status=status))
    assert [line for line in receiver.lines() if ".responses." in line] == [f"t.api.responses.{cls}:1|c"]


def test_a_client_gone_before_the_last_byte_is_a_4xx_response(receiver: Receiver) -> None:
    sink = live(statsd(receiver), topology(service()))
    sink.request_done(record(status=499, reason="client-gone", queue_wait=None))
    assert receiver.lines() == ["t.api.requests:1|c", "t.api.responses.4xx:1|c", "t.api.latency:1500.000000|ms"]


def test_a_record_without_a_status_counts_in_no_class(receiver: Receiver) -> None:
    sink = live(statsd(receiver), topology(service()))
    sink.request_done(record(status=0, queue_wait=None))
    assert receiver.lines() == ["t.api.requests:1|c", "t.api.latency:1500.000000|ms"]


@pytest.mark.parametrize(
    ("status", "reason", "name"),
    [
        (404, "unknown-host", "unknown_host"),
        (400, "bad-request", "bad_request"),
        (400, "bad-host", "bad_host"),
        (431, "headers-too-large", "header_too_large"),  # SPEC's spelling
        (400, "bad-request-target", "bad_request_target"),
        (503, "too-many-connections", "too_many_connections"),
    ],
)
def test_a_refusal_before_routing_is_one_activator_wide_counter(
    receiver: Receiver, status: int, reason: str, name: str
) -> None:
    sink = live(statsd(receiver), topology(service()))
    sink.request_done(record(service="-", status=status, reason=reason, queue_wait=None))
    assert receiver.datagrams() == [f"t.rejected.{name}:1|c"]
    tagged = live(statsd(receiver, tags=True), topology(service()))
    tagged.request_done(record(service="-", status=status, reason=reason, queue_wait=None))
    assert receiver.datagrams() == [f"t.rejected.{name}:1|c"], "no service to tag it with"


def test_unrouted_records_without_a_refusal_are_not_counted(receiver: Receiver) -> None:
    sink = live(statsd(receiver), topology(service()))
    sink.request_done(record(service="-", status=499, reason="client-gone", queue_wait=None))
    assert receiver.datagrams() == []
    sink.request_done(record())
    assert SENT_A_REQUEST in receiver.lines(), "the sink was live: the silence above counts"


def test_tags_mode(receiver: Receiver) -> None:
    topo = topology(service())
    sink = live(statsd(receiver, tags=True), topo)
    sink.request_done(record())
    assert receiver.datagrams() == [
        "t.requests:1|c|#service:api\nt.responses.2xx:1|c|#service:api\n"
        "t.latency:1500.000000|ms|#service:api\nt.queue_wait:250.000000|ms|#service:api"
    ]
    grant(topo)
    sink.flush()
    lines = receiver.lines()
    assert "t.in_flight:1|g|#service:api" in lines
    assert "t.pods.healthy:1|g|#service:api" in lines
    assert f"t.pod.in_flight:1|g|#service:api,pod:{pod_id(POD_A)}" in lines
    sink.transition(Transition("api", POD_A, PodState.HEALTHY, PodState.PENDING, PodEvent.PROBE_FAILED, "probe"))
    assert receiver.lines() == ["t.pod_transitions.pending:1|c|#service:api"]
    sink.reload(True)
    assert receiver.lines() == ["t.config.reload.ok:1|c"]


def test_http2_budget_goaways_are_counted_by_budget(receiver: Receiver) -> None:
    sink = live(statsd(receiver), topology(service()))
    sink.h2_goaway("resets")
    sink.h2_goaway("pings")
    assert receiver.lines() == ["t.h2.goaway.resets:1|c", "t.h2.goaway.pings:1|c"]


def test_reload_counters(receiver: Receiver) -> None:
    sink = live(statsd(receiver), topology(service()))
    sink.reload(True)
    sink.reload(False)
    sink.reload(True)
    assert receiver.lines() == ["t.config.reload.ok:1|c", "t.config.reload.failed:1|c", "t.config.reload.ok:1|c"]


def test_pod_id() -> None:
    assert pod_id("10.0.1.5:8000") == "10_0_1_5_8000"
    assert pod_id("[::1]:8000") == "___1__8000"
    assert pod_id("api-1.internal:80") == "api-1_internal_80"


# ---------------------------------------------------------------------------------
# before the sender exists


def test_nothing_is_sent_before_the_sender_exists(receiver: Receiver) -> None:
    topo = topology(service())
    sink = StatsdMetrics(statsd(receiver), topo)
    sink.request_done(record())
    sink.flush()
    assert receiver.datagrams() == []
    assert sink.connect()
    assert receiver.datagrams() == [], "building the sender sends nothing"
    sink.request_done(record())
    assert SENT_A_REQUEST in receiver.lines()
    sink.flush()
    assert "t.api.requests:1|c" not in receiver.lines(), "the request before the sender was dropped"


@pytest.mark.parametrize("tags", [False, True])
def test_event_counters_before_the_sender_exists_go_with_the_first_flush(receiver: Receiver, tags: bool) -> None:
    sink = StatsdMetrics(statsd(receiver, tags=tags), topology(service()))
    sink.reload(True)  # e.g. the reload that swapped in this sink
    sink.reload(True)
    sink.transition(Transition("api", POD_A, PodState.HEALTHY, PodState.PENDING, PodEvent.PROBE_FAILED, "probe"))
    assert receiver.datagrams() == []
    assert sink.connect()
    sink.flush()
    tag = "|#service:api" if tags else ""
    transitions = "t.pod_transitions.pending" if tags else "t.api.pod_transitions.pending"
    assert counters(receiver.lines()) == sorted(["t.config.reload.ok:2|c", f"{transitions}:1|c{tag}"])
    sink.flush()
    lines = receiver.lines()
    assert lines, "the second flush sent its gauges"
    assert counters(lines) == [], "sent once"


# ---------------------------------------------------------------------------------
# gauges and failure counters


def test_gauges(receiver: Receiver) -> None:
    topo = topology(service(cc=2, pods=(POD_A, POD_B)), service("free", cc=0, pods=(POD_A,)))
    sink = live(statsd(receiver), topo)
    grant(topo)
    grant(topo)
    sink.flush()
    lines = receiver.lines()
    a, b = pod_id(POD_A), pod_id(POD_B)
    for expected in (
        "t.api.queued:0|g",
        "t.api.in_flight:2|g",
        "t.api.capacity:4|g",
        "t.api.pods.healthy:2|g",
        "t.api.pods.pending:0|g",
        "t.api.pods.draining:0|g",
        "t.free.in_flight:0|g",
        "t.free.pods.healthy:1|g",
        f"t.free.pod.{a}.in_flight:0|g",
        f"t.free.pod.{a}.peak_in_flight:0|g",
    ):
        assert expected in lines
    assert sorted(line for line in lines if ".api.pod." in line) == [
        f"t.api.pod.{a}.in_flight:2|g",
        f"t.api.pod.{a}.peak_in_flight:2|g",
        f"t.api.pod.{b}.in_flight:0|g",
        f"t.api.pod.{b}.peak_in_flight:0|g",
    ]
    assert not any(line.startswith("t.free.capacity") for line in lines), "unlimited: no capacity gauge"
    assert all(line.endswith("|g") for line in lines), "no counter without a failure"


def test_the_peak_gauge_proves_the_limit_held_after_the_requests_are_gone(receiver: Receiver) -> None:
    topo = topology(service(cc=2, pods=(POD_A,)))
    sink = live(statsd(receiver), topo)
    held = [grant(topo), grant(topo)]
    for g in held:
        topo.services["api"].release(g, time.monotonic())
    sink.flush()
    a = pod_id(POD_A)
    lines = receiver.lines()
    assert f"t.api.pod.{a}.in_flight:0|g" in lines and f"t.api.pod.{a}.peak_in_flight:2|g" in lines


def test_queued_and_draining(receiver: Receiver) -> None:
    topo = topology(service(cc=1, pods=(POD_A,)))
    sink = live(statsd(receiver), topo)
    grant(topo)
    assert not isinstance(topo.services["api"].acquire(time.monotonic()), Grant)
    probed = dataclasses.replace(service(cc=1, pods=(POD_B,)), probe=ProbeConfig())
    topo.apply(Config(path="test.yaml", services={"api": probed}), time.monotonic())
    sink.flush()
    lines = receiver.lines()
    for expected in (
        "t.api.queued:1|g",
        "t.api.in_flight:1|g",
        "t.api.pods.draining:1|g",
        "t.api.pods.pending:1|g",
        "t.api.pods.healthy:0|g",
        "t.api.capacity:0|g",
        f"t.api.pod.{pod_id(POD_A)}.in_flight:1|g",
        f"t.api.pod.{pod_id(POD_B)}.in_flight:0|g",
    ):
        assert expected in lines


def test_a_service_turned_unlimited_zeroes_its_capacity_once(receiver: Receiver) -> None:
    topo = topology(service(cc=1))
    sink = live(statsd(receiver), topo)
    sink.flush()
    assert "t.api.capacity:1|g" in receiver.lines()
    topo.apply(Config(path="test.yaml", services={"api": service(cc=0)}), time.monotonic())
    sink.flush()
    assert [line for line in receiver.lines() if "capacity" in line] == ["t.api.capacity:0|g"]
    sink.flush()
    lines = receiver.lines()
    assert "t.api.in_flight:0|g" in lines
    assert not [line for line in lines if "capacity" in line]


def test_gauge_greenlet_flushes_every_interval(receiver: Receiver) -> None:
    topo = topology(service())
    sink = StatsdMetrics(statsd(receiver), topo, interval=0.01)
    sink.start()
    try:
        first = receiver.wait_datagram()
        second = receiver.wait_datagram()
    finally:
        sink.stop()
    assert "t.api.in_flight:0|g" in first.split("\n")
    assert "t.api.in_flight:0|g" in second.split("\n")
    gevent.sleep(0.05)
    receiver.datagrams()
    gevent.sleep(0.05)
    assert receiver.datagrams() == [], "nothing after stop"


def test_failure_counters_are_increases_since_the_last_flush(receiver: Receiver) -> None:
    topo = topology(service(cc=2))
    throttler = topo.services["api"]
    sink = live(statsd(receiver), topo)
    a = pod_id(POD_A)
    now = time.monotonic()
    throttler.record_failure(POD_A, FailureKind.CONNECT, now)
    throttler.record_failure(POD_A, FailureKind.CONNECT, now)
    throttler.record_failure(POD_A, FailureKind.TIMEOUT, now)
    # what record_failure counts for a pod that was not healthy when it failed: summed all the same
    throttler.trackers[POD_A].failure_counts[(FailureKind.CONNECT, False)] = 1
    sink.flush()
    assert counters(receiver.lines()) == [f"t.api.pod.{a}.connect_errors:3|c", f"t.api.pod.{a}.timeouts:1|c"]
    sink.flush()
    lines = receiver.lines()
    assert f"t.api.pod.{a}.in_flight:0|g" in lines
    assert counters(lines) == [], "nothing new: no counter"
    throttler.record_failure(POD_A, FailureKind.RESET, now)
    throttler.record_failure(POD_A, FailureKind.TIMEOUT, now)
    sink.flush()
    assert counters(receiver.lines()) == [f"t.api.pod.{a}.resets:1|c", f"t.api.pod.{a}.timeouts:1|c"]


def test_failures_before_the_sink_existed_are_not_sent(receiver: Receiver) -> None:
    topo = topology(service())
    topo.services["api"].record_failure(POD_A, FailureKind.TIMEOUT, time.monotonic())
    sink = live(statsd(receiver), topo)
    sink.flush()
    lines = receiver.lines()
    assert f"t.api.pod.{pod_id(POD_A)}.in_flight:0|g" in lines
    assert counters(lines) == []
    topo.services["api"].record_failure(POD_A, FailureKind.TIMEOUT, time.monotonic())
    sink.flush()
    assert counters(receiver.lines()) == [f"t.api.pod.{pod_id(POD_A)}.timeouts:1|c"], "only the new one"


def test_removed_pod_sends_its_last_failures_then_a_zero_gauge(receiver: Receiver) -> None:
    topo = topology(service(pods=(POD_A, POD_B)))
    throttler = topo.services["api"]
    sink = live(statsd(receiver), topo)
    a = pod_id(POD_A)
    g = grant(topo)
    assert g.pod.address == POD_A
    sink.flush()
    receiver.datagrams()
    deliver(topo.apply(Config(path="test.yaml", services={"api": service(pods=(POD_B,))}), time.monotonic()), sink)
    assert receiver.lines() == ["t.api.pod_transitions.draining:1|c"]
    deliver(throttler.record_failure(POD_A, FailureKind.TIMEOUT, time.monotonic()), sink)
    deliver(throttler.release(g, time.monotonic()), sink)  # draining -> removed, and forgotten
    assert POD_A not in throttler.trackers, "forgotten before the sink hears of it"
    assert receiver.lines() == ["t.api.pod_transitions.removed:1|c", f"t.api.pod.{a}.timeouts:1|c"]
    sink.flush()
    lines = receiver.lines()
    assert f"t.api.pod.{a}.in_flight:0|g" in lines, "a gauge no longer reported is zeroed once"
    assert not any(f".{a}.timeouts" in line for line in lines), "not sent twice"
    sink.flush()
    lines = receiver.lines()
    assert f"t.api.pod.{pod_id(POD_B)}.in_flight:0|g" in lines
    assert not any(a in line for line in lines)


def test_transition_counter(receiver: Receiver) -> None:
    sink = live(statsd(receiver), topology(service()))
    sink.transition(Transition("api", POD_A, PodState.HEALTHY, PodState.PENDING, PodEvent.PROBE_FAILED, "probe"))
    assert receiver.lines() == ["t.api.pod_transitions.pending:1|c"]


def test_workers_tag_their_gauges_only(receiver: Receiver) -> None:
    topo = topology(service(), worker_index=1, workers=("127.0.0.1:9001", "127.0.0.1:9002"))
    assert topo.worker == (1, 2)
    sink = live(statsd(receiver), topo)
    sink.request_done(record())
    assert SENT_A_REQUEST in receiver.lines()
    sink.flush()
    lines = receiver.lines()
    assert "t.api.worker1.in_flight:0|g" in lines
    assert f"t.api.worker1.pod.{pod_id(POD_A)}.in_flight:0|g" in lines
    tagged = live(statsd(receiver, tags=True), topo)
    tagged.flush()
    assert "t.in_flight:0|g|#service:api,worker:1" in receiver.lines()
    tagged.request_done(record())
    assert "t.requests:1|c|#service:api" in receiver.lines()


@pytest.mark.parametrize("tags", [False, True])
def test_many_pods_are_split_into_datagrams_below_512_bytes(receiver: Receiver, tags: bool) -> None:
    pods = tuple(f"10.0.{i // 200}.{i % 200}:8000" for i in range(100))
    sink = live(statsd(receiver, tags=tags), topology(service(pods=pods)))
    sink.flush()
    datagrams = receiver.datagrams()
    assert len(datagrams) > 1
    assert all(len(d.encode()) < MAX_DATAGRAM for d in datagrams)
    pod_gauge = "t.pod.in_flight:" if tags else ".in_flight:"
    pod_lines = [line for d in datagrams for line in d.split("\n") if ".pod." in line and pod_gauge in line]
    assert len(pod_lines) == 100


@given(st.lists(st.integers(min_value=1, max_value=600), min_size=1, max_size=30))
@example([250, 249])  # two lines joined would be exactly 512 bytes: two datagrams
@example([249, 249])  # 511 bytes: one
def test_lines_are_split_into_datagrams_exactly_as_statsd_splits_them(lengths: list[int]) -> None:
    """Tags mode's own sender against statsd's pipeline itself, on the same lines."""
    rx = Receiver()
    client = StatsClient("127.0.0.1", rx.port)
    try:
        pipe = client.pipeline()
        for i, length in enumerate(lengths):
            pipe.incr(f"{i}." + "m" * length)
        pipe.send()
        by_statsd = rx.datagrams()
    finally:
        client.close()
        rx.sock.close()
    lines = [line for d in by_statsd for line in d.split("\n")]
    assert len(lines) == len(lengths)
    assert list(split_into_datagrams(lines)) == by_statsd


# ---------------------------------------------------------------------------------
# never block, never raise


def without_yielding(action: Callable[[], None]) -> None:
    """Run ``action`` on a greenlet; fail if it yielded to the hub (another greenlet ran meanwhile)."""
    ran: list[bool] = []

    def body() -> None:
        gevent.spawn(ran.append, True)
        action()
        assert not ran, "yielded to the hub"

    gevent.spawn(body).get(timeout=10)


def socket_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
        except OSError:
            pass  # the listing's own descriptor, gone already
    return fds


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists descriptors through /proc")
@pytest.mark.parametrize("tags", [False, True])
def test_the_sender_socket_is_non_blocking_and_closed_on_stop(receiver: Receiver, tags: bool) -> None:
    sink = StatsdMetrics(statsd(receiver, tags=tags), topology(service()))
    before = socket_fds()
    assert sink.connect()
    (fd,) = socket_fds() - before
    assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK, "a full buffer must drop, not block"
    assert socket.getdefaulttimeout() is None, "the process's default is put back"
    sink.stop()
    assert fd not in socket_fds()


#: Run under gevent's monkey-patching, as ``activator run`` is: building statsd's client
#: (whose constructor resolves its host through the patched, cooperative resolver) must
#: not let another greenlet run while new sockets are made non-blocking.
PATCHED_BUILD = """
from gevent import monkey
monkey.patch_all()
import socket, sys, time
import gevent
from activator.core.config import Address, Config, StatsdConfig
from activator.core.topology import Topology
from activator.ops.metrics import StatsdMetrics

rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
rx.bind(("127.0.0.1", 0))
config = StatsdConfig(Address("127.0.0.1", rx.getsockname()[1]), prefix="t")
sink = StatsdMetrics(config, Topology(Config(path="test.yaml"), time.monotonic()))
seen = []

def watch():
    while True:
        seen.append(socket.getdefaulttimeout())
        gevent.sleep(0)

watcher = gevent.spawn(watch)
gevent.sleep(0)
built = sink.connect()
watcher.kill()
sink.reload(True)
rx.settimeout(10)
print(built, len(seen) > 1, sorted(set(map(repr, seen))), rx.recv(512).decode())
"""


def test_under_monkey_patching_building_the_client_lets_nothing_else_run() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PATCHED_BUILD],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # The watcher ran while the address was resolved (that yields), never in the build.
    assert done.stdout.split() == ["True", "True", "['None']", "t.config.reload.ok:1|c"], done.stdout


def test_building_starting_sending_and_stopping_do_not_yield(receiver: Receiver) -> None:
    topo = topology(service())
    senders = [live(statsd(receiver, tags=tags), topo) for tags in (False, True)]
    transition = Transition("api", POD_A, PodState.HEALTHY, PodState.PENDING, PodEvent.PROBE_FAILED, "probe")

    def body() -> None:
        for host in ("127.0.0.1", "localhost"):  # the server's swap of sinks on reload
            for tags in (False, True):
                sink = make_metrics(statsd(receiver, host=host, tags=tags), topo)
                sink.start()
                sink.request_done(record())
                sink.stop()
        for sink in senders:
            sink.request_done(record())
            sink.transition(transition)
            sink.reload(True)
            sink.flush()
            sink.stop()

    without_yielding(body)
    lines = receiver.lines()
    for sent in (SENT_A_REQUEST, "t.requests:1|c|#service:api", "t.api.pod_transitions.pending:1|c"):
        assert sent in lines, "the sends did happen"
    assert lines.count("t.config.reload.ok:1|c") == 2
    assert any(line.startswith("t.api.in_flight:") for line in lines)


def test_unresolvable_host_does_not_prevent_startup(receiver: Receiver, caplog: pytest.LogCaptureFixture) -> None:
    topo = topology(service())
    config = StatsdConfig(address=Address("statsd.invalid", receiver.port), prefix="t")
    sink = StatsdMetrics(config, topo, interval=0.01)
    with caplog.at_level(logging.WARNING, logger="activator"):
        sink.start()
        sink.request_done(record())
        sink.reload(True)
        deadline = time.monotonic() + 20
        while "cannot resolve" not in caplog.text and time.monotonic() < deadline:
            gevent.sleep(0.01)
        assert not sink.connect(), "retried: still not resolvable"
        assert not sink.connect()
        sink.flush()
        sink.stop()
    assert caplog.text.count("cannot resolve") == 1, "warned once"
    assert receiver.datagrams() == []


def test_host_name_is_resolved_on_the_gauge_greenlet(receiver: Receiver) -> None:
    sink = StatsdMetrics(statsd(receiver, host="localhost"), topology(service()), interval=0.01)
    sink.request_done(record())  # not resolved yet: dropped
    assert receiver.datagrams() == []
    sink.start()
    try:
        assert "t.api.in_flight:0|g" in receiver.wait_datagram().split("\n")
        sink.request_done(record())
        assert SENT_A_REQUEST in receiver.lines()
    finally:
        sink.stop()


@pytest.mark.parametrize("tags", [False, True])
def test_dead_address_costs_nothing(receiver: Receiver, caplog: pytest.LogCaptureFixture, tags: bool) -> None:
    sink = live(statsd(receiver, tags=tags), topology(service()))
    port = receiver.port
    receiver.sock.close()  # nobody listens: ICMP port unreachable comes back

    def body() -> None:
        for _ in range(100):
            sink.request_done(record())
            sink.reload(False)
            sink.flush()

    with caplog.at_level(logging.WARNING, logger="activator"):
        without_yielding(body)  # no wait for the dead address
    assert "statsd" not in caplog.text, "an unreachable server is not a failure to report"
    back = Receiver(port)  # and nothing was given up: a server back on that port hears the next one
    try:
        sink.request_done(record())
        requests = "t.requests:1|c|#service:api" if tags else SENT_A_REQUEST
        assert requests in back.lines()
    finally:
        back.sock.close()
        sink.stop()


@pytest.mark.parametrize("tags", [False, True])
def test_send_errors_never_reach_the_caller(receiver: Receiver, caplog: pytest.LogCaptureFixture, tags: bool) -> None:
    sink = live(statsd(receiver, tags=tags), topology(service()))
    broken = record()
    broken.end = "later"  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="activator"):
        sink.request_done(broken)
        sink.request_done(broken)
    assert caplog.text.count("sending failed") == 1
    sink.request_done(record())
    assert any(line.startswith("t.") and "requests:1|c" in line for line in receiver.lines())

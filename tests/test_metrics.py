"""The StatsD sink against a real UDP socket on 127.0.0.1: names, types, values, datagrams.

A Topology is built from config dataclasses (no file, no proxy); requests are fed as
RequestRecords. Loopback UDP is delivered inside ``sendto``, so after a call returns
its datagrams are already queued on the receiver: no waiting, except for the gauge
greenlet itself (polled with a generous timeout, never timed).
"""


import dataclasses
import logging
from gevent import socket  # recv yields to the hub, so the sink's greenlets run
import time
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import pytest

from activator.core.config import Address, Config, PodConfig, ProbeConfig, ServiceConfig, StatsdConfig
from activator.core.states import PodEvent, PodState
from activator.core.topology import Topology
from activator.core.throttler import Grant, Transition
from activator.metrics import StatsdMetrics, make_metrics, pod_id
from activator.observe import MetricsSink, NoMetrics, RequestRecord

POD_A = "127.0.0.1:8001"
POD_B = "127.0.0.1:8002"


class Receiver:
    """A bound UDP socket; ``datagrams()`` drains what has arrived, without waiting."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
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
        return self.sock.recv(65536).decode()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.sock.close()


def pod(address: str, drain: bool = False) -> PodConfig:
    host, _, port = address.rpartition(":")
    return PodConfig(address=address, host=host, port=int(port), drain=drain)


def service(name: str = "api", cc: int = 1, pods: tuple[str, ...] = (POD_A,), queue_depth: int = 10) -> ServiceConfig:
    return ServiceConfig(name=name, hosts=(f"{name}.test",), container_concurrency=cc, queue_depth=queue_depth,
                         pods=tuple(pod(p) for p in pods))


def topology(*services: ServiceConfig, on_transition: Callable[[Transition], None] | None = None,
             **worker: Any) -> Topology:
    config = Config(path="test.yaml", services={s.name: s for s in services})
    return Topology(config, time.monotonic(), on_transition=on_transition, **worker)


def statsd(receiver: Receiver, tags: bool = False, host: str = "127.0.0.1") -> StatsdConfig:
    return StatsdConfig(address=Address(host, receiver.port), prefix="t", tags=tags)


def record(service: str = "api", status: int = 200, reason: str = "-", queue_wait: float | None = 0.25,
           total: float = 1.5) -> RequestRecord:
    r = RequestRecord(start=100.0, client="127.0.0.1", method="GET", target="/")
    r.service = service
    r.status = status
    r.reason = reason
    r.queue_wait = queue_wait
    r.end = r.start + total
    return r


def grant(topo: Topology, name: str = "api") -> Grant:
    got = topo.services[name].acquire(time.monotonic(), lambda: None)
    assert isinstance(got, Grant)
    return got


# ---------------------------------------------------------------------------------
# per request


def test_no_config_means_no_metrics() -> None:
    assert isinstance(make_metrics(None, topology(service())), NoMetrics)


def test_a_served_request_is_one_datagram(receiver: Receiver) -> None:
    sink = make_metrics(statsd(receiver), topology(service()))
    sink.request_started("api")
    sink.request_done(record())
    assert receiver.datagrams() == [
        "t.api.requests:1|c\nt.api.responses.2xx:1|c\nt.api.latency:1500.000|ms\nt.api.queue_wait:250.000|ms"
    ]
    sink.stop()


@pytest.mark.parametrize(("status", "reason", "rejected"), [
    (503, "queue-full", "t.api.rejected.queue_full:1|c"),
    (503, "queue-timeout", "t.api.rejected.queue_timeout:1|c"),
    (503, "shutting-down", "t.api.rejected.shutting_down:1|c"),
])
def test_refused_requests_count_by_reason_without_queue_wait(receiver: Receiver, status: int, reason: str,
                                                             rejected: str) -> None:
    sink = make_metrics(statsd(receiver), topology(service()))
    sink.request_done(record(status=status, reason=reason, queue_wait=None, total=0.002))
    assert receiver.datagrams() == [f"t.api.requests:1|c\nt.api.responses.5xx:1|c\n{rejected}\nt.api.latency:2.000|ms"]


@pytest.mark.parametrize(("status", "cls"), [(204, "2xx"), (304, "3xx"), (404, "4xx"), (502, "5xx"), (504, "5xx")])
def test_responses_by_class(receiver: Receiver, status: int, cls: str) -> None:
    sink = make_metrics(statsd(receiver), topology(service()))
    sink.request_done(record(status=status))
    assert f"t.api.responses.{cls}:1|c" in receiver.lines()


def test_unrouted_requests_are_not_counted(receiver: Receiver) -> None:
    sink = make_metrics(statsd(receiver), topology(service()))
    sink.request_done(record(service="-", status=404, reason="unknown-host", queue_wait=None))
    assert receiver.datagrams() == []


def test_client_gone_before_an_answer_counts_the_request_only(receiver: Receiver) -> None:
    sink = make_metrics(statsd(receiver), topology(service()))
    sink.request_done(record(status=0, queue_wait=None))
    assert receiver.lines() == ["t.api.requests:1|c", "t.api.latency:1500.000|ms"]


def test_tags_mode(receiver: Receiver) -> None:
    topo = topology(service())
    sink = make_metrics(statsd(receiver, tags=True), topo)
    sink.request_done(record())
    assert receiver.datagrams() == [
        "t.requests:1|c|#service:api\nt.responses.2xx:1|c|#service:api\n"
        "t.latency:1500.000|ms|#service:api\nt.queue_wait:250.000|ms|#service:api"
    ]
    assert isinstance(sink, StatsdMetrics)
    grant(topo)
    sink.flush()
    lines = receiver.lines()
    assert "t.in_flight:1|g|#service:api" in lines
    assert "t.pods.healthy:1|g|#service:api" in lines
    assert f"t.pod.in_flight:1|g|#service:api,pod:{pod_id(POD_A)}" in lines
    sink.reload(True)
    assert receiver.lines() == ["t.config.reload.ok:1|c"]


def test_reload_counters(receiver: Receiver) -> None:
    sink = make_metrics(statsd(receiver), topology(service()))
    sink.reload(True)
    sink.reload(False)
    sink.reload(True)
    assert receiver.lines() == ["t.config.reload.ok:1|c", "t.config.reload.failed:1|c", "t.config.reload.ok:1|c"]


def test_pod_id() -> None:
    assert pod_id("10.0.1.5:8000") == "10_0_1_5_8000"
    assert pod_id("[::1]:8000") == "___1__8000"
    assert pod_id("api-1.internal:80") == "api-1_internal_80"


# ---------------------------------------------------------------------------------
# gauges and failure counters


def test_gauges(receiver: Receiver) -> None:
    topo = topology(service(cc=2, pods=(POD_A, POD_B)), service("free", cc=0, pods=(POD_A,)))
    sink = make_metrics(statsd(receiver), topo)
    assert isinstance(sink, StatsdMetrics)
    grant(topo)
    grant(topo)
    sink.flush()
    lines = receiver.lines()
    a, b = pod_id(POD_A), pod_id(POD_B)
    for expected in ("t.api.queued:0|g", "t.api.in_flight:2|g", "t.api.capacity:4|g", "t.api.pods.healthy:2|g",
                     "t.api.pods.pending:0|g", "t.api.pods.draining:0|g", "t.free.in_flight:0|g",
                     "t.free.pods.healthy:1|g", f"t.free.pod.{a}.in_flight:0|g"):
        assert expected in lines
    assert sorted(line for line in lines if ".api.pod." in line) == [f"t.api.pod.{a}.in_flight:2|g",
                                                                      f"t.api.pod.{b}.in_flight:0|g"]
    assert not any(line.startswith("t.free.capacity") for line in lines), "unlimited: no capacity gauge"
    assert all(line.endswith("|g") for line in lines), "no counter without a failure"


def test_queued_and_draining(receiver: Receiver) -> None:
    topo = topology(service(cc=1, pods=(POD_A,)))
    sink = make_metrics(statsd(receiver), topo)
    assert isinstance(sink, StatsdMetrics)
    grant(topo)
    assert not isinstance(topo.services["api"].acquire(time.monotonic(), lambda: None), Grant)
    probed = dataclasses.replace(service(cc=1, pods=(POD_B,)), probe=ProbeConfig())
    topo.apply(Config(path="test.yaml", services={"api": probed}), time.monotonic())
    sink.flush()
    lines = receiver.lines()
    for expected in ("t.api.queued:1|g", "t.api.in_flight:1|g", "t.api.pods.draining:1|g", "t.api.pods.pending:1|g",
                     "t.api.pods.healthy:0|g", "t.api.capacity:0|g", f"t.api.pod.{pod_id(POD_A)}.in_flight:1|g",
                     f"t.api.pod.{pod_id(POD_B)}.in_flight:0|g"):
        assert expected in lines


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
    sink = make_metrics(statsd(receiver), topo)
    assert isinstance(sink, StatsdMetrics)
    a = pod_id(POD_A)
    g = grant(topo)
    now = time.monotonic()
    throttler.record_failure(g, "connect_errors", now)
    throttler.record_failure(g, "connect_errors", now)
    throttler.record_failure(g, "timeouts", now)
    # what record_failure counts for a pod that was not healthy when chosen: summed all the same
    throttler.trackers[POD_A].failure_counts[("connect_errors", "unhealthy")] = 1
    sink.flush()
    counters = [line for line in receiver.lines() if line.endswith("|c")]
    assert sorted(counters) == [f"t.api.pod.{a}.connect_errors:3|c", f"t.api.pod.{a}.timeouts:1|c"]
    sink.flush()
    assert not [line for line in receiver.lines() if line.endswith("|c")]
    throttler.record_failure(g, "resets", now)
    throttler.record_failure(g, "timeouts", now)
    sink.flush()
    counters = [line for line in receiver.lines() if line.endswith("|c")]
    assert sorted(counters) == [f"t.api.pod.{a}.resets:1|c", f"t.api.pod.{a}.timeouts:1|c"]


def test_failures_before_the_sink_existed_are_not_sent(receiver: Receiver) -> None:
    topo = topology(service())
    throttler = topo.services["api"]
    g = grant(topo)
    throttler.record_failure(g, "timeouts", time.monotonic())
    sink = make_metrics(statsd(receiver), topo)
    assert isinstance(sink, StatsdMetrics)
    sink.flush()
    assert not [line for line in receiver.lines() if line.endswith("|c")]


def test_removed_pod_sends_its_last_failures_then_a_zero_gauge(receiver: Receiver) -> None:
    sinks: list[MetricsSink] = []  # wired as the server does (through the Observer)

    def on_transition(transition: Transition) -> None:
        for sink in sinks:
            sink.transition(transition)

    topo = topology(service(pods=(POD_A, POD_B)), on_transition=on_transition)
    throttler = topo.services["api"]
    sink = make_metrics(statsd(receiver), topo)
    assert isinstance(sink, StatsdMetrics)
    sinks.append(sink)
    a = pod_id(POD_A)
    g = grant(topo)
    assert g.pod.address == POD_A
    sink.flush()
    receiver.datagrams()
    topo.apply(Config(path="test.yaml", services={"api": service(pods=(POD_B,))}), time.monotonic())
    assert receiver.lines() == ["t.api.pod_transitions.draining:1|c"]
    throttler.record_failure(g, "timeouts", time.monotonic())
    throttler.release(g, time.monotonic())  # draining -> removed, and forgotten
    assert POD_A not in throttler.trackers
    assert receiver.lines() == ["t.api.pod_transitions.removed:1|c", f"t.api.pod.{a}.timeouts:1|c"]
    sink.flush()
    lines = receiver.lines()
    assert f"t.api.pod.{a}.in_flight:0|g" in lines, "a gauge no longer reported is zeroed once"
    assert not any(f".{a}.timeouts" in line for line in lines), "not sent twice"
    sink.flush()
    assert not any(a in line for line in receiver.lines())


def test_transition_counter(receiver: Receiver) -> None:
    sink = make_metrics(statsd(receiver), topology(service()))
    sink.transition(Transition("api", POD_A, PodState.HEALTHY, PodState.PENDING, PodEvent.PROBE_FAILED, "probe"))
    assert receiver.lines() == ["t.api.pod_transitions.pending:1|c"]


def test_workers_tag_their_gauges_only(receiver: Receiver) -> None:
    topo = topology(service(), worker_index=1, workers=("127.0.0.1:9001", "127.0.0.1:9002"))
    assert topo.worker == (1, 2)
    sink = make_metrics(statsd(receiver), topo)
    assert isinstance(sink, StatsdMetrics)
    sink.request_done(record())
    assert "t.api.requests:1|c" in receiver.lines()
    sink.flush()
    lines = receiver.lines()
    assert "t.api.worker1.in_flight:0|g" in lines
    assert f"t.api.worker1.pod.{pod_id(POD_A)}.in_flight:0|g" in lines
    tagged = make_metrics(statsd(receiver, tags=True), topo)
    assert isinstance(tagged, StatsdMetrics)
    tagged.flush()
    assert "t.in_flight:0|g|#service:api,worker:1" in receiver.lines()


def test_many_pods_are_split_into_datagrams_below_512_bytes(receiver: Receiver) -> None:
    pods = tuple(f"10.0.{i // 200}.{i % 200}:8000" for i in range(100))
    sink = make_metrics(statsd(receiver), topology(service(pods=pods)))
    assert isinstance(sink, StatsdMetrics)
    sink.flush()
    datagrams = receiver.datagrams()
    assert len(datagrams) > 1
    assert all(len(d) < 512 for d in datagrams)
    assert sum(1 for d in datagrams for line in d.split("\n") if ".pod." in line) == 100


# ---------------------------------------------------------------------------------
# never block, never raise


def test_building_and_using_the_sink_does_not_yield(receiver: Receiver) -> None:
    ran: list[bool] = []
    topo = topology(service())

    def body() -> None:
        gevent.spawn(ran.append, True)
        for host in ("127.0.0.1", "localhost"):
            sink = make_metrics(statsd(receiver, host=host), topo)
            sink.start()
            sink.request_done(record())
            sink.reload(True)
            sink.stop()
        assert not ran, "the sink yielded to the hub"

    gevent.spawn(body).get(timeout=10)


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
        gevent.sleep(0.1)  # several more failed attempts
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
        assert "t.api.requests:1|c" in receiver.lines()
    finally:
        sink.stop()


def test_dead_address_costs_nothing(receiver: Receiver) -> None:
    port = receiver.port
    receiver.sock.close()  # nobody listens: ICMP port unreachable comes back
    sink = make_metrics(StatsdConfig(address=Address("127.0.0.1", port), prefix="t"), topology(service()))
    for _ in range(100):
        sink.request_done(record())
        sink.reload(False)


def test_send_errors_never_reach_the_caller(receiver: Receiver, caplog: pytest.LogCaptureFixture) -> None:
    sink = make_metrics(statsd(receiver), topology(service()))
    assert isinstance(sink, StatsdMetrics)
    broken = record()
    broken.end = "later"  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="activator"):
        sink.request_done(broken)
        sink.request_done(broken)
    assert caplog.text.count("sending failed") == 1
    sink.request_done(record())
    assert "t.api.requests:1|c" in receiver.lines()

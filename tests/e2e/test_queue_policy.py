"""End to end: the queue knows who waits (issue 27): priority classes, shedding, tenants.

The real ``activator run`` in front of one ``tests/backend.py`` pod at
``container_concurrency: 1``. Every request is a ``/hold?key=K`` that the pod holds until
the test releases ``K`` (its ``X-Request-Id`` is ``K`` too), so the order the pod
receives requests in is read back exactly (``request_ids``). A request is sent only once
the previous one is queued (``/status``), so the arrival order is the test's. Each test
runs over HTTP/1.1 and HTTP/2 (h2c, one connection per request: a connection's own share
of the queue is not what is tested here), with one process and with ``workers: 2``
(whichever worker the kernel gives a connection to, the one queue is the supervisor's and
keeps the same order).
"""

from __future__ import annotations

import http.client
from collections.abc import Callable
from typing import Any

import pytest
from harness import (
    Activator,
    H2Client,
    Pod,
    StatsdReceiver,
    activator_reason,
    service_config,
    start_request,
    wait_until,
)

pytestmark = pytest.mark.binary

SERVICE = "api"
HOST = "api.test"
CLASSES = ["critical", "standard", "sheddable"]


MODES = [("h1", 1), ("h2", 1), ("h1", 2), ("h2", 2)]


@pytest.fixture(params=MODES, ids=[f"{transport}-workers{workers}" for transport, workers in MODES])
def mode(request: pytest.FixtureRequest) -> tuple[str, int]:
    transport, workers = request.param
    return str(transport), int(workers)


def start(
    activator_factory: Any, mode: tuple[str, int], pod: Pod, statsd: StatsdReceiver | None = None, **options: Any
) -> tuple[Activator, Callable[..., Sent]]:
    """The activator (in ``mode``'s worker count) for one cc=1 service over ``pod``, and
    a function sending requests to it in ``mode``'s transport."""
    service = service_config(
        [pod], hosts=[HOST], container_concurrency=1, **{"queue_depth": 10, "queue_timeout": "60s", **options}
    )
    config: dict[str, Any] = {"workers": mode[1], "access_log": False, "services": {SERVICE: service}}
    if statsd is not None:
        config["statsd"] = {"address": statsd.address}
    act = activator_factory(config)
    return act, sender(act, mode[0])


class Sent:
    """One request on its own connection, over HTTP/1.1 or HTTP/2; its answer read later."""

    def __init__(self, act: Activator, transport: str, key: str, headers: dict[str, str]) -> None:
        all_headers = {"X-Request-Id": key, **headers}
        path = f"/hold?key={key}"
        self.h1: http.client.HTTPConnection | None = None
        self.h2: H2Client | None = None
        if transport == "h1":
            self.h1 = start_request(act.listen, path=path, host=HOST, headers=all_headers, timeout=60)
        else:
            self.h2 = H2Client(act.listen, host=HOST, timeout=60)
            self.stream = self.h2.send("GET", path, [(k.lower(), v) for k, v in all_headers.items()])

    def answer(self) -> tuple[int, str | None, str | None]:
        """(status, X-Activator-Reason, Retry-After); closes the connection."""
        if self.h1 is not None:
            try:
                resp = self.h1.getresponse()
                resp.read()
                return resp.status, activator_reason(resp), resp.getheader("Retry-After")
            finally:
                self.h1.close()
        assert self.h2 is not None
        try:
            got = self.h2.response(self.stream)
            return got.status or 0, got.header("x-activator-reason"), got.header("retry-after")
        finally:
            self.h2.close()


def queued(act: Activator, n: int) -> None:
    act.wait_for(lambda st: st["services"][SERVICE]["queued"] == n, message=f"{n} queued")


def holds(pod: Pod, key: str) -> None:
    wait_until(lambda: pod.held() == [key], message=lambda: f"the pod should hold {key}, holds {pod.held()}")


def sender(act: Activator, transport: str) -> Callable[..., Sent]:
    def send(key: str, queued_as: int | None = None, **headers: str) -> Sent:
        sent = Sent(act, transport, key, {k.replace("_", "-"): v for k, v in headers.items()})
        if queued_as is not None:
            queued(act, queued_as)
        return sent

    return send


def serve_all(pod: Pod, order: list[str]) -> None:
    """Release the held requests one by one, checking that they come in ``order``."""
    for key in order:
        holds(pod, key)
        pod.release(key)


def test_a_critical_request_is_served_before_queued_sheddable_ones(
    pod_factory, activator_factory, mode, statsd_receiver
):
    (pod,) = pod_factory(1)
    act, send = start(activator_factory, mode, pod, statsd_receiver, priority={"classes": CLASSES})
    sent = {"busy": send("busy")}
    holds(pod, "busy")
    sent["s1"] = send("s1", 1, Priority="u=7")
    sent["s2"] = send("s2", 2, Priority="u=6, i")
    sent["n1"] = send("n1", 3)  # no Priority: RFC 9218's default urgency 3, the middle class
    sent["c1"] = send("c1", 4, Priority="u=0")
    st = act.status()["services"][SERVICE]
    assert {name: c["queued"] for name, c in st["classes"].items()} == {"critical": 1, "standard": 1, "sheddable": 2}
    scraped = act.admin_get("/metrics").body.decode()
    assert 'activator_class_queued{class="sheddable",service="api"} 2.0' in scraped
    serve_all(pod, ["busy", "c1", "n1", "s1", "s2"])
    assert {key: s.answer()[0] for key, s in sent.items()} == dict.fromkeys(sent, 200)
    assert pod.stats()["request_ids"] == ["busy", "c1", "n1", "s1", "s2"]
    assert pod.stats()["peak"] == 1
    act.wait_idle()
    for klass in CLASSES:  # each waited: its class's queue wait is timed
        statsd_receiver.wait_for_metric(f"activator.api.class.{klass}.queue_wait", "ms")
    if mode[1] == 1:  # (with workers the queue is the supervisor's, which sends no gauges)
        statsd_receiver.wait_for_metric("activator.api.class.critical.queued", "g")


def test_a_full_queue_sheds_the_youngest_of_the_lowest_class(pod_factory, activator_factory, mode):
    (pod,) = pod_factory(1)
    act, send = start(activator_factory, mode, pod, queue_depth=2, priority={"classes": CLASSES})
    busy = send("busy")
    holds(pod, "busy")
    s1 = send("s1", 1, Priority="u=7")
    s2 = send("s2", 2, Priority="u=7")
    c1 = send("c1", None, Priority="u=0")
    status, reason, retry_after = s2.answer()
    assert (status, reason) == (503, "shed") and retry_after is not None
    full = send("s3", None, Priority="u=7")  # nobody below the lowest class: queue-full
    assert full.answer()[:2] == (503, "queue-full")
    assert act.status()["services"][SERVICE]["classes"]["sheddable"]["shed"] == 1
    scraped = act.admin_get("/metrics").body.decode()
    assert 'activator_class_shed_total{class="sheddable",service="api"} 1.0' in scraped
    assert 'activator_rejected_total{reason="shed",service="api"} 1.0' in scraped
    serve_all(pod, ["busy", "c1", "s1"])
    assert busy.answer()[0] == c1.answer()[0] == s1.answer()[0] == 200
    assert pod.stats()["request_ids"] == ["busy", "c1", "s1"]
    act.wait_idle()


def test_tenants_are_served_round_robin_and_one_cannot_fill_the_queue(pod_factory, activator_factory, mode):
    (pod,) = pod_factory(1)
    act, send = start(
        activator_factory, mode, pod, queue_depth=6, fair_by={"header": "X-Tenant"}, tenant_queue_share=0.5
    )
    sent = {"busy": send("busy", None, X_Tenant="a")}
    holds(pod, "busy")
    for n in (1, 2, 3):
        sent[f"a{n}"] = send(f"a{n}", n, X_Tenant="a")
    refused = send("a4", None, X_Tenant="a")
    status, reason, retry_after = refused.answer()
    assert (status, reason) == (503, "tenant-queue-full") and retry_after is not None
    sent["b1"] = send("b1", 4, X_Tenant="b")  # the quiet tenant still queues
    sent["b2"] = send("b2", 5, X_Tenant="b")
    st = act.status()["services"][SERVICE]
    assert st["top_tenants"][0] == {"tenant": "a", "queued": 3} and st["tenants"] == 2
    serve_all(pod, ["busy", "a1", "b1", "a2", "b2", "a3"])
    assert {key: s.answer()[0] for key, s in sent.items()} == dict.fromkeys(sent, 200)
    assert pod.stats()["request_ids"] == ["busy", "a1", "b1", "a2", "b2", "a3"]
    act.wait_idle()


def test_a_flooding_tenant_does_not_delay_the_quiet_ones_by_more_than_one_turn(pod_factory, activator_factory, mode):
    """Counted in requests passed, not in time: a quiet tenant's request that arrives
    behind a flood waits for at most one request of each other tenant."""
    (pod,) = pod_factory(1)
    act, send = start(
        activator_factory, mode, pod, queue_depth=20, fair_by={"header": "X-Tenant"}, tenant_queue_share=0.5
    )
    sent = {"busy": send("busy", None, X_Tenant="flood")}
    holds(pod, "busy")
    for n in range(1, 9):
        sent[f"f{n}"] = send(f"f{n}", n, X_Tenant="flood")
    sent["q1"] = send("q1", 9, X_Tenant="quiet1")
    sent["q2"] = send("q2", 10, X_Tenant="quiet2")
    order = ["busy", "f1", "q1", "q2", *[f"f{n}" for n in range(2, 9)]]
    serve_all(pod, order)
    assert {key: s.answer()[0] for key, s in sent.items()} == dict.fromkeys(sent, 200)
    served = pod.stats()["request_ids"]
    assert served == order
    # each quiet request passed at most one request of the flood (the one whose turn it was)
    assert served.index("q1") - served.index("busy") - 1 <= 1 and served.index("q2") - served.index("q1") == 1
    act.wait_idle()

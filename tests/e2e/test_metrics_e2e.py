"""StatsD end to end: the real ``activator run`` in front of a real pod, a real UDP receiver.

A known load (one held request, two refused with queue-full, two served) must show up
as exactly these counters and timers; gauges arrive on their own; reloads are counted.
Everything asynchronous is polled (``wait_for``), nothing is timed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from harness import Activator, Pod, StatsdReceiver, make_config, request, stream

pytestmark = pytest.mark.binary

HOST = "api.test"


def config(receiver: StatsdReceiver, pod: Pod, *, tags: bool = False) -> dict[str, Any]:
    statsd = {"address": receiver.address, "prefix": "t", "tags": tags}
    return make_config([pod], hosts=[HOST], queue_depth=0, top={"statsd": statsd})


def test_counters_timers_gauges_and_reloads(
    pod_factory: Callable[..., list[Pod]],
    activator_factory: Callable[..., Activator],
    statsd_receiver: StatsdReceiver,
) -> None:
    (pod,) = pod_factory(1)
    cfg = config(statsd_receiver, pod)
    act = activator_factory(cfg)
    rx = statsd_receiver
    pod_in_flight = f"t.api.pod.{pod.metric_name}.in_flight"

    # One request holds the only slot (an endless event stream) ...
    with stream(act.url("/sse?n=100000&gap_ms=20"), host=HOST) as held:
        assert held.status == 200
        assert held.readline()
        rx.wait_for(lambda _: rx.gauge("t.api.in_flight") == 1 and rx.gauge(pod_in_flight) == 1)
        # ... so with queue_depth 0 the next two are refused at once.
        for _ in range(2):
            refused = request(act.url("/"), host=HOST)
            assert (refused.status, refused.headers["X-Activator-Reason"]) == (503, "queue-full")
    # The client went away mid-response: the held request ends as 499 client-gone (a 4xx)
    # and frees the slot.
    rx.wait_for(lambda _: rx.counter("t.api.requests") == 3 and rx.gauge("t.api.in_flight") == 0)
    for _ in range(2):
        assert request(act.url("/delay?ms=10"), host=HOST).status == 200
    rx.wait_for(lambda _: rx.counter("t.api.requests") == 5)

    assert rx.counter("t.api.responses.2xx") == 2
    assert rx.counter("t.api.responses.4xx") == 1
    assert rx.counter("t.api.responses.5xx") == 2
    assert rx.counter("t.api.rejected.queue_full") == 2
    assert rx.counter("t.api.rejected.queue_timeout") == 0
    assert len(rx.values("t.api.latency", "ms")) == 5
    assert len(rx.values("t.api.queue_wait", "ms")) == 3, "only requests that got a slot"
    assert all(v >= 0 for v in rx.values("t.api.latency", "ms") + rx.values("t.api.queue_wait", "ms"))
    per_request = [d.decode() for d in rx.datagrams() if b"t.api.requests:1|c" in d]
    assert len(per_request) == 5 and all("t.api.latency:" in d for d in per_request), "one datagram per request"
    assert rx.gauge("t.api.capacity") == 1
    assert rx.gauge("t.api.pods.healthy") == 1
    assert rx.gauge("t.api.pods.pending") == 0
    assert rx.gauge("t.api.pods.draining") == 0
    assert rx.gauge("t.api.queued") == 0
    # The proof that cc held, after the requests are gone: the pod's peak, never above 1.
    rx.wait_for(lambda _: rx.gauge(f"t.api.pod.{pod.metric_name}.peak_in_flight") == 1)
    assert max(rx.values(f"t.api.pod.{pod.metric_name}.peak_in_flight", "g")) == 1
    assert not [name for name in rx.names() if name.endswith((".connect_errors", ".timeouts"))]
    assert not [name for name in rx.names() if name.startswith("t.-")], "unrouted requests are not counted"

    # SIGHUP re-reads an unchanged file: one good reload. A broken file: a failed one.
    act.reload()
    rx.wait_for(lambda _: rx.counter("t.config.reload.ok") == 1)
    act.rewrite_config({**cfg, "no_such_key": 1})
    rx.wait_for(lambda _: rx.counter("t.config.reload.failed") >= 1)
    assert rx.counter("t.config.reload.ok") == 1


def test_tags_mode_and_pod_failures(
    pod_factory: Callable[..., list[Pod]],
    activator_factory: Callable[..., Activator],
    statsd_receiver: StatsdReceiver,
) -> None:
    (pod,) = pod_factory(1)
    act = activator_factory(config(statsd_receiver, pod, tags=True))
    rx = statsd_receiver
    assert request(act.url("/"), host=HOST).status == 200
    pod.stop()  # connections refused from now on: 502, counted against the pod
    assert request(act.url("/"), host=HOST).status == 502

    service = ("service:api",)
    on_pod = ("service:api", f"pod:{pod.metric_name}")

    def total(name: str, tags: tuple[str, ...]) -> float:
        return sum(m.value for m in rx.tagged_metrics() if m.name == name and m.type == "c" and m.tags == tags)

    rx.wait_for(lambda _: total("t.pod.connect_errors", on_pod) >= 1)
    assert total("t.requests", service) == 2
    assert total("t.responses.2xx", service) == 1
    assert total("t.responses.5xx", service) == 1
    rx.wait_for(lambda _: any(m.name == "t.pod.in_flight" and m.tags == on_pod for m in rx.tagged_metrics()))
    assert any(m.name == "t.in_flight" and m.type == "g" and m.tags == service for m in rx.tagged_metrics())
    assert not [m for m in rx.tagged_metrics() if m.name.startswith("t.api.")], "no service in tagged names"

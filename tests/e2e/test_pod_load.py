"""End to end: the load pods announce (issue 27, item 3).

The real ``activator run`` in front of ``tests/backend.py`` pods that announce a load
(``POST /_load``): ORCA's ``endpoint-load-metrics`` header on their answers, or a gauge
on their ``/metrics`` read at each probe. ``least-loaded`` sends to the less loaded pod;
a pod's announced concurrency lowers its limit and never lifts it above
``container_concurrency``: the pods' own peaks (what they saw, not what the activator
says) prove it.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import (
    Activator,
    Pod,
    StatsdReceiver,
    concurrent_requests,
    json_request,
    probe_config,
    request,
    run_cli,
    service_config,
    start_request,
    wait_until,
)

pytestmark = pytest.mark.binary

ORCA = {"from": "orca"}


def announce(pod: Pod, **values: str) -> None:
    query = "&".join(f"{key}={value.replace(' ', '%20').replace(',', '%2C')}" for key, value in values.items())
    json_request(pod.address, "POST", f"/_load?{query}")


def pod_status(act: Activator, pod: Pod) -> dict[str, Any]:
    pods: list[dict[str, Any]] = act.status()["services"]["api"]["pods"]
    return next(p for p in pods if p["address"] == pod.address)


def served_by(act: Activator, path: str = "/work") -> str:
    response = request(act.listen, "GET", path, timeout=30)
    assert response.status == 200, response.text
    return response.headers["X-Pod"]


def start(
    activator_factory: Any, pods: list[Pod], cc: int, statsd: StatsdReceiver | None = None, **options: Any
) -> Activator:
    config: dict[str, Any] = {
        "access_log": False,
        "services": {"api": service_config(pods, container_concurrency=cc, queue_timeout="60s", **options)},
    }
    if statsd is not None:
        config["statsd"] = {"address": statsd.address}
    act: Activator = activator_factory(config)
    return act


def test_least_loaded_sends_to_the_pod_announcing_less(activator_factory: Any, pod_factory: Any) -> None:
    busy, idle = pod_factory(2)
    announce(busy, orca="TEXT cpu_utilization=0.9, named_metrics.queue=1")
    announce(idle, orca="TEXT cpu_utilization=0.1, named_metrics.queue=7")
    act = start(activator_factory, [busy, idle], 2, lb_policy="least-loaded", load=ORCA)
    # Silent pods are tried first (auto's order): each answer tells its pod's load.
    assert [served_by(act), served_by(act)] == [busy.address, idle.address]
    wait_until(lambda: pod_status(act, busy)["load"] == 0.9 and pod_status(act, idle)["load"] == 0.1)
    assert {served_by(act) for _ in range(8)} == {idle.address}
    # Both of the idle pod's slots taken: the next goes to the busy one.
    held = [start_request(act.listen, path=f"/hold?key=k{i}", timeout=30) for i in range(2)]
    wait_until(lambda: idle.held() == ["k0", "k1"])
    assert served_by(act) == busy.address
    idle.release()
    for conn in held:
        assert conn.getresponse().status == 200
        conn.close()
    assert busy.stats()["paths"].get("/hold") is None


def test_the_figure_is_the_named_metric_the_service_names(activator_factory: Any, pod_factory: Any) -> None:
    first, second = pod_factory(2)
    announce(first, orca='JSON {"cpu_utilization": 0.1, "named_metrics": {"queue": 9}}')
    announce(second, orca='JSON {"cpu_utilization": 0.9, "named_metrics": {"queue": 2}}')
    load = {"from": "orca", "metric": "named_metrics.queue"}
    act = start(activator_factory, [first, second], 1, lb_policy="least-loaded", load=load)
    served_by(act)
    served_by(act)
    wait_until(lambda: pod_status(act, first)["load"] == 9 and pod_status(act, second)["load"] == 2)
    assert {served_by(act) for _ in range(5)} == {second.address}


def test_a_pod_announcing_concurrency_1_gets_one_at_a_time(activator_factory: Any, pod_factory: Any) -> None:
    (pod,) = pod_factory(1)
    announce(pod, orca="TEXT named_metrics.max_concurrency=1")
    act = start(activator_factory, [pod], 3, load=ORCA)
    served_by(act)  # it is heard only once it answered
    wait_until(lambda: pod_status(act, pod)["announced_concurrency"] == 1)
    assert act.status()["services"]["api"]["capacity"] == 1
    pod.reset()
    statuses = concurrent_requests(6, lambda i: request(act.listen, "GET", "/work?ms=50", timeout=60).status)
    assert statuses == [200] * 6
    assert pod.stats()["peak"] == 1


def test_a_pod_announcing_more_than_cc_never_gets_more(activator_factory: Any, pod_factory: Any) -> None:
    (pod,) = pod_factory(1)
    announce(pod, orca="TEXT named_metrics.max_concurrency=10")
    act = start(activator_factory, [pod], 2, load=ORCA)
    served_by(act)
    wait_until(lambda: pod_status(act, pod)["announced_concurrency"] == 2)  # bounded by cc
    held = [start_request(act.listen, path=f"/hold?key=k{i}", timeout=30) for i in range(5)]
    wait_until(lambda: act.status()["services"]["api"]["queued"] == 3)
    wait_until(lambda: len(pod.held()) == 2)  # granted; each reaches the pod in its own time
    pod.release()
    wait_until(lambda: len(pod.held()) == 2)  # the next two, never more (the peak below)
    pod.release()
    wait_until(lambda: len(pod.held()) == 1)
    pod.release()
    for conn in held:
        assert conn.getresponse().status == 200
        conn.close()
    assert pod.stats()["peak"] == 2


def test_a_gauge_read_at_each_probe(activator_factory: Any, pod_factory: Any) -> None:
    long_queue, short_queue = pod_factory(2)
    announce(long_queue, gauge="5")
    announce(short_queue, gauge="1")
    load = {"from": {"path": "/metrics", "metric": "pod_queue_length"}}
    act = start(
        activator_factory, [long_queue, short_queue], 1, lb_policy="least-loaded", load=load, probe=probe_config()
    )
    wait_until(lambda: pod_status(act, long_queue)["load"] == 5 and pod_status(act, short_queue)["load"] == 1)
    assert {served_by(act) for _ in range(5)} == {short_queue.address}
    announce(long_queue, gauge="0")
    wait_until(lambda: pod_status(act, long_queue)["load"] == 0)
    assert {served_by(act) for _ in range(5)} == {long_queue.address}


def test_the_announced_load_is_visible_everywhere(
    activator_factory: Any, pod_factory: Any, statsd_receiver: StatsdReceiver
) -> None:
    (pod,) = pod_factory(1)
    announce(pod, orca="TEXT cpu_utilization=0.25, named_metrics.max_concurrency=1")
    act = start(activator_factory, [pod], 3, statsd_receiver, lb_policy="least-loaded", load=ORCA)
    served_by(act)
    shown = wait_until(lambda: (p := pod_status(act, pod))["announced_concurrency"] == 1 and p)
    assert shown["load"] == 0.25
    metrics = act.admin_get("/metrics").text
    on_pod = f'{{pod="{pod.address}",service="api"}}'
    assert f"activator_pod_load{on_pod} 0.25" in metrics
    assert f"activator_pod_announced_concurrency{on_pod} 1.0" in metrics
    assert statsd_receiver.wait_for_metric(f"activator.api.pod.{pod.metric_name}.load", "g").value == 0.25
    assert statsd_receiver.wait_for_metric(f"activator.api.pod.{pod.metric_name}.announced_concurrency", "g").value == 1
    page = act.admin_get("/").text
    assert "data-col='load'>0.25<" in page and "data-col='announced_concurrency'>1<" in page
    cli = run_cli(["status", "--admin", str(act.admin)])
    assert "announced: load 0.25, concurrency 1" in cli.stdout, cli.stdout


def test_with_workers_an_announced_concurrency_never_lifts_the_ceiling(
    activator_factory: Any, pod_factory: Any
) -> None:
    """``workers: 2``: each worker hears the pod itself; whatever it heard, the pod never
    holds more than container_concurrency (its own peak says so)."""
    (pod,) = pod_factory(1)
    announce(pod, orca="TEXT cpu_utilization=0.5, named_metrics.max_concurrency=10")
    service = service_config([pod], container_concurrency=2, queue_timeout="60s", lb_policy="least-loaded", load=ORCA)
    act = activator_factory({"workers": 2, "access_log": False, "services": {"api": service}})
    for _ in range(4):
        served_by(act)
    wait_until(lambda: pod_status(act, pod)["announced_concurrency"] == 2)
    pod.reset()
    statuses = concurrent_requests(8, lambda i: request(act.listen, "GET", "/work?ms=50", timeout=60).status)
    assert statuses == [200] * 8
    assert pod.stats()["peak"] <= 2  # the ceiling (whether both workers were busy at once is the kernel's)

"""``GET /metrics``: the StatsD metrics' meanings in the Prometheus text format.

What this module decides:

- Every value is read from one ``/status`` document (a single process's, or the
  supervisor's merge of its workers', so both serve the same metrics). Nothing is
  counted here and the request path does nothing for it: the counters are the history's
  (``history.Counters``) and the pod trackers', the gauges the topology's.
- Names are ``activator_...``, counters end in ``_total``; ``service`` and ``pod`` (the
  pod's address as written in the file) are labels, never part of a name, so one
  scrape config covers every pod. The meanings are those of the StatsD metrics
  (SPEC.md): ``requests``, ``responses.{class}``, ``rejected.{reason}``, ``latency``
  and ``queue_wait`` (histograms here, in seconds), the gauges ``queued`` /
  ``in_flight`` / ``tunnels`` / ``capacity`` / ``pods.{state}`` / ``pod.in_flight``,
  the per-pod transport failure counters, pod state changes, config reloads; per
  priority class, queued, the oldest wait and sheds, and the tenants waiting; for a
  service with ``launch:``, ``activator_launch_*`` (desired, running and starting pods;
  started, stopped and failed launches, cold starts and their seconds).
- ``activator_capacity`` is omitted for an unlimited service (``container_concurrency:
  0`` with a healthy pod), as in StatsD. With workers, a pod the workers see in
  different states counts in ``activator_pods`` under each of them.
- **Every label value exists from the start**: every reason (``activator_rejected_total``
  of a service, ``activator_refused_total`` before routing), state (pods per state, a
  pod's state, its time in each state, pod state changes) and answer class, at 0 until
  it happens, so that a rate or an alert over one that never happened is 0, not empty.
- Per pod, what proves that its limit held and how it did: in flight, its highest in
  flight since start and over the history kept (15 minutes), its slots here, answers by
  class, retries elsewhere, its pod time (a summary: count and sum), time in each state.
- ``process_*`` (CPU, memory, file descriptors, start time) and ``python_info`` come from
  prometheus_client's own ``ProcessCollector`` and ``PlatformCollector``, for the process
  that serves ``/metrics`` (with workers: the supervisor).
- Rendered through prometheus_client's public API only: a collector of our own
  (``collect()`` yields metric families) in a private ``CollectorRegistry``, written by
  ``generate_latest`` in the text format 0.0.4 (``CONTENT_TYPE``). The process-wide
  default registry is never used.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from .history import CLASSES, STATES

#: What ``generate_latest`` writes: the Prometheus text format, version 0.0.4.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
_FAILURE_KINDS = ("connect_errors", "timeouts", "resets")
#: The process's own collectors, made once (registered in each render's registry).
_PROCESS_COLLECTORS = (ProcessCollector(registry=None), PlatformCollector(registry=None))


class StatusCollector:
    """A prometheus_client collector of one /status document."""

    def __init__(self, status: Mapping[str, Any]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        return families(self.status)


def render(status: Mapping[str, Any]) -> bytes:
    """The Prometheus text exposition of ``status``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(status))
    for collector in _PROCESS_COLLECTORS:
        registry.register(collector)
    return generate_latest(registry)


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _histogram(family: HistogramMetricFamily, labels: list[str], histogram: Mapping[str, Any] | None) -> None:
    if not histogram:
        return
    buckets: list[tuple[str, float]] = []
    seen = 0
    bounds = histogram["bounds"]
    for bound, count in zip([*bounds, None], histogram["counts"], strict=True):
        seen += count
        buckets.append(("+Inf" if bound is None else repr(float(bound)), float(seen)))
    family.add_metric(labels, buckets, histogram["sum"])


def families(status: Mapping[str, Any]) -> Iterator[Metric]:
    """Every metric family of ``status`` (see the module docstring)."""
    s = ["service"]
    info = _gauge("activator_info", "This activator: version and name (always 1)", ["version", "self"])
    info.add_metric([str(status.get("version", "")), str(status.get("activator", {}).get("self") or "")], 1)
    ready = _gauge("activator_ready", "1 while serving (/readyz is 200), else 0", [])
    ready.add_metric([], 1 if status.get("ready") else 0)
    reloads = _counter("activator_config_reloads", "Config reloads by result (ok, failed)", ["result"])
    for result in ("ok", "failed"):
        reloads.add_metric([result], status.get("reloads", {}).get(result, 0))
    refused = _counter(
        "activator_refused", "Requests refused before a service was found for them, by X-Activator-Reason", ["reason"]
    )
    for reason, count in status.get("refused", {}).items():
        refused.add_metric([reason], count)
    goaways = _counter(
        "activator_h2_goaway",
        "HTTP/2 client connections closed (GOAWAY ENHANCE_YOUR_CALM) for going past a budget",
        ["budget"],
    )
    for budget, count in status.get("h2_goaway", {}).items():
        goaways.add_metric([budget], count)
    yield from (info, ready, reloads, refused, goaways)

    requests = _counter("activator_requests", "Requests routed to the service", s)
    responses = _counter("activator_responses", "Answers by status class, the activator's own included", [*s, "class"])
    rejected = _counter(
        "activator_rejected",
        "Requests the activator answered itself instead of a pod, by X-Activator-Reason",
        [*s, "reason"],
    )
    bytes_in = _counter("activator_request_body_bytes", "Request body bytes received from clients", s)
    bytes_out = _counter("activator_response_body_bytes", "Response body bytes sent to clients", s)
    latency = HistogramMetricFamily(
        "activator_request_duration_seconds", "Arrival to last byte, by the time the request ended", labels=s
    )
    queue_wait = HistogramMetricFamily(
        "activator_queue_wait_seconds", "Arrival to slot, of the requests that got one", labels=s
    )
    queued = _gauge("activator_queued", "Requests waiting for a slot", s)
    in_flight = _gauge("activator_in_flight", "Requests holding a slot", s)
    tunnels = _gauge("activator_tunnels", "Open upgraded connections (WebSockets), each holding a slot", s)
    capacity = _gauge("activator_capacity", "Usable slots: healthy pods' slots owned here", s)
    oldest = _gauge("activator_oldest_wait_seconds", "How long the oldest waiter has waited", s)
    pods = _gauge("activator_pods", "Pods per state", [*s, "state"])
    class_queued = _gauge("activator_class_queued", "Requests waiting for a slot, per priority class", [*s, "class"])
    class_oldest = _gauge(
        "activator_class_oldest_wait_seconds",
        "How long the oldest waiter of a priority class has waited",
        [*s, "class"],
    )
    class_shed = _counter(
        "activator_class_shed", "Waiters of a priority class shed from a full queue for a higher class", [*s, "class"]
    )
    tenants = _gauge("activator_tenants", "Tenants (fair_by) with requests waiting", s)
    transitions = _counter("activator_pod_transitions", "Pod state changes, by the new state", [*s, "state"])
    pod_families = _PodFamilies()
    for name, service in status.get("services", {}).items():
        labels = [name]
        totals = service.get("totals", {})
        requests.add_metric(labels, totals.get("requests", 0))
        for cls in CLASSES:
            responses.add_metric([name, cls], totals.get("responses", {}).get(cls, 0))
        for reason, count in totals.get("rejected", {}).items():
            rejected.add_metric([name, reason], count)
        bytes_in.add_metric(labels, totals.get("bytes_in", 0))
        bytes_out.add_metric(labels, totals.get("bytes_out", 0))
        _histogram(latency, labels, service.get("latency_seconds"))
        _histogram(queue_wait, labels, service.get("queue_wait_seconds"))
        queued.add_metric(labels, service["queued"])
        in_flight.add_metric(labels, service["in_flight"])
        tunnels.add_metric(labels, service.get("tunnels", 0))
        if service.get("capacity") is not None:
            capacity.add_metric(labels, service["capacity"])
        oldest.add_metric(labels, service.get("oldest_wait_seconds", 0))
        for klass, seen in service.get("classes", {}).items():
            class_queued.add_metric([name, klass], seen["queued"])
            class_oldest.add_metric([name, klass], seen["oldest_wait_seconds"])
            class_shed.add_metric([name, klass], seen["shed"])
        if "tenants" in service:
            tenants.add_metric(labels, service["tenants"])
        per_state = dict.fromkeys(STATES, 0)
        for state, count in (dict.fromkeys(STATES, 0) | totals.get("pod_transitions", {})).items():
            transitions.add_metric([name, state], count)
        for pod in service.get("pods", ()):
            for state in pod_families.add(name, pod):
                per_state[state] = per_state.get(state, 0) + 1
        for state, count in per_state.items():
            pods.add_metric([name, state], count)
    yield from (requests, responses, rejected, bytes_in, bytes_out, latency, queue_wait)
    yield from (queued, in_flight, tunnels, capacity, oldest, pods, transitions)
    yield from (class_queued, class_oldest, class_shed, tenants)
    yield from _launch_families(status.get("services", {}))
    yield from pod_families


#: The ``launch`` section's gauges and counters (``activator_launch_*``), with their help.
_LAUNCH_GAUGES = (
    ("desired", "Launched pods the autoscaler wants running"),
    ("running", "Pods this activator started that are ready"),
    ("starting", "Pods this activator started that are not ready yet"),
)
_LAUNCH_COUNTERS = (
    ("started", "started", "Pods this activator started"),
    ("stopped", "stopped", "Pods this activator stopped (or that ended)"),
    ("failed", "failed", "Launches that failed (exited before ready, or not ready within cold_start_timeout)"),
    ("cold_starts", "cold_starts", "Cold starts that ended with the pod ready"),
    ("cold_start_seconds", "cold_start_seconds_total", "Time from start to ready, summed over the cold starts"),
)


def _launch_families(services: Mapping[str, Any]) -> Iterator[Metric]:
    """``activator_launch_*`` of the launched services (their ``launch`` section)."""
    s = ["service"]
    gauges = [(key, _gauge(f"activator_launch_{key}", doc, s)) for key, doc in _LAUNCH_GAUGES]
    counters = [(field, _counter(f"activator_launch_{name}", doc, s)) for name, field, doc in _LAUNCH_COUNTERS]
    for name, service in services.items():
        launch = service.get("launch")
        if launch is not None:
            for key, gauge in gauges:
                gauge.add_metric([name], launch[key])
            for key, counter in counters:
                counter.add_metric([name], launch[key])
    yield from (family for _, family in gauges)
    yield from (family for _, family in counters)


class _PodFamilies:
    """The per-pod families, filled one pod at a time."""

    def __init__(self) -> None:
        sp = ["service", "pod"]
        self.state = _gauge("activator_pod_state", "1 for the pod's current state, 0 for the others", [*sp, "state"])
        self.in_flight = _gauge("activator_pod_in_flight", "Requests holding a slot on the pod", sp)
        self.peak = _gauge(
            "activator_pod_peak_in_flight", "The most requests the pod held at once, since it was first listed here", sp
        )
        self.window_peak = _gauge(
            "activator_pod_peak_in_flight_window",
            "The most requests the pod held at once over the history kept (the last 15 minutes)",
            sp,
        )
        self.slots = _gauge("activator_pod_slots", "The pod's slots owned here (absent: unlimited)", sp)
        self.load = _gauge("activator_pod_load", "The load the pod announced (absent: nothing announced)", sp)
        self.announced = _gauge(
            "activator_pod_announced_concurrency",
            "The concurrency the pod announced, bounded by container_concurrency (absent: none)",
            sp,
        )
        self.requests = _counter("activator_pod_requests", "Requests sent to the pod (slots granted)", sp)
        self.responses = _counter(
            "activator_pod_responses", "Answers of the requests sent to the pod, by class", [*sp, "class"]
        )
        self.retries = _counter(
            "activator_pod_retries", "Requests whose connection to the pod failed, retried on another pod", sp
        )
        self.pod_time = SummaryMetricFamily(
            "activator_pod_response_duration_seconds", "Request sent to the pod to its last byte", labels=sp
        )
        self.state_seconds = _counter(
            "activator_pod_state_seconds",
            "Seconds the pod spent in each state since it was first listed",
            [*sp, "state"],
        )
        self.streak = _gauge("activator_pod_consecutive_failures", "Transport failures in a row on the pod", sp)
        self.failures = {
            kind: _counter(f"activator_pod_{kind}", f"Transport failures on the pod: {kind.replace('_', ' ')}", sp)
            for kind in _FAILURE_KINDS
        }

    def add(self, service: str, pod: Mapping[str, Any]) -> set[str]:
        """Add one pod of ``service``; the states it is in (several, when workers disagree)."""
        on_pod = [service, pod["address"]]
        states = set(pod["state"].split("/"))
        for state in sorted(states | set(STATES)):
            self.state.add_metric([*on_pod, state], 1 if state in states else 0)
        self.in_flight.add_metric(on_pod, pod["in_flight"])
        self.peak.add_metric(on_pod, pod.get("peak_in_flight", 0))
        self.window_peak.add_metric(on_pod, pod.get("peak_in_flight_window", 0))
        if pod.get("slots") is not None:
            self.slots.add_metric(on_pod, pod["slots"])
        if pod.get("load") is not None:
            self.load.add_metric(on_pod, pod["load"])
        if pod.get("announced_concurrency") is not None:
            self.announced.add_metric(on_pod, pod["announced_concurrency"])
        self.requests.add_metric(on_pod, pod.get("requests", 0))
        for cls in CLASSES:
            self.responses.add_metric([*on_pod, cls], pod.get("responses", {}).get(cls, 0))
        self.retries.add_metric(on_pod, pod.get("retries", 0))
        timed = pod.get("pod_time_seconds", {})
        self.pod_time.add_metric(on_pod, count_value=timed.get("count", 0), sum_value=timed.get("sum", 0.0))
        spent = pod.get("seconds_by_state", {})
        for state in STATES:
            self.state_seconds.add_metric([*on_pod, state], spent.get(state, 0.0))
        self.streak.add_metric(on_pod, pod.get("failures", 0))
        by_kind = dict.fromkeys(_FAILURE_KINDS, 0)
        for key, count in pod.get("transport_failures", {}).items():
            kind = key.split(".")[0]
            by_kind[kind] = by_kind.get(kind, 0) + count
        for kind, family in self.failures.items():
            family.add_metric(on_pod, by_kind[kind])
        return states

    def __iter__(self) -> Iterator[Metric]:
        yield from (self.state, self.in_flight, self.peak, self.window_peak, self.slots, self.load, self.announced)
        yield from (self.requests,)
        yield from (self.responses, self.retries, self.pod_time, self.state_seconds, self.streak)
        yield from self.failures.values()

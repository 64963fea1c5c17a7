"""One activator's status from its workers' statuses (``workers: N``).

Each worker reports its own view of every service (``/status`` of a single process);
the activator's status is their merge, in the same shape: counts (in flight, queued,
tunnels, capacity, slots, requests), totals, rates and histograms are summed, the
oldest wait is the longest of them, a pod's failure streak is the longest of them, its
last probe the most recent, its state is the one every worker sees or, when they
differ, all of them joined with ``/`` (``healthy/pending``), and ``forward_to`` is a
peer only when every worker forwards the service to that peer (a worker forwarding to
a sibling is internal). Reload counts and refusals are summed (only one worker counts
reloads). A pod's peaks in flight are summed: each worker's peak is of its own
requests, so the sum is an upper bound of the activator's (never below it, exact with
one worker), which is what proves a limit held. Its time in each state is the longest
of the workers' (each sees the pod itself). Per priority class, queued and sheds are
summed and the oldest wait is the longest; the tenants with the most queued are summed by
tenant (``merge_queue_view``, which also adds the supervisor's one queue).
"""

from __future__ import annotations

import copy
import heapq
from typing import Any

from .waitqueue import WaitQueue

#: How many of the tenants with the most queued a status shows.
TOP_TENANTS = 5

#: Service fields summed over the workers (numbers, or nested dicts and lists of them).
SUMMED_SERVICE_FIELDS = ("in_flight", "queued", "tunnels", "borrowed", "requests_per_second")
NESTED_SERVICE_FIELDS = ("per_second", "totals", "latency_seconds", "queue_wait_seconds")
#: Pod fields summed over the workers (numbers, or nested dicts of them).
SUMMED_POD_FIELDS = (
    "in_flight",
    "requests",
    "failures_total",
    "requests_per_second",
    "peak_in_flight",
    "peak_in_flight_window",
    "retries",
    "transport_failures",
    "responses",
    "pod_time_seconds",
    "recent_pod_time_seconds",
)
#: What a pod announced (``core.load``), as each worker heard it: the highest is shown.
ANNOUNCED_POD_FIELDS = ("load", "announced_concurrency")


def add_into(into: Any, value: Any) -> Any:
    """``into + value`` for numbers, dicts (key-wise, a missing key counting as 0) and
    lists (element-wise), nested; ``bounds`` lists, the same for every worker, are kept."""
    if isinstance(into, dict) and isinstance(value, dict):
        for key, item in value.items():
            if key == "bounds":
                into.setdefault(key, item)
            elif key in into:
                into[key] = add_into(into[key], item)
            else:
                into[key] = copy.deepcopy(item)
        return into
    if isinstance(into, list) and isinstance(value, list):
        return [add_into(a, b) for a, b in zip(into, value, strict=False)]
    if isinstance(into, int | float) and isinstance(value, int | float):
        total = into + value
        return round(total, 6) if isinstance(total, float) else total
    return into


def _merge_pod(seen: dict[str, Any], pod: dict[str, Any]) -> None:
    seen["states"].append(pod["state"])
    for key in SUMMED_POD_FIELDS:
        if key in pod:
            seen[key] = add_into(seen[key], pod[key]) if key in seen else copy.deepcopy(pod[key])
    seen["failures"] = max(seen["failures"], pod["failures"])
    seen["slots"] = None if seen["slots"] is None or pod["slots"] is None else seen["slots"] + pod["slots"]
    for key in ANNOUNCED_POD_FIELDS:  # each worker hears the pod itself: the highest shown
        mine, theirs = seen.get(key), pod.get(key)
        seen[key] = theirs if mine is None else mine if theirs is None else max(mine, theirs)
    spent = seen.setdefault("seconds_by_state", {})
    for state, seconds in pod.get("seconds_by_state", {}).items():
        spent[state] = max(spent.get(state, 0.0), seconds)
    probe = pod.get("last_probe")
    if probe is not None:
        last = seen.get("last_probe")
        if last is None or probe["seconds_ago"] < last["seconds_ago"]:
            seen["last_probe"] = probe


def queue_view(queue: WaitQueue, classes: list[str] | None, fair: bool, sheds: list[int], now: float) -> dict[str, Any]:
    """A queue's part of a service's status: per class (``classes``: their names, or None
    without priority) its queued, its oldest's wait, its sheds; with tenants (``fair``),
    how many have waiters and the ``TOP_TENANTS`` with the most."""
    shown: dict[str, Any] = {}
    if classes is not None:
        shown["classes"] = {
            name: {
                "queued": queued,
                "oldest_wait_seconds": round(now - oldest, 3) if oldest is not None else 0.0,
                "shed": shed,
            }
            for name, queued, oldest, shed in zip(
                classes, queue.queued_by_class(), queue.oldest_by_class(), sheds, strict=False
            )
        }
    if fair:
        shown["tenants"] = queue.tenants
        shown["top_tenants"] = [
            {"tenant": tenant.decode("latin-1") if isinstance(tenant, bytes) else str(tenant), "queued": n}
            for tenant, n in queue.top_tenants(TOP_TENANTS)
        ]
    return shown


def merge_queue_view(into: dict[str, Any], view: dict[str, Any]) -> None:
    """Add one process's ``queue_view`` (a worker's, or the supervisor's) into ``into``."""
    for name, seen in view.get("classes", {}).items():
        mine = into.setdefault("classes", {}).setdefault(name, {"queued": 0, "oldest_wait_seconds": 0.0, "shed": 0})
        mine["queued"] += seen["queued"]
        mine["shed"] += seen["shed"]
        mine["oldest_wait_seconds"] = max(mine["oldest_wait_seconds"], seen["oldest_wait_seconds"])
    if "top_tenants" in view:
        counts: dict[str, int] = {}
        for entry in [*into.get("top_tenants", []), *view["top_tenants"]]:
            counts[entry["tenant"]] = counts.get(entry["tenant"], 0) + entry["queued"]
        top = heapq.nlargest(TOP_TENANTS, counts.items(), key=lambda item: item[1])
        into["top_tenants"] = [{"tenant": tenant, "queued": n} for tenant, n in top]
        into["tenants"] = into.get("tenants", 0) + view["tenants"]


def _merge_service(into: dict[str, Any] | None, service: dict[str, Any]) -> dict[str, Any]:
    if into is None:
        into = copy.deepcopy(service)
        for key in ("classes", "top_tenants", "tenants"):
            into.pop(key, None)
        into["pods"] = {}
        for key in ("capacity", *SUMMED_SERVICE_FIELDS):
            into[key] = 0
        for key in NESTED_SERVICE_FIELDS:
            into[key] = {}
        into["oldest_wait_seconds"] = 0.0
        into["forward_to"] = None
    for key in SUMMED_SERVICE_FIELDS:
        into[key] = add_into(into[key], service.get(key, 0))
    for key in NESTED_SERVICE_FIELDS:
        into[key] = add_into(into[key], service.get(key, {}))
    into["oldest_wait_seconds"] = max(into["oldest_wait_seconds"], service.get("oldest_wait_seconds", 0.0))
    merge_queue_view(into, service)
    if into["capacity"] is None or service["capacity"] is None:
        into["capacity"] = None
    else:
        into["capacity"] += service["capacity"]
    for pod in service["pods"]:
        seen = into["pods"].get(pod["address"])
        if seen is None:
            seen = {key: value for key, value in pod.items() if key not in SUMMED_POD_FIELDS}
            seen.update(states=[], slots=0, last_probe=None, seconds_by_state={})
            into["pods"][pod["address"]] = seen
        _merge_pod(seen, pod)
    return into


def merge_worker_statuses(statuses: list[dict[str, Any]]) -> dict[str, Any]:
    """One activator's status from its workers' (same shape as a single process's)."""
    merged = copy.deepcopy(statuses[0])
    merged["ready"] = all(s["ready"] for s in statuses)
    merged["worker"] = {"count": len(statuses)}
    merged["workers"] = [{"index": s["worker"]["index"], "ready": s["ready"]} for s in statuses]
    reloads: dict[str, Any] = {}
    for status in statuses:
        reloads = add_into(reloads, status.get("reloads", {}))
    merged["reloads"] = {"ok": 0, "failed": 0, **reloads}
    refused: dict[str, Any] = {}
    for status in statuses:
        refused = add_into(refused, status.get("refused", {}))
    merged["refused"] = refused
    goaways: dict[str, Any] = {}
    for status in statuses:
        goaways = add_into(goaways, status.get("h2_goaway", {}))
    merged["h2_goaway"] = goaways
    services: dict[str, Any] = {}
    for status in statuses:
        for name, service in status["services"].items():
            services[name] = _merge_service(services.get(name), service)
    for name, service in services.items():
        # The activator forwards a service when none of its workers owns a slot of it:
        # every worker then names the same peer (a worker forwarding to a sibling is
        # internal, the activator still serves the service itself).
        forwards = {s["services"][name].get("forward_to") for s in statuses if name in s["services"]}
        if len(forwards) == 1:
            (only,) = forwards
            if isinstance(only, str) and only.startswith("peer "):
                service["forward_to"] = only
        pods = list(service["pods"].values())
        for pod in pods:
            states = sorted(set(pod["states"]))
            pod["state"] = states[0] if len(states) == 1 else "/".join(states)
        service["pods"] = pods
    merged["services"] = services
    return merged

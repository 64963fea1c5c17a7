"""One activator's status from its workers' statuses (``workers: N``).

Each worker reports its own view of every service (``/status`` of a single process);
the activator's status is their merge, in the same shape: counts (in flight, queued,
capacity, slots, requests) are summed, a pod's failure streak is the longest of them,
its state is the one every worker sees or, when they differ, all of them joined with
``/`` (``healthy/pending``), and ``forward_to`` is a peer only when every worker forwards
the service to that peer (a worker forwarding to a sibling is internal). Pure.
"""

from __future__ import annotations

import copy
from typing import Any


def merge_worker_statuses(statuses: list[dict[str, Any]]) -> dict[str, Any]:
    """One activator's status from its workers' (same shape as a single process's)."""
    merged = copy.deepcopy(statuses[0])
    merged["ready"] = all(s["ready"] for s in statuses)
    merged["worker"] = {"count": len(statuses)}
    merged["workers"] = [{"index": s["worker"]["index"], "ready": s["ready"]} for s in statuses]
    services: dict[str, Any] = {}
    for status in statuses:
        for name, service in status["services"].items():
            into = services.get(name)
            if into is None:
                into = services[name] = copy.deepcopy(service)
                into["pods"] = {}
                for key in ("capacity", "in_flight", "queued"):
                    into[key] = 0
                into["forward_to"] = None
            for key in ("in_flight", "queued"):
                into[key] += service[key]
            if into["capacity"] is None or service["capacity"] is None:
                into["capacity"] = None
            else:
                into["capacity"] += service["capacity"]
            for pod in service["pods"]:
                seen = into["pods"].get(pod["address"])
                if seen is None:
                    seen = into["pods"][pod["address"]] = dict(pod, states=[], in_flight=0, slots=0, requests=0)
                seen["states"].append(pod["state"])
                seen["in_flight"] += pod["in_flight"]
                seen["requests"] += pod["requests"]
                seen["failures"] = max(seen["failures"], pod["failures"])
                seen["slots"] = None if seen["slots"] is None or pod["slots"] is None else seen["slots"] + pod["slots"]
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

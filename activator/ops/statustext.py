"""``activator status``'s text: the admin API's ``/status`` as lines for a terminal.

Pure formatting of the JSON document (the same one the page and ``--json`` show): one
header line, the peers, then per service its figures, its classes and tenants, its
launcher, and a table of its pods. Kept apart from ``cli.py``, which patches gevent at
import, so that anything may import it.
"""

from __future__ import annotations

from typing import Any


def _peer_label(name: str, address: str, me: str | None, health: dict[str, Any]) -> str:
    """``vm-b=10.0.0.2:8080 up`` (``(self)`` for this one, the last error when down)."""
    if name == me:
        return f"{name}={address} (self)"
    peer = health.get(name)
    if peer is None:
        return f"{name}={address}"
    error = f" ({peer['last_error']})" if peer["state"] == "down" and peer.get("last_error") else ""
    return f"{name}={address} {peer['state']}{error}"


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"


def format_launch(launch: dict[str, Any]) -> str:
    """A launched service's line: desired and running pods, cold starts, failed launches."""
    cold = launch["cold_starts"]
    mean = f" (mean {_seconds(launch['cold_start_seconds_total'] / cold)})" if cold else ""
    return (
        f"launch: desired={launch['desired']} ({launch['min']}..{launch['max']})  running={launch['running']}"
        f"  starting={launch['starting']}  cold_starts={cold}{mean}  failed={launch['failed']}"
        + ("  PANIC" if launch["panicking"] else "")
    )


def format_status(status: dict[str, Any]) -> str:
    """The terminal table of ``activator status`` (rates: the last ten seconds' average;
    a pod's MAX is its most in flight at once since it was first listed, beside its
    SLOTS: HAProxy's Max and Limit)."""
    lines = []
    config = status["config"]
    lines.append(
        f"activator {status['version']}  config {config['path']}  loaded {config['loaded_at']}"
        f"  {'ready' if status['ready'] else 'NOT READY'}"
    )
    if config["last_error"]:
        lines.append(f"last reload failed: {config['last_error']}")
    peers = status["activator"]["peers"]
    health = status["activator"].get("health") or {}
    if peers:
        lines.append(
            "peers: " + ", ".join(_peer_label(n, a, status["activator"]["self"], health) for n, a in peers.items())
        )
    for name, peer in health.items():
        if name not in peers:
            lines.append(f"left the file, still checked: {name}={peer['address']} {peer['state']}")
    for name, service in status["services"].items():
        capacity = "unlimited" if service["capacity"] is None else service["capacity"]
        lines.append("")
        lines.append(
            f"{name}  cc={service['container_concurrency']} {service['lb_policy']}  capacity={capacity}"
            f"  in_flight={service['in_flight']}  queued={service['queued']}/{service['queue_depth']}"
            f"  oldest_wait={_seconds(service.get('oldest_wait_seconds', 0.0))}"
        )
        lines += _queue_lines(service)
        per_second = service.get("per_second", {})
        lines.append(
            f"  rates (last 10s): {service.get('requests_per_second', 0.0):.1f} req/s"
            f"  5xx {per_second.get('responses', {}).get('5xx', 0.0):.1f}/s"
            f"  rejected {per_second.get('rejected', 0.0):.1f}/s"
        )
        launch = service.get("launch")
        if launch is not None:
            lines.append("  " + format_launch(launch))
        lines.append(
            f"  {'POD':<28} {'STATE':<9} {'IN_FLIGHT':>9} {'MAX':>4} {'SLOTS':>5} {'REQUESTS':>9} {'REQ/S':>7}"
            f" {'5XX':>6} {'FAILURES':>8} {'FAIL_TOTAL':>10}"
        )
        for pod in service["pods"]:
            slots = "inf" if pod["slots"] is None else pod["slots"]
            lines.append(
                f"  {pod['address']:<28} {pod['state']:<9} {pod['in_flight']:>9} {pod.get('peak_in_flight', 0):>4}"
                f" {slots:>5} {pod['requests']:>9} {pod.get('requests_per_second', 0.0):>7.1f}"
                f" {pod.get('responses', {}).get('5xx', 0):>6} {pod['failures']:>8} {pod.get('failures_total', 0):>10}"
            )
            if pod.get("load") is not None or pod.get("announced_concurrency") is not None:
                load, concurrency = pod.get("load"), pod.get("announced_concurrency")
                lines.append(
                    f"    announced: load {'-' if load is None else f'{load:g}'}, concurrency {concurrency or '-'}"
                )
    return "\n".join(lines)


def _queue_lines(service: dict[str, Any]) -> list[str]:
    """Per priority class: queued, the oldest wait, sheds; the tenants with the most queued."""
    lines = []
    classes = service.get("classes")
    if classes:
        lines.append(
            "  classes: "
            + "  ".join(
                f"{name} queued={c['queued']} oldest_wait={_seconds(c['oldest_wait_seconds'])} shed={c['shed']}"
                for name, c in classes.items()
            )
        )
    if "top_tenants" in service:
        top = ", ".join(f"{t['tenant'] or '(none)'}={t['queued']}" for t in service["top_tenants"])
        lines.append(f"  tenants waiting: {service['tenants']}" + (f"  most queued: {top}" if top else ""))
    return lines

"""The admin API, on its own port (never the proxy's): health, readiness, status.

- ``GET /healthz``: 200 while the process runs.
- ``GET /readyz``: 200 when serving; 503 while starting or stopping.
- ``GET /status``: JSON of this activator, its config and every service and pod
  (the names SPEC.md lists are relied on by operators; more fields are welcome).
- ``GET /``: a human status page of the same, refreshing itself.

It reads everything from a ``StatusSource``: a single activator process
(``server.Runtime``) or the supervisor of several workers (``workers.Supervisor``, which
merges its workers' statuses), with the same resources for both.
"""

from __future__ import annotations

import html
import json
from typing import Any, Protocol

import falcon


class StatusSource(Protocol):
    """What the admin API needs of the process it describes."""

    stopping: bool

    def is_serving(self) -> bool:
        """Ready and not stopping (the supervisor asks its workers: it may yield)."""

    def status(self) -> dict[str, Any]: ...


class Health:
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = "text/plain"
        resp.text = "ok\n"


class Ready:
    def __init__(self, source: StatusSource) -> None:
        self.source = source

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        ready = self.source.is_serving()
        resp.status = 200 if ready else 503
        resp.content_type = "text/plain"
        resp.text = "ready\n" if ready else ("stopping\n" if self.source.stopping else "starting\n")


class Status:
    def __init__(self, source: StatusSource) -> None:
        self.source = source

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = "application/json"
        resp.text = json.dumps(self.source.status(), indent=2)


STATE_COLOURS = {"healthy": "#2e7d32", "pending": "#b28704", "draining": "#1565c0", "removed": "#757575"}


def render_page(status: dict[str, Any]) -> str:
    """The human status page: one table per service, states coloured, busy pods marked."""
    esc = html.escape
    config = status["config"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='2'>",
        "<title>activator</title><style>",
        "body{font:14px system-ui,sans-serif;margin:1.5em}table{border-collapse:collapse;margin-bottom:1.5em}",
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#eee}",
        "td.l{text-align:left}.state{color:#fff;border-radius:3px;padding:1px 6px}.busy{background:#fff3e0}",
        ".err{color:#b71c1c}</style></head><body>",
        f"<h1>activator {esc(status['version'])}</h1>",
        f"<p>config <code>{esc(config['path'])}</code> loaded {esc(config['loaded_at'])}"
        f" &middot; {'ready' if status['ready'] else 'NOT READY'}"
        f" &middot; up {status['uptime_seconds']:.0f}s</p>",
    ]
    if config["last_error"]:
        parts.append(f"<p class='err'>last reload failed: {esc(config['last_error'])}</p>")
    peers = status["activator"]["peers"]
    if peers:
        me = status["activator"]["self"]
        parts.append("<p>peers: " + ", ".join(f"<b>{esc(n)}</b>" if n == me else esc(n) for n in peers) + "</p>")
    for name, service in status["services"].items():
        capacity = "unlimited" if service["capacity"] is None else service["capacity"]
        parts.append(
            f"<h2>{esc(name)}</h2><p>hosts {esc(', '.join(service['hosts']))} &middot; cc "
            f"{service['container_concurrency']} &middot; {esc(service['lb_policy'])} &middot; capacity {capacity}"
            f" &middot; in flight {service['in_flight']}"
            f" &middot; queued {service['queued']}/{service['queue_depth']}</p>"
        )
        parts.append(
            "<table><tr><th>pod</th><th>state</th><th>in flight</th><th>slots</th>"
            "<th>requests</th><th>failures</th><th>in state</th></tr>"
        )
        for pod in service["pods"]:
            busy = pod["slots"] is not None and pod["in_flight"] >= max(pod["slots"], 1)
            colour = STATE_COLOURS.get(pod["state"], "#000")
            parts.append(
                f"<tr class='{'busy' if busy else ''}'><td class='l'>{esc(pod['address'])}</td>"
                f"<td class='l'><span class='state' style='background:{colour}'>{esc(pod['state'])}</span></td>"
                f"<td>{pod['in_flight']}</td><td>{'&infin;' if pod['slots'] is None else pod['slots']}</td>"
                f"<td>{pod['requests']}</td><td>{pod['failures']}</td><td>{pod['seconds_in_state']:.0f}s</td></tr>"
            )
        parts.append("</table>")
    parts.append("</body></html>")
    return "".join(parts)


class Page:
    def __init__(self, source: StatusSource) -> None:
        self.source = source

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = "text/html; charset=utf-8"
        resp.text = render_page(self.source.status())


def make_admin_app(source: StatusSource) -> falcon.App[falcon.Request, falcon.Response]:
    app: falcon.App[falcon.Request, falcon.Response] = falcon.App()
    app.add_route("/healthz", Health())
    app.add_route("/readyz", Ready(source))
    app.add_route("/status", Status(source))
    app.add_route("/", Page(source))
    return app

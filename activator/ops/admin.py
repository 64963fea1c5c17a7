"""The admin API, on its own port (never the proxy's): health, readiness, status.

- ``GET /healthz``: 200 while the process runs.
- ``GET /readyz``: 200 when serving; 503 while starting or stopping.
- ``GET /status``: JSON of this activator, its config and every service and pod
  (the names SPEC.md lists are relied on by operators; more fields are welcome).
- ``GET /status/history``: JSON of the last fifteen minutes, one point a second, per
  service and per pod (``history.History.export``); ``?seconds=N`` keeps the last N
  (1..900), ``?pods=0`` leaves out the pods' series.
- ``GET /status.csv``: one row per pod, with its service's columns (``page.status_csv``).
- ``GET /metrics``: the metrics in the Prometheus text format (``prometheus.render``).
- ``GET /``: the human status page, with the history drawn (``page.render_page``),
  refreshing itself.
- ``HEAD`` of each of them answers what ``GET`` would, without the body (monitoring
  checks and ``curl -I`` use it).

It reads everything from a ``StatusSource``: a single activator process
(``server.Runtime``) or the supervisor of several workers (``workers.Supervisor``, which
merges its workers' statuses and histories), with the same resources for both.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import falcon

from . import prometheus
from .history import POINTS
from .page import render_page, status_csv


class StatusSource(Protocol):
    """What the admin API needs of the process it describes."""

    stopping: bool

    def is_serving(self) -> bool:
        """Ready and not stopping (the supervisor asks its workers: it may yield)."""

    def status(self) -> dict[str, Any]: ...

    def history(self, seconds: int, pods: bool) -> dict[str, Any]:
        """The last ``seconds`` of the history, with the pods' series when ``pods``."""


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


class History:
    def __init__(self, source: StatusSource) -> None:
        self.source = source

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        seconds = req.get_param_as_int("seconds", min_value=1, max_value=POINTS, default=POINTS)
        pods = req.get_param_as_bool("pods", default=True)
        resp.content_type = "application/json"
        resp.text = json.dumps(self.source.history(seconds, pods), separators=(",", ":"))


class Csv:
    def __init__(self, source: StatusSource) -> None:
        self.source = source

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = "text/csv; charset=utf-8"
        resp.text = status_csv(self.source.status())


class Metrics:
    def __init__(self, source: StatusSource) -> None:
        self.source = source

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = prometheus.CONTENT_TYPE
        resp.data = prometheus.render(self.source.status())


class Page:
    def __init__(self, source: StatusSource) -> None:
        self.source = source

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = "text/html; charset=utf-8"
        resp.text = render_page(self.source.status(), self.source.history(POINTS, False))


def make_admin_app(source: StatusSource) -> falcon.App[falcon.Request, falcon.Response]:
    app: falcon.App[falcon.Request, falcon.Response] = falcon.App()
    resources: dict[str, Any] = {
        "/healthz": Health(),
        "/readyz": Ready(source),
        "/status": Status(source),
        "/status/history": History(source),
        "/status.csv": Csv(source),
        "/metrics": Metrics(source),
        "/": Page(source),
    }
    for path, resource in resources.items():
        # HEAD: the GET answer's head (Falcon sends no body for HEAD, and keeps its length).
        resource.on_head = resource.on_get
        app.add_route(path, resource)
    return app

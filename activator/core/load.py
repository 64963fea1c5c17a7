"""The load a pod announces: ORCA's ``endpoint-load-metrics`` header, read into figures.

What this module decides:

- **What a header says** (``parse_orca``): ORCA's TEXT form
  (``TEXT cpu_utilization=0.3, rps_fractional=10, named_metrics.queue=2``) and JSON form
  (``JSON {"cpu_utilization": 0.3, "named_metrics": {"queue": 2}}``) become one flat
  mapping of metric name to value (nested JSON objects named ``named_metrics.queue``).
  Anything else (the binary form, a value that is not a finite number >= 0, a header
  longer than ``MAX_HEADER_BYTES``, more than ``MAX_METRICS`` metrics) is garbage and
  says nothing: ``None``, quietly (a pod's bad header must not cost a log line per
  response).
- **The figure** (``LoadReading.of``): the one metric the service's ``load.metric``
  names (by default ``cpu_utilization``) is the figure ``lb_policy: least-loaded``
  compares; the named metric ``max_concurrency`` (``ANNOUNCED_CONCURRENCY``), if
  present, is the concurrency the pod announces.
- **Never above cc** (``announced_limit``): an announced concurrency only ever lowers a
  pod's limit: ``min(announced, container_concurrency)``, and never below 1 (a pod that
  announces 0 still gets one request, or it could never announce anything again). With
  ``container_concurrency: 0`` (no limit) an announced concurrency is ignored.

Pure: no I/O, nothing yields.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

#: The response header a pod announces its load in (ORCA's name).
ORCA_HEADER = b"endpoint-load-metrics"
#: The ORCA metric that is the default figure.
DEFAULT_METRIC = "cpu_utilization"
#: The named metric a pod announces its own concurrency with.
ANNOUNCED_CONCURRENCY = "named_metrics.max_concurrency"
#: A longer header is not read (it is a bug or an attack, not a load report).
MAX_HEADER_BYTES = 4096
#: At most this many metrics in one header.
MAX_METRICS = 64
#: A value above this is garbage, not load (it keeps figures well inside float range).
MAX_VALUE = 1e12


@dataclass(frozen=True)
class LoadReading:
    """What one report says about a pod: its figure and announced concurrency (either
    may be None: not announced)."""

    figure: float | None
    concurrency: int | None

    @classmethod
    def of(cls, metrics: dict[str, float], metric: str) -> LoadReading:
        """The reading in ``metrics`` (as ``parse_orca`` returns) for the figure ``metric``."""
        announced = metrics.get(ANNOUNCED_CONCURRENCY)
        return cls(metrics.get(metric), None if announced is None else int(announced))


def _value(raw: object) -> float | None:
    """A metric's value: a finite number in [0, MAX_VALUE], else None."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    if not math.isfinite(value) or not 0 <= value <= MAX_VALUE:
        return None
    return value


def _parse_text(body: str) -> dict[str, float] | None:
    metrics: dict[str, float] = {}
    for item in body.split(","):
        name, equals, raw = item.partition("=")
        name = name.strip()
        value = _value(raw.strip())
        if not equals or not name or value is None or not name.replace(".", "").replace("_", "").isalnum():
            return None
        metrics[name] = value
    return metrics


def _parse_json(body: str) -> dict[str, float] | None:
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    metrics: dict[str, float] = {}
    for name, raw in document.items():
        if isinstance(raw, dict):
            for inner, inner_raw in raw.items():
                value = _value(inner_raw)
                if value is None:
                    return None
                metrics[f"{name}.{inner}"] = value
            continue
        value = _value(raw)
        if value is None:
            return None
        metrics[name] = value
    return metrics


def parse_orca(header: bytes) -> dict[str, float] | None:
    """ORCA's ``endpoint-load-metrics`` value (TEXT or JSON form) as metric -> value;
    None for garbage (see the module docstring)."""
    if len(header) > MAX_HEADER_BYTES:
        return None
    try:
        text = header.decode("ascii").strip()
    except UnicodeDecodeError:
        return None
    form, _, body = text.partition(" ")
    if form == "TEXT":
        metrics = _parse_text(body)
    elif form == "JSON":
        metrics = _parse_json(body)
    else:
        return None
    if metrics is None or not metrics or len(metrics) > MAX_METRICS:
        return None
    return metrics


def announced_limit(announced: int | None, container_concurrency: int) -> int | None:
    """The limit a pod's announced concurrency sets: None (no limit of its own), or
    ``min(announced, container_concurrency)``, at least 1. Never above cc; ignored at
    cc 0 (see the module docstring)."""
    if announced is None or container_concurrency == 0:
        return None
    return max(1, min(announced, container_concurrency))


def reading_in_head(
    headers: Sequence[tuple[bytes, bytes]], lower_names: Sequence[bytes], metric: str
) -> LoadReading | None:
    """What a response head announces (its first ``endpoint-load-metrics`` line), or None:
    no such line, or garbage."""
    for index, name in enumerate(lower_names):
        if name == ORCA_HEADER:
            metrics = parse_orca(headers[index][1])
            return None if metrics is None else LoadReading.of(metrics, metric)
    return None


def is_news(figure: float | None, announced: int | None, reading: LoadReading, container_concurrency: int) -> bool:
    """Whether ``reading`` changes what a pod's tracker holds (its ``figure`` and
    ``announced`` limit): only news is posted to the topology writer."""
    return figure != reading.figure or announced != announced_limit(reading.concurrency, container_concurrency)

"""StatsD metrics (placeholder until the metrics issue lands: no sink configured)."""

from __future__ import annotations

from .core.config import StatsdConfig
from .core.topology import Topology
from .observe import MetricsSink, NoMetrics


def make_metrics(config: StatsdConfig | None, topology: Topology) -> MetricsSink:
    return NoMetrics()

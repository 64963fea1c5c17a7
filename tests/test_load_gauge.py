"""The load gauge read from a pod's Prometheus text (``pods.prober.gauge_in``): tables."""

from __future__ import annotations

import pytest

from activator.pods.prober import gauge_in

VLLM = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 3.0
vllm:num_requests_waiting{model_name="b"} 2.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 7.0
"""


@pytest.mark.parametrize(
    ("text", "metric", "figure"),
    [
        (VLLM, "vllm:num_requests_waiting", 5.0),  # one sample per label set: summed
        (VLLM, "vllm:num_requests_running", 7.0),
        (VLLM, "vllm:absent", None),
        ("queue 0\n", "queue", 0.0),
        ("queue -1\n", "queue", None),  # not a load
        ("queue NaN\n", "queue", None),
        ("queue +Inf\n", "queue", None),
        ("queue{ 1\n", "queue", None),  # does not parse
        ("", "queue", None),
    ],
)
def test_gauge_in(text: str, metric: str, figure: float | None) -> None:
    assert gauge_in(text, metric) == figure

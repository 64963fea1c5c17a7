"""``launch:`` in the config model: defaults, and each bad value named by its key path."""

from __future__ import annotations

from typing import Any

import pytest

from activator.core.config import LaunchConfig, diff_configs, fill_launch_template, parse_config
from activator.core.errors import ConfigError

PODS = ["127.0.0.1:9001", "127.0.0.1:9002", {"address": "127.0.0.1:9003", "drain": True}]


def parse(launch: object, *, workers: int = 1, probe: object = None, pods: list[Any] = PODS) -> Any:
    body = {"hosts": ["api"], "pods": pods, "launch": launch, "probe": probe or {"path": "/healthz"}}
    return parse_config({"workers": workers, "services": {"api": body}}, filename="t.yaml", line_of=lambda p: None)


def test_defaults_follow_the_spec_and_the_panic_window_is_a_tenth_of_the_stable_one() -> None:
    launch = parse({"command": ["model", "--port", "{port}"]}).services["api"].launch
    assert launch == LaunchConfig(command=("model", "--port", "{port}"))
    assert (launch.min, launch.max, launch.target_concurrency, launch.stable_window) == (0, None, 1.0, 60.0)
    assert (launch.panic_window, launch.scale_to_zero_after, launch.cold_start_timeout) == (6.0, 600.0, 300.0)
    assert launch.stop_pods_on_exit is False
    short = parse({"command": ["m"], "stable_window": "2s"}).services["api"].launch
    assert short.panic_window == pytest.approx(0.2)


def test_every_key() -> None:
    launch = (
        parse(
            {
                "systemd_unit": "model@{port}.service",
                "min": 1,
                "max": 2,
                "target_concurrency": 2.5,
                "stable_window": "10s",
                "panic_window": "1s",
                "scale_to_zero_after": "1m",
                "cold_start_timeout": "30s",
                "stop_pods_on_exit": True,
            }
        )
        .services["api"]
        .launch
    )
    assert launch == LaunchConfig(None, "model@{port}.service", 1, 2, 2.5, 10.0, 1.0, 60.0, 30.0, True)
    assert fill_launch_template(launch.systemd_unit, "127.0.0.1", 9001) == "model@9001.service"


@pytest.mark.parametrize(
    ("launch", "key", "fragment"),
    [
        ({}, "services.api.launch", "command or systemd_unit"),
        ({"command": ["m"], "systemd_unit": "m@{port}.service"}, "services.api.launch", "exactly one"),
        ({"command": []}, "services.api.launch.command", "non-empty list"),
        ({"command": "model --port {port}"}, "services.api.launch.command", "non-empty list"),
        ({"command": ["m", "{pod}"]}, "services.api.launch.command[1]", "only {host} and {port}"),
        ({"command": ["m", None]}, "services.api.launch.command[1]", "must be a string"),
        ({"systemd_unit": "model.service"}, "services.api.launch.systemd_unit", "its own unit"),
        ({"systemd_unit": "model@{port}"}, "services.api.launch.systemd_unit", "ending in .service"),
        ({"systemd_unit": "a b@{port}.service"}, "services.api.launch.systemd_unit", "ending in .service"),
        ({"command": ["m"], "min": 3}, "services.api.launch.min", "at most the 2 listed pods"),
        ({"command": ["m"], "min": 2, "max": 1}, "services.api.launch.max", "at least min"),
        ({"command": ["m"], "max": 0}, "services.api.launch.max", ">= 1"),
        ({"command": ["m"], "target_concurrency": 0}, "services.api.launch.target_concurrency", "above 0"),
        ({"command": ["m"], "panic_window": "2m"}, "services.api.launch.panic_window", "stable_window"),
        ({"command": ["m"], "cold_start_timeout": 0}, "services.api.launch.cold_start_timeout", "greater than 0"),
        ({"command": ["m"], "stop_pods_on_exit": "yes"}, "services.api.launch.stop_pods_on_exit", "true or false"),
        ({"command": ["m"], "maximum": 2}, "services.api.launch.maximum", "did you mean max"),
    ],
)
def test_bad_values_name_their_key(launch: object, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(launch)
    assert caught.value.key == key
    assert fragment in str(caught.value)


def test_launch_needs_a_probe_and_one_worker() -> None:
    body = {"hosts": ["api"], "pods": PODS, "launch": {"command": ["m"]}}
    with pytest.raises(ConfigError, match="needs a probe") as caught:
        parse_config({"services": {"api": body}}, filename="t.yaml", line_of=lambda p: None)
    assert caught.value.key == "services.api.launch"
    with pytest.raises(ConfigError, match="workers: 1") as caught:
        parse({"command": ["m"]}, workers=2)
    assert caught.value.key == "services.api.launch"


def test_a_changed_launcher_is_a_live_change_of_the_service() -> None:
    old = parse({"command": ["m", "{port}"]})
    new = parse({"command": ["m", "{port}"], "max": 1})
    diff = diff_configs(old, new)
    assert [c.describe() for c in diff.services[0].changes] == ["launch.max null -> 1"]
    assert not diff.restart_needed

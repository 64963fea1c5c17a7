"""The load pods announce: ORCA's header read into figures (tables), ``least-loaded``
(tables on fake pods and in the throttler), and the ceiling: whatever the pods announce,
no pod ever runs more than container_concurrency (a hypothesis property)."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

import pytest
from builders import svc
from hypothesis import given, settings
from hypothesis import strategies as st

from activator.core.config import LoadConfig, ServiceConfig, describe_config, parse_config
from activator.core.errors import ConfigError, QueueFull
from activator.core.lb import FirstAvailable, LeastLoaded, RoundRobin, make_policy, policy_matches
from activator.core.load import (
    MAX_HEADER_BYTES,
    LoadReading,
    announced_limit,
    is_news,
    parse_orca,
    reading_in_head,
)
from activator.core.throttler import Grant, ServiceThrottler, Waiter

A, B, C = (f"10.0.0.{i}:8000" for i in range(1, 4))
ORCA = LoadConfig()

# -- the load key -----------------------------------------------------------------------


def service(**keys: Any) -> ServiceConfig:
    body = {"hosts": ["api.example.com"], "pods": ["10.0.1.5:8000"], **keys}
    return parse_config({"services": {"api": body}}, filename="t.yaml", line_of=lambda path: None).services["api"]


PROBED = {"probe": {"path": "/healthz"}}


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({}, None),
        ({"load": {"from": "orca"}}, LoadConfig("cpu_utilization")),
        ({"load": {"from": "orca", "metric": "named_metrics.queue"}}, LoadConfig("named_metrics.queue")),
        (
            {"load": {"from": {"path": "/stats", "metric": "vllm:num_requests_waiting"}}, **PROBED},
            LoadConfig("vllm:num_requests_waiting", "/stats"),
        ),
        ({"load": {"from": {"metric": "queue"}}, **PROBED}, LoadConfig("queue", "/metrics")),
    ],
)
def test_load_settings(keys: dict[str, Any], expected: LoadConfig | None) -> None:
    assert service(**keys).load == expected


@pytest.mark.parametrize(
    ("keys", "key", "fragment"),
    [
        ({"load": {}}, "services.api.load.from", "required"),
        ({"load": {"from": "header"}}, "services.api.load.from", "orca or {path: /metrics, metric: NAME}"),
        ({"load": {"from": "orca", "metric": "a b"}}, "services.api.load.metric", "an ORCA metric name"),
        ({"load": {"from": "orca", "typo": 1}}, "services.api.load.typo", "unknown key"),
        ({"load": {"from": {"path": "/metrics"}}, **PROBED}, "services.api.load.from.metric", "required"),
        ({"load": {"from": {"metric": "q", "path": "metrics"}}, **PROBED}, "services.api.load.from.path", "URL path"),
        ({"load": {"from": {"metric": "q"}, "metric": "q"}, **PROBED}, "services.api.load.metric", "goes in from"),
        ({"load": {"from": {"metric": "q"}}}, "services.api.load", "needs probe"),
        ({"lb_policy": "least-loaded"}, "services.api.lb_policy", "least-loaded needs load"),
    ],
)
def test_invalid_load_settings_name_their_key(keys: dict[str, Any], key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        service(**keys)
    assert caught.value.key == key
    assert fragment in caught.value.detail


def test_check_shows_where_the_load_comes_from() -> None:
    shown = describe_config(
        parse_config(
            {"services": {"api": {"hosts": ["a"], "lb_policy": "least-loaded", "load": {"from": "orca"}}}},
            filename="t.yaml",
            line_of=lambda path: None,
        )
    )
    assert "lb_policy least-loaded" in shown
    assert "load: cpu_utilization from the endpoint-load-metrics header (ORCA)" in shown


# -- parse_orca ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (b"TEXT cpu_utilization=0.3", {"cpu_utilization": 0.3}),
        (
            b"TEXT cpu_utilization=0.3, rps_fractional=10, named_metrics.queue=2",
            {"cpu_utilization": 0.3, "rps_fractional": 10.0, "named_metrics.queue": 2.0},
        ),
        (b"  TEXT named_metrics.max_concurrency=1  ", {"named_metrics.max_concurrency": 1.0}),
        (
            b'JSON {"cpu_utilization":0.3,"named_metrics":{"queue":2}}',
            {"cpu_utilization": 0.3, "named_metrics.queue": 2.0},
        ),
        (b'JSON {"rps_fractional": 7}', {"rps_fractional": 7.0}),
    ],
)
def test_orca_text_and_json_forms(header: bytes, expected: dict[str, float]) -> None:
    assert parse_orca(header) == expected


@pytest.mark.parametrize(
    "header",
    [
        b"",
        b"TEXT",
        b"TEXT ",
        b"BIN CgkJAAAAAAAA4D8=",  # the binary form is not read
        b"text cpu_utilization=0.3",  # the form is case-sensitive, as ORCA writes it
        b"TEXT cpu_utilization",
        b"TEXT cpu_utilization=",
        b"TEXT cpu_utilization=abc",
        b"TEXT cpu_utilization=-1",
        b"TEXT cpu_utilization=nan",
        b"TEXT cpu_utilization=inf",
        b"TEXT cpu_utilization=1e300",
        b"TEXT =3",
        b"TEXT a b=3",
        b"TEXT cpu_utilization=0.3,,",
        b"JSON",
        b"JSON {",
        b"JSON [1, 2]",
        b"JSON {}",
        b'JSON {"cpu_utilization": "high"}',
        b'JSON {"cpu_utilization": true}',
        b'JSON {"named_metrics": {"queue": {"deeper": 1}}}',
        b"TEXT cpu_utilization=\xff",
        b"TEXT " + b",".join(b"m%d=1" % i for i in range(65)),  # too many metrics
        b"TEXT cpu_utilization=0." + b"1" * MAX_HEADER_BYTES,  # too long
    ],
)
def test_garbage_says_nothing(header: bytes) -> None:
    assert parse_orca(header) is None


@given(st.binary(max_size=300))
def test_any_bytes_parse_to_none_or_finite_non_negative_values(header: bytes) -> None:
    metrics = parse_orca(header)
    assert metrics is None or all(0 <= value < float("inf") for value in metrics.values())


def test_the_reading_is_the_configured_metric_and_max_concurrency() -> None:
    metrics = parse_orca(b"TEXT cpu_utilization=0.5, named_metrics.queue=4, named_metrics.max_concurrency=2.7")
    assert metrics is not None
    assert LoadReading.of(metrics, "cpu_utilization") == LoadReading(0.5, 2)
    assert LoadReading.of(metrics, "named_metrics.queue") == LoadReading(4.0, 2)
    assert LoadReading.of(metrics, "rps_fractional") == LoadReading(None, 2)
    assert LoadReading.of({"cpu_utilization": 0.1}, "cpu_utilization") == LoadReading(0.1, None)


def test_a_head_announces_in_its_first_orca_line() -> None:
    headers = [
        (b"X-Pod", b"a"),
        (b"Endpoint-Load-Metrics", b"TEXT cpu_utilization=0.2"),
        (b"endpoint-load-metrics", b"x"),
    ]
    lower = [name.lower() for name, _ in headers]
    assert reading_in_head(headers, lower, "cpu_utilization") == LoadReading(0.2, None)
    assert reading_in_head(headers[:1], lower[:1], "cpu_utilization") is None  # none: nothing
    assert reading_in_head(headers[2:], lower[2:], "cpu_utilization") is None  # garbage: nothing


@pytest.mark.parametrize(
    ("held", "reading", "news"),
    [
        ((None, None), LoadReading(None, None), False),
        ((0.5, None), LoadReading(0.5, None), False),
        ((0.5, None), LoadReading(0.6, None), True),
        ((0.5, 2), LoadReading(0.5, 10), False),  # 10 at cc 2 is 2: what is held
        ((0.5, 2), LoadReading(0.5, 1), True),
        ((0.5, 1), LoadReading(0.5, None), True),
    ],
)
def test_only_news_is_posted(held: tuple[float | None, int | None], reading: LoadReading, news: bool) -> None:
    assert is_news(*held, reading, 2) is news


@pytest.mark.parametrize(
    ("announced", "cc", "limit"),
    [
        (None, 3, None),
        (1, 3, 1),
        (3, 3, 3),
        (10, 2, 2),  # never above cc
        (0, 3, 1),  # never below 1
        (5, 0, None),  # cc 0: no limit to lower
    ],
)
def test_announced_limit(announced: int | None, cc: int, limit: int | None) -> None:
    assert announced_limit(announced, cc) == limit


# -- the policy, on fake pods -----------------------------------------------------------


@dataclass(eq=False)
class Pod:
    address: str
    rank: int
    in_flight: int = 0
    load: float | None = None


def least_loaded() -> LeastLoaded:
    policy = make_policy("least-loaded", 1)
    assert isinstance(policy, LeastLoaded)
    return policy


def test_least_loaded_picks_the_lowest_figure_ties_by_rank() -> None:
    a, b, c = Pod(A, 0, load=0.5), Pod(B, 1, load=0.2), Pod(C, 2, load=0.2)
    policy = least_loaded()
    for p in (a, b, c):
        policy.add(p)
    assert policy.pick() is b
    policy.discard(b)
    assert policy.pick() is c
    policy.discard(c)
    assert policy.pick() is a
    assert len(policy) == 1 and a in policy and b not in policy


def test_least_loaded_follows_a_changed_figure() -> None:
    a, b = Pod(A, 0, load=0.1), Pod(B, 1, load=0.2)
    policy = least_loaded()
    policy.add(a)
    policy.add(b)
    assert policy.pick() is a
    a.load = 0.9
    policy.add(a)  # the throttler re-adds a pod whose figure changed
    assert policy.pick() is b
    assert len(policy) == 2


def test_a_pod_that_announced_nothing_is_picked_first_by_autos_choice() -> None:
    announced, silent_late, silent_early = Pod(A, 0, load=0.0), Pod(B, 2), Pod(C, 1)
    policy = least_loaded()
    for p in (announced, silent_late, silent_early):
        policy.add(p)
    assert policy.pick() is silent_early  # cc 1: auto is first-available among the silent
    silent_early.load = 0.5
    policy.add(silent_early)
    assert policy.pick() is silent_late
    policy.discard(silent_late)
    assert policy.pick() is announced
    announced.load = None  # a pod that stops announcing goes back to the silent
    policy.add(announced)
    assert policy.pick() is announced and len(policy) == 2


def test_least_loaded_heap_stays_bounded() -> None:
    a, b = Pod(A, 0, load=0.0), Pod(B, 1, load=0.0)
    policy = least_loaded()
    policy.add(b)
    for i in range(1000):
        a.load = float(i % 7)
        policy.add(a)
    assert len(policy._heap) <= 2 * 2 + 16 + 1
    assert policy.pick() in (a, b)


def test_a_reload_that_changes_autos_part_makes_a_new_policy() -> None:
    policy = make_policy("least-loaded", 1)
    assert policy_matches(policy, "least-loaded", 3)
    assert not policy_matches(policy, "least-loaded", 4)  # among the silent: round-robin now
    assert not policy_matches(policy, "first-available", 1)
    assert policy_matches(FirstAvailable(), "auto", 2) and not policy_matches(RoundRobin(), "auto", 2)


# -- in the throttler -------------------------------------------------------------------


def make(cc: int, *pods: str) -> ServiceThrottler:
    throttler = ServiceThrottler(svc(*pods, cc=cc, lb_policy="least-loaded", load=ORCA), 0.0, rng=random.Random(0))
    throttler.check_invariants()
    return throttler


def grant(throttler: ServiceThrottler) -> Grant:
    result = throttler.acquire(0.0)
    throttler.check_invariants()
    assert isinstance(result, Grant), result
    return result


def test_least_loaded_sends_to_the_less_loaded_pod() -> None:
    throttler = make(2, A, B)
    throttler.load_report(A, 0.9, None, 0.0)
    throttler.load_report(B, 0.1, None, 0.0)
    throttler.check_invariants()
    assert [grant(throttler).pod.address for _ in range(3)] == [B, B, A]


def test_an_announced_concurrency_lowers_the_limit_and_capacity() -> None:
    throttler = make(3, A)
    assert throttler.capacity == 3
    throttler.load_report(A, None, 1, 0.0)
    assert throttler.capacity == 1
    first = grant(throttler)
    assert isinstance(throttler.acquire(0.0), Waiter)  # the pod asked for 1 at once
    throttler.check_invariants()
    pod = throttler.snapshot(0.0)["pods"][0]
    assert (pod["load"], pod["announced_concurrency"], pod["slots"]) == (None, 1, 3)
    effects = throttler.load_report(A, None, 2, 0.0)  # raised again: the waiter gets it
    throttler.check_invariants()
    assert len(effects.woken) == 1 and effects.woken[0].grant is not None
    throttler.release(first, 0.0)
    throttler.release(effects.woken[0].grant, 0.0)
    throttler.check_invariants()


def test_an_announced_concurrency_above_cc_is_not_trusted() -> None:
    throttler = make(2, A)
    throttler.load_report(A, 0.0, 10, 0.0)
    assert throttler.capacity == 2
    grant(throttler)
    grant(throttler)
    assert isinstance(throttler.acquire(0.0), Waiter)
    throttler.check_invariants()


def test_lowering_cuts_nothing_that_runs() -> None:
    throttler = make(3, A)
    grants = [grant(throttler) for _ in range(3)]
    throttler.load_report(A, None, 1, 0.0)
    throttler.check_invariants()
    throttler.release(grants[0], 0.0)
    throttler.release(grants[1], 0.0)
    assert isinstance(throttler.acquire(0.0), Waiter)  # 1 runs: at its announced 1
    throttler.check_invariants()


def test_a_report_on_an_unknown_pod_or_the_same_report_changes_nothing() -> None:
    throttler = make(1, A)
    assert not throttler.load_report(B, 0.5, 1, 0.0)
    throttler.load_report(A, 0.5, 1, 0.0)
    assert not throttler.load_report(A, 0.5, 1, 0.0)
    throttler.check_invariants()


def test_a_reload_that_changes_load_forgets_what_was_announced() -> None:
    throttler = make(3, A)
    throttler.load_report(A, 0.5, 1, 0.0)
    throttler.apply(replace(throttler.config, lb_policy="auto", queue_depth=5), 0.0)  # load kept
    assert (throttler.trackers[A].load, throttler.capacity) == (0.5, 1)
    throttler.apply(replace(throttler.config, load=None), 0.0)
    throttler.check_invariants()
    assert (throttler.trackers[A].load, throttler.trackers[A].announced, throttler.capacity) == (None, None, 3)


@settings(max_examples=150, deadline=None)
@given(
    cc=st.integers(1, 4),
    steps=st.lists(
        st.one_of(
            st.tuples(
                st.just("report"),
                st.sampled_from([A, B, C]),
                st.none() | st.floats(0, 10),
                st.none() | st.integers(-3, 20),
            ),
            st.tuples(st.just("acquire")),
            st.tuples(st.just("release"), st.integers(0, 50)),
        ),
        max_size=60,
    ),
)
def test_whatever_the_pods_announce_no_pod_runs_more_than_cc(cc: int, steps: list[tuple[object, ...]]) -> None:
    throttler = make(cc, A, B, C)
    running: list[Grant] = []
    for step in steps:
        if step[0] == "report":
            _, address, figure, concurrency = step
            assert isinstance(address, str)
            effects = throttler.load_report(address, figure, concurrency, 0.0)  # type: ignore[arg-type]
            running += [w.grant for w in effects.woken if w.grant is not None]
        elif step[0] == "acquire":
            try:
                result = throttler.acquire(0.0)
            except QueueFull:
                continue
            if isinstance(result, Grant):
                pod = throttler.trackers[result.pod.address]
                assert pod.announced is None or pod.in_flight <= pod.announced  # asked for: held
                running.append(result)
        elif running:
            index = step[1]
            assert isinstance(index, int)
            effects = throttler.release(running.pop(index % len(running)), 0.0)
            running += [w.grant for w in effects.woken if w.grant is not None]
        throttler.check_invariants()
        for tracker in throttler.trackers.values():
            assert tracker.peak_in_flight <= cc

"""``priority``, ``fair_by`` and ``tenant_queue_share``: validation (a failing case for each
rule, naming its key path), and how a request gets its class and tenant (tables)."""

from __future__ import annotations

from typing import Any

import pytest

from activator.core.config import FairBy, PriorityConfig, ServiceConfig, class_of_urgency, parse_config
from activator.core.errors import ConfigError, Shed, TenantQueueFull
from activator.core.http import grpc_status, own_answer_headers
from activator.core.priority import MAX_TENANT_KEY, Classifier, queue_policy, urgency
from activator.core.waitqueue import QueuePolicy

CLASSES = ["critical", "standard", "sheddable"]


def service(**keys: Any) -> ServiceConfig:
    body = {"hosts": ["api.example.com", "batch.example.com"], "pods": ["10.0.1.5:8000"], **keys}
    return parse_config({"services": {"api": body}}, filename="t.yaml", line_of=lambda path: None).services["api"]


INVALID = [
    ({"priority": {"classes": []}}, "services.api.priority.classes", "non-empty list"),
    ({"priority": {}}, "services.api.priority.classes", "required"),
    ({"priority": {"classes": ["a", "a"]}}, "services.api.priority.classes[1]", "listed twice"),
    ({"priority": {"classes": ["a.b"]}}, "services.api.priority.classes[0]", "class name"),
    ({"priority": {"classes": [f"c{n}" for n in range(9)]}}, "services.api.priority.classes", "at most 8"),
    ({"priority": {"classes": CLASSES, "default": "gold"}}, "services.api.priority.default", "one of the classes"),
    ({"priority": {"classes": CLASSES, "from": "rfc9999"}}, "services.api.priority.from", "rfc9218 or"),
    (
        {"priority": {"classes": CLASSES, "from": {"values": {"x": "critical"}}}},
        "services.api.priority.from.header",
        "required",
    ),
    (
        {"priority": {"classes": CLASSES, "from": {"header": "X-Tier", "values": {"gold": "platinum"}}}},
        "services.api.priority.from.values.gold",
        "one of the classes",
    ),
    (
        {"priority": {"classes": CLASSES, "from": {"header": "bad header", "values": {"a": "critical"}}}},
        "services.api.priority.from.header",
        "header name",
    ),
    (
        {"priority": {"classes": CLASSES, "hosts": {"other.example.com": "sheddable"}}},
        "services.api.priority.hosts.other.example.com",
        "not one of the service's hosts",
    ),
    (
        {"priority": {"classes": CLASSES, "queue_timeout": {"gold": "10s"}}},
        "services.api.priority.queue_timeout.gold",
        "one of the classes",
    ),
    (
        {"priority": {"classes": CLASSES, "queue_timeout": {"sheddable": "soon"}}},
        "services.api.priority.queue_timeout.sheddable",
        "a number with a unit",
    ),
    ({"priority": {"classes": CLASSES, "max_starvation": 0}}, "services.api.priority.max_starvation", "greater than 0"),
    ({"priority": {"classes": CLASSES, "typo": 1}}, "services.api.priority.typo", "unknown key"),
    ({"fair_by": "ip"}, "services.api.fair_by", "client_ip or {header: NAME}"),
    ({"fair_by": {"cookie": "x"}}, "services.api.fair_by.cookie", "unknown key"),
    ({"fair_by": "client_ip", "tenant_queue_share": 0}, "services.api.tenant_queue_share", "above 0 and at most 1"),
    ({"tenant_queue_share": 0.5}, "services.api.tenant_queue_share", "needs fair_by"),
]


@pytest.mark.parametrize(("keys", "key", "fragment"), INVALID, ids=[case[1] + "-" + case[2] for case in INVALID])
def test_invalid_settings_name_their_key(keys: dict[str, Any], key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        service(**keys)
    assert caught.value.key == key
    assert fragment in caught.value.detail


def test_a_full_priority_section() -> None:
    config = service(
        priority={
            "classes": CLASSES,
            "default": "standard",
            "from": {"header": "X-Tier", "values": {"gold": "critical", "free": "sheddable"}},
            "hosts": {"Batch.Example.com": "sheddable"},
            "queue_timeout": {"sheddable": "120s"},
            "max_starvation": "30s",
        },
        fair_by={"header": "X-API-Key"},
        tenant_queue_share=0.25,
        queue_depth=100,
    )
    assert config.priority == PriorityConfig(
        classes=tuple(CLASSES),
        default="standard",
        header="x-tier",
        values={"gold": "critical", "free": "sheddable"},
        hosts={"batch.example.com": "sheddable"},
        queue_timeout={"sheddable": 120.0},
        max_starvation=30.0,
    )
    assert config.fair_by == FairBy("x-api-key")
    assert queue_policy(config) == QueuePolicy(classes=3, fair=True, tenant_cap=25, max_starvation=30.0)


def test_defaults() -> None:
    plain = service()
    assert plain.priority is None and plain.fair_by is None
    assert queue_policy(plain) == QueuePolicy() and not Classifier(plain).active
    two = service(priority={"classes": ["high", "low"]})
    assert two.priority is not None and two.priority.default == "high"  # urgency 3 of 0..7
    assert two.priority.header is None and two.priority.max_starvation is None
    assert service(priority={"classes": CLASSES}).priority.default == "standard"  # type: ignore[union-attr]
    assert service(fair_by="client_ip").fair_by == FairBy(None)
    assert queue_policy(service(fair_by="client_ip", queue_depth=1)).tenant_cap == 1  # at least one


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], None),
        ([b"u=0"], 0),
        ([b"u=7, i"], 7),
        ([b"i, u=5"], 5),
        ([b"u=2", b"u=6"], 6),  # the last one wins
        ([b"u=8"], None),
        ([b"u=-1"], None),
        ([b"u=1;x=2"], 1),
        ([b"u=12"], None),
        ([b"i"], None),
        ([b"garbage=="], None),
    ],
)
def test_rfc9218_urgency(values: list[bytes], expected: int | None) -> None:
    assert urgency(values) == expected


@pytest.mark.parametrize(
    ("classes", "spread"),
    [(1, [0] * 8), (2, [0, 0, 0, 0, 1, 1, 1, 1]), (3, [0, 0, 0, 1, 1, 1, 2, 2]), (8, list(range(8)))],
)
def test_urgency_spreads_evenly_over_the_classes(classes: int, spread: list[int]) -> None:
    assert [class_of_urgency(u, classes) for u in range(8)] == spread


def heads(*lines: tuple[bytes, bytes]) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    return list(lines), [name.lower() for name, _ in lines]


@pytest.mark.parametrize(
    ("host", "lines", "klass"),
    [
        ("api.example.com", [], 1),  # default
        ("batch.example.com", [], 2),  # the host's default
        ("BATCH.example.com:8080", [], 2),
        ("api.example.com", [(b"Priority", b"u=0")], 0),
        ("batch.example.com", [(b"Priority", b"u=1")], 0),  # the request's own word first
        ("api.example.com", [(b"Priority", b"u=9")], 1),  # unreadable: as if absent
        ("api.example.com", [(b"priority", b"u=6")], 2),
    ],
)
def test_class_from_rfc9218(host: str, lines: list[tuple[bytes, bytes]], klass: int) -> None:
    classifier = Classifier(service(priority={"classes": CLASSES, "hosts": {"batch.example.com": "sheddable"}}))
    assert classifier.classify(host, "10.0.0.9", *heads(*lines)) == (klass, None)


@pytest.mark.parametrize(
    ("lines", "klass"),
    [
        ([(b"X-Tier", b"gold")], 0),
        ([(b"x-tier", b" free ")], 2),
        ([(b"X-Tier", b"silver")], 1),  # not in the map: the default
        ([(b"Priority", b"u=0")], 1),  # Priority is not read with from: header
        ([], 1),
    ],
)
def test_class_from_a_header_map(lines: list[tuple[bytes, bytes]], klass: int) -> None:
    classifier = Classifier(
        service(
            priority={
                "classes": CLASSES,
                "from": {"header": "X-Tier", "values": {"gold": "critical", "free": "sheddable"}},
            }
        )
    )
    assert classifier.classify("api.example.com", "10.0.0.9", *heads(*lines))[0] == klass


def test_tenants() -> None:
    by_ip = Classifier(service(fair_by="client_ip"))
    assert by_ip.classify("api.example.com", "10.0.0.9", [], []) == (0, "10.0.0.9")
    by_key = Classifier(service(fair_by={"header": "X-API-Key"}))
    assert by_key.classify("api.example.com", "10.0.0.9", *heads((b"X-Api-Key", b" k1 ")))[1] == b"k1"
    assert by_key.classify("api.example.com", "10.0.0.9", [], [])[1] == b""  # the anonymous tenant
    long_key = b"k" * 1000
    assert by_key.classify("api.example.com", "", *heads((b"x-api-key", long_key)))[1] == long_key[:MAX_TENANT_KEY]


def test_per_class_queue_timeout() -> None:
    classifier = Classifier(
        service(queue_timeout="10s", priority={"classes": CLASSES, "queue_timeout": {"sheddable": "2m"}})
    )
    assert [classifier.queue_timeout(k) for k in range(3)] == [10.0, 10.0, 120.0]
    assert Classifier(service(queue_timeout="10s")).queue_timeout(0) == 10.0


@pytest.mark.parametrize("error", [Shed(), TenantQueueFull()])
def test_the_new_answers_are_503_with_retry_after_and_resource_exhausted(error: Shed | TenantQueueFull) -> None:
    status, headers, _ = own_answer_headers(error, grpc=False)
    assert status == 503 and (b"retry-after", b"1") in headers
    assert grpc_status(error) == 8


def test_the_longest_queue_timeout_bounds_a_forwarded_requests_wait() -> None:
    from activator.core.config import longest_queue_timeout

    assert longest_queue_timeout(service(queue_timeout="30s")) == 30.0
    classed = service(
        queue_timeout="30s", priority={"classes": CLASSES, "queue_timeout": {"sheddable": "2m", "critical": "5s"}}
    )
    assert longest_queue_timeout(classed) == 120.0


def test_check_shows_the_classes_and_the_tenants() -> None:
    from activator.core.config import describe_config

    body = {
        "hosts": ["api.example.com", "batch.example.com"],
        "queue_depth": 10,
        "priority": {
            "classes": CLASSES,
            "hosts": {"batch.example.com": "sheddable"},
            "queue_timeout": {"sheddable": "2m"},
            "max_starvation": "30s",
        },
        "fair_by": {"header": "X-API-Key"},
        "tenant_queue_share": 0.3,
    }
    text = describe_config(parse_config({"services": {"api": body}}, filename="t.yaml", line_of=lambda path: None))
    assert "priority classes, highest first: critical, standard, sheddable; from Priority: u=0..7 (RFC 9218)" in text
    assert "u=0..2 critical, u=3..5 standard, u=6..7 sheddable" in text
    assert "default standard; batch.example.com -> sheddable" in text
    assert "sheddable: queue_timeout 2m" in text and "max_starvation 30s" in text
    assert "fair_by header x-api-key: round-robin between tenants, each at most 3 queued" in text
    plain = describe_config(
        parse_config({"services": {"api": {"hosts": ["a.example.com"]}}}, filename="t", line_of=lambda p: None)
    )
    assert "priority" not in plain and "fair_by" not in plain

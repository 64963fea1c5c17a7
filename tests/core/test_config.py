"""The config model: every validation rule (a failing and a passing case), the diff,
``resolve_lb_policy`` and ``describe_config``. Plain data in, no files."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from activator.core.config import (
    LB_POLICIES,
    ActivatorsConfig,
    Address,
    Change,
    Config,
    KeyPath,
    LimitsConfig,
    PodConfig,
    ProbeConfig,
    ServiceConfig,
    ServiceDiff,
    StatsdConfig,
    describe_config,
    diff_configs,
    format_duration,
    normalize_host,
    parse_config,
    render_key_path,
    resolve_lb_policy,
)
from activator.core.errors import ConfigError


def parse(data: object) -> Config:
    return parse_config(data, filename="test.yaml", line_of=lambda path: None)


def service(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"hosts": ["api.example.com"], "pods": ["10.0.1.5:8000"]}
    body.update(overrides)
    return body


def config(services: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    data: dict[str, Any] = dict(top)
    data["services"] = {"api": service()} if services is None else services
    return data


def without(mapping: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in mapping.items() if k != key}


PEERS = {"vm-a": "10.0.0.1:8080", "vm-b": "10.0.0.2:8080"}
SECRET = "the-fleets-shared-secret"

# (id, data, rendered key, a fragment of the message)
INVALID: list[tuple[str, object, str, str]] = [
    # the document
    ("empty-file", None, "", "the file is empty"),
    ("top-is-list", [], "", "must be a mapping, got a list"),
    ("top-is-string", "listen", "", "must be a mapping, got string 'listen'"),
    ("top-key-not-string", {1: 2}, "", "keys must be strings, got number 1"),
    # unknown keys, at every level
    ("unknown-top", config(listne="0.0.0.0:80"), "listne", "unknown key (did you mean listen?)"),
    ("unknown-top-lists-allowed", config(foo=1), "foo", "allowed: listen, admin, workers"),
    (
        "unknown-service-key",
        config({"api": service(queue_dept=5)}),
        "services.api.queue_dept",
        "unknown key (did you mean queue_depth?); allowed: hosts, container_concurrency",
    ),
    ("unknown-limits-key", config(limits={"max_conections": 1}), "limits.max_conections", "max_connections"),
    (
        "unknown-probe-key",
        config({"api": service(probe={"intervall": "1s"})}),
        "services.api.probe.intervall",
        "did you mean interval?",
    ),
    (
        "unknown-pod-key",
        config({"api": service(pods=[{"address": "10.0.1.5:8000", "drian": True}])}),
        "services.api.pods[0].drian",
        "did you mean drain?",
    ),
    ("unknown-statsd-key", config(statsd={"address": "127.0.0.1:8125", "tag": True}), "statsd.tag", "tags"),
    (
        "unknown-activators-key",
        config(activators={"self": "vm-a", "peers": PEERS, "me": 1}),
        "activators.me",
        "self, peers",
    ),
    # addresses
    ("listen-no-port", config(listen="0.0.0.0"), "listen", "must be an address host:port, got '0.0.0.0'"),
    ("listen-number", config(listen=8080), "listen", "must be an address host:port, got number 8080"),
    ("listen-port-too-big", config(listen="0.0.0.0:70000"), "listen", "port must be 1..65535, got 70000"),
    ("listen-port-zero", config(listen="0.0.0.0:0"), "listen", "port must be 1..65535, got 0"),
    ("listen-port-huge", config(listen="0.0.0.0:" + "9" * 5000), "listen", "port must be 1..65535, got 99999"),
    ("listen-port-word", config(listen="0.0.0.0:http"), "listen", "port must be a number 1..65535, got 'http'"),
    ("listen-port-empty", config(listen="0.0.0.0:"), "listen", "port must be a number"),
    ("listen-no-host", config(listen=":8080"), "listen", "must be an address host:port"),
    ("ipv6-without-brackets", config(listen="::1:8080"), "listen", "an IPv6 address needs brackets"),
    ("ipv6-unclosed", config(listen="[::1:8080"), "listen", "IPv6 as [::1]:8000"),
    ("ipv6-invalid", config(listen="[zz::1]:8080"), "listen", "'zz::1' is not a valid IPv6 address"),
    ("ipv4-invalid", config(listen="256.1.1.1:8080"), "listen", "'256.1.1.1' is not a valid IPv4 address"),
    ("hostname-invalid", config(listen="bad-.example.com:8080"), "listen", "is not a valid host name"),
    ("hostname-space", config(listen="bad host:8080"), "listen", "is not a valid host name"),
    ("hostname-non-ascii", config(listen="bücher.de:8080"), "listen", "is not a valid host name"),
    ("admin-is-listen", config(listen="127.0.0.1:8080", admin="127.0.0.1:8080"), "admin", "must not be the proxy's"),
    ("admin-under-wildcard", config(admin="127.0.0.1:8080"), "admin", "must not be the proxy's address 0.0.0.0:8080"),
    ("admin-number", config(admin=9090), "admin", "must be an address host:port"),
    # pods
    (
        "pod-port",
        config({"api": service(pods=["10.0.1.5:8000", "10.0.1.6:8000", "10.0.1.7:70000"])}),
        "services.api.pods[2]",
        "port must be 1..65535, got 70000",
    ),
    ("pod-unspecified", config({"api": service(pods=["0.0.0.0:8000"])}), "services.api.pods[0]", "only for listening"),
    ("pod-unspecified-v6", config({"api": service(pods=["[::]:8000"])}), "services.api.pods[0]", "only for listening"),
    ("pod-number", config({"api": service(pods=[8000])}), "services.api.pods[0]", "a pod is host:port or {address"),
    ("pod-list", config({"api": service(pods=[["a"]])}), "services.api.pods[0]", "got a list"),
    (
        "pod-mapping-no-address",
        config({"api": service(pods=[{"drain": True}])}),
        "services.api.pods[0].address",
        "required",
    ),
    (
        "pod-mapping-bad-address",
        config({"api": service(pods=[{"address": "10.0.1.5:99999"}])}),
        "services.api.pods[0].address",
        "port must be 1..65535, got 99999",
    ),
    (
        "pod-drain-not-bool",
        config({"api": service(pods=[{"address": "10.0.1.5:8000", "drain": "yes"}])}),
        "services.api.pods[0].drain",
        "must be true or false, got string 'yes'",
    ),
    (
        "pod-twice-in-service",
        config({"api": service(pods=["10.0.1.5:8000", {"address": "10.0.1.5:8000", "drain": True}])}),
        "services.api.pods[1]",
        "pod 10.0.1.5:8000 is listed twice (also pods[0])",
    ),
    (
        "pod-twice-canonical",
        config({"api": service(pods=["[::1]:8000", "[0:0::1]:8000"])}),
        "services.api.pods[1]",
        "pod [::1]:8000 is listed twice",
    ),
    (
        "pod-in-two-services",
        config({"api": service(), "web": service(hosts=["web.example.com"])}),
        "services.web.pods[0]",
        "pod 10.0.1.5:8000 is in both services api and web",
    ),
    ("pods-not-list", config({"api": service(pods="10.0.1.5:8000")}), "services.api.pods", "must be a list of pods"),
    # integers
    ("workers-zero", config(workers=0), "workers", "must be >= 1, got 0"),
    ("workers-float", config(workers=1.5), "workers", "must be an integer, got number 1.5"),
    ("workers-whole-float", config(workers=2.0), "workers", "must be an integer, got number 2.0"),
    ("workers-bool", config(workers=True), "workers", "must be an integer, got boolean true"),
    ("workers-too-many", config(workers=100000), "workers", "must be <= 256, got 100000"),
    ("workers-string", config(workers="2"), "workers", "must be an integer, got string '2'"),
    ("workers-null", config(workers=None), "workers", "must be an integer, got null"),
    ("workers-huge-negative", config(workers=-(10**5000)), "workers", "must be >= 1, got (huge)"),
    ("cc-negative", config({"api": service(container_concurrency=-1)}), "services.api.container_concurrency", ">= 0"),
    ("cc-float", config({"api": service(container_concurrency=1.0)}), "services.api.container_concurrency", "integer"),
    (
        "queue-depth-negative",
        config({"api": service(queue_depth=-1)}),
        "services.api.queue_depth",
        "must be >= 0, got -1",
    ),
    ("max-connections-zero", config(limits={"max_connections": 0}), "limits.max_connections", "must be >= 1"),
    ("max-header-bytes-zero", config(limits={"max_header_bytes": 0}), "limits.max_header_bytes", "must be >= 1"),
    ("max-body-negative", config(limits={"max_body_bytes": -1}), "limits.max_body_bytes", "must be >= 0, got -1"),
    ("max-body-float", config(limits={"max_body_bytes": 1.5}), "limits.max_body_bytes", "must be an integer"),
    (
        "healthy-after-zero",
        config({"api": service(probe={"healthy_after": 0})}),
        "services.api.probe.healthy_after",
        ">= 1",
    ),
    (
        "unhealthy-after-zero",
        config({"api": service(probe={"unhealthy_after": 0})}),
        "services.api.probe.unhealthy_after",
        "must be >= 1, got 0",
    ),
    # durations
    ("duration-negative", config(grace_period=-1), "grace_period", "must not be negative, got -1"),
    ("duration-no-unit", config(grace_period="30"), "grace_period", "must be seconds or a number with a unit"),
    ("duration-negative-string", config(grace_period="-1s"), "grace_period", "like 250ms, 30s, 5m, 1h"),
    ("duration-unknown-unit", config(grace_period="1d"), "grace_period", "got '1d'"),
    ("duration-space", config(grace_period="30 s"), "grace_period", "got '30 s'"),
    ("duration-compound", config(grace_period="1h30m"), "grace_period", "got '1h30m'"),
    ("duration-bool", config(grace_period=True), "grace_period", "must be a duration (like 250ms"),
    ("duration-list", config(grace_period=[1]), "grace_period", "got a list"),
    ("duration-inf", config(grace_period=float("inf")), "grace_period", "must be a finite duration"),
    ("duration-nan", config(grace_period=float("nan")), "grace_period", "must be a finite duration"),
    ("duration-huge-int", config(grace_period=10**400), "grace_period", "must be a finite duration"),
    ("duration-huge-string", config(grace_period="9" * 400 + "s"), "grace_period", "must be a finite duration"),
    ("client-timeout-zero", config(limits={"client_timeout": 0}), "limits.client_timeout", "must be greater than 0"),
    (
        "connect-timeout-zero",
        config({"api": service(connect_timeout="0s")}),
        "services.api.connect_timeout",
        "greater than 0",
    ),
    (
        "connect-timeout-zero-ms",
        config({"api": service(connect_timeout="0ms")}),
        "services.api.connect_timeout",
        "greater than 0",
    ),
    (
        "request-timeout-zero",
        config({"api": service(request_timeout=0)}),
        "services.api.request_timeout",
        "greater than 0",
    ),
    (
        "queue-timeout-negative",
        config({"api": service(queue_timeout=-0.5)}),
        "services.api.queue_timeout",
        "not be negative",
    ),
    (
        "drain-timeout-negative",
        config({"api": service(drain_timeout=-1)}),
        "services.api.drain_timeout",
        "not be negative",
    ),
    (
        "probe-interval-zero",
        config({"api": service(probe={"interval": 0})}),
        "services.api.probe.interval",
        "greater than 0",
    ),
    (
        "probe-timeout-zero",
        config({"api": service(probe={"timeout": "0s"})}),
        "services.api.probe.timeout",
        "greater than 0",
    ),
    # booleans
    ("access-log-string", config(access_log="yes"), "access_log", "must be true or false, got string 'yes'"),
    ("access-log-int", config(access_log=1), "access_log", "must be true or false, got number 1"),
    # limits, statsd, activators
    ("limits-not-mapping", config(limits=5), "limits", "must be a mapping, got number 5"),
    ("limits-null", config(limits=None), "limits", "must be a mapping, got null"),
    ("statsd-no-address", config(statsd={"prefix": "x"}), "statsd.address", "required"),
    ("statsd-bad-address", config(statsd={"address": "127.0.0.1"}), "statsd.address", "must be an address"),
    ("statsd-not-mapping", config(statsd="127.0.0.1:8125"), "statsd", "must be a mapping"),
    (
        "statsd-prefix-empty",
        config(statsd={"address": "127.0.0.1:8125", "prefix": ""}),
        "statsd.prefix",
        "dot-separated",
    ),
    (
        "statsd-prefix-dots",
        config(statsd={"address": "127.0.0.1:8125", "prefix": "a..b"}),
        "statsd.prefix",
        "got string 'a..b'",
    ),
    (
        "statsd-prefix-colon",
        config(statsd={"address": "127.0.0.1:8125", "prefix": "a:b"}),
        "statsd.prefix",
        "dot-separated",
    ),
    ("statsd-tags-string", config(statsd={"address": "127.0.0.1:8125", "tags": "no"}), "statsd.tags", "true or false"),
    ("activators-no-self", config(activators={"peers": PEERS, "secret": SECRET}), "activators.self", "required"),
    ("activators-no-peers", config(activators={"self": "vm-a"}), "activators.peers", "required"),
    (
        "activators-self-not-peer",
        config(activators={"self": "vm-c", "peers": PEERS, "secret": SECRET}),
        "activators.self",
        "must be one of the peers (vm-a, vm-b), got string 'vm-c'",
    ),
    (
        "activators-peers-empty",
        config(activators={"self": "vm-a", "peers": {}}),
        "activators.peers",
        "at least one peer",
    ),
    ("activators-peers-list", config(activators={"self": "vm-a", "peers": ["vm-a"]}), "activators.peers", "got a list"),
    (
        "activators-peer-address",
        config(activators={"self": "vm-a", "peers": {"vm-a": "10.0.0.1"}}),
        "activators.peers.vm-a",
        "must be an address host:port",
    ),
    (
        "activators-peers-same-address",
        config(activators={"self": "vm-a", "peers": {"vm-a": "10.0.0.1:8080", "vm-b": "10.0.0.1:8080"}}),
        "activators.peers.vm-b",
        "address 10.0.0.1:8080 is also peer vm-a's",
    ),
    (
        "activators-peer-name",
        config(activators={"self": "vm a", "peers": {"vm a": "10.0.0.1:8080"}}),
        "activators.peers",
        "a peer name",
    ),
    ("activators-not-mapping", config(activators=["vm-a"]), "activators", "must be a mapping"),
    (
        "activators-no-secret",
        config(activators={"self": "vm-a", "peers": PEERS}),
        "activators",
        "secret or secret_file is required with more than one peer",
    ),
    (
        "activators-short-secret",
        config(activators={"self": "vm-a", "peers": PEERS, "secret": "short"}),
        "activators.secret",
        "at least 16 characters",
    ),
    (
        "activators-two-secrets",
        config(activators={"self": "vm-a", "peers": PEERS, "secret": SECRET, "secret_file": "/etc/x"}),
        "activators.secret_file",
        "not both",
    ),
    (
        "tls-with-several-activators",
        config(
            tls={"cert": "/etc/activator/tls.crt", "key": "/etc/activator/tls.key"},
            activators={"self": "vm-a", "peers": PEERS, "secret": SECRET},
        ),
        "tls",
        "cannot be combined with several activators",
    ),
    (
        "activators-unhealthy-after-zero",
        config(activators={"self": "vm-a", "peers": PEERS, "secret": SECRET, "unhealthy_after": 0}),
        "activators.unhealthy_after",
        "",
    ),
    # services
    ("services-list", {"services": [service()]}, "services", "must be a mapping of service name to service"),
    (
        "service-name-dot",
        config({"api.v1": service()}),
        "services",
        "a service name of A-Z a-z 0-9 _ -, got string 'api.v1'",
    ),
    ("service-name-empty", config({"": service()}), "services", "a service name"),
    ("service-name-not-string", config({1: service()}), "services", "got number 1"),
    ("service-null", config({"api": None}), "services.api", "must be a mapping, got null"),
    ("service-no-hosts", config({"api": without(service(), "hosts")}), "services.api.hosts", "required"),
    (
        "lb-policy-unknown",
        config({"api": service(lb_policy="random")}),
        "services.api.lb_policy",
        "auto, first-available",
    ),
    ("lb-policy-number", config({"api": service(lb_policy=1)}), "services.api.lb_policy", "must be one of"),
    ("probe-not-mapping", config({"api": service(probe="/healthz")}), "services.api.probe", "must be a mapping"),
    (
        "probe-path-relative",
        config({"api": service(probe={"path": "healthz"})}),
        "services.api.probe.path",
        "starting with /",
    ),
    ("probe-path-space", config({"api": service(probe={"path": "/a b"})}), "services.api.probe.path", "no spaces"),
    (
        "probe-path-newline",
        config({"api": service(probe={"path": "/a\r\nX: y"})}),
        "services.api.probe.path",
        "URL path",
    ),
    # hosts
    ("hosts-empty", config({"api": service(hosts=[])}), "services.api.hosts", "non-empty list"),
    ("hosts-string", config({"api": service(hosts="api.example.com")}), "services.api.hosts", "non-empty list"),
    ("hosts-null", config({"api": service(hosts=None)}), "services.api.hosts", "got null"),
    ("host-number", config({"api": service(hosts=[5])}), "services.api.hosts[0]", "must be a host name, got number 5"),
    ("host-wildcard-suffix", config({"api": service(hosts=["*.example.com"])}), "services.api.hosts[0]", "lone '*'"),
    (
        "host-url",
        config({"api": service(hosts=["http://x.com"])}),
        "services.api.hosts[0]",
        "must be a host name or IP",
    ),
    ("host-bad-port", config({"api": service(hosts=["x.com:http"])}), "services.api.hosts[0]", "optionally with :port"),
    (
        "host-bad-ipv6",
        config({"api": service(hosts=["[zz::1]"])}),
        "services.api.hosts[0]",
        "must be a host name or IP",
    ),
    ("host-bad-label", config({"api": service(hosts=["-x.com"])}), "services.api.hosts[0]", "not a valid host name"),
    ("host-trailing-dot", config({"api": service(hosts=["x.com."])}), "services.api.hosts[0]", "not a valid host name"),
    (
        "host-ipv6-twice",
        config({"api": service(hosts=["[::1]:80", "0::1"])}),
        "services.api.hosts[1]",
        "host '::1' is listed twice",
    ),
    (
        "host-twice-in-service",
        config({"api": service(hosts=["api.example.com", "API.example.com:8080"])}),
        "services.api.hosts[1]",
        "host 'api.example.com' is listed twice",
    ),
    (
        "host-in-two-services",
        config({"api": service(), "web": service(hosts=["web.example.com", "Api.Example.com"], pods=[])}),
        "services.web.hosts[1]",
        "host 'api.example.com' is in both services api and web",
    ),
    (
        "catch-all-twice",
        config({"api": service(hosts=["*"]), "web": service(hosts=["*"], pods=[])}),
        "services.web.hosts[0]",
        "host '*' is in both services api and web",
    ),
]


@pytest.mark.parametrize(("data", "key", "fragment"), [case[1:] for case in INVALID], ids=[case[0] for case in INVALID])
def test_invalid(data: object, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(data)
    error = caught.value
    assert error.key == key
    assert fragment in error.detail
    assert error.filename == "test.yaml"
    assert str(error) == ": ".join(part for part in ("test.yaml", key, error.detail) if part)


def test_error_reads_file_line_key_message() -> None:
    seen: list[KeyPath] = []

    def line_of(path: KeyPath) -> int:
        seen.append(path)
        return 14

    data = config({"api": service(pods=["10.0.1.5:8000", "10.0.1.6:8000", "10.0.1.7:70000"])})
    with pytest.raises(ConfigError) as caught:
        parse_config(data, filename="activator.yaml", line_of=line_of)
    assert str(caught.value) == "activator.yaml:14: services.api.pods[2]: port must be 1..65535, got 70000"
    assert caught.value.line == 14
    assert seen == [("services", "api", "pods", 2)]


def test_a_missing_key_is_looked_up_by_its_own_path() -> None:
    seen: list[KeyPath] = []

    def line_of(path: KeyPath) -> int | None:
        seen.append(path)
        return None

    with pytest.raises(ConfigError, match=r"^f\.yaml: services\.api\.hosts: required$"):
        parse_config(config({"api": {}}), filename="f.yaml", line_of=line_of)
    assert seen == [("services", "api", "hosts")]


# (id, data, what the Config must hold)
VALID: list[tuple[str, object, dict[str, object]]] = [
    ("empty-mapping", {}, {"services": {}, "listen": Address("0.0.0.0", 8080)}),
    ("services-empty", {"services": {}}, {"services": {}}),
    ("services-null", {"services": None}, {"services": {}}),
    (
        "defaults",
        {},
        {
            "path": "test.yaml",
            "admin": Address("127.0.0.1", 9090),
            "workers": 1,
            "grace_period": 30.0,
            "access_log": True,
            "limits": LimitsConfig(),
            "statsd": None,
            "activators": None,
        },
    ),
    ("listen-wildcard", {"listen": "0.0.0.0:80"}, {"listen": Address("0.0.0.0", 80)}),
    ("listen-ipv6-wildcard", {"listen": "[::]:8080", "admin": None}, {"listen": Address("::", 8080)}),
    ("listen-hostname", {"listen": "LocalHost:8080", "admin": None}, {"listen": Address("localhost", 8080)}),
    ("admin-null", {"admin": None}, {"admin": None}),
    ("admin-other-port", {"admin": "0.0.0.0:9091"}, {"admin": Address("0.0.0.0", 9091)}),
    ("admin-same-port-other-host", {"listen": "127.0.0.1:8080", "admin": "127.0.0.2:8080"}, {"workers": 1}),
    ("workers", {"workers": 4}, {"workers": 4}),
    ("access-log-off", {"access_log": False}, {"access_log": False}),
    ("grace-zero", {"grace_period": 0}, {"grace_period": 0.0}),
    ("duration-ms", {"grace_period": "250ms"}, {"grace_period": 0.25}),
    ("duration-s", {"grace_period": "30s"}, {"grace_period": 30.0}),
    ("duration-m", {"grace_period": "5m"}, {"grace_period": 300.0}),
    ("duration-h", {"grace_period": "1h"}, {"grace_period": 3600.0}),
    ("duration-fraction", {"grace_period": "1.5s"}, {"grace_period": 1.5}),
    ("duration-leading-dot", {"grace_period": ".5s"}, {"grace_period": 0.5}),
    ("duration-int", {"grace_period": 2}, {"grace_period": 2.0}),
    ("duration-float", {"grace_period": 0.5}, {"grace_period": 0.5}),
    (
        "limits",
        {"limits": {"max_connections": 5, "client_timeout": "10s", "max_header_bytes": 1024, "max_body_bytes": 0}},
        {"limits": LimitsConfig(5, 10.0, 1024, 0)},
    ),
    ("limits-partial", {"limits": {"max_body_bytes": 1000}}, {"limits": LimitsConfig(max_body_bytes=1000)}),
    ("limits-body-null", {"limits": {"max_body_bytes": None}}, {"limits": LimitsConfig()}),
    ("statsd-null", {"statsd": None}, {"statsd": None}),
    (
        "statsd-defaults",
        {"statsd": {"address": "127.0.0.1:8125"}},
        {"statsd": StatsdConfig(Address("127.0.0.1", 8125))},
    ),
    (
        "statsd-full",
        {"statsd": {"address": "statsd.local:8125", "prefix": "prod.activator", "tags": True}},
        {"statsd": StatsdConfig(Address("statsd.local", 8125), "prod.activator", True)},
    ),
    ("activators-null", {"activators": None}, {"activators": None}),
    (
        "activators",
        {"activators": {"self": "vm-b", "peers": PEERS, "secret": SECRET}},
        {
            "activators": ActivatorsConfig(
                "vm-b", {"vm-a": Address("10.0.0.1", 8080), "vm-b": Address("10.0.0.2", 8080)}, SECRET
            )
        },
    ),
    (
        "activators-alone",
        {"activators": {"self": "vm.a", "peers": {"vm.a": "[::1]:8080"}}},
        {"activators": ActivatorsConfig("vm.a", {"vm.a": Address("::1", 8080)})},
    ),
]


@pytest.mark.parametrize(("data", "expected"), [case[1:] for case in VALID], ids=[case[0] for case in VALID])
def test_valid(data: object, expected: dict[str, object]) -> None:
    result = parse(data)
    for name, value in expected.items():
        assert getattr(result, name) == value


# (id, service overrides, what the ServiceConfig must hold)
VALID_SERVICE: list[tuple[str, dict[str, Any], dict[str, object]]] = [
    (
        "defaults",
        {},
        {
            "name": "api",
            "hosts": ("api.example.com",),
            "container_concurrency": 1,
            "queue_depth": 100,
            "queue_timeout": 30.0,
            "connect_timeout": 2.0,
            "request_timeout": 300.0,
            "lb_policy": "auto",
            "drain_timeout": 3600.0,
            "probe": None,
            "pods": (PodConfig("10.0.1.5:8000", "10.0.1.5", 8000),),
        },
    ),
    ("cc-zero", {"container_concurrency": 0}, {"container_concurrency": 0}),
    ("cc-big", {"container_concurrency": 64}, {"container_concurrency": 64}),
    ("queue-zero", {"queue_depth": 0}, {"queue_depth": 0}),
    ("queue-timeout-zero", {"queue_timeout": 0}, {"queue_timeout": 0.0}),
    ("drain-timeout-zero", {"drain_timeout": "0s"}, {"drain_timeout": 0.0}),
    (
        "timeouts",
        {"connect_timeout": "250ms", "request_timeout": "5m"},
        {"connect_timeout": 0.25, "request_timeout": 300.0},
    ),
    ("probe-null", {"probe": None}, {"probe": None}),
    ("probe-empty", {"probe": {}}, {"probe": ProbeConfig()}),
    ("probe-partial", {"probe": {"interval": "2s"}}, {"probe": ProbeConfig(interval=2.0)}),
    (
        "probe-full",
        {"probe": {"path": "/ready?x=1", "interval": 5, "timeout": "500ms", "healthy_after": 2, "unhealthy_after": 1}},
        {"probe": ProbeConfig("/ready?x=1", 5.0, 0.5, 2, 1)},
    ),
    ("pods-null", {"pods": None}, {"pods": ()}),
    ("pods-empty", {"pods": []}, {"pods": ()}),
    ("pods-omitted", {"pods": None}, {"pods": ()}),
    (
        "pod-forms",
        {"pods": ["10.0.1.5:8000", {"address": "10.0.1.6:8000", "drain": True}, {"address": "10.0.1.7:8000"}]},
        {
            "pods": (
                PodConfig("10.0.1.5:8000", "10.0.1.5", 8000, False),
                PodConfig("10.0.1.6:8000", "10.0.1.6", 8000, True),
                PodConfig("10.0.1.7:8000", "10.0.1.7", 8000, False),
            )
        },
    ),
    ("pod-ipv6", {"pods": ["[0:0::1]:8000"]}, {"pods": (PodConfig("[::1]:8000", "::1", 8000),)}),
    (
        "pod-hostname",
        {"pods": ["Pod-1.Example.com:80"]},
        {"pods": (PodConfig("pod-1.example.com:80", "pod-1.example.com", 80),)},
    ),
    ("pod-underscore", {"pods": ["my_pod:80"]}, {"pods": (PodConfig("my_pod:80", "my_pod", 80),)}),
    ("pods-same-host-two-ports", {"pods": ["10.0.1.5:8000", "10.0.1.5:8001"]}, {"hosts": ("api.example.com",)}),
    (
        "hosts-normalized",
        {"hosts": ["API.Example.com:8080", "[0::1]:80", "[::2]", "0::3", " spaced.example.com ", "10.0.0.1:80"]},
        {"hosts": ("api.example.com", "::1", "::2", "::3", "spaced.example.com", "10.0.0.1")},
    ),
    ("hosts-catch-all", {"hosts": ["*", "a.com"]}, {"hosts": ("*", "a.com")}),
    ("hosts-ip", {"hosts": ["10.0.0.1:8080"]}, {"hosts": ("10.0.0.1",)}),
    *(
        (f"lb-{policy}", {"lb_policy": policy}, {"lb_policy": policy})
        for policy in LB_POLICIES
        if policy != "least-loaded"
    ),
    ("lb-least-loaded", {"lb_policy": "least-loaded", "load": {"from": "orca"}}, {"lb_policy": "least-loaded"}),
]


@pytest.mark.parametrize(
    ("overrides", "expected"), [case[1:] for case in VALID_SERVICE], ids=[case[0] for case in VALID_SERVICE]
)
def test_valid_service(overrides: dict[str, Any], expected: dict[str, object]) -> None:
    result = parse(config({"api": service(**overrides)})).services["api"]
    for name, value in expected.items():
        assert getattr(result, name) == value


def test_services_keep_file_order_and_may_share_nothing() -> None:
    result = parse(
        config(
            {
                "web": service(hosts=["web.example.com"], pods=["10.0.2.1:80"]),
                "api": service(hosts=["*"]),
                "batch": service(hosts=["batch"], pods=[]),
            }
        )
    )
    assert list(result.services) == ["web", "api", "batch"]
    assert all(isinstance(s, ServiceConfig) for s in result.services.values())


def test_parsing_does_not_change_the_data() -> None:
    data = config(activators={"self": "vm-a", "peers": PEERS, "secret": SECRET}, statsd={"address": "127.0.0.1:8125"})
    before = copy.deepcopy(data)
    parse(data)
    assert data == before


# -- helpers -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "cc", "expected"),
    [
        ("auto", 0, "least-in-flight"),
        ("auto", 1, "first-available"),
        ("auto", 2, "first-available"),
        ("auto", 3, "first-available"),
        ("auto", 4, "round-robin"),
        ("auto", 1000, "round-robin"),
        ("first-available", 0, "first-available"),
        ("round-robin", 1, "round-robin"),
        ("least-in-flight", 10, "least-in-flight"),
    ],
)
def test_resolve_lb_policy(policy: str, cc: int, expected: str) -> None:
    assert resolve_lb_policy(policy, cc) == expected


@pytest.mark.parametrize(("policy", "cc"), [("random", 1), ("", 1), ("auto", -1)])
def test_resolve_lb_policy_rejects(policy: str, cc: int) -> None:
    with pytest.raises(ValueError):
        resolve_lb_policy(policy, cc)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("Api.Example.COM", "api.example.com"),
        ("api.example.com:8080", "api.example.com"),
        (" api.example.com ", "api.example.com"),
        ("[::1]:8080", "::1"),
        ("[0:0::1]", "::1"),
        ("[FE80::1]", "fe80::1"),
        ("0::1", "::1"),
        ("[not-ipv6]:80", "not-ipv6"),
        ("*", "*"),
        ("", ""),
    ],
)
def test_normalize_host(value: str, expected: str) -> None:
    assert normalize_host(value) == expected


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (0.0, "0s"),
        (0.25, "250ms"),
        (0.001, "1ms"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (30.0, "30s"),
        (90.0, "90s"),
        (300.0, "5m"),
        (3600.0, "1h"),
        (5400.0, "90m"),
        (7200.0, "2h"),
    ],
)
def test_format_duration(seconds: float, expected: str) -> None:
    assert format_duration(seconds) == expected
    assert parse({"grace_period": expected}).grace_period == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ((), ""),
        (("listen",), "listen"),
        (("services", "api", "pods", 2), "services.api.pods[2]"),
        (("services", "api", "pods", 0, "address"), "services.api.pods[0].address"),
    ],
)
def test_render_key_path(path: KeyPath, expected: str) -> None:
    assert render_key_path(path) == expected


# -- diff --------------------------------------------------------------------------


def pods_config(pods: list[object], **overrides: Any) -> Config:
    return parse(config({"api": service(pods=pods, **overrides)}))


def test_diff_of_equal_configs_is_empty() -> None:
    old = parse(config(statsd={"address": "127.0.0.1:8125"}))
    new = parse_config(config(statsd={"address": "127.0.0.1:8125"}), filename="other.yaml", line_of=lambda p: None)
    diff = diff_configs(old, new)
    assert diff.is_empty()
    assert diff.describe() == "no changes"


A, B, C = "10.0.1.5:8000", "10.0.1.6:8000", "10.0.1.7:8000"


def drained(address: str) -> dict[str, object]:
    return {"address": address, "drain": True}


# (id, old pods, new pods, expected ServiceDiff fields)
POD_DIFFS: list[tuple[str, list[object], list[object], dict[str, tuple[str, ...]]]] = [
    ("add", [A], [A, B], {"add_pods": (B,)}),
    ("unlist-active-drains", [A, B], [A], {"drain_pods": (B,)}),
    ("drain-flag", [A, B], [A, drained(B)], {"drain_pods": (B,)}),
    ("listed-already-drained", [A], [A, drained(B)], {"drain_pods": (B,)}),
    ("undrain", [A, drained(B)], [A, B], {"undrain_pods": (B,)}),
    ("unlist-drained", [A, drained(B)], [A], {"unlist_pods": (B,)}),
    ("still-drained", [drained(A)], [drained(A)], {}),
    ("reorder-is-a-change", [A, B], [B, A], {"reordered": True}),
    ("replace", [A, B], [A, C], {"add_pods": (C,), "drain_pods": (B,)}),
    ("all-at-once", [A, drained(B), C], [drained(A), B], {"drain_pods": (A, C), "undrain_pods": (B,)}),
]


MOVES = ("add_pods", "drain_pods", "undrain_pods", "unlist_pods")


def moves_of(expected: dict[str, object]) -> tuple[object, ...]:
    return (*(expected.get(name, ()) for name in MOVES), expected.get("reordered", False))


def moves(service: ServiceDiff) -> tuple[str, tuple[object, ...]]:
    """A service diff's pods, in the four words the diff describes them with, and its order."""
    return service.name, (*(getattr(service, name) for name in MOVES), service.reordered)


@pytest.mark.parametrize(("old", "new", "expected"), [c[1:] for c in POD_DIFFS], ids=[c[0] for c in POD_DIFFS])
def test_pod_diff(old: list[object], new: list[object], expected: dict[str, object]) -> None:
    diff = diff_configs(pods_config(old), pods_config(new))
    if not expected:
        assert diff.is_empty()
        return
    assert [moves(service) for service in diff.services] == [("api", moves_of(expected))]


# (id, old overrides, new overrides, expected changes)
SETTING_DIFFS: list[tuple[str, dict[str, Any], dict[str, Any], tuple[Change, ...], str]] = [
    (
        "cc",
        {},
        {"container_concurrency": 2},
        (Change("container_concurrency", 1, 2),),
        "service api: container_concurrency 1 -> 2",
    ),
    (
        "queue",
        {"queue_depth": 5},
        {"queue_depth": 0},
        (Change("queue_depth", 5, 0),),
        "service api: queue_depth 5 -> 0",
    ),
    (
        "timeouts",
        {},
        {"queue_timeout": "250ms", "request_timeout": "1h"},
        (Change("queue_timeout", 30.0, 0.25), Change("request_timeout", 300.0, 3600.0)),
        "service api: queue_timeout 30s -> 250ms\nservice api: request_timeout 5m -> 1h",
    ),
    (
        "lb",
        {},
        {"lb_policy": "round-robin"},
        (Change("lb_policy", "auto", "round-robin"),),
        "lb_policy auto -> round-robin",
    ),
    (
        "hosts",
        {},
        {"hosts": ["api.example.com", "api2.example.com"]},
        (Change("hosts", ("api.example.com",), ("api.example.com", "api2.example.com")),),
        "service api: hosts [api.example.com] -> [api.example.com, api2.example.com]",
    ),
    (
        "probe-added",
        {},
        {"probe": {}},
        (Change("probe", None, ProbeConfig()),),
        "probe null -> {path: /healthz, interval: 1s, timeout: 1s, healthy_after: 1, unhealthy_after: 3}",
    ),
    ("probe-removed", {"probe": {}}, {"probe": None}, (Change("probe", ProbeConfig(), None),), "-> null"),
    (
        "probe-field",
        {"probe": {}},
        {"probe": {"interval": "2s", "path": "/ready"}},
        (Change("probe.path", "/healthz", "/ready"), Change("probe.interval", 1.0, 2.0)),
        "service api: probe.path /healthz -> /ready\nservice api: probe.interval 1s -> 2s",
    ),
]


@pytest.mark.parametrize(
    ("old", "new", "changes", "described"), [c[1:] for c in SETTING_DIFFS], ids=[c[0] for c in SETTING_DIFFS]
)
def test_service_setting_diff(
    old: dict[str, Any], new: dict[str, Any], changes: tuple[Change, ...], described: str
) -> None:
    diff = diff_configs(pods_config([A], **old), pods_config([A], **new))
    assert diff.services == (ServiceDiff("api", changes=changes),)
    assert not diff.restart_needed and not diff.changes
    assert described in diff.describe()


def test_added_and_removed_services_carry_their_pods() -> None:
    old = parse(config({"api": service(pods=[A, drained(B)])}))
    new = parse(config({"web": service(hosts=["web.example.com"], pods=[C])}))
    diff = diff_configs(old, new)
    assert diff.added_services == ("web",)
    assert diff.removed_services == ("api",)
    assert [moves(service) for service in diff.services] == [
        ("api", moves_of({"drain_pods": (A,), "unlist_pods": (B,)})),
        ("web", moves_of({"add_pods": (C,)})),
    ]
    assert diff.describe().splitlines() == [
        "add service web",
        "remove service api",
        f"service api: drain pod {A}",
        f"service api: unlist drained pod {B}",
        f"service web: add pod {C}",
    ]


def test_a_pod_moving_between_services_is_drained_in_one_and_added_in_the_other() -> None:
    old = parse(config({"api": service(pods=[A]), "web": service(hosts=["web"], pods=[])}))
    new = parse(config({"api": service(pods=[]), "web": service(hosts=["web"], pods=[A])}))
    assert [moves(service) for service in diff_configs(old, new).services] == [
        ("api", moves_of({"drain_pods": (A,)})),
        ("web", moves_of({"add_pods": (A,)})),
    ]


# (id, old top-level, new top-level, restart-needed, live changes, a described line)
TOP_DIFFS: list[tuple[str, dict[str, Any], dict[str, Any], tuple[Change, ...], tuple[Change, ...], str]] = [
    (
        "listen",
        {"listen": "0.0.0.0:8080"},
        {"listen": "0.0.0.0:8081"},
        (Change("listen", Address("0.0.0.0", 8080), Address("0.0.0.0", 8081)),),
        (),
        "restart needed: listen 0.0.0.0:8080 -> 0.0.0.0:8081",
    ),
    (
        "admin-off",
        {},
        {"admin": None},
        (Change("admin", Address("127.0.0.1", 9090), None),),
        (),
        "restart needed: admin 127.0.0.1:9090 -> null",
    ),
    ("workers", {}, {"workers": 2}, (Change("workers", 1, 2),), (), "restart needed: workers 1 -> 2"),
    ("grace", {}, {"grace_period": "1m"}, (), (Change("grace_period", 30.0, 60.0),), "grace_period 30s -> 1m"),
    ("access-log", {}, {"access_log": False}, (), (Change("access_log", True, False),), "access_log true -> false"),
    (
        "limits",
        {},
        {"limits": {"client_timeout": "30s", "max_body_bytes": 1024}},
        (),
        (Change("limits.client_timeout", 60.0, 30.0), Change("limits.max_body_bytes", None, 1024)),
        "limits.max_body_bytes null -> 1024",
    ),
    (
        "statsd-on",
        {},
        {"statsd": {"address": "127.0.0.1:8125"}},
        (),
        (Change("statsd", None, StatsdConfig(Address("127.0.0.1", 8125))),),
        "statsd null -> {address: 127.0.0.1:8125, prefix: activator, tags: false}",
    ),
    (
        "statsd-prefix",
        {"statsd": {"address": "127.0.0.1:8125"}},
        {"statsd": {"address": "127.0.0.1:8125", "prefix": "x"}},
        (),
        (Change("statsd.prefix", "activator", "x"),),
        "statsd.prefix activator -> x",
    ),
    (
        "activators-peer-added",
        {"activators": {"self": "vm-a", "peers": {"vm-a": "10.0.0.1:8080"}}},
        {"activators": {"self": "vm-a", "peers": PEERS, "secret": SECRET}},
        (),
        (
            Change(
                "activators.peers",
                {"vm-a": Address("10.0.0.1", 8080)},
                {"vm-a": Address("10.0.0.1", 8080), "vm-b": Address("10.0.0.2", 8080)},
            ),
            Change("activators.secret", None, "(hidden)"),  # never shown: only that there is one now
        ),
        "activators.peers {vm-a: 10.0.0.1:8080} -> {vm-a: 10.0.0.1:8080, vm-b: 10.0.0.2:8080}",
    ),
    (
        "activators-secret-removed",
        {"activators": {"self": "vm-a", "peers": {"vm-a": "10.0.0.1:8080"}, "secret": SECRET}},
        {"activators": {"self": "vm-a", "peers": {"vm-a": "10.0.0.1:8080"}}},
        (),
        (Change("activators.secret", "(hidden)", None),),
        "activators.secret (hidden) -> null",
    ),
    (
        "activators-self",
        {"activators": {"self": "vm-a", "peers": PEERS, "secret": SECRET}},
        {"activators": {"self": "vm-b", "peers": PEERS, "secret": SECRET}},
        (),
        (Change("activators.self", "vm-a", "vm-b"),),
        "activators.self vm-a -> vm-b",
    ),
]


@pytest.mark.parametrize(
    ("old", "new", "restart", "changes", "described"), [c[1:] for c in TOP_DIFFS], ids=[c[0] for c in TOP_DIFFS]
)
def test_top_level_diff(
    old: dict[str, Any], new: dict[str, Any], restart: tuple[Change, ...], changes: tuple[Change, ...], described: str
) -> None:
    diff = diff_configs(parse(config(**old)), parse(config(**new)))
    assert diff.restart_needed == restart
    assert diff.changes == changes
    assert diff.services == ()
    assert not diff.is_empty()
    assert described in diff.describe().splitlines()


def test_describe_puts_restarts_first_then_settings_then_pods() -> None:
    old = parse(config({"api": service(pods=[A, B])}))
    new = parse(config({"api": service(container_concurrency=2, pods=[A, drained(B), C])}, listen="0.0.0.0:8081"))
    assert diff_configs(old, new).describe().splitlines() == [
        "restart needed: listen 0.0.0.0:8080 -> 0.0.0.0:8081",
        "service api: container_concurrency 1 -> 2",
        f"service api: add pod {C}",
        f"service api: drain pod {B}",
    ]


# -- describe_config ---------------------------------------------------------------


def test_describe_config_lists_listeners_services_and_pods() -> None:
    text = describe_config(
        parse(
            config(
                {
                    "api": service(probe={}, pods=[A, drained(B)]),
                    "bulk": service(hosts=["*"], container_concurrency=0, lb_policy="round-robin", pods=[]),
                    "fast": service(hosts=["fast"], container_concurrency=8, pods=[C]),
                },
                admin=None,
                activators={"self": "vm-a", "peers": PEERS, "secret": SECRET},
            )
        )
    )
    lines = text.splitlines()
    assert lines[:3] == ["config test.yaml", "listen 0.0.0.0:8080", "admin disabled"]
    assert "activators: self vm-a; peers vm-a 10.0.0.1:8080, vm-b 10.0.0.2:8080" in lines
    api = lines[lines.index("service api") :]
    assert api[1] == "  hosts: api.example.com"
    assert api[2] == "  container_concurrency 1, queue_depth 100, queue_timeout 30s"
    assert "  lb_policy auto -> first-available, pods spoken to over HTTP/1.1, client_gone finish" in api
    assert "  probe: GET /healthz every 1s, timeout 1s, healthy after 1, unhealthy after 3" in api
    assert api[api.index("  pods (2):") + 1 :][:2] == [f"    {A}", f"    {B}  (drain)"]
    bulk = lines[lines.index("service bulk") :]
    assert "  hosts: * (catch-all)" in bulk
    assert "  lb_policy round-robin, pods spoken to over HTTP/1.1, client_gone finish" in bulk
    assert "  pods: none" in bulk
    assert "  probe: none (pods are routable as soon as listed)" in bulk
    assert (
        "  lb_policy auto -> round-robin, pods spoken to over HTTP/1.1, client_gone finish"
        in lines[lines.index("service fast") :]
    )


def test_describe_config_without_services() -> None:
    text = describe_config(parse({"statsd": {"address": "127.0.0.1:8125"}}))
    assert "admin 127.0.0.1:9090" in text
    assert "statsd 127.0.0.1:8125, prefix activator, tags false" in text
    assert text.endswith("no services")


# -- fuzz --------------------------------------------------------------------------

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["0.0.0.0:80", "[::1]:8000", "10.0.1.5:8000", "30s", "250ms", "*", "auto", "/healthz", "vm-a"])
)
ANY_DATA = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | SCALARS, inner, max_size=4),
    max_leaves=20,
)


def _paths(data: object, prefix: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    found = [prefix] if prefix else []
    if isinstance(data, dict):
        for key, value in data.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            found += _paths(value, (*prefix, index))
    return found


BASE = config(
    {
        "api": service(probe={"path": "/healthz", "interval": "1s"}, pods=[A, drained(B)]),
        "web": service(hosts=["web"], pods=[C]),
    },
    limits={"max_body_bytes": None},
    statsd={"address": "127.0.0.1:8125", "prefix": "p"},
    activators={"self": "vm-a", "peers": PEERS, "secret": SECRET},
)
BASE_PATHS = _paths(BASE)


def _replaced(path: tuple[object, ...], value: object) -> dict[str, Any]:
    """BASE with the value at ``path`` replaced."""
    data = copy.deepcopy(BASE)
    parent: Any = data
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = value
    return data


def _check(data: object) -> None:
    try:
        result = parse(data)
    except ConfigError as error:
        assert str(error).startswith("test.yaml")
    else:
        assert isinstance(result, Config)
        describe_config(result)
        assert diff_configs(result, result).is_empty()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ANY_DATA)
def test_any_data_gives_a_config_or_a_config_error(data: object) -> None:
    _check(data)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(BASE_PATHS), ANY_DATA)
def test_any_value_anywhere_in_a_valid_config_gives_a_config_or_a_config_error(
    path: tuple[object, ...], value: object
) -> None:
    _check(_replaced(path, value))


def _mutated(path: tuple[object, ...], value: object) -> Config | None:
    try:
        return parse(_replaced(path, value))
    except ConfigError:
        return None


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(BASE_PATHS), ANY_DATA, st.sampled_from(BASE_PATHS), ANY_DATA)
def test_diff_is_empty_exactly_when_configs_are_equal(
    old_path: tuple[object, ...], old_value: object, new_path: tuple[object, ...], new_value: object
) -> None:
    old, new = _mutated(old_path, old_value), _mutated(new_path, new_value)
    if old is None or new is None:
        return
    diff = diff_configs(old, new)
    assert diff.is_empty() == (old == new)
    assert (diff.describe() == "no changes") == diff.is_empty()

"""The configuration model: frozen values, validated strictly, and what a change means.

This module decides what a valid configuration is. ``parse_config`` takes plain data
(dicts, lists, scalars, as a YAML parser returns them) plus a way to find the line of
each key, and returns a frozen ``Config`` or raises ``ConfigError`` naming file, line
and key. It never reads files itself (``activator.process.configfile`` does).

Rules: unknown keys are errors at every level; integers are ints (not bools or floats);
durations are seconds or strings with a unit (``250ms``, ``30s``, ``5m``, ``1h``);
addresses are ``host:port`` with IPv6 in brackets, stored canonically (lower-case,
compressed IPv6) because a pod's address is its tracker's key, and ``hosts`` in the
form ``normalize_host`` gives a Host header; a host, a pod address
or the ``*`` catch-all belongs to one service only; only ``listen`` and ``admin`` may
use 0.0.0.0. An empty file is an error (an editor's truncated write must not drain
every pod), an explicit ``{}`` or ``services: {}`` is a proxy serving nothing yet.

``diff_configs`` decides what going from one valid config to another means: pods to
add, drain, undrain or unlist per service, settings changed live, and settings that
need a restart (listen, admin, workers). ``describe_config`` is what ``check`` prints.
"""

from __future__ import annotations

import difflib
import enum
import ipaddress
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields, is_dataclass
from typing import Any, TypeVar

from .errors import ConfigError
from .h2budgets import H2Budgets
from .load import DEFAULT_METRIC

LB_POLICIES = ("auto", "first-available", "round-robin", "least-in-flight", "least-loaded")
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_DOTTED_QUAD = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}")
#: More worker processes than this is a typo, not a machine (one per core is the point).
MAX_WORKERS = 256


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ProbeConfig:
    path: str = "/healthz"
    interval: float = 1.0
    timeout: float = 1.0
    healthy_after: int = 1
    unhealthy_after: int = 3


@dataclass(frozen=True)
class LaunchConfig:
    """How activator starts and stops a service's listed pods (``launch:``).

    Exactly one of ``command`` (argv, ``{host}`` and ``{port}`` filled in per pod, run as
    a child) and ``systemd_unit`` (a unit name template, ``systemctl start/stop``).
    """

    command: tuple[str, ...] | None = None
    systemd_unit: str | None = None
    min: int = 0  # pods kept running (0: scale to zero)
    max: int | None = None  # at most this many run; None: every listed pod
    target_concurrency: float = 1.0  # desired pods = ceil(observed concurrency / target)
    stable_window: float = 60.0
    panic_window: float = 6.0  # unset: a tenth of stable_window
    scale_to_zero_after: float = 600.0
    cold_start_timeout: float = 300.0
    stop_pods_on_exit: bool = False


def fill_launch_template(template: str, host: str, port: int) -> str:
    """A launcher's command argument or unit name for one pod (``{host}``, ``{port}``)."""
    return template.format(host=host, port=port)


@dataclass(frozen=True)
class PodConfig:
    address: str  # canonical "host:port" (IPv6 as "[::1]:8000"); the tracker key
    host: str
    port: int
    drain: bool = False


#: The most priority classes a service may have (RFC 9218 has eight urgencies).
MAX_CLASSES = 8
#: The urgency a request without a ``Priority`` header has (RFC 9218 4.1).
DEFAULT_URGENCY = 3


def class_of_urgency(urgency: int, classes: int) -> int:
    """RFC 9218 urgency 0..7 spread over ``classes`` classes (0 is the highest of both)."""
    return urgency * classes // 8


@dataclass(frozen=True)
class PriorityConfig:
    """A service's priority classes (``priority``) and how a request gets one."""

    classes: tuple[str, ...]  # highest first
    default: str  # the class of a request that says nothing (and whose host has none)
    #: The header that names the class: None for RFC 9218's ``Priority: u=N``; else a
    #: lower-case header name, whose (stripped) values map to classes by ``values``.
    header: str | None = None
    values: Mapping[str, str] = field(default_factory=dict)
    hosts: Mapping[str, str] = field(default_factory=dict)  # host -> its default class
    queue_timeout: Mapping[str, float] = field(default_factory=dict)  # class -> its queue_timeout
    #: A lower-class waiter that waited this long goes next; None: strictly by class.
    max_starvation: float | None = None


def tenant_cap(service: ServiceConfig) -> int:
    """How many waiters one tenant may hold: ``tenant_queue_share`` of queue_depth, at least one."""
    return max(1, math.floor(service.tenant_queue_share * service.queue_depth))


def longest_queue_timeout(service: ServiceConfig) -> float:
    """The longest a request of the service may wait for a slot, whatever its class."""
    if service.priority is None:
        return service.queue_timeout
    return max((service.queue_timeout, *service.priority.queue_timeout.values()))


@dataclass(frozen=True)
class FairBy:
    """Who a request's tenant is (``fair_by``): a header's value, or (None) the client's IP."""

    header: str | None = None


@dataclass(frozen=True)
class LoadConfig:
    """Where a service's pods announce their load (``load``): ORCA's response header
    (``path`` None; ``metric`` names the ORCA metric that is the figure), or one gauge
    ``metric`` of the Prometheus text at ``path``, read at each probe interval."""

    metric: str = DEFAULT_METRIC
    path: str | None = None


@dataclass(frozen=True)
class ServiceConfig:
    name: str
    hosts: tuple[str, ...]  # lower-cased, without port; "*" is the catch-all
    container_concurrency: int = 1
    queue_depth: int = 100
    queue_timeout: float = 30.0
    connect_timeout: float = 2.0
    # The whole exchange with the pod, from its request; None = no limit (a long stream).
    request_timeout: float | None = 300.0
    # From the request sent whole to the pod's response head.
    response_start_timeout: float = 300.0
    # Silence from the pod mid-body (a tunnel: either way); None = none of its own.
    idle_timeout: float | None = None
    lb_policy: str = "auto"
    drain_timeout: float = 3600.0
    protocol: str = "http1"  # how the pods are spoken to: http1 | h2c
    # A client that leaves while its request runs on an HTTP/1.1 pod: the pod finishes
    # ("finish", the slot held until its answer) or its connection is closed ("cancel").
    client_gone: str = "finish"
    probe: ProbeConfig | None = None
    pods: tuple[PodConfig, ...] = ()
    priority: PriorityConfig | None = None
    fair_by: FairBy | None = None
    #: With ``fair_by``: one tenant holds at most this share of queue_depth.
    tenant_queue_share: float = 0.5
    #: None: the pods are started by someone else.
    launch: LaunchConfig | None = None
    load: LoadConfig | None = None


@dataclass(frozen=True)
class Http2Limits:
    """What one HTTP/2 client connection may hold and cost (``limits.http2``)."""

    max_concurrent_streams: int = 256
    # The share of a service's queue_depth one connection's streams may hold.
    max_queue_share: float = 0.5
    budgets: H2Budgets = field(default_factory=H2Budgets)


@dataclass(frozen=True)
class LimitsConfig:
    max_connections: int = 10000
    client_timeout: float = 60.0
    max_header_bytes: int = 65536
    max_body_bytes: int | None = None
    http2: Http2Limits = field(default_factory=Http2Limits)


@dataclass(frozen=True)
class StatsdConfig:
    address: Address
    prefix: str = "activator"
    tags: bool = False


@dataclass(frozen=True)
class TlsConfig:
    """The proxy listener speaks TLS with this pair (PEM files, re-read on reload)."""

    cert: str
    key: str


#: How a secret value is shown in a diff or a description.
HIDDEN = "(hidden)"

#: The shortest shared secret accepted (``activators.secret`` / ``secret_file``).
MIN_SECRET_LENGTH = 16


@dataclass(frozen=True)
class ActivatorsConfig:
    self_name: str
    peers: Mapping[str, Address]  # name -> address, includes self_name
    #: The peers' shared secret, given inline (``secret``) or read by the shell from
    #: ``secret_file`` (then filled in here); required with more than one peer.
    secret: str | None = field(default=None, repr=False, metadata={"hidden": True})
    secret_file: str | None = None
    #: Each activator checks each peer this often, waiting this long for an answer; a
    #: peer that does not answer ``unhealthy_after`` checks in a row is down.
    interval: float = 1.0
    timeout: float = 1.0
    unhealthy_after: int = 3


@dataclass(frozen=True)
class Config:
    path: str
    listen: Address = Address("0.0.0.0", 8080)
    admin: Address | None = Address("127.0.0.1", 9090)
    workers: int = 1
    grace_period: float = 30.0
    access_log: bool = True
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    statsd: StatsdConfig | None = None
    tls: TlsConfig | None = None
    activators: ActivatorsConfig | None = None
    services: Mapping[str, ServiceConfig] = field(default_factory=dict)


# --------------------------------------------------------------------------- parsing

#: A key path into the plain data: mapping keys are strings, list positions ints.
KeyPath = tuple[str | int, ...]
#: Gives the 1-based line of a key path (or of its nearest known ancestor).
LineOf = Callable[[KeyPath], int | None]

_TOP_KEYS = (
    "listen",
    "admin",
    "workers",
    "grace_period",
    "access_log",
    "limits",
    "statsd",
    "tls",
    "activators",
    "services",
)
_LIMITS_KEYS = (
    "max_connections",
    "client_timeout",
    "max_header_bytes",
    "max_body_bytes",
    "http2",
)
_HTTP2_KEYS = ("max_concurrent_streams", "max_queue_share", "budgets")
_BUDGET_KEYS = tuple(f.name for f in fields(H2Budgets))
CLIENT_GONE = ("finish", "cancel")
_STATSD_KEYS = ("address", "prefix", "tags")
_ACTIVATORS_KEYS = ("self", "peers", "secret", "secret_file", "interval", "timeout", "unhealthy_after")
_SERVICE_KEYS = (
    "hosts",
    "container_concurrency",
    "queue_depth",
    "queue_timeout",
    "connect_timeout",
    "request_timeout",
    "response_start_timeout",
    "idle_timeout",
    "lb_policy",
    "drain_timeout",
    "protocol",
    "client_gone",
    "probe",
    "pods",
    "priority",
    "fair_by",
    "tenant_queue_share",
    "launch",
    "load",
)
_LOAD_KEYS = ("from", "metric")
# An ORCA metric name (``cpu_utilization``, ``named_metrics.queue``) or a Prometheus one.
_METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_:.]*")
_PRIORITY_KEYS = ("classes", "default", "from", "hosts", "queue_timeout", "max_starvation")
_CLASS_NAME = re.compile(r"[A-Za-z0-9_-]+")
# A header name (RFC 9110 token), as ``from.header`` and ``fair_by.header`` name one.
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_LAUNCH_KEYS = (
    "command",
    "systemd_unit",
    "min",
    "max",
    "target_concurrency",
    "stable_window",
    "panic_window",
    "scale_to_zero_after",
    "cold_start_timeout",
    "stop_pods_on_exit",
)
#: The placeholders a launcher's command or unit template may use.
LAUNCH_PLACEHOLDERS = ("host", "port")
# A systemd unit name: its allowed characters, ending in .service.
_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.@{}\\-]+\.service")
_TLS_KEYS = ("cert", "key")
PROTOCOLS = ("http1", "h2c")
_PROBE_KEYS = ("path", "interval", "timeout", "healthy_after", "unhealthy_after")
_POD_KEYS = ("address", "drain")

# Service names become StatsD name components: no dots, colons, pipes or spaces.
_SERVICE_NAME = re.compile(r"[A-Za-z0-9_-]+")
_PEER_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_STATSD_PREFIX = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
# A probe path goes verbatim into a request line: printable ASCII, no spaces.
_PROBE_PATH = re.compile(r"/[\x21-\x7e]*")
_HOST_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_UNSPECIFIED = ("0.0.0.0", "::")
_T = TypeVar("_T")


def render_key_path(path: KeyPath) -> str:
    """``("services", "api", "pods", 2)`` -> ``services.api.pods[2]``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = f"{out}.{part}" if out else part
    return out


def normalize_host(value: str) -> str:
    """The routing key of a Host header value: lower-cased, without ``:port``.

    IPv6 literals lose their brackets and are compressed (``[0:0::1]:80`` -> ``::1``),
    like ``Address.host``. The config's ``hosts`` are stored in this form, so the router
    should look Host headers up with this same function. Does not validate, never raises.
    """
    host = value.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        return host.partition(":")[0]
    return ipaddress.IPv6Address(host).compressed if _is_ipv6(host) else host


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def format_duration(seconds: float) -> str:
    """A duration the way the YAML file would spell it: ``250ms``, ``30s``, ``5m``, ``1h``, ``1.5s``."""
    if seconds > 0 and seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds > 0 and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    millis = round(seconds * 1000, 6)
    if seconds < 1 and millis.is_integer():
        return f"{int(millis)}ms"
    return f"{seconds!r}s"


def resolve_lb_policy(policy: str, cc: int) -> str:
    """The policy actually used: ``auto`` follows Knative on ``container_concurrency``.

    cc 0 (unlimited) -> least-in-flight, cc 1..3 -> first-available, cc > 3 -> round-robin.
    Any other policy is returned as is. Raises ValueError for an unknown policy or cc < 0.
    """
    if policy not in LB_POLICIES:
        raise ValueError(f"unknown lb_policy {policy!r}")
    if cc < 0:
        raise ValueError(f"container_concurrency must be >= 0, got {cc}")
    if policy != "auto":
        return policy
    if cc == 0:
        return "least-in-flight"
    if cc <= 3:
        return "first-available"
    return "round-robin"


def _describe_value(value: object) -> str:
    """How a wrong value is shown in an error: its YAML kind and a short rendering."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {'true' if value else 'false'}"
    if isinstance(value, (int, float)):
        return f"number {_number(value)}"
    if isinstance(value, str):
        shown = value if len(value) <= 60 else value[:57] + "..."
        return f"string {shown!r}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__}"


def _number(value: float) -> str:
    """A number for a message; Python refuses to print ints of more than 4300 digits."""
    return repr(value) if not isinstance(value, int) or value.bit_length() < 64 else "(huge)"


def parse_config(data: object, *, filename: str, line_of: LineOf) -> Config:
    """Validate the plain data of a config file and return the frozen ``Config``.

    ``data`` is what a YAML parser returns (dicts, lists, scalars); ``line_of`` maps a
    key path to its line. Raises ``ConfigError`` naming file, line and key on the first
    problem found. Pure: no I/O.
    """
    return _Parser(filename, line_of).config(data)


class _Parser:
    """One validation pass over the plain data.

    Each method checks one kind of value at a key path and returns it in its model
    form; ``fail`` turns a key path and a message into the ConfigError to raise.
    """

    def __init__(self, filename: str, line_of: LineOf) -> None:
        self.filename = filename
        self.line_of = line_of

    def fail(self, path: KeyPath, message: str) -> ConfigError:
        return ConfigError(
            message,
            filename=self.filename,
            line=self.line_of(path),
            key=render_key_path(path),
        )

    # -- values

    def section(self, value: object, path: KeyPath, allowed: tuple[str, ...]) -> _Section:
        """A mapping whose keys must all be in ``allowed``; a typo names the allowed keys."""
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a mapping, got {_describe_value(value)}")
        for key in value:
            if not isinstance(key, str):
                raise self.fail(path, f"keys must be strings, got {_describe_value(key)}")
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise self.fail((*path, key), f"unknown key{hint}; allowed: {', '.join(allowed)}")
        return _Section(self, value, path)

    def integer(self, value: object, path: KeyPath, minimum: int, maximum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"must be an integer, got {_describe_value(value)}")
        if value < minimum:
            raise self.fail(path, f"must be >= {minimum}, got {_number(value)}")
        if maximum is not None and value > maximum:
            raise self.fail(path, f"must be <= {maximum}, got {_number(value)}")
        return value

    def boolean(self, value: object, path: KeyPath) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"must be true or false, got {_describe_value(value)}")
        return value

    def name(self, value: object, path: KeyPath, pattern: re.Pattern[str], what: str) -> str:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            raise self.fail(path, f"must be {what}, got {_describe_value(value)}")
        return value

    def duration(self, value: object, path: KeyPath, *, positive: bool) -> float:
        """Seconds, from a number or a string with a unit (ms, s, m, h)."""
        if isinstance(value, str):
            match = _DURATION.fullmatch(value)
            if match is None:
                raise self.fail(
                    path,
                    f"must be seconds or a number with a unit ms, s, m or h (like 250ms, 30s, 5m, 1h), got {value!r}",
                )
            seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            seconds = float(value) if abs(value) < 1e300 else math.inf
        else:
            raise self.fail(
                path,
                f"must be a duration (like 250ms, 30s, 5m, 1h), got {_describe_value(value)}",
            )
        shown = value if isinstance(value, str) else _number(value)
        if not math.isfinite(seconds):
            raise self.fail(path, f"must be a finite duration, got {shown}")
        if positive and seconds <= 0:
            raise self.fail(path, f"must be greater than 0, got {shown}")
        if seconds < 0:
            raise self.fail(path, f"must not be negative, got {shown}")
        return seconds

    def address(self, value: object, path: KeyPath, *, listener: bool = False) -> Address:
        """``host:port`` with an IPv4 address, a host name or a bracketed IPv6 address.

        Only listeners (``listen``, ``admin``) may use the unspecified address
        (0.0.0.0, [::]): the others are addresses to connect to.
        """
        if not isinstance(value, str):
            raise self.fail(path, f"must be an address host:port, got {_describe_value(value)}")
        text = value.strip()
        if text.startswith("["):
            bracketed = re.fullmatch(r"\[([^\]]*)\]:([^:]*)", text)
            if bracketed is None:
                raise self.fail(
                    path,
                    f"must be an address host:port (IPv6 as [::1]:8000), got {value!r}",
                )
            host_text, port_text = bracketed.groups()
            if not _is_ipv6(host_text):
                raise self.fail(path, f"{host_text!r} is not a valid IPv6 address")
            host = ipaddress.IPv6Address(host_text).compressed
        else:
            host_text, colon, port_text = text.rpartition(":")
            if not colon or not host_text:
                raise self.fail(path, f"must be an address host:port, got {value!r}")
            if ":" in host_text:
                raise self.fail(
                    path,
                    f"an IPv6 address needs brackets, like [::1]:8000, got {value!r}",
                )
            host = self.hostname(host_text, path)
        if not (port_text.isascii() and port_text.isdigit()):
            raise self.fail(path, f"port must be a number 1..65535, got {port_text!r}")
        if len(port_text) > 5 or not 1 <= int(port_text) <= 65535:
            shown = port_text if len(port_text) <= 20 else port_text[:17] + "..."
            raise self.fail(path, f"port must be 1..65535, got {shown}")
        if not listener and host in _UNSPECIFIED:
            raise self.fail(path, f"{host} is only for listening; give an address to connect to")
        return Address(host, int(port_text))

    def hostname(self, text: str, path: KeyPath) -> str:
        """A valid IPv4 address or DNS name, lower-cased."""
        host = text.lower()
        if _DOTTED_QUAD.fullmatch(host):
            return host  # already canonical (the common case in a file of 10,000 pods)
        if re.fullmatch(r"[0-9.]+", host):
            try:
                return str(ipaddress.IPv4Address(host))
            except ValueError:
                raise self.fail(path, f"{text!r} is not a valid IPv4 address") from None
        if not (host.isascii() and len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in host.split("."))):
            raise self.fail(path, f"{text!r} is not a valid host name or IP address")
        return host

    # -- sections

    def config(self, data: object) -> Config:
        if data is None:
            raise self.fail((), "the file is empty; expected a mapping")
        top = self.section(data, (), _TOP_KEYS)
        default = Config(path=self.filename)
        listen = default.listen
        if top.has("listen"):
            listen = self.address(top.get("listen"), ("listen",), listener=True)
        admin = default.admin
        if top.has("admin"):
            admin = top.optional("admin", lambda v, p: self.address(v, p, listener=True))
        if admin and admin.port == listen.port and _overlap(admin.host, listen.host):
            raise self.fail(("admin",), f"must not be the proxy's address {listen}")
        tls = top.optional("tls", self.tls)
        activators = top.optional("activators", self.activators)
        if tls is not None and activators is not None and len(activators.peers) > 1:
            # Peers forward and check over plain HTTP on each other's proxy port.
            raise self.fail(
                ("tls",),
                "cannot be combined with several activators yet (peers talk plain HTTP on the proxy port): "
                "terminate TLS in front of the activators",
            )
        workers = top.integer("workers", default.workers, minimum=1, maximum=MAX_WORKERS)
        # The top-level settings before the services: an error is reported in the file's order.
        grace_period = top.duration("grace_period", default.grace_period)
        access_log = top.boolean("access_log", default.access_log)
        limits = self.limits(top.get("limits")) if top.has("limits") else default.limits
        statsd = top.optional("statsd", self.statsd)
        services = self.services(top.get("services"))
        launched = next((name for name, service in services.items() if service.launch is not None), None)
        if workers > 1 and launched is not None:
            raise self.fail(
                ("services", launched, "launch"),
                f"needs workers: 1 for now (got workers: {workers}): one process must decide the launches",
            )
        return Config(
            path=self.filename,
            listen=listen,
            admin=admin,
            workers=workers,
            grace_period=grace_period,
            access_log=access_log,
            limits=limits,
            statsd=statsd,
            tls=tls,
            activators=activators,
            services=services,
        )

    def limits(self, value: object) -> LimitsConfig:
        m = self.section(value, ("limits",), _LIMITS_KEYS)
        d = LimitsConfig()
        return LimitsConfig(
            max_connections=m.integer("max_connections", d.max_connections, minimum=1),
            client_timeout=m.duration("client_timeout", d.client_timeout, positive=True),
            max_header_bytes=m.integer("max_header_bytes", d.max_header_bytes, minimum=1),
            max_body_bytes=m.optional("max_body_bytes", lambda v, p: self.integer(v, p, 0)),
            http2=self.http2(m.get("http2"), m.path("http2")) if m.has("http2") else d.http2,
        )

    def http2(self, value: object, path: KeyPath) -> Http2Limits:
        m = self.section(value, path, _HTTP2_KEYS)
        d = Http2Limits()
        share = d.max_queue_share
        if m.has("max_queue_share"):
            share = self.share(m.get("max_queue_share"), m.path("max_queue_share"))
        budgets = d.budgets
        if m.has("budgets"):
            b = self.section(m.get("budgets"), m.path("budgets"), _BUDGET_KEYS)
            budgets = H2Budgets(
                window=b.duration("window", budgets.window, positive=True),
                **{
                    name: b.integer(name, getattr(budgets, name), minimum=1)
                    for name in _BUDGET_KEYS
                    if name != "window"
                },
            )
        return Http2Limits(
            max_concurrent_streams=m.integer("max_concurrent_streams", d.max_concurrent_streams, minimum=1),
            max_queue_share=share,
            budgets=budgets,
        )

    def share(self, value: object, path: KeyPath) -> float:
        """A share of something: a number above 0 and at most 1."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise self.fail(path, f"must be a number above 0 and at most 1, got {_describe_value(value)}")
        return float(value)

    def statsd(self, value: object, path: KeyPath) -> StatsdConfig:
        m = self.section(value, path, _STATSD_KEYS)
        prefix = m.name("prefix", StatsdConfig.prefix, _STATSD_PREFIX, "dot-separated words of A-Z a-z 0-9 _ -")
        return StatsdConfig(
            address=self.address(m.required("address"), m.path("address")),
            prefix=prefix,
            tags=m.boolean("tags", StatsdConfig.tags),
        )

    def activators(self, value: object, path: KeyPath) -> ActivatorsConfig:
        m = self.section(value, path, _ACTIVATORS_KEYS)
        self_name = m.required("self")
        peers_value = m.required("peers")
        peers_path = m.path("peers")
        if not isinstance(peers_value, dict) or not peers_value:
            raise self.fail(
                peers_path,
                "must be a mapping of peer name to host:port, with at least one peer; "
                f"got {_describe_value(peers_value)}",
            )
        peers: dict[str, Address] = {}
        owner: dict[Address, str] = {}
        for key, address_value in peers_value.items():
            name = self.name(key, peers_path, _PEER_NAME, "a peer name of A-Z a-z 0-9 _ . -")
            address = self.address(address_value, (*peers_path, name))
            if address in owner:
                raise self.fail(
                    (*peers_path, name),
                    f"address {address} is also peer {owner[address]}'s",
                )
            owner[address] = name
            peers[name] = address
        if not isinstance(self_name, str) or self_name not in peers:
            raise self.fail(
                m.path("self"),
                f"must be one of the peers ({', '.join(peers)}), got {_describe_value(self_name)}",
            )
        secret = secret_file = None
        if m.has("secret") and m.has("secret_file"):
            raise self.fail(m.path("secret_file"), "give secret or secret_file, not both")
        if m.has("secret"):
            value = m.get("secret")
            if not isinstance(value, str) or len(value.strip()) < MIN_SECRET_LENGTH:
                raise self.fail(m.path("secret"), f"must be a string of at least {MIN_SECRET_LENGTH} characters")
            secret = value.strip()
        elif m.has("secret_file"):
            secret_file = self.file_path(m.get("secret_file"), m.path("secret_file"))
        elif len(peers) > 1:
            raise self.fail(
                path,
                "secret or secret_file is required with more than one peer "
                "(the peers prove themselves to each other with it)",
            )
        d = ActivatorsConfig(self_name, peers)
        return ActivatorsConfig(
            self_name=self_name,
            peers=peers,
            secret=secret,
            secret_file=secret_file,
            interval=m.duration("interval", d.interval, positive=True),
            timeout=m.duration("timeout", d.timeout, positive=True),
            unhealthy_after=m.integer("unhealthy_after", d.unhealthy_after, minimum=1),
        )

    def services(self, value: object) -> dict[str, ServiceConfig]:
        """Every service; a host or a pod may belong to one service only."""
        if value is None:
            return {}
        path: KeyPath = ("services",)
        if not isinstance(value, dict):
            raise self.fail(
                path,
                f"must be a mapping of service name to service, got {_describe_value(value)}",
            )
        services: dict[str, ServiceConfig] = {}
        host_owner: dict[str, str] = {}
        pod_owner: dict[str, str] = {}
        for key, body in value.items():
            name = self.name(key, path, _SERVICE_NAME, "a service name of A-Z a-z 0-9 _ -")
            service = self.service(body, (*path, name))
            for index, host in enumerate(service.hosts):
                if host in host_owner:
                    raise self.fail(
                        (*path, name, "hosts", index),
                        f"host {host!r} is in both services {host_owner[host]} and {name}",
                    )
                host_owner[host] = name
            for index, pod in enumerate(service.pods):
                if pod.address in pod_owner:
                    raise self.fail(
                        (*path, name, "pods", index),
                        f"pod {pod.address} is in both services {pod_owner[pod.address]} and {name}",
                    )
                pod_owner[pod.address] = name
            services[name] = service
        return services

    def service(self, value: object, path: KeyPath) -> ServiceConfig:
        name = str(path[-1])
        m = self.section(value, path, _SERVICE_KEYS)
        d = ServiceConfig(name=name, hosts=())
        lb_policy = d.lb_policy
        if m.has("lb_policy"):
            lb_value = m.get("lb_policy")
            if not isinstance(lb_value, str) or lb_value not in LB_POLICIES:
                raise self.fail(
                    m.path("lb_policy"),
                    f"must be one of {', '.join(LB_POLICIES)}, got {_describe_value(lb_value)}",
                )
            lb_policy = lb_value
        hosts = self.hosts(m.required("hosts"), m.path("hosts"))
        pods = self.pods(m.get("pods"), m.path("pods"))
        launch = m.optional("launch", lambda v, p: self.launch(v, p, pods))
        if launch is not None and m.get("probe") is None:
            raise self.fail(
                m.path("launch"),
                "needs a probe: a started pod takes requests once its probe passes (probe: {path: ...})",
            )
        service = ServiceConfig(
            name=name,
            hosts=hosts,
            container_concurrency=m.integer("container_concurrency", d.container_concurrency, minimum=0),
            queue_depth=m.integer("queue_depth", d.queue_depth, minimum=0),
            queue_timeout=m.duration("queue_timeout", d.queue_timeout),
            connect_timeout=m.duration("connect_timeout", d.connect_timeout, positive=True),
            request_timeout=m.optional_duration("request_timeout", d.request_timeout),
            response_start_timeout=m.duration("response_start_timeout", d.response_start_timeout, positive=True),
            idle_timeout=m.optional_duration("idle_timeout", d.idle_timeout),
            lb_policy=lb_policy,
            drain_timeout=m.duration("drain_timeout", d.drain_timeout),
            protocol=self.protocol(m),
            client_gone=self.choice(m, "client_gone", CLIENT_GONE, d.client_gone),
            probe=m.optional("probe", self.probe),
            pods=pods,
            priority=m.optional("priority", self.priority),
            fair_by=m.optional("fair_by", self.fair_by),
            tenant_queue_share=(
                self.share(m.get("tenant_queue_share"), m.path("tenant_queue_share"))
                if m.has("tenant_queue_share")
                else d.tenant_queue_share
            ),
            launch=launch,
            load=m.optional("load", self.load),
        )
        if service.priority is not None:
            for host in service.priority.hosts:
                if host not in service.hosts:
                    raise self.fail((*path, "priority", "hosts", host), "is not one of the service's hosts")
        if service.lb_policy == "least-loaded" and service.load is None:
            raise self.fail(m.path("lb_policy"), "least-loaded needs load (where the pods announce it)")
        if service.load is not None and service.load.path is not None and service.probe is None:
            raise self.fail(m.path("load"), "a gauge is read at each probe: it needs probe")
        if m.has("tenant_queue_share") and service.fair_by is None:
            raise self.fail(m.path("tenant_queue_share"), "needs fair_by (who a tenant is)")
        return service

    def priority(self, value: object, path: KeyPath) -> PriorityConfig:
        m = self.section(value, path, _PRIORITY_KEYS)
        listed = m.required("classes")
        if not isinstance(listed, list) or not listed:
            raise self.fail(
                m.path("classes"), f"must be a non-empty list of class names, got {_describe_value(listed)}"
            )
        if len(listed) > MAX_CLASSES:
            raise self.fail(m.path("classes"), f"at most {MAX_CLASSES} classes, got {len(listed)}")
        classes: list[str] = []
        for index, item in enumerate(listed):
            name = self.name(item, (*m.path("classes"), index), _CLASS_NAME, "a class name of A-Z a-z 0-9 _ -")
            if name in classes:
                raise self.fail((*m.path("classes"), index), f"class {name!r} is listed twice")
            classes.append(name)

        def known(item: object, item_path: KeyPath) -> str:
            if not isinstance(item, str) or item not in classes:
                raise self.fail(
                    item_path, f"must be one of the classes {', '.join(classes)}, got {_describe_value(item)}"
                )
            return item

        default = classes[class_of_urgency(DEFAULT_URGENCY, len(classes))]
        if m.has("default"):
            default = known(m.get("default"), m.path("default"))
        header, values = self.priority_source(m.get("from") if m.has("from") else "rfc9218", m.path("from"), known)
        hosts: dict[str, str] = {}
        if m.has("hosts"):
            host_map = self.mapping(m.get("hosts"), m.path("hosts"), "host to class")
            hosts = {self.host(h, (*m.path("hosts"), h)): known(c, (*m.path("hosts"), h)) for h, c in host_map.items()}
        timeouts: dict[str, float] = {}
        if m.has("queue_timeout"):
            timeout_map = self.mapping(m.get("queue_timeout"), m.path("queue_timeout"), "class to duration")
            for key, seconds in timeout_map.items():
                where = (*m.path("queue_timeout"), key)
                timeouts[known(key, where)] = self.duration(seconds, where, positive=False)
        return PriorityConfig(
            classes=tuple(classes),
            default=default,
            header=header,
            values=values,
            hosts=hosts,
            queue_timeout=timeouts,
            max_starvation=m.optional_duration("max_starvation", None),
        )

    def priority_source(
        self, value: object, path: KeyPath, known: Callable[[object, KeyPath], str]
    ) -> tuple[str | None, dict[str, str]]:
        """``from``: ``rfc9218`` (None, no map), or ``{header: NAME, values: {VALUE: CLASS}}``."""
        if value == "rfc9218":
            return None, {}
        if not isinstance(value, dict):
            raise self.fail(
                path, f"must be rfc9218 or {{header: NAME, values: {{VALUE: CLASS}}}}, got {_describe_value(value)}"
            )
        m = self.section(value, path, ("header", "values"))
        header = self.name(m.required("header"), m.path("header"), _HEADER_NAME, "a header name").lower()
        value_map = self.mapping(m.required("values"), m.path("values"), "header value to class")
        values = {str(key).strip(): known(c, (*m.path("values"), key)) for key, c in value_map.items()}
        return header, values

    def fair_by(self, value: object, path: KeyPath) -> FairBy:
        """``client_ip`` or ``{header: NAME}``."""
        if value == "client_ip":
            return FairBy()
        if not isinstance(value, dict):
            raise self.fail(path, f"must be null, client_ip or {{header: NAME}}, got {_describe_value(value)}")
        m = self.section(value, path, ("header",))
        return FairBy(self.name(m.required("header"), m.path("header"), _HEADER_NAME, "a header name").lower())

    def load(self, value: object, path: KeyPath) -> LoadConfig:
        """``{from: orca, metric: NAME}`` or ``{from: {path: /metrics, metric: NAME}}``."""
        m = self.section(value, path, _LOAD_KEYS)
        source = m.required("from")
        if source == "orca":
            return LoadConfig(m.name("metric", DEFAULT_METRIC, _METRIC_NAME, "an ORCA metric name"))
        if not isinstance(source, dict):
            raise self.fail(
                m.path("from"), f"must be orca or {{path: /metrics, metric: NAME}}, got {_describe_value(source)}"
            )
        if m.has("metric"):
            raise self.fail(m.path("metric"), "with a Prometheus gauge, the metric goes in from")
        g = self.section(source, m.path("from"), ("path", "metric"))
        return LoadConfig(
            metric=self.name(g.required("metric"), g.path("metric"), _METRIC_NAME, "a Prometheus metric name"),
            path=g.name("path", "/metrics", _PROBE_PATH, "a URL path starting with / (no spaces)"),
        )

    def mapping(self, value: object, path: KeyPath, what: str) -> dict[str | int, object]:
        """A non-empty mapping with scalar keys (a YAML number key is taken as its text)."""
        if not isinstance(value, dict) or not value:
            raise self.fail(path, f"must be a non-empty mapping of {what}, got {_describe_value(value)}")
        for key in value:
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise self.fail(path, f"keys must be strings, got {_describe_value(key)}")
        return value

    def launch(self, value: object, path: KeyPath, pods: tuple[PodConfig, ...]) -> LaunchConfig:
        m = self.section(value, path, _LAUNCH_KEYS)
        d = LaunchConfig()
        if m.has("command") == m.has("systemd_unit"):
            raise self.fail(path, "give command or systemd_unit (exactly one): how a pod is started")
        command = systemd_unit = None
        if m.has("command"):
            command = self.command(m.get("command"), m.path("command"))
        else:
            systemd_unit = self.unit_template(m.get("systemd_unit"), m.path("systemd_unit"))
        listed = sum(1 for pod in pods if not pod.drain)
        minimum = m.integer("min", d.min, minimum=0)
        maximum = m.optional("max", lambda v, p: self.integer(v, p, 1))
        if minimum > listed:
            raise self.fail(m.path("min"), f"must be at most the {listed} listed pods (without drain), got {minimum}")
        if maximum is not None and maximum < minimum:
            raise self.fail(m.path("max"), f"must be at least min ({minimum}), got {maximum}")
        target = d.target_concurrency
        if m.has("target_concurrency"):
            value = m.get("target_concurrency")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise self.fail(m.path("target_concurrency"), f"must be a number above 0, got {_describe_value(value)}")
            target = float(value)
        stable = m.duration("stable_window", d.stable_window, positive=True)
        # Knative's default: the panic window is a tenth of the stable window.
        panic = m.duration("panic_window", stable * d.panic_window / d.stable_window, positive=True)
        if panic > stable:
            raise self.fail(
                m.path("panic_window"),
                f"must not be longer than stable_window ({format_duration(stable)}), got {format_duration(panic)}",
            )
        return LaunchConfig(
            command=command,
            systemd_unit=systemd_unit,
            min=minimum,
            max=maximum,
            target_concurrency=target,
            stable_window=stable,
            panic_window=panic,
            scale_to_zero_after=m.duration("scale_to_zero_after", d.scale_to_zero_after),
            cold_start_timeout=m.duration("cold_start_timeout", d.cold_start_timeout, positive=True),
            stop_pods_on_exit=m.boolean("stop_pods_on_exit", d.stop_pods_on_exit),
        )

    def command(self, value: object, path: KeyPath) -> tuple[str, ...]:
        """An argv: a non-empty list of strings, placeholders ``{host}`` and ``{port}`` only."""
        if not isinstance(value, list) or not value:
            raise self.fail(path, f"must be a non-empty list of strings (an argv), got {_describe_value(value)}")
        argv = []
        for index, item in enumerate(value):
            if not isinstance(item, (str, int)) or isinstance(item, bool):
                raise self.fail((*path, index), f"must be a string, got {_describe_value(item)}")
            argv.append(self.template(str(item), (*path, index)))
        if not argv[0]:
            raise self.fail((*path, 0), "must name the program to run")
        return tuple(argv)

    def unit_template(self, value: object, path: KeyPath) -> str:
        """A unit name template like ``model@{port}.service``: one unit per pod."""
        if not isinstance(value, str) or not _UNIT_NAME.fullmatch(value):
            raise self.fail(
                path,
                f"must be a unit name ending in .service, like model@{{port}}.service, got {_describe_value(value)}",
            )
        if "{port}" not in value and "{host}" not in value:
            raise self.fail(path, "must contain {port} or {host}: each pod needs its own unit")
        return self.template(value, path)

    def template(self, text: str, path: KeyPath) -> str:
        """A string whose only placeholders are ``{host}`` and ``{port}`` (``{{`` for a brace)."""
        try:
            text.format(**{name: "" for name in LAUNCH_PLACEHOLDERS})
        except (KeyError, IndexError, ValueError) as error:
            raise self.fail(
                path, f"only {{host}} and {{port}} may be filled in ({{{{ for a brace}}), got {text!r}: {error}"
            ) from None
        return text

    def protocol(self, m: _Section) -> str:
        value = m.get("protocol") if m.has("protocol") else "http1"
        if not isinstance(value, str) or value not in PROTOCOLS:
            raise self.fail(m.path("protocol"), f"must be one of {', '.join(PROTOCOLS)}, got {_describe_value(value)}")
        return value

    def choice(self, m: _Section, key: str, allowed: tuple[str, ...], default: str) -> str:
        value = m.get(key) if m.has(key) else default
        if not isinstance(value, str) or value not in allowed:
            raise self.fail(m.path(key), f"must be one of {', '.join(allowed)}, got {_describe_value(value)}")
        return value

    def tls(self, value: object, path: KeyPath) -> TlsConfig:
        m = self.section(value, path, _TLS_KEYS)
        return TlsConfig(
            cert=self.file_path(m.required("cert"), m.path("cert")),
            key=self.file_path(m.required("key"), m.path("key")),
        )

    def file_path(self, value: object, path: KeyPath) -> str:
        """A file's path (whether it can be read is checked by the shell, ``check`` included)."""
        if not isinstance(value, str) or not value.strip():
            raise self.fail(path, f"must be a file path, got {_describe_value(value)}")
        return value

    def hosts(self, value: object, path: KeyPath) -> tuple[str, ...]:
        if not isinstance(value, list) or not value:
            raise self.fail(
                path,
                f"must be a non-empty list of Host header values, got {_describe_value(value)}",
            )
        hosts: list[str] = []
        for index, item in enumerate(value):
            host = self.host(item, (*path, index))
            if host in hosts:
                raise self.fail((*path, index), f"host {host!r} is listed twice")
            hosts.append(host)
        return tuple(hosts)

    def host(self, value: object, path: KeyPath) -> str:
        """One ``hosts`` entry, validated, in its routing form (see ``normalize_host``)."""
        if not isinstance(value, str):
            raise self.fail(path, f"must be a host name, got {_describe_value(value)}")
        text = value.strip()
        if text == "*":
            return "*"
        if "*" in text:
            raise self.fail(path, f"only a lone '*' (the catch-all) may use '*', got {value!r}")
        if text.startswith("["):
            match = re.fullmatch(r"\[([^\]]*)\](?::[0-9]+)?", text)
            valid = match is not None and _is_ipv6(match.group(1))
        elif text.count(":") > 1:
            valid = _is_ipv6(text)
        else:
            name, colon, port = text.partition(":")
            valid = not colon or (port.isascii() and port.isdigit())
            if valid:
                self.hostname(name, path)
        if not valid:
            raise self.fail(
                path,
                f"must be a host name or IP address, optionally with :port, got {value!r}",
            )
        return normalize_host(text)

    def probe(self, value: object, path: KeyPath) -> ProbeConfig:
        m = self.section(value, path, _PROBE_KEYS)
        d = ProbeConfig()
        probe_path = m.name("path", d.path, _PROBE_PATH, "a URL path starting with / (no spaces)")
        return ProbeConfig(
            path=probe_path,
            interval=m.duration("interval", d.interval, positive=True),
            timeout=m.duration("timeout", d.timeout, positive=True),
            healthy_after=m.integer("healthy_after", d.healthy_after, minimum=1),
            unhealthy_after=m.integer("unhealthy_after", d.unhealthy_after, minimum=1),
        )

    def pods(self, value: object, path: KeyPath) -> tuple[PodConfig, ...]:
        if value is None:
            return ()
        if not isinstance(value, list):
            raise self.fail(path, f"must be a list of pods, got {_describe_value(value)}")
        pods: list[PodConfig] = []
        first: dict[str, int] = {}
        for index, item in enumerate(value):
            pod = self.pod(item, (*path, index))
            if pod.address in first:
                raise self.fail(
                    (*path, index),
                    f"pod {pod.address} is listed twice (also pods[{first[pod.address]}])",
                )
            first[pod.address] = index
            pods.append(pod)
        return tuple(pods)

    def pod(self, value: object, path: KeyPath) -> PodConfig:
        """A pod: ``host:port``, or ``{address: host:port, drain: true|false}``."""
        if isinstance(value, dict):
            m = self.section(value, path, _POD_KEYS)
            address = self.address(m.required("address"), m.path("address"))
            drain = m.boolean("drain", False)
        elif isinstance(value, str):
            address = self.address(value, path)
            drain = False
        else:
            raise self.fail(
                path,
                f"a pod is host:port or {{address: host:port, drain: true}}, got {_describe_value(value)}",
            )
        return PodConfig(address=str(address), host=address.host, port=address.port, drain=drain)


class _Section:
    """A mapping already checked for unknown keys; absent keys give their default."""

    def __init__(self, parser: _Parser, mapping: dict[str, object], path: KeyPath) -> None:
        self.parser = parser
        self.mapping = mapping
        self.where = path

    def path(self, key: str) -> KeyPath:
        return (*self.where, key)

    def has(self, key: str) -> bool:
        return key in self.mapping

    def get(self, key: str) -> object:
        return self.mapping.get(key)

    def required(self, key: str) -> object:
        if key not in self.mapping:
            raise self.parser.fail(self.path(key), "required")
        return self.mapping[key]

    def optional(self, key: str, parse: Callable[[object, KeyPath], _T]) -> _T | None:
        """Absent or null is None; anything else is parsed."""
        value = self.mapping.get(key)
        return None if value is None else parse(value, self.path(key))

    def integer(self, key: str, default: int, *, minimum: int, maximum: int | None = None) -> int:
        if key not in self.mapping:
            return default
        return self.parser.integer(self.mapping[key], self.path(key), minimum, maximum)

    def boolean(self, key: str, default: bool) -> bool:
        if key not in self.mapping:
            return default
        return self.parser.boolean(self.mapping[key], self.path(key))

    def name(self, key: str, default: str, pattern: re.Pattern[str], what: str) -> str:
        if key not in self.mapping:
            return default
        return self.parser.name(self.mapping[key], self.path(key), pattern, what)

    def duration(self, key: str, default: float, *, positive: bool = False) -> float:
        """``positive``: zero makes no sense (a timeout of zero could never be met)."""
        if key not in self.mapping:
            return default
        return self.parser.duration(self.mapping[key], self.path(key), positive=positive)

    def optional_duration(self, key: str, default: float | None) -> float | None:
        """A positive duration, or ``null`` for none (no limit)."""
        if key not in self.mapping:
            return default
        value = self.mapping[key]
        return None if value is None else self.parser.duration(value, self.path(key), positive=True)


def _overlap(a: str, b: str) -> bool:
    """Whether two listen hosts could share a socket address (same, or a wildcard)."""
    return a == b or a in _UNSPECIFIED or b in _UNSPECIFIED


# --------------------------------------------------------------------------- diff

#: Top-level settings that only take effect on restart: the sockets and the processes.
RESTART_SETTINGS = ("listen", "admin", "workers")
# Dataclass fields whose YAML key is spelled differently.
_YAML_NAMES = {"self_name": "self"}


@dataclass(frozen=True)
class Change:
    """One setting that differs: ``name`` is its dotted YAML path below the service or top level."""

    name: str
    old: object
    new: object

    def describe(self) -> str:
        return f"{self.name} {_show(self.old)} -> {_show(self.new)}"


class Listing(enum.Enum):
    """How a file lists a pod: the part of a config change the pod state machine sees."""

    ABSENT = "absent"
    ACTIVE = "active"  # listed, drain: false
    DRAINED = "drained"  # listed, drain: true


@dataclass(frozen=True)
class PodChange:
    """A pod whose listing differs between two configs of a service."""

    address: str
    before: Listing
    after: Listing


def pod_changes(old: ServiceConfig | None, new: ServiceConfig | None) -> tuple[PodChange, ...]:
    """The pods whose listing changes, in file order (old pods first). Pure.

    This is the one definition of what a change of ``pods`` means: ``diff_configs``
    describes it, the throttler applies it.
    """
    before = {pod.address: pod.drain for pod in (old.pods if old else ())}
    after = {pod.address: pod.drain for pod in (new.pods if new else ())}
    changes = []
    for address in [*before, *(a for a in after if a not in before)]:
        was, now = _listing(before.get(address)), _listing(after.get(address))
        if was is not now:
            changes.append(PodChange(address, was, now))
    return tuple(changes)


def _listing(drain: bool | None) -> Listing:
    if drain is None:
        return Listing.ABSENT
    return Listing.DRAINED if drain else Listing.ACTIVE


@dataclass(frozen=True)
class ServiceDiff:
    """What changes for one service: its pods' listings and its settings.

    ``pods`` holds every pod whose listing changes (``pod_changes``). In words: ``add_pods``
    were not listed and are now active; ``drain_pods`` were active and are now drained or
    unlisted, or appear already drained; ``undrain_pods`` were drained and are active
    again; ``unlist_pods`` were drained and are now unlisted.
    """

    name: str
    pods: tuple[PodChange, ...] = ()
    changes: tuple[Change, ...] = ()
    #: The listed pods are the same but in another order (first-available follows it).
    reordered: bool = False

    def _addresses(self, *moves: tuple[Listing, Listing]) -> tuple[str, ...]:
        return tuple(change.address for change in self.pods if (change.before, change.after) in moves)

    @property
    def add_pods(self) -> tuple[str, ...]:
        return self._addresses((Listing.ABSENT, Listing.ACTIVE))

    @property
    def drain_pods(self) -> tuple[str, ...]:
        return self._addresses(
            (Listing.ACTIVE, Listing.DRAINED), (Listing.ACTIVE, Listing.ABSENT), (Listing.ABSENT, Listing.DRAINED)
        )

    @property
    def undrain_pods(self) -> tuple[str, ...]:
        return self._addresses((Listing.DRAINED, Listing.ACTIVE))

    @property
    def unlist_pods(self) -> tuple[str, ...]:
        return self._addresses((Listing.DRAINED, Listing.ABSENT))

    def is_empty(self) -> bool:
        return not (self.pods or self.changes or self.reordered)


@dataclass(frozen=True)
class ConfigDiff:
    """What applying a new config means, from the old one.

    ``services`` holds a non-empty ``ServiceDiff`` for every service that changes, added and
    removed ones included (an added service adds its pods, a removed one drains them).
    ``restart_needed`` are changes of ``RESTART_SETTINGS``; ``changes`` the other top-level
    ones (limits, statsd, access_log, grace_period, activators), applied live.
    """

    added_services: tuple[str, ...] = ()
    removed_services: tuple[str, ...] = ()
    services: tuple[ServiceDiff, ...] = ()
    restart_needed: tuple[Change, ...] = ()
    changes: tuple[Change, ...] = ()

    @property
    def peers_changed(self) -> bool:
        """The activators changed: every service's slots are divided again."""
        return any(change.name.split(".")[0] == "activators" for change in self.changes)

    def service(self, name: str) -> ServiceDiff | None:
        """The diff of one service, or None when it does not change."""
        return next((service for service in self.services if service.name == name), None)

    def is_empty(self) -> bool:
        return not (
            self.added_services or self.removed_services or self.services or self.restart_needed or self.changes
        )

    def describe(self) -> str:
        """One human line per change, like ``service api: add pod 10.0.1.7:8000``."""
        if self.is_empty():
            return "no changes"
        lines = [f"restart needed: {change.describe()}" for change in self.restart_needed]
        lines += [change.describe() for change in self.changes]
        lines += [f"add service {name}" for name in self.added_services]
        lines += [f"remove service {name}" for name in self.removed_services]
        for service in self.services:
            prefix = f"service {service.name}:"
            lines += [f"{prefix} {change.describe()}" for change in service.changes]
            lines += [f"{prefix} add pod {address}" for address in service.add_pods]
            lines += [f"{prefix} undrain pod {address}" for address in service.undrain_pods]
            lines += [f"{prefix} drain pod {address}" for address in service.drain_pods]
            lines += [f"{prefix} unlist drained pod {address}" for address in service.unlist_pods]
            if service.reordered:
                lines.append(f"{prefix} pods listed in a new order")
        return "\n".join(lines)


def diff_configs(old: Config, new: Config) -> ConfigDiff:
    """Compare two valid configs (the running one and a new one). Pure."""
    top = [c for c in _changes("", old, new) if c.name not in ("path", "services")]
    services = []
    for name in [*old.services, *(n for n in new.services if n not in old.services)]:
        service = _service_diff(name, old.services.get(name), new.services.get(name))
        if not service.is_empty():
            services.append(service)
    return ConfigDiff(
        added_services=tuple(n for n in new.services if n not in old.services),
        removed_services=tuple(n for n in old.services if n not in new.services),
        services=tuple(services),
        restart_needed=tuple(c for c in top if c.name in RESTART_SETTINGS),
        changes=tuple(c for c in top if c.name not in RESTART_SETTINGS),
    )


def _service_diff(name: str, old: ServiceConfig | None, new: ServiceConfig | None) -> ServiceDiff:
    changes: tuple[Change, ...] = ()
    reordered = False
    if old is not None and new is not None:
        changes = tuple(c for c in _changes("", old, new) if c.name not in ("name", "pods"))
        kept = {pod.address for pod in old.pods} & {pod.address for pod in new.pods}
        reordered = [p.address for p in old.pods if p.address in kept] != [
            p.address for p in new.pods if p.address in kept
        ]
    return ServiceDiff(name, pod_changes(old, new), changes, reordered)


def _changes(prefix: str, old: object, new: object) -> list[Change]:
    """Field-by-field differences of two config dataclasses of the same type.

    Recurses into nested sections when both sides have one (``probe.interval``,
    ``limits.client_timeout``); an ``Address`` or a section appearing or disappearing is
    one change.
    """
    changes: list[Change] = []
    if not is_dataclass(old) or isinstance(old, type):
        raise TypeError(f"not a config dataclass instance: {old!r}")
    for f in fields(old):
        name = prefix + _YAML_NAMES.get(f.name, f.name)
        before, after = getattr(old, f.name), getattr(new, f.name)
        if before == after:
            continue
        if f.metadata.get("hidden"):  # never in a log line; only whether there is one
            changes.append(Change(name, None if before is None else HIDDEN, None if after is None else HIDDEN))
            continue
        nested = is_dataclass(before) and type(before) is type(after) and not isinstance(before, Address)
        if nested:
            changes += _changes(f"{name}.", before, after)
        else:
            changes.append(Change(name, before, after))
    return changes


def _shown_value(section: Any, f: Field[Any]) -> object:
    return HIDDEN if f.metadata.get("hidden") else getattr(section, f.name)


def _show(value: object) -> str:
    """A config value the way the YAML file would spell it (durations with a unit)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format_duration(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_show(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key}: {_show(item)}" for key, item in value.items()) + "}"
    if is_dataclass(value) and not isinstance(value, (Address, type)):
        shown = (f"{_YAML_NAMES.get(f.name, f.name)}: {_show(_shown_value(value, f))}" for f in fields(value))
        return "{" + ", ".join(shown) + "}"
    return str(value)


# --------------------------------------------------------------------------- check


def describe_config(config: Config) -> str:
    """What ``activator check`` prints for a valid file: where it listens, then each service."""
    limits = config.limits
    max_body = "unlimited" if limits.max_body_bytes is None else str(limits.max_body_bytes)
    lines = [
        f"config {config.path}",
        f"listen {config.listen}" + (f" (TLS: cert {config.tls.cert}, key {config.tls.key})" if config.tls else ""),
        f"admin {config.admin}" if config.admin else "admin disabled",
        f"workers {config.workers}, grace_period {format_duration(config.grace_period)}, "
        + f"access_log {_show(config.access_log)}",
        f"limits: max_connections {limits.max_connections}, "
        + f"client_timeout {format_duration(limits.client_timeout)}, "
        + f"max_header_bytes {limits.max_header_bytes}, max_body_bytes {max_body}",
    ]
    statsd = config.statsd
    if statsd is None:
        lines.append("statsd disabled")
    else:
        lines.append(f"statsd {statsd.address}, prefix {statsd.prefix}, tags {_show(statsd.tags)}")
    if config.activators is not None:
        peers = ", ".join(f"{name} {address}" for name, address in config.activators.peers.items())
        lines.append(f"activators: self {config.activators.self_name}; peers {peers}")
    if not config.services:
        lines.append("no services")
    for service in config.services.values():
        lines += ["", *_describe_service(service)]
    return "\n".join(lines)


def _optional_duration(seconds: float | None) -> str:
    return "none" if seconds is None else format_duration(seconds)


def _describe_service(service: ServiceConfig) -> list[str]:
    cc = service.container_concurrency
    resolved = resolve_lb_policy(service.lb_policy, cc)
    lb = service.lb_policy if resolved == service.lb_policy else f"{service.lb_policy} -> {resolved}"
    lines = [
        f"service {service.name}",
        f"  hosts: {', '.join(h if h != '*' else '* (catch-all)' for h in service.hosts)}",
        f"  container_concurrency {cc}{' (unlimited)' if cc == 0 else ''}, "
        + f"queue_depth {service.queue_depth}, "
        + f"queue_timeout {format_duration(service.queue_timeout)}",
        f"  connect_timeout {format_duration(service.connect_timeout)}, "
        + f"response_start_timeout {format_duration(service.response_start_timeout)}, "
        + f"idle_timeout {_optional_duration(service.idle_timeout)}, "
        + f"request_timeout {_optional_duration(service.request_timeout)}, "
        + f"drain_timeout {format_duration(service.drain_timeout)}",
        f"  lb_policy {lb}, pods spoken to over "
        + ("HTTP/2 (h2c)" if service.protocol == "h2c" else f"HTTP/1.1, client_gone {service.client_gone}"),
    ]
    probe = service.probe
    if probe is None:
        lines.append("  probe: none (pods are routable as soon as listed)")
    else:
        lines.append(
            f"  probe: GET {probe.path} every {format_duration(probe.interval)}, "
            + f"timeout {format_duration(probe.timeout)}, healthy after {probe.healthy_after}, "
            + f"unhealthy after {probe.unhealthy_after}"
        )
    lines += _describe_queue(service)
    launch = service.launch
    if launch is not None:
        how = f"systemctl start {launch.systemd_unit}" if launch.systemd_unit else " ".join(launch.command or ())
        lines.append(
            f"  launch: {how}; min {launch.min}, max {launch.max if launch.max is not None else 'every listed pod'}, "
            + f"target_concurrency {launch.target_concurrency:g}, "
            + f"stable_window {format_duration(launch.stable_window)}, "
            + f"panic_window {format_duration(launch.panic_window)}, "
            + f"scale_to_zero_after {format_duration(launch.scale_to_zero_after)}, "
            + f"cold_start_timeout {format_duration(launch.cold_start_timeout)}, "
            + f"stop_pods_on_exit {_show(launch.stop_pods_on_exit)}"
        )
    load = service.load
    if load is not None:
        where = "the endpoint-load-metrics header (ORCA)" if load.path is None else f"GET {load.path} at each probe"
        lines.append(f"  load: {load.metric} from {where}")
    lines.append(f"  pods ({len(service.pods)}):" if service.pods else "  pods: none")
    lines += [f"    {pod.address}{'  (drain)' if pod.drain else ''}" for pod in service.pods]
    return lines


def _describe_queue(service: ServiceConfig) -> list[str]:
    """The queue's classes and tenants, as ``check`` shows them (nothing for one FIFO)."""
    lines = []
    priority = service.priority
    if priority is not None:
        source = "Priority: u=0..7 (RFC 9218)" if priority.header is None else f"header {priority.header}"
        lines.append(f"  priority classes, highest first: {', '.join(priority.classes)}; from {source}")
        spread = [class_of_urgency(u, len(priority.classes)) for u in range(8)]
        if priority.header is None:
            ranges = []
            for index, name in enumerate(priority.classes):
                urgencies = [u for u in range(8) if spread[u] == index]
                if urgencies:
                    ranges.append(f"u={urgencies[0]}..{urgencies[-1]} {name}")
            lines.append(f"    {', '.join(ranges)}")
        else:
            lines += [f"    {value!r} -> {name}" for value, name in priority.values.items()]
        lines.append(f"    default {priority.default}" + "".join(f"; {h} -> {c}" for h, c in priority.hosts.items()))
        for name in priority.classes:
            if name in priority.queue_timeout:
                lines.append(f"    {name}: queue_timeout {format_duration(priority.queue_timeout[name])}")
        starvation = priority.max_starvation
        lines.append(
            "    strictly by class" if starvation is None else f"    max_starvation {format_duration(starvation)}"
        )
    if service.fair_by is not None:
        who = "client IP" if service.fair_by.header is None else f"header {service.fair_by.header}"
        cap = tenant_cap(service)
        lines.append(
            f"  fair_by {who}: round-robin between tenants, each at most {cap} queued"
            + f" (tenant_queue_share {service.tenant_queue_share:g})"
        )
    return lines

"""Which priority class and which tenant a request belongs to, read from its head.

A service's ``priority`` names its classes, highest first, and how a request gets one:

- ``from: rfc9218`` (the default): the urgency of the standard ``Priority`` header
  (RFC 9218: ``u=0`` most urgent .. ``u=7``; absent or unreadable: no urgency given),
  spread evenly over the classes (``config.class_of_urgency``);
- ``from: {header: NAME, values: {VALUE: CLASS}}``: that header's value, looked up;
- a request that says nothing (or a value not in the map) gets its host's class from
  ``hosts``, else ``default``.

With ``fair_by``, the tenant is a header's value (the first line; cut to
``MAX_TENANT_KEY`` bytes; a request without one shares the tenant ``b""``) or the
client's IP. ``queue_policy`` is what the service's ``WaitQueue`` enforces.

Pure; the shell calls ``Classifier.classify`` once per request, and only for a
service that has ``priority`` or ``fair_by`` (``Classifier.active``).
"""

from __future__ import annotations

from collections.abc import Sequence

from .config import ServiceConfig, class_of_urgency, normalize_host, tenant_cap
from .waitqueue import QueuePolicy

#: A tenant key longer than this is cut (it is client input, kept while queued).
MAX_TENANT_KEY = 128
_PRIORITY = b"priority"


def queue_policy(config: ServiceConfig) -> QueuePolicy:
    """The ``WaitQueue`` policy of a service."""
    priority = config.priority
    fair = config.fair_by is not None
    if priority is None and not fair:
        return QueuePolicy()
    return QueuePolicy(
        classes=len(priority.classes) if priority is not None else 1,
        fair=fair,
        tenant_cap=tenant_cap(config) if fair else None,
        max_starvation=priority.max_starvation if priority is not None else None,
    )


def urgency(values: Sequence[bytes]) -> int | None:
    """The urgency of ``Priority`` field lines (RFC 9218 4.1: a structured dictionary;
    the last ``u`` wins), or None when none is given or it is not 0..7."""
    if len(values) == 1 and len(values[0]) == 3 and values[0][:2] == b"u=":  # the usual "u=N"
        digit = values[0][2] - 48
        return digit if 0 <= digit <= 7 else None
    found: int | None = None
    for value in values:
        for member in value.split(b","):
            key, _, number = member.strip().partition(b"=")
            if key == b"u":
                number = number.partition(b";")[0].strip()
                found = int(number) if len(number) == 1 and number in b"01234567" else None
    return found


class Classifier:
    """A service's classes and tenants, compiled once per configuration. Does not yield."""

    __slots__ = (
        "_class_header",
        "_default",
        "_header",
        "_hosts",
        "_tenant_header",
        "_timeouts",
        "_values",
        "active",
        "fair",
        "names",
    )

    def __init__(self, config: ServiceConfig) -> None:
        priority = config.priority
        fair_by = config.fair_by
        #: Requests of this service need a class or a tenant (else everything is class 0).
        self.active = priority is not None or fair_by is not None
        self.fair = fair_by is not None
        self._tenant_header = fair_by.header.encode("latin-1") if fair_by is not None and fair_by.header else None
        if priority is None:
            self.names: tuple[str, ...] = ()
            self._default = 0
            self._header: bytes | None = None
            self._values: dict[bytes, int] = {}
            self._hosts: dict[str, int] = {}
            self._timeouts: tuple[float, ...] = (config.queue_timeout,)
            self._class_header: bytes | None = None
            return
        rank = {name: index for index, name in enumerate(priority.classes)}
        self.names = priority.classes
        self._default = rank[priority.default]
        self._header = priority.header.encode("latin-1") if priority.header is not None else None
        self._class_header = self._header if self._header is not None else _PRIORITY
        self._values = {value.encode("latin-1"): rank[name] for value, name in priority.values.items()}
        self._hosts = {host: rank[name] for host, name in priority.hosts.items()}
        self._timeouts = tuple(priority.queue_timeout.get(name, config.queue_timeout) for name in priority.classes)

    def classify(
        self, host: str, client_ip: str, headers: Sequence[tuple[bytes, bytes]], lower_names: Sequence[bytes]
    ) -> tuple[int, bytes | str | None]:
        """(class, tenant) of a request (tenant None without ``fair_by``), from one pass
        over its header lines."""
        class_header = self._class_header
        tenant_header = self._tenant_header
        class_values: list[bytes] = []
        tenant: bytes | None = None
        for index, lower in enumerate(lower_names):
            if lower == class_header:
                class_values.append(headers[index][1])
            if lower == tenant_header and tenant is None:
                tenant = headers[index][1]
        klass = self._class_of(host, class_values) if self.names else 0
        if not self.fair:
            return klass, None
        if tenant_header is None:
            return klass, client_ip
        return klass, tenant.strip()[:MAX_TENANT_KEY] if tenant is not None else b""

    def queue_timeout(self, klass: int) -> float:
        """How long a request of ``klass`` may wait for a slot."""
        return self._timeouts[klass]

    def class_name(self, klass: int) -> str | None:
        return self.names[klass] if self.names else None

    def _class_of(self, host: str, values: list[bytes]) -> int:
        """The class of a request whose class header has ``values``."""
        if self._header is None:
            given = urgency(values)
            if given is not None:
                return class_of_urgency(given, len(self.names))
        elif values:
            mapped = self._values.get(values[0].strip())
            if mapped is not None:
                return mapped
        if self._hosts:
            by_host = self._hosts.get(normalize_host(host))
            if by_host is not None:
                return by_host
        return self._default

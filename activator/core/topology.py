"""The whole routing table: services by Host, their throttlers, and config changes.

This module decides which service a request belongs to, and applies a new
configuration to the running throttlers as a diff (trackers and queues survive).
It is the one writer of topology: config reloads, probe results and the periodic
tick all come through here, from one greenlet of the shell. Requests only call
``route`` and then the throttler's acquire/release. Nothing here yields.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Mapping

from . import slots as slot_division
from .config import Config, ServiceConfig
from .errors import UnknownHost
from .throttler import ServiceThrottler, Transition


def host_of(header: str) -> str:
    """The Host header without its port, lower-cased (``[::1]:80`` -> ``::1``)."""
    host = header.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else host
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


class Topology:
    """All services of this activator. Does not yield."""

    def __init__(
        self,
        config: Config,
        now: float,
        *,
        worker: tuple[int, int] = (0, 1),
        rng: random.Random | None = None,
        on_transition: Callable[[Transition], None] | None = None,
    ) -> None:
        self._rng = rng
        self._on_transition = on_transition
        #: (index, count) of this process among the activator's workers.
        self.worker = worker
        self.services: dict[str, ServiceThrottler] = {}
        self._by_host: dict[str, ServiceThrottler] = {}
        self._catch_all: ServiceThrottler | None = None
        self.config = config
        self.apply(config, now)

    def route(self, host_header: str) -> ServiceThrottler:
        """The service for a Host header; raises UnknownHost."""
        service = self._by_host.get(host_of(host_header), self._catch_all)
        if service is None:
            raise UnknownHost()
        return service

    def apply(self, config: Config, now: float) -> None:
        """Make the running state follow ``config``; keeps every tracker and waiter."""
        self.config = config
        for name, service_config in config.services.items():
            owned = self.owned_slots(service_config)
            throttler = self.services.get(name)
            if throttler is None:
                self.services[name] = ServiceThrottler(
                    service_config, now, owned=owned, rng=self._rng, on_transition=self._on_transition
                )
            else:
                throttler.apply(service_config, now, owned)
        for name, throttler in list(self.services.items()):
            if name not in config.services:
                retired = ServiceConfig(name=name, hosts=(), container_concurrency=throttler.config.container_concurrency)
                throttler.apply(retired, now, {})
        self._by_host = {}
        self._catch_all = None
        for name, service_config in config.services.items():
            for host in service_config.hosts:
                if host == "*":
                    self._catch_all = self.services[name]
                else:
                    self._by_host[host] = self.services[name]
        self._drop_retired()

    def owned_slots(self, service: ServiceConfig) -> Mapping[str, int] | None:
        """Slots of each pod owned by this process; None when it owns them all."""
        peers = self.config.activators
        index, count = self.worker
        if (peers is None or len(peers.peers) == 1) and count == 1:
            return None
        limits = {pod.address: service.container_concurrency for pod in service.pods if not pod.drain}
        if peers is not None and len(peers.peers) > 1:
            limits = slot_division.owned_slots(limits, sorted(peers.peers), peers.self_name)
        if count > 1:
            limits = slot_division.owned_slots(limits, [str(i) for i in range(count)], str(index))
        return limits

    def tick(self, now: float) -> None:
        """Periodic housekeeping (drain timeouts, retired services)."""
        for throttler in self.services.values():
            throttler.tick(now)
        self._drop_retired()

    def snapshot(self, now: float) -> dict[str, Any]:
        return {name: throttler.snapshot(now) for name, throttler in sorted(self.services.items())}

    def check_invariants(self) -> None:
        for throttler in self.services.values():
            throttler.check_invariants()

    def _drop_retired(self) -> None:
        for name, throttler in list(self.services.items()):
            if name not in self.config.services and throttler.idle:
                del self.services[name]

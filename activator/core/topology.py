"""The whole routing table: services by Host, their throttlers, and config changes.

This module decides which service a request belongs to, and applies a new
configuration to the running throttlers as a diff (trackers and queues survive).
It is the one writer of topology: config reloads, probe results and the periodic
tick all come through here, from one greenlet of the shell. Requests only call
``route`` and then the throttler's acquire/release. Nothing here yields.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Sequence

from . import slots as slot_division
from .config import Config, ServiceConfig, normalize_host
from .errors import UnknownHost
from .throttler import ServiceThrottler, Transition


#: Distinct Host headers remembered by ``route`` before the memo starts over.
ROUTE_CACHE_SIZE = 4096
_UNSEEN = object()


class Topology:
    """All services of this activator. Does not yield."""

    def __init__(
        self,
        config: Config,
        now: float,
        *,
        worker_index: int = 0,
        workers: Sequence[str] = (),
        rng: random.Random | None = None,
        on_transition: Callable[[Transition], None] | None = None,
    ) -> None:
        self._rng = rng
        self._on_transition = on_transition
        #: This process's index among the activator's worker processes, and the private
        #: loopback address of each worker (empty: a single process).
        self.worker_index = worker_index
        self.workers = tuple(workers)
        self.services: dict[str, ServiceThrottler] = {}
        self._by_host: dict[str, ServiceThrottler] = {}
        self._catch_all: ServiceThrottler | None = None
        self._forwards: dict[str, Forward] = {}
        self._fallbacks: dict[str, Forward] = {}
        # Host header as received -> service (None: unknown), rebuilt on every apply.
        self._route_cache: dict[str, ServiceThrottler | None] = {}
        self.config = config
        self.apply(config, now)

    @property
    def worker(self) -> tuple[int, int]:
        """(index, count) of this process among the activator's workers."""
        return self.worker_index, max(1, len(self.workers))

    def route(self, host_header: str) -> ServiceThrottler:
        """The service for a Host header; raises UnknownHost."""
        cache = self._route_cache
        service = cache.get(host_header, _UNSEEN)
        if service is _UNSEEN:
            if len(cache) >= ROUTE_CACHE_SIZE:
                cache.clear()  # bounded: Host headers are client input
            service = cache[host_header] = self._by_host.get(normalize_host(host_header), self._catch_all)
        if service is None:
            raise UnknownHost()
        return service  # type: ignore[return-value]

    def apply(self, config: Config, now: float, only: Collection[str] | None = None) -> None:
        """Make the running state follow ``config``; keeps every tracker and waiter.

        ``only``: the names of the services whose configuration changed (from the diff);
        the others are left as they are, so that a big file with a small change costs
        little on the event loop. None: look at every service.
        """
        self.config = config
        for name, service_config in config.services.items():
            if only is not None and name not in only and name in self.services:
                continue
            owned, forward, fallback = self._division(service_config)
            _set_or_drop(self._forwards, name, forward)
            _set_or_drop(self._fallbacks, name, fallback)
            throttler = self.services.get(name)
            if throttler is None:
                self.services[name] = ServiceThrottler(
                    service_config, now, owned=owned, rng=self._rng, on_transition=self._on_transition
                )
            else:
                throttler.apply(service_config, now, owned)
                if forward is not None:
                    throttler.redirect_waiters()
        for name, throttler in list(self.services.items()):
            if name not in config.services:
                self._forwards.pop(name, None)
                self._fallbacks.pop(name, None)
                retired = ServiceConfig(name=name, hosts=(), container_concurrency=throttler.config.container_concurrency)
                throttler.apply(retired, now, {})
        self._by_host = {}
        self._catch_all = None
        self._route_cache = {}
        for name, service_config in config.services.items():
            for host in service_config.hosts:
                if host == "*":
                    self._catch_all = self.services[name]
                else:
                    self._by_host[host] = self.services[name]
        self._drop_retired()

    def owned_slots(self, service: ServiceConfig) -> Mapping[str, int] | None:
        """Slots of each pod owned by this process; None when it owns them all."""
        return self._division(service)[0]

    def forward_target(self, service: str) -> Forward | None:
        """Where to send a request of ``service`` instead of queueing it here, or None.

        To an owner when this process owns none of the service's slots (fewer slots
        than activators or workers); to another owner when it owns some but none can
        be used now (its pods pending or draining): no process is a black hole for a
        service that has a usable slot elsewhere.
        """
        forward = self._forwards.get(service)
        if forward is None and self._fallbacks and self.services[service].capacity == 0:
            forward = self._fallbacks.get(service)
        return forward

    def _division(self, service: ServiceConfig) -> tuple[Mapping[str, int] | None, Forward | None, Forward | None]:
        """(slots owned by this process, where to forward when it owns none, where to
        forward when none of its own slots can be used now).

        Slots are divided among the activators first, then this activator's share
        among its workers, with the same function. The fallback is another owner: a
        sibling worker if one owns slots, else a peer.
        """
        peers = self.config.activators
        several = peers is not None and len(peers.peers) > 1
        if not several and len(self.workers) <= 1:
            return None, None, None
        limits = {pod.address: service.container_concurrency for pod in service.pods if not pod.drain}
        limited = service.container_concurrency > 0 and bool(limits)
        fallback = None
        if peers is not None and several:
            division = slot_division.divide_slots(limits, sorted(peers.peers))
            limits = division[peers.self_name]
            owner = _forward_choice(division, peers.self_name)
            if limited and owner is not None:
                fallback = Forward(str(peers.peers[owner]), "peer")
                if not limits:
                    return limits, fallback, None
        if len(self.workers) > 1:
            names = [str(i) for i in range(len(self.workers))]
            me = str(self.worker_index)
            division = slot_division.divide_slots(limits, names)
            owner = _forward_choice(division, me)
            if limited and owner is not None:
                fallback = Forward(self.workers[int(owner)], "worker")
                if not division[me]:
                    return {}, fallback, None
            limits = division[me]
        return limits, None, fallback

    def tick(self, now: float) -> None:
        """Periodic housekeeping (drain timeouts, retired services)."""
        for throttler in self.services.values():
            throttler.tick(now)
        self._drop_retired()

    def snapshot(self, now: float) -> dict[str, Any]:
        services = {}
        for name, throttler in sorted(self.services.items()):
            services[name] = throttler.snapshot(now)
            forward = self._forwards.get(name)
            services[name]["forward_to"] = f"{forward.kind} {forward.address}" if forward else None
        return services

    def check_invariants(self) -> None:
        for throttler in self.services.values():
            throttler.check_invariants()

    def _drop_retired(self) -> None:
        for name, throttler in list(self.services.items()):
            if name not in self.config.services and throttler.idle:
                del self.services[name]


@dataclass(frozen=True)
class Forward:
    """Send the service's requests to ``address``: a peer activator's proxy port
    (kind "peer") or a sibling worker's private port (kind "worker")."""

    address: str
    kind: str


def _forward_choice(division: Mapping[str, Mapping[str, int]], me: str) -> str | None:
    """Among the other owners of slots, the one ``me`` forwards to (None if there is
    none): the best rendezvous score for ``me``, so forwarders spread over the owners,
    stably."""
    owners = [peer for peer, owned in division.items() if owned and peer != me]
    return max(owners, key=lambda peer: slot_division.score(peer, me)) if owners else None


def _set_or_drop(table: dict[str, Forward], name: str, value: Forward | None) -> None:
    if value is None:
        table.pop(name, None)
    else:
        table[name] = value

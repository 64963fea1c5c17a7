"""The whole routing table: services by Host, their throttlers, and config changes.

This module decides which service a request belongs to, where a request goes when this
process owns none (or no usable one) of its service's slots (``forward_target``,
``may_forward``), and what the running throttlers do when the configuration changes
(``apply``: as a diff; trackers and queues survive).

It is the state the one topology writer changes: configuration changes, probe verdicts,
transport failures and the periodic tick arrive as events (``core.events``) and are
applied by ``handle``, from one greenlet of the shell. Requests only call ``route``, then
their throttler's acquire and release. Nothing here yields; every change returns its
``Effects`` for the shell to act on.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import slots as slot_division
from .config import Config, ConfigDiff, ServiceConfig, normalize_host
from .errors import UnknownHost
from .events import ConfigChanged, Event, ProbeReport, Tick, TransportFailure
from .throttler import NO_EFFECTS, Effects, EffectsCollector, ServiceThrottler

#: Peer hops a request may take: the second only happens while activators disagree
#: about who owns a service's slots (one applied a new file, the other not yet).
MAX_PEER_HOPS = 2


def may_forward(marker: str | None, kind: str) -> bool:
    """Whether a request whose hops so far are ``marker`` may go on to a ``kind``.

    ``marker`` is its ``X-Activator-Forwarded`` value (``"peer vm-a, worker 1"``). A
    request goes to an owner of the service's slots in one hop. While two activators'
    files differ, the peer it was sent to may no longer own a slot and know the new
    owner: a second peer hop is allowed, never a third, so a disagreement cannot loop. A
    request from a sibling worker goes nowhere else.
    """
    hops = [hop.split()[0] for hop in marker.split(",") if hop.strip()] if marker else []
    if "worker" in hops:
        return False
    return kind == "worker" or hops.count("peer") < MAX_PEER_HOPS


#: Distinct Host headers remembered by ``route`` before the memo starts over.
ROUTE_CACHE_SIZE = 4096


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
    ) -> None:
        self._rng = rng
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
        #: The effects of building the routing table (pods turning healthy at once, ...).
        self.initial_effects = self.apply(config, now)

    @property
    def worker(self) -> tuple[int, int]:
        """(index, count) of this process among the activator's workers."""
        return self.worker_index, max(1, len(self.workers))

    def route(self, host_header: str) -> ServiceThrottler:
        """The service for a Host header; raises UnknownHost."""
        cache = self._route_cache
        try:
            service = cache[host_header]
        except KeyError:
            if len(cache) >= ROUTE_CACHE_SIZE:
                cache.clear()  # bounded: Host headers are client input
            service = cache[host_header] = self._by_host.get(normalize_host(host_header), self._catch_all)
        if service is None:
            raise UnknownHost()
        return service

    def apply(self, config: Config, now: float, diff: ConfigDiff | None = None) -> Effects:
        """Make the running state follow ``config``; keeps every tracker and waiter.

        ``diff`` (``core.config.diff_configs`` from the config applied before): only the
        services it names are looked at, so that a big file with a small change costs
        little on the event loop; all of them when the peers changed (every division
        changes) or without a diff.
        """
        only: Collection[str] | None = None
        if diff is not None and not diff.peers_changed:
            only = {service.name for service in diff.services}
        self.config = config
        effects = EffectsCollector()
        for name, service_config in config.services.items():
            if only is not None and name not in only and name in self.services:
                continue
            owned, forward, fallback = self._division(service_config)
            _set_or_drop(self._forwards, name, forward)
            _set_or_drop(self._fallbacks, name, fallback)
            throttler = self.services.get(name)
            if throttler is None:
                throttler = self.services[name] = ServiceThrottler(service_config, now, owned=owned, rng=self._rng)
                effects.add(throttler.initial_effects)
            else:
                effects.add(throttler.apply(service_config, now, owned))
                if forward is not None:
                    effects.add(throttler.redirect_waiters())
        for name, throttler in list(self.services.items()):
            if name not in config.services:
                self._forwards.pop(name, None)
                self._fallbacks.pop(name, None)
                # Its pods drain under its own settings (drain_timeout among them).
                retired = dataclasses.replace(throttler.config, hosts=(), pods=())
                effects.add(throttler.apply(retired, now, {}))
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
        return effects.result()

    def handle(self, event: Event, now: float) -> Effects:
        """Apply one topology event (the writer's only call). Does not yield."""
        if isinstance(event, TransportFailure):
            throttler = self.services.get(event.service)
            return NO_EFFECTS if throttler is None else throttler.record_failure(event.address, event.kind, now)
        if isinstance(event, ProbeReport):
            throttler = self.services.get(event.service)
            if throttler is None:
                return NO_EFFECTS
            return throttler.probe_result(event.address, event.verdict, now, event.detail)
        if isinstance(event, Tick):
            return self.tick(now)
        if isinstance(event, ConfigChanged):
            return self.apply(event.config, now, event.diff)
        raise TypeError(f"not a topology event: {event!r}")

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

    def tick(self, now: float) -> Effects:
        """Periodic housekeeping (drain timeouts, retired services)."""
        effects = EffectsCollector()
        for throttler in self.services.values():
            effects.add(throttler.tick(now))
        self._drop_retired()
        return effects.result()

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

"""The whole routing table: services by Host, their throttlers, and config changes.

This module decides which service a request belongs to, where a request goes when this
process owns none (or no usable one) of its service's slots (``forward_target``,
``may_forward``), and what the running throttlers do when the configuration changes
(``apply``: as a diff; trackers and queues survive).

It is the state the one topology writer changes: configuration changes, probe verdicts,
transport failures, the peers' checks and answers (``core.fleet``: shares, views,
hand-overs, peer health) and the periodic tick arrive as events (``core.events``) and
are applied by ``handle``, from one greenlet of the shell. Waiters of a service this
activator cannot serve now while a peer can are redirected there. Requests only call ``route``, then
their throttler's acquire and release. Nothing here yields; every change returns its
``Effects`` for the shell to act on.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from .config import Config, ConfigDiff, ServiceConfig, normalize_host
from .errors import PeerUnavailable, UnknownHost
from .events import (
    ConfigChanged,
    Event,
    LoadReported,
    PeerChecked,
    ProbeReport,
    Tick,
    TransportFailure,
    ViewReceived,
)
from .fleet import Fleet, Forward
from .peering import WORKER_SCOPE, Answer, Check
from .throttler import NO_EFFECTS, Effects, EffectsCollector, ServiceThrottler, then

#: Peer hops a request may take: the second only happens while activators disagree
#: about who owns a service's slots (one applied a new file, the other not yet).
MAX_PEER_HOPS = 2
#: Peer hops a request never goes beyond, redirects or not: activators whose files
#: disagree for good (each sure the other owns the slots) would otherwise pass a waiter
#: back and forth at every tick until its queue_timeout.
PEER_HOPS_CEILING = 6


def may_forward(marker: str | None, capped: bool = False, redirected: int = 0) -> bool:
    """Whether a request whose hops so far are ``marker`` may go on to a peer.

    ``marker`` is its ``X-Activator-Forwarded`` value (``"peer vm-a, peer vm-b"``). A
    request goes to an owner of the service's slots in one hop. While two activators'
    files differ, the peer it was sent to may no longer own a slot and know the new
    owner: a second peer hop is allowed, never a third at once, so a disagreement cannot
    loop. Two exceptions. ``capped``: an activator whose peers' views left it no usable
    slot of the service (it is being removed, or has an older file) passes its waiters on
    once more, to a peer that reported usable slots: they would wait for nothing here,
    and a peer with usable slots serves them instead of forwarding them (the chain ends).
    ``redirected``: how many times the request's wait here was ended by a redirect (this
    activator lost every usable slot of the service while a peer has some); each allows
    one more hop. A request that used its hops while files disagreed waits where it
    landed, and follows the slots once they are known to be elsewhere instead of waiting
    for nothing until ``queue_timeout``; a redirect follows a change of slots (or the
    writer's tick), so the extra hops cannot spin, and none goes beyond
    ``PEER_HOPS_CEILING``.
    """
    hops = [hop.split()[0] for hop in marker.split(",") if hop.strip()] if marker else []
    peer_hops = hops.count("peer")
    return peer_hops < min(PEER_HOPS_CEILING, MAX_PEER_HOPS + (1 if capped else 0) + redirected)


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
        hand_over_at_start: bool = False,
    ) -> None:
        """``hand_over_at_start``: a starting process (the server) lets its peers answer
        before it uses its share (``Fleet``); a topology read from a file alone (``check``)
        shows its share at once."""
        self._rng = rng
        #: This process's index among the activator's worker processes, and the private
        #: loopback address of each worker (empty: a single process).
        self.worker_index = worker_index
        self.workers = tuple(workers)
        self.services: dict[str, ServiceThrottler] = {}
        self._by_host: dict[str, ServiceThrottler] = {}
        self._catch_all: ServiceThrottler | None = None
        #: This process among the other holders of the pods' slots (``core.fleet``).
        self.fleet = Fleet(worker_index, max(1, len(self.workers)), hand_over_at_start=hand_over_at_start)
        #: ``workers: N``: the activator's usable slots per service, summed over the
        #: workers (the shell keeps it from the slot exchange); unknown counts as some.
        self.activator_capacity: dict[str, int] = {}
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
        self.fleet.configure(config, now)
        effects = EffectsCollector()
        for name, service_config in config.services.items():
            if only is not None and name not in only and name in self.services:
                continue
            owned = self.fleet.follow(service_config, now, grace=config.grace_period)
            throttler = self.services.get(name)
            if throttler is None:
                throttler = self.services[name] = ServiceThrottler(
                    service_config, now, owned=owned, rng=self._rng, sharing=len(self.workers) > 1
                )
                effects.add(throttler.initial_effects)
            else:
                effects.add(throttler.apply(service_config, now, owned))
                effects.add(self._redirect_if_elsewhere(name))
        for name, throttler in list(self.services.items()):
            if name not in config.services:
                self.fleet.forget(name)
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
            if throttler is None:
                return NO_EFFECTS
            effects = throttler.record_failure(event.address, event.kind, now)
            return then(effects, self._redirect_if_elsewhere(event.service))
        if isinstance(event, ProbeReport):
            throttler = self.services.get(event.service)
            if throttler is None:
                return NO_EFFECTS
            effects = throttler.probe_result(event.address, event.verdict, now, event.detail, event.duration)
            return then(effects, self._redirect_if_elsewhere(event.service))
        if isinstance(event, LoadReported):
            throttler = self.services.get(event.service)
            if throttler is None:
                return NO_EFFECTS
            return throttler.load_report(event.address, event.figure, event.concurrency, now)
        if isinstance(event, Tick):
            return self.tick(now)
        if isinstance(event, ConfigChanged):
            return self.apply(event.config, now, event.diff)
        if isinstance(event, ViewReceived):
            services = [self.config.services[name] for name in self.config.services]
            return self._reapply(self.fleet.view_received(event.issuer, event.view, services, now), now)
        if isinstance(event, PeerChecked):
            released = self.fleet.checked(
                event.peer, event.asked_at, event.answer, event.error, now, event.refused, event.forwarding
            )
            collected = EffectsCollector()
            collected.add(self._reapply(released, now))
            if event.answer is not None:  # a peer with usable slots again: stranded waiters go there
                for name in self.services:
                    collected.add(self._redirect_if_elsewhere(name))
            return collected.result()
        raise TypeError(f"not a topology event: {event!r}")

    def _reapply(self, names: Collection[str], now: float) -> Effects:
        """The services whose usable shares changed (a view, a hand-over released)."""
        effects = EffectsCollector()
        for name in names:
            throttler = self.services.get(name)
            config = self.config.services.get(name)
            if throttler is not None and config is not None:
                effects.add(throttler.apply(config, now, self.fleet.usable(name)))
                effects.add(self._redirect_if_elsewhere(name))
        return effects.result()

    def _redirect_if_elsewhere(self, name: str) -> Effects:
        """Waiters of a service that this activator cannot serve now, while a peer can,
        go there (the shell forwards redirected waiters)."""
        throttler = self.services[name]
        if not throttler.queued:
            return NO_EFFECTS
        try:
            target = self.forward_target(name)
        except PeerUnavailable:
            return NO_EFFECTS  # they wait here: the owners may come back
        return throttler.redirect_waiters() if target is not None else NO_EFFECTS

    def answer(self, check: Check, me: str) -> Answer:
        """This process's answer to ``check`` (its view applied first, ``ViewReceived``):
        the requests running on each pod of the view (slots lent included), the usable
        capacity per service, and whether the asker is listed in our file (a sibling
        always is). ``me``: the name it is signed with. Does not yield."""
        in_use: dict[str, dict[str, int]] = {}
        for service, pods in check.view.items():
            throttler = self.services.get(service)
            trackers = throttler.trackers if throttler is not None else {}
            in_use[service] = {pod: trackers[pod].in_flight if pod in trackers else 0 for pod in pods}
        capacity = {name: throttler.capacity for name, throttler in self.services.items()}
        peers = self.config.activators
        listed = check.scope == WORKER_SCOPE or (peers is not None and check.sender in peers.peers)
        return Answer(me, in_use, capacity, listed)

    def capped(self, service: str) -> bool:
        """Whether peers' views (newer files than ours) took slots of ``service`` from us."""
        return self.fleet.capped(service)

    def owned_slots(self, service: ServiceConfig) -> Mapping[str, int] | None:
        """Slots of each pod this process may use now; None when it may use them all."""
        return self.fleet.usable(service.name)

    def forward_target(self, service: str) -> Forward | None:
        """Where to send a request of ``service`` instead of queueing it here, or None.

        To an owner that is up when this activator owns none of the service's slots
        (fewer slots than activators; raises PeerUnavailable when every owner is down);
        to an owner that reported usable slots when this activator owns some but can use
        none now (its pods pending or draining): no activator is a black hole for a
        service that has a usable slot elsewhere. Workers never forward to each other
        (``core.slotexchange``).
        """
        fleet = self.fleet
        if not fleet.divided(service):  # a lone activator (the usual case): nothing to ask
            return None
        return fleet.forward_target(service, self._own_capacity_spent(service))

    def _own_capacity_spent(self, service: str) -> bool:
        """Whether this activator has no usable slot of ``service`` (with workers, what the
        siblings report through the slot exchange counts too)."""
        if len(self.workers) > 1:
            return self.activator_capacity.get(service, 1) == 0
        return self.services[service].capacity == 0

    def tick(self, now: float) -> Effects:
        """Periodic housekeeping (drain timeouts, retired services, hand-overs waited out)."""
        effects = EffectsCollector()
        for name, throttler in self.services.items():
            effects.add(throttler.tick(now))
            if throttler.queued and throttler.capacity == 0:
                # Waiters that no slot here can reach go where one can (a safety net:
                # every event that changes where slots are redirects them at once).
                effects.add(self._redirect_if_elsewhere(name))
        effects.add(self._reapply(self.fleet.expire(now), now))
        self._drop_retired()
        return effects.result()

    def snapshot(self, now: float) -> dict[str, Any]:
        services = {}
        for name, throttler in sorted(self.services.items()):
            services[name] = throttler.snapshot(now)
            services[name].update(self.fleet.snapshot_service(name, now))
        return services

    def check_invariants(self) -> None:
        for throttler in self.services.values():
            throttler.check_invariants()

    def _drop_retired(self) -> None:
        for name, throttler in list(self.services.items()):
            if name not in self.config.services and throttler.idle:
                del self.services[name]

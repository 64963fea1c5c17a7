"""Which client speaks to a pod: one per (address, protocol), made on first use.

What this module decides:

- A service's ``protocol`` picks the pod-side client: ``http1`` a keep-alive
  ``upstream.UpstreamPool``, ``h2c`` an ``upstream_h2.H2PodPool`` (HTTP/2 with prior
  knowledge, one stream per request). Both answer ``request(...)`` with an
  ``exchange.PodResponse``, so the proxy and the prober do not care which.
- Clients are keyed by address *and* protocol (one address may serve two services that
  speak differently). Peers and sibling workers are always spoken to in HTTP/1.1.
- ``close_unused`` closes the clients of addresses nobody routes to any more.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from ..base.exchange import PodRequest, PodResponse
from ..core.timeouts import Timeouts
from .h2c import H2PodPool
from .http1 import UpstreamPool

HTTP1 = "http1"
H2C = "h2c"


class PodClient(Protocol):
    """What the proxy and the prober need of a pod-side client."""

    def request(self, request: PodRequest, timeouts: Timeouts) -> PodResponse: ...

    def close(self) -> None: ...


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) as (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


#: Idle keep-alive connections kept per pod: as many as requests ran on it at once, up
#: to this (a pod with more slots than this would open and close connections under load).
MAX_IDLE_PER_POD = 1024


def make_client(address: str, protocol: str = HTTP1, *, max_idle: int = MAX_IDLE_PER_POD) -> PodClient:
    """A new client for the pod at ``address`` speaking ``protocol``."""
    host, port = split_address(address)
    if protocol == H2C:
        return H2PodPool(host, port)
    return UpstreamPool(host, port, max_idle=max_idle)


class PodClients:
    """The clients of one process, by (address, protocol)."""

    def __init__(self) -> None:
        self._clients: dict[tuple[str, str], PodClient] = {}

    def get(self, address: str, protocol: str = HTTP1) -> PodClient:
        key = (address, protocol)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = make_client(address, protocol)
        return client

    def close_unused(self, keep: Collection[str]) -> None:
        """Close the clients of every address not in ``keep``."""
        for key in [key for key in self._clients if key[0] not in keep]:
            self._clients.pop(key).close()

    def close_all(self) -> None:
        self.close_unused(())

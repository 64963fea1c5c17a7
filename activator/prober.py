"""Active health probes: one greenlet per probed pod, staggered, feeding the core.

What this module decides:

- Which pods are probed: every tracked pod of a service with a ``probe``, while it
  is ``pending`` or ``healthy`` (draining and removed pods are left alone).
- When: every ``interval``, each pod starting at a random offset within the first
  interval, so that probes of many pods do not fire together.
- What passes: a ``GET probe.path`` answered with 2xx or 3xx within ``timeout``.
- Busy pods are not misjudged: a pod whose slots here are all in use is not probed
  at all (it is visibly alive: it is serving our requests, and a probe would only
  queue behind the work, as with a one-request-at-a-time model server); and a probe
  that fails while requests are in flight on the pod is counted as inconclusive, not
  as a failure. Connect errors are always counted (a pod that refuses connections is
  down, busy or not). Passive failures on real traffic cover the rest.

Probes use their own connection pool per pod, so they never take a proxied
request's keep-alive connection. Results are applied with
``ServiceThrottler.probe_result``, which does not yield.
"""

from __future__ import annotations

import logging
import random
import time

import gevent

from .core.config import ProbeConfig
from .core.errors import ActivatorError, UpstreamConnectError
from .core.http import BodyFraming
from .core.states import PodState
from .core.topology import Topology
from .upstream import Timeouts, UpstreamBodyError, UpstreamPool

log = logging.getLogger("activator")

PROBED_STATES = (PodState.PENDING, PodState.HEALTHY)
PROBE_HEADERS = b"User-Agent: activator-probe\r\nAccept: */*\r\n"


class Prober:
    """Keeps one probe greenlet per (service, pod) that needs probing."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._greenlets: dict[tuple[str, str], gevent.Greenlet] = {}

    def sync(self) -> None:
        """Start probes for pods that need them, stop the others. Call after any topology change."""
        wanted = set()
        for name, service in self.topology.services.items():
            if service.config.probe is None:
                continue
            for address, tracker in service.trackers.items():
                if tracker.state in PROBED_STATES:
                    wanted.add((name, address))
        for key in list(self._greenlets):
            if key not in wanted or self._greenlets[key].dead:
                self._greenlets.pop(key).kill(block=False)
        for key in wanted - self._greenlets.keys():
            self._greenlets[key] = gevent.spawn(self._probe_forever, *key)

    def stop(self) -> None:
        for greenlet in self._greenlets.values():
            greenlet.kill(block=False)
        self._greenlets.clear()

    def _probe_forever(self, service_name: str, address: str) -> None:
        host, _, port = address.rpartition(":")
        pool = UpstreamPool(host.strip("[]"), int(port), max_idle=1)
        first = True
        try:
            while True:
                service = self.topology.services.get(service_name)
                probe = service.config.probe if service else None
                if probe is None:
                    return
                gevent.sleep(random.uniform(0, probe.interval) if first else probe.interval)
                first = False
                service = self.topology.services.get(service_name)
                tracker = service.trackers.get(address) if service else None
                probe = service.config.probe if service else None
                if tracker is None or probe is None or tracker.state not in PROBED_STATES:
                    return
                if tracker.slots is not None and tracker.in_flight >= max(tracker.slots, 1):
                    continue  # busy with our own requests: alive, and a probe would queue behind them
                ok, detail = probe_once(pool, address, probe)
                if not ok and tracker.in_flight > 0 and not detail.startswith("connect"):
                    continue  # inconclusive: the pod may be busy with work we sent it
                service.probe_result(address, ok, time.monotonic(), detail)
        finally:
            pool.close()


def probe_once(pool: UpstreamPool, address: str, probe: ProbeConfig) -> tuple[bool, str]:
    """One probe: (passed, why not)."""
    headers = b"Host: %s\r\n%s" % (address.encode(), PROBE_HEADERS)
    timeouts = Timeouts(probe.timeout, probe.timeout, total=probe.timeout)
    try:
        with gevent.Timeout(probe.timeout * 2 + 1):  # backstop; the pool enforces the real timeouts
            response = pool.request("GET", probe.path.encode(), headers, None, BodyFraming.NONE, None, timeouts)
            try:
                for _ in response.body():
                    pass
            finally:
                response.close()
    except UpstreamConnectError as error:
        return False, f"connect: {error}"
    except (ActivatorError, gevent.Timeout) as error:
        return False, f"timeout or error: {error}"
    except UpstreamBodyError as error:  # a body cut short, a reset: the pod is not well
        return False, f"error: {error!r}"
    if 200 <= response.status < 400:
        return True, ""
    return False, f"status {response.status}"

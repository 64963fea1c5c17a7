"""Launched pods: how many should run, which to start next, which to stop, and when.

For each service with ``launch:``, ``ServiceScaler`` decides from what the shell observes
(requests in flight and queued, the pods' health, a process that ended) and the time it
is given. It never starts or stops anything: every call returns ``LaunchEffect`` values
(start this pod, drain that one, stop it, give waiters up) for the shell to act on.

Rules:

- **Desired pods** follow Knative's KPA on one machine: observed concurrency (in flight
  plus queued) is averaged over ``stable_window`` and over ``panic_window``; desired =
  ceil(average / ``target_concurrency``). When the panic window's desire reaches twice
  the ready pods (demand doubled), the scaler panics: it follows the panic window and
  never scales down until a whole stable window passed without that happening again.
  Otherwise it follows the stable window, so a pod is given up only once the stable
  window agrees. Any request waiting or running means at least one pod; the last one is
  kept until ``scale_to_zero_after`` passed without a request. Always between ``min``
  and ``max`` (and the pods it may launch).
- **Which pod.** A pod being drained that is wanted again serves again; starts go to the
  listed pods (without ``drain``) in the file's order, skipping those already serving,
  those not probed yet (one may run already) and those that failed in this round, and
  never beyond ``max`` counting the pods still stopping; stops take the pods it started,
  those still booting first, then the latest in the file's order.
- **Several activators.** Each launches only the pods it owns (``launch_owner``); a
  request that reaches an activator owning none of a service's pods, while it has no
  usable slot, goes to the launcher of the first one (``launcher_elsewhere``).
- **Never a pod it did not start.** A pod that is healthy without having been started
  here (started by hand, by an earlier activator, by a peer) counts as serving and is
  never stopped.
- **Drain first.** A serving pod is stopped only after it was drained (``DRAIN``: no new
  requests) and its last request ended, or ``drain_timeout`` passed. A pod still booting
  takes no request and is stopped at once.
- **Cold starts.** A started pod is ready when its probe passes (``READY``, with the
  boot's duration). One that exits first, or is not ready within
  ``cold_start_timeout``, has failed (``FAILED``; stopped), and the next candidate is
  tried. When no pod serves, none boots and every candidate failed, the waiters are given
  up (``REFUSE_WAITERS``: 503 ``cold-start-failed``) and nothing starts again until a new
  request waits (or, with ``min`` above 0, after another ``cold_start_timeout``).

The shell's own events for these decisions are here too (``LaunchCheck``,
``PodEnded``), as values. Pure: no I/O, time passed in. ``Launches`` holds the scalers of every launched service
and follows config reloads: a service whose launcher is removed keeps every pod it has
(a pod being drained is given back to its requests).
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .config import Config, LaunchConfig, ServiceConfig
from .fleet import Forward
from .slots import score

#: Panic when the panic window asks for this many times the ready pods (KPA's 200%).
PANIC_THRESHOLD = 2.0


class Launch(enum.Enum):
    """A listed pod as its launcher sees it."""

    STOPPED = "stopped"  # not started here (it may run all the same: started by someone else)
    STARTING = "starting"  # started, its probe has not passed yet
    RUNNING = "running"  # started here and ready
    DRAINING = "draining"  # to be stopped: no new request, its last ones finishing
    STOPPING = "stopping"  # stop asked, the process has not ended yet


class Action(enum.Enum):
    START = "start"  # launch the pod
    DRAIN = "drain"  # the pod takes no new request (today's draining)
    STOP = "stop"  # stop the pod's process (drained, booting, or failed)
    UNDRAIN = "undrain"  # the pod is wanted again (stopped for good, or not to be stopped)
    READY = "ready"  # a started pod's probe passed (``seconds``: its cold start)
    FAILED = "failed"  # a start failed (logged and counted; its STOP follows if needed)
    REFUSE_WAITERS = "refuse-waiters"  # no pod came up: the waiters get 503 cold-start-failed


@dataclass(frozen=True)
class LaunchEffect:
    action: Action
    service: str
    pod: str = ""
    reason: str = ""
    seconds: float | None = None


@dataclass(frozen=True)
class LaunchCheck:
    """Shell event: a request queued for ``service``, launched, which has no usable slot
    (a cold start must not wait for the next tick)."""

    service: str


@dataclass(frozen=True)
class PodEnded:
    """Shell event: a launched pod's process ended (it exited, its start failed, or its
    stop is done)."""

    service: str
    address: str
    detail: str


#: The events the launcher's decisions are made on, besides config changes and ticks.
LaunchEvent = LaunchCheck | PodEnded


@dataclass(frozen=True)
class PodView:
    """One listed pod as the throttler sees it."""

    healthy: bool
    in_flight: int = 0
    #: Probed at least once: whether it runs is known (a pod left running by an earlier
    #: activator must not be started again before its first probe says so).
    probed: bool = True


@dataclass(frozen=True)
class ServiceView:
    """One service as the throttler sees it, at one moment."""

    in_flight: int
    queued: int
    #: Requests ever given a slot (any monotonic count of arrivals): a change is activity.
    requests: int
    pods: Mapping[str, PodView]


@dataclass
class _Pod:
    state: Launch = Launch.STOPPED
    since: float = 0.0
    #: Drained by us (``DRAIN``): needs ``UNDRAIN`` once stopped.
    parked: bool = False
    #: Failed in the current round of cold starts: not tried again in it.
    failed: bool = False


def launch_owner(address: str, peers: Sequence[str]) -> str:
    """The activator that launches the pod at ``address``: the top rendezvous score, the
    consistent hash that divides the slots (``core.slots.score``)."""
    return max(peers, key=lambda peer: (score(peer, address), peer))


def launcher_elsewhere(config: Config, service: ServiceConfig) -> Forward | None:
    """Where a request for ``service`` goes when it has no usable slot here and this
    activator launches none of its pods (it would wait for a start nobody makes): the
    launcher of its first listed pod, which starts it. None when this activator launches
    one of them, or is alone, or the service is not launched."""
    peers = config.activators
    if service.launch is None or peers is None or len(peers.peers) < 2:
        return None
    names = tuple(peers.peers)
    owners = [launch_owner(pod.address, names) for pod in service.pods if not pod.drain]
    if not owners or peers.self_name in owners:
        return None
    return Forward(str(peers.peers[owners[0]]), owners[0])


class ServiceScaler:
    """The launcher's decisions for one service (see the module docstring). Does not yield."""

    def __init__(self, service: ServiceConfig, now: float, owned: Callable[[str], bool] = lambda pod: True) -> None:
        assert service.launch is not None
        self.name = service.name
        self.launch: LaunchConfig = service.launch
        self.drain_timeout = service.drain_timeout
        # Invariant: every listed pod has an entry; entries of unlisted pods linger only
        # while they are ours and not yet stopped.
        self.pods: dict[str, _Pod] = {}
        #: The pods it may start, in the file's order (listed, without drain, owned here).
        self.candidates: tuple[str, ...] = ()
        self.listed: frozenset[str] = frozenset()
        self._stable = _Window()
        self._panic = _Window()
        self.last_activity = now
        self._requests: int | None = None
        self.panic_since: float | None = None
        # Invariant: min <= desired <= max_pods.
        self.desired = 0
        #: After giving waiters up: no start until this time, unless a new request waits.
        self.blocked_until: float | None = None
        self.started = 0
        self.stopped = 0
        self.failed = 0
        self.cold_starts = 0
        self.cold_start_seconds_total = 0.0
        self.last_cold_start: float | None = None
        self.configure(service, now, owned)

    @property
    def max_pods(self) -> int:
        limit = len(self.candidates)
        return limit if self.launch.max is None else min(self.launch.max, limit)

    def configure(self, service: ServiceConfig, now: float, owned: Callable[[str], bool]) -> None:
        """A new config of the service (still launched). Pods it started that the file no
        longer wants are stopped once drained (the file's unlisting or drain drains them)."""
        assert service.launch is not None
        self.launch = service.launch
        self.drain_timeout = service.drain_timeout
        self.candidates = tuple(p.address for p in service.pods if not p.drain and owned(p.address))
        self.listed = frozenset(p.address for p in service.pods)
        wanted = {p.address for p in service.pods if not p.drain}
        for address in self.listed:
            self.pods.setdefault(address, _Pod(since=now))
        for address, pod in list(self.pods.items()):
            if address in self.candidates:
                continue
            if pod.state in (Launch.STARTING, Launch.RUNNING) and address not in wanted:
                # The file drains it (unlisted, or drain: true): stopped once drained.
                pod.state, pod.since = Launch.DRAINING, now
            elif pod.state is Launch.STOPPED and address not in self.listed:
                del self.pods[address]
            # Still wanted but owned by another activator now: ours keeps running.
        self.desired = max(self.launch.min, min(self.desired, self.max_pods))

    def booting(self, address: str) -> bool:
        """Started here and not ready yet."""
        pod = self.pods.get(address)
        return pod is not None and pod.state is Launch.STARTING

    def retire(self) -> list[LaunchEffect]:
        """The launcher was removed: stop nothing; a pod being drained serves again."""
        effects = []
        for address, pod in self.pods.items():
            if pod.parked:
                pod.parked = False
                effects.append(LaunchEffect(Action.UNDRAIN, self.name, address, "launcher removed"))
        return effects

    # -- decisions --------------------------------------------------------------------

    def step(self, now: float, view: ServiceView, sample: bool = True) -> list[LaunchEffect]:
        """Observe the service and decide. ``sample``: record its concurrency in the
        windows (the shell samples once a second; a step on an event does not)."""
        demand = view.in_flight + view.queued
        if sample:
            self._stable.add(now, demand)
            self._panic.add(now, demand)
        if demand > 0 or (self._requests is not None and view.requests != self._requests):
            self.last_activity = now
        self._requests = view.requests
        effects: list[LaunchEffect] = []
        self._follow_boots(now, view, effects)
        self._follow_drains(now, view, effects)
        self.desired = self._desired(now, view, demand)
        self._reconcile(now, view, effects)
        return effects

    def ended(self, address: str, now: float, detail: str) -> list[LaunchEffect]:
        """The pod's process ended (it exited, its start failed, or our stop is done)."""
        pod = self.pods.get(address)
        if pod is None or pod.state is Launch.STOPPED:
            return []
        effects = []
        if pod.state is Launch.STARTING:
            pod.failed = True
            self.failed += 1
            effects.append(LaunchEffect(Action.FAILED, self.name, address, f"ended before it was ready: {detail}"))
        elif pod.state is not Launch.STOPPING:
            self.stopped += 1  # it went by itself
        pod.state, pod.since = Launch.STOPPED, now
        if pod.parked:
            pod.parked = False
            effects.append(LaunchEffect(Action.UNDRAIN, self.name, address, "stopped"))
        if address not in self.listed:
            del self.pods[address]
        return effects

    def _follow_boots(self, now: float, view: ServiceView, effects: list[LaunchEffect]) -> None:
        for address, pod in self.pods.items():
            if pod.state is not Launch.STARTING:
                continue
            seen = view.pods.get(address)
            if seen is not None and seen.healthy:
                pod.state, seconds, pod.since = Launch.RUNNING, now - pod.since, now
                self.cold_starts += 1
                self.cold_start_seconds_total += seconds
                self.last_cold_start = seconds
                for other in self.pods.values():
                    other.failed = False  # a new round begins with the next start
                effects.append(LaunchEffect(Action.READY, self.name, address, "probe passed", seconds))
            elif now - pod.since >= self.launch.cold_start_timeout:
                pod.failed = True
                self.failed += 1
                why = f"not ready after cold_start_timeout ({self.launch.cold_start_timeout:g}s)"
                effects.append(LaunchEffect(Action.FAILED, self.name, address, why))
                effects.append(self._stop(address, pod, now, why))

    def _follow_drains(self, now: float, view: ServiceView, effects: list[LaunchEffect]) -> None:
        for address, pod in self.pods.items():
            if pod.state is not Launch.DRAINING:
                continue
            seen = view.pods.get(address)
            if seen is None or seen.in_flight == 0:
                effects.append(self._stop(address, pod, now, "drained"))
            elif now - pod.since >= self.drain_timeout:
                effects.append(self._stop(address, pod, now, f"still {seen.in_flight} in flight after drain_timeout"))

    def _serving(self, view: ServiceView) -> list[str]:
        """Pods that serve or will: ours booting or running, and healthy ones not ours."""
        serving = []
        for address in self.candidates:
            pod = self.pods[address]
            seen = view.pods.get(address)
            ours = pod.state in (Launch.STARTING, Launch.RUNNING)
            if ours or (pod.state is Launch.STOPPED and seen is not None and seen.healthy):
                serving.append(address)
        return serving

    def _desired(self, now: float, view: ServiceView, demand: int) -> int:
        launch = self.launch
        stable = self._stable.mean(now - launch.stable_window, demand)
        panic = self._panic.mean(now - launch.panic_window, demand)
        stable_want = math.ceil(stable / launch.target_concurrency)
        panic_want = math.ceil(panic / launch.target_concurrency)
        ready = sum(1 for address in self.candidates if (seen := view.pods.get(address)) and seen.healthy)
        if panic_want > ready and panic_want >= PANIC_THRESHOLD * max(ready, 1):
            self.panic_since = now
        elif self.panic_since is not None and now - self.panic_since >= launch.stable_window:
            self.panic_since = None
        want = max(panic_want, self.desired) if self.panic_since is not None else stable_want
        if demand > 0:
            want = max(want, 1)
        if want == 0 and now - self.last_activity < launch.scale_to_zero_after and self._serving(view):
            want = 1  # the last pod stays until scale_to_zero_after without a request
        return max(launch.min, min(want, self.max_pods))

    def _reconcile(self, now: float, view: ServiceView, effects: list[LaunchEffect]) -> None:
        serving = self._serving(view)
        if self.blocked_until is not None:
            if view.queued > 0 or (self.launch.min > 0 and now >= self.blocked_until):
                self.blocked_until = None
            else:
                return
        missing = self.desired - len(serving)
        for address in self.candidates:
            pod = self.pods[address]
            if missing > 0 and pod.state is Launch.DRAINING and pod.parked:
                # Wanted again before it stopped: it serves again (no cold start).
                pod.state, pod.since, pod.parked = Launch.RUNNING, now, False
                effects.append(LaunchEffect(Action.UNDRAIN, self.name, address, f"{self.desired} pods desired"))
                serving.append(address)
                missing -= 1
        # Pods still stopping hold their resources: they count toward max.
        leaving = sum(1 for pod in self.pods.values() if pod.state in (Launch.DRAINING, Launch.STOPPING))
        missing = min(missing, self.max_pods - len(serving) - leaving)
        for address in self.candidates:
            if missing <= 0:
                break
            pod = self.pods[address]
            if address in serving or pod.state is not Launch.STOPPED or pod.failed or not _probed(view, address):
                continue
            pod.state, pod.since = Launch.STARTING, now
            self.started += 1
            effects.append(LaunchEffect(Action.START, self.name, address, f"{self.desired} pods desired"))
            serving.append(address)
            missing -= 1
        surplus = len(serving) - self.desired
        if surplus > 0:
            ours = [a for a in serving if self.pods[a].state in (Launch.STARTING, Launch.RUNNING)]
            order = [a for a in reversed(ours) if self.pods[a].state is Launch.STARTING]
            order += [a for a in reversed(ours) if self.pods[a].state is Launch.RUNNING]
            for address in order[:surplus]:
                pod = self.pods[address]
                why = f"{self.desired} pods desired"
                if pod.state is Launch.STARTING:
                    effects.append(self._stop(address, pod, now, f"not needed any more: {why}"))
                else:
                    pod.state, pod.since, pod.parked = Launch.DRAINING, now, True
                    effects.append(LaunchEffect(Action.DRAIN, self.name, address, f"scaled down: {why}"))
        booting = any(self.pods[a].state is Launch.STARTING for a in serving)
        unknown = any(not _probed(view, a) for a in self.candidates)
        if view.queued and self.candidates and not booting and not unknown and not _any_healthy(view):
            # Nothing serves, nothing boots, no candidate left: give the waiters up.
            for pod in self.pods.values():
                pod.failed = False
            self.blocked_until = now + self.launch.cold_start_timeout
            effects.append(LaunchEffect(Action.REFUSE_WAITERS, self.name, reason="no launched pod became ready"))

    def _stop(self, address: str, pod: _Pod, now: float, reason: str) -> LaunchEffect:
        pod.state, pod.since = Launch.STOPPING, now
        self.stopped += 1
        return LaunchEffect(Action.STOP, self.name, address, reason)

    # -- views ------------------------------------------------------------------------

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "desired": self.desired,
            "min": self.launch.min,
            "max": self.max_pods,
            "panicking": self.panic_since is not None,
            "running": sum(1 for pod in self.pods.values() if pod.state is Launch.RUNNING),
            "starting": sum(1 for pod in self.pods.values() if pod.state is Launch.STARTING),
            "started": self.started,
            "stopped": self.stopped,
            "failed": self.failed,
            "cold_starts": self.cold_starts,
            "cold_start_seconds_total": round(self.cold_start_seconds_total, 6),
            "last_cold_start_seconds": None if self.last_cold_start is None else round(self.last_cold_start, 6),
            "seconds_since_request": round(now - self.last_activity, 3),
            "pods": {address: pod.state.value for address, pod in self.pods.items()},
        }

    def check_invariants(self, view: ServiceView | None = None) -> None:
        if not self.launch.min <= self.desired <= max(self.launch.min, self.max_pods):
            raise AssertionError(f"{self.name}: desired {self.desired} outside min..max")
        for address, pod in self.pods.items():
            if pod.parked and pod.state not in (Launch.DRAINING, Launch.STOPPING):
                raise AssertionError(f"{self.name}: {address} drained by us but {pod.state.value}")
            if pod.state is Launch.RUNNING and address not in self.listed:
                raise AssertionError(f"{self.name}: {address} unlisted but running, not draining")


def _probed(view: ServiceView, address: str) -> bool:
    seen = view.pods.get(address)
    return seen is None or seen.probed


def _any_healthy(view: ServiceView) -> bool:
    return any(seen.healthy for seen in view.pods.values())


def _drained_in(service: ServiceConfig, address: str) -> bool:
    return not any(p.address == address and not p.drain for p in service.pods)


class _Window:
    """Concurrency samples over a sliding window, with their running total: the mean
    costs O(1) amortized per sample (a scaler's step runs for every launched service
    every second)."""

    __slots__ = ("samples", "total")

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int]] = deque()
        # Invariant: the sum of the samples' values.
        self.total = 0

    def add(self, now: float, value: int) -> None:
        self.samples.append((now, value))
        self.total += value

    def mean(self, since: float, current: int) -> float:
        """The mean of the samples taken after ``since`` (older ones are dropped);
        ``current`` when there is none."""
        samples = self.samples
        while samples and samples[0][0] <= since:
            self.total -= samples.popleft()[1]
        return self.total / len(samples) if samples else float(current)


class Launches:
    """The scalers of every launched service of this activator. Does not yield."""

    def __init__(self) -> None:
        self.services: dict[str, ServiceScaler] = {}

    def configure(self, config: Config, now: float) -> list[LaunchEffect]:
        """Follow a (new) config: scalers for launched services, retired otherwise.

        With several activators, this one launches only the pods it owns
        (``launch_owner``).
        """
        peers = config.activators
        me = peers.self_name if peers is not None else ""
        names = tuple(peers.peers) if peers is not None else ()

        def owned(address: str) -> bool:
            return len(names) < 2 or launch_owner(address, names) == me

        effects: list[LaunchEffect] = []
        for name, retired in list(self.services.items()):
            kept = config.services.get(name)
            if kept is None or kept.launch is None:
                effects += retired.retire()
                del self.services[name]
        for name, service in config.services.items():
            if service.launch is None:
                continue
            scaler = self.services.get(name)
            if scaler is None:
                self.services[name] = ServiceScaler(service, now, owned)
            else:
                scaler.configure(service, now, owned)
        return effects

    def step(self, now: float, views: Mapping[str, ServiceView], sample: bool = True) -> list[LaunchEffect]:
        effects: list[LaunchEffect] = []
        for name, scaler in self.services.items():
            view = views.get(name)
            if view is not None:
                effects += scaler.step(now, view, sample)
        return effects

    def ended(self, service: str, address: str, now: float, detail: str) -> list[LaunchEffect]:
        scaler = self.services.get(service)
        return scaler.ended(address, now, detail) if scaler is not None else []

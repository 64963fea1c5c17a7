"""Launched pods, the shell: runs the autoscaler's decisions (``core.autoscale``).

What this module decides:

- **Where decisions are made.** ``Launching`` lives inside the topology writer's steps
  (``base.writer.TopologyWriter``): after each new config (``configure``), at each writer
  tick (``step``; the concurrency is sampled once a second), and for one service only on
  ``LaunchCheck`` (a request queued for a launched service that has no usable slot: a
  cold start must not wait for the next tick), on ``PodEnded`` (a pod's process ended)
  and when a booting pod's probe passes (``probed``). It reads the
  throttlers, calls the core, and applies the parts that change the topology at once
  (a pod drained or wanted again: ``ServiceThrottler.park``; waiters given up:
  ``refuse_waiters`` with 503 ``cold-start-failed``), returning their ``Effects`` to the
  writer. So the topology keeps one writer, and nothing here yields.
- **Starting and stopping** happen in greenlets of their own (``PodProcess``), never in
  the writer's step: a ``command`` is a child process in its own session (it outlives
  activator unless ``stop_pods_on_exit``), its output logged line by line, its exit
  reaped by gevent's child watcher and logged; it is stopped with SIGTERM to its process
  group, then SIGKILL after ``grace_period``. A ``systemd_unit`` is started and stopped
  with ``systemctl start/stop UNIT`` (a child process too, so the hub never blocks),
  and watched with ``systemctl is-active`` while it runs. Either way, a process that
  ends (or a start that fails) comes back to the writer as a ``PodEnded`` event.
- **Never a pod it did not start.** Only ``PodProcess`` handles made here are stopped;
  at activator's stop, they are left running (a restart costs no cold start) unless the
  service says ``stop_pods_on_exit: true``.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterable
from typing import IO, Any, Protocol

import gevent
import gevent.event
import gevent.subprocess

from ..core.autoscale import Action, LaunchEffect, Launches, LaunchEvent, PodEnded, PodView, ServiceView
from ..core.config import Config, LaunchConfig, PodConfig, fill_launch_template
from ..core.errors import ColdStartFailed
from ..core.states import PodState
from ..core.throttler import NO_EFFECTS, Effects, EffectsCollector, then
from ..core.topology import Topology

log = logging.getLogger("activator")

#: How often the concurrency of launched services is sampled into the windows.
SAMPLE_SECONDS = 1.0
#: How often a started systemd unit is checked with ``systemctl is-active``.
UNIT_CHECK_SECONDS = 2.0
#: The program that starts and stops systemd units (found on PATH).
SYSTEMCTL = "systemctl"


Post = Callable[[Any], None]


class PodProcess:
    """One pod started here: its process (or unit), and how to stop it."""

    def __init__(self, service: str, pod: PodConfig, launch: LaunchConfig, post: Post, grace_period: float) -> None:
        self.service = service
        self.address = pod.address
        self.launch = launch
        self.post = post
        self.grace_period = grace_period
        self.unit = fill_launch_template(launch.systemd_unit, pod.host, pod.port) if launch.systemd_unit else None
        self.argv = [fill_launch_template(arg, pod.host, pod.port) for arg in launch.command or ()]
        self.process: gevent.subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.ended = False
        self._stop_done = gevent.event.Event()  # a unit's systemctl stop returned
        self._greenlet = gevent.spawn(self._run)

    def _run(self) -> None:
        try:
            detail = self._run_unit() if self.unit is not None else self._run_command()
        except Exception as error:  # an OSError starting it, most often: the pod failed
            detail = f"could not start: {error}"
        self.ended = True
        self.post(PodEnded(self.service, self.address, detail))

    def _run_command(self) -> str:
        log.info("pod %s (service %s): starting %s", self.address, self.service, " ".join(self.argv))
        process = self.process = gevent.subprocess.Popen(
            self.argv,
            stdin=gevent.subprocess.DEVNULL,
            stdout=gevent.subprocess.PIPE,
            stderr=gevent.subprocess.STDOUT,
            start_new_session=True,  # its own process group; a terminal's Ctrl-C is not for it
        )
        assert process.stdout is not None
        if self.stopping:  # stopped before it was even started
            _signal_group(process, signal.SIGTERM)
        reader = gevent.spawn(self._log_output, process.stdout)
        status = process.wait()
        reader.join(timeout=1)
        return _exit_detail(status)

    def _log_output(self, stream: IO[bytes]) -> None:
        for line in stream:
            log.info("pod %s: %s", self.address, line.decode("utf-8", "replace").rstrip())

    def _run_unit(self) -> str:
        assert self.unit is not None
        log.info("pod %s (service %s): systemctl start %s", self.address, self.service, self.unit)
        code, output = _systemctl("start", self.unit)
        if code != 0:
            return f"systemctl start {self.unit} failed ({code}): {output}"
        while True:
            gevent.sleep(UNIT_CHECK_SECONDS)
            if self.stopping:
                break
            code, output = _systemctl("is-active", self.unit)
            if code != 0 and not self.stopping:
                return f"unit {self.unit} is {output or 'not active'}"
        self._stop_done.wait()
        return f"unit {self.unit} stopped"

    def stop(self, reason: str) -> None:
        """Stop the pod (SIGTERM, SIGKILL after grace_period; or systemctl stop). Yields:
        call it in a greenlet of its own. Its end is posted as ``PodEnded`` once."""
        if self.stopping:
            return
        self.stopping = True
        log.info("pod %s (service %s): stopping (%s)", self.address, self.service, reason)
        if self.unit is not None:
            code, output = _systemctl("stop", self.unit)
            if code != 0:
                log.warning("pod %s: systemctl stop %s failed (%d): %s", self.address, self.unit, code, output)
            self._stop_done.set()
            return
        process = self.process
        if process is None or process.poll() is not None:
            return
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=self.grace_period)
        except gevent.subprocess.TimeoutExpired:
            log.warning("pod %s: still running %gs after SIGTERM: SIGKILL", self.address, self.grace_period)
            _signal_group(process, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> bool:
        """Until its end was posted; whether it was."""
        self._greenlet.join(timeout=timeout)
        return bool(self._greenlet.dead)


def _signal_group(process: gevent.subprocess.Popen[bytes], signum: signal.Signals) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass  # gone already


def _exit_detail(status: int) -> str:
    if status < 0:
        return f"killed by {signal.Signals(-status).name}"
    return f"exit status {status}"


def _systemctl(*args: str) -> tuple[int, str]:
    """Run ``systemctl ARGS`` as a child (the hub goes on); its exit code and output."""
    try:
        done = gevent.subprocess.run(
            [SYSTEMCTL, *args],
            stdin=gevent.subprocess.DEVNULL,
            stdout=gevent.subprocess.PIPE,
            stderr=gevent.subprocess.STDOUT,
            timeout=300,
            check=False,
        )
    except (OSError, gevent.subprocess.TimeoutExpired) as error:
        return 127, str(error)
    return done.returncode, done.stdout.decode("utf-8", "replace").strip()


class LaunchSink(Protocol):
    """Where launches are counted (``observe.Observer``)."""

    def launched(self, effect: LaunchEffect) -> None:
        """One effect acted on (started, stopped, failed, ready with its cold start)."""


class Launching:
    """The launcher's decisions applied to the topology (see the module docstring)."""

    def __init__(
        self,
        topology: Topology,
        post: Post,
        sink: LaunchSink,
        on_boot: Callable[[str, str], None] = lambda service, address: None,
    ) -> None:
        self.topology = topology
        self.post = post
        self.sink = sink
        #: Called with (service, pod) as a pod starts booting (the prober hurries).
        self.on_boot = on_boot
        self.launches = Launches()
        self.processes: dict[tuple[str, str], PodProcess] = {}
        self._next_sample = 0.0
        self._config: Config | None = None

    @property
    def active(self) -> bool:
        return bool(self.launches.services) or bool(self.processes)

    def configure(self, config: Config, now: float) -> Effects:
        """A (new) config applied to the topology. Does not yield."""
        self._config = config
        effects = self._act(self.launches.configure(config, now), now)
        return then(effects, self.step(now, sample=False))

    def handle(self, event: LaunchEvent, now: float) -> Effects:
        """A launch event, in the writer's step. Does not yield."""
        if isinstance(event, PodEnded):
            process = self.processes.get((event.service, event.address))
            if process is not None and not process.ended:
                return NO_EFFECTS  # an earlier process's end: the pod's current one runs
            if process is not None:
                del self.processes[(event.service, event.address)]
                level = logging.INFO if process.stopping else logging.WARNING
                log.log(level, "pod %s (service %s) ended: %s", event.address, event.service, event.detail)
            effects = self._act(self.launches.ended(event.service, event.address, now, event.detail), now)
            return then(effects, self._step((event.service,), now, False))
        return self._step((event.service,), now, False)

    def step(self, now: float, sample: bool | None = None) -> Effects:
        """Observe every launched service and act. ``sample`` None: once a second. Does not yield."""
        if not self.launches.services:
            return NO_EFFECTS
        if sample is None:
            sample = now >= self._next_sample
            if sample:
                self._next_sample = now + SAMPLE_SECONDS
        return self._step(self.launches.services, now, sample)

    def probed(self, service: str, address: str, now: float) -> Effects:
        """A probe passed: a booting pod may be ready (only then is its service looked
        at: healthy pods pass a probe every interval). Does not yield."""
        return self._step((service,), now, False) if self.booting(service, address) else NO_EFFECTS

    def _step(self, names: Iterable[str], now: float, sample: bool) -> Effects:
        """Observe these launched services and act on the decisions."""
        views = {}
        for name in names:
            throttler = self.topology.services.get(name)
            if throttler is None or name not in self.launches.services:
                continue
            pods = {
                address: PodView(tracker.state is PodState.HEALTHY, tracker.in_flight, tracker.last_probe is not None)
                for address, tracker in throttler.trackers.items()
            }
            requests = sum(tracker.requests for tracker in throttler.trackers.values())
            views[name] = ServiceView(throttler.in_flight, throttler.queued, requests, pods)
        return self._act(self.launches.step(now, views, sample), now)

    def _act(self, decided: list[LaunchEffect], now: float) -> Effects:
        collected = EffectsCollector()
        for effect in decided:
            self.sink.launched(effect)
            throttler = self.topology.services.get(effect.service)
            action = effect.action
            if action is Action.START:
                self._start(effect)
            elif action is Action.STOP:
                process = self.processes.get((effect.service, effect.pod))
                if process is None:  # it ended meanwhile: its end is on its way
                    self.post(PodEnded(effect.service, effect.pod, "already ended"))
                else:
                    gevent.spawn(process.stop, effect.reason)
            elif action is Action.DRAIN and throttler is not None:
                log.info("pod %s (service %s): draining before its stop: %s", effect.pod, effect.service, effect.reason)
                collected.add(throttler.park(effect.pod, True, now, f"launcher: {effect.reason}"))
            elif action is Action.UNDRAIN and throttler is not None:
                collected.add(throttler.park(effect.pod, False, now, f"launcher: {effect.reason}"))
            elif action is Action.READY:
                log.info(
                    "pod %s (service %s): ready after a cold start of %.3fs",
                    effect.pod,
                    effect.service,
                    effect.seconds or 0.0,
                )
            elif action is Action.FAILED:
                log.warning("pod %s (service %s): launch failed: %s", effect.pod, effect.service, effect.reason)
            elif action is Action.REFUSE_WAITERS and throttler is not None:
                log.warning(
                    "service %s: %s; %d waiting requests answered 503 cold-start-failed",
                    effect.service,
                    effect.reason,
                    throttler.queued,
                )
                collected.add(throttler.refuse_waiters(ColdStartFailed(effect.reason)))
        return collected.result()

    def _start(self, effect: LaunchEffect) -> None:
        config = self._config
        service = config.services.get(effect.service) if config is not None else None
        pod = next((p for p in service.pods if p.address == effect.pod), None) if service else None
        if service is None or service.launch is None or pod is None or config is None:
            self.post(PodEnded(effect.service, effect.pod, "no longer configured"))
            return
        key = (effect.service, effect.pod)
        if key in self.processes:  # still ending from an earlier start: that end is on its way
            log.warning("pod %s (service %s): started while its last process still ends", effect.pod, effect.service)
        self.processes[key] = PodProcess(effect.service, pod, service.launch, self.post, config.grace_period)
        self.on_boot(effect.service, effect.pod)

    def booting(self, service: str, address: str) -> bool:
        """Whether this activator started the pod and it is not ready yet. Does not yield."""
        scaler = self.launches.services.get(service)
        return scaler is not None and scaler.booting(address)

    def shutdown(self, config: Config) -> None:
        """At activator's stop: stop the pods of services with ``stop_pods_on_exit: true``
        (and wait for them); leave the others running. Yields."""
        stopping = []
        for (name, address), process in list(self.processes.items()):
            service = config.services.get(name)
            if service is not None and service.launch is not None and service.launch.stop_pods_on_exit:
                stopping.append(gevent.spawn(process.stop, "activator stops (stop_pods_on_exit)"))
            else:
                log.info("pod %s (service %s) left running", address, name)
        gevent.joinall(stopping)
        for process in list(self.processes.values()):
            if process.stopping:
                process.wait(timeout=config.grace_period + 5)

    def snapshot(self, now: float) -> dict[str, dict[str, Any]]:
        return {name: scaler.snapshot(now) for name, scaler in self.launches.services.items()}

"""End to end: pods that the activator starts on demand and stops when idle (``launch:``).

The real ``activator run`` launches real ``tests/backend.py`` pods as its ``command``
(through ``sh``, which writes the pod's pid and ``exec``s the backend, so that the test
can tell whether the pod process still runs, and kill it at teardown whatever
happened). Windows are short through the config; tests wait on ``/status`` with
generous deadlines and never assert a duration.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import (
    SERVICE,
    Activator,
    activator_reason,
    free_ports,
    json_request,
    make_config,
    probe_config,
    request,
    run_cli,
    start_request,
    wait_until,
)

pytestmark = pytest.mark.binary

BACKEND = Path(__file__).resolve().parents[1] / "backend.py"


class Pods:
    """The ports of the launched pods, and the pids their command wrote."""

    def __init__(self, directory: Path, count: int) -> None:
        self.dir = directory
        self.ports = free_ports(count)
        self.addresses = [f"127.0.0.1:{port}" for port in self.ports]

    def command(
        self, fail_ports: tuple[int, ...] = (), boot_delay: float = 0, unready_ports: tuple[int, ...] = ()
    ) -> list[str]:
        """``sh -c``: write the pid, exit 3 for a port in ``fail_ports``, else (after
        ``boot_delay`` seconds: a slow model server) become the backend, whose /healthz
        answers 503 for a port in ``unready_ports`` (it runs, it never gets ready)."""
        failing = " ".join(str(port) for port in fail_ports) or "none"
        unready = " ".join(str(port) for port in unready_ports) or "none"
        script = (
            f'echo $$ > {self.dir}/pod-$0.pid; for bad in {failing}; do [ "$0" = "$bad" ] && exit 3; done; '
            f'health=""; for sick in {unready}; do [ "$0" = "$sick" ] && health=--fail-health; done; '
            f"sleep {boot_delay}; exec {sys.executable} {BACKEND} --port $0 $health"
        )
        return ["/bin/sh", "-c", script, "{port}"]

    def pid(self, port: int) -> int | None:
        path = self.dir / f"pod-{port}.pid"
        return int(path.read_text()) if path.exists() else None

    def running(self, port: int) -> bool:
        pid = self.pid(port)
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return _not_a_zombie(pid)

    def kill_all(self) -> None:
        for port in self.ports:
            pid = self.pid(port)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _not_a_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[Any]:
    made: list[Pods] = []

    def make(count: int) -> Pods:
        made.append(Pods(tmp_path, count))
        return made[-1]

    yield make
    for group in made:
        group.kill_all()


def launched(
    pods: Pods,
    *,
    fail_ports: tuple[int, ...] = (),
    unready_ports: tuple[int, ...] = (),
    boot_delay: float = 0,
    cc: int = 1,
    **launch: Any,
) -> dict[str, Any]:
    settings = {"stable_window": "2s", "scale_to_zero_after": "1h", "cold_start_timeout": "20s", **launch}
    return make_config(
        pods.addresses,
        container_concurrency=cc,
        probe=probe_config("100ms"),
        queue_timeout="60s",
        launch={"command": pods.command(fail_ports, boot_delay, unready_ports), **settings},
        top={"grace_period": "5s"},
    )


def launch_status(status: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = status["services"][SERVICE]["launch"]
    return result


def release(port: int, key: str = "*") -> None:
    json_request(f"127.0.0.1:{port}", "POST", f"/_release?key={key}")


# -- from zero ----------------------------------------------------------------------------


def test_a_cold_start_holds_the_requests_then_serves_them_in_arrival_order(pods, activator_factory):
    group = pods(2)
    act: Activator = activator_factory(launched(group, max=1, boot_delay=5))
    assert not group.running(group.ports[0])  # min 0: nothing runs before a request
    responses: list[Any] = [None] * 4

    def send(i: int) -> None:
        responses[i] = request(act.listen, path="/delay?ms=50", headers={"X-Request-Id": f"r{i}"}, timeout=60)

    threads = []
    for i in range(4):  # one at a time into the queue, so that arrival order is known
        threads.append(threading.Thread(target=send, args=(i,)))
        threads[-1].start()
        act.wait_for(lambda st, n=i + 1: st["services"][SERVICE]["queued"] == n, message=f"request {i} queued")
    assert launch_status(act.status())["starting"] == 1  # all four wait for the one cold start
    for thread in threads:
        thread.join(60)
    assert [r.status for r in responses] == [200] * 4
    ids = json_request(f"127.0.0.1:{group.ports[0]}", path="/_stats")["request_ids"]
    assert ids == ["r0", "r1", "r2", "r3"]
    status = launch_status(act.status())
    assert status["cold_starts"] == 1 and status["started"] == 1 and status["failed"] == 0
    assert status["last_cold_start_seconds"] > 0
    assert not group.running(group.ports[1])  # max: 1


def test_scale_up_under_load_then_back_down_draining_first(pods, activator_factory):
    group = pods(2)
    act: Activator = activator_factory(launched(group, max=2))
    first = start_request(act.listen, path="/hold?key=a", timeout=120)
    act.wait_for(lambda st: launch_status(st)["running"] == 1, message="first pod up")
    second = start_request(act.listen, path="/hold?key=b", timeout=120)
    act.wait_for(lambda st: launch_status(st)["running"] == 2, message="a second pod for the second request")
    wait_until(lambda: group.running(group.ports[1]), message="the second pod runs")
    for port in group.ports:
        release(port)
    assert first.getresponse().status == 200 and second.getresponse().status == 200
    act.wait_for(
        lambda st: launch_status(st)["running"] == 1 and launch_status(st)["pods"][group.addresses[1]] == "stopped",
        timeout=60,
        message="back to one pod once the stable window agrees",
    )
    wait_until(lambda: not group.running(group.ports[1]), message="the second pod's process ended")
    assert group.running(group.ports[0])
    assert request(act.listen, path="/delay?ms=1").status == 200


def test_to_zero_after_scale_to_zero_after_without_a_request(pods, activator_factory):
    group = pods(1)
    act: Activator = activator_factory(launched(group, stable_window="1s", scale_to_zero_after="2s"))
    assert request(act.listen, path="/delay?ms=1", timeout=60).status == 200
    assert group.running(group.ports[0])
    act.wait_for(lambda st: launch_status(st)["desired"] == 0 and launch_status(st)["stopped"] == 1, timeout=60)
    wait_until(lambda: not group.running(group.ports[0]), message="the pod stopped")
    act.wait_pod_state(SERVICE, group.addresses[0], "pending")
    assert request(act.listen, path="/delay?ms=1", timeout=60).status == 200  # and up again
    assert launch_status(act.status())["cold_starts"] == 2


# -- cold starts that fail -------------------------------------------------------------------


def test_a_pod_that_exits_at_once_is_counted_and_the_next_candidate_serves(pods, activator_factory):
    group = pods(2)
    act: Activator = activator_factory(launched(group, fail_ports=(group.ports[0],)))
    response = request(act.listen, path="/delay?ms=1", timeout=60)
    assert response.status == 200
    assert response.headers["X-Pod"] == group.addresses[1]
    status = launch_status(act.status())
    assert status["failed"] == 1 and status["cold_starts"] == 1
    assert "launch failed" in act.output_tail(20000)


def test_a_pod_that_never_gets_ready_is_stopped_after_cold_start_timeout_and_the_next_serves(pods, activator_factory):
    group = pods(2)
    config = launched(group, unready_ports=(group.ports[0],), cold_start_timeout="2s")
    act: Activator = activator_factory(config)
    response = request(act.listen, path="/delay?ms=1", timeout=60)
    assert response.status == 200
    assert response.headers["X-Pod"] == group.addresses[1]
    status = launch_status(act.status())
    assert status["failed"] == 1 and status["pods"][group.addresses[0]] in ("stopping", "stopped")
    wait_until(lambda: not group.running(group.ports[0]), message="the pod that never got ready was stopped")
    assert "not ready after cold_start_timeout" in act.output_tail(20000)


def test_when_no_candidate_comes_up_the_waiters_get_503_cold_start_failed(pods, activator_factory):
    group = pods(2)
    act: Activator = activator_factory(launched(group, fail_ports=tuple(group.ports)))
    response = request(act.listen, path="/delay?ms=1", timeout=60)
    assert response.status == 503
    assert activator_reason(response) == "cold-start-failed"
    assert launch_status(act.status())["failed"] == 2
    again = request(act.listen, path="/delay?ms=1", timeout=60)  # a new request: a new round
    assert activator_reason(again) == "cold-start-failed"
    assert launch_status(act.status())["failed"] == 4


# -- activator's own stop and reloads --------------------------------------------------------


@pytest.mark.parametrize("stop_pods_on_exit", [False, True])
def test_at_its_stop_activator_leaves_started_pods_running_unless_told(pods, activator_factory, stop_pods_on_exit):
    group = pods(1)
    act: Activator = activator_factory(launched(group, stop_pods_on_exit=stop_pods_on_exit))
    assert request(act.listen, path="/delay?ms=1", timeout=60).status == 200
    assert act.stop() == 0
    if stop_pods_on_exit:
        wait_until(lambda: not group.running(group.ports[0]), message="the pod stopped with activator")
    else:
        assert group.running(group.ports[0])
        assert json_request(f"127.0.0.1:{group.ports[0]}", path="/_stats")["count"] == 1


def test_a_restarted_activator_uses_the_pod_left_running_and_never_stops_it(pods, activator_factory):
    group = pods(1)
    config = launched(group, stable_window="1s", scale_to_zero_after="1s")
    act: Activator = activator_factory(config)
    assert request(act.listen, path="/delay?ms=1", timeout=60).status == 200
    act.stop()
    again: Activator = activator_factory(config)
    assert request(again.listen, path="/delay?ms=1", timeout=60).status == 200
    status = launch_status(again.status())
    assert status["started"] == 0  # the pod it found healthy is not its own
    time.sleep(3)  # past scale_to_zero_after: a pod it started would have been stopped by now
    assert group.running(group.ports[0])
    assert launch_status(again.status())["stopped"] == 0


def test_a_reload_removing_the_launcher_keeps_the_serving_pods(pods, activator_factory):
    group = pods(2)
    config = launched(group, stable_window="1s", scale_to_zero_after="2s")
    act: Activator = activator_factory(config, env={"ACTIVATOR_WATCH_INTERVAL": "0.2"})
    assert request(act.listen, path="/delay?ms=1", timeout=60).status == 200
    without = {**config, "services": {SERVICE: {**config["services"][SERVICE]}}}
    del without["services"][SERVICE]["launch"]
    act.rewrite_config(without)
    act.wait_for(lambda st: "launch" not in st["services"][SERVICE], message="the launcher removed")
    time.sleep(3)  # past the old scale_to_zero_after: nothing stops it now
    assert group.running(group.ports[0])
    assert act.wait_pod_state(SERVICE, group.addresses[0], "healthy")
    assert request(act.listen, path="/delay?ms=1").status == 200


# -- systemd units, with a fake systemctl --------------------------------------------------------

FAKE_SYSTEMCTL = """#!/bin/sh
# A stand-in for systemctl: logs its argv, runs the backend for "start pod@PORT.service".
echo "$@" >> "{log}"
unit="$2"; port="${{unit#pod@}}"; port="${{port%.service}}"
pidfile="{dir}/pod-$port.pid"
case "$1" in
  start) {python} {backend} --port "$port" >/dev/null 2>&1 & echo $! > "$pidfile" ;;
  stop) kill "$(cat "$pidfile")"; while kill -0 "$(cat "$pidfile")" 2>/dev/null; do sleep 0.05; done ;;
  is-active) kill -0 "$(cat "$pidfile")" 2>/dev/null && echo active || {{ echo inactive; exit 3; }} ;;
esac
"""


def test_a_systemd_unit_launcher_sends_systemctl_start_and_stop_with_the_unit_name(pods, activator_factory, tmp_path):
    """Honest about what it proves: real systemd does not run here, so ``systemctl`` is a
    fake on PATH that logs the argv activator sends and runs the backend itself. This
    tests the commands (``start``/``is-active``/``stop`` with the unit name filled in) and
    the lifecycle around them, not systemd; ``packaging/systemd/`` holds what a real
    systemd needs (the polkit rule)."""
    group = pods(1)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "systemctl.log"
    fake = bin_dir / "systemctl"
    fake.write_text(FAKE_SYSTEMCTL.format(log=log, dir=tmp_path, python=sys.executable, backend=BACKEND))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    config = launched(group, stable_window="1s", scale_to_zero_after="3s")
    config["services"][SERVICE]["launch"] = {
        **{k: v for k, v in config["services"][SERVICE]["launch"].items() if k != "command"},
        "systemd_unit": "pod@{port}.service",
    }
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    act: Activator = activator_factory(config, env=env)
    assert request(act.listen, path="/delay?ms=1", timeout=60).status == 200
    act.wait_for(lambda st: launch_status(st)["stopped"] == 1, timeout=60, message="stopped after idle")
    wait_until(lambda: not group.running(group.ports[0]), message="the unit's process ended")
    unit = f"pod@{group.ports[0]}.service"
    calls = log.read_text().splitlines()
    assert calls[0] == f"start {unit}"
    assert calls[-1] == f"stop {unit}"
    assert set(calls) <= {f"start {unit}", f"is-active {unit}", f"stop {unit}"}


# -- visible -----------------------------------------------------------------------------------


def test_launches_show_in_status_metrics_statsd_the_cli_and_the_page(pods, activator_factory, statsd_receiver):
    group = pods(1)
    config = launched(group)
    config["statsd"] = {"address": statsd_receiver.address, "prefix": "act"}
    act: Activator = activator_factory(config)
    assert request(act.listen, path="/delay?ms=1", timeout=60).status == 200
    act.wait_for(lambda st: launch_status(st)["running"] == 1, message="the pod started here is running")
    statsd_receiver.wait_for_metric(f"act.{SERVICE}.launch.started", "c")
    statsd_receiver.wait_for_metric(f"act.{SERVICE}.launch.cold_start", "ms")
    statsd_receiver.wait_for(lambda lines: statsd_receiver.gauge(f"act.{SERVICE}.launch.desired") == 1)
    metrics = act.admin_get("/metrics").text
    assert f'activator_launch_cold_starts_total{{service="{SERVICE}"}} 1.0' in metrics
    assert f'activator_launch_desired{{service="{SERVICE}"}} 1.0' in metrics
    assert f'activator_launch_failed_total{{service="{SERVICE}"}} 0.0' in metrics
    table = run_cli(["status", "--admin", act.admin or ""])
    assert table.returncode == 0, table.stderr
    assert "launch: desired=1 (0..1)  running=1  starting=0  cold_starts=1" in table.stdout
    page = act.admin_get("/").text
    assert "launch: desired <b>1</b>" in page


# -- several activators ------------------------------------------------------------------------


def test_with_two_activators_only_the_pod_s_owner_launches_it_and_the_other_uses_it(pods, activator_factory):
    """A cold request at the activator that owns no pod goes to the pod's owner, which
    starts it; the other then sees it ready through its own probes and serves through it."""
    from activator.core.autoscale import launch_owner

    group = pods(1)
    address = group.addresses[0]
    names = ["a", "b"]
    owner = launch_owner(address, names)
    other = next(name for name in names if name != owner)
    listen = dict(zip(names, [f"127.0.0.1:{port}" for port in free_ports(2)], strict=True))
    service = launched(group, cc=2)["services"][SERVICE]
    acts: dict[str, Activator] = {}
    for name in names:
        config = {
            "listen": listen[name],
            "access_log": False,
            "activators": {"self": name, "peers": listen, "secret": "the-fleets-shared-secret"},
            "services": {SERVICE: service},
        }
        acts[name] = activator_factory(config, start=False)
    for act in acts.values():
        act.start(wait_ready=False)
    for act in acts.values():
        act.wait_ready()
        act.wait_for(lambda st: all(h["state"] == "up" for h in st["activator"]["health"].values()), message="peers up")
    assert launch_status(acts[other].status())["max"] == 0  # it may launch none of them
    # The first request reaches the activator that launches nothing: it goes to the owner.
    first = request(acts[other].listen, path="/delay?ms=1", timeout=60)
    assert first.status == 200 and first.headers["X-Pod"] == address
    assert launch_status(acts[owner].status())["started"] == 1
    acts[other].wait_pod_state(SERVICE, address, "healthy")  # seen through its own probes
    response = request(acts[other].listen, path="/delay?ms=1", timeout=60)
    assert response.status == 200 and response.headers["X-Pod"] == address
    status = launch_status(acts[other].status())
    assert status["started"] == 0 and status["pods"][address] == "stopped"
    assert group.running(group.ports[0])


SYSTEMD_RUNS = Path("/run/systemd/system").is_dir() and os.geteuid() == 0 and shutil.which("systemctl") is not None


@pytest.mark.skipif(not SYSTEMD_RUNS, reason="systemd is not PID 1 here (or not root): no real unit can be started")
def test_a_real_systemd_template_unit_is_started_then_stopped_when_idle(pods, activator_factory):
    """Where systemd runs (as root): a template unit under /run/systemd/system runs the
    backend on the instance's port; activator starts it with ``systemctl start`` and
    stops it after ``scale_to_zero_after``. Not run where this was written (no systemd)."""
    group = pods(1)
    name = f"activator-test-{os.getpid()}"
    template = Path("/run/systemd/system") / f"{name}@.service"
    template.write_text(f"[Service]\nType=exec\nExecStart={sys.executable} {BACKEND} --port %i\n")
    subprocess.run(["systemctl", "daemon-reload"], check=True, timeout=60)
    unit = f"{name}@{group.ports[0]}.service"
    try:
        config = launched(group, stable_window="1s", scale_to_zero_after="2s")
        launch = config["services"][SERVICE]["launch"]
        del launch["command"]
        launch["systemd_unit"] = f"{name}@{{port}}.service"
        act: Activator = activator_factory(config)
        assert request(act.listen, path="/delay?ms=1", timeout=60).status == 200
        assert subprocess.run(["systemctl", "is-active", "--quiet", unit], timeout=60).returncode == 0
        act.wait_for(lambda st: launch_status(st)["pods"][group.addresses[0]] == "stopped", timeout=60)
        wait_until(
            lambda: subprocess.run(["systemctl", "is-active", "--quiet", unit], timeout=60).returncode != 0,
            message=f"{unit} stopped",
        )
    finally:
        subprocess.run(["systemctl", "stop", unit], timeout=60)
        template.unlink()
        subprocess.run(["systemctl", "daemon-reload"], timeout=60)

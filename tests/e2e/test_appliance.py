"""End to end: the appliance (issue 6, point 6): sd_notify, signals, the executable.

Runs against whatever the harness starts: ``python -m activator`` from the venv, or the
PyInstaller executable when ``$ACTIVATOR_BIN`` names it (``.ci/run`` does both; the
one-file binary is two processes, the bootloader forwarding signals to Python, and
these tests signal the bootloader, as systemd does).

- sd_notify: a real ``AF_UNIX``/``SOCK_DGRAM`` socket passed as ``$NOTIFY_SOCKET``
  (``harness.NotifySocket``) receives ``READY=1`` with a ``STATUS=`` line,
  ``RELOADING=1`` then ``READY=1`` on SIGHUP, ``STOPPING=1`` on SIGTERM, and
  ``WATCHDOG=1`` pings when ``$WATCHDOG_USEC`` is set.
- SIGTERM: ``/readyz`` 503, the listener closed (a new connection is refused), a new
  request on a kept-alive connection gets 503 ``shutting-down``, queued and in-flight
  requests finish with 200, exit 0; ``grace_period`` bounds the drain; a second stop
  signal exits at once.

Requests that must stay in flight while a test looks around are chunked uploads whose
last chunk the test releases (``GatedUpload``): the drain lasts exactly as long as the
test needs, with no sleeps and no elapsed-time assertions. Loopback only.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
from harness import (
    DEFAULT_TIMEOUT,
    SERVICE,
    Activator,
    Client,
    NotifySocket,
    Pod,
    find_pod,
    make_config,
    request,
    run_cli,
    start_request,
    wait_until,
)

from activator import __version__
from activator.process.signals import DUPLICATE_SIGNAL_SECONDS

pytestmark = pytest.mark.binary

#: One catch-all service ``api`` over the pods, cc 1, no probe, first-available,
#: ``grace_period`` 60 s unless ``top`` says otherwise.
appliance_config = partial(make_config, lb_policy="first-available", queue_timeout="60s", top={"grace_period": "60s"})

# The held upload's parts: the proxy reads up to 64 KiB of a request body before it
# sends the head to the pod (activator/pods/http1.py), so the first part is larger.
FIRST_PART = b"x" * (256 * 1024)
LAST_PART = b"y" * 1000


def start(
    activator_factory: Any,
    config: dict[str, Any],
    notify: NotifySocket | None = None,
    watchdog_usec: int | None = None,
    **env: str,
) -> Activator:
    """The activator, started and ready; the file watcher effectively off (only SIGHUP
    re-reads), ``$NOTIFY_SOCKET`` (and ``$WATCHDOG_USEC``) set when ``notify`` is given."""
    child_env = {"ACTIVATOR_WATCH_INTERVAL": "3600", **env}
    if notify is not None:
        child_env.update(notify.env(watchdog_usec))
    act: Activator = activator_factory(config, env=child_env)
    return act


def svc(act: Activator) -> dict[str, Any]:
    result: dict[str, Any] = act.status()["services"][SERVICE]
    return result


def readyz(act: Activator) -> int:
    return act.admin_get("/readyz", timeout=5.0).status


def connection_refused(address: str) -> bool:
    """True when a new TCP connection to ``address`` is refused (the listener is gone)."""
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=5.0)
    except ConnectionRefusedError:
        return True
    sock.close()
    return False


def index_of(lines: list[str], text: str, after: int = -1) -> int:
    """Index of the first line equal to ``text`` after index ``after`` (-1 if none)."""
    return next((i for i, line in enumerate(lines) if i > after and line == text), -1)


def status_lines(datagram: str) -> list[str]:
    return [line[len("STATUS=") :] for line in datagram.split("\n") if line.startswith("STATUS=")]


def exchange_outcome(conn: http.client.HTTPConnection) -> int | str:
    """The response status, or ``"cut"`` when the connection failed or was cut short."""
    try:
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (http.client.HTTPException, OSError) as error:
        return f"cut ({error!r})"
    finally:
        conn.close()


class GatedUpload:
    """A chunked ``POST /upload`` whose last chunk waits for :meth:`release`.

    The pod counts it in flight from its head until the body ends, so the request is
    in flight for as long as the test wants. Runs on a thread; ``outcome`` is the status
    and the pod's JSON answer, or the exception that ended it.
    """

    def __init__(self, target: str) -> None:
        self.target = target
        self._gate = threading.Event()
        self.status: int | None = None
        self.answer: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gated-upload", daemon=True)
        self._thread.start()

    def _body(self) -> Iterator[bytes]:
        yield FIRST_PART
        self._gate.wait(DEFAULT_TIMEOUT * 4)
        yield LAST_PART

    def _run(self) -> None:
        try:
            conn = start_request(
                self.target,
                "POST",
                "/upload",
                body=self._body(),
                timeout=DEFAULT_TIMEOUT * 4,
            )
            try:
                resp = conn.getresponse()
                data = resp.read()
                self.status = resp.status
                if resp.status == 200:
                    self.answer = json.loads(data)
            finally:
                conn.close()
        except BaseException as error:  # reported to the test
            self.error = error

    def release(self, timeout: float = DEFAULT_TIMEOUT) -> GatedUpload:
        """Send the last chunk and wait for the outcome."""
        self._gate.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the upload did not finish"
        return self

    def abandon(self) -> None:
        """Let the thread end whatever happened (teardown)."""
        self._gate.set()
        self._thread.join(5.0)


@pytest.fixture
def gated() -> Iterator[list[GatedUpload]]:
    made: list[GatedUpload] = []
    yield made
    for upload in made:
        upload.abandon()


def hold(made: list[GatedUpload], act: Activator, pod: Pod) -> GatedUpload:
    """Start a gated upload through ``act`` and wait until ``pod`` works on it."""
    before = pod.stats()["in_flight"]
    upload = GatedUpload(act.listen)
    made.append(upload)
    wait_until(
        lambda: pod.stats()["in_flight"] == before + 1 or upload.error,
        message="the upload in flight on the pod",
    )
    assert upload.error is None, f"upload failed early: {upload.error!r}"
    return upload


# --------------------------------------------------------------------------------------
# it proxies


def test_proxies_a_request_through_a_pod(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = start(activator_factory, appliance_config([pod]))
    resp = request(act.listen, path="/echo/hello?x=1", host="api.example.com")
    assert resp.status == 200, resp.text
    assert resp.headers["X-Pod"] == pod.address
    assert pod.stats()["count"] == 1
    assert find_pod(act.status(), SERVICE, pod.address)["state"] == "healthy"


# --------------------------------------------------------------------------------------
# sd_notify


def test_ready_and_stopping_arrive_on_the_notify_socket(pod_factory, activator_factory, notify_socket):
    (pod,) = pod_factory(1)
    act = start(activator_factory, appliance_config([pod]), notify_socket)

    ready = notify_socket.wait_for("READY=1")
    statuses = status_lines(ready)
    assert statuses and statuses[0].strip(), f"READY=1 without a STATUS= line: {ready!r}"
    assert request(act.listen, path="/delay?ms=1").status == 200

    assert act.stop() == 0
    stopping = notify_socket.wait_for("STOPPING=1")
    lines = notify_socket.assignments()
    assert index_of(lines, "READY=1") < index_of(lines, "STOPPING=1"), lines
    assert all(line.strip() for line in status_lines(stopping))
    # No watchdog was asked for (no WATCHDOG_USEC), so none was sent.
    assert "WATCHDOG=1" not in lines, lines


def test_watchdog_pings_when_watchdog_usec_is_set(pod_factory, activator_factory, notify_socket):
    (pod,) = pod_factory(1)
    act = start(activator_factory, appliance_config([pod]), notify_socket, watchdog_usec=1_000_000)
    notify_socket.wait_for("READY=1")
    wait_until(
        lambda: notify_socket.assignments().count("WATCHDOG=1") >= 3,
        message=lambda: f"three WATCHDOG=1 pings in {notify_socket.messages()}",
    )
    # The pings come from the event loop while it serves.
    assert request(act.listen, path="/delay?ms=1").status == 200
    count = notify_socket.assignments().count("WATCHDOG=1")
    wait_until(
        lambda: notify_socket.assignments().count("WATCHDOG=1") > count,
        message="pings go on after a request",
    )
    assert act.stop() == 0
    notify_socket.wait_for("STOPPING=1")


# --------------------------------------------------------------------------------------
# SIGHUP


def test_sighup_applies_a_changed_file(pod_factory, activator_factory, notify_socket):
    a, b = pod_factory(2)
    act = start(activator_factory, appliance_config([a]), notify_socket)
    notify_socket.wait_for("READY=1")
    assert svc(act)["capacity"] == 1

    act.rewrite_config(appliance_config([a, b], container_concurrency=2))
    act.reload()
    st = act.wait_for(
        lambda st: (
            find_pod(st, SERVICE, b.address) is not None and find_pod(st, SERVICE, b.address)["state"] == "healthy"
        ),
        message="pod B added by SIGHUP",
    )
    service = st["services"][SERVICE]
    assert service["container_concurrency"] == 2
    assert service["capacity"] == 4
    assert st["config"]["last_error"] is None

    # systemd's reload protocol: RELOADING=1, then READY=1 once the file is applied.
    def reloaded() -> bool:
        lines = notify_socket.assignments()
        return index_of(lines, "READY=1", index_of(lines, "RELOADING=1")) > index_of(lines, "RELOADING=1") >= 0

    wait_until(
        reloaded,
        message=lambda: f"RELOADING=1 then READY=1 in {notify_socket.messages()}",
    )
    reloading = next(m for m in notify_socket.messages() if "RELOADING=1" in m)
    assert "MONOTONIC_USEC=" in reloading, reloading

    # `activator status` (the CLI) shows the change too.
    result = run_cli(["status", "--admin", act.admin])
    assert result.returncode == 0, result.stderr
    assert b.address in result.stdout, result.stdout

    assert request(act.listen, path="/delay?ms=1").status == 200

    # A broken file: RELOADING=1 and READY=1 again, the old config keeps serving.
    notify_socket.clear()
    act.write_config_in_place("services: [this is not\n")
    act.reload()
    act.wait_for(lambda st: st["config"]["last_error"], message="the error shown in /status")
    wait_until(
        reloaded,
        message=lambda: f"RELOADING=1 then READY=1 in {notify_socket.messages()}",
    )
    assert svc(act)["capacity"] == 4
    assert request(act.listen, path="/delay?ms=1").status == 200
    assert act.stop() == 0


# --------------------------------------------------------------------------------------
# SIGTERM


def test_sigterm_drains_in_flight_and_queued_requests_then_exits_0(
    pod_factory, activator_factory, notify_socket, gated
):
    (pod,) = pod_factory(1)
    act = start(activator_factory, appliance_config([pod], top={"grace_period": "120s"}), notify_socket)
    notify_socket.wait_for("READY=1")

    keepalive = Client(act.listen)
    try:
        first = keepalive.request("GET", "/delay?ms=1")
        assert first.status == 200

        upload = hold(gated, act, pod)  # in flight on the only slot
        queued = start_request(act.listen, path="/delay?ms=1", headers={"X-Request-Id": "queued"})
        try:
            act.wait_for(
                lambda st: st["services"][SERVICE]["queued"] == 1,
                message="one request queued",
            )

            act.signal(signal.SIGTERM)
            notify_socket.wait_for("STOPPING=1")
            wait_until(lambda: readyz(act) == 503, message="/readyz 503 while draining")
            wait_until(
                lambda: connection_refused(act.listen),
                message="new connections refused",
            )

            # A new request on the connection kept alive from before the stop.
            late = keepalive.request("GET", "/delay?ms=1")
            assert late.status == 503, late
            assert late.headers.get("X-Activator-Reason") == "shutting-down", late.headers

            # Still draining: nothing above ended the held or the queued request.
            assert act.is_running()
            st = act.status()
            assert st["services"][SERVICE]["queued"] == 1
            assert pod.stats()["in_flight"] == 1
            assert pod.stats()["request_ids"] == []  # the queued one has not reached the pod

            upload.release()
            assert upload.error is None, repr(upload.error)
            assert upload.status == 200
            assert upload.answer is not None and upload.answer["length"] == len(FIRST_PART) + len(LAST_PART)
            assert exchange_outcome(queued) == 200
        finally:
            queued.close()
    finally:
        keepalive.close()

    assert act.wait(60) == 0
    assert pod.stats()["request_ids"] == ["queued"]
    lines = notify_socket.assignments()
    assert index_of(lines, "READY=1") < index_of(lines, "STOPPING=1"), lines


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_second_stop_signal_during_a_long_drain_exits_at_once(pod_factory, activator_factory, gated, second):
    (pod,) = pod_factory(1)
    # The drain would last as long as the held request, up to 10 minutes.
    act = start(activator_factory, appliance_config([pod], top={"grace_period": "600s"}))
    upload = hold(gated, act, pod)

    act.signal(signal.SIGTERM)
    wait_until(lambda: readyz(act) == 503, message="/readyz 503 while draining")
    assert act.is_running()
    # A second signal within DUPLICATE_SIGNAL_SECONDS is taken for the same one seen
    # twice (terminal + bootloader forwarding); an operator's second signal comes later.
    time.sleep(DUPLICATE_SIGNAL_SECONDS + 0.2)
    act.signal(second)
    code = act.wait(DEFAULT_TIMEOUT)  # far below the grace period and the held request
    assert code >= 0, f"killed by signal {-code} instead of exiting"

    upload.release()
    assert upload.status != 200, "the held request cannot have finished: it was cut"


def test_grace_period_bounds_the_drain(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = start(activator_factory, appliance_config([pod], top={"grace_period": "1s"}))
    slow = start_request(act.listen, path="/delay?ms=10000", timeout=DEFAULT_TIMEOUT * 2)
    try:
        wait_until(lambda: pod.stats()["in_flight"] == 1, message="the slow request on the pod")
        act.signal(signal.SIGTERM)
        assert act.wait(60) == 0
        outcome = exchange_outcome(slow)
    finally:
        slow.close()
    assert outcome != 200, "the request outlived the grace period"


# --------------------------------------------------------------------------------------
# the command line, from another directory


def test_version_and_check_from_another_directory(tmp_path):
    result = run_cli(["--version"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert __version__ in result.stdout + result.stderr

    (tmp_path / "activator.yaml").write_text(
        "listen: 127.0.0.1:18080\nservices:\n  api:\n    hosts: [api.example.com]\n    pods: [127.0.0.1:8001]\n"
    )
    result = run_cli(["check", "-c", "activator.yaml"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout and "127.0.0.1:8001" in result.stdout, result.stdout

    result = run_cli(["check"], cwd=tmp_path, env={"ACTIVATOR_CONFIG": "activator.yaml"})
    assert result.returncode == 0, result.stderr

    (tmp_path / "bad.yaml").write_text("services:\n  api:\n    hosts: [a]\n    pods: [127.0.0.1:70000]\n")
    result = run_cli(["check", "-c", "bad.yaml"], cwd=tmp_path)
    assert result.returncode == 2
    assert "bad.yaml:4" in result.stderr, result.stderr


def test_executable_needs_no_python_environment(tmp_path):
    """The built executable alone: no PATH to a Python, no PYTHON* variables, another
    directory, and its one-file unpack directory gone after it exits."""
    binary = os.environ.get("ACTIVATOR_BIN")
    if not binary:
        pytest.skip("ACTIVATOR_BIN is not set: no executable to check")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    (tmp_path / "activator.yaml").write_text("services:\n  api:\n    hosts: ['*']\n    pods: [127.0.0.1:8001]\n")
    env = {"PATH": str(tmp_path / "no-bin"), "TMPDIR": str(tmpdir), "LANG": "C"}
    for args in (["--version"], ["check", "-c", "activator.yaml"]):
        result = subprocess.run(
            [binary, *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=DEFAULT_TIMEOUT,
            check=False,
        )
        assert result.returncode == 0, f"{args}: {result.stderr}"
    assert list(tmpdir.iterdir()) == [], "the one-file unpack directory was left behind"


def test_executable_is_signalled_like_systemd_does(pod_factory, activator_factory, notify_socket, tmp_path):
    """SIGHUP and SIGTERM sent to the main process (the one-file bootloader when
    testing the executable) reach the server; it exits 0 and leaves nothing behind."""
    (pod,) = pod_factory(1)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    act = start(activator_factory, appliance_config([pod]), notify_socket, TMPDIR=str(tmpdir))
    notify_socket.wait_for("READY=1")
    act.reload()
    notify_socket.wait_for("RELOADING=1")
    assert act.stop() == 0
    notify_socket.wait_for("STOPPING=1")
    assert list(tmpdir.iterdir()) == [], "the one-file unpack directory was left behind"

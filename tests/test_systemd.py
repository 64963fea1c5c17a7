"""sd_notify (activator.process.systemd) against a real socket, and the unit file against systemd.

The Notifier tests receive on a real AF_UNIX datagram socket, as systemd does. The unit
tests run ``systemd-analyze`` offline (PID 1 need not be systemd); .ci/run installs it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from activator.process import systemd
from activator.process.systemd import Notifier, StatusLine, run_watchdog, watchdog_interval

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "activator.service"
EXEC_START = "/usr/local/bin/activator run -c /etc/activator/activator.yaml"


# --------------------------------------------------------------------------- Notifier


@pytest.fixture
def receiver() -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket bound to a short path (sun_path holds 107 bytes)."""
    tmp = tempfile.mkdtemp(prefix="sdn")
    path = os.path.join(tmp, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    try:
        yield sock, path
    finally:
        sock.close()
        shutil.rmtree(tmp)


def recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def assert_nothing_queued(sock: socket.socket) -> None:
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)


def test_messages_reach_the_socket(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert n.enabled

    assert n.ready("listening on 0.0.0.0:8080") is True
    assert recv(sock) == "READY=1\nSTATUS=listening on 0.0.0.0:8080"
    assert n.ready() is True
    assert recv(sock) == "READY=1"
    assert n.watchdog() is True
    assert recv(sock) == "WATCHDOG=1"
    assert n.stopping() is True
    assert recv(sock) == "STOPPING=1"
    assert n.stopping("draining 3 requests") is True
    assert recv(sock) == "STOPPING=1\nSTATUS=draining 3 requests"


def test_reloading_carries_the_monotonic_clock(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    n = Notifier(path)
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert n.reloading() is True
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    lines = recv(sock).split("\n")
    assert lines[0] == "RELOADING=1"
    key, _, value = lines[1].partition("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after
    assert len(lines) == 2


def test_raw_and_field_messages(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    n = Notifier(path)
    assert n.notify("READY=1\nSTATUS=raw") is True
    assert recv(sock) == "READY=1\nSTATUS=raw"
    assert n.notify(ERRNO=98, BUSERROR="org.example.Failed") is True
    assert recv(sock) == "ERRNO=98\nBUSERROR=org.example.Failed"
    # A newline in a value would start a new assignment: it is flattened.
    assert n.ready("line one\nREADY=1") is True
    assert recv(sock) == "READY=1\nSTATUS=line one READY=1"
    # Nothing to say: nothing sent.
    assert n.notify() is False
    assert_nothing_queued(sock)


def test_abstract_namespace_socket() -> None:
    name = f"activator-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.ready("up") is True
        assert recv(sock) == "READY=1\nSTATUS=up"
        assert n.watchdog() is True
        assert recv(sock) == "WATCHDOG=1"
    finally:
        sock.close()


def test_unset_notify_socket_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_socket(*args: object) -> None:
        raise AssertionError("a no-op notifier must not open a socket")

    monkeypatch.setattr(systemd._socket, "socket", no_socket)
    for env in ({}, {"NOTIFY_SOCKET": ""}, {"WATCHDOG_USEC": "10000000"}):
        n = Notifier.from_env(env)
        assert not n.enabled
        assert n.ready("x") is False
        assert n.reloading() is False
        assert n.stopping() is False
        assert n.watchdog() is False
        assert n.watchdog_interval() is None


def test_from_env_reads_os_environ_and_can_unset_it(
    receiver: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = receiver
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")
    n = Notifier.from_env(unset=True)
    # Children started from now on do not inherit the socket...
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        assert key not in os.environ
    # ...but this notifier keeps it.
    assert n.watchdog_interval() == 2.0
    assert n.ready() is True
    assert recv(sock) == "READY=1"


def test_a_dead_socket_never_raises() -> None:
    tmp = tempfile.mkdtemp(prefix="sdn")
    try:
        # No such file.
        missing = Notifier(os.path.join(tmp, "missing"))
        assert missing.ready("x") is False
        assert missing.watchdog() is False
        # A socket file whose owner is gone (connection refused).
        path = os.path.join(tmp, "dead")
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        dead.bind(path)
        dead.close()
        assert Notifier(path).stopping() is False
        # Not a socket at all, and a directory.
        plain = os.path.join(tmp, "plain")
        Path(plain).write_text("")
        assert Notifier(plain).ready("x") is False
        assert Notifier(tmp).ready("x") is False
        # A listening stream socket (wrong type).
        stream_path = os.path.join(tmp, "stream")
        stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stream.bind(stream_path)
        stream.listen()
        try:
            assert Notifier(stream_path).ready() is False
        finally:
            stream.close()
        # An abstract name nobody holds.
        assert Notifier("@activator-nobody-" + uuid.uuid4().hex).ready() is False
    finally:
        shutil.rmtree(tmp)


def test_a_full_receiver_never_blocks(receiver: tuple[socket.socket, str]) -> None:
    """A receiver that stops reading fills up; sends then fail at once instead of blocking."""
    _, path = receiver
    n = Notifier(path)

    def hung(signum: int, frame: object) -> None:
        raise AssertionError("Notifier.watchdog() blocked on a full socket")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        results = [n.watchdog() for _ in range(5000)]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert results[0] is True
    assert results[-1] is False  # the queue is full: dropped, not waited for


def test_the_status_line_is_sent_when_it_changes_at_most_once_an_interval(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    line = StatusLine(Notifier(path), interval=1.0)
    assert line.update("0/1 pods healthy", 10.0)
    assert recv(sock) == "STATUS=0/1 pods healthy"
    assert not line.update("0/1 pods healthy", 20.0), "the same line again: nothing sent"
    assert not line.update("1/1 pods healthy", 10.5), "too soon after the last one"
    assert_nothing_queued(sock)
    assert line.update("1/1 pods healthy", 11.0), "offered again once the interval passed"
    sock.setblocking(True)
    assert recv(sock) == "STATUS=1/1 pods healthy"
    assert line.sent("reload failed", 30.0) == "reload failed"  # sent along with READY=1
    assert not line.update("reload failed", 40.0)
    assert line.update("1/1 pods healthy", 40.0)
    assert recv(sock) == "STATUS=1/1 pods healthy"


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "10000000"}) == 5.0
    # WATCHDOG_PID is systemd's MAINPID, the one-file bootloader: never compared.
    env = {"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert watchdog_interval(env) == 5.0
    for bad in ({}, {"WATCHDOG_USEC": ""}, {"WATCHDOG_USEC": "0"}, {"WATCHDOG_USEC": "ten"}):
        assert watchdog_interval(bad) is None
    n = Notifier.from_env({"NOTIFY_SOCKET": "/run/systemd/notify", **env})
    assert n.watchdog_interval() == 5.0
    assert Notifier.from_env({"NOTIFY_SOCKET": "/run/systemd/notify"}).watchdog_interval() is None


class _Stop(Exception):
    pass


def test_run_watchdog_pings_every_half_interval(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    n = Notifier(path, watchdog_usec=3_000_000)
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise _Stop

    with pytest.raises(_Stop):
        run_watchdog(n, sleep=sleep)
    assert sleeps == [1.5] * 3
    assert [recv(sock) for _ in range(3)] == ["WATCHDOG=1"] * 3
    assert_nothing_queued(sock)


def test_run_watchdog_returns_when_no_watchdog_is_wanted() -> None:
    def sleep(seconds: float) -> None:
        raise AssertionError("must not loop")

    run_watchdog(Notifier(None, watchdog_usec=2_000_000), sleep=sleep)
    run_watchdog(Notifier("/run/systemd/notify"), sleep=sleep)


def test_run_watchdog_as_a_greenlet(receiver: tuple[socket.socket, str]) -> None:
    gevent = pytest.importorskip("gevent")
    sock, path = receiver
    n = Notifier(path, watchdog_usec=600_000_000)  # pings every 300 s: one in this test
    greenlet = gevent.spawn(run_watchdog, n)
    try:
        gevent.sleep(0)  # let it run up to its gevent.sleep(interval)
        assert recv(sock) == "WATCHDOG=1"
        assert not greenlet.dead
    finally:
        greenlet.kill()
    assert greenlet.dead


# --------------------------------------------------------------------------- the unit

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze is not installed (apt-get install systemd; .ci/run does)",
)


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(ms|s|min)?", value)
    assert match, value
    factor = {"ms": 0.001, "s": 1.0, None: 1.0, "min": 60.0}[match.group(2)]
    return float(match.group(1)) * factor


def test_unit_has_what_the_appliance_relies_on() -> None:
    s = unit_settings()
    assert s["Type"] == ["notify"]
    assert s["NotifyAccess"] == ["all"]  # one-file: Python is the bootloader's child
    assert s["ExecStart"] == [EXEC_START]
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert s["KillMode"] == ["mixed"]
    assert s["Restart"] == ["on-failure"]
    assert seconds(s["WatchdogSec"][0]) > 0
    assert s["DynamicUser"] == ["yes"]
    assert s["RuntimeDirectory"] == ["activator"]
    assert "TMPDIR=/run/activator" in s["Environment"]
    assert s["LimitNOFILE"] == ["65536"]
    # The stop timeout must leave room for the drain.
    from activator.core.config import Config

    grace = {f.name: f.default for f in dataclasses.fields(Config)}["grace_period"]
    assert seconds(s["TimeoutStopSec"][0]) > grace
    # StatsD (UDP) and the proxy (TCP) need inet; journald and sd_notify need unix.
    assert set(s["RestrictAddressFamilies"][0].split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    assert "PrivateNetwork" not in s and "IPAddressDeny" not in s


def verify(unit_text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` on a copy whose ExecStart binary exists (/bin/true)."""
    assert SYSTEMD_ANALYZE is not None
    copy = tmp_path / "activator.service"
    assert unit_text.count(f"ExecStart={EXEC_START}") == 1
    args = EXEC_START.split(" ", 1)[1]
    copy.write_text(unit_text.replace(f"ExecStart={EXEC_START}", f"ExecStart=/bin/true {args}"))
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", str(copy)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_systemd_analyze
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    result = verify(UNIT.read_text(), tmp_path)
    # verify exits 0 on most parse errors: any output at all is a failure.
    assert result.returncode == 0 and result.stderr == "" and result.stdout == "", result


@needs_systemd_analyze
def test_verify_would_catch_a_bad_directive(tmp_path: Path) -> None:
    """The check above is not vacuous: a typo does produce output."""
    broken = UNIT.read_text().replace("WatchdogSec=10s", "WatchdogSec=ten")
    assert broken != UNIT.read_text()
    assert verify(broken, tmp_path).stderr != ""


def exposure(unit: Path) -> tuple[float, str]:
    assert SYSTEMD_ANALYZE is not None
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", result.stdout)
    assert match, result
    return float(match.group(1)), result.stdout


@needs_systemd_analyze
def test_unit_security_exposure_is_at_most_2(tmp_path: Path) -> None:
    score, report = exposure(UNIT)
    assert score <= 2.0, report
    # The parse is not vacuous: an unsandboxed unit scores far worse.
    bare = tmp_path / "bare.service"
    bare.write_text(f"[Service]\nType=notify\nExecStart={EXEC_START}\n")
    assert exposure(bare)[0] > 5.0

"""Helpers for end-to-end tests and benchmarks: real processes, real sockets, all on 127.0.0.1.

What this module decides, and its rules:

- Every process is started as a :class:`Process` (through :func:`spawn`): in its own
  session (so a whole process group, workers included, can be killed), registered for a
  kill at interpreter exit, and, when started from the main thread on Linux, with a
  parent-death signal so that even a SIGKILLed pytest (or benchmark run) leaves no
  orphan behind; its stdout and stderr go to files. ``Pod`` and ``Activator`` are
  context managers that always kill what they started. The benchmarks (``bench/``)
  start their servers through this module too.
- The activator under test is ``[sys.executable, "-m", "activator"]`` unless the
  environment variable ``ACTIVATOR_BIN`` names a built executable (or a command line);
  then the same tests run against it (``[ACTIVATOR_BIN, "run", "-c", PATH]``).
- Asynchronous effects are waited for by polling a condition with a generous timeout
  (:meth:`Activator.wait_for`, :func:`wait_until`, :func:`wait_http`, the receivers'
  ``wait_for``), never by sleeping a fixed time; a wait on a server fails at once when
  the server's process exits. No test asserts on elapsed time: these machines are
  noisy.
- Configs for the tests' activators come from :func:`make_config` and
  :func:`service_config`; "every count back to zero" is :func:`is_idle`
  (:meth:`Activator.wait_idle`).
- HTTP clients use the stdlib ``http.client`` (blocking; use threads for concurrency,
  e.g. :func:`concurrent_requests`); HTTP/2 on one connection is :class:`H2Client`
  (the ``h2`` library, sans-IO, on a blocking socket), and :func:`curl` runs the
  command line client. Nothing here imports or patches gevent.
- Pods are ``tests/backend.py`` (:class:`Pod`) or, for other protocols, a module of
  ``tests/pods/`` (:class:`ModulePod`); each records its own peak concurrency.
- The access log (``access_log: true``, the activator's stdout) is read back parsed
  (:meth:`Activator.access_log`, :meth:`Activator.wait_access`).
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol, Self, TypeVar, overload
from urllib.parse import urlsplit

import h2.config
import h2.connection
import h2.errors
import h2.events
import yaml

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
BACKEND = TESTS_DIR / "backend.py"
LOCALHOST = "127.0.0.1"

#: Default for HTTP client timeouts, and for waits on asynchronous effects.
DEFAULT_TIMEOUT = 30.0
#: The one service of :func:`make_config`.
SERVICE = "api"

T = TypeVar("T")
Config = Mapping[str, Any] | str
#: The types of conftest's ``activator_factory`` and ``pod_factory`` fixtures, for test signatures.
ActivatorFactory = Callable[..., "Activator"]
PodFactory = Callable[..., list["Pod"]]


class HarnessError(AssertionError):
    """A process or condition the test relies on did not come about (shown as a failure)."""


class Closing:
    """``with`` for an object whose :meth:`close` ends everything it started or opened."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------
# ports and polling


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port on 127.0.0.1 that was free a moment ago (TCP, or ``socket.SOCK_DGRAM``)."""
    return free_ports(1, kind)[0]


#: The first port of the tests' own block, which ends where the kernel's ephemeral ports
#: begin (``ip_local_port_range``, 32768 by default).
PORT_BLOCK_START = 10000


def _port_slice() -> range:
    """This process's slice of the ports the tests hand out.

    The block lies below the kernel's ephemeral range, so that no ``bind(0)`` and no
    outgoing connection's local port takes a port between its pick and its server's
    bind (the ports the kernel hands out are all above it). Each pytest-xdist worker
    (``PYTEST_XDIST_WORKER=gwN`` of ``PYTEST_XDIST_WORKER_COUNT``) has a slice of its own,
    so that two workers never pick the same port; a run without workers has the whole
    block."""
    ephemeral = 32768
    with contextlib.suppress(OSError, ValueError, IndexError):
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    block = range(PORT_BLOCK_START, max(ephemeral, PORT_BLOCK_START + 2000))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
    index = int(worker[2:]) % count if worker.startswith("gw") and worker[2:].isdigit() else 0
    size = len(block) // count
    return range(block.start + index * size, block.start + (index + 1) * size)


_PORTS = _port_slice()
#: Where the next pick starts: picks go round the slice, so that a port handed out is not
#: handed out again before the whole slice has been (its server binds it meanwhile). The
#: start is random, so that two test runs side by side start apart.
_next_port = random.randrange(len(_PORTS))
_ports_lock = threading.Lock()


def _is_free(port: int, kind: int) -> bool:
    with socket.socket(socket.AF_INET, kind) as sock:
        try:
            sock.bind((LOCALHOST, port))  # (no SO_REUSEADDR: a port in TIME_WAIT is not free)
        except OSError:
            return False
    return True


def free_ports(n: int, kind: int = socket.SOCK_STREAM, *, consecutive: bool = False) -> list[int]:
    """``n`` distinct ports on 127.0.0.1 that were free a moment ago (``consecutive``: a
    run of ``n`` neighbours), from this process's slice (:func:`_port_slice`), none
    handed out before in the last round of the slice."""
    global _next_port
    with _ports_lock:
        ports: list[int] = []
        for _ in range(len(_PORTS)):
            port = _PORTS[_next_port]
            _next_port = (_next_port + 1) % len(_PORTS)
            if consecutive and ports and port != ports[-1] + 1:
                ports = []  # wrapped round the slice: start the run again
            if _is_free(port, kind):
                ports.append(port)
                if len(ports) == n:
                    return ports
            elif consecutive:
                ports = []
        raise HarnessError(f"no {n} free ports left in {_PORTS}")


def wait_until(
    predicate: Callable[[], T | None],
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = 0.05,
    message: str | Callable[[], str] = "",
) -> T:
    """Poll ``predicate`` until it returns a truthy value, and return that value.

    Exceptions raised by the predicate count as "not yet" (the last one is reported),
    except :class:`HarnessError`, which stops the wait at once. Raises
    :class:`HarnessError` after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except HarnessError:
            raise
        except Exception as exc:  # any other error means "not yet"; the last one is reported
            last_exc = exc
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            detail = f"; last error: {last_exc!r}" if last_exc is not None else ""
            raise HarnessError(f"condition not met within {timeout}s: {text}{detail}")
        time.sleep(interval)


# --------------------------------------------------------------------------------------
# processes

_live: set[subprocess.Popen[bytes]] = set()
_live_lock = threading.Lock()

# Exec'd in front of a child: ask for SIGKILL when the parent (thread) dies, then become
# the real command (same pid). The ppid check closes the race where the parent died first.
_LAUNCHER = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def spawn(
    argv: Sequence[str],
    *,
    stdout: Any = subprocess.DEVNULL,
    stderr: Any = subprocess.DEVNULL,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session, tracked for cleanup (see module rules)."""
    cmd = list(argv)
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        # PR_SET_PDEATHSIG fires when the *thread* that forked exits: only the main
        # thread lives as long as the test process.
        cmd = [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *cmd]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        start_new_session=True,
    )
    with _live_lock:
        _live.add(proc)
    return proc


def _reap(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """SIGKILL the process and whatever is left of its process group (its workers), wait
    for it, stop tracking it; its exit code (None if it could not be reaped in time)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
    with _live_lock:
        _live.discard(proc)
    return code


def kill_all() -> None:
    """Kill every process this module started that is still tracked."""
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        _reap(proc, timeout=5.0)


atexit.register(kill_all)


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every child: this one without the service manager's variables
    (``NOTIFY_SOCKET``...), unbuffered Python, the repository on ``PYTHONPATH``; then
    ``extra`` (which may replace ``PYTHONPATH``)."""
    env = dict(os.environ)
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "ACTIVATOR_CONFIG"):
        env.pop(name, None)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def _tail(name: str, stdout_path: Path, stderr_path: Path, chars: int) -> str:
    def text(path: Path) -> str:
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    return f"--- {name} stderr (tail)\n{text(stderr_path)}\n--- {name} stdout (tail)\n{text(stdout_path)}"


class ProcessExited(HarnessError):
    """A process ended while something waited for it; ``code`` is its exit code."""

    def __init__(self, process: Process, waiting_for: str) -> None:
        self.code = process.returncode
        super().__init__(f"{process.name} exited with {self.code} {waiting_for}\n{process.output_tail()}")


class Process:
    """A command started by :func:`spawn` (its own process group, killed at exit), its
    stdout and stderr appended to two files.

    The one way a server is run here, by the tests (pods, activators) and by the
    benchmarks (nginx, HAProxy, the load generator...). ``stop`` signals the process
    itself, never its group: a supervisor stops its own workers, and what is left of the
    group is SIGKILLed after.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        stdout_path: str | os.PathLike[str],
        stderr_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        name: str | None = None,
    ) -> None:
        self.argv = list(argv)
        self.name = name or os.path.basename(self.argv[0])
        self.stdout_path = Path(stdout_path)
        self.stderr_path = Path(stderr_path)
        with open(self.stdout_path, "ab") as out, open(self.stderr_path, "ab") as err:
            self.popen = spawn(self.argv, stdout=out, stderr=err, env=child_env(env), cwd=cwd)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit code once it exited (negative: killed by that signal), else None."""
        return self.popen.poll()

    def is_running(self) -> bool:
        return self.popen.poll() is None

    def check_running(self, waiting_for: str = "") -> None:
        """Raise :class:`ProcessExited` (which stops a :func:`wait_until`) if it exited."""
        if self.popen.poll() is not None:
            raise ProcessExited(self, waiting_for)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process (not to its group)."""
        self.popen.send_signal(sig)

    def wait(self, timeout: float = DEFAULT_TIMEOUT) -> int:
        """Wait for the process to exit by itself (then kill what is left of its group);
        its exit code. Fails, leaving it running, if it is still there after ``timeout``."""
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise HarnessError(f"{self.name} still running after {timeout}s\n{self.output_tail()}") from None
        _reap(self.popen, 2.0)
        return code

    def stop(self, grace: float = 10.0, sig: int | None = None) -> int | None:
        """``sig`` (default SIGTERM) to the process, up to ``grace`` seconds for it to
        exit, then SIGKILL to whatever is left of its group. Its exit code, or None when
        it did not exit within the grace period and was killed."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM if sig is None else sig)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                _reap(self.popen, 10.0)
                return None
        _reap(self.popen, 2.0)
        return self.popen.returncode

    def kill(self) -> int | None:
        """SIGKILL the process and its whole group; its exit code once reaped."""
        return _reap(self.popen, 10.0)

    def stdout_text(self) -> str:
        return self.stdout_path.read_text(errors="replace") if self.stdout_path.exists() else ""

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def output_tail(self, chars: int = 4000) -> str:
        return _tail(self.name, self.stdout_path, self.stderr_path, chars)

    def wait_output(self, pattern: str, timeout: float = DEFAULT_TIMEOUT, interval: float = 0.01) -> re.Match[str]:
        """Wait until a line of its stdout matches ``pattern`` (``re.search``, multiline);
        that match. Fails at once with :class:`ProcessExited` if the process exits first."""
        regex = re.compile(pattern, re.MULTILINE)

        def found() -> re.Match[str] | None:
            match = regex.search(self.stdout_text())
            if match is None:
                self.check_running(f"before printing {pattern!r}")
            return match

        return wait_until(found, timeout=timeout, interval=interval, message=f"{self.name} to print {pattern!r}")

    def __repr__(self) -> str:
        return f"Process({self.name!r}, pid={self.pid})"


def activator_command() -> list[str]:
    """The activator CLI: ``$ACTIVATOR_BIN`` if set (a path to an executable, or a
    command line such as ``python -m activator``), else ``python -m activator``."""
    binary = os.environ.get("ACTIVATOR_BIN")
    if not binary:
        return [sys.executable, "-m", "activator"]
    return [binary] if os.path.exists(binary) else shlex.split(binary)


def run_cli(
    args: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the activator CLI to completion (``check``, ``--version``...); text output."""
    return subprocess.run(
        [*activator_command(), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(env),
        cwd=cwd,
        check=False,
    )


def rss_kib(pid: int) -> int:
    """The resident set size of a running process, in KiB (from ``/proc``)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    raise HarnessError(f"no VmRSS for process {pid}: not running?")


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` like an editor does: write a temporary file beside it, rename it over."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------
# HTTP client


class Headers(Mapping[str, str]):
    """Case-insensitive, read-only response headers; repeated names joined with ", "."""

    def __init__(self, items: Iterable[tuple[str, str]]) -> None:
        self._items = list(items)
        self._map: dict[str, str] = {}
        for name, value in self._items:
            key = name.lower()
            self._map[key] = f"{self._map[key]}, {value}" if key in self._map else value

    def __getitem__(self, name: str) -> str:
        return self._map[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._map

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def get_all(self, name: str) -> list[str]:
        """Every value of a repeated header, in order."""
        return [v for n, v in self._items if n.lower() == name.lower()]

    def raw(self) -> list[tuple[str, str]]:
        return list(self._items)

    def __repr__(self) -> str:
        return f"Headers({self._items!r})"


@dataclass(frozen=True)
class Response:
    status: int
    headers: Headers
    body: bytes
    reason: str = ""

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


def _split_target(target: str, path: str | None) -> tuple[str, int, str]:
    """``http://h:p/x?y`` or ``h:p`` -> (host, port, path)."""
    if "://" not in target:
        target = "http://" + target
    parts = urlsplit(target)
    host = parts.hostname or LOCALHOST
    port = parts.port or 80
    if path is None:
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
    return host, port, path


def _headers(headers: Mapping[str, str] | None, host: str | None) -> dict[str, str]:
    out = dict(headers or {})
    if host is not None:
        out["Host"] = host
    return out


def start_request(
    target: str,
    method: str = "GET",
    path: str | None = None,
    headers: Mapping[str, str] | None = None,
    body: bytes | str | Iterable[bytes] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    *,
    host: str | None = None,
) -> http.client.HTTPConnection:
    """Send a request and return the connection without reading the response.

    The caller owns the connection: ``conn.getresponse()`` to read, ``conn.close()`` to
    go away mid-request. A body that is an iterable of bytes is sent chunked unless a
    Content-Length header is given. ``host`` is a shortcut for the Host header.
    """
    h, port, p = _split_target(target, path)
    conn = http.client.HTTPConnection(h, port, timeout=timeout)
    try:
        conn.request(method, p, body=body, headers=_headers(headers, host))
    except BaseException:
        conn.close()
        raise
    return conn


def request(
    target: str,
    method: str = "GET",
    path: str | None = None,
    headers: Mapping[str, str] | None = None,
    body: bytes | str | Iterable[bytes] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    *,
    host: str | None = None,
) -> Response:
    """One request on a fresh connection; reads the whole response.

    ``target`` is a URL (its path used when ``path`` is None) or ``host:port``.
    Headers given explicitly (including Host) are sent as given.
    """
    conn = start_request(target, method, path, headers, body, timeout, host=host)
    try:
        resp = conn.getresponse()
        data = resp.read()
        return Response(resp.status, Headers(resp.getheaders()), data, resp.reason)
    finally:
        conn.close()


@contextlib.contextmanager
def stream(
    target: str,
    method: str = "GET",
    path: str | None = None,
    headers: Mapping[str, str] | None = None,
    body: bytes | str | Iterable[bytes] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    *,
    host: str | None = None,
) -> Iterator[http.client.HTTPResponse]:
    """Send a request, yield the response once its head arrived; read it piecemeal
    (``resp.read1()``, ``resp.readline()``). Leaving the block closes the connection,
    which is how a test makes the client go away mid-response."""
    conn = start_request(target, method, path, headers, body, timeout, host=host)
    try:
        yield conn.getresponse()
    finally:
        conn.close()


def send_raw(target: str, data: bytes, timeout: float = DEFAULT_TIMEOUT) -> socket.socket:
    """Open a TCP connection, send ``data`` as is, return the socket (caller closes)."""
    h, port, _ = _split_target(target, "/")
    sock = socket.create_connection((h, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if data:
        sock.sendall(data)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Read until the peer closes (or the socket's timeout, which raises)."""
    chunks: list[bytes] = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def parse_head(data: bytes) -> tuple[int, dict[str, str]]:
    """The status and headers (lower-case names) of the response head that ``data`` starts
    with (its empty line and what follows are ignored)."""
    lines = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    m = re.match(r"HTTP/1\.[01] (\d{3})(?: |$)", lines[0])
    assert m, f"not an HTTP response: {data[:200]!r}"
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(m.group(1)), headers


def activator_reason(resp: Response | http.client.HTTPResponse) -> str | None:
    """``X-Activator-Reason``: set on the activator's own answers, absent on a pod's."""
    if isinstance(resp, http.client.HTTPResponse):
        return resp.getheader("X-Activator-Reason")
    return resp.headers.get("X-Activator-Reason")


class Client(Closing):
    """A keep-alive client: every request reuses one connection (reconnects if closed)."""

    def __init__(self, target: str, timeout: float = DEFAULT_TIMEOUT, *, host: str | None = None):
        self._host, self._port, _ = _split_target(target, "/")
        self._timeout = timeout
        self._host_header = host
        self.conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def request(
        self,
        method: str = "GET",
        path: str = "/",
        headers: Mapping[str, str] | None = None,
        body: bytes | str | Iterable[bytes] | None = None,
    ) -> Response:
        self.conn.request(method, path, body=body, headers=_headers(headers, self._host_header))
        resp = self.conn.getresponse()
        data = resp.read()
        return Response(resp.status, Headers(resp.getheaders()), data, resp.reason)

    def close(self) -> None:
        self.conn.close()


@overload
def concurrent_requests(
    n: int,
    fn: Callable[[int], T],
    *,
    timeout: float | None = None,
    return_exceptions: Literal[False] = False,
) -> list[T]: ...


@overload
def concurrent_requests(
    n: int,
    fn: Callable[[int], T],
    *,
    timeout: float | None = None,
    return_exceptions: Literal[True],
) -> list[T | BaseException]: ...


def concurrent_requests(
    n: int,
    fn: Callable[[int], T],
    *,
    timeout: float | None = None,
    return_exceptions: bool = False,
) -> list[T] | list[T | BaseException]:
    """Run ``fn(0) .. fn(n-1)`` on ``n`` threads released together; results in order.

    The first exception (in call order) is re-raised unless ``return_exceptions``; then
    exceptions take their call's place in the list. ``timeout`` bounds the wait for each
    result (None: the functions' own client timeouts bound it).
    """
    if n <= 0:
        return []
    barrier = threading.Barrier(n)

    def run(i: int) -> T:
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=DEFAULT_TIMEOUT)
        return fn(i)

    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="client") as pool:
        futures = [pool.submit(run, i) for i in range(n)]
        results: list[T | BaseException] = []
        for fut in futures:
            exc = fut.exception(timeout=timeout)
            if exc is not None:
                if not return_exceptions:
                    raise exc
                results.append(exc)
            else:
                results.append(fut.result())
        return results


def download_pattern(size: int) -> bytes:
    """What the backend's ``/download?bytes=size`` sends: byte i is ``i % 251``."""
    block = bytes(range(251))
    return (block * (size // 251 + 1))[:size]


def json_request(target: str, method: str = "GET", path: str | None = None, timeout: float = 10.0) -> Any:
    """A control request (a pod's ``/_stats``, an admin ``/status``...): its JSON body.
    Fails unless the answer is 200."""
    resp = request(target, method, path, timeout=timeout)
    if resp.status != 200:
        raise HarnessError(f"{method} {path or target}: {resp.status} {resp.text}")
    return resp.json()


def curl(*args: str, timeout: float = DEFAULT_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run the ``curl`` command line client with ``args`` (silent but for errors, no proxy
    from the environment, at most ``timeout`` seconds); text output. Its exit code is
    the caller's to check (``result.returncode``)."""
    return subprocess.run(
        ["curl", "-sS", "--noproxy", "*", "--max-time", str(timeout), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout + 10,
        check=False,
    )


@dataclass
class H2Response:
    """One HTTP/2 stream's answer as :class:`H2Client` saw it (``reset``: the stream was
    reset by the server with that error code, or the connection ended first)."""

    status: int | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    trailers: list[tuple[str, str]] = field(default_factory=list)
    ended: bool = False
    reset: int | None = None

    def header(self, name: str) -> str | None:
        """The first value of ``name`` in the head (lower-case names), else None."""
        return next((v for n, v in self.headers if n == name.lower()), None)


class H2Client(Closing):
    """HTTP/2 with prior knowledge (h2c) on ONE connection, several streams at a time.

    Built on the ``h2`` library (the protocol, sans-IO) over a blocking socket, with a
    reader thread that applies what the server sends; the test opens streams
    (:meth:`send`), resets them (:meth:`reset`) and waits for their answers
    (:meth:`response`) in the order it chooses, which a command line client cannot do.
    Flow-control windows are given back as data is read, so large bodies flow.
    """

    def __init__(self, target: str, timeout: float = DEFAULT_TIMEOUT, *, host: str | None = None) -> None:
        h, port, _ = _split_target(target, "/")
        self.authority = host or f"{h}:{port}"
        self.timeout = timeout
        self.sock = socket.create_connection((h, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)  # the reader blocks; close() ends it
        self._conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self._cond = threading.Condition()
        self._streams: dict[int, H2Response] = {}
        self.terminated: int | None = None  # GOAWAY's error code, or -1 once the connection closed
        #: The connection is over (what the server sent is all read): no stream waits longer.
        self.closed = False
        self._pings_acked: set[bytes] = set()
        with self._cond:
            self._conn.initiate_connection()
            self._flush()
        self._reader = threading.Thread(target=self._read, name="h2-client", daemon=True)
        self._reader.start()

    def _flush(self) -> None:
        # Called with the condition held, so that frames go out in the order they were made.
        data = self._conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def send(
        self,
        method: str = "GET",
        path: str = "/",
        headers: Iterable[tuple[str, str]] = (),
        body: bytes | None = None,
        *,
        end_stream: bool = True,
    ) -> int:
        """Open a stream with this request; its stream id. ``body`` goes at once (within
        the server's flow-control window); with ``end_stream=False`` the request stays
        open for more body (:meth:`send_body`)."""
        with self._cond:
            stream_id: int = self._conn.get_next_available_stream_id()
            head = [(":method", method), (":scheme", "http"), (":authority", self.authority), (":path", path)]
            self._conn.send_headers(stream_id, [*head, *headers], end_stream=end_stream and not body)
            if body:
                self._conn.send_data(stream_id, body, end_stream=end_stream)
            self._streams[stream_id] = H2Response()
            self._flush()
            return stream_id

    def send_body(self, stream_id: int, data: bytes, *, end_stream: bool = True) -> None:
        """More of an open request's body (``data`` within the flow-control window)."""
        with self._cond:
            self._conn.send_data(stream_id, data, end_stream=end_stream)
            self._flush()

    def reset(self, stream_id: int) -> None:
        """RST_STREAM (CANCEL): the client gives up on that stream."""
        with self._cond:
            self._conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            self._flush()

    def ping(self, timeout: float | None = None) -> None:
        """PING, and wait for its ACK: every frame sent before it reached the server."""
        timeout = self.timeout if timeout is None else timeout
        with self._cond:
            opaque = os.urandom(8)
            self._conn.ping(opaque)
            self._flush()
            if not self._cond.wait_for(lambda: opaque in self._pings_acked or self.closed, timeout):
                raise HarnessError(f"no PING ACK within {timeout}s")

    def response(self, stream_id: int, timeout: float | None = None) -> H2Response:
        """Wait until the stream ended (or was reset); its answer."""
        timeout = self.timeout if timeout is None else timeout
        with self._cond:
            answer = self._streams[stream_id]
            if not self._cond.wait_for(lambda: answer.ended or answer.reset is not None or self.closed, timeout):
                raise HarnessError(f"HTTP/2 stream {stream_id} not answered within {timeout}s: {answer}")
            return answer

    def head(self, stream_id: int, timeout: float | None = None) -> H2Response:
        """Wait until the stream's response head came (or it ended); its answer so far."""
        timeout = self.timeout if timeout is None else timeout
        with self._cond:
            answer = self._streams[stream_id]
            done = self._cond.wait_for(
                lambda: answer.status is not None or answer.ended or answer.reset is not None or self.closed,
                timeout,
            )
            if not done:
                raise HarnessError(f"HTTP/2 stream {stream_id}: no head within {timeout}s")
            return answer

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            with self._cond:
                if not data:
                    self.terminated = -1 if self.terminated is None else self.terminated
                    self.closed = True
                    self._cond.notify_all()
                    return
                try:
                    events = self._conn.receive_data(data)
                    for ev in events:
                        self._apply(ev)
                    self._flush()
                except Exception:  # a protocol error, or the socket closed under us
                    self.terminated = -1
                    self.closed = True
                    self._cond.notify_all()
                    return
                self._cond.notify_all()

    def _apply(self, ev: Any) -> None:
        answer = self._streams.get(getattr(ev, "stream_id", 0) or 0)
        if isinstance(ev, h2.events.ResponseReceived) and answer is not None:
            answer.headers = [(str(n), str(v)) for n, v in ev.headers]
            answer.status = int(dict(answer.headers)[":status"])
        elif isinstance(ev, h2.events.DataReceived):
            if answer is not None:
                answer.body += ev.data
            self._conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, h2.events.TrailersReceived) and answer is not None:
            answer.trailers = [(str(n), str(v)) for n, v in ev.headers]
        elif isinstance(ev, h2.events.StreamEnded) and answer is not None:
            answer.ended = True
        elif isinstance(ev, h2.events.StreamReset) and answer is not None:
            answer.reset = int(ev.error_code or 0)
        elif isinstance(ev, h2.events.PingAckReceived):
            self._pings_acked.add(bytes(ev.ping_data))
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self.terminated = int(ev.error_code or 0)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._reader.join(5.0)


# --------------------------------------------------------------------------------------
# waiting for a server


def wait_listening(target: str, *, process: Process | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Wait until ``target`` (``host:port``) accepts a TCP connection. Fails at once when
    ``process``, the server, exits."""
    host, port, _ = _split_target(target, "/")

    def accepts() -> bool:
        if process is not None:
            process.check_running(f"before {target} accepted connections")
        with socket.create_connection((host, port), timeout=1.0):
            return True

    wait_until(accepts, timeout=timeout, message=f"{target} to accept connections")


def wait_http(
    target: str, path: str = "/", *, process: Process | None = None, timeout: float = DEFAULT_TIMEOUT
) -> Response:
    """Wait until ``GET path`` on ``target`` answers 200; that response. Fails at once
    when ``process``, the server, exits."""

    def answers() -> Response | None:
        if process is not None:
            process.check_running(f"before {target}{path} answered")
        resp = request(target, "GET", path, timeout=2.0)
        return resp if resp.status == 200 else None

    return wait_until(answers, timeout=timeout, message=f"GET {target}{path} to answer 200")


# --------------------------------------------------------------------------------------
# pods


class Pod(Closing):
    """``tests/backend.py`` as a subprocess on 127.0.0.1.

    ``port=None`` lets the backend pick a free port itself (no race); ``restart()`` comes
    back on the same port. Its output goes to files in ``workdir`` (a temp dir removed at
    :meth:`close` when none is given; ``log_text()``). ``host`` is the address it listens
    on (``0.0.0.0``: every loopback address too); ``wrapper`` goes in front of its
    command (the benchmarks' ``taskset``).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        fail_health: bool = False,
        start: bool = True,
        ready_timeout: float = 15.0,
        workdir: str | os.PathLike[str] | None = None,
        host: str = LOCALHOST,
        wrapper: Sequence[str] = (),
    ) -> None:
        self.port: int | None = port
        self.fail_health = fail_health
        self.ready_timeout = ready_timeout
        self.host = host
        self.wrapper = list(wrapper)
        self._own_dir = workdir is None
        self.dir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="pod-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self._process: Process | None = None
        self._runs = 0
        if start:
            self.start()

    # lifecycle

    @property
    def process(self) -> Process:
        """The current run's process."""
        if self._process is None:
            raise HarnessError("pod not started")
        return self._process

    def launch(self) -> None:
        """Start the process without waiting for READY (see :meth:`wait_ready`)."""
        if self.is_running():
            raise HarnessError(f"pod {self.address} already running")
        self._runs += 1
        argv = [*self.wrapper, sys.executable, str(BACKEND), "--host", self.host, "--port", str(self.port or 0)]
        if self.fail_health:
            argv.append("--fail-health")
        self._process = Process(
            argv,
            stdout_path=self.dir / f"stdout.{self._runs}",
            stderr_path=self.dir / f"stderr.{self._runs}",
            name="pod",
        )

    def wait_ready(self) -> None:
        """Wait for ``READY <port>``; raises :class:`ProcessExited` if the process exits first."""
        process = self.process
        try:
            ready = process.wait_output(r"^READY (\d+)$", timeout=self.ready_timeout)
        except ProcessExited:
            raise
        except HarnessError:
            process.kill()
            raise HarnessError(f"pod did not become ready:\n{self.log_text()}") from None
        self.port = int(ready.group(1))

    def start(self) -> Pod:
        """Launch and wait for READY. On a fixed port, retries while the port is busy
        (an outgoing connection may hold it for a moment after a stop)."""
        deadline = time.monotonic() + self.ready_timeout
        while True:
            self.launch()
            try:
                self.wait_ready()
                return self
            except ProcessExited as exc:
                if self.port and time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                raise HarnessError(f"pod exited with {exc.code} before READY:\n{self.log_text()}") from None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM and wait (SIGKILL if it lingers); its exit code. The port then refuses
        connections."""
        if self._process is None:
            return None
        self._process.stop(grace=timeout)
        return self._process.returncode

    def kill(self) -> int | None:
        """SIGKILL: connections in flight are reset by the kernel."""
        return None if self._process is None else self._process.kill()

    def restart(self) -> Pod:
        """Stop, then start again on the same port (its stats start from zero)."""
        self.stop()
        return self.start()

    def is_running(self) -> bool:
        return self._process is not None and self._process.is_running()

    def close(self) -> None:
        """Kill the process and remove the temp dir."""
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # addresses and control

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``, as it is written in the activator's config."""
        if self.port is None:
            raise HarnessError("pod has no port yet")
        return f"{LOCALHOST}:{self.port}"

    @property
    def metric_name(self) -> str:
        """The ``{pod}`` part of StatsD names: the address with ``.`` and ``:`` -> ``_``."""
        return self.address.replace(".", "_").replace(":", "_")

    def url(self, path: str = "/") -> str:
        return f"http://{self.address}{path}"

    def stats(self) -> dict[str, Any]:
        """``{"in_flight", "peak", "count", "paths", "request_ids", "healthy"}``."""
        result: dict[str, Any] = json_request(self.address, "GET", "/_stats")
        return result

    def reset(self) -> None:
        """Zero count, paths and request ids; the peak restarts from what is in flight."""
        json_request(self.address, "POST", "/_reset")

    def release(self, key: str = "*") -> int:
        """Let the ``/hold?key=`` requests of ``key`` (``*``: all) answer; how many were held."""
        released: int = json_request(self.address, "POST", f"/_release?key={key}")["released"]
        return released

    def held(self) -> list[str]:
        """The keys of the ``/hold`` requests the pod holds now (one entry per request)."""
        keys: list[str] = self.stats()["held"]
        return keys

    def set_health(self, ok: bool) -> None:
        """``/healthz`` answers 200 (ok) or 503."""
        json_request(self.address, "POST", f"/_health?ok={int(ok)}")

    def set_health_hang(self, hang: bool) -> None:
        """``/healthz`` accepts and never answers (probe timeout), or answers again."""
        json_request(self.address, "POST", f"/_health?hang={int(hang)}")

    def log_text(self) -> str:
        parts = []
        for f in sorted(self.dir.glob("std*")):
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')}")
        return "\n".join(parts)

    def __repr__(self) -> str:
        return f"Pod({self.port})"


def start_pods(n: int, *, fail_health: bool = False) -> list[Pod]:
    """Start ``n`` pods in parallel (launch all, then wait for each)."""
    pods = [Pod(fail_health=fail_health, start=False) for _ in range(n)]
    try:
        for pod in pods:
            pod.launch()
        for pod in pods:
            pod.wait_ready()
    except BaseException:
        for pod in pods:
            pod.close()
        raise
    return pods


class ModulePod(Closing):
    """A pod of the tests' own: ``python -m pods.NAME`` (a module of ``tests/pods/``) as a
    subprocess on 127.0.0.1, for what ``tests/backend.py`` does not speak (WebSocket,
    gRPC, a stream the test steps through).

    The module prints ``READY <port> <control_port>`` once it listens; its control port
    serves its own peak concurrency (``GET /_stats``: ``in_flight``, ``peak``, ``count``,
    ``per`` name, arrival ``order``, ``notes``), ``POST /_reset`` and the module's own
    actions (:meth:`control`). ``args`` go on its command line; output goes to files in
    ``workdir`` (a temp dir removed at :meth:`close` when none is given).
    """

    def __init__(
        self,
        name: str,
        *args: str,
        workdir: str | os.PathLike[str] | None = None,
        ready_timeout: float = 20.0,
    ) -> None:
        self.name = name
        self._own_dir = workdir is None
        self.dir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix=f"{name}-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", f"pods.{name}", "--port", "0", "--control-port", "0", *args]
        path = os.pathsep.join([str(TESTS_DIR), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
        self.process = Process(
            argv,
            stdout_path=self.dir / "stdout",
            stderr_path=self.dir / "stderr",
            env={"PYTHONPATH": path.rstrip(os.pathsep)},
            name=name,
        )
        try:
            ready = self.process.wait_output(r"^READY (\d+) (\d+)$", timeout=ready_timeout)
        except BaseException:
            self.close()
            raise
        self.port = int(ready.group(1))
        self.control_port = int(ready.group(2))

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``, as the activator's config lists it."""
        return f"{LOCALHOST}:{self.port}"

    @property
    def control_address(self) -> str:
        return f"{LOCALHOST}:{self.control_port}"

    def stats(self) -> dict[str, Any]:
        """The pod's own count of its work (see the class docstring)."""
        result: dict[str, Any] = json_request(self.control_address, "GET", "/_stats")
        return result

    def control(self, action: str, **query: str | int) -> Any:
        """``POST /ACTION?key=value...`` on the control port; its JSON answer."""
        qs = "&".join(f"{k}={v}" for k, v in query.items())
        return json_request(self.control_address, "POST", f"/{action}" + (f"?{qs}" if qs else ""))

    def wait_stats(self, predicate: Callable[[dict[str, Any]], Any], message: str = "") -> dict[str, Any]:
        """Poll :meth:`stats` until ``predicate`` holds; those stats (fails if the pod exits)."""

        def check() -> dict[str, Any] | None:
            self.process.check_running(f"while waiting: {message}")
            stats = self.stats()
            return stats if predicate(stats) else None

        return wait_until(check, message=lambda: f"{self.name}: {message}; stats {self.stats()}")

    def is_running(self) -> bool:
        return self.process.is_running()

    def kill(self) -> None:
        self.process.kill()

    def close(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def log_text(self) -> str:
        return self.process.output_tail()

    def __repr__(self) -> str:
        return f"ModulePod({self.name!r}, {getattr(self, 'port', None)})"


# --------------------------------------------------------------------------------------
# the activator under test: configs, /status


def _parse_yaml(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None


def render_config(config: Config, defaults: Mapping[str, Any]) -> str:
    """YAML text for ``config``, with top-level ``defaults`` added where missing.

    A string is kept byte for byte (line numbers matter to error tests); missing keys are
    appended at its end. Text that is not a YAML mapping is written unchanged.
    """
    if isinstance(config, str):
        parsed = _parse_yaml(config)
        if not isinstance(parsed, dict):
            return config
        missing = {k: v for k, v in defaults.items() if k not in parsed}
        if not missing:
            return config
        sep = "" if config.endswith("\n") or not config else "\n"
        appended: str = yaml.safe_dump(missing, default_flow_style=False, sort_keys=False)
        return config + sep + appended
    data = dict(config)
    for k, v in defaults.items():
        data.setdefault(k, v)
    text: str = yaml.safe_dump(data, default_flow_style=False, sort_keys=False)
    return text


class Addressed(Protocol):
    """A pod of any kind (:class:`Pod`, a test's own server): its ``host:port``."""

    @property
    def address(self) -> str: ...


PodEntry = Addressed | str | Mapping[str, Any]


def pod_entry(pod: Addressed | str, drain: bool = False) -> str | dict[str, Any]:
    """A pod as a service lists it: its address, or ``{address, drain: true}``."""
    address = pod if isinstance(pod, str) else pod.address
    return {"address": address, "drain": True} if drain else address


def service_config(pods: Iterable[PodEntry], **options: Any) -> dict[str, Any]:
    """One service's entry: every host (``*``), ``container_concurrency`` 1, no probe,
    over ``pods`` (a pod object is written as its address; an address or a mapping such
    as ``{"address": ..., "drain": True}`` as given). ``options`` are more keys of the
    entry, as the file spells them (``hosts``, ``lb_policy``...), and win over those."""
    entries = [pod if isinstance(pod, str | Mapping) else pod.address for pod in pods]
    return {"hosts": ["*"], "container_concurrency": 1, "probe": None, **options, "pods": entries}


def probe_config(interval: str = "200ms", **options: Any) -> dict[str, Any]:
    """An active probe of ``/healthz`` every ``interval``: a 1 s timeout, healthy after one
    success, unhealthy after two failures; ``options`` change or add keys."""
    return {
        "path": "/healthz",
        "interval": interval,
        "timeout": "1s",
        "healthy_after": 1,
        "unhealthy_after": 2,
        **options,
    }


def make_config(
    pods: Iterable[PodEntry], *, service: str = SERVICE, top: Mapping[str, Any] | None = None, **options: Any
) -> dict[str, Any]:
    """A config of one service, ``service``, over ``pods`` (``service_config(pods,
    **options)``), the access log off; ``top`` adds or replaces top-level keys
    (``limits``, ``grace_period``, ``access_log``...)."""
    return {"access_log": False, **(top or {}), "services": {service: service_config(pods, **options)}}


def find_pod(status: Mapping[str, Any], service: str, address: str) -> dict[str, Any] | None:
    """The pod entry of ``/status`` for ``address`` in ``service``, or None."""
    svc = status.get("services", {}).get(service)
    if not svc:
        return None
    for pod in svc.get("pods", []):
        if pod.get("address") == address:
            result: dict[str, Any] = pod
            return result
    return None


def pod_state(status: Mapping[str, Any], service: str, address: str) -> str | None:
    """The state of a pod in ``/status`` (None when it is not listed)."""
    pod = find_pod(status, service, address)
    return None if pod is None else pod.get("state")


def is_idle(status: Mapping[str, Any], service: str | None = None) -> bool:
    """Nothing queued or in flight in ``service`` (None: in any service), nor on any of
    its pods, per ``/status``: where every count returns once the load is over (a slot
    that was never released never gets there)."""
    services = status["services"]
    chosen = services.values() if service is None else [services[service]]
    return all(s["in_flight"] == 0 and s["queued"] == 0 and all(p["in_flight"] == 0 for p in s["pods"]) for s in chosen)


@dataclass(frozen=True)
class AccessRecord:
    """One access-log line: ``TIME CLIENT SERVICE POD STATUS REASON Tw= Tr= Tt= bytes=OUT
    in=IN "METHOD TARGET"`` (``bytes``: body bytes to the client, a tunnel's pod-to-client
    bytes; ``bytes_in``: request body bytes, a tunnel's client-to-pod bytes; None when the
    line has no ``in=``)."""

    service: str
    pod: str
    status: int
    reason: str
    bytes: int
    bytes_in: int | None
    method: str
    target: str
    line: str


_ACCESS_LINE = re.compile(
    r"^\S+ \S+ (?P<service>\S+) (?P<pod>\S+) (?P<status>\d{3}) (?P<reason>\S+) "
    r"Tw=-?\d+ Tr=-?\d+ Tt=-?\d+ bytes=(?P<bytes>\d+)(?: in=(?P<bytes_in>\d+))? "
    r'"(?P<method>\S+)(?: (?P<target>[^"]*))?"$'  # "-": no request line could be read
)


def parse_access_line(line: str) -> AccessRecord | None:
    """An access-log line as an :class:`AccessRecord` (None: not an access-log line)."""
    m = _ACCESS_LINE.match(line.strip())
    if m is None:
        return None
    return AccessRecord(
        m["service"],
        m["pod"],
        int(m["status"]),
        m["reason"],
        int(m["bytes"]),
        None if m["bytes_in"] is None else int(m["bytes_in"]),
        m["method"],
        m["target"] or "",
        line.strip(),
    )


class Activator(Closing):
    """``activator run -c PATH`` as a subprocess, with its config in a work dir.

    ``config`` is a dict or YAML text; ``listen`` and ``admin`` default to free ports on
    127.0.0.1 (pass ``admin: None`` to disable the admin API: readiness is then the proxy
    port accepting connections). With ``use_symlink=True`` the config path is a symlink
    and :meth:`swap_symlink` changes its target atomically.

    ``command`` is the CLI to run (default :func:`activator_command`: ``$ACTIVATOR_BIN``
    or this tree), ``cwd`` its working directory (default the work dir), ``wrapper`` what
    goes in front of it (the benchmarks' ``taskset``).
    """

    def __init__(
        self,
        config: Config,
        *,
        workdir: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        start: bool = True,
        wait_ready: bool = True,
        ready_timeout: float = 20.0,
        use_symlink: bool = False,
        filename: str = "activator.yaml",
        command: Sequence[str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        wrapper: Sequence[str] = (),
    ) -> None:
        self._own_dir = workdir is None
        self.dir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="activator-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.dir / filename
        self.env = dict(env or {})
        self.extra_args = list(extra_args)
        self.ready_timeout = ready_timeout
        self.use_symlink = use_symlink
        self.cli = list(command) if command is not None else activator_command()
        self.cwd = Path(cwd) if cwd is not None else self.dir
        self.wrapper = list(wrapper)
        self._versions = 0
        self._process: Process | None = None
        self.stdout_path = self.dir / "stdout.log"
        self.stderr_path = self.dir / "stderr.log"

        listen_port, admin_port = free_ports(2)
        self._defaults: dict[str, Any] = {
            "listen": f"{LOCALHOST}:{listen_port}",
            "admin": f"{LOCALHOST}:{admin_port}",
        }
        text = render_config(config, self._defaults)
        written = {**self._defaults, **config} if isinstance(config, Mapping) else _parse_yaml(text)
        if isinstance(written, dict):
            # What was actually written wins (a test may give its own listen/admin).
            self._defaults = {"listen": written.get("listen"), "admin": written.get("admin")}
        if use_symlink:
            self.swap_symlink(text)
        else:
            self.config_path.write_text(text)
        if start:
            try:
                self.start(wait_ready=wait_ready)
            except BaseException:
                self.close()  # the error already carries the output tail
                raise

    # addresses

    @property
    def listen(self) -> str:
        """The proxy's ``host:port``."""
        return str(self._defaults["listen"])

    @property
    def port(self) -> int:
        """The proxy's port."""
        return _host_port(self.listen)[1]

    @property
    def admin(self) -> str | None:
        """The admin API's ``host:port`` (None when disabled)."""
        admin = self._defaults["admin"]
        return None if admin is None else str(admin)

    def url(self, path: str = "/") -> str:
        return f"http://{self.listen}{path}"

    def admin_url(self, path: str = "/") -> str:
        if self.admin is None:
            raise HarnessError("admin API is disabled in this config")
        return f"http://{self.admin}{path}"

    # lifecycle

    def command(self) -> list[str]:
        return [*self.wrapper, *self.cli, "run", "-c", str(self.config_path), *self.extra_args]

    def start(self, wait_ready: bool = True) -> Activator:
        if self.is_running():
            raise HarnessError("activator already running")
        self._process = Process(
            self.command(),
            stdout_path=self.stdout_path,
            stderr_path=self.stderr_path,
            env=self.env,
            cwd=self.cwd,
            name="activator",
        )
        if wait_ready:
            self.wait_ready()
        return self

    @property
    def process(self) -> Process:
        """The running (or last) activator process."""
        if self._process is None:
            raise HarnessError("activator not started")
        return self._process

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.returncode

    def is_running(self) -> bool:
        return self._process is not None and self._process.is_running()

    def is_ready(self) -> bool:
        """``/readyz`` is 200 (or, with no admin API, the proxy port accepts)."""
        try:
            if self.admin is None:
                with socket.create_connection(_host_port(self.listen), timeout=1.0):
                    return True
            return request(self.admin, "GET", "/readyz", timeout=2.0).status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait for readiness; fail with the captured output if it exits or times out
        (then it is killed)."""
        timeout = self.ready_timeout if timeout is None else timeout
        process = self.process

        def ready() -> bool:
            process.check_running("before ready")
            return self.is_ready()

        try:
            wait_until(ready, timeout=timeout, interval=0.05)
        except ProcessExited:
            raise
        except HarnessError:
            self.kill()
            raise HarnessError(f"activator not ready within {timeout}s\n{self.output_tail()}") from None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the activator's main process."""
        self.process.signal(sig)

    def reload(self) -> None:
        """SIGHUP: force a re-read of the config file."""
        self.signal(signal.SIGHUP)

    def wait(self, timeout: float = DEFAULT_TIMEOUT) -> int:
        """Wait for the process to exit by itself; its exit code."""
        return self.process.wait(timeout)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait for the exit (grace period included); its exit code.

        If it is still running after ``timeout`` it is killed and this fails."""
        code = self.process.stop(grace=timeout)
        if code is None:
            raise HarnessError(f"activator still running after {timeout}s (killed)\n{self.output_tail()}")
        return code

    def kill(self) -> None:
        """SIGKILL the activator and its whole process group."""
        if self._process is not None:
            self._process.kill()

    def close(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # admin API

    def admin_get(self, path: str, timeout: float = 10.0) -> Response:
        if self.admin is None:
            raise HarnessError("admin API is disabled in this config")
        return request(self.admin, "GET", path, timeout=timeout)

    def status(self) -> dict[str, Any]:
        """``GET /status`` as JSON."""
        resp = self.admin_get("/status")
        if resp.status != 200:
            raise HarnessError(f"/status answered {resp.status}: {resp.text}")
        result: dict[str, Any] = resp.json()
        return result

    def wait_for(
        self,
        predicate: Callable[[dict[str, Any]], Any],
        timeout: float = DEFAULT_TIMEOUT,
        message: str = "",
    ) -> dict[str, Any]:
        """Poll ``/status`` every 50 ms until ``predicate(status)`` is truthy; return
        that status. Exceptions in the predicate (a service not there yet) mean "not yet".
        On timeout, fails showing the last status and the activator's output."""
        last: list[dict[str, Any]] = []
        process = self.process

        def check() -> dict[str, Any] | None:
            process.check_running(f"while waiting: {message}")
            st = self.status()
            last[:] = [st]
            return st if predicate(st) else None

        def describe() -> str:
            shown = json.dumps(last[0], indent=1) if last else "(no status)"
            return f"{message}\nlast /status: {shown}\n{self.output_tail()}"

        return wait_until(check, timeout=timeout, interval=0.05, message=describe)

    def wait_idle(
        self, service: str | None = None, timeout: float = DEFAULT_TIMEOUT, message: str = "every count back to zero"
    ) -> dict[str, Any]:
        """Wait until :func:`is_idle` (``service``, or every service): nothing queued or
        in flight anywhere, which a slot that was never released prevents; that status."""
        return self.wait_for(lambda st: is_idle(st, service), timeout, message=message)

    def wait_pod_state(
        self, service: str, address: str, state: str | None, timeout: float = DEFAULT_TIMEOUT
    ) -> dict[str, Any]:
        """Wait until the pod is in ``state`` (None: not listed any more)."""
        return self.wait_for(
            lambda st: pod_state(st, service, address) == state,
            timeout,
            message=f"pod {address} of {service} to be {state}",
        )

    # config edits

    def _text(self, config: Config) -> str:
        return render_config(config, self._defaults)

    def rewrite_config(self, config: Config) -> None:
        """Replace the file like an editor does: write a temp file, rename it over."""
        if self.use_symlink:
            self.swap_symlink(config)
            return
        write_atomic(self.config_path, self._text(config))

    def write_config_in_place(self, config: Config) -> None:
        """Truncate and rewrite the same inode (like ``cat > file``)."""
        with open(self.config_path, "w") as f:
            f.write(self._text(config))

    def swap_symlink(self, config: Config) -> None:
        """Write a new versioned file and atomically point the config symlink at it."""
        self._versions += 1
        versions = self.dir / "versions"
        versions.mkdir(exist_ok=True)
        target = versions / f"v{self._versions}.yaml"
        target.write_text(self._text(config))
        tmp_link = self.config_path.with_name(f".{self.config_path.name}.link{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            tmp_link.unlink()
        os.symlink(target, tmp_link)
        os.replace(tmp_link, self.config_path)

    def read_config(self) -> str:
        return self.config_path.read_text()

    # output

    def stdout_text(self) -> str:
        return self.stdout_path.read_text(errors="replace") if self.stdout_path.exists() else ""

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def output_tail(self, chars: int = 4000) -> str:
        return _tail("activator", self.stdout_path, self.stderr_path, chars)

    def access_log(self) -> list[AccessRecord]:
        """The access-log lines written so far (``access_log: true``), parsed."""
        return [r for r in map(parse_access_line, self.stdout_text().splitlines()) if r is not None]

    def wait_access(
        self, predicate: Callable[[AccessRecord], Any], timeout: float = DEFAULT_TIMEOUT, message: str = ""
    ) -> AccessRecord:
        """Wait until an access-log line matches ``predicate``; the first such."""
        process = self.process

        def found() -> AccessRecord | None:
            hit = next((r for r in self.access_log() if predicate(r)), None)
            if hit is None:
                process.check_running(f"while waiting for an access-log line: {message}")
            return hit

        return wait_until(found, timeout=timeout, message=lambda: f"access-log line: {message}\n{self.output_tail()}")


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host or LOCALHOST, int(port)


# --------------------------------------------------------------------------------------
# receivers: StatsD and sd_notify


class Metric(NamedTuple):
    name: str
    value: float
    type: str


class TaggedMetric(NamedTuple):
    name: str
    value: float
    type: str
    rate: float | None
    tags: tuple[str, ...]


def parse_statsd_line(line: str) -> TaggedMetric | None:
    """``name:value|type[|@rate][|#tag,tag]`` -> TaggedMetric (None if malformed)."""
    name, sep, rest = line.partition(":")
    if not sep:
        return None
    fields = rest.split("|")
    if len(fields) < 2:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    rate: float | None = None
    tags: tuple[str, ...] = ()
    for extra in fields[2:]:
        if extra.startswith("@"):
            with contextlib.suppress(ValueError):
                rate = float(extra[1:])
        elif extra.startswith("#"):
            tags = tuple(t for t in extra[1:].split(",") if t)
    return TaggedMetric(name, value, fields[1], rate, tags)


class _DatagramReceiver(Closing):
    """A bound datagram socket read by a daemon thread into a list."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._sock.settimeout(0.1)
        self._datagrams: list[bytes] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._cond:
                self._datagrams.append(data)
                self._cond.notify_all()

    def datagrams(self) -> list[bytes]:
        with self._cond:
            return list(self._datagrams)

    def clear(self) -> None:
        with self._cond:
            self._datagrams.clear()

    def close(self) -> None:
        self._closed = True
        self._thread.join(2.0)
        self._sock.close()


class StatsdReceiver(_DatagramReceiver):
    """A real UDP socket on 127.0.0.1; collects StatsD lines (datagrams split on \\n)."""

    def __init__(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        sock.bind((LOCALHOST, 0))
        self.port: int = sock.getsockname()[1]
        super().__init__(sock)

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT`` for the config's ``statsd.address``."""
        return f"{LOCALHOST}:{self.port}"

    def lines(self) -> list[str]:
        out: list[str] = []
        for data in self.datagrams():
            out.extend(line for line in data.decode("utf-8", "replace").split("\n") if line)
        return out

    def tagged_metrics(self) -> list[TaggedMetric]:
        return [m for m in map(parse_statsd_line, self.lines()) if m is not None]

    def metrics(self) -> list[Metric]:
        """Every line received, parsed as ``(name, value, type)``, in arrival order."""
        return [Metric(m.name, m.value, m.type) for m in self.tagged_metrics()]

    def values(self, name: str, type: str | None = None) -> list[float]:
        return [m.value for m in self.metrics() if m.name == name and (type is None or m.type == type)]

    def counter(self, name: str) -> float:
        """Sum of all ``|c`` values received for ``name``."""
        return sum(self.values(name, "c"))

    def gauge(self, name: str) -> float | None:
        """The last ``|g`` value received for ``name`` (None if never sent)."""
        values = self.values(name, "g")
        return values[-1] if values else None

    def names(self) -> set[str]:
        return {m.name for m in self.metrics()}

    def wait_for(self, predicate: Callable[[list[str]], Any], timeout: float = DEFAULT_TIMEOUT) -> list[str]:
        """Poll until ``predicate(lines)`` is truthy; return those lines."""
        last: list[list[str]] = [[]]

        def check() -> list[str] | None:
            lines = self.lines()
            last[0] = lines
            return lines if predicate(lines) else None

        def describe() -> str:
            return f"statsd lines so far ({len(last[0])}): {last[0][-50:]}"

        return wait_until(check, timeout=timeout, message=describe)

    def wait_for_metric(self, name: str, type: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> Metric:
        """Wait until a line for ``name`` (and ``type``) arrived; return the last such."""

        def found() -> Metric | None:
            hits = [m for m in self.metrics() if m.name == name and (type is None or m.type == type)]
            return hits[-1] if hits else None

        return wait_until(found, timeout=timeout, message=lambda: f"metric {name}; names seen: {sorted(self.names())}")


class NotifySocket(_DatagramReceiver):
    """An AF_UNIX datagram socket collecting sd_notify messages (``READY=1`` ...).

    Pass ``env()`` to the activator so it sees ``NOTIFY_SOCKET``.
    """

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="ntf")  # short: sun_path is ~108 bytes
        self.path = os.path.join(self._dir, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(self.path)
        super().__init__(sock)

    def env(self, watchdog_usec: int | None = None) -> dict[str, str]:
        """Environment for the child: ``NOTIFY_SOCKET`` (and ``WATCHDOG_USEC``)."""
        env = {"NOTIFY_SOCKET": self.path}
        if watchdog_usec is not None:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        return env

    def messages(self) -> list[str]:
        """Each datagram as text (one may hold several ``KEY=VALUE`` lines)."""
        return [d.decode("utf-8", "replace") for d in self.datagrams()]

    def assignments(self) -> list[str]:
        """Every ``KEY=VALUE`` line, across datagrams, in order."""
        return [line for m in self.messages() for line in m.split("\n") if line]

    def wait_for(self, text: str, timeout: float = DEFAULT_TIMEOUT) -> str:
        """Wait until a datagram contains ``text``; return that datagram."""

        def found() -> str | None:
            return next((m for m in self.messages() if text in m), None)

        return wait_until(found, timeout=timeout, message=lambda: f"{text!r} in sd_notify messages {self.messages()}")

    def close(self) -> None:
        super().close()
        shutil.rmtree(self._dir, ignore_errors=True)

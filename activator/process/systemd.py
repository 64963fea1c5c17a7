"""sd_notify for ``Type=notify`` services, without the systemd Python package.

This module decides what activator tells systemd and how: ``READY=1`` once listening,
``RELOADING=1`` (then ``READY=1`` again) around a SIGHUP re-read, ``STOPPING=1`` on
SIGTERM, ``WATCHDOG=1`` pings while the event loop is healthy, and free-form
``STATUS=`` lines that ``systemctl status`` shows.

Rules:

- Telling systemd is best effort. A send never raises into the caller and never blocks:
  the datagram goes out on a non-blocking ``AF_UNIX``/``SOCK_DGRAM`` socket of the C
  ``_socket`` module (not gevent's patched one, so a send never yields to the hub), and
  every error (no listener, full queue, wrong path) is swallowed and only logged at
  DEBUG. A missing ``$NOTIFY_SOCKET`` (not started by systemd) gives a no-op notifier.
- ``$NOTIFY_SOCKET`` starting with ``@`` names a socket in the abstract namespace.
- ``WATCHDOG_PID`` is deliberately not compared with ``os.getpid()`` (libsystemd does):
  in a PyInstaller one-file binary systemd's MAINPID is the bootloader and Python runs
  in its child, so the check would never match. The unit sets ``NotifyAccess=all`` for
  the same reason.
- Watchdog pings are sent from a greenlet on the event loop (``run_watchdog``), so a
  loop that is stuck (a greenlet that never yields) stops the pings and systemd
  restarts the service.
- ``STATUS=`` is kept current (``StatusLine``): the caller offers the line whenever it
  may have changed (pod states changed, and once a second); it is sent when it differs
  from the last one sent and at least ``STATUS_INTERVAL`` after it (a line that changed
  within the interval goes at the next offer after it), so ``systemctl status`` is never
  more than a moment behind and systemd gets at most one message a second.
"""

from __future__ import annotations

import _socket
import logging
import math
import os
import time
from collections.abc import Callable, Mapping

__all__ = ["Notifier", "StatusLine", "run_watchdog", "watchdog_interval"]

log = logging.getLogger(__name__)

#: The shortest time between two ``STATUS=`` lines sent by ``StatusLine.update``.
STATUS_INTERVAL = 1.0


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between two ``WATCHDOG=1`` pings, or None when no watchdog is set.

    Half of ``$WATCHDOG_USEC`` (systemd's ``WatchdogSec=``), as sd_watchdog_enabled(3)
    recommends. ``$WATCHDOG_PID`` is not checked (see the module docstring).
    """
    usec = _watchdog_usec(os.environ if environ is None else environ)
    return None if usec is None else usec / 2_000_000


def _watchdog_usec(env: Mapping[str, str]) -> int | None:
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec if usec > 0 else None


def _monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Sends sd_notify(3) messages to one notification socket, or nothing at all.

    Every method does not yield and never raises; it returns True when the datagram was
    handed to the kernel, False otherwise (including for the no-op notifier).
    """

    def __init__(self, address: str | None = None, watchdog_usec: int | None = None) -> None:
        # The socket address as given in $NOTIFY_SOCKET ("@name" for abstract);
        # None makes this notifier a no-op.
        self.address = address or None
        self.watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self._target: str | bytes | None = None
        if self.address is not None:
            if self.address.startswith("@"):
                self._target = b"\0" + self.address[1:].encode()
            else:
                self._target = self.address

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, unset: bool = False) -> Notifier:
        """The notifier systemd asked for through ``$NOTIFY_SOCKET`` (no-op if unset).

        ``unset=True`` removes ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID``
        from ``os.environ`` so that child processes (demo pods, workers) do not talk to
        systemd on our behalf.
        """
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        usec = _watchdog_usec(env)
        if unset:
            for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(key, None)
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        """True when started by systemd with a notification socket."""
        return self._target is not None

    def __repr__(self) -> str:
        return f"Notifier(address={self.address!r}, watchdog_usec={self.watchdog_usec!r})"

    def watchdog_interval(self) -> float | None:
        """Seconds between pings (half of ``WatchdogSec``), or None: no watchdog wanted."""
        if not self.enabled or self.watchdog_usec is None:
            return None
        return self.watchdog_usec / 2_000_000

    def notify(self, raw: str | None = None, /, **fields: object) -> bool:
        """Send one message: ``raw`` text and/or ``KEY=value`` fields, one per line.

        ``notify(READY=1, STATUS="serving")`` sends ``READY=1\\nSTATUS=serving``.
        Newlines inside a field's value are replaced by spaces (a newline would start
        a new assignment). Does not yield; never raises.
        """
        target = self._target
        if target is None:
            return False
        lines = [] if raw is None else [raw]
        for key, value in fields.items():
            if value is True:
                value = 1
            text = str(value).replace("\n", " ")
            lines.append(f"{key}={text}")
        if not lines:
            return False
        return self._send(target, "\n".join(lines).encode("utf-8", "replace"))

    def _send(self, target: str | bytes, data: bytes) -> bool:
        try:
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM)
        except OSError as exc:
            log.debug("sd_notify: cannot create a socket: %s", exc)
            return False
        try:
            sock.setblocking(False)
            sock.sendto(data, target)
            return True
        except OSError as exc:
            log.debug("sd_notify to %s failed: %s", self.address, exc)
            return False
        finally:
            sock.close()

    def ready(self, status: str | None = None) -> bool:
        """``READY=1`` (and ``STATUS=``): startup finished, or a reload finished."""
        if status is None:
            return self.notify(READY=1)
        return self.notify(READY=1, STATUS=status)

    def reloading(self, status: str | None = None) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC``; send ``ready()`` once reloaded."""
        fields: dict[str, object] = {"RELOADING": 1, "MONOTONIC_USEC": _monotonic_usec()}
        if status is not None:
            fields["STATUS"] = status
        return self.notify(**fields)

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: the graceful stop has begun."""
        if status is None:
            return self.notify(STOPPING=1)
        return self.notify(STOPPING=1, STATUS=status)

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: one keep-alive ping."""
        return self.notify(WATCHDOG=1)


class StatusLine:
    """Keeps systemd's ``STATUS=`` current, rate-limited (see the module docstring).
    Does not yield, never raises."""

    def __init__(self, notifier: Notifier, interval: float = STATUS_INTERVAL) -> None:
        self.notifier = notifier
        self.interval = interval
        self.last: str | None = None  # the last line sent
        self.last_at = -math.inf  # when (monotonic seconds)

    def update(self, text: str, now: float) -> bool:
        """Send ``text`` if it is news and the last line is old enough: whether it was sent."""
        if text == self.last or now - self.last_at < self.interval:
            return False
        self.sent(text, now)
        return self.notifier.notify(STATUS=text)

    def sent(self, text: str, now: float) -> str:
        """Note a line sent along with another message (``READY=1``); returns it."""
        self.last, self.last_at = text, now
        return text


def run_watchdog(notifier: Notifier, *, sleep: Callable[[float], object] | None = None) -> None:
    """Greenlet body: ping ``WATCHDOG=1`` every interval.

    Returns at once when systemd asked for no watchdog. Otherwise it runs until killed:
    ``gevent.spawn(run_watchdog, notifier)``. The pings come from the event loop, so a
    loop that stops turning stops them, and systemd restarts the service once
    ``WatchdogSec`` passes without one. systemd stops enforcing the watchdog once the
    service is stopping (after ``STOPPING=1`` or SIGTERM; checked on systemd 252 with a
    drain longer than ``WatchdogSec``), so at stop simply kill this greenlet. ``sleep``
    defaults to ``gevent.sleep``.
    """
    interval = notifier.watchdog_interval()
    if interval is None:
        return
    if sleep is None:
        import gevent

        sleep = gevent.sleep
    while True:
        notifier.watchdog()
        sleep(interval)

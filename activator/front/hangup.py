"""Noticing that a client hung up, without reading its socket and without a greenlet.

A queued request whose client left must leave the queue at once: for a one-request-
at-a-time model server, sending it later would waste a whole inference. Reading the
socket cannot tell: bytes already waiting (a request body, a pipelined request) hide the
EOF behind them. The kernel can: ``EPOLLRDHUP`` is reported when the peer has shut down
its side, whatever is still unread, and ``EPOLLHUP`` / ``EPOLLERR`` when it reset.

So one epoll set per process holds the sockets being watched (registered for exactly
those events, never for readability), and one gevent io watcher on the epoll descriptor
wakes the hub when any of them fires. A watch costs a dict entry and a registration: no
greenlet, no timer, nothing per wait beyond that (``HangupMonitor.watch``). Callbacks run
in the hub: they must not block or switch, they only set flags and wake waiters.

``hung_up(sock)`` is the same question asked once, without waiting (one ``poll`` with a
zero timeout): the proxy asks it before sending a granted request that waited.
"""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import Any

import gevent
from gevent.monkey import get_original

# gevent's monkey-patching removes select.epoll and select.poll (they would block the
# hub); these are the real ones, used without ever blocking: epoll only with a zero
# timeout when its descriptor is readable, poll only with a zero timeout.
_epoll = get_original("select", "epoll")
_poll = get_original("select", "poll")

_HANGUP_EVENTS = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
_POLL_HANGUP = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL
_READ = 1  # libev's EV_READ, as gevent's loop.io takes it


def hung_up(sock: Any) -> bool:
    """True when the peer of ``sock`` has closed or reset the connection. Does not yield."""
    try:
        fd = sock.fileno()
    except OSError:
        return True
    if fd < 0:
        return True
    poller = _poll()
    poller.register(fd, _POLL_HANGUP)
    return bool(poller.poll(0))


class HangupMonitor:
    """Calls back once when a watched socket's peer hangs up. One per process (``monitor()``)."""

    def __init__(self) -> None:
        self._epoll = _epoll()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._watcher = gevent.get_hub().loop.io(self._epoll.fileno(), _READ)

    def watch(self, fd: int, on_hangup: Callable[[], None]) -> bool:
        """Call ``on_hangup()`` (in the hub; it must not block) when ``fd``'s peer hangs up.

        Returns False (and calls nothing) when ``fd`` cannot be watched (already closed).
        A watch ends when it fires or with ``unwatch``. Does not yield.
        """
        try:
            self._epoll.register(fd, _HANGUP_EVENTS)
        except (OSError, ValueError):
            return False
        self._callbacks[fd] = on_hangup
        if not self._watcher.active:
            self._watcher.start(self._ready)
        return True

    def unwatch(self, fd: int, on_hangup: Callable[[], None]) -> None:
        """End this watch of ``fd`` (the one with this callback) if it has not fired.

        Idempotent, and safe after the descriptor was closed and its number reused by a
        newer watch: that one is left alone. Does not yield.
        """
        if self._callbacks.get(fd) == on_hangup:
            del self._callbacks[fd]
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):
                pass  # closed meanwhile: the kernel dropped it from the set already
        if not self._callbacks and self._watcher.active:
            self._watcher.stop()

    @property
    def watching(self) -> int:
        return len(self._callbacks)

    def _ready(self) -> None:
        for fd, _events in self._epoll.poll(0):
            callback = self._callbacks.get(fd)
            if callback is not None:
                self.unwatch(fd, callback)
                callback()


_monitor: HangupMonitor | None = None


def monitor() -> HangupMonitor:
    """This process's monitor (made on first use, on the running hub)."""
    global _monitor
    if _monitor is None:
        _monitor = HangupMonitor()
    return _monitor

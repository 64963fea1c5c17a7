"""Timeouts for every socket and queue wait of the process, enforced by one greenlet
instead of a timer per wait.

A gevent socket with a timeout starts and cancels a timer each time a read or a write
has to wait: two per proxied request at least, a measurable part of the CPU a request
costs. Here sockets have no timeout of their own. An object that waits on a socket (a
client connection, a pod connection) is a ``Watched``: before a wait it sets its
``deadline`` (a ``time.monotonic()`` instant; 0 means none), after the wait it clears
it, which costs two attribute writes. One sweeper greenlet per process looks at every
watched object every ``TICK`` seconds and calls ``expire()`` on those whose deadline has
passed; ``expire`` shuts the socket down (``shutdown`` interrupts a greenlet blocked on
it), and the interrupted operation sees ``timed_out`` and reports the timeout its way.
A request waiting in a queue is an ``Expiring`` too (``gate.wait_watching``): its expiry
wakes the waiter.

Resolution: a timeout fires between its deadline and one ``TICK`` after it. Cost: the
sweep touches every watched object each tick (microseconds per thousand).
"""

from __future__ import annotations

import socket
import time
from typing import Any, Protocol

import gevent

#: How often deadlines are checked (the resolution of every timeout).
TICK = 0.1


class Expiring(Protocol):
    """What the sweeper looks at: a ``deadline`` (0: none) and what to do when it passes."""

    deadline: float

    def expire(self) -> None:
        """The deadline passed. Must not yield."""


class Watched:
    """Something that waits on ``sock`` under a deadline. Subclasses set ``sock``."""

    __slots__ = ("deadline", "timed_out", "sock")

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.deadline = 0.0
        self.timed_out = False

    def expire(self) -> None:
        """The deadline passed: interrupt whatever waits on the socket. Does not yield."""
        self.timed_out = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class Sweeper:
    """The one greenlet that expires deadlines (see the module docstring)."""

    def __init__(self, tick: float = TICK) -> None:
        self.tick = tick
        self._watched: set[Expiring] = set()
        self._greenlet: gevent.Greenlet | None = None

    def add(self, watched: Expiring) -> None:
        self._watched.add(watched)
        if self._greenlet is None:
            self._greenlet = gevent.spawn(self._run)

    def discard(self, watched: Expiring) -> None:
        self._watched.discard(watched)

    def sweep(self, now: float) -> None:
        """Expire every deadline that passed by ``now``. Does not yield."""
        for watched in [w for w in self._watched if 0.0 < w.deadline <= now]:
            watched.deadline = 0.0
            watched.expire()

    def _run(self) -> None:
        while True:
            gevent.sleep(self.tick)
            self.sweep(time.monotonic())


_sweeper: Sweeper | None = None


def sweeper() -> Sweeper:
    """This process's sweeper (its greenlet starts with the first watched socket)."""
    global _sweeper
    if _sweeper is None:
        _sweeper = Sweeper()
    return _sweeper

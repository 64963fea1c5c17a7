"""Waiting for a slot under gevent: the only place a request blocks on the throttler.

The core decides (``ServiceThrottler.acquire`` returns a grant or a waiter); this module
does the waiting. A waiter parks its greenlet on a ``gevent.event.Event`` that the core
sets when it hands the waiter a slot, bounded by ``queue_timeout``; meanwhile the
process's ``HangupMonitor`` watches the client's socket (no greenlet of its own) and wakes
the waiter if the client hangs up. Whatever ends the wait (a slot, the timeout, the client
hanging up, the greenlet killed), the waiter leaves the queue, or a grant that arrived in
the same instant is released: a slot is never lost between "granted" and "woken", and a
client that hung up never gets a pod.
"""

from __future__ import annotations

import time
from typing import Protocol

from gevent.event import Event

from . import hangup
from .core.errors import ClientGone, QueueTimeout
from .core.throttler import Grant, ServiceThrottler, Waiter


class Client(Protocol):
    """What the gate needs of a client: its socket's descriptor, to watch for a hang-up."""

    def fileno(self) -> int: ...


class Redirected(Exception):
    """The waiter was taken out of the queue to be forwarded: this process owns no slot now."""


def _wait(throttler: ServiceThrottler, first: Grant | Waiter, event: Event, timeout: float,
          client: Client | None) -> Grant:
    if isinstance(first, Grant):
        return first
    gone = False

    def client_left() -> None:
        nonlocal gone
        gone = True
        event.set()

    monitor = hangup.monitor()
    fd = client.fileno() if client is not None else -1
    watching = fd >= 0 and monitor.watch(fd, client_left)
    if fd >= 0 and not watching:
        gone = True  # the socket is closed already
    try:
        if not gone:
            event.wait(timeout)
    except BaseException:
        grant = throttler.abandon(first)
        if grant is not None:
            throttler.release(grant, time.monotonic())
        raise
    finally:
        if watching:
            monitor.unwatch(fd, client_left)
    grant = throttler.abandon(first)
    if gone:
        if grant is not None:
            throttler.release(grant, time.monotonic())
        raise ClientGone("the client hung up while its request was queued")
    if grant is None:
        raise Redirected() if first.redirected else QueueTimeout()
    return grant


def _not_yet() -> None:
    """A waiter's notify until ``acquire`` gives it its Event (no yield comes between)."""


def acquire(throttler: ServiceThrottler, timeout: float, client: Client | None = None) -> Grant:
    """A slot on one of the service's pods, waiting in line if needed.

    Raises QueueFull at once, QueueTimeout after ``timeout`` seconds, or ClientGone as
    soon as ``client`` hangs up while waiting.
    """
    first = throttler.acquire(time.monotonic(), _not_yet)
    if isinstance(first, Grant):
        return first
    event = Event()
    first.notify = event.set  # before any yield: the core calls it when it hands a slot over
    return _wait(throttler, first, event, timeout, client)


def acquire_retry(throttler: ServiceThrottler, failed: Grant, timeout: float, client: Client | None = None) -> Grant:
    """A slot, preferably on another pod, for a request whose connection failed.

    ``failed`` is released here in every case (after the new slot is chosen, so its freed
    slot is not the first one offered to the retry).
    """
    event = Event()
    try:
        first = throttler.acquire_retry(failed, time.monotonic(), event.set)
    finally:
        throttler.release(failed, time.monotonic())
    return _wait(throttler, first, event, timeout, client)

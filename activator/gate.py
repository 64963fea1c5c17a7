"""Waiting for a slot under gevent: the only place a request blocks on the throttler.

The core decides (``ServiceThrottler.acquire`` returns a grant or a waiter); this
module does the waiting. A waiter parks its greenlet on a ``gevent.event.Event``
that the core sets when it hands the waiter a slot, bounded by ``queue_timeout``.
Whatever ends the wait (a slot, the timeout, the greenlet killed because the client
went away), the waiter leaves the queue, or a grant that arrived in the same instant
is released: a slot is never lost between "granted" and "woken".
"""

from __future__ import annotations

import time

from gevent.event import Event

from .core.errors import QueueTimeout
from .core.throttler import Grant, ServiceThrottler, Waiter


def _wait(throttler: ServiceThrottler, first: Grant | Waiter, event: Event, timeout: float) -> Grant:
    if isinstance(first, Grant):
        return first
    try:
        event.wait(timeout)
    except BaseException:
        grant = throttler.abandon(first)
        if grant is not None:
            throttler.release(grant, time.monotonic())
        raise
    grant = throttler.abandon(first)
    if grant is None:
        raise QueueTimeout()
    return grant


def acquire(throttler: ServiceThrottler, timeout: float) -> Grant:
    """A slot on one of the service's pods, waiting in line if needed.

    Raises QueueFull at once, or QueueTimeout after ``timeout`` seconds.
    """
    event = Event()
    first = throttler.acquire(time.monotonic(), event.set)
    return _wait(throttler, first, event, timeout)


def acquire_retry(throttler: ServiceThrottler, failed: Grant, timeout: float) -> Grant:
    """A slot, preferably on another pod, for a request whose connection failed.

    ``failed`` is released here in every case (after the new slot is chosen, so its
    freed slot is not the first one offered to the retry).
    """
    event = Event()
    try:
        first = throttler.acquire_retry(failed, time.monotonic(), event.set)
    finally:
        throttler.release(failed, time.monotonic())
    return _wait(throttler, first, event, timeout)

"""``no_switch()``: fail a test if the current greenlet switches away inside a block.

Under gevent, code that does not yield runs atomically: that is what makes the core
lock-free, and what the shell promises between looking at the state and changing it
(DESIGN.md, "The one idea"). This turns the promise into a check. Inside the block a
greenlet trace function (``greenlet.settrace``) records every ``switch`` and ``throw``
whose origin is the greenlet that entered the block, to the hub or to any other
greenlet; on exit the previous trace function is restored (and was called meanwhile,
so an outer tracer keeps seeing everything), then the test fails if anything was
recorded. Scheduling something (setting an Event, spawning, killing asynchronously) is
not a switch; waiting, sleeping (even ``sleep(0)``), joining and blocking I/O are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import greenlet  # type: ignore[import-untyped]

Tracer = Callable[[str, tuple[Any, Any]], Any]


class Switched(AssertionError):
    """The greenlet switched away inside a ``no_switch()`` block."""


@contextmanager
def no_switch(what: str = "the block") -> Iterator[None]:
    """Run the block; raise ``Switched`` if the current greenlet switched away in it."""
    me = greenlet.getcurrent()
    switches: list[str] = []
    previous: Tracer | None = None

    def trace(event: str, args: tuple[Any, Any]) -> None:
        if event in ("switch", "throw"):
            origin, target = args
            if origin is me:
                switches.append(f"{event} to {target!r}")
        if previous is not None:
            previous(event, args)

    previous = greenlet.settrace(trace)
    try:
        yield
    finally:
        greenlet.settrace(previous)
    if switches:
        raise Switched(f"{what} switched away from its greenlet {len(switches)} time(s): " + "; ".join(switches))

"""What the process does on a signal, for a single process and for the supervisor alike.

- SIGHUP: re-read the configuration (``on_reload``).
- SIGTERM or SIGINT: start a graceful stop (``on_stop``). A second one, more than
  ``DUPLICATE_SIGNAL_SECONDS`` after the first, ends it at once (``on_force``). A second
  one sooner is the same signal seen twice: a terminal's Ctrl-C (or ``systemctl kill``)
  reaches both the one-file bootloader, which forwards it, and the Python process.

Handlers are installed with ``gevent.signal_handler`` (never ``signal.signal``: a plain
Python handler would run between any two bytecodes of whatever greenlet is running), and
each handler only spawns a greenlet, so that nothing runs in the middle of a change.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import gevent

DUPLICATE_SIGNAL_SECONDS = 1.0


class Signals:
    """Installs the handlers (``install``); see the module docstring."""

    def __init__(
        self, on_reload: Callable[[], None], on_stop: Callable[[], None], on_force: Callable[[], None]
    ) -> None:
        self.on_reload = on_reload
        self.on_stop = on_stop
        self.on_force = on_force
        self.stopping = False
        self._stop_signalled_at = 0.0

    def install(self) -> None:
        gevent.signal_handler(signal.SIGHUP, self._reload)
        gevent.signal_handler(signal.SIGTERM, self._stop)
        gevent.signal_handler(signal.SIGINT, self._stop)

    def _reload(self) -> None:
        gevent.spawn(self.on_reload)

    def _stop(self) -> None:
        now = time.monotonic()
        if self.stopping:
            if now - self._stop_signalled_at >= DUPLICATE_SIGNAL_SECONDS:
                self.on_force()
            return
        self.stopping = True
        self._stop_signalled_at = now
        gevent.spawn(self.on_stop)

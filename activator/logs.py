"""The process's log: one line per event on stderr, with syslog priorities under systemd.

What this module decides:

- Records go to stderr, at ``$ACTIVATOR_LOG_LEVEL`` (default INFO), as
  ``TIME LEVEL message``.
- Under systemd, when stderr *is* the journal stream (``$JOURNAL_STREAM`` is
  ``DEVICE:INODE`` and names the file stderr is open on, as systemd sets it), every line
  starts with its syslog priority instead of the time (the journal stamps it):
  ``<3>`` error and critical, ``<4>`` warning, ``<6>`` info, ``<7>`` debug (the
  sd-daemon(3) convention), so ``journalctl -p err`` shows only errors. A record of
  several lines (a traceback) has the prefix on each of its lines, so none of them
  lands in the journal at the default priority.
- A line that ends the process before it serves (a bad file, a port taken) is written
  by ``fatal``, with ``<3>`` under the journal too.
- Exceptions that reach gevent's hub (a greenlet that died of a bug) are logged as one
  ERROR record with their traceback, through the same handler, instead of being printed
  on stderr by the hub: an unexpected exception is logged once, with its priority.
  Expected conditions never get there (they are handled where they happen).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import IO, Any

#: sd-daemon(3) priorities by logging level (the highest level at or below a record's).
PRIORITIES = ((logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6), (logging.NOTSET, 7))

log = logging.getLogger("activator")


def priority(level: int) -> int:
    """The syslog priority of a logging level: 3 error, 4 warning, 6 info, 7 debug."""
    return next(prio for threshold, prio in PRIORITIES if level >= threshold)


def stream_is_journal(stream: IO[str], journal_stream: str | None) -> bool:
    """Whether ``stream`` is the journal stream that ``$JOURNAL_STREAM`` (``dev:ino``) names."""
    if not journal_stream:
        return False
    device, _, inode = journal_stream.partition(":")
    try:
        stat = os.fstat(stream.fileno())
        return (stat.st_dev, stat.st_ino) == (int(device), int(inode))
    except (OSError, ValueError, AttributeError):
        return False


class JournalFormatter(logging.Formatter):
    """``<priority>LEVEL message`` on every line of a record."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


def setup_logging(stream: IO[str] | None = None, environ: dict[str, str] | None = None) -> logging.Handler:
    """Log to ``stream`` (stderr) as this module's docstring says; the handler installed."""
    stream = stream or sys.stderr
    environ = dict(os.environ) if environ is None else environ
    handler = logging.StreamHandler(stream)
    if stream_is_journal(stream, environ.get("JOURNAL_STREAM")):
        handler.setFormatter(JournalFormatter("%(levelname)s %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(environ.get("ACTIVATOR_LOG_LEVEL", "INFO").upper())
    _log_hub_errors()
    return handler


def fatal(message: str, stream: IO[str] | None = None) -> None:
    """A line that ends the process (a file that cannot be served), written as is, or
    with ``<3>`` when stderr is the journal: before logging is set up, or instead of it."""
    stream = stream or sys.stderr
    prefix = "<3>" if stream_is_journal(stream, os.environ.get("JOURNAL_STREAM")) else ""
    try:
        stream.write(f"{prefix}{message}\n")
        stream.flush()
    except (OSError, ValueError):
        pass


class _HubErrors:
    """gevent's hub's ``exception_stream``: what it prints in one go becomes one record."""

    def __init__(self, hub: Any) -> None:
        self.hub = hub
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        if not self.parts:
            # The hub prints an error in several writes, without yielding: log them
            # together once it is done.
            self.hub.loop.run_callback(self.emit)
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        """Nothing: the record is written once the hub has printed all of it (``emit``)."""

    def emit(self) -> None:
        text, self.parts = "".join(self.parts).rstrip("\n"), []
        if text:
            log.error("unexpected error in a greenlet:\n%s", text)


def _log_hub_errors() -> None:
    """Route the hub's error printing to the log (see the module docstring)."""
    if "gevent" not in sys.modules:  # a process that does not run gevent prints nothing
        return
    import gevent

    hub = gevent.get_hub()
    stream = hub.exception_stream = _HubErrors(hub)
    atexit.register(stream.emit)  # what the hub printed just before the process ended

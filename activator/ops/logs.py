"""The process's log: one line per event on stderr, with syslog priorities under systemd.

What this module decides:

- Records go to stderr, at ``$ACTIVATOR_LOG_LEVEL`` (default INFO; one of ``LEVELS``,
  any case; anything else is said in one warning and INFO is used: a typo in a drop-in
  must not stop the service), as ``TIME LEVEL message``.
- Levels are Python's, with NOTICE (25) between INFO and WARNING, syslog's "normal but
  significant" (a pod back to healthy).
- Under systemd, when stderr *is* the journal stream (``$JOURNAL_STREAM`` is
  ``DEVICE:INODE`` and names the file stderr is open on, as systemd sets it), every line
  starts with its syslog priority instead of the time (the journal stamps it):
  ``<3>`` error and critical, ``<4>`` warning, ``<5>`` notice, ``<6>`` info, ``<7>``
  debug (the sd-daemon(3) convention), so ``journalctl -p err`` shows only errors.
- A record of several lines (a reload's changes, a traceback) has its whole prefix
  (time or priority, and level) on each of its lines: every line found by grep or
  written to the journal says when and how important it is.
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

#: syslog's "normal but significant condition", between INFO and WARNING.
NOTICE = 25
logging.addLevelName(NOTICE, "NOTICE")

#: sd-daemon(3) priorities by logging level (the highest level at or below a record's).
PRIORITIES = ((logging.ERROR, 3), (logging.WARNING, 4), (NOTICE, 5), (logging.INFO, 6), (logging.NOTSET, 7))
#: The values ``$ACTIVATOR_LOG_LEVEL`` may take (any case).
LEVELS = ("DEBUG", "INFO", "NOTICE", "WARNING", "ERROR")
DEFAULT_LEVEL = "INFO"

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


class LineFormatter(logging.Formatter):
    """``TIME LEVEL message``, the prefix repeated on every line of a record."""

    def prefix(self, record: logging.LogRecord) -> str:
        return f"{self.formatTime(record)} {record.levelname} "

    def format(self, record: logging.LogRecord) -> str:
        prefix = self.prefix(record)
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


class JournalFormatter(LineFormatter):
    """``<priority>LEVEL message`` on every line of a record."""

    def prefix(self, record: logging.LogRecord) -> str:
        return f"<{priority(record.levelno)}>{record.levelname} "


def log_level(value: str | None) -> tuple[str, str | None]:
    """The level named by ``$ACTIVATOR_LOG_LEVEL`` and, when the value is not one of
    ``LEVELS``, the warning to log (the default level is used then)."""
    if value is None or not value.strip():
        return DEFAULT_LEVEL, None
    name = value.strip().upper()
    if name in LEVELS:
        return name, None
    shown = ", ".join(LEVELS)
    return DEFAULT_LEVEL, f"ACTIVATOR_LOG_LEVEL={value!r} is not a level ({shown}); logging at {DEFAULT_LEVEL}"


def setup_logging(stream: IO[str] | None = None, environ: dict[str, str] | None = None) -> logging.Handler:
    """Log to ``stream`` (stderr) as this module's docstring says; the handler installed."""
    stream = stream or sys.stderr
    environ = dict(os.environ) if environ is None else environ
    handler = logging.StreamHandler(stream)
    journal = stream_is_journal(stream, environ.get("JOURNAL_STREAM"))
    handler.setFormatter((JournalFormatter if journal else LineFormatter)("%(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    level, warning = log_level(environ.get("ACTIVATOR_LOG_LEVEL"))
    root.setLevel(level)
    if warning is not None:
        log.warning("%s", warning)
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

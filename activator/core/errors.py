"""The one error hierarchy, and the HTTP answer each error maps to.

Activator's own answers are decided here and nowhere else: the shell turns an
``ActivatorError`` into a response with ``status``, ``X-Activator-Reason: reason``
and, for queue-full, ``Retry-After``. Anything else escaping the core is a bug.
"""

from __future__ import annotations


class ActivatorError(Exception):
    """An answer activator gives itself instead of a pod's."""

    status: int = 500
    reason: str = "internal"
    #: Seconds for a Retry-After header, or None for no header.
    retry_after: int | None = None


class UnknownHost(ActivatorError):
    status = 404
    reason = "unknown-host"


class NotOriginForm(ActivatorError):
    """Absolute-form targets (``GET http://elsewhere/``) and CONNECT: not an open proxy."""

    status = 400
    reason = "bad-request-target"


class QueueFull(ActivatorError):
    status = 503
    reason = "queue-full"
    retry_after = 1


class QueueTimeout(ActivatorError):
    status = 503
    reason = "queue-timeout"


class ShuttingDown(ActivatorError):
    status = 503
    reason = "shutting-down"


class UpstreamConnectError(ActivatorError):
    status = 502
    reason = "upstream-connect"


class UpstreamTimeout(ActivatorError):
    status = 504
    reason = "upstream-timeout"


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names file, line and key.

    Maps to exit code 2 on the command line, and to ``last_error`` on reload.
    """

    def __init__(self, message: str, *, filename: str = "", line: int | None = None, key: str = "") -> None:
        self.filename = filename
        self.line = line
        self.key = key
        self.detail = message
        where = filename
        if line is not None:
            where = f"{where}:{line}" if where else f"line {line}"
        parts = [p for p in (where, key) if p]
        super().__init__(": ".join([*parts, message]))

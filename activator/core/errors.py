"""The one error hierarchy, and the HTTP answer each error maps to.

Activator's own answers are decided here and nowhere else: each ``ActivatorError`` names
its ``status``, its ``X-Activator-Reason`` (``reason``), an optional ``Retry-After`` and
whether the client connection must be closed after the answer (``closes_connection``:
set wherever the framing of what follows on the connection is in doubt). The shell turns
one into bytes in one place (``http1.own_answer``). Anything else escaping the core is a
bug.
"""

from __future__ import annotations

from .failures import FailureKind


class ActivatorError(Exception):
    """An answer activator gives itself instead of a pod's."""

    status: int = 500
    reason: str = "internal-error"
    #: Seconds for a Retry-After header, or None for no header.
    retry_after: int | None = None
    #: The client connection is closed after the answer (the framing is in doubt).
    closes_connection: bool = False


class InternalError(ActivatorError):
    """A bug: logged once with its traceback, answered 500."""

    closes_connection = True


# -- the client's request ----------------------------------------------------------------


class BadRequest(ActivatorError):
    """The request head is not HTTP/1.x as RFC 9112 defines it (llhttp refused it)."""

    status = 400
    reason = "bad-request"
    closes_connection = True


class MalformedMessage(BadRequest):
    """An HTTP/2 request whose fields break RFC 9113 8.2-8.3 (8.1.1: malformed): its
    stream is reset with PROTOCOL_ERROR, never answered; the connection goes on."""


class BadHost(ActivatorError):
    """HTTP/1.1 without Host, with two, or with one that is not ``host[:port]``."""

    status = 400
    reason = "bad-host"


class NotOriginForm(ActivatorError):
    """Absolute-form targets (``GET http://elsewhere/``): not an open proxy."""

    status = 400
    reason = "bad-request-target"


class MalformedTarget(NotOriginForm):
    """A request target llhttp refused (authority-form without CONNECT, bad bytes)."""

    closes_connection = True


class ConnectRefused(NotOriginForm):
    """CONNECT: a tunnel to anywhere; the bytes after its head are not HTTP."""

    closes_connection = True


class UnsupportedMethod(ActivatorError):
    """A method llhttp does not know (it parses a fixed list of methods)."""

    status = 501
    reason = "unsupported-method"
    closes_connection = True


class UnsupportedTransferEncoding(ActivatorError):
    """A Transfer-Encoding other than exactly ``chunked``."""

    status = 501
    reason = "unsupported-transfer-encoding"
    closes_connection = True


class RequestLineTooLong(ActivatorError):
    status = 414
    reason = "request-line-too-long"
    closes_connection = True


class HeadersTooLarge(ActivatorError):
    status = 431
    reason = "headers-too-large"
    closes_connection = True


class BodyTooLarge(ActivatorError):
    """A body over ``limits.max_body_bytes`` (declared, or a chunked one growing past it)."""

    status = 413
    reason = "body-too-large"
    closes_connection = True


class ClientBodyError(ActivatorError):
    """The request body's framing is broken (a bad chunk) or it ended early."""

    status = 400
    reason = "client-body"
    closes_connection = True


class ClientTimeout(ActivatorError):
    """The request head (or a piece of the body) did not arrive within client_timeout."""

    status = 408
    reason = "client-timeout"
    closes_connection = True


class ClientGone(ActivatorError):
    """The client closed its connection; nothing can be answered (logged as 499)."""

    status = 499  # nginx's convention; never actually delivered
    reason = "client-gone"
    closes_connection = True


class TooManyConnections(ActivatorError):
    status = 503
    reason = "too-many-connections"
    closes_connection = True


# -- routing and the queue ------------------------------------------------------------------


class UnknownHost(ActivatorError):
    status = 404
    reason = "unknown-host"


class QueueFull(ActivatorError):
    status = 503
    reason = "queue-full"
    retry_after = 1


class TenantQueueFull(ActivatorError):
    """This request's tenant (``fair_by``) holds its ``tenant_queue_share`` of the queue."""

    status = 503
    reason = "tenant-queue-full"
    retry_after = 1


class Shed(ActivatorError):
    """A higher-priority arrival took this waiter's place in a full queue."""

    status = 503
    reason = "shed"
    retry_after = 1


class QueueTimeout(ActivatorError):
    status = 503
    reason = "queue-timeout"


class ShuttingDown(ActivatorError):
    status = 503
    reason = "shutting-down"
    closes_connection = True


class DeadlineExceeded(ActivatorError):
    """A gRPC request's ``grpc-timeout`` passed before it got a slot (or had passed on arrival)."""

    status = 504
    reason = "deadline-exceeded"


class PeerUnavailable(ActivatorError):
    """The only owners of the service's slots are peers that are down."""

    status = 503
    reason = "peer-unavailable"
    retry_after = 1


# -- the pod ----------------------------------------------------------------------------------


class UpstreamConnectError(ActivatorError):
    """No answer head came from the pod (``core.failures.FailureKind.CONNECT``).

    ``connected``: a connection was made (the request may have reached the pod);
    ``body_read``: some of the client's body was consumed. Together they decide the retry
    (``core.failures.may_retry_elsewhere``).
    """

    status = 502
    reason = "upstream-connect"
    kind = FailureKind.CONNECT

    def __init__(self, message: str = "", *, connected: bool = True, body_read: bool = True) -> None:
        super().__init__(message)
        self.connected = connected
        self.body_read = body_read


class UpstreamBadResponse(UpstreamConnectError):
    """The pod answered with something that is not an HTTP/1.x response head."""

    reason = "upstream-bad-response"


class UpstreamTimeout(ActivatorError):
    status = 504
    reason = "upstream-timeout"
    kind = FailureKind.TIMEOUT


class UpstreamBodyError(Exception):
    """The response body broke off (reset, EOF, bad chunking) after its head was read.

    Not an ``ActivatorError``: the head is out already, so the only answer left is to cut
    the client's connection (or stream). ``log_reason``: what the access log says of it.
    """

    kind = FailureKind.RESET
    log_reason = "upstream-body-cut"


class UpstreamBodyTimeout(UpstreamBodyError):
    """The response did not finish within the exchange's ``total`` time."""

    kind = FailureKind.TIMEOUT
    log_reason = "upstream-body-timeout"


class UpstreamIdle(UpstreamBodyError):
    """The pod sent nothing for ``idle`` seconds mid-body."""

    kind = FailureKind.TIMEOUT
    log_reason = "upstream-idle"


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

"""Which header lines travel, how activator spells its own answers, and gRPC's rules.

The heads themselves, the request check and the framing of bodies are ``core.heads``;
what is decided here, for both transports:

- **Which header lines travel**, in both directions: hop-by-hop headers (RFC 9110 7.6.1:
  ``Connection`` and the headers it names, ``Keep-Alive``, ``Proxy-Connection``, ``TE``,
  ``Transfer-Encoding``, ``Upgrade``; also the proxy authentication pair) stop here;
  every other line keeps its place, its spelling and its value, and repeated lines stay
  separate. Framing headers are re-derived from how the body is actually sent.
  ``X-Forwarded-For`` gets the client appended, ``X-Forwarded-Proto`` and ``-Host`` are
  set.
- **Activator's own answers** (``own_answer_headers``): the status and reason of an
  ``ActivatorError``, ``X-Activator-Reason``, ``Retry-After`` when it has one; a gRPC
  request gets a trailers-only gRPC status instead.
- **gRPC**: what is a gRPC request, how activator's answers map to gRPC statuses, and
  the ``grpc-timeout`` format.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from http import HTTPStatus

from .errors import ActivatorError
from .heads import BodyFraming, Header

#: Request headers that never reach the pod (besides those named in ``Connection``).
#: ``Expect`` is ours: activator sends ``100 Continue`` itself once the slot is granted.
#: ``Content-Length`` and ``Transfer-Encoding`` are re-derived from the body we send.
REQUEST_HOP_BY_HOP = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"expect",
        b"content-length",
        b"x-forwarded-for",  # rebuilt: the client's list, then this client
        b"x-forwarded-proto",  # set: what the client spoke to us
        b"x-forwarded-host",  # set: the Host the client sent
        b"x-activator-forwarded",  # between activators only: the hops a request took
    )
)

#: Response headers that never reach the client (besides those named in ``Connection``).
RESPONSE_HOP_BY_HOP = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate", b"te", b"transfer-encoding", b"upgrade")
)

_OPTIONAL_WHITESPACE = b" \t"

REASON_PHRASES = {
    100: b"Continue",
    101: b"Switching Protocols",
    200: b"OK",
    400: b"Bad Request",
    404: b"Not Found",
    408: b"Request Timeout",
    413: b"Content Too Large",
    414: b"URI Too Long",
    431: b"Request Header Fields Too Large",
    499: b"Client Closed Request",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}


def pod_request_headers(
    headers: Sequence[Header],
    lower_names: Sequence[bytes],
    client_ip: bytes,
    scheme: bytes,
    host: bytes,
    named_by_connection: frozenset[bytes] = frozenset(),
    upgrade: bytes | None = None,
) -> list[Header]:
    """The header lines sent to the pod, as (name, value) pairs in order.

    Every end-to-end line in its place and spelling; ``X-Forwarded-For`` gets the client
    appended to what it said (all its lines, in order), ``X-Forwarded-Proto`` and
    ``-Host`` are set. ``upgrade``: the Upgrade value of a tunnel request, forwarded with
    ``Connection: upgrade``. Framing lines are added by the sender.
    """
    pairs = []
    forwarded_for = []
    for header, lower in zip(headers, lower_names):  # noqa: B905 (built together; strict costs a keyword call)
        if lower in REQUEST_HOP_BY_HOP or lower in named_by_connection:
            if lower == b"x-forwarded-for":
                forwarded_for.append(header[1])
            continue
        pairs.append(header)
    forwarded_for.append(client_ip)
    pairs.append((b"X-Forwarded-For", b", ".join(forwarded_for)))
    pairs.append((b"X-Forwarded-Proto", scheme))
    pairs.append((b"X-Forwarded-Host", host))
    if upgrade is not None:
        pairs.append((b"Connection", b"upgrade"))
        pairs.append((b"Upgrade", upgrade))
    return pairs


def header_block(pairs: Sequence[Header]) -> bytes:
    """HTTP/1.x header lines for ``pairs`` (each ``name: value`` and CRLF)."""
    return b"".join([b"%s: %s\r\n" % pair for pair in pairs])


def response_headers(
    headers: Sequence[Header],
    lower_names: Sequence[bytes],
    framing: BodyFraming,
    named_by_connection: frozenset[bytes] = frozenset(),
    keep_upgrade: bool = False,
    keep_length: bool = False,
) -> list[Header]:
    """The pod's header lines that reach the client, in order, for this framing.

    ``lower_names``: the lower-cased names of ``headers``; ``named_by_connection``: the
    options of the response's ``Connection`` lines (``connection_tokens``).
    Content-Length stays only when the body goes out with that length (or when there is
    no body but the length describes one: HEAD, 304); ``Trailer`` only with chunked.
    ``keep_upgrade``: a 101 answer keeps ``Upgrade`` (the protocol switched to).
    """
    drop_length = not (framing is BodyFraming.LENGTH or keep_length)
    drop_trailer = framing is not BodyFraming.CHUNKED
    kept = []
    for header, lower in zip(headers, lower_names):  # noqa: B905 (built together)
        if lower in RESPONSE_HOP_BY_HOP or lower in named_by_connection:
            if not (lower == b"upgrade" and keep_upgrade):
                continue
        elif (drop_length and lower == b"content-length") or (drop_trailer and lower == b"trailer"):
            continue
        kept.append(header)
    return kept


def relayed_trailers(trailers: Sequence[Header]) -> list[Header]:
    """Trailer fields that travel on (the hop-by-hop rules apply to them too)."""
    return [(name, value) for name, value in trailers if name.lower() not in RESPONSE_HOP_BY_HOP]


# -- HTTP/2 spelling ---------------------------------------------------------------------------

#: Header names HTTP/2 forbids (RFC 9113 8.2.2), ``host`` (``:authority`` carries it) and
#: ``te`` (a request always carries ``te: trailers``, the only value HTTP/2 allows).
NOT_IN_HTTP2 = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade", b"host", b"te")
)


def h2_response_fields(headers: Sequence[Header]) -> list[Header]:
    """Response header lines as HTTP/2 sends them: names lower-cased, connection-specific
    lines (and anything that looks like a pseudo-header) left out, the rest in order."""
    fields = []
    for name, value in headers:
        lower = name.lower()
        if lower in RESPONSE_HOP_BY_HOP or lower[:1] == b":":
            continue
        fields.append((lower, value))
    return fields


def h2_request_fields(
    method: str,
    target: bytes,
    headers: Sequence[Header],
    default_authority: bytes,
    framing: BodyFraming,
    content_length: int | None,
) -> list[Header]:
    """The HTTP/2 header block of a request to a pod: ``:method``, ``:scheme`` (``http``),
    ``:authority`` (the request's Host, else ``default_authority``), ``:path``, then every
    other line in its order, its name lower-cased, but those HTTP/2 forbids; then ``te:
    trailers`` always (gRPC servers require it) and ``content-length`` for a body of
    known length."""
    authority = None
    regular: list[Header] = []
    for name, value in headers:
        lower = name.lower()
        if lower == b"host":
            if authority is None:
                authority = value
        elif lower not in NOT_IN_HTTP2 and lower[:1] != b":":
            regular.append((lower, value))
    fields = [
        (b":method", method.encode("latin-1")),
        (b":scheme", b"http"),
        (b":authority", default_authority if authority is None else authority),
        (b":path", target),
        *regular,
        (b"te", b"trailers"),
    ]
    if framing is BodyFraming.LENGTH:
        fields.append((b"content-length", b"%d" % (content_length or 0)))
    return fields


def h2_trailer_fields(trailers: Sequence[Header]) -> list[Header]:
    """Request trailers as HTTP/2 sends them: names lower-cased, forbidden ones dropped."""
    return [
        (lower, value)
        for lower, value in ((name.lower(), value) for name, value in trailers)
        if lower not in NOT_IN_HTTP2 and lower[:1] != b":"
    ]


def _standard_phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode("latin-1")
    except ValueError:
        return b""


def status_line(status: int, reason: bytes | None = None) -> bytes:
    """``HTTP/1.1 <status> <reason>\\r\\n``; the pod's own reason phrase when given."""
    if not reason:
        reason = REASON_PHRASES.get(status) or _standard_phrase(status)
    return b"HTTP/1.1 %d %s\r\n" % (status, reason)


def own_answer_headers(error: ActivatorError, grpc: bool) -> tuple[int, list[Header], bytes]:
    """Activator's own answer for ``error``: (status, header lines, body), the one place
    it is decided; each transport spells it.

    A gRPC request (``grpc``) gets what a gRPC client understands: 200 with
    ``grpc-status`` and ``grpc-message`` (``grpc_status``) and no body (trailers-only);
    every answer carries ``X-Activator-Reason``, and ``Retry-After`` when the error has one.
    """
    reason = error.reason.encode()
    retry = [(b"retry-after", b"%d" % error.retry_after)] if error.retry_after is not None else []
    if grpc:
        message = f"{error.status} {error.reason}".encode()
        headers = [
            (b"content-type", b"application/grpc"),
            (b"grpc-status", b"%d" % grpc_status(error)),
            (b"grpc-message", message),
            (b"x-activator-reason", reason),
            *retry,
        ]
        return 200, headers, b""
    body = f"{error.status} {error.reason}\n".encode()
    headers = [
        (b"X-Activator-Reason", reason),
        *retry,
        (b"Content-Type", b"text/plain; charset=utf-8"),
        (b"Content-Length", b"%d" % len(body)),
    ]
    return error.status, headers, body


def own_answer(error: ActivatorError, close: bool, grpc: bool = False, *, head_only: bool = False) -> tuple[bytes, int]:
    """Activator's own answer for ``error`` as HTTP/1.1 bytes (``own_answer_headers``), and
    the size of its body; ``head_only``: the answer to a HEAD request (its head says the
    length of the body it does not carry)."""
    status, headers, body = own_answer_headers(error, grpc)
    if grpc:  # an HTTP/1.1 gRPC answer: the status rides in headers, the body is empty
        headers.append((b"Content-Length", b"0"))
    if close:
        headers.append((b"Connection", b"close"))
    if head_only:
        body = b""
    return b"%s%s\r\n%s" % (status_line(status), header_block(headers), body), len(body)


# -- gRPC -------------------------------------------------------------------------------------

#: Activator's own answers as gRPC status codes (grpc/doc/statuscodes.md).
GRPC_STATUS = {
    "queue-full": 8,  # RESOURCE_EXHAUSTED
    "shed": 8,
    "tenant-queue-full": 8,
    "queue-timeout": 14,  # UNAVAILABLE
    "upstream-connect": 14,
    "upstream-bad-response": 14,
    "shutting-down": 14,
    "peer-unavailable": 14,
    "too-many-connections": 14,
    "upstream-timeout": 4,  # DEADLINE_EXCEEDED
    "deadline-exceeded": 4,
    "unknown-host": 12,  # UNIMPLEMENTED
    "unsupported-method": 12,
    "body-too-large": 8,
    "headers-too-large": 8,
}
#: Any other answer, by HTTP status, as gRPC maps HTTP statuses (grpc/doc/http-grpc-status-mapping.md).
_GRPC_STATUS_OF_HTTP = {400: 13, 401: 16, 403: 7, 404: 12, 429: 14, 502: 14, 503: 14, 504: 14}
_GRPC_UNKNOWN = 2
_GRPC_TIMEOUT = re.compile(rb"([0-9]{1,8})([HMSmun])\Z")
_GRPC_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def is_grpc(content_type: bytes | None) -> bool:
    """Whether a request is gRPC: its content type is ``application/grpc`` or ``application/grpc+...``."""
    return content_type is not None and content_type[:16].lower() == b"application/grpc"


def grpc_status(error: ActivatorError) -> int:
    """The gRPC status code of one of activator's own answers."""
    known = GRPC_STATUS.get(error.reason)
    if known is not None:
        return known
    return _GRPC_STATUS_OF_HTTP.get(error.status, _GRPC_UNKNOWN)


def grpc_timeout(value: bytes | None) -> float | None:
    """Seconds of a ``grpc-timeout`` header (``"100m"``, ``"5S"``); None without a valid one."""
    if value is None:
        return None
    match = _GRPC_TIMEOUT.match(value.strip(_OPTIONAL_WHITESPACE))
    if match is None:
        return None
    return int(match.group(1)) * _GRPC_TIMEOUT_UNITS[match.group(2)]


def format_grpc_timeout(seconds: float) -> bytes:
    """A ``grpc-timeout`` value for ``seconds`` (milliseconds, at most 8 digits, at least 1)."""
    milliseconds = max(1, min(99_999_999, int(seconds * 1000)))
    return b"%dm" % milliseconds

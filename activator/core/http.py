"""HTTP/1.x decisions the parser leaves to us, as small pure functions on bytes.

llhttp (through httptools) decides the syntax of request and response heads and the
framing of bodies; it is strict (no lenient flags), so obs-fold, bare CR or LF, control
bytes, whitespace before a colon, bad or duplicate Content-Length and Content-Length with
Transfer-Encoding never get this far. What it leaves to us, decided here:

- **Versions**: HTTP/1.0 and HTTP/1.1 only (llhttp also parses 0.9 and 2.0 request lines).
- **Request targets**: origin-form (``/path?q``), and ``*`` for OPTIONS; absolute-form is
  refused (not an open proxy), CONNECT too (and its connection closed).
- **Host** (RFC 9112 3.2): an HTTP/1.1 request has exactly one Host, and it is
  ``host[:port]``: a reg-name of letters, digits, ``-._~``, an IPv4 address or a
  bracketed IPv6 literal, and an optional port of 1-5 digits. Stricter than RFC 3986 on
  purpose: no userinfo, no sub-delims (``x,y`` is what two merged Host lines look like),
  no percent-escapes. Only SP and HTAB are whitespace (llhttp trims them; a ``\\xa0`` is
  a byte of the value, so the value is invalid).
- **Body framing**: Transfer-Encoding must be exactly one ``chunked`` (any other coding
  -> 501, in HTTP/1.0 -> 400); a HEAD request or an Upgrade request carries no body;
  a declared body over ``max_body_bytes`` -> 413.
- **Which header lines travel**, in both directions: hop-by-hop headers (RFC 9110 7.6.1:
  ``Connection`` and the headers it names, ``Keep-Alive``, ``Proxy-Connection``, ``TE``,
  ``Transfer-Encoding``, ``Upgrade``; also the proxy authentication pair) stop here;
  every other line keeps its place, its spelling and its value, and repeated lines stay
  separate. Framing headers are re-derived from how the body is actually sent.
- **How a response is framed to the client** (``client_framing``): no body for HEAD,
  1xx, 204 and 304; the pod's Content-Length when it sent one; chunked to HTTP/1.1
  clients otherwise (trailers relayed); delimited by closing the connection for HTTP/1.0
  clients.

Names are compared lower-cased; values are never decoded beyond latin-1 for routing.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Sequence
from http import HTTPStatus
from typing import TypeVar

from .errors import (
    ActivatorError,
    BadHost,
    BadRequest,
    BodyTooLarge,
    ConnectRefused,
    NotOriginForm,
    UnsupportedTransferEncoding,
)

#: One header line as the parser delivered it: (name, value), both raw bytes.
Header = tuple[bytes, bytes]

_Item = TypeVar("_Item")


def add_line(lines: list[_Item] | tuple[()], item: _Item) -> list[_Item]:
    """``lines`` with ``item`` at the end. Lines most messages do not carry (Host,
    Connection, trailers, ...) start as the empty tuple: no list is made per message
    until one comes, and each one after that is appended in place."""
    if isinstance(lines, list):
        lines.append(item)
        return lines
    return [item]


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

_HOST = re.compile(rb"(?:\[([0-9A-Fa-f:.]+)\]|([A-Za-z0-9._~-]+))(?::[0-9]{1,5})?\Z")
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

#: Statuses whose responses never have a body (RFC 9110 6.4.1), besides 1xx.
BODILESS_STATUSES = frozenset((204, 304))


class BodyFraming(enum.Enum):
    """How a message body is delimited on the wire."""

    NONE = "none"  # no body at all
    LENGTH = "length"  # Content-Length
    CHUNKED = "chunked"  # Transfer-Encoding: chunked (trailers possible)
    CLOSE = "close"  # read until the connection closes (responses only)


def valid_host(value: bytes) -> bool:
    """Whether a Host value is ``host[:port]`` by the rules in the module docstring."""
    match = _HOST.match(value)
    if match is None:
        return False
    literal = match.group(1)
    if literal is not None:
        try:
            ipaddress.IPv6Address(literal.decode("ascii"))
        except ValueError:
            return False
    return True


#: Host values already found valid (bounded: they are client input).
_VALID_HOSTS: dict[bytes, str] = {}
_VALID_HOSTS_SIZE = 4096


def request_host(version: str, hosts: Sequence[bytes]) -> str:
    """The Host of a request, checked (RFC 9112 3.2); raises ``BadHost``.

    HTTP/1.0 may omit it (then ""); two lines, or an invalid value, are refused.
    """
    if len(hosts) == 1:
        host = hosts[0]
        known = _VALID_HOSTS.get(host)
        if known is not None:
            return known
        if not valid_host(host):
            raise BadHost(f"invalid Host {host[:100]!r}")
        if len(_VALID_HOSTS) >= _VALID_HOSTS_SIZE:
            _VALID_HOSTS.clear()
        text = _VALID_HOSTS[host] = host.decode("latin-1")
        return text
    if not hosts:
        if version == "1.0":
            return ""
        raise BadHost("an HTTP/1.1 request without Host")
    raise BadHost("more than one Host header")


def check_request_head(
    version: str,
    method: str,
    target: bytes,
    hosts: Sequence[bytes],
    content_length: int | None,
    transfer_encodings: Sequence[bytes],
    upgrade: bool,
    max_body_bytes: int | None,
) -> tuple[BodyFraming, str]:
    """Everything ``core.http`` decides about a head llhttp accepted: (body framing, Host).

    Raises the refusal: version, target form, body framing, then Host, in that order.
    """
    if version != "1.1":
        check_version(version)
    if target[:1] != b"/" or method == "CONNECT":
        check_target(method, target)
    if content_length is not None or transfer_encodings:
        framing = body_framing(version, method, content_length, transfer_encodings, upgrade, max_body_bytes)
    else:
        framing = BodyFraming.NONE
    return framing, request_host(version, hosts)


def check_target(method: str, target: bytes) -> None:
    """Origin-form, or ``*`` for OPTIONS; raises ``NotOriginForm`` / ``ConnectRefused``."""
    if method == "CONNECT":
        raise ConnectRefused("CONNECT is not proxied")
    if target[:1] == b"/" or (target == b"*" and method == "OPTIONS"):
        return
    raise NotOriginForm(f"request target {target[:100]!r} is not origin-form")


def check_version(version: str) -> None:
    if version != "1.1" and version != "1.0":
        raise BadRequest(f"HTTP version {version} (only 1.0 and 1.1)")


def body_framing(
    version: str,
    method: str,
    content_length: int | None,
    transfer_encodings: Sequence[bytes],
    upgrade: bool,
    max_body_bytes: int | None,
) -> BodyFraming:
    """How the request body is framed, after llhttp accepted the head; raises refusals.

    llhttp has already refused Content-Length together with Transfer-Encoding, and any
    Transfer-Encoding whose last coding is not chunked.
    """
    if transfer_encodings:
        if version == "1.0":
            raise BadRequest("Transfer-Encoding in an HTTP/1.0 request")
        check_transfer_encoding(transfer_encodings)
        framing = BodyFraming.CHUNKED
    elif content_length is not None:
        if max_body_bytes is not None and content_length > max_body_bytes:
            raise BodyTooLarge(f"Content-Length {content_length} over max_body_bytes {max_body_bytes}")
        framing = BodyFraming.LENGTH
        if not content_length:
            return framing  # "Content-Length: 0" is forwarded as it came
    else:
        return BodyFraming.NONE
    if method == "HEAD":
        raise BadRequest("a HEAD request with a body")
    if upgrade:
        raise BadRequest("an Upgrade request with a body")
    return framing


def check_transfer_encoding(values: Sequence[bytes]) -> None:
    """Exactly one Transfer-Encoding line, and it says ``chunked``; raises 501 otherwise."""
    if len(values) != 1 or values[0].lower() != b"chunked":
        shown = b", ".join(values)[:100]
        raise UnsupportedTransferEncoding(f"Transfer-Encoding {shown!r} (only chunked)")


def refusal_of_head(reason: str) -> ActivatorError:
    """What to answer when llhttp refused a request head, from its reason text.

    llhttp names the header it refused only in that text. A Transfer-Encoding it refused
    (a coding after chunked, a repeated line, a coding that is not chunked) is an
    unsupported coding (501), unless the refusal is its conflict with Content-Length (a
    framing conflict, 400); any other refusal is a malformed head (400).
    """
    if "Transfer-Encoding" in reason and "Content-Length" not in reason:
        return UnsupportedTransferEncoding(f"Transfer-Encoding refused: {reason}")
    return BadRequest(f"malformed request head: {reason}")


_NO_TOKENS: frozenset[bytes] = frozenset()
#: One Connection line's value -> its options (bounded: they are peer input).
_TOKENS_OF: dict[bytes, frozenset[bytes]] = {}
_TOKENS_OF_SIZE = 256


def connection_tokens(values: Sequence[bytes]) -> frozenset[bytes]:
    """The lower-cased options of ``Connection`` lines (``close``, ``upgrade``, names)."""
    if not values:
        return _NO_TOKENS
    if len(values) == 1:
        known = _TOKENS_OF.get(values[0])
        if known is not None:
            return known
    tokens: set[bytes] = set()
    for value in values:
        for token in value.split(b","):
            token = token.strip(_OPTIONAL_WHITESPACE).lower()
            if token:
                tokens.add(token)
    result = frozenset(tokens)
    if len(values) == 1:
        if len(_TOKENS_OF) >= _TOKENS_OF_SIZE:
            _TOKENS_OF.clear()
        _TOKENS_OF[values[0]] = result
    return result


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


def client_framing(
    method: str, status: int, pod_framing: BodyFraming, client_version: str, tunnel: bool = False
) -> BodyFraming:
    """How a pod's response is framed to the client (see the module docstring)."""
    if pod_framing is BodyFraming.LENGTH:
        return BodyFraming.NONE if method == "HEAD" or status == 304 or tunnel else BodyFraming.LENGTH
    if pod_framing is BodyFraming.NONE or method == "HEAD" or status < 200 or status in BODILESS_STATUSES or tunnel:
        return BodyFraming.NONE
    # HTTP/1.0 has no chunks: the end is the connection's. HTTP/2 frames as CHUNKED does
    # (DATA frames, then trailers).
    return BodyFraming.CLOSE if client_version == "1.0" else BodyFraming.CHUNKED


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


def own_answer(error: ActivatorError, close: bool, grpc: bool = False) -> bytes:
    """Activator's own answer for ``error`` as HTTP/1.1 bytes (``own_answer_headers``)."""
    status, headers, body = own_answer_headers(error, grpc)
    if grpc:  # an HTTP/1.1 gRPC answer: the status rides in headers, the body is empty
        headers.append((b"Content-Length", b"0"))
    if close:
        headers.append((b"Connection", b"close"))
    return b"%s%s\r\n%s" % (status_line(status), header_block(headers), body)


# -- gRPC -------------------------------------------------------------------------------------

#: Activator's own answers as gRPC status codes (grpc/doc/statuscodes.md).
GRPC_STATUS = {
    "queue-full": 8,  # RESOURCE_EXHAUSTED
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

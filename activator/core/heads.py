"""Message heads as values, whatever the transport, and the decisions taken on them.

A request head (``RequestHead``) and a pod's response head (``ResponseHead``) are filled
by either transport: HTTP/1.x from llhttp's callbacks, each header line appended and the
ones activator looks at noted (``note``, for the names in ``NOTED``); HTTP/2 from one
header block (``RequestHead.from_h2``, ``ResponseHead.fill_from_h2``), its pseudo-headers
mapped onto the same fields (``:method``, ``:path``, ``:authority`` as a Host).
Everything after that is decided here once, for every transport:

- **Field values** (RFC 9110 5.5): leading and trailing SP and HTAB
  (``WHITESPACE``) are not part of a value. llhttp trims the leading ones and
  keeps the trailing ones, which the HTTP/1.x transport trims before it appends a line,
  so ``Transfer-Encoding: chunked `` is chunked and ``Host: a.example `` is ``a.example``
  (and they travel trimmed). HTTP/2 forbids them (RFC 9113 8.2.1): such a field makes the
  stream malformed.
- **HTTP/2 fields** (RFC 9113 8.2 and 8.3; ``h2`` runs with its own header validation
  off, so this is the one check): names are lower-case tokens, values carry no NUL, CR or
  LF, connection-specific fields (``connection``, ``keep-alive``, ``proxy-connection``,
  ``transfer-encoding``, ``upgrade``) and a ``te`` other than ``trailers`` are
  forbidden, pseudo-headers come first, once each, only the request ones, with
  ``:method``, ``:scheme`` and a non-empty ``:path`` present. A request that breaks one
  of these is malformed (``MalformedMessage``): the stream is reset (PROTOCOL_ERROR), the
  connection goes on. Trailers carry no pseudo-header.
- **The request check** (``check_request_head``), in this order: the version (HTTP/1.0,
  1.1, or 2), the method (any token: RFC 9110 9.1; CONNECT is refused, not proxied), the
  target (origin-form, or ``*`` for OPTIONS; absolute-form refused: not an open proxy;
  an HTTP/2 target must also fit an HTTP/1.1 request line: visible ASCII), the body
  framing (one ``Transfer-Encoding: chunked`` in HTTP/1.1, else 501; none in HTTP/1.0;
  a declared length over ``max_body_bytes`` is 413; a HEAD request has no body), the
  Host (RFC 9112 3.2, below; an HTTP/2 ``:authority`` is its Host, and a ``host`` field
  beside it must agree) and last the Upgrade: an HTTP/1.1 request asks for a tunnel when
  it has ``Upgrade`` and ``Connection: upgrade``, carries no body and does not ask for
  ``h2c`` (deprecated, RFC 9113 3.1: activator declines it and serves the request as an
  HTTP/1.1 one, as HAProxy and nginx do); any other Upgrade request is served as a plain
  request, its Upgrade dropped as hop-by-hop.
- **Host values** (RFC 9112 3.2): exactly one, ``host[:port]``: a reg-name of letters,
  digits, ``-._~``, an IPv4 address or a bracketed IPv6 literal, and a port of 1-5
  digits. Stricter than RFC 3986 on purpose: no userinfo, no sub-delims (``x,y`` is what
  two merged Host lines look like), no percent-escapes. HTTP/1.0 may omit it.
- **A pod's response framing** (``response_framing``, as h11's ``_body_framing``): no
  body for HEAD, 1xx, 101, 204 and 304 and a ``Content-Length: 0``; chunked; a length;
  else an HTTP/1.1 body runs to the connection's end and an HTTP/2 one to END_STREAM.
- **The framing towards the client** (``client_framing``): no body for HEAD, 1xx, 204
  and 304; a length when there is one; chunked for HTTP/1.1 (trailers relayed) and
  HTTP/2 (DATA frames, then trailers) otherwise; the connection's end for HTTP/1.0.

Names are compared lower-cased; values are never decoded beyond latin-1 for routing.
Nothing here does I/O or keeps state between messages beyond bounded caches of values
already found valid.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Sequence
from typing import TypeVar

from .errors import (
    ActivatorError,
    BadHost,
    BadRequest,
    BodyTooLarge,
    ConnectRefused,
    HeadersTooLarge,
    MalformedMessage,
    NotOriginForm,
    UnsupportedTransferEncoding,
)

#: One header line as the parser delivered it: (name, value), both raw bytes.
Header = tuple[bytes, bytes]

_Item = TypeVar("_Item")

#: RFC 9113 6.5.2: what a field costs in a header list, beyond its name and value.
FIELD_OVERHEAD = 32


def add_line(lines: list[_Item] | tuple[()], item: _Item) -> list[_Item]:
    """``lines`` with ``item`` at the end. Lines most messages do not carry (Host,
    Connection, trailers, ...) start as the empty tuple: no list is made per message
    until one comes, and each one after that is appended in place."""
    if isinstance(lines, list):
        lines.append(item)
        return lines
    return [item]


class BodyFraming(enum.Enum):
    """How a message body is delimited on the wire."""

    NONE = "none"  # no body at all
    LENGTH = "length"  # Content-Length
    CHUNKED = "chunked"  # Transfer-Encoding: chunked, or HTTP/2 DATA frames (trailers possible)
    CLOSE = "close"  # read until the connection closes (HTTP/1.x responses only)


#: Statuses whose responses never have a body (RFC 9110 6.4.1), besides 1xx.
BODILESS_STATUSES = frozenset((204, 304))

#: What a field value may begin or end with that is not part of it (RFC 9110 5.5).
#: ``value.rstrip(WHITESPACE)`` is also the cheapest test for it CPython has: it returns
#: ``value`` itself when there is nothing to strip.
WHITESPACE = b" \t"
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
#: An HTTP/2 field name: a token without upper-case letters (RFC 9113 8.2.1).
_H2_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-z]+\Z")
#: What an HTTP/2 field value may not hold: NUL, CR, LF, and whitespace at either end.
_H2_BAD_VALUE = re.compile(rb"[\x00\r\n]|\A[ \t]|[ \t]\Z")
#: A request target that can travel in an HTTP/1.1 request line: visible ASCII only.
_TARGET_BYTES = re.compile(rb"[\x21-\x7e]+\Z")
_HOST = re.compile(rb"(?:\[([0-9A-Fa-f:.]+)\]|([A-Za-z0-9._~-]+))(?::[0-9]{1,5})?\Z")

#: Header fields HTTP/2 forbids in a request (RFC 9113 8.2.2); ``te`` is checked apart.
H2_CONNECTION_SPECIFIC = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")
)
_REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":authority", b":path", b":protocol"))

# The request fields a head notes as they come (lower-cased names).
_F_HOST = b"host"
_F_CONTENT_LENGTH = b"content-length"
_F_TRANSFER_ENCODING = b"transfer-encoding"
_F_CONNECTION = b"connection"
_F_EXPECT = b"expect"
_F_UPGRADE = b"upgrade"
_F_FORWARDED = b"x-activator-forwarded"
_F_CONTENT_TYPE = b"content-type"
_F_GRPC_TIMEOUT = b"grpc-timeout"
_F_TE = b"te"
#: The request fields a head notes as they come (``RequestHead.note``).
NOTED = frozenset(
    (
        _F_HOST,
        _F_CONTENT_LENGTH,
        _F_TRANSFER_ENCODING,
        _F_CONNECTION,
        _F_EXPECT,
        _F_UPGRADE,
        _F_FORWARDED,
        _F_CONTENT_TYPE,
        _F_GRPC_TIMEOUT,
    )
)


class RequestHead:
    """A request head as its transport delivered it, and what ``check_request_head``
    decided about it (``host``, ``framing``, ``upgrade``).

    ``headers`` holds every regular field in order, as it came (an HTTP/2 ``:authority``
    becomes a ``host`` line first when the request carries none, RFC 9113 8.3.1, for a
    pod spoken to in HTTP/1.1); ``lower_names`` their lower-cased names alongside. The
    fields activator looks at are noted as they are added. Lines few requests carry stay
    empty tuples until one comes (``add_line``).
    """

    __slots__ = (
        "method",
        "target",
        "version",
        "headers",
        "lower_names",
        "hosts",
        "content_length",
        "transfer_encodings",
        "connection_values",
        "expect_continue",
        "upgrade_value",
        "forwarded",
        "content_type",
        "grpc_timeout",
        "keep_alive",
        "ended",
        "malformed",
        "list_size",
        "host",
        "framing",
        "upgrade",
    )

    def __init__(self, version: str = "1.1") -> None:
        self.method = ""
        self.target = b""
        self.version = version
        self.headers: list[Header] = []
        self.lower_names: list[bytes] = []
        self.hosts: list[bytes] | tuple[()] = ()
        self.content_length: int | None = None
        self.transfer_encodings: list[bytes] | tuple[()] = ()
        self.connection_values: list[bytes] | tuple[()] = ()
        self.expect_continue = False
        self.upgrade_value: bytes | None = None
        #: ``X-Activator-Forwarded`` lines (the hops between activators), in order.
        self.forwarded: list[bytes] | tuple[()] = ()
        self.content_type: bytes | None = None
        self.grpc_timeout: bytes | None = None
        #: The client wants the connection kept after this exchange (llhttp's reading).
        self.keep_alive = True
        #: HTTP/2: the header block ended the stream (no body).
        self.ended = False
        #: HTTP/2: why the header block is malformed (RFC 9113 8.1.1), else None.
        self.malformed: str | None = None
        #: HTTP/2: the header block's size as SETTINGS_MAX_HEADER_LIST_SIZE counts it.
        self.list_size = 0
        # Decided by ``check_request_head``:
        self.host = ""
        self.framing = BodyFraming.NONE
        self.upgrade = False

    def __repr__(self) -> str:
        return f"<RequestHead {self.method} {self.target[:60]!r} HTTP/{self.version}>"

    def note(self, lower: bytes, value: bytes) -> None:
        """A field activator looks at (``lower``, its lower-cased name, is in ``NOTED``),
        as the transport adds it to ``headers``."""
        if lower == _F_HOST:
            self.hosts = add_line(self.hosts, value)
        elif lower == _F_CONTENT_LENGTH:
            if self.content_length is None:
                # llhttp (HTTP/1.x) and h2 (HTTP/2) have checked its digits and that repeats agree.
                self.content_length = int(value)
        elif lower == _F_TRANSFER_ENCODING:
            self.transfer_encodings = add_line(self.transfer_encodings, value)
        elif lower == _F_CONNECTION:
            self.connection_values = add_line(self.connection_values, value)
        elif lower == _F_EXPECT:
            self.expect_continue = value.lower() == b"100-continue"
        elif lower == _F_UPGRADE:
            self.upgrade_value = value
        elif lower == _F_FORWARDED:
            self.forwarded = add_line(self.forwarded, value)
        elif lower == _F_CONTENT_TYPE:
            self.content_type = value
        else:
            self.grpc_timeout = value

    @classmethod
    def from_h2(cls, pairs: Sequence[Header], ended: bool) -> RequestHead:
        """A request head from an HTTP/2 header block (``h2`` has decoded it, nothing
        more); ``malformed`` says why it breaks RFC 9113 8.2-8.3, if it does."""
        head = cls("2")
        head.ended = ended
        headers = head.headers
        lower_names = head.lower_names
        pseudo: dict[bytes, bytes] = {}
        malformed = None
        size = 0
        for name, value in pairs:
            size += len(name) + len(value)
            if name[:1] == b":":
                if headers or name in pseudo or name not in _REQUEST_PSEUDO:
                    malformed = f"pseudo-header {name[:40]!r} out of place, repeated or unknown"
                else:
                    pseudo[name] = value
                continue
            if name not in _VALID_H2_NAMES or _H2_BAD_VALUE.search(value) is not None:
                wrong = h2_field_malformed(name, value)
                if wrong is not None:
                    malformed = wrong
                    continue
            if name in _H2_SPECIAL:
                if name in H2_CONNECTION_SPECIFIC or (name == _F_TE and value != b"trailers"):
                    malformed = f"connection-specific field {name!r}"
                    continue
                if name in NOTED:
                    head.note(name, value)
            headers.append((name, value))
            lower_names.append(name)
        head.list_size = size + FIELD_OVERHEAD * len(pairs)
        head.method = method_name(pseudo.get(b":method", b""))
        head.target = pseudo.get(b":path", b"")
        if head.method != "CONNECT" and not (head.method and b":scheme" in pseudo and head.target):
            malformed = malformed or "a request without :method, :scheme or :path"
        head.malformed = malformed
        authority = pseudo.get(b":authority")
        if authority is not None:
            if any(host != authority for host in head.hosts):
                head.hosts = [authority, *head.hosts]  # two that disagree: the check refuses them
            else:
                if not head.hosts:
                    # RFC 9113 8.3.1: a request going on in HTTP/1.1 carries its authority as Host.
                    head.headers.insert(0, (_F_HOST, authority))
                    head.lower_names.insert(0, _F_HOST)
                head.hosts = [authority]
        return head


def h2_field_malformed(name: bytes, value: bytes) -> str | None:
    """Why a regular HTTP/2 field breaks RFC 9113 8.2.1, or None."""
    if name not in _VALID_H2_NAMES:
        if _H2_NAME.match(name) is None:
            return f"field name {name[:40]!r} is not a lower-case token"
        if len(_VALID_H2_NAMES) >= _VALID_SIZE:
            _VALID_H2_NAMES.clear()
        _VALID_H2_NAMES.add(name)
    if _H2_BAD_VALUE.search(value) is not None:
        return f"field {name[:40]!r}: a value with NUL, CR, LF or surrounding whitespace"
    return None


#: HTTP/2 field names already found valid, and methods as str (bounded: client input).
_VALID_H2_NAMES: set[bytes] = set()
_METHODS: dict[bytes, str] = {}
_VALID_SIZE = 4096


def method_name(token: bytes) -> str:
    """A method as the client spelled it, as str (from a bounded cache: methods repeat)."""
    name = _METHODS.get(token)
    if name is None:
        if len(_METHODS) >= _VALID_SIZE:
            _METHODS.clear()
        name = _METHODS[token] = token.decode("latin-1")
    return name


#: The HTTP/2 fields ``from_h2`` looks at beyond their syntax.
_H2_SPECIAL = H2_CONNECTION_SPECIFIC | {_F_TE} | NOTED


def trailer_fields_malformed(pairs: Sequence[Header]) -> str | None:
    """Why an HTTP/2 trailer block breaks RFC 9113 8.1 and 8.2, or None."""
    for name, value in pairs:
        if name[:1] == b":":
            return "a pseudo-header in trailers"
        wrong = h2_field_malformed(name, value)
        if wrong is not None:
            return wrong
    return None


# -- the request check -----------------------------------------------------------------


def check_request_head(
    head: RequestHead, max_body_bytes: int | None, list_size: int = 0, max_header_bytes: int = 0
) -> None:
    """Decide ``head.framing``, ``head.host`` and ``head.upgrade``, or raise the refusal.

    Raises, in this order: ``MalformedMessage`` (HTTP/2), a header list over
    ``max_header_bytes`` (HTTP/2: ``list_size`` as SETTINGS_MAX_HEADER_LIST_SIZE counts
    it; HTTP/1.x checks its section as it is parsed), the version, the method, the
    target, the body framing, the Host. See the module docstring.
    """
    version = head.version
    method = head.method
    target = head.target
    if version != "1.1":  # HTTP/1.1 heads are never malformed nor counted as a list
        if head.malformed is not None:
            raise MalformedMessage(head.malformed)
        if list_size > max_header_bytes:
            raise HeadersTooLarge(f"header list of {list_size} bytes over {max_header_bytes}")
        check_version(version)
    if method not in _COMMON_METHODS:
        check_method(method)
    if target[:1] != b"/":
        check_target(method, target)
    if version == "2" and _TARGET_BYTES.match(target) is None:
        raise BadRequest(f"request target {target[:100]!r} has bytes an HTTP/1.1 request line cannot carry")
    if head.content_length is not None or head.transfer_encodings or version == "2":
        head.framing = request_framing(head, max_body_bytes)
    head.host = request_host(version, head.hosts)
    if head.upgrade_value is not None and version == "1.1":
        head.upgrade = wants_tunnel(head)


_COMMON_METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"))


def check_version(version: str) -> None:
    if version != "1.1" and version != "1.0" and version != "2":
        raise BadRequest(f"HTTP version {version} (only 1.0, 1.1 and 2)")


def check_method(method: str) -> None:
    """Any token is a method (RFC 9110 9.1) but CONNECT, which is refused."""
    if _TOKEN.match(method.encode("latin-1")) is None:
        raise BadRequest(f"method {method[:40]!r} is not a token")
    if method == "CONNECT":
        raise ConnectRefused("CONNECT is not proxied")


def check_target(method: str, target: bytes) -> None:
    """Origin-form, or ``*`` for OPTIONS; raises ``NotOriginForm``."""
    if target[:1] == b"/" or (target == b"*" and method == "OPTIONS"):
        return
    raise NotOriginForm(f"request target {target[:100]!r} is not origin-form")


def request_framing(head: RequestHead, max_body_bytes: int | None) -> BodyFraming:
    """How the request body arrives; raises its refusals (see the module docstring).

    HTTP/1.x: llhttp has already refused Content-Length together with Transfer-Encoding,
    and any Transfer-Encoding whose last coding is not chunked. HTTP/2: the stream ended
    with its head, or DATA frames of a declared length or not.
    """
    content_length = head.content_length
    if head.version == "2":
        if head.ended:
            return BodyFraming.NONE
        framing = BodyFraming.CHUNKED if content_length is None else BodyFraming.LENGTH
    elif head.transfer_encodings:
        if head.version == "1.0":
            raise BadRequest("Transfer-Encoding in an HTTP/1.0 request")
        check_transfer_encoding(head.transfer_encodings)
        framing = BodyFraming.CHUNKED
    elif content_length is not None:
        framing = BodyFraming.LENGTH
        if not content_length:
            return framing  # "Content-Length: 0" is forwarded as it came
    else:
        return BodyFraming.NONE
    if content_length is not None and max_body_bytes is not None and content_length > max_body_bytes:
        raise BodyTooLarge(f"Content-Length {content_length} over max_body_bytes {max_body_bytes}")
    if head.method == "HEAD" and head.version != "2":
        raise BadRequest("a HEAD request with a body")
    return framing


def check_transfer_encoding(values: Sequence[bytes]) -> None:
    """Exactly one Transfer-Encoding line, and it says ``chunked``; raises 501 otherwise."""
    if len(values) != 1 or values[0].lower() != b"chunked":
        shown = b", ".join(values)[:100]
        raise UnsupportedTransferEncoding(f"Transfer-Encoding {shown!r} (only chunked)")


def wants_tunnel(head: RequestHead) -> bool:
    """Whether an HTTP/1.1 request with an Upgrade field becomes a tunnel if the pod
    answers 101: ``Connection: upgrade``, no body, and not ``h2c`` (declined)."""
    if head.framing is not BodyFraming.NONE or head.method == "CONNECT":
        return False
    if b"upgrade" not in connection_tokens(head.connection_values):
        return False
    value = head.upgrade_value or b""
    return b"h2c" not in {token.strip(WHITESPACE).lower() for token in value.split(b",")}


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
        raise BadHost("a request without Host" if version == "2" else "an HTTP/1.1 request without Host")
    raise BadHost("more than one Host header" if version != "2" else ":authority and a host that disagree")


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
            token = token.strip(WHITESPACE).lower()
            if token:
                tokens.add(token)
    result = frozenset(tokens)
    if len(values) == 1:
        if len(_TOKENS_OF) >= _TOKENS_OF_SIZE:
            _TOKENS_OF.clear()
        _TOKENS_OF[values[0]] = result
    return result


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


# -- the response --------------------------------------------------------------------------


class ResponseHead:
    """A pod's final response head, whatever the transport that carried it.

    Filled by the pod client: HTTP/1.1 from llhttp's callbacks (each line appended, the
    ones in ``RESPONSE_NOTED`` noted), HTTP/2 from the ``:status`` and fields of a
    HEADERS frame (``fill_from_h2``). ``reason`` is
    empty in HTTP/2 (it has none).
    """

    __slots__ = ("status", "reason", "headers", "lower_names", "connection_values", "content_length", "chunked")

    def __init__(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[Header] = []
        self.lower_names: list[bytes] = []
        # Lines few responses carry: no list until one comes (``add_line``).
        self.connection_values: list[bytes] | tuple[()] = ()
        self.content_length: int | None = None
        #: The body is chunked (HTTP/1.1: the last transfer coding says so); None while
        #: no Transfer-Encoding line came (False: one came, and it is not chunked).
        self.chunked: bool | None = None

    def note(self, lower: bytes, value: bytes) -> None:
        """A field activator looks at (``lower`` is in ``RESPONSE_NOTED``), as the pod
        client adds it to ``headers``."""
        if lower == _F_CONTENT_LENGTH:
            if self.content_length is None:
                self.content_length = int(value)  # llhttp / h2 have checked it
        elif lower == _F_CONNECTION:
            self.connection_values = add_line(self.connection_values, value)
        else:
            # llhttp reads a coding list not ending in chunked as "until close"; the pod
            # client refuses codings other than chunked.
            self.chunked = value.rsplit(b",", 1)[-1].strip(WHITESPACE).lower() == b"chunked"

    def fill_from_h2(self, status: int, fields: Sequence[Header]) -> None:
        """The final head of an HTTP/2 stream: ``fields`` without the pseudo-headers."""
        self.status = status
        self.headers = list(fields)
        self.lower_names = [name for name, _ in fields]
        for name, value in fields:
            if name in RESPONSE_NOTED:
                self.note(name, value)


#: The response fields a head notes (``ResponseHead.note``).
RESPONSE_NOTED = frozenset((_F_CONTENT_LENGTH, _F_CONNECTION, _F_TRANSFER_ENCODING))


def response_framing(method: str, head: ResponseHead, *, http2: bool, ended: bool = False) -> BodyFraming:
    """How a pod's response body is delimited (see the module docstring).

    ``ended``: an HTTP/2 HEADERS frame that also ended the stream (a gRPC
    trailers-only answer).
    """
    status = head.status
    if ended or method == "HEAD" or status < 200 or status in BODILESS_STATUSES:
        return BodyFraming.NONE
    if head.chunked:
        return BodyFraming.CHUNKED
    length = head.content_length
    if length is not None:
        return BodyFraming.LENGTH if length else BodyFraming.NONE
    return BodyFraming.CHUNKED if http2 else BodyFraming.CLOSE


def client_framing(method: str, status: int, pod_framing: BodyFraming, client_version: str) -> BodyFraming:
    """How a response is framed to the client (see the module docstring); ``pod_framing``
    is how its body comes (a pod's ``response_framing``, or LENGTH / CHUNKED for an
    application's answer of known or unknown length)."""
    if pod_framing is BodyFraming.NONE or method == "HEAD" or status < 200 or status in BODILESS_STATUSES:
        return BodyFraming.NONE
    if pod_framing is BodyFraming.LENGTH:
        return BodyFraming.LENGTH
    # HTTP/1.0 has no chunks: the end is the connection's. HTTP/2 frames as CHUNKED does
    # (DATA frames, then trailers).
    return BodyFraming.CLOSE if client_version == "1.0" else BodyFraming.CHUNKED

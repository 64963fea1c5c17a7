"""The one HTTP model (``core.heads``): every rule a row, for HTTP/1.x and HTTP/2 alike.

Request heads as either transport fills them (lines appended and noted as llhttp's
callbacks do; an HTTP/2 header block, ``RequestHead.from_h2``), the one request check, the HTTP/2
field rules (RFC 9113 8.2-8.3), the framing of a pod's response and of the answer to the
client, and the lines most messages do not carry (``add_line``: no list until one comes,
grown in place after that, so that thousands of such lines cost linear time). The
end-to-end conformance tier (``tests/conformance``) checks the same rules through real
sockets; these run in milliseconds.
"""

import pytest

from activator.core.errors import (
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
from activator.core.heads import (
    NOTED,
    BodyFraming,
    RequestHead,
    ResponseHead,
    add_line,
    check_request_head,
    client_framing,
    connection_tokens,
    refusal_of_head,
    response_framing,
    trailer_fields_malformed,
)


def test_the_first_line_makes_a_list_and_the_empty_tuple_stays_empty() -> None:
    none: tuple[()] = ()
    lines = add_line(none, b"a.example")
    assert lines == [b"a.example"]
    assert none == ()


def test_later_lines_are_appended_in_place_in_their_order() -> None:
    lines = add_line((), (b"X-One", b"1"))
    grown = lines
    for index in range(2, 1001):
        grown = add_line(grown, (b"X-More", b"%d" % index))
        assert grown is lines, "a new list per line: quadratic in the number of lines"
    assert lines[0] == (b"X-One", b"1")
    assert [value for _, value in lines[1:]] == [b"%d" % index for index in range(2, 1001)]


# -- the request head -----------------------------------------------------------------------

_REFUSALS = (
    BadHost,
    BadRequest,
    BodyTooLarge,
    ConnectRefused,
    HeadersTooLarge,
    MalformedMessage,
    NotOriginForm,
    UnsupportedTransferEncoding,
)


def h1(method: str = "GET", target: bytes = b"/", version: str = "1.1", *fields: tuple[bytes, bytes]) -> RequestHead:
    """An HTTP/1.x head as the transport fills it from llhttp's callbacks (its trailing
    whitespace trimmed: that is the transport's, see ``test_request_table``); Host first
    unless ``fields`` has one."""
    head = RequestHead(version)
    head.method, head.target = method, target
    if not any(name.lower() == b"host" for name, _ in fields) and version == "1.1":
        fields = ((b"Host", b"a.example"), *fields)
    for name, value in fields:
        value = value.rstrip(b" \t")
        lower = name.lower()
        head.headers.append((name, value))
        head.lower_names.append(lower)
        if lower in NOTED:
            head.note(lower, value)
    return head


def without_host() -> RequestHead:
    head = RequestHead("1.1")
    head.method, head.target = "GET", b"/"
    return head


def h2(*fields: tuple[bytes, bytes], ended: bool = True) -> RequestHead:
    base = [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/"), (b":authority", b"a.example")]
    given = {name for name, _ in fields if name[:1] == b":"}
    return RequestHead.from_h2([*(f for f in base if f[0] not in given), *fields], ended)


def verdict(head: RequestHead, max_body_bytes: int | None = 1000) -> str:
    try:
        check_request_head(head, max_body_bytes)
    except ActivatorError as error:
        return type(error).__name__
    return "ok"


def test_http1_fields_activator_looks_at_are_noted_as_they_come() -> None:
    head = h1(
        "POST",
        b"/",
        "1.1",
        (b"Host", b"a.example "),
        (b"Content-Length", b"5"),
        (b"Connection", b"keep-alive, Upgrade"),
        (b"Expect", b"100-Continue "),
        (b"Upgrade", b"websocket"),
        (b"X-Activator-Forwarded", b"peer a"),
        (b"X-Activator-Forwarded", b"peer b"),
        (b"Content-Type", b"application/grpc"),
        (b"grpc-timeout", b"5S"),
    )
    assert head.hosts == [b"a.example"]
    assert head.content_length == 5
    assert head.connection_values == [b"keep-alive, Upgrade"]
    assert head.expect_continue
    assert head.upgrade_value == b"websocket"
    assert head.forwarded == [b"peer a", b"peer b"]
    assert (head.content_type, head.grpc_timeout) == (b"application/grpc", b"5S")
    assert head.lower_names[:3] == [b"host", b"content-length", b"connection"]


REQUEST_CHECKS = [
    # version
    ("HTTP/1.1", h1(), "ok"),
    ("HTTP/1.0 without Host", h1("GET", b"/", "1.0"), "ok"),
    ("HTTP/0.9", h1("GET", b"/", "0.9"), "BadRequest"),
    ("HTTP/2.0 in a request line", h1("GET", b"/", "2.0"), "BadRequest"),
    ("HTTP/2", h2(), "ok"),
    # method: any token (RFC 9110 9.1)
    *((f"method {m}", h1(m), "ok") for m in ("BAN", "FOO", "X-CUSTOM", "MKCOLA", "PURGE", "get", "M-SEARCH")),
    *((f"HTTP/2 method {m}", h2((b":method", m.encode())), "ok") for m in ("BAN", "MKCOLA")),
    ("method not a token", h1("GE(T"), "BadRequest"),
    ("HTTP/2 method not a token", h2((b":method", b"GE T")), "BadRequest"),
    ("CONNECT", h1("CONNECT", b"a.example:443"), "ConnectRefused"),
    ("HTTP/2 CONNECT", RequestHead.from_h2([(b":method", b"CONNECT"), (b":authority", b"a:443")], True),
     "ConnectRefused"),
    # target
    ("origin-form", h1("GET", b"/a?b=c"), "ok"),
    ("OPTIONS *", h1("OPTIONS", b"*"), "ok"),
    ("GET *", h1("GET", b"*"), "NotOriginForm"),
    ("absolute-form", h1("GET", b"http://a.example/"), "NotOriginForm"),
    ("HTTP/2 absolute-form", h2((b":path", b"http://a.example/")), "NotOriginForm"),
    ("HTTP/2 target with a space", h2((b":path", b"/a b")), "BadRequest"),
    ("HTTP/2 target with non-ASCII", h2((b":path", b"/caf\xc3\xa9")), "BadRequest"),
    # body framing
    ("chunked", h1("POST", b"/", "1.1", (b"Transfer-Encoding", b"chunked")), "ok"),
    ("chunked with a trailing space", h1("POST", b"/", "1.1", (b"Transfer-Encoding", b"chunked ")), "ok"),
    ("Chunked in capitals", h1("POST", b"/", "1.1", (b"Transfer-Encoding", b"Chunked")), "ok"),
    ("gzip, chunked", h1("POST", b"/", "1.1", (b"Transfer-Encoding", b"gzip, chunked")), "UnsupportedTransferEncoding"),
    ("two Transfer-Encoding lines", h1("POST", b"/", "1.1", (b"Transfer-Encoding", b"chunked"),
     (b"Transfer-Encoding", b"chunked")), "UnsupportedTransferEncoding"),
    ("Transfer-Encoding in HTTP/1.0", h1("POST", b"/", "1.0", (b"Transfer-Encoding", b"chunked")), "BadRequest"),
    ("Content-Length", h1("POST", b"/", "1.1", (b"Content-Length", b"5")), "ok"),
    ("Content-Length over max_body_bytes", h1("POST", b"/", "1.1", (b"Content-Length", b"1001")), "BodyTooLarge"),
    ("HTTP/2 content-length over max_body_bytes", h2((b"content-length", b"1001"), ended=False), "BodyTooLarge"),
    ("HEAD with a body", h1("HEAD", b"/", "1.1", (b"Content-Length", b"5")), "BadRequest"),
    ("HEAD with Content-Length: 0", h1("HEAD", b"/", "1.1", (b"Content-Length", b"0")), "ok"),
    # Host
    ("Host with a trailing space", h1("GET", b"/", "1.1", (b"Host", b"a.example ")), "ok"),
    ("HTTP/1.1 without Host", without_host(), "BadHost"),
    ("two Host lines", h1("GET", b"/", "1.1", (b"Host", b"a.example"), (b"Host", b"a.example")), "BadHost"),
    *(
        (f"Host {value!r}", h1("GET", b"/", "1.1", (b"Host", value)), "ok" if ok else "BadHost")
        for value, ok in (
            (b"a.example:8080", True),
            (b"10.0.0.1", True),
            (b"[::1]:80", True),
            (b"[::g]", False),
            (b"user@a.example", False),
            (b"a.example,b.example", False),
            (b"a.example:80:80", False),
            (b"a%2eexample", False),
            (b"a.example:123456", False),
            (b"\xa0a.example", False),
        )
    ),
    ("HTTP/2 without :authority or host", RequestHead.from_h2(
        [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/")], True), "BadHost"),
    ("HTTP/2 host without :authority", RequestHead.from_h2(
        [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/"), (b"host", b"a.example")], True), "ok"),
    ("HTTP/2 :authority and a host that agree", h2((b"host", b"a.example")), "ok"),
    ("HTTP/2 :authority and a host that disagree", h2((b"host", b"b.example")), "BadHost"),
    # HTTP/2 fields (RFC 9113 8.2-8.3): malformed
    *(
        (f"HTTP/2 {name}", h2(*fields), "MalformedMessage")
        for name, fields in (
            ("upper-case name", [(b"X-Upper", b"1")]),
            ("name not a token", [(b"x(y", b"1")]),
            ("value with a trailing space", [(b"x-a", b"1 ")]),
            ("value with a leading tab", [(b"x-a", b"\t1")]),
            ("value with a NUL", [(b"x-a", b"a\x00b")]),
            ("value with a LF", [(b"x-a", b"a\nb")]),
            *((f"connection-specific {n.decode()}", [(n, b"x")]) for n in (
                b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")),
            ("te: gzip", [(b"te", b"gzip")]),
            ("response pseudo-header", [(b":status", b"200")]),
            ("unknown pseudo-header", [(b":foo", b"1")]),
            ("empty :path", [(b":path", b"")]),
        )
    ),
    ("HTTP/2 te: trailers", h2((b"te", b"trailers")), "ok"),
    ("HTTP/2 repeated :method", RequestHead.from_h2(
        [(b":method", b"GET"), (b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/"),
         (b":authority", b"a.example")], True), "MalformedMessage"),
    ("HTTP/2 pseudo-header after a regular one", RequestHead.from_h2(
        [(b":method", b"GET"), (b":scheme", b"https"), (b"x-a", b"1"), (b":path", b"/"),
         (b":authority", b"a.example")], True), "MalformedMessage"),
    ("HTTP/2 without :scheme", RequestHead.from_h2(
        [(b":method", b"GET"), (b":path", b"/"), (b":authority", b"a.example")], True), "MalformedMessage"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "head", "expected"), REQUEST_CHECKS, ids=[row[0] for row in REQUEST_CHECKS])
def test_request_check(name: str, head: RequestHead, expected: str) -> None:
    assert verdict(head) == expected


def test_the_refusals_are_the_errors_named() -> None:
    names = {row[2] for row in REQUEST_CHECKS} - {"ok"}
    assert names <= {cls.__name__ for cls in _REFUSALS}


@pytest.mark.parametrize(
    ("head", "framing"),
    [
        (h1(), BodyFraming.NONE),
        (h1("POST", b"/", "1.1", (b"Content-Length", b"5")), BodyFraming.LENGTH),
        (h1("POST", b"/", "1.1", (b"Content-Length", b"0")), BodyFraming.LENGTH),
        (h1("POST", b"/", "1.1", (b"Transfer-Encoding", b"chunked")), BodyFraming.CHUNKED),
        (h2(), BodyFraming.NONE),
        (h2(ended=False), BodyFraming.CHUNKED),
        (h2((b"content-length", b"5"), ended=False), BodyFraming.LENGTH),
    ],
    ids=["no body", "length", "length 0", "chunked", "h2 ended", "h2 DATA", "h2 DATA of a length"],
)
def test_request_framing(head: RequestHead, framing: BodyFraming) -> None:
    check_request_head(head, None)
    assert head.framing is framing


@pytest.mark.parametrize(
    ("fields", "tunnel"),
    [
        ([(b"Connection", b"Upgrade"), (b"Upgrade", b"websocket")], True),
        ([(b"Connection", b"keep-alive, upgrade"), (b"Upgrade", b"websocket")], True),
        ([(b"Upgrade", b"websocket")], False),  # not named by Connection: a plain request
        ([(b"Connection", b"Upgrade, HTTP2-Settings"), (b"Upgrade", b"h2c"), (b"HTTP2-Settings", b"AAMAAABk")], False),
        ([(b"Connection", b"Upgrade"), (b"Upgrade", b"H2C, websocket")], False),
        ([(b"Connection", b"Upgrade"), (b"Upgrade", b"websocket"), (b"Content-Length", b"3")], False),
        ([(b"Connection", b"Upgrade"), (b"Upgrade", b"websocket"), (b"Transfer-Encoding", b"chunked")], False),
    ],
    ids=["websocket", "upgrade among options", "no Connection: upgrade", "h2c (curl --http2)", "h2c offered",
         "with a body", "with a chunked body"],
)  # fmt: skip
def test_upgrade_becomes_a_tunnel_only_without_a_body_and_not_for_h2c(
    fields: list[tuple[bytes, bytes]], tunnel: bool
) -> None:
    head = h1("GET", b"/ws", "1.1", *fields)
    check_request_head(head, None)
    assert head.upgrade is tunnel


def test_an_http2_authority_becomes_the_first_host_line_for_a_pod_spoken_to_in_http1() -> None:
    head = h2((b"x-a", b"1"))
    assert head.headers[0] == (b"host", b"a.example") and head.lower_names[0] == b"host"
    assert head.hosts == [b"a.example"]
    check_request_head(head, None)
    assert head.host == "a.example"


def test_an_http2_header_list_over_the_limit_is_431() -> None:
    pairs = [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/"), (b":authority", b"a"), (b"x", b"a" * 100)]
    head = RequestHead.from_h2(pairs, True)
    size = head.list_size
    assert size == sum(len(n) + len(v) + 32 for n, v in pairs)
    with pytest.raises(HeadersTooLarge):
        check_request_head(head, None, size, size - 1)
    check_request_head(RequestHead.from_h2(pairs, True), None, size, size)


@pytest.mark.parametrize(
    ("pairs", "malformed"),
    [
        ([(b"grpc-status", b"0")], False),
        ([(b":status", b"200")], True),
        ([(b"Grpc-Status", b"0")], True),
        ([(b"x-a", b"a\r\nb")], True),
    ],
)
def test_http2_trailers(pairs: list[tuple[bytes, bytes]], malformed: bool) -> None:
    assert (trailer_fields_malformed(pairs) is not None) is malformed


def response(status: int, *fields: tuple[bytes, bytes], chunked: bool = False) -> ResponseHead:
    head = ResponseHead()
    head.fill_from_h2(status, [(name.lower(), value) for name, value in fields])
    head.chunked = chunked
    return head


RESPONSE_FRAMINGS = [
    # (request method, response, http2, ended) -> framing of the pod's body
    ("GET", response(200, (b"Content-Length", b"5")), False, False, BodyFraming.LENGTH),
    ("GET", response(200, (b"Content-Length", b"0")), False, False, BodyFraming.NONE),
    ("GET", response(200, chunked=True), False, False, BodyFraming.CHUNKED),
    ("GET", response(200), False, False, BodyFraming.CLOSE),
    ("GET", response(200), True, False, BodyFraming.CHUNKED),
    ("GET", response(200), True, True, BodyFraming.NONE),  # gRPC trailers-only
    ("HEAD", response(200, (b"Content-Length", b"5")), False, False, BodyFraming.NONE),
    ("HEAD", response(200, chunked=True), True, False, BodyFraming.NONE),
    ("GET", response(204, (b"Content-Length", b"5")), False, False, BodyFraming.NONE),
    ("GET", response(304, (b"Content-Length", b"5")), False, False, BodyFraming.NONE),
    ("GET", response(101), False, False, BodyFraming.NONE),
    ("POST", response(200, (b"Content-Length", b"5"), chunked=True), False, False, BodyFraming.CHUNKED),
]


@pytest.mark.parametrize(("method", "head", "http2", "ended", "framing"), RESPONSE_FRAMINGS)
def test_response_framing(method: str, head: ResponseHead, http2: bool, ended: bool, framing: BodyFraming) -> None:
    assert response_framing(method, head, http2=http2, ended=ended) is framing


@pytest.mark.parametrize(
    ("method", "status", "pod", "version", "framing"),
    [
        ("GET", 200, BodyFraming.LENGTH, "1.1", BodyFraming.LENGTH),
        ("GET", 200, BodyFraming.CHUNKED, "1.1", BodyFraming.CHUNKED),
        ("GET", 200, BodyFraming.CLOSE, "1.1", BodyFraming.CHUNKED),
        ("GET", 200, BodyFraming.CHUNKED, "1.0", BodyFraming.CLOSE),
        ("GET", 200, BodyFraming.LENGTH, "1.0", BodyFraming.LENGTH),
        ("GET", 200, BodyFraming.CLOSE, "2", BodyFraming.CHUNKED),
        ("HEAD", 200, BodyFraming.LENGTH, "1.1", BodyFraming.NONE),
        ("GET", 204, BodyFraming.LENGTH, "1.1", BodyFraming.NONE),
        ("GET", 304, BodyFraming.CHUNKED, "1.1", BodyFraming.NONE),
        ("GET", 103, BodyFraming.CHUNKED, "1.1", BodyFraming.NONE),
        ("GET", 200, BodyFraming.NONE, "1.1", BodyFraming.NONE),
    ],
)
def test_client_framing(method: str, status: int, pod: BodyFraming, version: str, framing: BodyFraming) -> None:
    assert client_framing(method, status, pod, version) is framing


@pytest.mark.parametrize(
    ("values", "tokens"),
    [
        ([], set()),
        ([b"close"], {b"close"}),
        ([b"Keep-Alive, Upgrade"], {b"keep-alive", b"upgrade"}),
        ([b" x-a ,, X-B\t"], {b"x-a", b"x-b"}),
        ([b"close", b"upgrade"], {b"close", b"upgrade"}),
    ],
)
def test_connection_tokens(values: list[bytes], tokens: set[bytes]) -> None:
    assert connection_tokens(values) == tokens


@pytest.mark.parametrize(
    ("reason", "refusal"),
    [
        ("Invalid `Transfer-Encoding` header value", UnsupportedTransferEncoding),
        ("Content-Length can't be present with Transfer-Encoding", BadRequest),
        ("Invalid header value char", BadRequest),
    ],
)
def test_what_llhttp_refused_maps_to_an_answer(reason: str, refusal: type[ActivatorError]) -> None:
    assert type(refusal_of_head(reason)) is refusal

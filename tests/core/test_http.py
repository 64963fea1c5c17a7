"""``core.http``, every rule a row: which header lines travel to the pod and back, the
HTTP/2 spelling of a request and of a response, activator's own answers, and gRPC's
statuses and timeouts. Pure functions, so each row runs in microseconds; the same rules
are checked through real sockets by the conformance tier (``tests/conformance``).
"""

from typing import Any

import pytest

from activator.core.errors import (
    ActivatorError,
    BadHost,
    BodyTooLarge,
    DeadlineExceeded,
    QueueFull,
    QueueTimeout,
    UnknownHost,
    UpstreamConnectError,
    UpstreamTimeout,
)
from activator.core.heads import BodyFraming, Header
from activator.core.http import (
    GRPC_STATUS,
    format_grpc_timeout,
    grpc_status,
    grpc_timeout,
    h2_request_fields,
    h2_response_fields,
    h2_trailer_fields,
    header_block,
    is_grpc,
    own_answer,
    own_answer_headers,
    pod_request_headers,
    relayed_trailers,
    response_headers,
    status_line,
)


def lower(headers: list[Header]) -> list[bytes]:
    return [name.lower() for name, _ in headers]


def to_pod(headers: list[Header], **options: Any) -> list[Header]:
    return pod_request_headers(headers, lower(headers), b"10.0.0.9", b"http", b"example.com", **options)


def names_to_pod(headers: list[Header], **options: Any) -> list[bytes]:
    return [name for name, _ in to_pod(headers, **options)]


# -- the request's lines on their way to the pod ------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        b"Connection",
        b"Keep-Alive",
        b"Proxy-Connection",
        b"Proxy-Authorization",
        b"TE",
        b"Trailer",
        b"Transfer-Encoding",
        b"Upgrade",
        b"Expect",  # activator sends 100 Continue itself
        b"Content-Length",  # re-derived from the body that is sent
        b"X-Activator-Forwarded",  # between activators only
    ],
)
def test_a_hop_by_hop_request_line_stops_here(name: bytes) -> None:
    assert name not in names_to_pod([(b"Accept", b"*/*"), (name, b"x")])


def test_end_to_end_request_lines_keep_their_order_spelling_and_repeats() -> None:
    headers = [(b"accept", b"a"), (b"X-Mixed-Case", b"V a l"), (b"Cookie", b"1"), (b"Cookie", b"2")]
    assert to_pod(headers)[:4] == headers


def test_a_line_named_by_connection_stops_here() -> None:
    headers = [(b"X-Secret-Hop", b"1"), (b"Accept", b"*/*")]
    assert names_to_pod(headers, named_by_connection=frozenset({b"x-secret-hop"}))[0] == b"Accept"


@pytest.mark.parametrize(
    ("client_said", "sent"),
    [
        ([], b"10.0.0.9"),
        ([b"1.1.1.1"], b"1.1.1.1, 10.0.0.9"),
        ([b"1.1.1.1", b"2.2.2.2, 3.3.3.3"], b"1.1.1.1, 2.2.2.2, 3.3.3.3, 10.0.0.9"),
    ],
)
def test_x_forwarded_for_gets_the_client_appended_to_all_its_lines(client_said: list[bytes], sent: bytes) -> None:
    pairs = to_pod([(b"X-Forwarded-For", value) for value in client_said])
    assert [value for name, value in pairs if name == b"X-Forwarded-For"] == [sent]


def test_x_forwarded_proto_and_host_are_set_not_relayed() -> None:
    pairs = to_pod([(b"X-Forwarded-Proto", b"https"), (b"X-Forwarded-Host", b"evil")])
    assert (b"X-Forwarded-Proto", b"http") in pairs and (b"X-Forwarded-Host", b"example.com") in pairs
    assert (b"X-Forwarded-Proto", b"https") not in pairs and (b"X-Forwarded-Host", b"evil") not in pairs


def test_a_tunnel_request_forwards_its_upgrade_with_connection_upgrade() -> None:
    pairs = to_pod([(b"Upgrade", b"websocket"), (b"Connection", b"Upgrade")], upgrade=b"websocket")
    assert pairs[-2:] == [(b"Connection", b"upgrade"), (b"Upgrade", b"websocket")]
    assert names_to_pod([(b"Upgrade", b"websocket")]).count(b"Upgrade") == 0


def test_header_block_spells_each_pair_as_a_crlf_line() -> None:
    assert header_block([(b"A", b"1"), (b"b", b"")]) == b"A: 1\r\nb: \r\n"


# -- the pod's lines on their way to the client -------------------------------------------


def from_pod(headers: list[Header], framing: BodyFraming, **options: Any) -> list[bytes]:
    return [name for name, _ in response_headers(headers, lower(headers), framing, **options)]


@pytest.mark.parametrize(
    "name", [b"Connection", b"Keep-Alive", b"Proxy-Connection", b"Proxy-Authenticate", b"TE", b"Transfer-Encoding"]
)
def test_a_hop_by_hop_response_line_stops_here(name: bytes) -> None:
    assert from_pod([(name, b"x"), (b"Server", b"pod")], BodyFraming.LENGTH) == [b"Server"]


@pytest.mark.parametrize(
    ("framing", "keep_length", "length_kept", "trailer_kept"),
    [
        (BodyFraming.LENGTH, False, True, False),
        (BodyFraming.CHUNKED, False, False, True),
        (BodyFraming.CLOSE, False, False, False),
        (BodyFraming.NONE, False, False, False),
        (BodyFraming.NONE, True, True, False),  # HEAD or 304: the length describes a body not sent
    ],
)
def test_framing_lines_follow_how_the_body_goes_out(
    framing: BodyFraming, keep_length: bool, length_kept: bool, trailer_kept: bool
) -> None:
    names = from_pod(
        [(b"Content-Length", b"5"), (b"Trailer", b"X-Sum"), (b"ETag", b"1")], framing, keep_length=keep_length
    )
    assert (b"Content-Length" in names, b"Trailer" in names, b"ETag" in names) == (length_kept, trailer_kept, True)


def test_upgrade_reaches_the_client_only_on_a_101() -> None:
    headers = [(b"Upgrade", b"websocket"), (b"Connection", b"Upgrade")]
    assert from_pod(headers, BodyFraming.NONE) == []
    assert from_pod(headers, BodyFraming.NONE, keep_upgrade=True) == [b"Upgrade"]


def test_a_response_line_named_by_connection_stops_here() -> None:
    names = from_pod([(b"X-Hop", b"1"), (b"Date", b"d")], BodyFraming.LENGTH, named_by_connection=frozenset({b"x-hop"}))
    assert names == [b"Date"]


def test_trailers_lose_their_hop_by_hop_fields() -> None:
    assert relayed_trailers([(b"grpc-status", b"0"), (b"Connection", b"x"), (b"TE", b"t")]) == [(b"grpc-status", b"0")]


# -- HTTP/2 spelling --------------------------------------------------------------------


def test_an_h2_response_lower_cases_names_and_drops_connection_specific_lines() -> None:
    fields = h2_response_fields(
        [(b"Content-Type", b"a"), (b"Connection", b"close"), (b":status", b"9"), (b"X-A", b"1")]
    )
    assert fields == [(b"content-type", b"a"), (b"x-a", b"1")]


@pytest.mark.parametrize(
    ("headers", "authority"),
    [
        ([(b"Host", b"svc.example")], b"svc.example"),
        ([], b"10.0.0.1:8001"),  # no Host: the pod's address
        ([(b"host", b"first"), (b"Host", b"second")], b"first"),
    ],
)
def test_an_h2_request_takes_its_authority_from_host(headers: list[Header], authority: bytes) -> None:
    fields = h2_request_fields("GET", b"/", headers, b"10.0.0.1:8001", BodyFraming.NONE, None)
    assert fields[:4] == [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", authority), (b":path", b"/")]


def test_an_h2_request_keeps_its_order_drops_what_h2_forbids_and_always_says_te_trailers() -> None:
    headers = [
        (b"X-B", b"2"),
        (b"Connection", b"keep-alive"),
        (b"TE", b"gzip"),
        (b"Transfer-Encoding", b"chunked"),
        (b"X-A", b"1"),
        (b":fake", b"x"),
    ]
    fields = h2_request_fields("POST", b"/p", headers, b"pod", BodyFraming.CHUNKED, None)
    assert fields[4:] == [(b"x-b", b"2"), (b"x-a", b"1"), (b"te", b"trailers")]


@pytest.mark.parametrize(
    ("framing", "length", "expected"),
    [
        (BodyFraming.LENGTH, 12, [(b"content-length", b"12")]),
        (BodyFraming.LENGTH, 0, [(b"content-length", b"0")]),
        (BodyFraming.CHUNKED, None, []),
    ],
)
def test_an_h2_request_says_its_length_only_when_known(
    framing: BodyFraming, length: int | None, expected: list[Header]
) -> None:
    fields = h2_request_fields("PUT", b"/", [], b"pod", framing, length)
    assert [field for field in fields if field[0] == b"content-length"] == expected


def test_h2_trailers_are_lower_cased_and_filtered() -> None:
    assert h2_trailer_fields([(b"X-Sum", b"1"), (b"Transfer-Encoding", b"x"), (b":path", b"/")]) == [(b"x-sum", b"1")]


# -- activator's own answers ------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "reason", "line"),
    [
        (200, None, b"HTTP/1.1 200 OK\r\n"),
        (503, None, b"HTTP/1.1 503 Service Unavailable\r\n"),
        (418, None, b"HTTP/1.1 418 I'm a Teapot\r\n"),  # from the standard table
        (299, None, b"HTTP/1.1 299 \r\n"),  # no standard phrase: empty, still valid
        (200, b"Fine Thanks", b"HTTP/1.1 200 Fine Thanks\r\n"),  # the pod's own phrase
    ],
)
def test_status_line(status: int, reason: bytes | None, line: bytes) -> None:
    assert status_line(status, reason) == line


def test_an_own_answer_says_its_reason_and_retry_after() -> None:
    status, headers, body = own_answer_headers(QueueFull(), grpc=False)
    assert status == 503 and body == b"503 queue-full\n"
    assert (b"X-Activator-Reason", b"queue-full") in headers and (b"retry-after", b"1") in headers
    assert (b"Content-Length", b"%d" % len(body)) in headers


def test_an_own_answer_without_retry_after_has_none() -> None:
    _, headers, _ = own_answer_headers(UnknownHost(), grpc=False)
    assert not any(name.lower() == b"retry-after" for name, _ in headers)


def test_a_grpc_request_gets_a_trailers_only_grpc_status() -> None:
    status, headers, body = own_answer_headers(QueueFull(), grpc=True)
    assert (status, body) == (200, b"")
    assert (b"grpc-status", b"8") in headers and (b"grpc-message", b"503 queue-full") in headers
    assert (b"content-type", b"application/grpc") in headers


@pytest.mark.parametrize(
    ("close", "head_only", "grpc"),
    [(False, False, False), (True, False, False), (False, True, False), (False, False, True)],
)
def test_own_answer_as_http1_bytes(close: bool, head_only: bool, grpc: bool) -> None:
    message, body_size = own_answer(BadHost(), close, grpc, head_only=head_only)
    head, _, body = message.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 ")
    assert (b"\r\nConnection: close" in head) == close
    assert body == (b"" if head_only or grpc else b"400 bad-host\n") and body_size == len(body)
    if head_only:  # the head still says the length of the body a GET would carry
        assert b"Content-Length: 13" in head
    if grpc:
        assert b"HTTP/1.1 200 OK" in head and b"Content-Length: 0" in head


# -- gRPC -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "grpc"),
    [
        (b"application/grpc", True),
        (b"application/grpc+proto", True),
        (b"Application/GRPC", True),
        (b"application/json", False),
        (b"application/gr", False),
        (None, False),
    ],
)
def test_is_grpc(content_type: bytes | None, grpc: bool) -> None:
    assert is_grpc(content_type) is grpc


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (QueueFull(), 8),  # RESOURCE_EXHAUSTED
        (QueueTimeout(), 14),  # UNAVAILABLE
        (UpstreamConnectError("refused"), 14),
        (UpstreamTimeout(), 4),  # DEADLINE_EXCEEDED
        (DeadlineExceeded(), 4),
        (UnknownHost(), 12),  # UNIMPLEMENTED
        (BodyTooLarge(), 8),
        (BadHost(), 13),  # by its HTTP status, 400 -> INTERNAL
    ],
)
def test_grpc_status_of_own_answers(error: ActivatorError, code: int) -> None:
    assert grpc_status(error) == code


def test_every_named_grpc_status_is_a_valid_code() -> None:
    assert all(0 <= code <= 16 for code in GRPC_STATUS.values())


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (b"100m", 0.1),
        (b"5S", 5.0),
        (b"2M", 120.0),
        (b"1H", 3600.0),
        (b"250u", 250e-6),
        (b"7n", 7e-9),
        (b" 3S\t", 3.0),  # optional whitespace around the value
        (b"123456789m", None),  # more than 8 digits
        (b"10", None),  # no unit
        (b"10x", None),
        (b"-1S", None),
        (b"", None),
        (None, None),
    ],
)
def test_grpc_timeout(value: bytes | None, seconds: float | None) -> None:
    assert grpc_timeout(value) == (pytest.approx(seconds) if seconds is not None else None)


@pytest.mark.parametrize(
    ("seconds", "value"), [(0.1, b"100m"), (0.0, b"1m"), (0.0004, b"1m"), (2.5, b"2500m"), (1e9, b"99999999m")]
)
def test_format_grpc_timeout(seconds: float, value: bytes) -> None:
    assert format_grpc_timeout(seconds) == value
    assert grpc_timeout(value) is not None  # what activator sends, it can read back

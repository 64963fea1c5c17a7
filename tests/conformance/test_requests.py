"""The request table: what activator accepts, refuses and forwards, byte by byte.

One real activator (``probe: null``, ``access_log: false``, ``limits.max_body_bytes``
1 MiB) in front of one recording pod, one service for the host ``a.example`` and no
catch-all. Each :class:`Row` is the raw bytes a client sends on a fresh connection (at
once, so in one packet; sometimes with a pipelined request after the first), and what
must follow:

- the answers, in order: status and ``X-Activator-Reason`` (``pod``: no reason, the pod's
  own answer, whose body names the request it answers);
- whether activator then ends the connection (its last answer then says
  ``Connection: close``), or keeps it: a request sent after the answers is served;
- what the pod receives: nothing at all (not one byte), or exactly these complete
  requests, each with its method, target, framing (and, where it matters, headers and
  body), forwarded as HTTP/1.1. Markers such as ``/SMUGGLED`` must never reach the pod.

A row's id says all of that, so the table reads as the specification it checks. The
behaviour is the one the llhttp engine is built to (RFC 9112, strictly); where llhttp
alone would be more lenient than a row (double spaces in the request line, duplicate Host
lines, Transfer-Encoding in HTTP/1.0) the engine has to refuse on its own. Rows that need
more than one packet or a client that stops sending are the tests after the table.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from recording_pod import Framing, Since
from wire import (
    SMUGGLED,
    Proxy,
    RawResponse,
    Uploader,
    Wire,
    chunked,
    http_request,
    proxy_setup,
    quiet_mark,
    wait_quiet,
    wire,
)

pytestmark = pytest.mark.binary

MAX_BODY_BYTES = 1024 * 1024
#: Sent after the answers on a connection that must have been kept open.
STILL_OPEN = http_request(b"GET /still-open HTTP/1.1")


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    with proxy_setup(tmp_path_factory.mktemp("requests"), limits={"max_body_bytes": MAX_BODY_BYTES}) as setup:
        yield setup


# --------------------------------------------------------------------------------------
# the table's vocabulary


@dataclass(frozen=True)
class Forwarded:
    """One complete request the pod must receive."""

    method: bytes
    target: bytes
    framing: Framing = "none"
    body: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()  # each among those forwarded (name in any case, value exact)
    absent: tuple[bytes, ...] = ()  # header names that must not be forwarded (lower-case)

    def describe(self) -> str:
        return f"{self.method.decode()} {self.target[:40].decode('latin-1')} ({self.framing})"


@dataclass(frozen=True)
class Answer:
    status: int
    reason: str | None = None  # X-Activator-Reason; None: the pod's own answer

    def describe(self) -> str:
        return f"{self.status} {self.reason or 'pod'}"


POD = Answer(200)


@dataclass(frozen=True)
class Row:
    name: str
    data: bytes
    answers: tuple[Answer, ...]
    closed: bool
    forwarded: tuple[Forwarded, ...] = ()  # () = not one byte reaches the pod
    never_forwarded: tuple[bytes, ...] = (b"/SMUGGLED",)  # bytes the pod must never receive

    def __post_init__(self) -> None:
        assert sum(a == POD for a in self.answers) == len(self.forwarded), f"{self.name}: one pod answer per request"

    @property
    def id(self) -> str:
        then = "closed" if self.closed else "kept open"
        pod = "; ".join(f.describe() for f in self.forwarded) or "nothing"
        return f"{self.name} -> {', '.join(a.describe() for a in self.answers)}, {then}, pod gets {pod}"


def refused(name: str, data: bytes, status: int, reason: str, *, closed: bool = True) -> Row:
    """Activator answers on its own and forwards nothing."""
    return Row(name, data, (Answer(status, reason),), closed)


def served(name: str, data: bytes, *forwarded: Forwarded, closed: bool = False) -> Row:
    """Each request reaches the pod, and the pod's answers come back in order."""
    return Row(name, data, (POD,) * len(forwarded), closed, forwarded)


def get(target: bytes, *header_lines: bytes, host: bytes | None = b"a.example", version: bytes = b"HTTP/1.1") -> bytes:
    return http_request(b"GET " + target + b" " + version, *header_lines, host=host)


def post(target: bytes, *header_lines: bytes, body: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    return http_request(b"POST " + target + b" " + version, *header_lines, body=body)


def with_host(*host_lines: bytes, version: bytes = b"HTTP/1.1") -> bytes:
    return get(b"/host", *host_lines, host=None, version=version)


def chunked_post(chunks: bytes, *header_lines: bytes, te: bytes = b"chunked") -> bytes:
    """A POST to ``/chunks`` with ``Transfer-Encoding: te`` whose body is ``chunks`` as
    given, then ``/SMUGGLED``."""
    return post(b"/chunks", b"Transfer-Encoding: " + te, *header_lines, body=chunks) + SMUGGLED


def with_body(*header_lines: bytes) -> bytes:
    """A POST to ``/framing`` with these framing headers and ``hello``, then ``/SMUGGLED``."""
    return post(b"/framing", *header_lines, body=b"hello") + SMUGGLED


HELLO_CHUNKED = chunked(b"hello", 5)

# --------------------------------------------------------------------------------------
# the table

REQUEST_LINES = [
    served("origin-form", get(b"/index.html?q=1&r=%2F"), Forwarded(b"GET", b"/index.html?q=1&r=%2F")),
    served("asterisk-form OPTIONS *", http_request(b"OPTIONS * HTTP/1.1"), Forwarded(b"OPTIONS", b"*")),
    refused("absolute-form (not an open proxy)", get(b"http://a.example/"), 400, "bad-request-target", closed=False),
    refused("CONNECT authority-form", http_request(b"CONNECT a.example:443 HTTP/1.1"), 400, "bad-request-target"),
    served("HTTP/1.0", get(b"/ten", version=b"HTTP/1.0"), Forwarded(b"GET", b"/ten"), closed=True),
    served(
        "HTTP/1.0 keep-alive", get(b"/ten", b"Connection: keep-alive", version=b"HTTP/1.0"), Forwarded(b"GET", b"/ten")
    ),
    refused("HTTP/0.9 simple request", b"GET /\r\n\r\n", 400, "bad-request"),
    refused("HTTP/0.9 version", get(b"/", version=b"HTTP/0.9"), 400, "bad-request"),
    refused("HTTP/1.2", get(b"/", version=b"HTTP/1.2"), 400, "bad-request"),
    refused("HTTP/2.0 in the request line", get(b"/", version=b"HTTP/2.0"), 400, "bad-request"),
    refused("lowercase http/1.1", get(b"/", version=b"http/1.1"), 400, "bad-request"),
    refused("double space after the method", http_request(b"GET  / HTTP/1.1"), 400, "bad-request"),
    refused("tab instead of a space", http_request(b"GET\t/ HTTP/1.1"), 400, "bad-request"),
    refused("missing target", http_request(b"GET HTTP/1.1"), 400, "bad-request-target"),
    refused("request line over 8 KiB", get(b"/" + b"a" * 9000), 414, "request-line-too-long"),
    served("request line under 8 KiB", get(b"/" + b"a" * 8000), Forwarded(b"GET", b"/" + b"a" * 8000)),
]

LINE_ENDINGS = [
    refused("bare LF line endings", b"GET / HTTP/1.1\nHost: a.example\n\n", 400, "bad-request"),
    refused("bare LF after one header line", b"GET / HTTP/1.1\r\nHost: a.example\nX-A: b\r\n\r\n", 400, "bad-request"),
    refused("bare LF ending the head", b"GET / HTTP/1.1\r\nHost: a.example\r\n\n", 400, "bad-request"),
    refused("bare CR after the request line", b"GET / HTTP/1.1\rHost: a.example\r\n\r\n", 400, "bad-request"),
    refused("bare CR in a header value", get(b"/", b"X-A: a\rb"), 400, "bad-request"),
    # RFC 9112 2.2: a server SHOULD ignore at least one empty line before the request
    # line. llhttp skips any number of them (h11 refuses even one): activator follows llhttp.
    served(
        "an empty line before the request line",
        b"\r\n" + get(b"/after-empty-line"),
        Forwarded(b"GET", b"/after-empty-line"),
    ),
    served(
        "two empty lines before the request line",
        b"\r\n\r\n" + get(b"/after-empty-lines"),
        Forwarded(b"GET", b"/after-empty-lines"),
    ),
    # llhttp also skips a bare CR there: not an empty line, so refused.
    refused("a bare CR before the request line", b"\r" + get(b"/after-bare-cr"), 400, "bad-request"),
    refused("a bare CR after an empty line", b"\r\n\r" + get(b"/after-bare-cr"), 400, "bad-request"),
]

HEADER_SYNTAX = [
    refused("header line without a colon", get(b"/", b"NoColonHere"), 400, "bad-request"),
    refused("space between name and colon", get(b"/", b"X-A : v"), 400, "bad-request"),
    refused("tab between name and colon", get(b"/", b"X-A\t: v"), 400, "bad-request"),
    refused("header name not a token", get(b"/", b"X(a): v"), 400, "bad-request"),
    refused("empty header name", get(b"/", b": v"), 400, "bad-request"),
    refused("obs-fold with SP", get(b"/", b"X-A: a", b" b"), 400, "bad-request"),
    refused("obs-fold with HTAB", get(b"/", b"X-A: a", b"\tb"), 400, "bad-request"),
    refused(
        "obs-fold hiding Transfer-Encoding",
        post(b"/", b"Content-Length: 5", b"X-A: a", b" Transfer-Encoding: chunked", body=b"hello") + SMUGGLED,
        400,
        "bad-request",
    ),
    refused("NUL in a value", get(b"/", b"X-A: a\x00b"), 400, "bad-request"),
    refused("control character in a value", get(b"/", b"X-A: a\x01b"), 400, "bad-request"),
    refused("ESC in a value", get(b"/", b"X-A: \x1b[31m"), 400, "bad-request"),
    refused("DEL in a value", get(b"/", b"X-A: a\x7fb"), 400, "bad-request"),
    served(
        "obs-text in a value, forwarded byte for byte",
        get(b"/obs-text", b"X-Obs: caf\xe9 \x80\xff"),
        Forwarded(b"GET", b"/obs-text", headers=((b"X-Obs", b"caf\xe9 \x80\xff"),)),
    ),
    served(
        "HTAB inside a value, forwarded byte for byte",
        get(b"/tab", b"X-Tab: a\tb"),
        Forwarded(b"GET", b"/tab", headers=((b"X-Tab", b"a\tb"),)),
    ),
    served(
        "header line with an empty value",
        get(b"/empty-value", b"X-Empty:"),
        Forwarded(b"GET", b"/empty-value", headers=((b"X-Empty", b""),)),
    ),
]

# Only SP and HTAB are whitespace (RFC 9110 5.6.3): NBSP (\xa0) and NEL (\x85) are not trimmed.
WHITESPACE = [
    refused(
        "Transfer-Encoding: NBSP chunked NBSP",
        chunked_post(HELLO_CHUNKED, te=b"\xa0chunked\xa0"),
        501,
        "unsupported-transfer-encoding",
    ),
    refused(
        "Transfer-Encoding: NEL chunked",
        chunked_post(HELLO_CHUNKED, te=b"\x85chunked"),
        501,
        "unsupported-transfer-encoding",
    ),
    refused("Content-Length: NBSP 5", with_body(b"Content-Length: \xa05"), 400, "bad-request"),
    refused("Content-Length: 5 NEL", with_body(b"Content-Length: 5\x85"), 400, "bad-request"),
    refused("Host: NBSP a.example NBSP", with_host(b"Host: \xa0a.example\xa0"), 400, "bad-host", closed=False),
]

# RFC 9112 3.2. A bad Host leaves the framing intact: the connection goes on.
HOSTS = [
    refused("HTTP/1.1 without Host", with_host(), 400, "bad-host", closed=False),
    refused("two equal Host lines", with_host(b"Host: a.example", b"Host: a.example"), 400, "bad-host", closed=False),
    refused(
        "two different Host lines", with_host(b"Host: a.example", b"Host: b.example"), 400, "bad-host", closed=False
    ),
    *(
        refused(f"{line.decode()!r}", with_host(line), 400, "bad-host", closed=False)
        for line in (
            b"Host: a.example,b.example",
            b"Host: user@a.example",
            b"Host: a.example:80:80",
            b"Host: a.example/x",
            b"Host:",
            b"Host: a.example:",
            b"Host: a.example:99999x",
        )
    ),
    served(
        "Host a.example", with_host(b"Host: a.example"), Forwarded(b"GET", b"/host", headers=((b"Host", b"a.example"),))
    ),
    served(
        "Host in upper case with a port (both ignored for routing, forwarded as sent)",
        with_host(b"Host: A.EXAMPLE:8080"),
        Forwarded(b"GET", b"/host", headers=((b"Host", b"A.EXAMPLE:8080"),)),
    ),
    refused("Host [::1]:80 (valid, names no service)", with_host(b"Host: [::1]:80"), 404, "unknown-host", closed=False),
    refused(
        "Host 127.0.0.1 (valid, names no service)", with_host(b"Host: 127.0.0.1"), 404, "unknown-host", closed=False
    ),
    refused("HTTP/1.0 without Host (valid, names no service)", with_host(version=b"HTTP/1.0"), 404, "unknown-host"),
    Row(
        "bad Host, then a pipelined request",
        get(b"/", host=b"user@a.example") + get(b"/after-bad-host"),
        (Answer(400, "bad-host"), POD),
        False,
        (Forwarded(b"GET", b"/after-bad-host"),),
    ),
    Row(
        "unknown Host, then a pipelined request",
        get(b"/", host=b"b.example") + get(b"/after-unknown-host"),
        (Answer(404, "unknown-host"), POD),
        False,
        (Forwarded(b"GET", b"/after-unknown-host"),),
    ),
    Row(
        "absolute-form, then a pipelined request",
        get(b"http://a.example/") + get(b"/after-absolute-form"),
        (Answer(400, "bad-request-target"), POD),
        False,
        (Forwarded(b"GET", b"/after-absolute-form"),),
    ),
]

# Refused framing closes the connection: where the next request would start is unknown.
# activator refuses duplicate Content-Length even when equal (h11 accepts them).
CONTENT_LENGTH = [
    served(
        "Content-Length 5",
        post(b"/framing", b"Content-Length: 5", body=b"hello"),
        Forwarded(b"POST", b"/framing", "content-length", b"hello"),
    ),
    served(
        "Content-Length 0",
        post(b"/framing", b"Content-Length: 0"),
        Forwarded(b"POST", b"/framing", "content-length", b""),
    ),
    served(
        "Content-Length with leading zeros",
        post(b"/framing", b"Content-Length: 005", body=b"hello"),
        Forwarded(b"POST", b"/framing", "content-length", b"hello"),
    ),
    *(
        refused(f"Content-Length {name}", with_body(*lines), 400, "bad-request")
        for name, lines in {
            "+5": [b"Content-Length: +5"],
            "-1": [b"Content-Length: -1"],
            "'5 5'": [b"Content-Length: 5 5"],
            "0x5": [b"Content-Length: 0x5"],
            "twice, equal": [b"Content-Length: 5", b"Content-Length: 5"],
            "twice, different": [b"Content-Length: 5", b"Content-Length: 6"],
            "comma list '5, 5'": [b"Content-Length: 5, 5"],
        }.items()
    ),
    # Only the head is sent: the answer must come without waiting for a body.
    refused(
        "Content-Length over 64 bits, answered on the head alone",
        post(b"/framing", b"Content-Length: 99999999999999999999999"),
        400,
        "bad-request",
    ),
    refused(
        "Content-Length over max_body_bytes, answered on the head alone",
        post(b"/framing", b"Content-Length: %d" % (MAX_BODY_BYTES + 1)),
        413,
        "body-too-large",
    ),
    served(
        "Content-Length at max_body_bytes",
        post(b"/framing", b"Content-Length: %d" % MAX_BODY_BYTES, body=b"b" * MAX_BODY_BYTES),
        Forwarded(b"POST", b"/framing", "content-length", b"b" * MAX_BODY_BYTES),
    ),
]

TRANSFER_ENCODING = [
    served(
        "Transfer-Encoding chunked",
        post(b"/te", b"Transfer-Encoding: chunked", body=chunked(b"hello world", 4)),
        Forwarded(b"POST", b"/te", "chunked", b"hello world"),
    ),
    served(
        "Transfer-Encoding Chunked (case-insensitive)",
        post(b"/te", b"Transfer-Encoding: Chunked", body=chunked(b"hello world", 4)),
        Forwarded(b"POST", b"/te", "chunked", b"hello world"),
    ),
    *(
        refused(
            f"Transfer-Encoding {te.decode()!r}",
            chunked_post(HELLO_CHUNKED, te=te),
            501,
            "unsupported-transfer-encoding",
        )
        for te in (b"gzip, chunked", b"chunked, gzip", b"gzip", b"identity", b"chunked;q=1")
    ),
    refused(
        "Transfer-Encoding chunked on two lines",
        chunked_post(HELLO_CHUNKED, b"Transfer-Encoding: chunked"),
        501,
        "unsupported-transfer-encoding",
    ),
    refused(
        "Content-Length and Transfer-Encoding", chunked_post(HELLO_CHUNKED, b"Content-Length: 10"), 400, "bad-request"
    ),
    refused(
        "Transfer-Encoding and Content-Length, the other order",
        post(b"/chunks", b"Content-Length: 10", b"Transfer-Encoding: chunked", body=HELLO_CHUNKED) + SMUGGLED,
        400,
        "bad-request",
    ),
    refused(
        "Transfer-Encoding in HTTP/1.0",
        post(b"/chunks", b"Transfer-Encoding: chunked", body=HELLO_CHUNKED, version=b"HTTP/1.0") + SMUGGLED,
        400,
        "bad-request",
    ),
]

# A body framing error: 400 client-body, Connection: close, and the pipelined /SMUGGLED
# never reaches the pod. The whole request came in one packet, so nothing at all does.
CHUNKS = [
    served(
        "upper-case hex chunk size",
        post(b"/chunks", b"Transfer-Encoding: chunked", body=b"A\r\n0123456789\r\n0\r\n\r\n"),
        Forwarded(b"POST", b"/chunks", "chunked", b"0123456789"),
    ),
    served(
        "lower-case hex chunk size",
        post(b"/chunks", b"Transfer-Encoding: chunked", body=b"a\r\n0123456789\r\n0\r\n\r\n"),
        Forwarded(b"POST", b"/chunks", "chunked", b"0123456789"),
    ),
    *(
        Row(
            f"chunk extension {ext.decode()} (not passed on)",
            post(b"/chunks", b"Transfer-Encoding: chunked", body=b"5" + ext + b"\r\nhello\r\n0\r\n\r\n"),
            (POD,),
            False,
            (Forwarded(b"POST", b"/chunks", "chunked", b"hello"),),
            (b"/SMUGGLED", ext),
        )
        for ext in (b";a=b", b';a="b"')
    ),
    *(
        refused(name, chunked_post(chunks), 400, "client-body")
        for name, chunks in {
            "chunk size not hex": b"zz\r\nhello\r\n0\r\n\r\n",
            "space after the chunk size": b"5 \r\nhello\r\n0\r\n\r\n",
            "chunk size 0x5": b"0x5\r\nhello\r\n0\r\n\r\n",
            "negative chunk size": b"-5\r\nhello\r\n0\r\n\r\n",
            "chunk size over 64 bits": b"10000000000000000\r\nhello\r\n0\r\n\r\n",
            "bare LF after the chunk size": b"5\nhello\r\n0\r\n\r\n",
            "bare LF in a chunk extension": b"5;a=b\nhello\r\n0\r\n\r\n",
            "no CRLF after the chunk data": b"5\r\nhelloXX\r\n0\r\n\r\n",
            "garbage after the last chunk": b"0\r\ngarbage\r\n\r\n",
            "empty chunk-size line (the classic desync)": b"3\r\nabc\r\n\r\n0\r\n\r\n",
        }.items()
    ),
]

PIPELINING = [
    served(
        "three GETs in one packet",
        get(b"/one") + get(b"/two") + get(b"/three"),
        Forwarded(b"GET", b"/one"),
        Forwarded(b"GET", b"/two"),
        Forwarded(b"GET", b"/three"),
    ),
    served(
        "a POST with Content-Length, then a GET",
        post(b"/first", b"Content-Length: 5", body=b"hello") + get(b"/second"),
        Forwarded(b"POST", b"/first", "content-length", b"hello"),
        Forwarded(b"GET", b"/second"),
    ),
    served(
        "a chunked POST, then a GET",
        post(b"/first", b"Transfer-Encoding: chunked", body=chunked(b"hello world", 3)) + get(b"/second"),
        Forwarded(b"POST", b"/first", "chunked", b"hello world"),
        Forwarded(b"GET", b"/second"),
    ),
]

# RFC 9110 5.5: leading and trailing SP and HTAB are not part of a field value; they
# travel trimmed.
TRAILING_WHITESPACE = [
    served(
        "Transfer-Encoding: chunked SP",
        post(b"/te-sp", b"Transfer-Encoding: chunked ", body=chunked(b"hello world", 4)),
        Forwarded(b"POST", b"/te-sp", "chunked", b"hello world"),
    ),
    # llhttp reads no coding from "chunked" then HTAB: refused as any coding it cannot read.
    refused(
        "Transfer-Encoding: chunked HTAB",
        chunked_post(HELLO_CHUNKED, te=b"chunked\t"),
        501,
        "unsupported-transfer-encoding",
    ),
    served(
        "Content-Length: 5 SP",
        post(b"/cl-sp", b"Content-Length: 5 ", body=b"hello"),
        Forwarded(b"POST", b"/cl-sp", "content-length", b"hello"),
    ),
    served(
        "Host: a.example SP",
        with_host(b"Host: a.example "),
        Forwarded(b"GET", b"/host", headers=((b"Host", b"a.example"),)),
    ),
    served(
        "a value with trailing SP and HTAB, forwarded trimmed",
        get(b"/trimmed", b"X-Trimmed: a b \t "),
        Forwarded(b"GET", b"/trimmed", headers=((b"X-Trimmed", b"a b"),)),
    ),
]

# RFC 9110 9.1: any token is a method, forwarded as it came (llhttp knows a fixed list;
# activator feeds it a stand-in and keeps the client's).
METHODS = [
    *(
        served(f"method {method.decode()}", http_request(method + b" /method HTTP/1.1"), Forwarded(method, b"/method"))
        for method in (b"BAN", b"FOO", b"X-CUSTOM", b"MKCOLA", b"PURGE", b"get", b"M-SEARCH", b"BREW")
    ),
    served(
        "method BAN with a chunked body",
        http_request(b"BAN /ban HTTP/1.1", b"Transfer-Encoding: chunked", body=chunked(b"hello", 2)),
        Forwarded(b"BAN", b"/ban", "chunked", b"hello"),
    ),
    served(
        "a GET, then BAN, then FOO, in one packet",
        get(b"/one") + http_request(b"BAN /two HTTP/1.1") + http_request(b"FOO /three HTTP/1.1"),
        Forwarded(b"GET", b"/one"),
        Forwarded(b"BAN", b"/two"),
        Forwarded(b"FOO", b"/three"),
    ),
    served(
        "a POST with Content-Length, then BAN",
        post(b"/first", b"Content-Length: 5", body=b"hello") + http_request(b"BAN /second HTTP/1.1"),
        Forwarded(b"POST", b"/first", "content-length", b"hello"),
        Forwarded(b"BAN", b"/second"),
    ),
    served(
        "a chunked POST whose body holds CRLF CRLF, then MKCOLA",
        post(b"/first", b"Transfer-Encoding: chunked", body=chunked(b"a\r\n\r\nb\r\n\r\n", 3))
        + http_request(b"MKCOLA /second HTTP/1.1"),
        Forwarded(b"POST", b"/first", "chunked", b"a\r\n\r\nb\r\n\r\n"),
        Forwarded(b"MKCOLA", b"/second"),
    ),
    refused("a method that is not a token", http_request(b"GE(T / HTTP/1.1"), 400, "bad-request"),
    refused("CONNECT", http_request(b"CONNECT a.example:443 HTTP/1.1"), 400, "bad-request-target"),
]

CURL_H2C_UPGRADE = (
    b"Connection: Upgrade, HTTP2-Settings",
    b"Upgrade: h2c",
    b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA",
)

# An Upgrade is a tunnel only when the pod answers 101 to a request that asked for one
# and has no body; h2c (deprecated, RFC 9113 3.1) is always declined. A declined one is a
# plain request, and the connection goes on.
UPGRADES = [
    served(
        "curl --http2 -d (Upgrade: h2c with a body)",
        post(b"/h2c-body", *CURL_H2C_UPGRADE, b"Content-Length: 5", body=b"hello"),
        Forwarded(b"POST", b"/h2c-body", "content-length", b"hello", absent=(b"upgrade", b"http2-settings")),
    ),
    served(
        "curl --http2 -d, then a pipelined GET",
        post(b"/h2c-body", *CURL_H2C_UPGRADE, b"Content-Length: 5", body=b"hello") + get(b"/after-h2c"),
        Forwarded(b"POST", b"/h2c-body", "content-length", b"hello", absent=(b"upgrade",)),
        Forwarded(b"GET", b"/after-h2c"),
    ),
    served(
        "Upgrade: h2c with a chunked body, then a pipelined GET",
        post(b"/h2c-chunked", *CURL_H2C_UPGRADE, b"Transfer-Encoding: chunked", body=chunked(b"hello", 2))
        + get(b"/after-h2c"),
        Forwarded(b"POST", b"/h2c-chunked", "chunked", b"hello", absent=(b"upgrade",)),
        Forwarded(b"GET", b"/after-h2c"),
    ),
    served(
        "Upgrade: h2c without a body, then a pipelined GET",
        get(b"/h2c", *CURL_H2C_UPGRADE) + get(b"/after-h2c"),
        Forwarded(b"GET", b"/h2c", absent=(b"upgrade", b"http2-settings")),
        Forwarded(b"GET", b"/after-h2c"),
    ),
    served(
        "Upgrade: websocket the pod declines (200), then a pipelined GET",
        get(b"/ws", b"Connection: Upgrade", b"Upgrade: websocket") + get(b"/after-declined"),
        Forwarded(b"GET", b"/ws", headers=((b"Upgrade", b"websocket"),)),
        Forwarded(b"GET", b"/after-declined"),
    ),
    served(
        "Upgrade: websocket with a body, served as a plain request",
        post(b"/ws-body", b"Connection: Upgrade", b"Upgrade: websocket", b"Content-Length: 5", body=b"hello")
        + get(b"/after-ws-body"),
        Forwarded(b"POST", b"/ws-body", "content-length", b"hello", absent=(b"upgrade",)),
        Forwarded(b"GET", b"/after-ws-body"),
    ),
]

ROWS = (
    REQUEST_LINES
    + LINE_ENDINGS
    + HEADER_SYNTAX
    + WHITESPACE
    + HOSTS
    + CONTENT_LENGTH
    + TRANSFER_ENCODING
    + CHUNKS
    + PIPELINING
    + TRAILING_WHITESPACE
    + METHODS
    + UPGRADES
)


# --------------------------------------------------------------------------------------
# checking a row


def read_answers(connection: Wire, row: Row) -> list[RawResponse]:
    """The row's answers, each checked as it comes; a pod's must be its answer to the
    matching forwarded request."""
    answers = []
    pod_answers_to = iter(row.forwarded)
    for expected in row.answers:
        got = connection.read_response()
        answers.append(got)
        assert (got.status, got.activator_reason) == (expected.status, expected.reason), got.describe()
        if expected == POD:
            forwarded = next(pod_answers_to)
            assert got.body == b"served " + forwarded.target, f"not the pod's answer to {forwarded.describe()}"
    return answers


def check_connection_end(connection: Wire, row: Row, answers: list[RawResponse]) -> None:
    if not row.closed:
        assert not any(a.says_close for a in answers), [a.describe() for a in answers]
        return
    assert connection.closed_by_peer(), f"connection kept open; then came {connection.unread()[:300]!r}"
    if row.answers[-1] != POD:
        assert answers[-1].says_close, f"closing without Connection: close: {answers[-1].describe()}"


def check_pod(since: Since, row: Row) -> None:
    for marker in row.never_forwarded:
        assert marker not in since.raw, f"{marker!r} reached the pod: {since.raw[:500]!r}"
    if not row.forwarded:
        assert since.raw == b"", f"the pod received {since.raw[:500]!r}"
    assert len(since.requests) == len(row.forwarded), since.requests
    for expected, got in zip(row.forwarded, since.requests, strict=True):
        assert (got.method, got.target, got.http_version) == (expected.method, expected.target, b"1.1"), got
        assert (got.framing, got.body) == (expected.framing, expected.body), got
        for name, value in expected.headers:
            assert value in got.values(name), f"{name!r}: {value!r} not among the headers the pod got: {got.headers}"
        for name in expected.absent:
            assert not got.values(name), f"{name!r} was forwarded: {got.headers}"
    assert not since.unfinished, f"a request begun and never finished at the pod: {since.raw[-300:]!r}"


def assert_kept_open(connection: Wire) -> None:
    """The connection serves another request."""
    connection.send(STILL_OPEN)
    answer = connection.read_response()
    assert (answer.status, answer.activator_reason, answer.body) == (200, None, b"served /still-open"), (
        answer.describe()
    )


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_request_row(proxy: Proxy, row: Row) -> None:
    mark = quiet_mark(proxy.act, proxy.pod)
    with wire(proxy.act) as connection:
        connection.send(row.data)
        answers = read_answers(connection, row)
        check_connection_end(connection, row, answers)
        wait_quiet(proxy.act, proxy.pod)
        check_pod(proxy.pod.since(mark), row)
        if not row.closed:
            assert_kept_open(connection)


# --------------------------------------------------------------------------------------
# exchanges that are more than one packet


HOP_BY_HOP = (b"connection", b"keep-alive", b"te", b"trailer", b"transfer-encoding", b"upgrade", b"proxy-connection")
CLIENT_END_TO_END = (
    (b"User-Agent", b"conformance/1"),
    (b"Cookie", b"a=1"),
    (b"X-Custom", b"one"),
    (b"Cookie", b"b=2"),
    (b"X-Custom", b"two"),
    (b"Content-Type", b"text/plain"),
)


def test_the_pod_gets_the_request_as_sent_minus_hop_by_hop_plus_forwarding_headers(proxy: Proxy) -> None:
    target = b"/a%20b/c.txt?x=1&y=%2F&z="
    data = post(
        target,
        *(name + b": " + value for name, value in CLIENT_END_TO_END[:3]),
        b"Connection: keep-alive, X-Hop",
        b"X-Hop: named by Connection",
        b"Keep-Alive: timeout=5",
        b"TE: trailers",
        b"Trailer: X-Checksum",
        b"Proxy-Connection: keep-alive",
        b"Upgrade: example/1",
        *(name + b": " + value for name, value in CLIENT_END_TO_END[3:]),
        b"X-Forwarded-For: 127.0.0.9",
        b"X-Forwarded-Proto: https",
        b"X-Forwarded-Host: spoofed.example",
        b"Content-Length: 5",
        body=b"hello",
    )
    mark = quiet_mark(proxy.act, proxy.pod)
    with wire(proxy.act) as connection:
        connection.send(data)
        answer = connection.read_response()
    assert (answer.status, answer.activator_reason) == (200, None), answer.describe()
    wait_quiet(proxy.act, proxy.pod)
    requests = proxy.pod.since(mark).requests
    assert len(requests) == 1, requests
    got = requests[0]
    assert (got.method, got.target, got.http_version, got.framing, got.body) == (
        b"POST",
        target,
        b"1.1",
        "content-length",
        b"hello",
    )
    end_to_end = {name.lower() for name, _ in CLIENT_END_TO_END}
    # In the client's order, repeated lines kept apart, values byte for byte.
    assert [(n.lower(), v) for n, v in got.headers if n.lower() in end_to_end] == [
        (n.lower(), v) for n, v in CLIENT_END_TO_END
    ], got.headers
    assert got.values(b"host") == [b"a.example"], got.headers
    assert got.values(b"x-forwarded-for") == [b"127.0.0.9, 127.0.0.1"], got.headers
    assert got.values(b"x-forwarded-proto") == [b"http"], got.headers
    assert got.values(b"x-forwarded-host") == [b"a.example"], got.headers
    assert got.values(b"content-length") == [b"5"], got.headers
    assert not got.values(b"x-hop"), got.headers
    # activator may keep its own pod connection alive, but says nothing the client said.
    for name in HOP_BY_HOP:
        for value in got.values(name):
            assert name == b"connection" and value.lower() in (b"keep-alive", b"close"), (name, value)


def test_expect_100_continue_is_answered_before_the_body_and_not_forwarded(proxy: Proxy) -> None:
    mark = quiet_mark(proxy.act, proxy.pod)
    with wire(proxy.act) as connection:
        connection.send(post(b"/expect", b"Expect: 100-continue", b"Content-Length: 5"))
        interim = connection.read_response()  # the body has not been sent: this must come first
        assert (interim.status, interim.head.split(b"\r\n")[0]) == (100, b"HTTP/1.1 100 Continue"), interim.describe()
        connection.send(b"hello")
        final = connection.read_response()
    assert (final.status, final.activator_reason, final.body) == (200, None, b"served /expect"), final.describe()
    wait_quiet(proxy.act, proxy.pod)
    requests = proxy.pod.since(mark).requests
    assert len(requests) == 1, requests
    got = requests[0]
    assert (got.target, got.framing, got.body) == (b"/expect", "content-length", b"hello")
    assert not got.values(b"expect"), got.headers


def test_expect_100_continue_with_trailing_whitespace_is_answered_too(proxy: Proxy) -> None:
    with wire(proxy.act) as connection:
        connection.send(post(b"/expect-sp", b"Expect: 100-continue \t", b"Content-Length: 5"))
        interim = connection.read_response()  # the body has not been sent: this must come first
        assert interim.status == 100, interim.describe()
        connection.send(b"hello")
        final = connection.read_response()
    assert (final.status, final.body) == (200, b"served /expect-sp"), final.describe()


def test_a_body_shorter_than_its_content_length_then_fin_never_completes_at_the_pod(proxy: Proxy) -> None:
    mark = quiet_mark(proxy.act, proxy.pod)
    with wire(proxy.act) as connection:
        connection.send(post(b"/short", b"Content-Length: 10", body=b"hello"))
        connection.shutdown_write()
        connection.read_to_end()  # whatever activator answers (400 client-body, or nothing), it ends the connection
    wait_quiet(proxy.act, proxy.pod)
    assert proxy.pod.since(mark).requests == (), "the pod got a complete request from a cut-off body"


def assert_refused_mid_upload(proxy: Proxy, head: bytes, rest: bytes, status: int, reason: str) -> None:
    """Send ``head``, then ``rest`` in 64 KiB pieces and a pipelined ``/SMUGGLED``: the
    answer is ``status`` / ``reason`` with ``Connection: close``, the connection is closed,
    and the pod never gets a complete request nor the smuggled one."""
    piece = 64 * 1024
    mark = quiet_mark(proxy.act, proxy.pod)
    with wire(proxy.act) as connection:
        connection.send(head)
        uploader = Uploader(connection, [rest[i : i + piece] for i in range(0, len(rest), piece)] + [SMUGGLED])
        answer = connection.read_response()
        assert (answer.status, answer.activator_reason) == (status, reason), answer.describe()
        assert answer.says_close, answer.describe()
        assert connection.closed_by_peer(), f"connection kept open after the {status}"
        uploader.join()
    wait_quiet(proxy.act, proxy.pod)
    since = proxy.pod.since(mark)
    assert since.requests == (), "the pod got a complete request"
    assert b"/SMUGGLED" not in since.raw


def test_a_chunked_body_growing_past_max_body_bytes_is_413_and_never_completes_at_the_pod(proxy: Proxy) -> None:
    body = chunked(b"c" * (MAX_BODY_BYTES + 4 * 64 * 1024), 64 * 1024)
    assert_refused_mid_upload(proxy, post(b"/too-large", b"Transfer-Encoding: chunked"), body, 413, "body-too-large")


def test_a_trailer_line_that_never_ends_is_400_at_once_and_never_completes_at_the_pod(proxy: Proxy) -> None:
    # llhttp delivers a field only once its line ends; until then httptools holds it. Past
    # max_header_bytes and one recv more with no body data, the request is refused (not at
    # client_timeout, with all of it held in memory until then).
    head = post(b"/endless-trailer", b"Transfer-Encoding: chunked") + b"5\r\nhello\r\n0\r\n"
    assert_refused_mid_upload(proxy, head, b"X-Endless: " + b"v" * (8 * 64 * 1024), 400, "client-body")


def test_zz_after_the_table_the_pod_never_saw_a_smuggled_request_nor_two_at_once(proxy: Proxy) -> None:
    assert proxy.act.is_running(), proxy.act.output_tail()
    for record in proxy.pod.connections():
        assert b"/SMUGGLED" not in record.raw, f"pod connection {record.index}: {record.raw[-500:]!r}"
        assert record.protocol_error is None, f"pod connection {record.index}: activator sent {record.protocol_error}"
    assert proxy.pod.peak <= 1, "container_concurrency 1 exceeded"

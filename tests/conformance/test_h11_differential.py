"""Differential test: activator's reading of HTTP/1.1 requests against h11's.

A fixed, reproducible generator (no clock, one seeded ``random.Random``) makes a few
hundred requests: request-line, Host, header and body-framing variants from the request
table, combined systematically and at random, plus random mutations of their heads.
For each, h11 as a server (``h11.Connection(h11.SERVER)``) is the oracle: it either reads
one complete request or refuses the bytes (a case h11 would still wait on is dropped).
The same bytes go to one real activator (``container_concurrency: 0``) on a fresh
connection, several cases at a time, and activator either forwards (the pod's own answer
comes back) or refuses (a 4xx/5xx with ``X-Activator-Reason``).

Where the two disagree, the case must match an entry of :data:`INTENDED_DIFFERENCES`:
what h11 does, what activator does instead, for which requests, and why. Anything else
fails the test, listed case by case: an unexplained refusal, and above all a request h11
refuses that activator forwards. Each entry must also be seen at least once, so the list
stays true. When both forward, the pod must have received the request h11 read (method,
target and body): two readings of where a request ends that differ are how requests get
smuggled. Every answer must be one of the two kinds (no silence, no stray status).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import h11
import pytest
from wire import AnswerMissing, Proxy, Wire, chunked, proxy_setup, wait_quiet

pytestmark = pytest.mark.binary

SEED = 20261201
#: The longest a case may wait for its answer; one that activator leaves unanswered is a failure.
CASE_TIMEOUT = 10.0
PARALLEL = 16

Verdict = Literal["accepts", "refuses"]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    with proxy_setup(tmp_path_factory.mktemp("differential"), container_concurrency=0) as setup:
        yield setup


# --------------------------------------------------------------------------------------
# the cases


@dataclass(frozen=True)
class Case:
    name: str  # how it was made
    data: bytes


METHODS = (
    b"GET",
    b"POST",
    b"PUT",
    b"DELETE",
    b"PATCH",
    b"OPTIONS",
    b"HEAD",
    b"PROPFIND",
    b"M-SEARCH",
    b"FOO",
    b"get",
    b"BREW",
    b"BAN",
    b"X-CUSTOM",
    b"MKCOLA",
    b"PURGE",
)
# {p} is the case's own path, /cNNNN: it tells each case's request apart at the pod.
TARGETS = (
    b"{p}",
    b"{p}?q=1&r=%2F",
    b"{p}/%7Euser/a;b",
    b"{p}#frag",
    b'{p}/a"b',
    b"{p}/caf\xc3\xa9",
    b"*",
    b"http://a.example{p}",
    b"a.example:443",
)
VERSIONS = (b"HTTP/1.1", b"HTTP/1.0", b"HTTP/1.2", b"HTTP/2.0", b"http/1.1", b"HTTP/0.9", b"HTTP/1.10")
HOSTS: dict[str, tuple[bytes, ...]] = {
    "host": (b"Host: a.example",),
    "host-upper-with-port": (b"Host: A.EXAMPLE:8080",),
    "no-host": (),
    "host-twice": (b"Host: a.example", b"Host: a.example"),
    "host-twice-differing": (b"Host: a.example", b"Host: b.example"),
    "host-userinfo": (b"Host: user@a.example",),
    "host-empty": (b"Host:",),
    "host-ipv6": (b"Host: [::1]:80",),
    "host-unknown": (b"Host: b.example",),
    "host-nbsp": (b"Host: \xa0a.example",),
    "host-list": (b"Host: a.example,b.example",),
    "host-empty-port": (b"Host: a.example:",),
    "host-path": (b"Host: a.example/x",),
}
EXTRAS: dict[str, tuple[bytes, ...]] = {
    "plain": (),
    "obs-text": (b"X-Obs: caf\xe9\x80\xff",),
    "empty-value": (b"X-Empty:",),
    "tab-in-value": (b"X-Tab: a\tb",),
    "obs-fold": (b"X-Fold: a", b" b"),
    "ctl-in-value": (b"X-Ctl: a\x01b",),
    "nul-in-value": (b"X-Nul: a\x00b",),
    "del-in-value": (b"X-Del: a\x7fb",),
    "no-colon": (b"NoColon",),
    "space-before-colon": (b"X-Sp : v",),
    "name-not-a-token": (b"X(a): v",),
    "two-cookies": (b"Cookie: a=1", b"Cookie: b=2"),
    "connection-close": (b"Connection: close",),
}
CL = b"Content-Length: "
TE = b"Transfer-Encoding: "
BODIES: dict[str, tuple[tuple[bytes, ...], bytes]] = {
    "no-body": ((), b""),
    "cl": ((CL + b"5",), b"hello"),
    "cl-0": ((CL + b"0",), b""),
    "cl-leading-zeros": ((CL + b"005",), b"hello"),
    "cl-plus": ((CL + b"+5",), b"hello"),
    "cl-minus": ((CL + b"-1",), b"hello"),
    "cl-two-numbers": ((CL + b"5 5",), b"hello"),
    "cl-hex": ((CL + b"0x5",), b"hello"),
    "cl-twice-equal": ((CL + b"5", CL + b"5"), b"hello"),
    "cl-twice-differing": ((CL + b"5", CL + b"6"), b"hello!"),
    "cl-list-equal": ((CL + b"5, 5",), b"hello"),
    "cl-over-64-bits": ((CL + b"99999999999999999999999",), b""),
    "cl-nbsp": ((CL + b"\xa05",), b"hello"),
    "cl-nel": ((CL + b"5\x85",), b"hello"),
    "te-chunked": ((TE + b"chunked",), chunked(b"hello world", 4)),
    "te-chunked-mixed-case": ((TE + b"Chunked",), chunked(b"hello world", 4)),
    "te-upper-hex": ((TE + b"chunked",), b"A\r\n0123456789\r\n0\r\n\r\n"),
    "te-extension": ((TE + b"chunked",), b"5;a=b\r\nhello\r\n0\r\n\r\n"),
    "te-quoted-extension": ((TE + b"chunked",), b'5;a="b"\r\nhello\r\n0\r\n\r\n'),
    "te-bare-extension": ((TE + b"chunked",), b"5;a\r\nhello\r\n0\r\n\r\n"),
    "te-trailer": ((TE + b"chunked",), b"5\r\nhello\r\n0\r\nX-Trailer: v\r\n\r\n"),
    "te-gzip-chunked": ((TE + b"gzip, chunked",), chunked(b"hello", 5)),
    "te-chunked-gzip": ((TE + b"chunked, gzip",), chunked(b"hello", 5)),
    "te-gzip": ((TE + b"gzip",), b"hello"),
    "te-identity": ((TE + b"identity",), b"hello"),
    "te-twice": ((TE + b"chunked", TE + b"chunked"), chunked(b"hello", 5)),
    "te-with-parameter": ((TE + b"chunked;q=1",), chunked(b"hello", 5)),
    "te-nbsp": ((TE + b"\xa0chunked",), chunked(b"hello", 5)),
    "te-nel": ((TE + b"\x85chunked",), chunked(b"hello", 5)),
    "cl-and-te": ((CL + b"10", TE + b"chunked"), chunked(b"hello", 5)),
    "te-and-cl": ((TE + b"chunked", CL + b"10"), chunked(b"hello", 5)),
    "chunk-not-hex": ((TE + b"chunked",), b"zz\r\nhello\r\n0\r\n\r\n"),
    "chunk-size-space": ((TE + b"chunked",), b"5 \r\nhello\r\n0\r\n\r\n"),
    "chunk-size-0x": ((TE + b"chunked",), b"0x5\r\nhello\r\n0\r\n\r\n"),
    "chunk-negative": ((TE + b"chunked",), b"-5\r\nhello\r\n0\r\n\r\n"),
    "chunk-bare-lf": ((TE + b"chunked",), b"5\nhello\r\n0\r\n\r\n"),
    "chunk-extension-bare-lf": ((TE + b"chunked",), b"5;a=b\nhello\r\n0\r\n\r\n"),
    "chunk-no-crlf": ((TE + b"chunked",), b"5\r\nhelloXX\r\n0\r\n\r\n"),
    "chunk-garbage-trailer": ((TE + b"chunked",), b"0\r\ngarbage\r\n\r\n"),
    "chunk-classic-desync": ((TE + b"chunked",), b"3\r\nabc\r\n\r\n0\r\n\r\n"),
}
ODD_REQUEST_LINES = (
    b"GET  {p} HTTP/1.1",
    b"GET\t{p} HTTP/1.1",
    b"GET {p}  HTTP/1.1",
    b"GET {p} HTTP/1.1 ",
    b" GET {p} HTTP/1.1",
    b"GET {p}",
    b"GET HTTP/1.1",
)
#: Bytes a mutation inserts: whitespace of all kinds, line ends, controls, obs-text, delimiters.
INTERESTING = b' \t\r\n\x00\x0b\x7f\x80\xa0\xff,;:"=@/'


def build(line: bytes, lines: Sequence[bytes], body: bytes = b"", ending: bytes = b"\r\n") -> bytes:
    return b"".join(x + ending for x in (line, *lines)) + ending + body


def systematic() -> Iterator[tuple[str, bytes]]:
    """Every variant of each part, the other parts plain."""
    host = HOSTS["host"]
    for name, (framing, body) in BODIES.items():
        yield f"body {name}", build(b"POST {p} HTTP/1.1", [*host, *framing], body)
    for name in ("cl", "te-chunked"):
        framing, body = BODIES[name]
        yield f"HEAD with body {name}", build(b"HEAD {p} HTTP/1.1", [*host, *framing], body)
    for method in METHODS:
        for version in VERSIONS:
            yield f"line {method!r} {version!r}", build(method + b" {p} " + version, host)
    for target in TARGETS:
        for method in (b"GET", b"OPTIONS"):
            yield f"target {method!r} {target!r}", build(method + b" " + target + b" HTTP/1.1", host)
    for name, lines in HOSTS.items():
        for version in (b"HTTP/1.1", b"HTTP/1.0"):
            yield f"{name} {version!r}", build(b"GET {p} " + version, lines)
    for name, lines in EXTRAS.items():
        yield f"header {name}", build(b"GET {p} HTTP/1.1", [*host, *lines])
    for line in ODD_REQUEST_LINES:
        yield f"request line {line!r}", build(line, host)
    for ending in (b"\n", b"\r"):
        yield f"line ending {ending!r}", build(b"GET {p} HTTP/1.1", host, ending=ending)
    yield "one bare LF", b"GET {p} HTTP/1.1\r\nHost: a.example\nX-A: b\r\n\r\n"
    for prefix in (b"\r\n", b"\r\n\r\n", b"\n"):
        yield f"prefix {prefix!r}", prefix + build(b"GET {p} HTTP/1.1", host)


def combined(rng: random.Random, count: int) -> Iterator[tuple[str, bytes]]:
    """Random combinations of one variant of each part."""
    for _ in range(count):
        method, target, version = rng.choice(METHODS), rng.choice(TARGETS), rng.choice(VERSIONS)
        host, extra, framing = rng.choice(list(HOSTS)), rng.choice(list(EXTRAS)), rng.choice(list(BODIES))
        lines, body = BODIES[framing]
        name = f"combined {method!r} {target!r} {version!r} {host} {extra} {framing}"
        yield name, build(method + b" " + target + b" " + version, [*HOSTS[host], *EXTRAS[extra], *lines], body)


def case_path(index: int) -> bytes:
    """The path that stands for ``{p}`` in case number ``index``."""
    return b"/c%04d" % index


def mutated(rng: random.Random, bases: Sequence[bytes], count: int) -> Iterator[tuple[str, bytes]]:
    """Random cases with one or two mutations of the head: a byte inserted, deleted or
    changed in case, a CRLF made bare, a line repeated. Each gets its own path first."""
    for number in range(count):
        chosen = rng.randrange(len(bases))
        data = bytearray(bases[chosen].replace(case_path(chosen), case_path(len(bases) + number)))
        operations = []
        for _ in range(rng.randint(1, 2)):
            head_end = data.find(b"\r\n\r\n")
            end = head_end if head_end > 0 else len(data)
            position = rng.randrange(end)
            line_ends = [m.start() for m in re.finditer(rb"\r\n", data[:end])]
            operation = rng.choice(("insert", "delete", "case", "bare-line-end", "repeat-line"))
            if operation == "insert":
                data[position:position] = bytes([rng.choice(INTERESTING)])
            elif operation == "delete":
                del data[position]
            elif operation == "case":
                data[position : position + 1] = bytes(data[position : position + 1]).swapcase()
            elif operation == "bare-line-end" and line_ends:
                position = rng.choice(line_ends)
                data[position : position + 2] = rng.choice((b"\n", b"\r"))
            elif operation == "repeat-line" and line_ends:
                position = rng.choice(line_ends)  # the line after this CRLF is written twice
                stop = data.find(b"\r\n", position + 2)
                data[stop:stop] = data[position:stop]
            operations.append(f"{operation}@{position}")
        yield f"mutated ({', '.join(operations)})", bytes(data)


def generate_cases() -> list[Case]:
    """The cases, the same on every run; each has its own path (see TARGETS), and none
    is the same as another but for it."""
    rng = random.Random(SEED)
    made = [
        (name, template.replace(b"{p}", case_path(index)))
        for index, (name, template) in enumerate([*systematic(), *combined(rng, 120)])
    ]
    made += list(mutated(rng, [data for _, data in made], 160))
    cases, seen = [], set()
    for name, data in made:
        shape = re.sub(rb"/c[0-9]{4}", b"{p}", data)
        if shape not in seen and h11_reading(data) is not None:
            seen.add(shape)
            cases.append(Case(name, data))
    return cases


# --------------------------------------------------------------------------------------
# the two readings


@dataclass(frozen=True)
class H11Reading:
    verdict: Verdict
    method: bytes = b""
    target: bytes = b""
    body: bytes = b""
    error: str = ""


def h11_reading(data: bytes) -> H11Reading | None:
    """What h11 makes of ``data``: one complete request, or a refusal; None when it would
    wait for more bytes."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(data)
    head: h11.Request | None = None
    body = b""
    try:
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                return None
            if isinstance(event, h11.Request):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                return H11Reading("accepts", bytes(head.method), bytes(head.target), body)
    except h11.RemoteProtocolError as exc:
        return H11Reading("refuses", error=str(exc))


@dataclass(frozen=True)
class Outcome:
    """What activator did with a case."""

    kind: Literal["forwards", "refuses", "broken"]
    status: int = 0
    reason: str | None = None
    detail: str = ""

    def describe(self) -> str:
        if self.kind == "forwards":
            return "forwards"
        return f"{self.kind} {self.status} {self.reason} {self.detail}".strip()


def send_case(address: str, case: Case) -> Outcome:
    request = LooseRequest.of(case.data)
    try:
        with Wire(address, CASE_TIMEOUT) as connection:
            connection.send(case.data)
            _, answer = connection.read_final_response(head_request=request.method == b"HEAD")
    except (AnswerMissing, OSError) as exc:
        return Outcome("broken", detail=f"no answer: {exc}")
    if answer.activator_reason is not None and answer.status >= 400:
        return Outcome("refuses", answer.status, answer.activator_reason)
    if (answer.status, answer.activator_reason) == (200, None) and (
        request.method == b"HEAD" or answer.body.startswith(b"served ")
    ):
        return Outcome("forwards")  # (whether it forwarded what h11 read: see the last test)
    return Outcome(
        "broken", answer.status, answer.activator_reason, f"not an answer of either kind: {answer.describe()}"
    )


# --------------------------------------------------------------------------------------
# the intended differences


@dataclass(frozen=True)
class LooseRequest:
    """A forgiving reading of a case's head, for the predicates below (never a verdict)."""

    leading_empty_line: bool
    method: bytes
    target: bytes
    version: bytes
    header_lines: tuple[bytes, ...]  # raw, line ends removed
    bare_lf_in_head: bool
    body: bytes

    @classmethod
    def of(cls, data: bytes) -> LooseRequest:
        rest = data.lstrip(b"\r\n")
        lines, position = [], 0
        while (newline := rest.find(b"\n", position)) >= 0:
            line, position = rest[position:newline], newline + 1
            if line in (b"", b"\r"):
                break
            lines.append(line.removesuffix(b"\r"))
        else:
            lines.append(rest[position:])
            position = len(rest)
        words = (lines[0] if lines else b"").split(b" ")
        return cls(
            leading_empty_line=rest != data,
            method=words[0],
            target=words[1] if len(words) > 1 else b"",
            version=words[2] if len(words) > 2 else b"",
            header_lines=tuple(lines[1:]),
            bare_lf_in_head=re.search(rb"(?<!\r)\n", rest[:position]) is not None,
            body=rest[position:],
        )

    def field_values(self, name: bytes) -> list[bytes]:
        """The value of each ``name`` header line, in order."""
        values = []
        for line in self.header_lines:
            header, colon, value = line.partition(b":")
            if colon and header.lower() == name:
                values.append(value.strip(b" \t"))
        return values

    def list_values(self, name: bytes) -> list[bytes]:
        """Every comma-separated element of every ``name`` header line."""
        return [part.strip(b" \t") for value in self.field_values(name) for part in value.split(b",")]


#: host[:port]: a reg-name of letters, digits and -._~ (or an IPv4 address, which is one),
#: or a bracketed IPv6 literal; a port of 1-5 digits.
#: RFC 9110 5.5: CTLs other than HTAB are invalid in a field value (a recipient MAY keep them).
CONTROL_IN_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
HOST_PORT = re.compile(rb"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~-]+)(?::[0-9]{1,5})?")


def valid_hosts(request: LooseRequest) -> bool:
    """Exactly one Host line, and it is host[:port] (HTTP/1.0 may have none)."""
    hosts = request.field_values(b"host")
    if not hosts:
        return request.version == b"HTTP/1.0"
    return len(hosts) == 1 and HOST_PORT.fullmatch(hosts[0]) is not None


def routes_to_the_service(request: LooseRequest) -> bool:
    """Whether the Host names a.example (case and port ignored)."""
    hosts = request.field_values(b"host")
    match = HOST_PORT.fullmatch(hosts[0]) if len(hosts) == 1 else None
    return match is not None and match["host"].lower() == b"a.example"


def has_body(request: LooseRequest) -> bool:
    lengths = request.list_values(b"content-length")
    return bool(request.field_values(b"transfer-encoding")) or any(v.strip(b"0") for v in lengths)


@dataclass(frozen=True)
class IntendedDifference:
    reason: str
    h11: Verdict  # what h11 does
    activator: tuple[int, str] | Literal["forwards"]  # what activator does instead
    applies: Callable[[LooseRequest], bool]  # to which requests

    def explains(self, request: LooseRequest, reading: H11Reading, outcome: Outcome) -> bool:
        does = "forwards" if outcome.kind == "forwards" else (outcome.status, outcome.reason)
        return reading.verdict == self.h11 and does == self.activator and self.applies(request)


INTENDED_DIFFERENCES = (
    IntendedDifference(
        "only HTTP/1.0 and HTTP/1.1 are spoken (h11 takes any HTTP/d.d)",
        "accepts",
        (400, "bad-request"),
        lambda r: r.version not in (b"HTTP/1.0", b"HTTP/1.1"),
    ),
    IntendedDifference(
        "not an open proxy: only origin-form targets, and OPTIONS *",
        "accepts",
        (400, "bad-request-target"),
        lambda r: not (r.target.startswith(b"/") or (r.method, r.target) == (b"OPTIONS", b"*")),
    ),
    IntendedDifference(
        "a Host must be host[:port] (h11 takes any value)", "accepts", (400, "bad-host"), lambda r: not valid_hosts(r)
    ),
    IntendedDifference(
        "a Host that names no service is answered 404 (routing, not parsing)",
        "accepts",
        (404, "unknown-host"),
        lambda r: not routes_to_the_service(r),
    ),
    IntendedDifference(
        "Content-Length given twice is refused even when equal (h11 merges them)",
        "accepts",
        (400, "bad-request"),
        lambda r: len(r.list_values(b"content-length")) > 1,
    ),
    IntendedDifference(
        "Content-Length with Transfer-Encoding is refused (h11 lets Transfer-Encoding win)",
        "accepts",
        (400, "bad-request"),
        lambda r: bool(r.field_values(b"content-length") and r.field_values(b"transfer-encoding")),
    ),
    IntendedDifference(
        "Transfer-Encoding in HTTP/1.0 is refused (RFC 9112 6.1)",
        "accepts",
        (400, "bad-request"),
        lambda r: r.version == b"HTTP/1.0" and bool(r.field_values(b"transfer-encoding")),
    ),
    IntendedDifference(
        "a HEAD request with a body is refused",
        "accepts",
        (400, "bad-request"),
        lambda r: r.method == b"HEAD" and has_body(r),
    ),
    IntendedDifference(
        "obsolete line folding is refused (RFC 9112 5.2; h11 unfolds it)",
        "accepts",
        (400, "bad-request"),
        lambda r: any(line[:1] in (b" ", b"\t") for line in r.header_lines),
    ),
    IntendedDifference(
        "control characters other than HTAB in a field value are refused (RFC 9110 5.5; h11 keeps them)",
        "accepts",
        (400, "bad-request"),
        lambda r: any(CONTROL_IN_VALUE.search(line.partition(b":")[2]) for line in r.header_lines),
    ),
    IntendedDifference(
        "bare LF line endings are refused (h11 takes LF for CRLF)",
        "accepts",
        (400, "bad-request"),
        lambda r: r.bare_lf_in_head,
    ),
    IntendedDifference(
        "whitespace after a chunk size is refused (llhttp; h11 allows it)",
        "accepts",
        (400, "client-body"),
        lambda r: re.search(rb"(?m)^[0-9A-Fa-f]+[ \t]+\r$", r.body) is not None,
    ),
    IntendedDifference(
        "empty lines before the request line are skipped (RFC 9112 2.2; h11 refuses them)",
        "refuses",
        "forwards",
        lambda r: r.leading_empty_line,
    ),
)


# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    case: Case
    request: LooseRequest
    reading: H11Reading
    outcome: Outcome
    explained_by: IntendedDifference | None

    def describe(self) -> str:
        h11_said = self.reading.verdict + (f" ({self.reading.error})" if self.reading.error else "")
        return f"{self.case.name}: {self.case.data[:160]!r}\n    h11 {h11_said}; activator {self.outcome.describe()}"


def agrees(reading: H11Reading, outcome: Outcome) -> bool:
    return {"accepts": "forwards", "refuses": "refuses"}[reading.verdict] == outcome.kind


CASES = generate_cases()


@pytest.fixture(scope="module")
def results(proxy: Proxy) -> list[Result]:
    """Every case sent once; the pod's records checked against the forwarded ones."""
    with ThreadPoolExecutor(PARALLEL, thread_name_prefix="case") as pool:
        outcomes = list(pool.map(lambda case: send_case(proxy.act.listen, case), CASES))
    wait_quiet(proxy.act, proxy.pod)
    results = []
    for case, outcome in zip(CASES, outcomes, strict=True):
        request, reading = LooseRequest.of(case.data), h11_reading(case.data)
        assert reading is not None
        explained_by = None
        if not agrees(reading, outcome):
            explained_by = next((d for d in INTENDED_DIFFERENCES if d.explains(request, reading, outcome)), None)
        results.append(Result(case, request, reading, outcome, explained_by))
    return results


def test_activator_and_h11_disagree_only_where_intended(results: list[Result]) -> None:
    unexplained = [r for r in results if not agrees(r.reading, r.outcome) and r.explained_by is None]
    assert not unexplained, f"{len(unexplained)} of {len(results)} cases disagree with h11, unexplained:\n" + "\n".join(
        r.describe() for r in unexplained
    )


def test_every_intended_difference_is_seen(results: list[Result]) -> None:
    seen = Counter(r.explained_by.reason for r in results if r.explained_by is not None)
    unseen = [d.reason for d in INTENDED_DIFFERENCES if not seen[d.reason]]
    assert not unseen, f"intended differences no case showed (remove them, or fix what they describe): {unseen}"


def test_the_pod_got_exactly_the_requests_both_read_the_same_way(proxy: Proxy, results: list[Result]) -> None:
    pod_requests = proxy.pod.requests()
    forwarded = [r for r in results if r.outcome.kind == "forwards"]
    assert len(pod_requests) == len(forwarded), "the pod got requests that activator did not answer as forwarded"
    targets = Counter(request.target for request in pod_requests)
    pod_read = {r.target: (r.method, r.target, r.body) for r in pod_requests if targets[r.target] == 1}
    mismatched = [
        f"{result.describe()}\n    the pod got {pod_read[result.request.target]}"
        for result in forwarded
        if result.reading.verdict == "accepts"
        and result.request.target in pod_read
        and pod_read[result.request.target] != (result.reading.method, result.reading.target, result.reading.body)
    ]
    assert not mismatched, "forwarded requests that are not what h11 read:\n" + "\n".join(mismatched)

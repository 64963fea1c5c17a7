"""Fuzzing the request parser path of a real activator with mutated raw requests.

One ``activator run`` (module-scoped, ``client_timeout: 500ms`` so that a truncated
request costs half a second) in front of one ``tests/backend.py`` pod. Each example is
a file of ``corpus/http/`` (a few hundred bytes: plain, pipelined, chunked, HTTP/1.0,
smuggling attempts, obs-fold, absolute-form, CONNECT...) mutated by byte flips,
truncation, header duplication, random header names and values, and random line
endings, sent on a fresh connection, read until the activator closes it.

Asserted for every example:

- the process is alive, and it closes the connection (client_timeout bounds every
  wait);
- what came back is nothing, or HTTP/1.x responses, each either the pod's (``X-Pod``)
  or activator's own (``X-Activator-Reason``), none a 500;
- the pod received no more requests than the bytes held complete, valid requests (plus
  a last one with a valid head whose body is cut short: bodies stream), as counted by
  :func:`valid_requests`, a reference parser as strict as the activator
  claims to be (RFC 9112 with its refusals): no request turned into two, nothing
  smuggled. And ``/smuggled`` reaches the pod only if the reference parser saw a
  valid request for it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CORPUS = Path(__file__).resolve().parent / "corpus" / "http"
FILES = sorted(CORPUS.glob("*.http"))
CORPUS_BYTES = [f.read_bytes() for f in FILES]

MAX_HEADER_BYTES = 4096
MAX_REQUEST_LINE = 8192  # pywsgi's


@dataclass
class Fuzzed:
    act: Any  # harness.Activator (harness is imported lazily, see conftest)
    pod: Any  # harness.Pod


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    from harness import Activator, Pod, make_config

    limits = {"client_timeout": "500ms", "max_header_bytes": MAX_HEADER_BYTES, "max_body_bytes": 4096}
    with Pod() as pod:
        config = make_config([pod], request_timeout="2s", queue_timeout="5s", top={"limits": limits})
        with Activator(config, workdir=tmp_path_factory.mktemp("fuzz-requests")) as act:
            yield Fuzzed(act, pod)


# -- the reference parser ----------------------------------------------------------------

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_TARGET = re.compile(rb"[\x21-\x7e]+\Z")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_HEX = frozenset(b"0123456789abcdefABCDEF")


class _Stop(Exception):
    """The rest of the bytes cannot be (or would not be) read as requests."""


class _Incomplete(_Stop):
    """A body that is valid so far but ends before its framing says it does."""


def _line(data: bytes, pos: int) -> tuple[bytes, int]:
    end = data.find(b"\n", pos)
    if end < 0:
        raise _Stop("incomplete line")
    return data[pos : end + 1], end + 1


def _chunked_end(data: bytes, pos: int) -> int:
    """Where a chunked body starting at ``pos`` ends (pywsgi's rules); _Stop if never."""
    while True:
        digits = bytearray()
        while True:
            if pos >= len(data):
                raise _Incomplete("incomplete chunk size")
            c = data[pos]
            pos += 1
            if c in (0x0D, 0x3B):  # CR or ;
                break
            if c not in _HEX or len(digits) >= 16:
                raise _Stop("bad chunk size")
            digits.append(c)
        if c == 0x3B:  # extension: up to CR
            cr = data.find(b"\r", pos)
            if cr < 0:
                raise _Incomplete("incomplete extension")
            pos = cr + 1
        if pos >= len(data) and digits:
            raise _Incomplete("incomplete chunk size line")
        if data[pos : pos + 1] != b"\n" or not digits:
            raise _Stop("chunk size line")
        pos += 1
        size = int(digits, 16)
        if size == 0:
            return _trailers_end(data, pos)
        if len(data) < pos + size + 2:
            raise _Incomplete("incomplete chunk")
        if data[pos + size : pos + size + 2] != b"\r\n":
            raise _Stop("chunk data not followed by CRLF")
        pos += size + 2


def _trailers_end(data: bytes, pos: int) -> int:
    """Where the trailer section starting at ``pos`` ends (after its empty line)."""
    while True:
        cr = data.find(b"\r", pos)
        if cr < 0 or cr + 1 == len(data):
            raise _Incomplete("incomplete trailer")
        if data[cr + 1 : cr + 2] != b"\n":
            raise _Stop("trailer")
        empty = cr == pos
        pos = cr + 2
        if empty:
            return pos


def _request_line(data: bytes, pos: int) -> tuple[bytes, bytes, bytes, int] | None:
    """``METHOD SP target SP HTTP/1.x`` at ``pos``, after any empty lines (RFC 9112 2.2: a
    server ignores empty lines before a request-line): (method, target, version, where
    the headers start); None when it is not one."""
    line, pos = _line(data, pos)
    while line in (b"\r\n", b"\n"):
        line, pos = _line(data, pos)
    if len(line) >= MAX_REQUEST_LINE:
        return None
    words = line.rstrip(b"\r\n").split(b" ")
    if (
        len(words) != 3
        or not _TOKEN.match(words[0])
        or not _TARGET.match(words[1])
        or words[2] not in (b"HTTP/1.1", b"HTTP/1.0")
    ):
        return None
    return words[0], words[1], words[2], pos


def _header_fields(data: bytes, pos: int) -> tuple[list[tuple[bytes, bytes]], int]:
    """The header lines at ``pos`` up to the empty line: (lower-case name, value) pairs, and
    where the body starts. Raises :class:`_Stop` on obs-fold or a malformed line."""
    headers: list[tuple[bytes, bytes]] = []
    while True:
        raw, pos = _line(data, pos)
        if raw in (b"\r\n", b"\n"):
            return headers, pos
        if raw[:1] in (b" ", b"\t"):
            raise _Stop("obs-fold")
        name, colon, value = raw.rstrip(b"\r\n").partition(b":")
        if not colon or not _TOKEN.match(name):
            raise _Stop("header line")
        value = value.strip(b" \t")
        if _BAD_VALUE.search(value):
            raise _Stop("header value")
        headers.append((name.lower(), value))


def _body_end(data: bytes, pos: int, method: bytes, version: bytes, headers: list[tuple[bytes, bytes]]) -> int | None:
    """Where the body that starts at ``pos`` ends; None when its framing is refused (or it
    is incomplete)."""
    lengths = {v.strip() for n, vs in headers if n == b"content-length" for v in vs.split(b",")}
    encodings = [v for n, v in headers if n == b"transfer-encoding"]
    if encodings:
        if version != b"HTTP/1.1" or lengths or len(encodings) != 1 or encodings[0].lower() != b"chunked":
            return None
        return _chunked_end(data, pos)
    if lengths:
        if len(lengths) != 1 or not re.fullmatch(rb"[0-9]+", next(iter(lengths))):
            return None
        n = int(next(iter(lengths)))
        if n and method == b"HEAD":
            return None
        if len(data) < pos + n:
            raise _Incomplete("incomplete body")
        return pos + n
    return pos


def _keeps_open(version: bytes, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the connection goes on after this request (HTTP/1.1 unless ``close``,
    HTTP/1.0 only with ``keep-alive``)."""
    connection = next((v.lower() for n, v in headers if n == b"connection"), None)
    if version == b"HTTP/1.1":
        return connection is None or b"close" not in connection
    return connection is not None and b"keep-alive" in connection


def valid_requests(data: bytes, *, streamed: bool = False) -> list[bytes]:
    """Targets of the complete, valid requests at the start of ``data``, in order.

    With ``streamed``, also the target of a last request whose head is valid and whose
    body, valid so far, is incomplete: bodies stream, so its head may reach the pod
    (which then sees the body break off).

    As strict as the activator documents itself: ``METHOD SP target SP HTTP/1.x`` (empty
    lines before it ignored),
    token header names, no control characters in values, no obs-fold, one agreed
    Content-Length or exactly ``Transfer-Encoding: chunked`` (HTTP/1.1) and not both.
    Where the activator is allowed to be stricter (limits), this parser is lenient:
    it gives an upper bound. Stops after a request that closes the connection.
    """
    targets: list[bytes] = []
    pos = 0
    try:
        while pos < len(data):
            start = _request_line(data, pos)
            if start is None:
                break
            method, target, version, pos = start
            headers, pos = _header_fields(data, pos)
            try:
                end = _body_end(data, pos, method, version, headers)
            except _Incomplete:
                if streamed:
                    targets.append(target)
                raise
            if end is None:
                break
            pos = end
            targets.append(target)
            if not _keeps_open(version, headers):
                break
    except _Stop:
        pass
    return targets


def test_the_reference_parser_on_the_corpus():
    by_name = {f.name: valid_requests(f.read_bytes()) for f in FILES}
    assert by_name["01_get_close.http"] == [b"/delay?ms=0"]
    assert by_name["02_pipelined_keepalive.http"] == [
        b"/echo/one?a=1",
        b"/echo/two?b=2",
    ]
    assert by_name["04_post_chunked_ext_trailer.http"] == [b"/upload"]
    assert by_name["06_http10_keepalive_post.http"] == [b"/upload", b"/delay"]
    for smuggling in (
        "12_smuggle_cl_te.http",
        "13_smuggle_te_te.http",
        "14_smuggle_cl_cl.http",
        "15_obs_fold.http",
    ):
        assert by_name[smuggling] == [], smuggling
    assert by_name["18_bad_chunk_then_request.http"] == []
    assert 10 <= len(FILES) <= 20
    assert all(len(b) <= 512 for b in CORPUS_BYTES)


# -- mutations ---------------------------------------------------------------------------

HEADER_NAMES = [
    b"Content-Length",
    b"Transfer-Encoding",
    b"Connection",
    b"Host",
    b"Expect",
    b"Upgrade",
    b"content-length",
    b"Transfer-encoding",
    b" Transfer-Encoding",
    b"X-A",
    b"",
    b"X A",
    b"\x00",
]
HEADER_VALUES = [
    b"0",
    b"5",
    b"44",
    b"+5",
    b"-1",
    b"chunked",
    b"gzip, chunked",
    b" chunked",
    b"close",
    b"keep-alive",
    b"100-continue",
    b"\x0bchunked",
    b"chunked\r\nX: y",
    b"",
    b"5, 5",
    b"5, 6",
]
LINE_ENDINGS = [b"\r\n", b"\n", b"\r", b"\r\r\n", b"\n\r", b"\r\n\r\n", b""]


@st.composite
def mutated_request(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(CORPUS_BYTES)))
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(
            st.sampled_from(
                [
                    "flip",
                    "truncate",
                    "dup-header",
                    "add-header",
                    "line-ending",
                    "all-line-endings",
                    "insert",
                    "delete",
                ]
            )
        )
        n = len(data)
        if kind == "flip" and n:
            data[draw(st.integers(0, n - 1))] = draw(st.integers(0, 255))
        elif kind == "truncate" and n:
            del data[draw(st.integers(1, n)) :]
        elif kind == "dup-header":
            lines = bytes(data).split(b"\r\n")
            if len(lines) > 2:
                i = draw(st.integers(1, len(lines) - 1))
                lines.insert(draw(st.integers(1, len(lines))), lines[i])
                data = bytearray(b"\r\n".join(lines))
        elif kind == "add-header":
            name = draw(st.sampled_from(HEADER_NAMES) | st.binary(min_size=1, max_size=12))
            value = draw(st.sampled_from(HEADER_VALUES) | st.binary(max_size=20))
            first = bytes(data).find(b"\n")
            if first >= 0:
                data[first + 1 : first + 1] = name + b": " + value + b"\r\n"
        elif kind == "line-ending":
            ends = [m.start() for m in re.finditer(rb"\r\n", bytes(data))]
            if ends:
                at = draw(st.sampled_from(ends))
                data[at : at + 2] = draw(st.sampled_from(LINE_ENDINGS))
        elif kind == "all-line-endings":
            data = bytearray(bytes(data).replace(b"\r\n", draw(st.sampled_from(LINE_ENDINGS))))
        elif kind == "insert":
            at = draw(st.integers(0, n))
            data[at:at] = draw(
                st.sampled_from(
                    [
                        b" ",
                        b"\t",
                        b"\x00",
                        b"\r",
                        b"\n",
                        b":",
                        b";",
                        b"0",
                        b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
                    ]
                )
                | st.binary(min_size=1, max_size=6)
            )
        elif kind == "delete" and n:
            at = draw(st.integers(0, n - 1))
            del data[at : at + draw(st.integers(1, 8))]
    return bytes(data)


# -- the check ---------------------------------------------------------------------------


def exchange(act: Any, data: bytes) -> bytes:
    from harness import send_raw

    sock = send_raw(act.listen, data, timeout=30)
    chunks = []
    try:
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break  # the activator closed with our bytes unread: a closed connection
            except TimeoutError:
                pytest.fail(f"the activator kept the connection open for 30 s after {data!r}")
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        sock.close()
    return b"".join(chunks)


_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([1-5][0-9][0-9]) [^\r\n]*\r\n")


def parse_responses(answer: bytes) -> list[tuple[int, dict[bytes, bytes]]]:
    """(status, headers) of every response in ``answer``; asserts they are well formed
    (a body is framed by Content-Length or chunked; a HEAD answer has none)."""
    out = []
    pos = 0
    while pos < len(answer):
        m = _STATUS_LINE.match(answer, pos)
        assert m, f"not a status line at {pos}: {answer[pos : pos + 80]!r} in {answer!r}"
        end = answer.find(b"\r\n\r\n", m.end() - 2)
        assert end >= 0, f"incomplete response head: {answer[pos:]!r}"
        headers = {}
        for line in answer[m.end() : end].split(b"\r\n"):
            if line:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
        status = int(m.group(1))
        out.append((status, headers))
        pos = end + 4
        if status == 100:
            continue
        if b"transfer-encoding" in headers:
            try:
                pos = _chunked_end(answer, pos)
            except _Stop:
                break  # a cut stream: the connection ended mid-body
        else:
            n = int(headers.get(b"content-length", b"0"))
            if not (n and _STATUS_LINE.match(answer, pos)):  # after a HEAD the next one follows at once
                pos += n
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=mutated_request())
def test_mutated_requests_never_crash_and_never_multiply(fuzzed: Fuzzed, data: bytes):
    act, pod = fuzzed.act, fuzzed.pod
    before = pod.stats()
    answer = exchange(act, data)
    assert act.is_running(), act.output_tail()
    after = pod.stats()

    for status, headers in parse_responses(answer):
        if status == 100:
            continue
        assert b"x-pod" in headers or b"x-activator-reason" in headers, (
            status,
            headers,
            data,
        )
        assert status != 500, (answer, data)

    expected = valid_requests(data, streamed=True)
    got = after["count"] - before["count"]
    assert got <= len(expected), (
        f"the pod got {got} requests from {len(expected)} valid ones (a last, incomplete "
        f"one counted) in {data!r}: "
        f"{after['paths']} (was {before['paths']})"
    )
    if not any(b"/smuggled" in t for t in expected):
        assert after["paths"].get("/smuggled", 0) == before["paths"].get("/smuggled", 0), data


def test_zz_after_the_fuzzing_the_activator_serves_and_is_idle(fuzzed: Fuzzed):
    from harness import request

    act = fuzzed.act
    assert act.is_running()
    assert request(act.listen, path="/delay?ms=0").status == 200
    st = act.wait_idle("api")
    assert st["services"]["api"]["in_flight"] == 0

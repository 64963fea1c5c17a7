"""End to end: hostile and broken requests are refused before they reach a pod (issue 7,
point 3).

Raw bytes over a socket to one real activator (``limits.max_header_bytes: 4096``,
``limits.max_body_bytes: 1000``) in front of one ``tests/backend.py`` pod. Every case
checks the status, ``X-Activator-Reason``, that the connection is closed after the
refusal, and that the pod's request count did not move. Smuggling attempts carry a
pipelined ``GET /smuggled``: the pod must never see that path. At the end the process
is still alive and serves a normal request.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import SERVICE, Activator, Pod, make_config, parse_head, read_all, request, send_raw, wait_until

pytestmark = pytest.mark.binary

MAX_HEADER_BYTES = 4096
MAX_BODY_BYTES = 1000
SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"


class Setup:
    def __init__(self, act: Activator, pod: Pod) -> None:
        self.act = act
        self.pod = pod


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    limits = {"max_header_bytes": MAX_HEADER_BYTES, "max_body_bytes": MAX_BODY_BYTES, "client_timeout": "5s"}
    with (
        Pod() as pod,
        Activator(make_config([pod], top={"limits": limits}), workdir=tmp_path_factory.mktemp("bad-input")) as act,
    ):
        yield Setup(act, pod)


def exchange(setup: Setup, data: bytes, *, shut_write: bool = False) -> bytes:
    """Send ``data`` on a new connection, read until the activator closes it.

    A connection the activator keeps open makes ``read_all`` time out, which fails
    the test: every refusal must end its connection."""
    sock = send_raw(setup.act.listen, data, timeout=30)
    try:
        if shut_write:
            sock.shutdown(socket.SHUT_WR)
        try:
            return read_all(sock)
        except ConnectionResetError:
            pytest.fail("connection reset instead of an answer")
    finally:
        sock.close()


def responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Every response in ``data`` (Content-Length framed, as activator's own are)."""
    out = []
    rest = data
    while rest:
        head, sep, rest = rest.partition(b"\r\n\r\n")
        assert sep, f"incomplete response head: {head[:200]!r}"
        status, headers = parse_head(head)
        n = int(headers.get("content-length", "0"))
        out.append((status, headers, rest[:n]))
        rest = rest[n:]
    return out


def assert_refused(setup: Setup, data: bytes, status: int, reason: str, **kw: Any) -> None:
    before = setup.pod.stats()
    answer = exchange(setup, data, **kw)
    got = responses(answer)
    assert got, "no answer, the connection was just closed"
    assert len(got) == 1, f"more than one answer (the connection went on): {answer!r}"
    code, headers, _ = got[0]
    assert (code, headers.get("x-activator-reason")) == (status, reason), answer
    after = setup.pod.stats()
    assert after["count"] == before["count"], f"the pod got {after['paths']} (was {before['paths']})"
    assert "/smuggled" not in after["paths"]


def req(head: bytes, body: bytes = b"", *, line: bytes = b"POST /echo HTTP/1.1") -> bytes:
    return line + b"\r\nHost: x\r\n" + head + b"\r\n" + body


# --------------------------------------------------------------------------------------
# request lines

BAD_REQUEST_LINES = {
    "missing-version": b"GET /delay",
    "http-0.9": b"GET /",
    "http-2.0": b"GET / HTTP/2.0",
    "http-1.1-lowercase": b"GET / http/1.1",
    "tab-separated": b"GET\t/\tHTTP/1.1",
    "double-space": b"GET  / HTTP/1.1",
    "trailing-space": b"GET / HTTP/1.1 ",
    "leading-space": b" GET / HTTP/1.1",
    "nul-in-method": b"G\x00T / HTTP/1.1",
    "nul-first": b"\x00GET / HTTP/1.1",
    "method-not-a-token": b"GE(T / HTTP/1.1",
    "only-version": b"HTTP/1.1",
}


@pytest.mark.parametrize("line", BAD_REQUEST_LINES.values(), ids=BAD_REQUEST_LINES.keys())
def test_malformed_request_lines_are_400(setup, line):
    assert_refused(setup, line + b"\r\nHost: x\r\n\r\n", 400, "bad-request")


BAD_TARGET_LINES = {
    # Any token is a method: then what llhttp reads as a target is none.
    "lowercase-garbage": b"hello world",
    "three-garbage-words": b"asdf qwer zxcv",
    "nul-in-target": b"GET /a\x00b HTTP/1.1",
    "non-ascii-target": b"GET /caf\xc3\xa9 HTTP/1.1",
    "control-in-target": b"GET /a\x7fb HTTP/1.1",
}


@pytest.mark.parametrize("line", BAD_TARGET_LINES.values(), ids=BAD_TARGET_LINES.keys())
def test_malformed_request_targets_are_400(setup, line):
    assert_refused(setup, line + b"\r\nHost: x\r\n\r\n", 400, "bad-request-target")


def test_request_line_over_8k_is_414(setup):
    assert_refused(
        setup,
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        414,
        "request-line-too-long",
    )


# --------------------------------------------------------------------------------------
# header lines

BAD_HEADERS = {
    "ctl-in-value": b"X-A: a\x01b",
    "nul-in-value": b"X-A: a\x00b",
    "bare-cr-in-value": b"X-A: a\rTransfer-Encoding: chunked",
    "del-in-value": b"X-A: a\x7fb",
    "esc-in-value": b"X-A: \x1b[31m",
    "space-in-name": b"Bad Name: v",
    "space-before-colon": b"Host : x",
    "tab-before-colon": b"X-A\t: v",
    "no-colon": b"NoColonHere",
    "empty-name": b": value",
    "name-not-a-token": b"X(a): v",
    "non-ascii-name": b"X-\xc3\xa9: v",
    "nul-in-name": b"X\x00A: v",
    "obs-fold-space": b"X-A: a\r\n b",
    "obs-fold-tab": b"X-A: a\r\n\tb",
    "obs-fold-hiding-te": b"X-A: a\r\n Transfer-Encoding: chunked",
    "leading-space-first-header": b" X-A: a",
}


@pytest.mark.parametrize("header", BAD_HEADERS.values(), ids=BAD_HEADERS.keys())
def test_invalid_header_lines_are_400(setup, header):
    assert_refused(
        setup,
        b"GET /delay HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n",
        400,
        "bad-request",
    )


def test_head_cut_short_is_400(setup):
    assert_refused(
        setup,
        b"GET /delay HTTP/1.1\r\nHost: x\r\nX-A: b",
        400,
        "bad-request",
        shut_write=True,
    )


# --------------------------------------------------------------------------------------
# limits


def _headers_of(total: int) -> bytes:
    """Header lines adding up to about ``total`` bytes."""
    lines = b"".join(b"X-Fill-%03d: %s\r\n" % (i, b"v" * 86) for i in range(total // 100))
    return lines


def test_header_section_over_the_limit_is_431(setup):
    assert_refused(
        setup,
        b"GET /delay HTTP/1.1\r\nHost: x\r\n" + _headers_of(5000) + b"\r\n",
        431,
        "headers-too-large",
    )


def test_one_header_line_over_the_limit_is_431(setup):
    assert_refused(
        setup,
        b"GET /delay HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 5000 + b"\r\n\r\n",
        431,
        "headers-too-large",
    )


def test_many_tiny_headers_over_the_limit_are_431(setup):
    assert_refused(
        setup,
        b"GET /delay HTTP/1.1\r\n" + b"a: b\r\n" * 1000 + b"\r\n",
        431,
        "headers-too-large",
    )


def test_header_section_under_the_limit_passes(setup):
    # The control: the limit is the configured one, not something smaller.
    count = setup.pod.stats()["count"]
    answer = exchange(
        setup,
        b"GET /delay HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + _headers_of(3800) + b"\r\n",
    )
    assert responses(answer)[0][0] == 200, answer[:300]
    assert setup.pod.stats()["count"] == count + 1


def test_content_length_over_max_body_bytes_is_413(setup):
    # Refused on the head alone: the body is never sent.
    assert_refused(setup, req(b"Content-Length: 2000\r\n"), 413, "body-too-large")


def test_content_length_too_large_for_64_bits_is_400_at_once(setup):
    assert_refused(
        setup,
        req(b"Content-Length: 99999999999999999999999999\r\n"),
        400,
        "bad-request",
    )


def test_body_at_max_body_bytes_passes(setup):
    count = setup.pod.stats()["count"]
    body = b"b" * MAX_BODY_BYTES
    answer = exchange(setup, req(b"Content-Length: %d\r\nConnection: close\r\n" % len(body), body))
    assert responses(answer)[0][0] == 200, answer[:300]
    assert setup.pod.stats()["count"] == count + 1


def _chunked(body: bytes, piece: int) -> bytes:
    out = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + piece]), body[i : i + piece]) for i in range(0, len(body), piece)
    )
    return out + b"0\r\n\r\n"


def test_chunked_body_growing_past_the_limit_never_reaches_the_pod_and_ends_the_connection(
    setup,
):
    before = setup.pod.stats()
    data = req(
        b"Transfer-Encoding: chunked\r\n",
        _chunked(b"c" * 2000, 500),
        line=b"POST /upload HTTP/1.1",
    )
    answer = exchange(setup, data + b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
    got = responses(answer)
    assert len(got) == 1, answer  # the pipelined request after it is not served
    code, headers, _ = got[0]
    assert code in (400, 413) and headers.get("x-activator-reason"), answer
    after = setup.pod.stats()
    assert after["count"] == before["count"], after["paths"]


def test_chunked_body_growing_past_the_limit_is_413(setup):
    data = req(
        b"Transfer-Encoding: chunked\r\n",
        _chunked(b"c" * 2000, 500),
        line=b"POST /upload HTTP/1.1",
    )
    assert_refused(setup, data, 413, "body-too-large")


def _with_trailers(trailer_lines: bytes) -> bytes:
    """A chunked POST whose last chunk carries ``trailer_lines`` (ending in CRLF, or cut off)."""
    return req(b"Transfer-Encoding: chunked\r\n", b"5\r\nhello\r\n0\r\n" + trailer_lines, line=b"POST /upload HTTP/1.1")


def test_trailer_section_over_the_limit_is_431(setup):
    # The trailers are a field section of their own, under the same limit as the head's.
    assert_refused(setup, _with_trailers(_headers_of(5000) + b"\r\n") + SMUGGLED, 431, "headers-too-large")


def test_many_tiny_trailers_over_the_limit_are_431(setup):
    assert_refused(setup, _with_trailers(b"a: b\r\n" * 1000 + b"\r\n") + SMUGGLED, 431, "headers-too-large")


def test_trailer_section_under_the_limit_passes(setup):
    # The control: trailers within the limit reach the pod with their request.
    count = setup.pod.stats()["count"]
    data = req(
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n",
        b"5\r\nhello\r\n0\r\n" + _headers_of(3800) + b"\r\n",
    )
    answer = exchange(setup, data)
    assert responses(answer)[0][0] == 200, answer[:300]
    assert setup.pod.stats()["count"] == count + 1


class RecordingPod:
    """A pod that never answers: it records every byte each connection brought."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.received: list[bytearray] = []
        self.ended = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            buf = bytearray()
            with self._lock:
                self.received.append(buf)
            threading.Thread(target=self._read, args=(conn, buf), daemon=True).start()

    def _read(self, conn: socket.socket, buf: bytearray) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    with self._lock:
                        self.ended += 1
                    return
                buf.extend(data)

    def close(self) -> None:
        self._listener.close()


def test_large_chunked_body_over_the_limit_is_cut_before_the_pod_has_it_all(activator_factory, tmp_path: Path):
    pod = RecordingPod()
    try:
        limit = 100_000  # over the first 64 KiB piece, so the pod does get a head and a part
        act = activator_factory(
            {
                "access_log": False,
                "limits": {"max_body_bytes": limit},
                "services": {
                    "api": {
                        "hosts": ["*"],
                        "container_concurrency": 1,
                        "probe": None,
                        "request_timeout": "30s",
                        "pods": [pod.address],
                    }
                },
            }
        )
        body = bytes(range(256)) * 1000  # 256 000 bytes, in 4 KiB chunks
        answer = b""  # stays empty when the cut comes as a reset
        sock = send_raw(
            act.listen,
            b"POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        )
        try:
            with contextlib.suppress(OSError):  # the activator may stop reading and close
                sock.sendall(_chunked(body, 4096))
            with contextlib.suppress(ConnectionResetError):
                answer = read_all(sock)
        finally:
            sock.close()
        wait_until(
            lambda: pod.ended == len(pod.received) >= 1,
            message="the pod connection was closed",
        )
        got = b"".join(pod.received)
        assert got.startswith(b"POST /upload HTTP/1.1\r\n")
        assert not got.endswith(b"0\r\n\r\n"), "the pod got a complete chunked body"
        assert len(got) < limit + 10_000
        if answer:
            code, headers, _ = responses(answer)[0]
            assert code in (400, 413) and headers.get("x-activator-reason"), answer
        act.wait_idle(SERVICE, message="slot released")
    finally:
        pod.close()


# --------------------------------------------------------------------------------------
# framing: Content-Length and Transfer-Encoding

FRAMING = {
    "cl-and-te": (
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
        400,
        "bad-request",
    ),
    "te-and-cl": (
        b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
        400,
        "bad-request",
    ),
    "two-different-cl": (
        b"Content-Length: 5\r\nContent-Length: 6\r\n",
        400,
        "bad-request",
    ),
    "cl-list-differs": (b"Content-Length: 5, 6\r\n", 400, "bad-request"),
    "cl-plus": (b"Content-Length: +5\r\n", 400, "bad-request"),
    "cl-minus": (b"Content-Length: -1\r\n", 400, "bad-request"),
    "cl-hex": (b"Content-Length: 0x5\r\n", 400, "bad-request"),
    "cl-two-numbers": (b"Content-Length: 5 5\r\n", 400, "bad-request"),
    "cl-empty": (b"Content-Length: \r\n", 400, "bad-request"),
    "cl-decimal": (b"Content-Length: 5.0\r\n", 400, "bad-request"),
    "cl-unicode-digit": (b"Content-Length: \xd9\xa5\r\n", 400, "bad-request"),
    "te-gzip-chunked": (
        b"Transfer-Encoding: gzip, chunked\r\n",
        501,
        "unsupported-transfer-encoding",
    ),
    "te-identity": (
        b"Transfer-Encoding: identity\r\n",
        501,
        "unsupported-transfer-encoding",
    ),
    "te-chunked-twice-one-line": (
        b"Transfer-Encoding: chunked, chunked\r\n",
        501,
        "unsupported-transfer-encoding",
    ),
    "te-chunked-twice": (
        b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
        501,
        "unsupported-transfer-encoding",
    ),
    "te-xchunked": (
        b"Transfer-Encoding: xchunked\r\n",
        501,
        "unsupported-transfer-encoding",
    ),
    "te-empty": (b"Transfer-Encoding: \r\n", 501, "unsupported-transfer-encoding"),
}


@pytest.mark.parametrize(("head", "status", "reason"), FRAMING.values(), ids=FRAMING.keys())
def test_bad_framing_is_refused(setup, head, status, reason):
    assert_refused(setup, req(head, b"hello"), status, reason)


def test_transfer_encoding_in_http_1_0_is_400(setup):
    assert_refused(
        setup,
        req(
            b"Transfer-Encoding: chunked\r\n",
            b"5\r\nhello\r\n0\r\n\r\n",
            line=b"POST /echo HTTP/1.0",
        ),
        400,
        "bad-request",
    )


def test_head_with_a_body_is_400(setup):
    assert_refused(
        setup,
        req(b"Content-Length: 5\r\n", b"hello", line=b"HEAD /delay HTTP/1.1"),
        400,
        "bad-request",
    )


# --------------------------------------------------------------------------------------
# smuggling: the pipelined /smuggled must never reach the pod

SMUGGLING = {
    # the brief's CL.TE: a front-end going by Content-Length would forward both
    "cl-te": (
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
        b"0\r\n\r\n",
        400,
        "bad-request",
    ),
    "te-cl": (
        b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n",
        b"0\r\n\r\n",
        400,
        "bad-request",
    ),
    "te-leading-space": (
        b"Content-Length: 4\r\n Transfer-Encoding: chunked\r\n",
        b"0\r\n\r\n",
        400,
        "bad-request",
    ),
    "te-space-before-colon": (
        b"Content-Length: 4\r\nTransfer-Encoding : chunked\r\n",
        b"0\r\n\r\n",
        400,
        "bad-request",
    ),
    "te-vertical-tab": (
        b"Transfer-Encoding:\x0bchunked\r\n",
        b"0\r\n\r\n",
        400,
        "bad-request",
    ),
    "te-twice": (
        b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
        b"0\r\n\r\n",
        501,
        "unsupported-transfer-encoding",
    ),
    "te-te-obfuscated": (
        b"Transfer-Encoding: chunked\r\nTransfer-encoding: cow\r\n",
        b"0\r\n\r\n",
        501,
        "unsupported-transfer-encoding",
    ),
    "cl-cl": (
        b"Content-Length: 0\r\nContent-Length: %d\r\n" % len(SMUGGLED),
        b"",
        400,
        "bad-request",
    ),
    "cl-cl-same-line": (
        b"Content-Length: 0, %d\r\n" % len(SMUGGLED),
        b"",
        400,
        "bad-request",
    ),
    # malformed chunks: the body's end is unknown, so the connection must end too
    "chunk-size-bare-lf": (
        b"Transfer-Encoding: chunked\r\n",
        b"\n",
        400,
        "client-body",
    ),
    "chunk-size-not-hex": (
        b"Transfer-Encoding: chunked\r\n",
        b"zz\r\nhello\r\n0\r\n\r\n",
        400,
        "client-body",
    ),
    "chunk-size-0x": (
        b"Transfer-Encoding: chunked\r\n",
        b"0x5\r\nhello\r\n0\r\n\r\n",
        400,
        "client-body",
    ),
    "chunk-size-empty": (
        b"Transfer-Encoding: chunked\r\n",
        b"\r\nhello\r\n0\r\n\r\n",
        400,
        "client-body",
    ),
    "chunk-data-too-long": (
        b"Transfer-Encoding: chunked\r\n",
        b"5\r\nhelloXX\r\n0\r\n\r\n",
        400,
        "client-body",
    ),
    "chunk-size-overflow": (
        b"Transfer-Encoding: chunked\r\n",
        b"fffffffffffffffff1\r\nhello\r\n",
        400,
        "client-body",
    ),
}


@pytest.mark.parametrize(("head", "body", "status", "reason"), SMUGGLING.values(), ids=SMUGGLING.keys())
def test_smuggling_attempts_are_refused_and_the_smuggled_request_never_reaches_the_pod(
    setup, head, body, status, reason
):
    assert_refused(setup, req(head, body, line=b"POST /upload HTTP/1.1") + SMUGGLED, status, reason)


def test_good_pipelined_requests_are_each_served_once(setup):
    # The control: a well-framed chunked body followed by a pipelined request is two
    # requests, and both reach the pod, each once.
    before = setup.pod.stats()
    answer = exchange(
        setup,
        req(
            b"Transfer-Encoding: chunked\r\n",
            _chunked(b"hello world", 4),
            line=b"POST /upload HTTP/1.1",
        )
        + b"GET /pipelined HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    got = responses(answer)
    assert [code for code, _, _ in got] == [200, 200], answer
    assert b'"length": 11' in got[0][2]
    after = setup.pod.stats()
    assert after["count"] == before["count"] + 2
    assert after["paths"].get("/pipelined", 0) == before["paths"].get("/pipelined", 0) + 1


# --------------------------------------------------------------------------------------


def test_zz_the_process_survived_everything(setup):
    assert setup.act.is_running(), setup.act.output_tail()
    resp = request(setup.act.listen, path="/delay?ms=0")
    assert resp.status == 200
    assert "/smuggled" not in setup.pod.stats()["paths"]
    st = setup.act.status()["services"]["api"]
    assert st["in_flight"] == 0 and st["queued"] == 0

"""Pod-side rows: what a pod answers reaches the client unchanged, through the real activator.

One activator (a probe configured, ``unhealthy_after: 3``; ``access_log: true``) in front
of one recording pod. Each test scripts the pod's raw answer for its own target and checks
what the client receives:

- an early ``413`` sent before the pod read an 8 MiB upload reaches the client as that 413
  (not a 502), with ``Connection: close``, and counts as an answer: the pod stays
  ``healthy`` with ``failures`` 0 after five in a row;
- interim answers (``103 Early Hints`` with its ``Link`` lines, ``102 Processing``) reach
  the client before the final one, their header lines byte for byte;
- a chunked answer's trailers reach the client;
- an answer whose head's lines end in a bare LF is relayed (the pod is trusted, as
  HAProxy and nginx trust it), its header lines re-spelled with CRLF and trimmed of
  trailing whitespace; bare LFs in chunk framing are not (llhttp has no leniency there);
- repeated ``Link``, ``WWW-Authenticate`` and ``Set-Cookie`` lines are relayed as separate
  lines in the pod's order, also relative to one another;
- a pod writing head and body in two writes without TCP_NODELAY (like ``http.server``)
  is served correctly, request after request, on a kept-alive client connection (its
  latency is the benchmarks' business, not a test's);
- a client hanging up mid-response, or while the pod works on its request (sent at once or
  after a wait for the slot), is logged as ``499 client-gone``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from harness import find_pod, probe_config, wait_until
from recording_pod import Script, Step
from wire import Proxy, RawResponse, Uploader, http_request, proxy_setup, quiet_mark, wait_quiet, wire

pytestmark = pytest.mark.binary

PROBE = probe_config(interval="1s", unhealthy_after=3)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    with proxy_setup(tmp_path_factory.mktemp("responses"), access_log=True, probe=PROBE) as setup:
        setup.act.wait_pod_state("a", setup.pod.address, "healthy")
        yield setup


def exchange(proxy: Proxy, target: bytes, script: Script, *header_lines: bytes) -> list[RawResponse]:
    """GET ``target`` (answered by ``script``) on a fresh connection: the interim answers,
    then the final one."""
    proxy.pod.set_script(target, script)
    wait_quiet(proxy.act, proxy.pod)
    with wire(proxy.act) as connection:
        connection.send(http_request(b"GET " + target + b" HTTP/1.1", *header_lines))
        interim, final = connection.read_final_response()
    return [*interim, final]


def header_lines(head: bytes, names: set[bytes]) -> list[bytes]:
    """The raw lines of ``head`` whose header name (any case) is in ``names``, in order."""
    return [line for line in head.split(b"\r\n")[1:] if line.partition(b":")[0].lower() in names]


# --------------------------------------------------------------------------------------


UPLOAD_BYTES = 8 * 1024 * 1024
EARLY_413 = (
    b"HTTP/1.1 413 Content Too Large\r\nContent-Type: text/plain\r\nContent-Length: 10\r\nConnection: close\r\n\r\n"
)


def test_an_early_413_before_the_pod_read_the_upload_reaches_the_client_and_counts_as_an_answer(proxy: Proxy) -> None:
    proxy.pod.set_script(b"/early-413", Script([EARLY_413 + b"too large\n"], at_head=True, close=True))
    for attempt in range(5):  # more than unhealthy_after: a miscount would eject the pod
        wait_quiet(proxy.act, proxy.pod)
        with wire(proxy.act) as connection:
            connection.send(http_request(b"POST /early-413 HTTP/1.1", b"Content-Length: %d" % UPLOAD_BYTES))
            uploader = Uploader(connection, (b"u" * 65536 for _ in range(UPLOAD_BYTES // 65536)))
            answer = connection.read_response()
            assert (answer.status, answer.activator_reason, answer.body) == (413, None, b"too large\n"), (
                f"attempt {attempt}: {answer.describe()}"
            )
            assert answer.says_close, answer.describe()  # the upload was cut: the connection cannot go on
            assert connection.closed_by_peer(), "connection kept open after an unfinished upload"
            uploader.join()
    wait_quiet(proxy.act, proxy.pod)
    pod = find_pod(proxy.act.status(), "a", proxy.pod.address)
    assert pod is not None and (pod["state"], pod["failures"]) == ("healthy", 0), pod


def test_103_early_hints_then_200_reach_the_client_in_order_byte_for_byte(proxy: Proxy) -> None:
    hints = [b"Link: </style.css>; rel=preload; as=style", b"Link: </app.js>; rel=preload; as=script"]
    script = Script(
        [
            b"HTTP/1.1 103 Early Hints\r\n" + b"".join(line + b"\r\n" for line in hints) + b"\r\n",
            0.2,  # the final answer is still being made: the hints must not wait for it
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nfinal",
        ]
    )
    answers = exchange(proxy, b"/early-hints", script)
    assert [a.status for a in answers] == [103, 200], [a.describe() for a in answers]
    early, final = answers
    assert header_lines(early.head, {b"link"}) == hints, early.describe()
    assert (final.status, final.activator_reason, final.body) == (200, None, b"final"), final.describe()


def test_102_processing_then_200_reach_the_client_in_order(proxy: Proxy) -> None:
    script = Script(
        [
            b"HTTP/1.1 102 Processing\r\n\r\n",
            0.2,
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 4\r\n\r\ndone",
        ]
    )
    answers = exchange(proxy, b"/processing", script)
    assert [a.status for a in answers] == [102, 200], [a.describe() for a in answers]
    final = answers[1]
    assert (final.status, final.activator_reason, final.body) == (200, None, b"done"), final.describe()


def test_the_trailers_of_a_chunked_response_reach_the_client(proxy: Proxy) -> None:
    script = Script(
        [
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n",
            b"5\r\nhello\r\n",
            b"6\r\n world\r\n",
            b"0\r\nX-Checksum: abc123\r\n\r\n",
        ]
    )
    answers = exchange(proxy, b"/trailers", script, b"TE: trailers")
    assert [a.status for a in answers] == [200], [a.describe() for a in answers]
    answer = answers[0]
    assert answer.body == b"hello world", answer.describe()
    assert [(name.lower(), value) for name, value in answer.trailers] == [(b"x-checksum", b"abc123")], answer.trailers


@pytest.mark.parametrize(
    ("name", "answer"),
    [
        ("bare LF everywhere", b"HTTP/1.1 200 OK\nContent-Type: text/plain\nX-Pod: lf \nContent-Length: 5\n\nhello"),
        ("bare LF ending the head", b"HTTP/1.1 200 OK\r\nX-Pod: lf\r\nContent-Length: 5\r\n\nhello"),
        (
            "bare LF in the head of a chunked answer",
            b"HTTP/1.1 200 OK\nX-Pod: lf\nTransfer-Encoding: chunked\n\n5\r\nhello\r\n0\r\n\r\n",
        ),
    ],
)
def test_a_pods_answer_with_bare_lf_line_ends_is_relayed(proxy: Proxy, name: str, answer: bytes) -> None:
    # The pod is trusted: as HAProxy and nginx do, its bare LFs are read as line ends
    # (a client's never are: the request table refuses them).
    target = b"/bare-lf-%d" % len(answer)
    answers = exchange(proxy, target, Script([answer]))
    assert [a.status for a in answers] == [200], [a.describe() for a in answers]
    assert answers[0].body == b"hello", answers[0].describe()
    assert header_lines(answers[0].head, {b"x-pod"}) == [b"X-Pod: lf"]


def test_bare_lf_in_a_pods_chunk_framing_is_a_bad_response(proxy: Proxy) -> None:
    # llhttp's leniency covers the head's lines only, not a chunk's size line.
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\n0\n\n"
    answers = exchange(proxy, b"/bare-lf-chunks", Script([answer]))  # one write: read before any relay
    assert [(a.status, a.activator_reason) for a in answers] == [(502, "upstream-bad-response")], [
        a.describe() for a in answers
    ]


def test_repeated_link_www_authenticate_and_set_cookie_lines_are_relayed_separately_in_order(proxy: Proxy) -> None:
    repeated = [
        b"Link: </a.css>; rel=preload",
        b"Set-Cookie: a=1; Path=/",
        b'WWW-Authenticate: Basic realm="one"',
        b"Link: </b.js>; rel=preload",
        b"Set-Cookie: b=2; Expires=Wed, 21 Oct 2026 07:28:00 GMT",
        b'WWW-Authenticate: Bearer realm="two", error="invalid_token"',
        b"Set-Cookie: c=3",
    ]
    head = b"HTTP/1.1 401 Unauthorized\r\n" + b"".join(line + b"\r\n" for line in repeated)
    script = Script([head + b"Content-Type: text/plain\r\nContent-Length: 2\r\n\r\nno"])
    answers = exchange(proxy, b"/repeated", script)
    assert [a.status for a in answers] == [401], [a.describe() for a in answers]
    answer = answers[0]
    assert (answer.activator_reason, answer.body) == (None, b"no"), answer.describe()
    assert header_lines(answer.head, {b"link", b"set-cookie", b"www-authenticate"}) == repeated, answer.describe()


def test_a_two_write_pod_without_nodelay_is_served_request_after_request_on_a_kept_alive_connection(
    proxy: Proxy,
) -> None:
    body = b"two writes\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(body)
    proxy.pod.set_script(b"/two-writes", Script([head, body]))  # like http.server: head, then body
    mark = quiet_mark(proxy.act, proxy.pod)
    with wire(proxy.act) as connection:
        for i in range(10):
            connection.send(http_request(b"GET /two-writes HTTP/1.1"))
            answer = connection.read_response()
            assert (answer.status, answer.activator_reason, answer.body) == (200, None, body), (
                f"request {i}: {answer.describe()}"
            )
            assert not answer.says_close, answer.describe()
    wait_quiet(proxy.act, proxy.pod)
    assert [r.target for r in proxy.pod.since(mark).requests if r.target != b"/healthz"] == [b"/two-writes"] * 10


def endless_stream() -> Iterator[Step]:
    """A chunked answer that goes on (1 KiB every 50 ms, at most 30 s) until the
    connection breaks."""
    yield b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
    for _ in range(600):
        yield b"400\r\n" + b"x" * 1024 + b"\r\n"
        yield 0.05
    yield b"0\r\n\r\n"


def test_a_client_hanging_up_mid_response_is_logged_499_client_gone(proxy: Proxy) -> None:
    proxy.pod.set_script(b"/client-gone", Script(endless_stream))
    wait_quiet(proxy.act, proxy.pod)
    with wire(proxy.act) as connection:
        connection.send(http_request(b"GET /client-gone HTTP/1.1"))
        connection.read_until(b"x" * 1024)  # the head and a first piece of the body are through
    # The client is gone; the access log says so once activator noticed.
    wait_until(
        lambda: any(
            " 499 client-gone " in line and '"GET /client-gone"' in line
            for line in proxy.act.stdout_text().splitlines()
        ),
        message=lambda: f"a 499 client-gone access log line; output:\n{proxy.act.output_tail()}",
    )
    wait_quiet(proxy.act, proxy.pod)


SLOW_ANSWER = Script([0.5, b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 4\r\n\r\nslow"])


@pytest.mark.parametrize("waited", [False, True], ids=["sent at once", "sent after waiting for the slot"])
def test_a_client_hanging_up_while_the_pod_works_is_logged_499_client_gone(proxy: Proxy, waited: bool) -> None:
    # Asked once the pod answers: one poll for a request sent at once; for one that waited
    # in the queue, the hang-up monitor's word (its socket stays watched after the wait).
    target = b"/gone-while-working-%s" % (b"waited" if waited else b"at-once")
    proxy.pod.set_script(target, SLOW_ANSWER)
    proxy.pod.set_script(b"/holder", SLOW_ANSWER)
    wait_quiet(proxy.act, proxy.pod)
    mark = quiet_mark(proxy.act, proxy.pod)

    def at_the_pod(path: bytes) -> bool:
        return path in [r.target for r in proxy.pod.since(mark).requests]

    with contextlib.ExitStack() as holding:
        if waited:  # the only slot is taken: the request below waits for it
            holder = holding.enter_context(wire(proxy.act))
            holder.send(http_request(b"GET /holder HTTP/1.1"))
            wait_until(lambda: at_the_pod(b"/holder"), message="the holder at the pod")
        with wire(proxy.act) as connection:
            connection.send(http_request(b"GET " + target + b" HTTP/1.1"))
            wait_until(lambda: at_the_pod(target), timeout=10, message="the request at the pod")
        if waited:
            assert holder.read_response().body == b"slow"
    line = f'"GET {target.decode()}"'
    wait_until(
        lambda: any(" 499 client-gone " in entry and line in entry for entry in proxy.act.stdout_text().splitlines()),
        message=lambda: f"a 499 client-gone access log line for {line}; output:\n{proxy.act.output_tail()}",
    )


def test_a_response_head_that_never_ends_is_502_bad_response_at_once(proxy: Proxy) -> None:
    # llhttp holds an unfinished header line until it ends: past MAX_POD_FIELD_BYTES
    # (256 KiB) the pod's answer is refused, not held until response_start_timeout.
    endless = b"HTTP/1.1 200 OK\r\nX-Endless: " + b"v" * (1024 * 1024)
    answers = exchange(proxy, b"/endless-head", Script([endless]))
    assert [(a.status, a.activator_reason) for a in answers] == [(502, "upstream-bad-response")], [
        a.describe() for a in answers
    ]


def test_trailers_that_never_end_cut_the_stream_at_once(proxy: Proxy) -> None:
    # After the head is out, the only honest signal left is cutting the connection: the
    # client never sees the last chunk, and is not kept waiting for the rest.
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
    script = Script([head, b"5\r\nhello\r\n", b"0\r\nX-Endless: " + b"v" * (1024 * 1024)])
    proxy.pod.set_script(b"/endless-trailer", script)
    wait_quiet(proxy.act, proxy.pod)
    with wire(proxy.act) as connection:
        connection.send(http_request(b"GET /endless-trailer HTTP/1.1", b"TE: trailers"))
        received = connection.read_to_end()
    assert received.startswith(b"HTTP/1.1 200 OK\r\n") and b"5\r\nhello\r\n" in received, received[:300]
    assert not received.endswith(b"\r\n\r\n"), f"the response was finished: {received[-100:]!r}"

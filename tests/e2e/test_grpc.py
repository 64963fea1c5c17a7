"""End to end: gRPC through the real activator (SPEC "Protocols": ``protocol: h2c`` pods,
gRPC requests answered with gRPC statuses, ``grpc-timeout``).

The pod is ``pods.grpc_pod``, a ``grpcio`` server in its own process (bytes in and out:
``Unary``, ``ServerStream``, ``ClientStream``, and ``Block``, which answers when the test
releases it; it records how many calls it served at once), behind activator with
``protocol: h2c`` and ``container_concurrency: 1``. The client is ``grpcio`` on an
insecure channel to activator's port (HTTP/2 with prior knowledge), with retries off so
that each status is the first answer. What is proved:

- unary, server-streaming and client-streaming calls succeed, also many at once, and the
  pod never serves more than one at a time;
- activator's own refusals reach the grpcio client as gRPC statuses, each with
  ``x-activator-reason`` in its trailing metadata: queue-full -> RESOURCE_EXHAUSTED,
  queue-timeout -> UNAVAILABLE, an authority no service matches -> UNIMPLEMENTED, a pod
  that refuses connections -> UNAVAILABLE, a pod too slow to answer -> DEADLINE_EXCEEDED;
- a call the client cancels while it runs reaches the pod as a cancel (activator resets
  the pod's stream) and its slot goes to the next call at once; one cancelled while
  queued leaves the queue and never reaches the pod;
- a call whose deadline (``grpc-timeout``) is shorter than its wait for the slot fails
  DEADLINE_EXCEEDED, leaves the queue and never reaches the pod; activator's answer to
  it (read with curl, whose request carries ``grpc-timeout`` but does not enforce it)
  is its own, ``grpc-status: 4``.

Every test ends with the pod's peak within ``container_concurrency`` and the activator
idle. No test asserts on elapsed time.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import (
    DEFAULT_TIMEOUT,
    LOCALHOST,
    SERVICE,
    Activator,
    ActivatorFactory,
    HarnessError,
    ModulePod,
    concurrent_requests,
    curl,
    free_port,
    make_config,
)
from pods.grpc_pod import method

pytestmark = pytest.mark.binary

AUTHORITY = "grpc.test"


@pytest.fixture
def grpc_pod() -> Iterator[ModulePod]:
    with ModulePod("grpc_pod") as pod:
        yield pod


def grpc_config(pods: list[Any], **options: Any) -> dict[str, Any]:
    """One service for :data:`AUTHORITY` over ``pods`` spoken to in HTTP/2 (h2c), cc 1."""
    return make_config(pods, hosts=[AUTHORITY], protocol="h2c", container_concurrency=1, **options)


class Stub(contextlib.AbstractContextManager["Stub"]):
    """The pod's four methods on a grpcio channel to the activator (bytes in and out)."""

    def __init__(self, act: Activator, authority: str = AUTHORITY) -> None:
        self.channel = grpc.insecure_channel(
            act.listen,
            options=[
                ("grpc.default_authority", authority),
                ("grpc.enable_http_proxy", 0),
                ("grpc.enable_retries", 0),
            ],
        )
        self.unary = self.channel.unary_unary(method("Unary"))
        self.server_stream = self.channel.unary_stream(method("ServerStream"))
        self.client_stream = self.channel.stream_unary(method("ClientStream"))
        self.block = self.channel.unary_unary(method("Block"))

    def __exit__(self, *exc: object) -> None:
        self.channel.close()


def refusal(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str | None]:
    """Make a call that must fail: its status code and its ``x-activator-reason``."""
    with pytest.raises(grpc.RpcError) as failed:
        call()
    error: Any = failed.value
    metadata = dict(error.trailing_metadata() or ())
    return error.code(), metadata.get("x-activator-reason")


@contextlib.contextmanager
def slot_held(stub: Stub, pod: ModulePod, act: Activator) -> Iterator[None]:
    """A ``Block`` call holds the only slot for the block's duration; then it is released
    and must succeed."""
    held = stub.block.future(b"holder", timeout=120)

    def running(stats: dict[str, Any]) -> bool:
        if held.done():
            raise HarnessError(f"the holder ended before it held the slot: {held.exception()}")
        return bool(stats["in_flight"] == 1)

    try:
        pod.wait_stats(running, "the holder running on the pod")
        act.wait_for(lambda st: st["services"][SERVICE]["in_flight"] == 1, message="the holder's slot")
        yield
    finally:
        pod.control("release", n=1)
    assert held.result(timeout=DEFAULT_TIMEOUT) == b"holder"


def settle(act: Activator, pod: ModulePod | None) -> None:
    """How every test ends: the pod's calls all over and never more than one at once, the
    activator idle."""
    if pod is not None:
        pod.wait_stats(lambda s: s["in_flight"] == 0, "every call over on the pod")
        assert pod.stats()["peak"] <= 1, pod.stats()
    act.wait_idle()


def test_unary_and_streaming_calls_succeed_one_at_a_time(
    grpc_pod: ModulePod, activator_factory: ActivatorFactory
) -> None:
    act = activator_factory(grpc_config([grpc_pod], queue_timeout="60s"))
    with Stub(act) as stub:
        assert stub.unary(b"hello", timeout=DEFAULT_TIMEOUT) == b"hello"
        assert list(stub.server_stream(b"5", timeout=DEFAULT_TIMEOUT)) == [b"0", b"1", b"2", b"3", b"4"]
        assert stub.client_stream(iter([b"a", b"b", b"c"]), timeout=DEFAULT_TIMEOUT) == b"a|b|c"
        large = bytes(range(256)) * 4096  # 1 MiB: more than one HTTP/2 window
        assert stub.unary(large, timeout=DEFAULT_TIMEOUT) == large

        def call(i: int) -> tuple[Any, Any]:
            kind = i % 3
            if kind == 0:
                return stub.unary(b"u%d" % i, timeout=60), b"u%d" % i
            if kind == 1:
                return list(stub.server_stream(b"%d" % (i % 4 + 1), timeout=60)), [b"%d" % n for n in range(i % 4 + 1)]
            parts = [b"c%d" % i, b"x" * i]
            return stub.client_stream(iter(parts), timeout=60), b"|".join(parts)

        results = concurrent_requests(12, call)

    assert [got for got, _ in results] == [want for _, want in results]
    stats = grpc_pod.stats()
    assert stats["peak"] == 1, f"the pod served {stats['peak']} calls at once"
    assert stats["count"] == 16 and stats["per"] == {"Unary": 6, "ServerStream": 5, "ClientStream": 5}, stats
    settle(act, grpc_pod)


def test_queue_full_is_resource_exhausted(grpc_pod: ModulePod, activator_factory: ActivatorFactory) -> None:
    act = activator_factory(grpc_config([grpc_pod], queue_depth=0))
    with Stub(act) as stub:
        with slot_held(stub, grpc_pod, act):
            code, reason = refusal(lambda: stub.unary(b"refused", timeout=DEFAULT_TIMEOUT))
        assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue-full")
        assert stub.unary(b"after", timeout=DEFAULT_TIMEOUT) == b"after"
    assert grpc_pod.stats()["order"] == ["Block", "Unary"]  # the refused call never reached it
    settle(act, grpc_pod)


def test_queue_timeout_is_unavailable(grpc_pod: ModulePod, activator_factory: ActivatorFactory) -> None:
    act = activator_factory(grpc_config([grpc_pod], queue_timeout="1s"))
    with Stub(act) as stub:
        with slot_held(stub, grpc_pod, act):
            code, reason = refusal(lambda: stub.unary(b"waited", timeout=DEFAULT_TIMEOUT))
        assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "queue-timeout")
    assert grpc_pod.stats()["order"] == ["Block"]
    settle(act, grpc_pod)


def test_unknown_authority_is_unimplemented(grpc_pod: ModulePod, activator_factory: ActivatorFactory) -> None:
    act = activator_factory(grpc_config([grpc_pod]))
    with Stub(act, authority="nobody.test") as stranger:
        code, reason = refusal(lambda: stranger.unary(b"who?", timeout=DEFAULT_TIMEOUT))
    assert (code, reason) == (grpc.StatusCode.UNIMPLEMENTED, "unknown-host")
    assert grpc_pod.stats()["count"] == 0
    settle(act, grpc_pod)


def test_pod_refusing_connections_is_unavailable(activator_factory: ActivatorFactory) -> None:
    act = activator_factory(grpc_config([f"{LOCALHOST}:{free_port()}"]))
    with Stub(act) as stub:
        code, reason = refusal(lambda: stub.unary(b"anyone?", timeout=DEFAULT_TIMEOUT))
    assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "upstream-connect")
    settle(act, None)


def test_pod_too_slow_to_answer_is_deadline_exceeded(grpc_pod: ModulePod, activator_factory: ActivatorFactory) -> None:
    act = activator_factory(grpc_config([grpc_pod], response_start_timeout="1s"))
    with Stub(act) as stub:
        # Block never answers unless released: only activator's timeout ends the call.
        code, reason = refusal(lambda: stub.block(b"slow", timeout=DEFAULT_TIMEOUT))
    assert (code, reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, "upstream-timeout")
    # The pod's call was cancelled with the stream activator gave up on.
    settle(act, grpc_pod)
    assert grpc_pod.stats()["per"] == {"Block": 1}


def test_a_call_cancelled_while_it_runs_is_cancelled_at_the_pod_and_frees_its_slot(
    grpc_pod: ModulePod, activator_factory: ActivatorFactory
) -> None:
    act = activator_factory(grpc_config([grpc_pod], queue_timeout="60s"))
    with Stub(act) as stub:
        running = stub.block.future(b"cancel me", timeout=120)
        grpc_pod.wait_stats(lambda s: s["in_flight"] == 1, "the call running on the pod")
        waiting = stub.unary.future(b"next", timeout=120)
        act.wait_for(lambda st: st["services"][SERVICE]["queued"] == 1, message="the next call queued")
        running.cancel()
        # The pod's call sees its cancel (its gate is never released), and the next call
        # gets the slot: it is answered while the cancelled one was never let finish.
        grpc_pod.wait_stats(lambda s: s["notes"].get("cancelled") == 1, "the cancel at the pod")
        assert waiting.result(timeout=DEFAULT_TIMEOUT) == b"next"
    stats = grpc_pod.stats()
    assert stats["order"] == ["Block", "Unary"]
    # The slot is the stream's: free once its RST_STREAM went out (SPEC, as HAProxy's
    # abortonclose), while the pod's handler may still be winding down the cancelled call.
    assert stats["peak"] <= 2, stats
    grpc_pod.wait_stats(lambda s: s["in_flight"] == 0, "every call over on the pod")
    act.wait_idle()


def test_a_call_cancelled_while_queued_never_reaches_the_pod(
    grpc_pod: ModulePod, activator_factory: ActivatorFactory
) -> None:
    act = activator_factory(grpc_config([grpc_pod], queue_timeout="60s"))
    with Stub(act) as stub:
        with slot_held(stub, grpc_pod, act):
            queued = stub.unary.future(b"queued", timeout=120)
            act.wait_for(lambda st: st["services"][SERVICE]["queued"] == 1, message="the call queued")
            queued.cancel()
            act.wait_for(lambda st: st["services"][SERVICE]["queued"] == 0, message="the call out of the queue")
        assert stub.unary(b"after", timeout=DEFAULT_TIMEOUT) == b"after"
    assert grpc_pod.stats()["order"] == ["Block", "Unary"]
    settle(act, grpc_pod)


def test_deadline_shorter_than_the_wait_fails_and_never_reaches_the_pod(
    grpc_pod: ModulePod, activator_factory: ActivatorFactory
) -> None:
    act = activator_factory(grpc_config([grpc_pod], queue_timeout="60s"))
    with Stub(act) as stub:
        with slot_held(stub, grpc_pod, act):
            code, reason = refusal(lambda: stub.unary(b"late", timeout=1.0))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED
            # Whoever noticed the deadline first (activator answers 4, the client
            # cancels), the call must leave the queue while the slot is still held.
            svc = act.wait_for(
                lambda st: st["services"][SERVICE]["queued"] == 0, message="the late call out of the queue"
            )["services"][SERVICE]
            assert svc["in_flight"] == 1
            assert reason in (None, "deadline-exceeded"), reason
        assert grpc_pod.stats()["order"] == ["Block"], "the call past its deadline reached the pod"
        assert stub.unary(b"in time", timeout=DEFAULT_TIMEOUT) == b"in time"
    assert grpc_pod.stats()["order"] == ["Block", "Unary"]
    settle(act, grpc_pod)


def test_grpc_timeout_passing_in_the_queue_gets_activators_own_status(
    grpc_pod: ModulePod, activator_factory: ActivatorFactory, tmp_path: Path
) -> None:
    act = activator_factory(grpc_config([grpc_pod], queue_timeout="60s"))
    message = tmp_path / "request.bin"
    message.write_bytes(struct.pack(">BI", 0, 4) + b"late")  # one gRPC message, uncompressed
    head = tmp_path / "head.txt"

    with Stub(act) as stub, slot_held(stub, grpc_pod, act):
        result = curl(
            "--http2-prior-knowledge",
            "--resolve",
            f"{AUTHORITY}:{act.port}:{LOCALHOST}",
            "-H",
            "content-type: application/grpc",
            "-H",
            "te: trailers",
            "-H",
            "grpc-timeout: 1S",
            "--data-binary",
            f"@{message}",
            "-D",
            str(head),
            "-o",
            str(tmp_path / "body.bin"),
            f"http://{AUTHORITY}:{act.port}{method('Unary')}",
        )
        assert result.returncode == 0, result.stderr
        lines = {
            name.strip().lower(): value.strip()
            for name, sep, value in (line.partition(":") for line in head.read_text().splitlines()[1:])
            if sep
        }
        assert head.read_text().startswith("HTTP/2 200"), head.read_text()
        assert lines.get("grpc-status") == "4", lines
        assert lines.get("x-activator-reason"), lines
        assert act.status()["services"][SERVICE]["queued"] == 0

    assert grpc_pod.stats()["order"] == ["Block"]
    settle(act, grpc_pod)

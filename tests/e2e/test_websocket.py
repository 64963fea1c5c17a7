"""End to end: WebSocket tunnels through the real activator (SPEC "Protocols": Upgrade).

The pod is ``pods.ws_echo`` (python ``websockets``, echoing every message and recording
how many WebSockets it had open at once); the clients are the ``websockets`` sync client
(and, where a client must vanish mid-queue, a raw socket sending the same upgrade). What
is proved:

- messages cross the tunnel unchanged both ways (text, binary, a message of megabytes);
- a tunnel holds its pod's slot for its whole life: with ``container_concurrency: 1`` a
  second WebSocket waits in the FIFO (``/status``: ``queued: 1``, ``tunnels: 1``) and is
  upgraded once the first closes; closing frees the slot (``in_flight`` and ``tunnels``
  back to 0, and the StatsD gauge ``{p}.{s}.tunnels`` follows);
- a client that gives up while queued leaves the queue and never reaches the pod;
- ``idle_timeout`` ends a tunnel that carries no byte either way;
- the access log has one line per tunnel, written when it closes: status 101 and the
  bytes each way;
- a pod that refuses the upgrade (200, 426) has its answer relayed as it is.

Every test ends with the pod's peak within ``container_concurrency`` and the activator
idle. No test asserts on elapsed time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from harness import (
    DEFAULT_TIMEOUT,
    SERVICE,
    Activator,
    ActivatorFactory,
    ModulePod,
    StatsdReceiver,
    make_config,
    send_raw,
)
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

pytestmark = pytest.mark.binary

MiB = 1024 * 1024
#: A client's upgrade request as the raw socket of a test sends it.
UPGRADE = (
    "GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


@pytest.fixture
def ws_pod() -> Iterator[ModulePod]:
    with ModulePod("ws_echo") as pod:
        yield pod


def open_ws(act: Activator, path: str) -> ClientConnection:
    """A WebSocket through the activator: no proxy from the environment, no compression, no
    keepalive pings (the test decides when bytes flow), no message size limit."""
    return connect(
        f"ws://{act.listen}{path}",
        proxy=None,
        compression=None,
        ping_interval=None,
        max_size=None,
        open_timeout=DEFAULT_TIMEOUT,
        close_timeout=5,
    )


def service(st: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = st["services"][SERVICE]
    return result


def wait_service(act: Activator, message: str, **expected: int) -> dict[str, Any]:
    """Wait until the service's ``/status`` fields have the ``expected`` values."""
    st = act.wait_for(lambda st: all(service(st)[k] == v for k, v in expected.items()), message=message)
    return service(st)


def settle(act: Activator, pod: ModulePod, cc: int = 1) -> None:
    """How every test ends: the pod never had more than ``cc`` WebSockets open, nothing
    is left open on it, and the activator is idle with no tunnel."""
    pod.wait_stats(lambda s: s["in_flight"] == 0, "every WebSocket closed on the pod")
    assert pod.stats()["peak"] <= cc, pod.stats()
    st = act.wait_idle()
    assert service(st)["tunnels"] == 0, service(st)


def test_messages_cross_the_tunnel_unchanged(ws_pod: ModulePod, activator_factory: ActivatorFactory) -> None:
    act = activator_factory(make_config([ws_pod]))
    large = os.urandom(3 * MiB)

    with open_ws(act, "/echo") as ws:
        ws.send("hello, tunnel")
        assert ws.recv(timeout=DEFAULT_TIMEOUT) == "hello, tunnel"
        ws.send(b"\x00\x01\xfe\xff binary")
        assert ws.recv(timeout=DEFAULT_TIMEOUT) == b"\x00\x01\xfe\xff binary"
        ws.send(large)
        echoed = ws.recv(timeout=DEFAULT_TIMEOUT)
        assert isinstance(echoed, bytes) and len(echoed) == len(large)
        assert echoed == large
        text = "é" * (MiB // 2)
        ws.send(text)
        assert ws.recv(timeout=DEFAULT_TIMEOUT) == text

    assert ws_pod.stats()["count"] == 1
    settle(act, ws_pod)


def test_second_websocket_waits_in_the_fifo_until_the_first_closes(
    ws_pod: ModulePod, activator_factory: ActivatorFactory
) -> None:
    act = activator_factory(make_config([ws_pod], container_concurrency=1, queue_timeout="60s"))
    # Leaving the block closes the first WebSocket before the pool waits for the second.
    with ThreadPoolExecutor(max_workers=1) as pool, open_ws(act, "/first") as first:
        first.send("one")
        assert first.recv(timeout=DEFAULT_TIMEOUT) == "one"
        wait_service(act, "the first WebSocket open", in_flight=1, tunnels=1)

        pending = pool.submit(open_ws, act, "/second")
        svc = wait_service(act, "the second WebSocket queued behind the open one", queued=1, tunnels=1)
        assert svc["in_flight"] == 1
        stats = ws_pod.stats()
        assert stats["order"] == ["/first"] and stats["in_flight"] == 1, stats
        assert not pending.done(), "upgraded while the only slot was held by an open WebSocket"
        first.close()

        with pending.result(timeout=DEFAULT_TIMEOUT) as second:
            second.send("two")
            assert second.recv(timeout=DEFAULT_TIMEOUT) == "two"
            svc = wait_service(act, "the second WebSocket holds the slot", in_flight=1, queued=0, tunnels=1)
            assert ws_pod.stats()["order"] == ["/first", "/second"]

    settle(act, ws_pod)


def test_closing_a_websocket_frees_its_slot_and_the_tunnels_gauge_follows(
    ws_pod: ModulePod, activator_factory: ActivatorFactory, statsd_receiver: StatsdReceiver
) -> None:
    prefix = "wstest"
    gauge = f"{prefix}.{SERVICE}.tunnels"
    act = activator_factory(
        make_config([ws_pod], top={"statsd": {"address": statsd_receiver.address, "prefix": prefix}})
    )

    with open_ws(act, "/held") as ws:
        ws.send("ping")
        assert ws.recv(timeout=DEFAULT_TIMEOUT) == "ping"
        svc = wait_service(act, "the WebSocket counted in flight and as a tunnel", in_flight=1, tunnels=1)
        assert [p["in_flight"] for p in svc["pods"]] == [1]
        statsd_receiver.wait_for(lambda lines: statsd_receiver.gauge(gauge) == 1)

    wait_service(act, "the slot given back when the client closed", in_flight=0, tunnels=0, queued=0)
    statsd_receiver.wait_for(lambda lines: statsd_receiver.gauge(gauge) == 0)
    # The slot is really free: another WebSocket is upgraded straight away.
    with open_ws(act, "/next") as again:
        again.send("pong")
        assert again.recv(timeout=DEFAULT_TIMEOUT) == "pong"
    assert ws_pod.stats()["order"] == ["/held", "/next"]
    settle(act, ws_pod)


def test_client_that_gives_up_while_queued_never_reaches_the_pod(
    ws_pod: ModulePod, activator_factory: ActivatorFactory
) -> None:
    act = activator_factory(make_config([ws_pod], container_concurrency=1, queue_timeout="60s"))
    with open_ws(act, "/first") as first:
        first.send("hold")
        assert first.recv(timeout=DEFAULT_TIMEOUT) == "hold"
        wait_service(act, "the first WebSocket open", in_flight=1, tunnels=1)

        quitter = send_raw(act.listen, UPGRADE.format(path="/quitter", host=act.listen).encode())
        wait_service(act, "the upgrade request queued", queued=1)
        quitter.close()
        svc = wait_service(act, "the queue left by the client that hung up", queued=0)
        assert svc["in_flight"] == 1 and svc["tunnels"] == 1

    with open_ws(act, "/third") as third:
        third.send("after")
        assert third.recv(timeout=DEFAULT_TIMEOUT) == "after"
    stats = ws_pod.stats()
    assert stats["order"] == ["/first", "/third"], f"the client that left reached the pod: {stats}"
    settle(act, ws_pod)


def test_idle_timeout_closes_a_tunnel_with_no_traffic_either_way(
    ws_pod: ModulePod, activator_factory: ActivatorFactory
) -> None:
    act = activator_factory(make_config([ws_pod], idle_timeout="1s", request_timeout=None, top={"access_log": True}))

    with open_ws(act, "/quiet") as ws:
        ws.send("only message")
        assert ws.recv(timeout=DEFAULT_TIMEOUT) == "only message"
        # Nothing more either way: the activator ends the tunnel, and the client sees it.
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=DEFAULT_TIMEOUT)

    line = act.wait_access(lambda r: r.target == "/quiet", message="the idle tunnel's line")
    assert line.status == 101, line.line
    settle(act, ws_pod)


def test_access_log_has_one_line_per_tunnel_when_it_closes_with_bytes_each_way(
    ws_pod: ModulePod, activator_factory: ActivatorFactory
) -> None:
    act = activator_factory(make_config([ws_pod], top={"access_log": True}))
    text, data = "t" * 10_000, os.urandom(5_000)
    payload = len(text) + len(data)

    with open_ws(act, "/logged") as ws:
        ws.send(text)
        assert ws.recv(timeout=DEFAULT_TIMEOUT) == text
        ws.send(data)
        assert ws.recv(timeout=DEFAULT_TIMEOUT) == data
        assert not [r for r in act.access_log() if r.target == "/logged"], "a line before the tunnel closed"

    line = act.wait_access(lambda r: r.target == "/logged", message="the tunnel's line once it closed")
    assert line.status == 101, line.line
    assert line.method == "GET" and line.service == SERVICE and line.pod == ws_pod.address, line.line
    # The messages and their framing (a few bytes each, masked from the client), the
    # closing handshake; no HTTP head is a body byte.
    assert line.bytes_in is not None, f"no in= count: {line.line}"
    assert payload <= line.bytes_in < payload + 4096, line.line
    assert payload <= line.bytes < payload + 4096, line.line
    settle(act, ws_pod)
    assert len([r for r in act.access_log() if r.target == "/logged"]) == 1, act.stdout_text()


@pytest.mark.parametrize("status", [200, 426])
def test_pod_that_refuses_the_upgrade_has_its_answer_relayed(
    ws_pod: ModulePod, activator_factory: ActivatorFactory, status: int
) -> None:
    act = activator_factory(make_config([ws_pod]))

    with pytest.raises(InvalidStatus) as refused:
        open_ws(act, f"/refuse?status={status}")

    response = refused.value.response
    assert response.status_code == status
    assert response.body == f"refused with {status}\n".encode()
    assert "X-Activator-Reason" not in response.headers
    stats = ws_pod.stats()
    assert stats["notes"] == {"refused": 1} and stats["count"] == 0, stats
    # Nothing was tunnelled: the next WebSocket gets the slot.
    with open_ws(act, "/after") as ws:
        ws.send("ok")
        assert ws.recv(timeout=DEFAULT_TIMEOUT) == "ok"
    settle(act, ws_pod)

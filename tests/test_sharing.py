"""The workers' one queue in the shell (``sharing.py``): two workers' ``SlotSharing`` and
the supervisor's ``ExchangeHub`` in one gevent loop, over real socket pairs.

What is pinned here is what the core's simulation cannot see: a request greenlet that is
killed (the engine's stop, an HTTP/2 connection torn down) at the very moment its slot
arrives gives the slot back; it is neither kept by a request that is gone nor lost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import gevent
import gevent.socket
import pytest
from gevent.event import Event

from activator.base.writer import Actor
from activator.core.config import parse_config
from activator.core.slotexchange import LedgerEffects
from activator.core.throttler import Effects, Grant
from activator.core.topology import Topology
from activator.fleet.sharing import ExchangeHub, SlotSharing

POD = "127.0.0.1:9"  # never connected to: slots only


class Quiet:
    def transition(self, transition: object) -> None:
        pass


class Worker:
    """One worker's topology (shared mode) and its side of the exchange."""

    def __init__(self, index: int, hub: ExchangeHub) -> None:
        data = {"workers": 2, "services": {"api": {"hosts": ["*"], "container_concurrency": 1, "pods": [POD]}}}
        config = parse_config(data, filename="test.yaml", line_of=lambda path: None)
        self.topology = Topology(config, 0.0, worker_index=index, workers=["127.0.0.1:1", "127.0.0.1:2"])
        self.throttler = self.topology.services["api"]
        ours, theirs = gevent.socket.socketpair(gevent.socket.AF_UNIX, gevent.socket.SOCK_SEQPACKET)
        hub.attach(index, theirs)
        self.actor = Actor(Quiet(), lend=lambda throttler, grant: self.sharing.offer(throttler, grant))
        self.sharing = SlotSharing(ours, index, self.topology, self.act, lambda event: None)

    def act(self, effects: Effects) -> None:
        self.actor.act(effects)


@pytest.fixture
def workers() -> Iterator[tuple[Worker, Worker, ExchangeHub]]:
    hub = ExchangeHub()
    hub.start()
    pair = (Worker(0, hub), Worker(1, hub))
    for w in pair:
        w.sharing.start()
    try:
        yield pair[0], pair[1], hub
    finally:
        for w in pair:
            w.sharing.stop()
        hub.stop()


def until(predicate: Callable[[], bool], what: str) -> None:
    with gevent.Timeout(5, AssertionError(f"never: {what}")):
        while not predicate():
            gevent.sleep(0.001)


def test_a_waiter_killed_as_its_slot_arrives_gives_the_slot_back(workers: tuple[Worker, Worker, ExchangeHub]) -> None:
    w0, w1, hub = workers
    owner, other = (w0, w1) if w0.throttler.capacity else (w1, w0)
    busy = owner.throttler.acquire_here()
    assert isinstance(busy, Grant)

    # The other worker's request queues at the exchange; the service is contended.
    got = Event()
    waiter = gevent.spawn(other.sharing.wait, other.throttler, 60.0 + gevent.get_hub().loop.now(), None, 0.0)
    until(lambda: hub.queued("api") == 1 and owner.throttler.contended, "the request queued, the owner contended")

    # The owner's slot frees and is lent across. The waiter is killed the moment its slot
    # came, before it runs on it.
    original = other.sharing._do  # (the test's hook on the waking; it still does it all)

    def kill_then_wake(out: LedgerEffects) -> None:
        if out.woken:  # (the outcome is set: the slot is the request's)
            waiter.kill(block=False)  # runs before the wake-up it precedes
            got.set()
        original(out)

    other.sharing._do = kill_then_wake  # type: ignore[method-assign]
    owner.act(owner.throttler.release(busy, 1.0))
    until(got.is_set, "the slot lent to the waiting request")
    waiter.join()
    assert isinstance(waiter.value, gevent.GreenletExit), waiter.value  # killed, not served

    # The slot comes back to its owner: nothing borrowed, nothing lent, nothing queued.
    until(lambda: owner.throttler.in_flight == 0, "the slot back with its owner")
    assert other.throttler.borrowed == 0
    assert hub.exchange.lent() == 0 and hub.queued("api") == 0
    assert owner.throttler.acquire_here() is not None

"""End to end: ``workers: 2`` has ONE queue per activator (issue 14, point 2; SPEC
"Several activators": "no pod has a free slot in one worker while a request of its
service waits in another").

The real ``activator run`` (or ``$ACTIVATOR_BIN``) with two workers in front of
``tests/backend.py`` pods. Every request here is sent to a chosen worker through that
worker's private port (served by that worker exactly like a connection the kernel gave it
on the shared listener), and is a ``/hold?key=K`` that the pod holds until the test
releases ``K``, its ``X-Request-Id`` being ``K`` too. So what runs where, and in which
order, is decided by the test and read back exactly from the pods (``held``,
``request_ids``, ``peak``) and from the supervisor's merged ``/status`` (whose ``queued``
includes the exchange's queue): nothing depends on timing, and no assertion is on
elapsed time. A request is sent only once the previous one is seen where it must be
(held by a pod, or queued), so the arrival order is the order of the test's code.

Which worker owns which pod's slot is read from each worker's own admin API (its port
found from the descriptor it inherited, in /proc), so that a test knows in advance
whether a request can be served by its worker's own slot or must borrow a sibling's.

What is proven, one test each:

1. no pod is idle while anything waits, and waiters are served in arrival order
   whichever worker they came to;
2. a worker that owns no slot of a service serves it with borrowed slots (never 503),
   and an owner whose slot is lent does not use it;
3. a client of either worker that hangs up while queued is taken out of the queue at
   once, and its request never reaches the pod;
4. ``queue_depth`` bounds the activator's one queue, not each worker's;
5. ``queue_timeout`` answers a request waiting at the exchange, which leaves the queue;
6. a SIGKILLed worker: a borrower's restart gives the slot back, an owner's restart
   does not use a slot still lent out;
7. a reload that adds pods while requests wait serves them on the new pods, in order.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from harness import (
    Activator,
    Pod,
    activator_reason,
    concurrent_requests,
    json_request,
    request,
    service_config,
    start_request,
    wait_until,
)

pytestmark = pytest.mark.binary

SERVICE = "api"
HOST = "api.test"

# --------------------------------------------------------------------------------------
# config


def one_queue_config(pods: Iterable[Pod], **options: Any) -> dict[str, Any]:
    """``workers: 2``, one service ``api`` (cc 1, no probe) over ``pods``; ``options`` are
    more keys of the service."""
    service = service_config(
        pods,
        hosts=[HOST],
        container_concurrency=1,
        **{"queue_depth": 100, "queue_timeout": "60s", **options},
    )
    return {"workers": 2, "access_log": False, "grace_period": "20s", "services": {SERVICE: service}}


# --------------------------------------------------------------------------------------
# the workers, from /proc


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter), for every process in /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        table[int(entry)] = (int(fields[1]), fields[0])
    return table


def _worker_spec(pid: int) -> dict[str, Any] | None:
    """The ``ACTIVATOR_WORKER`` JSON a process was started with (None: not a worker)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return None
    for item in items:
        name, _, value = item.partition(b"=")
        if name == b"ACTIVATOR_WORKER":
            spec: dict[str, Any] = json.loads(value)
            return spec
    return None


def _listening_port(pid: int, fd: int) -> int:
    """The local port of the listening TCP socket that is descriptor ``fd`` of ``pid``."""
    link = os.readlink(f"/proc/{pid}/fd/{fd}")
    inode = link.removeprefix("socket:[").removesuffix("]")
    with open(f"/proc/{pid}/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[9] == inode:
                return int(fields[1].rpartition(":")[2], 16)
    raise AssertionError(f"descriptor {fd} of process {pid} is not a TCP socket ({link})")


@dataclass(frozen=True)
class Worker:
    """One live worker: its index, pid, private proxy address and own admin address."""

    index: int
    pid: int
    proxy: str
    admin: str

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = json_request(self.admin, "GET", "/status")
        return result

    def slots(self, address: str) -> int:
        """The slots of the pod ``address`` this worker owns (its own /status)."""
        for pod in self.status()["services"][SERVICE]["pods"]:
            if pod["address"] == address:
                slots: int = pod["slots"]
                return slots
        raise AssertionError(f"worker {self.index} does not list pod {address}")


def live_workers(act: Activator) -> list[Worker]:
    """The live workers under the activator, by index. (Descendants, not children: a
    one-file executable runs the supervisor as a child of its bootloader; where a worker
    is itself a bootloader and its child, the innermost process, the one serving, is
    taken.)"""
    table = _process_table()
    below: set[int] = set()
    frontier = {act.pid}
    while frontier:
        frontier = {pid for pid, (ppid, state) in table.items() if ppid in frontier and state != "Z"} - below
        below |= frontier
    specs = {pid: spec for pid in below if (spec := _worker_spec(pid)) is not None}
    innermost = [pid for pid in specs if not any(table[c][0] == pid for c in specs)]
    found = []
    for pid in innermost:
        spec = specs[pid]
        admin = f"127.0.0.1:{_listening_port(pid, spec['admin'])}"
        found.append(Worker(spec["index"], pid, spec["addresses"][spec["index"]], admin))
    return sorted(found, key=lambda w: w.index)


def wait_workers(act: Activator, gone: Sequence[int] = ()) -> list[Worker]:
    """Wait until two workers (none of the pids ``gone``) run and the activator is ready."""

    def running() -> list[Worker] | None:
        workers = live_workers(act)
        ok = len(workers) == 2 and not {w.pid for w in workers} & set(gone)
        return workers if ok else None

    wait_until(running, message="two workers running")
    act.wait_for(
        lambda st: st["ready"] and st["worker"]["count"] == 2 and all(w["ready"] for w in st["workers"]),
        message="every worker ready",
    )
    workers = running()
    assert workers is not None
    return workers


def owner_and_slotless(workers: Sequence[Worker], pod: Pod) -> tuple[Worker, Worker]:
    """(the worker owning the cc=1 pod's one slot, the one owning none)."""
    owning = [w for w in workers if w.slots(pod.address) == 1]
    assert len(owning) == 1 and sum(w.slots(pod.address) for w in workers) == 1, [
        (w.index, w.slots(pod.address)) for w in workers
    ]
    (owner,) = owning
    (other,) = [w for w in workers if w is not owner]
    return owner, other


def borrowed(workers: Sequence[Worker]) -> dict[int, int]:
    """Worker index -> its requests running on slots lent by a sibling (its own /status)."""
    return {w.index: w.status()["services"][SERVICE]["borrowed"] for w in workers}


def wait_restarted(act: Activator, victim: Worker) -> list[Worker]:
    """Wait for a new worker in place of the killed ``victim``; the workers then."""
    return wait_workers(act, gone=[victim.pid])


# --------------------------------------------------------------------------------------
# held requests


def send_hold(worker: Worker, key: str) -> http.client.HTTPConnection:
    """``GET /hold?key=K`` (``X-Request-Id: K``) on its own connection to ``worker``; the
    response is read later (:func:`answer`)."""
    return start_request(worker.proxy, path=f"/hold?key={key}", host=HOST, headers={"X-Request-Id": key}, timeout=60)


def answer(conn: http.client.HTTPConnection) -> tuple[int, str | None, str]:
    """(status, X-Activator-Reason, body) of a sent request; closes the connection."""
    try:
        resp = conn.getresponse()
        body = resp.read().decode("utf-8", "replace")
        return resp.status, activator_reason(resp), body
    finally:
        conn.close()


def held(pods: Sequence[Pod]) -> dict[str, list[str]]:
    """Pod address -> the keys it holds now."""
    return {pod.address: pod.held() for pod in pods}


def wait_held(pods: Sequence[Pod], expected: dict[Pod, list[str]], message: str = "") -> None:
    """Wait until each pod holds exactly the keys given (a pod not named: none)."""
    want = {pod.address: sorted(expected.get(pod, [])) for pod in pods}
    last: list[dict[str, list[str]]] = [{}]

    def check() -> bool:
        last[0] = held(pods)
        return last[0] == want

    wait_until(check, message=lambda: f"{message}: want {want}, pods hold {last[0]}")


def queued(act: Activator, n: int, message: str = "", timeout: float = 30.0) -> dict[str, Any]:
    """Wait until the activator's ``queued`` of the service is ``n``; that status."""
    return act.wait_for(
        lambda st: st["services"][SERVICE]["queued"] == n, timeout=timeout, message=message or f"{n} queued"
    )


def queue(act: Activator, worker: Worker, key: str, n: int) -> http.client.HTTPConnection:
    """Send ``key`` to ``worker`` and wait until it is the ``n``-th queued request."""
    conn = send_hold(worker, key)
    queued(act, n, f"{key} (via worker {worker.index}) queued as number {n}")
    return conn


def request_ids(pods: Sequence[Pod]) -> dict[str, list[str]]:
    return {pod.address: pod.stats()["request_ids"] for pod in pods}


def peaks(pods: Sequence[Pod]) -> dict[str, int]:
    return {pod.address: pod.stats()["peak"] for pod in pods}


def served(conns: dict[str, http.client.HTTPConnection]) -> dict[str, int]:
    """Key -> status of each request's answer (all of them read)."""
    return {key: answer(conn)[0] for key, conn in conns.items()}


# --------------------------------------------------------------------------------------
# 1. no pod idle while anything waits; arrival order across workers


def test_no_pod_is_idle_while_anything_waits_and_waiters_go_in_arrival_order(pod_factory, activator_factory):
    pods = pod_factory(2)
    act = activator_factory(one_queue_config(pods))
    workers = wait_workers(act)
    # Each worker owns exactly one of the two slots (the division balances them).
    own = {w.index: [p for p in pods if w.slots(p.address) == 1] for w in workers}
    assert sorted(len(v) for v in own.values()) == [1, 1], own
    a, b = workers
    (pod_a,), (pod_b,) = own[a.index], own[b.index]

    # -- everything through worker A only.
    conns = {"a0": send_hold(a, "a0")}
    wait_held(pods, {pod_a: ["a0"]}, "a0 runs on A's own slot")
    # A has no free slot left; B's pod is free: the request must get B's slot, lent (with
    # per-worker queues it would wait in A while pod B idles).
    conns["a1"] = send_hold(a, "a1")
    wait_held(pods, {pod_a: ["a0"], pod_b: ["a1"]}, "a1 runs on B's slot, lent to A")
    assert borrowed(workers) == {a.index: 1, b.index: 0}
    conns["a2"] = queue(act, a, "a2", 1)
    conns["a3"] = queue(act, a, "a3", 2)
    assert held(pods) == {pod_a.address: ["a0"], pod_b.address: ["a1"]}

    # A freed slot goes to the oldest waiter: pod B's (the lent one) first, then pod A's.
    pod_b.release("a1")
    wait_held(pods, {pod_a: ["a0"], pod_b: ["a2"]}, "the oldest waiter, a2, on the freed pod B")
    queued(act, 1)
    pod_a.release("a0")
    wait_held(pods, {pod_a: ["a3"], pod_b: ["a2"]}, "a3 on the freed pod A")
    queued(act, 0)
    for pod in pods:
        pod.release()
    assert served(conns) == dict.fromkeys(conns, 200)
    assert request_ids(pods) == {pod_a.address: ["a0", "a3"], pod_b.address: ["a1", "a2"]}

    # -- interleaved over both workers: B B | A A B A B B A. The first two run at once
    # (B's own slot, then A's lent to B), the others queue, one at a time.
    plan = [b, b, a, a, b, a, b, b, a]
    keys = [f"i{n}" for n in range(len(plan))]
    conns = {keys[0]: send_hold(b, keys[0])}
    wait_held(pods, {pod_b: [keys[0]]}, "i0 on B's own slot")
    conns[keys[1]] = send_hold(b, keys[1])
    wait_held(pods, {pod_b: [keys[0]], pod_a: [keys[1]]}, "i1 on A's slot, lent to B")
    for n in range(2, len(plan)):
        conns[keys[n]] = queue(act, plan[n], keys[n], n - 1)

    # Free one slot at a time, the pods alternately: each time exactly the oldest waiter
    # (whichever worker it came to) takes the freed slot. Wrong order, a freed slot left
    # idle, or a slot going to a waiter on its owner worker first would all show here.
    running = {pod_b: keys[0], pod_a: keys[1]}
    for n in range(2, len(plan)):
        freed = pod_b if n % 2 == 0 else pod_a
        freed.release(running[freed])
        running[freed] = keys[n]
        wait_held(pods, {pod: [key] for pod, key in running.items()}, f"{keys[n]} (the oldest) on the freed pod")
        queued(act, len(plan) - 1 - n)
    for pod in pods:
        pod.release()
    assert served(conns) == dict.fromkeys(conns, 200)
    order = request_ids(pods)
    assert order[pod_b.address][2:] == keys[0::2]
    assert order[pod_a.address][2:] == keys[1::2]
    assert peaks(pods) == dict.fromkeys(peaks(pods), 1)
    act.wait_idle()


def test_the_merged_status_counts_every_workers_borrowed_slots(pod_factory, activator_factory):
    pods = pod_factory(2)
    act = activator_factory(one_queue_config(pods))
    workers = wait_workers(act)
    # Worker 1 runs two requests: one on its own slot, one on worker 0's, lent.
    conns = [send_hold(workers[1], "own"), send_hold(workers[1], "lent")]
    wait_until(lambda: sorted(k for keys in held(pods).values() for k in keys) == ["lent", "own"])
    assert borrowed(workers) == {0: 0, 1: 1}
    try:
        assert act.status()["services"][SERVICE]["borrowed"] == 1
    finally:
        for pod in pods:
            pod.release()
        assert [answer(c)[0] for c in conns] == [200, 200]


# --------------------------------------------------------------------------------------
# 2. a worker owning no slot


def test_a_worker_owning_no_slot_borrows_and_an_owner_does_not_use_a_lent_slot(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(one_queue_config([pod]))
    owner, slotless = owner_and_slotless(wait_workers(act), pod)

    # Straight to the slotless worker: served with the owner's slot, never 503.
    for n in range(5):
        resp = request(slotless.proxy, path="/delay?ms=5", host=HOST, headers={"X-Request-Id": f"s{n}"})
        assert resp.status == 200, (resp.status, resp.headers.get("X-Activator-Reason"), resp.text)
        assert resp.headers["X-Pod"] == pod.address

    # The pod busy through the owner: the slotless worker's request waits, then is served.
    conns = {"o0": send_hold(owner, "o0")}
    wait_held([pod], {pod: ["o0"]}, "o0 on the owner's slot")
    conns["s5"] = queue(act, slotless, "s5", 1)
    assert pod.held() == ["o0"]
    pod.release("o0")
    wait_held([pod], {pod: ["s5"]}, "s5 on the freed slot")
    queued(act, 0)

    # The other way round: the slot lent to the slotless worker's request, the owner's own
    # request must wait for it (using it would put two requests on the cc=1 pod).
    conns["o1"] = queue(act, owner, "o1", 1)
    assert pod.held() == ["s5"]
    pod.release("s5")
    wait_held([pod], {pod: ["o1"]}, "o1 on its owner's slot, back")
    pod.release()
    assert served(conns) == dict.fromkeys(conns, 200)
    assert pod.stats()["request_ids"] == [f"s{n}" for n in range(5)] + ["o0", "s5", "o1"]
    assert pod.stats()["peak"] == 1
    act.wait_idle()


# --------------------------------------------------------------------------------------
# 3. cancellation across workers


@pytest.mark.parametrize("waiter_on", ["slotless", "owner"])
def test_a_client_that_hangs_up_while_queued_leaves_the_queue(pod_factory, activator_factory, waiter_on):
    (pod,) = pod_factory(1)
    # queue_timeout 60s: only the hang-up can empty the queue within the wait below.
    act = activator_factory(one_queue_config([pod], queue_timeout="60s"))
    owner, slotless = owner_and_slotless(wait_workers(act), pod)
    busy_on, waiter = (owner, slotless) if waiter_on == "slotless" else (slotless, owner)

    first = send_hold(busy_on, "busy")
    wait_held([pod], {pod: ["busy"]}, "the pod busy")
    gone = queue(act, waiter, "gone", 1)
    gone.close()  # the client hangs up while its request waits at the exchange
    queued(act, 0, "the abandoned request out of the queue", timeout=15)

    pod.release("busy")
    assert answer(first)[0] == 200
    act.wait_for(lambda st: st["services"][SERVICE]["in_flight"] == 0, message="the slot free again")
    # A later request through the same worker takes the slot; the abandoned one never
    # reached the pod (had it stayed queued, it would have got the slot first).
    later = send_hold(waiter, "later")
    wait_held([pod], {pod: ["later"]}, "the later request served")
    pod.release()
    assert answer(later)[0] == 200
    assert pod.stats()["request_ids"] == ["busy", "later"]
    assert pod.stats()["peak"] == 1
    act.wait_idle()


# --------------------------------------------------------------------------------------
# 4. queue_depth is the activator's


def test_queue_depth_bounds_the_activators_one_queue(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(one_queue_config([pod], queue_depth=2))
    owner, slotless = owner_and_slotless(wait_workers(act), pod)

    conns = {"busy": send_hold(owner, "busy")}
    wait_held([pod], {pod: ["busy"]}, "the pod busy")
    # One waiter per worker: a per-worker depth of 2 would admit two more.
    conns["w1"] = queue(act, slotless, "w1", 1)
    conns["w2"] = queue(act, owner, "w2", 2)
    for worker, key in ((slotless, "full1"), (owner, "full2")):
        status, reason, body = answer(send_hold(worker, key))
        assert (status, reason) == (503, "queue-full"), (worker.index, status, reason, body)
    queued(act, 2)

    pod.release("busy")
    wait_held([pod], {pod: ["w1"]}, "w1, the oldest, next")
    pod.release("w1")
    wait_held([pod], {pod: ["w2"]}, "then w2")
    pod.release()
    assert served(conns) == dict.fromkeys(conns, 200)
    assert pod.stats()["request_ids"] == ["busy", "w1", "w2"]
    assert pod.stats()["peak"] == 1
    act.wait_idle()


def test_queue_full_answer_carries_retry_after(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(one_queue_config([pod], queue_depth=1))
    owner, slotless = owner_and_slotless(wait_workers(act), pod)
    busy = send_hold(owner, "busy")
    wait_held([pod], {pod: ["busy"]}, "the pod busy")
    waiting = queue(act, owner, "w1", 1)
    resp = request(slotless.proxy, path="/hold?key=full", host=HOST, headers={"X-Request-Id": "full"})
    assert (resp.status, resp.headers.get("X-Activator-Reason")) == (503, "queue-full"), resp
    assert "Retry-After" in resp.headers, resp.headers
    pod.release("busy")
    wait_held([pod], {pod: ["w1"]}, "w1 next")
    pod.release()
    assert answer(busy)[0] == answer(waiting)[0] == 200
    assert pod.stats()["request_ids"] == ["busy", "w1"]


# --------------------------------------------------------------------------------------
# 5. queue_timeout through a worker


def test_queue_timeout_at_the_exchange(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(one_queue_config([pod], queue_timeout="1s"))
    owner, slotless = owner_and_slotless(wait_workers(act), pod)

    busy = send_hold(owner, "busy")
    wait_held([pod], {pod: ["busy"]}, "the pod busy")
    # Both wait at the exchange: the slotless worker has nowhere else to wait, and the
    # owner queues there too while the service is contended or its slot is taken.
    late = [send_hold(slotless, "late-slotless"), send_hold(owner, "late-owner")]
    for conn in late:
        status, reason, body = answer(conn)
        assert (status, reason) == (503, "queue-timeout"), (status, reason, body)
    queued(act, 0, "the queue empty after the timeouts")

    pod.release("busy")
    assert answer(busy)[0] == 200
    act.wait_for(lambda st: st["services"][SERVICE]["in_flight"] == 0, message="the slot free again")
    # Nothing of the timed-out requests reaches the pod; the slot serves a newcomer.
    for worker in (slotless, owner):
        resp = request(worker.proxy, path="/delay?ms=1", host=HOST, headers={"X-Request-Id": f"new{worker.index}"})
        assert resp.status == 200, (resp.status, resp.text)
    assert pod.stats()["request_ids"] == ["busy", f"new{slotless.index}", f"new{owner.index}"]
    assert pod.stats()["peak"] == 1
    act.wait_idle()


# --------------------------------------------------------------------------------------
# 6. a killed worker


def _ended_without_answer(conn: http.client.HTTPConnection) -> bool:
    """The request's connection ended before a response (its worker died)."""
    try:
        status, reason, body = answer(conn)
    except (http.client.HTTPException, OSError):
        return True
    raise AssertionError(f"a request of the killed worker was answered: {status} {reason} {body!r}")


def test_a_killed_borrower_gives_the_slot_back(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(one_queue_config([pod]))
    owner, borrower = owner_and_slotless(wait_workers(act), pod)

    orphan = send_hold(borrower, "orphan")
    wait_held([pod], {pod: ["orphan"]}, "the borrower's request on the owner's slot")
    assert borrowed([owner, borrower]) == {owner.index: 0, borrower.index: 1}
    os.kill(borrower.pid, signal.SIGKILL)
    workers = wait_restarted(act, borrower)
    assert _ended_without_answer(orphan)

    pod.release()
    wait_until(lambda: pod.stats()["in_flight"] == 0, message="the pod done with the orphan")
    # The slot went back to its owner: both workers serve again, one request at a time.
    for worker in workers:
        for _ in range(3):
            resp = request(worker.proxy, path="/delay?ms=5", host=HOST)
            assert resp.status == 200, (worker.index, resp.status, resp.headers.get("X-Activator-Reason"))
    results = concurrent_requests(10, lambda i: request(workers[i % 2].proxy, path="/delay?ms=20", host=HOST))
    assert [r.status for r in results] == [200] * 10
    assert pod.stats()["peak"] == 1
    act.wait_idle()
    assert borrowed(workers) == {0: 0, 1: 0}


def test_a_restarted_owner_does_not_use_its_slot_while_it_is_still_lent(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(one_queue_config([pod]))
    owner, borrower = owner_and_slotless(wait_workers(act), pod)

    lent = send_hold(borrower, "lent")
    wait_held([pod], {pod: ["lent"]}, "the borrower's request on the owner's slot")
    os.kill(owner.pid, signal.SIGKILL)
    workers = wait_restarted(act, owner)
    (new_owner,) = [w for w in workers if w.index == owner.index]

    # The new incarnation owns the slot again, but it is still lent: a request through it
    # must wait (serving it would be two requests at once on the cc=1 pod).
    after = queue(act, new_owner, "after", 1)
    assert pod.held() == ["lent"]
    pod.release("lent")
    assert answer(lent)[0] == 200  # the borrower lives on: its request completes
    wait_held([pod], {pod: ["after"]}, "the queued request on the slot given back")
    pod.release()
    assert answer(after)[0] == 200
    assert pod.stats()["request_ids"] == ["lent", "after"]
    assert pod.stats()["peak"] == 1
    act.wait_idle()
    # And the slot is the owner's again (not kept reserved): served at once through both.
    for worker in workers:
        assert request(worker.proxy, path="/delay?ms=1", host=HOST).status == 200
    assert pod.stats()["peak"] == 1
    act.wait_idle()


# --------------------------------------------------------------------------------------
# 7. reload under load


@pytest.mark.parametrize("how", ["file-edit", "sighup"])
def test_a_reload_adding_pods_serves_the_queue_on_them(pod_factory, activator_factory, how):
    old, new1, new2 = pod_factory(3)
    pods = [old, new1, new2]
    act = activator_factory(one_queue_config([old]))
    owner, slotless = owner_and_slotless(wait_workers(act), old)

    conns = {"busy": send_hold(owner, "busy")}
    wait_held(pods, {old: ["busy"]}, "the one pod busy")
    plan = [slotless, owner, slotless]
    keys = ["q0", "q1", "q2"]
    for n, (worker, key) in enumerate(zip(plan, keys, strict=True)):
        conns[key] = queue(act, worker, key, n + 1)

    config = one_queue_config(pods)
    if how == "file-edit":
        act.rewrite_config(config)
    else:
        act.write_config_in_place(config)
        act.reload()
    # The two new pods take the two oldest waiters; the third keeps waiting.
    queued(act, 1, "two waiters on the new pods")
    # (granted is not yet held: each is on its way to its pod)
    wait_until(lambda: sum(map(len, held(pods).values())) == 3, message=lambda: f"three held: {held(pods)}")
    now = held(pods)
    assert now[old.address] == ["busy"], now
    assert sorted(now[new1.address] + now[new2.address]) == ["q0", "q1"], now
    assert len(now[new1.address]) == len(now[new2.address]) == 1, now

    # A new pod's slot, freed, goes to the last waiter (the old pod still busy).
    first_new = new1 if now[new1.address] == ["q0"] else new2
    first_new.release("q0")
    queued(act, 0)
    wait_until(lambda: first_new.held() == ["q2"], message=lambda: f"q2 on the freed new pod: {held(pods)}")
    for pod in pods:
        pod.release()
    assert served(conns) == dict.fromkeys(conns, 200)
    assert old.stats()["request_ids"] == ["busy"]
    assert sorted(new1.stats()["request_ids"] + new2.stats()["request_ids"]) == keys
    assert all(p <= 1 for p in peaks(pods).values()), peaks(pods)
    act.wait_idle()

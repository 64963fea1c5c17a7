"""End to end: ``workers: 2``, one activator as a supervisor and two worker processes
on one listener (issue 8, point 5; SPEC "Several activators").

The real ``activator run`` (or ``$ACTIVATOR_BIN``) in front of ``tests/backend.py`` pods
that record their own peak concurrency. What is proven:

- the process serves, and the workers together never push a pod past its cc (cc=1 and
  cc=2), each worker owning its share of every pod's slots;
- a one-pod cc=1 service is served whichever worker a connection lands on: the worker
  owning nothing forwards to its sibling (checked deterministically through each
  worker's private port, and with many connections on the shared listener);
- the supervisor's /status merges the workers (count 2, slots summing to cc);
- a file edit and SIGHUP reach every worker;
- SIGTERM lets in-flight requests finish, exits 0, and leaves no worker behind;
- a worker killed with SIGKILL is restarted by the supervisor, which serves again.

Worker processes are found among the activator's descendants in /proc; each one's private
port is read from the ``ACTIVATOR_WORKER`` spec in its environment (workersockets.py).
Waits poll with generous timeouts; no assertion is on elapsed time.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Sequence
from functools import partial
from typing import Any

import pytest
from harness import (
    Activator,
    concurrent_requests,
    find_pod,
    request,
    service_config,
    start_request,
    wait_until,
)

pytestmark = pytest.mark.binary

#: A service of the workers' files: ``service(pods, hosts=[...], container_concurrency=N)``.
service = partial(service_config, queue_depth=500, queue_timeout="30s")


# --------------------------------------------------------------------------------------
# helpers


def workers_config(services: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"workers": 2, "access_log": False, "grace_period": "20s", **top, "services": services}


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


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return any(item.startswith(b"ACTIVATOR_WORKER=") for item in f.read().split(b"\0"))
    except OSError:
        return False


def workers_of(act: Activator) -> list[int]:
    """The live worker processes under the activator: its descendants started with an
    ``ACTIVATOR_WORKER`` spec. (Descendants, not children: a one-file ``$ACTIVATOR_BIN``
    runs the supervisor as a child of its bootloader.) Where a worker is itself a
    bootloader and its child, the innermost process (the one serving) is taken."""
    table = _process_table()
    below: set[int] = set()
    frontier = {act.pid}
    while frontier:
        frontier = {pid for pid, (ppid, state) in table.items() if ppid in frontier and state != "Z"} - below
        below |= frontier
    workers = {pid for pid in below if _is_worker(pid)}
    return sorted(pid for pid in workers if not any(table[c][0] == pid for c in workers))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def worker_spec(pid: int) -> dict[str, Any]:
    """The ``ACTIVATOR_WORKER`` JSON a worker was started with (index, addresses...)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        for item in f.read().split(b"\0"):
            name, _, value = item.partition(b"=")
            if name == b"ACTIVATOR_WORKER":
                spec: dict[str, Any] = json.loads(value)
                return spec
    raise AssertionError(f"process {pid} is not an activator worker")


def wait_workers(act: Activator, n: int = 2) -> list[int]:
    """Wait until the supervisor has ``n`` live worker children and is ready; their pids."""
    pids = wait_until(lambda: (p := workers_of(act)) and len(p) == n and p, message=f"{n} workers running")
    act.wait_for(
        lambda st: st["ready"] and st["worker"]["count"] == n and all(w["ready"] for w in st["workers"]),
        message="every worker ready",
    )
    return list(pids)


def slots_sum_to_cc(status: dict[str, Any], service_name: str, addresses: Sequence[str], cc: int) -> bool:
    svc = status["services"][service_name]
    for address in addresses:
        pod = find_pod(status, service_name, address)
        if pod is None or pod["slots"] != cc or pod["state"] != "healthy":
            return False
    return svc["capacity"] == cc * len(addresses)


# --------------------------------------------------------------------------------------
# serving and limits


def test_two_workers_serve_without_exceeding_any_pods_limit(pod_factory, activator_factory):
    api = pod_factory(3)
    duo = pod_factory(2)
    (solo,) = pod_factory(1)
    act = activator_factory(
        workers_config(
            {
                "api": service(api, hosts=["api.test"], container_concurrency=1),
                "duo": service(duo, hosts=["duo.test"], container_concurrency=2),
                "solo": service([solo], hosts=["solo.test"], container_concurrency=1),
            }
        )
    )
    wait_workers(act)
    st = act.status()
    assert st["worker"] == {"count": 2}
    assert sorted(w["index"] for w in st["workers"]) == [0, 1]
    assert slots_sum_to_cc(st, "api", [p.address for p in api], 1), st["services"]["api"]
    assert slots_sum_to_cc(st, "duo", [p.address for p in duo], 2), st["services"]["duo"]
    assert slots_sum_to_cc(st, "solo", [solo.address], 1), st["services"]["solo"]

    plan = ["api.test"] * 30 + ["duo.test"] * 20 + ["solo.test"] * 10
    results = concurrent_requests(len(plan), lambda i: request(act.listen, path="/delay?ms=100", host=plan[i]))

    assert [r.status for r in results] == [200] * len(plan), [(r.status, r.text) for r in results if r.status != 200]
    # (The kernel picks the worker of each connection, so a pod owned by one worker may
    # see no request at all: the limit is what is checked.)
    for pod in [*api, solo]:
        stats = pod.stats()
        assert stats["peak"] <= 1, f"{pod.address} (cc 1) saw {stats['peak']} requests at once"
    for pod in duo:
        stats = pod.stats()
        assert 1 <= stats["peak"] <= 2, f"{pod.address} (cc 2) saw {stats['peak']} requests at once"
    assert sum(p.stats()["count"] for p in api) == 30
    assert sum(p.stats()["count"] for p in duo) == 20
    assert solo.stats()["count"] == 10
    act.wait_idle()


def test_one_pod_service_is_served_whichever_worker_gets_the_connection(pod_factory, activator_factory):
    (solo,) = pod_factory(1)
    act = activator_factory(
        workers_config({"solo": service([solo], hosts=["solo.test"], container_concurrency=1)}, access_log=True)
    )
    pids = wait_workers(act)
    specs = [worker_spec(pid) for pid in pids]
    addresses = specs[0]["addresses"]
    assert len(addresses) == 2 and sorted(s["index"] for s in specs) == [0, 1]

    # Straight to each worker's own port: the one owning no slot must borrow its
    # sibling's through the activator's one queue, not wait until the timeout.
    for address in addresses:
        for _ in range(3):
            resp = request(address, path="/delay?ms=10", host="solo.test")
            assert resp.status == 200, (address, resp.status, resp.text)
            assert resp.headers["X-Pod"] == solo.address
    assert "worker:" not in act.stdout_text(), "workers never forward to each other"

    # Through the shared listener, many connections (the kernel picks the worker).
    sequential = [request(act.listen, path="/delay?ms=5", host="solo.test") for _ in range(20)]
    burst = concurrent_requests(20, lambda i: request(act.listen, path="/delay?ms=20", host="solo.test"))
    assert [r.status for r in sequential + burst] == [200] * 40
    assert solo.stats()["peak"] == 1
    assert solo.stats()["count"] == 46
    act.wait_idle()
    pod = find_pod(act.status(), "solo", solo.address)
    assert pod is not None and pod["requests"] == 46 and pod["slots"] == 1


# --------------------------------------------------------------------------------------
# reload and signals


def test_file_edit_and_sighup_reach_every_worker(pod_factory, activator_factory):
    pods = pod_factory(3)
    act = activator_factory(workers_config({"api": service(pods[:1], hosts=["api.test"], container_concurrency=2)}))
    wait_workers(act)
    assert slots_sum_to_cc(act.status(), "api", [pods[0].address], 2)

    # An edit of the file: every worker applies it (a pod's merged state is "healthy"
    # only when every worker sees it healthy).
    act.rewrite_config(workers_config({"api": service(pods[:2], hosts=["api.test"], container_concurrency=2)}))
    act.wait_for(
        lambda st: slots_sum_to_cc(st, "api", [p.address for p in pods[:2]], 2), message="second pod in every worker"
    )
    st = act.status()
    assert [p["states"] for p in st["services"]["api"]["pods"]] == [["healthy", "healthy"]] * 2

    # SIGHUP to the supervisor: passed to every worker, each re-reads the file.
    before = act.stderr_text().count("config reload (SIGHUP)")
    act.write_config_in_place(workers_config({"api": service(pods, hosts=["api.test"], container_concurrency=2)}))
    act.reload()
    wait_until(
        lambda: act.stderr_text().count("config reload (SIGHUP)") >= before + 2,
        message=f"both workers logged a SIGHUP reload:\n{act.output_tail()}",
    )
    act.wait_for(
        lambda st: slots_sum_to_cc(st, "api", [p.address for p in pods], 2), message="third pod in every worker"
    )

    results = concurrent_requests(24, lambda i: request(act.listen, path="/delay?ms=50", host="api.test"))
    assert [r.status for r in results] == [200] * 24
    assert all(p.stats()["peak"] <= 2 for p in pods)
    act.wait_idle()


def test_sigterm_finishes_in_flight_exits_zero_and_leaves_no_worker(pod_factory, activator_factory):
    (pod,) = pod_factory(1)
    act = activator_factory(workers_config({"api": service([pod], hosts=["api.test"], container_concurrency=1)}))
    pids = wait_workers(act)

    slow = start_request(act.listen, path="/delay?ms=1500", host="api.test")
    wait_until(lambda: pod.stats()["in_flight"] == 1, message="slow request at the pod")
    act.signal(signal.SIGTERM)
    resp = slow.getresponse()
    assert resp.status == 200
    resp.read()
    slow.close()

    assert act.wait(timeout=40) == 0
    # The supervisor waited for (and reaped) its workers before exiting: none is left,
    # checked at once (a supervisor that exits first leaves them running, orphaned).
    assert [pid for pid in pids if alive(pid)] == [], "workers still alive after the supervisor exited"


def test_a_killed_worker_is_restarted(pod_factory, activator_factory):
    api = pod_factory(2)
    (solo,) = pod_factory(1)
    act = activator_factory(
        workers_config(
            {
                "api": service(api, hosts=["api.test"], container_concurrency=1),
                "solo": service([solo], hosts=["solo.test"], container_concurrency=1),
            }
        )
    )
    pids = wait_workers(act)
    victim = pids[0]
    os.kill(victim, signal.SIGKILL)
    # Not ready while a worker is missing, then a new worker takes its place.
    wait_until(
        lambda: (p := workers_of(act)) and len(p) == 2 and victim not in p,
        timeout=30,
        message="a new worker started in place of the killed one",
    )
    new_pids = wait_workers(act)
    assert victim not in new_pids
    st = act.status()
    assert slots_sum_to_cc(st, "api", [p.address for p in api], 1), st["services"]["api"]
    assert slots_sum_to_cc(st, "solo", [solo.address], 1), st["services"]["solo"]

    # Both workers serve again, the restarted one included (straight to its port too).
    restarted = next(pid for pid in new_pids if pid not in pids)
    spec = worker_spec(restarted)
    own = spec["addresses"][spec["index"]]
    for host in ("api.test", "solo.test"):
        resp = request(own, path="/delay?ms=10", host=host)
        assert resp.status == 200, (host, resp.status, resp.text)
    plan = ["api.test"] * 20 + ["solo.test"] * 10
    results = concurrent_requests(len(plan), lambda i: request(act.listen, path="/delay?ms=50", host=plan[i]))
    assert [r.status for r in results] == [200] * len(plan)
    assert all(p.stats()["peak"] <= 1 for p in [*api, solo])
    assert sum(p.stats()["count"] for p in api) == 20 + 1 and solo.stats()["count"] == 10 + 1
    act.wait_idle()

"""End to end: pod lifecycle under live YAML edits, draining, probes (issue 3, point 6).

The real ``activator run`` in front of ``tests/backend.py`` pods that record their own
peak concurrency and the ``X-Request-Id`` of every request they saw. The config file is
edited the ways an operator does (atomic rename, in-place write, symlink swap, SIGHUP);
the activator polls it every 0.2 s here (``ACTIVATOR_WATCH_INTERVAL``). Tests wait by
polling ``/status`` with generous timeouts and never assert on elapsed time.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import pytest
from harness import (
    SERVICE,
    Activator,
    Client,
    Pod,
    concurrent_requests,
    find_pod,
    make_config,
    pod_entry,
    pod_state,
    probe_config,
    request,
    start_request,
    wait_until,
)

pytestmark = pytest.mark.binary

#: One catch-all service ``api``, cc 1, no probe, first-available (the first listed
#: free pod gets a request, so a test knows where it lands).
lifecycle_config = partial(make_config, lb_policy="first-available", queue_timeout="30s")
FAST_WATCH = {"ACTIVATOR_WATCH_INTERVAL": "0.2"}


def start(activator_factory: Any, config: Any, **kwargs: Any) -> Activator:
    env = {**FAST_WATCH, **kwargs.pop("env", {})}
    act: Activator = activator_factory(config, env=env, **kwargs)
    return act


def svc_status(status: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = status["services"][SERVICE]
    return result


def pod_in(status: dict[str, Any], pod: Pod) -> dict[str, Any] | None:
    return find_pod(status, SERVICE, pod.address)


def get(act: Activator, path: str = "/delay?ms=10", request_id: str | None = None) -> Any:
    headers = {"X-Request-Id": request_id} if request_id else None
    return request(act.listen, path=path, headers=headers)


# --------------------------------------------------------------------------------------
# trackers outlive reloads


def test_unlist_and_relist_busy_pod_never_exceeds_its_limit(pod_factory, activator_factory):
    a, b = pod_factory(2)
    act = start(activator_factory, lifecycle_config([a, b]))

    long = start_request(act.listen, path="/delay?ms=5000", headers={"X-Request-Id": "long"})
    try:
        wait_until(lambda: a.stats()["in_flight"] == 1, message="long request on A")
        assert a.stats()["request_ids"] == ["long"]

        act.rewrite_config(lifecycle_config([b]))  # unlist A while it works
        act.wait_for(
            lambda st: (p := pod_in(st, a)) is not None and p["state"] == "draining" and p["in_flight"] == 1,
            message="A draining with its request in flight",
        )
        act.rewrite_config(lifecycle_config([a, b]))  # list it again
        st = act.wait_for(
            lambda st: (p := pod_in(st, a)) is not None and p["listed"] and p["state"] != "draining",
            message="A listed again",
        )
        assert pod_in(st, a)["in_flight"] == 1, "A lost its in-flight count on re-listing"
        assert a.stats()["in_flight"] == 1, "the long request ended too early for this test"

        # More requests than free slots (only B's one is free): A must not get any
        # while its long request runs.
        results = concurrent_requests(6, lambda i: get(act, "/delay?ms=100", f"burst-{i}"))
        assert [r.status for r in results] == [200] * 6
        assert a.stats()["peak"] == 1
        assert b.stats()["peak"] == 1

        first = long.getresponse()
        assert first.status == 200
        first.read()
    finally:
        long.close()
    assert a.stats()["peak"] == 1
    assert b.stats()["peak"] == 1
    st = act.wait_idle()
    assert pod_state(st, SERVICE, a.address) == "healthy"


def test_drain_with_a_request_in_flight(pod_factory, activator_factory):
    a, b = pod_factory(2)
    act = start(activator_factory, lifecycle_config([a, b]))

    long = start_request(act.listen, path="/delay?ms=2000", headers={"X-Request-Id": "long"})
    try:
        wait_until(lambda: a.stats()["in_flight"] == 1, message="long request on A")
        act.rewrite_config(lifecycle_config([pod_entry(a, drain=True), b]))
        act.wait_for(
            lambda st: (p := pod_in(st, a)) is not None and p["state"] == "draining" and p["in_flight"] == 1,
            message="A draining with its request in flight",
        )
        results = concurrent_requests(5, lambda i: get(act, "/delay?ms=50", f"after-{i}"))
        assert [r.status for r in results] == [200] * 5
        assert all(r.headers["X-Pod"] == b.address for r in results)

        first = long.getresponse()
        assert first.status == 200  # the in-flight request finished normally
        first.read()
    finally:
        long.close()

    # Removed once its last request is released; kept in /status while listed.
    act.wait_pod_state(SERVICE, a.address, "removed")
    assert a.stats()["request_ids"] == ["long"]  # no new request reached it
    assert a.stats()["count"] == 1
    for i in range(3):
        assert get(act, request_id=f"later-{i}").status == 200
    assert a.stats()["count"] == 1
    st = act.wait_idle()
    assert svc_status(st)["capacity"] == 1  # the removed pod does not count


def test_unlisting_an_idle_pod_removes_it_from_status(pod_factory, activator_factory):
    a, b = pod_factory(2)
    act = start(activator_factory, lifecycle_config([a, b]))
    assert get(act).status == 200

    act.rewrite_config(lifecycle_config([b]))
    act.wait_pod_state(SERVICE, a.address, None)
    before = a.stats()["count"]
    results = concurrent_requests(4, lambda i: get(act, "/delay?ms=20"))
    assert [r.status for r in results] == [200] * 4
    assert a.stats()["count"] == before
    assert svc_status(act.status())["capacity"] == 1


# --------------------------------------------------------------------------------------
# reloads: bad files, and every way a file changes


def test_broken_file_keeps_the_old_config_serving(pod_factory, activator_factory):
    (a,) = pod_factory(1)
    act = start(activator_factory, lifecycle_config([a]))
    assert act.status()["config"]["last_error"] is None

    # 1. YAML syntax error.
    act.rewrite_config("access_log: false\nservices:\n  api: [unclosed\n    hosts: x\n")
    st = act.wait_for(lambda st: st["config"]["last_error"], message="syntax error reported")
    error = st["config"]["last_error"]
    assert re.search(r"activator\.yaml:\d+", error), error
    assert get(act).status == 200  # old config keeps serving
    assert pod_state(st, SERVICE, a.address) == "healthy"

    # 2. A validation error: a bad port on a known line.
    bad = (
        "access_log: false\n"  # 1
        "services:\n"  # 2
        "  api:\n"  # 3
        "    hosts: ['*']\n"  # 4
        "    probe: null\n"  # 5
        "    pods:\n"  # 6
        "      - 127.0.0.1:70000\n"  # 7
    )
    act.rewrite_config(bad)
    st = act.wait_for(
        lambda st: "70000" in (st["config"]["last_error"] or ""),
        message="validation error reported",
    )
    error = st["config"]["last_error"]
    assert "activator.yaml:7:" in error, error
    assert "services.api.pods[0]" in error, error
    resp = get(act)
    assert resp.status == 200 and resp.headers["X-Pod"] == a.address
    assert [p["address"] for p in svc_status(st)["pods"]] == [a.address]

    # 3. A good file clears the error and is applied.
    (b,) = pod_factory(1)
    act.rewrite_config(lifecycle_config([b]))
    st = act.wait_for(
        lambda st: st["config"]["last_error"] is None and pod_state(st, SERVICE, b.address) == "healthy",
        message="good file applied",
    )
    assert get(act).headers["X-Pod"] == b.address


@pytest.mark.parametrize("how", ["atomic-rename", "in-place-write", "symlink-swap"])
def test_file_changes_are_picked_up(pod_factory, activator_factory, how):
    a, b = pod_factory(2)
    act = start(activator_factory, lifecycle_config([a]), use_symlink=(how == "symlink-swap"))
    assert get(act).headers["X-Pod"] == a.address

    new = lifecycle_config([b, a], container_concurrency=2)
    if how == "atomic-rename":
        act.rewrite_config(new)
    elif how == "in-place-write":
        act.write_config_in_place(new)
    else:
        act.swap_symlink(new)
        assert act.config_path.is_symlink()

    st = act.wait_for(
        lambda st: pod_state(st, SERVICE, b.address) == "healthy" and svc_status(st)["container_concurrency"] == 2,
        message=f"{how} picked up",
    )
    assert svc_status(st)["capacity"] == 4
    assert get(act).headers["X-Pod"] == b.address

    # And a second change the same way (the watcher keeps following the file).
    again = lifecycle_config([a])
    if how == "atomic-rename":
        act.rewrite_config(again)
    elif how == "in-place-write":
        act.write_config_in_place(again)
    else:
        act.swap_symlink(again)
    act.wait_pod_state(SERVICE, b.address, None)


def test_sighup_forces_a_reread(pod_factory, activator_factory):
    a, b = pod_factory(2)
    # The watcher effectively never polls: only SIGHUP can bring the change in.
    act = start(activator_factory, lifecycle_config([a]), env={"ACTIVATOR_WATCH_INTERVAL": "3600"})

    act.rewrite_config(lifecycle_config([a, b]))
    # (Not asserting the change is *not* seen without SIGHUP: that would be a timing.)
    act.reload()
    act.wait_pod_state(SERVICE, b.address, "healthy")

    act.write_config_in_place(lifecycle_config([b]))
    act.reload()
    act.wait_pod_state(SERVICE, a.address, None)
    assert get(act).headers["X-Pod"] == b.address


# --------------------------------------------------------------------------------------
# health: active probes and passive ejection


def test_pod_failing_its_probe_gets_nothing_until_it_passes(pod_factory, activator_factory):
    (sick,) = pod_factory(1, fail_health=True)
    act = start(activator_factory, lifecycle_config([sick], probe=probe_config(), queue_timeout="1s"))

    st = act.status()
    assert pod_state(st, SERVICE, sick.address) == "pending"
    assert svc_status(st)["capacity"] == 0
    # Give several probes (every 200 ms) the time to fail: /status does not count
    # failed probes of a pending pod, so wait on its time in state.
    act.wait_for(
        lambda st: pod_in(st, sick)["seconds_in_state"] >= 1.0,
        message="probes had time to run",
    )
    assert pod_state(act.status(), SERVICE, sick.address) == "pending"

    resp = get(act)
    assert resp.status == 503
    assert resp.headers.get("X-Activator-Reason") == "queue-timeout"
    assert sick.stats()["count"] == 0

    sick.set_health(True)
    act.wait_pod_state(SERVICE, sick.address, "healthy")
    resp = get(act)
    assert resp.status == 200 and resp.headers["X-Pod"] == sick.address
    assert sick.stats()["count"] == 1


def test_queued_request_is_served_once_the_probe_passes(pod_factory, activator_factory):
    (sick,) = pod_factory(1, fail_health=True)
    act = start(activator_factory, lifecycle_config([sick], probe=probe_config(), queue_timeout="30s"))
    act.wait_for(
        lambda st: pod_in(st, sick)["seconds_in_state"] >= 0.6,
        message="probes had time to run",
    )
    assert pod_state(act.status(), SERVICE, sick.address) == "pending"

    waiting = start_request(act.listen, path="/delay?ms=10")
    try:
        act.wait_for(lambda st: svc_status(st)["queued"] == 1, message="request queued")
        assert sick.stats()["count"] == 0
        sick.set_health(True)
        resp = waiting.getresponse()
        assert resp.status == 200
        resp.read()
    finally:
        waiting.close()
    assert sick.stats()["count"] == 1
    act.wait_idle()


def test_new_pod_under_probe_starts_pending_and_serves_only_after_passing(pod_factory, activator_factory):
    (a,) = pod_factory(1)
    act = start(activator_factory, lifecycle_config([a], probe=probe_config()))
    act.wait_pod_state(SERVICE, a.address, "healthy")

    (b,) = pod_factory(1, fail_health=True)
    act.rewrite_config(lifecycle_config([b, a], probe=probe_config()))  # b first: preferred once healthy
    st = act.wait_for(lambda st: pod_in(st, b) is not None, message="b listed")
    assert pod_state(st, SERVICE, b.address) == "pending"
    act.wait_for(
        lambda st: pod_in(st, b)["seconds_in_state"] >= 1.0,
        message="probes had time to run",
    )

    results = concurrent_requests(4, lambda i: get(act, "/delay?ms=50"))
    assert [r.status for r in results] == [200] * 4
    assert all(r.headers["X-Pod"] == a.address for r in results)
    assert b.stats()["count"] == 0
    assert pod_state(act.status(), SERVICE, b.address) == "pending"

    b.set_health(True)
    act.wait_pod_state(SERVICE, b.address, "healthy")
    resp = get(act)
    assert resp.status == 200 and resp.headers["X-Pod"] == b.address
    assert b.stats()["count"] == 1


def test_passive_ejection_and_return_via_probes(pod_factory, activator_factory):
    flaky, steady = pod_factory(2)
    # Probes every 2 s: two failed probes take at least one full interval, so the
    # ejection seen right after two failed requests is the passive one.
    config = lifecycle_config([flaky, steady], probe=probe_config(interval="2s", unhealthy_after=2))
    act = start(activator_factory, config)
    act.wait_for(
        lambda st: all(p["state"] == "healthy" for p in svc_status(st)["pods"]),
        message="both healthy",
    )
    assert get(act).headers["X-Pod"] == flaky.address

    flaky.stop()  # its port now refuses connections
    for _ in range(2):
        resp = get(act)  # tried on flaky first, retried on steady
        assert resp.status == 200
        assert resp.headers["X-Pod"] == steady.address
    st = act.status()
    entry = pod_in(st, flaky)
    assert entry["state"] == "pending", entry
    connect_errors = sum(n for k, n in entry["transport_failures"].items() if k.startswith("connect"))
    assert connect_errors >= 1, entry

    # Other pods keep serving, and the pending pod is not tried any more.
    results = concurrent_requests(3, lambda i: get(act, "/delay?ms=20"))
    assert [r.status for r in results] == [200] * 3
    entry_after = pod_in(act.status(), flaky)
    assert entry_after["state"] == "pending"
    assert entry_after["transport_failures"] == entry["transport_failures"]

    flaky.start()  # same port, fresh stats
    act.wait_pod_state(SERVICE, flaky.address, "healthy")
    resp = get(act)
    assert resp.status == 200 and resp.headers["X-Pod"] == flaky.address
    assert flaky.stats()["count"] == 1
    act.wait_idle()


# --------------------------------------------------------------------------------------
# churn


class _Load:
    """``threads`` clients looping requests on keep-alive connections; client ``i``
    cycles through ``paths`` starting at ``i``."""

    def __init__(self, act: Activator, threads: int, paths: Sequence[str]) -> None:
        self.act = act
        self.paths = list(paths)
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self.by_pod: dict[str, int] = {}
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> _Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self, i: int) -> None:
        client = Client(self.act.listen, timeout=60)
        n = 0
        try:
            while not self.stop.is_set():
                n += 1
                try:
                    path = self.paths[(i + n) % len(self.paths)]
                    resp = client.request("GET", path, headers={"X-Request-Id": f"c{i}-{n}"})
                except Exception as exc:  # every failure is counted
                    with self._lock:
                        self.failures.append(f"c{i}-{n}: {exc!r}")
                    client.close()
                    client = Client(self.act.listen, timeout=60)
                    continue
                with self._lock:
                    if resp.status == 200:
                        self.ok += 1
                        pod = resp.headers.get("X-Pod", "?")
                        self.by_pod[pod] = self.by_pod.get(pod, 0) + 1
                    else:
                        self.failures.append(f"c{i}-{n}: {resp.status} {resp.headers.get('X-Activator-Reason')}")
        finally:
            client.close()

    @property
    def total(self) -> int:
        with self._lock:
            return self.ok + len(self.failures)


EDITS = 24


@pytest.mark.slow
def test_churn_under_load(pod_factory, activator_factory):
    pods = pod_factory(5)
    rng = random.Random(20261129)

    def config(listed: dict[Pod, bool]) -> dict[str, Any]:
        # listed: pod -> drain flag; order shuffled so every pod is sometimes first.
        entries = [pod_entry(p, drain) for p, drain in listed.items()]
        rng.shuffle(entries)
        return lifecycle_config(entries, queue_depth=1000, queue_timeout="60s", lb_policy="auto")

    act = start(activator_factory, config({pods[0]: False, pods[1]: False}))
    edits = 0
    layouts: list[str] = []
    # Mostly short requests, and some long enough to be in flight on a pod across an
    # unlist/re-list or drain/undrain pair of edits (the case trackers must survive).
    paths = ["/delay?ms=50", "/delay?ms=800"]
    with _Load(act, threads=6, paths=paths) as load:
        wait_until(lambda: load.total >= 10, message="load running")
        for _ in range(EDITS):
            listed: dict[Pod, bool] = {}
            for pod in pods:
                roll = rng.random()
                if roll < 0.45:
                    listed[pod] = False  # listed, serving
                elif roll < 0.65:
                    listed[pod] = True  # listed, drain: true
                # else: unlisted
            if not any(not drain for drain in listed.values()):
                listed[rng.choice(pods)] = False  # always one pod listed and undrained
            act.rewrite_config(config(listed))
            edits += 1
            layouts.append(" ".join(("S" if not listed[p] else "D") if p in listed else "-" for p in pods))
            # Pacing the edits, not a wait for an effect.
            time.sleep(rng.uniform(0.2, 0.3))
        # End with every pod serving, and let the load run on it a moment.
        act.rewrite_config(config({p: False for p in pods}))
        edits += 1
        act.wait_for(
            lambda st: (
                all(p["state"] == "healthy" for p in svc_status(st)["pods"])
                and len(svc_status(st)["pods"]) == len(pods)
            ),
            message="all pods listed at the end",
        )
        total_at_end = load.total
        wait_until(
            lambda: load.total >= total_at_end + 20,
            message="load continues after churn",
        )

    st = act.wait_idle(message="every count back to zero after churn")
    peaks = {p.address: p.stats()["peak"] for p in pods}
    counts = {p.address: p.stats()["count"] for p in pods}
    reloads = len(re.findall(r"config reload \([^)]*\) applied", act.stderr_text()))
    print(
        f"\nchurn: requests={load.total} ok={load.ok} failures={len(load.failures)} "
        f"edits={edits} reloads_applied={reloads} peaks={sorted(peaks.values())} "
        f"per_pod_counts={sorted(counts.values())}"
    )
    for layout in layouts:
        print(f"  layout {layout}")
    assert not load.failures, load.failures[:20]
    assert all(peak <= 1 for peak in peaks.values()), peaks
    assert load.ok >= 50
    assert sum(counts.values()) == load.ok
    assert edits == EDITS + 1
    svc = svc_status(st)
    assert svc["in_flight"] == 0 and svc["queued"] == 0
    assert all(p["in_flight"] == 0 for p in svc["pods"])

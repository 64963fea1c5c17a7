"""End to end: a client that leaves while its request runs on an HTTP/1.1 pod
(SPEC: ``client_gone``; for h2c pods see ``test_grpc.py``: their streams are always reset).

A real activator in front of one ``container_concurrency: 1`` pod (``tests/backend.py``,
whose ``/hold?key=`` requests run until the test releases them). Client A's request
runs on the pod (held); client B's waits in the queue; then A hangs up:

- ``client_gone: finish`` (the default): the pod finishes A's request, the slot stays
  A's until the pod's answer; B reaches the pod only once A's request was released;
- ``client_gone: cancel`` (HAProxy's ``abortonclose``): activator closes A's pod
  connection and the slot is free at once: B reaches the pod while A's request is still
  held there (the pod notices only when it writes).

Either way A is logged ``499 client-gone`` and every count is back to zero. No test
asserts on elapsed time.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import SERVICE, Activator, ActivatorFactory, Pod, PodFactory, make_config, start_request, wait_until

pytestmark = pytest.mark.binary


def service(act: Activator) -> dict[str, Any]:
    result: dict[str, Any] = act.status()["services"][SERVICE]
    return result


@pytest.mark.parametrize("client_gone", ["finish", "cancel"])
def test_a_client_that_leaves_while_its_request_runs(
    pod_factory: PodFactory, activator_factory: ActivatorFactory, client_gone: str
) -> None:
    (pod,) = pod_factory(1)
    config = make_config([pod], top={"access_log": True}, client_gone=client_gone, queue_timeout="60s")
    act = activator_factory(config)
    a = start_request(act.listen, path="/hold?key=a")
    pod_holds(pod, ["a"])
    b = start_request(act.listen, path="/hold?key=b")
    act.wait_for(lambda st: st["services"][SERVICE]["queued"] == 1, message="b queued behind a")
    a.close()  # a hangs up while its request runs
    if client_gone == "cancel":
        pod_holds(pod, ["a", "b"])  # b got the slot at once; a's request is still held
        assert pod.release("a") == 1
    else:
        # a's request keeps its slot until the pod answers it: b is still queued (had the
        # slot gone back, b would run beside a: the pod's peak, checked below, says 1).
        assert service(act)["queued"] == 1 and pod.held() == ["a"]
        assert pod.release("a") == 1
        pod_holds(pod, ["b"])
    assert pod.release("b") == 1
    answer = b.getresponse()
    assert (answer.status, answer.read()) == (200, f"released b on {pod.address}\n".encode())
    b.close()
    record = act.wait_access(lambda r: "/hold?key=a" in r.target)
    assert (record.status, record.reason) == (499, "client-gone")
    assert pod.stats()["peak"] == (2 if client_gone == "cancel" else 1)
    act.wait_idle()


def pod_holds(pod: Pod, keys: list[str]) -> None:
    wait_until(lambda: sorted(pod.held()) == keys, message=f"the pod holding {keys}")

"""End to end: a peer that is not running leaves the file (issue 25, bug 2).

Real ``activator run`` processes on 127.0.0.1 in front of ``tests/backend.py`` pods.

- **Knative's TestActivatorsIndexUpdate**: activator ``vm-b`` starts with peers ``vm-a``
  (not running: its port refuses) and ``vm-b``; it owns its share (``vm-a`` refused, so it
  runs nothing) and shows ``vm-a`` down. The file then drops the peers: ``vm-b`` is
  alone (no ``activators`` section at all, as Knative's single activator), owns every
  slot of every pod, with nothing left waiting for a hand-over, and serves cc requests
  on every pod at once. Before the fix, nobody asked ``vm-a`` again once it left the
  file (the secret went with the section) and its slots waited out the whole
  ``request_timeout + grace_period``.
- The same with the peers section kept, naming ``vm-b`` alone.

The waits poll with the harness's default timeout (30 s), far below the 330 s the slots
were held; no assertion is on elapsed time.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest
from harness import LOCALHOST, Activator, Pod, free_ports, request, service_config

pytestmark = pytest.mark.binary

SECRET = "the-fleets-shared-secret"
CHECKS = {"interval": "200ms", "timeout": "500ms", "unhealthy_after": 2}


def file_of(listen: str, peers: dict[str, str] | None, pods: Sequence[Pod], cc: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "listen": listen,
        "access_log": False,
        "services": {"api": service_config(pods, container_concurrency=cc, queue_timeout="30s")},
    }
    if peers is not None:
        config["activators"] = {"self": "vm-b", "peers": peers, "secret": SECRET, **CHECKS}
    return config


def capacity(status: dict[str, Any]) -> int:
    return int(status["services"]["api"]["capacity"])


@pytest.mark.parametrize("alone", ["no activators section", "vm-b alone in the peers"])
def test_a_removed_peer_that_refuses_gives_every_slot_at_once(alone, pod_factory, activator_factory):
    cc = 2
    pods = pod_factory(3)
    port_a, port_b = free_ports(2)  # nothing ever listens on vm-a's port
    peers = {"vm-a": f"{LOCALHOST}:{port_a}", "vm-b": f"{LOCALHOST}:{port_b}"}
    act: Activator = activator_factory(file_of(peers["vm-b"], peers, pods, cc))

    status = act.wait_for(
        lambda st: (
            st["activator"]["health"]["vm-a"]["state"] == "down" and st["services"]["api"]["handover_slots"] == 0
        ),
        message="vm-a down (refused) and vm-b's share usable",
    )
    share = capacity(status)
    assert 0 < share < cc * len(pods), status["services"]["api"]

    act.rewrite_config(
        file_of(peers["vm-b"], None if alone == "no activators section" else {"vm-b": peers["vm-b"]}, pods, cc)
    )
    act.reload()
    status = act.wait_for(
        lambda st: capacity(st) == cc * len(pods) and st["services"]["api"]["handover_slots"] == 0,
        message="every slot usable at once (vm-a refused: it runs nothing)",
    )
    assert "vm-a" not in status["activator"]["health"], status["activator"]
    assert all(p["slots"] == cc for p in status["services"]["api"]["pods"]), status["services"]["api"]["pods"]

    # cc requests on every pod at once: all served together, none above cc.
    answers: list[int] = []
    threads = [
        threading.Thread(target=lambda: answers.append(request(act.listen, "GET", "/delay?ms=500").status))
        for _ in range(cc * len(pods))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [200] * cc * len(pods)
    for pod in pods:
        assert pod.stats()["peak"] <= cc

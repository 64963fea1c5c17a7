"""The cost of a class and a tenant key per queued request, in the core, measured.

Run: .venv/bin/python bench/queue_policy.py
One cc=1 service whose every request waits: each round admits BATCH requests (the pod is
busy), then releases slots until all were served (each release hands the slot to the next
waiter, as the shell's release does). Three services, the same work: one FIFO (no
``priority``, no ``fair_by``), three classes (each request classified from a head with a
``Priority`` header), three classes and ``fair_by: {header: X-API-Key}`` over 50 keys.
Interleaved rounds, CPU time (``time.process_time``) per request, medians; the ratios
are against the FIFO of the same run. This is the queue's own cost, not a whole proxied
request's (the engine's ~60 us per request in RESULTS.md is the denominator that matters).
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from builders import svc

from activator.core.config import FairBy, PriorityConfig
from activator.core.throttler import Grant, ServiceThrottler

BATCH = 2000
ROUNDS = 15
CLASSES = PriorityConfig(("critical", "standard", "sheddable"), "standard")
SERVICES = {
    "FIFO": {},
    "3 classes": {"priority": CLASSES},
    "3 classes + tenants": {"priority": CLASSES, "fair_by": FairBy("x-api-key")},
}


def heads(n: int) -> list[tuple[list[tuple[bytes, bytes]], list[bytes]]]:
    out = []
    for i in range(n):
        lines = [
            (b"Host", b"api.example.com"),
            (b"User-Agent", b"bench/1"),
            (b"Accept", b"*/*"),
            (b"Priority", b"u=%d" % (i % 8)),
            (b"X-API-Key", b"key-%d" % (i % 50)),
        ]
        out.append((lines, [name.lower() for name, _ in lines]))
    return out


def one_round(options: dict[str, object], requests: list[tuple[list[tuple[bytes, bytes]], list[bytes]]]) -> float:
    config = svc("10.0.0.1:80", cc=1, probe=None, queue_depth=len(requests) + 1, **options)
    throttler = ServiceThrottler(config, 0.0)
    busy = throttler.acquire(0.0)
    assert isinstance(busy, Grant)
    classifier = throttler.classifier
    start = time.process_time()
    for headers, names in requests:
        klass, tenant = 0, None
        if classifier.active:
            klass, tenant = classifier.classify("api.example.com", "10.0.0.9", headers, names)
        throttler.admit(1.0, klass, tenant)
    grant = busy
    for _ in range(len(requests)):
        effects = throttler.release(grant, 2.0)
        next_grant = effects.woken[0].grant
        assert next_grant is not None
        grant = next_grant
    spent = time.process_time() - start
    throttler.release(grant, 3.0)
    return spent / len(requests) * 1e6


def main() -> None:
    requests = heads(BATCH)
    times: dict[str, list[float]] = {name: [] for name in SERVICES}
    for _ in range(ROUNDS):
        for name, options in SERVICES.items():
            times[name].append(one_round(options, requests))
    base = statistics.median(times["FIFO"])
    print(f"queued requests, {BATCH} per round, {ROUNDS} interleaved rounds; CPU per request (median)")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"  {name:22s} {median:6.2f} us  ({median / base:.2f}x FIFO, +{median - base:.2f} us)")


if __name__ == "__main__":
    main()

"""pytest setup of the contract tier: one suite per interface, run over every transport.

Each test of ``test_pod_clients.py`` and ``test_client_exchanges.py`` takes the
``transport`` parameter (through the ``pod_side`` / ``client_side`` fixtures) and runs once
per transport, as trio runs one suite over its lock types. A test body never asks which
transport it runs on: what genuinely differs between HTTP/1.1 and HTTP/2 is a property of
the adapter (``pod_sides``, ``client_sides``).

Where the two implementations disagree and the contract says which one is right, the test
is written as the contract says and marked ``@discrepancy(transport, reason=...)``: that
transport's run is then ``xfail(strict=True)``, so the mark has to go once the engine is
fixed (a strict xfail that passes fails the run).

Every test runs under a bound (``TEST_BOUND``): a wait that no deadline of the code under
test ends fails the test instead of hanging the suite. Nothing here asserts a duration.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import gevent
import pytest

#: The transports every contract test runs over, by their test id.
TRANSPORTS = ("http1", "http2")
#: Seconds after which a whole test counts as hung (each takes well under one).
TEST_BOUND = 20.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "discrepancy(transport, reason): the contract as it should be; that transport does not keep it yet "
        "(its run is xfail strict)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "transport" not in metafunc.fixturenames:
        return
    gaps: dict[str, str] = {}
    for mark in metafunc.definition.iter_markers("discrepancy"):
        (transport,) = mark.args
        assert transport in TRANSPORTS, f"unknown transport {transport!r} in a discrepancy mark"
        gaps[transport] = mark.kwargs["reason"]
    metafunc.parametrize(
        "transport",
        [
            pytest.param(
                transport,
                id=transport,
                marks=[pytest.mark.xfail(strict=True, reason=gaps[transport])] if transport in gaps else [],
            )
            for transport in TRANSPORTS
        ],
    )


@pytest.fixture(autouse=True)
def hang_is_failure() -> Iterator[None]:
    """A wait that nothing ends fails the test instead of hanging it."""
    with gevent.Timeout(TEST_BOUND, AssertionError(f"the test was still waiting after {TEST_BOUND}s")):
        yield


@pytest.fixture(autouse=True)
def no_internal_error(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """An error logged by activator (an internal error: a bug, or a handler's failed
    assertion inside the engine) fails the test."""
    caplog.set_level(logging.ERROR, logger="activator")
    yield
    errors = [record for record in caplog.get_records("call") if record.levelno >= logging.ERROR]
    assert not errors, f"activator logged errors: {[record.getMessage() for record in errors]}"

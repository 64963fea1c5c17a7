"""pytest setup of the HTTP/1.1 conformance tier.

Each module starts its own activator and recording pod once (``wire.proxy_setup``, in a
module-scoped ``proxy`` fixture) and reuses them for all its tests. When a test fails,
the output of the activator it used is printed into its report.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from wire import Proxy


@pytest.fixture(autouse=True)
def _activator_output_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    report = getattr(request.node, "rep_call", None)
    if report is None or not report.failed:
        return
    for value in getattr(request.node, "funcargs", {}).values():
        if isinstance(value, Proxy):
            print(f"\n=== activator {value.act.command()} in {value.act.dir}\n{value.act.output_tail()}")

"""Shared helpers of the in-process tests (core and races): config values, and what a
core call's ``Effects`` hold.

``pod`` and ``svc`` build configs directly (no YAML). ``moves`` reads a call's pod state
changes as plain tuples and ``expect`` asserts a call's effects exactly: the waiters it
woke, in order, and the state changes, in order. That is the core's contract with the
shell ("effects out"): nothing more is woken or logged than what a call returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from activator.core.config import PodConfig, ServiceConfig
from activator.core.states import PodEvent, PodState, next_state
from activator.core.throttler import Effects, Waiter

#: One pod state change: (address, old state, new state, event).
Move = tuple[str, PodState, PodState, PodEvent]


def pod(address: str, drain: bool = False) -> PodConfig:
    host, port = address.rsplit(":", 1)
    return PodConfig(address=address, host=host.strip("[]"), port=int(port), drain=drain)


def svc(*pods: str | PodConfig, cc: int = 1, name: str = "api", **kw: Any) -> ServiceConfig:
    """Service ``name`` (``api`` unless told) with these pods (addresses or PodConfig values)."""
    kw.setdefault("hosts", (f"{name}.example.com",))
    return ServiceConfig(
        name=name,
        container_concurrency=cc,
        pods=tuple(p if isinstance(p, PodConfig) else pod(p) for p in pods),
        **kw,
    )


def moves(effects: Effects) -> list[Move]:
    """The pod state changes of one call, in the order they happened."""
    return [(tr.address, tr.old, tr.new, tr.event) for tr in effects.transitions]


def expect(
    effects: Effects,
    *,
    woken: Sequence[Waiter] = (),
    changes: Sequence[Move] = (),
    service: str = "api",
) -> None:
    """Exactly ``woken`` (in this order, each with a grant or redirected) and exactly
    ``changes`` (in order, each a real change of ``service``'s pod by the table)."""
    assert [id(w) for w in effects.woken] == [id(w) for w in woken], (
        f"woke {len(effects.woken)} waiter(s), expected {len(woken)} (or another order)"
    )
    for waiter in effects.woken:
        assert (waiter.grant is not None) != waiter.redirected, "woken with neither a grant nor a redirect"
    assert moves(effects) == list(changes)
    for tr in effects.transitions:
        assert tr.service == service and tr.reason, tr
        assert tr.new is not tr.old and next_state(tr.old, tr.event) is tr.new, tr
    assert bool(effects) == bool(woken or changes)

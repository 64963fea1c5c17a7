"""``core.h2budgets``: what one HTTP/2 client connection may cost, counted over a sliding
window. Flooders are caught at their budget; the traffic of normal clients (a gRPC client
answering each small message with WINDOW_UPDATEs, a browser reading a large answer,
priorities per stream) never is. Pure: the clock is an argument.
"""

import pytest

from activator.core.h2budgets import (
    EMPTY_FRAMES,
    PINGS,
    PRIORITY,
    RESETS,
    SETTINGS,
    WINDOW_UPDATES,
    Budget,
    BudgetMeter,
    H2Budgets,
)

BUDGETS = H2Budgets()


def first_excess(meter: BudgetMeter, index: int, times: int, now: float = 0.0) -> int | None:
    """Count ``times`` frames at ``now``: the 1-based number of the first one over the budget."""
    for n in range(1, times + 1):
        if meter.count(index, 1, now) is not None:
            return n
    return None


@pytest.mark.parametrize(
    ("index", "budget"),
    [
        (RESETS, Budget.RESETS),
        (PINGS, Budget.PINGS),
        (SETTINGS, Budget.SETTINGS),
        (EMPTY_FRAMES, Budget.EMPTY_FRAMES),
        (WINDOW_UPDATES, Budget.WINDOW_UPDATES),
        (PRIORITY, Budget.PRIORITY),
    ],
)
def test_a_flood_is_caught_just_past_its_budget(index: int, budget: Budget) -> None:
    meter = BudgetMeter(BUDGETS, 0.0)
    assert first_excess(meter, index, 100_000) == BUDGETS.limit(budget) + 1
    assert meter.count(index, 1, 0.0) is budget


def test_counts_leave_the_window() -> None:
    meter = BudgetMeter(BUDGETS, 0.0)
    assert first_excess(meter, RESETS, BUDGETS.resets) is None
    # Two windows later the old resets weigh nothing: a whole budget again.
    assert first_excess(meter, RESETS, BUDGETS.resets, now=2 * BUDGETS.window) is None


def test_the_window_slides_instead_of_resetting_at_once() -> None:
    meter = BudgetMeter(BUDGETS, 0.0)
    first_excess(meter, RESETS, BUDGETS.resets, now=BUDGETS.window / 2 - 0.01)
    # Just after the half turned, the previous half still weighs almost fully.
    assert first_excess(meter, RESETS, BUDGETS.resets, now=BUDGETS.window / 2 + 0.01) is not None


def test_a_grpc_client_at_400_calls_a_second_never_meets_the_window_update_budget() -> None:
    """grpcio sends a stream's and the connection's WINDOW_UPDATE for each small answer:
    found by the h2 bench, where a fixed budget closed a normal client every ~500 calls."""
    meter = BudgetMeter(BUDGETS, 0.0)
    for call in range(400 * 30):
        now = call / 400
        meter.opened_stream(now)
        meter.sent_data(12, now)  # one small message
        assert meter.count(WINDOW_UPDATES, 2, now) is None, f"call {call}"


def test_a_client_reading_a_large_answer_earns_its_window_updates() -> None:
    meter = BudgetMeter(BUDGETS, 0.0)
    meter.opened_stream(0.0)
    for chunk in range(20_000):  # 320 MB in 16 KiB writes, four WINDOW_UPDATEs each
        now = chunk / 2000
        meter.sent_data(16384, now)
        assert meter.count(WINDOW_UPDATES, 4, now) is None


def test_window_updates_without_traffic_are_a_flood_even_between_calls() -> None:
    meter = BudgetMeter(BUDGETS, 0.0)
    meter.opened_stream(0.0)
    meter.sent_data(12, 0.0)
    earned = 2 * 2  # the stream and the DATA write
    assert first_excess(meter, WINDOW_UPDATES, 100_000) == BUDGETS.window_updates + earned + 1


def test_priority_frames_are_earned_per_stream() -> None:
    meter = BudgetMeter(BUDGETS, 0.0)
    for _ in range(500):
        meter.opened_stream(0.0)
    assert first_excess(meter, PRIORITY, 100_000) == BUDGETS.priority + 500 * 10 + 1

"""What one HTTP/2 client connection may cost: its budgets, counted over a sliding window.

A client that opens streams and resets them at once (the "rapid reset" of
CVE-2023-44487), floods PING or SETTINGS frames whose acknowledgements it never reads,
sends frames that carry nothing, or WINDOW_UPDATE and PRIORITY frames far beyond what its
traffic needs, costs the process CPU and memory that a normal client never asks for. Each
of those has a budget here, as Envoy's ``http2_protocol_options`` and the glitch counters
of HAProxy and nginx have; past a budget the connection gets GOAWAY ``ENHANCE_YOUR_CALM``
and is closed (the shell does that, logs it once and counts it).

``H2Budgets`` is the configuration (``limits.http2`` in the YAML file); ``BudgetMeter``
counts one connection. Counts are kept over a sliding ``window`` of seconds
(approximated by two fixed halves of a window, the older one weighted by how much of it
is still inside; exact enough for a budget, O(1) per count). The budgets:

- ``resets``: streams the client reset before their response began (a client that
  cancels a call after its answer started costs nothing);
- ``pings`` and ``settings``: PING and SETTINGS frames received (each owes an ack);
- ``pending_acks``: acks owed and not yet taken by the client's socket (a client that
  never reads; not over the window: since the writer last caught up);
- ``empty_frames``: DATA, HEADERS or CONTINUATION frames with no payload that do not end
  their stream;
- ``window_updates``: WINDOW_UPDATE frames beyond what the client's traffic earns in the
  window: one per ``WINDOW_UPDATE_BYTES`` of DATA sent to it (a client reading a large
  answer sends them as it reads), and ``WINDOW_UPDATES_PER_EXCHANGE`` for each stream it
  opened and for each DATA write to it (a gRPC client such as grpcio answers every
  small message with a stream's and the connection's WINDOW_UPDATE: about two per call);
- ``priority``: PRIORITY frames beyond ``PRIORITY_PER_STREAM`` per stream opened in the
  window;
- ``continuations``: CONTINUATION frames in one header block (not over the window).

Pure: the time is an argument, nothing here does I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Budget(enum.Enum):
    """A budget, named as the log line, StatsD (``{p}.h2.goaway.{name}``) and
    ``/metrics`` name it."""

    RESETS = "resets"
    PINGS = "pings"
    SETTINGS = "settings"
    PENDING_ACKS = "pending_acks"
    EMPTY_FRAMES = "empty_frames"
    WINDOW_UPDATES = "window_updates"
    PRIORITY = "priority"
    CONTINUATIONS = "continuations"


#: The budgets counted over the window, in ``BudgetMeter``'s order.
WINDOWED = (
    Budget.RESETS,
    Budget.PINGS,
    Budget.SETTINGS,
    Budget.EMPTY_FRAMES,
    Budget.WINDOW_UPDATES,
    Budget.PRIORITY,
)
RESETS, PINGS, SETTINGS, EMPTY_FRAMES, WINDOW_UPDATES, PRIORITY = range(len(WINDOWED))
#: After the budgets' counts: what the client's traffic earns.
_BYTES_SENT, _STREAMS_OPENED, _DATA_WRITES = range(len(WINDOWED), len(WINDOWED) + 3)

#: DATA sent to the client that earns one more WINDOW_UPDATE in the window.
WINDOW_UPDATE_BYTES = 4096
#: WINDOW_UPDATE frames that each stream opened, and each DATA write to the client, earn.
WINDOW_UPDATES_PER_EXCHANGE = 2
#: PRIORITY frames each stream opened in the window earns.
PRIORITY_PER_STREAM = 10


@dataclass(frozen=True)
class H2Budgets:
    """The budgets of one client connection (see the module docstring); defaults that a
    normal client never meets."""

    window: float = 10.0
    resets: int = 200
    pings: int = 100
    settings: int = 100
    pending_acks: int = 1000
    empty_frames: int = 100
    window_updates: int = 1000
    priority: int = 1000
    continuations: int = 32

    def limit(self, budget: Budget) -> int:
        return int(getattr(self, budget.value))


class BudgetMeter:
    """The counts of one connection (see the module docstring)."""

    __slots__ = ("budgets", "_start", "_current", "_previous", "_limits")

    def __init__(self, budgets: H2Budgets, now: float) -> None:
        self.budgets = budgets
        #: When the current half began; counts of the current and the previous half, in
        #: ``WINDOWED`` order, plus the DATA bytes sent, the streams opened and the DATA
        #: writes (``_BYTES_SENT``, ``_STREAMS_OPENED``, ``_DATA_WRITES``).
        self._start = now
        self._current = [0] * (len(WINDOWED) + 3)
        self._previous = [0] * (len(WINDOWED) + 3)
        self._limits = [budgets.limit(budget) for budget in WINDOWED]

    def _roll(self, now: float) -> float:
        """Move the halves on to ``now``; the weight of the previous half."""
        half = self.budgets.window / 2
        elapsed = now - self._start
        if elapsed >= half:
            if elapsed >= 2 * half:
                self._previous = [0] * len(self._current)
            else:
                self._previous = self._current
            self._current = [0] * len(self._previous)
            self._start = now if elapsed >= 2 * half else self._start + half
            elapsed = now - self._start
        return 1.0 - elapsed / half

    def _value(self, index: int, weight: float) -> float:
        return self._previous[index] * weight + self._current[index]

    def count(self, index: int, n: int, now: float) -> Budget | None:
        """``n`` more of the windowed budget ``index`` (``RESETS``, ``PINGS``, ...); the
        budget now exceeded, if one is."""
        weight = self._roll(now)
        self._current[index] += n
        allowed = self._limits[index]
        if index == WINDOW_UPDATES:
            exchanges = self._value(_STREAMS_OPENED, weight) + self._value(_DATA_WRITES, weight)
            allowed += int(self._value(_BYTES_SENT, weight)) // WINDOW_UPDATE_BYTES
            allowed += int(exchanges) * WINDOW_UPDATES_PER_EXCHANGE
        elif index == PRIORITY:
            allowed += int(self._value(_STREAMS_OPENED, weight)) * PRIORITY_PER_STREAM
        if self._value(index, weight) > allowed:
            return WINDOWED[index]
        return None

    def sent_data(self, size: int, now: float) -> None:
        """``size`` bytes of DATA went to the client (they earn WINDOW_UPDATE frames)."""
        self._roll(now)
        self._current[_BYTES_SENT] += size
        self._current[_DATA_WRITES] += 1

    def opened_stream(self, now: float) -> None:
        """The client opened a stream (it earns PRIORITY frames)."""
        self._roll(now)
        self._current[_STREAMS_OPENED] += 1

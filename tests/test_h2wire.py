"""The HTTP/2 driver's frame scanner (``activator.base.h2wire.FrameScanner``), on every split of its input.

The scanner walks the frame headers of what a peer sends, before ``h2`` sees it: what it
passes on must be exactly the frames that came, in order, but the GOAWAY frames it takes
out (the pod side), cut into batches of at most ``BATCH_FRAMES`` frames that each end
where a frame does; what it counts (frames without payload, PINGs and SETTINGS that are
not acks, WINDOW_UPDATEs, PRIORITYs, the longest run of CONTINUATIONs) must be exactly
what the frames hold, however the bytes were split between reads; and a frame longer than
we accept is refused at its header. Pure: no sockets.
"""

from __future__ import annotations

from typing import Any

import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from activator.base.h2wire import (
    BATCH_FRAMES,
    CLIENT_PREFACE,
    COUNT_CONTINUATIONS,
    COUNT_EMPTY,
    COUNT_PINGS,
    COUNT_PRIORITIES,
    COUNT_SETTINGS,
    COUNT_WINDOW_UPDATES,
    Batch,
    FrameScanner,
    FrameTooLarge,
)

frames = st.lists(
    st.one_of(
        st.builds(
            lambda n, data, end: DataFrame(n * 2 + 1, data=data, flags=["END_STREAM"] if end else []),
            st.integers(0, 100),
            st.binary(max_size=40),
            st.booleans(),
        ),
        st.builds(
            lambda data, ack: PingFrame(0, opaque_data=data, flags=["ACK"] if ack else []),
            st.binary(min_size=8, max_size=8),
            st.booleans(),
        ),
        st.builds(lambda ack: SettingsFrame(0, flags=["ACK"] if ack else []), st.booleans()),
        st.builds(lambda n, inc: WindowUpdateFrame(n, window_increment=inc), st.integers(0, 9), st.integers(1, 1000)),
        st.builds(lambda n: PriorityFrame(n * 2 + 1, depends_on=0, stream_weight=16), st.integers(0, 9)),
        st.builds(lambda n, block: HeadersFrame(n * 2 + 1, data=block), st.integers(0, 9), st.binary(max_size=10)),
        st.builds(lambda n, block: ContinuationFrame(n * 2 + 1, data=block), st.integers(0, 9), st.binary(max_size=10)),
        st.builds(
            lambda last, code, extra: GoAwayFrame(0, last_stream_id=last, error_code=code, additional_data=extra),
            st.integers(0, 2**31 - 1),
            st.integers(0, 13),
            st.binary(max_size=20),
        ),
    ),
    max_size=12,
)


def expected_counts(sent: list[Any]) -> list[int]:
    counts = [0] * 6
    run = 0
    for frame in sent:
        carries_data = isinstance(frame, (DataFrame, HeadersFrame, ContinuationFrame))
        if carries_data and not frame.body_len and "END_STREAM" not in frame.flags:
            counts[COUNT_EMPTY] += 1
        if isinstance(frame, HeadersFrame):
            run = 0
        elif isinstance(frame, ContinuationFrame):
            run += 1
            counts[COUNT_CONTINUATIONS] = max(counts[COUNT_CONTINUATIONS], run)
        elif isinstance(frame, PingFrame) and "ACK" not in frame.flags:
            counts[COUNT_PINGS] += 1
        elif isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
            counts[COUNT_SETTINGS] += 1
        elif isinstance(frame, WindowUpdateFrame):
            counts[COUNT_WINDOW_UPDATES] += 1
        elif isinstance(frame, PriorityFrame):
            counts[COUNT_PRIORITIES] += 1
    return counts


def scan(scanner: FrameScanner, wire: bytes, cuts: list[int]) -> list[Batch]:
    batches: list[Batch] = []
    start = 0
    for end in [*sorted({cut % (len(wire) + 1) for cut in cuts}), len(wire)]:
        batches += scanner.feed(wire[start:end])
        start = end
    return batches


@settings(max_examples=300, deadline=None)
@given(frames, st.lists(st.integers(0, 10_000), max_size=10), st.booleans())
def test_what_passes_is_every_frame_but_the_goaways_it_takes_out(
    sent: list[Any], cuts: list[int], cut_goaway: bool
) -> None:
    wire = b"".join(frame.serialize() for frame in sent)
    batches = scan(FrameScanner(cut_goaway=cut_goaway), wire, cuts)
    passed = b"".join(batch.data for batch in batches)
    goaways = [goaway for batch in batches for goaway in batch.goaways]
    kept = [f for f in sent if not (cut_goaway and isinstance(f, GoAwayFrame))]
    assert passed == b"".join(f.serialize() for f in kept)
    expected = [f for f in sent if cut_goaway and isinstance(f, GoAwayFrame)]
    assert [(g.last_stream_id, g.error_code, g.additional_data) for g in goaways] == [
        (g.last_stream_id, g.error_code, g.additional_data) for g in expected
    ]
    totals = [sum(batch.counts[i] for batch in batches) for i in range(6)]
    expected_totals = expected_counts(sent)
    # The longest run of CONTINUATIONs is per batch (a run may span reads: each batch
    # reports the longest it saw go on).
    longest = max((batch.counts[COUNT_CONTINUATIONS] for batch in batches), default=0)
    assert longest == expected_totals[COUNT_CONTINUATIONS]
    totals[COUNT_CONTINUATIONS] = expected_totals[COUNT_CONTINUATIONS]
    assert totals == expected_totals


def test_batches_end_where_a_frame_does_and_hold_at_most_batch_frames() -> None:
    pings = [PingFrame(0, opaque_data=b"%08d" % i) for i in range(3 * BATCH_FRAMES + 5)]
    wire = b"".join(frame.serialize() for frame in pings)
    batches = FrameScanner().feed(wire)
    assert [batch.counts[COUNT_PINGS] for batch in batches] == [BATCH_FRAMES] * 3 + [5]
    assert [len(batch.data) for batch in batches] == [17 * BATCH_FRAMES] * 3 + [17 * 5]
    assert b"".join(batch.data for batch in batches) == wire


def test_a_clients_preface_passes_untouched_before_the_first_frame() -> None:
    wire = CLIENT_PREFACE + SettingsFrame(0).serialize() + PingFrame(0, opaque_data=b"12345678").serialize()
    scanner = FrameScanner(preface=len(CLIENT_PREFACE))
    batches = scan(scanner, wire, [5, 30])
    assert b"".join(batch.data for batch in batches) == wire
    assert sum(batch.counts[COUNT_SETTINGS] for batch in batches) == 1
    assert sum(batch.counts[COUNT_PINGS] for batch in batches) == 1


def test_a_frame_longer_than_we_accept_is_refused_at_its_header() -> None:
    # An HTTP/1.1 answer read as a frame header announces 4.7 MB: refused before any of it is kept.
    with pytest.raises(FrameTooLarge):
        FrameScanner().feed(b"HTTP/1.1 200 OK\r\n")

"""The one-shot signals to the host's block check: keyed, consumed once, and loud when left over."""

from __future__ import annotations

import logging

from fdsched.core.metrics import METRICS
from fdsched.patches._base import BlockCheckSignals


def test_a_signal_is_consumed_only_by_a_check_of_its_block_count():
    signals = BlockCheckSignals()
    signals.expect("refuse-running-chunk", "r1", 4)
    assert signals.take(5) == frozenset()  # someone else's check in between takes nothing
    assert signals.take(4) == {"refuse-running-chunk"}
    assert signals.take(4) == frozenset()  # one shot


def test_signals_for_the_same_check_are_taken_together():
    signals = BlockCheckSignals()
    signals.expect("refuse-running-chunk", "r1", 4)
    signals.expect("count-refusal", "(threshold)", 4)
    signals.expect("count-refusal", "(threshold)", 9)
    assert signals.take(4) == {"refuse-running-chunk", "count-refusal"}
    assert [e.num_blocks for e in signals.pending()] == [9]


def test_what_is_left_at_the_end_of_a_pass_is_dropped_logged_and_counted(caplog):
    METRICS.reset()
    signals = BlockCheckSignals()
    signals.expect("refuse-running-chunk", "r7", 3)
    logger = logging.getLogger("fdsched-test")
    with caplog.at_level(logging.WARNING, logger="fdsched-test"):
        dropped = signals.end_pass(logger)
    assert [e.request_id for e in dropped] == ["r7"]
    assert signals.pending() == ()
    assert METRICS.unconsumed_signals == {"refuse-running-chunk": 1}
    assert any("refuse-running-chunk" in r.getMessage() and "r7" in r.getMessage() for r in caplog.records)
    assert signals.end_pass(logger) == []  # a clean pass reports nothing
    assert METRICS.unconsumed_signals == {"refuse-running-chunk": 1}

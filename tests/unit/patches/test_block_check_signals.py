"""The one-shot signals to the host's block check: keyed to the thread, the request in focus and the block
count; consumed once; loud when left over."""

from __future__ import annotations

import logging
import threading

from fdsched.core.metrics import METRICS
from fdsched.patches._base import BlockCheckSignals


def _on_another_thread(func):
    out = []
    thread = threading.Thread(target=lambda: out.append(func()))
    thread.start()
    thread.join()
    return out[0]


def test_a_signal_is_consumed_only_by_a_check_of_its_block_count():
    signals = BlockCheckSignals()
    signals.focus("r1")
    signals.expect("refuse-running-chunk", 4)
    assert signals.take(5) == frozenset()  # someone else's check in between takes nothing
    assert signals.take(4) == {"refuse-running-chunk"}
    assert signals.take(4) == frozenset()  # one shot


def test_a_check_for_another_request_does_not_take_it():
    signals = BlockCheckSignals()
    signals.focus("r1")
    signals.expect("refuse-running-chunk", 4)
    signals.focus("r2")  # the scheduler moved on to another request's checks
    assert signals.take(4) == frozenset()
    signals.focus("r1")
    assert signals.take(4) == {"refuse-running-chunk"}


def test_a_check_of_the_same_count_on_another_thread_neither_takes_nor_is_bent_by_it():
    signals = BlockCheckSignals()
    signals.focus("r1")
    signals.expect("refuse-running-chunk", 4)
    assert _on_another_thread(lambda: signals.take(4)) == frozenset()
    assert _on_another_thread(lambda: (signals.focus("r1"), signals.take(4))[1]) == frozenset()
    assert signals.take(4) == {"refuse-running-chunk"}  # still there for the scheduler's own check


def test_signals_for_the_same_check_are_taken_together():
    signals = BlockCheckSignals()
    signals.focus("r1")
    signals.expect("refuse-running-chunk", 4)
    signals.expect("count-refusal", 4)
    signals.expect("count-refusal", 9)
    assert signals.take(4) == {"refuse-running-chunk", "count-refusal"}
    assert [e.num_blocks for e in signals.pending()] == [9]


def test_what_is_left_at_the_end_of_a_pass_is_dropped_logged_and_counted(caplog):
    METRICS.reset()
    signals = BlockCheckSignals()
    signals.focus("r7")
    signals.expect("refuse-running-chunk", 3)
    logger = logging.getLogger("fdsched-test")
    with caplog.at_level(logging.WARNING, logger="fdsched-test"):
        dropped = signals.end_pass(logger)
    assert [e.request_id for e in dropped] == ["r7"]
    assert signals.pending() == ()
    assert METRICS.unconsumed_signals == {"refuse-running-chunk": 1}
    assert any("refuse-running-chunk" in r.getMessage() and "r7" in r.getMessage() for r in caplog.records)
    assert signals.end_pass(logger) == []  # a clean pass reports nothing
    assert METRICS.unconsumed_signals == {"refuse-running-chunk": 1}


def test_the_end_of_one_threads_pass_leaves_another_threads_signals_alone():
    METRICS.reset()
    signals = BlockCheckSignals()
    signals.focus("r1")
    signals.expect("refuse-running-chunk", 4)
    assert _on_another_thread(lambda: signals.end_pass(logging.getLogger("fdsched-test"))) == []
    assert signals.take(4) == {"refuse-running-chunk"}
    assert METRICS.unconsumed_signals == {}

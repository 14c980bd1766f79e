"""The per-pass object the cache manager's block check consults: one question per check, answered by the pass open
on the checking thread, consumed once, loud when left over."""

from __future__ import annotations

import logging
import threading

from fdsched.core.metrics import METRICS
from fdsched.patches._pass import NO_PASSES, PassDesk, SchedulePass


def _on_another_thread(func):
    out = []
    thread = threading.Thread(target=lambda: out.append(func()))
    thread.start()
    thread.join()
    return out[0]


def test_an_expectation_is_consumed_only_by_a_check_of_its_block_count():
    schedule_pass = SchedulePass(None)
    schedule_pass.focus("r1")
    schedule_pass.expect("refuse-running-chunk", 4)
    assert schedule_pass.take(5) == frozenset()  # another check in between takes nothing
    assert schedule_pass.take(4) == {"refuse-running-chunk"}
    assert schedule_pass.take(4) == frozenset()  # one shot


def test_a_check_for_another_request_does_not_take_it():
    schedule_pass = SchedulePass(None)
    schedule_pass.focus("r1")
    schedule_pass.expect("refuse-running-chunk", 4)
    schedule_pass.focus("r2")  # the scheduler moved on to another request's checks
    assert schedule_pass.take(4) == frozenset()
    schedule_pass.focus("r1")
    assert schedule_pass.take(4) == {"refuse-running-chunk"}


def test_a_check_on_another_thread_finds_no_pass_of_its_own():
    desk = PassDesk()
    schedule_pass = SchedulePass(None)
    outer = desk.open(schedule_pass)
    schedule_pass.focus("r1")
    schedule_pass.expect("refuse-running-chunk", 4)
    assert _on_another_thread(desk.consulted) is None  # the pool's own answer there
    assert _on_another_thread(desk.current) is None
    assert desk.consulted() is schedule_pass and schedule_pass.take(4) == {"refuse-running-chunk"}
    desk.close(outer)
    assert desk.current() is None and desk.consulted() is None


def test_a_second_threads_pass_neither_replaces_nor_sees_the_first():
    desk = PassDesk()
    first = SchedulePass(None)
    desk.open(first)
    second = SchedulePass(None)

    def other():
        outer = desk.open(second)
        seen = desk.current()
        desk.close(outer)
        return seen

    assert _on_another_thread(other) is second
    assert desk.current() is first


def test_a_nested_pass_gives_the_outer_one_back():
    desk = PassDesk()
    outer_pass, inner_pass = SchedulePass(None), SchedulePass(None)
    assert desk.open(outer_pass) is None
    covered = desk.open(inner_pass)
    assert covered is outer_pass and desk.current() is inner_pass
    desk.close(covered)
    assert desk.current() is outer_pass


def test_a_question_asked_outside_a_pass_is_consulted_but_is_no_pass():
    desk = PassDesk()
    question = SchedulePass(None)
    desk.ask_outside_a_pass(question)
    question.expect("count-refusal", 3)
    assert desk.current() is None  # the scheduler's code sees no open pass here
    assert desk.consulted() is question and question.take(3) == {"count-refusal"}
    assert _on_another_thread(desk.consulted) is None


def test_expectations_for_the_same_check_are_taken_together():
    schedule_pass = SchedulePass(None)
    schedule_pass.focus("r1")
    schedule_pass.expect("refuse-running-chunk", 4)
    schedule_pass.expect("count-refusal", 4)
    schedule_pass.expect("count-refusal", 9)
    assert schedule_pass.take(4) == {"refuse-running-chunk", "count-refusal"}
    assert [e.num_blocks for e in schedule_pass.pending()] == [9]


def test_what_is_left_when_the_pass_closes_is_dropped_logged_and_counted(caplog):
    METRICS.reset()
    schedule_pass = SchedulePass(None)
    schedule_pass.focus("r7")
    schedule_pass.expect("refuse-running-chunk", 3)
    logger = logging.getLogger("fdsched-test")
    with caplog.at_level(logging.WARNING, logger="fdsched-test"):
        dropped = schedule_pass.close(logger)
    assert [e.request_id for e in dropped] == ["r7"]
    assert schedule_pass.pending() == ()
    assert METRICS.unconsumed_signals == {"refuse-running-chunk": 1}
    assert any("refuse-running-chunk" in r.getMessage() and "r7" in r.getMessage() for r in caplog.records)
    assert schedule_pass.close(logger) == []  # a clean pass reports nothing
    assert METRICS.unconsumed_signals == {"refuse-running-chunk": 1}


def test_a_cache_manager_no_scheduler_was_built_with_consults_nothing():
    assert NO_PASSES.consulted() is None and NO_PASSES.current() is None and NO_PASSES.pending() == ()


def test_a_pass_makes_its_budget_at_its_first_need_and_only_once():
    made = []
    schedule_pass = SchedulePass(lambda: made.append(object()) or made[-1])
    assert schedule_pass.made is None and made == []  # a pass that never asks makes none
    first = schedule_pass.budget
    assert schedule_pass.budget is first and schedule_pass.made is first and len(made) == 1
    assert SchedulePass(None).budget is None  # a question asked outside a pass has no budget


def test_the_desk_lists_a_thread_exactly_while_its_pass_or_question_expects_something():
    """The cache manager's check looks at ``desk.waiting`` first and asks the desk only when it is not empty: a thread
    is there from its first expectation until the last is taken, dropped or its pass is closed."""
    desk, me = PassDesk(), threading.get_ident()
    schedule_pass = SchedulePass(None)
    outer = desk.open(schedule_pass)
    assert desk.waiting == set()  # a pass that expects nothing
    schedule_pass.focus("r1")
    schedule_pass.expect("count-refusal", 3)
    schedule_pass.expect("refuse-running-chunk", 4)
    assert desk.waiting == {me}
    assert _on_another_thread(lambda: desk.take(3)) == frozenset()  # another thread's check: the pool answers
    assert desk.take(3) == {"count-refusal"} and desk.waiting == {me}  # one still expected
    assert desk.take(4) == {"refuse-running-chunk"} and desk.waiting == set()
    schedule_pass.expect("count-refusal", 5)
    desk.close(outer)  # closed with something still expected: no longer consulted, no longer waiting
    assert desk.waiting == set()
    question = SchedulePass(None)
    desk.ask_outside_a_pass(question)
    question.expect("count-refusal", 6)
    assert desk.waiting == {me}
    other = SchedulePass(None)

    def on_other():
        outer = desk.open(other)
        other.focus("r9")
        other.expect("count-refusal", 7)
        mine = desk.waiting == {me, threading.get_ident()}
        other.close(logging.getLogger("test"))
        desk.close(outer)
        return mine

    assert _on_another_thread(on_other) and desk.waiting == {me}  # the other thread came and went
    assert desk.take(6) == {"count-refusal"} and desk.waiting == set()

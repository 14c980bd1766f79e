"""The step plan the cache manager's block check consults where the plugin refuses a running chunk the host has no
seam to refuse: one question per check, answered by the plan open on the checking thread, consumed once, loud when
left over."""

from __future__ import annotations

import logging
import threading

from fdsched.core.metrics import METRICS
from fdsched.patches._scheduler import NO_PLANS, PlanSlot, StepPlan


def _on_another_thread(func):
    out = []
    thread = threading.Thread(target=lambda: out.append(func()))
    thread.start()
    thread.join()
    return out[0]


def test_an_expectation_is_consumed_only_by_a_check_of_its_block_count():
    plan = StepPlan(None)
    plan.focus("r1")
    plan.expect("refuse-running-chunk", 4)
    assert plan.take(5) == frozenset()  # another check in between takes nothing
    assert plan.take(4) == {"refuse-running-chunk"}
    assert plan.take(4) == frozenset()  # one shot


def test_a_check_for_another_request_does_not_take_it():
    plan = StepPlan(None)
    plan.focus("r1")
    plan.expect("refuse-running-chunk", 4)
    plan.focus("r2")  # the scheduler moved on to another request's checks
    assert plan.take(4) == frozenset()
    plan.focus("r1")
    assert plan.take(4) == {"refuse-running-chunk"}


def test_a_check_on_another_thread_finds_no_pass_of_its_own():
    slot = PlanSlot()
    plan = StepPlan(None)
    outer = slot.open(plan)
    plan.focus("r1")
    plan.expect("refuse-running-chunk", 4)
    assert _on_another_thread(slot.current) is None  # the pool's own answer there
    assert _on_another_thread(lambda: slot.take(4)) == frozenset()
    assert slot.current() is plan and slot.take(4) == {"refuse-running-chunk"}
    slot.close(outer)
    assert slot.current() is None


def test_a_second_threads_pass_neither_replaces_nor_sees_the_first():
    slot = PlanSlot()
    first = StepPlan(None)
    slot.open(first)
    second = StepPlan(None)

    def other():
        outer = slot.open(second)
        seen = slot.current()
        slot.close(outer)
        return seen

    assert _on_another_thread(other) is None  # it runs as outside a pass: its thresholds get budgets of their own
    assert slot.current() is first


def test_the_slot_tells_the_check_whether_anything_is_expected():
    slot = PlanSlot()
    plan = StepPlan(None)
    outer = slot.open(plan)
    assert slot.waiting is False
    plan.focus("r1")
    plan.expect("refuse-running-chunk", 3)
    assert slot.waiting is True
    assert slot.take(3) == {"refuse-running-chunk"}
    assert slot.waiting is False
    plan.expect("refuse-running-chunk", 5)
    slot.close(outer)
    assert slot.waiting is False and slot.pending() == ()


def test_a_nested_pass_gives_the_outer_one_back():
    slot = PlanSlot()
    outer_pass, inner_pass = StepPlan(None), StepPlan(None)
    assert slot.open(outer_pass) is None
    covered = slot.open(inner_pass)
    assert covered is outer_pass and slot.current() is inner_pass
    slot.close(covered)
    assert slot.current() is outer_pass


def test_expectations_for_the_same_check_are_taken_together():
    plan = StepPlan(None)
    plan.focus("r1")
    plan.expect("refuse-running-chunk", 4)
    plan.expect("a-second-kind", 4)
    plan.expect("a-second-kind", 9)
    assert plan.take(4) == {"refuse-running-chunk", "a-second-kind"}
    assert [e.num_blocks for e in plan.pending()] == [9]


def test_what_is_left_when_the_pass_closes_is_dropped_logged_and_counted(caplog):
    METRICS.reset()
    plan = StepPlan(None)
    plan.focus("r7")
    plan.expect("refuse-running-chunk", 3)
    logger = logging.getLogger("fdsched-test")
    with caplog.at_level(logging.WARNING, logger="fdsched-test"):
        dropped = plan.close(logger)
    assert [e.request_id for e in dropped] == ["r7"]
    assert plan.pending() == ()
    assert METRICS.unconsumed_signals == {"refuse-running-chunk": 1}
    assert any("refuse-running-chunk" in r.getMessage() and "r7" in r.getMessage() for r in caplog.records)
    assert plan.close(logger) == []  # a clean pass reports nothing
    assert METRICS.unconsumed_signals == {"refuse-running-chunk": 1}


def test_a_cache_manager_no_scheduler_was_built_with_consults_nothing():
    assert NO_PLANS.current() is None and NO_PLANS.take(3) == frozenset() and NO_PLANS.pending() == ()


def test_a_pass_makes_its_budget_at_its_first_need_and_only_once():
    made = []
    plan = StepPlan(lambda: made.append(object()) or made[-1])
    assert plan.made is None and made == []  # a pass that never asks makes none
    first = plan.budget
    assert plan.budget is first and plan.made is first and len(made) == 1
    assert StepPlan(None).budget is None  # a plan made without a budget maker has none


def test_the_slot_is_waiting_exactly_while_its_plan_expects_something():
    """The cache manager's check looks at ``slot.waiting`` first and asks the slot only when it is set: from the open
    plan's first expectation until the last is taken, dropped or its pass is closed."""
    slot = PlanSlot()
    plan = StepPlan(None)
    outer = slot.open(plan)
    assert slot.waiting is False  # a pass that expects nothing
    plan.focus("r1")
    plan.expect("refuse-running-chunk", 3)
    plan.expect("refuse-running-chunk", 4)
    assert slot.waiting is True
    assert _on_another_thread(lambda: slot.take(3)) == frozenset()  # another thread's check: the pool answers
    assert slot.take(3) == {"refuse-running-chunk"} and slot.waiting is True  # one still expected
    assert slot.take(4) == {"refuse-running-chunk"} and slot.waiting is False
    plan.expect("refuse-running-chunk", 5)
    slot.close(outer)  # closed with something still expected: no longer consulted, no longer waiting
    assert slot.waiting is False and slot.take(5) == frozenset()

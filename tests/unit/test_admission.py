"""Change 3's admission budget and the strategies behind it, in plain values (fdsched.core.admission)."""

from __future__ import annotations

import pytest

from fdsched.core.adaptive import AdaptiveReserve
from fdsched.core.admission import AdaptiveStrategy, AdmissionBudget, FixedBlockStrategy, RatioStrategy, RunningView
from fdsched.core.policies import FixedBlockReserve, NewTokenRatio, reserve_blocks_for_request


def _formula(request_id, budget, generated, ratio, clip, block_size):
    return reserve_blocks_for_request(budget, generated, ratio, clip, block_size)


def _view(rid, budget, generated, max_tokens=None, decoding=None):
    return RunningView(rid, budget, generated, max_tokens, decoding)


def _ratio(init=0.7, minimum=0.1, decay=0.1):
    return NewTokenRatio(init, minimum, decay)


def test_ratio_strategy_sums_upstreams_formula_per_running_request():
    strategy = RatioStrategy(_ratio(0.5), clip=40, block_size=4, extra_blocks_per_decode=0, estimate=_formula)
    running = [_view("a", 56, 0), _view("b", 10, 12), _view("c", 30, 4)]
    # min(56, 40) * 0.5 = 20 -> 5 blocks; over budget -> 0; 26 * 0.5 = 13 -> 4 blocks
    assert [strategy.request_blocks(v) for v in running] == [5, 0, 4]
    assert strategy.set_blocks(running) == 9


def test_a_prefill_node_reserves_nothing_but_its_ratio_still_moves():
    strategy = RatioStrategy(_ratio(0.7, decay=0.25), 4096, 4, 0, _formula, decodes=False)
    assert strategy.set_blocks([_view("a", 100, 0)]) == 0
    strategy.after_pass(scheduled_anything=True)
    assert strategy.ratio.value == pytest.approx(0.45)


def test_the_ratio_decays_only_after_a_pass_that_scheduled_something_and_is_reestimated_on_preemption():
    strategy = RatioStrategy(_ratio(0.7, decay=0.1), 4096, 4, extra_blocks_per_decode=1, estimate=_formula)
    strategy.after_pass(False)
    assert strategy.ratio.value == pytest.approx(0.7)
    strategy.after_pass(True)
    assert strategy.ratio.value == pytest.approx(0.6)
    # (10 + 20 generated + 1 extra block * 4 * 1 decoding) / (100 + 50 + 1), capped at init
    strategy.on_preemption([_view("a", 100, 10, decoding=True), _view("b", 50, 20, decoding=False)], 1)
    assert strategy.ratio.value == pytest.approx(34 / 151)
    strategy.on_preemption([], 1)
    assert strategy.ratio.value == pytest.approx(0.7)  # nothing runs: back to init


def test_fixed_block_strategy_is_relaxed_until_a_preemption_then_decays():
    strategy = FixedBlockStrategy(FixedBlockReserve(init=3, decay=1, minimum=0))
    running = [_view("a", 10, 0), _view("b", 10, 0)]
    assert strategy.relaxed and strategy.set_blocks(running) == 0
    strategy.on_preemption()
    assert not strategy.relaxed and strategy.set_blocks(running) == 6
    for expected in (4, 2, 0):
        strategy.after_pass(True)
        assert strategy.set_blocks(running) == expected
    assert strategy.relaxed


def test_the_budget_adds_the_running_sets_blocks_and_slack_unless_relaxed():
    slack = lambda blocks: blocks + 1  # noqa: E731 - a speculative-decoding engine's one extra block
    ratio = RatioStrategy(_ratio(0.5), 40, 4, 0, _formula)
    budget = AdmissionBudget(ratio, slack)
    assert budget.threshold(3, [_view("a", 56, 0)]) == 3 + 5 + 1 and budget.reserved == 5
    fixed = FixedBlockStrategy(FixedBlockReserve(3, 1, 0))
    relaxed = AdmissionBudget(fixed, slack)
    assert relaxed.threshold(3, [_view("a", 56, 0)]) == 3  # relaxed: the chunk itself, no slack
    fixed.on_preemption()
    assert AdmissionBudget(fixed, slack).threshold(3, [_view("a", 56, 0)]) == 3 + 3 + 1


def test_the_budget_sees_the_running_set_of_each_ask_and_refuses_asks_after_it_closed():
    budget = AdmissionBudget(RatioStrategy(_ratio(0.5), 40, 4, 0, _formula))
    running = [_view("a", 56, 0)]
    assert budget.threshold(1, running) == 6
    running.append(_view("b", 30, 4))  # a request admitted earlier in the pass now runs
    assert budget.threshold(1, running) == 10
    assert budget.asks == 2
    budget.declined.add("chunk")
    assert budget.close() == {"chunk"} and budget.declined == set()
    with pytest.raises(RuntimeError, match="closed"):
        budget.threshold(1, running)


def test_a_pass_estimates_each_request_once_while_it_and_the_ratio_stay_as_they_were():
    calls = []

    def counted(request_id, *rest):
        calls.append(request_id)
        return _formula(request_id, *rest)

    strategy = RatioStrategy(_ratio(0.5), 40, 4, 0, counted, pure=lambda: True)
    budget = AdmissionBudget(strategy)
    a, b = _view("a", 56, 0), _view("b", 30, 4)
    assert budget.threshold(1, [a]) == 1 + 5
    assert budget.threshold(1, [a, b]) == 1 + 5 + 4  # the admission before made b run: only b is new
    assert calls == ["a", "b"]
    grown = _view("a", 56, 30)  # the scheduler hands a new view when a request's output grew
    assert budget.threshold(1, [grown, b]) == 1 + 4 + 4 and calls == ["a", "b", "a"]
    assert budget.threshold(1, [b]) == 1 + 4 and calls == ["a", "b", "a"]  # a left the running set
    strategy.on_preemption([_view("b", 30, 4, decoding=True)], 1)  # the ratio moved: every answer is stale
    moved = strategy.ratio.value
    assert moved != 0.5
    assert budget.threshold(1, [b]) == 1 + _formula("b", 30, 4, moved, 40, 4) and calls[-1] == "b"
    # the same answers as asking afresh each time
    fresh = RatioStrategy(_ratio(0.5), 40, 4, 0, _formula)
    fresh.ratio.value = moved
    assert fresh.set_blocks([b]) == budget.reserved


def test_a_hook_that_is_not_the_plugins_formula_is_asked_at_every_ask():
    calls = []
    strategy = RatioStrategy(_ratio(0.5), 40, 4, 0, lambda rid, *rest: calls.append(rid) or 1)  # pure: False
    budget = AdmissionBudget(strategy)
    a = _view("a", 56, 0)
    assert budget.threshold(1, [a]) == 2 and budget.threshold(1, [a]) == 2
    assert calls == ["a", "a"]


def test_adaptive_strategy_lets_a_third_party_answer_outside_the_sets_margin():
    adaptive = AdaptiveReserve(min_samples=1, k=0.0)
    for length in (20, 40, 60, 80):
        adaptive.observe_finished(None, length)
    answers = {"hooked": 7}
    strategy = AdaptiveStrategy(
        _ratio(0.7), 4096, 4, 0, lambda rid, *rest: answers.get(rid), adaptive, FixedBlockReserve(16, 1, 0),
    )
    alone = strategy.set_blocks([_view("plain", 1000, 0)])
    assert alone > 0
    assert strategy.set_blocks([_view("plain", 1000, 0), _view("hooked", 1000, 0)]) == alone + 7


def test_adaptive_strategy_on_preemption_widens_k_resets_the_fallback_and_reestimates_the_ratio():
    adaptive = AdaptiveReserve(k=-2.0, k_step=0.5)
    fixed = FixedBlockReserve(16, 1, 0)
    strategy = AdaptiveStrategy(_ratio(0.7, decay=0.1), 4096, 4, 0, lambda *a: None, adaptive, fixed)
    strategy.after_pass(True)
    assert strategy.ratio.value == pytest.approx(0.6)
    strategy.on_preemption([_view("a", 100, 50, decoding=True)], count=2)
    assert adaptive.k == pytest.approx(-1.0)
    assert not fixed.relaxed and fixed.current == 16
    assert strategy.ratio.value == pytest.approx(50 / 101)

"""Change 3's admission budget and the strategies behind it, in plain values (fdsched.core.admission)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fdsched.core.adaptive import AdaptiveReserve
from fdsched.core.admission import (
    GAUGE_STEP, AdmissionBudget, NewTokenRatio, RatioStrategy, Verdict, reserve_blocks_for_request,
)
from fdsched.core.strategies import AdaptiveStrategy, FixedBlockReserve, FixedBlockStrategy
from fdsched.core.views import RunningView


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


class _Reader:
    """A reader whose requests are views already (fdsched.core.views.RunningReader); counts its reads."""

    def __init__(self):
        self.read = []  # request ids, in the order read

    def views(self, requests, kept=None):
        self.read.extend(v.request_id for v in requests)
        return list(requests)

    def lefts(self, requests):
        self.read.extend(v.request_id for v in requests)
        return [v.budget - v.generated for v in requests]


class _Pool:
    """The cache manager's block check as plain values: ``free`` blocks can be had (evicting where needed); each
    count it is asked is recorded."""

    def __init__(self, free: int = 0):
        self.free, self.asked = free, []

    def __call__(self, blocks: int) -> bool:
        self.asked.append(blocks)
        return blocks <= self.free


def _budget(strategy, slack=None, pool=None):
    return AdmissionBudget(strategy, strategy.tally(_Reader()), pool or _Pool(),
                           *(() if slack is None else (slack,)))


def test_the_budget_adds_the_running_sets_blocks_and_slack_unless_relaxed():
    slack = lambda blocks: blocks + 1  # noqa: E731 - a speculative-decoding engine's one extra block
    ratio = RatioStrategy(_ratio(0.5), 40, 4, 0, _formula)
    pool = _Pool(free=8)
    budget = _budget(ratio, slack, pool)
    # 3 + 5 + 1 blocks, which this pool cannot find: refused, after asking it for exactly those
    assert budget.admit(3, [_view("a", 56, 0)]) == Verdict(3 + 5 + 1, False, False) and budget.reserved == 5
    assert pool.asked == [9]
    pool.free = 9  # the pool finds them (evicting cached blocks, say): admitted, by the pool
    assert budget.admit(3, [_view("a", 56, 0)]) == Verdict(9, True, False) and pool.asked == [9, 9]
    fixed = FixedBlockStrategy(FixedBlockReserve(3, 1, 0))
    relaxed = _budget(fixed, slack)
    assert relaxed.admit(3, [_view("a", 56, 0)]).blocks == 3  # relaxed: the chunk itself, no slack
    fixed.on_preemption()
    assert _budget(fixed, slack).admit(3, [_view("a", 56, 0)]).blocks == 3 + 3 + 1


@pytest.mark.parametrize("pure", [True, False], ids=["plugin-formula", "third-party-hook"])
def test_the_budget_sees_the_running_set_of_each_ask_and_refuses_asks_after_it_closed(pure):
    budget = _budget(RatioStrategy(_ratio(0.5), 40, 4, 0, _formula, pure=lambda: pure))
    running = [_view("a", 56, 0)]
    assert budget.admit(1, running).blocks == 6
    running.append(_view("b", 30, 4))  # a request admitted earlier in the pass now runs
    assert budget.admit(1, running).blocks == 10
    assert budget.asks == 2
    budget.declined.add("chunk")
    assert budget.close() == {"chunk"} and budget.declined == set()
    with pytest.raises(RuntimeError, match="closed"):
        budget.admit(1, running)


@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.31, 0.5, 0.7, 1.0])
@pytest.mark.parametrize("clip", [0, 1, 7, 40, 4096])
def test_lefts_blocks_is_the_plugins_formula_summed(ratio, clip):
    strategy = RatioStrategy(_ratio(ratio, minimum=0.0), clip, 4, 0, _formula)
    views = [_view(f"r{i}", budget, generated) for i, (budget, generated) in enumerate(
        [(56, 0), (10, 12), (30, 4), (0, 0), (5000, 3), (41, 1), (40, 0), (39, 0), (1, 0), (7, 0), (8, 1)]
    )]
    for size in range(len(views) + 1):
        part = views[:size]
        assert strategy.lefts_blocks([v.budget - v.generated for v in part]) == strategy.set_blocks(part), size


def test_a_pass_counts_the_running_set_once_then_only_the_requests_admitted_since():
    reader = _Reader()
    strategy = RatioStrategy(_ratio(0.5), 40, 4, 0, _formula, pure=lambda: True)
    budget = AdmissionBudget(strategy, strategy.tally(reader), _Pool())
    a, b, c = _view("a", 56, 0), _view("b", 30, 4), _view("c", 20, 0)
    running = [a]
    assert budget.admit(1, running).blocks == 1 + 5
    running.append(b)  # admitted earlier in the pass
    assert budget.admit(1, running).blocks == 1 + 5 + 4
    assert reader.read == ["a", "b"]  # b alone was read at the second ask
    assert budget.admit(1, running).blocks == 1 + 9 and reader.read == ["a", "b"]  # nothing new: nothing read


def _fresh(strategy, running):
    return RatioStrategy(strategy.ratio, strategy.clip, strategy.block_size, 0, _formula).set_blocks(running)


@pytest.mark.parametrize("change", ["remove-first", "remove-last", "pop-and-append", "new-list", "shorter"])
def test_the_pass_counts_afresh_when_the_running_list_changed_other_than_by_appending(change):
    reader = _Reader()
    strategy = RatioStrategy(_ratio(0.5), 40, 4, 0, _formula, pure=lambda: True)
    budget = AdmissionBudget(strategy, strategy.tally(reader), _Pool())
    a, b, c, d = _view("a", 56, 0), _view("b", 30, 4), _view("c", 20, 0), _view("d", 100, 10)
    running = [a, b, c]
    budget.admit(1, running)
    if change == "remove-first":
        running.remove(a)
        running.append(d)
    elif change == "remove-last":
        running.remove(c)
    elif change == "pop-and-append":
        running.pop()
        running.append(d)
    elif change == "new-list":
        running = [a, b, d]
    elif change == "shorter":
        del running[1:]
    assert budget.reserved is not None
    assert budget.admit(0, running).blocks == _fresh(strategy, running)


def test_a_preemption_makes_the_next_ask_count_the_whole_set_with_the_moved_ratio():
    reader = _Reader()
    strategy = RatioStrategy(_ratio(0.5), 40, 4, 0, _formula, pure=lambda: True)
    budget = AdmissionBudget(strategy, strategy.tally(reader), _Pool())
    running = [_view("a", 56, 0), _view("b", 30, 4)]
    budget.admit(1, running)
    strategy.on_preemption([_view("b", 30, 4, decoding=True)], 1)  # the ratio moved, the list did not
    assert strategy.ratio.value != 0.5
    budget.running_changed()  # the scheduler's preemption seam says so
    assert budget.admit(0, running).blocks == _fresh(strategy, running)
    assert reader.read == ["a", "b", "a", "b"]


def test_the_offset_matches_a_full_count_through_random_appends_removals_and_preemptions():
    import random

    rng = random.Random(7)
    strategy = RatioStrategy(_ratio(0.6, minimum=0.05, decay=0.01), 64, 4, 1, _formula, pure=lambda: True)
    for trial in range(200):
        budget = AdmissionBudget(strategy, strategy.tally(_Reader()), _Pool())
        running = [_view(f"t{trial}-{i}", rng.randint(0, 200), rng.randint(0, 200)) for i in range(rng.randint(0, 12))]
        for step in range(rng.randint(1, 12)):
            for move in range(rng.randint(1, 3)):  # between two asks, one to three changes
                draw = rng.random()
                if draw < 0.5:
                    running.append(_view(f"t{trial}-n{step}.{move}", rng.randint(0, 200), 0))
                elif draw < 0.7 and running:
                    running.pop(rng.randrange(len(running)))
                elif draw < 0.8 and running:
                    strategy.on_preemption([v._replace(decoding=v.generated > 0) for v in running], 1)
                    budget.running_changed()
            assert budget.admit(0, running).blocks == _fresh(strategy, running), (trial, step)
        strategy.after_pass(True)


def test_a_hook_that_is_not_the_plugins_formula_is_asked_at_every_ask():
    calls = []
    strategy = RatioStrategy(_ratio(0.5), 40, 4, 0, lambda rid, *rest: calls.append(rid) or 1)  # pure: False
    budget = _budget(strategy)
    a = _view("a", 56, 0)
    assert budget.admit(1, [a]).blocks == 2 and budget.admit(1, [a]).blocks == 2
    assert calls == ["a", "a"]


def test_a_prefill_nodes_pass_reads_nothing():
    reader = _Reader()
    strategy = RatioStrategy(_ratio(0.7), 4096, 4, 0, _formula, decodes=False, pure=lambda: True)
    budget = AdmissionBudget(strategy, strategy.tally(reader), _Pool())
    assert budget.admit(2, [_view("a", 100, 0)]).blocks == 2 and reader.read == []


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


class _KeyReader(_Reader):
    def keys(self, requests):
        self.read.extend(v.request_id for v in requests)
        return [(v.max_tokens, v.budget, v.generated) for v in requests]


def test_the_adaptive_offset_matches_the_whole_sets_reservation_through_random_changes():
    import random

    rng = random.Random(11)
    adaptive = AdaptiveReserve(min_samples=4, k=-1.0)
    for length in (20, 40, 60, 80, 100, 300):
        adaptive.observe_finished(None, length)
        adaptive.observe_finished(200, length // 2)
    fixed = FixedBlockReserve(16, 1, 0)
    strategy = AdaptiveStrategy(_ratio(0.6, minimum=0.05, decay=0.01), 256, 4, 1, lambda *a: None, adaptive, fixed,
                                pure=lambda: True)
    whole = AdaptiveStrategy(strategy.ratio, 256, 4, 1, lambda *a: None, adaptive, fixed)  # asked afresh each time

    def view(name):
        bound = rng.choice([None, 200, 50])
        budget = bound if bound is not None else 1000
        return _view(name, budget, rng.randint(0, budget + 5), bound)

    for trial in range(150):
        reader = _KeyReader()
        budget = AdmissionBudget(strategy, strategy.tally(reader), _Pool())
        running = [view(f"t{trial}-{i}") for i in range(rng.randint(0, 10))]
        for step in range(rng.randint(1, 10)):
            for move in range(rng.randint(1, 3)):
                draw = rng.random()
                if draw < 0.5:
                    running.append(view(f"t{trial}-n{step}.{move}"))
                elif draw < 0.7 and running:
                    running.pop(rng.randrange(len(running)))
                elif draw < 0.8 and running:
                    strategy.on_preemption([v._replace(decoding=v.generated > 0) for v in running], 1)
                    budget.running_changed()
            got = budget.admit(0, running).blocks
            decided = strategy.last
            assert got == whole.set_blocks(running), (trial, step)
            assert decided == whole.last, (trial, step)
        strategy.after_pass(True)
    assert adaptive.k != -1.0  # preemptions moved the margin along the way


def test_the_adaptive_offset_reads_only_the_requests_admitted_since_the_last_ask():
    adaptive = AdaptiveReserve(min_samples=1, k=0.0)
    for length in (20, 40, 60, 80):
        adaptive.observe_finished(None, length)
    strategy = AdaptiveStrategy(_ratio(0.7), 4096, 4, 0, lambda *a: None, adaptive, FixedBlockReserve(16, 1, 0),
                                pure=lambda: True)
    reader = _KeyReader()
    budget = AdmissionBudget(strategy, strategy.tally(reader), _Pool())
    running = [_view("a", 1000, 0), _view("b", 1000, 10)]
    first = budget.admit(0, running).blocks
    running.append(_view("c", 1000, 0))
    second = budget.admit(0, running).blocks
    assert reader.read == ["a", "b", "c"] and second > first


def test_the_ratio_gauge_is_set_only_when_the_ratio_moved(monkeypatch):
    shown = []

    class Shown:
        ratio = staticmethod(shown.append)

    gauges = Shown()
    strategy = RatioStrategy(_ratio(0.5, minimum=0.3, decay=0.1), 40, 4, 0, _formula)
    strategy.report()  # no gauges: nothing reported, and nothing counted as shown
    strategy.report(gauges)
    strategy.report(gauges)  # nothing moved
    strategy.after_pass(True)
    strategy.report(gauges)
    strategy.after_pass(True)
    strategy.after_pass(True)  # at the floor
    strategy.report(gauges)
    strategy.report(gauges)
    strategy.on_preemption([_view("a", 100, 90, decoding=True)], 1)
    strategy.report(gauges)
    assert shown == pytest.approx([0.5, 0.4, 0.3, strategy.ratio.value]) and strategy.ratio.value != 0.3


def test_a_slow_decay_sets_the_gauge_in_steps_and_a_reestimate_at_once():
    shown = []

    class Shown:
        ratio = staticmethod(shown.append)

    strategy = RatioStrategy(_ratio(0.7, minimum=0.6915, decay=0.001), 40, 4, 0, _formula)
    strategy.report(Shown())  # the first report sets the gauge
    for _ in range(12):  # 0.699, 0.698, ... down to the floor 0.6915 after nine passes
        strategy.after_pass(True)
        strategy.report(Shown())
    # set again once the ratio moved GAUGE_STEP (0.005) or more, and at its floor; no update between
    assert shown == pytest.approx([0.7, 0.695, 0.6915])
    assert all(abs(a - b) <= GAUGE_STEP + 1e-12 for a, b in zip(shown, shown[1:]))
    strategy.ratio.value = 0.6925  # a rise, however small: shown at once
    strategy.report(Shown())
    assert shown[-1] == 0.6925 and len(shown) == 4
    strategy.ratio.value = 0.692  # a re-estimate below it by less than a step: held, unless reported as exact
    strategy.report(Shown())
    assert len(shown) == 4
    strategy.report(Shown(), exact=True)
    assert shown[-1] == 0.692 and len(shown) == 5


@pytest.mark.parametrize("kind", ["fixed", "ratio", "adaptive"])
def test_a_passes_one_end_call_does_what_its_three_did(kind):
    """pass_ended(scheduled, counted) == idle_pass (when nothing was counted), after_pass and report (unless the
    host's pass raised: scheduled None), on two strategies built alike, pass after pass."""
    shown = {"one": [], "three": []}

    class Shown:
        def __init__(self, name):
            self.ratio = shown[name].append

        def adaptive_decision(self, *figures):
            pass

    def make():
        adaptive = AdaptiveReserve(min_samples=1, k=0.0)
        ratio = _ratio(0.5, minimum=0.2, decay=0.1)
        if kind == "fixed":
            return FixedBlockStrategy(FixedBlockReserve(3, 1, 1))
        if kind == "ratio":
            return RatioStrategy(ratio, 40, 4, 0, _formula, pure=lambda: True)
        return AdaptiveStrategy(ratio, 40, 4, 0, lambda *a: None, adaptive, FixedBlockReserve(3, 1, 1),
                                pure=lambda: True)

    one, three = make(), make()
    reader = _MostReader(getattr(one, "most_blocks"))
    passes = [(True, True), (False, False), (None, True), (True, False), (True, True), (None, False), (False, True)]
    for scheduled, counted in passes:
        for strategy, name in ((one, "one"), (three, "three")):
            gauges = Shown(name)
            kept = strategy.most_tally(reader)
            if kept is not None:
                kept.blocks([_view("a", 56, 0)])
            if strategy is one:
                strategy.pass_ended(scheduled, counted, gauges)
            else:
                if not counted:
                    strategy.idle_pass()
                if scheduled is not None:
                    strategy.after_pass(scheduled)
                    strategy.report(gauges)
            held = None if kept is None else kept.counted
            state = (getattr(strategy, "ratio", None) and strategy.ratio.value, getattr(strategy, "fixed", None)
                     and (strategy.fixed.current, strategy.fixed.relaxed), held)
            if strategy is one:
                first = state
            else:
                assert state == first, (scheduled, counted)
    assert shown["one"] == shown["three"]


@pytest.mark.parametrize("ratio", [0.05, 0.1337, 0.31, 0.698, 1.0, 1.7])
@pytest.mark.parametrize("clip", [1, 64, 1000, 4096, 10**9])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_lefts_blocks_counts_by_thresholds_or_by_requests_as_the_formula(ratio, clip, block_size):
    import random

    strategy = RatioStrategy(_ratio(ratio, minimum=0.0), clip, block_size, 0, _formula)
    rng = random.Random(f"{ratio}-{clip}-{block_size}")
    for size, spread in [(1, 50), (40, 3000), (448, 600), (448, 5000), (448, 40)]:
        # budgets left as a running set has them: spread out, repeated, none or negative (past its budget)
        views = [_view(f"r{i}", rng.randint(0, spread), rng.randint(0, spread // 4)) for i in range(size)]
        lefts = [v.budget - v.generated for v in views]
        assert strategy.lefts_blocks(lefts) == strategy.set_blocks(views), (size, spread)


def test_the_least_budget_left_for_a_block_is_the_formulas_own():
    from fdsched.core.admission import _least_left

    for ratio in (0.05, 0.1, 0.3, 0.7, 0.698, 1.0, 2.5):
        for tokens in range(1, 400):
            least = _least_left(tokens, ratio)
            assert int(least * ratio) >= tokens and (least == 1 or int((least - 1) * ratio) < tokens), (ratio, tokens)


# ---- the bound ahead of the count ---------------------------------------------------------------------------
class _MostReader(_KeyReader):
    """A reader that also gives each request's most (``most_of``: the strategy's formula) and counts those reads."""

    def __init__(self, most_of):
        super().__init__()
        self.most_of, self.mosts_read = most_of, []

    def mosts(self, requests):
        self.mosts_read.extend(v.request_id for v in requests)
        return sum(self.most_of(v.budget) for v in requests)


def _bounded_budget(strategy, reader, free, slack=None):
    most = strategy.most_tally(reader)
    extra = {} if slack is None else {"slack": slack}
    return AdmissionBudget(strategy, strategy.tally(reader), _Pool(free), most=most,
                           free=(lambda: free) if most is not None else None, **extra)


@pytest.mark.parametrize("kind", ["ratio", "adaptive"])
def test_an_ask_the_free_blocks_cover_at_the_bound_is_answered_without_a_count(kind):
    adaptive = AdaptiveReserve(min_samples=1, k=0.0)
    for length in (20, 40, 60, 80):
        adaptive.observe_finished(None, length)
    ratio = _ratio(0.5, minimum=0.1, decay=0.1)
    strategy = (RatioStrategy(ratio, 40, 4, 0, _formula, pure=lambda: True) if kind == "ratio" else
                AdaptiveStrategy(ratio, 40, 4, 0, lambda *a: None, adaptive, FixedBlockReserve(16, 1, 0),
                                 pure=lambda: True))
    running = [_view("a", 56, 3), _view("b", 30, 4)]
    most = strategy.most_blocks(56) + strategy.most_blocks(30)
    assert most == 5 + 4  # ceil(int(min(budget, 40) x 0.5) / 4) at the ratio's top, whatever each generated
    slack = lambda blocks: blocks + 1  # noqa: E731
    reader = _MostReader(strategy.most_blocks)
    roomy = _bounded_budget(strategy, reader, free=2 + most + 1 + strategy.most_blocks(20), slack=slack)
    # covered: admitted without reading any request's terms (its caller need not expect a refusal of the check)
    assert roomy.admit(2, running) == Verdict(2 + most + 1, True, True)
    assert reader.read == [] and roomy.reserved is None and roomy.asks == 1 and roomy.pool.asked == []
    running.append(_view("c", 20, 0))  # admitted: the bound adds c's most alone
    assert roomy.admit(0, running).blocks == 0 + most + strategy.most_blocks(20) + 1
    assert reader.mosts_read == ["a", "b", "c"] and reader.read == []
    # one block short of the bound: the ask counts, and answers what the count gives
    tight_reader = _MostReader(strategy.most_blocks)
    tight = _bounded_budget(strategy, tight_reader, free=2 + most + strategy.most_blocks(20) - 1)
    exact = AdmissionBudget(strategy, strategy.tally(_KeyReader()), _Pool()).admit(2, running).blocks
    # the pool has exactly the free blocks (nothing cached to evict): the count's verdict is the pool's answer
    assert tight.admit(2, running) == Verdict(exact, exact <= tight.pool.free, False) and tight.reserved == exact - 2
    assert tight.pool.asked == [exact]
    assert tight_reader.read == ["a", "b", "c"]
    # a pool the bound does not fit after one that it did: each ask's verdict is its own
    shrinking = iter([10_000, 0])
    moving = AdmissionBudget(strategy, strategy.tally(_KeyReader()), _Pool(), most=strategy.most_tally(_MostReader(
        strategy.most_blocks)), free=lambda: next(shrinking))
    assert moving.admit(2, running).settled and moving.reserved is None
    assert not moving.admit(2, running).settled and moving.reserved is not None


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(-64, 4096), clip=st.integers(0, 2048), block_size=st.integers(1, 128),
       init=st.floats(0.0, 1.0), cap=st.floats(0.0, 1.0))
def test_a_requests_most_is_the_formula_over_its_whole_budget_at_the_ratios_top(budget, clip, block_size, init, cap):
    ratio = NewTokenRatio(init, 0.0, 0.01, cap)
    strategy = RatioStrategy(ratio, clip, block_size, 0, _formula, pure=lambda: True)
    assert strategy.most_blocks(budget) == reserve_blocks_for_request(budget, 0, ratio.top, clip, block_size)


def test_a_strategy_without_a_known_bound_counts_every_ask():
    hooked = RatioStrategy(_ratio(0.5), 40, 4, 0, _formula, pure=lambda: False)  # a third party answers
    assert hooked.most_tally(_MostReader(hooked.most_blocks)) is None
    prefill_node = RatioStrategy(_ratio(0.5), 40, 4, 0, _formula, decodes=False, pure=lambda: True)
    assert prefill_node.most_tally(_MostReader(prefill_node.most_blocks)) is None
    fixed = FixedBlockStrategy(FixedBlockReserve(3, 1, 0))
    assert fixed.most_tally(_MostReader(fixed.most_blocks)) is None


def test_the_ratios_top_is_never_exceeded_by_decay_or_a_reestimate():
    ratio = NewTokenRatio(0.7, 0.1, 0.05, cap=0.9)
    assert ratio.top == 0.9
    seen = [ratio.value]
    for generated in ([], [1, 2], [500, 500], [0, 0]):
        ratio.after_schedule(True)
        seen.append(ratio.value)
        ratio.on_preemption(generated, [10] * len(generated), len(generated), 64, 16)
        seen.append(ratio.value)
    assert max(seen) <= ratio.top and 0.9 in seen  # a re-estimate reached the cap


@settings(max_examples=300, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 6000), st.sampled_from([None, 64, 512])),
                      max_size=40),
    samples=st.lists(st.tuples(st.sampled_from([None, 64, 512]), st.integers(1, 3000)), max_size=60),
    decays=st.integers(0, 30),
    k=st.floats(-6.0, 6.0),
    clip=st.sampled_from([1, 40, 512, 4096]),
    block_size=st.sampled_from([1, 4, 64]),
)
def test_no_reservation_exceeds_the_sum_of_the_requests_mosts(requests, samples, decays, k, clip, block_size):
    """The bound the budget settles asks by: whatever each request generated, the ratio's decay, the samples and the
    margin, neither strategy keeps more than the requests' mosts together."""
    adaptive = AdaptiveReserve(min_samples=4, k=k)
    for bound, length in samples:
        adaptive.observe_finished(bound, length)
    ratio = NewTokenRatio(0.7, 0.05, 0.03)
    for _ in range(decays):
        ratio.after_schedule(True)
    fixed = FixedBlockReserve(16, 1, 0)
    fixed.on_preemption()
    views = [_view(f"r{i}", budget, generated, bound if bound is not None and bound < budget else None)
             for i, (budget, generated, bound) in enumerate(requests)]
    for strategy in (RatioStrategy(ratio, clip, block_size, 0, _formula, pure=lambda: True),
                     AdaptiveStrategy(ratio, clip, block_size, 0, lambda *a: None, adaptive, fixed,
                                      pure=lambda: True)):
        most = sum(strategy.most_blocks(v.budget) for v in views)
        assert strategy.set_blocks(views) <= most
        assert AdmissionBudget(strategy, strategy.tally(_KeyReader()), _Pool()).admit(0, views).blocks <= most


def test_the_kept_bound_adds_only_what_was_appended_since_and_sums_afresh_after_any_other_change():
    from fdsched.core.admission import KeptSum

    read = []

    def count(requests):
        read.append([r.request_id for r in requests])
        return sum(r.budget for r in requests)

    kept = KeptSum(count)
    a, b, c, d, e = (_view(name, budget, 0) for name, budget in zip("abcde", (1, 2, 4, 8, 16)))
    running = [a, b, c]
    assert kept.open_pass().blocks(running) == 7 and read == [["a", "b", "c"]]
    held = kept.counted
    running.append(d)  # admitted in the pass
    assert kept.blocks(running) == 15 and read[-1] == ["d"]
    # the list as counted grows by what the ask added: its own copy, not a new copy of the whole list
    assert kept.counted is held and kept.counted == running and kept.counted is not running
    # the next pass: the same requests, another list object: nothing is read
    running = [a, b, c, d]
    assert kept.open_pass().blocks(running) == 15 and len(read) == 2
    running.append(e)  # appended between the passes
    assert kept.open_pass().blocks(running) == 31 and read[-1] == ["e"]
    changes = {
        "a request gone": lambda rs: rs.remove(b),
        "another in its place": lambda rs: rs.__setitem__(1, _view("b2", 2, 0)),
        "inserted first, one gone": lambda rs: (rs.insert(0, _view("z", 32, 0)), rs.remove(c)),
        "reordered": lambda rs: rs.reverse(),
    }
    for name, change in changes.items():
        running = [a, b, c, d, e]
        kept.forget()
        kept.open_pass().blocks(running)
        change(running)
        before = len(read)
        assert kept.open_pass().blocks(running) == sum(r.budget for r in running), name
        assert read[before:] == [[r.request_id for r in running]], name  # summed afresh
    kept.forget()
    assert kept.counted is None and kept.members is None  # holds no request


def test_a_pass_that_asks_nothing_lets_the_kept_bound_go():
    strategy = RatioStrategy(_ratio(0.5), 40, 4, 0, _formula, pure=lambda: True)
    reader = _MostReader(strategy.most_blocks)
    running = [_view("a", 56, 0)]
    strategy.most_tally(reader).blocks(running)
    assert strategy.most_tally(reader).counted == running  # the same object is kept from pass to pass
    strategy.idle_pass()
    assert strategy.most_tally(reader).counted is None


def test_a_pool_short_of_the_last_count_is_counted_without_reading_the_bound():
    strategy = RatioStrategy(_ratio(0.5), 40, 4, 0, _formula, pure=lambda: True)
    reader = _MostReader(strategy.most_blocks)
    running = [_view("a", 56, 3), _view("b", 30, 4)]
    counted = _budget(strategy).admit(0, running).blocks  # 5 + 4 blocks, below the mosts' 5 + 4 (same here)
    short = _bounded_budget(strategy, reader, free=counted - 1)
    assert short.admit(0, running).blocks == counted and reader.mosts_read == ["a", "b"]  # no count yet: the bound read
    again = _bounded_budget(strategy, reader, free=counted - 1)
    assert again.admit(0, running).blocks == counted and reader.mosts_read == ["a", "b"]  # short of the last count
    roomy = _bounded_budget(strategy, reader, free=100)
    assert roomy.admit(0, running).blocks == strategy.most_blocks(56) + strategy.most_blocks(30)  # room: the bound

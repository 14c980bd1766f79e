"""The adaptive reservation estimator (fdsched.core.adaptive): plain values, no host."""

from __future__ import annotations

import math
import random

import pytest

from fdsched.core.adaptive import AdaptiveReserve, RunningRequest, margin_blocks
from fdsched.core.lengths import LengthHistogram
from fdsched.core.admission import reserve_blocks_for_request


def test_histogram_tail_matches_exact_statistics_on_integer_lengths():
    rnd = random.Random(0)
    values = [rnd.randint(1, 2000) for _ in range(5000)]
    hist = LengthHistogram(buckets_per_octave=8)
    for v in values:
        hist.add(v)
    for g in (0, 10, 100, 700, 1500):
        above = [v for v in values if v > g]
        count, total, _ = hist.tail(g + 0.5)
        assert count == pytest.approx(len(above), rel=0.03, abs=5)
        assert total / count == pytest.approx(sum(above) / len(above), rel=0.03)


def test_removing_a_sample_restores_the_histogram():
    hist = LengthHistogram()
    hist.add(10)
    before = hist.tail(0.0)
    hist.add(500)
    hist.add(500, -1.0)
    assert hist.tail(0.0) == pytest.approx(before)


def _learned(lengths, max_tokens=None, **kw):
    est = AdaptiveReserve(min_samples=10, **kw)
    for length in lengths:
        est.observe_finished(max_tokens, length)
    return est


def test_expected_remainder_given_what_was_generated():
    est = _learned([100] * 50 + [1000] * 50)
    young = est.remainder(None, 4000, 0)
    assert young.mean == pytest.approx(550, rel=0.05)  # half short, half long
    old = est.remainder(None, 4000, 200)  # it outlived every short one: it is a long one
    assert old.mean == pytest.approx(800, rel=0.05) and old.variance < young.variance


def test_relative_samples_scale_with_the_clients_max_tokens():
    est = _learned([50] * 40, max_tokens=100)  # clients that set max_tokens use half of it
    assert est.remainder(400, 400, 0).mean == pytest.approx(200, rel=0.06)
    assert est.remainder(None, 4000, 0) is None  # the absolute distribution has no samples yet


def test_remainder_never_exceeds_the_budget_and_is_at_least_one_token():
    est = _learned([3000] * 20)
    assert est.remainder(None, 500, 10).mean == 490
    est = _learned([10] * 20 + [11] * 20)
    assert est.remainder(None, 4000, 10).mean >= 1


def test_warm_up_and_beyond_the_tail_fall_back_to_the_warmup_reservation():
    est = AdaptiveReserve(min_samples=10)
    # Nothing learned: a bounded request reserves upstream's ratio over its bound, an unbounded one the legacy
    # fixed amount (7 blocks here), never more than the ratio formula.
    running = [RunningRequest(512, 512, 5), RunningRequest(None, 3000, 50)]
    assert est.reserve_blocks(running, 16, 0.7, 4096, fixed_blocks=7) == reserve_blocks_for_request(512, 5, 0.7, 4096, 16) + 7
    for _ in range(10):
        est.observe_finished(None, 20)
    beyond = [RunningRequest(None, 3000, 500)]  # longer than every sample: the fallback again
    assert est.reserve_blocks(beyond, 16, 0.7, 4096, fixed_blocks=7) == 7
    assert est.fallbacks == 3
    learned = [RunningRequest(None, 3000, 0)]  # every sample 20 tokens: 20 + k x 0 tokens = 2 blocks
    assert est.reserve_blocks(learned, 16, 0.7, 4096, fixed_blocks=7) == 2 and est.fallbacks == 3


def test_one_margin_for_the_set_is_tighter_than_a_margin_per_request():
    rnd = random.Random(1)
    est = _learned([rnd.randint(1, 400) for _ in range(400)], k=2.0)
    running = [RunningRequest(None, 4000, 0)] * 64
    estimates = [est.remainder(r.max_tokens, r.budget, r.generated) for r in running]
    mean_total = sum(e.mean for e in estimates)
    per_request = sum(e.mean + 2.0 * math.sqrt(e.variance) for e in estimates)
    blocks = est.reserve_blocks(running, 16, 0.7, 4096, fixed_blocks=0)
    assert math.ceil(mean_total / 16) < blocks < per_request / 16
    assert blocks == math.ceil((mean_total + 2.0 * math.sqrt(sum(e.variance for e in estimates))) / 16)


def test_sliding_window_forgets_old_samples():
    est = AdaptiveReserve(window=100, min_samples=10)
    for _ in range(100):
        est.observe_finished(None, 1000)
    for _ in range(100):
        est.observe_finished(None, 10)  # the workload changed
    assert est.remainder(None, 4000, 0).mean == pytest.approx(10, rel=0.1)
    assert est.state()["absolute_tokens"]["samples"] == 100


def test_preemptions_raise_the_margin_and_finished_samples_let_it_decay():
    est = _learned([100] * 20, k=2.0, k_step=0.5, k_max=3.0, k_decay=0.5)
    est.observe_preemption(1)
    assert est.k == 2.5
    est.observe_preemption(5)
    assert est.k == 3.0  # capped
    est.observe_finished(None, 100)
    assert est.k == 2.5


def test_same_events_same_state():
    def run():
        rnd = random.Random(7)
        est = AdaptiveReserve(window=50, min_samples=5)
        for i in range(300):
            if i % 17 == 0:
                est.observe_preemption()
            est.observe_finished(rnd.choice([None, 256]), rnd.randint(1, 256))
        return est.state(), est.reserve_blocks([RunningRequest(None, 2000, 30), RunningRequest(256, 256, 10)], 16, 0.5, 4096, 3)

    assert run() == run()


def test_censoring_only_finished_requests_are_samples():
    est = AdaptiveReserve(min_samples=1)
    est.observe_finished(None, 0)  # nothing generated: not a length sample
    assert est.state()["finished_seen"] == 0
    est.observe_preemption()  # a preempted request is not a sample either
    assert est.state()["absolute_tokens"]["samples"] == 0


@pytest.mark.parametrize("kw", [{"window": 0}, {"min_samples": 0}, {"k": -7}, {"k": 3, "k_max": 2}, {"k_decay": 2}])
def test_bad_parameters_are_refused(kw):
    with pytest.raises(ValueError):
        AdaptiveReserve(**kw)


# ---- the engine path's pieces: which max_tokens bound a length, the warm-up fallback ---------------------
from fdsched.core.adaptive import client_bound  # noqa: E402
from fdsched.core.warmup import warmup_reserve_blocks  # noqa: E402


@pytest.mark.parametrize(
    "max_tokens, max_model_len, prompt_len, expected",
    [
        (None, 4096, 1000, None),  # unset (the replay, a host that keeps None)
        (3096, 4096, 1000, None),  # the engine filled in what the context leaves: not the client's bound
        (5000, 4096, 1000, None),  # larger than the context (the engine clamps it): no bound either
        (3095, 4096, 1000, 3095),  # a real bound, one token short of the context
        (256, 4096, 1000, 256),
        (0, 4096, 1000, None),
    ],
)
def test_client_bound_only_when_max_tokens_bounds_the_length(max_tokens, max_model_len, prompt_len, expected):
    assert client_bound(max_tokens, max_model_len, prompt_len) == expected


def test_warmup_fallback_unbounded_uses_the_fixed_blocks_bounded_the_ratio_formula():
    assert warmup_reserve_blocks(None, 3000, 10, 0.7, 4096, 16, fixed_blocks=16) == 16
    assert warmup_reserve_blocks(None, 3000, 10, 0.7, 4096, 16, fixed_blocks=0) == 0  # legacy relaxed: nothing
    assert warmup_reserve_blocks(512, 512, 12, 0.7, 4096, 16, fixed_blocks=16) == reserve_blocks_for_request(
        512, 12, 0.7, 4096, 16
    )


def test_set_reservation_in_warm_up_uses_the_fallback_then_the_learned_estimate():
    est = AdaptiveReserve(min_samples=4, k=0.0)
    running = [RunningRequest(None, 3000, 0), RunningRequest(256, 256, 0)]
    # Nothing learned: unbounded -> fixed blocks (5), bounded -> ratio formula over its bound.
    assert est.reserve_blocks(running, 16, 0.5, 4096, fixed_blocks=5) == 5 + reserve_blocks_for_request(256, 0, 0.5, 4096, 16)
    for _ in range(4):
        est.observe_finished(None, 160)
    # Unbounded learned (every sample 160 tokens, k=0): 160 tokens = 10 blocks; bounded still in warm-up.
    assert est.reserve_blocks(running, 16, 0.5, 4096, fixed_blocks=5) == 10 + reserve_blocks_for_request(256, 0, 0.5, 4096, 16)
    assert est.state()["absolute_tokens"]["learned"] and not est.state()["relative_to_max_tokens"]["learned"]


def test_tail_cache_is_dropped_when_a_sample_arrives():
    hist = LengthHistogram()
    for v in (100, 200):
        hist.add(v)
    first = hist.tail(50.5)
    assert hist.tail(50.5) == first  # served from the cache
    hist.add(400)
    count, total, _ = hist.tail(50.5)
    assert count == pytest.approx(3) and total == pytest.approx(700)


def test_same_events_same_answers():
    def run():
        rnd = random.Random(7)
        est = AdaptiveReserve(min_samples=5)
        answers = []
        for i in range(300):
            est.observe_finished(None if i % 3 else 400, rnd.randint(1, 400))
            if i % 50 == 0:
                est.observe_preemption()
            answers.append(est.reserve_blocks([RunningRequest(None, 3000, i % 40), RunningRequest(400, 400, 7)], 16, 0.3, 4096, 2))
        return answers, est.state()

    assert run() == run()


def test_the_set_never_reserves_more_than_its_budgets_allow():
    # A lone request with 20 tokens left and a huge spread: k x std would be 6 x 20 tokens of air.
    assert margin_blocks(10, 400, 6.0, 4, left=20) == 5  # capped at 20 tokens = 5 blocks
    est = AdaptiveReserve(min_samples=2, k=6.0)
    for length in (1, 200, 3, 150):
        est.observe_finished(None, length)
    assert est.reserve_blocks([RunningRequest(None, 24, 4)], 4, 0.7, 4096, fixed_blocks=0) <= 5  # 20 tokens left


def test_warm_up_unbounded_never_reserves_more_than_upstream():
    # 16 legacy blocks, but upstream's formula reserves ceil(int(min(63 - 0, 4096) x 0.7) / 4) = 11 blocks.
    assert warmup_reserve_blocks(None, 63, 0, 0.7, 4096, 4, fixed_blocks=16) == 11



def test_the_set_never_reserves_more_than_upstreams_ratio_would():
    # Clients that bound their lengths exactly: the learned remainder is the whole remainder (no spread),
    # upstream's ratio keeps 0.5 of it; the set keeps the smaller, summed over the set.
    caps = sum(reserve_blocks_for_request(r, 0, 0.5, 8192, 16) for r in (300, 200, 100))
    assert caps == 10 + 7 + 4
    assert margin_blocks(600.0, 0.0, 2.0, 16, 600.0, cap_blocks=caps) == caps
    # ... and without a cap (or a loose one) the learned amount stands
    assert margin_blocks(600.0, 0.0, 2.0, 16, 600.0, cap_blocks=1000) == math.ceil(600 / 16)


def test_a_negative_margin_keeps_less_than_the_expected_remainder_and_never_goes_below_zero():
    assert margin_blocks(1000.0, 10 * 50.0 ** 2, -2.0, 16, 40000.0) == math.ceil((1000 - 2 * 50 * math.sqrt(10)) / 16)
    assert margin_blocks(10.0, 100.0 ** 2, -6.0, 16, 4000.0) == 0


# ---- one formula: alone, within a set, and the whole set ---------------------------------------------
from fdsched.core.adaptive import K_BOUND, K_DECAY, K_DEFAULT, K_STEP, margin_blocks  # noqa: E402


def test_a_request_alone_is_a_set_of_one():
    rnd = random.Random(3)
    est = _learned([rnd.randint(1, 600) for _ in range(300)], k=1.0)
    running = [RunningRequest(None, 4000, g) for g in (0, 40, 90, 300)] + [RunningRequest(700, 700, 5)]
    for r in running:
        alone = est.request_blocks(r, 0.7, 4096, 16, fixed_blocks=4)
        assert alone == est.reserve_blocks([r], 16, 0.7, 4096, fixed_blocks=4)
        e = est.remainder(r.max_tokens, r.budget, r.generated)
        if e is not None:
            cap = reserve_blocks_for_request(r.budget, r.generated, 0.7, 4096, 16)
            assert alone == margin_blocks(e.mean, e.variance, 1.0, 16, e.left, cap)
    whole = est.set_reservation(running, 0.7, 4096, 16, fixed_blocks=4)
    assert whole.blocks == est.reserve_blocks(running, 16, 0.7, 4096, fixed_blocks=4)
    assert whole.fallbacks == 1  # the relative kind is not learned: the bounded request fell back


def test_margin_blocks_caps_and_never_goes_negative():
    assert margin_blocks(100, 0, 0.0, 16) == 7
    assert margin_blocks(100, 10_000, 2.0, 16) == 19  # 100 + 2 x 100 = 300 tokens
    assert margin_blocks(100, 10_000, 2.0, 16, left=150) == 10
    assert margin_blocks(100, 10_000, 2.0, 16, cap_blocks=4) == 4
    assert margin_blocks(10, 10_000, -2.0, 16) == 0  # 10 - 200 tokens: nothing, not a negative count


def test_the_constants_are_the_settings_defaults_and_bounds():
    from fdsched.core.settings import SettingsError, load_settings

    s = load_settings(environ={})
    assert (s["tunables.adaptive_margin_k"], s["tunables.adaptive_k_step"], s["tunables.adaptive_k_decay"]) == (
        K_DEFAULT, K_STEP, K_DECAY
    )
    assert load_settings(environ={"FDSCHED_ADAPTIVE_MARGIN_K": str(K_BOUND)})["tunables.adaptive_margin_k"] == K_BOUND
    with pytest.raises(SettingsError, match="FDSCHED_ADAPTIVE_MARGIN_K"):
        load_settings(environ={"FDSCHED_ADAPTIVE_MARGIN_K": str(K_BOUND + 0.5)})
    with pytest.raises(SettingsError, match="FDSCHED_ADAPTIVE_K_DECAY"):
        load_settings(environ={"FDSCHED_ADAPTIVE_K_DECAY": "1.5"})
    est = AdaptiveReserve()
    assert (est.k, est.k_step, est.k_max, est.k_decay) == (K_DEFAULT, K_STEP, K_BOUND, K_DECAY)


# ---- a pass's asks: each request's terms are kept until something they depend on changes ----------------
class _Counting(AdaptiveReserve):
    """Counts the remainders it computes (set_reservation keeps each request's terms between calls)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.computed = 0

    def remainder(self, max_tokens, budget, generated):
        self.computed += 1
        return super().remainder(max_tokens, budget, generated)


def _replayed(events, **kw):
    """A fresh estimator (nothing kept) that saw ``events``: ("finished", max_tokens, length) / ("preempted",)."""
    est = AdaptiveReserve(**kw)
    for event in events:
        if event[0] == "finished":
            est.observe_finished(event[1], event[2])
        else:
            est.observe_preemption()
    return est


def test_a_passs_later_asks_compute_no_request_twice():
    est = _Counting(min_samples=4)
    for length in (30, 60, 90, 120, 400):
        est.observe_finished(None, length)
    running = [RunningRequest(None, 4000, g) for g in (0, 10, 20, 10)]  # two share (max_tokens, budget, generated)
    first = est.set_reservation(running, 0.7, 4096, 16, 0)
    assert est.computed == 3
    running.append(RunningRequest(None, 4000, 35))  # admitted within the pass
    second = est.set_reservation(list(reversed(running)), 0.7, 4096, 16, 0)
    assert est.computed == 4  # only the newcomer
    assert second.mean > first.mean and second.fallbacks == first.fallbacks == 0
    running[0] = RunningRequest(None, 4000, 1)  # it generated a token: a different request as far as terms go
    est.set_reservation(running, 0.7, 4096, 16, 0)
    assert est.computed == 5


def test_kept_terms_give_what_a_fresh_estimator_gives_as_samples_ratio_and_fallback_move():
    # Whatever the kept terms, every answer equals that of an estimator built afresh from the same events.
    rnd = random.Random(11)
    events, est = [], AdaptiveReserve(min_samples=6)
    running = [RunningRequest(rnd.choice((None, 300, 900)), 900, rnd.randint(0, 400)) for _ in range(40)]
    for step in range(120):
        if step % 7 == 3:
            event = ("finished", rnd.choice((None, 300)), rnd.randint(1, 900))
            est.observe_finished(event[1], event[2])
            events.append(event)
        if step % 31 == 5:
            est.observe_preemption()
            events.append(("preempted",))
        ratio = (0.7, 0.55, 0.4)[step // 20 % 3]  # held for stretches: samples alone must drop the kept terms
        fixed = (0, 16, 8)[step // 13 % 3]
        order = running[:]
        rnd.shuffle(order)
        kept = est.set_reservation(order, ratio, 4096, 16, fixed)
        fresh = _replayed(events, min_samples=6).set_reservation(running, ratio, 4096, 16, fixed)
        assert kept == fresh, f"step {step}"
        running[rnd.randrange(len(running))] = RunningRequest(None, 900, rnd.randint(0, 400))


def test_a_subclass_with_state_of_its_own_forgets_the_kept_terms():
    class Given(AdaptiveReserve):
        answer = 100.0

        def remainder(self, max_tokens, budget, generated):
            return RemainderEstimate(self.answer, 0.0, float(budget - generated))

    est = Given(k=0.0)
    running = [RunningRequest(None, 4000, 0)]
    assert est.set_blocks(running, 0.7, 4096, 16, 0) == math.ceil(100 / 16)
    est.answer = 300.0
    assert est.set_blocks(running, 0.7, 4096, 16, 0) == math.ceil(100 / 16)  # kept: nothing it knows changed
    est.forget_terms()
    assert est.set_blocks(running, 0.7, 4096, 16, 0) == math.ceil(300 / 16)


from fdsched.core.adaptive import RemainderEstimate  # noqa: E402


def test_the_kept_terms_stay_about_one_pass_large_while_outputs_grow():
    # Ratio at its minimum and nothing finishing: the stamp never changes, but every decoding request's key moves
    # with each token. The table must not keep every key it ever saw.
    est = AdaptiveReserve(min_samples=2)
    for length in (50, 500, 900):
        est.observe_finished(None, length)
    running = [RunningRequest(None, 4000 + i, 3 * i) for i in range(200)]  # no two share a key
    for step in range(50):
        est.set_reservation([RunningRequest(None, r.budget, r.generated + step) for r in running], 0.1, 4096, 16, 0)
        assert len(est._terms) <= 3 * len(running) + 64, f"step {step}: {len(est._terms)} kept"

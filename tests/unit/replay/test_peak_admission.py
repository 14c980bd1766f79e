"""Peak-demand admission with learned remainders (fdsched.replay.peak_admission): plain values, no host."""

from __future__ import annotations

import itertools
import random

import pytest

from fdsched.core.common import ceil_div
from fdsched.replay.peak_admission import (
    LearnedClip, PeakAdmission, QuantileController, QuantileLengths, RunningView, peak_blocks,
)
from fdsched.core.admission import reserve_blocks_for_request


def _simulate_peak(items, block_size, ahead):
    """Brute force: step the set forward one token per step and record the most blocks held."""
    best = 0
    horizon = max((rem for _, _, rem in items), default=0)
    for t in range(max(horizon, 1)):
        total = 0
        for held, tokens, rem in items:
            if rem > t or t == 0:
                total += max(held, ceil_div(tokens + t, block_size) + ahead)
        best = max(best, total)
    return best


def test_peak_blocks_matches_a_step_by_step_simulation():
    rnd = random.Random(1)
    for _ in range(300):
        items = [(rnd.randint(0, 40), rnd.randint(1, 600), rnd.randint(0, 300)) for _ in range(rnd.randint(0, 7))]
        assert peak_blocks(items, 16, 2) == _simulate_peak(items, 16, 2)


def test_peak_counts_blocks_a_finishing_request_gives_back():
    # A (100 tokens held, finishes in 1 step) and B (16 tokens, 200 to go): the peak is B's end alone
    # plus A now, never both grown, so it is far below "sum of full remainders".
    items = [(7, 100, 1), (1, 16, 200)]
    no_credit = ceil_div(100 + 1, 16) + ceil_div(16 + 200, 16)
    assert peak_blocks(items, 16, 0) < no_credit


def _views(rnd, n):
    out = []
    for _ in range(n):
        generated = rnd.randint(0, 500)
        bounded = rnd.random() < 0.5
        max_tokens = rnd.randint(generated + 1, generated + 900) if bounded else None
        left = (max_tokens - generated) if bounded else rnd.randint(0, 3000)
        tokens = rnd.randint(1, 2000) + generated
        out.append(RunningView(ceil_div(tokens, 16), tokens, generated, max_tokens, left))
    return out


def _learned_admission(rnd):
    lengths = QuantileLengths(min_samples=8)
    adm = PeakAdmission(lengths, QuantileController(q_start=0.8), ahead=2)
    for _ in range(400):
        if rnd.random() < 0.5:
            adm.observe_finished(None, int(rnd.paretovariate(1.2) * 20))
        else:
            adm.observe_finished(1000, rnd.randint(1, 1000))
    return adm


def test_reserve_is_the_same_for_every_order_of_the_running_set():
    rnd = random.Random(7)
    adm = _learned_admission(rnd)
    for _ in range(40):
        views = _views(rnd, 5)
        candidate = _views(rnd, 1)[0]
        answers = {adm.reserve_blocks(list(p), candidate, 16) for p in itertools.permutations(views)}
        assert len(answers) == 1
    # the candidate is part of the set: swapping it with a running request changes nothing either
    a, b = _views(rnd, 2)
    assert adm.reserve_blocks([a], b, 16) == adm.reserve_blocks([b], a, 16)


def test_reserve_is_never_negative_even_when_requests_hold_more_than_they_will_need():
    rnd = random.Random(3)
    adm = _learned_admission(rnd)
    for _ in range(500):
        views = [RunningView(rnd.randint(0, 300), rnd.randint(1, 200), rnd.randint(0, 50), None, rnd.randint(0, 50))
                 for _ in range(rnd.randint(0, 6))]
        assert adm.reserve_blocks(views, None, 16) >= 0
    # the case: three fresh requests on a short-mostly, long-tailed distribution
    fresh = PeakAdmission(QuantileLengths(min_samples=10), ahead=2)
    for length in [10] * 20 + [1000] * 5:
        fresh.observe_finished(None, length)
    assert fresh.reserve_blocks([RunningView(1, 16, 0, None, 4000)] * 3, None, 16) >= 0


def test_admission_means_the_predicted_peak_fits_the_pool():
    adm = PeakAdmission(QuantileLengths(min_samples=1), QuantileController(q_start=0.5, q_min=0.5), ahead=0)
    for _ in range(10):
        adm.observe_finished(None, 64)  # every request makes 64 tokens
    running = [RunningView(2, 32, 0, None, 4000)]  # 32 tokens held, 64 to come -> 6 blocks at its end
    candidate = RunningView(2, 32, 0, None, 4000)
    reserve = adm.reserve_blocks(running, candidate, 16)
    assert reserve == 12 - 4  # both peak at 6 blocks together; they hold 4


def test_quantile_lengths_conditional_quantile_and_window():
    lengths = QuantileLengths(window=5, min_samples=2)
    assert lengths.quantile(0.5) is None  # warm-up
    for v in (10, 20, 30, 40, 50):
        lengths.observe_finished(None, v)
    assert lengths.quantile(0.5) == 30
    assert lengths.quantile(0.5, above=25) == 40  # samples > 25: 30, 40, 50
    assert lengths.remainder(0.5, generated=25, max_tokens=None, left=1000) == 40 - 25
    assert lengths.remainder(0.5, generated=25, max_tokens=None, left=5) == 5  # never beyond the budget
    lengths.observe_finished(None, 60)  # the window drops 10
    assert lengths.quantile(0.0) == 20
    # beyond every sample: "as long again", within the budget
    assert lengths.remainder(0.5, generated=300, max_tokens=None, left=1000) == 300


def test_quantile_lengths_relative_to_max_tokens():
    lengths = QuantileLengths(min_samples=1)
    for _ in range(4):
        lengths.observe_finished(100, 100)  # every bounded client's request uses its whole budget
    assert lengths.remainder(0.5, generated=30, max_tokens=200, left=170) == 170


def test_controller_settles_at_the_target_rate():
    ctl = QuantileController(target_per_1k=5.0, q_start=0.7, step=0.05, q_min=0.01, q_max=0.99)
    for i in range(1, 20001):  # 5 preemptions per 1000 finished: q must not drift
        ctl.on_finished()
        if i % 200 == 0:
            ctl.on_preemption(1)
    assert ctl.q == pytest.approx(0.7, abs=1e-6)
    for _ in range(1000):  # no preemptions: q falls by step x target per 1000 finished
        ctl.on_finished()
    assert ctl.q == pytest.approx(0.7 - 0.25)
    for _ in range(10000):  # ... down to its floor, not below
        ctl.on_finished()
    assert ctl.q == pytest.approx(0.01)
    before = ctl.q
    ctl.on_preemption(2)
    assert ctl.q == pytest.approx(before + 0.1)


def test_learned_clip_is_upstream_formula_with_the_learned_quantile():
    clip = LearnedClip(q=0.75, min_samples=4)
    assert clip.reserve_blocks(4000, 0, 0.7, 256, 16) == reserve_blocks_for_request(4000, 0, 0.7, 256, 16)
    for v in (10, 20, 30, 40):
        clip.observe_finished(None, v)
    assert clip.clip(256) == 30
    assert clip.reserve_blocks(4000, 0, 1.0, 256, 16) == reserve_blocks_for_request(4000, 0, 1.0, 30, 16)


@pytest.mark.parametrize(
    "build, needle",
    [
        (lambda: QuantileLengths(window=0), "QuantileLengths window: bad value 0"),
        (lambda: QuantileController(target_per_1k=0), "target_per_1k: bad value 0"),
        (lambda: QuantileController(q_start=1.2), "q_min, q_start, q_max: bad values"),
        (lambda: PeakAdmission(ahead=-1), "ahead: bad value -1"),
        (lambda: peak_blocks([(1, 1, 1)], 0, 1), "block_size: bad value 0"),
        (lambda: PeakAdmission().reserve_blocks([RunningView(-1, 1, 0, None, 1)], None, 16), "RunningView.held_blocks: bad value -1"),
        (lambda: LearnedClip(q=1.0), "LearnedClip q: bad value 1.0"),
    ],
)
def test_bad_input_names_the_value_and_what_is_allowed(build, needle):
    with pytest.raises(ValueError) as info:
        build()
    assert needle in str(info.value) and "allowed" in str(info.value)


def test_large_sets_use_an_upper_bound_within_one_block_per_request():
    rnd = random.Random(5)
    for _ in range(100):
        items = [(rnd.randint(0, 40), rnd.randint(1, 600), rnd.randint(0, 300)) for _ in range(rnd.randint(1, 12))]
        exact = peak_blocks(items, 16, 2)
        bound = peak_blocks(items, 16, 2, exact_up_to=0)
        assert exact <= bound  # never admits what the exact check refuses
        unheld = [(0, tok, rem) for _, tok, rem in items]  # nobody holds more than its tokens need
        assert peak_blocks(unheld, 16, 2) <= peak_blocks(unheld, 16, 2, exact_up_to=0) <= peak_blocks(unheld, 16, 2) + len(items)
        shuffled = items[:]
        rnd.shuffle(shuffled)
        assert peak_blocks(shuffled, 16, 2, exact_up_to=0) == bound

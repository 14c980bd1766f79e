"""The estimator's terms over arrays (fdsched.core.terms) answer exactly what it answers one request at a time.

Plain values, no host. numpy comes with every FastDeploy host and with the test extra (matplotlib needs it too).
"""

from __future__ import annotations

import math
import random
import struct
from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from fdsched.core.adaptive import RELATIVE_SCALE, AdaptiveReserve, RunningRequest
from fdsched.core.terms import (
    BATCH_MIN, MEAN_SCALE, SetTerms, batch_terms, columns_of_keys, numpy_or_none, request_columns,
)

np = numpy_or_none()
pytestmark = pytest.mark.skipif(np is None, reason="unit: numpy not installed (the terms are then computed one by one)")


def _bits(values) -> tuple:
    """Floats as their bit patterns: equal only if bit for bit the same (0.0 and -0.0 differ)."""
    return tuple(struct.pack("<d", float(value)) for value in values)


def _one_by_one(est, keys, args) -> list:
    return [est._request_terms(*key, *args) for key in keys]


def _same(est, keys, args) -> None:
    """Every request's terms over arrays are the one-by-one rule's, bit for bit; the set's sums are theirs."""
    one = _one_by_one(est, keys, args)
    columns = request_columns(est, *columns_of_keys(keys), *args, RELATIVE_SCALE)
    answered = columns.answered.tolist()
    assert answered == [t[0] is not None for t in one], f"which are answered differ for keys {keys}"
    learned = [t for t in one if t[0] is not None]
    fallbacks = [t for t in one if t[0] is None]
    # the one-by-one rule may answer an int mean (the budget left, when that is smaller): the same value
    for column, index in (("mean", 0), ("variance", 1), ("left", 2), ("cap", 3)):
        mine = getattr(columns, column)[columns.answered].tolist()
        assert _bits(mine) == _bits(t[index] for t in learned), f"{column} differs for keys {keys}"
    assert columns.fallback[~columns.answered].tolist() == [t[3] for t in fallbacks]
    many = batch_terms(est, *columns_of_keys(keys), *args, RELATIVE_SCALE)
    assert many.mean_units == sum(int(Fraction(t[0]) * MEAN_SCALE) for t in learned)
    assert all(Fraction(t[0]) * MEAN_SCALE == int(Fraction(t[0]) * MEAN_SCALE) for t in learned)  # exact units
    assert _bits(many.variances) == _bits(t[1] for t in learned)
    assert (many.learned, many.left, many.caps, many.fallback_blocks, many.fallbacks) == (
        len(learned), int(math.fsum(t[2] for t in learned)), sum(t[3] for t in learned),
        sum(t[3] for t in fallbacks), len(fallbacks))


samples = st.lists(
    st.tuples(st.one_of(st.none(), st.integers(1, 3000)), st.integers(1, 5000)), min_size=0, max_size=120
)
keys = st.lists(
    st.tuples(
        st.one_of(st.none(), st.just(0), st.integers(1, 5000)),  # the client's bound (0: treated as none)
        st.integers(1, 8000),  # budget
        st.integers(0, 9000),  # generated (beyond the budget too)
    ),
    min_size=1,
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(samples=samples, keys=keys, min_samples=st.integers(1, 40), ratio=st.floats(0.05, 1.0),
       clip=st.integers(1, 4096), block_size=st.sampled_from((1, 16, 64)), fixed=st.integers(0, 16),
       window=st.integers(3, 3000))
def test_arrays_answer_every_request_as_one_by_one_does(samples, keys, min_samples, ratio, clip, block_size, fixed,
                                                        window):
    # a short window drops old samples: buckets left with a weight of float dust (the estimator's 1e-12 rule)
    est = AdaptiveReserve(min_samples=min(min_samples, window), window=window)
    for bound, length in samples:
        est.observe_finished(bound, length)
    _same(est, keys, (ratio, clip, block_size, fixed))


def test_thresholds_on_and_beside_every_bucket_edge_land_in_the_estimators_bucket():
    # A relative threshold is 4096 (g + 0.5) / max_tokens: exact powers of two (bucket edges) happen, e.g.
    # g = 0, max_tokens = 2048 is 1.0. Around every edge, one ulp either side: the bucket is the estimator's.
    est = AdaptiveReserve(min_samples=1)
    for bound, length in ((None, 7), (100, 37), (None, 900), (3000, 2999), (None, 40000), (64, 1)):
        est.observe_finished(bound, length)
    from fdsched.core.terms import _lower_edges

    rnd = random.Random(3)
    for histogram in (est.absolute, est.relative):
        edges = [histogram.lo * 2 ** (k / histogram.per_octave) for k in range(histogram.buckets + 2)]
        values = []
        for edge in edges:
            value = edge
            for _ in range(3):
                value = math.nextafter(value, 0.0)
            for _ in range(7):
                values.append(value)
                value = math.nextafter(value, math.inf)
        values += [0.0, 0.5, histogram.lo, histogram.hi * 3] + [rnd.uniform(0, 5000) for _ in range(2000)]
        found = np.searchsorted(_lower_edges(np, histogram), np.array(values), side="right") - 1
        assert found.tolist() == [histogram.bucket(value) for value in values]
    # and whole requests whose thresholds are exact powers of two
    keys = [(2048 >> j, 4000, g) for j in range(11) for g in (0, 1, 2, 3)] + [(3 * 512, 4000, 1), (1024, 4000, 0)]
    _same(est, keys, (0.7, 4096, 16, 0))
    # a bucket whose own weight is dust (at most 1e-12) is left out of the tail: the same over arrays
    est.absolute.add(300.0, 1e-13)
    est.absolute.add(301.0, 5e-13)
    _same(est, [(None, 10**7, g) for g in range(250, 330)], (0.7, 4096, 16, 0))


def test_a_large_running_set_gets_the_same_reservation_either_way():
    def learned() -> AdaptiveReserve:
        rnd, est = random.Random(5), AdaptiveReserve()
        for i in range(300):
            est.observe_finished(64 if i % 2 else None, rnd.randint(4, 600))
        return est

    rnd = random.Random(6)
    running = [RunningRequest(None if i % 4 == 0 else 256 + (i * 37) % 769, 4000, rnd.randint(0, 700))
               for i in range(448)]
    arrays, one = learned(), learned()
    one._batch = False  # the one-by-one rule
    assert arrays._batch and len(running) >= BATCH_MIN
    assert arrays.set_reservation(running, 0.7, 4096, 64, 0) == one.set_reservation(running, 0.7, 4096, 64, 0)
    # and term by term, bit for bit, over many such sets (a dense set puts many thresholds in buckets with samples)
    for seed in range(20):
        rnd = random.Random(seed)
        keys = [(rnd.choice((None, 0, rnd.randint(1, 1200))), rnd.randint(1, 5000), rnd.randint(0, 1500))
                for _ in range(448)]
        _same(arrays, keys, (rnd.uniform(0.05, 1.0), rnd.choice((512, 4096)), rnd.choice((16, 64)), rnd.randint(0, 16)))


def test_a_subclass_that_reads_requests_its_own_way_is_asked_one_by_one():
    class Own(AdaptiveReserve):
        def remainder(self, max_tokens, budget, generated):
            return super().remainder(max_tokens, budget, generated)

    assert AdaptiveReserve()._batch and not Own()._batch


def test_an_edge_is_found_from_a_guess_far_off_too():
    from fdsched.core.terms import _lower_edges, _lowest_in

    histogram = AdaptiveReserve().absolute
    edges = _lower_edges(np, histogram)
    for b in (1, 7, 8, 9, 80, histogram.buckets - 1):
        # far below and far above the edge: the short walk gives up and the bisection finds the same float
        assert _lowest_in(histogram.bucket, b, edges[b] / 3) == edges[b]
        assert _lowest_in(histogram.bucket, b, edges[b] * 3) == edges[b]
        assert histogram.bucket(edges[b]) >= b > histogram.bucket(math.nextafter(edges[b], 0.0))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.just(0.0), st.floats(1.0, 2.0 ** 40, allow_nan=False, allow_infinity=False)),
                min_size=0, max_size=3000))
def test_means_are_summed_exactly_in_units_of_2_to_the_minus_52(means):
    from fdsched.core.terms import mean_units

    units = mean_units(np, np.array(means, dtype=np.float64))
    assert units == sum(Fraction(m) for m in means) * MEAN_SCALE
    whole, rest = divmod(units, MEAN_SCALE)  # as the tally turns it back into a float: correctly rounded
    assert math.fsum([float(whole), rest / MEAN_SCALE]) == math.fsum(means)


def test_a_tally_added_to_over_arrays_and_one_by_one_answers_as_the_one_by_one_rule():
    rnd = random.Random(9)

    def learned(batch: bool) -> AdaptiveReserve:
        est = AdaptiveReserve(min_samples=8)
        for i in range(200):
            est.observe_finished(512 if i % 3 else None, 1 + (i * 53) % 700)
        est._batch = est._batch and batch
        return est

    arrays, one = learned(True), learned(False)
    for _ in range(10):
        parts = [[(rnd.choice((None, 512, 300)), rnd.randint(1, 2000), rnd.randint(0, 800)) for _ in range(n)]
                 for n in (rnd.randint(BATCH_MIN, 300), rnd.randint(0, 5), rnd.randint(BATCH_MIN, 60), 3)]
        tallies = [est.set_tally(0.7, 4096, 64, 4) for est in (arrays, one)]
        for part in parts:
            for tally in tallies:
                tally.add(part)
            assert tallies[0].reservation() == tallies[1].reservation()


def test_the_tail_rows_are_kept_while_the_histograms_stand_and_redrawn_after_a_sample():
    rnd = random.Random(12)
    est = AdaptiveReserve(min_samples=4)
    for i in range(60):
        est.observe_finished(700 if i % 2 else None, rnd.randint(2, 900))
    args = (0.7, 4096, 64, 2)
    keys = [(rnd.choice((None, 700, 90)), rnd.randint(50, 3000), rnd.randint(0, 900)) for _ in range(200)]
    _same(est, keys, args)
    kept = est._tail_rows
    _same(est, [(bound, budget, generated + 1) for bound, budget, generated in keys], args)  # the next pass
    assert est._tail_rows is kept  # nothing finished in between: the same rows, more of them filled
    for i in range(5):  # requests finish: every row is redrawn from the histograms as they are now
        est.observe_finished(None if i % 2 else 700, rnd.randint(300, 2000))
        _same(est, keys, args)
        assert est._tail_rows is not kept
        kept = est._tail_rows

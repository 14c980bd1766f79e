# NOT part of the test command (pytest's testpaths is tests/): these tests demonstrate issue 18's two defects of
# the adaptive estimator and FAIL on today's code by design. They move into tests/unit with the fix (issue 18),
# which changes adaptive's decisions (the golden decision log is regenerated for that profile then).
# Run: python -m pytest tools/issue18 -q. Recorded on the policy branch (before the redesign merge): SetMargin gave
# the pair (300, sigma 10) / (10, sigma 250) 18 blocks in one order and 0 in the other; four totals {0, 4, 18, 23}
# over the six orders of three requests; reserve_blocks returned -46 blocks for three fresh requests at k = -2.
# After the redesign merge reserve_blocks takes a fixed_blocks argument: the third test needs that argument.
"""Issue 18's two defects in the adaptive estimator (fdsched.core.adaptive), shown against today's code.

Both tests FAIL on the code as it stands (they are the regression tests for the fix; see the issue):
- SetMargin's per-request answers accumulate a running maximum, so the set's reservation depends on
  the order the running requests are asked in;
- AdaptiveReserve.reserve_blocks returns a negative block count with the default k = -2.
"""

from __future__ import annotations

import itertools

from fdsched.core.adaptive import AdaptiveReserve, RunningRequest, SetMargin


def _set_total(order, k=-2.0, block_size=16):
    margin = SetMargin()
    return sum(margin.add(mean, variance, k, block_size) for mean, variance in order)


def test_set_margin_total_does_not_depend_on_the_order_of_the_running_set():
    # (mean 300, sigma 10) and (mean 10, sigma 250), the pair named in the issue: the set is the same,
    # so its reservation must be too.
    pair = [(300.0, 10.0 ** 2), (10.0, 250.0 ** 2)]
    totals = {order: _set_total(order) for order in itertools.permutations(pair)}
    assert len(set(totals.values())) == 1, f"the set's reservation depends on order: {totals}"


def test_set_margin_total_is_order_independent_over_every_permutation_of_three():
    trio = [(300.0, 100.0), (10.0, 62500.0), (120.0, 900.0)]
    totals = {order: _set_total(order) for order in itertools.permutations(trio)}
    assert len(set(totals.values())) == 1, f"the set's reservation depends on order: {totals}"


def test_reserve_blocks_is_never_negative_with_the_default_k():
    est = AdaptiveReserve(min_samples=10)  # default k = -2
    for length in [10] * 20 + [1000] * 5:  # a short-mostly, long-tailed distribution
        est.observe_finished(None, length)
    fresh = [RunningRequest(max_tokens=None, budget=4000, generated=0)] * 3
    blocks = est.reserve_blocks(fresh, block_size=16, ratio=0.7, clip_max_new_tokens=4096)
    assert blocks >= 0, f"reserve_blocks returned {blocks} blocks for three fresh requests"

"""The schedule bench's per-step minima ratio (``fdsched.tools.bench.minima_ratios``): plain values, no host."""

from __future__ import annotations

import pytest

from fdsched.tools.bench import minima_ratios


def test_minima_ratio_sums_each_part_over_the_host_and_splits_by_admitting_steps():
    host = {"minima": [1.0, 2.0, 1.0, 4.0], "admitting": {1}}
    plugin = {"minima": [1.5, 3.0, 1.0, 4.0], "admitting": {3}}  # either variant's admitting steps count
    ratios = minima_ratios(host, plugin)
    assert ratios["all"] == pytest.approx(9.5 / 8.0)
    assert ratios["admitting"] == pytest.approx(7.0 / 6.0)
    assert ratios["other"] == pytest.approx(2.5 / 2.0)
    assert ratios["admitting_steps"] == 2


def test_a_part_without_steps_has_no_ratio():
    ratios = minima_ratios({"minima": [1.0, 1.0], "admitting": set()}, {"minima": [2.0, 1.0], "admitting": set()})
    assert ratios["admitting"] is None and ratios["other"] == pytest.approx(1.5) and ratios["admitting_steps"] == 0

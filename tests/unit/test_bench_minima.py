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


def test_runs_summarise_to_each_steps_least_time_and_every_runs_admitting_steps():
    from fdsched.tools.bench import summarise_runs

    runs = {("host", "off"): [([(3.0, False), (5.0, True)], [4, 0, 0]), ([(2.0, False), (6.0, False)], [2, 1, 0])],
            ("plugin", "off"): [([(4.0, True), (1.0, False)], [0, 0, 1])]}
    result = summarise_runs(runs)
    assert result[("host", "off")]["collections"] == [3.0, 0.5, 0.0]
    assert result[("plugin", "off")]["collections"] == [0.0, 0.0, 1.0]
    assert result[("host", "off")]["minima"] == [2.0, 5.0]
    assert result[("host", "off")]["admitting"] == {1}
    assert result[("host", "off")]["median"] == pytest.approx(4.0) and result[("host", "off")]["mean"] == 4.0
    assert result[("plugin", "off")]["minima"] == [4.0, 1.0] and result[("plugin", "off")]["admitting"] == {0}


def test_the_arms_take_turns_going_first():
    from fdsched.tools.bench import arm_order

    orders = [arm_order(i) for i in range(4)]
    assert orders == [("host", "plugin"), ("plugin", "host")] * 2


def test_groups_of_arm_processes_go_round_the_cpus_this_process_may_use(monkeypatch):
    import os

    from fdsched.tools import bench

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 2}, raising=False)
    assert bench.group_cpus(5) == [2, 5, 2, 5, 2]  # every process of a group on one CPU, the groups alternating
    monkeypatch.delattr(os, "sched_getaffinity")
    assert bench.group_cpus(2) == [None, None]  # where CPUs cannot be chosen: where the system puts them

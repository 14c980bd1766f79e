"""``fdsched bench sweep``'s arms, its --profiles flag and its rows: plain values, no host."""

from __future__ import annotations

import pytest

from fdsched.core.settings import SettingsError, shipped_profiles
from fdsched.tools import benchsweep
from fdsched.tools.bench import arm_order


def test_the_host_comes_first_then_a_second_host_process_then_the_profiles_in_order():
    arms = benchsweep.sweep_arms(["recommended", "baseline"])
    assert list(arms) == ["host", "null", "recommended", "baseline"]
    assert arms["null"] == "host" and arms["baseline"] == "baseline"


def test_every_arm_takes_turns_going_first_and_last():
    arms = ("host", "null", "a", "b")
    assert arm_order(0, arms) == arms and arm_order(1, arms) == tuple(reversed(arms))
    assert arm_order(2, arms) == arms


def test_all_is_every_shipped_profile_and_a_list_keeps_its_order():
    assert benchsweep.parse_profiles("all") == list(shipped_profiles())
    assert benchsweep.parse_profiles(" ratio_reserve, baseline ") == ["ratio_reserve", "baseline"]


@pytest.mark.parametrize("value, said", [("bogus", "unknown profile"), ("", "'all' or one or more"),
                                         ("baseline,baseline", "each profile once")])
def test_a_bad_profiles_value_names_the_flag_and_what_is_allowed(value, said):
    with pytest.raises(SettingsError) as caught:
        benchsweep.parse_profiles(value)
    assert str(caught.value).startswith("--profiles: bad value") and said in str(caught.value)
    assert "allowed" in str(caught.value)


def test_rows_put_each_arm_against_the_host_with_its_groups():
    host = {"minima": [1.0, 3.0], "admitting": {0}, "median": 2.0}
    result = {("host", "on"): host,
              ("null", "on"): {"minima": [1.0, 3.0], "admitting": {0}, "median": 2.1, "groups": [0.9, 1.1]},
              ("a", "on"): {"minima": [2.0, 3.0], "admitting": {0}, "median": 2.5, "groups": [1.3]}}
    rows = benchsweep.sweep_rows(result, {"host": "host", "null": "host", "a": "a"}, "on")
    assert rows[0] == ("host", None, [], 2.0)
    (null, null_ratios, null_groups, _), (arm, ratios, groups, median) = rows[1:]
    assert null == "null" and null_ratios["all"] == pytest.approx(1.0) and null_groups == [0.9, 1.1]
    assert arm == "a" and ratios["all"] == pytest.approx(5.0 / 4.0) and ratios["admitting"] == pytest.approx(2.0)
    assert ratios["other"] == pytest.approx(1.0) and groups == [1.3] and median == 2.5


def test_the_schedule_bench_in_processes_is_a_group_of_two(monkeypatch):
    from fdsched.tools import bench

    seen = {}
    timed = {("host", "on"): {"median": 1.0}, ("plugin", "on"): {"median": 1.1, "groups": [1.1, 1.0]}}

    def groups(count, arms, shape, repeat, gc_modes, heap_objects):
        seen.update(count=count, arms=arms, shape=shape, repeat=repeat, modes=gc_modes, heap=heap_objects)
        return timed

    monkeypatch.setattr(bench, "run_arm_groups", groups)
    result = bench.bench_schedule_isolated(3, 256, 64, 200, 2, 64, "recommended", ("on",), 0, "uniform")
    assert seen == {"count": 3, "arms": {"host": "host", "plugin": "recommended"},
                    "shape": (256, 64, 200, 64, "uniform"), "repeat": 2, "modes": ("on",), "heap": 0}
    assert result is timed  # each pair's own ratio in the plugin arm's groups, as the command prints them

"""The shipped A/B profiles (fdsched.configs/*.yaml): each loads and says what its name promises."""

from __future__ import annotations

import pytest
import yaml

from fdsched.core.profiles import profile_description
from fdsched.core.settings import HOST_FIXES, UPSTREAM_CHANGE_IDS as CHANGE_IDS, load_settings, shipped_profiles

PROFILES = shipped_profiles()
SINGLE_CHANGE_PROFILES = [name for name in PROFILES if name in CHANGE_IDS]
# "recommended + one thing": every change on, like recommended.
ALL_ON_PROFILES = [name for name in PROFILES if name != "baseline" and name not in CHANGE_IDS]

# What each shipped profile resolved the five original switches to when the profiles spelled out every
# switch (main at fcfbbd3), before `changes.others` replaced those lines. Written out, not derived, so that
# a profile edit that changes a switch fails here. A change added later is checked by the rule-based tests below.
ON, OFF = "on", "off"
PINNED_SWITCHES = {
    "baseline": (OFF, OFF, OFF, OFF, OFF),
    "deferred_recycle": (ON, OFF, OFF, OFF, OFF),
    "decode_only_preempt": (OFF, ON, OFF, OFF, OFF),
    "ratio_reserve": (OFF, OFF, ON, OFF, OFF),
    "pd_prefill_cache": (OFF, OFF, OFF, ON, OFF),
    "nonpolling_transfer": (OFF, OFF, OFF, OFF, ON),
    **{name: (ON, ON, ON, ON, ON) for name in (
        "recommended", "oracle", "adaptive", "unbounded", "optimism", "upstream-clip", "sglang-retract")},
}
PINNED_IDS = ("deferred_recycle", "decode_only_preempt", "ratio_reserve", "pd_prefill_cache", "nonpolling_transfer")


def switches(name: str) -> dict:
    s = load_settings(environ={}, profile=name)
    return {change_id: s.change_mode(change_id) for change_id in CHANGE_IDS}


def test_the_shipped_set():
    assert set(PROFILES) == {
        "baseline", "recommended", "oracle", "adaptive", "unbounded", "optimism", "upstream-clip",
        "sglang-retract", *CHANGE_IDS,
    }
    assert sorted(SINGLE_CHANGE_PROFILES) == sorted(CHANGE_IDS)


@pytest.mark.parametrize("name", list(PROFILES))
def test_every_shipped_profile_loads(name):
    s = load_settings(environ={}, profile=name)
    assert s.profile == name
    assert s.profile_path == str(PROFILES[name])
    for change_id in CHANGE_IDS:  # every profile sets every switch, by name or with changes.others: none is left auto
        assert s.sources[f"changes.{change_id}"] in (f"profile {name}", f"profile {name} via changes.others")


@pytest.mark.parametrize("name", list(PROFILES))
def test_every_shipped_profile_has_a_description(name):
    assert profile_description(PROFILES[name])


@pytest.mark.parametrize("name", list(PROFILES))
def test_shipped_profiles_name_only_the_switches_unlike_their_others(name):
    """`others` sets the rest, so a new change needs no line in an existing profile."""
    changes = yaml.safe_load(PROFILES[name].read_text(encoding="utf-8"))["changes"]
    others = changes.pop("others")
    assert others in ("on", "off")
    assert all(value != others for value in changes.values()), changes


@pytest.mark.parametrize("name", list(PINNED_SWITCHES))
def test_shipped_profile_resolves_to_its_pinned_switches(name):
    s = load_settings(environ={}, profile=name)
    assert tuple(s.change_mode(change_id) for change_id in PINNED_IDS) == PINNED_SWITCHES[name]


def test_the_pins_cover_every_shipped_profile_but_the_later_single_change_ones():
    assert set(PROFILES) - set(PINNED_SWITCHES) == set(CHANGE_IDS) - set(PINNED_IDS)


def test_baseline_has_every_change_off():
    assert switches("baseline") == {change_id: "off" for change_id in CHANGE_IDS}


@pytest.mark.parametrize("name", SINGLE_CHANGE_PROFILES)
def test_single_change_profile_has_only_that_change_on(name):
    expected = {change_id: "off" for change_id in CHANGE_IDS}
    expected[name] = "on"
    assert switches(name) == expected


def test_pd_prefill_cache_profile_uses_the_default_safe_mode():
    s = load_settings(environ={}, profile="pd_prefill_cache")
    assert s["pd_prefill_cache.mode"] == "safe"
    assert s.sources["pd_prefill_cache.mode"] == "default"


@pytest.mark.parametrize("name", ALL_ON_PROFILES)
def test_recommended_and_the_profiles_built_on_it_turn_every_change_on(name):
    assert switches(name) == {change_id: "on" for change_id in CHANGE_IDS}


@pytest.mark.parametrize("name", [None, *PROFILES])
def test_every_shipped_profile_and_the_default_leave_each_host_fix_auto(name):
    """A host fix applies wherever the host has the defect under every profile, ``baseline`` included (it means the
    pre-change policy, not the host's defects); ``changes.others`` does not reach it."""
    s = load_settings(environ={}, profile=name)
    assert HOST_FIXES
    for fix in HOST_FIXES:
        assert s.change_mode(fix) == "auto" and s.sources[f"changes.{fix}"] == "default"


def test_a_host_fix_named_off_keeps_the_host_code():
    s = load_settings(environ={"FDSCHED_PROFILE": "baseline", "FDSCHED_ONE_NODE_PER_BLOCK": "off"})
    assert s.change_mode("one_node_per_block") == "off"


def test_recommended_selects_the_safe_pd_mode_explicitly():
    s = load_settings(environ={}, profile="recommended")
    assert s["pd_prefill_cache.mode"] == "safe"
    assert s.sources["pd_prefill_cache.mode"] == "profile recommended"
    assert s["replay.oracle_reserve"] is False


def test_oracle_reserves_true_remaining_output():
    s = load_settings(environ={}, profile="oracle")
    assert s["replay.oracle_reserve"] is True
    assert s.sources["replay.oracle_reserve"] == "profile oracle"


@pytest.mark.parametrize("name", [n for n in PROFILES if n != "oracle"])
def test_only_oracle_uses_the_oracle_reserve(name):
    assert load_settings(environ={}, profile=name)["replay.oracle_reserve"] is False


def test_adaptive_is_recommended_with_the_adaptive_estimator():
    adaptive = load_settings(environ={}, profile="adaptive")
    recommended = load_settings(environ={}, profile="recommended")
    differ = {k for k in adaptive.values if adaptive[k] != recommended[k]}
    assert differ == {"tunables.reserve_estimator"}
    assert adaptive["tunables.reserve_estimator"] == "adaptive" and recommended["tunables.reserve_estimator"] == "ratio"

"""fdsched.core.settings: defaults < profile < environment, and one clear error for every bad input."""

from __future__ import annotations

import dataclasses

import pytest

from fdsched.install.installer import effective_ratio_mode
from fdsched.core.settings import (
    CHANGE_IDS, HOST_FIXES, PROFILE_ENV, SCHEMA, UPSTREAM_CHANGE_IDS, SettingsError, load_settings, shipped_profiles,
)

SCHEMA_BY_KEY = {setting.key: setting for setting in SCHEMA}
CLIP = "host_tunables.FD_CLIP_MAX_NEW_TOKENS"
INIT = "host_tunables.FD_INIT_NEW_TOKEN_RATIO"
MIN = "host_tunables.FD_MIN_NEW_TOKEN_RATIO"
LEGACY_INIT_ENV = "FD_RESERVE_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL"
LEGACY_DECAY_ENV = "FD_RESERVE_DECAY_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL"
LEGACY_MIN_ENV = "FD_RESERVE_MIN_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL"


def settings_error(environ=None, profile=None) -> str:
    with pytest.raises(SettingsError) as info:
        load_settings(environ={} if environ is None else environ, profile=profile)
    return str(info.value)


# --------------------------------------------------------------------------------------------
# Defaults
# --------------------------------------------------------------------------------------------
def test_defaults_with_an_empty_environment():
    s = load_settings(environ={})
    assert s.profile is None and s.profile_path is None
    for change_id in CHANGE_IDS:
        assert s.change_mode(change_id) == "auto"
    assert s["pd_prefill_cache.mode"] == "safe"
    assert s["host_tunables.FD_USE_NEW_TOKEN_RATIO_RESERVE"] is True
    assert s[INIT] == 0.7
    assert s[MIN] == 0.1
    assert s["host_tunables.FD_NEW_TOKEN_RATIO_DECAY"] == 0.001
    assert s[CLIP] == 4096
    assert s["host_tunables." + LEGACY_INIT_ENV] == 16
    assert s["host_tunables." + LEGACY_DECAY_ENV] == 0.025
    assert s["host_tunables." + LEGACY_MIN_ENV] == 0
    assert s["tunables.ratio_reestimate_extra_blocks"] == 16
    assert s["tunables.ratio_reestimate_cap"] is None
    assert s["tunables.recycle_heapify_min_batch"] == 64
    assert s["tunables.transfer_force_direct_recycle"] is False
    assert s["replay.oracle_reserve"] is False
    assert set(s.sources.values()) == {"default"}
    assert effective_ratio_mode(s) == "auto"


def test_every_schema_default_is_what_its_own_parser_accepts():
    s = load_settings(environ={})
    assert set(s.values) == {setting.key for setting in SCHEMA}
    for setting in SCHEMA:
        assert s[setting.key] == setting.default


def test_reestimate_cap_init_means_the_initial_ratio():
    assert load_settings(environ={"FD_INIT_NEW_TOKEN_RATIO": "0.6"}).reestimate_cap == 0.6
    s = load_settings(environ={"FDSCHED_RATIO_REESTIMATE_CAP": "1.0"})
    assert s["tunables.ratio_reestimate_cap"] == 1.0 and s.reestimate_cap == 1.0
    assert load_settings(environ={"FDSCHED_RATIO_REESTIMATE_CAP": " INIT "})["tunables.ratio_reestimate_cap"] is None


def test_describe_rows_follow_schema_order():
    rows = load_settings(environ={"FDSCHED_RATIO_RESERVE": "on"}).describe()
    assert [row[0] for row in rows] == [setting.key for setting in SCHEMA]
    assert ("changes.ratio_reserve", "FDSCHED_RATIO_RESERVE", "on", "env FDSCHED_RATIO_RESERVE") in rows
    assert ("replay.oracle_reserve", "-", False, "default") in rows


def test_settings_are_frozen():
    s = load_settings(environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.profile = "recommended"
    with pytest.raises(TypeError):
        s.values[CLIP] = 1
    with pytest.raises(TypeError):
        s.sources[CLIP] = "env X"
    assert s[CLIP] == 4096


# --------------------------------------------------------------------------------------------
# Precedence and sources
# --------------------------------------------------------------------------------------------
def test_precedence_default_then_profile_then_env(write_profile):
    path = write_profile(
        """
        changes:
          ratio_reserve: "on"
          deferred_recycle: "off"
        host_tunables:
          FD_CLIP_MAX_NEW_TOKENS: 1024
        """,
        name="mine.yaml",
    )
    s = load_settings(environ={PROFILE_ENV: path, "FD_CLIP_MAX_NEW_TOKENS": "2048"})
    # env beats profile
    assert s[CLIP] == 2048
    assert s.sources[CLIP] == "env FD_CLIP_MAX_NEW_TOKENS"
    # profile beats default
    assert s.change_mode("ratio_reserve") == "on"
    assert s.sources["changes.ratio_reserve"] == "profile mine"
    assert s.change_mode("deferred_recycle") == "off"
    # untouched: default
    assert s.change_mode("decode_only_preempt") == "auto"
    assert s.sources["changes.decode_only_preempt"] == "default"
    assert s.profile == "mine"
    assert s.profile_path == path


def test_env_beats_a_shipped_profile():
    s = load_settings(environ={PROFILE_ENV: "baseline", "FDSCHED_DEFERRED_RECYCLE": "ON"})
    assert s.change_mode("deferred_recycle") == "on"
    assert s.sources["changes.deferred_recycle"] == "env FDSCHED_DEFERRED_RECYCLE"
    assert s.change_mode("decode_only_preempt") == "off"
    assert s.sources["changes.decode_only_preempt"] == "profile baseline via changes.others"


def test_profile_env_with_a_shipped_name():
    s = load_settings(environ={PROFILE_ENV: " recommended "})
    assert s.profile == "recommended"
    assert s.profile_path == str(shipped_profiles()["recommended"])
    assert s.change_mode("ratio_reserve") == "on"
    assert s.sources["changes.ratio_reserve"] == "profile recommended via changes.others"


def test_profile_env_with_a_yaml_path(write_profile):
    path = write_profile('changes:\n  decode_only_preempt: "on"\n', name="ab_side.yml")
    s = load_settings(environ={PROFILE_ENV: path})
    assert s.profile == "ab_side"
    assert s.profile_path == path
    assert s.change_mode("decode_only_preempt") == "on"
    assert s.sources["changes.decode_only_preempt"] == "profile ab_side"


def test_empty_profile_env_means_no_profile():
    s = load_settings(environ={PROFILE_ENV: "  "})
    assert s.profile is None
    assert set(s.sources.values()) == {"default"}


def test_profile_argument_overrides_profile_env():
    s = load_settings(environ={PROFILE_ENV: "baseline"}, profile="recommended")
    assert s.profile == "recommended"
    assert s.change_mode("ratio_reserve") == "on"
    # the env's profile is not read at all: even a broken one does not matter
    s = load_settings(environ={PROFILE_ENV: "nosuch"}, profile="baseline")
    assert s.profile == "baseline"


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"])
def test_an_empty_profile_file_is_an_error(write_profile, text):
    # it used to run silently as all defaults: an operator who points at the wrong (empty) file must hear of it
    message = settings_error(profile=write_profile(text, name="empty.yaml"))
    assert "empty.yaml: empty" in message and "allowed: a YAML mapping" in message


def test_profile_description_key_is_accepted(write_profile):
    s = load_settings(environ={}, profile=write_profile("description: just a note\n"))
    assert s.profile == "custom"


@pytest.mark.parametrize("word, expected", [("on", "on"), ("off", "off"), ("On", "on"), ("OFF", "off"), ("yes", "on")])
def test_yaml_bare_booleans_are_switch_words(write_profile, word, expected):
    # YAML 1.1 reads bare on/off/yes as booleans; a change switch takes them as the words meant.
    s = load_settings(environ={}, profile=write_profile(f"changes:\n  ratio_reserve: {word}\n"))
    assert s.change_mode("ratio_reserve") == expected


def test_yaml_bare_boolean_for_host_switch(write_profile):
    s = load_settings(environ={}, profile=write_profile("host_tunables:\n  FD_USE_NEW_TOKEN_RATIO_RESERVE: off\n"))
    assert s["host_tunables.FD_USE_NEW_TOKEN_RATIO_RESERVE"] is False
    assert effective_ratio_mode(s) == "off"


@pytest.mark.parametrize("raw, expected", [("0", False), ("1", True), ("true", True), ("False", False)])
def test_host_switch_from_env(raw, expected):
    s = load_settings(environ={"FD_USE_NEW_TOKEN_RATIO_RESERVE": raw})
    assert s["host_tunables.FD_USE_NEW_TOKEN_RATIO_RESERVE"] is expected


def test_numbers_from_env_are_typed():
    s = load_settings(environ={"FD_CLIP_MAX_NEW_TOKENS": " 0 ", "FD_INIT_NEW_TOKEN_RATIO": "1", "FD_MIN_NEW_TOKEN_RATIO": "0"})
    assert s[CLIP] == 0 and isinstance(s[CLIP], int)
    assert s[INIT] == 1.0 and isinstance(s[INIT], float)


# --------------------------------------------------------------------------------------------
# Bad input: profile files
# --------------------------------------------------------------------------------------------
def test_malformed_yaml_names_file_and_line(write_profile):
    path = write_profile("changes:\n  ratio_reserve: on\n  deferred_recycle: [off\n")
    msg = settings_error(profile=path)
    assert path in msg
    assert "not valid YAML" in msg
    assert "line 4" in msg


def test_top_level_must_be_a_mapping(write_profile):
    path = write_profile("- ratio_reserve\n- deferred_recycle\n")
    msg = settings_error(profile=path)
    assert path in msg
    assert "top level must be a mapping" in msg
    assert "list" in msg


def test_a_key_given_twice_is_an_error_naming_both_lines(write_profile):
    path = write_profile(
        "description: x\n"
        "changes:\n"
        "  ratio_reserve: \"on\"\n"
        "  deferred_recycle: \"off\"\n"
        "  ratio_reserve: \"off\"\n"
    )
    msg = settings_error(profile=path)
    assert msg.startswith(f"profile {path}, key changes.ratio_reserve: bad value")
    assert "line 3 and line 5" in msg and "allowed: each key once" in msg


def test_a_top_level_key_given_twice_is_an_error(write_profile):
    path = write_profile("tunables:\n  recycle_heapify_min_batch: 8\ntunables:\n  recycle_heapify_min_batch: 9\n")
    msg = settings_error(profile=path)
    assert "key tunables: bad value" in msg and "line 1 and line 3" in msg


def test_every_shipped_profile_sets_what_its_file_says_and_nothing_else():
    from fdsched.core.settings import read_profile

    for name, path in shipped_profiles().items():
        s = load_settings(environ={}, profile=name)
        written = read_profile(path)  # raises on a key given twice
        assert written, name
        others = written.pop("changes.others", None)
        for key, value in written.items():
            assert s.sources[key] == f"profile {name}", (name, key)
            assert s[key] == SCHEMA_BY_KEY[key].parse(value), (name, key)
        via_others = {f"changes.{cid}" for cid in UPSTREAM_CHANGE_IDS} - set(written) if others is not None else set()
        for key in via_others:
            assert s.sources[key] == f"profile {name} via changes.others", (name, key)
            assert s[key] == others, (name, key)
        assert {k for k, src in s.sources.items() if src.startswith("profile")} == set(written) | via_others, name


# --------------------------------------------------------------------------------------------
# changes.others: one key for every switch a profile does not name
# --------------------------------------------------------------------------------------------
def test_others_sets_only_the_switches_the_profile_does_not_name(write_profile):
    path = write_profile('changes:\n  others: "off"\n  ratio_reserve: "on"\n', name="mine.yaml")
    s = load_settings(environ={}, profile=path)
    for change_id in UPSTREAM_CHANGE_IDS:
        expected = "on" if change_id == "ratio_reserve" else "off"
        assert s.change_mode(change_id) == expected, change_id
        source = "profile mine" if change_id == "ratio_reserve" else "profile mine via changes.others"
        assert s.sources[f"changes.{change_id}"] == source, change_id
    assert "changes.others" not in s.values  # not a setting: it only fills the switches


@pytest.mark.parametrize("raw, expected", [('"auto"', "auto"), ("on", "on"), ("off", "off"), ('" ON "', "on")])
def test_others_takes_the_values_of_a_switch(write_profile, raw, expected):
    path = write_profile(f"changes:\n  others: {raw}\n")
    s = load_settings(environ={}, profile=path)
    assert {s.change_mode(change_id) for change_id in UPSTREAM_CHANGE_IDS} == {expected}
    assert {s.change_mode(fix) for fix in HOST_FIXES} == {"auto"}  # a host fix is not "every other change"


@pytest.mark.parametrize("raw", ['"maybe"', "1", "null", "[on]"])
def test_others_with_a_bad_value_is_one_error_naming_the_key(write_profile, raw):
    path = write_profile(f"changes:\n  ratio_reserve: \"on\"\n  others: {raw}\n")
    msg = settings_error(profile=path)
    assert msg.startswith(f"profile {path}, key changes.others: bad value ")
    assert msg.endswith("; allowed: one of auto, on, off")
    assert "\n" not in msg


def test_an_environment_variable_beats_others(write_profile):
    path = write_profile('changes:\n  others: "on"\n', name="mine.yaml")
    s = load_settings(environ={"FDSCHED_RATIO_RESERVE": "off"}, profile=path)
    assert s.change_mode("ratio_reserve") == "off"
    assert s.sources["changes.ratio_reserve"] == "env FDSCHED_RATIO_RESERVE"
    assert s.change_mode("deferred_recycle") == "on"


def test_a_contradiction_with_a_switch_set_by_others_names_both_keys():
    msg = settings_error(environ={"FDSCHED_RESERVE_ESTIMATOR": "adaptive"}, profile="baseline")
    assert "key changes.ratio_reserve (from changes.others)='off'" in msg


def test_others_is_a_key_of_changes_only(write_profile):
    path = write_profile("tunables:\n  others: 1\n")
    msg = settings_error(profile=path)
    assert "key tunables.others: unknown key" in msg and "others" not in msg.split("allowed under tunables:")[1]


def test_unknown_top_level_key(write_profile):
    path = write_profile("change:\n  ratio_reserve: on\n")
    msg = settings_error(profile=path)
    assert path in msg
    assert "key change: unknown key" in msg
    assert "allowed top-level keys" in msg
    for allowed in ("changes", "host_tunables", "tunables", "replay", "pd_prefill_cache", "description"):
        assert allowed in msg


def test_unknown_nested_key(write_profile):
    path = write_profile("changes:\n  ratio_reserv: on\n")
    msg = settings_error(profile=path)
    assert path in msg
    assert "changes.ratio_reserv" in msg
    assert "allowed under changes" in msg
    for change_id in (*CHANGE_IDS, "others"):
        assert change_id in msg


def test_section_that_is_not_a_mapping(write_profile):
    path = write_profile("host_tunables: 3\n")
    msg = settings_error(profile=path)
    assert path in msg and "host_tunables" in msg and "3" in msg and "a mapping of settings" in msg


def test_description_must_be_a_string(write_profile):
    path = write_profile("description: [1, 2]\n")
    msg = settings_error(profile=path)
    assert path in msg and "description" in msg and "[1, 2]" in msg and "a string" in msg


def test_string_for_an_integer_in_yaml(write_profile):
    path = write_profile("host_tunables:\n  FD_CLIP_MAX_NEW_TOKENS: lots\n")
    msg = settings_error(profile=path)
    assert path in msg
    assert "host_tunables.FD_CLIP_MAX_NEW_TOKENS" in msg
    assert "'lots'" in msg
    assert "an integer >= 0" in msg


def test_bool_for_an_integer_in_yaml(write_profile):
    path = write_profile("tunables:\n  ratio_reestimate_extra_blocks: true\n")
    msg = settings_error(profile=path)
    assert path in msg
    assert "tunables.ratio_reestimate_extra_blocks" in msg
    assert "True" in msg
    assert "an integer >= 0" in msg


def test_float_for_an_integer_in_yaml(write_profile):
    path = write_profile("host_tunables:\n  FD_CLIP_MAX_NEW_TOKENS: 10.5\n")
    msg = settings_error(profile=path)
    assert "host_tunables.FD_CLIP_MAX_NEW_TOKENS" in msg and "10.5" in msg and "an integer" in msg


def test_bool_for_a_number_in_yaml(write_profile):
    path = write_profile("host_tunables:\n  FD_INIT_NEW_TOKEN_RATIO: true\n")
    msg = settings_error(profile=path)
    assert "host_tunables.FD_INIT_NEW_TOKEN_RATIO" in msg and "True" in msg and "a number in [0.0, 1.0]" in msg


def test_ratio_out_of_range_in_yaml(write_profile):
    path = write_profile("host_tunables:\n  FD_INIT_NEW_TOKEN_RATIO: 1.5\n")
    msg = settings_error(profile=path)
    assert path in msg
    assert "host_tunables.FD_INIT_NEW_TOKEN_RATIO" in msg
    assert "1.5" in msg
    assert "a number in [0.0, 1.0]" in msg


def test_bad_switch_word_in_yaml(write_profile):
    path = write_profile("changes:\n  deferred_recycle: sometimes\n")
    msg = settings_error(profile=path)
    assert path in msg and "changes.deferred_recycle" in msg and "'sometimes'" in msg
    assert "one of auto, on, off" in msg


def test_bad_pd_mode_in_yaml(write_profile):
    path = write_profile("pd_prefill_cache:\n  mode: fast\n")
    msg = settings_error(profile=path)
    assert path in msg and "pd_prefill_cache.mode" in msg and "'fast'" in msg and "one of safe, upstream" in msg


def test_min_ratio_above_init_in_yaml(write_profile):
    path = write_profile("host_tunables:\n  FD_MIN_NEW_TOKEN_RATIO: 0.9\n", name="ratios.yaml")
    msg = settings_error(profile=path)
    assert "ratios.yaml, key host_tunables.FD_MIN_NEW_TOKEN_RATIO: bad value 0.9" in msg
    assert "host_tunables.FD_MIN_NEW_TOKEN_RATIO" in msg
    assert "0.9" in msg
    assert "not above 0.7 (FD_INIT_NEW_TOKEN_RATIO" in msg


def test_min_ratio_above_init_in_yaml_names_the_file(write_profile):
    path = write_profile("host_tunables:\n  FD_MIN_NEW_TOKEN_RATIO: 0.9\n", name="ratios.yaml")
    assert path in settings_error(profile=path)


# --------------------------------------------------------------------------------------------
# Bad input: profile selection
# --------------------------------------------------------------------------------------------
def test_unknown_profile_name_lists_the_shipped_ones():
    msg = settings_error(environ={PROFILE_ENV: "recomended"})
    assert PROFILE_ENV in msg
    assert "'recomended'" in msg
    assert "unknown profile" in msg
    for name in shipped_profiles():
        assert name in msg
    assert "path of a YAML file" in msg


def test_unknown_profile_name_through_the_argument():
    msg = settings_error(profile="nosuch")
    assert "'nosuch'" in msg and "recommended" in msg and "baseline" in msg


def test_missing_profile_path(tmp_path):
    missing = str(tmp_path / "absent.yaml")
    msg = settings_error(environ={PROFILE_ENV: missing})
    assert PROFILE_ENV in msg
    assert missing in msg
    assert "no such profile file" in msg
    assert "recommended" in msg  # what is allowed: the shipped names ...
    assert "path of a YAML file" in msg  # ... or a path


# --------------------------------------------------------------------------------------------
# Bad input: environment
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "var, raw, allowed",
    [
        ("FDSCHED_RATIO_RESERVE", "maybe", "one of auto, on, off"),
        ("FDSCHED_DEFERRED_RECYCLE", "1", "one of auto, on, off"),
        ("FDSCHED_PD_PREFILL_CACHE_MODE", "fast", "one of safe, upstream"),
        ("FDSCHED_RATIO_REESTIMATE_CAP", "2", "'init' or a number in [0, 1]"),
        ("FDSCHED_RATIO_REESTIMATE_CAP", "ceiling", "'init' or a number in [0, 1]"),
        ("FD_CLIP_MAX_NEW_TOKENS", "lots", "an integer >= 0"),
        ("FD_CLIP_MAX_NEW_TOKENS", "-1", "an integer >= 0"),
        ("FD_CLIP_MAX_NEW_TOKENS", "1.5", "an integer >= 0"),
        ("FD_INIT_NEW_TOKEN_RATIO", "1.5", "a number in [0.0, 1.0]"),
        ("FD_MIN_NEW_TOKEN_RATIO", "-0.1", "a number in [0.0, 1.0]"),
        ("FD_NEW_TOKEN_RATIO_DECAY", "nan", "a number in [0.0, 1.0]"),
        (LEGACY_DECAY_ENV, "-1", "a number >= 0.0"),
        (LEGACY_INIT_ENV, "-3", "an integer >= 0"),
        ("FDSCHED_RECYCLE_HEAPIFY_MIN_BATCH", "0", "an integer >= 1"),
        ("FD_USE_NEW_TOKEN_RATIO_RESERVE", "yes", "0 or 1"),
        ("FDSCHED_TRANSFER_FORCE_DIRECT_RECYCLE", "2", "0 or 1"),
    ],
)
def test_bad_env_value_names_variable_value_and_allowed(var, raw, allowed):
    msg = settings_error(environ={var: raw})
    assert f"environment variable {var}: bad value {raw!r}; allowed: " in msg
    assert "allowed: " + allowed in msg


def test_min_ratio_above_init_from_env():
    msg = settings_error(environ={"FD_MIN_NEW_TOKEN_RATIO": "0.8"})
    assert "environment variable FD_MIN_NEW_TOKEN_RATIO" in msg
    assert "0.8" in msg
    assert "not above 0.7 (FD_INIT_NEW_TOKEN_RATIO" in msg


def test_init_ratio_below_default_min_from_env_still_names_the_variable():
    msg = settings_error(environ={"FD_INIT_NEW_TOKEN_RATIO": "0.05"})
    assert "environment variable FD_INIT_NEW_TOKEN_RATIO" in msg
    assert "0.05" in msg


def test_init_ratio_below_default_min_names_the_set_variable_first():
    msg = settings_error(environ={"FD_INIT_NEW_TOKEN_RATIO": "0.05"})
    assert msg.startswith("environment variable FD_INIT_NEW_TOKEN_RATIO: bad value 0.05")


def test_equal_min_and_init_ratio_are_fine():
    s = load_settings(environ={"FD_MIN_NEW_TOKEN_RATIO": "0.7"})
    assert s[MIN] == s[INIT] == 0.7


def test_fixed_block_min_above_its_init():
    msg = settings_error(environ={LEGACY_INIT_ENV: "2", LEGACY_MIN_ENV: "3"})
    assert f"environment variable {LEGACY_MIN_ENV}" in msg
    assert "bad value 3" in msg
    assert "not above 2" in msg
    assert LEGACY_INIT_ENV in msg


def test_fixed_block_min_equal_to_init_is_fine():
    s = load_settings(environ={LEGACY_INIT_ENV: "4", LEGACY_MIN_ENV: "4"})
    assert s["host_tunables." + LEGACY_MIN_ENV] == 4


# --------------------------------------------------------------------------------------------
# The ratio switch and the host's own switch
# --------------------------------------------------------------------------------------------
def test_ratio_on_contradicts_host_switch_zero():
    msg = settings_error(environ={"FDSCHED_RATIO_RESERVE": "on", "FD_USE_NEW_TOKEN_RATIO_RESERVE": "0"})
    assert "environment variable FD_USE_NEW_TOKEN_RATIO_RESERVE" in msg
    assert "bad value 0" in msg
    assert "contradicts" in msg and "FDSCHED_RATIO_RESERVE" in msg and "'on'" in msg
    assert "allowed: leave it unset, or 1" in msg


def test_ratio_off_contradicts_host_switch_one():
    msg = settings_error(environ={"FDSCHED_RATIO_RESERVE": "off", "FD_USE_NEW_TOKEN_RATIO_RESERVE": "1"})
    assert "environment variable FD_USE_NEW_TOKEN_RATIO_RESERVE" in msg
    assert "bad value 1" in msg
    assert "FDSCHED_RATIO_RESERVE" in msg and "'off'" in msg
    assert "allowed: leave it unset, or 0" in msg


def test_profile_ratio_on_contradicts_host_switch_zero_from_env():
    msg = settings_error(environ={PROFILE_ENV: "recommended", "FD_USE_NEW_TOKEN_RATIO_RESERVE": "0"})
    assert "FD_USE_NEW_TOKEN_RATIO_RESERVE" in msg and "recommended.yaml, key changes.ratio_reserve" in msg


@pytest.mark.parametrize("mode, host, expected", [("on", "1", "on"), ("off", "0", "off"), ("auto", "1", "auto")])
def test_agreeing_switches_are_fine(mode, host, expected):
    s = load_settings(environ={"FDSCHED_RATIO_RESERVE": mode, "FD_USE_NEW_TOKEN_RATIO_RESERVE": host})
    assert effective_ratio_mode(s) == expected


def test_auto_with_host_switch_zero_means_off():
    s = load_settings(environ={"FDSCHED_RATIO_RESERVE": "auto", "FD_USE_NEW_TOKEN_RATIO_RESERVE": "0"})
    assert s.change_mode("ratio_reserve") == "auto"
    assert effective_ratio_mode(s) == "off"
    # the host switch alone (ours left at its default auto) does the same
    assert effective_ratio_mode(load_settings(environ={"FD_USE_NEW_TOKEN_RATIO_RESERVE": "0"})) == "off"


def test_reserve_estimator_choices_and_adaptive_tunables():
    s = load_settings(environ={"FDSCHED_RESERVE_ESTIMATOR": "Adaptive", "FDSCHED_ADAPTIVE_MIN_SAMPLES": "8"})
    assert s["tunables.reserve_estimator"] == "adaptive" and s["tunables.adaptive_min_samples"] == 8
    with pytest.raises(SettingsError, match=r"FDSCHED_RESERVE_ESTIMATOR: bad value 'sglang'.*ratio, adaptive"):
        load_settings(environ={"FDSCHED_RESERVE_ESTIMATOR": "sglang"})
    with pytest.raises(SettingsError, match=r"FDSCHED_ADAPTIVE_MARGIN_K: bad value '7'.*\[-6.0, 6.0\]"):
        load_settings(environ={"FDSCHED_ADAPTIVE_MARGIN_K": "7"})


def test_adaptive_estimator_contradicts_ratio_reserve_off():
    with pytest.raises(SettingsError, match=r"FDSCHED_RESERVE_ESTIMATOR: bad value 'adaptive'.*ratio_reserve.*'off'"):
        load_settings(environ={"FDSCHED_RESERVE_ESTIMATOR": "adaptive"}, profile="baseline")
    with pytest.raises(SettingsError, match=r"FD_USE_NEW_TOKEN_RATIO_RESERVE=0"):
        load_settings(environ={"FDSCHED_RESERVE_ESTIMATOR": "adaptive", "FD_USE_NEW_TOKEN_RATIO_RESERVE": "0"})
    assert load_settings(environ={}, profile="adaptive")["tunables.reserve_estimator"] == "adaptive"

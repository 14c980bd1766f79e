"""Honest A/B arms: an arm is exactly its profile unless asked, and says what touched it. No host."""

from __future__ import annotations

import os

from fdsched.replay.runner import arm_settings, auto_check_every, host_environment, other_host_env


def test_an_arm_is_exactly_its_profile_by_default():
    env = {"FDSCHED_RATIO_RESERVE": "off", "FD_INIT_NEW_TOKEN_RATIO": "0.3", "PATH": "/bin"}
    settings, applied, ignored = arm_settings("recommended", inherit_env=False, environ=env)
    assert settings.change_mode("ratio_reserve") == "on"
    assert settings["host_tunables.FD_INIT_NEW_TOKEN_RATIO"] == 0.7
    assert applied == {} and ignored == {"FDSCHED_RATIO_RESERVE": "off", "FD_INIT_NEW_TOKEN_RATIO": "0.3"}


def test_inherit_env_applies_the_variables_and_says_so():
    env = {"FDSCHED_RATIO_RESERVE": "off", "FD_INIT_NEW_TOKEN_RATIO": "0.3", "FDSCHED_PROFILE": "baseline"}
    settings, applied, ignored = arm_settings("recommended", inherit_env=True, environ=env)
    assert settings.change_mode("ratio_reserve") == "off" and settings["host_tunables.FD_INIT_NEW_TOKEN_RATIO"] == 0.3
    assert applied == {"FDSCHED_RATIO_RESERVE": "off", "FD_INIT_NEW_TOKEN_RATIO": "0.3"}
    assert ignored == {"FDSCHED_PROFILE": "baseline"}  # the arm's profile wins over FDSCHED_PROFILE


def test_host_variables_hold_the_arms_values_while_it_runs(monkeypatch):
    monkeypatch.setenv("FD_USE_NEW_TOKEN_RATIO_RESERVE", "0")
    monkeypatch.setenv("FDSCHED_RATIO_RESERVE", "off")
    settings, _, _ = arm_settings("recommended", inherit_env=False, environ={})
    with host_environment(settings):
        assert os.environ["FD_USE_NEW_TOKEN_RATIO_RESERVE"] == "1"
        assert os.environ["FD_INIT_NEW_TOKEN_RATIO"] == "0.7"
        assert "FDSCHED_RATIO_RESERVE" not in os.environ
    assert os.environ["FD_USE_NEW_TOKEN_RATIO_RESERVE"] == "0" and os.environ["FDSCHED_RATIO_RESERVE"] == "off"
    assert "FD_INIT_NEW_TOKEN_RATIO" not in os.environ


def test_other_host_variables_are_reported():
    env = {"FD_DISABLE_CHUNKED_PREFILL": "1", "FD_INIT_NEW_TOKEN_RATIO": "0.3", "FD_LOG_DIR": "/tmp", "HOME": "/"}
    assert other_host_env(env) == {"FD_DISABLE_CHUNKED_PREFILL": "1"}


def test_invariant_cadence():
    assert auto_check_every(48) == 1 and auto_check_every(20000) == 32

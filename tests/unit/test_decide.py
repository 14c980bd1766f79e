"""fdsched.install.installer.decide: switch x what the host has x whether the plugin can patch it."""

from __future__ import annotations

import types

import pytest

from fdsched.install.installer import Decision, InstallError, decide
from fdsched.core.settings import CHANGE_IDS, HOST_FIXES, load_settings

LABEL = "FastDeploy 9.9 at /nowhere"
PROBLEM = "Thing.method is missing"
# pd_prefill_cache depends on its mode and is tested on its own below.
PLAIN_CHANGES = [c for c in CHANGE_IDS if c != "pd_prefill_cache"]


def host(has=(), problems=None):
    return types.SimpleNamespace(has={c: True for c in has}, problems=dict(problems or {}), label=LABEL)


def settings(**env):
    return load_settings(environ={k: str(v) for k, v in env.items()})


def switch(change_id, mode, **env):
    return settings(**{f"FDSCHED_{change_id.upper()}": mode}, **env)


# (mode, host has it, problem) -> (impl, state), or InstallError
MATRIX = [
    ("auto", False, False, ("plugin", "applied")),
    ("auto", False, True, ("host", "skipped")),
    ("auto", True, False, ("host", "host")),
    ("auto", True, True, ("host", "host")),
    ("on", False, False, ("plugin", "applied")),
    ("on", False, True, InstallError),
    ("on", True, False, ("plugin", "applied")),
    ("on", True, True, InstallError),
    ("off", False, False, ("host", "off")),
    ("off", False, True, ("host", "off")),
    ("off", True, False, ("off", "off")),
    ("off", True, True, InstallError),
]


@pytest.mark.parametrize("change_id", PLAIN_CHANGES)
@pytest.mark.parametrize("mode, has, problem, expected", MATRIX)
def test_decision_matrix(change_id, mode, has, problem, expected):
    info = host(has=[change_id] if has else [], problems={change_id: PROBLEM} if problem else {})
    s = switch(change_id, mode)
    if expected is InstallError:
        with pytest.raises(InstallError):
            decide(s, info)
        return
    d = decide(s, info)[change_id]
    assert (d.impl, d.state) == expected
    assert d.mode == mode
    assert d.change_id == change_id


def test_decisions_cover_every_change_in_order():
    decisions = decide(settings(), host())
    assert list(decisions) == list(CHANGE_IDS)
    assert all(isinstance(d, Decision) for d in decisions.values())
    assert {(d.impl, d.state) for d in decisions.values()} == {("plugin", "applied")}


def test_detail_lines():
    info = host(has=["decode_only_preempt"], problems={"deferred_recycle": PROBLEM})
    decisions = decide(settings(FDSCHED_RATIO_RESERVE="on", FDSCHED_NONPOLLING_TRANSFER="off"), info)
    assert decisions["deferred_recycle"].detail == f"skipped because {PROBLEM}"
    assert decisions["decode_only_preempt"].detail == "host already has it"
    assert decisions["ratio_reserve"].detail == "applied"
    assert decisions["nonpolling_transfer"].detail == "off (host's own pre-change code)"
    assert decisions["deferred_recycle"].line() == f"deferred_recycle=skipped because {PROBLEM}"


def test_on_over_a_host_that_has_it_says_so():
    d = decide(switch("decode_only_preempt", "on"), host(has=["decode_only_preempt"]))["decode_only_preempt"]
    assert d.detail == "applied (plugin's version over the host's)"


def test_off_on_a_host_that_has_it_restores_the_old_code():
    d = decide(switch("decode_only_preempt", "off"), host(has=["decode_only_preempt"]))["decode_only_preempt"]
    assert d.detail == "off (plugin restores the pre-change code)"


def test_on_with_a_problem_names_change_host_problem_and_allowed():
    with pytest.raises(InstallError) as info:
        decide(switch("ratio_reserve", "on"), host(problems={"ratio_reserve": PROBLEM}))
    msg = str(info.value)
    assert "changes.ratio_reserve=on" in msg
    assert "FDSCHED_RATIO_RESERVE" in msg
    assert LABEL in msg
    assert PROBLEM in msg
    assert "allowed: auto" in msg and "or off" in msg


def test_off_on_a_host_that_has_it_with_a_problem_names_what_is_allowed():
    info = host(has=["decode_only_preempt"], problems={"decode_only_preempt": PROBLEM})
    with pytest.raises(InstallError) as raised:
        decide(switch("decode_only_preempt", "off"), info)
    msg = str(raised.value)
    assert "changes.decode_only_preempt=off" in msg
    assert "FDSCHED_DECODE_ONLY_PREEMPT" in msg
    assert LABEL in msg and PROBLEM in msg
    assert "allowed: auto or on" in msg


def test_a_problem_in_another_change_does_not_matter():
    info = host(problems={"deferred_recycle": PROBLEM})
    d = decide(switch("decode_only_preempt", "on"), info)
    assert (d["decode_only_preempt"].impl, d["decode_only_preempt"].state) == ("plugin", "applied")
    assert d["deferred_recycle"].state == "skipped"


# --------------------------------------------------------------------------------------------
# ratio_reserve and the host's own switch
# --------------------------------------------------------------------------------------------
def test_auto_with_host_switch_zero_decides_as_off():
    s = settings(FDSCHED_RATIO_RESERVE="auto", FD_USE_NEW_TOKEN_RATIO_RESERVE="0")
    on_new_host = decide(s, host(has=["ratio_reserve"]))["ratio_reserve"]
    assert (on_new_host.mode, on_new_host.impl, on_new_host.state) == ("off", "off", "off")
    on_old_host = decide(s, host())["ratio_reserve"]
    assert (on_old_host.mode, on_old_host.impl, on_old_host.state) == ("off", "host", "off")


def test_auto_with_host_switch_one_stays_auto():
    s = settings(FD_USE_NEW_TOKEN_RATIO_RESERVE="1")
    d = decide(s, host())["ratio_reserve"]
    assert (d.mode, d.impl, d.state) == ("auto", "plugin", "applied")


# --------------------------------------------------------------------------------------------
# pd_prefill_cache: the host "has" it only in the upstream flavour
# --------------------------------------------------------------------------------------------
def test_pd_auto_safe_on_a_host_with_upstream_applies_the_plugin():
    d = decide(settings(FDSCHED_PD_PREFILL_CACHE_MODE="safe"), host(has=["pd_prefill_cache"]))["pd_prefill_cache"]
    assert (d.impl, d.state) == ("plugin", "applied")


def test_pd_auto_upstream_on_a_host_with_upstream_is_the_host():
    d = decide(settings(FDSCHED_PD_PREFILL_CACHE_MODE="upstream"), host(has=["pd_prefill_cache"]))["pd_prefill_cache"]
    assert (d.impl, d.state) == ("host", "host")


def test_pd_auto_upstream_on_a_host_without_it_applies_the_plugin():
    d = decide(settings(FDSCHED_PD_PREFILL_CACHE_MODE="upstream"), host())["pd_prefill_cache"]
    assert (d.impl, d.state) == ("plugin", "applied")


@pytest.mark.parametrize("mode", ["safe", "upstream"])
def test_pd_off_on_a_host_with_upstream_restores_the_old_code(mode):
    s = settings(FDSCHED_PD_PREFILL_CACHE="off", FDSCHED_PD_PREFILL_CACHE_MODE=mode)
    d = decide(s, host(has=["pd_prefill_cache"]))["pd_prefill_cache"]
    assert (d.impl, d.state) == ("off", "off")


def test_pd_on_safe_over_upstream_host_is_plain_applied():
    s = settings(FDSCHED_PD_PREFILL_CACHE="on")
    d = decide(s, host(has=["pd_prefill_cache"]))["pd_prefill_cache"]
    assert (d.impl, d.state, d.detail) == ("plugin", "applied", "applied")


def test_decide_uses_the_profile():
    s = load_settings(environ={}, profile="baseline")
    decisions = decide(s, host())
    assert {(d.mode, d.impl, d.state) for cid, d in decisions.items() if cid not in HOST_FIXES} == {("off", "host", "off")}
    # baseline is the pre-change policy, not the host's defects: each host fix applies where the host has the defect
    assert {(d.mode, d.impl, d.state) for cid, d in decisions.items() if cid in HOST_FIXES} == {("auto", "plugin", "applied")}


# ---- "Relies on:" assumptions probed at install -----------------------------------------------------------------
def _reliance_host(change_id, reliance, has=False):
    info = host(has=[change_id] if has else [])
    info.reliance_problems = {change_id: {reliance: "ResourceManagerV1.schedule no longer uses waiting"}}
    return info


def test_a_failed_reliance_makes_on_an_error_that_names_it():
    with pytest.raises(InstallError, match=r"relies on running-chunk-check .*no longer uses waiting"):
        decide(switch("ratio_reserve", "on"), _reliance_host("ratio_reserve", "running-chunk-check"))


def test_a_failed_reliance_makes_auto_skip_with_the_reason():
    d = decide(switch("ratio_reserve", "auto"), _reliance_host("ratio_reserve", "running-chunk-check"))["ratio_reserve"]
    assert (d.impl, d.state) == ("host", "skipped")
    assert "relies on running-chunk-check" in d.detail


def test_a_reliance_of_the_off_path_only_stops_off():
    # pass-end matters only where the plugin restores the pre-change code (off on a host that has the change).
    info = _reliance_host("ratio_reserve", "pass-end", has=True)
    assert decide(switch("ratio_reserve", "on"), info)["ratio_reserve"].impl == "plugin"
    with pytest.raises(InstallError, match="relies on pass-end"):
        decide(switch("ratio_reserve", "off"), info)

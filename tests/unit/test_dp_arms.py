"""Online A/B arms (``FDSCHED_PROFILE_BY_DP_RANK``): parsing, loading, deciding, labels. Plain objects, no host."""

from __future__ import annotations

import types

import pytest

from fdsched.install.installer import InstallError, decide_arms
from fdsched.core.metrics import PluginMetrics, labels_of, request_latencies
from fdsched.patches._base import dp_rank_of, init_signature
from fdsched.core.settings import DP_PROFILE_ENV, SettingsError, load_arm_settings, load_settings, parse_dp_arms

WHERE = f"environment variable {DP_PROFILE_ENV}"


# ---- parsing ---------------------------------------------------------------------------------------------
def test_parse_ranks_and_profiles():
    assert parse_dp_arms("0=baseline,1=recommended") == {0: "baseline", 1: "recommended"}
    assert parse_dp_arms(" 3 = /etc/arm b.yaml , 0=baseline") == {3: "/etc/arm b.yaml", 0: "baseline"}
    assert parse_dp_arms("") == {} and parse_dp_arms("  ") == {} and parse_dp_arms(None) == {}


@pytest.mark.parametrize(
    "raw, why",
    [
        ("0=baseline,", "(an empty item)"),
        ("0=baseline,,1=recommended", "(an empty item)"),
        ("baseline", "(no profile after RANK=)"),
        ("0=", "(no profile after RANK=)"),
        ("x=baseline", "(rank 'x')"),
        ("-1=baseline", "(rank '-1')"),
        ("1.5=baseline", "(rank '1.5')"),
        ("1024=baseline", "(rank '1024')"),
        ("=baseline", "(rank '')"),
        ("0=baseline,0=recommended", "(rank 0 is given twice: baseline and recommended)"),
    ],
)
def test_every_bad_mapping_gets_its_error(raw, why):
    with pytest.raises(SettingsError) as err:
        parse_dp_arms(raw)
    message = str(err.value)
    assert message.startswith(f"{WHERE}: bad value ")
    assert why in message
    assert "; allowed: a comma list of RANK=PROFILE" in message


# ---- loading ---------------------------------------------------------------------------------------------
def test_each_arm_is_its_profile_and_other_ranks_are_not_listed():
    arms = load_arm_settings({DP_PROFILE_ENV: "0=baseline,1=recommended"})
    assert sorted(arms) == [0, 1]
    assert arms[0].profile == "baseline" and arms[0].change_mode("decode_only_preempt") == "off"
    assert arms[1].profile == "recommended" and arms[1] == load_settings({}, profile="recommended")
    assert load_arm_settings({}) == {}


def test_an_unknown_profile_names_rank_and_profile():
    with pytest.raises(SettingsError) as err:
        load_arm_settings({DP_PROFILE_ENV: "0=baseline,1=nosuch"})
    assert str(err.value).startswith(f"{WHERE}, rank 1: bad value 'nosuch' (unknown profile); allowed: ")
    assert "baseline" in str(err.value)


def test_a_missing_profile_file_names_rank_and_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SettingsError, match=rf"{WHERE}, rank 2: bad value '{missing}' \(no such profile file\)"):
        load_arm_settings({DP_PROFILE_ENV: f"2={missing}"})


def test_an_error_inside_a_profile_names_rank_profile_and_key(tmp_path):
    arm = tmp_path / "arm.yaml"
    arm.write_text("changes: {ratio_reserve: sometimes}\n")
    with pytest.raises(SettingsError) as err:
        load_arm_settings({DP_PROFILE_ENV: f"0=baseline,1={arm}"})
    message = str(err.value)
    assert message.startswith(f"{WHERE}, rank 1 (profile {arm}): profile {arm}, key changes.ratio_reserve: bad value")
    assert "allowed: one of auto, on, off" in message


def test_environment_variables_override_every_arm_and_contradictions_name_the_arm():
    # One precedence rule: a variable overrides each arm's profile as it overrides FDSCHED_PROFILE.
    arms = load_arm_settings({DP_PROFILE_ENV: "0=baseline,1=recommended", "FD_CLIP_MAX_NEW_TOKENS": "128"})
    assert arms[0]["host_tunables.FD_CLIP_MAX_NEW_TOKENS"] == arms[1]["host_tunables.FD_CLIP_MAX_NEW_TOKENS"] == 128
    with pytest.raises(SettingsError) as err:  # the host's switch at 1 contradicts baseline's ratio_reserve=off
        load_arm_settings({DP_PROFILE_ENV: "0=baseline,1=recommended", "FD_USE_NEW_TOKEN_RATIO_RESERVE": "1"})
    assert str(err.value).startswith(f"{WHERE}, rank 0 (profile baseline): environment variable FD_USE_NEW_TOKEN")


# ---- deciding against the host ---------------------------------------------------------------------------
def _host():
    return types.SimpleNamespace(has={}, problems={}, label="FastDeploy 9.9 at /nowhere")


def test_every_arm_is_decided_and_labelled_by_its_profile():
    arms = decide_arms({1: load_settings({}, profile="recommended"), 0: load_settings({}, profile="baseline")}, _host())
    assert list(arms) == [0, 1]
    assert arms[0].label == "baseline" and arms[1].label == "recommended"
    assert arms[0].impl["decode_only_preempt"] == "host" and arms[1].impl["decode_only_preempt"] == "plugin"


def test_an_arm_the_host_cannot_take_names_rank_and_profile():
    problem_host = types.SimpleNamespace(
        has={}, problems={"ratio_reserve": "ResourceManagerV1.schedule is missing"}, label="FastDeploy 9.9"
    )
    with pytest.raises(InstallError) as err:
        decide_arms({0: load_settings({}, profile="baseline"), 1: load_settings({}, profile="recommended")}, problem_host)
    message = str(err.value)
    assert message.startswith(f"{WHERE}, rank 1 (profile recommended): changes.ratio_reserve=on")
    assert "allowed:" in message


# ---- the rank of a constructor call ----------------------------------------------------------------------
class _Host:
    def __init__(self, max_num_seqs, config, tensor_parallel_size, splitwise_role, local_data_parallel_id=0):
        pass


def _config(rank):
    return types.SimpleNamespace(parallel_config=types.SimpleNamespace(local_data_parallel_id=rank, data_parallel_rank=0))


def test_rank_from_the_argument_then_the_config_never_data_parallel_rank():
    sig = init_signature(_Host)
    assert dp_rank_of(sig, (8, _config(5), 1, "mixed", 3), {}) == 3  # the engine passes it positionally
    assert dp_rank_of(sig, (8, _config(5), 1, "mixed"), {"local_data_parallel_id": 2}) == 2
    assert dp_rank_of(sig, (8, _config(5), 1, "mixed"), {}) == 5  # not passed: the config's
    assert dp_rank_of(sig, (), {"max_num_seqs": 8, "config": object(), "tensor_parallel_size": 1,
                                "splitwise_role": "mixed"}) == 0
    assert dp_rank_of(sig, ("too", "many", "args", 1, 2, 3, 4), {}) == 0  # unbindable: rank 0
    assert dp_rank_of(None, (), {}) == 0


# ---- labels and outcomes ---------------------------------------------------------------------------------
def test_labels_of_an_instance_its_class_default_or_nothing():
    arm = types.SimpleNamespace(label="recommended")
    assert labels_of(types.SimpleNamespace(_fdsched_arm="baseline", _fdsched_dp_rank=0)) == {
        "arm": "baseline", "dp_rank": "0"}
    assert labels_of(types.SimpleNamespace(_fdsched_default_arm=arm)) == {"arm": "recommended", "dp_rank": ""}
    assert labels_of(None) == {"arm": "default", "dp_rank": ""}


def test_request_latencies_from_the_requests_stamps():
    assert request_latencies(10.0, 10.5, 12.5, 5) == (0.5, 0.5)
    assert request_latencies(10.0, 10.5, 10.5, 1) == (0.5, None)  # one token: no TPOT
    assert request_latencies(None, 10.5, 12.5, 5) == (None, 0.5)
    assert request_latencies(11.0, 10.5, None, 5) == (None, None)  # stamps from different clocks: nothing
    assert request_latencies(10.0, None, None, 0) == (None, None)


def test_plain_counters_keep_totals_and_split_by_arm():
    m = PluginMetrics()
    a = types.SimpleNamespace(_fdsched_arm="baseline", _fdsched_dp_rank=0)
    b = types.SimpleNamespace(_fdsched_arm="recommended", _fdsched_dp_rank=1)
    m.preempted("prefill", of=a, recomputed_tokens=40)
    m.preempted("decode", of=b, recomputed_tokens=9)
    m.admission_blocked(of=b)
    request = types.SimpleNamespace(
        output_token_ids=[1, 2, 3], metrics=types.SimpleNamespace(
            arrival_time=1.0, engine_recv_first_token_time=1.25, engine_recv_latest_token_time=1.45)
    )
    m.request_finished(request, of=b)
    assert m.preemptions == {"prefill": 1, "decode": 1} and m.recomputed_tokens == 49
    assert m.arm("baseline", 0) == {"preemptions_prefill": 1, "recomputed_tokens": 40}
    assert m.arm("recommended", "1")["requests_finished"] == 1 and m.arm("recommended", 1)["output_tokens"] == 3
    assert m.arm("recommended", 1)["admissions_blocked"] == 1 and m.admissions_blocked == 1
    (ttft, tpot), = m.latencies[("recommended", "1")]
    assert ttft == pytest.approx(0.25) and tpot == pytest.approx(0.1)
    assert m.arm("nosuch") == {}


def test_each_labelled_series_is_made_once_and_every_update_reaches_the_registry():
    prometheus_client = pytest.importorskip("prometheus_client")
    m = PluginMetrics()
    a = types.SimpleNamespace(_fdsched_arm="series-a", _fdsched_dp_rank=3)
    b = types.SimpleNamespace(_fdsched_arm="series-b", _fdsched_dp_rank=3)
    made = []
    real = prometheus_client.Gauge.labels

    def counting(self, *args, **kwargs):
        made.append((self._name, kwargs.get("arm")))
        return real(self, *args, **kwargs)

    prometheus_client.Gauge.labels = counting
    try:
        for value in (0.7, 0.5, 0.25):
            m.ratio(value, of=a)
        m.ratio(0.9, of=b)
    finally:
        prometheus_client.Gauge.labels = real
    assert made == [("fastdeploy:fdsched_new_token_ratio", "series-a"), ("fastdeploy:fdsched_new_token_ratio", "series-b")]
    sample = prometheus_client.REGISTRY.get_sample_value
    assert sample("fastdeploy:fdsched_new_token_ratio", {"arm": "series-a", "dp_rank": "3"}) == 0.25
    assert sample("fastdeploy:fdsched_new_token_ratio", {"arm": "series-b", "dp_rank": "3"}) == 0.9

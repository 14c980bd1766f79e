"""Report JSON, terminal table, plot, and the oracle hook. No host."""

from __future__ import annotations

import json

import pytest

from fdsched.core.hooks import Policies, make_plugin_manager
from fdsched.replay.costmodel import StepCost
from fdsched.replay.figures import ProfileRun, RequestRow, StepRow
from fdsched.replay.oracle import ORACLE_PLUGIN_NAME, OracleReserve
from fdsched.replay.plot import write_plot
from fdsched.replay.report import build_report, format_header, format_table, format_value, ratio, report_json

TRACE = {"name": "t", "description": "", "requests": 1, "sha256": "0" * 64}
ENGINE = {"block_size": 4, "num_gpu_blocks": 10}


def _run(profile, preempt=0, drained=True, blocked=3):
    run = ProfileRun(profile=profile, num_gpu_blocks=10, cost=StepCost(1.0, 0.0, 0.0), drained=drained)
    run.steps = [
        StepRow(0, prefill_tokens=4, blocks_used=2, running=1, waiting=0, schedule_cpu_s=0.001),
        StepRow(1, decode_tokens=1, blocks_used=3, running=1, preempted=[("r", "decode")] * preempt, schedule_cpu_s=0.002),
    ]
    run.requests = [RequestRow("r", 0, 4, 2, output_tokens=2, prefill_tokens=4, cache_hit_tokens=0, first_token_step=0,
                               finish_step=1, finish_count=1)]
    run.admissions_blocked = blocked
    run.decisions = {"ratio_reserve": "applied"}
    run.host = {"version": "2.6.0", "commit": "d38eeb8"}
    run.settings = {"changes.ratio_reserve": "on", "replay.oracle_reserve": profile == "oracle"}
    run.stop_reason = "" if drained else "max_steps=2 reached"
    return run


def test_format_value_and_ratio():
    assert format_value(None) == "n/a" and format_value(True) == "yes" and format_value(3) == "3"
    assert format_value(0.0) == "0" and format_value(0.12345) == "0.123" and format_value(12.345) == "12.35"
    assert format_value(1234.56) == "1234.6"
    assert ratio(3, 2) == 1.5 and ratio(1, 0) is None and ratio(None, 2) is None and ratio(True, 1) is None


def test_table_has_a_column_per_profile_and_ratio_columns():
    report = build_report(TRACE, ENGINE, [_run("baseline", preempt=2), _run("recommended", preempt=1, blocked=None)])
    table = format_table(report)
    header = table.splitlines()[0].split()
    assert header == ["figure", "better", "baseline", "recommended", "recommended/baseline"]
    row = next(line for line in table.splitlines() if line.startswith("preemptions "))
    assert row.split()[-4:] == ["lower", "2", "1", "0.50"]
    throughput = next(line for line in table.splitlines() if line.startswith("throughput"))
    assert " higher " in throughput
    evicted = next(line for line in table.splitlines() if line.startswith("evicted blocks"))
    assert "lower" not in evicted and "higher" not in evicted  # a description of the run, not a score
    blocked = next(line for line in table.splitlines() if line.startswith("admissions blocked"))
    assert blocked.split()[-3:] == ["3", "n/a", "-"]
    assert "recommended: admissions blocked n/a" in table
    assert "schedule() CPU ms / step, mean*" in table


def test_three_profiles_get_two_ratio_columns_and_not_drained_is_flagged():
    report = build_report(TRACE, ENGINE, [_run("a"), _run("b"), _run("c", drained=False)])
    table = format_table(report, measured=False)
    assert table.splitlines()[0].split()[-2:] == ["b/a", "c/a"]
    assert "c: NOT DRAINED after 2 steps (max_steps=2 reached)" in table
    assert "CPU ms" not in table


def test_report_is_deterministic_and_measured_is_separate():
    first = build_report(TRACE, ENGINE, [_run("baseline"), _run("recommended")])
    again_runs = [_run("baseline"), _run("recommended")]
    again_runs[0].steps[0].schedule_cpu_s = 0.5  # different timings
    again_runs[1].wall_seconds = 99.0
    again = build_report(TRACE, ENGINE, again_runs)
    assert first["measured"] != again["measured"]
    first.pop("measured")
    again.pop("measured")
    assert report_json(first) == report_json(again)
    text = report_json(first)
    assert "schedule" not in text and "wall" not in text
    parsed = json.loads(report_json(build_report(TRACE, ENGINE, [_run("x", preempt=1)])))
    entry = parsed["profiles"][0]
    assert entry["series"]["preemptions"] == [[1, "r", "decode"]]
    assert entry["series"]["blocks_in_use"] == [2, 3]
    assert entry["cost_model"]["step_fixed_ms"] == 1.0


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    report = build_report(TRACE, ENGINE, [_run("baseline", preempt=1), _run("recommended", drained=False)])
    path = tmp_path / "replay.png"
    write_plot(report, str(path), title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_oracle_reserves_the_true_remainder():
    oracle = OracleReserve({"a": 20})
    assert oracle.fdsched_estimate_reserve_blocks("a", 100, 3, 0.7, 4096, 4) == 5  # ceil(17 / 4)
    assert oracle.fdsched_estimate_reserve_blocks("a", 100, 25, 0.7, 4096, 4) == 0
    assert oracle.fdsched_estimate_reserve_blocks("zz", 100, 0, 0.7, 4096, 4) is None
    assert oracle.calls == 2


def test_oracle_overrides_the_default_through_the_hook_and_unregisters():
    policies = Policies(make_plugin_manager(environ={}, load_entry_points=False))
    default = policies.reserve_blocks("a", 100, 0, 0.5, 4096, 4)
    assert default == 13  # ceil(int(100 * 0.5) / 4)
    oracle = OracleReserve({"a": 9})
    policies.register(oracle, name=ORACLE_PLUGIN_NAME)
    assert policies.reserve_blocks("a", 100, 0, 0.5, 4096, 4) == 3
    assert policies.reserve_blocks("other", 100, 0, 0.5, 4096, 4) == 13  # unknown: falls through to the default
    assert ORACLE_PLUGIN_NAME in policies.external_plugins()
    policies.unregister(oracle)
    assert policies.reserve_blocks("a", 100, 0, 0.5, 4096, 4) == 13


def test_header_names_host_decisions_differing_settings_and_environment():
    base, oracle = _run("baseline"), _run("oracle")
    base.environment = {"inherit_env": False, "applied": {}, "not_applied": {"FDSCHED_RATIO_RESERVE": "off"},
                        "other_host_variables": {}, "hook_plugins": []}
    oracle.environment = {"inherit_env": True, "applied": {"FDSCHED_RATIO_RESERVE": "off"}, "not_applied": {},
                          "other_host_variables": {"FD_DISABLE_CHUNKED_PREFILL": "1"}, "hook_plugins": ["x"]}
    report = build_report(TRACE, ENGINE, [base, oracle])
    assert report["host"] == {"version": "2.6.0", "commit": "d38eeb8"}
    assert [p["settings_that_differ"] for p in report["profiles"]] == [
        {"replay.oracle_reserve": False}, {"replay.oracle_reserve": True}]
    assert report["better"]["ttft_ms_p50"] == "lower"
    text = format_header(report)
    assert "host: FastDeploy 2.6.0, commit d38eeb8" in text
    assert "arm baseline: ratio_reserve=applied" in text
    assert "settings that differ: replay.oracle_reserve=False" in text
    assert "environment NOT applied (use --inherit-env): FDSCHED_RATIO_RESERVE" in text
    assert "environment applied: FDSCHED_RATIO_RESERVE=off" in text
    assert "FD_DISABLE_CHUNKED_PREFILL=1" in text and "hook plugins loaded: x" in text


def test_a_host_that_differs_between_arms_is_called_out():
    a, b = _run("a"), _run("b")
    b.host = {"version": "2.6.0", "commit": "e7c8dc2"}
    report = build_report(TRACE, ENGINE, [a, b])
    assert "arms_differ" in report["host"]
    assert "DIFFERS BETWEEN ARMS" in format_header(report)


def test_series_carry_latency_distributions_and_completions_in_modelled_time():
    run = _run("a")
    run.steps[1].gap_ms = 10.0  # idle time skipped before step 1
    entry = build_report(TRACE, ENGINE, [run])["profiles"][0]
    assert entry["series"]["step_end_ms"] == [1.0, 12.0]
    assert entry["series"]["ttft_ms"] == [1.0]  # arrived at step 0's start, first token at its end
    assert entry["series"]["tpot_ms"] == [11.0]
    assert entry["series"]["finish_ms"] == [12.0]

"""The trace replay against the real host scheduler: shipped traces, determinism, the oracle, the CLI.

The host is imported only through the fixtures; without it every test here is skipped with a
reason that starts with "needs FastDeploy host".
"""

from __future__ import annotations

import json

import pytest

from fdsched.host import HOW_TO_POINT, HostNotFound

SHIPPED = ("pressure", "shared-prefix", "pd-prefill")
PROFILES = ("baseline", "recommended")


@pytest.fixture(scope="module")
def replay_host():
    from fdsched.replay.engine import prepare_host_environment

    prepare_host_environment()
    from fdsched.host import find_host

    try:
        find_host()
    except HostNotFound as exc:
        pytest.skip(f"needs FastDeploy host: {exc}" if HOW_TO_POINT in str(exc) else f"needs FastDeploy host: {HOW_TO_POINT}")
    from fdsched.host import probe

    yield probe()
    from fdsched import installer

    installer.uninstall()  # leave the process as the other host tests expect it


@pytest.fixture(scope="module")
def replays(replay_host):
    """(trace name, profile) -> ProfileRun, each replay run once per module."""
    from fdsched.replay.runner import run_profile
    from fdsched.replay.trace import load_trace, resolve_trace

    cache = {}

    def get(name, profile):
        if (name, profile) not in cache:
            trace = load_trace(resolve_trace(name))
            cache[(name, profile)] = (trace, run_profile(trace, profile, trace.engine_with()))
        return cache[(name, profile)]

    return get


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_trace_keeps_invariants_and_finishes_every_request(replays, replay_host, request, name, profile):
    from fdsched.replay.figures import compute_figures

    trace, run = replays(name, profile)
    figures = compute_figures(run)
    violations = [v for s in run.steps for v in s.violations] + run.request_violations
    assert violations == []
    assert figures["invariant_violations"] == 0
    assert run.drained, run.stop_reason
    assert figures["requests_finished"] == len(trace.requests)
    assert all(r.finish_count == 1 for r in run.requests)
    assert all(r.output_tokens == r.target_output for r in run.requests)


def test_pressure_preempts_under_baseline_but_never_a_prefill_under_recommended(replays):
    from fdsched.replay.figures import compute_figures

    base = compute_figures(replays("pressure", "baseline")[1])
    rec = compute_figures(replays("pressure", "recommended")[1])
    assert base["preemptions"] > 0
    assert base["recomputed_prompt_tokens"] > 0
    assert rec["preemptions_prefill_victims"] == 0
    assert rec["recomputed_prompt_tokens"] < base["recomputed_prompt_tokens"]


@pytest.mark.requires_host_change("ratio_reserve")
def test_upstream_ratio_reservation_stalls_a_prefill_node_and_the_plugin_does_not(replays, replay_host, tmp_path):
    """7783's reservation on a prefill node (the new host's own code, ``auto`` there) counts every running
    prefill's future decode tokens although the node never decodes: preallocation has already taken the
    pool, a refused chunk schedules nothing, and the ratio never decays. The plugin reserves nothing there."""
    assert replay_host.has["ratio_reserve"]  # deselected on a host without it (see tests/host/conftest.py)
    host_code = tmp_path / "ratio-host-code.yaml"
    host_code.write_text('changes: {ratio_reserve: "auto", decode_only_preempt: "auto"}\n')
    trace, stalled = replays("pd-prefill", str(host_code))
    assert not stalled.drained and stalled.stop_reason.startswith("stalled")
    stall = stalled.stall
    # Every stuck request is a running prefill that already holds all its blocks: only the
    # reservation threshold keeps it from running.
    assert stall["running"] > 0 and stall["running_prefilling"] == stall["running"]
    assert stall["running_with_all_blocks"] == stall["running"]
    assert stall["waiting"] == 0
    _, fixed = replays("pd-prefill", "recommended")
    assert fixed.drained


@pytest.mark.parametrize("profile", PROFILES)
def test_shared_prefix_hits_and_evicts(replays, profile):
    from fdsched.replay.figures import compute_figures

    figures = compute_figures(replays("shared-prefix", profile)[1])
    assert figures["prefix_hit_rate"] > 0.3
    assert figures["evicted_blocks"] > 0


@pytest.mark.parametrize("name", ["shared-prefix", "pressure", "pd-prefill"])
def test_host_hit_record_equals_the_tokens_the_first_chunk_skipped(replays, name):
    """The figure uses request.metrics.gpu_cache_token_num; check it against what was scheduled."""
    _, run = replays(name, "baseline")
    admitted = [r for r in run.requests if r.first_chunk_start is not None]
    assert admitted
    for r in admitted:
        assert r.cache_hit_tokens == r.first_chunk_start, r.id
    if name != "pressure":
        assert sum(r.cache_hit_tokens for r in admitted) > 0


def test_pd_prefill_requests_enter_through_the_prefill_node_path(replays):
    trace, run = replays("pd-prefill", "baseline")
    assert trace.engine["splitwise_role"] == "prefill"
    assert all(r.target_output == 1 and r.output_tokens == 1 for r in run.requests)
    assert all(s.decode_tokens == 0 for s in run.steps)


def _logical(report):
    report = dict(report)
    report.pop("measured")
    return json.dumps(report, sort_keys=True)


def test_two_runs_give_the_same_report_except_measured(replay_host):
    from fdsched.replay.report import build_report
    from fdsched.replay.runner import run_replay
    from fdsched.replay.trace import load_trace, resolve_trace

    reports = []
    for _ in range(2):
        trace = load_trace(resolve_trace("shared-prefix"))
        runs = run_replay(trace, PROFILES, trace.engine_with())
        reports.append(build_report({"name": trace.name}, trace.engine_with(), runs))
    assert _logical(reports[0]) == _logical(reports[1])
    assert reports[0]["profiles"][0]["series"]["blocks_in_use"]  # the comparison covered the per-step series


def test_oracle_reserves_true_output_and_unregisters(replay_host, monkeypatch):
    from fdsched import installer
    from fdsched.hookspecs import hookimpl
    from fdsched.replay import runner
    from fdsched.replay.figures import compute_figures
    from fdsched.replay.oracle import ORACLE_PLUGIN_NAME, OracleReserve
    from fdsched.replay.trace import load_trace, resolve_trace

    answers = []

    class Recording(OracleReserve):
        @hookimpl
        def fdsched_estimate_reserve_blocks(
            self, request_id, max_new_tokens, generated_tokens, ratio, clip_max_new_tokens, block_size
        ):
            answer = super().fdsched_estimate_reserve_blocks(
                request_id, max_new_tokens, generated_tokens, ratio, clip_max_new_tokens, block_size
            )
            true_output = self.true_output_lengths[request_id]
            answers.append((answer, -(-max(true_output - generated_tokens, 0) // block_size)))
            return answer

    monkeypatch.setattr(runner, "OracleReserve", Recording)
    trace = load_trace(resolve_trace("pressure"))
    run = runner.run_profile(trace, "oracle", trace.engine_with())
    figures = compute_figures(run)
    assert answers and all(answer == expected for answer, expected in answers)
    assert figures["preemptions"] == 0
    assert figures["invariant_violations"] == 0 and run.drained
    assert ORACLE_PLUGIN_NAME not in installer.current().policies.external_plugins()


def test_max_steps_stops_and_reports_not_drained(replay_host):
    from fdsched.replay.figures import compute_figures
    from fdsched.replay.runner import run_profile
    from fdsched.replay.trace import load_trace, resolve_trace

    trace = load_trace(resolve_trace("pressure"))
    run = run_profile(trace, "baseline", trace.engine_with(), max_steps=30)
    figures = compute_figures(run)
    assert not run.drained and figures["steps"] == 30 and figures["steps_to_drain"] is None
    assert run.stop_reason == "max_steps=30 reached"
    assert run.request_violations == []  # unfinished is not lost when the run was cut short
    assert figures["invariant_violations"] == 0


def test_cli_replay_writes_table_json_and_png(replay_host, tmp_path, capsys):
    from fdsched.cli import main
    from fdsched.replay.generate import generate_text

    trace = tmp_path / "small.jsonl"
    trace.write_text(generate_text("shared-prefix", 10, 5))
    out = tmp_path / "out"
    code = main(["replay", "--trace", str(trace), "--out", str(out), "--no-progress", "--cost-fixed-ms", "2",
                 "--profile", "baseline", "--profile", "recommended"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "recommended/baseline" in printed and "invariant violations" in printed
    report = json.loads((out / "report.json").read_text())
    assert [p["profile"] for p in report["profiles"]] == ["baseline", "recommended"]
    assert all(p["cost_model"]["step_fixed_ms"] == 2.0 for p in report["profiles"])
    assert report["trace"]["requests"] == 10 and len(report["trace"]["sha256"]) == 64
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (out / "replay.png").exists()
    else:
        assert (out / "replay.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_replay_dp_arms_splits_one_trace_across_one_scheduler_per_arm(replay_host, tmp_path, capsys):
    """--dp-arms predicts an online A/B: each rank serves its share (uniform random split, seeded) with its profile."""
    from fdsched.cli import main
    from fdsched.replay.trace import load_trace, resolve_trace, split_across_ranks

    out = tmp_path / "out"
    code = main(["replay", "--trace", "pressure", "--out", str(out), "--no-progress", "--no-plot",
                 "--dp-arms", "0=baseline,1=recommended", "--dp-seed", "0"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "dp1:recommended/dp0:baseline" in printed and "online A/B prediction (--dp-arms, seed 0)" in printed
    report = json.loads((out / "report.json").read_text())
    assert [p["profile"] for p in report["profiles"]] == ["dp0:baseline", "dp1:recommended"]
    shares = split_across_ranks(load_trace(resolve_trace("pressure")), [0, 1], seed=0)
    assert report["trace"]["dp_arms"]["requests_per_rank"] == {
        "dp0:baseline": len(shares[0].requests), "dp1:recommended": len(shares[1].requests)}
    figures = {p["profile"]: p["figures"] for p in report["profiles"]}
    assert figures["dp1:recommended"]["preemptions_prefill_victims"] == 0
    assert figures["dp0:baseline"]["requests_finished"] == len(shares[0].requests)


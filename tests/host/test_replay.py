"""The trace replay against the real host scheduler: shipped traces, determinism, the oracle, the CLI.

The host is imported only through the fixtures; without it every test here is skipped with a
reason that starts with "needs FastDeploy host".
"""

from __future__ import annotations

import json

import pytest

SHIPPED = ("pressure", "shared-prefix", "pd-prefill")
PROFILES = ("baseline", "recommended")


@pytest.fixture(scope="module")
def replays(replay_host):
    """(trace name, profile) -> ProfileRun, each replay run once per module."""
    from fdsched.replay.runner import run_profile
    from fdsched.replay.tracefile import load_trace, resolve_trace

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
def test_a_prefill_node_drains_under_the_plugin_and_as_the_host_drains_it_where_it_does(replays, replay_host, tmp_path):
    """7783's reservation on a prefill node (the host's own code, ``auto`` there) counts every running prefill's
    future decode tokens although the node never decodes; with the host alone it stalls (test_host_defects.py). The
    host fix ``prefill_node_reserve`` (``auto``) answers 0 for each running request there, and a later host (the 2.6
    branch head, 7198b58) skips the reservation for a prefill node's running chunks itself: either way the host's
    own reservation drains the node, and the plugin's version must decide exactly as it does."""
    from fdsched.replay.figures import compute_figures

    assert replay_host.has["ratio_reserve"]  # deselected on a host without it (see tests/host/conftest.py)
    host_code = tmp_path / "ratio-host-code.yaml"
    host_code.write_text('changes: {ratio_reserve: "auto", decode_only_preempt: "auto"}\n')
    trace, host_run = replays("pd-prefill", str(host_code))
    _, plugin_run = replays("pd-prefill", "recommended")
    assert plugin_run.drained, plugin_run.stop_reason
    if not host_run.drained:  # a host without the prefill-node branch
        assert host_run.stop_reason.startswith("stalled")
        stall = host_run.stall
        # Every stuck request is a running prefill that already holds all its blocks: only the
        # reservation threshold keeps it from running.
        assert stall["running"] > 0 and stall["running_prefilling"] == stall["running"]
        assert stall["running_with_all_blocks"] == stall["running"]
        assert stall["waiting"] == 0
        return
    # a host with it: the same admissions step for step
    host_figures, plugin_figures = compute_figures(host_run), compute_figures(plugin_run)
    for key in ("steps_to_drain", "requests_finished", "preemptions", "prefix_hit_rate"):
        assert host_figures[key] == plugin_figures[key], key
    step = lambda s: (s.prefill_tokens, s.first_tokens, s.running, s.waiting, s.blocks_used)  # noqa: E731
    assert [step(s) for s in host_run.steps] == [step(s) for s in plugin_run.steps]


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
    from fdsched.replay.tracefile import load_trace, resolve_trace

    reports = []
    for _ in range(2):
        trace = load_trace(resolve_trace("shared-prefix"))
        runs = run_replay(trace, PROFILES, trace.engine_with())
        reports.append(build_report({"name": trace.name}, trace.engine_with(), runs))
    assert _logical(reports[0]) == _logical(reports[1])
    assert reports[0]["profiles"][0]["series"]["blocks_in_use"]  # the comparison covered the per-step series


def test_oracle_admits_by_peak_demand_and_unregisters(replay_host, monkeypatch):
    """The clairvoyant bound answers for the running set through the reservation hook: its answers sum,
    per admission decision, to max(0, peak demand - blocks held), computed from the host's own requests."""
    from fdsched.install import installer
    from fdsched.hookspecs import hookimpl
    from fdsched.replay import runner
    from fdsched.replay.figures import compute_figures
    from fdsched.replay.oracle import ORACLE_PLUGIN_NAME, PeakOracle, peak_demand_blocks
    from fdsched.replay.tracefile import load_trace, resolve_trace

    seen = []

    class Recording(PeakOracle):
        @hookimpl
        def fdsched_estimate_reserve_blocks(
            self, request_id, max_new_tokens, generated_tokens, ratio, clip_max_new_tokens, block_size
        ):
            answer = super().fdsched_estimate_reserve_blocks(
                request_id, max_new_tokens, generated_tokens, ratio, clip_max_new_tokens, block_size
            )
            running, candidate = self.snapshot()
            if running and running[0].request_id == request_id:
                together = [h for h in running if candidate is None or h.request_id != candidate.request_id]
                together += [candidate] if candidate is not None else []
                peak = peak_demand_blocks(together, block_size)
                seen.append((answer, max(0, peak - sum(h.held_blocks for h in together)), candidate is not None))
            else:
                assert answer == 0
            return answer

    monkeypatch.setattr(runner, "PeakOracle", Recording)
    trace = load_trace(resolve_trace("pressure"))
    run = runner.run_profile(trace, "oracle", trace.engine_with())
    figures = compute_figures(run)
    assert seen and all(answer == expected for answer, expected, _ in seen)
    assert all(has_candidate for _, _, has_candidate in seen)  # every decision knew the prefill it decided on
    assert figures["invariant_violations"] == 0 and run.drained
    assert ORACLE_PLUGIN_NAME not in installer.current().policies.external_plugins()


def test_unbounded_arm_is_never_limited_by_memory(replays):
    from fdsched.replay.figures import compute_figures
    from fdsched.replay.runner import unbounded_blocks

    trace, run = replays("pressure", "unbounded")
    figures = compute_figures(run)
    assert run.num_gpu_blocks == unbounded_blocks(trace, trace.engine_with()) > trace.engine["num_gpu_blocks"]
    assert figures["preemptions"] == 0 and figures["invariant_violations"] == 0 and run.drained
    assert figures["blocks_in_use_peak"] < run.num_gpu_blocks
    assert figures["evicted_blocks"] == 0
    # The ceiling: no arm on the real pool finishes the trace sooner.
    for profile in ("baseline", "recommended", "oracle"):
        other = compute_figures(replays("pressure", profile)[1])
        assert figures["throughput_tokens_per_s"] >= other["throughput_tokens_per_s"], profile


def test_sglang_retract_order_picks_the_fewest_outputs(replay_host, monkeypatch, tmp_path):
    """optimism's pressure (no reservation) with SGLang's retract order: every victim is a decoding request
    with the fewest generated tokens among those that may be preempted, the longest prompt among ties."""
    from fdsched.hookspecs import hookimpl
    from fdsched.replay import runner
    from fdsched.replay.figures import compute_figures
    from fdsched.replay.oracle import RetractOrder
    from fdsched.replay.tracefile import load_trace, resolve_trace

    chosen = []

    class Recording(RetractOrder):
        @hookimpl
        def fdsched_select_preemption_victim(self, candidates, decode_only):
            index = super().fdsched_select_preemption_victim(candidates, decode_only)
            eligible = [(self.lengths(c.request_id), c) for c in candidates if c.decoding and not c.uses_extend_tables]
            chosen.append((index, [c.request_id for c in candidates], eligible))
            return index

    monkeypatch.setattr(runner, "RetractOrder", Recording)
    profile = tmp_path / "optimism-sglang.yaml"
    profile.write_text(
        "changes: {deferred_recycle: 'on', decode_only_preempt: 'on', ratio_reserve: 'on', pd_prefill_cache: 'on', "
        "nonpolling_transfer: 'on'}\nhost_tunables: {FD_INIT_NEW_TOKEN_RATIO: 0, FD_MIN_NEW_TOKEN_RATIO: 0}\n"
        "replay: {retract_order: sglang}\n"
    )
    trace = load_trace(resolve_trace("pressure"))
    run = runner.run_profile(trace, str(profile), trace.engine_with())
    figures = compute_figures(run)
    assert figures["invariant_violations"] == 0 and run.drained
    assert figures["preemptions"] > 0 and figures["preemptions_prefill_victims"] == 0
    assert chosen
    for index, ids, eligible in chosen:
        assert index is not None
        victim = ids[index]
        fewest = min(generated for (generated, _), _ in eligible)
        victim_lengths = next(lengths for lengths, c in eligible if c.request_id == victim)
        assert victim_lengths[0] == fewest
        assert victim_lengths[1] == max(prompt for (generated, prompt), _ in eligible if generated == fewest)


def test_token_times_match_the_output_and_first_token(replays):
    _, run = replays("pressure", "baseline")
    for r in run.requests:
        assert len(r.token_steps) == r.output_tokens
        assert r.token_steps[0] == r.first_token_step and r.token_steps[-1] == r.finish_step
        assert r.token_steps == sorted(set(r.token_steps))
    preempted = [r for r in run.requests if r.preemptions]
    assert preempted  # baseline preempts on this trace


def test_max_steps_stops_and_reports_not_drained(replay_host):
    from fdsched.replay.figures import compute_figures
    from fdsched.replay.runner import run_profile
    from fdsched.replay.tracefile import load_trace, resolve_trace

    trace = load_trace(resolve_trace("pressure"))
    run = run_profile(trace, "baseline", trace.engine_with(), max_steps=30)
    figures = compute_figures(run)
    assert not run.drained and figures["steps"] == 30 and figures["steps_to_drain"] is None
    assert run.stop_reason == "max_steps=30 reached"
    assert run.request_violations == []  # unfinished is not lost when the run was cut short
    assert figures["invariant_violations"] == 0


def test_cli_replay_writes_table_json_and_png(replay_host, tmp_path, capsys):
    from fdsched.tools.cli import main
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
    from fdsched.tools.cli import main
    from fdsched.replay.trace import split_across_ranks
    from fdsched.replay.tracefile import load_trace, resolve_trace

    from .conftest import skip_if_refused

    skip_if_refused("recommended")  # an arm this line refuses at load fails the run in one line, before replaying
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



@pytest.mark.parametrize("role", ["mixed", "prefill"])
def test_a_replayed_scheduler_names_its_shared_memory_signal_after_this_process(replay_host, role):
    """The host's scheduler creates a machine-wide shared-memory signal named after an engine port (2.4 reads
    ``engine_worker_queue_port[rank]``, later lines ``local_engine_worker_queue_port``). Two processes replaying
    at once (CI's two workers) must not share that name, or one unlinks the other's signal (seen on 2.4:
    FileNotFoundError building a prefill node)."""
    from fdsched.replay.engine import EngineShape, _private_signal_suffix, build_manager, close_manager

    shape = EngineShape(block_size=16, num_gpu_blocks=96, max_num_seqs=4, max_num_batched_tokens=256,
                        max_model_len=1024, splitwise_role=role)
    manager = build_manager(shape)
    try:
        signal = getattr(manager, "need_block_num_signal", None)
        if signal is None:
            pytest.skip("this line's scheduler has no need_block_num_signal")
        assert signal.shm.name.lstrip("/") == f"need_block_num_signal.{_private_signal_suffix(0)}"
    finally:
        close_manager(manager)

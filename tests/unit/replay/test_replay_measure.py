"""What users feel (E2E, TPOT, stalls, recomputed tokens), the verdict, the reference arms' pure parts
(peak-demand oracle, SGLang's retract order, the unbounded pool) and the held-out split. No host."""

from __future__ import annotations

import pytest

from fdsched.core.policies import VictimCandidate
from fdsched.replay.costmodel import StepCost
from fdsched.replay.evaluate import (
    EVAL_COLUMNS, format_eval_table, load_windows, missing_csv_message, window_trace_name,
)
from fdsched.replay.figures import (
    LATENCY_KEYS, ProfileRun, RequestRow, RequestTimes, StepRow, compute_figures, request_latency_figures,
)
from fdsched.replay.oracle import Holding, PeakOracle, peak_demand_blocks, sglang_victim
from fdsched.replay.report import BOUND_KEYS, build_report, format_bounds
from fdsched.replay.verdict import format_verdicts, verdict
from fdsched.replay.trace import TraceError
from fdsched.replay.tracefile import load_trace, shipped_traces


# --------------------------------------------------------------------------------------------
# A hand-made run: request "a" is preempted after two tokens and recomputed; "b" runs through.
# Cost: 1 ms per step + 0.1 ms per prefill token + 1 ms per decoding request.
# --------------------------------------------------------------------------------------------
def _preempted_run():
    cost = StepCost(fixed_ms=1.0, per_prefill_token_ms=0.1, per_decode_request_ms=1.0)
    run = ProfileRun(profile="p", num_gpu_blocks=10, cost=cost, drained=True)
    run.steps = [
        StepRow(0, prefill_tokens=10),  # a's prompt: 2 ms, ends 2 (a token 1)
        StepRow(1, decode_tokens=1, prefill_tokens=10),  # a decodes, b's prompt: 1 + 1 + 1 = 3 ms, ends 5 (a 2, b 1)
        StepRow(2, decode_tokens=1, preempted=[("a", "decode")]),  # a preempted, b decodes: 2 ms, ends 7 (b 2)
        StepRow(3, prefill_tokens=12, decode_tokens=1),  # a recomputed (10 + 2 tokens), b: 1 + 1.2 + 1, ends 10.2
        StepRow(4, decode_tokens=1),  # a decodes: 2 ms, ends 12.2 (a 4, finished)
    ]
    run.requests = [
        RequestRow("a", 0, 10, 4, output_tokens=4, prefill_tokens=22, cache_hit_tokens=0, first_token_step=0,
                   finish_step=4, finish_count=1, preemptions=1, token_steps=[0, 1, 3, 4]),
        RequestRow("b", 1, 10, 3, output_tokens=3, prefill_tokens=10, cache_hit_tokens=0, first_token_step=1,
                   finish_step=3, finish_count=1, token_steps=[1, 2, 3]),
    ]
    return run


def test_each_felt_figure_from_a_hand_made_run_with_a_preemption():
    f = compute_figures(_preempted_run())
    # a: arrives 0, tokens at 2, 5, 10.2, 12.2; b: arrives at step 1's start (2), tokens at 5, 7, 10.2
    assert f["ttft_ms_p50"] == pytest.approx((2.0 + 3.0) / 2)
    assert f["e2e_ms_p50"] == pytest.approx((12.2 + 8.2) / 2)
    assert f["e2e_ms_p90"] == pytest.approx(8.2 + (12.2 - 8.2) * 0.9)
    assert f["e2e_ms_p99"] == pytest.approx(8.2 + (12.2 - 8.2) * 0.99)
    tpot_a, tpot_b = (12.2 - 2.0) / 3, (10.2 - 5.0) / 2
    assert f["tpot_ms_p50"] == pytest.approx((tpot_a + tpot_b) / 2)
    assert f["tpot_ms_p99"] == pytest.approx(tpot_b + (tpot_a - tpot_b) * 0.99)
    # a's stall is its preemption: from its last token before it (end of step 1) to the first after the
    # recompute (end of step 3): the step it was preempted in plus the step that recomputed it.
    recompute_ms = (1.0 + 1.0) + (1.0 + 0.1 * 12 + 1.0)
    assert f["stall_ms_max"] == pytest.approx(recompute_ms)
    stall_b = 10.2 - 7.0
    assert f["stall_ms_p99"] == pytest.approx(stall_b + (recompute_ms - stall_b) * 0.99)
    assert f["recomputed_tokens"] == 12 == f["recomputed_prompt_tokens"]  # its prompt and its 2 tokens again
    assert set(LATENCY_KEYS) <= set(f)


def test_request_latency_figures_takes_plain_samples():
    samples = [
        {"arrival_ms": 0.0, "token_ms": [10.0, 12.0, 30.0, 32.0], "recomputed_tokens": 5},
        RequestTimes(5.0, [15.0]),
        RequestTimes(5.0, [20.0, 21.0], finished=False),  # cut off: TTFT only
        RequestTimes(7.0, []),  # never started
    ]
    f = request_latency_figures(samples)
    assert f["ttft_ms_p50"] == pytest.approx(10.0)  # 10, 10, 15
    assert f["e2e_ms_p50"] == pytest.approx((32.0 + 10.0) / 2)
    assert f["tpot_ms_p50"] == pytest.approx(22.0 / 3) and f["tpot_ms_p99"] == pytest.approx(22.0 / 3)
    assert f["stall_ms_max"] == 18.0 and f["stall_ms_p99"] == 18.0
    assert f["recomputed_tokens"] == 5
    empty = request_latency_figures([])
    assert empty["e2e_ms_p99"] is None and empty["stall_ms_max"] is None and empty["recomputed_tokens"] == 0


def test_report_table_and_png_series_carry_the_felt_figures(tmp_path):
    report = build_report({"name": "t", "description": "", "requests": 2, "sha256": "0"}, {"num_gpu_blocks": 10},
                          [_preempted_run()])
    figures = report["profiles"][0]["figures"]
    for key in ("e2e_ms_p50", "e2e_ms_p90", "e2e_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "stall_ms_p99",
                "stall_ms_max", "recomputed_tokens", "ttft_ms_p50", "preemptions"):
        assert key in figures
    series = report["profiles"][0]["series"]
    assert series["stall_ms"] == [3.2, 5.2] and series["e2e_ms"] == [8.2, 12.2]
    from fdsched.replay.report import format_table

    table = format_table(report, measured=False)
    assert "E2E p99 (modelled ms)" in table and "stall max (longest token gap, ms)" in table
    pytest.importorskip("matplotlib")
    from fdsched.replay.plot import write_plot

    write_plot(report, str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------------------------
# Verdict
# --------------------------------------------------------------------------------------------
def test_verdict_reads_ttft_e2e_and_stalls_together():
    ref = {"ttft_ms_p50": 100.0, "e2e_ms_p99": 1000.0, "stall_ms_p99": 50.0}
    assert verdict({"ttft_ms_p50": 80.0, "e2e_ms_p99": 1010.0, "stall_ms_p99": 50.0}, ref)[0] == "better"
    # better TTFT bought with stalls (an optimistic policy's trade): no ranking
    assert verdict({"ttft_ms_p50": 80.0, "e2e_ms_p99": 1000.0, "stall_ms_p99": 90.0}, ref)[0] == "mixed"
    assert verdict({"ttft_ms_p50": 103.0, "e2e_ms_p99": 1200.0, "stall_ms_p99": 50.0}, ref)[0] == "worse"
    assert verdict({"ttft_ms_p50": 104.0, "e2e_ms_p99": 990.0, "stall_ms_p99": 51.0}, ref)[0] == "same"
    assert verdict({"ttft_ms_p50": None, "e2e_ms_p99": 1.0, "stall_ms_p99": 1.0}, ref)[0] == "n/a"
    word, detail = verdict({"ttft_ms_p50": 50.0, "e2e_ms_p99": 1000.0, "stall_ms_p99": 50.0}, ref)
    assert word == "better" and "ttft_ms_p50 0.50x" in detail


def _arm(name, throughput, ttft, oracle=False, unbounded=False):
    run = _preempted_run()
    run.profile = name
    run.settings = {"replay.oracle_reserve": oracle, "replay.unbounded_memory": unbounded}
    # scale the modelled time by changing the fixed cost: a slower arm
    run.cost = StepCost(fixed_ms=throughput, per_prefill_token_ms=0.1, per_decode_request_ms=1.0)
    return run


def test_every_arm_gets_ratios_to_the_oracle_and_the_unbounded_arm():
    runs = [_arm("baseline", 3.0, 0), _arm("oracle", 2.0, 0, oracle=True), _arm("unbounded", 1.0, 0, unbounded=True)]
    report = build_report({"name": "t", "description": "", "requests": 2, "sha256": "0"}, {"num_gpu_blocks": 10}, runs)
    assert report["bounds"]["arms"] == {"oracle": "oracle", "unbounded": "unbounded"}
    ratios = report["bounds"]["ratios"]
    figures = {p["profile"]: p["figures"] for p in report["profiles"]}
    expected = figures["baseline"]["throughput_tokens_per_s"] / figures["unbounded"]["throughput_tokens_per_s"]
    assert ratios["baseline"]["vs_unbounded"]["throughput_tokens_per_s"] == pytest.approx(expected, abs=1e-6)
    assert expected < 1
    assert ratios["oracle"]["vs_oracle"] == {key: 1.0 for key in BOUND_KEYS}
    text = format_bounds(report)
    assert "oracle = oracle" in text and "baseline" in text
    assert "verdict vs baseline" in format_verdicts(report)
    none = build_report({"name": "t", "description": "", "requests": 2, "sha256": "0"}, {}, [_arm("a", 1.0, 0)])
    assert none["bounds"] == {} and format_bounds(none) == "" and format_verdicts(none) == ""


# --------------------------------------------------------------------------------------------
# The clairvoyant oracle
# --------------------------------------------------------------------------------------------
def test_peak_demand_counts_the_blocks_finishing_requests_give_back():
    # block size 4, no preallocated block ahead. a: 8 tokens held (2 blocks), 1 more token then done;
    # b: 4 tokens (1 block), 8 more tokens.
    a = Holding("a", 2, 8, 1)
    b = Holding("b", 1, 4, 8)
    # t=0: a 2 + b 1 = 3; t=7 (b's last step): a gone, b ceil(11/4) = 3 -> peak 3
    assert peak_demand_blocks([a, b], 4, ahead=0) == 3
    # summing true remainders (the old oracle) would ask for 2 + 1 + ceil(1/4) + ceil(8/4) = 6 blocks
    c = Holding("c", 1, 4, 8)
    assert peak_demand_blocks([b, c], 4, ahead=0) == 6  # both grow to 3 blocks together
    assert peak_demand_blocks([], 4) == 0
    assert peak_demand_blocks([Holding("x", 5, 4, 0)], 4, ahead=1) == 5  # never below what it holds


def test_peak_oracle_answers_the_set_reserve_once_per_decision():
    running = [Holding("a", 2, 8, 1), Holding("b", 1, 4, 8)]
    candidate = Holding("c", 1, 4, 8)
    oracle = PeakOracle(lambda: (running, candidate), block_size=4, ahead=0)
    # peak with the candidate: t=0 2+1+1 = 4; t=7: b 3 + c 3 = 6 -> reserve 6 - (2+1+1) = 2
    assert oracle.reserve(running, candidate) == 2
    assert oracle.fdsched_estimate_reserve_blocks("a", 100, 0, 0.5, 4096, 4) == 2
    assert oracle.fdsched_estimate_reserve_blocks("b", 100, 0, 0.5, 4096, 4) == 0
    assert oracle.decisions == 1 and oracle.calls == 2
    # a running chunk: the candidate is itself running, counted once
    assert oracle.reserve(running, Holding("b", 1, 4, 8)) == max(0, peak_demand_blocks(running, 4, 0) - 3)


# --------------------------------------------------------------------------------------------
# SGLang's retract order
# --------------------------------------------------------------------------------------------
def test_sglang_victim_fewest_outputs_then_longest_prompt():
    cands = [VictimCandidate("a", True, False), VictimCandidate("b", True, False), VictimCandidate("c", False, False),
             VictimCandidate("d", True, True), VictimCandidate("e", True, False)]
    lengths = {"a": (5, 100), "b": (2, 50), "c": (0, 900), "d": (0, 900), "e": (2, 80)}.get
    assert sglang_victim(cands, lengths, decode_only=True) == 4  # e: 2 outputs, longer prompt than b
    assert sglang_victim(cands, lengths, decode_only=False) == 2  # c: a prefill may go when not decode-only
    assert sglang_victim(cands[3:4], lengths, decode_only=True) is None  # extend tables: never


# --------------------------------------------------------------------------------------------
# The held-out split
# --------------------------------------------------------------------------------------------
def test_the_split_names_two_evaluation_windows_and_every_reference_arm():
    plan = load_windows()
    assert [w.name for w in plan.windows] == ["eval-conv", "eval-code"]
    for arm in ("baseline", "recommended", "adaptive", "optimism", "upstream-clip", "oracle", "unbounded"):
        assert arm in plan.arms
    assert plan.arms[0] == "baseline"
    for w in plan.windows:
        assert w.max_tokens == ("unset", "true")
        for t in plan.tuning:  # evaluation windows never overlap a tuning window
            if t["source"] == w.source:
                assert w.start >= t["start"] + t["duration"]
    assert "git clone https://github.com/Azure/AzurePublicDataset" in missing_csv_message(plan.windows[0], __import__("pathlib").Path("x"))


def test_the_shipped_evaluation_traces_are_the_windows_of_the_split():
    plan = load_windows()
    shipped = shipped_traces()
    for w in plan.windows:
        for mode in w.max_tokens:
            name = window_trace_name(w, mode)
            path = shipped[name]
            assert path.stat().st_size < 300_000
            trace = load_trace(path)
            gen = trace.generator
            assert (gen["start_s"], gen["duration_s"], gen["rate_scale"], gen["max_tokens"]) == (
                w.start, w.duration, w.rate_scale, mode)
            assert gen["source_file"] == w.file
            assert {k: trace.engine[k] for k in w.engine} == w.engine
            if mode == "true":
                assert all(r.max_tokens == r.output_len for r in trace.requests)
            else:
                assert all(r.max_tokens is None for r in trace.requests)
            assert "CC-BY-4.0" in trace.description


def test_a_bad_windows_file_is_one_error_naming_the_key(tmp_path):
    bad = tmp_path / "w.yaml"
    bad.write_text("sources: {s: {file: x.csv, format: azure}}\nevaluation:\n  - {name: e, source: nope, engine: {}}\n")
    with pytest.raises(TraceError, match=r"evaluation\[0\]: source 'nope'"):
        load_windows(bad)
    bad.write_text("sources: {s: {file: x.csv, format: azure}}\nevaluation:\n  - {name: e, source: s, engine: {}, max_tokens: [sometimes]}\n")
    with pytest.raises(TraceError, match="max_tokens 'sometimes'; allowed: unset, true"):
        load_windows(bad)


def test_eval_table_has_one_row_per_arm_and_bound_ratios():
    def entry(name, thr):
        return {"profile": name, "figures": {"ttft_ms_p50": 10.0, "e2e_ms_p99": 100.0, "stall_ms_p99": 5.0,
                                             "throughput_tokens_per_s": thr, "preemptions": 0,
                                             "invariant_violations": 0}}

    text = format_eval_table([("w", [entry("baseline", 50.0), entry("oracle", 100.0), entry("unbounded", 200.0)])])
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["trace", "arm"]
    base = next(line for line in lines if " baseline " in line)
    assert "0.50" in base and "0.25" in base and " ref" in base
    assert len(EVAL_COLUMNS) == 8


def test_eval_list_prints_the_split_without_a_host(capsys):
    from fdsched.tools.cli import main

    assert main(["eval", "--list"]) == 0
    out = capsys.readouterr().out
    assert "evaluation: eval-conv:" in out and "eval-code-unset, eval-code-true" in out
    assert "arms: baseline, recommended, adaptive, optimism, upstream-clip, sglang-retract, oracle, unbounded" in out


def test_eval_rejects_a_bad_arm_and_a_missing_csv_says_where_to_get_it(tmp_path, capsys):
    from fdsched.tools.cli import main

    assert main(["eval", "--arms", "no-such-profile", "--out", str(tmp_path)]) == 1
    assert "unknown profile" in capsys.readouterr().err
    from fdsched.replay.evaluate import import_window

    window = load_windows().windows[0]
    with pytest.raises(TraceError, match="not found; get it with: git clone https://github.com/Azure/AzurePublicDataset"):
        import_window(window, "unset", tmp_path, tmp_path)
    (tmp_path / window.file).write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceError, match="has sha256 .*allowed: the file the split names"):
        import_window(window, "unset", tmp_path, tmp_path)


def test_eval_rejects_an_unknown_cost_model_before_anything_runs(tmp_path, capsys):
    from fdsched.tools.cli import main

    assert main(["eval", "--cost-model", "no-such-model", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "--cost-model" in err and "no-such-model" in err and "llama2-7b-a100" in err
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


def _write_eval_report(path, arms, commit="d38eeb8", model="llama2-7b-a100"):
    import json

    profiles = [{"profile": name, "cost_model": {"model": model},
                 "figures": {"ttft_ms_p50": ttft, "e2e_ms_p99": 100.0, "stall_ms_p99": 5.0, "stall_ms_max": 5.0,
                             "tpot_ms_p99": 1.0, "throughput_tokens_per_s": thr, "preemptions": 0,
                             "preemptions_prefill_victims": 0, "invariant_violations": 0}}
                for name, ttft, thr in arms]
    path.write_text(json.dumps({"profiles": profiles, "host": {"commit": commit}}))


def test_eval_table_from_earlier_runs_in_the_split_order_and_markdown(tmp_path, capsys):
    from fdsched.tools.cli import main

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    arms = [("baseline", 10.0, 50.0), ("adaptive", 5.0, 60.0), ("oracle", 5.0, 100.0), ("unbounded", 1.0, 200.0)]
    _write_eval_report(one / "azure-conv.report.json", arms)
    _write_eval_report(one / "eval-conv-unset.report.json", [("baseline", 99.0, 1.0)])
    _write_eval_report(two / "eval-conv-unset.report.json", arms)  # the later directory wins
    assert main(["eval", "--table-from", str(one), str(two), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "cost model: llama2-7b-a100; host: d38eeb8"
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| trace | arm | TTFT p50")
    assert rows[1].startswith("| eval-conv-unset | baseline | 10.00 |")  # split order: windows before shipped
    assert rows[2].startswith("|  | adaptive | 5.00 |") and "| 0.60 | 0.30 | better |" in rows[2]
    assert any(r.startswith("| azure-conv | baseline |") for r in rows)
    assert "99.0" not in out
    assert main(["eval", "--table-from", str(one), "--only", "azure-conv"]) == 0
    assert "eval-conv-unset" not in capsys.readouterr().out.split("\n", 1)[1]


def test_eval_only_and_table_from_reject_bad_values(tmp_path, capsys):
    from fdsched.tools.cli import main

    assert main(["eval", "--only", "no-such-trace", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "--only: bad value 'no-such-trace'" in err and "allowed: eval-conv-unset, eval-conv-true" in err
    assert main(["eval", "--table-from", str(tmp_path)]) == 1
    assert "--table-from: bad value" in capsys.readouterr().err
    (tmp_path / "x.report.json").write_text("{not json")
    assert main(["eval", "--table-from", str(tmp_path)]) == 1
    assert "not a report.json of fdsched eval" in capsys.readouterr().err

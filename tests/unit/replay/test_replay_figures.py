"""Cost model, percentiles and the figures computed from a run. No host."""

from __future__ import annotations

import math

import pytest

from fdsched.replay.costmodel import StepCost, cost_from_settings, step_times
from fdsched.replay.figures import ProfileRun, RequestRow, StepRow, compute_figures, measured_figures, mean, percentile


def test_step_cost_formula_and_validation():
    cost = StepCost(fixed_ms=2.0, per_prefill_token_ms=0.5, per_decode_request_ms=3.0)
    assert cost.step_ms(0, 0) == 2.0
    assert cost.step_ms(10, 2) == 2.0 + 5.0 + 6.0
    with pytest.raises(ValueError, match="fixed_ms=-1"):
        StepCost(fixed_ms=-1)
    with pytest.raises(ValueError, match="per_prefill_token_ms"):
        StepCost(per_prefill_token_ms=float("nan"))
    assert cost.to_json() == {
        "model": "linear", "step_fixed_ms": 2.0, "per_prefill_token_ms": 0.5, "per_decode_request_ms": 3.0,
        "token_floor_ms": 0.0, "per_prefill_context_token_ms": 0.0, "per_decode_context_token_ms": 0.0,
    }


def test_cost_from_settings_with_overrides():
    settings = {"replay.step_fixed_ms": 5.0, "replay.per_prefill_token_ms": 0.02, "replay.per_decode_request_ms": 0.1}
    assert cost_from_settings(settings) == StepCost(5.0, 0.02, 0.1)
    assert cost_from_settings(settings, {"step_fixed_ms": 1.0, "per_decode_request_ms": None}) == StepCost(1.0, 0.02, 0.1)
    with pytest.raises(KeyError, match="unknown cost key"):
        cost_from_settings(settings, {"fixed": 1.0})


def test_step_times_accumulate():
    starts, ends = step_times(StepCost(1.0, 1.0, 1.0), [0, 4, 0], [0, 1, 2])
    assert starts == [0.0, 1.0, 7.0]
    assert ends == [1.0, 7.0, 10.0]


def test_percentile_linear_interpolation():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([7], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1], 101)
    assert mean([1, 2, 6]) == 3.0 and mean([]) is None


def _run(drained=True):
    cost = StepCost(fixed_ms=1.0, per_prefill_token_ms=0.1, per_decode_request_ms=1.0)
    run = ProfileRun(profile="p", num_gpu_blocks=10, cost=cost, drained=drained)
    # step: prefill tokens, decode tokens -> step ms = 1 + 0.1*prefill + decode
    run.steps = [
        StepRow(0, prefill_tokens=10, decode_tokens=0, blocks_used=4),  # 2 ms, ends 2
        StepRow(1, prefill_tokens=0, decode_tokens=1, blocks_used=6, preempted=[("b", "prefill")]),  # 2 ms, ends 4
        StepRow(2, prefill_tokens=20, decode_tokens=1, blocks_used=8, violations=["x"]),  # 4 ms, ends 8
        StepRow(3, prefill_tokens=0, decode_tokens=2, blocks_used=2, preempted=[("a", "decode")]),  # 3 ms, ends 11
    ]
    run.requests = [
        # a: prompt 10, 4 tokens hit, scheduled 6 + 9 prefill tokens -> recomputed 15 - 6 = 9
        RequestRow("a", arrival=0, prompt_len=10, target_output=3, output_tokens=3, prefill_tokens=15,
                   cache_hit_tokens=4, first_token_step=0, finish_step=3, finish_count=1),
        # b: prompt 20, no hit, scheduled 20 -> recomputed 0; arrives at step 1 (t=2), first token at end of 2 (t=8)
        RequestRow("b", arrival=1, prompt_len=20, target_output=1, output_tokens=1, prefill_tokens=20,
                   cache_hit_tokens=0, first_token_step=2, finish_step=2, finish_count=1),
        # c: never admitted
        RequestRow("c", arrival=3, prompt_len=5, target_output=2),
    ]
    run.request_violations = ["lost c"]
    run.admissions_blocked = 7
    return run


def test_compute_figures_by_hand():
    f = compute_figures(_run())
    assert f["steps"] == 4 and f["steps_to_drain"] == 4 and f["drained"] is True
    assert (f["preemptions"], f["preemptions_decode_victims"], f["preemptions_prefill_victims"]) == (2, 1, 1)
    assert f["recomputed_prompt_tokens"] == 9
    assert f["prefix_hit_tokens"] == 4 and f["prompt_tokens"] == 35
    assert f["prefix_hit_rate"] == pytest.approx(4 / 35, abs=1e-6)
    assert f["decode_tokens_per_step_mean"] == 1.0
    assert f["blocks_in_use_peak"] == 8 and f["blocks_in_use_mean"] == 5.0 and f["blocks_total"] == 10
    assert f["modelled_seconds"] == 0.011
    assert f["output_tokens"] == 4
    assert f["throughput_tokens_per_s"] == pytest.approx(4 / 0.011, abs=1e-3)
    # TTFT: a = end(0) - start(0) = 2; b = end(2) - start(1) = 8 - 2 = 6
    assert f["ttft_ms_p50"] == 4.0 and f["ttft_ms_p99"] == pytest.approx(2 + 4 * 0.99)
    # TPOT: a = (end(3) - end(0)) / (3 - 1) = (11 - 2) / 2; b has one token: no TPOT
    assert f["tpot_ms_p50"] == 4.5 and f["tpot_ms_p99"] == 4.5
    assert f["invariant_violations"] == 2
    assert f["requests_finished"] == 2
    assert f["admissions_blocked"] == 7


def test_not_drained_has_no_steps_to_drain_and_measured_is_apart():
    run = _run(drained=False)
    run.stop_reason = "max_steps=4 reached"
    f = compute_figures(run)
    assert f["steps_to_drain"] is None and f["stop_reason"] == "max_steps=4 reached"
    run.steps[1].schedule_cpu_s = 0.004
    run.steps[2].schedule_wall_s = 0.010
    assert compute_figures(run) == f  # timings never reach the logical figures
    m = measured_figures(run)
    assert m["schedule_cpu_ms_mean"] == pytest.approx(1.0)
    assert m["schedule_wall_ms_p99"] == pytest.approx(10.0 * 0.99 + 0.0, rel=0.05)


def test_recomputed_never_negative_and_unadmitted_requests_ignored():
    run = _run()
    run.requests[1].cache_hit_tokens = 0
    run.requests[1].prefill_tokens = 12  # preempted, then readmitted with a bigger hit than the first time
    f = compute_figures(run)
    assert f["recomputed_prompt_tokens"] == 9


def test_empty_run():
    run = ProfileRun(profile="p", num_gpu_blocks=4, cost=StepCost())
    f = compute_figures(run)
    assert f["throughput_tokens_per_s"] is None and f["prefix_hit_rate"] is None and f["ttft_ms_p50"] is None
    assert math.isclose(f["modelled_seconds"], 0.0)


def test_time_based_ttft_counts_from_the_arrival_time_and_idle_gaps_are_skipped():
    from fdsched.replay.costmodel import StepCost
    from fdsched.replay.figures import ProfileRun, RequestRow, StepRow, compute_figures

    run = ProfileRun(profile="p", num_gpu_blocks=8, cost=StepCost(10.0, 0.0, 0.0))
    # Step 0 at 0..10 ms; nothing runs until the next arrival at 1000 ms: step 1 runs 1000..1010.
    run.steps = [StepRow(0, prefill_tokens=4), StepRow(1, prefill_tokens=4, gap_ms=990.0)]
    run.requests = [
        RequestRow("a", 0, 4, 1, output_tokens=1, first_token_step=0, finish_step=0, finish_count=1, arrival_ms=0.0),
        RequestRow("b", 0, 4, 1, output_tokens=1, first_token_step=1, finish_step=1, finish_count=1, arrival_ms=995.0),
    ]
    figures = compute_figures(run)
    assert figures["modelled_seconds"] == 1.01
    assert figures["ttft_ms_p50"] == pytest.approx((10.0 + 15.0) / 2)

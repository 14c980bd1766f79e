"""Which arm to ship (issue 18): every shippable arm against the best one, per trace and figure
(fdsched.replay.armcompare.compare_arms, its reader and printer). No host."""

from __future__ import annotations

import json

import pytest

from fdsched.replay.armcompare import compare_arms, format_comparison
from fdsched.replay.evaluate import load_arm_results, main
from fdsched.replay.trace import TraceError


def _fig(thr, ttft, e2e, stall, preempt=0, victims=0, requests=1000):
    return {"throughput_tokens_per_s": thr, "ttft_ms_p50": ttft, "e2e_ms_p99": e2e, "stall_ms_p99": stall,
            "preemptions": preempt, "preemptions_prefill_victims": victims, "requests": requests}


def _trace(**arms):
    return [{"profile": name.replace("_", "-"), "figures": f} for name, f in arms.items()]


def _row(comparison, trace, arm):
    t = next(t for t in comparison["traces"] if t["trace"] == trace)
    return next(r for r in t["rows"] if r["arm"] == arm)


def test_best_per_figure_direction_and_the_two_percent_band():
    results = [("w", _trace(
        baseline=_fig(1000, 100, 1000, 50, preempt=10),
        adaptive=_fig(985, 101.9, 1019, 50.9, preempt=2),  # every figure within 2% / 1 per 1k of the best
        optimism=_fig(1005, 100, 990, 600, preempt=400),  # best thr and E2E; stalls far outside
        oracle=_fig(2000, 1, 1, 1),  # a bound: never the best
    ))]
    c = compare_arms(results)
    a = _row(c, "w", "adaptive")["cells"]
    assert a["thr"][1] == pytest.approx(985 / 1005) and a["thr"][2]  # 0.980x the best: in
    assert a["TTFT p50"][1] == pytest.approx(1.019) and a["TTFT p50"][2]  # best is 100 (baseline, optimism)
    assert a["E2E p99"][1] == pytest.approx(1019 / 990) and not a["E2E p99"][2]  # 2.9% above optimism's: out
    assert a["stall p99"][2] and a["preempt/1k"][2]  # best stall 50 (baseline); 2 per 1k is the best count
    assert _row(c, "w", "baseline")["cells"]["preempt/1k"][2] is False  # 10 per 1k, best 2: out
    assert _row(c, "w", "oracle")["within_all"] is None and _row(c, "w", "oracle")["bound"]
    assert c["within_everywhere"] == []  # adaptive misses E2E by 0.9%; nobody is within everywhere


def test_counts_near_zero_use_the_absolute_band_and_an_arm_within_everywhere_is_named():
    results = [
        ("w1", _trace(recommended=_fig(1000, 100, 1000, 50, preempt=0), adaptive=_fig(990, 101, 1010, 50.5, preempt=1))),
        ("w2", _trace(recommended=_fig(1000, 300, 1000, 50, preempt=0), adaptive=_fig(1000, 100, 1000, 50, preempt=2))),
    ]
    c = compare_arms(results)
    # w1: adaptive's 1 preemption per 1k is within 1 per 1k of recommended's 0 (no relative band around 0).
    assert _row(c, "w1", "adaptive")["within_all"] is True
    assert _row(c, "w1", "adaptive")["cells"]["preempt/1k"][1] is None  # no ratio to a best of 0
    # w2: 2 per 1k is outside; recommended's TTFT is 3x adaptive's: outside too.
    assert _row(c, "w2", "adaptive")["within_all"] is False and _row(c, "w2", "recommended")["within_all"] is False
    assert c["within_everywhere"] == []
    results[1] = ("w2", _trace(recommended=_fig(1000, 300, 1000, 50), adaptive=_fig(1000, 100, 1000, 50, preempt=1)))
    assert compare_arms(results)["within_everywhere"] == ["adaptive"]


def test_an_arm_missing_from_a_trace_is_not_within_everywhere():
    same = _fig(1000, 100, 1000, 50)
    results = [("w1", _trace(adaptive=same, baseline=same)), ("w2", _trace(baseline=same))]
    assert compare_arms(results)["within_everywhere"] == ["baseline"]  # adaptive did not run on w2


def _write(tmp_path, d, trace, profiles, host="d38eeb8334331b903fb34c9cd270ff0c58a48adf", model="linear"):
    folder = tmp_path / d
    folder.mkdir(exist_ok=True)
    report = {"host": {"commit": host},
              "profiles": [{"profile": p, "figures": f, "cost_model": {"model": model}} for p, f in profiles]}
    (folder / f"{trace}.report.json").write_text(json.dumps(report), encoding="utf-8")
    return folder


def test_reports_merge_per_arm_a_later_directory_wins_and_cost_models_must_match(tmp_path, capsys):
    first = _write(tmp_path, "all", "eval-conv-unset", [("baseline", _fig(1000, 100, 1000, 50)),
                                                         ("adaptive", _fig(900, 200, 2000, 60))])
    second = _write(tmp_path, "fixed", "eval-conv-unset", [("adaptive", _fig(1000, 100, 1000, 50))])
    results = load_arm_results([first, second])
    arms = {a["profile"]: a for a in results[0][1]}
    assert set(arms) == {"baseline", "adaptive"}  # baseline stays from the first run
    assert arms["adaptive"]["figures"]["ttft_ms_p50"] == 100 and arms["adaptive"]["dir"] == str(second)
    assert compare_arms(results)["within_everywhere"] == ["baseline", "adaptive"]
    assert main(["--compare", str(first), str(second)]) == 0
    out = capsys.readouterr().out
    assert "within on every figure of every trace: baseline, adaptive" in out and "host commit(s): d38eeb833" in out
    preset = _write(tmp_path, "preset", "eval-conv-unset", [("optimism", _fig(1, 1, 1, 1))], model="llama2-7b-a100")
    with pytest.raises(TraceError, match="eval-conv-unset: arms ran under different cost models"):
        load_arm_results([first, preset])
    with pytest.raises(TraceError, match="--compare: bad value"):
        load_arm_results([tmp_path / "nothing-here"])
    assert main(["--compare", str(tmp_path / "nothing-here")]) == 1
    assert "no <trace>.report.json" in capsys.readouterr().err


def test_the_printed_table_marks_what_is_outside():
    results = [("w", _trace(baseline=_fig(1000, 100, 1000, 50, preempt=10), adaptive=_fig(1000, 100, 1000, 50)))]
    text = format_comparison(compare_arms(results))
    baseline_line = next(line for line in text.splitlines() if " baseline " in line)
    assert baseline_line.count("*") == 1 and baseline_line.rstrip().endswith("no")
    assert "within on every figure of every trace: adaptive" in text
    assert "(arm within/cells): baseline 5/6, adaptive 6/6" in text
    assert "  baseline: thr 1.000, TTFT p50 1.000, E2E p99 1.000, stall p99 1.000, preempt/1k +10.0" in text
    md = format_comparison(compare_arms(results), markdown=True)
    assert md.splitlines()[0].startswith("| trace | arm | thr |")

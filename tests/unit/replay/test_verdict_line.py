"""The verdict line (one definition, ``fdsched.replay.verdict.verdict_line``) and every output that ends with it:
the replay table, ``fdsched eval``, the served report, ``fdsched ab report``, the PNG. No host."""

from __future__ import annotations

from pathlib import Path

import pytest

from fdsched.replay.plot import ARM_COLORS, QUEUE_COLORS, arm_color
from fdsched.replay.report import build_report
from fdsched.replay.verdict import (
    SMALL_EVENTS, SMALL_REQUESTS, VERDICT_WIDTH, change_words, format_verdicts, verdict_line, verdict_lines,
)

REF = {"throughput_tokens_per_s": 1000.0, "ttft_ms_p50": 800.0, "e2e_ms_p99": 14000.0, "stall_ms_p99": 250.0,
       "preemptions_prefill_victims": 2, "requests_finished": 191}


def test_signs_follow_the_arm_minus_the_reference():
    arm = dict(REF, throughput_tokens_per_s=1030.0, ttft_ms_p50=360.0, e2e_ms_p99=13300.0, stall_ms_p99=250.4,
               preemptions_prefill_victims=0)
    line = verdict_line("adaptive", arm, "baseline", REF)
    assert line.splitlines() == [
        "  adaptive vs baseline, better: throughput +3%, TTFT p50 -55%, E2E p99 -5%, stall p99 same,",
        "      0 prefill victims (baseline 2)",
        "      noise in the prefill victims: 0 vs 2 (under 10 each) can be one request's timing",
    ]
    worse = verdict_line("recommended", dict(REF, throughput_tokens_per_s=920.0, ttft_ms_p50=2264.0), "baseline", REF)
    assert worse.startswith("  recommended vs baseline, worse: throughput -8%, TTFT p50 +183% (2.83x), E2E p99 same")


def test_every_line_fits_a_terminal_and_noise_lines_name_what_they_qualify():
    long = verdict_line("a-profile-with-a-long-name", dict(REF, ttft_ms_p50=58400.0, requests_finished=24,
                                                           preemptions_prefill_victims=0),
                        "another-long-reference-name", dict(REF, requests_finished=24))
    lines = long.splitlines()
    assert len(lines) >= 3 and all(len(line) <= VERDICT_WIDTH for line in lines)
    assert all(line.startswith("      ") for line in lines[1:])
    noise = [line.strip() for line in lines if "noise" in line]
    assert noise == [
        "noise in the p99 figures: 24 requests (under 100), so a p99 is the slowest one or two",
        "noise in the prefill victims: 0 vs 2 (under 10 each) can be one request's timing",
    ]
    heading = verdict_lines([{"profile": "b", "figures": REF}, {"profile": "a", "figures": REF}])[0]
    assert all(len(line) <= VERDICT_WIDTH for line in heading.splitlines())


@pytest.mark.parametrize("ttft, stall, word", [
    (800.0 * 73, 100.0, "worse"),  # 73x on TTFT, stalls better: the factor decides, never mixed
    (800.0 * 2.01, 100.0, "worse"),
    (800.0 * 1.99, 100.0, "mixed"),  # under the factor: a trade
    (400.0, 250.0 * 3, "worse"),
])
def test_a_figure_worse_by_more_than_the_factor_is_never_mixed(ttft, stall, word):
    from fdsched.replay.verdict import VERDICT_DOMINANT_FACTOR, verdict

    assert VERDICT_DOMINANT_FACTOR == 2.0
    arm = dict(REF, ttft_ms_p50=ttft, stall_ms_p99=stall)
    assert verdict(arm, REF)[0] == word
    assert f"vs baseline, {word}: " in verdict_line("x", arm, "baseline", REF)


def test_singular_counts():
    line = verdict_line("a", dict(REF, preemptions_prefill_victims=1), "b", REF)
    assert "1 prefill victim (b 2)" in line and "1 prefill victims" not in line


def test_change_words_edges():
    assert change_words("x", 100.4, 100.0) == "x same"  # rounds to 0%
    assert change_words("x", 99.4, 100.0) == "x -1%"
    assert change_words("x", 0, 0) == "x same"
    assert change_words("x", 12.5, 0) == "x 0 -> 12.50"
    assert change_words("x", None, 5.0) == "x n/a" and change_words("x", 5.0, None) == "x n/a"
    assert change_words("x", 300.0, 100.0) == "x +200% (3.00x)"
    assert change_words("x", 200.0, 100.0) == "x +100%"  # the factor shows only where it decides the verdict


def test_the_word_is_the_existing_classification():
    mixed = dict(REF, ttft_ms_p50=400.0, stall_ms_p99=400.0)  # wins TTFT, loses stalls (by less than 2x)
    assert ", mixed: " in verdict_line("optimism", mixed, "baseline", REF)
    assert ", same: " in verdict_line("b", dict(REF, ttft_ms_p50=820.0), "baseline", REF)


@pytest.mark.parametrize("n, caveat", [(SMALL_REQUESTS - 1, True), (SMALL_REQUESTS, False)])
def test_the_request_caveat_names_what_small_is(n, caveat):
    line = verdict_line("a", dict(REF, requests_finished=n, preemptions_prefill_victims=2), "b", dict(REF, requests_finished=n))
    assert (f"{n} requests (under {SMALL_REQUESTS}), so a p99 is the slowest one or two" in line) is caveat
    assert ("noise in the p99 figures" in line) is caveat


@pytest.mark.parametrize("mine, theirs, caveat", [
    (0, SMALL_EVENTS - 1, True), (0, SMALL_EVENTS, False), (3, 3, False), (0, 0, False), (SMALL_EVENTS + 5, 1, False),
])
def test_the_victim_caveat_only_for_small_differing_counts(mine, theirs, caveat):
    line = verdict_line("a", dict(REF, preemptions_prefill_victims=mine), "b",
                        dict(REF, preemptions_prefill_victims=theirs))
    assert f"{mine} prefill victims (b {theirs})" in line
    assert (f"(under {SMALL_EVENTS} each)" in line) is caveat


def test_missing_figures_say_na_and_the_word_says_what_it_read():
    partial = {"ttft_ms_p50": 500.0, "preemptions_prefill_victims": 0, "requests_finished": 150}
    ref = {"ttft_ms_p50": 1000.0, "preemptions_prefill_victims": 0, "requests_finished": 150}
    line = verdict_line("r", partial, "b", ref)
    assert " ".join(line.split()).startswith(
        "r vs b, better (on TTFT p50 only): throughput n/a, TTFT p50 -50%, E2E p99 n/a")
    assert "prefill victims n/a" in verdict_line("r", {"ttft_ms_p50": 1.0}, "b", {"ttft_ms_p50": 1.0})
    assert ", n/a: " in verdict_line("r", {}, "b", {})


def test_verdict_lines_heading_reference_and_one_arm():
    profiles = [{"profile": n, "figures": dict(REF)} for n in ("a", "b", "c")]
    lines = verdict_lines(profiles, reference="b")
    assert lines[0].startswith("verdict vs b: TTFT p50, E2E p99 and stall p99 read together")
    assert [line.split(",")[0].strip() for line in lines[1:]] == ["a vs b", "c vs b"]
    assert "worse: one worse by more than 2x" in " ".join(lines[0].split())
    assert verdict_lines(profiles[:1]) == []


# --------------------------------------------------------------------------------------------
# Every output ends with the same lines
# --------------------------------------------------------------------------------------------
def _profiles():
    return [{"profile": "baseline", "figures": dict(REF)},
            {"profile": "adaptive", "figures": dict(REF, ttft_ms_p50=360.0, preemptions_prefill_victims=0)}]


def test_eval_table_ends_with_the_lines_per_trace():
    from fdsched.replay.evaluate import format_eval_table

    text = format_eval_table([("t1", _profiles())])
    assert text.rstrip().endswith(verdict_line("adaptive", _profiles()[1]["figures"], "baseline", REF))
    assert "verdict (t1) vs baseline" in text


def test_served_table_ends_with_the_lines():
    from fdsched.serve.served_report import BETTER, format_served_table

    profiles = [dict(p, url="http://x", errors=[], server={"plugin_arms_on_metrics": [], "scrape_error": None})
                for p in _profiles()]
    report = {"profiles": profiles, "better": BETTER, "trace": {"name": "t", "requests": 191},
              "load": {"time_scale": 1.0, "step_ms": None, "split_seed": 0}}
    text = format_served_table(report)
    assert text.rstrip().endswith(verdict_line("adaptive", profiles[1]["figures"], "baseline", REF))


def test_ab_report_ends_with_the_lines(capsys):
    from fdsched.tools.abreport import cmd_report

    scrape = Path(__file__).resolve().parents[1] / "data" / "ab-scrape-old-host.prom"
    assert cmd_report(type("A", (), {"scrape": [str(scrape)], "since": None, "reference": None})()) == 0
    last = capsys.readouterr().out.rstrip().splitlines()[-4:]
    # the fixture: baseline 2 prefill victims of 24 requests, recommended 0; TTFT p50 5000 -> 5556 ms
    assert last == [
        "  recommended vs baseline, worse (on TTFT p50 only): throughput n/a, TTFT p50 +11%, E2E p99 n/a,",
        "      stall p99 n/a, 0 prefill victims (baseline 2)",
        "      noise in the p99 figures: 24 requests (under 100), so a p99 is the slowest one or two",
        "      noise in the prefill victims: 0 vs 2 (under 10 each) can be one request's timing",
    ]


def test_replay_report_lines_are_the_same_function():
    report = {"profiles": _profiles()}
    text = format_verdicts(report)
    assert text.endswith("\n" + verdict_line("adaptive", _profiles()[1]["figures"], "baseline", REF))


# --------------------------------------------------------------------------------------------
# The PNG: one colour per arm everywhere, greys for queue states, four arms, the verdict in the figure
# --------------------------------------------------------------------------------------------
def _four_arm_report():
    from tests.unit.replay.test_replay_measure import _preempted_run

    runs = []
    for name in ("baseline", "recommended", "adaptive", "oracle"):
        run = _preempted_run()
        run.profile = name
        runs.append(run)
    return build_report({"name": "t", "description": "", "requests": 2, "sha256": "0"}, {"num_gpu_blocks": 10}, runs)


def _captured_figure(monkeypatch, report, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from fdsched.replay.plot import write_plot

    seen = []
    original = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: (seen.append(self), original(self, *a, **k))[1])
    write_plot(report, str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    return seen[0]


def test_four_arms_one_colour_each_in_every_panel(monkeypatch, tmp_path):
    from matplotlib.colors import to_hex

    report = _four_arm_report()
    fig = _captured_figure(monkeypatch, report, tmp_path)
    axes = fig.get_axes()
    timelines = [ax for ax in axes if ax.get_title(loc="left")]
    assert len(timelines) == 4
    for i, ax in enumerate(timelines):
        assert report["profiles"][i]["profile"] in ax.get_title(loc="left")
        # the arm's own lines in its colour, nothing else in an arm colour except its own
        colours = {to_hex(line.get_color()) for line in ax.get_lines() if line.get_linestyle() != ":"}
        assert colours == {arm_color(i)}
        assert to_hex(ax._left_title.get_color()) == arm_color(i)  # set_title(loc="left")
    # queue states: greys on the twin axes, never an arm colour
    queue = {to_hex(line.get_color()) for ax in axes for line in ax.get_lines() if ax.get_ylabel() == "requests"}
    assert queue == {QUEUE_COLORS["running"]} and not queue & set(ARM_COLORS)
    # the overlaid panels: arm i drawn in arm i's colour in each of them
    overlaid = [ax for ax in axes if ax.get_ylabel() in ("requests completed", "fraction of requests")]
    assert len(overlaid) == 5
    for ax in overlaid:
        assert [to_hex(line.get_color()) for line in ax.get_lines()] == [arm_color(i) for i in range(4)]
    # with four arms there is no dashed "held by requests" line
    assert not any(line.get_linestyle() == "--" for ax in axes for line in ax.get_lines())
    # the verdict lines are in the figure, each arm's in its colour
    texts = {t.get_text(): to_hex(t.get_color()) for ax in axes for t in ax.texts}
    for i, name in enumerate(("recommended", "adaptive", "oracle"), start=1):
        line = next(t for t in texts if t.startswith(f"{name} vs baseline, same:"))
        assert texts[line] == arm_color(i)
    # the legend tells the arm's solid KV line from the grey dash-dot running line
    legend = {t.get_text(): h for t, h in zip(fig.legends[0].get_texts(), fig.legends[0].legend_handles)}
    kv = next(h for t, h in legend.items() if t.startswith("KV blocks in use"))
    running = next(h for t, h in legend.items() if t.startswith("running requests"))
    assert (kv.get_linestyle(), running.get_linestyle()) == ("-", "-.")
    assert to_hex(running.get_color()) == QUEUE_COLORS["running"] and to_hex(kv.get_color()) != to_hex(running.get_color())
    # a running-requests line drawn in the figure has the legend's style
    assert {line.get_linestyle() for ax in axes if ax.get_ylabel() == "requests" for line in ax.get_lines()} == {"-."}


def test_two_arms_keep_the_held_line(monkeypatch, tmp_path):
    report = _four_arm_report()
    report["profiles"] = report["profiles"][:2]
    fig = _captured_figure(monkeypatch, report, tmp_path)
    assert sum(line.get_linestyle() == "--" for ax in fig.get_axes() for line in ax.get_lines()) == 2

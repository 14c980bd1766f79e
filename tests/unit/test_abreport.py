"""`fdsched ab report` on recorded expositions (made with prometheus_client's own writer). No host."""

from __future__ import annotations

import pytest

from fdsched.cmdline.scrape import ABReportError, Histogram, parse_exposition
from fdsched.tools.abreport import arm_figures, format_report
from fdsched.tools.cli import main

prometheus_client = pytest.importorskip("prometheus_client")  # the test extra installs it


_WRITER = r"""
import json, sys
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

per_arm = json.loads(sys.argv[1])
reg = CollectorRegistry()
buckets = (0.01, 0.05, 0.1, 0.5, 1, 5)
ttft = Histogram("fastdeploy:fdsched_ttft_seconds", "ttft", ["arm", "dp_rank"], registry=reg, buckets=buckets)
tpot = Histogram("fastdeploy:fdsched_tpot_seconds", "tpot", ["arm", "dp_rank"], registry=reg, buckets=buckets)
fin = Counter("fastdeploy:fdsched_requests_finished_total", "f", ["arm", "dp_rank"], registry=reg)
pre = Counter("fastdeploy:fdsched_preemptions_total", "p", ["arm", "dp_rank", "victim_phase"], registry=reg)
rec = Counter("fastdeploy:fdsched_recomputed_tokens_total", "r", ["arm", "dp_rank"], registry=reg)
Counter("fastdeploy:fdsched_evicted_blocks_total", "no arm label", registry=reg).inc(5)
for arm, (rank, ttfts, tpots, preempt, recomputed) in per_arm.items():
    for v in ttfts:
        ttft.labels(arm, rank).observe(v)
        fin.labels(arm, rank).inc()
    for v in tpots:
        tpot.labels(arm, rank).observe(v)
    for phase, n in preempt.items():
        pre.labels(arm, rank, phase).inc(n)
    rec.labels(arm, rank).inc(recomputed)
sys.stdout.write(generate_latest(reg).decode())
"""


def exposition(per_arm):
    """A scrape with the plugin's per-arm series, written by prometheus_client itself.

    per_arm = {arm: (rank, ttfts, tpots, preemptions by phase, recomputed tokens)}. Written in a clean process:
    where PROMETHEUS_MULTIPROC_DIR is set (a host tier in the same run), prometheus_client keeps values in
    per-process files that two registries of one process would share.
    """
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    proc = subprocess.run([sys.executable, "-c", _WRITER, json.dumps(per_arm)], env=env, capture_output=True, text=True,
                          check=True, timeout=60)
    return proc.stdout


TEXT = exposition(
    {
        "baseline": ("0", [0.2] * 50 + [2.0] * 50, [0.02] * 100, {"decode": 3, "prefill": 2}, 400),
        "recommended": ("1", [0.2] * 80 + [2.0] * 20, [0.02] * 100, {"decode": 1}, 0),
    }
)


def test_parse_keeps_arms_apart_and_ignores_unlabelled_series():
    arms = parse_exposition(TEXT)
    assert set(arms) == {"baseline", "recommended"}
    assert arms["baseline"].dp_ranks == {"0"} and arms["recommended"].dp_ranks == {"1"}
    assert arms["baseline"].counter("fastdeploy:fdsched_requests_finished") == 100
    assert arms["baseline"].counter("fastdeploy:fdsched_preemptions", victim_phase="prefill") == 2
    assert arms["baseline"].histograms["fastdeploy:fdsched_ttft_seconds"].count == 100


def test_figures_and_ratios():
    figures = {title: values for title, _better, values in arm_figures(parse_exposition(TEXT))}
    assert figures["requests finished"]["baseline"] == (100, 100)
    assert figures["preemptions / 1k requests"]["baseline"][0] == pytest.approx(50.0)
    assert figures["  prefill-phase victims / 1k requests"]["recommended"][0] == 0
    assert figures["recomputed tokens / request"]["baseline"][0] == pytest.approx(4.0)
    assert figures["TTFT mean (ms)"]["baseline"][0] == pytest.approx(1100.0)
    assert figures["TTFT mean (ms)"]["recommended"][0] == pytest.approx(560.0)
    # p50: the 50th of 100 observations lies in (0.1, 0.5] for both arms
    assert 100 < figures["TTFT p50 (ms)"]["baseline"][0] <= 500
    text = format_report(parse_exposition(TEXT), reference="baseline")
    line = next(l for l in text.splitlines() if l.startswith("TTFT mean (ms)"))
    assert "lower" in line and line.rstrip().endswith("0.51")  # 560 / 1100
    assert "(100)" in line  # the count behind the figure


def test_histogram_quantile_interpolates_like_prometheus():
    h = Histogram({0.1: 0.0, 0.5: 10.0, 1.0: 20.0, float("inf"): 20.0}, 20.0, 10.0)
    assert h.quantile(0.5) == pytest.approx(0.5)
    assert h.quantile(0.75) == pytest.approx(0.75)
    assert Histogram().quantile(0.5) is None


def test_since_reports_the_window(tmp_path, capsys):
    earlier = tmp_path / "t0.prom"
    later = tmp_path / "t1.prom"
    earlier.write_text(exposition({"baseline": ("0", [0.2] * 10, [], {}, 0), "recommended": ("1", [0.2] * 10, [], {}, 0)}))
    later.write_text(exposition({"baseline": ("0", [0.2] * 30, [], {}, 0), "recommended": ("1", [0.2] * 15, [], {}, 0)}))
    assert main(["ab", "report", str(later), "--since", str(earlier)]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("requests finished"))
    assert "20 (20)" in line and "5 (5)" in line and "0.25" in line


def test_bad_inputs_are_one_error(tmp_path, capsys):
    empty = tmp_path / "no-arms.prom"
    empty.write_text("# HELP x y\n# TYPE x counter\nx_total 1\n")
    assert main(["ab", "report", str(empty)]) == 1
    assert "no fdsched series with an arm label" in capsys.readouterr().err
    assert main(["ab", "report", str(tmp_path / "missing.prom")]) == 1
    assert "cannot be read" in capsys.readouterr().err
    good = tmp_path / "good.prom"
    good.write_text(TEXT)
    assert main(["ab", "report", str(good), "--reference", "nosuch"]) == 1
    assert "allowed: baseline, recommended" in capsys.readouterr().err
    with pytest.raises(ABReportError):
        parse_exposition("this is { not prometheus", "x")


# ---- a real scrape ---------------------------------------------------------------------------------------
# tests/unit/data/ab-scrape-old-host.prom: the host's own /metrics text (get_filtered_metrics) recorded from
# `python -m tests.host.ab_scenario` on the old host (e7c8dc2) with FDSCHED_PROFILE_BY_DP_RANK=0=baseline,1=recommended:
# rank 0 built in the process, rank 1 forked after it, 24 requests each under KV pressure.
RECORDED = __import__("pathlib").Path(__file__).parent / "data" / "ab-scrape-old-host.prom"


def test_report_on_a_recorded_host_scrape(capsys):
    arms = parse_exposition(RECORDED.read_text())
    assert sorted(arms) == ["baseline", "recommended"]
    assert arms["baseline"].dp_ranks == {"0"} and arms["recommended"].dp_ranks == {"1"}
    figures = {title: values for title, _, values in arm_figures(arms)}
    assert figures["requests finished"] == {"baseline": (24, 24), "recommended": (24, 24)}
    assert figures["  prefill-phase victims / 1k requests"]["recommended"][0] == 0
    assert figures["  prefill-phase victims / 1k requests"]["baseline"][0] == pytest.approx(2 / 24 * 1000)
    # baseline on the old host runs the host's own reservation: its refusals are not counted (n/a, not 0)
    assert figures["admissions blocked / request"]["baseline"][0] is None
    assert figures["admissions blocked / request"]["recommended"][0] > 0
    assert main(["ab", "report", str(RECORDED), "--reference", "baseline"]) == 0
    printed = capsys.readouterr().out
    assert "arms: baseline: dp_rank 0; recommended: dp_rank 1" in printed
    assert "recommended/baseline" in printed and "TPOT p90 (ms)" in printed


def test_several_scrapes_are_added_up(tmp_path, capsys):
    """multi_api_server: one /metrics per rank's api_server; the report takes them all."""
    one = exposition({"baseline": ("0", [0.2] * 10, [0.02] * 10, {"decode": 1}, 5)})
    two = exposition({"recommended": ("1", [0.2] * 20, [0.02] * 20, {}, 0),
                      "baseline": ("2", [0.2] * 5, [0.02] * 5, {"prefill": 1}, 3)})
    a, b = tmp_path / "a.prom", tmp_path / "b.prom"
    a.write_text(one)
    b.write_text(two)
    assert main(["ab", "report", str(a), str(b)]) == 0
    printed = capsys.readouterr().out
    assert "baseline: dp_rank 0, 2; recommended: dp_rank 1" in printed
    assert "15 (15)" in printed and "20 (20)" in printed
    empty = tmp_path / "empty.prom"
    empty.write_text("# nothing yet\n")
    assert main(["ab", "report", str(a), "--since", str(empty)]) == 0  # an earlier scrape may have no arm yet


# ---- FastDeploy's own histograms: E2E and token gaps (no arm label) ----------------------------------------
_HOST_WRITER = r"""
import json, sys
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

arms, e2e, gaps = json.loads(sys.argv[1])
reg = CollectorRegistry()
fin = Counter("fastdeploy:fdsched_requests_finished_total", "f", ["arm", "dp_rank"], registry=reg)
for arm, rank in arms:
    fin.labels(arm, rank).inc(len(e2e))
# FastDeploy's own buckets (fastdeploy/metrics/metrics.py, both hosts) and no labels
h_e2e = Histogram("fastdeploy:e2e_request_latency_seconds", "e2e", registry=reg, buckets=(
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0))
h_gap = Histogram("fastdeploy:time_per_output_token_seconds", "gap", registry=reg, buckets=(
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0))
for v in e2e:
    h_e2e.observe(v)
for v in gaps:
    h_gap.observe(v)
sys.stdout.write(generate_latest(reg).decode())
"""


def host_exposition(arms, e2e, gaps):
    """One server's scrape: ``arms`` [(arm, rank)] with the plugin's counter, and FastDeploy's unlabelled E2E and
    token-gap histograms observed with ``e2e`` and ``gaps`` (seconds)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    proc = subprocess.run([sys.executable, "-c", _HOST_WRITER, json.dumps([arms, e2e, gaps])], env=env,
                          capture_output=True, text=True, check=True, timeout=60)
    return proc.stdout


def test_recorded_scrape_has_the_host_histograms_but_no_observations(capsys):
    from fdsched.cmdline.scrape import HOST_E2E, HOST_GAP, attribute_host, parse_scrape

    scrape = parse_scrape(RECORDED.read_text())
    assert set(scrape.host) == {HOST_E2E, HOST_GAP}
    assert scrape.host[HOST_E2E].count == 0 and 7680.0 in scrape.host[HOST_E2E].buckets
    assert 1.0 in scrape.host[HOST_GAP].buckets
    arms, pooled = attribute_host([scrape])  # two arms in one scrape: the host's series cannot be split
    assert set(pooled) == {HOST_E2E, HOST_GAP}
    assert all(HOST_E2E not in s.histograms for s in arms.values())
    assert main(["ab", "report", str(RECORDED), "--reference", "baseline"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("E2E p99"))
    assert "- (0)" in line
    assert "with 0 observations" in out and "not in any metric: a request's stall" in out


def test_one_arm_per_scrape_gets_its_e2e_and_token_gaps(tmp_path, capsys):
    """multi_api_server: each rank's api_server scraped on its own, so each scrape's host histograms are one arm's."""
    a = tmp_path / "rank0.prom"
    b = tmp_path / "rank1.prom"
    # baseline: 100 requests, E2E 0.9 s for 50 and 12 s for 50; 1000 gaps, 20 of them 0.8 s (a recompute stall)
    a.write_text(host_exposition([["baseline", "0"]], [0.9] * 50 + [12.0] * 50, [0.03] * 980 + [0.8] * 20))
    # adaptive: 100 requests, all 0.9 s; 1000 gaps, none late
    b.write_text(host_exposition([["adaptive", "1"]], [0.9] * 100, [0.03] * 1000))
    assert main(["ab", "report", str(a), str(b), "--reference", "baseline"]) == 0
    out = capsys.readouterr().out
    rows = {l.split("  ")[0]: l for l in out.splitlines()}
    # E2E p50 of baseline: the 50th observation is the last of the (0.8, 1.0] bucket -> 1000 ms; adaptive's
    # 50th of 100 in (0.8, 1.0] -> 0.8 + 0.2 * 50/100 = 900 ms
    assert "1000 (100)" in rows["E2E p50 (ms, host, chat)"] and "900 (100)" in rows["E2E p50 (ms, host, chat)"]
    # baseline p99: the 99th of 100 lies in (10, 15]: 10 + 5 * 49/50 = 14.9 s
    assert "14900 (100)" in rows["E2E p99 (ms, host, chat)"]
    # token gaps over 0.5 s: 20 of 1000 -> 20 per 1k for baseline, 0 for adaptive
    late = rows["token gaps > 0.5 s / 1k gaps (host)"]
    assert "20 (1000)" in late and "0 (1000)" in late
    # p99 of baseline's gaps: the 990th of 1000 lies in (0.75, 1.0]: 750 + 250 * 10/20 = 875 ms
    assert "875 (1000)" in rows["token gap p99 (ms, host)"]
    assert "E2E and token gaps per arm: '-'" not in out  # attributed


def test_host_histograms_of_a_shared_scrape_are_pooled_and_since_pairs_servers(tmp_path, capsys):
    from fdsched.cmdline.scrape import HOST_E2E, attribute_host, parse_scrape

    both = host_exposition([["baseline", "0"], ["adaptive", "1"]], [2.0] * 10, [0.02] * 10)
    arms, pooled = attribute_host([parse_scrape(both)])
    assert pooled[HOST_E2E].count == 10 and all(HOST_E2E not in s.histograms for s in arms.values())
    path = tmp_path / "both.prom"
    path.write_text(both)
    assert main(["ab", "report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "host histograms pooled over arms" in out and "E2E p50 (ms, host, chat) 1750 (10)" in out  # (1.5, 2] interpolated
    # --since with one earlier scrape per server: the window per server, host histograms still attributed
    t0, t1 = tmp_path / "t0.prom", tmp_path / "t1.prom"
    t0.write_text(host_exposition([["baseline", "0"]], [0.9] * 10, [0.03] * 10))
    t1.write_text(host_exposition([["baseline", "0"]], [0.9] * 10 + [30.0] * 10, [0.03] * 10))
    assert main(["ab", "report", str(t1), "--since", str(t0)]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("E2E p50"))
    assert "25000 (10)" in line  # only the window's 10 requests, all 30 s: the 5th of 10 in (20, 30] -> 25 s

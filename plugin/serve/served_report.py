"""The served report: per arm, the client-side figures of a load run and the server's own counters.

Imports nothing from FastDeploy. The figure keys are the replay report's (``fdsched.replay.figures``) where
the figure is the same (``ttft_ms_p50``, ``tpot_ms_p99``, ``e2e_ms_p99``, ``stall_ms_max``, ...), so one
tool reads both; here every time is wall-clock, measured by the client (see :mod:`fdsched.serve.load`), and
throughput is output tokens per wall second from the first request sent to the last token received.

Server-side figures come from the window between the two scrapes of each arm's ``/metrics`` (the plugin's
``fastdeploy:fdsched_*`` series, read by :mod:`fdsched.cmdline.scrape`): preemptions (all, by victim phase),
recomputed tokens, requests finished. ``None`` where the server exposes no plugin series.
"""

from __future__ import annotations

import json
from typing import Optional

from fdsched.core.common import text_table
from fdsched.replay.report import BETTER as REPLAY_BETTER
from fdsched.replay.report import format_value, ratio
from fdsched.replay.verdict import verdict_lines

__all__ = ["SERVED_REPORT_VERSION", "TABLE_ROWS", "BETTER", "client_figures", "server_figures", "build_served_report",
           "format_served_table", "write_served_plot", "served_report_json", "traffic_of", "traffic_lines",
           "gated_verdict_lines", "merge_loads", "noise_band", "noise_lines"]

SERVED_REPORT_VERSION = 1

TABLE_ROWS = (
    ("requests", "requests sent"),
    ("requests_finished", "requests finished"),
    ("errors", "errors"),
    ("output_tokens", "output tokens"),
    ("wall_seconds", "wall time (s)"),
    ("throughput_tokens_per_s", "throughput (out tok / s)"),
    ("ttft_ms_p50", "TTFT p50 (ms)"),
    ("ttft_ms_p99", "TTFT p99 (ms)"),
    ("tpot_ms_p50", "TPOT p50 (ms)"),
    ("tpot_ms_p99", "TPOT p99 (ms)"),
    ("e2e_ms_p50", "E2E p50 (ms)"),
    ("e2e_ms_p90", "E2E p90 (ms)"),
    ("e2e_ms_p99", "E2E p99 (ms)"),
    ("stall_ms_p99", "stall p99 (ms)"),
    ("stall_ms_max", "stall max (ms)"),
    ("prompt_tokens_mismatch", "prompts not of the trace's length"),
    ("preemptions", "preemptions (server)"),
    ("preemptions_decode_victims", "  decode-phase victims"),
    ("preemptions_prefill_victims", "  prefill-phase victims"),
    ("recomputed_tokens", "recomputed tokens (server)"),
    ("server_requests_finished", "requests finished (server)"),
)
# Which direction is better: the replay's own for the figures both reports have (one definition), plus the
# served report's own figures.
BETTER = {
    **{key: REPLAY_BETTER[key] for key in (
        "requests_finished", "throughput_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
        "e2e_ms_p50", "e2e_ms_p90", "e2e_ms_p99", "stall_ms_p99", "stall_ms_max", "preemptions",
        "preemptions_decode_victims", "preemptions_prefill_victims", "recomputed_tokens")},
    "errors": "lower",
    "wall_seconds": "lower",
    "prompt_tokens_mismatch": "lower",
}


def _round(value, digits: int = 3):
    return None if value is None else round(float(value), digits)


def client_figures(results: list) -> dict:
    """Figures of one arm's requests (:class:`fdsched.serve.load.RequestResult`): the latency figures with the
    replay's own definitions (:func:`fdsched.replay.figures.request_latency_figures`, on the client's clock:
    sent -> each streamed token), plus counts, wall time and throughput."""
    from fdsched.replay.figures import RequestTimes, request_latency_figures

    samples = [RequestTimes(r.sent_s * 1000.0, [t * 1000.0 for t in r.token_s], finished=r.ok)
               for r in results if r.sent_s is not None]
    latency = request_latency_figures(samples)
    latency.pop("recomputed_tokens")  # a client cannot see it: the server's counter reports it
    sent = [r.sent_s for r in results if r.sent_s is not None]
    ends = [r.token_s[-1] if r.token_s else r.end_s for r in results if r.end_s is not None]
    wall = (max(ends) - min(sent)) if sent and ends else None
    output = sum(r.output_tokens for r in results if r.ok)
    return {
        "requests": len(results),
        "requests_finished": sum(1 for r in results if r.ok),
        "errors": sum(1 for r in results if not r.ok),
        "output_tokens": output,
        "wall_seconds": _round(wall),
        "throughput_tokens_per_s": _round(output / wall if wall else None),
        **{key: _round(value) for key, value in latency.items()},
        "prompt_tokens_mismatch": sum(1 for r in results if r.prompt_tokens is not None and r.prompt_tokens != r.prompt_len),
    }


def server_figures(before: Optional[str], after: Optional[str], source: str = "/metrics") -> dict:
    """The plugin's counters in the window between two scrapes (all arm labels of the scrape added up)."""
    from fdsched.cmdline.scrape import PREFIX, ABReportError, ArmSeries, merge_scrapes, parse_exposition

    empty = {"preemptions": None, "preemptions_decode_victims": None, "preemptions_prefill_victims": None,
             "recomputed_tokens": None, "server_requests_finished": None, "server_arms": []}

    def parse(text):
        if not text:
            return {}
        try:
            return parse_exposition(text, source)
        except ABReportError:
            return {}

    now, earlier = parse(after), parse(before)
    if not now:
        return empty
    total = ArmSeries()
    for arm, series in now.items():
        total = total.plus(series.minus(earlier.get(arm, ArmSeries())))
    count = lambda name, **labels: int(round(total.counter(PREFIX + name, **labels)))  # noqa: E731
    return {
        "preemptions": count("preemptions"),
        "preemptions_decode_victims": count("preemptions", victim_phase="decode"),
        "preemptions_prefill_victims": count("preemptions", victim_phase="prefill"),
        "recomputed_tokens": count("recomputed_tokens"),
        "server_requests_finished": count("requests_finished"),
        "server_arms": sorted(merge_scrapes([now])),
    }


def traffic_of(trace, results: list) -> dict:
    """What one arm was sent: requests, input tokens (the trace's prompt lengths), output tokens (what the trace's
    requests generate)."""
    by_id = {r.id: r for r in trace.requests}
    sent = [by_id[r.id] for r in results if r.id in by_id]
    return {"requests": len(sent), "input_tokens": sum(r.prompt_len for r in sent),
            "output_tokens": sum(r.effective_output_len for r in sent)}


def _traffic_difference(mine: dict, ref: dict) -> tuple:
    """(largest relative difference, its name) between two arms' traffic."""
    worst = (0.0, "requests")
    for key in ("requests", "input_tokens", "output_tokens"):
        a, b = ref.get(key) or 0, mine.get(key) or 0
        d = abs(b - a) / a if a else (0.0 if b == 0 else float("inf"))
        if d > worst[0]:
            worst = (d, key.replace("_", " "))
    return worst


def traffic_lines(report: dict) -> list:
    """How each arm's traffic compares, said before any figure."""
    profiles = report["profiles"]
    mode = report["load"].get("traffic", "split" if len(profiles) > 1 else "single")
    if len(profiles) < 2 or any("traffic" not in p for p in profiles):  # a report from before traffic was recorded
        return []
    each = "; ".join(f"{p['profile']}: {p['traffic']['requests']} requests, {p['traffic']['input_tokens']:,} input "
                     f"tokens, {p['traffic']['output_tokens']:,} output tokens" for p in profiles)
    if mode == "identical":
        return [f"traffic: identical: every arm got the same requests at the same arrival times, one stack per arm in "
                f"turn ({each})"]
    ref = profiles[0]
    diffs = [f"{p['profile']} {_traffic_difference(p['traffic'], ref['traffic'])[0]:.0%} "
             f"({_traffic_difference(p['traffic'], ref['traffic'])[1]})" for p in profiles[1:]]
    return [f"traffic: NOT identical: the requests were split over the arms as the Router splits them ({each})",
            f"  largest difference from {ref['profile']}: {', '.join(diffs)}; latency figures are per request and "
            "throughput per token, totals are not comparable, and no verdict is given where the traffic differs by "
            "more than the effect"]


def _read_beyond(p: dict, ref: dict, line: str, limits: dict) -> tuple:
    """For arm ``p`` against ``ref`` and its verdict line: ``(arm words, the line's figures, effect per verdict figure
    (|ratio - 1|), the verdict figures whose effect exceeds their limit in ``limits`` (0 where absent))``."""
    from fdsched.replay.verdict import VERDICT_KEYS

    effects = {key: abs(r - 1) for key in VERDICT_KEYS
               for r in [ratio(p["figures"].get(key), ref["figures"].get(key))] if r is not None}
    beyond = [key for key in VERDICT_KEYS if effects.get(key, 0.0) > limits.get(key, 0.0)]
    head, _, rest = line.strip().partition(": ")
    return head.split(",")[0], rest, effects, beyond


def gated_verdict_lines(report: dict, what: str) -> list:
    """The replay's verdict lines; on split traffic each verdict figure (TTFT p50, E2E p99, stall p99) whose change
    is smaller than the traffic difference is left out of the word, and an arm with no figure beyond the
    difference gets no verdict; the line says which."""
    from fdsched.replay.verdict import VERDICT_KEYS, VERDICT_LINE_FIGURES, verdict

    profiles = report["profiles"]
    lines = verdict_lines(profiles, what=what)
    if lines and report.get("reference_repeat"):
        return _noise_gated(report, lines)
    if not lines or report["load"].get("traffic") == "identical" or any("traffic" not in p for p in profiles):
        return lines
    ref = profiles[0]
    labels = dict(VERDICT_LINE_FIGURES)
    out = [lines[0]]
    for p, line in zip(profiles[1:], lines[1:]):
        diff, name = _traffic_difference(p["traffic"], ref["traffic"])
        arm, rest, effects, beyond = _read_beyond(p, ref, line, dict.fromkeys(VERDICT_KEYS, diff))
        if not beyond:
            largest = max(effects.values()) if effects else 0.0
            out.append(f"  {arm}: no verdict: the traffic differs by more than the largest effect"
                       + _wrapped_note(f"its traffic differs from {ref['profile']}'s by {diff:.0%} ({name}), more "
                                       f"than the largest effect ({largest:.0%})") + _figures_note(rest))
            continue
        word = verdict(p["figures"], ref["figures"], keys=tuple(beyond))[0]
        within = [labels[k] for k in VERDICT_KEYS if k not in beyond]
        note = _wrapped_note(f"traffic differs by {diff:.0%} ({name}): the verdict reads only "
                             f"{', '.join(labels[k] for k in beyond)}"
                             + (f", not {', '.join(within)} (within the difference)" if within else ""))
        out.append(f"  {arm}, {word}: {rest}{note}")
    return out


def noise_band(report: dict) -> dict:
    """Verdict figure -> how far the reference arm's second run landed from its first (``|second / first - 1|``):
    what the same arm moves between two runs on this machine, so the least change that can be read as an effect.
    Empty without a repeated reference run."""
    from fdsched.replay.verdict import VERDICT_KEYS

    repeat = report.get("reference_repeat")
    if not repeat:
        return {}
    first = report["profiles"][0]["figures"]
    band = {}
    for key in VERDICT_KEYS:
        r = ratio(repeat["figures"].get(key), first.get(key))
        if r is not None:
            band[key] = abs(r - 1)
    return band


def noise_lines(report: dict) -> list:
    """The reference arm's second run, said under the table: how far each verdict figure moved between its runs."""
    from fdsched.replay.verdict import VERDICT_KEYS, VERDICT_LINE_FIGURES

    repeat = report.get("reference_repeat")
    if not repeat:
        return []
    labels = dict(VERDICT_LINE_FIGURES)
    first = report["profiles"][0]["figures"]
    parts = []
    for key in VERDICT_KEYS:
        a, b = first.get(key), repeat["figures"].get(key)
        r = ratio(b, a)
        parts.append(f"{labels[key]} {format_value(a)} then {format_value(b)}" + ("" if r is None else f" ({r - 1:+.0%})"))
    return [f"run-to-run noise: {repeat['profile']} ran again after the other arms:", "  " + ", ".join(parts),
            "  a change no larger than its figure's noise is not read as an effect in the verdicts below"]


def _noise_gated(report: dict, lines: list) -> list:
    """Verdict lines where each verdict figure whose change from the reference is within that figure's run-to-run
    noise (:func:`noise_band`) is left out of the word; an arm with no figure beyond the noise gets no verdict."""
    from fdsched.replay.verdict import VERDICT_KEYS, VERDICT_LINE_FIGURES, verdict

    profiles = report["profiles"]
    ref = profiles[0]
    band = noise_band(report)
    labels = dict(VERDICT_LINE_FIGURES)
    out = [lines[0]]
    for p, line in zip(profiles[1:], lines[1:]):
        arm, rest, _effects, beyond = _read_beyond(p, ref, line, band)
        within = [f"{labels[k]} (noise {band[k]:.0%})" for k in VERDICT_KEYS if k not in beyond and k in band]
        if not beyond:
            out.append(f"  {arm}: no verdict: every change is within {ref['profile']}'s run-to-run noise"
                       + _wrapped_note(f"noise: {', '.join(within)}") + _figures_note(rest))
            continue
        word = verdict(p["figures"], ref["figures"], keys=tuple(beyond))[0]
        note = _wrapped_note(f"within run-to-run noise, not read: {', '.join(within)}") if within else ""
        out.append(f"  {arm}, {word}: {rest}{note}")
    return out


def _wrapped_note(text: str) -> str:
    """``text`` on lines of its own under a verdict line, indented as the verdict's own notes, wrapped to the
    verdict width."""
    import textwrap

    from fdsched.replay.verdict import VERDICT_WIDTH

    return "".join("\n" + line for line in textwrap.wrap(text, VERDICT_WIDTH, initial_indent="      ",
                                                          subsequent_indent="      ", break_on_hyphens=False))


def _figures_note(rest: str) -> str:
    """A verdict line's figures (its first physical line wrapped, its own note lines kept) under a line that gives
    no verdict."""
    first, *more = rest.split("\n")
    return _wrapped_note(f"figures: {first.strip()}") + "".join("\n" + line for line in more)


def merge_loads(loads: list) -> dict:
    """One load document from arms run in turn on the same requests (each its own :func:`run_trace_load`)."""
    merged = {"results": [], "servers": {}, "wall_seconds": 0.0, "assignment_seed": None,
              "time_scale": loads[0]["time_scale"], "step_ms": loads[0]["step_ms"], "traffic": "identical"}
    for load in loads:
        merged["results"] += load["results"]
        merged["servers"].update(load["servers"])
        merged["wall_seconds"] += load["wall_seconds"]
    return merged


def build_served_report(trace, load: dict, targets: list) -> dict:
    """The report document of one :func:`fdsched.serve.load.run_trace_load` run (or of :func:`merge_loads`)."""
    arms = []
    for target in targets:
        mine = [r for r in load["results"] if r.arm == target.arm]
        server = load["servers"][target.arm]
        figures = client_figures(mine)
        srv = server_figures(server.get("scrape_before"), server.get("scrape_after"), target.metrics)
        server_arms = srv.pop("server_arms")
        figures.update(srv)
        errors = sorted({r.error for r in mine if r.error})
        arms.append({
            "profile": target.arm,
            "url": target.url,
            "metrics_url": target.metrics,
            "server": {"model": server.get("model"), "max_model_len": server.get("max_model_len"),
                       "plugin_arms_on_metrics": server_arms, "scrape_error": server.get("scrape_error")},
            "figures": figures,
            "traffic": traffic_of(trace, mine),
            "errors": errors[:10],
            "series": {
                "ttft_ms": sorted(v for r in mine if r.ok for v in [_metric(r, "ttft_ms")] if v is not None),
                "e2e_ms": sorted(v for r in mine if r.ok for v in [_metric(r, "e2e_ms")] if v is not None),
                "stall_ms": sorted(v for r in mine if r.ok for v in [_metric(r, "stall_ms")] if v is not None),
                "finish_s": sorted(r.token_s[-1] for r in mine if r.ok and r.token_s),
            },
        })
    return {
        "fdsched_served_report": SERVED_REPORT_VERSION,
        "trace": {"name": trace.name, "requests": len(trace.requests), "source": str(trace.source),
                  "time_based": trace.time_based},
        "load": {"time_scale": load["time_scale"], "step_ms": load["step_ms"], "split_seed": load["assignment_seed"],
                 "wall_seconds": _round(load["wall_seconds"]),
                 "traffic": load.get("traffic", "split" if len(targets) > 1 else "single"),
                 "sent_without_max_tokens": len({r.id for r in load["results"] if r.max_tokens is None})},
        "better": dict(BETTER),
        "profiles": arms,
    }


def _metric(result, key):
    from fdsched.serve.load import request_metrics

    return request_metrics(result)[key]


def served_report_json(report: dict) -> str:
    return json.dumps(report, indent=1, allow_nan=False) + "\n"


def format_served_table(report: dict) -> str:
    """Rows = figures, one column per arm, then each arm over the first (the replay table's layout)."""
    profiles = report["profiles"]
    names = [p["profile"] for p in profiles]
    headers = ["figure", "better"] + names + [f"{n}/{names[0]}" for n in names[1:]]
    rows = []
    for key, label in TABLE_ROWS:
        values = [p["figures"].get(key) for p in profiles]
        cells = [label, report["better"].get(key, "")] + [format_value(v) for v in values]
        for v in values[1:]:
            r = ratio(v, values[0])
            cells.append("-" if r is None else f"{r:.2f}")
        rows.append(cells)
    notes = [f"{p['profile']}: {p['url']}" + (f"; plugin arm(s) on its /metrics: {', '.join(p['server']['plugin_arms_on_metrics'])}"
                                              if p["server"]["plugin_arms_on_metrics"] else "; no plugin series on its /metrics")
             for p in profiles]
    for p in profiles:
        if p["server"].get("scrape_error"):
            notes.append(f"{p['profile']}: /metrics not read: {p['server']['scrape_error']}")
        if p["errors"]:
            notes.append(f"{p['profile']}: {p['figures']['errors']} failed requests, e.g. {p['errors'][0]}")
    load = report["load"]
    split = len(profiles) > 1 and load.get("traffic", "split") == "split"
    head = (f"trace {report['trace']['name']}: {report['trace']['requests']} requests, time scale {load['time_scale']}"
            + (f", {load['step_ms']} ms per trace step" if load.get("step_ms") else "")
            + (f", split over the arms as the Router does (seed {load['split_seed']})" if split else "")
            + (f", {load['sent_without_max_tokens']} sent without max_tokens" if load.get("sent_without_max_tokens")
               else "")
            + "; times are wall-clock, measured by the client")
    traffic = traffic_lines(report)
    notes += noise_lines(report)
    verdicts = gated_verdict_lines(report, what="client-side wall-clock; victims from each arm's /metrics")
    return ("\n".join(traffic + [head]) + "\n" + text_table(rows, headers, align_right_from=2) + "\n"
            + "\n".join(notes) + ("\n\n" + "\n".join(verdicts) if verdicts else ""))


def write_served_plot(report: dict, path: str, title: str = "") -> None:
    """Arms overlaid: completed requests over time, TTFT CDF, E2E CDF, stall CDF. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    done_ax, ttft_ax, e2e_ax, stall_ax = axes
    for i, entry in enumerate(report["profiles"]):
        series, color = entry["series"], f"C{i % 10}"
        f = entry["figures"]
        label = f"{entry['profile']} ({f['preemptions'] if f['preemptions'] is not None else '?'} preemptions)"
        done_ax.step(series["finish_s"], range(1, len(series["finish_s"]) + 1), where="post", color=color, label=label)
        for ax, key in ((ttft_ax, "ttft_ms"), (e2e_ax, "e2e_ms"), (stall_ax, "stall_ms")):
            values = series[key]
            if values:
                ax.step(values, [(k + 1) / len(values) for k in range(len(values))], where="post", color=color)
    done_ax.set_xlabel("wall time (s)")
    done_ax.set_ylabel("requests completed")
    done_ax.legend(fontsize=8, frameon=False, loc="upper left")
    for ax, label in ((ttft_ax, "TTFT ms (log)"), (e2e_ax, "end-to-end latency ms (log)"), (stall_ax, "longest token gap ms (log)")):
        ax.set_xlabel(label + "; left is better")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    for ax, key in ((ttft_ax, "ttft_ms"), (e2e_ax, "e2e_ms"), (stall_ax, "stall_ms")):
        values = [v for p in report["profiles"] for v in p["series"][key]]
        if values and min(values) > 0:
            ax.set_xscale("log")
    done_ax.grid(alpha=0.3)
    fig.suptitle((title + " - " if title else "") + f"served, trace {report['trace']['name']} (client-side wall-clock)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

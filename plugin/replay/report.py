"""The replay report: JSON document, terminal table, PNG. Imports nothing from FastDeploy.

``report.json`` is byte-identical for the same inputs (trace, profiles, engine shape, cost model,
host) except its ``measured`` section, which holds wall-clock timings and nothing else.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional, Sequence

from fdsched.replay.costmodel import row_step_ms
from fdsched.core.common import plural, text_table
from fdsched.replay.figures import ProfileRun, compute_figures, latency_samples, measured_figures

__all__ = [
    "REPORT_VERSION",
    "TABLE_ROWS",
    "MEASURED_ROWS",
    "INSTALL_HINT",
    "build_report",
    "report_json",
    "format_value",
    "ratio",
    "format_table",
    "format_header",
    "differing_settings",
    "BETTER",
    "write_plot",
    "ARM_COLORS",
    "QUEUE_COLORS",
    "arm_color",
    "VERDICT_KEYS",
    "VERDICT_TOLERANCE",
    "verdict",
    "format_verdicts",
    "verdict_line",
    "verdict_lines",
    "change_words",
    "SMALL_REQUESTS",
    "SMALL_EVENTS",
    "BOUND_KEYS",
    "bound_ratios",
    "format_bounds",
]

REPORT_VERSION = 2
# the package is on no index yet: name what pip can install (the [report] extra's packages, or the extra from a checkout)
INSTALL_HINT = "pip install matplotlib tqdm, or in a checkout of this project: pip install '.[report]'"

# (figure key, label) in table order.
TABLE_ROWS = (
    ("preemptions", "preemptions"),
    ("preemptions_decode_victims", "  decode-phase victims"),
    ("preemptions_prefill_victims", "  prefill-phase victims"),
    ("recomputed_prompt_tokens", "recomputed prompt tokens"),
    ("decode_tokens_per_step_mean", "decode tokens / step (mean)"),
    ("steps_to_drain", "steps to drain"),
    ("prefix_hit_rate", "prefix-cache hit rate"),
    ("evicted_blocks", "evicted blocks"),
    ("blocks_in_use_peak", "blocks in use, peak"),
    ("blocks_in_use_mean", "blocks in use, mean"),
    ("admissions_blocked", "admissions blocked"),
    ("modelled_seconds", "modelled time (s)"),
    ("throughput_tokens_per_s", "throughput (out tok / modelled s)"),
    ("ttft_ms_p50", "TTFT p50 (modelled ms)"),
    ("ttft_ms_p99", "TTFT p99 (modelled ms)"),
    ("e2e_ms_p50", "E2E p50 (modelled ms)"),
    ("e2e_ms_p90", "E2E p90 (modelled ms)"),
    ("e2e_ms_p99", "E2E p99 (modelled ms)"),
    ("tpot_ms_p50", "TPOT p50 (modelled ms)"),
    ("tpot_ms_p99", "TPOT p99 (modelled ms)"),
    ("stall_ms_p99", "stall p99 (longest token gap, ms)"),
    ("stall_ms_max", "stall max (longest token gap, ms)"),
    ("recomputed_tokens", "recomputed tokens"),
    ("requests_finished", "requests finished"),
    ("invariant_violations", "invariant violations"),
)
MEASURED_ROWS = (
    ("schedule_cpu_ms_mean", "schedule() CPU ms / step, mean*"),
    ("schedule_cpu_ms_p99", "schedule() CPU ms / step, p99*"),
    ("replay_cpu_ms_mean", "replay's own CPU ms / step, mean*"),
    ("replay_wall_seconds", "replay wall time (s)*"),
)

# Which direction of each figure is better ("lower" / "higher"); figures not listed have none
# (they describe the run: pool use, evictions, refused admissions).
BETTER = {
    "preemptions": "lower",
    "preemptions_decode_victims": "lower",
    "preemptions_prefill_victims": "lower",
    "recomputed_prompt_tokens": "lower",
    "decode_tokens_per_step_mean": "higher",
    "steps_to_drain": "lower",
    "prefix_hit_rate": "higher",
    "modelled_seconds": "lower",
    "throughput_tokens_per_s": "higher",
    "ttft_ms_p50": "lower",
    "ttft_ms_p99": "lower",
    "tpot_ms_p50": "lower",
    "tpot_ms_p99": "lower",
    "e2e_ms_p50": "lower",
    "e2e_ms_p90": "lower",
    "e2e_ms_p99": "lower",
    "stall_ms_p99": "lower",
    "stall_ms_max": "lower",
    "recomputed_tokens": "lower",
    "requests_finished": "higher",
    "invariant_violations": "lower",
}
MEASURED_BETTER = {key: "lower" for key, _ in MEASURED_ROWS}

# The verdict reads what users feel together: the first token, the whole answer, the worst pause.
VERDICT_KEYS = ("ttft_ms_p50", "e2e_ms_p99", "stall_ms_p99")
# A difference within this fraction of the reference's value is noise (the replay is deterministic, but a
# window of real traffic moves these figures by a few percent when requests shift by one step).
VERDICT_TOLERANCE = 0.05


# A figure worse than the reference by more than this factor decides the verdict alone: ``worse``, whatever the
# others gain (a user who waits 3x as long for the first token is not paid back by a shorter tail elsewhere).
# So a line that shows a factor (``+183% (2.83x)``) on a time never reads ``mixed``.
VERDICT_DOMINANT_FACTOR = 2.0


def verdict(figures: dict, reference: dict, tolerance: float = VERDICT_TOLERANCE, keys: Sequence[str] = VERDICT_KEYS) -> tuple:
    """``(word, detail)`` comparing one arm's figures with a reference arm's on :data:`VERDICT_KEYS`
    (lower is better for each):

    * ``worse``: worse by more than :data:`VERDICT_DOMINANT_FACTOR` on any of them, whatever the others; or not
      better beyond ``tolerance`` on any and worse beyond it on at least one;
    * ``better``: not worse beyond ``tolerance`` on any of them and better beyond it on at least one;
    * ``mixed``: better beyond ``tolerance`` on one, worse beyond it (but by at most
      :data:`VERDICT_DOMINANT_FACTOR`) on another: no ranking, the trade-off is the user's call;
    * ``same``: within ``tolerance`` on all; ``n/a`` when a figure is missing.

    ``detail`` lists each figure's ratio (arm / reference). ``keys``: a subset of :data:`VERDICT_KEYS` when a
    source has only some of them (an online A/B's /metrics has no E2E or stall)."""
    better, worse, dominant, parts = [], [], [], []
    for key in keys:
        a, b = reference.get(key), figures.get(key)
        if a is None or b is None:
            return "n/a", f"{key} missing"
        r = ratio(b, a)
        if r is None:  # reference 0
            r = 1.0 if b == 0 else float("inf")
        parts.append(f"{key} {r:.2f}x")
        if r > VERDICT_DOMINANT_FACTOR:
            dominant.append(key)
        if r > 1 + tolerance:
            worse.append(key)
        elif r < 1 - tolerance:
            better.append(key)
    if dominant:
        word = "worse"
    else:
        word = "mixed" if better and worse else "better" if better else "worse" if worse else "same"
    return word, ", ".join(parts)


# The verdict line: what a person acts on. Below these counts a figure is noise-prone, and the line says so.
SMALL_REQUESTS = 100  # fewer finished requests than this: a p99 is the slowest one or two requests
SMALL_EVENTS = 10  # fewer prefill victims than this on both sides: a difference of a few can be one request's timing
# (figure key, words) in the line's order; the victims follow.
VERDICT_LINE_FIGURES = (
    ("throughput_tokens_per_s", "throughput"),
    ("ttft_ms_p50", "TTFT p50"),
    ("e2e_ms_p99", "E2E p99"),
    ("stall_ms_p99", "stall p99"),
)
# Printed verdicts fit a terminal: every line (with its indent) at most this many characters.
VERDICT_WIDTH = 100
VERDICT_INDENT = "  "  # before each arm's first line
VERDICT_CONTINUATION = "      "  # before its wrapped and noise lines


def change_words(label: str, value, reference) -> str:
    """``TTFT p50 -55%``: the arm's value against the reference's as a signed percentage (``+183% (2.83x)``
    above :data:`VERDICT_DOMINANT_FACTOR`, where a time decides the verdict alone; ``same`` when it rounds to 0%;
    ``n/a`` when either is missing)."""
    r = ratio(value, reference)
    if r is None:
        if value == 0 and reference == 0:
            return f"{label} same"
        if reference == 0 and isinstance(value, (int, float)):
            return f"{label} 0 -> {format_value(value)}"
        return f"{label} n/a"
    pct = (r - 1.0) * 100.0
    if round(pct) == 0:
        return f"{label} same"
    # the factor is shown exactly where it decides the verdict (a time above VERDICT_DOMINANT_FACTOR: `worse`)
    return f"{label} {pct:+.0f}%" + (f" ({r:.2f}x)" if r > VERDICT_DOMINANT_FACTOR else "")


def _wrap(text: str, first: str, rest: str, width: int) -> list:
    import textwrap

    return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest, break_long_words=False,
                         break_on_hyphens=False)


def _wrap_items(head: str, items: list, width: int) -> list:
    """``head`` and the comma-separated ``items``, broken only between items (a figure is never split)."""
    lines, line = [], VERDICT_INDENT + head
    for i, item in enumerate(items):
        text = item + ("," if i < len(items) - 1 else "")
        if line.strip() and not line.endswith(": ") and len(line) + 1 + len(text) > width:
            lines.append(line)
            line = VERDICT_CONTINUATION + text
        else:
            line += ("" if line.endswith(": ") else " ") + text
    return lines + [line]


def verdict_line(name: str, figures: dict, reference_name: str, reference: dict,
                 tolerance: float = VERDICT_TOLERANCE, width: int = VERDICT_WIDTH) -> str:
    """One arm's verdict, e.g.::

          adaptive vs baseline, better: throughput +1%, TTFT p50 -55%, E2E p99 -5%, stall p99 -66%,
              0 prefill victims (baseline 2)
              noise in the prefill victims: 0 vs 2 (under 10 each) can be one request's timing

    The word is :func:`verdict`'s, on the :data:`VERDICT_KEYS` both arms have (the line says which when some are
    missing). The figures wrap at ``width`` (indent included); each noise caveat is a line of its own that names
    the figures it qualifies: fewer than :data:`SMALL_REQUESTS` finished requests behind the p99 figures, or
    fewer than :data:`SMALL_EVENTS` prefill victims on both sides when they differ. Every line starts with
    its indent (:data:`VERDICT_INDENT`, then :data:`VERDICT_CONTINUATION`)."""
    have = tuple(k for k in VERDICT_KEYS if figures.get(k) is not None and reference.get(k) is not None)
    word = verdict(figures, reference, tolerance, keys=have)[0] if have else "n/a"
    if have and have != VERDICT_KEYS:
        word += " (on " + ", ".join(label for key, label in VERDICT_LINE_FIGURES if key in have) + " only)"
    parts = [change_words(label, figures.get(key), reference.get(key)) for key, label in VERDICT_LINE_FIGURES]
    mine, theirs = figures.get("preemptions_prefill_victims"), reference.get("preemptions_prefill_victims")
    if mine is None or theirs is None:
        parts.append("prefill victims n/a")
    else:
        parts.append(f"{mine} prefill {_plural(mine, 'victim')} ({reference_name} {theirs})")
    noise = []
    counts = [n for n in (figures.get("requests_finished"), reference.get("requests_finished")) if n is not None]
    if counts and min(counts) < SMALL_REQUESTS:
        noise.append(f"noise in the p99 figures: {plural(min(counts), 'request')} (under {SMALL_REQUESTS}), "
                     "so a p99 is the slowest one or two")
    if mine is not None and theirs is not None and mine != theirs and max(mine, theirs) < SMALL_EVENTS:
        noise.append(f"noise in the prefill victims: {mine} vs {theirs} (under {SMALL_EVENTS} each) "
                     "can be one request's timing")
    lines = _wrap_items(f"{name} vs {reference_name}, {word}: ", parts, width)
    for clause in noise:
        lines += _wrap(clause, VERDICT_CONTINUATION, VERDICT_CONTINUATION + "  ", width)
    return "\n".join(lines)


def _plural(count, noun: str) -> str:
    """The noun alone, singular for 1 (the count is printed beside it)."""
    return noun if count == 1 else noun + "s"


def verdict_heading(reference: str, what: str = "", width: int = VERDICT_WIDTH) -> str:
    """The lines above the arms' verdicts: what is read and the rule (wrapped at ``width``)."""
    text = (
        f"verdict{' (' + what + ')' if what else ''} vs {reference}: TTFT p50, E2E p99 and stall p99 read together "
        f"(better: none worse by more than {VERDICT_TOLERANCE:.0%}, one better by more; worse: one worse by more "
        f"than {VERDICT_DOMINANT_FACTOR:g}x, or none better and one worse by more than {VERDICT_TOLERANCE:.0%}; "
        f"mixed: the rest of the trades); % = change from {reference} (throughput: + is better; times: - is better)"
    )
    return "\n".join(_wrap(text, "", "  ", width))


def verdict_lines(profiles: Sequence[dict], reference: Optional[str] = None, what: str = "") -> list:
    """The heading (:func:`verdict_heading`) and one :func:`verdict_line` per arm (``profiles``: [{"profile",
    "figures"}]) against ``reference`` (default: the first arm); [] with fewer than two arms. An entry may hold
    several physical lines (joined by newlines), each at most :data:`VERDICT_WIDTH` characters."""
    if len(profiles) < 2:
        return []
    ref = next((p for p in profiles if p["profile"] == reference), profiles[0])
    return [verdict_heading(ref["profile"], what)] + [
        verdict_line(p["profile"], p["figures"], ref["profile"], ref["figures"]) for p in profiles if p is not ref
    ]


def format_verdicts(report: dict) -> str:
    """The verdict lines of a report (see :func:`verdict_lines`): the first arm is the reference."""
    return "\n".join(verdict_lines(report["profiles"]))


# Figures reported as ratios to the reference arms (oracle, unbounded), with the direction that is better.
BOUND_KEYS = ("throughput_tokens_per_s", "ttft_ms_p50", "e2e_ms_p99", "stall_ms_p99")


def _bound_arms(runs_or_profiles) -> dict:
    found = {}
    for p in runs_or_profiles:
        settings = p.get("settings_that_differ", {}) if isinstance(p, dict) else p.settings
        name = p["profile"] if isinstance(p, dict) else p.profile
        if settings.get("replay.oracle_reserve") in (True, "True") and "oracle" not in found:
            found["oracle"] = name
        if settings.get("replay.unbounded_memory") in (True, "True") and "unbounded" not in found:
            found["unbounded"] = name
    return found


def bound_ratios(profiles: Sequence[dict], bounds: dict) -> dict:
    """Each arm's :data:`BOUND_KEYS` over the same figure of each reference arm (``bounds``: kind -> arm name)."""
    by_name = {p["profile"]: p["figures"] for p in profiles}
    out = {}
    for p in profiles:
        entry = {}
        for kind, name in bounds.items():
            entry[f"vs_{kind}"] = {
                key: (None if (r := ratio(p["figures"].get(key), by_name[name].get(key))) is None else round(r, 6))
                for key in BOUND_KEYS
            }
        out[p["profile"]] = entry
    return out


def format_bounds(report: dict) -> str:
    bounds = report.get("bounds")
    if not bounds or not bounds.get("arms"):
        return ""
    rows = []
    names = [p["profile"] for p in report["profiles"]]
    kinds = list(bounds["arms"])
    headers = ["arm"] + [f"{k.split('_ms')[0].split('_tokens')[0]} / {kind}" for kind in kinds for k in BOUND_KEYS]
    for name in names:
        cells = [name]
        for kind in kinds:
            for key in BOUND_KEYS:
                v = bounds["ratios"][name][f"vs_{kind}"][key]
                cells.append("-" if v is None else f"{v:.2f}")
        rows.append(cells)
    arms = ", ".join(f"{kind} = {name}" for kind, name in bounds["arms"].items())
    return f"ratios to the reference arms ({arms}; throughput: higher is better, the rest lower):\n" + text_table(
        rows, headers, align_right_from=1
    )


def _series(run: ProfileRun) -> dict:
    lat = latency_samples(run)
    ends, now = [], 0.0
    for s in run.steps:
        now += s.gap_ms + row_step_ms(run.cost, s)
        ends.append(round(now, 3))
    return {
        "step_end_ms": ends,
        "ttft_ms": sorted(round(v, 3) for v in lat["ttft_ms"]),
        "tpot_ms": sorted(round(v, 3) for v in lat["tpot_ms"]),
        "finish_ms": sorted(round(v, 3) for v in lat["finish_ms"]),
        "e2e_ms": sorted(round(v, 3) for v in lat["e2e_ms"]),
        "stall_ms": sorted(round(v, 3) for v in lat["stall_ms"]),
        "blocks_in_use": [s.blocks_used for s in run.steps],
        "blocks_held_by_requests": [s.blocks_held for s in run.steps],
        "running": [s.running for s in run.steps],
        "waiting": [s.waiting for s in run.steps],
        "prefill_tokens": [s.prefill_tokens for s in run.steps],
        "decode_tokens": [s.decode_tokens for s in run.steps],
        "preemptions": [[s.step, rid, phase] for s in run.steps for rid, phase in s.preempted],
    }


def _violations(run: ProfileRun, limit: int = 20) -> list:
    found = [f"step {s.step}: {v}" for s in run.steps for v in s.violations]
    found += list(run.request_violations)
    return found[:limit]


def differing_settings(runs: Sequence[ProfileRun]) -> list:
    """Setting keys whose effective values are not the same in every arm (schema order)."""
    if not runs:
        return []
    keys = list(runs[0].settings)
    return [k for k in keys if len({repr(run.settings.get(k)) for run in runs}) > 1]


def build_report(trace: dict, engine: dict, runs: Sequence[ProfileRun], include_series: bool = True) -> dict:
    """The report document. ``trace``: name, description, requests, sha256 (plain values)."""
    differing = differing_settings(runs)
    profiles = []
    for run in runs:
        entry = {
            "profile": run.profile,
            "host": dict(run.host),
            "decisions": dict(run.decisions),
            "settings_that_differ": {k: _plain(run.settings.get(k)) for k in differing},
            "environment": dict(run.environment),
            "cost_model": run.cost.to_json(),
            "invariants_checked_every_steps": run.check_every,
            "figures": compute_figures(run),
            "violations": _violations(run),
        }
        if run.estimator is not None:
            entry["estimator"] = dict(run.estimator)
        if include_series:
            entry["series"] = _series(run)
        profiles.append(entry)
    bounds = _bound_arms(runs)
    hosts = {(r.host.get("version"), r.host.get("commit")) for r in runs}
    host = dict(runs[0].host) if len(hosts) == 1 and runs else {"arms_differ": [dict(r.host) for r in runs]}
    return {
        "fdsched_replay_report": REPORT_VERSION,
        "trace": dict(trace),
        "engine": dict(engine),
        "host": host,
        "better": dict(BETTER),
        "profiles": profiles,
        "bounds": {"arms": bounds, "ratios": bound_ratios(profiles, bounds)} if bounds else {},
        "measured": {
            "note": "wall-clock measurements on this machine; they differ from run to run",
            "better": dict(MEASURED_BETTER),
            "profiles": {run.profile: measured_figures(run) for run in runs},
        },
    }


def _plain(value):
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def report_json(report: dict) -> str:
    return json.dumps(report, indent=1, sort_keys=False, allow_nan=False) + "\n"


# --------------------------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------------------------
def format_value(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.1f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3f}"
    return str(value)


def ratio(b, a) -> Optional[float]:
    """b / a for two numbers with a != 0; None otherwise (booleans and missing values too)."""
    numeric = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if not (numeric(a) and numeric(b)) or a == 0:
        return None
    return b / a


def format_table(report: dict, measured: bool = True) -> str:
    """Rows = figures, one column per profile, then one ratio column per profile after the first
    (``B/A``: that profile's value over the first one's)."""
    profiles = report["profiles"]
    names = [p["profile"] for p in profiles]
    headers = ["figure", "better"] + names + [f"{n}/{names[0]}" for n in names[1:]]
    rows = []
    better = dict(report.get("better", BETTER), **report.get("measured", {}).get("better", MEASURED_BETTER))

    def add(key: str, label: str, values: list) -> None:
        cells = [label, better.get(key, "")] + [format_value(v) for v in values]
        for v in values[1:]:
            r = ratio(v, values[0])
            cells.append("-" if r is None else f"{r:.2f}")
        rows.append(cells)

    for key, label in TABLE_ROWS:
        add(key, label, [p["figures"].get(key) for p in profiles])
    if measured:
        by_name = report["measured"]["profiles"]
        for key, label in MEASURED_ROWS:
            add(key, label, [by_name.get(n, {}).get(key) for n in names])
    text = text_table(rows, headers, align_right_from=2)
    notes = []
    if measured:
        notes.append("* measured wall-clock/CPU figures (not part of the deterministic report)")
    for p in profiles:
        f = p["figures"]
        if not f["drained"]:
            notes.append(f"{p['profile']}: NOT DRAINED after {plural(f['steps'], 'step')} ({f['stop_reason']})")
        if f["admissions_blocked"] is None:
            notes.append(f"{p['profile']}: admissions blocked n/a: the host's own reservation code decides")
    return text + ("\n" + "\n".join(notes) if notes else "")


def format_header(report: dict) -> str:
    """What ran: the trace, the engine, the host, and per arm its decisions, the settings that differ
    between arms and the environment variables that were (not) applied."""
    trace, engine, host = report["trace"], report["engine"], report.get("host", {})
    lines = [
        f"trace {trace['name']}: {plural(trace['requests'], 'request')}; engine "
        + ", ".join(f"{k}={v}" for k, v in engine.items()),
    ]
    dp = trace.get("dp_arms")
    if dp:
        shares = ", ".join(f"{name} {n}" for name, n in dp["requests_per_rank"].items())
        lines.append(f"online A/B prediction (--dp-arms, seed {dp['seed']}): requests per rank: {shares}; {dp['split']}")
    if "arms_differ" in host:
        lines.append("host: DIFFERS BETWEEN ARMS: " + "; ".join(f"{h.get('version')} {h.get('commit')}" for h in host["arms_differ"]))
    else:
        lines.append("host: " + (host.get("label") or f"FastDeploy {host.get('version') or '?'}, commit {host.get('commit') or '?'}"))
    lines.extend(_cost_lines(report["profiles"]))
    for p in report["profiles"]:
        decisions = ", ".join(f"{cid}={detail}" for cid, detail in p["decisions"].items())
        lines.append(f"arm {p['profile']}: {decisions}")
        if p.get("settings_that_differ"):
            lines.append("    settings that differ: " + ", ".join(f"{k}={v}" for k, v in p["settings_that_differ"].items()))
        env = p.get("environment") or {}
        if env.get("applied"):
            lines.append("    environment applied: " + ", ".join(f"{k}={v}" for k, v in env["applied"].items()))
        if env.get("not_applied"):
            lines.append("    environment NOT applied (use --inherit-env): " + ", ".join(env["not_applied"]))
        if env.get("other_host_variables"):
            lines.append("    other FD_* variables the host may read (every arm alike): "
                         + ", ".join(f"{k}={v}" for k, v in env["other_host_variables"].items()))
        if env.get("hook_plugins"):
            lines.append("    third-party hook plugins loaded: " + ", ".join(env["hook_plugins"]))
    return "\n".join(lines)


def _cost_lines(profiles) -> list:
    """The header's cost-model line(s): one when every arm has the same model, else one per arm."""
    models = [p.get("cost_model") or {} for p in profiles]
    if not models:
        return []

    def text(model: dict) -> str:
        coeffs = ", ".join(f"{k} {v:g}" for k, v in model.items() if k not in ("model", "source") and v)
        line = f"{model.get('model', '?')}: {coeffs or 'all coefficients 0'}"
        return line + (f" (source: {model['source']})" if model.get("source") else "")

    if all(m == models[0] for m in models):
        return ["cost model " + text(models[0])]
    return [f"cost model of arm {p['profile']}: " + text(m) for p, m in zip(profiles, models)]


# --------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------
# One colour per arm in every panel (tab10 without its grey); queue states and the pool in greys, preemptions in
# black, so no colour means two things.
ARM_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
QUEUE_COLORS = {"running": "#404040", "waiting": "#b0b0b0"}
PREEMPTION_MARKS = {"decode": "v", "prefill": "x"}
# The running-requests line is dash-dotted so the legend tells it from the arms' solid "KV blocks in use" lines.
RUNNING_STYLE = "-."
HELD_LINE_MAX_ARMS = 2  # the dashed "held by requests" line only up to this many arms (report.json has it always)


def arm_color(index: int) -> str:
    return ARM_COLORS[index % len(ARM_COLORS)]


def _plot_timeline(ax, entry: dict, color: str, scales: dict, show_held: bool):
    """One arm over modelled time: KV blocks in use (its colour), held by requests (dashed, if ``show_held``), the
    pool (dotted), running and waiting requests (greys, right axis), preemptions by victim phase (black marks)."""
    series = entry["series"]
    times = [v / 1000.0 for v in series["step_end_ms"]]
    ax.plot(times, series["blocks_in_use"], color=color, lw=1.2)
    if show_held:
        ax.plot(times, series["blocks_held_by_requests"], color=color, lw=0.8, ls="--", alpha=0.7)
    if scales["pool"]:
        ax.axhline(scales["pool"], color="black", lw=0.8, ls=":")
    ax.set_ylim(0, scales["blocks"] * 1.08)
    ax.set_xlim(0, scales["t_max"] * 1.01)
    ax.set_ylabel("KV blocks")
    twin = ax.twinx()
    twin.fill_between(times, series["waiting"], color=QUEUE_COLORS["waiting"], alpha=0.45, lw=0, step="post")
    twin.plot(times, series["running"], color=QUEUE_COLORS["running"], lw=0.9, ls=RUNNING_STYLE)
    twin.set_ylim(0, scales["requests"] * 1.08)
    twin.set_ylabel("requests")
    ax.set_zorder(twin.get_zorder() + 1)  # the arm's line and the marks above the grey queue areas
    ax.patch.set_visible(False)
    for phase, marker in PREEMPTION_MARKS.items():
        xs = [p[0] for p in series["preemptions"] if p[2] == phase]
        if xs:
            ax.scatter([times[x] for x in xs], [series["blocks_in_use"][x] for x in xs], color="black", marker=marker,
                       s=28, zorder=5, linewidths=1.2)
    f = entry["figures"]
    ax.set_title(
        f"{entry['profile']}: {f['preemptions']} {_plural(f['preemptions'], 'preemption')} "
        f"({f['preemptions_decode_victims']} decode / {f['preemptions_prefill_victims']} prefill "
        f"{_plural(f['preemptions_decode_victims'] + f['preemptions_prefill_victims'], 'victim')}), "
        f"{f['steps']} {_plural(f['steps'], 'step')}"
        + ("" if f["drained"] else f" - NOT DRAINED ({f['stop_reason'].split(':')[0]})"),
        fontsize=9.5, loc="left", color=color, fontweight="bold",
    )


def _plot_distributions(axes: dict, profiles: Sequence[dict], t_max: float) -> None:
    """Arms overlaid, each in its colour: requests completed over modelled time, and the TTFT, E2E, TPOT and stall
    CDFs (log x where every value is positive)."""
    from matplotlib.ticker import NullFormatter

    for i, entry in enumerate(profiles):
        series, color = entry["series"], arm_color(i)
        finish = [v / 1000.0 for v in series["finish_ms"]]
        axes["done"].step(finish, range(1, len(finish) + 1), where="post", color=color, lw=1.2, label=entry["profile"])
        for key in ("ttft_ms", "e2e_ms", "tpot_ms", "stall_ms"):
            values = series.get(key) or []
            if values:
                axes[key].step(values, [(k + 1) / len(values) for k in range(len(values))], where="post", color=color,
                               lw=1.2)
    done = axes["done"]
    done.set_xlim(0, t_max * 1.01)
    done.set_xlabel("modelled time (s)")
    done.set_ylabel("requests completed")
    done.grid(alpha=0.3)
    labels = {"ttft_ms": "TTFT", "e2e_ms": "E2E latency", "tpot_ms": "TPOT", "stall_ms": "stall: longest token gap"}
    for key, label in labels.items():
        ax = axes[key]
        values = [v for p in profiles for v in p["series"].get(key) or []]
        log = key != "tpot_ms" and values and min(values) > 0
        if log:
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks run into each other
        ax.set_xlabel(f"{label}\nmodelled ms{', log' if log else ''}; left is better", fontsize=9)
        ax.set_ylim(0, 1.02)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)


def _legend_handles(profiles: Sequence[dict], pool, show_held: bool) -> list:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Line2D([], [], color=arm_color(i), lw=2.5, label=p["profile"]) for i, p in enumerate(profiles)]
    handles += [
        Line2D([], [], color=arm_color(0), lw=1.2, label="KV blocks in use (solid, in the arm's colour)"),
        Line2D([], [], color="black", lw=0.8, ls=":", label=f"pool ({pool})"),
        Line2D([], [], color=QUEUE_COLORS["running"], lw=0.9, ls=RUNNING_STYLE,
               label="running requests (dash-dot, grey; right axis)"),
        Patch(color=QUEUE_COLORS["waiting"], alpha=0.45, label="waiting requests (right axis)"),
        Line2D([], [], color="black", marker=PREEMPTION_MARKS["decode"], ls="", label="preemption, decode victim"),
        Line2D([], [], color="black", marker=PREEMPTION_MARKS["prefill"], ls="", label="preemption, prefill victim"),
    ]
    if show_held:
        handles.insert(len(profiles) + 1, Line2D([], [], color=arm_color(0), lw=0.8, ls="--", alpha=0.7,
                                                  label="KV blocks held by requests (dashed, arm's colour)"))
    return handles


def _verdict_figure_lines(report: dict, width: int = 150) -> list:
    """(text, colour) per line of the verdict under the figure: the heading in black, each arm's lines (its
    figures wrapped at ``width``, then its noise lines) in its colour."""
    lines = verdict_lines(report["profiles"])
    if not lines:
        return []
    heading = " ".join(part.strip() for part in lines[0].splitlines())
    out = [(line, "black") for line in _wrap(heading, "", "", width)]
    for i, entry in enumerate(lines[1:], start=1):
        physical = [line.strip() for line in entry.splitlines()]
        figures = [line for line in physical if not line.startswith("noise ")]
        for k, part in enumerate(_wrap(" ".join(figures), "", "    ", width)):
            out.append((part, arm_color(i)))
        out += [("    " + line, arm_color(i)) for line in physical if line.startswith("noise ")]
    return out


def write_plot(report: dict, path: str, title: str = "") -> None:
    """One figure, the same scales everywhere, one colour per arm in every panel.

    * one panel per arm over modelled time (:func:`_plot_timeline`);
    * arms overlaid: completed requests over modelled time, TTFT, E2E, TPOT and stall CDFs;
    * the verdict lines (:func:`verdict_lines`) at the bottom, each in its arm's colour.

    Needs matplotlib (raises ImportError otherwise; the caller says how to install it).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = report["profiles"]
    n = len(profiles)
    pool = report["engine"].get("num_gpu_blocks")
    scales = {
        "pool": pool,
        "t_max": max((p["series"]["step_end_ms"][-1] for p in profiles if p["series"]["step_end_ms"]),
                     default=1000.0) / 1000.0,
        "requests": max((max(p["series"]["running"] + p["series"]["waiting"] or [0]) for p in profiles),
                        default=1) or 1,
        "blocks": pool or max((max(p["series"]["blocks_in_use"] or [1]) for p in profiles), default=1),
    }
    show_held = n <= HELD_LINE_MAX_ARMS
    verdict_text = _verdict_figure_lines(report)
    panel = 2.3 if n <= 2 else 1.9
    text_height = 0.18 * len(verdict_text) + (0.25 if verdict_text else 0)
    height = panel * n + 3.4 + text_height + 0.9
    fig = plt.figure(figsize=(16, height))
    grid = fig.add_gridspec(n + 2, 5, height_ratios=[panel] * n + [3.4, max(text_height, 0.01)],
                            top=1 - 1.05 / height, bottom=0.02, hspace=0.55, wspace=0.3)
    first = None
    for i, entry in enumerate(profiles):
        ax = fig.add_subplot(grid[i, :], sharex=first)
        first = first or ax
        _plot_timeline(ax, entry, arm_color(i), scales, show_held)
        if i < n - 1:
            plt.setp(ax.get_xticklabels(), visible=False)
        else:
            ax.set_xlabel("modelled time (s)")
    keys = ("done", "ttft_ms", "e2e_ms", "tpot_ms", "stall_ms")
    _plot_distributions({key: fig.add_subplot(grid[n, k]) for k, key in enumerate(keys)}, profiles, scales["t_max"])
    if verdict_text:
        text_ax = fig.add_subplot(grid[n + 1, :])
        text_ax.axis("off")
        step = 1.0 / len(verdict_text)
        for k, (line, color) in enumerate(verdict_text):
            text_ax.text(0.0, 1.0 - k * step, line, color=color, family="monospace", fontsize=8.5, va="top",
                         transform=text_ax.transAxes)
    fig.legend(handles=_legend_handles(profiles, pool, show_held), loc="upper center", ncol=min(n + 6, 6),
               fontsize=8.5, frameon=False, bbox_to_anchor=(0.5, 1 - 0.3 / height))
    host = report.get("host", {})
    subtitle = host.get("label") or f"FastDeploy {host.get('version', '?')} {str(host.get('commit') or '')[:8]}".strip()
    fig.suptitle((title + " - " if title else "") + subtitle, fontsize=11, y=1 - 0.05 / height)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def trace_info(trace, path) -> dict:
    """The report's ``trace`` section."""
    return {
        "name": trace.name,
        "description": trace.description,
        "requests": len(trace.requests),
        "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
    }

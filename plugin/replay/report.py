"""The replay report: JSON document and terminal table (the figure: :mod:`fdsched.replay.plot`; the verdict line:
:mod:`fdsched.replay.verdict`). Imports nothing from FastDeploy.

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


def trace_info(trace, path) -> dict:
    """The report's ``trace`` section."""
    return {
        "name": trace.name,
        "description": trace.description,
        "requests": len(trace.requests),
        "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
    }

"""The replay report: JSON document, terminal table, PNG. Imports nothing from FastDeploy.

``report.json`` is byte-identical for the same inputs (trace, profiles, engine shape, cost model,
host) except its ``measured`` section, which holds wall-clock timings and nothing else.
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

from .figures import ProfileRun, compute_figures, measured_figures

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
    "write_plot",
]

REPORT_VERSION = 1
INSTALL_HINT = "pip install 'fastdeploy-sched-plugin[report]'"

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
    ("tpot_ms_p50", "TPOT p50 (modelled ms)"),
    ("tpot_ms_p99", "TPOT p99 (modelled ms)"),
    ("requests_finished", "requests finished"),
    ("invariant_violations", "invariant violations"),
)
MEASURED_ROWS = (
    ("schedule_cpu_ms_mean", "schedule() CPU ms / step, mean*"),
    ("schedule_cpu_ms_p99", "schedule() CPU ms / step, p99*"),
)


def _series(run: ProfileRun) -> dict:
    return {
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


def build_report(trace: dict, engine: dict, runs: Sequence[ProfileRun], include_series: bool = True) -> dict:
    """The report document. ``trace``: name, description, requests, sha256 (plain values)."""
    profiles = []
    for run in runs:
        entry = {
            "profile": run.profile,
            "host": dict(run.host),
            "decisions": dict(run.decisions),
            "cost_model": run.cost.to_json(),
            "figures": compute_figures(run),
            "violations": _violations(run),
        }
        if include_series:
            entry["series"] = _series(run)
        profiles.append(entry)
    return {
        "fdsched_replay_report": REPORT_VERSION,
        "trace": dict(trace),
        "engine": dict(engine),
        "profiles": profiles,
        "measured": {
            "note": "wall-clock measurements on this machine; they differ from run to run",
            "profiles": {run.profile: measured_figures(run) for run in runs},
        },
    }


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


def _grid(rows: list, headers: list) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join([first] + rest).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_table(report: dict, measured: bool = True) -> str:
    """Rows = figures, one column per profile, then one ratio column per profile after the first
    (``B/A``: that profile's value over the first one's)."""
    profiles = report["profiles"]
    names = [p["profile"] for p in profiles]
    headers = ["figure"] + names + [f"{n}/{names[0]}" for n in names[1:]]
    rows = []

    def add(label: str, values: list) -> None:
        cells = [label] + [format_value(v) for v in values]
        for v in values[1:]:
            r = ratio(v, values[0])
            cells.append("-" if r is None else f"{r:.2f}")
        rows.append(cells)

    for key, label in TABLE_ROWS:
        add(label, [p["figures"].get(key) for p in profiles])
    if measured:
        by_name = report["measured"]["profiles"]
        for key, label in MEASURED_ROWS:
            add(label, [by_name.get(n, {}).get(key) for n in names])
    text = _grid(rows, headers)
    notes = []
    if measured:
        notes.append("* measured wall-clock/CPU figures (not part of the deterministic report)")
    for p in profiles:
        f = p["figures"]
        if not f["drained"]:
            notes.append(f"{p['profile']}: NOT DRAINED after {f['steps']} steps ({f['stop_reason']})")
        if f["admissions_blocked"] is None:
            notes.append(f"{p['profile']}: admissions blocked n/a: the host's own reservation code decides")
    return text + ("\n" + "\n".join(notes) if notes else "")


# --------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------
def write_plot(report: dict, path: str, title: str = "") -> None:
    """blocks in use and running / waiting over steps, one panel per profile, preemptions marked.

    Needs matplotlib (raises ImportError otherwise; the caller says how to install it).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.lines import Line2D

    profiles = report["profiles"]
    total = report["engine"].get("num_gpu_blocks")
    marks = {"decode": ("tab:red", "v"), "prefill": ("black", "x")}
    fig, axes = plt.subplots(len(profiles), 1, figsize=(11, 1.0 + 2.9 * len(profiles)), sharex=True, squeeze=False)
    for ax, entry in zip(axes[:, 0], profiles):
        series = entry["series"]
        steps = list(range(len(series["blocks_in_use"])))
        ax.plot(steps, series["blocks_in_use"], color="tab:blue", lw=1.2)
        ax.plot(steps, series["blocks_held_by_requests"], color="tab:cyan", lw=0.8, ls="--")
        if total:
            ax.axhline(total, color="grey", lw=0.8, ls=":")
        ax.set_ylabel("KV blocks")
        ax.set_ylim(0, (total or max(series["blocks_in_use"] or [1])) * 1.08)
        twin = ax.twinx()
        twin.plot(steps, series["running"], color="tab:green", lw=1.0)
        twin.plot(steps, series["waiting"], color="tab:orange", lw=1.0)
        twin.set_ylabel("requests")
        twin.set_ylim(bottom=0)
        for phase, (color, marker) in marks.items():
            xs = [p[0] for p in series["preemptions"] if p[2] == phase]
            if xs:
                ys = [series["blocks_in_use"][x] for x in xs]
                ax.scatter(xs, ys, color=color, marker=marker, s=30, zorder=5)
        f = entry["figures"]
        ax.set_title(
            f"{entry['profile']}: {f['preemptions']} preemptions "
            f"({f['preemptions_decode_victims']} decode / {f['preemptions_prefill_victims']} prefill victims), "
            f"{f['steps']} steps" + ("" if f["drained"] else f" - NOT DRAINED ({f['stop_reason'].split(':')[0]})"),
            fontsize=10,
        )
    axes[-1, 0].set_xlabel("engine step")
    legend = [
        Line2D([], [], color="tab:blue", lw=1.2, label="blocks in use (not free)"),
        Line2D([], [], color="tab:cyan", lw=0.8, ls="--", label="blocks held by requests"),
        Line2D([], [], color="grey", lw=0.8, ls=":", label=f"pool ({total})"),
        Line2D([], [], color="tab:green", lw=1.0, label="running (right axis)"),
        Line2D([], [], color="tab:orange", lw=1.0, label="waiting (right axis)"),
        Line2D([], [], color=marks["decode"][0], marker=marks["decode"][1], ls="", label="preemption, decode victim"),
        Line2D([], [], color=marks["prefill"][0], marker=marks["prefill"][1], ls="", label="preemption, prefill victim"),
    ]
    height = 1.0 + 2.9 * len(profiles)
    fig.legend(handles=legend, loc="upper center", ncol=4, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.3 / height))
    if title:
        fig.suptitle(title, fontsize=11, y=1 - 0.05 / height)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.62 / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)

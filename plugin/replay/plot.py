"""The replay report's figure (``replay.png``): one timeline panel per arm over modelled time, the arms overlaid
in the latency distributions, and the verdict lines under it, one colour per arm in every panel. Needs matplotlib
(:data:`fdsched.replay.report.INSTALL_HINT` says how to install it). Imports nothing from FastDeploy.
"""

from __future__ import annotations

from typing import Sequence

from fdsched.replay.verdict import noun_for, verdict_lines, wrap_text

__all__ = ["ARM_COLORS", "QUEUE_COLORS", "arm_color", "write_plot"]

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
        f"{entry['profile']}: {f['preemptions']} {noun_for(f['preemptions'], 'preemption')} "
        f"({f['preemptions_decode_victims']} decode / {f['preemptions_prefill_victims']} prefill "
        f"{noun_for(f['preemptions_decode_victims'] + f['preemptions_prefill_victims'], 'victim')}), "
        f"{f['steps']} {noun_for(f['steps'], 'step')}"
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
    out = [(line, "black") for line in wrap_text(heading, "", "", width)]
    for i, entry in enumerate(lines[1:], start=1):
        physical = [line.strip() for line in entry.splitlines()]
        figures = [line for line in physical if not line.startswith("noise ")]
        for k, part in enumerate(wrap_text(" ".join(figures), "", "    ", width)):
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

"""Which arm to ship: every shippable arm of earlier ``fdsched eval`` runs against the best one, per trace and
figure (:func:`compare_arms`), and its table (:func:`format_comparison`). Reading the runs is
:func:`fdsched.replay.evaluate.load_arm_results`; the command is ``python -m fdsched.replay.evaluate --compare``.
No host needed, nothing runs.
"""

from __future__ import annotations

from typing import Optional, Sequence

from fdsched.core.common import text_table
from fdsched.replay.report import format_value

__all__ = ["SHIPPABLE_ARMS", "BOUND_ARMS", "COMPARE_FIGURES", "REL_TOL", "PER_1K_ABS_TOL", "compare_arms",
           "format_comparison"]

SHIPPABLE_ARMS = ("baseline", "recommended", "adaptive", "optimism", "upstream-clip", "sglang-retract",
                  "peak-adaptive", "clip-learned")  # the last two: replay-only candidates (examples/profiles)
BOUND_ARMS = ("oracle", "unbounded")  # bounds, not policies: shown beside, never "the best"

# (name, figure key, higher is better, per 1k requests): the figures an arm is compared on.
COMPARE_FIGURES = (
    ("thr", "throughput_tokens_per_s", True, False),
    ("TTFT p50", "ttft_ms_p50", False, False),
    ("E2E p99", "e2e_ms_p99", False, False),
    ("stall p99", "stall_ms_p99", False, False),
    ("preempt/1k", "preemptions", False, True),
    ("prefill vict/1k", "preemptions_prefill_victims", False, True),
)
REL_TOL = 0.02  # within 2% of the best arm's value ...
PER_1K_ABS_TOL = 1.0  # ... or, for the counts per 1k requests, within 1 per 1k of the best


def _figure_value(figures: dict, key: str, per_1k: bool) -> Optional[float]:
    value = figures.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if per_1k:
        requests = figures.get("requests")
        if not isinstance(requests, (int, float)) or requests <= 0:
            return None
        return 1000.0 * value / requests
    return float(value)


def _within(value: float, best: float, higher: bool, per_1k: bool, rel_tol: float, abs_tol: float) -> bool:
    if higher:
        return value >= best * (1.0 - rel_tol)
    if per_1k and value - best <= abs_tol:
        return True
    return value <= best * (1.0 + rel_tol)


def compare_arms(results: Sequence[tuple], shippable: Sequence[str] = SHIPPABLE_ARMS,
                 bounds: Sequence[str] = BOUND_ARMS, rel_tol: float = REL_TOL,
                 abs_tol_per_1k: float = PER_1K_ABS_TOL) -> dict:
    """Each shippable arm against the best shippable arm, per trace and figure (:data:`COMPARE_FIGURES`).

    ``results``: ``[(trace, [{"profile", "figures", ...}])]`` (:func:`load_arm_results`; :func:`load_results`'s
    entries work too). Per trace and figure, the best is the highest throughput or the lowest of the others, among
    the shippable arms present; an arm is *within* when its value is at least ``(1 - rel_tol)`` x the best
    throughput, at most ``(1 + rel_tol)`` x the best of a lower-is-better figure, or, for the counts per 1k
    requests, at most ``abs_tol_per_1k`` above the best (a count of 0 has no relative band). Bounds
    (``bounds``) get their ratio to the best shippable arm but are never the best and never "within".

    Returns ``{"traces": [{"trace", "rows": [{"arm", "bound", "cells": {figure: (value, ratio, within)},
    "within_all"}]}], "within_everywhere": [arms within on every figure of every trace they ran on, and that ran
    on every trace], "arms": [shippable arms present]}``. A ratio is value / best (None when the best is 0).
    """
    traces, present = [], []
    for trace_name, profiles in results:
        by_arm = {p["profile"]: p["figures"] for p in profiles}
        ship = [a for a in shippable if a in by_arm]
        for a in ship:
            if a not in present:
                present.append(a)
        best = {}
        for name, key, higher, per_1k in COMPARE_FIGURES:
            values = [v for v in (_figure_value(by_arm[a], key, per_1k) for a in ship) if v is not None]
            best[name] = (max(values) if higher else min(values)) if values else None
        rows = []
        for arm in ship + [b for b in bounds if b in by_arm]:
            cells, within_all = {}, True
            for name, key, higher, per_1k in COMPARE_FIGURES:
                value, top = _figure_value(by_arm[arm], key, per_1k), best[name]
                if value is None or top is None:
                    cells[name] = (value, None, None)
                    within_all = False
                    continue
                r = value / top if top != 0 else (1.0 if value == 0 else None)
                ok = _within(value, top, higher, per_1k, rel_tol, abs_tol_per_1k)
                cells[name] = (value, r, ok)
                within_all = within_all and ok
            bound = arm in bounds
            rows.append({"arm": arm, "bound": bound, "cells": cells, "within_all": None if bound else within_all})
        traces.append({"trace": trace_name, "rows": rows, "best": best})
    everywhere = [
        a for a in present
        if all(any(r["arm"] == a for r in t["rows"]) for t in traces)
        and all(r["within_all"] for t in traces for r in t["rows"] if r["arm"] == a)
    ]
    return {"traces": traces, "within_everywhere": everywhere, "arms": present}


def _cell(value, r, ok) -> str:
    if value is None:
        return "n/a"
    text = format_value(round(value, 2) if isinstance(value, float) else value)
    mark = "" if ok in (None, True) else " *"
    return f"{text}{mark}" if r is None else f"{text} ({r:.3f}){mark}"


def format_comparison(comparison: dict, markdown: bool = False, rel_tol: float = REL_TOL,
                      abs_tol_per_1k: float = PER_1K_ABS_TOL) -> str:
    """One table: per trace and arm, each figure's value and (its ratio to the best shippable arm); ``*`` marks a
    figure outside the tolerance; then which arms are within it on every figure, per trace and overall."""
    names = [name for name, _, _, _ in COMPARE_FIGURES]
    headers = ["trace", "arm"] + names + ["within all"]
    rows = []
    for t in comparison["traces"]:
        for i, r in enumerate(t["rows"]):
            word = "bound" if r["bound"] else ("yes" if r["within_all"] else "no")
            rows.append([t["trace"] if (i == 0 or not markdown) else "", r["arm"]]
                        + [_cell(*r["cells"][n]) for n in names] + [word])
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(cells) + " |" for cells in rows]
        table = "\n".join(lines)
    else:
        table = text_table(rows, headers, align_right_from=2)
    directions = ", ".join(f"{n} {'higher' if h else 'lower'} is better" for n, _, h, _ in COMPARE_FIGURES)
    per_trace = []
    for t in comparison["traces"]:
        ok = [r["arm"] for r in t["rows"] if r["within_all"]]
        per_trace.append(f"  {t['trace']}: {', '.join(ok) if ok else 'none'}")
    everywhere = comparison["within_everywhere"]
    counts = []
    for arm in comparison["arms"]:
        cells = [c for t in comparison["traces"] for r in t["rows"] if r["arm"] == arm for c in r["cells"].values()]
        inside = sum(1 for c in cells if c[2])
        counts.append(f"{arm} {inside}/{len(cells)}")
    worst_lines = []
    for arm in comparison["arms"]:
        parts = []
        for name, _, higher, per_1k in COMPARE_FIGURES:
            if per_1k:
                gaps = [t["best"][name] is not None and r["cells"][name][0] is not None
                        and r["cells"][name][0] - t["best"][name] for t in comparison["traces"] for r in t["rows"]
                        if r["arm"] == arm]
                gaps = [g for g in gaps if g is not False]
                parts.append(f"{name} +{max(gaps):.1f}" if gaps else f"{name} n/a")
            else:
                ratios = [r["cells"][name][1] for t in comparison["traces"] for r in t["rows"]
                          if r["arm"] == arm and r["cells"][name][1] is not None]
                parts.append(f"{name} {(min(ratios) if higher else max(ratios)):.3f}" if ratios else f"{name} n/a")
        worst_lines.append(f"  {arm}: " + ", ".join(parts))
    return (
        table + "\n"
        + f"value (value / best shippable arm's); {directions}; within = at least {1 - rel_tol:g}x the best throughput, "
        f"at most {1 + rel_tol:g}x the best of the others, or for the counts per 1k requests at most "
        f"{abs_tol_per_1k:g} per 1k above the best; * = outside; bounds ({', '.join(BOUND_ARMS)}) are shown, never "
        "the best\nwithin on every figure, per trace:\n" + "\n".join(per_trace) + "\n"
        + f"within on every figure of every trace: {', '.join(everywhere) if everywhere else 'none'}\n"
        + f"figures within, over every trace (arm within/cells): {', '.join(counts)}\n"
        + "worst over the traces (ratio to the best; per 1k: above the best):\n" + "\n".join(worst_lines)
    )

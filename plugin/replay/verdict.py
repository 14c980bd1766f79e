"""The verdict of a comparison, in one place: which arm is better or worse than the reference on what users feel
together (TTFT p50, E2E p99, stall p99), with a tolerance for noise (:func:`verdict`), and the one line per arm that
ends every output comparing arms (:func:`verdict_line`: the replay's table, its PNG, ``fdsched eval``, the served
report, ``fdsched ab report``). Imports nothing from FastDeploy.
"""

from __future__ import annotations

from typing import Optional, Sequence

from fdsched.core.common import plural
from fdsched.replay.report import format_value, ratio

__all__ = [
    "VERDICT_KEYS", "VERDICT_TOLERANCE", "VERDICT_DOMINANT_FACTOR", "VERDICT_LINE_FIGURES", "VERDICT_WIDTH",
    "SMALL_REQUESTS", "SMALL_EVENTS", "verdict", "change_words", "verdict_line", "verdict_heading", "verdict_lines",
    "format_verdicts", "wrap_text", "noun_for",
]

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


def wrap_text(text: str, first: str, rest: str, width: int) -> list:
    """``text`` wrapped at ``width``, the first line after ``first``, the others after ``rest`` (words never split)."""
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
        parts.append(f"{mine} prefill {noun_for(mine, 'victim')} ({reference_name} {theirs})")
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
        lines += wrap_text(clause, VERDICT_CONTINUATION, VERDICT_CONTINUATION + "  ", width)
    return "\n".join(lines)


def noun_for(count, noun: str) -> str:
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
    return "\n".join(wrap_text(text, "", "  ", width))


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

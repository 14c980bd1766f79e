"""``fdsched ab report``: the per-arm comparison of an online A/B, from a Prometheus text exposition.

An online A/B runs one arm (profile) per data-parallel rank of one deployment (``FDSCHED_PROFILE_BY_DP_RANK``);
the plugin's metrics carry the arm as the label ``arm``. This command reads a scrape of ``/metrics`` (a saved
file, ``-`` for stdin, or an http(s) URL) — or several, added up: with ``multi_api_server`` every rank's
api_server has its own ``/metrics`` — optionally minus earlier scrapes (``--since``: the window between the
two), and prints one row per figure and one column per arm, with the ratio of each arm to the reference
arm and the counts behind each figure, so a reader can judge noise.

Figures per arm come from the plugin's series (requests, output tokens, TTFT, TPOT, preemptions, recomputed
tokens, admissions blocked); E2E and token gaps come from FastDeploy's own histograms, which carry no ``arm``
label: a scrape's host histograms belong to one arm only when that scrape holds the plugin series of exactly one
arm, and a scrape that holds several arms is printed pooled under the table. Which metric each figure comes from,
and what the metrics cannot show (a request's stall, E2E of non-chat requests, anything finer than a bucket):
examples/ab_run.md and docs/online-ab.md.

The exposition is parsed by :mod:`fdsched.cmdline.scrape` (with ``prometheus_client``'s own parser, a FastDeploy
dependency; the ``report`` extra installs it).
"""

from __future__ import annotations

import sys
import urllib.request
from typing import Optional

from fdsched.cmdline.scrape import (
    HOST_E2E, HOST_GAP, HOST_HISTOGRAMS, PREFIX, ABReportError, ArmSeries, Histogram, Scrape, attribute_host,
    merge_scrapes, parse_scrape,
)
from fdsched.core.common import EXIT_ERROR, EXIT_OK, read_utf8, text_table

__all__ = ["arm_figures", "host_figures", "format_report", "LATE_GAP_SECONDS", "add_command", "cmd_report"]

LATE_GAP_SECONDS = 0.5  # a bucket bound of HOST_GAP on both hosts


def _read(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    if source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(source, timeout=30) as response:
                return response.read().decode("utf-8")
        except Exception as exc:
            raise ABReportError(f"cannot read {source}: {exc}; allowed: a saved scrape file, - (stdin) or a /metrics URL") from exc
    return read_utf8(source, "scrape", "a saved /metrics scrape, - (stdin) or a /metrics URL", ABReportError)


# figure name, better direction ("lower"/"higher"/None), function(ArmSeries) -> (value, count behind it)
def _per(numerator: float, requests: float, scale: float = 1.0):
    return (numerator / requests * scale if requests > 0 else None), requests


def _figures():
    finished = lambda s: s.counter(PREFIX + "requests_finished")  # noqa: E731
    rows = [
        ("requests finished", None, lambda s: (finished(s), finished(s))),
        ("output tokens", None, lambda s: (s.counter(PREFIX + "output_tokens"), finished(s))),
    ]
    for metric, title in (("ttft_seconds", "TTFT"), ("tpot_seconds", "TPOT")):
        name = PREFIX + metric
        rows.append((f"{title} mean (ms)", "lower", lambda s, n=name: _ms(s.histograms.get(n, Histogram()).mean(), s, n)))
        for q in (0.5, 0.9, 0.99):
            rows.append(
                (f"{title} p{int(q * 100)} (ms)", "lower", lambda s, n=name, q=q: _ms(s.histograms.get(n, Histogram()).quantile(q), s, n))
            )
    rows += [
        ("preemptions / 1k requests", "lower", lambda s: _per(s.counter(PREFIX + "preemptions"), finished(s), 1000)),
        (
            "  prefill-phase victims / 1k requests",
            "lower",
            lambda s: _per(s.counter(PREFIX + "preemptions", victim_phase="prefill"), finished(s), 1000),
        ),
        ("recomputed tokens / request", "lower", lambda s: _per(s.counter(PREFIX + "recomputed_tokens"), finished(s))),
        ("admissions blocked / request", None, _admissions_blocked),
    ]
    return rows + _host_rows()


def _host_rows():
    """Rows from FastDeploy's own histograms (``-`` for an arm whose scrapes held other arms too)."""
    rows = []
    for q in (0.5, 0.9, 0.99):
        rows.append((f"E2E p{int(q * 100)} (ms, host, chat)", "lower",
                     lambda s, q=q: _ms(s.histograms.get(HOST_E2E, Histogram()).quantile(q), s, HOST_E2E)))
    for q in (0.5, 0.99):
        rows.append((f"token gap p{int(q * 100)} (ms, host)", "lower",
                     lambda s, q=q: _ms(s.histograms.get(HOST_GAP, Histogram()).quantile(q), s, HOST_GAP)))
    rows.append((f"token gaps > {LATE_GAP_SECONDS:g} s / 1k gaps (host)", "lower", _late_gaps))
    return rows


def _late_gaps(series):
    hist = series.histograms.get(HOST_GAP, Histogram())
    late = hist.above(LATE_GAP_SECONDS)
    return (None if late is None or hist.count <= 0 else late / hist.count * 1000), hist.count


def host_figures(host: dict) -> list:
    """[(figure, (value, count))] of the host histograms ``host`` (pooled over arms)."""
    series = ArmSeries(histograms=dict(host))
    return [(title, fn(series)) for title, _better, fn in _host_rows()]


def _admissions_blocked(series):
    """Counted only where the plugin's reservation code runs (its series exists there, from 0); else n/a."""
    name = PREFIX + "admissions_blocked"
    if not any(n == name for n, _ in series.counters):
        return None, series.counter(PREFIX + "requests_finished")
    return _per(series.counter(name), series.counter(PREFIX + "requests_finished"))


def _ms(value, series, name):
    return (None if value is None else value * 1e3), series.histograms.get(name, Histogram()).count


def arm_figures(arms: dict) -> list:
    """[(figure, better, {arm: (value, count)})]."""
    return [(title, better, {arm: fn(series) for arm, series in arms.items()}) for title, better, fn in _figures()]


def _fmt(value) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100 or value == int(value):
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:g}"
    return f"{value:.3g}"


def format_report(arms: dict, reference: Optional[str] = None, pooled: Optional[dict] = None) -> str:
    names = sorted(arms)
    reference = reference or names[0]
    if reference not in arms:
        raise ABReportError(f"--reference {reference!r} is not an arm of this scrape; allowed: {', '.join(names)}")
    others = [a for a in names if a != reference]
    ordered = [reference] + others
    headers = ["figure", "better"] + [f"{a} (n)" for a in ordered] + [f"{a}/{reference}" for a in others]
    rows = []
    for title, better, values in arm_figures(arms):
        row = [title, {"lower": "lower", "higher": "higher"}.get(better, "")]
        for arm in ordered:
            value, count = values[arm]
            row.append(f"{_fmt(value)} ({_fmt(count)})")
        ref_value = values[reference][0]
        for arm in others:
            value = values[arm][0]
            row.append("-" if value is None or not ref_value else f"{value / ref_value:.2f}")
        rows.append(row)
    ranks = "; ".join(f"{arm}: dp_rank {', '.join(sorted(arms[arm].dp_ranks)) or '?'}" for arm in ordered)
    text = f"arms: {ranks}\n(n) = requests (or observations) behind each figure\n" + text_table(rows, headers)
    return text + "\n" + _host_note(arms, pooled or {})


def _host_note(arms: dict, pooled: dict) -> str:
    lines = []
    if pooled and not any(h.count > 0 for h in pooled.values()):
        lines.append("FastDeploy's E2E and token-gap histograms are in the scrape with 0 observations (nothing observed "
                     "them: the api_server observes E2E for chat completions, the token processor the gaps)")
    if any(h.count > 0 for h in pooled.values()):
        cells = "; ".join(f"{title.strip()} {_fmt(value)} ({_fmt(count)})" for title, (value, count) in host_figures(pooled))
        lines.append("host histograms pooled over arms (a scrape held several arms; FastDeploy's own series have no "
                     f"arm label): {cells}")
    if not any(n in s.histograms for s in arms.values() for n in HOST_HISTOGRAMS):
        lines.append("E2E and token gaps per arm: '-' (they come from FastDeploy's own histograms, which carry no arm "
                     "label: they are an arm's only when one scrape holds one arm, as with multi_api_server's "
                     "api_server per rank scraped one by one)")
    lines.append("not in any metric: a request's stall (longest gap between two tokens), recompute time per request, "
                 "E2E of non-chat requests; fdsched serve's report has them per request")
    return "\n".join(lines)


def _parse_or_empty(text: str, source: str) -> Scrape:
    """An earlier scrape may predate every per-arm series (taken before the first request finished)."""
    return parse_scrape(text, source, require_arms=False)


def _verdict_text(arms: dict, reference: Optional[str]) -> str:
    """The verdict lines (one definition: :func:`fdsched.replay.verdict.verdict_lines`) on what a scrape has:
    TTFT p50, prefill victims and requests finished; /metrics has no throughput, E2E or stall (the lines say n/a)."""
    from fdsched.replay.verdict import verdict_lines

    def figures(series):
        ttft = series.histograms.get(PREFIX + "ttft_seconds", Histogram()).quantile(0.5)
        return {"ttft_ms_p50": None if ttft is None else ttft * 1e3,
                "preemptions_prefill_victims": int(round(series.counter(PREFIX + "preemptions", victim_phase="prefill"))),
                "requests_finished": int(round(series.counter(PREFIX + "requests_finished")))}

    profiles = [{"profile": arm, "figures": figures(arms[arm])} for arm in sorted(arms)]
    lines = verdict_lines(profiles, reference, what="server-side, from /metrics")
    return "\n" + "\n".join(lines) if lines else ""


def add_command(sub) -> None:
    ab = sub.add_parser("ab", help="online A/B (one arm per data-parallel rank): the per-arm report")
    ab_sub = ab.add_subparsers(dest="ab_command", required=True)
    report = ab_sub.add_parser("report", help="per-arm comparison from a /metrics scrape (file, - or URL)")
    report.add_argument(
        "scrape",
        nargs="+",
        help="a saved Prometheus text exposition, - for stdin, or a /metrics URL; several (one per api_server of a "
        "multi_api_server deployment, each has its own /metrics) are added up",
    )
    report.add_argument(
        "--since",
        nargs="+",
        help="earlier scrapes of the same servers: report the window between them and the scrapes",
    )
    report.add_argument("--reference", help="the arm the others are compared with (default: the first by name)")
    report.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    try:
        scrapes = [parse_scrape(_read(source), source) for source in args.scrape]
        if args.since:
            earlier = [_parse_or_empty(_read(source), source) for source in args.since]
            if len(earlier) == len(scrapes):  # the same servers in the same order: the window per server
                scrapes = [later.minus(before) for later, before in zip(scrapes, earlier)]
            else:  # cannot pair them: per-arm series by arm, host histograms pooled
                total = Scrape(merge_scrapes([e.arms for e in earlier]), {})
                for e in earlier:
                    for name, h in e.host.items():
                        total.host[name] = total.host[name].plus(h) if name in total.host else h
                later = Scrape(merge_scrapes([s.arms for s in scrapes]), {})
                for s in scrapes:
                    for name, h in s.host.items():
                        later.host[name] = later.host[name].plus(h) if name in later.host else h
                scrapes = [later.minus(total)]
        arms, pooled = attribute_host(scrapes)
        print(format_report(arms, args.reference, pooled))
        verdict = _verdict_text(arms, args.reference)
        if verdict:
            print(verdict)
    except ABReportError as exc:
        print(f"fdsched ab report: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK

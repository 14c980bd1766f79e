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

The exposition is parsed with ``prometheus_client``'s own parser (a FastDeploy dependency; the ``report``
extra installs it).
"""

from __future__ import annotations

import math
import sys
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

from fdsched.core.common import EXIT_ERROR, EXIT_OK, read_utf8, text_table

__all__ = [
    "ArmSeries", "Scrape", "parse_exposition", "parse_scrape", "merge_scrapes", "attribute_host", "arm_figures",
    "host_figures", "format_report", "ABReportError", "HOST_HISTOGRAMS",
]

PREFIX = "fastdeploy:fdsched_"
# FastDeploy's own histograms the report reads (no arm label: attributed per scrape, see the module docstring and examples/ab_run.md)
HOST_E2E = "fastdeploy:e2e_request_latency_seconds"
HOST_GAP = "fastdeploy:time_per_output_token_seconds"
HOST_HISTOGRAMS = (HOST_E2E, HOST_GAP)
LATE_GAP_SECONDS = 0.5  # a bucket bound of HOST_GAP on both hosts


class ABReportError(RuntimeError):
    """The exposition could not be read, or has no per-arm series."""


@dataclass
class Histogram:
    buckets: dict = field(default_factory=dict)  # upper bound (float, inf included) -> cumulative count
    count: float = 0.0
    total: float = 0.0

    def plus(self, other: "Histogram") -> "Histogram":
        bounds = set(self.buckets) | set(other.buckets)
        return Histogram(
            {le: self.buckets.get(le, 0.0) + other.buckets.get(le, 0.0) for le in bounds},
            self.count + other.count,
            self.total + other.total,
        )

    def minus(self, other: "Histogram") -> "Histogram":
        return Histogram(
            {le: c - other.buckets.get(le, 0.0) for le, c in self.buckets.items()},
            self.count - other.count,
            self.total - other.total,
        )

    def quantile(self, q: float) -> Optional[float]:
        """Linear interpolation within the bucket holding the q-th observation (Prometheus' way)."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for le in sorted(self.buckets):
            cumulative = self.buckets[le]
            if cumulative >= rank:
                if math.isinf(le):
                    return lower_bound  # in the +Inf bucket: the highest finite bound is all we know
                width = cumulative - lower_count
                return lower_bound + (le - lower_bound) * ((rank - lower_count) / width if width > 0 else 1.0)
            lower_bound, lower_count = le, cumulative
        return lower_bound

    def mean(self) -> Optional[float]:
        return self.total / self.count if self.count > 0 else None

    def above(self, bound: float) -> Optional[float]:
        """Observations above ``bound`` (a bucket bound of this histogram; None if it is not one)."""
        if bound not in self.buckets:
            return None
        return self.count - self.buckets[bound]


@dataclass
class ArmSeries:
    counters: dict = field(default_factory=dict)  # (metric name, other labels frozenset) -> value
    histograms: dict = field(default_factory=dict)  # metric name -> Histogram
    dp_ranks: set = field(default_factory=set)

    def counter(self, name: str, **labels) -> float:
        want = set(labels.items())
        return sum(v for (n, other), v in self.counters.items() if n == name and want <= set(other))

    def plus(self, other: "ArmSeries") -> "ArmSeries":
        """The series of two scrapes of different servers together (multi_api_server: one /metrics per rank)."""
        counters = dict(self.counters)
        for k, v in other.counters.items():
            counters[k] = counters.get(k, 0.0) + v
        histograms = dict(self.histograms)
        for k, h in other.histograms.items():
            histograms[k] = histograms[k].plus(h) if k in histograms else h
        return ArmSeries(counters, histograms, self.dp_ranks | other.dp_ranks)

    def minus(self, other: "ArmSeries") -> "ArmSeries":
        return ArmSeries(
            {k: v - other.counters.get(k, 0.0) for k, v in self.counters.items()},
            {k: h.minus(other.histograms.get(k, Histogram())) for k, h in self.histograms.items()},
            set(self.dp_ranks),
        )


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


def _bad_line(text: str, parse) -> tuple:
    """(line number, line) of the first line the parser refuses on its own, else (None, ""): the parser's error
    names the bad token but not where it is."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            list(parse(line + "\n"))
        except Exception:
            return number, line
    return None, ""


@dataclass
class Scrape:
    """One server's scrape: the plugin's per-arm series and the host's own histograms (no arm label)."""
    arms: dict  # arm -> ArmSeries
    host: dict = field(default_factory=dict)  # metric name of HOST_HISTOGRAMS -> Histogram

    def minus(self, other: "Scrape") -> "Scrape":
        return Scrape(
            {arm: s.minus(other.arms.get(arm, ArmSeries())) for arm, s in self.arms.items()},
            {name: h.minus(other.host.get(name, Histogram())) for name, h in self.host.items()},
        )


def parse_exposition(text: str, source: str = "<text>") -> dict:
    """arm -> :class:`ArmSeries` for every fdsched series that carries an ``arm`` label."""
    return parse_scrape(text, source).arms


def parse_scrape(text: str, source: str = "<text>", require_arms: bool = True) -> Scrape:
    """The plugin's per-arm series and the host's histograms of :data:`HOST_HISTOGRAMS` in one exposition
    (raises ABReportError when it has no per-arm series and ``require_arms``)."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError as exc:  # pragma: no cover - the report extra installs it
        raise ABReportError("the A/B report needs prometheus_client: pip install prometheus-client (or, in a checkout of this project: pip install '.[report]')") from exc
    arms: dict = {}
    host: dict = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:
        line, content = _bad_line(text, text_string_to_metric_families)
        where = f", line {line}: {content[:80]!r}" if line else ""
        raise ABReportError(f"{source}: not a Prometheus text exposition{where} ({exc}); allowed: the text a "
                            "/metrics endpoint serves (curl -s http://HOST:PORT/metrics > scrape.txt)") from None
    for family in families:
        if family.name in HOST_HISTOGRAMS and family.type == "histogram":
            hist = host.setdefault(family.name, Histogram())
            for sample in family.samples:
                _add_sample(hist, sample)
            continue
        if not family.name.startswith(PREFIX):
            continue
        for sample in family.samples:
            arm = sample.labels.get("arm")
            if arm is None:
                continue
            series = arms.setdefault(arm, ArmSeries())
            if "dp_rank" in sample.labels:
                series.dp_ranks.add(sample.labels["dp_rank"])
            others = frozenset((k, v) for k, v in sample.labels.items() if k not in ("arm", "dp_rank", "le"))
            if family.type == "histogram":
                _add_sample(series.histograms.setdefault(family.name, Histogram()), sample)
            elif family.type in ("counter", "unknown", "untyped"):
                if sample.name.endswith("_created"):
                    continue
                key = (family.name if family.type == "counter" else sample.name, others)
                series.counters[key] = series.counters.get(key, 0.0) + sample.value
    if not arms and require_arms:
        raise ABReportError(
            f"{source}: no fdsched series with an arm label; is FDSCHED_PROFILE_BY_DP_RANK set on the deployment, "
            "and FD_PLUGINS=fdsched?"
        )
    return Scrape(arms, host)


def _add_sample(hist: Histogram, sample) -> None:
    if sample.name.endswith("_bucket"):
        le = float(sample.labels["le"])
        hist.buckets[le] = hist.buckets.get(le, 0.0) + sample.value
    elif sample.name.endswith("_count"):
        hist.count += sample.value
    elif sample.name.endswith("_sum"):
        hist.total += sample.value


def attribute_host(scrapes: list) -> tuple:
    """(arm -> ArmSeries, pooled host histograms) for a list of :class:`Scrape`, one per server: the per-arm
    series added up, and each scrape's host histograms added to its arm's series when the scrape holds exactly
    one arm; the host histograms of a scrape that holds several arms (or none) go to the pooled dict."""
    arms = merge_scrapes([s.arms for s in scrapes])
    arms = {arm: ArmSeries(dict(s.counters), dict(s.histograms), set(s.dp_ranks)) for arm, s in arms.items()}
    pooled: dict = {}
    for scrape in scrapes:
        target = arms[next(iter(scrape.arms))].histograms if len(scrape.arms) == 1 else pooled
        for name, hist in scrape.host.items():
            target[name] = target[name].plus(hist) if name in target else hist
    return arms, pooled


# figure name, better direction ("lower"/"higher"/None), function(ArmSeries) -> (value, count behind it)
def _per(numerator: float, requests: float, scale: float = 1.0):
    return (numerator / requests * scale if requests > 0 else None), requests


def merge_scrapes(scrapes: list) -> dict:
    """arm -> :class:`ArmSeries` summed over several parsed scrapes (one per server of the deployment)."""
    merged: dict = {}
    for arms in scrapes:
        for arm, series in arms.items():
            merged[arm] = merged[arm].plus(series) if arm in merged else series
    return merged


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
    """The verdict lines (one definition: :func:`fdsched.replay.report.verdict_lines`) on what a scrape has:
    TTFT p50, prefill victims and requests finished; /metrics has no throughput, E2E or stall (the lines say n/a)."""
    from fdsched.replay.report import verdict_lines

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

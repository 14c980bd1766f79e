"""The plugin's per-arm series in a Prometheus text exposition (a scrape of ``/metrics``), parsed once for every
command that reads one: ``fdsched ab report`` (:mod:`fdsched.tools.abreport`, the figures and the table) and
``fdsched serve``'s served report (:mod:`fdsched.serve.served_report`, the window's counters).

The plugin's series (``fastdeploy:fdsched_*``) carry the arm as the label ``arm``; FastDeploy's own histograms of
:data:`HOST_HISTOGRAMS` carry none, and are kept per scrape (:func:`attribute_host` says whose they are). The
exposition is parsed with ``prometheus_client``'s own parser (a FastDeploy dependency; the ``report`` extra installs
it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

__all__ = [
    "PREFIX", "HOST_E2E", "HOST_GAP", "HOST_HISTOGRAMS", "ABReportError", "Histogram", "ArmSeries", "Scrape",
    "parse_exposition", "parse_scrape", "merge_scrapes", "attribute_host",
]

PREFIX = "fastdeploy:fdsched_"
# FastDeploy's own histograms the A/B report reads (no arm label: attributed per scrape, see examples/ab_run.md)
HOST_E2E = "fastdeploy:e2e_request_latency_seconds"
HOST_GAP = "fastdeploy:time_per_output_token_seconds"
HOST_HISTOGRAMS = (HOST_E2E, HOST_GAP)

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


def merge_scrapes(scrapes: list) -> dict:
    """arm -> :class:`ArmSeries` summed over several parsed scrapes (one per server of the deployment)."""
    merged: dict = {}
    for arms in scrapes:
        for arm, series in arms.items():
            merged[arm] = merged[arm].plus(series) if arm in merged else series
    return merged

"""The plugin's metrics, FastDeploy style (``fastdeploy:`` prefix, Prometheus types).

Values are always kept in plain counters on :data:`METRICS` (tests, the replay and ``doctor`` read
them). When ``prometheus_client`` is importable (FastDeploy depends on it) every update is mirrored
to a Prometheus metric on the default registry; in FastDeploy's multi-process mode
(``PROMETHEUS_MULTIPROC_DIR``) the host's own ``/metrics`` endpoint collects them with its
``MultiProcessCollector``. The Prometheus objects are created once per process, however often the
plugin is installed.

**Labels: every series carries ``arm`` and ``dp_rank``.** ``arm`` is the profile the recording scheduler
runs (its rank's arm under ``FDSCHED_PROFILE_BY_DP_RANK``, else ``FDSCHED_PROFILE``; ``default`` without a
profile), ``dp_rank`` its data-parallel rank. The host's ``/metrics`` sums the samples of forked ranks that
share a label set, so without these labels the arms of an online A/B would be added together. One helper,
:func:`labels_of`, gives an instance's label values; every update takes the recording instance as ``of=``
(a new metric: add its row to ``_DECLARED`` with its own labels beyond ``LABELS``, update it through
``PluginMetrics._series(family, name, labels_of(of), ...)``, which keeps each labelled child, and add its row to
docs/metrics.md). Updates without ``of`` are labelled ``arm="default", dp_rank=""``.

Every metric, its type and what it counts: docs/metrics.md (tests/unit/test_docs.py checks that the page names
every metric declared here).
"""

from __future__ import annotations

import threading
from collections import Counter as _Tally
from collections import deque

__all__ = ["METRICS", "PluginMetrics", "LABELS", "labels_of", "request_latencies"]

LABELS = ("arm", "dp_rank")
_NO_LABELS = {"arm": "default", "dp_rank": ""}
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


def labels_of(obj) -> dict:
    """The ``arm`` and ``dp_rank`` label values of the plugin object ``obj`` (a scheduler, cache manager or
    cache queue); ``arm="default", dp_rank=""`` for None or an object that has no arm."""
    if obj is None:
        return dict(_NO_LABELS)
    arm = getattr(obj, "_fdsched_arm", None)
    if arm is None:
        default = getattr(obj, "_fdsched_default_arm", None)
        arm = default.label if default is not None else "default"
    rank = getattr(obj, "_fdsched_dp_rank", None)
    return {"arm": str(arm), "dp_rank": "" if rank is None else str(rank)}


def request_latencies(arrival, first_token, latest_token, output_tokens):
    """(TTFT, TPOT) in seconds from a request's timestamps; None where a stamp is missing or the value is
    negative. TPOT needs two output tokens."""
    ttft = tpot = None
    if isinstance(arrival, (int, float)) and isinstance(first_token, (int, float)) and first_token >= arrival:
        ttft = float(first_token - arrival)
    if (
        output_tokens > 1
        and isinstance(first_token, (int, float))
        and isinstance(latest_token, (int, float))
        and latest_token >= first_token
    ):
        tpot = float(latest_token - first_token) / (output_tokens - 1)
    return ttft, tpot

# One row per Prometheus metric: (key, type, name, help, labels beyond LABELS, options); docs/metrics.md has a row
# for each. The objects are made from it once per process (:func:`_prometheus`).
_DECLARED = (
    ("preemptions", "Counter", "fastdeploy:fdsched_preemptions_total", "Preemptions by the victim's phase",
     ("victim_phase",), {}),
    ("recomputed", "Counter", "fastdeploy:fdsched_recomputed_tokens_total",
     "Computed tokens thrown away by preemptions", (), {}),
    ("ratio", "Gauge", "fastdeploy:fdsched_new_token_ratio", "Current new_token_ratio", (),
     {"multiprocess_mode": "max"}),
    ("reserved", "Gauge", "fastdeploy:fdsched_reserved_blocks",
     "Blocks reserved for running requests at the last admission decision", (), {"multiprocess_mode": "max"}),
    ("blocked", "Counter", "fastdeploy:fdsched_admissions_blocked_total",
     "Prefills refused by the reservation threshold", (), {}),
    ("evicted", "Counter", "fastdeploy:fdsched_evicted_blocks_total", "GPU blocks freed by LRU eviction", (), {}),
    ("batches", "Counter", "fastdeploy:fdsched_recycle_batches_total", "Batched recycle calls", (), {}),
    ("batch_size", "Histogram", "fastdeploy:fdsched_recycle_batch_size", "Blocks per batched recycle call", (),
     {"buckets": (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)}),
    ("evict_seconds", "Counter", "fastdeploy:fdsched_eviction_seconds_total", "Time spent in the eviction loops",
     (), {}),
    ("gc_hold", "Histogram", "fastdeploy:fdsched_gc_hold_seconds",
     "How long a large eviction held the garbage collector off (process-wide)", (),
     {"buckets": (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)}),
    ("unconsumed", "Counter", "fastdeploy:fdsched_unconsumed_signals_total",
     "One-shot signals to the host's control flow that no check consumed by the end of the pass", ("signal",), {}),
    ("guard", "Counter", "fastdeploy:fdsched_guard_events_total",
     "Scheduler guard events: seats_resumed (the way out of every seat held by a preempted request taken), "
     "admission_stalled (requests wait, blocks are free, nothing runs or is admitted), block_owner_conflict "
     "(an audit found one KV block with two owners, or free twice)", ("event",), {}),
    ("finished", "Counter", "fastdeploy:fdsched_requests_finished_total", "Requests the scheduler finished", (), {}),
    ("output_tokens", "Counter", "fastdeploy:fdsched_output_tokens_total", "Output tokens of finished requests",
     (), {}),
    ("ttft", "Histogram", "fastdeploy:fdsched_ttft_seconds",
     "Time to first token of finished requests (engine_recv_first_token_time - arrival_time)", (),
     {"buckets": TTFT_BUCKETS}),
    ("tpot", "Histogram", "fastdeploy:fdsched_tpot_seconds",
     "Time per output token after the first, of finished requests", (), {"buckets": TPOT_BUCKETS}),
)

_PROM_LOCK = threading.Lock()
_PROM = None


def _prometheus():
    """Create the Prometheus objects of :data:`_DECLARED` once per process; None where prometheus_client is
    missing."""
    global _PROM
    with _PROM_LOCK:
        if _PROM is not None:
            return _PROM or None
        try:
            import prometheus_client
        except ImportError:
            _PROM = False
            return None
        _PROM = {key: getattr(prometheus_client, kind)(name, text, LABELS + labels, **options)
                 for key, kind, name, text, labels, options in _DECLARED}
        return _PROM


_ADAPTIVE_PROM = None


def _adaptive_prometheus():
    """The adaptive estimator's gauges (created once per process, beside :func:`_prometheus`'s)."""
    global _ADAPTIVE_PROM
    if _prometheus() is None:
        return None
    with _PROM_LOCK:
        if _ADAPTIVE_PROM is None:
            from prometheus_client import Gauge

            def gauge(name, text, labels=()):
                return Gauge(
                    f"fastdeploy:fdsched_adaptive_{name}", text, list(labels) + list(LABELS), multiprocess_mode="max"
                )

            _ADAPTIVE_PROM = {
                "samples": gauge("samples", "Finished requests the adaptive estimator learns from", ["kind"]),
                "learned": gauge("learned", "1 once a kind has enough samples, 0 in warm-up", ["kind"]),
                "mean": gauge("mean_output", "Learned mean output (tokens; relative: fraction of max_tokens)", ["kind"]),
                "expected": gauge("expected_tokens", "Expected remaining output of the running set, last decision"),
                "margin": gauge("margin_tokens", "The running set's margin at the last decision"),
                "k": gauge("margin_k", "The margin factor k"),
                "fallbacks": gauge("fallback_requests", "Running requests answered by the warm-up fallback"),
            }
        return _ADAPTIVE_PROM


class PluginMetrics:
    """Plain counters (totals over every arm, as before arms existed) plus ``by_arm``: ``(arm, dp_rank)`` ->
    a tally of the per-arm figures (``preemptions_decode``, ``preemptions_prefill``, ``recomputed_tokens``,
    ``admissions_blocked``, ``requests_finished``, ``output_tokens``), and ``latencies``: ``(arm, dp_rank)`` ->
    the most recent (ttft, tpot) pairs."""

    def __init__(self) -> None:
        self._kept_series: dict = {}  # (metric, label values...) -> its Prometheus child (see _series)
        self.reset()

    def reset(self) -> None:
        """Zero the plain counters (tests and the replay; Prometheus counters only ever grow)."""
        self.preemptions = _Tally()
        self.new_token_ratio = None
        self.reserved_blocks = 0
        self.admissions_blocked = 0
        self.evicted_blocks = 0
        self.recycle_batches = 0
        self.recycle_batch_sizes = deque(maxlen=4096)  # the most recent batches only
        self.eviction_seconds = 0.0
        self.gc_holds = 0  # evictions that held the collector off, and the longest hold (s)
        self.gc_hold_seconds_max = 0.0
        self.unconsumed_signals = _Tally()
        self.guard_events = _Tally()
        self.recomputed_tokens = 0
        self.requests_finished = 0
        self.output_tokens = 0
        self.by_arm = {}
        self.latencies = {}
        self.adaptive = {}  # the adaptive estimator's last state and decision (plain values)

    def _series(self, family: dict, name: str, labels: dict, **extra):
        """The Prometheus child of metric ``name`` of ``family`` for ``labels`` and ``extra`` labels, kept once
        made: ``.labels()`` checks the names and takes a lock at every call, which costs more than the update
        itself, and some of these are updated at every ``schedule()`` pass. The metrics are made once per process
        (:func:`_prometheus`), so a child kept stays the one the registry holds."""
        key = (name, labels["arm"], labels["dp_rank"], *extra.values())
        child = self._kept_series.get(key)
        if child is None:
            child = self._kept_series[key] = family[name].labels(**extra, **labels)
        return child

    def _arm(self, labels: dict) -> _Tally:
        key = (labels["arm"], labels["dp_rank"])
        tally = self.by_arm.get(key)
        if tally is None:
            tally = self.by_arm[key] = _Tally()
        return tally

    def arm(self, arm: str, dp_rank="") -> _Tally:
        """The per-arm tally of ``arm`` on ``dp_rank`` (empty when nothing was recorded)."""
        return self.by_arm.get((arm, str(dp_rank)), _Tally())

    def preempted(self, victim_phase: str, of=None, recomputed_tokens: int = 0) -> None:
        labels = labels_of(of)
        self.preemptions[victim_phase] += 1
        self.recomputed_tokens += recomputed_tokens
        tally = self._arm(labels)
        tally[f"preemptions_{victim_phase}"] += 1
        tally["recomputed_tokens"] += recomputed_tokens
        prom = _prometheus()
        if prom:
            self._series(prom, "preemptions", labels, victim_phase=victim_phase).inc()
            if recomputed_tokens:
                self._series(prom, "recomputed", labels).inc(recomputed_tokens)

    def ratio(self, value: float, of=None) -> None:
        self.new_token_ratio = value
        prom = _prometheus()
        if prom:
            self._series(prom, "ratio", labels_of(of)).set(value)

    def reserved(self, blocks: int, of=None) -> None:
        self.reserved_blocks = blocks
        prom = _prometheus()
        if prom:
            self._series(prom, "reserved", labels_of(of)).set(blocks)

    def admission_blocked(self, of=None) -> None:
        labels = labels_of(of)
        self.admissions_blocked += 1
        self._arm(labels)["admissions_blocked"] += 1
        prom = _prometheus()
        if prom:
            self._series(prom, "blocked", labels).inc()

    def admission_counting(self, of=None) -> None:
        """``of`` counts refused admissions (the plugin's reservation code runs there): its series exists at 0."""
        self._arm(labels_of(of))["admissions_blocked"] += 0
        prom = _prometheus()
        if prom:
            self._series(prom, "blocked", labels_of(of)).inc(0)

    def guard_event(self, event: str, of=None) -> None:
        """The scheduler guard saw a stall (``admission_stalled``), took a way out of one (``seats_resumed``), or found a
        block with two owners (``block_owner_conflict``)."""
        self.guard_events[event] += 1
        prom = _prometheus()
        if prom:
            self._series(prom, "guard", labels_of(of), event=event).inc()

    def signal_unconsumed(self, signal: str, of=None) -> None:
        self.unconsumed_signals[signal] += 1
        prom = _prometheus()
        if prom:
            self._series(prom, "unconsumed", labels_of(of), signal=signal).inc()

    def adaptive_samples(self, state: dict, of=None) -> None:
        """The adaptive estimator's samples and learned means (``AdaptiveReserve.state()``)."""
        kinds = {"absolute": state["absolute_tokens"], "relative": state["relative_to_max_tokens"]}
        self.adaptive.update(
            {f"{kind}_{key}": part[key] for kind, part in kinds.items() for key in ("samples", "learned", "mean")}
        )
        self.adaptive["margin_k"] = state["k"]
        prom = _adaptive_prometheus()
        if prom:
            labels = labels_of(of)
            for kind, part in kinds.items():
                self._series(prom, "samples", labels, kind=kind).set(part["samples"])
                self._series(prom, "learned", labels, kind=kind).set(1 if part["learned"] else 0)
                if part["mean"] is not None:
                    self._series(prom, "mean", labels, kind=kind).set(part["mean"])
            self._series(prom, "k", labels).set(state["k"])

    def adaptive_decision(
        self, expected_tokens: float, margin_tokens: float, k: float, fallbacks: int, of=None
    ) -> None:
        """One admission decision of the adaptive estimator."""
        self.adaptive.update(
            expected_tokens=expected_tokens, margin_tokens=margin_tokens, margin_k=k, fallback_requests=fallbacks
        )
        prom = _adaptive_prometheus()
        if prom:
            labels = labels_of(of)
            self._series(prom, "expected", labels).set(expected_tokens)
            self._series(prom, "margin", labels).set(margin_tokens)
            self._series(prom, "k", labels).set(k)
            self._series(prom, "fallbacks", labels).set(fallbacks)

    def recycled(self, num_blocks: int, seconds: float, of=None) -> None:
        self.evicted_blocks += num_blocks
        self.recycle_batches += 1
        self.recycle_batch_sizes.append(num_blocks)
        self.eviction_seconds += seconds
        prom = _prometheus()
        if prom:
            labels = labels_of(of)
            self._series(prom, "evicted", labels).inc(num_blocks)
            self._series(prom, "batches", labels).inc()
            self._series(prom, "batch_size", labels).observe(num_blocks)
            self._series(prom, "evict_seconds", labels).inc(seconds)

    def gc_held(self, seconds: float, of=None) -> None:
        """A large eviction held the collector off for ``seconds`` (see deferred_recycle.collections_held)."""
        self.gc_holds += 1
        self.gc_hold_seconds_max = max(self.gc_hold_seconds_max, seconds)
        prom = _prometheus()
        if prom:
            self._series(prom, "gc_hold", labels_of(of)).observe(seconds)

    def request_finished(self, request, of=None) -> None:
        """A request the scheduler ``of`` finished: its outcome from the request's own timestamps."""
        labels = labels_of(of)
        outputs = len(getattr(request, "output_token_ids", None) or ())
        stamps = getattr(request, "metrics", None)
        ttft, tpot = request_latencies(
            getattr(stamps, "arrival_time", None),
            getattr(stamps, "engine_recv_first_token_time", None),
            getattr(stamps, "engine_recv_latest_token_time", None),
            outputs,
        )
        self.requests_finished += 1
        self.output_tokens += outputs
        tally = self._arm(labels)
        tally["requests_finished"] += 1
        tally["output_tokens"] += outputs
        key = (labels["arm"], labels["dp_rank"])
        recent = self.latencies.get(key)
        if recent is None:
            recent = self.latencies[key] = deque(maxlen=4096)
        recent.append((ttft, tpot))
        prom = _prometheus()
        if prom:
            self._series(prom, "finished", labels).inc()
            if outputs:
                self._series(prom, "output_tokens", labels).inc(outputs)
            if ttft is not None:
                self._series(prom, "ttft", labels).observe(ttft)
            if tpot is not None:
                self._series(prom, "tpot", labels).observe(tpot)


METRICS = PluginMetrics()

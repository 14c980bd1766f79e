"""The plugin's metrics, FastDeploy style (``fastdeploy:`` prefix, Prometheus types).

Values are always kept in plain counters on :data:`METRICS` (tests, the replay and ``doctor`` read
them). When ``prometheus_client`` is importable (FastDeploy depends on it) every update is mirrored
to a Prometheus metric on the default registry; in FastDeploy's multi-process mode
(``PROMETHEUS_MULTIPROC_DIR``) the host's own ``/metrics`` endpoint collects them with its
``MultiProcessCollector``. The Prometheus objects are created once per process, however often the
plugin is installed.

===========================================================  =========  =====================================
name                                                         type       meaning
===========================================================  =========  =====================================
fastdeploy:fdsched_preemptions_total{victim_phase}           counter    preemptions, by the victim's phase
                                                                        (decode / prefill)
fastdeploy:fdsched_new_token_ratio                           gauge      current new_token_ratio
fastdeploy:fdsched_reserved_blocks                           gauge      blocks reserved for running requests
                                                                        at the last admission decision
fastdeploy:fdsched_admissions_blocked_total                  counter    prefills (new or next chunk) refused
                                                                        by the reservation threshold
fastdeploy:fdsched_evicted_blocks_total                      counter    GPU blocks freed by LRU eviction
fastdeploy:fdsched_recycle_batches_total                     counter    batched recycle calls
fastdeploy:fdsched_recycle_batch_size                        histogram  blocks per batched recycle call
fastdeploy:fdsched_eviction_seconds_total                    counter    time spent in the eviction loops
fastdeploy:fdsched_unconsumed_signals_total{signal}          counter    one-shot signals to the host's control
                                                                        flow that no check consumed by the end
                                                                        of the pass (should stay 0; see the log)
fastdeploy:fdsched_adaptive_samples{kind}                    gauge      adaptive estimator: finished requests
                                                                        it learns from (kind: absolute =
                                                                        unbounded clients, relative = clients
                                                                        that set max_tokens)
fastdeploy:fdsched_adaptive_learned{kind}                    gauge      1 once a kind has enough samples, 0
                                                                        while it is in warm-up (fallback)
fastdeploy:fdsched_adaptive_mean_output{kind}                gauge      learned mean output (tokens; relative:
                                                                        fraction of max_tokens)
fastdeploy:fdsched_adaptive_expected_tokens                  gauge      expected remaining output of the
                                                                        running set at the last decision
fastdeploy:fdsched_adaptive_margin_tokens                    gauge      the set's margin at that decision
                                                                        (k x sqrt of the summed variances)
fastdeploy:fdsched_adaptive_margin_k                         gauge      the margin factor k (raised by
                                                                        preemptions)
fastdeploy:fdsched_adaptive_fallback_requests                gauge      running requests answered by the
                                                                        warm-up fallback at that decision
===========================================================  =========  =====================================
"""

from __future__ import annotations

import threading
from collections import Counter as _Tally
from collections import deque

__all__ = ["METRICS", "PluginMetrics"]

_PROM_LOCK = threading.Lock()
_PROM = None


def _prometheus():
    """Create the Prometheus objects once per process; None where prometheus_client is missing."""
    global _PROM
    with _PROM_LOCK:
        if _PROM is not None:
            return _PROM or None
        try:
            from prometheus_client import Counter, Gauge, Histogram
        except ImportError:
            _PROM = False
            return None
        _PROM = {
            "preemptions": Counter(
                "fastdeploy:fdsched_preemptions_total", "Preemptions by the victim's phase", ["victim_phase"]
            ),
            "ratio": Gauge("fastdeploy:fdsched_new_token_ratio", "Current new_token_ratio", multiprocess_mode="max"),
            "reserved": Gauge(
                "fastdeploy:fdsched_reserved_blocks",
                "Blocks reserved for running requests at the last admission decision",
                multiprocess_mode="max",
            ),
            "blocked": Counter(
                "fastdeploy:fdsched_admissions_blocked_total", "Prefills refused by the reservation threshold"
            ),
            "evicted": Counter("fastdeploy:fdsched_evicted_blocks_total", "GPU blocks freed by LRU eviction"),
            "batches": Counter("fastdeploy:fdsched_recycle_batches_total", "Batched recycle calls"),
            "batch_size": Histogram(
                "fastdeploy:fdsched_recycle_batch_size",
                "Blocks per batched recycle call",
                buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536),
            ),
            "evict_seconds": Counter("fastdeploy:fdsched_eviction_seconds_total", "Time spent in the eviction loops"),
            "unconsumed": Counter(
                "fastdeploy:fdsched_unconsumed_signals_total",
                "One-shot signals to the host's control flow that no check consumed by the end of the pass",
                ["signal"],
            ),
        }
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
                return Gauge(f"fastdeploy:fdsched_adaptive_{name}", text, list(labels), multiprocess_mode="max")

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
    def __init__(self) -> None:
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
        self.unconsumed_signals = _Tally()
        self.adaptive = {}  # the adaptive estimator's last state and decision (plain values)

    def preempted(self, victim_phase: str) -> None:
        self.preemptions[victim_phase] += 1
        prom = _prometheus()
        if prom:
            prom["preemptions"].labels(victim_phase=victim_phase).inc()

    def ratio(self, value: float) -> None:
        self.new_token_ratio = value
        prom = _prometheus()
        if prom:
            prom["ratio"].set(value)

    def reserved(self, blocks: int) -> None:
        self.reserved_blocks = blocks
        prom = _prometheus()
        if prom:
            prom["reserved"].set(blocks)

    def admission_blocked(self) -> None:
        self.admissions_blocked += 1
        prom = _prometheus()
        if prom:
            prom["blocked"].inc()

    def signal_unconsumed(self, signal: str) -> None:
        self.unconsumed_signals[signal] += 1
        prom = _prometheus()
        if prom:
            prom["unconsumed"].labels(signal=signal).inc()

    def adaptive_samples(self, state: dict) -> None:
        """The adaptive estimator's samples and learned means (``AdaptiveReserve.state()``)."""
        kinds = {"absolute": state["absolute_tokens"], "relative": state["relative_to_max_tokens"]}
        self.adaptive.update(
            {f"{kind}_{key}": part[key] for kind, part in kinds.items() for key in ("samples", "learned", "mean")}
        )
        self.adaptive["margin_k"] = state["k"]
        prom = _adaptive_prometheus()
        if prom:
            for kind, part in kinds.items():
                prom["samples"].labels(kind=kind).set(part["samples"])
                prom["learned"].labels(kind=kind).set(1 if part["learned"] else 0)
                if part["mean"] is not None:
                    prom["mean"].labels(kind=kind).set(part["mean"])
            prom["k"].set(state["k"])

    def adaptive_decision(self, expected_tokens: float, margin_tokens: float, k: float, fallbacks: int) -> None:
        """One admission decision of the adaptive estimator."""
        self.adaptive.update(
            expected_tokens=expected_tokens, margin_tokens=margin_tokens, margin_k=k, fallback_requests=fallbacks
        )
        prom = _adaptive_prometheus()
        if prom:
            prom["expected"].set(expected_tokens)
            prom["margin"].set(margin_tokens)
            prom["k"].set(k)
            prom["fallbacks"].set(fallbacks)

    def recycled(self, num_blocks: int, seconds: float) -> None:
        self.evicted_blocks += num_blocks
        self.recycle_batches += 1
        self.recycle_batch_sizes.append(num_blocks)
        self.eviction_seconds += seconds
        prom = _prometheus()
        if prom:
            prom["evicted"].inc(num_blocks)
            prom["batches"].inc()
            prom["batch_size"].observe(num_blocks)
            prom["evict_seconds"].inc(seconds)


METRICS = PluginMetrics()

"""What one replay of one profile produced, and the figures computed from it.

Imports nothing from FastDeploy: the runner (:mod:`fdsched.replay.runner`) fills :class:`ProfileRun`
from the host objects; everything here works on those plain values, so the arithmetic is tested
without a host.

Figures (all from the logical run, byte-identical for the same inputs, except ``measured``):

==============================  =================================================================
preemptions                     preempted requests, split by the victim's phase when it was chosen
                                (``decode``: it had produced a token since its last prefill;
                                ``prefill``: its prefill had not finished)
recomputed prompt tokens        per request, prefill tokens scheduled beyond its first full prefill:
                                ``max(0, scheduled prefill tokens - (prompt_len - cache hit at its
                                first admission))``, summed: work redone after preemptions
decode tokens per step          mean over all steps of the tokens decoding requests produced
steps to drain                  steps until every request finished (not drained: the step count at
                                which the run stopped, flagged)
prefix-cache hit rate           tokens served from the prefix cache at each request's first admission
                                (the host's own record, ``request.metrics.gpu_cache_token_num``, set
                                in ``get_prefix_cached_blocks``) / prompt tokens
blocks in use                   ``num_gpu_blocks - len(free list)`` after each step: peak and mean
                                (this includes blocks only the prefix cache holds)
evicted blocks                  radix-tree nodes whose GPU block went back to the free list
admissions blocked              ``fdsched.core.metrics.METRICS.admissions_blocked`` (prefills refused by the
                                reservation threshold); ``None`` where the host's own code decides
modelled time                   see :mod:`fdsched.replay.costmodel`; throughput = output tokens /
                                modelled seconds; TTFT = end of the step of the first token - arrival
                                (the arrival step's start, or a time-based request's own time);
                                TPOT = (finish - first token) / (output tokens - 1), requests with >= 2
what users feel                 :func:`request_latency_figures`, from each request's token times:
                                E2E = last token - arrival (finished requests); stall = the longest
                                gap between two consecutive tokens of one request (a preemption's
                                wait and recompute shows here); recomputed tokens = prefill tokens
                                scheduled beyond each request's first full prefill (prompt and
                                already generated tokens prefilled again after a preemption)
invariant violations            see :mod:`fdsched.replay.invariants`; must be 0
==============================  =================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from fdsched.core.common import mean, percentile
from fdsched.replay.costmodel import StepCost, step_times

__all__ = [
    "StepRow", "RequestRow", "ProfileRun", "percentile", "mean", "latency_samples", "compute_figures", "measured_figures",
    "RequestTimes", "request_latency_figures", "LATENCY_KEYS",
]


@dataclass
class StepRow:
    step: int
    prefill_tokens: int = 0
    decode_tokens: int = 0
    first_tokens: int = 0
    preempted: list = field(default_factory=list)  # (request id, "decode" | "prefill")
    finished: int = 0
    running: int = 0
    waiting: int = 0  # queued in the engine (waiting + preempted), plus arrived but not admitted on a P node
    blocks_used: int = 0  # not free
    blocks_held: int = 0  # held by requests
    evicted: int = 0
    violations: list = field(default_factory=list)
    schedule_cpu_s: float = 0.0  # measured
    schedule_wall_s: float = 0.0  # measured
    gap_ms: float = 0.0  # time-based traces: idle modelled time skipped before this step
    replay_cpu_s: float = 0.0  # measured: the replay's own CPU time in this step (all but schedule())
    decode_context_tokens: int = 0  # cost model facts (fdsched.replay.costmodel): tokens held by decoding requests
    prefill_context_tokens: int = 0  # and tokens attended to by the scheduled prefill tokens, summed


@dataclass
class RequestRow:
    id: str
    arrival: int
    prompt_len: int
    target_output: int  # tokens it produces on this node
    output_tokens: int = 0
    prefill_tokens: int = 0
    cache_hit_tokens: Optional[int] = None  # at its first admission (host record)
    first_chunk_start: Optional[int] = None  # prefill_start_index of its first scheduled chunk
    first_token_step: Optional[int] = None
    finish_step: Optional[int] = None
    finish_count: int = 0
    preemptions: int = 0
    arrival_ms: Optional[float] = None  # time-based traces: the modelled arrival time (else: start of its step)
    token_steps: list = field(default_factory=list)  # the step of each output token, in order (recompute included)


@dataclass
class ProfileRun:
    profile: str
    num_gpu_blocks: int
    cost: StepCost
    steps: list = field(default_factory=list)  # StepRow
    requests: list = field(default_factory=list)  # RequestRow, trace order
    drained: bool = False
    stop_reason: str = ""  # "" when drained; else why the run stopped
    stall: Optional[dict] = None  # the scheduler's state when the run stopped because it stalled
    admissions_blocked: Optional[int] = None
    request_violations: list = field(default_factory=list)
    decisions: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)  # every effective setting of the arm
    environment: dict = field(default_factory=dict)  # which variables were applied, which not
    estimator: Optional[dict] = None  # the adaptive estimator's final state (profile adaptive; fdsched.core.adaptive)
    check_every: int = 1  # block invariants checked every N steps (0: only at the end)
    wall_seconds: float = 0.0  # measured


# --------------------------------------------------------------------------------------------
# Small statistics
# --------------------------------------------------------------------------------------------
def _round(value, digits: int = 6):
    if value is None:
        return None
    if isinstance(value, float):
        return round(value, digits)
    return value


# --------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestTimes:
    """One request as a user sees it: when it arrived and when each of its output tokens came (ms, on
    one clock; a client-side report passes wall-clock times, the replay modelled times)."""

    arrival_ms: float
    token_ms: Sequence[float]  # the time of each output token, in order
    finished: bool = True  # False: the request was cut off (counted in TTFT only)
    recomputed_tokens: int = 0  # tokens prefilled again after a preemption (0 where unknown)


# The figures :func:`request_latency_figures` returns, in table order.
LATENCY_KEYS = (
    "ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p50", "e2e_ms_p90", "e2e_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
    "stall_ms_p99", "stall_ms_max", "recomputed_tokens",
)


def _per_request(samples) -> dict:
    ttft, e2e, tpot, stall, recomputed = [], [], [], [], 0
    for sample in samples:
        if isinstance(sample, dict):
            sample = RequestTimes(**sample)
        tokens = sample.token_ms
        recomputed += sample.recomputed_tokens
        if not tokens:
            continue
        ttft.append(tokens[0] - sample.arrival_ms)
        if not sample.finished:
            continue
        e2e.append(tokens[-1] - sample.arrival_ms)
        if len(tokens) >= 2:
            tpot.append((tokens[-1] - tokens[0]) / (len(tokens) - 1))
            stall.append(max(b - a for a, b in zip(tokens, tokens[1:])))
    return {"ttft_ms": ttft, "e2e_ms": e2e, "tpot_ms": tpot, "stall_ms": stall, "recomputed_tokens": recomputed}


def request_latency_figures(samples) -> dict:
    """What users feel, from per-request token times: ``samples`` is an iterable of :class:`RequestTimes`
    (or dicts with its fields). Returns the keys :data:`LATENCY_KEYS` (ms; None when no request qualifies):

    * ``ttft_ms_p50/p99``: first token - arrival, every request that got a token;
    * ``e2e_ms_p50/p90/p99``: last token - arrival, finished requests;
    * ``tpot_ms_p50/p99``: (last token - first token) / (tokens - 1), finished requests with >= 2 tokens;
    * ``stall_ms_p99/max``: per finished request with >= 2 tokens, the longest gap between two consecutive
      tokens (a preemption's wait for re-admission plus its recompute shows here); p99 and max over requests;
    * ``recomputed_tokens``: the sum of the samples' ``recomputed_tokens``.

    Percentiles: linear interpolation between closest ranks (:func:`fdsched.core.common.percentile`). Not rounded.
    """
    per = _per_request(samples)
    stall = per["stall_ms"]
    return {
        "ttft_ms_p50": percentile(per["ttft_ms"], 50),
        "ttft_ms_p99": percentile(per["ttft_ms"], 99),
        "e2e_ms_p50": percentile(per["e2e_ms"], 50),
        "e2e_ms_p90": percentile(per["e2e_ms"], 90),
        "e2e_ms_p99": percentile(per["e2e_ms"], 99),
        "tpot_ms_p50": percentile(per["tpot_ms"], 50),
        "tpot_ms_p99": percentile(per["tpot_ms"], 99),
        "stall_ms_p99": percentile(stall, 99),
        "stall_ms_max": float(max(stall)) if stall else None,
        "recomputed_tokens": per["recomputed_tokens"],
    }


def _token_steps(r: RequestRow) -> list:
    """The steps of a request's tokens; a row filled by hand without them: its first token, then the rest
    evenly up to its finish (enough for TTFT, TPOT and E2E)."""
    if r.token_steps:
        return list(r.token_steps)
    if r.first_token_step is None:
        return []
    n = max(1, r.output_tokens)
    last = r.finish_step if r.finish_step is not None else r.first_token_step
    if n == 1:
        return [r.first_token_step]
    return [r.first_token_step + (last - r.first_token_step) * k / (n - 1) for k in range(n)]


def _recomputed(r: RequestRow) -> int:
    if r.cache_hit_tokens is None:
        return 0
    return max(0, r.prefill_tokens - (r.prompt_len - r.cache_hit_tokens))


def request_times(run: ProfileRun) -> tuple:
    """(list of :class:`RequestTimes` in trace order, total modelled ms) of a run."""
    steps, cost = run.steps, run.cost
    starts, ends = step_times(
        cost, [s.prefill_tokens for s in steps], [s.decode_tokens for s in steps], [s.gap_ms for s in steps],
        [s.decode_context_tokens for s in steps], [s.prefill_context_tokens for s in steps],
    )
    total_ms = ends[-1] if ends else 0.0

    def start_of(step: int) -> float:
        if step < len(starts):
            return starts[step]
        return total_ms + (step - len(starts)) * cost.fixed_ms  # never reached: idle steps

    def end_of(step) -> float:
        if isinstance(step, int):
            return ends[step]
        low = int(step)  # a hand-made row's interpolated step
        return ends[low] + (ends[min(low + 1, len(ends) - 1)] - ends[low]) * (step - low)

    samples = []
    for r in run.requests:
        arrived = start_of(r.arrival) if r.arrival_ms is None else r.arrival_ms
        tokens = [end_of(s) for s in _token_steps(r)]
        samples.append(RequestTimes(arrived, tokens, r.finish_step is not None, _recomputed(r)))
    return samples, total_ms


def latency_samples(run: ProfileRun) -> dict:
    """Per-request modelled latencies (ms), in trace order: TTFT, TPOT (requests with >= 2 tokens),
    E2E and stall (finished requests), the finish time of every finished request; plus the run's total
    modelled time."""
    samples, total_ms = request_times(run)
    per = _per_request(samples)
    finish = [s.token_ms[-1] for s in samples if s.finished and s.token_ms]
    return {"total_ms": total_ms, "ttft_ms": per["ttft_ms"], "tpot_ms": per["tpot_ms"], "finish_ms": finish,
            "e2e_ms": per["e2e_ms"], "stall_ms": per["stall_ms"]}


def compute_figures(run: ProfileRun) -> dict:
    """The logical figures of one run, as a JSON-ready dict (floats rounded to 6 digits)."""
    steps, requests = run.steps, run.requests
    samples, total_ms = request_times(run)
    felt = request_latency_figures(samples)

    preempt_decode = sum(1 for s in steps for _, phase in s.preempted if phase == "decode")
    preempt_prefill = sum(1 for s in steps for _, phase in s.preempted if phase != "decode")

    recomputed = 0
    hits = prompt_tokens = 0
    for r in requests:
        prompt_tokens += r.prompt_len
        hit = r.cache_hit_tokens or 0
        hits += hit
        if r.cache_hit_tokens is not None:
            recomputed += max(0, r.prefill_tokens - (r.prompt_len - hit))

    output_tokens = sum(r.output_tokens for r in requests)
    used = [s.blocks_used for s in steps]
    violations = sum(len(s.violations) for s in steps) + len(run.request_violations)
    figures = {
        "requests": len(requests),
        "requests_finished": sum(1 for r in requests if r.finish_count >= 1),
        "drained": run.drained,
        "stop_reason": run.stop_reason,
        "stall": dict(run.stall) if run.stall else None,
        "steps": len(steps),
        "steps_to_drain": len(steps) if run.drained else None,
        "preemptions": preempt_decode + preempt_prefill,
        "preemptions_decode_victims": preempt_decode,
        "preemptions_prefill_victims": preempt_prefill,
        "recomputed_prompt_tokens": recomputed,
        "prefill_tokens": sum(s.prefill_tokens for s in steps),
        "output_tokens": output_tokens,
        "decode_tokens_per_step_mean": _round(mean([s.decode_tokens for s in steps])),
        "prompt_tokens": prompt_tokens,
        "prefix_hit_tokens": hits,
        "prefix_hit_rate": _round(hits / prompt_tokens if prompt_tokens else None),
        "blocks_total": run.num_gpu_blocks,
        "blocks_in_use_peak": max(used) if used else 0,
        "blocks_in_use_mean": _round(mean(used)),
        "blocks_held_by_requests_peak": max((s.blocks_held for s in steps), default=0),
        "evicted_blocks": sum(s.evicted for s in steps),
        "admissions_blocked": run.admissions_blocked,
        "modelled_seconds": _round(total_ms / 1000.0),
        "throughput_tokens_per_s": _round(output_tokens / (total_ms / 1000.0) if total_ms > 0 else None),
    }
    for key in LATENCY_KEYS:
        figures[key] = _round(felt[key])
    figures["invariant_violations"] = violations
    return figures


def measured_figures(run: ProfileRun) -> dict:
    """Wall-clock measurements: differ from run to run, kept apart from the logical figures."""
    cpu_ms = [s.schedule_cpu_s * 1000.0 for s in run.steps]
    wall_ms = [s.schedule_wall_s * 1000.0 for s in run.steps]
    replay_ms = [s.replay_cpu_s * 1000.0 for s in run.steps]
    return {
        "replay_cpu_ms_mean": _round(mean(replay_ms)),
        "replay_cpu_ms_p99": _round(percentile(replay_ms, 99)),
        "schedule_cpu_ms_mean": _round(mean(cpu_ms)),
        "schedule_cpu_ms_p99": _round(percentile(cpu_ms, 99)),
        "schedule_wall_ms_mean": _round(mean(wall_ms)),
        "schedule_wall_ms_p99": _round(percentile(wall_ms, 99)),
        "replay_wall_seconds": _round(run.wall_seconds, 3),
    }

"""The offline replay against the served engine: the same trace and cost model through both, and how far apart.

For each profile: ``fdsched replay`` (:func:`fdsched.replay.runner.run_replay`: the host's scheduler classes
stepped on a modelled clock) and the served engine (:class:`fdsched.serve.launcher.ServedEngine`: FastDeploy's
api_server, engine threads and the simulated worker, which sleeps the same cost model's step time in real time)
receive the same requests at the same times. The served side is timed by the client
(:mod:`fdsched.serve.load`); preemptions come from the plugin's counters on the engine's ``/metrics``.

What is sent differs from the trace in one way, on both sides alike: every request's ``max_tokens`` is its true
output length (``min(output_len, max_tokens)``). The served worker ends a request at ``max_tokens`` (it has no
other way to know where the trace's request ends); a request sent without ``max_tokens`` would run to the
engine's default, ``max_model_len - prompt_len`` (fastdeploy/input/base_processor.py ~438 at d38eeb8). The
replay runs on the same rewritten trace, so both sides reserve for the same client ``max_tokens``.

Imports the host only through the replay runner and the served engine.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Sequence

from fdsched.core.common import text_table
from fdsched.replay.report import format_value, ratio
from fdsched.replay.trace import Trace

__all__ = ["FIGURES", "exact_output_trace", "scaled_trace", "compare_profile", "compare", "format_comparison"]

# (replay figure key, label); the served report uses the same keys.
FIGURES = (
    ("throughput_tokens_per_s", "throughput (out tok/s)"),
    ("ttft_ms_p50", "TTFT p50 (ms)"),
    ("ttft_ms_p99", "TTFT p99 (ms)"),
    ("tpot_ms_p50", "TPOT p50 (ms)"),
    ("tpot_ms_p99", "TPOT p99 (ms)"),
    ("e2e_ms_p50", "E2E p50 (ms)"),
    ("e2e_ms_p99", "E2E p99 (ms)"),
    ("stall_ms_max", "stall max (ms)"),
    ("preemptions", "preemptions"),
    ("preemptions_prefill_victims", "  prefill-phase victims"),
    ("requests_finished", "requests finished"),
)


def exact_output_trace(trace: Trace) -> Trace:
    """The trace with every request's max_tokens set to the tokens it really generates."""
    return replace(trace, requests=tuple(replace(r, max_tokens=r.effective_output_len) for r in trace.requests))


def scaled_trace(trace: Trace, time_scale: float) -> Trace:
    """Arrival times (seconds) multiplied by ``time_scale``; a step-based trace is returned unchanged."""
    if time_scale == 1.0 or not trace.time_based:
        return trace
    return replace(trace, requests=tuple(replace(r, arrival_s=r.arrival_s * time_scale) for r in trace.requests))


def _served_engine():
    try:
        from fdsched.serve.config import EngineConfig, ServeError
        from fdsched.serve.launcher import ServedEngine
    except ImportError as exc:
        from fdsched.serve.load import LoadError

        raise LoadError(f"needs FastDeploy engine: the served engine (fdsched.serve.launcher) is not available ({exc})") from None
    return EngineConfig, ServedEngine, ServeError


def compare_profile(trace: Trace, profile: str, engine: dict, progress: bool = True, log: Optional[Callable] = None) -> dict:
    """{"replay": figures, "served": figures, "cost_model": ...} for one profile on an already rewritten trace (the
    served run directory is removed after a clean run, kept and named in the error after a failed one)."""
    from fdsched.replay.figures import compute_figures
    from fdsched.replay.runner import run_replay
    from fdsched.serve.load import Target, run_trace_load
    from fdsched.serve.served_report import build_served_report

    log = log or (lambda _msg: None)
    log(f"{profile}: replay")
    run = run_replay(trace, [profile], engine)[0]
    replay_figures = compute_figures(run)
    from fdsched.serve.load import LoadError

    EngineConfig, ServedEngine, ServeError = _served_engine()
    config = EngineConfig(
        profile=profile, num_gpu_blocks=engine["num_gpu_blocks"], block_size=engine["block_size"],
        max_num_seqs=engine["max_num_seqs"], max_model_len=engine["max_model_len"],
        max_num_batched_tokens=engine["max_num_batched_tokens"], enable_prefix_caching=engine["enable_prefix_caching"],
    )
    log(f"{profile}: served engine")
    served = ServedEngine(config)
    try:
        with served:
            target = Target(profile, served.urls[0], served.metrics_urls[0])
            load = run_trace_load(trace, [target], progress=progress)
    except ServeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise LoadError(f"profile {profile}: the served engine failed: {first}; logs kept in {served.run_dir}") from None
    except BaseException:
        served.cleanup()
        raise
    served.cleanup()  # a clean run leaves nothing behind
    report = build_served_report(trace, load, [target])
    return {"replay": replay_figures, "served": report["profiles"][0]["figures"],
            "cost_model": run.cost.to_json()}


def compare(trace: Trace, profiles: Sequence[str], time_scale: float = 1.0, progress: bool = True,
            log: Optional[Callable] = None) -> dict:
    """profile -> :func:`compare_profile`; the trace is rewritten once (exact outputs, scaled arrivals)."""
    sent = scaled_trace(exact_output_trace(trace), time_scale)
    engine = sent.engine_with()
    if engine.get("splitwise_role", "mixed") != "mixed":
        from fdsched.serve.load import LoadError

        raise LoadError(f"trace {trace.name}: splitwise_role={engine['splitwise_role']}; allowed: mixed (the served "
                        "engine is one mixed node)")
    return {"trace": trace.name, "time_scale": time_scale, "engine": engine,
            "profiles": {p: compare_profile(sent, p, engine, progress, log) for p in profiles}}


def format_comparison(result: dict) -> str:
    """One row per (figure), per profile three columns: replay, served, served/replay."""
    profiles = list(result["profiles"])
    headers = ["figure"]
    for p in profiles:
        headers += [f"{p} replay", f"{p} served", "served/replay"]
    rows = []
    for key, label in FIGURES:
        row = [label]
        for p in profiles:
            a = result["profiles"][p]["replay"].get(key)
            b = result["profiles"][p]["served"].get(key)
            r = ratio(b, a)
            row += [format_value(a), format_value(b), "-" if r is None else f"{r:.2f}"]
        rows.append(row)
    head = (f"trace {result['trace']} (max_tokens = each request's true output length; time scale "
            f"{result['time_scale']}): replay = modelled ms, served = wall-clock ms measured by the client")
    return head + "\n" + text_table(rows, headers, align_right_from=1)

"""`fdsched load` against the real served engine (FastDeploy's api_server on CPU, plugin loaded, simulated
worker): a slice of a shipped real trace over HTTP, with and without max_tokens. Skips, with a reason starting
"needs FastDeploy engine:", where the served engine cannot start (no host, missing serving modules)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from fdsched.replay.tracefile import load_trace, resolve_trace
from fdsched.serve.compare import exact_output_trace
from fdsched.serve.load import LoadError, Target, run_trace_load
from fdsched.serve.served_report import build_served_report, format_served_table

pytest.importorskip("aiohttp", reason="needs FastDeploy engine: aiohttp (pip install 'fastdeploy-sched-plugin[serve]')")

PROFILE = "recommended"
MAX_MODEL_LEN = 2048


def _launcher():
    try:
        from fdsched.serve.config import EngineConfig, ServeError, check_host_modules
        from fdsched.serve.launcher import ServedEngine
    except ImportError as exc:
        pytest.skip(f"needs FastDeploy engine: fdsched.serve.launcher is not available ({exc})")
    try:
        check_host_modules()
    except ServeError as exc:
        message = str(exc)
        pytest.skip(message if message.startswith("needs FastDeploy engine:") else f"needs FastDeploy engine: {message}")
    return EngineConfig, ServedEngine


@pytest.fixture(scope="module")
def engine():
    EngineConfig, ServedEngine = _launcher()
    config = EngineConfig(profile=PROFILE, num_gpu_blocks=160, block_size=16, max_num_seqs=16,
                          max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=1024)
    served = ServedEngine(config)
    with served:
        yield served
    served.cleanup()  # its run directory: nothing of the stack is left behind


def _slice(n, exact=True):
    trace = load_trace(resolve_trace("azure-conv"))
    first = [r for r in trace.in_feed_order() if r.prompt_len + r.effective_output_len < MAX_MODEL_LEN][:n]
    trace = replace(trace, requests=tuple(first))
    return exact_output_trace(trace) if exact else trace


def _worker_saw(engine):
    """(prompt tokens, max_tokens as the engine held it, length mark) of every request the worker was handed."""
    seen = re.findall(r"request \S+: prompt (\d+) tokens, max_tokens (\S+) \(as the engine holds it\), "
                      r"length mark (\S+),", engine.engine_log_text())
    return [(int(p), None if m == "None" else int(m), None if k == "None" else int(k)) for p, m, k in seen]


def test_clients_without_max_tokens_end_at_their_true_length(engine):
    trace = _slice(30, exact=False)
    trace = replace(trace, requests=tuple(r for r in trace.requests if r.effective_output_len < 200)[:8])
    assert len(trace.requests) == 8 and all(r.max_tokens is None for r in trace.requests)
    before = len(_worker_saw(engine))
    target = Target(PROFILE, engine.urls[0], engine.metrics_urls[0])
    load = run_trace_load(trace, [target], time_scale=0.1, progress=False)
    results = {r.id: r for r in load["results"]}
    assert load["unmarked_bounded"] == []
    for request in trace.requests:
        r = results[request.id]
        assert r.ok, (request.id, r.status, r.error)
        assert r.max_tokens is None and r.length_mark == request.output_len  # sent without max_tokens
        assert r.output_tokens == request.output_len == len(r.token_s)  # ended exactly at its true length
        assert r.finish_reason == "stop"  # by the EOS, not by reaching a max_tokens
    # what the engine handed the worker: its own default max_tokens (the rest of the context), the client's none
    seen = sorted(_worker_saw(engine)[before:])
    assert seen == sorted((r.prompt_len, MAX_MODEL_LEN - r.prompt_len, r.output_len) for r in trace.requests)


def test_a_real_trace_slice_through_the_served_engine(engine):
    trace = _slice(24)
    target = Target(PROFILE, engine.urls[0], engine.metrics_urls[0])
    load = run_trace_load(trace, [target], time_scale=0.25, progress=False)
    results = {r.id: r for r in load["results"]}
    for request in trace.requests:
        r = results[request.id]
        assert r.ok, (request.id, r.status, r.error)
        assert r.prompt_tokens == request.prompt_len  # the prompt is token-exact for the tiny model
        assert r.output_tokens == request.effective_output_len == len(r.token_s)
        assert r.token_s[0] >= r.sent_s
    report = build_served_report(trace, load, [target])
    figures = report["profiles"][0]["figures"]
    assert figures["requests_finished"] == len(trace.requests) and figures["errors"] == 0
    assert figures["prompt_tokens_mismatch"] == 0
    assert figures["server_requests_finished"] == len(trace.requests)  # the plugin counted each one on /metrics
    assert report["profiles"][0]["server"]["plugin_arms_on_metrics"] == [PROFILE]
    assert figures["e2e_ms_p99"] >= figures["ttft_ms_p99"] > 0
    assert "E2E p99 (ms)" in format_served_table(report)


def test_a_prompt_longer_than_the_engines_context_is_refused_before_sending(engine):
    trace = _slice(1)
    long = replace(trace.requests[0], id="too-long", prompt_len=MAX_MODEL_LEN + 10, prompt=None, prefix_group=None,
                   prefix_len=0)
    target = Target(PROFILE, engine.urls[0], engine.metrics_urls[0])
    with pytest.raises(LoadError, match=f"does not fit the server at .*max_model_len={MAX_MODEL_LEN}"):
        run_trace_load(replace(trace, requests=(long,)), [target], progress=False)

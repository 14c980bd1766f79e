"""`fdsched load` against the real served engine (FastDeploy's api_server on CPU, plugin loaded, simulated
worker): a slice of a shipped real trace over HTTP. Skips, with a reason starting "needs FastDeploy engine:",
where the served engine cannot start (no host, missing serving modules)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fdsched.replay.trace import load_trace, resolve_trace
from fdsched.serve.compare import exact_output_trace
from fdsched.serve.load import LoadError, Target, run_trace_load
from fdsched.serve.served_report import build_served_report, format_served_table

pytest.importorskip("aiohttp", reason="needs FastDeploy engine: aiohttp (pip install 'fastdeploy-sched-plugin[serve]')")

PROFILE = "recommended"
MAX_MODEL_LEN = 2048


def _launcher():
    try:
        from fdsched.serve.launcher import EngineConfig, ServedEngine, ServeError, check_host_modules
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


def _slice(n):
    trace = load_trace(resolve_trace("azure-conv"))
    first = [r for r in trace.in_feed_order() if r.prompt_len + r.effective_output_len < MAX_MODEL_LEN][:n]
    return exact_output_trace(replace(trace, requests=tuple(first)))


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

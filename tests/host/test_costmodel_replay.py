"""The context-aware cost model inside a real replay: the driver's step facts, and what the model
changes (modelled time) and does not (the scheduler's decisions on a step-based trace).

The host is imported only through the fixture; without it every test here is skipped with a reason
that starts with "needs FastDeploy host".
"""

from __future__ import annotations

import pytest

from fdsched.install.probe import HOW_TO_POINT, HostNotFound


@pytest.fixture(scope="module")
def pressure_runs():
    from fdsched.replay.engine import prepare_host_environment

    prepare_host_environment()
    from fdsched.install.probe import find_host

    try:
        find_host()
    except HostNotFound as exc:
        pytest.skip(f"needs FastDeploy host: {exc}" if HOW_TO_POINT in str(exc) else f"needs FastDeploy host: {HOW_TO_POINT}")
    from fdsched.install import installer
    from fdsched.replay.runner import run_profile
    from fdsched.replay.tracefile import load_trace, resolve_trace

    from fdsched.replay.driver import Driver

    trace = load_trace(resolve_trace("pressure"))  # arrivals in steps: the cost model cannot move them
    checks = []  # per step of the preset's run: (record, what the decoding requests held before the step)
    original = Driver.step

    def watched(self):
        before = {r.request_id: (r, r.num_total_tokens, len(r.output_token_ids)) for r in self.rm.running}
        record = original(self)
        decoded = [held for rid, (r, held, n) in before.items()
                   if len(r.output_token_ids) > n and rid not in record.first_tokens]
        checks.append((record, sum(decoded), len(decoded)))
        return record

    try:
        runs = {"linear": run_profile(trace, "baseline", trace.engine_with(), {"model": "linear"})}
        Driver.step = watched
        try:
            runs["llama2-7b-a100"] = run_profile(trace, "baseline", trace.engine_with(), {"model": "llama2-7b-a100"})
        finally:
            Driver.step = original
    finally:
        installer.uninstall()  # leave the process as the other host tests expect it
    return trace, runs, checks


def test_the_model_changes_time_not_decisions_on_a_step_based_trace(pressure_runs):
    from fdsched.replay.figures import compute_figures

    _, runs, _ = pressure_runs
    linear, a100 = runs["linear"], runs["llama2-7b-a100"]
    assert linear.cost.name == "linear" and a100.cost.name == "llama2-7b-a100"
    shape = [(s.prefill_tokens, s.decode_tokens, s.preempted, s.finished) for s in linear.steps]
    assert shape == [(s.prefill_tokens, s.decode_tokens, s.preempted, s.finished) for s in a100.steps]
    # the facts are the same too: they describe the step, not the model
    assert [(s.decode_context_tokens, s.prefill_context_tokens) for s in linear.steps] == [
        (s.decode_context_tokens, s.prefill_context_tokens) for s in a100.steps
    ]
    lf, af = compute_figures(linear), compute_figures(a100)
    assert lf["preemptions"] == af["preemptions"] > 0
    assert af["modelled_seconds"] > lf["modelled_seconds"]


def test_the_driver_records_each_steps_context_facts(pressure_runs):
    from fdsched.replay.costmodel import chunk_context_tokens, row_step_ms
    from fdsched.replay.figures import compute_figures

    trace, runs, checks = pressure_runs
    run = runs["llama2-7b-a100"]
    assert len(checks) == len(run.steps)
    decoding = 0
    for row, (record, held_before, decoders) in zip(run.steps, checks):
        # decode: the tokens each request that decoded held when the step began, summed
        assert decoders == record.decode_tokens == row.decode_tokens
        assert row.decode_context_tokens == record.decode_context_tokens == held_before
        # prefill: each chunk [start, end) attends n * start + n (n + 1) / 2 tokens
        assert row.prefill_context_tokens == sum(chunk_context_tokens(a, b) for _, a, b in record.prefill_chunks)
        decoding += bool(decoders)
    assert decoding and any(s.prefill_context_tokens > chunk_context_tokens(0, s.prefill_tokens) for s in run.steps), (
        "the pressure trace decodes and prefills chunks over a prefix"
    )
    total = sum(s.gap_ms + row_step_ms(run.cost, s) for s in run.steps)
    assert compute_figures(run)["modelled_seconds"] == pytest.approx(total / 1000.0, rel=1e-9)

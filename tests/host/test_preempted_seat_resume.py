"""Host fix ``preempted_seat_resume`` against the real ResourceManagerV1: the smallest reproduction.

One seat (``max_num_seqs`` 1), the smallest pool the host accepts (18 blocks of 4 tokens for ``max_model_len`` 64) and
one request of 1 prompt token that decodes 56: near the end of its output the host's decode allocates two blocks
ahead, finds none, and preempts the request itself. The request then waits, preempted, holding the only seat; the
host's admission loop counts it against ``max_num_seqs`` before it admits anything, so it never resumes, with every
block free. ``fdsched check`` found this case from scratch (seed 0) and shrank it to this.

A line whose admission loop does not count preempted requests (2.2, 2.4, 2.5: the fix is "not needed" there) resumes
the request itself: there the host alone drains it, and the fix is not applied.
"""

from __future__ import annotations

import pytest

ENGINE = {"block_size": 4, "max_model_len": 64, "num_gpu_blocks": 18, "max_num_seqs": 1, "max_num_batched_tokens": 16,
          "enable_prefix_caching": True, "splitwise_role": "mixed", "enc_dec_block_num": 2}
REQUEST = dict(id="c3", arrival=0, prompt_len=1, output_len=56, max_tokens=None)


def _run(arm, monkeypatch):
    from fdsched.replay.runner import run_profile
    from fdsched.replay.trace import Trace, TraceRequest

    from .conftest import skip_if_refused

    skip_if_refused(arm if arm not in ("host", "fix-off", "default") else None)
    trace = Trace((TraceRequest(line=1, **REQUEST),), dict(ENGINE), source="test", name="one-seat")
    with monkeypatch.context() as m:
        m.delenv("FDSCHED_PROFILE", raising=False)
        if arm == "fix-off":
            m.setenv("FDSCHED_PREEMPTED_SEAT_RESUME", "off")
        profile = arm if arm not in ("host", "fix-off", "default") else None
        return run_profile(trace, profile, dict(ENGINE), max_steps=3000, stall_steps=40, check_every=1,
                           host_only=arm == "host", inherit_env=arm == "fix-off")


@pytest.mark.parametrize("arm", ["host", "fix-off"])
def test_the_host_alone_never_resumes_a_request_holding_the_only_seat(monkeypatch, replay_host, arm):
    run = _run(arm, monkeypatch)
    if replay_host.has.get("preempted_seat_resume"):  # the line's loop leaves preempted requests out of its count
        assert run.drained and sum(len(s.preempted) for s in run.steps) >= 1, run.stop_reason
        return
    assert not run.drained and run.stall, run.stop_reason
    assert run.stall["running"] == 0 and run.stall["waiting_preempted"] == 1 and run.stall["free_blocks"] == 18
    assert sum(len(s.preempted) for s in run.steps) == 1


@pytest.mark.parametrize("arm", ["default", "baseline", "adaptive", "recommended"])
def test_with_the_fix_the_request_resumes_on_its_seat_and_finishes(monkeypatch, replay_host, arm):
    from fdsched.core.metrics import METRICS

    run = _run(arm, monkeypatch)
    if replay_host.has.get("preempted_seat_resume"):
        assert METRICS.guard_events["seats_resumed"] == 0  # not applied: the host's loop resumes it itself
    else:
        assert METRICS.guard_events["seats_resumed"] >= 1  # the way out was taken (and logged), not luck
    assert run.drained, run.stop_reason
    assert [v for s in run.steps for v in s.violations] == [] and run.request_violations == []
    (row,) = run.requests
    assert row.output_tokens == REQUEST["output_len"] and row.finish_count == 1
    assert row.preemptions >= 1  # it was preempted, resumed, and finished

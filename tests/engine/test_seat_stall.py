"""The seat lock in FastDeploy's real serving stack: one seat, the smallest pool, one request that preempts itself
near the end of its output (the engine's decode allocates blocks ahead). With the host fix off the engine keeps
answering /health and never returns another token for that request; with the fix (no profile, ``recommended``) it
resumes on its own seat and finishes. The replay's smallest case, under every shipped profile:
tests/host/test_preempted_seat_resume.py.
"""

from __future__ import annotations

import socket

import pytest

from fdsched.serve.model import prompt_of_length

from .helpers import assert_blocks_whole, complete, metric, settle

ONE_SEAT = dict(num_gpu_blocks=18, block_size=4, max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16)
PROMPT, OUTPUT = 4, 56  # 60 of 64 tokens: near the end the decode wants two blocks more than the pool has
STALL_S = 45.0  # no token for this long: the request is stuck (a healthy step here takes milliseconds)


def _one_request(eng):
    try:
        return complete(eng.urls[0], prompt_of_length(PROMPT, seed=7), OUTPUT, timeout=STALL_S)
    except (socket.timeout, TimeoutError) as exc:
        return {"error": f"no token for {STALL_S:.0f} s ({exc})", "finish_reason": None, "chunks": None}


def test_with_the_fix_off_the_engine_stops_returning_tokens(served):
    """The guard sees the stall (100 passes and 30 s with a request waiting, none running, blocks free) and says
    so; its block audits (every 10 s) find no KV block with two owners."""
    eng = served(profile="recommended", env={"FDSCHED_PREEMPTED_SEAT_RESUME": "off"}, **ONE_SEAT)
    result = _one_request(eng)
    assert result["finish_reason"] is None and "no token for" in (result["error"] or ""), result
    text = eng.metrics_text(0)
    guard = "fastdeploy:fdsched_guard_events_total"
    assert metric(text, guard, arm="recommended", dp_rank="0", event="admission_stalled") == 1
    assert metric(text, guard, event="block_owner_conflict") == 0 and metric(text, guard, event="seats_resumed") == 0


@pytest.mark.parametrize("profile", [None, "recommended"])
def test_with_the_fix_the_request_resumes_on_its_seat_and_finishes(served, profile):
    eng = served(profile=profile, **ONE_SEAT)
    result = _one_request(eng)
    assert result["error"] is None and result["finish_reason"] == "length", result
    arm = profile or "default"
    text = eng.metrics_text(0)
    assert metric(text, "fastdeploy:fdsched_guard_events_total", arm=arm, dp_rank="0", event="seats_resumed") >= 1
    assert metric(text, "fastdeploy:fdsched_guard_events_total", event="block_owner_conflict") == 0
    assert metric(text, "fastdeploy:fdsched_requests_finished_total", arm=arm, dp_rank="0") == 1
    assert_blocks_whole(settle(eng), eng.rank_log_dir(0))

"""Two defects of the host's own code, found by random short traces, pinned with the host alone and under the
plugin.

Both need the pre-change KV reservation (``FD_RESERVE_*_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL``), whose schedules
preempt more: the host alone shows them where it lacks upstream's ratio reservation (the old host) and not where it
has it (the new host, on these traces); the plugin's ``baseline``, which restores the pre-change reservation on
either host, shows them on both, and so does ``adaptive``, whose warm-up falls back to the pre-change amounts for
requests without ``max_tokens``; ``recommended`` shows neither. The plugin neither causes nor fixes them: they sit
in host code that none of the five changes touches (docs/changes.md, "Host defects the changes do not touch").

1. **Preempted requests hold every seat.** The host's admission loop counts the PREEMPTED requests in ``waiting``
   against ``max_num_seqs`` before it admits anything, those included. Once ``max_num_seqs`` requests are preempted
   and nothing runs, the loop stops at its first check in every pass: nothing is admitted again. The host fix
   ``preempted_seat_resume`` (``auto`` under every profile) resumes the first of them on its own seat; its smallest
   reproduction is ``tests/host/test_preempted_seat_resume.py``.
2. **A prefix block reused while free.** A fully cached prompt whose recomputed last block is recorded in two
   chunks gets a second radix-tree node for a block its path already holds; after a decode preemption and an
   eviction that block is both in the free list and in the radix tree (and, at the next step, in a request's block
   table as well). The host fix ``one_node_per_block`` (``auto`` under every profile) removes it: the trace shows it
   with the host alone where the host's reservation preempts (the old host) and under ``baseline`` with the fix
   ``off`` on both hosts, and under no shipped profile. Its smallest reproduction is
   ``tests/host/test_one_node_per_block.py``.

When a host or the plugin stops showing one, the test that pins it fails and says so: update docs/changes.md.
"""

from __future__ import annotations

import pytest

ENGINE = {"block_size": 4, "max_model_len": 64, "num_gpu_blocks": 18, "max_num_seqs": 3,
          "max_num_batched_tokens": 8, "enable_prefix_caching": True, "splitwise_role": "mixed",
          "enc_dec_block_num": 2}

# (arrival step, prompt tokens, output tokens, max_tokens, prefix group, prefix tokens), as hypothesis drew them
SEATS = [(0, 7, 10, 1, "a", 0), (2, 8, 16, None, "b", 8), (1, 19, 39, None, None, 0), (5, 11, 4, 1, "b", 0),
         (5, 24, 30, 10, None, 0), (4, 6, 31, 27, "a", 2), (3, 3, 19, 11, None, 0), (3, 5, 4, None, None, 0)]
REUSED = [(0, 1, 1, None, None, 0), (1, 8, 13, None, "a", 8), (0, 1, 1, None, None, 0), (0, 1, 1, None, None, 0),
          (0, 1, 1, None, None, 0), (1, 1, 1, None, None, 0), (0, 1, 17, None, None, 0), (0, 17, 1, None, "a", 8)]


def _trace(rows):
    from fdsched.replay.trace import Trace, TraceRequest

    requests = tuple(
        TraceRequest(id=f"h{i}", arrival=a, prompt_len=p, output_len=o, max_tokens=m, prefix_group=g, prefix_len=pl,
                     line=i + 1)
        for i, (a, p, o, m, g, pl) in enumerate(rows)
    )
    return Trace(requests, dict(ENGINE), source="test", name="host-defect")


@pytest.fixture
def replay(replay_host, monkeypatch):
    """run(rows, arm, fix=None) -> the replay's run; arm ``host`` replays the host's own classes (the plugin is not
    installed, so the replay drives exactly what FastDeploy ships); ``fix-off``: ``baseline`` with the host fix whose
    switch is ``fix`` off."""
    from fdsched.replay.runner import run_profile

    from .conftest import skip_if_refused

    def run(rows, arm, fix=None):
        skip_if_refused(None if arm in ("host", "fix-off") else arm)
        with monkeypatch.context() as m:
            inherit = arm == "fix-off"
            if inherit:
                m.setenv(fix, "off")
            return run_profile(_trace(rows), "baseline" if arm in ("host", "fix-off") else arm, dict(ENGINE),
                               max_steps=3000, stall_steps=40, inherit_env=inherit, host_only=arm == "host")

    return run


def _violations(run):
    return [v for s in run.steps for v in s.violations] + list(run.request_violations)


def _seats_stall(run) -> bool:
    stall = run.stall or {}
    return (not run.drained and stall.get("running") == 0
            and stall.get("waiting_preempted") == ENGINE["max_num_seqs"] and stall.get("free_blocks", 0) > 0)


def _pre_change(replay_host, arm) -> bool:
    """Does this run schedule with the pre-change reservation?"""
    return arm in ("baseline", "adaptive") or (arm == "host" and not replay_host.has.get("ratio_reserve", False))


@pytest.mark.parametrize("arm", ["host", "fix-off", "baseline", "adaptive", "recommended"])
def test_preempted_requests_holding_every_seat_stop_admission(replay, replay_host, arm):
    """The host alone stalls where its reservation preempts this much (the old host) and its loop counts preempted
    requests (every 2.6 commit); ``baseline`` with the fix off stalls on both hosts; every shipped profile drains
    (the host fix ``preempted_seat_resume`` is ``auto`` in each)."""
    run = replay(SEATS, arm, fix="FDSCHED_PREEMPTED_SEAT_RESUME")
    assert _violations(run) == []
    has_defect = not replay_host.has.get("preempted_seat_resume")  # the line's loop counts preempted requests
    if has_defect and (arm == "fix-off" or (arm == "host" and _pre_change(replay_host, arm))):
        assert _seats_stall(run), (
            f"{arm}: this trace no longer stalls with every seat held by a preempted request "
            f"({run.stop_reason or 'drained'}): update docs/changes.md")
        assert run.stall["free_blocks"] == 14 and run.stall["waiting"] == 7
    else:
        assert run.drained, run.stop_reason


@pytest.mark.parametrize("arm", ["host", "fix-off", "baseline", "adaptive", "recommended"])
def test_a_prefix_block_reused_while_free(replay, replay_host, arm):
    """Shown by the host's own recording where the schedule preempts (the host alone on the old host; ``baseline``
    with the fix ``off`` on both); no shipped profile shows it (the fix is ``auto`` in every one)."""
    run = replay(REUSED, arm, fix="FDSCHED_ONE_NODE_PER_BLOCK")
    assert run.drained, run.stop_reason
    found = _violations(run)
    has_defect = not replay_host.has.get("one_node_per_block")  # the line records a count below the cached one
    if has_defect and (arm == "fix-off" or (arm == "host" and _pre_change(replay_host, arm))):
        assert found, f"{arm}: this trace no longer reuses a free prefix block: update docs/changes.md"
        assert all("both free and in use" in v and "prefix cache" in v for v in found), found
    else:
        assert found == []


@pytest.mark.parametrize("arm", ["fix-off", "baseline", "adaptive", "recommended"])
@pytest.mark.parametrize("rows", ["SEATS", "REUSED"])
def test_the_guard_audits_every_pass_and_finds_only_the_defect(replay, replay_host, monkeypatch, rows, arm):
    """The engine guard's block audit, run after every pass of both traces: it reports the two owners where the
    replay's own checks find them (``baseline`` with ``one_node_per_block`` off, on the trace that reuses a block),
    and nothing anywhere else (no false alarm under any shipped profile, preemptions and evictions included)."""
    from fdsched.core.metrics import METRICS
    from fdsched.patches import _guard

    monkeypatch.setattr(_guard, "AUDIT_INTERVAL_S", 0.0)
    run = replay(SEATS if rows == "SEATS" else REUSED, arm, fix="FDSCHED_ONE_NODE_PER_BLOCK")
    events = METRICS.guard_events["block_owner_conflict"]
    if rows == "REUSED" and arm == "fix-off" and not replay_host.has.get("one_node_per_block"):
        assert _violations(run) and events >= 1, (events, _violations(run))
    else:
        assert _violations(run) == [] and events == 0, (events, _violations(run))


# ---- 3. a PD prefill node under upstream's ratio reservation ---------------------------------------------------
def _pd_prefill(arm, monkeypatch):
    """The shipped pd-prefill trace; ``host``: FastDeploy alone; ``fix-off``: no profile with the fix off; else a
    profile (None: no profile)."""
    from fdsched.replay.runner import run_profile
    from fdsched.replay.tracefile import load_trace, resolve_trace

    from .conftest import skip_if_refused

    skip_if_refused(None if arm in ("host", "fix-off") else arm)
    trace = load_trace(resolve_trace("pd-prefill"))
    with monkeypatch.context() as m:
        for var in ("FDSCHED_PROFILE", "FDSCHED_PREFILL_NODE_RESERVE"):
            m.delenv(var, raising=False)
        if arm == "fix-off":
            m.setenv("FDSCHED_PREFILL_NODE_RESERVE", "off")
        profile = None if arm in ("host", "fix-off", None) else arm
        return run_profile(trace, profile, trace.engine_with(), stall_steps=100, host_only=arm == "host",
                           inherit_env=arm == "fix-off")


@pytest.mark.parametrize("arm", ["host", "fix-off", None, "baseline", "adaptive", "recommended"])
def test_a_prefill_node_under_the_hosts_ratio_reservation(replay_host, monkeypatch, arm):
    """Where the host has upstream's ratio reservation and its code reserves decode tokens for a prefill node's
    running chunks (the probe reads both; FastDeploy's 2.6 head sets that threshold to 0 itself), the node stalls
    with the host alone and with the fix off; with no profile (the host's reservation, the fix ``auto``)
    and under every shipped profile it drains."""
    run = _pd_prefill(arm, monkeypatch)
    stalls_alone = replay_host.has.get("ratio_reserve", False) and not replay_host.has.get("prefill_node_reserve")
    if arm in ("host", "fix-off") and stalls_alone:
        assert not run.drained and run.stop_reason.startswith("stalled"), run.stop_reason
        assert run.stall["running"] > 0 and run.stall["running_with_all_blocks"] == run.stall["running"]
    else:
        assert run.drained, run.stop_reason
    assert _violations(run) == []

"""PR 7783's rewrite of the host's ``test_trigger_preempt_records_tasks``, in our words, on either host.

Before 7783 the host's test preempts the *last running* request, which it leaves in the prefill phase.
7783 made preemption decode-only and rewrote the test so that the victim is a *decoding* request (its
status ``RUNNING_DECODE``). The old host has a single ``RUNNING`` status; there a request is decoding
once it has generated a token (the plugin's one decode test, ``fdsched.core.policies.is_decoding``), so the
adapted test makes the victim decode by giving it output tokens. It must pass wherever decode-only
preemption is on — the plugin's version on the old host, the host's own (or the plugin's) on the new —
and the host-suite harness expects the old host's original test to fail under exactly those runs
(``fdsched/host_suites.yaml``).
"""

from __future__ import annotations

import pytest

from .test_scheduler_changes import SHAPE, _drain_pool, _place

DECODE_ONLY_PROFILES = ["decode_only_preempt", "recommended", None]  # None: FD_PLUGINS only, every change auto


@pytest.fixture
def rm_for(install_profile, make_manager):
    def _build(profile):
        install_profile(profile)
        return make_manager(**SHAPE)

    return _build


@pytest.mark.parametrize("profile", DECODE_ONLY_PROFILES, ids=lambda p: p or "default")
def test_trigger_preempt_records_the_decoding_victim(rm_for, profile):
    rm = rm_for(profile)
    target = _place(rm, "req-target", 8, computed=0)  # the prefill asking for blocks
    victim = _place(rm, "req-preempted", 8, generated=2)  # decoding: it has output tokens
    assert rm._fdsched_is_decoding(victim) and not rm._fdsched_is_decoding(target)
    _drain_pool(rm)

    preempted, scheduled = [], []
    can_schedule = rm._trigger_preempt(target, 2, preempted, scheduled)

    assert can_schedule is True
    assert victim.request_id in rm.to_be_rescheduled_request_id_set
    assert preempted == [victim]
    assert [task.request_id for task in scheduled] == [victim.request_id]
    assert [r.request_id for r in rm.running] == [target.request_id]


@pytest.mark.parametrize("profile", DECODE_ONLY_PROFILES, ids=lambda p: p or "default")
def test_trigger_preempt_takes_no_prefill_victim(rm_for, profile):
    """The host's pre-7783 test scenario (the last running request is a prefill): nothing is preempted."""
    rm = rm_for(profile)
    target = _place(rm, "req-target", 8, computed=0)
    other = _place(rm, "req-other", 8, computed=4)  # also prefilling: not a victim under 7783
    _drain_pool(rm)

    preempted, scheduled = [], []
    assert rm._trigger_preempt(target, 2, preempted, scheduled) is False
    assert preempted == [] and scheduled == []
    assert other.request_id not in rm.to_be_rescheduled_request_id_set
    assert [r.request_id for r in rm.running] == [target.request_id, other.request_id]


def test_baseline_still_preempts_the_last_request_even_a_prefill(rm_for):
    """The pre-change behaviour (baseline) is what the old host's original test asserts."""
    rm = rm_for("baseline")
    target = _place(rm, "req-target", 8, computed=0)
    other = _place(rm, "req-other", 8, computed=4)  # holds one block
    _drain_pool(rm, keep=1)  # one free block + the victim's one = the two asked for

    preempted, scheduled = [], []
    assert rm._trigger_preempt(target, 2, preempted, scheduled) is True
    assert preempted == [other]

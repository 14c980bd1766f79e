"""The adaptive reservation estimator in the engine path (profile ``adaptive``), on the real ResourceManagerV1.

Samples come from the host's own ``finish_requests`` (running requests only), preemptions widen the
margin, the running set shares one margin, a third-party hook still answers first, and the estimator's
state reaches the plugin's metrics. Runs on whichever host is configured (both hosts in CI).
"""

from __future__ import annotations

import math

import pytest

from fdsched.hookspecs import hookimpl
from fdsched.core.metrics import METRICS

from .test_scheduler_changes import SHAPE, _drain_pool, _place


@pytest.fixture
def adaptive_rm(install_profile, make_manager):
    def _build(**env):
        env.setdefault("FDSCHED_ADAPTIVE_MIN_SAMPLES", "4")
        install_profile("adaptive", **env)
        return make_manager(**SHAPE)

    return _build


def _finish(rm, rid, prompt_len, generated, max_tokens=None):
    _place(rm, rid, prompt_len, generated=generated, max_tokens=max_tokens)
    rm.finish_requests(iter([rid]))  # an iterator: the plugin must not consume what the host reads
    assert rid not in rm.requests  # the host still finished it


def test_finished_running_requests_are_samples_and_the_set_shares_one_margin(adaptive_rm):
    rm = adaptive_rm(FDSCHED_ADAPTIVE_MARGIN_K="1")
    assert rm.fdsched_strategy("ratio_reserve").adaptive_state() is not None
    lengths = [2, 4, 30, 40]  # all above the first bucket: the tail statistics at g = 0 are exact
    for i, length in enumerate(lengths):
        _finish(rm, f"f{i}", 8, generated=length)
    state = rm.fdsched_strategy("ratio_reserve").adaptive_state()
    assert state["absolute_tokens"]["samples"] == 4 and state["absolute_tokens"]["learned"]
    assert METRICS.adaptive["absolute_samples"] == 4 and METRICS.adaptive["absolute_learned"] is True
    # Worked by hand: E[L] = 76 / 4 = 19 tokens, Var[L] = 2520 / 4 - 19^2 = 269. Three running requests with
    # nothing generated (56 tokens of budget each, block size 4): the set keeps 3 x 19 + 1 x sqrt(3 x 269)
    # = 85.4 -> 86 tokens -> 22 blocks; upstream's ratio (0.7 x 56 = 39 tokens -> 10 blocks each, 30) caps above.
    for rid in "abc":
        _place(rm, rid, 8, generated=0, computed=8, max_tokens=None)
    assert rm.fdsched_strategy("ratio_reserve").running_reserve() == 22
    # A margin per request would keep 3 x ceil(ceil(19 + sqrt(269)) / 4) = 3 x 9 = 27 blocks.
    assert 22 < 3 * math.ceil(math.ceil(19 + math.sqrt(269)) / 4) == 27
    assert METRICS.adaptive["expected_tokens"] == pytest.approx(57)
    assert METRICS.adaptive["fallback_requests"] == 0


def test_a_preempted_request_is_not_a_sample_and_a_preemption_widens_the_margin(adaptive_rm):
    rm = adaptive_rm()
    a = _place(rm, "a", 8, generated=5, max_tokens=None)
    _place(rm, "b", 8, generated=3, max_tokens=None)
    _drain_pool(rm)
    k_before = rm.fdsched_strategy("ratio_reserve").adaptive_state()["k"]
    rm._trigger_preempt(a, 1, [], [])  # b, the last decoder, is preempted
    after = rm.fdsched_strategy("ratio_reserve").adaptive_state()
    assert after["preemptions_seen"] == 1 and after["k"] == k_before + 0.5  # K_STEP
    assert "b" in rm.to_be_rescheduled_request_id_set
    rm.finish_requests(["b"])  # finished while preempted: its length is not known to be complete
    assert rm.fdsched_strategy("ratio_reserve").adaptive_state()["finished_seen"] == 0


def test_warm_up_unbounded_requests_use_the_legacy_fixed_blocks(adaptive_rm):
    rm = adaptive_rm()
    _place(rm, "a", 8, generated=2, max_tokens=None)
    _place(rm, "b", 8, generated=2, max_tokens=None)
    assert rm.fdsched_strategy("ratio_reserve").running_reserve() == 0  # the legacy reservation is relaxed until a preemption
    assert METRICS.adaptive["fallback_requests"] == 2
    _drain_pool(rm)
    rm._trigger_preempt(rm.running[0], 1, [], [])
    # After the preemption the fallback reserves the legacy per-request blocks for what still runs, never
    # more than upstream's formula would (a: budget 64 - 8 = 56, 2 generated, at the re-estimated ratio).
    from fdsched.core.admission import reserve_blocks_for_request

    fixed = rm.fdsched_strategy("ratio_reserve").fixed.current
    by_ratio = reserve_blocks_for_request(56, 2, rm.fdsched_strategy("ratio_reserve").ratio.value, 4096, 4)
    assert fixed == 16 and [r.request_id for r in rm.running] == ["a"]
    assert rm.fdsched_strategy("ratio_reserve").running_reserve() == min(fixed, by_ratio) > 0


def test_a_bounded_client_is_learned_relative_to_its_max_tokens(adaptive_rm):
    rm = adaptive_rm()
    for i in range(4):
        _finish(rm, f"f{i}", 8, generated=10, max_tokens=20)  # half of max_tokens, every time
    state = rm.fdsched_strategy("ratio_reserve").adaptive_state()
    assert state["relative_to_max_tokens"]["samples"] == 4 and state["absolute_tokens"]["samples"] == 0
    assert state["relative_to_max_tokens"]["mean"] == pytest.approx(0.5, abs=0.03)


def test_a_third_party_hook_still_answers_first(adaptive_rm):
    rm = adaptive_rm()

    class Three:
        @hookimpl
        def fdsched_estimate_reserve_blocks(self, request_id, max_new_tokens, generated_tokens, ratio,
                                            clip_max_new_tokens, block_size):
            return 3 if request_id == "mine" else None

    policies = rm._fdsched_policies
    policies.register(Three(), name="three")
    try:
        _place(rm, "mine", 8, generated=2, max_tokens=None)
        _place(rm, "other", 8, generated=2, max_tokens=None)
        assert rm.fdsched_strategy("ratio_reserve").running_reserve() == 3 + 0  # "other": warm-up fallback, legacy relaxed
    finally:
        policies.pm.unregister(name="three")
        policies.refresh()


def test_the_running_sets_reservation_does_not_depend_on_the_order_of_running(adaptive_rm):
    # Issue 18: the set is summed at once (AdaptiveReserve.set_reservation), not as a running maximum of
    # per-request shares. Samples: four of 2 tokens, four of 50. A request that generated 30 expects 20 more
    # with almost no spread (5 blocks alone at k = -2); fresh ones expect 26 and 25 with a spread of 24 each
    # (nothing alone). The set: 71 - 2 x sqrt(2 x 576) = 3.1 tokens = 1 block, in every order. The
    # per-request shares kept 5 blocks whenever the 30-token request was asked first.
    import itertools

    rm = adaptive_rm(FDSCHED_ADAPTIVE_MARGIN_K="-2")
    for i, length in enumerate([2] * 4 + [50] * 4):
        _finish(rm, f"f{i}", 8, generated=length)
    for rid, generated in (("a", 0), ("b", 30), ("c", 1)):
        _place(rm, rid, 8, generated=generated, computed=8, max_tokens=None)
    answers = set()
    original = list(rm.running)
    try:
        for order in itertools.permutations(original):
            rm.running[:] = list(order)
            answers.add(rm.fdsched_strategy("ratio_reserve").running_reserve())
    finally:
        rm.running[:] = original
    assert len(answers) == 1, f"the set's reservation depends on the order of running: {answers}"
    assert answers == {1}


def test_an_admission_the_free_blocks_cover_at_the_bound_is_decided_without_a_count(adaptive_rm):
    """The host's block check takes nothing when its free list covers the count: an ask whose threshold at every
    running request's most is covered is answered with that threshold, and only a tighter pool counts."""
    from fdsched.core.admission import reserve_blocks_for_request
    from fdsched.patches.ratio_reserve.reader import free_blocks_of

    rm = adaptive_rm()
    free_list = rm.cache_manager.gpu_free_block_list
    free_of = free_blocks_of(rm.cache_manager)  # this host's check reads its free list: the bound applies
    assert free_of is not None and free_of() == len(free_list)
    _place(rm, "a", 8, generated=3, max_tokens=None)
    _place(rm, "b", 8, generated=0, computed=8, max_tokens=20)
    strategy = rm.fdsched_strategy("ratio_reserve").strategy
    top = rm.fdsched_strategy("ratio_reserve").ratio.top
    most = sum(reserve_blocks_for_request(budget, 0, top, strategy.clip, SHAPE["block_size"]) for budget in (56, 20))
    assert 2 + most <= len(free_list)  # the pool covers the bound
    METRICS.reserved(-1, of=rm)  # a mark: an answer by the bound leaves the gauge as it was
    before = len(free_list)
    threshold = rm._get_can_schedule_prefill_threshold_block(2)
    assert threshold == 2 + most and METRICS.reserved_blocks == -1
    assert rm.cache_manager.can_allocate_gpu_blocks(threshold) and len(free_list) == before  # nothing taken
    _drain_pool(rm, keep=2 + most - 1)  # one block short of the bound: the ask counts
    threshold = rm._get_can_schedule_prefill_threshold_block(2)
    counted = rm.fdsched_strategy("ratio_reserve").running_reserve()
    assert threshold == 2 + counted and METRICS.reserved_blocks == counted < most

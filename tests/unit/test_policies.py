"""fdsched.core.policies: the pure decisions, with plain values."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fdsched.core.admission import NewTokenRatio, max_new_tokens_of, reestimate_new_token_ratio, reserve_blocks_for_request
from fdsched.core.strategies import FixedBlockReserve
from fdsched.core.policies import (
    NoVictimWarning, VictimCandidate, is_decoding, select_any_phase_victim, select_preemption_victim,
)


def C(request_id, decoding, extend=False):
    return VictimCandidate(request_id, decoding, extend)


# --------------------------------------------------------------------------------------------
# is_decoding
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("total, need", [(1, 100), (100, 1), (5, 5)])
def test_status_is_authoritative_when_given(total, need):
    assert is_decoding(True, total, need) is True
    assert is_decoding(False, total, need) is False


def test_token_counts_decide_without_a_status():
    assert is_decoding(None, 101, 100) is True  # produced one token after its prefill
    assert is_decoding(None, 100, 100) is False  # prefill done, first token not back yet
    assert is_decoding(None, 40, 100) is False  # chunked prefill under way


def test_rescheduled_request_prefills_again_until_a_new_token():
    # a preempted request is re-admitted with need_prefill_tokens = its total tokens (prompt + output so far)
    prompt, generated = 100, 30
    total = prompt + generated
    assert is_decoding(None, total, need_prefill_tokens=total) is False
    assert is_decoding(None, total + 1, need_prefill_tokens=total) is True


@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_is_decoding_without_status_is_the_token_comparison(total, need):
    assert is_decoding(None, total, need) is (total > need)


# --------------------------------------------------------------------------------------------
# Victims
# --------------------------------------------------------------------------------------------
def test_no_candidates_no_victim():
    assert select_preemption_victim([]) is None
    assert select_any_phase_victim([]) is None


def test_all_prefilling_gives_no_decode_only_victim():
    queue = [C("a", False), C("b", False), C("c", False)]
    assert select_preemption_victim(queue) is None
    assert select_any_phase_victim(queue) == 2  # the old policy throws away prefill work


def test_lifo_among_decoders():
    queue = [C("old", True), C("mid", True), C("chunk", False), C("new", True), C("prefill", False)]
    assert select_preemption_victim(queue) == 3
    assert select_preemption_victim(queue[:3]) == 1
    assert select_preemption_victim(queue[:1]) == 0


def test_extend_table_requests_are_skipped():
    queue = [C("a", True), C("b", True, extend=True)]
    assert select_preemption_victim(queue) == 0
    assert select_any_phase_victim(queue) == 0
    assert select_preemption_victim([C("x", True, extend=True)]) is None
    assert select_any_phase_victim([C("x", False, extend=True)]) is None


def test_any_phase_victim_may_be_a_prefill():
    queue = [C("a", True), C("b", False), C("c", True, extend=True)]
    assert select_any_phase_victim(queue) == 1
    assert select_preemption_victim(queue) == 0


def test_victim_candidates_are_frozen():
    candidate = C("a", True)
    with pytest.raises(Exception):
        candidate.decoding = False


candidate_lists = st.lists(st.builds(VictimCandidate, st.text(max_size=3), st.booleans(), st.booleans()), max_size=12)


@given(candidate_lists)
def test_decode_only_victim_is_the_last_qualifying(queue):
    index = select_preemption_victim(queue)
    qualifying = [i for i, c in enumerate(queue) if c.decoding and not c.uses_extend_tables]
    assert index == (qualifying[-1] if qualifying else None)


@given(candidate_lists)
def test_any_phase_victim_is_the_last_without_extend_tables(queue):
    index = select_any_phase_victim(queue)
    qualifying = [i for i, c in enumerate(queue) if not c.uses_extend_tables]
    assert index == (qualifying[-1] if qualifying else None)
    decode_only = select_preemption_victim(queue)
    if decode_only is not None:  # the decode-only victim is never later than the any-phase one
        assert decode_only <= index


# --------------------------------------------------------------------------------------------
# Reservation
# --------------------------------------------------------------------------------------------
def test_max_new_tokens_of():
    assert max_new_tokens_of(256, 8192, 1000) == 256
    assert max_new_tokens_of(None, 8192, 1000) == 7192
    as_float = max_new_tokens_of(256.0, 8192, 1000)  # a float max_tokens (JSON) becomes the same int budget
    assert as_float == 256 and type(as_float) is int


def test_reserve_with_max_tokens_unset_uses_the_rest_of_the_context():
    budget = max_new_tokens_of(None, max_model_len=2048, prompt_len=1024)
    assert reserve_blocks_for_request(budget, 0, 1.0, 4096, 64) == 16
    assert reserve_blocks_for_request(budget, 0, 0.5, 4096, 64) == 8


def test_generated_more_than_the_budget_reserves_nothing():
    assert reserve_blocks_for_request(100, 150, 0.7, 4096, 64) == 0
    assert reserve_blocks_for_request(100, 100, 1.0, 4096, 64) == 0


def test_clip_applies_before_the_ratio():
    assert reserve_blocks_for_request(100_000, 0, 1.0, 4096, 64) == 64
    assert reserve_blocks_for_request(100_000, 0, 0.5, 4096, 64) == 32
    assert reserve_blocks_for_request(100_000, 0, 1.0, 0, 64) == 0


@pytest.mark.parametrize(
    "tokens, blocks", [(0, 0), (1, 1), (63, 1), (64, 1), (65, 2), (127, 2), (128, 2), (129, 3)]
)
def test_ceil_division_is_exact_at_block_boundaries(tokens, blocks):
    assert reserve_blocks_for_request(tokens, 0, 1.0, 4096, 64) == blocks


def test_tokens_are_truncated_before_rounding_up_to_blocks():
    # int(3 * 0.5) == 1 token -> 1 block; int(1 * 0.5) == 0 tokens -> 0 blocks
    assert reserve_blocks_for_request(3, 0, 0.5, 4096, 16) == 1
    assert reserve_blocks_for_request(1, 0, 0.5, 4096, 16) == 0
    # 129 tokens * 0.5 = 64.5 -> 64 tokens -> exactly one 64-token block
    assert reserve_blocks_for_request(129, 0, 0.5, 4096, 64) == 1


reserve_args = dict(
    max_new=st.integers(0, 200_000),
    generated=st.integers(0, 200_000),
    clip=st.integers(0, 10_000),
    block=st.integers(1, 256),
)


@given(**reserve_args, r1=st.floats(0, 1), r2=st.floats(0, 1))
def test_reserve_is_monotone_in_ratio_and_never_negative(max_new, generated, clip, block, r1, r2):
    low, high = sorted((r1, r2))
    a = reserve_blocks_for_request(max_new, generated, low, clip, block)
    b = reserve_blocks_for_request(max_new, generated, high, clip, block)
    assert 0 <= a <= b


@given(**reserve_args, ratio=st.floats(0, 1))
def test_reserve_is_bounded_by_the_clipped_budget(max_new, generated, clip, block, ratio):
    blocks = reserve_blocks_for_request(max_new, generated, ratio, clip, block)
    assert 0 <= blocks <= math.ceil(max(min(max_new - generated, clip), 0) / block)
    assert isinstance(blocks, int)


@given(**reserve_args, extra=st.integers(0, 1000), ratio=st.floats(0, 1))
def test_reserve_never_grows_as_a_request_generates(max_new, generated, clip, block, extra, ratio):
    before = reserve_blocks_for_request(max_new, generated, ratio, clip, block)
    after = reserve_blocks_for_request(max_new, generated + extra, ratio, clip, block)
    assert after <= before


# --------------------------------------------------------------------------------------------
# Ratio re-estimate and the ratio state machine
# --------------------------------------------------------------------------------------------
def test_reestimate_formula():
    # (10 + 20 + 1 extra block * 16 tokens * 2 decoding) / (100 + 200 + 1)
    assert reestimate_new_token_ratio([10, 20], [100, 200], 2, 16, 1, cap=1.0) == 62 / 301
    # no extra term: exactly what was generated over the budgets (+1)
    assert reestimate_new_token_ratio([50], [99], 1, 64, 0, cap=1.0) == 0.5
    # generators are fine
    assert reestimate_new_token_ratio(iter([50]), iter([99]), 1, 64, 0, cap=1.0) == 0.5


def test_reestimate_is_capped():
    # (30 + 16 * 16 * 2) / 301 is far above 1
    assert reestimate_new_token_ratio([10, 20], [100, 200], 2, 16, 16, cap=0.7) == 0.7
    assert reestimate_new_token_ratio([10, 20], [100, 200], 2, 16, 16, cap=1.0) == 1.0
    assert reestimate_new_token_ratio([0], [100], 0, 16, 16, cap=0.7) == 0.0


def test_new_token_ratio_decays_to_its_floor():
    ratio = NewTokenRatio(init=0.7, minimum=0.1, decay=0.25)
    assert ratio.value == 0.7 and ratio.cap == 0.7
    ratio.after_schedule(True)
    assert ratio.value == pytest.approx(0.45)
    ratio.after_schedule(False)  # a pass that scheduled nothing does not relax the reservation
    assert ratio.value == pytest.approx(0.45)
    ratio.after_schedule(True)
    assert ratio.value == pytest.approx(0.2)
    ratio.after_schedule(True)
    assert ratio.value == 0.1
    ratio.after_schedule(True)
    assert ratio.value == 0.1


def test_new_token_ratio_reestimates_on_preemption():
    ratio = NewTokenRatio(init=0.7, minimum=0.1, decay=0.001)
    value = ratio.on_preemption([10, 20], [100, 200], 2, 16, 1)
    assert value == ratio.value == 62 / 301
    # upstream caps at init; a custom cap replaces it
    assert ratio.on_preemption([10, 20], [100, 200], 2, 16, 16) == 0.7
    wide = NewTokenRatio(init=0.7, minimum=0.1, decay=0.001, cap=1.0)
    assert wide.on_preemption([10, 20], [100, 200], 2, 16, 16) == 1.0


def test_new_token_ratio_back_to_init_when_nothing_runs():
    ratio = NewTokenRatio(init=0.7, minimum=0.1, decay=0.3)
    ratio.after_schedule(True)
    assert ratio.value < 0.7
    assert ratio.on_preemption([], [], 0, 16, 16) == 0.7
    assert ratio.value == 0.7


@given(
    init=st.floats(0, 1),
    decay=st.floats(0, 1),
    passes=st.lists(st.booleans(), max_size=50),
    data=st.data(),
)
def test_new_token_ratio_stays_between_floor_and_init(init, decay, passes, data):
    minimum = data.draw(st.floats(0, init))
    ratio = NewTokenRatio(init, minimum, decay)
    previous = ratio.value
    for scheduled in passes:
        ratio.after_schedule(scheduled)
        assert minimum <= ratio.value <= init
        assert ratio.value <= previous
        previous = ratio.value


# --------------------------------------------------------------------------------------------
# The fixed-block reservation (ratio_reserve off)
# --------------------------------------------------------------------------------------------
def test_fixed_block_reserve_starts_relaxed():
    fixed = FixedBlockReserve(init=16, decay=0.5, minimum=0)
    assert fixed.relaxed is True
    assert fixed.threshold(chunk_blocks=5, num_running=3) == 5


def test_fixed_block_reserve_after_preemption():
    fixed = FixedBlockReserve(init=16, decay=0.5, minimum=0)
    fixed.on_preemption()
    assert fixed.relaxed is False
    assert fixed.threshold(5, 3) == 5 + 3 * 16


def test_fixed_block_reserve_decays_and_relaxes_at_zero():
    fixed = FixedBlockReserve(init=2, decay=0.5, minimum=0)
    fixed.on_preemption()
    fixed.after_schedule(False)
    assert fixed.current == 2
    fixed.after_schedule(True)  # 1.5
    assert fixed.current == 1 and fixed.relaxed is False
    assert fixed.threshold(5, 3) == 8
    fixed.after_schedule(True)  # 1.0
    assert fixed.current == 1 and fixed.relaxed is False
    fixed.after_schedule(True)  # 0.5 -> 0
    assert fixed.current == 0 and fixed.relaxed is True
    assert fixed.threshold(5, 3) == 5
    fixed.on_preemption()  # back to init, not relaxed
    assert fixed.current == 2 and fixed.relaxed is False
    assert fixed.threshold(5, 3) == 11


def test_fixed_block_reserve_with_a_floor_never_relaxes():
    fixed = FixedBlockReserve(init=16, decay=1.0, minimum=4)
    fixed.on_preemption()
    for _ in range(100):
        fixed.after_schedule(True)
    assert fixed.current == 4
    assert fixed.relaxed is False
    assert fixed.threshold(1, 2) == 9


# --------------------------------------------------------------------------------------------
# No-victim warning episodes
# --------------------------------------------------------------------------------------------
def test_no_victim_warns_once_per_episode():
    warning = NoVictimWarning()
    assert warning.should_warn() is True
    assert warning.should_warn() is False  # same pass
    warning.end_pass()
    assert warning.should_warn() is False  # next pass, still stuck: same episode
    warning.end_pass()
    assert warning.episodes == 1
    warning.end_pass()  # a pass without the state ends the episode
    assert warning.should_warn() is True
    assert warning.episodes == 2


def test_end_pass_without_hits_never_warns():
    warning = NoVictimWarning()
    for _ in range(3):
        warning.end_pass()
    assert warning.episodes == 0


@given(st.lists(st.booleans(), max_size=40))
def test_warnings_equal_the_number_of_stuck_runs(stuck_passes):
    warning = NoVictimWarning()
    warned = 0
    for stuck in stuck_passes:
        if stuck:
            warned += warning.should_warn()
            assert warning.should_warn() is False  # never twice in a pass
        warning.end_pass()
    runs = sum(1 for i, s in enumerate(stuck_passes) if s and (i == 0 or not stuck_passes[i - 1]))
    assert warned == runs == warning.episodes


def test_the_stall_watch_reports_an_episode_once_after_enough_passes_and_time():
    from fdsched.core.policies import StallWatch

    watch = StallWatch(min_passes=3, min_seconds=10.0)
    assert [watch.observe(t, waiting=2, running=0, free_blocks=5) for t in (0.0, 1.0, 2.0)] == [False] * 3  # too soon
    assert watch.observe(10.0, waiting=2, running=0, free_blocks=5) is True
    assert watch.observe(20.0, waiting=2, running=0, free_blocks=5) is False  # once per episode
    assert watch.observe(21.0, waiting=2, running=1, free_blocks=5) is False and watch.since is None  # not stuck
    assert [watch.observe(t, waiting=1, running=0, free_blocks=3) for t in (30.0, 31.0, 42.0)] == [False, False, True]
    watch.clear()
    assert watch.observe(50.0, waiting=0, running=0, free_blocks=3) is False  # nothing waits: not a stall
    assert watch.observe(51.0, waiting=1, running=0, free_blocks=0) is False and watch.passes == 0  # no free block

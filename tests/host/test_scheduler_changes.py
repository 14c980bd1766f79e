"""Changes 2 and 3 against the real ResourceManagerV1 (cherry-picked upstream behaviour, in our words).

Upstream PR 7444 (2.6: 7783) tests the victim selector, the reserve estimate and the ratio state
machine; these tests check the same behaviour through the plugin's subclass on whichever host runs
them, and, on a host that has 7783, against the host's own methods.
"""

from __future__ import annotations

import logging
import threading

import pytest

from fdsched.core.metrics import METRICS

from .workloads import PRESSURE_SHAPE, kv_pressure_requests, run_workload

SHAPE = dict(block_size=4, num_gpu_blocks=40, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
             enable_prefix_caching=False)


def _place(rm, rid, prompt_len, generated=0, computed=None, extend=False, max_tokens=32, blocks=None):
    """Put a request into the running queue in a given state, holding real blocks from the pool."""
    from fdsched.replay.engine import make_request

    request = make_request(rid, [3] * prompt_len, max_tokens)
    request.output_token_ids = [7] * generated
    decoding = generated > 0
    request.num_computed_tokens = (request.num_total_tokens - 1) if decoding else (computed or 0)
    host = getattr(rm, "_fdsched_host", None)
    if host is None:  # the host's own class (no plugin installed)
        from fdsched.install.probe import probe

        host = probe()
    status = host.request_status
    if host.split_status:
        request.status = status.RUNNING_DECODE if decoding else status.RUNNING_PREFILL
    else:
        request.status = status.RUNNING
    request.use_extend_tables = extend
    need = blocks if blocks is not None else -(-max(request.num_computed_tokens, 1) // rm.config.cache_config.block_size)
    request.block_tables = rm.cache_manager.allocate_gpu_blocks(need, rid)
    request.idx = rm.get_available_position()
    rm.tasks_list[request.idx] = request
    rm.stop_flags[request.idx] = False
    rm.requests[rid] = request
    rm.req_dict[rid] = request.idx
    rm.running.append(request)
    return request


def _drain_pool(rm, keep=0):
    """Allocate every free block but ``keep`` to a dummy holder, so the next allocation must preempt."""
    free = len(rm.cache_manager.gpu_free_block_list)
    return rm.cache_manager.allocate_gpu_blocks(free - keep, "holder")


@pytest.fixture
def rm_with(install_profile, make_manager):
    def _build(profile=None, shape=None, **env):
        install_profile(profile, **env)
        return make_manager(**(shape or SHAPE))

    return _build


# ---- victim selection (change 2) ---------------------------------------------------------------------
def test_victim_is_the_last_decoding_request(rm_with):
    rm = rm_with("decode_only_preempt")
    a = _place(rm, "a", 8, generated=3)
    b = _place(rm, "b", 8, generated=2)
    c = _place(rm, "c", 12, computed=4)  # a chunked prefill, admitted last
    _drain_pool(rm)
    preempted, scheduled = [], []
    assert rm._trigger_preempt(a, 1, preempted, scheduled) is True
    assert [r.request_id for r in preempted] == ["b"]
    assert [r.request_id for r in rm.running] == ["a", "c"]
    assert "b" in rm.to_be_rescheduled_request_id_set
    assert b.num_computed_tokens == 0 and b.block_tables == []
    assert [t.request_id for t in scheduled] == ["b"] and type(scheduled[0]).__name__ == "ScheduledPreemptTask"
    assert METRICS.preemptions == {"decode": 1}
    assert c.status != rm._fdsched_host.request_status.PREEMPTED


def test_extend_table_requests_are_never_victims(rm_with):
    rm = rm_with("decode_only_preempt")
    a = _place(rm, "a", 8, generated=3)
    _place(rm, "b", 8, generated=2, extend=True)
    preempted = []
    _drain_pool(rm)
    assert rm._trigger_preempt(a, 1, preempted, []) is False  # a preempts itself: nothing else qualifies
    assert [r.request_id for r in preempted] == ["a"]
    assert [r.request_id for r in rm.running] == ["b"]


def test_all_prefilling_means_no_victim_and_a_warning(rm_with, caplog):
    from fastdeploy.utils import llm_logger

    rm = rm_with("decode_only_preempt")
    first = _place(rm, "p1", 16, computed=4)
    _place(rm, "p2", 16, computed=8)
    _drain_pool(rm)
    llm_logger.propagate, saved = True, llm_logger.propagate
    try:
        with caplog.at_level(logging.WARNING):
            preempted = []
            assert rm._trigger_preempt(first, 2, preempted, []) is False
            assert rm._trigger_preempt(first, 2, preempted, []) is False  # same pass: no second warning
            assert preempted == [] and len(rm.running) == 2
            rm._fdsched_strategies["decode_only_preempt"].no_victim.end_pass()  # a pass that hit the state: episode goes on
            rm._trigger_preempt(first, 2, [], [])
            rm._fdsched_strategies["decode_only_preempt"].no_victim.end_pass()
            rm._fdsched_strategies["decode_only_preempt"].no_victim.end_pass()  # a clean pass ends the episode
            rm._trigger_preempt(first, 2, [], [])
    finally:
        llm_logger.propagate = saved
    warnings = [r for r in caplog.records if "no preemptable" in r.getMessage()]
    if hasattr(rm._fdsched_host_class, "_select_preempt_candidate"):
        # New host: its own loop runs (the plugin answers its _select_preempt_candidate) and warns on every call.
        assert len(warnings) == 4 and not any("[fdsched]" in r.getMessage() for r in warnings)
    else:
        # Old host: the plugin's loop warns once per episode.
        assert len(warnings) == 2 and all("[fdsched]" in r.getMessage() for r in warnings)


def test_off_restores_the_pre_change_victim_a_prefill_can_be_chosen(rm_with):
    rm = rm_with("baseline")
    a = _place(rm, "a", 8, generated=3)
    _place(rm, "b", 8, generated=2)
    _place(rm, "c", 12, computed=4)
    _drain_pool(rm)
    preempted = []
    assert rm._trigger_preempt(a, 1, preempted, []) is True
    assert [r.request_id for r in preempted] == ["c"]


# ---- the reserve estimate (change 3) -------------------------------------------------------------------
def test_reserve_estimate_max_tokens_none_remaining_negative_and_clip(rm_with):
    rm = rm_with("ratio_reserve", FD_CLIP_MAX_NEW_TOKENS=40, FD_INIT_NEW_TOKEN_RATIO=0.5)
    # max_tokens None: budget = max_model_len (64) - prompt (8) = 56, clipped to 40; 40 * 0.5 = 20 tokens -> 5 blocks
    _place(rm, "none", 8, generated=0, computed=8, max_tokens=None)
    # remaining < 0: generated 12 of max_tokens 10 -> 0 blocks
    _place(rm, "over", 8, generated=12, max_tokens=10)
    # plain: (30 - 4) * 0.5 = 13 tokens -> ceil(13 / 4) = 4 blocks
    _place(rm, "plain", 8, generated=4, max_tokens=30)
    assert rm.fdsched_strategy("ratio_reserve").running_reserve() == 5 + 0 + 4
    # Where the free blocks cover the chunk at every request's most (their whole budgets: 5 + 2 + 4), the threshold
    # is that bound (any threshold the free list covers is checked alike); below it the ask counts the set.
    assert rm._get_can_schedule_prefill_threshold_block(3) == 3 + 11
    _drain_pool(rm, keep=3 + 11 - 1)
    assert rm._get_can_schedule_prefill_threshold_block(3) == 3 + 9
    if hasattr(rm, "_get_running_request_reserve_blocks"):  # the host's own 7783 code agrees
        rm.new_token_ratio, rm.clip_max_new_tokens = 0.5, 40
        assert sum(rm._get_running_request_reserve_blocks(r) for r in rm.running) == 9


def test_ratio_is_reestimated_after_a_preemption(rm_with):
    rm = rm_with("recommended")
    a = _place(rm, "a", 8, generated=5, max_tokens=40)
    _place(rm, "b", 8, generated=3, max_tokens=20)
    _place(rm, "c", 12, computed=4, max_tokens=None)
    _drain_pool(rm)
    rm._trigger_preempt(a, 1, [], [])
    # b (last decoder) is gone; running: a (decoding, 5 of 40), c (prefill, budget 64 - 12 = 52)
    expected = min((5 + 16 * 4 * 1) / (40 + 52 + 1), 0.7)
    assert rm.fdsched_strategy("ratio_reserve").ratio.value == pytest.approx(expected)
    assert METRICS.new_token_ratio == pytest.approx(expected)


def test_reestimate_term_and_cap_are_tunable(rm_with):
    rm = rm_with("recommended", FDSCHED_RATIO_REESTIMATE_EXTRA_BLOCKS=0, FDSCHED_RATIO_REESTIMATE_CAP=0.9)
    a = _place(rm, "a", 8, generated=30, max_tokens=32)
    _place(rm, "b", 8, generated=3, max_tokens=20)
    _drain_pool(rm)
    rm._trigger_preempt(a, 1, [], [])
    assert rm.fdsched_strategy("ratio_reserve").ratio.value == pytest.approx(min(30 / 33, 0.9))


def test_ratio_resets_to_init_when_nothing_runs(rm_with):
    rm = rm_with("recommended")
    a = _place(rm, "a", 8, generated=5)
    rm.fdsched_strategy("ratio_reserve").ratio.value = 0.2
    _drain_pool(rm)
    rm._trigger_preempt(a, 1, [], [])  # a preempts itself, nothing runs afterwards
    assert rm.running == [] and rm.fdsched_strategy("ratio_reserve").ratio.value == pytest.approx(0.7)


def test_ratio_decays_after_passes_that_schedule_and_stops_at_the_floor(rm_with):
    from fdsched.replay.engine import make_request

    rm = rm_with("recommended", FD_NEW_TOKEN_RATIO_DECAY=0.25, FD_MIN_NEW_TOKEN_RATIO=0.1)
    assert rm.schedule()[0] == []
    assert rm.fdsched_strategy("ratio_reserve").ratio.value == pytest.approx(0.7)  # nothing scheduled: no decay
    for value in (0.45, 0.2, 0.1, 0.1):
        request = make_request(f"w{value}", [1, 2, 3, 4], 4)
        rm.add_request(request)
        for future in request.async_process_futures:
            future.result()
        assert rm.schedule()[0], "expected the new request to be scheduled"
        assert rm.fdsched_strategy("ratio_reserve").ratio.value == pytest.approx(value)


# ---- the chunked-prefill guard -------------------------------------------------------------------------
def _guard_scene(rm):
    """A decoder with room for 12+ more tokens, a running chunked prefill that needs 4 more blocks, a waiting
    request, and 8 free blocks: enough for the chunk by itself, not with the decoder's reservation
    (int(59 * 0.7) = 41 tokens -> 11 blocks) on top."""
    from fdsched.replay.engine import make_request

    _place(rm, "d1", 8, generated=1, max_tokens=60, blocks=6)
    chunk = _place(rm, "chunk", 24, computed=8, max_tokens=8, blocks=2)
    waiting = make_request("w", [9] * 8, 8)
    rm.add_request(waiting)
    for future in waiting.async_process_futures:
        future.result()
    _drain_pool(rm, keep=8)
    return chunk, waiting


def test_guard_stops_running_chunk_and_blocks_admission(rm_with):
    rm = rm_with("recommended")
    chunk, waiting = _guard_scene(rm)
    before = chunk.num_computed_tokens
    scheduled, _ = rm.schedule()
    assert chunk.num_computed_tokens == before, "the refused chunk must not advance"
    assert list(rm.waiting) == [waiting], "no waiting request may be admitted in that step"
    assert rm.to_be_rescheduled_request_id_set == set(), "the guard never preempts"
    # one refusal: the chunk's, decided and counted where its verdict is made; the waiting pass never asks
    assert METRICS.admissions_blocked == 1


def test_a_block_check_from_another_thread_mid_pass_neither_takes_nor_is_bent_by_the_pass_signals(rm_with):
    """In the engine the cache manager is also called from other threads (token processor, transfer receiver,
    PD preallocation) while a schedule() pass is open. Right after the scheduler's pass expects something of its
    next block check (a host without the reserve seams: the guard's refusal of the running chunk), another thread
    checks exactly that many blocks: it must get the pool's true answer, leave the pass's expectation pending, and
    the scheduler's own check must still be the one that takes it. On a host with the reserve seams the pass expects
    nothing of any check (the threshold's verdict asked the pool itself) and the cache manager's check is the
    host's own."""
    from fdsched.patches._host_code import HostCode
    from fdsched.patches.ratio_reserve.budget import RunningChunkGuard

    rm = rm_with("recommended")
    chunk, waiting = _guard_scene(rm)
    before = chunk.num_computed_tokens
    seen = []

    def check_from_another_thread():
        signals = rm._fdsched_plans.current()  # the scheduler's open plan (this runs on its thread)
        pending = signals.pending()
        for expected in pending:
            answer = []
            thread = threading.Thread(target=lambda n=expected.num_blocks: answer.append(
                rm.cache_manager.can_allocate_gpu_blocks(n)))
            thread.start()
            thread.join()
            seen.append((expected.kind, expected.num_blocks, answer[0], len(rm.cache_manager.gpu_free_block_list)))
        assert signals.pending() == pending, "another thread's check took the scheduler's signal"

    for name in ("get_new_block_nums", "_get_can_schedule_prefill_threshold_block"):
        def wrapped(*args, _real=getattr(rm, name), **kwargs):
            result = _real(*args, **kwargs)
            check_from_another_thread()
            return result

        setattr(rm, name, wrapped)  # on the instance: the host's self.<name>(...) calls find it first
    rm.schedule()
    guarded = isinstance(rm.fdsched_strategy("ratio_reserve"), RunningChunkGuard)
    if guarded:
        assert seen, "the pass expected no signal: the scene no longer exercises the guard"
    else:
        assert seen == [], "a host with the reserve seams: no pass expects anything of a block check"
        assert isinstance(rm.cache_manager._fdsched_check, HostCode), "the cache manager's check is the host's"
    for kind, num_blocks, answer, free in seen:
        assert answer == (free >= num_blocks), f"the other thread's check of {num_blocks} blocks was bent by {kind}"
    assert chunk.num_computed_tokens == before, "the scheduler's own check of the chunk must still be refused"
    assert list(rm.waiting) == [waiting]
    assert METRICS.admissions_blocked >= 1
    assert METRICS.unconsumed_signals == {}, "every signal was taken by the check it was for"


def test_the_served_engine_state_reports_what_an_open_pass_still_expects(rm_with):
    """The served engine's state (read by the engine tier's checks) lists what the scheduler's open pass still
    expects of a block check, from the slot the scheduler made; nothing once the pass is closed."""
    from fdsched.patches._scheduler import Expected, StepPlan
    from fdsched.patches.ratio_reserve.budget import REFUSE_RUNNING_CHUNK
    from fdsched.serve.seams.engine import _engine_state_locked

    rm = rm_with("recommended")
    slot, plan = rm._fdsched_plans, StepPlan(None)
    outer = slot.open(plan)
    plan.focus("r1")
    plan.expect(REFUSE_RUNNING_CHUNK, 7)
    assert _engine_state_locked(rm, rm.cache_manager)["pending_signals"] == [
        repr(Expected(REFUSE_RUNNING_CHUNK, "r1", 7))]
    slot.close(outer)
    assert _engine_state_locked(rm, rm.cache_manager)["pending_signals"] == []


def test_a_second_thread_entering_schedule_mid_pass_does_not_take_the_open_pass_budget(rm_with, monkeypatch):
    """The pass's admission budget belongs to the thread that opened it: another thread that calls schedule()
    while a pass is open (it then waits for the host's lock) must not replace the budget the open pass's
    admissions ask (on the old host the guard needs it to refuse the running chunk)."""
    import time

    from fdsched.patches._scheduler import PlanSlot

    rm = rm_with("recommended")
    chunk, waiting = _guard_scene(rm)
    before = chunk.num_computed_tokens
    other = threading.Thread(target=rm.schedule)
    real = rm.get_new_block_nums
    opened = []

    real_open = PlanSlot.open

    def recording_open(slot, plan):
        outer = real_open(slot, plan)
        if slot is rm._fdsched_plans:
            opened.append(plan.owner)
        return outer

    monkeypatch.setattr(PlanSlot, "open", recording_open)  # the slot the scheduler made and handed over, as it is

    def wrapped(*args, **kwargs):
        if not other.is_alive() and other.ident is None:
            other.start()
            time.sleep(0.2)  # the second thread is in schedule() by now, waiting for this pass to end
            assert other.is_alive() and opened == [threading.get_ident()], "the second pass ran inside the first"
            assert rm._fdsched_plans.current().owner == threading.get_ident(), "the open pass was replaced"
        return real(*args, **kwargs)

    rm.get_new_block_nums = wrapped  # on the instance: the host's self.get_new_block_nums(...) finds it first
    rm.schedule()
    other.join(timeout=30)
    assert not other.is_alive()
    assert chunk.num_computed_tokens == before, "the open pass's check of the chunk must still be refused"
    assert list(rm.waiting) == [waiting]
    assert rm.to_be_rescheduled_request_id_set == set(), "the guard never preempts"
    assert rm._fdsched_plans.plan is None
    assert opened == [threading.get_ident(), other.ident], "each pass opened its own plan, one after the other"


def test_without_the_change_the_running_chunk_goes_ahead(rm_with):
    rm = rm_with("baseline")
    chunk, _ = _guard_scene(rm)
    rm.schedule()
    assert chunk.num_computed_tokens == 24, "the pre-change scheduler only needs the chunk's own blocks"
    assert rm.to_be_rescheduled_request_id_set == set()


def test_fixed_block_threshold_under_off(rm_with):
    rm = rm_with("baseline", FD_RESERVE_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL=3)
    a = _place(rm, "a", 8, generated=3)
    _place(rm, "b", 8, generated=2)
    assert rm._get_can_schedule_prefill_threshold_block(5) == 5  # relaxed until the first preemption
    _drain_pool(rm)
    rm._trigger_preempt(a, 1, [], [])
    rm.cache_manager.recycle_gpu_blocks(rm.cache_manager.allocate_gpu_blocks(0, "x"))
    # After a preemption: 3 blocks per running request (one left running).
    assert rm._get_can_schedule_prefill_threshold_block(5) == 5 + 3 * len(rm.running)


# ---- scenarios under KV pressure ---------------------------------------------------------------------
PREFILL_VICTIM_WORKLOAD = dict(prompt=(30, 90), output=(10, 40))


def _victims(rm_with, profile):
    from fdsched.replay.engine import logical_clock

    rm = rm_with(profile, shape=PRESSURE_SHAPE)
    with logical_clock():
        records = run_workload(rm, kv_pressure_requests(**PREFILL_VICTIM_WORKLOAD))
    return [phase for record in records for _, phase in record.preempted]


def test_scenario_decode_only_never_preempts_a_prefill(rm_with):
    victims = _victims(rm_with, "decode_only_preempt")
    assert victims, "the workload must cause preemptions"
    assert "prefill" not in victims


def test_scenario_off_preempts_a_prefill(rm_with):
    assert "prefill" in _victims(rm_with, "baseline")


def test_plugin_metrics_reach_the_hosts_metrics_endpoint(rm_with):
    """The host's /metrics text (get_filtered_metrics, multi-process mode) includes the plugin's metrics."""
    from fastdeploy.metrics.metrics import get_filtered_metrics

    rm = rm_with("recommended")
    a = _place(rm, "a", 8, generated=3)
    _place(rm, "b", 8, generated=2)
    _drain_pool(rm)
    rm._trigger_preempt(a, 1, [], [])
    text = get_filtered_metrics()
    # Every series carries the arm (the profile) and the data-parallel rank.
    assert 'fastdeploy:fdsched_preemptions_total{arm="recommended",dp_rank="0",victim_phase="decode"}' in text
    assert 'fastdeploy:fdsched_new_token_ratio{arm="recommended",dp_rank="0"}' in text


def _chunk_short_of_blocks_scene(rm, chunk_last=True):
    """Two decoders and a running chunk that needs 4 more blocks while 2 are free."""
    _place(rm, "d1", 8, generated=1, max_tokens=60, blocks=6)
    _place(rm, "d2", 8, generated=1, max_tokens=60, blocks=6)
    chunk = _place(rm, "chunk", 24, computed=8, max_tokens=8, blocks=2)
    if not chunk_last:
        rm.running.remove(chunk)
        rm.running.insert(0, chunk)
    _drain_pool(rm, keep=2)
    return chunk


def test_off_a_running_chunk_short_of_blocks_preempts_as_before_7783(rm_with):
    """Pre-change (old host, or off on the new host): the chunk preempts the last running request."""
    rm = rm_with("baseline")
    chunk = _chunk_short_of_blocks_scene(rm, chunk_last=False)
    rm.schedule()
    assert "d2" in rm.to_be_rescheduled_request_id_set, "the last running request is the victim"
    assert chunk.num_computed_tokens == 24, "with the victim's blocks the chunk goes ahead"


def test_off_a_chunk_that_preempts_itself_gets_no_blocks(rm_with):
    # No fixed-block reservation, so only the refusal keeps the host from handing the freed blocks back to it.
    rm = rm_with("baseline", FD_RESERVE_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL=0)
    chunk = _chunk_short_of_blocks_scene(rm, chunk_last=True)
    rm.schedule()
    assert "chunk" in rm.to_be_rescheduled_request_id_set
    assert chunk.block_tables == [] and chunk.num_computed_tokens == 0
    assert chunk not in rm.running
    free = rm.cache_manager.gpu_free_block_list
    assert len(free) == len(set(free))


def test_a_signal_no_host_check_consumes_is_dropped_and_reported_at_the_end_of_the_pass(rm_with, caplog):
    from fastdeploy.utils import llm_logger

    rm = rm_with("recommended")
    chunk, _ = _guard_scene(rm)
    real = rm.get_new_block_nums

    def wrapped(*args, **kwargs):
        blocks = real(*args, **kwargs)
        schedule_pass = rm._fdsched_plans.current()
        schedule_pass.focus("ghost")
        schedule_pass.expect("refuse-running-chunk", 12345)  # no check is ever for 12345
        schedule_pass.focus(args[0].request_id)
        return blocks

    rm.get_new_block_nums = wrapped  # on the instance: the host's self.get_new_block_nums(...) finds it first
    llm_logger.propagate, saved = True, llm_logger.propagate
    try:
        with caplog.at_level(logging.WARNING):
            rm.schedule()
    finally:
        llm_logger.propagate = saved
    assert METRICS.unconsumed_signals.get("refuse-running-chunk", 0) >= 1
    assert rm._fdsched_plans.current() is None and rm._fdsched_plans.pending() == ()
    assert any("ghost" in r.getMessage() and "not consumed" in r.getMessage() for r in caplog.records)
    assert rm.cache_manager.can_allocate_gpu_blocks(1), "a dropped refusal refuses nothing later"


@pytest.mark.parametrize("profile,scene", [
    ("recommended", "guard"), ("adaptive", "guard"), ("baseline", "chunk-short"), ("recommended", "chunk-short"),
])
def test_the_pass_stores_nothing_of_the_plugins_in_the_cache_managers_dict(rm_with, profile, scene):
    """What the cache manager's block check consults is the pass object, handed over when the scheduler was
    built: no attribute of the plugin's is added to (or replaced in) the cache manager's __dict__ while a pass
    runs, through refusals, counted thresholds and (off on the new host) the plugin's own preemptions."""
    rm = rm_with(profile)
    if scene == "guard":
        _guard_scene(rm)
    else:
        _chunk_short_of_blocks_scene(rm, chunk_last=False)
    cm = rm.cache_manager
    real_check = type(cm).can_allocate_gpu_blocks
    seen = []

    def plugins(obj) -> dict:
        return {key: id(value) for key, value in vars(obj).items() if "fdsched" in key}

    def spy(*args, **kwargs):
        seen.append(plugins(cm))  # mid-pass, at every block check
        return real_check(cm, *args, **kwargs)

    cm.can_allocate_gpu_blocks = spy  # on the instance: every self.cache_manager.can_allocate_gpu_blocks finds it
    before = plugins(cm)
    rm.schedule()
    rm.schedule()
    assert seen, "the scene made no block check"
    assert all(during == before for during in seen), "the pass stored something of the plugin's in the cache manager"
    assert plugins(cm) == before

"""One arm's run, step by step: what the runner (:func:`fdsched.replay.runner.run_profile`) hands the driver, and
the loop that feeds arrivals (as each arrives, or as the host's engine fetches them: :func:`engine_fetch_rule`),
runs one engine step (:class:`fdsched.replay.driver.Driver`), records the step's row and each request's figures,
checks the block accounting and request bookkeeping (:mod:`fdsched.replay.invariants`) and stops when the run has
drained, stalled or reached ``max_steps``.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from fdsched.patches._blocks import cache_held_blocks, request_held_blocks
from fdsched.replay.costmodel import prefill_context_tokens, row_step_ms
from fdsched.replay.figures import ProfileRun, StepRow
from fdsched.replay.invariants import check_blocks, check_requests
from fdsched.replay.trace import Trace

__all__ = ["DriveInputs", "drive", "engine_fetch_rule", "FETCH_ALL", "FETCH_ONE_WHEN_EMPTY",
           "FETCH_WHILE_SLOTS"]

# replay.fetch, as the driver applies it (engine_fetch_rule): every arrival at once, or a host engine's rule.
FETCH_ALL, FETCH_ONE_WHEN_EMPTY, FETCH_WHILE_SLOTS = "all", "one-when-empty", "while-slots"


class _CountingPool(list):
    """The prefix cache's node-id pool; every eviction of a GPU node returns its id here."""

    returned = 0

    def append(self, value):  # noqa: D401 - list API
        self.returned += 1
        super().append(value)


@dataclass(frozen=True)
class DriveInputs:
    """What one arm's run is fixed to before its first step (set by :func:`run_profile`).

    ``outputs``: request id -> tokens it produces on this node; ``role``: the engine's
    ``splitwise_role``; ``check_every``: run the block invariants every N steps (0: only once, when the run drains);
    ``progress``: called after each step with the number of requests finished so far (or None);
    ``cost``: the step-cost model that moves the modelled clock; ``policies``: the installed plugin's
    :class:`fdsched.core.hooks.Policies` (the driver's decode test).
    """

    trace: Trace
    manager: object
    outputs: dict
    role: str
    max_steps: int
    stall_steps: int
    check_every: int
    progress: Optional[Callable[[int], None]]
    cost: object
    policies: object
    fetch: str = FETCH_ALL  # how arrivals reach the waiting queue (:func:`engine_fetch_rule`)


@dataclass
class _DriveState:
    """Where a run stands between two steps (owned by :func:`_drive`, changed by its helpers).

    ``feed``: the trace's requests in feed order, ``next_index`` the first not fed yet;
    ``arrival_ms``: their arrival on the modelled clock (time-based traces; None otherwise);
    ``p_queue``: on a prefill node, requests made but not admitted by ``preallocate_resource_in_p`` yet;
    ``objects``: request id -> the host ``Request`` the replay made; ``rows``: request id -> its report row;
    ``finish_counts`` / ``finished_once``: how often each request finished, and how many finished at least
    once; ``quiet``: consecutive steps in which nothing happened (the stall counter); ``evicted_before``:
    the cache's evictions counted up to the previous step; ``now_ms``: modelled time at the start of the step.
    """

    driver: object
    cache: object
    pool: _CountingPool
    rows: dict
    feed: list
    arrival_ms: Optional[list]
    objects: dict = field(default_factory=dict)
    finish_counts: Counter = field(default_factory=Counter)
    finished_once: int = 0
    p_queue: deque = field(default_factory=deque)
    m_queue: deque = field(default_factory=deque)  # replay.fetch engine: arrived, not yet handed to the scheduler
    next_index: int = 0
    quiet: int = 0
    evicted_before: int = 0
    now_ms: float = 0.0

    @property
    def timed(self) -> bool:
        return self.arrival_ms is not None

    def all_fed(self) -> bool:
        """Every request of the trace was made, and (prefill node) admitted."""
        return self.next_index == len(self.feed) and not self.p_queue and not self.m_queue

    def remaining(self) -> int:
        """Requests that have not finished yet."""
        return len(self.feed) - self.finished_once


def drive(run: ProfileRun, inputs: DriveInputs) -> None:
    """Step the scheduler until every request has finished, the run stalls, or ``max_steps`` is reached;
    each step's row goes into ``run.steps``, each request's figures into ``run.requests``, and
    ``run.drained`` / ``run.stop_reason`` / ``run.stall`` / ``run.request_violations`` say how it ended."""
    state = _start_drive(run, inputs)
    for step in range(inputs.max_steps):
        if _one_step(run, inputs, state, step):
            break
    else:
        run.stop_reason = f"max_steps={inputs.max_steps} reached"
    _finish_drive(run, inputs, state)


def _start_drive(run: ProfileRun, inputs: DriveInputs) -> _DriveState:
    """The driver around the manager, and the prefix cache's node pool swapped for one that counts evictions."""
    from fdsched.replay.driver import Driver

    driver = Driver(inputs.manager, output_lengths=dict(inputs.outputs), policies=inputs.policies)
    cache = inputs.manager.cache_manager
    pool = _CountingPool(cache.node_id_pool)
    cache.node_id_pool = pool
    feed = inputs.trace.in_feed_order()
    arrival_ms = [r.arrival_s * 1000.0 for r in feed] if inputs.trace.time_based else None
    return _DriveState(driver=driver, cache=cache, pool=pool, rows={row.id: row for row in run.requests}, feed=feed,
                       arrival_ms=arrival_ms)


def _one_step(run: ProfileRun, inputs: DriveInputs, state: _DriveState, step: int) -> bool:
    """Feed what has arrived, run one engine step and record it. True when the run ends here
    (drained or stalled)."""
    step_cpu = time.thread_time()
    gap = _skip_to_next_arrival(state)
    fed = _feed_arrivals(inputs, state, step)
    record = state.driver.step()
    row = _step_row(step, record, inputs.manager, state, gap)
    state.now_ms += row_step_ms(inputs.cost, row)
    _record_requests(state, record, step)
    done = _account_blocks(row, inputs, state, step)
    run.steps.append(row)
    if inputs.progress is not None:
        inputs.progress(state.finished_once)
    row.replay_cpu_s = time.thread_time() - step_cpu - record.schedule_cpu_seconds
    if done:
        run.drained = True
        return True
    return _stalled(run, inputs, state, record, fed)


def _skip_to_next_arrival(state: _DriveState) -> float:
    """On a time-based trace, when nothing runs, waits or is queued and the next arrival is later, jump the
    modelled clock to it. Returns the idle time skipped (ms; 0.0 when none)."""
    i = state.next_index
    if (state.timed and i < len(state.feed) and not state.p_queue and not state.m_queue and state.driver.idle()
            and state.arrival_ms[i] > state.now_ms):
        gap = state.arrival_ms[i] - state.now_ms
        state.now_ms = state.arrival_ms[i]
        return gap
    return 0.0


def _arrived(state: _DriveState, step: int) -> bool:
    """Whether the next request in feed order is due at this step (by modelled time, or by step number)."""
    if state.timed:
        return state.arrival_ms[state.next_index] <= state.now_ms
    return state.feed[state.next_index].arrival <= step


def _feed_arrivals(inputs: DriveInputs, state: _DriveState, step: int) -> int:
    """Make a host request for every request due now and hand it to the scheduler: ``add_request`` on a
    mixed node (with ``replay.fetch: engine``, as the host's engine hands them over: :func:`_engine_fetch`); on a
    prefill node, queue it and admit from the queue's head, first come first served, until a preallocation fails
    (the rest wait for the next step). A timed trace's request carries its arrival on the modelled clock
    (``metrics.arrival_time``, seconds). Returns how many were handed over."""
    from fdsched.replay.engine import make_request

    fed = 0
    while state.next_index < len(state.feed) and _arrived(state, step):
        tr = state.feed[state.next_index]
        request = make_request(tr.id, tr.prompt_tokens(), tr.max_tokens)
        if state.timed:
            request.metrics.arrival_time = state.arrival_ms[state.next_index] / 1000.0
        state.objects[tr.id] = request
        if inputs.role == "prefill":
            state.p_queue.append(request)
        elif inputs.fetch == FETCH_ALL:
            state.driver.add(request, inputs.outputs[tr.id])
            fed += 1
        else:
            state.m_queue.append(request)
        state.next_index += 1
    if state.m_queue:
        fed += _engine_fetch(inputs, state)
    p_queue = state.p_queue
    while p_queue and state.driver.add_in_p(p_queue[0], inputs.outputs[p_queue[0].request_id]):
        p_queue.popleft()
        fed += 1
    return fed


def engine_fetch_rule(fetch: str, role: str) -> str:
    """``replay.fetch`` as this host's engine hands requests to a mixed node's scheduler.

    * With the prepare mixin (d38eeb8: ``fastdeploy/engine/common_engine_prepare_mixin.py``, ``_fetch_request_mixed``): a fetch
      thread asks the request scheduler only while ``resource_manager.waiting`` is empty, for ``min(free batch
      slots, MAX_PREFILL_NUM)`` requests, and the request scheduler (``LocalScheduler.get_requests``, chunked
      prefill with ``max_num_partial_prefills`` 1) returns one: one request per step, when the queue is empty.
    * Without it (e7c8dc2: ``common_engine.py``, ``_fetch_request`` in ``_schedule_request_to_worker_v1``): a fetch
      runs whenever the previous one ended, whatever the waiting queue holds; between two engine steps it hands
      over every arrived request while a batch slot is free (``resource_manager.available_batch()`` > 0).
    """
    if fetch == FETCH_ALL or role != "mixed":
        return FETCH_ALL
    import importlib.util

    has_prepare_mixin = importlib.util.find_spec("fastdeploy.engine.common_engine_prepare_mixin") is not None
    return FETCH_ONE_WHEN_EMPTY if has_prepare_mixin else FETCH_WHILE_SLOTS


def _engine_fetch(inputs: DriveInputs, state: _DriveState) -> int:
    """Hand queued arrivals to the scheduler by the host engine's rule (:func:`engine_fetch_rule`)."""
    manager = inputs.manager
    if inputs.fetch == FETCH_ONE_WHEN_EMPTY:
        count = 1 if not manager.waiting and int(manager.available_batch()) > 0 else 0
    else:
        count = len(state.m_queue) if int(manager.available_batch()) > 0 else 0
    for _ in range(count):
        request = state.m_queue.popleft()
        state.driver.add(request, inputs.outputs[request.request_id])
    return count


def _host_hit(request) -> int:
    metrics = getattr(request, "metrics", None)
    value = getattr(metrics, "gpu_cache_token_num", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def _step_row(step: int, record, manager, state: _DriveState, gap: float) -> StepRow:
    """The step's row from the driver's record (the block figures are added by :func:`_account_blocks`)."""
    row = StepRow(
        step=step,
        prefill_tokens=record.scheduled_prefill_tokens,
        decode_tokens=record.decode_tokens,
        first_tokens=len(record.first_tokens),
        preempted=[(rid, phase) for rid, phase in record.preempted],
        finished=len(record.finished),
        running=record.running,
        waiting=record.waiting + len(manager.to_be_rescheduled_request_id_set) + len(state.p_queue),
        blocks_used=record.blocks_used,
        schedule_cpu_s=record.schedule_cpu_seconds,
        schedule_wall_s=record.schedule_seconds,
        gap_ms=gap,
    )
    _set_step_context(row, record)
    return row


def _record_requests(state: _DriveState, record, step: int) -> None:
    """Add the step's events to each request's row: prefill chunks (and, at the first, where it started
    and the host's cache hit), tokens produced, first token, preemptions, finishes."""
    rows = state.rows
    for rid, start, end in record.prefill_chunks:
        r = rows[rid]
        r.prefill_tokens += end - start
        if r.first_chunk_start is None:
            r.first_chunk_start = start
            r.cache_hit_tokens = _host_hit(state.objects[rid])
    for rid in record.produced:
        rows[rid].token_steps.append(step)
    for rid in record.first_tokens:
        if rows[rid].first_token_step is None:
            rows[rid].first_token_step = step
    for rid, _ in record.preempted:
        rows[rid].preemptions += 1
    for rid in record.finished:
        state.finish_counts[rid] += 1
        if state.finish_counts[rid] == 1:
            state.finished_once += 1
        rows[rid].finish_count += 1
        rows[rid].finish_step = step
        rows[rid].output_tokens = len(state.objects[rid].output_token_ids)


def _account_blocks(row: StepRow, inputs: DriveInputs, state: _DriveState, step: int) -> bool:
    """Fill the row's blocks held and evicted, and check the block invariants when due (every
    ``check_every`` steps, and at the last). Returns whether the run has drained: everything fed, nothing
    running or waiting, every request finished."""
    cache = state.cache
    held = request_held_blocks(inputs.manager.requests.values())
    row.blocks_held = len({b for ids in held.values() for b in ids})
    row.evicted = state.pool.returned - state.evicted_before
    state.evicted_before = state.pool.returned
    done = state.all_fed() and state.driver.idle() and state.remaining() == 0
    if inputs.check_every and (step % inputs.check_every == 0 or done):
        row.violations = check_blocks(cache.num_gpu_blocks, cache.gpu_free_block_list, held, cache_held_blocks(cache))
    return done


def _stalled(run: ProfileRun, inputs: DriveInputs, state: _DriveState, record, fed: int) -> bool:
    """Count the step as quiet when nothing was fed, scheduled, produced, preempted or finished and no
    request is still to arrive; after ``stall_steps`` quiet steps in a row, record the stall and return True."""
    active = fed or record.scheduled_prefill_tokens or record.decode_tokens or record.first_tokens
    active = active or record.preempted or record.finished
    state.quiet = 0 if (active or state.next_index < len(state.feed)) else state.quiet + 1
    if state.quiet < inputs.stall_steps:
        return False
    remaining = state.remaining()
    run.stall = _stall_detail(inputs.manager, state.p_queue, remaining)
    held_all = run.stall["running_with_all_blocks"]
    run.stop_reason = (
        f"stalled: nothing fed, scheduled, produced or finished for {inputs.stall_steps} steps with "
        f"{remaining} request(s) left (running {run.stall['running']}, of which {held_all} already hold every "
        f"block their prefill needs; waiting {run.stall['waiting']}; not admitted {run.stall['not_admitted']}; "
        f"free blocks {run.stall['free_blocks']})"
    )
    return True


def _finish_drive(run: ProfileRun, inputs: DriveInputs, state: _DriveState) -> None:
    """After the last step: each request's final output count, the block check of a drained run that was
    not checked on the way, and the request bookkeeping checks."""
    manager, cache = inputs.manager, state.cache
    for rid, request in state.objects.items():
        state.rows[rid].output_tokens = len(request.output_token_ids)
    if run.drained and not inputs.check_every:
        run.steps[-1].violations = check_blocks(
            cache.num_gpu_blocks, cache.gpu_free_block_list, request_held_blocks(manager.requests.values()),
            cache_held_blocks(cache)
        )
    run.request_violations = check_requests([r.id for r in inputs.trace.requests], state.finish_counts, run.drained)
    if run.drained and manager.requests:
        run.request_violations.append(f"the scheduler still tracks finished requests: {sorted(manager.requests)[:8]}")


def _set_step_context(row: StepRow, record) -> None:
    """The step's context facts for the cost model (:mod:`fdsched.replay.costmodel`): the tokens its
    decoding requests held, and the tokens its prefill chunks attended to (prefix included)."""
    row.decode_context_tokens = record.decode_context_tokens
    row.prefill_context_tokens = prefill_context_tokens(record.prefill_chunks)


def _stall_detail(manager, p_queue, remaining: int) -> dict:
    """What a stalled scheduler looks like (plain values, for the report)."""
    block_size = manager.config.cache_config.block_size
    running = list(manager.running)
    prefilling = [r for r in running if r.num_computed_tokens < r.need_prefill_tokens]
    preempted = [r for r in manager.waiting if getattr(getattr(r, "status", None), "name", "") == "PREEMPTED"]
    return {
        "remaining": remaining,
        "running": len(running),
        "running_prefilling": len(prefilling),
        "running_with_all_blocks": sum(1 for r in prefilling if len(r.block_tables) * block_size >= r.need_prefill_tokens),
        "waiting": len(manager.waiting),
        # preempted requests back in waiting: the host's admission loop counts them against max_num_seqs
        "waiting_preempted": len(preempted),
        "not_admitted": len(p_queue),
        "free_blocks": len(manager.cache_manager.gpu_free_block_list),
    }

"""Replay a trace through the real host scheduler, once per profile (needs the FastDeploy host).

For each profile (an "arm"): load its settings (:func:`arm_settings`: exactly the profile, unless
``inherit_env`` lets the process environment override it as in production; either way the run
records which variables were applied and which not), install the plugin with them, reset
the plugin's counters, build a fresh ``ResourceManagerV1`` for the trace's engine inside a logical
clock, and step it (:class:`fdsched.replay.engine.Driver`) until every request has finished:

* a request is fed at the start of its arrival step (a time-based trace: at the start of the first
  step that begins at or after its ``arrival_s`` on the modelled clock; when nothing runs or waits,
  the clock jumps to the next arrival): ``add_request`` on a mixed node; on a prefill
  node (``splitwise_role: prefill``) through ``preallocate_resource_in_p`` then
  ``add_request_in_p`` as the prefill node's engine does, first come first served (a request whose
  preallocation fails is retried at the next step, and the ones behind it wait);
* after every step the block accounting and the request bookkeeping are checked
  (:mod:`fdsched.replay.invariants`);
* the run stops early at ``max_steps``, or when it has stalled: ``stall_steps`` consecutive steps
  in which nothing was fed, scheduled, produced, preempted or finished while requests remain and
  no arrival is due (the scheduler's state no longer changes: it is hung).

Everything recorded is a function of the inputs, except the measured timings.
"""

from __future__ import annotations

import os
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from fdsched.core.common import plural
from fdsched.replay.costmodel import check_replay_settings, cost_from_settings, prefill_context_tokens, row_step_ms
from fdsched.replay.figures import ProfileRun, RequestRow, StepRow
from fdsched.patches._blocks import cache_held_blocks, request_held_blocks
from fdsched.replay.invariants import check_blocks, check_requests
from fdsched.replay.peak_arm import PEAK_PLUGIN_NAME, replay_admission_hook
from fdsched.replay.oracle import ORACLE_PLUGIN_NAME, RETRACT_PLUGIN_NAME, Holding, PeakOracle, RetractOrder
from fdsched.replay.trace import Trace, TraceError, check_engine

__all__ = ["unbounded_blocks", "run_profile", "run_replay", "run_dp_arms", "dp_arm_name", "arm_settings", "host_environment", "other_host_env", "node_output_lengths", "cache_held_blocks", "request_held_blocks"]

DEFAULT_MAX_STEPS = 200_000
DEFAULT_STALL_STEPS = 200
# Block invariants: every step for traces up to this many requests, else every AUTO_CHECK_EVERY steps.
AUTO_CHECK_ALL_UP_TO = 2000
AUTO_CHECK_EVERY = 32
# replay.fetch, as the driver applies it (engine_fetch_rule): every arrival at once, or a host engine's rule.
FETCH_ALL, FETCH_ONE_WHEN_EMPTY, FETCH_WHILE_SLOTS = "all", "one-when-empty", "while-slots"


def auto_check_every(requests: int) -> int:
    """How often the block invariants are checked when the caller does not say (always at the end too)."""
    return 1 if requests <= AUTO_CHECK_ALL_UP_TO else AUTO_CHECK_EVERY


def node_output_lengths(trace: Trace, splitwise_role: str) -> dict:
    """Tokens each request produces on this node: its real output, or 1 on a prefill node."""
    if splitwise_role == "prefill":
        return {r.id: 1 for r in trace.requests}
    return {r.id: r.effective_output_len for r in trace.requests}


class _CountingPool(list):
    """The prefix cache's node-id pool; every eviction of a GPU node returns its id here."""

    returned = 0

    def append(self, value):  # noqa: D401 - list API
        self.returned += 1
        super().append(value)


def unbounded_blocks(trace: Trace, engine: dict) -> int:
    """A KV pool that is never the limit: what every request of the trace holds at its largest, all at
    once (prompt, output, the host's decode preallocation and one spare block each), plus the host's minimum; the
    prefix cache may keep every finished request's blocks and still never fill it."""
    from fdsched.replay.trace import min_gpu_blocks

    block_size, ahead = engine["block_size"], engine.get("enc_dec_block_num", 2)
    every = sum(-(-(r.prompt_len + r.effective_output_len) // block_size) + ahead + 1 for r in trace.requests)
    return every + min_gpu_blocks(engine["max_model_len"], block_size)


def _holding(request, true_output: int, block_size: int, blocks_after=None) -> Holding:
    held = len(request.block_tables or []) + len(getattr(request, "extend_block_tables", None) or [])
    generated = len(request.output_token_ids)
    tokens = max(request.need_prefill_tokens, request.prompt_token_ids_len + generated)
    return Holding(request.request_id, held if blocks_after is None else max(held, blocks_after), tokens,
                   max(true_output - generated, 0))


def _peak_oracle(manager_ref: dict, outputs: dict, block_size: int) -> PeakOracle:
    """The clairvoyant bound on a manager built later (``manager_ref["manager"]``): the candidate is the
    request whose new blocks the scheduler counted last (``get_new_block_nums``, called just before the
    admission threshold, for a running chunk and for a waiting request alike)."""

    def snapshot():
        manager = manager_ref["manager"]
        running = [_holding(r, outputs[r.request_id], block_size) for r in manager.running]
        candidate = manager_ref.get("candidate")
        if candidate is not None:
            request, new_tokens = candidate
            after = -(-(request.num_computed_tokens + new_tokens) // block_size)
            candidate = _holding(request, outputs[request.request_id], block_size, blocks_after=after)
        return running, candidate

    def first_running():
        running = manager_ref["manager"].running
        return running[0].request_id if running else None

    return PeakOracle(snapshot, block_size, first_running=first_running)


def _watch_candidate(manager, manager_ref: dict) -> None:
    """Remember the last request ``get_new_block_nums`` was asked about (an instance attribute over the
    class's method; the scheduler's decisions are unchanged)."""
    counted = manager.get_new_block_nums

    def get_new_block_nums(request, num_new_tokens):
        manager_ref["candidate"] = (request, num_new_tokens)
        return counted(request, num_new_tokens)

    manager.get_new_block_nums = get_new_block_nums


def _host_hit(request) -> int:
    metrics = getattr(request, "metrics", None)
    value = getattr(metrics, "gpu_cache_token_num", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def arm_settings(profile: str, inherit_env: bool, environ: Optional[Mapping[str, str]] = None):
    """An arm's settings and the environment variables that touched it.

    By default an arm is exactly its profile: the plugin's variables (``FDSCHED_*`` of the settings
    schema and the host tunables ``FD_*`` it knows) are not applied. With ``inherit_env`` they are,
    as in production. Returns ``(settings, applied, ignored)``: variable -> value dicts.
    """
    from fdsched.core.settings import PROFILE_ENV, SCHEMA, load_settings

    environ = os.environ if environ is None else environ
    names = {s.env for s in SCHEMA if s.env} | {PROFILE_ENV}
    present = {name: environ[name] for name in sorted(names) if name in environ}
    if inherit_env:
        settings = check_replay_settings(load_settings(environ=environ, profile=profile))
        applied = {s.env: environ[s.env] for s in SCHEMA if s.env and settings.sources[s.key] == f"env {s.env}"}
        ignored = {k: v for k, v in present.items() if k not in applied}
    else:
        settings = check_replay_settings(load_settings(environ={}, profile=profile))
        applied, ignored = {}, present
    return settings, applied, ignored


@contextmanager
def host_environment(settings):
    """While an arm runs, the host's own ``FD_*`` variables that the settings schema knows hold the
    arm's effective values (the host reads some of them, e.g. ``FD_USE_NEW_TOKEN_RATIO_RESERVE``, when
    it builds the scheduler), and the plugin's ``FDSCHED_*`` variables are out of the way."""
    from fdsched.core.settings import SCHEMA

    saved = {}
    for setting in SCHEMA:
        name = setting.env
        if not name:
            continue
        saved[name] = os.environ.get(name)
        if name.startswith("FD_"):
            value = settings[setting.key]
            os.environ[name] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        else:
            os.environ.pop(name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def other_host_env(environ: Optional[Mapping[str, str]] = None) -> dict:
    """``FD_*`` variables set in the environment that the settings schema does not know: the host reads
    some of them (e.g. ``FD_DISABLE_CHUNKED_PREFILL``) in every arm alike. Reported, not changed."""
    from fdsched.core.settings import SCHEMA

    environ = os.environ if environ is None else environ
    known = {s.env for s in SCHEMA if s.env} | {"FD_LOG_DIR", "FD_PLUGINS"}
    return {k: environ[k] for k in sorted(environ) if k.startswith("FD_") and k not in known}


def run_profile(
    trace: Trace,
    profile: str,
    engine: dict,
    cost_overrides: Optional[dict] = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    stall_steps: int = DEFAULT_STALL_STEPS,
    check_every_step: bool = True,
    progress: Optional[Callable[[int], None]] = None,
    inherit_env: bool = False,
    check_every: Optional[int] = None,
    host_only: bool = False,
) -> ProfileRun:
    """Replay ``trace`` under one profile. Raises HostNotFound, SettingsError, InstallError, TraceError.

    ``host_only``: replay FastDeploy's own classes (the plugin's install is undone before the scheduler is built;
    ``profile`` then only gives the host tunables and the replay's keys).

    ``check_every``: run the block invariants every N steps (and always at the last step); 1 checks
    every step; None: :func:`auto_check_every`. ``check_every_step=False`` checks only at the end.
    """
    from fdsched.install.probe import find_host
    from fdsched.install.installer import install
    from fdsched.core.metrics import METRICS

    from fdsched.replay.engine import EngineShape, build_manager, close_manager, logical_clock, prepare_host_environment

    check_engine(trace, engine)
    prepare_host_environment()
    find_host()
    settings, env_applied, env_ignored = arm_settings(profile, inherit_env)
    report = install(settings)
    if host_only:
        from fdsched.install.installer import uninstall

        uninstall()
    cost = cost_from_settings(settings, cost_overrides)
    unbounded = settings["replay.unbounded_memory"]
    if unbounded:
        engine = dict(engine, num_gpu_blocks=max(engine["num_gpu_blocks"], unbounded_blocks(trace, engine)))
    shape = EngineShape(**engine)
    role = shape.splitwise_role
    outputs = node_output_lengths(trace, role)

    run = ProfileRun(profile=profile, num_gpu_blocks=shape.num_gpu_blocks, cost=cost)
    run.decisions = {cid: "host alone" if host_only else d.detail for cid, d in report.decisions.items()}
    run.host = {"version": report.host.version, "commit": report.host.commit, "label": report.host.name}
    run.settings = {key: settings[key] for key, *_ in settings.describe()}
    run.environment = {
        "inherit_env": inherit_env,
        "applied": env_applied,
        "not_applied": env_ignored,
        "other_host_variables": other_host_env(),
        "hook_plugins": report.policies.external_plugins(),
    }
    run.requests = [
        RequestRow(r.id, r.arrival, r.prompt_len, outputs[r.id],
                   arrival_ms=None if r.arrival_s is None else r.arrival_s * 1000.0)
        for r in trace.requests
    ]

    reservation = None
    hooks = []
    manager_ref: dict = {}
    if settings["replay.oracle_reserve"]:
        reservation = _peak_oracle(manager_ref, outputs, shape.block_size)
        report.policies.register(reservation, name=ORACLE_PLUGIN_NAME)
    else:
        reservation = replay_admission_hook(settings, trace, shape, manager_ref)  # the replay-only candidates (docs/peak-admission.md)
        if reservation is not None:
            report.policies.register(reservation, name=PEAK_PLUGIN_NAME)
    if settings["replay.retract_order"] == "sglang":

        def lengths(request_id):
            request = manager_ref["manager"].requests.get(request_id)
            return None if request is None else (len(request.output_token_ids), request.prompt_token_ids_len)

        retract = RetractOrder(lengths)
        report.policies.register(retract, name=RETRACT_PLUGIN_NAME)
        hooks.append(retract)
    METRICS.reset()
    started = time.perf_counter()
    every = 0 if not check_every_step else max(1, check_every or auto_check_every(len(trace.requests)))
    if unbounded and check_every is None and every:
        every = max(every, AUTO_CHECK_EVERY)  # the block check is O(pool), and this pool holds the whole trace
    run.check_every = every
    try:
        with host_environment(settings), logical_clock():
            manager = build_manager(shape)
            manager_ref["manager"] = manager
            if getattr(reservation, "watches_candidate", False):  # PeakOracle, PeakAdmissionHook
                _watch_candidate(manager, manager_ref)
            try:
                inputs = _DriveInputs(trace, manager, outputs, role, max_steps, stall_steps, every, progress, cost,
                                      report.policies, engine_fetch_rule(settings["replay.fetch"], role))
                _drive(run, inputs)
            finally:
                close_manager(manager)
    finally:
        if reservation is not None:
            report.policies.unregister(reservation)
        for hook in hooks:
            report.policies.unregister(hook)
        manager_ref.clear()
    if unbounded:
        _check_unbounded(run)
    run.wall_seconds = time.perf_counter() - started
    adaptive_state = getattr(manager, "fdsched_adaptive_state", None)
    if adaptive_state is not None:
        run.estimator = adaptive_state()  # the engine path's estimator (profile adaptive); None when it does not run
    ratio_impl = "host" if host_only else report.decisions["ratio_reserve"].impl
    run.admissions_blocked = None if ratio_impl == "host" else METRICS.admissions_blocked
    return run


def _check_unbounded(run: ProfileRun) -> None:
    """An ``unbounded`` arm whose memory was a limit after all is flagged (an invariant violation)."""
    preempted = sum(len(s.preempted) for s in run.steps)
    peak = max((s.blocks_used for s in run.steps), default=0)
    if preempted or peak >= run.num_gpu_blocks:
        run.request_violations.append(
            f"replay.unbounded_memory: the pool of {run.num_gpu_blocks} blocks was a limit ({plural(preempted, 'preemption')}, "
            f"peak {peak} blocks in use; allowed: no preemption and a pool never full)"
        )


@dataclass(frozen=True)
class _DriveInputs:
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


def _drive(run: ProfileRun, inputs: _DriveInputs) -> None:
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


def _start_drive(run: ProfileRun, inputs: _DriveInputs) -> _DriveState:
    """The driver around the manager, and the prefix cache's node pool swapped for one that counts evictions."""
    from fdsched.replay.engine import Driver

    driver = Driver(inputs.manager, output_lengths=dict(inputs.outputs), policies=inputs.policies)
    cache = inputs.manager.cache_manager
    pool = _CountingPool(cache.node_id_pool)
    cache.node_id_pool = pool
    feed = inputs.trace.in_feed_order()
    arrival_ms = [r.arrival_s * 1000.0 for r in feed] if inputs.trace.time_based else None
    return _DriveState(driver=driver, cache=cache, pool=pool, rows={row.id: row for row in run.requests}, feed=feed,
                       arrival_ms=arrival_ms)


def _one_step(run: ProfileRun, inputs: _DriveInputs, state: _DriveState, step: int) -> bool:
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


def _feed_arrivals(inputs: _DriveInputs, state: _DriveState, step: int) -> int:
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


def _engine_fetch(inputs: _DriveInputs, state: _DriveState) -> int:
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


def _account_blocks(row: StepRow, inputs: _DriveInputs, state: _DriveState, step: int) -> bool:
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


def _stalled(run: ProfileRun, inputs: _DriveInputs, state: _DriveState, record, fed: int) -> bool:
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


def _finish_drive(run: ProfileRun, inputs: _DriveInputs, state: _DriveState) -> None:
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


def run_replay(
    trace: Trace,
    profiles: Sequence[str],
    engine: dict,
    cost_overrides: Optional[dict] = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    stall_steps: int = DEFAULT_STALL_STEPS,
    progress_factory: Optional[Callable] = None,
    inherit_env: bool = False,
    check_every: Optional[int] = None,
) -> list:
    """One :class:`ProfileRun` per profile, in order. ``progress_factory(profile, total)`` may return
    an object with ``update_to(done)`` and ``close()`` (a progress bar)."""
    return [
        _run_with_progress(
            progress_factory, profile, trace, profile, engine, cost_overrides, max_steps, stall_steps, inherit_env,
            check_every,
        )
        for profile in profiles
    ]


def _run_with_progress(
    progress_factory, label, trace, profile, engine, cost_overrides, max_steps, stall_steps, inherit_env, check_every
):
    """:func:`run_profile` with a progress bar named ``label`` (closed however the run ends)."""
    bar = progress_factory(label, len(trace.requests)) if progress_factory else None
    try:
        return run_profile(
            trace,
            profile,
            engine,
            cost_overrides,
            max_steps,
            stall_steps,
            progress=bar.update_to if bar is not None else None,
            inherit_env=inherit_env,
            check_every=check_every,
        )
    finally:
        if bar is not None:
            bar.close()


def dp_arm_name(rank: int, profile: str) -> str:
    """The column of rank ``rank`` running ``profile`` in a ``--dp-arms`` report."""
    return f"dp{rank}:{profile}"


def run_dp_arms(
    trace: Trace,
    arms: dict,
    engine: dict,
    seed: int = 0,
    cost_overrides: Optional[dict] = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    stall_steps: int = DEFAULT_STALL_STEPS,
    progress_factory: Optional[Callable] = None,
    inherit_env: bool = False,
    check_every: Optional[int] = None,
) -> list:
    """Predict an online A/B: one :class:`ProfileRun` per rank of ``arms`` (rank -> profile), each the rank's
    scheduler (its own KV pool of the engine's shape) serving its share of ``trace``
    (:func:`fdsched.replay.trace.split_across_ranks`). Ranks do not interact in the scheduler, so each rank
    runs on its own, one after the other; the runs are named ``dp<rank>:<profile>``."""
    from fdsched.replay.trace import split_across_ranks

    shares = split_across_ranks(trace, list(arms), seed)
    empty = [rank for rank, share in shares.items() if not share.requests]
    if empty:
        raise TraceError(
            f"--dp-arms: rank(s) {empty} get no request of the {len(trace.requests)} in the trace with seed {seed}; "
            "allowed: a longer trace, fewer ranks or another --dp-seed"
        )
    runs = []
    for rank in sorted(arms):
        name = dp_arm_name(rank, arms[rank])
        run = _run_with_progress(
            progress_factory, name, shares[rank], arms[rank], engine, cost_overrides, max_steps, stall_steps,
            inherit_env, check_every,
        )
        run.profile = name
        runs.append(run)
    return runs

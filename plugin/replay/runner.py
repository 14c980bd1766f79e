"""Replay a trace through the real host scheduler, once per profile (needs the FastDeploy host).

For each profile (an "arm"): load its settings (:func:`arm_settings`: exactly the profile, unless
``inherit_env`` lets the process environment override it as in production; either way the run
records which variables were applied and which not), install the plugin with them, reset
the plugin's counters, build a fresh ``ResourceManagerV1`` for the trace's engine inside a logical
clock, and step it (:class:`fdsched.replay.driver.Driver`) until every request has finished:

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
from contextlib import contextmanager
from typing import Callable, Mapping, Optional, Sequence

from fdsched.core.common import plural
from fdsched.replay.costmodel import check_replay_settings, cost_from_settings
from fdsched.replay.drive import DriveInputs, drive, engine_fetch_rule
from fdsched.replay.figures import ProfileRun, RequestRow
from fdsched.replay.peak_arm import PEAK_PLUGIN_NAME, replay_admission_hook
from fdsched.replay.oracle import ORACLE_PLUGIN_NAME, RETRACT_PLUGIN_NAME, Holding, PeakOracle, RetractOrder
from fdsched.replay.trace import Trace, TraceError, check_engine

__all__ = ["unbounded_blocks", "run_profile", "run_replay", "run_dp_arms", "dp_arm_name", "arm_settings", "host_environment", "other_host_env", "node_output_lengths"]

DEFAULT_MAX_STEPS = 200_000
DEFAULT_STALL_STEPS = 200
# Block invariants: every step for traces up to this many requests, else every AUTO_CHECK_EVERY steps.
AUTO_CHECK_ALL_UP_TO = 2000
AUTO_CHECK_EVERY = 32

def auto_check_every(requests: int) -> int:
    """How often the block invariants are checked when the caller does not say (always at the end too)."""
    return 1 if requests <= AUTO_CHECK_ALL_UP_TO else AUTO_CHECK_EVERY


def node_output_lengths(trace: Trace, splitwise_role: str) -> dict:
    """Tokens each request produces on this node: its real output, or 1 on a prefill node."""
    if splitwise_role == "prefill":
        return {r.id: 1 for r in trace.requests}
    return {r.id: r.effective_output_len for r in trace.requests}


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


def arm_settings(profile: str, inherit_env: bool, environ: Optional[Mapping[str, str]] = None):
    """An arm's settings and the environment variables that touched it.

    By default an arm is exactly its profile: the plugin's variables (``FDSCHED_*`` of the settings
    schema and the host tunables ``FD_*`` it knows) are not applied. With ``inherit_env`` they are,
    as in production. Returns ``(settings, applied, ignored)``: variable -> value dicts.
    """
    from fdsched.core.settings import SCHEMA
    from fdsched.core.settings import PROFILE_ENV, load_settings

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
    from fdsched.core.metrics import METRICS

    from fdsched.replay.engine import EngineShape

    settings, env_applied, env_ignored, report = _install_arm(trace, engine, profile, inherit_env, host_only)
    cost = cost_from_settings(settings, cost_overrides)
    unbounded = settings["replay.unbounded_memory"]
    if unbounded:
        engine = dict(engine, num_gpu_blocks=max(engine["num_gpu_blocks"], unbounded_blocks(trace, engine)))
    shape = EngineShape(**engine)
    outputs = node_output_lengths(trace, shape.splitwise_role)
    run = _new_run(profile, shape, cost, settings, report, host_only, (inherit_env, env_applied, env_ignored), trace,
                   outputs)

    manager_ref: dict = {}
    hooks = _register_replay_hooks(settings, trace, shape, outputs, report.policies, manager_ref)
    METRICS.reset()
    started = time.perf_counter()
    run.check_every = every = _check_interval(check_every_step, check_every, len(trace.requests), unbounded)

    def inputs_for(manager) -> DriveInputs:
        role = shape.splitwise_role
        return DriveInputs(trace, manager, outputs, role, max_steps, stall_steps, every, progress, cost,
                           report.policies, engine_fetch_rule(settings["replay.fetch"], role))

    try:
        manager = _build_and_drive(run, settings, shape, inputs_for, manager_ref, hooks)
    finally:
        for hook in hooks:
            report.policies.unregister(hook)
        manager_ref.clear()
    if unbounded:
        _check_unbounded(run)
    run.wall_seconds = time.perf_counter() - started
    _record_plugin_state(run, manager, report, host_only)
    return run


def _install_arm(trace: Trace, engine: dict, profile: str, inherit_env: bool, host_only: bool) -> tuple:
    """Check the trace against the engine, find the host, load the arm's settings (:func:`arm_settings`) and
    install the plugin with them, undone again with ``host_only``: (settings, variables applied, variables not
    applied, the install's report)."""
    from fdsched.install.installer import install
    from fdsched.install.probe import find_host

    from fdsched.replay.engine import prepare_host_environment

    check_engine(trace, engine)
    prepare_host_environment()
    find_host()
    settings, env_applied, env_ignored = arm_settings(profile, inherit_env)
    report = install(settings)
    if host_only:
        from fdsched.install.installer import uninstall

        uninstall()
    return settings, env_applied, env_ignored, report


def _record_plugin_state(run: ProfileRun, manager, report, host_only: bool) -> None:
    """What the plugin's own state says after the run: the adaptive estimator's (profile adaptive; None when it
    does not run) and the admissions the ratio reservation refused (None where the host's code decided)."""
    from fdsched.core.metrics import METRICS

    reservation = manager.fdsched_strategy("ratio_reserve") if hasattr(manager, "fdsched_strategy") else None
    adaptive_state = getattr(reservation, "adaptive_state", None)
    if adaptive_state is not None:
        run.estimator = adaptive_state()  # the engine path's estimator (profile adaptive); None when it does not run
    ratio_impl = "host" if host_only else report.decisions["ratio_reserve"].impl
    run.admissions_blocked = None if ratio_impl == "host" else METRICS.admissions_blocked


def _check_interval(check_every_step: bool, check_every: Optional[int], requests: int, unbounded: bool) -> int:
    """Every how many steps the block invariants run (0: only at the end); see :func:`run_profile`."""
    every = 0 if not check_every_step else max(1, check_every or auto_check_every(requests))
    if unbounded and check_every is None and every:
        every = max(every, AUTO_CHECK_EVERY)  # the block check is O(pool), and this pool holds the whole trace
    return every


def _new_run(profile: str, shape, cost, settings, report, host_only: bool, environment: tuple, trace: Trace,
             outputs: dict) -> ProfileRun:
    """The arm's record before it runs: what the install decided, the host, the settings, the environment
    (``(inherit_env, applied, not applied)``) and the requests."""
    inherit_env, env_applied, env_ignored = environment
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
    return run


def _register_replay_hooks(settings, trace: Trace, shape, outputs: dict, policies, manager_ref: dict) -> list:
    """Register the replay-only hooks the arm's settings ask for, in order: the peak oracle or a replay admission
    candidate (docs/peak-admission.md), then SGLang's retract order. They read the scheduler through
    ``manager_ref["manager"]`` once it is built; the caller unregisters them, in the same order."""
    hooks = []
    if settings["replay.oracle_reserve"]:
        reservation = _peak_oracle(manager_ref, outputs, shape.block_size)
        policies.register(reservation, name=ORACLE_PLUGIN_NAME)
        hooks.append(reservation)
    else:
        reservation = replay_admission_hook(settings, trace, shape, manager_ref)
        if reservation is not None:
            policies.register(reservation, name=PEAK_PLUGIN_NAME)
            hooks.append(reservation)
    if settings["replay.retract_order"] == "sglang":

        def lengths(request_id):
            request = manager_ref["manager"].requests.get(request_id)
            return None if request is None else (len(request.output_token_ids), request.prompt_token_ids_len)

        retract = RetractOrder(lengths)
        policies.register(retract, name=RETRACT_PLUGIN_NAME)
        hooks.append(retract)
    return hooks


def _build_and_drive(run: ProfileRun, settings, shape, inputs_for: Callable, manager_ref: dict, hooks: list):
    """Build the arm's scheduler inside its host environment and a logical clock, drive the run through it
    (``inputs_for(manager)``: what :func:`drive` is given) into ``run`` and close it; returns the (closed) scheduler."""
    from fdsched.replay.engine import build_manager, close_manager, logical_clock

    with host_environment(settings), logical_clock():
        manager = build_manager(shape)
        manager_ref["manager"] = manager
        if any(getattr(hook, "watches_candidate", False) for hook in hooks):  # PeakOracle, PeakAdmissionHook
            _watch_candidate(manager, manager_ref)
        try:
            drive(run, inputs_for(manager))
        finally:
            close_manager(manager)
    return manager


def _check_unbounded(run: ProfileRun) -> None:
    """An ``unbounded`` arm whose memory was a limit after all is flagged (an invariant violation)."""
    preempted = sum(len(s.preempted) for s in run.steps)
    peak = max((s.blocks_used for s in run.steps), default=0)
    if preempted or peak >= run.num_gpu_blocks:
        run.request_violations.append(
            f"replay.unbounded_memory: the pool of {run.num_gpu_blocks} blocks was a limit ({plural(preempted, 'preemption')}, "
            f"peak {peak} blocks in use; allowed: no preemption and a pool never full)"
        )


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

"""Host fix — a preempted request resumes on the seat it holds: the admission loop never locks every seat for good.

Replaces:  no host method; a step after the ``schedule()`` passes: after a pass that scheduled nothing while every seat
           is held by preempted requests and nothing runs, the first of them resumes on its own seat and the pass runs
           again
Why:       FastDeploy's admission loop counts the preempted requests waiting to resume against ``max_num_seqs`` before
           it admits anything, those requests included (slot accounting, PR 7141 / 7181). Once ``max_num_seqs``
           requests sit preempted with nothing running, every pass stops at that first check: no request is admitted
           again while blocks are free, and nothing runs that could finish and free a seat. The smallest case: one seat,
           one request that preempts itself near ``max_model_len`` on the smallest pool.
Upstream:  none: a defect of FastDeploy's own admission loop (the 2.6 commits with PR 7181, develop), not proposed
           upstream yet. The upstream fix is one condition: a preempted request at the head of the queue already holds
           a seat, so the check should not ask it for another.
Needs it:  the lines whose admission loop counts preempted requests in the waiting queue (2.6 with PR 7181, develop),
           read from ``schedule``'s code. A line without that count (2.2, 2.4, 2.5) does not need it.
Switch:    FDSCHED_PREEMPTED_SEAT_RESUME / changes.preempted_seat_resume = auto | on | off. ``auto`` applies it
           where the loop counts them; ``off`` keeps FastDeploy's own loop, to reproduce the stall. A profile's
           ``changes.others`` does not set it.
Delete:    when FastDeploy's admission loop lets a preempted request at the head of the queue resume on its own seat,
           on every supported line.
Relies on: (probed at install: ``on`` fails naming it; ``auto`` skips)
  * running-prefill-chunks: ``schedule()`` gives a running request whose prefill is not finished its next chunk
    (``_get_num_new_tokens``, ``get_new_block_nums``), and ``get_prefix_cached_blocks`` matches a request's tokens
    against the prefix cache and records the match.

How: the host's pass runs first, unchanged. When it scheduled nothing and the scheduler is locked (nothing running,
nothing waiting for a preemption or an abort to be acknowledged, the request at the head of the waiting queue
preempted, and the preempted requests in the queue at least ``max_num_seqs``), the fix, holding the scheduler's
lock, does for that one request what the host's resume path does before it allocates (the tokens to recompute are
all it holds; the prefix cache is matched and recorded) and moves it from the waiting queue to the running list with
the host's running-prefill status. It held a seat and still holds exactly one, so no request enters running without
a seat. The host's pass then runs once more and schedules its prefill chunks as for any running request. The others
resume as seats free, through the host's own loop. Each time it acts it logs one warning line and counts
``fdsched_guard_events_total{event="seats_resumed"}``.

What else stalls, and KV blocks with two owners, the scheduler guard watches (:mod:`fdsched.patches._guard`, in
every scheduler while the plugin is loaded).
"""

from __future__ import annotations

import sys

from fdsched.core.metrics import METRICS
from fdsched.patches._guard import nothing_scheduled
from fdsched.patches._spec import PatchSpec, Reliance
from fdsched.patches._base import code_names, code_objects, host_global, node_role

RM = "fastdeploy.engine.sched.resource_manager_v1"


def seats_locked(running: int, in_flight: int, waiting, preempted, seats: int) -> bool:
    """The state the host's admission loop never leaves by itself: nothing running or in flight, the head of the
    ``waiting`` queue ``preempted`` (a status), and the preempted requests waiting at least ``seats``. The queue is
    walked only when every other term holds: a pass that left something running (most) reads nothing of it."""
    return (running == 0 and in_flight == 0 and bool(waiting) and waiting[0].status == preempted
            and sum(1 for r in waiting if r.status == preempted) >= seats)


class SeatResume:
    """The fix, one per scheduler (see :mod:`fdsched.patches._scheduler`): it serves no seam of the host's; it takes
    part in the pass's steps once the passes are done."""

    seams: tuple = ()
    fdsched_attributes = ("running", "waiting", "lock", "to_be_rescheduled_request_id_set", "to_be_aborted_req_id_set",
                          "max_num_seqs", "cache_manager", "config")
    fdsched_calls = {"ResourceManagerV1.get_prefix_cached_blocks": ("request",),
                     "ResourceManagerV1._free_blocks": ("request",)}
    fdsched_globals = {RM: ("llm_logger",)}  # the lines go beside the scheduler's own

    def __init__(self, rm, settings, next):
        # the host's resume path matches the prefix cache except on a decode node or without prefix caching: read once
        cache_config = getattr(getattr(rm, "config", None), "cache_config", None)
        self.match_on_resume = bool(getattr(cache_config, "enable_prefix_caching", False)) and node_role(rm) != "decode"

    def after_passes(self, rm, result, run_pass):
        """After a pass that scheduled nothing with the seats locked: the preempted head resumes on its seat and one
        more pass runs (``run_pass``); the result is the second pass's tasks with both passes' error lists. Seats are
        locked only with nothing running: a pass that left something running (almost every one) reads nothing more
        (the count read without the lock only rules out; :meth:`resume_locked_head` decides under it)."""
        if rm.running:
            return result
        if nothing_scheduled(result) and self.resume_locked_head(rm):
            again = run_pass()
            result = (again[0], list(result[1]) + list(again[1])) + tuple(again[2:])
        return result

    def resume_locked_head(self, rm) -> bool:
        """Under the scheduler's lock: move the preempted head of the waiting queue to running when the seats are
        locked; True when it moved."""
        preempted = rm._fdsched_statuses.PREEMPTED
        with rm.lock:
            waiting = rm.waiting
            in_flight = len(rm.to_be_rescheduled_request_id_set) + len(rm.to_be_aborted_req_id_set)
            if not seats_locked(len(rm.running), in_flight, waiting, preempted, rm.max_num_seqs):
                return False
            request = waiting[0]
            if not self.match_prefix(rm, request):
                return False
            waiting.popleft()
            request.status = rm._fdsched_prefill_status
            rm.running.append(request)
        METRICS.guard_event("seats_resumed", of=rm)
        log = host_global(RM, "llm_logger")
        log.warning("fdsched: every seat was held by a preempted request and nothing ran; request %s resumes on the "
                    "seat it holds (host fix preempted_seat_resume)", request.request_id)
        return True

    def match_prefix(self, rm, request) -> bool:
        """What the host's resume path does before it allocates: the request recomputes every token it holds, matched
        against the prefix cache first (a failed match frees what it took, and the request stays waiting)."""
        request.need_prefill_tokens = request.num_total_tokens
        if not self.match_on_resume:
            return True
        cache_config = rm.config.cache_config
        if rm.cache_manager.num_cpu_blocks > 0 or getattr(cache_config, "kvcache_storage_backend", None):
            needed = -(-request.need_prefill_tokens // cache_config.block_size)
            if not rm.cache_manager.can_allocate_gpu_blocks(needed):
                return False  # as the host: a match that swaps in from the CPU tier needs room first
        if rm.get_prefix_cached_blocks(request):
            return True
        rm._free_blocks(request)
        return False


def _no_preempted_seat_count(info) -> bool:
    """Whether the host's admission loop leaves preempted requests out of its seat count (the lines before PR 7141's
    slot accounting: 2.2, 2.4, 2.5): then the seats cannot lock this way and the fix is not needed. Read from
    ``schedule``'s code: the count is a comprehension over the waiting queue that reads each request's ``status``
    against ``PREEMPTED`` (a nested code object; Python 3.12 inlines comprehensions, so there ``schedule`` itself
    naming ``sum``, ``PREEMPTED`` and ``max_num_seqs`` counts). Anything unclear reads as counted: the fix applies,
    and where the state never arises it never acts."""
    codes = code_objects(getattr(info.rm_class, "schedule", None))
    if not codes:
        return False
    code, nested = codes[0], codes[1:]
    if any({"status", "PREEMPTED"} <= set(inner.co_names) for inner in nested):
        return False
    return not (sys.version_info >= (3, 12) and {"sum", "PREEMPTED", "max_num_seqs"} <= set(code.co_names))


def _running_prefill_chunks(info):
    schedule = getattr(info.rm_class, "schedule", None)
    missing = {"_get_num_new_tokens", "get_new_block_nums", "get_prefix_cached_blocks", "waiting", "running"} - (
        code_names(schedule) if schedule else set())
    if missing:
        return f"ResourceManagerV1.schedule no longer uses {', '.join(sorted(missing))}"
    if getattr(getattr(info, "request_status", None), "PREEMPTED", None) is None:
        return "RequestStatus has no PREEMPTED"
    return None


SPEC = PatchSpec(
    change_id="preempted_seat_resume",
    title="A preempted request resumes on the seat it holds",
    upstream_prs=(),
    upstream_state="none",
    replaces=(),
    why=(
        "The admission loop counts preempted requests waiting to resume against max_num_seqs before admitting any, "
        "those included: once max_num_seqs requests sit preempted and nothing runs, nothing is admitted again."
    ),
    how="After a pass that scheduled nothing in that state, the first preempted request moves to running on its own "
        "seat (its prefix matched as the host's resume path does) and the pass runs again.",
    hosts_needing="lines that count preempted requests against max_num_seqs (2.6 with PR 7181, develop)",
    switch="FDSCHED_PREEMPTED_SEAT_RESUME",
    delete_when="FastDeploy lets a preempted request at the head of the queue resume on its own seat",
    strategies={"ResourceManagerV1": {"plugin": SeatResume, "host": None, "off": None}},
    host_has=_no_preempted_seat_count,
    relies_on=(
        Reliance(
            "running-prefill-chunks",
            "schedule() gives a running request's unfinished prefill its next chunk; get_prefix_cached_blocks matches "
            "and records a request's prefix",
            _running_prefill_chunks,
            when=("plugin",),
        ),
    ),
)

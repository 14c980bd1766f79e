"""Change 3 — new_token_ratio-based KV reservation, with the chunked-prefill guard.

Replaces:  ResourceManagerV1.__init__ (state), ResourceManagerV1.schedule (wrapper: the pass's state; decay
           after a pass that scheduled something), ResourceManagerV1.get_new_block_nums (the running chunk:
           old-host guard, or the pre-change preemption under ``off`` on the new host),
           ResourceManagerV1._get_can_schedule_prefill_threshold_block (the threshold),
           ResourceManagerV1._get_running_request_reserve_blocks (new host's seam: one request's reserve),
           ResourceManagerV1._reset_reserve_on_preemption (new host's seam: re-estimate after a preemption),
           ResourceManagerV1._trigger_preempt (wrapper: old host's reservation resets, the guard's decline),
           ResourceManagerV1.finish_requests (adaptive estimator: a finished request is a sample),
           PrefixCacheManager.can_allocate_gpu_blocks (the host's block check: keyed refusal, refusal count).
Why:       the host reserves a fixed 16 blocks per running request after a preemption, decaying to
           nothing, whatever each request still has to generate; admission is either too greedy
           (preemption storms) or too timid.
Upstream:  PR 7444, 2.6 cherry-pick 7783 (merged; in the "new host" d38eeb8).
Needs it:  FastDeploy 2.6 before 7783 (the "old host" e7c8dc2).
Switch:    FDSCHED_RATIO_RESERVE / changes.ratio_reserve = auto | on | off, with the host's own
           FD_USE_NEW_TOKEN_RATIO_RESERVE, FD_INIT/MIN_NEW_TOKEN_RATIO, FD_NEW_TOKEN_RATIO_DECAY,
           FD_CLIP_MAX_NEW_TOKENS and the fixed-block FD_RESERVE_*_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL;
           plugin tunables FDSCHED_RATIO_REESTIMATE_EXTRA_BLOCKS (16) and _CAP (init).
           FDSCHED_RESERVE_ESTIMATOR = ratio (upstream's formula) | adaptive (beyond upstream, below), with
           FDSCHED_ADAPTIVE_MIN_SAMPLES / _WINDOW / _MARGIN_K. ``adaptive`` makes ``auto`` apply the
           plugin's version on the new host too (the host has only the ratio formula).
           ``off`` on a host that has the change restores the fixed-block policy, including the
           old host's raw block check for a running chunked prefill.
Delete:    when every supported host carries 7783 and exposes the re-estimate term and cap.
Relies on: (each probed at install: ``on``, or ``off`` on the new host, fails naming it; ``auto`` skips)
  * running-chunk-check: the running pass checks a running chunk with ``cache_manager.can_allocate_gpu_blocks(n)``
    (new host: ``n = _get_can_schedule_prefill_threshold_block(...)``), right after ``n`` blocks came from
    ``get_new_block_nums``; on the old host a failed check calls ``_trigger_preempt(request, n, preempted_reqs,
    scheduled_reqs)`` and the waiting pass runs only when ``preempted_reqs`` is empty.
  * pass-end: (new host, ``off``) ``schedule()`` holds ``self.lock`` for the whole pass and returns the pass's task
    list; its waiting pass starts with a truth test of ``self.waiting`` and nothing before it in the pass reads the
    queue (every other reader of the queue, in the host and the engine, asks its ``len``).
  * threshold-check: every caller of ``_get_can_schedule_prefill_threshold_block`` checks its result with
    ``cache_manager.can_allocate_gpu_blocks`` next (the refusal count).
  * finish-seam: (adaptive estimator) every request the engine finishes goes through ``finish_requests``
    (``finish_requests_async`` submits it to a pool), which finds it in ``self.requests``, still with its
    running status, and takes it out of ``running``; a preempted request is not running.

How: one admission budget per ``schedule()`` pass (:class:`fdsched.core.admission.AdmissionBudget`), with
this arm's reservation strategy behind it. The ``schedule`` wrapper opens the pass, which makes the budget at
its first need; every admission asks it at the host's threshold seam ``_get_can_schedule_prefill_threshold_block``
(a prefill, new or the next chunk of a running one, is admitted only when free blocks cover its chunk plus what
the running set keeps free); the wrapper closes it when the pass ends and then tells the strategy whether the
pass scheduled something.
The arm's class holds the mixin for its impl, host version and estimator (``SPEC.variants``), chosen
once when the class is built; no method asks which impl it runs. One module of this package per implementation:

==============================  ==================================================================================
impl (host)                     module: mixin, strategy
==============================  ==================================================================================
host (either)                   ``host``: ``HostReserveMixin`` (a host that keeps the fixed-block reset in its
                                preemption loop: ``HostReserveOldHostMixin``): the host's own code, fed the
                                profile's values
plugin, ratio (new / old)       ``ratio``: ``RatioReserveMixin`` / ``RatioReserveOldHostMixin``:
                                :class:`~fdsched.core.admission.RatioStrategy`
plugin, adaptive (new / old)    ``adaptive``: ``AdaptiveReserveMixin`` / ``AdaptiveReserveOldHostMixin``:
                                :class:`~fdsched.core.admission.AdaptiveStrategy`
off (new host only)             ``off``: ``PreChangeReserveMixin``: :class:`~fdsched.core.admission.FixedBlockStrategy`
                                and the pre-change running pass
(shared by plugin and off)      ``budget``: the pass's admission budget, the host-shape adapters (new host's seams,
                                old host's guard); ``reader``: what the budget reads of the running requests;
                                ``cache``: the cache manager's block check
==============================  ==================================================================================

Upstream's formula keeps ``ceil(min(max_tokens - generated, clip) * ratio / block_size)`` blocks per running
request (hook ``fdsched_estimate_reserve_blocks``; the new host's per-request seam
``_get_running_request_reserve_blocks`` answers the same for one request asked alone). The ratio starts at
init, decays after each pass that scheduled something, and is re-estimated after a preemption (the new host's
``_reset_reserve_on_preemption`` seam; on the old host at the end of a ``_trigger_preempt`` call that
preempted). A running chunked prefill that fails the threshold stops the running pass and blocks waiting
requests for the step. On the new host that stop is the host's own code; on the old host the plugin gets the
same effect through the host's own control flow: ``get_new_block_nums`` asks the budget for the chunk and,
refused, records that one decision in the pass object; the cache manager's check of exactly that chunk's blocks
reads it there and answers False (evicting nothing), and ``_trigger_preempt`` reads it there too and declines
for that request without preempting, putting it into the pass's ``preempted_reqs`` (the host skips its waiting
pass when that list is not empty).

``off`` on the new host restores the pre-change running pass too: a running chunk short of blocks
preempts instead of waiting. The plugin preempts (``_trigger_preempt``) into lists of its own, kept in the
pass's budget, and closes admission for the rest of that pass (the pre-change pass skips admission after a
preemption): the waiting queue is replaced by a copy that holds every request but reads as empty to the host's
``while self.waiting`` (:func:`admission_closed`). The ``schedule`` wrapper, the host's own seam for the pass,
ends it: under the host's lock it gives the queue its own type back (with every request that arrived meanwhile in
its place) and puts the preempt tasks into the pass's list just before the chunk's own task. Nothing depends on
who called whom: a class between the host's ``schedule()`` and these methods changes nothing. Left as the new
host has it: the token budget that 7783 pre-deducts for decoding requests at the start of a pass.

The pass object (:class:`fdsched.patches._pass.SchedulePass`) is the scheduler's, one per ``schedule()`` call,
found through the scheduler's desk (thread -> open pass) that the scheduler hands its cache manager once, when it
is built. It holds the budget and what the pass expects of a block check (the refusal of a guarded chunk, the
refusal count of a threshold), keyed to the request the scheduler is deciding on (``get_new_block_nums`` puts it
in focus) and the block count; the cache manager's check asks the pass open on its own thread, so a check by
another thread (the token processor, the transfer receiver, the PD preallocation) finds none and gets the pool's
answer. Nothing of a pass is stored in the cache manager. A threshold asked outside a pass gets a budget of its
own, and its refusal count is a question kept for that thread's next check. An expectation, a guard's decline or a
pre-change running chunk's threshold still pending when the pass closes is dropped, logged and counted in
``fastdeploy:fdsched_unconsumed_signals_total{signal}``.

Beyond upstream: the adaptive estimator (``FDSCHED_RESERVE_ESTIMATOR=adaptive``, profile ``adaptive``;
pure code in :mod:`fdsched.core.adaptive`). Through the same seam, each running request reserves its expected
remaining output ``E[L - g | L > g]`` learned from the engine's own finished requests (samples taken in
the host's ``finish_requests`` seam, before the host forgets the request: its output length and, where
the client bounded it, its ``max_tokens``); one margin, ``k x sqrt(sum of variances)``, covers the running
set: the budget asks the strategy for the whole set at once, ``ceil((sum of means + margin) / block_size)``
(:meth:`fdsched.core.adaptive.AdaptiveReserve.set_reservation`: order-independent, never negative), never more
than upstream's ratio formula gives
the same requests (``k`` defaults to -2: see fdsched.core.adaptive). A preemption raises ``k`` (and resets the
warm-up fallback); a preempted or still-running request is never a sample. Until a kind (bounded /
unbounded) has enough samples it answers with :func:`fdsched.core.adaptive.warmup_reserve_blocks`. A third-party
``fdsched_estimate_reserve_blocks`` hook still answers first, per request (outside the set's margin).

What an admission costs: first a bound. The host's block check compares a threshold with its free list and takes
nothing when the list covers it (every FastDeploy 2.x's; probed when the scheduler is built, else no bound), so every
threshold the free blocks cover gets the same answer. Each running request's most possible reservation (upstream's
formula over its whole budget at the ratio's top, which neither strategy ever exceeds for it) is kept with its other
terms; an ask whose chunk plus that sum is covered is answered with that threshold, the sum read in C and kept from
one pass to the next (:class:`fdsched.core.admission.KeptSum`). An ask the bound settles expects nothing of the check
that follows (it answers True: the free blocks cover it), and the old host's guard takes that answer without the
check. Only an ask the bound does not settle counts, and a
pool short of the last count's figure counts without reading the bound. A count counts the running set once per
pass, at its first such ask, and keeps it as an offset (:class:`fdsched.core.admission.RunningOffset`, as SGLang's
``PrefillAdder`` keeps its running offset); a later
ask adds only the requests appended to the running list since (the pass's admissions), and a preemption, or any
other change of the list, makes the next ask count it afresh. The first ask reads each running request's budget
left (upstream's formula: one loop, no call per request) or its ``(max_tokens, budget, generated)`` key (the
adaptive estimator: a request's terms are kept until a sample arrives or the ratio, clip or fallback moves, a
bucket's tail sums until the next finished request). That first ask stays O(running): every decoding request's
term moves with every token, and the host has no seam where a token lands (the token processor appends to
``output_token_ids`` directly). A third party's estimate hook is asked for every request at every ask. The gauges
are set once, at the pass's end.

Beyond upstream: on a prefill node (``splitwise_role == "prefill"``) running requests reserve nothing:
such a node never decodes, and upstream's reservation there stalls it for good (a chunk that needs no
new block is refused while preallocated requests hold the pool, and the ratio only decays after a pass
that scheduled something). The new host's own code (``auto`` there) still has that stall.
"""

from __future__ import annotations

from fdsched.patches._spec import PatchSpec, Reliance, Variant
from fdsched.patches.ratio_reserve.adaptive import (  # noqa: F401  (the change's classes, by their catalogue path)
    ADAPTIVE_OLD_HOST, AdaptiveReserveMixin, AdaptiveReserveOldHostMixin, AdaptiveReserveRequestArgMixin,
)
from fdsched.patches.ratio_reserve.budget import (  # noqa: F401
    COUNT_REFUSAL, DECLINE_PREEMPTION, REFUSE_RUNNING_CHUNK, RM, THRESHOLD_FOR_RUNNING_CHUNK, ReservationMixin,
    _BudgetedReserve,
)
from fdsched.patches.ratio_reserve.cache import CACHE_SHAPES, RatioReserveCacheMixin, RatioReserveCacheOneArgMixin  # noqa: F401
from fdsched.patches.ratio_reserve.host import HOST_RESERVE_OLD_HOST, HostReserveMixin, HostReserveOldHostMixin  # noqa: F401
from fdsched.patches.ratio_reserve.off import (  # noqa: F401
    PRE_CHANGE_SHAPES, PreChangeReserveBatchMixin, PreChangeReserveMixin, admission_closed,
)
from fdsched.patches.ratio_reserve.ratio import (  # noqa: F401
    RATIO_OLD_HOST, RatioReserveMixin, RatioReserveOldHostMixin, RatioReserveRequestArgMixin,
)


def _plugin_variant(host_has: bool, settings):
    adaptive = settings is not None and settings["tunables.reserve_estimator"] == "adaptive"
    if host_has:
        return AdaptiveReserveMixin if adaptive else RatioReserveMixin
    return ADAPTIVE_OLD_HOST if adaptive else RATIO_OLD_HOST



def _has_ratio_reserve(info) -> bool:
    return hasattr(info.rm_class, "_get_running_request_reserve_blocks") and hasattr(
        info.rm_class, "_reset_reserve_on_preemption"
    )


def _uses(func, names) -> str | None:
    from fdsched.patches._base import code_names

    missing = set(names) - code_names(func)
    return f"{func.__qualname__} no longer uses {', '.join(sorted(missing))}" if missing else None


def _running_chunk_check(info):
    names = {"get_new_block_nums", "can_allocate_gpu_blocks"}
    if _has_ratio_reserve(info):
        names.add("_get_can_schedule_prefill_threshold_block")
    else:  # the old host's guard declines the chunk's preemption call and relies on the pass's two lists
        names |= {"_trigger_preempt", "preempted_reqs", "scheduled_reqs"}
    return _uses(info.rm_class.schedule, names)


def _pass_end(info):
    if not _has_ratio_reserve(info):
        return None  # only off on the new host uses it
    return _uses(info.rm_class.schedule, {"waiting", "lock"})


def _threshold_check(info):
    return _uses(info.rm_class.schedule, {"_get_can_schedule_prefill_threshold_block", "can_allocate_gpu_blocks"})


def _finish_seam(info):
    async_finish = getattr(info.rm_class, "finish_requests_async", None)
    if async_finish is not None:
        problem = _uses(async_finish, {"finish_requests"})
        if problem:
            return problem
    return _uses(info.rm_class.finish_requests, {"requests", "running", "remove"})


def _as_selected(settings, host_has_ratio: bool) -> bool:
    # The new host has upstream's ratio formula, never the adaptive estimator.
    return host_has_ratio and settings["tunables.reserve_estimator"] == "ratio"


SPEC = PatchSpec(
    change_id="ratio_reserve",
    title="new_token_ratio KV reservation and chunked-prefill guard",
    upstream_prs=(7444, 7783),
    upstream_state="merged",
    replaces=(
        "ResourceManagerV1.__init__",
        "ResourceManagerV1.schedule",
        "ResourceManagerV1.get_new_block_nums",
        "ResourceManagerV1._get_can_schedule_prefill_threshold_block",
        "ResourceManagerV1._get_running_request_reserve_blocks",
        "ResourceManagerV1._reset_reserve_on_preemption",
        "ResourceManagerV1._trigger_preempt",
        "ResourceManagerV1.finish_requests",
        "PrefixCacheManager.can_allocate_gpu_blocks",
    ),
    why="Fixed 16 blocks per running request ignore how much each request still has to generate.",
    how="Admit a prefill only if free >= chunk + sum(ceil(min(max_tokens - generated, clip) * ratio / block)); "
    "ratio decays per pass, re-estimated on preemption; a refused running chunk blocks admission for the step.",
    hosts_needing="2.6 before PR 7783 (old host e7c8dc2)",
    switch="FDSCHED_RATIO_RESERVE",
    delete_when="every supported host carries 7783 and exposes the re-estimate term and cap as settings",
    mixins={"ResourceManagerV1": ReservationMixin, "PrefixCacheManager": RatioReserveCacheMixin},
    host_has=_has_ratio_reserve,
    relies_on=(
        Reliance("running-chunk-check", "the running pass checks a running chunk's blocks right after "
                 "get_new_block_nums (old host: a failed check calls _trigger_preempt with the pass's lists)",
                 _running_chunk_check),
        Reliance("pass-end", "schedule() holds self.lock for the whole pass, whose waiting pass starts with a "
                 "truth test of self.waiting (nothing before it reads the queue), and returns the pass's task list",
                 _pass_end, when=("off",)),
        Reliance("threshold-check", "every threshold is checked with can_allocate_gpu_blocks next",
                 _threshold_check),
        Reliance("finish-seam", "every finished request goes through finish_requests (finish_requests_async "
                 "submits it), found in self.requests with its running status and taken out of running",
                 _finish_seam, when=("plugin",)),
    ),
    host_has_as_selected=_as_selected,
    variants={
        "host": {"ResourceManagerV1": Variant.by_host(HostReserveMixin, HOST_RESERVE_OLD_HOST)},
        "plugin": {
            "ResourceManagerV1": Variant(_plugin_variant, (
                RatioReserveMixin, AdaptiveReserveMixin, RATIO_OLD_HOST, ADAPTIVE_OLD_HOST,
            )),
            "PrefixCacheManager": CACHE_SHAPES,
        },
        # only on a host that has the change (elsewhere off is the host's own code: impl "host")
        "off": {"ResourceManagerV1": PRE_CHANGE_SHAPES, "PrefixCacheManager": CACHE_SHAPES},
    },
)

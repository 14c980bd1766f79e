"""Change 3 — new_token_ratio-based KV reservation, with the chunked-prefill guard.

Replaces:  ResourceManagerV1.__init__ (and a step at each ``schedule()`` pass's end: the budget closes),
           ResourceManagerV1.get_new_block_nums, ResourceManagerV1._get_can_schedule_prefill_threshold_block,
           ResourceManagerV1._get_running_request_reserve_blocks, ResourceManagerV1._reset_reserve_on_preemption,
           ResourceManagerV1._trigger_preempt (wrapper), ResourceManagerV1.finish_requests (adaptive: samples),
           PrefixCacheManager.can_allocate_gpu_blocks (what each does: docs/internals.md, "ratio_reserve")
Why:       the host reserves a fixed 16 blocks per running request after a preemption, decaying to
           nothing, whatever each request still has to generate; admission is either too greedy
           (preemption storms) or too timid.
Upstream:  PR 7444, 2.6 cherry-pick 7783 (merged; in d38eeb8).
Needs it:  FastDeploy 2.6 before 7783 (e7c8dc2).
Switch:    FDSCHED_RATIO_RESERVE / changes.ratio_reserve = auto | on | off, with the host's own
           FD_USE_NEW_TOKEN_RATIO_RESERVE and ratio tunables; FDSCHED_RESERVE_ESTIMATOR = ratio (upstream's
           formula) | adaptive (beyond upstream; ``auto`` then applies the plugin with the change too). ``off``
           on a host that has the change restores the fixed-block policy (docs/configuration.md).
Delete:    when every supported host carries 7783 and exposes the re-estimate term and cap.
Relies on: (each probed at install: ``on``, or ``off`` on a host with the change, fails naming it; ``auto`` skips)
  * running-chunk-check: a running chunk's blocks are checked with ``can_allocate_gpu_blocks`` right after
    ``get_new_block_nums``; without the reserve seams a failed check calls ``_trigger_preempt``.
  * pass-end: (reserve seams, ``off``) ``schedule()`` holds ``self.lock`` for the whole pass.
  * threshold-check: every threshold is checked with ``can_allocate_gpu_blocks`` next (the verdict asks that check
    first; the host's then finds the blocks free, or, after a refusal, nothing left to evict).
  * finish-seam: (adaptive) every finished request goes through ``finish_requests``, still running.

How: one admission budget per ``schedule()`` pass (:class:`fdsched.core.admission.AdmissionBudget`), asked at the
host's threshold seam for a verdict (the pool's answer included); each scheduler holds one strategy per impl, host
shape and estimator (``SPEC.strategies``), chosen once when it is built. Modules: ``host``, ``adaptive``, ``off``
(one per impl), ``budget`` (the pass's budget, the ratio strategy on each host shape, the cache manager's check
where the plugin refuses a running chunk) and ``reader``. The rest (the running-chunk
guard, ``off``'s running pass, the pass object, the adaptive estimator, what an admission costs, prefill nodes):
docs/internals.md, "ratio_reserve".
"""

from __future__ import annotations

from fdsched.patches._spec import PatchSpec, Reliance, Variant
from fdsched.patches.ratio_reserve.adaptive import (  # noqa: F401  (the change's classes, by their catalogue path)
    ADAPTIVE_GUARD_SHAPES, AdaptiveGuard, AdaptiveGuardRequestArg, AdaptiveSeams,
)
from fdsched.patches.ratio_reserve.budget import (  # noqa: F401
    CHECK_SHAPES, DECLINE_PREEMPTION, RATIO_GUARD_SHAPES, REFUSE_RUNNING_CHUNK, RM,
    THRESHOLD_FOR_RUNNING_CHUNK, BudgetedReserve, PlanCheck, PlanCheckOneArg, RatioGuard, RatioGuardRequestArg,
    RatioSeams,
)
from fdsched.patches.ratio_reserve.host import HOST_RESERVE_RESET_SHAPES, HostReserve, HostReserveReset  # noqa: F401
from fdsched.patches.ratio_reserve.off import (  # noqa: F401
    ClosedWaitingQueue, PRE_CHANGE_SHAPES, PreChangeReserve, PreChangeReserveBatch,
)


def _plugin_variant(host_has: bool, settings):
    adaptive = settings is not None and settings["tunables.reserve_estimator"] == "adaptive"
    if host_has:
        return AdaptiveSeams if adaptive else RatioSeams
    return ADAPTIVE_GUARD_SHAPES if adaptive else RATIO_GUARD_SHAPES


def _guard_check(host_has: bool, settings):
    return None if host_has else CHECK_SHAPES


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
    else:  # no reserve seams: the guard declines the chunk's preemption call and relies on the pass's two lists
        names |= {"_trigger_preempt", "preempted_reqs", "scheduled_reqs"}
    return _uses(info.rm_class.schedule, names)


def _pass_end(info):
    if not _has_ratio_reserve(info):
        return None  # only off on a host with the reserve seams uses it
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
    # A host with the reserve seams has upstream's ratio formula, never the adaptive estimator.
    return host_has_ratio and settings["tunables.reserve_estimator"] == "ratio"


SPEC = PatchSpec(
    change_id="ratio_reserve",
    title="new_token_ratio KV reservation and chunked-prefill guard",
    upstream_prs=(7444, 7783),
    upstream_state="merged",
    replaces=(
        "ResourceManagerV1.__init__",
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
    hosts_needing="2.6 before PR 7783 (e7c8dc2)",
    switch="FDSCHED_RATIO_RESERVE",
    delete_when="every supported host carries 7783 and exposes the re-estimate term and cap as settings",
    host_has=_has_ratio_reserve,
    relies_on=(
        Reliance("running-chunk-check", "the running pass checks a running chunk's blocks right after "
                 "get_new_block_nums (no reserve seams: a failed check calls _trigger_preempt with the pass's lists)",
                 _running_chunk_check),
        Reliance("pass-end", "schedule() holds self.lock for the whole pass, whose waiting pass starts with a "
                 "truth test of self.waiting (nothing before it reads the queue), and returns the pass's task list",
                 _pass_end, when=("off",)),
        Reliance("threshold-check", "every threshold is checked with can_allocate_gpu_blocks next (the verdict "
                 "asks that check first)", _threshold_check),
        Reliance("finish-seam", "every finished request goes through finish_requests (finish_requests_async "
                 "submits it), found in self.requests with its running status and taken out of running",
                 _finish_seam, when=("plugin",)),
    ),
    host_has_as_selected=_as_selected,
    strategies={
        "ResourceManagerV1": {
            "host": Variant.by_host(HostReserve, HOST_RESERVE_RESET_SHAPES),
            "plugin": Variant(_plugin_variant, (RatioSeams, AdaptiveSeams, RATIO_GUARD_SHAPES, ADAPTIVE_GUARD_SHAPES)),
            # only on a host that has the change (elsewhere off is the host's own code: impl "host")
            "off": PRE_CHANGE_SHAPES,
        },
        # The cache manager refuses a running chunk's check where the plugin refuses the chunk and the host has no
        # seam for it: the guard (no reserve seams) and off's pre-change running pass. Elsewhere the host's check.
        "PrefixCacheManager": {"plugin": Variant(_guard_check, (CHECK_SHAPES,)), "off": CHECK_SHAPES, "host": None},
    },
)

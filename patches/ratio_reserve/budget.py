"""Change 3, the plugin's reservation (impl ``plugin``, and what impl ``off`` shares of it): the pass's admission
budget, upstream's ratio formula as a strategy on each host shape (the reserve seams, the running-chunk guard, a
threshold seam that takes the request), and, where the plugin refuses a running chunk that the host has no seam to
refuse, the cache manager's side (:class:`PlanCheck`).
What it reads of the running requests is :mod:`fdsched.patches.ratio_reserve.reader`; the adaptive estimator
(:mod:`fdsched.patches.ratio_reserve.adaptive`) is the ratio strategy with another estimator. The catalogue entry,
with what the change replaces and relies on, is :mod:`fdsched.patches.ratio_reserve`.
"""

from __future__ import annotations

import functools
import sys
from threading import get_ident

from fdsched.core.adaptive import client_bound
from fdsched.core.admission import AdmissionBudget, NewTokenRatio, RatioStrategy, max_new_tokens_of
from fdsched.core.metrics import METRICS
from fdsched.core.strategies import FixedBlockReserve
from fdsched.core.views import RunningView

from fdsched.patches._spec import Shapes
from fdsched.patches._base import drafts, host_global, node_role
from fdsched.patches._scheduler import StepPlan
from fdsched.patches.ratio_reserve.reader import free_blocks_of, reader_for

RM = "fastdeploy.engine.sched.resource_manager_v1"

# What a pass expects of a block check (also the `signal` label of the unconsumed-signals metric).
REFUSE_RUNNING_CHUNK = "refuse-running-chunk"  # the host's check of a running chunk's blocks answers False
DECLINE_PREEMPTION = "decline-guarded-preemption"  # no reserve seams: _trigger_preempt declines for the guarded chunk
THRESHOLD_FOR_RUNNING_CHUNK = "threshold-for-running-chunk"  # off, seams: the next threshold is a running chunk's

_FIXED = (
    "host_tunables.FD_RESERVE_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
    "host_tunables.FD_RESERVE_DECAY_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
    "host_tunables.FD_RESERVE_MIN_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
)


class ArmGauges:
    """A strategy's reports (:class:`fdsched.core.views.Gauges`) as this scheduler's metrics, labelled by its
    arm."""

    __slots__ = ("_of",)

    def __init__(self, scheduler) -> None:
        self._of = scheduler

    def ratio(self, value: float) -> None:
        METRICS.ratio(value, of=self._of)

    def adaptive_decision(self, expected_tokens: float, margin_tokens: float, k: float, fallbacks: int) -> None:
        METRICS.adaptive_decision(expected_tokens, margin_tokens, k, fallbacks, of=self._of)


# ---- what the plugin's reservation (impls "plugin" and "off") shares -----------------------------------
class BudgetedReserve:
    """One :class:`fdsched.core.admission.AdmissionBudget` per ``schedule()`` pass, with this arm's reservation
    strategy (:mod:`fdsched.core.strategies`) behind it: made by the pass the scheduler opens (:meth:`new_budget`, at
    its first need), asked at the host's threshold seam (and by the running-chunk guard), closed when the pass ends
    (:meth:`pass_end`). The budget belongs to the thread that opened it: a threshold asked on another thread while the
    pass is open (a PD decode node's preallocation) gets a budget of its own. One per scheduler (see
    :mod:`fdsched.patches._scheduler`); each method named as the host's takes the scheduler first."""

    seams = ("get_new_block_nums", "_get_can_schedule_prefill_threshold_block")
    counts_admissions = True  # the plugin's code decides admissions here: the scheduler declares the refusals' series
    fdsched_globals = {RM: ("llm_logger",)}
    fdsched_attributes = ("config", "running", "lock", "cache_manager")

    def __init__(self, rm, settings, next):
        self.next, self.rm, self.settings = next, rm, settings
        self.ratio = NewTokenRatio(
            settings["host_tunables.FD_INIT_NEW_TOKEN_RATIO"],
            settings["host_tunables.FD_MIN_NEW_TOKEN_RATIO"],
            settings["host_tunables.FD_NEW_TOKEN_RATIO_DECAY"],
            settings.reestimate_cap,
        )
        self.fixed = FixedBlockReserve(*(settings[key] for key in _FIXED))
        self.gauges = ArmGauges(rm)  # where the strategy reports, labelled by this scheduler's arm
        self.plans = rm._fdsched_plans
        # The slot of this scheduler's open plan, handed to its cache manager once, here (its PlanCheck, where the
        # plugin refuses running chunks, reads it): nothing of a pass is ever stored in the cache manager.
        rm.cache_manager.fdsched_plans = self.plans
        # A draft model (speculative decoding) needs one block more per chunk; fixed for the scheduler's life.
        self.speculative_slack = self.draft_slack if drafts(rm) else None
        # the host module's request class (every FastDeploy 2.x has one; without it the reader reads afresh)
        self.reader = reader_for(rm, getattr(sys.modules.get(RM), "Request", None),
                                 functools.partial(running_views, rm), self.most_of)
        # The pool's free blocks, where the host's block check compares the count with its free list and takes
        # nothing when the list covers it: a pass's budget may then settle an ask by a bound (AdmissionBudget).
        self.free_blocks = free_blocks_of(rm.cache_manager)
        self.most_tally = _most_tally if self.free_blocks is not None else _no_bound

    @functools.cached_property
    def strategy(self):
        """This arm's reservation strategy (built on first use: it reads the host's config). The reader asks it for
        each request's most from then on (before, through :meth:`most_of`, which makes it)."""
        strategy = self.make_strategy()
        self.reader.most = strategy.most_blocks
        return strategy

    def make_strategy(self):
        raise NotImplementedError

    def new_budget(self) -> AdmissionBudget:
        """The pass's budget (the scheduler's plan makes it at the pass's first need: most passes never ask)."""
        strategy, reader = self.strategy, self.reader
        # How this pass counts the running set is the strategy's choice, made here, once per pass.
        most = self.most_tally(strategy, reader)
        return AdmissionBudget(strategy, strategy.tally(reader), self.rm.cache_manager.can_allocate_gpu_blocks,
                               self.speculative_slack, most, self.free_blocks if most is not None else None)

    def most_of(self, budget: int) -> int:
        """The most a running request with output budget ``budget`` can ever keep free (the reader keeps it with
        the request's other terms)."""
        return self.strategy.most_blocks(budget)

    def budget(self):
        """The budget of the pass this thread has open (made now if it had none yet), else None."""
        plan = self.plans.current()
        return plan.budget if plan is not None else None

    def made_budget(self):
        """The budget of the pass this thread has open if the pass made one yet, else None (nothing is made)."""
        plan = self.plans.current()
        return plan.made if plan is not None else None

    # ---- the pass ---------------------------------------------------------------------------------
    def pass_end(self, rm, plan: StepPlan, result) -> None:
        """Under the host's lock: what the pass left (:meth:`end_pass`), and the end of the strategy's pass (None: the
        host's pass raised, the ratio stays)."""
        with rm.lock:
            budget = plan.made
            if budget is not None or plan.expected:  # most passes: nothing was asked or is left
                self.end_pass(rm, plan, result[0] if result else None)
            self.strategy.pass_ended(None if result is None else bool(result[0]), budget is not None, self.gauges)

    def end_pass(self, rm, plan: StepPlan, scheduled_reqs) -> None:
        """What a pass that asked, or left something expected, leaves: its figures to the metrics, and what nobody
        consumed logged and counted."""
        budget = plan.made
        if budget is not None:
            self.report(budget)
            for request_id in sorted(budget.close()):
                METRICS.signal_unconsumed(DECLINE_PREEMPTION, of=rm)
                host_global(RM, "llm_logger").warning(
                    f"[fdsched] the guard refused running chunk {request_id} but no preemption call followed"
                )
        if plan.expecting():  # something left unconsumed: logged and counted (the logger looked up here)
            plan.close(host_global(RM, "llm_logger"), of=rm)

    # ---- the admission threshold ---------------------------------------------------------------------
    def get_new_block_nums(self, rm, request, num_new_tokens):
        self.focus(request)
        return self.next.get_new_block_nums(rm, request, num_new_tokens)

    def focus(self, request):
        """The host asks for a request's block count right before that request's block checks: the pass this thread
        has open is now deciding on ``request``. Returns that pass's plan (None outside a pass)."""
        plan = self.plans.plan  # PlanSlot.current and StepPlan.focus, read here: the host asks this for every request
        if plan is None or plan.owner != get_ident():
            return None
        plan.request_id = request.request_id
        return plan

    def _get_can_schedule_prefill_threshold_block(self, rm, num_chunk_new_block):
        """The answer at the host's threshold seam (where the host passes the count only: a pass asks it once per
        admission): the verdict's blocks, which the host's block check asked next finds free, or, refused, cannot
        find (counted here, where the verdict is made)."""
        plan = self.plans.plan  # PlanSlot.current, read here (once an admission)
        if plan is not None and plan.owner == get_ident():
            # The pass's figures go to the metrics once, when it ends (end_pass): a pass may ask once per admission,
            # and the gauges' updates cost a fair part of an ask.
            budget = plan.made
            if budget is None:
                budget = plan.budget
            verdict = budget.admit(num_chunk_new_block, rm.running)
        else:  # asked outside a pass (a PD decode node's preallocation): a budget of its own
            budget = self.new_budget()
            verdict = budget.admit(num_chunk_new_block, rm.running)
            self.report(budget)
        if not verdict.admitted:
            METRICS.admission_blocked(of=rm)
        return verdict.blocks

    def report(self, budget: AdmissionBudget) -> None:
        """The running set's blocks at ``budget``'s last ask that counted them, and the strategy's decision then, to
        the metrics (nothing when no ask counted: every one was settled by the bound, or none came)."""
        if budget.reserved is not None:
            METRICS.reserved(budget.reserved, of=self.rm)
            self.strategy.report_decision(self.gauges)

    def running_reserve(self) -> int:
        """The blocks the running set keeps free now (what an admission's threshold adds to its chunk); the
        decision's figures go to the metrics as an admission's do."""
        blocks = self.strategy.set_blocks(running_views(self.rm))
        self.strategy.report_decision(self.gauges)
        return blocks

    def draft_slack(self, threshold: int) -> int:
        return min(threshold + 1, self.rm.config.cache_config.max_block_num_per_seq)

    def adaptive_state(self):
        """The adaptive estimator's state (:meth:`fdsched.core.adaptive.AdaptiveReserve.state`), or None when this
        scheduler does not run it."""
        return None


def running_views(rm, requests=None, with_phase: bool = False, kept: dict = None) -> list:
    """``requests`` (default: ``rm``'s running ones) as a reservation strategy sees them (``with_phase``: whether each
    is decoding, asked only where it is used: the hook may be a third party's).

    ``kept``: a pass's views by request id (the adaptive estimator's tally keeps them for its pass): a request found
    there, the same object with as many output tokens, is seen as it was at the pass's last ask (its client bound and
    prompt do not change while the scheduler holds its lock; its output grows when the token processor appends, and
    then it is seen afresh). Not with ``with_phase``.
    """
    # Built for every running request at every admission decision: names are bound once per call.
    max_model_len = rm.config.model_config.max_model_len
    is_decoding = rm._fdsched_is_decoding if with_phase else None
    if with_phase:
        kept = None
    view, budget_of, bound_of = RunningView, max_new_tokens_of, client_bound
    views = []
    append = views.append
    for r in rm.running if requests is None else requests:
        generated = len(r.output_token_ids)
        if kept is not None:
            seen = kept.get(r.request_id)
            if seen is not None and seen[0] is r and seen[1] == generated:
                append(seen[2])
                continue
        max_tokens = getattr(r.sampling_params, "max_tokens", None)
        prompt_len = r.prompt_token_ids_len
        made = view(
            r.request_id,
            budget_of(max_tokens, max_model_len, prompt_len),
            generated,
            bound_of(max_tokens, max_model_len, prompt_len),
            is_decoding(r) if with_phase else None,
        )
        if kept is not None:
            kept[r.request_id] = (r, generated, made)
        append(made)
    return views


def _most_tally(strategy, reader):
    return strategy.most_tally(reader)


def _no_bound(strategy, reader):
    return None


# ---- the host's shapes of the plugin's version ------------------------------------------------------------
class ReserveSeams:
    """The seams a host with 7783 calls: one running request's reserve, and the re-estimate after a preemption (with
    a :class:`BudgetedReserve` estimator class)."""

    seams = ("_get_running_request_reserve_blocks", "_reset_reserve_on_preemption")

    def _get_running_request_reserve_blocks(self, rm, request) -> int:
        (view,) = running_views(rm, (request,))
        return self.strategy.request_blocks(view)

    def _reset_reserve_on_preemption(self, rm):
        self.reestimate()


class RunningChunkGuard:
    """A host without reserve seams checks a running chunk against its own blocks only, and has no per-preemption
    seam: the budget is asked for the chunk in ``get_new_block_nums``; a refused chunk's check is refused and its
    preemption call declined (both read the pass's one decision); the ratio is re-estimated after a
    ``_trigger_preempt`` call that preempted (with a :class:`BudgetedReserve` estimator class)."""

    seams = ("_trigger_preempt",)
    fdsched_calls = {"PrefixCacheManager.can_allocate_gpu_blocks": ("num_blocks",)}

    def get_new_block_nums(self, rm, request, num_new_tokens):
        plan = self.focus(request)
        blocks = self.next.get_new_block_nums(rm, request, num_new_tokens)
        if plan is None or not rm._fdsched_is_running_prefill(request):  # outside a pass the host's check stands
            return blocks
        budget = plan.budget
        if budget.admit(blocks, rm.running).admitted:  # the host's own check of the chunk's blocks then holds
            return blocks
        METRICS.admission_blocked(of=rm)
        # The pass's one decision for this chunk: its block check is refused and its preemption call declined.
        plan.expect(REFUSE_RUNNING_CHUNK, blocks)
        budget.declined.add(request.request_id)
        return blocks

    def _trigger_preempt(self, rm, request, num_new_blocks, preempted_reqs, scheduled_reqs):
        budget = self.made_budget()  # a decline is recorded in a budget the pass made
        if budget is not None and request.request_id in budget.declined:
            # The guard refused this running chunk. Decline without preempting; a non-empty list makes the
            # host skip its waiting pass, as upstream does after a refused chunk.
            budget.declined.discard(request.request_id)
            preempted_reqs.append(request)
            return False
        already = len(preempted_reqs)
        result = self.next._trigger_preempt(rm, request, num_new_blocks, preempted_reqs, scheduled_reqs)
        if len(preempted_reqs) > already:
            self.reestimate(len(preempted_reqs) - already)
        return result


class ThresholdTakesRequest:
    """The threshold seam where the host passes the request too, ``(request, num_chunk_new_block)`` (FastDeploy
    2.4 and 2.5): the same answer; the request is not needed for it."""

    def _get_can_schedule_prefill_threshold_block(self, rm, request, num_chunk_new_block):
        return super()._get_can_schedule_prefill_threshold_block(rm, num_chunk_new_block)


# ---- impl "plugin": upstream's ratio formula -------------------------------------------------------------------
class RatioCore(BudgetedReserve):
    """The plugin's version of change 3 with upstream's ratio formula (:class:`RatioStrategy`), on any host."""

    def __init__(self, rm, settings, next):
        super().__init__(rm, settings, next)
        # A prefill node never decodes: its requests leave after their first token. Reserving decode blocks
        # there (as 7783 does) can stall it for good: a chunk that needs no new block is refused while the
        # preallocated requests hold the pool, and the ratio decays only after a pass that scheduled something.
        self.decodes = node_role(rm) != "prefill"
        self.policies = rm._fdsched_policies
        METRICS.ratio(self.ratio.value, of=rm)

    def make_strategy(self):
        return RatioStrategy(
            self.ratio,
            self.settings["host_tunables.FD_CLIP_MAX_NEW_TOKENS"],
            self.rm.config.cache_config.block_size,
            self.settings["tunables.ratio_reestimate_extra_blocks"],
            self.policies.reserve_blocks,
            decodes=self.decodes,
            pure=lambda policies=self.policies: policies.reserve_is_formula,
        )

    def reestimate(self, preemptions: int = 1) -> None:
        self.strategy.on_preemption(running_views(self.rm, with_phase=True), preemptions)
        budget = self.made_budget()
        if budget is not None:  # the ratio moved: the pass's next ask counts the running set afresh
            budget.running_changed()
        self.strategy.report(self.gauges, exact=True)


class RatioSeams(ReserveSeams, RatioCore):
    """Upstream's ratio formula on a host with 7783 (through its seams)."""

    seams = RatioCore.seams + ReserveSeams.seams


class RatioGuard(RunningChunkGuard, RatioCore):
    """Upstream's ratio formula on a host without the reserve seams (with the guard)."""

    seams = RatioCore.seams + RunningChunkGuard.seams


class RatioGuardRequestArg(ThresholdTakesRequest, RatioGuard):
    """:class:`RatioGuard` on a host whose threshold seam takes the request."""


RATIO_GUARD_SHAPES = Shapes(RatioGuard, RatioGuardRequestArg)


# ---- the cache manager's side ----------------------------------------------------------------------------
class PlanCheck:
    """The host's block check where the plugin refuses a running chunk that the host has no seam to refuse (the
    running-chunk guard, and ``off``'s pre-change running pass; one per cache manager; ``next`` checks: the host's
    own): a check the scheduler's pass said to refuse (:meth:`fdsched.patches._scheduler.StepPlan.expect`, through
    the slot the scheduler handed its cache manager when it was built, ``fdsched_plans``) answers False and evicts
    nothing; every other check is the host's."""

    seams = ("can_allocate_gpu_blocks",)

    def __init__(self, cm, settings, next):
        self.pool = next.can_allocate_gpu_blocks  # the layer below's check (the host's): asked by most checks

    def can_allocate_gpu_blocks(self, cm, num_blocks, try_free_gpu_blocks=True):
        # most checks: no pass on any thread expects anything of a check, the pool answers
        plans = cm.fdsched_plans
        if plans.waiting and REFUSE_RUNNING_CHUNK in plans.take(num_blocks):
            return False
        return self.pool(cm, num_blocks, try_free_gpu_blocks)


class PlanCheckOneArg(PlanCheck):
    """The block check where the host's takes the count only, ``(num_blocks)`` (FastDeploy 2.4 and 2.5)."""

    def can_allocate_gpu_blocks(self, cm, num_blocks):
        plans = cm.fdsched_plans
        if plans.waiting and REFUSE_RUNNING_CHUNK in plans.take(num_blocks):
            return False
        return self.pool(cm, num_blocks)


CHECK_SHAPES = Shapes(PlanCheck, PlanCheckOneArg)

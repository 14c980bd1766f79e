"""Change 3, impl ``off`` on a host that has the change: the fixed-block policy
(:class:`fdsched.core.strategies.FixedBlockStrategy`) and the pre-change running pass. The catalogue entry is
:mod:`fdsched.patches.ratio_reserve`.
"""

from __future__ import annotations

from fdsched.core.admission import AdmissionBudget
from fdsched.core.strategies import FixedBlockStrategy
from fdsched.core.metrics import METRICS

from fdsched.patches._spec import Shapes
from fdsched.patches._base import host_global
from fdsched.patches._scheduler import StepPlan
from fdsched.patches.ratio_reserve.budget import (
    REFUSE_RUNNING_CHUNK, RM, THRESHOLD_FOR_RUNNING_CHUNK, BudgetedReserve,
)


# ---- impl "off" (a host that has the change): the pre-change policy and running pass -----------------------
class _PreChangePass(AdmissionBudget):
    """The budget of a pre-change pass, with what the pre-change running pass does that 7783's does not: a
    running chunk short of blocks preempts (into lists of the plugin's own, added to the pass's task list at
    its end, right before the chunk's task), and a pass that preempted admits nobody (the waiting queue reads as
    empty until the pass ends: :class:`ClosedWaitingQueue`)."""

    def __init__(self, strategy, tally, pool, slack):
        super().__init__(strategy, tally, pool, slack)
        self.preemptions: list = []  # (the running chunk, its preempt tasks), in order
        self.closed = None  # the view the waiting queue is seen through while admission is closed for the pass


class ClosedWaitingQueue:
    """The host's waiting queue for the rest of a pass that preempted: a view of the queue that reads as empty to a
    truth test and is the queue itself for everything else. The host's waiting pass starts with ``while
    self.waiting``, its only gate before its side effects (prefix matching, swap-in) that the plugin can reach;
    every other operation (append, appendleft, len, index, iteration, remove) goes to the queue, so a request that
    arrives meanwhile keeps its place and the pass's metrics count the queue. The pass's end puts the queue itself
    back (:attr:`queue`): nothing is copied."""

    __slots__ = ("queue",)

    def __init__(self, queue) -> None:
        self.queue = queue

    def __bool__(self) -> bool:
        return False

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self):
        return iter(self.queue)

    def __getitem__(self, index):
        return self.queue[index]

    def __contains__(self, item) -> bool:
        return item in self.queue

    def __getattr__(self, name):
        return getattr(self.queue, name)

    def __repr__(self) -> str:
        return f"ClosedWaitingQueue({self.queue!r})"


class PreChangeReserve(BudgetedReserve):
    """``off`` on a host that has 7783: the fixed-block policy (:class:`FixedBlockStrategy`) and the pre-change
    running pass (a running chunk short of blocks preempts instead of waiting). The pass ends where the host's
    ``schedule()`` returns: the pass's end (:meth:`pass_end`) gives it back what the plugin held, under the host's
    lock."""

    seams = BudgetedReserve.seams + ("_trigger_preempt", "_reset_reserve_on_preemption")
    fdsched_calls = {"PrefixCacheManager.can_allocate_gpu_blocks": ("num_blocks",)}
    fdsched_attributes = ("waiting",)

    def make_strategy(self):
        return FixedBlockStrategy(self.fixed)

    def new_budget(self) -> AdmissionBudget:
        strategy = self.strategy
        return _PreChangePass(strategy, strategy.tally(self.reader), self.rm.cache_manager.can_allocate_gpu_blocks,
                              self.speculative_slack)

    def get_new_block_nums(self, rm, request, num_new_tokens):
        blocks = super().get_new_block_nums(rm, request, num_new_tokens)
        if rm._fdsched_is_running_prefill(request):
            budget = self.budget()
            if budget is not None:
                self.pre_change_running_chunk(rm, budget, request, blocks)
        return blocks

    def pre_change_running_chunk(self, rm, budget: _PreChangePass, request, blocks) -> None:
        # before 7783 it needed only its own blocks: the threshold asked next for it is its own count
        self.plans.current().running_chunk = (request.request_id, blocks)
        if rm.cache_manager.can_allocate_gpu_blocks(blocks):
            return
        preempted, tasks = [], self.task_list()
        can_schedule = rm._trigger_preempt(request, blocks, preempted, tasks)
        if len(tasks):
            budget.preemptions.append((request, tasks))
        if preempted and budget.closed is None:
            # Before 7783 a pass that preempted admitted nobody: close admission until the pass ends. The
            # scheduler lock is held for the whole pass, so nothing else reads or fills the queue meanwhile.
            budget.closed = rm.waiting = ClosedWaitingQueue(rm.waiting)
        if not can_schedule:
            # The host then stops its running pass (and, as before 7783, admits nobody in this step): its check of
            # the chunk's blocks is refused, and counted here, where it is decided.
            self.plans.current().expect(REFUSE_RUNNING_CHUNK, blocks)
            METRICS.admission_blocked(of=rm)

    def _get_can_schedule_prefill_threshold_block(self, rm, num_chunk_new_block):
        plan = self.plans.current()
        if plan is not None and plan.running_chunk is not None and plan.running_chunk[1] == num_chunk_new_block:
            plan.running_chunk = None
            # pre-change: a running chunk needed only its own blocks (decided when its count was asked)
            return num_chunk_new_block
        return super()._get_can_schedule_prefill_threshold_block(rm, num_chunk_new_block)

    def _trigger_preempt(self, rm, request, num_new_blocks, preempted_reqs, scheduled_reqs):
        result = self.next._trigger_preempt(rm, request, num_new_blocks, preempted_reqs, scheduled_reqs)
        self.strategy.on_preemption()  # pre-change: at the end of every call, as a host with no reserve seams does
        return result

    def _reset_reserve_on_preemption(self, rm):
        """Nothing: before 7783 the reservation was reset at the end of the ``_trigger_preempt`` call."""

    def task_list(self):
        """An empty container of the kind the host's ``_trigger_preempt`` appends preempt tasks to (a list)."""
        return []

    def insert_before(self, scheduled_reqs, chunk, tasks) -> None:
        at = next((i for i, task in enumerate(scheduled_reqs) if task is chunk), len(scheduled_reqs))
        scheduled_reqs[at:at] = tasks

    def end_pass(self, rm, plan: StepPlan, scheduled_reqs) -> None:
        """Give the pass back what the plugin held for it (under the host's lock): the waiting queue, every request
        that arrived meanwhile in its place, and its preempt tasks in order."""
        budget: _PreChangePass = plan.made
        if budget is None:  # the pass needed none: the plugin held nothing for it
            super().end_pass(rm, plan, scheduled_reqs)
            return
        if budget.closed is not None:
            if rm.waiting is budget.closed:  # else the host replaced the queue during the pass: it stays
                rm.waiting = budget.closed.queue
            budget.closed = None
        if scheduled_reqs is None:  # the host's pass raised: its tasks are gone, and so are the plugin's
            scheduled_reqs = self.task_list()
        for chunk, tasks in budget.preemptions:
            # Before 7783 the preempt tasks went into the pass's list right before the chunk's own task.
            self.insert_before(scheduled_reqs, chunk, tasks)
        budget.preemptions = []
        if plan.running_chunk is not None:
            METRICS.signal_unconsumed(THRESHOLD_FOR_RUNNING_CHUNK, of=rm)
            host_global(RM, "llm_logger").warning(
                f"[fdsched] no threshold was computed for running chunk {plan.running_chunk[0]} "
                f"({plan.running_chunk[1]} blocks) after its block count"
            )
        super().end_pass(rm, plan, scheduled_reqs)


class PreChangeReserveBatch(PreChangeReserve):
    """:class:`PreChangeReserve` on a host whose pass collects its tasks in a ``BatchRequest`` (develop:
    ``_trigger_preempt(..., batch_request)``): the plugin's own preemptions go into a ``BatchRequest`` of their
    own, and at the pass's end into the pass's, right before the chunk's task, with any swap / evict metadata
    they carry."""

    fdsched_globals = {RM: ("llm_logger", "BatchRequest")}

    def _trigger_preempt(self, rm, request, num_new_blocks, preempted_reqs, batch_request):
        result = self.next._trigger_preempt(rm, request, num_new_blocks, preempted_reqs, batch_request)
        self.strategy.on_preemption()  # pre-change: at the end of every call, as a host with no reserve seams does
        return result

    def task_list(self):
        return host_global(RM, "BatchRequest")()

    def insert_before(self, batch_request, chunk, tasks) -> None:
        requests = batch_request.requests
        at = next((i for i, task in enumerate(requests) if task is chunk), len(requests))
        requests[at:at] = tasks.requests
        if tasks.cache_swap_metadata:
            batch_request.append_swap_metadata([tasks.cache_swap_metadata])
        if tasks.cache_evict_metadata:
            batch_request.append_evict_metadata([tasks.cache_evict_metadata])


PRE_CHANGE_SHAPES = Shapes(PreChangeReserve, PreChangeReserveBatch)

"""Change 3, the cache manager's side (impls ``plugin`` and ``off``): the host's block check as the scheduler's pass
sees it. The catalogue entry is :mod:`fdsched.patches.ratio_reserve`.
"""

from __future__ import annotations

from fdsched.core.metrics import METRICS

from fdsched.patches._spec import Shapes
from fdsched.patches._plan import NOTHING
from fdsched.patches.ratio_reserve.budget import COUNT_REFUSAL, REFUSE_RUNNING_CHUNK


# ---- the cache manager's side ----------------------------------------------------------------------------
class PlanCheck:
    """The host's block check, seen by the scheduler (one per cache manager; ``next`` checks: the host's own): it
    consults the scheduler's plan open on its own thread (:class:`fdsched.patches._plan.StepPlan`, through the slot
    the scheduler handed its cache manager when it was built, ``fdsched_plans``) — a refusal of one check (evicting
    nothing), or a refused threshold check to count for the metrics."""

    seams = ("can_allocate_gpu_blocks",)

    def __init__(self, cm, settings, next):
        self.next = next

    def can_allocate_gpu_blocks(self, cm, num_blocks, try_free_gpu_blocks=True):
        # most checks: no pass on any thread expects anything of a check, the pool answers
        plans = cm.fdsched_plans
        kinds = plans.take(num_blocks) if plans.waiting else NOTHING
        if kinds is NOTHING:
            return self.next.can_allocate_gpu_blocks(cm, num_blocks, try_free_gpu_blocks)
        allowed = REFUSE_RUNNING_CHUNK not in kinds and self.next.can_allocate_gpu_blocks(cm, num_blocks,
                                                                                          try_free_gpu_blocks)
        return counted(cm, kinds, allowed)


class PlanCheckOneArg(PlanCheck):
    """The block check where the host's takes the count only, ``(num_blocks)`` (FastDeploy 2.4 and 2.5)."""

    def can_allocate_gpu_blocks(self, cm, num_blocks):
        plans = cm.fdsched_plans
        kinds = plans.take(num_blocks) if plans.waiting else NOTHING
        if kinds is NOTHING:
            return self.next.can_allocate_gpu_blocks(cm, num_blocks)
        allowed = REFUSE_RUNNING_CHUNK not in kinds and self.next.can_allocate_gpu_blocks(cm, num_blocks)
        return counted(cm, kinds, allowed)


def counted(cm, kinds, allowed: bool) -> bool:
    """``allowed``, after counting a refused threshold check the pass said to count."""
    if COUNT_REFUSAL in kinds and not allowed:
        METRICS.admission_blocked(of=cm)
    return allowed


CHECK_SHAPES = Shapes(PlanCheck, PlanCheckOneArg)

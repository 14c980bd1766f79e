"""Change 3, the cache manager's side (impls ``plugin`` and ``off``): the host's block check as the scheduler's pass
sees it. The catalogue entry is :mod:`fdsched.patches.ratio_reserve`.
"""

from __future__ import annotations

from fdsched.core.metrics import METRICS

from fdsched.patches._spec import Shapes
from fdsched.patches._base import PluginBase
from fdsched.patches._plan import NO_PLANS, NOTHING
from fdsched.patches.ratio_reserve.budget import COUNT_REFUSAL, REFUSE_RUNNING_CHUNK


# ---- the cache manager's side ----------------------------------------------------------------------------
class RatioReserveCacheMixin(PluginBase):
    """The host's block check, seen by the scheduler: it consults the scheduler's plan open on its own thread
    (:class:`fdsched.patches._plan.StepPlan`, through the slot the scheduler handed over when it was built) —
    a refusal of one check (evicting nothing), or a refused threshold check to count for the metrics."""

    _fdsched_plans = NO_PLANS  # until a plugin scheduler built with this cache manager hands over its slot

    def can_allocate_gpu_blocks(self, num_blocks, try_free_gpu_blocks=True):
        # most checks: no pass on any thread expects anything of a check, the pool answers
        kinds = self._fdsched_plans.take(num_blocks) if self._fdsched_plans.waiting else NOTHING
        if kinds is NOTHING:
            return super().can_allocate_gpu_blocks(num_blocks, try_free_gpu_blocks)
        allowed = REFUSE_RUNNING_CHUNK not in kinds and super().can_allocate_gpu_blocks(num_blocks, try_free_gpu_blocks)
        return self._fdsched_counted(kinds, allowed)

    def _fdsched_counted(self, kinds, allowed: bool) -> bool:
        """``allowed``, after counting a refused threshold check the pass said to count."""
        if COUNT_REFUSAL in kinds and not allowed:
            METRICS.admission_blocked(of=self)
        return allowed


class RatioReserveCacheOneArgMixin(RatioReserveCacheMixin):
    """The block check where the host's takes the count only, ``(num_blocks)`` (FastDeploy 2.4 and 2.5)."""

    def can_allocate_gpu_blocks(self, num_blocks):
        kinds = self._fdsched_plans.take(num_blocks) if self._fdsched_plans.waiting else NOTHING
        if kinds is NOTHING:
            return super(RatioReserveCacheMixin, self).can_allocate_gpu_blocks(num_blocks)
        allowed = REFUSE_RUNNING_CHUNK not in kinds and super(RatioReserveCacheMixin, self).can_allocate_gpu_blocks(num_blocks)
        return self._fdsched_counted(kinds, allowed)


CACHE_SHAPES = Shapes(RatioReserveCacheMixin, RatioReserveCacheOneArgMixin)

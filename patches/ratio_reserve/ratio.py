"""Change 3, impl ``plugin`` with upstream's ratio formula (:class:`fdsched.core.strategies.RatioStrategy`), on each
host shape. The catalogue entry is :mod:`fdsched.patches.ratio_reserve`.
"""

from __future__ import annotations

from fdsched.core.strategies import RatioStrategy
from fdsched.core.metrics import METRICS

from fdsched.patches._spec import Shapes
from fdsched.patches._base import node_role
from fdsched.patches.ratio_reserve.budget import (
    BudgetedReserve, ReserveSeams, RunningChunkGuard, ThresholdTakesRequest, running_views,
)


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
        self.strategy.report(self.gauges)


class RatioSeams(ReserveSeams, RatioCore):
    """Upstream's ratio formula on a host with 7783 (through its seams)."""

    seams = RatioCore.seams + ReserveSeams.seams


class RatioGuard(RunningChunkGuard, RatioCore):
    """Upstream's ratio formula on a host without the reserve seams (with the guard)."""

    seams = RatioCore.seams + RunningChunkGuard.seams


class RatioGuardRequestArg(ThresholdTakesRequest, RatioGuard):
    """:class:`RatioGuard` on a host whose threshold seam takes the request."""


RATIO_GUARD_SHAPES = Shapes(RatioGuard, RatioGuardRequestArg)

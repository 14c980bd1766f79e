"""Change 3, impl ``plugin`` with upstream's ratio formula (:class:`fdsched.core.strategies.RatioStrategy`), on each
host shape. The catalogue entry is :mod:`fdsched.patches.ratio_reserve`.
"""

from __future__ import annotations

from fdsched.core.strategies import RatioStrategy
from fdsched.core.metrics import METRICS

from fdsched.patches._spec import Shapes
from fdsched.patches._base import node_role
from fdsched.patches.ratio_reserve.budget import _BudgetedReserve, _ReserveSeams, _RunningChunkGuard, _ThresholdTakesRequest


# ---- impl "plugin": upstream's ratio formula -------------------------------------------------------------------
class _RatioCore(_BudgetedReserve):
    """The plugin's version of change 3 with upstream's ratio formula (:class:`RatioStrategy`), on any host."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A prefill node never decodes: its requests leave after their first token. Reserving decode blocks
        # there (as 7783 does) can stall it for good: a chunk that needs no new block is refused while the
        # preallocated requests hold the pool, and the ratio decays only after a pass that scheduled something.
        self._fdsched_decodes = node_role(self) != "prefill"
        METRICS.ratio(self._fdsched_ratio.value, of=self)

    def _fdsched_make_strategy(self):
        return RatioStrategy(
            self._fdsched_ratio,
            self._fdsched_settings["host_tunables.FD_CLIP_MAX_NEW_TOKENS"],
            self.config.cache_config.block_size,
            self._fdsched_settings["tunables.ratio_reestimate_extra_blocks"],
            self._fdsched_policies.reserve_blocks,
            decodes=self._fdsched_decodes,
            pure=lambda policies=self._fdsched_policies: policies.reserve_is_formula,
        )

    def _fdsched_reestimate(self, preemptions: int = 1) -> None:
        self._fdsched_strategy.on_preemption(self._fdsched_views(with_phase=True), preemptions)
        budget = self._fdsched_made_budget()
        if budget is not None:  # the ratio moved: the pass's next ask counts the running set afresh
            budget.running_changed()
        self._fdsched_strategy.report(self._fdsched_gauges)

    def fdsched_adaptive_state(self):
        """The adaptive estimator's state (:meth:`fdsched.core.adaptive.AdaptiveReserve.state`), or None when this
        scheduler does not run it."""
        return None


class RatioReserveMixin(_ReserveSeams, _RatioCore):
    """Upstream's ratio formula on a host with 7783 (through its seams)."""


class RatioReserveGuardMixin(_RunningChunkGuard, _RatioCore):
    """Upstream's ratio formula on a host without the reserve seams (with the guard)."""


class RatioReserveRequestArgMixin(_ThresholdTakesRequest, RatioReserveGuardMixin):
    """:class:`RatioReserveGuardMixin` on a host whose threshold seam takes the request."""


RATIO_GUARD_SHAPES = Shapes(RatioReserveGuardMixin, RatioReserveRequestArgMixin)

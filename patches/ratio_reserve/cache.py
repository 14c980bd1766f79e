"""Change 3, the cache manager's side (impls ``plugin`` and ``off``): the host's block check as the scheduler's pass
sees it. The catalogue entry is :mod:`fdsched.patches.ratio_reserve`.
"""

from __future__ import annotations

from fdsched.core.metrics import METRICS

from fdsched.patches._spec import Shapes
from fdsched.patches._base import PluginBase
from fdsched.patches.ratio_reserve.budget import COUNT_REFUSAL, REFUSE_RUNNING_CHUNK


# ---- the cache manager's side ----------------------------------------------------------------------------
class RatioReserveCacheMixin(PluginBase):
    """The host's block check, seen by the scheduler: a keyed refusal of one check (evicting nothing), and a
    refused threshold check counted for the metrics (signals: :class:`fdsched.patches._base.BlockCheckSignals`)."""

    def can_allocate_gpu_blocks(self, num_blocks, try_free_gpu_blocks=True):
        kinds = self._fdsched_signals_for(num_blocks)
        allowed = REFUSE_RUNNING_CHUNK not in kinds and super().can_allocate_gpu_blocks(num_blocks, try_free_gpu_blocks)
        return self._fdsched_counted(kinds, allowed)

    def _fdsched_signals_for(self, num_blocks) -> frozenset:
        signals = self.__dict__.get("_fdsched_block_checks")
        return signals.take(num_blocks) if signals is not None else frozenset()

    def _fdsched_counted(self, kinds, allowed: bool) -> bool:
        if COUNT_REFUSAL in kinds and not allowed:
            METRICS.admission_blocked(of=self)
        return allowed


class RatioReserveCacheOneArgMixin(RatioReserveCacheMixin):
    """The block check where the host's takes the count only, ``(num_blocks)`` (FastDeploy 2.4 and 2.5)."""

    def can_allocate_gpu_blocks(self, num_blocks):
        kinds = self._fdsched_signals_for(num_blocks)
        allowed = REFUSE_RUNNING_CHUNK not in kinds and super(RatioReserveCacheMixin, self).can_allocate_gpu_blocks(num_blocks)
        return self._fdsched_counted(kinds, allowed)


CACHE_SHAPES = Shapes(RatioReserveCacheMixin, RatioReserveCacheOneArgMixin)

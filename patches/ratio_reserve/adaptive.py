"""Change 3, impl ``plugin`` with the plugin's adaptive estimator (:class:`fdsched.core.strategies.AdaptiveStrategy`,
beyond upstream), on each host shape. The catalogue entry is :mod:`fdsched.patches.ratio_reserve`.
"""

from __future__ import annotations

from fdsched.core.adaptive import K_BOUND, AdaptiveReserve, client_bound, track_live
from fdsched.core.strategies import AdaptiveStrategy
from fdsched.core.metrics import METRICS

from fdsched.patches._spec import Shapes
from fdsched.patches._base import finished_ids
from fdsched.patches.ratio_reserve.budget import _ReserveSeams, _RunningChunkGuard, _ThresholdTakesRequest
from fdsched.patches.ratio_reserve.ratio import _RatioCore


class _AdaptiveCore(_RatioCore):
    """The plugin's own estimator (:class:`AdaptiveStrategy`); every request that finishes running is a sample."""

    fdsched_attributes = ("requests",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        s = self._fdsched_settings
        # Built now (it needs nothing of the host's config), so `fdsched doctor` and the metrics see it from the
        # start; the strategy around it is built on first use, as every arm's is.
        self._fdsched_adaptive = AdaptiveReserve(
            window=s["tunables.adaptive_window"],
            min_samples=s["tunables.adaptive_min_samples"],
            k=s["tunables.adaptive_margin_k"],
            k_step=s["tunables.adaptive_k_step"],
            k_max=K_BOUND,
            k_decay=s["tunables.adaptive_k_decay"],
        )
        track_live(self._fdsched_adaptive)
        METRICS.adaptive_samples(self._fdsched_adaptive.state(), of=self)
        # A prefill node's requests leave after their first token: not samples of the output length.
        self._fdsched_take_samples = self._fdsched_observe_finished if self._fdsched_decodes else _no_samples

    def _fdsched_make_strategy(self):
        s = self._fdsched_settings
        return AdaptiveStrategy(
            self._fdsched_ratio,
            s["host_tunables.FD_CLIP_MAX_NEW_TOKENS"],
            self.config.cache_config.block_size,
            s["tunables.ratio_reestimate_extra_blocks"],
            self._fdsched_policies.reserve_blocks_override,
            self._fdsched_adaptive,
            self._fdsched_fixed,
            decodes=self._fdsched_decodes,
            pure=lambda policies=self._fdsched_policies: policies.reserve_is_formula,
        )

    def _fdsched_reestimate(self, preemptions: int = 1) -> None:
        super()._fdsched_reestimate(preemptions)
        METRICS.adaptive_samples(self._fdsched_adaptive.state(), of=self)

    def fdsched_adaptive_state(self):
        return self._fdsched_adaptive.state()

    def finish_requests(self, request_ids):
        request_ids, ids = finished_ids(request_ids)  # read here and by the host
        self._fdsched_take_samples(ids)
        return super().finish_requests(request_ids)

    def _fdsched_observe_finished(self, ids) -> None:
        running = self._fdsched_running_statuses
        max_model_len = self.config.model_config.max_model_len
        adaptive = self._fdsched_adaptive
        with self.lock:
            for request_id in ids:
                request = self.requests.get(request_id)
                # Only a request that finishes while running is a sample; a preempted one (waiting to be
                # rescheduled) or an unknown id is not: its length is not known to be complete (censoring).
                if request is None or request.status not in running:
                    continue
                adaptive.observe_finished(
                    client_bound(
                        getattr(request.sampling_params, "max_tokens", None), max_model_len, request.prompt_token_ids_len
                    ),
                    len(request.output_token_ids),
                )
            METRICS.adaptive_samples(adaptive.state(), of=self)


class AdaptiveReserveMixin(_ReserveSeams, _AdaptiveCore):
    """The adaptive estimator on a host with 7783 (through its seams)."""


class AdaptiveReserveGuardMixin(_RunningChunkGuard, _AdaptiveCore):
    """The adaptive estimator on a host without the reserve seams (with the guard)."""


class AdaptiveReserveRequestArgMixin(_ThresholdTakesRequest, AdaptiveReserveGuardMixin):
    """:class:`AdaptiveReserveGuardMixin` on a host whose threshold seam takes the request."""


ADAPTIVE_GUARD_SHAPES = Shapes(AdaptiveReserveGuardMixin, AdaptiveReserveRequestArgMixin)


def _no_samples(ids) -> None:
    """A prefill node: finished requests are not samples."""

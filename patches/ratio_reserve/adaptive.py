"""Change 3, impl ``plugin`` with the plugin's adaptive estimator (:class:`fdsched.core.strategies.AdaptiveStrategy`,
beyond upstream), on each host shape. The catalogue entry is :mod:`fdsched.patches.ratio_reserve`.
"""

from __future__ import annotations

from fdsched.core.adaptive import K_BOUND, AdaptiveReserve, client_bound, track_live
from fdsched.core.strategies import AdaptiveStrategy
from fdsched.core.metrics import METRICS

from fdsched.patches._spec import Shapes
from fdsched.patches._base import finished_ids
from fdsched.patches.ratio_reserve.budget import RatioCore, ReserveSeams, RunningChunkGuard, ThresholdTakesRequest


class AdaptiveCore(RatioCore):
    """The plugin's own estimator (:class:`AdaptiveStrategy`); every request that finishes running is a sample."""

    seams = RatioCore.seams + ("finish_requests",)
    fdsched_attributes = ("requests",)

    def __init__(self, rm, settings, next):
        super().__init__(rm, settings, next)
        # Built now (it needs nothing of the host's config), so `fdsched doctor` and the metrics see it from the
        # start; the strategy around it is built on first use, as every arm's is.
        self.adaptive = AdaptiveReserve(
            window=settings["tunables.adaptive_window"],
            min_samples=settings["tunables.adaptive_min_samples"],
            k=settings["tunables.adaptive_margin_k"],
            k_step=settings["tunables.adaptive_k_step"],
            k_max=K_BOUND,
            k_decay=settings["tunables.adaptive_k_decay"],
        )
        track_live(self.adaptive)
        METRICS.adaptive_samples(self.adaptive.state(), of=rm)
        # A prefill node's requests leave after their first token: not samples of the output length.
        self.take_samples = self.observe_finished if self.decodes else _no_samples

    def make_strategy(self):
        return AdaptiveStrategy(
            self.ratio,
            self.settings["host_tunables.FD_CLIP_MAX_NEW_TOKENS"],
            self.rm.config.cache_config.block_size,
            self.settings["tunables.ratio_reestimate_extra_blocks"],
            self.policies.reserve_blocks_override,
            self.adaptive,
            self.fixed,
            decodes=self.decodes,
            pure=lambda policies=self.policies: policies.reserve_is_formula,
        )

    def reestimate(self, preemptions: int = 1) -> None:
        super().reestimate(preemptions)
        METRICS.adaptive_samples(self.adaptive.state(), of=self.rm)

    def adaptive_state(self):
        return self.adaptive.state()

    def finish_requests(self, rm, request_ids):
        request_ids, ids = finished_ids(request_ids)  # read here and by the host
        self.take_samples(rm, ids)
        return self.next.finish_requests(rm, request_ids)

    def observe_finished(self, rm, ids) -> None:
        running = rm._fdsched_running_statuses
        max_model_len = rm.config.model_config.max_model_len
        adaptive = self.adaptive
        with rm.lock:
            for request_id in ids:
                request = rm.requests.get(request_id)
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
            METRICS.adaptive_samples(adaptive.state(), of=rm)


class AdaptiveSeams(ReserveSeams, AdaptiveCore):
    """The adaptive estimator on a host with 7783 (through its seams)."""

    seams = AdaptiveCore.seams + ReserveSeams.seams


class AdaptiveGuard(RunningChunkGuard, AdaptiveCore):
    """The adaptive estimator on a host without the reserve seams (with the guard)."""

    seams = AdaptiveCore.seams + RunningChunkGuard.seams


class AdaptiveGuardRequestArg(ThresholdTakesRequest, AdaptiveGuard):
    """:class:`AdaptiveGuard` on a host whose threshold seam takes the request."""


ADAPTIVE_GUARD_SHAPES = Shapes(AdaptiveGuard, AdaptiveGuardRequestArg)


def _no_samples(rm, ids) -> None:
    """A prefill node: finished requests are not samples."""

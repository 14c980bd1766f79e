"""Change 3's other two reservation strategies, in plain values (nothing here imports FastDeploy); upstream's ratio
strategy, the default, is :class:`fdsched.core.admission.RatioStrategy`, beside the verdict it feeds.

* :class:`FixedBlockStrategy`: the pre-change policy (``FD_RESERVE_*_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL``, the
  state in :class:`FixedBlockReserve`);
* :class:`AdaptiveStrategy`: the plugin's learned remainder plus one margin for the whole set.

Each has the ratio strategy's interface: how many blocks the running set keeps free, what a pass that scheduled
something and a preemption do to its state (``pass_ended``, ``on_preemption``), how a pass's budget counts the
running set (``tally``) and what it reports to the gauges it is given (:class:`fdsched.core.views.Gauges`).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

from fdsched.core.adaptive import AdaptiveReserve, SetReservation
from fdsched.core.admission import NewTokenRatio, RatioStrategy, RunningOffset, RunningRecount, nothing_reserved
from fdsched.core.terms import BATCH_MIN
from fdsched.core.views import RunningReader, RunningView

__all__ = ["FixedBlockReserve", "FixedBlockStrategy", "AdaptiveStrategy"]


class FixedBlockReserve:
    """The fixed-block reservation (ratio_reserve off; the pre-change policy) (FD_RESERVE_*_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL).

    ``init`` blocks per running request, decaying by ``decay`` per pass that scheduled something,
    never below ``minimum``; once it reaches 0 the reservation is off ("relaxed") until the next
    preemption puts it back to ``init``.
    """

    def __init__(self, init: int, decay: float, minimum: int) -> None:
        self.init = init
        self.decay = decay
        self.minimum = minimum
        self.current = init
        self._current_float = float(init)
        self.relaxed = True

    def threshold(self, chunk_blocks: int, num_running: int) -> int:
        if self.relaxed:
            return chunk_blocks
        return chunk_blocks + num_running * self.current

    def after_schedule(self, scheduled_anything: bool) -> None:
        if not scheduled_anything:
            return
        self._current_float -= self.decay
        self.current = max(int(self._current_float), self.minimum, 0)
        if self.current == 0:
            self.relaxed = True

    def on_preemption(self) -> None:
        self.current = self.init
        self._current_float = float(self.init)
        self.relaxed = False

class FixedBlockStrategy:
    """The pre-change policy: ``current`` blocks per running request after a preemption, decaying by ``decay``
    per pass that scheduled something; once at 0 the reservation is off ("relaxed") until the next preemption
    (:class:`FixedBlockReserve`)."""

    def __init__(self, fixed: FixedBlockReserve) -> None:
        self.fixed = fixed

    @property
    def relaxed(self) -> bool:
        """Nothing is reserved, and the threshold is the chunk itself (no speculative slack either)."""
        return self.fixed.relaxed

    def set_blocks(self, running: Sequence[RunningView]) -> int:
        return 0 if self.fixed.relaxed else len(running) * self.fixed.current

    def tally(self, reader: RunningReader):
        """A count of the running requests, nothing read of each."""
        return RunningRecount(self.set_blocks)

    def most_tally(self, reader: RunningReader):
        """No bound ahead of the count: the count itself reads nothing of each request."""
        return None

    def idle_pass(self) -> None:
        """Nothing is kept between passes."""

    def most_blocks(self, budget: int) -> int:
        """The most one request keeps free under this policy, whatever its budget: the amount after a preemption."""
        return max(self.fixed.init, self.fixed.minimum, 0)

    def after_pass(self, scheduled_anything: bool) -> None:
        self.fixed.after_schedule(scheduled_anything)

    def pass_ended(self, scheduled_anything: Optional[bool], counted: bool, gauges=None) -> None:
        """A ``schedule()`` pass ended (:meth:`RatioStrategy.pass_ended`): the amount decays after one that scheduled
        something."""
        if scheduled_anything:
            self.after_pass(True)

    def on_preemption(self, running: Sequence[RunningView] = (), count: int = 1) -> None:
        self.fixed.on_preemption()

    def report(self, gauges=None, exact: bool = False) -> None:
        """Its state's gauges (none: the budget's reserved figure says it)."""

    def report_decision(self, gauges=None) -> None:
        """What the last :meth:`set_blocks` decided, beyond the reserved figure (nothing here)."""

class AdaptiveStrategy(RatioStrategy):
    """The plugin's own: each running request's expected remainder learned from finished requests, plus one
    margin ``k x sqrt(sum of variances)`` for the running set (:class:`fdsched.core.adaptive.AdaptiveReserve`),
    never more than upstream's formula gives the same requests. Until a kind has enough samples a request
    falls back (:func:`fdsched.core.warmup.warmup_reserve_blocks`, with ``fixed``'s current amount for an
    unbounded one). A third-party ``fdsched_estimate_reserve_blocks`` answer (``override``) counts for its
    request outside the set's margin. A preemption raises k and resets ``fixed``."""

    def __init__(
        self,
        ratio: NewTokenRatio,
        clip: int,
        block_size: int,
        extra_blocks_per_decode: int,
        override: Callable,
        adaptive: AdaptiveReserve,
        fixed: FixedBlockReserve,
        decodes: bool = True,
        pure: Callable[[], bool] = lambda: False,
    ) -> None:
        # pure(): no third party answers for a request (``override`` then answers None for every one)
        super().__init__(ratio, clip, block_size, extra_blocks_per_decode, override, decodes, pure)
        self.adaptive = adaptive
        self.fixed = fixed
        self.last: Optional[SetReservation] = None  # the last set_blocks' answer (for the metrics)
        self.last_k: float = adaptive.k  # the margin factor that answer used

    def _fixed_blocks(self) -> int:
        return 0 if self.fixed.relaxed else self.fixed.current

    def request_blocks(self, view: RunningView) -> int:
        """One running request's blocks, asked alone: the set of that one request."""
        return self.set_blocks((view,))

    def tally(self, reader: RunningReader):
        """How a pass counts the running set: with no third party answering, the set's terms as an offset
        (:class:`RunningOffset` over :class:`fdsched.core.adaptive.SetTally`: a request's terms are added once per
        pass, the sums taken at each ask); else the whole set at every ask through views kept for the pass (a
        request whose output has not grown is not viewed again)."""
        if not self.decodes:
            return RunningRecount(nothing_reserved)
        if self.pure():
            return RunningOffset(lambda: _AdaptiveSum(self, reader))
        set_blocks, views, kept = self.set_blocks, reader.views, {}
        return RunningRecount(lambda requests: set_blocks(views(requests, kept)))

    def set_blocks(self, running: Sequence[RunningView]) -> int:
        """The whole running set at once (:meth:`fdsched.core.adaptive.AdaptiveReserve.set_reservation`: it
        depends on the set, not on the order of its requests); a request a third party answers for counts
        outside the set."""
        if not self.decodes:
            return 0
        # The views go to the estimator as they are (it reads max_tokens, budget and generated): asked at every
        # admission for every running request, a copy per request and ask would cost more than the answer.
        estimate, ratio, clip, block_size = self.estimate, self.ratio.value, self.clip, self.block_size
        outside, learned = 0, []
        for view in running:
            override = estimate(view.request_id, view.budget, view.generated, ratio, clip, block_size)
            if override is not None:
                outside += override
            else:
                learned.append(view)
        self.last = self.adaptive.set_reservation(learned, ratio, clip, block_size, self._fixed_blocks())
        self.last_k = self.adaptive.k
        return outside + self.last.blocks

    def after_pass(self, scheduled_anything: bool) -> None:
        super().after_pass(scheduled_anything)
        self.fixed.after_schedule(scheduled_anything)  # the warm-up fallback for unbounded requests

    def on_preemption(self, running: Sequence[RunningView] = (), count: int = 1) -> None:
        # The reservation was too small: widen the margin; the warm-up fallback resets like the legacy policy.
        self.adaptive.observe_preemption(count)
        self.fixed.on_preemption()
        super().on_preemption(running, count)

    def report_decision(self, gauges=None) -> None:
        last = self.last
        if gauges is not None and last is not None:
            k = self.last_k  # as decided: a preemption since (which raises k) does not rewrite the figures
            gauges.adaptive_decision(last.mean, k * math.sqrt(max(last.variance, 0.0)), k, last.fallbacks)


class _AdaptiveSum:
    """:class:`AdaptiveStrategy`'s running set for a :class:`RunningOffset`: requests are read as
    ``(max_tokens, budget, generated)`` keys (many at once: as the reader's three arrays, where the estimator
    computes over arrays and the reader gives them) and added to the estimator's
    :class:`~fdsched.core.adaptive.SetTally`; every answer is the strategy's last decision (its metrics)."""

    __slots__ = ("strategy", "keys", "columns", "set")

    def __init__(self, strategy: "AdaptiveStrategy", reader: RunningReader) -> None:
        self.strategy, self.keys = strategy, reader.keys
        columns = getattr(reader, "columns", None)
        self.columns = columns if strategy.adaptive._batch else None
        self.set = strategy.adaptive.set_tally(
            strategy.ratio.value, strategy.clip, strategy.block_size, strategy._fixed_blocks()
        )

    def add(self, requests: Sequence) -> None:
        if self.columns is not None and len(requests) >= BATCH_MIN:
            self.set.add_columns(*self.columns(requests))
        else:
            self.set.add(self.keys(requests))

    def blocks(self) -> int:
        strategy = self.strategy
        strategy.last = reservation = self.set.reservation()
        strategy.last_k = strategy.adaptive.k
        return reservation.blocks

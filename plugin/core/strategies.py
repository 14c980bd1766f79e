"""Change 3's reservation strategies: how many blocks the running set keeps free for the tokens it will still
generate, in plain values (nothing here imports FastDeploy).

* :class:`FixedBlockStrategy`: the pre-change policy (``FD_RESERVE_*_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL``);
* :class:`RatioStrategy`: upstream's new_token_ratio formula (PR 7444/7783);
* :class:`AdaptiveStrategy`: the plugin's learned remainder plus one margin for the whole set.

A strategy also carries its state between passes: what a pass that scheduled something does (``after_pass``; the
scheduler ends each pass with one call, :meth:`RatioStrategy.pass_ended`) and what a preemption does
(``on_preemption``). It chooses how a pass's budget (:class:`fdsched.core.admission.AdmissionBudget`) counts the
running set (:meth:`RatioStrategy.tally`) and reports its decisions to the gauges it is given
(:class:`fdsched.core.admission.Gauges`), if any.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Optional, Sequence

from fdsched.core.adaptive import AdaptiveReserve, SetReservation
from fdsched.core.admission import (
    BlockSum, FixedBlockReserve, KeptSum, NewTokenRatio, RunningOffset, RunningReader, RunningRecount, RunningView,
)
from fdsched.core.terms import BATCH_MIN

__all__ = ["FixedBlockStrategy", "RatioStrategy", "AdaptiveStrategy"]


class FixedBlockStrategy:
    """The pre-change policy: ``current`` blocks per running request after a preemption, decaying by ``decay``
    per pass that scheduled something; once at 0 the reservation is off ("relaxed") until the next preemption
    (:class:`fdsched.core.admission.FixedBlockReserve`)."""

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

    def report(self, gauges=None) -> None:
        """Its state's gauges (none: the budget's reserved figure says it)."""

    def report_decision(self, gauges=None) -> None:
        """What the last :meth:`set_blocks` decided, beyond the reserved figure (nothing here)."""


def _least_left(tokens: int, ratio: float) -> int:
    """The least budget left ``n`` (a whole number, at least 1) with ``int(n x ratio) >= tokens``, ``ratio > 0``:
    estimated by division and settled with the product itself, as the formula computes it."""
    least = max(1, math.ceil(tokens / ratio))
    while least > 1 and int((least - 1) * ratio) >= tokens:
        least -= 1
    while int(least * ratio) < tokens:
        least += 1
    return least


class RatioStrategy:
    """Upstream's formula: each running request keeps ``ceil(min(budget - generated, clip) x ratio / block)``
    blocks (``estimate``: the ``fdsched_estimate_reserve_blocks`` hook, whose default is that formula); the
    ratio decays after every pass that scheduled something and is re-estimated after a preemption
    (:class:`fdsched.core.admission.NewTokenRatio`). ``decodes=False`` (a prefill node, whose requests leave
    after their first token) reserves nothing; the ratio still moves."""

    relaxed = False

    def __init__(
        self,
        ratio: NewTokenRatio,
        clip: int,
        block_size: int,
        extra_blocks_per_decode: int,
        estimate: Callable,
        decodes: bool = True,
        pure: Callable[[], bool] = lambda: False,
    ) -> None:
        self.ratio = ratio
        self.clip = clip
        self.block_size = block_size
        self.extra_blocks_per_decode = extra_blocks_per_decode
        self.estimate = estimate
        self.decodes = decodes
        # pure(): ``estimate`` is the plugin's own formula now (no third party registered): the set's blocks are
        # then a sum over the requests' budgets left (:meth:`lefts_blocks`), kept through a pass (:meth:`tally`);
        # a third party's hook may keep state of its own and is asked for every request at every ask
        self.pure = pure
        self._reported = None  # the ratio this strategy's gauge shows (report)
        self._most: Optional[KeptSum] = None  # the running set's bound, kept from pass to pass (most_tally)

    def most_blocks(self, budget: int) -> int:
        """The most a request with output budget ``budget`` can ever keep free here: upstream's formula over its
        whole budget at the ratio's top (:attr:`NewTokenRatio.top`). Its reservation only shrinks from there as it
        generates and as the ratio decays, and the adaptive estimator's never exceeds the formula's.
        (:func:`fdsched.core.admission.reserve_blocks_for_request` with nothing generated, inline: the reader asks it
        for every request it keeps.)"""
        tokens = int(min(budget, self.clip) * self.ratio.top)
        return -(-tokens // self.block_size) if tokens > 0 else 0

    def most_tally(self, reader: RunningReader):
        """A bound on the running set's blocks (:meth:`RunningReader.mosts`: each request's most, read from what the
        reader keeps), kept from pass to pass (:class:`KeptSum`): an admission whose chunk fits beside it needs no
        count. None where a third party answers for requests (its answer has no known bound) or nothing is
        reserved."""
        if not self.decodes or not self.pure():
            self._most = None
            return None
        kept = self._most
        if kept is None or kept.source is not reader:
            kept = self._most = KeptSum(reader.mosts, reader)
        return kept.open_pass()

    def idle_pass(self) -> None:
        """A pass asked nothing: the kept bound lets go of the requests it holds (it counts afresh next time)."""
        if self._most is not None:
            self._most.forget()

    def request_blocks(self, view: RunningView) -> int:
        """What one running request keeps free, asked alone."""
        if not self.decodes:
            return 0
        return self.estimate(view.request_id, view.budget, view.generated, self.ratio.value, self.clip, self.block_size)

    def set_blocks(self, running: Sequence[RunningView]) -> int:
        """The running set's blocks: the estimate of each request, summed."""
        return sum(self.request_blocks(view) for view in running)

    def lefts_blocks(self, lefts: Sequence[int]) -> int:
        """Upstream's formula summed over requests given by their budget left (``budget - generated``): what
        :meth:`set_blocks` gives with the plugin's own estimate
        (:func:`fdsched.core.admission.reserve_blocks_for_request`), without a call per request.

        A request's blocks, ``ceil(int(min(left, clip) x ratio) / block)``, only grow with its budget left, by one
        block at each of a few thresholds (the least budget left that reaches each block). So the sum is, over those
        thresholds, how many requests reach each: with the budgets left sorted, one bisection per threshold. That is
        the way when the thresholds are few next to the requests (a short clip, or budgets left that are small
        next to the block); else one loop over the requests."""
        ratio, clip, block_size = self.ratio.value, self.clip, self.block_size
        if ratio <= 0 or clip <= 0 or not lefts:
            return 0  # int(min(left, clip) x ratio) is never above 0
        top = min(max(lefts), clip)
        if top <= 0:
            return 0
        round_up = block_size - 1
        steps = (int(top * ratio) + round_up) // block_size  # the blocks of the request with the most left
        if steps * 16 > len(lefts):  # a threshold (its search and bisection) costs about 16 turns of the loop
            whole = partial = 0
            for left in lefts:
                if left >= clip:
                    whole += 1
                elif left > 0:
                    partial += (int(left * ratio) + round_up) // block_size
            return partial + whole * ((int(clip * ratio) + round_up) // block_size)
        ordered = sorted(lefts)
        count, total, low = len(ordered), 0, 0
        for step in range(steps):
            low = bisect.bisect_left(ordered, _least_left(step * block_size + 1, ratio), low)
            total += count - low
        return total

    def tally(self, reader: RunningReader):
        """How a pass counts the running set (chosen when the pass makes its budget): the plugin's own formula as
        an offset over budgets left (:class:`RunningOffset`); a third party's hook through views, the whole set at
        every ask (:class:`RunningRecount`); nothing on a prefill node."""
        if not self.decodes:
            return RunningRecount(_nothing)
        if self.pure():
            lefts_blocks, lefts = self.lefts_blocks, reader.lefts
            return RunningOffset(lambda: BlockSum(lambda requests: lefts_blocks(lefts(requests))))
        set_blocks, views = self.set_blocks, reader.views
        return RunningRecount(lambda requests: set_blocks(views(requests)))

    def after_pass(self, scheduled_anything: bool) -> None:
        self.ratio.after_schedule(scheduled_anything)

    def pass_ended(self, scheduled_anything: Optional[bool], counted: bool, gauges=None) -> None:
        """A ``schedule()`` pass ended, in one call (the scheduler makes it at the end of every pass):
        :meth:`idle_pass` where the pass ``counted`` nothing, then, unless the host's pass raised
        (``scheduled_anything`` None), :meth:`after_pass` and :meth:`report`."""
        if not counted:
            self.idle_pass()
        if scheduled_anything is None:
            return
        if scheduled_anything:
            self.after_pass(True)
        self.report(gauges)

    def on_preemption(self, running: Sequence[RunningView] = (), count: int = 1) -> None:
        """Re-estimate the ratio from what the running requests did (back to init when nothing runs)."""
        self.ratio.on_preemption(
            [view.generated for view in running],
            [view.budget for view in running],
            sum(view.decoding for view in running),
            self.block_size,
            self.extra_blocks_per_decode,
        )

    def report(self, gauges=None) -> None:
        """The ratio's gauge, set only when the ratio moved since this strategy last set it (at its floor it stays
        put pass after pass, and a gauge update costs about as much as the rest of a pass's own work)."""
        value = self.ratio.value
        if gauges is not None and value != self._reported:
            self._reported = value
            gauges.ratio(value)

    def report_decision(self, gauges=None) -> None:
        """What the last :meth:`set_blocks` decided, beyond the reserved figure (nothing here)."""


def _nothing(requests) -> int:
    return 0


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
            return RunningRecount(_nothing)
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

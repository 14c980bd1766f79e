"""Change 3's admission decision: one budget per ``schedule()`` pass, with the reservation policy behind it.

The host admits a prefill chunk (a new request's, or the next chunk of a running one) when
``cache_manager.can_allocate_gpu_blocks(threshold)`` holds, where the threshold is the chunk's own blocks plus
what the running requests keep free for the tokens they will still generate. This module is that decision,
in plain values (nothing here imports FastDeploy):

* a **strategy** says how many blocks the running set keeps free: :class:`FixedBlockStrategy` (the
  pre-change policy, ``FD_RESERVE_*_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL``), :class:`RatioStrategy`
  (upstream's new_token_ratio formula, PR 7444/7783) and :class:`AdaptiveStrategy` (the plugin's learned
  remainder plus one margin for the whole set). A strategy also carries its state between passes: what
  a pass that scheduled something does (:meth:`after_pass`) and what a preemption does (:meth:`on_preemption`).
* an :class:`AdmissionBudget` is opened by the scheduler at the start of every ``schedule()`` pass, asked by
  every admission in it (:meth:`AdmissionBudget.threshold`) and closed at the pass's end. It is the model of
  SGLang's ``PrefillAdder`` (one object per pass that every admission asks). It keeps no running offset: within a
  pass the running set changes as requests are admitted and preempted, and the host's own threshold (which
  decisions must match byte for byte) is a sum over the running set as it is at each ask. Instead it keeps each
  request's answer for the pass (``memo``), so a later ask estimates only the requests new to the pass (or all of
  them again after a preemption moved the ratio) and sums the rest.

The scheduler side (``fdsched.patches.ratio_reserve``) turns host requests into :class:`RunningView` values
and applies the answers at the host's seams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence

from fdsched.core.adaptive import AdaptiveReserve, SetReservation
from fdsched.core.metrics import METRICS
from fdsched.core.policies import FixedBlockReserve, NewTokenRatio

__all__ = [
    "RunningView",
    "FixedBlockStrategy",
    "RatioStrategy",
    "AdaptiveStrategy",
    "AdmissionBudget",
]


class RunningView(NamedTuple):
    """What a strategy knows about one running request.

    A named tuple rather than a frozen dataclass: the scheduler builds one per running request at every
    admission decision, and a frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field) costs
    several times a tuple's construction; it is as immutable and reads the same."""

    request_id: str
    budget: int  # its output budget: max_tokens, else what the context leaves
    generated: int  # output tokens so far
    max_tokens: Optional[int]  # the client's bound (fdsched.core.adaptive.client_bound), None when it says nothing
    decoding: bool


class FixedBlockStrategy:
    """The pre-change policy: ``current`` blocks per running request after a preemption, decaying by ``decay``
    per pass that scheduled something; once at 0 the reservation is off ("relaxed") until the next preemption
    (:class:`fdsched.core.policies.FixedBlockReserve`)."""

    def __init__(self, fixed: FixedBlockReserve) -> None:
        self.fixed = fixed

    @property
    def relaxed(self) -> bool:
        """Nothing is reserved, and the threshold is the chunk itself (no speculative slack either)."""
        return self.fixed.relaxed

    def set_blocks(self, running: Sequence[RunningView], memo: Optional[dict] = None) -> int:
        return 0 if self.fixed.relaxed else len(running) * self.fixed.current

    def after_pass(self, scheduled_anything: bool) -> None:
        self.fixed.after_schedule(scheduled_anything)

    def on_preemption(self, running: Sequence[RunningView] = (), count: int = 1) -> None:
        self.fixed.on_preemption()

    def report(self, of=None) -> None:
        """Its state's gauges (none: the budget's reserved figure says it)."""

    def report_decision(self, of=None) -> None:
        """What the last :meth:`set_blocks` decided, beyond the reserved figure (nothing here)."""


_MEMO_RATIO = object()  # the key under which a pass's memo keeps the ratio its answers used


class RatioStrategy:
    """Upstream's formula: each running request keeps ``ceil(min(budget - generated, clip) x ratio / block)``
    blocks (``estimate``: the ``fdsched_estimate_reserve_blocks`` hook, whose default is that formula); the
    ratio decays after every pass that scheduled something and is re-estimated after a preemption
    (:class:`fdsched.core.policies.NewTokenRatio`). ``decodes=False`` (a prefill node, whose requests leave
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
        # pure(): ``estimate`` answers from its arguments alone now (the plugin's formula, no third party
        # registered): a pass may keep its answers (:meth:`set_blocks`); a third party's hook may keep state of its
        # own and is asked every time
        self.pure = pure

    def request_blocks(self, view: RunningView) -> int:
        """What one running request keeps free, asked alone."""
        if not self.decodes:
            return 0
        return self.estimate(view.request_id, view.budget, view.generated, self.ratio.value, self.clip, self.block_size)

    def set_blocks(self, running: Sequence[RunningView], memo: Optional[dict] = None) -> int:
        """The running set's blocks. ``memo`` (a pass's :attr:`AdmissionBudget.memo`), used when ``estimate`` is
        the plugin's own formula (``pure()``): each request's answer is kept there with the view it answered and
        the ratio it used, and reused while the scheduler hands the same view (the same object: nothing about the
        request changed) and the ratio has not moved, so a pass's later admissions estimate only the requests that
        are new to it."""
        if memo is None or not self.decodes or not self.pure():
            return sum(self.request_blocks(view) for view in running)
        ratio = self.ratio.value
        if memo.get(_MEMO_RATIO) != ratio:  # a preemption re-estimated the ratio: every answer is stale
            memo.clear()
            memo[_MEMO_RATIO] = ratio
        estimate, clip, block_size = self.estimate, self.clip, self.block_size
        total = 0
        for view in running:
            kept = memo.get(view.request_id)
            if kept is not None and kept[0] is view:
                total += kept[1]
                continue
            blocks = estimate(view.request_id, view.budget, view.generated, ratio, clip, block_size)
            memo[view.request_id] = (view, blocks)
            total += blocks
        return total

    def after_pass(self, scheduled_anything: bool) -> None:
        self.ratio.after_schedule(scheduled_anything)

    def on_preemption(self, running: Sequence[RunningView] = (), count: int = 1) -> None:
        """Re-estimate the ratio from what the running requests did (back to init when nothing runs)."""
        self.ratio.on_preemption(
            [view.generated for view in running],
            [view.budget for view in running],
            sum(view.decoding for view in running),
            self.block_size,
            self.extra_blocks_per_decode,
        )

    def report(self, of=None) -> None:
        METRICS.ratio(self.ratio.value, of=of)

    def report_decision(self, of=None) -> None:
        """What the last :meth:`set_blocks` decided, beyond the reserved figure (nothing here)."""


class AdaptiveStrategy(RatioStrategy):
    """The plugin's own: each running request's expected remainder learned from finished requests, plus one
    margin ``k x sqrt(sum of variances)`` for the running set (:class:`fdsched.core.adaptive.AdaptiveReserve`),
    never more than upstream's formula gives the same requests. Until a kind has enough samples a request
    falls back (:func:`fdsched.core.adaptive.warmup_reserve_blocks`, with ``fixed``'s current amount for an
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
    ) -> None:
        super().__init__(ratio, clip, block_size, extra_blocks_per_decode, override, decodes)
        self.adaptive = adaptive
        self.fixed = fixed
        self.last: Optional[SetReservation] = None  # the last set_blocks' answer (for the metrics)
        self.last_k: float = adaptive.k  # the margin factor that answer used

    def _fixed_blocks(self) -> int:
        return 0 if self.fixed.relaxed else self.fixed.current

    def request_blocks(self, view: RunningView) -> int:
        """One running request's blocks, asked alone: the set of that one request."""
        return self.set_blocks((view,))

    def set_blocks(self, running: Sequence[RunningView], memo: Optional[dict] = None) -> int:
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

    def report_decision(self, of=None) -> None:
        last = self.last
        if last is not None:
            k = self.last_k  # as decided: a preemption since (which raises k) does not rewrite the figures
            METRICS.adaptive_decision(last.mean, k * math.sqrt(max(last.variance, 0.0)), k, last.fallbacks, of=of)


@dataclass
class AdmissionBudget:
    """One ``schedule()`` pass's admission decision: opened at the pass's start, asked by every admission,
    closed at its end.

    ``slack`` is what a speculative-decoding engine adds to a threshold that reserves something (one block,
    within the per-sequence maximum). ``declined`` (the old host's guard) holds the running chunks the budget
    refused in this pass: the scheduler declines their preemption call instead of preempting.
    """

    strategy: object
    slack: Callable[[int], int] = lambda blocks: blocks
    declined: set = field(default_factory=set)
    reserved: Optional[int] = None  # the running set's blocks at the last ask
    # The scheduler's views of this pass's running requests, by request id (request, generated, view): a pass
    # asks once per admission, and a request that generated nothing since the last ask is seen as it was.
    views: dict = field(default_factory=dict)
    # What the strategy answered per request in this pass (:meth:`RatioStrategy.set_blocks`): with ``views`` it
    # makes a pass's later admissions cost the requests new to the pass, not the whole running set again.
    memo: dict = field(default_factory=dict)
    asks: int = 0
    closed: bool = False

    def threshold(self, chunk_blocks: int, running: Sequence[RunningView]) -> int:
        """Blocks that must be free for a chunk of ``chunk_blocks`` to be admitted now."""
        if self.closed:
            raise RuntimeError("AdmissionBudget: asked after its schedule() pass was closed")
        self.asks += 1
        strategy = self.strategy
        self.reserved = strategy.set_blocks(running, self.memo)
        total = chunk_blocks + self.reserved
        return total if strategy.relaxed else self.slack(total)

    def close(self) -> set:
        """End the pass; returns the declines nobody consumed (the host did not call what the guard relies on)."""
        self.closed = True
        left, self.declined = self.declined, set()
        return left

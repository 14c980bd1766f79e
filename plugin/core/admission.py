"""Change 3's admission decision in plain values (nothing here imports FastDeploy): upstream's ratio strategy and
one budget per ``schedule()`` pass that every admission asks for its verdict.

The host admits a prefill chunk when ``cache_manager.can_allocate_gpu_blocks(threshold)`` holds, the threshold being
the chunk's blocks plus what the running requests keep free for the tokens they will still generate. Here:

* the **formulas** and the ratio's state (:class:`NewTokenRatio`: ``FD_INIT_NEW_TOKEN_RATIO``, decayed per pass,
  re-estimated after a preemption), and :class:`RatioStrategy`, upstream's reservation over them (the other two
  strategies, the pre-change fixed blocks and the plugin's adaptive estimator: :mod:`fdsched.core.strategies`);
* an :class:`AdmissionBudget`, made at a pass's first need, asked by every admission, closed at the pass's end (as
  SGLang's ``PrefillAdder``). An admission is one call, :meth:`AdmissionBudget.admit`, answered with a
  :class:`Verdict` (the blocks, and whether they are admitted), as vLLM's ``allocate_slots`` answers;
* the **tallies**: how a budget counts the running set's blocks at each ask (:class:`RunningOffset`: the whole set
  at a pass's first ask, then only the requests admitted since; :class:`RunningRecount`: the whole set every time;
  :class:`KeptSum`: a bound kept from pass to pass).

The scheduler side (``fdsched.patches.ratio_reserve``) reads host requests and applies the answers at its seams.
"""

from __future__ import annotations

import bisect
import math
import operator
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple, Optional, Sequence

from fdsched.core.common import ceil_div
from fdsched.core.views import RunningReader, RunningView


__all__ = ["AdmissionBudget", "Verdict", "RatioStrategy", "NewTokenRatio", "RunningOffset", "RunningRecount",
           "BlockSum", "KeptSum", "max_new_tokens_of", "reserve_blocks_for_request", "reestimate_new_token_ratio"]


# ---- the reservation's formulas (upstream PR 7444 / 2.6 cherry-pick 7783; the code is our own) ----------
def max_new_tokens_of(max_tokens: Optional[int], max_model_len: int, prompt_len: int) -> int:
    """A request's output budget: its ``max_tokens``, or what is left of the context when unset."""
    if max_tokens is None:
        return max_model_len - prompt_len
    return int(max_tokens)


def reserve_blocks_for_request(
    max_new_tokens: int, generated_tokens: int, ratio: float, clip_max_new_tokens: int, block_size: int
) -> int:
    """Blocks to keep free for one running request's future decode tokens.

    ``ceil(max(int(min(max_new_tokens - generated, clip) * ratio), 0) / block_size)``: a request
    that already generated more than its budget reserves nothing.
    """
    remaining = max_new_tokens - generated_tokens
    clipped = min(remaining, clip_max_new_tokens)
    reserved_tokens = max(int(clipped * ratio), 0)
    return ceil_div(reserved_tokens, block_size)


def reestimate_new_token_ratio(
    generated: Iterable[int],
    max_new_tokens: Iterable[int],
    num_decoding: int,
    block_size: int,
    extra_blocks_per_decode: int,
    cap: float,
) -> float:
    """The ratio after a preemption: how much of their budgets running requests have used.

    ``(sum(generated) + extra_blocks_per_decode * block_size * num_decoding) / (sum(max_new) + 1)``,
    capped at ``cap`` (upstream: the initial ratio; SGLang: 1.0).
    """
    total_generated = sum(generated)
    total_budget = sum(max_new_tokens)
    estimate = (total_generated + extra_blocks_per_decode * block_size * num_decoding) / (total_budget + 1)
    return min(estimate, cap)


class NewTokenRatio:
    """The new_token_ratio state machine of the ratio-based reservation policy."""

    def __init__(self, init: float, minimum: float, decay: float, cap: Optional[float] = None) -> None:
        self.init = init
        self.minimum = minimum
        self.decay = decay
        self.cap = init if cap is None else cap
        self.value = init
        # The most the ratio can ever be: it starts at ``init``, only decays after a pass, and a re-estimate gives at
        # most ``cap`` (``init`` again when nothing runs). Both are fixed from here on.
        self.top = max(self.init, self.cap)

    def after_schedule(self, scheduled_anything: bool) -> None:
        """Relax the reservation a little after every pass that scheduled something."""
        if scheduled_anything:
            self.value = max(self.value - self.decay, self.minimum)

    def on_preemption(
        self,
        generated: Sequence[int],
        max_new_tokens: Sequence[int],
        num_decoding: int,
        block_size: int,
        extra_blocks_per_decode: int,
    ) -> float:
        """Re-estimate from what the running requests did; back to init if nothing runs."""
        if not generated:
            self.value = self.init
        else:
            self.value = reestimate_new_token_ratio(
                generated, max_new_tokens, num_decoding, block_size, extra_blocks_per_decode, self.cap
            )
        return self.value


class RunningRecount:
    """A pass's tally that counts the whole running set at every ask: ``count(requests) -> blocks``."""

    def __init__(self, count: Callable[[Sequence], int]) -> None:
        self.count = count

    def blocks(self, running: Sequence) -> int:
        return self.count(running)

    def forget(self) -> None:
        """Nothing is kept between asks."""


class RunningOffset:
    """A pass's tally for a set whose reservation adds up request by request: the whole running list at the pass's
    first ask, then only the requests appended since (the pass's admissions), into ``new_sum()`` (``add(requests)``,
    ``blocks()``: :class:`BlockSum`, :class:`fdsched.core.adaptive.SetTally`). It starts over when the list is
    another object, shorter, or no longer holds the last request counted where it was, and after :meth:`forget` (a
    preemption moved the ratio). Output that grows while the pass is open counts from the next pass."""

    def __init__(self, new_sum: Callable[[], object]) -> None:
        self.new_sum = new_sum
        self.sum = None
        self.members: Optional[Sequence] = None  # the running list counted
        self.counted = 0  # how many of its first entries
        self.last = None  # the last of them

    def blocks(self, running: Sequence) -> int:
        size, counted = len(running), self.counted
        if running is self.members and counted <= size and (counted == 0 or running[counted - 1] is self.last):
            if size > counted:
                self.sum.add(running[counted:])
        else:
            self.sum = self.new_sum()
            self.sum.add(running)
            self.members = running
        self.counted = size
        self.last = running[size - 1] if size else None
        return self.sum.blocks()

    def forget(self) -> None:
        """Count the whole set again at the next ask."""
        self.members = None


class KeptSum:
    """A sum over the running list (``count(requests) -> int``) kept from pass to pass: a pass's first ask compares
    the list with its own copy of the one counted, by identity (in C: no request is read), and counts only the
    requests appended since where it begins with it; later asks go on as :class:`RunningOffset`. :meth:`forget`
    (after a pass that asked nothing) lets the requests go. ``floor``: what the budget counted last (free blocks
    that do not cover it are counted without reading the bound)."""

    __slots__ = ("count", "source", "members", "counted", "total", "strict", "floor")

    def __init__(self, count: Callable[[Sequence], int], source=None) -> None:
        self.count = count
        self.source = source  # what ``count`` reads (the reader it was made for)
        self.members = None  # the running list last counted
        self.counted: Optional[list] = None  # a copy of it as counted
        self.total = 0
        self.strict = True  # the next ask compares every request (a pass's first)
        self.floor = 0  # the running set's blocks at the last count (AdmissionBudget): the bound is never below it

    def open_pass(self) -> "KeptSum":
        """A pass begins: its first ask compares the whole list with the one counted."""
        self.strict = True
        return self

    def blocks(self, running: Sequence) -> int:
        counted, size = self.counted, len(running)
        if counted is not None:
            n = len(counted)
            if self.strict:  # from another pass: anything may have changed; every request is compared
                same = size >= n and all(map(operator.is_, running, counted))
            else:  # within the pass, as RunningOffset
                same = running is self.members and size >= n and (n == 0 or running[n - 1] is counted[n - 1])
            if same:
                if size > n:
                    more = running[n:]
                    self.total += self.count(more)
                    counted += more  # the list as counted (its first n are running's own, as just compared)
                self.members, self.strict = running, False
                return self.total
        self.total = self.count(running)
        self.counted, self.members, self.strict = list(running), running, False
        return self.total

    def forget(self) -> None:
        """Count the whole list at the next ask, and hold no request meanwhile."""
        self.counted = self.members = None


class BlockSum:
    """A sum of blocks over requests: ``count(requests)`` gives those requests' blocks."""

    __slots__ = ("count", "total")

    def __init__(self, count: Callable[[Sequence], int]) -> None:
        self.count = count
        self.total = 0

    def add(self, requests: Sequence) -> None:
        self.total += self.count(requests)

    def blocks(self) -> int:
        return self.total


class Verdict(NamedTuple):
    """One admission's answer (:meth:`AdmissionBudget.admit`): ``blocks``, the chunk's plus the running set's
    reserve (the threshold the host checks next); ``admitted``, whether the pool has them; ``settled``, decided by
    the free blocks alone at the running set's most possible reserve (nothing counted, the pool not asked), else
    the pool answered, evicting cached blocks where it could."""

    blocks: int
    admitted: bool
    settled: bool


@dataclass
class AdmissionBudget:
    """One ``schedule()`` pass's admission decision: made at the pass's first need, asked by every admission
    (:meth:`admit`), closed at its end.

    ``tally`` counts the running set's blocks at each ask (:meth:`RatioStrategy.tally`). ``pool`` answers whether
    a count of blocks can be had (the cache manager's block check, evicting cached blocks to find them; the host's
    own check of the verdict's blocks then finds them free, or nothing left to evict). ``slack``: what speculative
    decoding adds to a threshold that reserves something. ``declined`` (the running-chunk guard): the running chunks
    refused in this pass, whose preemption call the scheduler declines. ``most`` and ``free`` (both or neither): a
    bound on the running set's blocks (:meth:`RatioStrategy.most_tally`) and the free blocks now; an ask whose
    threshold at the bound the free blocks cover is admitted without counting (a settled :class:`Verdict`: where
    the free blocks cover a threshold, the host's check takes nothing and says yes).
    """

    strategy: object
    tally: object  # RunningOffset or RunningRecount
    pool: Callable[[int], bool]
    slack: Optional[Callable[[int], int]] = None  # None: nothing added (no draft model)
    most: object = None  # KeptSum over each request's most, or None
    free: Optional[Callable[[], int]] = None
    declined: set = field(default_factory=set)
    reserved: Optional[int] = None  # the running set's blocks at the last ask that counted them
    asks: int = 0
    closed: bool = False

    def admit(self, chunk_blocks: int, running: Sequence) -> Verdict:
        """The verdict on admitting a chunk of ``chunk_blocks`` now (``running``: the scheduler's running requests,
        read through the tally)."""
        if self.closed:
            raise RuntimeError("AdmissionBudget: asked after its schedule() pass was closed")
        self.asks += 1
        most = self.most
        if most is not None:
            # Never relaxed here: only a strategy that reserves per request has a bound. The bound is never below
            # the count, which moves little from one count to the next: where the free blocks do not cover the last
            # count's figure (a pool under pressure), the bound is not looked at, and the ask counts at once.
            free = self.free()
            if chunk_blocks + most.floor <= free:
                total = chunk_blocks + most.blocks(running)
                if self.slack is not None:
                    total = self.slack(total)
                if total <= free:
                    return Verdict(total, True, True)
        reserved = self.reserved = self.tally.blocks(running)
        if most is not None:
            most.floor = reserved
        total = chunk_blocks + reserved
        if self.slack is not None and not self.strategy.relaxed:
            total = self.slack(total)
        return Verdict(total, bool(self.pool(total)), False)

    def running_changed(self) -> None:
        """A preemption re-estimated the ratio: the next ask counts the whole running set."""
        self.tally.forget()
        if self.most is not None:
            self.most.forget()

    def close(self) -> set:
        """End the pass; returns the declines nobody consumed (the host did not call what the guard relies on)."""
        self.closed = True
        left, self.declined = self.declined, set()
        return left


GAUGE_STEP = 0.005  # how far the decaying ratio moves before its gauge is set again (RatioStrategy.report)


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
    """Upstream's formula: each running request keeps ``ceil(min(budget - generated, clip) x ratio / block)`` blocks
    (``estimate``: the ``fdsched_estimate_reserve_blocks`` hook, whose default is that formula), the ratio a
    :class:`NewTokenRatio`. ``decodes=False`` (a prefill node) reserves nothing; the ratio still moves."""

    relaxed = False

    def __init__(self, ratio: NewTokenRatio, clip: int, block_size: int, extra_blocks_per_decode: int,
                 estimate: Callable, decodes: bool = True, pure: Callable[[], bool] = lambda: False) -> None:
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
        self._shown = -math.inf  # the ratio this strategy's gauge shows (report; -inf: none yet)
        self._low = 0.0  # a decay to above this leaves the gauge as it is (report)
        self._most: Optional[KeptSum] = None  # the running set's bound, kept from pass to pass (most_tally)

    def most_blocks(self, budget: int) -> int:
        """The most a request with output budget ``budget`` can ever keep free: the formula over its whole budget at
        the ratio's top (:attr:`NewTokenRatio.top`; its reserve only shrinks from there, and the adaptive estimator's
        never exceeds the formula's). :func:`reserve_blocks_for_request` inline: asked for every request kept."""
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
        :meth:`set_blocks` gives with the plugin's own estimate, without a call per request. A request's blocks grow
        with its budget left by one at each of a few thresholds, so where the thresholds are few next to the
        requests the sum is, per threshold, how many requests reach it (one bisection of the sorted budgets left);
        else one loop over the requests."""
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
            return RunningRecount(nothing_reserved)
        if self.pure():
            lefts_blocks, lefts = self.lefts_blocks, reader.lefts
            return RunningOffset(lambda: BlockSum(lambda requests: lefts_blocks(lefts(requests))))
        set_blocks, views = self.set_blocks, reader.views
        return RunningRecount(lambda requests: set_blocks(views(requests)))

    def after_pass(self, scheduled_anything: bool) -> None:
        self.ratio.after_schedule(scheduled_anything)

    def pass_ended(self, scheduled_anything: Optional[bool], counted: bool, gauges=None) -> None:
        """A ``schedule()`` pass ended (called after every pass): :meth:`idle_pass` where the pass ``counted``
        nothing, then, unless the host's pass raised (``scheduled_anything`` None), :meth:`after_pass` and
        :meth:`report`; each only where it has work (a bound already let go holds nothing)."""
        most = self._most
        if not counted and most is not None and most.members is not None:
            self.idle_pass()
        if scheduled_anything is None:
            return
        if scheduled_anything:
            self.after_pass(True)
        value, shown = self.ratio.value, self._shown
        if gauges is not None and value != shown and not self._low < value < shown:  # report's own tests, read here
            self.report(gauges)

    def on_preemption(self, running: Sequence[RunningView] = (), count: int = 1) -> None:
        """Re-estimate the ratio from what the running requests did (back to init when nothing runs)."""
        self.ratio.on_preemption([view.generated for view in running], [view.budget for view in running],
                                 sum(view.decoding for view in running), self.block_size, self.extra_blocks_per_decode)

    def report(self, gauges=None, exact: bool = False) -> None:
        """The ratio's gauge: set to a re-estimate (``exact``) or a rise at once; while the ratio decays (by
        ``FD_NEW_TOKEN_RATIO_DECAY`` a pass), once it fell :data:`GAUGE_STEP` since last set, or at its floor (an
        update costs about as much as the rest of a pass's own work; the gauge is read every few seconds)."""
        value, shown = self.ratio.value, self._shown
        if gauges is None or value == shown:
            return
        if exact or not self._low < value < shown:  # a rise at once (or the first), a decay once it reaches low
            self._shown = value
            self._low = max(value - GAUGE_STEP, self.ratio.minimum)
            gauges.ratio(value)

    def report_decision(self, gauges=None) -> None:
        """What the last :meth:`set_blocks` decided, beyond the reserved figure (nothing here)."""


def nothing_reserved(requests) -> int:
    return 0

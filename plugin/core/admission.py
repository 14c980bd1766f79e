"""Change 3's admission decision: the reservation's formulas, and one budget per ``schedule()`` pass with a
reservation strategy behind it.

The host admits a prefill chunk (a new request's, or the next chunk of a running one) when
``cache_manager.can_allocate_gpu_blocks(threshold)`` holds, where the threshold is the chunk's own blocks plus
what the running requests keep free for the tokens they will still generate. This module is that decision,
in plain values (nothing here imports FastDeploy):

* the **formulas**: a request's output budget (:func:`max_new_tokens_of`), upstream's per-request reserve
  (:func:`reserve_blocks_for_request`), the ratio's state (:class:`NewTokenRatio`: ``FD_INIT_NEW_TOKEN_RATIO``,
  decayed per pass, re-estimated after a preemption) and the pre-change fixed-block reserve
  (:class:`FixedBlockReserve`);
* a **strategy** (:mod:`fdsched.core.strategies`) says how many blocks the running set keeps free, and carries its
  state between passes.
* an :class:`AdmissionBudget` is made by the scheduler's ``schedule()`` pass at its first need, asked by
  every admission in it and closed at the pass's end. It is the model of SGLang's ``PrefillAdder`` (one object
  per pass that every admission asks). An admission is one call, :meth:`AdmissionBudget.admit`, whose answer is
  a :class:`Verdict`: the blocks the chunk and the reserve need, and whether they are admitted: at once where the
  free blocks cover them, else by the pool the budget was made with (its check evicts cached blocks to find them,
  and refuses when it cannot), as vLLM's ``allocate_slots`` answers with blocks or None.
* a **tally** is how a budget counts the running set's blocks at each ask, chosen by the strategy when the pass
  makes its budget (``strategy.tally``): a :class:`RunningOffset` where the set's reservation adds up
  request by request (with no third party answering: upstream's formula over budgets left, or the adaptive
  estimator's terms; counted in full at the pass's first ask, then only the requests admitted since, as SGLang's
  ``PrefillAdder`` keeps its running offset), else a :class:`RunningRecount` (the whole set at every ask).

The scheduler side (``fdsched.patches.ratio_reserve``) turns host requests into :class:`RunningView` values
and applies the answers at the host's seams.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple, Optional, Protocol, Sequence

from fdsched.core.common import ceil_div


__all__ = [
    "RunningView",
    "Gauges",
    "AdmissionBudget",
    "Verdict",
    "RunningReader",
    "RunningOffset",
    "RunningRecount",
    "BlockSum",
    "KeptSum",
    "max_new_tokens_of",
    "reserve_blocks_for_request",
    "reestimate_new_token_ratio",
    "NewTokenRatio",
    "FixedBlockReserve",
]


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

    @property
    def top(self) -> float:
        """The most the ratio can ever be: it starts at ``init``, only decays after a pass, and a re-estimate gives
        at most ``cap`` (``init`` again when nothing runs)."""
        return max(self.init, self.cap)

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


class Gauges(Protocol):
    """Where a strategy reports what it decided (the scheduler's metrics, labelled by its arm); a strategy given
    none reports nothing (the replay, the tests)."""

    def ratio(self, value: float) -> None: ...

    def adaptive_decision(self, expected_tokens: float, margin_tokens: float, k: float, fallbacks: int) -> None: ...


class RunningReader(Protocol):
    """What the scheduler reads of its running requests for a strategy (``requests``: the host's own objects)."""

    def views(self, requests: Sequence, kept: Optional[dict] = None) -> list:
        """One :class:`RunningView` per request (``kept``: a pass's views by request id, reused while a request's
        output has not grown)."""

    def lefts(self, requests: Sequence) -> list:
        """Each request's budget left: its output budget minus what it generated."""

    def mosts(self, requests: Sequence) -> int:
        """The most the requests can ever reserve together: each one's :meth:`fdsched.core.strategies.RatioStrategy.most_blocks`, which
        depends only on its output budget."""

    def keys(self, requests: Sequence) -> list:
        """Each request as ``(max_tokens, budget, generated)``, as its :class:`RunningView` has them."""

    def columns(self, requests: Sequence) -> tuple:
        """Optional: the same as three arrays (:func:`fdsched.core.terms.columns_of_keys`), for many requests at
        once."""


class RunningRecount:
    """A pass's tally that counts the whole running set at every ask: ``count(requests) -> blocks``."""

    def __init__(self, count: Callable[[Sequence], int]) -> None:
        self.count = count

    def blocks(self, running: Sequence) -> int:
        return self.count(running)

    def forget(self) -> None:
        """Nothing is kept between asks."""


class RunningOffset:
    """A pass's tally for a set whose reservation adds up request by request: the whole running list at the
    pass's first ask, then, at each later ask, only the requests appended to it since (the admissions of the
    pass). ``new_sum()`` makes an empty sum, with ``add(requests)`` and ``blocks()`` (:class:`BlockSum`,
    :class:`fdsched.core.adaptive.SetTally`).

    It starts over from the whole list when the list is another object, is shorter than what was counted, or no
    longer holds the last request counted where it was (a request left from anywhere but the end, or several
    changed places), and after :meth:`forget` (the scheduler's preemption seam: the ratio moved). What it does
    not see is a request's output growing while the pass is open (the token processor appends without the
    scheduler's lock): those tokens count from the next pass's first ask.
    """

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
    """A sum over the running list kept from one pass to the next (``count(requests) -> int``, a sum over
    requests): at a pass's first ask the list is compared with the one counted, request by request (identity, in C:
    no request is read); where it begins with it, only the requests appended since are counted, else the whole list
    is. Later asks in the pass add the requests appended since as :class:`RunningOffset` does. It holds the list
    counted (a copy of its own, to which an ask appends the requests it added: no ask copies the whole list) until
    :meth:`forget`, which the scheduler calls after a pass that asked nothing. ``floor`` is
    what the budget counted last: a pool whose free blocks do not cover it cannot cover the bound either, most
    likely, and is counted without reading the bound."""

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
    """One admission's answer (:meth:`AdmissionBudget.admit`).

    ``blocks``: what must be free for the chunk to be admitted, the chunk's own blocks plus the running set's
    reserve (the threshold the host's block check is asked). ``admitted``: whether the pool has them. ``settled``:
    decided by the free blocks alone, at the running set's most possible reservation (neither the running set
    counted nor the pool asked); otherwise the budget's pool answered, evicting cached blocks to make room where it
    could (a refusal: the chunk and the reserve do not fit). What the running set counted for it is the budget's
    :attr:`AdmissionBudget.reserved`."""

    blocks: int
    admitted: bool
    settled: bool


@dataclass
class AdmissionBudget:
    """One ``schedule()`` pass's admission decision: made at the pass's first need of it, asked by every admission
    (:meth:`admit`), closed at its end.

    ``tally`` counts the running set's blocks at each ask (the strategy's
    :meth:`fdsched.core.strategies.RatioStrategy.tally`, chosen when the budget is made). ``pool`` answers whether
    a count of blocks can be had (the cache manager's block check, which evicts cached blocks to find them; the
    host asks the same check of the verdict's blocks next, which then finds them free, or, after a refusal, nothing
    left to evict). ``slack`` is what a speculative-decoding engine adds to a threshold that reserves something
    (one block, within the per-sequence maximum). ``declined`` (the running-chunk guard) holds the running chunks
    the budget refused in this pass: the scheduler declines their preemption call instead of preempting.

    ``most`` and ``free`` (both or neither): a bound on the running set's blocks
    (:meth:`fdsched.core.strategies.RatioStrategy.most_tally`) and the pool's free blocks now. Where the host checks
    a threshold by comparing it with its free blocks (taking nothing when they cover it), any threshold they cover
    gets the same answer: an ask whose threshold at the bound is covered is admitted without counting the running
    set (a settled :class:`Verdict`), and only an ask the bound does not settle counts it (``reserved``).
    """

    strategy: object
    tally: object  # RunningOffset or RunningRecount
    pool: Callable[[int], bool]
    slack: Callable[[int], int] = lambda blocks: blocks
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
                total = self.slack(chunk_blocks + most.blocks(running))
                if total <= free:
                    return Verdict(total, True, True)
        reserved = self.reserved = self.tally.blocks(running)
        if most is not None:
            most.floor = reserved
        total = chunk_blocks + reserved
        if not self.strategy.relaxed:
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

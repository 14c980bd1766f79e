"""Adaptive KV reservation: learn the output-length distribution, reserve the running set's expected
remainder plus one margin for the set as a whole. Pure policy code: plain values in, plain values
out; imports nothing from FastDeploy.

Why: upstream's new_token_ratio reservation (PR 7444/7783) keeps ``min(max_tokens - generated, clip)
x ratio`` tokens free per running request. Where clients leave ``max_tokens`` unset the budget is
the rest of the context, and most of that reservation is never used; admission waits for blocks no
request will fill. The legacy policy reserves a fixed amount and preempts instead.

What: every finished request is one sample of the output length ``L``: relative (``L / max_tokens``) where the
client set ``max_tokens``, absolute (tokens) where not. A running request that has generated ``g`` tokens is
expected to generate ``E[L - g | L > g]`` more, with variance ``Var[L - g | L > g]``. The running set reserves the
sum of those means plus ``k x sqrt(sum of the variances)``: one margin for the whole set. The default ``k`` is
negative (-2): the set never needs all of its remainder at once, because a request that finishes gives its blocks
back while the others still grow. The set never keeps more free than its budgets allow, nor more than upstream's
ratio formula would for the same requests, and its answer depends on the set, not on the order of its requests
(:meth:`AdaptiveReserve.set_reservation`).

Warm-up (:func:`fdsched.core.warmup.warmup_reserve_blocks`), drift (a sliding window), censoring (only finished
requests are samples), the preemption feedback on ``k`` (:data:`K_STEP`, :data:`K_BOUND`, :data:`K_DECAY`),
determinism (a function of the events, no clock) and the cost (log-spaced buckets in Fenwick trees,
:mod:`fdsched.core.lengths`; many requests' terms at once through :mod:`fdsched.core.terms`): docs/adaptive.md,
"How the estimator works".
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional

from fdsched.core.common import ceil_div
from fdsched.core.lengths import LengthHistogram
from fdsched.core.admission import reserve_blocks_for_request
from fdsched.core.terms import BATCH_MIN, MEAN_SCALE, SetTerms, batch_terms, columns_of_keys, numpy_or_none
from fdsched.core.terms import prepare as prepare_terms
from fdsched.core.warmup import warmup_reserve_blocks

__all__ = [
    "RemainderEstimate",
    "AdaptiveReserve",
    "RunningRequest",
    "SetReservation",
    "RELATIVE_SCALE",
    "K_DEFAULT",
    "K_BOUND",
    "K_STEP",
    "K_DECAY",
    "margin_blocks",
    "track_live",
    "live_states",
    "client_bound",
]

# Relative samples (L / max_tokens, in (0, 1]) are stored as L / max_tokens * RELATIVE_SCALE.
RELATIVE_SCALE = 4096.0

# The margin factor k, in standard deviations of the running set's total remainder: every constant of it is
# here (the settings' defaults and ranges read these). K_DEFAULT: see the module docstring and docs/adaptive.md; K_BOUND: |k| and
# k after any number of preemptions stay within it; K_STEP: added per preemption; K_DECAY: what each finished
# request leaves of that extra.
K_DEFAULT = -2.0
K_BOUND = 6.0
K_STEP = 0.5
K_DECAY = 0.98

# Schedulers of this process that run the estimator register it here (``fdsched doctor`` shows their state).
_LIVE: "weakref.WeakSet" = weakref.WeakSet()


def track_live(estimator: "AdaptiveReserve") -> None:
    """Make ``estimator`` visible to :func:`live_states` for as long as it exists."""
    _LIVE.add(estimator)


def live_states() -> list:
    """The state (:meth:`AdaptiveReserve.state`) of every estimator a scheduler of this process runs."""
    return [estimator.state() for estimator in list(_LIVE)]


def margin_blocks(mean: float, variance: float, k: float, block_size: int, left: float = math.inf,
                  cap_blocks: float = math.inf) -> int:
    """The one reservation formula: blocks for remainders of total ``mean`` and ``variance`` with a margin of
    ``k`` standard deviations, ``ceil(min(mean + k sqrt(variance), left) / block_size)``, never more than
    ``cap_blocks`` nor less than 0. One request alone and a running set (:meth:`AdaptiveReserve.set_reservation`) both use it."""
    tokens = min(mean + k * math.sqrt(max(variance, 0.0)), left)
    return max(min(ceil_div(int(math.ceil(tokens)), block_size), cap_blocks), 0)


def client_bound(max_tokens: Optional[int], max_model_len: int, prompt_len: int) -> Optional[int]:
    """The request's ``max_tokens`` when it says something about its length, else None.

    A client that leaves ``max_tokens`` unset gets the rest of the context from the engine's data
    processor (FastDeploy's ``base_processor`` fills ``max_model_len - prompt length`` in, and clamps a
    larger value to it), so a running request's ``max_tokens`` is never None in a real engine. A bound
    that equals (or exceeds) what the context leaves is not the client's choice and says nothing about
    the length: such a request is learned and answered in absolute tokens, like an unset one.
    """
    if max_tokens is None or max_tokens < 1:
        return None
    if max_tokens >= max_model_len - prompt_len:
        return None
    return int(max_tokens)


class RemainderEstimate(NamedTuple):
    """Expected remaining output tokens of one running request, and their variance (a named tuple: one is
    made per running request whose output grew, at a pass's first admission decision, and a frozen
    dataclass's ``__init__`` costs several times a tuple's)."""

    mean: float
    variance: float
    left: Optional[float] = None  # what its budget still allows (the most it can use); None: unbounded


@dataclass(frozen=True)
class RunningRequest:
    """What the reservation knows about one running request."""

    max_tokens: Optional[int]  # the client's bound (:func:`client_bound`; None: unset, or no bound at all)
    budget: int  # max_tokens, or what the context leaves (max_model_len - prompt length)
    generated: int


@dataclass(frozen=True)
class SetReservation:
    """One running set's adaptive reservation, computed over the whole set at once
    (:meth:`AdaptiveReserve.set_reservation`)."""

    blocks: int  # what the set keeps free: the learned part plus every fallback, never negative
    mean: float  # expected remaining tokens of the learned requests (sum)
    variance: float  # variance of that sum
    fallbacks: int  # requests answered by the warm-up fallback


class SetTally:
    """A running set's adaptive reservation, built up request by request (:meth:`AdaptiveReserve.set_tally`): a
    pass's running offset adds the requests admitted since its last ask instead of going over the whole set
    again. The per-request terms are added up as they come; the sums themselves are taken at a
    :meth:`reservation` that follows an add, exactly, so the answer is the whole set's whatever the order the
    requests came in: means added over arrays as an integer count of 2**-52 (each is 0 or at least 1), the others
    and the variances with :func:`math.fsum`, the budgets left (whole tokens) as integers."""

    __slots__ = ("estimator", "terms_of", "args", "means", "mean_units", "learned", "variances", "left", "caps",
                 "fallback_blocks", "fallbacks", "sums")

    def __init__(self, estimator: "AdaptiveReserve", terms_of: dict, args: tuple) -> None:
        self.estimator = estimator
        self.terms_of = terms_of  # the estimator's kept terms for these arguments
        self.args = args  # (ratio, clip, block size, fixed blocks)
        self.means: list = []  # the means of requests added one by one
        self.mean_units = 0  # the means of requests added over arrays: their exact sum, in units of 2**-52
        self.learned = 0  # requests the estimator answered for
        self.variances: list = []
        self.left = 0  # what the learned requests' budgets still allow, together (tokens: an exact integer sum)
        self.caps = 0
        self.fallback_blocks = 0
        self.fallbacks = 0
        self.sums = (0, 0.0, 0.0)  # (learned requests summed, sum of means, sum of variances)

    def add(self, keys: Iterable[tuple]) -> None:
        """Add requests given as ``(max_tokens, budget, generated)`` (``max_tokens``: the client's bound, or
        None)."""
        keys = keys if isinstance(keys, list) else list(keys)
        if self.estimator._batch and len(keys) >= BATCH_MIN:
            self.add_columns(*columns_of_keys(keys))
            return
        terms_of, request_terms, args = self.terms_of, self.estimator._request_terms, self.args
        means, variances = self.means, self.variances
        learned = left = caps = fallback_blocks = fallbacks = 0
        for key in keys:
            terms = terms_of.get(key)
            if terms is None:
                terms = terms_of[key] = request_terms(key[0], key[1], key[2], *args)
            if terms[0] is None:
                fallbacks += 1
                fallback_blocks += terms[3]
            else:
                learned += 1
                means.append(terms[0])
                variances.append(terms[1])
                left += int(terms[2])
                caps += terms[3]
        self._add_set(SetTerms(0, learned, (), left, caps, fallback_blocks, fallbacks))

    def add_columns(self, bound, budget, generated) -> None:
        """Add many requests at once, over arrays (where the estimator computes so: ``estimator._batch``): the
        client's bound (float64, NaN for none), budget and output so far (int64), one entry a request
        (:func:`fdsched.core.terms.columns_of_keys`). A decoding request's key moves with every token, so the
        kept terms of the passes before are of no use to it: a pass's first count comes here."""
        self._add_set(batch_terms(self.estimator, bound, budget, generated, *self.args, RELATIVE_SCALE))

    def _add_set(self, terms: SetTerms) -> None:
        self.mean_units += terms.mean_units
        self.learned += terms.learned
        self.variances.extend(terms.variances)
        self.left += terms.left
        self.caps += terms.caps
        self.fallback_blocks += terms.fallback_blocks
        self.fallbacks += terms.fallbacks
        self.estimator.fallbacks += terms.fallbacks
        self.estimator._terms_asked = self.fallbacks + self.learned

    def reservation(self) -> SetReservation:
        """The reservation of every request added so far, with the estimator's margin now."""
        if not self.learned:
            return SetReservation(self.fallback_blocks, 0.0, 0.0, self.fallbacks)
        if self.sums[0] != self.learned:  # requests were added since the last sums (they are only ever added)
            whole, units = divmod(self.mean_units, MEAN_SCALE)  # two floats whose sum is exactly mean_units
            mean = math.fsum(self.means + [float(whole), units / MEAN_SCALE])
            self.sums = (self.learned, mean, math.fsum(self.variances))
        _, mean, variance = self.sums
        learned = margin_blocks(mean, variance, self.estimator.k, self.args[2], float(self.left), self.caps)
        return SetReservation(int(learned) + self.fallback_blocks, mean, variance, self.fallbacks)


class AdaptiveReserve:
    """The estimator. Feed it events (:meth:`observe_finished`, :meth:`observe_preemption`); ask it
    for one running request's reservation (:meth:`request_blocks`), a whole set's (:meth:`set_reservation`,
    :meth:`set_blocks`) or one request's remainder (:meth:`remainder`)."""

    def __init__(
        self,
        window: int = 2000,
        min_samples: int = 16,
        k: float = K_DEFAULT,
        k_step: float = K_STEP,
        k_max: float = K_BOUND,
        k_decay: float = K_DECAY,
        buckets_per_octave: int = 8,
        max_length: int = 1 << 20,
    ) -> None:
        if window < 1 or min_samples < 1 or not -k_max <= k <= k_max or k_step < 0 or not 0 <= k_decay <= 1:
            raise ValueError("AdaptiveReserve: window, min_samples >= 1; -k_max <= k <= k_max; k_step >= 0; k_decay in [0, 1]")
        self.window, self.min_samples = window, min_samples
        self.k0, self.k_step, self.k_max, self.k_decay = k, k_step, k_max, k_decay
        self.k_extra = 0.0
        self.absolute = LengthHistogram(1.0, float(max_length), buckets_per_octave)
        self.relative = LengthHistogram(1.0, RELATIVE_SCALE, buckets_per_octave)
        self._samples: deque = deque()  # (is_relative, stored value), oldest first
        self.finished = 0
        self.preemptions = 0
        self.fallbacks = 0  # requests answered with the ratio formula (warm-up or beyond the tail)
        # (max_tokens, budget, generated) -> that request's terms in set_reservation, valid while _terms_stamp holds
        self._terms: dict = {}
        self._terms_stamp: tuple = ()
        self._terms_asked = 0  # requests in the last set_reservation call
        self._tail_rows = None  # the histograms' tail rows as one table, while they stand (fdsched.core.terms)
        # Terms over arrays (numpy) only where they are this class's own: a subclass that reads a request
        # otherwise (its remainder or its terms) is asked one request at a time.
        own = type(self).remainder is AdaptiveReserve.remainder and (
            type(self)._request_terms is AdaptiveReserve._request_terms
        )
        self._batch = own and numpy_or_none() is not None
        if self._batch:
            prepare_terms(self)

    # ---- events -------------------------------------------------------------------------------
    def observe_finished(self, max_tokens: Optional[int], output_tokens: int) -> None:
        """A request finished after ``output_tokens`` tokens (its client's ``max_tokens``, or None)."""
        if output_tokens < 1:
            return
        if max_tokens is not None and max_tokens >= 1:
            sample = (True, min(output_tokens / max_tokens, 1.0) * RELATIVE_SCALE)
        else:
            sample = (False, float(output_tokens))
        self._histogram(sample[0]).add(sample[1])
        self._samples.append(sample)
        if len(self._samples) > self.window:
            old_relative, old_value = self._samples.popleft()
            self._histogram(old_relative).add(old_value, -1.0)
        self.finished += 1
        self.k_extra *= self.k_decay

    def observe_preemption(self, count: int = 1) -> None:
        """``count`` running requests were preempted: the last reservations were too small."""
        self.preemptions += count
        self.k_extra = min(self.k_extra + self.k_step * count, self.k_max - self.k0)

    # ---- queries ------------------------------------------------------------------------------
    @property
    def k(self) -> float:
        return self.k0 + self.k_extra

    def _histogram(self, relative: bool) -> LengthHistogram:
        return self.relative if relative else self.absolute

    def remainder(self, max_tokens: Optional[int], budget: int, generated: int) -> Optional[RemainderEstimate]:
        """``E[L - g | L > g]`` and its variance for one running request; None: not learned yet (warm-up,
        or it has generated more than the samples cover)."""
        relative = max_tokens is not None and max_tokens >= 1
        histogram = self._histogram(relative)
        if histogram.n < self.min_samples:
            return None
        scale = (max_tokens / RELATIVE_SCALE) if relative else 1.0
        # Lengths are whole tokens: L > g means L >= g + 1; the threshold sits halfway.
        count, total, squares = histogram.tail((generated + 0.5) / scale)
        if count < 0.5:
            return None
        mean_value = total / count
        variance = max(squares / count - mean_value * mean_value, 0.0) * scale * scale
        mean = mean_value * scale - generated
        left = max(budget - generated, 0)
        mean = min(max(mean, 1.0), left)
        return RemainderEstimate(mean, min(variance, float(left) * left), float(left))

    def request_blocks(
        self,
        request: RunningRequest,
        ratio: float,
        clip_max_new_tokens: int,
        block_size: int,
        fixed_blocks: int,
    ) -> int:
        """Blocks one running request reserves when it is asked about alone: the set of that one request
        (:meth:`set_blocks`), i.e. :func:`margin_blocks` with a margin of its own when learned, else
        :func:`warmup_reserve_blocks` with ``fixed_blocks`` (counted in ``fallbacks``); never more than
        upstream's ratio formula gives it."""
        return self.set_blocks((request,), ratio, clip_max_new_tokens, block_size, fixed_blocks)

    def set_reservation(
        self,
        requests: Iterable[RunningRequest],
        ratio: float,
        clip_max_new_tokens: int,
        block_size: int,
        fixed_blocks: int,
    ) -> SetReservation:
        """The whole running set's reservation at once; it depends on the set, not on the order of its requests.

        Requests the estimator cannot answer for (warm-up, or beyond every sample) reserve
        :func:`warmup_reserve_blocks` each, as :meth:`request_blocks` gives them (counted in ``fallbacks``).
        The others together reserve :func:`margin_blocks` over their sums: ``ceil((sum of expected remainders +
        k sqrt(sum of variances)) / block_size)``, never more than their budgets still allow, never more than
        upstream's ratio formula gives them, never less than 0. Every fallback is at most upstream's formula
        too, so the whole set never keeps more than upstream's formula would for the same requests.
        The sums are exact (:func:`math.fsum`): no order of the requests rounds differently.

        A request is read through its ``max_tokens``, ``budget`` and ``generated`` only (a
        :class:`RunningRequest`, or any value with those attributes: the scheduler's views are passed as they
        are). Its terms (remainder or fallback, and cap) are a function of those three, the other arguments
        and the samples. Many requests at once are computed over arrays (:func:`fdsched.core.terms.batch_terms`);
        a few are computed one by one (:meth:`_request_terms`), kept and reused by later calls. A subclass whose
        :meth:`remainder` reads anything else must call :meth:`forget_terms` when that changes (and is always
        asked one request at a time).
        """
        tally = self.set_tally(ratio, clip_max_new_tokens, block_size, fixed_blocks)
        tally.add([(request.max_tokens, request.budget, request.generated) for request in requests])
        return tally.reservation()

    def set_tally(self, ratio: float, clip_max_new_tokens: int, block_size: int, fixed_blocks: int) -> "SetTally":
        """An empty running set's reservation, to which requests are added (:class:`SetTally`); its
        :meth:`SetTally.reservation` is :meth:`set_reservation` of every request added, with these arguments and
        the current samples and margin."""
        return SetTally(self, self._terms_for(ratio, clip_max_new_tokens, block_size, fixed_blocks),
                        (ratio, clip_max_new_tokens, block_size, fixed_blocks))

    def _terms_for(self, ratio: float, clip_max_new_tokens: int, block_size: int, fixed_blocks: int) -> dict:
        """The kept per-request terms for these arguments and the current samples (emptied when either changed,
        and when they hold more than twice the last call's requests: a decoding request's key moves with every
        token, so what the passes before kept is mostly dead, and a table that grows for long (ratio at its
        minimum, nothing finishing) costs more in memory traffic and collections than it saves)."""
        stamp = (
            ratio, clip_max_new_tokens, block_size, fixed_blocks, self.min_samples,
            self.absolute, self.absolute.version, self.relative, self.relative.version,
        )
        terms = self._terms
        if stamp != self._terms_stamp or len(terms) > 2 * self._terms_asked + 64:
            terms.clear()
            self._terms_stamp = stamp
        return terms

    def forget_terms(self) -> None:
        """Drop the kept per-request terms (:meth:`set_reservation`); the next call computes them afresh."""
        self._terms.clear()
        self._terms_stamp = ()

    def _request_terms(
        self,
        max_tokens: Optional[int],
        budget: int,
        generated: int,
        ratio: float,
        clip_max_new_tokens: int,
        block_size: int,
        fixed_blocks: int,
    ) -> tuple:
        """One request's part of :meth:`set_reservation`: ``(mean, variance, left, cap)`` when learned (cap:
        upstream's ratio formula for it), ``(None, None, None, blocks)`` when it falls back (blocks:
        :func:`warmup_reserve_blocks`)."""
        estimate = self.remainder(max_tokens, budget, generated)
        if estimate is None:
            blocks = warmup_reserve_blocks(
                max_tokens, budget, generated, ratio, clip_max_new_tokens, block_size, fixed_blocks
            )
            return None, None, None, blocks
        cap = reserve_blocks_for_request(budget, generated, ratio, clip_max_new_tokens, block_size)
        return estimate.mean, estimate.variance, estimate.left, cap

    def set_blocks(
        self,
        requests: Iterable[RunningRequest],
        ratio: float,
        clip_max_new_tokens: int,
        block_size: int,
        fixed_blocks: int,
    ) -> int:
        """Blocks the whole running set keeps free (:meth:`set_reservation`'s ``blocks``)."""
        return self.set_reservation(requests, ratio, clip_max_new_tokens, block_size, fixed_blocks).blocks

    def reserve_blocks(
        self,
        running: Iterable[RunningRequest],
        block_size: int,
        ratio: float,
        clip_max_new_tokens: int,
        fixed_blocks: int,
    ) -> int:
        """Blocks to keep free for a running set (:meth:`set_blocks`, with the arguments in this older order)."""
        return self.set_blocks(running, ratio, clip_max_new_tokens, block_size, fixed_blocks)

    def state(self) -> dict:
        """Samples, the current estimates and the margin (plain values, for metrics and reports)."""

        def summary(histogram: LengthHistogram, scale: float) -> dict:
            if histogram.n < 0.5:
                return {"samples": 0, "mean": None, "std": None, "learned": False}
            count, total, squares = histogram.tail(0.0)
            mean = total / count
            std = math.sqrt(max(squares / count - mean * mean, 0.0))
            return {
                "samples": int(round(histogram.n)),
                "mean": round(mean * scale, 3),
                "std": round(std * scale, 3),
                "learned": histogram.n >= self.min_samples,
            }

        return {
            "finished_seen": self.finished,
            "window": self.window,
            "min_samples": self.min_samples,
            "absolute_tokens": summary(self.absolute, 1.0),
            "relative_to_max_tokens": summary(self.relative, 1.0 / RELATIVE_SCALE),
            "k": round(self.k, 6),
            "preemptions_seen": self.preemptions,
            "fallback_answers": self.fallbacks,
        }


"""The adaptive estimator's per-request terms for many requests at once, with numpy.

Why: a decoding request's terms change with every token it generates, so the first count of every admitting
``schedule()`` pass computes them afresh for the whole running set. One at a time
(:meth:`fdsched.core.adaptive.AdaptiveReserve._request_terms`) that is five Python calls and some twenty float
operations a request: at 448 running, about 2 ms a pass. Here the same operations run over arrays.

What: :func:`request_columns` answers exactly what ``_request_terms`` answers for each request, bit for bit, from
three arrays (the client's bound, the budget, the output so far: :func:`columns_of_keys`, or the scheduler's
reader); :func:`batch_terms` gathers the same as a set, the means summed exactly (:func:`mean_units`). Every step
is the same IEEE operation in the same order (numpy's elementwise ``+ - * /``, ``minimum`` and ``maximum`` round
as Python's floats do; integers stay integers). A length's histogram bucket is found among the bucket edges as
the estimator's own ``math.log2`` draws them (:func:`_lower_edges`), not with numpy's ``log2``, which may differ
in the last bit. A request the estimator cannot answer for (its kind still warming up, or it has generated more
than any sample) gets the warm-up fallback, over the same arrays.

numpy comes with every FastDeploy host (FastDeploy and paddle depend on it); the plugin does not require it.
Without it, or for a few keys, the estimator computes terms one by one (:data:`BATCH_MIN`).
"""

from __future__ import annotations

import math
import struct
import sys
from typing import NamedTuple, Sequence

__all__ = ["BATCH_MIN", "MEAN_SCALE", "Columns", "SetTerms", "batch_terms", "columns_of_keys", "numpy_or_none",
           "prepare", "request_columns"]

# Fewer keys than this are computed one by one: below about this many, numpy's fixed cost (some 80 operations of
# one to a few microseconds each) is more than what the arrays save.
BATCH_MIN = 24

# Every learned mean is 0 or at least 1 (``remainder`` clips it to [1, budget left]), so it is a whole multiple of
# 2**-52: its sum is kept exactly as an integer count of 2**-52 (SetTerms.mean_units).
MEAN_SCALE = 2 ** 52

_NUMPY: list = []


def numpy_or_none():
    """numpy, imported on first use; None where it is not installed."""
    if not _NUMPY:
        try:
            import numpy
        except ImportError:
            numpy = None
        _NUMPY.append(numpy)
    return _NUMPY[0]


def prepare(estimator) -> None:
    """Draw the bucket edges of ``estimator``'s histograms now (:func:`_lower_edges`: once per histogram shape and
    process), so a scheduler's first admitting pass does not pay for them."""
    np = numpy_or_none()
    for histogram in (estimator.absolute, estimator.relative):
        _lower_edges(np, histogram)


class SetTerms(NamedTuple):
    """What a set of requests adds to a :class:`fdsched.core.adaptive.SetTally`."""

    mean_units: int  # the learned requests' means, summed exactly, in units of 2**-52 (MEAN_SCALE)
    learned: int  # how many requests the estimator answered for
    variances: list  # their variances, in the requests' order
    left: int  # what their budgets still allow, together (tokens)
    caps: int  # upstream's ratio formula over the learned requests
    fallback_blocks: int
    fallbacks: int


class Columns(NamedTuple):
    """Each request's terms, as arrays in the requests' order (:func:`request_columns`)."""

    mean: object  # float64: what _request_terms answers as the mean (where ``answered``)
    variance: object  # float64
    left: object  # int64: what the budget still allows
    cap: object  # int64: upstream's ratio formula
    answered: object  # bool: the estimator answered (else the warm-up fallback)
    fallback: object  # int64: the warm-up fallback's blocks (where not ``answered``)


def columns_of_keys(keys: Sequence[tuple]) -> tuple:
    """``(max_tokens, budget, generated)`` keys as the three arrays :func:`request_columns` reads (no bound: NaN)."""
    np = numpy_or_none()
    bounds, budget, generated = zip(*keys)
    bound = np.array([math.nan if value is None else value for value in bounds], dtype=np.float64)
    return (bound, np.fromiter(budget, dtype=np.int64, count=len(keys)),
            np.fromiter(generated, dtype=np.int64, count=len(keys)))


def request_columns(
    estimator,
    bound,
    budget,
    generated,
    ratio: float,
    clip_max_new_tokens: int,
    block_size: int,
    fixed_blocks: int,
    relative_scale: float,
) -> Columns:
    """What ``estimator._request_terms(max_tokens, budget, generated, ratio, clip, block_size, fixed_blocks)``
    answers for each request, bit for bit, as arrays: ``bound`` (float64, the client's bound, NaN for none),
    ``budget`` and ``generated`` (int64), one entry a request; ``relative_scale`` is the estimator's scale of
    relative samples."""
    np = numpy_or_none()
    columns = _learned_columns(np, estimator, bound, budget, generated, ratio, clip_max_new_tokens, block_size,
                               relative_scale)
    return columns._replace(fallback=_fallback(np, bound, columns.cap, fixed_blocks))


def _learned_columns(np, estimator, bound, budget, generated, ratio, clip_max_new_tokens, block_size,
                     relative_scale) -> Columns:
    """:func:`request_columns` but the warm-up fallback (None)."""
    absolute, relative = estimator.absolute, estimator.relative
    is_relative = bound >= 1  # the client bounded it: learned relative to that bound (NaN, no bound: False)
    scale = np.where(is_relative, bound / relative_scale, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):  # what is computed for a fallback is not used
        # What estimator.remainder does, over arrays (same operations, same order).
        threshold = (generated + 0.5) / scale
        # c: the bucket's own weight, 0 where the estimator leaves the bucket out (its weight <= 1e-12): adding
        # part = 0.0 then leaves count, total and squares as they are, as leaving it out does. width is the
        # bucket's max(high - low, 1e-12) and high2 its high * high, each computed once per bucket.
        count, total, squares, c, low, high, width, high2 = _tails(np, estimator, is_relative, threshold)
        part = np.minimum(np.maximum((high - threshold) / width, 0.0), 1.0) * c
        a = np.maximum(threshold, low)
        count = np.maximum(count + part, 0.0)
        total = total + part * (a + high) / 2.0
        squares = squares + part * (a * a + a * high + high2) / 3.0
        mean_value = total / count
        variance = np.maximum(squares / count - mean_value * mean_value, 0.0) * scale * scale
        mean = mean_value * scale - generated
    remaining = budget - generated
    left = np.maximum(remaining, 0)
    mean = np.minimum(np.maximum(mean, 1.0), left)
    variance = np.minimum(variance, left.astype(np.float64) * left)
    # The cap: upstream's ratio formula (fdsched.core.admission.reserve_blocks_for_request), in integers.
    reserved = np.maximum((np.minimum(remaining, clip_max_new_tokens) * ratio).astype(np.int64), 0)
    cap = (reserved + (block_size - 1)) // block_size
    # Answered: its kind has learned, and some sample is longer than what it generated.
    answered = count >= 0.5
    learned = (relative.n >= estimator.min_samples, absolute.n >= estimator.min_samples)
    if not all(learned):
        answered &= np.where(is_relative, *learned)
    return Columns(mean, variance, left, cap, answered, None)


def _fallback(np, bound, cap, fixed_blocks: int):
    """The warm-up rule (fdsched.core.warmup.warmup_reserve_blocks) for each request: upstream's formula (the
    cap), or for a request without a bound the fixed amount when that is less."""
    return np.where(np.isnan(bound), np.minimum(max(int(fixed_blocks), 0), cap), cap)


def batch_terms(estimator, bound, budget, generated, ratio: float, clip_max_new_tokens: int, block_size: int,
                fixed_blocks: int, relative_scale: float) -> SetTerms:
    """The requests' terms (:func:`request_columns`) gathered as a set (:class:`SetTerms`)."""
    np = numpy_or_none()
    mean, variance, left, cap, answered, _ = _learned_columns(
        np, estimator, bound, budget, generated, ratio, clip_max_new_tokens, block_size, relative_scale)
    if answered.all():
        fallback_blocks = fallbacks = 0
    else:
        unanswered = ~answered
        fallback_blocks = int(_fallback(np, bound[unanswered], cap[unanswered], fixed_blocks).sum())
        fallbacks = int(np.count_nonzero(unanswered))
        mean, variance, left, cap = mean[answered], variance[answered], left[answered], cap[answered]
    return SetTerms(mean_units(np, mean), len(mean), variance.tolist(), int(left.sum()), int(cap.sum()),
                    fallback_blocks, fallbacks)


def mean_units(np, mean) -> int:
    """The exact sum of ``mean`` (float64, each 0 or at least 1, below 2**31) in units of 2**-52.

    Each mean is a whole multiple of 2**-52, split exactly into three whole numbers: its whole part, and the top and
    bottom 26 bits of its fraction times 2**52. Each is summed as floats, exactly: every partial sum is a whole
    number below 2**53 for up to 2**22 requests, in any order of addition."""
    parts = np.empty((3, len(mean)))
    whole = np.floor(mean, out=parts[0])
    fraction = mean - whole
    top = np.floor(fraction * 67108864.0, out=parts[1])  # 2**26
    np.subtract(fraction * 4503599627370496.0, top * 67108864.0, out=parts[2])  # 2**52: the bottom 26 bits
    whole_sum, top_sum, bottom_sum = np.add.reduce(parts, axis=1).tolist()
    return (int(whole_sum) << 52) + (int(top_sum) << 26) + int(bottom_sum)


def _tails(np, estimator, is_relative, threshold) -> tuple:
    """The kept tail aggregates (``histogram._tails``: count, sum and sum of squares above the bucket, the bucket's
    own weight, its edges), and the bucket's ``max(high - low, 1e-12)`` and ``high * high``, of each threshold's
    bucket in its kind's histogram, as eight arrays.

    The rows are kept in one table while both histograms stand (``estimator._tail_rows``, keyed by the histograms
    and their versions, as each histogram keeps its own tails until its next sample): a pass whose first count
    follows another with no request finished in between computes no row again."""
    absolute, relative = estimator.absolute, estimator.relative
    # a value's bucket is the number of inner edges at or below it (never more than the histogram's last bucket)
    by_absolute = np.searchsorted(_inner_edges(np, absolute), threshold, side="right")
    if (absolute.lo, absolute.per_octave) == (relative.lo, relative.per_octave) and absolute.buckets >= relative.buckets:
        by_relative = by_absolute  # the same edges, the relative histogram's fewer: clamped below
    else:
        by_relative = np.searchsorted(_inner_edges(np, relative), threshold, side="right")
    # one numbering: the relative histogram's buckets, then the absolute one's
    index = np.where(is_relative, np.minimum(by_relative, relative.buckets - 1), by_absolute + relative.buckets)
    stand = (relative, relative.version, absolute, absolute.version)
    kept = estimator._tail_rows
    if kept is None or kept[0] != stand:
        rows = relative.buckets + absolute.buckets
        kept = estimator._tail_rows = (stand, np.empty((8, rows)), np.zeros(rows, dtype=bool))
    _, table, filled = kept
    missing = np.zeros(len(filled), dtype=bool)
    missing[index] = True
    missing &= ~filled
    if missing.any():
        wanted = np.flatnonzero(missing).tolist()
        rows = []
        for bucket in wanted:
            histogram, own = (relative, bucket) if bucket < relative.buckets else (absolute, bucket - relative.buckets)
            row = histogram._tails.get(own)
            if row is None:
                row = histogram._tails[own] = histogram._bucket_tail(own)
            count, total, squares, c, low, high = row
            if c <= 1e-12:  # the estimator leaves this bucket's own weight out (fdsched.core.lengths.LengthHistogram.tail)
                c = 0.0
            rows.append((count, total, squares, c, low, high, max(high - low, 1e-12), high * high))
        table[:, wanted] = np.array(rows).T
        filled[wanted] = True
    return tuple(table.take(index, axis=1))


# (lo, per_octave, buckets) -> the lower edges of those buckets (an array), as LengthHistogram.bucket draws them,
# and the same without bucket 0's
_EDGES: dict = {}


def _lower_edges(np, histogram):
    """Bucket ``b``'s lower edge, for every ``b``: the smallest float that ``histogram.bucket`` puts in ``b`` or
    above (``-inf`` for bucket 0), so a value's bucket is the number of edges at or below it, less one.

    Found with ``histogram.bucket`` itself, so the edges are exactly where the estimator's own ``math.log2`` puts
    them (numpy's ``log2`` may differ in the last bit): from the edge's value in exact arithmetic, a few floats up
    or down (bisection over the floats if that ever took long). Once per histogram shape and process, about a
    millisecond, when the estimator is built (:func:`prepare`)."""
    shape = (histogram.lo, histogram.per_octave, histogram.buckets)
    edges = _EDGES.get(shape)
    if edges is None:
        found = [-math.inf] + [_lowest_in(histogram.bucket, b, histogram.lo * 2 ** (b / histogram.per_octave))
                               for b in range(1, histogram.buckets)]
        lower = np.array(found)
        edges = _EDGES[shape] = (lower, lower[1:])
    return edges[0]


def _inner_edges(np, histogram):
    """:func:`_lower_edges` without bucket 0's: the number of them at or below a value is its bucket."""
    edges = _EDGES.get((histogram.lo, histogram.per_octave, histogram.buckets))
    return _lower_edges(np, histogram)[1:] if edges is None else edges[1]


def _lowest_in(bucket, b: int, guess: float) -> float:
    """The smallest positive float ``x`` with ``bucket(x) >= b`` (``bucket`` never decreases), searched from
    ``guess``."""
    x = guess
    for _ in range(64):  # the guess is within a few floats of the edge
        if bucket(x) >= b:
            below = math.nextafter(x, 0.0)
            if bucket(below) < b:
                return x
            x = below
        else:
            x = math.nextafter(x, math.inf)
    # positive floats are ordered as their bit patterns: bisect on those
    low, high = _bits_of(0.0), _bits_of(sys.float_info.max)  # bucket(low) < b <= bucket(high)
    while high - low > 1:
        middle = (low + high) // 2
        if bucket(_float_of(middle)) >= b:
            high = middle
        else:
            low = middle
    return _float_of(high)


def _bits_of(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _float_of(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]

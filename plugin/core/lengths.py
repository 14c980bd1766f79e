"""Output lengths as the adaptive estimator (:mod:`fdsched.core.adaptive`) keeps them: weighted samples in
log-spaced buckets, with prefix sums (Fenwick trees) so that the samples above any threshold are a few lookups.
Pure code: imports nothing of FastDeploy or of the rest of the plugin."""

from __future__ import annotations

import math

__all__ = ["LengthHistogram"]


class _Fenwick:
    """Prefix sums over a fixed number of slots, O(log n) update and query."""

    __slots__ = ("n", "tree")

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0.0] * (n + 1)

    def add(self, index: int, delta: float) -> None:
        i = index + 1
        tree, n = self.tree, self.n
        while i <= n:
            tree[i] += delta
            i += i & -i

    def prefix(self, index: int) -> float:
        """Sum of slots 0 .. index-1."""
        total = 0.0
        i = index
        tree = self.tree
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total


class LengthHistogram:
    """Weighted samples of a positive length in log-spaced buckets: count, sum, sum of squares.

    Bucket ``b`` covers ``[lo * 2**(b / per_octave), lo * 2**((b + 1) / per_octave))``; values
    below ``lo`` go to bucket 0, values above ``hi`` to the last one.
    """

    def __init__(self, lo: float = 1.0, hi: float = 1 << 20, buckets_per_octave: int = 8) -> None:
        if not (0 < lo < hi) or buckets_per_octave < 1:
            raise ValueError(f"LengthHistogram(lo={lo}, hi={hi}, buckets_per_octave={buckets_per_octave})")
        self.lo, self.hi, self.per_octave = float(lo), float(hi), buckets_per_octave
        self.buckets = int(math.ceil(math.log2(hi / lo) * buckets_per_octave)) + 1
        self._count = _Fenwick(self.buckets)
        self._sum = _Fenwick(self.buckets)
        self._sumsq = _Fenwick(self.buckets)
        self.n = 0.0  # total weight
        self.version = 0  # bumped by every add: answers computed from this histogram are valid while it stands
        # bucket -> its tail aggregates, valid until the next add: queries between two finished requests
        # (every running request at every admission decision) mostly hit a few buckets, O(1) each then.
        self._tails: dict = {}

    def bucket(self, value: float) -> int:
        if value < self.lo:
            return 0
        index = int(math.log2(value / self.lo) * self.per_octave)
        return min(index, self.buckets - 1)

    def edges(self, index: int) -> tuple:
        low = self.lo * 2 ** (index / self.per_octave) if index > 0 else 0.0
        return low, self.lo * 2 ** ((index + 1) / self.per_octave)

    def add(self, value: float, weight: float = 1.0) -> None:
        """Add (or, with a negative weight, remove) a sample."""
        index = self.bucket(value)
        self._count.add(index, weight)
        self._sum.add(index, weight * value)
        self._sumsq.add(index, weight * value * value)
        self.n += weight
        self.version += 1
        self._tails.clear()

    def _slot(self, index: int) -> tuple:
        return (
            self._count.prefix(index + 1) - self._count.prefix(index),
            self._sum.prefix(index + 1) - self._sum.prefix(index),
            self._sumsq.prefix(index + 1) - self._sumsq.prefix(index),
        )

    def tail(self, threshold: float) -> tuple:
        """(weight, sum, sum of squares) of the samples above ``threshold``."""
        index = self.bucket(threshold)
        cached = self._tails.get(index)
        if cached is None:
            cached = self._tails[index] = self._bucket_tail(index)
        count, total, squares, c, low, high = cached
        if c > 1e-12:
            # The part of this bucket above the threshold, its samples taken as spread evenly over it.
            part = min(max((high - threshold) / max(high - low, 1e-12), 0.0), 1.0) * c
            a, b = max(threshold, low), high
            count += part
            total += part * (a + b) / 2.0
            squares += part * (a * a + a * b + b * b) / 3.0
        return max(count, 0.0), total, squares

    def _bucket_tail(self, index: int) -> tuple:
        """(weight, sum, sum of squares) above bucket ``index``, the bucket's own weight and its edges."""
        count = self.n - self._count.prefix(index + 1)
        total = self._sum.prefix(self.buckets) - self._sum.prefix(index + 1)
        squares = self._sumsq.prefix(self.buckets) - self._sumsq.prefix(index + 1)
        c = self._slot(index)[0]
        low, high = self.edges(index)
        return count, total, squares, c, low, high

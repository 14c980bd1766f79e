"""Peak-demand admission with learned remainders (replay only). Pure policy code: plain values in, plain
values out; imports nothing from FastDeploy.

Why: a reservation per running request (upstream's ``min(left, clip) x ratio``, or the adaptive
estimator's expected remainder plus one margin k over the set) keeps blocks free for tokens that a
request which finishes early never writes, and it gives no credit for the blocks a finishing request
hands back to the others. The admission question is really: *with the candidate added, does the
running set's KV demand at its future peak fit the pool?* The replay's clairvoyant bound
(:class:`fdsched.replay.oracle.PeakOracle`) answers it with true output lengths. This module answers it
with *predicted* ones, learned from the requests that finished.

What:

* :class:`QuantileLengths` learns the output-length distribution from finished requests only (a sliding window,
  kept sorted) and predicts a running request's remainder as the ``q``-quantile of ``L - g`` given ``L > g``.
* :func:`peak_blocks` is the running set's demand at its future peak (a function of the set: order-independent,
  never negative).
* :class:`PeakAdmission` is the admission: ``reserve_blocks(running, candidate, block_size)`` returns
  ``max(0, peak - held)``, the blocks to keep free beyond the candidate's chunk.
* The preemption-rate target replaces k: an integral controller moves ``q`` (up per preemption, down per
  finished request) so that preemptions per 1000 finished requests settle at the target.
* :class:`LearnedClip`: upstream's formula with the clip learned online.

The warm-up fallbacks, the peak's shape, the controller's defaults and how they were chosen, and the cost:
docs/peak-admission.md. Determinism: the state is a function of the sequence of events (finished requests,
preemptions).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from fdsched.core.common import ceil_div

__all__ = [
    "RunningView",
    "QuantileLengths",
    "QuantileController",
    "PeakAdmission",
    "peak_blocks",
    "LearnedClip",
    "DEFAULT_TARGET_PER_1K",
    "EXACT_UP_TO",
]

DEFAULT_TARGET_PER_1K = 5.0


@dataclass(frozen=True)
class RunningView:
    """What the admission knows about one request (running, or the candidate).

    ``held_blocks``: blocks it holds now (for the candidate: with the chunk it is about to get);
    ``tokens``: tokens whose KV it holds once its current prefill is done (prompt + generated);
    ``generated``: output tokens so far; ``max_tokens``: the client's bound (None: unset, or the
    engine's fill-in of the rest of the context); ``left``: output tokens its budget still allows.
    """

    held_blocks: int
    tokens: int
    generated: int
    max_tokens: Optional[int]
    left: int


def _check_view(v: RunningView) -> None:
    for name in ("held_blocks", "tokens", "generated", "left"):
        value = getattr(v, name)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"RunningView.{name}: bad value {value!r}; allowed: an integer >= 0")
    if v.max_tokens is not None and (not isinstance(v.max_tokens, int) or v.max_tokens < 1):
        raise ValueError(f"RunningView.max_tokens: bad value {v.max_tokens!r}; allowed: None or an integer >= 1")


EXACT_UP_TO = 64


def peak_blocks(items: Iterable[tuple], block_size: int, ahead: int, exact_up_to: int = EXACT_UP_TO) -> int:
    """The most blocks a set holds at once from now on.

    ``items``: ``(held_blocks, tokens, remaining)`` per request; a request decodes one token per step
    and gives every block back after its last one (``remaining`` steps from now; 0: it finishes now
    and counts at ``t = 0`` only). Demand grows between finishes, so the peak is at ``t = 0`` or at
    ``t = remaining - 1`` of some request. Order-independent; 0 for an empty set.

    Exact (O(k^2)) for up to ``exact_up_to`` requests. Beyond that an upper bound in O(k log k): a
    request's blocks after ``t`` more tokens are counted as its blocks now plus ``ceil(t / block_size)``
    (never below the exact peak; at most one block more per request, plus, for a request that already
    holds more blocks than its tokens need, the growth it would make into them), with the requests
    sorted by ``remaining`` and suffix sums over them."""
    if block_size < 1:
        raise ValueError(f"block_size: bad value {block_size!r}; allowed: an integer >= 1")
    if ahead < 0:
        raise ValueError(f"ahead: bad value {ahead!r}; allowed: an integer >= 0")
    rows = [(int(h), int(tok), max(int(rem), 0)) for h, tok, rem in items]
    if not rows:
        return 0
    now = [max(h, ceil_div(tok, block_size) + ahead) for h, tok, _ in rows]
    best = sum(now)
    if len(rows) > exact_up_to:
        order = sorted(range(len(rows)), key=lambda i: rows[i][2])
        suffix = 0  # sum of "now" over requests with remaining > t, walking from the longest down
        alive = 0
        i = len(order) - 1
        while i >= 0:
            rem = rows[order[i]][2]
            while i >= 0 and rows[order[i]][2] == rem:  # every request finishing at this same time
                suffix += now[order[i]]
                alive += 1
                i -= 1
            if rem > 1:
                best = max(best, suffix + alive * ceil_div(rem - 1, block_size))
        return best
    for t in {rem - 1 for _, _, rem in rows if rem > 1}:
        total = 0
        for h, tok, rem in rows:
            if rem > t:
                total += max(h, ceil_div(tok + t, block_size) + ahead)
        if total > best:
            best = total
    return best


class QuantileLengths:
    """Output lengths of finished requests in a sliding window, kept sorted, with conditional quantiles.

    Two kinds, as in :mod:`fdsched.core.adaptive`: requests whose client bounded ``max_tokens`` are kept
    relative (``L / max_tokens``, in (0, 1]); the others in absolute tokens. Only finished requests
    are samples (a running or preempted request's length is unknown)."""

    def __init__(self, window: int = 2000, min_samples: int = 16, fallback_tokens: int = 256) -> None:
        for name, value, low in (("window", window, 1), ("min_samples", min_samples, 1), ("fallback_tokens", fallback_tokens, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"QuantileLengths {name}: bad value {value!r}; allowed: an integer >= {low}")
        self.window, self.min_samples, self.fallback_tokens = window, min_samples, fallback_tokens
        self._absolute: list = []
        self._relative: list = []
        self._order: deque = deque()  # (relative?, value), oldest first
        self.finished = 0
        self.fallbacks = 0

    def observe_finished(self, max_tokens: Optional[int], output_tokens: int) -> None:
        """A request finished after ``output_tokens`` (its client's bound, None when unset/not a bound)."""
        if output_tokens < 1:
            return
        relative = max_tokens is not None and max_tokens >= 1
        value = min(output_tokens / max_tokens, 1.0) if relative else float(output_tokens)
        bisect.insort(self._relative if relative else self._absolute, value)
        self._order.append((relative, value))
        if len(self._order) > self.window:
            old_relative, old = self._order.popleft()
            store = self._relative if old_relative else self._absolute
            del store[bisect.bisect_left(store, old)]
        self.finished += 1

    def samples(self, relative: bool) -> int:
        return len(self._relative if relative else self._absolute)

    def quantile(self, q: float, relative: bool = False, above: float = 0.0) -> Optional[float]:
        """The ``q``-quantile of the samples greater than ``above`` (None: none, or still warming up)."""
        store = self._relative if relative else self._absolute
        if len(store) < self.min_samples:
            return None
        start = bisect.bisect_right(store, above)
        n = len(store) - start
        if n <= 0:
            return None
        index = min(start + int(math.ceil(q * n)) - 1, len(store) - 1)
        return store[max(index, start)]

    def remainder(self, q: float, generated: int, max_tokens: Optional[int], left: int) -> int:
        """Predicted output tokens still to come: the ``q``-quantile of ``L - g`` given ``L > g``,
        within ``[1, left]`` (0 when nothing is left)."""
        if left <= 0:
            return 0
        relative = max_tokens is not None and max_tokens >= 1
        scale = float(max_tokens) if relative else 1.0
        value = self.quantile(q, relative, (generated + 0.5) / scale)
        if value is None:
            self.fallbacks += 1
            if self.samples(relative) < self.min_samples:
                return min(left, self.fallback_tokens)
            return min(left, max(generated, self.fallback_tokens))  # beyond every sample: "as long again"
        return min(max(int(math.ceil(value * scale)) - generated, 1), left)


class QuantileController:
    """The quantile ``q`` that keeps preemptions near ``target_per_1k`` per 1000 finished requests.

    ``on_preemption(n)``: ``q += n x step``; ``on_finished()``: ``q -= step x target_per_1k / 1000``;
    ``q`` stays in ``[q_min, q_max]``. The fixed point is a preemption rate of ``target_per_1k``."""

    def __init__(self, target_per_1k: float = DEFAULT_TARGET_PER_1K, q_start: float = 0.5, step: float = 0.1,
                 q_min: float = 0.5, q_max: float = 0.995) -> None:
        if not (isinstance(target_per_1k, (int, float)) and target_per_1k > 0):
            raise ValueError(f"target_per_1k: bad value {target_per_1k!r}; allowed: a number > 0")
        if not 0.0 < q_min <= q_start <= q_max < 1.0:
            raise ValueError(f"q_min, q_start, q_max: bad values {q_min!r}, {q_start!r}, {q_max!r}; allowed: 0 < q_min <= q_start <= q_max < 1")
        if not step > 0:
            raise ValueError(f"step: bad value {step!r}; allowed: a number > 0")
        self.target_per_1k, self.step, self.q_min, self.q_max = float(target_per_1k), float(step), q_min, q_max
        self.q = float(q_start)
        self.preemptions = 0
        self.finished = 0

    def on_preemption(self, count: int = 1) -> None:
        self.preemptions += count
        self.q = min(self.q + self.step * count, self.q_max)

    def on_finished(self) -> None:
        self.finished += 1
        self.q = max(self.q - self.step * self.target_per_1k / 1000.0, self.q_min)


class PeakAdmission:
    """Admission by predicted peak demand (see the module docstring). Feed it events; ask
    :meth:`reserve_blocks` once per admission decision."""

    def __init__(self, lengths: Optional[QuantileLengths] = None, controller: Optional[QuantileController] = None,
                 ahead: int = 1) -> None:
        if not isinstance(ahead, int) or ahead < 0:
            raise ValueError(f"ahead: bad value {ahead!r}; allowed: an integer >= 0")
        self.lengths = lengths or QuantileLengths()
        self.controller = controller or QuantileController()
        self.ahead = ahead
        self.decisions = 0

    def observe_finished(self, max_tokens: Optional[int], output_tokens: int) -> None:
        self.lengths.observe_finished(max_tokens, output_tokens)
        self.controller.on_finished()

    def observe_preemption(self, count: int = 1) -> None:
        self.controller.on_preemption(count)

    def predicted_peak(self, views: Sequence[RunningView], block_size: int) -> int:
        q = self.controller.q
        items = []
        for v in views:
            _check_view(v)
            items.append((v.held_blocks, v.tokens, self.lengths.remainder(q, v.generated, v.max_tokens, v.left)))
        return peak_blocks(items, block_size, self.ahead)

    def reserve_blocks(self, running: Sequence[RunningView], candidate: Optional[RunningView], block_size: int) -> int:
        """Blocks to keep free beyond the candidate's chunk: ``max(0, predicted peak - held)`` over the
        running set with the candidate; admitting then means the predicted peak fits the pool."""
        self.decisions += 1
        together = list(running) + ([candidate] if candidate is not None else [])
        held = sum(v.held_blocks for v in together)
        return max(0, self.predicted_peak(together, block_size) - held)

    def state(self) -> dict:
        return {
            "kind": "peak-admission",
            "q": round(self.controller.q, 6),
            "target_preemptions_per_1k": self.controller.target_per_1k,
            "finished_seen": self.lengths.finished,
            "preemptions_seen": self.controller.preemptions,
            "absolute_samples": self.lengths.samples(False),
            "relative_samples": self.lengths.samples(True),
            "fallback_answers": self.lengths.fallbacks,
            "decisions": self.decisions,
        }


class LearnedClip:
    """The simpler peer: upstream's per-request formula ``min(left, clip) x ratio`` with the clip set
    online to the ``q``-quantile of the finished requests' output lengths (absolute tokens), instead of
    a value an operator fixes once (``FD_CLIP_MAX_NEW_TOKENS``). Until ``min_samples`` requests have
    finished the operator's clip stands."""

    def __init__(self, q: float = 0.75, window: int = 2000, min_samples: int = 16) -> None:
        if not 0.0 < q < 1.0:
            raise ValueError(f"LearnedClip q: bad value {q!r}; allowed: 0 < q < 1")
        self.q = q
        self.lengths = QuantileLengths(window=window, min_samples=min_samples)

    def observe_finished(self, max_tokens: Optional[int], output_tokens: int) -> None:
        self.lengths.observe_finished(None, output_tokens)  # the clip is in tokens, whatever the bound

    def clip(self, default_clip: int) -> int:
        value = self.lengths.quantile(self.q)
        return default_clip if value is None else max(int(math.ceil(value)), 1)

    def reserve_blocks(self, max_new_tokens: int, generated: int, ratio: float, default_clip: int, block_size: int) -> int:
        left = max_new_tokens - generated
        return ceil_div(max(int(min(left, self.clip(default_clip)) * ratio), 0), block_size)

    def state(self) -> dict:
        return {"kind": "learned-clip", "q": self.q, "finished_seen": self.lengths.finished,
                "clip": self.lengths.quantile(self.q)}

"""What a running request reserves while the adaptive estimator (:mod:`fdsched.core.adaptive`) cannot answer for
it: warm-up (too few finished requests of its kind), or it has generated more than any sample of its kind. Pure
code: plain values in, plain values out."""

from __future__ import annotations

from typing import Optional

from fdsched.core.admission import reserve_blocks_for_request

__all__ = ["warmup_reserve_blocks"]


def warmup_reserve_blocks(
    max_tokens: Optional[int],
    budget: int,
    generated: int,
    ratio: float,
    clip_max_new_tokens: int,
    block_size: int,
    fixed_blocks: int,
) -> int:
    """Blocks a running request reserves while the estimator cannot answer for it (warm-up, or it has
    generated more than any sample of its kind).

    * The client bounded its length (``max_tokens`` from :func:`fdsched.core.adaptive.client_bound`): upstream's
      ratio formula over that bound (:func:`fdsched.core.admission.reserve_blocks_for_request`): the bound is
      informative and that formula does well on such traffic.
    * No bound: the legacy fixed-block reservation's current per-request amount (``fixed_blocks``: 16
      blocks after a preemption, decaying to 0; :class:`fdsched.core.strategies.FixedBlockReserve`), never
      more than upstream's formula would reserve for it. Upstream's
      ratio over the rest of the context (min(context left, 4096) x 0.7 tokens per request at first) is
      mostly air and throttles a cold engine for hundreds of steps; the legacy policy is what the
      operator ran before and beats it on real traffic, and decode-only preemption keeps its
      under-reservation cheap (no prefill is thrown away).
    """
    by_ratio = reserve_blocks_for_request(budget, generated, ratio, clip_max_new_tokens, block_size)
    if max_tokens is None:
        # Never more than upstream would reserve: the legacy amount ignores what the request can still use,
        # and a lone request in a small pool could otherwise refuse its own next chunk for good.
        return min(max(int(fixed_blocks), 0), by_ratio)
    return by_ratio

"""Invariants the replay checks after every engine step. Imports nothing from FastDeploy.

Block accounting
================

The GPU pool has block ids ``0 .. num_gpu_blocks - 1``. After every step each id must be in
exactly one of two states:

* **free**: in the prefix cache's free list (``cache_manager.gpu_free_block_list``), once;
* **used**: held by a request (its ``block_tables`` or ``extend_block_tables``, for every request
  the replay has fed and that has not finished) or by the prefix cache (the ``block_id`` of every
  radix-tree node whose ``cache_status`` is GPU and that the cache manager can still reach: from the
  root through ``children``, from the LRU leaf heap, or from a request's leaf node through
  ``parent``; plus the nodes' reserved decode ids and the cache's unfilled-block map).

So ``free + used = total`` holds exactly when: no id is in the free list twice; no id is both free
and used; every id is free or used; every id is in range. One more rule: a block that the prefix
cache does not hold belongs to at most one request (only cached blocks are shared).

:func:`check_blocks` takes plain lists and returns one message per violation (an empty list when
all holds); the replay gathers the lists from the host objects.

Requests
========

:func:`check_requests`: every request id of the trace ends finished exactly once (a run cut short
by ``--max-steps`` reports the unfinished ones as not drained, not as lost).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Sequence

__all__ = ["check_blocks", "check_requests", "MAX_IDS_SHOWN"]

MAX_IDS_SHOWN = 8


def _ids(ids: Iterable[int]) -> str:
    ids = sorted(ids)
    shown = ", ".join(str(i) for i in ids[:MAX_IDS_SHOWN])
    more = f", ... ({len(ids)} in all)" if len(ids) > MAX_IDS_SHOWN else ""
    return f"[{shown}{more}]"


def check_blocks(
    num_gpu_blocks: int,
    free_list: Sequence[int],
    request_blocks: Mapping[str, Sequence[int]],
    cache_blocks: Sequence[int],
) -> list:
    """Violations of the block accounting (see the module docstring); ``[]`` when it holds.

    :param free_list: the free list as it is (duplicates matter).
    :param request_blocks: request id -> the block ids it holds.
    :param cache_blocks: block ids the prefix cache holds (duplicates allowed: a reserved id may be
        listed by two views of the same node).
    """
    if _holds_quickly(num_gpu_blocks, free_list, request_blocks, cache_blocks):
        return []
    problems = []
    everything = range(num_gpu_blocks)
    free_counts = Counter(free_list)
    twice = [b for b, c in free_counts.items() if c > 1]
    if twice:
        problems.append(f"block ids twice in the free list: {_ids(twice)}")
    free = set(free_counts)
    cache = set(cache_blocks)
    held_by_requests: Counter = Counter()
    for rid, blocks in request_blocks.items():
        held_by_requests.update(set(blocks))
    used = cache | set(held_by_requests)
    out_of_range = [b for b in free | used if not (0 <= b < num_gpu_blocks)]
    if out_of_range:
        problems.append(f"block ids out of range(0, {num_gpu_blocks}): {_ids(out_of_range)}")
    both = free & used
    if both:
        owners = _owners(both, request_blocks, cache)
        problems.append(f"block ids both free and in use: {_ids(both)} ({owners})")
    lost = set(everything) - free - used
    if lost:
        problems.append(f"block ids neither free nor held by a request or the prefix cache (leaked): {_ids(lost)}")
    shared = [b for b, c in held_by_requests.items() if c > 1 and b not in cache]
    if shared:
        owners = _owners(shared, request_blocks, cache)
        problems.append(f"uncached block ids held by more than one request: {_ids(shared)} ({owners})")
    if not problems and len(free_list) + len(used) != num_gpu_blocks:  # cannot happen when the above hold
        problems.append(f"free {len(free_list)} + used {len(used)} != total {num_gpu_blocks}")
    return problems


def _holds_quickly(num_gpu_blocks, free_list, request_blocks, cache_blocks) -> bool:
    """True when the accounting certainly holds (the common case), with set sizes only; False sends
    the caller to the full check, which names what is wrong."""
    free = set(free_list)
    if len(free) != len(free_list):
        return False
    cache = set(cache_blocks)
    by_requests = set()
    total = 0
    for blocks in request_blocks.values():
        mine = set(blocks)
        total += len(mine)
        by_requests |= mine
    if total != len(by_requests) and (by_requests - cache):
        return False  # some block is held by two requests; the full check decides whether that is allowed
    used = cache | by_requests
    if free & used or len(free) + len(used) != num_gpu_blocks:
        return False
    everything = free | used
    return not everything or (min(everything) >= 0 and max(everything) < num_gpu_blocks)


def _owners(ids, request_blocks: Mapping[str, Sequence[int]], cache: set) -> str:
    first = sorted(ids)[0]
    holders = sorted(rid for rid, blocks in request_blocks.items() if first in blocks)
    if first in cache:
        holders.append("prefix cache")
    return f"block {first} held by: {', '.join(holders) or 'nobody'}"


def check_requests(request_ids: Sequence[str], finish_counts: Mapping[str, int], drained: bool) -> list:
    """Violations of "every request ends finished exactly once"."""
    problems = []
    twice = sorted(rid for rid, count in finish_counts.items() if count > 1)
    if twice:
        problems.append(f"requests finished more than once: {', '.join(twice[:MAX_IDS_SHOWN])}")
    unknown = sorted(set(finish_counts) - set(request_ids))
    if unknown:
        problems.append(f"finished requests that the trace does not have: {', '.join(unknown[:MAX_IDS_SHOWN])}")
    if drained:
        never = [rid for rid in request_ids if finish_counts.get(rid, 0) == 0]
        if never:
            problems.append(f"requests lost (the engine drained without finishing them): {', '.join(never[:MAX_IDS_SHOWN])}")
    return problems

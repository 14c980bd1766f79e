"""Block accounting of the GPU pool, from plain values: the rules the replay checks after every step and the engine's
guard audits now and then. Imports nothing from FastDeploy (the readers of the host's objects are in
:mod:`fdsched.patches._blocks`).

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
all holds); the replay and the engine's guard gather the lists from the host's objects.

:class:`BlockAudit` decides when the engine's guard audits and which findings it reports: the two-owner kinds only
(a block twice in the free list, both free and in use, an uncached block held by two requests or two radix-tree nodes,
an id out of range),
each once it has been seen by two audits in a row (a state caught while another thread was mid-update does not last
a pass), once per episode.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Sequence

__all__ = ["check_blocks", "kind_of", "BlockAudit", "MAX_IDS_SHOWN", "TWICE_FREE", "BOTH", "SHARED", "OUT_OF_RANGE", "LEAKED",
           "TWO_NODES", "OWNER_KINDS"]

MAX_IDS_SHOWN = 8
# Each finding's text starts with one of these (its kind).
TWICE_FREE = "block ids twice in the free list"
OUT_OF_RANGE = "block ids out of range"
BOTH = "block ids both free and in use"
LEAKED = "block ids neither free nor held"
SHARED = "uncached block ids held by more than one request"
TWO_NODES = "block ids held by two prefix-cache nodes"
OWNER_KINDS = (TWICE_FREE, OUT_OF_RANGE, BOTH, SHARED, TWO_NODES)  # one block, two owners (or none that can own it)


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
    node_blocks: Sequence[int] = (),
) -> list:
    """Violations of the block accounting (see the module docstring); ``[]`` when it holds.

    :param free_list: the free list as it is (duplicates matter).
    :param request_blocks: request id -> the block ids it holds.
    :param cache_blocks: block ids the prefix cache holds (duplicates allowed: a reserved id may be
        listed by two views of the same node).
    :param node_blocks: optionally, the block id of every GPU radix-tree node (one per node): an id two nodes hold
        is a finding too (the first sign of two owners: evicting one node frees a block the other still serves).
    """
    doubled = [b for b, c in Counter(node_blocks).items() if c > 1]
    found = [f"{TWO_NODES}: {_ids(doubled)}"] if doubled else []
    return found + _check(num_gpu_blocks, free_list, request_blocks, cache_blocks)


def _check(num_gpu_blocks, free_list, request_blocks, cache_blocks) -> list:
    if _holds_quickly(num_gpu_blocks, free_list, request_blocks, cache_blocks):
        return []
    problems = []
    everything = range(num_gpu_blocks)
    free_counts = Counter(free_list)
    twice = [b for b, c in free_counts.items() if c > 1]
    if twice:
        problems.append(f"{TWICE_FREE}: {_ids(twice)}")
    free = set(free_counts)
    cache = set(cache_blocks)
    held_by_requests: Counter = Counter()
    for rid, blocks in request_blocks.items():
        held_by_requests.update(set(blocks))
    used = cache | set(held_by_requests)
    out_of_range = [b for b in free | used if not (0 <= b < num_gpu_blocks)]
    if out_of_range:
        problems.append(f"{OUT_OF_RANGE}(0, {num_gpu_blocks}): {_ids(out_of_range)}")
    both = free & used
    if both:
        owners = _owners(both, request_blocks, cache)
        problems.append(f"{BOTH}: {_ids(both)} ({owners})")
    lost = set(everything) - free - used
    if lost:
        problems.append(f"{LEAKED} by a request or the prefix cache (leaked): {_ids(lost)}")
    shared = [b for b, c in held_by_requests.items() if c > 1 and b not in cache]
    if shared:
        owners = _owners(shared, request_blocks, cache)
        problems.append(f"{SHARED}: {_ids(shared)} ({owners})")
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


def kind_of(finding: str) -> str:
    """The kind a finding of :func:`check_blocks` is of (its leading words, see the constants above)."""
    return next((kind for kind in OWNER_KINDS + (LEAKED,) if finding.startswith(kind)), finding)


class BlockAudit:
    """When the guard audits the pool, and what it reports. ``interval``: seconds between audits (an audit walks the
    free list, every request's block table and the radix tree: about a millisecond for 5,000 blocks, 80 ms for a tree
    of 100,000, so it runs now and then, not every pass; after a costly one the next waits longer, so audits take at
    most :attr:`SHARE` of the scheduler thread). A finding of a two-owner kind is reported when the audit right after the one that found
    it (the next pass) finds the same kind again; then once, until an audit no longer finds that kind."""

    SHARE = 0.001  # an audit takes at most this share of the scheduler thread: the interval grows with its cost

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self.next_at = 0.0
        self.suspect: frozenset = frozenset()  # kinds one audit found, waiting for the next to confirm them
        self.standing: set = set()  # kinds reported and still found
        self.audits = 0

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def gap(self, spent: float) -> float:
        """Seconds to the next audit after one that took ``spent`` seconds (an interval of 0: every pass, whatever
        it costs; for tests and a hunt)."""
        return max(self.interval, spent / self.SHARE) if self.interval > 0 else 0.0

    def record(self, now: float, findings: Sequence[str], spent: float = 0.0) -> list:
        """One audit's findings (:func:`check_blocks`), ``spent`` seconds in the making; returns those to report
        now."""
        self.audits += 1
        owner = {kind: f for kind, f in ((kind_of(f), f) for f in findings) if kind in OWNER_KINDS}
        self.standing &= set(owner)  # an episode ends when its kind is gone
        confirmed = [k for k in owner if k in self.suspect and k not in self.standing]
        self.standing.update(confirmed)
        self.suspect = frozenset(k for k in owner if k not in self.standing)
        self.next_at = now if self.suspect else now + self.gap(spent)  # a suspicion is checked at the next pass
        return [owner[k] for k in confirmed]

"""What the scheduler guard costs (``fdsched bench schedule`` prints it after its table).

The guard runs after every pass where ``preempted_seat_resume`` is applied: a clock read and the stall watch (a few
comparisons), and every :data:`fdsched.patches._guard.AUDIT_INTERVAL_S` seconds an audit of the block
accounting, which walks the free list, every request's block table and the radix tree. Timed on the bench's own
scheduler (its running set, its pool) and on a prefix cache of ``cached_blocks`` released blocks (an engine-sized
tree). Its share of the scheduler thread: the per-pass part over a pass, plus one audit over the interval (the share
when passes run back to back; less when the engine waits on the GPU between them). An audit delays the pass after it
by its own time: the line says how long at an engine-sized tree.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

__all__ = ["bench_guard", "print_guard"]


def _per_call(call, calls: int) -> float:
    """Seconds per call, the least of 5 timed batches."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _audit_seconds(audit, repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        audit()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_guard(open_scheduler, build_tree, cached_blocks: int = 100_000) -> Optional[dict]:
    """``{"per_pass", "audit", "blocks", "requests", "tree_audit", "tree_blocks", "interval"}`` (seconds; None where
    the guard is not on the scheduler). ``open_scheduler()``: a context giving the bench's ``(scheduler, driver)``;
    ``build_tree(blocks)``: a scheduler whose prefix cache holds that many released blocks."""
    from fdsched.core.blocks import BlockAudit, check_blocks
    from fdsched.patches import _guard
    from fdsched.patches._blocks import cache_blocks_by_node
    from fdsched.replay.engine import close_manager

    with open_scheduler() as (rm, _driver):
        if not hasattr(rm, "_fdsched_guard"):
            return None
        rm._fdsched_block_audit.next_at = float("inf")  # the per-pass part alone: no audit due
        per_pass = _per_call(lambda: rm._fdsched_guard(([None], [])), 20_000)  # a pass that scheduled one task

        def audit():
            rm._fdsched_block_audit = BlockAudit(_guard.AUDIT_INTERVAL_S)
            rm._fdsched_audit_blocks(time.monotonic())

        audit_s = _audit_seconds(audit)
        blocks, requests = rm.cache_manager.num_gpu_blocks, len(rm.requests)
    tree = build_tree(cached_blocks)
    try:
        cache = tree.cache_manager

        def tree_audit():
            nodes, others = cache_blocks_by_node(cache)
            check_blocks(cache.num_gpu_blocks, list(cache.gpu_free_block_list), {}, nodes + others, node_blocks=nodes)

        tree_s = _audit_seconds(tree_audit, repeat=3)
        tree_blocks = cache.num_gpu_blocks
    finally:
        close_manager(tree)
    return {"per_pass": per_pass, "audit": audit_s, "blocks": blocks, "requests": requests, "tree_audit": tree_s,
            "tree_blocks": tree_blocks, "interval": _guard.AUDIT_INTERVAL_S}


def print_guard(guard: Optional[dict], pass_seconds: float, profile: str) -> None:
    """Lines under the schedule bench's table; ``pass_seconds``: the plugin's median pass."""
    if guard is None:
        print(f"guard: not on this host's scheduler ({profile}: its schedule() cannot be wrapped)")
        return
    from fdsched.core.blocks import BlockAudit

    gap = BlockAudit(guard["interval"]).gap
    pass_share = guard["per_pass"] / pass_seconds
    audit_share = guard["audit"] / gap(guard["audit"])
    tree_gap = gap(guard["tree_audit"])
    print(f"guard, per pass: {guard['per_pass'] * 1e6:.2f} us = {pass_share:.2%} of the plugin's median pass "
          f"({pass_seconds * 1e6:.0f} us)")
    print(f"guard, block audit: {guard['audit'] * 1e3:.2f} ms at {guard['blocks']} blocks and {guard['requests']} "
          f"requests, every {gap(guard['audit']):g} s = {audit_share:.3%} of the scheduler thread; at "
          f"{guard['tree_blocks']} cached blocks {guard['tree_audit'] * 1e3:.1f} ms (one pass that much later), every "
          f"{tree_gap:.0f} s = {guard['tree_audit'] / tree_gap:.3%}")
    print(f"guard, together: {pass_share + audit_share:.2%} of a pass (passes back to back)")

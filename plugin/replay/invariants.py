"""Invariants the replay checks after every engine step. Imports nothing from FastDeploy.

Blocks
======

:func:`check_blocks`: the block accounting of the GPU pool, the rules of :mod:`fdsched.core.blocks` (where the
engine's guard finds them too).

Requests
========

:func:`check_requests`: every request id of the trace ends finished exactly once (a run cut short
by ``--max-steps`` reports the unfinished ones as not drained, not as lost).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from fdsched.core.blocks import MAX_IDS_SHOWN, check_blocks

__all__ = ["check_blocks", "check_requests", "MAX_IDS_SHOWN"]


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

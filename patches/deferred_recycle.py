"""Change 1 — deferred, batched GPU block recycling in LRU eviction.

Replaces:  PrefixCacheManager.free_block_ids_async (no-CPU-tier path), PrefixCacheManager.free_nodes_directly
Why:       the host recycles each evicted node's blocks with its own recycle_gpu_blocks call, which
           formats and logs the whole id list at INFO, sets two gauges and heap-pushes each id:
           about 100 us per block, 2 s for 20k blocks.
Upstream:  PR 7885, 2.6 cherry-pick 7886 (both still open).
Needs it:  every 2.6 host (old e7c8dc2 and new d38eeb8).
Switch:    FDSCHED_DEFERRED_RECYCLE / changes.deferred_recycle = auto | on | off.
Delete:    when upstream merges 7885/7886 into every supported host.
"""

from __future__ import annotations

from . import PatchSpec
from ._base import PluginBase


class DeferredRecycleMixin(PluginBase):
    """Placeholder until the batched eviction loop lands: the probe reports it as unavailable."""


def _not_yet(info):
    return "not implemented in this plugin version yet"


SPEC = PatchSpec(
    change_id="deferred_recycle",
    title="Deferred batched block recycling in LRU eviction",
    upstream_prs=(7885, 7886),
    upstream_state="open",
    target="PrefixCacheManager",
    replaces=(),
    requires={"free_block_ids_async": ("need_block_num",), "recycle_gpu_blocks": ("gpu_block_ids",)},
    why="One recycle_gpu_blocks call per evicted node: INFO log of the id list, two gauges, one push per id.",
    how="Collect the evicted nodes' block ids (block + reserved decode ids) and recycle them once after the loop.",
    hosts_needing="all 2.6 hosts (old e7c8dc2, new d38eeb8)",
    switch="FDSCHED_DEFERRED_RECYCLE",
    delete_when="upstream merges PR 7885/7886 into every supported host",
    mixin=DeferredRecycleMixin,
    host_has=lambda info: False,
    extra_check=_not_yet,
)

"""Host fix — one radix-tree node per KV block: a fully cached prompt's record never drops below its leaf.

Replaces:  PrefixCacheManager.update_cache_blocks (a record below the request's cached count is raised to it)
Why:       when a prompt's every block is already in the prefix cache, the scheduler recomputes its last block
           (``num_computed_tokens = matched - block_size``) and records that count. FastDeploy's prefix cache
           then writes the request's cached count *down* to it while its leaf stays at the full match, so the next
           record builds a second node, below that leaf, for a block the leaf's path already holds. Two nodes own
           one block: evicting one returns the block to the free list while the other still serves it from the
           radix tree, and the next allocation hands it to a new request (one request's KV overwrites another's
           cached prefix: wrong answers, no error). Found by the replay's block invariants.
Upstream:  none proposed by this project; FastDeploy's 2.6 head and develop return from ``update_cache_blocks`` when
           the computed count is not above the cached count, which removes the defect there.
Needs it:  the lines whose ``update_cache_blocks`` lacks that check (2.2, 2.4, 2.5, the 2.6 commits before the head;
           the lines name the record ``cache_info`` or ``req_to_radix_tree_info``; both are handled).
Switch:    FDSCHED_ONE_NODE_PER_BLOCK / changes.one_node_per_block = auto | on | off. ``auto`` applies it where the
           host lacks the check (read from the bytecode of ``update_cache_blocks``); ``off`` keeps FastDeploy's own
           recording, to reproduce the defect.
           A profile's ``changes.others`` does not set it: ``baseline`` means the pre-change policy, not the host's
           defects.
Delete:    when FastDeploy's ``update_cache_blocks`` leaves a request's record alone for a computed count below
           its cached count, on every supported line.
Relies on: (probed at install: ``on`` fails naming it; ``auto`` skips)
  * cached-count-record: the prefix cache keeps each request's ``(leaf node, cached tokens)`` under its request id,
    and ``update_cache_blocks`` builds nodes for the tokens from that cached count up to the computed count, then
    stores the computed count (rounded down to a block) as the new cached count.

How: before the host records, the fix reads the request's cached count; a computed count whose whole blocks fall
below it is raised to it. The host then finds nothing new to build, keeps the leaf, and stores the cached count it
had (``num_cached_blocks`` stays at the blocks the radix tree owns, so ``_free_blocks`` never recycles one of
them). A count at or above the cached count is passed on unchanged: every other record is the host's own.
"""

from __future__ import annotations

import operator

from fdsched.patches._spec import PatchSpec, Reliance, Shapes
from fdsched.patches._base import code_names, compares_locals


def raised_record(num_computed_tokens: int, cached_tokens: int, block_size: int) -> int:
    """The computed count to record: ``num_computed_tokens``, or the cached count when its whole blocks fall below
    it (recording less would write the cached count down while the leaf stays where it is)."""
    if num_computed_tokens - num_computed_tokens % block_size < cached_tokens:
        return cached_tokens
    return num_computed_tokens


class RaisedRecord:
    """The fix: one per cache manager; ``next`` records (the next change's gate, or the host's own). Each line's
    shape (below) says where the prefix cache keeps its per-request record."""

    seams = ("update_cache_blocks",)
    records: str  # the cache manager's attribute holding the per-request record

    def __init__(self, cm, settings, next):
        self.records_of = operator.attrgetter(self.records)  # reads that attribute of a cache manager
        self.record = next.update_cache_blocks  # the layer below's (the gate's, or the host's own)

    def update_cache_blocks(self, cm, task, block_size, num_computed_tokens):
        record = self.records_of(cm).get(task.request_id)
        if record is not None:
            num_computed_tokens = raised_record(num_computed_tokens, record[1], block_size)
        return self.record(cm, task, block_size, num_computed_tokens)


class RaisedTreeInfoRecord(RaisedRecord):
    """Lines that keep the record as ``req_to_radix_tree_info[request_id] = [leaf, cached tokens]`` (2.5 on)."""

    fdsched_attributes = ("req_to_radix_tree_info",)
    records = "req_to_radix_tree_info"


class RaisedCacheInfoRecord(RaisedRecord):
    """Lines that keep it as ``cache_info[request_id] = (leaf, cached tokens)`` (2.2, 2.4)."""

    fdsched_attributes = ("cache_info",)
    records = "cache_info"


def _cached_count_record(info):
    """The host's ``update_cache_blocks`` reads the record and builds from it (``mm_build_path`` or
    ``build_path``)."""
    cls = info.host_classes.get("PrefixCacheManager")
    func = getattr(cls, "update_cache_blocks", None)
    if func is None:
        return "PrefixCacheManager.update_cache_blocks is missing"
    names = code_names(func)
    if not ({"req_to_radix_tree_info", "cache_info"} & names):
        return ("PrefixCacheManager.update_cache_blocks keeps no per-request record "
                "(req_to_radix_tree_info / cache_info)")
    if not ({"mm_build_path", "build_path"} & names):
        return "PrefixCacheManager.update_cache_blocks builds no path (mm_build_path / build_path)"
    return None


def _skips_records_below_cached(info) -> bool:
    """The host's ``update_cache_blocks`` compares the computed count (rounded to whole blocks) with the recorded
    cached count before it builds (FastDeploy's 2.6 head and develop return there when it is not above): the defect
    is fixed in the host. Read from the function's bytecode: a comparison whose operands load both locals. A host
    that renames them reads as without the check, and the fix applies (it changes nothing where the host returns)."""
    cls = info.host_classes.get("PrefixCacheManager")
    func = getattr(cls, "update_cache_blocks", None)
    return func is not None and compares_locals(func, "can_cache_computed_tokens", "num_cached_tokens")


SPEC = PatchSpec(
    change_id="one_node_per_block",
    title="One radix-tree node per KV block (fully cached prompts)",
    upstream_prs=(),
    upstream_state="none",
    replaces=("PrefixCacheManager.update_cache_blocks",),
    why=(
        "A fully cached prompt's recomputed last block lowers its cached count below its leaf; the next record "
        "builds a second node for a block already cached, and evicting either frees a block the other still serves."
    ),
    how="Raise a computed count whose whole blocks fall below the request's cached count to that count before the "
        "host records it; every other record passes unchanged.",
    hosts_needing="lines whose update_cache_blocks records a count below the cached one (2.2 to 2.6 before the head)",
    switch="FDSCHED_ONE_NODE_PER_BLOCK",
    delete_when="FastDeploy leaves a request's record alone for a computed count below its cached count",
    strategies={"PrefixCacheManager": {"plugin": Shapes(RaisedTreeInfoRecord, RaisedCacheInfoRecord), "host": None,
                                       "off": None}},
    host_has=_skips_records_below_cached,
    relies_on=(
        Reliance(
            "cached-count-record",
            "update_cache_blocks builds from the request's recorded (leaf, cached tokens) and stores the new count",
            _cached_count_record,
            when=("plugin",),
        ),
    ),
)

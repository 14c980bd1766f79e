"""Change 1 — deferred, batched GPU block recycling in LRU eviction.

Replaces:  PrefixCacheManager.free_block_ids_async (the path without a CPU tier),
           PrefixCacheManager.free_nodes_directly,
           PrefixCacheManager.recycle_gpu_blocks (same contract, cheap for a batch),
           PrefixCacheManager._handle_free_gpu_node_without_cpu (the host's per-node step: inside the
           plugin's eviction it collects the node's ids instead of recycling them),
           PrefixCacheManager.__init__ (the arm's tunables and its eviction path, chosen once)
Why:       the host recycles each evicted node with two recycle_gpu_blocks calls (its reserved decode
           ids, then its block), each of which formats and logs the id list at INFO, sets two
           Prometheus gauges and heap-pushes each id: about 100 us per block, 2 s for 20k blocks.
Upstream:  PR 7885, 2.6 cherry-pick 7886 (both still open).
Needs it:  every 2.6 host (old e7c8dc2 and new d38eeb8).
Switch:    FDSCHED_DEFERRED_RECYCLE / changes.deferred_recycle = auto | on | off;
           FDSCHED_RECYCLE_HEAPIFY_MIN_BATCH (64).
Delete:    when upstream merges 7885/7886 into every supported host.

How: the loop pops LRU leaves exactly as the host does and hands each evicted node to the host's per-node seam;
while the plugin's eviction is open on that thread, the seam collects the node's ids instead of recycling them, and
after the loop all ids go back through the host's own ``recycle_gpu_blocks`` in one call, as upstream's 7885/7886
does. That ``recycle_gpu_blocks`` keeps the host's contract and makes a batch cheap for every caller: one merge
into the free heap, one summary log line, one update of each gauge.

Where it differs from upstream's patch or the host on purpose (an evicted node's status stays ``CPU``, a node is
removed from its parent only if it is the parent's child, the overflow guard holds for the whole batch, the
collector is held off for a large eviction), and why: docs/internals.md, "deferred_recycle". The path with a CPU
tier is left to the host unless ``FDSCHED_TRANSFER_FORCE_DIRECT_RECYCLE=1``.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import logging
import math
import threading
import time

from fdsched.core.metrics import METRICS

from fdsched.patches._spec import PatchSpec, Shapes
from fdsched.patches._base import host_global

PCM = "fastdeploy.cache_manager.prefix_cache_manager"
# An eviction of at least len(heap) / KEYED_HEAP_MIN_SHARE blocks works on keyed tuples (one pass to
# build, one to write back) rather than calling BlockNode.__lt__ some 2*log2(len(heap)) times per pop.
KEYED_HEAP_MIN_SHARE = 4


_HOLD_LOCK = threading.Lock()
_hold_depth = 0
_hold_reenable = False


@contextlib.contextmanager
def collections_held():
    """Hold the cyclic garbage collector off while the block runs; restore what was there before.

    Why the keyed mirror needs it: it allocates one tuple per heap entry and per pushed parent (5k to 20k
    for a large eviction). Tuples are GC-tracked, so in an engine-sized heap (~300k objects) they start
    young-generation collections, survive them (the mirror holds them), get promoted and count towards
    CPython's full-collection rule; whenever the engine is close to a full collection, the eviction pays a
    traversal of the whole heap (``fdsched bench evict``, GC mode "due": ~4 us per block becomes ~20 on
    20k blocks; the host's loop allocates nothing per node and is unaffected). Allocating nothing per
    node instead would mean giving up the C-level key comparisons (the host's ``BlockNode.__lt__`` per
    comparison, the cost the mirror removes) or caching keys on the host's nodes. Holding collections
    off costs nothing, and the tuples are freed before collections resume, so the collector never sees
    them: a collection is avoided, not merely postponed.

    Process-wide, as the collector is: another thread (the token processor) allocating meanwhile does
    not collect until the hold ends (one eviction: about 130 ms for 20k blocks, docs/gc.md); only cyclic garbage
    waits, everything else is still freed by reference counting. Nesting and threads: the first holder
    disables the collector only if it was enabled and the last one re-enables it only then; if the
    caller had it disabled it stays disabled. Code that calls ``gc.disable()`` from another thread while
    a hold is open gets the collector re-enabled when the hold ends (nothing can tell its intent apart).
    """
    global _hold_depth, _hold_reenable
    with _HOLD_LOCK:
        if _hold_depth == 0:
            _hold_reenable = gc.isenabled()
            gc.disable()
        _hold_depth += 1
    try:
        yield
    finally:
        with _HOLD_LOCK:
            _hold_depth -= 1
            if _hold_depth == 0 and _hold_reenable:
                gc.enable()


def merge_into_heap(heap: list, ids: list, heapify_min_batch: int) -> str:
    """Add ``ids`` to the min-heap ``heap`` in place; return which way was used ("push"/"heapify").

    Pushing costs about ``k * log2(n + k)`` comparisons, a heapify about ``2 * (n + k)``; the cheaper
    one is used once the batch has at least ``heapify_min_batch`` ids.
    """
    n, k = len(heap), len(ids)
    if k >= heapify_min_batch and k * math.log2(n + k + 1) > 2 * (n + k):
        heap.extend(ids)
        heapq.heapify(heap)
        return "heapify"
    for block_id in ids:
        heapq.heappush(heap, block_id)
    return "push"


class DeferredRecycle:
    """The cache manager's eviction and recycling under this change (one per cache manager, made when it is built;
    see :mod:`fdsched.patches._prefix_cache`). Each method named as the host's takes the cache manager first;
    ``next`` has the host's own methods."""

    seams = ("free_block_ids_async", "free_nodes_directly", "recycle_gpu_blocks", "_handle_free_gpu_node_without_cpu")
    fdsched_globals = {PCM: ("CacheStatus", "PrefixTreeStatus", "envs", "logger", "main_process_metrics")}
    fdsched_attributes = (
        "request_release_lock", "gpu_free_task_future", "gpu_lru_leaf_heap", "gpu_lru_leaf_set", "radix_tree_root",
        "node_id_pool", "node_map", "gpu_free_block_list", "num_gpu_blocks", "cache_config", "available_gpu_resource",
    )

    def __init__(self, cm, settings, next):
        self.next = next
        # (the thread whose eviction is open, the ids it collects), or None: opened under request_release_lock only
        self.eviction = None
        self.heapify_min_batch = settings["tunables.recycle_heapify_min_batch"]
        self.deferred_path = (
            self.forced_direct if settings["tunables.transfer_force_direct_recycle"] else self.direct_without_cpu_room
        )

    def free_block_ids_async(self, cm, need_block_num):
        if not self.deferred_path(cm, need_block_num):
            return self.next.free_block_ids_async(cm, need_block_num)
        with cm.request_release_lock:
            if cm.gpu_free_task_future is not None:
                if not cm.gpu_free_task_future.done():
                    return
                cm.gpu_free_task_future.result()
                cm.gpu_free_task_future = None
            started = time.perf_counter()
            with self.batch() as freed:
                try:
                    self.evict_lru(cm, need_block_num, freed)
                    cm.gpu_free_task_future = None
                except Exception as exc:
                    self.eviction_error(cm, "free_block_ids_async", exc)
                finally:
                    self.recycle_evicted(cm, freed, started)

    def free_nodes_directly(self, cm, node):
        with cm.request_release_lock, self.batch() as freed:
            started = time.perf_counter()
            removed_from_heap = False
            try:
                while node is not None and node is not cm.radix_tree_root:
                    if node in cm.gpu_lru_leaf_set:
                        cm.gpu_lru_leaf_set.remove(node)
                        cm.gpu_lru_leaf_heap.remove(node)
                        removed_from_heap = True
                    if node.shared_count != 0 or not node.is_gpu_leaf_node or node.is_persistent:
                        break
                    cm._handle_free_gpu_node_without_cpu(node)  # the host's per-node seam (collects, see below)
                    parent = node.parent
                    if parent.children.get(node.hash_value) is node:
                        del parent.children[node.hash_value]
                    node = parent if not parent.children else None
            except Exception as exc:
                self.eviction_error(cm, "free_nodes_directly", exc)
            finally:
                if removed_from_heap:
                    heapq.heapify(cm.gpu_lru_leaf_heap)  # list.remove broke the heap order
                self.recycle_evicted(cm, freed, started)

    def _handle_free_gpu_node_without_cpu(self, cm, node):
        """The host's per-node eviction step: inside one of the plugin's evictions the node is detached as the host
        detaches it (status, node id, node map; its reserved decode ids cleared) but its ids are collected for
        the eviction's one recycle call instead of recycled one node at a time; anywhere else, the host's own."""
        eviction = self.eviction
        if eviction is None or eviction[0] != threading.get_ident():
            return self.next._handle_free_gpu_node_without_cpu(cm, node)
        freed = eviction[1]
        node.cache_status = host_global(PCM, "CacheStatus").CPU  # see docs/internals.md, "deferred_recycle"
        cm.node_id_pool.append(node.node_id)
        cm.node_map.pop(node.node_id, None)
        if node.reverved_dec_block_ids:
            freed.extend(node.reverved_dec_block_ids)
            node.reverved_dec_block_ids = []
        freed.append(node.block_id)
        return None

    @contextlib.contextmanager
    def batch(self):
        """The calling thread's eviction batch: the list the per-node seam collects into while it is open (on that
        thread only: a call on another thread gets the host's own step). Opened under ``request_release_lock``, as
        every host eviction that calls the seam is, so one is open at a time."""
        outer, freed = self.eviction, []
        self.eviction = (threading.get_ident(), freed)
        try:
            yield freed
        finally:
            self.eviction = outer

    def recycle_gpu_blocks(self, cm, gpu_block_ids, req_id=None):
        """The host's seam for returning GPU blocks, same contract, one heap merge per call."""
        ids = gpu_block_ids if isinstance(gpu_block_ids, list) else [gpu_block_ids]
        self.recycle_batch(cm, ids, req_id)

    # ---- pieces ---------------------------------------------------------------------------
    def evict_lru(self, cm, need_block_num: int, freed: list) -> int:
        """The LRU loop: pop leaves oldest first, detach them, collect their ids. The hot path.

        Same decisions as the host's loop, with its per-node work reduced to attribute tests: for a node
        without children ``is_gpu_leaf_node`` is just ``cache_status == GPU``. For a large eviction the
        heap is worked on as keyed tuples (see :meth:`lru_heap`): same pops, same pushes, same
        final heap as the host's, without a Python ``BlockNode.__lt__`` call per comparison.
        """
        gpu = host_global(PCM, "CacheStatus").GPU
        in_heap, root = cm.gpu_lru_leaf_set, cm.radix_tree_root
        handle = cm._handle_free_gpu_node_without_cpu
        pop, push = heapq.heappop, heapq.heappush
        evicted = 0
        with self.lru_heap(cm, need_block_num) as (heap, keyed):
            while heap and evicted < need_block_num:
                node = pop(heap)
                if keyed:
                    node = node[2]
                in_heap.remove(node)
                if node.shared_count != 0 or node.cache_status != gpu or (node.children and not node.is_gpu_leaf_node):
                    continue  # as the host: a node that is in use again leaves the heap
                handle(node)  # the host's per-node seam: collects into ``freed`` (the batch is open)
                evicted += 1
                parent = node.parent
                siblings = parent.children
                if siblings.get(node.hash_value) is node:
                    del siblings[node.hash_value]
                if (
                    not siblings
                    and parent is not root
                    and parent.shared_count == 0
                    and parent.cache_status == gpu
                    and parent.is_persistent is False
                    and parent not in in_heap
                ):
                    push(heap, (parent.last_used_time, -parent.depth, parent) if keyed else parent)
                    in_heap.add(parent)
        return evicted

    @contextlib.contextmanager
    def lru_heap(self, cm, need_block_num: int):
        """Yield ``(heap, keyed)`` for one eviction: the host's ``gpu_lru_leaf_heap`` or its keyed mirror.

        ``BlockNode.__lt__`` orders by ``(last_used_time, -depth)``; a Python call per comparison is
        most of an eviction's cost. When the eviction is large next to the heap
        (``need * KEYED_HEAP_MIN_SHARE >= len(heap)``) the heap is mirrored, position for position,
        as ``(last_used_time, -depth, node)`` tuples, which ``heapq`` compares in C. A tuple compares
        exactly as its node does (on a tie in both keys it falls through to ``node < node``, which is
        the host's own answer), so every sift makes the host's choice and the nodes are written back
        in the order the host's loop would leave them. A small eviction on a large heap pops nodes
        directly: building the mirror would cost more than the comparisons it saves. The mirror lives
        while collections are held off (:func:`collections_held`).
        """
        heap = cm.gpu_lru_leaf_heap
        if need_block_num * KEYED_HEAP_MIN_SHARE < len(heap):
            yield heap, False
            return
        held = time.perf_counter()
        with collections_held():  # see collections_held: the tuples must never meet a collection
            keyed = [(node.last_used_time, -node.depth, node) for node in heap]
            try:
                yield keyed, True
            finally:
                heap[:] = [entry[2] for entry in keyed]
                keyed.clear()  # the tuples die before collections resume: nothing was promoted, nothing is due
        METRICS.gc_held(time.perf_counter() - held, of=cm)  # the hold's length, for operators (docs/gc.md)

    def direct_without_cpu_room(self, cm, need_block_num) -> bool:
        """Whether this eviction takes the plugin's path: not where the host swaps to the CPU tier (change 5's path)."""
        if cm.cache_config.num_cpu_blocks >= need_block_num:
            return False
        return not self.flush_only(cm)

    def forced_direct(self, cm, need_block_num) -> bool:
        """FDSCHED_TRANSFER_FORCE_DIRECT_RECYCLE=1: every eviction takes the plugin's path, CPU tier or not."""
        return not self.flush_only(cm)

    def flush_only(self, cm) -> bool:
        # The host's own storage switches, read when the host reads them: flush-only storage mode collects per-node
        # flush info, which the host's loop does.
        return bool(getattr(host_global(PCM, "envs"), "FD_AS_ONLY_FLUSH", False)) and (
            cm.kvcache_storage_backend == "attention_store"
        )

    def eviction_error(self, cm, where: str, exc: Exception) -> None:
        logger = host_global(PCM, "logger")
        signal = getattr(cm, "prefix_tree_status_signal", None)
        normal = host_global(PCM, "PrefixTreeStatus").NORMAL
        if signal is not None and signal.value[0] != normal:
            logger.warning(f"[fdsched] {where}: error while the prefix tree is not normal, ignored: {exc}")
            return
        logger.error(f"[fdsched] {where}: error: {type(exc).__name__} {exc}")
        raise exc

    def recycle_evicted(self, cm, ids: list, started: float) -> None:
        """Hand an eviction's ids to the host's seam in one call; count the batch."""
        if not ids:
            return
        cm.recycle_gpu_blocks(ids)  # an instance attribute that replaces the method sees the batch too
        METRICS.recycled(len(ids), time.perf_counter() - started, of=cm)

    def recycle_batch(self, cm, ids: list, req_id) -> None:
        """Return ``ids`` to the free heap: once, guarded like the host's recycle."""
        if not ids:
            return
        logger = host_global(PCM, "logger")
        signal = getattr(cm, "prefix_tree_status_signal", None)
        if signal is not None and signal.value[0] != host_global(PCM, "PrefixTreeStatus").NORMAL:
            logger.warning(f"[fdsched] prefix tree is not normal, skip recycling {len(ids)} gpu blocks")
            return
        free = cm.gpu_free_block_list
        if len(free) + len(ids) > cm.num_gpu_blocks:
            ids = self.drop_duplicates(cm, ids)
            if len(free) + len(ids) > cm.num_gpu_blocks:
                logger.error(
                    f"[fdsched] {len(free)} free gpu blocks plus {len(ids)} recycled exceed the pool of "
                    f"{cm.num_gpu_blocks}: block accounting is broken, the batch is discarded: {ids}"
                )
                return
        way = merge_into_heap(free, ids, self.heapify_min_batch)
        metrics = host_global(PCM, "main_process_metrics")
        metrics.free_gpu_block_num.set(len(free))
        metrics.available_gpu_resource.set(cm.available_gpu_resource)
        logger.info(f"[fdsched] req_id:{req_id} recycled {len(ids)} gpu blocks ({way}), free {len(free)}/{cm.num_gpu_blocks}")
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(f"[fdsched] req_id:{req_id} recycled gpu block ids: {ids}")

    def drop_duplicates(self, cm, ids: list) -> list:
        logger = host_global(PCM, "logger")
        already_free = set(cm.gpu_free_block_list)
        seen, kept, dropped = set(), [], []
        for block_id in ids:
            if block_id in already_free or block_id in seen:
                dropped.append(block_id)
            else:
                seen.add(block_id)
                kept.append(block_id)
        if dropped:
            logger.error(f"[fdsched] recycle batch had {len(dropped)} duplicate or already-free ids, dropped: {dropped}")
        return kept


class DeferredRecycleNoReqId(DeferredRecycle):
    """:class:`DeferredRecycle` on a host whose ``recycle_gpu_blocks`` takes the ids only (FastDeploy 2.4)."""

    def recycle_gpu_blocks(self, cm, gpu_block_ids):
        ids = gpu_block_ids if isinstance(gpu_block_ids, list) else [gpu_block_ids]
        self.recycle_batch(cm, ids, None)


SPEC = PatchSpec(
    change_id="deferred_recycle",
    title="Deferred batched block recycling in LRU eviction",
    upstream_prs=(7885, 7886),
    upstream_state="open",
    replaces=(
        "PrefixCacheManager.__init__",
        "PrefixCacheManager.free_block_ids_async",
        "PrefixCacheManager.free_nodes_directly",
        "PrefixCacheManager.recycle_gpu_blocks",
        "PrefixCacheManager._handle_free_gpu_node_without_cpu",
    ),
    why="One recycle_gpu_blocks call per evicted node: INFO log of the id list, two gauges, one push per id.",
    how=(
        "Collect the evicted nodes' block ids (block + reserved decode ids) and pass them to recycle_gpu_blocks "
        "once after the loop; that method merges a batch into the free heap at once (one log line, gauges once)."
    ),
    hosts_needing="all 2.6 hosts (old e7c8dc2, new d38eeb8)",
    switch="FDSCHED_DEFERRED_RECYCLE",
    delete_when="upstream merges PR 7885/7886 into every supported host",
    strategies={"PrefixCacheManager": {"plugin": Shapes(DeferredRecycle, DeferredRecycleNoReqId), "host": None,
                                       "off": None}},
    host_has=lambda info: False,
)

"""``fdsched bench evict``'s workload: a radix tree of released nodes, freed through the prefix cache's LRU loop
(host code vs the plugin's batched recycling) beside a floor that pops the same nodes and does nothing else.
The command itself is in :mod:`fdsched.tools.bench`."""

from __future__ import annotations

import heapq

from fdsched.tools.benchcommon import GC_MODES, install_arm, timed


def build_tree(num_blocks: int, chain: int, block_size: int):
    """A manager whose radix tree holds ``num_blocks`` released nodes in chains of ``chain`` blocks."""
    from fdsched.replay.engine import EngineShape, build_manager, make_request

    shape = EngineShape(
        block_size=block_size,
        num_gpu_blocks=num_blocks + chain + 4,
        max_num_seqs=8,
        max_num_batched_tokens=chain * block_size,
        max_model_len=chain * block_size,
    )
    rm = build_manager(shape)
    cm = rm.cache_manager
    for i in range(num_blocks // chain):
        prompt = [i * 7919 + t + 1 for t in range(chain * block_size)]
        request = make_request(f"tree{i}", prompt, 1)
        matched, _, _ = cm.request_match_blocks(request, block_size)
        request.block_tables = list(matched) + cm.allocate_gpu_blocks(chain - len(matched), request.request_id)
        cm.update_cache_blocks(request, block_size, len(prompt))
        cm.release_block_ids(request)
    return rm


def _floor_evict(cm, need: int) -> int:
    """Pop the same nodes from the same heap and detach them; nothing else."""
    heap, in_heap, root = cm.gpu_lru_leaf_heap, cm.gpu_lru_leaf_set, cm.radix_tree_root
    evicted = 0
    while heap and evicted < need:
        node = heapq.heappop(heap)
        in_heap.remove(node)
        parent = node.parent
        del parent.children[node.hash_value]
        evicted += 1
        if not parent.children and parent is not root and parent not in in_heap:
            heapq.heappush(heap, parent)
            in_heap.add(parent)
    return evicted


def bench_evict(sizes, chain: int, block_size: int, repeat: int, gc_modes=GC_MODES) -> list:
    """Per size: {(variant, gc mode): (median seconds, collections per generation of the median run)} and
    {("held", gc mode): the longest collector hold of the plugin's median run, seconds}."""
    from fdsched.core.metrics import METRICS
    from fdsched.replay.engine import close_manager, logical_clock

    rows = []
    for n in sizes:
        timings = {}
        for variant, profile in (("host", "baseline"), ("plugin", "deferred_recycle"), ("floor", "baseline")):
            for mode in gc_modes:
                runs = []
                for _ in range(repeat):
                    install_arm(profile)
                    with logical_clock():
                        rm = build_tree(n, chain, block_size)
                    cm = rm.cache_manager
                    free_before = len(cm.gpu_free_block_list)
                    # no gc.collect() here: the collector's counters stand where serving the tree left them

                    if variant == "floor":
                        def run(cm=cm):
                            return _floor_evict(cm, n)
                    else:
                        def run(cm=cm):
                            cm.free_block_ids_async(n)
                            return len(cm.gpu_free_block_list) - free_before

                    METRICS.gc_hold_seconds_max = 0.0
                    seconds, freed, counts = timed(run, {"on": True, "due": "due", "off": False}[mode])
                    close_manager(rm)
                    if freed != n:
                        raise RuntimeError(f"{variant}: freed {freed} of {n} blocks")
                    runs.append((seconds, counts, METRICS.gc_hold_seconds_max))
                runs.sort(key=lambda r: r[0])
                seconds, counts, held = runs[len(runs) // 2]
                timings[(variant, mode)] = (seconds, counts)
                if variant == "plugin":
                    timings[("held", mode)] = held
        rows.append((n, timings))
    install_arm(None)
    return rows


def print_evict(rows, gc_modes=GC_MODES) -> None:
    print("time per evicted block, us (median); collections during the eviction: gen0/gen1/gen2")
    header = f"{'blocks':>7}  {'variant':<7}"
    for mode in gc_modes:
        header += f"  {'gc ' + mode + ' us/blk':>13}  {'collections':>11}"
    print(header)
    for n, t in rows:
        for variant in ("host", "plugin", "floor"):
            line = f"{n:>7}  {variant:<7}"
            for mode in gc_modes:
                seconds, counts = t[(variant, mode)]
                line += f"  {seconds / n * 1e6:>13.2f}  {'/'.join(map(str, counts)):>11}"
            print(line)
        ratios = "  ".join(
            f"gc {mode}: host/plugin {t[('host', mode)][0] / t[('plugin', mode)][0]:.1f}x, "
            f"plugin/floor {t[('plugin', mode)][0] / t[('floor', mode)][0]:.2f}x"
            for mode in gc_modes
        )
        print(f"{'':>7}  {ratios}")
        held = "  ".join(f"gc {mode}: {t[('held', mode)] * 1e3:.1f} ms" for mode in gc_modes)
        print(f"{'':>7}  plugin held the collector off (longest hold, median run): {held}")

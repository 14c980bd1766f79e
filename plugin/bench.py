"""Benchmarks that print numbers (never assertions): ``fdsched bench evict`` and ``fdsched bench schedule``.

Both run the real host classes (an installed FastDeploy or ``FDSCHED_HOST_SOURCE``).

``evict``: frees N GPU blocks through the prefix cache's LRU loop (``free_block_ids_async``, no CPU
tier), host code vs the plugin's batched recycling, beside a floor: a plain loop that pops the same
nodes from the same heap and detaches them, doing nothing else. The tree is rebuilt identically for
every variant (chains of ``--chain`` blocks, one node per block).

``schedule``: ``schedule()`` CPU time per step with R running decode requests (and a queue of
waiting requests that the reservation keeps out), host code vs the plugin, interleaved repetitions,
median per-step time and the ratio.
"""

from __future__ import annotations

import gc
import heapq
import statistics
import time


def _install(profile):
    from fdsched import installer
    from fdsched.settings import load_settings

    if profile is None:
        installer.uninstall()
        return "host"
    installer.install(load_settings(profile=profile))
    return profile


# ---- eviction ------------------------------------------------------------------------------------
def _build_tree(num_blocks: int, chain: int, block_size: int):
    """A manager whose radix tree holds ``num_blocks`` released nodes in chains of ``chain`` blocks."""
    from .replay.engine import EngineShape, build_manager, make_request

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


def bench_evict(sizes, chain: int, block_size: int, repeat: int) -> list:
    from .replay.engine import close_manager, logical_clock

    rows = []
    for n in sizes:
        timings = {}
        for variant, profile in (("host", "baseline"), ("plugin", "deferred_recycle"), ("floor", "baseline")):
            best = None
            for _ in range(repeat):
                _install(profile)
                with logical_clock():
                    rm = _build_tree(n, chain, block_size)
                cm = rm.cache_manager
                free_before = len(cm.gpu_free_block_list)
                gc.collect()
                gc.disable()
                started = time.perf_counter()
                if variant == "floor":
                    freed = _floor_evict(cm, n)
                else:
                    cm.free_block_ids_async(n)
                    freed = len(cm.gpu_free_block_list) - free_before
                seconds = time.perf_counter() - started
                gc.enable()
                close_manager(rm)
                if freed != n:
                    raise RuntimeError(f"{variant}: freed {freed} of {n} blocks")
                best = seconds if best is None else min(best, seconds)
            timings[variant] = best
        rows.append((n, timings))
    _install(None)
    return rows


def print_evict(rows) -> None:
    print(f"{'blocks':>7}  {'host us/blk':>11}  {'plugin us/blk':>13}  {'floor us/blk':>12}  "
          f"{'host/plugin':>11}  {'plugin/floor':>12}")
    for n, t in rows:
        print(f"{n:>7}  {t['host'] / n * 1e6:>11.2f}  {t['plugin'] / n * 1e6:>13.2f}  {t['floor'] / n * 1e6:>12.2f}  "
              f"{t['host'] / t['plugin']:>10.1f}x  {t['plugin'] / t['floor']:>11.2f}x")


# ---- schedule() overhead -------------------------------------------------------------------------------
def _schedule_setup(running: int, waiting: int, block_size: int):
    from .replay.engine import Driver, EngineShape, build_manager, make_request

    shape = EngineShape(
        block_size=block_size,
        num_gpu_blocks=running * 8 + waiting * 20 + 64,
        max_num_seqs=running + waiting,
        max_num_batched_tokens=max(4096, running * 4),
        max_model_len=2048,
        enable_prefix_caching=True,
    )
    rm = build_manager(shape)
    driver = Driver(rm)
    for i in range(running):
        driver.add(make_request(f"run{i}", [i % 97 + 1] * 16, 512), true_output_len=512)
    for _ in range(8):  # admit and prefill all of them; they decode from here on
        driver.step()
    if len(rm.running) != running:
        raise RuntimeError(f"only {len(rm.running)} of {running} requests are running")
    for i in range(waiting):  # long prompts: admission decisions (and the reserve sum) every step
        driver.add(make_request(f"wait{i}", [i % 89 + 1] * 1024, 512), true_output_len=512)
    return rm, driver


def bench_schedule(running: int, waiting: int, steps: int, repeat: int, block_size: int, profile: str) -> dict:
    from .replay.engine import close_manager, logical_clock

    per_variant = {"host": [], "plugin": []}
    for _ in range(repeat):
        for variant in ("host", "plugin"):
            _install(None if variant == "host" else profile)
            with logical_clock():
                rm, driver = _schedule_setup(running, waiting, block_size)
                times = []
                gc.collect()
                for _ in range(steps):
                    started = time.process_time()
                    rm.schedule()
                    times.append(time.process_time() - started)
                    # play the worker for the decoders only: one token each (no finishing within the run)
                    for request in rm.running:
                        if request.num_computed_tokens >= request.need_prefill_tokens:
                            request.output_token_ids.append(7)
                            if driver._split and request.status == driver._status.RUNNING_PREFILL:
                                request.status = driver._status.RUNNING_DECODE
                close_manager(rm)
            per_variant[variant].append(statistics.median(times))
    _install(None)
    return {k: statistics.median(v) for k, v in per_variant.items()}


def add_commands(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print numbers (need the host)")
    which = bench.add_subparsers(dest="bench", required=True)

    evict = which.add_parser("evict", help="LRU eviction: host vs plugin vs floor, time per block")
    evict.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 20000])
    evict.add_argument("--chain", type=int, default=50, help="blocks per cached prompt (tree depth)")
    evict.add_argument("--block-size", type=int, default=4)
    evict.add_argument("--repeat", type=int, default=3, help="best of N")
    evict.set_defaults(func=_run_evict)

    sched = which.add_parser("schedule", help="schedule() CPU time per step: host vs plugin")
    sched.add_argument("--running", type=int, default=256)
    sched.add_argument("--waiting", type=int, default=64)
    sched.add_argument("--steps", type=int, default=200)
    sched.add_argument("--repeat", type=int, default=5, help="interleaved repetitions (median)")
    sched.add_argument("--block-size", type=int, default=64)
    sched.add_argument("--profile", default="recommended", help="the plugin's profile")
    sched.set_defaults(func=_run_schedule)


def _host_label() -> str:
    from .host import probe

    return probe().label


def _run_evict(args) -> int:
    print(f"host: {_host_label()}")
    print_evict(bench_evict(args.sizes, args.chain, args.block_size, args.repeat))
    return 0


def _run_schedule(args) -> int:
    print(f"host: {_host_label()}")
    result = bench_schedule(args.running, args.waiting, args.steps, args.repeat, args.block_size, args.profile)
    print(f"schedule() CPU per step, {args.running} running + {args.waiting} waiting, median of {args.repeat} x "
          f"{args.steps} steps:")
    print(f"  host   {result['host'] * 1e6:9.1f} us")
    print(f"  plugin {result['plugin'] * 1e6:9.1f} us  (profile {args.profile})")
    print(f"  ratio plugin/host = {result['plugin'] / result['host']:.3f}")
    return 0

"""Benchmarks that print numbers (never assertions): ``fdsched bench evict`` and ``fdsched bench schedule``
(``fdsched bench instructions``, the schedule bench's instruction count under callgrind, is
:mod:`fdsched.tools.instructions`).

Both run the real host classes (an installed FastDeploy or ``FDSCHED_HOST_SOURCE``).

``evict``: frees N GPU blocks through the prefix cache's LRU loop (``free_block_ids_async``, no CPU
tier), host code vs the plugin's batched recycling, beside a floor: a plain loop that pops the same
nodes from the same heap and detaches them, doing nothing else. The tree is rebuilt identically for
every variant (chains of ``--chain`` blocks, one node per block).

``schedule``: ``schedule()`` CPU time per step with R running decode requests (``--workload``: their budgets
spread, after requests that finished taught the estimators, or all the same; :func:`running_budget`) and a queue of
waiting requests that the reservation keeps out, host code vs the plugin, each arm in fresh processes of its
own taking turns (``--processes``; 0: both in this process, interleaved repetitions),
median and mean per-step time and the ratios, and the ratio of the summed per-step minima (each step's least
disturbed repetition: the figure that holds still on a shared machine, where the medians move by 10-50%), also
split into the steps that admit a prefill chunk (either variant) and the others.

Both first grow the process to what a served engine holds (``--heap-objects``, default
``ENGINE_HEAP_OBJECTS``: GC-tracked objects, measured in a served LLMEngine) and time each variant with
the garbage collector on, on with a full collection due (as a long-running engine regularly is), and
off (``--gc``), counting the collections that ran while timed. See docs/gc.md.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import statistics
import time
from typing import Optional

from fdsched.core.common import bounded_float, bounded_int, percentile


def _install(profile):
    from fdsched.install import installer
    from fdsched.core.settings import load_settings

    if profile is None:
        installer.uninstall()
        return "host"
    installer.install(load_settings(profile=profile))
    return profile


# ---- eviction ------------------------------------------------------------------------------------
def _build_tree(num_blocks: int, chain: int, block_size: int):
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


def _timed(run, gc_on):
    """Run ``run()`` with the collector on (True), on with a full collection due ("due") or off (False);
    return (seconds, result, collections per generation while it ran)."""
    counts = [0, 0, 0]

    def count(phase, info):
        if phase == "start":
            counts[info["generation"]] += 1

    was_enabled = gc.isenabled()
    if gc_on == "due":
        _make_full_collection_due()
    gc.callbacks.append(count)
    if gc_on:
        gc.enable()
    else:
        gc.disable()
    try:
        started = time.perf_counter()
        result = run()
        seconds = time.perf_counter() - started
    finally:
        gc.callbacks.remove(count)
        _DUE.clear()
        if was_enabled:
            gc.enable()
        else:
            gc.disable()
    return seconds, result, counts


# GC modes of the benches: "on" (the collector's counters stand where building the workload left them),
# "due" (on, and a full collection is due: the next objects that survive into the oldest generation start
# one), "off" (collections held off while timed).
GC_MODES = ("on", "due", "off")


def _make_full_collection_due(margin: int = 500) -> None:
    """Put the collector where a long-running engine regularly is: just short of a full collection.

    CPython runs a full collection when the oldest generation's counter is over its threshold AND the
    objects that reached that generation since the last full collection exceed a quarter of the ones
    that were there (the "long-lived pending" rule). An engine's requests keep promoting objects, so it
    crosses that line now and then; whatever loop promotes the last few thousand objects pays for a
    traversal of the whole heap. Here: collect, then promote ``total / 4 - margin`` fresh objects with
    young-generation collections, which also bring the oldest generation's counter over its threshold, and
    bring the middle generation's counter to its threshold: the timed code's first collection is a
    middle-generation one (its survivors count as pending), and the one after it is a full collection if
    the timed code keeps more than ``margin`` new objects alive meanwhile.
    """
    gc.collect()
    total = len(gc.get_objects())
    _DUE.clear()
    _DUE.extend([i] for i in range(max(0, total // 4 - margin)))
    for _ in range(gc.get_threshold()[2] + 1):
        gc.collect(1)  # survivors move to the oldest generation (pending grows), its counter goes up by one
    for _ in range(gc.get_threshold()[1]):
        gc.collect(0)  # the middle generation's counter goes up by one


_DUE: list = []


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
                    _install(profile)
                    with logical_clock():
                        rm = _build_tree(n, chain, block_size)
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
                    seconds, freed, counts = _timed(run, {"on": True, "due": "due", "off": False}[mode])
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
    _install(None)
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


def full_collection_ms(repeat: int = 3) -> float:
    """The median time of one full collection of this process as it stands: what a due collection costs the
    code that happens to trigger it (the trade against the eviction's hold, docs/gc.md)."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2] * 1e3


# ---- schedule() overhead -------------------------------------------------------------------------------
WORKLOADS = ("spread", "uniform")
FINISHED_BEFORE = 48  # "spread": requests that run to completion before the timed steps


def running_budget(index: int, workload: str) -> Optional[int]:
    """The ``max_tokens`` of the bench's ``index``-th running request (None: no client bound). "spread": every
    fourth without a bound, the others spread over 256-1024 tokens, as real traffic's are (a request's terms of the
    reservation are then its own, as in an engine); "uniform": every one 512 (they then share their terms, which
    flatters an estimator that keeps them by value). None of them ends within the default 200 steps either way."""
    if workload != "spread":
        return 512
    return None if index % 4 == 3 else 256 + (index * 37) % 769


def _finish_some_first(driver, rm, make_request) -> None:
    """"spread": :data:`FINISHED_BEFORE` requests run to completion before the running set is admitted, half with a
    client bound of 64 tokens (4-60 generated), half without (4-600 generated), so an estimator that learns from
    finished requests has learned, as in an engine that has served for a while."""
    for i in range(FINISHED_BEFORE):
        bounded = i % 2 == 0
        length = 4 + (i * 7) % 57 if bounded else 4 + (i * 97) % 597
        driver.add(make_request(f"done{i}", [i % 83 + 1] * 16, 64 if bounded else None), true_output_len=length)
    for _ in range(FINISHED_BEFORE * 600):  # a few at a time where max_num_seqs is small
        if not rm.running and not rm.waiting:
            return
        driver.step()
    raise RuntimeError(f"{len(rm.running) + len(rm.waiting)} of the {FINISHED_BEFORE} first requests did not finish")


def _schedule_setup(running: int, waiting: int, block_size: int, workload: str = "spread"):
    from fdsched.replay.engine import Driver, EngineShape, build_manager, make_request

    shape = EngineShape(
        block_size=block_size,
        # room for the running set under every shipped profile's reservation (spread: larger budgets reserve more)
        num_gpu_blocks=running * (16 if workload == "spread" else 8) + waiting * 20 + 64,
        max_num_seqs=running + waiting,
        max_num_batched_tokens=max(4096, running * 4),
        max_model_len=2048,
        enable_prefix_caching=True,
    )
    rm = build_manager(shape)
    driver = Driver(rm)
    if workload == "spread":
        _finish_some_first(driver, rm, make_request)
    for i in range(running):
        budget = running_budget(i, workload)
        driver.add(make_request(f"run{i}", [i % 97 + 1] * 16, budget), true_output_len=budget or 1024)
    for _ in range(8):  # admit and prefill all of them; they decode from here on
        driver.step()
    if len(rm.running) != running:
        raise RuntimeError(f"only {len(rm.running)} of {running} requests are running")
    for i in range(waiting):  # long prompts: admission decisions (and the reserve sum) every step
        driver.add(make_request(f"wait{i}", [i % 89 + 1] * 1024, 512), true_output_len=512)
    return rm, driver


@contextlib.contextmanager
def scheduler_for(variant: str, running: int, waiting: int, block_size: int, workload: str = "spread"):
    """A fresh scheduler of one arm (``variant``: "host" or a profile) on the bench's workload, with its driver,
    under the logical clock: ``(rm, driver)``, the manager closed on the way out."""
    from fdsched.replay.engine import close_manager, logical_clock

    _install(None if variant == "host" else variant)
    with logical_clock():
        rm, driver = _schedule_setup(running, waiting, block_size, workload)
        try:
            yield rm, driver
        finally:
            close_manager(rm)


def import_host() -> None:
    """In a fresh interpreter: make the host importable and import its scheduler module (its modules are then in
    the process, as in an engine)."""
    from fdsched.install.probe import find_host
    from fdsched.replay.engine import prepare_host_environment

    prepare_host_environment()
    find_host()
    import fastdeploy.engine.sched.resource_manager_v1  # noqa: F401


def _schedule_runs(variant: str, mode: str, running: int, waiting: int, steps: int, block_size: int,
                   workload: str = "spread") -> list:
    """One timed run of one arm (``variant``: "host" or a profile) on a fresh scheduler: ``[(cpu seconds, admitted
    a prefill chunk)]`` per step."""
    with scheduler_for(variant, running, waiting, block_size, workload) as (rm, driver):
        gc.collect()

        def run(driver=driver):  # the driver plays worker and token processor; only schedule() is timed
            # per step, its CPU time and whether it admitted a chunk: the step's record is not kept
            # alive through the timed run (its lists would be objects for the collector to walk)
            return [(record.schedule_cpu_seconds, bool(record.prefill_chunks))
                    for record in (driver.step() for _ in range(steps))]

        _, per_step, _ = _timed(run, {"on": True, "due": "due", "off": False}[mode])
    return per_step


def _arm_in_a_process(variant: str, repeat: int, gc_modes: tuple, shape: tuple, heap_objects: int) -> dict:
    """In a fresh interpreter (:func:`bench_schedule_isolated`): the host made importable, the heap grown as the
    bench's own process grows it, then ``repeat`` runs of one arm per gc mode: ``{mode: [per-step records]}``."""
    import_host()
    grow_heap(heap_objects)
    runs = {mode: [_schedule_runs(variant, mode, *shape) for _ in range(repeat)] for mode in gc_modes}
    _install(None)
    return runs


def arm_order(repetition: int) -> tuple:
    """The arms' order in a repetition: they take turns going first (the arm that runs second in a process
    inherits the first one's heap; in an isolated run, the next process starts a moment after the last one)."""
    return ("host", "plugin") if repetition % 2 == 0 else ("plugin", "host")


def bench_schedule(running: int, waiting: int, steps: int, repeat: int, block_size: int, profile: str,
                   gc_modes=GC_MODES, workload: str = "spread") -> dict:
    """{(variant, gc mode): {"median": s, "mean": s, "minima": [s per step], "admitting": {step index}}} of
    schedule() CPU per step, both arms in this process, interleaved repetitions. ``minima``: each step's least
    time over the repetitions; ``admitting``: the steps in which that variant scheduled a prefill chunk (the same
    in every repetition)."""
    runs = {(v, m): [] for v in ("host", "plugin") for m in gc_modes}
    for repetition in range(repeat):
        for mode in gc_modes:
            for variant in arm_order(repetition):
                arm = "host" if variant == "host" else profile
                runs[(variant, mode)].append(_schedule_runs(arm, mode, running, waiting, steps, block_size, workload))
    _install(None)
    return summarise_runs(runs)


def bench_schedule_isolated(processes: int, running: int, waiting: int, steps: int, repeat: int, block_size: int,
                            profile: str, gc_modes=GC_MODES, heap_objects: Optional[int] = None,
                            workload: str = "spread") -> dict:
    """:func:`bench_schedule` with each arm in processes of its own, as an engine runs one class: ``processes``
    fresh interpreters per arm, taking turns (:func:`arm_order`), one at a time, each running ``repeat``
    repetitions of its arm (``heap_objects``: each grows its heap to that first; default
    :data:`ENGINE_HEAP_OBJECTS`). In one process the arms disturb each other: there, which arm went first in each
    repetition moved the ratio by up to 5 points (``recommended``, 448 running, e7c8dc2: 1.05-1.07 host first,
    1.09-1.13 taking turns)."""
    import multiprocessing

    heap_objects = ENGINE_HEAP_OBJECTS if heap_objects is None else heap_objects

    spawn = multiprocessing.get_context("spawn")
    shape = (running, waiting, steps, block_size, workload)
    runs = {(v, m): [] for v in ("host", "plugin") for m in gc_modes}
    for process in range(processes):
        for variant in arm_order(process):
            arm = "host" if variant == "host" else profile
            with spawn.Pool(1) as pool:  # one interpreter for this arm's repetitions, gone before the next starts
                per_mode = pool.apply(_arm_in_a_process, (arm, repeat, tuple(gc_modes), shape, heap_objects))
            for mode, per_run in per_mode.items():
                runs[(variant, mode)].extend(per_run)
    return summarise_runs(runs)


def summarise_runs(runs: dict) -> dict:
    """``{(variant, mode): [per-step records of one run]}`` -> what :func:`bench_schedule` returns."""
    result = {}
    for key, per_run in runs.items():
        flat = [seconds for records in per_run for seconds, _ in records]
        steps = len(per_run[0]) if per_run else 0
        result[key] = {
            "median": statistics.median(flat),
            "mean": statistics.fmean(flat),
            "minima": [min(records[i][0] for records in per_run) for i in range(steps)],
            "admitting": {i for records in per_run for i, (_, admitted) in enumerate(records) if admitted},
        }
    return result


def minima_ratios(host: dict, plugin: dict) -> dict:
    """Plugin / host of the summed per-step minima (:func:`bench_schedule`): over every step, over the steps in
    which either variant admitted a prefill chunk, and over the others (None where a part has no step)."""
    steps = range(len(host["minima"]))
    admitting = host["admitting"] | plugin["admitting"]
    parts = {"all": list(steps), "admitting": [i for i in steps if i in admitting]}
    parts["other"] = [i for i in steps if i not in admitting]

    def ratio(indices):
        spent = sum(host["minima"][i] for i in indices)
        return sum(plugin["minima"][i] for i in indices) / spent if indices and spent > 0 else None

    return {name: ratio(indices) for name, indices in parts.items()} | {"admitting_steps": len(parts["admitting"])}


# ---- the process's heap ---------------------------------------------------------------------------------
# GC-tracked objects (len(gc.get_objects())) of a served engine's main process, rounded up: FastDeploy's
# LLMEngine (e7c8dc2, plugin profile recommended, the CPU engine prototype's simulated worker and
# tiny WordLevel tokenizer) held 280,734 after serving 64 requests. A bench process that imports the host's
# scheduler modules holds about 270k already (paddle is among them); a real model's tokenizer adds more.
ENGINE_HEAP_OBJECTS = 300_000
_BALLAST: list = []


def grow_heap(target: int) -> dict:
    """Hold this process's GC-tracked objects at ``target`` at least (long-lived lists, as an engine's
    modules, configs and tokenizer tables are); return the counts before and after."""
    gc.collect()
    before = len(gc.get_objects())
    missing = max(0, target - before)
    _BALLAST.extend([i] for i in range(missing))  # a list is always tracked by the collector
    gc.collect()  # what an engine holds has survived many collections: generation 2
    return {"before": before, "after": len(gc.get_objects()), "added": missing}


def _print_heap(heap: dict) -> None:
    print(f"process heap: {heap['after']} GC-tracked objects ({heap['before']} with the host's modules loaded, "
          f"{heap['added']} long-lived objects added; an engine holds ~{ENGINE_HEAP_OBJECTS}); "
          f"gc thresholds {gc.get_threshold()}")


# --heap-objects: an engine holds a few hundred thousand; a hundred million is already ~10 GB of Python objects.
_nonneg_int = bounded_int(0, 100_000_000)


def add_workload_arg(parser) -> None:
    parser.add_argument("--workload", choices=WORKLOADS, default="spread",
                        help="spread (default): the running requests' max_tokens spread over 256-1024 tokens, one in "
                        "four without one, after 48 requests ran to completion (an estimator that learns from them "
                        "has learned); uniform: every running request at 512, nothing finished before")


def _add_heap_args(parser) -> None:
    parser.add_argument("--heap-objects", type=_nonneg_int, default=ENGINE_HEAP_OBJECTS, metavar="N",
                        help=f"grow the process to N GC-tracked objects first, as a served engine holds "
                        f"(default {ENGINE_HEAP_OBJECTS}; 0: as loaded)")
    parser.add_argument("--gc", choices=("all",) + GC_MODES, default="all",
                        help="time with the collector on (its counters as the workload left them), due (on, with a "
                        "full collection due, as a long-running engine regularly is), off, or all (default all)")


def _gc_modes(args) -> tuple:
    return GC_MODES if args.gc == "all" else (args.gc,)


def add_commands(sub):
    """``fdsched bench evict|schedule|transfer``; returns the ``bench`` subcommands (for ``instructions``)."""
    bench = sub.add_parser("bench", help="benchmarks that print numbers (need the host)")
    which = bench.add_subparsers(dest="bench", required=True)

    evict = which.add_parser("evict", help="LRU eviction: host vs plugin vs floor, time per block")
    evict.add_argument("--sizes", type=bounded_int(1, 1_000_000), nargs="+", default=[1000, 5000, 20000], help="blocks to evict, one run per size (default 1000 5000 20000)")
    evict.add_argument("--chain", type=bounded_int(1, 100_000), default=50, help="blocks per cached prompt (tree depth)")
    evict.add_argument("--block-size", type=bounded_int(1, 4096), default=4, help="tokens per KV block (default 4)")
    evict.add_argument("--repeat", type=bounded_int(1, 1000), default=3, help="median of N")
    _add_heap_args(evict)
    evict.set_defaults(func=_run_evict)

    sched = which.add_parser("schedule", help="schedule() CPU time per step: host vs plugin")
    sched.add_argument("--running", type=bounded_int(1, 65_536), default=256, help="running requests in the batch (default 256)")
    sched.add_argument("--waiting", type=bounded_int(0, 65_536), default=64, help="requests waiting to be admitted (default 64)")
    sched.add_argument("--steps", type=bounded_int(1, 1_000_000), default=200, help="schedule() calls timed per repetition (default 200)")
    sched.add_argument("--repeat", type=bounded_int(1, 1000), default=5,
                       help="repetitions of each arm (per process with --processes; default 5)")
    sched.add_argument("--processes", type=bounded_int(0, 100), default=3, metavar="P",
                       help="run each arm in P fresh processes of its own, taking turns, as an engine runs one class "
                       "(default 3); 0: both arms in this process, interleaved (quicker; the arms then share the "
                       "host's bytecode and disturb each other by a few percent)")
    sched.add_argument("--block-size", type=bounded_int(1, 4096), default=64, help="tokens per KV block (default 64)")
    sched.add_argument("--profile", default="recommended", help="the plugin's profile")
    add_workload_arg(sched)
    _add_heap_args(sched)
    sched.set_defaults(func=_run_schedule)

    transfer = which.add_parser("transfer", help="transfer-done receiver: idle RPC rate and latency, host vs plugin")
    transfer.add_argument("--idle-seconds", type=float, default=5.0, help="how long to count the idle receiver's RPCs (default 5)")
    transfer.add_argument("--count", type=bounded_int(1, 1_000_000), default=200, help="transfer-done signals to time (default 200)")
    transfer.add_argument("--interval", type=bounded_float(0.0, 60.0), default=0.02, help="seconds between signals")
    transfer.set_defaults(func=_run_transfer)
    return which


def _host_label() -> str:
    from fdsched.install.probe import probe

    return probe().label


def _prepare(args) -> None:
    from fdsched.replay.engine import prepare_host_environment

    print(f"host: {_host_label()}")
    prepare_host_environment()
    import fastdeploy.engine.sched.resource_manager_v1  # noqa: F401  (the host's modules are in the count)

    _print_heap(grow_heap(args.heap_objects))


def _run_evict(args) -> int:
    _prepare(args)
    modes = _gc_modes(args)
    # what a due full collection costs whoever triggers it, at the heap just grown (before the benches add to it)
    objects = len(gc.get_objects())
    full = f"one full collection of this process ({objects} GC-tracked objects): {full_collection_ms():.1f} ms"
    print(f"evict: chains of {args.chain} blocks, block size {args.block_size}, median of {args.repeat}")
    print_evict(bench_evict(args.sizes, args.chain, args.block_size, args.repeat, modes), modes)
    print(f"{full} (median of 3, before the runs)")
    return 0


def _run_schedule(args) -> int:
    from fdsched.core.settings import load_settings, resolve_profile

    resolve_profile(args.profile, "--profile")  # a bad --profile: one line now, not after the host import
    load_settings(environ={}, profile=args.profile)
    _prepare(args)
    modes = _gc_modes(args)
    if args.processes:
        result = bench_schedule_isolated(args.processes, args.running, args.waiting, args.steps, args.repeat,
                                         args.block_size, args.profile, modes, args.heap_objects, args.workload)
        where = f"each arm in {args.processes} processes of its own x {args.repeat} repetitions"
    else:
        result = bench_schedule(args.running, args.waiting, args.steps, args.repeat, args.block_size, args.profile, modes,
                                args.workload)
        where = f"both arms in this process, {args.repeat} interleaved repetitions"
    print(f"schedule() CPU per step, {args.running} running ({args.workload}) + {args.waiting} waiting, "
          f"{args.steps} steps, {where} "
          f"(plugin profile {args.profile}):")
    print(f"{'gc':<4} {'host median':>12} {'plugin median':>14} {'ratio':>6}   {'host mean':>10} {'plugin mean':>12} "
          f"{'ratio':>6}   {'minima ratio':>12} {'admitting':>9} {'other':>6}")
    for mode in modes:
        h, p = result[("host", mode)], result[("plugin", mode)]
        m = minima_ratios(h, p)
        shown = {k: "-" if m[k] is None else f"{m[k]:.3f}" for k in ("all", "admitting", "other")}
        print(f"{mode:<4} {h['median'] * 1e6:>9.1f} us {p['median'] * 1e6:>11.1f} us {p['median'] / h['median']:>6.3f}   "
              f"{h['mean'] * 1e6:>7.1f} us {p['mean'] * 1e6:>9.1f} us {p['mean'] / h['mean']:>6.3f}   "
              f"{shown['all']:>12} {shown['admitting']:>9} {shown['other']:>6}")
    print("minima ratio: plugin / host of the per-step minima summed over the steps (each step's least disturbed "
          f"repetition); admitting: the {m['admitting_steps']} steps in which either admitted a prefill chunk; other: the rest")
    for mode in modes:
        h, p = result[("host", mode)], result[("plugin", mode)]
        print(f"per-step minima, gc {mode}: host {statistics.fmean(h['minima']) * 1e6:.1f} us, "
              f"plugin {statistics.fmean(p['minima']) * 1e6:.1f} us a step")
    from fdsched.tools.guardbench import bench_guard, print_guard

    guard = bench_guard(lambda: scheduler_for(args.profile, args.running, args.waiting, args.block_size, args.workload),
                        lambda blocks: _build_tree(blocks, 50, args.block_size))
    print_guard(guard, result[("plugin", modes[0])]["median"], args.profile)
    return 0


# ---- CPU-cache transfer-done path (change 5) -----------------------------------------------------------
AUTHKEY = b"fdsched-bench"


def transfer_producer(port: int, count: int, interval: float, host_source: str) -> None:
    """A producer like a cache transfer manager: a fresh interpreter, the host's own client, no plugin.

    Puts ``count`` storage-write results ``interval`` seconds apart; each task id carries its put time.
    """
    import os

    if host_source:
        os.environ.setdefault("FDSCHED_HOST_SOURCE", host_source)
    from fdsched.install.probe import find_host
    from fdsched.replay.engine import prepare_host_environment

    prepare_host_environment()
    find_host()
    from fastdeploy.cache_manager.cache_data import CacheStatus
    from fastdeploy.inter_communicator.engine_cache_queue import EngineCacheQueue

    queue = EngineCacheQueue(address=("127.0.0.1", port), authkey=AUTHKEY, is_server=False, num_client=1, client_id=0)
    for i in range(count):
        time.sleep(interval)
        queue.put_transfer_done_signal((CacheStatus.GPU2STORAGE, f"task-{i}@{time.time():.6f}", [], [i]))


class StampingEvents(dict):
    """Stands in for the host's ``task_write_back_event`` map: every task id has an event, and setting it
    records (put time, handled time). The host's receiver sets the event when it handles the signal."""

    def __init__(self):
        super().__init__()
        self.handled = []  # (task id, put time, handled time) in handling order

    def __contains__(self, task_id):
        return True

    def __missing__(self, task_id):
        handled = self.handled

        class _Stamp:
            @staticmethod
            def set():
                handled.append((task_id, float(task_id.rsplit("@", 1)[1]), time.time()))

        return _Stamp()


def start_transfer_receiver(port: int):
    """The host's own receiver loop (PrefixCacheManager.recv_data_transfer_result) on a real manager."""
    import sys
    import threading
    from types import SimpleNamespace

    import numpy as np

    from fdsched.replay.engine import EngineShape, build_manager

    rm = build_manager(EngineShape(block_size=4, num_gpu_blocks=32, max_num_seqs=2, max_num_batched_tokens=64,
                                   max_model_len=64))
    cm = rm.cache_manager
    queue_cls = sys.modules["fastdeploy.inter_communicator.engine_cache_queue"].EngineCacheQueue
    cm.cache_task_queue = queue_cls(address=("127.0.0.1", port), authkey=AUTHKEY, is_server=False, num_client=1,
                                    client_id=0)
    cm.prefix_tree_status_signal = SimpleNamespace(value=np.zeros(1, dtype=np.int32))  # normally launch_cache_manager's
    cm.task_write_back_event = StampingEvents()
    thread = threading.Thread(target=cm.recv_data_transfer_result, name="fdsched-transfer-receiver", daemon=True)
    thread.start()
    return rm, cm, thread


def start_transfer_server():
    import sys

    queue_cls = sys.modules["fastdeploy.inter_communicator.engine_cache_queue"].EngineCacheQueue
    server = queue_cls(address=("127.0.0.1", 0), authkey=AUTHKEY, is_server=True, num_client=1,
                       local_data_parallel_size=1)
    return server, server.get_server_port()


def run_producer(port: int, count: int, interval: float) -> None:
    import multiprocessing
    import os

    producer = multiprocessing.get_context("spawn").Process(
        target=transfer_producer, args=(port, count, interval, os.environ.get("FDSCHED_HOST_SOURCE", ""))
    )
    producer.start()
    producer.join(timeout=300)
    if producer.exitcode != 0:
        raise RuntimeError(f"the producer process failed (exit code {producer.exitcode})")


def bench_transfer(idle_seconds: float, count: int, interval: float) -> dict:
    import threading
    from multiprocessing.managers import BaseProxy

    results = {}
    original_call = BaseProxy._callmethod
    for variant, profile in (("host", None), ("plugin", "nonpolling_transfer")):
        _install(profile)
        server, port = start_transfer_server()
        rm, cm, receiver = start_transfer_receiver(port)
        calls = [0]

        def counting(self, *args, **kwargs):
            if threading.current_thread() is receiver:
                calls[0] += 1
            return original_call(self, *args, **kwargs)

        BaseProxy._callmethod = counting
        try:
            time.sleep(0.5)  # the receiver's connection is open
            calls[0] = 0
            started = time.perf_counter()
            time.sleep(idle_seconds)
            idle_rate = calls[0] / (time.perf_counter() - started)
        finally:
            BaseProxy._callmethod = original_call
        run_producer(port, count, interval)
        deadline = time.time() + 10
        while len(cm.task_write_back_event.handled) < count and time.time() < deadline:
            time.sleep(0.01)
        handled = cm.task_write_back_event.handled
        latencies = sorted((done - put) * 1e3 for _, put, done in handled)
        results[variant] = {
            "idle_rpc_per_s": idle_rate,
            "handled": len(handled),
            "in_order": [t for t, _, _ in handled] == sorted((t for t, _, _ in handled), key=lambda t: int(t[5:].split("@")[0])),
            "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99),
            "max_ms": latencies[-1] if latencies else float("nan"),
        }
        stop_transfer(server, rm)
    _install(None)
    return results


def stop_transfer(server, rm) -> None:
    """Shut the queue server down; the host's receiver thread then ends on the closed connection (expected)."""
    import threading

    from fdsched.replay.engine import close_manager

    previous = threading.excepthook

    def quiet(hook_args):
        if hook_args.thread is None or hook_args.thread.name != "fdsched-transfer-receiver":
            previous(hook_args)

    threading.excepthook = quiet
    server.manager.shutdown()
    time.sleep(0.2)
    close_manager(rm)


def _run_transfer(args) -> int:
    print(f"host: {_host_label()}")
    results = bench_transfer(args.idle_seconds, args.count, args.interval)
    print(f"transfer-done receiver: idle {args.idle_seconds:.0f} s, then {args.count} signals {args.interval * 1e3:.0f} ms "
          f"apart from another process")
    print(f"{'variant':<8} {'idle RPC/s':>10} {'handled':>8} {'in order':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for variant, r in results.items():
        print(f"{variant:<8} {r['idle_rpc_per_s']:>10.1f} {r['handled']:>8} {str(r['in_order']):>9} {r['p50_ms']:>8.2f} "
              f"{r['p99_ms']:>8.2f} {r['max_ms']:>8.2f}")
    return 0

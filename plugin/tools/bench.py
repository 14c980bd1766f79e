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
own, the two of a pair of processes taking turns run by run (``--processes``; 0: both in this process, interleaved
repetitions),
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
import os
import statistics
from typing import Optional

from fdsched.core.common import bounded_float, bounded_int
from fdsched.tools.benchcommon import GC_MODES, full_collection_ms, host_label, install_arm, timed
from fdsched.tools.evictbench import bench_evict, build_tree, print_evict
from fdsched.tools.transferbench import run_transfer


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
    from fdsched.replay.driver import Driver
    from fdsched.replay.engine import EngineShape, build_manager, make_request

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

    install_arm(None if variant == "host" else variant)
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
                   workload: str = "spread") -> tuple:
    """One timed run of one arm (``variant``: "host" or a profile) on a fresh scheduler: ``([(cpu seconds, admitted
    a prefill chunk)] per step, [collections of generation 0, 1, 2 that ran while timed])`` (the driver's work is the
    same for both arms: a difference in collections is the arm's)."""
    with scheduler_for(variant, running, waiting, block_size, workload) as (rm, driver):
        gc.collect()

        def run(driver=driver):  # the driver plays worker and token processor; only schedule() is timed
            # per step, its CPU time and whether it admitted a chunk: the step's record is not kept
            # alive through the timed run (its lists would be objects for the collector to walk)
            return [(record.schedule_cpu_seconds, bool(record.prefill_chunks))
                    for record in (driver.step() for _ in range(steps))]

        _, per_step, collections = timed(run, {"on": True, "due": "due", "off": False}[mode])
    return per_step, collections


def _start_arm_process(heap_objects: int, cpu: Optional[int]) -> None:
    """A fresh interpreter's start (:func:`run_arm_groups`): the host made importable, the heap grown as the bench's
    own process grows it, then on ``cpu`` alone (None: where the system puts it; the imports before, on any CPU)."""
    import_host()
    grow_heap(heap_objects)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def group_cpus(groups: int) -> list:
    """The CPU each group of arm processes runs on (:func:`run_arm_groups`): the groups go round the CPUs this
    process may use, every process of a group on the same one; None for each where CPUs cannot be chosen."""
    if not hasattr(os, "sched_getaffinity"):
        return [None] * groups
    cpus = sorted(os.sched_getaffinity(0))
    return [cpus[group % len(cpus)] for group in range(groups)]


def _run_in_arm_process(variant: str, mode: str, shape: tuple) -> tuple:
    """One timed run of ``variant`` in an arm's process (:func:`_schedule_runs`), the host's own class put back."""
    try:
        return _schedule_runs(variant, mode, *shape)
    finally:
        install_arm(None)


def arm_order(repetition: int, arms: tuple = ("host", "plugin")) -> tuple:
    """The arms' order in a repetition: they take turns going first, the order reversed every other repetition (the
    arm that runs second in a process inherits the first one's heap; in processes of their own, each run starts a
    moment after the one before)."""
    return tuple(arms) if repetition % 2 == 0 else tuple(reversed(arms))


def bench_schedule(running: int, waiting: int, steps: int, repeat: int, block_size: int, profile: str,
                   gc_modes=GC_MODES, workload: str = "spread") -> dict:
    """{(variant, gc mode): {"median": s, "mean": s, "minima": [s per step], "admitting": {step index}}} of
    schedule() CPU per step, both arms in this process, interleaved repetitions. ``minima``: each step's least
    time over the repetitions; ``admitting``: the steps in which that variant scheduled a prefill chunk (the same
    in every repetition). ``profile`` "host": a null run, the host's own class in both arms."""
    runs = {(v, m): [] for v in ("host", "plugin") for m in gc_modes}
    for repetition in range(repeat):
        for mode in gc_modes:
            for variant in arm_order(repetition):
                arm = "host" if variant == "host" else profile
                runs[(variant, mode)].append(_schedule_runs(arm, mode, running, waiting, steps, block_size, workload))
    install_arm(None)
    return summarise_runs(runs)


def bench_schedule_isolated(processes: int, running: int, waiting: int, steps: int, repeat: int, block_size: int,
                            profile: str, gc_modes=GC_MODES, heap_objects: Optional[int] = None,
                            workload: str = "spread") -> dict:
    """:func:`bench_schedule` with each arm in processes of its own, as an engine runs one class: ``processes`` pairs
    of fresh interpreters, one per arm (:func:`run_arm_groups`: the plugin arm's ``groups`` has each pair's own minima
    ratio). In one process the arms disturb each other: there, which arm went first in each repetition moved the ratio
    by up to 5 points (``recommended``, 448 running, e7c8dc2: 1.05-1.07 host first, 1.09-1.13 taking turns)."""
    return run_arm_groups(processes, {"host": "host", "plugin": profile},
                          (running, waiting, steps, block_size, workload), repeat, gc_modes, heap_objects)


def run_arm_groups(groups: int, arms: dict, shape: tuple, repeat: int, gc_modes=GC_MODES,
                   heap_objects: Optional[int] = None) -> dict:
    """Time ``arms`` (label -> "host" or a profile; the first is the reference, "host") in ``groups`` groups of fresh
    interpreters, one per arm, each grown to ``heap_objects`` GC-tracked objects (default
    :data:`ENGINE_HEAP_OBJECTS`). A group's processes live side by side on one CPU (:func:`group_cpus`) and take turns
    run by run (:func:`arm_order`, one run at a time), ``repeat`` runs of each arm per gc mode, so every arm is timed
    on the same CPU in the same stretch of the machine's time (a null run's processes one after another, 256 running:
    740-1190 us a step). :func:`summarise_runs` of every run, each arm but the first with ``groups``: each group's
    own minima ratio against the first arm."""
    import multiprocessing

    heap_objects = ENGINE_HEAP_OBJECTS if heap_objects is None else heap_objects
    spawn = multiprocessing.get_context("spawn")
    labels = tuple(arms)
    runs = {(arm, mode): [] for arm in labels for mode in gc_modes}
    groups_ratios = {key: [] for key in runs if key[0] != labels[0]}
    for cpu in group_cpus(groups):
        pools = {arm: spawn.Pool(1, _start_arm_process, (heap_objects, cpu)) for arm in labels}
        try:
            for pool in pools.values():  # all started (host imported, heap grown) before the first timed run
                pool.apply(int)
            mine = {key: [] for key in runs}
            for repetition in range(repeat):
                for mode in gc_modes:
                    for arm in arm_order(repetition, labels):
                        mine[(arm, mode)].append(pools[arm].apply(_run_in_arm_process, (arms[arm], mode, shape)))
        finally:
            for pool in pools.values():
                pool.terminate()
                pool.join()
        group = summarise_runs(mine)
        for key, timed_runs in mine.items():
            runs[key].extend(timed_runs)
        for arm, mode in groups_ratios:
            groups_ratios[(arm, mode)].append(minima_ratios(group[(labels[0], mode)], group[(arm, mode)])["all"])
    result = summarise_runs(runs)
    for key, ratios in groups_ratios.items():
        result[key]["groups"] = ratios
    return result


def summarise_runs(runs: dict) -> dict:
    """``{(variant, mode): [(per-step records of one run, its collections per generation)]}`` -> what
    :func:`bench_schedule` returns (``collections``: per generation, the mean over the runs)."""
    result = {}
    for key, timed_runs in runs.items():
        per_run = [records for records, _ in timed_runs]
        counts = [collections for _, collections in timed_runs]
        flat = [seconds for records in per_run for seconds, _ in records]
        steps = len(per_run[0]) if per_run else 0
        result[key] = {
            "median": statistics.median(flat),
            "mean": statistics.fmean(flat),
            "minima": [min(records[i][0] for records in per_run) for i in range(steps)],
            "admitting": {i for records in per_run for i, (_, admitted) in enumerate(records) if admitted},
            "collections": [statistics.fmean(c[g] for c in counts) if counts else 0.0 for g in range(3)],
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


def add_shape_args(parser, steps_help: str, most_steps: int = 1_000_000) -> None:
    """The schedule benches' workload: --running, --waiting, --steps, --block-size, --workload."""
    parser.add_argument("--running", type=bounded_int(1, 65_536), default=256,
                        help="running requests in the batch (default 256)")
    parser.add_argument("--waiting", type=bounded_int(0, 65_536), default=64,
                        help="requests waiting to be admitted (default 64)")
    parser.add_argument("--steps", type=bounded_int(1, most_steps), default=200, help=f"{steps_help} (default 200)")
    parser.add_argument("--block-size", type=bounded_int(1, 4096), default=64, help="tokens per KV block (default 64)")
    add_workload_arg(parser)


def add_heap_args(parser) -> None:
    parser.add_argument("--heap-objects", type=_nonneg_int, default=ENGINE_HEAP_OBJECTS, metavar="N",
                        help=f"grow the process to N GC-tracked objects first, as a served engine holds "
                        f"(default {ENGINE_HEAP_OBJECTS}; 0: as loaded)")
    parser.add_argument("--gc", choices=("all",) + GC_MODES, default="all",
                        help="time with the collector on (its counters as the workload left them), due (on, with a "
                        "full collection due, as a long-running engine regularly is), off, or all (default all)")


def gc_modes_of(args) -> tuple:
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
    add_heap_args(evict)
    evict.set_defaults(func=_run_evict)

    sched = which.add_parser("schedule", help="schedule() CPU time per step: host vs plugin")
    add_shape_args(sched, "schedule() calls timed per repetition")
    sched.add_argument("--repeat", type=bounded_int(1, 1000), default=5,
                       help="repetitions of each arm (per process with --processes; default 5)")
    sched.add_argument("--processes", type=bounded_int(0, 100), default=3, metavar="P",
                       help="run each arm in processes of its own, as an engine runs one class: P pairs of fresh "
                       "processes, one per arm, whose two take turns run by run (default 3); 0: both arms in this "
                       "process, interleaved (quicker; the arms then share the host's bytecode and disturb each other "
                       "by a few percent)")
    sched.add_argument("--profile", default="recommended", help="the plugin's profile")
    sched.add_argument("--null", action="store_true",
                       help="time the host's own class in both arms (an A/A run): how far apart this machine puts two "
                       "identical arms; read a plugin run's ratio against that spread")
    add_heap_args(sched)
    sched.set_defaults(func=_run_schedule)

    transfer = which.add_parser("transfer", help="transfer-done receiver: idle RPC rate and latency, host vs plugin")
    transfer.add_argument("--idle-seconds", type=float, default=5.0, help="how long to count the idle receiver's RPCs (default 5)")
    transfer.add_argument("--count", type=bounded_int(1, 1_000_000), default=200, help="transfer-done signals to time (default 200)")
    transfer.add_argument("--interval", type=bounded_float(0.0, 60.0), default=0.02, help="seconds between signals")
    transfer.set_defaults(func=run_transfer)
    return which


def prepare(args) -> None:
    from fdsched.replay.engine import prepare_host_environment

    print(f"host: {host_label()}")
    prepare_host_environment()
    import fastdeploy.engine.sched.resource_manager_v1  # noqa: F401  (the host's modules are in the count)

    _print_heap(grow_heap(args.heap_objects))


def _run_evict(args) -> int:
    prepare(args)
    modes = gc_modes_of(args)
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
    prepare(args)
    modes = gc_modes_of(args)
    second = "host" if args.null else args.profile  # the second ("plugin") arm's class: the host's own in a null run
    if args.processes:
        result = bench_schedule_isolated(args.processes, args.running, args.waiting, args.steps, args.repeat,
                                         args.block_size, second, modes, args.heap_objects, args.workload)
        where = (f"{args.processes} pairs of processes, one per arm, taking turns run by run, x {args.repeat} "
                 "repetitions")
    else:
        result = bench_schedule(args.running, args.waiting, args.steps, args.repeat, args.block_size, second, modes,
                                args.workload)
        where = f"both arms in this process, {args.repeat} interleaved repetitions"
    arms = "null run: the host's own class in both arms" if args.null else f"plugin profile {args.profile}"
    print(f"schedule() CPU per step, {args.running} running ({args.workload}) + {args.waiting} waiting, "
          f"{args.steps} steps, {where} ({arms}):")
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
    for mode in modes:
        pairs = result[("plugin", mode)].get("groups")  # with --processes: a pair of processes is a group
        if pairs:
            print(f"minima ratio of each pair of processes, gc {mode}: {' '.join(f'{r:.3f}' for r in pairs)} "
                  f"(median {statistics.median(pairs):.3f})")
    for mode in (m for m in modes if m != "off"):
        h, p = (" / ".join(f"{n:.1f}" for n in result[(v, mode)]["collections"]) for v in ("host", "plugin"))
        print(f"collections while timed, gc {mode} (generations 0 / 1 / 2, mean per run of {args.steps} steps): "
              f"host {h}, plugin {p}")
    if args.null:
        return 0  # no plugin arm: no guard to time
    from fdsched.tools.guardbench import bench_guard, print_guard

    guard = bench_guard(lambda: scheduler_for(args.profile, args.running, args.waiting, args.block_size, args.workload),
                        lambda blocks: build_tree(blocks, 50, args.block_size))
    print_guard(guard, result[("plugin", modes[0])]["median"], args.profile)
    return 0

"""``fdsched bench sweep``: the schedule bench (:mod:`fdsched.tools.bench`) over many profiles at once.

Each group of fresh processes holds one per arm: the host's own class, a second process of the host's own class
(``null``: how far apart two identical arms read in the same stretch of time) and one per profile. A group's
processes share one CPU and take turns run by run (:func:`fdsched.tools.bench.run_arm_groups`), so every profile is
timed beside the host and the null arm in the same minutes. The sweep prints, per arm, the minima ratio of all its
runs against the host's, split into admitting and other steps, the median and spread of the groups' own minima
ratios, and the arm's median step.
"""

from __future__ import annotations

import statistics

from fdsched.core.common import bounded_int
from fdsched.tools.bench import add_heap_args, add_shape_args, gc_modes_of, minima_ratios, prepare, run_arm_groups

NULL = "null"  # the second process of the host's own class


def sweep_arms(profiles) -> dict:
    """Arm label -> the class it runs ("host" or a profile): the host first (the reference), the null arm, then
    ``profiles`` in the order given."""
    return {"host": "host", NULL: "host"} | {profile: profile for profile in profiles}


def parse_profiles(value: str) -> list:
    """``--profiles``: "all" (every shipped profile) or shipped profile names or YAML paths, comma-separated; a bad
    value raises :class:`SettingsError` naming the flag, before any process starts."""
    from fdsched.core.settings import SettingsError, resolve_profile, shipped_profiles

    names = list(shipped_profiles()) if value.strip() == "all" else [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise SettingsError(f"--profiles: bad value {value!r}; allowed: 'all' or one or more profiles, comma-separated")
    for name in names:
        resolve_profile(name, "--profiles")
    if len(set(names)) != len(names) or {"host", NULL} & set(names):
        raise SettingsError(f"--profiles: bad value {value!r}; allowed: each profile once, none named 'host' or "
                            f"'{NULL}'")
    return names


def sweep_rows(result: dict, arms: dict, mode: str) -> list:
    """One row per arm but the host: (label, minima ratios as :func:`minima_ratios`, the groups' own ratios, the
    arm's median step in seconds); the host's row first, with no ratios."""
    host = result[("host", mode)]
    rows = [("host", None, [], host["median"])]
    for arm in list(arms)[1:]:
        timed = result[(arm, mode)]
        rows.append((arm, minima_ratios(host, timed), timed["groups"], timed["median"]))
    return rows


def _shown(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_sweep(result: dict, arms: dict, modes) -> None:
    for mode in modes:
        print(f"gc {mode}:")
        print(f"{'arm':<22} {'minima ratio':>12} {'admitting':>9} {'other':>6}   {'median group':>12} "
              f"{'least':>6} {'most':>6}   {'median step':>11}")
        for arm, ratios, groups, median in sweep_rows(result, arms, mode):
            label = "null (host again)" if arm == NULL else arm
            if ratios is None:
                print(f"{label:<22} {'':>12} {'':>9} {'':>6}   {'':>12} {'':>6} {'':>6}   {median * 1e6:>8.1f} us")
                continue
            print(f"{label:<22} {_shown(ratios['all']):>12} {_shown(ratios['admitting']):>9} "
                  f"{_shown(ratios['other']):>6}   {statistics.median(groups):>12.3f} {min(groups):>6.3f} "
                  f"{max(groups):>6.3f}   {median * 1e6:>8.1f} us")
    print("minima ratio: the arm / the host of the per-step minima over all their runs, summed over the steps; "
          "admitting: the steps in which either admitted a prefill chunk; median group: the median of each group's "
          "own minima ratio (a group's processes share a CPU and its stretch of time); median step: over all runs")


def _run_sweep(args) -> int:
    profiles = parse_profiles(args.profiles)  # SettingsError: one line, from main()
    prepare(args)
    modes = gc_modes_of(args)
    arms = sweep_arms(profiles)
    shape = (args.running, args.waiting, args.steps, args.block_size, args.workload)
    print(f"schedule() CPU per step, {args.running} running ({args.workload}) + {args.waiting} waiting, "
          f"{args.steps} steps; {args.groups} groups of {len(arms)} processes (the host's class, the host's class "
          f"again, one per profile), each group on one CPU taking turns run by run, x {args.repeat} repetitions")
    print_sweep(run_arm_groups(args.groups, arms, shape, args.repeat, modes, args.heap_objects), arms, modes)
    return 0


def add_command(which) -> None:
    """``fdsched bench sweep`` under the ``bench`` subcommands ``which``."""
    sweep = which.add_parser("sweep", help="schedule() CPU per step of many profiles at once, beside the host and "
                             "a second host process, in groups of processes that share a CPU")
    sweep.add_argument("--profiles", default="all",
                       help="'all' (default: every shipped profile) or profiles, comma-separated")
    add_shape_args(sweep, "schedule() calls timed per run")
    sweep.add_argument("--groups", type=bounded_int(1, 100), default=12, metavar="G",
                       help="groups of processes, one process per arm in each (default 12)")
    sweep.add_argument("--repeat", type=bounded_int(1, 1000), default=4,
                       help="runs of each arm per group and gc mode (default 4)")
    add_heap_args(sweep)
    sweep.set_defaults(func=_run_sweep)

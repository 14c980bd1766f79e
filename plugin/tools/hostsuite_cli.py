"""``fdsched host test``: the host's own test suites without and with fdsched (per profile). The runs are chosen
(by default the profile that applies the most changes on this host: :func:`most_applying_profile`), FastDeploy's
loader is checked, each run is compared with the ``no-plugin`` run and one table is printed. The harness itself is
:mod:`fdsched.tools.hostsuites`.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from fdsched.core.common import EXIT_ERROR, EXIT_OK, text_table
from fdsched.install.hosts import host_key
from fdsched.tools.hostsuites import (
    DEFAULT_RUN, NO_PLUGIN, check_loader, engine_profiles, load_table, run_and_compare, run_names, run_suite, suite_files,
)

__all__ = ["add_command", "cmd_test", "profile_decisions", "most_applying_profile"]


def add_command(host_sub) -> None:
    test = host_sub.add_parser(
        "test",
        help="run the host's own test files without and with fdsched (per profile): no test that passes without it may fail with it",
    )
    test.add_argument("--run", nargs="+", metavar="RUN",
                      help=f"runs to make besides {NO_PLUGIN} (default: {DEFAULT_RUN} and the profile that applies the "
                           "most changes on this host)")
    test.add_argument("--all-profiles", action="store_true", help="every run: default and every shipped profile")
    test.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    test.set_defaults(func=cmd_test)


def cmd_test(args) -> int:
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        print("fdsched host test: error: pytest is not installed here; allowed: pip install pytest (or, in a checkout of this project: pip install '.[test]')",
              file=sys.stderr)
        return EXIT_ERROR
    table = load_table()
    info, runs = _probe_and_runs(args)
    unknown = [r for r in runs if r not in run_names()]
    if unknown:
        print(f"fdsched host test: error: --run {unknown}; allowed: {', '.join(run_names())}", file=sys.stderr)
        return EXIT_ERROR
    tree, key, label = info.location, host_key(info.commit), info.label
    print(f"host suites on {label} ({info.support})")
    failed = _loader_failed(tree, args.timeout)
    files = suite_files(tree, key, table) if os.path.isdir(os.path.join(tree, "tests")) else []
    if not files:
        print(f"  this tree has none of the host test files the suites run ({len(table.candidates)} candidates): "
              "nothing to compare")
        print("host suites: " + ("FAILED" if failed else "no suites in this tree; the loader checks passed"))
        return EXIT_ERROR if failed else EXIT_OK
    print(f"  {len(files)} files; runs: {NO_PLUGIN}, {', '.join(runs)}")
    baseline = run_suite(tree, key, NO_PLUGIN, table, args.timeout)
    rows = []
    for run in [NO_PLUGIN] + runs:
        result, problems, altered = run_and_compare(tree, key, run, table, baseline, timeout=args.timeout)
        counts = result.counts()
        rows.append((run, counts["passed"], counts["failed"], len(altered), counts["skipped"], len(problems),
                     f"{result.seconds:.1f}"))
        failed = _print_run(run, result, problems, altered, table) or failed
    print(text_table(rows, ("run", "passed", "failed", "altered", "skipped", "problems", "seconds")))
    print("host suites: " + ("FAILED" if failed else "no test that passes without the plugin fails with it"))
    return EXIT_ERROR if failed else 0


def _probe_and_runs(args) -> tuple:
    """(the probed host, the runs to make besides no-plugin: --all-profiles, --run, or default and the profile that
    applies the most changes here); the host's import chatter goes to a log file."""
    from fdsched.cmdline.quiet import host_output_to
    from fdsched.install.hosts import cache_dir
    from fdsched.install.probe import probe

    with host_output_to(cache_dir() / "logs" / "host-test-host.log", verbose=False):  # the host's import chatter
        info = probe()
        best = None if (args.all_profiles or args.run) else most_applying_profile(info)
    if args.all_profiles:
        return info, run_names()[1:]
    if args.run:
        return info, [r for r in args.run if r != NO_PLUGIN]
    return info, [DEFAULT_RUN] + [p for p in [best] if p]


def _loader_failed(tree: str, timeout: float) -> bool:
    """FastDeploy's own loader with FD_PLUGINS unset (must not install) and =fdsched (must); True on a problem."""
    loader = {plugins: check_loader(tree, plugins, timeout) for plugins in (None, "fdsched")}
    print(f"  FastDeploy's loader, FD_PLUGINS unset: {'INSTALLED (wrong)' if loader[None]['installed'] else 'not installed'}"
          f"; FD_PLUGINS=fdsched: {'installed' if loader['fdsched']['installed'] else 'not installed: ' + str(loader['fdsched'].get('error'))}")
    if loader[None]["installed"] or loader[None]["exit"] != 0 or loader["fdsched"]["exit"] != 0:
        print(f"  loader problem: {loader}")
        return True
    return False


def _print_run(run: str, result, problems: list, altered: dict, table) -> bool:
    """What one run left behind, refused, altered on purpose and got wrong; True when it has a problem."""
    for node, threads in sorted(result.leaked_threads.items()):
        where = "own process" if node.split("::", 1)[0] in table.own_process else "SHARED process"
        print(f"  {run}: left threads running ({where}): {node}: {', '.join(threads)}")
    for call in result.refused_signals:
        print(f"  {run}: refused a signal to a process the suite did not start: {call}")
    if result.install.get("refused"):
        print(f"  {run}: refused at load, nothing patched: {result.install['refused']}")
    for node, why in altered.items():
        print(f"  {run}: altered on purpose: {node}: {why}")
    for problem in problems:
        print(f"  {run}: {problem}")
    if problems:
        print(result.output_tail)
    return bool(problems)


def profile_decisions(info, refusals: Optional[dict] = None) -> dict:
    """Every profile an engine runs differently -> its decisions on the probed host ``info``, or None where the host
    refuses it (recommended first, then by name). ``refusals``, if given, receives each refused profile's one-line
    reason (the message an engine would stop with)."""
    from fdsched.core.settings import load_settings
    from fdsched.install.installer import InstallError, decide

    found = {}
    for name in sorted(set(engine_profiles().values()), key=lambda n: (n != "recommended", n)):
        try:
            found[name] = decide(load_settings({}, profile=name), info)
        except InstallError as exc:
            found[name] = None
            if refusals is not None:
                refusals[name] = (str(exc).splitlines() or [type(exc).__name__])[0]
    return found


def most_applying_profile(info=None, decisions: Optional[dict] = None) -> Optional[str]:
    """The profile that applies the most changes on the probed host (plugin code in the most places; ties:
    recommended first, then by name), None when every profile is refused there. ``decisions``: what
    :func:`profile_decisions` found, if the caller has it already."""
    if decisions is None:
        if info is None:
            from fdsched.install.probe import probe

            info = probe()
        decisions = profile_decisions(info)
    best, best_count = None, -1
    for name, decided in decisions.items():
        if decided is None:
            continue
        count = sum(1 for d in decided.values() if d.impl != "host")
        if count > best_count:
            best, best_count = name, count
    return best

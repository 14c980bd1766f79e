"""``fdsched eval``'s body: the reference arms on the held-out evaluation windows (docs/evaluation.md), one table.

Its options are declared in :mod:`fdsched.replay.cli`; it checks and runs as ``fdsched replay`` does
(:mod:`fdsched.replay.replay_cli`), over the windows :mod:`fdsched.replay.evaluate` imports and replays.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fdsched.core.common import EXIT_ERROR, EXIT_OK, error_line
from fdsched.cmdline.outdir import settle_out_dir
from fdsched.replay.replay_cli import ProgressBar, check_out_dir, refuse_duplicate_arms, report_run_error, run_failure
from fdsched.replay.trace import TraceError

__all__ = ["cmd_eval"]


def cmd_eval(args) -> int:
    from fdsched.core.settings import SettingsError, load_settings

    from fdsched.replay.evaluate import format_eval_markdown, format_eval_table, load_results, load_windows, window_trace_name

    from fdsched.replay.costmodel import check_replay_settings, resolve_cost_model

    try:
        plan = load_windows(args.windows)
        arms = tuple(args.arms or plan.arms)
        refuse_duplicate_arms(list(arms), "--arms")
        for profile in arms:
            check_replay_settings(load_settings(environ={}, profile=profile))
        if args.cost_model is not None:
            resolve_cost_model(args.cost_model, "--cost-model")
    except (TraceError, SettingsError) as exc:
        print(error_line("eval", exc), file=sys.stderr)
        return EXIT_ERROR
    if args.list:
        for t in plan.tuning:
            print(f"tuning: {t}")
        for w in plan.windows:
            names = ", ".join(window_trace_name(w, m) for m in w.max_tokens)
            print(f"evaluation: {w.name}: {w.file} from {w.start:g} s for {w.duration:g} s, rate x{w.rate_scale:g}, "
                  f"engine {w.engine} -> {names}")
        print(f"shipped (tuned on, reported alongside): {', '.join(plan.shipped)}")
        print(f"arms: {', '.join(arms)}")
        return EXIT_OK
    fmt = format_eval_markdown if args.markdown else format_eval_table
    if args.table_from:
        try:
            results, models, hosts = load_results(args.table_from, plan, args.only)
        except TraceError as exc:
            print(error_line("eval", exc), file=sys.stderr)
            return EXIT_ERROR
        print(f"cost model: {', '.join(models)}; host: {', '.join(hosts)}")
        print(fmt(results))
        return EXIT_OK
    try:
        out, created = check_out_dir(args.out, "fdsched eval")  # before the imports and arms run, not after
    except TraceError as exc:
        print(error_line("eval", exc), file=sys.stderr)
        return EXIT_ERROR
    try:
        return _run_eval(args, plan, arms, fmt)
    finally:
        settle_out_dir(out, "fdsched eval", created)


def _run_eval(args, plan, arms, fmt) -> int:
    """``fdsched eval`` after its checks: import, replay every arm, print the table (the output folder is claimed)."""
    from fdsched.install.probe import HostNotFound
    from fdsched.install.installer import InstallError
    from fdsched.core.settings import SettingsError
    from fdsched.replay.evaluate import run_plan

    tqdm = None
    if not args.no_progress:
        try:
            from tqdm import tqdm
        except ImportError:
            pass
    from fdsched.cmdline.quiet import host_output_to, log_note

    error = None
    # as fdsched replay: the host's import-time and run-time messages go to OUT/host.log (-v: here)
    with host_output_to(Path(args.out) / "host.log", verbose=args.verbose) as host_log:
        terminal = host_log.terminal
        progress_factory = None
        if tqdm is not None:
            progress_factory = lambda profile, total: ProgressBar(tqdm, profile, total, terminal)  # noqa: E731
        try:
            results = run_plan(plan, Path(args.csv_dir), Path(args.out), arms, include_shipped=not args.no_shipped,
                               progress_factory=progress_factory, log=lambda m: print(m, file=terminal, flush=True),
                               check_every=args.check_every, cost_overrides={"model": args.cost_model}, only=args.only)
        except (HostNotFound, SettingsError, InstallError, TraceError) as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - anything else the host (or we) raised mid-run: one line
            error = run_failure(exc, Path(args.out) / "host.log")
    note = log_note(host_log)
    if error is not None:
        return report_run_error(error, "eval")
    if note:
        print(note)
    print(fmt(results))
    print(f"\nreports: {Path(args.out)}/<trace>.report.json")
    violations = sum(p["figures"]["invariant_violations"] for _, profiles in results for p in profiles)
    return EXIT_ERROR if violations else EXIT_OK

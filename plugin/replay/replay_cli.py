"""``fdsched replay``'s body: check the inputs, replay the trace once per arm, write and print the report.

Its options are declared in :mod:`fdsched.replay.cli`. The run's pieces that ``fdsched eval``
(:mod:`fdsched.replay.eval_cli`) shares are public here: the progress bar, the output folder's claim, the
one-arm-per-profile check, the one-line report of an unexpected error and of a run that did not start.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fdsched.core.common import EXIT_ERROR, EXIT_NO_HOST, EXIT_OK, error_line
from fdsched.cmdline.outdir import settle_out_dir
from fdsched.replay.trace import TraceError, check_engine
from fdsched.replay.tracefile import load_trace, resolve_trace

DEFAULT_PROFILES = ("baseline", "recommended")

__all__ = ["cmd_replay", "ProgressBar", "check_out_dir", "refuse_duplicate_arms", "report_run_error", "run_failure"]


class ProgressBar:
    """One tqdm bar counting requests, fed the running total (``update_to``)."""

    def __init__(self, tqdm_cls, label: str, total: int, stream=None) -> None:
        self._bar = tqdm_cls(total=total, desc=label, unit="req", file=stream or sys.stderr, leave=False, disable=None)
        self._done = 0

    def update_to(self, done: int) -> None:
        if done > self._done:
            self._bar.update(done - self._done)
            self._done = done

    def close(self) -> None:
        self._bar.close()


def _import_host() -> None:
    """Find the host and import the modules every arm uses (raises HostNotFound)."""
    from fdsched.install.probe import HostNotFound, find_host

    from fdsched.replay.engine import prepare_host_environment

    prepare_host_environment()
    find_host()
    try:
        import fastdeploy.cache_manager.prefix_cache_manager  # noqa: F401
        import fastdeploy.config  # noqa: F401
        import fastdeploy.engine.args_utils  # noqa: F401
        import fastdeploy.engine.sched.resource_manager_v1  # noqa: F401
    except Exception as exc:  # the host's own import failing is a host problem; say what it was
        raise HostNotFound(f"importing the host's scheduler modules failed: {type(exc).__name__}: {exc}") from None


def check_out_dir(value: str, command: str) -> tuple:
    """(folder, created): the output folder, made and marked now (a bad --out fails before the arms run, not
    minutes later); only a new or empty folder or one the same command wrote is taken. Raises TraceError."""
    from fdsched.cmdline.outdir import OutputError, claim_out_dir

    try:
        return claim_out_dir(value, command)
    except OutputError as exc:
        raise TraceError(str(exc)) from None


REPORT_FILES = ("report.json", "replay.png")


def _say_if_replacing(out: Path) -> None:
    """An earlier report in ``out`` is replaced when this run finishes (and kept if it fails): say so now, on
    stderr, so that nobody loses a report without a word."""
    old = [name for name in REPORT_FILES if (out / name).is_file()]
    if old:
        import time

        when = time.strftime("%Y-%m-%d %H:%M", time.localtime((out / old[0]).stat().st_mtime))
        print(f"fdsched replay: note: {out} holds an earlier report ({', '.join(old)}, {when}); this run replaces "
              "it when it finishes (--out DIR keeps both)", file=sys.stderr)


@dataclass(frozen=True)
class _ReplayPlan:
    """What one ``fdsched replay`` call runs, checked before any arm starts (:func:`_replay_plan`).

    ``path``: the trace file; ``engine``: the trace's engine shape with the command line's overrides;
    ``profiles``: the arms in order (with ``--dp-arms``: each rank's profile); ``dp_arms``: rank -> profile,
    or None without ``--dp-arms``; ``out``: the output directory (already made and marked; ``created``: by this run).
    """

    path: Path
    trace: object
    engine: dict
    profiles: list
    dp_arms: Optional[dict]
    out: Path
    created: bool = False


def cmd_replay(args) -> int:
    """``fdsched replay``: check the inputs, replay the trace once per arm with the host's messages sent
    to ``host.log``, then write ``report.json`` (and ``replay.png``) and print the table and verdicts.
    Exit code: EXIT_OK; EXIT_ERROR on bad input or an invariant violation; EXIT_NO_HOST without the host."""
    from fdsched.core.settings import SettingsError

    try:
        plan = _replay_plan(args)
    except (TraceError, SettingsError) as exc:
        print(error_line("replay", exc), file=sys.stderr)
        return EXIT_ERROR
    try:
        tqdm = _progress_module(args)
        runs, error, note = _run_arms_logged(args, plan, tqdm)
        if error is not None:
            return report_run_error(error)
        return _write_and_print_report(args, plan, runs, note)
    finally:  # every file now in the folder is this command's; a folder this run made and left empty goes
        settle_out_dir(plan.out, "fdsched replay", plan.created)


def _replay_plan(args) -> _ReplayPlan:
    """Everything the command line names, loaded and checked so a mistake fails now, not after the first
    arm (minutes later): the --dp-arms / --profile choice, the trace and its engine shape, the cost model,
    every profile, and the output directory. Raises TraceError or SettingsError."""
    from fdsched.replay.costmodel import resolve_cost_model

    profiles = args.profiles or list(DEFAULT_PROFILES)
    dp_arms = _parse_dp_arms(args)
    if dp_arms is not None:
        profiles = list(dp_arms.values())
    path = resolve_trace(args.trace)
    trace = load_trace(path)
    engine = trace.engine_with({
        "block_size": args.block_size,
        "num_gpu_blocks": args.num_gpu_blocks,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
    })
    check_engine(trace, engine)
    if args.cost_model is not None:
        resolve_cost_model(args.cost_model, "--cost-model")
    _check_profiles(args, profiles, dp_arms)
    out, created = check_out_dir(args.out, "fdsched replay")
    _say_if_replacing(out)
    return _ReplayPlan(path=path, trace=trace, engine=engine, profiles=profiles, dp_arms=dp_arms, out=out,
                       created=created)


def _parse_dp_arms(args) -> Optional[dict]:
    """``--dp-arms`` as rank -> profile (None when not given). Raises SettingsError when it is given with
    ``--profile`` or names no arm."""
    from fdsched.core.settings import SettingsError

    if args.dp_arms is None:
        return None
    from fdsched.core.settings import parse_dp_arms

    if args.profiles:
        raise SettingsError("--dp-arms: bad value with --profile; allowed: one of --dp-arms or --profile")
    dp_arms = parse_dp_arms(args.dp_arms, origin="--dp-arms")
    if len(dp_arms) < 1:
        raise SettingsError(f"--dp-arms: bad value {args.dp_arms!r}; allowed: RANK=PROFILE,... (one or more)")
    return dp_arms


def _check_profiles(args, profiles: list, dp_arms: Optional[dict]) -> None:
    """Load every arm's settings once, before anything runs (with --dp-arms an error names the rank).
    Raises SettingsError."""
    from fdsched.core.settings import SettingsError, load_settings, resolve_profile
    from fdsched.replay.costmodel import check_replay_settings

    environ = None if args.inherit_env else {}
    if dp_arms is None:
        refuse_duplicate_arms(profiles)
    for profile in profiles if dp_arms is None else ():
        check_replay_settings(load_settings(environ=environ, profile=profile))
    for rank, profile in (dp_arms or {}).items():
        resolve_profile(profile, f"--dp-arms, rank {rank}")
        try:
            check_replay_settings(load_settings(environ=environ, profile=profile))
        except SettingsError as exc:
            raise SettingsError(f"--dp-arms, rank {rank} (profile {profile}): {exc}") from None


def refuse_duplicate_arms(profiles: list, flag: str = "--profile") -> None:
    """Each arm once: the same profile twice (by name or by file), or two files whose arms would carry the same
    label in the report, is refused, naming ``flag``. Raises SettingsError."""
    from fdsched.core.settings import SettingsError, resolve_profile

    seen_files, seen_labels = {}, {}
    for value in profiles:
        label, path = resolve_profile(value, flag)
        key = Path(path).resolve()
        if key in seen_files:
            raise SettingsError(f"{flag}: bad value {value!r} (the same profile as {seen_files[key]!r}, given "
                                "twice); allowed: each profile once (an arm per profile)")
        if label in seen_labels:
            raise SettingsError(f"{flag}: bad value {value!r} (its arm would be labelled {label!r}, as "
                                f"{seen_labels[label]!r}'s); allowed: profiles with distinct names")
        seen_files[key], seen_labels[label] = value, value


def _progress_module(args):
    """tqdm's class for the progress bars, or None (``--no-progress``, or tqdm missing: said on stderr)."""
    from fdsched.replay.report import INSTALL_HINT

    if args.no_progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        print(f"fdsched replay: note: tqdm is not installed: no progress bar (install with {INSTALL_HINT})", file=sys.stderr)
        return None
    return tqdm


def _run_arms_logged(args, plan: _ReplayPlan, tqdm):
    """Run every arm with the host's import-time and run-time messages in ``<out>/host.log`` (started
    afresh) rather than between the bar and the table (``-v``: on the terminal). Returns ``(runs, error,
    note)``: the runs, or the error that stopped them (HostNotFound, SettingsError, InstallError,
    TraceError), and the note about the log to print with the report (or None)."""
    from fdsched.install.probe import HostNotFound
    from fdsched.install.installer import InstallError
    from fdsched.core.settings import SettingsError
    from fdsched.cmdline.quiet import host_output_to, log_note

    log_path = plan.out / "host.log"
    if log_path.is_file():
        log_path.unlink()
    runs, error = None, None
    with host_output_to(log_path, verbose=args.verbose) as host_log:
        try:
            _import_host()  # before the first bar: its time estimate is the replay's, not the host import's
            runs = _run_arms(args, plan, _progress_factory(tqdm, plan.profiles, host_log.terminal))
        except (HostNotFound, SettingsError, InstallError, TraceError) as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - anything else the host (or we) raised mid-run: one line
            error = run_failure(exc, log_path)
    return runs, error, log_note(host_log)


def run_failure(exc: BaseException, log_path) -> RuntimeError:
    """An unexpected error during a run as one line for the terminal; its traceback goes to the host's log (this
    runs inside ``host_output_to``, whose stderr is that log), so nothing is lost."""
    import traceback

    traceback.print_exc()
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    first = (str(exc).splitlines() or [""])[0][:160]
    return RuntimeError(f"the run failed: {type(exc).__name__}: {first}{where}; the traceback is in {log_path}")


def _progress_factory(tqdm, profiles: list, stream):
    """The runner's ``progress_factory``: one bar per arm, labelled "arm i/n <profile>" (None without tqdm)."""
    if tqdm is None:
        return None
    arms = iter(range(1, len(profiles) + 1))
    return lambda profile, total: ProgressBar(tqdm, f"arm {next(arms)}/{len(profiles)} {profile}", total, stream)


def _run_arms(args, plan: _ReplayPlan, progress_factory) -> list:
    """One ProfileRun per arm: per --dp-arms rank on its share of the trace, else per profile on the whole."""
    from fdsched.replay.runner import DEFAULT_MAX_STEPS, run_dp_arms, run_replay

    cost_overrides = {
        "model": args.cost_model,
        "step_fixed_ms": args.cost_fixed_ms,
        "per_prefill_token_ms": args.cost_prefill_token_ms,
        "per_decode_request_ms": args.cost_decode_request_ms,
    }
    max_steps = args.max_steps or DEFAULT_MAX_STEPS
    if plan.dp_arms is not None:
        return run_dp_arms(
            plan.trace, plan.dp_arms, plan.engine, args.dp_seed, cost_overrides, max_steps,
            progress_factory=progress_factory, inherit_env=args.inherit_env, check_every=args.check_every,
        )
    return run_replay(
        plan.trace, plan.profiles, plan.engine, cost_overrides, max_steps,
        progress_factory=progress_factory, inherit_env=args.inherit_env, check_every=args.check_every,
    )


def report_run_error(error: Exception, command: str = "replay") -> int:
    """Say why the arms of ``fdsched <command>`` did not run; EXIT_NO_HOST when the host is missing (with how to
    point at one), else EXIT_ERROR."""
    from fdsched.install.probe import HOW_TO_POINT, HostNotFound

    if isinstance(error, HostNotFound):
        message = str(error)
        if HOW_TO_POINT not in message:
            message += f"; {HOW_TO_POINT}"
        print(error_line(command, f"needs the FastDeploy host: {message}"), file=sys.stderr)
        return EXIT_NO_HOST
    print(error_line(command, error), file=sys.stderr)
    return EXIT_ERROR


def _trace_section(args, plan: _ReplayPlan, runs: list) -> dict:
    """The report's ``trace`` section; with --dp-arms it also says how the trace was split."""
    from fdsched.replay.report import trace_info

    info = trace_info(plan.trace, plan.path)
    if plan.dp_arms is not None:
        from fdsched.replay.trace import DP_SPLIT_RULE

        info["dp_arms"] = {
            "arms": {str(rank): profile for rank, profile in sorted(plan.dp_arms.items())},
            "seed": args.dp_seed,
            "split": DP_SPLIT_RULE,
            "requests_per_rank": {run.profile: len(run.requests) for run in runs},
        }
    return info


def _write_and_print_report(args, plan: _ReplayPlan, runs: list, note: Optional[str]) -> int:
    """Write ``report.json``, print the header, table and bounds, the host-log note, the plot (unless
    ``--no-plot``) and, last, the verdicts. EXIT_ERROR when any arm broke an invariant, else EXIT_OK."""
    from fdsched.replay.report import build_report, format_bounds, format_header, format_table, report_json
    from fdsched.replay.verdict import format_verdicts

    out = plan.out
    report = build_report(_trace_section(args, plan, runs), plan.engine, runs)
    (out / "report.json").write_text(report_json(report), encoding="utf-8")
    print(format_header(report))
    print(format_table(report))
    if format_bounds(report):
        print("\n" + format_bounds(report))
    print(f"\nreport: {out / 'report.json'}")
    if note:
        print(note)
    if not args.no_plot:
        _write_plot(report, out, plan.trace.name)
    elif (out / "replay.png").is_file():  # an earlier run's plot would sit beside this run's report
        (out / "replay.png").unlink()
    if format_verdicts(report):  # last: what the reader acts on
        print("\n" + format_verdicts(report))
    violations = sum(p["figures"]["invariant_violations"] for p in report["profiles"])
    if violations:
        print(f"fdsched replay: error: {violations} invariant violation(s); see 'violations' in {out / 'report.json'}",
              file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def _write_plot(report: dict, out: Path, trace_name: str) -> None:
    """``<out>/replay.png``, and its path on stdout; without matplotlib, say so on stderr instead."""
    from fdsched.replay.plot import write_plot
    from fdsched.replay.report import INSTALL_HINT

    try:
        write_plot(report, str(out / "replay.png"), title=f"trace {trace_name}")
    except ImportError:
        print(f"fdsched replay: note: matplotlib is not installed: no plot (install with {INSTALL_HINT})", file=sys.stderr)
    else:
        print(f"plot:   {out / 'replay.png'}")

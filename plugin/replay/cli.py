"""``fdsched replay``, ``eval``, ``check`` and ``trace``: the command-line side of the replay.

``fdsched replay`` replays a trace once per profile through the real host scheduler and writes a
table (terminal), ``report.json`` and ``replay.png``; ``fdsched eval`` runs the reference arms on the held-out
evaluation windows. Every command's options are declared here; the bodies of ``fdsched trace``'s subcommands
(generate, validate, list, import: no host needed) are :mod:`fdsched.replay.trace_cli`, ``fdsched check``'s
:mod:`fdsched.replay.check_cli`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fdsched.replay.trace import ENGINE_MAX, MAX_ARRIVAL_S, MAX_ARRIVAL_STEP, TraceError, check_engine, load_trace, resolve_trace, shipped_traces

from fdsched.core.common import EXIT_ERROR, EXIT_NO_HOST, EXIT_OK, bounded_float, bounded_int, error_line
from fdsched.cmdline.outdir import settle_out_dir

DEFAULT_TRACE = "pressure"
DEFAULT_PROFILES = ("baseline", "recommended")

__all__ = ["add_commands", "cmd_eval", "cmd_replay"]


# Upper bounds of the numeric options without one of their own (a typo of a dozen extra digits is refused in
# one line, before the host is imported).
MAX_MS = 3_600_000.0  # a step-cost coefficient: one hour
MAX_SECONDS = MAX_ARRIVAL_S  # --start, --duration: one year
MAX_RATE_SCALE = 1_000_000.0
MAX_COUNT = 10_000_000  # --requests, --limit
MAX_SEED = 2**32 - 1


_nonneg_float = bounded_float(0.0, MAX_MS)  # a step-cost coefficient, ms


def _preset_list() -> str:
    from fdsched.replay.costmodel import preset_names

    return ", ".join(preset_names()) or "none shipped"


def _pos_int(hi: int):
    return bounded_int(1, hi)


def _add_engine_shape_args(group) -> None:
    """The engine-shape options (replay: override the trace header; import: write it)."""
    for flag, what in (("--block-size", "tokens per KV block"), ("--num-gpu-blocks", "KV blocks in the pool"),
                       ("--max-num-seqs", "running requests at most"),
                       ("--max-num-batched-tokens", "tokens one step may prefill/decode at most"),
                       ("--max-model-len", "prompt + output tokens of one request at most")):
        hi = ENGINE_MAX[flag[2:].replace("-", "_")]
        group.add_argument(flag, type=bounded_int(1, hi), metavar="N", help=f"{what} (1..{hi})")


def add_commands(sub) -> None:
    """``fdsched replay``, ``eval``, ``check`` and ``trace``, each with its options."""
    from fdsched.replay.check_cli import add_check_command

    _add_replay(sub)
    _add_eval(sub)
    add_check_command(sub)
    _add_trace(sub)


def _add_replay(sub) -> None:
    replay = sub.add_parser(
        "replay",
        help="replay a trace through the real scheduler under several profiles and compare",
        description="Replay a JSONL trace through the host's real ResourceManagerV1 once per profile "
        "(no GPU: the replay plays worker and token processor) and report preemptions, recomputation, "
        "prefix-cache hits, KV blocks, modelled latency and invariant checks.",
    )
    replay.add_argument("--trace", default=DEFAULT_TRACE, help=f"shipped trace name or JSONL path (default {DEFAULT_TRACE}; "
                        f"shipped: {', '.join(shipped_traces()) or 'none'})")
    replay.add_argument("--profile", dest="profiles", action="extend", nargs="+", metavar="P",
                        help="profile names or YAML paths, one or more (--profile A B, or the flag repeated; "
                        "default: baseline recommended)")
    replay.add_argument("--dp-arms", metavar="RANK=PROFILE,...",
                        help="predict an online A/B (FDSCHED_PROFILE_BY_DP_RANK): split the trace across one scheduler "
                        "per data-parallel rank, each running its profile, e.g. 0=baseline,1=recommended; requests go "
                        "to ranks uniformly at random, as FastDeploy's Router does (not with --profile)")
    replay.add_argument("--dp-seed", type=bounded_int(0, MAX_SEED), default=0, help="seed of the --dp-arms split (default 0)")
    replay.add_argument("--out", default="replay-out", help="output directory (default ./replay-out)")
    cost = replay.add_argument_group("step-cost model (default: the profile's replay.cost_model and replay.* settings)")
    cost.add_argument("--cost-model", metavar="NAME|FILE",
                      help="the step-cost model of every arm: linear (the profile's replay.* coefficients), a shipped "
                      "preset calibrated from public profiling data (" + _preset_list() + "), or a preset YAML file "
                      "(docs/costmodel.md); the three options below replace its coefficients")
    cost.add_argument("--cost-fixed-ms", type=_nonneg_float, help="fixed cost of one engine step, ms")
    cost.add_argument("--cost-prefill-token-ms", type=_nonneg_float, help="cost per prefill token, ms")
    cost.add_argument("--cost-decode-request-ms", type=_nonneg_float, help="cost per decoding request, ms")
    _add_engine_shape_args(replay.add_argument_group("engine shape (default: the trace header's engine)"))
    replay.add_argument("--no-plot", action="store_true", help="do not write replay.png")
    replay.add_argument("--max-steps", type=_pos_int(MAX_ARRIVAL_STEP), default=None,
                        help="stop each profile after N steps (reported as not drained)")
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")
    replay.add_argument("-v", "--verbose", action="store_true",
                        help="show the host's own messages (import warnings, logs) here instead of in OUT/host.log")
    replay.add_argument("--inherit-env", action="store_true",
                        help="let FDSCHED_*/FD_* variables of this environment override each profile, as in "
                        "production (default: each arm is exactly its profile; the report lists what was applied)")
    replay.add_argument("--check-every", type=_pos_int(MAX_ARRIVAL_STEP), default=None, metavar="N",
                        help="check the block invariants every N steps and at the end (default: every step for "
                        "traces up to 2000 requests, else every 32)")
    replay.set_defaults(func=cmd_replay)


def _add_eval(sub) -> None:
    ev = sub.add_parser(
        "eval",
        help="run every reference arm on the held-out evaluation windows and print one table",
        description="Held-out evaluation (docs/evaluation.md): import each evaluation window of the split "
        "(fdsched/replay/windows.yaml) from its CSV, clients' max_tokens unset and true, plus the shipped real "
        "traces, replay every reference arm on each and print one table.",
    )
    ev.add_argument("--csv-dir", default=".", help="folder holding the source CSVs the split names (default .)")
    ev.add_argument("--out", default="eval-out", help="output directory: imported traces, one report.json per trace")
    ev.add_argument("--arms", nargs="+", metavar="P", help="profiles to run (default: the split's reference arms)")
    ev.add_argument("--windows", default=None, help="a windows YAML file (default: the shipped split)")
    ev.add_argument("--no-shipped", action="store_true", help="only the evaluation windows, not the shipped real traces")
    ev.add_argument("--list", action="store_true", help="print the split and exit (no host needed)")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.add_argument("-v", "--verbose", action="store_true",
                    help="show the host's own messages (import warnings, logs) here instead of in OUT/host.log")
    ev.add_argument("--cost-model", metavar="NAME|FILE",
                    help="the step-cost model of every arm (as fdsched replay --cost-model; default: each profile's)")
    ev.add_argument("--only", nargs="+", metavar="TRACE",
                    help="run only these traces of the split (e.g. eval-conv-unset azure-conv; --list names them)")
    ev.add_argument("--table-from", nargs="+", metavar="DIR",
                    help="run nothing: print the table of the report.json files earlier runs wrote to these --out "
                    "directories (a later directory's report of a trace wins)")
    ev.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ev.add_argument("--check-every", type=_pos_int(MAX_ARRIVAL_STEP), default=32, metavar="N",
                    help="check the block invariants every N steps and at the end (default 32; 1: every step)")
    ev.set_defaults(func=cmd_eval)


def _add_trace(sub) -> None:
    from fdsched.replay.trace_cli import cmd_trace_generate, cmd_trace_import, cmd_trace_list, cmd_trace_validate

    trace = sub.add_parser("trace", help="generate, validate or list replay traces (no host needed)")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    gen = trace_sub.add_parser("generate", help="write a synthetic trace")
    from fdsched.replay.generate import DEFAULT_REQUESTS, KINDS

    gen.add_argument("--kind", required=True, choices=sorted(KINDS), help="the workload shape")
    gen.add_argument("--requests", type=_pos_int(MAX_COUNT), default=None,
                     help="number of requests (default per kind: "
                     + ", ".join(f"{k} {v}" for k, v in DEFAULT_REQUESTS.items()) + ")")
    gen.add_argument("--seed", type=bounded_int(0, MAX_SEED), default=0, help="random seed (default 0): same seed, same trace")
    gen.add_argument("--out", default="-", help="output file (default: standard output)")
    gen.set_defaults(func=cmd_trace_generate)
    val = trace_sub.add_parser("validate", help="check a trace (and that its requests fit its engine)")
    val.add_argument("trace", help="shipped trace name or JSONL path")
    val.set_defaults(func=cmd_trace_validate)
    lst = trace_sub.add_parser("list", help="list the shipped traces")
    lst.set_defaults(func=cmd_trace_list)
    imp = trace_sub.add_parser(
        "import", help="turn a public request log (Azure LLM trace, BurstGPT, any CSV) into a time-based trace",
        description="Stream a CSV request log into a JSONL trace with arrivals in seconds (see examples/replay.md).",
    )
    imp.add_argument("csv", help="the CSV file")
    imp.add_argument("--format", dest="fmt", required=True, choices=("azure", "burstgpt", "generic"),
                     help="the CSV's layout: Azure LLM inference trace, BurstGPT, or generic (with --columns)")
    imp.add_argument("--columns", help="generic: time=COL,prompt=COL,output=COL")
    imp.add_argument("--out", required=True, help="the trace to write (JSONL)")
    imp.add_argument("--start", type=bounded_float(0.0, MAX_SECONDS), default=0.0, help="window start, seconds after the first row")
    imp.add_argument("--duration", type=bounded_float(0.0, MAX_SECONDS, lo_open=True), default=None, help="window length, seconds")
    imp.add_argument("--limit", type=_pos_int(MAX_COUNT), default=None, help="at most N requests")
    imp.add_argument("--rate-scale", type=bounded_float(0.0, MAX_RATE_SCALE, lo_open=True), default=1.0,
                     help="divide arrival times by this (2 = twice the request rate; default 1)")
    imp.add_argument("--sample", type=bounded_float(0.0, 1.0, lo_open=True), default=1.0, help="keep each row with this probability (seeded)")
    imp.add_argument("--seed", type=bounded_int(0, MAX_SEED), default=0, help="seed of --sample (default 0)")
    imp.add_argument("--max-tokens", default="unset", metavar="unset|true|N",
                     help="the clients' max_tokens: unset (null, the engine default), true (each request's true "
                     "output length) or one integer for all (default unset)")
    imp.add_argument("--description", default="", help="text for the trace header's description")
    _add_engine_shape_args(imp.add_argument_group("engine shape for the trace header (default: the replay defaults)"))
    imp.set_defaults(func=cmd_trace_import)


def cmd_eval(args) -> int:
    from fdsched.core.settings import SettingsError, load_settings

    from fdsched.replay.evaluate import format_eval_markdown, format_eval_table, load_results, load_windows, window_trace_name

    from fdsched.replay.costmodel import check_replay_settings, resolve_cost_model

    try:
        plan = load_windows(args.windows)
        arms = tuple(args.arms or plan.arms)
        _refuse_duplicate_arms(list(arms), "--arms")
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
        out, created = _check_out_dir(args.out, "fdsched eval")  # before the imports and arms run, not after
    except TraceError as exc:
        print(error_line("eval", exc), file=sys.stderr)
        return EXIT_ERROR
    try:
        return _run_eval(args, plan, arms, fmt)
    finally:
        settle_out_dir(out, "fdsched eval", created)


def _run_eval(args, plan, arms, fmt) -> int:
    """``fdsched eval`` after its checks: import, replay every arm, print the table (the output folder is claimed)."""
    from fdsched.install.probe import HOW_TO_POINT, HostNotFound
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
            progress_factory = lambda profile, total: _Bar(tqdm, profile, total, terminal)  # noqa: E731
        try:
            results = run_plan(plan, Path(args.csv_dir), Path(args.out), arms, include_shipped=not args.no_shipped,
                               progress_factory=progress_factory, log=lambda m: print(m, file=terminal, flush=True),
                               check_every=args.check_every, cost_overrides={"model": args.cost_model}, only=args.only)
        except (HostNotFound, SettingsError, InstallError, TraceError) as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - anything else the host (or we) raised mid-run: one line
            error = run_failure(exc, Path(args.out) / "host.log")
    note = log_note(host_log)
    if isinstance(error, HostNotFound):
        message = str(error)
        if HOW_TO_POINT not in message:
            message += f"; {HOW_TO_POINT}"
        print(error_line("eval", f"needs the FastDeploy host: {message}"), file=sys.stderr)
        return EXIT_NO_HOST
    if error is not None:
        print(error_line("eval", error), file=sys.stderr)
        return EXIT_ERROR
    if note:
        print(note)
    print(fmt(results))
    print(f"\nreports: {Path(args.out)}/<trace>.report.json")
    violations = sum(p["figures"]["invariant_violations"] for _, profiles in results for p in profiles)
    return EXIT_ERROR if violations else EXIT_OK


class _Bar:
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


def _check_out_dir(value: str, command: str) -> tuple:
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
            return _report_run_error(error)
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
    out, created = _check_out_dir(args.out, "fdsched replay")
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
        _refuse_duplicate_arms(profiles)
    for profile in profiles if dp_arms is None else ():
        check_replay_settings(load_settings(environ=environ, profile=profile))
    for rank, profile in (dp_arms or {}).items():
        resolve_profile(profile, f"--dp-arms, rank {rank}")
        try:
            check_replay_settings(load_settings(environ=environ, profile=profile))
        except SettingsError as exc:
            raise SettingsError(f"--dp-arms, rank {rank} (profile {profile}): {exc}") from None


def _refuse_duplicate_arms(profiles: list, flag: str = "--profile") -> None:
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
    return lambda profile, total: _Bar(tqdm, f"arm {next(arms)}/{len(profiles)} {profile}", total, stream)


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


def _report_run_error(error: Exception) -> int:
    """Say why the arms did not run; EXIT_NO_HOST when the host is missing (with how to point at one),
    else EXIT_ERROR."""
    from fdsched.install.probe import HOW_TO_POINT, HostNotFound

    if isinstance(error, HostNotFound):
        message = str(error)
        if HOW_TO_POINT not in message:
            message += f"; {HOW_TO_POINT}"
        print(error_line("replay", f"needs the FastDeploy host: {message}"), file=sys.stderr)
        return EXIT_NO_HOST
    print(error_line("replay", error), file=sys.stderr)
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

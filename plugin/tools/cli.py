"""fdsched: doctor, patches, profiles, explain, host setup, and the replay, benchmark and A/B report commands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from fdsched import __version__
from fdsched.core.profiles import profile_description
from fdsched.core.settings import (
    CHANGE_IDS, HOST_FIXES, PROFILE_ENV, UPSTREAM_CHANGE_IDS, SettingsError, load_settings, shipped_profiles,
)

from fdsched.core.common import EXIT_ERROR, EXIT_NO_HOST, EXIT_OK, bounded_int, error_line, plural, read_utf8
from fdsched.core.common import text_table as _table


def _print_arms(arm_settings, info) -> bool:
    """doctor's online A/B arms, one line per dp rank; False when deciding them failed (the error is printed)."""
    from fdsched.install.installer import InstallError, decide_arms

    print("\nonline A/B arms (FDSCHED_PROFILE_BY_DP_RANK; other ranks: the profile above):")
    ok = True
    try:
        arms = decide_arms(arm_settings, info) if info is not None else {}
    except InstallError as exc:
        print(error_line("doctor", exc), file=sys.stderr)
        ok, arms = False, {}
    for rank, arm_s in sorted(arm_settings.items()):
        line = arms[rank].line() if rank in arms else "-"
        print(f"  dp rank {rank}: {arm_s.profile} ({arm_s.profile_path}): {line}")
    return ok


def _print_hook_plugins() -> bool:
    """doctor's third-party hook plugins line; False when one is broken (the error is printed)."""
    try:
        from fdsched.core.hooks import DISABLE_ENV, external_plugin_states

        rows, blocked_all = external_plugin_states()
        shown = ", ".join(f"{name} ({state})" for name, state in rows) or "none installed"
        if blocked_all and not rows:
            shown += f"; any would be blocked by {DISABLE_ENV}"
        print(f"\nthird-party hook plugins (entry-point group fdsched.hooks): {shown}")
    except Exception as exc:  # a broken third-party plugin is an error worth showing, not a crash
        print(error_line("doctor", f"third-party hook plugins: {type(exc).__name__}: {exc}"), file=sys.stderr)
        return False
    return True


def cmd_doctor(args) -> int:
    from fdsched.patches import CATALOGUE

    from fdsched.install.installer import InstallError, current, decide
    from fdsched.core.settings import load_arm_settings

    print(f"fdsched {__version__}")
    status = EXIT_OK
    try:
        settings = load_settings()
        arm_settings = load_arm_settings()
    except SettingsError as exc:
        _print_preflight(args, None)
        print(error_line("doctor", f"settings: {exc}"), file=sys.stderr)
        return EXIT_ERROR
    print(f"profile: {settings.profile or 'default'}" + (f" ({settings.profile_path})" if settings.profile_path else ""))

    info, not_found, note = _probe_quietly(args)
    if not_found is None:
        print(f"host: {info.label}")
        print(f"host support: {info.support}")
        print(f"host status enum: {'RUNNING_PREFILL/RUNNING_DECODE' if info.split_status else 'single RUNNING'}")
    else:
        print(error_line("doctor", f"host not found: {not_found}"), file=sys.stderr)
        status = EXIT_NO_HOST
    findings = _print_preflight(args, info.location if info is not None else None)

    decisions = {}
    if info is not None:
        try:
            decisions = decide(settings, info)
        except InstallError as exc:
            print(error_line("doctor", exc), file=sys.stderr)
            status = EXIT_ERROR
    rows = []
    for spec in CATALOGUE:
        has = "-" if info is None else ("yes" if info.has.get(spec.change_id) else "no")
        would = decisions[spec.change_id].detail if spec.change_id in decisions else "-"
        rows.append((spec.change_id, _upstream_text(spec, "{prs} ({state})"), has, settings.change_mode(spec.change_id),
                     would))
    print()
    print(_table(rows, ("change", "upstream PR", "host has it", "switch", "would be")))
    if arm_settings and not _print_arms(arm_settings, info):
        status = EXIT_ERROR
    installed = current()
    if installed is not None:
        print("\ninstalled in this process: " + installed.summary())
    print("\n" + _adaptive_report(settings, decisions.get("ratio_reserve")))
    if not _print_hook_plugins():
        status = EXIT_ERROR
    print("\neffective settings:")
    print(_table([(k, env, _show(v), src) for k, env, v, src in settings.describe()], ("key", "variable", "value", "source")))
    if note:
        print("\n" + note)
    if findings and status == EXIT_OK:  # an error above already said why doctor fails: one error line
        print(error_line("doctor", f"{plural(findings, 'pre-flight finding')} to fix (the lines marked !! above)"),
              file=sys.stderr)
    return doctor_status(status, findings)


def doctor_status(status: int, findings: int) -> int:
    """doctor's exit code: 2 (``EXIT_NO_HOST``) when no host was found; else 1 (``EXIT_ERROR``) on a settings or
    install error or on any pre-flight finding (a line marked ``!!``: the engine would not do what the settings
    say until the operator fixes it); else 0. doctor has no warnings: every finding counts."""
    if status == EXIT_NO_HOST:
        return EXIT_NO_HOST
    return EXIT_ERROR if status != EXIT_OK or findings else EXIT_OK


def _probe_quietly(args) -> tuple:
    """(info or None, HostNotFound or None, the note about the host's log): the probe, its chatter in a log file."""
    from fdsched.install.probe import HostNotFound, probe
    from fdsched.tools.hostsetup import cache_dir
    from fdsched.cmdline.quiet import host_output_to, log_note

    log_path = cache_dir() / "logs" / "doctor-host.log"
    if log_path.is_file():
        log_path.unlink()
    info = not_found = None
    with host_output_to(log_path, verbose=args.verbose) as host_log:  # the host's import chatter: into the log
        try:
            info = probe()
        except HostNotFound as exc:
            not_found = exc
    return info, not_found, log_note(host_log)


def _print_preflight(args, location) -> int:
    """The environment's mistakes that stop the plugin doing what the settings say, one line each with the fix;
    returns how many it printed (the lines marked ``!!``)."""
    from fdsched.tools.preflight import environment_lines, host_variables, loader_when_unset

    print("\npre-flight (this environment, as the engine would see it):")
    findings = 0
    for ok, line in environment_lines(when_unset=loader_when_unset(location), ranks=args.dp,
                                      read_by_host=host_variables(location)):
        print(f"  {'ok' if ok else '!!'}  {line}")
        findings += not ok
    return findings


def _adaptive_report(settings, ratio_decision) -> str:
    """The reservation estimator: the live state of every scheduler in this process that runs the adaptive
    one, else what the settings would use."""
    estimator = settings["tunables.reserve_estimator"]
    from fdsched.core.adaptive import live_states

    live = live_states()
    if live:
        lines = [f"reservation estimator: adaptive, {len(live)} scheduler(s) in this process"]
        for i, state in enumerate(live):
            lines.append(f"  scheduler {i}: " + _adaptive_state_line(state))
        return "\n".join(lines)
    if estimator == "ratio":
        return "reservation estimator: ratio (upstream's new_token_ratio formula)"
    applied = ratio_decision is None or ratio_decision.impl == "plugin"
    where = "" if applied else f" (but ratio_reserve is {ratio_decision.detail}: the estimator would not run)"
    return (
        f"reservation estimator: adaptive{where}; no scheduler in this process (it runs in the engine's). It would "
        f"learn from the last {settings['tunables.adaptive_window']} finished requests, answer for a kind (bounded / "
        f"unbounded max_tokens) after {settings['tunables.adaptive_min_samples']} of them, with a margin of "
        f"k={settings['tunables.adaptive_margin_k']} standard deviations; until then bounded requests use upstream's "
        "ratio formula and unbounded ones the legacy fixed-block reservation. Live state: the "
        "fastdeploy:fdsched_adaptive_* metrics."
    )


def _adaptive_state_line(state: dict) -> str:
    parts = []
    for label, key in (("unbounded", "absolute_tokens"), ("bounded", "relative_to_max_tokens")):
        kind = state[key]
        mean = "-" if kind["mean"] is None else f"{kind['mean']:g}"
        phase = "learned" if kind["learned"] else "warm-up (fallback)"
        parts.append(f"{label}: {plural(kind['samples'], 'sample')}, mean {mean}, {phase}")
    return "; ".join(parts) + f"; k={state['k']:g}; preemptions seen {state['preemptions_seen']}"


def _show(value) -> str:
    if value is None:
        return "init"
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def cmd_patches(args) -> int:
    """The catalogue, as the code uses it: for each change what it replaces, why, how, which hosts need it,
    when it can be deleted and what it relies on in the host's control flow. Needs no host."""
    from fdsched.patches import CATALOGUE, TARGETS

    specs = [spec for spec in CATALOGUE if args.change in (None, spec.change_id)]
    if not specs:
        print(
            error_line("patches", f"bad value {args.change!r} for CHANGE; allowed: {', '.join(CHANGE_IDS)}"),
            file=sys.stderr,
        )
        return EXIT_ERROR
    for number, spec in enumerate(specs):
        if number:
            print()
        print(f"{spec.change_id}: {spec.title}")
        rows = [
            ("upstream", _upstream_text(spec, "PR {prs} ({state})")),
            ("switch", f"{spec.switch} (profile key changes.{spec.change_id}) = auto | on | off"),
            ("why", spec.why),
            ("how", spec.how),
            ("hosts needing it", spec.hosts_needing),
            ("delete when", spec.delete_when),
        ]
        rows += [("replaces" if i == 0 else "", f"{TARGETS[name.split('.')[0]]}.{name.split('.', 1)[1]}")
                 for i, name in enumerate(spec.replaces)]
        rows += [("relies on" if i == 0 else "", f"{r.name} ({'/'.join(r.when)}): {r.text}")
                 for i, r in enumerate(spec.relies_on)] or [("relies on", "nothing beyond the methods it replaces")]
        for label, text in rows:
            print(f"  {label:<17} {text}")
    print("\nwhether this host has each change and what the settings would do: fdsched doctor")
    return EXIT_OK


def _upstream_text(spec, form: str) -> str:
    """The change's upstream PRs in ``form``, or what a host fix is (no upstream PR)."""
    if not spec.upstream_prs:
        return "none: host fix"
    return form.format(prs="/".join(str(p) for p in spec.upstream_prs), state=spec.upstream_state)


def _changes_text(settings) -> str:
    """The upstream changes' switches in a few words; a host fix only where it is not ``auto`` (its default in
    every shipped profile)."""
    modes = {cid: settings.change_mode(cid) for cid in UPSTREAM_CHANGE_IDS}
    fixes = [f"{cid}={settings.change_mode(cid)}" for cid in HOST_FIXES if settings.change_mode(cid) != "auto"]
    if len(set(modes.values())) == 1:
        return ", ".join([f"all {next(iter(modes.values()))}", *fixes])
    common = max(set(modes.values()), key=list(modes.values()).count)
    odd = [f"{cid}={mode}" for cid, mode in modes.items() if mode != common]
    return ", ".join(odd + fixes) + f", rest {common}"


def _differs_from(settings, reference) -> str:
    """The non-switch settings whose value differs from the reference profile's, as key=value."""
    diffs = [
        f"{key}={_show(value)}"
        for key, value in settings.values.items()
        if not key.startswith("changes.") and value != reference.values.get(key)
    ]
    return ", ".join(diffs) or "-"


def cmd_profiles(args) -> int:
    """List the shipped profiles with what each sets differently from baseline; show one (a name or a YAML path,
    which is checked as the engine would load it)."""
    profiles = shipped_profiles()
    reference = load_settings(environ={}, profile="baseline") if "baseline" in profiles else None
    if args.name is not None:
        from fdsched.core.settings import resolve_profile

        name, path = resolve_profile(args.name, "argument NAME")  # SettingsError: one line, from main()
        settings = load_settings(environ={}, profile=args.name)
        print(f"# {path}")
        print(read_utf8(path, "profile", "a YAML mapping", SettingsError), end="")
        if reference is not None:
            print(f"\n# checked: ok; changes: {_changes_text(settings)}; other settings unlike baseline's: "
                  f"{_differs_from(settings, reference)}")
        return EXIT_OK
    rows = []
    for name, path in profiles.items():
        settings = load_settings(environ={}, profile=name)
        beyond = "(the reference)" if name == "baseline" or reference is None else _differs_from(settings, reference)
        rows.append((name, _changes_text(settings), beyond))
    print(_table(rows, ("profile", "changes", "other settings unlike baseline's")))
    print(f"\nselect one with {PROFILE_ENV}=<name or path>; show one with: fdsched profiles <name>; "
          "check your own: fdsched profiles /path/to/profile.yaml")
    for name, path in profiles.items():
        print(f"\n{name}: {profile_description(path)}")
    return EXIT_OK


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a refused command line answered in one line (``fdsched <command>: error: ...``, as
    every command's own errors), not the whole usage first; exit code 2 as argparse's. Sub-commands' parsers
    are of this class too (argparse builds them with the parent's class)."""

    def error(self, message: str, prog: Optional[str] = None):
        prog = prog or self.prog
        if message.endswith("expected one argument"):  # e.g. --dp-arms -1=baseline: argparse took the value for a flag
            message += " (a value that starts with '-' goes as --option=VALUE)"
        self.exit(2, f"{prog}: error: {message} (usage: {prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # name the command they were given to, as its own refusals do
            command = command_name(parsed) if getattr(parsed, "command", None) else ""
            self.error(f"unrecognized arguments: {' '.join(extras)}", f"{self.prog} {command}".strip())
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="fdsched", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fdsched {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="host, what it already has, what the settings would apply",
                            description="The host, what it already has, what the settings would apply, and the "
                            "pre-flight: the environment as the engine would see it. Exit status: 0 all fine; 1 a "
                            "settings or install error, or a pre-flight finding to fix (a line marked !!, e.g. "
                            "FD_PLUGINS unset or not naming fdsched); 2 no FastDeploy host found.")
    doctor.add_argument("-v", "--verbose", action="store_true",
                        help="show the host's own import messages here instead of in a log file")
    doctor.add_argument("--dp", type=bounded_int(1, 4096), metavar="N",
                        help="the engine's data-parallel ranks: check FDSCHED_PROFILE_BY_DP_RANK against them")
    doctor.set_defaults(func=cmd_doctor)

    patches = sub.add_parser("patches", help="the catalogue: what each change replaces, why, when to delete it, "
                             "what it relies on")
    patches.add_argument("change", nargs="?", help="one change id (default: all)")
    patches.set_defaults(func=cmd_patches)

    profiles = sub.add_parser("profiles", help="list the shipped profiles and what each sets unlike baseline, or "
                              "show one (a name) or check your own (a YAML path)")
    profiles.add_argument("name", nargs="?", help="a shipped profile name, or the path of a YAML profile to check")
    profiles.set_defaults(func=cmd_profiles)

    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub) -> None:
    """Commands that live in their own modules (replay, traces, benchmarks)."""
    from fdsched.tools import abreport
    from fdsched.tools import bench
    from fdsched.tools import benchsweep
    from fdsched.tools import explain
    from fdsched.tools import hostsetup
    from fdsched.tools import instructions

    bench_commands = bench.add_commands(sub)
    instructions.add_command(bench_commands)
    benchsweep.add_command(bench_commands)
    hostsetup.add_commands(sub)
    abreport.add_command(sub)
    explain.add_command(sub)
    from fdsched.serve import cli as serve_cli  # fdsched serve

    serve_cli.add_command(sub)
    from fdsched.serve import load_cli  # fdsched load: a trace against running servers

    load_cli.add_command(sub)
    load_cli.add_compare_command(sub)
    from fdsched.serve import pd_bench  # fdsched serve-pd-bench: a served A/B of one PD role

    pd_bench.add_command(sub)
    try:
        from fdsched.replay import cli as replay_cli
    except ImportError:
        return
    replay_cli.add_commands(sub)


# commands that import the host in this process: each gets its own log and metrics directories, removed when it
# exits (the stacks serve starts get theirs from the launcher; load imports nothing of the host)
HOST_IMPORTING = frozenset({"doctor", "explain", "host", "bench", "patches", "serve", "serve-pd-bench",
                            "load-vs-replay"})


def command_name(args) -> str:
    """The command as typed, for error lines: ``replay``, ``trace import``, ``host use``."""
    words = [args.command]
    for key, value in sorted(vars(args).items()):
        if key.endswith("_command") and key != "command" and isinstance(value, str):
            words.append(value)
    if isinstance(getattr(args, "bench", None), str):
        words.append(args.bench)
    return " ".join(words)


def main(argv: Optional[list] = None) -> int:
    from fdsched.install.probe import HostNotFound
    from fdsched.tools.hostsuites import HostSuiteError
    from fdsched.tools.instructions import InstructionsError
    from fdsched.install.installer import InstallError

    args = build_parser().parse_args(argv)
    command = command_name(args)
    if args.command in HOST_IMPORTING:
        # The host writes its logs to ./log and a new /tmp/prom_main_* per import unless told where: give this
        # process directories of its own that go when it exits (the replay and eval do the same).
        from fdsched.replay.engine import prepare_host_environment

        prepare_host_environment()
    try:
        return args.func(args)
    except (SettingsError, InstallError) as exc:
        print(error_line(command, exc), file=sys.stderr)
        return EXIT_ERROR
    except HostNotFound as exc:
        print(error_line(command, exc), file=sys.stderr)
        return EXIT_NO_HOST
    except (HostSuiteError, InstructionsError) as exc:
        print(error_line(command, exc), file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # `fdsched ... | head`: the reader left; no traceback for that
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - what a host nobody tested raises: one line, the traceback kept
        print(error_line(command, unexpected(exc)), file=sys.stderr)
        return EXIT_ERROR


def unexpected(exc: BaseException) -> str:
    """An error no command expected (a host's code we have never seen, or a bug of ours) in one line; its traceback
    is written to ``$FDSCHED_HOME/logs/last-error.log`` (else it would be lost)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    first = (str(exc).splitlines() or [""])[0][:160]
    text = f"{type(exc).__name__}: {first}{where}"
    try:
        from fdsched.install.hosts import cache_dir

        log = cache_dir() / "logs" / "last-error.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("".join(traceback.format_exception(exc)), encoding="utf-8")
        return f"{text}; the traceback is in {log}"
    except OSError:
        return text


if __name__ == "__main__":
    sys.exit(main())

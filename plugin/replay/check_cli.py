"""``fdsched check``: the command line of the defect search (:mod:`fdsched.replay.check`)."""

from __future__ import annotations

import sys
from pathlib import Path

from fdsched.core.common import EXIT_ERROR, EXIT_OK

__all__ = ["add_check_command", "cmd_check", "COMMAND"]

COMMAND = "fdsched check"


def add_check_command(sub) -> None:
    from fdsched.core.settings import shipped_profiles

    check = sub.add_parser(
        "check",
        help="search the host's real scheduler for stalls, block-accounting errors and lost requests",
        description="Replay random short traces on random small engines (pool, seats, token budget, prefix "
        "caching, PD prefill role) through FastDeploy's own classes alone (arm host) and under each shipped "
        "profile, checking the block invariants after every step, progress, and every request's output. Each "
        "failure is shrunk to a small trace, written to --out and printed as one line.",
    )
    check.add_argument("--seed", type=int, default=0, help="seed of the drawn cases (default 0)")
    check.add_argument("--budget", type=float, default=60.0, metavar="SECONDS",
                       help="stop drawing new cases after this many seconds (default 60)")
    check.add_argument("--cases", type=int, default=0, metavar="N", help="stop after N cases (default: the budget)")
    check.add_argument("--arms", default=None, metavar="A,B",
                       help="comma-separated arms: host (FastDeploy alone) and profile names (default: host and "
                       f"every shipped profile: {', '.join(sorted(shipped_profiles()))})")
    check.add_argument("--out", default="fdsched-check", help="folder for the shrunk traces (default fdsched-check)")
    check.add_argument("-v", "--verbose", action="store_true", help="show the host's own messages here")
    check.set_defaults(func=cmd_check)


def _arms(value) -> list:
    from fdsched.core.settings import SettingsError, shipped_profiles
    from fdsched.replay.check import HOST_ARM

    known = sorted(shipped_profiles())
    if value is None:
        return [HOST_ARM, *known]
    arms = [a.strip() for a in value.split(",") if a.strip()]
    bad = [a for a in arms if a != HOST_ARM and a not in known]
    if not arms or bad:
        raise SettingsError(f"--arms: bad value {value!r}; allowed: a comma-separated list of {HOST_ARM} and "
                            f"shipped profiles ({', '.join(known)})")
    return arms


def _out_dir(value: str) -> Path:
    """The output folder (:func:`fdsched.cmdline.outdir.check_out_dir`): new, empty, or one an earlier check wrote."""
    from fdsched.core.settings import SettingsError
    from fdsched.cmdline.outdir import OutputError, check_out_dir

    try:
        return check_out_dir(value, COMMAND)
    except OutputError as exc:
        raise SettingsError(str(exc)) from None


def _replay_problem() -> str:
    """Why the replay cannot drive this host's scheduler at all (one request on the smallest engine, FastDeploy
    alone), or ""."""
    from fdsched.replay.check import HOST_ARM, Case, run_case
    from fdsched.replay.trace import TraceRequest

    engine = {"block_size": 4, "max_model_len": 64, "num_gpu_blocks": 18, "max_num_seqs": 2,
              "max_num_batched_tokens": 16, "enable_prefix_caching": True, "splitwise_role": "mixed",
              "enc_dec_block_num": 2}
    found = run_case(Case(engine, (TraceRequest(id="probe", arrival=0, prompt_len=4, output_len=2, line=1),)), HOST_ARM)
    return found[1] if found and found[0] == "raises" else ""


def _refused_profiles(arms) -> dict:
    """profile -> why this host refuses it (the plugin would not load it in an engine either)."""
    from fdsched.core.settings import SettingsError, load_settings
    from fdsched.install.installer import InstallError, install, uninstall
    from fdsched.replay.check import HOST_ARM

    refused = {}
    for arm in arms:
        if arm == HOST_ARM:
            continue
        try:
            install(load_settings(environ={}, profile=arm))
        except (InstallError, SettingsError) as exc:
            refused[arm] = str(exc).splitlines()[0]
        finally:
            uninstall()
    return refused


def cmd_check(args) -> int:
    """Exit code: EXIT_OK when no shipped profile fails a case (FastDeploy alone may: its findings are what the host
    fixes are for); EXIT_ERROR otherwise (the lines say which)."""
    from fdsched.core.settings import SettingsError
    from fdsched.replay.engine import prepare_host_environment
    from fdsched.cmdline.outdir import OutputError, claim_out_dir, settle_out_dir

    if args.budget <= 0 or args.cases < 0:
        raise SettingsError(f"--budget/--cases: bad value {args.budget!r}/{args.cases!r}; allowed: a budget > 0 "
                            "seconds and cases >= 0")
    arms = _arms(args.arms)
    _out_dir(args.out)
    prepare_host_environment()
    try:
        out, created = claim_out_dir(args.out, COMMAND)
    except OutputError as exc:
        raise SettingsError(str(exc)) from None
    for stale in out.glob("finding-*.jsonl"):
        stale.unlink()  # an earlier check's findings (the marker says this folder and they are check's)
    try:
        cannot, refused, result = _run(args, arms, out)
    finally:
        settle_out_dir(out, COMMAND, created)
    if cannot:
        raise SettingsError(f"this FastDeploy: the replay cannot drive its scheduler ({cannot}); allowed: a FastDeploy "
                            "whose scheduler the replay builds (fdsched replay shows the same)")
    return _report(args, arms, refused, result, out)


def _run(args, arms, out):
    """(why the replay cannot drive this host or "", refused profiles, the search's result) with the host's output
    in ``out/host.log``."""
    from fdsched.install.probe import find_host
    from fdsched.replay.check import search
    from fdsched.cmdline.quiet import host_output_to

    result = None
    with host_output_to(out / "host.log", verbose=args.verbose):
        find_host()  # the host's import chatter goes to the log too
        cannot = _replay_problem()
        refused = {} if cannot else _refused_profiles(arms)
        if not cannot:
            arms = [a for a in arms if a not in refused]
            result = search(arms, args.seed, args.budget, out=out, max_cases=args.cases, report=lambda line: None)
    return cannot, refused, result


def _report(args, arms, refused, result, out) -> int:
    from fdsched.replay.check import HOST_ARM

    arms = [a for a in arms if a not in refused]
    for profile, why in refused.items():
        print(f"fdsched check: profile {profile} is refused on this host, not searched: {why}")
    findings = result["findings"]
    for finding in findings:
        print(finding.line())
    under_profiles = [f for f in findings if f.arm != HOST_ARM]
    print(f"fdsched check: {result['cases']} cases x {len(arms)} arms in {result['seconds']} s (seed {args.seed}): "
          f"{len(findings)} finding(s), {len(under_profiles)} under a shipped profile; traces in {out}")
    return EXIT_ERROR if under_profiles else EXIT_OK



"""``fdsched serve --prefill N --decode M [--role-profiles prefill=P,decode=D]``: the command around
:class:`fdsched.serve.pd.PdServedEngine` (flags, checks before anything is spawned, the serve loop)."""

from __future__ import annotations

import sys

from fdsched.core.common import EXIT_ERROR

__all__ = ["add_pd_arguments", "is_pd", "check_pd_args", "serve_pd"]


def add_pd_arguments(p) -> None:
    p.add_argument("--prefill", type=int, help="PD disaggregation: this many prefill instances behind FastDeploy's "
                                               "Router in splitwise mode (with --decode; default 1 when only "
                                               "--decode is given)")
    p.add_argument("--decode", type=int, help="PD disaggregation: this many decode instances (default 1 when only "
                                              "--prefill is given)")
    p.add_argument("--decode-num-gpu-blocks", type=int, help="with --prefill/--decode: the decode instances' KV blocks "
                                                              "(default: --num-gpu-blocks)")
    p.add_argument("--role-profiles", help="with --prefill/--decode: the profile per role, ROLE=PROFILE items "
                                           "(prefill=pd_prefill_cache,decode=baseline); a role not named runs "
                                           "--profile")


def is_pd(args) -> bool:
    return getattr(args, "prefill", None) is not None or getattr(args, "decode", None) is not None


def check_pd_args(args, cli) -> tuple:
    """(problems, config): every problem of the PD flags, one line each, before anything is spawned. ``cli`` is
    :mod:`fdsched.serve.cli` (handed in: it imports this module)."""
    from fdsched.serve.pd import PdConfig, pd_config_problems

    SHAPE_KEYS, _shape_from_args = cli.SHAPE_KEYS, cli._shape_from_args  # noqa: N806

    problems = []
    for flag in ("trace", "time_schedule", "idle_rpc", "out"):
        value = getattr(args, flag, None)
        if value:
            problems.append(f"--{flag.replace('_', '-')} with --prefill/--decode: allowed: without it (the PD stack "
                            "serves until Ctrl-C)")
    for key in SHAPE_KEYS:
        value = getattr(args, key)
        if value is not None and value < 1:
            problems.append(f"--{key.replace('_', '-')} {value}: allowed: an integer >= 1")
    config = PdConfig(profile=args.profile, dp=args.dp, arms=args.arms, port=args.port, host=args.host,
                      num_cpu_blocks=args.num_cpu_blocks, health_timeout=args.health_timeout,
                      prefill=1 if args.prefill is None else args.prefill,
                      decode=1 if args.decode is None else args.decode, role_profiles=args.role_profiles,
                      decode_num_gpu_blocks=args.decode_num_gpu_blocks,
                      **_shape_from_args(args))
    problems += [p for p in pd_config_problems(config) if p not in problems]
    return problems, config


def serve_pd(args, signals, cli) -> int:
    """Start the PD stack, print where it listens, serve until Ctrl-C (drain), stop. ``cli`` is
    :mod:`fdsched.serve.cli`, whose helpers this shares."""
    _check_host_quietly, _check_shapes_quietly = cli._check_host_quietly, cli._check_shapes_quietly  # noqa: N806
    _finish, _say, _serve_until_stopped = cli._finish, cli._say, cli._serve_until_stopped  # noqa: N806
    from fdsched.serve.config import LOOPBACK, ServeError
    from fdsched.serve.pd import PdServedEngine
    from fdsched.serve.pd_checks import host_pd_problems

    engine = None
    try:
        problems, config = check_pd_args(args, cli)
        if not problems:
            _check_host_quietly()
            problems = _check_shapes_quietly([config]) or _host_pd_quietly(config, host_pd_problems)
        if problems:
            for problem in problems:
                print(f"fdsched serve: {problem}", file=sys.stderr)
            return EXIT_ERROR
        signals.install()
        engine = PdServedEngine(config, progress=_say)
        with engine:
            where = "loopback only; --host to choose otherwise" if args.host == LOOPBACK else "--host"
            _say(f"up on {args.host} ({where}); logs in {engine.log_dir}")
            _say("profiles: " + ", ".join(f"{i['name']} {i['profile'] or 'default'}" for i in engine.instances))
            for inst in engine.instances:
                print(f"  {inst['name']}: {inst['url']}  metrics {inst['metrics']}")
            print(f"  router: {engine.router_url}/v1/completions  (every request goes to one prefill and one decode "
                  "instance)")
            code = _serve_until_stopped(engine, args, signals)
        _finish(engine, args, failed=bool(code))
        return code
    except (KeyboardInterrupt, ServeError) as exc:
        return cli._ended(engine, args, exc)


def _host_pd_quietly(config, check) -> list:
    from fdsched.install.hosts import cache_dir
    from fdsched.cmdline.quiet import host_output_to

    with host_output_to(cache_dir() / "logs" / "serve-host-import.log"):
        return check(config)

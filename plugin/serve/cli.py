"""``fdsched serve``: the command around :class:`fdsched.serve.launcher.ServedEngine` (start the stack, send a trace
through the load generator, print the per-arm report). The launcher itself only starts and stops the stack.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from fdsched.core.common import EXIT_ERROR, EXIT_NO_HOST
from fdsched.serve.load_cli import out_dir_problems, owned_out_dir
from fdsched.serve.preflight import (
    host_shape_problems, profiles_line, rank_arm_problems, rank_profiles, sequential_arms, sequential_arms_problems,
    trace_only_problems,
)
from fdsched.serve.config import (
    LOOPBACK, PORT_RANGE, PORTS_PER_RANK, EngineConfig, HostMissing, ServeError, check_config, check_host_modules,
)
from fdsched.serve.launcher import ServedEngine, format_schedule_times, receiver_rpc_rate
from fdsched.serve.ports import port_in_use

__all__ = ["add_command", "cmd_serve"]


def add_command(sub) -> None:
    p = sub.add_parser("serve", help="FastDeploy's real OpenAI server on CPU with the plugin and a simulated worker")
    p.add_argument("--profile", help="FDSCHED_PROFILE for every rank")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (multi_api_server + Router)")
    p.add_argument("--arms", help="with --trace: A,B,... runs one stack per arm in turn on the same requests (an A/B "
                                  "on identical traffic); RANK=A,RANK=B (with --dp >= 2): one arm per data-parallel rank "
                                  "behind the Router (FDSCHED_PROFILE_BY_DP_RANK; each rank gets a different share)")
    p.add_argument("--host", default=LOOPBACK, help=f"address the api_server, metrics and router ports listen on "
                                                    f"(default {LOOPBACK}, this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, help=f"first port of the stack (default: free ports in {PORT_RANGE[0]}-"
                                            f"{PORT_RANGE[1]})")
    p.add_argument("--num-gpu-blocks", type=int, help="KV blocks per rank (default: the trace header's, else the simulated profile run's)")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default: the trace header's, else FastDeploy's)")
    p.add_argument("--max-num-seqs", type=int, help="running requests per rank at most (default: the trace header's, else FastDeploy's)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the trace header's, else the tiny model's)")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens per step at most (default: the trace header's, else FastDeploy's)")
    p.add_argument("--num-cpu-blocks", type=int, default=0,
                   help="CPU swap tier per rank in KV blocks (passed to FastDeploy as the equivalent --swap-space); "
                        "> 0 starts the simulated cache transfer manager (seam S10); default 0")
    p.add_argument("--idle-rpc", type=float, metavar="SECONDS",
                   help="with --num-cpu-blocks: measure the transfer-done receiver's RPCs/s over SECONDS of idle, "
                        "print it and shut down")
    p.add_argument("--time-schedule", action="store_true",
                   help="with --trace: time every schedule() call in each rank's engine (harness seam H3) and print "
                        "the scheduler thread's CPU time per call that scheduled something")
    p.add_argument("--health-timeout", type=float, default=240.0, help="seconds to wait for each stage")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT,
                   help="on Ctrl-C / SIGTERM: stop admitting, let requests in flight finish for up to this many "
                        f"seconds, then end the rest with an error event (default {DRAIN_TIMEOUT:g})")
    p.add_argument("--keep-logs", action="store_true", help="keep the run directory (logs) after a clean exit; it is "
                                                            "always kept, and named, after a failure")
    p.add_argument("--no-repeat-reference", dest="repeat_reference", action="store_false",
                   help="with --arms A,B,...: do not run the first arm again after the others (by default it runs "
                        "twice, and a change no larger than how far its two runs differ is not read as an effect)")
    p.add_argument("--trace", help="a trace name or file: send it, report, shut down")
    p.add_argument("--exact-max-tokens", action="store_true",
                   help="with --trace: send every request with max_tokens = its true output length (clients that "
                        "bound their lengths exactly); by default max_tokens is sent as the trace has it (omitted "
                        "where it is null, so the engine's default applies) and each answer still ends at its true "
                        "length")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every arrival time by this (0.5: twice as fast); default 1")
    p.add_argument("--out", help="report directory (with --trace; default serve-out): report.json, report.png, requests.jsonl")
    from fdsched.serve.pd_cli import add_pd_arguments

    add_pd_arguments(p)
    p.set_defaults(func=cmd_serve)


DRAIN_TIMEOUT = 5.0
SHAPE_KEYS = ("num_gpu_blocks", "block_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens")


def _load_trace(args):
    from fdsched.replay.trace import TraceError
    from fdsched.replay.tracefile import load_trace, resolve_trace

    try:
        return load_trace(resolve_trace(args.trace))
    except TraceError as exc:
        raise ServeError(f"--trace {args.trace}: {exc}") from None


def _shape_from_args(args, trace=None) -> dict:
    shape = {}
    engine = (getattr(trace, "engine", None) or {}) if trace is not None else {}
    for key in SHAPE_KEYS:  # the trace header's engine shape, then the flags
        if key in engine:
            shape[key] = engine[key]
    for key in SHAPE_KEYS:
        value = getattr(args, key)
        if value is not None:
            shape[key] = value
    return shape


def report_dir(args):
    """Where a --trace run writes its report (--out, default serve-out); None without --trace."""
    return (args.out or "serve-out") if args.trace else None


def check_serve_args(args) -> tuple:
    """(problems, trace, configs): every problem of the flags, the profile(s) and the FDSCHED_* variables, one line
    each, found before anything is spawned; the loaded trace (or None) and one EngineConfig per stack to run."""
    import math

    problems, trace = [], None
    if args.trace:
        try:
            trace = _load_trace(args)
        except ServeError as exc:
            problems.append(str(exc))
    for key in SHAPE_KEYS:
        value = getattr(args, key)
        if value is not None and value < 1:
            problems.append(f"--{key.replace('_', '-')} {value}: allowed: an integer >= 1")
    if not (args.time_scale > 0 and math.isfinite(args.time_scale)):
        problems.append(f"--time-scale {args.time_scale}: allowed: a number > 0 (0.5 sends twice as fast)")
    if not (args.drain_timeout >= 0 and math.isfinite(args.drain_timeout)):
        problems.append(f"--drain-timeout {args.drain_timeout}: allowed: seconds >= 0")
    if args.idle_rpc is not None and (not args.idle_rpc > 0 or not args.num_cpu_blocks or args.trace):
        problems.append(f"--idle-rpc {args.idle_rpc}: allowed: seconds > 0, with --num-cpu-blocks > 0 and without "
                        "--trace")
    problems += trace_only_problems(args)
    if getattr(args, "role_profiles", None):  # PD only: a mixed stack has no roles
        problems.append(f"--role-profiles {args.role_profiles}: allowed only with --prefill/--decode (PD "
                        "disaggregation); for one profile per data-parallel rank use --dp 2 --arms 0=A,1=B")
    if getattr(args, "decode_num_gpu_blocks", None) is not None:
        problems.append(f"--decode-num-gpu-blocks {args.decode_num_gpu_blocks}: allowed only with --prefill/--decode")
    problems += out_dir_problems(report_dir(args), "fdsched serve")
    arms = sequential_arms(args)
    problems += sequential_arms_problems(args, arms)
    shape = _shape_from_args(args, trace)
    if arms:
        configs = [EngineConfig(profile=arm, dp=1, port=args.port, host=args.host, num_cpu_blocks=args.num_cpu_blocks,
                                health_timeout=args.health_timeout, time_schedule=args.time_schedule, **shape)
                   for arm in arms if arm]
    else:
        configs = [EngineConfig(profile=args.profile, dp=args.dp, arms=args.arms, port=args.port, host=args.host,
                                num_cpu_blocks=args.num_cpu_blocks, count_rpcs=args.idle_rpc is not None,
                                time_schedule=args.time_schedule, health_timeout=args.health_timeout, **shape)]
    for config in configs:
        problems += [p for p in check_config(config) if p not in problems]
    problems += rank_arm_problems(args.arms, args.dp, args.profile)
    if trace is not None and configs and not any("max-model-len" in p for p in problems):
        from fdsched.serve.compare import exact_output_trace
        from fdsched.serve.load import LoadError, check_servable

        try:
            check_servable(exact_output_trace(trace), configs[0].max_model_len, "the served engine")
        except LoadError as exc:
            problems.append(f"--trace {args.trace}: {exc}")
    if args.port is not None and not any(p.startswith("--port") for p in problems) and configs:
        need = PORTS_PER_RANK * max(1, args.dp) + (1 if args.dp > 1 else 0)
        busy = next((p for p in range(args.port, args.port + need) if port_in_use(p)), None)
        if busy is not None:
            problems.append(f"--port {args.port}: port {busy} is in use (the stack needs ports {args.port}-"
                            f"{args.port + need - 1}); allowed: a first port whose {need} ports are free")
    return problems, trace, configs


class _Signals:
    """Ctrl-C / SIGTERM: while serving, the first asks for a drain (the loop sees it); during start-up, a trace
    run, or a second time, it stops at once (KeyboardInterrupt, caught by the command: no traceback)."""

    def __init__(self):
        self.received = None
        self.serving = False

    def __call__(self, signum, _frame):
        first = self.received is None
        self.received = self.received or signum
        if not (self.serving and first):
            raise KeyboardInterrupt

    def install(self):
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)


def _say(line: str) -> None:
    print(f"fdsched serve: {line}", flush=True)


def cmd_serve(args) -> int:
    signals = _Signals()
    signals.install()
    with contextlib.ExitStack() as owned:  # the --out folder, settled however the run ends
        return _serve(args, signals, owned)


def _serve(args, signals, owned) -> int:
    from fdsched.serve.pd_cli import is_pd, serve_pd

    if is_pd(args):  # PD disaggregation: prefill and decode instances behind the Router
        return serve_pd(args, signals, sys.modules[__name__])
    engine = None
    try:
        problems, trace, configs = check_serve_args(args)
        if problems:
            for problem in problems:
                print(f"fdsched serve: {problem}", file=sys.stderr)
            return EXIT_ERROR
        _check_host_quietly()
        problems = _check_shapes_quietly(configs)
        for problem in problems:  # the host's own config checks on the shape, before anything is spawned
            print(f"fdsched serve: {problem}", file=sys.stderr)
        if problems:
            return EXIT_ERROR
        owned.enter_context(owned_out_dir(report_dir(args), "fdsched serve"))
        signals.install()  # the host's import may have installed its own handlers: ours go after it
        if sequential_arms(args):
            return _run_arms_in_turn(args, trace, configs, signals)
        engine = ServedEngine(configs[0], progress=_say)
        with engine:
            where = "loopback only; --host to choose otherwise" if args.host == LOOPBACK else "--host"
            _say(f"up on {args.host} ({where}); logs in {engine.log_dir}")
            _say(profiles_line(args.profile, args.arms, args.dp))
            for rank, (url, metrics) in enumerate(zip(engine.urls, engine.metrics_urls)):
                print(f"  rank {rank}: {url}/v1/completions  metrics {metrics}")
            if engine.router_url:
                print(f"  router: {engine.router_url}/v1/completions")
            if args.trace:
                code = _run_trace(engine, args, trace)
                if args.time_schedule:
                    for rank, arm in enumerate(_arm_names(engine, args)):
                        t = engine.engine_state(rank).get("schedule_times", {})
                        print(f"rank {rank} ({arm}): schedule() {format_schedule_times(t)}")
                engine.check_alive()
            elif args.idle_rpc is not None:
                for rank in range(len(engine.urls)):
                    r = receiver_rpc_rate(engine, args.idle_rpc, rank)
                    print(f"rank {rank}: transfer-done receiver {r['receiver_rpcs_per_s']:.1f} RPC/s idle "
                          f"({r['receiver_rpcs']} RPCs in {r['seconds']:.1f} s); other engine-process manager "
                          f"RPCs {r['other_rpcs_per_s']:.1f}/s")
                code = 0
            else:
                code = _serve_until_stopped(engine, args, signals)
        _finish(engine, args, failed=bool(code))
        return code
    except (KeyboardInterrupt, ServeError) as exc:
        return _ended(engine, args, exc)


def _check_host_quietly() -> None:
    """The host's import chatter (paddle, prometheus, ops warnings) goes to a log file, not the terminal."""
    from fdsched.install.hosts import cache_dir
    from fdsched.cmdline.quiet import host_output_to

    with host_output_to(cache_dir() / "logs" / "serve-host-import.log"):
        check_host_modules()


def _check_shapes_quietly(configs) -> list:
    """The host's own config checks on each stack's engine shape (its import chatter into the log, as above)."""
    from fdsched.install.hosts import cache_dir
    from fdsched.cmdline.quiet import host_output_to

    problems = []
    with host_output_to(cache_dir() / "logs" / "serve-host-import.log"):
        for config in configs[:1]:  # the stacks differ only in their profile: one shape
            problems += host_shape_problems(config)
    return problems


def _ended(engine, args, exc: BaseException) -> int:
    """A stack stopped by Ctrl-C (0) or failed with a :class:`ServeError` (its exit code): one line, everything
    started stopped, and what ran reported."""
    stopped = isinstance(exc, KeyboardInterrupt)
    if stopped:
        print("fdsched serve: stopped" + (" during start-up" if engine is None or not engine.urls else ""),
              file=sys.stderr)
    else:
        print(f"fdsched serve: {exc}", file=sys.stderr)
    if engine is not None:
        engine.stop()
        _finish(engine, args, failed=not stopped)
    if stopped:
        return 0
    return EXIT_NO_HOST if isinstance(exc, HostMissing) else EXIT_ERROR


def _finish(engine, args, failed: bool) -> None:
    """The run directory: removed on a clean exit unless --keep-logs; kept and named after a failure."""
    if not os.path.isdir(engine.run_dir):
        return  # refused before anything was started: nothing was written
    if failed or args.keep_logs:
        print(f"fdsched serve: logs kept in {engine.run_dir}", file=sys.stderr)
    else:
        engine.cleanup()


def _serve_until_stopped(engine, args, signals) -> int:
    print("serving until Ctrl-C (drains for up to "
          f"{args.drain_timeout:g} s, then ends what is left with an error event)", flush=True)
    signals.serving = True
    while signals.received is None:
        engine.check_alive()  # ServeError naming the rank, role and signal of the first process gone
        time.sleep(0.5)
    name = signal.Signals(signals.received).name
    counts = engine.drain(args.drain_timeout)
    signals.serving = False
    print(f"fdsched serve: {name}: stopped admitting; {counts['finished']} request(s) in flight finished, "
          f"{counts['ended']} ended with an error event after the {args.drain_timeout:g} s drain timeout, "
          f"{counts['refused']} refused while draining"
          + (f", {counts['lost']} lost with an instance already gone" if counts.get("lost") else "")
          + f" ({counts['seconds']:.1f} s); stopping", file=sys.stderr)
    return 0


def _run_arms_in_turn(args, trace, configs, signals) -> int:
    """One stack per arm, in turn, each sent the whole trace at the same arrival times: an A/B on identical
    traffic. The per-arm report carries a verdict."""
    from fdsched.serve.load import LoadError, Target, run_trace_load
    from fdsched.serve.served_report import build_served_report, format_served_table, merge_loads

    sent = _sendable(trace, args)
    runs = list(configs)
    if getattr(args, "repeat_reference", True) and len(configs) > 1:
        runs.append(configs[0])  # the reference again, last: its two runs bound what this machine's noise moves
    loads, targets, repeat = [], [], None
    for i, config in enumerate(runs):
        again = i == len(configs)
        label = f"{config.profile} (again)" if again else config.profile
        _say(f"arm {label} ({i + 1} of {len(runs)}): the whole trace, {len(sent.requests)} requests")
        engine = ServedEngine(config, progress=_say)
        try:
            with engine:
                target = Target(config.profile, engine.urls[0], engine.metrics_urls[0])
                try:
                    load = run_trace_load(sent, [target], time_scale=args.time_scale)
                except LoadError as exc:
                    raise ServeError(f"--trace {args.trace}: {exc}") from None
                if args.time_schedule:
                    t = engine.engine_state(0).get("schedule_times", {})
                    print(f"{label}: schedule() {format_schedule_times(t)}")
                engine.check_alive()
                if again:
                    repeat = build_served_report(sent, load, [target])["profiles"][0]
                else:
                    loads.append(load)
                    targets.append(target)
        except ServeError:
            print(f"fdsched serve: arm {label}: logs kept in {engine.run_dir}", file=sys.stderr)
            raise
        except KeyboardInterrupt:
            engine.stop()
            _finish(engine, args, failed=False)
            raise
        _finish(engine, args, failed=False)
    load = merge_loads(loads)
    report = build_served_report(sent, load, targets)
    if repeat is not None:
        report["reference_repeat"] = {"profile": repeat["profile"], "figures": repeat["figures"],
                                      "traffic": repeat["traffic"]}
    print(format_served_table(report))
    return _write_report(report, load, args)


def _sendable(trace, args):
    """The trace as its clients sent it (max_tokens unset where it is null: the engine's default applies, and the
    length mark in each prompt ends the answer at its true length), or with ``--exact-max-tokens`` every
    request's max_tokens set to its true output length."""
    from fdsched.serve.compare import exact_output_trace

    unset = sum(1 for r in trace.requests if r.max_tokens is None)
    if getattr(args, "exact_max_tokens", False):
        print(f"fdsched serve: --exact-max-tokens: every request of trace {trace.name} is sent with max_tokens = its "
              f"true output length ({unset} of {len(trace.requests)} leave it unset in the trace)", file=sys.stderr)
        return exact_output_trace(trace)
    if unset:
        from fdsched.serve.load import request_prompt

        short = sum(1 for r in trace.requests if r.max_tokens is None and request_prompt(r)[1] is None)
        print(f"fdsched serve: {unset} of {len(trace.requests)} requests of trace {trace.name} are sent without "
              "max_tokens, as the trace has them (the engine's default, max_model_len - prompt length, applies); "
              "each answer ends at its true length (--exact-max-tokens sends that length as max_tokens instead)"
              + (f"; {short} prompt(s) too short to carry their length are sent with it as max_tokens" if short
                 else ""), file=sys.stderr)
    return trace


def _write_report(report, load, args) -> int:
    from fdsched.serve.load_cli import write_outputs

    for path in write_outputs(report, load["results"], report_dir(args)):
        print(f"wrote {path}")
    failed = sum(p["figures"]["errors"] for p in report["profiles"])
    return 1 if failed else 0


def _arm_names(engine, args) -> list:
    """Each rank's arm: its profile from --arms, else --profile (the plugin's default profile when neither)."""
    names = rank_profiles(args.profile, args.arms, len(engine.urls))
    # two ranks on one profile are still two arms: name them apart
    return [f"{name}@rank{rank}" if names.count(name) > 1 else name for rank, name in enumerate(names)]


def _run_trace(engine, args, trace) -> int:
    """Send the trace to every rank's api_server (split as the Router splits, seeded; a client behind the Router
    cannot tell which rank served it, see docs/load.md), print the per-arm report, write it to --out."""
    from fdsched.serve.load import LoadError, Target, run_trace_load
    from fdsched.serve.served_report import build_served_report, format_served_table

    sent = _sendable(trace, args)
    targets = [Target(arm, url, metrics)
               for arm, url, metrics in zip(_arm_names(engine, args), engine.urls, engine.metrics_urls)]
    try:
        load = run_trace_load(sent, targets, time_scale=args.time_scale)
    except LoadError as exc:
        raise ServeError(f"--trace {args.trace}: {exc}") from None
    report = build_served_report(sent, load, targets)
    print(format_served_table(report))
    return _write_report(report, load, args)

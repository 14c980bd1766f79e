"""``fdsched serve``: the command around :class:`fdsched.serve.launcher.ServedEngine` (start the stack, send a trace
through the load generator, print the per-arm report). The launcher itself only starts and stops the stack.
"""

from __future__ import annotations

import signal
import sys
import time

from fdsched.core.common import EXIT_ERROR, EXIT_NO_HOST
from fdsched.serve.launcher import (
    PORT_RANGE, HostMissing, EngineConfig, ServedEngine, ServeError, check_host_modules, format_schedule_times, receiver_rpc_rate,
)

__all__ = ["add_command", "cmd_serve"]


def add_command(sub) -> None:
    p = sub.add_parser("serve", help="FastDeploy's real OpenAI server on CPU with the plugin and a simulated worker")
    p.add_argument("--profile", help="FDSCHED_PROFILE for every rank")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (multi_api_server + Router)")
    p.add_argument("--arms", help="FDSCHED_PROFILE_BY_DP_RANK, e.g. 0=baseline,1=recommended (needs --dp >= 2)")
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
    p.add_argument("--trace", help="a trace name or file: send it, report, shut down")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every arrival time by this (0.5: twice as fast); default 1")
    p.add_argument("--out", help="report directory (with --trace; default serve-out): report.json, report.png, requests.jsonl")
    p.set_defaults(func=cmd_serve)


def _shape_from_args(args) -> dict:
    shape = {}
    if args.trace:
        from fdsched.replay.trace import TraceError, load_trace  # the trace header's engine shape

        from fdsched.replay.trace import resolve_trace

        try:
            trace = load_trace(resolve_trace(args.trace))
        except TraceError as exc:
            raise ServeError(f"--trace {args.trace}: {exc}") from None
        engine = getattr(trace, "engine", None) or {}
        for key in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            if key in engine:
                shape[key] = engine[key]
    for key in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens"):
        value = getattr(args, key)
        if value is not None:
            if value < 1:
                raise ServeError(f"--{key.replace('_', '-')} {value}: allowed: an integer >= 1")
            shape[key] = value
    return shape


def cmd_serve(args) -> int:
    try:
        if args.idle_rpc is not None and (args.idle_rpc <= 0 or not args.num_cpu_blocks or args.trace):
            raise ServeError(f"--idle-rpc {args.idle_rpc}: allowed: seconds > 0, with --num-cpu-blocks > 0 and "
                             "without --trace")
        config = EngineConfig(profile=args.profile, dp=args.dp, arms=args.arms, port=args.port,
                              num_cpu_blocks=args.num_cpu_blocks, count_rpcs=args.idle_rpc is not None,
                              time_schedule=args.time_schedule,
                              health_timeout=args.health_timeout, **_shape_from_args(args))
        if args.port is not None and not (1024 <= args.port <= 65535):
            raise ServeError(f"--port {args.port}: allowed: 1024-65535")

        check_host_modules()  # imports the host (paddle may install its own SIGINT handler): ours go after it

        def _term(_sig, _frm):
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, _term)
        signal.signal(signal.SIGINT, _term)
        engine = ServedEngine(config)
        try:
            with engine:
                print(f"fdsched serve: up; logs in {engine.log_dir}")
                for rank, (url, metrics) in enumerate(zip(engine.urls, engine.metrics_urls)):
                    print(f"  rank {rank}: {url}/v1/completions  metrics {metrics}")
                if engine.router_url:
                    print(f"  router: {engine.router_url}/v1/completions")
                if args.trace:
                    code = _run_trace(engine, args)
                    if args.time_schedule:
                        for rank, arm in enumerate(_arm_names(engine, args)):
                            t = engine.engine_state(rank).get("schedule_times", {})
                            print(f"rank {rank} ({arm}): schedule() {format_schedule_times(t)}")
                    return code
                if args.idle_rpc is not None:
                    for rank in range(len(engine.urls)):
                        r = receiver_rpc_rate(engine, args.idle_rpc, rank)
                        print(f"rank {rank}: transfer-done receiver {r['receiver_rpcs_per_s']:.1f} RPC/s idle "
                              f"({r['receiver_rpcs']} RPCs in {r['seconds']:.1f} s); other engine-process manager "
                              f"RPCs {r['other_rpcs_per_s']:.1f}/s")
                    return 0
                print("serving until Ctrl-C", flush=True)
                while True:
                    for name, proc in engine.procs.items():
                        if proc.poll() is not None:
                            raise ServeError(f"{name} exited with code {proc.returncode}; shutting down; "
                                             f"logs in {engine.log_dir}")
                    time.sleep(1)
        except KeyboardInterrupt:
            print("fdsched serve: stopped", file=sys.stderr)
            return 0
    except ServeError as exc:
        print(f"fdsched serve: {exc}", file=sys.stderr)
        return EXIT_NO_HOST if isinstance(exc, HostMissing) else EXIT_ERROR


def _arm_names(engine, args) -> list:
    """Each rank's arm: its profile from --arms, else --profile (the plugin's default profile when neither)."""
    by_rank = {}
    for item in (args.arms or "").split(","):
        if "=" in item:
            rank, profile = item.split("=", 1)
            by_rank[int(rank.strip())] = profile.strip()
    names = [by_rank.get(rank, args.profile or "default") for rank in range(len(engine.urls))]
    # two ranks on one profile are still two arms: name them apart
    return [f"{name}@rank{rank}" if names.count(name) > 1 else name for rank, name in enumerate(names)]


def _run_trace(engine, args) -> int:
    """Send the trace to every rank's api_server (split as the Router splits, seeded; a client behind the Router
    cannot tell which rank served it, see docs/load.md), print the per-arm report, write it to --out."""
    from fdsched.replay.trace import TraceError, load_trace, resolve_trace

    from fdsched.serve.load import LoadError, Target, run_trace_load
    from fdsched.serve.load_cli import write_outputs
    from fdsched.serve.served_report import build_served_report, format_served_table

    from fdsched.serve.compare import exact_output_trace

    try:
        trace = load_trace(resolve_trace(args.trace))
        unset = sum(1 for r in trace.requests if r.max_tokens is None)
        if unset:
            # The simulated worker ends a request at its max_tokens (it has no model to say EOS); a request sent
            # without max_tokens would run to the end of the context. So every request is sent with max_tokens =
            # the tokens it really generated: the clients of this run bound their lengths exactly.
            print(f"fdsched serve: {unset} of {len(trace.requests)} requests of trace {trace.name} leave max_tokens "
                  "unset; the simulated worker stops a request only at max_tokens, so each is sent with max_tokens = "
                  "its true output length (clients that bound their lengths exactly; docs/load.md)", file=sys.stderr)
            trace = exact_output_trace(trace)
        targets = [Target(arm, url, metrics)
                   for arm, url, metrics in zip(_arm_names(engine, args), engine.urls, engine.metrics_urls)]
        load = run_trace_load(trace, targets, time_scale=args.time_scale)
    except (LoadError, TraceError) as exc:
        raise ServeError(f"--trace {args.trace}: {exc}") from None
    report = build_served_report(trace, load, targets)
    print(format_served_table(report))
    out = args.out or "serve-out"
    for path in write_outputs(report, load["results"], out):
        print(f"wrote {path}")
    failed = sum(p["figures"]["errors"] for p in report["profiles"])
    return 1 if failed else 0

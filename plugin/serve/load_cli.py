"""``fdsched load``: send a trace to running FastDeploy servers and print the per-arm served report."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from fdsched.core.common import EXIT_ERROR, EXIT_OK

__all__ = ["add_command", "cmd_load", "targets_from_args", "write_outputs"]


def add_command(sub) -> None:
    load = sub.add_parser(
        "load",
        help="send a trace to running FastDeploy servers (OpenAI /v1/completions, streaming); per-arm report",
        description="Replay a trace's requests over HTTP at their arrival times and report, per arm, what a client "
        "measures (TTFT, TPOT, end-to-end latency, stalls, errors) and the plugin's counters from each server's "
        "/metrics. With several --url, requests are split over them as FastDeploy's Router would (uniform, seeded).",
    )
    load.add_argument("--url", action="append", required=True,
                      help="an api_server's base URL, e.g. http://127.0.0.1:8000; repeat for one arm per server "
                      "(one rank's api_server each)")
    load.add_argument("--arm", action="append", help="the name of each --url's arm, in the same order (default: arm0, arm1, ...)")
    load.add_argument("--metrics-url", action="append",
                      help="each --url's Prometheus endpoint, in the same order (default: URL/metrics; FastDeploy's "
                      "api_server serves it on --metrics-port)")
    load.add_argument("--trace", required=True, help="a shipped trace name or a JSONL file (fdsched trace import output)")
    load.add_argument("--time-scale", type=float, default=1.0,
                      help="multiply every arrival time by this (0.5: twice as fast); default 1")
    load.add_argument("--step-ms", type=float, default=None,
                      help="step-based traces only: ms per trace step (default 5, the replay's fixed step cost)")
    load.add_argument("--seed", type=int, default=0, help="the seeded split over several --url (default 0, as the replay's --dp-seed)")
    load.add_argument("--model", help="the model name sent in each request (default: the server's /v1/models id)")
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds without a streamed byte before a request fails (default 600)")
    load.add_argument("--out", help="write report.json, report.png and requests.jsonl into this directory")
    load.add_argument("--no-progress", action="store_true", help="no progress bar")
    load.set_defaults(func=cmd_load)


def targets_from_args(urls, arms, metrics_urls) -> list:
    from fdsched.serve.load import LoadError, Target

    arms = arms or [f"arm{i}" for i in range(len(urls))]
    if len(arms) != len(urls):
        raise LoadError(f"--arm given {len(arms)} times for {len(urls)} --url; allowed: one --arm per --url, in order")
    if metrics_urls and len(metrics_urls) != len(urls):
        raise LoadError(f"--metrics-url given {len(metrics_urls)} times for {len(urls)} --url; allowed: one per --url, in order")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise LoadError(f"--url {url!r}; allowed: an http(s) URL such as http://127.0.0.1:8000")
    return [Target(arm, url, (metrics_urls or [None] * len(urls))[i]) for i, (arm, url) in enumerate(zip(arms, urls))]


def write_outputs(report: dict, results: list, out: str) -> list:
    """report.json, requests.jsonl and (with matplotlib) report.png in ``out``; the paths written."""
    from fdsched.serve.served_report import served_report_json, write_served_plot

    os.makedirs(out, exist_ok=True)
    written = [os.path.join(out, "report.json"), os.path.join(out, "requests.jsonl")]
    with open(written[0], "w", encoding="utf-8") as fh:
        fh.write(served_report_json(report))
    with open(written[1], "w", encoding="utf-8") as fh:
        for r in results:
            fh.write(json.dumps(r.to_json()) + "\n")
    try:
        write_served_plot(report, os.path.join(out, "report.png"))
        written.append(os.path.join(out, "report.png"))
    except ImportError:
        print("fdsched load: no PNG: matplotlib is missing: pip install aiohttp matplotlib, or in a checkout of this project: pip install '.[serve]'", file=sys.stderr)
    return written


def load_arg_problems(args) -> list:
    """Every problem of ``fdsched load``'s options that needs no server and no trace, one line each."""
    import math

    problems = []
    if not (args.time_scale > 0 and math.isfinite(args.time_scale)):
        problems.append(f"--time-scale {args.time_scale!r}; allowed: a number > 0 (0.5 sends twice as fast)")
    if args.step_ms is not None and not (args.step_ms > 0 and math.isfinite(args.step_ms)):
        problems.append(f"--step-ms {args.step_ms!r}; allowed: a number > 0")
    if not (args.request_timeout > 0):
        problems.append(f"--request-timeout {args.request_timeout!r}; allowed: seconds > 0")
    if args.arm and len(args.arm) != len(args.url):
        problems.append(f"--arm given {len(args.arm)} times for {len(args.url)} --url; allowed: one --arm per --url, "
                        "in order")
    if args.metrics_url and len(args.metrics_url) != len(args.url):
        problems.append(f"--metrics-url given {len(args.metrics_url)} times for {len(args.url)} --url; allowed: one "
                        "per --url, in order")
    for url in args.url:
        if not url.startswith(("http://", "https://")):
            problems.append(f"--url {url!r}; allowed: an http(s) URL such as http://127.0.0.1:8000")
    problems += out_dir_problems(args.out, "fdsched load")
    return problems


def out_dir_problems(out, command: str) -> list:
    """The --out folder's problem (one line), if ``command`` may not write into it; [] without --out."""
    from fdsched.cmdline.outdir import OutputError, check_out_dir

    if out is None:
        return []
    try:
        check_out_dir(out, command)
    except OutputError as exc:
        return [str(exc)]
    return []


def cmd_load(args) -> int:
    from fdsched.replay.trace import TraceError
    from fdsched.replay.tracefile import load_trace, resolve_trace
    from fdsched.serve.load import DEFAULT_STEP_MS, LoadError, run_trace_load
    from fdsched.serve.served_report import build_served_report, format_served_table

    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print("fdsched load: error: needs aiohttp: pip install aiohttp matplotlib, or in a checkout of this project: pip install '.[serve]'", file=sys.stderr)
        return EXIT_ERROR
    problems = load_arg_problems(args)
    if problems:  # every bad option, one line each, before any server is contacted
        for problem in problems:
            print(f"fdsched load: error: {problem}", file=sys.stderr)
        return EXIT_ERROR
    try:
        targets = targets_from_args(args.url, args.arm, args.metrics_url)
        trace = load_trace(resolve_trace(args.trace))
        if args.step_ms is not None and trace.time_based:
            raise LoadError(f"--step-ms {args.step_ms}: trace {trace.name} has arrival times in seconds; allowed: only "
                            "with a step-based trace")
    except (LoadError, TraceError) as exc:
        print(f"fdsched load: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    with owned_out_dir(args.out, "fdsched load") as out:
        try:
            load = run_trace_load(trace, targets, args.time_scale, args.step_ms or DEFAULT_STEP_MS, args.seed,
                                  args.model, args.request_timeout, progress=not args.no_progress)
        except (LoadError, TraceError) as exc:
            print(f"fdsched load: error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        report = build_served_report(trace, load, targets)
        print(format_served_table(report))
        if out is not None:
            for path in write_outputs(report, load["results"], str(out)):
                print(f"wrote {path}")
    failed = sum(p["figures"]["errors"] for p in report["profiles"])
    return EXIT_ERROR if failed else EXIT_OK


@contextlib.contextmanager
def owned_out_dir(value, command: str):
    """The --out folder claimed for ``command`` while the block runs (None without --out), then settled: what the
    run wrote is recorded as the command's, and a folder it made and left empty goes."""
    from fdsched.cmdline.outdir import claim_out_dir, settle_out_dir

    if value is None:
        yield None
        return
    out, created = claim_out_dir(value, command)
    try:
        yield out
    finally:
        settle_out_dir(out, command, created)


def add_compare_command(sub) -> None:
    cmp = sub.add_parser(
        "load-vs-replay",
        help="the same trace and cost model through fdsched replay and through the served engine: how far apart",
        description="Per profile: run the trace through the offline replay and through the served engine (fdsched "
        "serve's stack, the simulated worker sleeping the same cost model) and print replay vs served figures. "
        "Every request is sent with max_tokens = its true output length, on both sides (see docs/load.md).",
    )
    cmp.add_argument("--trace", required=True, help="a shipped trace name or a JSONL file")
    cmp.add_argument("--profile", action="append", required=True, help="a profile to compare; repeat for several")
    cmp.add_argument("--time-scale", type=float, default=1.0, help="multiply every arrival time by this (both sides)")
    cmp.add_argument("--out", help="write comparison.json into this directory")
    cmp.add_argument("--no-progress", action="store_true", help="no progress bar")
    cmp.set_defaults(func=cmd_compare)


def cmd_compare(args) -> int:
    from fdsched.replay.trace import TraceError
    from fdsched.replay.tracefile import load_trace, resolve_trace
    from fdsched.serve.compare import compare, format_comparison
    from fdsched.serve.load import LoadError

    problems = out_dir_problems(args.out, "fdsched load-vs-replay")
    if not (args.time_scale > 0):
        problems.insert(0, f"--time-scale {args.time_scale}; allowed: a number > 0")
    for problem in problems:
        print(f"fdsched load-vs-replay: error: {problem}", file=sys.stderr)
    if problems:
        return EXIT_ERROR
    with owned_out_dir(args.out, "fdsched load-vs-replay") as out:
        try:
            trace = load_trace(resolve_trace(args.trace))
            result = compare(trace, args.profile, args.time_scale, progress=not args.no_progress,
                             log=lambda msg: print(msg, file=sys.stderr, flush=True))
        except (LoadError, TraceError) as exc:
            print(f"fdsched load-vs-replay: error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        print(format_comparison(result))
        if out is not None:
            path = os.path.join(out, "comparison.json")
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(result, fh, indent=1)
            print(f"wrote {path}")
    return EXIT_OK

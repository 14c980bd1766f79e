"""``fdsched serve-pd-bench``: a served A/B of one PD role, through FastDeploy's Router to one prefill and one decode
instance, one stack per profile of that role in turn (the other role's profile unchanged). Two workloads:

    fdsched serve-pd-bench --trace pd-prefill \\
        --prefill-profiles baseline,examples/profiles/pd-prefill-upstream.yaml,pd_prefill_cache \\
        --decode-profile baseline --decode-num-gpu-blocks 1200
    fdsched serve-pd-bench --burst 8 --decode-profiles baseline,decode_only_preempt --runs 3

A trace (the prefill node's A/B; the first profile again at the end for the run-to-run noise). Per arm: the prefill
and decode engines' own prefix-cache hit rate (``fastdeploy:hit_token_rate`` on each instance's ``/metrics``), TTFT
and E2E on the client's clock (sent -> first / last streamed token, through the Router), KV blocks not free on each
instance (sampled every 0.5 s from the engine's own accounting, seam H1: peak and mean), and the prefill messager's
transfer count (finished / failed).

A burst (decode-side preemption through the Router's retry): :mod:`fdsched.serve.pd_burst`.

``python -m fdsched.serve.pd_bench`` runs the same command.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time

__all__ = ["main", "run_arm", "stack_config", "add_command", "check_args", "host_problems", "cmd_serve_pd_bench"]


def _sample_blocks(eng, stop: threading.Event, out: dict) -> None:
    while not stop.is_set():
        for rank, inst in enumerate(eng.instances):
            try:
                state = eng.engine_state(rank, timeout=10)
            except Exception:  # noqa: BLE001 - a missed sample is not a failed run
                continue
            used = int(state["total"]) - len(state["free"])
            out.setdefault(inst["role"], []).append(used)
        stop.wait(0.5)


def _hit_rate(text) -> float:
    for line in (text or "").splitlines():
        m = re.match(r"fastdeploy:hit_token_rate(?:\{[^}]*\})?\s+([0-9.eE+-]+)", line)
        if m:
            return float(m.group(1))
    return float("nan")


def stack_config(prefill_profile: str, decode_profile: str, shape: dict, decode_blocks=None):
    """One 1P+1D stack's configuration: each role's profile, the engine shape, the decode node's own pool if set."""
    from fdsched.serve.pd import PdConfig

    return PdConfig(prefill=1, decode=1, role_profiles=f"prefill={prefill_profile},decode={decode_profile}",
                    decode_num_gpu_blocks=decode_blocks, health_timeout=300, **shape)


def run_arm(trace, config, time_scale: float) -> dict:
    """One stack (:func:`stack_config`), the whole trace through its Router; the arm's figures. The stack's run
    folder goes afterwards."""
    from fdsched.serve.pd import PdServedEngine, parse_role_profiles

    profiles = parse_role_profiles(config.role_profiles)
    prefill_profile, decode_profile = profiles["prefill"], profiles["decode"]
    eng = PdServedEngine(config, progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    try:
        with eng:
            return _measure(eng, trace, prefill_profile, decode_profile, time_scale)
    finally:
        eng.cleanup()  # the stack's run folder (logs, state): everything reported has been read from it


def _measure(eng, trace, prefill_profile: str, decode_profile: str, time_scale: float) -> dict:
    """The arm's figures from a running stack."""
    from fdsched.serve.load import Target, run_trace_load
    from fdsched.serve.served_report import client_figures

    prefill, decode = eng.instances
    target = Target(prefill_profile, prefill["url"], prefill["metrics"], send_url=eng.router_url)
    samples, stop = {}, threading.Event()
    sampler = threading.Thread(target=_sample_blocks, args=(eng, stop, samples), daemon=True)
    sampler.start()
    load = run_trace_load(trace, [target], time_scale=time_scale, progress=False)
    stop.set()
    sampler.join()
    eng.check_alive()
    figures = client_figures(load["results"])
    log = eng.messager_log(0)
    finished = len(re.findall(r": finished \(", log))
    failed = len(re.findall(r": (?:connection error|write cache error) \(", log))
    return {
        "prefill_profile": prefill_profile, "decode_profile": decode_profile,
        "requests": figures["requests"], "finished": figures["requests_finished"], "errors": figures["errors"],
        "prefill_hit_rate": _hit_rate(eng.metrics_text(0)), "decode_hit_rate": _hit_rate(eng.metrics_text(1)),
        **{k: figures.get(k) for k in ("ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p50", "e2e_ms_p90", "e2e_ms_p99")},
        "prefill_blocks_peak": max(samples.get("prefill", [0])),
        "prefill_blocks_mean": round(sum(samples.get("prefill", [0])) / max(1, len(samples.get("prefill", []))), 1),
        "decode_blocks_peak": max(samples.get("decode", [0])),
        "transfers_finished": finished, "transfers_failed": failed,
        "wall_seconds": round(load["wall_seconds"], 1),
    }


COLUMNS = (("prefill_hit_rate", "P hit rate", "{:.3f}"), ("decode_hit_rate", "D hit rate", "{:.3f}"),
           ("ttft_ms_p50", "TTFT p50 ms", "{:.0f}"), ("ttft_ms_p99", "TTFT p99 ms", "{:.0f}"),
           ("e2e_ms_p50", "E2E p50 ms", "{:.0f}"), ("e2e_ms_p99", "E2E p99 ms", "{:.0f}"),
           ("prefill_blocks_peak", "P blocks peak", "{}"), ("prefill_blocks_mean", "P blocks mean", "{}"),
           ("decode_blocks_peak", "D blocks peak", "{}"), ("transfers_finished", "transfers", "{}"),
           ("transfers_failed", "failed", "{}"), ("finished", "finished", "{}"), ("wall_seconds", "wall s", "{}"))


def format_table(rows: list, role: str = "prefill") -> str:
    head = f"| {role} profile | " + " | ".join(title for _k, title, _f in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for row in rows:
        cells = []
        for key, _title, fmt in COLUMNS:
            value = row.get(key)
            cells.append("n/a" if value is None else fmt.format(value))
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


DESCRIPTION = ("A served A/B of one PD role through FastDeploy's Router to one prefill and one decode instance, one "
               "stack per profile of that role in turn (the other role's profile unchanged): a trace (--trace), or "
               "a burst of non-streamed completions that makes the decode node preempt (--burst N), which names a "
               "stalled decode node in one line.")
TRACE_DEFAULT = "pd-prefill"
DEFAULTS = {"trace": {"prefill": "baseline,pd_prefill_cache", "decode": "baseline"},
            "burst": {"prefill": "baseline", "decode": "baseline,decode_only_preempt"}}
BURST_ONLY = {"prompt_tokens": 40, "max_tokens": 150, "runs": 1, "stall_seconds": 15.0}


def add_arguments(p) -> None:
    from fdsched.core.common import bounded_float, bounded_int

    p.add_argument("--trace", help=f"a shipped trace name or a JSONL file (default {TRACE_DEFAULT}; not with --burst)")
    p.add_argument("--burst", type=bounded_int(1, 64), metavar="N",
                   help="instead of a trace: N non-streamed completions at once (the Router retries only those when "
                        "a decode instance preempts one), on a 48-block pool (--num-gpu-blocks)")
    p.add_argument("--prefill-profiles", "--prefill-profile", dest="prefill_profiles",
                   help="comma-separated profiles for the prefill node, one stack each, in turn (default: "
                        f"{DEFAULTS['trace']['prefill']} with a trace, {DEFAULTS['burst']['prefill']} with --burst)")
    p.add_argument("--decode-profiles", "--decode-profile", dest="decode_profiles",
                   help="comma-separated profiles for the decode node (default: "
                        f"{DEFAULTS['trace']['decode']} with a trace, {DEFAULTS['burst']['decode']} with --burst); "
                        "several profiles on one role only")
    p.add_argument("--num-gpu-blocks", type=bounded_int(1, 1_000_000),
                   help="every instance's KV pool (default: the trace's; 48 with --burst)")
    p.add_argument("--decode-num-gpu-blocks", type=bounded_int(1, 1_000_000),
                   help="the decode node's KV pool (default: --num-gpu-blocks)")
    p.add_argument("--time-scale", type=bounded_float(0, 1000, lo_open=True), default=1.0,
                   help="with a trace: multiply every arrival time by this (default 1)")
    p.add_argument("--no-repeat-reference", dest="repeat", action="store_false",
                   help="with a trace: do not run the first profile again at the end")
    p.add_argument("--prompt-tokens", type=bounded_int(1, 4096),
                   help=f"with --burst: each prompt's tokens (default {BURST_ONLY['prompt_tokens']})")
    p.add_argument("--max-tokens", type=bounded_int(1, 4096),
                   help=f"with --burst: each answer's max_tokens (default {BURST_ONLY['max_tokens']})")
    p.add_argument("--runs", type=bounded_int(1, 20),
                   help=f"with --burst: stacks per profile (default {BURST_ONLY['runs']})")
    p.add_argument("--stall-seconds", type=bounded_float(0, 3600, lo_open=True),
                   help="with --burst: end a run, naming what the decode engine holds, when no answer arrives and "
                        f"its state does not change for this long (default {BURST_ONLY['stall_seconds']:g})")
    p.add_argument("--out", help="write the rows as JSON here")


def add_command(sub) -> None:
    p = sub.add_parser("serve-pd-bench", help="a served A/B of one PD role through the Router: a trace, or a burst "
                                              "that makes the decode node preempt",
                       description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=cmd_serve_pd_bench)


def _role_profiles(a, mode: str, problems: list) -> dict:
    """role -> its profiles from the command line (or the mode's default), each loaded and its cost model checked
    (the role's simulated worker steps by it); a problem appended per bad one."""
    import os

    from fdsched.core.settings import SettingsError, load_settings
    from fdsched.replay.costmodel import check_replay_settings

    roles = {}
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FDSCHED_PROFILE")}
    for role in ("prefill", "decode"):
        text = getattr(a, f"{role}_profiles")
        names = [x.strip() for x in (text if text is not None else DEFAULTS[mode][role]).split(",") if x.strip()]
        if not names:
            problems.append(f"--{role}-profiles {text!r}: allowed: one or more profile names or YAML paths, "
                            "comma-separated")
        for name in names:
            try:
                check_replay_settings(load_settings(environ, profile=name))
            except SettingsError as exc:
                problems.append(f"--{role}-profiles: {exc}")
        roles[role] = names
    return roles


def check_args(a) -> tuple:
    """(problems, plan): every problem of the command line, one line each, before anything is spawned."""
    import os

    problems = []
    mode = "burst" if a.burst else "trace"
    if a.burst and a.trace:
        problems.append(f"--trace {a.trace} with --burst {a.burst}: allowed: one workload, a trace or a burst")
    if not a.burst:
        for key in BURST_ONLY:
            if getattr(a, key) is not None:
                flag = "--" + key.replace("_", "-")
                problems.append(f"{flag} {getattr(a, key):g} without --burst: allowed: only with --burst N")
    roles = _role_profiles(a, mode, problems)
    if len(roles["prefill"]) > 1 and len(roles["decode"]) > 1:
        problems.append(f"--prefill-profiles {','.join(roles['prefill'])} with --decode-profiles "
                        f"{','.join(roles['decode'])}: allowed: several profiles on one role only")
    plan = {"mode": mode, "roles": roles, "trace": None, "shape": {}}
    if a.burst:
        burst = {k: getattr(a, k) if getattr(a, k) is not None else v for k, v in BURST_ONLY.items()}
        plan.update(burst)
        from fdsched.serve.pd_burst import BURST_SHAPE

        plan["shape"] = dict(BURST_SHAPE)
        limit = plan["shape"]["max_model_len"]
        if burst["prompt_tokens"] + burst["max_tokens"] > limit:
            problems.append(f"--prompt-tokens {burst['prompt_tokens']} with --max-tokens {burst['max_tokens']}: "
                            f"allowed: at most {limit} tokens together (the burst's max_model_len)")
    else:
        from fdsched.replay.trace import TraceError
        from fdsched.replay.tracefile import load_trace, resolve_trace

        try:
            plan["trace"] = load_trace(resolve_trace(a.trace or TRACE_DEFAULT))
        except TraceError as exc:
            problems.append(f"--trace: {exc}")
        else:
            engine = dict(plan["trace"].engine or {})
            plan["shape"] = {k: engine[k] for k in ("num_gpu_blocks", "block_size", "max_num_seqs",
                                                     "max_num_batched_tokens", "max_model_len") if k in engine}
    if a.num_gpu_blocks is not None:
        plan["shape"]["num_gpu_blocks"] = a.num_gpu_blocks
    if a.out and not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
        problems.append(f"--out {a.out}: no such directory {os.path.dirname(os.path.abspath(a.out))}; allowed: a "
                        "file in an existing directory")
    return problems, plan


def cmd_serve_pd_bench(a) -> int:
    from fdsched.core.common import EXIT_ERROR, EXIT_NO_HOST, error_line
    from fdsched.serve.config import HostMissing, ServeError

    problems, plan = check_args(a)
    for problem in problems:
        print(error_line("serve-pd-bench", problem), file=sys.stderr)
    if problems:
        return EXIT_ERROR
    try:
        problems = host_problems(a, plan)
    except HostMissing as exc:
        print(error_line("serve-pd-bench", exc), file=sys.stderr)
        return EXIT_NO_HOST
    for problem in problems:
        print(error_line("serve-pd-bench", problem), file=sys.stderr)
    if problems:
        return EXIT_ERROR
    try:
        rows = _run_burst(a, plan) if plan["mode"] == "burst" else _run_trace(a, plan)
    except ServeError as exc:
        print(error_line("serve-pd-bench", exc), file=sys.stderr)
        return EXIT_ERROR
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    if plan["mode"] == "burst":
        return 0 if not any(r["stalled"] for r in rows) else 1
    return 0 if all(r["errors"] == 0 for r in rows) else 1


def _say(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def host_problems(a, plan) -> list:
    """The serve command's pre-flight for every stack the plan starts, before the first one: the PD configuration,
    the host's own config checks on the shape, what the host must have for PD and whether it takes each profile.
    The host is imported here once, its import chatter in the serve commands' log; its label goes in
    ``plan["host"]``. ServeError (HostMissing) when the host or its serving modules are missing."""
    from fdsched.cmdline.quiet import host_output_to
    from fdsched.install.hosts import cache_dir
    from fdsched.install.probe import probe
    from fdsched.serve.config import check_host_modules
    from fdsched.serve.pd import pd_config_problems
    from fdsched.serve.pd_checks import host_pd_problems
    from fdsched.serve.preflight import host_shape_problems

    roles = plan["roles"]
    configs = [stack_config(p, d, plan["shape"], a.decode_num_gpu_blocks) for p in roles["prefill"]
               for d in roles["decode"]]
    problems = pd_config_problems(configs[0])
    with host_output_to(cache_dir() / "logs" / "serve-host-import.log"):
        check_host_modules()
        plan["host"] = probe().label
        problems = problems or host_shape_problems(configs[0])  # the stacks differ only in their profiles
        for config in configs if not problems else []:
            problems += [p for p in host_pd_problems(config) if p not in problems]
    return problems


def _run_trace(a, plan) -> list:
    trace = plan["trace"]
    prefill, decode = plan["roles"]["prefill"], plan["roles"]["decode"]
    role, arms = ("decode", decode) if len(decode) > 1 else ("prefill", prefill)
    runs = arms + ([arms[0]] if a.repeat and len(arms) > 1 else [])
    rows = []
    for i, profile in enumerate(runs):
        label = profile + (" (again)" if i >= len(arms) else "")
        print(f"arm {label} ({i + 1} of {len(runs)})", file=sys.stderr, flush=True)
        p, d = (profile, decode[0]) if role == "prefill" else (prefill[0], profile)
        row = run_arm(trace, stack_config(p, d, plan["shape"], a.decode_num_gpu_blocks), a.time_scale)
        row["label"] = label
        rows.append(row)
    print(f"trace {trace.name}: {len(trace.requests)} requests; host {plan['host']}; "
          + (f"decode node {decode[0]}" if role == "prefill" else f"prefill node {prefill[0]}")
          + f"; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(format_table(rows, role))
    return rows


def _run_burst(a, plan) -> list:
    from fdsched.serve.pd_burst import format_burst_table, run_burst_arm

    prefill, decode = plan["roles"]["prefill"], plan["roles"]["decode"]
    rows = []
    total = len(prefill) * len(decode) * plan["runs"]
    for run in range(1, plan["runs"] + 1):
        for p in prefill:
            for d in decode:
                print(f"run {len(rows) + 1} of {total}: prefill {p}, decode {d}", file=sys.stderr, flush=True)
                config = stack_config(p, d, plan["shape"], a.decode_num_gpu_blocks)
                rows.append(run_burst_arm(config, d, run, a.burst, plan["prompt_tokens"], plan["max_tokens"],
                                          plan["stall_seconds"], _say))
    print(f"burst of {a.burst} non-streamed completions ({plan['prompt_tokens']} prompt tokens, max_tokens "
          f"{plan['max_tokens']}) through the Router; {plan['shape']['num_gpu_blocks']} blocks of "
          f"{plan['shape']['block_size']}; prefill node {', '.join(prefill)}; host {plan['host']}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(format_burst_table(rows))
    for row in rows:
        for what in ("stall", "error_sample"):
            if row[what]:
                print(f"run {row['run']} ({row['decode_profile']}): {row[what]}")
    return rows


class _Parser(argparse.ArgumentParser):
    """A refused command line in one line, as the ``fdsched`` command's."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def main(argv=None) -> int:
    ap = _Parser(prog="fdsched serve-pd-bench", description=DESCRIPTION)
    add_arguments(ap)
    return cmd_serve_pd_bench(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

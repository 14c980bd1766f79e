"""``fdsched replay``, ``eval``, ``check`` and ``trace``: the command-line side of the replay, their options.

``fdsched replay`` replays a trace once per profile through the real host scheduler and writes a
table (terminal), ``report.json`` and ``replay.png``; ``fdsched eval`` runs the reference arms on the held-out
evaluation windows. The options are declared here (``fdsched check``'s in :mod:`fdsched.replay.check_cli`); the
bodies are :mod:`fdsched.replay.replay_cli`, :mod:`fdsched.replay.eval_cli`, :mod:`fdsched.replay.check_cli` and,
for ``fdsched trace``'s subcommands (generate, validate, list, import: no host needed), :mod:`fdsched.replay.trace_cli`.
"""

from __future__ import annotations

from fdsched.core.common import bounded_float, bounded_int
from fdsched.replay.eval_cli import cmd_eval
from fdsched.replay.replay_cli import cmd_replay
from fdsched.replay.trace import ENGINE_MAX, MAX_ARRIVAL_S, MAX_ARRIVAL_STEP
from fdsched.replay.tracefile import shipped_traces

DEFAULT_TRACE = "pressure"

__all__ = ["add_commands"]


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

"""``fdsched trace``'s subcommands (no host needed): ``generate`` writes a synthetic trace, ``validate`` checks one
(and that its requests fit its engine), ``list`` shows the shipped ones, ``import`` turns a public request log (CSV)
into a time-based trace. Their options are declared with the replay's in :mod:`fdsched.replay.cli`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fdsched.core.common import EXIT_ERROR, EXIT_OK, error_line, plural
from fdsched.replay.trace import ENGINE_KEYS, TraceError, check_engine
from fdsched.replay.tracefile import load_trace, resolve_trace, shipped_traces

__all__ = ["cmd_trace_generate", "cmd_trace_validate", "cmd_trace_list", "cmd_trace_import"]


def cmd_trace_generate(args) -> int:
    from fdsched.replay.generate import DEFAULT_REQUESTS, generate_text

    n = args.requests or DEFAULT_REQUESTS[args.kind]
    text = generate_text(args.kind, n, args.seed)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        try:
            _check_out_file(args.out, "fdsched trace generate")
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text, encoding="utf-8")
        except (TraceError, OSError) as exc:
            detail = exc if isinstance(exc, TraceError) else (
                f"--out {args.out!r}: cannot write ({exc.strerror}); allowed: a file path in a writable directory, "
                "or - (standard output)")
            print(error_line("trace generate", detail), file=sys.stderr)
            return EXIT_ERROR
        print(f"wrote {args.out}: {args.kind}, {plural(n, 'request')}, seed {args.seed}", file=sys.stderr)
    return EXIT_OK


def _trace_summary(trace, engine: dict) -> str:
    requests = trace.requests
    prompt = sum(r.prompt_len for r in requests)
    out = sum(r.effective_output_len for r in requests)
    if trace.time_based:
        span = f"arrivals over {min(r.arrival_s for r in requests):.3f}..{max(r.arrival_s for r in requests):.3f} s"
    else:
        span = f"arrivals over steps 0..{max(r.arrival for r in requests)}"
    groups = sorted({r.prefix_group for r in requests if r.prefix_group})
    lines = [
        f"{trace.name}: {plural(len(requests), 'request')}, {span}, {plural(prompt, 'prompt token')}, "
        f"{out} output tokens" + (f", prefix groups: {', '.join(groups)}" if groups else ""),
        "engine: " + ", ".join(f"{k}={engine[k]}" for k in ENGINE_KEYS),
    ]
    if trace.description:
        lines.append(trace.description)
    return "\n".join(lines)


def cmd_trace_validate(args) -> int:
    try:
        trace = load_trace(resolve_trace(args.trace))
        engine = trace.engine_with()
        check_engine(trace, engine)
    except TraceError as exc:
        print(error_line("trace validate", exc), file=sys.stderr)
        return EXIT_ERROR
    print(_trace_summary(trace, engine))
    print("ok")
    return EXIT_OK


def cmd_trace_import(args) -> int:
    from fdsched.replay.importer import ImportOptions, import_summary, import_trace, parse_columns, parse_max_tokens

    try:
        options = ImportOptions(
            fmt=args.fmt,
            columns=parse_columns(args.columns) if args.columns else {},
            start_s=args.start,
            duration_s=args.duration,
            limit=args.limit,
            rate_scale=args.rate_scale,
            sample=args.sample,
            seed=args.seed,
            max_tokens=parse_max_tokens(args.max_tokens),
            engine={
                "block_size": args.block_size,
                "num_gpu_blocks": args.num_gpu_blocks,
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "max_model_len": args.max_model_len,
            },
            description=args.description,
        )
        _check_out_file(args.out, "fdsched trace import")
        result = import_trace(args.csv, args.out, options)
    except TraceError as exc:
        print(error_line("trace import", exc), file=sys.stderr)
        return EXIT_ERROR
    print(f"wrote {args.out}: {import_summary(result)}", file=sys.stderr)
    return EXIT_OK


def cmd_trace_list(args) -> int:
    for name, path in shipped_traces().items():
        try:
            trace = load_trace(path)
            print(f"{name}: {trace.description or '(no description)'}")
        except TraceError as exc:
            print(f"{name}: INVALID: {exc}")
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# replay
# --------------------------------------------------------------------------------------------


def _check_out_file(value: str, command: str) -> None:
    """An output trace's path: a new file, or a trace the same command wrote (never a file it did not write)."""
    from fdsched.replay.generate import KINDS
    from fdsched.cmdline.outdir import OutputError, check_out_file, trace_written_by

    kinds = ("import",) if command.endswith("import") else tuple(KINDS)
    try:
        check_out_file(value, command, trace_written_by(kinds))
    except OutputError as exc:
        raise TraceError(str(exc)) from None

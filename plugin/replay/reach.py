"""How often the host defects appear on the shipped real traces, at realistic engine shapes.

``python -m fdsched.replay.reach --out DIR [--traces NAME ...] [--quick]`` replays a window of each shipped real
trace (its first requests, in arrival order) through FastDeploy's own scheduler at every ``max_num_seqs`` in
:data:`SEATS` and every pool in :data:`POOLS` (a multiple of the window's working set), under each arm of
:data:`ARMS`, and classifies each run with :func:`fdsched.replay.check.failure_of`: ``ok``, ``blocks`` (a block
with two owners, or free and in use), ``requests`` (a request lost or short), ``stall`` (``stall (seats)`` when
preempted requests hold every seat). The PD prefill trace is replayed on a prefill node with no profile, before
and after the prefill fix, and with the host alone.

The working set of a window at a ``max_num_seqs`` is the peak number of KV blocks held by requests at once when
the window is replayed under the ``unbounded`` profile (a pool that never limits) at that ``max_num_seqs``; a pool
is never set below the host's minimum (:func:`fdsched.replay.trace.min_gpu_blocks`).

The results go to ``DIR/reach-<host commit>.json`` (rewritten after every row, so an interrupted grid keeps what
finished); a summary (per trace and arm: how many shapes show each defect) and the Markdown table (a row per
trace and shape, a column per arm) are printed at the end. ``--table JSON`` prints both for an earlier run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

__all__ = ["ARMS", "PD_ARMS", "FIXES_OFF", "Grid", "FULL", "QUICK", "window", "working_set", "shape_engine",
           "replay_arm", "cell_of", "run_grid", "markdown", "summary", "main", "COMMAND"]

COMMAND = "python -m fdsched.replay.reach"  # the owner recorded in --out's marker (fdsched.cmdline.outdir)
REAL_TRACES = ("azure-conv", "burstgpt", "eval-code-true", "eval-code-unset", "eval-conv-true", "eval-conv-unset")
PD_TRACE = "pd-prefill"
SEATS = (4, 16, 64, 256)
POOLS = (0.5, 1.0, 2.0)
FIXES_OFF = {"FDSCHED_ONE_NODE_PER_BLOCK": "off", "FDSCHED_PREEMPTED_SEAT_RESUME": "off",
             "FDSCHED_PREFILL_NODE_RESERVE": "off"}


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str  # the column
    profile: Optional[str]  # None: no profile (the defaults)
    host_only: bool = False  # FastDeploy's own classes, the plugin not installed
    env: tuple = ()  # (variable, value) pairs applied with inherit_env


ARMS = (
    Arm("host alone", "baseline", host_only=True),
    Arm("baseline before the fixes", "baseline", env=tuple(FIXES_OFF.items())),
    Arm("baseline", "baseline"),
    Arm("adaptive", "adaptive"),
    Arm("recommended", "recommended"),
)
PD_ARMS = (
    Arm("host alone", None, host_only=True),  # the host's own defaults (its ratio reservation where it has one)
    Arm("default before the fix", None, env=(("FDSCHED_PREFILL_NODE_RESERVE", "off"),)),
    Arm("default", None),
)


@dataclasses.dataclass(frozen=True)
class Grid:
    traces: tuple
    seats: tuple
    pools: tuple
    window: int  # the first N requests of each trace
    check_every: int = 1  # block invariants every N steps
    max_steps: int = 40_000
    stall_steps: int = 200


FULL = Grid(REAL_TRACES + (PD_TRACE,), SEATS, POOLS, window=60)
QUICK = Grid(("azure-conv", PD_TRACE), (4,), (0.5,), window=12, max_steps=6000, stall_steps=60)


def window(trace, size: int):
    """The trace cut to its first ``size`` requests in arrival order (the whole trace when it is shorter)."""
    first = tuple(trace.in_feed_order()[:size])
    return dataclasses.replace(trace, requests=first)


def shape_engine(trace, seats: int, pool: int) -> dict:
    """The trace header's engine at ``seats`` and ``pool`` blocks (never below the host's minimum pool)."""
    from fdsched.replay.trace import min_gpu_blocks

    base = trace.engine_with()
    floor = min_gpu_blocks(base["max_model_len"], base["block_size"])
    return trace.engine_with({"max_num_seqs": seats, "num_gpu_blocks": max(floor, pool)})


def working_set(trace, seats: int) -> int:
    """Peak blocks held by requests at once, replayed under ``unbounded`` (a pool that never limits)."""
    from fdsched.replay.runner import run_profile

    run = run_profile(trace, "unbounded", shape_engine(trace, seats, 0), check_every_step=False)
    return max((step.blocks_held for step in run.steps), default=0)


@contextlib.contextmanager
def arm_environment(arm: Arm) -> Iterator[None]:
    """While the arm runs: the plugin's variables are exactly the arm's (others set outside are put aside)."""
    from fdsched.core.settings import SCHEMA
    from fdsched.core.settings import PROFILE_ENV

    names = {s.env for s in SCHEMA if s.env} | {PROFILE_ENV} | {name for name, _ in arm.env}
    saved = {name: os.environ.pop(name) for name in list(names) if name in os.environ}
    os.environ.update(dict(arm.env))
    try:
        yield
    finally:
        for name, _ in arm.env:
            os.environ.pop(name, None)
        os.environ.update(saved)


def replay_arm(trace, engine: dict, arm: Arm, grid: Grid):
    """One replay of ``trace`` on ``engine`` under ``arm`` (the runner's ProfileRun)."""
    from fdsched.replay.runner import run_profile

    with arm_environment(arm):
        return run_profile(trace, arm.profile, dict(engine), max_steps=grid.max_steps, stall_steps=grid.stall_steps,
                           check_every=grid.check_every, inherit_env=bool(arm.env), host_only=arm.host_only)


def cell_of(failure: Optional[tuple]) -> str:
    """A table cell from :func:`fdsched.replay.check.failure_of`'s answer."""
    from fdsched.replay.check import SEATS_DEFECT

    if failure is None:
        return "ok"
    kind, _, known = failure
    return f"{kind} (seats)" if known == SEATS_DEFECT else kind


def _measure(trace, engine: dict, arm: Arm, grid: Grid) -> dict:
    """Replay one arm and classify it; an arm the host refuses is an ``error`` cell, with its message."""
    from fdsched.replay.check import Case, failure_of

    started = time.process_time()
    try:
        run = replay_arm(trace, engine, arm, grid)
    except Exception as exc:  # noqa: BLE001 - one refused arm must not end the grid; the cell says so
        return {"cell": "error", "detail": f"{type(exc).__name__}: {exc}"[:300], "cpu_s": 0.0}
    failure = failure_of(run, Case(dict(engine), trace.requests))
    out = {"cell": cell_of(failure), "cpu_s": round(time.process_time() - started, 2), "drained": run.drained,
           "steps": len(run.steps), "preemptions": sum(len(s.preempted) for s in run.steps)}
    if failure is not None:
        out.update(kind=failure[0], detail=failure[1], known=failure[2])
    return out


def _rows(grid: Grid, name: str) -> Iterator[dict]:
    """Every (seats, pool) row of one trace, measured."""
    from fdsched.replay.tracefile import load_trace, resolve_trace

    full = load_trace(resolve_trace(name))
    trace = window(full, grid.window)
    arms = PD_ARMS if trace.engine_with()["splitwise_role"] == "prefill" else ARMS
    for seats in grid.seats:
        need = working_set(trace, seats)
        for factor in grid.pools:
            engine = shape_engine(trace, seats, round(need * factor))
            cells = {arm.name: _measure(trace, engine, arm, grid) for arm in arms}
            yield {"trace": name, "requests": len(trace.requests), "of": len(full.requests), "seats": seats,
                   "pool_factor": factor, "working_set": need, "pool": engine["num_gpu_blocks"],
                   "role": engine["splitwise_role"], "cells": cells}


def _host() -> dict:
    from fdsched.install.probe import probe

    info = probe()
    commit = getattr(info, "commit", None) or ""
    version = getattr(info, "version", None) or ""
    known = version if version and version.lower() != "unknown" else ""
    return {"label": " ".join(filter(None, ("FastDeploy", known, f"commit {commit[:7]}"))), "commit": commit,
            "version": version}


def run_grid(grid: Grid, out: Path, report=None) -> dict:
    """Measure the grid, rewriting ``out``'s JSON after every row; returns the results. ``report(line, stream)``
    is called after every row (the stream is the terminal's, while the host's output goes to the log)."""
    from fdsched.replay.engine import prepare_host_environment
    from fdsched.install.probe import find_host
    from fdsched.cmdline.outdir import settle_out_dir
    from fdsched.cmdline.quiet import host_output_to

    prepare_host_environment()
    with host_output_to(out / "host.log"):
        find_host()
        host = _host()
    results = {"host": host, "grid": dataclasses.asdict(grid), "rows": [],
               "working_set": "peak KV blocks held by requests, the window replayed under the unbounded profile "
                              "at the row's max_num_seqs", "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    path = out / f"reach-{(host['commit'] or 'host')[:7]}.json"
    for name in grid.traces:
        with host_output_to(out / "host.log") as log:
            for row in _rows(grid, name):
                results["rows"].append(row)
                path.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
                settle_out_dir(out, COMMAND, created=False)  # an interrupted grid's folder stays this command's
                if report is not None:
                    report(_progress(row), log.terminal)
    results["path"] = str(path)
    return results


def _progress(row: dict) -> str:
    cpu = sum(c.get("cpu_s", 0.0) for c in row["cells"].values())
    cells = ", ".join(f"{arm}: {c['cell']}" for arm, c in row["cells"].items())
    return f"{row['trace']} max_num_seqs {row['seats']} pool {row['pool_factor']:g}x: {cells} ({cpu:.0f} s)"


def markdown(results: dict) -> str:
    """The results as Markdown tables: one for the mixed-role traces, one for the prefill node."""
    parts = []
    for role in ("mixed", "prefill"):
        rows = [r for r in results["rows"] if r["role"] == role]
        if not rows:
            continue
        arms = list(rows[0]["cells"])
        lines = ["| trace (window) | max_num_seqs | pool (x working set) | " + " | ".join(arms) + " |",
                 "|---|---|---|" + "---|" * len(arms)]
        for r in rows:
            floor = " (the host's minimum)" if r["pool"] > round(r["working_set"] * r["pool_factor"]) else ""
            pool = f"{r['pool']}{floor}: {r['pool_factor']:g}x of {r['working_set']}"
            lines.append(f"| {r['trace']} (first {r['requests']} of {r['of']}) | {r['seats']} | {pool} | "
                         + " | ".join(r["cells"][a]["cell"] for a in arms) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def summary(results: dict) -> str:
    """Per role, one Markdown row per trace: per arm, ``ok`` when every shape drains clean, else each defect with
    the number of shapes that show it (``stall (seats) 2 of 12``)."""
    parts = []
    for role in ("mixed", "prefill"):
        rows = [r for r in results["rows"] if r["role"] == role]
        if rows:
            parts.append(_summary_table(rows))
    return "\n\n".join(parts)


def _summary_table(rows: list) -> str:
    arms = list(rows[0]["cells"])
    lines = ["| trace (window) | shapes | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
    for name in dict.fromkeys(r["trace"] for r in rows):
        mine = [r for r in rows if r["trace"] == name]
        cells = []
        for arm in arms:
            found = [r["cells"][arm]["cell"] for r in mine]
            bad = {cell: found.count(cell) for cell in dict.fromkeys(found) if cell != "ok"}
            cells.append(", ".join(f"{cell} {n} of {len(found)}" for cell, n in bad.items()) if bad else "ok")
        lines.append(f"| {name} (first {mine[0]['requests']} of {mine[0]['of']}) | {len(mine)} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fdsched.replay.reach", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the JSON results and the host's log (new, empty, or this "
                        "command's own)")
    parser.add_argument("--traces", nargs="+", metavar="NAME", help="shipped traces (default: "
                        f"{', '.join(FULL.traces)}; --quick: {', '.join(QUICK.traces)})")
    parser.add_argument("--quick", action="store_true", help=f"a tiny grid: the first {QUICK.window} requests, "
                        f"max_num_seqs {QUICK.seats[0]}, a pool of {QUICK.pools[0]:g}x the working set")
    parser.add_argument("--window", type=int, metavar="N", help="replay the first N requests of each trace "
                        f"(default {FULL.window}; --quick {QUICK.window})")
    parser.add_argument("--seats", type=int, nargs="+", metavar="N", help="max_num_seqs values")
    parser.add_argument("--table", metavar="JSON", help="print the table of an earlier run's JSON and stop")
    return parser


def _grid(args) -> Grid:
    grid = QUICK if args.quick else FULL
    changes = {}
    if args.traces:
        from fdsched.replay.tracefile import shipped_traces

        unknown = [t for t in args.traces if t not in shipped_traces()]
        if unknown:
            raise ValueError(f"--traces: bad value {' '.join(unknown)!r} (unknown); allowed: shipped traces "
                             f"({', '.join(shipped_traces())})")
        changes["traces"] = tuple(args.traces)
    if args.window is not None:
        if args.window < 1:
            raise ValueError(f"--window: bad value {args.window!r}; allowed: 1 or more requests")
        changes["window"] = args.window
    if args.seats:
        if min(args.seats) < 1:
            raise ValueError(f"--seats: bad value {min(args.seats)!r}; allowed: max_num_seqs of 1 or more")
        changes["seats"] = tuple(args.seats)
    return dataclasses.replace(grid, **changes)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit code 0 when the grid ran (whatever it found), 1 on a refused option or folder (one line)."""
    from fdsched.cmdline.outdir import OutputError, claim_out_dir, settle_out_dir

    args = _parser().parse_args(argv)
    if args.table:
        results = json.loads(Path(args.table).read_text(encoding="utf-8"))
        print(summary(results) + "\n\n" + markdown(results))
        return 0
    try:
        if not args.out:
            raise OutputError("--out: missing; allowed: a new or empty folder, or one an earlier run of "
                              f"{COMMAND} wrote")
        grid = _grid(args)
        out, created = claim_out_dir(args.out, COMMAND)
    except (OutputError, ValueError) as exc:
        print(f"{COMMAND}: error: {exc}", file=sys.stderr)
        return 1
    try:
        results = run_grid(grid, out, report=lambda line, stream: print(line, file=stream, flush=True))
    finally:
        settle_out_dir(out, COMMAND, created)
    print(f"host {results['host']['label']}; results in {results['path']}\n")
    print(summary(results) + "\n\n" + markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

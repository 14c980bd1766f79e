"""The golden decision log: what the scheduler decided, step by step, for every shipped trace x profile.

A redesign that must not change behaviour is checked against it: the host-tier test
``tests/host/test_decision_golden.py`` replays the traces and profiles recorded in the golden file for
the running host and compares every step. Regenerate the file ONLY when a change is meant to alter
decisions (and say so in the commit)::

    python -m fdsched.replay.golden write            # both supported hosts, every shipped trace x profile
    python -m fdsched.replay.golden check [--full]   # the test's comparison, from the command line
    python -m fdsched.replay.golden dump TRACE PROFILE [--now]   # one log as JSON lines, to diff

run from the repository's root (the files are ``tests/host/data/decision_golden/<host commit>.jsonl.gz``;
``--dir`` points elsewhere); ``write`` needs both hosts under ``FDSCHED_HOME`` (``fdsched host setup``).

A step's record (one JSON array, the step number is its index)::

    [prefill chunks [[request id, start, end], ...], preempted [[request id, phase], ...],
     first-token request ids, finished request ids, decode tokens, running, waiting,
     blocks used (not free), blocks held by requests, nodes evicted, idle gap ms before the step]

and a request's, at the end: ``[id, first token step, finish step, finish count, preemptions,
cache-hit tokens, prefill tokens, output tokens]``. Everything here is a function of the trace, the
profile, the host and the (default, linear) step-cost model; nothing measured is in it. The report's
figures (``compute_figures``) are kept beside each log.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

GOLDEN_VERSION = 1
# Golden files live with the host tier (one per host commit); the package does not ship them.
GOLDEN_DIR = Path("tests") / "host" / "data" / "decision_golden"
HOSTS = ("e7c8dc2fe940ba2f50d932f17b41eab555846ecb", "d38eeb8334331b903fb34c9cd270ff0c58a48adf")
# The CI subset (tests/host/test_decision_golden.py without FDSCHED_GOLDEN_FULL=1): every profile on the
# three synthetic traces; on azure-conv the profiles that differ in what they decide (baseline, the ratio
# reservation alone, recommended and its reservation variants); on burstgpt, the slower real trace, baseline,
# recommended and adaptive. The profiles left out on the real traces differ from baseline only in changes those
# traces do not exercise there (deferred recycle and the transfer receiver keep decisions; decode-only preemption
# and the P-node cache are covered on pressure and pd-prefill). `python -m fdsched.replay.golden check --full`
# compares every recorded pair.
CI_SUBSET = {
    "pressure": "*",
    "shared-prefix": "*",
    "pd-prefill": "*",
    "azure-conv": ("baseline", "ratio_reserve", "recommended", "adaptive", "oracle"),
    "burstgpt": ("baseline", "recommended", "adaptive"),
}
# Pairs whose replay is not reproducible from run to run, so they are recorded but not compared. None: the one
# there was (pd-prefill under pd_prefill_cache) depended on PYTHONHASHSEED, because the replay finished a
# step's requests with one finish_requests(list) call, which the host turns into a set of ids (string-hash
# order), and on a prefill node the safe recording enters blocks into the radix tree in finishing order. The
# replay now finishes one id per call in the step's order, as the engine's token processor does.
NOT_REPRODUCIBLE: set = set()
FLOAT_REL = 1e-9  # report figures: relative tolerance (float arithmetic may be reordered by a refactor)


def golden_path(commit: str, directory: Path = GOLDEN_DIR) -> Path:
    return Path(directory) / f"{commit[:9]}.jsonl.gz"


def _num(value):
    if isinstance(value, float):
        return round(value, 6)
    return value


@contextlib.contextmanager
def recording_steps(records: list):
    """While open, every ``Driver.step()`` appends its ``StepRecord`` to ``records``."""
    from fdsched.replay.driver import Driver

    original = Driver.step

    def step(self):
        record = original(self)
        records.append(record)
        return record

    Driver.step = step
    try:
        yield
    finally:
        Driver.step = original


def step_line(record, row) -> list:
    return [
        [[rid, start, end] for rid, start, end in record.prefill_chunks],
        [[rid, phase] for rid, phase in record.preempted],
        list(record.first_tokens),
        list(record.finished),
        record.decode_tokens,
        row.running,
        row.waiting,
        row.blocks_used,
        row.blocks_held,
        row.evicted,
        _num(row.gap_ms),
    ]


def request_line(row) -> list:
    return [row.id, row.first_token_step, row.finish_step, row.finish_count, row.preemptions, row.cache_hit_tokens,
            row.prefill_tokens, row.output_tokens]


def _plain_figures(figures: dict) -> dict:
    return {k: _num(v) for k, v in figures.items() if isinstance(v, (int, float, str, type(None)))}


def decision_log(trace_name: str, profile: str) -> dict:
    """Replay one shipped trace under one profile (exactly the profile: no environment applies) and return
    its entry: the step and request lines, their sha256 and the report's figures."""
    from fdsched.replay.figures import compute_figures
    from fdsched.replay.runner import run_profile
    from fdsched.replay.tracefile import load_trace, resolve_trace

    trace = load_trace(resolve_trace(trace_name))
    records: list = []
    with recording_steps(records):
        run = run_profile(trace, profile, trace.engine_with(), check_every_step=False)
    if len(records) != len(run.steps):
        raise RuntimeError(f"{trace_name}/{profile}: {len(records)} step records for {len(run.steps)} steps")
    steps = [step_line(rec, row) for rec, row in zip(records, run.steps)]
    requests = [request_line(row) for row in run.requests]
    digest = hashlib.sha256()
    for line in steps + [["requests"]] + requests:
        digest.update(json.dumps(line, separators=(",", ":")).encode())
        digest.update(b"\n")
    return {
        "trace": trace_name,
        "profile": profile,
        "sha256": digest.hexdigest(),
        "steps": len(steps),
        "drained": run.drained,
        "stop_reason": run.stop_reason,
        "figures": _plain_figures(compute_figures(run)),
        "log": steps,
        "requests": requests,
    }


def current_profiles() -> list:
    from fdsched.core.settings import shipped_profiles

    return sorted(shipped_profiles())


def current_traces() -> list:
    from fdsched.replay.tracefile import shipped_traces

    return list(shipped_traces())


def comparable(trace: str, profile: str) -> bool:
    return (trace, profile) not in NOT_REPRODUCIBLE


def in_ci_subset(trace: str, profile: str) -> bool:
    if not comparable(trace, profile):
        return False
    chosen = CI_SUBSET.get(trace)
    return chosen == "*" or (chosen is not None and profile in chosen)


def read_golden(path: Path) -> list:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        header = json.loads(handle.readline())
        if header.get("fdsched_decision_golden") != GOLDEN_VERSION:
            raise ValueError(f"{path}: not a version-{GOLDEN_VERSION} golden decision log")
        return [json.loads(line) for line in handle]


def write_golden(path: Path, host_commit: str, entries: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(str(path), "wb", compresslevel=9, mtime=0) as raw:
        raw.write((json.dumps({"fdsched_decision_golden": GOLDEN_VERSION, "host": host_commit,
                               "cost_model": "the profiles' default linear replay.* step cost",
                               "regenerate": "python -m fdsched.replay.golden write"}) + "\n").encode())
        for entry in entries:
            raw.write((json.dumps(entry, separators=(",", ":")) + "\n").encode())


def _same_figure(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            return a is b
        if math.isnan(a) and math.isnan(b):
            return True
        return math.isclose(a, b, rel_tol=FLOAT_REL, abs_tol=1e-9)
    return a == b


STEP_FIELDS = ("prefill_chunks", "preempted", "first_token", "finished", "decode_tokens", "running", "waiting",
               "blocks_used", "blocks_held", "evicted", "gap_ms")
REQUEST_FIELDS = ("id", "first_token_step", "finish_step", "finish_count", "preemptions", "cache_hit_tokens",
                  "prefill_tokens", "output_tokens")


def compare(golden: dict, current: dict) -> Optional[str]:
    """None when ``current`` decides as ``golden`` did; else a message naming the first difference."""
    where = f"trace {golden['trace']}, profile {golden['profile']}"
    if golden["sha256"] == current["sha256"]:
        return _compare_figures(where, golden, current)
    for index, (old, new) in enumerate(zip(golden["log"], current["log"])):
        if old != new:
            fields = [f"{name}: golden {o!r}, now {n!r}" for name, o, n in zip(STEP_FIELDS, old, new) if o != n]
            return f"{where}: first differing step {index}: " + "; ".join(fields)
    if len(golden["log"]) != len(current["log"]):
        return (f"{where}: the first {min(len(golden['log']), len(current['log']))} steps agree, then the golden run "
                f"has {len(golden['log'])} steps and this one {len(current['log'])}")
    for old, new in zip(golden["requests"], current["requests"]):
        if old != new:
            fields = [f"{name}: golden {o!r}, now {n!r}" for name, o, n in zip(REQUEST_FIELDS, old, new) if o != n]
            return f"{where}: every step agrees, request {old[0]} differs: " + "; ".join(fields)
    return f"{where}: the logs hash differently but no step or request differs (golden file damaged?)"


def _compare_figures(where: str, golden: dict, current: dict) -> Optional[str]:
    for key, value in golden["figures"].items():
        if key not in current["figures"]:
            return f"{where}: report figure {key!r} (golden {value!r}) is no longer computed"
        if not _same_figure(value, current["figures"][key]):
            return f"{where}: same decisions, but report figure {key!r}: golden {value!r}, now {current['figures'][key]!r}"
    return None


def _host_commit() -> str:
    from fdsched.install.probe import find_host, probe
    from fdsched.replay.engine import prepare_host_environment

    prepare_host_environment()
    find_host()
    return probe().commit or ""


def check(directory: Path = GOLDEN_DIR, full: bool = False, progress=print) -> list:
    """Compare the running host against its golden file; return the failure messages."""
    commit = _host_commit()
    path = golden_path(commit, directory)
    if not path.exists():
        return [f"no golden decision log for host {commit[:9]} ({path}); supported: {', '.join(h[:9] for h in HOSTS)}"]
    failures = []
    profiles, traces = set(current_profiles()), set(current_traces())
    for golden in read_golden(path):
        trace, profile = golden["trace"], golden["profile"]
        if not comparable(trace, profile) or (not full and not in_ci_subset(trace, profile)):
            continue
        if profile not in profiles:
            failures.append(f"profile {profile!r} of the golden log is no longer shipped")
            continue
        if trace not in traces:
            failures.append(f"trace {trace!r} of the golden log is no longer shipped")
            continue
        started = time.perf_counter()
        message = compare(golden, decision_log(trace, profile))
        progress(f"{trace:<14} {profile:<20} {golden['steps']:>6} steps  {time.perf_counter() - started:6.1f} s  "
                 f"{'ok' if message is None else 'DIFFERS'}")
        if message:
            failures.append(message)
    return failures


def _generate(commit: str, out: Path, only_profiles: Sequence[str] = ()) -> None:
    """Write the golden file of ``commit``: every shipped trace x profile, or with ``only_profiles`` the
    recorded entries of those profiles replaced (every other entry kept as recorded)."""
    kept = read_golden(out) if only_profiles else []
    profiles = list(only_profiles) or current_profiles()
    entries = [entry for entry in kept if entry["profile"] not in profiles]
    for trace in current_traces():
        for profile in profiles:
            started = time.perf_counter()
            entries.append(decision_log(trace, profile))
            print(f"{commit[:9]} {trace:<14} {profile:<20} {entries[-1]['steps']:>6} steps "
                  f"{time.perf_counter() - started:6.1f} s", file=sys.stderr, flush=True)
    order = {(t, p): i for i, (t, p) in enumerate((e["trace"], e["profile"]) for e in kept)}
    entries.sort(key=lambda e: order.get((e["trace"], e["profile"]), len(order)))
    write_golden(out, commit, entries)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fdsched.replay.golden", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    write = sub.add_parser("write", help="regenerate the golden file(s): ONLY for a change meant to alter decisions")
    write.add_argument("--host", action="append", metavar="COMMIT",
                       help=f"host commit (default: both, {', '.join(h[:9] for h in HOSTS)}); needs FDSCHED_HOME")
    write.add_argument("--profile", action="append", default=[], metavar="NAME",
                       help="regenerate only this profile's entries (repeatable); the others stay as recorded")
    chk = sub.add_parser("check", help="compare the host of FDSCHED_HOST_SOURCE against its golden file")
    chk.add_argument("--full", action="store_true", help="every recorded trace x profile, not only the CI subset")
    dump = sub.add_parser("dump", help="print one recorded log as JSON lines (to diff against a fresh one)")
    dump.add_argument("trace")
    dump.add_argument("profile")
    dump.add_argument("--host", default=None, help="host commit of the golden file (default: the running host)")
    dump.add_argument("--now", action="store_true", help="replay it now instead of reading the golden file")
    for each in (write, chk, dump):
        each.add_argument("--dir", type=Path, default=GOLDEN_DIR, help=f"golden files' folder (default {GOLDEN_DIR})")
    args = parser.parse_args(argv)

    if args.command == "write":
        unknown = sorted(set(args.profile) - set(current_profiles()))
        if unknown:
            parser.error(f"--profile {unknown[0]!r}: not a shipped profile; allowed: {', '.join(current_profiles())}")
        return _write(args.host or list(HOSTS), args.dir, args.profile)
    if args.command == "check":
        failures = check(args.dir, full=args.full)
        for message in failures:
            print(f"DIFFERS: {message}", file=sys.stderr)
        return 1 if failures else 0
    entry = _dump_entry(args)
    if entry is None:
        return 1
    for index, line in enumerate(entry["log"]):
        print(json.dumps([index] + line, separators=(",", ":")))
    for line in entry["requests"]:
        print(json.dumps(["request"] + line, separators=(",", ":")))
    print(json.dumps(["figures", entry["figures"]], sort_keys=True))
    return 0


def _dump_entry(args) -> Optional[dict]:
    if args.now:
        return decision_log(args.trace, args.profile)
    commit = args.host or _host_commit()
    matches = [p for p in Path(args.dir).glob("*.jsonl.gz") if commit.startswith(p.name.split(".")[0])
               or p.name.startswith(commit[:9])]
    if not matches:
        print(f"no golden file for host {commit!r} in {args.dir}", file=sys.stderr)
        return None
    for entry in read_golden(matches[0]):
        if entry["trace"] == args.trace and entry["profile"] == args.profile:
            return entry
    print(f"{matches[0]} has no log for trace {args.trace!r}, profile {args.profile!r}", file=sys.stderr)
    return None


def _write(hosts: list, directory: Path, only_profiles: Sequence[str] = ()) -> int:
    """One child process per host (a process binds one host's modules)."""
    import subprocess

    home = os.environ.get("FDSCHED_HOME")
    for commit in hosts:
        source = _host_source(commit, home)
        if source is None:
            print(f"host {commit}: not found under FDSCHED_HOME ({home}); run `fdsched host setup` first",
                  file=sys.stderr)
            return 1
        env = dict(os.environ, FDSCHED_HOST_SOURCE=str(source))
        for name in [k for k in env if k.startswith("FDSCHED_") and k not in ("FDSCHED_HOME", "FDSCHED_HOST_SOURCE")]:
            del env[name]
        env.pop("FD_PLUGINS", None)
        path = golden_path(commit, directory)
        code = subprocess.call([sys.executable, "-m", "fdsched.replay.golden", "_write_one", commit, str(path),
                                *only_profiles], env=env)
        if code:
            return code
        print(f"wrote {path} ({path.stat().st_size} bytes)", file=sys.stderr)
    return 0


def _host_source(commit: str, home: Optional[str]) -> Optional[Path]:
    if not home:
        return None
    path = Path(home) / "hosts" / commit
    return path if path.is_dir() else None


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "_write_one":  # the child process of `write`, one host
        found = _host_commit()
        if found != sys.argv[2]:
            sys.exit(f"expected host {sys.argv[2]}, FDSCHED_HOST_SOURCE gives {found}")
        _generate(found, Path(sys.argv[3]), sys.argv[4:])
        sys.exit(0)
    sys.exit(main())

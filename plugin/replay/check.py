"""``fdsched check``: search the host's real scheduler for defects with generated traces and engine shapes.

Each case is a short trace (1 to 10 requests: shared prefixes, ``max_tokens`` set and unset) on a small engine
drawn at random from a seed: pools from the smallest the host accepts to ample, ``max_num_seqs`` 1 to 256, token
budgets that chunk prompts, prefix caching on or off, the mixed or the PD prefill role. Every case is replayed
through FastDeploy's own classes with the plugin not installed (arm ``host``) and under each shipped profile
(arms named by profile), with the block invariants checked after every step. A case fails an arm when

* ``blocks``: a block is free twice, both free and held, leaked, or held by two requests outside the cache;
* ``requests``: a request is lost, finished twice, or finished with fewer tokens than it should produce;
* ``stall``: nothing is fed, scheduled, produced, preempted or finished for ``stall_steps`` steps while requests
  are left (the replay's progress rule), or the run reaches its step limit;
* ``raises``: the scheduler or the prefix cache raises out of a step (in an engine, the scheduler thread's end).

A failure is shrunk (requests dropped, lengths and arrivals cut, the pool and the seats made smaller, as long as
the same arm still fails the same way), written as a trace file the replay reads, and printed as one line.
Imports nothing from FastDeploy at import time (the runner does, when it runs).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from fdsched.replay.trace import Trace, TraceRequest, dump_trace, min_gpu_blocks

__all__ = ["HOST_ARM", "SEATS_DEFECT", "TWO_OWNERS_DEFECT", "PREFILL_RESERVE_DEFECT", "Case", "Finding", "draw_case",
           "failure_of", "run_case", "shrink", "search"]

HOST_ARM = "host"
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
SEATS = (1, 2, 3, 4, 6, 8, 16, 256)
BUDGETS = (8, 16, 32, 64)
STALL_STEPS = 40
MAX_STEPS = 3000


@dataclass(frozen=True)
class Case:
    engine: dict
    requests: tuple  # TraceRequest

    def trace(self) -> Trace:
        return Trace(self.requests, dict(self.engine), source="fdsched check", name="check")


@dataclass(frozen=True)
class Finding:
    arm: str
    kind: str  # blocks | requests | stall
    detail: str
    case: Case
    path: Optional[Path] = None
    known: str = ""  # the documented host defect it is, if it is one
    drawn: int = 0  # which drawn case (1 = the seed's first) it was found in, before shrinking

    def line(self) -> str:
        where = f" -> {self.path}" if self.path else ""
        known = f" [known: {self.known}]" if self.known else ""
        engine = self.case.engine
        shape = (f"{len(self.case.requests)} requests, {engine['num_gpu_blocks']} blocks, "
                 f"max_num_seqs {engine['max_num_seqs']}, role {engine['splitwise_role']}")
        return f"{self.arm}: {self.kind}: {self.detail} ({shape}, drawn case {self.drawn}){known}{where}"


def draw_case(rng: random.Random) -> Case:
    """One random case: an engine shape and up to 10 requests that fit it."""
    seats = rng.choice(SEATS)
    need = min_gpu_blocks(MAX_MODEL_LEN, BLOCK_SIZE)
    engine = {
        "block_size": BLOCK_SIZE,
        "max_model_len": MAX_MODEL_LEN,
        "num_gpu_blocks": rng.choice((need, need, need + rng.randrange(1, 8), need + rng.randrange(8, 40))),
        "max_num_seqs": seats,
        "max_num_batched_tokens": max(rng.choice(BUDGETS), seats, BLOCK_SIZE),
        "enable_prefix_caching": rng.random() < 0.8,
        "splitwise_role": "prefill" if rng.random() < 0.2 else "mixed",
        "enc_dec_block_num": 2,
    }
    requests = []
    for i in range(rng.randint(1, 10)):
        group = rng.choice((None, None, "a", "b"))
        if group and rng.random() < 0.4:  # a prompt the cache may hold whole: block-aligned, all of it the prefix
            prompt_len = BLOCK_SIZE * rng.randint(1, 6)
            prefix_len = prompt_len
        else:
            prompt_len = rng.randint(1, 28)
            prefix_len = rng.choice((0, prompt_len, rng.randint(0, prompt_len))) if group else 0
        output_len = rng.randint(1, MAX_MODEL_LEN - prompt_len)
        max_tokens = rng.choice((None, None, rng.randint(1, MAX_MODEL_LEN - prompt_len)))
        requests.append(TraceRequest(id=f"c{i}", arrival=rng.randint(0, 6), prompt_len=prompt_len,
                                     output_len=output_len, max_tokens=max_tokens, prefix_group=group,
                                     prefix_len=prefix_len, line=i + 1))
    return Case(engine, tuple(requests))


SEATS_DEFECT = "preempted requests hold every seat"
TWO_OWNERS_DEFECT = "a KV block owned by two radix-tree nodes"
PREFILL_RESERVE_DEFECT = "a prefill node's reservation refuses chunks that need no block"


def failure_of(run, case: Case) -> Optional[tuple]:
    """``(kind, detail, known)`` of the first failed check of a finished replay (``known``: the documented host
    defect it is, or ""), or None when every check holds."""
    for step in run.steps:
        if step.violations:
            first = step.violations[0]
            two_owners = (("both free and in use" in first and "prefix cache" in first)
                          or "twice in the free list" in first)
            return "blocks", f"step {step.step}: {first}", TWO_OWNERS_DEFECT if two_owners else ""
    if run.request_violations:
        return "requests", run.request_violations[0], ""
    if not run.drained:
        stall = run.stall or {}
        if not stall:
            return "stall", run.stop_reason or "the run did not drain", ""
        return "stall", (f"running {stall.get('running')}, waiting {stall.get('waiting')} "
                         f"({stall.get('waiting_preempted')} preempted), not admitted {stall.get('not_admitted')}, "
                         f"free blocks {stall.get('free_blocks')}"), _known_stall(stall, case.engine)
    short = [row.id for row in run.requests if row.output_tokens < row.target_output]
    if short:
        return "requests", f"finished with fewer tokens than it produces: {', '.join(short[:8])}", ""
    return None


def _known_stall(stall: dict, engine: dict) -> str:
    """The documented host defect a stall looks like, or ""."""
    if (stall.get("running") == 0 and stall.get("free_blocks", 0) > 0
            and stall.get("waiting_preempted", 0) >= engine["max_num_seqs"]):
        return SEATS_DEFECT
    running = stall.get("running", 0)
    if (engine["splitwise_role"] == "prefill" and running > 0 and stall.get("waiting") == 0
            and stall.get("running_with_all_blocks") == running):
        return PREFILL_RESERVE_DEFECT
    return ""


def run_case(case: Case, arm: str) -> Optional[tuple]:
    """Replay ``case`` under ``arm`` (``host``: FastDeploy alone; else a profile); its failure or None."""
    from fdsched.replay.runner import run_profile

    host = arm == HOST_ARM
    try:
        run = run_profile(case.trace(), "baseline" if host else arm, dict(case.engine), max_steps=MAX_STEPS,
                          stall_steps=STALL_STEPS, check_every=1, host_only=host)
    except Exception as exc:  # noqa: BLE001 - the scheduler raising out of a step is a finding, not the search's end
        return "raises", _raised(exc), ""
    return failure_of(run, case)


def _raised(exc: BaseException) -> str:
    """``Type: message at file:line`` of the innermost frame, and of the innermost frame in FastDeploy's code when
    that is another one (the chained exception a handler was raising about comes first)."""
    import os
    import traceback

    cause = exc.__context__ if exc.__context__ is not None else exc
    frames = traceback.extract_tb(cause.__traceback__)
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    text = f"{type(cause).__name__}: {cause}{where}"
    if cause is not exc:
        text += f" (then {type(exc).__name__}: {exc})"
    return text


def _smaller(case: Case):
    """Candidate cases one shrinking step smaller, most reducing first."""
    reqs = case.requests
    for i in range(len(reqs)):
        if len(reqs) > 1:
            yield replace(case, requests=reqs[:i] + reqs[i + 1:])
    engine = case.engine
    floor = min_gpu_blocks(engine["max_model_len"], engine["block_size"])
    if engine["num_gpu_blocks"] > floor:
        yield replace(case, engine=dict(engine, num_gpu_blocks=max(floor, engine["num_gpu_blocks"] // 2)))
        yield replace(case, engine=dict(engine, num_gpu_blocks=engine["num_gpu_blocks"] - 1))
    if engine["max_num_seqs"] > 1:
        seats = min(engine["max_num_seqs"] - 1, max(1, len(reqs)))
        yield replace(case, engine=dict(engine, max_num_seqs=seats))
    for i, r in enumerate(reqs):
        for field, value in (("output_len", r.output_len // 2), ("prompt_len", r.prompt_len // 2),
                             ("arrival", 0), ("max_tokens", None), ("prefix_group", None)):
            if getattr(r, field) == value or (field in ("output_len", "prompt_len") and value < 1):
                continue
            changed = replace(r, **{field: value})
            if field == "prompt_len" or field == "prefix_group":
                changed = replace(changed, prefix_len=min(changed.prefix_len, changed.prompt_len)
                                  if changed.prefix_group else 0)
            yield replace(case, requests=reqs[:i] + (changed,) + reqs[i + 1:])


def shrink(case: Case, arm: str, kind: str, fails: Callable = run_case, deadline: Optional[float] = None) -> Case:
    """The smallest case found, by greedy steps, that still fails ``arm`` with ``kind``."""
    improved = True
    while improved and (deadline is None or time.monotonic() < deadline):
        improved = False
        for candidate in _smaller(case):
            try:
                found = fails(candidate, arm)
            except Exception:  # noqa: BLE001 - a candidate the host refuses is simply not smaller
                continue
            if found is not None and found[0] == kind:
                case, improved = candidate, True
                break
    return case


def _write(out: Path, index: int, finding: Finding) -> Path:
    path = out / f"finding-{index:02d}-{finding.arm}-{finding.kind}.jsonl"
    profile = "baseline" if finding.arm == HOST_ARM else finding.arm
    how = ("FastDeploy alone (plugin not installed)" if finding.arm == HOST_ARM else f"profile {finding.arm}")
    text = dump_trace(finding.case.requests, finding.case.engine,
                      description=f"fdsched check: {finding.kind} under {how}: {finding.detail}",
                      generator={"kind": "fdsched check", "arm": finding.arm, "profile": profile})
    path.write_text(text, encoding="utf-8")
    return path


def search(arms: Sequence[str], seed: int, budget_s: float, out: Optional[Path] = None, max_cases: int = 0,
           report: Callable = print, fails: Callable = run_case, until: frozenset = frozenset()) -> dict:
    """Draw cases from ``seed`` until ``budget_s`` seconds are spent (or ``max_cases`` are tried, or every known
    defect named in ``until`` is found); replay each under every arm; shrink, write and report the first failure of
    each (arm, kind, known defect). Returns a summary dict."""
    rng = random.Random(seed)
    started = time.monotonic()
    deadline = started + budget_s
    seen: dict = {}
    cases = 0
    while time.monotonic() < deadline and (not max_cases or cases < max_cases) and not (
            until and until <= {f.known for f in seen.values()}):
        case = draw_case(rng)
        cases += 1
        for arm in arms:
            found = fails(case, arm)
            if found is None or (arm, found[0], found[2]) in seen:
                continue
            kind = found[0]
            small = shrink(case, arm, kind, fails, deadline=time.monotonic() + max(5.0, budget_s / 10))
            _, detail, known = fails(small, arm) or found
            finding = Finding(arm, kind, detail, small, known=known, drawn=cases)
            if out is not None:
                finding = replace(finding, path=_write(out, len(seen) + 1, finding))
            seen[(arm, kind, found[2])] = finding
            report(finding.line())
    return {"cases": cases, "seconds": round(time.monotonic() - started, 1), "findings": list(seen.values())}


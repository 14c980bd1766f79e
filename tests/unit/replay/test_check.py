"""fdsched check's search without a host: drawing, judging, shrinking and reporting, with plain objects."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from fdsched.core.settings import SettingsError
from fdsched.replay.check import (HOST_ARM, PREFILL_RESERVE_DEFECT, SEATS_DEFECT, TWO_OWNERS_DEFECT, Case, draw_case,
                                  failure_of, search, shrink)
from fdsched.replay.check_cli import COMMAND, _arms, _out_dir
from fdsched.cmdline.outdir import claim_out_dir
from fdsched.replay.trace import TraceRequest, check_engine
from fdsched.replay.tracefile import load_trace


def _req(i, prompt=8, output=4, arrival=0, max_tokens=None):
    return TraceRequest(id=f"r{i}", arrival=arrival, prompt_len=prompt, output_len=output, max_tokens=max_tokens,
                        line=i + 1)


def _case(*requests, **engine):
    shape = dict(block_size=4, max_model_len=64, num_gpu_blocks=30, max_num_seqs=4, max_num_batched_tokens=16,
                 enable_prefix_caching=True, splitwise_role="mixed", enc_dec_block_num=2)
    shape.update(engine)
    return Case(shape, tuple(requests))


def test_drawn_cases_fit_their_engine_and_repeat_by_seed():
    first = [draw_case(random.Random(7)) for _ in range(1)]
    rng_a, rng_b = random.Random(3), random.Random(3)
    cases_a = [draw_case(rng_a) for _ in range(200)]
    cases_b = [draw_case(rng_b) for _ in range(200)]
    assert cases_a == cases_b and first
    for case in cases_a:
        check_engine(case.trace(), case.engine)  # raises on a shape or request the host would refuse
        assert 1 <= len(case.requests) <= 10
    engines = [c.engine for c in cases_a]
    assert {e["splitwise_role"] for e in engines} == {"mixed", "prefill"}
    assert min(e["num_gpu_blocks"] for e in engines) == 18 and max(e["num_gpu_blocks"] for e in engines) > 30
    assert {1, 256} <= {e["max_num_seqs"] for e in engines}
    assert any(r.max_tokens is None for c in cases_a for r in c.requests)
    assert any(r.max_tokens is not None for c in cases_a for r in c.requests)
    assert any(r.prefix_group for c in cases_a for r in c.requests)


def _run(**fields):
    base = dict(steps=[], request_violations=[], drained=True, stall=None, stop_reason="", requests=[])
    base.update(fields)
    return SimpleNamespace(**base)


def test_failure_of_names_the_first_failed_check():
    case = _case(_req(0), max_num_seqs=2)
    assert failure_of(_run(), case) is None
    blocks = _run(steps=[SimpleNamespace(step=3, violations=["block ids twice in the free list: [4]"])])
    assert failure_of(blocks, case) == ("blocks", "step 3: block ids twice in the free list: [4]", TWO_OWNERS_DEFECT)
    leaked = _run(steps=[SimpleNamespace(step=2, violations=["block ids neither free nor held (leaked): [1]"])])
    assert failure_of(leaked, case)[2] == ""
    lost = _run(request_violations=["requests lost (the engine drained without finishing them): r0"])
    assert failure_of(lost, case)[0] == "requests"
    short = _run(requests=[SimpleNamespace(id="r0", output_tokens=2, target_output=4)])
    assert failure_of(short, case)[:2] == ("requests", "finished with fewer tokens than it produces: r0")
    seats = _run(drained=False, stall={"running": 0, "waiting": 2, "waiting_preempted": 2, "not_admitted": 0,
                                       "free_blocks": 20})
    assert failure_of(seats, case) == ("stall", "running 0, waiting 2 (2 preempted), not admitted 0, free blocks 20",
                                       SEATS_DEFECT)
    other = _run(drained=False, stall={"running": 1, "waiting": 0, "waiting_preempted": 0, "not_admitted": 3,
                                       "free_blocks": 0})
    assert failure_of(other, case)[0::2] == ("stall", "")
    prefill = _case(_req(0), splitwise_role="prefill")
    stuck = _run(drained=False, stall={"running": 2, "waiting": 0, "waiting_preempted": 0, "not_admitted": 0,
                                       "free_blocks": 3, "running_with_all_blocks": 2})
    assert failure_of(stuck, prefill)[2] == PREFILL_RESERVE_DEFECT and failure_of(stuck, case)[2] == ""


def test_shrink_keeps_the_failure_and_makes_the_case_small():
    """A made-up defect: any request with a prompt of 10 tokens or more stalls the arm."""

    def fails(case, arm):
        return ("stall", "x", "") if any(r.prompt_len >= 10 for r in case.requests) else None

    big = _case(*[_req(i, prompt=p, output=30, arrival=i) for i, p in enumerate((3, 25, 7, 40, 2))],
                num_gpu_blocks=40, max_num_seqs=8)
    small = shrink(big, "baseline", "stall", fails)
    assert fails(small, "baseline") is not None
    assert len(small.requests) == 1 and 10 <= small.requests[0].prompt_len < 20
    assert small.requests[0].output_len == 1 and small.requests[0].arrival == 0
    assert small.engine["num_gpu_blocks"] == 18 and small.engine["max_num_seqs"] == 1


def test_shrink_does_not_trade_one_failure_for_another():
    def fails(case, arm):
        if len(case.requests) >= 2:
            return ("blocks", "two", "")
        return ("stall", "one", "")

    small = shrink(_case(_req(0), _req(1), _req(2)), "host", "blocks", fails)
    assert len(small.requests) == 2


def test_search_reports_each_arm_and_kind_once_and_writes_a_replayable_trace(tmp_path):
    def fails(case, arm):
        if arm == "recommended":
            return None
        return ("stall", f"{arm} stalls", SEATS_DEFECT if arm == HOST_ARM else "")

    lines = []
    result = search([HOST_ARM, "baseline", "recommended"], seed=1, budget_s=30, out=tmp_path, max_cases=5,
                    report=lines.append, fails=fails)
    assert result["cases"] == 5
    assert [(f.arm, f.kind) for f in result["findings"]] == [(HOST_ARM, "stall"), ("baseline", "stall")]
    assert len(lines) == 2 and lines[0].startswith("host: stall: host stalls (") and "[known: " in lines[0]
    assert "[known" not in lines[1]
    for finding in result["findings"]:
        trace = load_trace(finding.path)
        strip = lambda requests: [(r.id, r.arrival, r.prompt_len, r.output_len, r.max_tokens) for r in requests]  # noqa: E731
        assert strip(trace.requests) == strip(finding.case.requests) and trace.engine_with() == finding.case.engine
        assert str(finding.path) in finding.line()


def test_arms_and_out_are_checked_before_anything_runs(tmp_path):
    assert _arms(None)[0] == HOST_ARM and "recommended" in _arms(None)
    assert _arms("host, baseline") == [HOST_ARM, "baseline"]
    with pytest.raises(SettingsError, match=r"^--arms: bad value 'host,nosuch'; allowed: .*recommended"):
        _arms("host,nosuch")
    assert _out_dir(str(tmp_path / "new")) == tmp_path / "new"
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    with pytest.raises(SettingsError, match="did not write"):
        _out_dir(str(tmp_path / "theirs"))
    claim_out_dir(str(tmp_path / "ours"), COMMAND)  # an earlier check's folder
    assert _out_dir(str(tmp_path / "ours")) == Path(tmp_path / "ours")
    with pytest.raises(SettingsError, match="an existing file"):
        _out_dir(str(tmp_path / "theirs" / "notes.txt"))

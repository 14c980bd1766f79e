"""The reach command (``python -m fdsched.replay.reach --quick``) on the host set up: a tiny grid of the shipped
azure-conv and pd-prefill windows.

Every shipped profile and the defaults come out ``ok`` (every host fix is ``auto`` in each); the prefill node with
the prefill fix ``off`` stalls exactly where the host's own ratio reservation reserves decode tokens on a prefill
node; and each before-the-fix cell is what :func:`fdsched.replay.check.failure_of` says of the same replay run here
without the command's own plumbing.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

SHIPPED = ("baseline", "adaptive", "recommended", "default")


@pytest.fixture(scope="module")
def quick(replay_host, tmp_path_factory):
    from fdsched.replay import reach

    out = tmp_path_factory.mktemp("reach")
    assert reach.main(["--quick", "--out", str(out)]) == 0
    (path,) = out.glob("reach-*.json")
    return json.loads(path.read_text(encoding="utf-8"))


def _row(results, trace):
    (row,) = [r for r in results["rows"] if r["trace"] == trace]
    return row


def test_the_quick_grid_covers_both_roles_and_every_arm(quick):
    from fdsched.replay.reach import ARMS, PD_ARMS, QUICK

    assert [r["trace"] for r in quick["rows"]] == list(QUICK.traces)
    assert list(_row(quick, "azure-conv")["cells"]) == [a.name for a in ARMS]
    assert list(_row(quick, "pd-prefill")["cells"]) == [a.name for a in PD_ARMS]
    for row in quick["rows"]:
        assert row["requests"] == QUICK.window and row["pool"] >= 2
        assert all(c["cell"] != "error" for c in row["cells"].values()), row["cells"]


def test_every_shipped_profile_and_the_defaults_are_ok(quick):
    for row in quick["rows"]:
        for arm, cell in row["cells"].items():
            if arm in SHIPPED:
                assert cell["cell"] == "ok", (row["trace"], arm, cell)


def test_the_prefill_node_stalls_before_the_fix_where_the_hosts_reservation_reserves(quick, replay_host):
    """The host's ratio reservation (new host) without its own prefill skip: the defaults with the fix off stall;
    where the plugin runs its own reservation (old host) they drain."""
    exposed = replay_host.has.get("ratio_reserve", False) and not replay_host.has.get("prefill_node_reserve")
    cell = _row(quick, "pd-prefill")["cells"]["default before the fix"]
    assert cell["cell"] == ("stall" if exposed else "ok"), cell


@pytest.mark.parametrize("trace_name, arm, env", [
    ("azure-conv", "baseline", {"FDSCHED_ONE_NODE_PER_BLOCK": "off", "FDSCHED_PREEMPTED_SEAT_RESUME": "off",
                                "FDSCHED_PREFILL_NODE_RESERVE": "off"}),
    ("pd-prefill", None, {"FDSCHED_PREFILL_NODE_RESERVE": "off"}),
])
def test_a_before_the_fix_cell_is_failure_of_the_same_replay(quick, monkeypatch, trace_name, arm, env):
    from fdsched.replay.check import Case, failure_of
    from fdsched.replay.reach import QUICK
    from fdsched.replay.runner import run_profile
    from fdsched.replay.tracefile import load_trace, resolve_trace

    row = _row(quick, trace_name)
    full = load_trace(resolve_trace(trace_name))
    trace = dataclasses.replace(full, requests=tuple(full.in_feed_order()[:QUICK.window]))
    engine = trace.engine_with({"max_num_seqs": row["seats"], "num_gpu_blocks": row["pool"]})
    monkeypatch.delenv("FDSCHED_PROFILE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = run_profile(trace, arm, dict(engine), max_steps=QUICK.max_steps, stall_steps=QUICK.stall_steps,
                      check_every=QUICK.check_every, inherit_env=True)
    found = failure_of(run, Case(dict(engine), trace.requests))
    column = "baseline before the fixes" if arm else "default before the fix"
    cell = row["cells"][column]
    assert (cell.get("kind"), cell.get("known")) == ((found[0], found[2]) if found else (None, None)), (cell, found)
    assert cell["steps"] == len(run.steps)

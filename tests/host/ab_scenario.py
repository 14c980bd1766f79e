"""Issue 11's done-when scenario as a process tree like the engine's (run by tests/host/test_dp_arms.py).

``python -m tests.host.ab_scenario SCRAPE_FILE`` with ``FD_PLUGINS=fdsched`` and ``FDSCHED_PROFILE_BY_DP_RANK`` set:
FastDeploy's own plugin loader installs the plugin from the environment; rank 0's scheduler is built in this
process, rank 1's in a child forked *after* that (as ``LLMEngine`` forks its data-parallel services); both run
the same KV-pressure workload at once; the host's own ``/metrics`` text (``get_filtered_metrics``: every
process's samples under ``PROMETHEUS_MULTIPROC_DIR``) is written to SCRAPE_FILE. Prints one JSON line: the arm
and the victim phases of each rank.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys


def _rank(rank: int, conn=None):
    from fdsched.replay.engine import EngineShape, build_manager, close_manager, logical_clock

    from .workloads import PREFILL_VICTIM_WORKLOAD, PRESSURE_SHAPE, drive_together, kv_pressure_requests

    manager = build_manager(EngineShape(**PRESSURE_SHAPE), dp_rank=rank, dp_size=2)
    return manager, lambda: _run(manager, rank, close_manager, logical_clock, drive_together,
                                 kv_pressure_requests(**PREFILL_VICTIM_WORKLOAD))


def _run(manager, rank, close_manager, logical_clock, drive_together, requests):
    try:
        with logical_clock():
            return {"arm": manager._fdsched_arm, "victims": drive_together({rank: manager}, requests)[rank]}
    finally:
        close_manager(manager)


def _child(conn):
    try:
        _, run = _rank(1)
        conn.send(run())
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send({"error": repr(exc)})
    finally:
        conn.close()
        os._exit(0)


def main(out: str) -> int:
    from fdsched.replay.engine import prepare_host_environment

    prepare_host_environment()
    from fdsched.install.probe import find_host

    find_host()  # an installed fastdeploy, FDSCHED_HOST_SOURCE, or the active `fdsched host setup` host
    from fastdeploy.plugins.model_register import load_model_register_plugins

    load_model_register_plugins()  # FD_PLUGINS=fdsched: the plugin's entry point installs from the environment
    from fdsched.install.installer import current

    report = current()
    assert report is not None and report.arms, "FD_PLUGINS=fdsched and FDSCHED_PROFILE_BY_DP_RANK must be set"
    _, run0 = _rank(0)  # rank 0's scheduler exists before the fork, as in the engine
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child,))
    proc.start()
    child.close()
    result0 = run0()
    result1 = parent.recv()
    proc.join(120)
    from fastdeploy.metrics.metrics import get_filtered_metrics

    with open(out, "w", encoding="utf-8") as fh:
        fh.write(get_filtered_metrics())
    print(json.dumps({"0": result0, "1": result1, "summary": report.summary()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

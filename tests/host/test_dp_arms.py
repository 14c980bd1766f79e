"""Online A/B in one deployment: one arm (profile) per data-parallel rank, against the real host classes.

The engine builds rank 0's scheduler in the api_server process and forks ranks 1..N-1 from it afterwards
(``engine.py``: ``multiprocessing.get_context("fork")``; ``ExpertService`` sets
``parallel_config.local_data_parallel_id`` before building its ``EngineService``). These tests build the
schedulers of two ranks both ways — side by side in one process, and rank 1 in a child forked after rank 0's
scheduler exists — and check that each runs its own arm, that the plugin's metrics keep the arms apart through
the host's own ``/metrics`` text, and that ``fdsched ab report`` reads that text.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest

from fdsched.core.metrics import METRICS, labels_of
from fdsched.patches.nonpolling_transfer import PollingReceiver, WaitingReceiver

from .workloads import PREFILL_VICTIM_WORKLOAD, PRESSURE_SHAPE, drive_together, kv_pressure_requests
ARMS = {0: "baseline", 1: "recommended"}


@pytest.fixture
def install_arms():
    from fdsched.install import installer
    from fdsched.core.settings import load_settings

    def _install(arms=ARMS, profile=None):
        METRICS.reset()
        return installer.install(
            load_settings(environ={}, profile=profile),
            arms={rank: load_settings(environ={}, profile=p) for rank, p in arms.items()},
        )

    yield _install
    installer.uninstall()


@pytest.fixture
def build():
    from fdsched.replay.engine import EngineShape, build_manager, close_manager

    built = []

    def _build(rank, **shape):
        manager = build_manager(EngineShape(**(shape or PRESSURE_SHAPE)), dp_rank=rank, dp_size=2)
        built.append(manager)
        return manager

    yield _build
    for manager in built:
        close_manager(manager)


def test_each_rank_runs_its_arm_side_by_side_in_one_process(install_arms, build, clock, host_info):
    report = install_arms()
    rm0, rm1, rm2 = build(0), build(1), build(2)  # rank 2 is not listed: the default arm (no profile)
    assert (rm0._fdsched_arm, rm1._fdsched_arm, rm2._fdsched_arm) == ("baseline", "recommended", "default")
    assert rm0._fdsched_impl == report.arms[0].impl and rm1._fdsched_impl == report.arms[1].impl
    assert labels_of(rm1) == {"arm": "recommended", "dp_rank": "1"} and rm2._fdsched_dp_rank == 2
    assert rm0._fdsched_impl["decode_only_preempt"] == ("off" if host_info.has["decode_only_preempt"] else "host")
    assert rm1._fdsched_impl["decode_only_preempt"] in ("host", "plugin")  # the change runs (whose version: the profile's)
    # Each prefix cache follows its own scheduler's rank.
    assert rm0.cache_manager._fdsched_arm == "baseline" and rm1.cache_manager._fdsched_arm == "recommended"
    assert rm0.cache_manager._fdsched_impl["deferred_recycle"] == "host"
    assert rm1.cache_manager._fdsched_impl["deferred_recycle"] == "plugin"
    # One scheduler class (what the host module names) keeps the single profile's decisions; each rank built the
    # strategies of its arm's row: baseline runs no reservation strategy, recommended the plugin's where it decides so.
    cls = report.classes["ResourceManagerV1"]
    assert cls._fdsched_impl == {cid: d.impl for cid, d in report.decisions.items()}
    assert type(rm0) is type(rm1) is type(rm2) is cls
    from fdsched.patches.ratio_reserve import BudgetedReserve

    for rm in (rm0, rm1):  # the plugin's reservation decides admissions where the arm runs its version or the old one
        budgeted = isinstance(rm.fdsched_strategy("ratio_reserve"), BudgetedReserve)
        assert budgeted == (rm._fdsched_impl["ratio_reserve"] != "host")
    assert type(rm0.fdsched_strategy("ratio_reserve")) is not type(rm1.fdsched_strategy("ratio_reserve"))
    # One cache manager class; each instance built its arm's strategies: baseline runs the host's own eviction.
    assert type(rm0.cache_manager) is type(rm1.cache_manager) is report.classes["PrefixCacheManager"]
    assert type(rm1.cache_manager._fdsched_recycle).__name__ == "DeferredRecycle"
    assert type(rm0.cache_manager._fdsched_recycle).__name__ == "HostCode"

    victims = drive_together({0: rm0, 1: rm1}, kv_pressure_requests(**PREFILL_VICTIM_WORKLOAD))
    assert "prefill" in victims[0], "rank 0 (baseline) preempts as the pre-change host does, prefills included"
    assert victims[1], "the workload must cause preemptions on rank 1 too"
    assert "prefill" not in victims[1], "rank 1 (recommended) never preempts a prefill"

    base, rec = METRICS.arm("baseline", 0), METRICS.arm("recommended", 1)
    assert base["preemptions_prefill"] == victims[0].count("prefill")
    assert rec["preemptions_prefill"] == 0 and rec["preemptions_decode"] == len(victims[1])
    assert base["requests_finished"] == rec["requests_finished"] == 24
    assert base["recomputed_tokens"] > 0
    latencies = METRICS.latencies[("recommended", "1")]
    assert all(ttft is not None and ttft >= 0 for ttft, _ in latencies)
    assert any(tpot is not None and tpot > 0 for _, tpot in latencies)


def test_engine_log_says_which_arm_each_rank_runs(install_arms, build, caplog):
    import logging

    install_arms()
    with caplog.at_level(logging.INFO):
        build(0)
        build(1)
    lines = [r.getMessage() for r in caplog.records if "data-parallel rank" in r.getMessage()]
    assert any(line.startswith("[fdsched] data-parallel rank 0 runs arm baseline:") for line in lines), lines
    assert any(line.startswith("[fdsched] data-parallel rank 1 runs arm recommended:") for line in lines), lines


def _child_rank(rank, conn):
    """A forked data-parallel rank: build this rank's scheduler, run the workload, report the victims."""
    try:
        from fdsched.replay.engine import close_manager, logical_clock

        from fdsched.replay.engine import EngineShape, build_manager

        manager = build_manager(EngineShape(**PRESSURE_SHAPE), dp_rank=rank, dp_size=2)
        try:
            with logical_clock():
                victims = drive_together({rank: manager}, kv_pressure_requests(**PREFILL_VICTIM_WORKLOAD))[rank]
            conn.send(("ok", manager._fdsched_arm, victims))
        finally:
            close_manager(manager)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", repr(exc), []))
    finally:
        conn.close()
        os._exit(0)


def _scrape():
    from fastdeploy.metrics.metrics import get_filtered_metrics

    return get_filtered_metrics()


def test_forked_rank_runs_its_arm_and_metrics_and_report_show_both(install_arms, build, clock):
    """As the engine does: rank 0's scheduler exists before rank 1 is forked; each runs its own arm, and the
    host's /metrics text (multi-process collection of every rank's samples) carries both arms apart."""
    from fdsched.cmdline.scrape import parse_exposition
    from fdsched.tools.abreport import format_report

    install_arms()
    before = _scrape()
    rm0 = build(0)  # built before the fork, as the engine builds rank 0 before it forks the others
    parent, child = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_child_rank, args=(1, child))
    proc.start()
    child.close()
    victims0 = drive_together({0: rm0}, kv_pressure_requests(**PREFILL_VICTIM_WORKLOAD))[0]
    status, arm1, victims1 = parent.recv()
    proc.join(60)
    assert status == "ok", arm1
    assert arm1 == "recommended"
    assert "prefill" in victims0
    assert victims1 and "prefill" not in victims1

    after = _scrape()
    assert 'fdsched_requests_finished_total{arm="baseline",dp_rank="0"}' in after
    assert 'fdsched_requests_finished_total{arm="recommended",dp_rank="1"}' in after
    assert 'fdsched_ttft_seconds_bucket{arm="recommended",dp_rank="1"' in after
    # The report over the window of this test (--since), on the host's own exposition.
    arms = parse_exposition(after)
    earlier = parse_exposition(before) if "arm=" in before else {}
    from fdsched.cmdline.scrape import ArmSeries

    window = {arm: series.minus(earlier.get(arm, ArmSeries())) for arm, series in arms.items()}
    assert window["recommended"].counter("fastdeploy:fdsched_requests_finished") == 24
    assert window["recommended"].counter("fastdeploy:fdsched_preemptions", victim_phase="prefill") == 0
    assert window["baseline"].counter("fastdeploy:fdsched_preemptions", victim_phase="prefill") == victims0.count(
        "prefill"
    )
    text = format_report({a: window[a] for a in ("baseline", "recommended")}, reference="baseline")
    assert "recommended/baseline" in text and "TTFT p50 (ms)" in text
    print(text)


def test_the_cache_queue_a_manager_builds_takes_the_managers_arm(install_arms, build):
    report = install_arms({0: "baseline", 1: "nonpolling_transfer"})
    rm1 = build(1)
    queue_cls = report.classes["EngineCacheQueue"]
    # The queue (built without a rank) has one class; its server's done lists wait because an arm's receiver does.
    assert queue_cls._fdsched_serves_waiting
    client, client0 = _unconnected_client(queue_cls), _unconnected_client(queue_cls)
    rm1.cache_manager.cache_task_queue = client  # what launch_cache_manager does
    assert type(client._fdsched_receiver) is WaitingReceiver
    assert client._fdsched_receiver.wait_seconds == rm1.cache_manager._fdsched_settings["tunables.transfer_wait_seconds"]
    rm0 = build(0)
    rm0.cache_manager.cache_task_queue = client0
    assert type(client0._fdsched_receiver) is PollingReceiver
    assert type(client0) is type(client) is queue_cls


def test_a_single_profile_class_has_no_arms_and_instances_match_the_class(install_arms, build):
    report = install_arms({}, profile="ratio_reserve")
    cls = report.classes["ResourceManagerV1"]
    rm = build(3)
    assert cls._fdsched_arms == {} and type(rm) is cls
    assert rm._fdsched_impl == cls._fdsched_impl and rm._fdsched_arm == "ratio_reserve"
    assert type(rm.cache_manager) is report.classes["PrefixCacheManager"] and rm.cache_manager._fdsched_arms == {}
    client = _unconnected_client(report.classes["EngineCacheQueue"])
    client._fdsched_receiver = before = object()
    rm.cache_manager.cache_task_queue = client  # no hand-over without arms: the client keeps what it chose
    assert client._fdsched_receiver is before


def _unconnected_client(queue_cls):
    """A client of ``queue_cls`` whose server's done list can wait (what its ``__init__`` finds connected to a
    server built with the plugin), without a server process."""
    from fdsched.patches.nonpolling_transfer import WaitableDoneList

    client = queue_cls.__new__(queue_cls)
    client.tansfer_done_queue = WaitableDoneList()
    return client


def test_an_arm_the_host_cannot_take_names_rank_and_profile_and_patches_nothing(tmp_path, host_info):
    import fastdeploy.engine.sched.resource_manager_v1 as rm_module

    from fdsched.install import installer
    from fdsched.install.installer import InstallError
    from fdsched.core.settings import SettingsError

    original = rm_module.ResourceManagerV1
    arm = tmp_path / "bad-arm.yaml"
    arm.write_text('changes: {deferred_recycle: "off"}\ntunables: {transfer_force_direct_recycle: 1}\n')
    env = dict(os.environ, FDSCHED_PROFILE_BY_DP_RANK=f"0=baseline,1={arm}")
    installer.uninstall()
    with pytest.raises(InstallError) as err:
        installer.install(environ=env)
    message = str(err.value)
    assert message.startswith(f"environment variable FDSCHED_PROFILE_BY_DP_RANK, rank 1 (profile bad-arm):")
    assert "FDSCHED_TRANSFER_FORCE_DIRECT_RECYCLE" in message and "allowed:" in message
    assert rm_module.ResourceManagerV1 is original and installer.current() is None

    env["FDSCHED_PROFILE_BY_DP_RANK"] = "0=baseline,1=nosuch"
    with pytest.raises(SettingsError, match=r"FDSCHED_PROFILE_BY_DP_RANK, rank 1: bad value 'nosuch'"):
        installer.install(environ=env)
    assert rm_module.ResourceManagerV1 is original and installer.current() is None


def test_arms_from_the_environment(build):
    from fdsched.install import installer

    env = dict(os.environ, FDSCHED_PROFILE_BY_DP_RANK="0=baseline,1=recommended", FDSCHED_PROFILE="ratio_reserve")
    installer.uninstall()
    try:
        report = installer.install(environ=env)
        assert {r: a.label for r, a in report.arms.items()} == {0: "baseline", 1: "recommended"}
        assert "dp rank 0: baseline, dp rank 1: recommended; other ranks: ratio_reserve" in report.summary()
        assert build(3)._fdsched_arm == "ratio_reserve"
    finally:
        installer.uninstall()


def test_done_when_one_deployment_through_fastdeploys_loader(tmp_path, capsys, host_info):
    """Issue 11, done when: FDSCHED_PROFILE_BY_DP_RANK=0=baseline,1=recommended, the plugin loaded by FastDeploy's
    own loader; rank 0 preempts as the pre-change host does (prefills too), rank 1 (forked after rank 0's
    scheduler exists) never preempts a prefill; the host's /metrics shows both arms; the report compares them."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from fdsched.tools.cli import main

    root = Path(__file__).resolve().parents[2]
    scrape = tmp_path / "metrics.prom"
    prom_dir = tmp_path / "prom"
    prom_dir.mkdir()
    env = dict(
        os.environ,
        FD_PLUGINS="fdsched",
        FDSCHED_PROFILE_BY_DP_RANK="0=baseline,1=recommended",
        PROMETHEUS_MULTIPROC_DIR=str(prom_dir),
        FD_LOG_DIR=str(tmp_path / "log"),
    )
    env.pop("FDSCHED_PROFILE", None)
    done = subprocess.run(
        [sys.executable, "-m", "tests.host.ab_scenario", str(scrape)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["0"]["arm"] == "baseline" and result["1"]["arm"] == "recommended", result
    assert "prefill" in result["0"]["victims"], result
    assert result["1"]["victims"] and "prefill" not in result["1"]["victims"], result
    assert "online A/B arms (FDSCHED_PROFILE_BY_DP_RANK): dp rank 0: baseline, dp rank 1: recommended" in result[
        "summary"]

    text = scrape.read_text()
    for arm, rank in (("baseline", 0), ("recommended", 1)):
        assert f'fastdeploy:fdsched_requests_finished_total{{arm="{arm}",dp_rank="{rank}"}} 24.0' in text
        assert f'fastdeploy:fdsched_ttft_seconds_count{{arm="{arm}",dp_rank="{rank}"}} 24.0' in text
    prefill0 = result["0"]["victims"].count("prefill")
    assert f'fastdeploy:fdsched_preemptions_total{{arm="baseline",dp_rank="0",victim_phase="prefill"}} {prefill0}.0' in text
    assert 'arm="recommended",dp_rank="1",victim_phase="prefill"' not in text

    capsys.readouterr()
    assert main(["ab", "report", str(scrape), "--reference", "baseline"]) == 0
    printed = capsys.readouterr().out
    assert "arms: baseline: dp_rank 0; recommended: dp_rank 1" in printed
    assert "recommended/baseline" in printed

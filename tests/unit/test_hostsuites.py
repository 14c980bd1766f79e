"""The host-suite harness's table and comparison (fdsched.tools.hostsuites), with plain run results. No host."""

from __future__ import annotations

import pytest

from fdsched.tools.hostsuites import (
    DEFAULT_RUN,
    NO_PLUGIN,
    HostSuiteError,
    RunResult,
    compare,
    load_expectations,
    run_names,
)
from fdsched.core.settings import shipped_profiles

TABLE = load_expectations()
PLUGIN_FAIL = "tests/v1/test_resource_manager_v1.py::TestResourceManagerV1Additional::test_trigger_preempt_records_tasks"


def test_runs_are_no_plugin_default_and_every_profile():
    assert run_names() == [NO_PLUGIN, DEFAULT_RUN] + list(shipped_profiles())


def test_table_entries_name_their_cause():
    assert TABLE.failures, "the table lists the known failures"
    for entry in TABLE.failures:
        assert entry.why
        if entry.cause == "plugin":
            assert isinstance(entry.upstream_pr, int)
            assert NO_PLUGIN not in entry.runs and "all" not in entry.runs
    plugin_caused = [e for e in TABLE.failures if e.cause == "plugin"]
    assert [(e.test, e.hosts, e.upstream_pr) for e in plugin_caused] == [(PLUGIN_FAIL, ("old",), 7783)]
    # the control set of the issue is in both hosts' suites; the transfer manager's only on the old host
    assert "tests/cache_manager/test_prefix_cache_manager.py" in TABLE.suites["old"]
    assert "tests/cache_manager/test_cache_transfer_manager.py" in TABLE.suites["old"]
    assert "tests/cache_manager/test_cache_transfer_manager.py" not in TABLE.suites["new"]


def test_plugin_caused_entries_list_exactly_the_runs_that_apply_their_change():
    """A new profile that switches the change on must be added to the entry (and one that does not, must not)."""
    from fdsched.core.settings import load_settings

    for entry in TABLE.failures:
        if entry.cause != "plugin":
            continue
        applying = []
        for run in run_names():
            if run == NO_PLUGIN:
                continue
            settings = load_settings(environ={}, profile=None if run == DEFAULT_RUN else run)
            # the hosts of these entries lack the change, so auto applies it as on does
            if settings.change_mode(entry.change) in ("auto", "on"):
                applying.append(run)
        assert sorted(entry.runs) == sorted(applying), (
            f"{entry.test}: runs {sorted(entry.runs)} but the runs that apply {entry.change} are {sorted(applying)}; "
            "update plugin/tools/host_suites.yaml"
        )


def _result(run, outcomes, host="old", installed=True, profile="same"):
    files = TABLE.suites[host]
    base = {f"{path}::test_x": "passed" for path in files}
    base.update(outcomes)
    install = {"installed": installed}
    if installed:
        install["profile"] = (None if run == DEFAULT_RUN else run) if profile == "same" else profile
    return RunResult(host, run, base, install, 1 if "failed" in base.values() else 0, 1.0)


def _expected_failures(host, run):
    return {node: "failed" for node in TABLE.expected_failures(host, run)}


def test_a_run_that_matches_has_no_problems():
    for run in ("recommended", "baseline"):
        result = _result(run, _expected_failures("old", run))
        assert compare(result, TABLE) == []
    assert compare(_result(NO_PLUGIN, _expected_failures("old", NO_PLUGIN), installed=False), TABLE) == []


def test_unexpected_failure_and_unexpected_pass_are_problems():
    outcomes = _expected_failures("old", "recommended")
    outcomes[PLUGIN_FAIL] = "passed"
    outcomes["tests/engine/test_resource_manager.py::test_other"] = "failed"
    problems = compare(_result("recommended", outcomes), TABLE)
    assert any(p.startswith("expected to fail (plugin, PR 7783) but passed") for p in problems)
    assert "unexpected failure: tests/engine/test_resource_manager.py::test_other" in problems


def test_the_plugin_failure_is_unexpected_under_baseline():
    outcomes = _expected_failures("old", "baseline")
    outcomes[PLUGIN_FAIL] = "failed"
    assert compare(_result("baseline", outcomes), TABLE) == [f"unexpected failure: {PLUGIN_FAIL}"]


def test_install_mismatches_are_problems():
    run = "recommended"
    assert "FastDeploy's loader did not install fdsched" in compare(_result(run, _expected_failures("old", run), installed=False), TABLE)[0]
    assert "expected 'recommended'" in compare(_result(run, _expected_failures("old", run), profile="baseline"), TABLE)[0]
    assert "although FD_PLUGINS was unset" in compare(_result(NO_PLUGIN, _expected_failures("old", NO_PLUGIN)), TABLE)[0]


def test_a_file_that_ran_nothing_is_a_problem():
    result = _result("baseline", _expected_failures("old", "baseline"))
    result.outcomes = {k: v for k, v in result.outcomes.items() if not k.startswith("tests/engine/test_common_engine.py")}
    assert "tests/engine/test_common_engine.py: no test ran" in compare(result, TABLE)


def test_bad_table_entries_are_named(tmp_path):
    text = open(__import__("fdsched.tools.hostsuites", fromlist=["x"]).EXPECTATIONS, encoding="utf-8").read()
    bad = text.replace("cause: plugin", "cause: sometimes", 1)
    path = tmp_path / "t.yaml"
    path.write_text(bad)
    with pytest.raises(HostSuiteError, match=r"expected_failures\[0\]\.cause: 'sometimes'; allowed: plugin, host"):
        load_expectations(path)
    path.write_text(text.replace("runs: [default, adaptive,", "runs: [default, nosuch,", 1))
    with pytest.raises(HostSuiteError, match=r"expected_failures\[0\]\.runs: \['nosuch'\]"):
        load_expectations(path)


def test_thread_leaking_files_run_in_their_own_process_leaking_tests_last():
    from fdsched.tools.hostsuites import _groups, load_expectations

    table = load_expectations()
    assert "tests/engine/test_common_engine.py" in table.own_process
    for host in ("old", "new"):
        groups = _groups(list(table.suites[host]), table)
        shared, _ = groups[0]
        assert "tests/engine/test_common_engine.py" not in shared
        assert (["tests/engine/test_common_engine.py"], table.own_process["tests/engine/test_common_engine.py"][1]) in groups
        assert sorted(f for files, _ in groups for f in files) == sorted(table.suites[host])  # every file, once


def test_no_retry_hides_a_failure():
    # the harness used to run an unexpected failure again alone and call it flaky when it passed: gone
    import fdsched.tools.hostsuites as hs

    assert not hasattr(hs, "UNEXPECTED")
    assert "flaky" not in (hs.run_and_compare.__doc__ or "").replace("No retry", "")


def test_the_pytest_plugin_moves_leaking_tests_last(monkeypatch):
    from types import SimpleNamespace

    from fdsched.tools import hostsuite_pytest

    items = [SimpleNamespace(nodeid=n) for n in ("f::a", "f::b", "f::c", "f::d")]
    monkeypatch.setenv(hostsuite_pytest.LAST_ENV, "f::b\nf::a")
    hostsuite_pytest.pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == ["f::c", "f::d", "f::b", "f::a"]


def test_own_process_entries_are_checked(tmp_path):
    from fdsched.tools.hostsuites import EXPECTATIONS, HostSuiteError, load_expectations

    text = EXPECTATIONS.read_text(encoding="utf-8").replace(
        "      - tests/engine/test_common_engine.py::TestCommonEngineAdditionalCoverage::test_launch_components_dp_mode",
        "      - tests/other.py::test_x", 1)
    bad = tmp_path / "t.yaml"
    bad.write_text(text, encoding="utf-8")
    with pytest.raises(HostSuiteError, match="leaking_tests"):
        load_expectations(bad)


def test_each_host_suite_process_gets_its_own_engine_queue_ports(tmp_path, monkeypatch):
    # the host's engine tests assert FD_ENGINE_QUEUE_PORT / FD_CACHE_QUEUE_PORT are free (default 6778 / 6779): a
    # fixed pair collides with any other process holding one of them
    import socket

    from fdsched.tools.hostsuites import _run_env

    monkeypatch.setenv("FD_ENGINE_QUEUE_PORT", "6778")
    first = _run_env("baseline", str(tmp_path / "r.json"), str(tmp_path / "a"))
    ports = [int(first["FD_ENGINE_QUEUE_PORT"]), int(first["FD_CACHE_QUEUE_PORT"])]
    assert ports[0] != ports[1] and 6778 not in ports
    for port in ports:  # free now: FastDeploy's own check (bind with SO_REUSEADDR) passes
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", port))


def test_sweep_removes_only_new_host_shm_files_that_no_process_holds(tmp_path):
    from fdsched.tools.hostsuites import _shm_names, sweep_new_shm

    (tmp_path / "fd_lock_gpu_cache_lock.1000").write_text("")  # there before the run: kept
    before = _shm_names(str(tmp_path))
    for name in ("fd_lock_gpu_cache_lock.2000", "fmq_ctrl_w2e_rank0_2001.ipc", "need_block_num_signal.2002",
                 "someone_elses_segment", "fd_lock_gpu_cache_lock.3000"):
        (tmp_path / name).write_text("")
    with open(tmp_path / "fd_lock_gpu_cache_lock.3000", encoding="utf-8"):  # held open by a live process: kept
        removed = sweep_new_shm(before, str(tmp_path))
    assert removed == ["fd_lock_gpu_cache_lock.2000", "fmq_ctrl_w2e_rank0_2001.ipc", "need_block_num_signal.2002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fd_lock_gpu_cache_lock.1000", "fd_lock_gpu_cache_lock.3000", "someone_elses_segment"]

"""The host-suite harness's table and comparison (fdsched.tools.hostsuites), with plain run results. No host."""

from __future__ import annotations

import os

import pytest

from fdsched.tools.hostsuites import (
    DEFAULT_RUN,
    NO_PLUGIN,
    SUITES,
    HostSuiteError,
    RunResult,
    altered_tests,
    compare,
    load_table,
    run_names,
    suite_files,
)
from fdsched.core.settings import shipped_profiles

TABLE = load_table()
ALTERED = "tests/v1/test_resource_manager_v1.py::TestResourceManagerV1Additional::test_trigger_preempt_records_tasks"
FILES = ["tests/a.py", "tests/b.py"]


def test_runs_are_no_plugin_default_and_every_profile_an_engine_runs_differently():
    from fdsched.core.settings import load_settings

    runs = run_names()
    assert runs[:2] == [NO_PLUGIN, DEFAULT_RUN] and "recommended" in runs and "baseline" in runs
    # oracle, unbounded and sglang-retract are recommended plus replay-only keys: the same classes in an engine
    assert not {"oracle", "unbounded", "sglang-retract"} & set(runs)
    engine_view = lambda name: {k: v for k, v in load_settings({}, profile=name).values.items()  # noqa: E731
                                if not k.startswith("replay.")}
    for name in ("oracle", "unbounded", "sglang-retract"):
        assert engine_view(name) == engine_view("recommended")
    assert sorted(runs[2:]) == sorted(set(runs[2:])) and set(runs[2:]) <= set(shipped_profiles())
    assert len(runs[2:]) == len({tuple(sorted(engine_view(r).items(), key=str)) for r in runs[2:]})


def test_suite_files_are_the_candidates_the_tree_has_less_exclusions(tmp_path):
    for path in ("tests/v1/test_resource_manager_v1.py", "tests/cache_manager/test_cache_transfer_manager.py",
                 "tests/engine/test_resource_manager_v1.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert suite_files(str(tmp_path), "old", TABLE) == [
        "tests/v1/test_resource_manager_v1.py", "tests/cache_manager/test_cache_transfer_manager.py"]
    # only_on: the transfer manager's file hangs on later hosts; an unknown commit (key None) does not run it
    assert suite_files(str(tmp_path), "new", TABLE) == ["tests/v1/test_resource_manager_v1.py"]
    assert suite_files(str(tmp_path), None, TABLE) == ["tests/v1/test_resource_manager_v1.py"]
    assert suite_files(str(tmp_path / "nothing"), None, TABLE) == []


def _result(run, outcomes, installed=True, profile="same", decisions=None, has=None):
    base = {f"{path}::test_x": "passed" for path in FILES}
    base[ALTERED] = "passed"
    base.update(outcomes)
    install = {"installed": installed}
    if installed:
        install["profile"] = (None if run == DEFAULT_RUN else run) if profile == "same" else profile
        install["decisions"] = decisions or {}
        install["has"] = has or {}
    return RunResult("old", run, base, install, 1 if "failed" in base.values() else 0, 1.0, files=list(FILES))


BASELINE = _result(NO_PLUGIN, {"tests/a.py::test_host_fails": "failed"}, installed=False)


def test_a_run_like_the_baseline_has_no_problems():
    assert compare(_result("recommended", {"tests/a.py::test_host_fails": "failed"}), BASELINE) == ([], {})
    assert compare(BASELINE, BASELINE) == ([], {})


def test_a_test_that_passes_without_the_plugin_and_fails_with_it_is_a_problem():
    problems, _ = compare(_result("baseline", {"tests/b.py::test_x": "failed"}), BASELINE)
    assert problems == ["passes without the plugin, failed with it: tests/b.py::test_x"]
    missing = _result("baseline", {})
    del missing.outcomes["tests/b.py::test_x"]
    assert "passes without the plugin, did not run with it: tests/b.py::test_x" in compare(missing, BASELINE)[0]


def test_the_problem_line_says_why_the_test_failed_when_the_run_recorded_it():
    failed = _result("baseline", {"tests/b.py::test_x": "failed"})
    failed.reasons = {"tests/b.py::test_x": "call: AssertionError: engine_worker_queue_port 20021 is already in use"}
    assert compare(failed, BASELINE)[0] == [
        "passes without the plugin, failed with it: tests/b.py::test_x "
        "(call: AssertionError: engine_worker_queue_port 20021 is already in use)"]


def test_a_failure_is_told_in_one_line_from_pytests_own_report(tmp_path):
    """failure_reason on real pytest reports (a pytest process of its own; the host-suite plugin itself needs a host,
    so a conftest hands each failed report to the same function): the failed phase and pytest's message."""
    import json
    import subprocess
    import sys

    from fdsched.tools.hostsuite_pytest import REASON_CHARS

    (tmp_path / "conftest.py").write_text(
        "import json, os\n"
        "from fdsched.tools.hostsuite_pytest import failure_reason\n"
        "seen = {}\n"
        "def pytest_runtest_logreport(report):\n"
        "    if report.failed:\n        seen.setdefault(report.nodeid, failure_reason(report))\n"
        "def pytest_sessionfinish(session):\n"
        "    with open(os.environ['REASONS_OUT'], 'w') as fh:\n        json.dump(seen, fh)\n")
    (tmp_path / "test_f.py").write_text(
        "import pytest\n"
        "@pytest.fixture\n"
        "def broken():\n    raise RuntimeError('port 20021\\n   in use')\n"
        "def test_call():\n    assert 1 == 2, 'x' * 1000\n"
        "def test_setup(broken):\n    pass\n"
        "def test_ok():\n    pass\n")
    out = tmp_path / "reasons.json"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_f.py"], cwd=tmp_path,
                   env={**os.environ, "REASONS_OUT": str(out)}, capture_output=True, check=False, timeout=120)
    reasons = json.loads(out.read_text())
    assert set(reasons) == {"test_f.py::test_call", "test_f.py::test_setup"}
    assert reasons["test_f.py::test_call"].startswith("call: AssertionError: xxx")
    assert len(reasons["test_f.py::test_call"]) == REASON_CHARS
    assert reasons["test_f.py::test_setup"] == "setup: RuntimeError: port 20021 in use"


def test_a_failure_the_host_has_without_the_plugin_is_not_judged():
    assert compare(_result("baseline", {"tests/a.py::test_host_fails": "failed"}), BASELINE)[0] == []


def test_a_declared_alteration_applies_only_where_the_change_runs_the_plugins_version_on_a_host_without_it():
    failing = {ALTERED: "failed"}
    applied = _result("recommended", failing, decisions={"decode_only_preempt": "plugin"}, has={"decode_only_preempt": False})
    problems, altered = compare(applied, BASELINE)
    assert problems == [] and list(altered) == [ALTERED] and "7783" in altered[ALTERED]
    for decisions, has in (({"decode_only_preempt": "host"}, {}), ({"decode_only_preempt": "plugin"}, {"decode_only_preempt": True})):
        problems, altered = compare(_result("recommended", failing, decisions=decisions, has=has), BASELINE)
        assert problems == [f"passes without the plugin, failed with it: {ALTERED}"] and altered == {}
    assert set(altered_tests({"decisions": {"decode_only_preempt": "plugin"}, "has": {}})) == {ALTERED}


def test_install_mismatches_are_problems():
    assert "FastDeploy's loader did not install fdsched" in compare(_result("recommended", {}, installed=False), BASELINE)[0][0]
    assert "expected 'recommended'" in compare(_result("recommended", {}, profile="baseline"), BASELINE)[0][0]
    assert "although FD_PLUGINS was unset" in compare(_result(NO_PLUGIN, {}), BASELINE)[0][0]


def test_a_refused_profile_is_its_one_line_not_a_failure():
    refused = RunResult("develop", "baseline", {}, {"installed": False, "refused": "[fdsched] ... cannot ..."}, 5, 1.0,
                        files=list(FILES))
    assert compare(refused, BASELINE) == ([], {})


def test_a_file_that_ran_nothing_is_a_problem():
    result = _result("baseline", {})
    result.outcomes = {k: v for k, v in result.outcomes.items() if not k.startswith("tests/b.py")}
    assert "tests/b.py: no test ran" in compare(result, BASELINE)[0]


def test_bad_table_entries_are_named(tmp_path):
    text = SUITES.read_text(encoding="utf-8")
    path = tmp_path / "t.yaml"
    path.write_text(text.replace("tests/cache_manager/test_cache_transfer_manager.py: [old]",
                                 "tests/nosuch.py: [old]", 1))
    with pytest.raises(HostSuiteError, match=r"only_on\.tests/nosuch\.py"):
        load_table(path)
    path.write_text("candidates: [not_tests/x.py]\n")
    with pytest.raises(HostSuiteError, match=r"candidates: \['not_tests/x.py'\]"):
        load_table(path)


def test_thread_leaking_files_run_in_their_own_process_leaking_tests_last():
    from fdsched.tools.hostsuites import _groups

    table = TABLE
    assert "tests/engine/test_common_engine.py" in table.own_process
    files = list(table.candidates)
    groups = _groups(files, table)
    shared, _ = groups[0]
    assert "tests/engine/test_common_engine.py" not in shared
    assert (["tests/engine/test_common_engine.py"], table.own_process["tests/engine/test_common_engine.py"][1]) in groups
    assert sorted(f for files_, _ in groups for f in files_) == sorted(files)  # every file, once


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
    text = SUITES.read_text(encoding="utf-8").replace(
        "      - tests/engine/test_common_engine.py::TestCommonEngineAdditionalCoverage::test_launch_components_dp_mode",
        "      - tests/other.py::test_x", 1)
    bad = tmp_path / "t.yaml"
    bad.write_text(text, encoding="utf-8")
    with pytest.raises(HostSuiteError, match="leaking_tests"):
        load_table(bad)


def test_each_host_suite_process_gets_its_own_engine_queue_ports(tmp_path, monkeypatch):
    # the host's engine tests assert FD_ENGINE_QUEUE_PORT / FD_CACHE_QUEUE_PORT are free (default 6778 / 6779), and
    # its DP tests use the port + 21 + rank: every port of both spans must be free, outside the kernel's ephemeral
    # range, and held from other fdsched stacks while the process runs
    import socket

    from fdsched.serve.ports import PortLease
    from fdsched.serve.config import PORT_RANGE
    from fdsched.tools.hostsuites import HOST_PORT_SPAN, _host_test_ports, _run_env

    monkeypatch.setenv("FD_ENGINE_QUEUE_PORT", "6778")
    with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="utf-8") as fh:
        ephemeral_low = int(fh.read().split()[0])
    with _host_test_ports() as ports:
        env = _run_env("baseline", str(tmp_path / "r.json"), str(tmp_path / "a"), ports)
        engine, cache = int(env["FD_ENGINE_QUEUE_PORT"]), int(env["FD_CACHE_QUEUE_PORT"])
        spans = [range(engine, engine + HOST_PORT_SPAN), range(cache, cache + HOST_PORT_SPAN)]
        assert not set(spans[0]) & set(spans[1]) and 6778 not in spans[0]
        assert HOST_PORT_SPAN > 22 and all(port < ephemeral_low for span in spans for port in span)
        assert not any(PORT_RANGE[0] <= port <= PORT_RANGE[1] for span in spans for port in span)  # not a stack's
        other = PortLease()
        assert other.take(engine + 21) is not None  # another process cannot take a port of the span meanwhile
        for span in spans:
            for port in span:  # free now: FastDeploy's own check (bind with SO_REUSEADDR) passes
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("0.0.0.0", port))
    assert other.take(engine + 21) is None  # released with the block
    other.release()


def test_host_suite_ports_skip_a_block_where_any_port_is_taken():
    import socket

    from fdsched.tools.hostsuites import HOST_PORT_SPAN, _host_test_ports

    with _host_test_ports() as (engine, _cache):
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("0.0.0.0", engine + 21))
        held.listen()
        for _attempt in range(20):
            with _host_test_ports() as (again, cache):
                assert engine + 21 not in range(again, again + HOST_PORT_SPAN)
                assert engine + 21 not in range(cache, cache + HOST_PORT_SPAN)


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

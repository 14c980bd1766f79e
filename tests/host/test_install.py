"""The spine against the real host: FastDeploy's loader installs us, rebinding, parity, uninstall, doctor."""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys

import pytest

RM_MODULE = "fastdeploy.engine.sched.resource_manager_v1"
PCM_MODULE = "fastdeploy.cache_manager.prefix_cache_manager"
IMPORT_SITES = {
    # module -> names it binds at import time (found by grepping both hosts' sources; develop's resource_manager no
    # longer binds PrefixCacheManager, so a name the module does not bind on this line is left out: _bound_sites)
    "fastdeploy.engine.common_engine": ("ResourceManagerV1",),
    "fastdeploy.engine.resource_manager": ("PrefixCacheManager",),
}


def _originals():
    from fdsched.install.probe import _original

    return (
        _original(importlib.import_module(RM_MODULE).ResourceManagerV1),
        _original(importlib.import_module(PCM_MODULE).PrefixCacheManager),
    )


@contextlib.contextmanager
def captured_llm_logger():
    """Every record FastDeploy's llm_logger handles while the block runs."""
    from fastdeploy.utils import llm_logger

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    llm_logger.addHandler(handler)
    try:
        yield records
    finally:
        llm_logger.removeHandler(handler)


@pytest.fixture
def fresh_loader(monkeypatch):
    """FastDeploy's own model-register plugin loader, as if this process had not loaded plugins yet."""
    from fastdeploy.plugins import model_register

    from fdsched.install import installer

    installer.uninstall()
    monkeypatch.setattr(model_register, "plugins_loaded", False)
    yield model_register.load_model_register_plugins
    installer.uninstall()


def _import_sites() -> dict:
    """module -> the names of IMPORT_SITES it binds on this line (the scheduler's engine site always)."""
    bound = {}
    for module, names in IMPORT_SITES.items():
        try:
            loaded = importlib.import_module(module)
        except Exception as exc:  # pragma: no cover - depends on the host's optional deps
            pytest.skip(f"cannot import {module} on this machine: {exc}")
        bound[module] = tuple(name for name in names if hasattr(loaded, name))
    assert bound["fastdeploy.engine.common_engine"] == ("ResourceManagerV1",)
    return bound


def test_fd_plugins_loader_installs_plugin_everywhere(fresh_loader, monkeypatch):
    sites = _import_sites()
    rm_host, pcm_host = _originals()
    monkeypatch.setenv("FD_PLUGINS", "fdsched")
    monkeypatch.setenv("FDSCHED_PROFILE", "baseline")
    with captured_llm_logger() as records:
        fresh_loader()

    from fdsched.install import installer

    report = installer.current()
    assert report is not None, "FastDeploy's loader did not call the fdsched entry point"
    rm_cls, pcm_cls = report.classes["ResourceManagerV1"], report.classes["PrefixCacheManager"]
    assert issubclass(rm_cls, rm_host) and rm_cls is not rm_host
    assert issubclass(pcm_cls, pcm_host) and pcm_cls is not pcm_host
    assert sys.modules[RM_MODULE].ResourceManagerV1 is rm_cls
    assert sys.modules[PCM_MODULE].PrefixCacheManager is pcm_cls
    for module, names in sites.items():
        for name in names:
            assert getattr(sys.modules[module], name) is report.classes[name], f"{module}.{name} not rebound"
    # One log line naming every change with its state.
    lines = [r.getMessage() for r in records if "[fdsched]" in r.getMessage() and "installed" in r.getMessage()]
    assert len(lines) == 1
    for change_id in report.decisions:
        assert f"{change_id}=" in lines[0]


def test_nothing_is_loaded_without_fd_plugins(fresh_loader, monkeypatch):
    monkeypatch.delenv("FD_PLUGINS", raising=False)
    rm_host, pcm_host = _originals()
    fresh_loader()
    from fdsched.install import installer

    assert installer.current() is None
    assert sys.modules[RM_MODULE].ResourceManagerV1 is rm_host
    assert sys.modules[PCM_MODULE].PrefixCacheManager is pcm_host


def test_entry_point_twice_changes_nothing(fresh_loader, monkeypatch):
    monkeypatch.setenv("FD_PLUGINS", "fdsched")
    fresh_loader()
    from fdsched.install import installer
    from fdsched.entry import register

    first = installer.current()
    bound = sys.modules[RM_MODULE].ResourceManagerV1
    register()
    assert installer.current() is first
    assert sys.modules[RM_MODULE].ResourceManagerV1 is bound


def test_bad_settings_raise_before_anything_is_patched(fresh_loader, monkeypatch):
    rm_host, pcm_host = _originals()
    monkeypatch.setenv("FD_PLUGINS", "fdsched")
    monkeypatch.setenv("FD_INIT_NEW_TOKEN_RATIO", "1.5")
    from fdsched.core.settings import SettingsError

    with pytest.raises(SettingsError, match="FD_INIT_NEW_TOKEN_RATIO"):
        fresh_loader()
    assert sys.modules[RM_MODULE].ResourceManagerV1 is rm_host
    assert sys.modules[PCM_MODULE].PrefixCacheManager is pcm_host


def test_uninstall_restores_every_site(install_profile):
    sites = _import_sites()
    rm_host, pcm_host = _originals()
    report = install_profile("recommended")
    assert report.sites["ResourceManagerV1"][0] == f"{RM_MODULE}.ResourceManagerV1"
    from fdsched.install import installer

    installer.uninstall()
    assert sys.modules[RM_MODULE].ResourceManagerV1 is rm_host
    assert sys.modules[PCM_MODULE].PrefixCacheManager is pcm_host
    for module, names in sites.items():
        for name in names:
            assert getattr(sys.modules[module], name) in (rm_host, pcm_host)


def test_manager_built_like_host_tests_is_plugin_subclass(install_profile, make_manager):
    report = install_profile("baseline")
    manager = make_manager(block_size=4, num_gpu_blocks=40, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    # the fixed classes (what the host modules name) build baseline's strategies, for rank 0
    assert type(manager) is report.classes["ResourceManagerV1"]
    assert type(manager.cache_manager) is report.classes["PrefixCacheManager"]
    assert isinstance(manager, report.classes["ResourceManagerV1"]) and manager._fdsched_arm == "baseline"


def _workload_fingerprint(make_manager):
    """Run a small KV-pressure workload through schedule(); return every observable decision."""
    from fdsched.replay.engine import logical_clock

    from .workloads import PRESSURE_SHAPE, fingerprint, kv_pressure_requests, run_workload

    with logical_clock():
        return fingerprint(run_workload(make_manager(**PRESSURE_SHAPE), kv_pressure_requests()))


def test_schedules_exactly_as_host_when_every_change_runs_host_code(install_profile, make_manager, host_info):
    """All changes resolving to the host's own code: identical decisions, step by step."""
    from fdsched.core.settings import CHANGE_IDS

    host_run = _workload_fingerprint(make_manager)
    # A change runs the host's code under `off` where the host lacks it (the old host: every change; the new
    # host: deferred_recycle and nonpolling_transfer) and under `auto` where the host has it (the new host's
    # decode_only_preempt, ratio_reserve and pd_prefill_cache; pd_prefill_cache in upstream's mode).
    switches = {f"FDSCHED_{cid.upper()}": "auto" if host_info.has[cid] else "off" for cid in CHANGE_IDS}
    report = install_profile(None, **switches, FDSCHED_PD_PREFILL_CACHE_MODE="upstream")
    assert {d.impl for d in report.decisions.values()} == {"host"}
    plugin_run = _workload_fingerprint(make_manager)
    assert plugin_run == host_run
    assert sum(len(step[4]) for step in host_run) > 0, "workload must exercise preemption"


def test_doctor_reports_what_the_host_has(host_info, capsys, monkeypatch):
    from fdsched.tools.cli import main

    monkeypatch.delenv("FDSCHED_PROFILE", raising=False)
    monkeypatch.setenv("FD_PLUGINS", "fdsched")
    assert main(["doctor"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "  !!  " not in out and captured.err == ""
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in host_info.has}
    assert set(rows) == set(host_info.has)
    expected = {
        # the old host (e7c8dc2) has none of the five, and without upstream's ratio reservation it cannot have the
        # prefill-node or the decode-node defect (those host fixes are not needed there); the new host (d38eeb8) has
        # 7783 and 7387
        "e7c8dc2fe940ba2f50d932f17b41eab555846ecb": {"prefill_node_reserve", "decode_node_reserve"},
        "d38eeb8334331b903fb34c9cd270ff0c58a48adf": {"decode_only_preempt", "ratio_reserve", "pd_prefill_cache"},
    }
    has = {cid for cid, value in host_info.has.items() if value}
    if host_info.commit in expected:
        assert has == expected[host_info.commit]
    # Both changes of PR 7783 come together with the split status enum.
    assert host_info.has["decode_only_preempt"] == host_info.has["ratio_reserve"] == host_info.split_status
    for cid, line in rows.items():
        assert (" yes " in line) == (cid in has), line


def test_doctor_exits_1_when_fd_plugins_does_not_name_the_plugin(host_info, capsys, monkeypatch):
    """The same host and settings: FD_PLUGINS unset or misspelt is a finding the operator must fix (the engine would
    never load the plugin), so doctor fails, saying so on stderr; named exactly, it passes."""
    from fdsched.tools.cli import main

    monkeypatch.delenv("FDSCHED_PROFILE", raising=False)
    for value in (None, "fdsched ", "fd_sched"):
        if value is None:
            monkeypatch.delenv("FD_PLUGINS", raising=False)
        else:
            monkeypatch.setenv("FD_PLUGINS", value)
        assert main(["doctor"]) == 1, value
        captured = capsys.readouterr()
        assert "  !!  FD_PLUGINS" in captured.out
        assert captured.err.strip().splitlines()[-1].startswith("fdsched doctor: error: 1 pre-flight finding to fix")
    monkeypatch.setenv("FD_PLUGINS", "fdsched")
    assert main(["doctor"]) == 0


def test_a_non_fork_start_method_is_warned_about(fresh_loader, monkeypatch):
    """Children started without fork do not inherit the plugin: the entry point says so at install."""
    import fdsched.entry

    monkeypatch.setenv("FD_PLUGINS", "fdsched")
    monkeypatch.setattr(fdsched.entry, "start_method", lambda: "forkserver")
    with captured_llm_logger() as records:
        fresh_loader()
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING and "start method" in r.getMessage()]
    assert len(warnings) == 1 and "forkserver" in warnings[0]


@pytest.mark.parametrize("profile, warned", [("oracle", True), ("recommended", False)])
def test_a_replay_only_profile_warns_when_an_engine_loads_it(fresh_loader, monkeypatch, profile, warned):
    monkeypatch.setenv("FD_PLUGINS", "fdsched")
    monkeypatch.setenv("FDSCHED_PROFILE", profile)
    with captured_llm_logger() as records:
        fresh_loader()
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING and "oracle_reserve" in r.getMessage()]
    assert len(warnings) == (1 if warned else 0)
    if warned:
        assert "profile oracle" in warnings[0] and "only the replay" in warnings[0]


def test_the_replay_does_not_warn_about_the_oracle_profile():
    from fdsched.replay.runner import run_profile
    from fdsched.replay.trace import Trace, TraceRequest

    engine = dict(block_size=4, max_model_len=64, num_gpu_blocks=20, max_num_seqs=2, max_num_batched_tokens=16)
    trace = Trace((TraceRequest(id="a", arrival=0, prompt_len=6, output_len=3, max_tokens=4, line=1),), engine,
                  source="test", name="test")
    with captured_llm_logger() as records:
        run = run_profile(trace, "oracle", trace.engine_with())
    assert run.drained
    assert not [r for r in records if "oracle_reserve" in r.getMessage()]


def test_relies_on_probes_notice_a_host_whose_control_flow_changed(host_info):
    """Each "Relies on:" probe fires on a host class whose methods no longer do what the patch relies on."""
    import dataclasses

    from fdsched.install.installer import InstallError, decide
    from fdsched.patches import spec_for
    from fdsched.core.settings import load_settings

    assert all(not failed for failed in host_info.reliance_problems.values()), host_info.reliance_problems

    class Changed(host_info.rm_class):
        def schedule(self):
            return [], []

        def _trigger_preempt(self, request, num_new_blocks, preempted_reqs, scheduled_reqs):
            return False

        def finish_requests(self, request_ids):
            return None

    changed = dataclasses.replace(host_info, host_classes={**host_info.host_classes, "ResourceManagerV1": Changed})
    failed = {cid: spec_for(cid).check_reliances(changed) for cid in host_info.has}
    assert {"running-chunk-check", "threshold-check", "finish-seam"} <= set(failed["ratio_reserve"])
    assert ("pass-end" in failed["ratio_reserve"]) == host_info.has["ratio_reserve"]  # only the new host uses it
    assert ("preempt-loop-seams" in failed["decode_only_preempt"]) == host_info.has["decode_only_preempt"]
    assert "record-moments" in failed["pd_prefill_cache"]
    changed.reliance_problems = failed
    with pytest.raises(InstallError, match="relies on running-chunk-check"):
        decide(load_settings(environ={"FDSCHED_RATIO_RESERVE": "on"}), changed)
    if not host_info.has["ratio_reserve"]:
        decision = decide(load_settings(environ={}), changed)["ratio_reserve"]
        assert decision.state == "skipped" and "relies on running-chunk-check" in decision.detail


@pytest.mark.parametrize("variable, value", [("FDSCHED_RATIO_RESERVE", "maybe"), ("FDSCHED_PROFILE", "nosuch")])
def test_a_bad_variable_in_an_engine_ends_it_with_one_line(tmp_path, variable, value):
    # FastDeploy's loader calls the entry point without a try: the process must end with our line, not a traceback
    import os
    import subprocess

    code = (
        "from fdsched.replay.engine import prepare_host_environment; prepare_host_environment()\n"
        "from fdsched.install.probe import find_host; find_host()\n"
        "from fastdeploy.plugins.model_register import load_model_register_plugins\n"
        "load_model_register_plugins()\n"
        "print('engine would start')\n"
    )
    env = dict(os.environ, FD_PLUGINS="fdsched", FD_LOG_DIR=str(tmp_path), **{variable: value})
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path,
                            timeout=600)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "engine would start" not in result.stdout
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("[fdsched] the engine does not start: ") and variable in last and repr(value) in last
    # the engine's own log has the line too
    logged = "".join(p.read_text(errors="replace") for p in tmp_path.glob("fastdeploy*.log*"))
    assert "[fdsched] the engine does not start" in logged


def test_generated_classes_say_where_they_come_from(host_info):
    """The classes the installer builds over the real host classes name their origin: each target's fixed class by its
    module, with the seam class and the host class as its bases."""
    from fdsched.core.hooks import Policies, make_plugin_manager
    from fdsched.core.settings import load_settings
    from fdsched.install.installer import _build, decide

    settings = load_settings(environ={}, profile="baseline")
    policies = Policies(make_plugin_manager(environ={}, load_entry_points=False))
    classes = _build(host_info, settings, decide(settings, host_info), policies)
    for target, module in (("ResourceManagerV1", "_scheduler"), ("PrefixCacheManager", "_prefix_cache"),
                           ("EngineCacheQueue", "_cache_queue")):
        fixed = classes[target]
        assert (fixed.__module__, fixed.__qualname__) == (f"fdsched.patches.{module}", target)
        assert fixed.__bases__[1] is host_info.host_classes[target]

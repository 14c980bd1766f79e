"""``fdsched doctor``'s pre-flight: FD_PLUGINS and what the host's loader does with it, settings the engine would
ignore, a per-rank list that does not match the ranks, and FDSCHED_* variables the plugin does not read."""

from __future__ import annotations

import textwrap

import pytest

from fdsched.tools.cli import main
from fdsched.tools.preflight import environment_lines, fd_plugins_line, known_variables, loader_when_unset

# Two loaders in the shapes FastDeploy's lines have (written here, not copied): 2.2 and earlier call every plugin
# when FD_PLUGINS is unset; 2.4 on return before loading any.
LOADER_ALL = """
def load_plugins_by_group(group):
    wanted = envs.FD_PLUGINS
    found = {}
    for entry in entry_points(group=group):
        if wanted is None or entry.name in wanted:
            found[entry.name] = entry.load()
    return found
"""
LOADER_NONE = """
def load_plugins_by_group(group):
    wanted = envs.FD_PLUGINS
    if wanted is None:
        log("set FD_PLUGINS")
        return {}
    return {e.name: e.load() for e in entry_points(group=group) if e.name in wanted}
"""


def _tree(tmp_path, text):
    (tmp_path / "fastdeploy" / "plugins").mkdir(parents=True)
    (tmp_path / "fastdeploy" / "plugins" / "utils.py").write_text(textwrap.dedent(text), encoding="utf-8")
    return str(tmp_path)


def test_the_loaders_behaviour_when_unset_is_read_from_the_hosts_source(tmp_path):
    assert loader_when_unset(_tree(tmp_path / "old", LOADER_ALL)) == "all"
    assert loader_when_unset(_tree(tmp_path / "new", LOADER_NONE)) == "none"
    assert loader_when_unset(str(tmp_path / "no-loader")) is None  # 2.0: no plugins/utils.py
    assert loader_when_unset(None) is None


@pytest.mark.parametrize("when,says", [("all", "calls every installed plugin, and fdsched does nothing"),
                                       ("none", "loads no plugin"), (None, "fdsched does nothing unless")])
def test_an_unset_fd_plugins_is_one_line_with_the_fix(when, says):
    ok, line = fd_plugins_line({}, when)
    assert not ok and line.startswith("FD_PLUGINS is unset: ") and says in line
    assert line.endswith("fix: export FD_PLUGINS=fdsched")


@pytest.mark.parametrize("value,ok,fix", [
    ("fdsched", True, None),
    ("other,fdsched", True, None),
    ("other, fdsched", False, "export FD_PLUGINS=other,fdsched"),  # FastDeploy keeps the space: ' fdsched'
    ("fdshed", False, "export FD_PLUGINS=fdsched"),
    ("FDSCHED", False, "export FD_PLUGINS=fdsched"),
    ("other", False, "export FD_PLUGINS=other,fdsched"),
    ("", False, "export FD_PLUGINS=fdsched"),
])
def test_fd_plugins_names_the_plugin_exactly_as_fastdeploy_compares(value, ok, fix):
    found, line = fd_plugins_line({"FD_PLUGINS": value}, "none")
    assert found is ok
    if fix:
        assert line.endswith("fix: " + fix), line


def test_settings_without_fd_plugins_ranks_and_unknown_variables_are_flagged():
    environ = {"FDSCHED_PROFILE": "adaptive", "FDSCHED_PROFILE_BY_DP_RANK": "0=baseline,2=recommended",
               "FDSCHED_RATIO_RESERV": "on", "FDSCHED_HOME": "/x", "FDSCHED_SERVE_STATE_DIR": "/y"}
    lines = environment_lines(environ, "none", ranks=2)
    assert [ok for ok, _ in lines] == [False] * 5
    texts = [line for _, line in lines]
    assert texts[1].startswith("FDSCHED_PROFILE, FDSCHED_PROFILE_BY_DP_RANK set, but FD_PLUGINS does not name")
    assert "rank 2, which does not exist with 2 data-parallel rank(s)" in texts[2]
    assert "gives rank 1 no arm: it runs FDSCHED_PROFILE (adaptive)" in texts[3]
    assert texts[4].startswith("FDSCHED_RATIO_RESERV is not a variable fdsched reads (did you mean "
                               "FDSCHED_RATIO_RESERVE?)")
    assert all("fix: " in text for text in texts)


def test_a_clean_environment_is_one_ok_line():
    environ = {"FD_PLUGINS": "fdsched", "FDSCHED_PROFILE_BY_DP_RANK": "0=baseline,1=adaptive", "FDSCHED_HOME": "/x"}
    assert [ok for ok, _ in environment_lines(environ, "none", ranks=2)] == [True]
    gap = {"FD_PLUGINS": "fdsched", "FDSCHED_PROFILE_BY_DP_RANK": "0=baseline,2=adaptive"}
    lines = environment_lines(gap, "none")  # without --dp: a gap in the ranks is still worth a line
    assert len(lines) == 2 and "names ranks 0, 2 but not 1" in lines[1][1] and "--dp N" in lines[1][1]


def test_every_documented_variable_is_known():
    assert {"FDSCHED_PROFILE", "FDSCHED_PROFILE_BY_DP_RANK", "FDSCHED_HOME", "FDSCHED_HOST_SOURCE",
            "FDSCHED_DISABLE_EXTERNAL_HOOKS", "FDSCHED_RATIO_RESERVE"} <= known_variables()


def test_doctor_prints_the_preflight_even_without_a_host(tmp_path, monkeypatch, capsys):
    for name in ("FD_PLUGINS", "FDSCHED_HOST_SOURCE", "FDSCHED_PROFILE", "FDSCHED_PROFILE_BY_DP_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FDSCHED_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FDSCHED_PROFILE", "baseline")
    import importlib.util

    if importlib.util.find_spec("fastdeploy") is not None:
        pytest.skip("FastDeploy is importable in this run")
    assert main(["doctor"]) == 2  # no host: 2 outranks the findings
    out = capsys.readouterr().out
    assert "profile: baseline" in out
    assert "  !!  FD_PLUGINS is unset: " in out
    assert "  !!  FDSCHED_PROFILE set, but FD_PLUGINS does not name fdsched" in out


def test_an_fd_variable_neither_the_host_nor_the_plugin_reads_is_flagged(tmp_path):
    from fdsched.tools.preflight import host_variables

    (tmp_path / "fastdeploy" / "engine").mkdir(parents=True)
    (tmp_path / "fastdeploy" / "envs.py").write_text('table = {"FD_LOG_DIR": 1, \'FD_MAX_STOP_SEQS_NUM\': 2}\n',
                                                      encoding="utf-8")
    (tmp_path / "fastdeploy" / "engine" / "x.py").write_text('os.getenv("FD_ENABLE_MAX_PREFILL")\n', encoding="utf-8")
    read = host_variables(str(tmp_path))
    assert read == {"FD_LOG_DIR", "FD_MAX_STOP_SEQS_NUM", "FD_ENABLE_MAX_PREFILL"}
    assert host_variables(str(tmp_path / "none")) is None
    environ = {"FD_PLUGINS": "fdsched", "FD_LOG_DIR": "/x", "FD_ENABLE_MAX_PREFIL": "1",
               "FD_INIT_NEW_TOKEN_RATIO": "0.5"}  # the last one: a setting the plugin reads on any host
    lines = environment_lines(environ, "none", read_by_host=read | {"FD_PLUGINS"})
    assert [line for _, line in lines[1:]] == [
        "FD_ENABLE_MAX_PREFIL is set, but neither this FastDeploy nor fdsched reads it (did you mean "
        "FD_ENABLE_MAX_PREFILL?); fix: rename or unset it"]
    assert len(environment_lines(environ, "none")) == 1  # no host tree read: nothing said about FD_* names


@pytest.fixture
def fake_host(monkeypatch):
    """doctor over a stand-in host: the probe and the installer's decision replaced, so only the pre-flight counts."""
    from types import SimpleNamespace

    import fdsched.install.installer
    from fdsched.tools import cli

    info = SimpleNamespace(label="FastDeploy (stand-in)", support="a stand-in", split_status=False, location=None,
                           has={})
    monkeypatch.setattr(cli, "_probe_quietly", lambda args: (info, None, ""))
    monkeypatch.setattr(fdsched.install.installer, "decide", lambda settings, host: {})
    for name in ("FD_PLUGINS", "FDSCHED_PROFILE", "FDSCHED_PROFILE_BY_DP_RANK"):
        monkeypatch.delenv(name, raising=False)
    return info


@pytest.mark.parametrize("env, code, findings", [
    ({"FD_PLUGINS": "fdsched"}, 0, 0),
    ({"FD_PLUGINS": "fdsched", "FDSCHED_PROFILE": "adaptive"}, 0, 0),
    ({}, 1, 1),                                                    # FD_PLUGINS unset: the engine never loads it
    ({"FD_PLUGINS": "FDSCHED"}, 1, 1),                             # not the name FastDeploy compares
    ({"FDSCHED_PROFILE": "adaptive"}, 1, 2),                       # ... and a setting the engine would ignore
    ({"FD_PLUGINS": "fdsched", "FDSCHED_PROFILE_BY_DP_RANK": "0=baseline,2=adaptive"}, 1, 1),  # rank 1 skipped
])
def test_doctor_exits_1_on_a_preflight_finding_and_0_when_there_is_none(fake_host, monkeypatch, capsys, env, code,
                                                                        findings):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["doctor"]) == code
    captured = capsys.readouterr()
    assert captured.out.count("\n  !!  ") == findings
    err = captured.err.strip().splitlines()
    if findings:
        assert err == [f"fdsched doctor: error: {findings} pre-flight finding{'s' if findings > 1 else ''} to fix "
                       "(the lines marked !! above)"]
    else:
        assert err == []


def test_doctor_without_a_host_exits_2_with_one_error_line_even_with_findings(tmp_path, monkeypatch, capsys):
    import importlib.util

    if importlib.util.find_spec("fastdeploy") is not None:
        pytest.skip("FastDeploy is importable in this run")
    monkeypatch.delenv("FD_PLUGINS", raising=False)
    monkeypatch.setenv("FDSCHED_HOST_SOURCE", str(tmp_path / "nowhere"))
    assert main(["doctor"]) == 2
    captured = capsys.readouterr()
    assert "  !!  FD_PLUGINS is unset: " in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fdsched doctor: error: host not found: ")


@pytest.mark.parametrize("status, findings, code", [(0, 0, 0), (0, 3, 1), (1, 0, 1), (1, 2, 1), (2, 0, 2), (2, 1, 2)])
def test_doctor_status_no_host_first_then_any_error_or_finding(status, findings, code):
    from fdsched.tools.cli import doctor_status

    assert doctor_status(status, findings) == code

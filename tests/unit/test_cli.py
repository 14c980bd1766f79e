"""fdsched.tools.cli: `fdsched profiles` and `fdsched doctor` without a host."""

from __future__ import annotations

import importlib.util

import sys

import pytest

from fdsched import __version__
from fdsched.tools.cli import EXIT_ERROR, EXIT_NO_HOST, EXIT_OK, main
from fdsched.install.probe import HOST_SOURCE_ENV
from fdsched.core.settings import CHANGE_IDS, PROFILE_ENV, shipped_profiles


@pytest.fixture
def no_host(monkeypatch):
    monkeypatch.delenv(HOST_SOURCE_ENV, raising=False)
    if "fastdeploy" in sys.modules or importlib.util.find_spec("fastdeploy") is not None:
        pytest.skip("FastDeploy is importable in this run; the no-host path is checked where it is not (CI)")


def test_profiles_lists_every_shipped_profile(capsys):
    assert main(["profiles"]) == EXIT_OK
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in shipped_profiles():
        assert any(line.startswith(name + " ") for line in lines), name
        assert f"\n{name}: " in out  # its description
    rows = {line.split()[0]: line for line in lines if line and line.split()[0] in shipped_profiles()}
    assert "all off" in rows["baseline"] and "(the reference)" in rows["baseline"]
    # what each profile sets unlike baseline: the four "all on" profiles are told apart
    assert rows["recommended"].split()[1:] == ["all", "on", "-"]
    assert "tunables.reserve_estimator=adaptive" in rows["adaptive"]
    assert "replay.oracle_reserve=1" in rows["oracle"]
    assert "ratio_reserve=on, rest off" in rows["ratio_reserve"]
    assert PROFILE_ENV in out


def test_profiles_ignores_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("FDSCHED_RATIO_RESERVE", "maybe")  # would be an error for load_settings()
    assert main(["profiles"]) == EXIT_OK
    assert "recommended" in capsys.readouterr().out


def test_profiles_shows_one(capsys):
    assert main(["profiles", "oracle"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("# ")
    assert str(shipped_profiles()["oracle"]) in out
    assert "oracle_reserve: true" in out


def test_profiles_checks_a_yaml_path(capsys, tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text('changes: {ratio_reserve: "on"}\ntunables: {reserve_estimator: adaptive}\n', encoding="utf-8")
    assert main(["profiles", str(good)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "checked: ok" in out and "ratio_reserve=on, rest auto" in out and "reserve_estimator=adaptive" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("changes: {ratio_reserve: maybe}\n", encoding="utf-8")
    assert main(["profiles", str(bad)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "changes.ratio_reserve" in err and "'maybe'" in err and len(err.strip().splitlines()) == 1
    assert main(["profiles", str(tmp_path)]) == EXIT_ERROR
    assert "a directory" in capsys.readouterr().err


def test_profiles_unknown_name(capsys):
    assert main(["profiles", "nosuch"]) == EXIT_ERROR
    captured = capsys.readouterr()
    assert "'nosuch'" in captured.err
    for name in shipped_profiles():
        assert name in captured.err
    assert captured.out == ""


def test_doctor_without_a_host(capsys, no_host):
    assert main(["doctor"]) == EXIT_NO_HOST
    captured = capsys.readouterr()
    out = captured.out
    assert f"fdsched {__version__}" in out
    assert "profile: default" in out
    assert "fdsched doctor: error: host not found: " in captured.err and "not found" not in out  # errors: stderr
    assert HOST_SOURCE_ENV in captured.err  # how to point at a host
    for change_id in CHANGE_IDS:
        assert change_id in out
    assert "effective settings:" in out
    assert "env " not in out  # nothing came from the environment


def test_doctor_without_a_host_shows_the_selected_profile(capsys, monkeypatch, no_host):
    monkeypatch.setenv(PROFILE_ENV, "recommended")
    assert main(["doctor"]) == EXIT_NO_HOST
    out = capsys.readouterr().out
    assert "profile: recommended (" in out
    assert "profile recommended" in out  # as a source in the settings table


def test_doctor_with_a_bad_env_value(capsys, monkeypatch, no_host):
    monkeypatch.setenv("FDSCHED_RATIO_RESERVE", "maybe")
    assert main(["doctor"]) == EXIT_ERROR
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("fdsched doctor: error: settings: ") and "error" not in captured.out
    assert "FDSCHED_RATIO_RESERVE" in err
    assert "'maybe'" in err
    assert "one of auto, on, off" in err
    assert "host:" not in captured.out + err  # stops before looking for a host


def test_doctor_with_an_unknown_profile(capsys, monkeypatch, no_host):
    monkeypatch.setenv(PROFILE_ENV, "nosuch")
    assert main(["doctor"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert PROFILE_ENV in err and "'nosuch'" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2


def test_patches_shows_each_specs_prose_to_operators(capsys):
    from fdsched.patches import CATALOGUE, TARGETS

    assert main(["patches"]) == EXIT_OK
    out = capsys.readouterr().out
    for spec in CATALOGUE:
        assert f"{spec.change_id}: {spec.title}" in out
        for text in (spec.why, spec.how, spec.hosts_needing, spec.delete_when, spec.switch):
            assert text in out, (spec.change_id, text)
        for name in spec.replaces:
            target, method = name.split(".", 1)
            assert f"{TARGETS[target]}.{method}" in out
        for reliance in spec.relies_on:
            assert f"{reliance.name} ({'/'.join(reliance.when)}): {reliance.text}" in out


def test_patches_shows_one_change_or_names_the_allowed_ones(capsys):
    assert main(["patches", "ratio_reserve"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("ratio_reserve: ") and "deferred_recycle:" not in out
    assert "PrefixCacheManager.can_allocate_gpu_blocks" in out
    assert main(["patches", "nosuch"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "'nosuch'" in err and all(change_id in err for change_id in CHANGE_IDS)


def test_doctor_reports_the_reservation_estimator_live_or_what_it_would_use():
    from fdsched.core.adaptive import AdaptiveReserve
    from fdsched.tools.cli import _adaptive_report
    from fdsched.core.settings import load_settings

    assert "ratio (upstream" in _adaptive_report(load_settings(environ={}, profile="recommended"), None)
    would = _adaptive_report(load_settings(environ={}, profile="adaptive"), None)
    assert "no scheduler in this process" in would and "after 16 of them" in would and "k=-2.0" in would

    from fdsched.core.adaptive import track_live

    live = AdaptiveReserve(min_samples=2)  # what a live plugin scheduler registers (fdsched.core.adaptive.track_live)
    for length in (10, 30, 50):
        live.observe_finished(None, length)
    track_live(live)
    report = _adaptive_report(load_settings(environ={}, profile="adaptive"), None)
    assert "1 scheduler(s) in this process" in report
    assert "unbounded: 3 samples" in report and "learned" in report and "bounded: 0 samples" in report


def test_an_error_no_command_expected_is_one_line_with_its_traceback_kept(tmp_path, monkeypatch, capsys):
    from fdsched.tools import cli

    monkeypatch.setenv("FDSCHED_HOME", str(tmp_path))

    def broken(args):
        raise AttributeError("type object 'X' has no attribute 'y'")

    args = cli.build_parser().parse_args(["patches"])
    args.func = broken  # a command whose code meets something it never expected
    monkeypatch.setattr(cli, "build_parser", lambda: type("P", (), {"parse_args": lambda self, argv: args})())
    assert cli.main([]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fdsched patches: error: AttributeError: type object 'X'")
    log = tmp_path / "logs" / "last-error.log"
    assert str(log) in err[0] and "Traceback (most recent call last)" in log.read_text(encoding="utf-8")

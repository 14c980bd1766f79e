"""`fdsched host setup` / `list` / `use`: archive checks, errors, the registry. No host.

The archives here are tiny tar.gz files made by the tests: they exercise the set-up's own handling
(unpacking, checksums, errors, what is recorded). Whether a real FastDeploy archive sets up and runs
is checked by CI, which sets up both supported hosts with this same code.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import tarfile

import pytest

from fdsched.tools import hostarchive, hostsetup
from fdsched.tools.cli import main
from fdsched.tools.hostsetup import HostSetupError, recorded_host_path, recorded_hosts, setup_host, use_host

COMMIT = "d38eeb8334331b903fb34c9cd270ff0c58a48adf"
MODULES = ("fastdeploy/__init__.py",) + hostsetup.HOST_MODULES


def make_archive(path, top=f"FastDeploy-{COMMIT}", files=MODULES, sums=True):
    with tarfile.open(path, "w:gz") as tar:
        for name in files:
            data = b"# placeholder\n"
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    if sums:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        (path.parent / "SHA256SUMS").write_text(f"{digest}  {path.name}\n")
    return path


def _nothing_left(home):
    hosts = home / "hosts"
    assert not (home / "hosts.json").exists()
    assert not hosts.exists() or os.listdir(hosts) == []


@pytest.fixture
def home(tmp_path, monkeypatch):
    path = tmp_path / "home"
    monkeypatch.setenv(hostsetup.HOME_ENV, str(path))
    return path


def test_setup_unpacks_checks_and_records(tmp_path, home):
    archive = make_archive(tmp_path / f"FastDeploy-{COMMIT}.tar.gz")
    record = setup_host(str(archive), install_deps=False)
    tree = home / "hosts" / COMMIT
    assert record["commit"] == COMMIT and record["key"] == "new" and record["path"] == str(tree)
    assert (tree / "fastdeploy" / "engine" / "sched" / "resource_manager_v1.py").is_file()
    assert (tree / hostsetup.MARKER).read_text().strip() == COMMIT
    active, hosts = recorded_hosts()
    assert active == COMMIT and set(hosts) == {COMMIT}
    assert recorded_host_path() == str(tree)
    assert [p.name for p in (home / "hosts").iterdir()] == [COMMIT]  # no scratch left behind


def test_setup_again_replaces_the_tree(tmp_path, home):
    archive = make_archive(tmp_path / f"FastDeploy-{COMMIT}.tar.gz")
    setup_host(str(archive), install_deps=False)
    stale = home / "hosts" / COMMIT / "stale.txt"
    stale.write_text("x")
    setup_host(str(archive), install_deps=False)
    assert not stale.exists()


def test_corrupt_archive_is_one_error_and_nothing_is_recorded(tmp_path, home):
    archive = make_archive(tmp_path / f"FastDeploy-{COMMIT}.tar.gz", sums=False)
    archive.write_bytes(archive.read_bytes()[:60])  # truncated
    with pytest.raises(HostSetupError, match="truncated or corrupt.*fetch it again"):
        setup_host(str(archive), install_deps=False)
    _nothing_left(home)


def test_checksum_mismatch_names_the_sums_file(tmp_path, home):
    archive = make_archive(tmp_path / f"FastDeploy-{COMMIT}.tar.gz")
    (tmp_path / "SHA256SUMS").write_text(f"{'0' * 64}  {archive.name}\n")
    with pytest.raises(HostSetupError, match="does not match .*SHA256SUMS"):
        setup_host(str(archive), install_deps=False)
    _nothing_left(home)


def test_tree_without_fastdeploy_names_what_is_missing(tmp_path, home):
    archive = make_archive(tmp_path / f"FastDeploy-{COMMIT}.tar.gz", files=("README.md",))
    with pytest.raises(HostSetupError) as err:
        setup_host(str(archive), install_deps=False)
    assert "fastdeploy/engine/sched/resource_manager_v1.py" in str(err.value)
    assert "fastdeploy/__init__.py" in str(err.value)
    _nothing_left(home)


def test_a_python_without_extraction_filters_still_refuses_in_one_line(tmp_path, home, monkeypatch):
    """Python 3.11.3 and older (3.10.11 and older) have no ``tarfile.FilterError``: a refused archive still ends in
    the one-line refusal, not in an AttributeError from the handler that names the filters' error."""
    import importlib

    monkeypatch.delattr(tarfile, "FilterError", raising=False)
    older = importlib.reload(hostsetup)
    try:
        archive = make_archive(tmp_path / f"FastDeploy-{COMMIT}.tar.gz", files=("README.md",))
        with pytest.raises(HostSetupError, match="the tree has no"):
            older.setup_host(str(archive), install_deps=False)
        _nothing_left(home)
    finally:
        monkeypatch.undo()
        importlib.reload(hostsetup)


def test_directory_or_missing_file_as_archive(tmp_path, home):
    with pytest.raises(HostSetupError, match="is a directory"):
        setup_host(str(tmp_path), install_deps=False)
    with pytest.raises(HostSetupError, match="does not exist"):
        setup_host(str(tmp_path / "nope.tar.gz"), install_deps=False)
    _nothing_left(home)


def test_unknown_commit_needs_commit_option(tmp_path, home):
    archive = make_archive(tmp_path / "fd.tar.gz", top="FastDeploy-main", sums=False)
    with pytest.raises(HostSetupError, match="pass --commit"):
        setup_host(str(archive), install_deps=False)
    record = setup_host(str(archive), commit="abcdef1234567", install_deps=False)
    assert record["key"] is None and recorded_hosts()[0] == "abcdef1234567"


def test_commit_option_must_match_the_archive(tmp_path, home):
    archive = make_archive(tmp_path / f"FastDeploy-{COMMIT}.tar.gz")
    with pytest.raises(HostSetupError, match="does not match the archive"):
        setup_host(str(archive), commit="e7c8dc2", install_deps=False)
    _nothing_left(home)


def test_no_network_says_to_pass_an_offline_archive(home):
    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(HostSetupError) as err:
        setup_host(f"http://127.0.0.1:{port}/FastDeploy.tar.gz", install_deps=False)
    assert "cannot download" in str(err.value) and "--archive" in str(err.value)
    _nothing_left(home)


def test_failing_pip_is_one_error_and_nothing_is_recorded(tmp_path, home, monkeypatch):
    archive = make_archive(tmp_path / f"FastDeploy-{COMMIT}.tar.gz")
    broken = tmp_path / "req.txt"
    broken.write_text(f"{tmp_path / 'no-such-package-dir'}\n")  # pip fails at once, no network needed
    monkeypatch.setattr(hostsetup, "REQUIREMENTS", broken)
    with pytest.raises(HostSetupError) as err:
        setup_host(str(archive), install_deps=True)
    assert "pip failed" in str(err.value) and str(broken) in str(err.value)
    _nothing_left(home)


def test_failing_import_check_records_nothing(tmp_path, home):
    archive = make_archive(tmp_path / f"FastDeploy-{COMMIT}.tar.gz", sums=False)
    # a tree whose scheduler module raises at import
    with tarfile.open(archive, "w:gz") as tar:
        for name in MODULES:
            data = b"raise ImportError('needs paddle')\n" if name.endswith("resource_manager_v1.py") else b""
            info = tarfile.TarInfo(f"FastDeploy-{COMMIT}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(HostSetupError, match="do not import"):
        setup_host(str(archive), install_deps=False)
    _nothing_left(home)


def test_use_and_list(tmp_path, home, capsys):
    old = "e7c8dc2fe940ba2f50d932f17b41eab555846ecb"
    for commit in (old, COMMIT):
        (tmp_path / commit).mkdir()
        setup_host(str(make_archive(tmp_path / commit / f"FastDeploy-{commit}.tar.gz", top=f"FastDeploy-{commit}")), install_deps=False)
    assert recorded_hosts()[0] == COMMIT
    assert use_host("old") == old and recorded_hosts()[0] == old
    assert use_host("d38eeb8") == COMMIT
    with pytest.raises(HostSetupError, match="is not set up"):
        use_host("1234567")
    assert main(["host", "list"]) == 0
    out = capsys.readouterr().out
    assert "* " in out and "d38eeb833" in out and "e7c8dc2fe" in out and "old" in out and "new" in out
    assert main(["host", "use", "nope"]) == 1
    assert "is not set up" in capsys.readouterr().err


def test_list_with_nothing_set_up(home, capsys):
    assert main(["host", "list"]) == 0
    assert "no host set up; run: fdsched host setup" in capsys.readouterr().out


def test_broken_registry_is_named(home, capsys):
    home.mkdir(parents=True)
    (home / "hosts.json").write_text("{not json")
    assert main(["host", "list"]) == 1
    assert "hosts.json is not readable JSON" in capsys.readouterr().err
    assert recorded_host_path() is None  # find_host falls through to "not found", not a traceback


def test_cli_setup_error_exit_code(tmp_path, home, capsys):
    assert main(["host", "setup", "--archive", str(tmp_path / "missing.tar.gz"), "--no-deps"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fdsched host setup: error:") and "does not exist" in err


def test_registry_is_json_with_the_record(tmp_path, home):
    setup_host(str(make_archive(tmp_path / f"FastDeploy-{COMMIT}.tar.gz")), install_deps=False)
    data = json.loads((home / "hosts.json").read_text())
    assert data["active"] == COMMIT
    assert data["hosts"][COMMIT]["sha256"] == hashlib.sha256((tmp_path / f"FastDeploy-{COMMIT}.tar.gz").read_bytes()).hexdigest()


def test_optional_requirements_follow_the_hosts_own_requirements(tmp_path):
    """A line whose requirements.txt names an optional package gets fdsched's pinned CPU one; others get nothing."""
    from fdsched.tools.hostsetup import _requirement_name, optional_requirements

    assert _requirement_name("opentelemetry_Exporter.otlp[x]>=1.2 ; python_version>'3'") == "opentelemetry-exporter-otlp"
    assert _requirement_name("# comment") is None and _requirement_name("-r other.txt") is None
    table = tmp_path / "table.txt"
    table.write_text("# comment\nfoo-bar -> foo-bar-cpu==1.0\nbaz -> baz==2\n", encoding="utf-8")
    tree = tmp_path / "tree"
    tree.mkdir()
    assert optional_requirements(tree, table) == []  # no requirements.txt at all
    (tree / "requirements.txt").write_text("numpy\nFoo_Bar>=0.1\n", encoding="utf-8")
    assert optional_requirements(tree, table) == ["foo-bar-cpu==1.0"]


def test_use_of_a_host_not_set_up_names_the_archive_that_sets_it_up(tmp_path):
    """`fdsched host use old` before the old host is set up suggests the command that sets up the old host (plain
    `fdsched host setup` would set up the new one)."""
    import pytest

    from fdsched.tools.hostsetup import HostSetupError, use_host

    with pytest.raises(HostSetupError) as info:
        use_host("old", environ={"FDSCHED_HOME": str(tmp_path)})
    assert "archive/e7c8dc2fe940ba2f50d932f17b41eab555846ecb.tar.gz" in str(info.value)
    with pytest.raises(HostSetupError) as info:
        use_host("0123abc", environ={"FDSCHED_HOME": str(tmp_path)})
    assert "--archive FastDeploy-<commit>.tar.gz" in str(info.value)


def _no_download(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("set-up tried to download")

    monkeypatch.setattr(hostarchive.urllib.request, "urlopen", refuse)


def test_setup_without_archive_takes_the_pinned_archive_from_the_current_folder(tmp_path, home, monkeypatch, capsys):
    """The quick start's `fdsched host setup` works offline unchanged once the archive sits in the folder."""
    _no_download(monkeypatch)
    folder = tmp_path / "checkout"
    folder.mkdir()
    make_archive(folder / f"FastDeploy-{hostsetup.DEFAULT_COMMIT}.tar.gz")
    monkeypatch.chdir(folder)
    assert hostsetup.DEFAULT_COMMIT == COMMIT
    record = setup_host(install_deps=False)
    assert record["commit"] == COMMIT and record["archive"] == str(folder / f"FastDeploy-{COMMIT}.tar.gz")
    assert "found in this folder (no download)" in capsys.readouterr().out
    assert main(["host", "setup", "--no-deps", "--commit", COMMIT[:9]]) == 0  # a prefix finds it too


def test_local_archive_needs_exactly_one_full_name(tmp_path):
    assert hostsetup.local_archive(COMMIT, tmp_path) is None
    make_archive(tmp_path / f"FastDeploy-{COMMIT}.tar.gz", sums=False)
    assert hostsetup.local_archive(COMMIT, tmp_path) == str(tmp_path / f"FastDeploy-{COMMIT}.tar.gz")
    assert hostsetup.local_archive(COMMIT[:7], tmp_path) == str(tmp_path / f"FastDeploy-{COMMIT}.tar.gz")
    assert hostsetup.local_archive("new", tmp_path) is None  # not a commit
    other = COMMIT[:7] + "0" * 33
    make_archive(tmp_path / f"FastDeploy-{other}.tar.gz", top=f"FastDeploy-{other}", sums=False)
    assert hostsetup.local_archive(COMMIT[:7], tmp_path) is None  # two match the prefix: neither is guessed
    assert hostsetup.local_archive(COMMIT, tmp_path) == str(tmp_path / f"FastDeploy-{COMMIT}.tar.gz")


def test_a_failed_download_of_the_pinned_archive_names_the_file_to_put_here(tmp_path, home, monkeypatch):
    def offline(*args, **kwargs):
        raise hostarchive.urllib.error.URLError("no network")

    monkeypatch.setattr(hostarchive.urllib.request, "urlopen", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HostSetupError) as err:
        setup_host(install_deps=False)
    text = str(err.value)
    assert text.startswith(f"cannot download {hostsetup.PUBLIC_ARCHIVE.format(commit=COMMIT)}: no network")
    assert f"as FastDeploy-{COMMIT}.tar.gz and run the same command again" in text and "--archive" in text
    _nothing_left(home)

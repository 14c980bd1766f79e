"""``fdsched host setup``: a CPU FastDeploy host, one command away, for the replay, doctor, bench and tests.

FastDeploy (``fastdeploy-gpu``) is not installable from the package registries, but its scheduler and
prefix-cache classes are plain Python and run on a CPU with the CPU ``paddlepaddle`` wheel. Setting up
a host means:

1. take a FastDeploy source archive (``--archive PATH_OR_URL``; by default ``FastDeploy-<commit>.tar.gz`` in
   the current folder, else the public archive of the pinned commit, downloaded over HTTPS), check it (a readable tar.gz, one top folder holding
   ``fastdeploy/`` with the two scheduler modules, the checksum in a ``SHA256SUMS`` file beside a local
   archive when there is one);
2. unpack it into the per-user cache (``$FDSCHED_HOME``, else ``$XDG_CACHE_HOME/fdsched``, else
   ``~/.cache/fdsched``) under ``hosts/<commit>/``;
3. install the host's CPU Python dependencies into the current environment from the pinned
   requirements file shipped with fdsched (``host-requirements-cpu.txt``; ``paddleformers`` without its
   dependencies, as the host's CPU use needs);
4. check that the two host modules import, and only then record the host as the active one in
   ``hosts.json``.

Any step that fails raises :class:`HostSetupError` naming what failed and the next step; nothing is
recorded then, and a tree unpacked by this call is removed. :func:`recorded_host_path` is what
:func:`fdsched.install.probe.find_host` consults when neither an installed ``fastdeploy`` nor
``FDSCHED_HOST_SOURCE`` is there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from fdsched.core.common import EXIT_ERROR, EXIT_OK, text_table
from fdsched.tools.hostarchive import (  # noqa: F401  (archive_name, local_archive, HOST_MODULES: named here too)
    HOST_MODULES, archive_name, check_checksum, fetch_archive, local_archive, say, unpack_archive,
)
from fdsched.install.hosts import (  # noqa: F401  (defined with the probe; the CLI and tests name them here)
    DEFAULT_COMMIT, HOME_ENV, KNOWN_HOSTS, MARKER, REGISTRY, HostSetupError, KnownHost, _read_registry, cache_dir,
    host_key, known_host, recorded_host_path, recorded_hosts,
)

__all__ = [
    "KNOWN_HOSTS",
    "DEFAULT_COMMIT",
    "HostSetupError",
    "cache_dir",
    "setup_host",
    "archive_name",
    "local_archive",
    "recorded_hosts",
    "recorded_host_path",
    "use_host",
    "host_key",
    "known_host",
]

REQUIREMENTS = Path(__file__).with_name("host-requirements-cpu.txt")
OPTIONAL_REQUIREMENTS = Path(__file__).with_name("host-requirements-optional.txt")
NO_DEPS_REQUIREMENTS = ("paddleformers==1.1.1",)  # its own dependency list pulls GPU packages; the host needs none of them
PUBLIC_ARCHIVE = "https://github.com/gongshaotian/FastDeploy/archive/{commit}.tar.gz"


# ---- the registry -----------------------------------------------------------------------------------


def _write_registry(root: Path, data: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".hosts-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
    os.replace(tmp, root / REGISTRY)


def use_host(commit: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """Make a recorded host (a commit or a unique prefix, or old/new) the active one; return its commit."""
    root = cache_dir(environ)
    data = _read_registry(root)
    wanted = commit.lower()
    matches = [c for c in data["hosts"] if c.startswith(wanted) or host_key(c) == wanted]
    if len(matches) != 1:
        have = ", ".join(f"{c[:9]} ({host_key(c) or 'unknown commit'})" for c in data["hosts"]) or "none"
        named = next((h for h in KNOWN_HOSTS.values() if h.key == wanted or h.commit.startswith(wanted)), None)
        how = (f"fdsched host setup --archive {PUBLIC_ARCHIVE.format(commit=named.commit)}" if named and not matches
               else "fdsched host setup --archive FastDeploy-<commit>.tar.gz")
        raise HostSetupError(
            f"host {commit!r} {'is ambiguous' if matches else 'is not set up'}; set up: {have}; allowed: a set-up "
            f"commit (or a unique prefix of it) or its short name (old, new, develop, 2.5, ...); set it up with: {how}"
        )
    data["active"] = matches[0]
    _write_registry(root, data)
    return matches[0]


# ---- the steps ---------------------------------------------------------------------------------------


def _pip(args: list, what: str) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args]
    say(f"installing {what}: {' '.join(command[2:])}")
    result = subprocess.run(command)
    if result.returncode != 0:
        raise HostSetupError(
            f"pip failed (exit {result.returncode}) installing {what}: {' '.join(command)}; "
            "check the network to the package index and that this is Python 3.10-3.12, then run setup again"
        )


def _requirement_name(line: str) -> Optional[str]:
    """The normalised project name of one requirements.txt line (``Foo_Bar[x]>=1`` -> ``foo-bar``), or None."""
    line = line.split("#", 1)[0].strip()
    match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)", line)
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() if match and not line.startswith("-") else None


def optional_requirements(tree: Path, table: Path = OPTIONAL_REQUIREMENTS) -> list:
    """What fdsched installs for this host beyond its CPU list: the table's packages whose host name the host's own
    requirements.txt lists (derived from the host, so a line that does not need them does not get them)."""
    host_file = tree / "requirements.txt"
    if not host_file.is_file():
        return []
    wanted = {_requirement_name(line) for line in host_file.read_text(encoding="utf-8", errors="replace").splitlines()}
    found = []
    for line in table.read_text(encoding="utf-8").splitlines():
        if "->" not in line or line.lstrip().startswith("#"):
            continue
        name, package = (part.strip() for part in line.split("->", 1))
        if _requirement_name(name) in wanted:
            found.append(package)
    return found


def _check_imports(tree: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("ENABLE_V1_KVCACHE_SCHEDULER", "1")
    scratch = tempfile.mkdtemp(prefix="fdsched-setup-")
    env.setdefault("PROMETHEUS_MULTIPROC_DIR", scratch)
    env.setdefault("FD_LOG_DIR", scratch)
    code = "import fastdeploy.engine.sched.resource_manager_v1, fastdeploy.cache_manager.prefix_cache_manager"
    try:
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        missing = re.search(r"No module named '([^']+)'", result.stderr)
        if missing:
            raise HostSetupError(
                f"the host's scheduler modules do not import from {tree}: it imports {missing.group(1)}, which "
                "fdsched's CPU dependency lists do not install; install the package that provides it into this "
                f"environment ({sys.executable} -m pip install ...), then run `fdsched host setup --no-deps` with "
                "the same archive"
            )
        tail = "\n".join(lines[-5:])
        raise HostSetupError(
            f"the host's scheduler modules do not import from {tree}:\n{tail}\n"
            "if the error names a missing package, install it into this environment and run setup again with --no-deps; "
            "otherwise check the archive"
        )


def _default_archive(commit: Optional[str]) -> tuple:
    """No ``--archive``: (the archive of ``commit`` (default: the pinned one) found in this folder, else its public
    URL; the commit; what to do without network when it is the URL, else None)."""
    commit = commit or DEFAULT_COMMIT
    archive = local_archive(commit)
    if archive is not None:
        say(f"using {archive}, found in this folder (no download)")
        return archive, commit, None
    archive = PUBLIC_ARCHIVE.format(commit=commit)
    return archive, commit, (f"without network, copy {archive} here as {archive_name(commit)} and run the same "
                             "command again, or pass it with --archive /path/to/FastDeploy-<commit>.tar.gz")


def _install_dependencies(tree: Path) -> None:
    """The host's CPU dependencies into this environment: the pinned file, the no-deps packages, and what the host's
    own requirements.txt adds."""
    _pip(["-r", str(REQUIREMENTS)], f"the host's CPU dependencies ({REQUIREMENTS.name}, about 1 GB: a minute or two)")
    _pip(["--no-deps", *NO_DEPS_REQUIREMENTS], "packages taken without their dependencies")
    extra = optional_requirements(tree)
    if extra:
        _pip(extra, "what this host's own requirements.txt adds (host-requirements-optional.txt)")


def setup_host(
    archive: Optional[str] = None,
    commit: Optional[str] = None,
    install_deps: bool = True,
    environ: Optional[Mapping[str, str]] = None,
) -> dict:
    """Set up a host; return its record. See the module docstring for the steps."""
    root = cache_dir(environ)
    hosts_dir = root / "hosts"
    hosts_dir.mkdir(parents=True, exist_ok=True)
    offline_hint = None
    if archive is None:
        archive, commit, offline_hint = _default_archive(commit)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=".setup-", dir=hosts_dir))
    placed: Optional[Path] = None
    try:
        local = fetch_archive(archive, work, offline_hint)
        digest = check_checksum(local, archive)
        tree, named = unpack_archive(local, archive, work / "tree")
        if commit and named and not named.startswith(commit.lower()):
            raise HostSetupError(f"--commit {commit} does not match the archive's folder {tree.name}; allowed: {named}")
        full = named or (commit or "").lower()
        if not re.fullmatch(r"[0-9a-f]{7,40}", full or ""):
            raise HostSetupError(
                f"{archive}: the commit is unknown (top folder {tree.name!r} is not FastDeploy-<40-hex commit>); "
                "pass --commit <hash>"
            )
        known = host_key(full)
        if known is None:
            say(f"warning: commit {full} is not a supported host ({', '.join(c[:9] for c in KNOWN_HOSTS)}); setting it up anyway")
        (tree / MARKER).write_text(full + "\n", encoding="utf-8")
        if install_deps:
            _install_dependencies(tree)
        _check_imports(tree)
        final = hosts_dir / full
        if final.exists():
            shutil.rmtree(final)
        os.replace(tree, final)
        placed = final
        data = _read_registry(root)
        record = {
            "commit": full,
            "key": known,
            "path": str(final),
            "archive": archive,
            "sha256": digest,
            "python": sys.executable,
            "set_up": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        data["hosts"][full] = record
        data["active"] = full
        _write_registry(root, data)
        placed = None  # recorded: keep it
        say(f"host {full[:9]} ({known or 'unsupported'}) ready at {final} in {time.monotonic() - started:.0f} s")
        return record
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if placed is not None:  # unpacked but not recorded: leave nothing behind
            shutil.rmtree(placed, ignore_errors=True)


# ---- CLI ------------------------------------------------------------------------------------------
def add_commands(sub) -> None:
    host = sub.add_parser("host", help="set up and list CPU FastDeploy hosts (for replay, doctor, bench, tests)")
    host_sub = host.add_subparsers(dest="host_command", required=True)
    setup = host_sub.add_parser("setup", help="unpack a FastDeploy source archive, install its CPU dependencies, record it")
    setup.add_argument(
        "--archive",
        help="a FastDeploy source .tar.gz (path or http(s) URL); default: FastDeploy-<commit>.tar.gz in the current "
             "folder if it is there, else the public archive of --commit, downloaded",
    )
    setup.add_argument(
        "--commit",
        help="which commit (default: d38eeb8 when --archive is not given; else read from the archive)",
    )
    setup.add_argument("--no-deps", action="store_true", help="do not pip-install the host's dependencies (they are there)")
    setup.set_defaults(func=cmd_setup)
    listing = host_sub.add_parser("list", help="the hosts set up for this user (* = active)")
    listing.set_defaults(func=cmd_list)
    use = host_sub.add_parser("use", help="make a set-up host the active one")
    use.add_argument("commit", help="a commit (or unique prefix), or old / new")
    use.set_defaults(func=cmd_use)
    from fdsched.tools import hostsuite_cli, support

    hostsuite_cli.add_command(host_sub)
    support.add_command(host_sub)


def cmd_setup(args) -> int:
    try:
        record = setup_host(args.archive, args.commit, install_deps=not args.no_deps)
    except HostSetupError as exc:
        print(f"fdsched host setup: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"active host: {record['commit']} ({record['key'] or 'unsupported'}) at {record['path']}")
    try:
        _, hosts = recorded_hosts()
    except HostSetupError:
        hosts = {}
    others = [f"{host_key(c) or c[:9]}" for c in sorted(hosts) if c != record["commit"]]
    if others:
        print(f"(it is now the active one; also set up: {', '.join(others)}; switch with: fdsched host use "
              f"{others[0]}, list with: fdsched host list)")
    else:
        print("(the active one; set up another with --archive and switch with: fdsched host use old|new|<commit>)")
    return EXIT_OK


def cmd_list(args) -> int:
    try:
        active, hosts = recorded_hosts()
    except HostSetupError as exc:
        print(f"fdsched host list: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"cache: {cache_dir()}")
    if not hosts:
        print("no host set up; run: fdsched host setup   (or --archive /path/to/FastDeploy-<commit>.tar.gz offline)")
        return EXIT_OK
    rows = []
    for commit, record in sorted(hosts.items(), key=lambda kv: kv[1].get("set_up", "")):
        present = os.path.isdir(record.get("path", ""))
        known = known_host(commit)
        rows.append(
            (
                "*" if commit == active else "",
                commit[:9],
                known.key if known else "unsupported",
                known.what if known else "-",
                record.get("path", "") if present else f"{record.get('path', '')} (MISSING)",
                record.get("set_up", ""),
            )
        )
    print(text_table(rows, ("", "commit", "host", "what", "path", "set up")))
    return EXIT_OK


def cmd_use(args) -> int:
    try:
        commit = use_host(args.commit)
    except HostSetupError as exc:
        print(f"fdsched host use: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"active host: {commit}")
    return EXIT_OK

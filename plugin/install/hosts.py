"""The supported hosts, and the hosts set up for this user: what the probe needs to name and find a host.

Read-only: ``fdsched host setup`` (:mod:`fdsched.tools.hostsetup`) writes the registry read here. Loaded in engine
processes through the probe, so it imports no tooling.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

__all__ = ["HOME_ENV", "MARKER", "REGISTRY", "KnownHost", "KNOWN_HOSTS", "DEFAULT_COMMIT", "HostSetupError", "known_host", "host_key", "cache_dir", "recorded_hosts", "recorded_host_path"]


HOME_ENV = "FDSCHED_HOME"
MARKER = "FDSCHED_HOST_COMMIT"  # written into a set-up tree: fdsched.install.probe reads the commit from it
REGISTRY = "hosts.json"


@dataclass(frozen=True)
class KnownHost:
    key: str  # short name (old / new for the two fully tested 2.6 commits; else the line)
    commit: str
    what: str
    line: str = ""  # the upstream line the commit belongs to
    tier: str = "full"  # what CI runs on it: full (unit, host, engine tiers) / compat (set-up, doctor, suites, replay)


# Every commit the project's CI runs (see .ci/run and docs/host.md's support table). A commit not listed here is an
# "unknown commit": the plugin still probes it and applies only what fits, and says that nobody tested it.
KNOWN_HOSTS = {
    host.commit: host
    for host in (
        KnownHost("old", "e7c8dc2fe940ba2f50d932f17b41eab555846ecb", "FastDeploy 2.6 before PR 7387 and PR 7783", "2.6"),
        KnownHost("new", "d38eeb8334331b903fb34c9cd270ff0c58a48adf", "FastDeploy 2.6 with PR 7387 and PR 7783", "2.6"),
        KnownHost("2.6-head", "7198b5883a0ebdc85b91a455aa07d0856911c9a7", "FastDeploy 2.6 branch head", "2.6", "compat"),
        KnownHost("develop", "c1b7c083da606ed7f3ac35c2f905dc904f1163b2", "FastDeploy develop", "develop", "compat"),
        KnownHost("2.5", "e9e128cdf23f0cf7e5bb63b5435edb70b2d0c116", "FastDeploy 2.5", "2.5", "compat"),
        KnownHost("2.4", "f83673daac0a495afe239bc31d43a3f3398fb035", "FastDeploy 2.4", "2.4", "compat"),
        KnownHost("2.2", "b3031d232428972a677f49454a4564e7e54c08c1", "FastDeploy 2.2", "2.2", "compat"),
        KnownHost("2.0", "fd91da7b41cfa15c49cc4500e93f978ae7343812", "FastDeploy 2.0 (no V1 scheduler: refused)", "2.0",
                  "refused"),
    )
}


DEFAULT_COMMIT = "d38eeb8334331b903fb34c9cd270ff0c58a48adf"


class HostSetupError(RuntimeError):
    """A step of ``fdsched host setup`` failed; the message names it and the next step."""


def known_host(commit: Optional[str]) -> Optional[KnownHost]:
    """The supported host of ``commit`` (a full hash or a prefix of at least 7), else None."""
    if not commit or len(commit) < 7:
        return None
    for full, host in KNOWN_HOSTS.items():
        if full.startswith(commit.lower()):
            return host
    return None


def host_key(commit: Optional[str]) -> Optional[str]:
    """The short name of a commit CI runs (``old``, ``new``, ``develop``, ``2.5``, ...; a full hash or a prefix of
    at least 7), else None."""
    host = known_host(commit)
    return host.key if host else None


def cache_dir(environ: Optional[Mapping[str, str]] = None) -> Path:
    environ = os.environ if environ is None else environ
    if environ.get(HOME_ENV):
        return Path(environ[HOME_ENV]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fdsched"


def _read_registry(root: Path) -> dict:
    path = root / REGISTRY
    if not path.is_file():
        return {"active": None, "hosts": {}}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HostSetupError(f"{path} is not readable JSON ({exc}); remove it and run `fdsched host setup` again") from exc
    if not isinstance(data, dict) or not isinstance(data.get("hosts"), dict):
        raise HostSetupError(f"{path} is not an fdsched host registry; remove it and run `fdsched host setup` again")
    return data


def recorded_hosts(environ: Optional[Mapping[str, str]] = None) -> tuple:
    """(active commit or None, {commit: record}) of the hosts set up for this user."""
    data = _read_registry(cache_dir(environ))
    return data.get("active"), dict(data["hosts"])


def recorded_host_path(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The source tree of the active recorded host, if it is still there."""
    try:
        active, hosts = recorded_hosts(environ)
    except HostSetupError:
        return None
    record = hosts.get(active or "")
    if not record:
        return None
    path = record.get("path", "")
    return path if os.path.isfile(os.path.join(path, "fastdeploy", "__init__.py")) else None

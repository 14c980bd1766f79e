"""A FastDeploy source archive for ``fdsched host setup`` (:mod:`fdsched.tools.hostsetup`): found beside the
command or downloaded, checked (a readable tar.gz, one top folder, the checksum in a ``SHA256SUMS`` file beside a
local archive) and unpacked member by member, refusing what would land outside the tree."""

from __future__ import annotations

import gzip
import hashlib
import lzma
import os
import re
import shutil
import tarfile
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import Optional

from fdsched.install.hosts import HostSetupError

# What a FastDeploy tree must hold (checked in the archive before it is unpacked)
HOST_MODULES = (
    "fastdeploy/engine/sched/resource_manager_v1.py",
    "fastdeploy/cache_manager/prefix_cache_manager.py",
)


def say(message: str) -> None:
    print(f"fdsched host setup: {message}", flush=True)


def archive_name(commit: str) -> str:
    """The file name GitHub gives a commit's source archive (and CI's archives have): ``FastDeploy-<commit>.tar.gz``."""
    return f"FastDeploy-{commit}.tar.gz"


def local_archive(commit: str, folder: Optional[Path] = None) -> Optional[str]:
    """The archive of ``commit`` (a full hash or a prefix) in ``folder`` (default: the current one), when exactly one
    file there is named ``FastDeploy-<commit...>.tar.gz``: what ``fdsched host setup`` without ``--archive`` takes
    before it downloads anything, so the quick start's command works offline unchanged."""
    folder = Path.cwd() if folder is None else folder
    if not re.fullmatch(r"[0-9a-fA-F]{7,40}", commit or ""):
        return None
    found = sorted(p for p in folder.glob(f"FastDeploy-{commit.lower()}*.tar.gz")
                   if re.fullmatch(r"FastDeploy-[0-9a-f]{40}\.tar\.gz", p.name) and p.is_file())
    return str(found[0]) if len(found) == 1 else None


def fetch_archive(archive: str, workdir: Path, offline_hint: Optional[str] = None) -> Path:
    """A local path for ``archive`` (a path, or an http(s) URL downloaded into ``workdir``); ``offline_hint``: what
    to do without network, when the default archive was being downloaded."""
    if re.match(r"^https?://", archive):
        target = workdir / "archive.tar.gz"
        say(f"downloading {archive}")
        try:
            with urllib.request.urlopen(archive, timeout=60) as response, open(target, "wb") as out:
                shutil.copyfileobj(response, out)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise HostSetupError(
                f"cannot download {archive}: {reason}; "
                + (offline_hint or "without network, pass an offline copy: fdsched host setup --archive "
                                   "/path/to/FastDeploy-<commit>.tar.gz")
            ) from exc
        return target
    path = Path(archive).expanduser()
    if path.is_dir():
        raise HostSetupError(f"--archive {archive!r} is a directory; allowed: a .tar.gz file or an http(s) URL")
    if not path.is_file():
        raise HostSetupError(f"--archive {archive!r} does not exist; allowed: a .tar.gz file or an http(s) URL")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_checksum(path: Path, original: str) -> Optional[str]:
    """Verify against a SHA256SUMS file beside a local archive; return the digest."""
    digest = _sha256(path)
    sums = path.parent / "SHA256SUMS"
    if path.name != "archive.tar.gz" and sums.is_file():
        for line in sums.read_text(encoding="utf-8", errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("*") == path.name:
                if parts[0].lower() != digest:
                    raise HostSetupError(
                        f"{original}: checksum {digest} does not match {sums} ({parts[0]}); the archive is corrupt "
                        "or not the one listed: fetch it again"
                    )
                say(f"checksum matches {sums}")
    return digest


def _check_member(member: tarfile.TarInfo, original: str) -> None:
    """Refuse a member that would land outside the unpack folder, naming it and why (not a re-download hint)."""
    name = member.name
    if name.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", name):
        raise HostSetupError(f"{original}: member {name!r} has an absolute path; allowed: a source archive whose "
                             "members are relative (FastDeploy-<commit>/...); this archive is not one, do not unpack it")
    if ".." in re.split(r"[\\/]", name):
        raise HostSetupError(f"{original}: member {name!r} escapes the archive's folder (a '..' in its path); allowed: "
                             "a source archive whose members stay inside FastDeploy-<commit>/; do not unpack this one")
    if member.issym() or member.islnk():
        target = member.linkname
        base = os.path.dirname(name) if member.issym() else ""
        resolved = os.path.normpath(os.path.join(base, target))
        if target.startswith("/") or resolved == ".." or resolved.startswith("../"):
            raise HostSetupError(f"{original}: link {name!r} -> {target!r} points outside the archive's folder; "
                                 "allowed: a source archive whose links stay inside FastDeploy-<commit>/")


# The extraction filters' error (Python 3.10.12, 3.11.4, 3.12 and later); on an older Python nothing matches it, and
# an ``except`` that named the missing attribute would turn every refusal into an AttributeError.
_FILTER_ERRORS = (tarfile.FilterError,) if hasattr(tarfile, "FilterError") else ()


def unpack_archive(path: Path, original: str, into: Path) -> tuple:
    """Unpack into ``into``; return (tree root, commit named by the top folder or None)."""
    try:
        tar = tarfile.open(path, "r:*")
    except (tarfile.ReadError, tarfile.CompressionError, EOFError) as exc:
        # tarfile's own message lists every compression it tried, one per line: say it once
        with open(path, "rb") as fh:
            head = fh.read(6)
        if head.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")):
            raise HostSetupError(
                f"{original}: a compressed file that does not unpack as a tar archive (truncated or corrupt); "
                "fetch it again"
            ) from None
        raise HostSetupError(
            f"{original}: not a tar archive (no gzip, bzip2, xz or plain tar could read it); allowed: a FastDeploy "
            "source .tar.gz, e.g. https://github.com/gongshaotian/FastDeploy/archive/<commit>.tar.gz"
        ) from None
    except OSError as exc:
        raise HostSetupError(f"{original}: cannot be read ({exc.strerror or exc}); allowed: a readable .tar.gz file") from None
    try:
        with tar:
            members = tar.getmembers()
            for member in members:
                _check_member(member, original)
            tops = {m.name.split("/", 1)[0] for m in members if m.name not in ("", ".")}
            if len(tops) != 1:
                raise HostSetupError(
                    f"{original}: expected one top folder (FastDeploy-<commit>/), found {len(tops)}: "
                    f"{', '.join(sorted(tops)[:5])}; allowed: a FastDeploy source archive"
                )
            top = tops.pop()
            names = {m.name for m in members}
            missing = [m for m in HOST_MODULES + ("fastdeploy/__init__.py",) if f"{top}/{m}" not in names]
            if missing:
                raise HostSetupError(
                    f"{original}: the tree has no {', '.join(missing)}; allowed: a FastDeploy source archive with "
                    "the V1 scheduler and prefix cache (FastDeploy 2.x from 2.2 on; 2.0 has neither)"
                )
            try:
                tar.extractall(into, filter="data")
            except TypeError:  # a Python before the extraction filters (3.10.11 and older): _check_member checked
                tar.extractall(into)  # noqa: S202 - every member was checked above
    except _FILTER_ERRORS as exc:  # what the "data" filter refuses that _check_member did not name
        raise HostSetupError(f"{original}: unsafe member ({exc}); allowed: a FastDeploy source archive") from None
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, lzma.LZMAError) as exc:
        raise HostSetupError(
            f"{original}: the archive is truncated or corrupt ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else '?'}); "
            "fetch it again"
        ) from None
    except OSError as exc:
        raise HostSetupError(f"{original}: cannot unpack ({exc.strerror or exc}); check the free space in {into.parent}") from None
    match = re.fullmatch(r"FastDeploy-([0-9a-f]{40})", top)
    return into / top, (match.group(1) if match else None)

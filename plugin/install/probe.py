"""Finding the FastDeploy host and probing what it already has.

The host is, in this order: an installed ``fastdeploy`` package; a source tree named by
``FDSCHED_HOST_SOURCE`` (a directory whose ``fastdeploy/`` package imports with that directory on
``sys.path``); the active host recorded by ``fdsched host setup`` (:mod:`fdsched.tools.hostsetup`). Nothing
here patches anything: :func:`probe` only looks.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

__all__ = [
    "HOST_SOURCE_ENV",
    "HostNotFound",
    "HostInfo",
    "find_host",
    "probe",
]

HOST_SOURCE_ENV = "FDSCHED_HOST_SOURCE"
HOW_TO_POINT = (
    "run `fdsched host setup` (a CPU host from a FastDeploy source archive), install FastDeploy 2.x "
    f"(fastdeploy-gpu) in this environment, or set {HOST_SOURCE_ENV}=/path/to/FastDeploy (a source tree "
    "whose fastdeploy/ package imports, with paddlepaddle installed)"
)


class HostNotFound(RuntimeError):
    """FastDeploy cannot be imported here."""


def find_host(environ: Optional[Mapping[str, str]] = None) -> str:
    """Make the host importable and say where it is; raise :class:`HostNotFound` otherwise.

    An installed ``fastdeploy`` wins; else ``FDSCHED_HOST_SOURCE``, else the host recorded by
    ``fdsched host setup``, is put on ``sys.path``.
    """
    environ = os.environ if environ is None else environ
    if "fastdeploy" in sys.modules:
        return _location(sys.modules["fastdeploy"])
    source = environ.get(HOST_SOURCE_ENV, "").strip()
    if importlib.util.find_spec("fastdeploy") is None:
        if source:
            if not os.path.isfile(os.path.join(source, "fastdeploy", "__init__.py")):
                raise HostNotFound(f"{HOST_SOURCE_ENV}={source!r} has no fastdeploy/__init__.py; {HOW_TO_POINT}")
        else:
            from fdsched.install.hosts import recorded_host_path

            source = recorded_host_path(environ) or ""
        if source:
            sys.path.insert(0, os.path.abspath(source))
            importlib.invalidate_caches()
    if importlib.util.find_spec("fastdeploy") is None:
        raise HostNotFound(f"FastDeploy is not importable; {HOW_TO_POINT}")
    try:
        module = importlib.import_module("fastdeploy")
    except Exception as exc:  # the host's own import failing is a host problem; say what it was
        raise HostNotFound(f"importing fastdeploy failed: {type(exc).__name__}: {exc}; {HOW_TO_POINT}") from exc
    return _location(module)


def _location(module) -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(module.__file__)))


@dataclass
class HostInfo:
    """What the probe found. ``has[change_id]`` is True when the host already has the change."""

    location: str
    version: str
    commit: Optional[str]
    host_classes: dict  # target name (see fdsched.patches.TARGETS) -> the host's class
    request_status: Any
    has: dict = field(default_factory=dict)
    problems: dict = field(default_factory=dict)  # change_id -> why the plugin cannot patch it here
    # change_id -> {reliance name -> what differs}: "Relies on:" assumptions that do not hold on this host
    reliance_problems: dict = field(default_factory=dict)
    split_status: bool = False

    @property
    def rm_class(self) -> type:
        return self.host_classes["ResourceManagerV1"]

    @property
    def name(self) -> str:
        """Version when known, commit, and which supported host it is (no location)."""
        from fdsched.install.hosts import known_host

        version = "" if self.version.lower() in ("unknown", "none", "") else f" {self.version}"
        commit = f", commit {self.commit[:9]}" if self.commit else ""
        return f"FastDeploy{version}{commit}"

    @property
    def support(self) -> str:
        """Whether the project tests this host, in words: its line and what CI runs on it, or an unknown commit."""
        from fdsched.install.hosts import known_host

        known = known_host(self.commit)
        if known is None:
            return ("an unknown commit (not one the project tests): each change is applied only where its checks "
                    "pass on this host, else declined")
        tiers = {"full": "tested in CI: unit, host and engine tiers", "compat": "tested in CI: compatibility tier",
                 "refused": "refused"}
        return f"{known.what} (line {known.line}; {tiers.get(known.tier, known.tier)})"

    @property
    def label(self) -> str:
        return f"{self.name} at {self.location}"


def _host_version(location: str) -> tuple[str, Optional[str]]:
    version = "unknown"
    try:
        version = str(importlib.import_module("fastdeploy").__version__)
    except Exception:
        pass
    if version.lower() == "unknown":
        try:
            from importlib.metadata import version as dist_version

            for dist in ("fastdeploy-gpu", "fastdeploy"):
                try:
                    version = dist_version(dist)
                    break
                except Exception:
                    continue
        except Exception:
            pass
    return version, _git_commit(location)


def _git_commit(location: str) -> Optional[str]:
    """The commit of a source tree: its .git HEAD, or a FDSCHED_HOST_COMMIT marker file."""
    marker = os.path.join(location, "FDSCHED_HOST_COMMIT")
    if os.path.isfile(marker):
        return open(marker, encoding="utf-8").read().strip() or None
    head = os.path.join(location, ".git", "HEAD")
    if not os.path.isfile(head):
        return None
    ref = open(head, encoding="utf-8").read().strip()
    if ref.startswith("ref: "):
        ref_path = os.path.join(location, ".git", ref[5:])
        return open(ref_path, encoding="utf-8").read().strip() if os.path.isfile(ref_path) else None
    return ref


def probe(environ: Optional[Mapping[str, str]] = None) -> HostInfo:
    """Find and import the host's two modules, then probe every change in the catalogue."""
    from fdsched.patches import CATALOGUE  # local import: patches import nothing from the host at import

    from fdsched.patches import TARGETS

    location = find_host(environ)
    version, commit = _host_version(location)
    host_classes = {}
    module_name = "fastdeploy.engine.request"
    try:
        RequestStatus = importlib.import_module(module_name).RequestStatus
        for target, dotted in TARGETS.items():
            module_name, class_name = dotted.rsplit(".", 1)
            host_classes[target] = _original(getattr(importlib.import_module(module_name), class_name))
    except Exception as exc:  # noqa: BLE001 - a host without these classes is one the plugin cannot serve
        first = str(exc).splitlines()[0] if str(exc) else "?"
        raise HostNotFound(
            f"FastDeploy at {location}{f' (commit {commit[:9]})' if commit else ''} has no usable {module_name} "
            f"({type(exc).__name__}: {first}); the plugin needs FastDeploy 2.x with the V1 scheduler "
            "(fastdeploy/engine/sched/resource_manager_v1.py)"
        ) from None

    info = HostInfo(
        location=location,
        version=version,
        commit=commit,
        host_classes=host_classes,
        request_status=RequestStatus,
        split_status=hasattr(RequestStatus, "RUNNING_PREFILL") and hasattr(RequestStatus, "RUNNING_DECODE"),
    )
    for spec in CATALOGUE:
        try:
            info.has[spec.change_id] = bool(spec.host_has(info))
        except Exception as exc:  # noqa: BLE001 - a host the probe cannot read is declined, never a crash
            info.has[spec.change_id] = False
            info.problems[spec.change_id] = f"probing the host for it failed ({type(exc).__name__}: {exc})"
        info.reliance_problems[spec.change_id] = spec.check_reliances(info)
    return info


def _original(cls: type) -> type:
    """The host class even when our subclass is installed already."""
    return getattr(cls, "_fdsched_host_class", cls)

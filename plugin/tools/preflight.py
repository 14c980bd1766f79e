"""``fdsched doctor``'s pre-flight: the mistakes it can see in the environment, one line each with the fix.

* whether ``FD_PLUGINS`` names the plugin, and what FastDeploy's loader on the probed host does with its current
  value (read from the host's ``fastdeploy/plugins/utils.py``: 2.2 and earlier call every installed plugin when
  ``FD_PLUGINS`` is unset, 2.4 and later none; either way the plugin acts only when ``FD_PLUGINS`` names it);
* ``FDSCHED_*`` settings set while ``FD_PLUGINS`` does not name the plugin (the engine ignores them);
* a per-rank profile list (``FDSCHED_PROFILE_BY_DP_RANK``) that does not match the data-parallel ranks;
* an ``FDSCHED_*`` variable the plugin does not read, and an ``FD_*`` variable neither the host nor the plugin reads
  (with the one it most likely meant).

Nothing here imports the host: the loader is read as source text.
"""

from __future__ import annotations

import ast
import os
import re
from typing import Mapping, Optional

from fdsched.core.common import did_you_mean

__all__ = ["PLUGIN", "loader_when_unset", "host_variables", "fd_plugins_line", "environment_lines", "known_variables"]

PLUGIN = "fdsched"
FIX = f"export FD_PLUGINS={PLUGIN}"
# Variables the tools set for the processes they start, and the test suites' own: read, not the operator's.
TOOL_PREFIXES = ("FDSCHED_SERVE_", "FDSCHED_HOSTSUITE_")
TEST_VARIABLES = ("FDSCHED_TEST_ALL_PROFILES", "FDSCHED_GOLDEN_FULL")
_FD_NAME = re.compile(r"[\"'](FD_[A-Z0-9_]+)[\"']")


def loader_when_unset(location: Optional[str]) -> Optional[str]:
    """What the host's plugin loader does when ``FD_PLUGINS`` is unset: ``"all"`` (calls every installed plugin),
    ``"none"`` (calls none), or None when the host tree has no loader this can read. ``location`` is the directory
    that holds the host's ``fastdeploy`` package."""
    if not location:
        return None
    path = os.path.join(location, "fastdeploy", "plugins", "utils.py")
    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError):
        return None
    loader = next((node for node in ast.walk(tree)
                   if isinstance(node, ast.FunctionDef) and node.name == "load_plugins_by_group"), None)
    if loader is None:
        return None
    for node in ast.walk(loader):  # ``if <allowed> is None: ... return ...``: nothing is loaded when unset
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.Is) \
                and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None \
                and any(isinstance(inner, ast.Return) for inner in ast.walk(node)):
            return "none"
    return "all"


def fd_plugins_line(environ: Mapping[str, str], when_unset: Optional[str]) -> tuple:
    """(ok, line): whether FastDeploy's loader will call the plugin, and one line saying so (with the fix)."""
    value = environ.get("FD_PLUGINS")
    if value is None:
        what = {"all": "FastDeploy's loader on this host then calls every installed plugin, and fdsched does nothing "
                       "unless FD_PLUGINS names it",
                "none": "FastDeploy's loader on this host then loads no plugin"}.get(
            when_unset, "fdsched does nothing unless FD_PLUGINS names it")
        return False, f"FD_PLUGINS is unset: {what}; fix: {FIX}"
    names = value.split(",")  # as FastDeploy splits it: at commas, spaces kept
    if PLUGIN in names:
        return True, f"FD_PLUGINS={value}: names fdsched; FastDeploy's loader calls it in every engine process"
    stripped = [name.strip() for name in names if name.strip()]
    if not stripped:
        return False, f"FD_PLUGINS is set but empty: FastDeploy's loader loads no plugin; fix: {FIX}"
    meant = [name for name in stripped if name.lower() == PLUGIN or did_you_mean(name, [PLUGIN])]
    kept = [name for name in stripped if name not in meant]  # a near-miss is replaced, not kept beside it
    fixed = ",".join(dict.fromkeys(kept + [PLUGIN]))
    if PLUGIN in stripped:
        return False, (f"FD_PLUGINS={value!r}: FastDeploy splits it at commas and keeps the spaces, so no name in it "
                       f"is exactly fdsched; fix: export FD_PLUGINS={fixed}")
    hint = ""
    if meant:
        hint = " (names are case-sensitive)" if meant[0].lower() == PLUGIN else f" ({meant[0]!r} is not its name)"
    return False, (f"FD_PLUGINS={value}: does not name fdsched{hint}; FastDeploy's loader loads only "
                   f"{', '.join(stripped)}; fix: export FD_PLUGINS={fixed}")


def known_variables() -> set:
    """Every ``FDSCHED_*`` variable the plugin or its commands read from an operator's environment."""
    from fdsched.core.hooks import DISABLE_ENV
    from fdsched.core.settings import SCHEMA
    from fdsched.core.settings import DP_PROFILE_ENV, PROFILE_ENV
    from fdsched.install.hosts import HOME_ENV
    from fdsched.install.probe import HOST_SOURCE_ENV

    return {s.env for s in SCHEMA if s.env} | {PROFILE_ENV, DP_PROFILE_ENV, DISABLE_ENV, HOME_ENV, HOST_SOURCE_ENV}


def host_variables(location: Optional[str]) -> Optional[set]:
    """Every ``FD_*`` name the host's source spells out as a string (what its ``envs`` table and its direct
    ``os.getenv`` calls can read), or None when there is no host tree to read."""
    root = os.path.join(location or "", "fastdeploy")
    if not location or not os.path.isdir(root):
        return None
    names = set()
    for folder, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                try:
                    with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as handle:
                        names.update(_FD_NAME.findall(handle.read()))
                except OSError:
                    continue
    return names


def _fd_lines(environ: Mapping[str, str], read_by_host: Optional[set]) -> list:
    from fdsched.core.settings import SCHEMA

    if read_by_host is None:
        return []
    known = read_by_host | {s.env for s in SCHEMA if s.env}
    return [f"{name} is set, but neither this FastDeploy nor fdsched reads it{did_you_mean(name, known)}; fix: rename "
            "or unset it" for name in sorted(environ) if name.startswith("FD_") and name not in known]


def _rank_lines(environ: Mapping[str, str], ranks: Optional[int]) -> list:
    from fdsched.core.settings import DP_PROFILE_ENV, PROFILE_ENV, SettingsError, parse_dp_arms

    try:
        arms = parse_dp_arms(environ.get(DP_PROFILE_ENV, ""))
    except SettingsError:
        return []  # doctor's settings check says what is wrong with it
    others = environ.get(PROFILE_ENV, "").strip() or "default"
    if not arms:
        return []
    named = ", ".join(str(r) for r in sorted(arms))
    if ranks is None:
        gaps = [r for r in range(max(arms)) if r not in arms]
        if not gaps:
            return []
        return [f"{DP_PROFILE_ENV} names ranks {named} but not {', '.join(map(str, gaps))}: those run {PROFILE_ENV} "
                f"({others}); fix: name every rank, or check it against the engine's ranks with: fdsched doctor --dp N"]
    lines = []
    beyond = sorted(r for r in arms if r >= ranks)
    if beyond:
        lines.append(f"{DP_PROFILE_ENV} names rank {', '.join(map(str, beyond))}, which does not exist with {ranks} "
                     f"data-parallel rank(s) (0-{ranks - 1}): that arm never runs; fix: name ranks 0-{ranks - 1} only")
    missing = [r for r in range(ranks) if r not in arms]
    if missing:
        lines.append(f"{DP_PROFILE_ENV} gives rank {', '.join(map(str, missing))} no arm: it runs {PROFILE_ENV} "
                     f"({others}), unlike the ranks named; fix: give every rank 0-{ranks - 1} a profile")
    return lines


def environment_lines(environ: Optional[Mapping[str, str]] = None, when_unset: Optional[str] = None,
                      ranks: Optional[int] = None, read_by_host: Optional[set] = None) -> list:
    """The pre-flight: ``(ok, line)`` per finding, the ``FD_PLUGINS`` line first (``ok``: the plugin will be
    loaded); every other line is a mistake, with its fix. ``ranks``: the engine's data-parallel size when known
    (``fdsched doctor --dp N``); ``read_by_host``: the ``FD_*`` names the host reads (:func:`host_variables`), to
    flag the ones nothing reads."""
    from fdsched.core.settings import DP_PROFILE_ENV, PROFILE_ENV

    environ = os.environ if environ is None else environ
    loaded, first = fd_plugins_line(environ, when_unset)
    lines = []
    known = known_variables()
    ours = sorted(k for k in environ if k.startswith("FDSCHED_"))
    unknown = [k for k in ours if k not in known and not k.startswith(TOOL_PREFIXES) and k not in TEST_VARIABLES]
    settings = [k for k in ours if k in known and (k in (PROFILE_ENV, DP_PROFILE_ENV) or k not in _tool_variables())]
    if settings and not loaded:
        lines.append(f"{', '.join(settings)} set, but FD_PLUGINS does not name fdsched: the engine ignores "
                     f"{'it' if len(settings) == 1 else 'them'}; fix: {FIX}")
    lines += _rank_lines(environ, ranks)
    for name in unknown:
        lines.append(f"{name} is not a variable fdsched reads{did_you_mean(name, known)}; fix: rename or unset it "
                     "(every variable: docs/configuration.md)")
    lines += _fd_lines(environ, read_by_host)
    return [(loaded, first)] + [(False, line) for line in lines]


def _tool_variables() -> set:
    """The variables of the ``fdsched`` commands themselves (where the host is), not the engine's settings."""
    from fdsched.install.hosts import HOME_ENV
    from fdsched.install.probe import HOST_SOURCE_ENV

    return {HOME_ENV, HOST_SOURCE_ENV}

"""Profile files: the shipped profiles, a profile named by the operator (a name or a path), a profile file read into
its YAML mapping (a key given twice is an error, not the last one kept), and the per-rank arm list
(``FDSCHED_PROFILE_BY_DP_RANK``). Nothing here knows the settings: :func:`fdsched.core.settings.read_profile`
hands :func:`read_keys` the key table to check a profile's keys against.

Errors are :class:`SettingsError` in the settings' one format, ``<where>: bad value <value>[ (why)]; allowed: <what>``.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any, Collection, Sequence

import yaml

from fdsched.core.common import SettingsError, did_you_mean, read_utf8

__all__ = [
    "PROFILE_ENV", "DP_PROFILE_ENV", "MAX_DP_RANK", "shipped_profiles", "resolve_profile", "read_keys",
    "profile_description", "parse_dp_arms",
]

PROFILE_ENV = "FDSCHED_PROFILE"
# Online A/B in one deployment: one profile per data-parallel rank, e.g. ``0=baseline,1=recommended``.
DP_PROFILE_ENV = "FDSCHED_PROFILE_BY_DP_RANK"
MAX_DP_RANK = 1023  # a bound on typos (FastDeploy's data-parallel sizes are single or double digits)


def shipped_profiles() -> dict[str, Path]:
    """Shipped profile name -> path of its YAML file."""
    found = {}
    for entry in resources.files("fdsched.configs").iterdir():
        if entry.name.endswith(".yaml"):
            found[entry.name[: -len(".yaml")]] = Path(str(entry))
    return dict(sorted(found.items()))


def resolve_profile(value: str, origin: str = PROFILE_ENV) -> tuple[str, Path]:
    """A profile named by ``value`` (a shipped profile's name, or a YAML file's path) as (name, file); a bad value
    raises :class:`SettingsError` naming ``origin`` (the variable, option or key it came from) and what is allowed."""
    value = value.strip()
    looks_like_path = os.sep in value or value.endswith((".yaml", ".yml"))
    if looks_like_path:
        path = Path(value).expanduser()
        if path.is_dir():
            raise SettingsError(f"{origin}: bad value {value!r} (a directory, not a profile file); allowed: a shipped "
                                f"profile name ({', '.join(shipped_profiles())}) or the path of a YAML file")
        if not path.is_file():
            raise SettingsError(f"{origin}: bad value {value!r} (no such profile file); allowed: a shipped profile "
                                f"name ({', '.join(shipped_profiles())}) or the path of a YAML file")
        return path.stem, path
    profiles = shipped_profiles()
    if value not in profiles:
        hint = did_you_mean(value, profiles).replace(" (", "; ").rstrip(")")
        raise SettingsError(f"{origin}: bad value {value!r} (unknown profile{hint}); "
                            f"allowed: {', '.join(profiles)} or the path of a YAML file")
    return value, profiles[value]


class _DuplicateKey(Exception):
    def __init__(self, key_path: str, first_line: int, second_line: int):
        super().__init__(key_path)
        self.key_path, self.first_line, self.second_line = key_path, first_line, second_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses a key given twice in one mapping (PyYAML silently keeps the last one)."""


def _unique_mapping(loader, node, deep=False):
    seen: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if isinstance(key, (str, int, float, bool)) and key in seen:
            raise _DuplicateKey(str(key), seen[key], line)
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _parent_path(text: str, line: int) -> str:
    """The dotted key path a duplicate at ``line`` sits under (its parent keys, by indentation)."""
    lines = text.splitlines()
    target = lines[line - 1]
    indent = len(target) - len(target.lstrip())
    parents = []
    for previous in reversed(lines[: line - 1]):
        stripped = previous.lstrip()
        if not stripped or stripped.startswith("#"):
            continue
        level = len(previous) - len(stripped)
        if level < indent and stripped.rstrip().endswith(":"):
            parents.append(stripped.rstrip()[:-1].strip())
            indent = level
    return ".".join(reversed(parents))


def _read_document(path: Path, top_keys: Sequence[str]) -> dict:
    """One profile file as its top-level YAML mapping; not YAML, a key given twice, an empty file or a top level
    that is not a mapping is an error (``top_keys``: what the error says is allowed at the top)."""
    text = read_utf8(path, "profile", "a YAML mapping (see fdsched profiles baseline)", SettingsError)
    try:
        document = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as dup:
        parent = _parent_path(text, dup.second_line)
        key = f"{parent}.{dup.key_path}" if parent else dup.key_path
        raise SettingsError(
            f"profile {path}, key {key}: bad value (given twice, at line {dup.first_line} and line {dup.second_line}); "
            "allowed: each key once"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SettingsError(f"profile {path}: not valid YAML{where}: {problem}; allowed: a YAML mapping") from None
    if document is None:
        raise SettingsError(
            f"profile {path}: empty (no settings); allowed: a YAML mapping with keys {', '.join(top_keys)} "
            "(a profile that changes nothing is the built-in defaults: leave FDSCHED_PROFILE unset instead)"
        )
    if not isinstance(document, dict):
        raise SettingsError(
            f"profile {path}: bad value at the top level (a {type(document).__name__}); allowed: a mapping with keys "
            f"{', '.join(top_keys)} (the top level must be a mapping)"
        )
    return document


def read_keys(path: Path, top_keys: Sequence[str], known: Collection[str]) -> dict[str, Any]:
    """One profile file as ``{dotted key: raw value}``, its keys as written; a key not in ``known`` (the settings'
    key paths; ``top_keys`` are their first parts) is an error that names what is allowed there."""
    flat: dict[str, Any] = {}
    for top, value in _read_document(path, top_keys).items():
        if top not in top_keys:
            raise SettingsError(
                f"profile {path}, key {top}: unknown key{did_you_mean(top, top_keys)}; allowed top-level keys: "
                f"{', '.join(top_keys)}"
            )
        if top == "description":
            if not isinstance(value, str):
                raise SettingsError(f"profile {path}, key description: bad value {value!r}; allowed: a string")
            continue
        if not isinstance(value, dict):
            raise SettingsError(f"profile {path}, key {top}: bad value {value!r}; allowed: a mapping of settings")
        for sub, raw in value.items():
            key = f"{top}.{sub}"
            if key not in known:
                allowed = sorted(k.split(".", 1)[1] for k in known if k.startswith(top + "."))
                raise SettingsError(f"profile {path}, key {key}: unknown key{did_you_mean(sub, allowed)}; "
                                    f"allowed under {top}: {', '.join(allowed)}")
            flat[key] = raw
    return flat


def profile_description(path: Path) -> str:
    document = yaml.safe_load(read_utf8(path, "profile", "a YAML mapping", SettingsError)) or {}
    return str(document.get("description", "")).strip() if isinstance(document, dict) else ""


_DP_ALLOWED = (
    "a comma list of RANK=PROFILE, each RANK an integer in [0, %d] given once and each PROFILE a shipped profile "
    "name or the path of a YAML file (e.g. 0=baseline,1=recommended)" % MAX_DP_RANK
)


def parse_dp_arms(raw: str, origin: str = f"environment variable {DP_PROFILE_ENV}") -> dict:
    """``"0=baseline,1=recommended"`` -> ``{0: "baseline", 1: "recommended"}`` (rank -> profile as written).

    Only the syntax is checked here (ranks, duplicates, empty profiles);
    :func:`fdsched.core.settings.load_arm_settings` loads each profile. An empty or blank value means no arms.
    Raises :class:`SettingsError` naming the bad item.
    """
    arms: dict = {}
    if raw is None or raw.strip() == "":
        return arms
    for item in raw.split(","):
        text = item.strip()
        if not text:
            raise SettingsError(f"{origin}: bad value {raw!r} (an empty item); allowed: {_DP_ALLOWED}")
        rank_text, sep, profile = text.partition("=")
        rank_text, profile = rank_text.strip(), profile.strip()
        if not sep or not profile:
            raise SettingsError(f"{origin}: bad value {text!r} (no profile after RANK=); allowed: {_DP_ALLOWED}")
        try:
            rank = int(rank_text)
        except ValueError:
            rank = -1
        if not rank_text.isdigit() or not 0 <= rank <= MAX_DP_RANK:
            raise SettingsError(f"{origin}: bad value {text!r} (rank {rank_text!r}); allowed: {_DP_ALLOWED}")
        if rank in arms:
            raise SettingsError(
                f"{origin}: bad value {text!r} (rank {rank} is given twice: {arms[rank]} and {profile}); "
                f"allowed: {_DP_ALLOWED}"
            )
        arms[rank] = profile
    return arms

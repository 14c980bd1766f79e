"""Settings: built-in defaults < a YAML profile < environment variables, validated once, frozen.

Every setting is one row of ``SCHEMA`` (:mod:`fdsched.core.schema`, the key table): its YAML key path, its
environment variable, its type, its default and what it is for. The host's own tunables keep their FastDeploy names (``FD_*``) both
as environment variables and as keys under ``host_tunables:`` in a profile. A profile's ``changes.others``
sets every change switch the profile does not name (see :func:`load_settings`).

Bad input raises one :class:`SettingsError` in one format, ``<where>: bad value <value>[ (why)]; allowed:
<what>``, where ``<where>`` is ``environment variable <VAR>`` or ``profile <file>, key <key path>``. It is
raised by :func:`load_settings`, before anything is patched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional

import yaml

from fdsched.core.common import SettingsError, did_you_mean, read_utf8
from fdsched.core.schema import OTHERS_KEY, PROFILE_TOP_KEYS, SCHEMA, SCHEMA_BY_KEY, UPSTREAM_CHANGE_IDS, parse_switch

__all__ = [
    "PROFILE_ENV",
    "DP_PROFILE_ENV",
    "parse_dp_arms",
    "load_arm_settings",
    "Settings",
    "SettingsError",
    "load_settings",
    "shipped_profiles",
    "read_profile",
    "resolve_profile",
]

PROFILE_ENV = "FDSCHED_PROFILE"
# Online A/B in one deployment: one profile per data-parallel rank, e.g. ``0=baseline,1=recommended``.
DP_PROFILE_ENV = "FDSCHED_PROFILE_BY_DP_RANK"
MAX_DP_RANK = 1023  # a bound on typos (FastDeploy's data-parallel sizes are single or double digits)


@dataclass(frozen=True)
class Settings:
    """The effective settings of one process. Read with ``settings[key]``."""

    values: Mapping[str, Any]
    # key -> "default" | "profile <name>" | "profile <name> via changes.others" | "env <VAR>"
    sources: Mapping[str, str]
    profile: Optional[str]
    profile_path: Optional[str]

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def change_mode(self, change_id: str) -> str:
        return self.values[f"changes.{change_id}"]

    @property
    def reestimate_cap(self) -> float:
        cap = self.values["tunables.ratio_reestimate_cap"]
        return self.values["host_tunables.FD_INIT_NEW_TOKEN_RATIO"] if cap is None else cap

    def origin(self, key: str) -> str:
        """Where ``key``'s value came from, as an error message names it: ``environment variable <VAR>``,
        ``profile <file>, key <key>`` or ``<key> (default)``."""
        return _where(key, self.sources, self.profile_path)

    def describe(self) -> list[tuple[str, str, Any, str]]:
        """(key, variable, value, source) rows, schema order."""
        return [(s.key, s.env or "-", self.values[s.key], self.sources[s.key]) for s in SCHEMA]


# --------------------------------------------------------------------------------------------
# Profiles
# --------------------------------------------------------------------------------------------
def shipped_profiles() -> dict[str, Path]:
    """Shipped profile name -> path of its YAML file."""
    found = {}
    for entry in resources.files("fdsched.configs").iterdir():
        if entry.name.endswith(".yaml"):
            found[entry.name[: -len(".yaml")]] = Path(str(entry))
    return dict(sorted(found.items()))


def engine_profiles() -> dict[str, str]:
    """Shipped profile name -> the shipped profile an engine runs identically, for every profile.

    Profiles that differ only in ``replay.*`` keys (settings only the replay reads: ``oracle``, ``unbounded``,
    ``sglang-retract`` are ``recommended`` in an engine) build the same classes with the same values, so a test of
    the engine or of the host's suites proves the same thing for each; the representative of a group is the one
    whose replay keys are all defaults (else the first by name)."""
    groups: dict = {}
    for name in shipped_profiles():
        settings = load_settings({}, profile=name)
        engine_view = tuple(sorted((k, repr(v)) for k, v in settings.values.items() if not k.startswith("replay.")))
        groups.setdefault(engine_view, []).append(settings)
    chosen = {}
    for members in groups.values():
        plain = [m for m in members if not any(src != "default" for k, src in m.sources.items() if k.startswith("replay."))]
        representative = (plain or members)[0].profile
        for member in members:
            chosen[member.profile] = representative
    return dict(sorted(chosen.items()))


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


def read_profile(path: Path) -> dict[str, Any]:
    """Parse one profile file into ``{key path: raw value}``; unknown and duplicate keys are errors.

    The keys are those written in the file, ``changes.others`` included (:func:`load_settings` gives its
    value to every switch the file does not name)."""
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
            f"profile {path}: empty (no settings); allowed: a YAML mapping with keys {', '.join(PROFILE_TOP_KEYS)} "
            "(a profile that changes nothing is the built-in defaults: leave FDSCHED_PROFILE unset instead)"
        )
    if not isinstance(document, dict):
        raise SettingsError(
            f"profile {path}: bad value at the top level (a {type(document).__name__}); allowed: a mapping with keys "
            f"{', '.join(PROFILE_TOP_KEYS)} (the top level must be a mapping)"
        )
    flat: dict[str, Any] = {}
    for top, value in document.items():
        if top not in PROFILE_TOP_KEYS:
            raise SettingsError(
                f"profile {path}, key {top}: unknown key{did_you_mean(top, PROFILE_TOP_KEYS)}; allowed top-level keys: "
                f"{', '.join(PROFILE_TOP_KEYS)}"
            )
        if top == "description":
            if not isinstance(value, str):
                raise SettingsError(f"profile {path}, key description: bad value {value!r}; allowed: a string")
            continue
        if not isinstance(value, dict):
            raise SettingsError(f"profile {path}, key {top}: bad value {value!r}; allowed: a mapping of settings")
        for sub, raw in value.items():
            key = f"{top}.{sub}"
            if key not in SCHEMA_BY_KEY and key != OTHERS_KEY:
                allowed = sorted(k.split(".", 1)[1] for k in (*SCHEMA_BY_KEY, OTHERS_KEY) if k.startswith(top + "."))
                raise SettingsError(f"profile {path}, key {key}: unknown key{did_you_mean(sub, allowed)}; allowed under "
                                    f"{top}: {', '.join(allowed)}")
            flat[key] = raw
    return flat


def profile_description(path: Path) -> str:
    document = yaml.safe_load(read_utf8(path, "profile", "a YAML mapping", SettingsError)) or {}
    return str(document.get("description", "")).strip() if isinstance(document, dict) else ""


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
def load_settings(environ: Optional[Mapping[str, str]] = None, profile: Optional[str] = None) -> Settings:
    """Build the frozen settings: defaults < profile < environment.

    ``profile`` overrides ``FDSCHED_PROFILE`` (the replay uses it to run several profiles). The profile's
    ``changes.others`` (auto | on | off) sets each switch the profile does not name; its source is then
    ``profile <name> via changes.others``.
    Raises :class:`SettingsError` on the first bad input, naming where it came from.
    """
    environ = os.environ if environ is None else environ
    values = {s.key: s.default for s in SCHEMA}
    sources = {s.key: "default" for s in SCHEMA}

    profile_name = profile_path = None
    requested = profile if profile is not None else environ.get(PROFILE_ENV)
    if requested is not None and requested.strip() != "":
        profile_name, path = resolve_profile(requested, PROFILE_ENV if profile is None else "profile")
        profile_path = str(path)
        written = read_profile(path)
        for key, raw in written.items():
            parse = parse_switch if key == OTHERS_KEY else SCHEMA_BY_KEY[key].parse
            try:
                value = parse(raw)
            except ValueError as exc:
                raise SettingsError(f"profile {path}, key {key}: bad value {raw!r}; allowed: {exc}") from None
            if key != OTHERS_KEY:
                values[key], sources[key] = value, f"profile {profile_name}"
                continue
            for change_id in UPSTREAM_CHANGE_IDS:  # every upstream change's switch the profile does not name
                if f"changes.{change_id}" not in written:
                    values[f"changes.{change_id}"] = value
                    sources[f"changes.{change_id}"] = f"profile {profile_name} via {OTHERS_KEY}"

    for setting in SCHEMA:
        if setting.env is None or setting.env not in environ:
            continue
        raw = environ[setting.env]
        try:
            values[setting.key] = setting.parse(raw)
        except ValueError as exc:
            raise SettingsError(f"environment variable {setting.env}: bad value {raw!r}; allowed: {exc}") from None
        sources[setting.key] = f"env {setting.env}"

    _check_together(values, sources, profile_path)
    return Settings(MappingProxyType(values), MappingProxyType(sources), profile_name, profile_path)


def _where(key: str, sources: Mapping[str, str], profile_path: Optional[str] = None) -> str:
    setting = SCHEMA_BY_KEY[key]
    source = sources[key]
    if source.startswith("env "):
        return f"environment variable {setting.env}"
    if source.startswith("profile "):
        name, _, via = source[len("profile "):].partition(" via ")  # a switch the profile set with changes.others
        return f"profile {profile_path or name}, key {key}" + (f" (from {via})" if via else "")
    return f"{key} (default)"


_PRECEDENCE = {"default": 0, "profile": 1, "env": 2}


def _rank(source: str) -> int:
    return _PRECEDENCE[source.split(" ", 1)[0]]


def _check_order(values, sources, low_k, high_k, what, profile_path) -> None:
    """``values[low_k] <= values[high_k]``, else blame whichever was set with higher precedence."""
    if values[low_k] <= values[high_k]:
        return
    low_name, high_name = low_k.split(".", 1)[1], high_k.split(".", 1)[1]
    if _rank(sources[high_k]) > _rank(sources[low_k]):
        raise SettingsError(
            f"{_where(high_k, sources, profile_path)}: bad value {values[high_k]!r}; allowed: {what} not below "
            f"{values[low_k]!r} ({low_name}, from {_where(low_k, sources, profile_path)})"
        )
    raise SettingsError(
        f"{_where(low_k, sources, profile_path)}: bad value {values[low_k]!r}; allowed: {what} not above "
        f"{values[high_k]!r} ({high_name}, from {_where(high_k, sources, profile_path)})"
    )


def _check_together(values: dict, sources: dict, profile_path: Optional[str] = None) -> None:
    """Checks that involve two settings: the one set with higher precedence is named first."""
    _check_order(
        values, sources, "host_tunables.FD_MIN_NEW_TOKEN_RATIO", "host_tunables.FD_INIT_NEW_TOKEN_RATIO",
        "a number", profile_path,
    )
    _check_order(
        values,
        sources,
        "host_tunables.FD_RESERVE_MIN_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
        "host_tunables.FD_RESERVE_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
        "an integer",
        profile_path,
    )
    # The adaptive estimator answers only inside the plugin's ratio reservation.
    est_k = "tunables.reserve_estimator"
    if values[est_k] == "adaptive":
        ratio_k, host_k0 = "changes.ratio_reserve", "host_tunables.FD_USE_NEW_TOKEN_RATIO_RESERVE"
        if values[ratio_k] == "off":
            raise SettingsError(
                f"{_where(est_k, sources, profile_path)}: bad value 'adaptive'; it contradicts "
                f"{_where(ratio_k, sources, profile_path)}='off'; allowed: ratio with ratio_reserve=off, or "
                "adaptive with ratio_reserve=auto/on"
            )
        if sources[host_k0] != "default" and not values[host_k0]:
            raise SettingsError(
                f"{_where(est_k, sources, profile_path)}: bad value 'adaptive'; it contradicts "
                f"{_where(host_k0, sources, profile_path)}=0 (the fixed-block policy); allowed: ratio, or leave "
                "FD_USE_NEW_TOKEN_RATIO_RESERVE unset / 1"
            )
    # The host's own switch for the ratio policy must not contradict ours when both are explicit.
    host_k, ours_k = "host_tunables.FD_USE_NEW_TOKEN_RATIO_RESERVE", "changes.ratio_reserve"
    if sources[host_k] != "default":
        mode = values[ours_k]
        if (mode == "on" and not values[host_k]) or (mode == "off" and values[host_k]):
            raise SettingsError(
                f"{_where(host_k, sources, profile_path)}: bad value {int(values[host_k])!r}; it contradicts "
                f"{_where(ours_k, sources, profile_path)}={mode!r}; allowed: leave it unset, or "
                f"{1 if mode == 'on' else 0} with ratio_reserve={mode}"
            )


# --------------------------------------------------------------------------------------------
# Online A/B: one profile per data-parallel rank
# --------------------------------------------------------------------------------------------
_DP_ALLOWED = (
    "a comma list of RANK=PROFILE, each RANK an integer in [0, %d] given once and each PROFILE a shipped profile "
    "name or the path of a YAML file (e.g. 0=baseline,1=recommended)" % MAX_DP_RANK
)


def parse_dp_arms(raw: str, origin: str = f"environment variable {DP_PROFILE_ENV}") -> dict:
    """``"0=baseline,1=recommended"`` -> ``{0: "baseline", 1: "recommended"}`` (rank -> profile as written).

    Only the syntax is checked here (ranks, duplicates, empty profiles); :func:`load_arm_settings` loads each
    profile. An empty or blank value means no arms. Raises :class:`SettingsError` naming the bad item.
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


def load_arm_settings(environ: Optional[Mapping[str, str]] = None) -> dict:
    """rank -> :class:`Settings` of that rank's arm, from ``FDSCHED_PROFILE_BY_DP_RANK`` (empty when unset).

    Each arm is loaded exactly as ``FDSCHED_PROFILE`` would be (defaults < its profile < environment
    variables: a per-change or tunable variable overrides every arm, as it overrides the single profile).
    Any error is one :class:`SettingsError` that names the rank and the profile.
    """
    environ = os.environ if environ is None else environ
    arms = parse_dp_arms(environ.get(DP_PROFILE_ENV, ""))
    loaded = {}
    for rank, profile in arms.items():
        where = f"environment variable {DP_PROFILE_ENV}, rank {rank}"
        resolve_profile(profile, where)  # unknown name / missing file: the rank is in the message
        try:
            loaded[rank] = load_settings(environ, profile=profile)
        except SettingsError as exc:
            raise SettingsError(f"{where} (profile {profile}): {exc}") from None
    return loaded

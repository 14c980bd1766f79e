"""The replay's step-cost model. Imports nothing from FastDeploy.

The replay runs the real scheduler but no model, so time is modelled. One engine step costs::

    step_ms = fixed_ms
            + max(token_floor_ms, per_prefill_token_ms * P + per_decode_request_ms * D)   (when P + D > 0)
            + per_prefill_context_token_ms * prefill_context_tokens
            + per_decode_context_token_ms * decode_context_tokens

with ``P`` the prefill tokens and ``D`` the decoding requests of the step, and the two context sums from
:func:`decode_context_tokens` and :func:`prefill_context_tokens`. A step in which nothing runs costs ``fixed_ms``.
Models (``--cost-model NAME|FILE``, profile key ``replay.cost_model``): ``linear`` (the default, the profile's
three coefficients, every other 0), a shipped preset (:func:`preset_names`) or a preset file (:func:`load_preset`).

Each fact of a step, the models, the command-line overrides and what modelled time means: docs/costmodel.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

from fdsched.core.common import SettingsError

__all__ = [
    "StepCost",
    "CostModelError",
    "COEFFICIENTS",
    "LINEAR",
    "cost_from_settings",
    "step_times",
    "row_step_ms",
    "decode_context_tokens",
    "prefill_context_tokens",
    "chunk_context_tokens",
    "preset_names",
    "load_preset",
    "resolve_cost_model",
    "allowed_text",
    "parse_cost_model",
    "check_replay_settings",
]

LINEAR = "linear"
PRESET_DIR = "costmodels"  # inside the fdsched.replay package

# Coefficient keys (as in report.json and preset files) -> (StepCost attribute, meaning with unit).
COEFFICIENTS = {
    "step_fixed_ms": ("fixed_ms", "ms per engine step"),
    "per_prefill_token_ms": ("per_prefill_token_ms", "ms per prefill token scheduled"),
    "per_decode_request_ms": ("per_decode_request_ms", "ms per decoding request"),
    "token_floor_ms": (
        "token_floor_ms",
        "ms: the least the token-proportional part costs in a step that runs anything",
    ),
    "per_prefill_context_token_ms": (
        "per_prefill_context_token_ms",
        "ms per (prefill token x token it attends to)",
    ),
    "per_decode_context_token_ms": (
        "per_decode_context_token_ms",
        "ms per token held by a decoding request (its KV read)",
    ),
}


class CostModelError(SettingsError):
    """A cost model name or preset file is unknown or malformed (the message says what is allowed).
    A :class:`fdsched.core.settings.SettingsError` (so a ValueError): every command that reports bad
    settings reports it the same way."""


@dataclass(frozen=True)
class StepCost:
    fixed_ms: float = 5.0
    per_prefill_token_ms: float = 0.02
    per_decode_request_ms: float = 0.1
    token_floor_ms: float = 0.0
    per_prefill_context_token_ms: float = 0.0
    per_decode_context_token_ms: float = 0.0
    name: str = LINEAR  # the model's name: "linear", a preset's name, or a preset file's path
    source: str = ""  # where the coefficients come from (a preset's source line; "" for linear)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("name", "source"):
                continue
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"cost model {f.name}={value!r}; allowed: a number >= 0")

    @property
    def context_aware(self) -> bool:
        """True when a context term is not 0 (the step's context facts change its cost)."""
        return bool(self.per_prefill_context_token_ms or self.per_decode_context_token_ms)

    def step_ms(
        self,
        prefill_tokens: int,
        decode_requests: int,
        *,
        decode_context_tokens: float = 0,
        prefill_context_tokens: float = 0,
    ) -> float:
        """The modelled duration of one step (see the module docstring for each argument)."""
        # The linear part first, in the order the replay has always added it (same float result).
        ms = self.fixed_ms + self.per_prefill_token_ms * prefill_tokens + self.per_decode_request_ms * decode_requests
        if self.token_floor_ms and (prefill_tokens or decode_requests):
            tokens_ms = self.per_prefill_token_ms * prefill_tokens + self.per_decode_request_ms * decode_requests
            if tokens_ms < self.token_floor_ms:
                ms = self.fixed_ms + self.token_floor_ms
        if self.per_prefill_context_token_ms and prefill_context_tokens:
            ms += self.per_prefill_context_token_ms * prefill_context_tokens
        if self.per_decode_context_token_ms and decode_context_tokens:
            ms += self.per_decode_context_token_ms * decode_context_tokens
        return ms

    def coefficients(self) -> dict:
        """Coefficient key -> value (keys of :data:`COEFFICIENTS`)."""
        return {key: getattr(self, attr) for key, (attr, _) in COEFFICIENTS.items()}

    def to_json(self) -> dict:
        """The model's name and source, then every coefficient (report.json's ``cost_model``)."""
        out = {"model": self.name}
        if self.source:
            out["source"] = self.source
        out.update(self.coefficients())
        return out


# --------------------------------------------------------------------------------------------
# Step facts
# --------------------------------------------------------------------------------------------
def chunk_context_tokens(start: int, end: int) -> int:
    """Tokens attended to by the prefill tokens ``[start, end)`` of one request, summed (causal: the
    token at position ``i`` attends to ``i + 1`` tokens): ``n * start + n * (n + 1) / 2``, ``n = end - start``."""
    n = end - start
    if n <= 0:
        return 0
    return n * start + n * (n + 1) // 2


def prefill_context_tokens(chunks: Iterable) -> int:
    """The step's ``prefill_context_tokens`` from its prefill chunks: ``(start, end)`` pairs or
    ``(request id, start, end)`` triples (the replay driver's ``prefill_chunks``)."""
    total = 0
    for chunk in chunks:
        start, end = chunk[-2], chunk[-1]
        total += chunk_context_tokens(start, end)
    return total


def decode_context_tokens(held_tokens: Iterable[int]) -> int:
    """The step's ``decode_context_tokens``: the tokens each decoding request holds when it decodes
    (prompt + tokens generated so far), summed."""
    return sum(held_tokens)


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------
def _preset_root():
    return resources.files("fdsched.replay").joinpath(PRESET_DIR)


def preset_names() -> list:
    """The shipped presets' names (file stems), sorted."""
    root = _preset_root()
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(e.name[: -len(".yaml")] for e in entries if e.name.endswith(".yaml"))


def allowed_text() -> str:
    return f"{LINEAR}, {', '.join(preset_names())} or the path of a preset YAML file"


def load_preset(path, name: Optional[str] = None, shown: Optional[str] = None) -> StepCost:
    """A :class:`StepCost` from a preset YAML file: a mapping with ``coefficients`` (every key of
    :data:`COEFFICIENTS`, numbers >= 0), optional ``name`` and ``description``, and ``source``
    (a mapping or string saying where the numbers come from). Raises :class:`CostModelError`."""
    import yaml

    shown = shown or str(path)  # how messages and the report name the file
    where = f"cost model file {shown}"
    try:
        text = Path(path).read_text(encoding="utf-8") if not hasattr(path, "read_text") else path.read_text(
            encoding="utf-8"
        )
    except OSError as exc:
        raise CostModelError(f"{where}: cannot be read ({exc.strerror or exc}); allowed: {allowed_text()}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise CostModelError(f"{where}: not valid YAML: {problem}; allowed: a YAML mapping") from None
    top_keys = ("name", "description", "units", "source", "derivation", "coefficients", "fit")
    if not isinstance(doc, dict):
        raise CostModelError(f"{where}: bad value at the top level (a {type(doc).__name__}); allowed: a mapping "
                             f"with keys {', '.join(top_keys)}")
    for key in doc:
        if key not in top_keys:
            raise CostModelError(f"{where}, key {key}: unknown key; allowed: {', '.join(top_keys)}")
    coeffs = doc.get("coefficients")
    if not isinstance(coeffs, dict):
        raise CostModelError(f"{where}, key coefficients: bad value {coeffs!r}; allowed: a mapping of "
                             f"{', '.join(COEFFICIENTS)}")
    for key in coeffs:
        if key not in COEFFICIENTS:
            raise CostModelError(f"{where}, key coefficients.{key}: unknown key; allowed: {', '.join(COEFFICIENTS)}")
    values = {}
    for key, (attr, meaning) in COEFFICIENTS.items():
        if key not in coeffs:
            raise CostModelError(f"{where}, key coefficients.{key}: missing; allowed: a number >= 0 ({meaning})")
        value = coeffs[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise CostModelError(f"{where}, key coefficients.{key}: bad value {value!r}; allowed: a number >= 0 "
                                 f"({meaning})")
        values[attr] = float(value)
    label = doc.get("name", name if name is not None else shown)
    if not isinstance(label, str) or not label.strip():
        raise CostModelError(f"{where}, key name: bad value {label!r}; allowed: a non-empty string")
    source = doc.get("source", "")
    if isinstance(source, dict):  # the short form: repository @ commit (the file has the rest)
        repo, commit = source.get("repository"), source.get("commit")
        short = f"{repo} @ {str(commit)[:12]}" if repo and commit else str(repo or source.get("data") or "")
        source = f"{short}; details in {shown}" if short else f"see {shown}"
    elif not isinstance(source, str):
        raise CostModelError(f"{where}, key source: bad value {source!r}; allowed: a string or a mapping")
    return StepCost(name=label, source=source, **values)


def resolve_cost_model(value: str, origin: str = "--cost-model") -> Optional[StepCost]:
    """``linear`` -> None (the profile's linear coefficients apply); a shipped preset's name or a
    preset file's path -> its :class:`StepCost`. Raises :class:`CostModelError` naming ``origin``."""
    if not isinstance(value, str) or not value.strip():
        raise CostModelError(f"{origin}: bad value {value!r}; allowed: {allowed_text()}")
    text = value.strip()
    if text == LINEAR:
        return None
    if text in preset_names():
        try:
            return load_preset(_preset_root().joinpath(f"{text}.yaml"), name=text,
                               shown=f"fdsched/replay/{PRESET_DIR}/{text}.yaml")
        except CostModelError as exc:  # a broken shipped preset: say so
            raise CostModelError(f"{origin}: shipped preset {text!r} is broken: {exc}") from None
    path = Path(text).expanduser()
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise CostModelError(f"{origin}: bad value {value!r} (no such file); allowed: {allowed_text()}")
        try:
            return load_preset(path)
        except CostModelError as exc:
            raise CostModelError(f"{origin}: {exc}") from None
    raise CostModelError(f"{origin}: bad value {value!r} (unknown cost model); allowed: {allowed_text()}")


def parse_cost_model(raw) -> str:
    """A ``replay.cost_model`` value: ``linear``, a shipped preset's name or a preset file that loads. Raises
    ValueError saying what is allowed (the settings' parser contract)."""
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(allowed_text())
    text = raw.strip()
    if text == LINEAR or text in preset_names():
        return text
    if not Path(text).expanduser().is_file():
        raise ValueError(allowed_text())
    try:
        load_preset(Path(text).expanduser())
    except CostModelError as exc:
        raise ValueError(f"{allowed_text()}; this file: {exc}") from None
    return text


def check_replay_settings(settings):
    """The replay's own check of its keys, which the engine's settings loader leaves as written: raises
    :class:`SettingsError` naming where ``replay.cost_model`` came from, the bad value and what is allowed.
    Returns ``settings``. Every replay command calls it on each arm's settings before anything runs."""
    raw = settings["replay.cost_model"]
    try:
        parse_cost_model(raw)
    except ValueError as exc:
        raise SettingsError(f"{settings.origin('replay.cost_model')}: bad value {raw!r}; allowed: {exc}") from None
    return settings


# --------------------------------------------------------------------------------------------
# From settings, and over a run
# --------------------------------------------------------------------------------------------
def _setting(settings: Mapping, key: str, default):
    try:
        return settings[key]
    except KeyError:
        return default


def cost_from_settings(settings: Mapping, overrides: Optional[Mapping] = None) -> StepCost:
    """The arm's cost model: ``replay.cost_model`` (``linear``: the profile's ``replay.*`` linear
    coefficients; else a preset), replaced by ``overrides["model"]`` when given, then each coefficient
    replaced by a non-None override (keys as in :data:`COEFFICIENTS`; the linear three on the command
    line). Raises :class:`CostModelError` (a ValueError) for an unknown model, KeyError for an unknown key."""
    overrides = dict(overrides or {})
    model = overrides.pop("model", None)
    origin = "--cost-model"
    if model is None:
        model, origin = _setting(settings, "replay.cost_model", LINEAR), "replay.cost_model"
    preset = resolve_cost_model(model, origin)
    if preset is None:
        cost = StepCost(
            settings["replay.step_fixed_ms"], settings["replay.per_prefill_token_ms"], settings["replay.per_decode_request_ms"]
        )
    else:
        cost = preset
    changes = {}
    for key, value in overrides.items():
        if key not in COEFFICIENTS:
            raise KeyError(f"unknown cost key {key!r}; allowed: model, {', '.join(COEFFICIENTS)}")
        if value is not None:
            changes[COEFFICIENTS[key][0]] = value
    return replace(cost, **changes) if changes else cost


def row_step_ms(cost: StepCost, row) -> float:
    """One replay step row's modelled duration (its context facts: 0 when the row has none)."""
    return cost.step_ms(
        row.prefill_tokens,
        row.decode_tokens,
        decode_context_tokens=getattr(row, "decode_context_tokens", 0),
        prefill_context_tokens=getattr(row, "prefill_context_tokens", 0),
    )


def step_times(
    cost: StepCost,
    prefill_tokens: Sequence[int],
    decode_requests: Sequence[int],
    gaps_ms: Optional[Sequence[float]] = None,
    decode_context: Optional[Sequence[float]] = None,
    prefill_context: Optional[Sequence[float]] = None,
) -> tuple:
    """(start_ms, end_ms) lists, one entry per step; ``gaps_ms``: idle time skipped before each step;
    ``decode_context`` / ``prefill_context``: each step's ``decode_context_tokens`` /
    ``prefill_context_tokens`` (None: 0 in every step)."""
    starts, ends = [], []
    now = 0.0
    n = len(prefill_tokens)
    gaps = gaps_ms if gaps_ms is not None else [0.0] * n
    dctx = decode_context if decode_context is not None else [0] * n
    pctx = prefill_context if prefill_context is not None else [0] * n
    for prefill, decode, gap, dc, pc in zip(prefill_tokens, decode_requests, gaps, dctx, pctx):
        now += gap
        starts.append(now)
        now += cost.step_ms(prefill, decode, decode_context_tokens=dc, prefill_context_tokens=pc)
        ends.append(now)
    return starts, ends

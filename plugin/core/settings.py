"""Settings: each one a row of :data:`SCHEMA` (YAML key path, environment variable, parser, default, what is allowed,
what it is for; the changes' switches first, one :data:`CHANGES` line each), loaded as defaults < a YAML profile <
environment variables, checked once, frozen. The host's tunables keep their FastDeploy names (``FD_*``), as
variables and as keys under ``host_tunables:``; a profile's ``changes.others`` sets each switch it does not name.

A parser returns the typed value or raises ValueError saying what is allowed; :func:`load_settings` adds where the
value came from, as one :class:`SettingsError`: ``<where>: bad value <value>[ (why)]; allowed: <what>``, ``<where>``
being ``environment variable <VAR>`` or ``profile <file>, key <key path>``. Profile files: :mod:`fdsched.core.profiles`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

from fdsched.core.adaptive import K_BOUND, K_DECAY, K_DEFAULT, K_STEP
from fdsched.core.common import SettingsError, did_you_mean
from fdsched.core.profiles import (
    DP_PROFILE_ENV, PROFILE_ENV, parse_dp_arms, read_keys, resolve_profile, shipped_profiles,
)

__all__ = [
    "CHANGES", "CHANGE_IDS", "HOST_FIXES", "UPSTREAM_CHANGE_IDS", "OTHERS_KEY", "SWITCH_VALUES", "INT_SETTING_MAX",
    "Setting", "SCHEMA", "SCHEMA_BY_KEY", "PROFILE_TOP_KEYS", "parse_switch",
    "Settings", "SettingsError", "load_settings", "read_profile", "load_arm_settings",
    # the profile files' names, for the callers that load settings (defined in fdsched.core.profiles)
    "PROFILE_ENV", "DP_PROFILE_ENV", "parse_dp_arms", "resolve_profile", "shipped_profiles",
]

SWITCH_VALUES = ("auto", "on", "off")

# The upstream changes, in catalogue order: (id, what it does). One line per change; the id is the YAML key
# under ``changes:``, ``FDSCHED_<ID>`` its variable and ``<ID>`` the name of its module in ``fdsched.patches``.
# The list lives here, not in ``fdsched.patches``, because the core layer must not import the patches
# (tests/unit/test_layers.py); tests/unit/test_catalogue.py checks that the catalogue has the same ids, in order.
CHANGES: tuple[tuple[str, str], ...] = (
    ("deferred_recycle", "recycle evicted GPU blocks in one batch after the LRU loop (PR 7885/7886)."),
    ("decode_only_preempt", "preempt only decoding requests, LIFO (PR 7444/7783)."),
    ("ratio_reserve", "new_token_ratio KV reservation and chunked-prefill guard (PR 7444/7783)."),
    ("pd_prefill_cache", "record prefill-node blocks in the radix tree (PR 7364/7387)."),
    ("nonpolling_transfer", "wait on a blocking queue for CPU-cache transfer results (idea of PR 7520)."),
    ("one_node_per_block", "host fix: a fully cached prompt never gets a second radix node for a cached block."),
    ("prefill_node_reserve", "host fix: a PD prefill node reserves no decode blocks for running requests."),
    ("preempted_seat_resume", "host fix: a preempted request resumes on its seat; admission never locks for good."),
    ("decode_node_reserve", "host fix: a PD decode node admits a running request's chunk on its own blocks."),
)
CHANGE_IDS = tuple(change_id for change_id, _ in CHANGES)
# The plugin's fixes of defects in FastDeploy's own code (the entries above whose text starts "host fix"). A
# profile's ``changes.others`` does not set them: "every change off" (``baseline``) is the pre-change policy, not
# the host's defects; ``off`` named on its own keeps the host's code, to reproduce a defect.
HOST_FIXES = tuple(change_id for change_id, text in CHANGES if text.startswith("host fix"))
UPSTREAM_CHANGE_IDS = tuple(change_id for change_id in CHANGE_IDS if change_id not in HOST_FIXES)
# A profile's ``changes.others`` sets every switch that profile does not name (e.g. baseline: ``others: "off"``),
# so a new change needs no line in the profiles that mean "every change off" or "every change on".
OTHERS_KEY = "changes.others"


# ---- value parsers -------------------------------------------------------------------------
def _near(raw: Any, words) -> str:
    return did_you_mean(raw.strip().lower(), words) if isinstance(raw, str) else ""  # a typed word only


def parse_switch(raw: Any) -> str:
    # YAML 1.1 reads bare on/off as booleans; accept them as the words they were meant to be.
    if raw is True:
        return "on"
    if raw is False:
        return "off"
    if isinstance(raw, str) and raw.strip().lower() in SWITCH_VALUES:
        return raw.strip().lower()
    raise ValueError("one of auto, on, off" + _near(raw, SWITCH_VALUES))


def _choice(*allowed: str) -> Callable[[Any], str]:
    def parse(raw: Any) -> str:
        if isinstance(raw, str) and raw.strip().lower() in allowed:
            return raw.strip().lower()
        raise ValueError("one of " + ", ".join(allowed) + _near(raw, allowed))

    return parse


# Every integer setting without an upper bound of its own stops here (the host keeps counts in int32): a typo of a
# dozen extra digits is one line at start, not an OverflowError inside the engine.
INT_SETTING_MAX = 2**31 - 1


def _int(lo: Optional[int] = None, hi: Optional[int] = None) -> Callable[[Any], int]:
    text = _range_text("an integer", lo, hi) + ("" if hi is not None else f" (at most {INT_SETTING_MAX})")
    top = INT_SETTING_MAX if hi is None else hi

    def parse(raw: Any) -> int:
        if isinstance(raw, bool):
            raise ValueError(text)
        try:
            value = int(raw.strip()) if isinstance(raw, str) else raw
        except ValueError:
            raise ValueError(text) from None
        if not isinstance(value, int) or (lo is not None and value < lo) or value > top:
            raise ValueError(text)
        return value

    return parse


def _float(lo: Optional[float] = None, hi: Optional[float] = None) -> Callable[[Any], float]:
    def parse(raw: Any) -> float:
        if isinstance(raw, bool):
            raise ValueError(_range_text("a number", lo, hi))
        try:
            value = float(raw.strip()) if isinstance(raw, str) else float(raw)
        except (TypeError, ValueError):
            raise ValueError(_range_text("a number", lo, hi)) from None
        if value != value or value in (float("inf"), float("-inf")) or (lo is not None and value < lo) \
                or (hi is not None and value > hi):
            raise ValueError(_range_text("a number", lo, hi) + (" (finite)" if hi is None or lo is None else ""))
        return value

    return parse


def _bool01(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, int) and raw in (0, 1):
        return bool(raw)
    if isinstance(raw, str) and raw.strip().lower() in ("0", "1", "true", "false"):
        return raw.strip().lower() in ("1", "true")
    raise ValueError("0 or 1 (true/false in YAML)")


def _cap(raw: Any) -> Optional[float]:
    """``init`` (upstream: cap the re-estimated ratio at its initial value) or a number in [0, 1]."""
    if isinstance(raw, str) and raw.strip().lower() == "init":
        return None
    try:
        return _float(0.0, 1.0)(raw)
    except ValueError:
        raise ValueError("'init' or a number in [0, 1]") from None


def _as_written(raw: Any) -> Any:
    """A value the engine never reads, kept as the profile wrote it: the layer that reads it checks it (the
    replay checks ``replay.cost_model`` with :func:`fdsched.replay.costmodel.check_replay_settings`)."""
    return raw


def _range_text(what: str, lo: Any, hi: Any) -> str:
    if lo is not None and hi is not None:
        return f"{what} in [{lo}, {hi}]"
    if lo is not None:
        return f"{what} >= {lo}"
    if hi is not None:
        return f"{what} <= {hi}"
    return what


@dataclass(frozen=True)
class Setting:
    key: str  # YAML key path, dotted
    env: Optional[str]  # environment variable, or None for profile/CLI-only settings
    parse: Callable[[Any], Any] = field(repr=False)
    default: Any
    allowed: str  # what is allowed, in words (for docs and `doctor`)
    doc: str


def _change(number: int, change_id: str, doc: str) -> Setting:
    """The switch of change ``number``: ``changes.<id>`` / ``FDSCHED_<ID>`` = auto | on | off."""
    return Setting(
        key=f"changes.{change_id}",
        env=f"FDSCHED_{change_id.upper()}",
        parse=parse_switch,
        default="auto",
        allowed="auto | on | off",
        doc=f"Change {number}: {doc}",
    )


def _host(name: str, parse: Callable[[Any], Any], default: Any, allowed: str, doc: str) -> Setting:
    """One of the host's own tunables: its FastDeploy name is its variable and its key under ``host_tunables:``."""
    return Setting(f"host_tunables.{name}", name, parse, default, allowed, doc)


_FIXED = "Fixed-block reservation (ratio_reserve off): "
SCHEMA: tuple[Setting, ...] = (
    *(_change(number, change_id, doc) for number, (change_id, doc) in enumerate(CHANGES, start=1)),
    Setting("pd_prefill_cache.mode", "FDSCHED_PD_PREFILL_CACHE_MODE", _choice("safe", "upstream"), "safe",
            "safe | upstream",
            "safe: record only computed blocks, the rest after the prefill ran; upstream: record the whole prompt at "
            "preallocation (what 7387 does)."),
    # ---- the host's own tunables, FastDeploy names and defaults ------------------------------
    _host("FD_USE_NEW_TOKEN_RATIO_RESERVE", _bool01, True, "0 | 1",
          "Host switch for the ratio reservation (a host with 7783). Setting it explicitly must agree with "
          "changes.ratio_reserve."),
    _host("FD_INIT_NEW_TOKEN_RATIO", _float(0.0, 1.0), 0.7, "a number in [0, 1]", "Initial new_token_ratio."),
    _host("FD_MIN_NEW_TOKEN_RATIO", _float(0.0, 1.0), 0.1, "a number in [0, 1], not above FD_INIT_NEW_TOKEN_RATIO",
          "Floor of new_token_ratio."),
    _host("FD_NEW_TOKEN_RATIO_DECAY", _float(0.0, 1.0), 0.001, "a number in [0, 1]",
          "Subtracted from new_token_ratio after every schedule() that scheduled something."),
    _host("FD_CLIP_MAX_NEW_TOKENS", _int(0), 4096, "an integer >= 0",
          "Remaining output tokens per request are clipped to this before applying the ratio."),
    _host("FD_RESERVE_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL", _int(0), 16, "an integer >= 0",
          _FIXED + "blocks reserved per running request after a preemption."),
    _host("FD_RESERVE_DECAY_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL", _float(0.0), 0.025,
          "a number >= 0", _FIXED + "decay of the per-request reservation per scheduling pass."),
    _host("FD_RESERVE_MIN_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL", _int(0), 0,
          "an integer >= 0, not above the fixed-block initial reservation",
          _FIXED + "floor of the per-request reservation."),
    # ---- plugin tunables (upstream hard-codes these) ----------------------------------------
    Setting("tunables.ratio_reestimate_extra_blocks", "FDSCHED_RATIO_REESTIMATE_EXTRA_BLOCKS", _int(0), 16,
            "an integer >= 0",
            "Blocks per decoding request added to the generated tokens when the ratio is re-estimated after a "
            "preemption (upstream: 16; SGLang adds 20 tokens)."),
    Setting("tunables.ratio_reestimate_cap", "FDSCHED_RATIO_REESTIMATE_CAP", _cap, None, "init | a number in [0, 1]",
            "Cap of the re-estimated ratio: 'init' caps at FD_INIT_NEW_TOKEN_RATIO (upstream), SGLang uses 1.0."),
    Setting("tunables.reserve_estimator", "FDSCHED_RESERVE_ESTIMATOR", _choice("ratio", "adaptive"), "ratio",
            "ratio | adaptive",
            "What running requests reserve when the plugin's ratio reservation runs (changes.ratio_reserve applied): "
            "ratio = upstream's new_token_ratio formula (PR 7444/7783); adaptive = the expected remaining output "
            "learned from the engine's finished requests plus one margin for the running set (fdsched.core.adaptive)."),
    Setting("tunables.adaptive_min_samples", "FDSCHED_ADAPTIVE_MIN_SAMPLES", _int(1), 16, "an integer >= 1",
            "Adaptive estimator: finished requests of a kind (client max_tokens set / unset) needed before it "
            "answers for that kind; before that, the warm-up fallback (see README)."),
    Setting("tunables.adaptive_window", "FDSCHED_ADAPTIVE_WINDOW", _int(1), 2000, "an integer >= 1",
            "Adaptive estimator: how many of the most recent finished requests it learns from (drift)."),
    Setting("tunables.adaptive_margin_k", "FDSCHED_ADAPTIVE_MARGIN_K", _float(-K_BOUND, K_BOUND), K_DEFAULT,
            f"a number in [{-K_BOUND:g}, {K_BOUND:g}]",
            "Adaptive estimator: the running set's margin is k standard deviations of its total remaining output; "
            "a negative k keeps less than the expected remainder free (requests that finish give their blocks back "
            f"while the others grow); each preemption raises k by tunables.adaptive_k_step (up to {K_BOUND:g}), each "
            "finished request leaves tunables.adaptive_k_decay of that extra."),
    Setting("tunables.adaptive_k_step", "FDSCHED_ADAPTIVE_K_STEP", _float(0.0, 2 * K_BOUND), K_STEP,
            f"a number in [0, {2 * K_BOUND:g}]",
            f"Adaptive estimator: what each preemption adds to k (k never exceeds {K_BOUND:g})."),
    Setting("tunables.adaptive_k_decay", "FDSCHED_ADAPTIVE_K_DECAY", _float(0.0, 1.0), K_DECAY, "a number in [0, 1]",
            "Adaptive estimator: the share of the preemptions' extra k that each finished request leaves "
            "(1: never decays, 0: gone at the next finished request)."),
    Setting("tunables.recycle_heapify_min_batch", "FDSCHED_RECYCLE_HEAPIFY_MIN_BATCH", _int(1), 64, "an integer >= 1",
            "Deferred recycling: batches at least this large are merged with one heapify instead of one push per id."),
    Setting("tunables.transfer_force_direct_recycle", "FDSCHED_TRANSFER_FORCE_DIRECT_RECYCLE", _bool01, False, "0 | 1",
            "Evict GPU blocks directly (the batched path of change 1) even where the host would swap them to the "
            "CPU tier; needs changes.deferred_recycle applied."),
    Setting("tunables.transfer_wait_seconds", "FDSCHED_TRANSFER_WAIT_SECONDS", _float(0.001, 60.0), 0.5,
            "a number in [0.001, 60]",
            "Non-polling transfer: how long one blocking wait for a transfer-done signal lasts before the receiver "
            "loop goes round again (the idle RPC rate is about 1 / this)."),
    # ---- replay step-cost model and candidate policies (profile or command line only) --------
    Setting("replay.cost_model", None, _as_written, "linear",
            "linear, a shipped preset name (fdsched replay --help) or a preset YAML file",
            "Step-cost model of the replay (docs/costmodel.md): linear (the replay.* coefficients below) or a "
            "calibrated preset whose step cost grows with the context held and attended to."),
    Setting("replay.step_fixed_ms", None, _float(0.0), 5.0, "a number >= 0", "Modelled fixed cost of one engine step."),
    Setting("replay.per_prefill_token_ms", None, _float(0.0), 0.02, "a number >= 0",
            "Modelled cost per prefill token in a step."),
    Setting("replay.per_decode_request_ms", None, _float(0.0), 0.1, "a number >= 0",
            "Modelled cost per decoding request in a step."),
    Setting("replay.oracle_reserve", None, _bool01, False, "true | false",
            "Replay only: the clairvoyant admission bound: admit a prefill only when the running set's peak future "
            "KV demand, with the candidate and each request's true output length, fits the pool (finishing requests "
            "give their blocks back)."),
    Setting("replay.unbounded_memory", None, _bool01, False, "true | false",
            "Replay only: a KV pool large enough for every request of the trace at once (memory is never the limit; "
            "the reference ceiling under the same cost model)."),
    Setting("replay.fetch", None, _choice("all", "engine"), "all", "all | engine",
            "Replay only: how arrived requests reach the scheduler's waiting queue. all: each as it arrives (the "
            "replay's model so far); engine: as the host's own engine hands them over on a mixed node (with the "
            "prepare mixin: one request, and only when the waiting queue is empty; without it: every arrived request "
            "while a batch slot is free), the rest queued first come first served in front of it "
            "(docs/evaluation.md)."),
    Setting("replay.retract_order", None, _choice("default", "sglang"), "default", "default | sglang",
            "Replay only: which decoding request a preemption picks; sglang: fewest generated tokens, then longest "
            "prompt (SGLang's retract order), through the victim hook."),
    Setting("replay.admission", None, _choice("default", "peak", "clip-learned"), "default",
            "default | peak | clip-learned",
            "Replay only, the candidate policies of docs/peak-admission.md: peak admits a prefill only when the "
            "running set's predicted peak KV demand fits the pool (remainders learned from finished requests); "
            "clip-learned is upstream's ratio formula with the clip learned online. default: the profile's own "
            "reservation."),
)

SCHEMA_BY_KEY = {s.key: s for s in SCHEMA}
PROFILE_TOP_KEYS = ("description",) + tuple(sorted({s.key.split(".")[0] for s in SCHEMA}))


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


def read_profile(path: Path) -> dict[str, Any]:
    """One profile file as ``{key path: raw value}``, the keys as written (``changes.others`` included); unknown and
    duplicate keys are errors (:func:`fdsched.core.profiles.read_keys`)."""
    return read_keys(path, PROFILE_TOP_KEYS, (*SCHEMA_BY_KEY, OTHERS_KEY))


# ---- loading ---------------------------------------------------------------------------------
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
    def where(key: str) -> str:
        return _where(key, sources, profile_path)

    fixed = "host_tunables.FD_RESERVE_{}OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL"
    _check_order(values, sources, "host_tunables.FD_MIN_NEW_TOKEN_RATIO", "host_tunables.FD_INIT_NEW_TOKEN_RATIO",
                 "a number", profile_path)
    _check_order(values, sources, fixed.format("MIN_"), fixed.format(""), "an integer", profile_path)
    est_k, ours_k = "tunables.reserve_estimator", "changes.ratio_reserve"
    host_k = "host_tunables.FD_USE_NEW_TOKEN_RATIO_RESERVE"
    host_set, mode = sources[host_k] != "default", values[ours_k]
    # The adaptive estimator answers only inside the plugin's ratio reservation.
    if values[est_k] == "adaptive" and mode == "off":
        raise SettingsError(f"{where(est_k)}: bad value 'adaptive'; it contradicts {where(ours_k)}='off'; allowed: "
                            "ratio with ratio_reserve=off, or adaptive with ratio_reserve=auto/on")
    if values[est_k] == "adaptive" and host_set and not values[host_k]:
        raise SettingsError(f"{where(est_k)}: bad value 'adaptive'; it contradicts {where(host_k)}=0 (the fixed-block "
                            "policy); allowed: ratio, or leave FD_USE_NEW_TOKEN_RATIO_RESERVE unset / 1")
    # The host's own switch for the ratio policy must not contradict ours when both are explicit.
    if host_set and ((mode == "on" and not values[host_k]) or (mode == "off" and values[host_k])):
        raise SettingsError(f"{where(host_k)}: bad value {int(values[host_k])!r}; it contradicts {where(ours_k)}="
                            f"{mode!r}; allowed: leave it unset, or {1 if mode == 'on' else 0} with "
                            f"ratio_reserve={mode}")


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

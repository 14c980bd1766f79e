"""The settings' key table: every setting as one row of :data:`SCHEMA` (its YAML key path, its environment variable,
its parser, its default, what is allowed and what it is for), the upstream changes' switches first (:data:`CHANGES`:
one line per change). :mod:`fdsched.core.settings` loads and checks the values; nothing here reads them.

A parser takes the raw value (a string from the environment, or whatever YAML gave) and returns the typed value, or
raises ValueError saying what is allowed; :func:`fdsched.core.settings.load_settings` adds where it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from fdsched.core.adaptive import K_BOUND, K_DECAY, K_DEFAULT, K_STEP
from fdsched.core.common import did_you_mean

__all__ = [
    "CHANGES", "CHANGE_IDS", "HOST_FIXES", "UPSTREAM_CHANGE_IDS", "OTHERS_KEY", "SWITCH_VALUES", "INT_SETTING_MAX",
    "Setting", "SCHEMA", "SCHEMA_BY_KEY", "PROFILE_TOP_KEYS", "parse_switch",
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


# --------------------------------------------------------------------------------------------
# Value parsers
# --------------------------------------------------------------------------------------------
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


SCHEMA: tuple[Setting, ...] = (
    *(_change(number, change_id, doc) for number, (change_id, doc) in enumerate(CHANGES, start=1)),
    Setting(
        "pd_prefill_cache.mode",
        "FDSCHED_PD_PREFILL_CACHE_MODE",
        _choice("safe", "upstream"),
        "safe",
        "safe | upstream",
        "safe: record only computed blocks, the rest after the prefill ran; upstream: record the whole prompt at "
        "preallocation (what 7387 does).",
    ),
    # ---- the host's own tunables, FastDeploy names and defaults ------------------------------
    Setting(
        "host_tunables.FD_USE_NEW_TOKEN_RATIO_RESERVE",
        "FD_USE_NEW_TOKEN_RATIO_RESERVE",
        _bool01,
        True,
        "0 | 1",
        "Host switch for the ratio reservation (a host with 7783). Setting it explicitly must agree with "
        "changes.ratio_reserve.",
    ),
    Setting(
        "host_tunables.FD_INIT_NEW_TOKEN_RATIO",
        "FD_INIT_NEW_TOKEN_RATIO",
        _float(0.0, 1.0),
        0.7,
        "a number in [0, 1]",
        "Initial new_token_ratio.",
    ),
    Setting(
        "host_tunables.FD_MIN_NEW_TOKEN_RATIO",
        "FD_MIN_NEW_TOKEN_RATIO",
        _float(0.0, 1.0),
        0.1,
        "a number in [0, 1], not above FD_INIT_NEW_TOKEN_RATIO",
        "Floor of new_token_ratio.",
    ),
    Setting(
        "host_tunables.FD_NEW_TOKEN_RATIO_DECAY",
        "FD_NEW_TOKEN_RATIO_DECAY",
        _float(0.0, 1.0),
        0.001,
        "a number in [0, 1]",
        "Subtracted from new_token_ratio after every schedule() that scheduled something.",
    ),
    Setting(
        "host_tunables.FD_CLIP_MAX_NEW_TOKENS",
        "FD_CLIP_MAX_NEW_TOKENS",
        _int(0),
        4096,
        "an integer >= 0",
        "Remaining output tokens per request are clipped to this before applying the ratio.",
    ),
    Setting(
        "host_tunables.FD_RESERVE_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
        "FD_RESERVE_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
        _int(0),
        16,
        "an integer >= 0",
        "Fixed-block reservation (ratio_reserve off): blocks reserved per running request after a preemption.",
    ),
    Setting(
        "host_tunables.FD_RESERVE_DECAY_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
        "FD_RESERVE_DECAY_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
        _float(0.0),
        0.025,
        "a number >= 0",
        "Fixed-block reservation (ratio_reserve off): decay of the per-request reservation per scheduling pass.",
    ),
    Setting(
        "host_tunables.FD_RESERVE_MIN_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
        "FD_RESERVE_MIN_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL",
        _int(0),
        0,
        "an integer >= 0, not above the fixed-block initial reservation",
        "Fixed-block reservation (ratio_reserve off): floor of the per-request reservation.",
    ),
    # ---- plugin tunables (upstream hard-codes these) ----------------------------------------
    Setting(
        "tunables.ratio_reestimate_extra_blocks",
        "FDSCHED_RATIO_REESTIMATE_EXTRA_BLOCKS",
        _int(0),
        16,
        "an integer >= 0",
        "Blocks per decoding request added to the generated tokens when the ratio is re-estimated after a "
        "preemption (upstream: 16; SGLang adds 20 tokens).",
    ),
    Setting(
        "tunables.ratio_reestimate_cap",
        "FDSCHED_RATIO_REESTIMATE_CAP",
        _cap,
        None,
        "init | a number in [0, 1]",
        "Cap of the re-estimated ratio: 'init' caps at FD_INIT_NEW_TOKEN_RATIO (upstream), SGLang uses 1.0.",
    ),
    Setting(
        "tunables.reserve_estimator",
        "FDSCHED_RESERVE_ESTIMATOR",
        _choice("ratio", "adaptive"),
        "ratio",
        "ratio | adaptive",
        "What running requests reserve when the plugin's ratio reservation runs (changes.ratio_reserve applied): "
        "ratio = upstream's new_token_ratio formula (PR 7444/7783); adaptive = the expected remaining output "
        "learned from the engine's finished requests plus one margin for the running set (fdsched.core.adaptive).",
    ),
    Setting(
        "tunables.adaptive_min_samples",
        "FDSCHED_ADAPTIVE_MIN_SAMPLES",
        _int(1),
        16,
        "an integer >= 1",
        "Adaptive estimator: finished requests of a kind (client max_tokens set / unset) needed before it "
        "answers for that kind; before that, the warm-up fallback (see README).",
    ),
    Setting(
        "tunables.adaptive_window",
        "FDSCHED_ADAPTIVE_WINDOW",
        _int(1),
        2000,
        "an integer >= 1",
        "Adaptive estimator: how many of the most recent finished requests it learns from (drift).",
    ),
    Setting(
        "tunables.adaptive_margin_k",
        "FDSCHED_ADAPTIVE_MARGIN_K",
        _float(-K_BOUND, K_BOUND),
        K_DEFAULT,
        f"a number in [{-K_BOUND:g}, {K_BOUND:g}]",
        "Adaptive estimator: the running set's margin is k standard deviations of its total remaining output; "
        "a negative k keeps less than the expected remainder free (requests that finish give their blocks back "
        f"while the others grow); each preemption raises k by tunables.adaptive_k_step (up to {K_BOUND:g}), each "
        "finished request leaves tunables.adaptive_k_decay of that extra.",
    ),
    Setting(
        "tunables.adaptive_k_step",
        "FDSCHED_ADAPTIVE_K_STEP",
        _float(0.0, 2 * K_BOUND),
        K_STEP,
        f"a number in [0, {2 * K_BOUND:g}]",
        f"Adaptive estimator: what each preemption adds to k (k never exceeds {K_BOUND:g}).",
    ),
    Setting(
        "tunables.adaptive_k_decay",
        "FDSCHED_ADAPTIVE_K_DECAY",
        _float(0.0, 1.0),
        K_DECAY,
        "a number in [0, 1]",
        "Adaptive estimator: the share of the preemptions' extra k that each finished request leaves "
        "(1: never decays, 0: gone at the next finished request).",
    ),
    Setting(
        "tunables.recycle_heapify_min_batch",
        "FDSCHED_RECYCLE_HEAPIFY_MIN_BATCH",
        _int(1),
        64,
        "an integer >= 1",
        "Deferred recycling: batches at least this large are merged with one heapify instead of one push per id.",
    ),
    Setting(
        "tunables.transfer_force_direct_recycle",
        "FDSCHED_TRANSFER_FORCE_DIRECT_RECYCLE",
        _bool01,
        False,
        "0 | 1",
        "Evict GPU blocks directly (the batched path of change 1) even where the host would swap them to the "
        "CPU tier; needs changes.deferred_recycle applied.",
    ),
    Setting(
        "tunables.transfer_wait_seconds",
        "FDSCHED_TRANSFER_WAIT_SECONDS",
        _float(0.001, 60.0),
        0.5,
        "a number in [0.001, 60]",
        "Non-polling transfer: how long one blocking wait for a transfer-done signal lasts before the receiver "
        "loop goes round again (the idle RPC rate is about 1 / this).",
    ),
    # ---- replay step-cost model (profile or command line only) ------------------------------
    Setting(
        "replay.cost_model",
        None,
        _as_written,
        "linear",
        "linear, a shipped preset name (fdsched replay --help) or a preset YAML file",
        "Step-cost model of the replay (docs/costmodel.md): linear (the replay.* coefficients below) or a "
        "calibrated preset whose step cost grows with the context held and attended to.",
    ),
    Setting("replay.step_fixed_ms", None, _float(0.0), 5.0, "a number >= 0", "Modelled fixed cost of one engine step."),
    Setting(
        "replay.per_prefill_token_ms",
        None,
        _float(0.0),
        0.02,
        "a number >= 0",
        "Modelled cost per prefill token in a step.",
    ),
    Setting(
        "replay.per_decode_request_ms",
        None,
        _float(0.0),
        0.1,
        "a number >= 0",
        "Modelled cost per decoding request in a step.",
    ),
    Setting(
        "replay.oracle_reserve",
        None,
        _bool01,
        False,
        "true | false",
        "Replay only: the clairvoyant admission bound: admit a prefill only when the running set's peak future "
        "KV demand, with the candidate and each request's true output length, fits the pool (finishing requests "
        "give their blocks back).",
    ),
    Setting(
        "replay.unbounded_memory",
        None,
        _bool01,
        False,
        "true | false",
        "Replay only: a KV pool large enough for every request of the trace at once (memory is never the limit; "
        "the reference ceiling under the same cost model).",
    ),
    Setting(
        "replay.fetch",
        None,
        _choice("all", "engine"),
        "all",
        "all | engine",
        "Replay only: how arrived requests reach the scheduler's waiting queue. all: each as it arrives (the "
        "replay's model so far); engine: as the host's own engine hands them over on a mixed node (with the prepare mixin: one "
        "request, and only when the waiting queue is empty; without it: every arrived request while a batch slot is "
        "free), the rest queued first come first served in front of it (docs/evaluation.md).",
    ),
    Setting(
        "replay.retract_order",
        None,
        _choice("default", "sglang"),
        "default",
        "default | sglang",
        "Replay only: which decoding request a preemption picks; sglang: fewest generated tokens, then longest "
        "prompt (SGLang's retract order), through the victim hook.",
    ),
    Setting(
        "replay.admission",
        None,
        _choice("default", "peak", "clip-learned"),
        "default",
        "default | peak | clip-learned",
        "Replay only, the candidate policies of docs/peak-admission.md: peak admits a prefill only when the running "
        "set's predicted peak KV demand fits the pool (remainders learned from finished requests); clip-learned is "
        "upstream's ratio formula with the clip learned online. default: the profile's own reservation.",
    ),
)

SCHEMA_BY_KEY = {s.key: s for s in SCHEMA}
PROFILE_TOP_KEYS = ("description",) + tuple(sorted({s.key.split(".")[0] for s in SCHEMA}))

"""Replay traces: the JSONL format, what a trace holds, its bounds, deterministic prompt tokens, writing one.

Reading a trace file and checking it line by line is :mod:`fdsched.replay.tracefile`. Imports nothing from
FastDeploy.

A trace is a UTF-8 text file with one JSON object per line (blank lines ignored): an optional header first
(``{"header": {"description": ..., "engine": {...}, "generator": {...}}}``: the engine the trace was made for,
every key optional and overridable on the command line), then one request per line::

    {"id": "r0", "arrival": 3, "prompt_len": 300, "prefix_group": "sys-a", "prefix_len": 256,
     "max_tokens": 512, "output_len": 400}

``arrival`` (an engine step) or ``arrival_s`` (seconds; a time-based trace), ``prompt`` (token ids) or
``prompt_len`` (a generated prompt; a ``prefix_group`` shares its first ``prefix_len`` tokens across requests and
traces), ``max_tokens`` (or null: the rest of the context), ``output_len`` (the true length). Requests may appear in
any order; the replay feeds them by ``(arrival or arrival_s, line)``. Errors name the file, the line and the field
(:class:`TraceError`). Every field and engine key, with its default and the allowed values: examples/replay.md,
"Trace format (JSONL)".
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

from fdsched.core.common import ceil_div
from fdsched.replay.tracehelp import fitting_max_model_len, shown_source

__all__ = [
    "TraceError",
    "TraceRequest",
    "Trace",
    "ENGINE_DEFAULTS",
    "ENGINE_KEYS",
    "ENGINE_MAX",
    "MAX_ARRIVAL_STEP",
    "MAX_ARRIVAL_S",
    "MAX_TOKENS",
    "VOCAB_SIZE",
    "SPLITWISE_ROLES",
    "Where",
    "dump_trace",
    "group_tokens",
    "request_tokens",
    "check_engine",
    "check_engine_shape",
    "min_gpu_blocks",
    "effective_output_len",
    "split_across_ranks",
    "DP_SPLIT_RULE",
]

VOCAB_SIZE = 50_000  # generated token ids are in [1, VOCAB_SIZE)

# Engine keys a header may set, with the replay's defaults (those of EngineShape).
ENGINE_DEFAULTS = {
    "block_size": 16,
    "num_gpu_blocks": 512,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 2048,
    "max_model_len": 4096,
    "enable_prefix_caching": True,
    "splitwise_role": "mixed",
    "enc_dec_block_num": 2,
}
ENGINE_KEYS = tuple(ENGINE_DEFAULTS)
# Upper bounds of every number a trace or the command line may give: far above any real engine or trace, low
# enough that a typo (an extra dozen digits) is refused in one line before the host is imported, rather than
# overflowing inside it or replaying an idle clock for ever.
ENGINE_MAX = {
    "block_size": 4096,
    "num_gpu_blocks": 1_000_000,
    "max_num_seqs": 65_536,
    "max_num_batched_tokens": 16_777_216,
    "max_model_len": 16_777_216,
    "enc_dec_block_num": 1024,
}
MAX_ARRIVAL_STEP = 10_000_000  # an arrival in engine steps (also the bound of --max-steps)
MAX_ARRIVAL_S = 31_536_000.0  # an arrival in seconds: one year
MAX_TOKENS = 2**31 - 1  # a token count (max_tokens, output_len, prompt_len): the host's int32
SPLITWISE_ROLES = ("mixed", "prefill")


class TraceError(ValueError):
    """A trace is malformed; the message names the file, line and field."""


@dataclass(frozen=True)
class TraceRequest:
    id: str
    arrival: int
    prompt_len: int
    output_len: int
    max_tokens: Optional[int] = None
    prompt: Optional[tuple] = None  # explicit token ids, or None (generated)
    prefix_group: Optional[str] = None
    prefix_len: int = 0
    line: int = 0
    arrival_s: Optional[float] = None  # time-based traces: seconds (then ``arrival`` is 0 and unused)

    @property
    def feed_key(self) -> tuple:
        return (self.arrival if self.arrival_s is None else self.arrival_s, self.line)

    @property
    def effective_output_len(self) -> int:
        """Tokens it really generates: stops at its end of sequence or at max_tokens."""
        return effective_output_len(self.output_len, self.max_tokens)

    def prompt_tokens(self) -> list:
        """The prompt's token ids (explicit, or generated deterministically)."""
        if self.prompt is not None:
            return list(self.prompt)
        return request_tokens(self.id, self.prompt_len, self.prefix_group, self.prefix_len)

    def to_json(self) -> dict:
        out: dict = {"id": self.id}
        if self.arrival_s is None:
            out["arrival"] = self.arrival
        else:
            out["arrival_s"] = self.arrival_s
        if self.prompt is not None:
            out["prompt"] = list(self.prompt)
        else:
            out["prompt_len"] = self.prompt_len
            if self.prefix_group is not None:
                out["prefix_group"] = self.prefix_group
                out["prefix_len"] = self.prefix_len
        out["max_tokens"] = self.max_tokens
        out["output_len"] = self.output_len
        return out


@dataclass(frozen=True)
class Trace:
    requests: tuple
    engine: dict = field(default_factory=dict)  # only the keys the header sets
    description: str = ""
    generator: Optional[dict] = None
    source: str = "<trace>"
    name: str = "trace"

    def engine_with(self, overrides: Optional[dict] = None) -> dict:
        """Defaults < header < overrides (None values in overrides are ignored)."""
        merged = dict(ENGINE_DEFAULTS)
        merged.update(self.engine)
        for key, value in (overrides or {}).items():
            if value is not None:
                merged[key] = value
        return merged

    @property
    def time_based(self) -> bool:
        """Arrivals in seconds (``arrival_s``) rather than engine steps."""
        return bool(self.requests) and self.requests[0].arrival_s is not None

    def in_feed_order(self) -> list:
        return sorted(self.requests, key=lambda r: r.feed_key)


def effective_output_len(output_len: int, max_tokens: Optional[int]) -> int:
    """The one rule for when a request stops: at its own end of sequence, or at max_tokens if set."""
    return output_len if max_tokens is None else min(output_len, max_tokens)


# --------------------------------------------------------------------------------------------
# Deterministic tokens
# --------------------------------------------------------------------------------------------
def _stream(label: str, count: int) -> list:
    seed = int.from_bytes(hashlib.sha256(label.encode("utf-8")).digest()[:8], "big")
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB_SIZE) for _ in range(count)]


def group_tokens(group: str, count: int) -> list:
    """The first ``count`` tokens of a prefix group (a prefix of a longer request is the same)."""
    return _stream("group:" + group, count)


def request_tokens(request_id: str, prompt_len: int, prefix_group: Optional[str], prefix_len: int) -> list:
    if prefix_group is None:
        prefix_len = 0
    head = group_tokens(prefix_group, prefix_len) if prefix_len else []
    return head + _stream("request:" + request_id, prompt_len - prefix_len)


# --------------------------------------------------------------------------------------------
# Checking a trace against an engine
# --------------------------------------------------------------------------------------------
class Where:
    """A line of a trace file, for an error that names it (and the field)."""

    def __init__(self, source: str, line: int) -> None:
        self.source, self.line = source, line

    def error(self, field_name: Optional[str], problem: str) -> TraceError:
        where = f"{shown_source(self.source)} line {self.line}"
        if field_name:
            where += f", field {field_name!r}"
        return TraceError(f"trace {where}: {problem}")


def check_engine_shape(engine: dict) -> None:
    """The one check of an engine shape (the replay's, the host test harness's, an importer's header)."""
    block_size, max_len = engine["block_size"], engine["max_model_len"]
    need = min_gpu_blocks(max_len, block_size)
    if engine["num_gpu_blocks"] < need:
        raise TraceError(
            f"engine num_gpu_blocks={engine['num_gpu_blocks']} is too small for max_model_len={max_len} and "
            f"block_size={block_size}; allowed: at least max_model_len / block_size + 2 = {need}"
        )
    if engine["max_num_batched_tokens"] < max(engine["max_num_seqs"], block_size):
        raise TraceError(
            f"engine max_num_batched_tokens={engine['max_num_batched_tokens']} is too small; allowed: at least "
            f"max(max_num_seqs, block_size) = {max(engine['max_num_seqs'], block_size)}"
        )
    if engine["splitwise_role"] not in SPLITWISE_ROLES:
        raise TraceError(f"engine splitwise_role={engine['splitwise_role']!r}; allowed: {', '.join(SPLITWISE_ROLES)}")
    if engine["max_num_batched_tokens"] > engine["max_num_seqs"] * max_len:
        raise TraceError(
            f"engine max_num_batched_tokens={engine['max_num_batched_tokens']} is too large; allowed: at most "
            f"max_num_seqs * max_model_len = {engine['max_num_seqs'] * max_len} (the host's config check)"
        )


def min_gpu_blocks(max_model_len: int, block_size: int) -> int:
    """The smallest pool the host accepts: one sequence of max_model_len tokens plus 2 blocks."""
    return ceil_div(max_model_len, block_size) + 2


def check_engine(trace: Trace, engine: dict) -> None:
    """Check the engine shape and that every request can run on it (errors name the line)."""
    check_engine_shape(engine)
    max_len = engine["max_model_len"]
    for request in trace.requests:
        where = Where(trace.source, request.line)
        raise_to = f"allowed: max_model_len (--max-model-len) {fitting_max_model_len(trace.requests)} or more, where every request fits"
        if request.prompt_len >= max_len:
            raise where.error("prompt_len", f"{request.prompt_len} does not fit max_model_len={max_len}; {raise_to}")
        total = request.prompt_len + request.effective_output_len
        if total > max_len:
            field_name = "output_len" if request.max_tokens is None or request.output_len <= request.max_tokens else "max_tokens"
            raise where.error(
                field_name,
                f"prompt ({request.prompt_len}) + output ({request.effective_output_len}) = {total} exceeds "
                f"max_model_len={max_len}; {raise_to}",
            )


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
def dump_trace(requests: Sequence, engine: Optional[dict] = None, description: str = "", generator: Optional[dict] = None) -> str:
    """JSONL text (header first when there is one); requests are dicts or :class:`TraceRequest`."""
    lines = []
    if engine or description or generator:
        header: dict = {}
        if description:
            header["description"] = description
        if engine:
            header["engine"] = dict(engine)
        if generator:
            header["generator"] = dict(generator)
        lines.append(json.dumps({"header": header}, separators=(", ", ": ")))
    for request in requests:
        obj = request.to_json() if isinstance(request, TraceRequest) else request
        lines.append(json.dumps(obj, separators=(", ", ": ")))
    return "\n".join(lines) + "\n"


# How the replay spreads one trace over data-parallel ranks, in words (the report repeats it).
DP_SPLIT_RULE = (
    "each request goes to a rank drawn uniformly at random (random.Random(seed)), as FastDeploy's Router picks a "
    "mixed instance (fastdeploy/router/router.py, Router.select_mixed: random.randint over the registered servers)"
)


def split_across_ranks(trace: Trace, ranks: Sequence[int], seed: int = 0) -> dict:
    """rank -> the sub-trace that rank would serve when one traffic stream is spread over ``ranks``.

    The draw is uniform and independent per request (``random.Random(seed)``, in trace order), which is what
    FastDeploy's Router does for mixed instances (``Router.select_mixed``: ``random.randint`` over the registered
    servers; fastdeploy/router/router.py line 171 on e7c8dc2, 198 on d38eeb8);
    one api_server with the default local scheduler sends everything to rank 0 instead (see
    examples/ab_run.md). Every request keeps its own arrival; a rank's sub-trace is named ``<trace>@dp<rank>``.
    """
    ordered = sorted(set(int(r) for r in ranks))
    if not ordered:
        raise TraceError("split_across_ranks: no ranks; allowed: one or more data-parallel ranks")
    rng = random.Random(seed)
    shares: dict = {rank: [] for rank in ordered}
    for request in trace.requests:
        shares[ordered[rng.randrange(len(ordered))]].append(request)
    return {
        rank: Trace(
            requests=tuple(requests),
            engine=dict(trace.engine),
            description=trace.description,
            generator=trace.generator,
            source=trace.source,
            name=f"{trace.name}@dp{rank}",
        )
        for rank, requests in shares.items()
    }

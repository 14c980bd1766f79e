"""Replay traces: the JSONL format, its validation, and deterministic prompt tokens.

Imports nothing from FastDeploy.

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
import math
import os
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from fdsched.core.common import ceil_div, did_you_mean, read_utf8
from fdsched.replay.tracehelp import TRACE_FORMAT, fitting_max_model_len, shown_source

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
    "parse_trace",
    "load_trace",
    "resolve_trace",
    "shipped_traces",
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
_HEADER_KEYS = ("description", "engine", "generator")
_REQUEST_KEYS = ("id", "arrival", "arrival_s", "prompt", "prompt_len", "prefix_group", "prefix_len", "max_tokens", "output_len")


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
# Parsing and validation
# --------------------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Where:
    def __init__(self, source: str, line: int) -> None:
        self.source, self.line = source, line

    def error(self, field_name: Optional[str], problem: str) -> TraceError:
        where = f"{shown_source(self.source)} line {self.line}"
        if field_name:
            where += f", field {field_name!r}"
        return TraceError(f"trace {where}: {problem}")


def _check_int(where: _Where, name: str, value: Any, lo: int, hi: Optional[int] = None) -> int:
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        allowed = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
        raise where.error(name, f"bad value {value!r}; allowed: {allowed}")
    return value


def _parse_engine(where: _Where, raw: Any) -> dict:
    if not isinstance(raw, dict):
        raise where.error("header.engine", f"bad value {raw!r}; allowed: an object with keys {', '.join(ENGINE_KEYS)}")
    engine = {}
    for key, value in raw.items():
        name = f"header.engine.{key}"
        if key not in ENGINE_DEFAULTS:
            raise where.error(name, f"unknown key; allowed: {', '.join(ENGINE_KEYS)}")
        if key == "enable_prefix_caching":
            if not isinstance(value, bool):
                raise where.error(name, f"bad value {value!r}; allowed: true or false")
        elif key == "splitwise_role":
            if value not in SPLITWISE_ROLES:
                raise where.error(name, f"bad value {value!r}; allowed: {', '.join(SPLITWISE_ROLES)}")
        else:
            _check_int(where, name, value, 0 if key == "enc_dec_block_num" else 1, ENGINE_MAX[key])
        engine[key] = value
    return engine


def _parse_header(where: _Where, raw: Any) -> tuple:
    if not isinstance(raw, dict):
        raise where.error("header", f"bad value {raw!r}; allowed: an object with keys {', '.join(_HEADER_KEYS)}")
    for key in raw:
        if key not in _HEADER_KEYS:
            raise where.error(f"header.{key}", f"unknown key; allowed: {', '.join(_HEADER_KEYS)}")
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise where.error("header.description", f"bad value {description!r}; allowed: a string")
    generator = raw.get("generator")
    if generator is not None and not isinstance(generator, dict):
        raise where.error("header.generator", f"bad value {generator!r}; allowed: an object")
    engine = _parse_engine(where, raw.get("engine", {}))
    return engine, description, generator


def _parse_request(where: _Where, raw: dict) -> TraceRequest:
    for key in raw:
        if key not in _REQUEST_KEYS:
            raise where.error(key, f"unknown field; allowed: {', '.join(_REQUEST_KEYS)}")
    for required in ("id", "output_len"):
        if required not in raw:
            raise where.error(required, "missing (required)")
    rid = raw["id"]
    if not isinstance(rid, str) or not rid:
        raise where.error("id", f"bad value {rid!r}; allowed: a non-empty string")
    if ("arrival" in raw) == ("arrival_s" in raw):
        raise where.error("arrival", "give exactly one of 'arrival' (an engine step) or 'arrival_s' (seconds)")
    arrival, arrival_s = 0, None
    if "arrival" in raw:
        arrival = _check_int(where, "arrival", raw["arrival"], 0, MAX_ARRIVAL_STEP)
    else:
        arrival_s = raw["arrival_s"]
        if not isinstance(arrival_s, (int, float)) or isinstance(arrival_s, bool) or not math.isfinite(arrival_s) \
                or not 0 <= arrival_s <= MAX_ARRIVAL_S:
            raise where.error("arrival_s", f"bad value {arrival_s!r}; allowed: a number of seconds in "
                              f"[0, {MAX_ARRIVAL_S:.0f}] (one year)")
        arrival_s = float(arrival_s)
    output_len = _check_int(where, "output_len", raw["output_len"], 1, MAX_TOKENS)
    if "max_tokens" not in raw:
        raise where.error("max_tokens", "missing (required; null means the engine's default)")
    max_tokens = raw["max_tokens"]
    if max_tokens is not None:
        max_tokens = _check_int(where, "max_tokens", max_tokens, 1, MAX_TOKENS)

    has_prompt, has_len = "prompt" in raw, "prompt_len" in raw
    if has_prompt == has_len:
        raise where.error("prompt", "give exactly one of 'prompt' (token ids) or 'prompt_len'")
    prompt = None
    prefix_group, prefix_len = None, 0
    if has_prompt:
        tokens = raw["prompt"]
        if not isinstance(tokens, list) or not tokens:
            raise where.error("prompt", f"bad value {tokens!r}; allowed: a non-empty list of token ids")
        for index, token in enumerate(tokens):
            if not _is_int(token) or not 0 <= token <= MAX_TOKENS:
                raise where.error("prompt", f"bad token {token!r} at index {index}; allowed: integers in "
                                  f"[0, {MAX_TOKENS}]")
        for key in ("prefix_group", "prefix_len"):
            if key in raw:
                raise where.error(key, "only allowed with 'prompt_len' (an explicit prompt has its own tokens)")
        prompt = tuple(tokens)
        prompt_len = len(tokens)
    else:
        prompt_len = _check_int(where, "prompt_len", raw["prompt_len"], 1, MAX_TOKENS)
        if ("prefix_group" in raw) != ("prefix_len" in raw):
            missing = "prefix_len" if "prefix_group" in raw else "prefix_group"
            raise where.error(missing, "missing: 'prefix_group' and 'prefix_len' go together")
        if "prefix_group" in raw:
            prefix_group = raw["prefix_group"]
            if not isinstance(prefix_group, str) or not prefix_group:
                raise where.error("prefix_group", f"bad value {prefix_group!r}; allowed: a non-empty string")
            prefix_len = _check_int(where, "prefix_len", raw["prefix_len"], 0, prompt_len)
    return TraceRequest(
        id=rid,
        arrival=arrival,
        prompt_len=prompt_len,
        output_len=output_len,
        max_tokens=max_tokens,
        prompt=prompt,
        prefix_group=prefix_group,
        prefix_len=prefix_len,
        line=where.line,
        arrival_s=arrival_s,
    )


def parse_trace(lines: Iterable[str], source: str = "<trace>", name: Optional[str] = None) -> Trace:
    """Parse and validate JSONL lines. Raises :class:`TraceError` at the first problem."""
    engine: dict = {}
    description, generator = "", None
    requests: list = []
    seen: dict = {}
    first_object = True
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        where = _Where(source, number)
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            detail = f"not valid JSON: {exc.msg} (column {exc.colno}); allowed: {TRACE_FORMAT}"
            raise where.error(None, detail) from None
        if not isinstance(obj, dict):
            got = type(obj).__name__
            raise where.error(None, f"each line must be a JSON object, got {got}; allowed: {TRACE_FORMAT}")
        if "header" in obj:
            if not first_object:
                raise where.error("header", "a header is only allowed on the first line")
            if len(obj) != 1:
                extra = sorted(k for k in obj if k != "header")
                raise where.error(extra[0], "a header line holds only the 'header' object")
            engine, description, generator = _parse_header(where, obj["header"])
        else:
            request = _parse_request(where, obj)
            if requests and (request.arrival_s is None) != (requests[0].arrival_s is None):
                first = "arrival_s" if requests[0].arrival_s is not None else "arrival"
                raise where.error(
                    "arrival_s" if request.arrival_s is not None else "arrival",
                    f"mixes step and time arrivals; this trace uses {first!r} (line {requests[0].line})",
                )
            if request.id in seen:
                raise where.error("id", f"duplicate id {request.id!r} (first on line {seen[request.id]})")
            seen[request.id] = number
            requests.append(request)
        first_object = False
    if not requests:
        raise TraceError(f"trace {shown_source(source)}: no requests; allowed: {TRACE_FORMAT}")
    stem = name or Path(source).name.split(".")[0] or "trace"
    return Trace(tuple(requests), engine, description, generator, source, stem)


def load_trace(path) -> Trace:
    path = Path(path)
    text = read_utf8(path, "trace", "a JSONL trace file (fdsched trace validate checks one)", TraceError)
    if path.suffix.lower() == ".csv" and not text.lstrip().startswith("{"):
        raise TraceError(f"trace {path}: a CSV file, not a trace; allowed: {TRACE_FORMAT}. A CSV request log becomes "
                         f"one with: fdsched trace import {path} --format azure|burstgpt|generic --out TRACE.jsonl")
    return parse_trace(text.splitlines(), source=str(path), name=path.name[: -len(".jsonl")] if path.name.endswith(".jsonl") else path.stem)


def shipped_traces() -> dict:
    """Shipped trace name -> path."""
    folder = resources.files("fdsched.replay") / "traces"
    found = {}
    if folder.is_dir():
        for entry in folder.iterdir():
            if entry.name.endswith(".jsonl"):
                found[entry.name[: -len(".jsonl")]] = Path(str(entry))
    return dict(sorted(found.items()))


def resolve_trace(value: str) -> Path:
    """A shipped trace name, or the path of a JSONL file."""
    value = value.strip()
    shipped = shipped_traces()
    if value in shipped:
        return shipped[value]
    if os.sep in value or value.endswith(".jsonl") or os.path.exists(value):
        path = Path(value).expanduser()
        if path.is_dir():
            raise TraceError(f"trace {value!r}: is a directory; allowed: a shipped trace ({', '.join(shipped)}) or the path of a JSONL file")
        if not path.is_file():
            raise TraceError(f"trace {value!r}: no such file; allowed: a shipped trace ({', '.join(shipped)}) or a path")
        return path
    raise TraceError(f"trace {value!r}: unknown{did_you_mean(value, shipped)}; allowed: a shipped trace ({', '.join(shipped)}) "
                     "or the path of a JSONL file")


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
        where = _Where(trace.source, request.line)
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

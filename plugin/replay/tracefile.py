"""Trace files: the shipped ones, a name or path resolved to one, and a file read and checked line by line.

What a trace is (its requests, header, bounds and prompt tokens) is :mod:`fdsched.replay.trace`; this module turns
JSONL text into one (:func:`parse_trace`, :func:`load_trace`). Every line is checked as it is read, field by field
in a fixed order, and the first problem is one :class:`fdsched.replay.trace.TraceError` naming the file, the line and
the field. Imports nothing from FastDeploy.
"""

from __future__ import annotations

import json
import math
import os
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Optional

from fdsched.core.common import did_you_mean, read_utf8
from fdsched.replay.trace import (
    ENGINE_DEFAULTS, ENGINE_KEYS, ENGINE_MAX, MAX_ARRIVAL_S, MAX_ARRIVAL_STEP, MAX_TOKENS, SPLITWISE_ROLES, Trace,
    TraceError, TraceRequest, Where,
)
from fdsched.replay.tracehelp import TRACE_FORMAT, shown_source

__all__ = ["parse_trace", "load_trace", "resolve_trace", "shipped_traces"]

_HEADER_KEYS = ("description", "engine", "generator")
_REQUEST_KEYS = ("id", "arrival", "arrival_s", "prompt", "prompt_len", "prefix_group", "prefix_len", "max_tokens", "output_len")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(where: Where, name: str, value: Any, lo: int, hi: Optional[int] = None) -> int:
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        allowed = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
        raise where.error(name, f"bad value {value!r}; allowed: {allowed}")
    return value


def _parse_engine(where: Where, raw: Any) -> dict:
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


def _parse_header(where: Where, raw: Any) -> tuple:
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


def _parse_request(where: Where, raw: dict) -> TraceRequest:
    """One request line, its fields checked in a fixed order (the first problem is the one reported)."""
    for key in raw:
        if key not in _REQUEST_KEYS:
            raise where.error(key, f"unknown field; allowed: {', '.join(_REQUEST_KEYS)}")
    for required in ("id", "output_len"):
        if required not in raw:
            raise where.error(required, "missing (required)")
    rid = raw["id"]
    if not isinstance(rid, str) or not rid:
        raise where.error("id", f"bad value {rid!r}; allowed: a non-empty string")
    arrival, arrival_s = _parse_arrival(where, raw)
    output_len = _check_int(where, "output_len", raw["output_len"], 1, MAX_TOKENS)
    if "max_tokens" not in raw:
        raise where.error("max_tokens", "missing (required; null means the engine's default)")
    max_tokens = raw["max_tokens"]
    if max_tokens is not None:
        max_tokens = _check_int(where, "max_tokens", max_tokens, 1, MAX_TOKENS)
    prompt, prompt_len, prefix_group, prefix_len = _parse_prompt(where, raw)
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


def _parse_arrival(where: Where, raw: dict) -> tuple:
    """``(arrival, arrival_s)``: an engine step, or seconds (then ``arrival`` is 0)."""
    if ("arrival" in raw) == ("arrival_s" in raw):
        raise where.error("arrival", "give exactly one of 'arrival' (an engine step) or 'arrival_s' (seconds)")
    if "arrival" in raw:
        return _check_int(where, "arrival", raw["arrival"], 0, MAX_ARRIVAL_STEP), None
    arrival_s = raw["arrival_s"]
    if not isinstance(arrival_s, (int, float)) or isinstance(arrival_s, bool) or not math.isfinite(arrival_s) \
            or not 0 <= arrival_s <= MAX_ARRIVAL_S:
        raise where.error("arrival_s", f"bad value {arrival_s!r}; allowed: a number of seconds in "
                          f"[0, {MAX_ARRIVAL_S:.0f}] (one year)")
    return 0, float(arrival_s)


def _parse_prompt(where: Where, raw: dict) -> tuple:
    """``(prompt, prompt_len, prefix_group, prefix_len)``: explicit token ids, or a length (with a prefix group)."""
    has_prompt, has_len = "prompt" in raw, "prompt_len" in raw
    if has_prompt == has_len:
        raise where.error("prompt", "give exactly one of 'prompt' (token ids) or 'prompt_len'")
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
        return tuple(tokens), len(tokens), None, 0
    prompt_len = _check_int(where, "prompt_len", raw["prompt_len"], 1, MAX_TOKENS)
    if ("prefix_group" in raw) != ("prefix_len" in raw):
        missing = "prefix_len" if "prefix_group" in raw else "prefix_group"
        raise where.error(missing, "missing: 'prefix_group' and 'prefix_len' go together")
    if "prefix_group" not in raw:
        return None, prompt_len, None, 0
    prefix_group = raw["prefix_group"]
    if not isinstance(prefix_group, str) or not prefix_group:
        raise where.error("prefix_group", f"bad value {prefix_group!r}; allowed: a non-empty string")
    return None, prompt_len, prefix_group, _check_int(where, "prefix_len", raw["prefix_len"], 0, prompt_len)


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
        where = Where(source, number)
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

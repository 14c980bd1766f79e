"""``fdsched trace import``: public request logs (CSV) to time-based replay traces. No host needed.

Formats (the first row is the header; columns are found by name):

``azure``
    Azure LLM inference trace (Azure/AzurePublicDataset, 2023 and 2024):
    ``TIMESTAMP,ContextTokens,GeneratedTokens``; TIMESTAMP is a date and time
    (``2023-11-16 18:15:46.6805900``).
``burstgpt``
    BurstGPT (HPMLL/BurstGPT): ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``
    (BurstGPT_3 adds ``Session ID`` and ``Elapsed time``); Timestamp is seconds. Failed requests
    (``Response tokens`` 0, or a ``Log Type`` that names a failure) are skipped and counted.
``generic``
    any CSV, with ``--columns time=COL,prompt=COL,output=COL`` (time: seconds, or an ISO date and time).

The input is read as a stream (one row at a time; files of millions of rows are fine) and must be
UTF-8 (a UTF-8 byte-order mark is accepted). Rows must be in time order. A bad row stops the import
with one error naming ``file:line``, the column, the value and what is allowed, and nothing is
written: the trace goes to a temporary file that is renamed only when the import succeeded.

Options: a time window (``--start`` seconds after the first row, ``--duration`` seconds,
``--limit`` rows), ``--rate-scale`` (arrival times are divided by it: 2 doubles the request rate),
``--sample`` (keep each row with this probability, seeded by ``--seed``), the clients'
``max_tokens`` (``unset``: null, the engine's default; ``true``: each request's true output length;
an integer: that value for every request), and the engine shape for the header. Requests that do
not fit ``max_model_len`` are truncated (the prompt first, then the output) and counted.
"""

from __future__ import annotations

import codecs
import csv
import math
import os
import random
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator, Optional

from fdsched.core.common import plural
from fdsched.replay.trace import ENGINE_DEFAULTS, TraceError, check_engine_shape, dump_trace

__all__ = [
    "FORMATS", "ImportOptions", "ImportResult", "ImportError_", "import_trace", "import_summary", "parse_columns",
    "parse_max_tokens",
]

# format -> {role: column name}
FORMATS = {
    "azure": {"time": "TIMESTAMP", "prompt": "ContextTokens", "output": "GeneratedTokens"},
    "burstgpt": {"time": "Timestamp", "prompt": "Request tokens", "output": "Response tokens", "log_type": "Log Type"},
    "generic": {},
}
ROLES = ("time", "prompt", "output")
TIME_FORMATS = {"azure": "datetime", "burstgpt": "seconds", "generic": "auto"}
SOURCES = {
    "azure": "Azure LLM inference trace (github.com/Azure/AzurePublicDataset), CC-BY-4.0; Patel et al., "
    "\"Splitwise: Efficient generative LLM inference using phase splitting\", ISCA 2024",
    "burstgpt": "BurstGPT (github.com/HPMLL/BurstGPT), CC-BY-4.0; Wang et al., \"BurstGPT: A Real-World Workload "
    "Dataset to Optimize LLM Serving Systems\", KDD 2025",
}


class ImportError_(TraceError):
    """The input cannot be imported; the message names the file, line, column and value."""


@dataclass
class ImportOptions:
    fmt: str
    columns: dict = field(default_factory=dict)  # generic: role -> column name
    start_s: float = 0.0
    duration_s: Optional[float] = None
    limit: Optional[int] = None
    rate_scale: float = 1.0
    sample: float = 1.0
    seed: int = 0
    max_tokens: object = "unset"  # "unset" | "true" | int
    engine: dict = field(default_factory=dict)
    id_prefix: str = "q"
    description: str = ""


@dataclass
class ImportResult:
    requests: int
    skipped_failed: int
    truncated: int
    rows_read: int
    first_arrival_s: float
    last_arrival_s: float


def parse_columns(text: str) -> dict:
    """``time=COL,prompt=COL,output=COL`` -> {role: column}."""
    out = {}
    for part in text.split(","):
        if "=" not in part:
            raise ImportError_(f"--columns {text!r}: {part!r} is not ROLE=COLUMN; allowed roles: {', '.join(ROLES)}")
        role, column = (p.strip() for p in part.split("=", 1))
        if role not in ROLES:
            raise ImportError_(f"--columns {text!r}: unknown role {role!r}; allowed: {', '.join(ROLES)}")
        out[role] = column
    missing = [r for r in ROLES if r not in out]
    if missing:
        raise ImportError_(f"--columns {text!r}: missing {', '.join(missing)}; allowed: time=COL,prompt=COL,output=COL")
    return out


def parse_max_tokens(text: str):
    if text in ("unset", "true"):
        return text
    from fdsched.replay.trace import MAX_TOKENS

    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_TOKENS:
        raise ImportError_(f"--max-tokens {text!r}; allowed: unset, true, or an integer in [1, {MAX_TOKENS}]")
    return value


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
def _open_text(path: Path):
    if path.is_dir():
        raise ImportError_(f"{path}: is a directory; allowed: a CSV file")
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise ImportError_(f"{path}: cannot be read ({exc.strerror}); allowed: a readable CSV file") from None
    head = handle.read(4)
    handle.seek(0)
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE, codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)) or (
        len(head) >= 2 and (head[0] == 0 or head[1] == 0)
    ):
        handle.close()
        raise ImportError_(
            f"{path}: looks like UTF-16/UTF-32 text (a Windows tool's 'Unicode'); allowed: UTF-8 "
            f"(convert with: iconv -f UTF-16 -t UTF-8 {path.name} > out.csv)"
        )
    return codecs.getreader("utf-8-sig")(handle, errors="strict")


def _rows(path: Path) -> Iterator[tuple]:
    """(line number, header, row) for every data row; the header comes first as (1, header, None)."""
    text = _open_text(path)
    reader = csv.reader(text, strict=True)
    try:
        try:
            header = next(reader)
        except StopIteration:
            raise ImportError_(f"{path}:1: the file is empty; allowed: a CSV file with a header row") from None
        yield reader.line_num, [h.strip() for h in header], None
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            yield reader.line_num, header, row
    except csv.Error as exc:
        raise ImportError_(f"{path}:{reader.line_num + 1}: malformed CSV ({exc}); allowed: comma-separated values") from None
    except UnicodeDecodeError as exc:
        raise ImportError_(
            f"{path}:{reader.line_num + 1}: not UTF-8 (byte 0x{exc.object[exc.start]:02x}); allowed: UTF-8 text"
        ) from None
    finally:
        text.close()


def _parse_time(kind: str) -> Callable[[str], float]:
    def seconds(value: str) -> float:
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(value)
        return number

    def date_time(value: str) -> float:
        value = value.strip()
        main, _, fraction = value.partition(".")
        stamp = datetime.fromisoformat(main.replace("T", " ").rstrip("Z"))
        extra = float("0." + fraction) if fraction else 0.0
        if fraction and not fraction.isdigit():
            raise ValueError(value)
        return stamp.timestamp() + extra

    def auto(value: str) -> float:
        try:
            return seconds(value)
        except ValueError:
            return date_time(value)

    return {"seconds": seconds, "datetime": date_time, "auto": auto}[kind]


_TIME_ALLOWED = {
    "seconds": "a number of seconds",
    "datetime": "a date and time like 2023-11-16 18:15:46.6805900",
    "auto": "a number of seconds or an ISO date and time",
}


def _failed(log_type: Optional[str]) -> bool:
    return bool(log_type) and any(word in log_type.lower() for word in ("fail", "error"))


# --------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------
def import_trace(source, out, options: ImportOptions) -> ImportResult:
    """Read ``source`` (CSV), write ``out`` (JSONL trace) atomically. Raises :class:`ImportError_`."""
    source, out = Path(source), Path(out)
    columns, engine = _checked_options(options)
    requests, tally = _select_requests(source, columns, options, engine["max_model_len"])
    if not requests:
        window = f"start {options.start_s} s" + (f", duration {options.duration_s} s" if options.duration_s else "")
        raise ImportError_(
            f"{source}: no requests in the window ({window}; {tally['rows_read']} rows read, {tally['skipped']} failed "
            "or empty skipped); allowed: a window that holds at least one request"
        )
    text = dump_trace(requests, engine={k: engine[k] for k in ENGINE_DEFAULTS},
                      description=_description(source, options, len(requests)),
                      generator=_generator_record(source, options, tally))
    _write_atomically(out, text)
    return ImportResult(len(requests), tally["skipped"], tally["truncated"], tally["rows_read"],
                        requests[0]["arrival_s"], requests[-1]["arrival_s"])


def _checked_options(options: ImportOptions) -> tuple:
    """The column map and the engine shape of ``options``, or :class:`ImportError_` naming the bad option."""
    if options.fmt not in FORMATS:
        raise ImportError_(f"format {options.fmt!r}; allowed: {', '.join(FORMATS)}")
    columns = dict(options.columns) if options.fmt == "generic" else dict(FORMATS[options.fmt])
    if options.fmt == "generic" and not columns:
        raise ImportError_("format generic needs --columns time=COL,prompt=COL,output=COL")
    if not options.rate_scale > 0:
        raise ImportError_(f"--rate-scale {options.rate_scale}; allowed: a number > 0")
    if not 0 < options.sample <= 1:
        raise ImportError_(f"--sample {options.sample}; allowed: a number in (0, 1]")
    engine = dict(ENGINE_DEFAULTS)
    engine.update({k: v for k, v in options.engine.items() if v is not None})
    check_engine_shape(engine)
    return columns, engine


def _parsed_rows(source: Path, columns: dict, fmt: str):
    """Yield ``(line, time, counts, cell)`` for every data row of ``source``, in file order: ``counts`` holds the
    prompt and output token counts, ``cell(role)`` a row's raw text. Raises :class:`ImportError_` naming the line,
    column and value of the first bad row."""
    parse_time = _parse_time(TIME_FORMATS[fmt])
    previous = None
    index_of = {}
    for line, header, row in _rows(source):
        if row is None:
            for role, name in columns.items():
                if name not in header:
                    raise ImportError_(
                        f"{source}:{line}, column {name!r}: missing from the header ({', '.join(header)}); "
                        f"allowed: a CSV in the {fmt} format, with columns {', '.join(columns.values())}"
                    )
            index_of = {role: header.index(name) for role, name in columns.items()}
            continue
        if not row or (len(row) == 1 and not row[0].strip()):
            continue  # a blank line
        if len(row) != len(header):
            missing = header[len(row)] if len(row) < len(header) else None
            raise ImportError_(
                f"{source}:{line}, column {missing!r}: row has {len(row)} fields, the header {len(header)}"
                + (" (truncated row?)" if missing else "")
                + f"; allowed: {len(header)} comma-separated fields"
            )

        def cell(role, row=row):
            return row[index_of[role]].strip()

        raw_time = cell("time")
        try:
            t = parse_time(raw_time)
        except ValueError:
            raise ImportError_(
                f"{source}:{line}, column {columns['time']!r}, value {raw_time!r}: unparsable time; allowed: "
                f"{_TIME_ALLOWED[TIME_FORMATS[fmt]]}"
            ) from None
        if previous is not None and t < previous:
            raise ImportError_(
                f"{source}:{line}, column {columns['time']!r}, value {raw_time!r}: earlier than the row before; "
                "allowed: rows in time order"
            )
        previous = t
        counts = {role: _token_count(cell(role), f"{source}:{line}, column {columns[role]!r}")
                  for role in ("prompt", "output")}
        yield line, t, counts, cell


def _token_count(raw: str, where: str) -> int:
    """A token count cell: an integer >= 0 (``12`` or ``12.0``), else :class:`ImportError_`."""
    try:
        value = int(raw)
    except ValueError:
        try:
            as_float = float(raw)
        except ValueError:
            as_float = None
        value = int(as_float) if as_float is not None and as_float.is_integer() else None
    if value is None or value < 0:
        raise ImportError_(f"{where}, value {raw!r}: bad token count; allowed: an integer >= 0")
    return value


def _select_requests(source: Path, columns: dict, options: ImportOptions, max_len: int) -> tuple:
    """The trace's requests from the rows inside the window (``start_s``, ``duration_s``, ``limit``, ``sample``),
    and a tally of rows read, rows skipped (failed or empty) and requests truncated to ``max_len``."""
    rng = random.Random(options.seed)
    requests = []
    tally = {"rows_read": 0, "skipped": 0, "truncated": 0}
    first_time = None
    for _line, t, counts, cell in _parsed_rows(source, columns, options.fmt):
        tally["rows_read"] += 1
        if first_time is None:
            first_time = t
        offset = t - first_time
        if offset < options.start_s:
            continue
        if options.duration_s is not None and offset >= options.start_s + options.duration_s:
            break
        if options.limit is not None and len(requests) >= options.limit:
            break
        if options.fmt == "burstgpt" and (counts["output"] == 0 or _failed(cell("log_type"))):
            tally["skipped"] += 1
            continue
        if counts["output"] == 0 or counts["prompt"] == 0:
            tally["skipped"] += 1  # nothing to prefill or nothing generated: not a request the scheduler would run
            continue
        if options.sample < 1 and rng.random() >= options.sample:
            continue
        prompt, output = counts["prompt"], counts["output"]
        if prompt + output > max_len:
            tally["truncated"] += 1
            prompt = max(min(prompt, max_len - 1 - min(output, max_len // 2)), 1)
            output = min(output, max_len - prompt)
        requests.append({
            "id": f"{options.id_prefix}{len(requests):06d}",
            "arrival_s": round((offset - options.start_s) / options.rate_scale, 6),
            "prompt_len": prompt,
            "max_tokens": _client_max_tokens(options.max_tokens, output),
            "output_len": output,
        })
    return requests, tally


def _client_max_tokens(mode: str, output: int) -> Optional[int]:
    """What the client sent as ``max_tokens``: nothing (``unset``), the true length (``true``) or a fixed number."""
    if mode == "unset":
        return None
    if mode == "true":
        return output
    return int(mode)


def _generator_record(source: Path, options: ImportOptions, tally: dict) -> dict:
    """The trace header's ``generator`` section: how to make this trace again from its source."""
    return {
        "kind": "import",
        "format": options.fmt,
        "source_file": source.name,
        "source": SOURCES.get(options.fmt, "user-supplied CSV"),
        "start_s": options.start_s,
        "duration_s": options.duration_s,
        "limit": options.limit,
        "rate_scale": options.rate_scale,
        "sample": options.sample,
        "seed": options.seed,
        "max_tokens": options.max_tokens,
        "skipped_failed_or_empty": tally["skipped"],
        "truncated_to_max_model_len": tally["truncated"],
    }


def _description(source: Path, options: ImportOptions, count: int) -> str:
    return options.description or (
        f"{plural(count, 'request')} imported from {source.name} ({options.fmt}), window from {options.start_s} s"
        + (f" for {options.duration_s} s" if options.duration_s else "")
        + (f", time compressed {options.rate_scale}x" if options.rate_scale != 1 else "")
        + f"; max_tokens {options.max_tokens}"
    )


def _write_atomically(out: Path, text: str) -> None:
    if out.is_dir():
        raise ImportError_(f"--out {out}: is a directory; allowed: a file path")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=str(out.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def import_summary(result: ImportResult) -> str:
    return (
        f"{plural(result.requests, 'request')} (of {plural(result.rows_read, 'row')} read; {result.skipped_failed} failed or empty skipped; "
        f"{result.truncated} truncated to max_model_len), arrivals {result.first_arrival_s:.3f}..{result.last_arrival_s:.3f} s"
    )


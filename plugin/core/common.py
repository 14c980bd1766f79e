"""Small computations every part of the plugin shares, written once.

Imports nothing from FastDeploy and nothing else from the plugin, so every layer (policies,
patches, replay, benchmarks, CLI) may use it.
"""

from __future__ import annotations

import argparse
import codecs
import math
import os
from typing import Iterable, Optional, Sequence

__all__ = ["SettingsError", "EXIT_OK", "EXIT_ERROR", "EXIT_NO_HOST", "error_line", "did_you_mean", "plural", "bounded_int", "bounded_float", "read_utf8", "remove_files", "ceil_div", "blocks_for_tokens", "percentile", "mean", "text_table"]


class SettingsError(ValueError):
    """A setting is malformed, unknown, out of range or contradicts another one (defined here, re-exported by
    :mod:`fdsched.core.settings`, so that the cost model's errors can be settings errors without a circle)."""

# Exit codes of every ``fdsched`` command: done / a bad input, setting or check / no FastDeploy host.
EXIT_OK, EXIT_ERROR, EXIT_NO_HOST = 0, 1, 2


def plural(count, noun: str) -> str:
    """``1 request``, ``2 requests``: a count and its noun (regular plurals only)."""
    shown = f"{count:g}" if isinstance(count, float) else str(count)
    return f"{shown} {noun}" if count == 1 else f"{shown} {noun}s"


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest of ``choices`` to a mistyped ``word``, or ``""`` when none is close."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def error_line(command: str, message) -> str:
    """Every command's error line, in argparse's own style: ``fdsched <command>: error: <message>``."""
    return f"fdsched {command}: error: {message}" if command else f"fdsched: error: {message}"


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad value {text!r} (not a number)") from None


def bounded_float(lo: float, hi: float, lo_open: bool = False):
    """An argparse type: a number in [lo, hi] (``lo_open``: (lo, hi]); the error says what is allowed."""
    def parse(text: str) -> float:
        value = _number(text)
        if value != value or value > hi or value < lo or (lo_open and value == lo):
            bracket = "(" if lo_open else "["
            raise argparse.ArgumentTypeError(f"bad value {text!r}; allowed: a number in {bracket}{lo:g}, {hi:g}]")
        return value
    parse.__name__ = "number"
    return parse


def bounded_int(lo: int, hi: int):
    """An argparse type: an integer in [lo, hi]; the error says what is allowed."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad value {text!r} (not an integer); allowed: an integer in "
                                             f"[{lo}, {hi}]") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"bad value {text!r}; allowed: an integer in [{lo}, {hi}]")
        return value
    parse.__name__ = "integer"
    return parse


def read_utf8(path, what: str, allowed: str, error: type = ValueError) -> str:
    """The text of a UTF-8 file, or ``error`` with one line naming the file, what is wrong and the fix.

    ``what`` names the input (``"trace"``, ``"profile"``); ``allowed`` says what the input may be. A directory,
    a missing or unreadable file, UTF-16/UTF-32 text (a Windows editor's "Unicode") and binary data each get
    their own message instead of an ``OSError`` / ``UnicodeDecodeError`` traceback.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise error(f"{what} {path}: is a directory; allowed: {allowed}")
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise error(f"{what} {path}: cannot be read ({exc.strerror}); allowed: {allowed}") from None
    name = os.path.basename(path)
    if data.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) or (
        len(data) >= 4 and ((data[0] and not data[1] and data[2] and not data[3]) or (not data[0] and data[1] and not data[2] and data[3]))
    ):  # a BOM, or ASCII text every other byte (UTF-16 without a BOM)
        raise error(
            f"{what} {path}: looks like UTF-16/UTF-32 text; allowed: UTF-8 text "
            f"(convert it: iconv -f UTF-16 -t UTF-8 {name} > {name}.utf8)"
        )
    if b"\x00" in data:
        line = data.count(b"\n", 0, data.index(b"\x00")) + 1
        raise error(f"{what} {path}: binary data (a NUL byte on line {line}), not text; allowed: {allowed} as UTF-8 text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(
            f"{what} {path}: not UTF-8 (byte 0x{data[exc.start]:02x} on line {line}); allowed: {allowed} as UTF-8 text "
            f"(convert it: iconv -f LATIN1 -t UTF-8 {name} > {name}.utf8)"
        ) from None
    return text


def remove_files(names: Iterable[str], directory: str) -> list:
    """Remove each of ``names`` from ``directory`` (one already gone or not removable is skipped); returns the
    names removed (the /dev/shm sweeps of the served engine and of the host's test suites)."""
    removed = []
    for name in names:
        try:
            os.remove(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def ceil_div(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for integers, without floats (denominator > 0)."""
    return -(-numerator // denominator)


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """KV blocks that hold ``tokens`` tokens (0 for 0 or fewer)."""
    return ceil_div(max(tokens, 0), block_size)


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100), linear interpolation between closest ranks; None when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q!r}; allowed: 0..100")
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    fraction = rank - low
    return float(ordered[low] + (ordered[high] - ordered[low]) * fraction)


def mean(values: Sequence[float]) -> Optional[float]:
    return float(sum(values)) / len(values) if values else None


def text_table(rows: Iterable[Sequence], headers: Sequence[str], align_right_from: Optional[int] = None) -> str:
    """A plain-text table: a header, a rule, one line per row. Columns from ``align_right_from`` on
    are right-aligned (numbers); the rest left-aligned."""
    rows = [[str(c) for c in row] for row in rows]
    headers = [str(h) for h in headers]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells) -> str:
        out = []
        for i, (cell, width) in enumerate(zip(cells, widths)):
            right = align_right_from is not None and i >= align_right_from
            out.append(cell.rjust(width) if right else cell.ljust(width))
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])

"""Output folders and files the ``fdsched`` commands own: they never write over what they did not write.

A command that writes a folder (``fdsched replay --out``, ``eval``, ``serve --trace --out``, ``load --out``,
``load-vs-replay --out``) writes only into a folder it made, an empty one, or one that holds nothing but what an
earlier run of the same command wrote there. It recognises its own folders by a marker file it writes into each
(:data:`MARKER`: the command and the names it wrote), never by the names of the files. A command that writes one
file (``fdsched trace generate --out``, ``trace import --out``) overwrites only a file that the same command wrote,
recognised by the file's own record of what made it (a trace header's ``generator``).

Everything else is refused in one line before the command runs, naming the path and what to do:
:class:`OutputError` (a ``ValueError``), whose text follows the one error format, ``<where>: bad value <value>
(why); allowed: <what>``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

__all__ = ["MARKER", "OutputError", "check_out_dir", "claim_out_dir", "settle_out_dir", "check_out_file",
           "trace_written_by"]

MARKER = ".fdsched-output.json"
SHOWN = 3  # foreign names shown in a refusal


class OutputError(ValueError):
    """An output path a command must not write to; the text is one line that says what to give instead."""


def _refuse(flag: str, value: str, why: str, allowed: str) -> OutputError:
    return OutputError(f"{flag} {value!r}: bad value ({why}); allowed: {allowed}")


def _read_marker(folder: Path) -> Optional[dict]:
    """The marker's record (``{"command": ..., "files": [...]}``), or None when there is none or it is unreadable."""
    try:
        record = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("files"), list):
        return None
    return record


def _foreign(folder: Path, command: str) -> tuple:
    """(whose, names): what in ``folder`` the command did not write. ``whose`` names the other command whose
    folder it is (or None); ``names`` the entries no earlier run of ``command`` recorded."""
    entries = sorted(entry.name for entry in folder.iterdir() if entry.name not in (MARKER, MARKER + ".tmp"))
    record = _read_marker(folder)
    if record is None:
        return None, entries
    if record.get("command") != command:
        return str(record.get("command")), entries
    owned = set(record["files"])
    return None, [name for name in entries if name not in owned]


def check_out_dir(value: str, command: str, flag: str = "--out") -> Path:
    """The folder ``value`` names, if ``command`` may write into it; writes nothing. Raises :class:`OutputError`."""
    again = f"a new folder (it is made), an empty one, or one an earlier {command} wrote"
    if not str(value).strip():
        raise _refuse(flag, value, "empty", again)
    out = Path(value).expanduser()
    resolved = out.resolve()
    if resolved == Path(resolved.anchor):
        raise _refuse(flag, value, "the filesystem root", f"{again}, e.g. {flag} ./fdsched-out")
    for parent in [out, *out.parents]:
        if parent.exists():
            if not parent.is_dir():
                what = "an existing file" if parent == out else f"{str(parent)!r} is a file"
                raise _refuse(flag, value, f"{what}, not a folder", again)
            break
    if not out.exists():
        parent = next(p for p in out.parents if p.exists())
        if not os.access(parent, os.W_OK | os.X_OK):
            raise _refuse(flag, value, f"cannot make it: {str(parent)!r} is not writable", again)
        return out
    if not os.access(out, os.W_OK | os.X_OK):
        raise _refuse(flag, value, "a folder you cannot write to", again)
    whose, foreign = _foreign(out, command)
    if whose is not None:
        raise _refuse(flag, value, f"the output folder of {whose}", f"{again}; give another folder")
    if foreign:
        shown = ", ".join(foreign[:SHOWN]) + (f" and {len(foreign) - SHOWN} more" if len(foreign) > SHOWN else "")
        raise _refuse(flag, value, f"it holds files {command} did not write: {shown}",
                      f"{again}; give another folder, or move those files away")
    return out


def _write_marker(folder: Path, command: str, files: list) -> None:
    text = json.dumps({"command": command, "files": sorted(set(files)),
                       "note": f"written by {command}: it writes into this folder again only while it holds "
                               "nothing but these files"}, indent=1)
    tmp = folder / (MARKER + ".tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, folder / MARKER)


def claim_out_dir(value: str, command: str, flag: str = "--out") -> tuple:
    """Check ``value`` (:func:`check_out_dir`), make the folder and mark it as ``command``'s.

    Returns ``(folder, created)``; pass both to :func:`settle_out_dir` when the command ends, however it ends.
    Raises :class:`OutputError`.
    """
    out = check_out_dir(value, command, flag)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        record = _read_marker(out)
        _write_marker(out, command, record["files"] if record else [])
    except OSError as exc:
        raise _refuse(flag, value, f"cannot make or mark the folder: {exc.strerror}",
                      "a folder path you can write to") from None
    return out, created


def settle_out_dir(out: Path, command: str, created: bool) -> None:
    """After a run: record every file now in ``out`` as ``command``'s; a folder this run made and left with nothing
    in it (or only an empty log) is removed."""
    try:
        names = [entry.name for entry in out.iterdir() if entry.name not in (MARKER, MARKER + ".tmp")]
        for name in list(names):
            if name.endswith(".log") and (out / name).is_file() and (out / name).stat().st_size == 0:
                (out / name).unlink()
                names.remove(name)
        if created and not names:
            for leftover in (MARKER, MARKER + ".tmp"):
                if (out / leftover).exists():
                    (out / leftover).unlink()
            out.rmdir()
            return
        _write_marker(out, command, names)
    except OSError:
        pass  # the folder went away or became unwritable mid-run: nothing of ours to record


def trace_written_by(kinds) -> Callable[[Path], bool]:
    """A recogniser for :func:`check_out_file`: the file is a trace whose header's ``generator.kind`` is one of
    ``kinds`` (what ``fdsched trace generate`` and ``trace import`` record)."""
    def recognise(path: Path) -> bool:
        try:
            with open(path, encoding="utf-8") as handle:
                first = json.loads(handle.readline())
        except (OSError, ValueError, UnicodeDecodeError):
            return False
        generator = first.get("header", {}).get("generator") if isinstance(first, dict) else None
        return isinstance(generator, dict) and generator.get("kind") in kinds
    return recognise


def check_out_file(value: str, command: str, recognise: Callable[[Path], bool], flag: str = "--out") -> Path:
    """The file ``value`` names, if ``command`` may write it: a new file, or one ``recognise`` says the command
    wrote (it is then replaced). Writes nothing. Raises :class:`OutputError`."""
    allowed = f"a new file path, or a file an earlier {command} wrote"
    if not str(value).strip():
        raise _refuse(flag, value, "empty", allowed)
    out = Path(value).expanduser()
    if out.is_dir():
        raise _refuse(flag, value, "a directory", allowed)
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise _refuse(flag, value, f"{str(parent)!r} is a file, not a directory", allowed)
            break
    if out.exists() and not recognise(out):
        raise _refuse(flag, value, f"an existing file {command} did not write", f"{allowed}; give another path, or "
                      "move that file away")
    return out

"""Keep the host's import-time and run-time chatter away from the terminal: ``fdsched replay`` and ``doctor``.

Importing FastDeploy on a CPU machine prints 8-25 lines that are not about the user's run (paddle's "No ccache
found", ``PROMETHEUS_MULTIPROC_DIR`` was set, "Version file not found", cache-manager ops, ports), through
``warnings``, through logging handlers the host built around ``sys.stdout``/``sys.stderr`` at import time, and
from C code writing to the file descriptors directly. :func:`host_output_to` sends all of it to a log file by
redirecting file descriptors 1 and 2 for the duration (with a Python-level fallback where they are not real
files, e.g. under pytest's capture), and hands the caller a stream on the terminal's original stderr for the
progress bar. ``-v`` on the command skips it. Imports nothing from the host.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Iterator, Optional

__all__ = ["HostLog", "host_output_to", "log_note"]


class HostLog:
    """Where the host's output went, and a stream on the terminal for the progress bar."""

    def __init__(self, path: Optional[Path], terminal) -> None:
        self.path = path
        self.terminal = terminal

    def lines(self) -> int:
        if self.path is None or not self.path.is_file():
            return 0
        with open(self.path, "rb") as fh:
            return sum(1 for line in fh if line.strip())


def _real_fd(stream) -> Optional[int]:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


@contextlib.contextmanager
def host_output_to(path: Optional[Path], verbose: bool = False) -> Iterator[HostLog]:
    """Within the block, everything written to stdout/stderr (Python or C level) goes to ``path``.

    ``verbose`` (or ``path`` None): nothing is redirected; the bar writes to stderr as usual.
    """
    if verbose or path is None:
        yield HostLog(None, sys.stderr)
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out_fd, err_fd = _real_fd(sys.stdout), _real_fd(sys.stderr)
    log = open(path, "ab", buffering=0)
    sys.stdout.flush()
    sys.stderr.flush()
    if out_fd is None or err_fd is None:  # no real descriptors (pytest capsys): Python-level only
        text = io.TextIOWrapper(log, encoding="utf-8", errors="replace", write_through=True)
        terminal = sys.stderr
        try:
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield HostLog(path, terminal)
        finally:
            text.flush()
            text.detach()
            log.close()
        return
    saved_out, saved_err = os.dup(out_fd), os.dup(err_fd)
    terminal = os.fdopen(os.dup(saved_err), "w", buffering=1, encoding=sys.stderr.encoding or "utf-8",
                         errors="replace")
    try:
        os.dup2(log.fileno(), out_fd)
        os.dup2(log.fileno(), err_fd)
        yield HostLog(path, terminal)
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os.dup2(saved_out, out_fd)
        os.dup2(saved_err, err_fd)
        os.close(saved_out)
        os.close(saved_err)
        terminal.close()
        log.close()


def log_note(log: HostLog) -> str:
    """One line naming the log file (empty when nothing was collected)."""
    count = log.lines()
    if log.path is None or not count:
        return ""
    return f"the host's own messages ({count} lines: import warnings, its logs): {log.path}  (-v shows them here)"

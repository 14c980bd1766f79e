"""Which process of a served stack is gone, and why: the exit records the seams' watchers write, the stack's
own children, and the engine's processes recorded once it is up; the host's last error line for the rank.
:class:`StackWatch` is the part of :class:`fdsched.serve.launcher.ServedEngine` that answers it."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass
from typing import Optional

from fdsched.serve.config import ServeError


_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit)): (.+)$")


def last_exception(files) -> str:
    """The last exception line (``SomeError: ...``) written to any of ``files``, from the most recently written
    one; "" when none has one (a missing file is skipped)."""
    best = (0.0, "")
    for path in files:
        try:
            with open(path, errors="replace") as fh:
                lines = fh.read().splitlines()
            mtime = os.path.getmtime(path)
        except OSError:
            continue
        for line in reversed(lines):
            m = _EXCEPTION_LINE.match(line.strip())
            if m and "KeyboardInterrupt" not in line:
                if mtime >= best[0]:
                    best = (mtime, f"{m.group(1)}: {m.group(2)}"[:400])
                break
    return best[1]


GONE_GRACE_S = 1.0  # how long a watched process may be gone before it is named without its exit status


@dataclass(frozen=True)
class Death:
    """A process of the stack that is gone: which rank, which role, how it ended."""

    rank: Optional[int]
    role: str
    pid: int
    code: Optional[int] = None  # exit status; negative: killed by that signal (Popen's convention)
    when: float = 0.0

    def text(self) -> str:
        where = f"rank {self.rank} {self.role}" if self.rank is not None else self.role
        if self.code is None:
            how = "is gone (not our child: its exit status is its parent's)"
        elif self.code < 0:
            try:
                how = f"was killed by {signal.Signals(-self.code).name}"
            except ValueError:
                how = f"was killed by signal {-self.code}"
        else:
            how = f"exited with code {self.code}"
        return f"{where} (pid {self.pid}) {how}"


class StackWatch:
    """The watching methods of a served stack. The stack sets ``config``, ``procs``, ``log_dir``, ``state_dir``,
    ``_watched`` and ``_gone_since`` and answers ``rank_log_dir``."""

    def watched(self) -> dict:
        """The stack's processes seen once it was up, a copy: (pid, create time) -> (rank or None, role)."""
        return dict(self._watched)

    def deaths(self) -> list:
        """Every process of the stack known to be gone, earliest first (empty while all live)."""
        found = {}
        for f in sorted(os.listdir(os.path.join(self.state_dir, "exits"))):  # recorded by the seams' watchers
            try:
                with open(os.path.join(self.state_dir, "exits", f)) as fh:
                    d = json.load(fh)
            except (OSError, ValueError):
                continue
            found[d["pid"]] = Death(d.get("rank"), d["role"], d["pid"], d.get("code"), d.get("time", 0.0))
        now = time.time()
        for name, proc in self.procs.items():
            if proc.poll() is not None and proc.pid not in found:
                rank = 0 if name == "api_server" else None
                found[proc.pid] = Death(rank, name, proc.pid, proc.returncode, now)
        if self._watched:
            import psutil

            for (pid, created), (rank, role) in self._watched.items():
                if pid in found:
                    continue
                try:
                    p = psutil.Process(pid)
                    alive = p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE
                except psutil.Error:
                    alive = False
                if alive:
                    continue
                # Its parent's watcher records how it ended (an exits record) a moment after it goes: wait that
                # long before naming it without its status.
                first_seen = self._gone_since.setdefault(pid, now)
                if now - first_seen >= GONE_GRACE_S:
                    found[pid] = Death(rank, role, pid, None, first_seen)
        # earliest first; at one detection time, a death whose status is known (the cause) before the ones it took
        return sorted(found.values(), key=lambda d: (d.when, d.code is None, d.pid))

    def check_alive(self) -> None:
        """ServeError in one line naming the first process that is gone (rank, role, signal or exit code), the
        others after it, and the host's own error message where its output has one."""
        dead = self.deaths()
        if not dead:
            return
        first = dead[0]
        message = first.text()
        rest = [d.text() for d in dead[1:]]
        if rest:
            message += "; then " + ", ".join(rest[:3]) + (f" and {len(rest) - 3} more" if len(rest) > 3 else "")
        host_error = self.host_error(first.rank)
        if host_error:
            message += f"; the host said: {host_error}"
        raise ServeError(message)

    def host_error(self, rank: Optional[int]) -> str:
        """The last exception line (``SomeError: ...``) the host wrote for ``rank``: the api_server's own output
        (``api_server.out``, ``multi_api_server.out`` under data parallelism) and the rank's log files."""
        files = [os.path.join(self.log_dir, "api_server.out"), os.path.join(self.log_dir, "multi_api_server.out")]
        if rank is not None:
            d = self.rank_log_dir(rank)
            if os.path.isdir(d):
                files += [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".log")]
        return last_exception(files)

    def _watch_engine_processes(self):
        """Record, once the stack is up, each rank's api_server and its descendants (the engine's queue managers
        and cache processes; the simulated workers): a later disappearance of any of them stops the stack."""
        try:
            import psutil
        except ImportError:
            return
        roots = []
        if self.config.dp == 1 and "api_server" in self.procs:
            roots.append((0, self.procs["api_server"].pid))
        elif "multi_api_server" in self.procs:
            try:
                for child in psutil.Process(self.procs["multi_api_server"].pid).children():
                    m = re.search(r"--local-data-parallel-id\s+(\d+)", " ".join(child.cmdline()))
                    if m:
                        roots.append((int(m.group(1)), child.pid))
            except psutil.Error:
                pass
        for rank, pid in roots:
            try:
                root = psutil.Process(pid)
                self._watched[(pid, root.create_time())] = (rank, "api_server")
                children = root.children(recursive=True)
                workers = {c.pid for c in children if "worker.py" in " ".join(c.cmdline())}
                for child in children:
                    if child.ppid() in workers:  # a worker's own helpers (its resource tracker) go with it
                        continue
                    line = " ".join(child.cmdline())
                    m = re.search(r"--dp-rank\s+(\d+)", line)
                    if "worker.py" in line and m:
                        who = (int(m.group(1)), "worker")
                    elif "worklaunch.py" in line:
                        who = (rank, "worker launcher")
                    elif "cachexfer.py" in line:
                        who = (rank, "cache transfer manager")
                    else:
                        who = (rank, "engine process")
                    self._watched[(child.pid, child.create_time())] = who
            except psutil.Error:
                pass

    def _alive_check(self):
        try:
            self.check_alive()
        except ServeError as exc:
            raise ServeError(f"during start-up: {exc}; logs in {self.log_dir}") from None

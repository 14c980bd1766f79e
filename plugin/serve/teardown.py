"""What a stopped stack must not leave behind: its processes (found by process group and by the descendants seen
while it ran) and the ``/dev/shm`` entries they created, known from the seams' ledger
(:mod:`fdsched.serve.seams.ledger`) by name and inode, never by name alone."""

from __future__ import annotations

import json
import os
import signal
import stat


def created_entries(state_dir: str, still_there: bool = False) -> list:
    """(path, inode) of every /dev/shm entry the stack's processes recorded creating (seams' ledger).

    A creation is recorded twice: an intent before the call (with the inode at the path then, if any), and the
    entry's inode after it (or that it failed). An intent left open means the process ended inside the call; the
    entry at the path is then the one that call made when it is of the kind the call makes and is not the one that
    was there before it. Such an entry is only known while it is there, whatever ``still_there`` says."""
    from fdsched.serve.seams import SHM_LEDGER

    entries, seen, open_intents = [], set(), {}

    def add(path, ino):
        if (path, ino) in seen:
            return
        seen.add((path, ino))
        if still_there:
            try:
                if os.stat(path).st_ino != ino:
                    return
            except OSError:
                return
        entries.append((path, ino))

    try:
        with open(os.path.join(state_dir, SHM_LEDGER), errors="replace") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                    if "intent" in rec:
                        open_intents[(rec["pid"], rec["intent"])] = rec
                    elif "failed" in rec:
                        open_intents.pop((rec["pid"], rec["failed"]), None)
                    else:
                        open_intents.pop((rec["pid"], rec["path"]), None)
                        add(rec["path"], rec["ino"])
                except (ValueError, KeyError, TypeError):
                    continue
    except OSError:
        pass
    for rec in open_intents.values():
        path = rec["intent"]
        try:
            st = os.stat(path)
        except OSError:
            continue
        kind_ok = stat.S_ISSOCK(st.st_mode) if rec.get("kind") == "socket" else stat.S_ISREG(st.st_mode)
        if kind_ok and st.st_ino != rec.get("before"):
            add(path, st.st_ino)
    return entries


def remove_created(state_dir: str) -> list:
    """Remove the /dev/shm entries the stack's own processes created and that are still the same file (name and
    inode as recorded at creation); nothing found only by its name. Returns the paths removed."""
    removed = []
    for path, ino in created_entries(state_dir, still_there=True):
        try:
            if os.stat(path).st_ino == ino:
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
    return removed


def group_members(pgids) -> set:
    """(pid, create_time) of the live, non-zombie processes in the process groups ``pgids``. A group's number is not
    handed out again while any process is in it, and a member found here is one: it belongs to the stack."""
    try:
        import psutil
    except ImportError:
        return set()
    members = set()
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) in pgids and proc.status() != psutil.STATUS_ZOMBIE:
                members.add((proc.pid, proc.create_time()))
        except (psutil.Error, OSError):
            pass
    return members


def kill_pids(pids):
    for pid in still_running(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def still_running(descendants) -> list:
    """The (pid, create_time) pairs that are still the same live, non-zombie process."""
    import psutil

    alive = []
    for pid, created in descendants:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.Error:
            pass
    return alive

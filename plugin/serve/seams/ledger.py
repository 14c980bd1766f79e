"""What the stack's processes leave behind, recorded as it happens: every ``/dev/shm`` entry a process creates
(H4, the ledger the launcher removes from) and how each watched child ended (H5, the exit records)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from .env import SHM_LEDGER, STATE_ENV


# H4 --------------------------------------------------------------------------------------------

def _ledger_write(rec: dict) -> None:
    """Append one record to the stack's ledger (one write, O_APPEND, so records of concurrent processes do not mix)."""
    state_dir = os.environ.get(STATE_ENV)
    if not state_dir:
        return
    line = json.dumps(dict(rec, pid=os.getpid())) + "\n"
    try:
        fd = _REAL_OS_OPEN(os.path.join(state_dir, SHM_LEDGER), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def record_created(path: str, ino: int) -> None:
    """Append one /dev/shm entry this process created to the stack's ledger."""
    _ledger_write({"path": path, "ino": ino})


def _inode_or_none(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _creating(path: str, kind: str, create, inode_of=None):
    """Run ``create()``, which may make the /dev/shm entry ``path`` (``kind``: "socket" or "file"), and record the
    entry's inode (``inode_of(create())``, default: the inode at ``path``) in the ledger; returns what ``create``
    returned. An intent record is written first: a process can end between the entry appearing and its record
    (SIGKILL, or a daemon thread stopped at interpreter exit while the call had let go of the GIL), and the intent,
    with the inode that was at the path before, lets the launcher still know the entry as its own. A call that fails
    is closed in the ledger too."""
    if not os.environ.get(STATE_ENV):
        return create()
    _ledger_write({"intent": path, "kind": kind, "before": _inode_or_none(path)})
    try:
        out = create()
    except BaseException:
        _ledger_write({"failed": path})
        raise
    ino = _inode_or_none(path) if inode_of is None else inode_of(out)
    if ino is not None:
        record_created(path, ino)
    return out


def _fd_inode(fd: int) -> int:
    return os.fstat(fd).st_ino


_REAL_OS_OPEN = os.open
SHM_DIR = "/dev/shm/"


def record_creations() -> None:
    """Shared-memory segments (``_posixshmem.shm_open``), files (``os.open``, e.g. the host's IPCLock) and unix
    sockets (``socket.bind``) created under /dev/shm by this process go into the ledger."""
    if getattr(os.open, "_fdsched", False):
        return

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        text = os.fspath(path) if isinstance(path, (str, bytes, os.PathLike)) else ""
        text = os.fsdecode(text) if isinstance(text, bytes) else text
        watched = dir_fd is None and text.startswith(SHM_DIR) and flags & os.O_CREAT
        existed = watched and not flags & os.O_EXCL and os.path.exists(text)
        if not watched or existed:
            return _REAL_OS_OPEN(path, flags, mode, dir_fd=dir_fd)
        return _creating(text, "file", lambda: _REAL_OS_OPEN(path, flags, mode, dir_fd=dir_fd), _fd_inode)

    os_open._fdsched = True
    os.open = os_open
    try:
        import _posixshmem
    except ImportError:
        return
    real_open = _posixshmem.shm_open

    def shm_open(path, flags, mode=0o777):
        full = "/dev/shm/" + str(path).lstrip("/")
        existed = bool(flags & os.O_CREAT) and not flags & os.O_EXCL and os.path.exists(full)
        if not flags & os.O_CREAT or existed:
            return real_open(path, flags, mode=mode)
        return _creating(full, "file", lambda: real_open(path, flags, mode=mode), _fd_inode)

    shm_open._fdsched = True
    _posixshmem.shm_open = shm_open
    real_bind = socket.socket.bind

    def bind(self, address):
        path = os.fsdecode(address) if self.family == socket.AF_UNIX and isinstance(address, (str, bytes)) else ""
        if not path.startswith(SHM_DIR):
            return real_bind(self, address)
        return _creating(path, "socket", lambda: real_bind(self, address))

    socket.socket.bind = bind


def _h4_record_zmq(module) -> None:
    """ZeroMQ ipc endpoints under /dev/shm (``ipc:///dev/shm/...``), created by libzmq at bind."""
    if not os.environ.get(STATE_ENV):
        return
    cls = module.Socket
    real = cls.bind
    if getattr(real, "_fdsched", False):
        return

    def bind(self, addr, *args, **kwargs):
        text = addr.decode() if isinstance(addr, bytes) else str(addr)
        if not text.startswith("ipc://" + SHM_DIR):
            return real(self, addr, *args, **kwargs)
        path = text[len("ipc://"):]
        return _creating(path, "socket", lambda: real(self, addr, *args, **kwargs))

    bind._fdsched = True
    cls.bind = bind


# H5 --------------------------------------------------------------------------------------------

_WATCHED: list = []  # the Popen objects watched: referenced, so that no garbage-collected Popen is reaped by
# subprocess's own _cleanup() (run at every later Popen) before its watcher learns the status


def exit_status(proc) -> Optional[int]:
    """How the child ``proc`` ended -- its exit code, or minus the signal that killed it -- waiting for it without
    reaping it first (``waitid(..., WNOWAIT)``). None when its status is lost: another waiter of this process reaped
    it first (the api_server's gunicorn arbiter reaps any child with ``waitpid(-1)``), and a ``Popen.wait`` would
    then report a made-up 0."""
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # reaped already: by this very Popen in another thread (its return code is right)
        for _ in range(20):  # ... which sets it a moment after its waitpid returns
            if proc.returncode is not None:
                return proc.returncode
            time.sleep(0.01)
        return None  # or by another waiter: the status is gone
    except (OSError, AttributeError):  # no waitid here: what Popen learns
        info = None
    code = None
    if info is not None:
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        code = -info.si_status if killed else info.si_status
    try:
        reaped = proc.wait()  # reap it (or read the status the object already has)
    except Exception:  # noqa: BLE001
        reaped = None
    return code if code is not None else reaped


def _worklaunch():
    """The worker launcher's module (``worklaunch.py`` beside this package, loaded by its path as this package is):
    its ``record_exit`` writes every exit record of the stack."""
    module = sys.modules.get("_fdsched_serve_worklaunch")
    if module is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "_fdsched_serve_worklaunch",
            os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worklaunch.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["_fdsched_serve_worklaunch"] = module
    return module


def watch_exit(proc, role: str, rank) -> None:
    """Record how the child ``proc`` (a ``subprocess.Popen``) ends -- exit code, or minus the signal -- in the state
    dir (:func:`exit_status`)."""
    state_dir = os.environ.get(STATE_ENV)
    if not state_dir:
        return
    _WATCHED.append(proc)
    record_exit = _worklaunch().record_exit  # loaded now, not while the process is going down

    def wait():
        try:
            code = exit_status(proc)
        except Exception:  # noqa: BLE001 (the death is still recorded, without its status)
            code = None
        record_exit(proc.pid, role, rank, code)

    threading.Thread(target=wait, name=f"fdsched-serve-watch-{role}-{rank}", daemon=True).start()


def watch_api_servers() -> None:
    """In multi_api_server: every api_server it spawns gets an exit watcher (H5)."""
    real = subprocess.Popen
    if getattr(real, "_fdsched", False):
        return

    class WatchedPopen(real):
        _fdsched = True

        def __init__(self, args, *more, **kwargs):
            super().__init__(args, *more, **kwargs)
            words = list(args) if isinstance(args, (list, tuple)) else str(args).split()
            words = [str(w) for w in words]
            if "fastdeploy.entrypoints.openai.api_server" in words:
                rank = None
                if "--local-data-parallel-id" in words:
                    rank = words[words.index("--local-data-parallel-id") + 1]
                watch_exit(self, "api_server", rank)

    subprocess.Popen = WatchedPopen


AFTER_LOAD = {"zmq": [_h4_record_zmq]}

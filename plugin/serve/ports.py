"""The served stack's ports: which are free (:func:`port_in_use`, :func:`free_ports`) and the lease that keeps
them the stack's own from before anything is spawned until everything is stopped (:class:`PortLease`)."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import tempfile
from typing import Optional

from fdsched.serve.config import PORT_RANGE, ServeError


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


# One lock file per port, shared by every user's fdsched stacks on this machine (sticky, world-writable like /tmp).
PORT_LOCK_DIR = os.path.join(tempfile.gettempdir(), "fdsched-ports")


class PortLease:
    """Exclusive use of ports among fdsched stacks: ``flock`` on ``PORT_LOCK_DIR/<port>.lock`` per port.

    The lock lives as long as one of its holders (the launcher, and the stack's top process, which inherits the
    descriptors), so a second ``fdsched serve`` on the same ports fails at once instead of racing the first one's
    start-up. Released files are removed while still locked; a taker re-checks after locking that its file is still
    the one on disk (the classic unlink-while-locked protocol), so no two holders can ever share a port."""

    def __init__(self, lock_dir: Optional[str] = None):
        self.lock_dir = lock_dir or PORT_LOCK_DIR
        self.held: dict = {}  # port -> fd

    def _open(self, path: str) -> int:
        os.makedirs(self.lock_dir, exist_ok=True)
        try:
            if os.stat(self.lock_dir).st_uid == os.getuid():
                os.chmod(self.lock_dir, 0o1777)  # other users' stacks lock here too
        except OSError:
            pass
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:  # another user's file: flock works on a read-only descriptor
            fd = os.open(path, os.O_RDONLY)
        return fd

    def take(self, port: int) -> Optional[str]:
        """None when the port is now ours; else who holds it (``"pid 1234"`` or ``"another fdsched stack"``)."""
        if port in self.held:
            return None
        path = os.path.join(self.lock_dir, f"{port}.lock")
        for _attempt in range(20):
            try:
                fd = self._open(path)
            except FileNotFoundError:  # the directory was removed by a releasing stack just now
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                os.close(fd)
                return f"pid {holder}" if holder.isdigit() else "another fdsched stack"
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # its holder released (and removed) it between our open and our lock: take the new one
                os.close(fd)
                continue
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                pass  # read-only (another user's file): the lock is what counts
            self.held[port] = fd
            return None
        return "another fdsched stack (its lock file kept changing)"

    def fds(self) -> tuple:
        return tuple(self.held.values())

    def release(self) -> None:
        for port, fd in sorted(self.held.items()):
            try:
                os.unlink(os.path.join(self.lock_dir, f"{port}.lock"))  # still locked: nobody holds it after us
            except OSError:
                pass
            os.close(fd)
        self.held.clear()
        try:
            os.rmdir(self.lock_dir)  # only when empty: another stack's locks keep it
        except OSError:
            pass


def free_ports(count: int, start: Optional[int] = None, port_range=PORT_RANGE, lease: Optional[PortLease] = None) -> list:
    """``count`` consecutive free ports in ``port_range`` (from ``start`` if given, else a random offset); with
    ``lease``, ports some other fdsched stack holds are skipped and the block returned is held in ``lease``."""
    import random

    lo, hi = port_range
    first = start if start is not None else lo + random.randrange(0, max(1, hi - lo - count))
    candidates = list(range(first, hi + 1 - count + 1)) + list(range(lo, first))
    for base in candidates[::count]:
        block = list(range(base, base + count))
        if block[-1] > hi or any(port_in_use(p) for p in block):
            continue
        if lease is None:
            return block
        taken = [p for p in block if lease.take(p) is None]
        if len(taken) == len(block) and not any(port_in_use(p) for p in block):
            return block
        for p in taken:  # a partial block: give it back
            fd = lease.held.pop(p)
            try:
                os.unlink(os.path.join(lease.lock_dir, f"{p}.lock"))
            except OSError:
                pass
            os.close(fd)
    raise ServeError(f"no {count} free consecutive ports in {lo}-{hi}")

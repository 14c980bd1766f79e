"""The simulated workers' launcher: what ``paddle.distributed.launch`` is to FastDeploy's real workers.

The engine starts one process for all its GPU workers (on a GPU machine ``python -m paddle.distributed.launch
... worker_process.py``), reads that process's standard output and polls it. This script is that process on a CPU
machine: it starts every data-parallel rank's simulated worker (:mod:`worker`) as its own child, hands its standard
output to rank 0's worker (the lines the engine parses at start-up), and is the only process that waits for them.

Why a process of its own: the engine runs inside the api_server's gunicorn arbiter, which reaps *every* child of
its process (``waitpid(-1)``) and drops the status of the ones it did not start. A worker started by the engine
itself could die with its exit status taken by the arbiter first, and the stack would then report a worker killed
by a signal as one that "exited with code 0". Here the status is read by the one waiter there is, written to the
stack's state directory (``exits/worker-<pid>.json``, the record the launcher reads), and the launcher names the
rank, the role and the signal.

When one worker ends, the others are stopped (SIGTERM, then SIGKILL after a grace period) and this process ends
the way that first worker did (the same exit code, or killed by the same signal), as ``paddle.distributed.launch``
ends when a rank fails. When the engine that started it is gone, it stops the workers and ends.

Run by the served stack's seams as a script (``python -u worklaunch.py``) with the workers' commands in
``FDSCHED_SERVE_WORKERS`` (JSON: ``[{"rank": 0, "cmd": [...], "log": "path"}, ...]``). It imports nothing of the
host's nor of ``fdsched`` (the seams load it by path).
"""

import json
import os
import signal
import subprocess
import sys
import time

SPEC_ENV = "FDSCHED_SERVE_WORKERS"
STATE_ENV = "FDSCHED_SERVE_STATE_DIR"
POLL_S = 0.05
STOP_GRACE_S = 5.0


def record_exit(pid: int, role: str, rank, code) -> None:
    """Write how process ``pid`` ended in the stack's state dir (``exits/<role>-<pid>.json``), atomically."""
    state_dir = os.environ.get(STATE_ENV)
    if not state_dir:
        return
    record = {"pid": pid, "role": role, "rank": None if rank is None else int(rank), "code": code,
              "time": time.time()}
    path = os.path.join(state_dir, "exits", f"{role}-{pid}.json")
    try:
        with open(path + ".tmp", "w") as fh:
            json.dump(record, fh)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _log(msg: str) -> None:
    print(f"[fdsched worklaunch] {msg}", file=sys.stderr, flush=True)


def _reap(children: dict, block: bool):
    """One ended child as ``(pid, rank, code)`` (code: exit code, or minus the signal), or None."""
    try:
        pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
    except ChildProcessError:
        return None
    if pid == 0 or pid not in children:
        return None
    code = os.waitstatus_to_exitcode(status)
    rank = children.pop(pid)
    record_exit(pid, "worker", rank, code)
    return pid, rank, code


def _stop(children: dict) -> None:
    """SIGTERM every worker still running, SIGKILL the ones left after the grace period; reap (and record) all."""
    for pid in list(children):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    while children and time.monotonic() < deadline:
        if _reap(children, block=False) is None:
            time.sleep(POLL_S)
    for pid in list(children):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while children:
        if _reap(children, block=True) is None and children:
            children.clear()  # nothing left to wait for (reaped elsewhere): give up on their status


def main() -> int:
    spec = json.loads(os.environ.pop(SPEC_ENV))
    parent = os.getppid()
    children = {}  # pid -> rank
    stopping = []

    def on_term(signum, _frame):
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    for entry in spec:
        err = open(entry["log"], "ab")
        out = None if int(entry["rank"]) == 0 else err  # rank 0 writes to our stdout: the engine reads it
        proc = subprocess.Popen(entry["cmd"], stdout=out, stderr=err)
        children[proc.pid] = int(entry["rank"])
        _log(f"rank {entry['rank']} worker started (pid {proc.pid})")
    while True:
        ended = _reap(children, block=False)
        if ended is not None:
            pid, rank, code = ended
            _log(f"rank {rank} worker (pid {pid}) ended ({code}); stopping the others")
            _stop(children)
            if code < 0:
                if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
                    signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            return code
        if stopping or os.getppid() != parent:
            _log("asked to stop" if stopping else "engine process gone; stopping the workers")
            _stop(children)
            return 0
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())

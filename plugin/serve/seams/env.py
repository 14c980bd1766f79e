"""The names the seams and the launcher share: the environment variables that switch each seam on, the state
directory's files, and the host modules a process is started as (:func:`main_module`). Imports nothing but the
standard library (the seams run without the ``fdsched`` package: see the package's docstring)."""

from __future__ import annotations

import sys

ENABLE_ENV = "FDSCHED_SERVE_SEAMS"  # "1": install the seams in this process tree
WORKER_ENV = "FDSCHED_SERVE_WORKER"  # path of the simulated worker script (fdsched/serve/worker.py)
STATE_ENV = "FDSCHED_SERVE_STATE_DIR"  # where the state probe (H1) answers requests
XFER_ENV = "FDSCHED_SERVE_CACHEXFER"  # path of the simulated cache transfer manager (fdsched/serve/cachexfer.py)
RPC_COUNT_ENV = "FDSCHED_SERVE_COUNT_RPC"  # "1": count the engine process's manager RPCs per thread (H2)
TIME_SCHEDULE_ENV = "FDSCHED_SERVE_TIME_SCHEDULE"  # "1": time every resource_manager.schedule() call (H3)
FINISH_DELAY_ENV = "FDSCHED_SERVE_FINISH_DELAY_MS"  # > 0: each finish on the host's finish pool waits this long (H7)
HOST_ENV = "FDSCHED_SERVE_HOST"  # the address the api_server, metrics and router ports listen on (S11)
SHM_LEDGER = "created-shm"  # in the state dir: one JSON line per /dev/shm entry a process of the stack created (H4)
MAIN_ENV_MULTI = "fastdeploy.entrypoints.openai.multi_api_server"
MAIN_API_SERVER = "fastdeploy.entrypoints.openai.api_server"


def main_module() -> str:
    """The module this process was started as (``python -m <module>``), or ""."""
    argv = list(getattr(sys, "orig_argv", []))
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        return argv[argv.index("-m") + 1]
    return ""

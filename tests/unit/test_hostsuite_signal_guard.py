"""The host-suite process's signal guard (fdsched.tools.hostsuite_pytest.signal_guard), with real processes. No host.

The host's tests/engine/test_common_engine.py sends SIGTERM, through engine finalizers, to process groups of
made-up pids; the guard lets a signal reach only the suite's own children, never the suite's own group nor
anything outside its session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from fdsched.tools.hostsuite_pytest import signal_guard


def _guard():
    refused = []
    kill, killpg = signal_guard(os.kill, os.killpg, refused.append)
    return kill, killpg, refused


def _sleeper(**kw):
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **kw)


def test_own_group_and_own_pid_are_refused_and_recorded():
    kill, killpg, refused = _guard()
    with pytest.raises(ProcessLookupError):
        killpg(os.getpgrp(), signal.SIGTERM)
    with pytest.raises(ProcessLookupError):
        kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(ProcessLookupError):
        kill(0, signal.SIGTERM)  # 0: the caller's own group
    assert [r.split(" in ")[0] for r in refused] == [
        f"killpg({os.getpgrp()}, {int(signal.SIGTERM)})", f"kill({os.getpid()}, {int(signal.SIGTERM)})",
        f"kill(0, {int(signal.SIGTERM)})"]
    kill(os.getpid(), 0)  # "is it alive?" goes through


def test_a_child_in_the_session_is_signalled_and_another_session_is_not():
    kill, killpg, refused = _guard()
    ours = _sleeper(process_group=0)  # the suite's child in a group of its own, same session: as the host starts workers
    theirs = _sleeper(start_new_session=True)  # a process of another session: someone else's
    try:
        killpg(ours.pid, signal.SIGTERM)
        assert ours.wait(timeout=10) == -signal.SIGTERM
        with pytest.raises(ProcessLookupError):
            kill(theirs.pid, signal.SIGTERM)
        with pytest.raises(ProcessLookupError):
            killpg(theirs.pid, signal.SIGTERM)
        assert theirs.poll() is None, "the guard let a signal reach another session"
        assert len(refused) == 2
    finally:
        for proc in (ours, theirs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()

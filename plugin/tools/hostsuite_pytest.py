"""A pytest plugin for running the host's own test files with fdsched loaded the way an engine loads it.

Used by :mod:`fdsched.tools.hostsuites` as ``python -m pytest -p fdsched.tools.hostsuite_pytest ...`` inside a
FastDeploy source tree. At configure time (before any test module is imported) it calls FastDeploy's
own plugin loader, ``fastdeploy.plugins.model_register.load_model_register_plugins()``, which runs
the ``fdsched`` entry point only when ``FD_PLUGINS`` lists it. It then writes one JSON file
(``FDSCHED_HOSTSUITE_RESULTS``) with what was installed and every test's outcome, so the harness
compares outcomes by test id without parsing pytest's text.
"""

from __future__ import annotations

import errno
import json
import os
import threading

RESULTS_ENV = "FDSCHED_HOSTSUITE_RESULTS"
LAST_ENV = "FDSCHED_HOSTSUITE_LAST"  # newline-separated node ids to run last (tests that leave threads running)

_outcomes: dict = {}
_install: dict = {}
_leaked: dict = {}
_reasons: dict = {}  # node id -> why it failed, in a line ("setup: AssertionError: ...")
_threads_before: set = set()
_refused: list = []  # signals the guard refused: "killpg(1953, 15) in <test> from thread <name>"
_current = {"test": "(collection)"}


def signal_guard(kill, killpg, record) -> tuple:
    """(kill, killpg) that refuse a signal to this process, its process group, or anything outside its session.

    Why: the host's tests/engine/test_common_engine.py gives engines made-up worker and cache-manager pids
    (``Mock(pid=1234)``, ``DummyCacheMgr(2001, ...)``, 12345, ...) and patches ``os.killpg`` while each test runs;
    the engine's ``weakref.finalize(self, self._exit_sub_services)`` then runs whenever the collector gets to it,
    patch or no patch, and calls ``os.killpg(os.getpgid(pid), SIGTERM)`` on those pids. On a machine whose pid
    counter is near them (a fresh CI container: this pytest ran as pid 1953) a made-up pid is a real process, this
    suite's own child or someone else's, and the whole group gets SIGTERM: CI saw the suite's pytest die mid-file
    (exit -15, no results). The tests mean a pid that does not exist; the guard answers as for one
    (``ProcessLookupError``) and records the call. Signals to the suite's own children in their own groups, and
    signal 0 (is it alive?), go through unchanged.
    """
    own_pid, own_group, own_session = os.getpid(), os.getpgrp(), os.getsid(0)

    def allowed(target: int, own: int) -> bool:
        if target <= 0 or target == own or target == own_group:
            return False
        try:
            return os.getsid(target) == own_session
        except OSError:  # no such process (or a group whose leader is gone: whose it is cannot be told)
            return False

    def refuse(call: str):
        record(f"{call} in {_current['test']} from thread {threading.current_thread().name}")
        raise ProcessLookupError(errno.ESRCH, f"{call}: refused by fdsched's host-suite guard (not a process this "
                                              "suite started)")

    def guarded_kill(pid, sig):
        if sig == 0 or (pid > 0 and allowed(pid, own_pid)) or (pid < -1 and allowed(-pid, own_group)):
            return kill(pid, sig)
        refuse(f"kill({pid}, {int(sig)})")

    def guarded_killpg(pgid, sig):
        if sig == 0 or allowed(pgid, own_group):
            return killpg(pgid, sig)
        refuse(f"killpg({pgid}, {int(sig)})")

    return guarded_kill, guarded_killpg


def pytest_configure(config):
    os.kill, os.killpg = signal_guard(os.kill, os.killpg, _refused.append)
    from fastdeploy.plugins.model_register import load_model_register_plugins

    _install.clear()
    try:
        load_model_register_plugins()
    except SystemExit as exc:  # a profile this host refuses: one line, nothing patched; no test is run then
        _install.update(installed=False, refused=str(exc.code if exc.code is not None else exc))
        return
    from fdsched.install.installer import current

    report = current()
    if report is None:
        _install["installed"] = False
    else:
        _install.update(
            installed=True,
            profile=report.settings.profile,
            decisions={cid: d.impl for cid, d in report.decisions.items()},
            has={cid: bool(v) for cid, v in report.host.has.items()},
            summary=report.summary(),
        )


def pytest_collection_modifyitems(session, config, items):
    """Move the tests named in FDSCHED_HOSTSUITE_LAST to the end (in that order): no other test runs after them.
    A refused profile runs no test (its run is only the refusal)."""
    if _install.get("refused"):
        items[:] = []
        return
    last = [n for n in os.environ.get(LAST_ENV, "").splitlines() if n]
    if not last:
        return
    order = {node: i for i, node in enumerate(last)}
    moved = sorted((item for item in items if item.nodeid in order), key=lambda item: order[item.nodeid])
    items[:] = [item for item in items if item.nodeid not in order] + moved


def pytest_runtest_setup(item):
    _current["test"] = item.nodeid
    _threads_before.clear()
    _threads_before.update(threading.enumerate())


def pytest_runtest_logfinish(nodeid, location):
    left = sorted(t.name for t in threading.enumerate() if t not in _threads_before and t.is_alive())
    if left:
        _leaked[nodeid] = left


def pytest_runtest_logreport(report):
    # A test fails if any phase fails; it is skipped if its setup skipped it; else it passed.
    previous = _outcomes.get(report.nodeid)
    if report.failed:
        _outcomes[report.nodeid] = "failed"
        _reasons.setdefault(report.nodeid, failure_reason(report))
    elif report.skipped and previous is None:
        _outcomes[report.nodeid] = "skipped"
    elif report.passed and report.when == "call" and previous is None:
        _outcomes[report.nodeid] = "passed"


REASON_CHARS = 300


def failure_reason(report) -> str:
    """A failed phase in one line: the phase and the crash's message (pytest's own short summary), at most
    REASON_CHARS characters; a differential problem then says why, not only which test."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and crash.message:
        text = crash.message
    else:  # a longrepr that is a string or a tuple: its last line
        lines = str(report.longrepr or "").strip().splitlines()
        text = lines[-1] if lines else "(no message)"
    text = " ".join(text.split())
    return f"{report.when}: {text}"[:REASON_CHARS]


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"install": _install, "outcomes": _outcomes, "exitstatus": int(exitstatus), "leaked_threads": _leaked,
                   "refused_signals": _refused, "reasons": _reasons},
                  fh, indent=1, sort_keys=True)

"""A pytest plugin for running the host's own test files with fdsched loaded the way an engine loads it.

Used by :mod:`fdsched.tools.hostsuites` as ``python -m pytest -p fdsched.tools.hostsuite_pytest ...`` inside a
FastDeploy source tree. At configure time (before any test module is imported) it calls FastDeploy's
own plugin loader, ``fastdeploy.plugins.model_register.load_model_register_plugins()``, which runs
the ``fdsched`` entry point only when ``FD_PLUGINS`` lists it. It then writes one JSON file
(``FDSCHED_HOSTSUITE_RESULTS``) with what was installed and every test's outcome, so the harness
compares outcomes by test id without parsing pytest's text.
"""

from __future__ import annotations

import json
import os
import threading

RESULTS_ENV = "FDSCHED_HOSTSUITE_RESULTS"
LAST_ENV = "FDSCHED_HOSTSUITE_LAST"  # newline-separated node ids to run last (tests that leave threads running)

_outcomes: dict = {}
_install: dict = {}
_leaked: dict = {}
_threads_before: set = set()


def pytest_configure(config):
    from fastdeploy.plugins.model_register import load_model_register_plugins

    load_model_register_plugins()
    from fdsched.install.installer import current

    report = current()
    _install.clear()
    if report is None:
        _install["installed"] = False
    else:
        _install.update(
            installed=True,
            profile=report.settings.profile,
            decisions={cid: d.impl for cid, d in report.decisions.items()},
            summary=report.summary(),
        )


def pytest_collection_modifyitems(session, config, items):
    """Move the tests named in FDSCHED_HOSTSUITE_LAST to the end (in that order): no other test runs after them."""
    last = [n for n in os.environ.get(LAST_ENV, "").splitlines() if n]
    if not last:
        return
    order = {node: i for i, node in enumerate(last)}
    moved = sorted((item for item in items if item.nodeid in order), key=lambda item: order[item.nodeid])
    items[:] = [item for item in items if item.nodeid not in order] + moved


def pytest_runtest_setup(item):
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
    elif report.skipped and previous is None:
        _outcomes[report.nodeid] = "skipped"
    elif report.passed and report.when == "call" and previous is None:
        _outcomes[report.nodeid] = "passed"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"install": _install, "outcomes": _outcomes, "exitstatus": int(exitstatus), "leaked_threads": _leaked},
                  fh, indent=1, sort_keys=True)

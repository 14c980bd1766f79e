"""Shared pytest setup: the three tiers, their order, and their turns under pytest-xdist.

``tests/unit``: needs no host; always runs (CI). ``tests/host``: needs FastDeploy importable (an installed ``fastdeploy``
or ``FDSCHED_HOST_SOURCE=/path/to/FastDeploy``); every test there is skipped with one reason, starting "needs FastDeploy
host", when it is not, so a CI log shows at a glance how many host tests ran. ``tests/engine``: FastDeploy's serving
stack on CPU, skipped with one reason starting "needs FastDeploy engine" when it cannot start.

The tiers run in that order. Under pytest-xdist (README's test command: two workers, a module at a time each) the
workers share the unit and host tiers; an engine module runs only while no other module runs anywhere (a lock on this
file: shared for a unit or host module, exclusive for an engine module). So a served stack never starts beside
another or beside other tests' work, as its start-up and health timeouts assume on two cores. Without workers nobody
ever waits.

The host and engine tiers' summary lines are printed here, by the process that reports (under pytest-xdist the
controller, which loads no tier's conftest), for each tier that has a result in the run.
"""

from __future__ import annotations

import fcntl
import os

import pytest

TIERS = ("tests/unit/", "tests/host/", "tests/engine/")
HOST, ENGINE = TIERS.index("tests/host/"), TIERS.index("tests/engine/")


def _own_metrics_directory() -> None:
    """A pytest-xdist worker that inherited ``PROMETHEUS_MULTIPROC_DIR`` (the controller loaded the host tier's
    conftest, which sets it, when ``tests/host`` is on the command line) gets a directory of its own, here, before it
    imports anything that writes samples: the host's ``/metrics`` text collects every file in the directory, and a
    shared one mixes the workers' samples (a test comparing two scrapes would count another worker's requests)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from fdsched.replay.engine import prepare_host_environment

        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        prepare_host_environment()  # a fresh one, removed when this worker exits


_own_metrics_directory()


def _tier(path) -> int:
    path = str(path).replace("\\", "/")
    return next((i for i, tier in enumerate(TIERS) if tier in path), len(TIERS))


_WORKER_DESELECTED: list = []  # host tests the pytest-xdist workers deselected (tests/host/conftest.py)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: _tier(item.fspath))  # stable: each tier keeps its own order


@pytest.fixture(scope="module", autouse=True)
def tier_turns(request):
    """Hold this module's turn (see the module docstring) from its first test's set-up to its last test's teardown."""
    with open(__file__, "rb") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX if _tier(request.path) == ENGINE else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _WORKER_DESELECTED.extend(getattr(node, "workeroutput", {}).get("fdsched_deselected", []))


def pytest_terminal_summary(terminalreporter):
    stats = terminalreporter.stats
    ran = {_tier(getattr(report, "nodeid", "")) for reports in stats.values() for report in reports}
    if HOST in ran:
        from tests.host import conftest as host

        for line in host.summary_lines(_WORKER_DESELECTED):
            terminalreporter.write_line(line)
    if ENGINE in ran:
        from tests.engine import conftest as engine

        for line in engine.summary_lines(stats):
            terminalreporter.write_line(line)

"""The engine tier: FastDeploy's real serving stack on CPU with the plugin (``fdsched serve``).

Every test here starts processes (api_server or multi_api_server + Router, simulated workers). When the host
or its serving packages are missing, every test in this folder skips with one reason starting
"needs FastDeploy engine:"; CI fails on such a skip (.ci/run). The summary line names how many engine tests
ran and the host commit.
"""

from __future__ import annotations

import pytest

from fdsched.replay.engine import prepare_host_environment


def _missing():
    prepare_host_environment()
    from fdsched.serve.config import ServeError, check_host_modules

    try:
        check_host_modules()
    except ServeError as exc:
        return str(exc)
    return None


_MISSING = _missing()


def _in_tier(item) -> bool:
    return "tests/engine/" in str(item.fspath).replace("\\", "/")


def pytest_collection_modifyitems(config, items):
    if _MISSING is not None:
        marker = pytest.mark.skip(reason=_MISSING)
        for item in items:
            if _in_tier(item):
                item.add_marker(marker)


def _label():
    from fdsched.install.probe import probe

    return probe().label


def summary_lines(stats) -> list:
    """The tier's line in pytest's summary (``stats``: the terminal reporter's): how many engine tests ran, against
    which host."""
    if _MISSING is not None:
        return [f"fdsched engine tests: SKIPPED ({_MISSING})"]
    ran = 0
    for key in ("passed", "failed", "error"):
        ran += sum(1 for r in stats.get(key, []) if "tests/engine/" in getattr(r, "nodeid", "")
                   and getattr(r, "when", "call") == "call")
    return [f"fdsched engine tests: {ran} ran against {_label()}"]


@pytest.fixture
def served():
    """Start a served engine (kwargs of EngineConfig); stopped and checked for leftovers afterwards."""
    from fdsched.serve.config import EngineConfig
    from fdsched.serve.launcher import ServedEngine

    started = []

    def _start(**kw):
        eng = ServedEngine(EngineConfig(**kw))
        started.append(eng)
        eng.__enter__()
        return eng

    yield _start
    from .helpers import assert_left_nothing

    for eng in started:
        assert_left_nothing(eng)

"""Fixtures for tests that run against the real FastDeploy host classes.

Find the host once; when it is missing, skip every test in this folder with one reason. The host
modules are imported only after the environment they need on a CPU machine is set
(:func:`fdsched.replay.engine.prepare_host_environment`).
"""

from __future__ import annotations

import pytest

from fdsched.install.probe import HOW_TO_POINT, HostNotFound, find_host

SKIP_REASON = "needs FastDeploy host: " + HOW_TO_POINT


def _host_available():
    from fdsched.replay.engine import prepare_host_environment

    prepare_host_environment()
    try:
        find_host()
    except HostNotFound as exc:
        return str(exc)
    return None


_MISSING = _host_available()


_DESELECTED: list = []


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "requires_host_change(change_id): compares with the host's own version of a change; deselected (not skipped) "
        "on a host that lacks it, and the header says so",
    )


def pytest_collection_modifyitems(config, items):
    if _MISSING is not None:
        marker = pytest.mark.skip(reason=SKIP_REASON)
        for item in items:
            if "tests/host/" in str(item.fspath).replace("\\", "/"):
                item.add_marker(marker)
        return
    from fdsched.install.probe import probe

    info = probe()
    keep = []
    for item in items:
        mark = item.get_closest_marker("requires_host_change")
        if mark is not None and not info.has.get(mark.args[0]):
            _DESELECTED.append(f"{item.nodeid} (the host lacks {mark.args[0]})")
        else:
            keep.append(item)
    if _DESELECTED:
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


def pytest_report_header(config):
    if _MISSING is None:
        from fdsched.install.probe import probe

        return f"fdsched host tests: {probe().label}"
    return f"fdsched host tests: SKIPPED ({_MISSING})"


def pytest_sessionfinish(session):
    # a pytest-xdist worker hands what it deselected to the controller, which prints the summary (tests/conftest.py)
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["fdsched_deselected"] = list(_DESELECTED)


def summary_lines(deselected=()) -> list:
    """The tier's lines in pytest's summary (printed even with -q, the header is not), so a CI log says which host
    the tier ran against and what it deselected: ``deselected`` adds what pytest-xdist workers deselected."""
    lines = [pytest_report_header(None)]
    for line in dict.fromkeys(list(_DESELECTED) + list(deselected)):
        lines.append(f"fdsched host tests: deselected on this host: {line}")
    return lines


@pytest.fixture(scope="session")
def host_info():
    from fdsched.install.probe import probe

    return probe()


@pytest.fixture(scope="module")
def replay_host():
    """The probed host for tests that drive the replay (it installs the plugin per run); skipped without a host.
    The plugin is uninstalled when the module ends, leaving the process as the other host tests expect it."""
    from fdsched.install.probe import HOW_TO_POINT, HostNotFound, find_host, probe
    from fdsched.replay.engine import prepare_host_environment

    prepare_host_environment()
    try:
        find_host()
    except HostNotFound as exc:
        why = exc if HOW_TO_POINT in str(exc) else HOW_TO_POINT
        pytest.skip(f"needs FastDeploy host: {why}")
    skip_where_the_replay_declines()
    yield probe()
    from fdsched.install import installer

    installer.uninstall()


_REPLAY_DECLINES: dict = {}


def skip_where_the_replay_declines() -> None:
    """Skip, naming why, on a line whose scheduler the replay cannot build (2.2: its configs are not the ones the
    replay builds; ``fdsched check`` and ``fdsched replay`` decline it in one line too)."""
    if "why" not in _REPLAY_DECLINES:
        from fdsched.replay.engine import EngineShape, HostConfigError, build_manager, close_manager

        try:
            close_manager(build_manager(EngineShape(block_size=4, num_gpu_blocks=40, max_num_seqs=2,
                                                    max_num_batched_tokens=16, max_model_len=64)))
            _REPLAY_DECLINES["why"] = ""
        except HostConfigError as exc:
            _REPLAY_DECLINES["why"] = f"its configs refuse the shape the replay builds (as 2.4 and later take it): {exc}"[:160]
    if _REPLAY_DECLINES["why"]:
        pytest.skip(f"the replay cannot build this line's scheduler: {_REPLAY_DECLINES['why']}")


def skip_if_refused(profile) -> None:
    """Skip, naming why, where this line refuses ``profile`` at load (the support table's "shipped profiles refused
    at load": a change the profile turns on that the line cannot take). None and "host" always load."""
    if profile in (None, "host"):
        return
    from fdsched.core.settings import load_settings
    from fdsched.install.installer import InstallError, decide
    from fdsched.install.probe import probe

    try:
        decide(load_settings(environ={}, profile=profile), probe())
    except InstallError as exc:
        pytest.skip(f"profile {profile} is refused on this line ({str(exc).split(' cannot be applied')[0]})")


@pytest.fixture
def install_profile():
    """Install the plugin with a shipped profile (or a dict of env overrides); uninstall afterwards. A profile this
    line refuses skips the test, naming why."""
    from fdsched.install import installer
    from fdsched.core.metrics import METRICS
    from fdsched.core.settings import load_settings

    def _install(profile=None, **env):
        skip_if_refused(profile)
        settings = load_settings(environ={k: str(v) for k, v in env.items()}, profile=profile)
        METRICS.reset()
        return installer.install(settings)

    yield _install
    installer.uninstall()


@pytest.fixture
def make_manager():
    """Build managers through the host module's current binding; close them afterwards."""
    from fdsched.replay.engine import EngineShape, build_manager, close_manager

    built = []

    skip_where_the_replay_declines()

    def _make(**shape):
        manager = build_manager(EngineShape(**shape))
        built.append(manager)
        return manager

    yield _make
    for manager in built:
        close_manager(manager)


@pytest.fixture
def clock():
    from fdsched.replay.engine import logical_clock

    with logical_clock():
        yield

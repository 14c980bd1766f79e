"""Decisions unchanged: every recorded (shipped trace, shipped profile) replays, step by step, exactly as the
golden decision log of the running host says (tests/host/data/decision_golden/<host commit>.jsonl.gz).

What a step's record holds and how to regenerate the file (ONLY for a change meant to alter decisions):
fdsched.replay.golden's docstring, or docs/decision-golden.md. Only what the golden file records is compared: a
profile or trace added later is not, a recorded profile or trace that is no longer shipped fails. By default
the CI subset runs (fdsched.replay.golden.CI_SUBSET); FDSCHED_GOLDEN_FULL=1 runs every recorded pair.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fdsched.replay import golden

GOLDEN_DIR = Path(__file__).resolve().parent / "data" / "decision_golden"
FULL = os.environ.get("FDSCHED_GOLDEN_FULL", "") == "1"


def _golden_file():
    """(host commit, path) of the running host's golden file; (None, reason) when there is no host."""
    from fdsched.install.probe import HostNotFound, find_host, probe
    from fdsched.replay.engine import prepare_host_environment

    prepare_host_environment()
    try:
        find_host()
    except HostNotFound as exc:
        return None, str(exc)
    commit = probe().commit or ""
    return commit, golden.golden_path(commit, GOLDEN_DIR)


_COMMIT, _PATH = _golden_file()
_ENTRIES = {}
if _COMMIT is not None and Path(_PATH).exists():
    for _entry in golden.read_golden(Path(_PATH)):
        if golden.in_ci_subset(_entry["trace"], _entry["profile"]) or (
            FULL and golden.comparable(_entry["trace"], _entry["profile"])
        ):
            _ENTRIES[f"{_entry['trace']}/{_entry['profile']}"] = _entry


@pytest.fixture(autouse=True)
def _uninstall_after():
    yield
    from fdsched.install import installer

    installer.uninstall()


def test_the_running_host_has_a_golden_decision_log():
    if _COMMIT is None:
        pytest.skip("needs FastDeploy host: " + _PATH)  # the tier's conftest skips it with the same reason
    assert Path(_PATH).exists(), (
        f"no golden decision log for host {_COMMIT[:9]} at {_PATH}: every supported host has one "
        f"({', '.join(h[:9] for h in golden.HOSTS)}); regenerate: python -m fdsched.replay.golden write"
    )
    assert _ENTRIES, f"{_PATH} records nothing"


@pytest.mark.parametrize("case", sorted(_ENTRIES) or ["(no golden file)"])
def test_decisions_match_the_golden_log(case):
    if case not in _ENTRIES:
        pytest.fail(f"no golden decision log for this host ({_PATH}); see test_the_running_host_has_a_golden_decision_log")
    recorded = _ENTRIES[case]
    trace, profile = recorded["trace"], recorded["profile"]
    assert profile in golden.current_profiles(), (
        f"profile {profile!r} is in the golden decision log but no longer shipped; if that is meant, regenerate "
        f"the golden file (python -m fdsched.replay.golden write)"
    )
    assert trace in golden.current_traces(), f"trace {trace!r} is in the golden decision log but no longer shipped"
    message = golden.compare(recorded, golden.decision_log(trace, profile))
    assert message is None, (
        f"{message}\n(host {_COMMIT[:9]}; see the whole log: python -m fdsched.replay.golden dump {trace} {profile} "
        f"[--now]; regenerate ONLY for a change meant to alter decisions: python -m fdsched.replay.golden write)"
    )

"""Shared fixtures of the host-free unit tier.

Nothing in tests/unit imports FastDeploy or paddle. Every test runs with the plugin's own
environment variables removed and an empty fdsched home (no recorded host), so a developer's shell,
a host set up on the machine, or tests/host cannot leak in.
"""

from __future__ import annotations

import textwrap

import pytest

from fdsched.core.hooks import DISABLE_ENV
from fdsched.install.probe import HOST_SOURCE_ENV
from fdsched.tools.hostsetup import HOME_ENV
from fdsched.core.settings import PROFILE_ENV, SCHEMA

PLUGIN_ENV_VARS = sorted({s.env for s in SCHEMA if s.env} | {PROFILE_ENV, HOST_SOURCE_ENV, DISABLE_ENV})


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch, tmp_path_factory):
    for var in PLUGIN_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    # A host recorded by `fdsched host setup` on this machine must not leak in either.
    monkeypatch.setenv(HOME_ENV, str(tmp_path_factory.mktemp("fdsched-home")))


@pytest.fixture
def write_profile(tmp_path):
    """Write a YAML profile into tmp_path and return its path (as a str)."""

    def _write(text: str, name: str = "custom.yaml") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return str(path)

    return _write

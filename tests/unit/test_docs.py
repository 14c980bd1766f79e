"""The operator's documents name everything an operator can set or see (a new change or setting cannot be left out)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fdsched.metrics
from fdsched.settings import CHANGE_IDS, SCHEMA

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def readme():
    if not README.is_file():
        pytest.skip("README.md is not in this installation (an sdist/wheel without it)")
    return README.read_text(encoding="utf-8")


@pytest.mark.parametrize("env", sorted(s.env for s in SCHEMA if s.env))
def test_every_variable_is_in_the_readme(readme, env):
    assert f"`{env}`" in readme


@pytest.mark.parametrize("change_id", CHANGE_IDS)
def test_every_change_is_in_the_readme_table(readme, change_id):
    assert re.search(rf"^\| `{change_id}` \|", readme, re.M), change_id


def test_every_metric_is_in_the_readme(readme):
    names = set(re.findall(r"fastdeploy:fdsched_\w+", fdsched.metrics.__doc__))
    assert names
    for name in sorted(names):
        assert f"`{name}" in readme, name

"""The host's own test files, run with fdsched loaded through FastDeploy's loader, held against the table.

One test per run (``no-plugin``, ``default`` and every shipped profile): a fresh pytest process inside
the host's source tree runs the files ``fdsched/host_suites.yaml`` lists for this host, and every
outcome must match the table (see :mod:`fdsched.hostsuites`). A test that fails unexpectedly is run once more,
alone; if it passes then, it is reported as flaky in the warnings summary instead of failing the run.
"""

from __future__ import annotations

import warnings

import pytest

from fdsched.hostsuites import host_tree_and_key, load_expectations, run_and_compare, run_names


@pytest.fixture(scope="module")
def host_tree():
    tree, key, _label = host_tree_and_key()
    return tree, key


@pytest.mark.parametrize("run", run_names())
def test_host_suite_outcomes_match_the_table(host_tree, run):
    tree, key = host_tree
    expectations = load_expectations()
    result, problems, flaky = run_and_compare(tree, key, run, expectations)
    for node in flaky:  # shown in the warnings summary of the CI log
        warnings.warn(f"host suite run {run}: flaky (failed, then passed alone): {node}")
    assert not problems, "\n".join(problems) + "\n--- pytest output (tail) ---\n" + result.output_tail
    assert result.counts()["passed"] > 300  # the files really ran

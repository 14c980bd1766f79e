"""The host's own test files, run with fdsched loaded through FastDeploy's loader, held against the table.

One test per run (``no-plugin``, ``default`` and every shipped profile): a fresh pytest process inside
the host's source tree runs the files ``fdsched/host_suites.yaml`` lists for this host, and every
outcome must match the table (see :mod:`fdsched.tools.hostsuites`). No retry: the host's thread-leaking files run in
processes of their own (``own_process`` in the table), their leaking tests last, so outcomes do not depend on load.
"""

from __future__ import annotations

import pytest

from fdsched.tools.hostsuites import host_tree_and_key, load_expectations, run_and_compare, run_names


@pytest.fixture(scope="module")
def host_tree():
    tree, key, _label = host_tree_and_key()
    return tree, key


@pytest.mark.parametrize("run", run_names())
def test_host_suite_outcomes_match_the_table(host_tree, run):
    tree, key = host_tree
    expectations = load_expectations()
    result, problems = run_and_compare(tree, key, run, expectations)
    assert not problems, "\n".join(problems) + "\n--- pytest output (tail) ---\n" + result.output_tail
    assert result.counts()["passed"] > 300  # the files really ran

"""The host's own test files, run without and with fdsched loaded through FastDeploy's loader: a differential test.

One ``no-plugin`` run (FD_PLUGINS unset: the host alone), then one test per run with the plugin (``default``,
``baseline``, ``recommended``, ``adaptive``: between them every class of the plugin's that any shipped profile
builds on this host, checked below; ``FDSCHED_TEST_ALL_PROFILES=1`` runs every shipped profile): a fresh pytest process inside the host's source tree runs the files of
``fdsched/tools/host_suites.yaml`` that the tree has, and no test that passes without the plugin may fail with it,
unless a change the run applies declares it altered (see :mod:`fdsched.tools.hostsuites`). No retry: the host's
thread-leaking files run in processes of their own, their leaking tests last, so outcomes do not depend on load.
"""

from __future__ import annotations

import pytest

from fdsched.tools.hostsuites import (
    NO_PLUGIN, check_loader, covering_runs, host_tree_and_key, load_table, plugin_classes, run_and_compare, run_names,
    run_suite,
)


@pytest.fixture(scope="module")
def host_tree():
    tree, key, _label = host_tree_and_key()
    return tree, key


@pytest.fixture(scope="module")
def baseline(host_tree):
    tree, key = host_tree
    return run_suite(tree, key, NO_PLUGIN, load_table())


def test_the_host_alone_runs_the_suites(baseline):
    assert not baseline.install.get("installed"), baseline.install
    assert baseline.counts()["passed"] > 300  # the files really ran


@pytest.mark.parametrize("run", covering_runs())
def test_no_test_that_passes_without_the_plugin_fails_with_it(host_tree, baseline, run):
    tree, key = host_tree
    result, problems, _altered = run_and_compare(tree, key, run, load_table(), baseline)
    assert not problems, "\n".join(problems) + "\n--- pytest output (tail) ---\n" + result.output_tail
    assert result.install.get("installed") or result.install.get("refused")


def test_fastdeploys_loader_installs_the_plugin_only_when_fd_plugins_names_it(host_tree):
    tree, _key = host_tree
    unset, named, other = (check_loader(tree, plugins) for plugins in (None, "fdsched", "someone_else"))
    assert not unset["installed"] and unset["exit"] == 0, unset
    assert named["installed"] and named["exit"] == 0 and "fdsched installed" in named["summary"], named
    assert not other["installed"] and other["exit"] == 0, other


def test_the_runs_made_build_every_plugin_class_any_profile_builds_here(host_info):
    """The default runs stand for every shipped profile: no class of the plugin's that some profile builds on this
    host is left out of them (a profile that needs one of its own must join ``COVERING_RUNS``)."""
    from fdsched.tools.hostsuites import COVERING_RUNS

    built = {run: plugin_classes(host_info, run) for run in run_names()[1:]}
    everything = frozenset().union(*[c for c in built.values() if c])
    covered = frozenset().union(*[built[run] or frozenset() for run in COVERING_RUNS])
    assert everything, "no profile builds a class here"
    assert not everything - covered, f"built only by profiles outside {COVERING_RUNS}: {sorted(everything - covered)}"

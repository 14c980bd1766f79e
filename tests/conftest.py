"""Shared pytest setup: the two test tiers.

``tests/unit``: needs no host; always runs (CI). ``tests/host``: needs FastDeploy importable (an
installed ``fastdeploy`` or ``FDSCHED_HOST_SOURCE=/path/to/FastDeploy``); every test there is
skipped with one reason, starting "needs FastDeploy host", when it is not, so a CI log shows at a
glance how many host tests ran.
"""

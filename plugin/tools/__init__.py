"""Tooling that only the ``fdsched`` command loads: the CLI, host set-up, the host's suites, benchmarks, the A/B
report. Never imported on the engine path (:mod:`fdsched.entry`).
"""

"""Trace replay: drive the real host scheduler through a workload once per profile and compare.

Modules that import nothing from FastDeploy (tested without a host):

* :mod:`~fdsched.replay.trace` - the JSONL trace format, its bounds, deterministic prompt tokens;
* :mod:`~fdsched.replay.tracefile` - trace files: shipped, resolved, read and checked line by line;
* :mod:`~fdsched.replay.generate` - the ``pressure`` / ``shared-prefix`` / ``pd-prefill`` generators;
* :mod:`~fdsched.replay.costmodel` - the modelled step cost;
* :mod:`~fdsched.replay.figures` - per-step and per-request records and the figures computed from them;
* :mod:`~fdsched.replay.invariants` - block accounting and request bookkeeping checks;
* :mod:`~fdsched.replay.report` - report JSON, terminal table, PNG;
* :mod:`~fdsched.replay.oracle` - the ``oracle`` profile's reservation hook.

Modules that need the host: :mod:`~fdsched.replay.engine` (build a ``ResourceManagerV1``),
:mod:`~fdsched.replay.driver` (play worker and token processor) and :mod:`~fdsched.replay.runner` (one replay
per profile).
:mod:`~fdsched.replay.cli` adds ``fdsched replay``, ``eval``, ``check`` and ``trace`` (their bodies: the ``*_cli`` modules).
"""

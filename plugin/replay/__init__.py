"""Trace replay: drive the real host scheduler through a workload once per profile and compare."""

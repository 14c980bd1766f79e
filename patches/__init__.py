"""The patch catalogue: one module per upstream change, each declaring itself as data.

Every change module defines ``SPEC`` (a :class:`PatchSpec`) and its strategy classes. The installer reads
``CATALOGUE`` to decide what to apply on this host and builds one fixed class over each of the three host classes
(``TARGETS``), whose instances build the strategies of their arm (``SPEC.strategies``: target -> impl -> strategy);
``fdsched patches`` shows the catalogue's prose to operators and ``fdsched doctor`` what it decides here. Tests check
that every seam a strategy serves is declared in its spec's ``replaces`` and the other way round, and that each
module's "Replaces:" and "Relies on:" text names exactly what its spec does, so neither the catalogue nor the
docstrings can drift from the code.

Nothing here imports FastDeploy at import time.
"""

from __future__ import annotations

from fdsched.patches._spec import AlteredTest, PatchSpec, Reliance, Shapes, Variant  # noqa: F401  (the catalogue's types, re-exported)

__all__ = ["AlteredTest", "PatchSpec", "Reliance", "Shapes", "Variant", "CATALOGUE", "TARGETS", "spec_for"]

# Dotted paths of the three host classes the plugin's fixed classes are built over.
TARGETS = {
    "ResourceManagerV1": "fastdeploy.engine.sched.resource_manager_v1.ResourceManagerV1",
    "PrefixCacheManager": "fastdeploy.cache_manager.prefix_cache_manager.PrefixCacheManager",
    "EngineCacheQueue": "fastdeploy.inter_communicator.engine_cache_queue.EngineCacheQueue",
}


def _load_catalogue() -> tuple:
    from fdsched.patches import (
        decode_node_reserve,
        decode_only_preempt,
        deferred_recycle,
        nonpolling_transfer,
        one_node_per_block,
        pd_prefill_cache,
        preempted_seat_resume,
        prefill_node_reserve,
        ratio_reserve,
    )

    return (
        deferred_recycle.SPEC,
        decode_only_preempt.SPEC,
        ratio_reserve.SPEC,
        pd_prefill_cache.SPEC,
        nonpolling_transfer.SPEC,
        one_node_per_block.SPEC,
        prefill_node_reserve.SPEC,
        preempted_seat_resume.SPEC,
        decode_node_reserve.SPEC,
    )


CATALOGUE = _load_catalogue()


def spec_for(change_id: str) -> PatchSpec:
    for spec in CATALOGUE:
        if spec.change_id == change_id:
            return spec
    raise KeyError(change_id)

"""The patch catalogue: one module per upstream change, each declaring itself as data.

Every change module defines ``SPEC`` (a :class:`PatchSpec`) and its mixin classes. The installer reads
``CATALOGUE`` to decide what to apply on this host and builds one subclass of each of the three host
classes (``TARGETS``) from the mixins; ``fdsched patches`` shows the catalogue's prose to operators and
``fdsched doctor`` what it decides here. Tests check that every method a mixin defines is declared in its
spec's ``replaces`` and the other way round, and that each module's "Replaces:" and "Relies on:" text names
exactly what its spec does, so neither the catalogue nor the docstrings can drift from the code.

Nothing here imports FastDeploy at import time.
"""

from __future__ import annotations

from typing import Optional

from fdsched.patches._spec import AlteredTest, PatchSpec, Reliance, Shapes, Variant, pick_shape  # noqa: F401  (the catalogue's types, re-exported)

__all__ = ["AlteredTest", "PatchSpec", "Reliance", "Shapes", "Variant", "CATALOGUE", "TARGETS", "spec_for", "mixins_for"]

# Dotted paths of the three host classes the plugin subclasses.
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


def mixins_for(target: str, impl: Optional[dict] = None, host_has: Optional[dict] = None, settings=None,
               host_cls=None, host_classes: Optional[dict] = None) -> tuple:
    """The mixins of ``target``'s plugin class, outermost first: later catalogue entries wrap earlier ones.

    ``impl`` (change id -> "host" / "plugin" / "off": one arm's decisions) selects what that arm's class gets
    (:meth:`PatchSpec.mixin_of`, with ``host_has`` (change id -> the host carries it) and the arm's ``settings``
    for a :class:`Variant`; a change whose impl gets no mixin is left out); ``host_cls`` (the host's class)
    picks each :class:`Shapes`' mixin for the host's method shapes, and leaves out a mixin whose overrides do not
    fit it (the installer has declined such a change already; for impl "host" the mixin only counts). Without
    ``impl``, every change's base mixin. ``host_classes`` (every target's host class) lets a :class:`Shapes` pick
    by the host methods and globals its mixins use too. Where two changes override the same method this order decides who sees
    whose calls; a unit test pins it per shared method and says why it must be so.
    """
    if impl is None:
        return tuple(spec.mixins[target] for spec in reversed(CATALOGUE) if target in spec.mixins)
    has = host_has or {}
    found = []
    for spec in reversed(CATALOGUE):
        chosen = spec.mixin_of(target, impl[spec.change_id], bool(has.get(spec.change_id)), settings)
        if host_cls is not None:
            chosen, _problem = pick_shape(chosen, host_cls, target, host_classes)
        elif isinstance(chosen, Shapes):
            chosen = chosen[0]
        if chosen is not None:
            found.append(chosen)
    return tuple(found)

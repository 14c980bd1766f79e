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

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["PatchSpec", "Reliance", "CATALOGUE", "TARGETS", "spec_for", "mixins_for"]

# Dotted paths of the three host classes the plugin subclasses.
TARGETS = {
    "ResourceManagerV1": "fastdeploy.engine.sched.resource_manager_v1.ResourceManagerV1",
    "PrefixCacheManager": "fastdeploy.cache_manager.prefix_cache_manager.PrefixCacheManager",
    "EngineCacheQueue": "fastdeploy.inter_communicator.engine_cache_queue.EngineCacheQueue",
}


@dataclass(frozen=True)
class Reliance:
    """One assumption a patch makes about the host's control flow (beyond method names and signatures).

    Written down in the module's "Relies on:" section under ``name`` and probed at install by ``check``
    (HostInfo -> what differs, or None). It matters only where the plugin runs one of the ``when``
    implementations of the change ("plugin": the plugin's version; "off": the pre-change code restored on a
    host that has the change): there ``on``/``off`` fail naming it and ``auto`` skips the change.
    """

    name: str
    text: str
    check: Callable
    when: tuple = ("plugin", "off")


@dataclass(frozen=True)
class PatchSpec:
    change_id: str
    title: str
    upstream_prs: tuple  # PR numbers: (main PR, 2.6 cherry-pick, ...)
    upstream_state: str  # merged / open / closed
    replaces: tuple  # "Target.method" for every host method a mixin of this change overrides
    requires: dict  # "Target.method" -> parameter names the host method must have (probe)
    why: str
    how: str
    hosts_needing: str  # which host versions need it
    switch: str  # environment variable (also `changes.<id>` in a profile)
    delete_when: str
    mixins: dict  # Target -> mixin class (with ``variants``: the base its variants share)
    host_has: Callable  # HostInfo -> bool: the host already carries the change
    relies_on: tuple = ()  # Reliance, one per "Relies on:" item of the module docstring
    # (settings, host_has) -> bool: whether the host has the change *as the settings select it*
    # (the PD change: the new host has upstream's behaviour, never the safe one).
    host_has_as_selected: Optional[Callable] = None
    # Which mixins an arm's class gets, by the change's impl there (see :meth:`mixin_of`): ``applies`` lists
    # the impls that get ``mixins`` (every other impl: none, the host's code runs untouched); ``variants``
    # (impl -> {Target: mixin}) instead names a mixin per impl, where the impls differ in what they do.
    applies: tuple = ("plugin",)
    variants: Optional[dict] = None

    def mixin_of(self, target: str, impl: str):
        """The mixin an arm whose decision for this change is ``impl`` gets for ``target``, or None."""
        if self.variants is not None:
            return self.variants.get(impl, {}).get(target)
        return self.mixins.get(target) if impl in self.applies else None

    def classes(self, target: str) -> tuple:
        """Every mixin class this change may put into ``target``'s plugin classes (its base and variants)."""
        found = [self.mixins[target]] if target in self.mixins else []
        for by_target in (self.variants or {}).values():
            if target in by_target and by_target[target] not in found:
                found.append(by_target[target])
        return tuple(found)

    def check_reliances(self, info) -> dict:
        """Reliance name -> what differs on the probed host, for every assumption that does not hold."""
        found = {}
        for reliance in self.relies_on:
            problem = reliance.check(info)
            if problem:
                found[reliance.name] = problem
        return found

    def reliance_problem(self, failed: dict, impl: str) -> Optional[str]:
        """The first failed reliance (from :meth:`check_reliances`) that matters for ``impl``, in words."""
        for reliance in self.relies_on:
            if reliance.name in failed and impl in reliance.when:
                return f"it relies on {reliance.name} ({reliance.text}), but {failed[reliance.name]}"
        return None

    def check_host(self, info) -> Optional[str]:
        """Why this change cannot be applied to the probed host (methods and signatures), or None when it can."""
        for target_method, params in self.requires.items():
            target, method = target_method.split(".", 1)
            cls = info.host_classes[target]
            func = getattr(cls, method, None)
            if func is None or not callable(func):
                return f"{cls.__name__}.{method} is missing"
            try:
                have = list(inspect.signature(func).parameters)
            except (TypeError, ValueError):
                return f"{cls.__name__}.{method} has no readable signature"
            missing = [p for p in params if p not in have]
            if missing:
                return f"{cls.__name__}.{method}{inspect.signature(func)} lacks parameter(s) {', '.join(missing)}"
        return None


def _load_catalogue() -> tuple:
    from fdsched.patches import (
        decode_only_preempt,
        deferred_recycle,
        nonpolling_transfer,
        pd_prefill_cache,
        ratio_reserve,
    )

    return (
        deferred_recycle.SPEC,
        decode_only_preempt.SPEC,
        ratio_reserve.SPEC,
        pd_prefill_cache.SPEC,
        nonpolling_transfer.SPEC,
    )


CATALOGUE = _load_catalogue()


def spec_for(change_id: str) -> PatchSpec:
    for spec in CATALOGUE:
        if spec.change_id == change_id:
            return spec
    raise KeyError(change_id)


def mixins_for(target: str, impl: Optional[dict] = None) -> tuple:
    """The mixins of ``target``'s plugin class, outermost first: later catalogue entries wrap earlier ones.

    ``impl`` (change id -> "host" / "plugin" / "off": one arm's decisions) selects what that arm's class gets
    (:meth:`PatchSpec.mixin_of`; a change whose impl gets no mixin is left out); without it, every change's
    base mixin. Where two changes override the same method this order decides who sees whose calls; a unit
    test pins it per shared method and says why it must be so.
    """
    if impl is None:
        return tuple(spec.mixins[target] for spec in reversed(CATALOGUE) if target in spec.mixins)
    chosen = (spec.mixin_of(target, impl[spec.change_id]) for spec in reversed(CATALOGUE))
    return tuple(mixin for mixin in chosen if mixin is not None)

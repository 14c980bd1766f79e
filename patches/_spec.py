"""The catalogue's data types: a change's :class:`PatchSpec` and each assumption it makes about the host
(:class:`Reliance`). Every change module imports them from here; :mod:`fdsched.patches` collects the specs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["PatchSpec", "Reliance", "Variant"]


@dataclass(frozen=True)
class Variant:
    """A change's mixin for one impl that also depends on the host or the arm's settings, chosen once when the
    arm's class is built: ``choose(host_has, settings)`` returns one of ``options`` (``host_has``: the host
    carries the change; ``settings``: the arm's :class:`fdsched.core.settings.Settings`)."""

    choose: Callable
    options: tuple

    @classmethod
    def by_host(cls, with_change, without_change) -> "Variant":
        """The mixin ``with_change`` on a host that carries the change, else ``without_change``."""
        return cls(lambda host_has, settings: with_change if host_has else without_change, (with_change, without_change))


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
    # (impl -> {Target: mixin or Variant}) instead names a mixin per impl, where the impls differ in what they
    # do (a Variant where it also differs by host or by the arm's settings).
    applies: tuple = ("plugin",)
    variants: Optional[dict] = None

    def mixin_of(self, target: str, impl: str, host_has: bool = False, settings=None):
        """The mixin an arm whose decision for this change is ``impl`` gets for ``target``, or None
        (``host_has`` and ``settings`` choose among a :class:`Variant`'s options)."""
        if self.variants is not None:
            chosen = self.variants.get(impl, {}).get(target)
            return chosen.choose(host_has, settings) if isinstance(chosen, Variant) else chosen
        return self.mixins.get(target) if impl in self.applies else None

    def classes(self, target: str) -> tuple:
        """Every mixin class this change may put into ``target``'s plugin classes (its base and variants)."""
        found = [self.mixins[target]] if target in self.mixins else []
        for by_target in (self.variants or {}).values():
            chosen = by_target.get(target)
            for mixin in chosen.options if isinstance(chosen, Variant) else (chosen,) if chosen else ():
                if mixin not in found:
                    found.append(mixin)
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

"""The catalogue's data types: a change's :class:`PatchSpec` and each assumption it makes about the host
(:class:`Reliance`). Every change module imports them from here; :mod:`fdsched.patches` collects the specs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional

__all__ = ["AlteredTest", "PatchSpec", "Reliance", "Variant", "Shapes", "shape_of", "format_shape", "served_methods",
           "strategy_problem", "call_problem", "uses_problem", "pick_shape"]


# ---- host signatures: what the plugin checks before it patches -----------------------------------------------
_NO_DEFAULT = "<required>"


def shape_of(func) -> Optional[tuple]:
    """A function's parameters as the plugin compares them: ``(name, kind, default)`` per parameter, annotations
    left out (``default`` is the repr of the default value, or ``<required>``). None when the signature cannot be
    read. ``self`` is kept: it is the first positional parameter of every method."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return None
    return tuple(
        (p.name, p.kind.name, _NO_DEFAULT if p.default is inspect.Parameter.empty else repr(p.default)) for p in params
    )


def format_shape(shape: tuple) -> str:
    """``(self, a, b=1, *, c)`` for a :func:`shape_of` tuple."""
    parts, star_done = [], False
    for name, kind, default in shape:
        if kind == "KEYWORD_ONLY" and not star_done:
            parts.append("*")
            star_done = True
        text = {"VAR_POSITIONAL": f"*{name}", "VAR_KEYWORD": f"**{name}"}.get(kind, name)
        if kind == "VAR_POSITIONAL":
            star_done = True
        parts.append(text if default == _NO_DEFAULT else f"{text}={default}")
    return f"({', '.join(parts)})"


def _is_plugin_class(cls) -> bool:
    return cls.__module__.split(".", 1)[0] == "fdsched"


def served_methods(strategy) -> dict:
    """Host method name -> the strategy's function, for every seam a strategy class serves (its ``seams``)."""
    return {name: getattr(strategy, name) for name in getattr(strategy, "seams", ())}


def strategy_problem(strategy, host_cls) -> Optional[str]:
    """Why ``strategy`` (a change's strategy object's class: each method it serves, named in its ``seams``, takes the
    host object first, then the host method's own parameters) cannot serve ``host_cls``'s seams: a seam the host
    lacks, or whose signature differs from the one the strategy was written for (names, order, kinds, defaults; the
    host object left out). The host calls the seam as it calls its own method, and the strategy calls the host's with
    its own parameters, so the two must be the same. None when every method fits."""
    return _methods_problem(served_methods(strategy), host_cls, "serves", takes_host_object=True)


def _methods_problem(methods: dict, host_cls, verb: str, takes_host_object: bool = False) -> Optional[str]:
    """The first of ``methods`` (host method name -> the plugin's function) whose shape the host's method does not
    have, in words; a ``*args, **kwargs`` pass-through takes whatever the host's takes. ``takes_host_object``: each
    function takes the host object after its own ``self`` (a strategy's), left out of the comparison."""
    for name, func in sorted(methods.items()):
        mine = shape_of(func)
        if mine is not None and takes_host_object:
            mine = mine[:1] + mine[2:]
        if mine is not None and any(kind in ("VAR_POSITIONAL", "VAR_KEYWORD") for _, kind, _ in mine):
            continue  # a pass-through: takes whatever the host's takes
        host = getattr(host_cls, name, None)
        if host is None or not callable(host):
            return f"{host_cls.__name__}.{name} is missing (the plugin {verb} it)"
        theirs = shape_of(host)
        if theirs is None:
            return f"{host_cls.__name__}.{name} has no readable signature"
        if mine != theirs:
            mine_text = format_shape(mine) if mine is not None else "(?)"
            return f"{host_cls.__name__}.{name}{format_shape(theirs)} differs from the {mine_text} the plugin handles"
    return None


def call_problem(host_cls, method: str, args: tuple) -> Optional[str]:
    """Why the plugin's call ``method(*args)`` (``args``: the parameter names it passes, by position) does not fit
    the host's method: missing, a parameter at one of those positions named otherwise (another meaning), or a
    required parameter left over. None when it fits."""
    func = getattr(host_cls, method, None)
    if func is None or not callable(func):
        return f"{host_cls.__name__}.{method} is missing"
    shape = shape_of(func)
    if shape is None:
        return f"{host_cls.__name__}.{method} has no readable signature"
    positional = [p for p in shape[1:] if p[1] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    have = tuple(p[0] for p in positional[: len(args)])
    rest = [p for p in shape[1:] if p not in positional[: len(args)] and p[1] not in ("VAR_POSITIONAL", "VAR_KEYWORD")]
    if have != tuple(args) or any(p[2] == _NO_DEFAULT for p in rest):
        return f"{host_cls.__name__}.{method}{format_shape(shape)} does not take the plugin's call ({', '.join(args)})"
    return None


def declared(strategy, attr: str) -> dict:
    """A strategy class's ``fdsched_calls`` / ``fdsched_globals`` merged over the plugin classes it derives from (a
    subclass entry of None removes an inherited one)."""
    merged: dict = {}
    for cls in reversed(strategy.__mro__):
        if _is_plugin_class(cls):
            merged.update(vars(cls).get(attr, {}))
    return {key: value for key, value in merged.items() if value is not None}  # None: a subclass no longer uses it


def uses_problem(strategy, target: str, host_classes: dict) -> Optional[str]:
    """What ``strategy`` (written for ``target``) declares it uses of the host and the host lacks, or None.

    ``fdsched_calls``: ``"Target.method" -> the parameter names the plugin passes, by position`` for every host
    method the strategy calls without serving it (:func:`call_problem`; a seam it serves is checked by
    :func:`strategy_problem`). ``fdsched_attributes``: the attributes of the host object it reads (set by the host's
    ``__init__``, or on its class). ``fdsched_globals``: ``module -> names`` it reads from the host module's globals
    (:func:`fdsched.patches._base.host_global`)."""
    import sys

    overridden = set(getattr(strategy, "seams", ()))
    for target_method, args in sorted(declared(strategy, "fdsched_calls").items()):
        called, method = target_method.split(".", 1)
        host_cls = host_classes.get(called)
        if host_cls is None or (called == target and method in overridden):
            continue
        problem = call_problem(host_cls, method, tuple(args))
        if problem:
            return problem
    missing = [name for name in attributes_of(strategy) if not host_sets(host_classes.get(target), name)]
    if missing:
        return f"{host_classes[target].__name__} sets no {', '.join(missing)} (the plugin reads it)"
    for module_name, names in sorted(declared(strategy, "fdsched_globals").items()):
        module = sys.modules.get(module_name)
        missing = [name for name in names if module is None or not hasattr(module, name)]
        if missing:
            return f"{module_name} has no {', '.join(missing)}"
    return None


def attributes_of(strategy) -> tuple:
    """The host instance attributes a strategy class reads (its ``fdsched_attributes``, over the plugin classes it
    derives from), in order, once each."""
    found: list = []
    for cls in reversed(strategy.__mro__):
        if _is_plugin_class(cls):
            for name in vars(cls).get("fdsched_attributes", ()):
                if name not in found:
                    found.append(name)
    return tuple(found)


def host_sets(host_cls, name: str) -> bool:
    """Whether objects of ``host_cls`` have ``name``: a class attribute (method, property), or an attribute some
    ``__init__`` along the host's MRO assigns (read from its code: nothing is constructed)."""
    if host_cls is None:
        return False
    if hasattr(host_cls, name):
        return True
    for cls in host_cls.__mro__:
        init = vars(cls).get("__init__")
        code = getattr(init, "__code__", None)
        if code is not None and _assigns(code, name):
            return True
    return False


def _assigns(code, name: str) -> bool:
    import dis

    for instruction in dis.get_instructions(code):
        if instruction.opname == "STORE_ATTR" and instruction.argval == name:
            return True
    return any(_assigns(const, name) for const in code.co_consts if inspect.iscode(const))


class Shapes(tuple):
    """One behaviour written for several shapes of the host's methods (e.g. a threshold seam that takes the
    request too): the installer takes the first strategy whose seams all match the host (:func:`strategy_problem`);
    when none does, the change is declined with the first one's difference."""

    def __new__(cls, *strategies):
        return super().__new__(cls, strategies)

    def pick(self, host_cls, target: Optional[str] = None, host_classes: Optional[dict] = None) -> tuple:
        """(the strategy for ``host_cls``, None) or (None, why none fits): the first whose seams match the host and,
        given the ``target`` it is for and every target's ``host_classes``, whose declared uses the host has."""
        shape_problems, use_problems = [], []
        for strategy in self:
            problem = strategy_problem(strategy, host_cls)
            if problem is not None:
                shape_problems.append(problem)
                continue
            problem = uses_problem(strategy, target, host_classes) if host_classes is not None else None
            if problem is None:
                return strategy, None
            use_problems.append(problem)
        # the closest miss: a shape that matched the host's methods but uses something the host lacks
        return None, (use_problems or shape_problems)[0]


def pick_shape(chosen, host_cls, target: Optional[str] = None, host_classes: Optional[dict] = None) -> tuple:
    """(strategy or None, problem or None) for a chosen strategy, :class:`Shapes` or None on ``host_cls``."""
    if chosen is None:
        return None, None
    if isinstance(chosen, Shapes):
        return chosen.pick(host_cls, target, host_classes)
    return chosen, strategy_problem(chosen, host_cls)


@dataclass(frozen=True)
class Variant:
    """A change's strategy for one impl that also depends on the host or the arm's settings, chosen once when the
    plugin is installed: ``choose(host_has, settings)`` returns one of ``options`` (``host_has``: the host carries the
    change; ``settings``: the arm's :class:`fdsched.core.settings.Settings`)."""

    choose: Callable
    options: tuple

    @classmethod
    def by_host(cls, with_change, without_change) -> "Variant":
        """The strategy ``with_change`` on a host that carries the change, else ``without_change``."""
        return cls(lambda host_has, settings: with_change if host_has else without_change, (with_change, without_change))


@dataclass(frozen=True)
class AlteredTest:
    """A host test whose assertion this change alters on purpose: it may pass without the plugin and fail with it.

    ``test``: its pytest node id inside the host's tree; ``upstream_pr``: the PR whose behaviour change it asserts
    against; ``on_host_with_change``: where it applies (False: only on a host that lacks the upstream change, where
    the host's test still asserts the pre-change behaviour); it applies in a run that runs the plugin's version.
    """

    test: str
    why: str
    upstream_pr: int
    on_host_with_change: bool = False

    def applies(self, impl: str, host_has: bool) -> bool:
        return impl == "plugin" and host_has == self.on_host_with_change


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
    replaces: tuple  # "Target.method" for every host method a strategy of this change serves
    why: str
    how: str
    hosts_needing: str  # which host versions need it
    switch: str  # environment variable (also `changes.<id>` in a profile)
    delete_when: str
    host_has: Callable  # HostInfo -> bool: the host already carries the change
    relies_on: tuple = ()  # Reliance, one per "Relies on:" item of the module docstring
    # (settings, host_has) -> bool: whether the host has the change *as the settings select it*
    # (the PD change: a host with 7387 has upstream's behaviour, never the safe one).
    host_has_as_selected: Optional[Callable] = None
    alters_tests: tuple = ()  # AlteredTest: the host's own tests this change alters on purpose (fdsched host test)
    # Target -> {impl: strategy class, Shapes or Variant of them, or None}: the strategy an instance of the target's
    # fixed class uses under an arm with that impl (None: the host's own code runs); the catalogue's table
    # (patches/_scheduler.py, patches/_prefix_cache.py, patches/_cache_queue.py).
    strategies: dict = field(default_factory=dict)

    def classes(self, target: str) -> tuple:
        """Every strategy class this change may use on ``target`` (every impl's, every variant and shape)."""
        found = []
        for chosen in self.strategies.get(target, {}).values():
            for option in chosen.options if isinstance(chosen, Variant) else (chosen,) if chosen else ():
                for strategy in option if isinstance(option, Shapes) else (option,):
                    if strategy not in found:
                        found.append(strategy)
        return tuple(found)

    def choose(self, target: str, impl: str, host_cls, host_has: bool = False, settings=None,
               host_classes: Optional[dict] = None) -> tuple:
        """(the strategy this impl uses on ``host_cls`` or None, why it cannot or None): the table's entry, a
        :class:`Variant` chosen by ``host_has`` and ``settings``, a :class:`Shapes` picked by the host's seams and,
        given ``host_classes``, declared uses."""
        chosen = self.strategies.get(target, {}).get(impl)
        if isinstance(chosen, Variant):
            chosen = chosen.choose(host_has, settings)
        return pick_shape(chosen, host_cls, target, host_classes)

    def shape_problem(self, host_classes: dict, impl: str, host_has: bool = False, settings=None) -> Optional[str]:
        """Why this impl cannot run on the host, or None: every target's strategy checked (:meth:`choose`: the
        seams it serves), then what the chosen strategies declare they use of the host
        (:func:`uses_problem`: the host methods they call, the host module globals they read)."""
        chosen = []
        for target, host_cls in host_classes.items():
            strategy, problem = self.choose(target, impl, host_cls, host_has, settings, host_classes)
            if problem:
                return problem
            if strategy is not None:
                chosen.append((target, strategy))
        for target, strategy in chosen:
            problem = uses_problem(strategy, target, host_classes)
            if problem:
                return problem
        return None

    def check_reliances(self, info) -> dict:
        """Reliance name -> what differs on the probed host, for every assumption that does not hold."""
        found = {}
        for reliance in self.relies_on:
            try:
                problem = reliance.check(info)
            except Exception as exc:  # noqa: BLE001 - a host the probe cannot read does not hold the assumption
                problem = f"probing it failed ({type(exc).__name__}: {exc})"
            if problem:
                found[reliance.name] = problem
        return found

    def reliance_problem(self, failed: dict, impl: str) -> Optional[str]:
        """The first failed reliance (from :meth:`check_reliances`) that matters for ``impl``, in words."""
        for reliance in self.relies_on:
            if reliance.name in failed and impl in reliance.when:
                return f"it relies on {reliance.name} ({reliance.text}), but {failed[reliance.name]}"
        return None

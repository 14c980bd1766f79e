"""Probe the host, decide every change, build the plugin's classes, rebind them — once per process.

Order of work, so that nothing is ever half-patched:

1. settings are loaded and validated (:func:`fdsched.settings.load_settings`; errors raise here);
2. the host is found and probed (:func:`fdsched.host.probe`);
3. every change is decided (:func:`decide`); a change switched ``on`` (or ``off`` on a host that
   has it) that the host cannot take — a method or signature it needs, or an assumption about the
   host's control flow written in its module's "Relies on:" — is an error, raised here;
4. only then are the three classes built and rebound; if rebinding one fails, those already rebound
   are restored before the error propagates.

:func:`install` is idempotent and cheap on a second call. :func:`uninstall` restores exactly.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Mapping, Optional

from . import host as host_mod
from .hooks import Policies, make_plugin_manager
from .rebind import Rebinding
from .settings import CHANGE_IDS, Settings, effective_ratio_mode, load_settings

__all__ = ["Decision", "InstallReport", "InstallError", "decide", "install", "uninstall", "current"]


class InstallError(RuntimeError):
    """The host cannot take a change the settings demand."""


@dataclass(frozen=True)
class Decision:
    change_id: str
    mode: str  # auto / on / off, after the host's own switch is considered
    impl: str  # host (the host's own code) / plugin (the plugin's version) / off (the plugin restores the pre-change code)
    state: str  # one word: applied / host / off / skipped
    detail: str  # the human-readable state line

    def line(self) -> str:
        return f"{self.change_id}={self.detail}"


@dataclass
class InstallReport:
    settings: Settings
    host: "host_mod.HostInfo"
    decisions: dict
    classes: dict
    sites: dict
    policies: Policies

    def summary(self) -> str:
        profile = self.settings.profile or "none"
        changes = "; ".join(d.line() for d in self.decisions.values())
        return f"fdsched installed (profile {profile}) on {self.host.label}: {changes}"


def decide(settings: Settings, info) -> dict:
    """change id -> :class:`Decision`. Raises :class:`InstallError` for an impossible demand."""
    from fdsched.patches import spec_for

    decisions = {}
    for change_id in CHANGE_IDS:
        mode = effective_ratio_mode(settings) if change_id == "ratio_reserve" else settings.change_mode(change_id)
        spec = spec_for(change_id)
        has_change = bool(info.has.get(change_id))  # the host carries the upstream change
        has = has_change  # ... in the flavour the settings select (auto / on decide on this)
        if spec.host_has_as_selected is not None:
            has = spec.host_has_as_selected(settings, has_change)
        failed = getattr(info, "reliance_problems", {}).get(change_id, {})
        # What stops the plugin from running its version (auto / on), or the pre-change code (off), here.
        problem = info.problems.get(change_id) or spec.reliance_problem(failed, "plugin")
        off_problem = info.problems.get(change_id) or spec.reliance_problem(failed, "off")
        if mode == "auto":
            if has:
                d = Decision(change_id, mode, "host", "host", "host already has it")
            elif problem:
                d = Decision(change_id, mode, "host", "skipped", f"skipped because {problem}")
            elif has_change:  # the host has the change, but not in the flavour the settings select
                d = Decision(change_id, mode, "plugin", "applied", "applied (the host has upstream's flavour)")
            else:
                d = Decision(change_id, mode, "plugin", "applied", "applied")
        elif mode == "on":
            if problem:
                raise InstallError(
                    f"changes.{change_id}=on (FDSCHED_{change_id.upper()}) cannot be applied to {info.label}: "
                    f"{problem}; allowed: auto (skip where the host cannot take it) or off"
                )
            d = Decision(change_id, mode, "plugin", "applied", "applied (plugin's version over the host's)" if has else "applied")
        else:  # off: what matters is whether the host runs the post-change code at all
            if not has_change:
                d = Decision(change_id, mode, "host", "off", "off (host's own pre-change code)")
            elif off_problem:
                raise InstallError(
                    f"changes.{change_id}=off (FDSCHED_{change_id.upper()}) needs the plugin to restore the pre-change "
                    f"code on {info.label}, which it cannot: {off_problem}; allowed: auto or on"
                )
            else:
                d = Decision(change_id, mode, "off", "off", "off (plugin restores the pre-change code)")
        decisions[change_id] = d
    if settings["tunables.transfer_force_direct_recycle"] and decisions["deferred_recycle"].impl != "plugin":
        raise InstallError(
            f"FDSCHED_TRANSFER_FORCE_DIRECT_RECYCLE=1 ({settings.sources['tunables.transfer_force_direct_recycle']}) "
            f"needs changes.deferred_recycle applied, but it is {decisions['deferred_recycle'].detail}; "
            "allowed: 0, or 1 with FDSCHED_DEFERRED_RECYCLE=on/auto"
        )
    return decisions


_LOCK = threading.RLock()
_CURRENT: Optional[InstallReport] = None
_REBINDINGS: list = []


def current() -> Optional[InstallReport]:
    return _CURRENT


def _build(info, settings: Settings, decisions: dict, policies: Policies) -> dict:
    from fdsched.patches import TARGETS, mixins_for
    from fdsched.patches._base import InitGuard

    impl = {cid: d.impl for cid, d in decisions.items()}
    classes = {}
    for target, host_cls in info.host_classes.items():
        mixins = mixins_for(target)  # outermost first; tests/unit/test_catalogue.py pins the order and why
        attrs = {
            "__module__": "fdsched.patches",
            "__qualname__": host_cls.__name__,
            "__doc__": f"fdsched subclass of {TARGETS[target]} (changes: {', '.join(m.__name__ for m in mixins)}).",
            "_fdsched_impl": impl,
            "_fdsched_settings": settings,
            "_fdsched_policies": policies,
            "_fdsched_host": info,
            "_fdsched_host_class": host_cls,
        }
        classes[target] = type(host_cls.__name__, (InitGuard,) + mixins + (host_cls,), attrs)
    return classes


def install(
    settings: Optional[Settings] = None, environ: Optional[Mapping[str, str]] = None, policies: Optional[Policies] = None
) -> InstallReport:
    """Install the plugin in this process (idempotent).

    Without arguments the settings come from the environment, once: a second call returns the
    first report and changes nothing. Passing different ``settings`` reinstalls with them (the
    replay switches profiles this way).
    """
    global _CURRENT
    with _LOCK:
        if _CURRENT is not None and (settings is None or settings == _CURRENT.settings) and policies is None:
            return _CURRENT
        settings = load_settings(environ) if settings is None else settings
        info = host_mod.probe(environ)
        decisions = decide(settings, info)
        policies = policies or Policies(make_plugin_manager(environ))
        classes = _build(info, settings, decisions, policies)
        if _CURRENT is not None:
            uninstall()
        from fdsched.patches import TARGETS

        rebindings = [
            Rebinding(TARGETS[target].rsplit(".", 1)[0], target, classes[target]) for target in info.host_classes
        ]
        sites = {}
        done = []
        try:
            for rebinding in rebindings:
                sites[rebinding.name] = rebinding.apply()
                done.append(rebinding)
        except BaseException:
            for rebinding in reversed(done):
                rebinding.restore()
            raise
        _REBINDINGS[:] = rebindings
        _CURRENT = InstallReport(settings, info, decisions, classes, sites, policies)
        return _CURRENT


def uninstall() -> None:
    """Restore every binding the last install replaced. Safe to call when nothing is installed."""
    global _CURRENT
    with _LOCK:
        for rebinding in reversed(_REBINDINGS):
            rebinding.restore()
        _REBINDINGS.clear()
        _CURRENT = None

"""Probe the host, decide every change, build the plugin's classes, rebind them — once per process.

Order of work, so that nothing is ever half-patched:

1. settings are loaded and validated (:func:`fdsched.core.settings.load_settings`; errors raise here);
2. the host is found and probed (:func:`fdsched.install.probe.probe`);
3. every change is decided (:func:`decide`); a change switched ``on`` (or ``off`` on a host that
   has it) that the host cannot take — a method or signature it needs, or an assumption about the
   host's control flow written in its module's "Relies on:" — is an error, raised here;
4. only then are the classes built and rebound; if rebinding one fails, those already rebound
   are restored before the error propagates.

Online A/B (``FDSCHED_PROFILE_BY_DP_RANK``): steps 1 and 3 run for every arm too, and an error names the
rank and its profile. Step 4 builds one fixed class per target, over the host class, that the host module is rebound
to, with a table made here (:func:`strategy_row`: per rank, each change's strategy for that arm's decision); each
instance reads its own data-parallel rank when it is built (``local_data_parallel_id``: the engine forks ranks
1..N-1 after rank 0's scheduler exists, so nothing per process can tell them apart) and builds that arm's
strategies; ranks not listed get ``FDSCHED_PROFILE``'s (or the defaults'). The class's ``_fdsched_impl`` /
``_fdsched_settings`` are those of the single profile; an instance has its arm's.

:func:`install` is idempotent and cheap on a second call. :func:`uninstall` restores exactly.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Mapping, Optional

from fdsched.install import probe as host_mod
from fdsched.core.hooks import Policies, make_plugin_manager
from fdsched.install.rebind import Rebinding
from fdsched.core.settings import CHANGE_IDS, DP_PROFILE_ENV, Settings, load_arm_settings, load_settings

__all__ = ["Arm", "Decision", "InstallReport", "InstallError", "effective_ratio_mode", "decide", "decide_arms", "install", "uninstall", "current"]


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


@dataclass(frozen=True)
class Arm:
    """What one instance runs: the arm's label (its profile's name, or ``default``), settings and decisions."""

    label: str
    settings: Settings
    decisions: dict  # change id -> Decision

    @property
    def impl(self) -> dict:
        return {cid: d.impl for cid, d in self.decisions.items()}

    def line(self) -> str:
        return "; ".join(d.line() for d in self.decisions.values())


def arm_label(settings: Settings) -> str:
    """The ``arm`` label of metrics: the profile's name, or ``default`` without a profile."""
    return settings.profile or "default"


@dataclass
class InstallReport:
    settings: Settings
    host: "host_mod.HostInfo"
    decisions: dict
    classes: dict
    sites: dict
    policies: Policies
    arms: dict = None  # rank -> Arm (FDSCHED_PROFILE_BY_DP_RANK); empty for a single-profile deployment

    def summary(self) -> str:
        profile = self.settings.profile or "none"
        changes = "; ".join(d.line() for d in self.decisions.values())
        text = f"fdsched installed (profile {profile}) on {self.host.label} ({self.host.support}): {changes}"
        if self.arms:
            ranks = ", ".join(f"dp rank {rank}: {arm.label}" for rank, arm in sorted(self.arms.items()))
            text += f"; online A/B arms ({DP_PROFILE_ENV}): {ranks}; other ranks: {arm_label(self.settings)}"
        return text


def effective_ratio_mode(settings: Settings) -> str:
    """The ratio-reserve switch after the host's FD_USE_NEW_TOKEN_RATIO_RESERVE is considered.

    ``auto`` with FD_USE_NEW_TOKEN_RATIO_RESERVE explicitly 0 means the operator asked for the fixed-block
    policy by the host's own name: treat it as ``off``.
    """
    mode = settings.change_mode("ratio_reserve")
    explicit_host = settings.sources["host_tunables.FD_USE_NEW_TOKEN_RATIO_RESERVE"] != "default"
    if mode == "auto" and explicit_host and not settings["host_tunables.FD_USE_NEW_TOKEN_RATIO_RESERVE"]:
        return "off"
    return mode


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
        # What stops the plugin from running its version (auto / on), or the pre-change code (off), here: a host
        # method it overrides or calls whose shape it does not handle, a host global it reads that is missing,
        # or an assumption about the host's control flow that does not hold. Checked before anything is patched.
        probe_failed = info.problems.get(change_id)
        problem = (
            probe_failed or _impl_problem(spec, info, "plugin", has_change, settings)
            or spec.reliance_problem(failed, "plugin")
        )
        off_problem = (
            (probe_failed or _impl_problem(spec, info, "off", has_change, settings) or spec.reliance_problem(failed, "off"))
            if has_change else None
        )
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


def _impl_problem(spec, info, impl: str, host_has: bool, settings) -> Optional[str]:
    """Why ``impl`` of ``spec``'s change cannot run on the probed host (see :meth:`PatchSpec.shape_problem`); a
    probe that itself fails is a reason too, never an exception. A probe result that carries no host classes (a
    plain object in the unit tests) has only the problems it lists."""
    if getattr(info, "host_classes", None) is None:
        return None
    try:
        return spec.shape_problem(info.host_classes, impl, host_has, settings)
    except Exception as exc:  # noqa: BLE001 - an unreadable host is a reason to decline, not to crash
        return f"probing the host's methods failed ({type(exc).__name__}: {exc})"


def decide_arms(arm_settings: Mapping[int, Settings], info) -> dict:
    """rank -> :class:`Arm`; an arm the host cannot take is one :class:`InstallError` naming the rank and profile."""
    arms = {}
    for rank, settings in sorted(arm_settings.items()):
        try:
            decisions = decide(settings, info)
        except InstallError as exc:
            raise InstallError(
                f"environment variable {DP_PROFILE_ENV}, rank {rank} (profile {settings.profile}): {exc}"
            ) from None
        arms[rank] = Arm(arm_label(settings), settings, decisions)
    return arms


_LOCK = threading.RLock()
_CURRENT: Optional[InstallReport] = None
_REBINDINGS: list = []


def current() -> Optional[InstallReport]:
    return _CURRENT


def _build(info, settings: Settings, decisions: dict, policies: Policies, arms: Optional[dict] = None) -> dict:
    """target -> the plugin's one fixed class over the host class, which the host module is rebound to: each instance
    builds its rank's strategies from the table made here (:func:`strategy_row`)."""
    from fdsched.patches import CATALOGUE, _cache_queue, _prefix_cache, _scheduler
    from fdsched.patches._base import status_views
    from fdsched.patches._outcomes import RequestOutcomes
    from fdsched.patches._spec import strategy_problem

    arms = dict(arms or {})
    default_arm = Arm(arm_label(settings), settings, decisions)
    common = {
        "_fdsched_arms": arms,
        "_fdsched_default_arm": default_arm,
        "_fdsched_impl": default_arm.impl,  # the single profile's (an instance has its arm's)
        "_fdsched_settings": default_arm.settings,
        "_fdsched_policies": policies,
        "_fdsched_host": info,
    }
    classes = {}
    for target, host_cls in info.host_classes.items():
        if target == "EngineCacheQueue":
            # each client picks its receiver when it is built; the server's lists can wait when any arm's receiver does
            runs_it = any(arm.impl["nonpolling_transfer"] == "plugin" for arm in (default_arm, *arms.values()))
            classes[target] = _cache_queue.over(host_cls, default_arm.impl, default_arm.settings, runs_it)
            continue
        rows = {rank: (arm, strategy_row(target, arm, info)) for rank, arm in arms.items()}
        rows[None] = (default_arm, strategy_row(target, default_arm, info))
        if target == "PrefixCacheManager":
            classes[target] = _prefix_cache.over(host_cls, rows, common)
            continue
        # measurement only (every arm, every profile), where the host's finish_requests has the shape it is written for
        outermost = (RequestOutcomes,) if strategy_problem(RequestOutcomes, host_cls) is None else ()
        order = tuple(spec.change_id for spec in CATALOGUE)  # innermost first
        classes[target] = _scheduler.over(host_cls, rows, order, outermost, dict(common, **status_views(info, policies)))
    return classes


def strategy_row(target: str, arm: Arm, info) -> dict:
    """change id -> the strategy class ``arm`` runs for it on ``target``'s fixed class (None: the host's own code):
    each change's ``SPEC.strategies`` entry for the arm's decision, with the host's shape picked."""
    from fdsched.patches import CATALOGUE

    row = {}
    for spec in CATALOGUE:
        if target in spec.strategies:
            strategy, _problem = spec.choose(target, arm.impl[spec.change_id], info.host_classes[target],
                                             bool(info.has.get(spec.change_id)), arm.settings, info.host_classes)
            row[spec.change_id] = strategy  # a shape the host lacks was declined when the arm was decided
    return row


def install(
    settings: Optional[Settings] = None,
    environ: Optional[Mapping[str, str]] = None,
    policies: Optional[Policies] = None,
    arms: Optional[Mapping[int, Settings]] = None,
) -> InstallReport:
    """Install the plugin in this process (idempotent).

    Without arguments the settings come from the environment, once: a second call returns the
    first report and changes nothing. Passing different ``settings`` reinstalls with them (the
    replay switches profiles this way). ``arms`` (rank -> settings) are the online A/B arms; without
    ``settings`` they too come from the environment (``FDSCHED_PROFILE_BY_DP_RANK``), with explicit
    ``settings`` there are none unless given.
    """
    global _CURRENT
    with _LOCK:
        if (
            _CURRENT is not None
            and (settings is None or settings == _CURRENT.settings)
            and policies is None
            and (arms is None or dict(arms) == {r: a.settings for r, a in (_CURRENT.arms or {}).items()})
        ):
            return _CURRENT
        if settings is None:
            settings = load_settings(environ)
            arm_settings = load_arm_settings(environ) if arms is None else dict(arms)
        else:
            arm_settings = dict(arms or {})
        info = host_mod.probe(environ)
        decisions = decide(settings, info)
        arm_map = decide_arms(arm_settings, info)
        policies = policies or Policies(make_plugin_manager(environ))
        classes = _build(info, settings, decisions, policies, arm_map)
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
        _CURRENT = InstallReport(settings, info, decisions, classes, sites, policies, arm_map)
        return _CURRENT


def uninstall() -> None:
    """Restore every binding the last install replaced. Safe to call when nothing is installed."""
    global _CURRENT
    with _LOCK:
        for rebinding in reversed(_REBINDINGS):
            rebinding.restore()
        _REBINDINGS.clear()
        _CURRENT = None

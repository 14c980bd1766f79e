"""The plugin manager: our default policies plus third-party hook implementations.

:class:`Policies` is what the patches call. When a hook has no implementation besides ours it calls
the pure policy function directly, so the scheduler's hot path pays no hook dispatch.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence

import pluggy

from fdsched import hookspecs

from fdsched.core import admission, policies
from fdsched.hookspecs import hookimpl
from fdsched.core.policies import VictimCandidate

__all__ = ["ENTRY_POINT_GROUP", "DISABLE_ENV", "DefaultPolicies", "Policies", "make_plugin_manager"]

ENTRY_POINT_GROUP = "fdsched.hooks"
DISABLE_ENV = "FDSCHED_DISABLE_EXTERNAL_HOOKS"


class DefaultPolicies:
    """The plugin's own policies as hook implementations (registered last, consulted last)."""

    @hookimpl(trylast=True)
    def fdsched_select_preemption_victim(self, candidates: Sequence[VictimCandidate], decode_only: bool):
        if decode_only:
            return policies.select_preemption_victim(candidates)
        return policies.select_any_phase_victim(candidates)

    @hookimpl(trylast=True)
    def fdsched_estimate_reserve_blocks(
        self, request_id, max_new_tokens, generated_tokens, ratio, clip_max_new_tokens, block_size
    ):
        return admission.reserve_blocks_for_request(
            max_new_tokens, generated_tokens, ratio, clip_max_new_tokens, block_size
        )

    @hookimpl(trylast=True)
    def fdsched_is_decoding(self, request_id, status_is_decode, num_total_tokens, need_prefill_tokens):
        return policies.is_decoding(status_is_decode, num_total_tokens, need_prefill_tokens)


def external_plugin_states(environ: Optional[Mapping[str, str]] = None) -> tuple:
    """What ``fdsched doctor`` shows: ``(rows, blocked_all)``, rows being (entry-point name, state) for every
    plugin installed in the group, state ``loaded`` or ``blocked by FDSCHED_DISABLE_EXTERNAL_HOOKS``;
    ``blocked_all``: the variable blocks every third-party plugin. Loads the plugins it does not block (as
    the engine would), so a broken one raises here."""
    from importlib.metadata import entry_points

    environ = os.environ if environ is None else environ
    blocked = _blocked_names(environ)
    names = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
    loaded = set(Policies(make_plugin_manager(environ)).external_plugins())
    why = f"blocked by {DISABLE_ENV}={environ.get(DISABLE_ENV, '').strip()}"
    rows = []
    for name in sorted(set(names) | loaded):
        if name in loaded:
            rows.append((name, "loaded"))
        elif blocked is not None and (not blocked or name in blocked):
            rows.append((name, why))
        else:
            rows.append((name, "not loaded"))
    return rows, blocked == set()


def _blocked_names(environ: Mapping[str, str]) -> Optional[set]:
    """None: nothing blocked; empty set: everything blocked; else the blocked entry-point names."""
    raw = environ.get(DISABLE_ENV, "").strip()
    if raw in ("", "0"):
        return None
    if raw.lower() in ("1", "all", "true"):
        return set()
    return {name.strip() for name in raw.split(",") if name.strip()}


def make_plugin_manager(environ: Optional[Mapping[str, str]] = None, load_entry_points: bool = True):
    """A plugin manager with our defaults and, unless blocked, the ``fdsched.hooks`` entry points."""
    environ = os.environ if environ is None else environ
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(DefaultPolicies(), name="fdsched-defaults")
    blocked = _blocked_names(environ)
    if load_entry_points and blocked != set():
        for name in blocked or ():
            pm.set_blocked(name)
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    pm.check_pending()
    return pm


class Policies:
    """Hook relay with a fast path when only the defaults answer."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self.refresh()

    def register(self, plugin, name: Optional[str] = None):
        """Register a hook implementation; a plugin with an unknown ``fdsched_*`` hook is rejected whole."""
        self.pm.register(plugin, name=name)
        try:
            self.pm.check_pending()
        except Exception:
            self.pm.unregister(plugin)
            raise
        finally:
            self.refresh()

    def unregister(self, plugin) -> None:
        self.pm.unregister(plugin)
        self.refresh()

    def refresh(self) -> None:
        hook = self.pm.hook
        self._direct_victim = len(hook.fdsched_select_preemption_victim.get_hookimpls()) == 1
        self._direct_reserve = len(hook.fdsched_estimate_reserve_blocks.get_hookimpls()) == 1
        self._direct_decoding = len(hook.fdsched_is_decoding.get_hookimpls()) == 1
        self._reserve_overrides = None  # built on first use, after every (un)registration

    def external_plugins(self) -> list[str]:
        # Blocked names stay in pluggy's registry as None placeholders: they are not loaded plugins.
        return sorted(
            name for name, plugin in self.pm.list_name_plugin() if plugin is not None and name != "fdsched-defaults"
        )

    def is_decoding(self, request_id, status_is_decode, num_total_tokens, need_prefill_tokens) -> bool:
        if self._direct_decoding:
            return policies.is_decoding(status_is_decode, num_total_tokens, need_prefill_tokens)
        return bool(
            self.pm.hook.fdsched_is_decoding(
                request_id=request_id,
                status_is_decode=status_is_decode,
                num_total_tokens=num_total_tokens,
                need_prefill_tokens=need_prefill_tokens,
            )
        )

    def select_victim(self, candidates: Sequence[VictimCandidate], decode_only: bool) -> Optional[int]:
        if self._direct_victim:
            if decode_only:
                return policies.select_preemption_victim(candidates)
            return policies.select_any_phase_victim(candidates)
        return self.pm.hook.fdsched_select_preemption_victim(candidates=candidates, decode_only=decode_only)

    @property
    def reserve_is_formula(self) -> bool:
        """True when no third party answers ``fdsched_estimate_reserve_blocks``: :meth:`reserve_blocks` is then the
        plugin's formula, a function of its arguments alone (an answer may be reused while they are unchanged)."""
        return self._direct_reserve

    def reserve_blocks_override(self, request_id, max_new_tokens, generated_tokens, ratio, clip, block_size):
        """A third-party ``fdsched_estimate_reserve_blocks`` answer for one request, or None when no third
        party answers (the adaptive estimator then answers; the plugin's default is not consulted)."""
        if self._direct_reserve:
            return None
        caller = self._reserve_overrides
        if caller is None:
            caller = self._reserve_overrides = self.pm.subset_hook_caller(
                "fdsched_estimate_reserve_blocks", remove_plugins=[self.pm.get_plugin("fdsched-defaults")]
            )
        answer = caller(**_reserve_args(request_id, max_new_tokens, generated_tokens, ratio, clip, block_size))
        return None if answer is None else int(answer)

    def reserve_blocks(self, request_id, max_new_tokens, generated_tokens, ratio, clip, block_size) -> int:
        if self._direct_reserve:
            return admission.reserve_blocks_for_request(max_new_tokens, generated_tokens, ratio, clip, block_size)
        return int(
            self.pm.hook.fdsched_estimate_reserve_blocks(
                **_reserve_args(request_id, max_new_tokens, generated_tokens, ratio, clip, block_size)
            )
        )


def _reserve_args(request_id, max_new_tokens, generated_tokens, ratio, clip, block_size) -> dict:
    """The keyword arguments of ``fdsched_estimate_reserve_blocks`` (one spelling for every caller)."""
    return dict(
        request_id=request_id,
        max_new_tokens=max_new_tokens,
        generated_tokens=generated_tokens,
        ratio=ratio,
        clip_max_new_tokens=clip,
        block_size=block_size,
    )

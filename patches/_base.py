"""What every mixin may use: the runtime choice per change, small views of host requests, one-shot signals.

The installer builds each plugin class as
``type(name, (InitGuard, <mixins, later catalogue entries first>, HostClass), attrs)``, so the MRO is
``PluginClass -> InitGuard -> mixin of the last change ... mixin of the first change -> PluginBase -> HostClass``
(every mixin derives from :class:`PluginBase`, which therefore sits right before the host class). It sets, as
class attributes:

* ``_fdsched_impl``: change id -> ``"host"`` (the host's own code runs), ``"plugin"`` (the plugin's
  version of the change) or ``"off"`` (the plugin runs the pre-change code on a host that already has
  the change: the change is off);
* ``_fdsched_settings``, ``_fdsched_policies`` (:class:`fdsched.hooks.Policies`), ``_fdsched_host``
  (:class:`fdsched.host.HostInfo`) and ``_fdsched_host_class`` (the class that was replaced).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from fdsched.metrics import METRICS

__all__ = ["PluginBase", "InitGuard", "BlockCheckSignals", "host_global", "host_defines"]


def host_global(module_name: str, name: str):
    """A name from a loaded host module's globals (logger, envs, trace helpers)."""
    return getattr(sys.modules[module_name], name)


def host_defines(obj, method: str) -> bool:
    """Whether the host class ``obj``'s plugin class replaced defines ``method`` (a host seam)."""
    return hasattr(obj._fdsched_host_class, method)


@dataclass(frozen=True)
class _Expected:
    kind: str  # what the signal is for, e.g. "refuse-running-chunk"
    request_id: str  # the request whose check it is
    num_blocks: int  # the block count of that check


class BlockCheckSignals:
    """One-shot signals for the host's next block check (``PrefixCacheManager.can_allocate_gpu_blocks``).

    A signal is keyed to what it is for: its kind, the request and the block count of the check the
    host is about to make. Only a check of exactly that many blocks consumes it, so a check made by
    anyone else in between (another plugin, another code path) neither takes nor is bent by it. The
    scheduler calls :meth:`end_pass` at the end of every ``schedule()`` pass: a signal still pending then
    was not consumed by the check it was for (the host's control flow is not what the patch relies on)
    and is dropped, logged and counted (``fastdeploy:fdsched_unconsumed_signals_total{signal}``).
    """

    def __init__(self) -> None:
        self._pending: list = []

    def expect(self, kind: str, request_id: str, num_blocks: int) -> None:
        self._pending.append(_Expected(kind, request_id, int(num_blocks)))

    def take(self, num_blocks: int) -> frozenset:
        """The kinds pending for a check of ``num_blocks`` blocks; they are consumed."""
        if not self._pending:
            return frozenset()
        taken = [e for e in self._pending if e.num_blocks == num_blocks]
        if not taken:
            return frozenset()
        self._pending = [e for e in self._pending if e.num_blocks != num_blocks]
        return frozenset(e.kind for e in taken)

    def pending(self) -> tuple:
        return tuple(self._pending)

    def end_pass(self, logger) -> list:
        """Drop what is left; log and count each as unconsumed. Returns the dropped signals."""
        left, self._pending = self._pending, []
        for e in left:
            METRICS.signal_unconsumed(e.kind)
            logger.warning(
                f"[fdsched] one-shot signal {e.kind} for request {e.request_id} (a block check of {e.num_blocks} "
                "blocks) was not consumed by the end of the schedule() pass: the host's control flow differs from "
                "what the plugin relies on (see `fdsched patches`); the signal is dropped"
            )
        return left


def block_checks(cache_manager) -> BlockCheckSignals:
    """The signals pending for ``cache_manager``'s block checks (created on first use)."""
    signals = cache_manager.__dict__.get("_fdsched_block_checks")
    if signals is None:
        signals = cache_manager.__dict__["_fdsched_block_checks"] = BlockCheckSignals()
    return signals


class PluginBase:
    _fdsched_impl: dict = {}
    _fdsched_settings = None
    _fdsched_policies = None
    _fdsched_host = None
    _fdsched_host_class = None

    # ---- request views -------------------------------------------------------------------
    def _fdsched_is_decoding(self, request) -> bool:
        """The one decode test (victim choice, ratio estimate, metrics), through the hook."""
        host = self._fdsched_host
        status_is_decode = (request.status == host.request_status.RUNNING_DECODE) if host.split_status else None
        return self._fdsched_policies.is_decoding(
            request.request_id, status_is_decode, request.num_total_tokens, request.need_prefill_tokens
        )


class InitGuard:
    """First base of every plugin class: lets the host's explicit ``super(HostName, self)`` work.

    ``ResourceManagerV1.__init__`` calls ``super(ResourceManagerV1, self).__init__``. Once the
    plugin rebinds ``ResourceManagerV1`` in the host module to its subclass, that call resolves to
    the plugin class's MRO and would enter the plugin's ``__init__`` chain again. The re-entry lands
    here (right after the plugin class in the MRO); it continues past the host class instead.
    """

    def __init__(self, *args, **kwargs):
        if self.__dict__.get("_fdsched_constructing"):
            super(self._fdsched_host_class, self).__init__(*args, **kwargs)
            return
        self.__dict__["_fdsched_constructing"] = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            self.__dict__.pop("_fdsched_constructing", None)

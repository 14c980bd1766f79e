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
  (:class:`fdsched.host.HostInfo`) and ``_fdsched_host_class`` (the class that was replaced);
* ``_fdsched_arms`` (data-parallel rank -> :class:`fdsched.installer.Arm`, from ``FDSCHED_PROFILE_BY_DP_RANK``)
  and ``_fdsched_default_arm`` (every other rank).

Per instance: :class:`InitGuard` reads the instance's data-parallel rank from its constructor's arguments
(``local_data_parallel_id``, else ``config.parallel_config.local_data_parallel_id``) and, *before* the host's
and the mixins' ``__init__`` run, sets ``_fdsched_impl``, ``_fdsched_settings``, ``_fdsched_arm`` (the arm's
label) and ``_fdsched_dp_rank`` on the instance from that rank's arm. Mixins read ``self._fdsched_impl`` /
``self._fdsched_settings`` and so follow the instance's arm; the class attributes stay the single profile's.
The engine forks ranks 1..N-1 after rank 0's scheduler is built, so nothing per process or per class could
tell the ranks apart. ``EngineCacheQueue`` gets no rank (the engine builds its server without one): the queue
a cache manager builds is stamped with that manager's arm when the manager stores it (:class:`ArmStamp`).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

from fdsched.metrics import METRICS

__all__ = [
    "PluginBase",
    "InitGuard",
    "ARM_ATTRS",
    "ArmStamp",
    "InstanceAttribute",
    "RequestOutcomesMixin",
    "BlockCheckSignals",
    "finished_ids",
    "host_global",
    "host_defines",
    "init_signature",
    "dp_rank_of",
]


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

    def end_pass(self, logger, of=None) -> list:
        """Drop what is left; log and count each as unconsumed (labelled by ``of``'s arm). Returns the dropped signals."""
        left, self._pending = self._pending, []
        for e in left:
            METRICS.signal_unconsumed(e.kind, of=of)
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


def init_signature(cls):
    """The signature of ``cls.__init__`` (read once, when the plugin class is built), or None."""
    try:
        return inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return None


def dp_rank_of(signature, args, kwargs) -> int:
    """The data-parallel rank a host constructor call is for.

    ``local_data_parallel_id`` when the caller passes it (the engine passes
    ``cfg.parallel_config.local_data_parallel_id``), else ``config.parallel_config.local_data_parallel_id``,
    else 0. Never ``parallel_config.data_parallel_rank``: it stays 0 on the engine side.
    """
    arguments = {}
    if signature is not None:
        try:
            arguments = signature.bind(None, *args, **kwargs).arguments
        except TypeError:
            arguments = {}
    explicit = arguments.get("local_data_parallel_id")
    if explicit is None:
        parallel = getattr(arguments.get("config"), "parallel_config", None)
        explicit = getattr(parallel, "local_data_parallel_id", None)
    try:
        return int(explicit) if explicit is not None else 0
    except (TypeError, ValueError):
        return 0


def finished_ids(request_ids) -> tuple:
    """``finish_requests``' argument (one id, or an iterable of ids) as (what to pass on to the host, the ids):
    an iterator is read into a list once, so both the override and the host see every id."""
    if isinstance(request_ids, str):
        return request_ids, (request_ids,)
    request_ids = list(request_ids)
    return request_ids, request_ids


# The instance attributes that make an object run its rank's arm (set by _bind_arm, copied by ArmStamp).
ARM_ATTRS = ("_fdsched_impl", "_fdsched_settings", "_fdsched_arm", "_fdsched_dp_rank")


def _bind_arm(obj, rank, arm) -> None:
    obj.__dict__.update(zip(ARM_ATTRS, (arm.impl, arm.settings, arm.label, rank)))


class InstanceAttribute:
    """Data descriptor for a host attribute the plugin must see being assigned: the value lives in the
    instance's ``__dict__`` as before; subclasses extend :meth:`__set__`."""

    def __init__(self, name: str = None) -> None:
        self.name = name

    def __set_name__(self, owner, name):
        if self.name is None:
            self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        try:
            return obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj, value):
        obj.__dict__[self.name] = value

    def __delete__(self, obj):
        try:
            del obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None


class ArmStamp(InstanceAttribute):
    """Data descriptor on a plugin class for an attribute holding another plugin object the instance builds
    (the cache manager's ``cache_task_queue`` client): the stored object takes the instance's arm."""

    def __set__(self, obj, value):
        obj.__dict__[self.name] = value
        if getattr(type(value), "_fdsched_default_arm", None) is not None and "_fdsched_arm" in obj.__dict__:
            for key in ARM_ATTRS:
                value.__dict__[key] = obj.__dict__[key]


class RequestOutcomesMixin:
    """Per-arm request outcomes, recorded where a request finishes in the scheduler process.

    Replaces nothing the host decides: ``finish_requests`` runs the host's own and then, for every request
    that the host's call removed from ``self.requests``, records requests finished, output tokens, TTFT
    (``engine_recv_first_token_time - arrival_time``, what the host's own TTFT histogram uses) and TPOT
    (``(engine_recv_latest_token_time - engine_recv_first_token_time) / (output tokens - 1)``) from the
    request's own timestamps, labelled by this scheduler's arm (:func:`fdsched.metrics.labels_of`).
    Relies on: ``finish_requests(request_ids)`` is where the host removes a finished request from
    ``self.requests`` (both supported hosts; also when called through ``finish_requests_async``).
    """

    def finish_requests(self, request_ids):
        request_ids, ids = finished_ids(request_ids)
        requests = getattr(self, "requests", None)
        before = [(rid, requests.get(rid)) for rid in ids] if isinstance(requests, dict) else []
        result = super().finish_requests(request_ids)
        for rid, request in before:
            if request is not None and rid not in self.requests:
                METRICS.request_finished(request, of=self)
        return result


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
            self._fdsched_bind_arm(args, kwargs)
            super().__init__(*args, **kwargs)
        finally:
            self.__dict__.pop("_fdsched_constructing", None)
        if getattr(type(self), "_fdsched_target", None) == "ResourceManagerV1" and "_fdsched_impl" in self.__dict__:
            # Refusals are counted only where the plugin's reservation code decides: declare the series there (at
            # 0), so a scrape tells "none refused" from "not counted" (the host's own code runs).
            if self._fdsched_impl.get("ratio_reserve") != "host":
                METRICS.admission_counting(of=self)

    def _fdsched_bind_arm(self, args, kwargs) -> None:
        """Set this instance's arm (see the module docstring) before any ``__init__`` of the chain runs."""
        cls = type(self)
        default = getattr(cls, "_fdsched_default_arm", None)
        if default is None:
            return
        if getattr(cls, "_fdsched_target", None) == "EngineCacheQueue":
            return  # no rank here: the class's settings, or the arm ArmStamp gives it later
        rank = dp_rank_of(getattr(cls, "_fdsched_init_signature", None), args, kwargs)
        arms = getattr(cls, "_fdsched_arms", None) or {}
        arm = arms.get(rank, default)
        _bind_arm(self, rank, arm)
        if arms and cls._fdsched_target == "ResourceManagerV1":
            logger = getattr(sys.modules.get(cls._fdsched_host_class.__module__), "llm_logger", None)
            if logger is not None:
                logger.info(f"[fdsched] data-parallel rank {rank} runs arm {arm.label}: {arm.line()}")
                size = _dp_size(args, kwargs, cls)
                beyond = sorted(r for r in arms if size is not None and r >= size)
                if beyond:
                    logger.warning(
                        f"[fdsched] FDSCHED_PROFILE_BY_DP_RANK names rank(s) {beyond} but the deployment has "
                        f"{size} data-parallel rank(s): those arms get no traffic"
                    )


def _dp_size(args, kwargs, cls):
    signature = getattr(cls, "_fdsched_init_signature", None)
    try:
        config = signature.bind(None, *args, **kwargs).arguments.get("config")
        return int(config.parallel_config.data_parallel_size)
    except Exception:  # noqa: BLE001 - only for a warning
        return None

"""What every mixin may use: small views of host requests, and how an arm's class is picked (what a scheduler's
pass hands its cache manager is :mod:`fdsched.patches._pass`).

The installer builds, for the scheduler, one *front* class and one class per arm (the cache manager and the cache
queue have one fixed class each instead: :mod:`fdsched.patches._prefix_cache`, :mod:`fdsched.patches._cache_queue`):

* the front class, ``type(name, (ArmChoice, HostClass), attrs)``, is what the host modules are rebound to
  (``isinstance(x, ResourceManagerV1)`` holds for every plugin object). It carries the single profile's
  ``_fdsched_impl`` / ``_fdsched_settings`` / ``_fdsched_default_arm``, ``_fdsched_arms`` (data-parallel
  rank -> :class:`fdsched.install.installer.Arm`, from ``FDSCHED_PROFILE_BY_DP_RANK``), ``_fdsched_arm_classes``
  (rank -> that arm's class) and ``_fdsched_default_class`` (every other rank);
* an arm's class, ``type(name, (InitGuard, <that arm's mixins, later catalogue entries first>, Front), attrs)``, holds
  only the mixins the arm applies (:meth:`fdsched.patches.PatchSpec.mixin_of`: a change whose impl there is
  the host's own code gets none, or a variant for that impl), and as class attributes that arm's
  ``_fdsched_impl`` (change id -> ``"host"`` / ``"plugin"`` / ``"off"``), ``_fdsched_settings`` and
  ``_fdsched_arm`` (its label). Its MRO is ``ArmClass -> InitGuard -> mixins ... -> PluginBase -> Front ->
  ArmChoice -> HostClass``. A class another plugin derives from the front class is built over the arm's class
  (``type(name, (TheirClass, ArmClass))``), so its overrides wrap the arm's mixins. Every class also has ``_fdsched_policies``, ``_fdsched_host`` (:class:`fdsched.install.probe.HostInfo`)
  and ``_fdsched_host_class``.

Constructing the front class builds an instance of the rank's arm class (:meth:`InitGuard.__new__`): the rank
comes from the constructor's arguments (``local_data_parallel_id``, else
``config.parallel_config.local_data_parallel_id``) and is kept as ``_fdsched_dp_rank``. The engine forks ranks
1..N-1 after rank 0's scheduler is built, so nothing per process could tell the ranks apart; the choice is
made once, per object, and no method asks again. The cache manager's fixed class reads the rank the same way in its
own ``__init__``; the cache queue gets no rank (the engine builds its server without one), and the cache manager that
stores a client hands it that manager's arm (:class:`QueueOwner`).
"""

from __future__ import annotations

import inspect
import sys

from fdsched.core.metrics import METRICS

__all__ = [
    "code_names",
    "PluginBase",
    "ArmChoice",
    "InitGuard",
    "QueueOwner",
    "InstanceAttribute",
    "RequestOutcomesMixin",
    "finished_ids",
    "host_global",
    "init_signature",
    "dp_rank_of",
    "SplitStatusViews",
    "SingleStatusViews",
    "status_views",
    "node_role",
    "drafts",
]


# Set in an object's __dict__ while the host's own __init__ runs on it (see ArmChoice).
HOST_INIT_RUNNING = "_fdsched_in_host_init"


def code_objects(func) -> list:
    """``func``'s code object and every code object nested in it (comprehensions, inner functions); [] without
    code."""
    found: list = []
    stack = [getattr(func, "__code__", None)]
    while stack:
        code = stack.pop()
        if code is None:
            continue
        found.append(code)
        stack.extend(c for c in code.co_consts if inspect.iscode(c))
    return found


def code_names(func) -> frozenset:
    """Global/attribute names and local variable names a function's code uses (nested code too)."""
    names: set = set()
    for code in code_objects(func):
        names.update(code.co_names)
        names.update(code.co_varnames)
    return frozenset(names)


def compares_locals(func, first: str, second: str) -> bool:
    """Whether ``func``'s code compares its locals ``first`` and ``second`` with each other (a ``COMPARE_OP`` whose
    two operands are loads of those names), read from its bytecode."""
    import dis

    code = getattr(func, "__code__", None)
    if code is None:
        return False
    loads: list = []
    for ins in dis.get_instructions(code):
        if ins.opname.startswith("LOAD_FAST"):
            loads.extend(ins.argval if isinstance(ins.argval, tuple) else (ins.argval,))  # 3.13 loads two at once
        elif ins.opname == "COMPARE_OP":
            if set(loads[-2:]) == {first, second}:
                return True
            loads.clear()
        elif ins.opname not in ("CACHE", "EXTENDED_ARG"):
            loads.clear()
    return False


def stores_constant(func, name: str, value) -> bool:
    """Whether ``func``'s code assigns the constant ``value`` to its local ``name`` (a ``LOAD_CONST`` straight into a
    ``STORE_FAST``), read from its bytecode."""
    import dis

    code = getattr(func, "__code__", None)
    if code is None:
        return False
    last = None
    for ins in dis.get_instructions(code):
        if ins.opname in ("CACHE", "EXTENDED_ARG"):
            continue
        if (ins.opname == "STORE_FAST" and ins.argval == name and last is not None and last.opname in (
                "LOAD_CONST", "LOAD_SMALL_INT") and last.argval == value and type(last.argval) is type(value)):
            return True
        last = ins
    return False


def node_role(scheduler):
    """The PD role a scheduler works in, read once when it is built: ``config.scheduler_config.splitwise_role``, as the
    host's own code reads it; None where its config has no scheduler config (a host test's stub config: any path of
    the host's that reads the role fails there too, so no choice made from it is ever used)."""
    return getattr(getattr(getattr(scheduler, "config", None), "scheduler_config", None), "splitwise_role", None)


def drafts(scheduler) -> bool:
    """Whether a draft model runs (speculative decoding), read once when the scheduler is built:
    ``config.speculative_config.method`` is set."""
    return getattr(getattr(getattr(scheduler, "config", None), "speculative_config", None), "method", None) is not None


def host_global(module_name: str, name: str):
    """A name from a loaded host module's globals (logger, envs, trace helpers)."""
    return getattr(sys.modules[module_name], name)


class PluginBase:
    """Base of every mixin. The attributes it reads (``_fdsched_impl``, ``_fdsched_settings``,
    ``_fdsched_policies``, ``_fdsched_host``, ``_fdsched_host_class``) are the arm class's (see above); the request
    views (``_fdsched_is_decoding``, ``_fdsched_statuses``, ...) come from the host's :func:`status_views` class."""


# ---- request views, one class per shape of the host's RequestStatus (chosen when the classes are built) -------
class _RequestViews:
    """What both shapes read the same way."""

    def _fdsched_is_running_prefill(self, request) -> bool:
        """Whether the host's running pass gives ``request`` a prefill chunk next: a running request (any running
        status) that has not computed all it must prefill. A PD decode node's prefilled request is one: it is added
        decoding, with one prefill token (the first token the prefill node sent) still to compute."""
        return request.status in self._fdsched_running_statuses and request.num_computed_tokens < request.need_prefill_tokens


class SplitStatusViews(_RequestViews):
    """Request views on a host whose running status is split (``RUNNING_PREFILL`` / ``RUNNING_DECODE``, PR 7783)."""

    def _fdsched_is_decoding(self, request) -> bool:
        """The one decode test (victim choice, ratio estimate, metrics), through the hook."""
        return self._fdsched_policies.is_decoding(
            request.request_id,
            request.status == self._fdsched_decode_status,
            request.num_total_tokens,
            request.need_prefill_tokens,
        )


class SingleStatusViews(_RequestViews):
    """Request views on a host with one ``RUNNING`` status: the status cannot tell a decoding request apart."""

    def _fdsched_is_decoding(self, request) -> bool:
        """The one decode test (victim choice, ratio estimate, metrics), through the hook."""
        return self._fdsched_policies.is_decoding(
            request.request_id, None, request.num_total_tokens, request.need_prefill_tokens
        )


def status_views(info) -> tuple:
    """(the request-views class for the probed host, its class attributes): chosen once, when the plugin's classes are
    built. ``_fdsched_statuses`` is the host's ``RequestStatus``; ``_fdsched_running_statuses`` every status a running
    request has; ``_fdsched_prefill_status`` the status of a running request that may still be prefilling."""
    statuses = getattr(info, "request_status", None)
    if getattr(info, "split_status", False):
        return SplitStatusViews, {
            "_fdsched_statuses": statuses,
            "_fdsched_running_statuses": (statuses.RUNNING_PREFILL, statuses.RUNNING_DECODE),
            "_fdsched_prefill_status": statuses.RUNNING_PREFILL,
            "_fdsched_decode_status": statuses.RUNNING_DECODE,
        }
    running = getattr(statuses, "RUNNING", None)
    return SingleStatusViews, {
        "_fdsched_statuses": statuses,
        "_fdsched_running_statuses": (running,),
        "_fdsched_prefill_status": running,
    }


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


class QueueOwner(InstanceAttribute):
    """Data descriptor on the cache manager's class for the attribute holding the cache queue client it builds
    (``cache_task_queue``): in an online A/B (the owner's class has arms) the queue class is built without a rank, so
    the manager hands the client it stores its own arm's decisions and settings (the client's
    ``fdsched_serve(impl, settings)``, where its class has one)."""

    def __set__(self, obj, value):
        obj.__dict__[self.name] = value
        if not getattr(obj, "_fdsched_arms", None):
            return  # a single profile: the client started with it
        serve = getattr(type(value), "fdsched_serve", None)
        impl = getattr(obj, "_fdsched_impl", None)
        if serve is not None and impl is not None:
            serve(value, impl, obj._fdsched_settings)


class RequestOutcomesMixin:
    """Per-arm request outcomes, recorded where a request finishes in the scheduler process; and no request
    finished twice.

    ``finish_requests`` runs the host's own and then, for every request that the host's call removed from
    ``self.requests``, records requests finished, output tokens, TTFT (``engine_recv_first_token_time -
    arrival_time``, what the host's own TTFT histogram uses) and TPOT (``(engine_recv_latest_token_time -
    engine_recv_first_token_time) / (output tokens - 1)``) from the request's own timestamps, labelled by this
    scheduler's arm (:func:`fdsched.core.metrics.labels_of`). Relies on: ``finish_requests(request_ids)`` is where
    the host removes a finished request from ``self.requests`` (also when called through ``finish_requests_async``).

    Finished twice (every arm, ``baseline`` included): the host runs a finish later on a thread pool, so a request
    whose last token is out can still be preempted, and the output reader puts it back into ``waiting`` (its slot is
    absent from the next batch) before the finish runs. The host's ``finish_requests`` then logs "scheduled into
    waiting list, after finished" and leaves it there, to be prefilled and finished a second time. Here such a
    request -- in ``waiting``, still ``PREEMPTED`` (not scheduled again) -- is taken out of ``waiting`` first and
    finished as the host finishes a preempted request: its blocks went back at the preemption and its slot was
    cleared then (the slot may hold another request by now, so it is left alone).
    """

    def finish_requests(self, request_ids):
        request_ids, ids = finished_ids(request_ids)
        requests = getattr(self, "requests", None)
        before = [(rid, requests.get(rid)) for rid in ids] if isinstance(requests, dict) else []
        ended = self._fdsched_end_preempted_in_waiting(before) if before else set()
        if ended:  # the host would log each as an invalid id
            request_ids = [rid for rid in ids if rid not in ended]
        result = super().finish_requests(request_ids)
        for rid, request in before:  # the host's and the ones ended above alike: gone from self.requests
            if request is not None and rid not in self.requests:
                METRICS.request_finished(request, of=self)
        return result

    def _fdsched_end_preempted_in_waiting(self, found) -> set:
        """End (as above) each of ``found`` (request id, request) that is back in ``waiting`` after a preemption;
        the ids ended."""
        ended = set()
        status = self._fdsched_statuses  # the host's RequestStatus (fdsched.patches._base.status_views)
        preempted, finished = getattr(status, "PREEMPTED", None), getattr(status, "FINISHED", None)
        lock, waiting = getattr(self, "lock", None), getattr(self, "waiting", None)
        if preempted is None or finished is None or lock is None or waiting is None:
            return ended
        with lock:
            for rid, request in found:
                if request is None or request.status != preempted or self.requests.get(rid) is not request:
                    continue
                try:
                    waiting.remove(request)
                except ValueError:  # not put back yet: the host's own branch for a preempted request ends it
                    continue
                request.status = finished
                del self.requests[rid]
                getattr(self, "req_dict", {}).pop(rid, None)
                for name in ("to_be_rescheduled_request_id_set", "waiting_abort_req_id_set",
                             "to_be_aborted_req_id_set"):
                    getattr(self, name, set()).discard(rid)
                ended.add(rid)
        if ended:
            logger = getattr(sys.modules.get(self._fdsched_host_class.__module__), "llm_logger", None)
            if logger is not None:
                logger.info(f"[fdsched] finished while their preemption was in flight, ended instead of run "
                            f"again: {sorted(ended)}")
        return ended


class ArmChoice:
    """Base of every front class (the class the host modules are rebound to): constructing it builds an object
    of the rank's arm class, and the host's explicit ``super(HostName, self)`` keeps working.

    ``ResourceManagerV1.__init__`` calls ``super(ResourceManagerV1, self).__init__``. Once ``ResourceManagerV1``
    names the front class (or a class another plugin stacked on it), that call re-enters the plugin's chain: this
    class's ``__init__`` (right after the front class) or :class:`InitGuard` (where a stacked class sits above
    ours). One mark says the host's ``__init__`` is running (:data:`HOST_INIT_RUNNING`, set here around it): a
    re-entry that finds it continues past the host class.
    """

    def __new__(cls, *args, **kwargs):
        chosen, rank = cls._fdsched_class_for(args, kwargs)
        obj = object.__new__(chosen)
        if rank is not None:
            obj.__dict__["_fdsched_dp_rank"] = rank
        return obj

    def __init__(self, *args, **kwargs):
        if self.__dict__.get(HOST_INIT_RUNNING):  # the host's own super(HostName, self).__init__: past the host class
            super(self._fdsched_host_class, self).__init__(*args, **kwargs)
            return
        self.__dict__[HOST_INIT_RUNNING] = True
        try:
            super().__init__(*args, **kwargs)  # the host's __init__
        finally:
            del self.__dict__[HOST_INIT_RUNNING]

    @classmethod
    def _fdsched_class_for(cls, args, kwargs) -> tuple:
        """(the class to instantiate, the data-parallel rank or None) for a constructor call of ``cls``."""
        if InitGuard in cls.__mro__:
            return cls, None  # an arm's class itself (e.g. a copy): it stays what it is
        front = cls._fdsched_front
        rank = dp_rank_of(front._fdsched_init_signature, args, kwargs)
        chosen = front._fdsched_arm_classes.get(rank, front._fdsched_default_class)
        arms = front._fdsched_arms
        if arms and cls._fdsched_target == "ResourceManagerV1":
            logger = getattr(sys.modules.get(cls._fdsched_host_class.__module__), "llm_logger", None)
            if logger is not None:
                arm = arms.get(rank, front._fdsched_default_arm)
                logger.info(f"[fdsched] data-parallel rank {rank} runs arm {arm.label}: {arm.line()}")
                size = _dp_size(args, kwargs, front)
                beyond = sorted(r for r in arms if size is not None and r >= size)
                if beyond:
                    logger.warning(
                        f"[fdsched] FDSCHED_PROFILE_BY_DP_RANK names rank(s) {beyond} but the deployment has "
                        f"{size} data-parallel rank(s): those arms get no traffic"
                    )
        return _on_top(cls, chosen), rank


def _on_top(cls, arm_class):
    """``arm_class``, or for a class another plugin derived from the front class, that class over the arm's:
    ``type(name, (cls, arm_class))`` (made once per pair), so its overrides wrap the arm's mixins."""
    if cls is cls._fdsched_front:
        return arm_class
    combined = cls.__dict__.get("_fdsched_on_arms")
    if combined is None:
        combined = {}
        type.__setattr__(cls, "_fdsched_on_arms", combined)
    if arm_class not in combined:
        combined[arm_class] = type(cls.__name__, (cls, arm_class), {
            "__module__": __name__,
            "__qualname__": f"_on_top.<locals>.{cls.__qualname__}[{arm_class._fdsched_arm}]",
            "__doc__": f"{cls.__module__}.{cls.__qualname__} over fdsched's class for arm {arm_class._fdsched_arm}.",
        })
    return combined[arm_class]


class InitGuard:
    """First base of every arm class: where a class another plugin stacked on the front class sits above ours, the
    host's ``super(HostName, self).__init__`` re-enters here while the host's ``__init__`` runs (see
    :class:`ArmChoice`), and continues past the host class."""

    def __init__(self, *args, **kwargs):
        if self.__dict__.get(HOST_INIT_RUNNING):
            super(self._fdsched_host_class, self).__init__(*args, **kwargs)
            return
        super().__init__(*args, **kwargs)
        if self._fdsched_counts_admissions:
            # Refusals are counted only where the plugin's reservation code decides: declare the series there (at
            # 0), so a scrape tells "none refused" from "not counted" (the host's own code runs).
            METRICS.admission_counting(of=self)


def _dp_size(args, kwargs, cls):
    signature = getattr(cls, "_fdsched_init_signature", None)
    try:
        config = signature.bind(None, *args, **kwargs).arguments.get("config")
        return int(config.parallel_config.data_parallel_size)
    except Exception:  # noqa: BLE001 - only for a warning
        return None

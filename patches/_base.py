"""What every change's strategies may use: the node's role, the host's request views, the rank a constructor call is
for, and small readers of the host's code. The fixed classes are :mod:`fdsched.patches._scheduler`,
:mod:`fdsched.patches._prefix_cache` and :mod:`fdsched.patches._cache_queue`; each reads its instance's data-parallel
rank from the constructor's arguments (:func:`dp_rank_of`) and builds that rank's strategies when it is built (the
engine forks ranks 1..N-1 after rank 0's scheduler is built, so nothing per process could tell the ranks apart).
"""

from __future__ import annotations

import inspect
import sys

__all__ = [
    "code_names",
    "QueueOwner",
    "InstanceAttribute",
    "finished_ids",
    "host_global",
    "init_signature",
    "dp_rank_of",
    "take_arm",
    "SplitStatusViews",
    "SingleStatusViews",
    "status_views",
    "node_role",
    "drafts",
]


# Set in an object's __dict__ while the host's own __init__ runs on it: the host's explicit super(HostName, self)
# .__init__ re-enters the fixed class's __init__, which then continues past the host class.
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


# ---- request views, one class per shape of the host's RequestStatus (chosen when the plugin is installed) ------
class _RequestViews:
    """What both shapes read the same way (one object per install, shared by every scheduler)."""

    def __init__(self, statuses, policies, running: tuple, prefill) -> None:
        self.statuses, self.policies = statuses, policies
        self.running_statuses = running  # every status a running request has
        self.prefill_status = prefill  # the status of a running request that may still be prefilling

    def is_running_prefill(self, request) -> bool:
        """Whether the host's running pass gives ``request`` a prefill chunk next: a running request (any running
        status) that has not computed all it must prefill. A PD decode node's prefilled request is one: it is added
        decoding, with one prefill token (the first token the prefill node sent) still to compute."""
        return request.status in self.running_statuses and request.num_computed_tokens < request.need_prefill_tokens


class SplitStatusViews(_RequestViews):
    """Request views on a host whose running status is split (``RUNNING_PREFILL`` / ``RUNNING_DECODE``, PR 7783)."""

    def __init__(self, statuses, policies) -> None:
        super().__init__(statuses, policies, (statuses.RUNNING_PREFILL, statuses.RUNNING_DECODE),
                         statuses.RUNNING_PREFILL)
        self.decode_status = statuses.RUNNING_DECODE

    def is_decoding(self, request) -> bool:
        """The one decode test (victim choice, ratio estimate, metrics), through the hook."""
        return self.policies.is_decoding(
            request.request_id,
            request.status == self.decode_status,
            request.num_total_tokens,
            request.need_prefill_tokens,
        )


class SingleStatusViews(_RequestViews):
    """Request views on a host with one ``RUNNING`` status: the status cannot tell a decoding request apart."""

    def __init__(self, statuses, policies) -> None:
        running = getattr(statuses, "RUNNING", None)
        super().__init__(statuses, policies, (running,), running)

    def is_decoding(self, request) -> bool:
        """The one decode test (victim choice, ratio estimate, metrics), through the hook."""
        return self.policies.is_decoding(request.request_id, None, request.num_total_tokens, request.need_prefill_tokens)


def status_views(info, policies) -> dict:
    """The scheduler's class attributes for the probed host's ``RequestStatus`` shape, chosen once, when the plugin is
    installed: ``_fdsched_statuses`` (the host's ``RequestStatus``), ``_fdsched_running_statuses``,
    ``_fdsched_prefill_status``, and the views ``_fdsched_is_decoding(request)`` and
    ``_fdsched_is_running_prefill(request)`` (bound methods of one views object)."""
    statuses = getattr(info, "request_status", None)
    views = (SplitStatusViews if getattr(info, "split_status", False) else SingleStatusViews)(statuses, policies)
    return {
        "_fdsched_statuses": statuses,
        "_fdsched_running_statuses": views.running_statuses,
        "_fdsched_prefill_status": views.prefill_status,
        "_fdsched_is_decoding": views.is_decoding,
        "_fdsched_is_running_prefill": views.is_running_prefill,
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


def take_arm(obj, args, kwargs) -> tuple:
    """(data-parallel rank, Arm, that arm's row of strategies) for a fixed class's constructor call on ``obj``, whose
    class holds the install's table (``_fdsched_rows``: rank, or None for every rank not listed -> (Arm, row)); the
    rank and the arm's label, decisions and settings are set on ``obj`` (the metrics label it by them)."""
    rank = dp_rank_of(obj._fdsched_init_signature, args, kwargs)
    arm, row = obj._fdsched_rows.get(rank) or obj._fdsched_rows[None]
    obj._fdsched_dp_rank = rank
    obj._fdsched_arm, obj._fdsched_impl, obj._fdsched_settings = arm.label, arm.impl, arm.settings
    return rank, arm, row


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


def _dp_size(args, kwargs, cls):
    signature = getattr(cls, "_fdsched_init_signature", None)
    try:
        config = signature.bind(None, *args, **kwargs).arguments.get("config")
        return int(config.parallel_config.data_parallel_size)
    except Exception:  # noqa: BLE001 - only for a warning
        return None

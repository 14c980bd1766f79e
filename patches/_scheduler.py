"""The plugin's ``ResourceManagerV1``: one class over the host's, whose seams hand each call to the strategies the
instance chose when it was built, and whose ``schedule()`` runs one pass with its plan open.

:class:`Scheduler` is the class as it runs; :func:`over` puts it over the probed host class with one class statement,
with the install's table as class attributes: per data-parallel rank, the arm and one strategy class (or None: the
host's own code) per change, read from each change's ``SPEC.strategies`` when the plugin was installed. ``__init__``
reads the instance's rank from the constructor's arguments, lets the host build the object, then builds that arm's
strategies once, innermost first, each over the layer below it (``next``), which ends in the host's own methods
(:class:`fdsched.patches._host_code.HostCode`). Later catalogue entries wrap earlier ones, so where two changes serve
one seam the catalogue's order decides who sees whose calls (``tests/unit/test_catalogue.py`` pins it, and why).

A strategy that lets every call through on this scheduler (``passes_all``: e.g. the PD change on a node that is not a
prefill node) is left out, steps and all. A strategy serves the seams it names in ``seams`` (each method takes the scheduler first, then the host method's own
parameters) and may take part in the pass's steps by defining them:

1. ``pass_end(scheduler, plan, result)`` after every pass, also one that raised (``result`` None then);
2. ``pass_result(scheduler, result)`` after a pass that returned;
3. ``after_passes(scheduler, result, run_pass) -> result`` once the passes are done (it may run one more with
   ``run_pass()``, steps 1 and 2 included);

each kind innermost first, then the guard (:class:`fdsched.patches._guard.SchedulerGuard`) reads the final result.

The changes not yet written as strategies are mixins on a class per arm built over this one
(:mod:`fdsched.patches._base`); their steps are named in class attributes (``fdsched_pass_end = "<method>"``, ...)
and run after the strategies' of the same kind (the mixins wrap every strategy).
"""

from __future__ import annotations

from functools import partial

import sys

from fdsched.patches._base import HOST_INIT_RUNNING, _dp_size, _on_top, dp_rank_of, init_signature
from fdsched.patches._guard import SchedulerGuard, nothing_scheduled
from fdsched.patches._host_code import HostCode, hide_absent
from fdsched.patches._plan import PlanSlot, StepPlan

__all__ = ["Scheduler", "over", "SEAMS", "STEP_KINDS", "declared_steps"]

# The host methods a strategy may serve.
SEAMS = ("get_new_block_nums", "_get_can_schedule_prefill_threshold_block", "_get_running_request_reserve_blocks",
         "_reset_reserve_on_preemption", "_select_preempt_candidate", "_trigger_preempt", "preallocate_resource_in_p",
         "_free_blocks", "finish_requests")

# (a mixin's class attribute naming its step, the strategy method of the same kind), in the order the kinds run
STEP_KINDS = (("fdsched_pass_end", "pass_end"), ("fdsched_pass_result", "pass_result"),
              ("fdsched_after_passes", "after_passes"))


def declared_steps(cls, kind: str) -> tuple:
    """The method names ``cls``'s classes declare for ``kind`` (a mixin's class attribute), innermost first, once
    each."""
    names: list = []
    for klass in reversed(cls.__mro__):
        name = klass.__dict__.get(kind)
        if name and name not in names:
            names.append(name)
    return tuple(names)


class Scheduler(SchedulerGuard):
    """Seams and the one ``schedule()`` of the plugin's ``ResourceManagerV1`` (class attributes from :func:`over`)."""

    _fdsched_host_class: type  # the probed host class, the next class in the MRO
    _fdsched_rows: dict  # data-parallel rank (None: every rank not listed) -> (Arm, {change id: strategy or None})
    _fdsched_order: tuple  # change ids, innermost first: the order strategies are built and steps run in

    def __new__(cls, *args, **kwargs):
        chosen, rank = cls._fdsched_class_for(args, kwargs)
        obj = object.__new__(chosen)
        if rank is not None:
            obj.__dict__["_fdsched_dp_rank"] = rank
        return obj

    def __init__(self, *args, **kwargs):
        if self.__dict__.get(HOST_INIT_RUNNING):  # the host's own super(HostName, self).__init__: past the host
            super(self._fdsched_host_class, self).__init__(*args, **kwargs)
            return
        rank = dp_rank_of(self._fdsched_init_signature, args, kwargs)
        arm, row = self._fdsched_rows.get(rank) or self._fdsched_rows[None]
        # One pass at a time, plan open to the pass's last step (the slot's turn); made before the host's constructor
        # runs, so that a change can hand it to the cache manager the host builds.
        self._fdsched_plans = PlanSlot()
        host = HostCode(self._fdsched_host_class, SEAMS)
        self._fdsched_bind_seams(host)  # the host's own code while the host builds the object
        self.__dict__[HOST_INIT_RUNNING] = True
        try:
            super().__init__(*args, **kwargs)  # the host's
        finally:
            del self.__dict__[HOST_INIT_RUNNING]
        self._fdsched_start_guard()
        self._fdsched_strategies = built = {}
        below = host
        for change_id in self._fdsched_order:
            strategy = row.get(change_id)
            if strategy is None:
                continue
            layer = strategy(self, arm.settings, below)
            if getattr(layer, "passes_all", False):
                continue  # it lets every call through on this scheduler (e.g. not a prefill node): left out
            built[change_id] = layer
            below = _Layers(layer, below)
        self._fdsched_bind_seams(below)
        self._fdsched_steps = {
            method: tuple(partial(getattr(s, method), self) for s in built.values() if hasattr(s, method))
            + tuple(getattr(self, name) for name in declared_steps(type(self), attribute))
            for attribute, method in STEP_KINDS
        }
        # the pass's admission budget maker, where a strategy has one (the plugin's reservation), else None
        self._fdsched_plan_budget = next((s.new_budget for s in built.values() if hasattr(s, "new_budget")), None)

    def _fdsched_bind_seams(self, layers) -> None:
        """Each seam's first layer, bound once: a call costs the seam's frame and that layer's."""
        for name in SEAMS:
            self.__dict__[f"_fdsched_seam_{name.lstrip('_')}"] = getattr(layers, name)

    # ---- the one schedule() ----------------------------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        result = self._fdsched_pass(args, kwargs)
        for step in self._fdsched_steps["after_passes"]:
            result = step(result, lambda: self._fdsched_pass(args, kwargs))
        self._fdsched_guard(nothing_scheduled(result))
        return result

    def _fdsched_pass(self, args, kwargs):
        """One pass of the host's ``schedule()`` with its plan open, then the pass's ends and results."""
        plan = StepPlan(self._fdsched_plan_budget)
        slot = self._fdsched_plans
        with slot.turn:
            outer = slot.open(plan)
            result = None
            try:
                result = super().schedule(*args, **kwargs)
            finally:
                slot.close(outer)
                for step in self._fdsched_steps["pass_end"]:
                    step(plan, result)
            for step in self._fdsched_steps["pass_result"]:
                step(result)
        return result

    def fdsched_strategy(self, change_id: str):
        """This scheduler's strategy for ``change_id``, or None (the host's own code runs it here)."""
        return self._fdsched_strategies.get(change_id)

    # ---- seams -----------------------------------------------------------------------------------------------
    def get_new_block_nums(self, *args, **kwargs):
        return self._fdsched_seam_get_new_block_nums(self, *args, **kwargs)

    def _get_can_schedule_prefill_threshold_block(self, *args, **kwargs):
        return self._fdsched_seam_get_can_schedule_prefill_threshold_block(self, *args, **kwargs)

    def _get_running_request_reserve_blocks(self, *args, **kwargs):
        return self._fdsched_seam_get_running_request_reserve_blocks(self, *args, **kwargs)

    def _reset_reserve_on_preemption(self, *args, **kwargs):
        return self._fdsched_seam_reset_reserve_on_preemption(self, *args, **kwargs)

    def _select_preempt_candidate(self, *args, **kwargs):
        return self._fdsched_seam_select_preempt_candidate(self, *args, **kwargs)

    def _trigger_preempt(self, *args, **kwargs):
        return self._fdsched_seam_trigger_preempt(self, *args, **kwargs)

    def preallocate_resource_in_p(self, *args, **kwargs):
        return self._fdsched_seam_preallocate_resource_in_p(self, *args, **kwargs)

    def _free_blocks(self, *args, **kwargs):
        return self._fdsched_seam_free_blocks(self, *args, **kwargs)

    def finish_requests(self, *args, **kwargs):
        return self._fdsched_seam_finish_requests(self, *args, **kwargs)

    # ---- the arm of a constructor call (while some changes are still mixins on a class per arm) --------------
    @classmethod
    def _fdsched_class_for(cls, args, kwargs) -> tuple:
        """(the class to instantiate, the data-parallel rank or None) for a constructor call of ``cls``."""
        from fdsched.patches._base import InitGuard

        if InitGuard in cls.__mro__:
            return cls, None  # an arm's class itself (e.g. a copy): it stays what it is
        front = cls._fdsched_front
        rank = dp_rank_of(front._fdsched_init_signature, args, kwargs)
        chosen = front._fdsched_arm_classes.get(rank, front._fdsched_default_class)
        arms = front._fdsched_arms
        if arms:
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


class _Layers:
    """One layer over the ones below it: per seam, the layer's own method where it serves that seam, else the
    method below."""

    def __init__(self, layer, below) -> None:
        served = getattr(layer, "seams", ())
        for name in SEAMS:
            setattr(self, name, getattr(layer, name) if name in served else getattr(below, name))


def over(host_cls: type, rows: dict, order: tuple, attributes: dict) -> type:
    """The plugin's class over ``host_cls`` (what the host module's ``ResourceManagerV1`` is rebound to);
    ``attributes``: the install's other class attributes (arms, policies, the host's request statuses)."""

    class ResourceManagerV1(Scheduler, host_cls):
        __doc__ = f"fdsched's ResourceManagerV1 over {host_cls.__module__}.{host_cls.__qualname__}: see Scheduler."
        __qualname__ = "ResourceManagerV1"
        _fdsched_host_class = host_cls
        _fdsched_rows = rows
        _fdsched_order = order
        _fdsched_init_signature = init_signature(host_cls)

    for name, value in attributes.items():
        setattr(ResourceManagerV1, name, value)
    hide_absent(ResourceManagerV1, host_cls, SEAMS)  # a seam this host lacks stays missing
    return ResourceManagerV1


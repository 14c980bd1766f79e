"""The one ``schedule()`` wrapper: every arm class of ``ResourceManagerV1`` has it outermost, whatever the arm applies.

One call of ``schedule()`` runs one pass of the host's own ``schedule()`` with a :class:`fdsched.patches._plan.StepPlan`
open (the pass's admission budget and what it expects of the cache manager's checks), then each change's steps in a
fixed order, then the guard:

1. **pass ends** (``fdsched_pass_end = "<method>"``, called as ``method(plan, result)`` after every pass, also one
   that raised, ``result`` None then), innermost change first: decode-only preemption ends its no-victim episode,
   the reservation closes its budget under the host's lock;
2. **pass results** (``fdsched_pass_result``, ``method(result)`` after a pass that returned): the prefill node's
   pre-change recording of the pass's chunks;
3. **after the passes** (``fdsched_after_passes``, ``method(result, run_pass) -> result``): the seat fix, which may
   run one more pass (``run_pass()``, steps 1 and 2 included) and returns the merged result;
4. the guard (:class:`fdsched.patches._guard.SchedulerGuard`) reads the final result.

A change declares a step by naming one of its methods in a class attribute; the names are collected once, when the
arm's class is made (``__init_subclass__``), from every class of its MRO. ``tests/unit/test_catalogue.py`` pins the
order of the steps and why.
"""

from __future__ import annotations

from fdsched.patches._guard import SchedulerGuard, nothing_scheduled
from fdsched.patches._plan import PlanSlot, StepPlan

__all__ = ["StepPlanMixin", "STEP_KINDS", "declared_steps"]

# the class attribute a change names its step by -> where the arm's class keeps the names collected, in the order the
# kinds run
STEP_KINDS = {
    "fdsched_pass_end": "_fdsched_pass_ends",
    "fdsched_pass_result": "_fdsched_pass_results",
    "fdsched_after_passes": "_fdsched_after_passes",
}


def declared_steps(cls, kind: str) -> tuple:
    """The method names ``cls``'s classes declare for ``kind``, innermost class first, each once."""
    names: list = []
    for klass in reversed(cls.__mro__):
        name = klass.__dict__.get(kind)
        if name and name not in names:
            names.append(name)
    return tuple(names)


class StepPlanMixin(SchedulerGuard):
    """Outermost on every arm class of the scheduler (see the module docstring)."""

    _fdsched_pass_ends: tuple = ()
    _fdsched_pass_results: tuple = ()
    _fdsched_after_passes: tuple = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for kind, collected in STEP_KINDS.items():
            setattr(cls, collected, declared_steps(cls, kind))

    def __init__(self, *args, **kwargs):
        # Made before the host's constructor runs: a change that hands it to the cache manager does so in its own
        # __init__, right after the host has built that cache manager.
        # One pass at a time, plan open to the pass's last step (the slot's turn): the host's passes already take
        # turns on its lock, so this only makes the plan's life take turns too.
        self._fdsched_plans = PlanSlot()
        super().__init__(*args, **kwargs)
        # the reservation's budget maker where the arm has the plugin's reservation, else None: fixed for life
        self._fdsched_plan_budget = getattr(self, "_fdsched_new_budget", None)

    def schedule(self, *args, **kwargs):
        result = self._fdsched_pass(args, kwargs)
        for name in self._fdsched_after_passes:
            result = getattr(self, name)(result, lambda: self._fdsched_pass(args, kwargs))
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
                for name in self._fdsched_pass_ends:
                    getattr(self, name)(plan, result)
            for name in self._fdsched_pass_results:
                getattr(self, name)(result)
        return result

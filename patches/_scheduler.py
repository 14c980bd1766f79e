"""The plugin's ``ResourceManagerV1``: one class over the host's, whose seams hand each call to the strategies the
instance chose when it was built, and whose ``schedule()`` runs one pass with its plan open.

:class:`Scheduler` is the class as it runs; :func:`over` puts it over the probed host class with one class statement,
with the install's table as class attributes: per data-parallel rank, the arm and one strategy class (or None: the
host's own code) per change, read from each change's ``SPEC.strategies`` when the plugin was installed. ``__init__``
reads the instance's rank from the constructor's arguments, lets the host build the object, then builds that arm's
strategies once, innermost first, each over the layer below it (``next``), which ends in the host's own methods
(:class:`fdsched.patches._host_code.HostCode`); the request outcomes (:mod:`fdsched.patches._outcomes`) are the
outermost layer of ``finish_requests`` on every arm. Later catalogue entries wrap earlier ones, so where two changes
serve one seam the catalogue's order decides who sees whose calls (``tests/unit/test_catalogue.py`` pins it, and why).

A strategy serves the seams it names in ``seams`` (each method takes the scheduler first, then the host method's own
parameters); one that lets every call through on this scheduler (``passes_all``: e.g. the PD change on a node that is
not a prefill node) is left out. A strategy may take part in the pass's steps by defining them:

1. ``pass_end(scheduler, plan, result)`` after every pass, also one that raised (``result`` None then);
2. ``pass_result(scheduler, result)`` after a pass that returned;
3. ``after_passes(scheduler, result, run_pass) -> result`` once the passes are done (it may run one more with
   ``run_pass()``, steps 1 and 2 included);

each kind innermost first, then the guard (:class:`fdsched.patches._guard.SchedulerGuard`) reads the final result.
One that defines ``new_budget()`` makes the pass's admission budget.

**The step plan.** Each pass opens one :class:`StepPlan` that every change reads and writes: the pass's admission
budget (made at its first need; an admission asks it once and gets its verdict, the pool's answer included), the
request the pass is deciding on (:meth:`StepPlan.focus`, from the host's ``get_new_block_nums(request, ...)``) and,
where the plugin refuses a running chunk that the host has no seam to refuse (the running-chunk guard on a host
without the reserve seams, and ``off``'s pre-change running pass), that refusal (:meth:`StepPlan.expect`: a kind and
a block count). The host's block check (``PrefixCacheManager.can_allocate_gpu_blocks``) is called with a count only;
there it asks the plan "do you refuse this check of n blocks?" (:meth:`StepPlan.take`, consumed). The scheduler
makes one :class:`PlanSlot` when it is built and a strategy hands it to the cache manager then; the slot holds the
open plan and the thread that opened it, so a check on another thread (the token processor, the transfer receiver)
gets the pool's own answer. What a pass still expects when it ends is dropped, logged and counted
(``fastdeploy:fdsched_unconsumed_signals_total``).

Each seam's first layer is bound once per scheduler: on the instance itself where no class below it overrides the
seam (the host's own calls then cost what they cost without the plugin, plus the strategies' own frames), else
through the class's seam method (a class another plugin derives from this one wraps every layer).
"""

from __future__ import annotations

import sys
import threading
from functools import partial
from threading import get_ident
from typing import NamedTuple

from fdsched.core.metrics import METRICS
from fdsched.patches._base import HOST_INIT_RUNNING, _dp_size, init_signature, take_arm
from fdsched.patches._guard import SchedulerGuard
from fdsched.patches._host_code import HostCode, hide_absent

__all__ = ["Scheduler", "over", "SEAMS", "STEPS", "StepPlan", "PlanSlot", "NO_PLANS", "NOTHING", "defined_by"]

# The host methods a strategy may serve.
SEAMS = ("get_new_block_nums", "_get_can_schedule_prefill_threshold_block", "_get_running_request_reserve_blocks",
         "_reset_reserve_on_preemption", "_select_preempt_candidate", "_trigger_preempt", "preallocate_resource_in_p",
         "_free_blocks", "finish_requests")
_SEAM_ATTRIBUTE = {name: f"_fdsched_seam_{name.lstrip('_')}" for name in SEAMS}  # where each seam's first layer is

STEPS = ("pass_end", "pass_result", "after_passes")  # the kinds of step, in the order they run
_STEP_ATTRIBUTE = {"pass_end": "_fdsched_pass_ends", "pass_result": "_fdsched_pass_results",
                   "after_passes": "_fdsched_after_passes"}  # where a scheduler keeps each kind's steps


class Scheduler(SchedulerGuard):
    """Seams and the one ``schedule()`` of the plugin's ``ResourceManagerV1`` (class attributes from :func:`over`)."""

    _fdsched_host_class: type  # the probed host class, the next class in the MRO
    _fdsched_rows: dict  # data-parallel rank (None: every rank not listed) -> (Arm, {change id: strategy or None})
    _fdsched_order: tuple  # change ids, innermost first: the order strategies are built and steps run in
    _fdsched_outermost: tuple  # layers over every change's on each arm (the request outcomes, where the host fits)
    _fdsched_arms: dict  # data-parallel rank -> Arm (FDSCHED_PROFILE_BY_DP_RANK); empty for a single profile
    _fdsched_init_signature: object  # the host's __init__ signature (where the rank is read)

    def __init__(self, *args, **kwargs):
        if self.__dict__.get(HOST_INIT_RUNNING):  # the host's own super(HostName, self).__init__: past the host
            super(self._fdsched_host_class, self).__init__(*args, **kwargs)
            return
        rank, arm, row = take_arm(self, args, kwargs)
        if self._fdsched_arms:
            self._fdsched_log_arm(rank, arm, args, kwargs)
        # One pass at a time, plan open to the pass's last step (the slot's turn); made before the host's constructor
        # runs, so that a strategy can hand it to the cache manager the host builds.
        self._fdsched_plans = PlanSlot()
        host = HostCode(self._fdsched_host_class, SEAMS)
        self._fdsched_bind_seams(host, host)  # the host's own code while the host builds the object
        self.__dict__[HOST_INIT_RUNNING] = True
        try:
            super().__init__(*args, **kwargs)  # the host's
        finally:
            del self.__dict__[HOST_INIT_RUNNING]
        self._fdsched_start_guard()
        self._fdsched_next_schedule = super().schedule  # the next class's schedule() (the host's), bound once
        self._fdsched_strategies = built = {}
        below = host
        for change_id, strategy in [(c, row.get(c)) for c in self._fdsched_order] + [
                (None, extra) for extra in self._fdsched_outermost]:
            if strategy is None:
                continue
            layer = strategy(self, arm.settings, below)
            if getattr(layer, "passes_all", False):
                continue  # it lets every call through on this scheduler (e.g. not a prefill node): left out
            built[change_id or type(layer).__name__] = layer
            below = _Layers(layer, below)
        self._fdsched_bind_seams(below, host)
        # per kind of step, the strategies' own, innermost first (most kinds are empty on most arms: a pass then
        # loops over nothing)
        for kind in STEPS:
            own = tuple(partial(getattr(s, kind), self) for s in built.values() if hasattr(s, kind))
            setattr(self, _STEP_ATTRIBUTE[kind], own)
        # the pass's admission budget maker, where a strategy has one (the plugin's reservation), else None
        self._fdsched_plan_budget = next((s.new_budget for s in built.values() if hasattr(s, "new_budget")), None)
        if any(getattr(s, "counts_admissions", False) for s in built.values()):
            # Refusals are counted only where the plugin's reservation code decides: declare the series there (at 0),
            # so a scrape tells "none refused" from "not counted" (the host's own code runs).
            METRICS.admission_counting(of=self)

    def _fdsched_bind_seams(self, layers, host) -> None:
        """Each seam's first layer, bound once (see the module docstring)."""
        own = self.__dict__
        for name in SEAMS:
            first = getattr(layers, name)
            own[_SEAM_ATTRIBUTE[name]] = first
            if defined_by(type(self), name) is not Scheduler:
                continue  # a class over this one overrides it (or marks it absent: the host lacks it): that runs
            own[name] = first.__get__(self) if first is getattr(host, name) else partial(first, self)

    def fdsched_strategy(self, change_id: str):
        """This scheduler's strategy for ``change_id``, or None (the host's own code runs it here)."""
        return self._fdsched_strategies.get(change_id)

    # ---- the one schedule() ----------------------------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        result = self._fdsched_pass(args, kwargs)
        for step in self._fdsched_after_passes:
            result = step(result, partial(self._fdsched_pass, args, kwargs))
        self._fdsched_guard(result)
        return result

    def _fdsched_pass(self, args, kwargs):
        """One pass of the host's ``schedule()`` with its plan open, then the pass's ends and results. (It runs on
        every pass, cold between the host's long loops: each call and lookup here is one every pass pays.)"""
        slot = self._fdsched_plans
        with slot.turn:
            plan = StepPlan(self._fdsched_plan_budget)
            outer = slot.open(plan)
            result = None
            try:
                result = self._fdsched_next_schedule(*args, **kwargs)
            finally:
                slot.close(outer)
                for step in self._fdsched_pass_ends:
                    step(plan, result)
            for step in self._fdsched_pass_results:
                step(result)
        return result

    # ---- seams (for a class over this one; an instance of this class has them bound on itself) ---------------
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

    # ---- an online A/B: which arm this rank runs, in the scheduler's own log --------------------------------
    def _fdsched_log_arm(self, rank: int, arm, args, kwargs) -> None:
        logger = getattr(sys.modules.get(self._fdsched_host_class.__module__), "llm_logger", None)
        if logger is None:
            return
        logger.info(f"[fdsched] data-parallel rank {rank} runs arm {arm.label}: {arm.line()}")
        size = _dp_size(args, kwargs, type(self))
        beyond = sorted(r for r in self._fdsched_arms if size is not None and r >= size)
        if beyond:
            logger.warning(f"[fdsched] FDSCHED_PROFILE_BY_DP_RANK names rank(s) {beyond} but the deployment has {size} "
                           "data-parallel rank(s): those arms get no traffic")


def defined_by(cls, name: str):
    """The class along ``cls``'s MRO whose own ``name`` an instance finds."""
    return next((klass for klass in cls.__mro__ if name in vars(klass)), None)


class _Layers:
    """One layer over the ones below it: per seam, the layer's own method where it serves that seam, else the
    method below."""

    def __init__(self, layer, below) -> None:
        served = getattr(layer, "seams", ())
        for name in SEAMS:
            setattr(self, name, getattr(layer, name) if name in served else getattr(below, name))


def over(host_cls: type, rows: dict, order: tuple, outermost: tuple, attributes: dict) -> type:
    """The plugin's class over ``host_cls`` (what the host module's ``ResourceManagerV1`` is rebound to);
    ``attributes``: the install's other class attributes (arms, policies, the host's request views)."""

    class ResourceManagerV1(Scheduler, host_cls):
        __doc__ = f"fdsched's ResourceManagerV1 over {host_cls.__module__}.{host_cls.__qualname__}: see Scheduler."
        __qualname__ = "ResourceManagerV1"
        _fdsched_host_class = host_cls
        _fdsched_rows = rows
        _fdsched_order = order
        _fdsched_outermost = outermost
        _fdsched_init_signature = init_signature(host_cls)

    for name, value in attributes.items():
        setattr(ResourceManagerV1, name, value)
    hide_absent(ResourceManagerV1, host_cls, SEAMS)  # a seam this host lacks stays missing
    return ResourceManagerV1


# ---- the step plan ----------------------------------------------------------------------------------------
NOTHING = frozenset()  # what a plan says of a check it expects nothing of (most checks: one object, no allocation)


class Expected(NamedTuple):
    """What a plan expects of one block check (a named tuple: one is made per admission a pass asks about)."""

    kind: str  # what the plan expects of the check, e.g. "refuse-running-chunk"
    request_id: str  # the request whose check it is
    num_blocks: int  # the block count of that check


class StepPlan:
    """One ``schedule()`` pass of one scheduler, used by the thread that opened it only."""

    __slots__ = ("_new_budget", "made", "request_id", "expected", "slot", "owner", "running_chunk")

    def __init__(self, new_budget=None) -> None:
        # makes the pass's admission budget (fdsched.core.admission.AdmissionBudget) when the pass first needs it:
        # most passes admit nothing and never ask; None: a plan with no budget
        self._new_budget = new_budget
        self.made = None  # the budget, once the plan made it (read as it is: nothing is made)
        self.request_id = "(none)"  # the request the pass is deciding on
        self.expected = ()  # what the plan still expects of its checks (Expected), in order (a list once it expects)
        self.slot = None  # the slot it is open in, told when it starts or stops expecting
        self.owner = None  # the thread that opened it
        # (request id, blocks): a running chunk whose threshold the pass asks next, answered with its own blocks (the
        # pre-change running pass; a PD decode node's)
        self.running_chunk = None

    @property
    def budget(self):
        """The pass's admission budget, made on first use; None for a plan without one."""
        if self.made is None and self._new_budget is not None:
            self.made = self._new_budget()
        return self.made

    def focus(self, request_id: str) -> None:
        """The pass's next block checks are for ``request_id``."""
        self.request_id = request_id

    def expect(self, kind: str, num_blocks: int) -> None:
        """The next check of ``num_blocks`` blocks, for the request in focus, is for ``kind``."""
        self.expected = [*self.expected, Expected(kind, self.request_id, int(num_blocks))]
        if self.slot is not None:
            self.slot.waiting = True

    def take(self, num_blocks: int) -> frozenset:
        """The kinds the plan expects of this check of ``num_blocks`` blocks for the request in focus (consumed)."""
        expected = self.expected
        if not expected:
            return NOTHING
        if len(expected) == 1:  # the common case: the one threshold just asked
            kind, request_id, blocks = expected[0]
            if blocks != num_blocks or request_id != self.request_id:
                return NOTHING
            self.expected = ()
            self._settled()
            return frozenset((kind,))
        taken = [e for e in expected if e.num_blocks == num_blocks and e.request_id == self.request_id]
        if not taken:
            return NOTHING
        self.expected = [e for e in self.expected if e not in taken]
        self._settled()
        return frozenset(e.kind for e in taken)

    def _settled(self) -> None:
        if self.slot is not None:
            self.slot.settle()

    def pending(self) -> tuple:
        return tuple(self.expected)

    def expecting(self) -> bool:
        """Whether the plan still expects something of a check (what :meth:`close` would drop)."""
        return bool(self.expected)

    def close(self, logger, of=None) -> list:
        """Drop what is still expected; log and count each as unconsumed (labelled by ``of``'s arm)."""
        left, self.expected = list(self.expected), ()
        self._settled()
        for e in left:
            METRICS.signal_unconsumed(e.kind, of=of)
            logger.warning(
                f"[fdsched] one-shot signal {e.kind} for request {e.request_id} (a block check of {e.num_blocks} "
                "blocks) was not consumed by the end of the schedule() pass: the host's control flow differs from "
                "what the plugin relies on (see `fdsched patches`); the signal is dropped"
            )
        return left


class PlanSlot:
    """Where a scheduler's cache manager finds the scheduler's open plan: one plan at a time, with the thread that
    opened it.

    The slot's :attr:`turn` makes the passes take turns: the scheduler's ``schedule()`` holds it from opening a plan to
    the end of the pass's steps, so a second thread calling ``schedule()`` waits for the open pass to end, as on the
    host's lock (re-entrant: a pass that calls ``schedule()`` again on its own thread nests). A plan opened here without the
    turn while another thread's is open is not found through the slot: its thresholds are asked as outside a pass.
    Only the owner of a plan changes it.
    """

    __slots__ = ("plan", "waiting", "turn")

    def __init__(self) -> None:
        self.turn = threading.RLock()  # held by the scheduler for one pass, plan open to the pass's last step
        self.plan = None  # the open pass's plan
        # Whether the open plan expects something of a check: the cache manager's check reads this first (most
        # checks find it False and ask nothing).
        self.waiting = False

    def settle(self) -> None:
        """:attr:`waiting` again, after a plan stopped expecting (or the slot changed)."""
        plan = self.plan
        self.waiting = bool(plan is not None and plan.expected)

    def open(self, plan: StepPlan):
        """Open ``plan`` on the calling thread; returns what to hand :meth:`close` (the plan it covers, or None)."""
        plan.owner, plan.slot = get_ident(), self
        outer = self.plan
        if outer is not None and outer.owner != plan.owner:
            return _NOT_OPENED  # another thread's pass is open: this one is not found through the slot
        self.plan = plan
        return outer

    def close(self, outer) -> None:
        """End the calling thread's pass, putting back ``outer`` (what :meth:`open` returned)."""
        if outer is _NOT_OPENED:
            return
        self.plan = outer
        if self.waiting:
            self.settle()

    def current(self):
        """The plan the calling thread has open, or None."""
        plan = self.plan
        return plan if plan is not None and plan.owner == get_ident() else None

    def take(self, num_blocks: int) -> frozenset:
        """What the plan open on the calling thread says of this check of ``num_blocks`` blocks (:meth:`StepPlan.take`,
        consumed); :data:`NOTHING` when there is none. The cache manager asks this only while :attr:`waiting` is set
        (most checks find it unset and ask nothing)."""
        plan = self.current()
        return NOTHING if plan is None else plan.take(num_blocks)

    def pending(self) -> tuple:
        """What the open plan still expects (a diagnostic: read from any thread)."""
        plan = self.plan
        return plan.pending() if plan is not None else ()


_NOT_OPENED = object()  # what PlanSlot.open returns for a plan it did not open


class _NoPlans(PlanSlot):
    """The slot of a cache manager no plugin scheduler was built with: nothing is ever open."""

    __slots__ = ()

    def open(self, plan):  # pragma: no cover - never opened
        raise RuntimeError("no scheduler handed this cache manager a plan slot")

    def current(self):
        return None


NO_PLANS = _NoPlans()

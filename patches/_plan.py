"""The step plan: one object per ``schedule()`` pass that every change reads and writes, and the one slot through which
the scheduler's cache manager finds it.

The host's block check (``PrefixCacheManager.can_allocate_gpu_blocks``) is called with a count only; the scheduler
knows which request the check is for. A :class:`StepPlan` holds what the pass decided that a check must follow: the
pass's admission budget (made at its first need), the request the pass is deciding on (:meth:`StepPlan.focus`, from
the host's ``get_new_block_nums(request, ...)``, called right before that request's checks) and what the pass
expects of a check of it (:meth:`StepPlan.expect`: a kind and a block count). The check asks the plan one question,
"what do you say of this check of n blocks?" (:meth:`StepPlan.take`), and the answer is consumed by that check.

The scheduler makes one :class:`PlanSlot` when it is built and hands it to its cache manager then; the slot holds the
plan that is open (one at a time) and the thread that opened it. A check on any other thread (the token processor,
the transfer receiver, another plugin) is not the pass's and gets the pool's own answer. A threshold asked with no
plan open (PD preallocation on a host without reserve seams) leaves one question in the slot for the check that
follows it on the same thread; the host asks both under its lock, so no other question comes between.

When a pass ends, what is still expected was not met by the check it was for (the host's control flow is not what
the plugin relies on): :meth:`StepPlan.close` drops it, logs it and counts it
(``fastdeploy:fdsched_unconsumed_signals_total{signal}``).
"""

from __future__ import annotations

import threading
from threading import get_ident
from typing import NamedTuple

from fdsched.core.metrics import METRICS

__all__ = ["Expected", "StepPlan", "PlanSlot", "NO_PLANS", "NOTHING"]

NOTHING = frozenset()  # what a plan says of a check it expects nothing of (most checks: one object, no allocation)


class Expected(NamedTuple):
    """What a plan expects of one block check (a named tuple: one is made per admission a pass asks about)."""

    kind: str  # what the plan expects of the check, e.g. "refuse-running-chunk"
    request_id: str  # the request whose check it is
    num_blocks: int  # the block count of that check


class StepPlan:
    """One ``schedule()`` pass of one scheduler (or one question asked outside a pass), used by the thread that
    opened it only."""

    __slots__ = ("_new_budget", "made", "request_id", "expected", "slot", "owner", "running_chunk")

    def __init__(self, new_budget=None) -> None:
        # makes the pass's admission budget (fdsched.core.admission.AdmissionBudget) when the pass first needs it:
        # most passes admit nothing and never ask; None: a plan with no budget
        self._new_budget = new_budget
        self.made = None  # the budget, once the plan made it (read as it is: nothing is made)
        self.request_id = "(none)"  # the request the pass is deciding on
        self.expected: list = []  # what the plan still expects of its checks (Expected), in order
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
        self.expected.append(Expected(kind, self.request_id, int(num_blocks)))
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
            self.expected = []
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
        left, self.expected = self.expected, []
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
    """Where a scheduler's cache manager finds the scheduler's open plan: one plan and one question at a time, each
    with the thread that opened it.

    The slot's :attr:`turn` makes the passes take turns: the scheduler's ``schedule()`` holds it from opening a plan to
    the end of the pass's steps, so a second thread calling ``schedule()`` waits for the open pass to end, as on the
    host's lock (re-entrant: a pass that calls ``schedule()`` again on its own thread nests). A plan opened here without the
    turn while another thread's is open is not found through the slot: its thresholds are asked as outside a pass.
    Only the owner of a plan changes it.
    """

    __slots__ = ("plan", "question", "waiting", "turn")

    def __init__(self) -> None:
        self.turn = threading.RLock()  # held by the scheduler for one pass, plan open to the pass's last step
        self.plan = None  # the open pass's plan
        self.question = None  # a threshold's plan asked with no pass open, until the next such question
        # Whether the open plan or the question expects something of a check: the cache manager's check reads this
        # first (most checks find it False and ask nothing).
        self.waiting = False

    def settle(self) -> None:
        """:attr:`waiting` again, after a plan stopped expecting (or the slot changed)."""
        plan, question = self.plan, self.question
        self.waiting = bool((plan is not None and plan.expected) or (question is not None and question.expected))

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

    def ask_outside_a_pass(self, plan: StepPlan) -> None:
        """A threshold asked with no pass open on this thread: its one question for the check that follows is kept
        until the next such question (it is never the scheduler's pass: :meth:`current` does not see it)."""
        plan.owner, plan.slot = get_ident(), self
        self.question = plan
        self.settle()

    def current(self):
        """The plan the calling thread has open, or None."""
        plan = self.plan
        return plan if plan is not None and plan.owner == get_ident() else None

    def consulted(self):
        """What a block check on the calling thread consults: that thread's open plan, else its question, else None."""
        me = get_ident()
        plan = self.plan
        if plan is not None and plan.owner == me:
            return plan
        question = self.question
        return question if question is not None and question.owner == me else None

    def take(self, num_blocks: int) -> frozenset:
        """What the plan :meth:`consulted` on the calling thread says of this check of ``num_blocks`` blocks
        (:meth:`StepPlan.take`, consumed); :data:`NOTHING` when there is none. The cache manager asks this only while
        :attr:`waiting` is set (most checks find it unset and ask nothing)."""
        plan = self.consulted()
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

    def consulted(self):
        return None


NO_PLANS = _NoPlans()

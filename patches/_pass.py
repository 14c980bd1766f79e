"""One object per ``schedule()`` pass: what the scheduler's pass decided that the cache manager's block check must
follow, held by the pass and consulted there, instead of notes left in the cache manager.

The host's block check (``PrefixCacheManager.can_allocate_gpu_blocks``) is called with a count only; the scheduler
knows which request the check is for. A :class:`SchedulePass` is the scheduler's pass: it holds the pass's
admission budget, the request the pass is deciding on (:meth:`SchedulePass.focus`, from the host's
``get_new_block_nums(request, ...)``, which the host calls right before that request's checks), and what the pass
expects of a check of that request (:meth:`SchedulePass.expect`: a kind and a block count). The cache manager asks
one question of the pass open on its own thread — "what do you say of this check of n blocks?"
(:meth:`SchedulePass.take`) — and gets one answer, consumed by that check.

The scheduler owns a :class:`PassDesk` (thread -> the pass that thread has open) and hands it to its cache manager
once, when the scheduler is built. A check made on another thread while a pass is open (the token processor, the
transfer receiver, the PD preallocation, another plugin) finds no pass of its own and gets the pool's own answer;
nothing of the pass's is stored in the cache manager, so nothing there can be taken or bent by another caller.

At the end of every pass the scheduler closes it (:meth:`SchedulePass.close`): an expectation still pending was
not met by the check it was for (the host's control flow is not what the patch relies on); it is dropped, logged
and counted (``fastdeploy:fdsched_unconsumed_signals_total{signal}``).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from fdsched.core.metrics import METRICS

__all__ = ["Expected", "SchedulePass", "PassDesk", "NO_PASSES", "NOTHING"]

NOTHING = frozenset()  # what a pass says of a check it expects nothing of (most checks: one object, no allocation)


class Expected(NamedTuple):
    """What a pass expects of one block check (a named tuple: one is made per admission a pass asks about)."""

    kind: str  # what the pass expects of the check, e.g. "refuse-running-chunk"
    request_id: str  # the request whose check it is
    num_blocks: int  # the block count of that check


class SchedulePass:
    """One ``schedule()`` pass of one scheduler, used by the thread that runs it only."""

    __slots__ = ("_new_budget", "made", "request_id", "expected", "desk")

    def __init__(self, new_budget=None) -> None:
        # makes the pass's admission budget (fdsched.core.admission.AdmissionBudget) when the pass first needs it:
        # most passes admit nothing and never ask; None: a pass with no budget (a question asked outside a pass)
        self._new_budget = new_budget
        self.made = None  # the budget, once the pass made it (read as it is: nothing is made)
        self.request_id = "(none)"  # the request the pass is deciding on
        self.expected: list = []  # what the pass still expects of its checks (Expected), in order
        self.desk = None  # the desk it was opened on (PassDesk.open, ask_outside_a_pass), told what it expects

    @property
    def budget(self):
        """The pass's admission budget, made on first use; None for a pass without one."""
        if self.made is None and self._new_budget is not None:
            self.made = self._new_budget()
        return self.made

    def focus(self, request_id: str) -> None:
        """The pass's next block checks are for ``request_id``."""
        self.request_id = request_id

    def expect(self, kind: str, num_blocks: int) -> None:
        """The next check of ``num_blocks`` blocks, for the request in focus, is for ``kind``."""
        self.expected.append(Expected(kind, self.request_id, int(num_blocks)))
        if self.desk is not None:
            self.desk.waiting.add(threading.get_ident())

    def take(self, num_blocks: int) -> frozenset:
        """The kinds the pass expects of this check of ``num_blocks`` blocks for the request in focus (consumed)."""
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
        if self.desk is not None:
            self.desk.settle()

    def pending(self) -> tuple:
        return tuple(self.expected)

    def expecting(self) -> bool:
        """Whether the pass still expects something of a check (what :meth:`close` would drop)."""
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


class PassDesk:
    """Where a scheduler's open passes are found: thread id -> the :class:`SchedulePass` that thread has open.

    Each thread reads and writes only its own entry (one dict operation each), so no lock is needed: a second
    thread calling ``schedule()`` while a pass is open opens a pass of its own (and then waits for the host's
    lock) without replacing or seeing the first.
    """

    def __init__(self) -> None:
        self._open: dict = {}
        self._asked: dict = {}  # thread id -> a threshold asked outside a pass, until that thread asks the next
        # Threads whose open pass or question expects something of a check: the cache manager's check reads it first
        # (most checks, on every thread, find it empty). Only a thread itself adds or drops its own id (settle).
        self.waiting: set = set()

    def settle(self) -> None:
        """Put the calling thread in :attr:`waiting` exactly while its open pass or its question expects something."""
        thread = threading.get_ident()
        schedule_pass, question = self._open.get(thread), self._asked.get(thread)
        if (schedule_pass is not None and schedule_pass.expecting()) or (question is not None and question.expecting()):
            self.waiting.add(thread)
        else:
            self.waiting.discard(thread)

    def ask_outside_a_pass(self, schedule_pass: SchedulePass) -> None:
        """A threshold asked on a thread with no pass open (PD preallocation, no reserve seams): its one question for
        the check that follows is kept for that thread until it asks the next one (it is never a scheduler's
        pass: :meth:`current` does not see it)."""
        self._asked[threading.get_ident()] = schedule_pass
        schedule_pass.desk = self
        self.settle()

    def open(self, schedule_pass: SchedulePass):
        """Open ``schedule_pass`` on the calling thread; returns the pass it covers (a nested call), or None."""
        thread = threading.get_ident()
        outer = self._open.get(thread)
        self._open[thread] = schedule_pass
        schedule_pass.desk = self
        return outer

    def close(self, outer) -> None:
        """End the calling thread's pass, putting back ``outer`` (what :meth:`open` returned)."""
        thread = threading.get_ident()
        if outer is None:
            self._open.pop(thread, None)
        else:
            self._open[thread] = outer
        if self.waiting:
            self.settle()

    def current(self):
        """The pass the calling thread has open, or None."""
        return self._open.get(threading.get_ident())

    def consulted(self):
        """What the cache manager's check on the calling thread consults: that thread's open pass, else the question
        it asked outside a pass, else None."""
        thread = threading.get_ident()
        return self._open.get(thread) or self._asked.get(thread)

    def take(self, num_blocks: int) -> frozenset:
        """What the pass :meth:`consulted` on the calling thread says of this check of ``num_blocks`` blocks
        (:meth:`SchedulePass.take`, consumed); :data:`NOTHING` when no pass is. The cache manager asks this only while
        :attr:`waiting` holds a thread (most checks find it empty and ask nothing)."""
        schedule_pass = self.consulted()
        return NOTHING if schedule_pass is None else schedule_pass.take(num_blocks)

    def pending(self) -> tuple:
        """What every open pass still expects (a diagnostic: read from any thread)."""
        return tuple(e for p in list(self._open.values()) for e in p.pending())


class _NoPasses(PassDesk):
    """The desk of a cache manager no plugin scheduler was built with: nothing is ever open."""

    def open(self, schedule_pass):  # pragma: no cover - never opened
        raise RuntimeError("no scheduler handed this cache manager a desk")

    def current(self):
        return None

    def consulted(self):
        return None


NO_PASSES = _NoPasses()

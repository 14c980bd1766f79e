"""The scheduler guard: a watch after every ``schedule()`` call, in every ``ResourceManagerV1`` while the
plugin is loaded (every profile, every line; it changes no decision). The scheduler's one ``schedule()``
(:mod:`fdsched.patches._scheduler`) calls it.

* **Stalled admission.** A pass that schedules nothing while requests wait, nothing runs and blocks are free is
  watched (:class:`fdsched.core.policies.StallWatch`); an episode that lasts 100 passes and 30 s is reported once.
  (Where the plugin knows a way out, the host fix ``preempted_seat_resume`` takes it inside the pass; this watch sees
  what is left.)
* **A KV block with two owners.** Every :data:`AUDIT_INTERVAL_S` seconds (longer where an audit is costly: at most
  0.1% of the scheduler thread) the block accounting is read under the scheduler's lock and checked
  (:mod:`fdsched.core.blocks`): each block free once or held, an uncached block by one request, a cached block by
  one radix-tree node. A finding seen by two audits in a row is reported once per episode.

Each report is one line in the scheduler's own log (the host's ``llm_logger``) and one
``fastdeploy:fdsched_guard_events_total{event=...}``. The guard only reads, and nothing in it raises into the engine.
Its cost is printed by ``fdsched bench schedule``.
"""

from __future__ import annotations

import time

from fdsched.core.blocks import BlockAudit, check_blocks
from fdsched.core.metrics import METRICS
from fdsched.core.policies import StallWatch
from fdsched.patches._base import host_global
from fdsched.patches._blocks import cache_blocks_by_node, request_held_blocks

__all__ = ["SchedulerGuard", "AUDIT_INTERVAL_S", "nothing_scheduled"]

RM = "fastdeploy.engine.sched.resource_manager_v1"
AUDIT_INTERVAL_S = 10.0  # seconds between the guard's audits of the block accounting


def nothing_scheduled(result) -> bool:
    """Whether a pass's result ``(tasks, ...)`` scheduled nothing (its tasks a list, or develop's ``BatchRequest``
    with ``__len__``); False when it cannot tell."""
    if not (isinstance(result, tuple) and len(result) >= 2):
        return False
    try:
        return len(result[0]) == 0
    except TypeError:
        return False


class SchedulerGuard:
    """The guard's part of the plugin's scheduler (:class:`fdsched.patches._scheduler.Scheduler`), which calls
    :meth:`_fdsched_guard` after each whole ``schedule()`` call (see the module docstring)."""

    def _fdsched_start_guard(self) -> None:
        """The guard's state, made when the scheduler is built."""
        self._fdsched_stall_watch = StallWatch()
        self._fdsched_block_audit = BlockAudit(AUDIT_INTERVAL_S)

    def _fdsched_guard(self, result) -> None:
        """After a pass that returned ``result``."""
        try:
            now = time.monotonic()
            # a stall has nothing running (StallWatch.observe): a pass with requests running reads no further
            if not self.running and nothing_scheduled(result):
                self._fdsched_watch_stall(now)
            elif self._fdsched_stall_watch.passes:  # an episode was open: this pass ends it
                self._fdsched_stall_watch.clear()
            if self._fdsched_block_audit.due(now):
                self._fdsched_audit_blocks(now)
        except Exception:  # noqa: BLE001 - a watch never takes the engine down
            pass  # the next pass reads again

    def _fdsched_watch_stall(self, now: float) -> None:
        """``admission_stalled``: a stall nothing in the plugin knows a way out of."""
        free = len(self.cache_manager.gpu_free_block_list)
        if not self._fdsched_stall_watch.observe(now, len(self.waiting), len(self.running), free):
            return
        METRICS.guard_event("admission_stalled", of=self)
        host_global(RM, "llm_logger").warning(
            "fdsched: admission stalled: %d request(s) waiting, none running, %d blocks free, nothing admitted for %d "
            "passes; the plugin knows no way out of this state", len(self.waiting), free,
            self._fdsched_stall_watch.passes)

    def _fdsched_audit_blocks(self, now: float) -> None:
        """``block_owner_conflict``: the accounting, read under the scheduler's lock and checked outside it."""
        cache = self.cache_manager
        start = time.perf_counter()
        with self.lock:
            free = list(cache.gpu_free_block_list)
            held = request_held_blocks(list(self.requests.values()))
            nodes, others = cache_blocks_by_node(cache)
        findings = check_blocks(cache.num_gpu_blocks, free, held, nodes + others, node_blocks=nodes)
        for finding in self._fdsched_block_audit.record(now, findings, time.perf_counter() - start):
            METRICS.guard_event("block_owner_conflict", of=self)
            host_global(RM, "llm_logger").error(
                "fdsched: KV block accounting: %s; a request's KV may be overwritten by another's (the plugin cannot "
                "undo this; a restart clears it)", finding)

"""Per-arm request outcomes, recorded where a request finishes in the scheduler process, and no request finished
twice: the outermost layer of the scheduler's ``finish_requests`` on every arm (see :mod:`fdsched.patches._scheduler`).

``finish_requests`` runs the layers below (the changes', then the host's own) and then, for every request that the
call removed from ``requests``, records requests finished, output tokens, TTFT (``engine_recv_first_token_time -
arrival_time``, what the host's own TTFT histogram uses) and TPOT (``(engine_recv_latest_token_time -
engine_recv_first_token_time) / (output tokens - 1)``) from the request's own timestamps, labelled by the scheduler's
arm (:func:`fdsched.core.metrics.labels_of`). Relies on: ``finish_requests(request_ids)`` is where the host removes a
finished request from ``self.requests`` (also when called through ``finish_requests_async``).

Finished twice (every arm, ``baseline`` included): the host runs a finish later on a thread pool, so a request whose
last token is out can still be preempted, and the output reader puts it back into ``waiting`` (its slot is absent
from the next batch) before the finish runs. The host's ``finish_requests`` then logs "scheduled into waiting list,
after finished" and leaves it there, to be prefilled and finished a second time. Here such a request -- in
``waiting``, still ``PREEMPTED`` (not scheduled again) -- is taken out of ``waiting`` first and finished as the host
finishes a preempted request: its blocks went back at the preemption and its slot was cleared then (the slot may hold
another request by now, so it is left alone).
"""

from __future__ import annotations

import sys

from fdsched.core.metrics import METRICS
from fdsched.patches._base import finished_ids

__all__ = ["RequestOutcomes"]


class RequestOutcomes:
    """The outermost layer of ``finish_requests`` (one per scheduler, where the host's ``finish_requests`` takes the
    ids only)."""

    seams = ("finish_requests",)

    def __init__(self, rm, settings, next):
        self.next = next

    def finish_requests(self, rm, request_ids):
        request_ids, ids = finished_ids(request_ids)
        requests = getattr(rm, "requests", None)
        before = [(rid, requests.get(rid)) for rid in ids] if isinstance(requests, dict) else []
        ended = self.end_preempted_in_waiting(rm, before) if before else set()
        if ended:  # the host would log each as an invalid id
            request_ids = [rid for rid in ids if rid not in ended]
        result = self.next.finish_requests(rm, request_ids)
        for rid, request in before:  # the host's and the ones ended above alike: gone from rm.requests
            if request is not None and rid not in rm.requests:
                METRICS.request_finished(request, of=rm)
        return result

    @staticmethod
    def end_preempted_in_waiting(rm, found) -> set:
        """End (as above) each of ``found`` (request id, request) that is back in ``waiting`` after a preemption;
        the ids ended."""
        ended = set()
        status = rm._fdsched_statuses  # the host's RequestStatus
        preempted, finished = getattr(status, "PREEMPTED", None), getattr(status, "FINISHED", None)
        lock, waiting = getattr(rm, "lock", None), getattr(rm, "waiting", None)
        if preempted is None or finished is None or lock is None or waiting is None:
            return ended
        with lock:
            for rid, request in found:
                if request is None or request.status != preempted or rm.requests.get(rid) is not request:
                    continue
                try:
                    waiting.remove(request)
                except ValueError:  # not put back yet: the host's own branch for a preempted request ends it
                    continue
                request.status = finished
                del rm.requests[rid]
                getattr(rm, "req_dict", {}).pop(rid, None)
                for name in ("to_be_rescheduled_request_id_set", "waiting_abort_req_id_set",
                             "to_be_aborted_req_id_set"):
                    getattr(rm, name, set()).discard(rid)
                ended.add(rid)
        if ended:
            logger = getattr(sys.modules.get(rm._fdsched_host_class.__module__), "llm_logger", None)
            if logger is not None:
                logger.info(f"[fdsched] finished while their preemption was in flight, ended instead of run "
                            f"again: {sorted(ended)}")
        return ended

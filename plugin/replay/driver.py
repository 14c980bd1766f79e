"""Play worker and token processor around a real host scheduler, one engine step at a time (:class:`Driver`).

The scheduler is built by :mod:`fdsched.replay.engine`; the replay's loop over a run (arrivals, rows, checks) is
:mod:`fdsched.replay.drive`. One :meth:`Driver.step` is one engine step:

1. ``schedule()`` on the real scheduler;
2. the worker: every running request that was decoding before the step produces one token, and every
   request whose prefill finished this step produces its first token (a chunk that does not finish
   the prompt produces nothing);
3. the token processor: append the token, flip ``RUNNING_PREFILL`` to ``RUNNING_DECODE`` on a host
   that has the split status, ``finish_requests`` when the request reaches its true output length or
   ``max_tokens`` (:func:`fdsched.replay.trace.effective_output_len`), and ``reschedule_preempt_task``
   for each request preempted in this step.

Which running requests decode is the plugin's one decode test, through the installed plugin's hook
(``fdsched_is_decoding``) when the plugin is installed, else the plugin's default policy. Asynchronous
preprocessing is waited on, so a step is deterministic for the same inputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from fdsched.core.policies import is_decoding
from fdsched.replay.trace import effective_output_len

__all__ = ["Driver", "StepRecord"]


def _wait_preprocessing(request) -> None:
    """Wait for the request's async preprocessing (``async_process_futures``), where the line has it."""
    for future in list(getattr(request, "async_process_futures", None) or ()):
        future.result()


@dataclass
class StepRecord:
    step: int
    scheduled_prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_context_tokens: int = 0  # tokens the decoding requests held when they decoded, summed (cost model)
    first_tokens: list = field(default_factory=list)  # request ids that got their first token
    finished: list = field(default_factory=list)
    preempted: list = field(default_factory=list)  # (request id, phase at preemption)
    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    schedule_seconds: float = 0.0  # wall clock
    schedule_cpu_seconds: float = 0.0  # this thread's CPU time
    prefill_chunks: list = field(default_factory=list)  # (request id, prefill_start_index, prefill_end_index)
    produced: list = field(default_factory=list)  # request ids that got a token in this step (first or decode)


class Driver:
    """Plays worker and token processor around a real scheduler.

    ``output_lengths``: request id -> true output length (a request without one stops only at
    ``max_tokens``). ``policies``: the :class:`fdsched.core.hooks.Policies` whose decode test to use;
    default: the installed plugin's, else the plugin's default policy. ``clock``: when given (a function
    returning seconds), the driver stamps each request's ``metrics`` as the engine does: ``arrival_time``
    when it is added, ``engine_recv_first_token_time`` / ``engine_recv_latest_token_time`` when a token
    comes (the plugin's per-arm TTFT / TPOT read them); without it nothing is stamped.
    """

    def __init__(self, manager, output_lengths: Optional[dict] = None, token_id: int = 7, policies=None, clock=None):
        self.rm = manager
        self.clock = clock
        self.output_lengths = output_lengths or {}  # request id -> true output length
        self.token_id = token_id
        self.step_no = 0
        from fastdeploy.engine.request import Request, RequestStatus

        self._request_cls = Request
        self._status = RequestStatus
        self._split = hasattr(RequestStatus, "RUNNING_DECODE")
        self._decode_status = RequestStatus.RUNNING_DECODE if self._split else None
        self._prefill_status = RequestStatus.RUNNING_PREFILL if self._split else None
        self._preprocessed = set()  # prefill-node path: request ids whose async preprocessing ran
        self._stop_at = {}  # request id -> tokens at which it finishes (None: only at max_tokens)
        if policies is None:
            from fdsched.install.installer import current

            installed = current()
            policies = installed.policies if installed is not None else None
        self._policies = policies

    # ---- feeding ------------------------------------------------------------------------------
    def _remember(self, request, true_output_len: Optional[int]) -> None:
        if true_output_len is not None:
            self.output_lengths[request.request_id] = true_output_len

    def add(self, request, true_output_len: Optional[int] = None) -> None:
        self._remember(request, true_output_len)
        self.rm.add_request(request)
        _wait_preprocessing(request)
        if self.clock is not None:  # after the host's own stamps (it sets arrival_time from the wall clock)
            request.metrics.arrival_time = self.clock()

    def add_in_p(self, request, true_output_len: Optional[int] = None) -> bool:
        """Feed a request the way a prefill node's engine does (``splitwise_role == "prefill"``).

        The engine starts the request's async preprocessing, preallocates its prompt blocks with
        ``preallocate_resource_in_p`` (retrying while it fails), waits for the preprocessing and then
        hands it to ``add_request_in_p``, which puts it straight into ``running``. Here one call is
        one attempt: False when preallocation failed (call again at a later step; the engine's
        feeding thread does not move on to the next request meanwhile).
        """
        rid = request.request_id
        self._remember(request, true_output_len)
        if rid not in self._preprocessed:
            start = getattr(self.rm, "apply_async_preprocess", None)  # a line without async preprocessing: nothing
            if start is not None:
                start(request)
            self._preprocessed.add(rid)
        _wait_preprocessing(request)
        if not self.rm.preallocate_resource_in_p(request):
            return False
        finish = getattr(self.rm, "waiting_async_process", None)
        if finish is not None:
            finish(request)
        self.rm.add_request_in_p([request])
        self._preprocessed.discard(rid)
        return True

    # ---- one engine step --------------------------------------------------------------------
    def is_decoding(self, request) -> bool:
        """The plugin's one decode test: the hook ``fdsched_is_decoding`` of the installed plugin (its
        default: the host's status where it has RUNNING_DECODE, else token counts)."""
        status_is_decode = (request.status == self._decode_status) if self._split else None
        if self._policies is None:
            return is_decoding(status_is_decode, request.num_total_tokens, request.need_prefill_tokens)
        return self._policies.is_decoding(
            request.request_id, status_is_decode, request.num_total_tokens, request.need_prefill_tokens
        )

    def _stop_after(self, request) -> Optional[int]:
        rid = request.request_id
        if rid not in self._stop_at:
            limit = self.output_lengths.get(rid)
            max_tokens = request.sampling_params.max_tokens
            self._stop_at[rid] = max_tokens if limit is None else effective_output_len(limit, max_tokens)
        return self._stop_at[rid]

    def step(self) -> StepRecord:
        """One engine step (the module's docstring says what each part does, in the engine's order)."""
        rm = self.rm
        record = StepRecord(step=self.step_no)
        phase_before = {}
        for r in rm.running:
            phase_before[r.request_id] = "decode" if self.is_decoding(r) else "prefill"

        started, started_cpu = time.perf_counter(), time.thread_time()
        scheduled, errors = rm.schedule()
        record.schedule_cpu_seconds = time.thread_time() - started_cpu
        record.schedule_seconds = time.perf_counter() - started
        if errors:
            raise RuntimeError(f"scheduler reported errors: {errors}")

        prefilled, preempted_ids = self._read_scheduled(scheduled, record, phase_before)
        producers = self._producers(prefilled, set(preempted_ids), phase_before, record)
        record.produced = [request.request_id for request in producers]
        finished = self._emit_tokens(producers)
        for rid in finished:
            # One id per call, in the step's order, as the engine's token processor does
            # (finish_requests_async(task_id)): the host turns a list into a set, whose order follows string
            # hashes (PYTHONHASHSEED); on a prefill node the order requests finish in is the order the plugin's
            # safe recording enters their blocks into the radix tree.
            rm.finish_requests(rid)
            self._stop_at.pop(rid, None)
        record.finished = finished
        for rid in preempted_ids:
            rm.reschedule_preempt_task(rid)

        record.running = len(rm.running)
        record.waiting = len(rm.waiting)
        cm = rm.cache_manager
        record.blocks_used = cm.num_gpu_blocks - len(cm.gpu_free_block_list)
        self.step_no += 1
        return record

    def _read_scheduled(self, scheduled, record: StepRecord, phase_before: dict) -> tuple:
        """What ``schedule()`` returned: (request id -> its prefill task, the preempted ids in order); the
        prefill chunks and the preemptions (with the phase each victim was in) go into ``record``."""
        prefilled = {}
        preempted_ids = []
        request_cls = self._request_cls
        for task in scheduled:
            if isinstance(task, request_cls):
                prefilled[task.request_id] = task
                record.scheduled_prefill_tokens += task.prefill_end_index - task.prefill_start_index
                record.prefill_chunks.append((task.request_id, task.prefill_start_index, task.prefill_end_index))
            elif type(task).__name__ == "ScheduledPreemptTask":
                preempted_ids.append(task.request_id)
        record.preempted = [(rid, phase_before.get(rid, "prefill")) for rid in preempted_ids]
        return prefilled, preempted_ids

    def _producers(self, prefilled: dict, preempted: set, phase_before: dict, record: StepRecord) -> list:
        """The worker: the running requests that produce a token this step (a finished prefill its first, a
        request that was decoding before the step and holds the slots for it one more), counted in ``record``."""
        rm = self.rm
        producers = []
        for request in list(rm.running):
            rid = request.request_id
            if rid in preempted:
                continue
            if rid in prefilled:
                if prefilled[rid].prefill_end_index >= request.need_prefill_tokens:
                    producers.append(request)
                    record.first_tokens.append(rid)
            elif phase_before.get(rid) == "decode" and rm.allocated_slots(request) >= request.num_total_tokens:
                producers.append(request)
                record.decode_tokens += 1
                record.decode_context_tokens += request.num_total_tokens
        return producers

    def _emit_tokens(self, producers: list) -> list:
        """The token processor: append each producer's token (stamping its metrics with a clock), move it to
        decode, and return the ids that reached their stop length, in order."""
        finished = []
        now = self.clock() if self.clock is not None else None
        for request in producers:
            request.output_token_ids.append(self.token_id)
            if now is not None:
                if len(request.output_token_ids) == 1 or request.metrics.engine_recv_first_token_time is None:
                    request.metrics.engine_recv_first_token_time = now
                request.metrics.engine_recv_latest_token_time = now
            if self._split and request.status == self._prefill_status:
                request.status = self._decode_status
            stop = self._stop_after(request)
            if stop is not None and len(request.output_token_ids) >= stop:
                finished.append(request.request_id)
        return finished

    def idle(self) -> bool:
        return not self.rm.running and not self.rm.waiting and not self.rm.to_be_rescheduled_request_id_set

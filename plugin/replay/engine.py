"""Drive the real host scheduler without a GPU: build it, feed requests, play worker and token processor.

Used by the replay and by the host tests. Builds ``ResourceManagerV1`` through whatever class the
host module binds at call time, so with the plugin installed it is the plugin's subclass.

One :meth:`Driver.step` is one engine step:

1. ``schedule()`` on the real scheduler;
2. the worker: every running request that was decoding before the step produces one token, and every
   request whose prefill finished this step produces its first token (a chunk that does not finish
   the prompt produces nothing);
3. the token processor: append the token, flip ``RUNNING_PREFILL`` to ``RUNNING_DECODE`` on a host
   that has the split status, ``finish_requests`` when the request reaches its true output length or
   ``max_tokens``, and ``reschedule_preempt_task`` for each request preempted in this step.

Everything is deterministic for the same inputs: asynchronous preprocessing is waited on, and the
prefix cache's LRU timestamps come from a logical clock (:func:`logical_clock`).
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

from ..policies import is_decoding

__all__ = [
    "EngineShape",
    "prepare_host_environment",
    "build_manager",
    "close_manager",
    "make_request",
    "logical_clock",
    "Driver",
    "StepRecord",
]


def prepare_host_environment() -> None:
    """Environment the host's modules need on a CPU machine (idempotent; set before importing them)."""
    os.environ.setdefault("ENABLE_V1_KVCACHE_SCHEDULER", "1")
    for var in ("PROMETHEUS_MULTIPROC_DIR", "FD_LOG_DIR"):
        if not os.environ.get(var):
            os.environ[var] = tempfile.mkdtemp(prefix=f"fdsched-{var.lower()}-")


@dataclass(frozen=True)
class EngineShape:
    """The engine the scheduler thinks it runs on."""

    block_size: int = 16
    num_gpu_blocks: int = 512
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    splitwise_role: str = "mixed"
    enc_dec_block_num: int = 2

    def check(self) -> None:
        need = -(-self.max_model_len // self.block_size) + 2
        if self.num_gpu_blocks < need:
            raise ValueError(
                f"num_gpu_blocks={self.num_gpu_blocks} is too small: the host needs at least "
                f"max_model_len / block_size + 2 = {need}"
            )
        if self.max_num_batched_tokens > self.max_num_seqs * self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must not exceed max_num_seqs * max_model_len "
                f"= {self.max_num_seqs * self.max_model_len} (the host's config check)"
            )


def build_manager(shape: EngineShape):
    """A ``ResourceManagerV1`` built from real host configs, the way the host's own tests build one."""
    from dataclasses import asdict
    from types import SimpleNamespace

    shape.check()
    prepare_host_environment()
    from fastdeploy.config import CacheConfig, FDConfig, ParallelConfig, SchedulerConfig
    from fastdeploy.engine import args_utils
    from fastdeploy.engine.sched import resource_manager_v1

    v1_flag = os.environ.get("ENABLE_V1_KVCACHE_SCHEDULER")
    engine_args = args_utils.EngineArgs(
        max_num_seqs=shape.max_num_seqs,
        num_gpu_blocks_override=shape.num_gpu_blocks,
        max_num_batched_tokens=shape.max_num_batched_tokens,
    )
    # On a CPU paddle wheel EngineArgs turns the V1 scheduler off in the process environment.
    os.environ["ENABLE_V1_KVCACHE_SCHEDULER"] = v1_flag or "1"
    args = asdict(engine_args)

    cache = CacheConfig(args)
    cache.block_size = shape.block_size
    cache.max_block_num_per_seq = -(-shape.max_model_len // shape.block_size) + 1
    cache.enc_dec_block_num = shape.enc_dec_block_num
    cache.enable_prefix_caching = shape.enable_prefix_caching
    cache.enable_output_caching = False
    cache.bytes_per_token_per_layer = 1
    cache.kv_cache_ratio = 1.0
    model = SimpleNamespace(
        enable_mm=False,
        max_model_len=shape.max_model_len,
        architectures=["fdsched_replay_model"],
        mm_max_tokens_per_item=None,
        version=None,
        print=lambda *a, **k: None,
    )
    scheduler = SchedulerConfig(args)
    scheduler.splitwise_role = shape.splitwise_role
    fd_config = FDConfig(
        model_config=model,
        cache_config=cache,
        parallel_config=ParallelConfig(args),
        graph_opt_config=engine_args.create_graph_optimization_config(),
        speculative_config=SimpleNamespace(method=None, num_speculative_tokens=0),
        scheduler_config=scheduler,
    )
    manager = resource_manager_v1.ResourceManagerV1(
        max_num_seqs=shape.max_num_seqs,
        config=fd_config,
        tensor_parallel_size=1,
        splitwise_role=shape.splitwise_role,
    )
    return manager


def close_manager(manager) -> None:
    """Release what a manager holds outside Python objects (shared memory, thread pools)."""
    manager.need_block_num_signal.clear()
    manager.finish_execution_pool.shutdown(wait=True)
    manager.async_preprocess_pool.shutdown(wait=True)


def make_request(request_id: str, prompt_token_ids: list, max_tokens: Optional[int]):
    from fastdeploy.engine.request import Request, RequestMetrics

    request = Request.from_dict({"request_id": request_id, "multimodal_inputs": {}})
    request.prompt_token_ids = list(prompt_token_ids)
    request.prompt_token_ids_len = len(request.prompt_token_ids)
    request.need_prefill_tokens = request.prompt_token_ids_len
    request.output_token_ids = []
    request.disaggregate_info = {}
    request.metrics = RequestMetrics()
    request.sampling_params.max_tokens = max_tokens
    return request


@contextmanager
def logical_clock(start: float = 1_000_000.0):
    """Make ``time.time()`` in the prefix cache module a counter, so LRU order never ties on wall time."""
    import fastdeploy.cache_manager.prefix_cache_manager as pcm_module

    original = pcm_module.time
    state = {"now": start}

    class _Clock:
        def __getattr__(self, name):
            return getattr(original, name)

        @staticmethod
        def time():
            state["now"] += 1.0
            return state["now"]

    pcm_module.time = _Clock()
    try:
        yield
    finally:
        pcm_module.time = original


@dataclass
class StepRecord:
    step: int
    scheduled_prefill_tokens: int = 0
    decode_tokens: int = 0
    first_tokens: list = field(default_factory=list)  # request ids that got their first token
    finished: list = field(default_factory=list)
    preempted: list = field(default_factory=list)  # (request id, phase at preemption)
    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    schedule_seconds: float = 0.0  # wall clock
    schedule_cpu_seconds: float = 0.0  # this thread's CPU time
    prefill_chunks: list = field(default_factory=list)  # (request id, prefill_start_index, prefill_end_index)


class Driver:
    """Plays worker and token processor around a real scheduler."""

    def __init__(self, manager, output_lengths: Optional[dict] = None, token_id: int = 7):
        self.rm = manager
        self.output_lengths = output_lengths or {}  # request id -> true output length
        self.token_id = token_id
        self.step_no = 0
        from fastdeploy.engine.request import RequestStatus

        self._status = RequestStatus
        self._split = hasattr(RequestStatus, "RUNNING_DECODE")
        self._preprocessed = set()  # prefill-node path: request ids whose async preprocessing ran

    # ---- feeding ------------------------------------------------------------------------------
    def add(self, request, true_output_len: Optional[int] = None) -> None:
        if true_output_len is not None:
            self.output_lengths[request.request_id] = true_output_len
        self.rm.add_request(request)
        for future in list(request.async_process_futures):
            future.result()

    def add_in_p(self, request, true_output_len: Optional[int] = None) -> bool:
        """Feed a request the way a prefill node's engine does (``splitwise_role == "prefill"``).

        The engine starts the request's async preprocessing, preallocates its prompt blocks with
        ``preallocate_resource_in_p`` (retrying while it fails), waits for the preprocessing and then
        hands it to ``add_request_in_p``, which puts it straight into ``running``. Here one call is
        one attempt: False when preallocation failed (call again at a later step; the engine's
        feeding thread does not move on to the next request meanwhile).
        """
        rid = request.request_id
        if true_output_len is not None:
            self.output_lengths[rid] = true_output_len
        if rid not in self._preprocessed:
            self.rm.apply_async_preprocess(request)
            self._preprocessed.add(rid)
        for future in list(request.async_process_futures):
            future.result()
        if not self.rm.preallocate_resource_in_p(request):
            return False
        self.rm.waiting_async_process(request)
        self.rm.add_request_in_p([request])
        self._preprocessed.discard(rid)
        return True

    # ---- one engine step --------------------------------------------------------------------
    def _is_decoding_now(self, request) -> bool:
        """The plugin's one decode test (the host's status where it has RUNNING_DECODE, else token counts)."""
        status_is_decode = (request.status == self._status.RUNNING_DECODE) if self._split else None
        return is_decoding(status_is_decode, request.num_total_tokens, request.need_prefill_tokens)

    def step(self) -> StepRecord:
        from fastdeploy.engine.request import Request

        rm = self.rm
        record = StepRecord(step=self.step_no)
        decoding_before = {r.request_id for r in rm.running if self._is_decoding_now(r)}
        phase_before = {r.request_id: ("decode" if r.request_id in decoding_before else "prefill") for r in rm.running}

        started, started_cpu = time.perf_counter(), time.thread_time()
        scheduled, errors = rm.schedule()
        record.schedule_cpu_seconds = time.thread_time() - started_cpu
        record.schedule_seconds = time.perf_counter() - started
        if errors:
            raise RuntimeError(f"scheduler reported errors: {errors}")

        prefilled = {}
        preempted_ids = []
        for task in scheduled:
            if isinstance(task, Request):
                prefilled[task.request_id] = task
                record.scheduled_prefill_tokens += task.prefill_end_index - task.prefill_start_index
                record.prefill_chunks.append((task.request_id, task.prefill_start_index, task.prefill_end_index))
            elif type(task).__name__ == "ScheduledPreemptTask":
                preempted_ids.append(task.request_id)
        record.preempted = [(rid, phase_before.get(rid, "prefill")) for rid in preempted_ids]
        preempted_set = set(preempted_ids)

        producers = []
        for request in list(rm.running):
            rid = request.request_id
            if rid in preempted_set:
                continue
            if rid in prefilled:
                if prefilled[rid].prefill_end_index >= request.need_prefill_tokens:
                    producers.append(request)
                    record.first_tokens.append(rid)
            elif rid in decoding_before and rm.allocated_slots(request) >= request.num_total_tokens:
                producers.append(request)
                record.decode_tokens += 1

        finished = []
        for request in producers:
            request.output_token_ids.append(self.token_id)
            if self._split and request.status == self._status.RUNNING_PREFILL:
                request.status = self._status.RUNNING_DECODE
            limit = self.output_lengths.get(request.request_id)
            max_tokens = request.sampling_params.max_tokens
            if (limit is not None and len(request.output_token_ids) >= limit) or (
                max_tokens is not None and len(request.output_token_ids) >= max_tokens
            ):
                finished.append(request.request_id)
        if finished:
            rm.finish_requests(finished)
        record.finished = finished
        for rid in preempted_ids:
            rm.reschedule_preempt_task(rid)

        record.running = len(rm.running)
        record.waiting = len(rm.waiting)
        cm = rm.cache_manager
        record.blocks_used = cm.num_gpu_blocks - len(cm.gpu_free_block_list)
        self.step_no += 1
        return record

    def idle(self) -> bool:
        return not self.rm.running and not self.rm.waiting and not self.rm.to_be_rescheduled_request_id_set

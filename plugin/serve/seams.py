"""Every seam the served engine needs on a CPU machine: as data (:data:`SEAMS`) and as code, in one place.

How the seams reach every process
---------------------------------
The served stack is several processes: the Router, ``multi_api_server`` (which starts one
``python -m fastdeploy.entrypoints.openai.api_server`` per data-parallel rank with ``subprocess``), each
api_server (gunicorn/uvicorn with the ``LLMEngine`` in its process, plus its queue-manager children), and
the simulated workers. The launcher (:mod:`fdsched.serve.launcher`) writes a ``sitecustomize.py`` into a
temporary directory and puts that directory on ``PYTHONPATH`` **only in the environment of the served
stack** (with ``FDSCHED_SERVE_SEAMS=1``). Python imports ``sitecustomize`` at start-up in every process
that inherits that environment, spawned ones included. It loads *this file by its path* (under a private
module name, so the ``fdsched`` package and the plugin are NOT imported) and installs an import hook
(:class:`_SeamFinder` on ``sys.meta_path``). The hook does nothing until one of the host modules in
:data:`SEAMS` is imported; right after that module has executed it applies that module's seams. A process
that never imports those modules (the Router) is not changed at all. Without ``FDSCHED_SERVE_SEAMS=1``
the ``sitecustomize`` returns at once.

Why an import hook rather than a wrapper entry point: the operator's commands stay exactly the
production ones (``python -m fastdeploy.entrypoints.openai.api_server``, ``multi_api_server``,
``fastdeploy.router.launch``), and the processes those commands spawn get the same seams without any of
them knowing.

The plugin is loaded only by FastDeploy's own loader (``load_model_register_plugins``, which reads
``FD_PLUGINS``): seam S4 calls that loader where the model-zoo import would have called it. Nothing
here imports ``fdsched``.

Seams change nothing else of the host. Each entry of :data:`SEAMS` names the host lines it stands for on
both supported hosts (new d38eeb8, old e7c8dc2) and why it is needed.
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.machinery
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

ENABLE_ENV = "FDSCHED_SERVE_SEAMS"  # "1": install the seams in this process tree
WORKER_ENV = "FDSCHED_SERVE_WORKER"  # path of the simulated worker script (fdsched/serve/worker.py)
STATE_ENV = "FDSCHED_SERVE_STATE_DIR"  # where the state probe (H1) answers requests
XFER_ENV = "FDSCHED_SERVE_CACHEXFER"  # path of the simulated cache transfer manager (fdsched/serve/cachexfer.py)
RPC_COUNT_ENV = "FDSCHED_SERVE_COUNT_RPC"  # "1": count the engine process's manager RPCs per thread (H2)
TIME_SCHEDULE_ENV = "FDSCHED_SERVE_TIME_SCHEDULE"  # "1": time every resource_manager.schedule() call (H3)
FINISH_DELAY_ENV = "FDSCHED_SERVE_FINISH_DELAY_MS"  # > 0: each finish on the host's finish pool waits this long (H7)
HOST_ENV = "FDSCHED_SERVE_HOST"  # the address the api_server, metrics and router ports listen on (S11)
SHM_LEDGER = "created-shm"  # in the state dir: one JSON line per /dev/shm entry a process of the stack created (H4)
MAIN_ENV_MULTI = "fastdeploy.entrypoints.openai.multi_api_server"
MAIN_API_SERVER = "fastdeploy.entrypoints.openai.api_server"


@dataclass(frozen=True)
class Seam:
    id: str
    module: str  # the host module whose import triggers the seam
    replaces: str  # what is replaced
    lines: dict  # host commit prefix -> the host lines it stands for
    why: str
    gpu_necessity: str


NEW, OLD = "d38eeb8", "e7c8dc2"

SEAMS = (
    Seam(
        "S1 platform",
        "fastdeploy.engine.args_utils",
        "args_utils.current_platform (a CPU platform that answers is_cuda() True)",
        {NEW: "engine/args_utils.py 573-625 (EngineArgs.__post_init__)", OLD: "engine/args_utils.py 560-612"},
        "on a non-CUDA platform __post_init__ turns prefix caching off, the overlap schedule off and forces "
        "ENABLE_V1_KVCACHE_SCHEDULER=0: config decisions only, so the V1 scheduler and the prefix cache the "
        "plugin replaces would never run",
        "no",
    ),
    Seam(
        "S2 worker launch",
        "fastdeploy.engine.engine",
        "LLMEngine._start_worker_service: starts fdsched/serve/worklaunch.py (one process that starts "
        "fdsched/serve/worker.py per rank, told the instance's splitwise_role) instead of paddle.distributed.launch",
        {NEW: "engine/engine.py 525-694 (_start_worker_service); 864-930 check_worker_initialize_status reads "
              "its stdout", OLD: "engine/engine.py 514-~680; 846-~910"},
        "the real worker runs the model on a GPU",
        "yes",
    ),
    Seam(
        "S3 kv shape",
        "fastdeploy.cache_manager.prefix_cache_manager",
        "PrefixCacheManager._get_kv_cache_shape: the shape computed from the model config",
        {NEW: "cache_manager/prefix_cache_manager.py 140-~165", OLD: "cache_manager/prefix_cache_manager.py 138-~163"},
        "builds a GPU attention backend only to size the swap process's command line",
        "yes",
    ),
    Seam(
        "S6 visible devices",
        "fastdeploy.cache_manager.prefix_cache_manager",
        "prefix_cache_manager.get_all_visible_devices when it is None",
        {NEW: "prefix_cache_manager.py 35 (import), 288 and 407 (use)", OLD: "prefix_cache_manager.py 35, 282, 391"},
        "cache_manager/ops.py binds it to None when the GPU ops do not import; used for the cache processes' "
        "command line",
        "no",
    ),
    Seam(
        "S4 model zoo",
        "fastdeploy.config",
        "ModelConfig._post_init without the model-zoo registry; keeps read_model_config and the rest; then "
        "FastDeploy's own plugin loader (load_model_register_plugins)",
        {NEW: "config.py 302-347 (_post_init), 349-352 (registry); model_executor/models/__init__.py 68 "
              "(the loader call the zoo import makes)", OLD: "config.py 301-346, 348-351; models/__init__.py 68"},
        "the registry imports the model zoo (paddleformers extras, GPU layers); that import is also what runs "
        "FD_PLUGINS' loader, so the loader is called here instead; pooler_config stays None (deep-copyable)",
        "partly",
    ),
    Seam(
        "S5 eos helper",
        "paddleformers.cli.utils.llm_utils",
        "get_eos_token_id (paddleformers.cli.utils.llm_utils or .trl.llm_utils), only when the real module fails "
        "to import",
        {NEW: "input/base_processor.py 102-107", OLD: "input/base_processor.py 102-107"},
        "paddleformers' module imports sklearn, which the CPU venv does not need otherwise",
        "no",
    ),
    Seam(
        "S7 multi_api_server devices",
        "fastdeploy.platforms",
        "the platform of the multi_api_server process only (is_cuda() True, CUDA_VISIBLE_DEVICES from the "
        "launcher)",
        {NEW: "entrypoints/openai/multi_api_server.py 164-173 (device_count), 91-97 (rdma ports check)",
         OLD: "entrypoints/openai/multi_api_server.py 164-173"},
        "on CPU device_count is 0 and the rdma-ports check can never pass, so multi_api_server cannot start",
        "no",
    ),
    Seam(
        "S8 output reader on rank > 0",
        "fastdeploy.output.token_processor",
        "TokenProcessor.process_sampling_results_use_zmq on data-parallel ranks > 0 only: a loop calling the "
        "host's own _reschedule_preempt_task_use_zmq, _process_batch_output_use_zmq and postprocess",
        {NEW: "output/token_processor.py 447-470", OLD: "output/token_processor.py 375-398"},
        "the ZMQ output path (FD_USE_GET_SAVE_OUTPUT_V1) reads only on rank 0 unless expert parallelism is on; "
        "production GPUs use the compiled get_output path, which every rank reads",
        "yes (the output path)",
    ),
    Seam(
        "S9 decode status on the ZMQ path",
        "fastdeploy.output.token_processor",
        "TokenProcessor._process_batch_output_use_zmq: first marks a RUNNING_PREFILL task that received a real "
        "token RUNNING_DECODE, then runs the host's method (hosts without RUNNING_DECODE: no change)",
        {NEW: "output/token_processor.py 341-(ZMQ path, no status change) vs 954-955 (get_output path sets it); "
              "resource_manager_v1.py 361 preempts only RUNNING_DECODE", OLD: "not applied (no split status)"},
        "on the new host only the compiled get_output path moves a request to RUNNING_DECODE; on the ZMQ path no "
        "request ever becomes preemptable and the scheduler logs 'no preemptable request can be found'. "
        "A host divergence between the two output paths, found by this harness",
        "yes (the output path)",
    ),
    Seam(
        "S10 cache transfer manager",
        "fastdeploy.cache_manager.prefix_cache_manager",
        "the script on the command line launch_cache_manager starts when num_cpu_blocks > 0: "
        "fdsched/serve/cachexfer.py (a CPU process speaking EngineCacheQueue) instead of "
        "cache_manager/cache_transfer_manager.py; the module's subprocess.Popen sees the host's own command with "
        "that one path replaced (same arguments, environment, log file and process group)",
        {NEW: "cache_manager/prefix_cache_manager.py 226-228 (py_path), 311-346 (the launch command and Popen), "
              "348-362 (waits on cache_transfer_inited_signal, cache_ready_signal, swap_space_ready_signal), "
              "370-371 (starts recv_data_transfer_result); the process: cache_transfer_manager.py 156-335 "
              "(__init__ signals), 774-820 (_init_cpu_cache), 1277-1331 (swap tasks answered with "
              "put_transfer_done_signal), 1442-1570 (do_data_transfer)",
         OLD: "cache_manager/prefix_cache_manager.py 218-222 (py_path), ~290-340 (launch command and Popen), "
              "~342-356 (waits), ~364 (receiver thread); cache_transfer_manager.py ~150-308 (__init__), "
              "~560-606 (_init_cpu_cache), 1192-1320 (do_data_transfer)"},
        "the real transfer manager allocates pinned host memory and copies KV blocks with GPU ops (cuda_host_alloc, "
        "swap_cache_all_layers); with a CPU tier configured the engine waits for it forever without one",
        "yes",
    ),
    Seam(
        "S12 cache messager (PD)",
        "fastdeploy.cache_manager.prefix_cache_manager",
        "the script on the command line launch_cache_messager starts on a prefill or decode instance: "
        "fdsched/serve/pdxfer.py instead of cache_manager/cache_messager.py (same arguments, log file "
        "launch_cache_messager_0.log, process group); the simulated worker of a prefill instance reports each slot's "
        "prefill progress per step to it, where the GPU attention kernels report it per layer",
        {NEW: "cache_manager/prefix_cache_manager.py 237 (splitwise only), 378-454 (launch_cache_messager: 393 path, "
              "443 Popen, 446 waits on cache_ready_signal); the process: cache_messager.py 462-933 (CacheMessagerV1: "
              "641 cache infos, 676-851 send and put_finished_req at 841, 853 consume_signals), 935-1084 (main, "
              "1065 cache_ready_signal); the engine waits at output/token_processor.py 639 (get_finished_req)",
         OLD: "prefix_cache_manager.py 231, 362-438 (377 path, 427 Popen, 430 wait); cache_messager.py 462-919 "
              "(637 cache infos, 671 put_finished_add_cache_task_req, 678-851, 841 put_finished_req, 853), 921-1070 "
              "(1051 cache_ready_signal); token_processor.py 524 (get_finished_req)"},
        "the real messager allocates the instance's KV cache on the GPU, reads the compiled get_output_kv_signal op and "
        "writes blocks over RDMA or CUDA IPC; on a PD instance the engine waits for it at start-up and the prefill "
        "engine waits for its transfer result before it hands a request to the decode instance",
        "yes",
    ),
    Seam(
        "S13 prefill answer on the ZMQ path (PD)",
        "fastdeploy.output.token_processor",
        "TokenProcessor._process_per_token / _process_batch_output_use_zmq on a prefill instance: a finished "
        "prefill's result is handed on to the engine's scheduler, as the get_output path does",
        {NEW: "output/token_processor.py 440-443 (ZMQ path: kept back unless the scheduler is 'splitwise') vs "
              "1099 (get_output path: always handed on); 283 _process_per_token",
         OLD: "output/token_processor.py 368-371 vs 964; 215 _process_per_token"},
        "without it the prefill api_server never answers a request on the ZMQ path, and the Router, which awaits both "
        "instances' answers for a non-streamed request, hangs; a divergence between the host's two output paths "
        "that this harness found",
        "yes (the output path)",
    ),
    Seam(
        "H2 RPC counter (harness only)",
        "fastdeploy.cache_manager.prefix_cache_manager",
        "multiprocessing.managers.BaseProxy._callmethod in the engine process, when FDSCHED_SERVE_COUNT_RPC=1: "
        "counts each manager round trip by the calling thread's name (the state probe H1 reports the counts)",
        {NEW: "added (no host line)", OLD: "added (no host line)"},
        "measures the CPU-cache transfer-done receiver's RPC rate (recv_data_transfer_result's thread) inside the "
        "served engine, host polling vs the plugin's blocking receiver",
        "no",
    ),
    Seam(
        "H3 schedule() timer (harness only)",
        "fastdeploy.engine.engine",
        "the rank's resource_manager.schedule, wrapped on the instance when FDSCHED_SERVE_TIME_SCHEDULE=1 (set "
        "when the state probe starts): per call the scheduler thread's CPU time (time.thread_time_ns) and wall "
        "time, split by whether the call scheduled anything; the state probe H1 reports them",
        {NEW: "added; the call it times: engine/common_engine.py 897 (_schedule_request_to_worker_v1)",
         OLD: "added; engine/common_engine.py 1080"},
        "the plugin's schedule() cost against the host's inside a served engine under load (same heap, threads, "
        "GIL contention as production), not in a bench process",
        "no",
    ),
    Seam(
        "S11 listen address",
        "uvicorn / fastdeploy.config",
        "in the api_server process: uvicorn.run's host for the metrics server (the host passes 0.0.0.0), and "
        "config.get_host_ip (the address the api_server registers with the Router) when FDSCHED_SERVE_HOST is "
        "not a wildcard; the api_server's own port follows its --host flag",
        {NEW: "entrypoints/openai/api_server.py 853 (metrics uvicorn.run host='0.0.0.0'); config.py 1746, 1993 "
              "(get_host_ip)", OLD: "entrypoints/openai/api_server.py (metrics uvicorn.run); config.py get_host_ip"},
        "a CPU rehearsal tool listens on loopback unless asked otherwise; the metrics port has no flag for it",
        "no",
    ),
    Seam(
        "H4 creation ledger (harness only)",
        "os / _posixshmem / socket / zmq",
        "os.open, _posixshmem.shm_open, socket.socket.bind and zmq.Socket.bind in every process of the stack: each "
        "/dev/shm entry a process creates (a lock file, a shared-memory segment, a unix or ZeroMQ ipc socket) is "
        "appended to the stack's ledger with its inode, after an intent record written before the call (a process "
        "killed between the two still leaves its entry known)",
        {NEW: "added (no host line)", OLD: "added (no host line)"},
        "the launcher removes exactly what its own processes created, never entries found by a name pattern",
        "no",
    ),
    Seam(
        "H5 exit watchers (harness only)",
        "fastdeploy.engine.engine / multi_api_server",
        "the worker launcher records how each worker ends (it is their only waiter); a thread per worker launcher "
        "(in the engine that starts it) and per api_server (in multi_api_server, whose subprocess.Popen is wrapped) "
        "waits on the child's own Popen object without reaping it first, and records rank, role, pid and exit "
        "status or signal in the state dir (no status when another waiter of that process took it)",
        {NEW: "added; multi_api_server.py 135 (Popen)", OLD: "added; multi_api_server.py Popen"},
        "only a process's parent learns how it ended; the launcher names the rank, role and signal of the first "
        "death and stops the stack",
        "no",
    ),
    Seam(
        "H6 drain gate (harness only)",
        "starlette.applications",
        "Starlette.build_middleware_stack in the api_server process: the app is wrapped in a gate that, once the "
        "launcher asks for a drain, answers new POST /v1/* with 503 and, once it asks for an abort, ends each "
        "completion still in flight with an error event (streams) or a 503",
        {NEW: "added (no host line)", OLD: "added (no host line)"},
        "Ctrl-C / SIGTERM stop admitting, let requests in flight finish, then end the rest readably",
        "no",
    ),
    Seam(
        "H1 state probe (harness only)",
        "fastdeploy.engine.engine",
        "a daemon thread in each rank's engine process (LLMEngine on rank 0, ExpertService.start on ranks > 0 "
        "under multi_api_server) answering state requests through files in FDSCHED_SERVE_STATE_DIR",
        {NEW: "added; wraps engine/expert_service.py ExpertService.start (~101)", OLD: "added; expert_service.py start"},
        "tests read the engine's own cache-manager block accounting and what an open schedule() pass still "
        "expects of a block check, from the live process",
        "no",
    ),
    Seam(
        "H7 late finishes (harness only)",
        "fastdeploy.engine.engine",
        "with FDSCHED_SERVE_FINISH_DELAY_MS > 0, each finish the token processor hands to the scheduler's "
        "finish pool (finish_requests_async) runs that much later on the same pool",
        {NEW: "added; wraps the resource manager's finish_requests_async (resource_manager_v1.py ~1632)",
         OLD: "added; resource_manager_v1.py finish_requests_async (~1494)"},
        "stands for a busy finish pool under load: a finished request stays in running long enough to be "
        "preempted, the ordering that can finish a request twice (tests/engine/test_served.py)",
        "no",
    ),
)


def seam_table(host_prefix: str = NEW) -> str:
    rows = [f"| {s.id} | {s.lines.get(host_prefix, '?')} | {s.why} |" for s in SEAMS]
    return "\n".join(["| seam | host lines | why |", "|---|---|---|"] + rows)


# ---------------------------------------------------------------------------------------------- the code

def _sim_platform():
    from fastdeploy.platforms.cpu import CPUPlatform

    class SimulatedCudaPlatform(CPUPlatform):
        """A CPU platform that claims CUDA for configuration decisions only."""

        def is_cuda(self):
            return True

    return SimulatedCudaPlatform()


def _s1(module):
    module.current_platform = _sim_platform()


def _s3_s6(module):
    def _get_kv_cache_shape(self, max_block_num):
        model = self.config.model_config
        tp = self.config.parallel_config.tensor_parallel_size
        heads = max(1, int(model.num_key_value_heads) // tp)
        shape = [max_block_num, heads, self.config.cache_config.block_size, model.head_dim]
        return shape, list(shape)

    module.PrefixCacheManager._get_kv_cache_shape = _get_kv_cache_shape
    if getattr(module, "get_all_visible_devices", None) is None:
        module.get_all_visible_devices = lambda: "CUDA_VISIBLE_DEVICES=0"
    _s10(module)
    _h2_count_rpcs()


class _TransferManagerLauncher:
    """Stands for the ``subprocess`` module inside prefix_cache_manager (S10): Popen of a command that runs the
    host's cache_transfer_manager.py runs the simulated one with the same arguments; all else is subprocess."""

    HOST_SCRIPT = os.sep + os.path.join("cache_manager", "cache_transfer_manager.py")
    HOST_MESSAGER = os.sep + os.path.join("cache_manager", "cache_messager.py")  # S12

    def __init__(self, real, script):
        self._real, self._script = real, script
        self._messager = os.path.join(os.path.dirname(script), "pdxfer.py")

    def Popen(self, cmd, *args, **kwargs):  # noqa: N802 (the subprocess name)
        if isinstance(cmd, str) and (self.HOST_SCRIPT in cmd or self.HOST_MESSAGER in cmd):
            words = cmd.split(" ")
            words = [self._script if w.endswith(self.HOST_SCRIPT) else self._messager if w.endswith(self.HOST_MESSAGER)
                     else w for w in words]
            cmd = " ".join(words)
        return self._real.Popen(cmd, *args, **kwargs)

    def __getattr__(self, item):
        return getattr(self._real, item)


def _s10(module):
    script = os.environ.get(XFER_ENV)
    if script and not isinstance(module.subprocess, _TransferManagerLauncher):
        module.subprocess = _TransferManagerLauncher(module.subprocess, script)


RPC_COUNTS: dict = {}
_RPC_LOCK = threading.Lock()


def _h2_count_rpcs():
    if os.environ.get(RPC_COUNT_ENV) != "1":
        return
    from multiprocessing import managers

    original = managers.BaseProxy._callmethod
    if getattr(original, "_fdsched_counting", False):
        return

    def _callmethod(self, methodname, args=(), kwds={}):  # noqa: B006 (the host's signature)
        name = threading.current_thread().name
        with _RPC_LOCK:
            RPC_COUNTS[name] = RPC_COUNTS.get(name, 0) + 1
        return original(self, methodname, args, kwds)

    _callmethod._fdsched_counting = True
    managers.BaseProxy._callmethod = _callmethod


def _s4(module):
    def _post_init(self):
        self.is_unified_ckpt = False
        self.runner_type = "generate"
        self.convert_type = "none"
        self.supported_tasks = ["generate"]
        self.is_reasoning_model = False
        self.enable_mm = False
        self.kv_cache_quant_scale_path = os.path.join(self.model, "kv_cache_scale.json")
        self._architecture = self.architectures[0]
        self.pooler_config = None
        self.override_name_from_config()
        self.read_from_env()
        self.read_model_config()
        from fastdeploy.plugins.model_register import load_model_register_plugins

        load_model_register_plugins()  # FastDeploy's loader: loads fdsched only when FD_PLUGINS names it

    module.ModelConfig._post_init = _post_init


def _s5_fallback(module):
    def get_eos_token_id(tokenizer, generation_config=None):
        ids = []
        if generation_config is not None and getattr(generation_config, "eos_token_id", None) is not None:
            eos = generation_config.eos_token_id
            ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        if not ids and tokenizer.eos_token_id is not None:
            ids = [tokenizer.eos_token_id]
        return ids

    module.get_eos_token_id = get_eos_token_id


def _s7(module):
    if _main_module() == MAIN_ENV_MULTI:
        module._current_platform = _sim_platform()


def _s8(module):
    original = module.TokenProcessor.process_sampling_results_use_zmq

    def process_sampling_results_use_zmq(self):
        if self.cfg.parallel_config.local_data_parallel_id == 0:
            return original(self)
        while True:  # rank > 0: the same three steps the host runs on rank 0
            datas = self.zmq_server.recv_pyobj()
            try:
                self._reschedule_preempt_task_use_zmq(datas)
                self.postprocess(self._process_batch_output_use_zmq(datas))
            except Exception as exc:  # as the host's loop: log and go on
                print(f"[fdsched-serve] output reader rank>0: {exc!r}", file=sys.stderr, flush=True)

    module.TokenProcessor.process_sampling_results_use_zmq = process_sampling_results_use_zmq

    # S9: the decode status on the ZMQ path (hosts that split RUNNING into RUNNING_PREFILL / RUNNING_DECODE)
    from fastdeploy.engine.request import RequestStatus

    if not hasattr(RequestStatus, "RUNNING_DECODE"):
        return
    original_batch = module.TokenProcessor._process_batch_output_use_zmq

    def _process_batch_output_use_zmq(self, receive_datas):
        rm = self.resource_manager
        for data in receive_datas:
            tokens = data.tokens
            if tokens is None or len(tokens) == 0 or tokens[-1] < 0 or rm.stop_flags[data.batch_id]:
                continue
            task = rm.tasks_list[data.batch_id]
            if task is not None and task.status == RequestStatus.RUNNING_PREFILL:
                task.status = RequestStatus.RUNNING_DECODE  # what the get_output path does on a real token
        return original_batch(self, receive_datas)

    module.TokenProcessor._process_batch_output_use_zmq = _process_batch_output_use_zmq


def _s13(module):
    """S13: on a prefill instance, the ZMQ output path hands a finished prefill's result to the engine's scheduler,
    as the get_output path does. The host's ZMQ path keeps it back unless the scheduler is the old splitwise one, so
    the prefill api_server never answers and the Router, which waits for both answers, hangs."""
    tp = module.TokenProcessor
    per_token, batch = tp._process_per_token, tp._process_batch_output_use_zmq

    def _process_per_token(self, task, batch_id, token_ids, result, is_prefill):
        out = per_token(self, task, batch_id, token_ids, result, is_prefill)
        if is_prefill and out is not None and getattr(out, "finished", False) \
                and self.cfg.scheduler_config.name != "splitwise":
            self.__dict__.setdefault("_fdsched_prefill_results", []).append(out)
        return out

    def _process_batch_output_use_zmq(self, receive_datas):
        held = self.__dict__.setdefault("_fdsched_prefill_results", [])
        results = batch(self, receive_datas)
        if held:
            results = list(results or []) + [r for r in held if all(r is not x for x in (results or []))]
            held.clear()
        return results

    tp._process_per_token = _process_per_token
    tp._process_batch_output_use_zmq = _process_batch_output_use_zmq


# S2 + H1 ----------------------------------------------------------------------------------------

def _start_simulated_worker(self):
    """Stands for LLMEngine._start_worker_service: one simulated worker per data-parallel rank.

    As ``paddle.distributed.launch --devices 0,1`` does, the LLMEngine (rank 0's, also under
    multi_api_server, where ranks > 0 run an ExpertService that launches no worker) starts the workers of
    every rank through one launcher process (``worklaunch.py``); they share its process group, and the engine
    reads the launcher's stdout.
    """
    cfg = self.cfg
    pc = cfg.parallel_config
    log_dir = os.getenv("FD_LOG_DIR", "log")
    os.makedirs(log_dir, exist_ok=True)
    eos = list(self.engine.data_processor.eos_token_ids)
    workers = []
    for rank in range(int(pc.data_parallel_size)):
        cmd = [
            sys.executable, "-u", os.environ[WORKER_ENV],
            "--engine-pid", str(pc.engine_worker_queue_port[0]),
            "--queue-port", str(pc.engine_worker_queue_port[rank]),
            "--dp-rank", str(rank),
            "--dp-size", str(pc.data_parallel_size),
            "--ready-slots", str(cfg.worker_num_per_node),
            "--eos", ",".join(map(str, eos)),
            "--do-profile", str(int(bool(self.do_profile))),
            "--profile-blocks", str(cfg.cache_config.num_gpu_blocks_override or 0),
            "--multi-api-server", str(int(os.getenv("FD_ENABLE_MULTI_API_SERVER", "0") == "1")),
            "--pod-ip", str(cfg.master_ip),
            "--splitwise-role", str(getattr(cfg.scheduler_config, "splitwise_role", "mixed")),
        ]
        workers.append({"rank": rank, "cmd": cmd, "log": os.path.join(log_dir, f"simworker_rank{rank}.log")})
    # One launcher process for every rank's worker, as paddle.distributed.launch on a GPU machine: the engine
    # reads its stdout (rank 0's worker's) and polls it; it is the one waiter for the workers' exit statuses
    # (this process's gunicorn arbiter reaps any child of its own with waitpid(-1) and drops their statuses).
    env = dict(os.environ, FDSCHED_SERVE_WORKERS=json.dumps(workers))
    err = open(os.path.join(log_dir, "simworker_launch.log"), "ab")
    script = os.path.join(os.path.dirname(os.environ[WORKER_ENV]), "worklaunch.py")
    first = subprocess.Popen([sys.executable, "-u", script], stdout=subprocess.PIPE, stderr=err, env=env,
                             process_group=0)
    watch_exit(first, "worker launcher", 0)
    _start_state_probe(self, int(getattr(pc, "local_data_parallel_id", 0) or 0))
    return first


def _s2(module):
    module.LLMEngine._start_worker_service = _start_simulated_worker


def _h1_expert_service(module):
    original = module.ExpertService.start

    def start(self, *args, **kwargs):
        ok = original(self, *args, **kwargs)
        _start_state_probe(self, int(self.cfg.parallel_config.local_data_parallel_id or 0))
        return ok

    module.ExpertService.start = start


def _host_locks(rm, cm) -> list:
    """The host's own locks in the host's order: the scheduler holds ``rm.lock`` when it calls into the cache
    manager (allocation, release), which takes ``request_release_lock`` and, inside it, ``cache_status_lock``
    (prefix match, ``cache_output_blocks``); the transfer receiver takes ``cache_status_lock`` alone to land a
    swap result (``_handle_swap_result``: node status, node block id, recycled block). Held in this order, no
    host thread can be half-way through any of those while the probe reads."""
    found = [("resource_manager.lock", getattr(rm, "lock", None)),
             ("cache_manager.request_release_lock", getattr(cm, "request_release_lock", None)),
             ("cache_manager.cache_status_lock", getattr(cm, "cache_status_lock", None))]
    return [(name, lock) for name, lock in found if lock is not None]


LOCK_WAIT_S = 30.0  # a host thread holding one of its locks this long is stuck; the probe says so


def engine_state(llm_engine) -> dict:
    """The engine's own block accounting and the plugin's pending block-check signals (H1), read as one picture
    under the host's locks (:func:`_host_locks`). A swap-out the host's eviction thread has in flight holds none of
    those locks; its nodes show as ``in_transit`` and ``evicting`` is true until it lands."""
    rm = llm_engine.engine.resource_manager
    cm = rm.cache_manager
    held = []
    try:
        for name, lock in _host_locks(rm, cm):
            if not lock.acquire(timeout=LOCK_WAIT_S):
                raise TimeoutError(f"the host held {name} for more than {LOCK_WAIT_S:.0f} s")
            held.append(lock)
        return _engine_state_locked(rm, cm)
    finally:
        for lock in reversed(held):
            lock.release()


def _future_running(future) -> bool:
    return future is not None and not future.done()


def _engine_state_locked(rm, cm) -> dict:
    free = list(cm.gpu_free_block_list)
    tree, cpu_tree, other, nodes = [], [], [], []
    stack = [getattr(cm, "radix_tree_root", None)]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if getattr(node, "block_id", None) is not None and node is not cm.radix_tree_root:
            status = getattr(getattr(node, "cache_status", None), "name", "GPU")
            # a node's block_id is a GPU block while it is on the GPU, a CPU block once swapped out (host's
            # BlockNode); a node in transit (SWAP2CPU / SWAP2GPU) is reported apart
            (tree if status == "GPU" else cpu_tree if status == "CPU" else other).append(
                node.block_id if status in ("GPU", "CPU") else f"{status}:{node.block_id}")
            nodes.append({"node": getattr(node, "node_id", None), "status": status, "block": node.block_id,
                          "shared": getattr(node, "shared_count", None)})
        stack.extend(getattr(node, "children", {}).values())
    held = []
    for req in list(getattr(rm, "requests", {}).values()):
        held.extend(getattr(req, "block_tables", []) or [])
    desk = getattr(cm, "_fdsched_plans", None)  # the scheduler's plan slot (fdsched.patches._plan.PlanSlot)
    return {
        "rm_class": type(rm).__name__, "cm_class": type(cm).__name__,
        "total": int(cm.num_gpu_blocks), "free": free, "tree_blocks": tree, "request_blocks": held,
        "cpu_total": int(getattr(cm, "num_cpu_blocks", 0) or 0),
        "cpu_free": list(getattr(cm, "cpu_free_block_list", []) or []), "cpu_tree_blocks": cpu_tree,
        "in_transit": other, "tree_nodes": nodes, "rpc_counts": dict(RPC_COUNTS), "time": time.monotonic(),
        "schedule_times": schedule_time_summary(),
        "running": len(getattr(rm, "running", [])), "waiting": len(getattr(rm, "waiting", [])),
        "requests": len(getattr(rm, "requests", {})),
        "evicting": _future_running(getattr(cm, "gpu_free_task_future", None))
        or _future_running(getattr(cm, "cpu_free_future", None)),
        "pending_signals": [repr(p) for p in (desk.pending() if desk is not None else ())],
    }


SCHEDULE_TIMES: dict = {"busy_cpu_ns": [], "busy_wall_ns": [], "idle_calls": 0, "idle_cpu_ns": 0}


def _h3_time_schedule(llm_engine) -> None:
    if os.environ.get(TIME_SCHEDULE_ENV) != "1":
        return
    rm = llm_engine.engine.resource_manager
    original = rm.schedule  # the bound method (the plugin's, or the host's under the baseline profile)
    limit = 200_000

    def schedule(*args, **kwargs):
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        out = original(*args, **kwargs)
        cpu, wall = time.thread_time_ns() - c0, time.perf_counter_ns() - w0
        scheduled = isinstance(out, tuple) and bool(out[0])
        if scheduled:
            if len(SCHEDULE_TIMES["busy_cpu_ns"]) < limit:
                SCHEDULE_TIMES["busy_cpu_ns"].append(cpu)
                SCHEDULE_TIMES["busy_wall_ns"].append(wall)
        else:
            SCHEDULE_TIMES["idle_calls"] += 1
            SCHEDULE_TIMES["idle_cpu_ns"] += cpu
        return out

    rm.schedule = schedule


def schedule_time_summary() -> dict:
    """Per-call figures of the timed schedule() calls that scheduled something (µs), and the idle calls."""
    cpu = sorted(SCHEDULE_TIMES["busy_cpu_ns"])
    wall = sorted(SCHEDULE_TIMES["busy_wall_ns"])
    if not cpu:
        return {"calls": 0, "idle_calls": SCHEDULE_TIMES["idle_calls"]}

    def q(xs, f):
        return xs[min(len(xs) - 1, int(f * len(xs)))] / 1000.0

    idle = SCHEDULE_TIMES["idle_calls"]
    return {"calls": len(cpu), "cpu_us_mean": sum(cpu) / len(cpu) / 1000.0, "cpu_us_p50": q(cpu, 0.5),
            "cpu_us_p90": q(cpu, 0.9), "cpu_us_p99": q(cpu, 0.99), "wall_us_mean": sum(wall) / len(wall) / 1000.0,
            "wall_us_p50": q(wall, 0.5), "wall_us_p99": q(wall, 0.99), "idle_calls": idle,
            "idle_cpu_us_mean": SCHEDULE_TIMES["idle_cpu_ns"] / idle / 1000.0 if idle else 0.0}


def _h7_late_finishes(llm_engine) -> None:
    try:
        delay = float(os.environ.get(FINISH_DELAY_ENV) or 0) / 1000.0
    except ValueError:
        delay = 0.0
    rm = llm_engine.engine.resource_manager
    pool = getattr(rm, "finish_execution_pool", None)
    if delay <= 0 or pool is None:
        return

    def finish_requests_async(request_ids):
        def later():
            time.sleep(delay)
            return rm.finish_requests(request_ids)

        return pool.submit(later)

    rm.finish_requests_async = finish_requests_async


def _start_state_probe(llm_engine, dp_rank: int) -> None:
    _h3_time_schedule(llm_engine)
    _h7_late_finishes(llm_engine)
    state_dir = os.environ.get(STATE_ENV)
    if not state_dir:
        return

    def loop():
        ask = os.path.join(state_dir, f"ask-rank{dp_rank}")
        answer = os.path.join(state_dir, f"state-rank{dp_rank}.json")
        while True:
            if os.path.exists(ask):
                try:
                    state = engine_state(llm_engine)
                except Exception as exc:  # report, never crash the engine
                    state = {"error": repr(exc)}
                tmp = answer + ".tmp"
                with open(tmp, "w") as fh:
                    json.dump(state, fh)
                os.replace(tmp, answer)
                os.remove(ask)
            time.sleep(0.05)

    threading.Thread(target=loop, name="fdsched-serve-state-probe", daemon=True).start()


# S11 -------------------------------------------------------------------------------------------

def _listen_host() -> str:
    return os.environ.get(HOST_ENV, "")


def _s11_uvicorn(module):
    host = _listen_host()
    if not host or _main_module() != MAIN_API_SERVER or getattr(module.run, "_fdsched", False):
        return
    real = module.run

    def run(app, *args, **kwargs):
        if kwargs.get("host") == "0.0.0.0":
            kwargs["host"] = host
        return real(app, *args, **kwargs)

    run._fdsched = True
    module.run = run


def _s11_host_ip(module):
    host = _listen_host()
    if host and host not in ("0.0.0.0", "::") and hasattr(module, "get_host_ip"):
        module.get_host_ip = lambda: host


# H4 --------------------------------------------------------------------------------------------

def _ledger_write(rec: dict) -> None:
    """Append one record to the stack's ledger (one write, O_APPEND, so records of concurrent processes do not mix)."""
    state_dir = os.environ.get(STATE_ENV)
    if not state_dir:
        return
    line = json.dumps(dict(rec, pid=os.getpid())) + "\n"
    try:
        fd = _REAL_OS_OPEN(os.path.join(state_dir, SHM_LEDGER), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def record_created(path: str, ino: int) -> None:
    """Append one /dev/shm entry this process created to the stack's ledger."""
    _ledger_write({"path": path, "ino": ino})


def _inode_or_none(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _creating(path: str, kind: str, create, inode_of=None):
    """Run ``create()``, which may make the /dev/shm entry ``path`` (``kind``: "socket" or "file"), and record the
    entry's inode (``inode_of(create())``, default: the inode at ``path``) in the ledger; returns what ``create``
    returned. An intent record is written first: a process can end between the entry appearing and its record
    (SIGKILL, or a daemon thread stopped at interpreter exit while the call had let go of the GIL), and the intent,
    with the inode that was at the path before, lets the launcher still know the entry as its own. A call that fails
    is closed in the ledger too."""
    if not os.environ.get(STATE_ENV):
        return create()
    _ledger_write({"intent": path, "kind": kind, "before": _inode_or_none(path)})
    try:
        out = create()
    except BaseException:
        _ledger_write({"failed": path})
        raise
    ino = _inode_or_none(path) if inode_of is None else inode_of(out)
    if ino is not None:
        record_created(path, ino)
    return out


def _fd_inode(fd: int) -> int:
    return os.fstat(fd).st_ino


_REAL_OS_OPEN = os.open
SHM_DIR = "/dev/shm/"


def _h4_record_creations() -> None:
    """Shared-memory segments (``_posixshmem.shm_open``), files (``os.open``, e.g. the host's IPCLock) and unix
    sockets (``socket.bind``) created under /dev/shm by this process go into the ledger."""
    if getattr(os.open, "_fdsched", False):
        return

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        text = os.fspath(path) if isinstance(path, (str, bytes, os.PathLike)) else ""
        text = os.fsdecode(text) if isinstance(text, bytes) else text
        watched = dir_fd is None and text.startswith(SHM_DIR) and flags & os.O_CREAT
        existed = watched and not flags & os.O_EXCL and os.path.exists(text)
        if not watched or existed:
            return _REAL_OS_OPEN(path, flags, mode, dir_fd=dir_fd)
        return _creating(text, "file", lambda: _REAL_OS_OPEN(path, flags, mode, dir_fd=dir_fd), _fd_inode)

    os_open._fdsched = True
    os.open = os_open
    try:
        import _posixshmem
    except ImportError:
        return
    real_open = _posixshmem.shm_open

    def shm_open(path, flags, mode=0o777):
        full = "/dev/shm/" + str(path).lstrip("/")
        existed = bool(flags & os.O_CREAT) and not flags & os.O_EXCL and os.path.exists(full)
        if not flags & os.O_CREAT or existed:
            return real_open(path, flags, mode=mode)
        return _creating(full, "file", lambda: real_open(path, flags, mode=mode), _fd_inode)

    shm_open._fdsched = True
    _posixshmem.shm_open = shm_open
    real_bind = socket.socket.bind

    def bind(self, address):
        path = os.fsdecode(address) if self.family == socket.AF_UNIX and isinstance(address, (str, bytes)) else ""
        if not path.startswith(SHM_DIR):
            return real_bind(self, address)
        return _creating(path, "socket", lambda: real_bind(self, address))

    socket.socket.bind = bind


def _h4_record_zmq(module) -> None:
    """ZeroMQ ipc endpoints under /dev/shm (``ipc:///dev/shm/...``), created by libzmq at bind."""
    if not os.environ.get(STATE_ENV):
        return
    cls = module.Socket
    real = cls.bind
    if getattr(real, "_fdsched", False):
        return

    def bind(self, addr, *args, **kwargs):
        text = addr.decode() if isinstance(addr, bytes) else str(addr)
        if not text.startswith("ipc://" + SHM_DIR):
            return real(self, addr, *args, **kwargs)
        path = text[len("ipc://"):]
        return _creating(path, "socket", lambda: real(self, addr, *args, **kwargs))

    bind._fdsched = True
    cls.bind = bind


# H5 --------------------------------------------------------------------------------------------

_WATCHED: list = []  # the Popen objects watched: referenced, so that no garbage-collected Popen is reaped by
# subprocess's own _cleanup() (run at every later Popen) before its watcher learns the status


def exit_status(proc) -> Optional[int]:
    """How the child ``proc`` ended -- its exit code, or minus the signal that killed it -- waiting for it without
    reaping it first (``waitid(..., WNOWAIT)``). None when its status is lost: another waiter of this process reaped
    it first (the api_server's gunicorn arbiter reaps any child with ``waitpid(-1)``), and a ``Popen.wait`` would
    then report a made-up 0."""
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # reaped already: by this very Popen in another thread (its return code is right)
        for _ in range(20):  # ... which sets it a moment after its waitpid returns
            if proc.returncode is not None:
                return proc.returncode
            time.sleep(0.01)
        return None  # or by another waiter: the status is gone
    except (OSError, AttributeError):  # no waitid here: what Popen learns
        info = None
    code = None
    if info is not None:
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        code = -info.si_status if killed else info.si_status
    try:
        reaped = proc.wait()  # reap it (or read the status the object already has)
    except Exception:  # noqa: BLE001
        reaped = None
    return code if code is not None else reaped


def _worklaunch():
    """The worker launcher's module (``worklaunch.py`` beside this file, loaded by its path as this file is): its
    ``record_exit`` writes every exit record of the stack."""
    module = sys.modules.get("_fdsched_serve_worklaunch")
    if module is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "_fdsched_serve_worklaunch", os.path.join(os.path.dirname(os.path.abspath(__file__)), "worklaunch.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["_fdsched_serve_worklaunch"] = module
    return module


def watch_exit(proc, role: str, rank) -> None:
    """Record how the child ``proc`` (a ``subprocess.Popen``) ends -- exit code, or minus the signal -- in the state
    dir (:func:`exit_status`)."""
    state_dir = os.environ.get(STATE_ENV)
    if not state_dir:
        return
    _WATCHED.append(proc)
    record_exit = _worklaunch().record_exit  # loaded now, not while the process is going down

    def wait():
        try:
            code = exit_status(proc)
        except Exception:  # noqa: BLE001 (the death is still recorded, without its status)
            code = None
        record_exit(proc.pid, role, rank, code)

    threading.Thread(target=wait, name=f"fdsched-serve-watch-{role}-{rank}", daemon=True).start()


def _h5_watch_api_servers() -> None:
    """In multi_api_server: every api_server it spawns gets an exit watcher (H5)."""
    real = subprocess.Popen
    if getattr(real, "_fdsched", False):
        return

    class WatchedPopen(real):
        _fdsched = True

        def __init__(self, args, *more, **kwargs):
            super().__init__(args, *more, **kwargs)
            words = list(args) if isinstance(args, (list, tuple)) else str(args).split()
            words = [str(w) for w in words]
            if "fastdeploy.entrypoints.openai.api_server" in words:
                rank = None
                if "--local-data-parallel-id" in words:
                    rank = words[words.index("--local-data-parallel-id") + 1]
                watch_exit(self, "api_server", rank)

    subprocess.Popen = WatchedPopen


# H6 --------------------------------------------------------------------------------------------

DRAIN_DIR = "drain"  # in the state dir: "requested", "abort" (the launcher's), "<pid>.json" (each gate's counts)
SHUTDOWN_ERROR = {"message": "the server is shutting down: it finished what it could and ended this request",
                  "type": "server_shutdown", "code": 503}
REFUSED_ERROR = {"message": "the server is shutting down: not admitting new requests", "type": "server_shutdown",
                 "code": 503}


class _GateState:
    """One per api_server process: requests in flight and what the drain did, shared with the launcher."""

    def __init__(self, state_dir: str):
        self.dir = os.path.join(state_dir, DRAIN_DIR)
        self.in_flight = self.finished = self.ended = self.refused = 0
        self.draining = self.aborting = self.closed = False
        self._written = None
        self._abort_events = {}  # event loop -> asyncio.Event set when the launcher asks for the abort
        self._write()
        threading.Thread(target=self._poll, name="fdsched-serve-drain-gate", daemon=True).start()

    def _write(self):
        data = {"pid": os.getpid(), "draining": self.draining, "in_flight": self.in_flight,
                "finished": self.finished, "ended": self.ended, "refused": self.refused}
        if data == self._written:
            return
        path = os.path.join(self.dir, f"{os.getpid()}.json")
        try:
            with open(path + ".tmp", "w") as fh:
                json.dump(data, fh)
            os.replace(path + ".tmp", path)
            self._written = data
        except OSError:
            pass

    def abort_event(self) -> "asyncio.Event":
        """The running loop's event for the abort (one per loop; set at once if the abort came already)."""
        loop = asyncio.get_running_loop()
        event = self._abort_events.get(loop)
        if event is None:
            event = self._abort_events[loop] = asyncio.Event()
            if self.aborting:
                event.set()
        return event

    def _poll(self):
        while not self.closed:
            if not self.draining and os.path.exists(os.path.join(self.dir, "requested")):
                self.draining = True
            if self.draining and not self.aborting and os.path.exists(os.path.join(self.dir, "abort")):
                self.aborting = True
                for loop, event in list(self._abort_events.items()):
                    try:
                        loop.call_soon_threadsafe(event.set)
                    except RuntimeError:  # that loop is closed
                        pass
            self._write()
            time.sleep(0.05)


_GATE = {}


async def _send_json(send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class _DrainGate:
    """ASGI wrapper of the api_server's app (H6); only POST /v1/* passes through it."""

    def __init__(self, app, state_dir: str):
        self.app, self.state_dir = app, state_dir

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST" or not scope.get("path", "").startswith("/v1/"):
            return await self.app(scope, receive, send)
        if "gate" not in _GATE:
            _GATE["gate"] = _GateState(self.state_dir)
        st = _GATE["gate"]
        if st.draining:
            st.refused += 1
            return await _send_json(send, 503, {"error": REFUSED_ERROR})
        st.in_flight += 1
        sent = {"start": False, "done": False, "stream": False, "cut": False}

        async def tracking_send(message):
            if sent["cut"]:  # ended by the drain: what the app sends while it unwinds (e.g. its [DONE]) is dropped
                return
            if message["type"] == "http.response.start":
                sent["start"] = True
                headers = dict((bytes(k).lower(), bytes(v)) for k, v in message.get("headers", []))
                sent["stream"] = b"text/event-stream" in headers.get(b"content-type", b"")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["done"] = True
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, tracking_send))
        abort = asyncio.ensure_future(st.abort_event().wait())
        outcome = "finished"
        try:  # no polling: woken by the request's end or by the abort
            done, _ = await asyncio.wait({task, abort}, return_when=asyncio.FIRST_COMPLETED)
            if task in done or sent["done"]:  # finished (perhaps its last byte went out just as the abort came)
                return await task
            outcome = "ended"
            sent["cut"] = True
            task.cancel()
            await asyncio.wait({task}, timeout=2)
            if sent["start"]:
                event = b"data: " + json.dumps({"error": SHUTDOWN_ERROR}).encode() + b"\n\n"
                if sent["stream"]:
                    event += b"data: [DONE]\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": False})
            else:
                await _send_json(send, 503, {"error": SHUTDOWN_ERROR})
            return None
        finally:
            abort.cancel()
            st.in_flight -= 1
            if outcome == "ended":
                st.ended += 1
            elif st.draining:
                st.finished += 1


def _h6_drain_gate(module):
    """Wrap the middleware stack of every ASGI app class the module defines (Starlette, and FastAPI, which
    overrides ``build_middleware_stack``) in the api_server process."""
    state_dir = os.environ.get(STATE_ENV)
    if not state_dir or _main_module() != MAIN_API_SERVER:
        return
    for cls in (getattr(module, "Starlette", None), getattr(module, "FastAPI", None)):
        real = None if cls is None else cls.__dict__.get("build_middleware_stack")
        if real is None or getattr(real, "_fdsched", False):
            continue

        def build_middleware_stack(self, _real=real):
            stack = _real(self)
            return stack if isinstance(stack, _DrainGate) else _DrainGate(stack, state_dir)

        build_middleware_stack._fdsched = True
        cls.build_middleware_stack = build_middleware_stack


def request_drain(state_dir: str) -> None:
    """The launcher: every api_server's gate stops admitting (answers 503) from now on."""
    open(os.path.join(state_dir, DRAIN_DIR, "requested"), "w").close()


def request_abort(state_dir: str) -> None:
    """The launcher: every api_server's gate ends what is still in flight with an error event."""
    open(os.path.join(state_dir, DRAIN_DIR, "abort"), "w").close()


def drain_counts(state_dir: str, wait_ack: float = 1.0) -> dict:
    """Sum of every gate's counts; after a drain request, waits up to ``wait_ack`` s for each gate to see it."""
    directory = os.path.join(state_dir, DRAIN_DIR)
    deadline = time.monotonic() + wait_ack
    requested = os.path.exists(os.path.join(directory, "requested"))
    while True:
        gates = []
        for name in os.listdir(directory):
            if name.endswith(".json"):
                try:
                    with open(os.path.join(directory, name)) as fh:
                        gates.append(json.load(fh))
                except (OSError, ValueError):
                    pass
        if not requested or all(g["draining"] for g in gates) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return {key: sum(g[key] for g in gates) for key in ("in_flight", "finished", "ended", "refused")}


# ---------------------------------------------------------------------------------------------- the hook

_AFTER_LOAD = {
    "fastdeploy.engine.args_utils": [_s1],
    "fastdeploy.engine.engine": [_s2],
    "fastdeploy.engine.expert_service": [_h1_expert_service],
    "fastdeploy.cache_manager.prefix_cache_manager": [_s3_s6],
    "fastdeploy.config": [_s4, _s11_host_ip],
    "uvicorn": [_s11_uvicorn],
    "starlette.applications": [_h6_drain_gate],
    "fastapi.applications": [_h6_drain_gate],
    "zmq": [_h4_record_zmq],
    "fastdeploy.platforms": [_s7],
    "fastdeploy.output.token_processor": [_s8, _s13],
}
_ON_IMPORT_ERROR = {"paddleformers.trl.llm_utils": _s5_fallback, "paddleformers.cli.utils.llm_utils": _s5_fallback}


def _main_module() -> str:
    argv = list(getattr(sys, "orig_argv", []))
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        return argv[argv.index("-m") + 1]
    return ""


class _SeamLoader(importlib.abc.Loader):
    def __init__(self, real, name):
        self._real, self._name = real, name

    def create_module(self, spec):
        return self._real.create_module(spec)

    def exec_module(self, module):
        if self._name in _ON_IMPORT_ERROR:
            try:
                self._real.exec_module(module)
            except ImportError:
                _ON_IMPORT_ERROR[self._name](module)
            return
        self._real.exec_module(module)
        for patch in _AFTER_LOAD[self._name]:
            patch(module)

    def __getattr__(self, item):  # get_code, get_source, is_package ... from the real loader
        return getattr(self._real, item)


class _SeamFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _AFTER_LOAD and name not in _ON_IMPORT_ERROR:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _SeamLoader(spec.loader, name)
                return spec
        return None


def install() -> bool:
    """Install the import hook in this process when ``FDSCHED_SERVE_SEAMS=1``; True when installed."""
    if os.environ.get(ENABLE_ENV) != "1":
        return False
    if not any(isinstance(f, _SeamFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SeamFinder())
        os.environ.setdefault("FD_USE_GET_SAVE_OUTPUT_V1", "1")
        os.environ.setdefault("ENABLE_V1_KVCACHE_SCHEDULER", "1")
        if os.environ.get(STATE_ENV):
            _h4_record_creations()
            if _main_module() == MAIN_ENV_MULTI:
                _h5_watch_api_servers()
    return True


SITECUSTOMIZE = '''\
# Written by fdsched serve: installs the served engine's seams (see {path}). Only on the served stack's PYTHONPATH.
import os as _os
if _os.environ.get("{env}") == "1":
    import importlib.util as _u
    _spec = _u.spec_from_file_location("_fdsched_serve_seams", {path!r})
    _mod = _u.module_from_spec(_spec)
    import sys as _sys
    _sys.modules["_fdsched_serve_seams"] = _mod
    _spec.loader.exec_module(_mod)
    _mod.install()
'''


def write_sitecustomize(directory: str) -> str:
    path = os.path.join(directory, "sitecustomize.py")
    with open(path, "w") as fh:
        fh.write(SITECUSTOMIZE.format(path=os.path.abspath(__file__), env=ENABLE_ENV))
    return path

"""Every seam as data: what it replaces, the host lines it stands for on both supported hosts, why it is needed
and whether a GPU machine needs it too (:data:`SEAMS`; docs/engine.md prints the table)."""

from __future__ import annotations

from dataclasses import dataclass


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
        "on a host with the split running status only the compiled get_output path moves a request to RUNNING_DECODE; on the ZMQ path no "
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

"""The seams of the engine process: S2 starts the simulated workers in place of the GPU workers, H1 answers the
launcher's state probe (the engine's block accounting, read under the host's locks), H2 counts the manager RPCs
per thread, H3 times every ``schedule()`` call, H7 delays the finishes on the host's finish pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from .env import FINISH_DELAY_ENV, RPC_COUNT_ENV, STATE_ENV, TIME_SCHEDULE_ENV, WORKER_ENV
from .ledger import watch_exit


RPC_COUNTS: dict = {}
_RPC_LOCK = threading.Lock()


def count_manager_rpcs():
    """H2: count every manager RPC of this process per thread (:data:`RPC_COUNTS`), when the launcher asks for it."""
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
    plans = getattr(rm, "_fdsched_plans", None)  # the scheduler's plan slot (fdsched.patches._scheduler.PlanSlot)
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
        "pending_signals": [repr(p) for p in (plans.pending() if plans is not None else ())],
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


AFTER_LOAD = {"fastdeploy.engine.engine": [_s2], "fastdeploy.engine.expert_service": [_h1_expert_service]}

"""The simulated cache transfer manager: the CPU swap tier's process, without a GPU.

Started by seam S10 (:mod:`fdsched.serve.seams`) in place of the host's ``cache_manager/cache_transfer_manager.py``,
which ``PrefixCacheManager.launch_cache_manager`` starts (one per tensor-parallel rank) when
``num_cpu_blocks > 0``. It receives the host's own command line and speaks the same side of FastDeploy's IPC as
the real one:

- readiness: waits for its rank's ``cache_ready_signal`` (set by the worker once the KV cache exists), sets its
  slot of ``swap_space_ready_signal`` once its "CPU cache" exists and waits for every rank's, then sets its slot
  of ``cache_transfer_inited_signal`` (the engine waits on both);
- a client of the engine's ``EngineCacheQueue``: rank 0 raises ``cache_task_broadcast_signal`` when the task
  list is not empty, every rank reads the task once with ``get_transfer_task()`` (the queue's per-client bitmask)
  and the reader that completes the read lowers the signal, as the real loop does;
- ``cache_task_inflight`` is 1 for its rank while it takes tasks and 0 while paused
  (``reset(wait_for_tasks_done=True)`` waits for 0);
- the KV-cache clearing handshake (``check_cache_status``): ``kv_cache_status`` CLEARING pauses it (a swap task read
  while paused is dropped unanswered, as the real loop drops every non-control task while paused) and answers
  CLEARED; UPDATING resumes it and answers NORMAL. The prefix tree's own clearing (``PrefixTreeStatus``, the
  engine's ``clear_prefix_cache`` thread calling ``reset``) is the engine's, unchanged;
- SWAP2CPU / SWAP2GPU: checks the task (equal lengths; GPU block ids below ``num_gpu_blocks``, CPU block ids below
  ``num_cpu_blocks``; a bad task is logged as an error and still answered, as the real one answers after its
  copy), takes a modelled copy time, and rank 0 answers with the host's ``put_transfer_done_signal`` and the
  tuple the real ``_transfer_data`` returns: ``(event_type, task_id, node_ids, gpu_block_ids, cpu_block_ids)``.
  It also remembers which CPU block holds which GPU block's data and logs a SWAP2GPU from a CPU block nothing
  was swapped into.

Differences from the real process, on purpose: no tensors (the copy is a sleep of
``FDSCHED_SERVE_SWAP_MS_PER_BLOCK`` ms per block, default 0.2); when idle it sleeps
``FDSCHED_SERVE_XFER_IDLE_MS`` (default 1 ms) between ``empty()`` checks, where the real loop with one rank checks
again at once (it spins on that RPC); one rank only (the served stack runs TP 1, so the cross-rank barriers are
not used); storage tasks and control (pause/resume) tasks are logged and not answered (the served stack configures
no storage backend and sends no control task).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parse(argv):
    ap = argparse.ArgumentParser(prog="fdsched-simxfer")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--mp_num", type=int, default=1)
    ap.add_argument("--key_cache_shape", default="")
    ap.add_argument("--cache_queue_port", type=int, required=True)
    ap.add_argument("--pod_ip", default="0.0.0.0")
    ap.add_argument("--engine_worker_queue_port", type=int, required=True)
    ap.add_argument("--num_cpu_blocks", type=int, default=0)
    ap.add_argument("--local_data_parallel_id", type=int, default=0)
    args, _unused = ap.parse_known_args(argv)  # the rest of the real command line (dtype, protocol, ...) is moot
    return args


# The IPC signals the real process shares with the engine (name -> slots), in the order it attaches them.
SIGNALS = (("cache_ready_signal", "ranks"), ("swap_space_ready_signal", "ranks"), ("cache_task_broadcast_signal", 1),
           ("cache_task_is_paused", 1), ("cache_task_inflight", "ranks"), ("cache_transfer_inited_signal", "ranks"),
           ("kv_cache_status", 1))


def main(argv=None) -> int:
    a = _parse(sys.argv[1:] if argv is None else argv)

    def log(msg):
        print(f"[fdsched simxfer rank{a.rank} dp{a.local_data_parallel_id}] {msg}", flush=True)

    if a.mp_num != 1:
        log(f"--mp_num {a.mp_num}: the simulated transfer manager runs one rank only (tensor parallel 1)")
        return 2
    ms_per_block = float(os.environ.get("FDSCHED_SERVE_SWAP_MS_PER_BLOCK", "0.2"))
    idle_s = float(os.environ.get("FDSCHED_SERVE_XFER_IDLE_MS", "1")) / 1000.0
    num_gpu_blocks = int(a.key_cache_shape.split(",")[0]) if a.key_cache_shape else 0
    queue, sig = _connect(a)
    state = {"paused": False}
    _watch_cache_status(sig, a.rank, state, log)
    log(f"started (pid {os.getpid()}): {num_gpu_blocks} GPU blocks, {a.num_cpu_blocks} CPU blocks, "
        f"{ms_per_block} ms per block")
    _wait_ready(sig, a)
    log("ready")
    _serve_tasks(a, queue, sig, state, (num_gpu_blocks, ms_per_block, idle_s), log)


def _connect(a) -> tuple:
    """(the engine's cache queue, as a client; name -> IPC signal of :data:`SIGNALS`). Every signal stays referenced
    for the life of the process (a collected one unmaps its segment)."""
    import numpy as np
    from fastdeploy import envs
    from fastdeploy.inter_communicator import EngineCacheQueue, IPCSignal

    def signal(name, size):
        return IPCSignal(name=name, array=np.zeros([size], dtype=np.int32), dtype=np.int32,
                         suffix=a.engine_worker_queue_port, create=False)

    address = (f"/dev/shm/fd_task_queue_{a.cache_queue_port}.sock" if int(envs.FD_ENGINE_TASK_QUEUE_WITH_SHM)
               else (a.pod_ip, a.cache_queue_port))
    queue = EngineCacheQueue(address=address, is_server=False, num_client=a.mp_num, client_id=a.rank,
                             local_data_parallel_id=0)
    return queue, {name: signal(name, a.mp_num if size == "ranks" else size) for name, size in SIGNALS}


def _watch_cache_status(sig: dict, rank: int, state: dict, log) -> None:
    """The real check_cache_status thread, minus the tensors: CLEARING pauses the loop and answers CLEARED once it
    has stopped taking tasks; UPDATING resumes it and answers NORMAL."""
    import threading

    from fastdeploy.inter_communicator import KVCacheStatus

    kv_status, inflight = sig["kv_cache_status"], sig["cache_task_inflight"]

    def watch():
        while True:
            if kv_status.value[0] == KVCacheStatus.CLEARING:
                state["paused"] = True
                while inflight.value[rank] != 0:  # the loop has finished its task and marked itself paused
                    time.sleep(0.01)
                kv_status.value[0] = KVCacheStatus.CLEARED
                log("paused; KV cache cleared")
            elif kv_status.value[0] == KVCacheStatus.UPDATING:
                state["paused"] = False
                kv_status.value[0] = KVCacheStatus.NORMAL
                log("resumed; KV cache restored")
            time.sleep(0.1)

    threading.Thread(target=watch, name="check_cache_status", daemon=True).start()


def _wait_ready(sig: dict, a) -> None:
    """The worker made the KV cache; this rank's CPU cache "exists", then every rank's; this rank is initialised."""
    import numpy as np

    while sig["cache_ready_signal"].value[a.rank] != 1:
        time.sleep(0.1)
    sig["swap_space_ready_signal"].value[a.rank] = 1
    while int(np.sum(sig["swap_space_ready_signal"].value)) != a.mp_num:
        time.sleep(0.1)
    sig["cache_transfer_inited_signal"].value[a.rank] = 1


def _serve_tasks(a, queue, sig: dict, state: dict, sizes: tuple, log) -> None:
    """The task loop: take each swap task once, check it, model its copy time and (rank 0) answer it."""
    from fastdeploy.cache_manager.cache_data import CacheStatus

    num_gpu_blocks, ms_per_block, idle_s = sizes
    broadcast, paused, inflight = sig["cache_task_broadcast_signal"], sig["cache_task_is_paused"], sig["cache_task_inflight"]
    holds = {}  # CPU block -> the GPU block whose data it holds
    done = {"SWAP2CPU": 0, "SWAP2GPU": 0, "bad": 0, "dropped": 0}
    while True:
        is_paused = state["paused"]
        if a.rank == 0:
            paused.value[0] = int(is_paused)
        inflight.value[a.rank] = 0 if is_paused else 1
        if a.rank == 0 and not queue.empty():
            broadcast.value[0] = 1
        if broadcast.value[0] != 1:
            time.sleep(idle_s)
            continue
        data, read_finish = queue.get_transfer_task()
        if read_finish:
            broadcast.value[0] = 0
        if data is None:
            continue
        event_type = data[0]
        if is_paused and event_type.value != CacheStatus.CTRL.value:
            done["dropped"] += 1
            log(f"paused: dropped a {event_type.name} task unanswered, as the real loop does: {data[1]!r}")
            continue
        if event_type.value not in (CacheStatus.SWAP2CPU.value, CacheStatus.SWAP2GPU.value):
            log(f"ignored a {event_type.name} task (storage and control tasks are not simulated): {data!r}")
            continue
        _swap(a, queue, data, holds, done, (num_gpu_blocks, ms_per_block), log)


def _swap(a, queue, data, holds: dict, done: dict, sizes: tuple, log) -> None:
    """One SWAP2CPU / SWAP2GPU task: checked (a bad one is logged as an error and still answered), a modelled copy
    time, the CPU blocks' contents remembered, and rank 0's answer (the tuple the real ``_transfer_data`` returns)."""
    from fastdeploy.cache_manager.cache_data import CacheStatus

    num_gpu_blocks, ms_per_block = sizes
    event_type, task_id, node_ids, gpu_ids, cpu_ids = data
    problems = []
    if not (len(node_ids) == len(gpu_ids) == len(cpu_ids)):
        problems.append(f"lengths differ: {len(node_ids)} nodes, {len(gpu_ids)} GPU, {len(cpu_ids)} CPU blocks")
    problems += [f"GPU block {g} out of range 0..{num_gpu_blocks - 1}" for g in gpu_ids
                 if num_gpu_blocks and not 0 <= int(g) < num_gpu_blocks]
    problems += [f"CPU block {c} out of range 0..{a.num_cpu_blocks - 1}" for c in cpu_ids
                 if not 0 <= int(c) < a.num_cpu_blocks]
    if event_type.value == CacheStatus.SWAP2GPU.value:
        problems += [f"CPU block {c} holds no swapped-out data" for c in cpu_ids if int(c) not in holds]
    if problems:
        done["bad"] += 1
        log(f"ERROR bad {event_type.name} task {task_id}: " + "; ".join(problems))
    time.sleep(ms_per_block * len(gpu_ids) / 1000.0)
    if event_type.value == CacheStatus.SWAP2CPU.value:
        for g, c in zip(gpu_ids, cpu_ids):
            holds[int(c)] = int(g)
    else:
        for c in cpu_ids:
            holds.pop(int(c), None)
    done[event_type.name] += 1
    if a.rank == 0:
        queue.put_transfer_done_signal((event_type, task_id, node_ids, gpu_ids, cpu_ids))
    log(f"{event_type.name} task {task_id}: {len(gpu_ids)} blocks done; totals {done}")


if __name__ == "__main__":
    sys.exit(main())

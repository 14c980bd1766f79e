"""The simulated cache messager: the KV transport between a prefill and a decode instance, without a GPU.

Started by seam S12 (:mod:`fdsched.serve.seams`) in place of the host's ``cache_manager/cache_messager.py``, which
``PrefixCacheManager.launch_cache_messager`` starts (one per tensor-parallel rank) on every instance whose
``splitwise_role`` is not ``mixed``. It receives the host's own command line and speaks the host's side of the
engine's IPC as the real one does:

- readiness: sets its slot of ``cache_ready_signal`` (suffix ``--ipc_suffix``) once its "KV cache" exists; the
  engine's ``launch_cache_messager`` waits on it;
- prefill role, the cache tasks: a client of the engine's ``EngineWorkerQueue``; ``get_cache_info()`` hands it the
  prefill engine's half of a task (``src_block_ids``, ``need_prefill_tokens``, the slot ``current_id``, the
  Router's ``disaggregate_info``: decode address and ports) and the decode engine's half (``dest_block_ids``,
  forwarded by the prefill engine's connector on ``cache_sync``); a task is ready when both halves are there. Where
  the host waits for the messager to acknowledge a ready task (``put_finished_add_cache_task_req``, at e7c8dc2), it
  is acknowledged;
- prefill role, the progress signals: on a GPU the attention kernels of the prefill worker report per layer how
  far each slot's prefill got (``get_output_kv_signal``, a compiled op). The simulated worker reports the same
  fact once per step, ``(slot, tokens prefilled so far)``, on a ZeroMQ socket in the stack's state directory;
- prefill role, the transfer: the blocks a step completed (all of them once the whole prompt is prefilled) are sent
  to the decode instance named in the task -- to the simulated messager listening on the decode's
  ``rdma_comm_ports`` port -- which checks them (every destination block inside its pool) and answers. Once the
  whole prompt is sent the task ends with the host's ``put_finished_req([[request_id, status]])``: ``finished``,
  or the host's error words (``connection error`` when the decode does not answer, ``write cache error`` when it
  refuses the blocks); the prefill engine's token processor waits for exactly that (``get_finished_req``) before
  it sends the first token to the decode instance and frees the request's blocks;
- decode role: it listens on its ``--rdma_port`` and answers the prefill messagers' writes;
- both roles end when the engine that launched them is gone (the host starts the messager through a shell in a
  session of its own, so neither a signal to the engine's process group nor the shell reaches it).

A file named ``kv-hold`` in the stack's state directory holds every write of a prefill messager while it is there
(one log line per held task): the prefill is done and the decode has allocated its blocks, the bytes are not sent.
The engine tier uses it to take a decode instance away with a transfer in flight.

Differences from the real process, on purpose: no tensors (a write takes ``FDSCHED_SERVE_KV_MS_PER_BLOCK`` ms per
block, default 0.05); the transfer is one message per step and request, not one per layer; one rank only (the
served stack runs tensor parallel 1); only the ``rdma`` route is simulated (the stack's instances announce
``--cache-transfer-protocol rdma``, so the Router always picks it; ``ipc`` maps one GPU's memory into another
process); the eager RDMA connect tasks (``FD_ENABLE_PD_RDMA_EAGER_CONNECT``, off by default) are not answered.

Run by the seams as a script; it imports the host's modules and nothing of ``fdsched``.
"""

import argparse
import os
import sys
import threading
import time

SIGNAL_NAME = "kv-signal-{suffix}.sock"  # in the stack's state dir: the worker's progress reports (PUSH -> PULL)
HOLD_NAME = "kv-hold"  # in the stack's state dir: while it exists, a prefill messager holds its writes
MS_PER_BLOCK_ENV = "FDSCHED_SERVE_KV_MS_PER_BLOCK"
STATE_ENV = "FDSCHED_SERVE_STATE_DIR"
SEND_TIMEOUT_MS = 3000


def signal_address(suffix) -> str:
    """The ZeroMQ address the worker reports prefill progress on, for the instance whose IPC suffix is ``suffix``."""
    return "ipc://" + os.path.join(os.environ.get(STATE_ENV, "/tmp"), SIGNAL_NAME.format(suffix=suffix))


def hold_path(state_dir: str) -> str:
    """The file whose presence holds the prefill messagers' writes of the stack whose state dir is ``state_dir``."""
    return os.path.join(state_dir, HOLD_NAME)


def _parent_of(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _engine_watch():
    """A callable that is True while the engine that launched this process lives: the parent, and the parent's
    parent when the parent is the shell the host's command line runs in (``Popen(..., shell=True)``)."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as fh:
            through_shell = os.path.basename(fh.read().split(b"\0")[0]) in (b"sh", b"bash", b"dash")
    except OSError:
        through_shell = False
    engine = _parent_of(parent) if through_shell else None
    engine_start = _start_time(engine) if engine else None

    def alive() -> bool:
        if os.getppid() != parent:
            return False
        return engine is None or _start_time(engine) == engine_start

    return alive


def _start_time(pid: int):
    """The process's start time (its identity with its pid), or None once it is gone or a zombie (a killed engine
    stays a zombie until the launcher reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def _parse(argv):
    ap = argparse.ArgumentParser(prog="fdsched-simmessager")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--mp_num", type=int, default=1)
    ap.add_argument("--splitwise_role", default="mixed")
    ap.add_argument("--key_cache_shape", default="")
    ap.add_argument("--pod_ip", default="0.0.0.0")
    ap.add_argument("--engine_worker_queue_port", type=int, required=True)
    ap.add_argument("--local_data_parallel_id", type=int, default=0)
    ap.add_argument("--ipc_suffix", default=None)
    ap.add_argument("--rdma_port", default="0")
    args, _unused = ap.parse_known_args(argv)  # dtype, protocol, speculative config: moot without tensors
    return args


class Messager:
    """One rank's messager; ``log`` writes a line to the process's log."""

    def __init__(self, a, queue, block_size, num_blocks, log):
        self.a, self.queue, self.block_size, self.num_blocks, self.log = a, queue, block_size, num_blocks, log
        self.tasks = {}  # request id -> the merged halves of its task
        self.by_slot = {}  # slot -> request id (a task both halves of which are here)
        self.lock = threading.Lock()
        self.ms_per_block = float(os.environ.get(MS_PER_BLOCK_ENV, "0.05"))
        self.sent_blocks = self.transfers = self.failures = 0

    # ---- prefill: the cache tasks -------------------------------------------------------------------------------
    def take_cache_infos(self):
        acked = []
        infos = self.queue.get_cache_info()
        if not infos:
            return False
        barrier = getattr(self.queue, "cache_info_barrier", None)
        if barrier is not None:
            barrier.wait()
        with self.lock:
            for info in infos:
                rid = info["request_id"]
                task = self.tasks.setdefault(rid, {})
                task.update(info)
                if "src_block_ids" in task and "dest_block_ids" in task and "sent_blocks" not in task:
                    # the decode may already hold a cached head of the prompt: its list is shorter by those blocks
                    skipped = max(0, len(task["src_block_ids"]) - len(task["dest_block_ids"]))
                    task["dest_block_ids"] = [-1] * skipped + list(task["dest_block_ids"])
                    task["sent_blocks"] = skipped
                    task["status"] = "init"
                    self.by_slot[task["current_id"]] = rid
                    acked.append(rid)
                    self.log(f"task {rid}: slot {task['current_id']}, {len(task['src_block_ids'])} blocks to "
                             f"{task.get('decode_ip')}:{task.get('decode_rdma_ports')}, "
                             f"{task.get('need_prefill_tokens')} tokens")
        if acked and hasattr(self.queue, "put_finished_add_cache_task_req"):  # the hosts that wait for it
            self.queue.put_finished_add_cache_task_req(acked)
            barrier = getattr(self.queue, "finish_add_cache_task_barrier", None)
            if barrier is not None:
                barrier.wait()
        return True

    def _task_for_slot(self, slot, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                rid = self.by_slot.get(slot)
                if rid is not None:
                    return rid, self.tasks[rid]
            time.sleep(0.002)
        return None, None

    # ---- prefill: the transfer ----------------------------------------------------------------------------------
    def on_progress(self, slot, prefilled, zmq, ctx, sockets):
        rid, task = self._task_for_slot(slot)
        if task is None:
            self.log(f"progress for slot {slot} ({prefilled} tokens) but no cache task arrived for it in 30 s")
            return
        src, dest = task["src_block_ids"], task["dest_block_ids"]
        done = prefilled >= int(task["need_prefill_tokens"])
        end = len(src) if done else min(len(src), prefilled // self.block_size)
        start = task["sent_blocks"]
        if end > start and "error" not in task["status"]:
            self._hold(task, end - start)
            status = self._write(task, src[start:end], dest[start:end], zmq, ctx, sockets)
            if status != "ok":
                task["status"] = status
            task["sent_blocks"] = end
        if done:
            status = task["status"] if "error" in task["status"] else "finished"
            with self.lock:
                self.by_slot.pop(slot, None)
                self.tasks.pop(rid, None)
            barrier = getattr(self.queue, "finish_send_cache_barrier", None)
            if barrier is not None:
                barrier.wait()
            self.queue.put_finished_req([[rid, status]])
            self.transfers += 1
            self.failures += status != "finished"
            self.log(f"task {rid}: {status} ({end} blocks sent); transfers {self.transfers}, failed "
                     f"{self.failures}, blocks {self.sent_blocks}")

    def _hold(self, task, blocks) -> None:
        path = hold_path(os.environ.get(STATE_ENV, "/tmp"))
        if not os.path.exists(path):
            return
        self.log(f"task {task['request_id']}: write of {blocks} blocks held ({HOLD_NAME})")
        while os.path.exists(path):
            time.sleep(0.02)

    def _write(self, task, src, dest, zmq, ctx, sockets) -> str:
        ports = task.get("decode_rdma_ports") or []
        if isinstance(ports, str):
            ports = ports.split(",")
        if not ports:
            return "connection error"
        addr = f"tcp://{task.get('decode_ip')}:{ports[self.a.rank] if len(ports) > self.a.rank else ports[0]}"
        keep = [(s, d) for s, d in zip(src, dest) if d != -1]
        time.sleep(self.ms_per_block * len(keep) / 1000.0)
        sock = sockets.get(addr)
        if sock is None:
            sock = sockets[addr] = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, SEND_TIMEOUT_MS)
            sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            sock.connect(addr)
        try:
            sock.send_pyobj({"request_id": task["request_id"], "dest_block_ids": [d for _s, d in keep]})
            answer = sock.recv_pyobj()
        except zmq.ZMQError as exc:  # the decode does not answer: this REQ socket is spent
            sock.close()
            sockets.pop(addr, None)
            self.log(f"task {task['request_id']}: write to {addr} failed: {exc}")
            return "connection error"
        if answer != "ok":
            self.log(f"task {task['request_id']}: {addr} refused the write: {answer}")
            return "write cache error"
        self.sent_blocks += len(keep)
        return "ok"

    # ---- decode: the receiver -----------------------------------------------------------------------------------
    def receive(self, zmq, ctx, port):
        sock = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://{self.a.pod_ip}:{port}")
        self.log(f"receiving KV writes on port {port}")
        received = 0
        while True:
            msg = sock.recv_pyobj()
            bad = [b for b in msg.get("dest_block_ids", []) if not 0 <= int(b) < self.num_blocks]
            if bad:
                self.log(f"write for {msg.get('request_id')}: blocks {bad[:5]} outside the pool of {self.num_blocks}")
                sock.send_pyobj(f"blocks {bad[:5]} outside the pool of {self.num_blocks}")
                continue
            received += len(msg.get("dest_block_ids", []))
            sock.send_pyobj("ok")


def main(argv=None) -> int:
    a = _parse(sys.argv[1:] if argv is None else argv)
    import numpy as np
    import zmq
    from fastdeploy import envs
    from fastdeploy.inter_communicator import EngineWorkerQueue, IPCSignal

    def log(msg):
        print(f"[fdsched simmessager {a.splitwise_role} rank{a.rank}] {msg}", flush=True)

    if a.mp_num != 1:
        log(f"--mp_num {a.mp_num}: the simulated cache messager runs one rank only (tensor parallel 1)")
        return 2
    shape = [int(x) for x in a.key_cache_shape.split(",")] if a.key_cache_shape else [0, 0, 0, 0]
    num_blocks, block_size = shape[0], shape[2]
    address = (f"/dev/shm/fd_task_queue_{a.engine_worker_queue_port}.sock" if int(envs.FD_ENGINE_TASK_QUEUE_WITH_SHM)
               else (a.pod_ip, a.engine_worker_queue_port))
    queue = EngineWorkerQueue(address=address, is_server=False, num_client=a.mp_num, client_id=a.rank,
                              local_data_parallel_id=a.local_data_parallel_id)
    messager = Messager(a, queue, block_size, num_blocks, log)
    ctx = zmq.Context()
    suffix = a.ipc_suffix or a.engine_worker_queue_port
    if a.splitwise_role == "decode":
        port = int(str(a.rdma_port).split(",")[a.rank] if "," in str(a.rdma_port) else a.rdma_port)
        threading.Thread(target=messager.receive, args=(zmq, ctx, port), name="kv-receiver", daemon=True).start()
    elif a.splitwise_role == "prefill":
        progress = ctx.socket(zmq.PULL)
        progress.setsockopt(zmq.LINGER, 0)
        progress.bind(signal_address(suffix))

        def cache_infos():
            while True:
                try:
                    if not messager.take_cache_infos():
                        time.sleep(0.001)
                except Exception as exc:  # noqa: BLE001 - as the host's thread: log and go on
                    log(f"cache info thread: {exc!r}")
                    time.sleep(0.01)

        threading.Thread(target=cache_infos, name="cache-infos", daemon=True).start()
    cache_ready = IPCSignal(name="cache_ready_signal", array=np.zeros([a.mp_num], dtype=np.int32), dtype=np.int32,
                            suffix=suffix, create=False)
    cache_ready.value[a.rank] = 1
    log(f"ready (pid {os.getpid()}): {num_blocks} blocks of {block_size} tokens")
    engine_alive = _engine_watch()
    if a.splitwise_role != "prefill":
        while engine_alive():
            time.sleep(0.5)
        log("engine process gone; exiting")
        return 0
    sockets = {}
    while True:
        if not progress.poll(500):
            if not engine_alive():
                log("engine process gone; exiting")
                return 0
            continue
        for slot, prefilled in progress.recv_pyobj():
            messager.on_progress(int(slot), int(prefilled), zmq, ctx, sockets)


if __name__ == "__main__":
    sys.exit(main())

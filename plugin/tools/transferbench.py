"""``fdsched bench transfer``: the CPU-cache transfer-done path (change 5), a benchmark that prints numbers.

A producer in another process puts storage-write results like a cache transfer manager; the receiver counts its
idle RPCs and times each signal's handling, host code vs the plugin. Runs the real host classes.
"""

from __future__ import annotations

import time

from fdsched.core.common import percentile
from fdsched.tools.benchcommon import host_label, install_arm


AUTHKEY = b"fdsched-bench"


def transfer_producer(port: int, count: int, interval: float, host_source: str) -> None:
    """A producer like a cache transfer manager: a fresh interpreter, the host's own client, no plugin.

    Puts ``count`` storage-write results ``interval`` seconds apart; each task id carries its put time.
    """
    import os

    if host_source:
        os.environ.setdefault("FDSCHED_HOST_SOURCE", host_source)
    from fdsched.install.probe import find_host
    from fdsched.replay.engine import prepare_host_environment

    prepare_host_environment()
    find_host()
    from fastdeploy.cache_manager.cache_data import CacheStatus
    from fastdeploy.inter_communicator.engine_cache_queue import EngineCacheQueue

    queue = EngineCacheQueue(address=("127.0.0.1", port), authkey=AUTHKEY, is_server=False, num_client=1, client_id=0)
    for i in range(count):
        time.sleep(interval)
        queue.put_transfer_done_signal((CacheStatus.GPU2STORAGE, f"task-{i}@{time.time():.6f}", [], [i]))


class StampingEvents(dict):
    """Stands in for the host's ``task_write_back_event`` map: every task id has an event, and setting it
    records (put time, handled time). The host's receiver sets the event when it handles the signal."""

    def __init__(self):
        super().__init__()
        self.handled = []  # (task id, put time, handled time) in handling order

    def __contains__(self, task_id):
        return True

    def __missing__(self, task_id):
        handled = self.handled

        class _Stamp:
            @staticmethod
            def set():
                handled.append((task_id, float(task_id.rsplit("@", 1)[1]), time.time()))

        return _Stamp()


def start_transfer_receiver(port: int):
    """The host's own receiver loop (PrefixCacheManager.recv_data_transfer_result) on a real manager."""
    import sys
    import threading
    from types import SimpleNamespace

    import numpy as np

    from fdsched.replay.engine import EngineShape, build_manager

    rm = build_manager(EngineShape(block_size=4, num_gpu_blocks=32, max_num_seqs=2, max_num_batched_tokens=64,
                                   max_model_len=64))
    cm = rm.cache_manager
    queue_cls = sys.modules["fastdeploy.inter_communicator.engine_cache_queue"].EngineCacheQueue
    cm.cache_task_queue = queue_cls(address=("127.0.0.1", port), authkey=AUTHKEY, is_server=False, num_client=1,
                                    client_id=0)
    cm.prefix_tree_status_signal = SimpleNamespace(value=np.zeros(1, dtype=np.int32))  # normally launch_cache_manager's
    cm.task_write_back_event = StampingEvents()
    thread = threading.Thread(target=cm.recv_data_transfer_result, name="fdsched-transfer-receiver", daemon=True)
    thread.start()
    return rm, cm, thread


def start_transfer_server():
    import sys

    queue_cls = sys.modules["fastdeploy.inter_communicator.engine_cache_queue"].EngineCacheQueue
    server = queue_cls(address=("127.0.0.1", 0), authkey=AUTHKEY, is_server=True, num_client=1,
                       local_data_parallel_size=1)
    return server, server.get_server_port()


def run_producer(port: int, count: int, interval: float) -> None:
    import multiprocessing
    import os

    producer = multiprocessing.get_context("spawn").Process(
        target=transfer_producer, args=(port, count, interval, os.environ.get("FDSCHED_HOST_SOURCE", ""))
    )
    producer.start()
    producer.join(timeout=300)
    if producer.exitcode != 0:
        raise RuntimeError(f"the producer process failed (exit code {producer.exitcode})")


def bench_transfer(idle_seconds: float, count: int, interval: float) -> dict:
    import threading
    from multiprocessing.managers import BaseProxy

    results = {}
    original_call = BaseProxy._callmethod
    for variant, profile in (("host", None), ("plugin", "nonpolling_transfer")):
        install_arm(profile)
        server, port = start_transfer_server()
        rm, cm, receiver = start_transfer_receiver(port)
        calls = [0]

        def counting(self, *args, **kwargs):
            if threading.current_thread() is receiver:
                calls[0] += 1
            return original_call(self, *args, **kwargs)

        BaseProxy._callmethod = counting
        try:
            time.sleep(0.5)  # the receiver's connection is open
            calls[0] = 0
            started = time.perf_counter()
            time.sleep(idle_seconds)
            idle_rate = calls[0] / (time.perf_counter() - started)
        finally:
            BaseProxy._callmethod = original_call
        run_producer(port, count, interval)
        deadline = time.time() + 10
        while len(cm.task_write_back_event.handled) < count and time.time() < deadline:
            time.sleep(0.01)
        handled = cm.task_write_back_event.handled
        latencies = sorted((done - put) * 1e3 for _, put, done in handled)
        results[variant] = {
            "idle_rpc_per_s": idle_rate,
            "handled": len(handled),
            "in_order": [t for t, _, _ in handled] == sorted((t for t, _, _ in handled), key=lambda t: int(t[5:].split("@")[0])),
            "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99),
            "max_ms": latencies[-1] if latencies else float("nan"),
        }
        stop_transfer(server, rm)
    install_arm(None)
    return results


def stop_transfer(server, rm) -> None:
    """Shut the queue server down; the host's receiver thread then ends on the closed connection (expected)."""
    import threading

    from fdsched.replay.engine import close_manager

    previous = threading.excepthook

    def quiet(hook_args):
        if hook_args.thread is None or hook_args.thread.name != "fdsched-transfer-receiver":
            previous(hook_args)

    threading.excepthook = quiet
    server.manager.shutdown()
    time.sleep(0.2)
    close_manager(rm)


def run_transfer(args) -> int:
    print(f"host: {host_label()}")
    results = bench_transfer(args.idle_seconds, args.count, args.interval)
    print(f"transfer-done receiver: idle {args.idle_seconds:.0f} s, then {args.count} signals {args.interval * 1e3:.0f} ms "
          f"apart from another process")
    print(f"{'variant':<8} {'idle RPC/s':>10} {'handled':>8} {'in order':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for variant, r in results.items():
        print(f"{variant:<8} {r['idle_rpc_per_s']:>10.1f} {r['handled']:>8} {str(r['in_order']):>9} {r['p50_ms']:>8.2f} "
              f"{r['p99_ms']:>8.2f} {r['max_ms']:>8.2f}")
    return 0

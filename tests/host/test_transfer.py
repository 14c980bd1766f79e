"""Change 5 against the real host: EngineCacheQueue server, a producer process, the host's receiver loop."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

ECQ = "fastdeploy.inter_communicator.engine_cache_queue"


@pytest.fixture
def transfer(install_profile):
    """(server, port) with the plugin's change 5 on; the receiver is started by the test."""
    from fdsched.tools.transferbench import start_transfer_server

    install_profile("nonpolling_transfer", FDSCHED_TRANSFER_WAIT_SECONDS=0.3)
    started = []

    def _start():
        server, port = start_transfer_server()
        started.append(server)
        return server, port

    yield _start
    for server in started:
        server.manager.shutdown()


def _client(port):
    import sys

    from fdsched.tools.transferbench import AUTHKEY

    cls = sys.modules[ECQ].EngineCacheQueue
    return cls(address=("127.0.0.1", port), authkey=AUTHKEY, is_server=False, num_client=1, client_id=0)


def _host_client(port):
    import sys

    from fdsched.tools.transferbench import AUTHKEY
    from fdsched.install.probe import _original

    cls = _original(sys.modules[ECQ].EngineCacheQueue)
    return cls(address=("127.0.0.1", port), authkey=AUTHKEY, is_server=False, num_client=1, client_id=0)


def _signal(i):
    from fastdeploy.cache_manager.cache_data import CacheStatus

    return (CacheStatus.GPU2STORAGE, f"task-{i}@{time.time():.6f}", [], [i])


def test_signals_from_another_process_arrive_in_order(transfer):
    from fdsched.tools.transferbench import run_producer, start_transfer_receiver, stop_transfer

    server, port = transfer()
    rm, cm, receiver = start_transfer_receiver(port)
    run_producer(port, 40, 0.0)  # a fresh interpreter without the plugin, the host's own put
    deadline = time.time() + 10
    while len(cm.task_write_back_event.handled) < 40 and time.time() < deadline:
        time.sleep(0.01)
    handled = [task.split("@")[0] for task, _, _ in cm.task_write_back_event.handled]
    assert handled == [f"task-{i}" for i in range(40)]
    assert receiver.is_alive()
    assert server.result_queue_empty()
    stop_transfer(server, rm)


def test_an_idle_receiver_waits_in_the_server_instead_of_polling(transfer):
    from multiprocessing.managers import BaseProxy

    server, port = transfer()
    client = _client(port)
    client.get_transfer_done_signal()  # opens this thread's connection
    calls = [0]
    original = BaseProxy._callmethod

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    BaseProxy._callmethod = counting
    try:
        started = time.perf_counter()
        assert client.get_transfer_done_signal() is None
        waited = time.perf_counter() - started
    finally:
        BaseProxy._callmethod = original
    assert waited >= 0.25, "an empty get must wait in the server (FDSCHED_TRANSFER_WAIT_SECONDS=0.3)"
    assert calls[0] == 1, "one blocking RPC per wait"


def test_a_waiting_receiver_wakes_when_a_signal_is_put(transfer):
    server, port = transfer()
    receiver, producer = _client(port), _host_client(port)
    got = []
    thread = threading.Thread(target=lambda: got.append((receiver.get_transfer_done_signal(), time.perf_counter())))
    thread.start()
    time.sleep(0.1)
    put_at = time.perf_counter()
    producer.put_transfer_done_signal(_signal(1))
    thread.join(timeout=5)
    data, at = got[0]
    assert data is not None and data[1].startswith("task-1@")
    assert at - put_at < 0.2, "woken by the put, not by the end of the wait"


def test_a_result_being_handled_still_counts_as_pending(transfer):
    """reset(wait_for_tasks_done=True) polls result_queue_empty(): it must stay False until handled."""
    server, port = transfer()
    receiver, producer = _client(port), _host_client(port)
    producer.put_transfer_done_signal(_signal(1))
    assert receiver.get_transfer_done_signal() is not None
    assert not receiver.result_queue_empty(), "taken but not yet handled"
    assert not producer.result_queue_empty(), "the host's own client sees it pending too"
    assert receiver.get_transfer_done_signal() is None  # asking again acknowledges the handled one
    assert receiver.result_queue_empty()


def test_reset_waits_for_every_result(transfer):
    from fdsched.tools.transferbench import run_producer, start_transfer_receiver, stop_transfer

    server, port = transfer()
    rm, cm, receiver = start_transfer_receiver(port)
    events = cm.task_write_back_event
    original_missing = type(events).__missing__

    def slow_missing(self, task_id):  # handling each result takes 30 ms
        stamp = original_missing(self, task_id)
        return SimpleNamespace(set=lambda: (time.sleep(0.03), stamp.set()))

    type(events).__missing__ = slow_missing
    try:
        producer = threading.Thread(target=run_producer, args=(port, 20, 0.0))
        producer.start()
        while not events.handled:
            time.sleep(0.005)
        import numpy as np

        cm.cache_task_inflight_signal = SimpleNamespace(value=np.zeros(1, dtype=np.int32))
        producer.join(timeout=60)
        cm.reset(wait_for_tasks_done=True)
        assert len(events.handled) == 20, "reset returned while results were still pending"
    finally:
        type(events).__missing__ = original_missing
    stop_transfer(server, rm)


def test_swap_branch_stays_reachable_and_direct_recycle_is_explicit(install_profile, make_manager):
    """With a CPU tier the host's swap path is taken; only FDSCHED_TRANSFER_FORCE_DIRECT_RECYCLE=1 evicts directly."""
    install_profile("recommended")
    rm = make_manager(block_size=4, num_gpu_blocks=40, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    cm = rm.cache_manager
    cm.cache_config.num_cpu_blocks = 100
    assert cm._fdsched_recycle.deferred_path(cm, 10) is False, "with CPU room the host's GPU->CPU swap branch must run"
    install_profile("recommended", FDSCHED_TRANSFER_FORCE_DIRECT_RECYCLE=1)
    rm = make_manager(block_size=4, num_gpu_blocks=40, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    rm.cache_manager.cache_config.num_cpu_blocks = 100
    assert rm.cache_manager._fdsched_recycle.deferred_path(rm.cache_manager, 10) is True


def test_client_falls_back_to_polling_against_a_host_server(install_profile):
    from fdsched.install import installer
    from fdsched.tools.transferbench import start_transfer_server

    installer.uninstall()
    server, port = start_transfer_server()  # the host's own server: plain lists
    try:
        install_profile("nonpolling_transfer")
        receiver, producer = _client(port), _host_client(port)
        # decided when the client was built: it polls with the host's own method
        from fdsched.patches.nonpolling_transfer import PollingReceiver

        assert type(receiver._fdsched_receiver) is PollingReceiver
        assert receiver.get_transfer_done_signal() is None
        producer.put_transfer_done_signal(_signal(2))
        assert receiver.get_transfer_done_signal()[1].startswith("task-2@")
    finally:
        server.manager.shutdown()

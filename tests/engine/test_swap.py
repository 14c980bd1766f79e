"""The CPU swap tier inside the served engine (issue 15 item 6; the plugin's change 5 in its real topology).

With ``num_cpu_blocks > 0`` the engine's ``PrefixCacheManager`` starts the cache transfer manager; seam S10 starts
the simulated one (``fdsched/serve/cachexfer.py``), which speaks ``EngineCacheQueue`` as the real one does. So the
swap path (GPU->CPU on eviction, CPU->GPU on a prefix hit), the transfer-done receiver (the host's polling one under
``baseline``, the plugin's blocking one under ``recommended``: ``changes.nonpolling_transfer`` off / on) and
``reset()`` (the host's prefix-tree clearing handshake) all run across real processes here.

After every load: every request finished, both transfer directions ran, no task the transfer manager checked was
bad, and both pools are whole: GPU free + GPU-resident tree blocks = all GPU blocks, CPU free + CPU-resident tree
blocks = all CPU blocks, nothing in transit, nothing held, nothing twice.
"""

from __future__ import annotations

import ast
import re
import time

import pytest

from fdsched.serve.launcher import receiver_rpc_rate
from fdsched.serve.model import prompt_of_length

from .helpers import assert_blocks_whole, complete, run_concurrently, settle

# 48 GPU blocks of 16 tokens under 24 concurrent requests over 6 distinct 80-token prompts: the running set
# outgrows the pool, cached prefixes are evicted to the CPU tier and come back on the next hit.
SHAPE = dict(num_gpu_blocks=48, block_size=16, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256)
CPU_BLOCKS = 64
N_REQUESTS, PROMPTS, PROMPT, OUTPUT = 24, 6, 80, 60
ARMS = {"recommended": "plugin (nonpolling_transfer on)", "baseline": "host (nonpolling_transfer off)"}
WAIT_S = 0.5  # tunables.transfer_wait_seconds, the plugin's longest single wait (default)


def _load(eng, seed=0):
    args = [(eng.urls[0], prompt_of_length(PROMPT, seed=seed + i % PROMPTS), OUTPUT) for i in range(N_REQUESTS)]
    return run_concurrently(complete, args)


def _transfer_totals(eng) -> dict:
    """The simulated transfer manager's last totals line (its log is the launch log the host names)."""
    found = re.findall(r"totals (\{[^}]*\})", eng.engine_log_text())
    return ast.literal_eval(found[-1]) if found else {}


def assert_pools_whole(state: dict, log_dir: str = "") -> None:
    assert_blocks_whole(state, log_dir)  # the GPU pool (free + GPU-resident tree blocks), pending signals
    assert state["in_transit"] == [], f"tree nodes still in transit: {state['in_transit']}"
    free, tree = state["cpu_free"], state["cpu_tree_blocks"]
    assert len(free) == len(set(free)), f"a CPU block is free twice: {sorted(free)}"
    assert len(tree) == len(set(tree)), f"a CPU block is cached twice: {sorted(tree)}"
    assert not set(free) & set(tree), f"CPU blocks both free and cached: {sorted(set(free) & set(tree))}"
    assert set(free) | set(tree) == set(range(state["cpu_total"])), (
        f"CPU blocks lost: {sorted(set(range(state['cpu_total'])) - set(free) - set(tree))}")


def _signal(name, port):
    import numpy as np
    from fastdeploy.inter_communicator import IPCSignal

    return IPCSignal(name=name, array=np.zeros([1], dtype=np.int32), dtype=np.int32, suffix=port, create=False)


def _set_and_wait(sig, value, until, timeout=60.0):
    sig.value[0] = value
    deadline = time.monotonic() + timeout
    while sig.value[0] != until and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sig.value[0] == until, f"signal stayed at {sig.value[0]} (wanted {until})"


@pytest.mark.parametrize("profile", list(ARMS))
def test_swap_tier_under_pressure_and_reset(served, profile):
    eng = served(profile=profile, num_cpu_blocks=CPU_BLOCKS, count_rpcs=True, **SHAPE)
    state = eng.engine_state(0)
    assert state["cpu_total"] == CPU_BLOCKS, f"the engine has {state['cpu_total']} CPU blocks, asked {CPU_BLOCKS}"

    # idle: the plugin's receiver makes one blocking RPC per wait; the host's polls every millisecond
    idle = receiver_rpc_rate(eng, 3.0)
    bound = idle["seconds"] / WAIT_S + 3
    if profile == "recommended":
        assert idle["receiver_rpcs"] <= bound, f"plugin receiver made {idle['receiver_rpcs']} RPCs idle: {idle}"
    else:
        assert idle["receiver_rpcs"] > bound, f"host receiver made only {idle['receiver_rpcs']} RPCs idle: {idle}"

    results = _load(eng)
    assert [r["error"] for r in results if r["error"]] == []
    assert [r["finish_reason"] for r in results] == ["length"] * N_REQUESTS
    assert_pools_whole(settle(eng), eng.log_dir)
    totals = _transfer_totals(eng)
    assert totals.get("SWAP2CPU", 0) > 0 and totals.get("SWAP2GPU", 0) > 0, f"no swap both ways: {totals}"
    assert totals.get("bad") == 0, f"the transfer manager saw bad tasks: {totals}"

    # reset(): the host's clearing handshake, as clear_load_weight drives it (engine_client ~790-810): the
    # transfer manager pauses (cache_task_inflight -> 0), then the engine's clear_prefix_cache thread runs
    # reset(wait_for_tasks_done=True), which waits for the receiver to have handled every result
    from fastdeploy.inter_communicator import KVCacheStatus, PrefixTreeStatus

    port = eng._rank_ports[0][2]  # engine_worker_queue_port: the suffix of the rank's IPC signals
    kv, tree = _signal("kv_cache_status", port), _signal("prefix_tree_status", port)
    _set_and_wait(kv, KVCacheStatus.CLEARING, KVCacheStatus.CLEARED)
    _set_and_wait(tree, PrefixTreeStatus.CLEARING, PrefixTreeStatus.CLEARED)
    cleared = eng.engine_state(0)
    assert sorted(cleared["free"]) == list(range(cleared["total"])) and cleared["tree_blocks"] == []
    assert sorted(cleared["cpu_free"]) == list(range(CPU_BLOCKS)) and cleared["cpu_tree_blocks"] == []
    _set_and_wait(kv, KVCacheStatus.UPDATING, KVCacheStatus.NORMAL)
    _set_and_wait(tree, PrefixTreeStatus.UPDATING, PrefixTreeStatus.NORMAL)

    # the swap path works again on the reset tree
    before = _transfer_totals(eng)
    results = _load(eng, seed=100)
    assert [r["finish_reason"] for r in results] == ["length"] * N_REQUESTS
    assert_pools_whole(settle(eng), eng.log_dir)
    after = _transfer_totals(eng)
    assert after["SWAP2CPU"] > before["SWAP2CPU"], f"no swap after the reset: {before} -> {after}"
    assert after.get("bad") == 0, f"the transfer manager saw bad tasks after the reset: {after}"

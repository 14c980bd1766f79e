"""Changes 1 and 4 against the real PrefixCacheManager / ResourceManagerV1."""

from __future__ import annotations

import heapq
import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fdsched.core.metrics import METRICS

from .workloads import tree_nodes

BS = 4
SHAPE = dict(block_size=BS, num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64)


def _fill_tree(rm, prompts):
    """Run each prompt to completion (one output token) so its blocks end up cached and released."""
    from fdsched.replay.driver import Driver
    from fdsched.replay.engine import make_request

    driver = Driver(rm)
    for i, prompt in enumerate(prompts):
        driver.add(make_request(f"fill{i}", prompt, 1), true_output_len=1)
    for _ in range(200):
        driver.step()
        if driver.idle():
            return driver
    raise AssertionError("fill did not drain")


def _prompts(seed=0, groups=3, per_group=3, prefix_blocks=3, tail=(1, 4)):
    rnd = random.Random(seed)
    out = []
    for g in range(groups):
        prefix = [1000 + g * 100 + i for i in range(prefix_blocks * BS)]
        for _ in range(per_group):
            out.append(prefix + [rnd.randrange(10, 90) for _ in range(rnd.randrange(*tail) * BS)])
    return out


def _is_heap(items) -> bool:
    return all(not (items[c] < items[i]) for i in range(len(items)) for c in (2 * i + 1, 2 * i + 2) if c < len(items))


def _check_accounting(rm):
    """free + held = all blocks; no id twice in the free list; none both free and held."""
    cm = rm.cache_manager
    free = list(cm.gpu_free_block_list)
    assert len(free) == len(set(free)), "a block id is in the free list twice"
    held = set()
    for node in tree_nodes(cm):
        if node.has_in_gpu:
            held.add(node.block_id)
            held.update(node.reverved_dec_block_ids)
    for request in list(rm.running) + list(rm.requests.values()):
        held.update(request.block_tables)
    assert not (held & set(free)), f"blocks both free and held: {sorted(held & set(free))}"
    assert held | set(free) == set(range(cm.num_gpu_blocks)), "a block is neither free nor held"
    assert len(cm.gpu_lru_leaf_heap) == len(cm.gpu_lru_leaf_set) == len(set(map(id, cm.gpu_lru_leaf_heap)))


@pytest.fixture
def filled(install_profile, make_manager, clock):
    def _build(profile="deferred_recycle", **env):
        install_profile(profile, **env)
        rm = make_manager(**SHAPE)
        _fill_tree(rm, _prompts())
        return rm

    return _build


# ---- change 1: deferred batched recycling -------------------------------------------------------
def test_batched_recycle_frees_exactly_the_evicted_blocks_once(filled):
    rm = filled()
    cm = rm.cache_manager
    nodes_before = {id(n): n for n in tree_nodes(cm)}
    dec_ids = cm.allocate_gpu_blocks(2, "dec")
    free_before = set(cm.gpu_free_block_list)
    leaf = cm.gpu_lru_leaf_heap[0]
    leaf.reverved_dec_block_ids = list(dec_ids)
    METRICS.reset()

    cm.free_block_ids_async(5)

    gone = [n for key, n in nodes_before.items() if key not in {id(m) for m in tree_nodes(cm)}]
    assert len(gone) == 5
    expected = {n.block_id for n in gone} | set(dec_ids)
    assert set(cm.gpu_free_block_list) - free_before == expected
    assert len(cm.gpu_free_block_list) == len(free_before) + len(expected)
    assert METRICS.recycle_batches == 1 and METRICS.evicted_blocks == len(expected)
    assert leaf.reverved_dec_block_ids == []
    from fastdeploy.cache_manager.cache_data import CacheStatus

    assert all(n.cache_status == CacheStatus.CPU for n in gone)
    assert all(n.node_id not in cm.node_map for n in gone)
    _check_accounting(rm)


def test_every_evicted_id_goes_through_the_recycle_seam_once_per_batch(filled):
    """The host's seam is kept: an instance attribute that replaces recycle_gpu_blocks (as the host's own
    test_free_nodes_directly_handles_gpu_leafs does) sees every freed id, in one call per eviction."""
    rm = filled()
    cm = rm.cache_manager
    leaf = cm.gpu_lru_leaf_heap[0]
    dec_ids = list(cm.allocate_gpu_blocks(2, "dec"))
    leaf.reverved_dec_block_ids = list(dec_ids)
    nodes_before = {id(n): n for n in tree_nodes(cm)}
    calls = []
    cm.recycle_gpu_blocks = lambda ids: calls.append(list(ids))

    cm.free_block_ids_async(5)

    gone = [n for key, n in nodes_before.items() if key not in {id(m) for m in tree_nodes(cm)}]
    assert len(gone) == 5 and len(calls) == 1, calls
    assert sorted(calls[0]) == sorted([n.block_id for n in gone] + dec_ids)

    # free_nodes_directly: the same seam, one call for the whole chain it frees
    calls.clear()
    target = next(n for n in tree_nodes(cm) if n.shared_count == 0 and not n.children and n in cm.gpu_lru_leaf_set)
    target.reverved_dec_block_ids = list(cm.allocate_gpu_blocks(1, "dec2"))
    dec = list(target.reverved_dec_block_ids)
    cm.free_nodes_directly(target)
    assert len(calls) == 1 and target.block_id in calls[0] and set(dec) <= set(calls[0])
    assert target.reverved_dec_block_ids == []


def test_recycle_seam_overridden_by_a_subclass_sees_the_batch(install_profile, make_manager, clock):
    """A platform subclass that extends recycle_gpu_blocks keeps seeing evictions (one call, every id)."""
    from fastdeploy.cache_manager import prefix_cache_manager as pcm_mod

    install_profile("deferred_recycle")
    plugin_cls = pcm_mod.PrefixCacheManager
    seen = []

    class Observing(plugin_cls):
        def recycle_gpu_blocks(self, gpu_block_ids, req_id=None):
            seen.append(list(gpu_block_ids) if isinstance(gpu_block_ids, list) else [gpu_block_ids])
            return super().recycle_gpu_blocks(gpu_block_ids, req_id)

    from fdsched.install.rebind import Rebinding

    stacked = Rebinding(pcm_mod.__name__, "PrefixCacheManager", Observing)
    stacked.apply()  # where the host builds its cache manager, it now builds the stacked class
    try:
        rm = make_manager(**SHAPE)
    finally:
        stacked.restore()
    # the stacked class itself, over the plugin's one class: its override wraps the plugin's seams
    assert type(rm.cache_manager) is Observing and type(rm.cache_manager).__mro__[1] is plugin_cls
    _fill_tree(rm, _prompts())
    cm = rm.cache_manager
    free_before = set(cm.gpu_free_block_list)
    seen.clear()
    cm.free_block_ids_async(6)
    assert len(seen) == 1 and len(seen[0]) == 6
    assert set(cm.gpu_free_block_list) - free_before == set(seen[0])
    assert _is_heap(cm.gpu_free_block_list)
    _check_accounting(rm)


def test_plugin_recycle_keeps_the_host_contract_for_every_caller(filled):
    """Single id or list, req_id accepted; the free list stays a heap; one merge for a big batch."""
    rm = filled()
    cm = rm.cache_manager
    ids = cm.allocate_gpu_blocks(min(80, len(cm.gpu_free_block_list)), "r")
    single = ids.pop()
    cm.recycle_gpu_blocks(single, "r")
    assert single in cm.gpu_free_block_list
    cm.recycle_gpu_blocks(ids, req_id="r")
    assert set(ids) <= set(cm.gpu_free_block_list) and _is_heap(cm.gpu_free_block_list)
    assert len(cm.gpu_free_block_list) == len(set(cm.gpu_free_block_list))


@pytest.mark.parametrize("ties", [False, True], ids=["distinct-times", "all-tied"])
@pytest.mark.parametrize("need", [2, 7, 40], ids=["small-direct-pops", "keyed-heap", "everything"])
def test_eviction_matches_the_host_loop(install_profile, make_manager, clock, need, ties):
    """Same tree, same request: the plugin evicts the same nodes in the same order, frees the same ids and
    leaves the LRU heap in the same layout as the host's loop, with distinct or fully tied LRU keys, for a
    small eviction (direct heap pops) and a large one (the keyed mirror of the heap)."""
    from fdsched.patches import deferred_recycle

    outcomes = {}
    for profile in ("baseline", "deferred_recycle"):
        install_profile(profile)
        rm = make_manager(**SHAPE)
        _fill_tree(rm, _prompts(seed=4))
        cm = rm.cache_manager
        if ties:
            for node in tree_nodes(cm):
                node.last_used_time = 1.0  # every comparison between equal depths is a tie
        leaves = len(cm.gpu_lru_leaf_heap)
        order = []
        host_recycle = cm.recycle_gpu_blocks

        def observe(ids, req_id=None, _recycle=host_recycle):
            order.extend(ids if isinstance(ids, list) else [ids])
            return _recycle(ids, req_id)

        cm.recycle_gpu_blocks = observe
        cm.free_block_ids_async(need)
        outcomes[profile] = (
            order,
            sorted(cm.gpu_free_block_list),
            sorted(n.block_id for n in tree_nodes(cm)),
            [n.block_id for n in cm.gpu_lru_leaf_heap],  # the heap's layout, not just its contents
        )
    assert outcomes["baseline"][0], "the host freed nothing: the scenario does not evict"
    assert outcomes["baseline"] == outcomes["deferred_recycle"]
    keyed = need * deferred_recycle.KEYED_HEAP_MIN_SHARE >= leaves
    assert keyed == (need != 2), f"scenario drifted: {leaves} leaves, need {need}"


@pytest.mark.parametrize("caller_disabled", [False, True], ids=["gc-enabled", "gc-disabled-by-caller"])
def test_large_eviction_holds_collections_off_and_restores_the_collector(filled, monkeypatch, caller_disabled):
    """The keyed mirror is built and popped with the collector off (its tuples must never meet a collection),
    and the collector is as the caller left it afterwards; a small eviction needs no hold."""
    import gc

    from fdsched.core.metrics import METRICS
    from fdsched.patches import deferred_recycle

    rm = filled()
    cm = rm.cache_manager
    seen = []
    real_pop = heapq.heappop

    def pop(heap):
        seen.append((type(heap[0]) is tuple, gc.isenabled()))
        return real_pop(heap)

    monkeypatch.setattr(deferred_recycle.heapq, "heappop", pop)
    was = gc.isenabled()
    if caller_disabled:
        gc.disable()
    holds = METRICS.gc_holds
    try:
        cm.free_block_ids_async(1)  # small: direct pops
        small = list(seen)
        small_holds = METRICS.gc_holds - holds
        seen.clear()
        cm.free_block_ids_async(len(cm.gpu_lru_leaf_heap))  # large: the keyed mirror
        after = gc.isenabled()
    finally:
        if was:
            gc.enable()
    assert small and all(not keyed and enabled == (not caller_disabled) for keyed, enabled in small), small
    assert seen and all(keyed and not enabled for keyed, enabled in seen), seen
    # the hold's length reaches the operators' histogram: once for the large eviction, never for the small one
    assert small_holds == 0 and METRICS.gc_holds - holds == 1
    assert 0 < METRICS.gc_hold_seconds_max < 60
    assert after == (not caller_disabled), "the eviction changed the collector's state"
    _check_accounting(rm)


def test_no_node_enters_the_lru_heap_twice(filled):
    rm = filled()
    cm = rm.cache_manager
    cm.free_block_ids_async(len(tree_nodes(cm)) // 2)
    heap_ids = [id(n) for n in cm.gpu_lru_leaf_heap]
    assert len(heap_ids) == len(set(heap_ids)) == len(cm.gpu_lru_leaf_set)
    assert _is_heap(cm.gpu_lru_leaf_heap)
    _check_accounting(rm)


def test_overflow_guard_drops_duplicates_and_keeps_the_rest(filled):
    rm = filled()
    cm = rm.cache_manager
    already_free = cm.gpu_free_block_list[0]
    leaf = cm.gpu_lru_leaf_heap[0]
    leaf.reverved_dec_block_ids = [already_free]  # an accounting error: this id is free already
    total_free = len(cm.gpu_free_block_list)
    # Make the pool look full so the batch overflows and the guard has to look at it.
    cm.num_gpu_blocks, real_total = total_free + 1, cm.num_gpu_blocks
    try:
        cm.free_block_ids_async(1)
    finally:
        cm.num_gpu_blocks = real_total
    free = cm.gpu_free_block_list
    assert len(free) == len(set(free)), "the duplicate must not enter the free list"
    assert leaf.block_id in free, "the valid id of the batch is still recycled"
    assert len(free) == total_free + 1


def test_overflow_guard_discards_a_batch_that_cannot_fit(filled):
    rm = filled()
    cm = rm.cache_manager
    before = sorted(cm.gpu_free_block_list)
    cm.num_gpu_blocks, real_total = len(before), cm.num_gpu_blocks  # "every block is free already"
    try:
        cm.free_block_ids_async(2)
    finally:
        cm.num_gpu_blocks = real_total
    assert sorted(cm.gpu_free_block_list) == before


def test_nothing_is_recycled_while_the_tree_is_cleared(filled):
    import numpy as np
    from types import SimpleNamespace

    from fastdeploy.inter_communicator.ipc_signal_const import PrefixTreeStatus

    rm = filled()
    cm = rm.cache_manager
    cm.prefix_tree_status_signal = SimpleNamespace(value=np.array([PrefixTreeStatus.CLEARING]))
    before = list(cm.gpu_free_block_list)
    try:
        cm.free_block_ids_async(3)
    finally:
        del cm.prefix_tree_status_signal
    assert sorted(cm.gpu_free_block_list) == sorted(before)


def test_heap_merge_uses_heapify_for_large_batches():
    from fdsched.patches.deferred_recycle import merge_into_heap

    heap = list(range(0, 200, 2))
    heapq.heapify(heap)
    assert merge_into_heap(heap, list(range(1, 2000, 2)), 64) == "heapify"
    assert _is_heap(heap) and len(heap) == 100 + 1000
    assert merge_into_heap(heap, [5001, 5003], 64) == "push"
    assert _is_heap(heap) and sorted(heap)[:3] == [0, 1, 2] and heap[0] == 0


# ---- property test: random workloads through the real prefix cache with the plugin on ---------------
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "evict"]), st.integers(0, 5), st.integers(1, 6)),
        min_size=5,
        max_size=40,
    )
)
def test_random_insert_match_release_evict_keeps_accounting(ops, install_profile, make_manager):
    from fdsched.replay.driver import Driver
    from fdsched.replay.engine import logical_clock, make_request

    install_profile("recommended")
    with logical_clock():
        rm = make_manager(**dict(SHAPE, num_gpu_blocks=40))
        driver = Driver(rm)
        for n, (op, group, size) in enumerate(ops):
            if op == "add":
                prompt = [2000 + group * 50 + i for i in range(2 * BS)] + [n % 50 + 1] * (size * 2)
                driver.add(make_request(f"q{n}", prompt, 4), true_output_len=1 + size % 4)
            elif op == "step":
                driver.step()
            else:
                rm.cache_manager.free_block_ids_async(size)
            _check_accounting(rm)
        for _ in range(300):
            if driver.idle():
                break
            driver.step()
            _check_accounting(rm)
        assert driver.idle()


# ---- change 4: PD prefill-node recording ----------------------------------------------------------
def _p_request(rid, prompt):
    from fdsched.replay.engine import make_request

    request = make_request(rid, prompt, 1)
    request.disaggregate_info = {"role": "prefill"}
    return request


def _preallocate(rm, request):
    assert rm.preallocate_resource_in_p(request)
    rm.add_request_in_p([request])
    return request


def _matched_tokens(rm, prompt):
    """How many prompt tokens a new request would match in the prefix cache right now."""
    probe = _p_request(f"probe{len(prompt)}{random.random()}", prompt)
    _, matched, _ = rm.cache_manager.request_match_blocks(probe, BS)
    rm.cache_manager.release_block_ids(probe)
    return matched


PROMPT = [3000 + i for i in range(6 * BS)]


def _on_another_thread(func, *args):
    out = []
    thread = threading.Thread(target=lambda: out.append(func(*args)))
    thread.start()
    thread.join()
    return out[0]


@pytest.mark.parametrize("preallocation_thread", ["same", "another"])
@pytest.mark.parametrize("mode, matched_before_prefill", [("safe", 0), ("upstream", 6 * BS)])
def test_second_request_matches_only_written_kv(mode, matched_before_prefill, preallocation_thread, install_profile,
                                                 make_manager, clock):
    """In the engine the preallocation runs on another thread than schedule(): the gate tells the host's
    preallocation record from its chunk records by the request, so either thread gives the same answer."""
    install_profile("pd_prefill_cache", FDSCHED_PD_PREFILL_CACHE_MODE=mode)
    rm = make_manager(**dict(SHAPE, splitwise_role="prefill"))
    request = _p_request("first", PROMPT)
    first = _preallocate(rm, request) if preallocation_thread == "same" else _on_another_thread(_preallocate, rm, request)
    assert first.num_computed_tokens == 0
    # The first request's prefill has not run: no KV is written for its prompt yet.
    assert _matched_tokens(rm, PROMPT) == matched_before_prefill

    # Run its prefill (one chunk), give it its first token, finish it as a prefill node does.
    scheduled, _ = rm.schedule()
    assert [t.request_id for t in scheduled] == ["first"]
    first.output_token_ids.append(7)
    rm.finish_requests(["first"])
    # Whole blocks of the prompt (all 6) are now recorded under both behaviours.
    assert _matched_tokens(rm, PROMPT) == 6 * BS


def test_pd_off_on_a_prefill_node_records_per_chunk_as_before(install_profile, make_manager, clock, host_info):
    install_profile("baseline")
    rm = make_manager(**dict(SHAPE, splitwise_role="prefill", max_num_batched_tokens=2 * BS))
    _preallocate(rm, _p_request("first", PROMPT))
    assert _matched_tokens(rm, PROMPT) == 0
    rm.schedule()  # first chunk: 2 blocks scheduled -> recorded at scheduling (pre-change behaviour)
    assert _matched_tokens(rm, PROMPT) == 2 * BS

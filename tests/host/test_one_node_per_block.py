"""Host fix ``one_node_per_block`` against the real PrefixCacheManager / ResourceManagerV1.

The smallest reproduction of the defect: one prompt of two whole blocks runs to completion (its blocks stay in the
radix tree), then the same prompt again. Every block of the second matches, so the scheduler recomputes its last
block (``num_computed_tokens = matched - block_size``) and records that; FastDeploy's prefix cache then writes the
request's cached count down below its leaf, and the next record builds a second node for a block the leaf's path
already holds. With the host alone that second node exists; with the fix (``auto``, every shipped profile) it does
not, and the block accounting holds when the cache is evicted afterwards. A line whose ``update_cache_blocks`` skips a
record at or below the cached count (FastDeploy's 2.6 head, develop) builds no second node by itself: there the fix
is "not needed" and ``off`` shows no defect.
"""

from __future__ import annotations

from collections import Counter

import pytest

from .workloads import tree_nodes

BS = 4
SHAPE = dict(block_size=BS, num_gpu_blocks=12, max_num_seqs=2, max_num_batched_tokens=4, max_model_len=16)
PROMPT = [101, 102, 103, 104, 105, 106, 107, 108]  # two whole blocks
OTHER = [201, 202, 203]  # a request that decodes meanwhile, so the repeat's recomputed block comes in two chunks


def _blocks_of_two_nodes(cm) -> list:
    counts = Counter(node.block_id for node in tree_nodes(cm))
    return sorted(block for block, count in counts.items() if count > 1)


def _run_prompt_twice(rm):
    """The same two-block prompt twice, the second while another request decodes (a token budget of 4 leaves it 3,
    so its recomputed last block is recorded in two chunks, as in a busy engine); returns the block ids that two
    radix-tree nodes hold at some step."""
    from fdsched.replay.driver import Driver
    from fdsched.replay.engine import make_request

    driver = Driver(rm)
    driver.add(make_request("first", list(PROMPT), 1), true_output_len=1)
    for _ in range(20):
        driver.step()
        if driver.idle():
            break
    assert driver.idle(), "the first request did not finish"
    driver.add(make_request("other", list(OTHER), 6), true_output_len=6)
    driver.step()  # its prefill; from now on it decodes one token a step and leaves the repeat 3 of the 4 tokens
    driver.add(make_request("again", list(PROMPT), 3), true_output_len=3)
    twice = []
    for _ in range(20):
        driver.step()
        twice = twice or _blocks_of_two_nodes(rm.cache_manager)
        if driver.idle():
            break
    assert driver.idle(), "the second request did not finish"
    return twice


def _evict_all_and_check(rm):
    """Evict every cached node; then no block may be in the free list twice and every block must be free."""
    cm = rm.cache_manager
    cm.free_block_ids(SHAPE["num_gpu_blocks"])
    free = list(cm.gpu_free_block_list)
    return sorted(b for b, c in Counter(free).items() if c > 1), len(set(free))


def _host_has_it() -> bool:
    """The line records no count below the cached one by itself (the probe reads ``update_cache_blocks``)."""
    from fdsched.install.probe import probe

    return bool(probe().has.get("one_node_per_block"))


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_a_fully_cached_prompt_gets_one_node_per_block(install_profile, make_manager, mode):
    install_profile("baseline", FDSCHED_ONE_NODE_PER_BLOCK=mode)
    rm = make_manager(**SHAPE)
    twice = _run_prompt_twice(rm)
    doubled, free = _evict_all_and_check(rm)
    if mode == "off" and not _host_has_it():  # FastDeploy's own recording: the defect, as it is on every line
        assert twice, "the host no longer builds a second node for a cached block: the fix may be deleted"
        assert doubled, "evicting both nodes no longer frees their block twice"
    else:
        assert twice == []
        assert doubled == [] and free == SHAPE["num_gpu_blocks"]


@pytest.mark.parametrize("profile", ["baseline", "recommended", "adaptive", None])
def test_every_shipped_profile_applies_the_fix(install_profile, profile):
    report = install_profile(profile)
    decision = report.decisions["one_node_per_block"]
    expected = ("auto", "host") if _host_has_it() else ("auto", "plugin")  # not needed: the host's own code
    assert (decision.mode, decision.impl) == expected, decision.detail


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_the_guard_reports_a_block_two_nodes_hold(install_profile, make_manager, monkeypatch, caplog, mode):
    """The engine guard's audit (here every pass) finds the second node as soon as the host builds it, and the block
    freed twice after the eviction; one error line and one ``block_owner_conflict`` event per episode. With the fix
    there is nothing to find, and it reports nothing."""
    from fdsched.core.metrics import METRICS
    from fdsched.patches import _guard

    monkeypatch.setattr(_guard, "AUDIT_INTERVAL_S", 0.0)
    defect = mode == "off" and not _host_has_it()
    install_profile("baseline", FDSCHED_ONE_NODE_PER_BLOCK=mode)
    rm = make_manager(**SHAPE)
    with caplog.at_level("ERROR"):
        twice = _run_prompt_twice(rm)
        after_run = METRICS.guard_events["block_owner_conflict"]
        _evict_all_and_check(rm)
        rm.schedule(), rm.schedule()  # two passes: an audit and its confirmation
    lines = [r.getMessage() for r in caplog.records if "KV block accounting" in r.getMessage()]
    if defect:
        assert twice and after_run == 1, (twice, after_run)
        assert any("held by two prefix-cache nodes" in line for line in lines), lines
        assert METRICS.guard_events["block_owner_conflict"] == 2  # then the block free twice
        assert any("twice in the free list" in line for line in lines), lines
    else:
        assert METRICS.guard_events["block_owner_conflict"] == 0 and lines == []

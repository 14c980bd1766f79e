"""The engine guard's block audit (fdsched.core.blocks): what it finds from plain lists, and when it reports."""

from __future__ import annotations

from fdsched.core.blocks import BOTH, LEAKED, TWICE_FREE, TWO_NODES, BlockAudit, check_blocks, kind_of


def test_two_nodes_holding_one_block_is_a_finding_before_anything_is_freed():
    # 4 blocks: 0 and 1 cached (1 by two nodes), 2 held by a request, 3 free: the accounting itself holds
    assert check_blocks(4, [3], {"a": [2]}, [0, 1, 1]) == []
    found = check_blocks(4, [3], {"a": [2]}, [0, 1, 1], node_blocks=[0, 1, 1])
    assert found == [f"{TWO_NODES}: [1]"]
    assert kind_of(found[0]) == TWO_NODES


def test_each_finding_has_its_kind():
    found = check_blocks(4, [3, 3, 0], {"a": [0]}, [])
    assert {kind_of(f) for f in found} == {TWICE_FREE, BOTH, LEAKED}


def test_a_finding_is_reported_when_the_next_audit_confirms_it_then_once_per_episode():
    audit = BlockAudit(interval=10.0)
    assert audit.due(0.0)
    both = f"{BOTH}: [5] (block 5 held by: r1, prefix cache)"
    assert audit.record(0.0, [both]) == []  # a suspicion: checked again at the next pass
    assert audit.due(0.001)
    assert audit.record(0.001, [both]) == [both]  # confirmed: reported
    assert not audit.due(5.0) and audit.due(10.001)
    assert audit.record(10.001, [both]) == []  # the same episode: not again
    assert audit.record(20.0, []) == []  # the episode ends
    assert audit.record(30.0, [both]) == [] and audit.record(30.01, [both]) == [both]  # a new one is reported


def test_a_finding_the_next_audit_does_not_see_is_never_reported():
    audit = BlockAudit(interval=10.0)
    assert audit.record(0.0, [f"{TWICE_FREE}: [2]"]) == []
    assert audit.record(0.001, []) == []  # a state caught mid-update by another thread: gone a pass later
    assert not audit.due(5.0)
    assert audit.record(10.0, [f"{BOTH}: [2]"]) == []  # another kind needs its own confirmation


def test_a_leak_alone_is_not_reported():
    # blocks in flight between a request and the free list (another thread's free) are neither; never two owners
    audit = BlockAudit(interval=0.0)
    leak = f"{LEAKED} by a request or the prefix cache (leaked): [1]"
    assert audit.record(0.0, [leak]) == [] and audit.record(0.0, [leak]) == []


def test_a_costly_audit_waits_longer_for_the_next():
    audit = BlockAudit(interval=10.0)
    assert audit.gap(0.001) == 10.0
    assert audit.gap(0.08) == 0.08 / BlockAudit.SHARE  # 80 s: the audits keep to their share of the thread
    audit.record(5.0, [], spent=0.08)
    assert not audit.due(84.0) and audit.due(85.0)


def test_an_interval_of_zero_audits_every_pass():
    audit = BlockAudit(interval=0.0)
    audit.record(1.0, [], spent=0.5)
    assert audit.due(1.0)

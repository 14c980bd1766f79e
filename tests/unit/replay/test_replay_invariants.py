"""Block accounting and request bookkeeping checks. No host."""

from __future__ import annotations

from fdsched.replay.invariants import check_blocks, check_requests


def test_consistent_state_has_no_violation():
    # 0..7: free 0,1; request a holds 2,3 (3 cached); b holds 3,4 (3 shared through the cache); cache holds 3,5,6,7
    assert check_blocks(8, [1, 0], {"a": [2, 3], "b": [3, 4]}, [3, 5, 6, 7, 7]) == []


def test_duplicate_in_free_list():
    problems = check_blocks(4, [0, 1, 1], {"a": [2, 3]}, [])
    assert any("twice in the free list: [1]" in p for p in problems)


def test_free_and_used_at_once():
    problems = check_blocks(4, [0, 1, 2], {"a": [2, 3]}, [])
    assert any("both free and in use: [2]" in p and "held by: a" in p for p in problems)
    problems = check_blocks(4, [0, 1, 3], {"a": [2]}, [3])
    assert any("both free and in use: [3]" in p and "prefix cache" in p for p in problems)


def test_leaked_block():
    problems = check_blocks(5, [0, 1], {"a": [2]}, [3])
    assert problems == ["block ids neither free nor held by a request or the prefix cache (leaked): [4]"]


def test_out_of_range():
    problems = check_blocks(3, [0, 1], {"a": [2, 9]}, [])
    assert any("out of range(0, 3): [9]" in p for p in problems)


def test_uncached_block_shared_by_two_requests():
    problems = check_blocks(4, [0, 1], {"a": [2, 3], "b": [3]}, [])
    assert any("uncached block ids held by more than one request: [3]" in p and "held by: a, b" in p for p in problems)


def test_long_id_lists_are_shortened():
    problems = check_blocks(40, [], {}, [])
    assert problems == [
        "block ids neither free nor held by a request or the prefix cache (leaked): [0, 1, 2, 3, 4, 5, 6, 7, ... (40 in all)]"
    ]


def test_requests_finished_once():
    assert check_requests(["a", "b"], {"a": 1, "b": 1}, drained=True) == []
    assert check_requests(["a", "b"], {"a": 2, "b": 1}, drained=True) == ["requests finished more than once: a"]
    assert check_requests(["a", "b"], {"a": 1}, drained=True) == [
        "requests lost (the engine drained without finishing them): b"
    ]
    assert check_requests(["a", "b"], {"a": 1}, drained=False) == []  # cut short: not drained, not lost
    assert check_requests(["a"], {"a": 1, "z": 1}, drained=True) == ["finished requests that the trace does not have: z"]

"""The server-side done list of change 5 is plain Python: test it without a host."""

from __future__ import annotations

import threading
import time

from fdsched.patches.nonpolling_transfer import WaitableDoneList


def test_plain_list_behaviour_is_unchanged():
    items = WaitableDoneList([1, 2])
    items.append(3)
    assert items.pop(0) == 1 and list(items) == [2, 3] and len(items) == 2


def test_an_empty_wait_returns_none_after_the_wait():
    items = WaitableDoneList()
    started = time.perf_counter()
    assert items.pop(0, 0.05) is None
    assert time.perf_counter() - started >= 0.04
    assert len(items) == 0


def test_a_waiter_is_woken_by_an_append():
    items = WaitableDoneList()
    got = []
    waiter = threading.Thread(target=lambda: got.append(items.pop(0, 5.0)))
    waiter.start()
    time.sleep(0.05)
    started = time.perf_counter()
    items.append("done")
    waiter.join(timeout=5)
    assert got == ["done"] and time.perf_counter() - started < 1.0


def test_a_taken_item_counts_until_acknowledged():
    items = WaitableDoneList(["a", "b"])
    assert items.pop(0, 0.01) == "a"
    assert len(items) == 2, "'a' is in flight: still pending for result_queue_empty()"
    assert items.pop(0, 0.01, True) == "b"  # acknowledges 'a', takes 'b'
    assert len(items) == 1
    assert items.pop(0, 0.01, True) is None  # acknowledges 'b'
    assert len(items) == 0


def test_order_is_first_in_first_out_under_concurrent_producers():
    items = WaitableDoneList()

    def produce(base):
        for i in range(100):
            items.append((base, i))

    producers = [threading.Thread(target=produce, args=(b,)) for b in range(4)]
    for p in producers:
        p.start()
    got, ack = [], False
    while len(got) < 400:
        item = items.pop(0, 1.0, ack)
        ack = item is not None
        if item is not None:
            got.append(item)
    for p in producers:
        p.join()
    for base in range(4):
        assert [i for b, i in got if b == base] == list(range(100))


def test_only_the_plugins_list_answers_the_clients_question():
    from fdsched.patches.nonpolling_transfer import WAITABLE_ANSWER, WAITABLE_QUERY

    assert WaitableDoneList([("a",), WAITABLE_QUERY]).count(WAITABLE_QUERY) == WAITABLE_ANSWER
    assert [("a",)].count(WAITABLE_QUERY) == 0  # the host's list
    assert WaitableDoneList([("a",), ("a",)]).count(("a",)) == 2  # every other count is a list's

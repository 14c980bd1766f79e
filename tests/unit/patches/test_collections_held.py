"""deferred_recycle.collections_held: the collector is off inside, restored outside, across nesting and threads."""

from __future__ import annotations

import gc
import threading

import pytest

from fdsched.patches.deferred_recycle import collections_held


@pytest.fixture(autouse=True)
def _restore_gc():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_off_inside_on_after_also_when_nested_and_on_error():
    gc.enable()
    with collections_held():
        assert not gc.isenabled()
        with collections_held():
            assert not gc.isenabled()
        assert not gc.isenabled(), "the inner hold re-enabled the collector while the outer one is open"
    assert gc.isenabled()
    with pytest.raises(KeyError):
        with collections_held():
            raise KeyError("boom")
    assert gc.isenabled()


def test_a_caller_that_disabled_the_collector_keeps_it_disabled():
    gc.disable()
    with collections_held():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_holds_in_two_threads_reenable_only_when_the_last_ends():
    gc.enable()
    inside, release = threading.Event(), threading.Event()

    def other():
        with collections_held():
            inside.set()
            release.wait(5)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(5)
    with collections_held():
        pass
    assert not gc.isenabled(), "this thread's hold ended while the other's is open: the collector must stay off"
    release.set()
    thread.join(5)
    assert gc.isenabled()

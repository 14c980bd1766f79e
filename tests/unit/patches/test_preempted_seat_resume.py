"""The seat fix's decisions with plain values (the host-tier tests drive the real scheduler)."""

from __future__ import annotations

from types import SimpleNamespace

from fdsched.patches._guard import nothing_scheduled
from fdsched.patches.preempted_seat_resume import seats_locked


class _Batch:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def _queue(*statuses):
    return [SimpleNamespace(status=status) for status in statuses]


class _Unread(list):
    """A waiting queue that fails if it is read: the predicate's cheaper terms decide first."""

    def _read(self, *args):
        raise AssertionError("the waiting queue was read")

    __bool__ = __len__ = __getitem__ = __iter__ = _read


def test_seats_are_locked_only_when_nothing_runs_or_is_in_flight_and_preempted_requests_hold_every_seat():
    P, W = "preempted", "waiting"
    assert seats_locked(running=0, in_flight=0, waiting=_queue(P, P, P), preempted=P, seats=3)
    assert seats_locked(running=0, in_flight=0, waiting=_queue(P, W), preempted=P, seats=1)
    assert seats_locked(running=0, in_flight=0, waiting=_queue(P, W, P, P), preempted=P, seats=3)
    assert not seats_locked(running=0, in_flight=0, waiting=_queue(W, P, P, P), preempted=P, seats=3)  # head
    assert not seats_locked(running=0, in_flight=0, waiting=_queue(P, P, W), preempted=P, seats=3)
    assert not seats_locked(running=0, in_flight=0, waiting=_queue(), preempted=P, seats=1)
    assert not seats_locked(running=1, in_flight=0, waiting=_Unread(), preempted=P, seats=3)
    assert not seats_locked(running=0, in_flight=1, waiting=_Unread(), preempted=P, seats=3)


def test_nothing_scheduled_reads_a_list_or_a_batch_and_says_no_when_it_cannot_tell():
    assert nothing_scheduled(([], [])) and not nothing_scheduled(([object()], []))
    assert nothing_scheduled((_Batch(0), [])) and not nothing_scheduled((_Batch(2), []))
    assert not nothing_scheduled((object(), []))  # unknown: the fix does nothing
    assert not nothing_scheduled([]) and not nothing_scheduled(None)  # not a pass's (tasks, ...) result

"""The host's ordering that can finish a request twice, replayed step by step on the real ResourceManagerV1.

Seen once in the served engine under load (two ranks, new host, baseline and adaptive alike): a request whose last
token arrived while its preemption was in flight was scheduled again, prefilled again and finished a second time.
The steps below are the host's own calls, in the order its threads can make them on the ZMQ output path:

1. the token processor hands the request's finish to a thread pool (``finish_requests_async``): until it runs,
   the request is still in ``running``;
2. the scheduler thread preempts it (it is the last decoding request);
3. the next output batch does not carry its slot (the worker ended it with its last token), and the output reader
   reschedules every preempted request whose slot is absent (``_reschedule_preempt_task_use_zmq`` calls
   ``reschedule_preempt_task``), without waiting for its -9 acknowledgement;
4. the finish task runs: ``finish_requests`` finds the request in ``waiting``, logs "scheduled into waiting list,
   after finished" and leaves it there.

Without the plugin the request is left waiting, to be scheduled again (the host's behaviour, pinned: when a host
stops allowing it, the first test fails and says so). With the plugin loaded, under any arm (``baseline`` too), the
finish ends it there: it leaves ``waiting`` and ``requests``, its blocks stay free, its slot stays as it is, and the
next pass does not schedule it.
"""

from __future__ import annotations

import pytest

from .test_cherry_pick_7783 import rm_for  # noqa: F401  (the fixture: a scheduler under a profile)
from .test_scheduler_changes import _drain_pool, _place


def _finish_during_preemption(rm):
    """Steps 1-4 above; returns (the request finished during its preemption, the blocks holding the pool)."""
    target = _place(rm, "req-prefill", 8, computed=0)  # a prefill that needs blocks
    done = _place(rm, "req-done", 8, generated=4)  # its last token is out; its finish waits in the pool (step 1)
    holder = _drain_pool(rm)

    preempted, scheduled = [], []
    rm._trigger_preempt(target, 2, preempted, scheduled)  # step 2
    assert preempted == [done] and done.request_id in rm.to_be_rescheduled_request_id_set

    rm.reschedule_preempt_task(done.request_id)  # step 3: its slot is absent from the next batch
    assert done in rm.waiting
    rm.finish_requests([done.request_id])  # step 4: the finish task runs
    return done, holder


def _scheduled_ids(rm) -> list:
    out = rm.schedule()
    tasks = out[0] if isinstance(out, tuple) else out
    return [t.request_id for t in tasks]


def test_without_the_plugin_the_host_leaves_it_to_run_again(make_manager, host_info):
    from .test_cherry_pick_7783 import SHAPE

    rm = make_manager(**SHAPE)
    assert not hasattr(type(rm), "_fdsched_impl"), "the host's own class is expected here"
    try:
        done, holder = _finish_during_preemption(rm)
    except RuntimeError as exc:  # hosts that raise here instead of logging (2.4)
        assert "after finished" in str(exc)
        return
    if done not in rm.waiting:
        pytest.fail("this host no longer leaves a finished request in waiting after a reschedule: the ordering in "
                    "docs/engine.md ('A host ordering that can finish a request twice') is gone; update the doc")
    assert done.request_id in rm.requests
    rm.cache_manager.recycle_gpu_blocks(holder)  # room again: the next step schedules it, a second prefill
    assert done.request_id in _scheduled_ids(rm)


@pytest.mark.parametrize("profile", ["baseline", "recommended"])
def test_with_the_plugin_a_request_finished_during_its_preemption_ends_there(rm_for, profile):
    from fdsched.core.metrics import METRICS

    rm = rm_for(profile)
    done, holder = _finish_during_preemption(rm)
    assert done not in rm.waiting and done.request_id not in rm.requests
    assert done.request_id not in rm.req_dict and done.request_id not in rm.to_be_rescheduled_request_id_set
    assert done.status == rm._fdsched_host.request_status.FINISHED
    assert METRICS.requests_finished == 1  # counted once, here
    free_before = len(rm.cache_manager.gpu_free_block_list)
    rm.cache_manager.recycle_gpu_blocks(holder)
    assert len(rm.cache_manager.gpu_free_block_list) == free_before + len(holder)
    assert done.request_id not in _scheduled_ids(rm)
    rm.finish_requests([done.request_id])  # a late second finish: nothing left to do, nothing raised
    assert METRICS.requests_finished == 1

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

This pins the host's behaviour, under the host's own preemption (baseline) and the plugin's (recommended): the
request is left waiting, to be scheduled again. When a host stops allowing it, this test fails and says so.
"""

from __future__ import annotations

import pytest

from .test_cherry_pick_7783 import rm_for  # noqa: F401  (the fixture: a scheduler under a profile)
from .test_scheduler_changes import _drain_pool, _place


@pytest.mark.parametrize("profile", ["baseline", "recommended"])
def test_a_request_finished_while_its_preemption_is_in_flight_is_left_to_run_again(rm_for, profile):
    rm = rm_for(profile)
    target = _place(rm, "req-prefill", 8, computed=0)  # a prefill that needs blocks
    done = _place(rm, "req-done", 8, generated=4)  # its last token is out; its finish waits in the pool (step 1)
    holder = _drain_pool(rm)

    preempted, scheduled = [], []
    rm._trigger_preempt(target, 2, preempted, scheduled)  # step 2
    assert preempted == [done] and done.request_id in rm.to_be_rescheduled_request_id_set

    rm.reschedule_preempt_task(done.request_id)  # step 3: its slot is absent from the next batch
    rm.finish_requests([done.request_id])  # step 4: the finish task runs

    if done not in rm.waiting:
        pytest.fail("this host no longer leaves a finished request in waiting after a reschedule: the ordering in "
                    "docs/engine.md ('A host ordering that can finish a request twice') is gone; update the doc")
    assert done.request_id in rm.requests  # still the host's
    rm.cache_manager.recycle_gpu_blocks(holder)  # room again: the next step schedules it, a second prefill
    out = rm.schedule()
    tasks = out[0] if isinstance(out, tuple) else out
    assert done.request_id in [t.request_id for t in tasks], [t.request_id for t in tasks]

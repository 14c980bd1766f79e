"""Small deterministic workloads driven through the real scheduler (shared by host tests)."""

from __future__ import annotations

import random


def tree_nodes(cm):
    """Every radix-tree node below a prefix cache's root, by walking the children maps."""
    nodes, stack = [], [cm.radix_tree_root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            nodes.append(child)
            stack.append(child)
    return nodes


def kv_pressure_requests(seed=3, count=14, arrival_span=10, prompt=(8, 40), output=(20, 56), max_tokens=56):
    """(arrival step, id, prompt tokens, true output length, max_tokens) for a pool that runs short."""
    rnd = random.Random(seed)
    return [
        (
            rnd.randrange(0, arrival_span),
            f"r{i}",
            [rnd.randrange(50) for _ in range(rnd.randrange(*prompt))],
            rnd.randrange(*output),
            max_tokens,
        )
        for i in range(count)
    ]


PRESSURE_SHAPE = dict(block_size=4, num_gpu_blocks=34, max_num_seqs=6, max_num_batched_tokens=48, max_model_len=96)


def run_workload(manager, requests, max_steps=3000, on_step=None):
    """Drive ``requests`` through ``manager``; return the list of StepRecords."""
    from fdsched.replay.driver import Driver
    from fdsched.replay.engine import make_request

    driver = Driver(manager)
    records = []
    last_arrival = max(r[0] for r in requests)
    for step in range(max_steps):
        for arrival, rid, prompt, out, max_tokens in requests:
            if arrival == step:
                driver.add(make_request(rid, prompt, max_tokens), true_output_len=out)
        record = driver.step()
        records.append(record)
        if on_step is not None:
            on_step(driver, record)
        if step >= last_arrival and driver.idle():
            return records
    raise AssertionError(f"workload did not drain in {max_steps} steps")


def fingerprint(records):
    return [
        (r.step, r.scheduled_prefill_tokens, r.decode_tokens, tuple(r.finished), tuple(r.preempted), r.blocks_used,
         r.running, r.waiting)
        for r in records
    ]


# KV pressure under which the baseline preempts prefills and recommended still preempts (decoders only).
PREFILL_VICTIM_WORKLOAD = dict(seed=4, count=24, prompt=(30, 90), output=(10, 40))


class StepClock:
    """Seconds of a modelled engine: 20 ms per step of the driver it belongs to."""

    def __init__(self):
        self.driver = None

    def __call__(self):
        return 1000.0 + 0.02 * (self.driver.step_no if self.driver is not None else 0)


def stamped_driver(manager):
    """A Driver that stamps request timestamps (arrival, first / latest token) with a :class:`StepClock`."""
    from fdsched.replay.driver import Driver

    clock = StepClock()
    driver = Driver(manager, clock=clock)
    clock.driver = driver
    return driver


def drive_together(managers, requests, max_steps=3000):
    """Drive every manager (rank -> manager) through the same workload, one step each in turn.

    Returns rank -> the victim phases of its preemptions."""
    from fdsched.replay.engine import make_request

    drivers = {rank: stamped_driver(m) for rank, m in managers.items()}
    victims = {rank: [] for rank in managers}
    last_arrival = max(r[0] for r in requests)
    for step in range(max_steps):
        for rank, driver in drivers.items():
            for arrival, rid, prompt, out, max_tokens in requests:
                if arrival == step:
                    driver.add(make_request(rid, prompt, max_tokens), true_output_len=out)
            victims[rank] += [phase for _, phase in driver.step().preempted]
        if step >= last_arrival and all(d.idle() for d in drivers.values()):
            return victims
    raise AssertionError(f"workload did not drain in {max_steps} steps")

"""A decode node whose running requests are all prefilled ones it never stepped schedules nothing, for good, with the
host alone; the host fix ``decode_node_reserve`` drains it under every shipped profile. No engine: the host's own
``ResourceManagerV1`` in the decode role, the engine's feeding, the worker and the token processor played around it.

The smallest reproduction of the stall the served PD stack showed under decode-side preemption on the new host
(``fdsched serve-pd-bench --burst 8``): a pool of 48 blocks of 16 and eight prompts of 40 tokens with ``max_tokens``
150, as on the served stack, then four more once the eight are done. Prefix caching is off: a decode node is handed
its KV and matches nothing (2.4 and 2.5 would record a decode node's running chunk in a prefix tree that never had
the request).

How the new host (d38eeb8) gets there, ``engine/sched/resource_manager_v1.py``:

* ``preallocate_resource_in_d`` (1505-1536) allocates a prefilled request's blocks (its prompt and
  ``enc_dec_block_num`` more) and sets ``num_computed_tokens`` to the prompt; ``add_prefilled_request``
  (1549-1590) appends the first token, sets ``need_prefill_tokens`` to the prompt + 1 and puts it in ``running``;
* so ``schedule()`` sees a running request that still needs one prefill token; its running-queue prefill branch
  (996-1013) admits a chunk only if ``can_allocate_gpu_blocks(_get_can_schedule_prefill_threshold_block(
  num_new_block))``: free blocks above the reservation for *every* running request (488-504; by new-token ratio,
  7 blocks per 150-token answer at the initial 0.7), itself included, although the chunk needs no new block;
  otherwise ``break``, and nothing after it in ``running`` is scheduled either;
* the reservation relaxes only after a pass that scheduled something (1198-1210);
* so with eight such requests (56 blocks reserved, 8 free) no pass schedules anything, nothing decodes, nothing
  finishes, nothing frees, the reservation never relaxes: the node is stuck, its blocks held, its worker idle.

The old host (e7c8dc2) asks that branch only for the chunk's own blocks (``can_allocate_gpu_blocks(num_new_block)``,
about 908-915) and preempts when it cannot: the same bursts drain there, 6 finished and 6 preempted (a decode node
hands a preempted request back to the Router). With the fix the new host does exactly that. Which behaviour a host
has is read from its ``schedule()``: whether the running queue's prefill branch asks for the reservation too; the
plugin's probe must agree with that reading.
"""

from __future__ import annotations

import pytest

SHAPE = dict(num_gpu_blocks=48, block_size=16, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
             splitwise_role="decode", enc_dec_block_num=2, enable_prefix_caching=False)
PROMPT, MAX_TOKENS = 40, 150
PREALLOCATED = (PROMPT + 15) // 16 + 2  # the prompt's blocks and enc_dec_block_num


class DecodeNode:
    """The host's decode scheduler, with the engine's feeding, the worker and the token processor played around it."""

    def __init__(self):
        from fastdeploy.engine.sched import resource_manager_v1

        from fdsched.replay.engine import EngineShape, host_config

        config = host_config(EngineShape(**SHAPE), replay_check=False)
        self.rm = resource_manager_v1.ResourceManagerV1(max_num_seqs=SHAPE["max_num_seqs"], config=config,
                                                        tensor_parallel_size=1, splitwise_role="decode")
        self.handed = set()  # request ids the worker was given (a task for their first step)
        self.preempted, self.finished = [], []

    def arrive(self, rids) -> bool:
        """The prefill node sends these requests at once: each is preallocated when the connector brings it (before
        its prefill), then added as prefilled when the first token and the KV arrive. False: a preallocation
        failed (the host answers the prefill "Not enough resources")."""
        from fastdeploy.engine.request import CompletionOutput, RequestOutput

        from fdsched.replay.engine import make_request

        requests = [make_request(rid, list(range(100, 100 + PROMPT)), MAX_TOKENS) for rid in rids]
        if not all(self.rm.preallocate_resource_in_d(r) for r in requests):
            return False
        for request in requests:
            out = RequestOutput(request_id=request.request_id, finished=False,
                                outputs=CompletionOutput(index=0, send_idx=0, token_ids=[7]))
            out.metrics, out.num_cached_tokens = request.metrics, 0
            self.rm.add_prefilled_request(out)
        return True

    def step(self) -> int:
        """One schedule() pass and one step of the worker; how many tasks the pass gave."""
        tasks, errors = self.rm.schedule()
        assert not errors, errors
        for task in tasks:
            kind = type(task).__name__
            if kind == "ScheduledPreemptTask":
                self.preempted.append(task.request_id)
                self.handed.discard(task.request_id)
            elif kind == "Request":
                self.handed.add(task.request_id)
        for request in list(self.rm.running):
            if request.request_id in self.handed:
                request.output_token_ids.append(9)
                if len(request.output_token_ids) >= MAX_TOKENS:  # the token processor's recycle
                    self.handed.discard(request.request_id)
                    self.finished.append(request.request_id)
                    self.rm.stop_flags[request.idx] = True
                    self.rm.tasks_list[request.idx] = None
                    self.rm.finish_requests(request.request_id)
        return len(tasks)

    def run(self, steps: int = 2000, idle: int = 50) -> bool:
        """Step until nothing runs (True) or ``idle`` passes in a row give nothing with requests running (False)."""
        quiet = 0
        for _ in range(steps):
            if not self.rm.running:
                return True
            quiet = 0 if self.step() else quiet + 1
            if quiet >= idle:
                return False
        raise AssertionError(f"neither drained nor stuck in {steps} passes")

    def free(self) -> int:
        return len(self.rm.cache_manager.gpu_free_block_list)

    def close(self):
        from fdsched.replay.engine import close_manager

        close_manager(self.rm)


@pytest.fixture
def node():
    """The host's scheduler with no plugin installed."""
    from .conftest import skip_where_the_replay_declines

    skip_where_the_replay_declines()  # the node is built as the replay builds its scheduler
    n = DecodeNode()
    assert type(n.rm).__module__ == "fastdeploy.engine.sched.resource_manager_v1", "the plugin is installed"
    yield n
    n.close()


@pytest.fixture
def node_with(install_profile):
    """node_with(profile=None, **env): the scheduler under the plugin, installed with a shipped profile (None: no
    profile) and these switches (a profile the line refuses skips, naming why)."""
    made = []

    def _make(profile=None, **env):
        from .conftest import skip_where_the_replay_declines

        from fdsched.install.installer import InstallError

        skip_where_the_replay_declines()  # the node is built as the replay builds its scheduler
        try:
            install_profile(profile, **env)
        except InstallError as exc:  # a switch set ``on`` where the line's seams differ: refused in one line
            pytest.skip(f"{env} is refused on this line ({str(exc).split(' cannot be applied')[0]})")
        n = DecodeNode()
        assert type(n.rm).__module__ != "fastdeploy.engine.sched.resource_manager_v1", "the plugin is not installed"
        made.append(n)
        return n

    yield _make
    for n in made:
        n.close()


def running_chunks_wait_for_the_reservation() -> bool:
    """Whether the host's ``schedule()`` asks for the reservation inside its loop over the running queue (every line
    asks for it for the waiting queue's requests)."""
    import ast
    import inspect
    import textwrap

    from fastdeploy.engine.sched import resource_manager_v1

    tree = ast.parse(textwrap.dedent(inspect.getsource(resource_manager_v1.ResourceManagerV1.schedule)))
    for loop in ast.walk(tree):
        if isinstance(loop, ast.While) and "self.running" in ast.unparse(loop.test):
            return any(isinstance(node, ast.Attribute) and node.attr == "_get_can_schedule_prefill_threshold_block"
                       for node in ast.walk(loop))
    raise AssertionError("the host's schedule() has no loop over self.running")


def test_prefilled_requests_the_decode_never_stepped_hold_their_blocks_for_good(node):
    assert node.arrive([f"a{i}" for i in range(8)])
    if not running_chunks_wait_for_the_reservation():  # the old host: both bursts drain, preempting on the way
        assert node.run() and node.preempted and node.finished
        assert node.arrive([f"b{i}" for i in range(4)]) and node.run()
        assert sorted(node.finished + node.preempted) == sorted([f"a{i}" for i in range(8)] + [f"b{i}" for i in range(4)])
        assert node.free() == SHAPE["num_gpu_blocks"]
        return
    assert not node.run(), "the burst drained"
    stuck = list(node.rm.running)
    assert len(stuck) == 8 and not node.handed and not node.preempted, "a running request was stepped or preempted"
    assert all(len(r.block_tables) == PREALLOCATED for r in stuck)
    assert all(node.rm.get_new_block_nums(r, 1) <= 0 for r in stuck), "a stuck request needs a new block"
    free = node.free()
    assert free == SHAPE["num_gpu_blocks"] - 8 * PREALLOCATED and free > 0
    for _ in range(200):
        assert node.step() == 0
    assert node.free() == free and [r.request_id for r in node.rm.running] == [r.request_id for r in stuck]


def assert_stuck(node) -> None:
    """The eight prefilled requests hold their blocks, and no pass schedules anything."""
    assert not node.run(), "the burst drained"
    stuck = list(node.rm.running)
    assert len(stuck) == 8 and not node.handed and not node.preempted, "a running request was stepped or preempted"
    assert all(len(r.block_tables) == PREALLOCATED for r in stuck)
    free = node.free()
    assert free == SHAPE["num_gpu_blocks"] - 8 * PREALLOCATED and free > 0
    for _ in range(50):
        assert node.step() == 0
    assert node.free() == free


def assert_both_bursts_drain(node) -> None:
    """Eight, then four: every request finishes or is handed back preempted, once, and the pool is whole again."""
    assert node.run(), "the first burst stalled"
    assert node.arrive([f"b{i}" for i in range(4)]) and node.run(), "the second burst stalled"
    ended = node.finished + node.preempted
    assert sorted(ended) == sorted([f"a{i}" for i in range(8)] + [f"b{i}" for i in range(4)]), ended
    assert node.finished and not node.rm.running and node.free() == SHAPE["num_gpu_blocks"]


def test_the_probe_reads_the_defect_where_the_source_has_it(host_info):
    """The fix's probe (from the class and its code) says "not needed" exactly where the running pass never asks the
    reservation for a running chunk, or where the threshold itself reads the node's role (upstream's own fix)."""
    from fastdeploy.engine.sched import resource_manager_v1

    from fdsched.patches._base import code_names

    asks = running_chunks_wait_for_the_reservation()
    threshold = getattr(resource_manager_v1.ResourceManagerV1, "_get_can_schedule_prefill_threshold_block", None)
    reads_role = threshold is not None and "splitwise_role" in code_names(threshold)
    assert host_info.has["decode_node_reserve"] == (not asks or reads_role)


@pytest.mark.parametrize("arm", [
    (None, {}), ("baseline", {}), ("decode_only_preempt", {}), ("recommended", {}), ("adaptive", {}),
    (None, {"FDSCHED_DECODE_NODE_RESERVE": "on"}),
], ids=["no-profile", "baseline", "decode_only_preempt", "recommended", "adaptive", "fix-on"])
def test_with_the_fix_both_bursts_drain_as_on_a_line_without_the_defect(node_with, arm):
    profile, env = arm
    node = node_with(profile, **env)
    assert node.arrive([f"a{i}" for i in range(8)])
    assert_both_bursts_drain(node)


@pytest.mark.parametrize("profile", [None, "recommended"], ids=["host-reservation", "plugin-reservation"])
def test_with_the_fix_off_the_node_stalls_where_the_line_has_the_defect(node_with, host_info, profile):
    """Off, FastDeploy's reservation (no profile) and the plugin's (``recommended``) both hold a running chunk for
    the reservation, where the line's running pass asks it."""
    node = node_with(profile, FDSCHED_DECODE_NODE_RESERVE="off")
    assert node.arrive([f"a{i}" for i in range(8)])
    if host_info.has["decode_node_reserve"]:
        assert_both_bursts_drain(node)
    else:
        assert_stuck(node)


def test_a_preallocation_the_pool_refuses_is_counted_once_and_one_it_admits_never(node_with):
    """A decode node preallocates each arriving request's blocks outside any schedule() pass. Where the line's
    preallocation asks the threshold seam, the plugin's reservation decides there with no pass open: the verdict is
    made and counted at the seam as in a pass. Prompts of 13 blocks (plus the host's extra blocks) arrive until the
    pool cannot find one (nothing is cached to evict), before the seats run out: each admitted one counts nothing,
    the refused one once. Where the line's preallocation checks the pool itself, the plugin decides nothing there and
    counts nothing."""
    from fdsched.core.metrics import METRICS
    from fdsched.patches._base import code_names
    from fdsched.replay.engine import make_request

    node = node_with("recommended")
    host_class = type(node.rm)._fdsched_host_class
    asks_the_seam = "_get_can_schedule_prefill_threshold_block" in code_names(host_class.preallocate_resource_in_d)
    admitted = []
    for n in range(SHAPE["max_num_seqs"] - 1):
        request = make_request(f"p{n}", [1000 * (n + 1) + i for i in range(200)], MAX_TOKENS)
        if not node.rm.preallocate_resource_in_d(request):
            break
        admitted.append(request)
        assert METRICS.admissions_blocked == 0, n
    else:
        pytest.fail("the pool never refused a preallocation: the scene no longer exercises a refusal")
    assert len(admitted) >= 2 and node.free() < len(admitted[0].block_tables)
    assert METRICS.admissions_blocked == (1 if asks_the_seam else 0)
    assert node.rm._fdsched_plans.plan is None and node.rm._fdsched_plans.pending() == ()

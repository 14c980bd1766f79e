"""Host fix — a PD decode node admits a running request's prefill chunk on its own blocks.

Replaces:  ResourceManagerV1.get_new_block_nums (notes a running chunk's block count),
           ResourceManagerV1._get_can_schedule_prefill_threshold_block (that chunk's threshold is its own blocks); on a
           decode node only (the role is read once, when the scheduler is built)
Why:       a decode node adds each prefilled request to ``running`` with one prefill token left (the first token
           the prefill node sent). Upstream's running pass (PR 7444/7783) admits that one-token chunk only if the
           free blocks cover the reservation of every running request, although the chunk needs no new block. A
           burst that the node preallocated fills the pool past that reservation: no chunk is admitted, nothing
           decodes or finishes, the reservation relaxes only after a pass that scheduled something, so the node
           holds its blocks and schedules nothing, for good (``tests/host/test_decode_prefilled_stall.py``).
Upstream:  FastDeploy PR 8022 (develop) and 8021 (2.6), after every line here: on a PD node every chunk's threshold
           is its own blocks. This fix is narrower: only a running request's chunk, on a decode node; the
           preallocation of a new request keeps the host's reservation.
Needs it:  the lines whose running pass asks the reservation threshold for a running chunk (2.6 with 7783, the
           2.6 head, develop), read from ``schedule``'s code and the threshold's.
Switch:    FDSCHED_DECODE_NODE_RESERVE / changes.decode_node_reserve = auto | on | off, on a decode node only. It
           acts wherever a running chunk's threshold carries a reservation: FastDeploy's own (``ratio_reserve``
           ``auto``) or the plugin's (``on``); ``off`` (the pre-change reservation) already admits a running chunk
           on its own blocks, as FastDeploy did before 7783. A profile's ``changes.others`` does not set it;
           ``off`` keeps the host's reservation, to reproduce the stall.
Delete:    when every supported line has upstream's fix (PR 8022).
Relies on: (probed at install: ``on`` fails naming it; ``auto`` skips)
  * running-chunk-threshold: the running pass asks ``get_new_block_nums`` for a chunk, then the threshold for that
    count, then checks the threshold with ``can_allocate_gpu_blocks``.

How: the role is read once when the scheduler is built. In a pass on a decode node, ``get_new_block_nums`` for a
running request that still has prompt to compute notes (request, count) in the pass's plan; the threshold asked
next for that count is the count itself. Any other threshold (a preallocation, asked outside a pass; a waiting
request) is the host's, or the reservation change's.
"""

from __future__ import annotations

from fdsched.patches._spec import PatchSpec, Reliance, Variant
from fdsched.patches._base import code_names, node_role


class DecodeNodeReserve:
    """The fix, one per scheduler (see :mod:`fdsched.patches._scheduler`); on every role but decode it lets every call
    through and the scheduler leaves it out (``passes_all``: the role is fixed for the scheduler's life)."""

    seams = ("get_new_block_nums", "_get_can_schedule_prefill_threshold_block")

    def __init__(self, rm, settings, next):
        self.next, self.plans = next, rm._fdsched_plans
        self.passes_all = node_role(rm) != "decode"

    def get_new_block_nums(self, rm, request, num_new_tokens):
        blocks = self.next.get_new_block_nums(rm, request, num_new_tokens)
        plan = self.plans.current()
        if plan is not None:
            chunk = rm._fdsched_is_running_prefill(request)
            plan.running_chunk = (request.request_id, blocks) if chunk else None
        return blocks

    def _get_can_schedule_prefill_threshold_block(self, rm, num_chunk_new_block):
        plan = self.plans.current()
        if plan is not None and plan.running_chunk is not None and plan.running_chunk[1] == num_chunk_new_block:
            plan.running_chunk = None
            return num_chunk_new_block  # a running chunk on a decode node: its own blocks, no reservation
        return self.next._get_can_schedule_prefill_threshold_block(rm, num_chunk_new_block)


def _running_pass_asks_the_threshold(info) -> bool:
    """The line's running pass asks the reservation threshold for a running chunk: it has upstream's reserve seams
    (7783's running pass), read from the class. Elsewhere a running chunk is checked on its own blocks."""
    rm = info.rm_class
    return callable(getattr(rm, "_get_running_request_reserve_blocks", None)) and callable(
        getattr(rm, "_reset_reserve_on_preemption", None))


def _host_skips_it(info) -> bool:
    """The line cannot have the defect: its running pass checks a running chunk on its own blocks, or its threshold
    reads the node's role (upstream's fix returns the chunk's own blocks on a PD node; read from its code)."""
    if not _running_pass_asks_the_threshold(info):
        return True
    threshold = getattr(info.rm_class, "_get_can_schedule_prefill_threshold_block", None)
    return threshold is not None and "splitwise_role" in code_names(threshold)


def _running_chunk_threshold(info):
    if not _running_pass_asks_the_threshold(info):
        return None  # nothing to rely on: the fix is not applied there
    schedule = getattr(info.rm_class, "schedule", None)
    if schedule is None:
        return "ResourceManagerV1.schedule is missing"
    missing = {"get_new_block_nums", "_get_can_schedule_prefill_threshold_block",
               "can_allocate_gpu_blocks"} - code_names(schedule)
    if missing:
        return f"ResourceManagerV1.schedule no longer uses {', '.join(sorted(missing))}"
    return None


def _where_a_running_chunk_is_reserved(host_has: bool, settings):
    """The strategy where a running chunk's threshold carries a reservation: FastDeploy's own (``ratio_reserve``
    ``auto``) or the plugin's (``on``); the pre-change reservation (``off``) admits it on its own blocks."""
    if settings is not None and settings.change_mode("ratio_reserve") == "off":
        return None
    return DecodeNodeReserve


SPEC = PatchSpec(
    change_id="decode_node_reserve",
    title="A running prefill chunk on a PD decode node needs only its own blocks (upstream's ratio reservation)",
    upstream_prs=(),
    upstream_state="none",
    replaces=("ResourceManagerV1.get_new_block_nums", "ResourceManagerV1._get_can_schedule_prefill_threshold_block"),
    why=(
        "A decode node adds a prefilled request with one prefill token left; upstream's running pass admits that "
        "chunk only above every running request's reservation, so a preallocated burst stalls the node for good."
    ),
    how="On a decode node (role read once) a running request's prefill chunk is admitted on its own blocks.",
    hosts_needing="lines whose running pass asks the reservation for a running chunk (2.6 with 7783, develop)",
    switch="FDSCHED_DECODE_NODE_RESERVE",
    delete_when="every supported line has upstream's fix (PR 8022)",
    strategies={"ResourceManagerV1": {"plugin": Variant(_where_a_running_chunk_is_reserved, (DecodeNodeReserve,)),
                                      "host": None, "off": None}},
    host_has=_host_skips_it,
    relies_on=(
        Reliance(
            "running-chunk-threshold",
            "the running pass asks get_new_block_nums for a chunk, then the threshold for that count, then checks it "
            "with can_allocate_gpu_blocks",
            _running_chunk_threshold,
            when=("plugin",),
        ),
    ),
)

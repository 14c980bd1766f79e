"""Host fix — a PD prefill node reserves no decode blocks for its running requests.

Replaces:  ResourceManagerV1._get_running_request_reserve_blocks (0 on a prefill node; the role is read once, when
           the scheduler is built)
Why:       upstream's new_token_ratio reservation (PR 7444/7783, as merged) reserves, before a running request's next
           prefill chunk, every running request's future decode tokens, although a prefill node never decodes. On a
           prefill node ``preallocate_resource_in_p`` fills the pool without that check, a running prefill that needs
           0 new blocks is then refused because the free blocks do not cover the reservation, nothing is scheduled
           so the ratio never decays, and nothing finishes so nothing is freed: the node stalls for good.
Upstream:  none proposed by this project; FastDeploy's 2.6 head sets a prefill node's running-chunk threshold to 0
           in ``schedule()`` itself, which removes the defect there.
Needs it:  the lines with upstream's ratio reservation whose ``schedule()`` does not set that threshold to 0 (2.6
           with 7783 before the head, develop), read from ``schedule``'s bytecode.
Switch:    FDSCHED_PREFILL_NODE_RESERVE / changes.prefill_node_reserve = auto | on | off. It acts where FastDeploy's
           own reservation runs (``changes.ratio_reserve`` ``auto`` on a line that has it; the plugin's own
           reservation already reserves nothing for running requests on a prefill node), and on a prefill node only.
           A profile's ``changes.others`` does not set it; ``off`` keeps the host's reservation, to reproduce the stall.
Delete:    when FastDeploy reserves nothing for running requests on a prefill node on every supported line.
Relies on: (probed at install: ``on`` fails naming it; ``auto`` skips)
  * reserve-per-running-request: the host's reservation threshold sums
    ``_get_running_request_reserve_blocks(request)`` over the running requests.

How: the role is read once when the scheduler is built (``splitwise_role``); on a prefill node each running
request's reserve is 0, so a running chunk needs only its own new blocks; every other role gets the host's answer.
"""

from __future__ import annotations

from fdsched.patches._spec import PatchSpec, Reliance, Variant
from fdsched.patches._base import code_names, node_role, stores_constant


class PrefillNodeReserve:
    """The fix, one per scheduler (see :mod:`fdsched.patches._scheduler`); on every role but prefill it lets every
    call through and the scheduler leaves it out (``passes_all``: the role is fixed for the scheduler's life)."""

    seams = ("_get_running_request_reserve_blocks",)

    def __init__(self, rm, settings, next):
        self.passes_all = node_role(rm) != "prefill"

    def _get_running_request_reserve_blocks(self, rm, request) -> int:
        return 0  # a prefill node never decodes: nothing to reserve for a running request's output


def _has_no_ratio_reservation(info) -> bool:
    """The line has no per-request ratio reservation, so it cannot have this defect."""
    return not callable(getattr(info.rm_class, "_get_running_request_reserve_blocks", None))


def _host_skips_it(info) -> bool:
    """The line cannot have the defect: no ratio reservation, or its ``schedule`` sets the threshold of a running
    request's chunk to 0 itself (FastDeploy's 2.6 head does so on a prefill node; read from its bytecode)."""
    if _has_no_ratio_reservation(info):
        return True
    schedule = getattr(info.rm_class, "schedule", None)
    return schedule is not None and stores_constant(schedule, "can_schedule_block_num_threshold", 0)


def _reserve_per_running_request(info):
    if _has_no_ratio_reservation(info):
        return None  # nothing to rely on: the line cannot have the defect, and the fix is not applied there
    threshold = getattr(info.rm_class, "_get_can_schedule_prefill_threshold_block", None)
    if threshold is None:
        return "ResourceManagerV1._get_can_schedule_prefill_threshold_block is missing"
    if "_get_running_request_reserve_blocks" not in code_names(threshold):
        return ("ResourceManagerV1._get_can_schedule_prefill_threshold_block no longer uses "
                "_get_running_request_reserve_blocks")
    return None


def _where_the_host_reserves(host_has: bool, settings):
    """The strategy where FastDeploy's own ratio reservation runs (``ratio_reserve`` ``auto``); the plugin's own
    reservation (``on``) and the pre-change one (``off``) do not ask this seam for a prefill node's decode tokens."""
    if settings is not None and settings.change_mode("ratio_reserve") != "auto":
        return None
    return PrefillNodeReserve


SPEC = PatchSpec(
    change_id="prefill_node_reserve",
    title="No decode reservation on a PD prefill node (upstream's ratio reservation)",
    upstream_prs=(),
    upstream_state="none",
    replaces=("ResourceManagerV1._get_running_request_reserve_blocks",),
    why=(
        "Upstream's ratio reservation reserves running requests' future decode tokens on a prefill node, which never "
        "decodes; with the pool filled by preallocation a running prefill needing 0 blocks is refused for good."
    ),
    how="On a prefill node (role read once when the scheduler is built) each running request's reserve is 0.",
    hosts_needing="lines with upstream's ratio reservation (2.6 with 7783, develop)",
    switch="FDSCHED_PREFILL_NODE_RESERVE",
    delete_when="FastDeploy reserves nothing for running requests on a prefill node on every supported line",
    strategies={"ResourceManagerV1": {"plugin": Variant(_where_the_host_reserves, (PrefillNodeReserve,)), "host": None,
                                      "off": None}},
    host_has=_host_skips_it,
    relies_on=(
        Reliance(
            "reserve-per-running-request",
            "the reservation threshold sums _get_running_request_reserve_blocks over the running requests",
            _reserve_per_running_request,
            when=("plugin",),
        ),
    ),
)

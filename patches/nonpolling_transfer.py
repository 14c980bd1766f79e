"""Change 5 — the CPU prefix-cache transfer-done receiver waits instead of polling.

Replaces:  nothing yet — NOT IMPLEMENTED in this version: the probe reports it unavailable, so ``auto``
           skips it with a warning and ``on`` is an error. The plan: PrefixCacheManager.recv_data_transfer_result
           and the EngineCacheQueue transfer-done channel (server in a manager process the engine starts).
Why:       the host's receiver thread calls EngineCacheQueue.get_transfer_done_signal(), a BaseManager
           RPC over a locked list, every 1 ms, idle or not.
Upstream:  PR 7520 (closed: `or True` made the swap branch unreachable, a Process started from a
           thread, a second queue broke reset(wait_for_tasks_done=True), exceptions swallowed).
Needs it:  every 2.6 host.
Switch:    FDSCHED_NONPOLLING_TRANSFER = auto | on | off.
Delete:    when upstream ships a blocking transfer-done path.
"""

from __future__ import annotations

from . import PatchSpec
from ._base import PluginBase


class NonpollingTransferMixin(PluginBase):
    """Placeholder until the blocking receiver lands: the probe reports it as unavailable."""


def _not_yet(info):
    return "not implemented in this plugin version yet"


SPEC = PatchSpec(
    change_id="nonpolling_transfer",
    title="Non-polling CPU-cache transfer-done path",
    upstream_prs=(7520,),
    upstream_state="closed",
    replaces=(),
    requires={"PrefixCacheManager.recv_data_transfer_result": ()},
    why="The receiver polls an RPC every millisecond even when idle.",
    how="A server-side blocking queue; the receiver blocks on it; reset(wait_for_tasks_done=True) still sees pending results.",
    hosts_needing="all 2.6 hosts",
    switch="FDSCHED_NONPOLLING_TRANSFER",
    delete_when="upstream ships a blocking transfer-done path",
    mixins={"PrefixCacheManager": NonpollingTransferMixin},
    host_has=lambda info: False,
    extra_check=_not_yet,
)

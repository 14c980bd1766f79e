"""Change 4 — PD disaggregation: a prefill node records its blocks in the radix tree.

Replaces:  ResourceManagerV1.preallocate_resource_in_p, ResourceManagerV1._free_blocks (wrapper),
           PrefixCacheManager.update_cache_blocks (gate), PrefixCacheManager.__init__ (the gate, once); ``off``: a
           step after each ``schedule()`` pass records its chunks
Why:       with splitwise_role == "prefill" the prefix hit rate was low: blocks a prefill node
           computed did not reliably end up in its radix tree.
Upstream:  PR 7364, 2.6 cherry-pick 7387 (merged; in d38eeb8). Upstream records the
           whole prompt right after preallocation and skips the running-prefill update for the
           prefill role. Review concern: at preallocation the blocks past the cache hit are not
           computed, so another request can match KV that is not written yet.
Needs it:  2.6 before 7387 (e7c8dc2) for ``upstream``; every host for ``safe``.
Switch:    FDSCHED_PD_PREFILL_CACHE / changes.pd_prefill_cache = auto | on | off, and
           FDSCHED_PD_PREFILL_CACHE_MODE / pd_prefill_cache.mode = safe (default) | upstream.
           ``auto`` with ``safe`` applies the plugin on both hosts (neither host has the safe
           behaviour); ``auto`` with ``upstream`` leaves a host with 7387 alone.
Delete:    when every supported host records only computed blocks on prefill nodes.
Relies on: (probed at install: ``on``, or ``off`` on a host with the change, fails naming it; ``auto`` skips)
  * record-moments: the host records blocks by calling ``cache_manager.update_cache_blocks`` only from inside
    ``schedule()`` (per chunk) and ``preallocate_resource_in_p`` (for the request it preallocates), and releases
    a finished request's blocks through ``_free_blocks`` (called from ``finish_requests``).

How, for the prefill role only (other roles are untouched): three moments can record blocks (at preallocation,
per scheduled chunk, when the prefill is done); ``off`` records the cache hit and each chunk, ``upstream`` the
whole prompt at preallocation, ``safe`` the cache hit and then the whole prompt at finish. The prefix cache's gate
tells the host's two moments apart by the request (one whose preallocation is under way), not by the caller, and
lets a record through only when the selected behaviour records then; the plugin's own record at finish calls the
host's recording directly. Each scheduler and cache manager holds one strategy pair per behaviour and host
(``SPEC.strategies``), chosen once. The table of moments and of strategies: docs/internals.md, "pd_prefill_cache".
"""

from __future__ import annotations

from fdsched.patches._spec import PatchSpec, Reliance, Variant
from fdsched.patches._base import node_role

PREALLOCATION, CHUNK = "preallocation", "chunk"


def preallocating(cache_manager) -> set:
    """Ids of the requests whose preallocation is under way on ``cache_manager``: its gate's own set, made when the
    cache manager was built (nothing is added to the cache manager later)."""
    return cache_manager.fdsched_gate.preallocating


# ---- the prefix cache's gate: which of the host's own records pass, per behaviour -----------------------------
class RecordGate:
    """The gate on a prefill node (one per cache manager; ``next`` records: the host's own); the base and the
    ``safe`` behaviour: none of the host's records pass. On every other role each record passes."""

    seams = ("update_cache_blocks",)
    allowed: frozenset = frozenset()  # the host's moments whose records pass

    def __init__(self, cm, settings, next):
        self.next = next
        self.preallocating: set = set()  # marked by the scheduler for the duration of a preallocation
        # The role is fixed for the manager's life: only a prefill node's records go through the gate.
        self.prefill_node = getattr(cm, "splitwise_role", None) == "prefill"

    @property
    def passes_all(self) -> bool:
        """Every record passes (not a prefill node): the cache manager leaves the gate out of its recording."""
        return not self.prefill_node

    def update_cache_blocks(self, cm, task, block_size, num_computed_tokens):
        if self.prefill_node:
            moment = PREALLOCATION if task.request_id in self.preallocating else CHUNK
            if moment not in self.allowed:
                return None  # these blocks' KV is not written yet under the selected behaviour
        return self.next.update_cache_blocks(cm, task, block_size, num_computed_tokens)

    def record_blocks(self, cm, task, block_size, num_computed_tokens):
        """The plugin's own record (past the gate): the host's recording of ``task``'s blocks up to
        ``num_computed_tokens``."""
        return self.next.update_cache_blocks(cm, task, block_size, num_computed_tokens)


class UpstreamRecordGate(RecordGate):
    """``upstream``: the host's preallocation record passes (the whole prompt, on a host that has the change)."""

    allowed = frozenset({PREALLOCATION})


class PreChangeRecordGate(RecordGate):
    """``off`` on a host that has the change: the host's chunk records pass, as before it."""

    allowed = frozenset({CHUNK})


# ---- the scheduler's side: the marks the gate reads, and the plugin's own records -----------------------------
class PdRecording:
    """The base, and ``upstream`` on a host that has the change (the host records; the plugin only marks each
    preallocation for the gate). One per scheduler; on every role but prefill it lets every call through and the
    scheduler leaves it out (``passes_all``: the role is fixed for the scheduler's life)."""

    seams = ("preallocate_resource_in_p",)
    fdsched_calls = {"PrefixCacheManager.update_cache_blocks": ("task", "block_size", "num_computed_tokens")}
    fdsched_attributes = ("config", "cache_manager", "lock")

    def __init__(self, rm, settings, next):
        self.next = next
        self.passes_all = node_role(rm) != "prefill"

    def preallocate_resource_in_p(self, rm, request):
        marks = preallocating(rm.cache_manager)
        marks.add(request.request_id)
        try:
            allocated = self.next.preallocate_resource_in_p(rm, request)
        finally:
            marks.discard(request.request_id)
        if allocated:
            self.preallocated(rm, request)
        return allocated

    def preallocated(self, rm, request) -> None:
        """After a successful preallocation on a prefill node: what this behaviour records itself (nothing)."""

    @staticmethod
    def record(rm, request, num_tokens, locked=False):
        if not rm.config.cache_config.enable_prefix_caching:  # the host's own flag, read when the host reads it
            return
        block_size = rm.config.cache_config.block_size
        gate = rm.cache_manager.fdsched_gate
        if locked:  # the caller holds the scheduler lock already
            gate.record_blocks(rm.cache_manager, request, block_size, num_tokens)
        else:
            with rm.lock:
                gate.record_blocks(rm.cache_manager, request, block_size, num_tokens)


class PdUpstreamRecord(PdRecording):
    """``upstream`` on a host without the change: the whole prompt recorded right after preallocation."""

    def preallocated(self, rm, request) -> None:
        self.record(rm, request, request.need_prefill_tokens)


class PdSafe(PdRecording):
    """``safe``: the whole prompt recorded once the prefill has run (its first token came back), before the
    host releases the blocks."""

    seams = ("preallocate_resource_in_p", "_free_blocks")

    def _free_blocks(self, rm, request):
        if request.status == rm._fdsched_statuses.FINISHED and request.num_computed_tokens >= request.need_prefill_tokens:
            self.record(rm, request, request.need_prefill_tokens, locked=True)
        return self.next._free_blocks(rm, request)


class PdPreChange(PdRecording):
    """``off`` on a host that has the change: the pre-change recording, which also recorded every running
    chunk of a prefill node (a host with the change records only a new request's first chunk there)."""

    def pass_result(self, rm, result) -> None:
        """After a pass that returned: its final task list's chunks recorded."""
        from fastdeploy.engine.request import Request

        for task in result[0]:
            if isinstance(task, Request):
                self.record(rm, task, task.num_computed_tokens)


def _mode(settings) -> str:
    return "safe" if settings is None else settings["pd_prefill_cache.mode"]  # safe: the setting's default


def _plugin_recording(host_has: bool, settings):
    if _mode(settings) == "safe":
        return PdSafe
    return PdRecording if host_has else PdUpstreamRecord


def _plugin_gate(host_has: bool, settings):
    return RecordGate if _mode(settings) == "safe" else UpstreamRecordGate


def _has_pd_record(info) -> bool:
    if not callable(getattr(info.rm_class, "preallocate_resource_in_p", None)):
        return False  # a host without PD preallocation has neither behaviour
    from fdsched.patches._base import code_names

    return "update_cache_blocks" in code_names(info.rm_class.preallocate_resource_in_p)


def _record_moments(info):
    from fdsched.patches._base import code_names

    if "update_cache_blocks" not in code_names(info.rm_class.schedule):
        return "ResourceManagerV1.schedule no longer calls update_cache_blocks"
    if "_free_blocks" not in code_names(info.rm_class.finish_requests):
        return "ResourceManagerV1.finish_requests no longer calls _free_blocks"
    return None


def _as_selected(settings, host_has_upstream: bool) -> bool:
    # No host has the safe behaviour; a host with 7387 has upstream's.
    return host_has_upstream and settings["pd_prefill_cache.mode"] == "upstream"


SPEC = PatchSpec(
    change_id="pd_prefill_cache",
    title="PD prefill-node prefix-cache recording (upstream or safe)",
    upstream_prs=(7364, 7387),
    upstream_state="merged",
    replaces=(
        "PrefixCacheManager.__init__",
        "ResourceManagerV1.preallocate_resource_in_p",
        "ResourceManagerV1._free_blocks",
        "PrefixCacheManager.update_cache_blocks",
    ),
    why="Prefill nodes had a low prefix hit rate; upstream's fix records KV that is not computed yet.",
    how="upstream: record the whole prompt at preallocation; safe: the cache hit at preallocation, the rest "
    "once the prefill has run (at finish, before the blocks are released).",
    hosts_needing="2.6 before PR 7387 (e7c8dc2) for upstream; every host for safe",
    switch="FDSCHED_PD_PREFILL_CACHE",
    delete_when="every supported host records only computed blocks on prefill nodes",
    host_has=_has_pd_record,
    host_has_as_selected=_as_selected,
    # off: only on a host that has the change (elsewhere off is the host's own code: impl "host")
    strategies={"PrefixCacheManager": {"plugin": Variant(_plugin_gate, (RecordGate, UpstreamRecordGate)),
                                       "off": PreChangeRecordGate, "host": None},
                "ResourceManagerV1": {"plugin": Variant(_plugin_recording, (PdRecording, PdUpstreamRecord, PdSafe)),
                                      "off": PdPreChange, "host": None}},
    relies_on=(
        Reliance("record-moments", "the host records blocks with update_cache_blocks only inside schedule() and "
                 "preallocate_resource_in_p (for the request it preallocates), and finish_requests frees through "
                 "_free_blocks",
                 _record_moments),
    ),
)

"""Change 4 — PD disaggregation: a prefill node records its blocks in the radix tree.

Replaces:  ResourceManagerV1.preallocate_resource_in_p, ResourceManagerV1.schedule (wrapper),
           ResourceManagerV1._free_blocks (wrapper), PrefixCacheManager.update_cache_blocks (gate)
Why:       with splitwise_role == "prefill" the prefix hit rate was low: blocks a prefill node
           computed did not reliably end up in its radix tree.
Upstream:  PR 7364, 2.6 cherry-pick 7387 (merged; in the "new host" d38eeb8). Upstream records the
           whole prompt right after preallocation and skips the running-prefill update for the
           prefill role. Review concern: at preallocation the blocks past the cache hit are not
           computed, so another request can match KV that is not written yet.
Needs it:  2.6 before 7387 (old host e7c8dc2) for ``upstream``; every host for ``safe``.
Switch:    FDSCHED_PD_PREFILL_CACHE / changes.pd_prefill_cache = auto | on | off, and
           FDSCHED_PD_PREFILL_CACHE_MODE / pd_prefill_cache.mode = safe (default) | upstream.
           ``auto`` with ``safe`` applies the plugin on both hosts (neither host has the safe
           behaviour); ``auto`` with ``upstream`` leaves the new host's own code alone.
Delete:    when every supported host records only computed blocks on prefill nodes.
Relies on: (probed at install: ``on``, or ``off`` on the new host, fails naming it; ``auto`` skips)
  * record-moments: the host records blocks by calling ``cache_manager.update_cache_blocks`` from inside
    ``schedule()`` (per chunk) and ``preallocate_resource_in_p``, on the calling thread, and releases a
    finished request's blocks through ``_free_blocks`` (called from ``finish_requests``).

How, for the prefill role only (other roles are untouched). Three moments can record blocks:

============  =======================  ========================  =================================
behaviour     at preallocation         per scheduled chunk       when the prefill is done (finish)
============  =======================  ========================  =================================
off           the cache hit only       up to num_computed_tokens nothing more
upstream      the whole prompt         nothing                   nothing more
safe          the cache hit only       nothing                   the whole prompt
============  =======================  ========================  =================================

The resource manager marks which moment a call to ``update_cache_blocks`` belongs to (a thread-local
context, since preallocation and scheduling run on different threads); the prefix cache's gate lets
a call through only when the selected behaviour records at that moment. Calls outside these moments
(every other role, every other caller) pass through untouched.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from fdsched.patches._spec import PatchSpec, Reliance
from fdsched.patches._base import PluginBase

_CONTEXT = threading.local()

PREALLOCATION, CHUNK, RECORD = "preallocation", "chunk", "record"


@contextmanager
def _moment(name: str):
    previous = getattr(_CONTEXT, "moment", None)
    _CONTEXT.moment = name
    try:
        yield
    finally:
        _CONTEXT.moment = previous


_ALLOWED = {
    "off": {CHUNK, RECORD},
    "upstream": {PREALLOCATION, RECORD},
    "safe": {RECORD},
}


class _Recording(PluginBase):
    def _fdsched_recording(self) -> str:
        """The behaviour this arm runs: the profile's mode ('upstream' or 'safe'); the ``off`` variant: 'off'."""
        return self._fdsched_settings["pd_prefill_cache.mode"]


class _PreChangeRecording(PluginBase):
    def _fdsched_recording(self) -> str:
        return "off"  # the pre-change recording, restored on a host that has the change


class PdPrefillCacheManagerMixin(_Recording):
    def update_cache_blocks(self, task, block_size, num_computed_tokens):
        moment = getattr(_CONTEXT, "moment", None)
        if moment is not None and moment not in _ALLOWED[self._fdsched_recording()]:
            return None  # these blocks' KV is not written yet under the selected behaviour
        return super().update_cache_blocks(task, block_size, num_computed_tokens)


class PdPrefillCacheMixin(_Recording):
    def _fdsched_pd_behaviour(self):
        if self.config.scheduler_config.splitwise_role != "prefill":
            return None
        return self._fdsched_recording()

    def preallocate_resource_in_p(self, request):
        behaviour = self._fdsched_pd_behaviour()
        if behaviour is None:
            return super().preallocate_resource_in_p(request)
        with _moment(PREALLOCATION):
            allocated = super().preallocate_resource_in_p(request)
        host_records_here = self._fdsched_host.has["pd_prefill_cache"]
        if allocated and behaviour == "upstream" and not host_records_here:
            self._fdsched_record(request, request.need_prefill_tokens)
        return allocated

    def schedule(self):
        behaviour = self._fdsched_pd_behaviour()
        if behaviour is None:
            return super().schedule()
        with _moment(CHUNK):
            result = super().schedule()
        if behaviour == "off" and self._fdsched_host.has["pd_prefill_cache"]:
            # The new host no longer updates the tree per chunk on a prefill node; do it as the old host did.
            from fastdeploy.engine.request import Request

            for task in result[0]:
                if isinstance(task, Request):
                    self._fdsched_record(task, task.num_computed_tokens)
        return result

    def _free_blocks(self, request):
        behaviour = self._fdsched_pd_behaviour()
        if (
            behaviour == "safe"
            and request.status == self._fdsched_host.request_status.FINISHED
            and request.num_computed_tokens >= request.need_prefill_tokens
        ):
            # The prefill has run (its first token came back): now its KV is written; record it.
            self._fdsched_record(request, request.need_prefill_tokens, locked=True)
        return super()._free_blocks(request)

    def _fdsched_record(self, request, num_tokens, locked=False):
        if not self.config.cache_config.enable_prefix_caching:
            return
        block_size = self.config.cache_config.block_size
        with _moment(RECORD):
            if locked:  # the caller holds the scheduler lock already
                self.cache_manager.update_cache_blocks(request, block_size, num_tokens)
            else:
                with self.lock:
                    self.cache_manager.update_cache_blocks(request, block_size, num_tokens)


class PdPrefillCacheManagerOffMixin(_PreChangeRecording, PdPrefillCacheManagerMixin):
    """``off`` on a host that has the change: the pre-change recording."""


class PdPrefillCacheOffMixin(_PreChangeRecording, PdPrefillCacheMixin):
    """``off`` on a host that has the change: the pre-change recording."""


def _has_pd_record(info) -> bool:
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
    # Neither host has the safe behaviour; the new host has upstream's.
    return host_has_upstream and settings["pd_prefill_cache.mode"] == "upstream"


SPEC = PatchSpec(
    change_id="pd_prefill_cache",
    title="PD prefill-node prefix-cache recording (upstream or safe)",
    upstream_prs=(7364, 7387),
    upstream_state="merged",
    replaces=(
        "ResourceManagerV1.preallocate_resource_in_p",
        "ResourceManagerV1.schedule",
        "ResourceManagerV1._free_blocks",
        "PrefixCacheManager.update_cache_blocks",
    ),
    requires={
        "ResourceManagerV1.preallocate_resource_in_p": ("request",),
        "ResourceManagerV1._free_blocks": ("request",),
        "ResourceManagerV1.schedule": (),
        "PrefixCacheManager.update_cache_blocks": ("task", "block_size", "num_computed_tokens"),
    },
    why="Prefill nodes had a low prefix hit rate; upstream's fix records KV that is not computed yet.",
    how="upstream: record the whole prompt at preallocation; safe: the cache hit at preallocation, the rest "
    "once the prefill has run (at finish, before the blocks are released).",
    hosts_needing="2.6 before PR 7387 (old host e7c8dc2) for upstream; every host for safe",
    switch="FDSCHED_PD_PREFILL_CACHE",
    delete_when="every supported host records only computed blocks on prefill nodes",
    mixins={"ResourceManagerV1": PdPrefillCacheMixin, "PrefixCacheManager": PdPrefillCacheManagerMixin},
    host_has=_has_pd_record,
    host_has_as_selected=_as_selected,
    variants={
        "plugin": {"ResourceManagerV1": PdPrefillCacheMixin, "PrefixCacheManager": PdPrefillCacheManagerMixin},
        "off": {"ResourceManagerV1": PdPrefillCacheOffMixin, "PrefixCacheManager": PdPrefillCacheManagerOffMixin},
    },
    relies_on=(
        Reliance("record-moments", "the host records blocks with update_cache_blocks inside schedule() and "
                 "preallocate_resource_in_p on the calling thread, and finish_requests frees through _free_blocks",
                 _record_moments),
    ),
)
